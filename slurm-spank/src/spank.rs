//! The SPANK plugin: the symbols Slurm looks up in `rfaas_spank.so`.
//!
//! Slurm's declarations come from [`crate::ffi`], generated at build time
//! from the installed `<slurm/spank.h>`, and `plugin_version` is that
//! build's `SLURM_VERSION_NUMBER` (Slurm refuses a plugin whose major and
//! minor release differ from its own). The functions are resolved from the
//! process that loads the plugin (srun, sbatch, salloc, slurmd,
//! slurmstepd); nothing is linked. When slurmd loads it, the plugin logs
//! the Slurm release it was built for; see `docs/slurm.md`.
//!
//! Every callback runs inside [`guarded`]: a panic is logged through Slurm
//! and the callback returns success, so no panic crosses into C and no job
//! fails because of rfaas.

#![allow(non_upper_case_globals)]

use std::ffi::{c_char, c_int, c_uint, CStr, CString};
use std::io::Write;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::OnceLock;

use crate::ffi::{
    self, slurm_error, slurm_info, spank_context_t, spank_f, spank_opt_cb_f, spank_option,
    ESPANK_SUCCESS, S_CTX_ALLOCATOR, S_CTX_LOCAL, S_CTX_REMOTE, S_CTX_SLURMD, S_JOB_ID, S_JOB_UID,
    S_SLURM_VERSION, S_TASK_ID,
};
use crate::hook::{self, guarded, Event, Log, Logger};
use crate::job::JobOnNode;
use crate::settings::{RfaasChoice, Settings};

/// `SLURM_VERSION_NUMBER` of the Slurm headers the plugin was built from
/// (Slurm loads it only under a release of the same major and minor).
pub const SLURM_VERSION_NUMBER: c_uint = ffi::SLURM_VERSION_NUMBER;

/// That release as Slurm writes it (`22.05.8`), and where its headers were.
const BUILT_FOR: &str = env!("BUILT_FOR_SLURM");
const HEADERS: &str = env!("BUILT_FROM_SLURM_HEADERS");

/// `spank_t`, an opaque handle.
type Spank = ffi::spank_t;

/// The option table entry as a static: its pointers are to static strings.
struct StaticOption(spank_option);

// SAFETY: the option is never written after its definition and points only
// at 'static C strings; Slurm reads it, and may from any thread.
unsafe impl Sync for StaticOption {}

// The entry points have the type `spank.h` declares for them.
const _: [spank_f; 5] = [
    Some(slurm_spank_init),
    Some(slurm_spank_init_post_opt),
    Some(slurm_spank_job_prolog),
    Some(slurm_spank_job_epilog),
    Some(slurm_spank_task_init),
];
const _: spank_opt_cb_f = Some(check_rfaas_option);

/// The plugin's name, as Slurm logs it.
#[no_mangle]
pub static plugin_name: [u8; 12] = *b"rfaas_spank\0";

/// What kind of plugin this is.
#[no_mangle]
pub static plugin_type: [u8; 6] = *b"spank\0";

/// The Slurm release the plugin is built for.
#[no_mangle]
pub static plugin_version: c_uint = SLURM_VERSION_NUMBER;

/// `--rfaas[=yes|no]` on srun, sbatch and salloc.
// `spank.h` declares the strings `char *`; Slurm only reads them.
static RFAAS_OPTION: StaticOption = StaticOption(spank_option {
    name: c"rfaas".as_ptr() as *mut c_char,
    arginfo: c"yes|no".as_ptr() as *mut c_char,
    usage: c"Let the job offload functions to rfaas on idle nodes (--rfaas=no: not even where the site turns rfaas on for every job)".as_ptr() as *mut c_char,
    has_arg: 2,
    val: 0,
    cb: Some(check_rfaas_option),
});

fn option_ptr() -> *mut spank_option {
    // Slurm's prototypes take a mutable pointer; it only reads the option.
    &RFAAS_OPTION.0 as *const spank_option as *mut spank_option
}

/// Logs through Slurm: in srun and sbatch to the user's terminal, in
/// slurmd and the job's prolog and epilog to slurmd's log.
#[derive(Debug)]
struct SlurmLog;

fn c_line(line: &str) -> CString {
    CString::new(format!("rfaas_spank: {}", line.replace('\0', " ")))
        .unwrap_or_else(|_| CString::from(c"rfaas_spank: (unprintable line)"))
}

impl Log for SlurmLog {
    fn info(&self, line: &str) {
        let line = c_line(line);
        // SAFETY: slurm_info is printf-like; the format takes one C string,
        // which lives until the call returns.
        unsafe { slurm_info(c"%s".as_ptr(), line.as_ptr()) }
    }

    fn error(&self, line: &str) {
        let line = c_line(line);
        // SAFETY: as in `info`.
        unsafe { slurm_error(c"%s".as_ptr(), line.as_ptr()) }
    }
}

/// The plugin's `key=value` arguments from plugstack.conf.
///
/// # Safety
///
/// `av` holds `ac` valid C strings (Slurm's argument vector), or is null.
unsafe fn words(ac: c_int, av: *const *const c_char) -> Vec<String> {
    if av.is_null() || ac <= 0 {
        return Vec::new();
    }
    (0..ac as usize)
        .filter_map(|i| {
            // SAFETY: i < ac, and av has ac entries (the caller's promise).
            let p = unsafe { *av.add(i) };
            // SAFETY: each non-null entry is a C string (the caller's promise).
            (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
        })
        .collect()
}

/// A copy of C string `p`, `None` for null.
///
/// # Safety
///
/// `p` is null or a valid C string.
unsafe fn owned(p: *const c_char) -> Option<String> {
    if p.is_null() {
        return None;
    }
    // SAFETY: not null, and a C string (the caller's promise).
    Some(unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
}

fn context() -> spank_context_t {
    // SAFETY: takes nothing, valid in every callback.
    unsafe { ffi::spank_context() }
}

/// `slurm_spank_init`: registers `--rfaas` where jobs are submitted and
/// run; in slurmd, reports the arguments it cannot take.
///
/// # Safety
///
/// Called by Slurm with its handle and the plugin's arguments.
#[no_mangle]
pub unsafe extern "C" fn slurm_spank_init(sp: Spank, ac: c_int, av: *mut *mut c_char) -> c_int {
    // SAFETY: Slurm's argument vector.
    let words = unsafe { words(ac, av as *const *const c_char) };
    guarded("init", &SlurmLog, 0, || {
        let (settings, bad) = Settings::parse(words.iter().map(String::as_str));
        let log = Logger::new(&SlurmLog, &settings);
        match context() {
            S_CTX_LOCAL | S_CTX_REMOTE | S_CTX_ALLOCATOR => {
                // SAFETY: a valid handle in init; the option is static.
                let rc = unsafe { ffi::spank_option_register(sp, option_ptr()) };
                if rc != ESPANK_SUCCESS {
                    log.error(&format!(
                        "cannot register --rfaas (error {rc}); jobs run without it"
                    ));
                }
            }
            // Once per slurmd start: where the administrator looks.
            S_CTX_SLURMD => {
                log_loaded(sp);
                hook::report_bad_words(&log, &bad);
            }
            _ => {}
        }
        0
    })
}

/// The line slurmd logs when it loads the plugin: which rfaas, built for
/// which Slurm, from which headers, and the Slurm running it when Slurm
/// tells (a mismatch there is the first thing to look at).
fn loaded_line(running: Option<&str>) -> String {
    let mut line = format!(
        "rfaas_spank {} built for Slurm {BUILT_FOR} (headers {HEADERS})",
        env!("CARGO_PKG_VERSION")
    );
    if let Some(running) = running {
        line.push_str(&format!(", running under Slurm {running}"));
    }
    line
}

fn log_loaded(sp: Spank) {
    let mut version: *const c_char = std::ptr::null();
    // SAFETY: S_SLURM_VERSION takes one `char **`, which lives through the
    // call; Slurm points it at its own static string (or leaves it null).
    let rc =
        unsafe { ffi::spank_get_item(sp, S_SLURM_VERSION, &mut version as *mut *const c_char) };
    // SAFETY: null or Slurm's static C string.
    let running = (rc == ESPANK_SUCCESS)
        .then(|| unsafe { owned(version) })
        .flatten();
    let line = CString::new(loaded_line(running.as_deref()).replace('\0', " "))
        .unwrap_or_else(|_| CString::from(c"rfaas_spank: (unprintable version line)"));
    // SAFETY: slurm_info is printf-like; the format takes one C string,
    // which lives until the call returns.
    unsafe { slurm_info(c"%s".as_ptr(), line.as_ptr()) }
}

/// What `--rfaas` said in this srun, sbatch or salloc: 0 nothing, 1 yes,
/// 2 no. An atomic, not a lock: nothing can be left poisoned.
static CHOICE: AtomicU8 = AtomicU8::new(0);

/// The job control variable carrying the choice to the job's prolog and
/// epilog (which see it as `SPANK_RFAAS`) and its steps (whose
/// environment has it as `SLURM_SPANK_RFAAS`): Slurm does not pass an
/// optional argument's absence there, so the plugin says it in words.
const CHOICE_VAR: &CStr = c"RFAAS";

/// Checks `--rfaas`'s argument where the user gives it, and keeps it for
/// `init_post_opt`.
unsafe extern "C" fn check_rfaas_option(
    _val: c_int,
    optarg: *const c_char,
    _remote: c_int,
) -> c_int {
    guarded("--rfaas", &SlurmLog, 0, || {
        // SAFETY: optarg is null or Slurm's C string for this call.
        let arg = unsafe { owned(optarg) };
        match RfaasChoice::parse(arg.as_deref()) {
            Ok(choice) => {
                CHOICE.store(
                    if choice == RfaasChoice::Yes { 1 } else { 2 },
                    Ordering::Relaxed,
                );
                0
            }
            Err(e) => {
                SlurmLog.error(&e);
                -1
            }
        }
    })
}

/// `slurm_spank_init_post_opt`: in srun, sbatch and salloc, hands the
/// job's `--rfaas` choice to its prolog and epilog; in the job step on a
/// node (slurmstepd, still as root), puts the job's rfaas environment into
/// the step's tasks when the job asked for rfaas.
///
/// # Safety
///
/// Called by Slurm with its handle and the plugin's arguments.
#[no_mangle]
pub unsafe extern "C" fn slurm_spank_init_post_opt(
    sp: Spank,
    ac: c_int,
    av: *mut *mut c_char,
) -> c_int {
    // SAFETY: Slurm's argument vector.
    let words = unsafe { words(ac, av as *const *const c_char) };
    guarded("init_post_opt", &SlurmLog, 0, || {
        if context() == S_CTX_REMOTE {
            step_env(sp, &words);
            return 0;
        }
        if !matches!(context(), S_CTX_LOCAL | S_CTX_ALLOCATOR) {
            return 0;
        }
        let value = match CHOICE.load(Ordering::Relaxed) {
            1 => c"yes",
            2 => c"no",
            _ => return 0,
        };
        // SAFETY: a valid handle in init_post_opt; both strings are static.
        let rc =
            unsafe { ffi::spank_job_control_setenv(sp, CHOICE_VAR.as_ptr(), value.as_ptr(), 1) };
        if rc != ESPANK_SUCCESS {
            SlurmLog.error(&format!(
                "cannot hand --rfaas to the job (error {rc}); the site's default applies"
            ));
        }
        0
    })
}

/// `slurm_spank_job_prolog`: the job starts on this node; take the node's
/// CPUs back from rfaas within the grace. Always succeeds.
///
/// # Safety
///
/// Called by Slurm with its handle and the plugin's arguments.
#[no_mangle]
pub unsafe extern "C" fn slurm_spank_job_prolog(
    sp: Spank,
    ac: c_int,
    av: *mut *mut c_char,
) -> c_int {
    // SAFETY: Slurm's argument vector and handle.
    unsafe { job_script(Event::Prolog, sp, ac, av) };
    0
}

/// `slurm_spank_job_epilog`: the job ended on this node; offer the node's
/// idle CPUs to rfaas. Always succeeds.
///
/// # Safety
///
/// Called by Slurm with its handle and the plugin's arguments.
#[no_mangle]
pub unsafe extern "C" fn slurm_spank_job_epilog(
    sp: Spank,
    ac: c_int,
    av: *mut *mut c_char,
) -> c_int {
    // SAFETY: Slurm's argument vector and handle.
    unsafe { job_script(Event::Epilog, sp, ac, av) };
    0
}

/// # Safety
///
/// `sp` is Slurm's handle in a job_prolog or job_epilog callback; `av`
/// holds `ac` C strings.
unsafe fn job_script(event: Event, sp: Spank, ac: c_int, av: *mut *mut c_char) {
    // SAFETY: Slurm's argument vector.
    let words = unsafe { words(ac, av as *const *const c_char) };
    let name = match event {
        Event::Prolog => "job_prolog",
        Event::Epilog => "job_epilog",
    };
    guarded(name, &SlurmLog, (), || {
        let (settings, bad) = Settings::parse(words.iter().map(String::as_str));
        let log = Logger::new(&SlurmLog, &settings);
        hook::report_bad_words(&log, &bad);
        let mut job = JobOnNode::from_env(|k| std::env::var(k).ok());
        let mut id: u32 = 0;
        // SAFETY: S_JOB_ID takes one uint32_t *, which lives through the call.
        if unsafe { ffi::spank_get_item(sp, S_JOB_ID, &mut id as *mut u32) } == ESPANK_SUCCESS {
            job.job_id = u64::from(id);
        }
        if event == Event::Prolog && wants_rfaas(sp, std::env::var("SPANK_RFAAS").ok(), &settings) {
            log.info(&format!("job {} asks for rfaas", job.job_id));
        }
        hook::run(event, &settings, &job, &log);
    });
}

/// Whether the job wants rfaas: what `--rfaas` said (as an option, or as
/// the choice handed on in `SPANK_RFAAS`), else the site's default.
fn wants_rfaas(sp: Spank, said: Option<String>, settings: &Settings) -> bool {
    let choice = match said.as_deref() {
        Some(v) => RfaasChoice::parse(Some(v)).ok(),
        None => rfaas_choice(sp),
    };
    decide(choice, settings)
}

/// A choice made, or the site's default.
fn decide(choice: Option<RfaasChoice>, settings: &Settings) -> bool {
    match choice {
        Some(choice) => choice == RfaasChoice::Yes,
        None => settings.rfaas_by_default,
    }
}

/// What `--rfaas` said to this process, as its option callback kept it.
///
/// In a job step (slurmstepd) Slurm runs the callback with the step's own
/// options before `init_post_opt`, where `spank_option_getopt` is not
/// available: this is how a step started by a plain `srun --rfaas` knows.
fn own_choice() -> Option<RfaasChoice> {
    match CHOICE.load(Ordering::Relaxed) {
        1 => Some(RfaasChoice::Yes),
        2 => Some(RfaasChoice::No),
        _ => None,
    }
}

/// In a job step: the job's rfaas environment, if it wants rfaas.
///
/// The step's own `--rfaas` (srun's, or the one an allocation's srun
/// inherits) decides first; then the choice `sbatch` or `salloc` handed on,
/// which reaches the step's environment as `SLURM_SPANK_RFAAS`; then the
/// site's default. Whenever the step wants rfaas and gets no environment,
/// one line says why, on the job's standard error and in slurmd's log.
fn step_env(sp: Spank, words: &[String]) {
    let (settings, _) = Settings::parse(words.iter().map(String::as_str));
    let log = Logger::new(&SlurmLog, &settings);
    let choice = own_choice().or_else(|| {
        job_getenv(sp, c"SLURM_SPANK_RFAAS").and_then(|v| RfaasChoice::parse(Some(&v)).ok())
    });
    if !decide(choice, &settings) {
        return;
    }
    let (mut id, mut uid): (u32, u32) = (0, u32::MAX);
    // SAFETY: S_JOB_ID takes one uint32_t * and S_JOB_UID one uid_t *
    // (32 bits on Linux); both live through the calls.
    let known = unsafe {
        ffi::spank_get_item(sp, S_JOB_ID, &mut id as *mut u32) == ESPANK_SUCCESS
            && ffi::spank_get_item(sp, S_JOB_UID, &mut uid as *mut u32) == ESPANK_SUCCESS
    };
    if !known {
        let line = hook::no_env_line(
            u64::from(id),
            "Slurm does not tell this step its job or its user",
        );
        log.error(&line);
        let _ = UNSERVED.set(line);
        return;
    }
    // slurmstepd's own environment, which it sets from slurmd's
    // configuration at start; never the job's, which the user writes.
    let node = std::env::var("SLURMD_NODENAME")
        .ok()
        .filter(|n| !n.is_empty());
    let vars = match hook::job_env(&settings, node.as_deref(), u64::from(id), uid, &log) {
        Ok(vars) => vars,
        Err(line) => {
            let _ = UNSERVED.set(line);
            return;
        }
    };
    for (name, value) in vars {
        let (Ok(n), Ok(v)) = (CString::new(name.as_str()), CString::new(value)) else {
            log.error(&format!("job {id}: {name} holds a NUL byte; not set"));
            continue;
        };
        // SAFETY: a valid handle in a remote callback; both strings live
        // through the call.
        let rc = unsafe { ffi::spank_setenv(sp, n.as_ptr(), v.as_ptr(), 1) };
        if rc != ESPANK_SUCCESS {
            log.error(&format!("job {id}: cannot set {name} (error {rc})"));
        }
    }
}

/// Why this step wanted rfaas and runs without it, if so: said again on
/// the job's standard error by [`slurm_spank_task_init`]. Set once, in
/// slurmstepd, before it forks the tasks, which inherit it.
static UNSERVED: OnceLock<String> = OnceLock::new();

/// `slurm_spank_task_init`: in each task of a step, just before it runs
/// the user's program, with its standard error set up. If the step asked
/// for rfaas and got no environment, the node's first task says why there
/// (slurmstepd's own log lines reach only slurmd's log). Always succeeds.
///
/// # Safety
///
/// Called by Slurm with its handle and the plugin's arguments.
#[no_mangle]
pub unsafe extern "C" fn slurm_spank_task_init(
    sp: Spank,
    _ac: c_int,
    _av: *mut *mut c_char,
) -> c_int {
    guarded("task_init", &SlurmLog, 0, || {
        let Some(line) = UNSERVED.get() else {
            return 0;
        };
        let mut task: c_int = -1;
        // SAFETY: S_TASK_ID takes one int *, which lives through the call.
        let rc = unsafe { ffi::spank_get_item(sp, S_TASK_ID, &mut task as *mut c_int) };
        if rc == ESPANK_SUCCESS && task == 0 {
            // One write, so it does not mix with other tasks' output.
            let _ = std::io::stderr().write_all(format!("rfaas_spank: {line}\n").as_bytes());
        }
        0
    })
}

/// A variable of the job's environment, if set (and under 4 KiB).
fn job_getenv(sp: Spank, name: &CStr) -> Option<String> {
    let mut buf = vec![0u8; 4096];
    // SAFETY: a valid handle; Slurm writes at most `len` bytes, NUL
    // included, into the buffer, which lives through the call.
    let rc = unsafe {
        ffi::spank_getenv(
            sp,
            name.as_ptr(),
            buf.as_mut_ptr() as *mut c_char,
            buf.len() as c_int,
        )
    };
    if rc != ESPANK_SUCCESS {
        return None;
    }
    let end = buf.iter().position(|&b| b == 0)?;
    Some(String::from_utf8_lossy(&buf[..end]).into_owned())
}

/// What the job said with `--rfaas`, if anything (`--rfaas` and
/// `--rfaas=yes` are yes).
fn rfaas_choice(sp: Spank) -> Option<RfaasChoice> {
    let mut arg: *mut c_char = std::ptr::null_mut();
    // SAFETY: a valid handle, the static option, and a pointer Slurm sets
    // to its own string (or leaves null).
    if unsafe { ffi::spank_option_getopt(sp, option_ptr(), &mut arg) } != ESPANK_SUCCESS {
        return None;
    }
    // SAFETY: arg is null or Slurm's C string, alive through this callback.
    let arg = unsafe { owned(arg) };
    // A bad value was refused where it was given; here it counts as no.
    Some(RfaasChoice::parse(arg.as_deref()).unwrap_or(RfaasChoice::No))
}

//! The plugin is built for the Slurm whose headers it was built from, and
//! says so.
//!
//! - The build script's header search and release check
//!   (`build/headers.rs`, included here), and the build script itself, as
//!   cargo ran it: a missing header or an unchecked release stops it with
//!   one sentence and no panic; a release it does not know is generated
//!   from all the same when the administrator says so.
//! - The built `rfaas_spank.so`: its `plugin_version` is the headers'
//!   `SLURM_VERSION_NUMBER`, and the only Slurm functions it leaves for
//!   Slurm to resolve are the allowlisted ones.
//! - On a one-node loopback cluster (`scripts/slurm-cluster.sh`; root),
//!   slurmd's log has the line saying which Slurm the plugin was built for
//!   and which runs it.
//!
//! The headers are the ones the build used: `SLURM_INCLUDE_DIR`, else
//! pkg-config's, else `/usr/include`; the plugin is
//! `RFAAS_SPANK_PLUGIN` if set, else the one cargo built next to this test.

#[path = "../build/headers.rs"]
#[allow(dead_code)]
mod headers;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use headers::{Headers, Search, FUNCTIONS, INCLUDE_DIR_VAR, UNCHECKED_VAR};
use rfaas_testkit::slurm::{spank_plugin, SlurmCluster, SlurmOptions};
use rfaas_testkit::wait::poll_for;

/// The headers this build used, found as `build.rs` finds them.
fn build_headers() -> Headers {
    let from_env = std::env::var_os(INCLUDE_DIR_VAR)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from);
    let from_pkg_config = Command::new("pkg-config")
        .args(["--variable=includedir", "slurm"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| PathBuf::from(String::from_utf8_lossy(&o.stdout).trim()))
        .filter(|p| !p.as_os_str().is_empty() && from_env.is_none());
    Search {
        from_env,
        from_pkg_config,
        unchecked: true,
    }
    .find()
    .unwrap_or_else(|e| panic!("{e}"))
}

/// `target/<profile>/`, where cargo put this test under `deps/`.
fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent().unwrap().parent().unwrap().to_path_buf()
}

/// The plugin under test.
fn plugin() -> PathBuf {
    spank_plugin().unwrap_or_else(|e| panic!("{e}"))
}

fn run(cmd: &mut Command) -> Output {
    cmd.output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"))
}

fn stdout_of(cmd: &mut Command) -> String {
    let out = run(cmd);
    assert!(out.status.success(), "{cmd:?}: {out:?}");
    String::from_utf8(out.stdout).unwrap()
}

/// The 4 bytes of symbol `name` in shared object `so`, as `objdump` reads
/// them from the file.
fn symbol_u32(so: &Path, name: &str) -> u32 {
    let syms = stdout_of(Command::new("nm").args(["-D", "--defined-only"]).arg(so));
    let addr = syms
        .lines()
        .find_map(|l| {
            let mut w = l.split_whitespace();
            let (addr, _kind, sym) = (w.next()?, w.next()?, w.next()?);
            (sym == name).then(|| u64::from_str_radix(addr, 16).unwrap())
        })
        .unwrap_or_else(|| panic!("{} exports no {name}:\n{syms}", so.display()));
    let dump = stdout_of(
        Command::new("objdump")
            .arg("-s")
            .arg(format!("--start-address={addr:#x}"))
            .arg(format!("--stop-address={:#x}", addr + 4))
            .arg(so),
    );
    // " 1a2b0 08051600    ....": the first line after the section header.
    let word = dump
        .lines()
        .skip_while(|l| !l.starts_with("Contents of section"))
        .nth(1)
        .and_then(|l| l.split_whitespace().nth(1))
        .unwrap_or_else(|| panic!("no bytes of {name} in:\n{dump}"));
    let bytes: Vec<u8> = (0..4)
        .map(|i| u8::from_str_radix(&word[2 * i..2 * i + 2], 16).unwrap())
        .collect();
    u32::from_le_bytes(bytes.try_into().unwrap())
}

#[test]
fn plugin_version_is_the_headers_slurm_version_number() {
    let headers = build_headers();
    let so = plugin();
    let version = symbol_u32(&so, "plugin_version");
    assert_eq!(
        version,
        headers.version.number(),
        "{} says {:#x}, {}/slurm_version.h {:#x}",
        so.display(),
        version,
        headers.slurm_dir().display(),
        headers.version.number()
    );
}

#[test]
fn the_plugin_needs_from_slurm_only_the_allowlisted_functions() {
    let so = plugin();
    let undefined = stdout_of(Command::new("nm").args(["-D", "--undefined-only"]).arg(&so));
    let mut from_slurm: Vec<&str> = undefined
        .lines()
        .filter_map(|l| l.split_whitespace().last())
        .filter(|s| s.starts_with("spank_") || s.starts_with("slurm_"))
        .collect();
    from_slurm.sort_unstable();
    let mut allowed = FUNCTIONS.to_vec();
    allowed.sort_unstable();
    assert_eq!(from_slurm, allowed, "{}", so.display());
}

/// The build script cargo ran for this crate (the newest, if several).
fn build_script() -> PathBuf {
    let build = profile_dir().join("build");
    std::fs::read_dir(&build)
        .unwrap()
        .filter_map(|e| {
            let dir = e.ok()?.path();
            let name = dir.file_name()?.to_str()?.to_owned();
            let script = dir.join("build-script-build");
            (name.starts_with("rfaas-slurm-spank-") && script.exists()).then_some(script)
        })
        .max_by_key(|p| p.metadata().and_then(|m| m.modified()).ok())
        .unwrap_or_else(|| {
            panic!(
                "no rfaas-slurm-spank build script under {}",
                build.display()
            )
        })
}

/// Runs the build script as cargo would, with `include_dir` as
/// `SLURM_INCLUDE_DIR`, into `out_dir`.
fn run_build_script(include_dir: &Path, unchecked: bool, out_dir: &Path) -> Output {
    std::fs::create_dir_all(out_dir).unwrap();
    let mut cmd = Command::new(build_script());
    cmd.current_dir(env!("CARGO_MANIFEST_DIR"))
        .env(INCLUDE_DIR_VAR, include_dir)
        .env("OUT_DIR", out_dir)
        .env_remove(UNCHECKED_VAR)
        .env_remove("RUST_BACKTRACE");
    if unchecked {
        cmd.env(UNCHECKED_VAR, "1");
    }
    run(&mut cmd)
}

/// A scratch directory of this test's own.
fn scratch(name: &str) -> PathBuf {
    let dir =
        std::env::temp_dir().join(format!("rfaas-spank-version-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn the_build_stops_with_one_sentence_when_the_headers_are_missing() {
    let dir = scratch("missing");
    let out = run_build_script(Path::new("/nonexistent"), false, &dir.join("out"));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert_eq!(
        stderr.trim_end(),
        "rfaas_spank: <slurm/spank.h> not found in /nonexistent/slurm (SLURM_INCLUDE_DIR \
         set): install libslurm-dev (Debian/Ubuntu) or slurm-devel (RHEL family), or set \
         SLURM_INCLUDE_DIR to the directory holding slurm/spank.h"
    );
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn an_unchecked_release_stops_the_build_unless_the_administrator_says_so() {
    // The installed headers, saying they are Slurm 26.05.0.
    let headers = build_headers();
    let dir = scratch("unchecked");
    let include = dir.join("include");
    std::fs::create_dir_all(include.join("slurm")).unwrap();
    for entry in std::fs::read_dir(headers.slurm_dir()).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, include.join("slurm").join(path.file_name().unwrap())).unwrap();
    }
    let version_h = include.join("slurm/slurm_version.h");
    let text = std::fs::read_to_string(&version_h).unwrap();
    let old = format!("{:#x}", headers.version.number());
    assert!(text.contains(&old), "{text}");
    std::fs::write(&version_h, text.replace(&old, "0x1a0500")).unwrap();

    let out = run_build_script(&include, false, &dir.join("out"));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(stderr.contains("says Slurm 26.05.0"), "{stderr}");
    assert!(stderr.contains("RFAAS_SLURM_UNCHECKED=1"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");

    let out = run_build_script(&include, true, &dir.join("out"));
    assert!(out.status.success(), "{out:?}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("cargo:warning=rfaas_spank: "), "{stdout}");
    assert!(
        stdout.contains("cargo:rustc-env=BUILT_FOR_SLURM=26.05.0"),
        "{stdout}"
    );
    let generated = std::fs::read_to_string(dir.join("out/spank.rs")).unwrap();
    assert!(
        generated.contains(&format!("SLURM_VERSION_NUMBER: u32 = {};", 0x1a0500)),
        "{generated}"
    );
    std::fs::remove_dir_all(dir).unwrap();
}

/// slurmd's own release, from `slurmd -V` ("slurm-wlm 22.05.8").
fn running_slurm() -> String {
    let v = stdout_of(Command::new("slurmd").arg("-V"));
    v.split_whitespace().last().unwrap().to_owned()
}

#[test]
fn slurmd_logs_the_release_the_plugin_was_built_for_and_runs_under() {
    let headers = build_headers();
    let dir = scratch("cluster");
    let plugstack = dir.join("plugstack.conf");
    std::fs::write(&plugstack, format!("required {}\n", plugin().display())).unwrap();
    let cluster = SlurmCluster::start(SlurmOptions {
        nodes: 1,
        plugstack: Some(plugstack),
        ..SlurmOptions::default()
    })
    .unwrap_or_else(|e| panic!("{e}"));
    // A job loads the plugin in srun and slurmstepd too: `required`, so a
    // plugin Slurm refuses fails it.
    assert_eq!(cluster.srun(&["-N1", "echo", "ran"]).unwrap().trim(), "ran");
    let built = format!("built for Slurm {} (headers ", headers.version);
    let line = poll_for(Duration::from_secs(60), || {
        let log = cluster.slurmd_log("node1");
        log.lines().find(|l| l.contains(&built)).map(str::to_owned)
    })
    .unwrap_or_else(|| {
        panic!(
            "no {built:?} in slurmd's log:\n{}",
            cluster.slurmd_log("node1")
        )
    });
    let (start, end) = (
        format!("rfaas_spank {} {built}", env!("CARGO_PKG_VERSION")),
        format!("/slurm), running under Slurm {}", running_slurm()),
    );
    assert!(
        line.contains(&start) && line.ends_with(&end),
        "{line:?}: not {start:?}...{end:?}"
    );
    // A plugin built elsewhere (RFAAS_SPANK_PLUGIN) names its own headers.
    if std::env::var_os("RFAAS_SPANK_PLUGIN").is_none() {
        let headers_dir = format!("(headers {}), ", headers.slurm_dir().display());
        assert!(line.contains(&headers_dir), "{line:?}: not {headers_dir:?}");
    }
    drop(cluster);
    std::fs::remove_dir_all(dir).unwrap();
}

//! What the worker does to itself before it loads user code: dying with the
//! daemon, pinning, the memory limit, and the drop to the lease's user.

use std::io;
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};

use rfaas_proto::control::ErrorCode;

use super::WorkerError;

/// The parent seen by the first [`die_with_parent`].
static PARENT: AtomicI32 = AtomicI32::new(0);

/// Set by [`outlive_parent`]: [`die_with_parent`] does nothing.
static OUTLIVE: AtomicBool = AtomicBool::new(false);

/// The worker outlives its daemon (`--outlive-daemon`, the daemon's
/// `workers_outlive_daemon`): no parent-death signal, from now on.
pub fn outlive_parent() {
    OUTLIVE.store(true, Ordering::Relaxed);
}

/// Asks the kernel to SIGKILL this process when its parent dies, then checks
/// that the parent is still the one seen at the first call (closing the race
/// between the parent's death and the prctl). A parent that died before the
/// first call closed its end of the control socket: the worker then ends
/// when it reads the assignment.
///
/// The kernel clears the setting when the process changes its credentials,
/// so [`drop_privileges`] sets it again.
pub fn die_with_parent() -> Result<(), WorkerError> {
    if OUTLIVE.load(Ordering::Relaxed) {
        return Ok(());
    }
    // SAFETY: getppid cannot fail.
    let first = unsafe { libc::getppid() };
    let _ = PARENT.compare_exchange(0, first, Ordering::Relaxed, Ordering::Relaxed);
    // SAFETY: prctl with integer arguments only.
    if unsafe {
        libc::prctl(
            libc::PR_SET_PDEATHSIG,
            libc::SIGKILL as libc::c_ulong,
            0,
            0,
            0,
        )
    } != 0
    {
        return Err(os_failure("prctl(PR_SET_PDEATHSIG)"));
    }
    // SAFETY: getppid cannot fail.
    if unsafe { libc::getppid() } != PARENT.load(Ordering::Relaxed) {
        return Err(WorkerError::Orphaned);
    }
    Ok(())
}

/// Pins the calling thread, and so every thread it starts later, to `cpus`.
pub fn pin_to(cpus: &[u32]) -> Result<(), WorkerError> {
    // SAFETY: cpu_set_t is plain data; all-zero is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for &cpu in cpus {
        if cpu as usize >= libc::CPU_SETSIZE as usize {
            return Err(WorkerError::failed(
                ErrorCode::Internal,
                format!("CPU {cpu} is beyond the {} CPUs the worker can pin to; check the executor's cpus setting", libc::CPU_SETSIZE),
            ));
        }
        // SAFETY: cpu is below CPU_SETSIZE, inside `set`.
        unsafe { libc::CPU_SET(cpu as usize, &mut set) };
    }
    // SAFETY: `set` is a valid cpu_set_t of the size passed; pid 0 is the caller.
    if unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) } != 0 {
        let err = io::Error::last_os_error();
        return Err(WorkerError::failed(
            ErrorCode::Internal,
            format!("cannot pin the worker to CPUs {cpus:?}: {err}; check that they are online and in the executor's cpuset"),
        ));
    }
    Ok(())
}

/// Limits the process's address space to `bytes` (soft and hard).
pub fn limit_memory(bytes: u64) -> Result<(), WorkerError> {
    let lim = libc::rlimit {
        rlim_cur: bytes as libc::rlim_t,
        rlim_max: bytes as libc::rlim_t,
    };
    // SAFETY: setrlimit reads the struct we pass.
    if unsafe { libc::setrlimit(libc::RLIMIT_AS, &lim) } != 0 {
        return Err(os_failure("setrlimit(RLIMIT_AS)"));
    }
    Ok(())
}

/// Becomes `uid`/`gid` with no supplementary groups (when that is not who
/// the process already is), then makes `/proc/self` readable again and
/// forbids regaining privileges.
///
/// Refuses uid 0: user code never runs as root.
pub fn drop_privileges(uid: u32, gid: u32) -> Result<(), WorkerError> {
    if uid == 0 {
        return Err(WorkerError::failed(
            ErrorCode::UserRefused,
            "the assignment asks the worker to run as root (uid 0); workers never run user code as root: run the job as an ordinary user".into(),
        ));
    }
    // SAFETY: getuid and getgid cannot fail.
    let (cur_uid, cur_gid) = unsafe { (libc::getuid(), libc::getgid()) };
    if uid != cur_uid || gid != cur_gid {
        // SAFETY: an empty group list; the pointer is not read for size 0.
        if unsafe { libc::setgroups(0, std::ptr::null()) } != 0 {
            return Err(user_failure("setgroups([])", uid, gid));
        }
        // SAFETY: plain syscalls with integer arguments.
        if unsafe { libc::setgid(gid) } != 0 {
            return Err(user_failure("setgid", uid, gid));
        }
        // SAFETY: as above.
        if unsafe { libc::setuid(uid) } != 0 {
            return Err(user_failure("setuid", uid, gid));
        }
        // SAFETY: as above.
        if unsafe { libc::getuid() } != uid || unsafe { libc::geteuid() } != uid {
            return Err(WorkerError::failed(
                ErrorCode::Internal,
                format!(
                    "the worker is still not uid {uid} after setuid; refusing to load the library"
                ),
            ));
        }
    }
    // Changing credentials cleared the parent-death signal and made the
    // process undumpable (which hides /proc/self/fd, where the library is).
    die_with_parent()?;
    // SAFETY: prctl with integer arguments only.
    if unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 1 as libc::c_ulong, 0, 0, 0) } != 0 {
        return Err(os_failure("prctl(PR_SET_DUMPABLE)"));
    }
    // SAFETY: as above.
    if unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1 as libc::c_ulong, 0, 0, 0) } != 0 {
        return Err(os_failure("prctl(PR_SET_NO_NEW_PRIVS)"));
    }
    Ok(())
}

fn user_failure(call: &str, uid: u32, gid: u32) -> WorkerError {
    let err = io::Error::last_os_error();
    WorkerError::failed(
        ErrorCode::UserRefused,
        format!("cannot switch the worker to uid {uid} gid {gid}: {call} failed: {err}; the executor must run as root to serve other users"),
    )
}

fn os_failure(call: &str) -> WorkerError {
    let err = io::Error::last_os_error();
    WorkerError::failed(
        ErrorCode::Internal,
        format!("{call} failed in the worker: {err}"),
    )
}

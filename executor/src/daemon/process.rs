//! Worker processes: spawning (directly or under bubblewrap), signalling by
//! pid (adopted workers through their pidfd), and waiting for their end;
//! what the spawner thread is asked.

use std::ffi::CString;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;

/// A started worker: its pid and the daemon's end of its socket pair.
#[derive(Debug)]
pub struct Spawned {
    /// Process id (of `bwrap` under the bubblewrap sandbox).
    pub pid: u32,
    /// The daemon's end of the control socket pair.
    pub sock: UnixStream,
}

/// How to run a worker under bubblewrap.
#[derive(Debug, Clone)]
pub struct Bwrap {
    /// The `bwrap` binary.
    pub bwrap: PathBuf,
    /// The allocation's runtime directory, the one writable path.
    pub runtime_dir: PathBuf,
}

/// Starts `worker --control-fd N` with one end of a new socket pair as fd
/// N, in its own process group (a terminal's Ctrl-C reaches the daemon,
/// which stops workers itself), with SIGKILL as its parent-death signal
/// unless it is to `outlive` the daemon (`--outlive-daemon`: it then waits
/// for the next daemon when this one ends). With `bwrap`, the worker runs
/// inside a bubblewrap sandbox. With
/// `cgroup_procs`, the child joins that cgroup before it execs. `env` is
/// added to its environment.
///
/// Call it from a thread that lives as long as the daemon: the
/// parent-death signal fires when the spawning *thread* ends.
pub fn spawn_worker(
    worker: &Path,
    bwrap: Option<&Bwrap>,
    cgroup_procs: Option<&Path>,
    nice: i32,
    env: &[(&str, &str)],
    outlive: bool,
) -> io::Result<Spawned> {
    let (ours, theirs) = UnixStream::pair()?;
    let fd = theirs.as_raw_fd();
    let mut cmd = match bwrap {
        None => Command::new(worker),
        Some(b) => {
            let mut c = Command::new(&b.bwrap);
            c.args([
                "--die-with-parent",
                "--unshare-pid",
                "--unshare-ipc",
                "--unshare-uts",
                "--ro-bind",
                "/",
                "/",
                "--dev",
                "/dev",
                "--proc",
                "/proc",
                "--tmpfs",
                "/tmp",
            ]);
            // bwrap makes missing mount points mode 0700 and root-owned;
            // the worker, as the lease's user, must traverse them.
            let mut ancestors: Vec<&Path> = b
                .runtime_dir
                .ancestors()
                .skip(1)
                .filter(|a| a.parent().is_some())
                .collect();
            ancestors.reverse();
            for a in ancestors {
                c.args(["--perms", "0711", "--dir"]).arg(a);
            }
            c.arg("--bind").arg(&b.runtime_dir).arg(&b.runtime_dir);
            // The worker binary itself, in case the tmpfs hid it (a build
            // tree under /tmp). It is executed as root, before any drop.
            c.arg("--ro-bind").arg(worker).arg(worker);
            c.arg("--new-session").arg("--").arg(worker);
            c
        }
    };
    cmd.arg("--control-fd").arg(fd.to_string());
    if outlive {
        cmd.arg("--outlive-daemon");
    }
    cmd.envs(env.iter().copied());
    cmd.stdin(Stdio::null()).stdout(Stdio::null());
    cmd.process_group(0);
    let procs = cgroup_procs
        .map(|p| CString::new(p.as_os_str().as_bytes()))
        .transpose()
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
    // SAFETY: the closure runs in the forked child before exec and only
    // makes async-signal-safe system calls (fcntl, sigprocmask, prctl,
    // setpriority, open, write, close) on memory prepared before the fork.
    unsafe {
        cmd.pre_exec(move || {
            let flags = libc::fcntl(fd, libc::F_GETFD);
            if flags < 0 || libc::fcntl(fd, libc::F_SETFD, flags & !libc::FD_CLOEXEC) < 0 {
                return Err(io::Error::last_os_error());
            }
            // The daemon blocks its termination signals to take them in
            // one thread; the worker must not inherit that.
            let mut empty: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut empty);
            libc::pthread_sigmask(libc::SIG_SETMASK, &empty, std::ptr::null_mut());
            if !outlive {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0);
            }
            if nice != 0 && libc::setpriority(libc::PRIO_PROCESS, 0, nice) != 0 {
                return Err(io::Error::last_os_error());
            }
            if let Some(procs) = &procs {
                let f = libc::open(procs.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
                if f < 0 {
                    return Err(io::Error::last_os_error());
                }
                // "0" means the writing process itself.
                let ok = libc::write(f, b"0".as_ptr().cast(), 1) == 1;
                libc::close(f);
                if !ok {
                    return Err(io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
    let child = cmd.spawn().map_err(|e| {
        let what = match bwrap {
            Some(b) => format!(
                "{} (bubblewrap) for {}",
                b.bwrap.display(),
                worker.display()
            ),
            None => worker.display().to_string(),
        };
        io::Error::new(e.kind(), format!("cannot start the worker {what}: {e}"))
    })?;
    drop(theirs);
    // The daemon reaps the process itself (see `wait_exit`); dropping the
    // handle neither waits nor kills.
    let pid = child.id();
    drop(child);
    Ok(Spawned { pid, sock: ours })
}

/// Sets the nice value of `pid`'s main thread (threads it starts later
/// inherit it). Raising a priority needs `CAP_SYS_NICE` (root has it unless
/// a container or service manager dropped it); without it the daemon says
/// so, and its workers keep their nice value.
pub fn renice(pid: u32, nice: i32) {
    // SAFETY: setpriority has no memory preconditions.
    if unsafe { libc::setpriority(libc::PRIO_PROCESS, pid as libc::id_t, nice) } != 0 {
        tracing::warn!(pid, nice, error = %io::Error::last_os_error(), "cannot renice the worker (raising a priority needs CAP_SYS_NICE, which the executor lacks)");
    }
}

/// How a process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    /// It exited with this code.
    Exited(i32),
    /// A signal ended it.
    Signaled(i32),
}

/// Blocks until child `pid` has ended, without reaping it: the pid stays
/// taken (a zombie) until [`reap`], so nobody signals a recycled pid.
pub fn wait_exit(pid: u32) -> io::Result<Ended> {
    loop {
        // SAFETY: siginfo_t is plain data; waitid fills it in.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: info is a valid siginfo_t for waitid to write.
        let rc = unsafe {
            libc::waitid(
                libc::P_PID,
                pid as libc::id_t,
                &mut info,
                libc::WEXITED | libc::WNOWAIT,
            )
        };
        if rc == 0 {
            // SAFETY: waitid succeeded for an exited child, so si_status
            // is the field it set.
            let status = unsafe { info.si_status() };
            return Ok(match info.si_code {
                libc::CLD_EXITED => Ended::Exited(status),
                _ => Ended::Signaled(status),
            });
        }
        let err = io::Error::last_os_error();
        if err.kind() != io::ErrorKind::Interrupted {
            return Err(err);
        }
    }
}

/// Reaps child `pid`, which [`wait_exit`] saw end. Returns the CPU time
/// (user and system, ns) the kernel counted for it and for the children it
/// waited for (`wait4`), or `None` when it was not ours to reap.
pub fn reap(pid: u32) -> Option<u64> {
    let mut status = 0;
    // SAFETY: rusage is plain data; wait4 fills it in.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    loop {
        // SAFETY: wait4 on our own child with valid status and usage
        // pointers.
        let rc = unsafe { libc::wait4(pid as libc::pid_t, &mut status, 0, &mut usage) };
        if rc == pid as libc::pid_t {
            return Some(timeval_ns(usage.ru_utime).saturating_add(timeval_ns(usage.ru_stime)));
        }
        if rc < 0 && io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
            continue;
        }
        return None;
    }
}

fn timeval_ns(t: libc::timeval) -> u64 {
    (t.tv_sec.max(0) as u64)
        .saturating_mul(1_000_000_000)
        .saturating_add(t.tv_usec.max(0) as u64 * 1000)
}

/// Adopted workers (not this daemon's children, so their pids are not
/// held as zombies until reaped) by pid: [`signal`] reaches them through
/// their pidfd, never a process that got the pid after them.
static PIDFDS: std::sync::Mutex<
    std::collections::BTreeMap<u32, std::sync::Arc<std::os::fd::OwnedFd>>,
> = std::sync::Mutex::new(std::collections::BTreeMap::new());

fn pidfds() -> std::sync::MutexGuard<
    'static,
    std::collections::BTreeMap<u32, std::sync::Arc<std::os::fd::OwnedFd>>,
> {
    PIDFDS.lock().unwrap_or_else(|e| e.into_inner())
}

/// From now on [`signal`] reaches `pid` through `pidfd` (an adopted
/// worker's), until [`untrack`].
pub fn track(pid: u32, pidfd: std::sync::Arc<std::os::fd::OwnedFd>) {
    pidfds().insert(pid, pidfd);
}

/// `pid` is no longer an adopted worker's (its end was handled).
pub fn untrack(pid: u32) {
    pidfds().remove(&pid);
}

/// Sends `signal` to `pid`: a child of this daemon's (callers only signal
/// pids they have not reaped), or an adopted worker's through its pidfd
/// ([`track`]). Returns whether it was delivered (false: the process is
/// gone).
pub fn signal(pid: u32, signal: i32) -> bool {
    let tracked = pidfds().get(&pid).cloned();
    let r = match tracked {
        // SAFETY: a pidfd we hold open, a signal number, no siginfo, no
        // flags: no memory is passed.
        Some(fd) => unsafe {
            libc::syscall(
                libc::SYS_pidfd_send_signal,
                fd.as_raw_fd(),
                signal,
                std::ptr::null::<libc::siginfo_t>(),
                0u32,
            )
        },
        // SAFETY: kill has no memory preconditions.
        None => i64::from(unsafe { libc::kill(pid as libc::pid_t, signal) }),
    };
    r == 0
}

/// `pid`'s descendants (children, their children, ...), from procfs.
pub fn descendants(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    let mut todo = vec![pid];
    while let Some(p) = todo.pop() {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{p}/task")) else {
            continue;
        };
        for task in tasks.flatten() {
            let children =
                std::fs::read_to_string(task.path().join("children")).unwrap_or_default();
            for c in children
                .split_whitespace()
                .filter_map(|c| c.parse::<u32>().ok())
            {
                if !out.contains(&c) && out.len() < 4096 {
                    out.push(c);
                    todo.push(c);
                }
            }
        }
    }
    out
}

/// Whether process `pid`, or one below it (the worker, under
/// bubblewrap), is exiting or has exited and waits to be reaped: its task
/// flags say `PF_EXITING`, or it is a zombie. False when `/proc` cannot
/// tell. The caller makes sure `pid` is not reaped meanwhile.
pub fn is_exiting(pid: u32) -> bool {
    let exiting = |p: u32| {
        std::fs::read_to_string(format!("/proc/{p}/stat")).is_ok_and(|s| stat_says_exiting(&s))
    };
    exiting(pid) || descendants(pid).into_iter().any(exiting)
}

/// The kernel's task flag of a task that runs its exit (`PF_EXITING`,
/// include/linux/sched.h; `/proc/<pid>/stat`'s ninth field).
const PF_EXITING: u64 = 0x4;

/// Whether a `/proc/<pid>/stat` line is that of an exiting or exited task.
fn stat_says_exiting(stat: &str) -> bool {
    // The command name may hold spaces and parentheses: fields start after
    // the last ')'.
    let Some((_, rest)) = stat.rsplit_once(')') else {
        return false;
    };
    let mut fields = rest.split_whitespace();
    let state = fields.next();
    // After the state: ppid, pgrp, session, tty_nr, tpgid, then flags.
    let flags = fields.nth(5).and_then(|f| f.parse::<u64>().ok());
    matches!(state, Some("Z" | "X" | "x")) || flags.is_some_and(|f| f & PF_EXITING != 0)
}

/// A signal's name (`SIGSEGV`), or its number.
pub fn signal_name(sig: i32) -> String {
    let name = match sig {
        libc::SIGHUP => "SIGHUP",
        libc::SIGINT => "SIGINT",
        libc::SIGQUIT => "SIGQUIT",
        libc::SIGILL => "SIGILL",
        libc::SIGTRAP => "SIGTRAP",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        libc::SIGKILL => "SIGKILL",
        libc::SIGUSR1 => "SIGUSR1",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGUSR2 => "SIGUSR2",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGALRM => "SIGALRM",
        libc::SIGTERM => "SIGTERM",
        libc::SIGXCPU => "SIGXCPU",
        libc::SIGXFSZ => "SIGXFSZ",
        libc::SIGSYS => "SIGSYS",
        _ => return format!("signal {sig}"),
    };
    name.to_owned()
}

/// Work for the spawner thread.
#[derive(Debug)]
pub(crate) enum SpawnJob {
    /// Start a worker for an allocation and hand it back.
    Direct {
        bwrap: Option<Bwrap>,
        cgroup_procs: Option<PathBuf>,
        reply: mpsc::Sender<io::Result<Spawned>>,
    },
    /// Top the idle pool up to `pool_size`.
    Refill,
}

/// A pidfd for `pid` (it becomes readable when the process ends).
pub(crate) fn pidfd_open(pid: u32) -> io::Result<std::os::fd::OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags; no memory is passed.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the kernel just returned this descriptor, ours alone.
    Ok(unsafe { std::os::fd::FromRawFd::from_raw_fd(fd as i32) })
}

/// Blocks until the process behind `pidfd` has ended.
pub(crate) fn wait_pidfd(pidfd: &std::os::fd::OwnedFd) {
    loop {
        let mut pfd = libc::pollfd {
            fd: pidfd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd for the duration of the call.
        let n = unsafe { libc::poll(&mut pfd, 1, -1) };
        if n > 0 {
            return;
        }
        if n < 0 && io::Error::last_os_error().kind() != io::ErrorKind::Interrupted {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exiting_and_exited_tasks_are_told_by_their_stat() {
        // Running, its flags without PF_EXITING (0x400040).
        let live = "4242 (rfaas-worker) S 17 4242 4242 0 -1 4194368 211 0 0 0 3 1 0 0 20 0";
        assert!(!stat_says_exiting(live));
        // Tearing its memory down: PF_EXITING (0x400044).
        let exiting = "4242 (rfaas-worker) R 17 4242 4242 0 -1 4194372 211 0 0 0 3 1 0 0 20 0";
        assert!(stat_says_exiting(exiting));
        // A zombie, with a command name that looks like fields.
        let zombie = "4242 (a) Z 1 2 3) Z 17 4242 4242 0 -1 4194368 211 0 0 0 3 1 0 0 20 0";
        assert!(stat_says_exiting(zombie));
        assert!(!stat_says_exiting("garbage"));
        // This process is neither.
        assert!(!is_exiting(std::process::id()));
    }

    #[test]
    fn spawn_wait_and_reap() {
        // `true` ignores its arguments, so it stands in for the worker.
        let s = spawn_worker(Path::new("/bin/true"), None, None, 0, &[], false).unwrap();
        assert_eq!(wait_exit(s.pid).unwrap(), Ended::Exited(0));
        // Still a zombie: the pid is ours until reaped.
        assert!(Path::new(&format!("/proc/{}", s.pid)).exists());
        assert!(reap(s.pid).is_some());
        assert_eq!(reap(s.pid), None, "reaped once");
        assert_eq!(signal_name(11), "SIGSEGV");
        assert_eq!(signal_name(99), "signal 99");
    }

    #[test]
    // `reap` is the wait under test.
    #[allow(clippy::zombie_processes)]
    fn reaping_tells_the_cpu_time_of_the_child() {
        let child = Command::new("/bin/sh")
            .args(["-c", "i=0; while [ $i -lt 200000 ]; do i=$((i+1)); done"])
            .spawn()
            .unwrap();
        let pid = child.id();
        assert_eq!(wait_exit(pid).unwrap(), Ended::Exited(0));
        let cpu = reap(pid).unwrap();
        // 200 000 shell iterations take far more than a millisecond of CPU.
        assert!(cpu > 1_000_000, "{cpu} ns");
    }

    #[test]
    fn a_tracked_pid_is_signalled_through_its_pidfd_not_by_number() {
        use std::os::unix::process::ExitStatusExt;
        let mut tracked = Command::new("/bin/sleep").arg("30").spawn().unwrap();
        let mut other = Command::new("/bin/sleep").arg("30").spawn().unwrap();
        let fd = pidfd_open(tracked.id()).unwrap();
        // `other`'s number stands for a pid the kernel handed on after the
        // tracked process: the signal goes to the process the pidfd names.
        track(other.id(), std::sync::Arc::new(fd));
        assert!(signal(other.id(), libc::SIGKILL));
        assert!(tracked.wait().unwrap().signal() == Some(libc::SIGKILL));
        assert!(
            other.try_wait().unwrap().is_none(),
            "the other process lives"
        );
        // The tracked process is gone: nothing is delivered.
        assert!(!signal(other.id(), libc::SIGKILL));
        untrack(other.id());
        assert!(signal(other.id(), libc::SIGKILL));
        other.wait().unwrap();
    }

    #[test]
    fn killed_children_report_the_signal() {
        let s = spawn_worker(Path::new("/bin/sleep"), None, None, 0, &[], false);
        // sleep refuses "--control-fd" and exits 1 at once.
        let s = s.unwrap();
        let ended = wait_exit(s.pid).unwrap();
        reap(s.pid);
        assert_eq!(ended, Ended::Exited(1));

        let mut child = Command::new("/bin/sleep").arg("30").spawn().unwrap();
        let pid = child.id();
        signal(pid, libc::SIGKILL);
        assert_eq!(wait_exit(pid).unwrap(), Ended::Signaled(libc::SIGKILL));
        child.wait().unwrap();
    }

    #[test]
    fn a_niced_worker_starts_at_that_nice_value() {
        let dir = std::env::temp_dir().join(format!("rfaas-nice-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let script = dir.join("report-nice");
        // The script stands in for the worker and ignores --control-fd.
        std::fs::write(&script, "#!/bin/sh\nnice > \"$(dirname \"$0\")/nice\"\n").unwrap();
        std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .unwrap();
        let s = spawn_worker(&script, None, None, 7, &[], false).unwrap();
        assert_eq!(wait_exit(s.pid).unwrap(), Ended::Exited(0));
        reap(s.pid);
        let nice = std::fs::read_to_string(dir.join("nice")).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(nice.trim(), "7");
    }

    #[test]
    fn missing_worker_binary_is_named() {
        let err = spawn_worker(
            Path::new("/nonexistent/rfaas-worker"),
            None,
            None,
            0,
            &[],
            false,
        )
        .unwrap_err();
        assert!(
            err.to_string().contains("/nonexistent/rfaas-worker"),
            "{err}"
        );
    }
}

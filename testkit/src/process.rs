//! Starting a service under test and stopping it by its pid.
//!
//! Every rfaas service prints one ready line on its standard output once
//! it listens (`rfaas-manager listening on ...`, `rfaas-accounting
//! listening on ...`, `rfaas-executord ready ...`): [`spawn_ready`] starts
//! one, its standard error appended to a log file, and waits for that
//! line. [`stop`] ends a process with SIGTERM, then SIGKILL after a grace;
//! [`wait_for_exit`] sleeps on a pidfd until a process is gone, and
//! [`wait_gone`] fails the test when it is not.

use std::io::{BufRead, BufReader};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// How long a service may take to print its ready line.
pub const READY_TIMEOUT: Duration = Duration::from_secs(30);

/// How long a service may take to end after SIGTERM before it is killed.
pub const STOP_GRACE: Duration = Duration::from_secs(10);

/// Starts `cmd` (standard input closed, standard error appended to `log`)
/// and waits up to [`READY_TIMEOUT`] for its first line on standard
/// output, which must start with `ready_prefix`; returns the process and
/// the rest of that line. Standard output stays open and drained for the
/// process's lifetime. `Err` says what came instead, with the log; the
/// process is then stopped.
pub fn spawn_ready(
    mut cmd: Command,
    log: &Path,
    ready_prefix: &str,
) -> Result<(Child, String), String> {
    let program = cmd.get_program().to_string_lossy().into_owned();
    let log_file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
        .map_err(|e| format!("open the log {}: {e}", log.display()))?;
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(log_file)
        .spawn()
        .map_err(|e| format!("start {program}: {e}"))?;
    let stdout = child.stdout.take().expect("stdout is piped");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut lines = BufReader::new(stdout).lines();
        let _ = tx.send(lines.next());
        // Keep the pipe open (and drained) for the process's lifetime.
        for _ in lines {}
    });
    let got = rx.recv_timeout(READY_TIMEOUT);
    if let Ok(Some(Ok(line))) = &got {
        if let Some(rest) = line.trim().strip_prefix(ready_prefix) {
            return Ok((child, rest.to_owned()));
        }
    }
    stop(&mut child, STOP_GRACE);
    let status = child.try_wait().ok().flatten();
    Err(format!(
        "{program} did not print its ready line {ready_prefix:?} within {READY_TIMEOUT:?} \
         (got {got:?}, exit status {status:?}); its log {}:\n{}",
        log.display(),
        std::fs::read_to_string(log).unwrap_or_default()
    ))
}

/// SIGTERM (a service stops what it started), then SIGKILL when `child`
/// has not ended after `grace`; reaps it. Nothing when it was reaped
/// already.
pub fn stop(child: &mut Child, grace: Duration) {
    if matches!(child.try_wait(), Ok(Some(_))) {
        return;
    }
    // SAFETY: kill has no memory preconditions; the pid is our unreaped
    // child (only `wait` below reaps it).
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
    if !wait_for_exit(child.id(), grace) {
        let _ = child.kill();
    }
    let _ = child.wait();
}

/// SIGKILL and reaping.
pub fn kill(child: &mut Child) {
    let _ = child.kill();
    let _ = child.wait();
}

/// Waits up to `timeout` for process `pid` to end, sleeping in `poll` on its
/// pidfd (readable once the process has exited, reaped or not); true when
/// it has ended or was already gone.
pub fn wait_for_exit(pid: u32, timeout: Duration) -> bool {
    // SAFETY: a plain system call with integer arguments.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if fd < 0 {
        return std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH);
    }
    // SAFETY: pidfd_open returned a fresh descriptor we own.
    let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    let until = Instant::now() + timeout;
    loop {
        let left = until.saturating_duration_since(Instant::now());
        let mut p = libc::pollfd {
            fd: fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = left.as_millis().min(i32::MAX as u128) as i32;
        // SAFETY: one valid pollfd.
        match unsafe { libc::poll(&mut p, 1, ms) } {
            1.. => return true,
            0 => return false,
            _ if std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted => {}
            _ => return false,
        }
    }
}

/// Waits up to [`crate::wait::TIMEOUT`] for process `pid` to end (gone,
/// or a zombie); fails the test naming it when it has not.
pub fn wait_gone(pid: u32) {
    let within = crate::wait::TIMEOUT;
    assert!(
        wait_for_exit(pid, within),
        "waited {within:?} for process {pid} to end, and it did not"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waiting_for_an_exit_sees_it_end() {
        let mut child = Command::new("sleep").arg("60").spawn().unwrap();
        assert!(!wait_for_exit(child.id(), Duration::from_millis(50)));
        // SAFETY: kill has no memory preconditions; our unreaped child.
        unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
        assert!(wait_for_exit(child.id(), Duration::from_secs(60)));
        child.wait().unwrap();
    }

    #[test]
    fn a_ready_line_is_returned_after_its_prefix() {
        let dir = crate::TempDir::new("ready");
        let mut cmd = Command::new("sh");
        cmd.args(["-c", "echo 'svc listening on 127.0.0.1:9'; exec sleep 60"]);
        let (mut child, rest) = spawn_ready(cmd, &dir.join("log"), "svc listening on ").unwrap();
        assert_eq!(rest, "127.0.0.1:9");
        stop(&mut child, Duration::from_secs(10));
        assert!(child.try_wait().unwrap().is_some());
    }

    #[test]
    fn another_first_line_is_an_error_with_the_log() {
        let dir = crate::TempDir::new("not-ready");
        let mut cmd = Command::new("sh");
        cmd.args(["-c", "echo 'bad config' >&2; echo 'usage: svc'"]);
        let err = spawn_ready(cmd, &dir.join("log"), "svc listening on ").unwrap_err();
        assert!(
            err.contains("did not print its ready line") && err.contains("bad config"),
            "{err}"
        );
    }
}

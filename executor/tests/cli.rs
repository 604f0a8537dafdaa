//! The command-line tools as a shell uses them: output piped into a
//! reader that stops early (`rfaas-token ... | head -c 10`).

use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::process::ExitStatusExt;
use std::process::{Command, Stdio};

use rfaas_testkit::{output_text, TempDir};

/// A pipe whose read end is already closed: every write to the other end
/// fails (EPIPE, or SIGPIPE).
fn closed_pipe() -> OwnedFd {
    let mut fds = [0; 2];
    // SAFETY: `fds` has room for the two descriptors pipe(2) writes.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    // SAFETY: pipe(2) just opened both; each is owned once, here.
    let (read, write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    drop(read);
    write
}

#[test]
fn a_reader_that_goes_away_ends_rfaas_token_quietly() {
    let dir = TempDir::new("cli");
    let token = env!("CARGO_BIN_EXE_rfaas-token");
    let (secret, public) = (dir.path().join("k.secret"), dir.path().join("k.pub"));
    let o = Command::new(token)
        .args(["keygen", "--key-id", "t1", "--secret"])
        .arg(&secret)
        .arg("--public")
        .arg(&public)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", output_text(&o));
    let o = Command::new(token)
        .args(["mint", "--key"])
        .arg(&secret)
        .args(["--node", "n1", "--user", "nobody", "--account", "a"])
        .args(["--cores", "1", "--memory-mib", "64", "--ttl-secs", "60"])
        .stdout(Stdio::from(closed_pipe()))
        .stderr(Stdio::piped())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(!stderr.contains("panicked"), "{stderr}");
    // Ended by SIGPIPE, as `cat` or `sort` would be.
    assert_eq!(
        o.status.signal(),
        Some(libc::SIGPIPE),
        "{:?}: {stderr}",
        o.status
    );
}

//! A worker that outlives its daemon: when the daemon's socket ends (the
//! daemon stopped, crashed or is being upgraded), the worker keeps serving
//! its lanes and listens on `adopt.sock` in its allocation's directory for
//! the next daemon. The first peer that is root gets a [`WorkerRejoin`]
//! with the meter area attached and becomes the worker's daemon. No daemon
//! by the lease's end: the worker ends itself ([`EXIT_LEASE_OVER`]).

use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::OnceLock;

use rfaas_proto::control::worker::WorkerRejoin;
use rfaas_proto::control::Frame;

use crate::ipc;

/// Exit code of a worker that ended itself at its lease's end because no
/// daemon adopted it.
pub const EXIT_LEASE_OVER: i32 = 4;

/// The socket's name in the allocation's directory.
pub const ADOPT_SOCKET: &str = "adopt.sock";

/// The meter area's descriptor, kept to hand it to an adopting daemon.
static METER_FD: OnceLock<OwnedFd> = OnceLock::new();

/// Keeps the meter area's descriptor for a later adoption.
pub(super) fn keep_meter_fd(fd: OwnedFd) {
    let _ = METER_FD.set(fd);
}

/// How often the wait looks at the lease's end, ms.
const POLL_MS: i32 = 250;

/// Waits in `dir` for a daemon to adopt the worker of `allocation_id`;
/// returns its socket once the worker told it [`WorkerRejoin`]. Ends the
/// process at the lease's end ([`super::EXPIRES_AT`]) if none came.
pub(super) fn await_daemon(dir: &Path, allocation_id: u64) -> io::Result<UnixStream> {
    let path = dir.join(ADOPT_SOCKET);
    match std::fs::remove_file(&path) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let listener = UnixListener::bind(&path)?;
    listener.set_nonblocking(true)?;
    tracing::info!(socket = %path.display(), "the daemon's socket ended; serving on and waiting for the next daemon");
    loop {
        let expires_at = super::EXPIRES_AT.load(Ordering::Relaxed);
        if expires_at != 0 && super::watchdog::coarse_unix_secs() >= expires_at {
            tracing::info!(
                expires_at,
                "the lease ended and no daemon adopted the worker; ending"
            );
            let _ = std::fs::remove_file(&path);
            std::process::exit(EXIT_LEASE_OVER);
        }
        let mut pfd = libc::pollfd {
            fd: listener.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd for the duration of the call.
        let n = unsafe { libc::poll(&mut pfd, 1, POLL_MS) };
        if n <= 0 {
            continue;
        }
        let sock = match listener.accept() {
            Ok((s, _)) => s,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        };
        if peer_uid(&sock) != Some(0) {
            tracing::warn!("a process that is not root connected to the adoption socket; ignored");
            continue;
        }
        sock.set_nonblocking(false)?;
        let rejoin = WorkerRejoin {
            allocation_id,
            expires_at: super::EXPIRES_AT.load(Ordering::Relaxed),
        };
        let fds: Vec<_> = METER_FD.get().map(|fd| fd.as_fd()).into_iter().collect();
        if let Err(e) = ipc::send_frame(&sock, &Frame::new(&rejoin, vec![]), &fds) {
            tracing::warn!(error = %e, "cannot answer the adopting daemon; waiting for another");
            continue;
        }
        let _ = std::fs::remove_file(&path);
        tracing::info!("adopted by a new daemon");
        return Ok(sock);
    }
}

/// The uid of the process at the other end of `sock`.
pub fn peer_uid(sock: &UnixStream) -> Option<u32> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: cred and len are valid for getsockopt to write.
    let rc = unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    (rc == 0).then_some(cred.uid)
}

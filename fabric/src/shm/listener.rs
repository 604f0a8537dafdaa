//! The passive side: a unix stream socket at a filesystem path (never an
//! abstract name), accepting peers of this process's user or root only.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rfaas_proto::shm_control::MSG_LEN;

use super::connect::{self, Role};
use super::cq::ShmCq;
use super::domain::DomainState;
use super::endpoint::ShmEndpoint;
use super::sys;
use crate::error::{Error, Result};
use crate::{os, EndpointOptions};

static NEXT_NAME: AtomicU64 = AtomicU64::new(0);

/// A listening shm socket, unlinked when dropped (with its directory when
/// the listener made it).
#[derive(Debug)]
pub(crate) struct ShmListener {
    fd: OwnedFd,
    addr: String,
    /// The private directory made for a fresh socket (`listen("")`).
    own_dir: Option<std::path::PathBuf>,
    /// Connections whose peer's hello is not whole yet.
    pending: os::Pending,
}

impl ShmListener {
    /// Listens on `addr`: a socket path, or `""` for a fresh socket in a
    /// directory of its own (mode 0700, under `$XDG_RUNTIME_DIR` or the
    /// temporary directory). Abstract names (`@name`) are refused.
    pub(super) fn bind(addr: &str) -> Result<ShmListener> {
        let (addr, own_dir) = if addr.is_empty() {
            let dir = private_dir()?;
            (dir.join("sock").to_string_lossy().into_owned(), Some(dir))
        } else {
            (addr.to_owned(), None)
        };
        let listening = Self::bind_at(&addr, own_dir.clone());
        if let (Err(_), Some(dir)) = (&listening, &own_dir) {
            let _ = std::fs::remove_dir(dir);
        }
        listening
    }

    fn bind_at(addr: &str, own_dir: Option<std::path::PathBuf>) -> Result<ShmListener> {
        let addr = addr.to_owned();
        let target = sys::UnixAddr::parse(&addr)?;
        let fd = sys::stream_socket()?;
        sys::bind_listen(fd.as_raw_fd(), &target).map_err(|e| {
            let hint = if e.kind() == io::ErrorKind::AddrInUse {
                "; if no process serves it, remove the stale socket file"
            } else {
                ""
            };
            Error::io(
                "bind (shm listen)",
                io::Error::new(e.kind(), format!("cannot listen on {addr}: {e}{hint}")),
            )
        })?;
        Ok(ShmListener {
            fd,
            addr,
            own_dir,
            pending: os::Pending::default(),
        })
    }
}

impl ShmListener {
    /// Accepts one connection into the domain of `state`, waiting at most
    /// `timeout` (forever with `None`).
    pub(super) fn accept_into(
        &self,
        state: &Arc<DomainState>,
        cq: &mut ShmCq,
        opts: &EndpointOptions,
        timeout: Option<Duration>,
    ) -> Result<ShmEndpoint> {
        connect::check_options(opts)?;
        let deadline = timeout.and_then(|t| Instant::now().checked_add(t));
        let listener = self.fd.as_raw_fd();
        let take = || loop {
            match sys::accept(listener) {
                Ok(sock) => return Ok(Some((sock, self.addr.clone()))),
                // None left (or another thread took it).
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(None),
                // The client gave up already.
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::Interrupted | io::ErrorKind::ConnectionAborted
                    ) => {}
                Err(e) => return Err(e),
            }
        };
        // A peer is handed out once its whole hello has arrived, so a silent
        // one holds up nobody; it is dropped after `connect_timeout`.
        let peer = self
            .pending
            .next(listener, MSG_LEN, opts.connect_timeout, deadline, take)?
            .peer("shm accept")?;
        // The kernel's word on who connected: the grants below hand out
        // memory, so only this process's user and root may have them.
        // SAFETY: geteuid has no preconditions.
        let me = unsafe { libc::geteuid() };
        match sys::peer_cred(peer.fd.as_raw_fd()) {
            Some((_, uid)) if uid == me || uid == 0 => {}
            found => {
                let who = found.map_or("an unknown user".into(), |(pid, uid)| {
                    format!("uid {uid} (pid {pid})")
                });
                return Err(Error::Connect {
                    addr: self.addr.clone(),
                    reason: format!(
                        "refused a peer running as {who}: only this process's user (uid {me}) and root may connect over shm"
                    ),
                });
            }
        }
        // Its hello is there; only our answer can still wait (on a full
        // socket buffer).
        let hello_deadline = Instant::now() + opts.connect_timeout;
        let role = Role::Accept {
            listener: &self.addr,
        };
        match connect::establish(peer.fd, role, state, cq, opts, hello_deadline) {
            Err(Error::Timeout(_)) => Err(Error::Connect {
                addr: self.addr.clone(),
                reason: format!(
                    "the handshake did not finish within {} ms",
                    opts.connect_timeout.as_millis()
                ),
            }),
            other => other,
        }
    }

    /// The address peers connect to.
    pub(super) fn local(&self) -> String {
        self.addr.clone()
    }
}

impl Drop for ShmListener {
    fn drop(&mut self) {
        sys::unlink(&self.addr);
        if let Some(dir) = &self.own_dir {
            let _ = std::fs::remove_dir(dir);
        }
    }
}

/// A fresh directory of mode 0700 for a listener's socket.
fn private_dir() -> Result<std::path::PathBuf> {
    use std::os::unix::fs::DirBuilderExt;
    let base = std::env::var_os("XDG_RUNTIME_DIR")
        .map(std::path::PathBuf::from)
        .filter(|d| d.is_dir())
        .unwrap_or_else(std::env::temp_dir);
    loop {
        let n = NEXT_NAME.fetch_add(1, Ordering::Relaxed);
        let dir = base.join(format!("rfaas-shm-{}-{n}", std::process::id()));
        match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
            Ok(()) => return Ok(dir),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(Error::io("create the directory of a shm socket", e)),
        }
    }
}

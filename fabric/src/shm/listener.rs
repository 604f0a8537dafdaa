//! The passive side: a unix stream socket, by path or abstract name.

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

/// A listening shm socket. A filesystem socket is unlinked when dropped.
#[derive(Debug)]
pub(crate) struct ShmListener {
    fd: OwnedFd,
    addr: String,
    path: Option<String>,
    /// Connections whose peer's hello is not whole yet.
    pending: os::Pending,
}

impl ShmListener {
    /// Listens on `addr`: a socket path, `@name` (abstract), or `""` / `"@"`
    /// for a fresh abstract name.
    pub(super) fn bind(addr: &str) -> Result<ShmListener> {
        let addr = if addr.is_empty() || addr == "@" {
            let n = NEXT_NAME.fetch_add(1, Ordering::Relaxed);
            format!("@rfaas-shm-{}-{n}", std::process::id())
        } else {
            addr.to_owned()
        };
        let target = sys::UnixAddr::parse(&addr)?;
        let fd = sys::stream_socket()?;
        sys::bind_listen(fd.as_raw_fd(), &target).map_err(|e| {
            let hint = if e.kind() == io::ErrorKind::AddrInUse && !addr.starts_with('@') {
                "; if no process serves it, remove the stale socket file"
            } else {
                ""
            };
            Error::io(
                "bind (shm listen)",
                io::Error::new(e.kind(), format!("cannot listen on {addr}: {e}{hint}")),
            )
        })?;
        let path = (!addr.starts_with('@')).then(|| addr.clone());
        Ok(ShmListener {
            fd,
            addr,
            path,
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
        if let Some(path) = &self.path {
            sys::unlink(path);
        }
    }
}

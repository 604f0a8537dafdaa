//! The passive side: a unix stream socket, by path or abstract name.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::endpoint::{self, Role, ShmEndpoint};
use super::sys;
use super::{ShmCq, ShmDomain};
use crate::error::{Error, Result};
use crate::EndpointOptions;

static NEXT_NAME: AtomicU64 = AtomicU64::new(0);

/// A listening shm socket. A filesystem socket is unlinked when dropped.
#[derive(Debug)]
pub(crate) struct ShmListener {
    fd: OwnedFd,
    addr: String,
    path: Option<String>,
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
        Ok(ShmListener { fd, addr, path })
    }

    /// Accepts one connection, waiting at most `timeout` (forever with `None`).
    pub(crate) fn accept(
        &self,
        domain: &ShmDomain,
        cq: &mut ShmCq,
        opts: &EndpointOptions,
        timeout: Option<Duration>,
    ) -> Result<ShmEndpoint> {
        endpoint::check_options(opts)?;
        let deadline = timeout.and_then(|t| Instant::now().checked_add(t));
        loop {
            let ready = sys::wait_fd(self.fd.as_raw_fd(), libc::POLLIN, deadline)
                .map_err(|e| Error::io("poll (shm accept)", e))?;
            if !ready {
                return Err(Error::Timeout("shm accept"));
            }
            let sock = match sys::accept(self.fd.as_raw_fd()) {
                Ok(sock) => sock,
                // Another thread took it, or the client gave up already.
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock
                            | io::ErrorKind::Interrupted
                            | io::ErrorKind::ConnectionAborted
                    ) =>
                {
                    continue
                }
                Err(e) => return Err(Error::io("accept (shm)", e)),
            };
            // A silent peer cannot hold `accept` longer than the handshake
            // may take.
            let hello_deadline = Instant::now() + opts.connect_timeout;
            let hello_deadline = deadline.map_or(hello_deadline, |d| d.min(hello_deadline));
            let role = Role::Accept {
                listener: &self.addr,
            };
            return match endpoint::establish(sock, role, &domain.state, cq, opts, hello_deadline) {
                // The caller's own deadline did not pass: the peer was too slow.
                Err(Error::Timeout(_)) if deadline.map_or(true, |d| Instant::now() < d) => {
                    Err(Error::Connect {
                        addr: self.addr.clone(),
                        reason: format!(
                            "the peer sent no hello within {} ms",
                            opts.connect_timeout.as_millis()
                        ),
                    })
                }
                other => other,
            };
        }
    }

    /// The address peers connect to.
    pub(crate) fn local_addr(&self) -> String {
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

//! Connection set-up, both sides: dialling a listener (accepting is in
//! [`super::listener`]), the hello exchange with its descriptors, and the
//! checks on what the peer passed.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rfaas_proto::shm_control::{Hello, HelloError, HelloKind, RejectReason, MSG_LEN, VERSION};

use super::cq::ShmCq;
use super::domain::{DomainState, VALIDITY_BYTES};
use super::endpoint::ShmEndpoint;
use super::link::Link;
use super::progress::progress;
use super::ring::{self, Inbound, Outbound};
use super::sys::{self, Mapping};
use crate::error::{Error, Result};
use crate::EndpointOptions;

/// Dials the listener at `addr` and sets up an endpoint of `domain`.
pub(super) fn connect(
    addr: &str,
    domain: &Arc<DomainState>,
    cq: &mut ShmCq,
    opts: &EndpointOptions,
) -> Result<ShmEndpoint> {
    check_options(opts)?;
    let target = sys::UnixAddr::parse(addr)?;
    let deadline = Instant::now()
        .checked_add(opts.connect_timeout)
        .unwrap_or_else(|| Instant::now() + Duration::from_secs(86_400 * 365));
    let sock = sys::stream_socket()?;
    let mut backoff = Duration::from_millis(1);
    loop {
        match sys::connect(std::os::fd::AsRawFd::as_raw_fd(&sock), &target) {
            Ok(()) => break,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            // A unix listener with a full backlog: retry until the deadline.
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                let now = Instant::now();
                if now >= deadline {
                    return Err(Error::Timeout("shm connect"));
                }
                std::thread::sleep(backoff.min(deadline - now));
                backoff = (backoff * 2).min(Duration::from_millis(50));
            }
            Err(e) => {
                let what = match e.kind() {
                    std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused => {
                        "nothing listens at this address (is the peer up, is the path right?)"
                    }
                    std::io::ErrorKind::PermissionDenied => {
                        "the socket's permissions do not let this user connect"
                    }
                    _ => "cannot reach the listener",
                };
                return Err(sys::connect_error(addr, what, &e));
            }
        }
    }
    establish(sock, Role::Connect { addr }, domain, cq, opts, deadline)
}

/// Checks the depths a caller asked for.
pub(super) fn check_options(opts: &EndpointOptions) -> Result<()> {
    for (name, value) in [
        ("send_depth", opts.send_depth),
        ("recv_depth", opts.recv_depth),
    ] {
        if value == 0 || value > ring::MAX_CAP as usize {
            return Err(Error::InvalidArgument(format!(
                "EndpointOptions::{name} must be between 1 and {}, not {value}",
                ring::MAX_CAP
            )));
        }
    }
    Ok(())
}

/// Which side of the handshake we are.
pub(super) enum Role<'a> {
    /// We dialled `addr`.
    Connect { addr: &'a str },
    /// We accepted on the listener at `listener`.
    Accept { listener: &'a str },
}

/// The peer's half of the connection, checked and mapped.
struct PeerParts {
    out: Outbound,
    wake: OwnedFd,
    validity: Mapping,
}

/// Checks the peer's hello and descriptors, then maps its ring and table.
fn adopt(
    hello: &Hello,
    fds: Vec<OwnedFd>,
) -> std::result::Result<PeerParts, (RejectReason, String)> {
    if !ring::valid_cap(hello.ring_cap) {
        return Err((
            RejectReason::Malformed,
            format!(
                "the peer announced an immediate ring of {} entries",
                hello.ring_cap
            ),
        ));
    }
    let Ok([ring_fd, wake, validity_fd]) = <[OwnedFd; 3]>::try_from(fds) else {
        return Err((
            RejectReason::Descriptors,
            "the peer did not pass the 3 descriptors of the protocol".into(),
        ));
    };
    let bad = |why: String| (RejectReason::Descriptors, why);
    let ring_len = ring::ring_bytes(hello.ring_cap);
    sys::check_peer_memfd(ring_fd.as_raw_fd(), ring_len).map_err(bad)?;
    sys::check_peer_memfd(validity_fd.as_raw_fd(), VALIDITY_BYTES).map_err(bad)?;
    if !sys::is_socket(wake.as_raw_fd()) {
        return Err(bad("the peer's wake-up descriptor is not a socket".into()));
    }
    let ring_map =
        Mapping::new(ring_fd.as_raw_fd(), ring_len, true).map_err(|e| bad(e.to_string()))?;
    let validity = Mapping::new(validity_fd.as_raw_fd(), VALIDITY_BYTES, false)
        .map_err(|e| bad(e.to_string()))?;
    Ok(PeerParts {
        out: Outbound::new(ring_map, hello.ring_cap),
        wake,
        validity,
    })
}

/// Why a handshake read failed.
enum HelloFailure {
    Io(io::Error),
    Garbage(HelloError),
}

fn read_hello(
    fd: std::os::fd::RawFd,
    deadline: Instant,
) -> std::result::Result<(Hello, Vec<OwnedFd>), HelloFailure> {
    let mut buf = [0u8; MSG_LEN];
    let mut fds = Vec::new();
    sys::recv_exact(fd, &mut buf, &mut fds, deadline).map_err(HelloFailure::Io)?;
    let hello = Hello::decode(&buf).map_err(HelloFailure::Garbage)?;
    Ok((hello, fds))
}

/// Exchanges hellos on a fresh connection and builds the endpoint.
pub(super) fn establish(
    sock: OwnedFd,
    role: Role<'_>,
    domain: &Arc<DomainState>,
    cq: &mut ShmCq,
    opts: &EndpointOptions,
    deadline: Instant,
) -> Result<ShmEndpoint> {
    let (addr, timeout_what) = match role {
        Role::Connect { addr } => (addr, "shm connect"),
        Role::Accept { listener } => (listener, "shm accept"),
    };
    let fail = |reason: String| Error::Connect {
        addr: addr.to_owned(),
        reason,
    };
    let io_fail = |e: io::Error| match e.kind() {
        io::ErrorKind::TimedOut => Error::Timeout(timeout_what),
        io::ErrorKind::UnexpectedEof => {
            fail("the peer closed the connection during the handshake".into())
        }
        _ => fail(format!("the handshake failed: {e}")),
    };

    let cap = ring::ring_cap(opts.recv_depth);
    let inbound = Inbound::new(cap)?;
    let (wake_ours, wake_theirs) = sys::socketpair()?;
    let kind = match role {
        Role::Connect { .. } => HelloKind::Connect,
        Role::Accept { .. } => HelloKind::Accept,
    };
    let ours = Hello {
        kind,
        version: VERSION,
        pid: std::process::id(),
        send_depth: opts.send_depth as u32,
        recv_depth: opts.recv_depth as u32,
        ring_cap: inbound.cap(),
        reason: 0,
    };
    let our_fds = [
        inbound.fd(),
        wake_theirs.as_raw_fd(),
        domain.validity_ro.as_raw_fd(),
    ];
    let fd = sock.as_raw_fd();
    let reject = |reason: RejectReason| {
        let no = Hello {
            kind: HelloKind::Reject,
            reason: reason as u32,
            ..ours
        };
        // Best effort: the peer may already be gone.
        let _ = sys::send_all(fd, &no.encode(), &[], deadline);
    };

    let parts = match role {
        Role::Connect { .. } => {
            sys::send_all(fd, &ours.encode(), &our_fds, deadline).map_err(io_fail)?;
            let (theirs, fds) = match read_hello(fd, deadline) {
                Ok(h) => h,
                Err(HelloFailure::Io(e)) => return Err(io_fail(e)),
                Err(HelloFailure::Garbage(g)) => return Err(fail(g.to_string())),
            };
            match theirs.kind {
                HelloKind::Accept => {}
                HelloKind::Reject => {
                    return Err(fail(RejectReason::describe(theirs.reason).into()))
                }
                HelloKind::Connect => {
                    return Err(fail(
                        "the peer is connecting too, it does not listen".into(),
                    ))
                }
            }
            adopt(&theirs, fds).map_err(|(_, why)| fail(why))?
        }
        Role::Accept { .. } => {
            let (theirs, fds) = match read_hello(fd, deadline) {
                Ok(h) => h,
                Err(HelloFailure::Io(e)) => return Err(io_fail(e)),
                Err(HelloFailure::Garbage(g)) => {
                    if let HelloError::Version(_) = g {
                        reject(RejectReason::Version);
                    }
                    return Err(fail(g.to_string()));
                }
            };
            if theirs.kind != HelloKind::Connect {
                reject(RejectReason::Malformed);
                return Err(fail(format!(
                    "the peer opened with a {:?} hello",
                    theirs.kind
                )));
            }
            let parts = match adopt(&theirs, fds) {
                Ok(parts) => parts,
                Err((reason, why)) => {
                    reject(reason);
                    return Err(fail(why));
                }
            };
            sys::send_all(fd, &ours.encode(), &our_fds, deadline).map_err(io_fail)?;
            parts
        }
    };
    drop(wake_theirs);

    let peer = match role {
        Role::Connect { addr } => addr.to_owned(),
        Role::Accept { listener } => match sys::peer_cred(fd) {
            Some((pid, uid)) => format!("pid {pid} (uid {uid}) on {listener}"),
            None => format!("a peer on {listener}"),
        },
    };
    tracing::debug!(%peer, ring_cap = cap, "shm endpoint connected");
    let link = Arc::new(Link::new(
        sock,
        domain.clone(),
        opts.recv_depth,
        inbound,
        cq.shared().clone(),
        peer,
    ));
    let progress = progress()?;
    let token = progress.register(&link)?;
    let slot = match cq.attach(link.clone(), wake_ours) {
        Ok(slot) => slot,
        Err(e) => {
            progress.unregister(token);
            return Err(e);
        }
    };
    Ok(ShmEndpoint::new(
        link,
        slot,
        opts,
        parts.out,
        parts.wake,
        parts.validity,
        progress,
        token,
    ))
}

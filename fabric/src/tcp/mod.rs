//! The `tcp` provider: RDMA semantics in user space over TCP.
//!
//! Each endpoint is one TCP connection carrying the frames of
//! [`rfaas_proto::tcp_frame`]. The target of a one-sided operation checks it
//! against its domain's region table (rkey, domain, bounds, access right)
//! and applies it: writes land directly in the registered memory, reads are
//! answered from it, atomics run as CPU atomics on it.
//!
//! Progress is driven by whoever polls: [`TcpCq::poll`] reads and writes the
//! sockets of its endpoints itself, so a hot poller has no helper thread
//! between it and its socket. [`TcpCq::wait`] sleeps in `epoll_wait` on
//! those sockets. An endpoint whose completion queue nobody polls or waits
//! on (a passive target) is served by one progress thread per process
//! (`progress`), so one-sided operations complete as they would on a NIC.
//!
//! Acknowledgements ride on whatever frame flows back; a standalone `Ack`
//! goes out only when nothing else does (see `endpoint`), so a ping-pong
//! costs one `writev` and one `read` per side and message, like a plain
//! socket program.
//!
//! # Layout
//!
//! - `endpoint`: connection state, the receive state machine, the transmit
//!   queue, posting.
//! - `cq`: completion queues, `poll` and `wait`.
//! - `progress`: the passive-target progress thread.
//! - `sys`: the few socket and epoll calls std does not offer.

mod cq;
mod endpoint;
mod progress;
mod sys;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rfaas_proto::tcp_frame::{FrameHeader, FrameKind, HEADER_LEN};

pub(crate) use cq::TcpCq;
pub(crate) use endpoint::TcpEndpoint;

use crate::error::{Error, Result};
use crate::memory::{Access, MemoryRegion};
use crate::os;
use crate::registry::{register_soft, Registry};
use crate::EndpointOptions;

/// The opened tcp provider (stateless: the progress thread starts lazily).
#[derive(Debug)]
pub(crate) struct TcpFabric;

impl TcpFabric {
    pub(crate) fn open() -> Result<Self> {
        Ok(TcpFabric)
    }

    pub(crate) fn domain(&self) -> Result<TcpDomain> {
        Ok(TcpDomain {
            registry: Registry::new(),
        })
    }

    pub(crate) fn completion_queue(&self, depth: usize) -> Result<TcpCq> {
        TcpCq::new(depth)
    }

    pub(crate) fn listen(&self, addr: &str) -> Result<TcpListener> {
        let listener = std::net::TcpListener::bind(addr).map_err(|e| Error::Connect {
            addr: addr.to_owned(),
            reason: format!("cannot listen there: {e}"),
        })?;
        let local = listener
            .local_addr()
            .map_err(|e| Error::io("getsockname", e))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| Error::io("fcntl (listen)", e))?;
        Ok(TcpListener {
            listener,
            local,
            pending: os::Pending::default(),
        })
    }
}

/// A software protection domain: its own region table.
#[derive(Debug)]
pub(crate) struct TcpDomain {
    registry: Arc<Registry>,
}

impl TcpDomain {
    pub(crate) fn id(&self) -> u64 {
        self.registry.id()
    }

    pub(crate) fn register_buffer(
        &self,
        buf: crate::Buffer,
        access: Access,
    ) -> Result<MemoryRegion> {
        register_soft(&self.registry, buf, access)
    }

    pub(crate) fn connect(
        &self,
        addr: &str,
        cq: &mut TcpCq,
        opts: &EndpointOptions,
    ) -> Result<TcpEndpoint> {
        let connect_err = |reason: String| Error::Connect {
            addr: addr.to_owned(),
            reason,
        };
        let target: SocketAddr = addr
            .to_socket_addrs()
            .map_err(|e| connect_err(format!("cannot resolve the address: {e}")))?
            .next()
            .ok_or_else(|| connect_err("the address resolves to nothing".into()))?;
        let stream = TcpStream::connect_timeout(&target, opts.connect_timeout)
            .map_err(|e| connect_err(e.to_string()))?;
        establish(stream, addr, &self.registry, cq, opts)
    }
}

/// A listening socket.
#[derive(Debug)]
pub(crate) struct TcpListener {
    listener: std::net::TcpListener,
    local: SocketAddr,
    /// Connections whose peer's hello is not whole yet.
    pending: os::Pending,
}

impl TcpListener {
    pub(crate) fn accept(
        &self,
        domain: &TcpDomain,
        cq: &mut TcpCq,
        opts: &EndpointOptions,
        timeout: Option<Duration>,
    ) -> Result<TcpEndpoint> {
        let deadline = timeout.and_then(|t| Instant::now().checked_add(t));
        let take = || loop {
            match self.listener.accept() {
                Ok((stream, peer)) => return Ok(Some((OwnedFd::from(stream), peer.to_string()))),
                // None left (or another thread took it).
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return Ok(None),
                // The client gave up already.
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::Interrupted | std::io::ErrorKind::ConnectionAborted
                    ) => {}
                Err(e) => return Err(e),
            }
        };
        // A peer is handed out once its whole hello has arrived, so a silent
        // one holds up nobody; it is dropped after `connect_timeout`.
        let peer = self
            .pending
            .next(
                self.listener.as_raw_fd(),
                HEADER_LEN,
                opts.connect_timeout,
                deadline,
                take,
            )?
            .peer("accepting a tcp connection")?;
        let stream = TcpStream::from(peer.fd);
        // Accepted from a non-blocking listener: make sure it blocks, as
        // the handshake expects.
        stream
            .set_nonblocking(false)
            .map_err(|e| Error::io("fcntl (accept)", e))?;
        establish(stream, &peer.label, &domain.registry, cq, opts)
    }

    pub(crate) fn local_addr(&self) -> String {
        self.local.to_string()
    }
}

/// Exchanges `Hello` frames, then turns the stream into an endpoint.
fn establish(
    mut stream: TcpStream,
    peer: &str,
    registry: &Arc<Registry>,
    cq: &mut TcpCq,
    opts: &EndpointOptions,
) -> Result<TcpEndpoint> {
    let fail = |reason: String| Error::Connect {
        addr: peer.to_owned(),
        reason,
    };
    if opts.send_depth == 0 || opts.recv_depth == 0 {
        return Err(Error::InvalidArgument(
            "send_depth and recv_depth must be at least 1".into(),
        ));
    }
    cq.check_room(opts)?;
    stream
        .set_read_timeout(Some(opts.connect_timeout))
        .and_then(|()| stream.set_nodelay(true))
        .map_err(|e| Error::io("setsockopt", e))?;
    let hello = FrameHeader::hello(opts.send_depth as u64, opts.recv_depth as u64);
    stream
        .write_all(&hello.encode())
        .map_err(|e| fail(format!("sending the hello failed: {e}")))?;
    let mut bytes = [0u8; HEADER_LEN];
    stream
        .read_exact(&mut bytes)
        .map_err(|e| fail(format!("no hello from the peer: {e}")))?;
    let theirs = FrameHeader::decode(&bytes)
        .map_err(|e| fail(format!("the peer does not speak rfaas tcp: {e}")))?;
    if theirs.kind != FrameKind::Hello || theirs.arg0 == 0 || theirs.arg1 == 0 {
        return Err(fail(format!(
            "the peer answered {theirs} instead of a hello with nonzero depths"
        )));
    }
    sys::tune_socket(&stream)?;
    stream
        .set_read_timeout(None)
        .and_then(|()| stream.set_nonblocking(true))
        .map_err(|e| Error::io("fcntl", e))?;
    let peer_send_depth = usize::try_from(theirs.arg0)
        .unwrap_or(usize::MAX)
        .min(1 << 20);
    Ok(TcpEndpoint::new(
        stream,
        peer.to_owned(),
        registry.clone(),
        cq,
        opts,
        peer_send_depth,
    ))
}

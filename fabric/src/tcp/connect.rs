//! Connection set-up: listening, dialling, accepting, and the `Hello`
//! exchange that turns a TCP stream into an endpoint.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rfaas_proto::tcp_frame::{FrameHeader, FrameKind, HEADER_LEN};

use super::cq::TcpCq;
use super::endpoint::TcpEndpoint;
use super::{progress, sys};
use crate::error::{Error, Result};
use crate::os;
use crate::registry::Registry;
use crate::EndpointOptions;

/// Listens on `addr` (`host:port`; port 0 picks one).
pub(super) fn listen(addr: &str) -> Result<TcpListener> {
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

/// Dials the listener at `addr` and makes an endpoint of `registry`'s domain.
pub(super) fn connect(
    addr: &str,
    registry: &Arc<Registry>,
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
    establish(stream, addr, registry, cq, opts)
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
    /// Accepts one connection into the domain of `registry`
    /// ([`Listener::accept`](crate::provider::Listener::accept)).
    pub(super) fn accept_into(
        &self,
        registry: &Arc<Registry>,
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
        establish(stream, &peer.label, registry, cq, opts)
    }

    pub(super) fn addr(&self) -> String {
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
    let ep = TcpEndpoint::new(
        stream,
        peer.to_owned(),
        registry.clone(),
        cq.shared().clone(),
        opts,
        peer_send_depth,
    );
    cq.attach(ep.shared().clone(), opts);
    progress::register(ep.shared().clone());
    Ok(ep)
}

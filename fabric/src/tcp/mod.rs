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
//! between it and its socket. A queue with more than two endpoints first
//! asks `epoll_wait` (without sleeping) which sockets are readable and
//! reads only those, besides driving, without a read, the endpoints whose
//! work no readability announces (queued output, an acknowledgement owed,
//! frames stalled for want of a receive). [`TcpCq::wait`] sleeps in
//! `epoll_wait` on those sockets. An endpoint whose completion queue nobody polls or waits
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
//! - `connect`: connection set-up: listening, dialling, accepting and the
//!   hello exchange.
//! - `endpoint`: the data path: a connection's state and posting;
//!   `endpoint::transmit` sends frames, `endpoint::receive` drives progress
//!   and carries out the peer's requests.
//! - `claim`: the atomic claim on a connection's state that lets posting,
//!   polling and the progress thread share it without a lock.
//! - `cq`: completion queues, `poll` and `wait`; `queue`: the part of
//!   one that endpoints and the progress thread see.
//! - `progress`: the passive-target progress thread; `wake`: its
//!   doorbell.
//! - `sys`: the few socket and epoll calls std does not offer.

mod claim;
mod connect;
mod cq;
mod endpoint;
mod progress;
mod queue;
mod sys;
mod wake;

#[cfg(test)]
mod tests;

use std::sync::Arc;
use std::time::Duration;

pub(crate) use connect::TcpListener;
pub(crate) use cq::TcpCq;
pub(crate) use endpoint::TcpEndpoint;

use crate::error::Result;
use crate::memory::{Access, MemoryRegion};
use crate::provider;
use crate::registry::{register_soft, Registry};
use crate::EndpointOptions;

/// The opened tcp provider (stateless: the progress thread starts lazily).
#[derive(Debug)]
pub(crate) struct TcpFabric;

impl TcpFabric {
    pub(crate) fn open() -> Result<Self> {
        Ok(TcpFabric)
    }
}

impl provider::Provider for TcpFabric {
    type Domain = TcpDomain;
    type Cq = TcpCq;
    type Listener = TcpListener;
    type Endpoint = TcpEndpoint;

    fn domain(&self) -> Result<TcpDomain> {
        Ok(TcpDomain {
            registry: Registry::new(),
        })
    }

    fn completion_queue(&self, depth: usize) -> Result<TcpCq> {
        TcpCq::new(depth)
    }

    fn listen(&self, addr: &str) -> Result<TcpListener> {
        connect::listen(addr)
    }
}

/// A software protection domain: its own region table.
#[derive(Debug)]
pub(crate) struct TcpDomain {
    registry: Arc<Registry>,
}

impl provider::Listener<TcpFabric> for TcpListener {
    fn accept(
        &self,
        domain: &TcpDomain,
        cq: &mut TcpCq,
        opts: &EndpointOptions,
        timeout: Option<Duration>,
    ) -> Result<TcpEndpoint> {
        self.accept_into(&domain.registry, cq, opts, timeout)
    }

    fn local_addr(&self) -> String {
        self.addr()
    }
}

impl provider::Domain<TcpFabric> for TcpDomain {
    fn id(&self) -> u64 {
        self.registry.id()
    }

    fn register_buffer(&self, buf: crate::Buffer, access: Access) -> Result<MemoryRegion> {
        register_soft(&self.registry, buf, access)
    }

    fn connect(&self, addr: &str, cq: &mut TcpCq, opts: &EndpointOptions) -> Result<TcpEndpoint> {
        connect::connect(addr, &self.registry, cq, opts)
    }
}

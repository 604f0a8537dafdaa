//! An established connection: its queue pair, its rdma_cm id and event
//! channel, and what has become of it (its [`Fate`]), which the monitor
//! thread records from rdma_cm events and completions read.

use std::fmt;
use std::net::SocketAddr;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU8, AtomicUsize};
use std::sync::Arc;

use rdma_sys::{rdma_cm_event_type, rdma_disconnect};

use super::cm::{try_get_event, CmEvent, CmId, EventChannel};
use super::fate::{ConnShared, Fate};
use super::hello::Hello;
use super::monitor::Watched;
use super::qp::Qp;
use crate::EndpointOptions;

/// An established connection. Field order is drop order: the QP goes
/// before the cm id, the id before its event channel.
pub(crate) struct Conn {
    pub(super) shared: Arc<ConnShared>,
    pub(super) qp: Qp,
    id: CmId,
    channel: EventChannel,
    pub(super) local: Option<SocketAddr>,
    pub(super) send_depth: usize,
    pub(super) recv_depth: usize,
    peer_hello: Hello,
}

impl Conn {
    /// A connection `connect` has established with `peer` on `device`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new(
        peer: String,
        device: &str,
        qp: Qp,
        id: CmId,
        channel: EventChannel,
        opts: &EndpointOptions,
        peer_hello: Hello,
    ) -> Conn {
        let local = id.local_addr();
        Conn {
            shared: Arc::new(ConnShared {
                fate: AtomicU8::new(Fate::Alive as u8),
                peer,
                device: device.to_owned(),
                sends: AtomicUsize::new(0),
            }),
            qp,
            id,
            channel,
            local,
            send_depth: opts.send_depth,
            recv_depth: opts.recv_depth,
            peer_hello,
        }
    }

    fn lost(&self, fate: Fate, event: &CmEvent) {
        self.shared.set_fate(fate);
        tracing::info!(peer = %self.shared.peer, device = %self.shared.device, event = %event.name(), "verbs connection lost");
        if let Err(e) = self.qp.to_error() {
            tracing::warn!(peer = %self.shared.peer, error = %e, "could not move the queue pair to ERR");
        }
    }
}

impl Watched for Conn {
    fn channel_fd(&self) -> RawFd {
        self.channel.fd()
    }

    /// Handles every queued rdma_cm event of this connection (monitor thread).
    fn handle_cm_events(&self) {
        loop {
            let event = match try_get_event(&self.channel) {
                Ok(Some(event)) => event,
                Ok(None) => return,
                Err(e) => {
                    tracing::debug!(peer = %self.shared.peer, error = %e, "rdma_get_cm_event failed");
                    return;
                }
            };
            match event.kind {
                rdma_cm_event_type::RDMA_CM_EVENT_DISCONNECTED => {
                    self.lost(Fate::PeerClosed, &event);
                    // Answer the peer's disconnect request (DREP) now rather than at drop.
                    // SAFETY: the id is valid while self lives.
                    unsafe { rdma_disconnect(self.id.raw()) };
                }
                rdma_cm_event_type::RDMA_CM_EVENT_DEVICE_REMOVAL => {
                    self.lost(Fate::DeviceRemoved, &event)
                }
                _ => {
                    tracing::debug!(peer = %self.shared.peer, event = %event.name(), "rdma_cm event ignored")
                }
            }
        }
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        self.shared.set_fate(Fate::LocalClose);
        // Flush everything, then tell the peer; the fields then destroy the
        // QP (reclaiming its slots), the id and the channel, in that order.
        let _ = self.qp.to_error();
        // SAFETY: the id is valid; disconnecting twice only returns EINVAL.
        unsafe { rdma_disconnect(self.id.raw()) };
    }
}

impl fmt::Debug for Conn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Conn")
            .field("shared", &self.shared)
            .field("qp", &self.qp)
            .field("local", &self.local)
            .field("send_depth", &self.send_depth)
            .field("recv_depth", &self.recv_depth)
            .field("peer_hello", &self.peer_hello)
            .finish()
    }
}

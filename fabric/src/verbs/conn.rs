//! An established connection: its queue pair, its rdma_cm id and event
//! channel, and what has become of it (its [`Fate`]), which the monitor
//! thread records from rdma_cm events and completions read.

use std::fmt;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;

use rdma_sys::{rdma_cm_event_type, rdma_disconnect};

use super::cm::{try_get_event, CmEvent, CmId, EventChannel};
use super::hello::Hello;
use super::qp::Qp;
use crate::error::Error;
use crate::EndpointOptions;

/// What has become of a connection; the first cause recorded wins.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Fate {
    Alive = 0,
    /// rdma_cm reported RDMA_CM_EVENT_DISCONNECTED.
    PeerClosed = 1,
    /// Transport or RNR retries ran out: the peer stopped answering.
    PeerSilent = 2,
    /// rdma_cm reported RDMA_CM_EVENT_DEVICE_REMOVAL.
    DeviceRemoved = 3,
    /// An error completion (bad rkey, bounds, rights) stopped the QP.
    QpError = 4,
    /// This side closed the endpoint.
    LocalClose = 5,
}

impl Fate {
    fn from_u8(v: u8) -> Fate {
        match v {
            0 => Fate::Alive,
            1 => Fate::PeerClosed,
            2 => Fate::PeerSilent,
            3 => Fate::DeviceRemoved,
            4 => Fate::QpError,
            _ => Fate::LocalClose,
        }
    }

    /// Whether flushed requests are the peer's doing (Status::PeerLost).
    pub(crate) fn is_peer_lost(self) -> bool {
        matches!(
            self,
            Fate::PeerClosed | Fate::PeerSilent | Fate::DeviceRemoved
        )
    }

    fn reason(self, device: &str) -> String {
        match self {
            Fate::Alive => "it is open".into(),
            Fate::PeerClosed => "the peer disconnected (RDMA_CM_EVENT_DISCONNECTED)".into(),
            Fate::PeerSilent => "the peer stopped answering (transport retries exhausted)".into(),
            Fate::DeviceRemoved => {
                format!("RDMA device {device} was removed (RDMA_CM_EVENT_DEVICE_REMOVAL)")
            }
            Fate::QpError => {
                "its queue pair stopped at an error completion (a refused access, such as a bad \
                              rkey, stops an RC connection on both sides); connect again"
                    .into()
            }
            Fate::LocalClose => "it was closed locally".into(),
        }
    }
}

/// The part of a connection that completions and the monitor look at.
pub(crate) struct ConnShared {
    fate: AtomicU8,
    pub(super) peer: String,
    pub(super) device: String,
}

impl ConnShared {
    pub(crate) fn fate(&self) -> Fate {
        Fate::from_u8(self.fate.load(Ordering::Acquire))
    }

    /// Records `fate` unless another was recorded first.
    pub(crate) fn set_fate(&self, fate: Fate) {
        let _ = self.fate.compare_exchange(
            Fate::Alive as u8,
            fate as u8,
            Ordering::AcqRel,
            Ordering::Acquire,
        );
    }

    pub(super) fn disconnected(&self, fate: Fate) -> Error {
        Error::Disconnected {
            peer: self.peer.clone(),
            reason: fate.reason(&self.device),
        }
    }
}

impl fmt::Debug for ConnShared {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConnShared")
            .field("peer", &self.peer)
            .field("fate", &self.fate())
            .finish()
    }
}

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

    pub(crate) fn channel_fd(&self) -> i32 {
        self.channel.fd()
    }

    /// Handles every queued rdma_cm event of this connection (monitor thread).
    pub(crate) fn handle_cm_events(&self) {
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

    fn lost(&self, fate: Fate, event: &CmEvent) {
        self.shared.set_fate(fate);
        tracing::info!(peer = %self.shared.peer, device = %self.shared.device, event = %event.name(), "verbs connection lost");
        if let Err(e) = self.qp.to_error() {
            tracing::warn!(peer = %self.shared.peer, error = %e, "could not move the queue pair to ERR");
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fates_round_trip_and_only_the_first_sticks() {
        for fate in [
            Fate::Alive,
            Fate::PeerClosed,
            Fate::PeerSilent,
            Fate::DeviceRemoved,
            Fate::QpError,
            Fate::LocalClose,
        ] {
            assert_eq!(Fate::from_u8(fate as u8), fate);
        }
        let shared = ConnShared {
            fate: AtomicU8::new(Fate::Alive as u8),
            peer: "192.0.2.1:7000".into(),
            device: "rxe0".into(),
        };
        shared.set_fate(Fate::PeerClosed);
        shared.set_fate(Fate::LocalClose);
        assert_eq!(shared.fate(), Fate::PeerClosed);
        let err = shared.disconnected(shared.fate()).to_string();
        assert!(
            err.contains("192.0.2.1:7000") && err.contains("DISCONNECTED"),
            "{err}"
        );
    }

    #[test]
    fn dead_rc_queue_pairs_say_to_reconnect() {
        assert!(Fate::QpError.reason("rxe0").contains("connect again"));
        assert!(Fate::DeviceRemoved.reason("rxe0").contains("rxe0"));
    }
}

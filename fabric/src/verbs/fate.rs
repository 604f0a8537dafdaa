//! What has become of a connection (its [`Fate`]), and the part of it
//! that completions and the monitor look at ([`ConnShared`]).

use std::fmt;
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};

use crate::error::Error;

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
    pub(super) fate: AtomicU8,
    pub(super) peer: String,
    pub(super) device: String,
    /// Send work requests handed to the NIC whose completions are not
    /// polled yet: what they take of the send queue, never less than the
    /// truth (a batch checks its room against it).
    pub(super) sends: AtomicUsize,
}

impl ConnShared {
    /// A send work request of this connection completed (polled).
    pub(crate) fn send_polled(&self) {
        self.sends.fetch_sub(1, Ordering::Release);
    }

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
            sends: AtomicUsize::new(0),
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

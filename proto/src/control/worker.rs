//! Executor daemon ↔ worker process (a socket pair): the assignment, the
//! worker's answer, and a renewal's new end.

use serde::{Deserialize, Serialize};

use super::client::{Descriptor, Mode};
use super::frame::message_kinds;
use super::ErrorReply;

/// Daemon → serving worker: refuse invocations from `expires_at` (Unix
/// seconds) on, instead of the assignment's end. The worker answers with
/// the same message once its lanes use it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExpiryMoved {
    /// The lease's new end, Unix seconds.
    pub expires_at: u64,
}

/// Daemon → worker: serve an allocation. The library arrives as a memfd
/// passed with this frame (SCM_RIGHTS), followed by the allocation's meter
/// area ([`crate::meter`]) when the daemon meters it; the worker drops
/// privileges to `uid`/`gid` before it loads the library.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Assignment {
    /// The allocation's id.
    pub allocation_id: u64,
    /// User to run as.
    pub uid: u32,
    /// Group to run as.
    pub gid: u32,
    /// CPUs to pin the worker threads to, one per thread, in thread order;
    /// empty means no pinning.
    pub cpus: Vec<u32>,
    /// The allocation's lane key, 48 hex digits: a connection serves a
    /// lane only after a [`LaneHello`](crate::hello::LaneHello) with it.
    pub lane_key: String,
    /// Lanes: connections, each with its input buffer and meter record.
    pub lanes: u16,
    /// Worker threads serving the lanes, lane `i` on thread `i mod
    /// threads`; 0 (from a daemon that does not say) means one per lane.
    #[serde(default)]
    pub threads: u16,
    /// Slots per lane ([`AllocateRequest::slots`](super::client::AllocateRequest::slots));
    /// 0 (from a daemon that does not say) means one.
    #[serde(default)]
    pub slots: u16,
    /// Address-space limit for the process in bytes (0: none), used when
    /// the daemon cannot apply a cgroup limit.
    pub memory_limit_bytes: u64,
    /// The allocation's memory, MiB, as asked for (for messages; 0 from a
    /// daemon that does not say).
    #[serde(default)]
    pub memory_mib: u32,
    /// The largest bulk payload a lane pulls, bytes (0: the worker's own
    /// rule, `memory_limit_bytes` or a default).
    #[serde(default)]
    pub pull_limit_bytes: u64,
    /// How lanes wait.
    pub mode: Mode,
    /// Hot period of [`Mode::HotThenWarm`], microseconds.
    pub hot_timeout_us: u64,
    /// Bytes of each lane's input buffer, header included.
    pub input_capacity: u32,
    /// Bytes of each lane's output buffer.
    pub output_capacity: u32,
    /// The deadline, milliseconds.
    pub deadline_ms: u64,
    /// When the lease ends, Unix seconds.
    pub expires_at: u64,
    /// Symbol names to resolve, in table order.
    pub functions: Vec<String>,
    /// The fabric provider.
    pub provider: String,
    /// Where to listen (`host:0` for tcp and verbs, a socket path for shm).
    pub listen_addr: String,
    /// As in
    /// [`AllocateRequest::read_only_input`](super::client::AllocateRequest::read_only_input).
    #[serde(default)]
    pub read_only_input: bool,
    /// The allocation's runtime directory: a worker that outlives its
    /// daemon waits there (`adopt.sock`) for the next one. Empty (from a
    /// daemon that does not say, or one that does not keep its workers):
    /// the worker ends with its daemon's socket.
    #[serde(default)]
    pub adopt_dir: String,
}

impl Assignment {
    /// The worker threads to run: [`threads`](Self::threads), one per lane
    /// for 0, never more than the lanes.
    pub fn thread_count(&self) -> u16 {
        match self.threads {
            0 => self.lanes,
            t => t.min(self.lanes),
        }
    }

    /// Slots per lane: [`slots`](Self::slots), one for 0.
    pub fn slot_count(&self) -> u16 {
        self.slots.max(1)
    }
}

/// Worker → daemon: the assignment is loaded and listening.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerReady {
    /// The address clients connect to.
    pub fabric_addr: String,
    /// Each lane's input buffer; with several slots, `len` is one slot's
    /// capacity.
    pub lanes: Vec<Descriptor>,
    /// Bytes from one slot's start to the next's; 0 (from a worker that
    /// does not say) with one slot.
    #[serde(default)]
    pub slot_stride: u32,
    /// Nanoseconds spent loading the library and resolving the functions.
    pub load_ns: u64,
    /// Nanoseconds spent creating the fabric resources and listening.
    pub listen_ns: u64,
}

/// Worker → daemon: the assignment failed, with the refusal the daemon
/// passes on to the client (the same JSON as an [`ErrorReply`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct WorkerFailed(pub ErrorReply);

/// Worker → the daemon that connected to its `adopt.sock`: the worker
/// takes it as its daemon from now on. Its meter area is passed alongside
/// (SCM_RIGHTS), so the adopting daemon meters it where the first left off.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerRejoin {
    /// The allocation it serves.
    pub allocation_id: u64,
    /// Its lease's end as it applies it, Unix seconds.
    pub expires_at: u64,
}

message_kinds! {
    Assignment => Assignment,
    WorkerReady => WorkerReady,
    WorkerFailed => WorkerFailed,
    ExpiryMoved => ExpiryMoved,
    WorkerRejoin => WorkerRejoin,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::{ControlError, ErrorCode, Frame, Kind};

    #[test]
    fn a_message_type_fixes_its_frame_kind() {
        let reply = ErrorReply {
            request_id: 4,
            code: ErrorCode::MalformedLibrary,
            message: "no".into(),
        };
        let as_error = Frame::new(&reply, vec![]);
        let as_failed = Frame::new(&WorkerFailed(reply.clone()), vec![]);
        assert_eq!(as_error.kind, Kind::Error);
        assert_eq!(as_failed.kind, Kind::WorkerFailed);
        // The same body, told apart only by the kind.
        assert_eq!(as_error.json, as_failed.json);
        assert_eq!(as_failed.parse::<WorkerFailed>().unwrap().0, reply);
        assert!(matches!(
            as_failed.parse::<ErrorReply>(),
            Err(ControlError::UnexpectedKind {
                expected: Kind::Error,
                got: Kind::WorkerFailed
            })
        ));
    }

    #[test]
    fn threads_default_to_one_per_lane_and_never_exceed_the_lanes() {
        let json = serde_json::json!({
            "allocation_id": 1, "uid": 1000, "gid": 1000, "cpus": [0, 1],
            "lane_key": "00", "lanes": 16, "memory_limit_bytes": 0,
            "mode": "hot", "hot_timeout_us": 0, "input_capacity": 4096,
            "output_capacity": 4096, "deadline_ms": 0, "expires_at": 0,
            "functions": ["noop"], "provider": "shm", "listen_addr": "x"
        });
        // From a daemon that does not say: one thread per lane, as before.
        let mut a: Assignment = serde_json::from_value(json.clone()).unwrap();
        assert_eq!((a.threads, a.thread_count()), (0, 16));
        a.threads = 2;
        assert_eq!(a.thread_count(), 2);
        let back: Assignment = serde_json::from_str(&serde_json::to_string(&a).unwrap()).unwrap();
        assert_eq!(back, a);
        a.threads = 40;
        assert_eq!(
            a.thread_count(),
            16,
            "a thread without lanes serves nothing"
        );
    }
}

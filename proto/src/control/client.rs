//! Client ↔ executor daemon (TCP): allocation, renewal, deallocation, and
//! the daemon's word when a worker ends.

use serde::{Deserialize, Serialize};

use super::frame::message_kinds;

/// How a worker thread waits for invocations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// Busy-polls its completion queue: the lowest latency, a whole core.
    Hot,
    /// Sleeps in the kernel until a request comes.
    Warm,
    /// Busy-polls for `hot_timeout_us` after each invocation, then sleeps.
    HotThenWarm,
}

/// A registered memory range of the worker, as the client names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Descriptor {
    /// Address.
    pub addr: u64,
    /// Remote key.
    pub rkey: u32,
    /// Length in bytes.
    pub len: u32,
}

/// Client → executor: start a worker for a lease. The frame's blob is the
/// function library (an ELF shared object).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AllocateRequest {
    /// Repeated in the reply.
    pub request_id: u64,
    /// The lease token ([`crate::lease`]).
    pub token: String,
    /// Worker threads, one core each; at most the lease's cores.
    pub cores: u16,
    /// Memory limit of the worker process, MiB; at most the lease's memory.
    pub memory_mib: u32,
    /// How the worker threads wait.
    pub mode: Mode,
    /// For [`Mode::HotThenWarm`]: how long a thread polls after an
    /// invocation before it sleeps, in microseconds.
    pub hot_timeout_us: u64,
    /// Bytes of each lane's input buffer, header included; bigger payloads
    /// are pulled by the worker in chunks.
    pub input_capacity: u32,
    /// Bytes a function may write per invocation (the worker's output
    /// buffer; a guard page follows it).
    pub output_capacity: u32,
    /// Longest a function may run, in milliseconds; 0 means the executor's
    /// default.
    pub deadline_ms: u64,
    /// The functions the client will call, by symbol name; their order is
    /// the function table (index 0 is the first).
    pub functions: Vec<String>,
    /// A name for the library, for logs.
    pub library_name: String,
    /// The fabric provider the client speaks (`tcp`, `shm`, `verbs:<dev>`).
    pub provider: String,
    /// The client promises that the functions never write to their input.
    /// On a provider that shares memory with the client (shm), a payload
    /// bigger than the input buffer is then read in place, without a copy,
    /// through a read-only mapping (a function that writes to it faults).
    #[serde(default)]
    pub read_only_input: bool,
    /// Lanes: connections to the worker, each with its own input buffer;
    /// the worker's `cores` threads serve them all (lane `i` on thread
    /// `i mod cores`). 0, or absent (older clients), means one lane per
    /// core.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub lanes: u16,
    /// Slots per lane: invocations one lane holds in flight at once, each
    /// with its own part of the lane's input buffer and its own output
    /// buffer in the worker. A power of two, at most [`MAX_SLOTS`]. 0, or
    /// absent (older clients), means one.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub slots: u16,
}

/// The most slots a lane may have ([`AllocateRequest::slots`]).
pub const MAX_SLOTS: u16 = 64;

/// Why a slot count is refused: not a power of two, or above
/// [`MAX_SLOTS`]. `None` for a valid count (0 means 1).
pub fn slots_refusal(slots: u16) -> Option<String> {
    if slots > MAX_SLOTS {
        return Some(format!(
            "slots {slots} is more than a lane holds (at most {MAX_SLOTS})"
        ));
    }
    if slots > 1 && !slots.is_power_of_two() {
        return Some(format!(
            "slots {slots} is not a power of two (an invocation's slot is its id modulo the slots)"
        ));
    }
    None
}

fn is_zero(n: &u16) -> bool {
    *n == 0
}

impl AllocateRequest {
    /// The lanes the request asks for: [`lanes`](Self::lanes), or one per
    /// core when it says 0.
    pub fn lane_count(&self) -> u16 {
        if self.lanes == 0 {
            self.cores
        } else {
            self.lanes
        }
    }

    /// Worker threads: one per core, and never more than there are lanes.
    pub fn thread_count(&self) -> u16 {
        self.cores.min(self.lane_count())
    }

    /// Slots per lane: [`slots`](Self::slots), or one when it says 0.
    pub fn slot_count(&self) -> u16 {
        self.slots.max(1)
    }
}

/// Time spent in each phase of an allocation on the executor, nanoseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AllocatePhases {
    /// Parsing the request and checking the token and capacity.
    pub validate_ns: u64,
    /// Taking a pooled worker, or spawning one.
    pub worker_ns: u64,
    /// The worker loading the library and building the function table.
    pub load_ns: u64,
    /// The worker registering buffers and listening.
    pub listen_ns: u64,
}

/// Executor → client: the worker is ready.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AllocateOk {
    /// The request's id.
    pub request_id: u64,
    /// The allocation's id on this executor.
    pub allocation_id: u64,
    /// The lease it runs under.
    pub lease_id: u64,
    /// The fabric address of the worker's listener; connect once per lane.
    pub fabric_addr: String,
    /// Input buffer of each lane, in lane order.
    pub lanes: Vec<Descriptor>,
    /// The allocation's lane key, 48 hex digits: the client's first write
    /// on every lane is a [`LaneHello`](crate::hello::LaneHello) with it.
    pub lane_key: String,
    /// The function table: `functions[i]` is called with index `i`.
    pub functions: Vec<String>,
    /// The output capacity granted (bytes per invocation).
    pub output_capacity: u32,
    /// The function deadline in force, milliseconds.
    pub deadline_ms: u64,
    /// When the lease ends (Unix seconds); the worker refuses invocations
    /// from then on.
    pub expires_at: u64,
    /// Whether a pre-spawned worker was used.
    pub pooled: bool,
    /// Where the executor spent its time.
    pub phases: AllocatePhases,
    /// The largest input (bytes) one invocation may carry: what the
    /// allocation's memory leaves for pulling a payload bigger than the
    /// input buffer. 0 from an executor that does not say.
    #[serde(default)]
    pub max_input_bytes: u64,
    /// The allocation's attach secret, 32 hex digits: after the executor
    /// restarted, an [`Attach`] with it takes the allocation up on a new
    /// connection. Empty from an executor that does not keep its workers
    /// across restarts.
    #[serde(default)]
    pub attach_secret: String,
    /// Slots per lane granted: invocation `id` of a lane goes to slot
    /// `id % slots`, at byte `slot × slot_stride` of the lane's input
    /// buffer, whose [`Descriptor::len`] is then one slot's capacity. 0,
    /// or absent (older executors), means one slot.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub slots: u16,
    /// Bytes from one slot's start to the next's (see
    /// [`slots`](Self::slots)); 0 with one slot.
    #[serde(default, skip_serializing_if = "is_zero_u32")]
    pub slot_stride: u32,
}

fn is_zero_u32(n: &u32) -> bool {
    *n == 0
}

/// Client → executor, on a new connection after the one an allocation
/// was made on ended: take it up on this connection (the executor
/// restarted and adopted its worker). Answered [`Attached`], or an
/// [`ErrorReply`](super::ErrorReply) `unknown_allocation`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Attach {
    /// Repeated in the reply.
    pub request_id: u64,
    /// Which allocation.
    pub allocation_id: u64,
    /// [`AllocateOk::attach_secret`].
    pub secret: String,
}

/// Executor → client: the allocation is this connection's now; its
/// `WorkerExited` comes here, and the connection's end ends it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Attached {
    /// The request's id.
    pub request_id: u64,
    /// Which allocation.
    pub allocation_id: u64,
    /// The allocation's end, Unix seconds.
    pub expires_at: u64,
}

/// Client → executor: end an allocation and stop its worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Deallocate {
    /// Repeated in the reply.
    pub request_id: u64,
    /// Which allocation.
    pub allocation_id: u64,
}

/// Executor → client: the allocation is gone and its cores are free.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Deallocated {
    /// The request's id.
    pub request_id: u64,
    /// Which allocation.
    pub allocation_id: u64,
}

/// Client → executor: move an allocation's end to that of a new token for
/// its lease (the manager renewed the lease). The token must verify, name
/// this node and the allocation's lease, and end no earlier than the
/// allocation does now.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RenewLease {
    /// Repeated in the reply.
    pub request_id: u64,
    /// Which allocation (made on this connection).
    pub allocation_id: u64,
    /// The renewed lease's token ([`crate::lease`]).
    pub token: String,
}

/// Executor → client: the allocation now ends at `expires_at`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseRenewed {
    /// The request's id.
    pub request_id: u64,
    /// Which allocation.
    pub allocation_id: u64,
    /// The allocation's new end, Unix seconds.
    pub expires_at: u64,
}

/// Why a worker process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum ExitCause {
    /// Killed by a signal it raised itself (a function crashed: SIGSEGV,
    /// SIGBUS, SIGABRT, SIGFPE, SIGILL, ...).
    Crashed,
    /// A function ran past the deadline and the worker ended itself.
    DeadlineExceeded,
    /// The lease expired and the executor stopped the worker.
    LeaseExpired,
    /// The executor is shutting down and stopped the worker.
    Stopped,
    /// The worker exited on its own (an internal failure).
    Exited,
    /// The kernel killed the worker because the allocation used more memory
    /// than it was given (a cgroup `memory.max`; under `RLIMIT_AS` the
    /// function's allocation fails instead, and it usually crashes).
    OutOfMemory,
    /// The node is being retrieved (drained) and the executor stopped the
    /// worker after the grace period.
    Drained,
}

/// Executor → client, unsolicited: an allocation's worker ended. Its cores
/// are free again; the allocation is gone.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerExited {
    /// Which allocation.
    pub allocation_id: u64,
    /// Why.
    pub cause: ExitCause,
    /// The terminating signal, if a signal ended it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signal: Option<i32>,
    /// The exit status, if it exited.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    /// For people: what happened, e.g. "worker 1234 killed by SIGSEGV".
    pub message: String,
}

message_kinds! {
    AllocateRequest => AllocateRequest,
    AllocateOk => AllocateOk,
    Deallocate => Deallocate,
    Deallocated => Deallocated,
    WorkerExited => WorkerExited,
    RenewLease => RenewLease,
    LeaseRenewed => LeaseRenewed,
    Attach => Attach,
    Attached => Attached,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::frame::small_frame;
    use crate::control::local::LocalRequest;
    use crate::control::worker::ExpiryMoved;
    use crate::control::{ControlError, ErrorCode, ErrorReply, Frame, FrameLimits};

    #[test]
    fn frame_round_trip_with_blob() {
        let req = AllocateRequest {
            request_id: 3,
            token: "rfaas2.x.y".into(),
            cores: 2,
            memory_mib: 256,
            mode: Mode::HotThenWarm,
            hot_timeout_us: 500,
            input_capacity: 4096,
            output_capacity: 4096,
            deadline_ms: 0,
            functions: vec!["echo".into(), "noop".into()],
            library_name: "libfunctions.so".into(),
            provider: "tcp".into(),
            read_only_input: true,
            lanes: 0,
            slots: 0,
        };
        let frame = Frame::new(&req, vec![0x7f, b'E', b'L', b'F']);
        let bytes = frame.to_bytes();
        assert_eq!(&bytes[..4], b"RFAX");
        assert_eq!(&bytes[bytes.len() - 4..], b"\x7fELF");
        let json_len = u32::from_le_bytes(bytes[8..12].try_into().unwrap()) as usize;
        let json = std::str::from_utf8(&bytes[16..16 + json_len]).unwrap();
        assert_eq!(
            json,
            r#"{"request_id":3,"token":"rfaas2.x.y","cores":2,"memory_mib":256,"mode":"hot_then_warm","hot_timeout_us":500,"input_capacity":4096,"output_capacity":4096,"deadline_ms":0,"functions":["echo","noop"],"library_name":"libfunctions.so","provider":"tcp","read_only_input":true}"#
        );
        let back = Frame::read_from(&mut &bytes[..], FrameLimits::default()).unwrap();
        assert_eq!(back, frame);
        assert_eq!(back.parse::<AllocateRequest>().unwrap(), req);
        let err = back.parse::<Deallocate>().unwrap_err();
        assert!(matches!(err, ControlError::UnexpectedKind { .. }));
        // A request without the field promises nothing.
        let older = json.replace(r#","read_only_input":true"#, "");
        let older: AllocateRequest = serde_json::from_str(&older).unwrap();
        assert!(!older.read_only_input);
    }

    #[test]
    fn lanes_are_apart_from_cores_and_absent_when_zero() {
        let mut req: AllocateRequest = serde_json::from_str(
            r#"{"request_id":3,"token":"t","cores":2,"memory_mib":256,"mode":"hot","hot_timeout_us":0,"input_capacity":4096,"output_capacity":4096,"deadline_ms":0,"functions":["noop"],"library_name":"l","provider":"shm"}"#,
        )
        .unwrap();
        // An older client's request: one lane per core.
        assert_eq!((req.lanes, req.lane_count(), req.thread_count()), (0, 2, 2));
        // 0 is not written, so an older executor reads the same bytes.
        assert!(!serde_json::to_string(&req).unwrap().contains("lanes"));
        req.lanes = 64;
        let json = serde_json::to_string(&req).unwrap();
        assert!(
            json.ends_with(r#","provider":"shm","read_only_input":false,"lanes":64}"#),
            "{json}"
        );
        let back: AllocateRequest = serde_json::from_str(&json).unwrap();
        assert_eq!((back.lane_count(), back.thread_count()), (64, 2));
        // Fewer lanes than cores: a thread per lane, no idle spinners.
        req.lanes = 1;
        assert_eq!(req.thread_count(), 1);
    }

    #[test]
    fn slots_are_absent_when_one_and_checked() {
        let mut req: AllocateRequest = serde_json::from_str(
            r#"{"request_id":3,"token":"t","cores":1,"memory_mib":256,"mode":"hot","hot_timeout_us":0,"input_capacity":4096,"output_capacity":4096,"deadline_ms":0,"functions":["noop"],"library_name":"l","provider":"tcp","lanes":2}"#,
        )
        .unwrap();
        // An older client's request: one invocation per lane.
        assert_eq!((req.slots, req.slot_count()), (0, 1));
        assert!(!serde_json::to_string(&req).unwrap().contains("slots"));
        req.slots = 16;
        let json = serde_json::to_string(&req).unwrap();
        assert!(json.ends_with(r#","lanes":2,"slots":16}"#), "{json}");
        for ok in [0, 1, 2, 16, MAX_SLOTS] {
            assert_eq!(slots_refusal(ok), None, "{ok}");
        }
        let refused = slots_refusal(12).unwrap();
        assert!(refused.contains("not a power of two"), "{refused}");
        let refused = slots_refusal(MAX_SLOTS * 2).unwrap();
        assert!(refused.contains("at most 64"), "{refused}");

        // An older executor's answer says nothing: one slot.
        let ok: AllocateOk = serde_json::from_str(
            r#"{"request_id":1,"allocation_id":2,"lease_id":3,"fabric_addr":"127.0.0.1:1","lanes":[{"addr":4096,"rkey":7,"len":4096}],"lane_key":"00","functions":["noop"],"output_capacity":64,"deadline_ms":0,"expires_at":0,"pooled":false,"phases":{"validate_ns":0,"worker_ns":0,"load_ns":0,"listen_ns":0}}"#,
        )
        .unwrap();
        assert_eq!((ok.slots, ok.slot_stride), (0, 0));
        let json = serde_json::to_string(&AllocateOk {
            slots: 4,
            slot_stride: 4096,
            ..ok
        })
        .unwrap();
        assert!(
            json.ends_with(r#","slots":4,"slot_stride":4096}"#),
            "{json}"
        );
    }

    #[test]
    fn message_json_shapes() {
        let exited = WorkerExited {
            allocation_id: 5,
            cause: ExitCause::Crashed,
            signal: Some(11),
            exit_code: None,
            message: "worker 9 killed by SIGSEGV".into(),
        };
        assert_eq!(
            serde_json::to_string(&exited).unwrap(),
            r#"{"allocation_id":5,"cause":"crashed","signal":11,"message":"worker 9 killed by SIGSEGV"}"#
        );
        assert_eq!(
            serde_json::to_string(&ExitCause::OutOfMemory).unwrap(),
            r#""out_of_memory""#
        );
        let err = ErrorReply {
            request_id: 1,
            code: ErrorCode::NoCapacity,
            message: "no".into(),
        };
        assert_eq!(
            serde_json::to_string(&err).unwrap(),
            r#"{"request_id":1,"code":"no_capacity","message":"no"}"#
        );
        assert!(ErrorCode::NoCapacity.is_retryable());
        assert!(!ErrorCode::TokenForged.is_retryable());
        assert_eq!(
            serde_json::to_string(&ErrorCode::MemoryTooSmall).unwrap(),
            r#""memory_too_small""#
        );
        // Asking again with the same memory cannot succeed.
        assert!(!ErrorCode::MemoryTooSmall.is_retryable());
        assert_eq!(
            serde_json::to_string(&LocalRequest::Drain { grace_ms: 100 }).unwrap(),
            r#"{"command":"drain","grace_ms":100}"#
        );
        assert_eq!(
            serde_json::from_str::<LocalRequest>(r#"{"command":"status"}"#).unwrap(),
            LocalRequest::Status
        );
        assert_eq!(
            serde_json::to_string(&LocalRequest::Usage { lease_id: None }).unwrap(),
            r#"{"command":"usage"}"#
        );
        assert_eq!(
            serde_json::from_str::<LocalRequest>(r#"{"command":"usage","lease_id":3}"#).unwrap(),
            LocalRequest::Usage { lease_id: Some(3) }
        );
    }

    /// The renewal frames, byte for byte: header (kind 7, 8, 19) and JSON.
    #[test]
    fn renewal_frame_bytes() {
        let renew = RenewLease {
            request_id: 9,
            allocation_id: 4,
            token: "rfaas2.x.y".into(),
        };
        let json = br#"{"request_id":9,"allocation_id":4,"token":"rfaas2.x.y"}"#;
        let want = small_frame(7, json);
        let frame = Frame::new(&renew, vec![]);
        assert_eq!(frame.to_bytes(), want);
        assert_eq!(frame.parse::<RenewLease>().unwrap(), renew);

        let renewed = LeaseRenewed {
            request_id: 9,
            allocation_id: 4,
            expires_at: 1_800_000_000,
        };
        let json = br#"{"request_id":9,"allocation_id":4,"expires_at":1800000000}"#;
        let want = small_frame(8, json);
        assert_eq!(Frame::new(&renewed, vec![]).to_bytes(), want);

        let moved = ExpiryMoved {
            expires_at: 1_800_000_000,
        };
        let json = br#"{"expires_at":1800000000}"#;
        let want = small_frame(19, json);
        let frame = Frame::new(&moved, vec![]);
        assert_eq!(frame.to_bytes(), want);
        let back = Frame::read_from(&mut &want[..], FrameLimits::default()).unwrap();
        assert_eq!(back.parse::<ExpiryMoved>().unwrap(), moved);
        assert!(matches!(
            back.parse::<LeaseRenewed>(),
            Err(ControlError::UnexpectedKind { .. })
        ));
        assert_eq!(
            serde_json::to_string(&ErrorCode::LeaseMismatch).unwrap(),
            r#""lease_mismatch""#
        );
        assert!(!ErrorCode::LeaseMismatch.is_retryable());
    }

    /// The attach frames, byte for byte: header (kind 9, 10, 20) and JSON.
    #[test]
    fn attach_frame_bytes() {
        let attach = Attach {
            request_id: 3,
            allocation_id: 7,
            secret: "00ff".into(),
        };
        let json = br#"{"request_id":3,"allocation_id":7,"secret":"00ff"}"#;
        let want = small_frame(9, json);
        let frame = Frame::new(&attach, vec![]);
        assert_eq!(frame.to_bytes(), want);
        let back = Frame::read_from(&mut &want[..], FrameLimits::default()).unwrap();
        assert_eq!(back.parse::<Attach>().unwrap(), attach);

        let attached = Attached {
            request_id: 3,
            allocation_id: 7,
            expires_at: 1_800_000_000,
        };
        let json = br#"{"request_id":3,"allocation_id":7,"expires_at":1800000000}"#;
        assert_eq!(
            Frame::new(&attached, vec![]).to_bytes(),
            small_frame(10, json)
        );
        assert!(matches!(
            Frame::new(&attached, vec![]).parse::<Attach>(),
            Err(ControlError::UnexpectedKind { .. })
        ));

        let rejoin = crate::control::worker::WorkerRejoin {
            allocation_id: 7,
            expires_at: 1_800_000_000,
        };
        let json = br#"{"allocation_id":7,"expires_at":1800000000}"#;
        assert_eq!(
            Frame::new(&rejoin, vec![]).to_bytes(),
            small_frame(20, json)
        );
    }
}

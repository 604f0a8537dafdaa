//! The control channel: allocation between a client and an executor daemon
//! (TCP), the node's own tools and the daemon (unix socket), and the daemon
//! and its worker processes (a socket pair).
//!
//! None of this is on the invocation path, so messages are JSON (readable in
//! a capture, easy to extend) behind a fixed binary frame header, and a
//! frame may carry one binary blob after the JSON: the function library of
//! an allocation request.
//!
//! # Frame
//!
//! ```text
//!         0       1       2       3       4       5       6       7
//!       +-------+-------+-------+-------+-------+-------+-------+-------+
//!     0 |     magic "RFAX" (4 bytes)    | version (u16) |  kind (u16)   |
//!       +-------+-------+-------+-------+-------+-------+-------+-------+
//!     8 |        json_len (u32)         |        blob_len (u32)         |
//!       +-------+-------+-------+-------+-------+-------+-------+-------+
//!    16 | json_len bytes of JSON, then blob_len bytes of blob ...
//! ```
//!
//! `kind` names the message ([`Kind`]); the JSON is that message's struct in
//! this module. A receiver checks the magic, the version (equal to
//! [`VERSION`](crate::VERSION)) and both lengths against its limits
//! ([`FrameLimits`]) before reading the body, so a malformed or hostile peer
//! costs it at most the limits.
//!
//! # Allocation, in order
//!
//! 1. client → executor: [`AllocateRequest`] with the library as the blob.
//! 2. executor → client: [`AllocateOk`] (or [`ErrorReply`]). The client
//!    connects `lanes.len()` fabric endpoints to `fabric_addr`, in order:
//!    the i-th connection is lane i, served by the worker's i-th thread.
//! 3. Invocations flow over the fabric (see the crate docs), not here.
//! 4. executor → client, whenever it happens: [`WorkerExited`] when the
//!    worker process ends for any reason but a deallocation.
//! 5. client → executor: [`Deallocate`]; executor → client: [`Deallocated`].
//!
//! At any time before the lease ends, client → executor: [`RenewLease`]
//! with a new token for the same lease and node, ending no earlier;
//! executor → client: [`LeaseRenewed`] with the allocation's new end (or
//! [`ErrorReply`], the allocation untouched). The executor tells the worker
//! first ([`ExpiryMoved`], which the worker echoes), so the worker serves
//! until the new end as soon as the client hears of it.
//!
//! The executor checks an [`AllocateRequest`] (its token above all) before
//! it reads the blob: a refused request's blob is read and dropped, so the
//! refusal is answered and the connection goes on.
//!
//! Closing the control connection deallocates every allocation made on it.
//! Requests carry a `request_id` the reply repeats, so one cached connection
//! can serve several allocations.

use std::collections::BTreeMap;
use std::io::{self, Read, Write};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::VERSION;

/// The first four bytes of every control frame.
pub const MAGIC: [u8; 4] = *b"RFAX";

/// Bytes in a frame header.
pub const FRAME_HEADER_LEN: usize = 16;

/// Which message a frame holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u16)]
#[non_exhaustive]
pub enum Kind {
    /// [`AllocateRequest`], client → executor, blob: the library.
    AllocateRequest = 1,
    /// [`AllocateOk`], executor → client.
    AllocateOk = 2,
    /// [`ErrorReply`], executor → client (or daemon → tool).
    Error = 3,
    /// [`Deallocate`], client → executor.
    Deallocate = 4,
    /// [`Deallocated`], executor → client.
    Deallocated = 5,
    /// [`WorkerExited`], executor → client, unsolicited.
    WorkerExited = 6,
    /// [`RenewLease`], client → executor.
    RenewLease = 7,
    /// [`LeaseRenewed`], executor → client.
    LeaseRenewed = 8,
    /// [`Assignment`], daemon → pooled worker, with the library's memfd
    /// passed alongside (SCM_RIGHTS).
    Assignment = 16,
    /// [`WorkerReady`], worker → daemon.
    WorkerReady = 17,
    /// [`WorkerFailed`], worker → daemon: the assignment failed.
    WorkerFailed = 18,
    /// [`ExpiryMoved`], daemon → serving worker, and its echo back.
    ExpiryMoved = 19,
    /// [`LocalRequest`], node tool → daemon (unix socket).
    LocalRequest = 32,
    /// [`LocalReply`], daemon → node tool.
    LocalReply = 33,
}

impl Kind {
    /// Every kind, in code order.
    pub const ALL: [Kind; 14] = [
        Kind::AllocateRequest,
        Kind::AllocateOk,
        Kind::Error,
        Kind::Deallocate,
        Kind::Deallocated,
        Kind::WorkerExited,
        Kind::RenewLease,
        Kind::LeaseRenewed,
        Kind::Assignment,
        Kind::WorkerReady,
        Kind::WorkerFailed,
        Kind::ExpiryMoved,
        Kind::LocalRequest,
        Kind::LocalReply,
    ];

    /// The wire code.
    pub const fn code(self) -> u16 {
        self as u16
    }

    /// The kind with wire code `code`.
    pub fn from_code(code: u16) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| k.code() == code)
    }
}

/// A control message: the JSON body of a frame whose kind is fixed by the
/// message's type, so a frame's kind and its body cannot disagree.
pub trait Message: Serialize + DeserializeOwned {
    /// The frame kind that carries this message.
    const KIND: Kind;
}

macro_rules! message_kinds {
    ($($ty:ty => $kind:ident),* $(,)?) => {
        $(impl Message for $ty {
            const KIND: Kind = Kind::$kind;
        })*
    };
}

message_kinds! {
    AllocateRequest => AllocateRequest,
    AllocateOk => AllocateOk,
    ErrorReply => Error,
    Deallocate => Deallocate,
    Deallocated => Deallocated,
    WorkerExited => WorkerExited,
    RenewLease => RenewLease,
    LeaseRenewed => LeaseRenewed,
    Assignment => Assignment,
    WorkerReady => WorkerReady,
    WorkerFailed => WorkerFailed,
    ExpiryMoved => ExpiryMoved,
    LocalRequest => LocalRequest,
    LocalReply => LocalReply,
}

/// Largest sizes a receiver accepts; bigger frames are refused before their
/// body is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameLimits {
    /// Largest JSON part.
    pub max_json: u32,
    /// Largest blob.
    pub max_blob: u32,
}

impl Default for FrameLimits {
    /// 1 MiB of JSON, 64 MiB of blob.
    fn default() -> Self {
        FrameLimits {
            max_json: 1 << 20,
            max_blob: 64 << 20,
        }
    }
}

/// A decoded frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    /// The message kind.
    pub kind: Kind,
    /// Bytes of JSON that follow.
    pub json_len: u32,
    /// Bytes of blob after the JSON.
    pub blob_len: u32,
}

/// What is wrong with a control frame. Not retryable on the same
/// connection: the receiver closes it after answering with an
/// [`ErrorReply`] where it can.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ControlError {
    /// The connection failed or closed.
    #[error("control connection: {0}")]
    Io(#[from] io::Error),
    /// Not an rfaas control frame.
    #[error("not an rfaas control frame: magic is {0:02x?}, expected \"RFAX\"")]
    BadMagic([u8; 4]),
    /// Another protocol version.
    #[error("the peer speaks rfaas protocol version {peer}, this side speaks {VERSION}; run the same rfaas release on both")]
    Version {
        /// The peer's version.
        peer: u16,
    },
    /// An unknown kind code.
    #[error("unknown control message kind {0}")]
    UnknownKind(u16),
    /// Over the receiver's limits.
    #[error("control frame too large: {what} is {len} bytes, the limit is {limit}")]
    TooLarge {
        /// `"json"` or `"blob"`.
        what: &'static str,
        /// Declared length.
        len: u32,
        /// The receiver's limit.
        limit: u32,
    },
    /// A frame of another kind than expected.
    #[error("expected a {expected:?} message, got {got:?}")]
    UnexpectedKind {
        /// What the receiver waited for.
        expected: Kind,
        /// What came.
        got: Kind,
    },
    /// The JSON does not describe the message its kind names.
    #[error("malformed {kind:?} message: {source}")]
    Json {
        /// The frame's kind.
        kind: Kind,
        /// serde_json's account.
        #[source]
        source: serde_json::Error,
    },
}

impl FrameHeader {
    /// Encodes the header.
    pub fn encode(&self) -> [u8; FRAME_HEADER_LEN] {
        let mut b = [0u8; FRAME_HEADER_LEN];
        b[0..4].copy_from_slice(&MAGIC);
        b[4..6].copy_from_slice(&VERSION.to_le_bytes());
        b[6..8].copy_from_slice(&self.kind.code().to_le_bytes());
        b[8..12].copy_from_slice(&self.json_len.to_le_bytes());
        b[12..16].copy_from_slice(&self.blob_len.to_le_bytes());
        b
    }

    /// Decodes and checks a header against `limits`.
    pub fn decode(b: &[u8; FRAME_HEADER_LEN], limits: FrameLimits) -> Result<Self, ControlError> {
        let magic = [b[0], b[1], b[2], b[3]];
        if magic != MAGIC {
            return Err(ControlError::BadMagic(magic));
        }
        let version = u16::from_le_bytes([b[4], b[5]]);
        if version != VERSION {
            return Err(ControlError::Version { peer: version });
        }
        let code = u16::from_le_bytes([b[6], b[7]]);
        let kind = Kind::from_code(code).ok_or(ControlError::UnknownKind(code))?;
        let json_len = u32::from_le_bytes([b[8], b[9], b[10], b[11]]);
        let blob_len = u32::from_le_bytes([b[12], b[13], b[14], b[15]]);
        if json_len > limits.max_json {
            return Err(ControlError::TooLarge {
                what: "json",
                len: json_len,
                limit: limits.max_json,
            });
        }
        if blob_len > limits.max_blob {
            return Err(ControlError::TooLarge {
                what: "blob",
                len: blob_len,
                limit: limits.max_blob,
            });
        }
        Ok(FrameHeader {
            kind,
            json_len,
            blob_len,
        })
    }
}

/// One received frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    /// The message kind.
    pub kind: Kind,
    /// The JSON part.
    pub json: Vec<u8>,
    /// The blob, empty when there is none.
    pub blob: Vec<u8>,
}

impl Frame {
    /// A frame holding `msg` (its kind is the message type's) and `blob`.
    pub fn new<M: Message>(msg: &M, blob: Vec<u8>) -> Frame {
        Frame {
            kind: M::KIND,
            json: serde_json::to_vec(msg).expect("control messages always serialise"),
            blob,
        }
    }

    /// The whole frame as bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        let header = FrameHeader {
            kind: self.kind,
            json_len: self.json.len() as u32,
            blob_len: self.blob.len() as u32,
        };
        let mut out = Vec::with_capacity(FRAME_HEADER_LEN + self.json.len() + self.blob.len());
        out.extend_from_slice(&header.encode());
        out.extend_from_slice(&self.json);
        out.extend_from_slice(&self.blob);
        out
    }

    /// Writes the frame (one `write_all` of header and JSON, one of the blob).
    pub fn write_to(&self, w: &mut impl Write) -> io::Result<()> {
        let header = FrameHeader {
            kind: self.kind,
            json_len: self.json.len() as u32,
            blob_len: self.blob.len() as u32,
        };
        let mut head = Vec::with_capacity(FRAME_HEADER_LEN + self.json.len());
        head.extend_from_slice(&header.encode());
        head.extend_from_slice(&self.json);
        w.write_all(&head)?;
        if !self.blob.is_empty() {
            w.write_all(&self.blob)?;
        }
        w.flush()
    }

    /// Reads one frame, refusing it before its body if it breaks `limits`.
    pub fn read_from(r: &mut impl Read, limits: FrameLimits) -> Result<Frame, ControlError> {
        let mut h = [0u8; FRAME_HEADER_LEN];
        r.read_exact(&mut h)?;
        let header = FrameHeader::decode(&h, limits)?;
        let mut json = vec![0u8; header.json_len as usize];
        r.read_exact(&mut json)?;
        let mut blob = vec![0u8; header.blob_len as usize];
        r.read_exact(&mut blob)?;
        Ok(Frame {
            kind: header.kind,
            json,
            blob,
        })
    }

    /// Parses the JSON as message `M`, which must be the frame's kind.
    pub fn parse<M: Message>(&self) -> Result<M, ControlError> {
        if self.kind != M::KIND {
            return Err(ControlError::UnexpectedKind {
                expected: M::KIND,
                got: self.kind,
            });
        }
        serde_json::from_slice(&self.json).map_err(|source| ControlError::Json {
            kind: self.kind,
            source,
        })
    }
}

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
    /// Worker threads (lanes), one core each; at most the lease's cores.
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
}

/// Stable error codes of the control channel. Each says whether retrying
/// can help.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum ErrorCode {
    /// The request could not be parsed. Not retryable.
    MalformedRequest,
    /// The token is not a well-formed token. Not retryable.
    TokenMalformed,
    /// The token's signature does not verify. Not retryable.
    TokenForged,
    /// The lease has ended. Retry with a new lease.
    TokenExpired,
    /// The lease is for another node. Not retryable here.
    TokenWrongNode,
    /// The request asks for more than the lease grants. Not retryable.
    ExceedsLease,
    /// The request is bigger than anything this executor allows (library
    /// size, buffer sizes, cores per allocation). Not retryable.
    TooLarge,
    /// The executor has not enough free cores or memory now. Retryable
    /// later or elsewhere.
    NoCapacity,
    /// A requested function is not in the library. Not retryable.
    UnknownFunction,
    /// The library could not be loaded. Not retryable.
    MalformedLibrary,
    /// The executor does not serve this fabric provider. Not retryable here.
    ProviderUnsupported,
    /// The lease's user cannot run workers here. Not retryable here.
    UserRefused,
    /// The node is being retrieved. Retry elsewhere.
    Draining,
    /// The allocation id is unknown on this connection. Not retryable.
    UnknownAllocation,
    /// The executor failed. Retryable.
    Internal,
    /// `memory_mib` is too small for the worker, the library and the
    /// lanes' buffers; the message gives the MiB needed and what they are
    /// made of. Not retryable (ask for more memory).
    MemoryTooSmall,
    /// A renewal's token is for another lease than the allocation's, or
    /// ends before the allocation's lease. Not retryable with that token.
    LeaseMismatch,
    /// The request fits its lease only once allocations of the same lease
    /// that are ending here are gone: their workers were told to stop, or
    /// crashed and are exiting, and their cores and memory are counted
    /// free only once the executor has reaped them. Retryable on the same
    /// executor in a moment (a client library retries it by itself, with
    /// a short backoff).
    AllocationEnding,
}

impl ErrorCode {
    /// Whether the same request may succeed later or on another executor.
    pub const fn is_retryable(self) -> bool {
        matches!(
            self,
            ErrorCode::TokenExpired
                | ErrorCode::NoCapacity
                | ErrorCode::Draining
                | ErrorCode::Internal
                | ErrorCode::AllocationEnding
        )
    }
}

/// A refusal, with a sentence that says what failed and what to do.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorReply {
    /// The request's id (0 when the request could not be parsed).
    pub request_id: u64,
    /// What kind of failure.
    pub code: ErrorCode,
    /// For people.
    pub message: String,
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

/// Daemon → serving worker: refuse invocations from `expires_at` (Unix
/// seconds) on, instead of the assignment's end. The worker answers with
/// the same message once its lanes use it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExpiryMoved {
    /// The lease's new end, Unix seconds.
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
    /// CPUs to pin the lane threads to, one per lane, in lane order; empty
    /// means no pinning.
    pub cpus: Vec<u32>,
    /// The allocation's lane key, 48 hex digits: a connection serves a
    /// lane only after a [`LaneHello`](crate::hello::LaneHello) with it.
    pub lane_key: String,
    /// Lanes (worker threads).
    pub lanes: u16,
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
    /// As in [`AllocateRequest::read_only_input`].
    #[serde(default)]
    pub read_only_input: bool,
}

/// Worker → daemon: the assignment is loaded and listening.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerReady {
    /// The address clients connect to.
    pub fabric_addr: String,
    /// Each lane's input buffer.
    pub lanes: Vec<Descriptor>,
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

/// Where an executor daemon listens for the node's tools when its
/// configuration does not say (`local_socket`).
pub const DEFAULT_LOCAL_SOCKET: &str = "/run/rfaas/executord.sock";

/// Node tool → daemon (unix socket).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "command", rename_all = "snake_case")]
#[non_exhaustive]
pub enum LocalRequest {
    /// What the daemon has and runs.
    Status,
    /// Stop taking allocations, let running invocations finish for
    /// `grace_ms`, then stop every worker.
    Drain {
        /// Grace period, milliseconds.
        grace_ms: u64,
    },
    /// Take allocations again after a drain.
    Resume,
    /// What each lease used on this node ([`LeaseUsage`]), live and
    /// recently ended; only lease `lease_id` when given.
    Usage {
        /// One lease only.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        lease_id: Option<u64>,
    },
    /// Slurm's prolog: job `job_id` starts on this node. Stop allocating
    /// the CPUs it gets at once, let running invocations on them finish
    /// for `grace_ms`, then stop their workers. Answered with
    /// [`LocalReply::Done`] once the CPUs are free.
    SlurmRetrieve {
        /// The Slurm job.
        job_id: u64,
        /// CPUs the job gets on this node; 0 when the hook could not tell,
        /// which takes back every CPU.
        cpus: u32,
        /// Grace period, milliseconds.
        grace_ms: u64,
    },
    /// Slurm's epilog: job `job_id` ended on this node. Offer what Slurm
    /// has not allocated to another job. Answered with
    /// [`LocalReply::Done`].
    SlurmOffer {
        /// The Slurm job that ended.
        job_id: u64,
    },
    /// The SPANK plugin, as a job step started with `--rfaas` begins on
    /// this node: what to put in the job's environment so that its client
    /// can lease (manager URLs and a credential scoped to the job, which a
    /// manager mints at the node's request). Answered with
    /// [`LocalReply::JobEnv`]; refused when the node has no manager or
    /// Slurm does not run job `job_id` here for user `uid`.
    SlurmJobEnv {
        /// The Slurm job.
        job_id: u64,
        /// The job's user id.
        uid: u32,
    },
}

/// What one lease used on one node, over all its allocations there: the
/// executor daemon's cumulative figures. Every figure only grows, while the
/// lease runs and after it ended.
///
/// `cpu_ns` is the kernel's CPU time of the lease's workers (from their
/// assignment on); `hot_ns` and `compute_ns` split it (`hot_ns +
/// compute_ns == cpu_ns`) as the workers reported it, bounded by it.
/// `warm_ns`, `invocations` and the bytes are the workers' word, bounded
/// by what the daemon knows (see `docs/executor.md`, "What the executor
/// measures").
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseUsage {
    /// The lease's id.
    pub lease_id: u64,
    /// The node (this executor's `node_name`, as the lease names it).
    pub node: String,
    /// The lease's user.
    pub user: String,
    /// The account charged.
    pub account: String,
    /// The Slurm job, if the lease names one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job_id: Option<u64>,
    /// No allocation of the lease runs now, and every worker it had is
    /// reaped: the figures are final unless the lease allocates again.
    pub ended: bool,
    /// Allocations of the lease metered so far (running and ended).
    pub allocations: u32,
    /// Allocation wall time (the daemon's clock) times the allocation's
    /// memory: MiB·ms.
    pub alloc_mib_ms: u64,
    /// CPU time of the workers as the kernel measures it, ns.
    pub cpu_ns: u64,
    /// CPU time not spent hot-polling: the functions and everything else
    /// the workers did, ns.
    pub compute_ns: u64,
    /// CPU time of hot lanes polling for requests, ns.
    pub hot_ns: u64,
    /// Time warm lanes spent blocked waiting for requests, summed over
    /// lanes, ns.
    pub warm_ns: u64,
    /// Functions called.
    pub invocations: u64,
    /// Input bytes handed to functions.
    pub bytes_in: u64,
    /// Output bytes functions returned.
    pub bytes_out: u64,
}

/// One allocation, as [`LocalReply::Status`] lists it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AllocationStatus {
    /// Allocation id.
    pub allocation_id: u64,
    /// Lease id.
    pub lease_id: u64,
    /// The lease's user.
    pub user: String,
    /// Worker process id.
    pub pid: u32,
    /// CPUs held.
    pub cpus: Vec<u32>,
    /// Memory held, MiB.
    pub memory_mib: u32,
}

/// Daemon → node tool.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "reply", rename_all = "snake_case")]
#[non_exhaustive]
pub enum LocalReply {
    /// The answer to [`LocalRequest::Status`].
    Status {
        /// This node's name.
        node: String,
        /// Whether allocations are refused.
        draining: bool,
        /// Every configured CPU.
        cpus: Vec<u32>,
        /// CPUs not held by an allocation.
        free_cpus: Vec<u32>,
        /// Configured memory, MiB.
        memory_mib: u32,
        /// Memory not held, MiB.
        free_memory_mib: u32,
        /// Pre-spawned workers waiting.
        pool_idle: u32,
        /// Running allocations.
        allocations: Vec<AllocationStatus>,
    },
    /// The command was done.
    Done {
        /// What happened, for people.
        message: String,
    },
    /// The answer to [`LocalRequest::Usage`].
    Usage {
        /// This node's name.
        node: String,
        /// Leases running now or ended recently, by lease id.
        leases: Vec<LeaseUsage>,
    },
    /// The answer to [`LocalRequest::SlurmJobEnv`]: variables for the
    /// job's environment (`RFAAS_MANAGERS`, `RFAAS_CREDENTIAL`, ...).
    JobEnv {
        /// Name → value.
        vars: BTreeMap<String, String>,
        /// When the credential expires, Unix seconds.
        expires_at: u64,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_bytes() {
        let h = FrameHeader {
            kind: Kind::AllocateRequest,
            json_len: 0x0102,
            blob_len: 0x0a0b0c0d,
        };
        let b = h.encode();
        assert_eq!(
            b,
            [b'R', b'F', b'A', b'X', 2, 0, 1, 0, 0x02, 0x01, 0, 0, 0x0d, 0x0c, 0x0b, 0x0a]
        );
        let limits = FrameLimits {
            max_json: u32::MAX,
            max_blob: u32::MAX,
        };
        assert_eq!(FrameHeader::decode(&b, limits).unwrap(), h);
    }

    #[test]
    fn kind_codes_are_stable() {
        let codes: Vec<u16> = Kind::ALL.iter().map(|k| k.code()).collect();
        assert_eq!(codes, [1, 2, 3, 4, 5, 6, 7, 8, 16, 17, 18, 19, 32, 33]);
        for k in Kind::ALL {
            assert_eq!(Kind::from_code(k.code()), Some(k));
        }
        assert_eq!(Kind::from_code(9), None);
        assert_eq!(Kind::from_code(20), None);
    }

    #[test]
    fn bad_headers_are_refused_with_a_reason() {
        let good = FrameHeader {
            kind: Kind::Deallocate,
            json_len: 10,
            blob_len: 0,
        }
        .encode();
        let limits = FrameLimits::default();

        let mut b = good;
        b[0] = b'X';
        assert!(matches!(
            FrameHeader::decode(&b, limits),
            Err(ControlError::BadMagic(_))
        ));
        let mut b = good;
        b[4] = 9;
        let err = FrameHeader::decode(&b, limits).unwrap_err();
        assert!(matches!(err, ControlError::Version { peer: 9 }));
        assert!(err.to_string().contains("same rfaas release"), "{err}");
        let mut b = good;
        b[6] = 99;
        assert!(matches!(
            FrameHeader::decode(&b, limits),
            Err(ControlError::UnknownKind(99))
        ));
        let mut b = good;
        b[12..16].copy_from_slice(&(65u32 << 20).to_le_bytes());
        assert!(matches!(
            FrameHeader::decode(&b, limits),
            Err(ControlError::TooLarge { what: "blob", .. })
        ));
        let mut b = good;
        b[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            FrameHeader::decode(&b, limits),
            Err(ControlError::TooLarge { what: "json", .. })
        ));
    }

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
    fn malformed_json_says_which_message() {
        let frame = Frame {
            kind: Kind::Deallocate,
            json: b"{\"request_id\":1}".to_vec(),
            blob: vec![],
        };
        let err = frame.parse::<Deallocate>().unwrap_err();
        assert!(err.to_string().contains("Deallocate"), "{err}");
        assert!(err.to_string().contains("allocation_id"), "{err}");
    }

    #[test]
    fn truncated_frames_are_io_errors() {
        let bytes = Frame::new(
            &Deallocate {
                request_id: 1,
                allocation_id: 2,
            },
            vec![],
        )
        .to_bytes();
        let err = Frame::read_from(&mut &bytes[..bytes.len() - 1], FrameLimits::default());
        assert!(matches!(err, Err(ControlError::Io(_))));
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

    /// The Slurm hooks' requests, byte for byte: header (kind 32) and JSON.
    #[test]
    fn slurm_request_bytes() {
        let cases = [
            (
                LocalRequest::SlurmRetrieve {
                    job_id: 42,
                    cpus: 4,
                    grace_ms: 30_000,
                },
                &br#"{"command":"slurm_retrieve","job_id":42,"cpus":4,"grace_ms":30000}"#[..],
            ),
            (
                LocalRequest::SlurmOffer { job_id: 42 },
                &br#"{"command":"slurm_offer","job_id":42}"#[..],
            ),
            (
                LocalRequest::SlurmJobEnv {
                    job_id: 42,
                    uid: 1000,
                },
                &br#"{"command":"slurm_job_env","job_id":42,"uid":1000}"#[..],
            ),
        ];
        for (req, json) in cases {
            let mut want = vec![b'R', b'F', b'A', b'X', 2, 0, 32, 0];
            want.extend_from_slice(&(json.len() as u32).to_le_bytes());
            want.extend_from_slice(&[0, 0, 0, 0]);
            want.extend_from_slice(json);
            let frame = Frame::new(&req, vec![]);
            assert_eq!(frame.to_bytes(), want, "{req:?}");
            let back = Frame::read_from(&mut &want[..], FrameLimits::default()).unwrap();
            assert_eq!(back.parse::<LocalRequest>().unwrap(), req);
        }
        let reply = LocalReply::JobEnv {
            vars: [("RFAAS_CREDENTIAL".to_string(), "rfaasc.ab.cd".to_string())].into(),
            expires_at: 7,
        };
        assert_eq!(
            serde_json::to_string(&reply).unwrap(),
            r#"{"reply":"job_env","vars":{"RFAAS_CREDENTIAL":"rfaasc.ab.cd"},"expires_at":7}"#
        );
        // A field missing is refused, not defaulted: a retrieval without
        // its grace must not become one without grace.
        assert!(serde_json::from_str::<LocalRequest>(
            r#"{"command":"slurm_retrieve","job_id":1,"cpus":2}"#
        )
        .is_err());
    }

    #[test]
    fn usage_reply_json() {
        let reply = LocalReply::Usage {
            node: "n1".into(),
            leases: vec![LeaseUsage {
                lease_id: 7,
                node: "n1".into(),
                user: "alice".into(),
                account: "physics".into(),
                job_id: None,
                ended: true,
                allocations: 2,
                alloc_mib_ms: 1,
                cpu_ns: 10,
                compute_ns: 6,
                hot_ns: 4,
                warm_ns: 3,
                invocations: 5,
                bytes_in: 8,
                bytes_out: 9,
            }],
        };
        let json = serde_json::to_string(&reply).unwrap();
        assert_eq!(
            json,
            r#"{"reply":"usage","node":"n1","leases":[{"lease_id":7,"node":"n1","user":"alice","account":"physics","ended":true,"allocations":2,"alloc_mib_ms":1,"cpu_ns":10,"compute_ns":6,"hot_ns":4,"warm_ns":3,"invocations":5,"bytes_in":8,"bytes_out":9}]}"#
        );
        assert_eq!(serde_json::from_str::<LocalReply>(&json).unwrap(), reply);
    }

    /// The bytes of a version 2 frame of kind `kind` with `json` (under
    /// 256 bytes) and no blob: magic, version, kind, JSON length, blob
    /// length, little-endian.
    fn small_frame(kind: u8, json: &[u8]) -> Vec<u8> {
        let mut b = vec![b'R', b'F', b'A', b'X', 2, 0, kind, 0, json.len() as u8];
        b.extend_from_slice(&[0; 7]);
        b.extend_from_slice(json);
        b
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

    /// A refusal that passes once an ending allocation of the same lease
    /// is reaped: its frame, byte by byte, and retryable.
    #[test]
    fn allocation_ending_refusal_bytes() {
        let reply = ErrorReply {
            request_id: 7,
            code: ErrorCode::AllocationEnding,
            message: "m".into(),
        };
        let json = br#"{"request_id":7,"code":"allocation_ending","message":"m"}"#;
        let want = small_frame(3, json);
        assert_eq!(Frame::new(&reply, vec![]).to_bytes(), want);
        let back = Frame::read_from(&mut &want[..], FrameLimits::default()).unwrap();
        assert_eq!(back.parse::<ErrorReply>().unwrap(), reply);
        assert!(ErrorCode::AllocationEnding.is_retryable());
    }
}

//! [`rfaas_status`]: what every call returns, one code per way the client
//! can fail (one per cause of a worker's end, whichever way the news came),
//! and the mapping from [`::rfaas_client::Error`]; [`rfaas_next`], what to
//! do after a failure.

use std::ffi::{c_char, CStr};

use ::rfaas_client::{Error, ExitCause, Next};
use rfaas_proto::control::{ControlError, ErrorCode};
use rfaas_proto::manager::REQUEST_EXCEEDS_CLUSTER;
use rfaas_proto::InvocationStatus;

/// What a call returned. `RFAAS_OK` (0) is success; `RFAAS_PENDING` is
/// `rfaas_test`'s "not yet"; every other value is a failure whose message
/// `rfaas_last_error()` gives.
///
/// Codes are stable. 2..99 are failures of the client library or the
/// connection, 100 + n is the worker's invocation status n, 200 + n
/// the executor's refusal of an allocation, and 300 and up the resource
/// manager's refusal of a lease. Each cause has one code,
/// whether the worker answered it or the executor reported it: a worker
/// that crashed is `RFAAS_ERR_WORKER_CRASHED` (101, once
/// `RFAAS_ERR_FUNCTION_CRASHED`, is retired and never reused), one out of
/// memory `RFAAS_ERR_OUT_OF_MEMORY`, a deadline
/// `RFAAS_ERR_DEADLINE_EXCEEDED`, a lease's end `RFAAS_ERR_LEASE_EXPIRED`,
/// a drain `RFAAS_ERR_EXECUTOR_DRAINING`, a shutdown
/// `RFAAS_ERR_EXECUTOR_STOPPED`. `rfaas_last_error_info()` adds the signal
/// and what to do next.
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum rfaas_status {
    /// Success.
    RFAAS_OK = 0,
    /// `rfaas_test`: the invocation has not finished yet.
    RFAAS_PENDING = 1,
    /// A NULL pointer, a string that is not UTF-8, a length beyond a
    /// buffer, a buffer of another allocation, an option out of range.
    RFAAS_ERR_INVALID_ARGUMENT = 2,
    /// A fault inside librfaas (a bug): report it with the message.
    RFAAS_ERR_INTERNAL = 3,
    /// A local file (the function library) could not be read.
    RFAAS_ERR_IO = 4,
    /// The executor's control port could not be reached. Retryable.
    RFAAS_ERR_CONNECT = 5,
    /// Something took longer than the client's limit. Retryable.
    RFAAS_ERR_TIMEOUT = 6,
    /// The executor's reply broke the protocol.
    RFAAS_ERR_PROTOCOL = 7,
    /// The control connection failed while reading or writing. Retryable.
    RFAAS_ERR_CONTROL_IO = 8,
    /// The function name is not in the allocation's function table.
    RFAAS_ERR_UNKNOWN_FUNCTION = 9,
    /// Every lane of the allocation has an invocation in flight.
    /// Retryable once one finishes.
    RFAAS_ERR_ALL_LANES_BUSY = 10,
    /// The output buffer is still the target of a freed, unfinished
    /// invocation. Retryable once its response arrives.
    RFAAS_ERR_BUFFER_BUSY = 11,
    /// The worker process died under the invocation: a function crashed
    /// (the signal is in `rfaas_last_error_info()`: 11 for SIGSEGV, also for
    /// writing past the output capacity), something killed it (9), or it
    /// failed and exited (signal 0). The allocation has ended. Retryable
    /// with a new allocation (a function that crashes on this input crashes
    /// again).
    RFAAS_ERR_WORKER_CRASHED = 12,
    /// The connection to the worker failed and the executor did not say
    /// why. Retryable with a new allocation.
    RFAAS_ERR_WORKER_LOST = 13,
    /// The executor (its control connection) is gone, and with it the
    /// allocation. Retryable elsewhere.
    RFAAS_ERR_EXECUTOR_LOST = 14,
    /// A lane's fabric operation failed at the peer. Retryable with a new
    /// allocation; it means a bug.
    RFAAS_ERR_TRANSPORT = 15,
    /// A local fabric call failed.
    RFAAS_ERR_FABRIC = 16,
    /// A local fabric call failed for a transient reason (connection
    /// refused, timeout, full queue). Retryable.
    RFAAS_ERR_FABRIC_TRANSIENT = 17,
    /// The worker used more memory than the allocation has (the kernel
    /// killed it at its cgroup limit; signal 9). The allocation has ended.
    /// Retryable; allocate with more memory.
    RFAAS_ERR_OUT_OF_MEMORY = 18,
    /// The executor is shutting down (it was stopped, e.g. by SIGTERM) and
    /// ended the allocation. Retryable: allocate again, on another executor
    /// if it does not come back.
    RFAAS_ERR_EXECUTOR_STOPPED = 19,
    /// The caller's array is too small for the string asked for (a node
    /// name, an executor's address): nothing was written to it, and the
    /// call's `needed` says how many bytes it takes, NUL included. Call
    /// again with that many.
    RFAAS_ERR_TOO_SMALL = 20,
    /// Every slot of the pipeline has a call in flight. Retryable once one
    /// has been collected.
    RFAAS_ERR_SLOTS_FULL = 21,
    /// The function returned more output than the output capacity.
    RFAAS_ERR_OUTPUT_TOO_LARGE = 102,
    /// The worker does not know the function index.
    RFAAS_ERR_FUNCTION_INDEX = 103,
    /// The executor's node is being retrieved (drained, for a Slurm job);
    /// the allocation has ended. Retryable on another executor.
    RFAAS_ERR_EXECUTOR_DRAINING = 104,
    /// The function ran past the allocation's deadline and its worker
    /// ended; the allocation has ended. Split the work or ask for a longer
    /// deadline, and allocate again.
    RFAAS_ERR_DEADLINE_EXCEEDED = 105,
    /// The input is larger than the allocation permits.
    RFAAS_ERR_PAYLOAD_TOO_LARGE = 106,
    /// The worker could not decode the request header.
    RFAAS_ERR_MALFORMED_REQUEST = 107,
    /// The lease behind the allocation has expired; the allocation has
    /// ended. Get a new lease and allocate again.
    RFAAS_ERR_LEASE_EXPIRED = 108,
    /// The worker failed for a reason other than the function. Retryable.
    RFAAS_ERR_WORKER_INTERNAL = 109,
    /// The executor refused the allocation with a code this library does
    /// not know.
    RFAAS_ERR_REFUSED = 200,
    /// Refused: the request could not be parsed.
    RFAAS_ERR_REFUSED_MALFORMED_REQUEST = 201,
    /// Refused: the token is not a well-formed token.
    RFAAS_ERR_REFUSED_TOKEN_MALFORMED = 202,
    /// Refused: the token's signature does not verify.
    RFAAS_ERR_REFUSED_TOKEN_FORGED = 203,
    /// Refused: the lease has ended. Retryable with a new lease.
    RFAAS_ERR_REFUSED_TOKEN_EXPIRED = 204,
    /// Refused: the lease is for another node.
    RFAAS_ERR_REFUSED_TOKEN_WRONG_NODE = 205,
    /// Refused: the request asks for more than the lease grants.
    RFAAS_ERR_REFUSED_EXCEEDS_LEASE = 206,
    /// Refused: the request is beyond the executor's limits.
    RFAAS_ERR_REFUSED_TOO_LARGE = 207,
    /// Refused: not enough free cores or memory now. Retryable.
    RFAAS_ERR_REFUSED_NO_CAPACITY = 208,
    /// Refused: a requested function is not in the library.
    RFAAS_ERR_REFUSED_UNKNOWN_FUNCTION = 209,
    /// Refused: the library could not be loaded.
    RFAAS_ERR_REFUSED_MALFORMED_LIBRARY = 210,
    /// Refused: the executor does not serve this fabric provider.
    RFAAS_ERR_REFUSED_PROVIDER_UNSUPPORTED = 211,
    /// Refused: the lease's user cannot run workers on this node.
    RFAAS_ERR_REFUSED_USER_REFUSED = 212,
    /// Refused: the node is being drained. Retryable elsewhere.
    RFAAS_ERR_REFUSED_DRAINING = 213,
    /// Refused: the allocation is unknown to the executor.
    RFAAS_ERR_REFUSED_UNKNOWN_ALLOCATION = 214,
    /// Refused: the executor failed. Retryable.
    RFAAS_ERR_REFUSED_INTERNAL = 215,
    /// Refused: `memory_mib` is too small for the worker, the library and
    /// the buffers; the message gives the MiB needed. Ask for more.
    RFAAS_ERR_REFUSED_MEMORY_TOO_SMALL = 216,
    /// Refused: a renewal's token is for another lease than the
    /// allocation's, or ends before it; the allocation is unchanged.
    RFAAS_ERR_REFUSED_LEASE_MISMATCH = 217,
    /// Refused: the request fits the lease only once an ending allocation
    /// of the same lease (a crashed worker not yet reaped) is gone. The
    /// library asks again by itself, with a short backoff, up to the
    /// client's allocation timeout; this comes back only past it.
    /// Retryable.
    RFAAS_ERR_REFUSED_ALLOCATION_ENDING = 218,
    /// The resource manager refused the request for another reason than
    /// those below (the message says which).
    RFAAS_ERR_MANAGER = 300,
    /// The managers had no cores to grant until the request's deadline
    /// (`503`, `no_capacity`). Retryable later.
    RFAAS_ERR_MANAGER_NO_CAPACITY = 301,
    /// The request is beyond the account's quota; the message gives the
    /// cap and the cores in use.
    RFAAS_ERR_MANAGER_QUOTA = 302,
    /// The manager refused the credential (missing, unknown, expired, or
    /// not allowed this request).
    RFAAS_ERR_MANAGER_UNAUTHORIZED = 303,
    /// No manager answered until the request's deadline. Retryable.
    RFAAS_ERR_MANAGER_UNREACHABLE = 304,
    /// The cluster can never hold the request: it asks for more memory per
    /// node than the largest node offers, or for more cores than the nodes
    /// with that memory hold together (`422`, `request_exceeds_cluster`). The
    /// message gives the largest offer. Not retryable: waiting does not
    /// help; ask for at most that.
    RFAAS_ERR_REQUEST_EXCEEDS_CLUSTER = 305,
}

use rfaas_status::*;

/// Every status, in code order. (Not `pub`: cbindgen would export it.)
const ALL: [rfaas_status; 55] = [
    RFAAS_OK,
    RFAAS_PENDING,
    RFAAS_ERR_INVALID_ARGUMENT,
    RFAAS_ERR_INTERNAL,
    RFAAS_ERR_IO,
    RFAAS_ERR_CONNECT,
    RFAAS_ERR_TIMEOUT,
    RFAAS_ERR_PROTOCOL,
    RFAAS_ERR_CONTROL_IO,
    RFAAS_ERR_UNKNOWN_FUNCTION,
    RFAAS_ERR_ALL_LANES_BUSY,
    RFAAS_ERR_BUFFER_BUSY,
    RFAAS_ERR_WORKER_CRASHED,
    RFAAS_ERR_WORKER_LOST,
    RFAAS_ERR_EXECUTOR_LOST,
    RFAAS_ERR_TRANSPORT,
    RFAAS_ERR_FABRIC,
    RFAAS_ERR_FABRIC_TRANSIENT,
    RFAAS_ERR_OUT_OF_MEMORY,
    RFAAS_ERR_EXECUTOR_STOPPED,
    RFAAS_ERR_TOO_SMALL,
    RFAAS_ERR_SLOTS_FULL,
    RFAAS_ERR_OUTPUT_TOO_LARGE,
    RFAAS_ERR_FUNCTION_INDEX,
    RFAAS_ERR_EXECUTOR_DRAINING,
    RFAAS_ERR_DEADLINE_EXCEEDED,
    RFAAS_ERR_PAYLOAD_TOO_LARGE,
    RFAAS_ERR_MALFORMED_REQUEST,
    RFAAS_ERR_LEASE_EXPIRED,
    RFAAS_ERR_WORKER_INTERNAL,
    RFAAS_ERR_REFUSED,
    RFAAS_ERR_REFUSED_MALFORMED_REQUEST,
    RFAAS_ERR_REFUSED_TOKEN_MALFORMED,
    RFAAS_ERR_REFUSED_TOKEN_FORGED,
    RFAAS_ERR_REFUSED_TOKEN_EXPIRED,
    RFAAS_ERR_REFUSED_TOKEN_WRONG_NODE,
    RFAAS_ERR_REFUSED_EXCEEDS_LEASE,
    RFAAS_ERR_REFUSED_TOO_LARGE,
    RFAAS_ERR_REFUSED_NO_CAPACITY,
    RFAAS_ERR_REFUSED_UNKNOWN_FUNCTION,
    RFAAS_ERR_REFUSED_MALFORMED_LIBRARY,
    RFAAS_ERR_REFUSED_PROVIDER_UNSUPPORTED,
    RFAAS_ERR_REFUSED_USER_REFUSED,
    RFAAS_ERR_REFUSED_DRAINING,
    RFAAS_ERR_REFUSED_UNKNOWN_ALLOCATION,
    RFAAS_ERR_REFUSED_INTERNAL,
    RFAAS_ERR_REFUSED_MEMORY_TOO_SMALL,
    RFAAS_ERR_REFUSED_LEASE_MISMATCH,
    RFAAS_ERR_REFUSED_ALLOCATION_ENDING,
    RFAAS_ERR_MANAGER,
    RFAAS_ERR_MANAGER_NO_CAPACITY,
    RFAAS_ERR_MANAGER_QUOTA,
    RFAAS_ERR_MANAGER_UNAUTHORIZED,
    RFAAS_ERR_MANAGER_UNREACHABLE,
    RFAAS_ERR_REQUEST_EXCEEDS_CLUSTER,
];

impl rfaas_status {
    /// The status of a worker's invocation status.
    pub fn from_invocation(status: InvocationStatus) -> rfaas_status {
        match status {
            InvocationStatus::Ok => RFAAS_OK,
            // The same cause as a crash the executor reports.
            InvocationStatus::FunctionCrashed => RFAAS_ERR_WORKER_CRASHED,
            InvocationStatus::OutputTooLarge => RFAAS_ERR_OUTPUT_TOO_LARGE,
            InvocationStatus::UnknownFunction => RFAAS_ERR_FUNCTION_INDEX,
            InvocationStatus::ExecutorDraining => RFAAS_ERR_EXECUTOR_DRAINING,
            InvocationStatus::DeadlineExceeded => RFAAS_ERR_DEADLINE_EXCEEDED,
            InvocationStatus::PayloadTooLarge => RFAAS_ERR_PAYLOAD_TOO_LARGE,
            InvocationStatus::MalformedRequest => RFAAS_ERR_MALFORMED_REQUEST,
            InvocationStatus::LeaseExpired => RFAAS_ERR_LEASE_EXPIRED,
            InvocationStatus::InternalError => RFAAS_ERR_WORKER_INTERNAL,
        }
    }

    /// The status of an executor's refusal.
    pub fn from_refusal(code: ErrorCode) -> rfaas_status {
        match code {
            ErrorCode::MalformedRequest => RFAAS_ERR_REFUSED_MALFORMED_REQUEST,
            ErrorCode::TokenMalformed => RFAAS_ERR_REFUSED_TOKEN_MALFORMED,
            ErrorCode::TokenForged => RFAAS_ERR_REFUSED_TOKEN_FORGED,
            ErrorCode::TokenExpired => RFAAS_ERR_REFUSED_TOKEN_EXPIRED,
            ErrorCode::TokenWrongNode => RFAAS_ERR_REFUSED_TOKEN_WRONG_NODE,
            ErrorCode::ExceedsLease => RFAAS_ERR_REFUSED_EXCEEDS_LEASE,
            ErrorCode::TooLarge => RFAAS_ERR_REFUSED_TOO_LARGE,
            ErrorCode::NoCapacity => RFAAS_ERR_REFUSED_NO_CAPACITY,
            ErrorCode::UnknownFunction => RFAAS_ERR_REFUSED_UNKNOWN_FUNCTION,
            ErrorCode::MalformedLibrary => RFAAS_ERR_REFUSED_MALFORMED_LIBRARY,
            ErrorCode::ProviderUnsupported => RFAAS_ERR_REFUSED_PROVIDER_UNSUPPORTED,
            ErrorCode::UserRefused => RFAAS_ERR_REFUSED_USER_REFUSED,
            ErrorCode::Draining => RFAAS_ERR_REFUSED_DRAINING,
            ErrorCode::UnknownAllocation => RFAAS_ERR_REFUSED_UNKNOWN_ALLOCATION,
            ErrorCode::Internal => RFAAS_ERR_REFUSED_INTERNAL,
            ErrorCode::MemoryTooSmall => RFAAS_ERR_REFUSED_MEMORY_TOO_SMALL,
            ErrorCode::LeaseMismatch => RFAAS_ERR_REFUSED_LEASE_MISMATCH,
            ErrorCode::AllocationEnding => RFAAS_ERR_REFUSED_ALLOCATION_ENDING,
            _ => RFAAS_ERR_REFUSED,
        }
    }

    /// The status of a client error.
    pub fn from_error(e: &Error) -> rfaas_status {
        match e {
            Error::Refused { code, .. } => Self::from_refusal(*code),
            Error::FunctionFailed(status) => match Self::from_invocation(*status) {
                // A worker never reports ok as a failure; keep the contract
                // that a failure is never RFAAS_OK.
                RFAAS_OK => RFAAS_ERR_PROTOCOL,
                s => s,
            },
            Error::WorkerCrashed {
                cause: ExitCause::OutOfMemory,
                ..
            } => RFAAS_ERR_OUT_OF_MEMORY,
            Error::WorkerCrashed { .. } => RFAAS_ERR_WORKER_CRASHED,
            Error::ExecutorStopped { .. } => RFAAS_ERR_EXECUTOR_STOPPED,
            Error::ExecutorLost { .. } => RFAAS_ERR_EXECUTOR_LOST,
            Error::WorkerLost => RFAAS_ERR_WORKER_LOST,
            Error::Transport { .. } => RFAAS_ERR_TRANSPORT,
            Error::AllLanesBusy => RFAAS_ERR_ALL_LANES_BUSY,
            Error::SlotsFull { .. } => RFAAS_ERR_SLOTS_FULL,
            Error::BufferBusy => RFAAS_ERR_BUFFER_BUSY,
            Error::UnknownFunction(_) => RFAAS_ERR_UNKNOWN_FUNCTION,
            Error::InvalidArgument(_) => RFAAS_ERR_INVALID_ARGUMENT,
            Error::Protocol(_) => RFAAS_ERR_PROTOCOL,
            Error::Connect { .. } => RFAAS_ERR_CONNECT,
            Error::Timeout { .. } => RFAAS_ERR_TIMEOUT,
            Error::Manager { status: 503, .. } => RFAAS_ERR_MANAGER_NO_CAPACITY,
            Error::ExceedsCluster { .. } => RFAAS_ERR_REQUEST_EXCEEDS_CLUSTER,
            // An answer without the figures is the same refusal.
            Error::Manager { status, kind, .. }
                if *status < 500 && kind == REQUEST_EXCEEDS_CLUSTER =>
            {
                RFAAS_ERR_REQUEST_EXCEEDS_CLUSTER
            }
            Error::Manager {
                status: 401 | 403,
                kind,
                ..
            } if kind != "quota_exceeded" => RFAAS_ERR_MANAGER_UNAUTHORIZED,
            Error::Manager { kind, .. } if kind == "quota_exceeded" => RFAAS_ERR_MANAGER_QUOTA,
            Error::Manager { status, .. } if *status >= 500 => RFAAS_ERR_MANAGER_UNREACHABLE,
            Error::Manager { .. } => RFAAS_ERR_MANAGER,
            Error::ManagerUnreachable { .. } => RFAAS_ERR_MANAGER_UNREACHABLE,
            Error::Fabric(f) if f.is_retryable() => RFAAS_ERR_FABRIC_TRANSIENT,
            Error::Fabric(_) => RFAAS_ERR_FABRIC,
            Error::Control(ControlError::Io(_)) => RFAAS_ERR_CONTROL_IO,
            Error::Control(_) => RFAAS_ERR_PROTOCOL,
            _ => RFAAS_ERR_INTERNAL,
        }
    }

    /// Whether the failed call may succeed later, with a new allocation or
    /// on another executor.
    pub fn is_retryable(self) -> bool {
        matches!(
            self,
            RFAAS_ERR_CONNECT
                | RFAAS_ERR_TIMEOUT
                | RFAAS_ERR_MANAGER_NO_CAPACITY
                | RFAAS_ERR_MANAGER_UNREACHABLE
                | RFAAS_ERR_CONTROL_IO
                | RFAAS_ERR_ALL_LANES_BUSY
                | RFAAS_ERR_SLOTS_FULL
                | RFAAS_ERR_BUFFER_BUSY
                | RFAAS_ERR_WORKER_CRASHED
                | RFAAS_ERR_OUT_OF_MEMORY
                | RFAAS_ERR_EXECUTOR_STOPPED
                | RFAAS_ERR_WORKER_LOST
                | RFAAS_ERR_EXECUTOR_LOST
                | RFAAS_ERR_TRANSPORT
                | RFAAS_ERR_FABRIC_TRANSIENT
                | RFAAS_ERR_EXECUTOR_DRAINING
                | RFAAS_ERR_WORKER_INTERNAL
                | RFAAS_ERR_REFUSED_TOKEN_EXPIRED
                | RFAAS_ERR_REFUSED_NO_CAPACITY
                | RFAAS_ERR_REFUSED_DRAINING
                | RFAAS_ERR_REFUSED_INTERNAL
                | RFAAS_ERR_REFUSED_ALLOCATION_ENDING
        )
    }

    /// The constant's name, NUL-terminated.
    pub fn name(self) -> &'static CStr {
        match self {
            RFAAS_OK => c"RFAAS_OK",
            RFAAS_PENDING => c"RFAAS_PENDING",
            RFAAS_ERR_INVALID_ARGUMENT => c"RFAAS_ERR_INVALID_ARGUMENT",
            RFAAS_ERR_INTERNAL => c"RFAAS_ERR_INTERNAL",
            RFAAS_ERR_IO => c"RFAAS_ERR_IO",
            RFAAS_ERR_CONNECT => c"RFAAS_ERR_CONNECT",
            RFAAS_ERR_TIMEOUT => c"RFAAS_ERR_TIMEOUT",
            RFAAS_ERR_PROTOCOL => c"RFAAS_ERR_PROTOCOL",
            RFAAS_ERR_CONTROL_IO => c"RFAAS_ERR_CONTROL_IO",
            RFAAS_ERR_UNKNOWN_FUNCTION => c"RFAAS_ERR_UNKNOWN_FUNCTION",
            RFAAS_ERR_ALL_LANES_BUSY => c"RFAAS_ERR_ALL_LANES_BUSY",
            RFAAS_ERR_BUFFER_BUSY => c"RFAAS_ERR_BUFFER_BUSY",
            RFAAS_ERR_WORKER_CRASHED => c"RFAAS_ERR_WORKER_CRASHED",
            RFAAS_ERR_WORKER_LOST => c"RFAAS_ERR_WORKER_LOST",
            RFAAS_ERR_EXECUTOR_LOST => c"RFAAS_ERR_EXECUTOR_LOST",
            RFAAS_ERR_TRANSPORT => c"RFAAS_ERR_TRANSPORT",
            RFAAS_ERR_FABRIC => c"RFAAS_ERR_FABRIC",
            RFAAS_ERR_FABRIC_TRANSIENT => c"RFAAS_ERR_FABRIC_TRANSIENT",
            RFAAS_ERR_OUT_OF_MEMORY => c"RFAAS_ERR_OUT_OF_MEMORY",
            RFAAS_ERR_EXECUTOR_STOPPED => c"RFAAS_ERR_EXECUTOR_STOPPED",
            RFAAS_ERR_TOO_SMALL => c"RFAAS_ERR_TOO_SMALL",
            RFAAS_ERR_SLOTS_FULL => c"RFAAS_ERR_SLOTS_FULL",
            RFAAS_ERR_OUTPUT_TOO_LARGE => c"RFAAS_ERR_OUTPUT_TOO_LARGE",
            RFAAS_ERR_FUNCTION_INDEX => c"RFAAS_ERR_FUNCTION_INDEX",
            RFAAS_ERR_EXECUTOR_DRAINING => c"RFAAS_ERR_EXECUTOR_DRAINING",
            RFAAS_ERR_DEADLINE_EXCEEDED => c"RFAAS_ERR_DEADLINE_EXCEEDED",
            RFAAS_ERR_PAYLOAD_TOO_LARGE => c"RFAAS_ERR_PAYLOAD_TOO_LARGE",
            RFAAS_ERR_MALFORMED_REQUEST => c"RFAAS_ERR_MALFORMED_REQUEST",
            RFAAS_ERR_LEASE_EXPIRED => c"RFAAS_ERR_LEASE_EXPIRED",
            RFAAS_ERR_WORKER_INTERNAL => c"RFAAS_ERR_WORKER_INTERNAL",
            RFAAS_ERR_REFUSED => c"RFAAS_ERR_REFUSED",
            RFAAS_ERR_REFUSED_MALFORMED_REQUEST => c"RFAAS_ERR_REFUSED_MALFORMED_REQUEST",
            RFAAS_ERR_REFUSED_TOKEN_MALFORMED => c"RFAAS_ERR_REFUSED_TOKEN_MALFORMED",
            RFAAS_ERR_REFUSED_TOKEN_FORGED => c"RFAAS_ERR_REFUSED_TOKEN_FORGED",
            RFAAS_ERR_REFUSED_TOKEN_EXPIRED => c"RFAAS_ERR_REFUSED_TOKEN_EXPIRED",
            RFAAS_ERR_REFUSED_TOKEN_WRONG_NODE => c"RFAAS_ERR_REFUSED_TOKEN_WRONG_NODE",
            RFAAS_ERR_REFUSED_EXCEEDS_LEASE => c"RFAAS_ERR_REFUSED_EXCEEDS_LEASE",
            RFAAS_ERR_REFUSED_TOO_LARGE => c"RFAAS_ERR_REFUSED_TOO_LARGE",
            RFAAS_ERR_REFUSED_NO_CAPACITY => c"RFAAS_ERR_REFUSED_NO_CAPACITY",
            RFAAS_ERR_REFUSED_UNKNOWN_FUNCTION => c"RFAAS_ERR_REFUSED_UNKNOWN_FUNCTION",
            RFAAS_ERR_REFUSED_MALFORMED_LIBRARY => c"RFAAS_ERR_REFUSED_MALFORMED_LIBRARY",
            RFAAS_ERR_REFUSED_PROVIDER_UNSUPPORTED => c"RFAAS_ERR_REFUSED_PROVIDER_UNSUPPORTED",
            RFAAS_ERR_REFUSED_USER_REFUSED => c"RFAAS_ERR_REFUSED_USER_REFUSED",
            RFAAS_ERR_REFUSED_DRAINING => c"RFAAS_ERR_REFUSED_DRAINING",
            RFAAS_ERR_REFUSED_UNKNOWN_ALLOCATION => c"RFAAS_ERR_REFUSED_UNKNOWN_ALLOCATION",
            RFAAS_ERR_REFUSED_INTERNAL => c"RFAAS_ERR_REFUSED_INTERNAL",
            RFAAS_ERR_REFUSED_MEMORY_TOO_SMALL => c"RFAAS_ERR_REFUSED_MEMORY_TOO_SMALL",
            RFAAS_ERR_REFUSED_LEASE_MISMATCH => c"RFAAS_ERR_REFUSED_LEASE_MISMATCH",
            RFAAS_ERR_REFUSED_ALLOCATION_ENDING => c"RFAAS_ERR_REFUSED_ALLOCATION_ENDING",
            RFAAS_ERR_MANAGER => c"RFAAS_ERR_MANAGER",
            RFAAS_ERR_MANAGER_NO_CAPACITY => c"RFAAS_ERR_MANAGER_NO_CAPACITY",
            RFAAS_ERR_MANAGER_QUOTA => c"RFAAS_ERR_MANAGER_QUOTA",
            RFAAS_ERR_MANAGER_UNAUTHORIZED => c"RFAAS_ERR_MANAGER_UNAUTHORIZED",
            RFAAS_ERR_MANAGER_UNREACHABLE => c"RFAAS_ERR_MANAGER_UNREACHABLE",
            RFAAS_ERR_REQUEST_EXCEEDS_CLUSTER => c"RFAAS_ERR_REQUEST_EXCEEDS_CLUSTER",
        }
    }

    /// The status with code `code`, if there is one.
    pub fn from_code(code: u32) -> Option<rfaas_status> {
        ALL.into_iter().find(|s| *s as u32 == code)
    }
}

/// What to do after a failure (`rfaas_error_info.next`).
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum rfaas_next {
    /// No failure: the thread has not failed yet.
    RFAAS_NEXT_NONE = 0,
    /// Make the same call again, on the same allocation: what stood in its
    /// way (a busy lane, a busy buffer, a slow answer) passes.
    RFAAS_NEXT_RETRY = 1,
    /// Allocate again (the same executor will do) and call again;
    /// `rfaas_invoke_retrying` does this.
    RFAAS_NEXT_REALLOCATE = 2,
    /// Allocate again on another executor.
    RFAAS_NEXT_ELSEWHERE = 3,
    /// Get a new lease for the node, then allocate again.
    RFAAS_NEXT_NEW_LEASE = 4,
    /// Change the call, the options or the function: the same call fails
    /// the same way again.
    RFAAS_NEXT_FIX = 5,
    /// Report it with the message: rfaas broke its own rules (a bug, or a
    /// library and an executor of different versions).
    RFAAS_NEXT_REPORT = 6,
}

impl From<Next> for rfaas_next {
    fn from(next: Next) -> rfaas_next {
        match next {
            Next::Retry => rfaas_next::RFAAS_NEXT_RETRY,
            Next::Reallocate => rfaas_next::RFAAS_NEXT_REALLOCATE,
            Next::Elsewhere => rfaas_next::RFAAS_NEXT_ELSEWHERE,
            Next::NewLease => rfaas_next::RFAAS_NEXT_NEW_LEASE,
            Next::Fix => rfaas_next::RFAAS_NEXT_FIX,
            _ => rfaas_next::RFAAS_NEXT_REPORT,
        }
    }
}

/// The name of a status constant ("RFAAS_ERR_CONNECT"), or
/// "RFAAS_UNKNOWN_STATUS" for a value that is none. The string is static.
#[no_mangle]
pub extern "C" fn rfaas_status_name(status: u32) -> *const c_char {
    match rfaas_status::from_code(status) {
        Some(s) => s.name().as_ptr(),
        None => c"RFAAS_UNKNOWN_STATUS".as_ptr(),
    }
}

/// Whether a call that failed with `status` may succeed when tried again:
/// later, with a new allocation, or on another executor (see each code).
/// False for RFAAS_OK, RFAAS_PENDING and unknown values.
#[no_mangle]
pub extern "C" fn rfaas_status_is_retryable(status: u32) -> bool {
    rfaas_status::from_code(status).is_some_and(rfaas_status::is_retryable)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_is_complete_and_names_match() {
        for s in ALL {
            assert_eq!(rfaas_status::from_code(s as u32), Some(s));
            let name = s.name().to_str().unwrap();
            assert_eq!(name, format!("{s:?}"));
        }
        assert_eq!(rfaas_status::from_code(99), None);
    }

    #[test]
    fn invocation_statuses_are_100_plus_their_code() {
        // But a crash: one code, whichever way the news came.
        assert_eq!(rfaas_status::from_code(101), None, "101 is retired");
        assert_eq!(
            rfaas_status::from_invocation(InvocationStatus::FunctionCrashed),
            RFAAS_ERR_WORKER_CRASHED
        );
        for st in InvocationStatus::ALL
            .into_iter()
            .filter(|s| !matches!(s, InvocationStatus::Ok | InvocationStatus::FunctionCrashed))
        {
            assert_eq!(
                rfaas_status::from_invocation(st) as u32,
                100 + u32::from(st.code())
            );
            assert_eq!(
                rfaas_status::from_invocation(st).is_retryable(),
                st.is_retryable(),
                "{st:?}"
            );
        }
    }

    #[test]
    fn each_cause_of_a_workers_end_has_one_code() {
        let crashed = |cause| Error::WorkerCrashed {
            signal: Some(11),
            cause,
            message: String::new(),
        };
        let failed = |s| rfaas_status::from_error(&Error::FunctionFailed(s));
        // A crash: answered in band or reported by the executor.
        assert_eq!(
            failed(InvocationStatus::FunctionCrashed),
            RFAAS_ERR_WORKER_CRASHED
        );
        assert_eq!(
            rfaas_status::from_error(&crashed(ExitCause::Crashed)),
            RFAAS_ERR_WORKER_CRASHED
        );
        assert_eq!(
            rfaas_status::from_error(&crashed(ExitCause::OutOfMemory)),
            RFAAS_ERR_OUT_OF_MEMORY
        );
        assert_eq!(
            rfaas_status::from_error(&Error::ExecutorStopped {
                executor: String::new()
            }),
            RFAAS_ERR_EXECUTOR_STOPPED
        );
        assert_eq!(
            failed(InvocationStatus::DeadlineExceeded),
            RFAAS_ERR_DEADLINE_EXCEEDED
        );
        assert_eq!(
            failed(InvocationStatus::LeaseExpired),
            RFAAS_ERR_LEASE_EXPIRED
        );
        assert_eq!(
            failed(InvocationStatus::ExecutorDraining),
            RFAAS_ERR_EXECUTOR_DRAINING
        );
    }

    #[test]
    fn refusal_retryability_matches_the_executor_codes() {
        for code in [
            ErrorCode::MalformedRequest,
            ErrorCode::TokenMalformed,
            ErrorCode::TokenForged,
            ErrorCode::TokenExpired,
            ErrorCode::TokenWrongNode,
            ErrorCode::ExceedsLease,
            ErrorCode::TooLarge,
            ErrorCode::NoCapacity,
            ErrorCode::UnknownFunction,
            ErrorCode::MalformedLibrary,
            ErrorCode::ProviderUnsupported,
            ErrorCode::UserRefused,
            ErrorCode::Draining,
            ErrorCode::UnknownAllocation,
            ErrorCode::Internal,
            ErrorCode::MemoryTooSmall,
            ErrorCode::LeaseMismatch,
            ErrorCode::AllocationEnding,
        ] {
            let s = rfaas_status::from_refusal(code);
            assert_ne!(s, RFAAS_ERR_REFUSED, "{code:?} has its own status");
            assert_eq!(s.is_retryable(), code.is_retryable(), "{code:?}");
        }
    }

    #[test]
    fn client_errors_keep_their_retryability() {
        use ::rfaas_client::ClusterOffer;
        let errors = [
            Error::AllLanesBusy,
            Error::BufferBusy,
            Error::WorkerLost,
            Error::UnknownFunction("f".into()),
            Error::InvalidArgument("x".into()),
            Error::Protocol("p".into()),
            Error::ExecutorLost {
                executor: "127.0.0.1:1".into(),
            },
            Error::FunctionFailed(InvocationStatus::OutputTooLarge),
            Error::FunctionFailed(InvocationStatus::InternalError),
            Error::Refused {
                code: ErrorCode::NoCapacity,
                message: String::new(),
            },
            Error::ExecutorStopped {
                executor: "127.0.0.1:1".into(),
            },
            Error::WorkerCrashed {
                signal: Some(9),
                cause: ExitCause::OutOfMemory,
                message: String::new(),
            },
            Error::ExceedsCluster {
                offer: ClusterOffer {
                    largest_node_cores: 2,
                    largest_node_memory_mib: 2048,
                    cluster_cores: 6,
                    nodes: 3,
                    cores_with_memory: 6,
                },
                message: String::new(),
            },
            Error::Manager {
                status: 422,
                kind: REQUEST_EXCEEDS_CLUSTER.into(),
                message: String::new(),
            },
        ];
        for e in errors {
            let s = rfaas_status::from_error(&e);
            assert_ne!(s, RFAAS_OK);
            assert_eq!(s.is_retryable(), e.is_retryable(), "{e:?} -> {s:?}");
        }
    }
}

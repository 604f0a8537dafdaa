//! Refusals, on every channel: the executor's answer to a client or a
//! node tool that it cannot serve, and a worker's failed assignment.

use serde::{Deserialize, Serialize};

use super::frame::message_kinds;

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

message_kinds! {
    ErrorReply => Error,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::frame::small_frame;
    use crate::control::{Frame, FrameLimits};

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

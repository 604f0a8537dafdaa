//! [`ProtoError`]: everything that can be wrong with bytes or values on the
//! wire.
//!
//! Variants carry only `Copy` data, so building one on the hot path does not
//! allocate. None of them is worth retrying unchanged: the same bytes decode
//! the same way every time.

use crate::imm::{MAX_FUNCTIONS, MAX_INVOCATION_ID};
use crate::status::InvocationStatus;
use crate::text::count;

/// A value could not be encoded, or bytes could not be decoded, as one of the
/// wire formats of this crate.
///
/// On the worker, any of these raised while decoding a request is answered
/// with [`InvocationStatus::MalformedRequest`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ProtoError {
    /// The buffer is shorter than the message it should hold. Not retryable:
    /// the sender (on decode) or the caller (on encode) sized it wrong.
    #[error("the {what} is {}, but the buffer given for it is only {} long", count(*needed as u64, "byte"), count(*len as u64, "byte"))]
    BufferTooShort {
        /// Which message, e.g. `"invocation header"`.
        what: &'static str,
        /// Bytes the message needs.
        needed: usize,
        /// Bytes the buffer has.
        len: usize,
    },

    /// An invocation header says its payload is inline (`input_rkey` 0) but
    /// still names an input address. Not retryable: the client built a bad
    /// header.
    #[error(
        "invocation header has input_rkey 0, which marks an inline payload, \
         but input_addr is {input_addr:#x}; an inline payload must have input_addr 0"
    )]
    InlineWithAddress {
        /// The non-zero `input_addr` found in the header.
        input_addr: u64,
    },

    /// An inline payload's declared length differs from the number of bytes
    /// that arrived after the header. Not retryable: the client wrote a
    /// header that does not describe its own write.
    #[error(
        "invocation header declares an inline payload of {}, but {} arrived after the header",
        count(*input_len, "byte"),
        count(*arrived, "byte")
    )]
    InlineLengthMismatch {
        /// `input_len` from the header.
        input_len: u32,
        /// Payload bytes the completion reported (its length minus the header).
        arrived: u32,
    },

    /// An invocation id does not fit in the 20 bits an immediate gives it.
    /// Not retryable: use [`next_invocation_id`](crate::next_invocation_id)
    /// to generate ids, which stays in range.
    #[error(
        "invocation id {id} does not fit in 20 bits; the largest invocation id is {max}",
        max = MAX_INVOCATION_ID
    )]
    InvocationIdOutOfRange {
        /// The offending id.
        id: u32,
    },

    /// A function index does not fit in the 12 bits a request immediate gives
    /// it. Not retryable: a function table has at most
    /// [`MAX_FUNCTIONS`] entries.
    #[error(
        "function index {index} does not fit in 12 bits; a function table holds at most \
         {max} functions, indices 0 through {last}",
        max = MAX_FUNCTIONS,
        last = MAX_FUNCTIONS - 1
    )]
    FunctionIndexOutOfRange {
        /// The offending index.
        index: u16,
    },

    /// A status code is not one this protocol version defines. Not retryable:
    /// the peer speaks a different protocol version, or the bits are
    /// corrupt.
    #[error(
        "status code {code} is not a known invocation status; \
         protocol version {version} defines codes 0 through {last}",
        version = crate::VERSION,
        last = InvocationStatus::MAX_CODE
    )]
    UnknownStatus {
        /// The offending code.
        code: u16,
    },

    /// A lane key is not 48 hex digits. Not retryable: the executor sent a
    /// malformed `AllocateOk` or assignment.
    #[error("a lane key must be 48 hex digits (24 bytes)")]
    BadLaneKey,

    /// The first write on a lane is not a lane hello (wrong magic). Not
    /// retryable: the peer is not an rfaas client of this version.
    #[error("the first write on a lane is not a lane hello (magic \"RFLH\")")]
    NotALaneHello,
}

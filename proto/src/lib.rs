//! Wire formats of rfaas: the one definition of every byte that crosses a
//! process boundary, with tests of the exact bytes.
//!
//! Encoding and decoding never allocate, never lock and never log: they run
//! on the invocation hot path. They write into caller-provided buffers and
//! read from borrowed ones, and report a too-short buffer as an error.
//!
//! # Layout
//!
//! - [`header`]: [`InvocationHeader`], the 32 bytes in front of every request
//!   payload.
//! - [`imm`]: [`RequestImm`] and [`ResponseImm`], the 32-bit immediates of
//!   requests and responses, and invocation id arithmetic.
//! - [`status`]: [`InvocationStatus`], the stable codes of how an invocation
//!   ended.
//! - [`error`]: [`ProtoError`], what can be wrong with bytes or values.
//! - [`text`]: words of the messages people read (counts in the right
//!   form).
//! - [`files`]: the configuration directory (`/etc/rfaas`) and the names
//!   of the files in it that rfaas's programs share.
//! - [`check`]: what every daemon's `--check-config` prints: settings
//!   with their sources, problems, the verdict.
//! - [`hostlist`]: Slurm's host lists (`node[1-3]`), as its hooks and
//!   `scontrol` name nodes.
//! - [`control`]: the control channel, JSON messages behind a 16-byte
//!   frame header, one module per channel: [`control::client`] (allocation
//!   between client and executor), [`control::local`] (node tools and the
//!   daemon) and [`control::worker`] (the daemon and its workers).
//! - [`accounting`]: the counter region of an accounting service, the slot
//!   a lease's usage is added into, and the hello executors say to it;
//!   [`accounting::UsageFigures`], what a lease used, as executors measure
//!   it and accounting stores and prices it.
//! - [`lease`]: lease tokens, claims signed with Ed25519, and their key
//!   files.
//! - [`ticket`]: accounting tickets, the short-lived proof of a node's
//!   identity, signed with the lease key, that its accounting hello
//!   carries instead of its credential.
//! - [`manager`]: the resource manager's REST bodies (JSON), shared by the
//!   manager, the executor daemon and the client library.
//! - [`node_name`]: the one pattern node names follow (no `.`, `..`, `/`
//!   or control characters), checked by the manager and executord alike.
//! - [`notify`]: systemd's readiness datagrams (`READY=1`, `STOPPING=1`)
//!   every daemon sends once it serves and when it stops.
//! - [`meter`]: the meter area, shared memory in which a worker's lanes
//!   publish their counters for the executor daemon.
//! - [`shm_control`]: the control messages of the fabric's `shm` provider
//!   (hello and region grants over a unix socket).
//! - [`tcp_frame`]: the frames of the fabric's `tcp` provider (software RDMA
//!   over TCP), with their own [`tcp_frame::FrameError`].
//!
//! Every integer on the wire is little-endian. The formats are those of
//! protocol [`VERSION`] 2.
//!
//! # Invocation
//!
//! A request is one write-with-immediate from the client into the worker's
//! input buffer: an [`InvocationHeader`] at offset 0, then, when the payload
//! is inline, `input_len` payload bytes at offset 32. The immediate is a
//! [`RequestImm`]. The worker checks the header against the completion's
//! byte length with [`InvocationHeader::validate_inline`].
//!
//! ```text
//! input buffer   0                32                    32 + input_len
//!                +----------------+--------------------------+
//!                | header (32 B)  | payload (inline only)    |
//!                +----------------+--------------------------+
//! ```
//!
//! A bulk request writes the header alone; the worker then reads `input_len`
//! bytes from `input_addr` with `input_rkey`.
//!
//! The response is one write-with-immediate from the worker into the
//! client's output buffer (`output_addr`, `output_rkey`, at most
//! `output_capacity` bytes); the immediate is a [`ResponseImm`] carrying the
//! request's invocation id. With [`InvocationStatus::Ok`] the completion's
//! byte length is the output length. With
//! [`InvocationStatus::FunctionCrashed`] it is 4 or 0: the 4 bytes are the
//! signal the function died of (a little-endian `u32`, 11 for SIGSEGV),
//! sent when `output_capacity` is at least 4. With any other status it is
//! 0.
//!
//! ## Invocation header
//!
//! 32 bytes, [`InvocationHeader::LEN`]. Rows are 8 bytes; the left column is
//! the offset of the row.
//!
//! ```text
//!         0       1       2       3       4       5       6       7
//!       +-------+-------+-------+-------+-------+-------+-------+-------+
//!     0 |                      output_addr (u64)                        |
//!       +-------+-------+-------+-------+-------+-------+-------+-------+
//!     8 |       output_rkey (u32)       |     output_capacity (u32)     |
//!       +-------+-------+-------+-------+-------+-------+-------+-------+
//!    16 |                       input_addr (u64)                        |
//!       +-------+-------+-------+-------+-------+-------+-------+-------+
//!    24 |        input_rkey (u32)       |        input_len (u32)        |
//!       +-------+-------+-------+-------+-------+-------+-------+-------+
//! ```
//!
//! - `output_addr`, `output_rkey`: the client's output buffer.
//! - `output_capacity`: bytes the worker may write there; 0 is allowed.
//!   These first 16 bytes are where the worker answers
//!   ([`InvocationHeader::reply_to`]); it reads them even from a header that
//!   does not decode, to answer `malformed_request`
//!   ([`InvocationHeader::peek_reply_to`]).
//! - `input_addr`, `input_rkey`: where a bulk payload is read from. Both 0
//!   means the payload is inline; `input_rkey` 0 with a nonzero `input_addr`
//!   is malformed ([`ProtoError::InlineWithAddress`]).
//! - `input_len`: payload length in bytes, inline or bulk. For an inline
//!   payload it must equal the completion's byte length minus 32
//!   ([`ProtoError::InlineLengthMismatch`]).
//!
//! ## Immediate values
//!
//! Both immediates put the invocation id (0 to [`MAX_INVOCATION_ID`],
//! 2^20 - 1; see [`next_invocation_id`]) in the 20 high bits.
//!
//! [`RequestImm`]: the low 12 bits are the index into the allocation's
//! function table (0 to [`MAX_FUNCTIONS`] - 1 = 4095). Every `u32` decodes.
//!
//! ```text
//!  31                                    12 11                     0
//! +----------------------------------------+------------------------+
//! |          invocation id (20 bits)       | function index (12 b)  |
//! +----------------------------------------+------------------------+
//! ```
//!
//! [`ResponseImm`]: the low 12 bits are an [`InvocationStatus`] code (0 to
//! [`InvocationStatus::MAX_CODE`]); any other code is rejected
//! ([`ProtoError::UnknownStatus`]).
//!
//! ```text
//!  31                                    12 11                     0
//! +----------------------------------------+------------------------+
//! |          invocation id (20 bits)       |  status code (12 bits) |
//! +----------------------------------------+------------------------+
//! ```
//!
//! For example, invocation 1 of function 2 is the request immediate
//! `0x0000_1002`, and its successful response is `0x0000_1000`.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod accounting;
pub mod check;
pub mod control;
pub mod error;
pub mod files;
pub mod header;
pub mod hello;
pub mod hostlist;
pub mod imm;
pub mod lease;
pub mod manager;
pub mod meter;
pub mod node_name;
pub mod notify;
pub mod shm_control;
pub mod status;
pub mod tcp_frame;
pub mod text;
pub mod ticket;

pub use error::ProtoError;
pub use header::{InvocationHeader, ReplyTo};
pub use imm::{next_invocation_id, RequestImm, ResponseImm, MAX_FUNCTIONS, MAX_INVOCATION_ID};
pub use status::InvocationStatus;

/// The protocol version: the formats of this crate as they are now.
///
/// Every control frame carries it ([`control`]), so client, executor and
/// worker refuse to talk across releases that disagree. Any change to a layout or a status code in this
/// crate bumps it.
pub const VERSION: u16 = 2;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_is_2() {
        assert_eq!(VERSION, 2);
    }

    /// The worked example at the end of the crate docs.
    #[test]
    fn crate_doc_example() {
        let request = RequestImm {
            invocation_id: 1,
            function_index: 2,
        };
        assert_eq!(request.encode(), Ok(0x0000_1002));
        let response = ResponseImm {
            invocation_id: 1,
            status: InvocationStatus::Ok,
        };
        assert_eq!(response.encode(), Ok(0x0000_1000));
    }
}

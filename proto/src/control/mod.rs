//! The control channel: allocation between a client and an executor daemon
//! (TCP), the node's own tools and the daemon (unix socket), and the daemon
//! and its worker processes (a socket pair).
//!
//! None of this is on the invocation path, so messages are JSON (readable in
//! a capture, easy to extend) behind a fixed binary frame header, and a
//! frame may carry one binary blob after the JSON: the function library of
//! an allocation request.
//!
//! # Layout
//!
//! One module per channel, each with its messages and the tests of their
//! bytes:
//!
//! - [`client`]: client ↔ executor daemon (TCP): allocation, renewal,
//!   deallocation, and [`WorkerExited`](client::WorkerExited).
//! - [`local`]: the node's own tools (the Slurm hooks, the SPANK plugin,
//!   an admin's status, drain and usage requests) ↔ the daemon (unix
//!   socket).
//! - [`worker`]: the daemon ↔ a worker process (socket pair): the
//!   assignment and the worker's answer.
//!
//! What every channel shares is here: the frame ([`Frame`], [`Kind`],
//! [`FrameLimits`], [`ControlError`]) and refusals ([`ErrorReply`] with its
//! [`ErrorCode`]), sent to clients and tools alike and carried by a
//! worker's [`WorkerFailed`](worker::WorkerFailed).
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
//! its channel's module. A receiver checks the magic, the version (equal to
//! [`VERSION`](crate::VERSION)) and both lengths against its limits
//! ([`FrameLimits`]) before reading the body, so a malformed or hostile peer
//! costs it at most the limits.
//!
//! # Allocation, in order
//!
//! 1. client → executor: [`AllocateRequest`](client::AllocateRequest) with the library as the blob.
//! 2. executor → client: [`AllocateOk`](client::AllocateOk) (or [`ErrorReply`]). The client
//!    connects `lanes.len()` fabric endpoints to `fabric_addr`, in order:
//!    the i-th connection is lane i, served by the worker's i-th thread.
//! 3. Invocations flow over the fabric (see the crate docs), not here.
//! 4. executor → client, whenever it happens: [`WorkerExited`](client::WorkerExited) when the
//!    worker process ends for any reason but a deallocation.
//! 5. client → executor: [`Deallocate`](client::Deallocate); executor → client: [`Deallocated`](client::Deallocated).
//!
//! At any time before the lease ends, client → executor: [`RenewLease`](client::RenewLease)
//! with a new token for the same lease and node, ending no earlier;
//! executor → client: [`LeaseRenewed`](client::LeaseRenewed) with the allocation's new end (or
//! [`ErrorReply`], the allocation untouched). The executor tells the worker
//! first ([`ExpiryMoved`](worker::ExpiryMoved), which the worker echoes), so the worker serves
//! until the new end as soon as the client hears of it.
//!
//! The executor checks an [`AllocateRequest`](client::AllocateRequest) (its token above all) before
//! it reads the blob: a refused request's blob is read and dropped, so the
//! refusal is answered and the connection goes on.
//!
//! Closing the control connection deallocates every allocation made on it.
//! Requests carry a `request_id` the reply repeats, so one cached connection
//! can serve several allocations.

mod frame;
mod refusal;

pub mod client;
pub mod local;
pub mod worker;

pub use frame::{
    ControlError, Frame, FrameHeader, FrameLimits, Kind, Message, FRAME_HEADER_LEN, MAGIC,
};
pub use refusal::{ErrorCode, ErrorReply};

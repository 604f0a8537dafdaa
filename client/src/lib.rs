//! `rfaas-client`: allocate workers on rfaas executors, register buffers,
//! and invoke functions on other nodes' cores over the rfaas fabric.
//!
//! The protocol is in `docs/invocation.md`; the job author's guide is
//! `docs/client.md`.
//!
//! # Usage
//!
//! ```no_run
//! use rfaas_client::{AllocationSpec, Client, ClientOptions, Mode};
//! # fn main() -> rfaas_client::Result<()> {
//! # let token = String::new();
//! let library = std::fs::read("libfunctions.so").expect("the library");
//! let client = Client::new(ClientOptions::default());
//! let alloc = client.allocate(
//!     "127.0.0.1:7100",
//!     &token,
//!     &AllocationSpec::new(library, &["echo"]).cores(2).mode(Mode::Warm),
//! )?;
//! let echo = alloc.function("echo")?;
//! let mut input = alloc.buffer::<f64>(1024)?;
//! let mut output = alloc.buffer::<f64>(1024)?;
//! input.fill(1.5);
//! let bytes = alloc.submit(echo, &input, 1024, &mut output)?.get()?;
//! assert_eq!(bytes, 1024 * 8);
//! assert_eq!(output.to_vec()[0], 1.5);
//! alloc.deallocate()?;
//! # Ok(()) }
//! ```
//!
//! # Layout
//!
//! - [`client`]: [`Client`], the fabric and the cached control
//!   connections; allocation and its cold-start timings.
//! - [`spec`]: [`ClientOptions`] and [`AllocationSpec`].
//! - [`lease`]: [`Managers`] and [`Lease`]: leases from the resource
//!   manager, with backoff, failover, renewal and release.
//! - [`leased`]: [`LeasedAllocation`], made by [`Managers::allocate`]: an
//!   allocation holding its own lease, renewed in the background, released
//!   on deallocation, moved to another node when its executor fails.
//! - [`allocation`]: [`Allocation`] (submit, invoke, retry, renew,
//!   deallocate), [`Renewer`], [`FunctionId`], [`ColdStart`].
//! - [`buffer`]: [`Buffer`], registered memory with the request header's
//!   slot in front of page-aligned data, read and written by copies (its
//!   in-place slices are `unsafe`: workers may write it), and the [`Pod`]
//!   marker.
//! - [`invocation`]: [`Invocation`], waited for by blocking, spinning,
//!   polling or as a future.
//! - `lane`: one endpoint, completion queue and in-flight invocation; who
//!   may touch the queue, and how an abandoned invocation is drained.
//! - `control`: the control connection, its reader thread, and each
//!   allocation's fate (`WorkerExited`, connection loss).
//! - `spin`: noticing that a spinning thread shares its CPU with another
//!   busy thread ([`spin_sleeps`]), so `spin` sleeps instead.
//! - [`error`]: [`Error`], with [`Error::is_retryable`],
//!   [`Error::allocation_usable`] and [`Error::next`] ([`Next`]);
//!   [`ClusterOffer`], the largest request a cluster can hold.

pub mod allocation;
pub mod buffer;
pub mod client;
mod control;
pub mod error;
pub mod invocation;
mod lane;
pub mod lease;
pub mod leased;
pub mod pipeline;
pub mod spec;
mod spin;

pub use allocation::{Allocation, ColdStart, FunctionId, Renewer};
pub use buffer::{Buffer, Pod};
pub use client::Client;
pub use error::{ClusterOffer, Error, Next, Result};
pub use invocation::Invocation;
pub use lease::{Lease, Managers};
pub use leased::{LeaseOptions, LeasedAllocation};
pub use pipeline::{CallId, Done, Pipeline, Rejected};
pub use rfaas_proto::control::client::ExitCause;
pub use rfaas_proto::control::ErrorCode;
pub use rfaas_proto::InvocationStatus;
pub use spec::{AllocationSpec, ClientOptions, Mode};
pub use spin::spin_sleeps;

//! `librfaas`: the C API of the rfaas client library (`rfaas.h`).
//!
//! Every function returns an [`rfaas_status`](status::rfaas_status) (or a
//! plain value for accessors and `_free`s); a failure leaves a sentence in
//! the calling thread's [`rfaas_last_error`](ffi::rfaas_last_error). No
//! call crashes on a NULL pointer or a bad argument, and a panic inside
//! the library never crosses into C: it becomes `RFAAS_ERR_INTERNAL`.
//!
//! `build.rs` generates `include/rfaas.h` from these items with cbindgen
//! and gives `librfaas.so` the SONAME `librfaas.so.1`;
//! `scripts/build-capi.sh` builds and installs `librfaas.so.1`,
//! `librfaas.a`, the header and `rfaas.pc`, and the `rfaas-client` package
//! ships them (`docs/packages.md`). The guide is `docs/c-api.md`.
//!
//! # Layout
//!
//! - [`status`]: `rfaas_status`, one code per way a call fails (one per
//!   cause of a worker's end; a request no node can hold,
//!   `RFAAS_ERR_REQUEST_EXCEEDS_CLUSTER`), mapped from
//!   [`::rfaas_client::Error`];
//!   `rfaas_next`; `rfaas_status_name`, `rfaas_status_is_retryable`.
//! - [`ffi`]: the thread's last error (`rfaas_last_error`,
//!   `rfaas_last_error_info`) and its last call's retries
//!   (`rfaas_last_retries`), panic containment, checked conversions of C
//!   pointers and strings, the client's errors in C's words.
//! - [`options`]: `rfaas_alloc_options`, `rfaas_mode`.
//! - [`lease`]: `rfaas_managers`, `rfaas_lease`: leases from the resource
//!   manager (backoff, failover, renewal, release).
//! - [`client`]: `rfaas_client`, `rfaas_allocation`: allocate,
//!   look functions up, say where an allocation runs and how often it
//!   moved, deallocate.
//! - [`buffer`]: `rfaas_buffer`, registered page-aligned bytes.
//! - [`invocation`]: `rfaas_invocation`: submit, wait, spin, test; the
//!   synchronous `rfaas_invoke`.
//! - [`pipeline`]: `rfaas_pipeline`: many calls in flight on one lane,
//!   collected as they end.
#![allow(non_camel_case_types)]

// In the order rfaas.h presents them (cbindgen follows the modules).
pub mod status;

pub mod ffi;

pub mod options;

pub mod lease;

pub mod client;

pub mod buffer;

pub mod invocation;

pub mod pipeline;

pub use buffer::*;
pub use client::*;
pub use ffi::{rfaas_error_info, rfaas_last_error, rfaas_last_error_info, rfaas_last_retries};
pub use invocation::*;
pub use lease::*;
pub use options::*;
pub use pipeline::*;
pub use status::*;

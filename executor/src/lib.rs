//! `rfaas-executor`: the node agent (`rfaas-executord`) and the worker
//! process (`rfaas-worker`). See `docs/invocation.md`.
//!
//! # Layout
//!
//! - [`daemon`]: the node daemon: configuration, lease checks, capacity,
//!   the worker pool, supervision, the control and local sockets.
//! - [`ipc`]: control frames and file descriptors between the daemon and
//!   its workers (socket pair, SCM_RIGHTS), sealed memfds.
//! - [`meter`]: the meter area both sides map (the daemon's memfd, the
//!   worker's mapping) and the clock its lanes read.
//! - [`worker`]: the worker process: assignment, privilege drop, library
//!   loading, the lane loops and the deadline watchdog.

pub mod daemon;
pub mod ipc;
pub mod meter;
pub mod worker;

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
//! - [`gettid`]: the calling thread's id, for both.

pub mod daemon;
pub mod ipc;
pub mod meter;
pub mod worker;

/// The calling thread's id, by the system call: glibc's `gettid()` wrapper
/// came in 2.30, and the packaged binaries run on glibc 2.28 (EL8).
/// Async-signal-safe.
pub(crate) fn gettid() -> libc::pid_t {
    // SAFETY: SYS_gettid takes no arguments and cannot fail.
    unsafe { libc::syscall(libc::SYS_gettid) as libc::pid_t }
}

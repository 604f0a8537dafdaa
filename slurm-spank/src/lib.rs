//! rfaas on Slurm: a node's idle cores go to rfaas when a job ends there,
//! and come back, within a grace period, when a job starts. Two ways in,
//! one behaviour: the SPANK plugin `rfaas_spank.so` (this crate's cdylib,
//! listed in `plugstack.conf`) and `rfaas-slurm-hook` (Slurm's `Prolog=`
//! and `Epilog=`). Both only talk to the node's executor daemon on its
//! local socket, in bounded time, and fail open: whatever goes wrong is
//! logged, and the job starts on time on an undrained node.
//!
//! # Layout
//!
//! - [`settings`]: the site's `key=value` arguments (`grace=`, `socket=`,
//!   `timeout_ms=`, `default=`, `log=`), checked, defaults kept for what
//!   is wrong.
//! - [`job`]: the job on this node, from the prolog's environment.
//! - [`daemon`]: one bounded exchange with the executor daemon.
//! - [`hook`]: take back at a job's start, offer at its end, and the panic
//!   guard every entry point runs in.
//! - `spank` (no public items): the SPANK symbols and Slurm 22.05's FFI.
//!
//! `docs/slurm.md` is the administrator's guide.

pub mod daemon;
pub mod hook;
pub mod job;
pub mod settings;
mod spank;

pub use spank::SLURM_VERSION_NUMBER;

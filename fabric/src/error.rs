//! The one error type of the fabric.
//!
//! Errors returned by a call are local and synchronous: bad arguments, a
//! device that cannot be opened, a connection that cannot be made. Failures of
//! one-sided operations on the remote side (bad rkey, peer lost) arrive later
//! as error completions (see [`crate::Status`]), as they do on a NIC.

use std::io;

/// Result alias used throughout the fabric.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What went wrong, and whether trying again can help.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The provider string is not one of `tcp`, `shm` or `verbs:<device>`. Not retryable.
    #[error("unknown fabric provider {0:?}: expected \"tcp\", \"shm\" or \"verbs:<device>\"")]
    UnknownProvider(String),

    /// The provider exists but this build or machine cannot run it. Not retryable.
    #[error("fabric provider {provider} is unavailable: {reason}")]
    ProviderUnavailable {
        /// The provider asked for.
        provider: String,
        /// Why it cannot be used, with what to do about it.
        reason: String,
    },

    /// A caller passed something the fabric cannot accept. Not retryable: fix the call.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),

    /// Objects from two providers or two domains were mixed in one call. Not retryable.
    #[error("{0}")]
    DomainMismatch(&'static str),

    /// The send queue or a completion queue is full; poll completions and retry.
    #[error("{what} is full ({depth} entries): poll completions, then post again")]
    QueueFull {
        /// Which queue.
        what: &'static str,
        /// Its capacity.
        depth: usize,
    },

    /// Connection set-up failed: the peer refused, spoke another protocol or vanished.
    /// Retryable if the peer may come (back) up.
    #[error("connecting to {addr} failed: {reason}")]
    Connect {
        /// The address dialled or accepted from.
        addr: String,
        /// What happened.
        reason: String,
    },

    /// The endpoint's connection is gone; every later operation fails the same way.
    #[error("the connection to {peer} is closed: {reason}")]
    Disconnected {
        /// The peer's address.
        peer: String,
        /// Why it closed.
        reason: String,
    },

    /// A blocking call ran out of time.
    #[error("{0} timed out")]
    Timeout(&'static str),

    /// A system call failed.
    #[error("{call} failed")]
    Io {
        /// The call or verb that failed (`mmap`, `ibv_reg_mr`, ...).
        call: &'static str,
        /// What the kernel or library said.
        #[source]
        source: io::Error,
    },
}

impl Error {
    /// Wraps the current `errno` as an [`Error::Io`] naming `call`.
    pub(crate) fn last_os(call: &'static str) -> Self {
        Error::Io {
            call,
            source: io::Error::last_os_error(),
        }
    }

    /// Wraps `source` as an [`Error::Io`] naming `call`.
    pub(crate) fn io(call: &'static str, source: io::Error) -> Self {
        Error::Io { call, source }
    }

    /// Whether the same call may succeed later without changing it.
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            Error::QueueFull { .. } | Error::Connect { .. } | Error::Timeout(_)
        )
    }
}

//! [`Error`]: every way an allocation or an invocation can fail, and which
//! of them a retry can cure.

use std::time::Duration;

use rfaas_proto::control::{ControlError, ErrorCode, ExitCause, WorkerExited};
use rfaas_proto::InvocationStatus;

/// What failed. Each variant says whether retrying can help
/// ([`Error::is_retryable`]); [`crate::Allocation::invoke_retrying`] retries
/// exactly those.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The executor refused the allocation. Retryable when `code` is
    /// (no capacity, draining, an expired lease, an executor failure).
    #[error("the executor refused the allocation ({code:?}): {message}")]
    Refused {
        /// The executor's stable error code.
        code: ErrorCode,
        /// The executor's sentence: what failed and what to do.
        message: String,
    },
    /// The worker answered the invocation with a status other than `ok`.
    /// Retryable for `executor_draining` and `internal_error` only.
    #[error("the invocation failed: {0}")]
    FunctionFailed(InvocationStatus),
    /// The worker process died under the invocation (a function crashed,
    /// or something killed it). Retryable: a new allocation gets a fresh
    /// worker, but a function that crashes on this input crashes again.
    #[error("the worker crashed ({cause:?}{}): {message}", signal.map(|s| format!(", signal {s}")).unwrap_or_default())]
    WorkerCrashed {
        /// The terminating signal, if a signal ended it (11 is SIGSEGV).
        signal: Option<i32>,
        /// Why the executor says it ended.
        cause: ExitCause,
        /// The executor's account, e.g. "worker 1234 killed by SIGSEGV".
        message: String,
    },
    /// The control connection to the executor closed or failed: the daemon
    /// (or its node) is gone, and with it every allocation made on that
    /// connection. Retryable on another executor.
    #[error("lost the executor at {executor}: its control connection closed; allocate again (elsewhere if it does not come back)")]
    ExecutorLost {
        /// The executor's control address.
        executor: String,
    },
    /// The worker's connection failed, but the executor reported no exit
    /// within the grace period. Retryable.
    #[error("lost the connection to the worker, and the executor did not say why; allocate again")]
    WorkerLost,
    /// The lane's fabric operation failed at the peer for a reason other
    /// than losing it (a refused remote access). Retryable by allocating
    /// again; report it, it means a bug.
    #[error("lane {lane} failed: {status}")]
    Transport {
        /// The lane.
        lane: usize,
        /// The completion's status.
        status: rfaas_fabric::Status,
    },
    /// Every lane has an invocation in flight. Retryable at once: wait for
    /// one, or use [`crate::Allocation::submit_wait`].
    #[error(
        "every lane of the allocation is busy; wait for an invocation to finish or use submit_wait"
    )]
    AllLanesBusy,
    /// The output buffer may still receive the response of an invocation
    /// that was dropped unfinished. Retryable once that response arrives.
    #[error("the output buffer is still the target of a dropped, unfinished invocation; wait for it or use another buffer")]
    BufferBusy,
    /// The function is not in the allocation's function table.
    #[error(
        "function {0:?} is not in the allocation's function table; list it in AllocationSpec::new"
    )]
    UnknownFunction(String),
    /// A call's arguments do not fit (a length beyond a buffer, a buffer of
    /// another allocation, ...).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The executor's reply does not follow the protocol.
    #[error("the executor broke the protocol: {0}")]
    Protocol(String),
    /// Connecting to the executor's control port failed. Retryable.
    #[error("cannot connect to the executor at {executor}: {source}")]
    Connect {
        /// The executor's control address.
        executor: String,
        /// The socket error.
        #[source]
        source: std::io::Error,
    },
    /// Something took longer than its configured limit. Retryable.
    #[error("{what} took longer than {after:?}")]
    Timeout {
        /// What timed out.
        what: &'static str,
        /// The limit.
        after: Duration,
    },
    /// A local fabric call failed.
    #[error("fabric: {0}")]
    Fabric(#[from] rfaas_fabric::Error),
    /// A control frame could not be read or written.
    #[error(transparent)]
    Control(#[from] ControlError),
}

/// `Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// Whether the same call may succeed on a new allocation, later, or on
    /// another executor.
    pub fn is_retryable(&self) -> bool {
        match self {
            Error::Refused { code, .. } => code.is_retryable(),
            Error::FunctionFailed(status) => status.is_retryable(),
            Error::WorkerCrashed { .. }
            | Error::ExecutorLost { .. }
            | Error::WorkerLost
            | Error::Transport { .. }
            | Error::AllLanesBusy
            | Error::BufferBusy
            | Error::Connect { .. }
            | Error::Timeout { .. } => true,
            Error::Fabric(e) => e.is_retryable(),
            Error::Control(ControlError::Io(_)) => true,
            Error::UnknownFunction(_)
            | Error::InvalidArgument(_)
            | Error::Protocol(_)
            | Error::Control(_) => false,
        }
    }

    /// Whether a retry should go to another executor rather than the same
    /// one.
    pub(crate) fn wants_other_executor(&self) -> bool {
        match self {
            Error::ExecutorLost { .. } | Error::Connect { .. } => true,
            Error::FunctionFailed(s) => *s == InvocationStatus::ExecutorDraining,
            Error::Refused { code, .. } => {
                matches!(code, ErrorCode::NoCapacity | ErrorCode::Draining)
            }
            _ => false,
        }
    }

    /// The error of a `function_crashed` answer: the worker reports the
    /// signal before it dies of it, and the daemon's `WorkerExited` says
    /// the same afterwards.
    pub(crate) fn crashed_in_band(signal: Option<i32>) -> Error {
        Error::WorkerCrashed {
            signal,
            cause: ExitCause::Crashed,
            message: "the function crashed; its worker answered for it and ended".into(),
        }
    }

    /// The error an invocation ends with when its worker ended with `exit`.
    pub(crate) fn from_exit(exit: &WorkerExited) -> Error {
        match exit.cause {
            ExitCause::DeadlineExceeded => {
                Error::FunctionFailed(InvocationStatus::DeadlineExceeded)
            }
            ExitCause::LeaseExpired => Error::FunctionFailed(InvocationStatus::LeaseExpired),
            ExitCause::Stopped | ExitCause::Drained => {
                Error::FunctionFailed(InvocationStatus::ExecutorDraining)
            }
            cause => Error::WorkerCrashed {
                signal: exit.signal,
                cause,
                message: exit.message.clone(),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn exited(cause: ExitCause, signal: Option<i32>) -> WorkerExited {
        WorkerExited {
            allocation_id: 1,
            cause,
            signal,
            exit_code: None,
            message: "worker 7 killed by SIGSEGV".into(),
        }
    }

    #[test]
    fn worker_exits_map_to_errors() {
        let e = Error::from_exit(&exited(ExitCause::Crashed, Some(11)));
        assert!(
            matches!(e, Error::WorkerCrashed { signal: Some(11), cause: ExitCause::Crashed, ref message } if message.contains("SIGSEGV")),
            "{e:?}"
        );
        assert!(e.is_retryable());
        assert!(e.to_string().contains("signal 11"), "{e}");
        assert!(matches!(
            Error::from_exit(&exited(ExitCause::Exited, None)),
            Error::WorkerCrashed {
                signal: None,
                cause: ExitCause::Exited,
                ..
            }
        ));
        let e = Error::from_exit(&exited(ExitCause::DeadlineExceeded, None));
        assert!(matches!(
            e,
            Error::FunctionFailed(InvocationStatus::DeadlineExceeded)
        ));
        assert!(!e.is_retryable());
        let e = Error::from_exit(&exited(ExitCause::LeaseExpired, Some(9)));
        assert!(matches!(
            e,
            Error::FunctionFailed(InvocationStatus::LeaseExpired)
        ));
        assert!(!e.is_retryable());
        let e = Error::from_exit(&exited(ExitCause::Stopped, Some(9)));
        assert!(matches!(
            e,
            Error::FunctionFailed(InvocationStatus::ExecutorDraining)
        ));
        assert!(e.is_retryable());
        assert!(e.wants_other_executor());
    }

    #[test]
    fn retryability() {
        let refused = |code| Error::Refused {
            code,
            message: String::new(),
        };
        assert!(refused(ErrorCode::NoCapacity).is_retryable());
        assert!(refused(ErrorCode::NoCapacity).wants_other_executor());
        assert!(!refused(ErrorCode::TokenForged).is_retryable());
        assert!(!refused(ErrorCode::UnknownFunction).is_retryable());
        assert!(!Error::FunctionFailed(InvocationStatus::OutputTooLarge).is_retryable());
        assert!(Error::FunctionFailed(InvocationStatus::InternalError).is_retryable());
        let lost = Error::ExecutorLost {
            executor: "127.0.0.1:1".into(),
        };
        assert!(lost.is_retryable());
        assert!(lost.wants_other_executor());
        assert!(lost.to_string().contains("127.0.0.1:1"), "{lost}");
        assert!(Error::WorkerLost.is_retryable());
        assert!(!Error::WorkerLost.wants_other_executor());
        assert!(Error::AllLanesBusy.is_retryable());
        assert!(!Error::UnknownFunction("f".into()).is_retryable());
        assert!(!Error::InvalidArgument("x".into()).is_retryable());
    }
}

//! [`Error`]: every way an allocation or an invocation can fail, whether
//! the allocation still takes calls, and what to do next ([`Next`]).

use std::fmt;
use std::time::Duration;

use rfaas_proto::control::client::{ExitCause, WorkerExited};
use rfaas_proto::control::{ControlError, ErrorCode};
pub use rfaas_proto::manager::ClusterOffer;
use rfaas_proto::manager::{ApiError, REQUEST_EXCEEDS_CLUSTER};
use rfaas_proto::text::count;
use rfaas_proto::InvocationStatus;

/// What to do after an [`Error`] ([`Error::next`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Next {
    /// Make the same call again, on the same allocation: what stood in its
    /// way (a busy lane, a busy buffer, a slow answer) passes.
    Retry,
    /// Allocate again (the same executor will do) and call again.
    Reallocate,
    /// Allocate again on another executor.
    Elsewhere,
    /// Get a new lease for the node, then allocate again.
    NewLease,
    /// Change the call, the allocation or the function: the same call
    /// fails the same way again.
    Fix,
    /// Report it: rfaas broke its own rules (a bug, or a client and an
    /// executor of different versions).
    Report,
}

/// What failed. Each variant says whether retrying can help
/// ([`Error::is_retryable`]; [`crate::Allocation::invoke_retrying`] retries
/// exactly those), whether the allocation still takes calls
/// ([`Error::allocation_usable`]), and what to do next ([`Error::next`]);
/// its message says the same in words.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The executor refused the allocation. Retryable when `code` is
    /// (no capacity, draining, an expired lease, an executor failure, an
    /// ending allocation of the same lease whose cores are not free yet:
    /// the client library waits that one out by itself, up to
    /// [`ClientOptions::allocation_timeout`](crate::ClientOptions::allocation_timeout)).
    #[error("the executor refused the allocation ({}): {message}", code_name(*code))]
    Refused {
        /// The executor's stable error code.
        code: ErrorCode,
        /// The executor's sentence: what failed and what to do.
        message: String,
    },
    /// The worker answered the invocation with a status other than `ok`,
    /// or ended for a reason that status names (`deadline_exceeded`,
    /// `lease_expired`, `executor_draining`: the allocation has ended).
    /// Retryable for `executor_draining` and `internal_error` only.
    #[error("{}", failed(*.0))]
    FunctionFailed(InvocationStatus),
    /// The worker process died under the invocation: a function crashed
    /// it, the allocation ran out of memory (`cause` `OutOfMemory`),
    /// something killed it, or it failed and exited (`Exited`). Retryable:
    /// a new allocation gets a fresh worker, but a function that crashes on
    /// this input crashes again.
    #[error("{}", crashed(*cause, *signal, message))]
    WorkerCrashed {
        /// The terminating signal, if a signal ended it (11 is SIGSEGV).
        signal: Option<i32>,
        /// Why the executor says it ended.
        cause: ExitCause,
        /// The executor's account, e.g. "worker 1234 killed by SIGSEGV".
        message: String,
    },
    /// The executor is shutting down (it was stopped, e.g. by SIGTERM) and
    /// ended the allocation. Retryable: allocate again, on another
    /// executor if this one does not come back.
    #[error("the executor at {executor} is shutting down and ended the allocation; allocate again, on another executor if it does not come back")]
    ExecutorStopped {
        /// The executor's control address.
        executor: String,
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
    #[error("lost the connection to the worker, and the executor did not say why; the allocation has ended: allocate again")]
    WorkerLost,
    /// The lane's fabric operation failed at the peer for a reason other
    /// than losing it (a refused remote access). Retryable by allocating
    /// again; report it, it means a bug.
    #[error("lane {lane} failed: {status}; the allocation has ended: allocate again, and report it (it means a bug)")]
    Transport {
        /// The lane.
        lane: usize,
        /// The completion's status.
        status: rfaas_fabric::Status,
    },
    /// Every lane has an invocation in flight. Retryable at once: wait for
    /// one, or use [`crate::Allocation::submit_wait`].
    #[error(
        "every lane of the allocation is busy; wait for an invocation to finish, or use submit_wait, which waits for a lane"
    )]
    AllLanesBusy,
    /// Every slot of a [`Pipeline`](crate::Pipeline) has a call in flight.
    /// Retryable at once: collect a call first.
    #[error("all {slots} slots of the pipeline have a call in flight; collect one (test_any, wait_any) before submitting another")]
    SlotsFull {
        /// The pipeline's slots.
        slots: usize,
    },
    /// The output buffer may still receive the response of an invocation
    /// that was dropped unfinished. Retryable once that response arrives.
    #[error("the output buffer is still the target of a dropped, unfinished invocation; call again once its answer has come, or use another buffer")]
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
    #[error("the executor broke the protocol: {0}; report it (are the client library and the executor of one version?)")]
    Protocol(String),
    /// Connecting to the executor's control port failed. Retryable.
    #[error("cannot connect to the executor at {executor}: {source}; check that rfaas-executord runs there, or allocate elsewhere")]
    Connect {
        /// The executor's control address.
        executor: String,
        /// The socket error.
        #[source]
        source: std::io::Error,
    },
    /// Something took longer than its configured limit. Retryable.
    #[error("{what} took longer than {after:?}; try again later")]
    Timeout {
        /// What timed out.
        what: &'static str,
        /// The limit.
        after: Duration,
    },
    /// A resource manager refused a lease request (or its renewal or
    /// release), or still answered "nothing fits" (`503`, kind
    /// `no_capacity`) when the request's deadline came. Retryable for
    /// `503` and other 5xx only.
    #[error("the manager refused the request ({kind}, HTTP {status}): {message}")]
    Manager {
        /// The HTTP status.
        status: u16,
        /// The manager's stable error kind (`no_capacity`,
        /// `quota_exceeded`, `unauthorized`, ...).
        kind: String,
        /// The manager's sentence: what failed and what to do.
        message: String,
    },
    /// A manager refused the request for good: it asks for more than the
    /// cluster has ever held (more memory per node lease than the largest
    /// node offers, or more cores than the nodes with that memory hold
    /// together), so no wait makes it fit (`422`, kind
    /// `request_exceeds_cluster`). Not
    /// retryable: ask for at most the `offer`.
    #[error("{}", exceeds_cluster(offer, message))]
    ExceedsCluster {
        /// The largest the cluster offers, as the manager counts it.
        offer: ClusterOffer,
        /// The manager's sentence.
        message: String,
    },
    /// No manager answered before the request's deadline. Retryable.
    #[error("no manager answered (last tried {url}: {why}); check that rfaas-manager runs there and the URL is right")]
    ManagerUnreachable {
        /// The last URL tried.
        url: String,
        /// Why it did not answer.
        why: String,
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

/// What an invocation's timeout is called ([`Error::Timeout`]'s `what`).
pub(crate) const INVOCATION: &str = "the invocation";

impl Error {
    /// Whether the same call may succeed on a new allocation, later, or on
    /// another executor.
    pub fn is_retryable(&self) -> bool {
        match self {
            Error::Refused { code, .. } => code.is_retryable(),
            Error::FunctionFailed(status) => status.is_retryable(),
            Error::Manager { status, .. } => *status >= 500,
            Error::ExceedsCluster { .. } => false,
            Error::ManagerUnreachable { .. } => true,
            Error::WorkerCrashed { .. }
            | Error::ExecutorStopped { .. }
            | Error::ExecutorLost { .. }
            | Error::WorkerLost
            | Error::Transport { .. }
            | Error::AllLanesBusy
            | Error::SlotsFull { .. }
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

    /// Whether the allocation the failed call was made on still takes
    /// calls. False once its worker has ended (a crash, the deadline, the
    /// lease's end, a drain, a stop, a lost executor): every later call on
    /// it fails at once with the same error. For an error of
    /// [`Client::allocate`](crate::Client::allocate), which leaves no
    /// allocation, it is false.
    pub fn allocation_usable(&self) -> bool {
        match self {
            Error::FunctionFailed(status) => !status.ends_worker(),
            Error::AllLanesBusy
            | Error::SlotsFull { .. }
            | Error::BufferBusy
            | Error::UnknownFunction(_)
            | Error::InvalidArgument(_) => true,
            Error::Timeout { what, .. } => *what == INVOCATION,
            Error::Fabric(e) => e.is_retryable(),
            Error::Refused { .. }
            | Error::Manager { .. }
            | Error::ExceedsCluster { .. }
            | Error::ManagerUnreachable { .. }
            | Error::WorkerCrashed { .. }
            | Error::ExecutorStopped { .. }
            | Error::ExecutorLost { .. }
            | Error::WorkerLost
            | Error::Transport { .. }
            | Error::Protocol(_)
            | Error::Connect { .. }
            | Error::Control(_) => false,
        }
    }

    /// What to do next.
    pub fn next(&self) -> Next {
        match self {
            Error::Refused { code, .. } => match code {
                ErrorCode::TokenExpired => Next::NewLease,
                ErrorCode::NoCapacity | ErrorCode::Draining => Next::Elsewhere,
                ErrorCode::Internal | ErrorCode::AllocationEnding => Next::Reallocate,
                ErrorCode::MalformedRequest => Next::Report,
                _ => Next::Fix,
            },
            Error::FunctionFailed(status) => match status {
                InvocationStatus::ExecutorDraining => Next::Elsewhere,
                InvocationStatus::LeaseExpired => Next::NewLease,
                InvocationStatus::InternalError => Next::Retry,
                InvocationStatus::FunctionCrashed => Next::Reallocate,
                InvocationStatus::OutputTooLarge
                | InvocationStatus::DeadlineExceeded
                | InvocationStatus::PayloadTooLarge => Next::Fix,
                InvocationStatus::Ok
                | InvocationStatus::UnknownFunction
                | InvocationStatus::MalformedRequest => Next::Report,
            },
            Error::WorkerCrashed {
                cause: ExitCause::OutOfMemory,
                ..
            } => Next::Fix,
            Error::WorkerCrashed { .. } | Error::WorkerLost | Error::Transport { .. } => {
                Next::Reallocate
            }
            Error::ExecutorStopped { .. } | Error::ExecutorLost { .. } | Error::Connect { .. } => {
                Next::Elsewhere
            }
            Error::AllLanesBusy
            | Error::SlotsFull { .. }
            | Error::BufferBusy
            | Error::Timeout { .. } => Next::Retry,
            Error::Manager { status, .. } if *status >= 500 => Next::Retry,
            Error::Manager { .. } | Error::ExceedsCluster { .. } => Next::Fix,
            Error::ManagerUnreachable { .. } => Next::Retry,
            Error::UnknownFunction(_) | Error::InvalidArgument(_) => Next::Fix,
            Error::Fabric(e) if e.is_retryable() => Next::Retry,
            Error::Fabric(_) => Next::Fix,
            Error::Control(ControlError::Io(_)) => Next::Elsewhere,
            Error::Protocol(_) | Error::Control(_) => Next::Report,
        }
    }

    /// The error of a manager's refusal: `status`, and the body `api`.
    pub(crate) fn from_manager(status: u16, api: ApiError) -> Error {
        if api.error == REQUEST_EXCEEDS_CLUSTER && (400..500).contains(&status) {
            if let Some(offer) = ClusterOffer::from_details(&api.details) {
                return Error::ExceedsCluster {
                    offer,
                    message: api.message,
                };
            }
        }
        Error::Manager {
            status,
            kind: api.error,
            message: api.message,
        }
    }

    /// The signal that ended the worker, for [`Error::WorkerCrashed`].
    pub fn signal(&self) -> Option<i32> {
        match self {
            Error::WorkerCrashed { signal, .. } => *signal,
            _ => None,
        }
    }

    /// Whether a retry should go to another executor rather than the same
    /// one.
    pub(crate) fn wants_other_executor(&self) -> bool {
        self.next() == Next::Elsewhere
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

    /// The error an invocation ends with when its worker, on the executor
    /// at `executor`, ended with `exit`. A cause the worker also answers in
    /// band gives the same error either way.
    pub(crate) fn from_exit(exit: &WorkerExited, executor: &str) -> Error {
        match exit.cause {
            ExitCause::DeadlineExceeded => {
                Error::FunctionFailed(InvocationStatus::DeadlineExceeded)
            }
            ExitCause::LeaseExpired => Error::FunctionFailed(InvocationStatus::LeaseExpired),
            ExitCause::Drained => Error::FunctionFailed(InvocationStatus::ExecutorDraining),
            ExitCause::Stopped => Error::ExecutorStopped {
                executor: executor.to_owned(),
            },
            cause => Error::WorkerCrashed {
                signal: exit.signal,
                cause,
                message: exit.message.clone(),
            },
        }
    }
}

/// `n` values of `size` bytes each, in the words a caller used: bytes for
/// byte buffers (all the C API has), elements otherwise.
pub(crate) fn elements(n: usize, size: usize) -> String {
    if size == 1 {
        count(n as u64, "byte")
    } else {
        format!(
            "{} of {}",
            count(n as u64, "element"),
            count(size as u64, "byte")
        )
    }
}

/// The executor's refusal code as it is on the wire (`no_capacity`).
fn code_name(code: ErrorCode) -> String {
    serde_json::to_value(code)
        .ok()
        .and_then(|v| v.as_str().map(str::to_owned))
        .unwrap_or_else(|| format!("{code:?}"))
}

/// The sentence of a worker's failure status: what happened, and what next.
fn failed(status: InvocationStatus) -> &'static str {
    match status {
        InvocationStatus::Ok => "the worker reported success as a failure; report it",
        InvocationStatus::FunctionCrashed => "the function crashed its worker; the allocation has ended: allocate again",
        InvocationStatus::OutputTooLarge => "the function returned more output than the output buffer (or the allocation's output capacity) holds; give it a bigger output buffer, or allocate with a bigger output capacity",
        InvocationStatus::UnknownFunction => "the worker does not know the function index it was sent; the client and the worker disagree on the function table: report it",
        InvocationStatus::ExecutorDraining => "the executor's node is being retrieved (drained) and its worker takes no more calls; the allocation has ended: allocate on another executor",
        InvocationStatus::DeadlineExceeded => "the function ran past the allocation's deadline and its worker ended; the allocation has ended: split the work into shorter calls or ask for a longer deadline, and allocate again",
        InvocationStatus::PayloadTooLarge => "the input is larger than the worker can hold under the allocation's memory; send less per call, or allocate with more memory",
        InvocationStatus::MalformedRequest => "the worker could not read the request's header; report it",
        InvocationStatus::LeaseExpired => "the lease behind the allocation has expired and its worker takes no more calls; the allocation has ended: get a new lease and allocate again",
        InvocationStatus::InternalError => "the worker failed for a reason other than the function; call again (allocate again if it persists)",
    }
}

/// The sentence of a request no node can ever hold.
fn exceeds_cluster(offer: &ClusterOffer, message: &str) -> String {
    format!(
        "no node of the cluster can hold the request, now or later: the largest node offers {} and {} MiB, and the cluster has {} on {}; waiting does not help: ask for at most that (the manager said: {message})",
        count(offer.largest_node_cores, "core"),
        offer.largest_node_memory_mib,
        count(offer.cluster_cores, "core"),
        count(offer.nodes, "node"),
    )
}

/// The sentence of a worker's death.
fn crashed(cause: ExitCause, signal: Option<i32>, message: &str) -> String {
    let by = match signal {
        Some(s) => format!(
            " (signal {s}{})",
            signal_name(s).map(|n| format!(", {n}")).unwrap_or_default()
        ),
        None => String::new(),
    };
    match cause {
        ExitCause::OutOfMemory => format!("the worker ran out of memory{by}: {message}; the allocation has ended: allocate again with more memory"),
        ExitCause::Exited => format!("the worker failed and exited{by}: {message}; the allocation has ended: allocate again"),
        _ => format!("the worker crashed{by}: {message}; the allocation has ended: allocate again (a function that crashes on this input crashes again)"),
    }
}

/// The name of a signal that ends workers.
fn signal_name(signal: i32) -> Option<&'static str> {
    Some(match signal {
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        libc::SIGILL => "SIGILL",
        libc::SIGABRT => "SIGABRT",
        libc::SIGTRAP => "SIGTRAP",
        libc::SIGSYS => "SIGSYS",
        libc::SIGKILL => "SIGKILL",
        libc::SIGTERM => "SIGTERM",
        _ => return None,
    })
}

impl fmt::Display for Next {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Next::Retry => "retry",
            Next::Reallocate => "reallocate",
            Next::Elsewhere => "elsewhere",
            Next::NewLease => "new lease",
            Next::Fix => "fix",
            Next::Report => "report",
        })
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

    const EXECUTOR: &str = "127.0.0.1:7100";

    #[test]
    fn worker_exits_map_to_errors() {
        let e = Error::from_exit(&exited(ExitCause::Crashed, Some(11)), EXECUTOR);
        assert!(
            matches!(e, Error::WorkerCrashed { signal: Some(11), cause: ExitCause::Crashed, ref message } if message.contains("SIGSEGV")),
            "{e:?}"
        );
        assert!(e.is_retryable());
        assert_eq!(e.signal(), Some(11));
        assert!(e.to_string().contains("signal 11, SIGSEGV"), "{e}");
        assert!(matches!(
            Error::from_exit(&exited(ExitCause::Exited, None), EXECUTOR),
            Error::WorkerCrashed {
                signal: None,
                cause: ExitCause::Exited,
                ..
            }
        ));
        let e = Error::from_exit(&exited(ExitCause::DeadlineExceeded, None), EXECUTOR);
        assert!(matches!(
            e,
            Error::FunctionFailed(InvocationStatus::DeadlineExceeded)
        ));
        assert!(!e.is_retryable());
        let e = Error::from_exit(&exited(ExitCause::LeaseExpired, Some(9)), EXECUTOR);
        assert!(matches!(
            e,
            Error::FunctionFailed(InvocationStatus::LeaseExpired)
        ));
        assert!(!e.is_retryable());
        let e = Error::from_exit(&exited(ExitCause::Drained, Some(9)), EXECUTOR);
        assert!(matches!(
            e,
            Error::FunctionFailed(InvocationStatus::ExecutorDraining)
        ));
        assert!(e.is_retryable());
        assert!(e.wants_other_executor());
        // A shutdown is not a drain: it says so, and names the executor.
        let e = Error::from_exit(&exited(ExitCause::Stopped, Some(9)), EXECUTOR);
        assert!(
            matches!(e, Error::ExecutorStopped { ref executor } if executor == EXECUTOR),
            "{e:?}"
        );
        assert!(e.is_retryable());
        assert!(e.wants_other_executor());
        let text = e.to_string();
        assert!(text.contains("is shutting down"), "{text}");
        assert!(
            !text.contains("retrieved") && !text.contains("drain"),
            "{text}"
        );
    }

    /// One of every kind of error, with the causes that change the answers.
    fn every_error() -> Vec<Error> {
        let mut all: Vec<Error> = InvocationStatus::ALL
            .into_iter()
            .map(Error::FunctionFailed)
            .collect();
        for cause in [
            ExitCause::Crashed,
            ExitCause::OutOfMemory,
            ExitCause::Exited,
        ] {
            all.push(Error::WorkerCrashed {
                signal: Some(9),
                cause,
                message: "worker 7 killed by SIGKILL".into(),
            });
        }
        for code in [
            ErrorCode::TokenExpired,
            ErrorCode::NoCapacity,
            ErrorCode::Internal,
            ErrorCode::MalformedRequest,
            ErrorCode::ExceedsLease,
            ErrorCode::AllocationEnding,
        ] {
            all.push(Error::Refused {
                code,
                message: "the executor's sentence".into(),
            });
        }
        all.extend([
            Error::ExecutorStopped {
                executor: EXECUTOR.into(),
            },
            Error::ExecutorLost {
                executor: EXECUTOR.into(),
            },
            Error::WorkerLost,
            Error::Transport {
                lane: 1,
                status: rfaas_fabric::Status::RemoteAccess,
            },
            Error::AllLanesBusy,
            Error::SlotsFull { slots: 4 },
            Error::BufferBusy,
            Error::UnknownFunction("f".into()),
            Error::InvalidArgument("x".into()),
            Error::Protocol("p".into()),
            Error::Connect {
                executor: EXECUTOR.into(),
                source: std::io::Error::from(std::io::ErrorKind::ConnectionRefused),
            },
            Error::Timeout {
                what: INVOCATION,
                after: Duration::from_secs(1),
            },
            Error::Timeout {
                what: "the executor's reply",
                after: Duration::from_secs(1),
            },
            Error::ExceedsCluster {
                offer: OFFER,
                message: "the manager's sentence".into(),
            },
        ]);
        all
    }

    const OFFER: ClusterOffer = ClusterOffer {
        largest_node_cores: 2,
        largest_node_memory_mib: 2048,
        cluster_cores: 6,
        nodes: 3,
        cores_with_memory: 6,
    };

    #[test]
    fn every_error_says_what_next() {
        for e in every_error() {
            let text = e.to_string();
            // A refusal and an invalid argument carry the executor's or the
            // check's own sentence, which says what to do.
            if matches!(e, Error::Refused { .. } | Error::InvalidArgument(_)) {
                continue;
            }
            let words: &[&str] = match e.next() {
                Next::Retry => &["again", "wait"],
                Next::Reallocate => &["allocate again"],
                Next::Elsewhere => &["another executor", "elsewhere"],
                Next::NewLease => &["get a new lease"],
                Next::Fix => &[
                    "list it",
                    "bigger",
                    "shorter",
                    "send less",
                    "more memory",
                    "ask for at most",
                ],
                Next::Report => &["report it"],
            };
            assert!(
                words.iter().any(|w| text.contains(w)),
                "{e:?} ({}): {text}",
                e.next()
            );
            // Whether the allocation has ended is said, too (but where the
            // same error can come from allocating or leasing, which leave
            // none).
            if !matches!(
                e,
                Error::Connect { .. }
                    | Error::Timeout { .. }
                    | Error::Protocol(_)
                    | Error::ExceedsCluster { .. }
            ) {
                let ended = ["has ended", "ended the allocation", "lost the executor"]
                    .iter()
                    .any(|w| text.contains(w));
                assert_eq!(ended, !e.allocation_usable(), "{e:?}: {text}");
            }
        }
    }

    #[test]
    fn usable_allocations_and_what_next() {
        let usable = |e: Error| e.allocation_usable();
        assert!(usable(Error::AllLanesBusy));
        assert!(usable(Error::FunctionFailed(
            InvocationStatus::OutputTooLarge
        )));
        assert!(usable(Error::Timeout {
            what: INVOCATION,
            after: Duration::from_secs(1)
        }));
        for status in [
            InvocationStatus::DeadlineExceeded,
            InvocationStatus::LeaseExpired,
            InvocationStatus::ExecutorDraining,
            InvocationStatus::FunctionCrashed,
        ] {
            assert!(!usable(Error::FunctionFailed(status)), "{status:?}");
        }
        assert!(!usable(Error::crashed_in_band(Some(11))));
        assert_eq!(
            Error::FunctionFailed(InvocationStatus::LeaseExpired).next(),
            Next::NewLease
        );
        assert!(Error::FunctionFailed(InvocationStatus::LeaseExpired)
            .to_string()
            .contains("get a new lease"));
        assert_eq!(
            Error::WorkerCrashed {
                signal: Some(9),
                cause: ExitCause::OutOfMemory,
                message: String::new()
            }
            .next(),
            Next::Fix
        );
        assert_eq!(Error::crashed_in_band(None).next(), Next::Reallocate);
        assert_eq!(Error::AllLanesBusy.next(), Next::Retry);
        let refused = |code| Error::Refused {
            code,
            message: String::new(),
        };
        assert_eq!(refused(ErrorCode::TokenExpired).next(), Next::NewLease);
        assert_eq!(refused(ErrorCode::NoCapacity).next(), Next::Elsewhere);
        // An ending allocation of the same lease: the same executor, soon.
        assert_eq!(
            refused(ErrorCode::AllocationEnding).next(),
            Next::Reallocate
        );
        assert!(refused(ErrorCode::AllocationEnding).is_retryable());
        assert!(refused(ErrorCode::NoCapacity)
            .to_string()
            .contains("(no_capacity)"));
    }

    #[test]
    fn a_request_beyond_the_cluster_is_refused_for_good_with_the_largest_offer() {
        let api = |error: &str, details: serde_json::Value| ApiError {
            error: error.into(),
            message: "the largest node offers 2 cores".into(),
            details: details.as_object().cloned().unwrap_or_default(),
        };
        let figures = serde_json::json!({
            "largest_node_cores": 2, "largest_node_memory_mib": 2048,
            "cluster_cores": 6, "nodes": 3, "cores_with_memory": 6,
        });
        let e = Error::from_manager(422, api(REQUEST_EXCEEDS_CLUSTER, figures.clone()));
        assert!(
            matches!(e, Error::ExceedsCluster { offer, .. } if offer == OFFER),
            "{e:?}"
        );
        assert!(!e.is_retryable());
        assert_eq!(e.next(), Next::Fix);
        assert!(!e.allocation_usable());
        let text = e.to_string();
        for words in [
            "2 cores and 2048 MiB",
            "6 cores on 3 nodes",
            "ask for at most",
        ] {
            assert!(text.contains(words), "{words:?} not in {text}");
        }
        // Without its figures it is still the manager's refusal, for good.
        let e = Error::from_manager(422, api(REQUEST_EXCEEDS_CLUSTER, serde_json::json!({})));
        assert!(
            matches!(e, Error::Manager { status: 422, ref kind, .. } if kind == REQUEST_EXCEEDS_CLUSTER),
            "{e:?}"
        );
        assert!(!e.is_retryable());
        // Other kinds stay what they were.
        let e = Error::from_manager(503, api("no_capacity", figures));
        assert!(matches!(e, Error::Manager { status: 503, .. }), "{e:?}");
        assert!(e.is_retryable());
    }

    #[test]
    fn elements_are_bytes_for_bytes() {
        assert_eq!(elements(1, 1), "1 byte");
        assert_eq!(elements(16, 1), "16 bytes");
        assert_eq!(elements(1, 8), "1 element of 8 bytes");
        assert_eq!(elements(3, 8), "3 elements of 8 bytes");
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

//! [`InvocationStatus`]: the outcome of one invocation, as the worker reports
//! it in the low 12 bits of a [`ResponseImm`](crate::ResponseImm).
//!
//! Codes are stable: a code, once assigned, keeps its meaning. Adding a code
//! bumps [`VERSION`](crate::VERSION).

use std::fmt;

use crate::error::ProtoError;

/// Outcome of one invocation. The discriminant is the wire code.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u16)]
pub enum InvocationStatus {
    /// The function returned; the output length is the completion's length.
    Ok = 0,
    /// The function's process died (a signal such as SIGSEGV or SIGABRT).
    FunctionCrashed = 1,
    /// The function wrote past the output capacity (into the guard page).
    OutputTooLarge = 2,
    /// The function index is not in the allocation's function table.
    UnknownFunction = 3,
    /// The node is being retrieved (drained); allocate on another executor.
    ExecutorDraining = 4,
    /// The function ran past the allocation's deadline.
    DeadlineExceeded = 5,
    /// The input is larger than the allocation permits.
    PayloadTooLarge = 6,
    /// The invocation header failed to decode or validate.
    MalformedRequest = 7,
    /// The lease backing the allocation has expired.
    LeaseExpired = 8,
    /// A worker-side fault not caused by the function.
    InternalError = 9,
}

impl InvocationStatus {
    /// Every status, in code order.
    pub const ALL: [InvocationStatus; 10] = [
        Self::Ok,
        Self::FunctionCrashed,
        Self::OutputTooLarge,
        Self::UnknownFunction,
        Self::ExecutorDraining,
        Self::DeadlineExceeded,
        Self::PayloadTooLarge,
        Self::MalformedRequest,
        Self::LeaseExpired,
        Self::InternalError,
    ];

    /// The largest code this protocol version defines.
    pub const MAX_CODE: u16 = Self::InternalError as u16;

    /// The wire code.
    pub const fn code(self) -> u16 {
        self as u16
    }

    /// Whether sending the same request again, unchanged, to another worker
    /// or executor may succeed.
    ///
    /// True only for faults of the place the request ran, not of the request:
    /// [`ExecutorDraining`](Self::ExecutorDraining) (the node is leaving the
    /// pool, others are not) and [`InternalError`](Self::InternalError) (the
    /// worker failed, not the function). A crash is not retryable because the
    /// function and its input most likely crash again; a caller that knows
    /// its function is flaky may still choose to retry. Size, table and
    /// format errors repeat deterministically, and an expired lease or a
    /// missed deadline needs a new allocation, not a resend.
    pub const fn is_retryable(self) -> bool {
        matches!(self, Self::ExecutorDraining | Self::InternalError)
    }

    /// Whether the worker serves nothing more once it answered this: it is
    /// dying ([`FunctionCrashed`](Self::FunctionCrashed),
    /// [`DeadlineExceeded`](Self::DeadlineExceeded)) or refuses every
    /// request from now on ([`LeaseExpired`](Self::LeaseExpired),
    /// [`ExecutorDraining`](Self::ExecutorDraining)). A client ends the
    /// allocation on the first such answer.
    pub const fn ends_worker(self) -> bool {
        matches!(
            self,
            Self::FunctionCrashed
                | Self::DeadlineExceeded
                | Self::LeaseExpired
                | Self::ExecutorDraining
        )
    }
}

impl TryFrom<u16> for InvocationStatus {
    type Error = ProtoError;

    fn try_from(code: u16) -> Result<Self, ProtoError> {
        Self::ALL
            .get(usize::from(code))
            .copied()
            .ok_or(ProtoError::UnknownStatus { code })
    }
}

impl From<InvocationStatus> for u16 {
    fn from(status: InvocationStatus) -> u16 {
        status.code()
    }
}

impl fmt::Display for InvocationStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Ok => "The function completed.",
            Self::FunctionCrashed => "The function's process crashed.",
            Self::OutputTooLarge => "The function wrote more output than the output buffer holds.",
            Self::UnknownFunction => {
                "The function index is not in the allocation's function table."
            }
            Self::ExecutorDraining => {
                "The executor's node is being retrieved (drained); allocate on another executor."
            }
            Self::DeadlineExceeded => "The function ran past the allocation's deadline.",
            Self::PayloadTooLarge => "The input is larger than the allocation permits.",
            Self::MalformedRequest => "The invocation header was malformed.",
            Self::LeaseExpired => {
                "The lease backing the allocation has expired; get a new lease and allocate again."
            }
            Self::InternalError => "The worker failed for a reason other than the function.",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_stable() {
        let expected: [(InvocationStatus, u16); 10] = [
            (InvocationStatus::Ok, 0),
            (InvocationStatus::FunctionCrashed, 1),
            (InvocationStatus::OutputTooLarge, 2),
            (InvocationStatus::UnknownFunction, 3),
            (InvocationStatus::ExecutorDraining, 4),
            (InvocationStatus::DeadlineExceeded, 5),
            (InvocationStatus::PayloadTooLarge, 6),
            (InvocationStatus::MalformedRequest, 7),
            (InvocationStatus::LeaseExpired, 8),
            (InvocationStatus::InternalError, 9),
        ];
        for (status, code) in expected {
            assert_eq!(status.code(), code, "{status:?}");
            assert_eq!(u16::from(status), code, "{status:?}");
            assert_eq!(InvocationStatus::try_from(code), Ok(status));
        }
        assert_eq!(InvocationStatus::MAX_CODE, 9);
    }

    #[test]
    fn all_is_in_code_order() {
        for (i, status) in InvocationStatus::ALL.iter().enumerate() {
            assert_eq!(usize::from(status.code()), i);
        }
    }

    #[test]
    fn every_undefined_code_is_rejected() {
        for code in 10..=u16::MAX {
            assert_eq!(
                InvocationStatus::try_from(code),
                Err(ProtoError::UnknownStatus { code })
            );
        }
    }

    #[test]
    fn only_draining_and_internal_error_are_retryable() {
        let retryable: Vec<_> = InvocationStatus::ALL
            .into_iter()
            .filter(|s| s.is_retryable())
            .collect();
        assert_eq!(
            retryable,
            [
                InvocationStatus::ExecutorDraining,
                InvocationStatus::InternalError
            ]
        );
    }

    #[test]
    fn the_statuses_after_which_a_worker_serves_nothing() {
        let ending: Vec<_> = InvocationStatus::ALL
            .into_iter()
            .filter(|s| s.ends_worker())
            .collect();
        assert_eq!(
            ending,
            [
                InvocationStatus::FunctionCrashed,
                InvocationStatus::ExecutorDraining,
                InvocationStatus::DeadlineExceeded,
                InvocationStatus::LeaseExpired,
            ]
        );
    }

    #[test]
    fn display_is_a_sentence() {
        for status in InvocationStatus::ALL {
            let text = status.to_string();
            assert!(text.starts_with(char::is_uppercase), "{text}");
            assert!(text.ends_with('.'), "{text}");
        }
    }

    #[test]
    fn unknown_status_message_names_the_code_and_the_range() {
        let msg = ProtoError::UnknownStatus { code: 10 }.to_string();
        assert_eq!(
            msg,
            "status code 10 is not a known invocation status; \
             protocol version 2 defines codes 0 through 9"
        );
    }
}

//! The plumbing every `extern "C"` function shares: the thread's last error
//! (message and [`rfaas_error_info`]), panic containment, checked
//! conversions of C arguments, and the client's errors in C's words.

use std::borrow::Cow;
use std::cell::{Cell, RefCell};
use std::ffi::{c_char, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

use ::rfaas_client::Error;

use crate::status::{rfaas_next, rfaas_status};

/// What a thread's last failure was, besides its message: what to do next,
/// whether the allocation still takes calls, and the signal that ended its
/// worker. From `rfaas_last_error_info()`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct rfaas_error_info {
    /// The failure's status; `RFAAS_OK` when the thread has not failed yet.
    pub status: rfaas_status,
    /// What to do next.
    pub next: rfaas_next,
    /// Whether the allocation the call was made on still takes calls. False
    /// once its worker has ended (every later call on it fails at once with
    /// the same status), and for a failed `rfaas_client_new`,
    /// `rfaas_allocate*` or `rfaas_deallocate`, which leave no allocation.
    pub allocation_usable: bool,
    /// The signal that ended the worker (`RFAAS_ERR_WORKER_CRASHED`,
    /// `RFAAS_ERR_OUT_OF_MEMORY`), e.g. 11 for SIGSEGV; 0 when no signal
    /// did.
    pub signal: i32,
}

const NO_FAILURE: rfaas_error_info = rfaas_error_info {
    status: rfaas_status::RFAAS_OK,
    next: rfaas_next::RFAAS_NEXT_NONE,
    allocation_usable: true,
    signal: 0,
};

thread_local! {
    /// The message of this thread's last failed call.
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
    /// The rest of it.
    static LAST_INFO: Cell<rfaas_error_info> = const { Cell::new(NO_FAILURE) };
    /// How many times this thread's last `rfaas_invoke_retrying` retried.
    static LAST_RETRIES: Cell<u32> = const { Cell::new(0) };
}

/// A failed call: its status, the sentence `rfaas_last_error` returns, and
/// what `rfaas_last_error_info` adds.
#[derive(Debug, Clone)]
pub(crate) struct Failure {
    pub(crate) status: rfaas_status,
    pub(crate) message: String,
    pub(crate) next: rfaas_next,
    pub(crate) allocation_usable: bool,
    pub(crate) signal: i32,
}

impl Failure {
    /// A bad argument of the C call `call`: fix the call; the allocation
    /// is as it was.
    pub(crate) fn invalid(call: &str, why: impl std::fmt::Display) -> Failure {
        Failure {
            status: rfaas_status::RFAAS_ERR_INVALID_ARGUMENT,
            message: format!("{call}: {why}"),
            next: rfaas_next::RFAAS_NEXT_FIX,
            allocation_usable: true,
            signal: 0,
        }
    }

    /// A client error met in the C call `call`.
    pub(crate) fn client(call: &str, e: &Error) -> Failure {
        Failure {
            status: rfaas_status::from_error(e),
            message: format!("{call}: {}", in_c_words(e)),
            next: e.next().into(),
            allocation_usable: e.allocation_usable(),
            signal: e.signal().unwrap_or(0),
        }
    }

    /// The failure of a call that was to make (or end) an allocation: it
    /// leaves none to use.
    pub(crate) fn no_allocation(self) -> Failure {
        Failure {
            allocation_usable: false,
            ..self
        }
    }

    fn info(&self) -> rfaas_error_info {
        rfaas_error_info {
            status: self.status,
            next: self.next,
            allocation_usable: self.allocation_usable,
            signal: self.signal,
        }
    }
}

/// The message of a client error, in C's words where the client's name
/// Rust things (`submit_wait`, `AllocationSpec::new`, dropping).
pub(crate) fn in_c_words(e: &Error) -> Cow<'static, str> {
    match e {
        Error::AllLanesBusy => "every lane of the allocation is busy; wait for an invocation to finish (rfaas_wait), or call rfaas_invoke, which waits for a lane".into(),
        Error::BufferBusy => "the output buffer is still the target of an invocation freed before it finished; call again once its answer has come, or use another buffer".into(),
        Error::UnknownFunction(name) if name.starts_with('#') => format!(
            "function {name} is not in the allocation's function table; look a function's index up with rfaas_function_index"
        )
        .into(),
        Error::UnknownFunction(name) => format!(
            "function {name:?} is not in the allocation's function table; list it in the functions given to rfaas_allocate"
        )
        .into(),
        e => e.to_string().into(),
    }
}

/// The result of a call's body.
pub(crate) type CallResult = Result<rfaas_status, Failure>;

/// Records `failure` as the thread's last error.
pub(crate) fn set_last_failure(failure: Failure) {
    LAST_INFO.with(|slot| slot.set(failure.info()));
    // Interior NULs would cut the C string short; show them instead.
    let c = CString::new(failure.message.replace('\0', "\\0")).unwrap_or_default();
    LAST_ERROR.with(|slot| *slot.borrow_mut() = c);
}

/// Records how many times the thread's `rfaas_invoke_retrying` retried.
pub(crate) fn set_last_retries(n: u32) {
    LAST_RETRIES.with(|slot| slot.set(n));
}

/// Runs the body of the C call `call`: a failure sets the thread's last
/// error and returns its status; a panic never crosses into C and becomes
/// `RFAAS_ERR_INTERNAL`.
pub(crate) fn call(name: &str, body: impl FnOnce() -> CallResult) -> rfaas_status {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(status)) => status,
        Ok(Err(failure)) => {
            let status = failure.status;
            set_last_failure(failure);
            status
        }
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic without a message".into());
            set_last_failure(Failure {
                status: rfaas_status::RFAAS_ERR_INTERNAL,
                message: format!(
                    "{name}: internal error in librfaas ({what}); please report it with this message"
                ),
                next: rfaas_next::RFAAS_NEXT_REPORT,
                allocation_usable: false,
                signal: 0,
            });
            rfaas_status::RFAAS_ERR_INTERNAL
        }
    }
}

/// Runs a call that returns no status (the `_free` functions, accessors):
/// a panic is contained and gives `fallback`.
pub(crate) fn call_infallible<T>(fallback: T, body: impl FnOnce() -> T) -> T {
    catch_unwind(AssertUnwindSafe(body)).unwrap_or(fallback)
}

/// `p` as a UTF-8 string, or an invalid-argument failure naming `what`.
///
/// # Safety
///
/// `p` is NULL or points to a NUL-terminated string that stays valid and
/// unchanged for `'a`.
pub(crate) unsafe fn str_arg<'a>(
    call: &str,
    what: &str,
    p: *const c_char,
) -> Result<&'a str, Failure> {
    if p.is_null() {
        return Err(Failure::invalid(call, format!("`{what}` is NULL")));
    }
    // SAFETY: non-null, and the caller promises a NUL-terminated string
    // that outlives 'a.
    let s = unsafe { CStr::from_ptr(p) };
    s.to_str()
        .map_err(|_| Failure::invalid(call, format!("`{what}` is not valid UTF-8")))
}

/// `p` as a reference, or an invalid-argument failure naming `what`.
///
/// # Safety
///
/// `p` is NULL or points to a live `T` that nothing mutates for `'a`.
pub(crate) unsafe fn ref_arg<'a, T>(call: &str, what: &str, p: *const T) -> Result<&'a T, Failure> {
    // SAFETY: the caller promises p is NULL or valid for 'a.
    unsafe { p.as_ref() }.ok_or_else(|| Failure::invalid(call, format!("`{what}` is NULL")))
}

/// `p` as a mutable reference, or an invalid-argument failure naming `what`.
///
/// # Safety
///
/// `p` is NULL or points to a live `T` that nothing else accesses for `'a`.
pub(crate) unsafe fn mut_arg<'a, T>(
    call: &str,
    what: &str,
    p: *mut T,
) -> Result<&'a mut T, Failure> {
    // SAFETY: the caller promises p is NULL or valid and unaliased for 'a.
    unsafe { p.as_mut() }.ok_or_else(|| Failure::invalid(call, format!("`{what}` is NULL")))
}

/// Checks an out-pointer is not NULL.
pub(crate) fn out_arg<T>(call: &str, what: &str, p: *mut T) -> Result<(), Failure> {
    if p.is_null() {
        Err(Failure::invalid(
            call,
            format!("`{what}` (the result pointer) is NULL"),
        ))
    } else {
        Ok(())
    }
}

/// The message of the calling thread's last failed call, NUL-terminated;
/// "" when none failed yet. Successful calls leave it unchanged. The string
/// belongs to librfaas and stays valid until this thread's next failing
/// call; copy it to keep it longer.
#[no_mangle]
pub extern "C" fn rfaas_last_error() -> *const c_char {
    call_infallible(c"".as_ptr(), || {
        // The CString's heap buffer does not move until the slot is
        // replaced, which only this thread's next failure does.
        LAST_ERROR.with(|slot| slot.borrow().as_ptr())
    })
}

/// What the calling thread's last failure was, besides its message
/// (`rfaas_last_error()`): its status, what to do next, whether the
/// allocation still takes calls, and the signal that ended the worker.
/// `status` is `RFAAS_OK` (and `next` `RFAAS_NEXT_NONE`) when the thread
/// has not failed yet. Like the message, it is the thread's own and
/// changes only with its next failure.
#[no_mangle]
pub extern "C" fn rfaas_last_error_info() -> rfaas_error_info {
    call_infallible(NO_FAILURE, || LAST_INFO.with(Cell::get))
}

/// How many times the calling thread's last `rfaas_invoke_retrying`
/// retried: 0 when its first attempt's outcome stands (or the thread has
/// not called it). When it retried, `rfaas_last_error()` and
/// `rfaas_last_error_info()` describe the last failure it retried past
/// even if it then succeeded (a crash: status `RFAAS_ERR_WORKER_CRASHED`
/// and its signal), or, if it failed in the end, that final failure, whose
/// message also names the failure that made it retry first.
#[no_mangle]
pub extern "C" fn rfaas_last_retries() -> u32 {
    call_infallible(0, || LAST_RETRIES.with(Cell::get))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn last() -> String {
        // SAFETY: rfaas_last_error returns this thread's NUL-terminated
        // message, valid until its next failure.
        unsafe { CStr::from_ptr(rfaas_last_error()) }
            .to_str()
            .unwrap()
            .to_owned()
    }

    #[test]
    fn a_panic_becomes_internal_with_its_message() {
        let status = call("rfaas_test_call", || panic!("boom {}", 42));
        assert_eq!(status, rfaas_status::RFAAS_ERR_INTERNAL);
        let msg = last();
        assert!(msg.starts_with("rfaas_test_call: internal error"), "{msg}");
        assert!(msg.contains("boom 42"), "{msg}");
    }

    #[test]
    fn success_leaves_the_last_error_alone() {
        call("first", || Err(Failure::invalid("first", "bad")));
        assert_eq!(last(), "first: bad");
        assert_eq!(
            call("second", || Ok(rfaas_status::RFAAS_OK)),
            rfaas_status::RFAAS_OK
        );
        assert_eq!(last(), "first: bad");
    }

    #[test]
    fn interior_nul_is_shown_not_cut() {
        set_last_failure(Failure::invalid("a\0b", "c"));
        assert_eq!(last(), "a\\0b: c");
    }

    #[test]
    fn c_callers_read_c_words() {
        use ::rfaas_client::{ExitCause, InvocationStatus};
        use rfaas_proto::control::ErrorCode;
        let mut errors: Vec<Error> = InvocationStatus::ALL
            .into_iter()
            .map(Error::FunctionFailed)
            .collect();
        errors.extend([
            Error::AllLanesBusy,
            Error::BufferBusy,
            Error::UnknownFunction("matmul".into()),
            Error::UnknownFunction("#4".into()),
            Error::WorkerLost,
            Error::ExecutorStopped {
                executor: "127.0.0.1:7100".into(),
            },
            Error::ExecutorLost {
                executor: "127.0.0.1:7100".into(),
            },
            Error::Refused {
                code: ErrorCode::NoCapacity,
                message: "no room".into(),
            },
            Error::Protocol("p".into()),
            Error::Timeout {
                what: "the invocation",
                after: std::time::Duration::from_secs(1),
            },
        ]);
        for cause in [
            ExitCause::Crashed,
            ExitCause::OutOfMemory,
            ExitCause::Exited,
        ] {
            errors.push(Error::WorkerCrashed {
                signal: Some(1),
                cause,
                message: "worker 7 killed by SIGHUP".into(),
            });
        }
        // Rust's names, and a count with the wrong form.
        let rust = [
            "AllocationSpec",
            "ClientOptions",
            "submit",
            "buffer()",
            "get()",
            "spin()",
            "invoke_retrying",
            "in_len",
            "element",
            "dropped",
            "::",
            "1 bytes",
            "1 lanes",
            "1 cores",
        ];
        for e in &errors {
            let text = in_c_words(e);
            for word in rust {
                assert!(
                    !text.contains(word),
                    "{word:?} in the C message of {e:?}: {text}"
                );
            }
        }
        assert!(in_c_words(&Error::AllLanesBusy).contains("rfaas_invoke"));
        assert!(in_c_words(&Error::UnknownFunction("f".into())).contains("rfaas_allocate"));
        assert!(in_c_words(&Error::UnknownFunction("#4".into())).contains("rfaas_function_index"));
    }

    #[test]
    fn the_info_follows_the_last_failure() {
        std::thread::spawn(|| {
            assert_eq!(rfaas_last_error_info(), NO_FAILURE, "no failure yet");
            call("rfaas_x", || Err(Failure::invalid("rfaas_x", "bad")));
            let info = rfaas_last_error_info();
            assert_eq!(info.status, rfaas_status::RFAAS_ERR_INVALID_ARGUMENT);
            assert_eq!(info.next, rfaas_next::RFAAS_NEXT_FIX);
            assert!(info.allocation_usable);
            let crash = Error::WorkerCrashed {
                signal: Some(11),
                cause: ::rfaas_client::ExitCause::Crashed,
                message: "worker 3 killed by SIGSEGV".into(),
            };
            call("rfaas_wait", || Err(Failure::client("rfaas_wait", &crash)));
            let info = rfaas_last_error_info();
            assert_eq!(info.status, rfaas_status::RFAAS_ERR_WORKER_CRASHED);
            assert_eq!(info.next, rfaas_next::RFAAS_NEXT_REALLOCATE);
            assert!(!info.allocation_usable);
            assert_eq!(info.signal, 11);
            // Success leaves it alone; so does a panic's report say report.
            call("rfaas_ok", || Ok(rfaas_status::RFAAS_OK));
            assert_eq!(rfaas_last_error_info(), info);
            call("rfaas_boom", || panic!("boom"));
            assert_eq!(rfaas_last_error_info().next, rfaas_next::RFAAS_NEXT_REPORT);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn infallible_calls_contain_panics() {
        assert_eq!(call_infallible(7, || panic!("no")), 7);
    }
}

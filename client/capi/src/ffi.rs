//! The plumbing every `extern "C"` function shares: the thread's last error
//! message, panic containment, and checked conversions of C arguments.

use std::cell::RefCell;
use std::ffi::{c_char, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

use ::rfaas_client::Error;

use crate::status::rfaas_status;

thread_local! {
    /// The message of this thread's last failed call.
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

/// A failed call: its status and the sentence `rfaas_last_error` returns.
#[derive(Debug)]
pub(crate) struct Failure {
    pub(crate) status: rfaas_status,
    pub(crate) message: String,
}

impl Failure {
    /// A bad argument of the C call `call`.
    pub(crate) fn invalid(call: &str, why: impl std::fmt::Display) -> Failure {
        Failure {
            status: rfaas_status::RFAAS_ERR_INVALID_ARGUMENT,
            message: format!("{call}: {why}"),
        }
    }

    /// A client error met in the C call `call`.
    pub(crate) fn client(call: &str, e: &Error) -> Failure {
        Failure {
            status: rfaas_status::from_error(e),
            message: format!("{call}: {e}"),
        }
    }
}

/// The result of a call's body.
pub(crate) type CallResult = Result<rfaas_status, Failure>;

/// Records `message` as the thread's last error.
pub(crate) fn set_last_error(message: String) {
    // Interior NULs would cut the C string short; show them instead.
    let c = CString::new(message.replace('\0', "\\0")).unwrap_or_default();
    LAST_ERROR.with(|slot| *slot.borrow_mut() = c);
}

/// Runs the body of the C call `call`: a failure sets the thread's last
/// error and returns its status; a panic never crosses into C and becomes
/// `RFAAS_ERR_INTERNAL`.
pub(crate) fn call(name: &str, body: impl FnOnce() -> CallResult) -> rfaas_status {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(status)) => status,
        Ok(Err(failure)) => {
            set_last_error(failure.message);
            failure.status
        }
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic without a message".into());
            set_last_error(format!(
                "{name}: internal error in librfaas ({what}); please report it with this message"
            ));
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
        set_last_error("a\0b".into());
        assert_eq!(last(), "a\\0b");
    }

    #[test]
    fn infallible_calls_contain_panics() {
        assert_eq!(call_infallible(7, || panic!("no")), 7);
    }
}

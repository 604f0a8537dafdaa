//! [`rfaas_invocation`]: submitting a call and waiting for it (blocking,
//! spinning or polling), the synchronous `rfaas_invoke`, and
//! `rfaas_invoke_retrying`, which allocates again after a retryable
//! failure.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use ::rfaas_client::{Allocation, Buffer, FunctionId, Invocation};
use rfaas_proto::text::count;

use crate::buffer::rfaas_buffer;
use crate::client::{no_invocations, rfaas_allocation, Held};
use crate::ffi::{
    call, call_infallible, in_c_words, mut_arg, out_arg, ref_arg, set_last_failure,
    set_last_retries, CallResult, Failure,
};
use crate::status::rfaas_status::{self, RFAAS_OK, RFAAS_PENDING};

/// One call in flight, from `rfaas_submit`. Wait for it with `rfaas_wait`,
/// `rfaas_spin` or `rfaas_test`, then free it with `rfaas_invocation_free`.
/// The result is kept: asking again returns it again. Use it from one
/// thread at a time.
///
/// Lifetimes: the allocation must outlive the invocation
/// (`rfaas_deallocate` refuses while one is not freed); the input and
/// output buffers should too, and the output's bytes are the function's
/// only once a wait returned `RFAAS_OK`.
#[derive(Debug)]
pub struct rfaas_invocation {
    /// In flight until a wait took its result.
    inv: Option<Invocation<'static>>,
    /// What the wait returned: the output length, or the failure.
    result: Option<Result<usize, Failure>>,
    /// The allocation's count of unfreed invocations.
    live: Arc<AtomicUsize>,
}

impl Drop for rfaas_invocation {
    fn drop(&mut self) {
        // The invocation gives its lane back before the allocation may go.
        drop(self.inv.take());
        self.live.fetch_sub(1, Ordering::Release);
    }
}

/// The checked arguments of a submission.
struct Args<'a> {
    alloc: &'a Allocation,
    function: FunctionId,
    input: &'a Buffer<u8>,
    output: &'a mut Buffer<u8>,
}

/// # Safety
///
/// Each pointer is NULL or valid as `rfaas_submit` describes.
unsafe fn args<'a>(
    call: &str,
    alloc: *const rfaas_allocation,
    function: u32,
    input: *const rfaas_buffer,
    in_bytes: usize,
    output: *mut rfaas_buffer,
) -> Result<(&'a rfaas_allocation, Args<'a>), Failure> {
    // SAFETY: NULL or a live allocation (caller's promise).
    let handle = unsafe { ref_arg(call, "alloc", alloc) }?;
    // SAFETY: the caller's promises, passed on.
    let (function, input, output) =
        unsafe { buffers(call, handle.alloc(), function, input, in_bytes, output) }?;
    Ok((
        handle,
        Args {
            alloc: handle.alloc(),
            function,
            input,
            output,
        },
    ))
}

/// Checks a call's function index and buffers against `alloc`, in C's
/// words (bytes, `rfaas_buffer_new`), before the client library would.
///
/// # Safety
///
/// `input` is NULL or a live buffer; `output` is NULL or a live buffer
/// that nothing else uses during the call.
pub(crate) unsafe fn buffers<'a>(
    call: &str,
    alloc: &Allocation,
    function: u32,
    input: *const rfaas_buffer,
    in_bytes: usize,
    output: *mut rfaas_buffer,
) -> Result<(FunctionId, &'a Buffer<u8>, &'a mut Buffer<u8>), Failure> {
    if !input.is_null() && std::ptr::eq(input, output) {
        return Err(Failure::invalid(
            call,
            "`in` and `out` are the same buffer; use two buffers",
        ));
    }
    // SAFETY: NULL or a live buffer (caller's promise).
    let input = unsafe { ref_arg(call, "in", input) }?;
    // SAFETY: NULL or a live buffer that nothing else uses during the
    // call (caller's promise); distinct from `input` (checked above), so
    // this &mut does not alias that &.
    let output = unsafe { mut_arg(call, "out", output) }?;
    let index = u16::try_from(function).map_err(|_| {
        Failure::invalid(call, format!("function index {function} is out of range"))
    })?;
    let f = alloc
        .function_at(index)
        .map_err(|e| Failure::client(call, &e))?;
    if in_bytes > input.buf.len() {
        return Err(Failure::invalid(
            call,
            format!(
                "in_bytes {in_bytes} is more than the input buffer holds ({}); pass at most rfaas_buffer_size(in)",
                count(input.buf.len() as u64, "byte")
            ),
        ));
    }
    if !alloc.owns(&input.buf) || !alloc.owns(&output.buf) {
        return Err(Failure::invalid(
            call,
            "a buffer was made for another allocation; make buffers with rfaas_buffer_new on this one",
        ));
    }
    if u32::try_from(in_bytes).is_err() {
        return Err(Failure::invalid(
            call,
            format!("in_bytes {in_bytes} is more than an invocation carries (4 GiB - 1)"),
        ));
    }
    Ok((f, &input.buf, &mut output.buf))
}

/// Starts the function with table index `function` on the first
/// `in_bytes` bytes of `in`; its output goes to `out` (at most
/// `rfaas_buffer_size(out)` bytes). Takes an idle lane, or fails at once
/// with `RFAAS_ERR_ALL_LANES_BUSY`. On success `*inv` is the invocation.
///
/// Hot path: no lock; one small allocation, the handle.
///
/// # Safety
///
/// Each pointer is NULL or valid: a live allocation, two distinct live
/// buffers of it, a writable `inv`. Both buffers must stay alive until
/// the invocation is waited for or freed, and their bytes untouched by the
/// caller (the worker may read `in` and write `out`) until `rfaas_wait`,
/// `rfaas_spin` or `rfaas_test` says it ended (see `rfaas_buffer`).
#[no_mangle]
pub unsafe extern "C" fn rfaas_submit(
    alloc: *const rfaas_allocation,
    function: u32,
    r#in: *const rfaas_buffer,
    in_bytes: usize,
    out: *mut rfaas_buffer,
    inv: *mut *mut rfaas_invocation,
) -> rfaas_status {
    const CALL: &str = "rfaas_submit";
    call(CALL, || {
        out_arg(CALL, "inv", inv)?;
        // SAFETY: the caller's promises.
        let (handle, a) = unsafe { args(CALL, alloc, function, r#in, in_bytes, out) }?;
        let started = a
            .alloc
            .submit(a.function, a.input, in_bytes, a.output)
            .map_err(|e| Failure::client(CALL, &e))?;
        // SAFETY: the invocation borrows the allocation's lanes and, in
        // name only, the buffers. The allocation outlives it:
        // rfaas_deallocate refuses while `live` counts it, and the handle
        // (and so the Allocation and its lanes) does not move while boxed.
        // The buffers' regions are reference-counted by the lane while the
        // call is in flight, so freeing a buffer early cannot leave the
        // lane writing freed memory.
        let started: Invocation<'static> = unsafe { std::mem::transmute(started) };
        handle.live.fetch_add(1, Ordering::AcqRel);
        let boxed = Box::new(rfaas_invocation {
            inv: Some(started),
            result: None,
            live: Arc::clone(&handle.live),
        });
        // SAFETY: inv is non-null (checked) and writable (caller's promise).
        unsafe { inv.write(Box::into_raw(boxed)) };
        Ok(RFAAS_OK)
    })
}

/// How a wait waits.
#[derive(Clone, Copy)]
enum Wait {
    Block,
    Spin,
    Poll,
}

/// Waits for `inv` (or takes its kept result) and reports it.
///
/// # Safety
///
/// `inv` is NULL or a live invocation no other thread uses; `out_len` is
/// NULL or writable.
unsafe fn finish(
    call_name: &'static str,
    inv: *mut rfaas_invocation,
    out_len: *mut usize,
    how: Wait,
) -> rfaas_status {
    call(call_name, || {
        // SAFETY: the caller's promise.
        let handle = unsafe { mut_arg(call_name, "inv", inv) }?;
        if handle.result.is_none() {
            let r = match how {
                Wait::Block => handle.inv.take().map(Invocation::get),
                Wait::Spin => handle.inv.take().map(Invocation::spin),
                Wait::Poll => match handle.inv.as_mut().map(Invocation::try_get) {
                    Some(None) => return Ok(RFAAS_PENDING),
                    Some(Some(r)) => {
                        handle.inv = None;
                        Some(r)
                    }
                    None => None,
                },
            };
            let r = r.unwrap_or_else(|| {
                Err(::rfaas_client::Error::InvalidArgument(
                    "the invocation has no result and is not in flight".into(),
                ))
            });
            handle.result = Some(r.map_err(|e| Failure::client(call_name, &e)));
        }
        match handle.result.as_ref() {
            Some(Ok(len)) => {
                if !out_len.is_null() {
                    // SAFETY: non-null and writable (caller's promise).
                    unsafe { out_len.write(*len) };
                }
                Ok(RFAAS_OK)
            }
            Some(Err(failure)) => Err(failure.clone()),
            None => unreachable!("the result was just set"),
        }
    })
}

/// Waits for the invocation, sleeping in the kernel, and sets `*out_len`
/// (when not NULL) to the output length in bytes. A failure is the
/// function's or the worker's status. After the first wait the result is
/// kept: waiting again returns it again.
///
/// # Safety
///
/// `inv` is NULL or a live invocation no other thread uses; `out_len` is
/// NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn rfaas_wait(
    inv: *mut rfaas_invocation,
    out_len: *mut usize,
) -> rfaas_status {
    // SAFETY: the caller's promises, passed on.
    unsafe { finish("rfaas_wait", inv, out_len, Wait::Block) }
}

/// `rfaas_wait` by busy-polling: the lowest latency, and a whole core
/// while it waits. Spinning pays only on a CPU of its own: a thread found
/// sharing its CPU with another busy thread while it spins (a hot worker
/// pinned to the same core, say) gets its results only when the scheduler
/// switches, milliseconds instead of microseconds, so for its next 1000
/// waits `rfaas_spin` on that thread sleeps, like `rfaas_wait`, then spins
/// and measures again (`rfaas_spin_sleeps` tells).
///
/// # Safety
///
/// As for `rfaas_wait`.
#[no_mangle]
pub unsafe extern "C" fn rfaas_spin(
    inv: *mut rfaas_invocation,
    out_len: *mut usize,
) -> rfaas_status {
    // SAFETY: the caller's promises, passed on.
    unsafe { finish("rfaas_spin", inv, out_len, Wait::Spin) }
}

/// Whether `rfaas_spin` on the calling thread waits by sleeping because it
/// found the thread's CPU shared with another busy thread: it got less than
/// half of its CPU over half a millisecond of spinning, and the kernel ran
/// another task on it meanwhile. It stays true for the thread's next 1000
/// waits, then the thread spins and measures again. Pin a thread that
/// spins to a core no worker and no other busy thread uses.
#[no_mangle]
pub extern "C" fn rfaas_spin_sleeps() -> bool {
    call_infallible(false, ::rfaas_client::spin_sleeps)
}

/// Never waits: `RFAAS_PENDING` while the invocation is in flight (not a
/// failure: `rfaas_last_error` is unchanged), else what `rfaas_wait`
/// returns.
///
/// # Safety
///
/// As for `rfaas_wait`.
#[no_mangle]
pub unsafe extern "C" fn rfaas_test(
    inv: *mut rfaas_invocation,
    out_len: *mut usize,
) -> rfaas_status {
    // SAFETY: the caller's promises, passed on.
    unsafe { finish("rfaas_test", inv, out_len, Wait::Poll) }
}

/// Frees an invocation. NULL is ignored. Freeing one still in flight is
/// safe: its lane stays out of use until the late response arrives, and
/// its output buffer is refused as an output (`RFAAS_ERR_BUFFER_BUSY`)
/// until then.
///
/// # Safety
///
/// `inv` is NULL or an invocation from `rfaas_submit`, not freed before.
#[no_mangle]
pub unsafe extern "C" fn rfaas_invocation_free(inv: *mut rfaas_invocation) {
    call_infallible((), || {
        if !inv.is_null() {
            // SAFETY: the caller passes ownership of a Box made by
            // rfaas_submit.
            drop(unsafe { Box::from_raw(inv) });
        }
    });
}

/// Calls the function and waits for it (sleeping): waits for an idle lane
/// instead of failing when all are busy, then as `rfaas_wait`. Sets
/// `*out_len` (when not NULL) to the output length in bytes.
///
/// # Safety
///
/// As for `rfaas_submit`; `out_len` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn rfaas_invoke(
    alloc: *const rfaas_allocation,
    function: u32,
    r#in: *const rfaas_buffer,
    in_bytes: usize,
    out: *mut rfaas_buffer,
    out_len: *mut usize,
) -> rfaas_status {
    const CALL: &str = "rfaas_invoke";
    call(CALL, || -> CallResult {
        // SAFETY: the caller's promises.
        let (_, a) = unsafe { args(CALL, alloc, function, r#in, in_bytes, out) }?;
        let len = a
            .alloc
            .invoke(a.function, a.input, in_bytes, a.output)
            .map_err(|e| Failure::client(CALL, &e))?;
        if !out_len.is_null() {
            // SAFETY: non-null and writable (caller's promise).
            unsafe { out_len.write(len) };
        }
        Ok(RFAAS_OK)
    })
}

/// `rfaas_invoke`, and after a retryable failure (`rfaas_status_is_retryable`:
/// the worker crashed or was lost, the executor was lost, stopped or is
/// draining, it had no capacity, ...) allocates again with the same
/// library, functions, options and token, and calls again; at most
/// `retries` times in all (re-allocations that fail count too). A failure
/// that is not retryable returns at once.
///
/// After a worker's crash or loss it allocates on the same executor (a
/// fresh worker); after an executor's loss, stop or drain, or a
/// `RFAAS_ERR_REFUSED_NO_CAPACITY`, on the next executor added with
/// `rfaas_add_fallback_executor`, wrapping around. The new allocation
/// replaces the old one in `*alloc`: its buffers stay valid, nothing is
/// copied, and function indices are the same. With `retries` 0 it is
/// `rfaas_invoke`.
///
/// The old allocation is let go first; on the same executor, and under a
/// lease with no core to spare, the new worker comes once the crashed one
/// is gone (`RFAAS_ERR_REFUSED_ALLOCATION_ENDING` meanwhile is waited out,
/// not counted as a retry).
///
/// What it retried past stays readable: `rfaas_last_retries()` says how
/// many times it retried; when it did, `rfaas_last_error()` and
/// `rfaas_last_error_info()` describe the last failure it retried past
/// (a crash with its signal), even when it then returned `RFAAS_OK`. A
/// final failure is the last error as usual, and its message names the
/// failure that made it retry first.
///
/// Not thread-safe: no other call may use the allocation meanwhile, and it
/// fails with `RFAAS_ERR_INVALID_ARGUMENT` while invocations of it are not
/// freed (a re-allocation replaces the lanes they use).
///
/// # Safety
///
/// As for `rfaas_submit`, with `alloc` a live allocation no other thread
/// uses; `out_len` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn rfaas_invoke_retrying(
    alloc: *mut rfaas_allocation,
    function: u32,
    r#in: *const rfaas_buffer,
    in_bytes: usize,
    out: *mut rfaas_buffer,
    out_len: *mut usize,
    retries: u32,
) -> rfaas_status {
    const CALL: &str = "rfaas_invoke_retrying";
    call(CALL, || -> CallResult {
        // SAFETY: NULL or a live allocation no other thread uses (caller's
        // promise).
        let handle = unsafe { mut_arg(CALL, "alloc", alloc) }?;
        no_invocations(CALL, handle)?;
        // SAFETY: the caller's promises.
        let (f, input, output) =
            unsafe { buffers(CALL, handle.alloc(), function, r#in, in_bytes, out) }?;
        let result = match &mut handle.held {
            Held::Plain(a) => a.invoke_retrying(f, input, in_bytes, output, retries),
            Held::Leased(l) => l.invoke_retrying(f, input, in_bytes, output, retries),
        };
        let causes = handle.alloc().retry_causes();
        set_last_retries(u32::try_from(causes.len()).unwrap_or(u32::MAX));
        let len = match result {
            Ok(len) => {
                if let Some(last) = causes.last() {
                    set_last_failure(Failure::client(CALL, last));
                }
                len
            }
            Err(e) => {
                let mut failure = Failure::client(CALL, &e);
                if let Some(first) = causes.first() {
                    failure.message.push_str(&format!(
                        " (retried {} before; the first time because: {})",
                        count(causes.len() as u64, "time"),
                        in_c_words(first)
                    ));
                }
                return Err(failure);
            }
        };
        if !out_len.is_null() {
            // SAFETY: non-null and writable (caller's promise).
            unsafe { out_len.write(len) };
        }
        Ok(RFAAS_OK)
    })
}

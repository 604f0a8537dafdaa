//! [`rfaas_pipeline`]: many calls in flight on one lane from one thread,
//! collected in the order they end (`rfaas_pipeline_test_any`,
//! `rfaas_pipeline_wait_any`, `rfaas_pipeline_spin_any`).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use ::rfaas_client::{Done, Pipeline};

use crate::buffer::rfaas_buffer;
use crate::client::rfaas_allocation;
use crate::ffi::{call, call_infallible, mut_arg, out_arg, ref_arg, Failure};
use crate::invocation::buffers;
use crate::status::rfaas_status::{self, RFAAS_OK, RFAAS_PENDING};

/// The call id `rfaas_pipeline_*_any` reports when it reports no call.
pub const RFAAS_NO_CALL: u64 = u64::MAX;

/// One lane of an allocation taken for many calls at once, from
/// `rfaas_pipeline_new`: as many in flight as the allocation has slots per
/// lane (`rfaas_alloc_options.slots`). Submit with `rfaas_pipeline_submit`
/// (`RFAAS_ERR_SLOTS_FULL` when every slot is taken: it never blocks),
/// collect with `rfaas_pipeline_test_any`, `rfaas_pipeline_wait_any` or
/// `rfaas_pipeline_spin_any`, which report each call once, by the id its
/// submission returned, in the order the worker finished them. Use it from
/// one thread at a time; free it with `rfaas_pipeline_free`.
///
/// A call's buffers are the worker's from its submission until it is
/// reported: do not read, write, free or reuse them before (see
/// `rfaas_buffer`).
#[derive(Debug)]
pub struct rfaas_pipeline {
    pipe: Pipeline<'static, u8, u8>,
    /// The allocation's count of unfreed invocations and pipelines.
    live: Arc<AtomicUsize>,
}

impl Drop for rfaas_pipeline {
    fn drop(&mut self) {
        self.live.fetch_sub(1, Ordering::Release);
    }
}

/// Takes an idle lane of `alloc` for a pipeline (`RFAAS_ERR_ALL_LANES_BUSY`
/// when none is idle). On success `*out` is the pipeline.
///
/// # Safety
///
/// `alloc` is NULL or a live allocation; `out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn rfaas_pipeline_new(
    alloc: *const rfaas_allocation,
    out: *mut *mut rfaas_pipeline,
) -> rfaas_status {
    const CALL: &str = "rfaas_pipeline_new";
    call(CALL, || {
        out_arg(CALL, "out", out)?;
        // SAFETY: the caller's promise.
        let handle = unsafe { ref_arg(CALL, "alloc", alloc) }?;
        let pipe = handle
            .alloc()
            .pipeline::<u8, u8>()
            .map_err(|e| Failure::client(CALL, &e))?;
        // SAFETY: the pipeline borrows the allocation, which outlives it:
        // rfaas_deallocate refuses while `live` counts it, and the handle
        // (so the Allocation and its lanes) does not move while boxed.
        let pipe: Pipeline<'static, u8, u8> = unsafe { std::mem::transmute(pipe) };
        handle.live.fetch_add(1, Ordering::AcqRel);
        let boxed = Box::new(rfaas_pipeline {
            pipe,
            live: Arc::clone(&handle.live),
        });
        // SAFETY: out is non-null (checked) and writable (caller's promise).
        unsafe { out.write(Box::into_raw(boxed)) };
        Ok(RFAAS_OK)
    })
}

/// The calls the pipeline holds in flight at most (its lane's slots); 0
/// for NULL.
///
/// # Safety
///
/// `pipe` is NULL or a live pipeline.
#[no_mangle]
pub unsafe extern "C" fn rfaas_pipeline_slots(pipe: *const rfaas_pipeline) -> u32 {
    call_infallible(0, || {
        // SAFETY: the caller's promise.
        unsafe { pipe.as_ref() }.map_or(0, |p| p.pipe.slots() as u32)
    })
}

/// The calls in flight (submitted and not yet reported); 0 for NULL.
///
/// # Safety
///
/// `pipe` is NULL or a live pipeline.
#[no_mangle]
pub unsafe extern "C" fn rfaas_pipeline_in_flight(pipe: *const rfaas_pipeline) -> u32 {
    call_infallible(0, || {
        // SAFETY: the caller's promise.
        unsafe { pipe.as_ref() }.map_or(0, |p| p.pipe.in_flight() as u32)
    })
}

/// Starts the function with table index `function` on the first
/// `in_bytes` bytes of `in`, its output to `out`, and returns at once;
/// `*call_id` (when not NULL) is the call's id, numbered from 0 in
/// submission order. `RFAAS_ERR_SLOTS_FULL` when every slot has a call in
/// flight: collect one first.
///
/// Hot path: no lock, no allocation.
///
/// # Safety
///
/// `pipe` is NULL or a live pipeline no other thread uses; `in` and `out`
/// are NULL or two distinct live buffers of its allocation, alive and
/// untouched until the call is reported (or the pipeline freed); `call_id`
/// is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn rfaas_pipeline_submit(
    pipe: *mut rfaas_pipeline,
    function: u32,
    r#in: *const rfaas_buffer,
    in_bytes: usize,
    out: *mut rfaas_buffer,
    call_id: *mut u64,
) -> rfaas_status {
    // SAFETY: the caller's promises, passed on.
    unsafe {
        start(
            "rfaas_pipeline_submit",
            pipe,
            function,
            r#in,
            in_bytes,
            out,
            call_id,
            false,
        )
    }
}

/// As `rfaas_pipeline_submit`, but the request leaves with the next
/// `rfaas_pipeline_flush`, together with every other staged one: on tcp in
/// one system call, on shm behind one doorbell, on verbs as one chain of
/// work requests. `rfaas_pipeline_test_any`, `_wait_any` and `_spin_any`
/// flush first; nothing leaves by itself in between. A staged call is in
/// flight, and its buffers are the worker's, from this call on.
///
/// Hot path: no lock, no allocation.
///
/// # Safety
///
/// As for `rfaas_pipeline_submit`.
#[no_mangle]
pub unsafe extern "C" fn rfaas_pipeline_stage(
    pipe: *mut rfaas_pipeline,
    function: u32,
    r#in: *const rfaas_buffer,
    in_bytes: usize,
    out: *mut rfaas_buffer,
    call_id: *mut u64,
) -> rfaas_status {
    // SAFETY: the caller's promises, passed on.
    unsafe {
        start(
            "rfaas_pipeline_stage",
            pipe,
            function,
            r#in,
            in_bytes,
            out,
            call_id,
            true,
        )
    }
}

/// Sends the staged calls, in the order they were staged. On an error the
/// calls not sent stay staged for the next flush (a broken lane ends them
/// with its error when they are collected).
///
/// # Safety
///
/// `pipe` is NULL or a live pipeline no other thread uses.
#[no_mangle]
pub unsafe extern "C" fn rfaas_pipeline_flush(pipe: *mut rfaas_pipeline) -> rfaas_status {
    const CALL: &str = "rfaas_pipeline_flush";
    call(CALL, || {
        // SAFETY: the caller's promise.
        let handle = unsafe { mut_arg(CALL, "pipe", pipe) }?;
        handle.pipe.flush().map_err(|e| Failure::client(CALL, &e))?;
        Ok(RFAAS_OK)
    })
}

/// Submits (`stage` false) or stages a call: the body of both.
///
/// # Safety
///
/// As for `rfaas_pipeline_submit`.
#[allow(clippy::too_many_arguments)]
unsafe fn start(
    call_name: &'static str,
    pipe: *mut rfaas_pipeline,
    function: u32,
    r#in: *const rfaas_buffer,
    in_bytes: usize,
    out: *mut rfaas_buffer,
    call_id: *mut u64,
    stage: bool,
) -> rfaas_status {
    call(call_name, || {
        // SAFETY: the caller's promise.
        let handle = unsafe { mut_arg(call_name, "pipe", pipe) }?;
        // SAFETY: the caller's promises, passed on. The allocation is the
        // one the pipeline borrows.
        let (function, input, output) = unsafe {
            buffers(
                call_name,
                handle.pipe.allocation(),
                function,
                r#in,
                in_bytes,
                out,
            )
        }?;
        // SAFETY: the caller leaves both buffers alone until the call is
        // reported (this function's contract); the aliases share the
        // buffers' registered memory, which they keep alive.
        let (input, output) = unsafe { (input.alias(), output.alias()) };
        let started = if stage {
            handle.pipe.stage(function, input, in_bytes, output)
        } else {
            handle.pipe.submit(function, input, in_bytes, output)
        };
        let id = started.map_err(|r| Failure::client(call_name, &r.error))?;
        if !call_id.is_null() {
            // SAFETY: non-null and writable (caller's promise).
            unsafe { call_id.write(id.0) };
        }
        Ok(RFAAS_OK)
    })
}

/// How a collection waits.
#[derive(Clone, Copy)]
enum Wait {
    Poll,
    Block,
    Spin,
}

/// Reports the next call that ended, as `how` waits for one.
///
/// # Safety
///
/// As for `rfaas_pipeline_wait_any`.
unsafe fn any(
    call_name: &'static str,
    pipe: *mut rfaas_pipeline,
    call_id: *mut u64,
    out_len: *mut usize,
    how: Wait,
) -> rfaas_status {
    if !call_id.is_null() {
        // SAFETY: non-null and writable (caller's promise).
        unsafe { call_id.write(RFAAS_NO_CALL) };
    }
    call(call_name, || {
        // SAFETY: the caller's promise.
        let handle = unsafe { mut_arg(call_name, "pipe", pipe) }?;
        let done: Done<u8, u8> = match how {
            Wait::Poll => match handle.pipe.test_any() {
                Some(done) => Ok(done),
                None => return Ok(RFAAS_PENDING),
            },
            Wait::Block => handle.pipe.wait_any(),
            Wait::Spin => handle.pipe.spin_any(),
        }
        .map_err(|e| Failure::client(call_name, &e))?;
        if !call_id.is_null() {
            // SAFETY: as above.
            unsafe { call_id.write(done.id.0) };
        }
        let len = done.result.map_err(|e| Failure::client(call_name, &e))?;
        if !out_len.is_null() {
            // SAFETY: non-null and writable (caller's promise).
            unsafe { out_len.write(len) };
        }
        Ok(RFAAS_OK)
    })
}

/// A call that has ended, if one has; never waits. `RFAAS_PENDING` (not a
/// failure) when none has, with `*call_id` set to `RFAAS_NO_CALL`.
/// Otherwise as `rfaas_pipeline_wait_any`.
///
/// # Safety
///
/// As for `rfaas_pipeline_wait_any`.
#[no_mangle]
pub unsafe extern "C" fn rfaas_pipeline_test_any(
    pipe: *mut rfaas_pipeline,
    call_id: *mut u64,
    out_len: *mut usize,
) -> rfaas_status {
    // SAFETY: the caller's promises, passed on.
    unsafe {
        any(
            "rfaas_pipeline_test_any",
            pipe,
            call_id,
            out_len,
            Wait::Poll,
        )
    }
}

/// Waits for a call to end, sleeping in the kernel, and reports it: sets
/// `*call_id` (when not NULL) to its id and returns its status, with
/// `*out_len` (when not NULL) its output length in bytes on `RFAAS_OK`.
/// The call's buffers are the caller's again. `*call_id` is
/// `RFAAS_NO_CALL` when no call is reported (none is in flight:
/// `RFAAS_ERR_INVALID_ARGUMENT`).
///
/// # Safety
///
/// `pipe` is NULL or a live pipeline no other thread uses; `call_id` and
/// `out_len` are NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn rfaas_pipeline_wait_any(
    pipe: *mut rfaas_pipeline,
    call_id: *mut u64,
    out_len: *mut usize,
) -> rfaas_status {
    // SAFETY: the caller's promises, passed on.
    unsafe {
        any(
            "rfaas_pipeline_wait_any",
            pipe,
            call_id,
            out_len,
            Wait::Block,
        )
    }
}

/// `rfaas_pipeline_wait_any` by busy-polling (see `rfaas_spin`).
///
/// # Safety
///
/// As for `rfaas_pipeline_wait_any`.
#[no_mangle]
pub unsafe extern "C" fn rfaas_pipeline_spin_any(
    pipe: *mut rfaas_pipeline,
    call_id: *mut u64,
    out_len: *mut usize,
) -> rfaas_status {
    // SAFETY: the caller's promises, passed on.
    unsafe {
        any(
            "rfaas_pipeline_spin_any",
            pipe,
            call_id,
            out_len,
            Wait::Spin,
        )
    }
}

/// Frees a pipeline and gives its lane back. NULL is ignored. Calls still
/// in flight are abandoned: their answers still land in their buffers
/// (whose memory the library keeps registered until then, even if they
/// are freed); the lane takes no other call until they have.
///
/// # Safety
///
/// `pipe` is NULL or a pipeline from `rfaas_pipeline_new`, not freed
/// before.
#[no_mangle]
pub unsafe extern "C" fn rfaas_pipeline_free(pipe: *mut rfaas_pipeline) {
    call_infallible((), || {
        if !pipe.is_null() {
            // SAFETY: the caller passes ownership of a Box made by
            // rfaas_pipeline_new.
            drop(unsafe { Box::from_raw(pipe) });
        }
    });
}

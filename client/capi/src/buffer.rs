//! [`rfaas_buffer`]: registered bytes for inputs and outputs.

use std::ffi::c_void;

use ::rfaas_client::Buffer;

use crate::client::rfaas_allocation;
use crate::ffi::{call, call_infallible, out_arg, ref_arg, Failure};
use crate::status::rfaas_status::{self, RFAAS_OK};

/// Bytes registered for one allocation's invocations: the data starts at a
/// page boundary (so any element type is aligned), with room for the
/// request header in front. Not synchronised: one thread writes it at a
/// time.
///
/// When its bytes (`rfaas_buffer_data`) may be touched: the buffer is
/// registered for remote writes, and the worker may write an output or
/// read an input at any moment while an invocation that uses it is in
/// flight. So read or write a buffer only while no invocation that uses
/// it (as input or output) is in flight: before `rfaas_submit`, and after
/// `rfaas_wait`, `rfaas_spin` or `rfaas_test` said the invocation ended
/// (any status but `RFAAS_PENDING`), or `rfaas_invoke` returned. An
/// invocation freed before it ended is still in flight until its late
/// response arrives: its output is refused (`RFAAS_ERR_BUFFER_BUSY`) until
/// then, and its input may still be read by the worker. The output's
/// bytes are the function's answer only once the wait returned `RFAAS_OK`.
/// The worker keeps the buffer's key while the allocation lives: load only
/// functions trusted to write nothing but the output of their own call.
#[derive(Debug)]
pub struct rfaas_buffer {
    pub(crate) buf: Buffer<u8>,
}

/// Makes a zeroed buffer of `bytes` bytes registered for `alloc` (usable
/// only with `alloc`'s invocations). Free it with `rfaas_buffer_free`.
///
/// # Safety
///
/// `alloc` is NULL or a live allocation; `out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn rfaas_buffer_new(
    alloc: *const rfaas_allocation,
    bytes: usize,
    out: *mut *mut rfaas_buffer,
) -> rfaas_status {
    const CALL: &str = "rfaas_buffer_new";
    call(CALL, || {
        out_arg(CALL, "out", out)?;
        // SAFETY: the caller's promise.
        let alloc = unsafe { ref_arg(CALL, "alloc", alloc) }?;
        let page = rfaas_fabric::page_size();
        if bytes.saturating_add(page) > u32::MAX as usize {
            return Err(Failure::invalid(
                CALL,
                format!("a buffer of {bytes} bytes does not fit in a registered region (at most 4 GiB, {page} bytes of it for the request header); make it smaller"),
            ));
        }
        let buf = alloc
            .alloc()
            .buffer::<u8>(bytes)
            .map_err(|e| Failure::client(CALL, &e))?;
        // SAFETY: out is non-null (checked) and writable (caller's promise).
        unsafe { out.write(Box::into_raw(Box::new(rfaas_buffer { buf }))) };
        Ok(RFAAS_OK)
    })
}

/// The buffer's data: page-aligned, `rfaas_buffer_size` bytes, valid until
/// `rfaas_buffer_free`. NULL for a NULL buffer. Touch the bytes only while
/// no invocation that uses the buffer is in flight (see `rfaas_buffer`):
/// fill an input before `rfaas_submit`, read an output after the wait.
///
/// # Safety
///
/// `buf` is NULL or a live buffer.
#[no_mangle]
pub unsafe extern "C" fn rfaas_buffer_data(buf: *mut rfaas_buffer) -> *mut c_void {
    call_infallible(std::ptr::null_mut(), || {
        // SAFETY: NULL or live (caller's promise); the reference lives
        // only for this call.
        match unsafe { buf.as_ref() } {
            Some(b) => b.buf.data_ptr().cast(),
            None => std::ptr::null_mut(),
        }
    })
}

/// The buffer's size in bytes; 0 for a NULL buffer.
///
/// # Safety
///
/// `buf` is NULL or a live buffer.
#[no_mangle]
pub unsafe extern "C" fn rfaas_buffer_size(buf: *const rfaas_buffer) -> usize {
    call_infallible(0, || {
        // SAFETY: NULL or live (caller's promise).
        unsafe { buf.as_ref() }.map_or(0, |b| b.buf.len())
    })
}

/// Frees a buffer. NULL is ignored. Freeing the output of an unfinished
/// invocation is safe (the memory stays registered until its response is
/// drained) but loses that output.
///
/// # Safety
///
/// `buf` is NULL or a buffer from `rfaas_buffer_new`, not freed before.
#[no_mangle]
pub unsafe extern "C" fn rfaas_buffer_free(buf: *mut rfaas_buffer) {
    call_infallible((), || {
        if !buf.is_null() {
            // SAFETY: the caller passes ownership of a Box made by
            // rfaas_buffer_new.
            drop(unsafe { Box::from_raw(buf) });
        }
    });
}

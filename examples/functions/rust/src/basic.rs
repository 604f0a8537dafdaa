//! The smallest functions: the round-trip benchmarks call these.

use std::ffi::c_void;

/// Does nothing and returns nothing: measures the invocation path alone.
///
/// # Safety
///
/// None of the pointers is read or written; any values are sound.
#[no_mangle]
pub unsafe extern "C" fn noop(_input: *mut c_void, _in_len: u32, _out: *mut c_void) -> u32 {
    0
}

/// Returns its input.
///
/// # Safety
///
/// `input` must point to `in_len` readable bytes and `out` to `in_len`
/// writable bytes that do not overlap them.
#[no_mangle]
pub unsafe extern "C" fn echo(input: *mut c_void, in_len: u32, out: *mut c_void) -> u32 {
    // SAFETY: the caller promises `in_len` readable bytes at `input`,
    // `in_len` writable bytes at `out`, and no overlap.
    unsafe { std::ptr::copy_nonoverlapping(input.cast::<u8>(), out.cast::<u8>(), in_len as usize) };
    in_len
}

/// rFaaS's bandwidth benchmark function: copies the first 4 bytes of its
/// input and returns `in_len`, so `in_len` bytes of the output buffer travel
/// back without the function touching them. A round trip through it moves
/// the payload both ways at no cost in the function: what is left is the
/// invocation path's own.
///
/// # Safety
///
/// `input` must point to `in_len` readable bytes and `out` to `in_len`
/// writable bytes (the rfaas worker checks `in_len` against its output
/// capacity before sending them).
#[no_mangle]
pub unsafe extern "C" fn empty(input: *mut c_void, in_len: u32, out: *mut c_void) -> u32 {
    if in_len >= 4 {
        // SAFETY: both pointers hold at least `in_len` >= 4 bytes.
        unsafe { std::ptr::copy_nonoverlapping(input.cast::<u8>(), out.cast::<u8>(), 4) };
    }
    in_len
}

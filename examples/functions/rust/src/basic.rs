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

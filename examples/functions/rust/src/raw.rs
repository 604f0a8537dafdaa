//! Checked views of the ABI's raw pointers.

use std::ffi::c_void;

/// Size of the `{u32, u32, u32, u32}` header that `matmul` and `jacobi`
/// inputs start with.
pub(crate) const HEADER_LEN: usize = 16;

/// The four little-endian u32 of a header, or `None` when the input is
/// shorter than one.
///
/// # Safety
///
/// `input` must point to `in_len` readable bytes.
pub(crate) unsafe fn header(input: *const c_void, in_len: u32) -> Option<[u32; 4]> {
    if (in_len as usize) < HEADER_LEN {
        return None;
    }
    // SAFETY: the caller promises `in_len` >= HEADER_LEN readable bytes;
    // u8 has no alignment requirement.
    let bytes = unsafe { std::slice::from_raw_parts(input.cast::<u8>(), HEADER_LEN) };
    let mut h = [0u32; 4];
    for (v, b) in h.iter_mut().zip(bytes.chunks_exact(4)) {
        *v = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    }
    Some(h)
}

/// Whether both pointers may be read and written as f64.
pub(crate) fn f64_aligned(input: *const c_void, out: *const c_void) -> bool {
    let align = std::mem::align_of::<f64>();
    (input as usize) % align == 0 && (out as usize) % align == 0
}

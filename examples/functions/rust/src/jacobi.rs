//! One Jacobi iteration for `A x = b` on a block of rows: each node
//! computes its rows of `x'` from the whole previous `x`.
//!
//! Input: a 16-byte header `{u32 n, u32 rows_begin, u32 rows_end, u32
//! reserved = 0}` (little-endian), then `A` (`n×n` f64, row-major), `b`
//! (`n` f64) and `x` (`n` f64). Output: `x'[i]` for `i` in
//! `rows_begin..rows_end` (f64 each).

use std::ffi::c_void;

use crate::raw::{f64_aligned, header, HEADER_LEN};

/// Computes `x'[i] = (b[i] - Σ_{j≠i} A[i][j]·x[j]) / A[i][i]` for the rows
/// `rows_begin..rows_end`; returns `(rows_end - rows_begin)*8`.
///
/// A zero diagonal gives inf or NaN, as the arithmetic does. Returns 0 and
/// writes nothing when `in_len` does not match the header, when
/// `rows_begin > rows_end` or `rows_end > n`, when `reserved` is not 0, or
/// when `input` or `out` is not 8-byte aligned. Sums over `j` in order, like
/// the C library's `jacobi`. Hot path.
///
/// # Safety
///
/// `input` must point to `in_len` readable bytes and `out` to at least
/// `(rows_end - rows_begin)*8` writable bytes that do not overlap them.
#[no_mangle]
pub unsafe extern "C" fn jacobi(input: *mut c_void, in_len: u32, out: *mut c_void) -> u32 {
    // SAFETY: the caller promises `in_len` readable bytes at `input`.
    let Some([n, begin, end, reserved]) = (unsafe { header(input, in_len) }) else {
        return 0;
    };
    let (n, begin, end) = (u64::from(n), u64::from(begin), u64::from(end));
    // n*n fits a u64; bounding it by u32 keeps the byte count from
    // overflowing.
    if reserved != 0 || begin > end || end > n || n * n > u64::from(u32::MAX) {
        return 0;
    }
    if u64::from(in_len) != HEADER_LEN as u64 + 8 * (n * n + 2 * n) || !f64_aligned(input, out) {
        return 0;
    }
    let (n, begin, end) = (n as usize, begin as usize, end as usize);
    // SAFETY: in_len covers the header, A, b and x exactly; HEADER_LEN keeps
    // the f64 alignment the check above proved; the caller promises
    // end-begin f64 of writable, non-overlapping output.
    let (a, b, x, next) = unsafe {
        let a = input.cast::<u8>().add(HEADER_LEN).cast::<f64>();
        (
            std::slice::from_raw_parts(a, n * n),
            std::slice::from_raw_parts(a.add(n * n), n),
            std::slice::from_raw_parts(a.add(n * n + n), n),
            std::slice::from_raw_parts_mut(out.cast::<f64>(), end - begin),
        )
    };
    step(a, b, x, begin, next);
    ((end - begin) * 8) as u32
}

/// Writes rows `begin..begin + next.len()` of the next iterate into `next`.
fn step(a: &[f64], b: &[f64], x: &[f64], begin: usize, next: &mut [f64]) {
    let n = x.len();
    if n == 0 {
        return;
    }
    let rows = a.chunks_exact(n).zip(b).enumerate().skip(begin);
    for (xi, (i, (a_row, &bi))) in next.iter_mut().zip(rows) {
        let mut sum = 0.0;
        for (j, (&aij, &xj)) in a_row.iter().zip(x).enumerate() {
            if j != i {
                sum += aij * xj;
            }
        }
        *xi = (bi - sum) / a_row[i];
    }
}

//! Matrix multiplication of a row block: what a job offloads when it sends
//! part of `C = A·B` to another node's cores.
//!
//! Input: a 16-byte header `{u32 rows, u32 n, u32 k, u32 reserved = 0}`
//! (little-endian), then `A` (`rows×n` f64, row-major), then `B` (`n×k`
//! f64, row-major). Output: `C = A·B` (`rows×k` f64, row-major).

use std::ffi::c_void;

use crate::raw::{f64_aligned, header, HEADER_LEN};

/// Multiplies the row block `A` by `B`; returns `rows*k*8`.
///
/// Returns 0 and writes nothing when `in_len` does not match the header,
/// when `reserved` is not 0, when the output would not fit a u32 length, or
/// when `input` or `out` is not 8-byte aligned (rfaas always passes aligned
/// buffers). Each `C[i][j]` sums over `p` in order, so the result is
/// bit-identical to the C library's `matmul`. Hot path.
///
/// # Safety
///
/// `input` must point to `in_len` readable bytes and `out` to at least
/// `rows*k*8` writable bytes that do not overlap them (the allocation's
/// output capacity: rfaas puts a guard page after it).
#[no_mangle]
pub unsafe extern "C" fn matmul(input: *mut c_void, in_len: u32, out: *mut c_void) -> u32 {
    // SAFETY: the caller promises `in_len` readable bytes at `input`.
    let Some([rows, n, k, reserved]) = (unsafe { header(input, in_len) }) else {
        return 0;
    };
    let (rows, n, k) = (u64::from(rows), u64::from(n), u64::from(k));
    // Products of two u32 fit a u64; bounding them by u32 first keeps the
    // byte counts below from overflowing.
    let (a_len, b_len, c_len) = (rows * n, n * k, rows * k);
    let limit = u64::from(u32::MAX);
    if reserved != 0 || a_len > limit || b_len > limit || c_len > limit / 8 {
        return 0;
    }
    if u64::from(in_len) != HEADER_LEN as u64 + 8 * (a_len + b_len) || !f64_aligned(input, out) {
        return 0;
    }
    // SAFETY: in_len covers the header, A and B exactly; HEADER_LEN keeps
    // the f64 alignment the check above proved; the caller promises rows*k
    // f64 of writable, non-overlapping output.
    let (a, b, c) = unsafe {
        let a = input.cast::<u8>().add(HEADER_LEN).cast::<f64>();
        (
            std::slice::from_raw_parts(a, a_len as usize),
            std::slice::from_raw_parts(a.add(a_len as usize), b_len as usize),
            std::slice::from_raw_parts_mut(out.cast::<f64>(), c_len as usize),
        )
    };
    multiply(a, b, c, n as usize, k as usize);
    (c_len * 8) as u32
}

/// `c = a·b` for row-major `a` (`_×n`), `b` (`n×k`) and `c` (`_×k`).
fn multiply(a: &[f64], b: &[f64], c: &mut [f64], n: usize, k: usize) {
    if k == 0 {
        return;
    }
    if n == 0 {
        c.fill(0.0);
        return;
    }
    // i-p-j order streams rows of B and vectorises over j.
    for (c_row, a_row) in c.chunks_exact_mut(k).zip(a.chunks_exact(n)) {
        c_row.fill(0.0);
        for (&aip, b_row) in a_row.iter().zip(b.chunks_exact(k)) {
            for (cij, &bpj) in c_row.iter_mut().zip(b_row) {
                *cij += aip * bpj;
            }
        }
    }
}

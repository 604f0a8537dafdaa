//! European option prices by the Black-Scholes formula.
//!
//! Input: options of 5 f64 each, `{spot, strike, years, rate, volatility}`
//! (rate and volatility per year, continuously compounded). Output: 2 f64
//! per option, `{call, put}`.

use std::ffi::c_void;

use crate::normal::norm_cdf;
use crate::raw::f64_aligned;

/// Bytes of one option in the input.
const OPTION_LEN: usize = 5 * 8;

/// Prices every option; returns 16 bytes per option.
///
/// With no time or no volatility the price is the discounted intrinsic
/// value. Returns 0 and writes nothing when `in_len` is not a multiple of
/// 40 or `input` or `out` is not 8-byte aligned. Agrees with the C
/// library's `black_scholes` to about 1e-12 (the normal CDFs differ in the
/// last bits). Hot path.
///
/// # Safety
///
/// `input` must point to `in_len` readable bytes and `out` to at least
/// `in_len / 40 * 16` writable bytes that do not overlap them.
#[no_mangle]
pub unsafe extern "C" fn black_scholes(input: *mut c_void, in_len: u32, out: *mut c_void) -> u32 {
    let in_len = in_len as usize;
    if in_len % OPTION_LEN != 0 || !f64_aligned(input, out) {
        return 0;
    }
    let count = in_len / OPTION_LEN;
    // SAFETY: the caller promises in_len readable bytes at `input` and
    // count*16 writable, non-overlapping bytes at `out`; both are f64
    // aligned (checked above).
    let (options, prices) = unsafe {
        (
            std::slice::from_raw_parts(input.cast::<f64>(), count * 5),
            std::slice::from_raw_parts_mut(out.cast::<f64>(), count * 2),
        )
    };
    for (o, p) in options.chunks_exact(5).zip(prices.chunks_exact_mut(2)) {
        let (call, put) = price(o[0], o[1], o[2], o[3], o[4]);
        p[0] = call;
        p[1] = put;
    }
    (count * 16) as u32
}

/// The call and put prices of one option.
fn price(spot: f64, strike: f64, years: f64, rate: f64, volatility: f64) -> (f64, f64) {
    let discounted = strike * (-rate * years).exp();
    let vt = volatility * years.sqrt();
    // Also catches NaN: the formula divides by vt.
    if vt.is_nan() || vt <= 0.0 {
        return ((spot - discounted).max(0.0), (discounted - spot).max(0.0));
    }
    let d1 = ((spot / strike).ln() + (rate + 0.5 * volatility * volatility) * years) / vt;
    let d2 = d1 - vt;
    (
        spot * norm_cdf(d1) - discounted * norm_cdf(d2),
        discounted * norm_cdf(-d2) - spot * norm_cdf(-d1),
    )
}

//! Example rfaas functions written in Rust, exported with C linkage.
//!
//! Every function has the rFaaS signature, `uint32_t f(void *in, uint32_t
//! in_len, void *out)`: it reads `in_len` bytes at `in`, writes its output
//! at `out` and returns the output's length. The names and byte layouts are
//! those of the C examples (`examples/functions/c/`), so the same clients
//! and tests use either library; `docs/functions.md` gives the layouts.
//!
//! The functions neither allocate, lock nor panic: they run on a worker's
//! hot path, and a panic cannot unwind through `extern "C"`. Input they
//! cannot read returns 0 and writes nothing.
//!
//! # Layout
//!
//! - [`basic`]: `noop` and `echo`, the round-trip benchmarks' functions.
//! - [`matmul`]: a row block of a matrix product.
//! - [`jacobi`]: one Jacobi iteration step on a block of rows.
//! - [`black_scholes`]: European call and put prices.
//! - [`normal`]: the complementary error function and the normal CDF.
//! - `raw` (private): turning the ABI's raw pointers into checked slices.

pub mod basic;
pub mod black_scholes;
pub mod jacobi;
pub mod matmul;
pub mod normal;
mod raw;

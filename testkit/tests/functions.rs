//! The example functions, loaded with `dlopen` into the test process and
//! called through the rFaaS ABI as a worker calls them: the C library, the
//! Rust cdylib (same names, same layouts, same results) and rFaaS's own
//! example functions compiled from C++.

use std::ffi::{c_void, CString};
use std::path::Path;

use rfaas_testkit::functions::{c_library, rfaas_compat_library, rust_library};

/// The rFaaS function signature.
type Function = unsafe extern "C" fn(*mut c_void, u32, *mut c_void) -> u32;

/// Bytes the tests put after a function's expected output, and what they
/// must still hold after the call: a function writes no further than it
/// says.
const SLACK: usize = 64;
const CANARY: u8 = 0xee;

/// A shared library opened with `dlopen`, closed on drop.
struct Library {
    name: &'static str,
    handle: *mut c_void,
}

impl Library {
    fn open(name: &'static str, path: &Path) -> Self {
        let c_path = CString::new(path.to_str().expect("UTF-8 path")).unwrap();
        // SAFETY: c_path is a valid C string; the example libraries run no
        // code on load that could disturb the test process.
        let handle = unsafe { libc::dlopen(c_path.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        assert!(
            !handle.is_null(),
            "dlopen {} failed: {}",
            path.display(),
            dlerror()
        );
        Self { name, handle }
    }

    fn function(&self, symbol: &str) -> Function {
        let c_symbol = CString::new(symbol).unwrap();
        // SAFETY: handle is open; c_symbol is a valid C string.
        let f = unsafe { libc::dlsym(self.handle, c_symbol.as_ptr()) };
        assert!(
            !f.is_null(),
            "{}: no symbol {symbol}: {}",
            self.name,
            dlerror()
        );
        // SAFETY: every example function has the rFaaS signature.
        unsafe { std::mem::transmute::<*mut c_void, Function>(f) }
    }

    /// Calls `symbol` on `input` with `capacity` bytes of output (plus a
    /// canary), both 8-byte aligned as a worker's buffers are. Returns the
    /// returned length and the output bytes up to it; asserts that nothing
    /// was written past it.
    fn call(&self, symbol: &str, input: &[u8], capacity: usize) -> (u32, Vec<u8>) {
        self.call_at(symbol, input, 0, capacity, CANARY)
    }

    /// [`Library::call`] with the input starting `misalign` bytes past an
    /// 8-byte boundary and the output buffer filled with `fill`.
    fn call_at(
        &self,
        symbol: &str,
        input: &[u8],
        misalign: usize,
        capacity: usize,
        fill: u8,
    ) -> (u32, Vec<u8>) {
        let f = self.function(symbol);
        let mut in_buf = vec![0u64; (misalign + input.len()).div_ceil(8)];
        let in_bytes = &mut bytemuck(&mut in_buf)[misalign..misalign + input.len()];
        in_bytes.copy_from_slice(input);
        let mut out_buf = vec![0u64; (capacity + SLACK).div_ceil(8)];
        bytemuck(&mut out_buf).fill(fill);
        let in_len = u32::try_from(input.len()).unwrap();
        // SAFETY: in_bytes holds in_len readable bytes; out_buf holds more
        // than `capacity` writable bytes, which bounds every example
        // function's output for the inputs the tests give.
        let len = unsafe {
            f(
                in_bytes.as_mut_ptr().cast(),
                in_len,
                out_buf.as_mut_ptr().cast(),
            )
        };
        let out = bytemuck(&mut out_buf);
        let len_usize = len as usize;
        assert!(
            len_usize <= capacity,
            "{}::{symbol} returned {len} > capacity {capacity}",
            self.name
        );
        assert!(
            out[len_usize..].iter().all(|&b| b == fill),
            "{}::{symbol} wrote past its returned length {len}",
            self.name
        );
        (len, out[..len_usize].to_vec())
    }
}

impl Drop for Library {
    fn drop(&mut self) {
        // SAFETY: handle came from dlopen and no function pointer from it
        // outlives the Library (call copies the output out).
        unsafe { libc::dlclose(self.handle) };
    }
}

fn dlerror() -> String {
    // SAFETY: dlerror returns null or a valid C string owned by libc.
    let e = unsafe { libc::dlerror() };
    if e.is_null() {
        return "no error".into();
    }
    // SAFETY: non-null, NUL-terminated (checked above).
    unsafe { std::ffi::CStr::from_ptr(e) }
        .to_string_lossy()
        .into_owned()
}

fn bytemuck(words: &mut [u64]) -> &mut [u8] {
    // SAFETY: u64 has no padding and every byte pattern is a valid u8.
    unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr().cast(), words.len() * 8) }
}

/// The C library and the Rust cdylib, which export the same functions.
fn both() -> [Library; 2] {
    [
        Library::open("c", &c_library()),
        Library::open("rust", &rust_library()),
    ]
}

fn f64_bytes(values: &[f64]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn f64s(bytes: &[u8]) -> Vec<f64> {
    assert_eq!(bytes.len() % 8, 0);
    bytes
        .chunks_exact(8)
        .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn header(fields: [u32; 4]) -> Vec<u8> {
    fields.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// Deterministic values in [-1, 1): a small LCG, so failures reproduce.
fn values(seed: u64, count: usize) -> Vec<f64> {
    let mut s = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
    (0..count)
        .map(|_| {
            s = s
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (s >> 11) as f64 / (1u64 << 52) as f64 - 1.0
        })
        .collect()
}

fn assert_close(got: &[f64], want: &[f64], tolerance: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tolerance * w.abs().max(1.0),
            "{what}[{i}]: got {g}, want {w}"
        );
    }
}

fn matmul_input(rows: u32, n: u32, k: u32, a: &[f64], b: &[f64]) -> Vec<u8> {
    let mut input = header([rows, n, k, 0]);
    input.extend(f64_bytes(a));
    input.extend(f64_bytes(b));
    input
}

fn reference_matmul(a: &[f64], b: &[f64], rows: usize, n: usize, k: usize) -> Vec<f64> {
    let mut c = vec![0.0; rows * k];
    for i in 0..rows {
        for j in 0..k {
            c[i * k + j] = (0..n).map(|p| a[i * n + p] * b[p * k + j]).sum();
        }
    }
    c
}

fn jacobi_input(n: u32, begin: u32, end: u32, a: &[f64], b: &[f64], x: &[f64]) -> Vec<u8> {
    let mut input = header([n, begin, end, 0]);
    input.extend(f64_bytes(a));
    input.extend(f64_bytes(b));
    input.extend(f64_bytes(x));
    input
}

fn reference_jacobi(a: &[f64], b: &[f64], x: &[f64], rows: std::ops::Range<usize>) -> Vec<f64> {
    let n = x.len();
    rows.map(|i| {
        let off: f64 = (0..n)
            .filter(|&j| j != i)
            .map(|j| a[i * n + j] * x[j])
            .sum();
        (b[i] - off) / a[i * n + i]
    })
    .collect()
}

/// A diagonally dominant n×n matrix, so Jacobi converges.
fn dominant_matrix(n: usize) -> Vec<f64> {
    let mut a = values(7, n * n);
    for i in 0..n {
        a[i * n + i] = n as f64 + 1.0;
    }
    a
}

#[test]
fn libraries_export_every_example_function() {
    for lib in both() {
        for f in ["noop", "echo", "empty", "matmul", "jacobi", "black_scholes"] {
            lib.function(f);
        }
    }
}

#[test]
fn noop_returns_nothing() {
    for lib in both() {
        assert_eq!(lib.call("noop", b"ignored", 0), (0, vec![]));
    }
}

#[test]
fn echo_returns_its_input() {
    for lib in both() {
        for len in [0usize, 1, 4, 31, 4097] {
            let input: Vec<u8> = (0..len).map(|i| (i * 7 + 3) as u8).collect();
            let (n, out) = lib.call("echo", &input, len);
            assert_eq!(n as usize, len, "{}: echo length", lib.name);
            assert_eq!(out, input, "{}: echo bytes", lib.name);
        }
    }
}

#[test]
fn empty_returns_the_input_length_and_writes_only_the_first_word() {
    for lib in both() {
        for len in [0usize, 1, 3, 4, 5, 4097] {
            let input: Vec<u8> = (0..len).map(|i| (i * 5 + 1) as u8).collect();
            let (n, out) = lib.call_at("empty", &input, 0, len, CANARY);
            assert_eq!(n as usize, len, "{}: empty length", lib.name);
            let copied = if len >= 4 { 4 } else { 0 };
            assert_eq!(out[..copied], input[..copied], "{}: first word", lib.name);
            assert!(
                out[copied..].iter().all(|&b| b == CANARY),
                "{}: empty wrote past its first word",
                lib.name
            );
        }
    }
}

#[test]
fn matmul_matches_the_reference_and_both_libraries_agree() {
    let [c_lib, rust_lib] = both();
    let shapes = [
        (1, 1, 1),
        (3, 4, 5),
        (7, 1, 9),
        (16, 16, 16),
        (13, 17, 11),
        (1, 64, 3),
        (5, 0, 3),
        (0, 4, 4),
        (4, 4, 0),
    ];
    for (seed, (rows, n, k)) in shapes.into_iter().enumerate() {
        let a = values(seed as u64, rows * n);
        let b = values(seed as u64 + 100, n * k);
        let input = matmul_input(rows as u32, n as u32, k as u32, &a, &b);
        let want = reference_matmul(&a, &b, rows, n, k);
        let (c_len, c_out) = c_lib.call("matmul", &input, rows * k * 8);
        let (r_len, r_out) = rust_lib.call("matmul", &input, rows * k * 8);
        assert_eq!(
            c_len as usize,
            rows * k * 8,
            "c: matmul length for {rows}x{n}x{k}"
        );
        assert_eq!(r_len, c_len, "rust: matmul length for {rows}x{n}x{k}");
        assert_close(
            &f64s(&c_out),
            &want,
            1e-12,
            &format!("c matmul {rows}x{n}x{k}"),
        );
        assert_eq!(r_out, c_out, "C and Rust matmul differ for {rows}x{n}x{k}");
    }
}

#[test]
fn matmul_row_blocks_compose_the_whole_product() {
    // What a client does: half of A's rows on each of two invocations.
    let (rows, n, k) = (10, 6, 8);
    let a = values(1, rows * n);
    let b = values(2, n * k);
    let whole = reference_matmul(&a, &b, rows, n, k);
    for lib in both() {
        let mut joined = Vec::new();
        for half in [0..rows / 2, rows / 2..rows] {
            let block = &a[half.start * n..half.end * n];
            let input = matmul_input(half.len() as u32, n as u32, k as u32, block, &b);
            let (len, out) = lib.call("matmul", &input, half.len() * k * 8);
            assert_eq!(len as usize, half.len() * k * 8);
            joined.extend(f64s(&out));
        }
        assert_close(
            &joined,
            &whole,
            1e-12,
            &format!("{} matmul halves", lib.name),
        );
    }
}

#[test]
fn jacobi_step_matches_the_reference_and_both_libraries_agree() {
    let n = 9;
    let a = dominant_matrix(n);
    let b = values(3, n);
    let x = values(4, n);
    let [c_lib, rust_lib] = both();
    for (begin, end) in [(0, n), (0, 4), (4, n), (3, 3), (n - 1, n)] {
        let input = jacobi_input(n as u32, begin as u32, end as u32, &a, &b, &x);
        let want = reference_jacobi(&a, &b, &x, begin..end);
        let (c_len, c_out) = c_lib.call("jacobi", &input, (end - begin) * 8);
        let (r_len, r_out) = rust_lib.call("jacobi", &input, (end - begin) * 8);
        assert_eq!(c_len as usize, (end - begin) * 8, "c: jacobi length");
        assert_eq!(r_len, c_len, "rust: jacobi length");
        let what = format!("c jacobi {begin}..{end}");
        assert_close(&f64s(&c_out), &want, 1e-13, &what);
        assert_eq!(r_out, c_out, "C and Rust jacobi differ for {begin}..{end}");
    }
}

#[test]
fn jacobi_iterations_split_over_two_blocks_solve_the_system() {
    let n = 8;
    let a = dominant_matrix(n);
    let b = values(5, n);
    for lib in both() {
        let mut x = vec![0.0; n];
        for _ in 0..60 {
            let mut next = Vec::with_capacity(n);
            for (begin, end) in [(0, n / 2), (n / 2, n)] {
                let input = jacobi_input(n as u32, begin as u32, end as u32, &a, &b, &x);
                next.extend(f64s(&lib.call("jacobi", &input, (end - begin) * 8).1));
            }
            x = next;
        }
        let ax: Vec<f64> = (0..n)
            .map(|i| (0..n).map(|j| a[i * n + j] * x[j]).sum())
            .collect();
        assert_close(&ax, &b, 1e-9, &format!("{}: A·x after Jacobi", lib.name));
    }
}

fn black_scholes(lib: &Library, options: &[[f64; 5]]) -> Vec<f64> {
    let input = f64_bytes(&options.concat());
    let (len, out) = lib.call("black_scholes", &input, options.len() * 16);
    assert_eq!(
        len as usize,
        options.len() * 16,
        "{}: black_scholes length",
        lib.name
    );
    f64s(&out)
}

#[test]
fn black_scholes_gives_known_prices() {
    let options = [[100.0, 100.0, 1.0, 0.05, 0.2], [42.0, 40.0, 0.5, 0.1, 0.2]];
    // The closed form evaluated independently; the first is the textbook
    // at-the-money case (call 10.4506, put 5.5735).
    let want = [
        10.450_583_572_185_565,
        5.573_526_022_256_971,
        4.759_422_392_871_535,
        0.808_599_372_900_095_8,
    ];
    for lib in both() {
        assert_close(&black_scholes(&lib, &options), &want, 1e-10, lib.name);
    }
}

#[test]
fn black_scholes_satisfies_put_call_parity_and_both_libraries_agree() {
    let r = values(9, 5 * 200);
    let options: Vec<[f64; 5]> = r
        .chunks_exact(5)
        .map(|v| {
            [
                100.0 + 50.0 * v[0], // spot 50..150
                100.0 + 40.0 * v[1], // strike 60..140
                1.5 + 1.4 * v[2],    // years 0.1..2.9
                0.05 + 0.04 * v[3],  // rate 1%..9%
                0.35 + 0.3 * v[4],   // volatility 5%..65%
            ]
        })
        .collect();
    let [c_lib, rust_lib] = both();
    let c_prices = black_scholes(&c_lib, &options);
    let rust_prices = black_scholes(&rust_lib, &options);
    assert_close(&rust_prices, &c_prices, 1e-10, "Rust vs C black_scholes");
    for (o, p) in options.iter().zip(c_prices.chunks_exact(2)) {
        let [s, k, t, rate, _] = *o;
        let (call, put) = (p[0], p[1]);
        assert!(call >= 0.0 && put >= 0.0, "negative price for {o:?}: {p:?}");
        let parity = s - k * (-rate * t).exp();
        assert!(
            (call - put - parity).abs() < 1e-9,
            "put-call parity fails for {o:?}: {p:?}"
        );
    }
}

#[test]
fn black_scholes_without_time_or_volatility_is_the_discounted_intrinsic_value() {
    let options = [
        [110.0, 100.0, 0.0, 0.05, 0.2],
        [90.0, 100.0, 1.0, 0.0, 0.0],
        [100.0, 100.0, 0.0, 0.0, 0.3],
    ];
    let want = [10.0, 0.0, 0.0, 10.0, 0.0, 0.0];
    for lib in both() {
        assert_close(&black_scholes(&lib, &options), &want, 1e-15, lib.name);
    }
}

#[test]
fn malformed_inputs_return_zero_and_write_nothing() {
    let a = values(1, 6);
    let b = values(2, 6);
    let good_matmul = matmul_input(2, 3, 2, &a, &b);
    let mut reserved = good_matmul.clone();
    reserved[12] = 1;
    let huge_output = matmul_input(1 << 16, 0, 1 << 16, &[], &[]);
    let jac_a = dominant_matrix(3);
    let jac_bx = values(3, 3);
    let good_jacobi = jacobi_input(3, 0, 3, &jac_a, &jac_bx, &jac_bx);
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        ("matmul", vec![], "empty"),
        (
            "matmul",
            header([2, 3, 2, 0])[..12].to_vec(),
            "short header",
        ),
        (
            "matmul",
            good_matmul[..good_matmul.len() - 8].to_vec(),
            "missing an element",
        ),
        (
            "matmul",
            [good_matmul.as_slice(), &[0; 8]].concat(),
            "an element too many",
        ),
        (
            "matmul",
            matmul_input(3, 3, 2, &a, &b),
            "rows disagree with the length",
        ),
        ("matmul", reserved, "reserved not zero"),
        ("matmul", huge_output, "output beyond a u32 length"),
        (
            "jacobi",
            good_jacobi[..good_jacobi.len() - 8].to_vec(),
            "missing an element",
        ),
        (
            "jacobi",
            jacobi_input(3, 2, 1, &jac_a, &jac_bx, &jac_bx),
            "begin after end",
        ),
        (
            "jacobi",
            jacobi_input(3, 1, 4, &jac_a, &jac_bx, &jac_bx),
            "end beyond n",
        ),
        (
            "jacobi",
            jacobi_input(4, 0, 3, &jac_a, &jac_bx, &jac_bx),
            "n disagrees with the length",
        ),
        (
            "jacobi",
            header([0x1_0000, 0, 0, 0]),
            "an n no input can hold",
        ),
        ("black_scholes", vec![0; 39], "not a whole option"),
        ("black_scholes", vec![0; 41], "more than a whole option"),
    ];
    for lib in both() {
        for (f, input, why) in &cases {
            assert_eq!(
                lib.call(f, input, 64),
                (0, vec![]),
                "{}::{f} accepted {why}",
                lib.name
            );
        }
        // Buffers a worker never passes: f64 data off its alignment.
        assert_eq!(
            lib.call_at("matmul", &good_matmul, 4, 64, CANARY).0,
            0,
            "{}: misaligned matmul",
            lib.name
        );
        assert_eq!(
            lib.call_at("jacobi", &good_jacobi, 4, 64, CANARY).0,
            0,
            "{}: misaligned jacobi",
            lib.name
        );
        let option = f64_bytes(&[100.0, 100.0, 1.0, 0.05, 0.2]);
        assert_eq!(
            lib.call_at("black_scholes", &option, 4, 64, CANARY).0,
            0,
            "{}: misaligned black_scholes",
            lib.name
        );
        // The well-formed inputs of the same cases do run.
        assert_eq!(
            lib.call("matmul", &good_matmul, 32).0,
            32,
            "{}: matmul",
            lib.name
        );
        assert_eq!(
            lib.call("jacobi", &good_jacobi, 24).0,
            24,
            "{}: jacobi",
            lib.name
        );
    }
}

#[test]
fn rfaas_example_functions_run_unchanged() {
    let lib = Library::open("rfaas-compat", &rfaas_compat_library());

    // empty copies one int and claims the input's size.
    let input = [0x11, 0x22, 0x33, 0x44, 9, 9, 9, 9];
    let (len, out) = lib.call("empty", &input, input.len());
    assert_eq!(len, 8);
    assert_eq!(out[..4], input[..4]);

    // mmm and mmm3: [A | B] square, the output as large as one matrix.
    let n = 6;
    let a = values(11, n * n);
    let b = values(12, n * n);
    let input = f64_bytes(&[a.as_slice(), &b].concat());
    let whole = reference_matmul(&a, &b, n, n, n);
    // mmm adds into its output, so that starts zeroed.
    let (len, out) = lib.call_at("mmm", &input, 0, n * n * 8, 0);
    assert_eq!(len as usize, n * n * 8);
    assert_close(&f64s(&out), &whole, 1e-12, "mmm");

    let (len, out) = lib.call("mmm3", &input, n * n * 8);
    assert_eq!(len as usize, n * n * 8);
    let lower: Vec<f64> = (0..n * n)
        .map(|i| if i < n / 2 * n { 0.0 } else { whole[i] })
        .collect();
    assert_close(&f64s(&out), &lower, 1e-12, "mmm3");
}

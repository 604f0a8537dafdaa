//! A job that offloads half of a matrix multiplication to an rfaas worker.
//!
//! C = A·B with A and B n×n (f64). The worker computes the first half of
//! C's rows with the `matmul` example function while this thread computes
//! the second half; the result is checked against a local product. Prints
//! the cold start, the remote call's latency, and a noop round trip.
//!
//! ```text
//! offload_matmul --executor 127.0.0.1:7100 --token <lease token> \
//!     --library target/release/librfaas_example_functions.so \
//!     [--provider tcp|shm] [--n 512] [--reps 20]
//! ```

use std::time::{Duration, Instant};

use rfaas_client::{AllocationSpec, Client, ClientOptions, Mode};

struct Args {
    executor: String,
    token: String,
    library: String,
    provider: String,
    n: usize,
    reps: usize,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        executor: std::env::var("RFAAS_EXECUTOR").unwrap_or_default(),
        token: std::env::var("RFAAS_TOKEN").unwrap_or_default(),
        library: String::new(),
        provider: "tcp".into(),
        n: 512,
        reps: 20,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--executor" => args.executor = value()?,
            "--token" => args.token = value()?,
            "--library" => args.library = value()?,
            "--provider" => args.provider = value()?,
            "--n" => args.n = value()?.parse().map_err(|e| format!("--n: {e}"))?,
            "--reps" => args.reps = value()?.parse().map_err(|e| format!("--reps: {e}"))?,
            other => return Err(format!("unknown argument {other}")),
        }
    }
    if args.executor.is_empty() || args.token.is_empty() || args.library.is_empty() {
        return Err("--executor, --token and --library are required".into());
    }
    Ok(args)
}

/// Rows `rows` of A·B, with A given from its first row on.
fn local_matmul(a: &[f64], b: &[f64], n: usize, rows: std::ops::Range<usize>, c: &mut [f64]) {
    for (ci, i) in rows.enumerate() {
        let out = &mut c[ci * n..(ci + 1) * n];
        out.fill(0.0);
        for k in 0..n {
            let aik = a[i * n + k];
            let brow = &b[k * n..(k + 1) * n];
            for (o, &bkj) in out.iter_mut().zip(brow) {
                *o += aik * bkj;
            }
        }
    }
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = parse_args().map_err(|e| format!("{e}\nsee the usage in the source's header"))?;
    let n = args.n;
    let half = n / 2;
    let library = std::fs::read(&args.library)
        .map_err(|e| format!("cannot read the library {}: {e}", args.library))?;

    let started = Instant::now();
    let client = Client::new(ClientOptions::with_provider(&args.provider));
    let spec = AllocationSpec::new(library, &["matmul", "noop"])
        .cores(1)
        .memory_mib(512)
        .mode(Mode::Hot)
        .input_capacity(((16 + 8 * (half * n + n * n)) as u32).next_multiple_of(4096) + 4096)
        .output_capacity((8 * half * n) as u32);
    let alloc = client.allocate(&args.executor, &args.token, &spec)?;
    let matmul = alloc.function("matmul")?;
    let noop = alloc.function("noop")?;
    let empty = alloc.buffer::<u8>(1)?;
    let mut nothing = alloc.buffer::<u8>(1)?;
    // First result: the end of the cold start.
    alloc.submit(noop, &empty, 0, &mut nothing)?.spin()?;
    let cold = started.elapsed();
    let phases = alloc.cold_start();

    // A and B, deterministic and well-conditioned enough to compare exactly.
    let a: Vec<f64> = (0..n * n)
        .map(|i| ((i * 7 + 3) % 17) as f64 / 16.0)
        .collect();
    let b: Vec<f64> = (0..n * n)
        .map(|i| ((i * 5 + 1) % 13) as f64 / 12.0)
        .collect();

    // The request: {rows, n, k, 0} then rows of A, then B.
    let mut input = alloc.buffer::<u8>(16 + 8 * (half * n + n * n))?;
    {
        let bytes = input.as_mut_slice();
        for (i, v) in [half as u32, n as u32, n as u32, 0].iter().enumerate() {
            bytes[i * 4..i * 4 + 4].copy_from_slice(&v.to_le_bytes());
        }
        let mut at = 16;
        for v in a[..half * n].iter().chain(&b) {
            bytes[at..at + 8].copy_from_slice(&v.to_le_bytes());
            at += 8;
        }
    }
    let mut output = alloc.buffer::<f64>(half * n)?;

    let mut total = Vec::with_capacity(args.reps);
    let mut c = vec![0.0; n * n];
    for _ in 0..args.reps {
        let t0 = Instant::now();
        let inv = alloc.submit(matmul, &input, input.len(), &mut output)?;
        local_matmul(&a, &b, n, half..n, &mut c[half * n..]);
        let len = inv.spin()?;
        total.push(t0.elapsed());
        assert_eq!(len, 8 * half * n, "the worker returned {len} bytes");
    }
    c[..half * n].copy_from_slice(output.as_slice());

    let mut expect = vec![0.0; n * n];
    local_matmul(&a, &b, n, 0..n, &mut expect);
    let max_err = c
        .iter()
        .zip(&expect)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max);
    if max_err > 1e-9 {
        return Err(format!("the offloaded product is wrong: max |error| {max_err}").into());
    }

    let mut noops = Vec::with_capacity(1000);
    for _ in 0..1000 {
        let t0 = Instant::now();
        alloc.submit(noop, &empty, 1, &mut nothing)?.spin()?;
        noops.push(t0.elapsed());
    }
    total.sort();
    noops.sort();
    println!(
        "cold start (allocate to first result): {:.2} ms, {} worker",
        cold.as_secs_f64() * 1e3,
        if phases.pooled { "pooled" } else { "spawned" },
    );
    println!(
        "  control connect {:.0} µs, request {:.0} µs (executor: validate {:.0}, worker {:.0}, \
         load {:.0}, listen {:.0}), lanes {:.0} µs, first call {:.0} µs",
        us(phases.connect_control),
        us(phases.round_trip),
        us(phases.validate),
        us(phases.worker),
        us(phases.load),
        us(phases.listen),
        us(phases.connect_lanes),
        us(cold.saturating_sub(phases.total)),
    );
    println!("{:<44} {:>12} {:>12}", "", "median µs", "p99 µs");
    println!(
        "{:<44} {:>12.1} {:>12.1}",
        format!("matmul {n}x{n}, half offloaded, per call"),
        us(percentile(&total, 0.5)),
        us(percentile(&total, 0.99))
    );
    println!(
        "{:<44} {:>12.2} {:>12.2}",
        "noop round trip (hot worker)",
        us(percentile(&noops, 0.5)),
        us(percentile(&noops, 0.99))
    );
    println!("result checked against a local product: max |error| {max_err:e}");
    alloc.deallocate()?;
    Ok(())
}

//! A job that offloads half of a matrix multiplication to an rfaas worker.
//!
//! C = A·B with A and B n×n (f64). The worker computes the first half of
//! C's rows with the `matmul` example function while this thread computes
//! the second half; the result is checked against a local product. Prints
//! the time of the same product computed here alone next to the offloaded
//! one and whether offloading paid off, then the cold start and a noop
//! round trip. `offload_matmul --help` prints the usage.

use std::time::{Duration, Instant};

use rfaas_client::lease::{LeaseRequest, Managers};
use rfaas_client::{AllocationSpec, Client, ClientOptions, Mode};

const USAGE: &str = "\
Usage: offload_matmul --managers URLS --credential CRED --library FILE [OPTIONS]
       offload_matmul --executor HOST:PORT --token TOKEN --library FILE [OPTIONS]

A job that multiplies two n x n matrices (f64) and has an rfaas worker
compute half of the product's rows while it computes the other half. It
times the same product computed here alone, prints both times and the
speedup (or the slowdown), and checks the result.

With --managers, the job asks the resource manager for a lease of one
core (retrying with backoff while none is free, for up to 60 s), allocates
on the node it gets, and releases the lease at the end. With --executor and
--token it uses a lease minted by hand (rfaas-token) on that executor.

Options:
  --managers URLS       the resource manager replicas, comma-separated
                        (http://host:port); default: $RFAAS_MANAGERS
  --credential CRED     the job's credential for the managers (rfaasctl
                        credential user); default: $RFAAS_CREDENTIAL
  --executor HOST:PORT  the executor daemon's control address (the
                        `control=` of rfaas-executord's ready line);
                        default: $RFAAS_EXECUTOR
  --token TOKEN         a lease token for that executor's node (rfaas-token
                        mint); default: $RFAAS_TOKEN
  --library FILE        the function library to ship to the worker; it must
                        export `matmul` and `noop`, as
                        target/release/librfaas_example_functions.so does
  --provider NAME       fabric provider: tcp, shm (same machine only) or
                        verbs:DEVICE [default: tcp]
  --n N                 matrix size [default: 512]
  --reps R              products timed, each way [default: 20]
  -h, --help            print this help
";

struct Args {
    managers: String,
    credential: String,
    executor: String,
    token: String,
    library: String,
    provider: String,
    n: usize,
    reps: usize,
}

/// The arguments, or `None` for `--help`.
fn parse_args() -> Result<Option<Args>, String> {
    let mut args = Args {
        managers: std::env::var("RFAAS_MANAGERS").unwrap_or_default(),
        credential: std::env::var("RFAAS_CREDENTIAL").unwrap_or_default(),
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
            "-h" | "--help" => return Ok(None),
            "--managers" => args.managers = value()?,
            "--credential" => args.credential = value()?,
            "--executor" => args.executor = value()?,
            "--token" => args.token = value()?,
            "--library" => args.library = value()?,
            "--provider" => args.provider = value()?,
            "--n" => args.n = value()?.parse().map_err(|e| format!("--n: {e}"))?,
            "--reps" => args.reps = value()?.parse().map_err(|e| format!("--reps: {e}"))?,
            other => return Err(format!("unknown argument {other}")),
        }
    }
    let leased = !args.managers.is_empty() && !args.credential.is_empty();
    let minted = !args.executor.is_empty() && !args.token.is_empty();
    if !(leased || minted) || args.library.is_empty() {
        return Err(
            "--library and either --managers with --credential or --executor with --token are required"
                .into(),
        );
    }
    if args.n < 2 || args.reps == 0 {
        return Err(format!(
            "--n {} --reps {}: the matrices need at least 2 rows and the timing at least 1 repetition",
            args.n, args.reps
        ));
    }
    Ok(Some(args))
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

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn main() -> std::process::ExitCode {
    let args = match parse_args() {
        Ok(Some(args)) => args,
        Ok(None) => {
            print!("{USAGE}");
            return std::process::ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("offload_matmul: {e}\n(`offload_matmul --help` prints the usage)");
            return std::process::ExitCode::from(2);
        }
    };
    match run(&args) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("offload_matmul: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// Whether `executor` (HOST:PORT) names this machine, as far as its text says.
fn is_this_machine(executor: &str, provider: &str) -> bool {
    let host = executor
        .rsplit_once(':')
        .map_or(executor, |(host, _)| host)
        .trim_matches(['[', ']']);
    provider == "shm"
        || host == "localhost"
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

fn run(args: &Args) -> Result<(), Box<dyn std::error::Error>> {
    let n = args.n;
    let half = n / 2;
    let library = std::fs::read(&args.library)
        .map_err(|e| format!("cannot read the library {}: {e}", args.library))?;

    // A and B, deterministic and well-conditioned enough to compare exactly.
    let a: Vec<f64> = (0..n * n)
        .map(|i| ((i * 7 + 3) % 17) as f64 / 16.0)
        .collect();
    let b: Vec<f64> = (0..n * n)
        .map(|i| ((i * 5 + 1) % 13) as f64 / 12.0)
        .collect();

    // The job without rfaas: the whole product on this thread, before any
    // worker exists, the same number of times.
    let mut expect = vec![0.0; n * n];
    let mut local_only = Vec::with_capacity(args.reps);
    for _ in 0..args.reps {
        let t0 = Instant::now();
        local_matmul(&a, &b, n, 0..n, &mut expect);
        local_only.push(t0.elapsed());
    }

    let started = Instant::now();
    let client = Client::new(ClientOptions::with_provider(&args.provider));
    let spec = AllocationSpec::new(library, &["matmul", "noop"])
        .cores(1)
        .memory_mib(512)
        .mode(Mode::Hot)
        .input_capacity(((16 + 8 * (half * n + n * n)) as u32).next_multiple_of(4096) + 4096)
        .output_capacity((8 * half * n) as u32);
    // A lease from the manager, or the one given by hand.
    let lease;
    let (executor, token) = if !args.managers.is_empty() && !args.credential.is_empty() {
        let managers = Managers::new(args.managers.split(','), &args.credential)?;
        let want = LeaseRequest {
            cores: 1,
            memory_mib: 512,
            duration_s: 600,
            min_cores: None,
            nodes: Vec::new(),
        };
        lease = Some(managers.request(&want, Duration::from_secs(60))?);
        let node = lease.as_ref().expect("just granted").nodes().remove(0);
        println!(
            "lease {} from the manager: {} core on {} ({}), until {} (Unix s)",
            lease.as_ref().expect("just granted").id(),
            node.cores,
            node.node,
            node.executor(),
            lease.as_ref().expect("just granted").expires_at()
        );
        (node.executor(), node.token)
    } else {
        lease = None;
        (args.executor.clone(), args.token.clone())
    };
    let alloc = client.allocate(&executor, &token, &spec)?;
    let matmul = alloc.function("matmul")?;
    let noop = alloc.function("noop")?;
    let empty = alloc.buffer::<u8>(1)?;
    let mut nothing = alloc.buffer::<u8>(1)?;
    // First result: the end of the cold start.
    alloc.submit(noop, &empty, 0, &mut nothing)?.spin()?;
    let cold = started.elapsed();
    let phases = alloc.cold_start();

    // The request: {rows, n, k, 0} then rows of A, then B.
    let mut request = Vec::with_capacity(16 + 8 * (half * n + n * n));
    for v in [half as u32, n as u32, n as u32, 0] {
        request.extend_from_slice(&v.to_le_bytes());
    }
    for v in a[..half * n].iter().chain(&b) {
        request.extend_from_slice(&v.to_le_bytes());
    }
    let mut input = alloc.buffer::<u8>(request.len())?;
    input.write_from(0, &request);
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
    output.read_into(0, &mut c[..half * n]);

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
    local_only.sort();
    noops.sort();
    let (local_median, offloaded_median) = (percentile(&local_only, 0.5), percentile(&total, 0.5));
    println!("{:<44} {:>12} {:>12}", "", "median ms", "p99 ms");
    for (what, times) in [
        (format!("matmul {n}x{n}, computed here alone"), &local_only),
        (format!("matmul {n}x{n}, half offloaded"), &total),
    ] {
        println!(
            "{what:<44} {:>12.2} {:>12.2}",
            ms(percentile(times, 0.5)),
            ms(percentile(times, 0.99))
        );
    }
    let ratio = local_median.as_secs_f64() / offloaded_median.as_secs_f64();
    if ratio >= 1.05 {
        println!("speedup {ratio:.1}x: offloading half paid off");
    } else if ratio > 1.0 / 1.05 {
        println!("no gain: offloading took as long as computing here alone ({ratio:.2}x)");
    } else {
        println!(
            "slowdown: offloading was {:.1}x slower than computing here alone",
            1.0 / ratio
        );
    }
    if is_this_machine(&executor, &args.provider) {
        println!(
            "  (executor and job on one machine: the worker computes on a core this job \
             could have used itself, and the two compete for the memory bus)"
        );
    }
    println!("result checked against the local product: max |error| {max_err:e}");
    println!();
    println!(
        "cold start (allocate to first result): {:.2} ms, {} worker",
        ms(cold),
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
    println!(
        "noop round trip (hot worker): median {:.2} µs, p99 {:.2} µs",
        us(percentile(&noops, 0.5)),
        us(percentile(&noops, 0.99))
    );
    alloc.deallocate()?;
    if let Some(lease) = lease {
        lease.release()?;
    }
    Ok(())
}

//! `rfaas-control-bench`: a good client's allocation latency on a real
//! `rfaas-executord`, quiet and then while hundreds of connections without
//! a valid token misbehave on its control port (idle ones, slow ones, and
//! ones that stall one byte short of a 64 MiB library; see
//! `rfaas_testkit::abuse`), with what the daemon holds meanwhile.
//!
//! Each sample is one allocation of one core (the C example library, the
//! tcp provider) and its deallocation on a fresh connection from
//! 127.0.0.1; the misbehaving connections come from 127.0.0.2 and up. Runs
//! as root (workers run as `nobody`); needs `rfaas-executord` and
//! `rfaas-worker` next to this binary, or `--executord`.

use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Parser;
use rfaas_bench::cleanup;
use rfaas_bench::stats::Summary;
use rfaas_testkit::abuse::{self, Attack, Plan, Usage};
use rfaas_testkit::executord::{Executord, ExecutordOptions};
use rfaas_testkit::functions::c_library_bytes;

/// A good client's allocations, quiet and under misbehaving connections.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// Allocations measured in each phase, after 5 untimed.
    #[arg(long, default_value_t = 50)]
    iters: usize,

    /// Source addresses of the misbehaving connections (127.0.0.2 and up).
    #[arg(long, default_value_t = 4)]
    addresses: u8,

    /// Connections that send nothing, per address.
    #[arg(long, default_value_t = 200)]
    idle: usize,

    /// Connections that send a request a byte a second, per address.
    #[arg(long, default_value_t = 20)]
    slow: usize,

    /// Connections that stall one byte short of a 64 MiB library, per
    /// address.
    #[arg(long, default_value_t = 5)]
    stalled: usize,

    /// More lines for the daemon's configuration file (e.g. its caps).
    #[arg(long, default_value = "")]
    extra_config: String,

    /// The rfaas-executord binary (default: next to this one).
    #[arg(long)]
    executord: Option<PathBuf>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("rfaas-control-bench: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: &Args) -> Result<(), String> {
    cleanup::install().map_err(|e| format!("could not install the signal handlers: {e}"))?;
    let wanted = (usize::from(args.addresses) * (args.idle + args.slow + args.stalled)) as u64;
    let limit = abuse::raise_descriptor_limit(wanted + 256);
    if limit < wanted + 64 {
        return Err(format!(
            "the descriptor limit is {limit}, too low for {wanted} connections; raise ulimit -n"
        ));
    }
    let bin = rfaas_bench::cli::service_binary(
        args.executord.as_deref(),
        "rfaas-executord",
        "rfaas-executor",
        "--executord",
    )?;
    let d = Executord::try_start(
        &bin,
        ExecutordOptions {
            extra_config: args.extra_config.clone(),
            ..ExecutordOptions::default()
        },
    )?;
    let _registered = cleanup::register(d.pid());
    let library = c_library_bytes();

    let quiet = measure(&d, &library, args.iters)?;
    let quiet_usage = Usage::of(d.pid());
    let plan = Plan {
        from: (0..args.addresses)
            .map(|i| Ipv4Addr::new(127, 0, 0, 2 + i))
            .collect(),
        idle: args.idle,
        slow: args.slow,
        stalled: args.stalled,
    };
    let attack = Attack::start(d.control_addr(), &plan);
    let attacked = measure(&d, &library, args.iters)?;
    let attacked_usage = Usage::of(d.pid());
    let open = attack.open();
    drop(attack);

    println!(
        "rfaas-control-bench: {} connections ({} per address from {} addresses: {} idle, {} slow, \
         {} stalled at 64 MiB - 1)",
        open,
        args.idle + args.slow + args.stalled,
        args.addresses,
        args.idle,
        args.slow,
        args.stalled
    );
    println!(
        "{:<10} {:>10} {:>10} {:>10} {:>10} {:>6} {:>8}",
        "phase", "median_us", "p99_us", "max_us", "rss_mib", "fds", "threads"
    );
    for (name, s, u) in [
        ("quiet", quiet, quiet_usage),
        ("attacked", attacked, attacked_usage),
    ] {
        println!(
            "{:<10} {:>10.1} {:>10.1} {:>10.1} {:>10.1} {:>6} {:>8}",
            name,
            s.0.median_ns as f64 / 1e3,
            s.0.p99_ns as f64 / 1e3,
            s.1 as f64 / 1e3,
            u.rss_kib as f64 / 1024.0,
            u.fds,
            u.threads
        );
    }
    println!(
        "median attacked / quiet: {:.2}",
        attacked.0.median_ns as f64 / quiet.0.median_ns as f64
    );
    Ok(())
}

/// `iters` timed allocate-and-deallocate rounds after 5 untimed; the
/// summary and the slowest.
fn measure(d: &Executord, library: &[u8], iters: usize) -> Result<(Summary, u64), String> {
    for _ in 0..5 {
        d.allocate_and_deallocate(library)?;
    }
    let mut samples = Vec::with_capacity(iters);
    for _ in 0..iters {
        let t = Instant::now();
        d.allocate_and_deallocate(library)?;
        samples.push(t.elapsed().as_nanos() as u64);
        // The pool refills after each allocation; start each from a full one.
        wait_pool(d)?;
    }
    let max = samples.iter().copied().max().unwrap_or(0);
    let summary = Summary::of(&mut samples).ok_or("no samples")?;
    Ok((summary, max))
}

fn wait_pool(d: &Executord) -> Result<(), String> {
    let until = Instant::now() + Duration::from_secs(30);
    loop {
        if let rfaas_proto::control::local::LocalReply::Status {
            pool_idle,
            allocations,
            ..
        } = d.status()
        {
            if pool_idle >= 1 && allocations.is_empty() {
                return Ok(());
            }
        }
        if Instant::now() > until {
            return Err(format!(
                "the pool did not refill within 30 s; the daemon's log:\n{}",
                d.log()
            ));
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

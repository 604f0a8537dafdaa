//! `rfaas-fabric-bench`: round-trip latency and bandwidth of the fabric
//! providers next to the raw baselines they are judged against (DESIGN.md,
//! "Performance targets"), measured side by side in one run.
//!
//! Layout:
//! - `rows.rs`: what a row is ([`rows::RowSpec`]), what it is given
//!   ([`rows::Ctx`]), and the loop that runs the selected ones;
//! - `fabric_rows.rs`: `pingpong` and `bandwidth` through rfaas-fabric;
//! - `baselines.rs`: the raw baselines (plain sockets, shared memory, memcpy);
//! - `child.rs`: the peer process each two-sided row runs against, started by
//!   re-executing this binary with the hidden `--serve <what>`;
//! - `stats.rs`: latency samples -> median, p99, min, mean;
//! - `report.rs`: the table on stdout, or JSON lines with `--json`;
//! - `error.rs`: the error type; every error is a sentence.
//!
//! Adding rows: write a module that exports a [`rows::Suite`] and list it
//! in [`SUITES`]. A row is a `fn(&Ctx, &Provider, &mut Report) -> Result<()>`
//! (or `fn(&Ctx, &mut Report)` for provider-less rows) that pushes one
//! [`report::Row`] per size; its peer side is a
//! `fn(&[String], Ready) -> Result<()>` listed in the suite's `peers`, started
//! with `ctx.spawn_peer(name, args, fds)`. `baselines.rs` is the example.

mod baselines;
mod child;
mod error;
mod fabric_rows;
mod report;
mod rows;
mod stats;

use std::process::ExitCode;

use clap::{Parser, ValueEnum};

use crate::error::{Context, Error, Result};
use crate::report::Report;
use crate::rows::{Ctx, Provider, Suite};

/// Every measuring module, in the order its rows are run and printed.
const SUITES: &[Suite] = &[fabric_rows::SUITE, baselines::SUITE];

/// Latency and bandwidth of rfaas-fabric providers and raw baselines.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// Providers to measure: tcp, shm, verbs:DEVICE; repeat the flag or
    /// separate with commas. Baselines run for the providers they stand for.
    #[arg(long, value_delimiter = ',', default_value = "tcp,shm")]
    provider: Vec<String>,

    /// Message sizes in bytes for latency rows.
    #[arg(long, value_delimiter = ',', default_value = "1,64,4096")]
    sizes: Vec<usize>,

    /// Message sizes in bytes for bandwidth rows.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "1024,65536,1048576,5242880"
    )]
    bw_sizes: Vec<usize>,

    /// Timed iterations per latency row, after max(1000, iters/10) untimed.
    #[arg(long, default_value_t = 10_000)]
    iters: usize,

    /// Bytes moved per bandwidth row (at least 8 messages).
    #[arg(long, default_value_t = 256 << 20)]
    bw_bytes: u64,

    /// Measure every row this many times and report each row's best round
    /// (see report.rs for why).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
    rounds: u64,

    /// Only these rows (comma-separated names); all when absent.
    #[arg(long, value_delimiter = ',')]
    rows: Option<Vec<String>>,

    /// Print one JSON object per row on stdout; the table goes to stderr.
    #[arg(long)]
    json: bool,

    /// Pin the bench and its peer processes to two different CPUs. `auto`
    /// pins when at least two CPUs are available.
    #[arg(long, value_enum, default_value_t = Pin::Auto, num_args = 0..=1, default_missing_value = "on")]
    cpu_pin: Pin,

    /// Internal: run the peer side `<what>` of a row (see child.rs).
    #[arg(long, hide = true, num_args = 1.., allow_hyphen_values = true, value_name = "WHAT")]
    serve: Option<Vec<String>>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Pin {
    Auto,
    On,
    Off,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let result = match &args.serve {
        Some(serve) => {
            let (what, rest) = serve.split_first().expect("clap requires one value");
            child::serve(&peers(), what, rest)
                .map_err(|e| Error::new(format!("the {what} peer process stopped: {e}")))
        }
        None => run(&args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("rfaas-fabric-bench: {e}");
            ExitCode::FAILURE
        }
    }
}

fn peers() -> Vec<child::PeerSpec> {
    SUITES
        .iter()
        .flat_map(|s| s.peers.iter().copied())
        .collect()
}

fn run(args: &Args) -> Result<()> {
    let ctx = context(args)?;
    if let Some(filter) = &args.rows {
        rows::check_filter(SUITES, filter)?;
    }
    if let Some(cpu) = ctx.cpu {
        child::pin_current_thread(cpu).context(|| {
            format!("could not pin the bench to CPU {cpu} (--cpu-pin off skips pinning)")
        })?;
    }
    let rounds = args.rounds as usize;
    let mut report = Report::new(args.json, rounds);
    for round in 1..=rounds {
        if rounds > 1 {
            eprintln!("round {round} of {rounds}");
        }
        rows::run(SUITES, args.rows.as_deref(), &ctx, &mut report)?;
    }
    report.finish()
}

fn context(args: &Args) -> Result<Ctx> {
    let providers = args
        .provider
        .iter()
        .map(|p| Provider::parse(p))
        .collect::<Result<Vec<_>>>()?;
    for (flag, sizes) in [("--sizes", &args.sizes), ("--bw-sizes", &args.bw_sizes)] {
        if sizes.contains(&0) {
            return Err(Error::new(format!(
                "{flag} must list sizes of at least 1 byte"
            )));
        }
    }
    let (cpu, peer_cpu) = match args.cpu_pin {
        Pin::Off => (None, None),
        pin => match child::allowed_cpus()?[..] {
            [a, b, ..] => (Some(a), Some(b)),
            _ if pin == Pin::On => {
                return Err(Error::new(
                    "--cpu-pin needs at least two CPUs and this process may use only one",
                ))
            }
            _ => (None, None),
        },
    };
    Ok(Ctx {
        providers,
        sizes: args.sizes.clone(),
        bw_sizes: args.bw_sizes.clone(),
        iters: args.iters,
        warmup: (args.iters / 10).max(1000),
        bw_bytes: args.bw_bytes,
        cpu,
        peer_cpu,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_and_peer_names_are_unique() {
        let mut rows: Vec<&str> = SUITES.iter().flat_map(|s| s.rows).map(|r| r.name).collect();
        let mut peers: Vec<&str> = peers().iter().map(|p| p.name).collect();
        for names in [&mut rows, &mut peers] {
            let n = names.len();
            names.sort_unstable();
            names.dedup();
            assert_eq!(names.len(), n, "duplicate names: {names:?}");
        }
    }

    #[test]
    fn defaults_parse() {
        let args = Args::parse_from(["rfaas-fabric-bench"]);
        let ctx = context(&Args {
            cpu_pin: Pin::Off,
            ..args
        })
        .unwrap();
        assert_eq!(ctx.providers.len(), 2);
        assert_eq!(ctx.sizes, [1, 64, 4096]);
        assert_eq!(ctx.bw_sizes, [1024, 65536, 1048576, 5242880]);
        assert_eq!((ctx.iters, ctx.warmup), (10_000, 1000));
        assert_eq!(ctx.bw_bytes, 256 << 20);
    }

    #[test]
    fn provider_flag_repeats_and_splits() {
        let args = Args::parse_from([
            "rfaas-fabric-bench",
            "--provider",
            "tcp,shm",
            "--provider",
            "verbs:rxe0",
        ]);
        assert_eq!(args.provider, ["tcp", "shm", "verbs:rxe0"]);
    }

    #[test]
    fn serve_takes_the_rest_of_the_line() {
        let args = Args::parse_from([
            "rfaas-fabric-bench",
            "--serve",
            "raw_shm_echo",
            "spin",
            "3",
            "64",
        ]);
        assert_eq!(args.serve.unwrap(), ["raw_shm_echo", "spin", "3", "64"]);
    }
}

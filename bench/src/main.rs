//! `rfaas-bench`: invocation latency, payload bandwidth and cold starts
//! through `rfaas-client` and a real `rfaas-executord` on loopback, a gRPC
//! echo, and in the same run the fabric rows and raw baselines they are
//! judged against; then the overheads and ratios (derived rows) from the
//! best round of each (DESIGN.md, "Performance targets").
//!
//! Needs `rfaas-executord` and `rfaas-worker` next to this binary (`cargo
//! build --release -p rfaas-executor -p rfaas-bench`), or `--executord`,
//! and a C compiler for the example functions. Runs as root (the daemon
//! drops each worker to the user `nobody`).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use rfaas_bench::cli::{self, Common};
use rfaas_bench::error::Context;
use rfaas_bench::rows::Suite;
use rfaas_bench::{baselines, cleanup, derived, fabric_rows, grpc, invoke};

/// Every measuring module, in the order its rows are run and printed.
const SUITES: &[Suite] = &[
    invoke::SUITE,
    fabric_rows::SUITE,
    baselines::SUITE,
    grpc::SUITE,
];

/// Measures rfaas invocations (latency, bandwidth, cold start) through a
/// real rfaas-executord on loopback, next to the fabric, raw baselines and a
/// gRPC echo, in one run.
///
/// Starts its own rfaas-executord (from next to this binary, or
/// --executord) and stops it by pid; run it as root, since the daemon runs
/// the workers as the user `nobody`. Needs a C compiler for the example
/// functions. Prints a table; with --json one JSON object per row.
#[derive(Debug, Parser)]
#[command(version, after_long_help = cli::rows_help(SUITES, derived::ROWS))]
struct Args {
    #[command(flatten)]
    common: Common,

    /// Cold starts measured per provider, after one untimed.
    #[arg(long, default_value_t = 100)]
    cold_iters: usize,

    /// Pre-spawned workers in the daemon's pool.
    #[arg(long, default_value_t = 2)]
    pool_size: u32,

    /// The rfaas-executord binary (default: next to this one).
    #[arg(long)]
    executord: Option<PathBuf>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let invoke = || {
        cleanup::install().context(|| "could not install the signal handlers".to_owned())?;
        Ok(invoke::Settings {
            executord: args.executord.clone(),
            cold_iters: args.cold_iters,
            pool_size: args.pool_size,
        })
    };
    cli::main("rfaas-bench", SUITES, &args.common, invoke, derived::derive)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn row_and_peer_names_are_unique() {
        cli::check_unique_names(SUITES);
    }

    #[test]
    fn defaults_parse() {
        let args = Args::parse_from(["rfaas-bench"]);
        assert_eq!(args.common.sizes, [1, 64, 1024, 4096]);
        assert_eq!(args.common.bw_sizes, [1024, 65536, 1048576, 5242880]);
        assert_eq!((args.cold_iters, args.pool_size), (100, 2));
        assert_eq!(args.executord, None);
    }
}

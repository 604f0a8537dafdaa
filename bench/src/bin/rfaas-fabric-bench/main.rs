//! `rfaas-fabric-bench`: round-trip latency and bandwidth of the fabric
//! providers next to the raw baselines they are judged against (DESIGN.md,
//! "Performance targets"), measured side by side in one run.
//!
//! The rows, the peers, the report and the rest of the harness live in the
//! `rfaas_bench` library (see its Layout); `rfaas-bench` runs the same rows
//! next to the invocation rows.

use std::process::ExitCode;

use clap::Parser;
use rfaas_bench::cli::{self, Common};
use rfaas_bench::rows::Suite;
use rfaas_bench::{baselines, fabric_rows};

/// Every measuring module, in the order its rows are run and printed.
const SUITES: &[Suite] = &[fabric_rows::SUITE, baselines::SUITE];

/// Measures the rfaas fabric providers (round trips, bandwidth) next to the
/// fastest plain programs doing the same on this machine, in one run.
///
/// Prints a table; with --json one JSON object per row.
#[derive(Debug, Parser)]
#[command(version, after_long_help = cli::rows_help(SUITES, &[]))]
struct Args {
    #[command(flatten)]
    common: Common,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let invoke = || Ok(Default::default());
    cli::main("rfaas-fabric-bench", SUITES, &args.common, invoke, |_| {
        Vec::new()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use rfaas_bench::cli::Pin;

    #[test]
    fn row_and_peer_names_are_unique() {
        cli::check_unique_names(SUITES);
    }

    #[test]
    fn defaults_parse() {
        let args = Args::parse_from(["rfaas-fabric-bench"]);
        let common = Common {
            cpu_pin: Pin::Off,
            ..args.common
        };
        let ctx = cli::context(&common, Default::default()).unwrap();
        assert_eq!(ctx.providers.len(), 2);
        assert_eq!(ctx.sizes, [1, 64, 1024, 4096]);
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
        assert_eq!(args.common.provider, ["tcp", "shm", "verbs:rxe0"]);
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
        assert_eq!(
            args.common.serve.unwrap(),
            ["raw_shm_echo", "spin", "3", "64"]
        );
    }
}

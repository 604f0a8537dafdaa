//! `rfaas-bench`: invocation latency, payload bandwidth and cold starts
//! through `rfaas-client` and a real `rfaas-executord` on loopback, a gRPC
//! echo, the accounting service's adds and flushes, and in the same run
//! the fabric rows and raw baselines they are judged against; then the
//! overheads and ratios (derived rows) from the best round of each
//! (DESIGN.md, "Performance targets").
//!
//! With `--manager` it measures the resource manager instead: lease
//! grants through real `rfaas-manager` replicas next to the same grants
//! straight on the database, and how soon a registration reaches every
//! replica (see `manager.rs`).
//!
//! Needs `rfaas-executord` and `rfaas-worker` next to this binary (`cargo
//! build --release -p rfaas-executor -p rfaas-bench`), or `--executord`,
//! `rfaas-manager` and `rfaas-accounting` there too for `hot_noop_billed`
//! and `billing_adds` (`-p rfaas-manager -p rfaas-accounting`), Debian's
//! `postgresql-15` for `billing_flush` and `raw_db_upsert`, and a C
//! compiler for the example functions. Runs as root (the daemon drops each
//! worker to the user `nobody`).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use rfaas_bench::cli::{self, Common};
use rfaas_bench::error::Context;
use rfaas_bench::rows::Suite;
use rfaas_bench::{
    baselines, billing_adds, billing_flush, cleanup, derived, fabric_rows, grpc, invoke, manager,
    meter,
};

/// Every measuring module, in the order its rows are run and printed.
const SUITES: &[Suite] = &[
    invoke::SUITE,
    fabric_rows::SUITE,
    baselines::SUITE,
    grpc::SUITE,
    meter::SUITE,
    billing_adds::SUITE,
    billing_flush::SUITE,
];

/// Measures rfaas invocations (latency, bandwidth, cold start) through a
/// real rfaas-executord on loopback, next to the fabric, raw baselines and a
/// gRPC echo, and the accounting service's fetch-and-adds and flushes next
/// to the fabric's and a plain database loop's, in one run.
///
/// Starts its own rfaas-executord (from next to this binary, or
/// --executord) and stops it by pid; run it as root, since the daemon runs
/// the workers as the user `nobody`. Needs a C compiler for the example
/// functions; the billing rows start rfaas-manager and rfaas-accounting
/// from next to this binary and throwaway PostgreSQL 15 servers. Prints a
/// table; with --json one JSON object per row.
///
/// With --manager it measures the resource manager instead: lease grants
/// through real rfaas-manager replicas (from next to this binary, or
/// --manager-bin) on PostgreSQL and SQLite, next to the same transactions
/// straight on the database, and how soon a registration reaches every
/// replica. --rows, --rounds and --json apply; the invocation flags do not.
#[derive(Debug, Parser)]
#[command(version, after_long_help = help())]
struct Args {
    #[command(flatten)]
    common: Common,

    /// Measure the resource manager (rows lease_grant, lease_grant_paced,
    /// raw_db_grant, node_visible; lease_grant_aged when --rows names it) instead of invocations.
    #[arg(long)]
    manager: bool,

    /// Manager: client threads sending at once, for lease_grant and
    /// raw_db_grant (and the paced row's threads: the largest).
    #[arg(long, value_delimiter = ',', default_value = "1,4,16")]
    concurrency: Vec<u32>,

    /// Manager: replica counts for lease_grant; node_visible runs at the
    /// largest.
    #[arg(long, value_delimiter = ',', default_value = "1,3")]
    replicas: Vec<u32>,

    /// Manager: databases, postgres (a throwaway server through
    /// scripts/pg.sh) and sqlite (one file every replica opens).
    #[arg(long, value_delimiter = ',', default_value = "postgres,sqlite")]
    backend: Vec<String>,

    /// Manager: grant-and-release pairs timed per lease_grant,
    /// lease_grant_paced and raw_db_grant measurement, after a tenth as
    /// many untimed.
    #[arg(long, default_value_t = 2000)]
    grants: usize,

    /// Manager: registrations timed per node_visible measurement.
    #[arg(long, default_value_t = 30)]
    visible_iters: usize,

    /// Manager: every replica's refresh_ms (how often it reloads its whole
    /// view; on SQLite the only way a replica hears of another's changes).
    #[arg(long, default_value_t = 1000)]
    refresh_ms: u64,

    /// Manager: ended leases in lease_grant_aged's database.
    #[arg(long, default_value_t = 10_000_000)]
    ended_leases: u64,

    /// Manager: the rfaas-manager binary (default: next to this one).
    #[arg(long)]
    manager_bin: Option<PathBuf>,

    /// Cold starts measured per provider, after one untimed.
    #[arg(long, default_value_t = 100)]
    cold_iters: usize,

    /// Pre-spawned workers in the daemon's pool.
    #[arg(long, default_value_t = 2)]
    pool_size: u32,

    /// The rfaas-executord binary (default: next to this one).
    #[arg(long)]
    executord: Option<PathBuf>,

    /// Build the example function library the invocation rows ship (needs
    /// a C compiler), print its path and exit: for running the rows later
    /// where there is no compiler (scripts/bench-verbs.sh's VM).
    #[arg(long)]
    build_functions: bool,
}

/// The end of `--help`: every row of both modes.
fn help() -> String {
    let mut out = cli::rows_help(SUITES, derived::ROWS);
    out.push_str("\nWith --manager, these rows instead:\n");
    for (name, what) in manager::ROWS.iter().chain(manager::DERIVED) {
        out.push_str(&format!("  {name:<28} {what}\n"));
    }
    out
}

fn main() -> ExitCode {
    let args = Args::parse();
    if args.build_functions {
        return match invoke::build_functions() {
            Ok(path) => {
                println!("{}", path.display());
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("rfaas-bench: {e}");
                ExitCode::FAILURE
            }
        };
    }
    if args.manager {
        return manager_main(&args);
    }
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

fn manager_main(args: &Args) -> ExitCode {
    let settings = || -> rfaas_bench::error::Result<manager::Settings> {
        Ok(manager::Settings {
            backends: args
                .backend
                .iter()
                .map(|b| manager::parse_backend(b))
                .collect::<rfaas_bench::error::Result<_>>()?,
            replicas: args.replicas.clone(),
            concurrency: args.concurrency.clone(),
            grants: args.grants,
            visible_iters: args.visible_iters,
            refresh_ms: args.refresh_ms,
            manager_bin: args.manager_bin.clone(),
            rows: args.common.rows.clone(),
            ended_leases: args.ended_leases,
            rounds: args.common.rounds as usize,
            json: args.common.json,
        })
    };
    match settings().and_then(|s| manager::run(&s)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("rfaas-bench --manager: {e}");
            ExitCode::FAILURE
        }
    }
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
        assert!(!args.manager);
        assert_eq!(args.concurrency, [1, 4, 16]);
        assert_eq!(args.replicas, [1, 3]);
        assert_eq!(args.backend, ["postgres", "sqlite"]);
    }
}

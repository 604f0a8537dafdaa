//! `rfaas-fleet`: a simulated fleet of node agents against real
//! `rfaas-manager` replicas on PostgreSQL, while clients grant and release
//! leases. See `rfaas_bench::fleet`.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use rfaas_bench::child;
use rfaas_bench::error::Result;
use rfaas_bench::fleet::{self, agents, Settings};
use rfaas_bench::services::sibling;

/// A simulated fleet: node agents in a few processes register and
/// heartbeat through the real API (a node credential each, no executor
/// behind them) against 1 and 3 real rfaas-manager replicas on one
/// throwaway PostgreSQL 15 server with pg_stat_statements, while clients
/// grant and release leases at a steady rate. One `fleet` row per (nodes,
/// replicas) point: database statements and replica CPU per node per
/// minute, grant p99, node_visible p99, how soon a silent node is marked
/// lost, and the nodes lost in a rolling restart of the replicas.
///
/// Needs rfaas-manager next to this binary (or --manager-bin) and Debian's
/// postgresql-15. Prints a table; with --json one JSON object per point on
/// stdout.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// Fleet sizes.
    #[arg(long, value_delimiter = ',', default_value = "100,1000,10000")]
    nodes: Vec<usize>,

    /// Replica counts.
    #[arg(long, value_delimiter = ',', default_value = "1,3")]
    replicas: Vec<u32>,

    /// The measured window of each point, seconds.
    #[arg(long, default_value_t = 60.0)]
    window_s: f64,

    /// Grants per second during the window (each released at once).
    #[arg(long, default_value_t = 20.0)]
    grant_rate: f64,

    /// Client threads granting.
    #[arg(long, default_value_t = 4)]
    grant_threads: usize,

    /// node_visible registrations per point.
    #[arg(long, default_value_t = 20)]
    probes: usize,

    /// Agents silenced per point to time their loss.
    #[arg(long, default_value_t = 3)]
    silent: usize,

    /// Processes the agents run in.
    #[arg(long, default_value_t = 2)]
    agent_procs: usize,

    /// Worker threads of each agent process.
    #[arg(long, default_value_t = 16)]
    agent_threads: usize,

    /// Cores each node lends.
    #[arg(long, default_value_t = 64)]
    node_cores: u32,

    /// The replicas' heartbeat_interval_ms (default: the manager's).
    #[arg(long)]
    heartbeat_interval_ms: Option<u64>,

    /// The replicas' heartbeats_per_s, the rate past which the interval
    /// grows with the fleet (default: the manager's; 0 fixes the interval).
    #[arg(long)]
    heartbeats_per_s: Option<u64>,

    /// The replicas' lost_after_ms (default: the manager's).
    #[arg(long)]
    lost_after_ms: Option<u64>,

    /// The replicas' refresh_ms (default: the manager's).
    #[arg(long)]
    refresh_ms: Option<u64>,

    /// Skip the rolling restart (lost_in_restart is then 0).
    #[arg(long)]
    no_restart: bool,

    /// The rfaas-manager binary (default: next to this one).
    #[arg(long)]
    manager_bin: Option<PathBuf>,

    /// Print one JSON object per point on stdout; the table goes to stderr.
    #[arg(long)]
    json: bool,

    /// Internal: run as the agents' process (`--serve fleet-agents ...`).
    #[arg(long, hide = true, num_args = 1.., allow_hyphen_values = true)]
    serve: Option<Vec<String>>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let result = match &args.serve {
        Some(serve) => child::serve(&[agents::PEER], &serve[0], &serve[1..]),
        None => settings(&args).and_then(|s| fleet::run(&s)),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("rfaas-fleet: {e}");
            ExitCode::FAILURE
        }
    }
}

fn settings(args: &Args) -> Result<Settings> {
    if !args.window_s.is_finite() || args.window_s <= 0.0 {
        return Err(rfaas_bench::error::Error::new(format!(
            "--window-s {}: give a positive number of seconds",
            args.window_s
        )));
    }
    Ok(Settings {
        nodes: args.nodes.clone(),
        replicas: args.replicas.clone(),
        window: Duration::from_secs_f64(args.window_s),
        grant_rate: args.grant_rate,
        grant_threads: args.grant_threads,
        probes: args.probes,
        silent: args.silent,
        agent_procs: args.agent_procs,
        agent_threads: args.agent_threads,
        node_cores: args.node_cores,
        heartbeat_interval_ms: args.heartbeat_interval_ms,
        heartbeats_per_s: args.heartbeats_per_s,
        lost_after_ms: args.lost_after_ms,
        refresh_ms: args.refresh_ms,
        no_restart: args.no_restart,
        manager_bin: match &args.manager_bin {
            Some(b) => b.clone(),
            None => sibling("rfaas-manager")?,
        },
        json: args.json,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_parse() {
        let args = Args::parse_from(["rfaas-fleet"]);
        assert_eq!(args.nodes, [100, 1000, 10000]);
        assert_eq!(args.replicas, [1, 3]);
        assert_eq!(args.window_s, 60.0);
        assert!(args.serve.is_none());
        let args = Args::parse_from(["rfaas-fleet", "--serve", "fleet-agents", "f", "2"]);
        assert_eq!(args.serve.unwrap(), ["fleet-agents", "f", "2"]);
    }
}

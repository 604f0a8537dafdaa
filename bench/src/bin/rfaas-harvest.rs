//! `rfaas-harvest`: replays a seeded Slurm job stream on a loopback Slurm
//! cluster without rfaas and with it (its SPANK plugin, an executor daemon
//! per node, a manager, offloading clients), and reports the idle capacity
//! rfaas was offered, how soon job ends were lent again, what the plugin
//! costs a job's start, and the calls served meanwhile. See
//! `rfaas_bench::harvest`.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use rfaas_bench::error::{Context, Error, Result};
use rfaas_bench::harvest::clients::ClientSettings;
use rfaas_bench::harvest::site::Binaries;
use rfaas_bench::harvest::stream::StreamSpec;
use rfaas_bench::harvest::{self, Settings};

/// Harvesting a Slurm cluster's idle cores: a seeded job stream replayed
/// on a loopback Slurm cluster (scripts/slurm-cluster.sh) without rfaas,
/// then with rfaas_spank.so, an rfaas-executord per node, a manager and
/// offloading clients; one `harvest` row per run.
///
/// Runs as root (slurmd starts the jobs, the executor daemons run their
/// workers as `nobody`); needs Slurm (the script installs it), a C
/// compiler (the function the clients call), and rfaas-executord (with
/// rfaas-worker), rfaas-manager and librfaas_spank.so next to this binary
/// or named by the flags. Prints a table; with --json one JSON object per
/// run on stdout.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// The stream's seed; printed at the start, this flag repeats a stream
    /// (default: a new one).
    #[arg(long)]
    seed: Option<u64>,

    /// Jobs in the stream [default: 300; 30 with --quick].
    #[arg(long)]
    jobs: Option<usize>,

    /// A short run: 30 jobs of at most 3 s (unless --jobs or
    /// --max-seconds say otherwise).
    #[arg(long)]
    quick: bool,

    /// Slurm nodes.
    #[arg(long, default_value_t = 4)]
    nodes: u32,

    /// CPUs of each node (Slurm is told; the jobs only sleep).
    #[arg(long, default_value_t = 4)]
    cpus: u32,

    /// Shortest job, seconds (lengths are log-uniform).
    #[arg(long, default_value_t = 0.5)]
    min_seconds: f64,

    /// Longest job, seconds.
    #[arg(long)]
    max_seconds: Option<f64>,

    /// Core-seconds the jobs ask for per second, as a share of the
    /// cluster's cores: sets the Poisson arrival rate.
    #[arg(long, default_value_t = 0.6)]
    load: f64,

    /// The plugin's grace (plugstack.conf's grace=), seconds.
    #[arg(long, default_value_t = 30)]
    grace: u32,

    /// Offloading clients calling `echo` during the run with the plugin.
    #[arg(long, default_value_t = 2)]
    clients: usize,

    /// Each client's pause between calls, ms.
    #[arg(long, default_value_t = 5)]
    client_pause_ms: u64,

    /// Payload of each call, bytes.
    #[arg(long, default_value_t = 1024)]
    call_bytes: usize,

    /// Make both runs this many times (the same stream each time).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
    rounds: u64,

    /// How often Slurm (sinfo) is sampled, ms.
    #[arg(long, default_value_t = 100)]
    slurm_sample_ms: u64,

    /// How often the manager (GET /v1/nodes) is sampled, ms.
    #[arg(long, default_value_t = 25)]
    manager_sample_ms: u64,

    /// Print one JSON object per run on stdout; the table goes to stderr.
    #[arg(long)]
    json: bool,

    /// The rfaas-executord binary (default: next to this one).
    #[arg(long)]
    executord: Option<PathBuf>,

    /// The rfaas-manager binary (default: next to this one).
    #[arg(long)]
    manager_bin: Option<PathBuf>,

    /// The SPANK plugin, librfaas_spank.so (default: next to this one).
    #[arg(long)]
    plugin: Option<PathBuf>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    match settings(&args).and_then(|s| harvest::run(&s)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("rfaas-harvest: {e}");
            ExitCode::FAILURE
        }
    }
}

fn settings(args: &Args) -> Result<Settings> {
    let sibling = |name: &str| -> Result<PathBuf> {
        Ok(std::env::current_exe()
            .context(|| "could not find the bench's own executable".to_owned())?
            .with_file_name(name))
    };
    let jobs = args.jobs.unwrap_or(if args.quick { 30 } else { 300 });
    let max_seconds = args
        .max_seconds
        .unwrap_or(if args.quick { 3.0 } else { 10.0 });
    let library = rfaas_bench::invoke::build_functions()?;
    let library: Arc<[u8]> = std::fs::read(&library)
        .context(|| format!("could not read {}", library.display()))?
        .into();
    if args.slurm_sample_ms == 0 || args.manager_sample_ms == 0 {
        return Err(Error::new(
            "--slurm-sample-ms and --manager-sample-ms must be at least 1",
        ));
    }
    if args.call_bytes == 0 || args.call_bytes > 1 << 20 {
        return Err(Error::new(format!(
            "--call-bytes {}: give 1 to 1048576",
            args.call_bytes
        )));
    }
    Ok(Settings {
        stream: StreamSpec {
            seed: args.seed.unwrap_or_else(|| fastrand::u64(..1 << 40)),
            jobs,
            nodes: args.nodes,
            cpus: args.cpus,
            min_seconds: args.min_seconds,
            max_seconds,
            load: args.load,
        },
        grace_s: args.grace,
        clients: ClientSettings {
            count: args.clients,
            pause: Duration::from_millis(args.client_pause_ms),
            bytes: args.call_bytes,
            library,
        },
        rounds: args.rounds as usize,
        json: args.json,
        binaries: Binaries {
            executord: args
                .executord
                .clone()
                .map_or_else(|| sibling("rfaas-executord"), Ok)?,
            manager: args
                .manager_bin
                .clone()
                .map_or_else(|| sibling("rfaas-manager"), Ok)?,
            plugin: args
                .plugin
                .clone()
                .map_or_else(|| sibling("librfaas_spank.so"), Ok)?,
        },
        slurm_interval: Duration::from_millis(args.slurm_sample_ms),
        manager_interval: Duration::from_millis(args.manager_sample_ms),
        settle: Duration::from_secs(3),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_parse() {
        let args = Args::parse_from(["rfaas-harvest"]);
        assert_eq!(
            (args.jobs, args.nodes, args.cpus, args.grace),
            (None, 4, 4, 30)
        );
        assert_eq!((args.clients, args.rounds), (2, 1));
        assert_eq!(args.seed, None);
        let args = Args::parse_from(["rfaas-harvest", "--quick", "--seed", "5"]);
        assert!(args.quick);
        assert_eq!(args.seed, Some(5));
    }
}

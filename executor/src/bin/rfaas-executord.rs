//! `rfaas-executord`: the rfaas node daemon. Reads one TOML file
//! (`--config`), lets flags override it, binds, prints one line
//! `rfaas-executord ready control=<addr> local=<path>` to stdout, then logs
//! to stderr and serves until SIGTERM or SIGINT. With `--check-config` it
//! prints the settings it would run with and where each came from, checks
//! the files it would read, and exits (0: it would start; 1: why not).

use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;
use rfaas_executor::daemon::{Config, Daemon, Sandbox, Settings};
use rfaas_proto::check;
use rfaas_proto::files::ConfigDir;

/// The rfaas node daemon: validates lease tokens, runs and supervises
/// rfaas-worker processes on this node's configured cores.
///
/// Run it as root: it starts each worker as the lease's user. Not as root,
/// it can run workers only as its own user and refuses leases for anyone
/// else. Once it listens it prints one line on stdout, `rfaas-executord
/// ready control=<address> local=<socket>`, then logs to stderr until
/// SIGTERM or SIGINT, which stop every worker. Each flag overrides the key
/// of the same name in --config (with `_` for `-`); docs/executor.md
/// describes them all.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// The configuration file (TOML) [default: executord.toml in the
    /// configuration directory, if it exists; without one every key takes
    /// its default, and rfaas-executord.example.toml lists them].
    #[arg(long, short)]
    config: Option<PathBuf>,
    /// The configuration directory: executord.toml, lease-keys.pub and
    /// node.credential are looked for there [env: RFAAS_CONFIG_DIR]
    /// [default: /etc/rfaas].
    #[arg(long, value_name = "DIR")]
    config_dir: Option<PathBuf>,
    /// This node's name, as lease tokens name it [default: slurmd -C's
    /// NodeName, else the short host name].
    #[arg(long)]
    node_name: Option<String>,
    /// TCP address clients allocate on; port 0 picks a free one, which the
    /// ready line says [default: 0.0.0.0:7100].
    #[arg(long, value_name = "HOST:PORT")]
    control_listen: Option<String>,
    /// Address workers listen on for the tcp provider: this node's address
    /// on the network clients reach it by [default: the local address of
    /// the route to the first manager; without [manager], 127.0.0.1, this
    /// machine only].
    #[arg(long, value_name = "HOST")]
    fabric_host: Option<String>,
    /// Fabric providers served, comma-separated: tcp, shm (clients on this
    /// node), verbs:<device> [default: tcp,shm].
    #[arg(long, value_delimiter = ',')]
    providers: Option<Vec<String>>,
    /// CPUs allocations may use, as a cpulist such as 0-3,8; keep the cores
    /// the system needs out of it [default: the online CPUs, as many as
    /// slurmd -C counts, less reserve_cpus].
    #[arg(long, value_name = "CPULIST")]
    cpus: Option<String>,
    /// Pin each lane to one granted CPU; with false, --cpus only bounds how
    /// many lanes run [default: true].
    #[arg(long)]
    pin: Option<bool>,
    /// Memory all allocations together may hold, MiB [default: slurmd -C's
    /// RealMemory, else the machine's, less reserve_memory_mib].
    #[arg(long)]
    memory_mib: Option<u32>,
    /// A file of public keys lease tokens are checked with: the managers'
    /// (`rfaas-token keygen` makes a pair). Give it again for more files
    /// [default: lease-keys.pub in the configuration directory].
    #[arg(long = "lease-keys", value_name = "FILE")]
    lease_keys: Option<Vec<PathBuf>>,
    /// Unix socket for this node's own tools: status, drain, resume
    /// [default: /run/rfaas/executord.sock].
    #[arg(long, value_name = "PATH")]
    local_socket: Option<PathBuf>,
    /// Where per-allocation directories are made [default:
    /// /run/rfaas/workers].
    #[arg(long, value_name = "DIR")]
    runtime_dir: Option<PathBuf>,
    /// Idle workers kept started ahead of allocations [default: 2].
    #[arg(long, value_name = "N")]
    pool_size: Option<u32>,
    /// The rfaas-worker binary [default: the one next to rfaas-executord].
    #[arg(long, value_name = "FILE")]
    worker_path: Option<PathBuf>,
    /// How workers are isolated [default: none].
    #[arg(long, value_enum)]
    sandbox: Option<Sandbox>,
    /// How much the daemon logs on stderr: error, warn, info, debug or
    /// trace [default: info].
    #[arg(long, value_name = "LEVEL")]
    log_level: Option<String>,
    /// Load the configuration as the daemon would, work out every value
    /// the host supplies, print each setting and where it came from
    /// (file, flag, default, or discovered: slurmd -C, hostname, route,
    /// kernel), check the files it would read, and exit: 0 when it would
    /// start, 1 with the reasons when not. Binds nothing, connects to no
    /// manager, starts no worker.
    #[arg(long)]
    check_config: bool,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if args.check_config {
        std::process::exit(check_config(&args));
    }
    let (_, _, settings) = configure(&args)?;
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_max_level(settings.log_level)
        .with_ansi(false)
        .init();
    let source = |key| {
        settings
            .sources
            .get(key)
            .map_or("configured".into(), |s| s.to_string())
    };
    tracing::info!(
        node = %settings.node_name,
        node_source = %source("node_name"),
        fabric_host = %settings.fabric_host,
        fabric_host_source = %source("fabric_host"),
        cpus = %rfaas_executor::daemon::config::format_cpulist(&settings.cpus),
        cpus_source = %source("cpus"),
        pin = settings.pin,
        memory_mib = settings.memory_mib,
        memory_source = %source("memory_mib"),
        providers = ?settings.providers,
        pool_size = settings.pool_size,
        sandbox = ?settings.sandbox,
        "starting"
    );
    for note in &settings.notes {
        tracing::warn!("{note}");
    }
    let daemon = Daemon::bind(settings).context("rfaas-executord cannot start")?;
    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "rfaas-executord ready control={} local={}",
        daemon.control_addr(),
        daemon.local_socket().display()
    )
    .and_then(|()| out.flush())
    .context("cannot write the ready line to stdout")?;
    drop(out);
    daemon.run().context("rfaas-executord failed")?;
    Ok(())
}

/// The file as read (for where values came from), the flags given, and
/// the settings the daemon runs with.
fn configure(args: &Args) -> anyhow::Result<(Config, Vec<&'static str>, Settings)> {
    let dir = ConfigDir::resolve(args.config_dir.as_deref());
    let file = Config::load_or_default(args.config.as_deref(), &dir)?;
    let mut config = file.clone();
    let mut flags = Vec::new();
    rfaas_proto::flag_overrides!(
        args, config, flags;
        node_name,
        control_listen,
        fabric_host,
        providers,
        cpus,
        pin,
        memory_mib,
        lease_keys,
        local_socket,
        runtime_dir,
        pool_size,
        worker_path,
        sandbox,
        log_level
    );
    let settings = config.resolve_in(&dir)?;
    Ok((file, flags, settings))
}

/// `--check-config`: prints the report, returns the exit status.
fn check_config(args: &Args) -> i32 {
    let loaded = configure(args).map_err(|e| format!("{e:#}"));
    check::run(
        "rfaas-executord",
        loaded,
        |s: &Settings, key: &str| s.sources.get(key).map(ToString::to_string),
        |s: &Settings| {
            for note in &s.notes {
                eprintln!("warning: {note}");
            }
            rfaas_executor::daemon::check_files(s)
        },
    )
}

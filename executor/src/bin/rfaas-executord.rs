//! `rfaas-executord`: the rfaas node daemon. Reads one TOML file
//! (`--config`), lets flags override it, binds, prints one line
//! `rfaas-executord ready control=<addr> local=<path>` to stdout, then logs
//! to stderr and serves until SIGTERM or SIGINT.

use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;
use rfaas_executor::daemon::{Config, Daemon, Sandbox};

/// The rfaas node daemon: validates lease tokens, runs and supervises
/// rfaas-worker processes on this node's configured cores.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// The configuration file (see rfaas-executord.example.toml); without
    /// it every key takes its default.
    #[arg(long, short)]
    config: Option<PathBuf>,
    /// This node's name as lease tokens name it.
    #[arg(long)]
    node_name: Option<String>,
    /// TCP address of the control listener, e.g. 0.0.0.0:7100.
    #[arg(long)]
    control_listen: Option<String>,
    /// Host workers listen on for the tcp provider.
    #[arg(long)]
    fabric_host: Option<String>,
    /// Fabric providers served, comma-separated.
    #[arg(long, value_delimiter = ',')]
    providers: Option<Vec<String>>,
    /// CPUs granted to allocations, as a cpulist ("0-3,8").
    #[arg(long)]
    cpus: Option<String>,
    /// Whether lanes are pinned to the granted CPUs.
    #[arg(long)]
    pin: Option<bool>,
    /// Memory granted to allocations, MiB.
    #[arg(long)]
    memory_mib: Option<u32>,
    /// The cluster secret's file.
    #[arg(long)]
    secret_file: Option<PathBuf>,
    /// The node tools' unix socket.
    #[arg(long)]
    local_socket: Option<PathBuf>,
    /// Where per-allocation directories are made.
    #[arg(long)]
    runtime_dir: Option<PathBuf>,
    /// Pre-spawned idle workers.
    #[arg(long)]
    pool_size: Option<u32>,
    /// The rfaas-worker binary.
    #[arg(long)]
    worker_path: Option<PathBuf>,
    /// Worker isolation.
    #[arg(long, value_enum)]
    sandbox: Option<Sandbox>,
    /// error, warn, info, debug or trace.
    #[arg(long)]
    log_level: Option<String>,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let mut config = match &args.config {
        Some(path) => Config::load(path)?,
        None => Config::default(),
    };
    macro_rules! flag {
        ($($field:ident),*) => {
            $(if let Some(v) = args.$field.clone() { config.$field = Some(v); })*
        };
    }
    flag!(
        node_name,
        control_listen,
        fabric_host,
        providers,
        cpus,
        pin,
        memory_mib,
        secret_file,
        local_socket,
        runtime_dir,
        pool_size,
        worker_path,
        sandbox,
        log_level
    );
    let settings = config.resolve()?;
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_max_level(settings.log_level)
        .with_ansi(false)
        .init();
    tracing::info!(
        node = %settings.node_name,
        cpus = %rfaas_executor::daemon::config::format_cpulist(&settings.cpus),
        pin = settings.pin,
        memory_mib = settings.memory_mib,
        providers = ?settings.providers,
        pool_size = settings.pool_size,
        sandbox = ?settings.sandbox,
        "starting"
    );
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

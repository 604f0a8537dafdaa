//! `rfaas-accounting`: one accounting instance.

use std::path::PathBuf;

use clap::Parser;
use rfaas_accounting::config::FileConfig;
use rfaas_proto::check;
use rfaas_proto::files::{ConfigDir, ACCOUNTING_TOML};
use rfaas_service::config;

/// Serve an rfaas accounting instance: executor daemons add their leases'
/// usage into its counter region over the fabric; it flushes the totals to
/// the manager's database.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// The configuration file (TOML). Without this flag, accounting.toml in
    /// the configuration directory is read if it exists.
    #[arg(long, short)]
    config: Option<PathBuf>,
    /// The configuration directory: accounting.toml and billing.toml are
    /// looked for there [env: RFAAS_CONFIG_DIR] [default: /etc/rfaas].
    #[arg(long, value_name = "DIR")]
    config_dir: Option<PathBuf>,
    /// The instance's name (overrides `name`).
    #[arg(long)]
    name: Option<String>,
    /// The database: sqlite:///path/file.db or postgres://user@host:port/db
    /// (overrides `database`). A password here is refused: every user of
    /// the host reads command lines; it comes from
    /// `database_password_file`.
    #[arg(long)]
    database: Option<String>,
    /// The counter region's file (overrides `region_file`).
    #[arg(long)]
    region_file: Option<PathBuf>,
    /// Slots in the region (overrides `slots`).
    #[arg(long)]
    slots: Option<u32>,
    /// The fabric provider: tcp, shm or verbs:<device> (overrides `provider`).
    #[arg(long)]
    provider: Option<String>,
    /// The fabric address to listen on (overrides `listen`).
    #[arg(long)]
    listen: Option<String>,
    /// The fabric address to advertise (overrides `advertise`).
    #[arg(long)]
    advertise: Option<String>,
    /// host:port of /metrics and /healthz (overrides `metrics_listen`).
    #[arg(long)]
    metrics_listen: Option<String>,
    /// The flush period, ms (overrides `flush_interval_ms`).
    #[arg(long)]
    flush_interval_ms: Option<u64>,
    /// The rates file (overrides `billing_config`).
    #[arg(long)]
    billing_config: Option<PathBuf>,
    /// The manager's public key file, which checks executor daemons'
    /// accounting tickets; repeat for several (overrides `lease_keys`)
    /// [default: lease-keys.pub in the configuration directory].
    #[arg(long = "lease-keys", value_name = "FILE")]
    lease_keys: Option<Vec<PathBuf>>,
    /// Load the configuration as the service would, print each setting
    /// and where it came from (file, flag, default), check the files it
    /// would read (billing configuration, the manager's public keys), and
    /// exit: 0 when it would start, 1 with the reasons when not. Opens no
    /// database and binds nothing.
    #[arg(long)]
    check_config: bool,
    /// Log more (-v: debug).
    #[arg(long, short, action = clap::ArgAction::Count)]
    verbose: u8,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    config::init_logging(args.verbose);
    if let Some(url) = &args.database {
        rfaas_service::db::refuse_password_in_argument(url, "--database")
            .map_err(anyhow::Error::msg)?;
    }
    if args.check_config {
        std::process::exit(check_config(&args));
    }
    let settings = configure(&args)?.2;
    // Every accepted daemon holds a connection and a completion queue (a
    // few descriptors each).
    let _ = rfaas_service::limits::raise_descriptor_limit();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let running = rfaas_accounting::service::start(settings).await?;
        // The line tests and scripts wait for.
        println!(
            "rfaas-accounting listening on {} metrics {}",
            running.fabric_addr, running.metrics_addr
        );
        let status = format!("serving on {}", running.fabric_addr);
        if let Err(e) = rfaas_proto::notify::ready(&status) {
            tracing::warn!(error = %e, "cannot tell systemd the service is ready (NOTIFY_SOCKET)");
        }
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
        tracing::info!("stopping");
        let _ = rfaas_proto::notify::stopping();
        running.stop().await
    })
}

/// The file as read, the flags given, and the settings the service runs
/// with.
fn configure(
    args: &Args,
) -> anyhow::Result<(
    FileConfig,
    Vec<&'static str>,
    rfaas_accounting::config::Settings,
)> {
    let dir = ConfigDir::resolve(args.config_dir.as_deref());
    let read: FileConfig = config::load_or_default(args.config.as_deref(), &dir, ACCOUNTING_TOML)?;
    let mut file = read.clone();
    let mut flags = Vec::new();
    rfaas_proto::flag_overrides!(
        args, file, flags;
        name,
        database,
        region_file,
        slots,
        provider,
        listen,
        advertise,
        metrics_listen,
        flush_interval_ms,
        billing_config,
        lease_keys
    );
    Ok((read, flags, file.settings(&dir)?))
}

/// `--check-config`: prints the report, returns the exit status.
fn check_config(args: &Args) -> i32 {
    let loaded = configure(args).map_err(|e| format!("{e:#}"));
    check::run(
        "rfaas-accounting",
        loaded,
        |_, _| None,
        rfaas_accounting::service::check_files,
    )
}

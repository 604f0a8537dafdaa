//! `rfaas-accounting`: one accounting instance.

use std::path::PathBuf;

use clap::Parser;
use rfaas_accounting::config::FileConfig;
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
    let dir = ConfigDir::resolve(args.config_dir.as_deref());
    let mut file: FileConfig =
        config::load_or_default(args.config.as_deref(), &dir, ACCOUNTING_TOML)?;
    macro_rules! overrides {
        ($($field:ident),*) => {
            $(if args.$field.is_some() {
                file.$field = args.$field;
            })*
        };
    }
    overrides!(
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
    let settings = file.settings(&dir)?;
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
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
        tracing::info!("stopping");
        running.stop().await
    })
}

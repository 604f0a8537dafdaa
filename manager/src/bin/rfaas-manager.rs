//! `rfaas-manager`: one replica of the rfaas resource manager.

use std::path::PathBuf;

use clap::Parser;
use rfaas_manager::config::FileConfig;
use rfaas_proto::files::{ConfigDir, MANAGER_TOML};
use rfaas_service::config;

/// Serve rfaas's resource manager: nodes register here, jobs lease cores
/// here. Run several replicas on one PostgreSQL database for availability.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// The configuration file (TOML). Without this flag, manager.toml in
    /// the configuration directory is read if it exists.
    #[arg(long, short)]
    config: Option<PathBuf>,
    /// The configuration directory: manager.toml, admin.token and
    /// lease-key.secret are looked for there [env: RFAAS_CONFIG_DIR]
    /// [default: /etc/rfaas].
    #[arg(long, value_name = "DIR")]
    config_dir: Option<PathBuf>,
    /// Listen on this host:port (overrides `listen`).
    #[arg(long)]
    listen: Option<String>,
    /// The database: sqlite:///path/file.db or postgres://user@host:port/db
    /// (overrides `database`).
    #[arg(long)]
    database: Option<String>,
    /// The admin token's file (overrides `admin_token_file`).
    #[arg(long)]
    admin_token_file: Option<PathBuf>,
    /// The lease signing key's file (overrides `lease_key_file`).
    #[arg(long)]
    lease_key_file: Option<PathBuf>,
    /// Log more (-v: debug).
    #[arg(long, short, action = clap::ArgAction::Count)]
    verbose: u8,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    config::init_logging(args.verbose);
    let dir = ConfigDir::resolve(args.config_dir.as_deref());
    let mut file: FileConfig = config::load_or_default(args.config.as_deref(), &dir, MANAGER_TOML)?;
    if args.listen.is_some() {
        file.listen = args.listen;
    }
    if args.database.is_some() {
        file.database = args.database;
    }
    if args.admin_token_file.is_some() {
        file.admin_token_file = args.admin_token_file;
    }
    if args.lease_key_file.is_some() {
        file.lease_key_file = args.lease_key_file;
    }
    let settings = file.settings(&dir)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let running = rfaas_manager::start(settings).await?;
        // The line tests and scripts wait for.
        println!("rfaas-manager listening on {}", running.addr);
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
        tracing::info!("stopping");
        running.stop().await
    })
}

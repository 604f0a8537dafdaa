//! `rfaas-manager`: one replica of the rfaas resource manager.

use std::path::PathBuf;

use clap::{Parser, Subcommand};
use rfaas_manager::config::FileConfig;
use rfaas_proto::check;
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
    /// (overrides `database`). A password here is refused: every user of
    /// the host reads command lines; it comes from
    /// `database_password_file`.
    #[arg(long)]
    database: Option<String>,
    /// The admin token's file (overrides `admin_token_file`).
    #[arg(long)]
    admin_token_file: Option<PathBuf>,
    /// The lease signing key's file (overrides `lease_key_file`).
    #[arg(long)]
    lease_key_file: Option<PathBuf>,
    /// The HTTPS certificate chain, PEM (overrides `tls_cert`); reread on
    /// SIGHUP.
    #[arg(long, value_name = "FILE")]
    tls_cert: Option<PathBuf>,
    /// The HTTPS certificate's key, PEM (overrides `tls_key`).
    #[arg(long, value_name = "FILE")]
    tls_key: Option<PathBuf>,
    /// Load the configuration as a replica would, print each setting and
    /// where it came from (file, flag, default), check the files it would
    /// read (admin token, lease signing key, HTTPS certificate), and exit:
    /// 0 when it would start, 1 with the reasons when not. Opens no
    /// database and binds nothing.
    #[arg(long)]
    check_config: bool,
    /// Log more (-v: debug).
    #[arg(long, short, action = clap::ArgAction::Count, global = true)]
    verbose: u8,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Bring the database's schema up to date and exit (a replica does it
    /// at start too). The accounting service and rfaas-billing never
    /// migrate: they refuse a schema this does not leave current.
    Migrate,
    /// Purge ended leases older than [retention] ended_lease_days now, as
    /// the replicas do every interval_s, their usage kept per day for
    /// reports; prints how many rows went. Safe next to running replicas.
    Purge {
        /// Purge leases that ended this many days ago or earlier instead
        /// (0: every ended lease).
        #[arg(long)]
        ended_before_days: Option<u64>,
    },
    /// Print the PostgreSQL script that creates the manager's, the
    /// accounting service's and reports' database roles and grants each
    /// what it needs; run it with psql as a superuser before the first
    /// migrate and after each.
    DbRoles {
        /// The manager's role: owns and migrates the schema.
        #[arg(long, default_value = "rfaas_manager")]
        manager_role: String,
        /// The accounting service's role.
        #[arg(long, default_value = "rfaas_accounting")]
        accounting_role: String,
        /// rfaas-billing's role for reports.
        #[arg(long, default_value = "rfaas_report")]
        report_role: String,
    },
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    config::init_logging(args.verbose);
    if let Some(Command::DbRoles {
        manager_role,
        accounting_role,
        report_role,
    }) = &args.command
    {
        let roles = rfaas_service::schema::Roles {
            manager: manager_role.clone(),
            accounting: accounting_role.clone(),
            report: report_role.clone(),
        };
        print!(
            "{}",
            rfaas_service::schema::roles_sql(&roles).map_err(anyhow::Error::msg)?
        );
        return Ok(());
    }
    if let Some(url) = &args.database {
        rfaas_service::db::refuse_password_in_argument(url, "--database")
            .map_err(anyhow::Error::msg)?;
    }
    if args.check_config {
        std::process::exit(check_config(&args));
    }
    let settings = configure(&args)?.2;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    if let Some(Command::Migrate) = args.command {
        return runtime.block_on(rfaas_manager::migrate(&settings));
    }
    if let Some(Command::Purge { ended_before_days }) = args.command {
        let p = runtime.block_on(rfaas_manager::purge(&settings, ended_before_days))?;
        println!(
            "purged {} ended leases, {} usage rows, {} usage snapshots",
            p.leases, p.usage, p.snapshots
        );
        if p.busy {
            println!("another replica was purging; it purges the rest");
        }
        return Ok(());
    }
    runtime.block_on(async {
        let running = rfaas_manager::start(settings).await?;
        // The line tests and scripts wait for.
        println!("rfaas-manager listening on {}", running.addr);
        if let Err(e) = rfaas_proto::notify::ready(&format!("serving on {}", running.addr)) {
            tracing::warn!(error = %e, "cannot tell systemd the manager is ready (NOTIFY_SOCKET)");
        }
        use tokio::signal::unix::{signal, SignalKind};
        let mut term = signal(SignalKind::terminate())?;
        let mut hup = signal(SignalKind::hangup())?;
        loop {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => break,
                _ = term.recv() => break,
                _ = hup.recv() => match running.tls.reload() {
                    Ok(()) => tracing::info!(https = running.tls.enabled(), "SIGHUP: certificate reloaded"),
                    Err(e) => tracing::error!(error = %e, "SIGHUP: certificate not reloaded; the old one stays"),
                },
            }
        }
        tracing::info!("stopping");
        let _ = rfaas_proto::notify::stopping();
        running.stop().await
    })
}

/// The file as read, the flags given, and the settings a replica runs with.
fn configure(
    args: &Args,
) -> anyhow::Result<(
    FileConfig,
    Vec<&'static str>,
    rfaas_manager::config::Settings,
)> {
    let dir = ConfigDir::resolve(args.config_dir.as_deref());
    let read: FileConfig = config::load_or_default(args.config.as_deref(), &dir, MANAGER_TOML)?;
    let mut file = read.clone();
    let mut flags = Vec::new();
    rfaas_proto::flag_overrides!(
        args, file, flags;
        listen,
        database,
        admin_token_file,
        lease_key_file,
        tls_cert,
        tls_key
    );
    if flags.contains(&"tls_cert") {
        flags.push("http.tls");
    }
    Ok((read, flags, file.settings(&dir)?))
}

/// `--check-config`: prints the report, returns the exit status.
fn check_config(args: &Args) -> i32 {
    let loaded = configure(args).map_err(|e| format!("{e:#}"));
    check::run(
        "rfaas-manager",
        loaded,
        |_, _| None,
        rfaas_manager::check_files,
    )
}

//! Starting and stopping the service: the order of [`start`] is the order
//! in which a crash leaves things safe.
//!
//! 1. The billing configuration, the manager's public keys (which check
//!    the daemons' accounting tickets) and the metrics listener (bad
//!    configuration fails before anything else happens).
//! 2. The database: connect and bring the schema up to date, waiting
//!    while it is unreachable (the service is useless without it, and
//!    starts fine before it).
//! 3. The region file, mapped and registered on the fabric; the fabric
//!    listener bound (connections wait in its backlog).
//! 4. A region made new while the database still counts leases in this
//!    instance's slots (the file was lost, say on tmpfs after a reboot) is
//!    seeded with their stored totals before anyone can add, so their
//!    counters keep growing from there.
//! 5. The instance's row (`accounting_instances`), its `billing_slots`
//!    rows, and the budgets of the billing configuration.
//! 6. The flusher and the listener thread.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use rfaas_fabric::Fabric;
use rfaas_proto::files::ConfigDir;
use rfaas_service::db::{self, Backend, DbError};
use rfaas_tls::keys::read_lease_keys;
use sqlx::AnyPool;

use crate::config::Settings;
use crate::credentials::Verifier;
use crate::flusher::{FlushConfig, Flusher};
use crate::ledger::Ledger;
use crate::listener::{self, ListenerParts};
use crate::metrics::{self, Health, Metrics};
use crate::rates::{BillingConfig, Rates, RatesError};
use crate::region::Region;
use crate::store::{self, Instance};

/// Database connections the service keeps.
const DB_CONNECTIONS: u32 = 4;

/// A running service.
#[derive(Debug)]
pub struct Running {
    /// The fabric address it advertises (what daemons connect to).
    pub fabric_addr: String,
    /// Where `/metrics` and `/healthz` are served.
    pub metrics_addr: SocketAddr,
    /// The region's id.
    pub region_id: u64,
    /// Metrics.
    pub metrics: Arc<Metrics>,
    stop: tokio::sync::watch::Sender<bool>,
    stop_listener: Arc<AtomicBool>,
    listener: Option<std::thread::JoinHandle<()>>,
    flusher: tokio::task::JoinHandle<()>,
    http: tokio::task::JoinHandle<std::io::Result<()>>,
    // Dropped last: the listener and flusher use them.
    _region: Arc<Region>,
    _domain: Arc<rfaas_fabric::Domain>,
    _fabric: Arc<Fabric>,
}

impl Running {
    /// Stops: drops every connection, flushes once more, stops serving
    /// metrics.
    pub async fn stop(mut self) -> anyhow::Result<()> {
        self.stop_listener.store(true, Ordering::Relaxed);
        if let Some(t) = self.listener.take() {
            tokio::task::spawn_blocking(move || t.join())
                .await
                .context("the listener thread")?
                .map_err(|_| anyhow::anyhow!("the listener thread panicked"))?;
        }
        let _ = self.stop.send(true);
        (&mut self.flusher).await.context("the flusher task")?;
        (&mut self.http).await.context("the metrics server")??;
        Ok(())
    }
}

/// The rates and budgets of the billing configuration at `path`; a
/// missing file prices everything at 0, with a warning (usage is still
/// counted, only spend stays 0).
fn load_billing(
    path: &std::path::Path,
    dir: &ConfigDir,
) -> anyhow::Result<(Rates, BTreeMap<String, f64>)> {
    let hint = dir.hint(&["--billing-config", "billing_config in accounting.toml"]);
    match BillingConfig::load(path, &hint) {
        Ok(c) => Ok((c.rates, c.budgets)),
        Err(RatesError::Read { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
            tracing::warn!(
                path = %path.display(),
                "no billing configuration: every rate is 0, so account spend stays 0 (usage is still counted); write one to price usage"
            );
            let zero = Rates {
                alloc_per_gib_s: 0.0,
                compute_per_s: 0.0,
                hot_per_s: 0.0,
                harvested_discount: 0.0,
            };
            Ok((zero, BTreeMap::new()))
        }
        Err(e) => Err(e.into()),
    }
}

/// Opens the database, waiting while it is unavailable.
async fn open_database(url: &str) -> anyhow::Result<AnyPool> {
    let backend = Backend::of(url);
    let mut logged = false;
    loop {
        match db::open(url, DB_CONNECTIONS).await {
            Ok(pool) => return Ok(pool),
            // A conflict: SQLite shared with a manager that migrates too.
            Err(DbError::Unavailable(why) | DbError::Conflict(why)) => {
                if !logged {
                    tracing::warn!(
                        backend = backend.name(),
                        why,
                        "the database is unavailable; waiting for it"
                    );
                    logged = true;
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            Err(e) => {
                return Err(e).with_context(|| format!("open the database ({})", backend.name()))
            }
        }
    }
}

/// Removes a shm socket file left by a service that died, so the new
/// listener can bind it; a socket someone still serves is left alone.
fn remove_stale_socket(provider: &str, addr: &str) {
    use std::os::unix::fs::FileTypeExt;
    if provider != "shm" || addr.is_empty() || addr.starts_with('@') {
        return;
    }
    let is_socket = std::fs::symlink_metadata(addr).is_ok_and(|m| m.file_type().is_socket());
    if is_socket
        && std::os::unix::net::UnixStream::connect(addr)
            .is_err_and(|e| e.kind() == std::io::ErrorKind::ConnectionRefused)
    {
        tracing::info!(
            path = addr,
            "removing the stale socket of a service that is gone"
        );
        let _ = std::fs::remove_file(addr);
    }
}

/// Every reason the service with `settings` would not start that the
/// files it reads first show (billing configuration, the manager's public
/// keys), read as [`start`] reads them; for `--check-config`. Opens no
/// database and binds nothing.
pub fn check_files(settings: &Settings) -> Vec<String> {
    [
        load_billing(&settings.billing_config, &settings.config_dir).map(drop),
        lease_keys(settings).map(drop),
    ]
    .into_iter()
    .filter_map(|r| r.err().map(|e| format!("{e:#}")))
    .collect()
}

fn lease_keys(settings: &Settings) -> anyhow::Result<rfaas_proto::lease::LeaseKeys> {
    read_lease_keys(&settings.lease_keys).with_context(|| {
        format!(
            "read the manager's public keys, which check executor daemons' accounting tickets ({})",
            settings.config_dir.hint(&["lease_keys in accounting.toml"])
        )
    })
}

/// Starts the service with `settings`.
pub async fn start(settings: Settings) -> anyhow::Result<Running> {
    let (rates, budgets) = load_billing(&settings.billing_config, &settings.config_dir)?;
    let lease_keys = lease_keys(&settings)?;
    let started_ms = rfaas_service::now_ms();
    let metrics = Arc::new(Metrics::new(started_ms));
    let (http_listener, metrics_addr) = metrics::bind(&settings.metrics_listen)
        .await
        .with_context(|| format!("listen for metrics on {}", settings.metrics_listen))?;

    let pool = open_database(&settings.database).await?;
    let backend = Backend::of(&settings.database);

    let fabric = Arc::new(
        Fabric::open(&settings.provider)
            .with_context(|| format!("open the {} fabric", settings.provider))?,
    );
    let domain = Arc::new(fabric.domain().context("create the region's domain")?);
    let (region, created) = Region::open(&domain, &settings.region_file, settings.slots)?;
    let region = Arc::new(region);
    let ledger = Arc::new(
        Ledger::open(domain.clone(), region.clone(), created)
            .context("open the nodes' windows of the region")?,
    );
    remove_stale_socket(&settings.provider, &settings.listen);
    let fabric_listener = fabric
        .listen(&settings.listen)
        .with_context(|| format!("listen on {} ({})", settings.listen, settings.provider))?;
    let fabric_addr = settings
        .advertise
        .clone()
        .unwrap_or_else(|| fabric_listener.local_addr());
    let header = region.header();

    if created {
        seed(&pool, &settings.name, &ledger).await?;
    }
    let instance = Instance {
        name: settings.name.clone(),
        provider: settings.provider.clone(),
        fabric_addr: fabric_addr.clone(),
        metrics_addr: metrics_addr.to_string(),
        slots: settings.slots,
        region_id: header.region_id,
    };
    // SQLite, shared with the manager, may report a conflict: retried.
    let before =
        db::retrying(|| store::register_instance(&pool, &instance, rfaas_service::now_ms()))
            .await
            .context("write the instance's row")?;
    if let Some(old) = before.filter(|old| *old != header.region_id) {
        tracing::warn!(
            old_region = old,
            region = header.region_id,
            "this instance's region was replaced: adds made to the old one since its last flush are lost"
        );
    }
    let rows = db::retrying(|| store::ensure_slots(&pool, &settings.name, settings.slots))
        .await
        .context("create the billing slots")?;
    if rows.stranded > 0 {
        tracing::warn!(
            stranded = rows.stranded,
            slots = settings.slots,
            "leases hold slots past the region's end (the slot count shrank); their usage is not counted"
        );
    }
    match crate::report::budgets::sync(&pool, &budgets, rfaas_service::now_ms()).await {
        Ok(synced) => tracing::debug!(
            budgets = synced.len(),
            "wrote the budgets of the billing configuration"
        ),
        Err(e) => {
            tracing::warn!(error = %e, "cannot write the budgets of the billing configuration; `rfaas-billing budget sync` does it too")
        }
    }
    metrics.slots.set(i64::from(settings.slots));

    let (stop, stopped) = tokio::sync::watch::channel(false);
    let health = Health {
        metrics: metrics.clone(),
        max_lag: (settings.flush_interval * 3).max(Duration::from_secs(5)),
    };
    let http = tokio::spawn(metrics::serve(http_listener, health, stopped.clone()));
    let mut flusher = Flusher::new(
        FlushConfig {
            instance: settings.name.clone(),
            snapshot_interval: settings.snapshot_interval,
            slot_hold: settings.slot_hold,
            rates,
        },
        pool.clone(),
        ledger.clone(),
        metrics.clone(),
    );
    // The first flush before anyone connects: the row's heartbeat is
    // fresh and what a previous run left is written out.
    flusher.flush_logged().await;
    let flusher = tokio::spawn(flusher.run(settings.flush_interval, stopped));

    let stop_listener = Arc::new(AtomicBool::new(false));
    let listener = listener::spawn(
        ListenerParts {
            fabric: fabric.clone(),
            listener: fabric_listener,
            ledger: ledger.clone(),
            verifier: Arc::new(Verifier::new(pool.clone(), lease_keys)),
            runtime: tokio::runtime::Handle::current(),
            metrics: metrics.clone(),
            hello_timeout: settings.hello_timeout,
        },
        stop_listener.clone(),
    )
    .context("start the listener thread")?;
    tracing::info!(
        name = %settings.name,
        provider = %settings.provider,
        %fabric_addr,
        %metrics_addr,
        slots = settings.slots,
        region = %settings.region_file.display(),
        region_id = header.region_id,
        backend = backend.name(),
        "rfaas-accounting serving"
    );
    Ok(Running {
        fabric_addr,
        metrics_addr,
        region_id: header.region_id,
        metrics,
        stop,
        stop_listener,
        listener: Some(listener),
        flusher,
        http,
        _region: region,
        _domain: domain,
        _fabric: fabric,
    })
}

/// Seeds a new region's slots with the stored totals of the leases the
/// database still counts in them.
/// Each lease's slot is seeded in its node's window, where its daemon
/// reads it back.
async fn seed(pool: &AnyPool, name: &str, ledger: &Ledger) -> anyhow::Result<()> {
    let assigned = db::retrying(|| store::assigned_slots(pool, name))
        .await
        .context("read the slots to seed a new region")?;
    let ids: Vec<u64> = assigned.iter().map(|a| a.lease_id).collect();
    let rows = store::usage_of(pool, &ids)
        .await
        .context("read the usage to seed a new region")?;
    let mut seeded = 0;
    for a in assigned.iter().filter(|a| a.slot < ledger.slots()) {
        if let Some(row) = rows.iter().find(|r| r.lease_id == a.lease_id) {
            let window = match a.node() {
                Some(node) => ledger
                    .window(node)
                    .with_context(|| format!("make node {node}'s window to seed"))?,
                None => ledger.main().clone(),
            };
            window.seed_slot(a.slot, &row.totals);
            seeded += 1;
        }
    }
    if seeded > 0 {
        ledger
            .sync_all()
            .context("sync the seeded region to its file")?;
        tracing::warn!(
            seeded,
            "the region file is new while leases were counted in it: their slots start from the totals last flushed (adds since then are lost)"
        );
    }
    Ok(())
}

//! `rfaas-manager`: the resource manager. Executor daemons register their
//! nodes and heartbeat; jobs ask for cores and get lease tokens signed by
//! the manager, which executors check without calling back. It is off the
//! invocation path: a job talks to it to start, renew and release leases,
//! never to invoke.
//!
//! Any number of stateless replicas share one database (PostgreSQL; SQLite
//! for a single replica). Each replica serves any request:
//!
//! - [`api`]: the REST API under `/v1`, `/healthz`, `/metrics`, and the
//!   OpenAPI document generated from the handlers; one file per resource,
//!   and extractors that say who may call each handler.
//! - [`error`]: every refusal the API gives, its status and wire kind.
//! - [`store`]: every read and write, one transaction each, one SQL text
//!   for both databases ([`rfaas_service::db`]), one file per resource;
//!   grants by conditional updates, so no core is leased twice and no
//!   billing slot given to two leases under any concurrency.
//! - [`view`]: each replica's in-memory view of the nodes, which placement
//!   reads through an index of the nodes with free cores (so a grant reads
//!   a bounded number of nodes); refreshed by `LISTEN/NOTIFY` on
//!   PostgreSQL and periodically.
//! - [`announce`]: grants' and releases' counters for the other replicas,
//!   one notice every 20 ms at most.
//! - [`auth`]: the admin token and node and user credentials.
//! - [`signer`]: the key that signs lease tokens and accounting tickets.
//! - [`slurm`]: Slurm's word on a job (its user, account, state, nodes
//!   and time limit), asked once for all the nodes of a job asking at
//!   once, which the job routes go by rather than a node's, and on the
//!   accounts a user coordinates, which widens what the usage route shows.
//! - [`serve`]: the REST port's accept loop: HTTPS, timeouts, connection
//!   caps, certificate reload.
//! - [`retention`]: the purge of ended leases older than
//!   `[retention] ended_lease_days`, their usage kept per day.
//! - [`ctl`]: the client side `rfaasctl` (the admin's command line) is
//!   built on.
//!
//! - [`liveness`]: heartbeats kept in memory and written in batches; the
//!   heartbeat interval and loss timeout for the fleet's size.
//!
//! Background work in each replica ([`start`]): write the heartbeats
//! heard, reload the view (nodes and accounting instances) and the leases
//! recently ended, end expired leases, and mark nodes lost
//! that stopped heartbeating (only once the replica itself has reached the
//! database for `lost_after`, so a database outage never loses every
//! node); purge old ended leases ([`retention`]); on SQLite also checkpoint the write-ahead log
//! ([`rfaas_service::db::checkpoints`]).

pub mod announce;
pub mod api;
pub mod auth;
pub mod config;
pub mod ctl;
pub mod error;
pub mod liveness;
pub mod metrics;
pub mod retention;
pub mod serve;
pub mod signer;
pub mod slurm;
pub mod store;
pub mod view;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context as _;

// The database layer and the clocks the manager shares with the accounting
// service, under the names every module here uses (`crate::db`,
// `crate::now_ms`).
use rfaas_service::db;
use rfaas_service::{now_ms, now_s};

use crate::auth::Auth;
use crate::config::Settings;
use crate::db::Backend;
use crate::metrics::Metrics;
use crate::signer::Signer;
use crate::slurm::Slurm;
use crate::store::Store;
use crate::view::View;

/// One replica's state, shared by its handlers and background tasks.
#[derive(Debug)]
pub struct App {
    /// The settings.
    pub settings: Settings,
    /// The database.
    pub store: Store,
    /// The view of the nodes (the store applies its commits to it).
    pub view: Arc<View>,
    /// Credential checks.
    pub auth: Auth,
    /// Metrics.
    pub metrics: Metrics,
    /// The lease signing key.
    pub signer: Signer,
    /// Slurm's word on jobs.
    pub slurm: Slurm,
    /// Heartbeats heard and not yet written; leases recently ended.
    pub liveness: liveness::Liveness,
    /// Since when the database has answered without a break.
    healthy_since: Mutex<Option<Instant>>,
}

/// A running replica.
#[derive(Debug)]
pub struct Running {
    /// Where it listens.
    pub addr: SocketAddr,
    /// Its state.
    pub app: Arc<App>,
    /// Its certificate, if it serves HTTPS ([`serve::Tls::reload`]).
    pub tls: serve::Tls,
    stop: tokio::sync::watch::Sender<bool>,
    server: tokio::task::JoinHandle<std::io::Result<()>>,
}

impl Running {
    /// Stops serving (in-flight requests finish), writes the heartbeats
    /// heard and not yet written, and waits.
    pub async fn stop(self) -> anyhow::Result<()> {
        let _ = self.stop.send(true);
        self.server.await.context("the server task")??;
        if let Err(e) = self.app.liveness.flush(&self.app.store).await {
            tracing::warn!(error = %e, "cannot write the last heartbeats heard; the other replicas hear the nodes from now on");
        }
        Ok(())
    }

    /// Waits until the server stops (it stops on an error).
    pub async fn wait(self) -> anyhow::Result<()> {
        self.server.await.context("the server task")??;
        Ok(())
    }
}

/// Brings the database's schema up to date (`rfaas-manager migrate`);
/// [`start`] does it too.
pub async fn migrate(settings: &Settings) -> anyhow::Result<()> {
    let backend = Backend::of(&settings.database);
    let pool = db::open_and_migrate(&settings.database, 1)
        .await
        .with_context(|| format!("migrate the database ({})", backend.name()))?;
    pool.close().await;
    tracing::info!(backend = backend.name(), "the schema is up to date");
    Ok(())
}

/// Purges ended leases older than `[retention] ended_lease_days` (or
/// `days`, when given) once, now (`rfaas-manager purge`), as a replica's
/// purge task does every `interval_s`; returns what it deleted.
pub async fn purge(settings: &Settings, days: Option<u64>) -> anyhow::Result<store::Purged> {
    let backend = Backend::of(&settings.database);
    let pool = db::open_and_migrate(&settings.database, 1)
        .await
        .with_context(|| format!("open the database ({})", backend.name()))?;
    let store = Store::new(pool.clone(), backend);
    let mut r = settings.retention;
    r.ended_lease_days = days.unwrap_or(r.ended_lease_days);
    let purged = retention::purge(&store, &Metrics::new(), r, now_ms())
        .await
        .context("purge ended leases")?;
    pool.close().await;
    Ok(purged)
}

/// Every reason a replica with `settings` would not start that the files
/// it reads first show (admin token, lease signing key, HTTPS
/// certificate), read as [`start`] reads them; for `--check-config`. Opens
/// no database and binds nothing.
pub fn check_files(settings: &Settings) -> Vec<String> {
    [
        read_admin(settings).map(drop),
        load_signer(settings).map(drop),
        load_tls(settings).map(drop),
    ]
    .into_iter()
    .filter_map(|r| r.err().map(|e| format!("{e:#}")))
    .collect()
}

fn read_admin(settings: &Settings) -> anyhow::Result<String> {
    auth::read_admin_token(&settings.admin_token_file).map_err(|e| {
        anyhow::anyhow!(
            "{e}; {}",
            settings
                .config_dir
                .hint(&["--admin-token-file", "admin_token_file in manager.toml"])
        )
    })
}

fn load_signer(settings: &Settings) -> anyhow::Result<Signer> {
    Signer::load(&settings.lease_key_file).map_err(|e| {
        anyhow::anyhow!(
            "{e}; {}",
            settings
                .config_dir
                .hint(&["--lease-key-file", "lease_key_file in manager.toml"])
        )
    })
}

fn load_tls(settings: &Settings) -> anyhow::Result<serve::Tls> {
    serve::Tls::load(&settings.http)
        .context("load the HTTPS certificate (tls_cert and tls_key in manager.toml, or --tls-cert and --tls-key)")
}

/// Opens the database, loads the keys, starts the background tasks and
/// serves the API on `settings.listen`.
pub async fn start(settings: Settings) -> anyhow::Result<Running> {
    log_descriptor_limit(rfaas_service::limits::raise_descriptor_limit());
    let admin = read_admin(&settings)?;
    let signer = load_signer(&settings)?;
    let tls = load_tls(&settings)?;
    let max_connections = serve::connection_cap(settings.http.max_connections);
    let backend = Backend::of(&settings.database);
    let pool = db::open_and_migrate(&settings.database, settings.max_connections)
        .await
        .with_context(|| format!("open the database ({})", backend.name()))?;
    let view = Arc::new(View::default());
    let store = Store::new(pool, backend).with_view(view.clone());
    view.replace_all(store.nodes().await?);
    view.replace_instances(store.accounting_instances().await?);
    let listener = tokio::net::TcpListener::bind(&settings.listen)
        .await
        .with_context(|| format!("listen on {}", settings.listen))?;
    let addr = listener.local_addr()?;
    let settings_slurm = settings.slurm.clone();
    if settings_slurm.unchecked {
        tracing::warn!(
            "[slurm] unchecked = true: job credentials are minted for whatever job, user and account a node names, without asking Slurm; any node's credential can act as any user. Never run so on a cluster with users"
        );
    }
    let auth = Auth::open(&store, admin, settings.max_connections).await?;
    let app = Arc::new(App {
        settings,
        store,
        view,
        auth,
        metrics: Metrics::new(),
        signer,
        slurm: Slurm::new(settings_slurm),
        liveness: liveness::Liveness::default(),
        healthy_since: Mutex::new(Some(Instant::now())),
    });
    // Heartbeats are answered from memory once the leases ended lately
    // are known; if this fails, the first round loads them.
    if let Err(e) = app.liveness.load_ended(&app.store, now_ms()).await {
        tracing::warn!(error = %e, "cannot load the leases ended lately; heartbeats go to the database until a round does");
    }
    let (stop, _) = tokio::sync::watch::channel(false);
    tokio::spawn(refresh_loop(app.clone(), stop.subscribe()));
    if app.settings.retention.enabled {
        tokio::spawn(retention::purge_loop(app.clone(), stop.subscribe()));
    }
    match backend {
        Backend::Postgres => {
            tokio::spawn(listen_loop(app.clone(), stop.subscribe()));
        }
        Backend::Sqlite => {
            tokio::spawn(watch_loop(app.clone(), stop.subscribe()));
            tokio::spawn(db::checkpoints(
                app.settings.database.clone(),
                stop.subscribe(),
            ));
        }
    }
    let server = tokio::spawn(serve::serve(
        listener,
        api::router(app.clone()),
        tls.clone(),
        app.settings.http.clone(),
        max_connections,
        app.metrics.connections_refused.clone(),
        stop.subscribe(),
    ));
    tracing::info!(
        %addr,
        backend = backend.name(),
        https = tls.enabled(),
        max_connections,
        "rfaas-manager serving"
    );
    Ok(Running {
        addr,
        app,
        tls,
        stop,
        server,
    })
}

/// Below this many descriptors a replica warns: every connection, idle
/// or not, takes one.
const FEW_DESCRIPTORS: u64 = 8192;

/// Says the descriptor limit the replica serves with (raised to the hard
/// limit at start), and warns when it is low.
fn log_descriptor_limit(limit: Option<rfaas_service::limits::DescriptorLimit>) {
    match limit {
        Some(l) if l.soft < FEW_DESCRIPTORS => tracing::warn!(
            limit = l.soft,
            hard = l.hard,
            "the descriptor limit (RLIMIT_NOFILE) is low: each connection takes one, so \
             about this many open connections make the replica unreachable; raise the \
             hard limit (systemd: LimitNOFILE=65536)"
        ),
        Some(l) => tracing::info!(limit = l.soft, hard = l.hard, "descriptor limit"),
        None => tracing::warn!("cannot read the descriptor limit (RLIMIT_NOFILE)"),
    }
}

impl App {
    fn healthy(&self, ok: bool) {
        let mut h = self.healthy_since.lock().unwrap_or_else(|p| p.into_inner());
        match (ok, h.is_some()) {
            (true, false) => *h = Some(Instant::now()),
            (false, true) => *h = None,
            _ => {}
        }
    }

    /// Whether the last background round reached the database (what
    /// `/healthz` says).
    pub fn reaches_database(&self) -> bool {
        self.healthy_since
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some()
    }

    fn healthy_for(&self) -> Duration {
        self.healthy_since
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .map_or(Duration::ZERO, |t| t.elapsed())
    }

    /// The heartbeat interval and loss timeout for the nodes known now
    /// ([`liveness::Intervals`]).
    pub fn intervals(&self) -> liveness::Intervals {
        self.settings.intervals(self.view.len())
    }

    /// One round of background work: write the heartbeats heard
    /// ([`liveness`]), reload the view (nodes and accounting instances)
    /// and the leases recently ended, end expired leases, mark lost
    /// nodes.
    pub async fn refresh(&self) -> Result<(), db::DbError> {
        let flushed = self.liveness.flush(&self.store).await;
        self.healthy(flushed.is_ok());
        self.metrics.heartbeats_written.inc_by(flushed? as u64);
        let read = self
            .liveness
            .follow(&self.store, &self.view, now_ms(), self.settings.refresh_ms)
            .await;
        self.healthy(read.is_ok());
        self.metrics.view_reads.with_label_values(&[read?]).inc();
        self.liveness.load_ended(&self.store, now_ms()).await?;
        self.auth.follow_revocations(&self.store).await?;
        self.view
            .replace_instances(self.store.accounting_instances().await?);
        let expired = self.store.reap_expired(now_s(), now_ms()).await?;
        if !expired.is_empty() {
            self.metrics.expiries.inc_by(expired.len() as u64);
            tracing::info!(count = expired.len(), "leases expired");
        }
        let lost_after_ms = self.intervals().lost_after_ms;
        let lost_after = Duration::from_millis(lost_after_ms);
        let mut touched: BTreeSet<String> = expired.iter().map(|l| l.view.node.clone()).collect();
        if self.healthy_for() >= lost_after {
            let now = now_ms();
            let (lost, ended) = self
                .store
                .reap_lost(now.saturating_sub(lost_after_ms), now)
                .await?;
            for node in &lost {
                tracing::warn!(%node, "node lost: no heartbeat for lost_after");
            }
            self.metrics.lost_nodes.inc_by(lost.len() as u64);
            self.metrics.lost_leases.inc_by(ended.len() as u64);
            touched.extend(lost);
            touched.extend(ended.into_iter().map(|l| l.view.node));
        }
        if !touched.is_empty() {
            let names: Vec<&str> = touched.iter().map(String::as_str).collect();
            for node in self.store.nodes_named(&names).await? {
                self.view.upsert(node);
            }
        }
        Ok(())
    }
}

async fn refresh_loop(app: Arc<App>, mut stop: tokio::sync::watch::Receiver<bool>) {
    let period = Duration::from_millis(app.settings.refresh_ms);
    loop {
        tokio::select! {
            _ = tokio::time::sleep(period) => {}
            _ = stop.changed() => return,
        }
        if let Err(e) = app.refresh().await {
            tracing::warn!(error = %e, "background refresh failed; retrying");
        }
    }
}

/// How often a replica on SQLite asks whether the database changed.
const SQLITE_WATCH: Duration = Duration::from_millis(25);

/// SQLite has no notices. Every [`SQLITE_WATCH`], a replica asks SQLite on
/// a connection of its own whether any other connection committed since
/// (`PRAGMA data_version`, which reads no table), and if so reloads its
/// view of the nodes and the accounting instances: another replica's, or
/// an accounting service's, changes show within that period instead of at
/// the next `refresh_ms`.
async fn watch_loop(app: Arc<App>, mut stop: tokio::sync::watch::Receiver<bool>) {
    // Reads through its own connection, so the requests' one stays free.
    let mut watcher: Option<Store> = None;
    let mut seen: Option<i64> = None;
    loop {
        tokio::select! {
            _ = tokio::time::sleep(SQLITE_WATCH) => {}
            _ = stop.changed() => return,
        }
        if watcher.is_none() {
            watcher = db::open(&app.settings.database, 1)
                .await
                .ok()
                .map(|pool| Store::new(pool, Backend::Sqlite));
            seen = None;
        }
        let Some(store) = &watcher else { continue };
        // fetch_all: the statement runs to its end, so the connection
        // holds no read transaction (and no old snapshot) between polls.
        let version = match sqlx::query("PRAGMA data_version")
            .fetch_all(store.pool())
            .await
        {
            Ok(rows) => rows
                .first()
                .and_then(|row| sqlx::Row::try_get::<i64, _>(row, 0).ok()),
            Err(e) => {
                tracing::debug!(error = %e, "PRAGMA data_version failed; reconnecting");
                watcher = None;
                continue;
            }
        };
        if version.is_none() || version == seen {
            continue;
        }
        // The first answer too: the view was loaded before this
        // connection was, and a change may have come in between.
        seen = version;
        if let Ok(nodes) = store.nodes().await {
            app.view.replace_all(nodes);
        }
        if let Ok(instances) = store.accounting_instances().await {
            app.view.replace_instances(instances);
        }
    }
}

/// Follows the notices on `rfaas_nodes`. A batch of grants and releases
/// carries the nodes' leased counters with their `lease_seq`, which go
/// straight into the view (newer ones only). Other changes name the
/// nodes, which are read again: the notices that queued up meanwhile
/// together, in one query. This replica's own notices are skipped (it
/// applied those changes to its view when it made them).
async fn listen_loop(app: Arc<App>, mut stop: tokio::sync::watch::Receiver<bool>) {
    use sqlx::postgres::PgListener;
    loop {
        let mut listener = match PgListener::connect(&app.settings.database).await {
            Ok(l) => l,
            Err(e) => {
                tracing::debug!(error = %e, "LISTEN connection failed; retrying");
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_secs(1)) => continue,
                    _ = stop.changed() => return,
                }
            }
        };
        if listener.listen("rfaas_nodes").await.is_err() {
            continue;
        }
        // Whatever was announced while not listening: reload everything.
        if let Ok(nodes) = app.store.nodes().await {
            app.view.replace_all(nodes);
        }
        loop {
            let got = tokio::select! {
                got = listener.try_recv() => got,
                _ = stop.changed() => return,
            };
            match got {
                Ok(Some(n)) => {
                    let mut names = BTreeSet::new();
                    let mut take = |payload: &str| {
                        let (origin, entries) = store::notice(payload);
                        let own = origin == Some(app.store.origin());
                        if own {
                            return;
                        }
                        for e in entries {
                            match e {
                                store::Announced::Leased {
                                    node,
                                    cores,
                                    memory_mib,
                                    seq,
                                } => {
                                    if !app.view.set_leased(node, cores, memory_mib, seq) {
                                        names.insert(node.to_owned());
                                    }
                                }
                                store::Announced::Changed(node) => {
                                    names.insert(node.to_owned());
                                }
                            }
                        }
                    };
                    take(n.payload());
                    while let Some(n) = listener.next_buffered() {
                        take(n.payload());
                    }
                    if names.is_empty() {
                        continue;
                    }
                    let names: Vec<&str> = names.iter().map(String::as_str).collect();
                    match app.store.nodes_named(&names).await {
                        Ok(nodes) => nodes.into_iter().for_each(|n| app.view.upsert(n)),
                        Err(e) => tracing::debug!(error = %e, "reload of announced nodes failed"),
                    }
                }
                // The connection dropped; the next call reconnects, and
                // anything announced meanwhile is lost: reload everything.
                Ok(None) => {
                    if let Ok(nodes) = app.store.nodes().await {
                        app.view.replace_all(nodes);
                    }
                }
                Err(_) => break,
            }
        }
    }
}

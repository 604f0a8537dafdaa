//! `rfaas-bench --manager`: lease grants through real `rfaas-manager`
//! replicas, next to the same grants made straight on the database, and
//! how soon a node's registration reaches every replica.
//!
//! | row | what one sample is |
//! |---|---|
//! | `lease_grant` | one grant of 1 core (`POST /v1/leases`) and its release (`DELETE /v1/leases/{id}`) over HTTP, from one of `concurrency` client threads, each with its own keep-alive agent, user and account; the pairs rotate over the replicas |
//! | `lease_grant_paced` | the same, open loop: pairs start on a fixed schedule at half the best `lease_grant` rate of the round (same backend and replicas), whatever the earlier ones did; a sample runs from its scheduled start, so a queue behind a slow pair counts |
//! | `raw_db_grant` | `Store::grant` and `Store::end_grant` of `rfaas_manager::store` on a pool of the same database, from `concurrency` tasks: the same transactions (budget check, row locks, billing slots when accounting instances are registered, inserts, notifications) without HTTP, authentication, the view of the nodes and signing |
//! | `lease_grant_aged` | `lease_grant` at 1 replica and the largest concurrency, against a second database of the same backend that holds `--ended-leases` ended leases (inserted once, in one statement, ended over the last 80 days: none is old enough to purge); runs only when `--rows` names it, each round right after `lease_grant` |
//! | `node_visible` | a node's `PUT /v1/nodes/{name}` to one replica until every replica's `GET /v1/nodes/{name}` (its in-memory view, as `GET /v1/nodes` without `?fresh=true`) shows the node, each replica polled every millisecond; registrations start at random points of the replicas' `refresh_ms` |
//!
//! Every replica is a real `rfaas-manager` process on 127.0.0.1 (release
//! build, from next to the bench or `--manager-bin`), stopped by pid; all
//! of a backend's replicas share one database: a throwaway PostgreSQL
//! server (`rfaas_testkit::postgres`) or one SQLite file. The nodes
//! (`NODES` of `NODE_CORES` cores each, registered through the API with
//! node credentials) never run out of cores and are never lost
//! (`lost_after_ms` is a day).
//!
//! Nothing is pinned: replicas, the database and the clients share the
//! machine's CPUs, as they would on a manager host.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use rfaas_manager::config::DEFAULT_ACCOUNTING_LOST_AFTER_MS;
use rfaas_manager::store::{GrantOutcome, GrantPlan, Store};
use rfaas_manager::view::View;
use rfaas_proto::manager::{LeaseState, NodeState};
use rfaas_service::db::{self, retrying, Backend};
use rfaas_testkit::manager::{write_lease_key, Manager, ManagerOptions};
use rfaas_testkit::postgres::Postgres;

use crate::cleanup;
use crate::error::{Error, Result};
use crate::report::{Best, Measure, Report, Row, ServicePoint};
use crate::stats::Summary;

pub const LEASE_GRANT: &str = "lease_grant";
pub const LEASE_GRANT_PACED: &str = "lease_grant_paced";
pub const RAW_DB_GRANT: &str = "raw_db_grant";
pub const NODE_VISIBLE: &str = "node_visible";
pub const LEASE_GRANT_AGED: &str = "lease_grant_aged";
const RATIO: &str = "lease_grant_vs_raw_db_grant";
const AGED_RATIO: &str = "lease_grant_aged_vs_lease_grant";

/// The measured rows and what they measure, for `--help`.
pub const ROWS: &[(&str, &str)] = &[
    (LEASE_GRANT, "a lease grant of 1 core and its release over HTTP, --concurrency client threads, against each --replicas count of real rfaas-manager processes on one database"),
    (LEASE_GRANT_PACED, "the same paced open loop at half lease_grant's best rate of the round (target: p99 at most 5 ms)"),
    (RAW_DB_GRANT, "the manager's own grant and release transactions (rfaas_manager::store) straight on the database, no HTTP: the database's limit"),
    (LEASE_GRANT_AGED, "lease_grant at 1 replica and the largest --concurrency on a second database holding --ended-leases ended leases; only when --rows names it"),
    (NODE_VISIBLE, "a node's registration on one replica until every replica's view lists it, at the largest --replicas count (target: p99 at most 100 ms)"),
];

/// The derived rows, for `--help`.
pub const DERIVED: &[(&str, &str)] = &[
    (
        RATIO,
        "lease_grant ops/s over raw_db_grant ops/s at the same backend and concurrency (target: at least 0.5)",
    ),
    (
        AGED_RATIO,
        "lease_grant_aged ops/s over lease_grant ops/s at the same backend, replicas and concurrency (target: at least 0.9)",
    ),
];

/// Nodes registered, and cores each lends: grants never run out.
const NODES: usize = 8;
const NODE_CORES: u32 = 4096;
pub(crate) const NODE_MEMORY_MIB: u64 = 1 << 30;
/// What each grant asks for.
pub(crate) const GRANT_BODY: &str = r#"{"cores":1,"memory_mib":1,"duration_s":600}"#;
const GRANT_MEMORY_MIB: u64 = 1;
const GRANT_DURATION_S: u64 = 600;

const PACED_P99_MAX_NS: u64 = 5_000_000;
const VISIBLE_P99_MAX_NS: u64 = 100_000_000;
const GRANT_MIN_RATIO: f64 = 0.5;
/// Ended leases in the table cost grants at most a tenth of their rate.
const AGED_MIN_RATIO: f64 = 0.9;
/// The aged leases ended over this many seconds before now: less than
/// the default retention (90 days), so no purge runs during the bench.
const AGED_SPAN_S: u64 = 80 * 86_400;
/// How often `node_visible` asks each replica.
const POLL: Duration = Duration::from_millis(1);

/// What the manager mode is told.
#[derive(Debug, Clone)]
pub struct Settings {
    /// `postgres`, `sqlite`.
    pub backends: Vec<Backend>,
    /// Replica counts for `lease_grant`; `node_visible` runs at the largest.
    pub replicas: Vec<u32>,
    /// Client threads (tasks for `raw_db_grant`) at once.
    pub concurrency: Vec<u32>,
    /// Grant-and-release pairs timed per measurement.
    pub grants: usize,
    /// Registrations timed per `node_visible` measurement.
    pub visible_iters: usize,
    /// Each replica's `refresh_ms`.
    pub refresh_ms: u64,
    /// The `rfaas-manager` binary; `None`: next to the bench's own.
    pub manager_bin: Option<PathBuf>,
    /// `--rows`; `None`: every row.
    pub rows: Option<Vec<String>>,
    /// Ended leases in `lease_grant_aged`'s database.
    pub ended_leases: u64,
    pub rounds: usize,
    pub json: bool,
}

/// Parses a `--backend` value.
pub fn parse_backend(s: &str) -> Result<Backend> {
    match s.trim() {
        "postgres" => Ok(Backend::Postgres),
        "sqlite" => Ok(Backend::Sqlite),
        other => Err(Error::new(format!(
            "unknown --backend `{other}`; the backends are postgres and sqlite"
        ))),
    }
}

/// The rows, each round, then the derived rows; errors as sentences.
pub fn run(s: &Settings) -> Result<()> {
    check(s)?;
    cleanup::install()
        .map_err(|e| Error::new(format!("could not install the signal handlers: {e}")))?;
    let bin = match &s.manager_bin {
        Some(b) => b.clone(),
        None => std::env::current_exe()
            .map_err(|e| Error::new(format!("where is this binary? {e}")))?
            .with_file_name("rfaas-manager"),
    };
    if !bin.exists() {
        return Err(Error::new(format!(
            "{} is not built; build it next to the bench (cargo build --release -p rfaas-manager -p rfaas-bench) or pass --manager-bin",
            bin.display()
        )));
    }
    let dir = Scratch::new("manager")?;
    let aged = s
        .rows
        .as_ref()
        .is_some_and(|r| r.iter().any(|x| x == LEASE_GRANT_AGED));
    let mut dbs = Vec::new();
    for backend in &s.backends {
        let mut db = Database::new(*backend, &dir.0, "manager.db")?;
        if aged {
            let old = Database::new(*backend, &dir.0, "aged.db")?;
            fill_ended_leases(&old.url, s.ended_leases)?;
            db.aged = Some(Box::new(old));
        }
        dbs.push(db);
    }
    let common = Common::new(&bin, &dir.0, s.refresh_ms)?;
    let mut report = Report::new(s.json, s.rounds);
    for round in 1..=s.rounds {
        if s.rounds > 1 {
            eprintln!("round {round} of {}", s.rounds);
        }
        report.start_round();
        for db in &mut dbs {
            run_backend(s, &common, db, round, &mut report)?;
        }
    }
    report.finish_with(derive)
}

fn check(s: &Settings) -> Result<()> {
    if let Some(rows) = &s.rows {
        let known: Vec<&str> = ROWS.iter().map(|r| r.0).collect();
        if let Some(unknown) = rows.iter().find(|r| !known.contains(&r.as_str())) {
            return Err(Error::new(format!(
                "unknown row `{unknown}` in --rows; with --manager the rows are {}",
                known.join(", ")
            )));
        }
        if rows.iter().any(|r| r == LEASE_GRANT_PACED) && !rows.iter().any(|r| r == LEASE_GRANT) {
            return Err(Error::new(
                "lease_grant_paced runs at half lease_grant's rate: select lease_grant too",
            ));
        }
        if rows.iter().any(|r| r == LEASE_GRANT_AGED)
            && (!rows.iter().any(|r| r == LEASE_GRANT) || !s.replicas.contains(&1))
        {
            return Err(Error::new(
                "lease_grant_aged is compared with lease_grant at 1 replica: select lease_grant too and include 1 in --replicas",
            ));
        }
    }
    if s.concurrency.is_empty() || s.concurrency.contains(&0) {
        return Err(Error::new("--concurrency must list counts of at least 1"));
    }
    if s.replicas.is_empty() || s.replicas.contains(&0) || s.replicas.iter().any(|&r| r > 4) {
        return Err(Error::new("--replicas must list counts from 1 to 4"));
    }
    if s.grants == 0 || s.visible_iters == 0 {
        return Err(Error::new(
            "--grants and --visible-iters must be at least 1",
        ));
    }
    if s.backends.is_empty() {
        return Err(Error::new("--backend must name postgres, sqlite or both"));
    }
    Ok(())
}

/// A private directory for the key, the token and the SQLite file,
/// removed at the end.
pub(crate) struct Scratch(pub(crate) PathBuf);

impl Scratch {
    /// `/tmp/rfaas-bench-<what>-<pid>`.
    pub(crate) fn new(what: &str) -> Result<Scratch> {
        let dir = std::env::temp_dir().join(format!("rfaas-bench-{what}-{}", std::process::id()));
        std::fs::create_dir_all(&dir)
            .map_err(|e| Error::new(format!("could not create {}: {e}", dir.display())))?;
        Ok(Scratch(dir))
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// What every replica of the run shares: binary, admin token, lease key,
/// configuration.
pub(crate) struct Common {
    pub(crate) bin: PathBuf,
    pub(crate) admin_token: String,
    pub(crate) lease_key: PathBuf,
    pub(crate) refresh_ms: u64,
}

impl Common {
    pub(crate) fn new(bin: &Path, dir: &Path, refresh_ms: u64) -> Result<Common> {
        let lease_key = dir.join("lease-key.secret");
        write_lease_key(&lease_key).map_err(Error::new)?;
        Ok(Common {
            bin: bin.to_owned(),
            admin_token: format!("bench-admin-{:016x}", fastrand::u64(..)),
            lease_key,
            refresh_ms,
        })
    }
}

/// One database, kept for the whole run; prepared (credentials, nodes)
/// by its first replicas.
struct Database {
    backend: Backend,
    url: String,
    _pg: Option<(Postgres, cleanup::Registered)>,
    /// User tokens, one per client thread.
    users: Vec<String>,
    /// Their accounts, for `raw_db_grant`.
    accounts: Vec<String>,
    /// `lease_grant_aged`'s database, of the same backend.
    aged: Option<Box<Database>>,
}

impl Database {
    fn new(backend: Backend, dir: &Path, file: &str) -> Result<Database> {
        let (url, pg) = match backend {
            Backend::Postgres => {
                let pg = Postgres::start().map_err(|e| {
                    Error::new(format!(
                        "could not start PostgreSQL for the manager rows: {e}"
                    ))
                })?;
                let registered = pg.pid().map(cleanup::register);
                let url = pg.url().to_owned();
                (url, registered.map(|r| (pg, r)))
            }
            Backend::Sqlite => (format!("sqlite://{}", dir.join(file).display()), None),
        };
        Ok(Database {
            backend,
            url,
            _pg: pg,
            users: Vec::new(),
            accounts: Vec::new(),
            aged: None,
        })
    }
}

/// Running replicas, stopped (kill -9) on drop.
pub(crate) struct Replicas {
    managers: Vec<(Manager, Option<cleanup::Registered>)>,
    pub(crate) urls: Vec<String>,
}

impl Replicas {
    /// `n` replicas on `db` for the grant rows: heartbeats every second,
    /// and nodes never lost.
    fn start(common: &Common, db: &Database, n: u32) -> Result<Replicas> {
        let config = format!(
            "heartbeat_interval_ms = 1000\nlost_after_ms = 86400000\nrefresh_ms = {}\n",
            common.refresh_ms
        );
        Replicas::start_with(common, &db.url, n, &config)
    }

    /// `n` replicas on the database at `url`, `config` added to their
    /// configuration.
    pub(crate) fn start_with(common: &Common, url: &str, n: u32, config: &str) -> Result<Replicas> {
        let mut managers = Vec::new();
        for _ in 0..n {
            let opts = ManagerOptions {
                database: Some(url.to_owned()),
                admin_token: Some(common.admin_token.clone()),
                lease_key: Some(common.lease_key.clone()),
                extra_config: config.to_owned(),
                ..ManagerOptions::default()
            };
            let m = Manager::try_start(&common.bin, opts).map_err(Error::new)?;
            let registered = m.pid().map(cleanup::register);
            managers.push((m, registered));
        }
        let urls = managers.iter().map(|(m, _)| m.url().to_owned()).collect();
        Ok(Replicas { managers, urls })
    }

    /// The replicas' pids, those running.
    pub(crate) fn pids(&self) -> Vec<u32> {
        self.managers.iter().filter_map(|(m, _)| m.pid()).collect()
    }

    /// Stops replica `i` (SIGTERM, as an upgrade does) and starts it
    /// again on the same port.
    pub(crate) fn restart(&mut self, i: usize) -> Result<()> {
        let (m, registered) = &mut self.managers[i];
        *registered = None;
        m.restart().map_err(|e| {
            Error::new(format!(
                "could not restart the replica at {}: {e}; its log:\n{}",
                self.urls[i],
                m.log()
            ))
        })?;
        *registered = m.pid().map(cleanup::register);
        Ok(())
    }
}

/// A blocking HTTP agent: keep-alive, statuses as values, trusting
/// `RFAAS_CA_FILE` or the system's roots.
pub(crate) fn agent() -> ureq::Agent {
    let options = rfaas_tls::AgentOptions::new(Duration::from_secs(30)).ca_file_or_env(None);
    rfaas_tls::agent(&options).unwrap_or_else(|e| panic!("{e}"))
}

/// `method path` on `base` with `token`; the status and the body.
pub(crate) fn call(
    agent: &ureq::Agent,
    method: &str,
    url: &str,
    token: &str,
    body: Option<&str>,
) -> Result<(u16, String)> {
    let auth = format!("Bearer {token}");
    let sent = match (method, body) {
        ("POST", Some(b)) => agent
            .post(url)
            .header("Authorization", &auth)
            .content_type("application/json")
            .send(b),
        ("POST", None) => agent.post(url).header("Authorization", &auth).send_empty(),
        ("PUT", Some(b)) => agent
            .put(url)
            .header("Authorization", &auth)
            .content_type("application/json")
            .send(b),
        ("DELETE", _) => agent.delete(url).header("Authorization", &auth).call(),
        _ => agent.get(url).header("Authorization", &auth).call(),
    };
    let mut resp = sent.map_err(|e| Error::new(format!("{method} {url} failed: {e}")))?;
    let status = resp.status().as_u16();
    let text = resp
        .body_mut()
        .read_to_string()
        .map_err(|e| Error::new(format!("{method} {url}: unreadable answer: {e}")))?;
    Ok((status, text))
}

/// [`call`], failing unless the status is `want`.
pub(crate) fn expect(
    agent: &ureq::Agent,
    method: &str,
    url: &str,
    token: &str,
    body: Option<&str>,
    want: u16,
) -> Result<String> {
    let (status, text) = call(agent, method, url, token, body)?;
    if status != want {
        return Err(Error::new(format!(
            "{method} {url} answered {status}, not {want}: {text}"
        )));
    }
    Ok(text)
}

pub(crate) fn credential(
    agent: &ureq::Agent,
    url: &str,
    admin: &str,
    role: &str,
    subject: &str,
) -> Result<String> {
    let body = serde_json::json!({"role": role, "subject": subject}).to_string();
    let text = expect(
        agent,
        "POST",
        &format!("{url}/v1/credentials"),
        admin,
        Some(&body),
        201,
    )?;
    let v: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| Error::new(format!("a credential that is not JSON ({e}): {text}")))?;
    v["token"]
        .as_str()
        .map(str::to_owned)
        .ok_or_else(|| Error::new(format!("a credential without a token: {text}")))
}

pub(crate) fn register_body(name_seq: usize, cores: u32) -> String {
    serde_json::json!({
        "control_addr": format!("127.0.0.1:{}", 20_000 + name_seq % 40_000),
        "providers": [{"name": "tcp", "host": "127.0.0.1"}],
        "cores": cores,
        "memory_mib": NODE_MEMORY_MIB,
        "version": "bench",
    })
    .to_string()
}

/// Mints the user credentials (one per client thread) and registers the
/// nodes, once per database; then waits until every replica's view holds
/// the nodes.
fn prepare(common: &Common, db: &mut Database, reps: &Replicas, users: usize) -> Result<()> {
    let a = agent();
    let first = &reps.urls[0];
    if db.users.is_empty() {
        for n in 0..NODES {
            let name = format!("bench-n{n}");
            let token = credential(&a, first, &common.admin_token, "node", &name)?;
            expect(
                &a,
                "PUT",
                &format!("{first}/v1/nodes/{name}"),
                &token,
                Some(&register_body(n, NODE_CORES)),
                200,
            )?;
        }
    }
    while db.users.len() < users {
        let name = format!("bench-u{}", db.users.len());
        db.users
            .push(credential(&a, first, &common.admin_token, "user", &name)?);
        db.accounts.push(name);
    }
    let until = Instant::now() + Duration::from_millis(10_000 + 2 * common.refresh_ms);
    for url in &reps.urls {
        loop {
            let text = expect(
                &a,
                "GET",
                &format!("{url}/v1/nodes"),
                &common.admin_token,
                None,
                200,
            )?;
            if (0..NODES).all(|n| text.contains(&format!("\"name\":\"bench-n{n}\""))) {
                break;
            }
            if Instant::now() > until {
                return Err(Error::new(format!(
                    "the replica at {url} did not list the bench's nodes in time: {text}"
                )));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    Ok(())
}

fn run_backend(
    s: &Settings,
    common: &Common,
    db: &mut Database,
    round: usize,
    report: &mut Report,
) -> Result<()> {
    let want = |row: &str| s.rows.as_ref().map_or(true, |r| r.iter().any(|x| x == row));
    let threads = *s.concurrency.iter().max().unwrap_or(&1) as usize;
    let backend = db.backend.name();
    let point = |replicas: u32, concurrency: u32| ServicePoint {
        backend: backend.to_owned(),
        replicas,
        concurrency,
    };
    let warmup = (s.grants / 10).max(1);
    if want(LEASE_GRANT) {
        for &r in &s.replicas {
            let reps = Replicas::start(common, db, r)?;
            prepare(common, db, &reps, threads)?;
            let mut peak = 0u64;
            for &c in &s.concurrency {
                let (latency, ops_per_s) =
                    lease_grant(&reps.urls, &db.users, c as usize, s.grants, warmup)?;
                peak = peak.max(ops_per_s);
                report.push(&Row::service(
                    LEASE_GRANT,
                    point(r, c),
                    Measure::Service {
                        latency,
                        ops_per_s: Some(ops_per_s),
                        best: Best::MostOps,
                        target_p99_max_ns: None,
                        extra: Vec::new(),
                    },
                ))?;
            }
            if want(LEASE_GRANT_PACED) {
                let offered = (peak / 2).max(1);
                let (latency, ops_per_s) =
                    paced(&reps.urls, &db.users, threads, offered as f64, s.grants)?;
                report.push(&Row::service(
                    LEASE_GRANT_PACED,
                    point(r, threads as u32),
                    Measure::Service {
                        latency,
                        ops_per_s: Some(ops_per_s),
                        best: Best::LowestP99,
                        target_p99_max_ns: Some(PACED_P99_MAX_NS),
                        extra: vec![("offered_per_s", offered)],
                    },
                ))?;
            }
        }
    }
    if let Some(aged) = db.aged.as_deref_mut().filter(|_| want(LEASE_GRANT_AGED)) {
        let reps = Replicas::start(common, aged, 1)?;
        prepare(common, aged, &reps, threads)?;
        let (latency, ops_per_s) = lease_grant(&reps.urls, &aged.users, threads, s.grants, warmup)?;
        report.push(&Row::service(
            LEASE_GRANT_AGED,
            point(1, threads as u32),
            Measure::Service {
                latency,
                ops_per_s: Some(ops_per_s),
                best: Best::MostOps,
                target_p99_max_ns: None,
                extra: vec![("ended_leases", s.ended_leases)],
            },
        ))?;
    }
    if want(NODE_VISIBLE) {
        let r = *s.replicas.iter().max().unwrap_or(&1);
        let reps = Replicas::start(common, db, r)?;
        prepare(common, db, &reps, threads)?;
        let latency = node_visible(
            &reps.urls,
            &common.admin_token,
            s.visible_iters,
            round,
            common.refresh_ms,
        )?;
        report.push(&Row::service(
            NODE_VISIBLE,
            point(r, 1),
            Measure::Service {
                latency,
                ops_per_s: None,
                best: Best::LowestMedian,
                target_p99_max_ns: Some(VISIBLE_P99_MAX_NS),
                extra: vec![("refresh_ms", common.refresh_ms)],
            },
        ))?;
    }
    if want(RAW_DB_GRANT) {
        if db.users.is_empty() {
            let reps = Replicas::start(common, db, 1)?;
            prepare(common, db, &reps, threads)?;
        }
        for &c in &s.concurrency {
            let (latency, ops_per_s) =
                raw_db_grant(&db.url, &db.accounts, c as usize, s.grants, warmup)?;
            report.push(&Row::service(
                RAW_DB_GRANT,
                point(0, c),
                Measure::Service {
                    latency,
                    ops_per_s: Some(ops_per_s),
                    best: Best::MostOps,
                    target_p99_max_ns: None,
                    extra: Vec::new(),
                },
            ))?;
        }
    }
    Ok(())
}

/// Migrates the database at `url` and inserts `n` ended leases in one
/// statement (PostgreSQL counts with generate_series, SQLite with a
/// recursive query): 500 users of 50 accounts on the bench's nodes, 1 to
/// 4 cores, ended over the last [`AGED_SPAN_S`], a tenth expired and the
/// rest released; then refreshes the planner's statistics.
fn fill_ended_leases(url: &str, n: u64) -> Result<()> {
    eprintln!(
        "inserting {n} ended leases into the {} database of lease_grant_aged",
        Backend::of(url).name()
    );
    let now = rfaas_service::now_ms();
    let (with, from) = match Backend::of(url) {
        Backend::Sqlite => (
            format!(
                "WITH RECURSIVE k(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM k WHERE i < {n})"
            ),
            "k".to_owned(),
        ),
        _ => (
            String::new(),
            format!("generate_series(CAST(1 AS BIGINT), {n}) AS k(i)"),
        ),
    };
    let insert = format!(
        "{with} INSERT INTO leases (id, grant_id, node, owner, user_name, account, cores, memory_mib,
            issued_at, expires_at, state, ended_ms, harvested)
         SELECT 1000000000 + i, 1000000000 + i, 'bench-n' || (i % {NODES}), 'user:aged-u' || (i % 500),
            'aged-u' || (i % 500), 'aged-a' || (i % 50), 1 + i % 4, 64, e / 1000 - 600, e / 1000,
            CASE WHEN i % 10 = 0 THEN 'expired' ELSE 'released' END, e, 0
         FROM (SELECT i, {now} - (i % {AGED_SPAN_S}) * 1000 AS e FROM {from}) AS t"
    );
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| Error::new(format!("could not start a tokio runtime: {e}")))?;
    runtime.block_on(async {
        let failed = |e: &dyn std::fmt::Display| {
            Error::new(format!("could not insert {n} ended leases into {url}: {e}"))
        };
        let pool = db::open_and_migrate(url, 1).await.map_err(|e| failed(&e))?;
        // On PostgreSQL also vacuumed, as an old table is: otherwise the
        // autovacuum that the insert triggers scans it during the rounds.
        let analyze = match Backend::of(url) {
            Backend::Sqlite => "ANALYZE",
            _ => "VACUUM ANALYZE leases",
        };
        for statement in [insert.as_str(), analyze] {
            sqlx::query(statement)
                .execute(&pool)
                .await
                .map_err(|e| failed(&e))?;
        }
        pool.close().await;
        Ok(())
    })
}

/// One grant of 1 core and its release on `url`.
fn grant_and_release(agent: &ureq::Agent, url: &str, token: &str) -> Result<()> {
    let text = expect(
        agent,
        "POST",
        &format!("{url}/v1/leases"),
        token,
        Some(GRANT_BODY),
        201,
    )?;
    let id = grant_id(&text)?;
    expect(
        agent,
        "DELETE",
        &format!("{url}/v1/leases/{id}"),
        token,
        None,
        204,
    )?;
    Ok(())
}

/// The `"id"` of a `LeaseGrant`.
fn grant_id(text: &str) -> Result<u64> {
    let v: serde_json::Value = serde_json::from_str(text)
        .map_err(|e| Error::new(format!("a grant that is not JSON ({e}): {text}")))?;
    v["id"]
        .as_u64()
        .ok_or_else(|| Error::new(format!("a grant without an id: {text}")))
}

/// Merges the threads' samples; the first error wins.
fn merge(results: Vec<Result<Vec<u64>>>) -> Result<Summary> {
    let mut all = Vec::new();
    for r in results {
        all.extend(r?);
    }
    Summary::of(&mut all).ok_or_else(|| Error::new("no samples were taken"))
}

fn per_s(ops: usize, elapsed: Duration) -> u64 {
    (ops as f64 / elapsed.as_secs_f64().max(1e-9)).round() as u64
}

/// `clients` threads, each with its own agent and user, do `warmup`
/// pairs in all untimed, then `iters` in all as fast as they can; pair
/// `k` of thread `t` goes to replica `(t + k) % replicas`.
fn lease_grant(
    urls: &[String],
    users: &[String],
    clients: usize,
    iters: usize,
    warmup: usize,
) -> Result<(Summary, u64)> {
    let left = AtomicUsize::new(iters);
    let warm_left = AtomicUsize::new(warmup);
    let start = Barrier::new(clients + 1);
    let claim = |n: &AtomicUsize| {
        n.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| v.checked_sub(1))
            .is_ok()
    };
    let (results, elapsed) = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..clients)
            .map(|t| {
                let (left, warm_left, start, claim) = (&left, &warm_left, &start, &claim);
                scope.spawn(move || {
                    let agent = agent();
                    let token = &users[t % users.len()];
                    let mut k = t;
                    let mut next_url = || {
                        k += 1;
                        &urls[k % urls.len()]
                    };
                    let warm = (|| {
                        while claim(warm_left) {
                            grant_and_release(&agent, next_url(), token)?;
                        }
                        Ok(())
                    })();
                    start.wait();
                    warm?;
                    let mut samples = Vec::with_capacity(iters / clients + 1);
                    while claim(left) {
                        let url = next_url();
                        let t0 = Instant::now();
                        grant_and_release(&agent, url, token)?;
                        samples.push(t0.elapsed().as_nanos() as u64);
                    }
                    Ok((samples, Instant::now()))
                })
            })
            .collect();
        start.wait();
        let t0 = Instant::now();
        let mut end = t0;
        let mut results = Vec::new();
        for h in handles {
            let r: Result<(Vec<u64>, Instant)> = h
                .join()
                .unwrap_or_else(|_| Err(Error::new("a client thread panicked")));
            results.push(r.map(|(samples, done)| {
                end = end.max(done);
                samples
            }));
        }
        (results, end - t0)
    });
    Ok((merge(results)?, per_s(iters, elapsed)))
}

/// Open loop: `iters` pairs scheduled every `1 / rate` s, taken by
/// `workers` threads in order; each sample runs from the pair's scheduled
/// start to the end of its release. Returns the rate achieved.
fn paced(
    urls: &[String],
    users: &[String],
    workers: usize,
    rate: f64,
    iters: usize,
) -> Result<(Summary, u64)> {
    let interval = Duration::from_secs_f64(1.0 / rate);
    let next = AtomicUsize::new(0);
    let start = Instant::now() + Duration::from_millis(50);
    let results: Vec<Result<(Vec<u64>, Instant)>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..workers)
            .map(|t| {
                let next = &next;
                scope.spawn(move || {
                    let agent = agent();
                    let token = &users[t % users.len()];
                    let mut samples = Vec::new();
                    let mut done = start;
                    loop {
                        let k = next.fetch_add(1, Ordering::Relaxed);
                        if k >= iters {
                            break;
                        }
                        let due = start + interval * k as u32;
                        let now = Instant::now();
                        if due > now {
                            std::thread::sleep(due - now);
                        }
                        grant_and_release(&agent, &urls[k % urls.len()], token)?;
                        done = Instant::now();
                        samples.push((done - due).as_nanos() as u64);
                    }
                    Ok((samples, done))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(Error::new("a client thread panicked")))
            })
            .collect()
    });
    let mut end = start;
    let mut samples = Vec::new();
    for r in results {
        let (s, done) = r?;
        end = end.max(done);
        samples.push(Ok(s));
    }
    Ok((merge(samples)?, per_s(iters, end - start)))
}

/// `iters` registrations of new nodes, each on the next replica; a
/// sample ends when the last replica's view shows the node (`GET
/// /v1/nodes/{name}`, which reads the view as the listing does, at a
/// cost that does not grow with the nodes). Each waits a
/// random part of `refresh_ms` first: otherwise every registration would
/// start just after the slowest replica's reload, which is what ended the
/// sample before, and SQLite's figure would always be a whole period. The
/// nodes are drained after, so later grants do not pick them.
pub(crate) fn node_visible(
    urls: &[String],
    admin: &str,
    iters: usize,
    round: usize,
    refresh_ms: u64,
) -> Result<Summary> {
    let a = agent();
    let pollers: Vec<ureq::Agent> = urls.iter().map(|_| agent()).collect();
    let mut samples = Vec::with_capacity(iters);
    let mut names = Vec::with_capacity(iters);
    let deadline = Duration::from_secs(30);
    for k in 0..iters {
        let name = format!("bench-vis-{}-{round}-{k}", std::process::id());
        let token = credential(&a, &urls[0], admin, "node", &name)?;
        let body = register_body(NODES + k, 1);
        let target = &urls[k % urls.len()];
        let go = Barrier::new(urls.len() + 1);
        std::thread::sleep(Duration::from_millis(fastrand::u64(0..refresh_ms.max(1))));
        let (t0, seen) = std::thread::scope(|scope| {
            let handles: Vec<_> = urls
                .iter()
                .zip(&pollers)
                .map(|(url, agent)| {
                    let (go, name) = (&go, &name);
                    scope.spawn(move || -> Result<Instant> {
                        let show = format!("{url}/v1/nodes/{name}");
                        go.wait();
                        let since = Instant::now();
                        loop {
                            let (status, text) = call(agent, "GET", &show, admin, None)?;
                            match status {
                                200 => return Ok(Instant::now()),
                                404 => {}
                                _ => {
                                    return Err(Error::new(format!(
                                        "GET {show} answered {status}, not 200 or 404: {text}"
                                    )))
                                }
                            }
                            if since.elapsed() > deadline {
                                return Err(Error::new(format!(
                                    "the replica at {url} did not show node {name} within {deadline:?}"
                                )));
                            }
                            std::thread::sleep(POLL);
                        }
                    })
                })
                .collect();
            go.wait();
            let t0 = Instant::now();
            let put = expect(
                &a,
                "PUT",
                &format!("{target}/v1/nodes/{name}"),
                &token,
                Some(&body),
                200,
            );
            let seen: Vec<Result<Instant>> = handles
                .into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err(Error::new("a polling thread panicked")))
                })
                .collect();
            (t0, put.map(|_| seen))
        });
        let mut last = t0;
        for s in seen? {
            last = last.max(s?);
        }
        samples.push((last - t0).as_nanos() as u64);
        names.push(name);
    }
    for name in &names {
        expect(
            &a,
            "POST",
            &format!("{}/v1/nodes/{name}/drain", urls[0]),
            admin,
            None,
            200,
        )?;
    }
    Summary::of(&mut samples).ok_or_else(|| Error::new("no samples were taken"))
}

/// `clients` tasks on a pool of `clients` connections (one on SQLite) run the manager's
/// own grant and release transactions, `warmup` pairs in all untimed then
/// `iters`; task `t` is the account of `lease_grant`'s thread `t`.
fn raw_db_grant(
    url: &str,
    accounts: &[String],
    clients: usize,
    iters: usize,
    warmup: usize,
) -> Result<(Summary, u64)> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| Error::new(format!("could not start a tokio runtime: {e}")))?;
    runtime.block_on(async {
        // As many connections as clients, but one on SQLite, as a
        // replica's default: it takes one writer at a time, and more
        // connections only wait in its busy handler.
        let conns = match Backend::of(url) {
            Backend::Sqlite => 1,
            _ => clients as u32,
        };
        let pool = db::open_and_migrate(url, conns).await.map_err(raw_err)?;
        let store = Store::new(pool, Backend::of(url));
        // SQLite's log is checkpointed off the commits' path, as a
        // replica does it.
        let (stop, stopped) = tokio::sync::watch::channel(false);
        if Backend::of(url) == Backend::Sqlite {
            tokio::spawn(db::checkpoints(url.to_owned(), stopped));
        }
        let nodes: Vec<(String, u32)> = store
            .nodes()
            .await
            .map_err(raw_err)?
            .into_iter()
            .map(|n| n.node)
            .filter(|n| n.state == NodeState::Up && n.leased_cores < n.cores)
            .map(|n| (n.name, n.cores - n.leased_cores))
            .collect();
        let nodes = Arc::new(nodes);
        // The accounting instances, as a replica's view holds them: a
        // grant takes billing slots as the manager's does.
        let instances = Arc::new(View::default());
        instances.replace_instances(store.accounting_instances().await.map_err(raw_err)?);
        raw_phase(&store, &nodes, &instances, accounts, clients, warmup).await?;
        let t0 = Instant::now();
        let (samples, end) =
            raw_phase(&store, &nodes, &instances, accounts, clients, iters).await?;
        store.pool().close().await;
        let _ = stop.send(true);
        let mut samples = samples;
        let summary =
            Summary::of(&mut samples).ok_or_else(|| Error::new("no samples were taken"))?;
        Ok((summary, per_s(iters, end - t0)))
    })
}

fn raw_err(e: db::DbError) -> Error {
    Error::new(format!("raw_db_grant: {e}"))
}

/// `n` grant-and-release pairs in all from `clients` tasks: the samples,
/// and when the last one ended.
async fn raw_phase(
    store: &Store,
    nodes: &Arc<Vec<(String, u32)>>,
    instances: &Arc<View>,
    accounts: &[String],
    clients: usize,
    n: usize,
) -> Result<(Vec<u64>, Instant)> {
    let left = Arc::new(AtomicUsize::new(n));
    let mut tasks = tokio::task::JoinSet::new();
    for t in 0..clients {
        let (store, nodes, instances, left) = (
            store.clone(),
            nodes.clone(),
            instances.clone(),
            left.clone(),
        );
        let account = accounts[t % accounts.len()].clone();
        tasks.spawn(async move {
            let mut samples = Vec::new();
            let mut end = Instant::now();
            while left
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| v.checked_sub(1))
                .is_ok()
            {
                let mut candidates = nodes.as_ref().clone();
                fastrand::shuffle(&mut candidates);
                let now = rfaas_service::now_s();
                let plan = GrantPlan {
                    owner: format!("user:{account}"),
                    user: account.clone(),
                    account: account.clone(),
                    cap: None,
                    candidates,
                    cores: 1,
                    min_cores: 1,
                    memory_mib: GRANT_MEMORY_MIB,
                    issued_at: now,
                    expires_at: now + GRANT_DURATION_S,
                    job_id: None,
                    billing: instances.billing_candidates(
                        rfaas_service::now_ms(),
                        DEFAULT_ACCOUNTING_LOST_AFTER_MS,
                    ),
                    billing_required: false,
                };
                let t0 = Instant::now();
                let grant_id = match retrying(|| store.grant(&plan)).await.map_err(raw_err)? {
                    GrantOutcome::Granted { grant_id, leases } => {
                        instances.apply_slots(&leases);
                        grant_id
                    }
                    other => {
                        return Err(Error::new(format!(
                            "raw_db_grant: the database refused a grant of 1 core: {other:?}"
                        )))
                    }
                };
                retrying(|| {
                    store.end_grant(grant_id, LeaseState::Released, rfaas_service::now_ms())
                })
                .await
                .map_err(raw_err)?;
                end = Instant::now();
                samples.push((end - t0).as_nanos() as u64);
            }
            Ok::<_, Error>((samples, end))
        });
    }
    let mut all = Vec::with_capacity(n);
    let mut last = Instant::now();
    while let Some(joined) = tasks.join_next().await {
        let (samples, end) =
            joined.map_err(|e| Error::new(format!("a raw_db_grant task failed: {e}")))??;
        all.extend(samples);
        last = last.max(end);
    }
    Ok((all, last))
}

/// The ratio rows: `lease_grant` over `raw_db_grant` ops/s at the same
/// backend and concurrency, for each replica count.
pub fn derive(rows: &[Row]) -> Vec<Row> {
    let ops = |r: &Row| match &r.measure {
        Measure::Service { ops_per_s, .. } => *ops_per_s,
        _ => None,
    };
    let mut out = Vec::new();
    for grant in rows.iter().filter(|r| r.name == LEASE_GRANT) {
        let Some(point) = &grant.service else {
            continue;
        };
        let raw = rows.iter().find(|r| {
            r.name == RAW_DB_GRANT
                && r.service.as_ref().is_some_and(|p| {
                    p.backend == point.backend && p.concurrency == point.concurrency
                })
        });
        if let (Some(a), Some(b)) = (ops(grant), raw.and_then(ops)) {
            if b == 0 {
                continue;
            }
            let mut row = Row::ratio(
                RATIO,
                "",
                0,
                a as f64 / b as f64,
                format!("{LEASE_GRANT} / {RAW_DB_GRANT}"),
                Some(GRANT_MIN_RATIO),
            );
            row.service = Some(point.clone());
            out.push(row);
        }
    }
    for aged in rows.iter().filter(|r| r.name == LEASE_GRANT_AGED) {
        let Some(point) = &aged.service else {
            continue;
        };
        let fresh = rows
            .iter()
            .find(|r| r.name == LEASE_GRANT && r.service.as_ref() == Some(point));
        if let (Some(a), Some(b)) = (ops(aged), fresh.and_then(ops)) {
            if b == 0 {
                continue;
            }
            let mut row = Row::ratio(
                AGED_RATIO,
                "",
                0,
                a as f64 / b as f64,
                format!("{LEASE_GRANT_AGED} / {LEASE_GRANT}"),
                Some(AGED_MIN_RATIO),
            );
            row.service = Some(point.clone());
            out.push(row);
        }
    }
    out
}

//! Shared by the manager's integration tests: a database of either kind,
//! managers on it, and node and user callers.

#![allow(dead_code)]

use rfaas_testkit::manager::{Api, Manager, ManagerOptions};
use serde_json::{json, Value};

pub use rfaas_testkit::postgres::Postgres;

/// The database a test runs on: a SQLite file (made by the manager), or a
/// throwaway PostgreSQL server of its own.
#[derive(Debug)]
pub enum Db {
    /// SQLite: `None` until the first manager creates the file.
    Sqlite(Option<String>),
    /// PostgreSQL.
    Postgres(Postgres),
}

impl Db {
    /// A fresh database of `kind` ("sqlite" or "postgres").
    pub fn new(kind: &str) -> Db {
        match kind {
            "sqlite" => Db::Sqlite(None),
            "postgres" => Db::Postgres(Postgres::start().unwrap_or_else(|e| panic!("{e}"))),
            other => panic!("no backend {other}"),
        }
    }

    /// Starts a manager on this database with `extra` configuration.
    pub fn manager_with(&mut self, extra: &str, key: Option<&Manager>) -> Manager {
        self.manager_serving(extra, key, true)
    }

    /// As [`Db::manager`], serving plain HTTP on loopback: for tests that
    /// write raw requests on the socket (what they test lies above TLS).
    #[allow(dead_code)]
    pub fn plain_manager(&mut self, extra: &str) -> Manager {
        let quiet = if extra.contains("lost_after_ms") {
            ""
        } else {
            "lost_after_ms = 600000\n"
        };
        self.manager_serving(&format!("{quiet}{extra}"), None, false)
    }

    fn manager_serving(&mut self, extra: &str, key: Option<&Manager>, tls: bool) -> Manager {
        let defaults = ManagerOptions {
            tls,
            ..ManagerOptions::default()
        };
        // `extra` overrides the test defaults it names.
        let kept: String = defaults
            .extra_config
            .lines()
            .filter(|l| {
                let key = l.split('=').next().unwrap_or("").trim();
                !extra
                    .lines()
                    .any(|e| e.split('=').next().unwrap_or("").trim() == key)
            })
            .map(|l| format!("{l}\n"))
            .collect();
        let mut opts = ManagerOptions {
            extra_config: format!("{kept}{extra}"),
            ..defaults
        };
        if let Some(k) = key {
            opts.lease_key = Some(k.lease_key().to_owned());
            opts.admin_token = Some(k.admin_token().to_owned());
        }
        match self {
            Db::Sqlite(url) => {
                opts.database = url.clone();
                let m = Manager::start(opts);
                *url = Some(m.database().to_owned());
                m
            }
            Db::Postgres(pg) => {
                opts.database = Some(pg.url().to_owned());
                Manager::start(opts)
            }
        }
    }

    /// Starts a manager with the test defaults, except that nodes are
    /// never lost: the tests register nodes by hand and do not heartbeat,
    /// and on a loaded machine a second may pass between two requests.
    pub fn manager(&mut self) -> Manager {
        self.manager_with("lost_after_ms = 600000\n", None)
    }

    /// Starts a manager with the test defaults: a node that sends no
    /// heartbeat is lost after a second.
    pub fn manager_that_loses_nodes(&mut self) -> Manager {
        self.manager_with("", None)
    }

    /// The database's URL (SQLite: once a manager has made the file).
    pub fn url(&self) -> String {
        match self {
            Db::Sqlite(Some(url)) => url.clone(),
            Db::Sqlite(None) => panic!("no manager has made the SQLite file yet"),
            Db::Postgres(pg) => pg.url().to_owned(),
        }
    }

    /// Runs `statements` (one per item) straight on the database, in one
    /// transaction, as another service sharing it would; returns the rows
    /// of the last.
    fn rows(&self, statements: &[&str]) -> Vec<sqlx::any::AnyRow> {
        let url = self.url();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let pool = rfaas_service::db::open(&url, 1).await.unwrap();
            let mut tx = pool.begin().await.unwrap();
            let mut rows = Vec::new();
            for stmt in statements {
                rows = sqlx::query(stmt)
                    .fetch_all(&mut *tx)
                    .await
                    .unwrap_or_else(|e| panic!("{stmt}: {e}"));
            }
            tx.commit().await.unwrap();
            pool.close().await;
            rows
        })
    }

    /// As [`rows`](Self::rows), each column read as a number.
    pub fn sql(&self, statements: &[&str]) -> Vec<Vec<i64>> {
        use sqlx::Row;
        self.rows(statements)
            .iter()
            .map(|r| {
                (0..r.len())
                    .map(|k| r.try_get::<i64, _>(k).unwrap())
                    .collect()
            })
            .collect()
    }

    /// How the database would run `statement`: PostgreSQL's `EXPLAIN` or
    /// SQLite's `EXPLAIN QUERY PLAN`, its lines joined.
    pub fn plan(&self, statement: &str) -> String {
        use sqlx::Row;
        let (sql, column) = match self {
            Db::Sqlite(_) => (format!("EXPLAIN QUERY PLAN {statement}"), "detail"),
            Db::Postgres(_) => (format!("EXPLAIN {statement}"), "QUERY PLAN"),
        };
        self.rows(&[&sql])
            .iter()
            .map(|r| r.try_get::<String, _>(column).unwrap())
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// Registers accounting instance `name` with `slots` free billing
    /// slots and a heartbeat at `last_heartbeat_ms`, as the accounting
    /// service does at start.
    pub fn add_instance(&self, name: &str, slots: u32, last_heartbeat_ms: u64) {
        self.sql(&[
            &format!(
                "INSERT INTO accounting_instances (name, provider, fabric_addr, metrics_addr, slots, region_id, started_ms, last_heartbeat_ms)
                 VALUES ('{name}', 'tcp', '127.0.0.1:7400', '127.0.0.1:7401', {slots}, 42, 1, {last_heartbeat_ms})"
            ),
            &format!(
                "WITH RECURSIVE s(n) AS (SELECT 0 UNION ALL SELECT n + 1 FROM s WHERE n + 1 < {slots})
                 INSERT INTO billing_slots (instance, slot, lease_id, assigned_ms) SELECT '{name}', n, 0, 0 FROM s"
            ),
        ]);
    }
}

/// `[accounting]` for tests: instances stay live for ten minutes after
/// the heartbeat a test writes.
pub const ACCOUNTING: &str = "accounting = { lost_after_ms = 600000 }\n";

/// Waits until `m`'s view holds `live` live and `lost` lost accounting
/// instances (it reloads them every `refresh_ms`).
pub fn wait_for_instances(m: &Manager, live: u32, lost: u32) {
    let want = [
        format!("rfaas_manager_accounting_instances{{state=\"live\"}} {live}"),
        format!("rfaas_manager_accounting_instances{{state=\"lost\"}} {lost}"),
    ];
    let open = Api::new(m.url(), "");
    let within = std::time::Duration::from_secs(20);
    let mut text = String::new();
    rfaas_testkit::wait::poll_for(within, || {
        let (_, body) = open.call("GET", "/metrics", None);
        text = body.as_str().unwrap_or("").to_owned();
        want.iter()
            .all(|w| text.lines().any(|l| l == w))
            .then_some(())
    })
    .unwrap_or_else(|| {
        panic!("waited {within:?} for the manager to see {live} live and {lost} lost instances:\n{text}")
    });
}

/// A counter's value in `m`'s metrics.
pub fn metric(m: &Manager, line_start: &str) -> f64 {
    let (_, text) = Api::new(m.url(), "").call("GET", "/metrics", None);
    let text = text.as_str().unwrap_or("").to_owned();
    text.lines()
        .find_map(|l| l.strip_prefix(line_start)?.trim().parse().ok())
        .unwrap_or_else(|| panic!("{line_start} not in\n{text}"))
}

/// A registration body.
pub fn node_body(port: u16, cores: u32, memory_mib: u64) -> Value {
    json!({
        "control_addr": format!("127.0.0.1:{port}"),
        "providers": [{"name": "tcp", "host": "127.0.0.1"}, {"name": "shm"}],
        "cores": cores,
        "memory_mib": memory_mib,
        "version": "test"
    })
}

/// Registers node `name` with its own credential; returns its caller.
pub fn register(m: &Manager, name: &str, cores: u32, memory_mib: u64) -> Api {
    let cred = m.credential("node", name, None);
    let api = Api::new(m.url(), &cred);
    let (status, reply) = api.call(
        "PUT",
        &format!("/v1/nodes/{name}"),
        Some(&node_body(7100, cores, memory_mib)),
    );
    assert_eq!(status, 200, "register {name}: {reply}");
    api
}

/// A user's caller.
pub fn user(m: &Manager, name: &str, account: &str) -> Api {
    Api::new(m.url(), &m.credential("user", name, Some(account)))
}

/// `POST /v1/leases`.
pub fn lease(api: &Api, cores: u32, min: Option<u32>, memory: u64, secs: u64) -> (u16, Value) {
    let mut body = json!({"cores": cores, "memory_mib": memory, "duration_s": secs});
    if let Some(min) = min {
        body["min_cores"] = min.into();
    }
    api.call("POST", "/v1/leases", Some(&body))
}

/// `POST /v1/leases`, which must grant: the grant.
pub fn granted(api: &Api, cores: u32, memory: u64, secs: u64) -> Value {
    let (s, g) = lease(api, cores, None, memory, secs);
    assert_eq!(s, 201, "{g}");
    g
}

/// Cores granted in a grant body.
pub fn granted_cores(grant: &Value) -> u64 {
    grant["leases"]
        .as_array()
        .expect("leases")
        .iter()
        .map(|l| l["cores"].as_u64().unwrap())
        .sum()
}

/// Checks the pool's invariant through the admin API: on every node, the
/// leased cores equal the sum of its active leases and stay within its
/// cores; returns the total leased.
pub fn check_no_core_leased_twice(m: &Manager) -> u64 {
    let admin = m.admin();
    let (s, leases) = admin.call("GET", "/v1/leases?limit=100000", None);
    assert_eq!(s, 200, "{leases}");
    let (s, nodes) = admin.call("GET", "/v1/nodes?fresh=true", None);
    assert_eq!(s, 200, "{nodes}");
    let mut total = 0;
    for n in nodes.as_array().unwrap() {
        let name = n["name"].as_str().unwrap();
        let sum: u64 = leases
            .as_array()
            .unwrap()
            .iter()
            .filter(|l| l["node"] == name && l["state"] == "active")
            .map(|l| l["cores"].as_u64().unwrap())
            .sum();
        assert_eq!(
            n["leased_cores"].as_u64().unwrap(),
            sum,
            "node {name}: its counter and its leases disagree"
        );
        assert!(
            sum <= n["cores"].as_u64().unwrap(),
            "node {name} over-leased: {sum} > {}",
            n["cores"]
        );
        total += sum;
    }
    total
}

//! Shared by the accounting service's integration tests: a database of
//! either kind with a real manager on it (which mints the daemons' node
//! credentials), accounting instances on the same database, and SQL
//! helpers that play the manager's part in slot assignment.

#![allow(dead_code)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use rfaas_accounting::store::{self, UsageRow};
use rfaas_proto::accounting::{Counter, SlotTotals, UsageFigures};
use rfaas_testkit::accounting::{credential_id, sign_ticket, Accounting, AccountingOptions};
use rfaas_testkit::executord::ExecutordOptions;
use rfaas_testkit::manager::{Manager, ManagerOptions};
use rfaas_testkit::postgres::Postgres;
use rfaas_testkit::wait::{poll_for, wait_until, TIMEOUT};
use sqlx::{AnyPool, Row};

/// The billing configuration the tests price with.
pub const BILLING: &str = "currency = \"CHF\"\n[rates]\nalloc_per_gib_s = 0.5\ncompute_per_s = 2.0\nhot_per_s = 1.0\nharvested_discount = 0.5\n[budgets]\nphysics = 100.0\n";

/// A database with a manager on it, and a connection of the test's own.
pub struct Env {
    /// The manager (mints credentials; its migrations made the schema).
    pub manager: Manager,
    /// The database URL.
    pub url: String,
    /// The PostgreSQL server, for the PostgreSQL case.
    pub pg: Option<Postgres>,
    pool: AnyPool,
    rt: tokio::runtime::Runtime,
}

impl Env {
    /// A fresh database of `kind` ("sqlite" or "postgres") with a manager.
    pub fn new(kind: &str) -> Env {
        Env::with_manager_config(kind, "")
    }

    /// [`Env::new`] with `manager_config` appended to the manager's
    /// configuration (after its top-level keys: start it with a table).
    pub fn with_manager_config(kind: &str, manager_config: &str) -> Env {
        let pg = match kind {
            "sqlite" => None,
            "postgres" => Some(Postgres::start().unwrap_or_else(|e| panic!("{e}"))),
            other => panic!("no backend {other}"),
        };
        // A very slow machine (an emulated VM) can miss the manager's
        // 2 s wait for its first SQLite connection: a few tries.
        let mut opts = ManagerOptions {
            database: pg.as_ref().map(|p| p.url().to_owned()),
            ..ManagerOptions::default()
        };
        opts.extra_config.push_str(manager_config);
        let binary = rfaas_testkit::manager::manager_binary();
        let manager = (0..3)
            .find_map(|_| Manager::try_start(&binary, opts.clone()).ok())
            .unwrap_or_else(|| Manager::start(opts));
        let url = manager.database().to_owned();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let pool = rt
            .block_on(async {
                let mut tries = 0;
                loop {
                    match rfaas_service::db::open(&url, 2).await {
                        Err(rfaas_service::db::DbError::Unavailable(_)) if tries < 5 => tries += 1,
                        other => break other,
                    }
                }
            })
            .unwrap_or_else(|e| panic!("open {url}: {e}"));
        Env {
            manager,
            url,
            pg,
            pool,
            rt,
        }
    }

    /// Options of an accounting instance on this database, pricing with
    /// [`BILLING`].
    pub fn options(&self) -> AccountingOptions {
        AccountingOptions {
            billing: Some(BILLING.into()),
            lease_keys: vec![self.manager.public_key_line()],
            ..AccountingOptions::new(&self.url)
        }
    }

    /// Starts an accounting instance with [`Env::options`].
    pub fn accounting(&self) -> Accounting {
        Accounting::start(self.options())
    }

    /// A new node credential for `node`, minted through the manager.
    pub fn node_credential(&self, node: &str) -> String {
        self.manager.credential("node", node, None)
    }

    /// An accounting ticket for `node` under a new node credential, signed
    /// with the manager's key as its replies carry one (registering the
    /// node would have the manager end the tests' leases on it once it
    /// missed its heartbeats).
    pub fn node_ticket(&self, node: &str) -> String {
        self.ticket_for(node, &self.node_credential(node))
    }

    /// A ticket for `node` under a live credential, well formed, with the
    /// manager's key id, but signed by another key.
    pub fn forged_ticket(&self, node: &str) -> String {
        let dir = std::env::temp_dir().join(format!("rfaas-forger-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let key = dir.join("forger.secret");
        rfaas_testkit::manager::write_lease_key(&key).unwrap();
        let now = rfaas_service::now_s();
        let t = sign_ticket(
            &key,
            node,
            credential_id(&self.node_credential(node)),
            now,
            now + 600,
        );
        let _ = std::fs::remove_dir_all(&dir);
        t
    }

    /// A ticket for `node` under a live credential, signed by the
    /// manager's key, that ended `ago_s` seconds ago.
    pub fn expired_ticket(&self, node: &str, ago_s: u64) -> String {
        let now = rfaas_service::now_s();
        sign_ticket(
            self.manager.lease_key(),
            node,
            credential_id(&self.node_credential(node)),
            now - ago_s - 600,
            now - ago_s,
        )
    }

    /// An accounting ticket for `node` under `credential`, valid ten
    /// minutes from now.
    pub fn ticket_for(&self, node: &str, credential: &str) -> String {
        let now = rfaas_service::now_s();
        sign_ticket(
            self.manager.lease_key(),
            node,
            credential_id(credential),
            now,
            now + 600,
        )
    }

    /// The test's own pool on the database.
    pub fn pool(&self) -> &AnyPool {
        &self.pool
    }

    /// Runs `f` to completion.
    pub fn block<T>(&self, f: impl std::future::Future<Output = T>) -> T {
        self.rt.block_on(f)
    }

    /// Inserts an active lease `id` of `account` on node `n1`, as a grant
    /// would.
    pub fn insert_lease(&self, id: u64, account: &str, harvested: bool) {
        self.insert_lease_on(id, account, harvested, "n1");
    }

    /// Inserts an active lease `id` of `account` on `node`.
    pub fn insert_lease_on(&self, id: u64, account: &str, harvested: bool, node: &str) {
        let now = rfaas_service::now_ms() as i64;
        let p = &self.pool;
        self.rt.block_on(async {
            sqlx::query(
                "INSERT INTO leases (id, grant_id, node, owner, user_name, account, cores, memory_mib, issued_at, expires_at, state, ended_ms, harvested)
                 VALUES ($1, $1, $6, 'user:alice', 'alice', $2, 1, 1024, $3, $4, 'active', 0, $5)",
            )
            .bind(id as i64)
            .bind(account)
            // Granted an hour ago: time enough for the usage the tests add
            // (the flusher refuses more than cores x wall-clock time).
            .bind(now / 1000 - 3600)
            .bind(now / 1000 + 3600)
            .bind(i64::from(harvested))
            .bind(node)
            .execute(p)
            .await
            .unwrap();
        });
    }

    /// Ends lease `id` at `ended_ms`.
    pub fn end_lease(&self, id: u64, ended_ms: u64) {
        let p = &self.pool;
        self.rt.block_on(async {
            sqlx::query("UPDATE leases SET state = 'released', ended_ms = $2 WHERE id = $1")
                .bind(id as i64)
                .bind(ended_ms as i64)
                .execute(p)
                .await
                .unwrap();
        });
    }

    /// Assigns free `slot` of `instance` to lease `id`, as the manager's
    /// conditional update does; panics unless the slot was free.
    pub fn assign(&self, instance: &str, slot: u32, id: u64) {
        let p = &self.pool;
        let n = self.rt.block_on(async {
            sqlx::query(
                "UPDATE billing_slots SET lease_id = $3, assigned_ms = $4 WHERE instance = $1 AND slot = $2 AND lease_id = 0",
            )
            .bind(instance)
            .bind(i64::from(slot))
            .bind(id as i64)
            .bind(rfaas_service::now_ms() as i64)
            .execute(p)
            .await
            .unwrap()
            .rows_affected()
        });
        assert_eq!(n, 1, "slot {slot} of {instance} was not free");
    }

    /// The lease slot `slot` of `instance` is assigned to (0: free).
    pub fn slot_lease(&self, instance: &str, slot: u32) -> u64 {
        let p = &self.pool;
        self.rt.block_on(async {
            sqlx::query("SELECT lease_id FROM billing_slots WHERE instance = $1 AND slot = $2")
                .bind(instance)
                .bind(i64::from(slot))
                .fetch_one(p)
                .await
                .unwrap()
                .try_get::<i64, _>("lease_id")
                .unwrap() as u64
        })
    }

    /// Lease `id`'s `usage` row, if it has one.
    pub fn usage(&self, id: u64) -> Option<UsageRow> {
        self.rt
            .block_on(async { store::usage_of(&self.pool, &[id]).await.unwrap().pop() })
    }

    /// `account`'s spend.
    pub fn spend(&self, account: &str) -> f64 {
        self.rt
            .block_on(async { store::account_spend(&self.pool, account).await.unwrap() })
    }

    /// Lease `id`'s snapshots.
    pub fn snapshots(&self, id: u64) -> Vec<store::Snapshot> {
        self.rt
            .block_on(async { store::snapshots_of(&self.pool, id).await.unwrap() })
    }

    /// Runs `sql` and returns the first column of the first row as a
    /// number.
    pub fn scalar(&self, sql: &str) -> f64 {
        let p = &self.pool;
        self.rt.block_on(async {
            let row = sqlx::query(sql).fetch_one(p).await.unwrap();
            row.try_get::<f64, _>(0)
                .or_else(|_| row.try_get::<i64, _>(0).map(|v| v as f64))
                .unwrap()
        })
    }
}

/// A fresh private directory for the test `what` on a database of `kind`
/// (the caller removes it).
pub fn scratch_dir(what: &str, kind: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("rfaas-{what}-{}-{kind}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Waits until `n` nodes are up at `env`'s manager.
pub fn wait_nodes_up(env: &Env, n: usize) {
    let admin = env.manager.admin();
    wait_until(&format!("{n} nodes are up"), TIMEOUT, || {
        let (_, all) = admin.call("GET", "/v1/nodes", None);
        all.as_array()
            .is_some_and(|a| a.iter().filter(|n| n["state"] == "up").count() == n)
    });
}

/// Waits until lease `id`'s stored totals are `want` (its `closed` word
/// aside); returns the row.
pub fn wait_for_usage(env: &Env, id: u64, want: &SlotTotals) -> UsageRow {
    let want = store::stored(want);
    let mut last = None;
    poll_for(TIMEOUT, || {
        last = env.usage(id);
        last.clone().filter(|u| u.totals == want)
    })
    .unwrap_or_else(|| {
        panic!("waited {TIMEOUT:?} for lease {id}'s usage to be {want:?}; last seen {last:?}")
    })
}

/// Some usage with every counter set.
pub fn some_usage(seed: u64) -> SlotTotals {
    SlotTotals {
        usage: UsageFigures {
            alloc_mib_ms: 2048 * 1000 * seed,
            compute_ns: 1_000_000_000 * seed,
            hot_ns: 500_000_000 * seed,
            warm_ns: 7 * seed,
            invocations: 11 * seed,
            bytes_in: 13 * seed,
            bytes_out: 17 * seed,
        },
        closed: 0,
    }
}

/// The cost of `u` at [`BILLING`]'s rates.
pub fn cost(u: &SlotTotals, harvested: bool) -> f64 {
    rfaas_accounting::rates::BillingConfig::parse(BILLING)
        .unwrap()
        .rates
        .cost(&u.usage, harvested)
}

/// Asserts that a lease's stored `totals` are, counter by counter, what
/// its executors journaled (`logged`, one lease's entry of [`journaled`]);
/// `what` names the lease in the message.
pub fn assert_journaled(totals: &SlotTotals, logged: &HashMap<String, u64>, what: &str) {
    for c in Counter::ALL.into_iter().filter(|&c| c != Counter::Closed) {
        assert_eq!(
            logged.get(c.name()).copied().unwrap_or(0),
            totals.get(c),
            "{what}: {} stored is not what the executors journaled",
            c.name()
        );
    }
}

/// Sums each lease's `added` lines per counter over executor daemons'
/// billing `journals`: what the executors billed each lease.
pub fn journaled(journals: &[&Path]) -> HashMap<u64, HashMap<String, u64>> {
    let mut sums: HashMap<u64, HashMap<String, u64>> = HashMap::new();
    for j in journals {
        let text = std::fs::read_to_string(j).unwrap_or_default();
        for line in text.lines() {
            let v: serde_json::Value = serde_json::from_str(line).unwrap_or_else(|e| {
                panic!("{}: a line that is not JSON ({e}): {line:?}", j.display())
            });
            let id = v["lease_id"].as_u64().unwrap();
            if let Some(added) = v["added"].as_object() {
                let e = sums.entry(id).or_default();
                for (k, n) in added {
                    *e.entry(k.clone()).or_insert(0) += n.as_u64().unwrap();
                }
            }
        }
    }
    sums
}

/// An executor daemon `name` that registers with `env`'s manager (its node
/// credential written into `dir`) and posts usage every `granularity_ms`,
/// journaling each batch: its options and the journal's path.
pub fn billing_node(
    env: &Env,
    dir: &Path,
    name: &str,
    granularity_ms: u64,
) -> (ExecutordOptions, PathBuf) {
    let journal = dir.join(format!("{name}.billing.jsonl"));
    let mut opts = env.manager.node_options(dir, name);
    opts.extra_config += &format!(
        "[billing]\ngranularity_ms = {granularity_ms}\njournal = {:?}\n",
        journal.display().to_string(),
    );
    let opts = ExecutordOptions {
        cpus: "0-1".into(),
        memory_mib: 4096,
        ..opts
    };
    (opts, journal)
}

//! Every read and write of the manager's state, each one transaction.
//!
//! See [`crate::db`] for the rules these statements follow (one SQL text
//! for both databases, conditional updates for counters, lock order).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use rfaas_proto::accounting::BillingSlot;
use rfaas_proto::manager::{
    BudgetView, Heartbeat, LeaseState, LeaseView, NodeProvider, NodeState, NodeView, RegisterNode,
    Role,
};
use rfaas_service::budgets;
use rfaas_service::credentials::{self, CredentialRow};
use sqlx::any::AnyRow;
use sqlx::{Any, AnyPool, Row, Transaction};

use crate::announce::{Announcer, Leased};
use crate::db::{i, text_col, u64_col, Backend, DbError};
use crate::view::View;

/// The columns of a node, in the order [`node_from_row`] reads them.
const NODE_COLS: &str = "name, admin_state, lost, control_addr, providers, cores, memory_mib, leased_cores, leased_memory_mib, last_heartbeat_ms, harvested, withheld_cores, draining_cores, draining_memory_mib, lease_seq";

/// A release's settling of a node's capacity, `$2` cores and `$3` MiB
/// fewer leased: a node's `cores` is what it registered (`cores -
/// draining_cores`) or what is leased, whichever is more, so it never
/// holds less than is leased, and what drains leaves with the leases
/// (memory alike). Grants need none of it: they place nothing on a
/// draining node, whose leased cores or memory fill its capacity.
const NODE_CAPACITY: &str = "
    cores = CASE WHEN leased_cores - $2 > cores - draining_cores THEN leased_cores - $2 ELSE cores - draining_cores END,
    draining_cores = CASE WHEN leased_cores - $2 > cores - draining_cores
        THEN leased_cores - $2 - (cores - draining_cores) ELSE 0 END,
    memory_mib = CASE WHEN leased_memory_mib - $3 > memory_mib - draining_memory_mib
        THEN leased_memory_mib - $3 ELSE memory_mib - draining_memory_mib END,
    draining_memory_mib = CASE WHEN leased_memory_mib - $3 > memory_mib - draining_memory_mib
        THEN leased_memory_mib - $3 - (memory_mib - draining_memory_mib) ELSE 0 END";

/// A node as stored: what the API shows, and how many grants and releases
/// have changed its leased counters (`lease_seq`), which orders the
/// counters replicas hear of out of commit order (see [`crate::announce`]).
#[derive(Debug, Clone, PartialEq)]
pub struct StoredNode {
    /// The node.
    pub node: NodeView,
    /// Its `lease_seq` when read.
    pub lease_seq: u64,
}

/// The columns of a lease, in the order [`lease_from_row`] reads them.
const LEASE_COLS: &str =
    "id, grant_id, node, owner, user_name, account, cores, memory_mib, issued_at, expires_at, state, job_id";

/// A node lease as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseRow {
    /// What the API shows.
    pub view: LeaseView,
    /// The credential subject that asked for it (renews and releases it).
    pub owner: String,
    /// Its billing slot, where the caller asked for it (grants and
    /// renewals); `None` there: unbilled.
    pub billing: Option<BillingSlot>,
}

/// An accounting instance (`accounting_instances`, written by the
/// accounting service) and how many of its slots hold a lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AccountingInstance {
    /// Its name.
    pub name: String,
    /// Its fabric provider.
    pub provider: String,
    /// Its fabric address.
    pub fabric_addr: String,
    /// Slots in its region.
    pub slots: u32,
    /// Slots assigned to a lease (not yet freed by its flusher).
    pub used: u32,
    /// Its last heartbeat, Unix ms.
    pub last_heartbeat_ms: u64,
}

impl AccountingInstance {
    /// Slots free.
    pub fn free(&self) -> u32 {
        self.slots.saturating_sub(self.used)
    }

    /// Whether it heartbeat within `lost_after_ms` of `now_ms`.
    pub fn live(&self, now_ms: u64, lost_after_ms: u64) -> bool {
        now_ms.saturating_sub(self.last_heartbeat_ms) <= lost_after_ms
    }
}

/// What a grant asks the database for.
#[derive(Debug, Clone)]
pub struct GrantPlan {
    /// The credential subject asking.
    pub owner: String,
    /// The user the workers run as.
    pub user: String,
    /// The account charged.
    pub account: String,
    /// The account's cap on cores held at once.
    pub cap: Option<u32>,
    /// Nodes to try, best first, with the free cores the replica's view
    /// believes each has.
    pub candidates: Vec<(String, u32)>,
    /// Cores wanted.
    pub cores: u32,
    /// Fewest cores worth granting.
    pub min_cores: u32,
    /// Memory per node lease, MiB.
    pub memory_mib: u64,
    /// Unix seconds.
    pub issued_at: u64,
    /// Unix seconds.
    pub expires_at: u64,
    /// The batch job the leases serve, if known.
    pub job_id: Option<u64>,
    /// Accounting instances to take billing slots from, best first (see
    /// [`crate::view::View::billing_candidates`]); empty: unbilled.
    pub billing: Vec<AccountingInstance>,
    /// Refuse the grant ([`GrantOutcome::AccountingUnavailable`]) rather
    /// than leave a node lease unbilled.
    pub billing_required: bool,
}

/// A grant's outcome.
#[derive(Debug, Clone, PartialEq)]
pub enum GrantOutcome {
    /// Granted: the new node leases, under `grant_id`.
    Granted {
        /// The grant's id.
        grant_id: u64,
        /// Its node leases.
        leases: Vec<LeaseRow>,
    },
    /// Not enough cores fit.
    NoCapacity,
    /// The account's cap would be passed.
    Quota {
        /// The cap.
        cap: u32,
        /// Cores the account holds now.
        in_use: u64,
    },
    /// The account has spent its budget.
    BudgetExhausted {
        /// Its budget.
        budget: f64,
        /// What it has spent.
        spend: f64,
    },
    /// A node lease found no free billing slot, and billing is required.
    AccountingUnavailable,
}

/// The manager's database.
#[derive(Debug, Clone)]
pub struct Store {
    pool: AnyPool,
    backend: Backend,
    /// This replica's name in its notices: random per process.
    origin: String,
    /// Where committed leased counters go: this replica's view, if it has
    /// one ([`Store::with_view`]), and the other replicas, on PostgreSQL.
    announcer: Option<Arc<Announcer>>,
    view: Option<Arc<View>>,
}

/// What a notice on `rfaas_nodes` says of one node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Announced<'a> {
    /// `<node>`: it changed; read it again.
    Changed(&'a str),
    /// `<node>=<cores>/<memory_mib>/<seq>`: what it has leased since the
    /// commit that set its `lease_seq` to `seq` (a grant or a release),
    /// nothing else changed. Batches arrive out of commit order: the
    /// highest `seq` is the node's state.
    Leased {
        node: &'a str,
        cores: u32,
        memory_mib: u64,
        seq: u64,
    },
}

impl<'a> Announced<'a> {
    /// The node it is about.
    pub fn node(&self) -> &'a str {
        match *self {
            Announced::Changed(node) | Announced::Leased { node, .. } => node,
        }
    }

    fn parse(entry: &'a str) -> Announced<'a> {
        let leased = entry.split_once('=').and_then(|(node, counts)| {
            let mut counts = counts.split('/');
            let cores = counts.next()?.parse().ok()?;
            let memory_mib = counts.next()?.parse().ok()?;
            let seq = counts.next()?.parse().ok()?;
            counts.next().is_none().then_some(Announced::Leased {
                node,
                cores,
                memory_mib,
                seq,
            })
        });
        // Anything else names a node to read again (node names have no
        // `=`): a notice this replica cannot read costs a query, not a
        // stale view.
        leased.unwrap_or(Announced::Changed(entry.split('=').next().unwrap_or(entry)))
    }
}

/// A notice on `rfaas_nodes`, `<origin>:<entry>,<entry>...`: the replica
/// that sent it (`None` from a replica that did not say) and what changed
/// (see [`Announced`]).
pub fn notice(payload: &str) -> (Option<&str>, Vec<Announced<'_>>) {
    let (origin, entries) = match payload.split_once(':') {
        Some((origin, entries)) => (Some(origin), entries),
        None => (None, payload),
    };
    (
        origin,
        entries
            .split(',')
            .filter(|n| !n.is_empty())
            .map(Announced::parse)
            .collect(),
    )
}

/// `node`'s `leased_cores, leased_memory_mib, lease_seq`.
fn leased_cols(node: &str, row: &AnyRow) -> Result<Leased, DbError> {
    Ok(Leased {
        node: node.to_owned(),
        cores: u64_col(row, "leased_cores")? as u32,
        memory_mib: u64_col(row, "leased_memory_mib")?,
        seq: u64_col(row, "lease_seq")?,
    })
}

fn node_from_row(row: &AnyRow) -> Result<StoredNode, DbError> {
    let admin: String = text_col(row, "admin_state")?;
    let lost = u64_col(row, "lost")? != 0;
    let state = if lost {
        NodeState::Lost
    } else if admin == "drained" {
        NodeState::Drained
    } else {
        NodeState::Up
    };
    let providers: Vec<NodeProvider> = serde_json::from_str(&text_col(row, "providers")?)
        .map_err(|e| DbError::Other(format!("stored providers: {e}")))?;
    let node = NodeView {
        name: text_col(row, "name")?,
        state,
        control_addr: text_col(row, "control_addr")?,
        providers,
        cores: u64_col(row, "cores")? as u32,
        memory_mib: u64_col(row, "memory_mib")?,
        leased_cores: u64_col(row, "leased_cores")? as u32,
        leased_memory_mib: u64_col(row, "leased_memory_mib")?,
        last_heartbeat_ms: u64_col(row, "last_heartbeat_ms")?,
        harvested: u64_col(row, "harvested")? != 0,
        withheld_cores: u64_col(row, "withheld_cores")? as u32,
        draining_cores: u64_col(row, "draining_cores")? as u32,
        draining_memory_mib: u64_col(row, "draining_memory_mib")?,
    };
    Ok(StoredNode {
        node,
        lease_seq: u64_col(row, "lease_seq")?,
    })
}

fn lease_state(s: &str) -> LeaseState {
    match s {
        "active" => LeaseState::Active,
        "released" => LeaseState::Released,
        "lost" => LeaseState::Lost,
        _ => LeaseState::Expired,
    }
}

/// The stored name of a lease state.
pub fn lease_state_name(s: LeaseState) -> &'static str {
    match s {
        LeaseState::Active => "active",
        LeaseState::Released => "released",
        LeaseState::Expired => "expired",
        LeaseState::Lost => "lost",
    }
}

fn lease_from_row(row: &AnyRow) -> Result<LeaseRow, DbError> {
    Ok(LeaseRow {
        owner: text_col(row, "owner")?,
        billing: None,
        view: LeaseView {
            lease_id: u64_col(row, "id")?,
            grant_id: u64_col(row, "grant_id")?,
            node: text_col(row, "node")?,
            user: text_col(row, "user_name")?,
            account: text_col(row, "account")?,
            cores: u64_col(row, "cores")? as u32,
            memory_mib: u64_col(row, "memory_mib")?,
            issued_at: u64_col(row, "issued_at")?,
            expires_at: u64_col(row, "expires_at")?,
            state: lease_state(&text_col(row, "state")?),
            job_id: row.try_get::<Option<i64>, _>("job_id")?.map(|v| v as u64),
        },
    })
}

/// A new random id: 53 bits, so that JSON readers that hold numbers as
/// doubles read it exactly.
pub fn new_id() -> u64 {
    fastrand::u64(1..1 << 53)
}

impl Store {
    /// Wraps an open, migrated pool.
    pub fn new(pool: AnyPool, backend: Backend) -> Store {
        let origin = format!("{:016x}", fastrand::u64(..));
        Store {
            announcer: (backend == Backend::Postgres)
                .then(|| Arc::new(Announcer::new(pool.clone(), origin.clone()))),
            pool,
            backend,
            origin,
            view: None,
        }
    }

    /// This store, applying every grant's and release's counters to `view`
    /// as it commits them.
    pub fn with_view(mut self, view: Arc<View>) -> Store {
        self.view = Some(view);
        self
    }

    /// After a commit: the leased counters it left go into this replica's
    /// view at once and to the other replicas with the next batch.
    fn committed(&self, leased: &[Leased]) {
        if let Some(view) = &self.view {
            for l in leased {
                view.set_leased(&l.node, l.cores, l.memory_mib, l.seq);
            }
        }
        if let Some(a) = &self.announcer {
            a.queue(leased);
        }
    }

    /// The origin this replica's notices carry (see [`notice`]).
    pub fn origin(&self) -> &str {
        &self.origin
    }

    /// The backend.
    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// The pool, for the PostgreSQL listener and benchmarks.
    pub fn pool(&self) -> &AnyPool {
        &self.pool
    }

    /// Tells every replica that these nodes changed (PostgreSQL; on SQLite
    /// the periodic reload covers other processes). Delivered at commit;
    /// the notice names this replica, which applies its own changes to its
    /// view and need not reload them.
    async fn notify(
        &self,
        tx: &mut Transaction<'static, Any>,
        nodes: &[&str],
    ) -> Result<(), DbError> {
        self.announce(tx, nodes.join(",")).await
    }

    async fn announce(
        &self,
        tx: &mut Transaction<'static, Any>,
        entries: String,
    ) -> Result<(), DbError> {
        if self.backend == Backend::Postgres && !entries.is_empty() {
            sqlx::query("SELECT COUNT(*) AS n FROM (SELECT pg_notify('rfaas_nodes', $1)) AS sent")
                .bind(format!("{}:{entries}", self.origin))
                .execute(&mut **tx)
                .await?;
        }
        Ok(())
    }

    /// Checks that the database answers.
    pub async fn ping(&self) -> Result<(), DbError> {
        sqlx::query("SELECT 1 AS one").fetch_one(&self.pool).await?;
        Ok(())
    }

    /// Registers `name`, or updates its record; a lost node comes back.
    ///
    /// A node registered with fewer cores or less memory than it has
    /// leased keeps its leases: its capacity stays at what is leased, and
    /// the difference is recorded as draining (see `NODE_CAPACITY`).
    pub async fn register(
        &self,
        name: &str,
        r: &RegisterNode,
        now_ms: u64,
    ) -> Result<StoredNode, DbError> {
        let providers = serde_json::to_string(&r.providers).expect("providers serialise");
        let mut tx = self.pool.begin().await?;
        let row = sqlx::query(&format!(
            "INSERT INTO nodes (name, admin_state, lost, control_addr, providers, cores, memory_mib, leased_cores, leased_memory_mib, free_cores, free_memory_mib, version, registered_ms, last_heartbeat_ms, harvested)
             VALUES ($1, 'up', 0, $2, $3, $4, $5, 0, 0, $4, $5, $6, $7, $7, $8)
             ON CONFLICT (name) DO UPDATE SET lost = 0, control_addr = excluded.control_addr, providers = excluded.providers,
                cores = CASE WHEN nodes.leased_cores > excluded.cores THEN nodes.leased_cores ELSE excluded.cores END,
                draining_cores = CASE WHEN nodes.leased_cores > excluded.cores THEN nodes.leased_cores - excluded.cores ELSE 0 END,
                memory_mib = CASE WHEN nodes.leased_memory_mib > excluded.memory_mib THEN nodes.leased_memory_mib ELSE excluded.memory_mib END,
                draining_memory_mib = CASE WHEN nodes.leased_memory_mib > excluded.memory_mib
                    THEN nodes.leased_memory_mib - excluded.memory_mib ELSE 0 END,
                version = excluded.version,
                registered_ms = excluded.registered_ms, last_heartbeat_ms = excluded.last_heartbeat_ms,
                harvested = excluded.harvested
             RETURNING {NODE_COLS}"
        ))
        .bind(name)
        .bind(&r.control_addr)
        .bind(providers)
        .bind(i(r.cores.into()))
        .bind(i(r.memory_mib))
        .bind(&r.version)
        .bind(i(now_ms))
        .bind(i64::from(r.harvested))
        .fetch_one(&mut *tx)
        .await?;
        let node = node_from_row(&row)?;
        self.notify(&mut tx, &[name]).await?;
        tx.commit().await?;
        Ok(node)
    }

    /// Records a heartbeat. `None`: the node is unknown (it must register).
    /// Otherwise the leases the node holds that have ended.
    pub async fn heartbeat(
        &self,
        name: &str,
        h: &Heartbeat,
        now_ms: u64,
    ) -> Result<Option<(StoredNode, Vec<u64>)>, DbError> {
        let mut tx = self.pool.begin().await?;
        // A lost node that heartbeats again is back: other replicas must
        // hear of it, as of nothing else a heartbeat changes.
        let was_lost = sqlx::query("UPDATE nodes SET lost = 0 WHERE name = $1 AND lost = 1")
            .bind(name)
            .execute(&mut *tx)
            .await?
            .rows_affected()
            == 1;
        // So is a change of the cores the node withholds: grants on other
        // replicas must stop (or start) placing leases there.
        let withheld_changed = sqlx::query(
            "UPDATE nodes SET withheld_cores = $2 WHERE name = $1 AND withheld_cores <> $2",
        )
        .bind(name)
        .bind(i(h.withheld_cores.into()))
        .execute(&mut *tx)
        .await?
        .rows_affected()
            == 1;
        let row = sqlx::query(&format!(
            "UPDATE nodes SET last_heartbeat_ms = $2, free_cores = $3, free_memory_mib = $4
             WHERE name = $1 RETURNING {NODE_COLS}"
        ))
        .bind(name)
        .bind(i(now_ms))
        .bind(i(h.free_cores.into()))
        .bind(i(h.free_memory_mib))
        .fetch_optional(&mut *tx)
        .await?;
        let Some(row) = row else {
            return Ok(None);
        };
        let node = node_from_row(&row)?;
        let mut ended = Vec::new();
        for chunk in h.allocations.chunks(500) {
            let marks: Vec<String> = (0..chunk.len()).map(|k| format!("${}", k + 2)).collect();
            let sql = format!(
                "SELECT id FROM leases WHERE node = $1 AND state <> 'active' AND id IN ({})",
                marks.join(", ")
            );
            let mut q = sqlx::query(&sql).bind(name);
            for held in chunk {
                q = q.bind(i(held.lease_id));
            }
            for row in q.fetch_all(&mut *tx).await? {
                ended.push(u64_col(&row, "id")?);
            }
        }
        if was_lost || withheld_changed {
            self.notify(&mut tx, &[name]).await?;
        }
        tx.commit().await?;
        Ok(Some((node, ended)))
    }

    /// Drains (`true`) or resumes a node. `None`: unknown.
    pub async fn set_drained(
        &self,
        name: &str,
        drained: bool,
    ) -> Result<Option<StoredNode>, DbError> {
        let mut tx = self.pool.begin().await?;
        let row = sqlx::query(&format!(
            "UPDATE nodes SET admin_state = $2 WHERE name = $1 RETURNING {NODE_COLS}"
        ))
        .bind(name)
        .bind(if drained { "drained" } else { "up" })
        .fetch_optional(&mut *tx)
        .await?;
        let node = row.as_ref().map(node_from_row).transpose()?;
        if node.is_some() {
            self.notify(&mut tx, &[name]).await?;
        }
        tx.commit().await?;
        Ok(node)
    }

    /// Every node, by name.
    pub async fn nodes(&self) -> Result<Vec<StoredNode>, DbError> {
        sqlx::query(&format!("SELECT {NODE_COLS} FROM nodes ORDER BY name"))
            .fetch_all(&self.pool)
            .await?
            .iter()
            .map(node_from_row)
            .collect()
    }

    /// Some nodes by name (missing ones left out), 500 to a query.
    pub async fn nodes_named(&self, names: &[&str]) -> Result<Vec<StoredNode>, DbError> {
        let mut out = Vec::new();
        for chunk in names.chunks(500) {
            let marks: Vec<String> = (1..=chunk.len()).map(|k| format!("${k}")).collect();
            let sql = format!(
                "SELECT {NODE_COLS} FROM nodes WHERE name IN ({})",
                marks.join(", ")
            );
            let mut q = sqlx::query(&sql);
            for name in chunk {
                q = q.bind(*name);
            }
            for row in q.fetch_all(&self.pool).await? {
                out.push(node_from_row(&row)?);
            }
        }
        Ok(out)
    }

    /// Grants what fits of `plan` in one transaction, all or nothing up to
    /// `plan.min_cores`: the account (its budget, then its cap), the
    /// nodes, a billing slot per node lease, then the lease rows.
    pub async fn grant(&self, plan: &GrantPlan) -> Result<GrantOutcome, DbError> {
        let mut tx = self.pool.begin().await?;
        // The account first (lock order), reserving what the cap allows.
        sqlx::query("INSERT INTO accounts (name, leased_cores) VALUES ($1, 0) ON CONFLICT (name) DO NOTHING")
            .bind(&plan.account)
            .execute(&mut *tx)
            .await?;
        // The budget, read after a write: on SQLite the transaction then
        // holds the write lock, so this read cannot go stale before the
        // writes that follow (which SQLite would refuse, busy).
        if let Some(b) = budget_of(&mut tx, &plan.account).await? {
            if b.spend >= b.budget {
                tx.rollback().await?;
                return Ok(GrantOutcome::BudgetExhausted {
                    budget: b.budget,
                    spend: b.spend,
                });
            }
        }
        let mut want = plan.cores;
        if let Some(cap) = plan.cap {
            let in_use = u64_col(
                &sqlx::query("SELECT leased_cores FROM accounts WHERE name = $1")
                    .bind(&plan.account)
                    .fetch_one(&mut *tx)
                    .await?,
                "leased_cores",
            )?;
            let room = u64::from(cap).saturating_sub(in_use);
            if room < u64::from(plan.min_cores) {
                return Ok(GrantOutcome::Quota { cap, in_use });
            }
            want = want.min(room as u32);
        }
        let done = sqlx::query(
            "UPDATE accounts SET leased_cores = leased_cores + $2 WHERE name = $1 AND ($3 = 0 OR leased_cores + $2 <= $3)",
        )
        .bind(&plan.account)
        .bind(i(want.into()))
        .bind(i(plan.cap.unwrap_or(0).into()))
        .execute(&mut *tx)
        .await?;
        if done.rows_affected() != 1 {
            // Another grant took the room between the read and the update.
            return Err(DbError::Conflict(
                "the account's cap was reached meanwhile".into(),
            ));
        }

        // The nodes, in name order, each by a conditional update.
        let mut chosen: BTreeMap<&str, u32> = BTreeMap::new();
        let mut left = want;
        for (name, free) in &plan.candidates {
            if left == 0 {
                break;
            }
            let take = (*free).min(left);
            if take > 0 {
                chosen.insert(name, take);
                left -= take;
            }
        }
        let mut got: Vec<(&str, u32)> = Vec::new();
        // Each node's leased counters after this grant.
        let mut leased: Vec<Leased> = Vec::new();
        let mut total = 0u32;
        for (name, take) in &chosen {
            if let Some(counters) = self.take(&mut tx, name, *take, plan.memory_mib).await? {
                got.push((name, *take));
                leased.push(counters);
                total += take;
            }
        }
        // The view was stale for some: try the rest at what the database
        // says they have.
        if total < want {
            for (name, _) in &plan.candidates {
                if total >= want {
                    break;
                }
                if got.iter().any(|(n, _)| n == name) {
                    continue;
                }
                let row = sqlx::query(
                    "SELECT cores - draining_cores - leased_cores - withheld_cores AS free FROM nodes
                     WHERE name = $1 AND admin_state = 'up' AND lost = 0 AND leased_memory_mib + $2 <= memory_mib - draining_memory_mib",
                )
                .bind(name.as_str())
                .bind(i(plan.memory_mib))
                .fetch_optional(&mut *tx)
                .await?;
                let free = match row {
                    Some(r) => r.try_get::<i64, _>("free")?.max(0) as u32,
                    None => 0,
                };
                let take = free.min(want - total);
                if take == 0 {
                    continue;
                }
                if let Some(counters) = self.take(&mut tx, name, take, plan.memory_mib).await? {
                    got.push((name, take));
                    leased.push(counters);
                    total += take;
                }
            }
        }
        if total < plan.min_cores.max(1) {
            tx.rollback().await?;
            return Ok(GrantOutcome::NoCapacity);
        }
        if total < want {
            sqlx::query("UPDATE accounts SET leased_cores = leased_cores - $2 WHERE name = $1")
                .bind(&plan.account)
                .bind(i((want - total).into()))
                .execute(&mut *tx)
                .await?;
        }
        // A billing slot per node lease, after the nodes (lock order).
        let assigned_ms = crate::now_ms();
        let mut full = vec![false; plan.billing.len()];
        let mut slots = Vec::with_capacity(got.len());
        for _ in &got {
            let lease_id = new_id();
            let slot =
                assign_slot(&mut tx, lease_id, &plan.billing, &mut full, assigned_ms).await?;
            if slot.is_none() && plan.billing_required {
                tx.rollback().await?;
                return Ok(GrantOutcome::AccountingUnavailable);
            }
            slots.push((lease_id, slot));
        }
        let grant_id = new_id();
        let mut leases = Vec::with_capacity(got.len());
        for ((node, cores), (lease_id, billing)) in got.iter().zip(slots) {
            let view = LeaseView {
                lease_id,
                grant_id,
                node: (*node).to_owned(),
                user: plan.user.clone(),
                account: plan.account.clone(),
                cores: *cores,
                memory_mib: plan.memory_mib,
                issued_at: plan.issued_at,
                expires_at: plan.expires_at,
                state: LeaseState::Active,
                job_id: plan.job_id,
            };
            // `harvested` is the node's, for the accounting service's
            // discount.
            sqlx::query(&format!(
                "INSERT INTO leases ({LEASE_COLS}, ended_ms, harvested)
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, 'active', $11, 0,
                    (SELECT harvested FROM nodes WHERE name = $3))"
            ))
            .bind(i(view.lease_id))
            .bind(i(grant_id))
            .bind(&view.node)
            .bind(&plan.owner)
            .bind(&view.user)
            .bind(&view.account)
            .bind(i(view.cores.into()))
            .bind(i(view.memory_mib))
            .bind(i(view.issued_at))
            .bind(i(view.expires_at))
            .bind(plan.job_id.map(i))
            .execute(&mut *tx)
            .await?;
            leases.push(LeaseRow {
                view,
                owner: plan.owner.clone(),
                billing,
            });
        }
        tx.commit().await?;
        self.committed(&leased);
        Ok(GrantOutcome::Granted { grant_id, leases })
    }

    /// Leases `cores` and `memory_mib` on `node` if they fit; the node's
    /// counters after.
    async fn take(
        &self,
        tx: &mut Transaction<'static, Any>,
        node: &str,
        cores: u32,
        memory_mib: u64,
    ) -> Result<Option<Leased>, DbError> {
        sqlx::query(
            "UPDATE nodes SET leased_cores = leased_cores + $2, leased_memory_mib = leased_memory_mib + $3,
                lease_seq = lease_seq + 1
             WHERE name = $1 AND admin_state = 'up' AND lost = 0
               AND leased_cores + withheld_cores + $2 <= cores - draining_cores
               AND leased_memory_mib + $3 <= memory_mib - draining_memory_mib
             RETURNING leased_cores, leased_memory_mib, lease_seq",
        )
        .bind(node)
        .bind(i(cores.into()))
        .bind(i(memory_mib))
        .fetch_optional(&mut **tx)
        .await?
        .map(|row| leased_cols(node, &row))
        .transpose()
    }

    /// Gives back what ended leases held: accounts, then nodes by name.
    /// Returns the nodes' counters after.
    async fn give_back(
        &self,
        tx: &mut Transaction<'static, Any>,
        ended: &[LeaseRow],
    ) -> Result<Vec<Leased>, DbError> {
        let mut accounts: BTreeMap<&str, u64> = BTreeMap::new();
        let mut nodes: BTreeMap<&str, (u64, u64)> = BTreeMap::new();
        for l in ended {
            *accounts.entry(&l.view.account).or_default() += u64::from(l.view.cores);
            let n = nodes.entry(&l.view.node).or_default();
            n.0 += u64::from(l.view.cores);
            n.1 += l.view.memory_mib;
        }
        for (account, cores) in &accounts {
            sqlx::query("UPDATE accounts SET leased_cores = leased_cores - $2 WHERE name = $1")
                .bind(*account)
                .bind(i(*cores))
                .execute(&mut **tx)
                .await?;
        }
        let mut leased = Vec::with_capacity(nodes.len());
        for (node, (cores, mem)) in &nodes {
            let row = sqlx::query(&format!(
                "UPDATE nodes SET leased_cores = leased_cores - $2, leased_memory_mib = leased_memory_mib - $3,
                    {NODE_CAPACITY}, lease_seq = lease_seq + 1 WHERE name = $1
                 RETURNING leased_cores, leased_memory_mib, lease_seq"
            ))
            .bind(*node)
            .bind(i(*cores))
            .bind(i(*mem))
            .fetch_optional(&mut **tx)
            .await?;
            if let Some(row) = row {
                leased.push(leased_cols(node, &row)?);
            }
        }
        Ok(leased)
    }

    /// Ends the leases `update` (an `UPDATE leases ... RETURNING
    /// {LEASE_COLS}`) marks, and gives back what they held, in one
    /// transaction: lease rows first, then accounts and nodes (the lock
    /// order of [`crate::db`]).
    async fn end_leases<'q>(
        &self,
        update: sqlx::query::Query<'q, Any, sqlx::any::AnyArguments<'q>>,
    ) -> Result<Vec<LeaseRow>, DbError> {
        let mut tx = self.pool.begin().await?;
        let (ended, leased) = self.end_leases_in(&mut tx, update).await?;
        tx.commit().await?;
        self.committed(&leased);
        Ok(ended)
    }

    /// As [`end_leases`](Self::end_leases), inside transaction `tx`; also
    /// the nodes' counters, for [`committed`](Self::committed) after the
    /// commit.
    async fn end_leases_in<'q>(
        &self,
        tx: &mut Transaction<'static, Any>,
        update: sqlx::query::Query<'q, Any, sqlx::any::AnyArguments<'q>>,
    ) -> Result<(Vec<LeaseRow>, Vec<Leased>), DbError> {
        let ended = update
            .fetch_all(&mut **tx)
            .await?
            .iter()
            .map(lease_from_row)
            .collect::<Result<Vec<_>, _>>()?;
        let leased = self.give_back(tx, &ended).await?;
        Ok((ended, leased))
    }

    /// Ends grant `grant_id`'s active leases as `state`. Returns what it
    /// ended (empty if nothing was active).
    pub async fn end_grant(
        &self,
        grant_id: u64,
        state: LeaseState,
        now_ms: u64,
    ) -> Result<Vec<LeaseRow>, DbError> {
        self.end_grant_of(grant_id, None, state, now_ms).await
    }

    /// As [`end_grant`](Self::end_grant), only if `owner` (when given)
    /// holds it: a release needs no separate ownership query when it
    /// succeeds.
    pub async fn end_grant_of(
        &self,
        grant_id: u64,
        owner: Option<&str>,
        state: LeaseState,
        now_ms: u64,
    ) -> Result<Vec<LeaseRow>, DbError> {
        let sql = format!(
            "UPDATE leases SET state = $2, ended_ms = $3 WHERE grant_id = $1 AND state = 'active'
               AND ($4 = '' OR owner = $4) RETURNING {LEASE_COLS}"
        );
        self.end_leases(
            sqlx::query(&sql)
                .bind(i(grant_id))
                .bind(lease_state_name(state))
                .bind(i(now_ms))
                .bind(owner.unwrap_or("")),
        )
        .await
    }

    /// Ends every active lease that has expired at `now_s`.
    pub async fn reap_expired(&self, now_s: u64, now_ms: u64) -> Result<Vec<LeaseRow>, DbError> {
        let sql = format!(
            "UPDATE leases SET state = 'expired', ended_ms = $2 WHERE state = 'active' AND expires_at <= $1 RETURNING {LEASE_COLS}"
        );
        self.end_leases(sqlx::query(&sql).bind(i(now_s)).bind(i(now_ms)))
            .await
    }

    /// Marks nodes silent since before `cut_ms` lost, then ends the leases
    /// of every lost node. Returns the nodes newly lost and the leases
    /// ended.
    pub async fn reap_lost(
        &self,
        cut_ms: u64,
        now_ms: u64,
    ) -> Result<(Vec<String>, Vec<LeaseRow>), DbError> {
        let mut tx = self.pool.begin().await?;
        let lost: Vec<String> = sqlx::query(
            "UPDATE nodes SET lost = 1 WHERE lost = 0 AND last_heartbeat_ms < $1 RETURNING name",
        )
        .bind(i(cut_ms))
        .fetch_all(&mut *tx)
        .await?
        .iter()
        .map(|r| text_col(r, "name"))
        .collect::<Result<_, _>>()?;
        let names: Vec<&str> = lost.iter().map(String::as_str).collect();
        self.notify(&mut tx, &names).await?;
        tx.commit().await?;

        // Lease rows before node rows: a second transaction.
        let sql = format!(
            "UPDATE leases SET state = 'lost', ended_ms = $1 WHERE state = 'active'
               AND node IN (SELECT name FROM nodes WHERE lost = 1) RETURNING {LEASE_COLS}"
        );
        let ended = self.end_leases(sqlx::query(&sql).bind(i(now_ms))).await?;
        Ok((lost, ended))
    }

    /// Moves grant `grant_id`'s active leases' expiry to `expires_at`,
    /// never earlier than it was: an executor keeps the latest expiry it
    /// was shown, so a shorter one would let the manager lease cores the
    /// executor still serves. Returns them (empty: nothing active).
    ///
    /// A lease has ended at its `expires_at` second (Unix ms `now_ms`
    /// from `expires_at * 1000` on), as the reaper and the executors
    /// count, whether or not the reaper has marked it yet: such leases are
    /// not renewed, so a late renewal never brings back a lease whose
    /// workers the executors have stopped.
    ///
    /// Each keeps the billing slot it was granted with (the tokens of a
    /// renewal name the same slot), read with the instance's current
    /// address.
    pub async fn renew(
        &self,
        grant_id: u64,
        expires_at: u64,
        now_ms: u64,
    ) -> Result<Vec<LeaseRow>, DbError> {
        let rows = sqlx::query(&format!(
            "UPDATE leases SET expires_at = CASE WHEN expires_at > $2 THEN expires_at ELSE $2 END
             WHERE grant_id = $1 AND state = 'active' AND expires_at * 1000 > $3 RETURNING {LEASE_COLS}"
        ))
        .bind(i(grant_id))
        .bind(i(expires_at))
        .bind(i(now_ms))
        .fetch_all(&self.pool)
        .await?;
        let mut leases = rows
            .iter()
            .map(lease_from_row)
            .collect::<Result<Vec<_>, _>>()?;
        if leases.is_empty() {
            return Ok(leases);
        }
        let mut slots = self.grant_billing(grant_id).await?;
        for l in &mut leases {
            l.billing = slots.remove(&l.view.lease_id);
        }
        Ok(leases)
    }

    /// The billing slots grant `grant_id`'s leases hold, by lease id.
    async fn grant_billing(&self, grant_id: u64) -> Result<HashMap<u64, BillingSlot>, DbError> {
        let rows = sqlx::query(
            "SELECT b.lease_id, b.instance, b.slot, a.provider, a.fabric_addr
             FROM billing_slots b JOIN accounting_instances a ON a.name = b.instance
             WHERE b.lease_id IN (SELECT id FROM leases WHERE grant_id = $1)",
        )
        .bind(i(grant_id))
        .fetch_all(&self.pool)
        .await?;
        let mut out = HashMap::with_capacity(rows.len());
        for row in &rows {
            out.insert(
                u64_col(row, "lease_id")?,
                BillingSlot {
                    instance: text_col(row, "instance")?,
                    provider: text_col(row, "provider")?,
                    addr: text_col(row, "fabric_addr")?,
                    slot: slot_col(row)?,
                },
            );
        }
        Ok(out)
    }

    /// Every accounting instance, by name, with its slots in use: one
    /// query, over the instances and the slots that hold a lease (the
    /// index on `lease_id`), never over the free ones.
    pub async fn accounting_instances(&self) -> Result<Vec<AccountingInstance>, DbError> {
        let rows = sqlx::query(
            "SELECT a.name, a.provider, a.fabric_addr, a.slots, a.last_heartbeat_ms, COALESCE(u.used, 0) AS used
             FROM accounting_instances a LEFT JOIN
                (SELECT instance, COUNT(*) AS used FROM billing_slots WHERE lease_id > 0 GROUP BY instance) u
                ON u.instance = a.name
             ORDER BY a.name",
        )
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|row| {
                Ok(AccountingInstance {
                    name: text_col(row, "name")?,
                    provider: text_col(row, "provider")?,
                    fabric_addr: text_col(row, "fabric_addr")?,
                    slots: u64_col(row, "slots")?.min(u64::from(u32::MAX)) as u32,
                    used: u64_col(row, "used")?.min(u64::from(u32::MAX)) as u32,
                    last_heartbeat_ms: u64_col(row, "last_heartbeat_ms")?,
                })
            })
            .collect()
    }

    /// Every budget with its account's spend, by account.
    pub async fn budgets(&self) -> Result<Vec<BudgetView>, DbError> {
        sqlx::query(&format!("{BUDGET_SELECT} ORDER BY b.account"))
            .fetch_all(&self.pool)
            .await?
            .iter()
            .map(budget_from_row)
            .collect()
    }

    /// Sets `account`'s budget; returns it with the spend so far.
    pub async fn set_budget(
        &self,
        account: &str,
        budget: f64,
        now_ms: u64,
    ) -> Result<BudgetView, DbError> {
        let mut tx = self.pool.begin().await?;
        budgets::set(&mut tx, account, budget, now_ms).await?;
        let view = budget_of(&mut tx, account)
            .await?
            .ok_or_else(|| DbError::Other(format!("the budget of {account:?} vanished")))?;
        tx.commit().await?;
        Ok(view)
    }

    /// Removes `account`'s budget. `false`: it had none.
    pub async fn clear_budget(&self, account: &str) -> Result<bool, DbError> {
        let mut conn = self.pool.acquire().await?;
        Ok(budgets::clear(&mut conn, account).await?.is_some())
    }

    /// A grant's leases, whatever their state.
    pub async fn grant_leases(&self, grant_id: u64) -> Result<Vec<LeaseRow>, DbError> {
        sqlx::query(&format!(
            "SELECT {LEASE_COLS} FROM leases WHERE grant_id = $1 ORDER BY node"
        ))
        .bind(i(grant_id))
        .fetch_all(&self.pool)
        .await?
        .iter()
        .map(lease_from_row)
        .collect()
    }

    /// Leases, newest first: active ones only unless `all`, of `owner`
    /// only if given, at most `limit`.
    pub async fn leases(
        &self,
        all: bool,
        owner: Option<&str>,
        limit: u32,
    ) -> Result<Vec<LeaseRow>, DbError> {
        let sql = format!(
            "SELECT {LEASE_COLS} FROM leases WHERE ($1 = 1 OR state = 'active') AND ($2 = '' OR owner = $2)
             ORDER BY issued_at DESC, id LIMIT $3"
        );
        sqlx::query(&sql)
            .bind(i64::from(all))
            .bind(owner.unwrap_or(""))
            .bind(i64::from(limit))
            .fetch_all(&self.pool)
            .await?
            .iter()
            .map(lease_from_row)
            .collect()
    }

    /// When the soonest active lease ends, Unix seconds.
    pub async fn soonest_expiry(&self) -> Result<Option<u64>, DbError> {
        let row =
            sqlx::query("SELECT MIN(expires_at) AS soonest FROM leases WHERE state = 'active'")
                .fetch_one(&self.pool)
                .await?;
        let v: Option<i64> = row.try_get("soonest")?;
        Ok(v.map(|v| v.max(0) as u64))
    }

    /// Cores each account holds now.
    pub async fn account_use(&self) -> Result<HashMap<String, u64>, DbError> {
        let mut out = HashMap::new();
        for row in sqlx::query("SELECT name, leased_cores FROM accounts")
            .fetch_all(&self.pool)
            .await?
        {
            out.insert(text_col(&row, "name")?, u64_col(&row, "leased_cores")?);
        }
        Ok(out)
    }

    /// Stores a new credential.
    pub async fn add_credential(&self, c: &CredentialRow, now_ms: u64) -> Result<(), DbError> {
        sqlx::query(
            "INSERT INTO credentials (id, secret_hash, role, subject, account, created_ms, expires_at, revoked, job_id)
             VALUES ($1, $2, $3, $4, $5, $6, $7, 0, $8)",
        )
        .bind(&c.id)
        .bind(&c.secret_hash)
        .bind(role_name(c.role))
        .bind(&c.subject)
        .bind(&c.account)
        .bind(i(now_ms))
        .bind(i(c.expires_at))
        .bind(c.job_id.map(i))
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// One credential by id.
    pub async fn credential(&self, id: &str) -> Result<Option<CredentialRow>, DbError> {
        credentials::find(&self.pool, id).await
    }

    /// Every credential not revoked.
    pub async fn credentials(&self) -> Result<Vec<CredentialRow>, DbError> {
        sqlx::query(&format!(
            "SELECT {} FROM credentials WHERE revoked = 0 ORDER BY subject, id",
            credentials::COLUMNS
        ))
        .fetch_all(&self.pool)
        .await?
        .iter()
        .map(credentials::from_row)
        .collect()
    }

    /// Ends Slurm job `job_id` here: revokes its job credentials and
    /// releases its active leases, in one transaction, and gives back
    /// what they held. Returns the ids of the credentials revoked and the
    /// leases ended (both empty once the job's end was already recorded).
    pub async fn end_job(
        &self,
        job_id: u64,
        now_ms: u64,
    ) -> Result<(Vec<String>, Vec<LeaseRow>), DbError> {
        let mut tx = self.pool.begin().await?;
        let sql = format!(
            "UPDATE leases SET state = 'released', ended_ms = $2 WHERE job_id = $1 AND state = 'active' RETURNING {LEASE_COLS}"
        );
        let (ended, leased) = self
            .end_leases_in(&mut tx, sqlx::query(&sql).bind(i(job_id)).bind(i(now_ms)))
            .await?;
        // Credentials last: leases, accounts and nodes keep their lock
        // order (see `crate::db`).
        let revoked = sqlx::query(
            "UPDATE credentials SET revoked = 1 WHERE job_id = $1 AND revoked = 0 RETURNING id",
        )
        .bind(i(job_id))
        .fetch_all(&mut *tx)
        .await?
        .iter()
        .map(|r| text_col(r, "id"))
        .collect::<Result<Vec<_>, _>>()?;
        tx.commit().await?;
        self.committed(&leased);
        Ok((revoked, ended))
    }

    /// Revokes a credential. `false`: unknown.
    pub async fn revoke_credential(&self, id: &str) -> Result<bool, DbError> {
        let done = sqlx::query("UPDATE credentials SET revoked = 1 WHERE id = $1")
            .bind(id)
            .execute(&self.pool)
            .await?;
        Ok(done.rows_affected() == 1)
    }
}

/// Budgets with their accounts' spend; an account the accounting
/// services have not priced yet has spent 0.
const BUDGET_SELECT: &str =
    "SELECT b.account, b.budget, COALESCE(s.spend, 0.0) AS spend, b.updated_ms
     FROM budgets b LEFT JOIN account_spend s ON s.account = b.account";

fn budget_from_row(row: &AnyRow) -> Result<BudgetView, DbError> {
    Ok(BudgetView {
        account: text_col(row, "account")?,
        budget: row.try_get("budget")?,
        spend: row.try_get("spend")?,
        updated_ms: u64_col(row, "updated_ms")?,
    })
}

/// `account`'s budget and spend, if it has a budget: one lookup by
/// primary key in each table.
async fn budget_of(
    tx: &mut Transaction<'static, Any>,
    account: &str,
) -> Result<Option<BudgetView>, DbError> {
    sqlx::query(&format!("{BUDGET_SELECT} WHERE b.account = $1"))
        .bind(account)
        .fetch_optional(&mut **tx)
        .await?
        .as_ref()
        .map(budget_from_row)
        .transpose()
}

fn slot_col(row: &AnyRow) -> Result<u32, DbError> {
    let slot = u64_col(row, "slot")?;
    u32::try_from(slot).map_err(|_| DbError::Other(format!("billing slot {slot} is out of range")))
}

/// Takes a free billing slot for `lease_id` from the first of
/// `instances` that has one, skipping those `full` marks (and marking
/// those found full). A conditional update decides: the slot is taken only
/// if it is still free when its row is locked, so no slot goes to two
/// leases under any concurrency (as with cores, see [`crate::db`]). It
/// starts at a random slot, so that concurrent grants rarely reach for the
/// same one, then from slot 0 (wrapping), then once more at random in case
/// both lost a race; an instance that gives nothing is full.
async fn assign_slot(
    tx: &mut Transaction<'static, Any>,
    lease_id: u64,
    instances: &[AccountingInstance],
    full: &mut [bool],
    now_ms: u64,
) -> Result<Option<BillingSlot>, DbError> {
    for (k, inst) in instances.iter().enumerate() {
        if full[k] || inst.slots == 0 {
            continue;
        }
        for start in [fastrand::u32(..inst.slots), 0, fastrand::u32(..inst.slots)] {
            let row = sqlx::query(
                "UPDATE billing_slots SET lease_id = $1, assigned_ms = $2
                 WHERE instance = $3 AND lease_id = 0 AND slot =
                    (SELECT slot FROM billing_slots WHERE instance = $3 AND lease_id = 0 AND slot >= $4 ORDER BY slot LIMIT 1)
                 RETURNING slot",
            )
            .bind(i(lease_id))
            .bind(i(now_ms))
            .bind(&inst.name)
            .bind(i64::from(start))
            .fetch_optional(&mut **tx)
            .await?;
            if let Some(row) = row {
                return Ok(Some(BillingSlot {
                    instance: inst.name.clone(),
                    provider: inst.provider.clone(),
                    addr: inst.fabric_addr.clone(),
                    slot: slot_col(&row)?,
                }));
            }
        }
        full[k] = true;
    }
    Ok(None)
}

/// The stored name of a role.
pub fn role_name(r: Role) -> &'static str {
    match r {
        Role::Node => "node",
        Role::User => "user",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notices_name_their_replica_and_nodes() {
        use Announced::{Changed, Leased};
        assert_eq!(
            notice("00ab:n1,n-2.x@y"),
            (Some("00ab"), vec![Changed("n1"), Changed("n-2.x@y")])
        );
        // From a replica that did not say who it is: reloaded by every one.
        assert_eq!(notice("n1,n2"), (None, vec![Changed("n1"), Changed("n2")]));
        assert_eq!(notice("00ab:"), (Some("00ab"), vec![]));
        // Grants and releases carry the node's counters after the commit
        // and its lease_seq.
        assert_eq!(
            notice("00ab:n1=3/4096/17,n2=0/0/2"),
            (
                Some("00ab"),
                vec![
                    Leased {
                        node: "n1",
                        cores: 3,
                        memory_mib: 4096,
                        seq: 17
                    },
                    Leased {
                        node: "n2",
                        cores: 0,
                        memory_mib: 0,
                        seq: 2
                    }
                ]
            )
        );
        // What cannot be read, or counters without their seq (a replica
        // of an older release), names a node to read again.
        assert_eq!(
            notice("00ab:n1=x/1/1,n2=3,n3=3/4096,n4=1/2/3/4"),
            (
                Some("00ab"),
                vec![Changed("n1"), Changed("n2"), Changed("n3"), Changed("n4")]
            )
        );
        assert_eq!(Changed("n1").node(), "n1");
    }
}

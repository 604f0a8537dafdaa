//! The accounting tables in SQL, one text for PostgreSQL and SQLite (see
//! `rfaas_service::db` for the dialect both run): the instance's row, its
//! billing slots, the flusher's writes (`usage`, `usage_snapshots`,
//! `account_spend`), and readers of the stored usage.
//!
//! # Idempotent flushes
//!
//! A flush writes cumulative totals, and every counter column of `usage`
//! only grows (`CASE WHEN excluded.x > usage.x ...`: PostgreSQL has no
//! two-argument `MAX`, SQLite no `GREATEST`). The priced delta it adds to
//! `account_spend` is computed in the same transaction from the row as it
//! was before, so a flush replayed after a crash, or after a commit whose
//! outcome was lost, writes the same totals and adds nothing more.

use std::collections::{BTreeMap, HashMap};

use rfaas_proto::accounting::{Counter, SlotTotals};
use rfaas_service::db::{i, text_col, u64_col, DbError};
use sqlx::any::AnyRow;
use sqlx::{AnyPool, Row};

use crate::rates::Rates;

/// The counters stored per lease: a slot's words but `closed`.
pub const USAGE_COUNTERS: [Counter; 7] = [
    Counter::AllocMibMs,
    Counter::ComputeNs,
    Counter::HotNs,
    Counter::WarmNs,
    Counter::Invocations,
    Counter::BytesIn,
    Counter::BytesOut,
];

/// Leases written per statement (13 parameters each stays far below both
/// databases' limits).
const CHUNK: usize = 200;

/// `totals` with `closed` cleared: what the database stores.
pub fn stored(totals: &SlotTotals) -> SlotTotals {
    SlotTotals {
        closed: 0,
        ..*totals
    }
}

/// Each stored counter the larger of `a`'s and `b`'s.
pub fn max_totals(a: &SlotTotals, b: &SlotTotals) -> SlotTotals {
    let mut w = [0u64; 8];
    for c in USAGE_COUNTERS {
        w[c.index()] = a.get(c).max(b.get(c));
    }
    SlotTotals::from_words(w)
}

fn totals_from_row(row: &AnyRow) -> Result<SlotTotals, DbError> {
    let mut w = [0u64; 8];
    for c in USAGE_COUNTERS {
        w[c.index()] = u64_col(row, c.name())?;
    }
    Ok(SlotTotals::from_words(w))
}

/// An accounting instance's row in `accounting_instances`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Instance {
    /// Its name.
    pub name: String,
    /// Its fabric provider.
    pub provider: String,
    /// The fabric address daemons connect to.
    pub fabric_addr: String,
    /// Its metrics address.
    pub metrics_addr: String,
    /// Slots in its region.
    pub slots: u32,
    /// Its region's id.
    pub region_id: u64,
}

/// Writes the instance's row (started and heartbeat now); returns the
/// region id the row held before, if there was one.
pub async fn register_instance(
    pool: &AnyPool,
    inst: &Instance,
    now_ms: u64,
) -> Result<Option<u64>, DbError> {
    let mut tx = pool.begin().await?;
    let before = sqlx::query("SELECT region_id FROM accounting_instances WHERE name = $1")
        .bind(&inst.name)
        .fetch_optional(&mut *tx)
        .await?
        .map(|r| r.try_get::<i64, _>("region_id"))
        .transpose()?
        .map(|v| v as u64);
    sqlx::query(
        "INSERT INTO accounting_instances (name, provider, fabric_addr, metrics_addr, slots, region_id, started_ms, last_heartbeat_ms)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $7)
         ON CONFLICT (name) DO UPDATE SET provider = excluded.provider, fabric_addr = excluded.fabric_addr,
             metrics_addr = excluded.metrics_addr, slots = excluded.slots, region_id = excluded.region_id,
             started_ms = excluded.started_ms, last_heartbeat_ms = excluded.last_heartbeat_ms",
    )
    .bind(&inst.name)
    .bind(&inst.provider)
    .bind(&inst.fabric_addr)
    .bind(&inst.metrics_addr)
    .bind(i64::from(inst.slots))
    // Stored as the same 64 bits, so it may read back negative in SQL.
    .bind(inst.region_id as i64)
    .bind(i(now_ms))
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(before)
}

/// Records that the instance is alive.
pub async fn heartbeat(pool: &AnyPool, name: &str, now_ms: u64) -> Result<(), DbError> {
    sqlx::query("UPDATE accounting_instances SET last_heartbeat_ms = $2 WHERE name = $1")
        .bind(name)
        .bind(i(now_ms))
        .execute(pool)
        .await?;
    Ok(())
}

/// Slot rows of an instance after [`ensure_slots`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotRows {
    /// Rows created now.
    pub created: u64,
    /// Free rows past the slot count, removed now.
    pub removed: u64,
    /// Rows past the slot count still assigned to a lease (left alone).
    pub stranded: u64,
}

/// Makes sure `billing_slots` has a row per slot of the instance (free,
/// lease 0), in one statement for both databases (a recursive CTE), and
/// drops free rows past `slots` (left by a larger region).
pub async fn ensure_slots(pool: &AnyPool, name: &str, slots: u32) -> Result<SlotRows, DbError> {
    let mut tx = pool.begin().await?;
    let created = sqlx::query(
        "WITH RECURSIVE n(slot) AS (SELECT CAST(0 AS BIGINT) UNION ALL SELECT slot + 1 FROM n WHERE slot + 1 < $2)
         INSERT INTO billing_slots (instance, slot, lease_id, assigned_ms)
         SELECT $1, slot, 0, 0 FROM n WHERE true
         ON CONFLICT (instance, slot) DO NOTHING",
    )
    .bind(name)
    .bind(i64::from(slots))
    .execute(&mut *tx)
    .await?
    .rows_affected();
    let removed = sqlx::query(
        "DELETE FROM billing_slots WHERE instance = $1 AND slot >= $2 AND lease_id = 0",
    )
    .bind(name)
    .bind(i64::from(slots))
    .execute(&mut *tx)
    .await?
    .rows_affected();
    let stranded: i64 =
        sqlx::query("SELECT COUNT(*) AS n FROM billing_slots WHERE instance = $1 AND slot >= $2")
            .bind(name)
            .bind(i64::from(slots))
            .fetch_one(&mut *tx)
            .await?
            .try_get("n")?;
    tx.commit().await?;
    Ok(SlotRows {
        created,
        removed,
        stranded: stranded as u64,
    })
}

/// What the database says about a lease holding a slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseInfo {
    /// The account charged.
    pub account: String,
    /// On a harvested node.
    pub harvested: bool,
    /// `active` while it runs.
    pub state: String,
    /// When it ended, Unix ms (0 while active).
    pub ended_ms: u64,
    /// When it expires, Unix seconds.
    pub expires_at: u64,
    /// The node it runs on: only that node's window counts for it.
    pub node: String,
    /// Cores leased.
    pub cores: u64,
    /// Memory leased, MiB.
    pub memory_mib: u64,
    /// When it was granted, Unix seconds.
    pub issued_at: u64,
}

/// A slot of the instance assigned to a lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Assigned {
    /// The slot.
    pub slot: u32,
    /// The lease.
    pub lease_id: u64,
    /// When the manager assigned it, Unix ms.
    pub assigned_ms: u64,
    /// The lease's row (`None`: no such lease).
    pub lease: Option<LeaseInfo>,
    /// Its usage was flushed for the last time (a final flush that did not
    /// get to free the slot).
    pub finalized: bool,
}

impl Assigned {
    /// The node of the slot's lease (`None`: no such lease).
    pub fn node(&self) -> Option<&str> {
        self.lease.as_ref().map(|l| l.node.as_str())
    }
}

/// The instance's assigned slots, with their leases.
/// The lease slot `slot` of instance `name` is assigned to now (0: free).
pub async fn slot_lease(pool: &AnyPool, name: &str, slot: u32) -> Result<u64, DbError> {
    let row = sqlx::query("SELECT lease_id FROM billing_slots WHERE instance = $1 AND slot = $2")
        .bind(name)
        .bind(i64::from(slot))
        .fetch_optional(pool)
        .await?;
    match row {
        Some(r) => Ok(u64_col(&r, "lease_id")?),
        None => Ok(0),
    }
}

pub async fn assigned_slots(pool: &AnyPool, name: &str) -> Result<Vec<Assigned>, DbError> {
    let rows = sqlx::query(
        "SELECT b.slot, b.lease_id, b.assigned_ms, l.account, l.harvested, l.state, l.ended_ms, l.expires_at, l.node, l.cores, l.memory_mib, l.issued_at, u.finalized
         FROM billing_slots b
         LEFT JOIN leases l ON l.id = b.lease_id
         LEFT JOIN usage u ON u.lease_id = b.lease_id
         WHERE b.instance = $1 AND b.lease_id <> 0
         ORDER BY b.slot",
    )
    .bind(name)
    .fetch_all(pool)
    .await?;
    rows.iter()
        .map(|r| {
            let slot = u64_col(r, "slot")?;
            let account: Option<String> = r.try_get("account")?;
            let lease = match account {
                Some(account) => Some(LeaseInfo {
                    account,
                    harvested: u64_col(r, "harvested")? != 0,
                    state: text_col(r, "state")?,
                    ended_ms: u64_col(r, "ended_ms")?,
                    expires_at: u64_col(r, "expires_at")?,
                    node: text_col(r, "node")?,
                    cores: u64_col(r, "cores")?,
                    memory_mib: u64_col(r, "memory_mib")?,
                    issued_at: u64_col(r, "issued_at")?,
                }),
                None => None,
            };
            let finalized: Option<i64> = r.try_get("finalized")?;
            Ok(Assigned {
                slot: u32::try_from(slot)
                    .map_err(|_| DbError::Other(format!("billing slot {slot} is out of range")))?,
                lease_id: u64_col(r, "lease_id")?,
                assigned_ms: u64_col(r, "assigned_ms")?,
                lease,
                finalized: finalized.unwrap_or(0) != 0,
            })
        })
        .collect()
}

/// One lease's totals for [`write_usage`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UsageWrite {
    /// The lease.
    pub lease_id: u64,
    /// Its slot.
    pub slot: u32,
    /// The node of its lease, whose window the slot is read from.
    pub node: Option<String>,
    /// Cumulative totals read from the slot (`closed` is not stored).
    pub totals: SlotTotals,
    /// The last flush of this lease.
    pub finalized: bool,
    /// Write a snapshot row too.
    pub snapshot: bool,
    /// The account its spend goes to (`None`: none, the lease is unknown).
    pub account: Option<String>,
    /// Priced at the harvested discount.
    pub harvested: bool,
}

/// What [`write_usage`] wrote.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Written {
    /// `usage` rows upserted.
    pub usage_rows: u64,
    /// `usage_snapshots` rows written.
    pub snapshot_rows: u64,
    /// `account_spend` rows changed.
    pub spend_rows: u64,
    /// Each lease's stored totals after the write.
    pub totals: HashMap<u64, SlotTotals>,
    /// Spend added, by account.
    pub spend: BTreeMap<String, f64>,
}

fn placeholders(rows: usize, cols: usize) -> String {
    (0..rows)
        .map(|r| {
            let cells: Vec<String> = (1..=cols).map(|c| format!("${}", r * cols + c)).collect();
            format!("({})", cells.join(", "))
        })
        .collect::<Vec<_>>()
        .join(", ")
}

fn grow(col: &str, table: &str) -> String {
    format!("{col} = CASE WHEN excluded.{col} > {table}.{col} THEN excluded.{col} ELSE {table}.{col} END")
}

/// Upserts the leases' totals into `usage` (each counter only grows),
/// writes the snapshots asked for, and adds each lease's priced growth to
/// its account's `account_spend`, all in one transaction.
pub async fn write_usage(
    pool: &AnyPool,
    instance: &str,
    writes: &[UsageWrite],
    rates: &Rates,
    now_ms: u64,
) -> Result<Written, DbError> {
    let mut out = Written::default();
    if writes.is_empty() {
        return Ok(out);
    }
    let mut tx = pool.begin().await?;
    for chunk in writes.chunks(CHUNK) {
        let sql = format!(
            "SELECT lease_id, {} FROM usage WHERE lease_id IN ({})",
            counter_list(),
            (1..=chunk.len())
                .map(|k| format!("${k}"))
                .collect::<Vec<_>>()
                .join(", ")
        );
        let mut q = sqlx::query(&sql);
        for w in chunk {
            q = q.bind(i(w.lease_id));
        }
        let mut before: HashMap<u64, SlotTotals> = HashMap::new();
        for row in q.fetch_all(&mut *tx).await? {
            before.insert(u64_col(&row, "lease_id")?, totals_from_row(&row)?);
        }
        let merged: Vec<SlotTotals> = chunk
            .iter()
            .map(|w| {
                let prev = before.get(&w.lease_id).copied().unwrap_or_default();
                max_totals(&prev, &w.totals)
            })
            .collect();
        // usage
        const COLS: usize = 13;
        let sql = format!(
            "INSERT INTO usage (lease_id, instance, slot, {}, finalized, first_ms, updated_ms) VALUES {}
             ON CONFLICT (lease_id) DO UPDATE SET {}, finalized = CASE WHEN excluded.finalized > usage.finalized THEN excluded.finalized ELSE usage.finalized END, updated_ms = excluded.updated_ms",
            counter_list(),
            placeholders(chunk.len(), COLS),
            USAGE_COUNTERS
                .iter()
                .map(|c| grow(c.name(), "usage"))
                .collect::<Vec<_>>()
                .join(", ")
        );
        let mut q = sqlx::query(&sql);
        for (w, m) in chunk.iter().zip(&merged) {
            q = q.bind(i(w.lease_id)).bind(instance).bind(i64::from(w.slot));
            for c in USAGE_COUNTERS {
                q = q.bind(i(m.get(c)));
            }
            q = q
                .bind(i64::from(w.finalized))
                .bind(i(now_ms))
                .bind(i(now_ms));
        }
        out.usage_rows += q
            .execute(&mut *tx)
            .await?
            .rows_affected()
            .min(chunk.len() as u64);
        // usage_snapshots
        let snaps: Vec<(&UsageWrite, &SlotTotals)> = chunk
            .iter()
            .zip(&merged)
            .filter(|(w, _)| w.snapshot)
            .collect();
        if !snaps.is_empty() {
            const SCOLS: usize = 9;
            let sql = format!(
                "INSERT INTO usage_snapshots (lease_id, at_ms, {}) VALUES {}
                 ON CONFLICT (lease_id, at_ms) DO UPDATE SET {}",
                counter_list(),
                placeholders(snaps.len(), SCOLS),
                USAGE_COUNTERS
                    .iter()
                    .map(|c| grow(c.name(), "usage_snapshots"))
                    .collect::<Vec<_>>()
                    .join(", ")
            );
            let mut q = sqlx::query(&sql);
            for (w, m) in &snaps {
                q = q.bind(i(w.lease_id)).bind(i(now_ms));
                for c in USAGE_COUNTERS {
                    q = q.bind(i(m.get(c)));
                }
            }
            q.execute(&mut *tx).await?;
            out.snapshot_rows += snaps.len() as u64;
        }
        // account_spend: the priced growth over what was stored.
        let mut spend: BTreeMap<&str, f64> = BTreeMap::new();
        for (w, m) in chunk.iter().zip(&merged) {
            let Some(account) = &w.account else { continue };
            let prev = before.get(&w.lease_id).copied().unwrap_or_default();
            let delta = rates.cost(&m.usage, w.harvested) - rates.cost(&prev.usage, w.harvested);
            if delta > 0.0 {
                *spend.entry(account).or_default() += delta;
            }
        }
        for (account, delta) in spend {
            sqlx::query(
                "INSERT INTO account_spend (account, spend, updated_ms) VALUES ($1, $2, $3)
                 ON CONFLICT (account) DO UPDATE SET spend = account_spend.spend + excluded.spend, updated_ms = excluded.updated_ms",
            )
            .bind(account)
            .bind(delta)
            .bind(i(now_ms))
            .execute(&mut *tx)
            .await?;
            out.spend_rows += 1;
            *out.spend.entry(account.to_owned()).or_default() += delta;
        }
        for (w, m) in chunk.iter().zip(merged) {
            out.totals.insert(w.lease_id, m);
        }
    }
    tx.commit().await?;
    Ok(out)
}

fn counter_list() -> String {
    USAGE_COUNTERS
        .iter()
        .map(|c| c.name())
        .collect::<Vec<_>>()
        .join(", ")
}

/// Frees slots whose leases' final flush is done: `lease_id` back to 0,
/// only where the slot still holds that lease. Returns how many.
pub async fn free_slots(
    pool: &AnyPool,
    instance: &str,
    slots: &[(u32, u64)],
) -> Result<u64, DbError> {
    if slots.is_empty() {
        return Ok(0);
    }
    let mut tx = pool.begin().await?;
    let mut freed = 0;
    for (slot, lease_id) in slots {
        freed += sqlx::query(
            "UPDATE billing_slots SET lease_id = 0, assigned_ms = 0 WHERE instance = $1 AND slot = $2 AND lease_id = $3",
        )
        .bind(instance)
        .bind(i64::from(*slot))
        .bind(i(*lease_id))
        .execute(&mut *tx)
        .await?
        .rows_affected();
    }
    tx.commit().await?;
    Ok(freed)
}

/// A lease's row in `usage`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UsageRow {
    /// The lease.
    pub lease_id: u64,
    /// The accounting instance that counted it.
    pub instance: String,
    /// Its slot there.
    pub slot: u32,
    /// Its cumulative totals (`closed` is 0).
    pub totals: SlotTotals,
    /// Its final flush is done: the totals will not change.
    pub finalized: bool,
    /// Its first flush, Unix ms.
    pub first_ms: u64,
    /// Its last flush, Unix ms.
    pub updated_ms: u64,
}

fn usage_from_row(r: &AnyRow) -> Result<UsageRow, DbError> {
    Ok(UsageRow {
        lease_id: u64_col(r, "lease_id")?,
        instance: text_col(r, "instance")?,
        slot: u64_col(r, "slot")? as u32,
        totals: totals_from_row(r)?,
        finalized: u64_col(r, "finalized")? != 0,
        first_ms: u64_col(r, "first_ms")?,
        updated_ms: u64_col(r, "updated_ms")?,
    })
}

/// The `usage` rows of `lease_ids` (those that have one).
pub async fn usage_of(pool: &AnyPool, lease_ids: &[u64]) -> Result<Vec<UsageRow>, DbError> {
    let mut out = Vec::with_capacity(lease_ids.len());
    for chunk in lease_ids.chunks(CHUNK) {
        let sql = format!(
            "SELECT lease_id, instance, slot, {}, finalized, first_ms, updated_ms FROM usage WHERE lease_id IN ({}) ORDER BY lease_id",
            counter_list(),
            (1..=chunk.len())
                .map(|k| format!("${k}"))
                .collect::<Vec<_>>()
                .join(", ")
        );
        let mut q = sqlx::query(&sql);
        for id in chunk {
            q = q.bind(i(*id));
        }
        for row in q.fetch_all(pool).await? {
            out.push(usage_from_row(&row)?);
        }
    }
    Ok(out)
}

/// A lease's snapshot: its totals at `at_ms`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Snapshot {
    /// The lease.
    pub lease_id: u64,
    /// When, Unix ms.
    pub at_ms: u64,
    /// Its cumulative totals then.
    pub totals: SlotTotals,
}

/// The snapshots of `lease_id`, oldest first.
pub async fn snapshots_of(pool: &AnyPool, lease_id: u64) -> Result<Vec<Snapshot>, DbError> {
    let sql = format!(
        "SELECT lease_id, at_ms, {} FROM usage_snapshots WHERE lease_id = $1 ORDER BY at_ms",
        counter_list()
    );
    sqlx::query(&sql)
        .bind(i(lease_id))
        .fetch_all(pool)
        .await?
        .iter()
        .map(|r| {
            Ok(Snapshot {
                lease_id: u64_col(r, "lease_id")?,
                at_ms: u64_col(r, "at_ms")?,
                totals: totals_from_row(r)?,
            })
        })
        .collect()
}

/// An account's spend so far (0 when it has none).
pub async fn account_spend(pool: &AnyPool, account: &str) -> Result<f64, DbError> {
    let row = sqlx::query("SELECT spend FROM account_spend WHERE account = $1")
        .bind(account)
        .fetch_optional(pool)
        .await?;
    Ok(match row {
        Some(r) => r.try_get::<f64, _>("spend")?,
        None => 0.0,
    })
}

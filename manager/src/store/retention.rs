//! Retention: ended leases older than the configured age leave the
//! database with their usage and snapshots, in small batches, each rolled
//! up into per-day totals (`usage_daily`) in the same transaction as its
//! delete, so reports over whole days give the same totals after a purge
//! (see [`rfaas_service::usage`]).

use std::collections::BTreeMap;

use rfaas_proto::accounting::{SlotTotals, UsageFigures};
use sqlx::Row;

use super::Store;
use crate::db::{i, text_col, u64_col, Backend, DbError};
use rfaas_service::usage::{totals, COUNTERS};

/// A day, ms.
pub const DAY_MS: u64 = 86_400_000;

/// The PostgreSQL advisory lock one replica holds while it purges a
/// batch, so replicas never purge the same rows at once.
const PURGE_LOCK: i64 = 0x7266_6161_735f_7270; // "rfaas_rp"

/// What one batch purged.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Purged {
    /// Ended leases deleted.
    pub leases: u64,
    /// Their `usage` rows.
    pub usage: u64,
    /// Their `usage_snapshots` rows.
    pub snapshots: u64,
    /// Whether another replica held the purge lock (nothing was done).
    pub busy: bool,
}

/// The key of a day's totals.
type DayKey = (u64, String, String, u64, String, i64);

/// The UTC day whose totals a snapshot taken at `at_ms` ends: a period
/// `[D, D + 1 day)` counts the snapshots at or before its end, so one
/// taken exactly at midnight closes the day before.
fn day_of(at_ms: u64) -> u64 {
    at_ms.saturating_sub(1) / DAY_MS * DAY_MS
}

impl Store {
    /// Purges at most `batch` leases that ended before `before_ms`, with
    /// their usage and snapshots, after adding their usage per day into
    /// `usage_daily`: one transaction. Returns what it deleted; fewer
    /// leases than `batch` means none are left.
    pub async fn purge_ended(&self, before_ms: u64, batch: u32) -> Result<Purged, DbError> {
        let mut tx = self.pool.begin().await?;
        if self.backend == Backend::Postgres {
            let row = sqlx::query("SELECT pg_try_advisory_xact_lock($1) AS locked")
                .bind(PURGE_LOCK)
                .fetch_one(&mut *tx)
                .await?;
            if !row.try_get::<bool, _>("locked")? {
                return Ok(Purged {
                    busy: true,
                    ..Purged::default()
                });
            }
        }
        let leases = sqlx::query(
            "SELECT id, user_name, account, job_id, node, harvested FROM leases
             WHERE state <> 'active' AND ended_ms < $1 ORDER BY ended_ms LIMIT $2",
        )
        .bind(i(before_ms))
        .bind(i64::from(batch))
        .fetch_all(&mut *tx)
        .await?;
        if leases.is_empty() {
            return Ok(Purged::default());
        }
        let mut ids = Vec::with_capacity(leases.len());
        let mut keys = BTreeMap::new();
        for row in &leases {
            let id = u64_col(row, "id")?;
            ids.push(id);
            let job: Option<i64> = row.try_get("job_id")?;
            keys.insert(
                id,
                (
                    text_col(row, "user_name")?,
                    text_col(row, "account")?,
                    job.map_or(0, |j| j.max(0) as u64),
                    text_col(row, "node")?,
                    row.try_get::<i64, _>("harvested")?,
                ),
            );
        }
        let list = ids
            .iter()
            .map(|id| id.to_string())
            .collect::<Vec<_>>()
            .join(",");
        let cols = COUNTERS.join(", ");
        let mut days: BTreeMap<DayKey, UsageFigures> = BTreeMap::new();
        let mut add = |id: u64, at_ms: u64, grew: UsageFigures| {
            if let Some((user, account, job, node, harvested)) = keys.get(&id) {
                let key = (
                    day_of(at_ms),
                    user.clone(),
                    account.clone(),
                    *job,
                    node.clone(),
                    *harvested,
                );
                days.entry(key).or_default().add(&grew);
            }
        };
        // Each snapshot adds its growth since the one before to its day;
        // usage flushed after the last snapshot, to the day of its flush.
        let mut last: BTreeMap<u64, UsageFigures> = BTreeMap::new();
        let snapshots = sqlx::query(&format!(
            "SELECT lease_id, at_ms, {cols} FROM usage_snapshots WHERE lease_id IN ({list})
             ORDER BY lease_id, at_ms"
        ))
        .fetch_all(&mut *tx)
        .await?;
        for row in &snapshots {
            let id = u64_col(row, "lease_id")?;
            let t = totals(row, "")?.unwrap_or_default();
            let before = last.insert(id, t).unwrap_or_default();
            add(id, u64_col(row, "at_ms")?, t.since(&before));
        }
        let usage = sqlx::query(&format!(
            "SELECT lease_id, updated_ms, {cols} FROM usage WHERE lease_id IN ({list})"
        ))
        .fetch_all(&mut *tx)
        .await?;
        for row in &usage {
            let id = u64_col(row, "lease_id")?;
            let t = totals(row, "")?.unwrap_or_default();
            let before = last.get(&id).copied().unwrap_or_default();
            add(
                id,
                u64_col(row, "updated_ms")?.saturating_add(1),
                t.since(&before),
            );
        }
        let grow = COUNTERS
            .iter()
            .map(|c| format!("{c} = usage_daily.{c} + excluded.{c}"))
            .collect::<Vec<_>>()
            .join(", ");
        let marks = (7..7 + COUNTERS.len())
            .map(|k| format!("${k}"))
            .collect::<Vec<_>>()
            .join(", ");
        let upsert = format!(
            "INSERT INTO usage_daily (day_ms, user_name, account, job_id, node, harvested, {cols})
             VALUES ($1, $2, $3, $4, $5, $6, {marks})
             ON CONFLICT (day_ms, user_name, account, job_id, node, harvested) DO UPDATE SET {grow}"
        );
        for ((day, user, account, job, node, harvested), u) in &days {
            if *u == UsageFigures::default() {
                continue;
            }
            let mut q = sqlx::query(&upsert)
                .bind(i(*day))
                .bind(user.as_str())
                .bind(account.as_str())
                .bind(i(*job))
                .bind(node.as_str())
                .bind(*harvested);
            let slot = SlotTotals {
                usage: *u,
                closed: 0,
            };
            for &w in &slot.to_words()[..COUNTERS.len()] {
                q = q.bind(i(w));
            }
            q.execute(&mut *tx).await?;
        }
        let deleted =
            |table: &str, column: &str| format!("DELETE FROM {table} WHERE {column} IN ({list})");
        let snapshots = sqlx::query(&deleted("usage_snapshots", "lease_id"))
            .execute(&mut *tx)
            .await?
            .rows_affected();
        let usage = sqlx::query(&deleted("usage", "lease_id"))
            .execute(&mut *tx)
            .await?
            .rows_affected();
        let leases = sqlx::query(&deleted("leases", "id"))
            .execute(&mut *tx)
            .await?
            .rows_affected();
        tx.commit().await?;
        Ok(Purged {
            leases,
            usage,
            snapshots,
            busy: false,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_snapshot_at_midnight_closes_the_day_before() {
        assert_eq!(day_of(DAY_MS), 0);
        assert_eq!(day_of(DAY_MS + 1), DAY_MS);
        assert_eq!(day_of(2 * DAY_MS - 1), DAY_MS);
    }
}

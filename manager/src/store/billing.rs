//! Accounting instances (written by the accounting service) and the
//! billing slots grants take from them.

use std::collections::HashMap;

use rfaas_proto::accounting::BillingSlot;
use sqlx::any::AnyRow;
use sqlx::{Any, Transaction};

use super::Store;
use crate::db::{i, text_col, u64_col, DbError};

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

impl Store {
    /// The billing slots grant `grant_id`'s leases hold, by lease id.
    pub(super) async fn grant_billing(
        &self,
        grant_id: u64,
    ) -> Result<HashMap<u64, BillingSlot>, DbError> {
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
pub(super) async fn assign_slot(
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

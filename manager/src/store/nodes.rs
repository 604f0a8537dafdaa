//! Nodes: registrations, heartbeats, drains, and nodes lost.

use rfaas_proto::manager::{Heartbeat, NodeProvider, NodeState, NodeView, RegisterNode};
use sqlx::any::AnyRow;

use super::leases::{LeaseRow, LEASE_COLS};
use super::Store;
use crate::announce::Leased;
use crate::db::{i, text_col, u64_col, DbError};

/// The mark at the start of every statement liveness runs (registrations,
/// heartbeats, their batched flush, nodes lost, the view's reloads), so a
/// site (and the fleet benchmark) can tell them apart in
/// `pg_stat_statements` from grants' and releases'.
pub const LIVENESS: &str = "/* rfaas:liveness */";

/// Most nodes one flush statement names (two parameters each: far below
/// either database's limit).
const FLUSH_CHUNK: usize = 4000;

/// The columns of a node, in the order [`node_from_row`] reads them.
const NODE_COLS: &str = "name, admin_state, lost, control_addr, control_tls, providers, cores, memory_mib, leased_cores, leased_memory_mib, last_heartbeat_ms, harvested, withheld_cores, draining_cores, draining_memory_mib, lease_seq, partitions";

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

/// `node`'s `leased_cores, leased_memory_mib, lease_seq`.
pub(super) fn leased_cols(node: &str, row: &AnyRow) -> Result<Leased, DbError> {
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
    let partitions: Vec<String> = serde_json::from_str(&text_col(row, "partitions")?)
        .map_err(|e| DbError::Other(format!("stored partitions: {e}")))?;
    let node = NodeView {
        name: text_col(row, "name")?,
        state,
        control_addr: text_col(row, "control_addr")?,
        control_tls: u64_col(row, "control_tls")? != 0,
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
        partitions,
    };
    Ok(StoredNode {
        node,
        lease_seq: u64_col(row, "lease_seq")?,
    })
}

/// The statement [`Store::nodes_in`] runs: the nodes of partition `$1`
/// named after `$2` and from `$3` on, by name, at most `$4`, through the index on
/// `node_partitions (partition, node)`.
pub fn nodes_in_sql() -> String {
    let cols: Vec<String> = NODE_COLS.split(", ").map(|c| format!("n.{c}")).collect();
    format!(
        "SELECT {} FROM node_partitions p JOIN nodes n ON n.name = p.node
         WHERE p.partition = $1 AND p.node > $2 AND p.node >= $3 ORDER BY p.node LIMIT $4",
        cols.join(", ")
    )
}

impl Store {
    /// Registers `name`, or updates its record; a lost node comes back.
    ///
    /// A node registered with fewer cores or less memory than it has
    /// leased keeps its leases: its capacity stays at what is leased, and
    /// the difference is recorded as draining (see `NODE_CAPACITY`). The
    /// partitions it names replace those it had.
    pub async fn register(
        &self,
        name: &str,
        r: &RegisterNode,
        now_ms: u64,
    ) -> Result<StoredNode, DbError> {
        let providers = serde_json::to_string(&r.providers).expect("providers serialise");
        let partitions = serde_json::to_string(&r.partitions).expect("partitions serialise");
        let mut tx = self.pool.begin().await?;
        let row = sqlx::query(&format!(
            "{LIVENESS} INSERT INTO nodes (name, admin_state, lost, control_addr, providers, cores, memory_mib, leased_cores, leased_memory_mib, free_cores, free_memory_mib, version, registered_ms, last_heartbeat_ms, harvested, control_tls, partitions)
             VALUES ($1, 'up', 0, $2, $3, $4, $5, 0, 0, $4, $5, $6, $7, $7, $8, $9, $10)
             ON CONFLICT (name) DO UPDATE SET lost = 0, control_addr = excluded.control_addr, control_tls = excluded.control_tls, providers = excluded.providers,
                cores = CASE WHEN nodes.leased_cores > excluded.cores THEN nodes.leased_cores ELSE excluded.cores END,
                draining_cores = CASE WHEN nodes.leased_cores > excluded.cores THEN nodes.leased_cores - excluded.cores ELSE 0 END,
                memory_mib = CASE WHEN nodes.leased_memory_mib > excluded.memory_mib THEN nodes.leased_memory_mib ELSE excluded.memory_mib END,
                draining_memory_mib = CASE WHEN nodes.leased_memory_mib > excluded.memory_mib
                    THEN nodes.leased_memory_mib - excluded.memory_mib ELSE 0 END,
                version = excluded.version,
                registered_ms = excluded.registered_ms, last_heartbeat_ms = excluded.last_heartbeat_ms,
                harvested = excluded.harvested, partitions = excluded.partitions
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
        .bind(i64::from(r.control_tls))
        .bind(partitions)
        .fetch_one(&mut *tx)
        .await?;
        let node = node_from_row(&row)?;
        sqlx::query(&format!(
            "{LIVENESS} DELETE FROM node_partitions WHERE node = $1"
        ))
        .bind(name)
        .execute(&mut *tx)
        .await?;
        for p in &r.partitions {
            sqlx::query(&format!(
                "{LIVENESS} INSERT INTO node_partitions (node, partition) VALUES ($1, $2)"
            ))
            .bind(name)
            .bind(p.as_str())
            .execute(&mut *tx)
            .await?;
        }
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
        let was_lost = sqlx::query(&format!(
            "{LIVENESS} UPDATE nodes SET lost = 0 WHERE name = $1 AND lost = 1"
        ))
        .bind(name)
        .execute(&mut *tx)
        .await?
        .rows_affected()
            == 1;
        // So is a change of the cores the node withholds: grants on other
        // replicas must stop (or start) placing leases there.
        let withheld_changed = sqlx::query(&format!(
            "{LIVENESS} UPDATE nodes SET withheld_cores = $2 WHERE name = $1 AND withheld_cores <> $2"
        ))
        .bind(name)
        .bind(i(h.withheld_cores.into()))
        .execute(&mut *tx)
        .await?
        .rows_affected()
            == 1;
        let row = sqlx::query(&format!(
            "{LIVENESS} UPDATE nodes SET last_heartbeat_ms = $2, free_cores = $3, free_memory_mib = $4
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
                "{LIVENESS} SELECT id FROM leases WHERE node = $1 AND state <> 'active' AND id IN ({})",
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

    /// Writes the heartbeats a replica heard since its last flush (node,
    /// when heard), a statement per [`FLUSH_CHUNK`] nodes: a node's
    /// `last_heartbeat_ms` only moves forward, whichever replica flushes
    /// first. Nodes not registered are skipped; a lost node stays lost
    /// (its next heartbeat brings it back, through [`Store::heartbeat`]).
    pub async fn flush_heartbeats(&self, heard: &[(String, u64)]) -> Result<(), DbError> {
        for chunk in heard.chunks(FLUSH_CHUNK) {
            let rows: Vec<String> = (0..chunk.len())
                .map(|k| format!("(${}, ${})", 2 * k + 1, 2 * k + 2))
                .collect();
            let sql = format!(
                "{LIVENESS} WITH heard (name, at_ms) AS (VALUES {})
                 UPDATE nodes SET last_heartbeat_ms = heard.at_ms FROM heard
                 WHERE nodes.name = heard.name AND nodes.last_heartbeat_ms < heard.at_ms",
                rows.join(", ")
            );
            let mut q = sqlx::query(&sql);
            for (name, at_ms) in chunk {
                q = q.bind(name.as_str()).bind(i(*at_ms));
            }
            q.execute(&self.pool).await?;
        }
        Ok(())
    }

    /// The nodes last heard at `since_ms` or later, and when, as the
    /// database holds it (what every replica flushed): the narrow read a
    /// round makes instead of reloading every node's row.
    pub async fn heard_since(&self, since_ms: u64) -> Result<Vec<(String, u64)>, DbError> {
        sqlx::query(&format!(
            "{LIVENESS} SELECT name, last_heartbeat_ms FROM nodes WHERE last_heartbeat_ms >= $1"
        ))
        .bind(i(since_ms))
        .fetch_all(&self.pool)
        .await?
        .iter()
        .map(|row| Ok((text_col(row, "name")?, u64_col(row, "last_heartbeat_ms")?)))
        .collect()
    }

    /// The leases that ended at `since_ms` or later: (lease, node, when).
    pub async fn ended_since(&self, since_ms: u64) -> Result<Vec<(u64, String, u64)>, DbError> {
        sqlx::query(&format!(
            "{LIVENESS} SELECT id, node, ended_ms FROM leases WHERE state <> 'active' AND ended_ms >= $1"
        ))
        .bind(i(since_ms))
        .fetch_all(&self.pool)
        .await?
        .iter()
        .map(|row| {
            Ok((
                u64_col(row, "id")?,
                text_col(row, "node")?,
                u64_col(row, "ended_ms")?,
            ))
        })
        .collect()
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
        sqlx::query(&format!(
            "{LIVENESS} SELECT {NODE_COLS} FROM nodes ORDER BY name"
        ))
        .fetch_all(&self.pool)
        .await?
        .iter()
        .map(node_from_row)
        .collect()
    }

    /// The nodes of `partition` named after `after` and not before `from`,
    /// by name, at most `limit`: an index read whatever the number of
    /// nodes.
    pub async fn nodes_in(
        &self,
        partition: &str,
        after: &str,
        from: &str,
        limit: u32,
    ) -> Result<Vec<StoredNode>, DbError> {
        sqlx::query(&format!("{LIVENESS} {}", nodes_in_sql()))
            .bind(partition)
            .bind(after)
            .bind(from)
            .bind(i64::from(limit))
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
                "{LIVENESS} SELECT {NODE_COLS} FROM nodes WHERE name IN ({})",
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

    /// Marks nodes silent since before `cut_ms` lost, then ends the leases
    /// of every lost node. Returns the nodes newly lost and the leases
    /// ended.
    pub async fn reap_lost(
        &self,
        cut_ms: u64,
        now_ms: u64,
    ) -> Result<(Vec<String>, Vec<LeaseRow>), DbError> {
        let mut tx = self.pool.begin().await?;
        let lost: Vec<String> = sqlx::query(&format!(
            "{LIVENESS} UPDATE nodes SET lost = 1 WHERE lost = 0 AND last_heartbeat_ms < $1 RETURNING name"
        ))
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
            "{LIVENESS} UPDATE leases SET state = 'lost', ended_ms = $1 WHERE state = 'active'
               AND node IN (SELECT name FROM nodes WHERE lost = 1) RETURNING {LEASE_COLS}"
        );
        let ended = self.end_leases(sqlx::query(&sql).bind(i(now_ms))).await?;
        Ok((lost, ended))
    }
}

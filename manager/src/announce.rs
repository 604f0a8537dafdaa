//! Telling the other replicas, in batches, what grants and releases left
//! leased on their nodes.
//!
//! A grant or a release changes a node's leased counters and bumps its
//! `lease_seq`, in the same conditional update. After the commit, the
//! replica applies the counters to its own view and queues them here.
//! Every [`BATCH`] at most, one `pg_notify` on `rfaas_nodes` carries what
//! queued meanwhile, the latest counters of each node: one notice for many
//! grants, and none inside the grant's transaction (a notifying commit
//! takes PostgreSQL's cluster-wide notify lock, and every notice wakes
//! every replica's listener).
//!
//! Batched notices no longer arrive in commit order, so each entry carries
//! its `lease_seq` and a view takes counters only with a higher one (see
//! [`crate::view::View::set_leased`]). A replica that stops between a
//! commit and its batch leaves the others behind until their next reload
//! (`refresh_ms`), as a lost notice always did; the database decides every
//! grant either way.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

use sqlx::AnyPool;

/// The longest a grant's counters wait for the batch that announces them.
/// Under load every replica sends one notice per period, which wakes
/// every replica's listener: 20 ms keeps that to 50 a second per replica
/// (5 ms gave three replicas some 8 % fewer grants a second at four
/// clients, docs/benchmarks.md), and a view, which only places, is at most
/// that much behind.
pub const BATCH: Duration = Duration::from_millis(20);

/// The longest payload one notice carries (PostgreSQL refuses 8000 bytes
/// and more); a larger batch goes out as several notices.
const MAX_PAYLOAD: usize = 7000;

/// A node's leased counters after a committed grant or release.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Leased {
    /// The node.
    pub node: String,
    /// Cores leased.
    pub cores: u32,
    /// Memory leased, MiB.
    pub memory_mib: u64,
    /// The node's `lease_seq` at that commit.
    pub seq: u64,
}

/// This replica's queue of counters to announce, and the task that sends
/// them (started with the first entry, ended when the queue is dropped).
#[derive(Debug)]
pub struct Announcer {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    pool: AnyPool,
    origin: String,
    /// Per node, the counters with the highest `lease_seq` not yet sent.
    pending: Mutex<BTreeMap<String, (u32, u64, u64)>>,
    wake: Arc<tokio::sync::Notify>,
    started: OnceLock<()>,
}

impl Drop for Announcer {
    fn drop(&mut self) {
        // The task holds only a weak reference: let it see the end.
        self.inner.wake.notify_one();
    }
}

impl Announcer {
    /// A queue announcing on `pool` as `origin`.
    pub fn new(pool: AnyPool, origin: String) -> Announcer {
        Announcer {
            inner: Arc::new(Inner {
                pool,
                origin,
                pending: Mutex::new(BTreeMap::new()),
                wake: Arc::new(tokio::sync::Notify::new()),
                started: OnceLock::new(),
            }),
        }
    }

    /// Queues `leased` for the next batch. Call from within the Tokio
    /// runtime the store lives in: the first call starts the sending task
    /// there, and a store outliving that runtime announces no more.
    pub fn queue(&self, leased: &[Leased]) {
        if leased.is_empty() {
            return;
        }
        {
            let mut pending = self.inner.pending.lock().unwrap_or_else(|p| p.into_inner());
            for l in leased {
                let entry = pending
                    .entry(l.node.clone())
                    .or_insert((l.cores, l.memory_mib, l.seq));
                if l.seq >= entry.2 {
                    *entry = (l.cores, l.memory_mib, l.seq);
                }
            }
        }
        self.inner.started.get_or_init(|| {
            tokio::spawn(send_loop(
                Arc::downgrade(&self.inner),
                self.inner.wake.clone(),
            ));
        });
        self.inner.wake.notify_one();
    }
}

/// The payloads announcing `batch` as `origin`: `<origin>:<node>=<cores>/
/// <memory_mib>/<seq>,...`, each under [`MAX_PAYLOAD`] bytes.
pub fn payloads(origin: &str, batch: &BTreeMap<String, (u32, u64, u64)>) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    for (node, (cores, mem, seq)) in batch {
        let entry = format!("{node}={cores}/{mem}/{seq}");
        if !cur.is_empty() && cur.len() + 1 + entry.len() > MAX_PAYLOAD {
            out.push(std::mem::take(&mut cur));
        }
        if cur.is_empty() {
            cur.push_str(origin);
            cur.push(':');
        } else {
            cur.push(',');
        }
        cur.push_str(&entry);
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

async fn send_loop(inner: Weak<Inner>, wake: Arc<tokio::sync::Notify>) {
    loop {
        wake.notified().await;
        // Let the grants of the next few milliseconds join this batch.
        tokio::time::sleep(BATCH).await;
        let Some(inner) = inner.upgrade() else { return };
        let batch = std::mem::take(&mut *inner.pending.lock().unwrap_or_else(|p| p.into_inner()));
        for payload in payloads(&inner.origin, &batch) {
            let sent = sqlx::query(
                "SELECT COUNT(*) AS n FROM (SELECT pg_notify('rfaas_nodes', $1)) AS sent",
            )
            .bind(payload)
            .execute(&inner.pool)
            .await;
            if let Err(e) = sent {
                // The other replicas catch up at their next reload.
                tracing::debug!(error = %e, "announcing leased counters failed");
                break;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payloads_carry_every_node_and_stay_under_the_limit() {
        let mut batch = BTreeMap::new();
        batch.insert("n1".to_string(), (3, 4096, 17));
        batch.insert("n2".to_string(), (0, 0, 2));
        assert_eq!(payloads("00ab", &batch), ["00ab:n1=3/4096/17,n2=0/0/2"]);
        assert!(payloads("00ab", &BTreeMap::new()).is_empty());

        let many: BTreeMap<String, (u32, u64, u64)> = (0..2000)
            .map(|k| (format!("node-{k:05}"), (k, u64::from(k) * 1024, 1)))
            .collect();
        let out = payloads("00ab", &many);
        assert!(out.len() > 1, "one payload of {} bytes", out[0].len());
        let mut seen = 0;
        for p in &out {
            assert!(p.len() <= MAX_PAYLOAD, "{} bytes", p.len());
            let (origin, entries) = crate::store::notice(p);
            assert_eq!(origin, Some("00ab"));
            seen += entries.len();
        }
        assert_eq!(seen, many.len());
    }
}

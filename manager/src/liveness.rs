//! Liveness without a database write per heartbeat.
//!
//! A heartbeat that changes nothing the other replicas act on (the node
//! is up in this replica's view and withholds the same cores) is kept in
//! memory: [`Liveness::heard`] records when, and the replica's view shows
//! it at once. Every `refresh_ms` the replica writes what it heard since
//! the last round in one statement per few thousand nodes
//! ([`Store::flush_heartbeats`]), then marks lost the nodes silent for
//! `lost_after` ([`crate::App::refresh`]); a replica stopping writes what
//! it holds first. A heartbeat that does change something (a lost node
//! back, other withheld cores) or names a node this replica does not
//! know goes to the database at once, as a registration does.
//!
//! The database therefore learns of a node at most `refresh_ms` after a
//! replica heard it, and stores when it was heard, not when it was
//! written: a silent node is marked lost within `lost_after + refresh_ms`
//! of its last heartbeat by whichever replica reaps first. A replica that
//! dies loses at most one round of heartbeats; its nodes fail over to
//! another replica within a heartbeat and a call's timeout, which
//! [`Intervals`] keeps below `lost_after`, so they are not lost with it.
//!
//! Heartbeat replies list the node's leases that have ended. Each replica
//! keeps the leases ended in the last [`ENDED_WINDOW_MS`] in memory,
//! loaded every round from the database (one indexed query for every
//! replica's ends), so that answer needs no query either. A lease ended
//! longer ago than the window that a node still holds is one whose node
//! missed every heartbeat reply since: the node was lost meanwhile, its
//! next heartbeat goes to the database, and in any case its worker stops
//! at the lease's expiry, which the executor enforces itself.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;

use rfaas_proto::manager::HeldLease;

use crate::db::DbError;
use crate::store::Store;
use crate::view::View;

/// How long ended leases are remembered, ms.
pub const ENDED_WINDOW_MS: u64 = 10 * 60 * 1000;

/// How far back each round's query of ended leases reaches before the
/// previous round's start, ms: a lease ended (its `ended_ms` taken) in a
/// transaction that commits later than a round's read is still seen.
const ENDED_OVERLAP_MS: u64 = 10_000;

/// How often a round reloads every node's whole row, ms: the rounds
/// between read only the heartbeat times the replicas wrote
/// ([`Liveness::follow`]). Every other change reaches the view at once
/// (this replica's own, other replicas' through their notices).
pub const FULL_RELOAD_MS: u64 = 30_000;

/// How far a round's read of heartbeat times reaches before the previous
/// read started, beyond one `refresh_ms`, ms: another replica writes a
/// heartbeat up to its round after hearing it, with the time it heard it
/// by its own clock.
const HEARD_OVERLAP_MS: u64 = 2_000;

/// Heartbeats heard, not yet written; leases recently ended.
#[derive(Debug, Default)]
pub struct Liveness {
    heard: Mutex<HashMap<String, u64>>,
    ended: Mutex<Ended>,
    read: Mutex<Read>,
}

/// When the rounds last read the nodes, ms (0: never).
#[derive(Debug, Default)]
struct Read {
    /// Every node's row.
    full_ms: u64,
    /// The heartbeat times.
    heard_ms: u64,
}

#[derive(Debug, Default)]
struct Ended {
    /// Lease → (node, ended_ms).
    leases: HashMap<u64, (String, u64)>,
    /// When the last load started, ms (0: never).
    loaded_ms: u64,
}

impl Liveness {
    /// Records a heartbeat from `node` at `at_ms`.
    pub fn heard(&self, node: &str, at_ms: u64) {
        let mut heard = self.heard.lock().unwrap_or_else(|p| p.into_inner());
        match heard.get_mut(node) {
            Some(t) => *t = (*t).max(at_ms),
            None => {
                heard.insert(node.to_owned(), at_ms);
            }
        }
    }

    /// How many nodes were heard since the last flush.
    pub fn pending(&self) -> usize {
        self.heard.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Writes what was heard since the last flush. On failure it is kept
    /// for the next one (merged with what is heard meanwhile).
    pub async fn flush(&self, store: &Store) -> Result<usize, DbError> {
        let batch: Vec<(String, u64)> = {
            let mut heard = self.heard.lock().unwrap_or_else(|p| p.into_inner());
            heard.drain().collect()
        };
        if batch.is_empty() {
            return Ok(0);
        }
        match store.flush_heartbeats(&batch).await {
            Ok(()) => Ok(batch.len()),
            Err(e) => {
                for (node, at_ms) in &batch {
                    self.heard(node, *at_ms);
                }
                Err(e)
            }
        }
    }

    /// Brings the view up to date with the database, a round's way: at
    /// most every [`FULL_RELOAD_MS`] every node's row, otherwise only the
    /// heartbeat times written since the last read (other replicas'
    /// nodes; a short, narrow read). The view learns of every other change
    /// as it is made, so the full reload is a safety net, and a fleet of
    /// 10,000 nodes costs a round a few thousand names and times rather
    /// than 10,000 rows.
    /// Returns which read it made: `"full"` or `"heard"`.
    pub async fn follow(
        &self,
        store: &Store,
        view: &View,
        now_ms: u64,
        refresh_ms: u64,
    ) -> Result<&'static str, DbError> {
        let (full_ms, heard_ms) = {
            let read = self.read.lock().unwrap_or_else(|p| p.into_inner());
            (read.full_ms, read.heard_ms)
        };
        if full_ms == 0 || now_ms.saturating_sub(full_ms) >= FULL_RELOAD_MS {
            view.replace_all(store.nodes().await?);
            let mut read = self.read.lock().unwrap_or_else(|p| p.into_inner());
            (read.full_ms, read.heard_ms) = (now_ms, now_ms);
            Ok("full")
        } else {
            let since = heard_ms.saturating_sub(refresh_ms + HEARD_OVERLAP_MS);
            view.heard(&store.heard_since(since).await?);
            self.read.lock().unwrap_or_else(|p| p.into_inner()).heard_ms = now_ms;
            Ok("heard")
        }
    }

    /// Loads the leases ended since the last load (with an overlap), and
    /// forgets those ended before the window.
    pub async fn load_ended(&self, store: &Store, now_ms: u64) -> Result<(), DbError> {
        let since = {
            let ended = self.ended.lock().unwrap_or_else(|p| p.into_inner());
            if ended.loaded_ms == 0 {
                now_ms.saturating_sub(ENDED_WINDOW_MS)
            } else {
                ended.loaded_ms.saturating_sub(ENDED_OVERLAP_MS)
            }
        };
        let rows = store.ended_since(since).await?;
        let mut ended = self.ended.lock().unwrap_or_else(|p| p.into_inner());
        let cut = now_ms.saturating_sub(ENDED_WINDOW_MS);
        ended.leases.retain(|_, (_, at)| *at >= cut);
        for (id, node, at) in rows {
            ended.leases.insert(id, (node, at));
        }
        ended.loaded_ms = now_ms;
        Ok(())
    }

    /// Whether ended leases were loaded at least once: until then a
    /// heartbeat's answer needs the database.
    pub fn knows_ended(&self) -> bool {
        self.ended
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .loaded_ms
            != 0
    }

    /// The leases `node` holds that have ended, as far as this replica
    /// knows.
    pub fn ended_of(&self, node: &str, held: &[HeldLease]) -> Vec<u64> {
        if held.is_empty() {
            return Vec::new();
        }
        let ended = self.ended.lock().unwrap_or_else(|p| p.into_inner());
        let mut seen = HashSet::new();
        held.iter()
            .filter(|h| {
                ended
                    .leases
                    .get(&h.lease_id)
                    .is_some_and(|(n, _)| n == node)
                    && seen.insert(h.lease_id)
            })
            .map(|h| h.lease_id)
            .collect()
    }
}

/// The heartbeat interval and loss timeout for a fleet's size.
///
/// Nodes heartbeat every `max(heartbeat_interval_ms, nodes / heartbeats_per_s)`:
/// the replicas together take at most `heartbeats_per_s` heartbeats a
/// second whatever the fleet's size (0: the interval never grows). A node
/// is lost after `max(lost_after_ms, 3 × interval + 2 × refresh_ms +
/// failover)`: three heartbeats missed, plus a round a dead replica did
/// not write and the round that reaps, plus the time a node takes to turn
/// to another replica.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Intervals {
    /// Interval, ms.
    pub heartbeat_ms: u64,
    /// Loss timeout, ms.
    pub lost_after_ms: u64,
}

/// How long a node takes to turn to another replica: its call's timeout
/// and a retry.
pub const FAILOVER_MS: u64 = 2000;

impl Intervals {
    /// For `nodes` nodes.
    pub fn of(
        nodes: usize,
        heartbeat_interval_ms: u64,
        heartbeats_per_s: u64,
        lost_after_ms: u64,
        refresh_ms: u64,
    ) -> Intervals {
        let nodes = nodes as u64;
        let heartbeat_ms = if heartbeats_per_s == 0 {
            heartbeat_interval_ms
        } else {
            // Rounded up to a tenth of a second, so it moves seldom.
            let needed = (nodes.saturating_mul(1000)).div_ceil(heartbeats_per_s);
            heartbeat_interval_ms.max(needed.div_ceil(100) * 100)
        };
        let grown = heartbeat_ms > heartbeat_interval_ms;
        let lost_after_ms = if grown {
            lost_after_ms.max(3 * heartbeat_ms + 2 * refresh_ms + FAILOVER_MS)
        } else {
            lost_after_ms
        };
        Intervals {
            heartbeat_ms,
            lost_after_ms,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn held(ids: &[u64]) -> Vec<HeldLease> {
        ids.iter()
            .map(|&lease_id| HeldLease {
                lease_id,
                cores: 1,
                memory_mib: 1,
            })
            .collect()
    }

    #[test]
    fn heard_keeps_the_newest_time() {
        let l = Liveness::default();
        l.heard("a", 10);
        l.heard("a", 5);
        l.heard("b", 7);
        let heard = l.heard.lock().unwrap();
        assert_eq!(heard["a"], 10);
        assert_eq!(heard["b"], 7);
    }

    #[test]
    fn ended_leases_are_answered_for_their_own_node_only() {
        let l = Liveness::default();
        {
            let mut e = l.ended.lock().unwrap();
            e.leases.insert(1, ("a".into(), 100));
            e.leases.insert(2, ("b".into(), 100));
            e.loaded_ms = 100;
        }
        assert_eq!(l.ended_of("a", &held(&[1, 2, 3, 1])), [1]);
        assert!(l.ended_of("c", &held(&[1, 2])).is_empty());
    }

    #[test]
    fn the_interval_grows_with_the_fleet_and_the_loss_timeout_with_it() {
        // Small fleets keep the configured values.
        let small = Intervals::of(100, 1000, 2000, 10_000, 1000);
        assert_eq!(
            small,
            Intervals {
                heartbeat_ms: 1000,
                lost_after_ms: 10_000
            }
        );
        let at_2000 = Intervals::of(2000, 1000, 2000, 10_000, 1000);
        assert_eq!(at_2000.heartbeat_ms, 1000);
        // 10,000 nodes at 2,000 heartbeats a second: every 5 s.
        let big = Intervals::of(10_000, 1000, 2000, 10_000, 1000);
        assert_eq!(big.heartbeat_ms, 5000);
        assert_eq!(big.lost_after_ms, 3 * 5000 + 2 * 1000 + FAILOVER_MS);
        // A rate of 0 fixes the interval.
        assert_eq!(
            Intervals::of(10_000, 1000, 0, 10_000, 1000).heartbeat_ms,
            1000
        );
        // Rounded up to a tenth of a second.
        assert_eq!(
            Intervals::of(2001, 1000, 2000, 10_000, 1000).heartbeat_ms,
            1100
        );
    }
}

//! The allocation table: capacity, allocations, the idle pool and the
//! leases ended early, the [`State`] behind the daemon's one lock
//! ([`super::shared::Shared::lock`]).
//!
//! A worker's pid is signalled only under the lock and only while an
//! allocation or the pool names it; its watcher reaps it and removes it
//! from both in one critical section (see [`super::supervise`]), so a
//! recycled pid is never signalled.

use std::collections::BTreeMap;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::Instant;

use super::capacity::Capacity;
use super::process::Ended;
use super::slurm::hold::Hold;

/// Why the daemon ends an allocation's worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stop {
    /// The client deallocated (or closed its connection).
    Deallocate,
    /// The worker failed to start; the client gets an error reply.
    Failed,
    /// The lease ended.
    LeaseExpired,
    /// The manager ended the lease before its expiry (released by its job,
    /// or revoked).
    LeaseEnded,
    /// The node is being retrieved (a drain).
    Drained,
    /// The daemon is shutting down (SIGTERM, SIGINT).
    Shutdown,
}

/// One allocation, from its grant to its worker's end.
#[derive(Debug)]
pub(crate) struct Allocation {
    pub id: u64,
    pub lease_id: u64,
    pub user: String,
    /// The control connection it was made on (its `WorkerExited` goes
    /// there, and its end deallocates it).
    pub conn_id: u64,
    /// The worker, once one is attached; `None` again after it ended.
    pub pid: Option<u32>,
    /// Kept open for the worker's lifetime.
    pub worker_sock: Option<UnixStream>,
    pub cpus: Vec<u32>,
    pub memory_mib: u32,
    pub expires_at: u64,
    /// Hot or warm lanes.
    pub mode: rfaas_proto::control::client::Mode,
    /// The worker answered `WorkerReady` and the client was told.
    pub ready: bool,
    /// Set when the daemon decided to end the worker.
    pub stop: Option<Stop>,
    /// How the worker ended, for one that ended before it was ready.
    pub ended: Option<Ended>,
    pub runtime_dir: PathBuf,
    /// What a client shows to take the allocation up again on a new
    /// connection after a restart (`Attach`); empty: it cannot.
    pub attach_secret: String,
    /// Adopted from a previous daemon and not yet attached by its client:
    /// ended (as a closed connection ends it) if none attaches by then.
    pub attach_by: Option<Instant>,
}

/// An idle pre-spawned worker.
#[derive(Debug)]
pub(crate) struct PoolWorker {
    pub pid: u32,
    pub sock: UnixStream,
}

/// Everything behind the lock.
#[derive(Debug)]
pub(crate) struct State {
    pub draining: bool,
    pub stopping: bool,
    pub capacity: Capacity,
    pub allocations: BTreeMap<u64, Allocation>,
    pub pool: Vec<PoolWorker>,
    /// `WorkerExited` reports decided but not yet queued for the
    /// connection loop; shutdown waits for them.
    pub reports_pending: usize,
    /// Leases the manager ended before their expiry, with when it said so
    /// (Unix seconds): their tokens must not allocate again. Bounded by
    /// [`ENDED_LEASES_KEPT`] entries and [`ENDED_LEASES_KEPT_S`].
    pub ended_leases: BTreeMap<u64, u64>,
    /// Slurm jobs this node's CPUs were taken back for and not yet
    /// offered again, with what is withheld for each ([`super::slurm`]).
    pub slurm_jobs: BTreeMap<u64, Hold>,
    /// When a Slurm hook last spoke of each job (reconciliation leaves
    /// such jobs to the hook for a round).
    pub slurm_events: BTreeMap<u64, Instant>,
    /// Jobs whose take-back asks Slurm for their CPUs right now;
    /// meanwhile every CPU is withheld, and reconciliation leaves them be.
    pub slurm_asking: Vec<u64>,
    /// Something changed what the managers should hear: the manager link
    /// sends a heartbeat now rather than at its next interval.
    pub beat_now: bool,
    /// Allocations were taken back (a drain, a Slurm job): the billing
    /// thread posts every lease's figures now rather than at their
    /// granularity.
    pub flush_billing: bool,
}

impl State {
    /// Those of `ids` that are gone or ending for a reason of their own
    /// (their client let go, their lease ended): a take-back that chose
    /// them under this lock finds them finished, not drained.
    pub(crate) fn ending(&self, ids: &[u64]) -> Vec<u64> {
        ids.iter()
            .copied()
            .filter(|id| self.allocations.get(id).map_or(true, |a| a.stop.is_some()))
            .collect()
    }
}

/// Most ended leases remembered (16 bytes each); the oldest go first.
pub(crate) const ENDED_LEASES_KEPT: usize = 65_536;

/// How long an ended lease is remembered, seconds: longer than any lease a
/// manager grants by default (`max_lease_s`, one day).
pub(crate) const ENDED_LEASES_KEPT_S: u64 = 7 * 24 * 3600;

/// Forgets ended leases older than [`ENDED_LEASES_KEPT_S`], then the oldest
/// beyond [`ENDED_LEASES_KEPT`].
pub(crate) fn prune_ended_leases(ended: &mut BTreeMap<u64, u64>, now: u64) {
    ended.retain(|_, at| now.saturating_sub(*at) < ENDED_LEASES_KEPT_S);
    if ended.len() > ENDED_LEASES_KEPT {
        let mut times: Vec<u64> = ended.values().copied().collect();
        times.sort_unstable();
        let cut = times[ended.len() - ENDED_LEASES_KEPT];
        ended.retain(|_, at| *at >= cut);
        while ended.len() > ENDED_LEASES_KEPT {
            ended.pop_first();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ended_leases_stay_bounded_in_age_and_number() {
        let mut ended = BTreeMap::new();
        ended.insert(1, 0);
        ended.insert(2, ENDED_LEASES_KEPT_S);
        prune_ended_leases(&mut ended, ENDED_LEASES_KEPT_S + 10);
        assert_eq!(ended.keys().copied().collect::<Vec<_>>(), vec![2]);

        let mut many: BTreeMap<u64, u64> = (0..ENDED_LEASES_KEPT as u64 + 10)
            .map(|i| (i, 100 + i))
            .collect();
        prune_ended_leases(&mut many, 200);
        assert_eq!(many.len(), ENDED_LEASES_KEPT);
        assert!(!many.contains_key(&0), "the oldest go first");
        assert!(many.contains_key(&(ENDED_LEASES_KEPT as u64 + 9)));
    }
}

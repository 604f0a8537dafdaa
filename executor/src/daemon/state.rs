//! The daemon's shared state: capacity, allocations, the idle pool, behind
//! one mutex, and the rules for ending allocations.
//!
//! A worker's pid is signalled only under the lock and only while an
//! allocation or the pool names it; its watcher reaps it and removes it
//! from both in one critical section (see [`super::supervise`]), so a
//! recycled pid is never signalled.

use std::collections::BTreeMap;
use std::io;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use rfaas_proto::control::{Frame, FrameLimits};
use rfaas_proto::lease::LeaseKeys;
use rfaas_proto::text::count;

use super::capacity::Capacity;
use super::config::Settings;
use super::epoll::Waker;
use super::memlimit::MemoryLimiter;
use super::process::{self, Ended};
use super::supervise::SpawnJob;

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

/// What other threads tell the connection loop ([`super::server`]).
#[derive(Debug)]
pub(crate) enum LoopMsg {
    /// Write these bytes (whole frames) to connection `conn`.
    Send { conn: u64, bytes: Vec<u8> },
    /// The request of connection `conn` is answered: read its next one.
    /// `granted`: it was an allocation that succeeded; `release`: library
    /// bytes of the shared budget it no longer holds.
    Done {
        conn: u64,
        granted: bool,
        release: u64,
    },
    /// The daemon is stopping: answer what is in flight, write what is
    /// queued, and end.
    Stop,
}

/// The loop's inbox: messages, and a wake-up for its epoll wait.
#[derive(Debug)]
pub(crate) struct Outbox {
    tx: mpsc::Sender<LoopMsg>,
    waker: Arc<Waker>,
}

impl Outbox {
    pub(crate) fn new(tx: mpsc::Sender<LoopMsg>, waker: Arc<Waker>) -> Outbox {
        Outbox { tx, waker }
    }

    /// Queues `msg` for the loop. Never blocks.
    pub(crate) fn post(&self, msg: LoopMsg) {
        // Only fails once the loop has ended, when nobody is left to tell.
        if self.tx.send(msg).is_ok() {
            self.waker.wake();
        }
    }
}

/// Reports a request as answered when dropped, so a request thread that
/// panics still lets its connection go on.
#[derive(Debug)]
pub(crate) struct DoneGuard<'a> {
    outbox: &'a Outbox,
    conn: u64,
    pub granted: bool,
    release: u64,
}

impl<'a> DoneGuard<'a> {
    pub(crate) fn new(outbox: &'a Outbox, conn: u64, release: u64) -> DoneGuard<'a> {
        DoneGuard {
            outbox,
            conn,
            granted: false,
            release,
        }
    }
}

impl Drop for DoneGuard<'_> {
    fn drop(&mut self) {
        self.outbox.post(LoopMsg::Done {
            conn: self.conn,
            granted: self.granted,
            release: self.release,
        });
    }
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
    pub slurm_jobs: BTreeMap<u64, super::slurm::Hold>,
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

/// How long an allocation may take to end after SIGKILL.
pub(crate) const KILL_WAIT: Duration = Duration::from_secs(10);

/// What a take-back (a drain, a Slurm job's prolog) did to the
/// allocations it had to end, for its answer and its log line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TakenBack {
    /// From the take-back's start to its end.
    pub took: Duration,
    /// The grace period the allocations were given.
    pub grace: Duration,
    /// Over, or ending for another reason (their client let go, their
    /// lease ended), when the take-back began to wait.
    pub finished: usize,
    /// Ended within the grace.
    pub drained: usize,
    /// Still running when the grace ran out: killed.
    pub stopped: usize,
    /// Of those, still there after SIGKILL.
    pub stuck: usize,
}

impl TakenBack {
    /// "in 20 ms: 1 allocation drained within the 5000 ms grace period, 0
    /// stopped after it, 0 had finished already"; `on` follows each
    /// "allocation" (" on them").
    pub(crate) fn describe(&self, on: &str) -> String {
        let mut text = format!(
            "in {} ms: {}{on} drained within the {} ms grace period, {} stopped after it, {} had finished already",
            self.took.as_millis(),
            count(self.drained as u64, "allocation"),
            self.grace.as_millis(),
            self.stopped,
            self.finished,
        );
        if self.stuck > 0 {
            text.push_str(&format!(
                "; {} did not end after SIGKILL",
                count(self.stuck as u64, "worker")
            ));
        }
        text
    }

    /// Logs it as `what` ("drain done", "take-back done"), with `message`,
    /// the answer that says it in words.
    pub(crate) fn log(&self, what: &str, message: &str) {
        tracing::info!(
            took_ms = self.took.as_millis() as u64,
            grace_ms = self.grace.as_millis() as u64,
            drained = self.drained,
            stopped = self.stopped,
            finished = self.finished,
            stuck = self.stuck,
            %message,
            "{what}"
        );
    }
}

/// What every thread of the daemon shares.
#[derive(Debug)]
pub(crate) struct Shared {
    pub settings: Settings,
    /// The public keys lease tokens are checked with.
    pub lease_keys: LeaseKeys,
    pub limiter: MemoryLimiter,
    pub state: Mutex<State>,
    /// Notified whenever an allocation or a pool worker changes.
    pub changed: Condvar,
    pub spawner: mpsc::Sender<SpawnJob>,
    /// The connection loop's inbox.
    pub outbox: Outbox,
    /// Prometheus metrics.
    pub metrics: super::metrics::Metrics,
    /// What each lease used (its own lock; taken after `state`, never
    /// before).
    pub usage: super::usage::Ledger,
    /// Slurm jobs' credentials (own lock; taken after `state`, never
    /// before).
    pub jobs: super::jobs::Jobs,
    next_id: AtomicU64,
}

impl Shared {
    pub(crate) fn new(
        settings: Settings,
        lease_keys: LeaseKeys,
        limiter: MemoryLimiter,
        spawner: mpsc::Sender<SpawnJob>,
        outbox: Outbox,
        node_credential: Option<String>,
    ) -> Shared {
        let capacity = Capacity::new(&settings.cpus, settings.memory_mib);
        Shared {
            settings,
            lease_keys,
            limiter,
            state: Mutex::new(State {
                draining: false,
                stopping: false,
                capacity,
                allocations: BTreeMap::new(),
                pool: Vec::new(),
                reports_pending: 0,
                ended_leases: BTreeMap::new(),
                slurm_jobs: BTreeMap::new(),
                slurm_events: BTreeMap::new(),
                slurm_asking: Vec::new(),
                beat_now: false,
                flush_billing: false,
            }),
            changed: Condvar::new(),
            spawner,
            outbox,
            metrics: super::metrics::Metrics::new(),
            usage: super::usage::Ledger::new(crate::meter::TickClock::detect()),
            jobs: super::jobs::Jobs::new(node_credential),
            next_id: AtomicU64::new(1),
        }
    }

    /// Queues `frame` for control connection `conn` (dropped if it has
    /// closed). Never blocks.
    pub(crate) fn send(&self, conn: u64, frame: &Frame) {
        self.outbox.post(LoopMsg::Send {
            conn,
            bytes: frame.to_bytes(),
        });
    }

    /// A fresh id for an allocation or a connection.
    pub(crate) fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, State> {
        // A panic elsewhere must not take every worker's supervision down.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Limits for frames from clients.
    pub(crate) fn client_limits(&self) -> FrameLimits {
        FrameLimits {
            max_json: 1 << 20,
            max_blob: self.settings.max_library_bytes,
        }
    }

    /// Waits on `changed` until `done` holds or `timeout` passes; returns
    /// the guard and whether `done` holds.
    pub(crate) fn wait_until<'a>(
        &self,
        mut st: MutexGuard<'a, State>,
        timeout: Duration,
        mut done: impl FnMut(&State) -> bool,
    ) -> (MutexGuard<'a, State>, bool) {
        let until = Instant::now() + timeout;
        loop {
            if done(&st) {
                return (st, true);
            }
            let now = Instant::now();
            if now >= until {
                return (st, false);
            }
            st = self
                .changed
                .wait_timeout(st, until - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Removes allocation `id` and gives back its CPUs, memory, runtime
    /// directory and cgroup. Its worker must be gone.
    pub(crate) fn remove_allocation(&self, st: &mut State, id: u64) -> Option<Allocation> {
        let a = st.allocations.remove(&id)?;
        st.capacity.release(a.lease_id, &a.cpus, a.memory_mib);
        if let Err(e) = std::fs::remove_dir_all(&a.runtime_dir) {
            if e.kind() != io::ErrorKind::NotFound {
                tracing::warn!(dir = %a.runtime_dir.display(), error = %e, "cannot remove an allocation's runtime directory");
            }
        }
        self.limiter.remove(id);
        self.changed.notify_all();
        Some(a)
    }

    /// Ends the worker of each allocation in `ids` with `why` (unless a
    /// reason is set already) and waits, up to `timeout`, until they are
    /// gone. Returns how many were still there at the end.
    pub(crate) fn end_allocations(&self, ids: &[u64], why: Stop, timeout: Duration) -> usize {
        let mut st = self.lock();
        for id in ids {
            if let Some(a) = st.allocations.get_mut(id) {
                a.stop.get_or_insert(why);
                if let Some(pid) = a.pid {
                    process::signal(pid, libc::SIGKILL);
                }
            }
        }
        let (st, _) = self.wait_until(st, timeout, |st| {
            ids.iter().all(|id| !st.allocations.contains_key(id))
        });
        ids.iter()
            .filter(|id| st.allocations.contains_key(id))
            .count()
    }

    /// Waits until the allocations in `targets` have ended, at most what
    /// is left of `grace` since the take-back's `start`, then ends the
    /// rest ([`Stop::Drained`]) and has their figures posted at once.
    /// `ending`: those of them that were ending for another reason when
    /// the take-back chose them ([`State::ending`]).
    pub(crate) fn take_back(
        &self,
        targets: &[u64],
        ending: &[u64],
        grace: Duration,
        start: Instant,
    ) -> TakenBack {
        let st = self.lock();
        let (st, _) = self.wait_until(st, grace.saturating_sub(start.elapsed()), |st| {
            targets.iter().all(|id| !st.allocations.contains_key(id))
        });
        let left: Vec<u64> = targets
            .iter()
            .copied()
            .filter(|id| st.allocations.contains_key(id))
            .collect();
        drop(st);
        let stuck = self.end_allocations(&left, Stop::Drained, KILL_WAIT);
        if !targets.is_empty() {
            self.flush_billing();
        }
        // One still there after the grace was stopped, whatever it was
        // doing before.
        let finished = ending.iter().filter(|id| !left.contains(id)).count();
        TakenBack {
            took: start.elapsed(),
            grace,
            finished,
            drained: targets.len().saturating_sub(finished + left.len()),
            stopped: left.len(),
            stuck,
        }
    }

    /// Ends the leases in `ids` as the manager asked: their allocations'
    /// workers are killed (clients hear `lease_expired`, "the manager ended
    /// its lease"), and their tokens are refused from now on. Returns how
    /// many workers were signalled. Does not wait: the watchers reap them.
    pub(crate) fn end_leases(&self, ids: &[u64], now: u64) -> usize {
        let mut st = self.lock();
        let mut signalled = 0;
        for &lease in ids {
            st.ended_leases.insert(lease, now);
        }
        for a in st.allocations.values_mut() {
            if a.stop.is_none() && ids.contains(&a.lease_id) {
                a.stop = Some(Stop::LeaseEnded);
                if let Some(pid) = a.pid {
                    tracing::info!(
                        allocation = a.id,
                        lease = a.lease_id,
                        pid,
                        "the manager ended the lease; killing its worker"
                    );
                    process::signal(pid, libc::SIGKILL);
                    signalled += 1;
                }
            }
        }
        prune_ended_leases(&mut st.ended_leases, now);
        signalled
    }

    /// Asks the manager link for a heartbeat now (free capacity or
    /// draining changed).
    pub(crate) fn beat_now(&self, st: &mut State) {
        st.beat_now = true;
        self.changed.notify_all();
    }

    /// Asks the billing thread to post every lease's figures now
    /// (allocations were taken back).
    pub(crate) fn flush_billing(&self) {
        self.lock().flush_billing = true;
        self.changed.notify_all();
    }

    /// Kills every idle pooled worker (their watchers reap them).
    pub(crate) fn empty_pool(&self, st: &mut State) {
        for w in &st.pool {
            process::signal(w.pid, libc::SIGKILL);
        }
    }

    /// Asks the spawner to top the pool up.
    pub(crate) fn refill(&self) {
        let _ = self.spawner.send(SpawnJob::Refill);
    }

    /// Stops every worker, pooled or allocated, and waits (bounded) until
    /// they are reaped. Clients hear `WorkerExited` with cause `stopped`;
    /// allocations asked for meanwhile are refused `draining`.
    pub(crate) fn shutdown(&self) {
        let ids: Vec<u64> = {
            let mut st = self.lock();
            st.stopping = true;
            st.draining = true;
            self.empty_pool(&mut st);
            st.allocations.keys().copied().collect()
        };
        let left = self.end_allocations(&ids, Stop::Shutdown, Duration::from_secs(5));
        let st = self.lock();
        let (st, pool_done) = self.wait_until(st, Duration::from_secs(2), |st| {
            st.pool.is_empty() && st.reports_pending == 0
        });
        if left > 0 || !pool_done {
            tracing::error!(
                allocations = left,
                pooled = st.pool.len(),
                "some workers were not reaped in time"
            );
        }
    }
}

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

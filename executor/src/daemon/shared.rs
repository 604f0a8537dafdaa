//! What every thread of the daemon shares: its settings and keys, the
//! allocation table behind one lock ([`super::state`]), and the parts each
//! owned by a module of its own (metrics, the usage ledger, Slurm jobs'
//! credentials, the spawner's and the connection loop's inboxes). Ending
//! allocations and take-backs, which need several of them, live here.

use std::collections::BTreeMap;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use rfaas_proto::control::{Frame, FrameLimits};
use rfaas_proto::lease::LeaseKeys;
use rfaas_proto::text::count;

use super::capacity::Capacity;
use super::config::Settings;
use super::jobs::store::Jobs;
use super::memlimit::MemoryLimiter;
use super::metrics::Metrics;
use super::outbox::{LoopMsg, Outbox};
use super::process::{self, SpawnJob};
use super::state::{prune_ended_leases, Allocation, State, Stop};
use super::usage::Ledger;

/// How long an allocation may take to end after SIGKILL.
const KILL_WAIT: Duration = Duration::from_secs(10);

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
    pub metrics: Metrics,
    /// What each lease used (its own lock; taken after `state`, never
    /// before).
    pub usage: Ledger,
    /// Slurm jobs' credentials (own lock; taken after `state`, never
    /// before).
    pub jobs: Jobs,
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
            metrics: Metrics::new(),
            usage: Ledger::new(crate::meter::TickClock::detect()),
            jobs: Jobs::new(node_credential),
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

    /// Makes the next fresh id at least `next` (ids adopted allocations
    /// hold are not given again).
    pub(crate) fn skip_ids_to(&self, next: u64) {
        self.next_id.fetch_max(next, Ordering::Relaxed);
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
        super::records::remove(&self.settings.runtime_dir, id);
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
    ///
    /// With [`Settings::workers_outlive`], only the pool goes: allocated
    /// workers serve on, for the next daemon to adopt.
    pub(crate) fn shutdown(&self) {
        let outlive = self.settings.workers_outlive();
        let ids: Vec<u64> = {
            let mut st = self.lock();
            st.stopping = true;
            st.draining = true;
            self.empty_pool(&mut st);
            st.allocations
                .values()
                .filter(|a| !(outlive && a.ready && a.stop.is_none()))
                .map(|a| a.id)
                .collect()
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

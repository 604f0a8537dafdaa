//! The daemon's shared state: capacity, allocations, the idle pool, behind
//! one mutex, and the rules for ending allocations.
//!
//! A worker's pid is signalled only under the lock and only while an
//! allocation or the pool names it; its watcher reaps it under the lock
//! after removing it from both (see [`super::supervise`]), so a recycled
//! pid is never signalled.

use std::collections::BTreeMap;
use std::io;
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use rfaas_proto::control::{ErrorCode, ErrorReply, Frame, FrameLimits};

use super::capacity::Capacity;
use super::config::Settings;
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
    /// The node is being retrieved (a drain).
    Drained,
    /// The daemon is shutting down (SIGTERM, SIGINT).
    Shutdown,
}

/// The write side of a client's control connection, shared with the
/// watchers that report worker ends on it.
#[derive(Debug)]
pub(crate) struct ConnWriter {
    stream: Mutex<TcpStream>,
}

impl ConnWriter {
    pub(crate) fn new(stream: TcpStream) -> ConnWriter {
        ConnWriter {
            stream: Mutex::new(stream),
        }
    }

    /// Sends one frame; a failure means the client is gone, which its
    /// reader notices.
    pub(crate) fn send(&self, frame: &Frame) {
        let mut s = self.stream.lock().unwrap_or_else(|e| e.into_inner());
        if let Err(e) = frame.write_to(&mut *s) {
            tracing::debug!(error = %e, "cannot write to a control connection");
        }
    }

    /// Sends an [`ErrorReply`].
    pub(crate) fn error(&self, request_id: u64, code: ErrorCode, message: String) {
        tracing::info!(request_id, ?code, %message, "request refused");
        self.send(&Frame::new(
            &ErrorReply {
                request_id,
                code,
                message,
            },
            Vec::new(),
        ));
    }

    pub(crate) fn shutdown_write(&self) {
        let s = self.stream.lock().unwrap_or_else(|e| e.into_inner());
        let _ = s.shutdown(std::net::Shutdown::Write);
    }
}

/// One allocation, from its grant to its worker's end.
#[derive(Debug)]
pub(crate) struct Allocation {
    pub id: u64,
    pub lease_id: u64,
    pub user: String,
    pub conn_id: u64,
    pub conn: Arc<ConnWriter>,
    /// The worker, once one is attached; `None` again after it ended.
    pub pid: Option<u32>,
    /// Kept open for the worker's lifetime.
    pub worker_sock: Option<UnixStream>,
    pub cpus: Vec<u32>,
    pub memory_mib: u32,
    pub expires_at: u64,
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
    /// `WorkerExited` reports decided but not yet written; shutdown waits
    /// for them.
    pub reports_pending: usize,
}

/// What every thread of the daemon shares.
#[derive(Debug)]
pub(crate) struct Shared {
    pub settings: Settings,
    pub secret: Vec<u8>,
    pub limiter: MemoryLimiter,
    pub state: Mutex<State>,
    /// Notified whenever an allocation or a pool worker changes.
    pub changed: Condvar,
    pub spawner: mpsc::Sender<SpawnJob>,
    next_id: AtomicU64,
}

impl Shared {
    pub(crate) fn new(
        settings: Settings,
        secret: Vec<u8>,
        limiter: MemoryLimiter,
        spawner: mpsc::Sender<SpawnJob>,
    ) -> Shared {
        let capacity = Capacity::new(&settings.cpus, settings.memory_mib);
        Shared {
            settings,
            secret,
            limiter,
            state: Mutex::new(State {
                draining: false,
                stopping: false,
                capacity,
                allocations: BTreeMap::new(),
                pool: Vec::new(),
                reports_pending: 0,
            }),
            changed: Condvar::new(),
            spawner,
            next_id: AtomicU64::new(1),
        }
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

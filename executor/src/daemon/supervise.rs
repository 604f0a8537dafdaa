//! Worker supervision: the spawner thread (every worker is forked from it,
//! so the workers' parent-death signal is tied to a thread that lives as
//! long as the daemon), one watcher thread per worker blocking in
//! `waitid`, and the lease-expiry ticker.

use std::io;
use std::path::PathBuf;
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

use rfaas_proto::control::client::{ExitCause, WorkerExited};
use rfaas_proto::control::Frame;

use super::clock::unix_now;
use super::config::Sandbox;
use super::process::SpawnJob;
use super::process::{self, Bwrap, Ended, Spawned};
use super::shared::Shared;
use super::state::{PoolWorker, Stop};

/// The nice value pooled workers start with. Starting one (exec, dynamic
/// linking, its first pages) runs while allocations are being served; at
/// this value it takes the CPU only when the node has it to spare. The
/// daemon renices it to 0 when it hands it an allocation, before the
/// worker starts any thread ([`process::renice`]).
pub(crate) const POOL_NICE: i32 = 10;

/// How long the processes of an ended worker's allocation group may take
/// to go after SIGKILL (within the callers' wait for the allocation's
/// end, [`super::shared::Shared::end_allocations`]).
const GROUP_KILL_WAIT: Duration = Duration::from_secs(5);

/// The spawner thread's loop: direct requests first, then one pool worker
/// at a time while the pool is short.
pub(crate) fn spawner(shared: Arc<Shared>, jobs: mpsc::Receiver<SpawnJob>) {
    let worker = shared.settings.worker_path.clone();
    let env = shared.limiter.worker_env();
    let outlive = shared.settings.workers_outlive();
    let direct = |bwrap: Option<&Bwrap>, cgroup_procs: Option<&std::path::Path>| {
        process::spawn_worker(&worker, bwrap, cgroup_procs, 0, env, outlive)
    };
    let mut backoff_until = None::<std::time::Instant>;
    loop {
        // Drain every pending job before (re)filling the pool.
        loop {
            match jobs.try_recv() {
                Ok(SpawnJob::Direct {
                    bwrap,
                    cgroup_procs,
                    reply,
                }) => {
                    let _ = reply.send(direct(bwrap.as_ref(), cgroup_procs.as_deref()));
                }
                Ok(SpawnJob::Refill) => {}
                Err(mpsc::TryRecvError::Empty) => break,
                Err(mpsc::TryRecvError::Disconnected) => return,
            }
        }
        let short = {
            let st = shared.lock();
            let want = if st.draining || st.stopping || shared.settings.sandbox != Sandbox::None {
                0
            } else {
                shared.settings.pool_size as usize
            };
            st.pool.len() < want
        };
        let backing_off = backoff_until.is_some_and(|t| std::time::Instant::now() < t);
        if short && !backing_off {
            match process::spawn_worker(&worker, None, None, POOL_NICE, env, outlive) {
                Ok(s) => {
                    let pid = s.pid;
                    {
                        let mut st = shared.lock();
                        if st.draining || st.stopping {
                            process::signal(pid, libc::SIGKILL);
                        }
                        st.pool.push(PoolWorker { pid, sock: s.sock });
                    }
                    tracing::debug!(pid, "pooled worker started");
                    watch(&shared, pid);
                    continue;
                }
                Err(e) => {
                    tracing::error!(error = %e, "cannot pre-spawn a pooled worker; retrying in 5 s");
                    backoff_until = Some(std::time::Instant::now() + Duration::from_secs(5));
                }
            }
        }
        match jobs.recv_timeout(Duration::from_secs(1)) {
            Ok(SpawnJob::Direct {
                bwrap,
                cgroup_procs,
                reply,
            }) => {
                let _ = reply.send(direct(bwrap.as_ref(), cgroup_procs.as_deref()));
            }
            Ok(SpawnJob::Refill) | Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => return,
        }
    }
}

/// Starts a worker through the spawner thread.
pub(crate) fn spawn_direct(
    shared: &Shared,
    bwrap: Option<Bwrap>,
    cgroup_procs: Option<PathBuf>,
) -> io::Result<Spawned> {
    let (tx, rx) = mpsc::channel();
    shared
        .spawner
        .send(SpawnJob::Direct {
            bwrap,
            cgroup_procs,
            reply: tx,
        })
        .map_err(|_| io::Error::other("the spawner thread is gone"))?;
    rx.recv()
        .map_err(|_| io::Error::other("the spawner thread is gone"))?
}

/// Starts the watcher of `pid`, which the pool or an allocation names.
pub(crate) fn watch(shared: &Arc<Shared>, pid: u32) {
    let shared = Arc::clone(shared);
    let spawned = std::thread::Builder::new()
        .name(format!("watch-{pid}"))
        .spawn(move || watcher(&shared, pid));
    if let Err(e) = spawned {
        // Without a watcher nobody would reap it or free its cores.
        tracing::error!(pid, error = %e, "cannot start a worker's watcher thread; killing the worker");
        process::signal(pid, libc::SIGKILL);
    }
}

/// Starts the watcher of adopted worker `pid` (not the daemon's child:
/// `pidfd` says when it ended; init reaps it).
pub(crate) fn watch_adopted(shared: &Arc<Shared>, pid: u32, pidfd: std::os::fd::OwnedFd) {
    let shared = Arc::clone(shared);
    let pidfd = Arc::new(pidfd);
    // Signals reach it through the pidfd until its end is handled: its pid
    // is not held for this daemon, the kernel may hand it on.
    process::track(pid, Arc::clone(&pidfd));
    let spawned = std::thread::Builder::new()
        .name(format!("watch-{pid}"))
        .spawn(move || {
            super::process::wait_pidfd(&pidfd);
            // How it ended is its parent's to hear; a stopped worker was
            // killed, any other ended by itself.
            let stopped = shared
                .lock()
                .allocations
                .values()
                .any(|a| a.pid == Some(pid) && a.stop.is_some());
            let ended = if stopped {
                Ended::Signaled(libc::SIGKILL)
            } else {
                Ended::Exited(0)
            };
            after_end(&shared, pid, ended);
            process::untrack(pid);
        });
    if let Err(e) = spawned {
        tracing::error!(pid, error = %e, "cannot start an adopted worker's watcher thread; killing the worker");
        process::signal(pid, libc::SIGKILL);
        process::untrack(pid);
    }
}

fn watcher(shared: &Arc<Shared>, pid: u32) {
    let ended = match process::wait_exit(pid) {
        // bwrap exits with 128 + the signal that ended the worker.
        Ok(Ended::Exited(code))
            if shared.settings.sandbox == Sandbox::Bubblewrap && (129..=192).contains(&code) =>
        {
            Ended::Signaled(code - 128)
        }
        Ok(e) => e,
        Err(e) => {
            tracing::error!(pid, error = %e, "cannot wait for a worker");
            return;
        }
    };
    after_end(shared, pid, ended);
}

/// What follows a worker's end: its allocation's group goes, its figures
/// close, its client hears why, its CPUs are free again.
fn after_end(shared: &Arc<Shared>, pid: u32, ended: Ended) {
    let ended_at = shared.usage.now();
    // What the worker started may outlive it (forked, detached, ignoring
    // signals): the allocation's whole group goes before its CPU time is
    // read and its CPUs are given back.
    let allocation = shared
        .lock()
        .allocations
        .values()
        .find(|a| a.pid == Some(pid))
        .map(|a| a.id);
    if let Some(id) = allocation {
        shared.limiter.kill(id, GROUP_KILL_WAIT);
    }
    let mut report = None;
    let mut refill = false;
    {
        let mut st = shared.lock();
        // Under the lock, as the pool or an allocation still names it:
        // nobody signals the pid between here and its removal below.
        let cpu_ns = process::reap(pid);
        if let Some(i) = st.pool.iter().position(|w| w.pid == pid) {
            st.pool.remove(i);
            if !st.draining && !st.stopping {
                tracing::warn!(pid, ?ended, "an idle pooled worker ended");
            }
            refill = true;
        } else if let Some(id) = st
            .allocations
            .values()
            .find(|a| a.pid == Some(pid))
            .map(|a| a.id)
        {
            // A function that crashed its worker, killed meanwhile (its
            // client let go at once): the crash is the cause.
            let ended = match (ended, shared.usage.crashed(id)) {
                (Ended::Signaled(libc::SIGKILL), Some(signal)) => Ended::Signaled(signal),
                (ended, _) => ended,
            };
            // Before its cgroup goes with the allocation.
            shared.usage.close(id, ended_at, cpu_ns);
            let a = st.allocations.get_mut(&id).expect("found above");
            if shared.settings.workers_outlive() {
                carry_ended(shared, a.lease_id);
            }
            if a.ready {
                let oom = shared.limiter.oom_killed(id);
                let a = shared.remove_allocation(&mut st, id).expect("found above");
                let oom = oom.then_some(a.memory_mib);
                let (cause, message) = describe(pid, ended, a.stop, a.expires_at, oom, unix_now());
                tracing::info!(allocation = id, pid, ?cause, %message, "worker ended");
                if !matches!(a.stop, Some(Stop::Deallocate | Stop::Failed)) {
                    let msg = WorkerExited {
                        allocation_id: id,
                        cause,
                        signal: match ended {
                            Ended::Signaled(s) => Some(s),
                            Ended::Exited(_) => None,
                        },
                        exit_code: match ended {
                            Ended::Exited(c) => Some(c),
                            Ended::Signaled(_) => None,
                        },
                        message,
                    };
                    st.reports_pending += 1;
                    report = Some((a.conn_id, msg));
                }
            } else {
                // Still starting: the allocating thread owns the cleanup.
                a.pid = None;
                a.ended = Some(ended);
            }
        }
        shared.changed.notify_all();
    }
    if let Some((conn, msg)) = report {
        shared.send(conn, &Frame::new(&msg, Vec::new()));
        shared.lock().reports_pending -= 1;
        shared.changed.notify_all();
    }
    if refill {
        shared.refill();
    }
}

/// Why a worker ended, as the client hears it. `oom` is the allocation's
/// memory (MiB) when the kernel's OOM killer ended a process of its group;
/// `now` is the Unix time it ended.
pub(crate) fn describe(
    pid: u32,
    ended: Ended,
    stop: Option<Stop>,
    expires_at: u64,
    oom: Option<u32>,
    now: u64,
) -> (ExitCause, String) {
    let expired = expires_at != 0 && expires_at <= now;
    match (stop, ended, oom) {
        (Some(Stop::LeaseExpired), ..) => (
            ExitCause::LeaseExpired,
            format!("worker {pid} stopped: the lease expired at {expires_at} (Unix seconds)"),
        ),
        (Some(Stop::LeaseEnded), ..) => (
            ExitCause::LeaseExpired,
            format!("worker {pid} stopped: the manager ended its lease (released or revoked); request a new lease"),
        ),
        (Some(Stop::Drained), ..) => (
            ExitCause::Drained,
            format!("worker {pid} stopped: its node is being retrieved (drained); allocate on another executor"),
        ),
        (Some(Stop::Shutdown), ..) => (
            ExitCause::Stopped,
            format!("worker {pid} stopped: the executor is shutting down; allocate again, on another executor if it does not come back"),
        ),
        // Only logged: the client asked for it and hears `Deallocated`. A
        // worker that was ending by itself when the client let go (it
        // crashed, or overran its deadline: the client heard that first)
        // or that outlived its lease is logged as that, further down.
        (Some(Stop::Deallocate), Ended::Exited(code), _) if code != 3 => (
            ExitCause::Stopped,
            format!("worker {pid} stopped: its client deallocated or went away"),
        ),
        (Some(Stop::Deallocate), Ended::Signaled(libc::SIGKILL), _) if !expired => (
            ExitCause::Stopped,
            format!("worker {pid} stopped: its client deallocated or went away"),
        ),
        (Some(Stop::Deallocate), Ended::Signaled(libc::SIGKILL), _) => (
            ExitCause::LeaseExpired,
            format!("worker {pid} stopped: its client deallocated it after its lease expired at {expires_at} (Unix seconds)"),
        ),
        (_, Ended::Signaled(sig), Some(mib)) => (
            ExitCause::OutOfMemory,
            format!(
                "worker {pid} killed by {}: the allocation used more than its {mib} MiB",
                process::signal_name(sig)
            ),
        ),
        (_, Ended::Signaled(sig), None) => (
            ExitCause::Crashed,
            format!("worker {pid} killed by {}", process::signal_name(sig)),
        ),
        (_, Ended::Exited(3), _) => (
            ExitCause::DeadlineExceeded,
            format!("worker {pid} ended itself: a function ran past its deadline"),
        ),
        (_, Ended::Exited(code), _) => (
            ExitCause::Exited,
            format!("worker {pid} exited with code {code}"),
        ),
    }
}

/// Kills the workers of leases that ended, every quarter second.
pub(crate) fn lease_ticker(shared: Arc<Shared>) {
    loop {
        std::thread::sleep(Duration::from_millis(250));
        end_unattached(&shared, std::time::Instant::now());
        let now = unix_now();
        let mut st = shared.lock();
        if st.stopping {
            return;
        }
        for a in st.allocations.values_mut() {
            if a.ready && a.stop.is_none() && a.expires_at <= now {
                if let Some(pid) = a.pid {
                    tracing::info!(
                        allocation = a.id,
                        lease = a.lease_id,
                        pid,
                        "lease expired; killing its worker"
                    );
                    a.stop = Some(Stop::LeaseExpired);
                    process::signal(pid, libc::SIGKILL);
                }
            }
        }
    }
}

/// Keeps what lease `lease_id`'s ended allocations used for a daemon that
/// adopts its running ones; a lease with none running has nothing to
/// adopt (its carry, if any, goes once its figures are posted).
pub(crate) fn carry_ended(shared: &Shared, lease_id: u64) {
    let Some((cpu_ns, usage, ended, running)) = shared.usage.carried(lease_id) else {
        return;
    };
    if running == 0 {
        return;
    }
    super::records::update_lease(
        &super::records::state_dir(&shared.settings.runtime_dir),
        lease_id,
        |c| {
            c.closed_cpu_ns = cpu_ns;
            c.closed = usage;
            c.allocations = ended;
        },
    );
}

/// Ends adopted allocations whose client did not attach in time, as a
/// closed connection ends them. Called by the lease ticker.
pub(crate) fn end_unattached(shared: &Shared, now: std::time::Instant) {
    let ids: Vec<u64> = shared
        .lock()
        .allocations
        .values()
        .filter(|a| a.stop.is_none() && a.attach_by.is_some_and(|t| t <= now))
        .map(|a| a.id)
        .collect();
    if ids.is_empty() {
        return;
    }
    tracing::info!(allocations = ?ids, "no client attached to these adopted allocations in time; deallocating");
    shared.end_allocations(&ids, super::state::Stop::Deallocate, Duration::ZERO);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn causes() {
        let c = |stop, ended| describe(9, ended, stop, 100, None, 50).0;
        assert_eq!(c(None, Ended::Signaled(11)), ExitCause::Crashed);
        assert_eq!(
            c(Some(Stop::Deallocate), Ended::Signaled(libc::SIGKILL)),
            ExitCause::Stopped
        );
        assert_eq!(c(None, Ended::Exited(3)), ExitCause::DeadlineExceeded);
        assert_eq!(c(None, Ended::Exited(1)), ExitCause::Exited);
        assert_eq!(
            c(Some(Stop::LeaseExpired), Ended::Signaled(9)),
            ExitCause::LeaseExpired
        );
        assert_eq!(
            c(Some(Stop::Drained), Ended::Signaled(9)),
            ExitCause::Drained
        );
        assert_eq!(
            c(Some(Stop::Shutdown), Ended::Signaled(9)),
            ExitCause::Stopped
        );
        assert_eq!(
            describe(9, Ended::Signaled(11), None, 0, None, 50).1,
            "worker 9 killed by SIGSEGV"
        );
        let oom = describe(9, Ended::Signaled(libc::SIGKILL), None, 0, Some(256), 50);
        assert_eq!(oom.0, ExitCause::OutOfMemory);
        assert_eq!(
            oom.1,
            "worker 9 killed by SIGKILL: the allocation used more than its 256 MiB"
        );
        // A deallocation's kill is a deallocation, whatever the group saw.
        assert_eq!(
            describe(
                9,
                Ended::Signaled(9),
                Some(Stop::Deallocate),
                0,
                Some(256),
                50
            )
            .0,
            ExitCause::Stopped
        );
        // A worker that was ending by itself when its client let go is
        // logged as what ended it, not as the deallocation.
        let dealloc =
            |ended, expires_at| describe(9, ended, Some(Stop::Deallocate), expires_at, None, 50).0;
        assert_eq!(dealloc(Ended::Exited(0), 100), ExitCause::Stopped);
        assert_eq!(
            dealloc(Ended::Signaled(libc::SIGSEGV), 100),
            ExitCause::Crashed
        );
        assert_eq!(dealloc(Ended::Exited(3), 100), ExitCause::DeadlineExceeded);
        assert_eq!(
            dealloc(Ended::Signaled(libc::SIGKILL), 50),
            ExitCause::LeaseExpired
        );
        assert_eq!(
            dealloc(Ended::Signaled(libc::SIGKILL), 51),
            ExitCause::Stopped
        );
    }
}

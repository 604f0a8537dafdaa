//! The control connection to one executor: requests matched to replies by
//! `request_id`, and the fate of every allocation made on it.
//!
//! One reader thread per connection reads every frame. Replies go to the
//! waiting request through a channel; `WorkerExited` goes to the
//! allocation's [`Fate`]; the connection's end (EOF or an error) marks every
//! allocation on it as executor-lost and wakes every waiter.

use std::collections::HashMap;
use std::io::BufReader;
use std::net::{Shutdown, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError, SyncSender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use rfaas_proto::control::client::{
    AllocateOk, Deallocate, Deallocated, LeaseRenewed, WorkerExited,
};
use rfaas_proto::control::{ErrorReply, Frame, FrameLimits, Kind};
use rfaas_proto::InvocationStatus;

use crate::error::{Error, Result};

/// Locks `m`, ignoring poisoning: every state behind these mutexes stays
/// consistent between statements.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// What happened to an allocation's worker, as the control connection
/// tells it.
#[derive(Debug, Clone)]
pub(crate) enum FateState {
    /// Running, as far as the executor said.
    Running,
    /// A lane's worker answered that a function crashed: the worker is
    /// ending, and the executor's report is still to come.
    Crashed {
        /// The signal, when the answer carried it.
        signal: Option<i32>,
    },
    /// A lane's worker answered a status after which it serves nothing
    /// more ([`InvocationStatus::ends_worker`]: the deadline, the lease's
    /// end, a drain). It may still finish calls under way on other lanes
    /// (a drain lets them run for its grace period).
    Refusing(InvocationStatus),
    /// The executor reported the worker's end.
    Exited(WorkerExited),
    /// The control connection ended.
    ExecutorLost,
    /// The client deallocated it.
    Deallocated,
}

/// An allocation's fate, shared by the connection's reader thread (which
/// writes it) and the allocation's lanes (which read it when a lane fails).
#[derive(Debug)]
pub(crate) struct Fate {
    executor: String,
    /// Fast checks for the hot path: [`RUNNING`], [`ENDED`] or [`GONE`].
    level: AtomicU8,
    state: Mutex<FateState>,
    cond: Condvar,
}

/// [`Fate::level`]: the worker takes calls.
const RUNNING: u8 = 0;
/// The worker takes no more calls, but may finish those under way.
const ENDED: u8 = 1;
/// The worker is gone (or about to be): nothing more comes from it.
const GONE: u8 = 2;

impl Fate {
    pub(crate) fn new(executor: String) -> Fate {
        Fate {
            executor,
            level: AtomicU8::new(RUNNING),
            state: Mutex::new(FateState::Running),
            cond: Condvar::new(),
        }
    }

    /// Whether the allocation takes no more calls. Hot path: one atomic
    /// load.
    #[inline]
    pub(crate) fn ended(&self) -> bool {
        self.level.load(Ordering::Acquire) != RUNNING
    }

    /// Whether the worker is known to be gone, so a call still waiting on
    /// it will get no answer.
    #[inline]
    pub(crate) fn gone(&self) -> bool {
        self.level.load(Ordering::Acquire) == GONE
    }

    /// Records the end, unless an earlier one is recorded (the first cause
    /// is the one every call hears); news that the worker is gone is
    /// recorded either way.
    pub(crate) fn set(&self, state: FateState) {
        let mut st = lock(&self.state);
        // The executor's report of a crash says more than the worker's.
        let replaces = matches!(
            (&*st, &state),
            (FateState::Running, _) | (FateState::Crashed { .. }, FateState::Exited(_))
        );
        let level = match state {
            FateState::Running => RUNNING,
            FateState::Refusing(_) => ENDED,
            _ => GONE,
        };
        if replaces {
            *st = state;
        }
        self.level.fetch_max(level, Ordering::AcqRel);
        drop(st);
        self.cond.notify_all();
    }

    /// Whether the executor needs no word of the allocation's end: it
    /// reported the worker's exit itself, the connection is gone, or the
    /// client deallocated already. A worker that only answered a crash in
    /// band, or refuses calls, is still the executor's until told or
    /// reaped.
    pub(crate) fn settled(&self) -> bool {
        matches!(
            *lock(&self.state),
            FateState::Exited(_) | FateState::ExecutorLost | FateState::Deallocated
        )
    }

    /// The error for an invocation whose lane failed: waits up to `grace`
    /// for the executor to say why.
    pub(crate) fn error(&self, grace: Duration) -> Error {
        let until = Instant::now() + grace;
        let mut st = lock(&self.state);
        while matches!(*st, FateState::Running) {
            let now = Instant::now();
            if now >= until {
                break;
            }
            st = self
                .cond
                .wait_timeout(st, until - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        match &*st {
            FateState::Crashed { signal } => Error::crashed_in_band(*signal),
            FateState::Refusing(status) => Error::FunctionFailed(*status),
            FateState::Exited(exit) => Error::from_exit(exit, &self.executor),
            FateState::ExecutorLost => Error::ExecutorLost {
                executor: self.executor.clone(),
            },
            FateState::Running | FateState::Deallocated => Error::WorkerLost,
        }
    }
}

/// A reply to a request.
#[derive(Debug)]
pub(crate) enum Reply {
    Allocated(Box<AllocateOk>, Arc<Fate>),
    Refused(ErrorReply),
    Deallocated,
    /// The allocation's lease now ends at this time (Unix seconds).
    Renewed(u64),
}

#[derive(Debug, Default)]
struct ConnState {
    waiters: HashMap<u64, SyncSender<Reply>>,
    allocations: HashMap<u64, Arc<Fate>>,
    lost: Option<String>,
}

/// What the connection's handle and its reader thread share.
#[derive(Debug)]
struct ConnShared {
    executor: String,
    writer: Mutex<TcpStream>,
    state: Mutex<ConnState>,
    next_request: AtomicU64,
}

/// One control connection. Dropping the last handle closes it, which ends
/// every allocation still open on it at the executor.
#[derive(Debug)]
pub(crate) struct ControlConn {
    shared: Arc<ConnShared>,
}

impl ControlConn {
    /// Connects to `executor` (`host:port`) and starts the reader thread.
    pub(crate) fn connect(executor: &str, timeout: Duration) -> Result<ControlConn> {
        let connect_err = |source| Error::Connect {
            executor: executor.to_owned(),
            source,
        };
        let addrs: Vec<_> = executor.to_socket_addrs().map_err(connect_err)?.collect();
        let mut last = None;
        let mut stream = None;
        for addr in addrs {
            match TcpStream::connect_timeout(&addr, timeout) {
                Ok(s) => {
                    stream = Some(s);
                    break;
                }
                Err(e) => last = Some(e),
            }
        }
        let stream = stream.ok_or_else(|| {
            connect_err(last.unwrap_or_else(|| {
                std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    "the address resolves to nothing",
                )
            }))
        })?;
        stream.set_nodelay(true).map_err(connect_err)?;
        let reader = stream.try_clone().map_err(connect_err)?;
        let shared = Arc::new(ConnShared {
            executor: executor.to_owned(),
            writer: Mutex::new(stream),
            state: Mutex::new(ConnState::default()),
            next_request: AtomicU64::new(1),
        });
        let for_reader = Arc::clone(&shared);
        std::thread::Builder::new()
            .name("rfaas-control".into())
            .spawn(move || read_loop(reader, &for_reader))
            .map_err(connect_err)?;
        Ok(ControlConn { shared })
    }

    /// The executor's address.
    pub(crate) fn executor(&self) -> &str {
        &self.shared.executor
    }

    /// Whether the connection has ended.
    pub(crate) fn is_lost(&self) -> bool {
        lock(&self.shared.state).lost.is_some()
    }

    /// A fresh request id.
    pub(crate) fn next_request_id(&self) -> u64 {
        self.shared.next_request.fetch_add(1, Ordering::Relaxed)
    }

    /// Sends `frame` (whose message carries `request_id`) and waits up to
    /// `timeout` for its reply.
    pub(crate) fn request(
        &self,
        frame: &Frame,
        request_id: u64,
        timeout: Duration,
    ) -> Result<Reply> {
        let lost = || Error::ExecutorLost {
            executor: self.shared.executor.clone(),
        };
        let (tx, rx) = mpsc::sync_channel(1);
        {
            let mut st = lock(&self.shared.state);
            if st.lost.is_some() {
                return Err(lost());
            }
            st.waiters.insert(request_id, tx);
        }
        let sent = frame.write_to(&mut *lock(&self.shared.writer));
        if let Err(e) = sent {
            lock(&self.shared.state).waiters.remove(&request_id);
            tracing::debug!(executor = %self.shared.executor, error = %e, "control write failed");
            return Err(lost());
        }
        match rx.recv_timeout(timeout) {
            Ok(reply) => Ok(reply),
            Err(RecvTimeoutError::Timeout) => {
                lock(&self.shared.state).waiters.remove(&request_id);
                Err(Error::Timeout {
                    what: "the executor's reply",
                    after: timeout,
                })
            }
            Err(RecvTimeoutError::Disconnected) => Err(lost()),
        }
    }

    /// Sends a `Deallocate` without waiting for its reply; best effort.
    pub(crate) fn deallocate_nowait(&self, allocation_id: u64) {
        self.forget(allocation_id);
        let msg = Deallocate {
            request_id: self.next_request_id(),
            allocation_id,
        };
        send_deallocate(&self.shared, &msg);
    }

    /// Stops tracking an allocation's fate.
    pub(crate) fn forget(&self, allocation_id: u64) {
        lock(&self.shared.state).allocations.remove(&allocation_id);
    }
}

impl Drop for ControlConn {
    fn drop(&mut self) {
        // Wakes the reader with EOF; it ends and drops the shared state.
        let _ = lock(&self.shared.writer).shutdown(Shutdown::Both);
    }
}

fn send_deallocate(shared: &ConnShared, msg: &Deallocate) {
    let frame = Frame::new(msg, Vec::new());
    if let Err(e) = frame.write_to(&mut *lock(&shared.writer)) {
        tracing::debug!(executor = %shared.executor, error = %e, "cannot send Deallocate");
    }
}

fn read_loop(stream: TcpStream, shared: &ConnShared) {
    let mut reader = BufReader::new(stream);
    let reason = loop {
        match Frame::read_from(&mut reader, FrameLimits::default()) {
            Ok(frame) => {
                if let Err(e) = dispatch(shared, &frame) {
                    break e.to_string();
                }
            }
            Err(e) => break e.to_string(),
        }
    };
    tracing::debug!(executor = %shared.executor, %reason, "control connection ended");
    let mut st = lock(&shared.state);
    st.lost = Some(reason);
    // Dropping the senders wakes every waiting request.
    st.waiters.clear();
    let fates: Vec<_> = st.allocations.drain().map(|(_, f)| f).collect();
    drop(st);
    for fate in fates {
        fate.set(FateState::ExecutorLost);
    }
}

/// Routes one frame from the executor.
fn dispatch(shared: &ConnShared, frame: &Frame) -> Result<()> {
    match frame.kind {
        Kind::AllocateOk => {
            let ok: AllocateOk = frame.parse()?;
            let fate = Arc::new(Fate::new(shared.executor.clone()));
            let mut st = lock(&shared.state);
            match st.waiters.remove(&ok.request_id) {
                Some(tx) => {
                    st.allocations.insert(ok.allocation_id, Arc::clone(&fate));
                    drop(st);
                    let _ = tx.send(Reply::Allocated(Box::new(ok), fate));
                }
                None => {
                    // The request timed out: nobody will use this worker.
                    drop(st);
                    tracing::warn!(
                        allocation = ok.allocation_id,
                        "an allocation arrived after its request timed out; deallocating it"
                    );
                    let msg = Deallocate {
                        request_id: shared.next_request.fetch_add(1, Ordering::Relaxed),
                        allocation_id: ok.allocation_id,
                    };
                    send_deallocate(shared, &msg);
                }
            }
        }
        Kind::Error => {
            let e: ErrorReply = frame.parse()?;
            let tx = lock(&shared.state).waiters.remove(&e.request_id);
            match tx {
                Some(tx) => {
                    let _ = tx.send(Reply::Refused(e));
                }
                None => {
                    tracing::debug!(request_id = e.request_id, code = ?e.code, message = %e.message, "an error reply nobody waits for")
                }
            }
        }
        Kind::Deallocated => {
            let d: Deallocated = frame.parse()?;
            let mut st = lock(&shared.state);
            let fate = st.allocations.remove(&d.allocation_id);
            let tx = st.waiters.remove(&d.request_id);
            drop(st);
            if let Some(fate) = fate {
                fate.set(FateState::Deallocated);
            }
            if let Some(tx) = tx {
                let _ = tx.send(Reply::Deallocated);
            }
        }
        Kind::LeaseRenewed => {
            let r: LeaseRenewed = frame.parse()?;
            let tx = lock(&shared.state).waiters.remove(&r.request_id);
            if let Some(tx) = tx {
                let _ = tx.send(Reply::Renewed(r.expires_at));
            }
        }
        Kind::WorkerExited => {
            let w: WorkerExited = frame.parse()?;
            tracing::debug!(allocation = w.allocation_id, cause = ?w.cause, signal = ?w.signal, message = %w.message, "worker exited");
            let fate = lock(&shared.state).allocations.remove(&w.allocation_id);
            if let Some(fate) = fate {
                fate.set(FateState::Exited(w));
            }
        }
        other => {
            return Err(Error::Protocol(format!(
                "the executor sent a {other:?} message on a client connection"
            )))
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use rfaas_proto::control::client::ExitCause;

    #[test]
    fn the_executors_report_of_a_crash_replaces_the_workers() {
        let f = Fate::new("127.0.0.1:9".into());
        f.set(FateState::Crashed { signal: None });
        assert!(f.ended());
        assert!(matches!(
            f.error(Duration::ZERO),
            Error::WorkerCrashed {
                signal: None,
                cause: ExitCause::Crashed,
                ..
            }
        ));
        // Losing the executor afterwards changes nothing...
        f.set(FateState::ExecutorLost);
        assert!(matches!(
            f.error(Duration::ZERO),
            Error::WorkerCrashed { .. }
        ));
        // ...its report of the exit fills in the signal.
        f.set(FateState::Exited(WorkerExited {
            allocation_id: 1,
            cause: ExitCause::Crashed,
            signal: Some(6),
            exit_code: None,
            message: "worker 3 killed by SIGABRT".into(),
        }));
        assert!(matches!(
            f.error(Duration::ZERO),
            Error::WorkerCrashed {
                signal: Some(6),
                ..
            }
        ));
    }

    #[test]
    fn a_worker_that_refuses_calls_may_still_finish_those_under_way() {
        let f = Fate::new("127.0.0.1:9".into());
        f.set(FateState::Refusing(InvocationStatus::ExecutorDraining));
        assert!(f.ended(), "no more calls");
        assert!(!f.gone(), "a drain lets calls under way finish");
        // The worker's end, later, is news that it is gone; the cause every
        // call hears stays the first.
        f.set(FateState::Exited(WorkerExited {
            allocation_id: 1,
            cause: ExitCause::Drained,
            signal: Some(9),
            exit_code: None,
            message: "worker 3 stopped: its node is being retrieved".into(),
        }));
        assert!(f.gone());
        assert!(matches!(
            f.error(Duration::ZERO),
            Error::FunctionFailed(InvocationStatus::ExecutorDraining)
        ));
        let f = Fate::new("127.0.0.1:9".into());
        f.set(FateState::Crashed { signal: Some(11) });
        assert!(f.gone(), "a crashed worker is dying");
    }

    #[test]
    fn fate_errors() {
        let f = Fate::new("127.0.0.1:9".into());
        assert!(!f.ended());
        assert!(matches!(
            f.error(Duration::from_millis(10)),
            Error::WorkerLost
        ));
        f.set(FateState::Exited(WorkerExited {
            allocation_id: 1,
            cause: ExitCause::Crashed,
            signal: Some(9),
            exit_code: None,
            message: "worker 3 killed by SIGKILL".into(),
        }));
        assert!(f.ended());
        // The first end is kept.
        f.set(FateState::ExecutorLost);
        assert!(matches!(
            f.error(Duration::ZERO),
            Error::WorkerCrashed {
                signal: Some(9),
                ..
            }
        ));

        let f = Arc::new(Fate::new("127.0.0.1:9".into()));
        let g = Arc::clone(&f);
        let waiter = rfaas_testkit::wait::thread_id();
        // The news comes once this thread waits for it.
        let t = std::thread::spawn(move || {
            rfaas_testkit::wait::wait_until_asleep(std::process::id(), waiter);
            g.set(FateState::ExecutorLost);
        });
        // Waits for the late news instead of answering WorkerLost.
        let e = f.error(Duration::from_secs(10));
        assert!(
            matches!(e, Error::ExecutorLost { ref executor } if executor == "127.0.0.1:9"),
            "{e:?}"
        );
        t.join().unwrap();
    }
}

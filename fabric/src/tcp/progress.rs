//! The progress thread: serves passive targets.
//!
//! One thread per process watches every tcp endpoint with one-shot epoll
//! registrations. When a socket has work and the endpoint's completion
//! queue is neither polled (its poll counter moved since the last look) nor
//! waited on, the thread drives the endpoint itself: it places writes,
//! answers reads and atomics, and acknowledges. When the queue is busy the
//! registration stays disarmed, so a hot poller never shares its socket
//! with this thread. A tick re-checks disarmed endpoints: every
//! [`MIN_TICK`] after activity, doubling up to [`MAX_TICK`] while the
//! application keeps polling (each tick preempts a busy core, so a hot
//! poller should see few of them). A target that stops polling without
//! calling `wait` is served again within about two [`MAX_TICK`]s, and an
//! acknowledgement its last poll left owed goes out as soon.

use std::collections::HashMap;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use super::endpoint::EpShared;
use super::wake;
use crate::os;

/// Shortest interval between re-checks of disarmed endpoints.
const MIN_TICK: Duration = Duration::from_millis(1);
/// Longest interval between re-checks of disarmed endpoints.
const MAX_TICK: Duration = Duration::from_millis(16);
const WAKE_TOKEN: u64 = 0;

struct Thread {
    epfd: OwnedFd,
    /// The doorbell ([`wake`]), which lives as long as the process.
    wake: RawFd,
    /// New endpoints, to be watched (connection set-up only).
    added: Mutex<Vec<Arc<EpShared>>>,
}

static THREAD: OnceLock<Option<Arc<Thread>>> = OnceLock::new();

fn thread() -> Option<&'static Arc<Thread>> {
    THREAD
        .get_or_init(|| match start() {
            Ok(t) => Some(t),
            Err(e) => {
                tracing::error!(error = %e, "cannot start the tcp progress thread; passive targets are served only while polled");
                None
            }
        })
        .as_ref()
}

fn start() -> crate::Result<Arc<Thread>> {
    let epfd = os::epoll_create()?;
    let wake = wake::set(os::eventfd()?);
    os::epoll_ctl(
        epfd.as_raw_fd(),
        libc::EPOLL_CTL_ADD,
        wake,
        libc::EPOLLIN as u32,
        WAKE_TOKEN,
    )?;
    let t = Arc::new(Thread {
        epfd,
        wake,
        added: Mutex::new(Vec::new()),
    });
    let run = t.clone();
    std::thread::Builder::new()
        .name("rfaas-tcp-progress".into())
        .spawn(move || run.run())
        .map_err(|e| crate::Error::io("spawning the tcp progress thread", e))?;
    Ok(t)
}

/// Hands a new endpoint to the progress thread.
pub(super) fn register(ep: Arc<EpShared>) {
    if let Some(t) = thread() {
        t.added.lock().unwrap_or_else(|p| p.into_inner()).push(ep);
        wake::ring();
    }
}

struct Entry {
    ep: Arc<EpShared>,
    armed: bool,
    last_polls: u64,
}

impl Entry {
    /// Whether the application drives this endpoint itself right now.
    fn busy(&mut self) -> bool {
        let polls = self.ep.cq.polls.load(Ordering::Relaxed);
        let busy = polls != self.last_polls || self.ep.cq.waiting.load(Ordering::SeqCst);
        self.last_polls = polls;
        busy
    }
}

impl Thread {
    fn run(&self) {
        let mut entries: HashMap<u64, Entry> = HashMap::new();
        let mut events = [libc::epoll_event { events: 0, u64: 0 }; 64];
        let mut last_tick = Instant::now();
        let mut tick = MIN_TICK;
        loop {
            // Disarmed endpoints are re-checked every `tick`; armed ones
            // every MAX_TICK, for acknowledgements their owner left behind.
            let disarmed = entries.values().any(|e| !e.armed);
            let ms = match (disarmed, entries.is_empty()) {
                (true, _) => os::timeout_ms(Some(tick)),
                (false, false) => os::timeout_ms(Some(MAX_TICK)),
                (false, true) => -1,
            };
            let ready = match os::epoll_wait(self.epfd.as_raw_fd(), &mut events, ms) {
                Ok(n) => n,
                Err(e) => {
                    tracing::error!(error = %e, "tcp progress thread: epoll_wait failed");
                    std::thread::sleep(MAX_TICK);
                    0
                }
            };
            for event in &events[..ready] {
                if event.u64 == WAKE_TOKEN {
                    os::eventfd_drain(self.wake);
                    self.take_added(&mut entries);
                    self.take_kicks(&mut entries);
                    continue;
                }
                let id = event.u64;
                tick = MIN_TICK;
                let Some(entry) = entries.get_mut(&id) else {
                    continue;
                };
                entry.armed = false;
                if entry.ep.closed.load(Ordering::Relaxed) {
                    self.remove(&mut entries, id);
                    continue;
                }
                if !entry.busy() {
                    self.serve(&mut entries, id);
                }
            }
            let due = if disarmed { tick } else { MAX_TICK };
            if !entries.is_empty() && last_tick.elapsed() >= due {
                last_tick = Instant::now();
                tick = (tick * 2).min(MAX_TICK);
                let idle: Vec<u64> = entries
                    .iter_mut()
                    .filter(|(_, e)| !e.armed || e.ep.ack_owed.load(Ordering::Relaxed))
                    .filter_map(|(id, e)| {
                        (e.ep.closed.load(Ordering::Relaxed) || !e.busy()).then_some(*id)
                    })
                    .collect();
                for id in idle {
                    if entries[&id].ep.closed.load(Ordering::Relaxed) {
                        self.remove(&mut entries, id);
                    } else {
                        self.serve(&mut entries, id);
                    }
                }
            }
        }
    }

    fn take_added(&self, entries: &mut HashMap<u64, Entry>) {
        let added = std::mem::take(&mut *self.added.lock().unwrap_or_else(|p| p.into_inner()));
        for ep in added {
            let id = ep.id;
            let last_polls = ep.cq.polls.load(Ordering::Relaxed);
            entries.insert(
                id,
                Entry {
                    ep,
                    armed: false,
                    last_polls,
                },
            );
            self.arm(entries, id, libc::EPOLL_CTL_ADD);
        }
    }

    /// Watches the sockets of kicked endpoints for room as well. A disarmed
    /// endpoint is re-armed, watching for room, when it is next served.
    fn take_kicks(&self, entries: &mut HashMap<u64, Entry>) {
        let kicked: Vec<u64> = entries
            .iter()
            .filter(|(_, e)| e.ep.kicked.swap(false, Ordering::AcqRel) && e.armed)
            .map(|(id, _)| *id)
            .collect();
        for id in kicked {
            self.arm(entries, id, libc::EPOLL_CTL_MOD);
        }
    }

    /// Drives an endpoint nobody else drives, then re-arms it.
    fn serve(&self, entries: &mut HashMap<u64, Entry>, id: u64) {
        let Some(entry) = entries.get_mut(&id) else {
            return;
        };
        let Some(progress) = entry.ep.try_progress(true, true) else {
            // Another thread drives it: look again at the next tick.
            return;
        };
        if progress.completed {
            entry.ep.cq.notify();
        }
        if entry.ep.is_dead() {
            // Its outstanding operations are flushed; the owner's poll
            // finishes the job if the queue was full.
            self.remove(entries, id);
        } else if !progress.stalled {
            self.arm(entries, id, libc::EPOLL_CTL_MOD);
        }
    }

    fn arm(&self, entries: &mut HashMap<u64, Entry>, id: u64, op: i32) {
        let Some(entry) = entries.get_mut(&id) else {
            return;
        };
        let mut events = (libc::EPOLLIN | libc::EPOLLRDHUP | libc::EPOLLONESHOT) as u32;
        if entry.ep.tx_pending.load(Ordering::Acquire) {
            events |= libc::EPOLLOUT as u32;
        }
        match os::epoll_ctl(self.epfd.as_raw_fd(), op, entry.ep.fd(), events, id) {
            Ok(()) => entry.armed = true,
            Err(e) => {
                tracing::warn!(error = %e, "tcp progress thread cannot watch an endpoint");
            }
        }
    }

    fn remove(&self, entries: &mut HashMap<u64, Entry>, id: u64) {
        if let Some(entry) = entries.remove(&id) {
            let _ = os::epoll_ctl(
                self.epfd.as_raw_fd(),
                libc::EPOLL_CTL_DEL,
                entry.ep.fd(),
                0,
                0,
            );
        }
    }
}

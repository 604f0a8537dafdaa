//! The completion queue: local completions pushed at post time, plus the
//! inbound immediate rings of every attached endpoint, drained by `poll`.

use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{fence, AtomicU32, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_queue::ArrayQueue;

use super::link::Link;
use super::queue::CqShared;
use super::ring::{AWAKE, SLEEP_FUTEX, SLEEP_SOCKET};
use super::sys::{self, FutexWaitv, Waited, FUTEX_WAITV_MAX};
use crate::completion::{Completion, Opcode, Status};
use crate::error::{Error, Result};
use crate::os;
use crate::provider;

/// Epoll token of the queue's own eventfd; attached endpoint `i` uses `i + 1`.
const OWN_EVENT: u64 = 0;

/// An endpoint attached to the queue.
#[derive(Debug)]
struct Attached {
    link: Arc<Link>,
    /// Our copy of the inbound ring's head (we are its only writer).
    head: u64,
    /// Endpoint closed and its receives flushed: nothing more to do.
    done: bool,
    /// Our end of the wake-up socket the peer kicks when we sleep in
    /// `epoll_wait` (the fallback).
    wake: OwnedFd,
    /// Whether `wake` is still in our epoll set.
    watching: bool,
}

impl Attached {
    /// Moves this endpoint's receive completions into `out`. Hot path.
    #[inline]
    fn drain(&mut self, out: &mut [Completion]) -> usize {
        if self.done {
            return 0;
        }
        let link = &*self.link;
        let mut n = 0;
        if link.closed.load(Ordering::Acquire) {
            while n < out.len() {
                let Some(wr_id) = link.recvs.pop() else {
                    self.done = true;
                    break;
                };
                out[n] = Completion::error(wr_id, Opcode::RecvWithImm, Status::Flushed);
                n += 1;
            }
            return n;
        }
        // Read before the ring: notifications published before the loss
        // still pair with receives; whatever receives remain then fail.
        let lost = link.is_lost();
        match link.inbound.ready(self.head) {
            Some(mut ready) => {
                let start = self.head;
                while ready > 0 && n < out.len() {
                    let Some(wr_id) = link.recvs.pop() else { break };
                    let (imm, byte_len) = link.inbound.entry(self.head);
                    out[n] = Completion {
                        wr_id,
                        opcode: Opcode::RecvWithImm,
                        status: Status::Success,
                        imm,
                        byte_len,
                    };
                    n += 1;
                    self.head = self.head.wrapping_add(1);
                    ready -= 1;
                }
                if self.head != start {
                    link.inbound.release(self.head);
                }
            }
            // The peer wrote an impossible tail: treat it as gone.
            None => link.lost.store(true, Ordering::Release),
        }
        if lost {
            while n < out.len() {
                let Some(wr_id) = link.recvs.pop() else { break };
                out[n] = Completion::error(wr_id, Opcode::RecvWithImm, Status::PeerLost);
                n += 1;
            }
        }
        n
    }
}

/// A completion queue of the shm provider.
#[derive(Debug)]
pub(crate) struct ShmCq {
    shared: Arc<CqShared>,
    /// The eventfd and every attached endpoint's wake-up socket.
    epoll: OwnedFd,
    /// Attached endpoints by slot; a slot is freed only once its endpoint is
    /// closed and none of its completions is left in `shared.queue`.
    links: Vec<Option<Attached>>,
    /// Where the next poll starts, so no endpoint starves the others.
    cursor: usize,
    /// The words of the current `futex_waitv` (reused: no allocation per wait).
    waiters: Vec<FutexWaitv>,
    /// Sleep with `futex_waitv` when possible (tests clear it to force the
    /// epoll fallback).
    use_futex: bool,
    /// How many times `wait` slept on each path.
    sleeps: Sleeps,
}

/// How many times a queue slept in the kernel, by path.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Sleeps {
    pub futex: u64,
    pub epoll: u64,
    /// Sleeps (either path) that ended because the timeout passed.
    pub timeouts: u64,
}

impl ShmCq {
    pub(super) fn new(depth: usize) -> Result<ShmCq> {
        let event = os::eventfd()?;
        let epoll = os::epoll_create()?;
        os::epoll_add(
            epoll.as_raw_fd(),
            event.as_raw_fd(),
            libc::EPOLLIN as u32,
            OWN_EVENT,
        )?;
        Ok(ShmCq {
            shared: Arc::new(CqShared {
                queue: ArrayQueue::new(depth),
                reserved: AtomicUsize::new(0),
                depth,
                sleeping: AtomicU32::new(AWAKE),
                futex: AtomicU32::new(0),
                event,
            }),
            epoll,
            links: Vec::new(),
            cursor: 0,
            waiters: Vec::with_capacity(FUTEX_WAITV_MAX),
            use_futex: true,
            sleeps: Sleeps::default(),
        })
    }

    /// Makes `wait` sleep on the epoll fallback, as without `futex_waitv`.
    #[cfg(test)]
    pub(super) fn force_epoll(&mut self) {
        self.use_futex = false;
    }

    /// How many times `wait` slept, by path.
    #[cfg(test)]
    pub(super) fn sleeps(&self) -> Sleeps {
        self.sleeps
    }

    pub(super) fn shared(&self) -> &Arc<CqShared> {
        &self.shared
    }

    /// Attaches a new endpoint's link; `wake` is our end of the socket its
    /// peer kicks. Returns the endpoint's slot.
    pub(super) fn attach(&mut self, link: Arc<Link>, wake: OwnedFd) -> Result<u32> {
        self.reap();
        let slot = match self.links.iter().position(Option::is_none) {
            Some(free) => free,
            None => {
                self.links.push(None);
                self.links.len() - 1
            }
        };
        os::epoll_add(
            self.epoll.as_raw_fd(),
            wake.as_raw_fd(),
            libc::EPOLLIN as u32,
            slot as u64 + 1,
        )?;
        self.links[slot] = Some(Attached {
            link,
            head: 0,
            done: false,
            wake,
            watching: true,
        });
        Ok(slot as u32)
    }

    /// Frees the slots of closed endpoints with no completion left in the queue.
    fn reap(&mut self) {
        for entry in &mut self.links {
            let finished = entry
                .as_ref()
                .is_some_and(|a| a.done && a.link.outstanding.load(Ordering::Acquire) == 0);
            if finished {
                if let Some(a) = entry.take() {
                    if a.watching {
                        os::epoll_del(self.epoll.as_raw_fd(), a.wake.as_raw_fd());
                    }
                }
            }
        }
        while matches!(self.links.last(), Some(None)) {
            self.links.pop();
        }
    }

    /// How many words a `futex_waitv` would watch: ours and every live ring's.
    fn sleepers(&self) -> usize {
        1 + self.links.iter().flatten().filter(|a| !a.done).count()
    }

    /// Announces that we sleep, and how, in our flag and every live ring;
    /// for [`SLEEP_FUTEX`], fills `waiters` with each futex word and its
    /// value now (before the caller's fence and last poll).
    fn announce(&mut self, how: u32) {
        let shared = &*self.shared;
        shared.sleeping.store(how, Ordering::Relaxed);
        self.waiters.clear();
        let futex = how == SLEEP_FUTEX;
        if futex {
            // Acquire: if a waker's bump is already visible, so is what it
            // published, and the last poll finds it.
            let seen = shared.futex.load(Ordering::Acquire);
            self.waiters
                .push(FutexWaitv::new(&shared.futex, seen, true));
        }
        for a in self.links.iter().flatten() {
            if !a.done {
                let inbound = &a.link.inbound;
                inbound.set_sleeping(how);
                if futex {
                    let word = inbound.futex();
                    let seen = word.load(Ordering::Acquire);
                    self.waiters.push(FutexWaitv::new(word, seen, false));
                }
            }
        }
    }

    fn set_sleeping(&self, how: u32) {
        self.shared.sleeping.store(how, Ordering::Relaxed);
        for a in self.links.iter().flatten() {
            if !a.done {
                a.link.inbound.set_sleeping(how);
            }
        }
    }

    fn on_event(&mut self, token: u64) {
        if token == OWN_EVENT {
            os::eventfd_drain(self.shared.event.as_raw_fd());
            return;
        }
        let epoll = self.epoll.as_raw_fd();
        if let Some(Some(a)) = self.links.get_mut((token - 1) as usize) {
            if a.watching && !sys::drain_socket(a.wake.as_raw_fd()) {
                // The peer's end is closed: stop watching, or epoll would
                // report the hang-up forever. The control socket reports the loss.
                os::epoll_del(epoll, a.wake.as_raw_fd());
                a.watching = false;
            }
        }
    }
}

impl provider::CompletionQueue for ShmCq {
    /// Moves up to `out.len()` completions into `out`.
    ///
    /// Hot path: atomics only; no syscall, lock or allocation.
    #[inline]
    fn poll(&mut self, out: &mut [Completion]) -> usize {
        let mut n = 0;
        while n < out.len() {
            let Some((completion, slot)) = self.shared.queue.pop() else {
                break;
            };
            out[n] = completion;
            n += 1;
            self.shared.reserved.fetch_sub(1, Ordering::AcqRel);
            if let Some(Some(a)) = self.links.get(slot as usize) {
                a.link.outstanding.fetch_sub(1, Ordering::AcqRel);
            }
        }
        let count = self.links.len();
        if count == 0 {
            return n;
        }
        self.cursor = if self.cursor + 1 >= count {
            0
        } else {
            self.cursor + 1
        };
        for k in 0..count {
            if n == out.len() {
                break;
            }
            let i = if self.cursor + k >= count {
                self.cursor + k - count
            } else {
                self.cursor + k
            };
            if let Some(a) = &mut self.links[i] {
                n += a.drain(&mut out[n..]);
            }
        }
        n
    }

    /// Polls; if nothing is ready, sleeps in the kernel until something is or
    /// `timeout` passes (then `Ok(0)`). Warm path.
    ///
    /// Wake-up protocol: announce "sleeping" (our flag and every attached
    /// ring's), read the futex words, fence, poll once more, then sleep in
    /// `futex_waitv` on those words with the values read. A producer
    /// publishes, fences, and only if it sees the announcement bumps the
    /// word and wakes it, so a completion that lands between the last poll
    /// and the sleep still wakes us (the kernel sees the word changed).
    ///
    /// Without `futex_waitv` (Linux < 5.16, a seccomp filter), or with more
    /// endpoints than one call can watch, we announce the socket path and
    /// sleep in `epoll_wait` on the eventfd and the wake-up sockets instead
    /// (its timeout is rounded up to whole milliseconds).
    fn wait(&mut self, out: &mut [Completion], timeout: Duration) -> Result<usize> {
        if out.is_empty() {
            return Ok(0);
        }
        let deadline = Instant::now().checked_add(timeout);
        // The deadline on CLOCK_MONOTONIC (Instant's clock), for futex_waitv;
        // computed at the first sleep.
        let mut abs_deadline: Option<Option<libc::timespec>> = None;
        self.reap();
        let mut events = [libc::epoll_event { events: 0, u64: 0 }; 16];
        loop {
            let n = self.poll(out);
            if n > 0 {
                return Ok(n);
            }
            let futex =
                self.use_futex && sys::futex_waitv_usable() && self.sleepers() <= FUTEX_WAITV_MAX;
            self.announce(if futex { SLEEP_FUTEX } else { SLEEP_SOCKET });
            fence(Ordering::SeqCst);
            let n = self.poll(out);
            if n > 0 {
                self.set_sleeping(AWAKE);
                return Ok(n);
            }
            let remaining = match deadline {
                None => None,
                Some(deadline) => {
                    let now = Instant::now();
                    if now >= deadline {
                        self.set_sleeping(AWAKE);
                        return Ok(0);
                    }
                    Some(deadline - now)
                }
            };
            if futex {
                let abs =
                    *abs_deadline.get_or_insert_with(|| remaining.and_then(sys::monotonic_after));
                self.sleeps.futex += 1;
                let waited = sys::futex_waitv(&self.waiters, abs.as_ref());
                self.waiters.clear();
                self.set_sleeping(AWAKE);
                match waited.map_err(|e| Error::io("futex_waitv", e))? {
                    Waited::Woken => {}
                    Waited::TimedOut => {
                        self.sleeps.timeouts += 1;
                        return Ok(self.poll(out));
                    }
                    Waited::Unsupported => {
                        tracing::debug!(
                            "futex_waitv is unavailable; shm completion queues sleep in epoll_wait"
                        );
                    }
                }
            } else {
                let ms = remaining.map_or(-1, os::ceil_ms);
                self.sleeps.epoll += 1;
                let ready = os::epoll_wait(self.epoll.as_raw_fd(), &mut events, ms);
                self.set_sleeping(AWAKE);
                let ready = ready?;
                if ready == 0 {
                    self.sleeps.timeouts += 1;
                }
                for event in &events[..ready] {
                    let token = event.u64;
                    self.on_event(token);
                }
            }
        }
    }
}

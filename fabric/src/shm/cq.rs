//! The completion queue: local completions pushed at post time, plus the
//! inbound immediate rings of every attached endpoint, drained by `poll`.

use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{fence, AtomicU32, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_queue::ArrayQueue;

use super::link::Link;
use super::sys;
use crate::completion::{Completion, Opcode, Status};
use crate::error::Result;
use crate::os;

/// Epoll token of the queue's own eventfd; attached endpoint `i` uses `i + 1`.
const OWN_EVENT: u64 = 0;

/// The part of a completion queue its endpoints hold (possibly on other threads).
#[derive(Debug)]
pub(super) struct CqShared {
    /// Local completions with the CQ slot of the endpoint that posted them.
    queue: ArrayQueue<(Completion, u32)>,
    /// Completions pushed or about to be pushed; never above `depth`, so a
    /// reserved push cannot fail.
    reserved: AtomicUsize,
    depth: usize,
    /// The owner is (about to be) asleep in `wait`.
    sleeping: AtomicU32,
    /// Private eventfd the owner sleeps on (with the wake-up sockets).
    event: OwnedFd,
}

impl CqShared {
    /// Capacity in completions.
    pub(super) fn depth(&self) -> usize {
        self.depth
    }

    /// Claims room for one completion. Hot path.
    #[inline]
    pub(super) fn reserve(&self) -> bool {
        if self.reserved.fetch_add(1, Ordering::AcqRel) >= self.depth {
            self.reserved.fetch_sub(1, Ordering::AcqRel);
            return false;
        }
        true
    }

    /// Gives back a claim that will not be used. Hot path.
    #[inline]
    pub(super) fn unreserve(&self) {
        self.reserved.fetch_sub(1, Ordering::AcqRel);
    }

    /// Pushes a completion into reserved room and wakes a sleeping owner.
    /// Hot path: no syscall unless the owner sleeps.
    #[inline]
    pub(super) fn push(&self, completion: Completion, slot: u32) {
        let pushed = self.queue.push((completion, slot));
        debug_assert!(pushed.is_ok(), "a reserved completion slot was taken");
        self.wake_if_sleeping();
    }

    /// Wakes the owner if it announced it sleeps. Hot path: one fence and
    /// one load when it does not.
    #[inline]
    pub(super) fn wake_if_sleeping(&self) {
        // Pairs with the fence in `ShmCq::wait` between announcing sleep and
        // the last poll: either the owner sees our push or we see its flag.
        fence(Ordering::SeqCst);
        if self.sleeping.load(Ordering::Relaxed) != 0
            && self.sleeping.swap(0, Ordering::AcqRel) != 0
        {
            os::eventfd_signal(self.event.as_raw_fd());
        }
    }

    /// Wakes the owner unconditionally (peer loss, endpoint closed).
    pub(super) fn wake(&self) {
        os::eventfd_signal(self.event.as_raw_fd());
    }
}

/// An endpoint attached to the queue.
#[derive(Debug)]
struct Attached {
    link: Arc<Link>,
    /// Our copy of the inbound ring's head (we are its only writer).
    head: u64,
    /// Endpoint closed and its receives flushed: nothing more to do.
    done: bool,
    /// Our end of the wake-up socket the peer kicks.
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
                sleeping: AtomicU32::new(0),
                event,
            }),
            epoll,
            links: Vec::new(),
            cursor: 0,
        })
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

    /// Moves up to `out.len()` completions into `out`.
    ///
    /// Hot path: atomics only; no syscall, lock or allocation.
    #[inline]
    pub(crate) fn poll(&mut self, out: &mut [Completion]) -> usize {
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
    /// `timeout` passes (then `Ok(0)`; epoll rounds it up to whole
    /// milliseconds). Warm path.
    ///
    /// Wake-up protocol: announce "sleeping" (our flag and every attached
    /// ring's), fence, poll once more, then sleep in `epoll_wait`. A producer
    /// publishes, fences, and signals only if it sees the announcement, so a
    /// completion that lands between the last poll and the sleep still wakes us.
    pub(crate) fn wait(&mut self, out: &mut [Completion], timeout: Duration) -> Result<usize> {
        if out.is_empty() {
            return Ok(0);
        }
        let deadline = Instant::now().checked_add(timeout);
        self.reap();
        let mut events = [libc::epoll_event { events: 0, u64: 0 }; 16];
        loop {
            let n = self.poll(out);
            if n > 0 {
                return Ok(n);
            }
            self.set_sleeping(true);
            fence(Ordering::SeqCst);
            let n = self.poll(out);
            if n > 0 {
                self.set_sleeping(false);
                return Ok(n);
            }
            let ms = match deadline {
                None => -1,
                Some(deadline) => {
                    let now = Instant::now();
                    if now >= deadline {
                        self.set_sleeping(false);
                        return Ok(0);
                    }
                    os::ceil_ms(deadline - now)
                }
            };
            let ready = os::epoll_wait(self.epoll.as_raw_fd(), &mut events, ms);
            self.set_sleeping(false);
            let ready = ready?;
            for event in &events[..ready] {
                let token = event.u64;
                self.on_event(token);
            }
        }
    }

    fn set_sleeping(&self, sleeping: bool) {
        self.shared
            .sleeping
            .store(u32::from(sleeping), Ordering::Relaxed);
        for a in self.links.iter().flatten() {
            if !a.done {
                a.link.inbound.set_sleeping(sleeping);
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

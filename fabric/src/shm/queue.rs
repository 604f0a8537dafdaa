//! The part of a completion queue its endpoints hold: the completions, the
//! room reserved for them, and how to wake the queue's owner.

use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{fence, AtomicU32, AtomicUsize, Ordering};

use crossbeam_queue::ArrayQueue;

use super::ring::{AWAKE, SLEEP_FUTEX};
use super::sys;
use crate::completion::Completion;
use crate::os;

/// The part of a completion queue its endpoints hold (possibly on other threads).
#[derive(Debug)]
pub(super) struct CqShared {
    /// Local completions with the CQ slot of the endpoint that posted them.
    pub(super) queue: ArrayQueue<(Completion, u32)>,
    /// Completions pushed or about to be pushed; never above `depth`, so a
    /// reserved push cannot fail.
    pub(super) reserved: AtomicUsize,
    pub(super) depth: usize,
    /// Whether and how the owner is (about to be) asleep in `wait`:
    /// [`AWAKE`], [`SLEEP_FUTEX`] (on `futex`) or [`SLEEP_SOCKET`] (in
    /// `epoll_wait`, on `event`).
    pub(super) sleeping: AtomicU32,
    /// Private futex word the owner sleeps on (with its rings' words).
    pub(super) futex: AtomicU32,
    /// Private eventfd the owner sleeps on in the epoll fallback (with the
    /// wake-up sockets).
    pub(super) event: OwnedFd,
}

impl CqShared {
    /// Capacity in completions.
    pub(super) fn depth(&self) -> usize {
        self.depth
    }

    /// Claims room for `n` completions, all or none. Hot path.
    #[inline]
    pub(super) fn reserve_n(&self, n: usize) -> bool {
        if self.reserved.fetch_add(n, Ordering::AcqRel) + n > self.depth {
            self.reserved.fetch_sub(n, Ordering::AcqRel);
            return false;
        }
        true
    }

    /// Gives back `n` claims that will not be used. Hot path.
    #[inline]
    pub(super) fn unreserve(&self, n: usize) {
        self.reserved.fetch_sub(n, Ordering::AcqRel);
    }

    /// Pushes a completion into reserved room and wakes a sleeping owner.
    /// Hot path: no syscall unless the owner sleeps.
    #[inline]
    pub(super) fn push(&self, completion: Completion, slot: u32) {
        self.push_quietly(completion, slot);
        self.wake_if_sleeping();
    }

    /// Pushes a completion into reserved room without waking the owner:
    /// the caller calls [`CqShared::wake_if_sleeping`] after its last.
    /// Hot path.
    #[inline]
    pub(super) fn push_quietly(&self, completion: Completion, slot: u32) {
        let pushed = self.queue.push((completion, slot));
        debug_assert!(pushed.is_ok(), "a reserved completion slot was taken");
    }

    /// Wakes the owner if it announced it sleeps. Hot path: one fence and
    /// one load when it does not.
    #[inline]
    pub(super) fn wake_if_sleeping(&self) {
        // Pairs with the fence in `ShmCq::wait` between announcing sleep and
        // the last poll: either the owner sees our push or we see its flag.
        fence(Ordering::SeqCst);
        if self.sleeping.load(Ordering::Relaxed) != AWAKE {
            match self.sleeping.swap(AWAKE, Ordering::AcqRel) {
                AWAKE => {}
                SLEEP_FUTEX => self.wake_futex(),
                _ => os::eventfd_signal(self.event.as_raw_fd()),
            }
        }
    }

    /// Bumps the private futex word and wakes the owner sleeping on it.
    fn wake_futex(&self) {
        // Release: an owner that reads the new value sees what we published.
        self.futex.fetch_add(1, Ordering::Release);
        sys::futex_wake(&self.futex, true);
    }

    /// Wakes the owner unconditionally (peer loss, endpoint closed), on
    /// whichever path it sleeps. Cold path.
    pub(super) fn wake(&self) {
        self.wake_futex();
        os::eventfd_signal(self.event.as_raw_fd());
    }
}

//! The part of a completion queue that endpoints and the progress thread
//! see: the completions, and how to wake the queue's waiter.

use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::atomic::{fence, AtomicBool, AtomicU64, Ordering};

use crossbeam_queue::ArrayQueue;

use crate::completion::Completion;
use crate::os;

/// The part of a completion queue that endpoints and the progress thread see.
pub(crate) struct CqShared {
    pub(super) queue: ArrayQueue<Completion>,
    /// Bumped by every poll, so the progress thread can tell a queue that
    /// somebody polls from an abandoned one.
    pub(super) polls: AtomicU64,
    /// Somebody sleeps in `wait` and drives the endpoints.
    pub(super) waiting: AtomicBool,
    /// Wakes a waiter when another thread produced completions.
    pub(super) eventfd: OwnedFd,
    /// What a waiter sleeps on: the endpoints' sockets and the eventfd.
    pub(super) epfd: OwnedFd,
}

impl CqShared {
    /// Adds a completion; `false` when the queue is full.
    #[inline]
    pub(super) fn push(&self, completion: Completion) -> bool {
        self.queue.push(completion).is_ok()
    }

    /// Free entries.
    #[inline]
    pub(super) fn free(&self) -> usize {
        self.queue.capacity() - self.queue.len()
    }

    pub(super) fn capacity(&self) -> usize {
        self.queue.capacity()
    }

    /// Wakes a thread sleeping in `wait`, if there is one. Called by threads
    /// other than the waiter after they pushed completions.
    pub(super) fn notify(&self) {
        fence(Ordering::SeqCst);
        if self.waiting.load(Ordering::SeqCst) {
            os::eventfd_signal(self.eventfd.as_raw_fd());
        }
    }

    /// Takes a closed endpoint's socket out of the waiter's set.
    pub(super) fn forget(&self, fd: RawFd) {
        let _ = os::epoll_ctl(self.epfd.as_raw_fd(), libc::EPOLL_CTL_DEL, fd, 0, 0);
    }
}

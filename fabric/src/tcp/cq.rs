//! Completion queues of the tcp provider.

use std::os::fd::AsRawFd;
use std::sync::atomic::{fence, AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_queue::ArrayQueue;

use super::endpoint::EpShared;
use super::queue::CqShared;
use crate::completion::Completion;
use crate::error::{Error, Result};
use crate::os;
use crate::provider;
use crate::EndpointOptions;

const EVENTFD_TOKEN: u64 = u64::MAX;

/// Up to this many attached endpoints, `poll` reads every socket itself:
/// one `read` each, which with one or two endpoints is cheaper than asking
/// epoll first (the one-in-flight latency path). With more, one
/// `epoll_wait` finds the readable sockets and only those are read.
///
/// Measured on loopback (2 cores): an empty `read` costs about 0.3-0.4 µs
/// and an empty `epoll_wait` about 0.2 µs; a one-in-flight ping-pong took
/// about 5 µs either way with two endpoints, was slower by asking epoll
/// with one, and faster by it from three on (5.5 against 7 µs).
const DIRECT_POLL_MAX: usize = 2;
/// Readiness events taken by one poll. When all come back full, more may
/// be ready, and that poll drives every endpoint.
const READY_EVENTS: usize = 64;

/// An endpoint attached to a completion queue.
struct Attached {
    ep: Arc<EpShared>,
    /// Its socket is watched for writability too (`wait` sets it when
    /// output is queued, `poll` clears it once the output is gone).
    watching: bool,
    /// The completions it may need (send_depth + recv_depth).
    need: usize,
    /// Its socket was reported readable by this poll's `epoll_wait`.
    ready: bool,
}

/// A completion queue: the application's handle.
pub(crate) struct TcpCq {
    shared: Arc<CqShared>,
    /// Attached endpoints, in increasing id order (the epoll token), so a
    /// readiness event finds its endpoint by binary search.
    endpoints: Vec<Attached>,
    reserved: usize,
    polls: u64,
    /// The readiness events of one poll (allocated once).
    events: Box<[libc::epoll_event]>,
    /// Polls that asked epoll which sockets are readable.
    #[cfg(test)]
    ready_polls: u64,
}

impl std::fmt::Debug for TcpCq {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpCq")
            .field("depth", &self.shared.capacity())
            .field("endpoints", &self.endpoints.len())
            .finish()
    }
}

impl TcpCq {
    pub(super) fn new(depth: usize) -> Result<TcpCq> {
        let eventfd = os::eventfd()?;
        let epfd = os::epoll_create()?;
        os::epoll_ctl(
            epfd.as_raw_fd(),
            libc::EPOLL_CTL_ADD,
            eventfd.as_raw_fd(),
            libc::EPOLLIN as u32,
            EVENTFD_TOKEN,
        )?;
        Ok(TcpCq {
            shared: Arc::new(CqShared {
                queue: ArrayQueue::new(depth),
                polls: AtomicU64::new(0),
                waiting: AtomicBool::new(false),
                eventfd,
                epfd,
            }),
            endpoints: Vec::new(),
            reserved: 0,
            polls: 0,
            events: vec![libc::epoll_event { events: 0, u64: 0 }; READY_EVENTS].into_boxed_slice(),
            #[cfg(test)]
            ready_polls: 0,
        })
    }

    /// How many polls asked epoll for the readable sockets.
    #[cfg(test)]
    pub(super) fn ready_polls(&self) -> u64 {
        self.ready_polls
    }

    /// Keeps the progress thread off this queue's endpoints, as it stays
    /// off those of a queue somebody waits on: only polls drive them.
    #[cfg(test)]
    pub(super) fn keep_progress_thread_off(&self) {
        self.shared.waiting.store(true, Ordering::SeqCst);
    }

    pub(super) fn shared(&self) -> &Arc<CqShared> {
        &self.shared
    }

    /// Refuses an endpoint whose completions might not fit, as verbs
    /// requires a completion queue as deep as the queues feeding it.
    pub(super) fn check_room(&mut self, opts: &EndpointOptions) -> Result<()> {
        self.prune();
        let need = self.reserved + opts.send_depth + opts.recv_depth;
        if need > self.shared.capacity() {
            return Err(Error::InvalidArgument(format!(
                "the completion queue holds {} completions, but its endpoints may produce {need} \
                 (send_depth + recv_depth of each): create a deeper queue or smaller endpoints",
                self.shared.capacity()
            )));
        }
        Ok(())
    }

    pub(super) fn attach(&mut self, ep: Arc<EpShared>, opts: &EndpointOptions) {
        let need = opts.send_depth + opts.recv_depth;
        self.reserved += need;
        let _ = os::epoll_ctl(
            self.shared.epfd.as_raw_fd(),
            libc::EPOLL_CTL_ADD,
            ep.fd(),
            (libc::EPOLLIN | libc::EPOLLRDHUP) as u32,
            ep.id,
        );
        // Ids grow with every endpoint made, so this is normally a push.
        let at = self.endpoints.partition_point(|a| a.ep.id < ep.id);
        self.endpoints.insert(
            at,
            Attached {
                ep,
                watching: false,
                need,
                ready: false,
            },
        );
    }

    /// Drops endpoints the application has closed, keeping the others in
    /// order.
    fn prune(&mut self) {
        let reserved = &mut self.reserved;
        self.endpoints.retain(|a| {
            let closed = a.ep.closed.load(Ordering::Relaxed);
            if closed {
                *reserved -= a.need;
            }
            !closed
        });
    }

    /// Drives the endpoints: each reads its socket, unless the queue has
    /// more than [`DIRECT_POLL_MAX`] endpoints and `eager` is off; then
    /// only the sockets `epoll_wait` reports readable are read, and the
    /// endpoints with other work ([`EpShared::needs_drive`]) are driven
    /// without a read. Hot path.
    fn drive(&mut self, eager: bool) {
        self.polls = self.polls.wrapping_add(1);
        self.shared.polls.store(self.polls, Ordering::Relaxed);
        if eager || self.endpoints.len() <= DIRECT_POLL_MAX || !self.mark_ready() {
            for a in &self.endpoints {
                a.ep.try_progress(eager, true);
            }
            return;
        }
        for a in &mut self.endpoints {
            if a.ready || a.ep.needs_drive() {
                // A closed endpoint's socket is no longer watched: reading
                // it finds the end of the stream and fails what is left.
                let read = a.ready || a.ep.closed.load(Ordering::Relaxed);
                a.ep.try_progress(false, read);
                a.ready = false;
            }
        }
    }

    /// Asks epoll (without sleeping) which sockets are readable and marks
    /// their endpoints. `false` when that is unknown (epoll failed, or more
    /// may be ready than one call returns): then every endpoint is read.
    /// Stops watching for writability a socket whose output has left.
    /// Hot path: one system call.
    fn mark_ready(&mut self) -> bool {
        #[cfg(test)]
        {
            self.ready_polls += 1;
        }
        let epfd = self.shared.epfd.as_raw_fd();
        let Ok(n) = os::epoll_wait(epfd, &mut self.events, 0) else {
            return false;
        };
        if n == self.events.len() {
            return false;
        }
        let readable = (libc::EPOLLIN | libc::EPOLLRDHUP | libc::EPOLLHUP | libc::EPOLLERR) as u32;
        for event in &self.events[..n] {
            let (token, bits) = (event.u64, event.events);
            let Ok(i) = self.endpoints.binary_search_by_key(&token, |a| a.ep.id) else {
                // The eventfd (a waiter's wake-up, drained by `wait`), or an
                // endpoint pruned since.
                continue;
            };
            let a = &mut self.endpoints[i];
            a.ready |= bits & readable != 0;
            if a.watching && !a.ep.tx_pending.load(Ordering::Acquire) {
                // Writable, with nothing left to write: only `wait` watches
                // for room, and it will again when output is queued.
                let events = (libc::EPOLLIN | libc::EPOLLRDHUP) as u32;
                if os::epoll_ctl(epfd, libc::EPOLL_CTL_MOD, a.ep.fd(), events, a.ep.id).is_ok() {
                    a.watching = false;
                }
            }
        }
        true
    }

    fn drain(&mut self, out: &mut [Completion]) -> usize {
        let mut n = 0;
        while n < out.len() {
            match self.shared.queue.pop() {
                Some(c) => {
                    out[n] = c;
                    n += 1;
                }
                None => break,
            }
        }
        n
    }

    /// Watches sockets with queued output for writability while waiting.
    fn watch_writability(&mut self) -> Result<()> {
        let epfd = self.shared.epfd.as_raw_fd();
        for a in &mut self.endpoints {
            let ep = &a.ep;
            let pending = ep.tx_pending.load(Ordering::Acquire) && !ep.is_dead();
            if pending != a.watching {
                let mut events = (libc::EPOLLIN | libc::EPOLLRDHUP) as u32;
                if pending {
                    events |= libc::EPOLLOUT as u32;
                }
                os::epoll_ctl(epfd, libc::EPOLL_CTL_MOD, ep.fd(), events, ep.id)?;
                a.watching = pending;
            }
        }
        Ok(())
    }
}

impl provider::CompletionQueue for TcpCq {
    /// Hot path: drives the endpoints (each only if nobody else is; with
    /// many, only those with something to do), then drains completions. No
    /// blocking, no allocation, no waiting for locks.
    #[inline]
    fn poll(&mut self, out: &mut [Completion]) -> usize {
        self.drive(false);
        self.drain(out)
    }

    /// Warm path: sleeps in `epoll_wait` on the endpoints' sockets until a
    /// completion is ready or `timeout` passes.
    fn wait(&mut self, out: &mut [Completion], timeout: Duration) -> Result<usize> {
        let deadline = Instant::now() + timeout;
        let mut events = [libc::epoll_event { events: 0, u64: 0 }; 16];
        loop {
            self.prune();
            let n = self.poll(out);
            if n > 0 {
                return Ok(n);
            }
            self.shared.waiting.store(true, Ordering::SeqCst);
            fence(Ordering::SeqCst);
            // Acknowledge now: nobody will post for a while.
            self.drive(true);
            let n = self.drain(out);
            if n > 0 {
                self.shared.waiting.store(false, Ordering::SeqCst);
                return Ok(n);
            }
            self.watch_writability()?;
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                self.shared.waiting.store(false, Ordering::SeqCst);
                return Ok(0);
            }
            let ready = os::epoll_wait(
                self.shared.epfd.as_raw_fd(),
                &mut events,
                os::timeout_ms(Some(left)),
            );
            self.shared.waiting.store(false, Ordering::SeqCst);
            let ready = ready?;
            if events[..ready].iter().any(|e| e.u64 == EVENTFD_TOKEN) {
                os::eventfd_drain(self.shared.eventfd.as_raw_fd());
            }
        }
    }
}

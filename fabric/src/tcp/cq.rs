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

/// A completion queue: the application's handle.
pub(crate) struct TcpCq {
    shared: Arc<CqShared>,
    /// Attached endpoints, whether their socket is watched for writability
    /// by `wait`, and the completions they may need.
    endpoints: Vec<(Arc<EpShared>, bool, usize)>,
    reserved: usize,
    polls: u64,
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
        })
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
        self.endpoints.push((ep, false, need));
    }

    /// Drops endpoints the application has closed.
    fn prune(&mut self) {
        let mut i = 0;
        while i < self.endpoints.len() {
            if self.endpoints[i].0.closed.load(Ordering::Relaxed) {
                let (_, _, need) = self.endpoints.swap_remove(i);
                self.reserved -= need;
            } else {
                i += 1;
            }
        }
    }

    fn drive(&mut self, eager: bool) {
        self.polls = self.polls.wrapping_add(1);
        self.shared.polls.store(self.polls, Ordering::Relaxed);
        for (ep, _, _) in &self.endpoints {
            ep.try_progress(eager);
        }
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
        for (ep, watching, _) in &mut self.endpoints {
            let pending = ep.tx_pending.load(Ordering::Acquire) && !ep.is_dead();
            if pending != *watching {
                let mut events = (libc::EPOLLIN | libc::EPOLLRDHUP) as u32;
                if pending {
                    events |= libc::EPOLLOUT as u32;
                }
                os::epoll_ctl(epfd, libc::EPOLL_CTL_MOD, ep.fd(), events, ep.id)?;
                *watching = pending;
            }
        }
        Ok(())
    }
}

impl provider::CompletionQueue for TcpCq {
    /// Hot path: drives the endpoints (each only if nobody else is), then
    /// drains completions. No blocking, no allocation, no waiting for locks.
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

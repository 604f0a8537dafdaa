//! The state of one connection shared by its endpoint, its completion queue
//! and the progress thread.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use crossbeam_queue::ArrayQueue;

use super::domain::DomainState;
use super::queue::CqShared;
use super::ring::Inbound;
use super::sys;
use crate::completion::Status;
use rfaas_proto::shm_control::{GrantInfo, MSG_LEN};

/// Locks `m`, ignoring poisoning (every critical section leaves consistent state).
pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A grant reply handed from the progress thread to the endpoint that asked.
#[derive(Debug)]
pub(super) struct Reply {
    pub req_id: u64,
    pub grant: Option<GrantInfo>,
    pub fd: Option<OwnedFd>,
}

/// Bytes read from the control socket and not yet parsed (progress thread only).
pub(super) struct Rx {
    pub buf: [u8; 4096],
    pub len: usize,
    pub fds: Vec<OwnedFd>,
}

/// One connection.
pub(super) struct Link {
    /// The unix control socket (grants, and its hang-up tells us the peer is gone).
    pub sock: OwnedFd,
    /// Serialises whole messages on `sock` (grant requests vs. grant replies).
    write_lock: Mutex<()>,
    /// The domain this endpoint belongs to: the peer may be granted its regions.
    pub domain: Arc<DomainState>,
    /// The peer is gone (or broke the protocol); sticky.
    pub lost: AtomicBool,
    /// Our endpoint was dropped; sticky.
    pub closed: AtomicBool,
    /// Completions of this endpoint posted and not yet polled (send depth).
    pub outstanding: AtomicUsize,
    /// Posted receives, in order.
    pub recvs: ArrayQueue<u64>,
    /// Notifications from the peer.
    pub inbound: Inbound,
    /// Where this endpoint's completions go.
    pub cq: Arc<CqShared>,
    mailbox: Mutex<Option<Reply>>,
    mailbox_cv: Condvar,
    pub rx: Mutex<Rx>,
    /// The peer, for logs and errors.
    pub peer: String,
}

impl std::fmt::Debug for Link {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Link")
            .field("peer", &self.peer)
            .field("lost", &self.lost)
            .field("closed", &self.closed)
            .field("outstanding", &self.outstanding)
            .field("posted_receives", &self.recvs.len())
            .finish_non_exhaustive()
    }
}

impl Link {
    pub(super) fn new(
        sock: OwnedFd,
        domain: Arc<DomainState>,
        recv_depth: usize,
        inbound: Inbound,
        cq: Arc<CqShared>,
        peer: String,
    ) -> Link {
        Link {
            sock,
            write_lock: Mutex::new(()),
            domain,
            lost: AtomicBool::new(false),
            closed: AtomicBool::new(false),
            outstanding: AtomicUsize::new(0),
            recvs: ArrayQueue::new(recv_depth),
            inbound,
            cq,
            mailbox: Mutex::new(None),
            mailbox_cv: Condvar::new(),
            rx: Mutex::new(Rx {
                buf: [0; 4096],
                len: 0,
                fds: Vec::new(),
            }),
            peer,
        }
    }

    /// Whether the peer is gone. Hot path: one load.
    #[inline]
    pub(super) fn is_lost(&self) -> bool {
        self.lost.load(Ordering::Acquire)
    }

    /// Declares the peer gone: closes the connection (so the peer learns it
    /// too), wakes a thread waiting for a grant and the completion queue.
    pub(super) fn mark_lost(&self, why: &str) {
        if !self.lost.swap(true, Ordering::SeqCst) {
            tracing::debug!(peer = %self.peer, why, "shm peer lost");
        }
        sys::shutdown(self.sock.as_raw_fd());
        {
            let _mailbox = lock(&self.mailbox);
            self.mailbox_cv.notify_all();
        }
        self.cq.wake();
    }

    /// Sends one whole control message without blocking.
    pub(super) fn send_control(&self, msg: &[u8; MSG_LEN], fds: &[RawFd]) -> io::Result<()> {
        let _writer = lock(&self.write_lock);
        loop {
            match sys::send_msg(self.sock.as_raw_fd(), msg, fds, libc::MSG_DONTWAIT) {
                Ok(MSG_LEN) => return Ok(()),
                // Half a message would desynchronise the stream; only a peer
                // that stopped reading gets here.
                Ok(_) => return Err(io::Error::other("the control socket took half a message")),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    }

    /// Hands a grant reply to the endpoint waiting for it (progress thread).
    pub(super) fn deliver(&self, reply: Reply) {
        *lock(&self.mailbox) = Some(reply);
        self.mailbox_cv.notify_all();
    }

    /// Waits for the reply to request `req_id`. Slow path.
    pub(super) fn await_reply(&self, req_id: u64, timeout: Duration) -> Result<Reply, Status> {
        let deadline = Instant::now() + timeout;
        let mut mailbox = lock(&self.mailbox);
        loop {
            match mailbox.take() {
                Some(reply) if reply.req_id == req_id => return Ok(reply),
                // A late answer to a request we gave up on; its fd closes here.
                Some(_) => continue,
                None => {}
            }
            if self.is_lost() {
                return Err(Status::PeerLost);
            }
            let now = Instant::now();
            if now >= deadline {
                drop(mailbox);
                self.mark_lost("the peer did not answer a grant request in time");
                return Err(Status::PeerLost);
            }
            mailbox = self
                .mailbox_cv
                .wait_timeout(mailbox, deadline - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }
}

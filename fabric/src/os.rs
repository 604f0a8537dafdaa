//! The few epoll, eventfd and poll calls the software providers share, and
//! the pending connections of their listeners ([`Pending`]).
//!
//! None of these is on a hot path: they serve `wait`, set-up and the
//! progress threads.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

/// A duration as epoll/poll milliseconds, rounded up (a sleep never ends early).
pub(crate) fn ceil_ms(d: Duration) -> i32 {
    d.as_nanos().div_ceil(1_000_000).min(i32::MAX as u128) as i32
}

/// A timeout as epoll/poll milliseconds, rounded up; -1 for none.
pub(crate) fn timeout_ms(timeout: Option<Duration>) -> i32 {
    timeout.map_or(-1, ceil_ms)
}

pub(crate) fn epoll_create() -> Result<OwnedFd> {
    // SAFETY: plain syscall.
    let fd = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
    if fd < 0 {
        return Err(Error::last_os("epoll_create1"));
    }
    // SAFETY: fd is fresh and ours.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

pub(crate) fn eventfd() -> Result<OwnedFd> {
    // SAFETY: plain syscall.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
    if fd < 0 {
        return Err(Error::last_os("eventfd"));
    }
    // SAFETY: fd is fresh and ours.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Adds 1 to an eventfd (wakes whoever sleeps on it).
pub(crate) fn eventfd_signal(fd: RawFd) {
    let one: u64 = 1;
    // SAFETY: writes 8 bytes from a live u64. A full counter (EAGAIN)
    // already means "signalled", so the result is irrelevant.
    unsafe { libc::write(fd, (&one as *const u64).cast(), 8) };
}

/// Resets an eventfd.
pub(crate) fn eventfd_drain(fd: RawFd) {
    let mut value: u64 = 0;
    // SAFETY: reads 8 bytes into a live u64; EAGAIN means already drained.
    unsafe { libc::read(fd, (&mut value as *mut u64).cast(), 8) };
}

/// `epoll_ctl`; `ENOENT` on delete and `EEXIST` on add are not errors.
pub(crate) fn epoll_ctl(epfd: RawFd, op: i32, fd: RawFd, events: u32, data: u64) -> Result<()> {
    let mut event = libc::epoll_event { events, u64: data };
    // SAFETY: event is valid for the call.
    let rc = unsafe { libc::epoll_ctl(epfd, op, fd, &mut event) };
    if rc != 0 {
        let err = std::io::Error::last_os_error();
        match err.raw_os_error() {
            Some(libc::ENOENT) if op == libc::EPOLL_CTL_DEL => {}
            Some(libc::EEXIST) if op == libc::EPOLL_CTL_ADD => {}
            _ => return Err(Error::io("epoll_ctl", err)),
        }
    }
    Ok(())
}

/// `epoll_wait` into `events`; returns how many are ready (0 on timeout or EINTR).
pub(crate) fn epoll_wait(epfd: RawFd, events: &mut [libc::epoll_event], ms: i32) -> Result<usize> {
    // SAFETY: events is a valid, writable array of the given length.
    let rc = unsafe { libc::epoll_wait(epfd, events.as_mut_ptr(), events.len() as i32, ms) };
    if rc < 0 {
        let err = std::io::Error::last_os_error();
        if err.kind() == std::io::ErrorKind::Interrupted {
            return Ok(0);
        }
        return Err(Error::io("epoll_wait", err));
    }
    Ok(rc as usize)
}

/// Adds `fd` to an epoll set.
pub(crate) fn epoll_add(epfd: RawFd, fd: RawFd, events: u32, token: u64) -> Result<()> {
    epoll_ctl(epfd, libc::EPOLL_CTL_ADD, fd, events, token)
}

/// Removes `fd` from an epoll set (best effort: it may be gone already).
pub(crate) fn epoll_del(epfd: RawFd, fd: RawFd) {
    let _ = epoll_ctl(epfd, libc::EPOLL_CTL_DEL, fd, 0, 0);
}

/// A connection a listener took whose peer has not yet sent its whole
/// opening message.
#[derive(Debug)]
pub(crate) struct PendingPeer {
    pub fd: OwnedFd,
    /// Who it is, for errors.
    pub label: String,
    /// When it is given up if its opening message is still incomplete.
    deadline: Instant,
    /// It hung up (seen by poll), with part of its message sent.
    hung_up: bool,
    /// Part of its message is there (as of the last look).
    partial: bool,
}

/// What [`Pending::next`] found.
#[derive(Debug)]
pub(crate) enum Next {
    /// A peer whose whole opening message is waiting.
    Ready(PendingPeer),
    /// A peer given up, and why (it hung up or ran out of time).
    Failed(PendingPeer, String),
    /// The caller's deadline passed.
    TimedOut,
}

impl Next {
    /// The ready peer; a given-up one as [`Error::Connect`], the caller's
    /// deadline as [`Error::Timeout`]`(timed_out)`.
    pub(crate) fn peer(self, timed_out: &'static str) -> Result<PendingPeer> {
        match self {
            Next::Ready(peer) => Ok(peer),
            Next::Failed(peer, why) => Err(Error::Connect {
                addr: peer.label,
                reason: format!("the peer {why}"),
            }),
            Next::TimedOut => Err(Error::Timeout(timed_out)),
        }
    }
}

/// The connections a listener has taken but not handed out yet. `accept`
/// hands out the first whose peer has sent its whole opening message, so a
/// silent or slow peer holds up nobody behind it; one that hangs up or
/// outlives its deadline is handed out as failed (and closed).
#[derive(Debug, Default)]
pub(crate) struct Pending {
    peers: Mutex<Vec<PendingPeer>>,
}

/// How often a peer with part of its opening message is looked at again
/// (poll cannot wait for "at least n bytes" on every socket type), and how
/// long the listener rests when the process is out of descriptors.
const PARTIAL_RECHECK: Duration = Duration::from_millis(10);

/// Most connections kept waiting for their opening message; past it, new
/// ones wait in the kernel's backlog, as they did before any was taken.
const MAX_PENDING: usize = 64;

impl Pending {
    /// Waits for a pending peer with at least `need` bytes readable, or one
    /// to give up, taking new connections with `take` whenever `listener`
    /// is readable (`take` returns `None` when none is left; each new one
    /// gets `hold` to send its message), until `deadline`.
    pub(crate) fn next(
        &self,
        listener: RawFd,
        need: usize,
        hold: Duration,
        deadline: Option<Instant>,
        mut take: impl FnMut() -> std::io::Result<Option<(OwnedFd, String)>>,
    ) -> Result<Next> {
        let mut peers = self.peers.lock().unwrap_or_else(|e| e.into_inner());
        let mut rest_until: Option<Instant> = None;
        loop {
            let now = Instant::now();
            for i in 0..peers.len() {
                let p = &mut peers[i];
                let peek = peek_len(p.fd.as_raw_fd(), need);
                p.partial = peek == Peek::Partial;
                let why = match peek {
                    Peek::Ready => return Ok(Next::Ready(peers.swap_remove(i))),
                    Peek::Gone => "closed the connection before its hello was whole",
                    Peek::Partial if p.hung_up => {
                        "closed the connection before its hello was whole"
                    }
                    _ if p.deadline <= now => "sent no whole hello in time",
                    Peek::Partial | Peek::Nothing => continue,
                };
                return Ok(Next::Failed(peers.swap_remove(i), why.into()));
            }
            if deadline.is_some_and(|d| now >= d) {
                return Ok(Next::TimedOut);
            }
            // Wake for the listener, a peer's bytes or hang-up, a peer's
            // deadline, the caller's, and the next look at partial peers.
            let mut wake = deadline;
            for p in peers.iter() {
                wake = Some(wake.map_or(p.deadline, |w| w.min(p.deadline)));
            }
            let resting = rest_until.is_some_and(|r| now < r);
            if resting || peers.iter().any(|p| p.partial) {
                let soon = now + PARTIAL_RECHECK;
                wake = Some(wake.map_or(soon, |w| w.min(soon)));
            }
            // A full list, or no descriptor to take one with: leave new
            // connections in the backlog for now (fd -1 is ignored by poll).
            let taking = peers.len() < MAX_PENDING && !resting;
            let mut fds = Vec::with_capacity(peers.len() + 1);
            fds.push(libc::pollfd {
                fd: if taking { listener } else { -1 },
                events: libc::POLLIN,
                revents: 0,
            });
            for p in peers.iter() {
                // A partial peer is readable all along: wait only for its
                // hang-up, and look again at PARTIAL_RECHECK.
                let events = if p.partial {
                    libc::POLLRDHUP
                } else {
                    libc::POLLIN | libc::POLLRDHUP
                };
                fds.push(libc::pollfd {
                    fd: p.fd.as_raw_fd(),
                    events,
                    revents: 0,
                });
            }
            let ms = timeout_ms(wake.map(|w| w.saturating_duration_since(now)));
            // SAFETY: fds is a valid array of pollfds for the call.
            let rc = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
            if rc < 0 {
                let err = std::io::Error::last_os_error();
                if err.kind() != std::io::ErrorKind::Interrupted {
                    return Err(Error::io("poll (accept)", err));
                }
                continue;
            }
            for (p, f) in peers.iter_mut().zip(&fds[1..]) {
                if f.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0 {
                    p.hung_up = true;
                }
            }
            if fds[0].revents != 0 {
                while peers.len() < MAX_PENDING {
                    match take() {
                        Ok(Some((fd, label))) => peers.push(PendingPeer {
                            fd,
                            label,
                            deadline: Instant::now() + hold,
                            hung_up: false,
                            partial: false,
                        }),
                        Ok(None) => break,
                        // Out of descriptors or memory: the peers waiting
                        // now are served first, and the listener rests.
                        Err(e)
                            if matches!(
                                e.raw_os_error(),
                                Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)
                            ) =>
                        {
                            rest_until = Some(Instant::now() + PARTIAL_RECHECK);
                            break;
                        }
                        Err(e) => return Err(Error::io("accept", e)),
                    }
                }
            }
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Peek {
    /// At least the bytes asked for are there.
    Ready,
    /// Some, not all.
    Partial,
    /// None yet.
    Nothing,
    /// Closed or failed with nothing sent.
    Gone,
}

/// How much of a `need`-byte message waits on `fd`, without taking it.
fn peek_len(fd: RawFd, need: usize) -> Peek {
    let mut buf = [0u8; 256];
    let want = need.min(buf.len());
    // SAFETY: buf holds `want` writable bytes; MSG_PEEK leaves the data
    // (and any passed descriptors) queued.
    let n = unsafe {
        libc::recv(
            fd,
            buf.as_mut_ptr().cast(),
            want,
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    match n {
        n if n >= 0 && n as usize >= want => Peek::Ready,
        0 => Peek::Gone,
        n if n > 0 => Peek::Partial,
        _ => match std::io::Error::last_os_error().kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted => Peek::Nothing,
            _ => Peek::Gone,
        },
    }
}

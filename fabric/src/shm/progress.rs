//! The progress thread: one per process, started with the first endpoint.
//!
//! It watches every control socket with epoll and
//! - serves the peers' grant requests, so a target whose application never
//!   polls (a passive target) is still accessible, as behind a NIC;
//! - hands grant replies to the endpoint that asked;
//! - notices a peer's death by the hang-up of its socket and marks the
//!   connection lost, waking its completion queue.
//!
//! Nothing here is on a hot path: a cached grant never involves this thread.

use std::collections::HashMap;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::link::{lock, Link, Reply, Rx};
use super::sys;
use crate::error::{Error, Result};
use crate::memory::Access;
use crate::os;
use rfaas_proto::shm_control::{Control, GrantInfo, MSG_LEN};

/// The per-process progress thread's state.
#[derive(Debug)]
pub(super) struct Progress {
    /// The process that started the thread (a forked child needs its own).
    pid: u32,
    epoll: OwnedFd,
    links: Mutex<HashMap<u64, Arc<Link>>>,
    next_token: AtomicU64,
}

/// The progress thread of this process, started on first use.
pub(super) fn progress() -> Result<Arc<Progress>> {
    static CURRENT: Mutex<Option<Arc<Progress>>> = Mutex::new(None);
    let pid = std::process::id();
    let mut current = lock(&CURRENT);
    if let Some(p) = current.as_ref().filter(|p| p.pid == pid) {
        return Ok(p.clone());
    }
    // After fork the child inherits the parent's state but not its thread,
    // and must not touch the parent's epoll set: leak it, start afresh.
    if let Some(stale) = current.take() {
        std::mem::forget(stale);
    }
    let p = Arc::new(Progress {
        pid,
        epoll: os::epoll_create()?,
        links: Mutex::new(HashMap::new()),
        next_token: AtomicU64::new(1),
    });
    let runner = p.clone();
    std::thread::Builder::new()
        .name("rfaas-shm-progress".into())
        .spawn(move || runner.run())
        .map_err(|e| Error::io("spawning the shm progress thread", e))?;
    *current = Some(p.clone());
    Ok(p)
}

impl Progress {
    /// Starts watching `link`'s control socket; returns its token.
    pub(super) fn register(&self, link: &Arc<Link>) -> Result<u64> {
        let token = self.next_token.fetch_add(1, Ordering::Relaxed);
        lock(&self.links).insert(token, link.clone());
        let events = (libc::EPOLLIN | libc::EPOLLRDHUP) as u32;
        if let Err(e) = os::epoll_add(self.epoll.as_raw_fd(), link.sock.as_raw_fd(), events, token)
        {
            lock(&self.links).remove(&token);
            return Err(e);
        }
        Ok(token)
    }

    /// Stops watching the link of `token` (idempotent).
    pub(super) fn unregister(&self, token: u64) {
        if let Some(link) = lock(&self.links).remove(&token) {
            os::epoll_del(self.epoll.as_raw_fd(), link.sock.as_raw_fd());
        }
    }

    fn run(self: Arc<Self>) {
        let mut events = [libc::epoll_event { events: 0, u64: 0 }; 32];
        loop {
            let ready = match os::epoll_wait(self.epoll.as_raw_fd(), &mut events, -1) {
                Ok(n) => n,
                Err(e) => {
                    tracing::error!(error = %e, "shm progress thread: epoll_wait failed; retrying");
                    std::thread::sleep(Duration::from_millis(100));
                    continue;
                }
            };
            for event in &events[..ready] {
                let (token, flags) = (event.u64, event.events);
                let link = lock(&self.links).get(&token).cloned();
                let Some(link) = link else { continue };
                if let Err(why) = self.handle(&link, flags) {
                    self.unregister(token);
                    link.mark_lost(why);
                }
            }
        }
    }

    /// Reads and answers what the peer sent; `Err` ends the connection.
    fn handle(&self, link: &Link, flags: u32) -> std::result::Result<(), &'static str> {
        let fd = link.sock.as_raw_fd();
        let mut rx = lock(&link.rx);
        loop {
            let Rx { buf, len, fds } = &mut *rx;
            match sys::recv_msg(fd, &mut buf[*len..], fds) {
                Ok(0) => return Err("the peer closed the connection"),
                Ok(n) => {
                    *len += n;
                    process(link, &mut rx)?;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(_) => return Err("the control socket failed"),
            }
        }
        if flags & (libc::EPOLLHUP | libc::EPOLLRDHUP | libc::EPOLLERR) as u32 != 0 {
            return Err("the peer hung up");
        }
        Ok(())
    }
}

/// Acts on every whole message in `rx`.
fn process(link: &Link, rx: &mut Rx) -> std::result::Result<(), &'static str> {
    let mut at = 0;
    while rx.len - at >= MSG_LEN {
        let msg = Control::decode(&rx.buf[at..at + MSG_LEN])
            .ok_or("the peer sent a control message this version does not know")?;
        at += MSG_LEN;
        match msg {
            Control::GrantRequest { req_id, rkey } => serve_grant(link, req_id, rkey)?,
            Control::GrantReply { req_id, grant, .. } => {
                let fd = match grant {
                    Some(_) if rx.fds.is_empty() => {
                        return Err("the peer granted a region without its descriptor")
                    }
                    Some(_) => Some(rx.fds.remove(0)),
                    None => None,
                };
                link.deliver(Reply { req_id, grant, fd });
            }
        }
    }
    rx.buf.copy_within(at..rx.len, 0);
    rx.len -= at;
    // Only a grant reply carries a descriptor, and a peer has at most one
    // request outstanding per endpoint.
    if rx.fds.len() > 1 || (rx.len == 0 && !rx.fds.is_empty()) {
        return Err("the peer passed descriptors the protocol does not expect");
    }
    Ok(())
}

/// Answers a peer's request for the region `rkey` of our endpoint's domain.
fn serve_grant(link: &Link, req_id: u64, rkey: u32) -> std::result::Result<(), &'static str> {
    let domain = &link.domain;
    // The serial read on both sides of the lookup pins the registration the
    // lookup found (serials never repeat; revocation clears it first).
    let before = domain.serial(rkey);
    let found = domain.registry.lookup(rkey);
    let after = domain.serial(rkey);
    let found = found.filter(|f| before != 0 && before == after && f.access != Access::LOCAL);
    let mut read_only: Option<OwnedFd> = None;
    let mut fds: Vec<RawFd> = Vec::new();
    let mut grant = None;
    if let Some(f) = &found {
        let writable =
            f.access.contains(Access::REMOTE_WRITE) || f.access.contains(Access::REMOTE_ATOMIC);
        let fd = if writable {
            Some(f.buf.fd())
        } else {
            // A read-only file description, so the kernel refuses the peer
            // a writable mapping whatever its library does.
            match sys::reopen_read_only(f.buf.fd()) {
                Ok(ro) => {
                    let raw = ro.as_raw_fd();
                    read_only = Some(ro);
                    Some(raw)
                }
                Err(e) => {
                    tracing::warn!(error = %e, rkey, "shm: cannot reopen a region read-only; refusing the grant");
                    None
                }
            }
        };
        if let Some(fd) = fd {
            fds.push(fd);
            grant = Some(GrantInfo {
                access: f.access.bits(),
                base: f.buf.as_ptr() as u64,
                len: f.buf.len() as u64,
                map_len: f.buf.mapped_len() as u64,
                serial: before,
            });
        }
    }
    let reply = Control::GrantReply {
        req_id,
        rkey,
        grant,
    }
    .encode();
    let sent = link.send_control(&reply, &fds);
    drop(read_only);
    drop(found);
    sent.map_err(|_| "could not answer the peer's grant request")
}

//! A connected shm endpoint: connection set-up, the grant cache and the
//! one-sided operations.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::fmt;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::cq::ShmCq;
use super::link::Link;
use super::progress::{progress, Progress};
use super::ring::{self, Inbound, Outbound, Wake};
use super::sys::{self, Mapping};
use super::{validity_word, DomainState, VALIDITY_BYTES};
use crate::completion::{Completion, Opcode, Status};
use crate::error::{Error, Result};
use crate::memory::{page_size, Access, MemoryRegion, PeerView, RemoteAddr};
use crate::EndpointOptions;
use rfaas_proto::shm_control::{
    Control, Hello, HelloError, HelloKind, RejectReason, MSG_LEN, VERSION,
};

/// How long an endpoint waits for the peer's progress thread to answer a
/// grant request before it declares the peer lost.
const GRANT_TIMEOUT: Duration = Duration::from_secs(5);

/// One region of the peer, mapped into our address space.
#[derive(Debug)]
struct Grant {
    rkey: u32,
    /// Must equal the peer's validity-table word, or the region was revoked.
    serial: u64,
    base: u64,
    len: u64,
    access: Access,
    map: Mapping,
    /// A second, read-only mapping of a writable region, for
    /// [`crate::Endpoint::peer_view`] (`None`: `map` is read-only already).
    view_map: Option<Mapping>,
}

impl Grant {
    /// Where `len` bytes at the peer's `addr` are in our mapping, if the
    /// range lies in the region and the grant has `need`. Hot path.
    #[inline]
    fn locate(&self, addr: u64, len: u64, need: Access) -> Option<*mut u8> {
        if !self.access.contains(need) {
            return None;
        }
        let offset = addr.checked_sub(self.base)?;
        if offset.checked_add(len)? > self.len {
            return None;
        }
        // SAFETY: offset + len <= self.len <= map.len() (checked when the
        // grant was mapped), so the pointer stays inside the mapping.
        Some(unsafe { self.map.as_ptr().add(offset as usize) })
    }
}

impl Grant {
    /// Like [`Grant::locate`] with [`Access::REMOTE_READ`], in the
    /// read-only mapping.
    #[inline]
    fn locate_view(&self, addr: u64, len: u64) -> Option<*const u8> {
        let p = self.locate(addr, len, Access::REMOTE_READ)?;
        match &self.view_map {
            None => Some(p.cast_const()),
            // SAFETY: `p` lies in `map` at offset p - map; both mappings
            // have the same length.
            Some(ro) => Some(unsafe { ro.as_ptr().add(p.offset_from(self.map.as_ptr()) as usize) }),
        }
    }
}

/// Direct-mapped slots for the common case of a few regions per peer.
const FAST_SLOTS: usize = 32;

/// The peer's regions we mapped, by rkey. Filled on the slow path only.
#[derive(Debug)]
struct GrantCache {
    fast: [Option<Grant>; FAST_SLOTS],
    overflow: HashMap<u32, Grant>,
}

impl GrantCache {
    fn new() -> GrantCache {
        GrantCache {
            fast: std::array::from_fn(|_| None),
            overflow: HashMap::new(),
        }
    }

    /// Hot path: one indexed compare, no hashing when the slot matches.
    #[inline]
    fn get(&self, rkey: u32) -> Option<&Grant> {
        match &self.fast[rkey as usize % FAST_SLOTS] {
            Some(g) if g.rkey == rkey => Some(g),
            _ if self.overflow.is_empty() => None,
            _ => self.overflow.get(&rkey),
        }
    }

    fn insert(&mut self, grant: Grant) {
        let slot = &mut self.fast[grant.rkey as usize % FAST_SLOTS];
        if slot.is_none() {
            *slot = Some(grant);
        } else {
            self.overflow.insert(grant.rkey, grant);
        }
    }

    /// Keeps only the grants `live` accepts. Slow path.
    fn retain(&mut self, live: impl Fn(&Grant) -> bool) {
        for slot in &mut self.fast {
            if slot.as_ref().is_some_and(|g| !live(g)) {
                *slot = None;
            }
        }
        self.overflow.retain(|_, g| live(g));
    }

    /// How many regions are mapped.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.fast.iter().flatten().count() + self.overflow.len()
    }

    fn remove(&mut self, rkey: u32) {
        let slot = &mut self.fast[rkey as usize % FAST_SLOTS];
        if slot.as_ref().is_some_and(|g| g.rkey == rkey) {
            *slot = None;
        } else {
            self.overflow.remove(&rkey);
        }
    }
}

/// A connected endpoint of the shm provider. `Send`, not `Sync`.
pub(crate) struct ShmEndpoint {
    link: Arc<Link>,
    /// Our slot in the completion queue.
    slot: u32,
    send_depth: usize,
    recv_depth: usize,
    /// The peer's inbound ring.
    out: Outbound,
    /// The peer's wake-up socket, kicked when its CQ sleeps in `epoll_wait`
    /// (the fallback; it normally sleeps on its ring's futex word).
    peer_wake: OwnedFd,
    /// The peer domain's validity table (read-only).
    peer_validity: Mapping,
    grants: RefCell<GrantCache>,
    next_req: Cell<u64>,
    progress: Arc<Progress>,
    token: u64,
}

impl fmt::Debug for ShmEndpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ShmEndpoint")
            .field("peer", &self.link.peer)
            .field("slot", &self.slot)
            .field("lost", &self.link.is_lost())
            .finish()
    }
}

impl ShmEndpoint {
    /// Writes `local[offset..offset+len]` to `remote`, then, with `imm`,
    /// publishes a notification in the peer's ring. Hot path.
    ///
    /// A full ring returns [`Error::QueueFull`] before anything is copied.
    pub(crate) fn write(
        &self,
        wr_id: u64,
        local: &MemoryRegion,
        offset: usize,
        len: usize,
        remote: RemoteAddr,
        imm: Option<u32>,
    ) -> Result<()> {
        let opcode = if imm.is_some() {
            Opcode::WriteWithImm
        } else {
            Opcode::Write
        };
        self.reserve()?;
        if self.link.is_lost() {
            return self.finish(Completion::error(wr_id, opcode, Status::PeerLost));
        }
        // Like a NIC, a zero-length write names no memory and checks no rkey.
        let dst = if len == 0 {
            None
        } else {
            match self.resolve(remote, len as u64, Access::REMOTE_WRITE) {
                Ok(dst) => Some(dst),
                Err(status) => return self.finish(Completion::error(wr_id, opcode, status)),
            }
        };
        if imm.is_some() && !self.out.has_room() {
            self.unreserve();
            return Err(Error::QueueFull {
                what: "the peer's immediate ring (the peer posts too few receives)",
                depth: self.out.cap(),
            });
        }
        if let Some(dst) = dst {
            // SAFETY: lib.rs checked offset + len against the local region;
            // resolve checked the remote range against the granted, writable
            // mapping, which the grant cache keeps alive. The peer may touch
            // those bytes concurrently, as with a NIC; we only copy raw bytes.
            unsafe { std::ptr::copy(local.as_ptr().add(offset), dst, len) };
        }
        if let Some(imm) = imm {
            match self.out.push(imm, len as u32) {
                Wake::No => {}
                Wake::Futex => self.out.wake_futex(),
                Wake::Socket => sys::kick(self.peer_wake.as_raw_fd()),
            }
        }
        self.finish(Completion::ok(wr_id, opcode, len as u32))
    }

    /// Reads `len` bytes at `remote` into `local[offset..]`. Hot path once
    /// the region's grant is cached.
    pub(crate) fn read(
        &self,
        wr_id: u64,
        local: &MemoryRegion,
        offset: usize,
        len: usize,
        remote: RemoteAddr,
    ) -> Result<()> {
        self.reserve()?;
        if self.link.is_lost() {
            return self.finish(Completion::error(wr_id, Opcode::Read, Status::PeerLost));
        }
        if len > 0 {
            match self.resolve(remote, len as u64, Access::REMOTE_READ) {
                // SAFETY: as in `write`, with the roles of the two ranges swapped.
                Ok(src) => unsafe { std::ptr::copy(src, local.as_ptr().add(offset), len) },
                Err(status) => return self.finish(Completion::error(wr_id, Opcode::Read, status)),
            }
        }
        self.finish(Completion::ok(wr_id, Opcode::Read, len as u32))
    }

    /// See [`crate::Endpoint::peer_view`]. Hot path once the region's grant
    /// is cached.
    pub(crate) fn peer_view(
        &self,
        remote: RemoteAddr,
        len: usize,
    ) -> Option<std::result::Result<PeerView, Status>> {
        Some(self.view(remote, len))
    }

    fn view(&self, remote: RemoteAddr, len: usize) -> std::result::Result<PeerView, Status> {
        if self.link.is_lost() {
            return Err(Status::PeerLost);
        }
        if len == 0 {
            // Like a zero-length read: no rkey is checked.
            return Ok(PeerView::new(
                std::ptr::NonNull::<u8>::dangling().as_ptr(),
                0,
            ));
        }
        self.with_grant(remote.rkey, |g| g.locate_view(remote.addr, len as u64))
            .map(|p| PeerView::new(p, len))
    }

    /// Fetch-and-add on the peer's word at `remote`. Hot path once the
    /// region's grant is cached.
    pub(crate) fn fetch_add(
        &self,
        wr_id: u64,
        local: &MemoryRegion,
        offset: usize,
        remote: RemoteAddr,
        add: u64,
    ) -> Result<()> {
        self.atomic(wr_id, Opcode::FetchAdd, local, offset, remote, |word| {
            word.fetch_add(add, Ordering::SeqCst)
        })
    }

    /// Compare-and-swap on the peer's word at `remote`. Hot path once the
    /// region's grant is cached.
    pub(crate) fn compare_swap(
        &self,
        wr_id: u64,
        local: &MemoryRegion,
        offset: usize,
        remote: RemoteAddr,
        compare: u64,
        swap: u64,
    ) -> Result<()> {
        self.atomic(
            wr_id,
            Opcode::CompareSwap,
            local,
            offset,
            remote,
            |word| match word.compare_exchange(compare, swap, Ordering::SeqCst, Ordering::SeqCst) {
                Ok(old) | Err(old) => old,
            },
        )
    }

    /// The common part of the atomics: the alignment is checked before the
    /// grant, as a NIC rejects a malformed request before looking at keys.
    /// Hot path once the region's grant is cached.
    fn atomic(
        &self,
        wr_id: u64,
        opcode: Opcode,
        local: &MemoryRegion,
        offset: usize,
        remote: RemoteAddr,
        op: impl FnOnce(&AtomicU64) -> u64,
    ) -> Result<()> {
        self.reserve()?;
        if self.link.is_lost() {
            return self.finish(Completion::error(wr_id, opcode, Status::PeerLost));
        }
        if remote.addr % 8 != 0 {
            return self.finish(Completion::error(wr_id, opcode, Status::RemoteOperation));
        }
        let word = match self.resolve(remote, 8, Access::REMOTE_ATOMIC) {
            Ok(word) => word,
            Err(status) => return self.finish(Completion::error(wr_id, opcode, status)),
        };
        // SAFETY: resolve returned 8 in-bounds bytes of a writable mapping
        // (REMOTE_ATOMIC grants are mapped read-write); regions are
        // page-aligned in both address spaces, so the word is 8-byte aligned
        // like `remote.addr`. Every process updates it with atomics only.
        let old = op(unsafe { &*word.cast::<AtomicU64>() });
        // SAFETY: lib.rs checked that local[offset..offset+8] is inside the
        // region and offset is 8-byte aligned (the buffer is page-aligned).
        unsafe { std::ptr::write_volatile(local.as_ptr().add(offset).cast::<u64>(), old) };
        self.finish(Completion::ok(wr_id, opcode, 8))
    }

    /// Posts a receive for the peer's next write-with-immediate. Hot path.
    pub(crate) fn post_recv(&self, wr_id: u64) -> Result<()> {
        self.link.recvs.push(wr_id).map_err(|_| Error::QueueFull {
            what: "the receive queue",
            depth: self.recv_depth,
        })?;
        // A sleeping CQ may now pair a waiting notification, or flush this
        // receive if the peer is gone.
        self.link.cq.wake_if_sleeping();
        Ok(())
    }

    /// The peer, for logs and errors.
    pub(crate) fn peer_addr(&self) -> String {
        self.link.peer.clone()
    }

    /// How many of the peer's regions this endpoint has mapped.
    #[cfg(test)]
    pub(super) fn cached_grants(&self) -> usize {
        self.grants.borrow().len()
    }

    /// Claims a send-queue entry and a completion-queue entry. Hot path.
    #[inline]
    fn reserve(&self) -> Result<()> {
        let outstanding = &self.link.outstanding;
        if outstanding.fetch_add(1, Ordering::AcqRel) >= self.send_depth {
            outstanding.fetch_sub(1, Ordering::AcqRel);
            return Err(Error::QueueFull {
                what: "the send queue",
                depth: self.send_depth,
            });
        }
        if !self.link.cq.reserve() {
            outstanding.fetch_sub(1, Ordering::AcqRel);
            return Err(Error::QueueFull {
                what: "the completion queue",
                depth: self.link.cq.depth(),
            });
        }
        Ok(())
    }

    /// Gives back what [`ShmEndpoint::reserve`] claimed. Hot path.
    #[inline]
    fn unreserve(&self) {
        self.link.cq.unreserve();
        self.link.outstanding.fetch_sub(1, Ordering::AcqRel);
    }

    /// Hands a completion to the CQ (room was reserved). Hot path.
    #[inline]
    fn finish(&self, completion: Completion) -> Result<()> {
        self.link.cq.push(completion, self.slot);
        Ok(())
    }

    /// The peer's current serial for `rkey` (0: not registered). Hot path.
    #[inline]
    fn peer_serial(&self, rkey: u32) -> u64 {
        // SAFETY: peer_validity maps VALIDITY_BYTES bytes (checked at set-up)
        // for as long as self lives.
        unsafe { validity_word(self.peer_validity.as_ptr(), rkey) }.load(Ordering::Acquire)
    }

    /// Translates `len` bytes at `remote` into our mapping of the peer's
    /// region, checking rkey, revocation, bounds and rights.
    ///
    /// Hot path once the region's grant is cached; the first access to an
    /// rkey asks the peer for it (slow path).
    #[inline]
    fn resolve(
        &self,
        remote: RemoteAddr,
        len: u64,
        need: Access,
    ) -> std::result::Result<*mut u8, Status> {
        self.with_grant(remote.rkey, |g| g.locate(remote.addr, len, need))
    }

    /// `f` on the current grant of `rkey` (fetched first if need be);
    /// `RemoteAccess` when there is none, it was revoked, or `f` refuses.
    #[inline]
    fn with_grant<T>(
        &self,
        rkey: u32,
        f: impl FnOnce(&Grant) -> Option<T>,
    ) -> std::result::Result<T, Status> {
        let mut grants = self.grants.borrow_mut();
        if grants.get(rkey).is_none() {
            let grant = self.fetch_grant(rkey)?;
            // Forget regions the peer revoked since, so a peer that keeps
            // registering fresh regions does not grow our mappings forever.
            grants.retain(|g| self.peer_serial(g.rkey) == g.serial);
            grants.insert(grant);
        }
        let serial = self.peer_serial(rkey);
        let located = match grants.get(rkey) {
            Some(grant) if grant.serial == serial => f(grant),
            Some(_) => {
                // Revoked since we mapped it: forget it (slow path, unmaps).
                grants.remove(rkey);
                None
            }
            None => None,
        };
        located.ok_or(Status::RemoteAccess)
    }

    /// Asks the peer for the region `rkey` and maps it. Slow path.
    #[cold]
    fn fetch_grant(&self, rkey: u32) -> std::result::Result<Grant, Status> {
        if self.link.is_lost() {
            return Err(Status::PeerLost);
        }
        let req_id = self.next_req.get().wrapping_add(1);
        self.next_req.set(req_id);
        let request = Control::GrantRequest { req_id, rkey }.encode();
        if self.link.send_control(&request, &[]).is_err() {
            self.link.mark_lost("could not send a grant request");
            return Err(Status::PeerLost);
        }
        let reply = self.link.await_reply(req_id, GRANT_TIMEOUT)?;
        let (Some(info), Some(fd)) = (reply.grant, reply.fd) else {
            return Err(Status::RemoteAccess);
        };
        let page = page_size() as u64;
        // A page-aligned base keeps 8-byte aligned remote words aligned in
        // our mapping too (atomics need it).
        let sane = info.map_len > 0
            && info.base % page == 0
            && info.map_len % page == 0
            && info.len <= info.map_len
            && info.map_len <= u64::from(u32::MAX) + page;
        if !sane {
            tracing::warn!(peer = %self.link.peer, rkey, ?info, "shm: the peer granted an impossible region; refusing it");
            return Err(Status::RemoteAccess);
        }
        if let Err(why) = sys::check_peer_memfd(fd.as_raw_fd(), info.map_len as usize) {
            tracing::warn!(peer = %self.link.peer, rkey, why, "shm: refusing a granted region");
            return Err(Status::RemoteAccess);
        }
        let access = Access::from_bits_truncate(info.access);
        let writable =
            access.contains(Access::REMOTE_WRITE) || access.contains(Access::REMOTE_ATOMIC);
        let map_as = |writable| {
            Mapping::new(fd.as_raw_fd(), info.map_len as usize, writable).map_err(|e| {
                tracing::warn!(peer = %self.link.peer, rkey, error = %e, "shm: cannot map a granted region");
                Status::RemoteAccess
            })
        };
        let map = map_as(writable)?;
        let view_map = match writable && access.contains(Access::REMOTE_READ) {
            true => Some(map_as(false)?),
            false => None,
        };
        Ok(Grant {
            rkey,
            serial: info.serial,
            base: info.base,
            len: info.len,
            access,
            map,
            view_map,
        })
    }
}

impl Drop for ShmEndpoint {
    fn drop(&mut self) {
        // The CQ flushes our receives and forgets us once they are polled;
        // the peer sees the socket hang up and fails its side.
        self.link.closed.store(true, Ordering::Release);
        self.progress.unregister(self.token);
        sys::shutdown(self.link.sock.as_raw_fd());
        self.link.cq.wake();
    }
}

/// Checks the depths a caller asked for.
pub(super) fn check_options(opts: &EndpointOptions) -> Result<()> {
    for (name, value) in [
        ("send_depth", opts.send_depth),
        ("recv_depth", opts.recv_depth),
    ] {
        if value == 0 || value > ring::MAX_CAP as usize {
            return Err(Error::InvalidArgument(format!(
                "EndpointOptions::{name} must be between 1 and {}, not {value}",
                ring::MAX_CAP
            )));
        }
    }
    Ok(())
}

/// Which side of the handshake we are.
pub(super) enum Role<'a> {
    /// We dialled `addr`.
    Connect { addr: &'a str },
    /// We accepted on the listener at `listener`.
    Accept { listener: &'a str },
}

/// The peer's half of the connection, checked and mapped.
struct PeerParts {
    out: Outbound,
    wake: OwnedFd,
    validity: Mapping,
}

/// Checks the peer's hello and descriptors, then maps its ring and table.
fn adopt(
    hello: &Hello,
    fds: Vec<OwnedFd>,
) -> std::result::Result<PeerParts, (RejectReason, String)> {
    if !ring::valid_cap(hello.ring_cap) {
        return Err((
            RejectReason::Malformed,
            format!(
                "the peer announced an immediate ring of {} entries",
                hello.ring_cap
            ),
        ));
    }
    let Ok([ring_fd, wake, validity_fd]) = <[OwnedFd; 3]>::try_from(fds) else {
        return Err((
            RejectReason::Descriptors,
            "the peer did not pass the 3 descriptors of the protocol".into(),
        ));
    };
    let bad = |why: String| (RejectReason::Descriptors, why);
    let ring_len = ring::ring_bytes(hello.ring_cap);
    sys::check_peer_memfd(ring_fd.as_raw_fd(), ring_len).map_err(bad)?;
    sys::check_peer_memfd(validity_fd.as_raw_fd(), VALIDITY_BYTES).map_err(bad)?;
    if !sys::is_socket(wake.as_raw_fd()) {
        return Err(bad("the peer's wake-up descriptor is not a socket".into()));
    }
    let ring_map =
        Mapping::new(ring_fd.as_raw_fd(), ring_len, true).map_err(|e| bad(e.to_string()))?;
    let validity = Mapping::new(validity_fd.as_raw_fd(), VALIDITY_BYTES, false)
        .map_err(|e| bad(e.to_string()))?;
    Ok(PeerParts {
        out: Outbound::new(ring_map, hello.ring_cap),
        wake,
        validity,
    })
}

/// Why a handshake read failed.
enum HelloFailure {
    Io(io::Error),
    Garbage(HelloError),
}

fn read_hello(
    fd: std::os::fd::RawFd,
    deadline: Instant,
) -> std::result::Result<(Hello, Vec<OwnedFd>), HelloFailure> {
    let mut buf = [0u8; MSG_LEN];
    let mut fds = Vec::new();
    sys::recv_exact(fd, &mut buf, &mut fds, deadline).map_err(HelloFailure::Io)?;
    let hello = Hello::decode(&buf).map_err(HelloFailure::Garbage)?;
    Ok((hello, fds))
}

/// Exchanges hellos on a fresh connection and builds the endpoint.
pub(super) fn establish(
    sock: OwnedFd,
    role: Role<'_>,
    domain: &Arc<DomainState>,
    cq: &mut ShmCq,
    opts: &EndpointOptions,
    deadline: Instant,
) -> Result<ShmEndpoint> {
    let (addr, timeout_what) = match role {
        Role::Connect { addr } => (addr, "shm connect"),
        Role::Accept { listener } => (listener, "shm accept"),
    };
    let fail = |reason: String| Error::Connect {
        addr: addr.to_owned(),
        reason,
    };
    let io_fail = |e: io::Error| match e.kind() {
        io::ErrorKind::TimedOut => Error::Timeout(timeout_what),
        io::ErrorKind::UnexpectedEof => {
            fail("the peer closed the connection during the handshake".into())
        }
        _ => fail(format!("the handshake failed: {e}")),
    };

    let cap = ring::ring_cap(opts.recv_depth);
    let inbound = Inbound::new(cap)?;
    let (wake_ours, wake_theirs) = sys::socketpair()?;
    let kind = match role {
        Role::Connect { .. } => HelloKind::Connect,
        Role::Accept { .. } => HelloKind::Accept,
    };
    let ours = Hello {
        kind,
        version: VERSION,
        pid: std::process::id(),
        send_depth: opts.send_depth as u32,
        recv_depth: opts.recv_depth as u32,
        ring_cap: inbound.cap(),
        reason: 0,
    };
    let our_fds = [
        inbound.fd(),
        wake_theirs.as_raw_fd(),
        domain.validity_ro.as_raw_fd(),
    ];
    let fd = sock.as_raw_fd();
    let reject = |reason: RejectReason| {
        let no = Hello {
            kind: HelloKind::Reject,
            reason: reason as u32,
            ..ours
        };
        // Best effort: the peer may already be gone.
        let _ = sys::send_all(fd, &no.encode(), &[], deadline);
    };

    let parts = match role {
        Role::Connect { .. } => {
            sys::send_all(fd, &ours.encode(), &our_fds, deadline).map_err(io_fail)?;
            let (theirs, fds) = match read_hello(fd, deadline) {
                Ok(h) => h,
                Err(HelloFailure::Io(e)) => return Err(io_fail(e)),
                Err(HelloFailure::Garbage(g)) => return Err(fail(g.to_string())),
            };
            match theirs.kind {
                HelloKind::Accept => {}
                HelloKind::Reject => {
                    return Err(fail(RejectReason::describe(theirs.reason).into()))
                }
                HelloKind::Connect => {
                    return Err(fail(
                        "the peer is connecting too, it does not listen".into(),
                    ))
                }
            }
            adopt(&theirs, fds).map_err(|(_, why)| fail(why))?
        }
        Role::Accept { .. } => {
            let (theirs, fds) = match read_hello(fd, deadline) {
                Ok(h) => h,
                Err(HelloFailure::Io(e)) => return Err(io_fail(e)),
                Err(HelloFailure::Garbage(g)) => {
                    if let HelloError::Version(_) = g {
                        reject(RejectReason::Version);
                    }
                    return Err(fail(g.to_string()));
                }
            };
            if theirs.kind != HelloKind::Connect {
                reject(RejectReason::Malformed);
                return Err(fail(format!(
                    "the peer opened with a {:?} hello",
                    theirs.kind
                )));
            }
            let parts = match adopt(&theirs, fds) {
                Ok(parts) => parts,
                Err((reason, why)) => {
                    reject(reason);
                    return Err(fail(why));
                }
            };
            sys::send_all(fd, &ours.encode(), &our_fds, deadline).map_err(io_fail)?;
            parts
        }
    };
    drop(wake_theirs);

    let peer = match role {
        Role::Connect { addr } => addr.to_owned(),
        Role::Accept { listener } => match sys::peer_cred(fd) {
            Some((pid, uid)) => format!("pid {pid} (uid {uid}) on {listener}"),
            None => format!("a peer on {listener}"),
        },
    };
    tracing::debug!(%peer, ring_cap = cap, "shm endpoint connected");
    let link = Arc::new(Link::new(
        sock,
        domain.clone(),
        opts.recv_depth,
        inbound,
        cq.shared().clone(),
        peer,
    ));
    let progress = progress()?;
    let token = progress.register(&link)?;
    let slot = match cq.attach(link.clone(), wake_ours) {
        Ok(slot) => slot,
        Err(e) => {
            progress.unregister(token);
            return Err(e);
        }
    };
    Ok(ShmEndpoint {
        link,
        slot,
        send_depth: opts.send_depth,
        recv_depth: opts.recv_depth,
        out: parts.out,
        peer_wake: parts.wake,
        peer_validity: parts.validity,
        grants: RefCell::new(GrantCache::new()),
        next_req: Cell::new(0),
        progress,
        token,
    })
}

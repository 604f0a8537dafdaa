//! A connected shm endpoint, the data path: the one-sided operations, which
//! copy straight into or out of the peer's granted regions ([`super::grant`]).
//! Connection set-up is in [`super::connect`].

use std::cell::{Cell, RefCell};
use std::fmt;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::domain::validity_word;
use super::grant::{self, Grant, GrantCache};
use super::link::Link;
use super::progress::Progress;
use super::ring::{Outbound, Wake};
use super::sys::{self, Mapping};
use crate::completion::{Completion, Opcode, Status};
use crate::error::{Error, Result};
use crate::memory::{Access, PeerView, RemoteAddr};
use crate::provider::{self, Local, LocalWord, Write, Writes};
use crate::EndpointOptions;
/// Writes of a batch whose immediates are published together (one
/// doorbell) before their completions are pushed.
const PUBLISH_EVERY: usize = 64;

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
    /// Map the peer's file-backed regions too (`EndpointOptions::map_file_regions`).
    map_file_regions: bool,
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
    /// The endpoint of a connection `connect` has set up.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new(
        link: Arc<Link>,
        slot: u32,
        opts: &EndpointOptions,
        out: Outbound,
        peer_wake: OwnedFd,
        peer_validity: Mapping,
        progress: Arc<Progress>,
        token: u64,
    ) -> ShmEndpoint {
        ShmEndpoint {
            link,
            slot,
            send_depth: opts.send_depth,
            recv_depth: opts.recv_depth,
            out,
            peer_wake,
            peer_validity,
            grants: RefCell::new(GrantCache::new()),
            map_file_regions: opts.map_file_regions,
            next_req: Cell::new(0),
            progress,
            token,
        }
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

    /// The common part of the atomics: the alignment is checked before the
    /// grant, as a NIC rejects a malformed request before looking at keys.
    /// Hot path once the region's grant is cached.
    fn atomic(
        &self,
        wr_id: u64,
        opcode: Opcode,
        local: LocalWord<'_>,
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
        // SAFETY: `LocalWord` is 8 bytes inside our region, 8-byte aligned.
        unsafe { std::ptr::write_volatile(local.ptr(), old) };
        self.finish(Completion::ok(wr_id, opcode, 8))
    }

    /// How many of the peer's regions this endpoint has mapped.
    #[cfg(test)]
    pub(super) fn cached_grants(&self) -> usize {
        self.grants.borrow().len()
    }

    /// Claims a send-queue entry and a completion-queue entry. Hot path.
    #[inline]
    fn reserve(&self) -> Result<()> {
        self.reserve_n(1)
    }

    /// Claims `n` send-queue entries and `n` completion-queue entries, all
    /// or none. Hot path.
    #[inline]
    fn reserve_n(&self, n: usize) -> Result<()> {
        let outstanding = &self.link.outstanding;
        if outstanding.fetch_add(n, Ordering::AcqRel) + n > self.send_depth {
            outstanding.fetch_sub(n, Ordering::AcqRel);
            return Err(Error::QueueFull {
                what: "the send queue",
                depth: self.send_depth,
            });
        }
        if !self.link.cq.reserve_n(n) {
            outstanding.fetch_sub(n, Ordering::AcqRel);
            return Err(Error::QueueFull {
                what: "the completion queue",
                depth: self.link.cq.depth(),
            });
        }
        Ok(())
    }

    /// Gives back `n` of what [`ShmEndpoint::reserve_n`] claimed. Hot path.
    #[inline]
    fn unreserve(&self, n: usize) {
        self.link.cq.unreserve(n);
        self.link.outstanding.fetch_sub(n, Ordering::AcqRel);
    }

    /// Copies a write's bytes into the peer's region and, with an
    /// immediate, stages its notification (published by the caller); the
    /// write's completion. Room in the ring was checked. Hot path once the
    /// region's grant is cached.
    #[inline]
    fn place(&self, w: &Write<'_>) -> Completion {
        let len = w.local.len();
        let opcode = if w.imm.is_some() {
            Opcode::WriteWithImm
        } else {
            Opcode::Write
        };
        // Like a NIC, a zero-length write names no memory and checks no rkey.
        if len > 0 {
            match self.resolve(w.remote, len as u64, Access::REMOTE_WRITE) {
                // SAFETY: as in `write`.
                Ok(dst) => unsafe { std::ptr::copy(w.local.ptr(), dst, len) },
                Err(status) => return Completion::error(w.wr_id, opcode, status),
            }
        }
        if let Some(imm) = w.imm {
            self.out.stage(imm, len as u32);
        }
        Completion::ok(w.wr_id, opcode, len as u32)
    }

    /// Wakes the peer as a publish of its ring asks.
    #[inline]
    fn wake_peer(&self, wake: Wake) {
        match wake {
            Wake::No => {}
            Wake::Futex => self.out.wake_futex(),
            Wake::Socket => sys::kick(self.peer_wake.as_raw_fd()),
        }
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
            let req_id = self.next_req.get().wrapping_add(1);
            self.next_req.set(req_id);
            let grant = grant::fetch(&self.link, req_id, rkey, self.map_file_regions)?;
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
}

impl provider::Endpoint for ShmEndpoint {
    /// Writes `local[offset..offset+len]` to `remote`, then, with `imm`,
    /// publishes a notification in the peer's ring. Hot path.
    ///
    /// A full ring returns [`Error::QueueFull`] before anything is copied.
    fn write(&self, w: Write<'_>) -> Result<()> {
        let (wr_id, local, remote, imm) = (w.wr_id, w.local, w.remote, w.imm);
        let len = local.len();
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
            self.unreserve(1);
            return Err(Error::QueueFull {
                what: "the peer's immediate ring (the peer posts too few receives)",
                depth: self.out.cap(),
            });
        }
        if let Some(dst) = dst {
            // SAFETY: `local` holds len bytes of our region (checked by
            // `Local`); resolve checked the remote range against the granted,
            // writable mapping, which the grant cache keeps alive. The peer
            // may touch those bytes concurrently, as with a NIC; we only copy
            // raw bytes.
            unsafe { std::ptr::copy(local.ptr(), dst, len) };
        }
        if let Some(imm) = imm {
            self.wake_peer(self.out.push(imm, len as u32));
        }
        if w.unsignaled {
            // Done, and nothing to tell: the entries go back at once.
            self.unreserve(1);
            return Ok(());
        }
        self.finish(Completion::ok(wr_id, opcode, len as u32))
    }

    /// Copies every write's bytes and stages the immediates in the peer's
    /// ring, then publishes them together: one doorbell, and one wake-up
    /// of a sleeping peer, for up to [`PUBLISH_EVERY`] writes; one look at
    /// whether our own queue's owner sleeps for the batch. Room in the
    /// send queue, the completion queue and the ring is claimed for the
    /// whole batch first. Hot path once the regions' grants are cached.
    fn write_batch(&self, writes: Writes<'_>) -> Result<()> {
        let n = writes.len();
        writes.check_depth(self.send_depth)?;
        self.reserve_n(n)?;
        let cq = &self.link.cq;
        if self.link.is_lost() {
            for w in writes.iter() {
                let opcode = if w.imm.is_some() {
                    Opcode::WriteWithImm
                } else {
                    Opcode::Write
                };
                cq.push_quietly(
                    Completion::error(w.wr_id, opcode, Status::PeerLost),
                    self.slot,
                );
            }
            cq.wake_if_sleeping();
            return Ok(());
        }
        let imms = writes.iter().filter(|w| w.imm.is_some()).count() as u64;
        if imms > 0 && !self.out.has_room_for(imms) {
            self.unreserve(n);
            return Err(Error::QueueFull {
                what: "the peer's immediate ring (the peer posts too few receives)",
                depth: self.out.cap(),
            });
        }
        // A write completes only once its immediate is published. An
        // unsignaled write that succeeded completes not at all: its
        // entries go back at the end.
        let mut done = [Completion::EMPTY; PUBLISH_EVERY];
        let (mut k, mut placed, mut staged, mut silent) = (0, 0, false, 0);
        let mut writes = writes.iter().peekable();
        while let Some(w) = writes.next() {
            let c = self.place(&w);
            let ok = c.status == Status::Success;
            staged |= c.opcode == Opcode::WriteWithImm && ok;
            if ok && w.unsignaled {
                silent += 1;
            } else {
                done[k] = c;
                k += 1;
            }
            placed += 1;
            if placed == PUBLISH_EVERY || writes.peek().is_none() {
                if staged {
                    self.wake_peer(self.out.publish());
                }
                staged = false;
                for c in &done[..k] {
                    cq.push_quietly(*c, self.slot);
                }
                (k, placed) = (0, 0);
            }
        }
        if silent > 0 {
            self.unreserve(silent);
        }
        if silent < n {
            cq.wake_if_sleeping();
        }
        Ok(())
    }

    /// Reads `len` bytes at `remote` into `local[offset..]`. Hot path once
    /// the region's grant is cached.
    fn read(&self, wr_id: u64, local: Local<'_>, remote: RemoteAddr) -> Result<()> {
        let len = local.len();
        self.reserve()?;
        if self.link.is_lost() {
            return self.finish(Completion::error(wr_id, Opcode::Read, Status::PeerLost));
        }
        if len > 0 {
            match self.resolve(remote, len as u64, Access::REMOTE_READ) {
                // SAFETY: as in `write`, with the roles of the two ranges swapped.
                Ok(src) => unsafe { std::ptr::copy(src, local.ptr(), len) },
                Err(status) => return self.finish(Completion::error(wr_id, Opcode::Read, status)),
            }
        }
        self.finish(Completion::ok(wr_id, Opcode::Read, len as u32))
    }

    /// Fetch-and-add on the peer's word at `remote`. Hot path once the
    /// region's grant is cached.
    fn fetch_add(
        &self,
        wr_id: u64,
        local: LocalWord<'_>,
        remote: RemoteAddr,
        add: u64,
    ) -> Result<()> {
        self.atomic(wr_id, Opcode::FetchAdd, local, remote, |word| {
            word.fetch_add(add, Ordering::SeqCst)
        })
    }

    /// Compare-and-swap on the peer's word at `remote`. Hot path once the
    /// region's grant is cached.
    fn compare_swap(
        &self,
        wr_id: u64,
        local: LocalWord<'_>,
        remote: RemoteAddr,
        compare: u64,
        swap: u64,
    ) -> Result<()> {
        self.atomic(
            wr_id,
            Opcode::CompareSwap,
            local,
            remote,
            |word| match word.compare_exchange(compare, swap, Ordering::SeqCst, Ordering::SeqCst) {
                Ok(old) | Err(old) => old,
            },
        )
    }

    /// Posts a receive for the peer's next write-with-immediate. Hot path.
    fn post_recv(&self, wr_id: u64) -> Result<()> {
        self.link.recvs.push(wr_id).map_err(|_| Error::QueueFull {
            what: "the receive queue",
            depth: self.recv_depth,
        })?;
        // A sleeping CQ may now pair a waiting notification, or flush this
        // receive if the peer is gone.
        self.link.cq.wake_if_sleeping();
        Ok(())
    }

    /// See [`crate::Endpoint::peer_view`]. Hot path once the region's grant
    /// is cached.
    fn peer_view(
        &self,
        remote: RemoteAddr,
        len: usize,
    ) -> Option<std::result::Result<PeerView, Status>> {
        Some(self.view(remote, len))
    }

    /// The peer, for logs and errors.
    fn peer_addr(&self) -> String {
        self.link.peer.clone()
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

//! The peer's regions mapped into this process: grants, fetched from the
//! peer on the first access to an rkey and cached per endpoint.

use std::collections::HashMap;
use std::os::fd::AsRawFd;
use std::time::Duration;

use rfaas_proto::shm_control::Control;

use super::link::Link;
use super::sys::{self, Mapping};
use crate::completion::Status;
use crate::memory::{page_size, Access};

/// How long an endpoint waits for the peer's progress thread to answer a
/// grant request before it declares the peer lost.
const GRANT_TIMEOUT: Duration = Duration::from_secs(5);

/// One region of the peer, mapped into our address space.
#[derive(Debug)]
pub(super) struct Grant {
    pub(super) rkey: u32,
    /// Must equal the peer's validity-table word, or the region was revoked.
    pub(super) serial: u64,
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
    pub(super) fn locate(&self, addr: u64, len: u64, need: Access) -> Option<*mut u8> {
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
    pub(super) fn locate_view(&self, addr: u64, len: u64) -> Option<*const u8> {
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
pub(super) struct GrantCache {
    fast: [Option<Grant>; FAST_SLOTS],
    overflow: HashMap<u32, Grant>,
}

impl GrantCache {
    pub(super) fn new() -> GrantCache {
        GrantCache {
            fast: std::array::from_fn(|_| None),
            overflow: HashMap::new(),
        }
    }

    /// Hot path: one indexed compare, no hashing when the slot matches.
    #[inline]
    pub(super) fn get(&self, rkey: u32) -> Option<&Grant> {
        match &self.fast[rkey as usize % FAST_SLOTS] {
            Some(g) if g.rkey == rkey => Some(g),
            _ if self.overflow.is_empty() => None,
            _ => self.overflow.get(&rkey),
        }
    }

    pub(super) fn insert(&mut self, grant: Grant) {
        let slot = &mut self.fast[grant.rkey as usize % FAST_SLOTS];
        if slot.is_none() {
            *slot = Some(grant);
        } else {
            self.overflow.insert(grant.rkey, grant);
        }
    }

    /// Keeps only the grants `live` accepts. Slow path.
    pub(super) fn retain(&mut self, live: impl Fn(&Grant) -> bool) {
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

    pub(super) fn remove(&mut self, rkey: u32) {
        let slot = &mut self.fast[rkey as usize % FAST_SLOTS];
        if slot.as_ref().is_some_and(|g| g.rkey == rkey) {
            *slot = None;
        } else {
            self.overflow.remove(&rkey);
        }
    }
}

/// Asks the peer over `link` for the region `rkey` (request `req_id`) and
/// maps it; a region the peer backs with a regular file instead of a
/// sealed memfd only with `map_files`. Slow path.
#[cold]
pub(super) fn fetch(
    link: &Link,
    req_id: u64,
    rkey: u32,
    map_files: bool,
) -> std::result::Result<Grant, Status> {
    if link.is_lost() {
        return Err(Status::PeerLost);
    }
    let request = Control::GrantRequest { req_id, rkey }.encode();
    if link.send_control(&request, &[]).is_err() {
        link.mark_lost("could not send a grant request");
        return Err(Status::PeerLost);
    }
    let reply = link.await_reply(req_id, GRANT_TIMEOUT)?;
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
        tracing::warn!(peer = %link.peer, rkey, ?info, "shm: the peer granted an impossible region; refusing it");
        return Err(Status::RemoteAccess);
    }
    let checked = sys::check_peer_memfd(fd.as_raw_fd(), info.map_len as usize).or_else(|why| {
        match map_files && sys::is_regular_file(fd.as_raw_fd()) {
            true => sys::check_peer_file(fd.as_raw_fd(), info.map_len as usize),
            false => Err(why),
        }
    });
    if let Err(why) = checked {
        tracing::warn!(peer = %link.peer, rkey, why, "shm: refusing a granted region (a file-backed region needs EndpointOptions::map_file_regions)");
        return Err(Status::RemoteAccess);
    }
    let access = Access::from_bits_truncate(info.access);
    let writable = access.contains(Access::REMOTE_WRITE) || access.contains(Access::REMOTE_ATOMIC);
    let map_as = |writable| {
        Mapping::new(fd.as_raw_fd(), info.map_len as usize, writable).map_err(|e| {
            tracing::warn!(peer = %link.peer, rkey, error = %e, "shm: cannot map a granted region");
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

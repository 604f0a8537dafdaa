//! A protection domain's state: its region table and the validity table
//! peers map to check a region is still registered before each access.

use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use super::sys;
use crate::error::{Error, Result};
use crate::registry::{Registry, SLOTS};

/// Bytes of a validity table: one serial per registry slot.
pub(super) const VALIDITY_BYTES: usize = SLOTS * 8;

/// The validity word of `rkey` in a table at `base`.
///
/// # Safety
///
/// `base` must point to a live, 8-byte aligned table of [`VALIDITY_BYTES`]
/// bytes that outlives the returned reference.
#[inline]
pub(super) unsafe fn validity_word<'a>(base: *const u8, rkey: u32) -> &'a AtomicU64 {
    let index = rkey as usize & (SLOTS - 1);
    // SAFETY: index < SLOTS, so the word lies inside the table (caller's
    // contract); it is only ever accessed atomically, by every process.
    unsafe { &*base.cast::<AtomicU64>().add(index) }
}

/// A protection domain's state, shared with its endpoints' links and its
/// regions' revocation hooks.
#[derive(Debug)]
pub(super) struct DomainState {
    pub registry: Arc<Registry>,
    /// Serial of the live registration in each registry slot (0: none).
    validity: sys::Segment,
    /// The table as a read-only file description, for peers.
    pub validity_ro: OwnedFd,
}

impl DomainState {
    pub(super) fn new() -> Result<Arc<DomainState>> {
        let validity = sys::Segment::new(c"rfaas-shm-validity", VALIDITY_BYTES)?;
        let validity_ro = sys::reopen_read_only(validity.fd()).map_err(|e| {
            Error::io(
                "reopening the shm validity table read-only (is /proc mounted?)",
                e,
            )
        })?;
        Ok(Arc::new(DomainState {
            registry: Registry::new(),
            validity,
            validity_ro,
        }))
    }

    pub(super) fn word(&self, rkey: u32) -> &AtomicU64 {
        // SAFETY: the segment is VALIDITY_BYTES long, page-aligned and lives
        // as long as self.
        unsafe { validity_word(self.validity.as_ptr(), rkey) }
    }

    /// The serial of the live registration in `rkey`'s slot (0: none).
    pub(super) fn serial(&self, rkey: u32) -> u64 {
        self.word(rkey).load(Ordering::Acquire)
    }
}

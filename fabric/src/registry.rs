//! The region table of a software protection domain (tcp and shm providers).
//!
//! The target of a one-sided operation looks the rkey up here on its hot
//! path, so lookups take no lock: an rkey names a slot by its low bits and the
//! slot must still hold exactly that rkey. rkeys are unique in the process, so
//! an rkey of another domain never matches. Deregistration clears the slot,
//! then waits for lookups in flight to leave it before releasing the buffer.
//!
//! An rkey's high bits (its tag) are a process-wide counter passed through a
//! permutation keyed at random when the process starts ([`tag_of`]): unique
//! like the counter, but unpredictable, so an rkey seen in an earlier run, or
//! the next one after an rkey seen now, cannot be guessed from its number.

use std::any::Any;
use std::fmt;
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicPtr, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::memory::{Access, Buffer, Registration};

/// Slots per domain; the low bits of an rkey index them.
pub(crate) const SLOTS: usize = 1024;
const SLOT_BITS: u32 = 10;

/// Process-wide counter of registrations; [`tag_of`] turns it into an rkey's
/// tag, so rkeys never repeat across domains.
static NEXT_TAG: AtomicU32 = AtomicU32::new(1);
/// Bits of an rkey's tag.
const TAG_BITS: u32 = 32 - SLOT_BITS;
/// The key of the tag permutation, drawn from the OS's randomness once per
/// process (std's `RandomState`: SipHash with random keys).
static TAG_KEY: std::sync::OnceLock<std::collections::hash_map::RandomState> =
    std::sync::OnceLock::new();

/// The tag of the `n`-th registration: `n` through a four-round Feistel
/// network over `TAG_BITS` bits whose round function is SipHash with a
/// random key. A permutation, so distinct `n` give distinct tags; keyed,
/// so seeing some tags tells nothing about the others.
fn tag_of(n: u32) -> u32 {
    const HALF: u32 = TAG_BITS / 2;
    const MASK: u32 = (1 << HALF) - 1;
    let key = TAG_KEY.get_or_init(std::collections::hash_map::RandomState::new);
    let (mut left, mut right) = ((n >> HALF) & MASK, n & MASK);
    for round in 0..4u32 {
        let f = key.hash_one((round, right)) as u32 & MASK;
        (left, right) = (right, left ^ f);
    }
    (left << HALF) | right
}

/// A fresh, nonzero tag.
fn next_tag() -> u32 {
    loop {
        let n = NEXT_TAG.fetch_add(1, Ordering::Relaxed) & ((1 << TAG_BITS) - 1);
        let tag = tag_of(n);
        if tag != 0 {
            return tag;
        }
    }
}
/// Process-wide source of domain ids.
static NEXT_DOMAIN: AtomicU64 = AtomicU64::new(1);

/// A fresh protection-domain id, unique in the process (all providers use it).
pub(crate) fn next_domain_id() -> u64 {
    NEXT_DOMAIN.fetch_add(1, Ordering::Relaxed)
}

struct Slot {
    rkey: AtomicU32,
    access: AtomicU32,
    busy: AtomicU32,
    buf: AtomicPtr<Buffer>,
}

/// The regions of one protection domain.
pub(crate) struct Registry {
    id: u64,
    slots: Box<[Slot]>,
}

/// A region found by [`Registry::lookup`]: the buffer (kept alive) and rights.
pub(crate) struct Found {
    pub buf: Arc<Buffer>,
    pub access: Access,
}

impl Registry {
    pub(crate) fn new() -> Arc<Registry> {
        let slots = (0..SLOTS)
            .map(|_| Slot {
                rkey: AtomicU32::new(0),
                access: AtomicU32::new(0),
                busy: AtomicU32::new(0),
                buf: AtomicPtr::new(std::ptr::null_mut()),
            })
            .collect();
        Arc::new(Registry {
            id: next_domain_id(),
            slots,
        })
    }

    /// The domain id (unique in the process).
    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    /// Puts `buf` in a free slot and returns its rkey and the guard that frees it.
    pub(crate) fn insert(
        self: &Arc<Self>,
        buf: Arc<Buffer>,
        access: Access,
    ) -> Result<(u32, SlotGuard)> {
        for (index, slot) in self.slots.iter().enumerate() {
            if slot.buf.load(Ordering::Acquire).is_null() {
                let raw = Arc::into_raw(buf.clone()).cast_mut();
                if slot
                    .buf
                    .compare_exchange(
                        std::ptr::null_mut(),
                        raw,
                        Ordering::AcqRel,
                        Ordering::Acquire,
                    )
                    .is_err()
                {
                    // SAFETY: raw came from Arc::into_raw just above and was not stored.
                    drop(unsafe { Arc::from_raw(raw) });
                    continue;
                }
                let rkey = (next_tag() << SLOT_BITS) | index as u32;
                slot.access.store(access.bits(), Ordering::Relaxed);
                slot.rkey.store(rkey, Ordering::SeqCst);
                return Ok((
                    rkey,
                    SlotGuard {
                        registry: self.clone(),
                        index,
                        on_release: None,
                    },
                ));
            }
        }
        Err(Error::InvalidArgument(format!(
            "the protection domain already holds {SLOTS} regions; deregister some first"
        )))
    }

    /// Finds the region named by `rkey`, if it is registered in this domain.
    ///
    /// Hot path: no lock, no allocation; two atomic updates of the slot.
    #[inline]
    pub(crate) fn lookup(&self, rkey: u32) -> Option<Found> {
        if rkey == 0 {
            return None;
        }
        let slot = &self.slots[(rkey as usize) & (SLOTS - 1)];
        slot.busy.fetch_add(1, Ordering::SeqCst);
        let found = if slot.rkey.load(Ordering::SeqCst) == rkey {
            let raw = slot.buf.load(Ordering::Acquire);
            // SAFETY: while busy > 0 and the rkey still matches, the slot
            // owns one strong count of raw (deregistration clears the rkey,
            // then waits for busy to drop to 0 before releasing it).
            let buf = unsafe {
                Arc::increment_strong_count(raw);
                Arc::from_raw(raw)
            };
            Some(Found {
                buf,
                access: Access::from_bits_truncate(slot.access.load(Ordering::Relaxed)),
            })
        } else {
            None
        };
        slot.busy.fetch_sub(1, Ordering::SeqCst);
        found
    }

    /// Checks an access of `len` bytes at `addr` with `need` rights.
    ///
    /// Hot path. Returns the buffer and the offset into it.
    #[inline]
    pub(crate) fn check(
        &self,
        rkey: u32,
        addr: u64,
        len: u64,
        need: Access,
    ) -> Option<(Arc<Buffer>, usize)> {
        let found = self.lookup(rkey)?;
        if !found.access.contains(need) {
            return None;
        }
        let base = found.buf.as_ptr() as u64;
        let offset = addr.checked_sub(base)?;
        let end = offset.checked_add(len)?;
        if end > found.buf.len() as u64 {
            return None;
        }
        Some((found.buf, offset as usize))
    }

    fn remove(&self, index: usize) {
        let slot = &self.slots[index];
        slot.rkey.store(0, Ordering::SeqCst);
        while slot.busy.load(Ordering::SeqCst) != 0 {
            std::hint::spin_loop();
        }
        let raw = slot.buf.swap(std::ptr::null_mut(), Ordering::AcqRel);
        if !raw.is_null() {
            // SAFETY: the slot held one strong count from Arc::into_raw; no
            // lookup can see the slot any more (rkey cleared, busy drained).
            drop(unsafe { Arc::from_raw(raw) });
        }
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        for index in 0..self.slots.len() {
            self.remove(index);
        }
    }
}

impl fmt::Debug for Registry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Registry").field("id", &self.id).finish()
    }
}

/// Frees a slot when the region is dropped.
pub(crate) struct SlotGuard {
    registry: Arc<Registry>,
    index: usize,
    /// Runs first when the region is deregistered (the shm provider revokes
    /// its peers' mappings this way).
    on_release: Option<Box<dyn FnOnce() + Send + Sync>>,
}

impl SlotGuard {
    /// Runs `hook` when the region is deregistered, before its slot is freed.
    pub(crate) fn on_release(mut self, hook: Box<dyn FnOnce() + Send + Sync>) -> SlotGuard {
        self.on_release = Some(hook);
        self
    }
}

impl Registration for SlotGuard {
    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl Drop for SlotGuard {
    fn drop(&mut self) {
        if let Some(hook) = self.on_release.take() {
            hook();
        }
        self.registry.remove(self.index);
    }
}

/// Registers `buf` in `registry` (tcp and shm domains).
pub(crate) fn register_soft(
    registry: &Arc<Registry>,
    buf: Buffer,
    access: Access,
) -> Result<crate::MemoryRegion> {
    let buf = Arc::new(buf);
    let (rkey, guard) = registry.insert(buf.clone(), access)?;
    Ok(crate::MemoryRegion {
        buf,
        rkey,
        lkey: rkey,
        access,
        domain_id: registry.id(),
        _registration: Box::new(guard),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_are_distinct_and_not_the_counter() {
        let tags: std::collections::HashSet<u32> = (0..1 << 16).map(tag_of).collect();
        assert_eq!(tags.len(), 1 << 16, "the permutation repeated a tag");
        assert!(tags.iter().all(|t| *t < 1 << TAG_BITS));
        let in_order = (1..64).filter(|n| tag_of(*n) == *n).count();
        assert!(
            in_order < 4,
            "{in_order} of 63 tags are their counter: not permuted"
        );
    }
}

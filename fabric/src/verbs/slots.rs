//! The table of outstanding work requests of one completion queue.
//!
//! A work completion of an error carries only `wr_id`, `status` and
//! `qp_num`: its opcode is undefined. So every posted work request takes a
//! slot here, and the `wr_id` given to the NIC names the slot (index in the
//! low 32 bits, generation in the high 32 bits). The slot remembers the
//! caller's `wr_id`, the operation, its length, and keeps alive what the NIC
//! may still touch: the local [`Buffer`] and the connection's shared state.
//!
//! The table belongs to the completion queue, not to the queue pair, because
//! completions of a queue pair may still sit in the CQ after the queue pair
//! is gone; they must still name valid memory. There are exactly as many
//! slots as the CQ has entries, so the CQ can never overrun: a post that finds
//! no free slot fails with [`crate::Error::QueueFull`] instead.
//!
//! Releasing a slot is a compare-and-swap on its tag (generation and busy
//! bit), so the poller and an endpoint being dropped (which reclaims the slots
//! of its destroyed queue pair) cannot both release it; a completion naming a
//! reclaimed slot carries an old generation and is discarded.
//!
//! Hot path: acquire and release are a few atomic operations; no lock, no
//! allocation.

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crossbeam_queue::ArrayQueue;

use super::fate::ConnShared;
use crate::completion::Opcode;
use crate::memory::Buffer;

/// What a slot remembers about one outstanding work request.
pub(crate) struct SlotData {
    /// The caller's work-request id.
    pub(crate) wr_id: u64,
    /// The operation posted.
    pub(crate) opcode: Opcode,
    /// Bytes the operation moves (reported in the completion of sends).
    pub(crate) len: u32,
    /// The local buffer the NIC reads or writes (None for inline data and
    /// receives); held, never read, until the completion is polled.
    #[allow(dead_code)]
    pub(crate) buf: Option<Arc<Buffer>>,
    /// The connection, for its fate (peer lost or closed locally).
    pub(crate) conn: Option<Arc<ConnShared>>,
    /// An unsignaled write: its success is not reported.
    pub(crate) quiet: bool,
    /// The NIC `wr_id` of the work request posted just before this one on
    /// the same queue pair without `IBV_SEND_SIGNALED`, if any. Send
    /// queues complete in order, so this one's completion proves that one
    /// done, and it (and the one it covers, and so on) is released with
    /// it: see [`SlotTable::release_covered`].
    pub(crate) covers: Option<u64>,
}

impl SlotData {
    pub(crate) const EMPTY: SlotData = SlotData {
        wr_id: 0,
        opcode: Opcode::Write,
        len: 0,
        buf: None,
        conn: None,
        quiet: false,
        covers: None,
    };
}

struct Slot {
    /// `generation << 1 | busy`.
    tag: AtomicU64,
    /// Which endpoint posted the request (valid while busy).
    owner: AtomicU64,
    /// Written only by whoever holds the slot: the poster between taking the
    /// index from the free list and publishing the busy tag, the releaser
    /// after winning the compare-and-swap on the tag.
    data: UnsafeCell<SlotData>,
}

/// Outstanding work requests of one completion queue.
pub(crate) struct SlotTable {
    slots: Box<[Slot]>,
    free: ArrayQueue<u32>,
}

// SAFETY: `data` is only touched by the single thread that owns the slot at
// that moment (see `Slot::data`); ownership passes through the free list
// (whose push/pop synchronise) and the tag (Release store / AcqRel CAS).
// Everything else is atomic.
unsafe impl Sync for SlotTable {}
// SAFETY: SlotData holds Arcs of Send + Sync types and plain values.
unsafe impl Send for SlotTable {}

const BUSY: u64 = 1;

fn tag(generation: u32, busy: bool) -> u64 {
    (u64::from(generation) << 1) | u64::from(busy)
}

/// The `wr_id` handed to the NIC for slot `index` in `generation`.
fn encode(index: u32, generation: u32) -> u64 {
    (u64::from(generation) << 32) | u64::from(index)
}

fn decode(raw: u64) -> (usize, u32) {
    ((raw & 0xffff_ffff) as usize, (raw >> 32) as u32)
}

impl SlotTable {
    /// A table of `capacity` free slots.
    pub(crate) fn new(capacity: usize) -> SlotTable {
        let capacity = capacity.max(1);
        let slots = (0..capacity)
            .map(|_| Slot {
                tag: AtomicU64::new(tag(0, false)),
                owner: AtomicU64::new(0),
                data: UnsafeCell::new(SlotData::EMPTY),
            })
            .collect();
        let free = ArrayQueue::new(capacity);
        for index in 0..capacity {
            // Cannot fail: the queue has exactly `capacity` places.
            let _ = free.push(index as u32);
        }
        SlotTable { slots, free }
    }

    /// Number of slots.
    pub(crate) fn capacity(&self) -> usize {
        self.slots.len()
    }

    /// Takes a free slot for a request of `owner`; returns the `wr_id` to post,
    /// or None when every slot is in use. Hot path.
    #[inline]
    pub(crate) fn acquire(&self, owner: u64, data: SlotData) -> Option<u64> {
        let index = self.free.pop()?;
        let slot = &self.slots[index as usize];
        let generation = (slot.tag.load(Ordering::Relaxed) >> 1) as u32;
        // SAFETY: the index came off the free list, so this thread is the
        // only one that may touch the slot's data until it publishes BUSY.
        unsafe { *slot.data.get() = data };
        slot.owner.store(owner, Ordering::Relaxed);
        slot.tag.store(tag(generation, true), Ordering::Release);
        Some(encode(index, generation))
    }

    /// Frees the slot a completion (or a failed post) names and returns what
    /// it held; None if the `wr_id` is stale (the slot was reclaimed). Hot path.
    #[inline]
    pub(crate) fn release(&self, raw_wr_id: u64) -> Option<SlotData> {
        let (index, generation) = decode(raw_wr_id);
        let slot = self.slots.get(index)?;
        slot.tag
            .compare_exchange(
                tag(generation, true),
                tag(generation.wrapping_add(1), false),
                Ordering::AcqRel,
                Ordering::Relaxed,
            )
            .ok()?;
        // SAFETY: winning the CAS made this thread the slot's only owner; the
        // Acquire half synchronises with the poster's Release store.
        let data = unsafe { std::mem::replace(&mut *slot.data.get(), SlotData::EMPTY) };
        // Cannot fail: at most `capacity` indices exist.
        let _ = self.free.push(index as u32);
        Some(data)
    }

    /// Releases the unsignaled work requests a completion's slot covers,
    /// newest first, and counts them polled on their connection. They
    /// succeeded: a failure would have completed on its own, before the
    /// covering one. The walk ends at a slot already released, whose own
    /// release walked on from there. Returns how many. Hot path.
    #[inline]
    pub(crate) fn release_covered(&self, mut covers: Option<u64>) -> usize {
        let mut released = 0;
        while let Some(raw) = covers {
            let Some(data) = self.release(raw) else { break };
            if let Some(conn) = &data.conn {
                conn.send_polled();
            }
            covers = data.covers;
            released += 1;
        }
        released
    }

    /// Frees every slot `owner` still holds (its queue pair is destroyed, so
    /// no completion will release them; any still queued become stale).
    /// Returns how many were reclaimed.
    pub(crate) fn reclaim(&self, owner: u64) -> usize {
        let mut reclaimed = 0;
        for (index, slot) in self.slots.iter().enumerate() {
            let current = slot.tag.load(Ordering::Acquire);
            if current & BUSY == 0 || slot.owner.load(Ordering::Relaxed) != owner {
                continue;
            }
            // If the slot changed hands since the load, the generation moved
            // on and the release below fails harmlessly.
            let generation = (current >> 1) as u32;
            if self.release(encode(index as u32, generation)).is_some() {
                reclaimed += 1;
            }
        }
        reclaimed
    }

    /// Slots in use (for diagnostics and tests; racy by nature).
    pub(crate) fn in_use(&self) -> usize {
        self.capacity() - self.free.len()
    }
}

impl std::fmt::Debug for SlotTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SlotTable")
            .field("capacity", &self.capacity())
            .field("in_use", &self.in_use())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(wr_id: u64, opcode: Opcode) -> SlotData {
        SlotData {
            wr_id,
            opcode,
            len: 8,
            buf: None,
            conn: None,
            quiet: false,
            covers: None,
        }
    }

    /// A write posted after the unsignaled one `covers` names.
    fn after(wr_id: u64, covers: u64) -> SlotData {
        SlotData {
            covers: Some(covers),
            ..data(wr_id, Opcode::Write)
        }
    }

    #[test]
    fn a_completion_releases_the_unsignaled_requests_it_covers_and_no_more() {
        let table = SlotTable::new(8);
        let earlier = table.acquire(1, data(1, Opcode::Write)).unwrap();
        let a = table.acquire(1, data(2, Opcode::Write)).unwrap();
        let b = table.acquire(1, after(3, a)).unwrap();
        let tail = table.acquire(1, after(4, b)).unwrap();
        let covers = table.release(tail).unwrap().covers;
        assert_eq!(table.release_covered(covers), 2);
        assert!(table.release(a).is_none() && table.release(b).is_none());
        assert_eq!(table.in_use(), 1, "the request before the chain stays");
        assert_eq!(table.release(earlier).unwrap().wr_id, 1);
    }

    #[test]
    fn a_walk_stops_at_a_slot_released_on_its_own() {
        let table = SlotTable::new(8);
        let a = table.acquire(1, data(1, Opcode::Write)).unwrap();
        let b = table.acquire(1, after(2, a)).unwrap();
        // b failed and completed on its own: its release walked to a.
        let covers = table.release(b).unwrap().covers;
        assert_eq!(table.release_covered(covers), 1);
        // The slot a held is taken again; a stale link must not free it.
        let again = table.acquire(1, data(9, Opcode::Write)).unwrap();
        assert_eq!(table.release_covered(Some(a)), 0);
        assert_eq!(table.release(again).unwrap().wr_id, 9);
    }

    #[test]
    fn acquire_release_round_trip_keeps_wr_id_and_opcode() {
        let table = SlotTable::new(4);
        let raw = table.acquire(1, data(42, Opcode::FetchAdd)).unwrap();
        assert_eq!(table.in_use(), 1);
        let back = table.release(raw).unwrap();
        assert_eq!(
            (back.wr_id, back.opcode, back.len),
            (42, Opcode::FetchAdd, 8)
        );
        assert_eq!(table.in_use(), 0);
    }

    #[test]
    fn full_table_refuses_and_recovers() {
        let table = SlotTable::new(2);
        let a = table.acquire(1, data(1, Opcode::Write)).unwrap();
        let _b = table.acquire(1, data(2, Opcode::Write)).unwrap();
        assert!(table.acquire(1, data(3, Opcode::Write)).is_none());
        table.release(a).unwrap();
        assert!(table.acquire(1, data(3, Opcode::Write)).is_some());
    }

    #[test]
    fn a_completion_is_released_once() {
        let table = SlotTable::new(2);
        let raw = table.acquire(1, data(7, Opcode::Read)).unwrap();
        assert!(table.release(raw).is_some());
        assert!(
            table.release(raw).is_none(),
            "a second release of the same wr_id is stale"
        );
    }

    #[test]
    fn reclaim_frees_only_the_owner_and_makes_its_completions_stale() {
        let table = SlotTable::new(8);
        let mine: Vec<u64> = (0..3)
            .map(|i| table.acquire(10, data(i, Opcode::Write)).unwrap())
            .collect();
        let theirs = table.acquire(20, data(99, Opcode::Write)).unwrap();
        assert_eq!(table.reclaim(10), 3);
        assert_eq!(table.in_use(), 1);
        for raw in mine {
            assert!(
                table.release(raw).is_none(),
                "completions of a reclaimed slot are stale"
            );
        }
        assert_eq!(table.release(theirs).unwrap().wr_id, 99);
    }

    #[test]
    fn a_reused_slot_does_not_answer_to_its_old_wr_id() {
        let table = SlotTable::new(1);
        let old = table.acquire(1, data(1, Opcode::Write)).unwrap();
        table.release(old).unwrap();
        let new = table.acquire(1, data(2, Opcode::Write)).unwrap();
        assert_ne!(old, new, "same index, next generation");
        assert!(table.release(old).is_none());
        assert_eq!(table.release(new).unwrap().wr_id, 2);
    }

    #[test]
    fn garbage_wr_ids_are_ignored() {
        let table = SlotTable::new(2);
        assert!(table.release(u64::MAX).is_none());
        assert!(table.release(encode(1, 5)).is_none());
    }

    #[test]
    fn posters_pollers_and_reclaimers_agree_under_contention() {
        let table = Arc::new(SlotTable::new(64));
        let rounds = 20_000;
        let posters: Vec<_> = (0..2u64)
            .map(|owner| {
                let table = table.clone();
                std::thread::spawn(move || {
                    let mut posted = Vec::new();
                    let mut released = 0u64;
                    for i in 0..rounds {
                        if let Some(raw) = table.acquire(owner, data(i, Opcode::Write)) {
                            posted.push(raw);
                        }
                        if posted.len() > 8 {
                            let raw = posted.remove(0);
                            if table.release(raw).is_some() {
                                released += 1;
                            }
                        }
                        if i % 1000 == 0 {
                            table.reclaim(owner);
                        }
                    }
                    for raw in posted {
                        let _ = table.release(raw);
                    }
                    table.reclaim(owner);
                    released
                })
            })
            .collect();
        for poster in posters {
            assert!(poster.join().unwrap() > 0);
        }
        assert_eq!(table.in_use(), 0, "every slot came back exactly once");
        let mut all = Vec::new();
        while let Some(raw) = table.acquire(3, data(0, Opcode::Write)) {
            all.push(raw);
        }
        assert_eq!(all.len(), 64, "no index was lost or duplicated");
    }
}

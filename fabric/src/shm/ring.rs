//! The immediate ring: one per connection direction, in a memfd the
//! receiving side creates and the sending side maps.
//!
//! Single producer (the peer's endpoint), single consumer (our completion
//! queue). Layout, each doorbell on its own cache line:
//!
//! | offset | field | written by |
//! |---|---|---|
//! | 0 | `tail`: notifications published | producer |
//! | 64 | `head`: notifications consumed | consumer |
//! | 128 | `sleeping`: 0 (awake), or how the consumer's CQ is about to sleep: 1 on its wake-up socket, 2 on `futex` | consumer sets, producer clears |
//! | 132 | `futex`: a 32-bit futex word, bumped before each futex wake-up | producer |
//! | 192 | `cap` entries of 8 bytes: `imm` (low half) and `byte_len` (high half) | producer |
//!
//! Counters grow forever (u64) and index the entries modulo `cap`, a power
//! of two. The producer writes the entry, then publishes `tail` with release
//! ordering, so the consumer that reads `tail` with acquire ordering sees the
//! entry and the bytes of the write before it.
//!
//! Both wake-up words are in the ring the producer was given, so a hostile
//! producer that scribbles on them only causes spurious wake-ups of the
//! consumer or loses its own.

use std::cell::Cell;
use std::mem::size_of;
use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};

use super::sys::{self, Mapping, Segment};
use crate::error::Result;

#[repr(C, align(64))]
struct Line<T>(T);

/// The consumer's announcement and the futex word it sleeps on.
#[repr(C)]
struct WakeWords {
    sleeping: AtomicU32,
    futex: AtomicU32,
}

#[repr(C)]
struct Header {
    tail: Line<AtomicU64>,
    head: Line<AtomicU64>,
    wake: Line<WakeWords>,
}

/// `sleeping`: the consumer does not sleep.
pub(super) const AWAKE: u32 = 0;
/// `sleeping`: the consumer sleeps in `epoll_wait` on its wake-up socket.
pub(super) const SLEEP_SOCKET: u32 = 1;
/// `sleeping`: the consumer sleeps in `futex_waitv` on the ring's `futex` word.
pub(super) const SLEEP_FUTEX: u32 = 2;

/// What a producer must do after publishing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Wake {
    /// Nothing: the consumer is awake.
    No,
    /// Bump the futex word and wake it ([`Outbound::wake_futex`]).
    Futex,
    /// Send a byte on the consumer's wake-up socket.
    Socket,
}

const ENTRIES: usize = size_of::<Header>();

/// Largest ring a peer may ask us to map.
pub(super) const MAX_CAP: u32 = 1 << 20;

/// Bytes of a ring of `cap` entries.
pub(super) fn ring_bytes(cap: u32) -> usize {
    ENTRIES + cap as usize * 8
}

/// Capacity of the ring that holds up to `recv_depth` notifications.
pub(super) fn ring_cap(recv_depth: usize) -> u32 {
    (recv_depth.clamp(16, MAX_CAP as usize)).next_power_of_two() as u32
}

/// Whether `cap` is a capacity a peer may announce.
pub(super) fn valid_cap(cap: u32) -> bool {
    cap.is_power_of_two() && cap <= MAX_CAP
}

fn header(base: *mut u8) -> *const Header {
    base.cast_const().cast()
}

/// Our inbound ring, read by the completion queue.
#[derive(Debug)]
pub(super) struct Inbound {
    seg: Segment,
    cap: u64,
}

impl Inbound {
    pub(super) fn new(cap: u32) -> Result<Inbound> {
        let seg = Segment::new(c"rfaas-shm-ring", ring_bytes(cap))?;
        Ok(Inbound {
            seg,
            cap: u64::from(cap),
        })
    }

    pub(super) fn cap(&self) -> u32 {
        self.cap as u32
    }

    pub(super) fn fd(&self) -> std::os::fd::RawFd {
        self.seg.fd()
    }

    fn header(&self) -> &Header {
        // SAFETY: the segment is at least ring_bytes(cap) long, page-aligned
        // (so 64-byte aligned), lives as long as self, and Header holds only
        // atomics, which may be shared with the peer process.
        unsafe { &*header(self.seg.as_ptr()) }
    }

    /// How many notifications follow `head`; `None` if the producer wrote
    /// an impossible tail (a corrupt or hostile peer). Hot path.
    #[inline]
    pub(super) fn ready(&self, head: u64) -> Option<u64> {
        let tail = self.header().tail.0.load(Ordering::Acquire);
        let n = tail.wrapping_sub(head);
        (n <= self.cap).then_some(n)
    }

    /// The notification at `head`, as `(imm, byte_len)`. Hot path.
    #[inline]
    pub(super) fn entry(&self, head: u64) -> (u32, u32) {
        let index = (head & (self.cap - 1)) as usize;
        // SAFETY: index < cap, so the entry lies inside the segment; it is
        // 8-byte aligned (ENTRIES is a multiple of 64) and only ever accessed
        // atomically.
        let word = unsafe {
            &*self
                .seg
                .as_ptr()
                .add(ENTRIES + index * 8)
                .cast::<AtomicU64>()
        };
        let e = word.load(Ordering::Relaxed);
        (e as u32, (e >> 32) as u32)
    }

    /// Frees the entries before `head` for the producer. Hot path.
    #[inline]
    pub(super) fn release(&self, head: u64) {
        self.header().head.0.store(head, Ordering::Release);
    }

    /// Tells the producer whether and how our CQ sleeps ([`AWAKE`],
    /// [`SLEEP_SOCKET`] or [`SLEEP_FUTEX`]). The caller issues the SeqCst
    /// fence after announcing.
    #[inline]
    pub(super) fn set_sleeping(&self, how: u32) {
        self.header().wake.0.sleeping.store(how, Ordering::Relaxed);
    }

    /// The futex word the producer bumps before waking us (shared with the
    /// producer's process: never wait on it as a private futex).
    #[inline]
    pub(super) fn futex(&self) -> &AtomicU32 {
        &self.header().wake.0.futex
    }
}

/// The peer's inbound ring, written by our endpoint.
#[derive(Debug)]
pub(super) struct Outbound {
    map: Mapping,
    cap: u64,
    /// Our copy of `tail` (we are the only writer).
    tail: Cell<u64>,
    /// The last `head` we read; refreshed only when the ring looks full.
    head_seen: Cell<u64>,
}

impl Outbound {
    /// `map` must be at least `ring_bytes(cap)` long and `cap` valid.
    pub(super) fn new(map: Mapping, cap: u32) -> Outbound {
        assert!(valid_cap(cap) && map.len() >= ring_bytes(cap));
        Outbound {
            map,
            cap: u64::from(cap),
            tail: Cell::new(0),
            head_seen: Cell::new(0),
        }
    }

    pub(super) fn cap(&self) -> usize {
        self.cap as usize
    }

    fn header(&self) -> &Header {
        // SAFETY: the mapping is at least ring_bytes(cap) long (checked in
        // new), page-aligned, lives as long as self, and Header holds only atomics.
        unsafe { &*header(self.map.as_ptr()) }
    }

    /// Whether one more notification fits. Hot path.
    #[inline]
    pub(super) fn has_room(&self) -> bool {
        self.has_room_for(1)
    }

    /// Whether `n` more notifications fit. Hot path.
    #[inline]
    pub(super) fn has_room_for(&self, n: u64) -> bool {
        let tail = self.tail.get();
        if tail.wrapping_sub(self.head_seen.get()) + n <= self.cap {
            return true;
        }
        let head = self.header().head.0.load(Ordering::Acquire);
        // A head beyond our tail is the consumer's corruption: treat as full.
        if tail.wrapping_sub(head) > self.cap {
            return false;
        }
        self.head_seen.set(head);
        tail.wrapping_sub(head) + n <= self.cap
    }

    /// Publishes a notification (call [`Outbound::has_room`] first).
    /// Returns how to wake the consumer if it announced it sleeps. Hot path:
    /// no syscall.
    #[inline]
    pub(super) fn push(&self, imm: u32, byte_len: u32) -> Wake {
        self.stage(imm, byte_len);
        self.publish()
    }

    /// Writes a notification after those staged before it, unseen by the
    /// consumer until [`Outbound::publish`] (call
    /// [`Outbound::has_room_for`] first, for all to be staged). Hot path.
    #[inline]
    pub(super) fn stage(&self, imm: u32, byte_len: u32) {
        let tail = self.tail.get();
        let index = (tail & (self.cap - 1)) as usize;
        // SAFETY: index < cap, inside the mapping (checked in new); 8-byte
        // aligned; accessed atomically only.
        let word = unsafe {
            &*self
                .map
                .as_ptr()
                .add(ENTRIES + index * 8)
                .cast::<AtomicU64>()
        };
        word.store(
            u64::from(imm) | (u64::from(byte_len) << 32),
            Ordering::Relaxed,
        );
        self.tail.set(tail.wrapping_add(1));
    }

    /// Publishes the notifications staged so far, all at once: one
    /// doorbell. Returns how to wake the consumer if it announced it
    /// sleeps. Hot path: no syscall.
    #[inline]
    pub(super) fn publish(&self) -> Wake {
        let h = self.header();
        h.tail.0.store(self.tail.get(), Ordering::Release);
        // Pairs with the consumer's fence between announcing sleep and its
        // last look at `tail`: either it sees our entry or we see its flag.
        fence(Ordering::SeqCst);
        let sleeping = &h.wake.0.sleeping;
        if sleeping.load(Ordering::Relaxed) == AWAKE {
            return Wake::No;
        }
        match sleeping.swap(AWAKE, Ordering::AcqRel) {
            AWAKE => Wake::No,
            SLEEP_FUTEX => Wake::Futex,
            // SLEEP_SOCKET, or garbage the consumer wrote into its own ring.
            _ => Wake::Socket,
        }
    }

    /// Wakes a consumer that sleeps on the ring's futex word ([`Wake::Futex`]).
    /// Warm path: one syscall.
    #[inline]
    pub(super) fn wake_futex(&self) {
        let word = &self.header().wake.0.futex;
        // Release: a consumer that reads the new value also sees our entry.
        word.fetch_add(1, Ordering::Release);
        sys::futex_wake(word, false);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_puts_doorbells_on_their_own_cache_lines() {
        assert_eq!(std::mem::offset_of!(Header, head), 64);
        assert_eq!(std::mem::offset_of!(Header, wake), 128);
        assert_eq!(std::mem::offset_of!(WakeWords, futex), 4);
        assert_eq!(ENTRIES, 192);
        assert_eq!(ring_cap(1), 16);
        assert_eq!(ring_cap(256), 256);
        assert_eq!(ring_cap(300), 512);
    }

    #[test]
    fn a_sleeping_consumer_is_woken_the_way_it_announced() {
        let inbound = Inbound::new(16).unwrap();
        let map = Mapping::new(inbound.fd(), ring_bytes(16), true).unwrap();
        let out = Outbound::new(map, 16);
        assert_eq!(out.push(1, 1), Wake::No);
        inbound.set_sleeping(SLEEP_FUTEX);
        assert_eq!(out.push(2, 2), Wake::Futex);
        // The announcement is consumed: one wake-up per sleep.
        assert_eq!(out.push(3, 3), Wake::No);
        let before = inbound.futex().load(Ordering::Relaxed);
        out.wake_futex();
        assert_eq!(
            inbound.futex().load(Ordering::Relaxed),
            before.wrapping_add(1)
        );
        inbound.set_sleeping(SLEEP_SOCKET);
        assert_eq!(out.push(4, 4), Wake::Socket);
        // Garbage in the consumer's own ring: the old behaviour, a kick.
        inbound.set_sleeping(7);
        assert_eq!(out.push(5, 5), Wake::Socket);
        assert_eq!(inbound.ready(0), Some(5));
    }

    #[test]
    fn staged_notifications_appear_together_when_published() {
        let inbound = Inbound::new(16).unwrap();
        let map = Mapping::new(inbound.fd(), ring_bytes(16), true).unwrap();
        let out = Outbound::new(map, 16);
        assert!(out.has_room_for(16));
        assert!(!out.has_room_for(17));
        out.stage(1, 10);
        out.stage(2, 20);
        out.stage(3, 30);
        assert_eq!(
            inbound.ready(0),
            Some(0),
            "nothing is seen before publishing"
        );
        inbound.set_sleeping(SLEEP_FUTEX);
        assert_eq!(out.publish(), Wake::Futex, "one wake-up for the three");
        assert_eq!(inbound.ready(0), Some(3));
        assert_eq!(
            [inbound.entry(0), inbound.entry(1), inbound.entry(2)],
            [(1, 10), (2, 20), (3, 30)]
        );
        assert!(out.has_room_for(13));
        assert!(!out.has_room_for(14), "unconsumed entries take room");
        inbound.release(3);
        assert!(out.has_room_for(16));
    }

    #[test]
    fn ring_wraps_and_reports_full() {
        let inbound = Inbound::new(16).unwrap();
        let map = Mapping::new(inbound.fd(), ring_bytes(16), true).unwrap();
        let out = Outbound::new(map, 16);
        let mut head = 0u64;
        for round in 0..5u32 {
            for i in 0..16 {
                assert!(out.has_room());
                out.push(round * 100 + i, i);
            }
            assert!(!out.has_room());
            assert_eq!(inbound.ready(head), Some(16));
            for i in 0..16 {
                assert_eq!(inbound.entry(head), (round * 100 + i, i));
                head += 1;
            }
            inbound.release(head);
            assert!(out.has_room());
        }
    }
}

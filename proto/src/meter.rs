//! The meter area: shared memory in which a worker's lanes publish what
//! they did (invocations, time serving requests, hot-polling, blocked
//! waiting, bytes) for the executor daemon to read.
//!
//! The daemon makes the area (a memfd sealed against shrinking and growing),
//! writes its [`AreaHeader`], and passes it to the worker with the
//! assignment; the worker maps it and each lane thread is the only writer of
//! its own [`LaneRecord`]. The daemon reads the records whenever it wants a
//! live total. It never writes them, and it never trusts them: the worker
//! runs user code that can write anything here (see the executor's
//! `daemon::usage` for what the daemon makes of them). The area never
//! leaves the node, so integers are in the machine's byte order.
//!
//! ```text
//!  0              128            256                 128 + 128 * lanes
//!  +--------------+--------------+-----+-------------+
//!  | header       | lane 0       | ... | lane n - 1  |
//!  +--------------+--------------+-----+-------------+
//! ```
//!
//! Header, [`HEADER_LEN`] bytes, written once by the daemon but for
//! `crashed`:
//!
//! | offset | field | |
//! |---|---|---|
//! | 0 | magic | `RFAASMTR` |
//! | 8 | version | u16, [`VERSION`] |
//! | 10 | lanes | u16, records that follow |
//! | 12 | clock | u16, a [`Clock`] code: what a tick is |
//! | 14 | reserved | u16, 0 |
//! | 16 | ticks_per_sec | u64, the clock's rate as the daemon measured it (for people; the daemon keeps its own copy) |
//! | 24 | crashed | u64, 0; the signal of a function's crash, which the worker stores ([`CRASHED_OFFSET`]) before it answers `function_crashed` and dies, so the daemon knows the worker is ending before it reaps it |
//! | 32 | reserved | zeros up to 128 |
//!
//! Lane record, [`RECORD_LEN`] bytes (two cache lines, so the records of
//! two lanes never share a line, nor a pair of lines the prefetcher moves
//! together), every field an aligned `u64`:
//!
//! | offset | field | |
//! |---|---|---|
//! | 0 | seq | even when the record is consistent, odd while the lane writes it |
//! | 8 | state | a [`LaneState`] code: what the lane does since `since` |
//! | 16 | since | ticks: when the lane entered `state` |
//! | 24 | invocations | functions called |
//! | 32 | compute | ticks serving requests (the function, and the lane's handling around it), phases ended |
//! | 40 | hot | ticks polling (hot lanes, between requests), phases ended |
//! | 48 | warm | ticks blocked waiting for requests (warm lanes), phases ended |
//! | 56 | bytes_in | input bytes handed to the function |
//! | 64 | bytes_out | output bytes the function returned |
//! | 72 | reserved | zeros up to 128 |
//!
//! The counters hold finished phases only; the phase under way is `state`
//! since `since`, so a reader's live total of, say, hot ticks is `hot +
//! (now - since)` while `state` is [`LaneState::Hot`]. A lane changes a
//! record under its sequence number (a seqlock, [`LaneRecord::begin`] and
//! [`LaneRecord::end`]): plain stores, no read-modify-write, no lock; a
//! reader ([`LaneRecord::read`]) retries while it sees the number odd or
//! changed.

use std::sync::atomic::{fence, AtomicU64, Ordering};

/// First bytes of the area.
pub const MAGIC: [u8; 8] = *b"RFAASMTR";
/// Version of this layout.
pub const VERSION: u16 = 1;
/// Bytes of the header.
pub const HEADER_LEN: usize = 128;
/// Bytes of one lane record.
pub const RECORD_LEN: usize = 128;
/// Offset of the header's `crashed` word, an aligned `u64` (an atomic for
/// both sides): 0, or the signal a function crashed its worker with.
pub const CRASHED_OFFSET: usize = 24;

/// Bytes of an area with `lanes` records.
pub const fn area_len(lanes: u16) -> usize {
    HEADER_LEN + RECORD_LEN * lanes as usize
}

/// Offset of lane `lane`'s record.
pub const fn record_offset(lane: u16) -> usize {
    HEADER_LEN + RECORD_LEN * lane as usize
}

/// What the lanes' ticks are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Clock {
    /// Nanoseconds of `CLOCK_MONOTONIC`.
    Monotonic = 1,
    /// The x86 time-stamp counter (`rdtsc`), where the kernel uses it as
    /// its own clock source (constant rate, synchronised across CPUs).
    Tsc = 2,
}

impl Clock {
    /// The code in the header.
    pub const fn code(self) -> u16 {
        self as u16
    }

    /// The clock of code `code`.
    pub fn from_code(code: u16) -> Option<Clock> {
        match code {
            1 => Some(Clock::Monotonic),
            2 => Some(Clock::Tsc),
            _ => None,
        }
    }
}

/// What a lane does, in a record's `state`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LaneState {
    /// Not serving: before its client connected, or after it left.
    Off = 0,
    /// Polling (a hot lane between requests): counts as hot.
    Hot = 1,
    /// Serving a request: from its arrival to its answer, the user's
    /// function and the lane's own handling around it: counts as compute.
    Function = 2,
    /// Blocked waiting for requests (a warm lane), up to a request's
    /// arrival: counts as warm.
    Warm = 3,
    /// The lane's own work between requests on a lane that is not polling
    /// (a warm lane after its answer, until it waits again): counts in no
    /// bucket.
    Handling = 4,
}

impl LaneState {
    /// The code in a record.
    pub const fn code(self) -> u64 {
        self as u64
    }

    /// The state of code `code`; `None` for any other value (a reader
    /// counts such a phase nowhere).
    pub fn from_code(code: u64) -> Option<LaneState> {
        match code {
            0 => Some(LaneState::Off),
            1 => Some(LaneState::Hot),
            2 => Some(LaneState::Function),
            3 => Some(LaneState::Warm),
            4 => Some(LaneState::Handling),
            _ => None,
        }
    }
}

/// Why bytes are not a meter area header.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AreaError {
    /// Fewer bytes than the header, or than the records it announces.
    #[error("the meter area is {len} bytes, but {needed} are needed; the daemon sized it wrong")]
    TooShort {
        /// Bytes needed.
        needed: usize,
        /// Bytes there are.
        len: usize,
    },
    /// Not a meter area, or another version of it.
    #[error("the meter area does not start with the version {VERSION} header; worker and daemon come from different releases")]
    NotAnArea,
    /// A clock this build does not know or cannot read.
    #[error("the meter area names clock {0}, which this worker cannot read; worker and daemon come from different releases or machines")]
    UnknownClock(u16),
}

/// The header of an area.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AreaHeader {
    /// Lane records that follow.
    pub lanes: u16,
    /// What a tick is.
    pub clock: Clock,
    /// Ticks per second, as the daemon measured them.
    pub ticks_per_sec: u64,
}

impl AreaHeader {
    /// The header's bytes.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..8].copy_from_slice(&MAGIC);
        b[8..10].copy_from_slice(&VERSION.to_ne_bytes());
        b[10..12].copy_from_slice(&self.lanes.to_ne_bytes());
        b[12..14].copy_from_slice(&self.clock.code().to_ne_bytes());
        b[16..24].copy_from_slice(&self.ticks_per_sec.to_ne_bytes());
        b
    }

    /// Reads a header from the start of an area of `total` bytes and
    /// checks that its records fit.
    pub fn decode(b: &[u8], total: usize) -> Result<AreaHeader, AreaError> {
        if b.len() < HEADER_LEN || total < HEADER_LEN {
            return Err(AreaError::TooShort {
                needed: HEADER_LEN,
                len: b.len().min(total),
            });
        }
        let u16_at = |at: usize| u16::from_ne_bytes([b[at], b[at + 1]]);
        if b[0..8] != MAGIC || u16_at(8) != VERSION {
            return Err(AreaError::NotAnArea);
        }
        let lanes = u16_at(10);
        let needed = area_len(lanes);
        if total < needed {
            return Err(AreaError::TooShort { needed, len: total });
        }
        let clock = Clock::from_code(u16_at(12)).ok_or(AreaError::UnknownClock(u16_at(12)))?;
        let mut tps = [0u8; 8];
        tps.copy_from_slice(&b[16..24]);
        Ok(AreaHeader {
            lanes,
            clock,
            ticks_per_sec: u64::from_ne_bytes(tps),
        })
    }
}

/// One lane's record, as it lies in the area: every field an atomic, so the
/// lane thread and the daemon (another process) may touch it at once.
#[derive(Debug, Default)]
#[repr(C, align(128))]
pub struct LaneRecord {
    /// Even: consistent; odd: the lane is writing.
    pub seq: AtomicU64,
    /// A [`LaneState`] code.
    pub state: AtomicU64,
    /// Ticks: when the lane entered `state`.
    pub since: AtomicU64,
    /// Functions called.
    pub invocations: AtomicU64,
    /// Ticks serving requests, finished phases.
    pub compute: AtomicU64,
    /// Ticks polling, finished phases.
    pub hot: AtomicU64,
    /// Ticks blocked waiting, finished phases.
    pub warm: AtomicU64,
    /// Input bytes handed to the function.
    pub bytes_in: AtomicU64,
    /// Output bytes the function returned.
    pub bytes_out: AtomicU64,
}

const _: () = assert!(std::mem::size_of::<LaneRecord>() == RECORD_LEN);

/// The values of a record at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LaneValues {
    /// A [`LaneState`] code (any value: the record is not trusted).
    pub state: u64,
    /// Ticks: when the lane entered `state`.
    pub since: u64,
    /// Functions called.
    pub invocations: u64,
    /// Ticks serving requests, finished phases.
    pub compute: u64,
    /// Ticks polling, finished phases.
    pub hot: u64,
    /// Ticks blocked waiting, finished phases.
    pub warm: u64,
    /// Input bytes.
    pub bytes_in: u64,
    /// Output bytes.
    pub bytes_out: u64,
}

impl LaneRecord {
    /// Opens a change: `seq` is the lane's own count of changes (even),
    /// which it keeps itself rather than reading the record back. Writes
    /// after this one are seen after the odd number. Hot path (plain stores
    /// on x86).
    #[inline]
    pub fn begin(&self, seq: u64) {
        self.seq.store(seq | 1, Ordering::Relaxed);
        fence(Ordering::Release);
    }

    /// Closes the change opened with [`begin`](Self::begin)`(seq)`; returns
    /// the next even `seq`. Hot path.
    #[inline]
    pub fn end(&self, seq: u64) -> u64 {
        let next = (seq | 1).wrapping_add(1);
        self.seq.store(next, Ordering::Release);
        next
    }

    /// Writes every field at once, under the sequence number; returns the
    /// next `seq`.
    pub fn publish(&self, seq: u64, v: &LaneValues) -> u64 {
        self.begin(seq);
        self.state.store(v.state, Ordering::Relaxed);
        self.since.store(v.since, Ordering::Relaxed);
        self.invocations.store(v.invocations, Ordering::Relaxed);
        self.compute.store(v.compute, Ordering::Relaxed);
        self.hot.store(v.hot, Ordering::Relaxed);
        self.warm.store(v.warm, Ordering::Relaxed);
        self.bytes_in.store(v.bytes_in, Ordering::Relaxed);
        self.bytes_out.store(v.bytes_out, Ordering::Relaxed);
        self.end(seq)
    }

    /// Reads the record consistently, trying at most `tries` times (at
    /// least once). Returns the values and whether they are consistent: a
    /// writer that never finishes a change (or keeps changing it) cannot
    /// hold a reader, who then gets the last values read.
    pub fn read(&self, tries: u32) -> (LaneValues, bool) {
        let mut v = LaneValues::default();
        for _ in 0..tries.max(1) {
            let before = self.seq.load(Ordering::Acquire);
            v = LaneValues {
                state: self.state.load(Ordering::Relaxed),
                since: self.since.load(Ordering::Relaxed),
                invocations: self.invocations.load(Ordering::Relaxed),
                compute: self.compute.load(Ordering::Relaxed),
                hot: self.hot.load(Ordering::Relaxed),
                warm: self.warm.load(Ordering::Relaxed),
                bytes_in: self.bytes_in.load(Ordering::Relaxed),
                bytes_out: self.bytes_out.load(Ordering::Relaxed),
            };
            fence(Ordering::Acquire);
            let after = self.seq.load(Ordering::Relaxed);
            if before == after && before & 1 == 0 {
                return (v, true);
            }
            std::hint::spin_loop();
        }
        (v, false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::offset_of;

    #[test]
    fn header_bytes_are_as_documented() {
        let h = AreaHeader {
            lanes: 3,
            clock: Clock::Tsc,
            ticks_per_sec: 0x0102_0304_0506_0708,
        };
        let b = h.encode();
        assert_eq!(&b[0..8], b"RFAASMTR");
        assert_eq!(b[8..10], 1u16.to_ne_bytes());
        assert_eq!(b[10..12], 3u16.to_ne_bytes());
        assert_eq!(b[12..14], 2u16.to_ne_bytes());
        assert_eq!(b[14..16], [0, 0]);
        assert_eq!(b[16..24], 0x0102_0304_0506_0708u64.to_ne_bytes());
        assert!(b[24..].iter().all(|&x| x == 0));
        assert_eq!(AreaHeader::decode(&b, area_len(3)), Ok(h));
        assert_eq!(area_len(3), 128 + 3 * 128);
        assert_eq!(record_offset(2), 384);
    }

    #[test]
    fn bad_headers_are_refused() {
        let h = AreaHeader {
            lanes: 2,
            clock: Clock::Monotonic,
            ticks_per_sec: 1_000_000_000,
        };
        let b = h.encode();
        assert_eq!(
            AreaHeader::decode(&b, area_len(1)),
            Err(AreaError::TooShort {
                needed: area_len(2),
                len: area_len(1)
            })
        );
        assert!(matches!(
            AreaHeader::decode(&b[..64], area_len(2)),
            Err(AreaError::TooShort { .. })
        ));
        let mut other = b;
        other[8] ^= 0xff;
        assert_eq!(
            AreaHeader::decode(&other, area_len(2)),
            Err(AreaError::NotAnArea)
        );
        let mut clock = b;
        clock[12..14].copy_from_slice(&9u16.to_ne_bytes());
        assert_eq!(
            AreaHeader::decode(&clock, area_len(2)),
            Err(AreaError::UnknownClock(9))
        );
        let e = AreaHeader::decode(&other, area_len(2)).unwrap_err();
        assert!(e.to_string().contains("different releases"), "{e}");
    }

    #[test]
    fn record_offsets_are_as_documented() {
        assert_eq!(std::mem::size_of::<LaneRecord>(), 128);
        assert_eq!(std::mem::align_of::<LaneRecord>(), 128);
        let offsets = [
            offset_of!(LaneRecord, seq),
            offset_of!(LaneRecord, state),
            offset_of!(LaneRecord, since),
            offset_of!(LaneRecord, invocations),
            offset_of!(LaneRecord, compute),
            offset_of!(LaneRecord, hot),
            offset_of!(LaneRecord, warm),
            offset_of!(LaneRecord, bytes_in),
            offset_of!(LaneRecord, bytes_out),
        ];
        assert_eq!(offsets, [0, 8, 16, 24, 32, 40, 48, 56, 64]);
    }

    #[test]
    fn state_codes_are_stable() {
        let all = [
            (LaneState::Off, 0),
            (LaneState::Hot, 1),
            (LaneState::Function, 2),
            (LaneState::Warm, 3),
            (LaneState::Handling, 4),
        ];
        for (s, code) in all {
            assert_eq!(s.code(), code);
            assert_eq!(LaneState::from_code(code), Some(s));
        }
        assert_eq!(LaneState::from_code(5), None);
        assert_eq!(LaneState::from_code(u64::MAX), None);
        assert_eq!(Clock::from_code(1), Some(Clock::Monotonic));
        assert_eq!(Clock::from_code(2), Some(Clock::Tsc));
        assert_eq!(Clock::from_code(0), None);
    }

    #[test]
    fn a_published_record_reads_back_consistent() {
        let r = LaneRecord::default();
        let v = LaneValues {
            state: LaneState::Hot.code(),
            since: 10,
            invocations: 2,
            compute: 3,
            hot: 4,
            warm: 5,
            bytes_in: 6,
            bytes_out: 7,
        };
        let seq = r.publish(0, &v);
        assert_eq!(seq, 2);
        assert_eq!(r.read(1), (v, true));
        // A change left open reads as inconsistent, and does not hold the
        // reader.
        r.begin(seq);
        r.hot.store(99, Ordering::Relaxed);
        let (got, consistent) = r.read(3);
        assert!(!consistent);
        assert_eq!(got.hot, 99);
        assert_eq!(r.end(seq), 4);
        assert!(r.read(1).1);
    }

    #[test]
    fn readers_never_see_a_half_written_record() {
        let r = LaneRecord::default();
        std::thread::scope(|s| {
            s.spawn(|| {
                let mut seq = 0;
                for i in 1..=200_000u64 {
                    // Every field equal: a torn read shows as a mismatch.
                    seq = r.publish(
                        seq,
                        &LaneValues {
                            state: i,
                            since: i,
                            invocations: i,
                            compute: i,
                            hot: i,
                            warm: i,
                            bytes_in: i,
                            bytes_out: i,
                        },
                    );
                }
            });
            let mut consistent_reads = 0;
            while consistent_reads < 10_000 {
                let (v, ok) = r.read(64);
                if ok {
                    consistent_reads += 1;
                    for f in [
                        v.since,
                        v.invocations,
                        v.compute,
                        v.hot,
                        v.warm,
                        v.bytes_in,
                        v.bytes_out,
                    ] {
                        assert_eq!(f, v.state, "{v:?}");
                    }
                }
                if r.invocations.load(Ordering::Relaxed) == 200_000 {
                    break;
                }
            }
        });
    }
}

//! The meter area's mechanics on both sides ([`rfaas_proto::meter`] has the
//! layout): the clock its ticks come from, the daemon's sealed memfd, and
//! the mappings.
//!
//! # The clock
//!
//! A lane reads the clock twice per invocation, on the hot path, so the
//! cheapest sound clock is chosen once by the daemon ([`TickClock::detect`])
//! and written into the area's header for the worker:
//!
//! - [`Clock::Tsc`], the x86 time-stamp counter read with a plain `rdtsc`
//!   (no fence: it may run a few instructions early or late, which moves a
//!   phase boundary by nanoseconds and loses nothing, as every tick belongs
//!   to exactly one phase). Chosen only where the kernel itself uses the
//!   TSC as its clock source and the CPU says it is invariant
//!   (`constant_tsc`, `nonstop_tsc`): then it runs at one rate on every CPU
//!   and in every process. The daemon measures its rate against
//!   `CLOCK_MONOTONIC` at start and converts ticks to nanoseconds itself.
//! - [`Clock::Monotonic`] otherwise: `CLOCK_MONOTONIC` through the vDSO.
//!   Where the kernel's clock source is not the TSC (an emulated HPET or a
//!   paravirtual clock) a read costs more, but it is what every reader
//!   agrees on.
//!
//! On the build machine (an AMD EPYC virtual machine whose kernel uses the
//! TSC) a `rdtsc` costs 9 ns and `Instant::now()` 23 ns (`rfaas-bench
//! --rows clock_tsc,clock_instant_now`; docs/benchmarks.md, "Metering").

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use rfaas_proto::meter::{self, AreaError, AreaHeader, Clock, LaneRecord};

/// The name of the daemon's memfd, as `/proc/<pid>/maps` shows it
/// (`/memfd:rfaas-meter (deleted)`).
pub const MEMFD_NAME: &str = "rfaas-meter";

/// Reads `clock`'s ticks now. Hot path: no system call for either clock.
#[inline]
pub fn ticks(clock: Clock) -> u64 {
    match clock {
        Clock::Tsc => tsc(),
        Clock::Monotonic => monotonic_ns(),
    }
}

#[cfg(target_arch = "x86_64")]
#[inline]
fn tsc() -> u64 {
    // SAFETY: rdtsc has no preconditions; every x86-64 CPU has it (the
    // kernel could forbid it for this process with PR_SET_TSC, which rfaas
    // never does).
    unsafe { core::arch::x86_64::_rdtsc() }
}

#[cfg(not(target_arch = "x86_64"))]
#[inline]
fn tsc() -> u64 {
    // Never chosen here: TickClock::detect and MeterArea::map refuse it.
    monotonic_ns()
}

/// `CLOCK_MONOTONIC` in nanoseconds.
#[inline]
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: ts is a valid out-pointer; CLOCK_MONOTONIC always exists.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    (ts.tv_sec as u64)
        .wrapping_mul(1_000_000_000)
        .wrapping_add(ts.tv_nsec as u64)
}

/// Whether this machine's lanes can read `clock`.
pub fn readable(clock: Clock) -> bool {
    match clock {
        Clock::Monotonic => true,
        Clock::Tsc => cfg!(target_arch = "x86_64"),
    }
}

/// The daemon's clock for meter areas: which one, and its rate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TickClock {
    /// The clock lanes read.
    pub clock: Clock,
    /// Its ticks per second.
    pub ticks_per_sec: u64,
}

/// How long the daemon measures the TSC's rate at start.
const CALIBRATION: Duration = Duration::from_millis(10);

impl TickClock {
    /// `CLOCK_MONOTONIC`: nanoseconds.
    pub const MONOTONIC: TickClock = TickClock {
        clock: Clock::Monotonic,
        ticks_per_sec: 1_000_000_000,
    };

    /// The TSC where the kernel trusts it as its own clock source, with its
    /// rate measured over 10 ms against `CLOCK_MONOTONIC` (a few parts per
    /// million); `CLOCK_MONOTONIC` otherwise. Says which in the log.
    pub fn detect() -> TickClock {
        let why = match tsc_unusable_because() {
            None => match calibrate_tsc() {
                Some(ticks_per_sec) => {
                    tracing::info!(
                        ticks_per_sec,
                        "metering clock: the TSC (the kernel's clock source)"
                    );
                    return TickClock {
                        clock: Clock::Tsc,
                        ticks_per_sec,
                    };
                }
                None => "its measured rate was implausible".to_owned(),
            },
            Some(why) => why,
        };
        tracing::info!(%why, "metering clock: CLOCK_MONOTONIC, not the TSC");
        TickClock::MONOTONIC
    }

    /// Ticks now.
    pub fn now(&self) -> u64 {
        ticks(self.clock)
    }

    /// Nanoseconds in `ticks` (saturating).
    pub fn to_ns(&self, ticks: u64) -> u64 {
        if self.clock == Clock::Monotonic || self.ticks_per_sec == 0 {
            return ticks;
        }
        let ns = u128::from(ticks) * 1_000_000_000 / u128::from(self.ticks_per_sec);
        u64::try_from(ns).unwrap_or(u64::MAX)
    }
}

/// Why the TSC cannot be the metering clock here, or `None` when it can.
fn tsc_unusable_because() -> Option<String> {
    if !cfg!(target_arch = "x86_64") {
        return Some("this is not an x86-64 machine".into());
    }
    let source = "/sys/devices/system/clocksource/clocksource0/current_clocksource";
    match std::fs::read_to_string(source) {
        Ok(s) if s.trim() == "tsc" => {}
        Ok(s) => return Some(format!("the kernel's clock source is {}", s.trim())),
        Err(e) => return Some(format!("cannot read {source}: {e}")),
    }
    let cpuinfo = match std::fs::read_to_string("/proc/cpuinfo") {
        Ok(s) => s,
        Err(e) => return Some(format!("cannot read /proc/cpuinfo: {e}")),
    };
    let flags = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("flags")?.split_once(':').map(|(_, f)| f))
        .unwrap_or("");
    for needed in ["constant_tsc", "nonstop_tsc"] {
        if !flags.split_whitespace().any(|f| f == needed) {
            return Some(format!("the CPU does not say {needed}"));
        }
    }
    None
}

/// The TSC's rate against `CLOCK_MONOTONIC`, over [`CALIBRATION`].
fn calibrate_tsc() -> Option<u64> {
    // A (TSC, monotonic) pair read as close together as a few tries allow.
    let pair = || {
        (0..5)
            .map(|_| {
                let a = tsc();
                let m = monotonic_ns();
                let b = tsc();
                (b.wrapping_sub(a), a / 2 + b / 2, m)
            })
            .min_by_key(|&(spread, _, _)| spread)
            .map(|(_, t, m)| (t, m))
    };
    let (t0, m0) = pair()?;
    std::thread::sleep(CALIBRATION);
    let (t1, m1) = pair()?;
    let ns = m1.checked_sub(m0).filter(|&ns| ns > 0)?;
    let ticks = t1.checked_sub(t0)?;
    let rate = u128::from(ticks) * 1_000_000_000 / u128::from(ns);
    let rate = u64::try_from(rate).ok()?;
    // 100 MHz to 10 GHz: anything else is not a working TSC.
    (100_000_000..=10_000_000_000)
        .contains(&rate)
        .then_some(rate)
}

/// A mapped meter area. The daemon maps it read-only, the worker
/// read-write; either way only its records' atomics, and the header's
/// `crashed` word, are touched after mapping.
#[derive(Debug)]
pub struct MeterArea {
    ptr: NonNull<u8>,
    len: usize,
    header: AreaHeader,
}

// SAFETY: the mapping is plain shared memory that lives as long as the
// value; after `create`/`map` it is only accessed through `LaneRecord`'s
// atomics, which any thread (or process) may use at once.
unsafe impl Send for MeterArea {}
// SAFETY: as above.
unsafe impl Sync for MeterArea {}

/// Why a worker cannot use the meter area it was given.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MapError {
    /// `fstat` or `mmap` failed.
    #[error("cannot map the meter area: {0}")]
    Io(#[from] io::Error),
    /// The bytes are not an area this worker reads.
    #[error(transparent)]
    Area(#[from] AreaError),
}

impl MeterArea {
    /// The daemon's side: a memfd ([`MEMFD_NAME`]) with room for `lanes`
    /// records, its header written, sealed so its size never changes (a
    /// worker that shrank it would make the daemon's reads fault), and
    /// mapped read-only. Returns the mapping and the descriptor to pass to
    /// the worker.
    pub fn create(lanes: u16, clock: TickClock) -> io::Result<(MeterArea, OwnedFd)> {
        let name = std::ffi::CString::new(MEMFD_NAME).expect("no NUL in the name");
        // SAFETY: name is a valid C string for the call.
        let raw = unsafe {
            libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)
        };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: memfd_create just returned this descriptor to us.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let file = File::from(fd);
        let len = meter::area_len(lanes);
        file.set_len(len as u64)?;
        let header = AreaHeader {
            lanes,
            clock: clock.clock,
            ticks_per_sec: clock.ticks_per_sec,
        };
        file.write_all_at(&header.encode(), 0)?;
        let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
        // SAFETY: fcntl on a descriptor we own.
        if unsafe { libc::fcntl(file.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
            return Err(io::Error::last_os_error());
        }
        let fd = OwnedFd::from(file);
        let ptr = mmap(fd.as_raw_fd(), len, libc::PROT_READ)?;
        Ok((MeterArea { ptr, len, header }, fd))
    }

    /// The worker's side: maps the area passed as `fd` read-write and
    /// checks its header.
    pub fn map(fd: BorrowedFd<'_>) -> Result<MeterArea, MapError> {
        // SAFETY: stat is plain data, filled in by fstat.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: fstat on a descriptor we borrow, with a valid out-pointer.
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
            return Err(io::Error::last_os_error().into());
        }
        let len = usize::try_from(st.st_size).unwrap_or(0);
        if len < meter::HEADER_LEN {
            return Err(AreaError::TooShort {
                needed: meter::HEADER_LEN,
                len,
            }
            .into());
        }
        let ptr = mmap(fd.as_raw_fd(), len, libc::PROT_READ | libc::PROT_WRITE)?;
        let unmap = |e: MapError| {
            // SAFETY: ptr/len is the mapping made just above.
            unsafe { libc::munmap(ptr.as_ptr().cast(), len) };
            e
        };
        // SAFETY: the mapping holds at least HEADER_LEN bytes; the daemon
        // wrote the header before passing the area and no longer writes it.
        let head = unsafe { std::slice::from_raw_parts(ptr.as_ptr(), meter::HEADER_LEN) };
        let header = AreaHeader::decode(head, len).map_err(|e| unmap(e.into()))?;
        if !readable(header.clock) {
            return Err(unmap(AreaError::UnknownClock(header.clock.code()).into()));
        }
        Ok(MeterArea { ptr, len, header })
    }

    /// The header as the daemon wrote it.
    pub fn header(&self) -> AreaHeader {
        self.header
    }

    /// The header's `crashed` word.
    fn crashed_word(&self) -> &AtomicU64 {
        // SAFETY: the mapping holds at least the header; the offset is a
        // multiple of 8 in a page-aligned mapping; the word is only ever
        // accessed atomically, from either side.
        unsafe {
            &*self
                .ptr
                .as_ptr()
                .add(meter::CRASHED_OFFSET)
                .cast::<AtomicU64>()
        }
    }

    /// The worker's side: a function crashed the worker with `signal`,
    /// which is ending. Stored before the crash is answered, so the daemon
    /// sees it before the client can ask again.
    pub fn mark_crashed(&self, signal: i32) {
        self.crashed_word()
            .store(u64::from(signal.unsigned_abs()).max(1), Ordering::Release);
    }

    /// The daemon's side: the signal a function crashed the worker with,
    /// as the worker says. Its word, not trusted: it only makes the daemon
    /// count the allocation as ending, and name the crash as the cause of
    /// a worker it killed meanwhile.
    pub fn crashed(&self) -> Option<i32> {
        match self.crashed_word().load(Ordering::Acquire) {
            0 => None,
            s => Some(i32::try_from(s).unwrap_or(i32::MAX)),
        }
    }

    /// Lane `lane`'s record; `None` past the area's lanes.
    pub fn record(&self, lane: u16) -> Option<&LaneRecord> {
        if lane >= self.header.lanes {
            return None;
        }
        // SAFETY: decode (or create) checked that `lanes` records fit in
        // the mapping; the offset is a multiple of 128 in a page-aligned
        // mapping, so the record is aligned; LaneRecord is all atomics, so
        // shared access from other threads and processes is sound.
        Some(unsafe {
            &*self
                .ptr
                .as_ptr()
                .add(meter::record_offset(lane))
                .cast::<LaneRecord>()
        })
    }
}

impl Drop for MeterArea {
    fn drop(&mut self) {
        // SAFETY: ptr/len is our mapping; no reference into it outlives
        // `self` (records borrow it).
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

fn mmap(fd: libc::c_int, len: usize, prot: libc::c_int) -> io::Result<NonNull<u8>> {
    // SAFETY: a fresh shared mapping of a descriptor we hold; the kernel
    // chooses the address.
    let p = unsafe { libc::mmap(std::ptr::null_mut(), len, prot, libc::MAP_SHARED, fd, 0) };
    if p == libc::MAP_FAILED {
        return Err(io::Error::last_os_error());
    }
    NonNull::new(p.cast()).ok_or_else(|| io::Error::other("mmap returned a null mapping"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rfaas_proto::meter::{LaneState, LaneValues};
    use std::os::fd::AsFd;

    #[test]
    fn the_worker_sees_what_the_daemon_wrote_and_back() {
        let (daemon, fd) = MeterArea::create(3, TickClock::MONOTONIC).unwrap();
        let worker = MeterArea::map(fd.as_fd()).unwrap();
        assert_eq!(worker.header(), daemon.header());
        assert_eq!(worker.header().lanes, 3);
        let v = LaneValues {
            state: LaneState::Hot.code(),
            since: 5,
            invocations: 9,
            ..LaneValues::default()
        };
        worker.record(2).unwrap().publish(0, &v);
        assert_eq!(daemon.record(2).unwrap().read(1), (v, true));
        assert_eq!(daemon.record(0).unwrap().read(1).0, LaneValues::default());
        assert!(daemon.record(3).is_none());
        // A crash mark, and the header left as it was.
        assert_eq!(daemon.crashed(), None);
        worker.mark_crashed(libc::SIGSEGV);
        assert_eq!(daemon.crashed(), Some(libc::SIGSEGV));
        let mut head = [0u8; meter::HEADER_LEN];
        File::from(fd).read_exact_at(&mut head, 0).unwrap();
        assert_eq!(
            rfaas_proto::meter::AreaHeader::decode(&head, meter::area_len(3)).unwrap(),
            daemon.header()
        );
        assert_eq!(head[meter::CRASHED_OFFSET], libc::SIGSEGV as u8);
    }

    #[test]
    fn the_area_cannot_be_shrunk_or_grown() {
        let (_daemon, fd) = MeterArea::create(1, TickClock::MONOTONIC).unwrap();
        let file = File::from(fd);
        assert!(file.set_len(0).is_err(), "shrinking would fault the reader");
        assert!(file.set_len(1 << 20).is_err());
        // Still writable: the worker's lanes write through their mapping.
        file.write_all_at(&[1], meter::HEADER_LEN as u64).unwrap();
    }

    #[test]
    fn a_mangled_area_is_refused() {
        let (_daemon, fd) = MeterArea::create(1, TickClock::MONOTONIC).unwrap();
        let file = File::from(fd);
        file.write_all_at(b"NOTMETER", 0).unwrap();
        let err = MeterArea::map(file.as_fd()).unwrap_err();
        assert!(matches!(err, MapError::Area(AreaError::NotAnArea)), "{err}");
    }

    #[test]
    fn the_detected_clock_ticks_forward_at_its_rate() {
        let c = TickClock::detect();
        // A tick and a monotonic reading taken within 50 µs of each other
        // (a preempted try is taken again).
        let pair = || loop {
            let (before, t, after) = (monotonic_ns(), c.now(), monotonic_ns());
            if after - before < 50_000 {
                return (t, before);
            }
        };
        let (t0, m0) = pair();
        // Time is the subject: both clocks run 20 ms, then are compared.
        std::thread::sleep(Duration::from_millis(20));
        let (t1, m1) = pair();
        assert!(t1 > t0);
        let ns = c.to_ns(t1 - t0);
        // 100 µs of reading error at most, and a rate right within parts
        // per million: 1 % of 20 ms is far beyond either.
        let wall = m1 - m0;
        assert!(
            ns.abs_diff(wall) < wall / 100,
            "{ns} ns by ticks, {wall} ns"
        );
    }

    #[test]
    fn tick_conversion_saturates_and_scales() {
        let tsc = TickClock {
            clock: Clock::Tsc,
            ticks_per_sec: 2_000_000_000,
        };
        assert_eq!(tsc.to_ns(2_000), 1_000);
        assert_eq!(tsc.to_ns(u64::MAX), u64::MAX / 2);
        let slow = TickClock {
            clock: Clock::Tsc,
            ticks_per_sec: 100_000_000,
        };
        assert_eq!(slow.to_ns(u64::MAX), u64::MAX, "saturates");
        assert_eq!(TickClock::MONOTONIC.to_ns(77), 77);
    }
}

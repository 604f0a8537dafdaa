//! Noticing that a spinning thread shares its CPU with another busy thread.
//!
//! A thread that busy-polls for a result on a CPU where another thread is
//! busy too (a hot worker of its own allocation on this node, above all)
//! gets the result only when the scheduler lets the other thread run and
//! then lets it back: a call that takes a microsecond takes milliseconds.
//! The client cannot see where its workers run, so it measures: while
//! [`Invocation::spin`](crate::Invocation::spin) waits, it compares the
//! thread's CPU time with the time that passed, and counts the times the
//! kernel switched it out for another task. A thread that got less than
//! half of its CPU over at least [`WINDOW`], and was switched out for
//! another task meanwhile, is sharing it. (A virtual machine whose vCPU the
//! hypervisor took away also loses CPU time, but its kernel switched to no
//! other task: that is not sharing, and spinning on is right.)
//!
//! From then on `spin` on that thread waits by sleeping in the kernel (the
//! worker runs, and its answer wakes the thread) for its next
//! [`SLEEPING_WAITS`] waits, then measures again, so a thread that was
//! moved, or whose neighbour went idle, spins again. The library warns
//! once per process.
//!
//! The clocks are read only in waits that outlast a first check (1024
//! empty polls): a quick answer costs nothing more.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// Shortest span over which the thread's share of its CPU is judged.
pub(crate) const WINDOW: Duration = Duration::from_micros(500);

/// Waits that sleep after the thread was found sharing its CPU, before it
/// spins and measures again.
pub(crate) const SLEEPING_WAITS: u32 = 1000;

thread_local! {
    /// Waits this thread's `spin` still sleeps (see the module docs).
    static SLEEPS: Cell<u32> = const { Cell::new(0) };
}

/// Whether `spin` waits by sleeping on the calling thread: it found the
/// thread's CPU shared with another busy thread (see the module docs) and
/// has not measured again since.
pub fn spin_sleeps() -> bool {
    SLEEPS.with(Cell::get) > 0
}

/// Counts one sleeping wait of `spin` on this thread; after the last one
/// the thread spins (and measures) again.
pub(crate) fn slept_once() {
    SLEEPS.with(|s| s.set(s.get().saturating_sub(1)));
}

/// Whether a thread that got `cpu` of CPU time while `wall` passed, and
/// was switched out for another task `switched` times, shares its CPU: it
/// got less than half of it, over at least [`WINDOW`], and another task
/// ran meanwhile.
pub(crate) fn shares_its_cpu(wall: Duration, cpu: Duration, switched: u64) -> bool {
    wall >= WINDOW && cpu * 2 < wall && switched > 0
}

/// Times the kernel switched the calling thread out while it could run
/// (preempted, or yielding to another task).
fn involuntary_switches() -> u64 {
    // SAFETY: rusage is plain data that getrusage fills.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `ru` is a valid rusage to write.
    if unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut ru) } != 0 {
        return 0;
    }
    ru.ru_nivcsw as u64
}

/// The calling thread's CPU time.
fn thread_cpu_time() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec to write; the clock id is a
    // constant every Linux has.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    if rc != 0 {
        return Duration::ZERO;
    }
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// The wall clock, the thread's CPU time and its involuntary switches.
type Readings = (Instant, Duration, u64);

fn readings() -> Readings {
    (Instant::now(), thread_cpu_time(), involuntary_switches())
}

/// One spinning wait's measurement: the readings at its first check.
#[derive(Debug, Default)]
pub(crate) struct Probe {
    since: Option<Readings>,
}

impl Probe {
    /// A check of the wait: starts the measurement, or judges it. Returns
    /// true when the thread shares its CPU (recorded for the thread, and
    /// warned about once per process).
    pub(crate) fn check(&mut self) -> bool {
        self.check_with(readings)
    }

    /// [`check`](Self::check) with the readings `now` takes.
    fn check_with(&mut self, now: impl FnOnce() -> Readings) -> bool {
        let Some((wall0, cpu0, switches0)) = self.since else {
            self.since = Some(now());
            return false;
        };
        let (wall1, cpu1, switches1) = now();
        let wall = wall1.saturating_duration_since(wall0);
        if wall < WINDOW {
            return false;
        }
        let cpu = cpu1.saturating_sub(cpu0);
        let switched = switches1.saturating_sub(switches0);
        if !shares_its_cpu(wall, cpu, switched) {
            return false;
        }
        SLEEPS.with(|s| s.set(SLEEPING_WAITS));
        warn_once(wall, cpu);
        true
    }

    /// The end of the wait: judges it when it was measured.
    pub(crate) fn finish(&mut self) {
        if self.since.is_some() {
            self.check();
        }
    }
}

fn warn_once(wall: Duration, cpu: Duration) {
    static WARNED: AtomicBool = AtomicBool::new(false);
    if WARNED.swap(true, Ordering::Relaxed) {
        return;
    }
    let share = (cpu.as_secs_f64() / wall.as_secs_f64() * 100.0).round();
    tracing::warn!(
        waited_us = wall.as_micros() as u64,
        cpu_share_percent = share,
        "a thread busy-polling for an invocation's result got {share}% of its CPU: another busy thread \
         (a hot worker on this node?) shares that CPU, and each result waits for the scheduler. \
         This thread now waits for results by sleeping (it measures again every {SLEEPING_WAITS} waits). \
         For the lowest latency, run it on a core of its own, one no worker is pinned to"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_thread_that_got_less_than_half_its_cpu_shares_it() {
        let us = Duration::from_micros;
        // Spinning alone: all of the CPU, however long.
        assert!(!shares_its_cpu(us(10_000), us(9_900), 0));
        // A short preemption does not count...
        assert!(!shares_its_cpu(us(1_000), us(700), 1));
        // ...a CPU taken over does.
        assert!(shares_its_cpu(us(4_000), us(100), 3));
        assert!(shares_its_cpu(us(1_000), us(499), 1));
        // Too short a span to judge.
        assert!(!shares_its_cpu(us(400), us(0), 1));
        // Time lost with no other task run: the hypervisor took the vCPU,
        // nothing here shares it.
        assert!(!shares_its_cpu(us(4_000), us(100), 0));
    }

    #[test]
    fn a_probe_judges_from_its_first_check_and_marks_the_thread() {
        std::thread::spawn(|| {
            assert!(!spin_sleeps());
            let mut p = Probe::default();
            assert!(!p.check(), "the first check only starts measuring");
            let (t0, cpu0, sw0) = p.since.unwrap();
            // Time passed, the thread got little of it, and the kernel ran
            // no other task: a hypervisor's steal, not a shared CPU.
            let stolen = (t0 + WINDOW * 4, cpu0 + WINDOW / 4, sw0);
            assert!(!p.check_with(|| stolen));
            assert!(!spin_sleeps());
            // The same with another task run in between: shared.
            let shared = (t0 + WINDOW * 4, cpu0 + WINDOW / 4, sw0 + 2);
            assert!(p.check_with(|| shared));
            assert!(spin_sleeps());
            // It sleeps for a while, then spins and measures again.
            for _ in 1..SLEEPING_WAITS {
                slept_once();
            }
            assert!(spin_sleeps());
            slept_once();
            assert!(!spin_sleeps());
        })
        .join()
        .unwrap();
        assert!(!spin_sleeps(), "per thread");
        // A wait that was never checked is not judged.
        let mut p = Probe::default();
        p.finish();
        assert!(p.since.is_none());
    }
}

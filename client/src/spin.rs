//! Noticing that a spinning thread shares its CPU with another busy thread.
//!
//! A thread that busy-polls for a result on a CPU where another thread is
//! busy too (a hot worker of its own allocation on this node, above all)
//! gets the result only when the scheduler lets the other thread run and
//! then lets it back: a call that takes a microsecond takes milliseconds.
//! The client cannot see where its workers run, so it measures: while
//! [`Invocation::spin`](crate::Invocation::spin) waits, it compares the
//! thread's CPU time with the time that passed. A thread that got less than
//! half of its CPU over at least [`WINDOW`] is sharing it; from then on
//! `spin` on that thread waits by sleeping in the kernel (the worker runs,
//! and its answer wakes the thread), and the library warns once.
//!
//! The CPU clock is read only in waits that outlast a first check (1024
//! empty polls): a quick answer costs nothing more.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// Shortest span over which the thread's share of its CPU is judged.
pub(crate) const WINDOW: Duration = Duration::from_micros(500);

thread_local! {
    /// This thread's `spin` found its CPU shared and sleeps instead.
    static SLEEPS: Cell<bool> = const { Cell::new(false) };
}

/// Whether `spin` waits by sleeping on the calling thread: it found the
/// thread's CPU shared with another busy thread (see the module docs).
/// Once true, it stays true for the thread's life.
pub fn spin_sleeps() -> bool {
    SLEEPS.with(Cell::get)
}

/// Whether a thread that got `cpu` of CPU time while `wall` passed shares
/// its CPU: it got less than half of it, over at least [`WINDOW`].
pub(crate) fn shares_its_cpu(wall: Duration, cpu: Duration) -> bool {
    wall >= WINDOW && cpu * 2 < wall
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

/// One spinning wait's measurement: the wall clock and the thread's CPU
/// time at its first check.
#[derive(Debug, Default)]
pub(crate) struct Probe {
    since: Option<(Instant, Duration)>,
}

impl Probe {
    /// A check of the wait: starts the measurement, or judges it. Returns
    /// true when the thread shares its CPU (recorded for the thread, and
    /// warned about once per process).
    pub(crate) fn check(&mut self) -> bool {
        let Some((wall0, cpu0)) = self.since else {
            self.since = Some((Instant::now(), thread_cpu_time()));
            return false;
        };
        let wall = wall0.elapsed();
        if wall < WINDOW {
            return false;
        }
        let cpu = thread_cpu_time().saturating_sub(cpu0);
        if !shares_its_cpu(wall, cpu) {
            return false;
        }
        SLEEPS.with(|s| s.set(true));
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
         This thread now waits for results by sleeping. For the lowest latency, run it on a core \
         of its own, one no worker is pinned to"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_thread_that_got_less_than_half_its_cpu_shares_it() {
        let us = Duration::from_micros;
        // Spinning alone: all of the CPU, however long.
        assert!(!shares_its_cpu(us(10_000), us(9_900)));
        // A short preemption does not count...
        assert!(!shares_its_cpu(us(1_000), us(700)));
        // ...a CPU taken over does.
        assert!(shares_its_cpu(us(4_000), us(100)));
        assert!(shares_its_cpu(us(1_000), us(499)));
        // Too short a span to judge.
        assert!(!shares_its_cpu(us(400), us(0)));
    }

    #[test]
    fn a_probe_judges_from_its_first_check_and_marks_the_thread() {
        std::thread::spawn(|| {
            assert!(!spin_sleeps());
            let mut p = Probe::default();
            assert!(!p.check(), "the first check only starts measuring");
            // Pretend the first check was long ago and the thread has not
            // run since: it shares its CPU.
            p.since = Some((Instant::now() - WINDOW * 4, thread_cpu_time()));
            assert!(p.check());
            assert!(spin_sleeps());
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

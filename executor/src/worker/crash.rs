//! In-band crash reports: when a function dies of a signal, its client
//! hears `function_crashed`, with the signal, on the lane itself, before
//! the process ends; the daemon's `WorkerExited` follows as before.
//!
//! A handler for the fatal signals ([`FATAL`]) runs on the faulting
//! thread (on the worker thread's own alternate stack, [`arm_thread`], so
//! a stack overflow is caught too) and does only async-signal-safe work: it
//! finds the worker thread by thread id among those running a function,
//! publishes its number and the signal in one atomic word, wakes the [`watchdog`](super::watchdog)
//! with a futex, and waits, for [`ANSWER_WAIT`] at most, until the watchdog
//! has answered. Then it raises the signal again: `SA_RESETHAND` restored
//! the default action, so the process dies of the function's own signal and
//! the daemon reports it exactly as it would have.
//!
//! The answer is written by the watchdog thread, not in the handler: that
//! thread was not interrupted inside the function, holds none of its locks,
//! and uses the thread's endpoint through the same take-over as a deadline
//! answer. A function that corrupted the process's memory may still break
//! that write; the bounded wait means the process dies anyway, and the
//! client falls back to the daemon's report.
//!
//! A fault outside a function (an rfaas bug), a second crash while the
//! first is answered, or a signal sent from outside to a thread that runs
//! no function: no report, the default action at once.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use super::watchdog::Running;

/// The signals a function's fault raises.
pub const FATAL: [libc::c_int; 7] = [
    libc::SIGSEGV,
    libc::SIGBUS,
    libc::SIGFPE,
    libc::SIGILL,
    libc::SIGABRT,
    libc::SIGTRAP,
    libc::SIGSYS,
];

/// How long a crashed thread waits for the watchdog's answer before the
/// process dies regardless.
pub const ANSWER_WAIT: Duration = Duration::from_secs(1);

/// Every worker thread's [`Running`], by thread number; set before the
/// first thread starts.
static THREADS: OnceLock<Box<[Arc<Running>]>> = OnceLock::new();

/// 0, or the crash to answer: `(thread + 1) << 8 | signal`.
static CRASH: AtomicU32 = AtomicU32::new(0);

/// Set to 1 by the watchdog once the crash is answered (or cannot be).
static ANSWERED: AtomicU32 = AtomicU32::new(0);

/// A crash the watchdog is to answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Crash {
    /// The worker thread whose function crashed.
    pub thread: usize,
    /// The signal.
    pub signal: i32,
}

impl Crash {
    fn encode(self) -> u32 {
        ((self.thread as u32 + 1) << 8) | (self.signal as u32 & 0xff)
    }

    fn decode(word: u32) -> Option<Crash> {
        (word != 0).then(|| Crash {
            thread: (word >> 8) as usize - 1,
            signal: (word & 0xff) as i32,
        })
    }
}

/// Publishes the worker threads and installs the handler for [`FATAL`].
/// Call once, before any thread runs a function.
pub fn install(threads: Box<[Arc<Running>]>) -> std::io::Result<()> {
    if THREADS.set(threads).is_err() {
        return Err(std::io::Error::other(
            "the crash handler is already installed",
        ));
    }
    for sig in FATAL {
        // SAFETY: an all-zero sigaction is valid; the handler has the
        // SA_SIGINFO signature and does only async-signal-safe work.
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_fatal as *const () as usize;
            action.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK | libc::SA_RESETHAND;
            libc::sigemptyset(&mut action.sa_mask);
            if libc::sigaction(sig, &action, std::ptr::null_mut()) != 0 {
                return Err(std::io::Error::last_os_error());
            }
        }
    }
    Ok(())
}

/// The crash to answer, waiting for one up to `timeout` (forever: `None`).
/// The watchdog's sleep.
pub fn wait(timeout: Option<Duration>) -> Option<Crash> {
    if let Some(c) = Crash::decode(CRASH.load(Ordering::Acquire)) {
        return Some(c);
    }
    futex_wait(&CRASH, 0, timeout);
    Crash::decode(CRASH.load(Ordering::Acquire))
}

/// Bytes of the alternate signal stack [`arm_thread`] gives a worker thread.
const ALT_STACK: usize = 64 << 10;

/// Bytes at the bottom of a worker thread's stack made inaccessible
/// ([`arm_thread`]), above the one guard page the thread library puts
/// below it. Worker threads are started with this much more stack
/// ([`THREAD_STACK`](super::THREAD_STACK)).
pub const STACK_GUARD: usize = 256 << 10;

/// Gives the calling (worker) thread an alternate signal stack of
/// [`ALT_STACK`] bytes for the handler, after turning the lowest
/// [`STACK_GUARD`] bytes of its stack into a guard. The one std gives every thread is
/// sized for std's own overflow message: a handler that waits for the
/// watchdog needs more, and a second fault on that stack would end the
/// process before the crash is answered. Worker threads live as long as the
/// process, so the stack is never unmapped.
///
/// The wider guard: a function's frame can be larger than the one guard
/// page (gcc merges the frames of a recursion into one 24 KiB step whose
/// first write is at its bottom), so an overflow jumped the page and wrote
/// into whatever lay below, which is the next thread's stack, with that
/// thread's control block at its top: the watchdog's, which then crashed
/// instead of answering. Whether the jump hit anything depended on how
/// deep the thread's own frames were.
pub fn arm_thread() -> std::io::Result<()> {
    if let Err(e) = guard_own_stack() {
        tracing::warn!(error = %e, "cannot widen the worker thread's stack guard; a function's stack overflow may corrupt another thread instead of being answered");
    }
    let page = rfaas_fabric::page_size();
    // SAFETY: an anonymous private mapping; the result is checked.
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            page + ALT_STACK,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_STACK,
            -1,
            0,
        )
    };
    if base == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    // A guard page below: overflowing this stack faults instead of writing
    // into whatever lies there.
    // SAFETY: the first page of the mapping just made.
    if unsafe { libc::mprotect(base, page, libc::PROT_NONE) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let ss = libc::stack_t {
        // SAFETY: page + ALT_STACK bytes were mapped at base.
        ss_sp: unsafe { base.cast::<u8>().add(page) }.cast(),
        ss_flags: 0,
        ss_size: ALT_STACK,
    };
    // SAFETY: `ss` names ALT_STACK writable bytes that are never unmapped.
    if unsafe { libc::sigaltstack(&ss, std::ptr::null_mut()) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Makes the lowest [`STACK_GUARD`] bytes of the calling thread's stack
/// inaccessible. Inside the thread's own mapping, so nothing else can have
/// been placed there.
fn guard_own_stack() -> std::io::Result<()> {
    // SAFETY: pthread_attr_t is plain data that pthread_getattr_np fills
    // in; it is destroyed once read.
    let (low, size) = unsafe {
        let mut attr: libc::pthread_attr_t = std::mem::zeroed();
        let rc = libc::pthread_getattr_np(libc::pthread_self(), &mut attr);
        if rc != 0 {
            return Err(std::io::Error::from_raw_os_error(rc));
        }
        let (mut addr, mut size) = (std::ptr::null_mut(), 0usize);
        let rc = libc::pthread_attr_getstack(&attr, &mut addr, &mut size);
        libc::pthread_attr_destroy(&mut attr);
        if rc != 0 {
            return Err(std::io::Error::from_raw_os_error(rc));
        }
        (addr, size)
    };
    if size < 2 * STACK_GUARD {
        return Err(std::io::Error::other(format!(
            "the thread's stack is {size} bytes, too small to give up {STACK_GUARD} to a guard"
        )));
    }
    // SAFETY: the lowest STACK_GUARD bytes of this thread's own stack, far
    // below the frames in use (the stack grows down from its top, and at
    // least as much again lies above); page-aligned, as the thread library
    // maps stacks.
    if unsafe { libc::mprotect(low, STACK_GUARD, libc::PROT_NONE) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Lets the crashed thread go on to die.
pub fn answered() {
    ANSWERED.store(1, Ordering::Release);
    futex_wake(&ANSWERED);
}

extern "C" fn on_fatal(sig: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {
    // Everything here is async-signal-safe: atomics, gettid, futex,
    // clock_gettime, raise.
    let tid = crate::gettid();
    let thread = THREADS
        .get()
        .and_then(|threads| threads.iter().position(|r| r.crashed_here(tid)));
    if let Some(thread) = thread {
        let word = Crash {
            thread,
            signal: sig,
        }
        .encode();
        if CRASH
            .compare_exchange(0, word, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
        {
            futex_wake(&CRASH);
            let end = Instant::now() + ANSWER_WAIT;
            while ANSWERED.load(Ordering::Acquire) == 0 {
                let left = end.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    break;
                }
                futex_wait(&ANSWERED, 0, Some(left));
            }
        }
    }
    // SA_RESETHAND restored the default action and the signal stays blocked
    // until this handler returns: then it is delivered, and kills.
    // SAFETY: raise has no preconditions.
    unsafe { libc::raise(sig) };
}

/// `FUTEX_WAIT` on `word` while it holds `expected`, up to `timeout`.
fn futex_wait(word: &AtomicU32, expected: u32, timeout: Option<Duration>) {
    let ts = timeout.map(|t| libc::timespec {
        tv_sec: t.as_secs().min(i64::MAX as u64) as libc::time_t,
        tv_nsec: t.subsec_nanos() as libc::c_long,
    });
    let ts_ptr = ts
        .as_ref()
        .map_or(std::ptr::null(), |t| t as *const libc::timespec);
    // SAFETY: `word` is a live, aligned u32 and `ts_ptr` null or a live
    // timespec; a spurious or interrupted return is fine for every caller,
    // which looks at the word again.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT | libc::FUTEX_PRIVATE_FLAG,
            expected,
            ts_ptr,
        );
    }
}

/// `FUTEX_WAKE` of every waiter on `word`.
fn futex_wake(word: &AtomicU32) {
    // SAFETY: `word` is a live, aligned u32.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE | libc::FUTEX_PRIVATE_FLAG,
            i32::MAX,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crash_words_round_trip() {
        for (thread, signal) in [(0, libc::SIGSEGV), (3, libc::SIGABRT), (254, libc::SIGSYS)] {
            let c = Crash { thread, signal };
            assert_ne!(c.encode(), 0);
            assert_eq!(Crash::decode(c.encode()), Some(c));
        }
        assert_eq!(Crash::decode(0), None);
    }
}

//! The watchdog: one thread that answers for a worker thread whose
//! function cannot answer: one that crashed ([`crash`](super::crash)), or
//! one that runs longer than the allocation's deadline.
//!
//! Each worker thread publishes, in a [`Running`], when its current
//! function started, on which thread, for which of its lanes, and whom to
//! answer. For a crash the watchdog answers
//! `function_crashed` with the signal and lets the crashed thread die of
//! it. For an overrun it answers `deadline_exceeded` and ends the process
//! with [`EXIT_DEADLINE`]: a function that overran cannot be stopped inside
//! a thread, only with its process. Either way the process ends as soon as
//! the answer's write has completed (on tcp and verbs: the client has it),
//! [`RESPONSE_GRACE`] at most, so nobody waits on a worker that has
//! answered for its end. Between events it sleeps on the crash word's futex
//! (with the deadline's tick as timeout when there is a deadline).
//!
//! Endpoints and completion queues are `Send` but not all are `Sync`
//! (shm's are not), so the worker thread and the watchdog never use them at
//! the same time: while a function runs the thread leaves its endpoints and
//! queue alone, and the watchdog takes them over by swapping the start time
//! for `TAKEN` with a compare-and-swap. A thread whose function returns
//! after that finds its start time gone and parks until the process ends.
//!
//! A thread serving several requests at once holds their answers for one
//! batch ([`Held`]) and sends them together. The held answers live in its
//! `Running`, under the same protocol: the thread changes them only between
//! functions, and the watchdog, once it took the endpoints over, sends them
//! before its own answer. So a crash or an overrun loses no answer that was
//! already computed.

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicI32, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use rfaas_fabric::{Completion, CompletionQueue, Endpoint, MemoryRegion, RemoteAddr};
use rfaas_proto::{InvocationStatus, ResponseImm};

use super::crash::{self, Crash};
use super::EXIT_DEADLINE;
use crate::meter::MeterArea;

/// The longest the watchdog waits for its answer's write to complete
/// before the process ends regardless (a client that stopped acknowledging
/// must not keep a worker that has to end).
pub const RESPONSE_GRACE: Duration = Duration::from_millis(200);

/// The wr_id of the watchdog's response.
const WATCHDOG_WR_ID: u64 = u64::MAX;

/// The wr_id of a held answer the watchdog sends for its thread.
const HELD_WR_ID: u64 = u64::MAX - 1;

/// Answers a thread holds at most before it sends them.
pub const MAX_HELD: usize = 32;

/// An answer computed and not yet sent: `len` bytes at `offset` of the
/// lane's `slot` output buffer, to `to`, with the response immediate `imm`.
#[derive(Debug, Clone, Copy, Default)]
pub struct Answer {
    /// The thread's number for the lane.
    pub lane: u32,
    /// The slot whose output buffer holds it.
    pub slot: u32,
    /// Where the output starts in that buffer.
    pub offset: u32,
    /// Its bytes.
    pub len: u32,
    /// The encoded [`ResponseImm`].
    pub imm: u32,
    /// The client's output buffer.
    pub to: RemoteAddr,
}

/// A thread's held answers, in the order it computed them.
#[derive(Debug, Default)]
struct Held {
    len: usize,
    answers: [Answer; MAX_HELD],
}

impl Held {
    #[inline]
    fn as_slice(&self) -> &[Answer] {
        &self.answers[..self.len]
    }
}

/// The start time of a lane whose endpoint the watchdog took over.
const TAKEN: u64 = u64::MAX;

/// Bits of a start stamp that count invocations; the rest is the start
/// time in milliseconds.
const SEQ_BITS: u32 = 24;

/// Milliseconds of `CLOCK_MONOTONIC_COARSE`: the time of the kernel's last
/// tick (a few ms old at most), read from the vDSO page without touching a
/// clock device. Hot path: a full clock read costs microseconds where the
/// clocksource is emulated (a VM without a usable TSC reads the HPET).
#[inline]
pub fn coarse_ms() -> u64 {
    coarse(libc::CLOCK_MONOTONIC_COARSE).as_millis() as u64
}

/// Seconds since the Unix epoch, of `CLOCK_REALTIME_COARSE` (see
/// [`coarse_ms`]). Hot path.
#[inline]
pub fn coarse_unix_secs() -> u64 {
    coarse(libc::CLOCK_REALTIME_COARSE).as_secs()
}

#[inline]
fn coarse(clock: libc::clockid_t) -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: ts is a valid out-pointer; the coarse clocks exist on every
    // Linux since 2.6.32 and cannot fail with a valid pointer.
    unsafe { libc::clock_gettime(clock, &mut ts) };
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// A start stamp: the start in coarse milliseconds, and the lane's
/// invocation count below it, so two invocations of one lane never share a
/// stamp even within one tick. Never 0 and never [`TAKEN`].
fn stamp(started_ms: u64, seq: u32) -> u64 {
    ((started_ms << SEQ_BITS) | u64::from(seq & ((1 << SEQ_BITS) - 1))).clamp(1, TAKEN - 1)
}

/// The start in coarse milliseconds of a stamp.
fn started_ms(stamp: u64) -> u64 {
    stamp >> SEQ_BITS
}

/// What one worker thread is running, published with atomics (the thread
/// writes, the watchdog reads).
#[derive(Debug, Default)]
pub struct Running {
    /// The lane (the thread's own number for it) the function serves.
    lane: AtomicU32,
    /// The [`stamp`] of the running function; 0 while the lane is idle.
    started_ns: AtomicU64,
    /// Invocations started (the lane writes it, nobody else).
    seq: AtomicU32,
    /// The invocation id.
    invocation_id: AtomicU32,
    /// The client's output buffer.
    output_addr: AtomicU64,
    /// Its rkey.
    output_rkey: AtomicU32,
    /// The bytes the client's output buffer takes.
    output_capacity: AtomicU32,
    /// The lane thread's id (0 until it starts).
    tid: AtomicI32,
    /// The thread's held answers: changed by the thread only while no
    /// function runs, read by the watchdog only after a take-over.
    held: UnsafeCell<Held>,
}

// SAFETY: every field but `held` is atomic. `held` is written only by the
// worker thread, and only while its start time is 0 (between `finish` and
// the next `start`), and read by the watchdog only after its
// compare-and-swap took a nonzero start time over, which the thread can
// never undo: `start`'s release store orders the thread's writes before the
// take-over's acquire, and after it the thread never touches `held` again.
unsafe impl Sync for Running {}

impl Running {
    /// Marks a function as started; returns the stamp to hand to
    /// [`Running::finish`]. Hot path.
    #[inline]
    pub fn start(
        &self,
        lane: u32,
        invocation_id: u32,
        output: RemoteAddr,
        output_capacity: u32,
    ) -> u64 {
        self.lane.store(lane, Ordering::Relaxed);
        self.invocation_id.store(invocation_id, Ordering::Relaxed);
        self.output_addr.store(output.addr, Ordering::Relaxed);
        self.output_rkey.store(output.rkey, Ordering::Relaxed);
        self.output_capacity
            .store(output_capacity, Ordering::Relaxed);
        let seq = self.seq.load(Ordering::Relaxed).wrapping_add(1);
        self.seq.store(seq, Ordering::Relaxed);
        let stamp = stamp(coarse_ms(), seq);
        self.started_ns.store(stamp, Ordering::Release);
        stamp
    }

    /// Marks the lane idle again and takes its endpoint back. Hot path.
    ///
    /// Returns false when the watchdog took the endpoint over: the lane must
    /// not touch it again (the process is ending).
    #[inline]
    pub fn finish(&self, stamp: u64) -> bool {
        self.started_ns
            .compare_exchange(stamp, 0, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
    }

    /// Holds `answer` to send with the rest of its batch; returns how many
    /// are held now. The worker thread only, outside a function. Hot path.
    #[inline]
    pub fn hold(&self, answer: Answer) -> usize {
        // SAFETY: only the worker thread calls this, while no function runs
        // (see the Sync impl); the reference ends with the call.
        let held = unsafe { &mut *self.held.get() };
        assert!(
            held.len < MAX_HELD,
            "the thread sends its answers before it holds {MAX_HELD}"
        );
        held.answers[held.len] = answer;
        held.len += 1;
        held.len
    }

    /// Hands the held answers to `send`, then forgets them: the worker
    /// thread only, outside a function, and `send` holds none. Hot path.
    #[inline]
    pub fn drain_held<R>(&self, send: impl FnOnce(&[Answer]) -> R) -> R {
        // SAFETY: as in `hold`; nothing changes `held` while `send` runs.
        let r = send(unsafe { (*self.held.get()).as_slice() });
        // SAFETY: as in `hold`; the slice above is gone.
        unsafe { (*self.held.get()).len = 0 };
        r
    }

    /// How many answers the thread holds. The worker thread only. Hot path.
    #[inline]
    pub fn held_len(&self) -> usize {
        // SAFETY: as in `hold`.
        unsafe { (*self.held.get()).len }
    }

    /// The held answers of a thread whose endpoints the watchdog took over.
    fn held_after_take_over(&self) -> &[Answer] {
        // SAFETY: called by the watchdog after a successful take-over, when
        // the thread can no longer change them (see the Sync impl).
        unsafe { (*self.held.get()).as_slice() }
    }

    /// Records the calling thread as the lane's, for the crash handler.
    pub fn bind_thread(&self) {
        self.tid.store(crate::gettid(), Ordering::Relaxed);
    }

    /// Whether thread `tid` is this lane's and inside a function.
    /// Async-signal-safe (atomics only).
    pub fn crashed_here(&self, tid: libc::pid_t) -> bool {
        self.tid.load(Ordering::Relaxed) == tid && self.started().is_some()
    }

    /// The stamp of the lane's current function; `None` while it is idle
    /// or its endpoint was taken over.
    fn started(&self) -> Option<u64> {
        let started = self.started_ns.load(Ordering::Acquire);
        (started != 0 && started != TAKEN).then_some(started)
    }

    /// Takes the endpoints over from the function that started at
    /// `started`; `None` when that function returned meanwhile. Returns the
    /// invocation to answer, on which lane, where, and the bytes the
    /// client's output buffer takes.
    fn take_over(&self, started: u64) -> Option<TakenOver> {
        self.started_ns
            .compare_exchange(started, TAKEN, Ordering::AcqRel, Ordering::Relaxed)
            .ok()?;
        let remote = RemoteAddr {
            addr: self.output_addr.load(Ordering::Relaxed),
            rkey: self.output_rkey.load(Ordering::Relaxed),
        };
        Some(TakenOver {
            lane: self.lane.load(Ordering::Relaxed) as usize,
            id: self.invocation_id.load(Ordering::Relaxed),
            remote,
            capacity: self.output_capacity.load(Ordering::Relaxed),
        })
    }
}

/// The invocation the watchdog answers for.
#[derive(Debug, Clone, Copy)]
struct TakenOver {
    /// The thread's number for the lane.
    lane: usize,
    id: u32,
    remote: RemoteAddr,
    capacity: u32,
}

/// A worker thread's endpoints (one per lane it serves) and the completion
/// queue they all complete into, shared by the thread and the watchdog,
/// used by one of them at a time (see the module docs).
pub struct ThreadFabric {
    endpoints: Vec<Endpoint>,
    cq: UnsafeCell<CompletionQueue>,
}

// SAFETY: `Endpoint` and `CompletionQueue` are `Send` (checked below); the
// lane uses them only while its `Running` start time is 0 (outside the
// function) and the watchdog only after swapping a nonzero start time for
// `TAKEN`, which the lane can never undo. The compare-and-swaps order every
// use before the next user's, so neither is used from two threads at once,
// and a `&mut` to the queue lives only inside one `poll` or `wait` call.
unsafe impl Sync for ThreadFabric {}

const _: () = {
    const fn sendable<T: Send>() {}
    sendable::<Endpoint>();
    sendable::<CompletionQueue>();
};

impl std::fmt::Debug for ThreadFabric {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ThreadFabric")
            .field("endpoints", &self.endpoints)
            .finish_non_exhaustive()
    }
}

impl ThreadFabric {
    /// Wraps a thread's endpoints, in its lane order, and the completion
    /// queue they complete into.
    pub fn new(endpoints: Vec<Endpoint>, cq: CompletionQueue) -> ThreadFabric {
        ThreadFabric {
            endpoints,
            cq: UnsafeCell::new(cq),
        }
    }

    /// The endpoint of the thread's lane `lane`, outside the function call
    /// only.
    #[inline]
    pub fn get(&self, lane: usize) -> &Endpoint {
        &self.endpoints[lane]
    }

    /// Polls the queue, for whoever uses the endpoint now. Hot path.
    #[inline]
    pub fn poll(&self, out: &mut [Completion]) -> usize {
        // SAFETY: only the endpoint's current user calls this (module docs),
        // and the reference ends with the call.
        unsafe { (*self.cq.get()).poll(out) }
    }

    /// Waits on the queue up to `timeout`, for whoever uses the endpoint now.
    pub fn wait(&self, out: &mut [Completion], timeout: Duration) -> rfaas_fabric::Result<usize> {
        // SAFETY: as in poll.
        unsafe { (*self.cq.get()).wait(out, timeout) }
    }
}

/// What the watchdog needs of one worker thread to answer its clients.
#[derive(Debug)]
pub struct ThreadWatch {
    /// Published by the thread.
    pub running: Arc<Running>,
    /// The thread's endpoints and queue.
    pub fabric: Arc<ThreadFabric>,
    /// Per lane of the thread, its slots' output buffers, in slot order
    /// (a power of two of them): held answers are sent from them, and a
    /// crash response's signal from the start of the crashed invocation's
    /// own slot, which no other answer uses.
    pub regions: Vec<Box<[Arc<MemoryRegion>]>>,
}

/// Starts the watchdog over `threads`, with `deadline` for every function
/// (`None`: no deadline, crashes only); a crash is marked in `meter`, the
/// daemon's meter area, before it is answered.
pub fn spawn(
    threads: Vec<ThreadWatch>,
    deadline: Option<Duration>,
    meter: Option<&'static MeterArea>,
) -> std::io::Result<()> {
    let tick = deadline.map(|d| (d / 4).clamp(Duration::from_millis(1), Duration::from_millis(50)));
    thread::Builder::new()
        .name("rfaas-watchdog".into())
        .spawn(move || loop {
            if let Some(c) = crash::wait(tick) {
                crashed(&threads, c, meter);
            }
            let Some(deadline) = deadline else { continue };
            let deadline_ms = deadline.as_millis() as u64;
            let now = coarse_ms();
            for (i, thread) in threads.iter().enumerate() {
                let Some(started) = thread.running.started() else {
                    continue;
                };
                if now.saturating_sub(started_ms(started)) <= deadline_ms {
                    continue;
                }
                // Fails if that function just returned.
                if let Some(t) = thread.running.take_over(started) {
                    overran(i, thread, t, deadline);
                }
            }
        })
        .map(drop)
}

/// Answers `function_crashed` for crash `c`, carrying the signal as a
/// 4-byte little-endian output when the client's buffer takes it, lets it
/// leave, and lets the crashed thread die. Never returns: the process is
/// ending. First it marks the crash in `meter`: a client that allocates
/// again under the same lease at once finds the daemon counting this
/// worker's cores as about to be free, not as taken for good.
fn crashed(threads: &[ThreadWatch], c: Crash, meter: Option<&MeterArea>) -> ! {
    tracing::error!(
        thread = c.thread,
        signal = c.signal,
        "a function crashed; answering function_crashed and ending the worker"
    );
    if let Some(m) = meter {
        m.mark_crashed(c.signal);
    }
    // The crashed thread is stopped inside its function, which cannot
    // return.
    if let Some((thread, t)) = threads.get(c.thread).and_then(|w| {
        let started = w.running.started()?;
        w.running.take_over(started).map(|t| (w, t))
    }) {
        let len = if t.capacity >= 4 { 4 } else { 0 };
        if let Some(region) = thread.region_of(t.lane, t.id) {
            // SAFETY: the region is at least a page, ours, and nobody else
            // writes it: its thread is stopped in the signal handler.
            unsafe {
                region
                    .as_ptr()
                    .cast::<[u8; 4]>()
                    .write_unaligned((c.signal as u32).to_le_bytes())
            };
            answer(c.thread, thread, t, InvocationStatus::FunctionCrashed, len);
        }
    }
    crash::answered();
    loop {
        thread::park();
    }
}

/// Answers `deadline_exceeded` for `thread` and ends the process.
fn overran(index: usize, thread: &ThreadWatch, t: TakenOver, deadline: Duration) -> ! {
    tracing::error!(
        thread = index,
        lane = t.lane,
        invocation_id = t.id,
        deadline_ms = deadline.as_millis() as u64,
        "a function ran past the deadline; answering deadline_exceeded and ending the worker"
    );
    answer(index, thread, t, InvocationStatus::DeadlineExceeded, 0);
    // SAFETY: _exit ends the process without running destructors or atexit
    // handlers, which could wait on the lane stuck in user code.
    unsafe { libc::_exit(EXIT_DEADLINE) }
}

impl ThreadWatch {
    /// The output buffer of invocation `id`'s slot on lane `lane`.
    fn region_of(&self, lane: usize, id: u32) -> Option<&Arc<MemoryRegion>> {
        let slots = self.regions.get(lane)?;
        slots.get(id as usize & slots.len().wrapping_sub(1))
    }
}

/// Sends the answers the thread held, then the first `len` bytes of the
/// taken-over invocation's slot buffer to its client with `status`, and
/// waits until every one of these writes has completed, [`RESPONSE_GRACE`]
/// at most.
fn answer(index: usize, thread: &ThreadWatch, t: TakenOver, status: InvocationStatus, len: usize) {
    let mut posted = 0usize;
    let held = thread.running.held_after_take_over();
    if !held.is_empty() {
        tracing::info!(
            thread = index,
            answers = held.len(),
            "sending the answers the thread held"
        );
    }
    for a in held {
        let lane = a.lane as usize;
        let (Some(endpoint), Some(region)) = (
            thread.fabric.endpoints.get(lane),
            thread
                .regions
                .get(lane)
                .and_then(|r| r.get(a.slot as usize)),
        ) else {
            continue;
        };
        match endpoint.write_with_imm(
            HELD_WR_ID,
            region,
            a.offset as usize,
            a.len as usize,
            a.to,
            a.imm,
        ) {
            Ok(()) => posted += 1,
            Err(e) => {
                tracing::warn!(thread = index, lane, error = %e, "cannot send an answer the thread held")
            }
        }
    }
    let imm = ResponseImm {
        invocation_id: t.id,
        status,
    }
    .encode()
    .unwrap_or(status.code() as u32);
    let (Some(endpoint), Some(region)) = (
        thread.fabric.endpoints.get(t.lane),
        thread.region_of(t.lane, t.id),
    ) else {
        return;
    };
    match endpoint.write_with_imm(WATCHDOG_WR_ID, region, 0, len, t.remote, imm) {
        Ok(()) => posted += 1,
        Err(e) => {
            tracing::warn!(thread = index, error = %e, %status, "cannot send the watchdog's response")
        }
    }
    let until = Instant::now() + RESPONSE_GRACE;
    let mut done = [Completion::EMPTY; 16];
    while posted > 0 {
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            tracing::warn!(thread = index, %status, "the watchdog's responses did not complete in time; ending anyway");
            return;
        }
        // Other completions (requests the lane will never serve) are
        // dropped: the process is ending.
        match thread.fabric.wait(&mut done, left) {
            Ok(n) => {
                for c in &done[..n] {
                    if c.wr_id != WATCHDOG_WR_ID && c.wr_id != HELD_WR_ID {
                        continue;
                    }
                    posted -= 1;
                    if !c.status.is_ok() {
                        tracing::warn!(thread = index, %status, completion = %c.status, "a response the watchdog sent failed");
                    }
                }
            }
            Err(e) => {
                tracing::warn!(thread = index, error = %e, %status, "cannot wait for the watchdog's responses");
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stamps_of_one_tick_differ_and_keep_their_start() {
        let (a, b) = (stamp(1234, 1), stamp(1234, 2));
        assert_ne!(a, b, "two invocations in one tick");
        assert_eq!((started_ms(a), started_ms(b)), (1234, 1234));
        // The count wraps below the time, never into it.
        assert_eq!(started_ms(stamp(1234, u32::MAX)), 1234);
        assert_ne!(stamp(0, 0), 0, "0 means idle");
        assert_ne!(stamp(u64::MAX >> SEQ_BITS, u32::MAX), TAKEN);
    }

    #[test]
    fn a_running_thread_publishes_a_fresh_stamp_per_invocation() {
        let r = Running::default();
        let remote = RemoteAddr { addr: 1, rkey: 2 };
        let first = r.start(0, 7, remote, 64);
        assert_eq!(r.started(), Some(first));
        assert!(r.finish(first));
        assert_eq!(r.started(), None);
        let second = r.start(3, 8, remote, 64);
        assert_ne!(first, second);
        // A take-over aimed at the first function misses the second.
        assert!(r.take_over(first).is_none());
        let t = r.take_over(second).expect("the second function still runs");
        assert_eq!((t.lane, t.id, t.capacity), (3, 8, 64), "whom to answer");
        assert!(!r.finish(second), "the watchdog has the endpoint");
    }
}

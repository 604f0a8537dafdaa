//! The deadline watchdog: one thread that ends the worker when a function
//! runs longer than the allocation's deadline.
//!
//! Each lane publishes, in a [`Running`], when its current function started
//! and whom to answer. The watchdog answers `deadline_exceeded` to that
//! client itself, gives the response a moment to leave, and ends the
//! process with [`EXIT_DEADLINE`]: a function that
//! overran cannot be stopped inside a thread, only with its process.
//!
//! Endpoints are `Send` but not all are `Sync` (shm's is not), so the lane
//! and the watchdog never use one at the same time: while a function runs
//! the lane leaves its endpoint alone, and the watchdog takes it over by
//! swapping the start time for `TAKEN` with a compare-and-swap. A lane
//! whose function returns after that finds its start time gone and parks
//! until the process ends.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread;
use std::time::{Duration, Instant};

use rfaas_fabric::{Endpoint, MemoryRegion, RemoteAddr};
use rfaas_proto::{InvocationStatus, ResponseImm};

use super::EXIT_DEADLINE;

/// How long the response to an overrunning invocation gets to leave before
/// the process ends.
const RESPONSE_GRACE: Duration = Duration::from_millis(200);

/// The wr_id of the watchdog's response.
const WATCHDOG_WR_ID: u64 = u64::MAX;

/// The start time of a lane whose endpoint the watchdog took over.
const TAKEN: u64 = u64::MAX;

/// Nanoseconds since the process's first call, never 0.
pub fn now_ns() -> u64 {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    let epoch = *EPOCH.get_or_init(Instant::now);
    (epoch.elapsed().as_nanos() as u64).clamp(1, TAKEN - 1)
}

/// What one lane is running, published with atomics (the lane writes, the
/// watchdog reads).
#[derive(Debug, Default)]
pub struct Running {
    /// [`now_ns`] when the function started; 0 while the lane is idle.
    started_ns: AtomicU64,
    /// The invocation id.
    invocation_id: AtomicU32,
    /// The client's output buffer.
    output_addr: AtomicU64,
    /// Its rkey.
    output_rkey: AtomicU32,
}

impl Running {
    /// Marks a function as started; returns the stamp to hand to
    /// [`Running::finish`]. Hot path.
    #[inline]
    pub fn start(&self, invocation_id: u32, output: RemoteAddr) -> u64 {
        self.invocation_id.store(invocation_id, Ordering::Relaxed);
        self.output_addr.store(output.addr, Ordering::Relaxed);
        self.output_rkey.store(output.rkey, Ordering::Relaxed);
        let stamp = now_ns();
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
}

/// A lane's endpoint, shared by the lane and the watchdog, used by one of
/// them at a time (see the module docs).
#[derive(Debug)]
pub struct LaneEndpoint(Endpoint);

// SAFETY: `Endpoint` is `Send` (checked below); the lane uses it only while
// its `Running` start time is 0 (outside the function) and the watchdog only
// after swapping a nonzero start time for `TAKEN`, which the lane can never
// undo. The compare-and-swaps order every use before the next user's, so
// the endpoint is never used from two threads at once.
unsafe impl Sync for LaneEndpoint {}

const _: () = {
    const fn sendable<T: Send>() {}
    sendable::<Endpoint>();
};

impl LaneEndpoint {
    /// Wraps a lane's endpoint.
    pub fn new(endpoint: Endpoint) -> LaneEndpoint {
        LaneEndpoint(endpoint)
    }

    /// The endpoint, for its lane, outside the function call only.
    #[inline]
    pub fn get(&self) -> &Endpoint {
        &self.0
    }
}

/// What the watchdog needs of one lane to answer its client.
#[derive(Debug)]
pub struct LaneWatch {
    /// Published by the lane.
    pub running: Arc<Running>,
    /// The lane's endpoint.
    pub endpoint: Arc<LaneEndpoint>,
    /// Any region of the endpoint's domain (the response is empty).
    pub region: Arc<MemoryRegion>,
}

/// Starts the watchdog over `lanes` with `deadline`.
pub fn spawn(lanes: Vec<LaneWatch>, deadline: Duration) -> std::io::Result<()> {
    let tick = (deadline / 4).clamp(Duration::from_millis(1), Duration::from_millis(50));
    let deadline_ns = deadline.as_nanos() as u64;
    thread::Builder::new()
        .name("rfaas-watchdog".into())
        .spawn(move || loop {
            thread::sleep(tick);
            let now = now_ns();
            for (i, lane) in lanes.iter().enumerate() {
                let started = lane.running.started_ns.load(Ordering::Acquire);
                if started == 0 || started == TAKEN || now.saturating_sub(started) <= deadline_ns {
                    continue;
                }
                // Take the endpoint over; fails if the function just returned.
                if lane
                    .running
                    .started_ns
                    .compare_exchange(started, TAKEN, Ordering::AcqRel, Ordering::Relaxed)
                    .is_err()
                {
                    continue;
                }
                let id = lane.running.invocation_id.load(Ordering::Relaxed);
                let remote = RemoteAddr {
                    addr: lane.running.output_addr.load(Ordering::Relaxed),
                    rkey: lane.running.output_rkey.load(Ordering::Relaxed),
                };
                overran(i, lane, id, remote, deadline);
            }
        })
        .map(drop)
}

/// Answers `deadline_exceeded` on `lane` and ends the process.
fn overran(index: usize, lane: &LaneWatch, id: u32, remote: RemoteAddr, deadline: Duration) -> ! {
    tracing::error!(
        lane = index,
        invocation_id = id,
        deadline_ms = deadline.as_millis() as u64,
        "a function ran past the deadline; answering deadline_exceeded and ending the worker"
    );
    let imm = ResponseImm {
        invocation_id: id,
        status: InvocationStatus::DeadlineExceeded,
    }
    .encode()
    .unwrap_or(InvocationStatus::DeadlineExceeded.code() as u32);
    if let Err(e) =
        lane.endpoint
            .get()
            .write_with_imm(WATCHDOG_WR_ID, &lane.region, 0, 0, remote, imm)
    {
        tracing::warn!(lane = index, error = %e, "cannot send the deadline_exceeded response");
    }
    thread::sleep(RESPONSE_GRACE);
    // SAFETY: _exit ends the process without running destructors or atexit
    // handlers, which could wait on the lane stuck in user code.
    unsafe { libc::_exit(EXIT_DEADLINE) }
}

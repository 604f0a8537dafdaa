//! What each lease used on this node: the [`Ledger`], the daemon's
//! cumulative, trusted figures per lease, over every allocation the lease
//! had here. They are what the daemon reports to people (the node tools'
//! `usage` request) and what a poster adds into the accounting service.
//!
//! # The trust model
//!
//! The daemon is trusted; the worker is not, because it runs user code in
//! its own address space, where the meter area ([`rfaas_proto::meter`]) is
//! mapped writable. A function can write anything into its lanes' records,
//! at any moment. So each figure rests on what the daemon knows by itself,
//! and the worker's word only splits or fills in within those bounds:
//!
//! | figure | source | bound |
//! |---|---|---|
//! | `alloc_mib_ms` | the daemon's clock, from the assignment to the worker's end, times the allocation's memory | its own |
//! | `cpu_ns` | the kernel ([`cpu`]): the allocation's cgroup `cpu.stat`, or the worker's CPU clock and its `wait4` usage at reap, less what it used before its assignment | its own |
//! | `hot_ns` | the lanes' hot-polling time | at most `cpu_ns` |
//! | `compute_ns` | `cpu_ns - hot_ns` | `compute_ns + hot_ns == cpu_ns` exactly |
//! | `warm_ns` | the worker threads' blocked time | at most threads × allocation wall time |
//! | `invocations` | the lanes' count | at most one per 50 ns of `cpu_ns` |
//! | `bytes_in`, `bytes_out` | the lanes' counts | at most `invocations` × the allocation's input (payload limit) or output capacity |
//!
//! Every figure only grows: each new reading is clamped between the last
//! figure and its bound, so a worker that writes zeros, or a smaller value
//! than before, changes nothing, and one that writes huge values gets the
//! bound. In particular a function can move CPU time between `compute_ns`
//! and `hot_ns` (it decides what it reports as polling), but never make
//! their sum differ from what the kernel counted for its worker, up or
//! down; and it can only reach its own lease's figures (each allocation
//! has its own area and its own process).
//!
//! What the kernel's figure does not see: without a cgroup, CPU time of
//! processes a function forks and never waits for (they are not the
//! worker's threads, and their usage is not added to the worker's at its
//! end). With a cgroup every process in it counts.
//!
//! # Reading
//!
//! Figures are sampled when asked for ([`Ledger::snapshot`],
//! [`Ledger::totals`]): the worker's CPU time (one system call, or one
//! small file read with a cgroup) and each lane's record (a seqlock read of
//! one cache line pair) per running allocation. A lane's live total counts
//! the phase under way up to the daemon's clock now. When a worker ends,
//! the watcher reaps it and closes its allocation with the kernel's final
//! figure ([`Ledger::close`]); when that was the lease's last running
//! allocation, the lease's figures are final ([`LeaseUsage::ended`]) and go
//! to the subscriber ([`Ledger::subscribe`]) at once. Ended leases stay in
//! the snapshot at least [`ENDED_KEPT`] and until their lease expired, so
//! the figures of a lease never restart from zero while it can allocate.

pub(crate) mod cpu;

use std::collections::BTreeMap;
use std::sync::mpsc;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use rfaas_proto::accounting::{BillingSlot, UsageFigures};
use rfaas_proto::control::local::LeaseUsage;
use rfaas_proto::lease::LeaseClaims;
use rfaas_proto::meter::LaneState;

use crate::meter::{MeterArea, TickClock};
use cpu::CpuSource;

/// How long an ended lease stays in the snapshot at least.
pub(crate) const ENDED_KEPT: Duration = Duration::from_secs(60);

/// Most ended leases kept; the oldest go first beyond it.
pub(crate) const ENDED_MAX: usize = 65_536;

/// Least CPU time an invocation costs its worker (a hot lane's poll,
/// decode and answer take several times more): bounds `invocations`.
pub(crate) const MIN_INVOCATION_CPU_NS: u64 = 50;

/// Finals queued for a subscriber that does not read, at most.
const FINALS_QUEUED: usize = 4096;

/// Reads of a lane record before the daemon takes what it read (a worker
/// that keeps its record's sequence odd cannot hold the daemon).
const RECORD_TRIES: u32 = 8;

/// Cumulative figures, of one allocation, one lease or the node: the
/// kernel's CPU time, which the usage figures split (`compute_ns + hot_ns
/// == cpu_ns`), and the rest of them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Figures {
    /// The kernel's CPU time, ns.
    pub cpu_ns: u64,
    /// `compute_ns` is `cpu_ns - hot_ns`.
    pub usage: UsageFigures,
}

impl Figures {
    fn add(&mut self, o: &Figures) {
        self.cpu_ns = self.cpu_ns.saturating_add(o.cpu_ns);
        self.usage.add(&o.usage);
    }
}

/// What the worker's lanes report, summed over lanes, live, in ns.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Reported {
    /// Inside the function (not used for billing: `compute_ns` is the
    /// kernel's figure less hot-polling).
    pub compute_ns: u64,
    /// Polling.
    pub hot_ns: u64,
    /// Blocked waiting.
    pub warm_ns: u64,
    /// Functions called.
    pub invocations: u64,
    /// Input bytes.
    pub bytes_in: u64,
    /// Output bytes.
    pub bytes_out: u64,
}

/// What the daemon knows of an allocation by itself: the bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Limits {
    /// Lanes.
    pub lanes: u16,
    /// Worker threads: the most time spent waiting at once is one per
    /// thread (a thread waits for all its lanes, in its first lane's
    /// record).
    pub threads: u16,
    /// Memory, MiB.
    pub memory_mib: u32,
    /// Most input bytes one invocation can hand the function.
    pub max_in: u64,
    /// Most output bytes one invocation can return.
    pub max_out: u64,
}

/// `v` clamped into `[lo, max(lo, hi)]`: never panics, never below `lo`.
fn between(v: u64, lo: u64, hi: u64) -> u64 {
    v.max(lo).min(hi.max(lo))
}

/// The next figures of an allocation whose last ones were `prev`, from
/// the kernel's CPU time since the assignment, the allocation's wall time
/// by the daemon's clock and what its lanes report. The trust model (module
/// docs) in one place: every figure grows, within its bound.
pub(crate) fn bound(
    prev: &Figures,
    cpu_ns: u64,
    wall_ns: u64,
    rep: &Reported,
    lim: &Limits,
) -> Figures {
    let cpu = prev.cpu_ns.max(cpu_ns);
    let prev = &prev.usage;
    // prev.hot + prev.compute == prev.cpu <= cpu, so both can only grow.
    let hot = between(rep.hot_ns, prev.hot_ns, cpu.saturating_sub(prev.compute_ns));
    let compute = cpu - hot;
    let threads_wall = wall_ns.saturating_mul(u64::from(lim.threads.max(1)));
    let warm = between(rep.warm_ns, prev.warm_ns, threads_wall);
    let invocations = between(
        rep.invocations,
        prev.invocations,
        cpu / MIN_INVOCATION_CPU_NS,
    );
    let bytes_in = between(
        rep.bytes_in,
        prev.bytes_in,
        invocations.saturating_mul(lim.max_in),
    );
    let bytes_out = between(
        rep.bytes_out,
        prev.bytes_out,
        invocations.saturating_mul(lim.max_out),
    );
    let mib_ms = u128::from(wall_ns) * u128::from(lim.memory_mib) / 1_000_000;
    let alloc_mib_ms = prev
        .alloc_mib_ms
        .max(u64::try_from(mib_ms).unwrap_or(u64::MAX));
    Figures {
        cpu_ns: cpu,
        usage: UsageFigures {
            alloc_mib_ms,
            compute_ns: compute,
            hot_ns: hot,
            warm_ns: warm,
            invocations,
            bytes_in,
            bytes_out,
        },
    }
}

/// A moment by the daemon's clocks: for wall time, and for the lanes'
/// phases under way.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Stamp {
    at: Instant,
    ticks: u64,
}

/// A worker about to get its assignment: the area it gets, where its CPU
/// time is read and what it had used before.
#[derive(Debug)]
pub(crate) struct Opening {
    area: MeterArea,
    cpu: CpuSource,
    cpu_base: u64,
    opened: Stamp,
}

impl Opening {
    /// Gives back the area of an opening whose worker never got it.
    pub(crate) fn into_area(self) -> MeterArea {
        self.area
    }
}

/// Where an allocation's meter started: what a runtime record keeps so
/// that a daemon adopting the worker meters it on from the same start
/// (not from the adoption: nothing the previous daemon had not posted is
/// lost, and the lanes' counters, which run from the worker's assignment,
/// are not counted twice).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Origin {
    /// Where its CPU time is read.
    pub cpu: CpuSource,
    /// The CPU time before its assignment, ns.
    pub cpu_base: u64,
    /// The assignment, on `CLOCK_MONOTONIC` (the same for every process
    /// until the node reboots), ns.
    pub opened_mono_ns: u64,
}

/// A running allocation's meter.
#[derive(Debug)]
struct Metered {
    lease_id: u64,
    area: MeterArea,
    limits: Limits,
    cpu: CpuSource,
    cpu_base: u64,
    opened: Instant,
    last: Figures,
}

/// A billed lease, as [`Ledger::billed`] lists it.
#[derive(Debug, Clone)]
pub(crate) struct Billed {
    /// Its figures.
    pub usage: LeaseUsage,
    /// Its accounting slot.
    pub slot: BillingSlot,
    /// When its latest token ends, Unix seconds.
    pub expires_at: u64,
}

/// A lease's part of the ledger.
#[derive(Debug)]
struct Lease {
    lease_id: u64,
    node: String,
    user: String,
    account: String,
    job_id: Option<u64>,
    /// Unix seconds; the latest of its allocations' tokens.
    expires_at: u64,
    /// Figures of its ended allocations.
    closed: Figures,
    allocations: u32,
    running: u32,
    /// When its last running allocation ended.
    ended_at: Option<Instant>,
    /// Where its usage is billed, as its token says.
    billing: Option<BillingSlot>,
}

#[derive(Debug, Default)]
struct Inner {
    leases: BTreeMap<u64, Lease>,
    running: BTreeMap<u64, Metered>,
    /// Figures of every ended allocation since the daemon started.
    retired: Figures,
    finals: Option<mpsc::SyncSender<LeaseUsage>>,
}

/// The daemon's usage figures per lease (module docs). Cheap to read every
/// 100 ms: a sample costs one CPU-time read per running allocation and one
/// record read per lane, under one short lock of its own.
#[derive(Debug)]
pub(crate) struct Ledger {
    clock: TickClock,
    inner: Mutex<Inner>,
}

impl Ledger {
    /// An empty ledger whose meter areas tick with `clock`.
    pub(crate) fn new(clock: TickClock) -> Ledger {
        Ledger {
            clock,
            inner: Mutex::default(),
        }
    }

    /// The clock meter areas are made for.
    pub(crate) fn clock(&self) -> TickClock {
        self.clock
    }

    /// Now, by the daemon's clocks.
    pub(crate) fn now(&self) -> Stamp {
        Stamp {
            at: Instant::now(),
            ticks: self.clock.now(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The ledger with every running lease sampled now and what ended
    /// long ago pruned: what a report reads.
    fn sampled(&self) -> MutexGuard<'_, Inner> {
        let now = self.now();
        let mut inner = self.lock();
        sample_running(&mut inner, self.clock, now);
        prune(&mut inner, now.at, unix_now());
        inner
    }

    /// Takes what the worker whose CPU time `cpu` measures has used so far,
    /// just before its assignment `area` is sent: the allocation's meter
    /// starts now.
    pub(crate) fn opening(&self, area: MeterArea, cpu: CpuSource) -> Opening {
        let cpu_base = cpu.read_ns().unwrap_or(0);
        Opening {
            area,
            cpu,
            cpu_base,
            opened: self.now(),
        }
    }

    /// Where allocation `id`'s meter started; `None` for one not metered.
    pub(crate) fn origin(&self, id: u64) -> Option<Origin> {
        let inner = self.lock();
        let m = inner.running.get(&id)?;
        let age = u64::try_from(m.opened.elapsed().as_nanos()).unwrap_or(u64::MAX);
        Some(Origin {
            cpu: m.cpu.clone(),
            cpu_base: m.cpu_base,
            opened_mono_ns: crate::meter::monotonic_ns().saturating_sub(age),
        })
    }

    /// The opening of an adopted worker's allocation, which another daemon
    /// started at `origin`: its figures go on from where that daemon's
    /// were.
    pub(crate) fn resume(&self, area: MeterArea, origin: Origin) -> Opening {
        let now = self.now();
        let age = Duration::from_nanos(
            crate::meter::monotonic_ns().saturating_sub(origin.opened_mono_ns),
        );
        Opening {
            area,
            cpu: origin.cpu,
            cpu_base: origin.cpu_base,
            opened: Stamp {
                at: now.at.checked_sub(age).unwrap_or(now.at),
                ticks: now.ticks,
            },
        }
    }

    /// Adds what lease `lease_id`'s allocations that ended under a
    /// previous daemon used ([`Ledger::carried`] there) to its figures
    /// here. Call it after the lease's adopted allocations were opened.
    pub(crate) fn carry(&self, lease_id: u64, cpu_ns: u64, usage: &UsageFigures, allocations: u32) {
        if let Some(l) = self.lock().leases.get_mut(&lease_id) {
            l.closed.add(&Figures {
                cpu_ns,
                usage: *usage,
            });
            l.allocations = l.allocations.saturating_add(allocations);
        }
    }

    /// Lease `lease_id`'s ended allocations' figures (CPU ns and the
    /// rest), its allocations ended so far and those still running.
    pub(crate) fn carried(&self, lease_id: u64) -> Option<(u64, UsageFigures, u32, u32)> {
        let inner = self.lock();
        let l = inner.leases.get(&lease_id)?;
        Some((
            l.closed.cpu_ns,
            l.closed.usage,
            l.allocations.saturating_sub(l.running),
            l.running,
        ))
    }

    /// Starts metering allocation `id` of the lease of `claims`, whose
    /// worker answered ready. Call it under the state lock, with the
    /// allocation still there, so its watcher closes it after.
    pub(crate) fn open(&self, id: u64, claims: &LeaseClaims, opening: Opening, limits: Limits) {
        let mut inner = self.lock();
        let lease = inner
            .leases
            .entry(claims.lease_id)
            .or_insert_with(|| Lease {
                lease_id: claims.lease_id,
                node: claims.node.clone(),
                user: claims.user.clone(),
                account: claims.account.clone(),
                job_id: claims.job_id,
                expires_at: claims.expires_at,
                closed: Figures::default(),
                allocations: 0,
                running: 0,
                ended_at: None,
                billing: claims.billing.clone(),
            });
        lease.expires_at = lease.expires_at.max(claims.expires_at);
        if lease.billing.is_none() {
            lease.billing = claims.billing.clone();
        }
        lease.allocations += 1;
        lease.running += 1;
        lease.ended_at = None;
        inner.running.insert(
            id,
            Metered {
                lease_id: claims.lease_id,
                area: opening.area,
                limits,
                cpu: opening.cpu,
                cpu_base: opening.cpu_base,
                opened: opening.opened.at,
                last: Figures::default(),
            },
        );
    }

    /// Closes allocation `id` (a no-op for one never opened): its worker
    /// ended at `ended` and was reaped with `reaped_cpu_ns` of CPU time
    /// (its `wait4` usage). Call it before the allocation's cgroup is
    /// removed. Returns the lease's figures when this was its last running
    /// allocation; they also go to the subscriber.
    pub(crate) fn close(
        &self,
        id: u64,
        ended: Stamp,
        reaped_cpu_ns: Option<u64>,
    ) -> Option<LeaseUsage> {
        let mut inner = self.lock();
        let m = inner.running.remove(&id)?;
        let kernel = match &m.cpu {
            CpuSource::Cgroup(_) => m.cpu.read_ns(),
            CpuSource::Process { .. } => reaped_cpu_ns,
        };
        let last = sample(&m, self.clock, ended, kernel);
        inner.retired.add(&last);
        let lease = inner.leases.get_mut(&m.lease_id)?;
        lease.closed.add(&last);
        lease.running = lease.running.saturating_sub(1);
        if lease.running > 0 {
            return None;
        }
        lease.ended_at = Some(ended.at);
        let lease_id = m.lease_id;
        let done = report(&inner, lease_id)?;
        tracing::info!(
            lease = lease_id,
            allocations = done.allocations,
            cpu_ns = done.cpu_ns,
            compute_ns = done.usage.compute_ns,
            hot_ns = done.usage.hot_ns,
            warm_ns = done.usage.warm_ns,
            invocations = done.usage.invocations,
            alloc_mib_ms = done.usage.alloc_mib_ms,
            "the lease's last allocation here ended; its usage is final"
        );
        if let Some(tx) = &inner.finals {
            match tx.try_send(done.clone()) {
                Ok(()) => {}
                Err(mpsc::TrySendError::Full(_)) => {
                    tracing::warn!(lease = lease_id, "the usage subscriber is {FINALS_QUEUED} finals behind; this one is only in the snapshot");
                }
                Err(mpsc::TrySendError::Disconnected(_)) => inner.finals = None,
            }
        }
        prune(&mut inner, ended.at, unix_now());
        Some(done)
    }

    /// Every lease running here or ended recently, with its figures
    /// sampled now, by lease id.
    pub(crate) fn snapshot(&self) -> Vec<LeaseUsage> {
        let inner = self.sampled();
        inner
            .leases
            .keys()
            .filter_map(|&id| report(&inner, id))
            .collect()
    }

    /// Every lease whose token names an accounting slot, with the slot, its
    /// figures sampled now, and when its latest token ends.
    pub(crate) fn billed(&self) -> Vec<Billed> {
        let inner = self.sampled();
        inner
            .leases
            .values()
            .filter_map(|l| {
                let slot = l.billing.clone()?;
                let usage = report(&inner, l.lease_id)?;
                Some(Billed {
                    usage,
                    slot,
                    expires_at: l.expires_at,
                })
            })
            .collect()
    }

    /// The signal allocation `id`'s worker marked its meter area with, if
    /// a function crashed it (it is ending; the worker's word, see
    /// [`MeterArea::crashed`]).
    pub(crate) fn crashed(&self, id: u64) -> Option<i32> {
        self.lock().running.get(&id).and_then(|m| m.area.crashed())
    }

    /// A renewal moved lease `lease_id`'s end to `expires_at` (Unix
    /// seconds): it is not over before then.
    pub(crate) fn renewed(&self, lease_id: u64, expires_at: u64) {
        if let Some(l) = self.lock().leases.get_mut(&lease_id) {
            l.expires_at = l.expires_at.max(expires_at);
        }
    }

    /// One lease's figures, sampled now; `None` for a lease this daemon
    /// does not know (or forgot).
    pub(crate) fn lease(&self, lease_id: u64) -> Option<LeaseUsage> {
        let now = self.now();
        let mut inner = self.lock();
        sample_running(&mut inner, self.clock, now);
        report(&inner, lease_id)
    }

    /// The figures of every allocation since the daemon started, sampled
    /// now. Every field only grows.
    pub(crate) fn totals(&self) -> Figures {
        let now = self.now();
        let mut inner = self.lock();
        sample_running(&mut inner, self.clock, now);
        let mut t = inner.retired;
        for m in inner.running.values() {
            t.add(&m.last);
        }
        t
    }

    /// A receiver of every lease's final figures, sent when its last
    /// running allocation here ended (after its worker was reaped). One
    /// subscriber at a time: a new one replaces the old. Up to 4096 finals
    /// wait for a subscriber that does not read; later ones are only in the
    /// snapshot.
    // The accounting poster's entry point; nothing else waits for finals.
    #[allow(dead_code)]
    pub(crate) fn subscribe(&self) -> mpsc::Receiver<LeaseUsage> {
        let (tx, rx) = mpsc::sync_channel(FINALS_QUEUED);
        self.lock().finals = Some(tx);
        rx
    }
}

/// Samples every running allocation at `now`.
fn sample_running(inner: &mut Inner, clock: TickClock, now: Stamp) {
    for m in inner.running.values_mut() {
        let kernel = m.cpu.read_ns();
        m.last = sample(m, clock, now, kernel);
    }
}

/// `m`'s figures at `now`, with the kernel's CPU reading `kernel` (taken
/// at `now`; `None` keeps the last).
fn sample(m: &Metered, clock: TickClock, now: Stamp, kernel: Option<u64>) -> Figures {
    let cpu_ns = kernel.map_or(m.last.cpu_ns, |k| k.saturating_sub(m.cpu_base));
    let wall_ns = now.at.saturating_duration_since(m.opened).as_nanos();
    let wall_ns = u64::try_from(wall_ns).unwrap_or(u64::MAX);
    let rep = read_area(&m.area, m.limits.lanes, clock, now.ticks);
    bound(&m.last, cpu_ns, wall_ns, &rep, &m.limits)
}

/// The lanes' live totals at `now_ticks`, summed, in ns.
fn read_area(area: &MeterArea, lanes: u16, clock: TickClock, now_ticks: u64) -> Reported {
    let (mut compute, mut hot, mut warm) = (0u64, 0u64, 0u64);
    let mut r = Reported::default();
    for lane in 0..lanes {
        let Some(record) = area.record(lane) else {
            break;
        };
        let (v, _) = record.read(RECORD_TRIES);
        let (mut c, mut h, mut w) = (v.compute, v.hot, v.warm);
        let running = now_ticks.saturating_sub(v.since);
        match LaneState::from_code(v.state) {
            Some(LaneState::Function) => c = c.saturating_add(running),
            Some(LaneState::Hot) => h = h.saturating_add(running),
            Some(LaneState::Warm) => w = w.saturating_add(running),
            _ => {}
        }
        compute = compute.saturating_add(c);
        hot = hot.saturating_add(h);
        warm = warm.saturating_add(w);
        r.invocations = r.invocations.saturating_add(v.invocations);
        r.bytes_in = r.bytes_in.saturating_add(v.bytes_in);
        r.bytes_out = r.bytes_out.saturating_add(v.bytes_out);
    }
    r.compute_ns = clock.to_ns(compute);
    r.hot_ns = clock.to_ns(hot);
    r.warm_ns = clock.to_ns(warm);
    r
}

/// Lease `lease_id`'s figures as last sampled.
fn report(inner: &Inner, lease_id: u64) -> Option<LeaseUsage> {
    let l = inner.leases.get(&lease_id)?;
    let mut f = l.closed;
    for m in inner.running.values().filter(|m| m.lease_id == lease_id) {
        f.add(&m.last);
    }
    Some(LeaseUsage {
        lease_id: l.lease_id,
        node: l.node.clone(),
        user: l.user.clone(),
        account: l.account.clone(),
        job_id: l.job_id,
        ended: l.running == 0,
        allocations: l.allocations,
        cpu_ns: f.cpu_ns,
        usage: f.usage,
    })
}

/// Forgets ended leases older than [`ENDED_KEPT`] whose lease has expired
/// (no token of theirs allocates again), then the oldest ended beyond
/// [`ENDED_MAX`].
fn prune(inner: &mut Inner, now: Instant, unix_now: u64) {
    inner.leases.retain(|_, l| match l.ended_at {
        Some(at) => now.saturating_duration_since(at) < ENDED_KEPT || l.expires_at > unix_now,
        None => true,
    });
    let ended = inner.leases.values().filter(|l| l.running == 0).count();
    if ended > ENDED_MAX {
        let mut by_age: Vec<(Instant, u64)> = inner
            .leases
            .values()
            .filter_map(|l| Some((l.ended_at?, l.lease_id)))
            .collect();
        by_age.sort_unstable();
        for (_, id) in by_age.into_iter().take(ended - ENDED_MAX) {
            inner.leases.remove(&id);
        }
    }
}

fn unix_now() -> u64 {
    crate::daemon::clock::unix_now()
}

#[cfg(test)]
mod tests;

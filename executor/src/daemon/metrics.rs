//! Prometheus metrics, served by [`super::scrape`].
//!
//! Counters and the cold-start histogram are updated where things happen;
//! gauges of the node's state (allocations, workers by state, lanes by
//! mode, free capacity) are read from the shared state at each scrape, so
//! they cannot drift from it. The workers' usage counters (invocations,
//! CPU time split into compute and hot-polling, warm time) follow the
//! usage ledger's node totals, sampled at each scrape: every allocation
//! since the daemon started, running ones up to now.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use prometheus::{
    CounterVec, Encoder, Gauge, GaugeVec, Histogram, HistogramOpts, IntCounter, IntCounterVec,
    Opts, Registry, TextEncoder,
};
use rfaas_proto::accounting::UsageFigures;
use rfaas_proto::control::client::Mode;
use rfaas_proto::control::ErrorCode;

use super::state::State;

/// What the daemon has posted, for its metrics.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PosterStats {
    /// Batches of adds that landed.
    pub batches: u64,
    /// Leases closed.
    pub closed: u64,
    /// Leases given up.
    pub dropped: u64,
    /// Leases with figures not yet posted.
    pub pending: u64,
}

/// The daemon's metrics.
#[derive(Debug)]
pub(crate) struct Metrics {
    registry: Registry,
    allocations: IntCounterVec,
    cold_start: Histogram,
    heartbeats: IntCounterVec,
    registered: Gauge,
    allocations_now: Gauge,
    workers: GaugeVec,
    lanes: GaugeVec,
    cores: GaugeVec,
    memory: GaugeVec,
    invocations: IntCounter,
    worker_cpu: CounterVec,
    warm: prometheus::Counter,
    /// The ledger's totals as last exposed: the counters grow by the
    /// difference.
    exposed: Mutex<UsageFigures>,
    billing_posts: IntCounterVec,
    billing_pending: Gauge,
    /// The poster's figures as last exposed.
    billing_exposed: Mutex<PosterStats>,
    /// Set once the manager link registered; cleared while it fails.
    pub manager_ok: AtomicBool,
    control_tls_refused: IntCounterVec,
}

impl Metrics {
    pub(crate) fn new() -> Metrics {
        let registry =
            Registry::new_custom(Some("rfaas_executord".into()), None).expect("a valid prefix");
        let allocations = IntCounterVec::new(
            Opts::new(
                "allocations_total",
                "Allocation requests answered, by result (granted, or the refusal's code)",
            ),
            &["result"],
        )
        .expect("valid metric");
        let cold_start = Histogram::with_opts(
            HistogramOpts::new(
                "cold_start_seconds",
                "From a checked allocation request to its worker's readiness (validation, worker, load, listen)",
            )
            .buckets(vec![
                0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0,
            ]),
        )
        .expect("valid metric");
        let heartbeats = IntCounterVec::new(
            Opts::new(
                "manager_calls_total",
                "Registrations and heartbeats sent to the managers, by outcome",
            ),
            &["call", "outcome"],
        )
        .expect("valid metric");
        let registered = Gauge::new(
            "manager_registered",
            "1 while a manager accepts this node's heartbeats",
        )
        .expect("valid metric");
        let allocations_now =
            Gauge::new("allocations", "Allocations held now").expect("valid metric");
        let workers = GaugeVec::new(
            Opts::new(
                "workers",
                "Worker processes by state (pooled: idle and pre-spawned; starting; serving)",
            ),
            &["state"],
        )
        .expect("valid metric");
        let lanes = GaugeVec::new(
            Opts::new("lanes", "Lanes of live allocations by mode"),
            &["mode"],
        )
        .expect("valid metric");
        let cores = GaugeVec::new(
            Opts::new(
                "cores",
                "Cores lent, by state (free, allocated, withheld for Slurm jobs)",
            ),
            &["state"],
        )
        .expect("valid metric");
        let memory = GaugeVec::new(
            Opts::new("memory_mib", "Memory lent, MiB, by state (free, allocated)"),
            &["state"],
        )
        .expect("valid metric");
        let invocations = IntCounter::new(
            "invocations_total",
            "Functions called by the workers of every allocation since the daemon started \
             (the workers' count, bounded by their CPU time)",
        )
        .expect("valid metric");
        let worker_cpu = CounterVec::new(
            Opts::new(
                "worker_cpu_seconds_total",
                "CPU time of the workers since their assignment, as the kernel measures it, \
                 by use: hot_poll (hot lanes polling for requests, as the workers report it, \
                 at most their CPU time) and compute (the rest)",
            ),
            &["use"],
        )
        .expect("valid metric");
        let warm = prometheus::Counter::new(
            "warm_wait_seconds_total",
            "Time warm lanes spent blocked waiting for requests, summed over lanes",
        )
        .expect("valid metric");
        let billing_posts = IntCounterVec::new(
            Opts::new(
                "billing_posts_total",
                "Usage posted to accounting services: batches of adds that landed, leases closed, leases given up (dropped)",
            ),
            &["what"],
        )
        .expect("valid metric");
        let billing_pending = Gauge::new(
            "billing_pending_leases",
            "Leases whose usage is not yet all posted (grows while an accounting service is unreachable)",
        )
        .expect("valid metric");
        let control_tls_refused = IntCounterVec::new(
            Opts::new(
                "control_tls_refused_total",
                "Control connections closed before TLS was up, by reason (plain: no TLS where \
                 it is required; handshake_timeout; handshake_failed)",
            ),
            &["reason"],
        )
        .expect("valid metric");
        // Every outcome from the start, so alerts on failures have a series
        // to watch before the first one.
        for call in ["register", "heartbeat"] {
            for outcome in ["ok", "failed"] {
                heartbeats.with_label_values(&[call, outcome]);
            }
        }
        for what in ["batches", "closed", "dropped"] {
            billing_posts.with_label_values(&[what]);
        }
        for c in [
            Box::new(billing_posts.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(billing_pending.clone()),
            Box::new(control_tls_refused.clone()),
        ] {
            registry.register(c).expect("distinct metric names");
        }
        for c in [
            Box::new(allocations.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(invocations.clone()),
            Box::new(worker_cpu.clone()),
            Box::new(warm.clone()),
            Box::new(cold_start.clone()),
            Box::new(heartbeats.clone()),
            Box::new(registered.clone()),
            Box::new(allocations_now.clone()),
            Box::new(workers.clone()),
            Box::new(lanes.clone()),
            Box::new(cores.clone()),
            Box::new(memory.clone()),
        ] {
            registry.register(c).expect("distinct metric names");
        }
        Metrics {
            registry,
            allocations,
            cold_start,
            heartbeats,
            registered,
            allocations_now,
            workers,
            lanes,
            cores,
            memory,
            invocations,
            worker_cpu,
            warm,
            exposed: Mutex::default(),
            billing_posts,
            billing_pending,
            billing_exposed: Mutex::default(),
            manager_ok: AtomicBool::new(false),
            control_tls_refused,
        }
    }

    /// Brings the usage counters up to the ledger's `totals` (which only
    /// grow).
    fn follow_usage(&self, totals: &UsageFigures) {
        let mut exposed = self.exposed.lock().unwrap_or_else(|e| e.into_inner());
        let seconds = |new: u64, old: u64| new.saturating_sub(old) as f64 / 1e9;
        self.invocations
            .inc_by(totals.invocations.saturating_sub(exposed.invocations));
        self.worker_cpu
            .with_label_values(&["compute"])
            .inc_by(seconds(totals.compute_ns, exposed.compute_ns));
        self.worker_cpu
            .with_label_values(&["hot_poll"])
            .inc_by(seconds(totals.hot_ns, exposed.hot_ns));
        self.warm.inc_by(seconds(totals.warm_ns, exposed.warm_ns));
        *exposed = *totals;
    }

    /// The billing poster's figures now (they only grow, but `pending`).
    pub(crate) fn billing(&self, stats: PosterStats) {
        let mut exposed = self
            .billing_exposed
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        for (what, new, old) in [
            ("batches", stats.batches, exposed.batches),
            ("closed", stats.closed, exposed.closed),
            ("dropped", stats.dropped, exposed.dropped),
        ] {
            self.billing_posts
                .with_label_values(&[what])
                .inc_by(new.saturating_sub(old));
        }
        self.billing_pending.set(stats.pending as f64);
        *exposed = stats;
    }

    /// An allocation was granted after `seconds` of starting its worker.
    pub(crate) fn granted(&self, seconds: f64) {
        self.allocations.with_label_values(&["granted"]).inc();
        self.cold_start.observe(seconds);
    }

    /// A control connection was closed before TLS was up, for `reason`
    /// (`plain`, `handshake_timeout`, `handshake_failed`).
    pub(crate) fn control_tls_refused(&self, reason: &'static str) {
        self.control_tls_refused.with_label_values(&[reason]).inc();
    }

    /// An allocation was refused with `code`.
    pub(crate) fn refused(&self, code: ErrorCode) {
        let label = serde_json::to_value(code)
            .ok()
            .and_then(|v| v.as_str().map(str::to_owned))
            .unwrap_or_else(|| "other".into());
        self.allocations.with_label_values(&[label.as_str()]).inc();
    }

    /// A call to the managers (`register` or `heartbeat`) ended `ok` or
    /// `failed`.
    pub(crate) fn manager_call(&self, call: &str, ok: bool) {
        self.heartbeats
            .with_label_values(&[call, if ok { "ok" } else { "failed" }])
            .inc();
        self.manager_ok.store(ok, Ordering::Relaxed);
    }

    /// Sets the gauges of the node's state from `st`, for a scrape.
    pub(crate) fn gauge_state(&self, st: &State) {
        self.allocations_now.set(st.allocations.len() as f64);
        let serving = st
            .allocations
            .values()
            .filter(|a| a.ready && a.pid.is_some())
            .count();
        let starting = st
            .allocations
            .values()
            .filter(|a| !a.ready && a.pid.is_some())
            .count();
        self.workers
            .with_label_values(&["pooled"])
            .set(st.pool.len() as f64);
        self.workers
            .with_label_values(&["starting"])
            .set(starting as f64);
        self.workers
            .with_label_values(&["serving"])
            .set(serving as f64);
        let (mut hot, mut warm) = (0usize, 0usize);
        for a in st.allocations.values() {
            match a.mode {
                Mode::Hot => hot += a.cpus.len(),
                _ => warm += a.cpus.len(),
            }
        }
        self.lanes.with_label_values(&["hot"]).set(hot as f64);
        self.lanes.with_label_values(&["warm"]).set(warm as f64);
        let total = st.capacity.cpus().len();
        let free = st.capacity.free_cpus().len();
        let granted = st.capacity.granted_cpus().len();
        self.cores.with_label_values(&["free"]).set(free as f64);
        self.cores
            .with_label_values(&["allocated"])
            .set(granted as f64);
        // Withheld and not (or no longer) granted: the three add up.
        self.cores
            .with_label_values(&["withheld"])
            .set((total - free - granted) as f64);
        let mem = st.capacity.memory_mib();
        let mem_free = st.capacity.free_memory_mib();
        self.memory
            .with_label_values(&["free"])
            .set(f64::from(mem_free));
        self.memory
            .with_label_values(&["allocated"])
            .set(f64::from(mem - mem_free));
    }

    /// The text exposition, with the usage counters following `usage`
    /// (the ledger's node totals, read now).
    pub(crate) fn render(&self, usage: &UsageFigures) -> Vec<u8> {
        self.follow_usage(usage);
        self.registered
            .set(if self.manager_ok.load(Ordering::Relaxed) {
                1.0
            } else {
                0.0
            });
        let mut out = Vec::new();
        if let Err(e) = TextEncoder::new().encode(&self.registry.gather(), &mut out) {
            tracing::warn!(error = %e, "cannot encode the metrics");
        }
        out
    }
}

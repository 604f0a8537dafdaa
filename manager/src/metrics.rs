//! The manager's Prometheus metrics (`GET /metrics`).
//!
//! Counters are per replica (sum them across replicas in queries). Gauges
//! of the pool (nodes by state, cores and memory free and leased, the
//! oldest heartbeat) are read from this replica's view at each scrape, so
//! every replica reports the same pool.
//!
//! Every label has a small, fixed set of values, whatever callers send:
//! request methods and paths outside the API are counted as `other`.

use std::time::Duration;

use axum::http::Method;

use prometheus::{
    Encoder, Gauge, GaugeVec, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, Opts,
    Registry, TextEncoder,
};
use rfaas_proto::manager::NodeState;

use crate::view::View;

/// The label value of every method the API does not route and of every
/// path it does not match.
pub const OTHER: &str = "other";

/// The `method` label of `method`: one of the methods the API routes, or
/// [`OTHER`], so that made-up methods add no series.
pub fn method_label(method: &Method) -> &'static str {
    match *method {
        Method::GET => "GET",
        Method::POST => "POST",
        Method::PUT => "PUT",
        Method::DELETE => "DELETE",
        _ => OTHER,
    }
}

/// The metrics.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    /// Grants made (one per grant, whatever its node count).
    pub grants: IntCounter,
    /// Lease requests refused, by reason.
    pub denials: IntCounterVec,
    /// Node leases ended by expiry.
    pub expiries: IntCounter,
    /// Node leases ended because their node was lost.
    pub lost_leases: IntCounter,
    /// Nodes marked lost.
    pub lost_nodes: IntCounter,
    /// Heartbeats answered, by path: `memory` (noted, written later in a
    /// batch) or `database` (a change written at once).
    pub heartbeats: IntCounterVec,
    /// Heartbeats written to the database in batches.
    pub heartbeats_written: IntCounter,
    /// The rounds' reads of the nodes, by read: `full` (every node's row)
    /// or `heard` (the heartbeat times written since the last read).
    pub view_reads: IntCounterVec,
    /// Node leases granted without a billing slot.
    pub unbilled_leases: IntCounter,
    /// Connections closed at once because a cap was reached, by cap.
    pub connections_refused: IntCounterVec,
    /// Rows the retention purged, by table (leases, usage,
    /// usage_snapshots).
    pub retention_purged: IntCounterVec,
    /// When this replica last finished a purge, Unix seconds.
    pub retention_last_run: Gauge,
    /// How long this replica's last purge took, seconds.
    pub retention_duration: Gauge,
    requests: HistogramVec,
    accounting_instances: GaugeVec,
    nodes: GaugeVec,
    cores: GaugeVec,
    memory: GaugeVec,
    heartbeat_lag: GaugeVec,
    heartbeat_interval: Gauge,
    lost_after: Gauge,
}

impl Metrics {
    /// Registers every metric.
    pub fn new() -> Metrics {
        let registry =
            Registry::new_custom(Some("rfaas_manager".into()), None).expect("a valid prefix");
        let grants = IntCounter::new("grants_total", "Lease requests granted").expect("valid");
        let denials = IntCounterVec::new(
            Opts::new(
                "denials_total",
                "Lease requests refused, by reason (no_capacity, quota_exceeded, ...)",
            ),
            &["reason"],
        )
        .expect("valid");
        let expiries = IntCounter::new(
            "expiries_total",
            "Node leases ended at their expiry by this replica",
        )
        .expect("valid");
        let lost_leases = IntCounter::new(
            "lost_leases_total",
            "Node leases ended by this replica because their node was lost",
        )
        .expect("valid");
        let lost_nodes = IntCounter::new(
            "lost_nodes_total",
            "Nodes this replica marked lost after missed heartbeats",
        )
        .expect("valid");
        let heartbeats = IntCounterVec::new(
            Opts::new(
                "heartbeats_total",
                "Node heartbeats this replica answered, by path: memory (noted and written later in a batch) or database (a change written at once)",
            ),
            &["path"],
        )
        .expect("valid");
        for path in ["memory", "database"] {
            heartbeats.with_label_values(&[path]);
        }
        let heartbeats_written = IntCounter::new(
            "heartbeats_written_total",
            "Heartbeats this replica wrote to the database in its batched rounds (one per node heard per round)",
        )
        .expect("valid");
        let view_reads = IntCounterVec::new(
            Opts::new(
                "view_reads_total",
                "Reads of the nodes by this replica's rounds: full (every node's row, at start and every 30 s) or heard (the heartbeat times written since the last read)",
            ),
            &["read"],
        )
        .expect("valid");
        for read in ["full", "heard"] {
            view_reads.with_label_values(&[read]);
        }
        let unbilled_leases = IntCounter::new(
            "unbilled_leases_total",
            "Node leases this replica granted without a billing slot (no live accounting instance had a free one)",
        )
        .expect("valid");
        let accounting_instances = GaugeVec::new(
            Opts::new(
                "accounting_instances",
                "Accounting instances by state: live (heartbeat within [accounting] lost_after_ms) or lost",
            ),
            &["state"],
        )
        .expect("valid");
        let requests = HistogramVec::new(
            HistogramOpts::new(
                "request_seconds",
                "REST request latency, by route, method and status class",
            )
            .buckets(vec![
                0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0,
                2.0, 5.0,
            ]),
            &["route", "method", "status"],
        )
        .expect("valid");
        let nodes = GaugeVec::new(Opts::new("nodes", "Nodes by state"), &["state"]).expect("valid");
        let cores = GaugeVec::new(
            Opts::new("cores", "Cores of nodes that are up, free or leased"),
            &["state"],
        )
        .expect("valid");
        let memory = GaugeVec::new(
            Opts::new(
                "memory_mib",
                "Memory of nodes that are up, free or leased, MiB",
            ),
            &["state"],
        )
        .expect("valid");
        let heartbeat_lag = GaugeVec::new(
            Opts::new(
                "heartbeat_lag_seconds",
                "Time since a node's last heartbeat, over the nodes that are not lost (max and mean)",
            ),
            &["stat"],
        )
        .expect("valid");
        let heartbeat_interval = Gauge::new(
            "heartbeat_interval_seconds",
            "The heartbeat interval this replica hands the nodes now (it grows with the fleet)",
        )
        .expect("valid");
        let lost_after = Gauge::new(
            "lost_after_seconds",
            "The silence after which this replica marks a node lost now (it grows with the interval)",
        )
        .expect("valid");
        let connections_refused = IntCounterVec::new(
            Opts::new(
                "connections_refused_total",
                "Connections closed on accept because a cap was reached: replica (max_connections) or source (max_connections_per_source)",
            ),
            &["cap"],
        )
        .expect("valid");
        for cap in ["replica", "source"] {
            connections_refused.with_label_values(&[cap]);
        }
        let retention_purged = IntCounterVec::new(
            Opts::new(
                "retention_purged_rows_total",
                "Rows the retention purged, by table (leases, usage, usage_snapshots); their usage stays in usage_daily",
            ),
            &["table"],
        )
        .expect("valid");
        for table in ["leases", "usage", "usage_snapshots"] {
            retention_purged.with_label_values(&[table]);
        }
        let retention_last_run = Gauge::new(
            "retention_last_run_timestamp_seconds",
            "When this replica last finished a purge of ended leases, Unix seconds (0: never)",
        )
        .expect("valid");
        let retention_duration = Gauge::new(
            "retention_duration_seconds",
            "How long this replica's last purge of ended leases took, seconds",
        )
        .expect("valid");
        for m in [
            Box::new(grants.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(connections_refused.clone()),
            Box::new(denials.clone()),
            Box::new(expiries.clone()),
            Box::new(lost_leases.clone()),
            Box::new(lost_nodes.clone()),
            Box::new(heartbeats.clone()),
            Box::new(heartbeats_written.clone()),
            Box::new(view_reads.clone()),
            Box::new(unbilled_leases.clone()),
            Box::new(accounting_instances.clone()),
            Box::new(requests.clone()),
            Box::new(nodes.clone()),
            Box::new(cores.clone()),
            Box::new(memory.clone()),
            Box::new(heartbeat_lag.clone()),
            Box::new(heartbeat_interval.clone()),
            Box::new(lost_after.clone()),
            Box::new(retention_purged.clone()),
            Box::new(retention_last_run.clone()),
            Box::new(retention_duration.clone()),
        ] {
            registry.register(m).expect("metric names are unique");
        }
        for reason in [
            "no_capacity",
            "quota_exceeded",
            "budget_exhausted",
            "accounting_unavailable",
            "request_exceeds_cluster",
        ] {
            denials.with_label_values(&[reason]);
        }
        Metrics {
            registry,
            grants,
            denials,
            expiries,
            lost_leases,
            lost_nodes,
            heartbeats,
            heartbeats_written,
            view_reads,
            unbilled_leases,
            connections_refused,
            retention_purged,
            retention_last_run,
            retention_duration,
            accounting_instances,
            requests,
            nodes,
            cores,
            memory,
            heartbeat_lag,
            heartbeat_interval,
            lost_after,
        }
    }

    /// Records one request: `route` is the route's pattern or [`OTHER`],
    /// `method` a [`method_label`].
    pub fn observe(&self, route: &str, method: &str, status: u16, took: Duration) {
        let class = match status {
            200..=299 => "2xx",
            400..=499 => "4xx",
            500..=599 => "5xx",
            _ => "other",
        };
        self.requests
            .with_label_values(&[route, method, class])
            .observe(took.as_secs_f64());
    }

    /// The text exposition, the pool's gauges read from `view` first;
    /// accounting instances are live within `instance_lost_after_ms`.
    /// `intervals` are those the replica hands the nodes now.
    pub fn render(
        &self,
        view: &View,
        now_ms: u64,
        instance_lost_after_ms: u64,
        intervals: crate::liveness::Intervals,
    ) -> String {
        self.heartbeat_interval
            .set(intervals.heartbeat_ms as f64 / 1000.0);
        self.lost_after.set(intervals.lost_after_ms as f64 / 1000.0);
        let (live, lost) = view.instances_live(now_ms, instance_lost_after_ms);
        self.accounting_instances
            .with_label_values(&["live"])
            .set(live as f64);
        self.accounting_instances
            .with_label_values(&["lost"])
            .set(lost as f64);
        let all = view.all();
        for (state, name) in [
            (NodeState::Up, "up"),
            (NodeState::Drained, "drained"),
            (NodeState::Lost, "lost"),
        ] {
            self.nodes
                .with_label_values(&[name])
                .set(all.iter().filter(|n| n.state == state).count() as f64);
        }
        let up = all.iter().filter(|n| n.state == NodeState::Up);
        let (mut cores, mut leased, mut mem, mut leased_mem) = (0u64, 0u64, 0u64, 0u64);
        for n in up {
            cores += u64::from(n.cores);
            leased += u64::from(n.leased_cores.min(n.cores));
            mem += n.memory_mib;
            leased_mem += n.leased_memory_mib.min(n.memory_mib);
        }
        self.cores
            .with_label_values(&["free"])
            .set((cores - leased) as f64);
        self.cores.with_label_values(&["leased"]).set(leased as f64);
        self.memory
            .with_label_values(&["free"])
            .set((mem - leased_mem) as f64);
        self.memory
            .with_label_values(&["leased"])
            .set(leased_mem as f64);
        let lags: Vec<f64> = all
            .iter()
            .filter(|n| n.state != NodeState::Lost)
            .map(|n| now_ms.saturating_sub(n.last_heartbeat_ms) as f64 / 1000.0)
            .collect();
        let max = lags.iter().copied().fold(0.0, f64::max);
        let mean = if lags.is_empty() {
            0.0
        } else {
            lags.iter().sum::<f64>() / lags.len() as f64
        };
        self.heartbeat_lag.with_label_values(&["max"]).set(max);
        self.heartbeat_lag.with_label_values(&["mean"]).set(mean);
        let mut out = Vec::new();
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut out)
            .expect("text encoding cannot fail");
        String::from_utf8(out).expect("the text format is UTF-8")
    }
}

impl Default for Metrics {
    fn default() -> Metrics {
        Metrics::new()
    }
}

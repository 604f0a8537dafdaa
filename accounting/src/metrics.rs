//! The service's Prometheus metrics, and the small HTTP server of
//! `/metrics` and `/healthz` on `metrics_listen`.
//!
//! Names carry the `rfaas_accounting_` prefix; labels have small fixed
//! sets of values (never a lease, node or account).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::{Json, Router};
use prometheus::{
    Encoder, Gauge, IntCounter, IntCounterVec, IntGauge, Opts, Registry, TextEncoder,
};

/// The reasons of `rejected_adds_total`.
pub const REJECT_REASONS: [&str; 3] = ["foreign_slot", "shrank", "beyond_lease"];

/// The metrics.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    /// Slots assigned to leases, as of the last flush.
    pub slots_in_use: IntGauge,
    /// Slots in the region.
    pub slots: IntGauge,
    flush_lag: Gauge,
    /// Rows written, by table.
    pub rows_written: IntCounterVec,
    /// Flushes that failed (the database refused or was unreachable).
    pub flush_errors: IntCounter,
    /// Flushes done.
    pub flushes: IntCounter,
    /// Slots freed after their lease's final flush.
    pub slots_freed: IntCounter,
    /// Words found in free slots and cleared (adds after a lease's end).
    pub stray_adds: IntCounter,
    /// Adds refused or discarded, by reason.
    pub rejected_adds: IntCounterVec,
    /// Connections of accepted daemons.
    pub connections: IntGauge,
    /// Hellos answered or given up, by result.
    pub hellos: IntCounterVec,
    /// Accepted connections closed because their credential stopped
    /// being live.
    pub revoked_connections: IntCounter,
    /// When the last flush succeeded, Unix ms (0: none yet).
    last_flush_ms: AtomicU64,
    /// When the service started, Unix ms.
    started_ms: u64,
}

impl Metrics {
    /// Registers every metric.
    pub fn new(started_ms: u64) -> Metrics {
        let registry =
            Registry::new_custom(Some("rfaas_accounting".into()), None).expect("a valid prefix");
        let slots_in_use = IntGauge::new(
            "slots_in_use",
            "Slots of the region assigned to leases, as of the last flush",
        )
        .expect("valid");
        let slots = IntGauge::new("slots", "Slots in the region").expect("valid");
        let flush_lag = Gauge::new(
            "flush_lag_seconds",
            "Time since the last successful flush (since the start before the first)",
        )
        .expect("valid");
        let rows_written = IntCounterVec::new(
            Opts::new(
                "rows_written_total",
                "Rows the flusher wrote, by table (usage, usage_snapshots, account_spend)",
            ),
            &["table"],
        )
        .expect("valid");
        let flush_errors = IntCounter::new(
            "flush_errors_total",
            "Flushes that failed; the slots keep their totals and the next flush retries",
        )
        .expect("valid");
        let flushes = IntCounter::new("flushes_total", "Flushes that succeeded").expect("valid");
        let slots_freed = IntCounter::new(
            "slots_freed_total",
            "Slots zeroed and freed after their lease's final flush",
        )
        .expect("valid");
        let stray_adds = IntCounter::new(
            "stray_adds_total",
            "Free slots found holding adds (a daemon added after its lease's slot was freed), cleared",
        )
        .expect("valid");
        let rejected_adds = IntCounterVec::new(
            Opts::new(
                "rejected_adds_total",
                "Adds discarded, never stored, by reason (foreign_slot: a node added to a slot whose lease is not on it, one per slot and flush; shrank: a counter fell below what is stored, by a wrapping add or a compare-and-swap; beyond_lease: more time than the lease's cores, or allocation than its memory, in its wall-clock time)",
            ),
            &["reason"],
        )
        .expect("valid");
        let connections = IntGauge::new(
            "connections",
            "Fabric connections of executor daemons that said an accepted hello",
        )
        .expect("valid");
        let hellos = IntCounterVec::new(
            Opts::new(
                "hellos_total",
                "New connections, by how their hello ended (accepted, bad_credential, bad_hello, unavailable, dropped)",
            ),
            &["result"],
        )
        .expect("valid");
        let revoked_connections = IntCounter::new(
            "revoked_connections_total",
            "Connections of executor daemons closed because the node credential their ticket names was revoked, expired or deleted",
        )
        .expect("valid");
        for m in [
            Box::new(slots_in_use.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(revoked_connections.clone()),
            Box::new(slots.clone()),
            Box::new(flush_lag.clone()),
            Box::new(rows_written.clone()),
            Box::new(flush_errors.clone()),
            Box::new(flushes.clone()),
            Box::new(slots_freed.clone()),
            Box::new(stray_adds.clone()),
            Box::new(rejected_adds.clone()),
            Box::new(connections.clone()),
            Box::new(hellos.clone()),
        ] {
            registry.register(m).expect("metric names are unique");
        }
        for table in ["usage", "usage_snapshots", "account_spend"] {
            rows_written.with_label_values(&[table]);
        }
        for result in [
            "accepted",
            "bad_credential",
            "bad_hello",
            "unavailable",
            "dropped",
        ] {
            hellos.with_label_values(&[result]);
        }
        for reason in REJECT_REASONS {
            rejected_adds.with_label_values(&[reason]);
        }
        Metrics {
            registry,
            slots_in_use,
            slots,
            flush_lag,
            rows_written,
            flush_errors,
            flushes,
            slots_freed,
            stray_adds,
            rejected_adds,
            connections,
            hellos,
            revoked_connections,
            last_flush_ms: AtomicU64::new(0),
            started_ms,
        }
    }

    /// Records a successful flush at `now_ms`.
    pub fn flushed(&self, now_ms: u64) {
        self.flushes.inc();
        self.last_flush_ms.store(now_ms, Ordering::Relaxed);
    }

    /// Seconds since the last successful flush (since the start before
    /// the first).
    pub fn flush_lag(&self, now_ms: u64) -> f64 {
        let last = match self.last_flush_ms.load(Ordering::Relaxed) {
            0 => self.started_ms,
            t => t,
        };
        now_ms.saturating_sub(last) as f64 / 1000.0
    }

    /// Whether a flush has succeeded yet.
    pub fn has_flushed(&self) -> bool {
        self.last_flush_ms.load(Ordering::Relaxed) != 0
    }

    /// The text exposition.
    pub fn render(&self, now_ms: u64) -> String {
        self.flush_lag.set(self.flush_lag(now_ms));
        let mut out = Vec::new();
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut out)
            .expect("text encoding cannot fail");
        String::from_utf8(out).expect("the text format is UTF-8")
    }
}

/// What `/healthz` judges by.
#[derive(Debug, Clone)]
pub struct Health {
    /// The metrics.
    pub metrics: Arc<Metrics>,
    /// Lag past which the service is unhealthy.
    pub max_lag: Duration,
}

async fn metrics(State(h): State<Health>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        h.metrics.render(rfaas_service::now_ms()),
    )
}

/// `200` while flushes succeed, `503` once the last successful one is
/// older than the allowed lag (the database is unreachable or refuses).
async fn healthz(State(h): State<Health>) -> impl IntoResponse {
    let lag = h.metrics.flush_lag(rfaas_service::now_ms());
    let ok = h.metrics.has_flushed() && lag <= h.max_lag.as_secs_f64();
    let body = serde_json::json!({
        "status": if ok { "ok" } else { "flush_lagging" },
        "flush_lag_seconds": lag,
        "connections": h.metrics.connections.get(),
        "slots_in_use": h.metrics.slots_in_use.get(),
    });
    let status = if ok {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, Json(body))
}

/// Serves `/metrics` and `/healthz` on `listener` until `stop` says so.
pub async fn serve(
    listener: tokio::net::TcpListener,
    health: Health,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> std::io::Result<()> {
    let router = Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .with_state(health);
    axum::serve(listener, router)
        .with_graceful_shutdown(async move {
            let _ = stop.wait_for(|s| *s).await;
        })
        .await
}

/// Binds `addr` for [`serve`].
pub async fn bind(addr: &str) -> std::io::Result<(tokio::net::TcpListener, SocketAddr)> {
    let l = tokio::net::TcpListener::bind(addr).await?;
    let a = l.local_addr()?;
    Ok((l, a))
}

//! The purge task: every `[retention] interval_s`, ended leases older
//! than `ended_lease_days` leave the database in batches of `batch`, one
//! transaction each with `pause_ms` between them, off the request path
//! ([`crate::store::Store::purge_ended`] rolls their usage up per day
//! first). On PostgreSQL one replica at a time purges (an advisory lock
//! per batch; a replica that finds it held leaves the run to the holder);
//! SQLite has a single replica.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::config::RetentionSettings;
use crate::db::DbError;
use crate::metrics::Metrics;
use crate::store::{Purged, Store, DAY_MS};
use crate::App;

/// One purge of the leases that ended `ended_lease_days` or more before
/// `now_ms`: batches until one is not full or another replica purges.
/// Returns what it deleted.
pub async fn purge(
    store: &Store,
    metrics: &Metrics,
    r: RetentionSettings,
    now_ms: u64,
) -> Result<Purged, DbError> {
    let before_ms = now_ms.saturating_sub(r.ended_lease_days.saturating_mul(DAY_MS));
    let started = Instant::now();
    let mut total = Purged::default();
    loop {
        let p = store.purge_ended(before_ms, r.batch).await?;
        let m = &metrics.retention_purged;
        m.with_label_values(&["leases"]).inc_by(p.leases);
        m.with_label_values(&["usage"]).inc_by(p.usage);
        m.with_label_values(&["usage_snapshots"])
            .inc_by(p.snapshots);
        total.leases += p.leases;
        total.usage += p.usage;
        total.snapshots += p.snapshots;
        total.busy = p.busy;
        if p.busy || p.leases < u64::from(r.batch) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(r.pause_ms)).await;
    }
    let took = started.elapsed();
    metrics.retention_duration.set(took.as_secs_f64());
    metrics
        .retention_last_run
        .set(crate::now_ms() as f64 / 1000.0);
    tracing::info!(
        leases = total.leases,
        usage = total.usage,
        snapshots = total.snapshots,
        other_replica = total.busy,
        took_ms = took.as_millis() as u64,
        "purged ended leases"
    );
    Ok(total)
}

/// Purges every `interval_s` until `stop`; the first run comes one
/// interval after start, so a restart never adds load at once.
pub async fn purge_loop(app: Arc<App>, mut stop: tokio::sync::watch::Receiver<bool>) {
    let every = Duration::from_secs(app.settings.retention.interval_s);
    loop {
        tokio::select! {
            _ = tokio::time::sleep(every) => {}
            _ = stop.changed() => return,
        }
        let r = app.settings.retention;
        if let Err(e) = purge(&app.store, &app.metrics, r, crate::now_ms()).await {
            tracing::warn!(error = %e, "purging ended leases failed; the next run tries again");
        }
    }
}

//! How many usage rows per second the accounting service's flusher
//! writes to PostgreSQL, next to a plain sqlx upsert loop on the same
//! kind of database.
//!
//! | row | what is measured |
//! |---|---|
//! | `billing_flush` | [`Flusher::flush_once`] in the bench's process, on a region file of [`SLOTS`] slots, every one assigned to a lease whose totals grew since the last flush: `usage` rows written per second of flush |
//! | `raw_db_upsert` | the same [`SLOTS`] rows upserted into the same `usage` table by a plain sqlx loop: one statement per row (the flusher's upsert for one row, totals only growing), all in one transaction, per second |
//!
//! Each round runs the baseline first. Each row starts its own throwaway
//! PostgreSQL 15 server ([`rfaas_testkit::postgres`], that is
//! `scripts/pg.sh`: `fsync = off`, `shared_buffers = 32MB`), so neither
//! finds the other's dead rows, on the peers' CPU, with the manager's schema
//! ([`rfaas_service::db::open`], four connections as the service opens);
//! the flusher or the loop runs on the bench's CPU. One untimed pass
//! inserts the rows; then [`PASSES`] passes are timed, each after every
//! row's totals grew. The rate is the rows written over the passes' summed
//! time. A flush also heartbeats the instance, reads its assigned slots
//! and their leases, reads the region, syncs the region file, reads the
//! stored totals and adds the priced growth to the account's spend: what
//! a flush of the service costs, not only its upserts. Snapshots are not
//! due in the timed flushes (a site takes one a minute; the untimed first
//! flush writes them). Each row fails unless the database holds the
//! totals last written.

use std::sync::Arc;
use std::time::{Duration, Instant};

use rfaas_accounting::flusher::{FlushConfig, Flusher};
use rfaas_accounting::ledger::Ledger;
use rfaas_accounting::metrics::Metrics;
use rfaas_accounting::rates::Rates;
use rfaas_accounting::region::Region;
use rfaas_accounting::store::{self, Instance};
use rfaas_proto::accounting::{Counter, SlotTotals, UsageFigures};
use rfaas_service::db::{self, DbError};
use rfaas_testkit::postgres::Postgres;
use sqlx::{AnyPool, Row as _};

use crate::child;
use crate::cleanup;
use crate::error::{Context, Error, Result};
use crate::report::{Report, Row};
use crate::rows::{Ctx, RowSpec, Runner, Suite};

const BILLING_FLUSH: &str = "billing_flush";
const RAW_DB_UPSERT: &str = "raw_db_upsert";

/// Rows (slots, leases) written per pass.
pub const SLOTS: u32 = 4096;
/// Timed passes per measurement.
pub const PASSES: u32 = 8;
/// Connections to the database: the service's.
const CONNECTIONS: u32 = 4;
/// The instance the flusher writes for.
const INSTANCE: &str = "bench";
/// The rates spend is priced at; what they are does not change what is
/// measured.
const RATES: Rates = Rates {
    alloc_per_gib_s: 0.0001,
    compute_per_s: 0.01,
    hot_per_s: 0.005,
    harvested_discount: 0.5,
};

pub const SUITE: Suite = Suite {
    rows: &[
        RowSpec {
            name: RAW_DB_UPSERT,
            help: "usage rows per second a plain sqlx loop upserts into a throwaway PostgreSQL, 4096 rows, one statement per row in one transaction",
            runner: Runner::Once(raw_db_upsert),
        },
        RowSpec {
            name: BILLING_FLUSH,
            help: "the same 4096 rows written by the accounting service's flusher, every lease's totals grown, on another such server (next to raw_db_upsert)",
            runner: Runner::Once(billing_flush),
        },
    ],
    peers: &[],
};

fn db_err(row: &str) -> impl Fn(DbError) -> Error + '_ {
    move |e| Error::new(format!("{row}: {e}"))
}

fn sql_err(row: &str) -> impl Fn(sqlx::Error) -> Error + '_ {
    move |e| Error::new(format!("{row}: {e}"))
}

/// A throwaway PostgreSQL on the peers' CPU, stopped by pid when dropped
/// or when the bench is interrupted.
struct Database {
    pg: Postgres,
    _registered: Option<cleanup::Registered>,
}

impl Database {
    fn start(ctx: &Ctx, row: &str) -> Result<Database> {
        if let Some(cpu) = ctx.peer_cpu {
            child::pin_current_thread(cpu)
                .context(|| format!("could not move to CPU {cpu} to start PostgreSQL"))?;
        }
        let started = Postgres::start();
        if let Some(cpu) = ctx.cpu {
            child::pin_current_thread(cpu)
                .context(|| format!("could not move the bench back to CPU {cpu}"))?;
        }
        let pg =
            started.map_err(|e| Error::new(format!("{row}: could not start PostgreSQL: {e}")))?;
        let registered = pg.pid().map(cleanup::register);
        Ok(Database {
            pg,
            _registered: registered,
        })
    }
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context(|| "could not start a tokio runtime".to_owned())
}

/// What lease `id`'s totals grow by in each pass: every usage word, by
/// amounts that differ from lease to lease.
fn growth(id: u64) -> SlotTotals {
    SlotTotals {
        usage: UsageFigures {
            alloc_mib_ms: 1024 * 1000 + id,
            compute_ns: 900_000_000 + id,
            hot_ns: 50_000_000 + id,
            warm_ns: 10_000 + id,
            invocations: 1000 + id % 7,
            bytes_in: 64_000 + id,
            bytes_out: 32_000 + id,
        },
        closed: 0,
    }
}

fn billing_flush(ctx: &Ctx, out: &mut Report) -> Result<()> {
    let row = BILLING_FLUSH;
    let db = Database::start(ctx, row)?;
    let dir = std::env::temp_dir().join(format!("rfaas-bench-flush-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).context(|| format!("could not create {}", dir.display()))?;
    let result = runtime()?.block_on(flush_passes(db.pg.url(), &dir));
    let _ = std::fs::remove_dir_all(&dir);
    let (rows, elapsed) = result?;
    out.push(&Row::rate(row, "postgres", 0, 0, rows, elapsed).with("slots", u64::from(SLOTS)))
}

/// The untimed flush, then [`PASSES`] timed ones: the rows written and
/// the time the timed flushes took.
async fn flush_passes(url: &str, dir: &std::path::Path) -> Result<(u64, Duration)> {
    let row = BILLING_FLUSH;
    let pool = db::open_and_migrate(url, CONNECTIONS)
        .await
        .map_err(db_err(row))?;
    // The region is registered as the service's is; the provider does not
    // matter to the flusher, which reads it in place.
    let fabric = rfaas_fabric::Fabric::open("tcp")
        .map_err(|e| Error::new(format!("{row}: opening tcp: {e}")))?;
    let domain = fabric
        .domain()
        .map_err(|e| Error::new(format!("{row}: creating a domain: {e}")))?;
    let (region, _) = Region::open(&domain, &dir.join("accounting.region"), SLOTS)
        .map_err(|e| Error::new(format!("{row}: {e}")))?;
    let region = Arc::new(region);
    let ledger = Ledger::open(Arc::new(domain), region.clone(), false)
        .map_err(|e| Error::new(format!("{row}: {e}")))?;
    let now = rfaas_service::now_ms();
    store::register_instance(
        &pool,
        &Instance {
            name: INSTANCE.into(),
            provider: "tcp".into(),
            fabric_addr: "127.0.0.1:9".into(),
            metrics_addr: "127.0.0.1:9".into(),
            slots: SLOTS,
            region_id: region.header().region_id,
        },
        now,
    )
    .await
    .map_err(db_err(row))?;
    store::ensure_slots(&pool, INSTANCE, SLOTS)
        .await
        .map_err(db_err(row))?;
    assign_leases(&pool).await.map_err(sql_err(row))?;
    let mut flusher = Flusher::new(
        FlushConfig {
            instance: INSTANCE.into(),
            snapshot_interval: Duration::from_secs(3600),
            slot_hold: Duration::from_secs(600),
            rates: RATES,
        },
        pool.clone(),
        Arc::new(ledger),
        Arc::new(Metrics::new(now)),
    );
    let mut rows = 0u64;
    let mut elapsed = Duration::ZERO;
    for pass in 0..=PASSES {
        for slot in 0..SLOTS {
            region.restore_slot(slot, &growth(u64::from(slot) + 1));
        }
        let t0 = Instant::now();
        let report = flusher
            .flush_once(rfaas_service::now_ms())
            .await
            .map_err(db_err(row))?;
        let took = t0.elapsed();
        if report.written != SLOTS as usize {
            return Err(Error::new(format!(
                "{row}: a flush wrote {} leases, not {SLOTS}: {report:?}",
                report.written
            )));
        }
        if pass > 0 {
            if report.snapshots != 0 {
                return Err(Error::new(format!(
                    "{row}: a timed flush wrote {} snapshots",
                    report.snapshots
                )));
            }
            rows += report.written as u64;
            elapsed += took;
        }
    }
    // The database holds what the region does.
    let ids: Vec<u64> = (1..=u64::from(SLOTS)).collect();
    let stored = store::usage_of(&pool, &ids).await.map_err(db_err(row))?;
    if stored.len() != SLOTS as usize {
        return Err(Error::new(format!(
            "{row}: {} usage rows, not {SLOTS}",
            stored.len()
        )));
    }
    for u in &stored {
        let want = store::stored(&region.read_slot(u.slot));
        if u.totals != want {
            return Err(Error::new(format!(
                "{row}: lease {} stored {:?}, its slot holds {want:?}",
                u.lease_id, u.totals
            )));
        }
    }
    pool.close().await;
    Ok((rows, elapsed))
}

/// Leases 1..=[`SLOTS`], active, lease `slot + 1` in each slot, as the
/// manager grants them.
async fn assign_leases(pool: &AnyPool) -> std::result::Result<(), sqlx::Error> {
    let mut tx = pool.begin().await?;
    sqlx::query(
        "INSERT INTO leases (id, grant_id, node, owner, user_name, account, cores, memory_mib, issued_at, expires_at, state, ended_ms)
         SELECT g, g, 'bench', 'user:bench', 'bench', 'bench', 1, 64, 0, 4000000000, 'active', 0
         FROM generate_series(CAST(1 AS BIGINT), $1) AS g",
    )
    .bind(i64::from(SLOTS))
    .execute(&mut *tx)
    .await?;
    sqlx::query(
        "UPDATE billing_slots SET lease_id = slot + 1, assigned_ms = 1 WHERE instance = $1",
    )
    .bind(INSTANCE)
    .execute(&mut *tx)
    .await?;
    tx.commit().await
}

/// The flusher's upsert of one `usage` row: every counter only grows.
const UPSERT: &str = "INSERT INTO usage (lease_id, instance, slot, alloc_mib_ms, compute_ns, hot_ns, warm_ns, invocations, bytes_in, bytes_out, finalized, first_ms, updated_ms)
     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13)
     ON CONFLICT (lease_id) DO UPDATE SET
     alloc_mib_ms = CASE WHEN excluded.alloc_mib_ms > usage.alloc_mib_ms THEN excluded.alloc_mib_ms ELSE usage.alloc_mib_ms END,
     compute_ns = CASE WHEN excluded.compute_ns > usage.compute_ns THEN excluded.compute_ns ELSE usage.compute_ns END,
     hot_ns = CASE WHEN excluded.hot_ns > usage.hot_ns THEN excluded.hot_ns ELSE usage.hot_ns END,
     warm_ns = CASE WHEN excluded.warm_ns > usage.warm_ns THEN excluded.warm_ns ELSE usage.warm_ns END,
     invocations = CASE WHEN excluded.invocations > usage.invocations THEN excluded.invocations ELSE usage.invocations END,
     bytes_in = CASE WHEN excluded.bytes_in > usage.bytes_in THEN excluded.bytes_in ELSE usage.bytes_in END,
     bytes_out = CASE WHEN excluded.bytes_out > usage.bytes_out THEN excluded.bytes_out ELSE usage.bytes_out END,
     finalized = CASE WHEN excluded.finalized > usage.finalized THEN excluded.finalized ELSE usage.finalized END,
     updated_ms = excluded.updated_ms";

/// The counters in the order of [`UPSERT`]'s `$4`..`$10`.
const COUNTERS: [Counter; 7] = [
    Counter::AllocMibMs,
    Counter::ComputeNs,
    Counter::HotNs,
    Counter::WarmNs,
    Counter::Invocations,
    Counter::BytesIn,
    Counter::BytesOut,
];

fn raw_db_upsert(ctx: &Ctx, out: &mut Report) -> Result<()> {
    let row = RAW_DB_UPSERT;
    let db = Database::start(ctx, row)?;
    let (rows, elapsed) = runtime()?.block_on(upsert_passes(db.pg.url()))?;
    out.push(&Row::rate(row, "postgres", 0, 0, rows, elapsed).with("slots", u64::from(SLOTS)))
}

/// One untimed pass, then [`PASSES`] timed ones: the rows written and the
/// time the timed passes took.
async fn upsert_passes(url: &str) -> Result<(u64, Duration)> {
    let row = RAW_DB_UPSERT;
    let pool = db::open_and_migrate(url, CONNECTIONS)
        .await
        .map_err(db_err(row))?;
    let mut totals: Vec<SlotTotals> = vec![SlotTotals::default(); SLOTS as usize];
    let mut rows = 0u64;
    let mut elapsed = Duration::ZERO;
    for pass in 0..=PASSES {
        for (i, t) in totals.iter_mut().enumerate() {
            let g = growth(i as u64 + 1);
            let mut w = t.to_words();
            for c in COUNTERS {
                w[c.index()] += g.get(c);
            }
            *t = SlotTotals::from_words(w);
        }
        let now = db::i(rfaas_service::now_ms());
        let t0 = Instant::now();
        let written = upsert_all(&pool, &totals, now)
            .await
            .map_err(sql_err(row))?;
        let took = t0.elapsed();
        if written != u64::from(SLOTS) {
            return Err(Error::new(format!(
                "{row}: a pass upserted {written} rows, not {SLOTS}"
            )));
        }
        if pass > 0 {
            rows += written;
            elapsed += took;
        }
    }
    let stored = sqlx::query("SELECT lease_id, compute_ns, bytes_out FROM usage ORDER BY lease_id")
        .fetch_all(&pool)
        .await
        .map_err(sql_err(row))?;
    if stored.len() != SLOTS as usize {
        return Err(Error::new(format!(
            "{row}: {} usage rows, not {SLOTS}",
            stored.len()
        )));
    }
    for (r, want) in stored.iter().zip(&totals) {
        let got: (i64, i64) = (
            r.try_get("compute_ns").map_err(sql_err(row))?,
            r.try_get("bytes_out").map_err(sql_err(row))?,
        );
        if got != (db::i(want.usage.compute_ns), db::i(want.usage.bytes_out)) {
            return Err(Error::new(format!(
                "{row}: a row holds {got:?}, not the totals last written"
            )));
        }
    }
    pool.close().await;
    Ok((rows, elapsed))
}

/// Upserts lease `i + 1`'s `totals[i]`, one statement each, in one
/// transaction. Hot loop of `raw_db_upsert`.
async fn upsert_all(
    pool: &AnyPool,
    totals: &[SlotTotals],
    now_ms: i64,
) -> std::result::Result<u64, sqlx::Error> {
    let mut tx = pool.begin().await?;
    let mut written = 0;
    for (i, t) in totals.iter().enumerate() {
        let mut q = sqlx::query(UPSERT)
            .bind(i as i64 + 1)
            .bind(INSTANCE)
            .bind(i as i64);
        for c in COUNTERS {
            q = q.bind(db::i(t.get(c)));
        }
        written += q
            .bind(0i64)
            .bind(now_ms)
            .bind(now_ms)
            .execute(&mut *tx)
            .await?
            .rows_affected();
    }
    tx.commit().await?;
    Ok(written)
}

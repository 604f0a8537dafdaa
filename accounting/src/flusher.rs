//! The flusher: every `flush_interval` it writes the totals of the
//! instance's assigned slots to the database, and frees the slots whose
//! leases are over.
//!
//! # One flush
//!
//! 1. Heartbeat the instance's row; read its assigned slots and their
//!    leases. Free slots holding adds (a daemon that added after its slot
//!    was freed) are cleared at once, before a new lease can be given one.
//!    Adds in a node's window to a slot whose lease is not on that node
//!    are taken out and counted, never stored ([`crate::ledger`]).
//! 2. Read each assigned slot (the region plus the window of its lease's
//!    node). A lease is written when its slot grew past
//!    what is stored, when a snapshot is due (every `snapshot_interval`,
//!    for leases whose totals changed since their last one), and at its
//!    final flush. The region's pages are synced to its file first, so the
//!    file never holds less than the database.
//! 3. One transaction ([`store::write_usage`]): `usage` (counters only
//!    grow), `usage_snapshots`, and the priced growth into
//!    `account_spend`.
//! 4. A lease is final when its daemon closed the slot (`closed` != 0)
//!    and it is over in the database (not active, or past its expiry),
//!    when its usage is already finalized (a final flush that did not get
//!    to free the slot), or when it ended (or expired) more than
//!    `slot_hold` ago. After its final write commits, its slot is zeroed
//!    (each word exchanged with 0), synced to the file, and only then freed
//!    in the database (`lease_id = 0`). If an add slipped in between the
//!    read and the zeroing, the words are put back and the slot stays
//!    assigned: the next flush writes them and tries again.
//!
//! # Crashes
//!
//! Every step may be cut short. A replay reads the same slots and writes
//! the same totals: `usage` keeps the larger value of each counter, and
//! `account_spend` grows by the priced growth over the stored row, which is
//! 0 the second time. A slot zeroed but not freed belongs to a finalized
//! lease, which the next flush finishes freeing; a slot freed was zeroed
//! and synced first, so a reused slot starts at zero. While the database
//! is down nothing is lost: the slots keep adding, and the next flush that
//! succeeds writes their totals.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use rfaas_proto::accounting::{Counter, SlotTotals};
use rfaas_service::db::{retrying, DbError};
use sqlx::AnyPool;

use crate::ledger::Ledger;
use crate::metrics::Metrics;
use crate::rates::Rates;
use crate::store::{self, max_totals, stored, Assigned, LeaseInfo, UsageWrite};

/// What the flusher needs to know.
#[derive(Debug, Clone)]
pub struct FlushConfig {
    /// The instance's name.
    pub instance: String,
    /// Snapshot period.
    pub snapshot_interval: Duration,
    /// Hold of an ended lease's slot.
    pub slot_hold: Duration,
    /// The rates spend is priced at.
    pub rates: Rates,
}

/// What one flush did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FlushReport {
    /// Slots assigned to leases.
    pub assigned: usize,
    /// Leases written.
    pub written: usize,
    /// Snapshot rows written.
    pub snapshots: u64,
    /// Leases whose final flush was written.
    pub finals: usize,
    /// Slots freed.
    pub freed: u64,
    /// Free slots found holding adds, cleared.
    pub strays: usize,
    /// Slots of a node's window holding adds to another node's lease,
    /// cleared and counted.
    pub foreign: usize,
}

/// What the flusher remembers of a lease between flushes.
#[derive(Debug, Clone, Copy)]
struct Memo {
    slot: u32,
    /// The totals stored in `usage` after the last flush.
    stored: SlotTotals,
    /// The totals of its last snapshot.
    snapshot: Option<SlotTotals>,
}

/// Where a test cuts a flush short, as a crash would.
#[cfg(test)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Crash {
    /// After the final write committed, before any slot is zeroed.
    AfterFinalWrite,
    /// After the slots were zeroed and synced, before they are freed.
    AfterZeroing,
}

/// Why a slot's totals were not stored as read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// A counter below what is stored: an add that wrapped past 2^64, or
    /// a compare-and-swap that lowered it.
    Shrank,
    /// A time counter beyond the lease's cores times its wall-clock time
    /// (or the allocation beyond its memory times that time).
    BeyondLease,
}

impl Refusal {
    /// Its `reason` label of `rejected_adds_total`.
    pub(crate) fn reason(self) -> &'static str {
        match self {
            Refusal::Shrank => "shrank",
            Refusal::BeyondLease => "beyond_lease",
        }
    }
}

/// Slack of the wall-clock bound: a lease's grant time is stored in whole
/// seconds, and clocks of the nodes and this host differ a little.
const WALL_SLACK_MS: u64 = 5_000;

/// The most a counter can hold for `lease` at `now_ms` (`None`: no
/// bound): compute, hot and warm time at most cores × wall-clock time
/// since the grant (to its end or expiry), allocation at most memory ×
/// that time.
fn ceiling(counter: Counter, lease: &LeaseInfo, now_ms: u64) -> Option<u64> {
    let until = match lease.ended_ms {
        0 => now_ms.min(lease.expires_at.saturating_mul(1000)),
        ended => ended,
    }
    .max(lease.issued_at.saturating_mul(1000));
    let wall_ms = until - lease.issued_at.saturating_mul(1000) + WALL_SLACK_MS;
    match counter {
        Counter::ComputeNs | Counter::HotNs | Counter::WarmNs => Some(
            lease
                .cores
                .saturating_mul(wall_ms)
                .saturating_mul(1_000_000),
        ),
        Counter::AllocMibMs => Some(lease.memory_mib.saturating_mul(wall_ms)),
        _ => None,
    }
}

/// `now` as it may be stored: each counter below `prev` (what is stored)
/// or beyond the lease's ceiling keeps `prev`'s value instead. Returns the
/// totals and the refusals (at most one of each).
pub(crate) fn bounded(
    now: &SlotTotals,
    prev: Option<&SlotTotals>,
    lease: Option<&LeaseInfo>,
    now_ms: u64,
) -> (SlotTotals, Vec<Refusal>) {
    let mut w = now.to_words();
    let before = prev.copied().unwrap_or_default().to_words();
    let mut refused = Vec::new();
    for c in store::USAGE_COUNTERS {
        let i = c.index();
        let why = if prev.is_some() && w[i] < before[i] {
            Some(Refusal::Shrank)
        } else if lease
            .and_then(|l| ceiling(c, l, now_ms))
            .is_some_and(|max| w[i] > max)
        {
            Some(Refusal::BeyondLease)
        } else {
            None
        };
        if let Some(why) = why {
            w[i] = before[i];
            if !refused.contains(&why) {
                refused.push(why);
            }
        }
    }
    (SlotTotals::from_words(w), refused)
}

/// The flusher of one instance.
#[derive(Debug)]
pub struct Flusher {
    cfg: FlushConfig,
    pool: AnyPool,
    ledger: Arc<Ledger>,
    metrics: Arc<Metrics>,
    memo: HashMap<u64, Memo>,
    /// The totals last refused per lease, so each is logged and counted
    /// once.
    refused: HashMap<u64, SlotTotals>,
    last_snapshot_ms: Option<u64>,
    /// Consecutive failed flushes (for the log).
    failures: u64,
    #[cfg(test)]
    pub(crate) crash: Option<Crash>,
    /// An add that lands in each final slot between its read and its
    /// zeroing.
    #[cfg(test)]
    pub(crate) late_add: Option<SlotTotals>,
}

impl Flusher {
    /// A flusher of `ledger` into `pool`.
    pub fn new(
        cfg: FlushConfig,
        pool: AnyPool,
        ledger: Arc<Ledger>,
        metrics: Arc<Metrics>,
    ) -> Flusher {
        Flusher {
            cfg,
            pool,
            ledger,
            metrics,
            memo: HashMap::new(),
            refused: HashMap::new(),
            last_snapshot_ms: None,
            failures: 0,
            #[cfg(test)]
            crash: None,
            #[cfg(test)]
            late_add: None,
        }
    }

    /// Whether `a`'s lease ended (or expired) more than the hold ago.
    fn lease_over(&self, a: &Assigned, now_ms: u64) -> bool {
        let hold = self.cfg.slot_hold.as_millis() as u64;
        let since = match &a.lease {
            // The manager writes a lease and its slot together: a slot
            // without a lease is a leftover, given the hold from its
            // assignment.
            None => a.assigned_ms,
            Some(l) if l.state != "active" && l.ended_ms > 0 => l.ended_ms,
            Some(l) if l.state != "active" => a.assigned_ms,
            // Active but past its end: the manager has not reaped it yet.
            Some(l) => l.expires_at.saturating_mul(1000),
        };
        now_ms >= since.saturating_add(hold)
    }

    /// One flush at `now_ms` (Unix ms). See the module documentation.
    ///
    /// # Errors
    ///
    /// The database's failure; nothing is lost, the next flush retries.
    pub async fn flush_once(&mut self, now_ms: u64) -> Result<FlushReport, DbError> {
        let name = self.cfg.instance.clone();
        // SQLite, shared with the manager, may report a conflict: each
        // step is retried a few times before the flush gives up.
        retrying(|| store::heartbeat(&self.pool, &name, now_ms)).await?;
        let all = retrying(|| store::assigned_slots(&self.pool, &name)).await?;
        let slots = self.ledger.slots();
        let (assigned, outside): (Vec<Assigned>, Vec<Assigned>) =
            all.into_iter().partition(|a| a.slot < slots);
        for a in &outside {
            tracing::warn!(slot = a.slot, lease = a.lease_id, slots, "a lease holds a slot past the region's end (the region shrank?); it is not counted here");
        }
        let mut report = FlushReport {
            assigned: assigned.len(),
            foreign: self.reject_foreign(&assigned),
            strays: self.clear_strays(&assigned).await?,
            ..FlushReport::default()
        };
        self.metrics.slots_in_use.set(assigned.len() as i64);

        let snapshot_due = self.last_snapshot_ms.map_or(true, |t| {
            now_ms.saturating_sub(t) >= self.cfg.snapshot_interval.as_millis() as u64
        });
        let mut writes = Vec::new();
        // What each written lease's slot held, before bounding.
        let mut read = HashMap::new();
        for a in &assigned {
            let raw = self.ledger.read_slot(a.node(), a.slot);
            let memo = self
                .memo
                .get(&a.lease_id)
                .filter(|m| m.slot == a.slot)
                .copied();
            let (now, refusals) = bounded(
                &raw,
                memo.as_ref().map(|m| &m.stored),
                a.lease.as_ref(),
                now_ms,
            );
            self.refuse(a, &raw, &refusals);
            let grown = memo.map_or(true, |m| max_totals(&m.stored, &now) != m.stored);
            // A closed slot is final once its lease is over in the
            // database too: a lease renewed after its daemon saw the token
            // expire may be used, and added to, again.
            let ended = a.lease.as_ref().map_or(true, |l| {
                l.state != "active" || l.expires_at.saturating_mul(1000) <= now_ms
            });
            let last = a.finalized || (now.closed != 0 && ended) || self.lease_over(a, now_ms);
            let snapshot = last
                || (snapshot_due
                    && memo.map_or(true, |m| m.snapshot != Some(max_totals(&m.stored, &now))));
            if grown || last || snapshot {
                read.insert(a.lease_id, raw);
                writes.push(UsageWrite {
                    lease_id: a.lease_id,
                    slot: a.slot,
                    node: a.node().map(str::to_owned),
                    totals: stored(&now),
                    finalized: last,
                    snapshot,
                    account: a.lease.as_ref().map(|l| l.account.clone()),
                    harvested: a.lease.as_ref().is_some_and(|l| l.harvested),
                });
            }
        }
        if !writes.is_empty() {
            // The file first: it never holds less than the database.
            if let Err(e) = self.ledger.sync_all() {
                tracing::warn!(error = %e, "cannot sync the region to its file; flushing anyway");
            }
        }
        let written =
            store::write_usage(&self.pool, &name, &writes, &self.cfg.rates, now_ms).await?;
        self.count_rows(&written);
        report.written = writes.len();
        report.snapshots = written.snapshot_rows;
        for w in &writes {
            let stored = written.totals.get(&w.lease_id).copied().unwrap_or(w.totals);
            let prev_snapshot = self.memo.get(&w.lease_id).and_then(|m| m.snapshot);
            self.memo.insert(
                w.lease_id,
                Memo {
                    slot: w.slot,
                    stored,
                    snapshot: if w.snapshot {
                        Some(stored)
                    } else {
                        prev_snapshot
                    },
                },
            );
        }
        if snapshot_due {
            self.last_snapshot_ms = Some(now_ms);
        }

        let finals: Vec<&UsageWrite> = writes.iter().filter(|w| w.finalized).collect();
        report.finals = finals.len();
        if finals.is_empty() {
            return Ok(report);
        }
        #[cfg(test)]
        if self.crash == Some(Crash::AfterFinalWrite) {
            return Err(DbError::Other("crash after the final write".into()));
        }
        let mut free = Vec::new();
        for w in &finals {
            #[cfg(test)]
            if let Some(late) = &self.late_add {
                self.ledger.restore_slot(w.node.as_deref(), w.slot, late);
            }
            let taken = self.ledger.take_slot(w.node.as_deref(), w.slot);
            let was = read.get(&w.lease_id).copied().unwrap_or(w.totals);
            if max_totals(&taken, &was) == stored(&was) {
                free.push((w.slot, w.lease_id, w.node.as_deref()));
            } else {
                // An add landed after the read: put everything back for the
                // next flush to write.
                self.ledger.restore_slot(w.node.as_deref(), w.slot, &taken);
                tracing::info!(
                    slot = w.slot,
                    lease = w.lease_id,
                    "an add landed during the final flush; the slot is freed at the next one"
                );
            }
        }
        for (slot, _, node) in &free {
            self.ledger.sync_slot(*node, *slot).map_err(|e| {
                DbError::Other(format!(
                    "cannot sync zeroed slot {slot} to the region file ({e}); it stays assigned"
                ))
            })?;
        }
        #[cfg(test)]
        if self.crash == Some(Crash::AfterZeroing) {
            return Err(DbError::Other("crash after zeroing".into()));
        }
        let free: Vec<(u32, u64)> = free.iter().map(|(s, l, _)| (*s, *l)).collect();
        report.freed = retrying(|| store::free_slots(&self.pool, &name, &free)).await?;
        self.metrics.slots_freed.inc_by(report.freed);
        for (_, lease) in &free {
            self.memo.remove(lease);
            self.refused.remove(lease);
        }
        Ok(report)
    }

    /// Logs and counts the refusals of `a`'s totals `raw`, once per
    /// distinct `raw`.
    fn refuse(&mut self, a: &Assigned, raw: &SlotTotals, refusals: &[Refusal]) {
        if refusals.is_empty() || self.refused.get(&a.lease_id) == Some(raw) {
            return;
        }
        self.refused.insert(a.lease_id, *raw);
        for r in refusals {
            tracing::warn!(lease = a.lease_id, slot = a.slot, node = a.node().unwrap_or("unknown"), reason = r.reason(), totals = ?raw, "a slot holds totals that cannot be right (a counter shrank, or used more than the lease's cores or memory in its time); those counters keep their stored values");
            self.metrics
                .rejected_adds
                .with_label_values(&[r.reason()])
                .inc();
        }
    }

    /// Takes out of each node's window the adds to assigned slots whose
    /// lease is not on that node, and counts them. Returns how many slots
    /// held such adds.
    fn reject_foreign(&self, assigned: &[Assigned]) -> usize {
        let holders: HashMap<u32, Option<&str>> =
            assigned.iter().map(|a| (a.slot, a.node())).collect();
        let foreign = self.ledger.take_foreign(|slot| holders.get(&slot).copied());
        for (node, slot, taken) in &foreign {
            tracing::warn!(%node, slot, holder = holders.get(slot).copied().flatten().unwrap_or("nobody"), compute_ns = taken.get(Counter::ComputeNs), "a node added to a slot whose lease is not on it; the adds are discarded");
        }
        if !foreign.is_empty() {
            let _ = self.ledger.sync_all();
            self.metrics
                .rejected_adds
                .with_label_values(&["foreign_slot"])
                .inc_by(foreign.len() as u64);
        }
        foreign.len()
    }

    /// Clears free slots that hold adds. Returns how many. A slot that
    /// looks free in `assigned` may have been granted since that list was
    /// read, and its daemon may already be adding: each candidate's
    /// assignment is read again just before it is cleared.
    async fn clear_strays(&self, assigned: &[Assigned]) -> Result<usize, DbError> {
        let held: HashSet<u32> = assigned.iter().map(|a| a.slot).collect();
        let mut strays = 0;
        for slot in (0..self.ledger.slots()).filter(|s| !held.contains(s)) {
            let words = self.ledger.read_anywhere(slot);
            if words != SlotTotals::default() {
                let name = &self.cfg.instance;
                if retrying(|| store::slot_lease(&self.pool, name, slot)).await? != 0 {
                    continue;
                }
                let taken = self.ledger.take_anywhere(slot);
                tracing::warn!(slot, compute_ns = taken.get(Counter::ComputeNs), closed = taken.closed, "a free slot held adds (a daemon added after its lease's slot was freed); cleared");
                strays += 1;
            }
        }
        if strays > 0 {
            let _ = self.ledger.sync_all();
            self.metrics.stray_adds.inc_by(strays as u64);
        }
        Ok(strays)
    }

    fn count_rows(&self, w: &store::Written) {
        let m = &self.metrics.rows_written;
        m.with_label_values(&["usage"]).inc_by(w.usage_rows);
        m.with_label_values(&["usage_snapshots"])
            .inc_by(w.snapshot_rows);
        m.with_label_values(&["account_spend"]).inc_by(w.spend_rows);
    }

    /// Flushes every `period` until `stop` turns true, then once more.
    pub async fn run(mut self, period: Duration, mut stop: tokio::sync::watch::Receiver<bool>) {
        let mut tick = tokio::time::interval(period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let last = tokio::select! {
                _ = tick.tick() => false,
                _ = stop.wait_for(|s| *s) => true,
            };
            self.flush_logged().await;
            if last {
                return;
            }
        }
    }

    /// [`flush_once`](Self::flush_once) now, with metrics and logs.
    pub async fn flush_logged(&mut self) {
        let now = rfaas_service::now_ms();
        match self.flush_once(now).await {
            Ok(r) => {
                self.metrics.flushed(now);
                if self.failures > 0 {
                    tracing::info!(
                        failed = self.failures,
                        "flushes succeed again; nothing was lost"
                    );
                    self.failures = 0;
                }
                if r.freed > 0 || r.finals > 0 {
                    tracing::debug!(?r, "flushed");
                }
            }
            Err(e) => {
                self.metrics.flush_errors.inc();
                self.failures += 1;
                if self.failures == 1 {
                    tracing::warn!(error = %e, "a flush failed; the slots keep counting and the next flush retries");
                } else {
                    tracing::debug!(error = %e, failed = self.failures, "a flush failed again");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::region::Region;
    use crate::store::Instance;
    use rfaas_proto::accounting::UsageFigures;
    use rfaas_service::db;
    use rfaas_testkit::on_both;
    use sqlx::Row;

    /// A database, a region of 8 slots and an instance `t` on them.
    struct Bench {
        pool: AnyPool,
        region: Arc<Region>,
        ledger: Arc<Ledger>,
        _domain: Arc<rfaas_fabric::Domain>,
        _fabric: rfaas_fabric::Fabric,
        _pg: Option<rfaas_testkit::postgres::Postgres>,
        dir: std::path::PathBuf,
    }

    const RATES: Rates = Rates {
        alloc_per_gib_s: 0.5,
        compute_per_s: 2.0,
        hot_per_s: 1.0,
        harvested_discount: 0.5,
    };

    async fn bench(kind: &str) -> Bench {
        let dir = std::env::temp_dir().join(format!(
            "rfaas-flusher-{kind}-{}-{}",
            std::process::id(),
            fastrand::u32(..)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let pg = (kind == "postgres")
            .then(|| rfaas_testkit::postgres::Postgres::start().unwrap_or_else(|e| panic!("{e}")));
        let url = match &pg {
            Some(pg) => pg.url().to_owned(),
            None => format!("sqlite://{}", dir.join("db").display()),
        };
        let pool = db::open_and_migrate(&url, 2).await.unwrap();
        let fabric = rfaas_fabric::Fabric::open("tcp").unwrap();
        let domain = fabric.domain().unwrap();
        let (region, _) = Region::open(&domain, &dir.join("region"), 8).unwrap();
        let region = Arc::new(region);
        let domain = Arc::new(domain);
        let ledger = Arc::new(Ledger::open(domain.clone(), region.clone(), false).unwrap());
        let inst = Instance {
            name: "t".into(),
            provider: "tcp".into(),
            fabric_addr: "127.0.0.1:1".into(),
            metrics_addr: "127.0.0.1:2".into(),
            slots: 8,
            region_id: region.header().region_id,
        };
        store::register_instance(&pool, &inst, 1).await.unwrap();
        store::ensure_slots(&pool, "t", 8).await.unwrap();
        Bench {
            pool,
            region,
            ledger,
            _domain: domain,
            _fabric: fabric,
            _pg: pg,
            dir,
        }
    }

    impl Bench {
        fn flusher(&self, crash: Option<Crash>) -> Flusher {
            let mut f = Flusher::new(
                FlushConfig {
                    instance: "t".into(),
                    snapshot_interval: Duration::from_secs(60),
                    slot_hold: Duration::from_secs(600),
                    rates: RATES,
                },
                self.pool.clone(),
                self.ledger.clone(),
                Arc::new(Metrics::new(0)),
            );
            f.crash = crash;
            f
        }

        /// An active lease `id` in `slot`, granted at 0 with cores and
        /// memory for any usage the tests add.
        async fn lease(&self, id: i64, slot: i64) {
            self.lease_of(id, slot, 1000, 1_000_000, 0).await
        }

        /// An active lease `id` in `slot` of `cores` and `memory_mib`,
        /// granted at `issued_at` (Unix seconds).
        async fn lease_of(&self, id: i64, slot: i64, cores: i64, memory_mib: i64, issued_at: i64) {
            sqlx::query(
                "INSERT INTO leases (id, grant_id, node, owner, user_name, account, cores, memory_mib, issued_at, expires_at, state, ended_ms)
                 VALUES ($1, $1, 'n', 'o', 'u', 'physics', $2, $3, $4, 4000000000, 'active', 0)",
            )
            .bind(id)
            .bind(cores)
            .bind(memory_mib)
            .bind(issued_at)
            .execute(&self.pool)
            .await
            .unwrap();
            sqlx::query("UPDATE billing_slots SET lease_id = $1, assigned_ms = 1 WHERE instance = 't' AND slot = $2")
                .bind(id)
                .bind(slot)
                .execute(&self.pool)
                .await
                .unwrap();
        }

        /// Marks lease `id` released at `at_ms`.
        async fn end(&self, id: i64, at_ms: i64) {
            sqlx::query("UPDATE leases SET state = 'released', ended_ms = $2 WHERE id = $1")
                .bind(id)
                .bind(at_ms)
                .execute(&self.pool)
                .await
                .unwrap();
        }

        async fn slot_lease(&self, slot: i64) -> i64 {
            sqlx::query("SELECT lease_id FROM billing_slots WHERE instance = 't' AND slot = $1")
                .bind(slot)
                .fetch_one(&self.pool)
                .await
                .unwrap()
                .try_get("lease_id")
                .unwrap()
        }

        async fn usage(&self, id: u64) -> store::UsageRow {
            store::usage_of(&self.pool, &[id])
                .await
                .unwrap()
                .pop()
                .unwrap()
        }

        async fn spend(&self) -> f64 {
            store::account_spend(&self.pool, "physics").await.unwrap()
        }
    }

    impl Drop for Bench {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }

    fn usage(seed: u64) -> SlotTotals {
        SlotTotals {
            usage: UsageFigures {
                alloc_mib_ms: 1024 * 1000 * seed,
                compute_ns: 1_000_000_000 * seed,
                hot_ns: 1_000_000_000 * seed,
                warm_ns: seed,
                invocations: seed,
                bytes_in: seed,
                bytes_out: seed,
            },
            closed: 0,
        }
    }

    /// A final flush cut short after each of its steps, then replayed by a
    /// new flusher (as after a restart), stores the same totals, adds the
    /// spend once, and ends with the slot zeroed and freed. Flushes
    /// replayed without new adds change nothing.
    async fn crashes_replay_to_the_same_totals(kind: &str) {
        let b = bench(kind).await;
        b.lease(1, 2).await;
        b.lease(2, 3).await;
        let (u1, u2) = (usage(3), usage(2));
        b.region.restore_slot(2, &u1);
        b.region.restore_slot(3, &u2);
        let once = RATES.cost(&u1.usage, false) + RATES.cost(&u2.usage, false);

        // Lease 2 keeps running; its flush is replayed by fresh flushers.
        for _ in 0..3 {
            b.flusher(None).flush_once(10).await.unwrap();
            assert!((b.spend().await - once).abs() < 1e-9);
        }
        b.region.restore_slot(
            2,
            &SlotTotals {
                closed: 1,
                ..SlotTotals::default()
            },
        );
        // Closed, but the lease is still active in the database: not final.
        let r = b.flusher(None).flush_once(15).await.unwrap();
        assert_eq!(r.finals, 0);
        assert!(!b.usage(1).await.finalized);
        b.end(1, 15).await;

        let err = b.flusher(Some(Crash::AfterFinalWrite)).flush_once(20).await;
        assert!(err.is_err());
        let row = b.usage(1).await;
        assert_eq!((row.totals, row.finalized), (u1, true));
        assert_eq!(b.slot_lease(2).await, 1, "not freed yet");
        assert_eq!(store::stored(&b.region.read_slot(2)), u1, "not zeroed yet");

        let err = b.flusher(Some(Crash::AfterZeroing)).flush_once(30).await;
        assert!(err.is_err());
        assert_eq!(b.region.read_slot(2), SlotTotals::default(), "zeroed");
        assert_eq!(b.slot_lease(2).await, 1, "not freed yet");
        assert_eq!(b.usage(1).await.totals, u1);

        let r = b.flusher(None).flush_once(40).await.unwrap();
        assert_eq!((r.finals, r.freed), (1, 1));
        assert_eq!(b.slot_lease(2).await, 0, "freed");
        let row = b.usage(1).await;
        assert_eq!((row.totals, row.finalized), (u1, true));
        assert!((b.spend().await - once).abs() < 1e-9, "spent once");
        let snaps = store::snapshots_of(&b.pool, 1).await.unwrap();
        assert!(!snaps.is_empty() && snaps.iter().all(|s| s.totals == u1));

        // Nothing more to do: another flush frees nothing and adds nothing.
        let r = b.flusher(None).flush_once(50).await.unwrap();
        assert_eq!((r.assigned, r.finals, r.freed), (1, 0, 0));
        assert!((b.spend().await - once).abs() < 1e-9);
        assert_eq!(b.usage(2).await.totals, u2);
    }

    /// An add that lands between a final flush's read and its zeroing is
    /// put back, the slot stays assigned, and the next flush writes it and
    /// frees the slot.
    async fn a_late_add_keeps_the_slot(kind: &str) {
        let b = bench(kind).await;
        b.lease(1, 0).await;
        b.end(1, 5).await;
        let mut f = b.flusher(None);
        b.region.restore_slot(
            0,
            &SlotTotals {
                closed: 1,
                ..usage(1)
            },
        );
        f.late_add = Some(usage(1));
        let r = f.flush_once(10).await.unwrap();
        assert_eq!((r.finals, r.freed), (1, 0));
        assert_eq!(b.slot_lease(0).await, 1);
        assert_eq!(b.usage(1).await.totals, usage(1));
        assert_eq!(store::stored(&b.region.read_slot(0)), usage(2));
        f.late_add = None;
        let r = f.flush_once(20).await.unwrap();
        assert_eq!((r.finals, r.freed), (1, 1));
        assert_eq!(b.usage(1).await.totals, usage(2));
        assert_eq!(b.region.read_slot(0), SlotTotals::default());
        let want = RATES.cost(&usage(2).usage, false);
        assert!((b.spend().await - want).abs() < 1e-9);
    }

    /// A free slot holding adds is cleared before a new lease gets it.
    async fn strays_are_cleared(kind: &str) {
        let b = bench(kind).await;
        b.region.restore_slot(5, &usage(1));
        let r = b.flusher(None).flush_once(10).await.unwrap();
        assert_eq!(r.strays, 1);
        assert_eq!(b.region.read_slot(5), SlotTotals::default());
    }

    on_both!(async crashes_replay_to_the_same_totals);
    on_both!(async a_late_add_keeps_the_slot);
    on_both!(async strays_are_cleared);

    /// Totals no lease could have made are not stored, and counted: a
    /// counter beyond cores x wall-clock time (or memory x time), one that
    /// shrank (a compare-and-swap), one that wrapped past 2^64. What was
    /// stored stays; growth within the bounds goes on being stored.
    async fn impossible_totals_are_refused_and_counted(kind: &str) {
        let b = bench(kind).await;
        // One core and 1 GiB for 100 s (granted at 1000 s, flushed at 1100 s).
        b.lease_of(7, 3, 1, 1024, 1000).await;
        let metrics = Arc::new(Metrics::new(0));
        let mut f = Flusher::new(
            FlushConfig {
                instance: "t".into(),
                snapshot_interval: Duration::from_secs(60),
                slot_hold: Duration::from_secs(600),
                rates: RATES,
            },
            b.pool.clone(),
            b.ledger.clone(),
            metrics.clone(),
        );
        let rejected = |reason: &str| metrics.rejected_adds.with_label_values(&[reason]).get();
        let words = |compute_ns: u64, alloc_mib_ms: u64| {
            SlotTotals::from_words([alloc_mib_ms, compute_ns, 0, 0, 0, 0, 0, 0])
        };
        let at = 1_100_000;

        // 10^15 ns of compute in 100 s on one core, and 10^12 MiB·ms.
        b.region
            .restore_slot(3, &words(1_000_000_000_000_000, 1_000_000_000_000));
        f.flush_once(at).await.unwrap();
        assert_eq!(b.usage(7).await.totals, SlotTotals::default());
        assert_eq!(rejected("beyond_lease"), 1);
        f.flush_once(at + 1).await.unwrap();
        assert_eq!(rejected("beyond_lease"), 1, "counted once per total");

        // Within the bounds: stored.
        b.region.take_slot(3);
        b.region
            .restore_slot(3, &words(50_000_000_000, 1024 * 50_000));
        f.flush_once(at + 2).await.unwrap();
        assert_eq!(
            b.usage(7).await.totals,
            words(50_000_000_000, 1024 * 50_000)
        );

        // Lowered by a compare-and-swap: the stored totals stay.
        b.region.take_slot(3);
        b.region.restore_slot(3, &words(1, 1024 * 50_000));
        f.flush_once(at + 3).await.unwrap();
        assert_eq!(rejected("shrank"), 1);
        assert_eq!(
            b.usage(7).await.totals,
            words(50_000_000_000, 1024 * 50_000)
        );

        // An add that wraps past 2^64 lowers the word: refused the same way.
        b.region.take_slot(3);
        b.region
            .restore_slot(3, &words(50_000_000_000, 1024 * 50_000));
        b.region
            .restore_slot(3, &words(u64::MAX - 1_000_000_000, 0));
        f.flush_once(at + 4).await.unwrap();
        assert_eq!(rejected("shrank"), 2);
        assert_eq!(
            b.usage(7).await.totals,
            words(50_000_000_000, 1024 * 50_000)
        );
        assert_eq!(rejected("foreign_slot"), 0);
    }
    on_both!(async impossible_totals_are_refused_and_counted);
}

//! Grants: a lease request's one flow ([`Store::request`]): refused at
//! once if no node could ever hold it, placed on the nodes the replica's
//! view offers, granted all or nothing up to its `min_cores` in one
//! transaction ([`Store::grant`]), and, when the view was behind, placed
//! once more on the nodes as the database has them.

use std::collections::{BTreeMap, HashMap};

use rfaas_proto::manager::{ClusterOffer, LeaseState, LeaseView};
use sqlx::Row;
use sqlx::{Any, Transaction};

use super::billing::{assign_slot, AccountingInstance};
use super::budgets::budget_of;
use super::leases::{LeaseRow, LEASE_COLS};
use super::nodes::leased_cols;
use super::{new_id, Store};
use crate::announce::Leased;
use crate::db::{i, retrying, text_col, u64_col, DbError};
use crate::view::View;

/// A lease request, checked, as [`Store::request`] takes it.
#[derive(Debug, Clone)]
pub struct LeaseAsk<'a> {
    /// The grant wanted; its `candidates` and `billing` are left empty:
    /// the flow fills them from the replica's view.
    pub grant: GrantPlan,
    /// Nodes to try first, in this order.
    pub preferred: &'a [String],
    /// How long an accounting instance may be silent and still give
    /// billing slots, ms.
    pub accounting_lost_after_ms: u64,
}

/// A grant made: its id and node leases, each with its billing slot.
#[derive(Debug, Clone, PartialEq)]
pub struct Grant {
    /// The grant's id.
    pub grant_id: u64,
    /// Its node leases.
    pub leases: Vec<LeaseRow>,
}

/// Why [`Store::request`] granted nothing.
#[derive(Debug, Clone, PartialEq)]
pub enum Refused {
    /// No node that ever registered could hold the request.
    ExceedsCluster {
        /// What it asks beyond the cluster.
        beyond: Beyond,
        /// The largest request the cluster could ever hold.
        offer: ClusterOffer,
    },
    /// Not enough cores fit now.
    NoCapacity {
        /// When the soonest active lease ends, Unix seconds.
        soonest_expiry: Option<u64>,
    },
    /// The account or billing said no.
    Denied(Denied),
}

/// What a request asks beyond what the cluster could ever hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Beyond {
    /// More memory per node lease than the largest node lends.
    Memory,
    /// More cores than the nodes that lend that memory, which are not all
    /// of them.
    CoresWithMemory,
    /// More cores than all nodes together.
    Cores,
}

impl Beyond {
    /// What a request for `memory_mib` per node lease and at least
    /// `min_cores` asks beyond `offer`, if anything. With no node known
    /// yet the cluster may still be coming up: nothing is beyond it.
    pub fn of(offer: &ClusterOffer, memory_mib: u64, min_cores: u32) -> Option<Beyond> {
        let min_cores = u64::from(min_cores);
        if offer.nodes == 0 {
            None
        } else if memory_mib > offer.largest_node_memory_mib {
            Some(Beyond::Memory)
        } else if min_cores > offer.cores_with_memory
            && offer.cores_with_memory < offer.cluster_cores
        {
            Some(Beyond::CoresWithMemory)
        } else if min_cores > offer.cores_with_memory {
            Some(Beyond::Cores)
        } else {
            None
        }
    }
}

/// What a grant asks the database for.
#[derive(Debug, Clone)]
pub struct GrantPlan {
    /// The credential subject asking.
    pub owner: String,
    /// The user the workers run as.
    pub user: String,
    /// The account charged.
    pub account: String,
    /// The account's cap on cores held at once.
    pub cap: Option<u32>,
    /// Nodes to try, best first, with the free cores the replica's view
    /// believes each has.
    pub candidates: Vec<(String, u32)>,
    /// Cores wanted.
    pub cores: u32,
    /// Fewest cores worth granting.
    pub min_cores: u32,
    /// Memory per node lease, MiB.
    pub memory_mib: u64,
    /// Unix seconds.
    pub issued_at: u64,
    /// Unix seconds.
    pub expires_at: u64,
    /// The batch job the leases serve, if known.
    pub job_id: Option<u64>,
    /// Accounting instances to take billing slots from, best first (see
    /// [`crate::view::View::billing_candidates`]); empty: unbilled.
    pub billing: Vec<AccountingInstance>,
    /// Refuse the grant ([`Denied::AccountingUnavailable`]) rather
    /// than leave a node lease unbilled.
    pub billing_required: bool,
}

/// A grant's outcome.
#[derive(Debug, Clone, PartialEq)]
pub enum GrantOutcome {
    /// Granted: the new node leases, under `grant_id`.
    Granted {
        /// The grant's id.
        grant_id: u64,
        /// Its node leases.
        leases: Vec<LeaseRow>,
    },
    /// Not enough cores fit.
    NoCapacity,
    /// The account or billing said no.
    Denied(Denied),
}

/// A grant the account or billing refuses, whatever capacity is free.
#[derive(Debug, Clone, PartialEq)]
pub enum Denied {
    /// The account's cap would be passed.
    Quota {
        /// The cap.
        cap: u32,
        /// Cores the account holds now.
        in_use: u64,
    },
    /// The account has spent its budget.
    BudgetExhausted {
        /// Its budget.
        budget: f64,
        /// What it has spent.
        spend: f64,
    },
    /// A node lease found no free billing slot (or no accounting instance
    /// is live), and billing is required.
    AccountingUnavailable,
}

impl Store {
    /// Grants what fits of `plan` in one transaction, all or nothing up to
    /// `plan.min_cores`: the account (its budget, then its cap), the
    /// nodes, a billing slot per node lease, then the lease rows.
    pub async fn grant(&self, plan: &GrantPlan) -> Result<GrantOutcome, DbError> {
        let mut tx = self.pool.begin().await?;
        // The account first (lock order), reserving what the cap allows.
        sqlx::query("INSERT INTO accounts (name, leased_cores) VALUES ($1, 0) ON CONFLICT (name) DO NOTHING")
            .bind(&plan.account)
            .execute(&mut *tx)
            .await?;
        // The budget, read after a write: on SQLite the transaction then
        // holds the write lock, so this read cannot go stale before the
        // writes that follow (which SQLite would refuse, busy).
        if let Some(b) = budget_of(&mut tx, &plan.account).await? {
            if b.spend >= b.budget {
                tx.rollback().await?;
                return Ok(GrantOutcome::Denied(Denied::BudgetExhausted {
                    budget: b.budget,
                    spend: b.spend,
                }));
            }
        }
        let mut want = plan.cores;
        if let Some(cap) = plan.cap {
            let in_use = u64_col(
                &sqlx::query("SELECT leased_cores FROM accounts WHERE name = $1")
                    .bind(&plan.account)
                    .fetch_one(&mut *tx)
                    .await?,
                "leased_cores",
            )?;
            let room = u64::from(cap).saturating_sub(in_use);
            if room < u64::from(plan.min_cores) {
                return Ok(GrantOutcome::Denied(Denied::Quota { cap, in_use }));
            }
            want = want.min(room as u32);
        }
        let done = sqlx::query(
            "UPDATE accounts SET leased_cores = leased_cores + $2 WHERE name = $1 AND ($3 = 0 OR leased_cores + $2 <= $3)",
        )
        .bind(&plan.account)
        .bind(i(want.into()))
        .bind(i(plan.cap.unwrap_or(0).into()))
        .execute(&mut *tx)
        .await?;
        if done.rows_affected() != 1 {
            // Another grant took the room between the read and the update.
            return Err(DbError::Conflict(
                "the account's cap was reached meanwhile".into(),
            ));
        }

        // The nodes, in name order, each by a conditional update.
        let mut chosen: BTreeMap<&str, u32> = BTreeMap::new();
        let mut left = want;
        for (name, free) in &plan.candidates {
            if left == 0 {
                break;
            }
            let take = (*free).min(left);
            if take > 0 {
                chosen.insert(name, take);
                left -= take;
            }
        }
        let mut got: Vec<(&str, u32)> = Vec::new();
        // Each node's leased counters after this grant.
        let mut leased: Vec<Leased> = Vec::new();
        let mut total = 0u32;
        for (name, take) in &chosen {
            if let Some(counters) = self.take(&mut tx, name, *take, plan.memory_mib).await? {
                got.push((name, *take));
                leased.push(counters);
                total += take;
            }
        }
        // The view was stale for some: try the rest at what the database
        // says they have.
        if total < want {
            for (name, _) in &plan.candidates {
                if total >= want {
                    break;
                }
                if got.iter().any(|(n, _)| n == name) {
                    continue;
                }
                let row = sqlx::query(
                    "SELECT cores - draining_cores - leased_cores - withheld_cores AS free FROM nodes
                     WHERE name = $1 AND admin_state = 'up' AND lost = 0 AND leased_memory_mib + $2 <= memory_mib - draining_memory_mib",
                )
                .bind(name.as_str())
                .bind(i(plan.memory_mib))
                .fetch_optional(&mut *tx)
                .await?;
                let free = match row {
                    Some(r) => r.try_get::<i64, _>("free")?.max(0) as u32,
                    None => 0,
                };
                let take = free.min(want - total);
                if take == 0 {
                    continue;
                }
                if let Some(counters) = self.take(&mut tx, name, take, plan.memory_mib).await? {
                    got.push((name, take));
                    leased.push(counters);
                    total += take;
                }
            }
        }
        if total < plan.min_cores.max(1) {
            tx.rollback().await?;
            return Ok(GrantOutcome::NoCapacity);
        }
        if total < want {
            sqlx::query("UPDATE accounts SET leased_cores = leased_cores - $2 WHERE name = $1")
                .bind(&plan.account)
                .bind(i((want - total).into()))
                .execute(&mut *tx)
                .await?;
        }
        // A billing slot per node lease, after the nodes (lock order).
        let assigned_ms = crate::now_ms();
        let mut full = vec![false; plan.billing.len()];
        let mut slots = Vec::with_capacity(got.len());
        for _ in &got {
            let lease_id = new_id();
            let slot =
                assign_slot(&mut tx, lease_id, &plan.billing, &mut full, assigned_ms).await?;
            if slot.is_none() && plan.billing_required {
                tx.rollback().await?;
                return Ok(GrantOutcome::Denied(Denied::AccountingUnavailable));
            }
            slots.push((lease_id, slot));
        }
        let grant_id = new_id();
        let mut leases = Vec::with_capacity(got.len());
        for ((node, cores), (lease_id, billing)) in got.iter().zip(slots) {
            let view = LeaseView {
                lease_id,
                grant_id,
                node: (*node).to_owned(),
                user: plan.user.clone(),
                account: plan.account.clone(),
                cores: *cores,
                memory_mib: plan.memory_mib,
                issued_at: plan.issued_at,
                expires_at: plan.expires_at,
                state: LeaseState::Active,
                job_id: plan.job_id,
            };
            // `harvested` is the node's, for the accounting service's
            // discount.
            sqlx::query(&format!(
                "INSERT INTO leases ({LEASE_COLS}, ended_ms, harvested)
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, 'active', $11, 0,
                    (SELECT harvested FROM nodes WHERE name = $3))"
            ))
            .bind(i(view.lease_id))
            .bind(i(grant_id))
            .bind(&view.node)
            .bind(&plan.owner)
            .bind(&view.user)
            .bind(&view.account)
            .bind(i(view.cores.into()))
            .bind(i(view.memory_mib))
            .bind(i(view.issued_at))
            .bind(i(view.expires_at))
            .bind(plan.job_id.map(i))
            .execute(&mut *tx)
            .await?;
            leases.push(LeaseRow {
                view,
                owner: plan.owner.clone(),
                billing,
            });
        }
        tx.commit().await?;
        self.committed(&leased);
        Ok(GrantOutcome::Granted { grant_id, leases })
    }

    /// Leases `cores` and `memory_mib` on `node` if they fit; the node's
    /// counters after.
    async fn take(
        &self,
        tx: &mut Transaction<'static, Any>,
        node: &str,
        cores: u32,
        memory_mib: u64,
    ) -> Result<Option<Leased>, DbError> {
        sqlx::query(
            "UPDATE nodes SET leased_cores = leased_cores + $2, leased_memory_mib = leased_memory_mib + $3,
                lease_seq = lease_seq + 1
             WHERE name = $1 AND admin_state = 'up' AND lost = 0
               AND leased_cores + withheld_cores + $2 <= cores - draining_cores
               AND leased_memory_mib + $3 <= memory_mib - draining_memory_mib
             RETURNING leased_cores, leased_memory_mib, lease_seq",
        )
        .bind(node)
        .bind(i(cores.into()))
        .bind(i(memory_mib))
        .fetch_optional(&mut **tx)
        .await?
        .map(|row| leased_cols(node, &row))
        .transpose()
    }

    /// Cores each account holds now.
    pub async fn account_use(&self) -> Result<HashMap<String, u64>, DbError> {
        let mut out = HashMap::new();
        for row in sqlx::query("SELECT name, leased_cores FROM accounts")
            .fetch_all(&self.pool)
            .await?
        {
            out.insert(text_col(&row, "name")?, u64_col(&row, "leased_cores")?);
        }
        Ok(out)
    }

    /// A lease request, from placement to outcome: refused at once when
    /// no node that ever registered could hold it (the view's sums, no
    /// query), or when billing is required and no accounting instance is
    /// live; otherwise granted on the view's candidates. When nothing fits
    /// the view may be behind: it is reloaded from the database once, the
    /// request checked against it again, and placed once more. Billing
    /// slots taken count in the view until its next reload.
    pub async fn request(
        &self,
        view: &View,
        ask: &LeaseAsk<'_>,
    ) -> Result<Result<Grant, Refused>, DbError> {
        let (memory_mib, min_cores) = (ask.grant.memory_mib, ask.grant.min_cores);
        let beyond = |view: &View| {
            let offer = view.offer(memory_mib);
            Beyond::of(&offer, memory_mib, min_cores)
                .map(|beyond| Refused::ExceedsCluster { beyond, offer })
        };
        if let Some(refused) = beyond(view) {
            return Ok(Err(refused));
        }
        let mut plan = ask.grant.clone();
        plan.billing = view.billing_candidates(crate::now_ms(), ask.accounting_lost_after_ms);
        if plan.billing_required && plan.billing.is_empty() {
            return Ok(Err(Refused::Denied(Denied::AccountingUnavailable)));
        }
        plan.candidates = view.candidates(memory_mib, plan.cores, ask.preferred);
        let mut outcome = retrying(|| self.grant(&plan)).await?;
        if outcome == GrantOutcome::NoCapacity {
            view.replace_all(self.nodes().await?);
            if let Some(refused) = beyond(view) {
                return Ok(Err(refused));
            }
            plan.candidates = view.candidates(memory_mib, plan.cores, ask.preferred);
            outcome = retrying(|| self.grant(&plan)).await?;
        }
        Ok(match outcome {
            GrantOutcome::Granted { grant_id, leases } => {
                view.apply_slots(&leases);
                Ok(Grant { grant_id, leases })
            }
            GrantOutcome::NoCapacity => Err(Refused::NoCapacity {
                soonest_expiry: self.soonest_expiry().await?,
            }),
            GrantOutcome::Denied(denied) => Err(Refused::Denied(denied)),
        })
    }
}

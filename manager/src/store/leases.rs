//! Node leases once granted: renewals, releases, expiries, listings, and
//! giving back what ended leases held.

use std::collections::BTreeMap;

use rfaas_proto::accounting::BillingSlot;
use rfaas_proto::manager::{LeaseState, LeaseView};
use sqlx::any::AnyRow;
use sqlx::{Any, Row, Transaction};

use super::nodes::leased_cols;
use super::Store;
use crate::announce::Leased;
use crate::db::{i, text_col, u64_col, DbError};

/// The columns of a lease, in the order [`lease_from_row`] reads them.
pub(super) const LEASE_COLS: &str =
    "id, grant_id, node, owner, user_name, account, cores, memory_mib, issued_at, expires_at, state, job_id";

/// A release's settling of a node's capacity, `$2` cores and `$3` MiB
/// fewer leased: a node's `cores` is what it registered (`cores -
/// draining_cores`) or what is leased, whichever is more, so it never
/// holds less than is leased, and what drains leaves with the leases
/// (memory alike). Grants need none of it: they place nothing on a
/// draining node, whose leased cores or memory fill its capacity.
const NODE_CAPACITY: &str = "
    cores = CASE WHEN leased_cores - $2 > cores - draining_cores THEN leased_cores - $2 ELSE cores - draining_cores END,
    draining_cores = CASE WHEN leased_cores - $2 > cores - draining_cores
        THEN leased_cores - $2 - (cores - draining_cores) ELSE 0 END,
    memory_mib = CASE WHEN leased_memory_mib - $3 > memory_mib - draining_memory_mib
        THEN leased_memory_mib - $3 ELSE memory_mib - draining_memory_mib END,
    draining_memory_mib = CASE WHEN leased_memory_mib - $3 > memory_mib - draining_memory_mib
        THEN leased_memory_mib - $3 - (memory_mib - draining_memory_mib) ELSE 0 END";

/// A node lease as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseRow {
    /// What the API shows.
    pub view: LeaseView,
    /// The credential subject that asked for it (renews and releases it).
    pub owner: String,
    /// Its billing slot, where the caller asked for it (grants and
    /// renewals); `None` there: unbilled.
    pub billing: Option<BillingSlot>,
}

fn lease_state(s: &str) -> LeaseState {
    match s {
        "active" => LeaseState::Active,
        "released" => LeaseState::Released,
        "lost" => LeaseState::Lost,
        _ => LeaseState::Expired,
    }
}

/// Which leases a listing keeps.
#[derive(Debug, Clone, Default)]
pub struct LeaseFilter<'a> {
    /// In this state only; `None`: every state.
    pub state: Option<LeaseState>,
    /// Of this credential subject only.
    pub owner: Option<&'a str>,
    /// Run as this user only.
    pub user: Option<&'a str>,
    /// Charged to this account only.
    pub account: Option<&'a str>,
    /// On this node only.
    pub node: Option<&'a str>,
    /// For this batch job only.
    pub job_id: Option<u64>,
}

impl LeaseFilter<'_> {
    /// The listing's statement and its text and number parameters, in
    /// that order.
    pub fn select(&self, after: Option<(u64, u64)>, limit: u32) -> (String, Vec<String>, Vec<i64>) {
        let mut conds: Vec<String> = Vec::new();
        let mut texts: Vec<String> = Vec::new();
        let mut numbers: Vec<i64> = Vec::new();
        let state = self.state.map(|s| lease_state_name(s).to_owned());
        let columns = [
            ("state", state.as_deref()),
            ("owner", self.owner),
            ("user_name", self.user),
            ("account", self.account),
            ("node", self.node),
        ];
        for (col, value) in columns {
            if let Some(v) = value {
                texts.push(v.to_owned());
                conds.push(format!("{col} = ${}", texts.len()));
            }
        }
        let mut number = |n: u64| {
            numbers.push(i(n));
            format!("${}", texts.len() + numbers.len())
        };
        if let Some(job) = self.job_id {
            conds.push(format!("job_id = {}", number(job)));
        }
        if let Some((issued_at, id)) = after {
            let (a, b) = (number(issued_at), number(id));
            conds.push(format!(
                "(issued_at < {a} OR (issued_at = {a} AND id < {b}))"
            ));
        }
        let limit = number(limit.into());
        let filter = if conds.is_empty() {
            String::new()
        } else {
            format!("WHERE {}", conds.join(" AND "))
        };
        // The state index orders the rows of one state by issue time.
        let order = if self.state.is_some() {
            "state DESC, issued_at DESC, id DESC"
        } else {
            "issued_at DESC, id DESC"
        };
        (
            format!("SELECT {LEASE_COLS} FROM leases {filter} ORDER BY {order} LIMIT {limit}"),
            texts,
            numbers,
        )
    }
}

/// The stored name of a lease state.
pub fn lease_state_name(s: LeaseState) -> &'static str {
    match s {
        LeaseState::Active => "active",
        LeaseState::Released => "released",
        LeaseState::Expired => "expired",
        LeaseState::Lost => "lost",
    }
}

fn lease_from_row(row: &AnyRow) -> Result<LeaseRow, DbError> {
    Ok(LeaseRow {
        owner: text_col(row, "owner")?,
        billing: None,
        view: LeaseView {
            lease_id: u64_col(row, "id")?,
            grant_id: u64_col(row, "grant_id")?,
            node: text_col(row, "node")?,
            user: text_col(row, "user_name")?,
            account: text_col(row, "account")?,
            cores: u64_col(row, "cores")? as u32,
            memory_mib: u64_col(row, "memory_mib")?,
            issued_at: u64_col(row, "issued_at")?,
            expires_at: u64_col(row, "expires_at")?,
            state: lease_state(&text_col(row, "state")?),
            job_id: row.try_get::<Option<i64>, _>("job_id")?.map(|v| v as u64),
        },
    })
}

impl Store {
    /// Gives back what ended leases held: accounts, then nodes by name.
    /// Returns the nodes' counters after.
    async fn give_back(
        &self,
        tx: &mut Transaction<'static, Any>,
        ended: &[LeaseRow],
    ) -> Result<Vec<Leased>, DbError> {
        let mut accounts: BTreeMap<&str, u64> = BTreeMap::new();
        let mut nodes: BTreeMap<&str, (u64, u64)> = BTreeMap::new();
        for l in ended {
            *accounts.entry(&l.view.account).or_default() += u64::from(l.view.cores);
            let n = nodes.entry(&l.view.node).or_default();
            n.0 += u64::from(l.view.cores);
            n.1 += l.view.memory_mib;
        }
        for (account, cores) in &accounts {
            sqlx::query("UPDATE accounts SET leased_cores = leased_cores - $2 WHERE name = $1")
                .bind(*account)
                .bind(i(*cores))
                .execute(&mut **tx)
                .await?;
        }
        let mut leased = Vec::with_capacity(nodes.len());
        for (node, (cores, mem)) in &nodes {
            let row = sqlx::query(&format!(
                "UPDATE nodes SET leased_cores = leased_cores - $2, leased_memory_mib = leased_memory_mib - $3,
                    {NODE_CAPACITY}, lease_seq = lease_seq + 1 WHERE name = $1
                 RETURNING leased_cores, leased_memory_mib, lease_seq"
            ))
            .bind(*node)
            .bind(i(*cores))
            .bind(i(*mem))
            .fetch_optional(&mut **tx)
            .await?;
            if let Some(row) = row {
                leased.push(leased_cols(node, &row)?);
            }
        }
        Ok(leased)
    }

    /// Ends the leases `update` (an `UPDATE leases ... RETURNING
    /// {LEASE_COLS}`) marks, and gives back what they held, in one
    /// transaction: lease rows first, then accounts and nodes (the lock
    /// order of [`crate::db`]).
    pub(super) async fn end_leases<'q>(
        &self,
        update: sqlx::query::Query<'q, Any, sqlx::any::AnyArguments<'q>>,
    ) -> Result<Vec<LeaseRow>, DbError> {
        let mut tx = self.pool.begin().await?;
        let (ended, leased) = self.end_leases_in(&mut tx, update).await?;
        tx.commit().await?;
        self.committed(&leased);
        Ok(ended)
    }

    /// As [`end_leases`](Self::end_leases), inside transaction `tx`; also
    /// the nodes' counters, for [`committed`](Self::committed) after the
    /// commit.
    pub(super) async fn end_leases_in<'q>(
        &self,
        tx: &mut Transaction<'static, Any>,
        update: sqlx::query::Query<'q, Any, sqlx::any::AnyArguments<'q>>,
    ) -> Result<(Vec<LeaseRow>, Vec<Leased>), DbError> {
        let ended = update
            .fetch_all(&mut **tx)
            .await?
            .iter()
            .map(lease_from_row)
            .collect::<Result<Vec<_>, _>>()?;
        let leased = self.give_back(tx, &ended).await?;
        Ok((ended, leased))
    }

    /// Ends grant `grant_id`'s active leases as `state`. Returns what it
    /// ended (empty if nothing was active).
    pub async fn end_grant(
        &self,
        grant_id: u64,
        state: LeaseState,
        now_ms: u64,
    ) -> Result<Vec<LeaseRow>, DbError> {
        self.end_grant_of(grant_id, None, state, now_ms).await
    }

    /// As [`end_grant`](Self::end_grant), only if `owner` (when given)
    /// holds it: a release needs no separate ownership query when it
    /// succeeds.
    pub async fn end_grant_of(
        &self,
        grant_id: u64,
        owner: Option<&str>,
        state: LeaseState,
        now_ms: u64,
    ) -> Result<Vec<LeaseRow>, DbError> {
        let sql = format!(
            "UPDATE leases SET state = $2, ended_ms = $3 WHERE grant_id = $1 AND state = 'active'
               AND ($4 = '' OR owner = $4) RETURNING {LEASE_COLS}"
        );
        self.end_leases(
            sqlx::query(&sql)
                .bind(i(grant_id))
                .bind(lease_state_name(state))
                .bind(i(now_ms))
                .bind(owner.unwrap_or("")),
        )
        .await
    }

    /// Ends every active lease that has expired at `now_s`.
    pub async fn reap_expired(&self, now_s: u64, now_ms: u64) -> Result<Vec<LeaseRow>, DbError> {
        let sql = format!(
            "UPDATE leases SET state = 'expired', ended_ms = $2 WHERE state = 'active' AND expires_at <= $1 RETURNING {LEASE_COLS}"
        );
        self.end_leases(sqlx::query(&sql).bind(i(now_s)).bind(i(now_ms)))
            .await
    }

    /// Moves grant `grant_id`'s active leases' expiry to `expires_at`,
    /// never earlier than it was: an executor keeps the latest expiry it
    /// was shown, so a shorter one would let the manager lease cores the
    /// executor still serves. Returns them (empty: nothing active).
    ///
    /// A lease has ended at its `expires_at` second (Unix ms `now_ms`
    /// from `expires_at * 1000` on), as the reaper and the executors
    /// count, whether or not the reaper has marked it yet: such leases are
    /// not renewed, so a late renewal never brings back a lease whose
    /// workers the executors have stopped.
    ///
    /// Each keeps the billing slot it was granted with (the tokens of a
    /// renewal name the same slot), read with the instance's current
    /// address.
    pub async fn renew(
        &self,
        grant_id: u64,
        expires_at: u64,
        now_ms: u64,
    ) -> Result<Vec<LeaseRow>, DbError> {
        let rows = sqlx::query(&format!(
            "UPDATE leases SET expires_at = CASE WHEN expires_at > $2 THEN expires_at ELSE $2 END
             WHERE grant_id = $1 AND state = 'active' AND expires_at * 1000 > $3 RETURNING {LEASE_COLS}"
        ))
        .bind(i(grant_id))
        .bind(i(expires_at))
        .bind(i(now_ms))
        .fetch_all(&self.pool)
        .await?;
        let mut leases = rows
            .iter()
            .map(lease_from_row)
            .collect::<Result<Vec<_>, _>>()?;
        if leases.is_empty() {
            return Ok(leases);
        }
        let mut slots = self.grant_billing(grant_id).await?;
        for l in &mut leases {
            l.billing = slots.remove(&l.view.lease_id);
        }
        Ok(leases)
    }

    /// A grant's leases, whatever their state.
    pub async fn grant_leases(&self, grant_id: u64) -> Result<Vec<LeaseRow>, DbError> {
        sqlx::query(&format!(
            "SELECT {LEASE_COLS} FROM leases WHERE grant_id = $1 ORDER BY node"
        ))
        .bind(i(grant_id))
        .fetch_all(&self.pool)
        .await?
        .iter()
        .map(lease_from_row)
        .collect()
    }

    /// The accounts any lease of `user` was charged to: those the user
    /// belongs to, as far as the manager knows.
    pub async fn accounts_of(&self, user: &str) -> Result<Vec<String>, DbError> {
        sqlx::query("SELECT DISTINCT account FROM leases WHERE user_name = $1")
            .bind(user)
            .fetch_all(&self.pool)
            .await?
            .iter()
            .map(|r| text_col(r, "account"))
            .collect()
    }

    /// A page of the leases `filter` keeps, newest first (then by id,
    /// highest first): those after the `(issued_at, id)` cursor `after`,
    /// at most `limit`. It reads an index in that order
    /// (`leases_listed`, or `leases_listed_all` for every state).
    pub async fn leases(
        &self,
        filter: &LeaseFilter<'_>,
        after: Option<(u64, u64)>,
        limit: u32,
    ) -> Result<Vec<LeaseRow>, DbError> {
        let (sql, texts, numbers) = filter.select(after, limit);
        let mut q = sqlx::query(&sql);
        for t in texts {
            q = q.bind(t);
        }
        for n in numbers {
            q = q.bind(n);
        }
        q.fetch_all(&self.pool)
            .await?
            .iter()
            .map(lease_from_row)
            .collect()
    }

    /// When the soonest active lease ends, Unix seconds.
    pub async fn soonest_expiry(&self) -> Result<Option<u64>, DbError> {
        let row =
            sqlx::query("SELECT MIN(expires_at) AS soonest FROM leases WHERE state = 'active'")
                .fetch_one(&self.pool)
                .await?;
        let v: Option<i64> = row.try_get("soonest")?;
        Ok(v.map(|v| v.max(0) as u64))
    }
}

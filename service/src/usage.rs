//! Usage per lease over a period, as reports read it: from the tables
//! the accounting services write (`usage`, `usage_snapshots`) joined to
//! the manager's `leases`; one SQL text for PostgreSQL and SQLite.
//! `rfaas-billing` reads it straight from the database (admins), and the
//! manager's `GET /v1/usage` for anyone with a credential.
//!
//! The usage of a lease in a period `[S, E)` is its totals at `E` minus
//! its totals at `S`, where a lease's totals at a time are those of its
//! latest snapshot at or before that time, zero if none, and its current
//! totals when `E` is now or later.
//!
//! Leases the manager's retention has purged live on as per-day totals
//! (`usage_daily`, one row per UTC day, user, account, job, node and
//! harvested flag): a day counts in a period when the day starts inside
//! it, and such rows carry lease id 0. Over periods that start and end
//! at midnight UTC, reports give the same totals before and after a
//! purge.

use rfaas_proto::accounting::{SlotTotals, UsageFigures, SLOT_WORDS};
use sqlx::any::AnyRow;
use sqlx::{AnyPool, Row};

use crate::db::{self, i, DbError};

/// Which leases count (`-u`, `-A`, `-j`); an empty list lets any through.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Filters {
    /// Users.
    pub users: Vec<String>,
    /// Accounts.
    pub accounts: Vec<String>,
    /// Job ids.
    pub jobs: Vec<u64>,
}

/// The period `[start_ms, end_ms)`, Unix ms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Period {
    /// Its start.
    pub start_ms: u64,
    /// Its end, excluded.
    pub end_ms: u64,
}

pub use rfaas_proto::manager::LeaseUsage;

/// The usage counters, as columns of `usage`, `usage_snapshots` and
/// `usage_daily`, in the order of a slot's words.
pub const COUNTERS: [&str; 7] = [
    "alloc_mib_ms",
    "compute_ns",
    "hot_ns",
    "warm_ns",
    "invocations",
    "bytes_in",
    "bytes_out",
];

/// The totals in columns `{prefix}alloc_mib_ms`, ... (`None` if they are
/// NULL: no such row).
pub fn totals(row: &AnyRow, prefix: &str) -> Result<Option<UsageFigures>, DbError> {
    // The slot's words less `closed`, which stays 0.
    let mut w = [0u64; SLOT_WORDS];
    for (word, name) in w.iter_mut().zip(COUNTERS) {
        let col = format!("{prefix}{name}");
        let Some(v) = row.try_get::<Option<i64>, _>(col.as_str())? else {
            return Ok(None);
        };
        *word = u64::try_from(v).map_err(|_| DbError::Other(format!("column {name} holds {v}")))?;
    }
    Ok(Some(SlotTotals::from_words(w).usage))
}

/// A value bound to the statement being built.
enum Param<'a> {
    Int(i64),
    Text(&'a str),
}

/// `AND column IN ($n, ...)` for a non-empty list, numbering from `params`.
fn any_of<'a>(sql: &mut String, params: &mut Vec<Param<'a>>, column: &str, values: Vec<Param<'a>>) {
    if values.is_empty() {
        return;
    }
    let marks: Vec<String> = (0..values.len())
        .map(|k| format!("${}", params.len() + k + 1))
        .collect();
    sql.push_str(&format!(" AND {column} IN ({})", marks.join(", ")));
    params.extend(values);
}

/// The usage in `period` of every lease `filters` let through whose
/// usage there is not zero, by lease id. `now_ms` decides whether the
/// current totals stand in for the end.
///
/// Only leases with a snapshot inside `(start, end]`, or (for an end at
/// or after now) whose totals were flushed after the start, are read: the
/// others' totals at both edges are equal, or differ only by usage flushed
/// before the start that no snapshot has caught up with yet.
pub async fn lease_usage(
    pool: &AnyPool,
    period: Period,
    filters: &Filters,
    now_ms: u64,
) -> Result<Vec<LeaseUsage>, DbError> {
    let current = period.end_ms >= now_ms;
    let latest = |alias: &str, edge: &str| {
        format!(
            "LEFT JOIN usage_snapshots {alias} ON {alias}.lease_id = l.id AND {alias}.at_ms = \
             (SELECT MAX(x.at_ms) FROM usage_snapshots x WHERE x.lease_id = l.id AND x.at_ms <= {edge})"
        )
    };
    let cols = |alias: &str, prefix: &str| {
        COUNTERS
            .iter()
            .map(|c| format!("{alias}.{c} AS {prefix}{c}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let mut sql = format!(
        "SELECT l.id, l.user_name, l.account, l.job_id, l.node, l.harvested, {}, {}{} FROM leases l {} {}",
        cols("s", "s_"),
        cols("e", "e_"),
        if current {
            format!(", {}", cols("u", "u_"))
        } else {
            String::new()
        },
        latest("s", "$1"),
        latest("e", "$2"),
    );
    if current {
        sql.push_str(
            " LEFT JOIN usage u ON u.lease_id = l.id WHERE (l.id IN \
             (SELECT lease_id FROM usage_snapshots WHERE at_ms > $1 AND at_ms <= $2) \
             OR u.updated_ms > $1)",
        );
    } else {
        sql.push_str(
            " WHERE l.id IN (SELECT lease_id FROM usage_snapshots WHERE at_ms > $1 AND at_ms <= $2)",
        );
    }
    let mut params = vec![Param::Int(i(period.start_ms)), Param::Int(i(period.end_ms))];
    filtered(&mut sql, &mut params, "l", filters);
    sql.push_str(" ORDER BY l.id");
    let mut out = Vec::new();
    for row in bound(&sql, &params).fetch_all(pool).await? {
        let start = totals(&row, "s_")?.unwrap_or_default();
        let mut end = totals(&row, "e_")?;
        if current {
            if let Some(u) = totals(&row, "u_")? {
                end = Some(u);
            }
        }
        let usage = end.unwrap_or_default().since(&start);
        if usage == UsageFigures::default() {
            continue;
        }
        let job: Option<i64> = row.try_get("job_id")?;
        out.push(LeaseUsage {
            lease: db::u64_col(&row, "id")?,
            user: db::text_col(&row, "user_name")?,
            account: db::text_col(&row, "account")?,
            job: job
                .map(|j| {
                    u64::try_from(j).map_err(|_| DbError::Other(format!("column job_id holds {j}")))
                })
                .transpose()?,
            node: db::text_col(&row, "node")?,
            harvested: row.try_get::<i64, _>("harvested")? != 0,
            usage,
        });
    }
    out.extend(daily_usage(pool, period, filters).await?);
    Ok(out)
}

/// `AND {alias}.user_name IN (...)` and so on for each filter given.
fn filtered<'a>(sql: &mut String, params: &mut Vec<Param<'a>>, alias: &str, filters: &'a Filters) {
    any_of(
        sql,
        params,
        &format!("{alias}.user_name"),
        filters.users.iter().map(|u| Param::Text(u)).collect(),
    );
    any_of(
        sql,
        params,
        &format!("{alias}.account"),
        filters.accounts.iter().map(|a| Param::Text(a)).collect(),
    );
    any_of(
        sql,
        params,
        &format!("{alias}.job_id"),
        filters.jobs.iter().map(|&j| Param::Int(i(j))).collect(),
    );
}

fn bound<'q>(
    sql: &'q str,
    params: &'q [Param<'q>],
) -> sqlx::query::Query<'q, sqlx::Any, sqlx::any::AnyArguments<'q>> {
    let mut q = sqlx::query(sql);
    for p in params {
        q = match p {
            Param::Int(v) => q.bind(*v),
            Param::Text(t) => q.bind(*t),
        };
    }
    q
}

/// The purged leases' usage on the days that start in `period`, one row
/// per user, account, job, node and harvested flag, with lease id 0.
async fn daily_usage(
    pool: &AnyPool,
    period: Period,
    filters: &Filters,
) -> Result<Vec<LeaseUsage>, DbError> {
    let sums = COUNTERS
        .iter()
        .map(|c| format!("CAST(SUM(d.{c}) AS BIGINT) AS d_{c}"))
        .collect::<Vec<_>>()
        .join(", ");
    let mut sql = format!(
        "SELECT d.user_name, d.account, d.job_id, d.node, d.harvested, {sums} FROM usage_daily d \
         WHERE d.day_ms >= $1 AND d.day_ms < $2"
    );
    let mut params = vec![Param::Int(i(period.start_ms)), Param::Int(i(period.end_ms))];
    filtered(&mut sql, &mut params, "d", filters);
    sql.push_str(
        " GROUP BY d.user_name, d.account, d.job_id, d.node, d.harvested \
         ORDER BY d.user_name, d.account, d.job_id, d.node, d.harvested",
    );
    let mut out = Vec::new();
    for row in bound(&sql, &params).fetch_all(pool).await? {
        let usage = totals(&row, "d_")?.unwrap_or_default();
        if usage == UsageFigures::default() {
            continue;
        }
        let job = db::u64_col(&row, "job_id")?;
        out.push(LeaseUsage {
            lease: 0,
            user: db::text_col(&row, "user_name")?,
            account: db::text_col(&row, "account")?,
            job: (job != 0).then_some(job),
            node: db::text_col(&row, "node")?,
            harvested: row.try_get::<i64, _>("harvested")? != 0,
            usage,
        });
    }
    Ok(out)
}

/// The sentence refusing a filter that names a user, account or job no
/// lease ever had (most likely a typo, which would otherwise give an empty
/// report); `None` when every name is known.
pub async fn unknown_name(pool: &AnyPool, filters: &Filters) -> Result<Option<String>, DbError> {
    for user in &filters.users {
        if !exists(pool, "user_name", Param::Text(user)).await? {
            return Ok(Some(format!(
                "no lease was ever held by user {user:?}; check the name (-u)"
            )));
        }
    }
    for account in &filters.accounts {
        if !exists(pool, "account", Param::Text(account)).await? {
            return Ok(Some(format!(
                "no lease was ever charged to account {account:?}; check the name (-A)"
            )));
        }
    }
    for &job in &filters.jobs {
        if !exists(pool, "job_id", Param::Int(i(job))).await? {
            return Ok(Some(format!(
                "no lease was ever taken for job {job}; check the id (-j)"
            )));
        }
    }
    Ok(None)
}

/// Whether a lease, or a purged lease's daily totals, has `value` in
/// `column`.
async fn exists(pool: &AnyPool, column: &str, value: Param<'_>) -> Result<bool, DbError> {
    for table in ["leases", "usage_daily"] {
        let sql = format!("SELECT {column} FROM {table} WHERE {column} = $1 LIMIT 1");
        let q = bound(&sql, std::slice::from_ref(&value));
        if q.fetch_optional(pool).await?.is_some() {
            return Ok(true);
        }
    }
    Ok(false)
}

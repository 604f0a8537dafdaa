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

const COUNTERS: [&str; 7] = [
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
fn totals(row: &AnyRow, prefix: &str) -> Result<Option<UsageFigures>, DbError> {
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
    any_of(
        &mut sql,
        &mut params,
        "l.user_name",
        filters.users.iter().map(|u| Param::Text(u)).collect(),
    );
    any_of(
        &mut sql,
        &mut params,
        "l.account",
        filters.accounts.iter().map(|a| Param::Text(a)).collect(),
    );
    any_of(
        &mut sql,
        &mut params,
        "l.job_id",
        filters.jobs.iter().map(|&j| Param::Int(i(j))).collect(),
    );
    sql.push_str(" ORDER BY l.id");
    let mut q = sqlx::query(&sql);
    for p in &params {
        q = match p {
            Param::Int(v) => q.bind(*v),
            Param::Text(t) => q.bind(*t),
        };
    }
    let mut out = Vec::new();
    for row in q.fetch_all(pool).await? {
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

async fn exists(pool: &AnyPool, column: &str, value: Param<'_>) -> Result<bool, DbError> {
    let sql = format!("SELECT id FROM leases WHERE {column} = $1 LIMIT 1");
    let q = sqlx::query(&sql);
    let q = match value {
        Param::Int(v) => q.bind(v),
        Param::Text(t) => q.bind(t),
    };
    Ok(q.fetch_optional(pool).await?.is_some())
}

//! What reports read from the database the manager and the accounting
//! services share: one SQL text for PostgreSQL and SQLite, as in the
//! manager's store.

use std::time::Duration;

use rfaas_proto::accounting::{SlotTotals, UsageFigures, SLOT_WORDS};
use rfaas_service::db::{self, i, redact};
use sqlx::any::AnyRow;
use sqlx::{AnyConnection, AnyPool, Connection, Row};

use super::{BillingError, Filters, LeaseUsage, Period};

/// Opens the database at `url`, whose schema must be the manager's
/// current one (reports never migrate). A SQLite file must exist: a report on a new empty
/// file would only mislead.
pub async fn connect(url: &str) -> Result<AnyPool, BillingError> {
    let unreachable = |why: String| BillingError::Unreachable {
        url: redact(url),
        why,
    };
    if !(url.starts_with("sqlite:") || url.starts_with("postgres")) {
        return Err(unreachable(
            "it is neither sqlite:///path nor postgres://...".into(),
        ));
    }
    if let Some(file) = db::sqlite_file(url) {
        if !file.exists() {
            return Err(unreachable(format!(
                "the file {} does not exist",
                file.display()
            )));
        }
    }
    // One plain connection first: the pool would retry until its timeout
    // and report only that, not why (refused, bad password, no database).
    sqlx::any::install_default_drivers();
    match tokio::time::timeout(CONNECT_TIMEOUT, AnyConnection::connect(url)).await {
        Err(_) => {
            return Err(unreachable(format!(
                "no answer within {} s",
                CONNECT_TIMEOUT.as_secs()
            )))
        }
        Ok(Err(e)) => return Err(unreachable(e.to_string())),
        Ok(Ok(conn)) => {
            let _ = conn.close().await;
        }
    }
    db::open(url, 2)
        .await
        .map_err(|e| unreachable(e.to_string()))
}

/// How long a connection may take to open.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

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
fn totals(row: &AnyRow, prefix: &str) -> Result<Option<UsageFigures>, BillingError> {
    // The slot's words less `closed`, which stays 0.
    let mut w = [0u64; SLOT_WORDS];
    for (word, name) in w.iter_mut().zip(COUNTERS) {
        let col = format!("{prefix}{name}");
        let Some(v) = row.try_get::<Option<i64>, _>(col.as_str())? else {
            return Ok(None);
        };
        *word = u64::try_from(v)
            .map_err(|_| BillingError::Database(format!("column {name} holds {v}")))?;
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
) -> Result<Vec<LeaseUsage>, BillingError> {
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
                    u64::try_from(j)
                        .map_err(|_| BillingError::Database(format!("column job_id holds {j}")))
                })
                .transpose()?,
            node: db::text_col(&row, "node")?,
            harvested: row.try_get::<i64, _>("harvested")? != 0,
            usage,
        });
    }
    Ok(out)
}

/// Refuses a filter naming a user, account or job that no lease ever had:
/// most likely a typo, which would otherwise print an empty report.
pub async fn check_known(pool: &AnyPool, filters: &Filters) -> Result<(), BillingError> {
    for user in &filters.users {
        if !exists(pool, "user_name", Param::Text(user)).await? {
            return Err(BillingError::Unknown(format!(
                "no lease was ever held by user {user:?}; check the name (-u)"
            )));
        }
    }
    for account in &filters.accounts {
        if !exists(pool, "account", Param::Text(account)).await? {
            return Err(BillingError::Unknown(format!(
                "no lease was ever charged to account {account:?}; check the name (-A)"
            )));
        }
    }
    for &job in &filters.jobs {
        if !exists(pool, "job_id", Param::Int(i(job))).await? {
            return Err(BillingError::Unknown(format!(
                "no lease was ever taken for job {job}; check the id (-j)"
            )));
        }
    }
    Ok(())
}

async fn exists(pool: &AnyPool, column: &str, value: Param<'_>) -> Result<bool, BillingError> {
    let sql = format!("SELECT id FROM leases WHERE {column} = $1 LIMIT 1");
    let q = sqlx::query(&sql);
    let q = match value {
        Param::Int(v) => q.bind(v),
        Param::Text(t) => q.bind(t),
    };
    Ok(q.fetch_optional(pool).await?.is_some())
}

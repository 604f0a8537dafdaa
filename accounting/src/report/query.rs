//! What reports read from the database the manager and the accounting
//! services share: one SQL text for PostgreSQL and SQLite, as in the
//! manager's store.

use std::time::Duration;

use rfaas_service::db::{self, redact};
use rfaas_service::usage;
use sqlx::{AnyConnection, AnyPool, Connection};

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

/// The usage in `period` of every lease `filters` let through whose
/// usage there is not zero, by lease id ([`usage::lease_usage`]).
pub async fn lease_usage(
    pool: &AnyPool,
    period: Period,
    filters: &Filters,
    now_ms: u64,
) -> Result<Vec<LeaseUsage>, BillingError> {
    Ok(usage::lease_usage(pool, period, filters, now_ms).await?)
}

/// Refuses a filter naming a user, account or job that no lease ever had
/// ([`usage::unknown_name`]).
pub async fn check_known(pool: &AnyPool, filters: &Filters) -> Result<(), BillingError> {
    match usage::unknown_name(pool, filters).await? {
        Some(why) => Err(BillingError::Unknown(why)),
        None => Ok(()),
    }
}

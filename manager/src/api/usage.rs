//! Usage per lease over a period, which `rfaas-billing` prices: the admin
//! sees every lease; a user sees the leases they held and those charged
//! to an account they belong to, as Slurm's `PrivateData=usage` would.
//! A user belongs to the account of the credential they call with and to
//! every account any lease of theirs was charged to: what the manager
//! knows of accounts (it keeps no account membership of its own).
//!
//! With `[slurm] coordinators = true`, a coordinator of an account in
//! Slurm's accounting database also sees every lease charged to it or to
//! an account below it, whoever held it ([`crate::slurm::Slurm::coordinated`],
//! asked with `sacctmgr`). When sacctmgr cannot answer, the request is
//! answered without coordinator rights and a warning is logged: what is
//! left out is only what coordinator rights would have added, so nothing
//! is shown that Slurm did not confirm, and members keep their reports.

use std::collections::BTreeSet;

use axum::extract::{Query, State};
use axum::Json;
use rfaas_proto::manager::{LeaseUsage, UsageQuery};
use rfaas_service::usage::{self, Filters, Period};

use super::{ApiResult, AppState};
use crate::auth::Caller;
use crate::error::{ApiError, Kind, RefusalTable};
use crate::now_ms;
use crate::App;

/// What each operation here refuses, for the OpenAPI document.
pub(super) const REFUSALS: RefusalTable = &[(
    "list_usage",
    &[
        Kind::Malformed,
        Kind::Forbidden,
        Kind::NotFound,
        Kind::DatabaseUnavailable,
    ],
)];

/// A comma list, its empty items dropped.
fn list(text: Option<&str>) -> Vec<String> {
    text.unwrap_or_default()
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .collect()
}

/// The accounts `user` coordinates, when the site asks Slurm; none (and a
/// warning) when sacctmgr cannot answer.
async fn coordinated(app: &App, user: &str) -> Vec<String> {
    if !app.slurm.coordinators() {
        return Vec::new();
    }
    match app.slurm.coordinated(user).await {
        Ok(accounts) => accounts,
        Err(e) => {
            tracing::warn!(
                user,
                error = %e,
                "usage answered without coordinator rights: the accounts this user coordinates are unknown; check that slurmdbd runs and [slurm] sacctmgr and conf in manager.toml"
            );
            Vec::new()
        }
    }
}

/// The query's filters, or why they are not.
fn filters(q: &UsageQuery) -> ApiResult<Filters> {
    let jobs = list(q.jobs.as_deref())
        .iter()
        .map(|j| {
            j.parse::<u64>().map_err(|_| {
                ApiError::Malformed(format!("jobs: {j:?} is not a job id; give numbers"))
            })
        })
        .collect::<ApiResult<Vec<u64>>>()?;
    Ok(Filters {
        users: list(q.users.as_deref()),
        accounts: list(q.accounts.as_deref()),
        jobs,
    })
}

/// The usage of each lease in `[start_ms, end_ms)` (to now without
/// `end_ms`) that the filters let
/// through and the caller may see: every lease for the admin; for a user,
/// their own leases and those charged to the accounts they belong to
/// (their credential's, and any a lease of theirs was charged to) and,
/// with `[slurm] coordinators = true`, those charged to the accounts
/// Slurm says they coordinate (sub-accounts included); others are left
/// out, not refused. For the admin a filter naming a user,
/// account or job no lease ever had is `404`.
#[utoipa::path(get, path = "/v1/usage", params(UsageQuery),
    responses((status = 200, body = Vec<LeaseUsage>)))]
pub(super) async fn list_usage(
    State(app): AppState,
    Query(q): Query<UsageQuery>,
    caller: Caller,
) -> ApiResult<Json<Vec<LeaseUsage>>> {
    let now_ms = now_ms();
    let end_ms = q.end_ms.unwrap_or(now_ms);
    if q.start_ms >= end_ms {
        return Err(ApiError::Malformed(format!(
            "the period is empty: start_ms {} is not before its end {end_ms}",
            q.start_ms
        )));
    }
    let filters = filters(&q)?;
    let pool = app.store.pool();
    // Who may see which leases: `None` for all.
    let scope = match &caller {
        Caller::Admin => {
            if let Some(why) = usage::unknown_name(pool, &filters).await? {
                return Err(ApiError::NotFound(why));
            }
            None
        }
        Caller::User { user, account, .. } => {
            let mut accounts: BTreeSet<String> =
                app.store.accounts_of(user).await?.into_iter().collect();
            accounts.insert(account.clone());
            accounts.extend(coordinated(&app, user).await);
            Some((user.clone(), accounts))
        }
        Caller::Node { .. } => {
            return Err(ApiError::Forbidden(
                "usage is read with a user credential or the admin token, not a node's".into(),
            ))
        }
    };
    let period = Period {
        start_ms: q.start_ms,
        end_ms,
    };
    let leases = usage::lease_usage(pool, period, &filters, now_ms).await?;
    Ok(Json(
        leases
            .into_iter()
            .filter(|l| match &scope {
                None => true,
                Some((user, accounts)) => l.user == *user || accounts.contains(&l.account),
            })
            .collect(),
    ))
}

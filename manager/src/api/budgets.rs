//! Budgets (the admin): what each account may spend, and has spent.

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::Json;
use rfaas_proto::manager::{BudgetView, SetBudget};

use super::check::check_name;
use super::extract::{Admin, Sent};
use super::{ApiResult, AppState};
use crate::db::retrying;
use crate::error::{ApiError, Kind, RefusalTable};
use crate::now_ms;

/// Largest budget: far above any real one, and exact to a cent in a
/// double.
const MAX_BUDGET: f64 = 1e15;

/// What each operation here refuses, for the OpenAPI document.
pub(super) const REFUSALS: RefusalTable = &[
    (
        "list_budgets",
        &[Kind::Forbidden, Kind::DatabaseUnavailable],
    ),
    (
        "set_budget",
        &[Kind::Malformed, Kind::Forbidden, Kind::DatabaseUnavailable],
    ),
    (
        "clear_budget",
        &[
            Kind::Malformed,
            Kind::Forbidden,
            Kind::NotFound,
            Kind::DatabaseUnavailable,
        ],
    ),
];

/// Budgets and what each account has spent (admin).
#[utoipa::path(get, path = "/v1/budgets",
    responses((status = 200, body = Vec<BudgetView>)))]
pub(super) async fn list_budgets(
    State(app): AppState,
    _: Admin,
) -> ApiResult<Json<Vec<BudgetView>>> {
    Ok(Json(app.store.budgets().await?))
}

/// Set an account's budget (admin). Once its spend reaches the budget, the
/// account's new leases are refused `403 budget_exhausted`; leases it holds
/// run on, and renew.
#[utoipa::path(put, path = "/v1/budgets/{account}", request_body = SetBudget,
    params(("account" = String, Path, description = "The account", pattern = r"^[A-Za-z0-9._@-]{1,253}$")),
    responses((status = 200, body = BudgetView)))]
pub(super) async fn set_budget(
    State(app): AppState,
    Path(account): Path<String>,
    Sent(Admin, body): Sent<Admin, SetBudget>,
) -> ApiResult<Json<BudgetView>> {
    check_name("account", &account)?;
    if !(body.budget.is_finite() && (0.0..=MAX_BUDGET).contains(&body.budget)) {
        return Err(ApiError::Malformed(format!(
            "budget is {}; give a number from 0 to {MAX_BUDGET:e}",
            body.budget
        )));
    }
    let view = retrying(|| app.store.set_budget(&account, body.budget, now_ms())).await?;
    tracing::info!(%account, budget = body.budget, "budget set by an admin");
    Ok(Json(view))
}

/// Remove an account's budget (admin): its leases are no longer refused
/// for spend.
#[utoipa::path(delete, path = "/v1/budgets/{account}",
    params(("account" = String, Path, description = "The account", pattern = r"^[A-Za-z0-9._@-]{1,253}$")),
    responses((status = 204, description = "Removed")))]
pub(super) async fn clear_budget(
    State(app): AppState,
    Path(account): Path<String>,
    _: Admin,
) -> ApiResult<StatusCode> {
    check_name("account", &account)?;
    if !app.store.clear_budget(&account).await? {
        return Err(ApiError::NotFound(format!(
            "account {account:?} has no budget"
        )));
    }
    tracing::info!(%account, "budget removed by an admin");
    Ok(StatusCode::NO_CONTENT)
}

//! The REST API under `/v1`, its OpenAPI document, `/healthz` and
//! `/metrics`: the router here, the handlers one file per resource.
//!
//! A handler's signature says who may call it ([`extract`]: `Admin`,
//! `User`, `Node`, ...); it checks its input, then makes one database
//! transaction. Every refusal is an [`ApiError`]; axum's own rejections
//! become the same JSON through [`json_errors`]. The document's error
//! responses come from each resource's `REFUSALS` ([`Refusals`]).
//!
//! - [`nodes`]: registration, heartbeats, listings, drain and resume.
//! - [`leases`]: grants, renewals, releases, listings.
//! - [`credentials`]: node and user credentials.
//! - [`jobs`]: Slurm jobs' credentials and ends.
//! - [`budgets`]: accounts' budgets.
//! - [`usage`]: usage per lease over a period, for reports.
//! - [`check`]: checks of fields several resources share.
//! - [`page`]: listings in pages: `limit`, the `after` cursor and the
//!   `Link: <...>; rel="next"` header.

mod budgets;
mod check;
mod credentials;
pub mod extract;
mod jobs;
mod leases;
mod nodes;
mod page;
mod usage;

use std::sync::Arc;
use std::time::Instant;

use axum::extract::{DefaultBodyLimit, MatchedPath, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post, put};
use axum::{Json, Router};
use rfaas_proto::accounting::{BillingSlot, UsageFigures};
use rfaas_proto::manager::{
    ApiError as ErrorBody, BudgetView, Credential, CredentialRequest, Heartbeat, HeartbeatReply,
    JobCredentialRequest, JobEnded, LeaseGrant, LeaseRequest, LeaseState, LeaseUsage, LeaseView,
    NodeLease, NodeProvider, NodeState, NodeView, PartitionName, RegisterNode, Registered,
    RenewRequest, Role, SetBudget,
};
use utoipa::OpenApi;

use crate::error::{json_errors, ApiError, Kind, RefusalTable, Refusals};
use crate::metrics;
use crate::{now_ms, App};

/// Largest request body, bytes. A heartbeat of a node with thousands of
/// allocations fits.
pub const MAX_BODY: usize = 256 * 1024;

type AppState = State<Arc<App>>;
type ApiResult<T> = Result<T, ApiError>;

/// What the operations here refuse, for the OpenAPI document.
const REFUSALS: RefusalTable = &[("healthz", &[Kind::DatabaseUnavailable])];

/// The OpenAPI document, generated from the handlers, the bodies of
/// `rfaas_proto::manager`, and each operation's refusals.
#[derive(Debug, OpenApi)]
#[openapi(
    info(
        title = "rfaas-manager",
        description = "The rfaas resource manager: nodes register and heartbeat, jobs lease cores. Every error is an ApiError. Authenticate with `Authorization: Bearer <token>`: the admin token, or a node or user credential."
    ),
    paths(
        nodes::register_node, nodes::heartbeat, nodes::list_nodes, nodes::show_node,
        nodes::drain_node, nodes::resume_node,
        leases::request_lease, leases::list_leases, leases::show_lease, leases::renew_lease,
        leases::release_lease,
        credentials::create_credential, credentials::list_credentials,
        credentials::revoke_credential,
        jobs::job_credential, jobs::end_job,
        budgets::list_budgets, budgets::set_budget, budgets::clear_budget,
        usage::list_usage, healthz
    ),
    components(schemas(
        ErrorBody, RegisterNode, Registered, Heartbeat, HeartbeatReply, NodeView, NodeState,
        NodeProvider, LeaseRequest, LeaseGrant, NodeLease, BillingSlot, RenewRequest, LeaseView,
        LeaseState, CredentialRequest, Credential, Role, SetBudget, BudgetView,
        JobCredentialRequest, JobEnded, LeaseUsage, UsageFigures, PartitionName
    )),
    modifiers(&BearerAuth, &ALL_REFUSALS),
    security(("bearer" = []))
)]
pub struct ApiDoc;

/// Every operation's refusals.
const ALL_REFUSALS: Refusals = Refusals(&[
    nodes::REFUSALS,
    leases::REFUSALS,
    credentials::REFUSALS,
    jobs::REFUSALS,
    budgets::REFUSALS,
    usage::REFUSALS,
    REFUSALS,
]);

struct BearerAuth;

impl utoipa::Modify for BearerAuth {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
    }
}

/// The router, with the request metrics and JSON errors around it.
pub fn router(app: Arc<App>) -> Router {
    Router::new()
        .route("/v1/nodes", get(nodes::list_nodes))
        .route(
            "/v1/nodes/:name",
            put(nodes::register_node).get(nodes::show_node),
        )
        .route("/v1/nodes/:name/heartbeat", post(nodes::heartbeat))
        .route("/v1/nodes/:name/drain", post(nodes::drain_node))
        .route("/v1/nodes/:name/resume", post(nodes::resume_node))
        .route(
            "/v1/leases",
            post(leases::request_lease).get(leases::list_leases),
        )
        .route(
            "/v1/leases/:id",
            get(leases::show_lease).delete(leases::release_lease),
        )
        .route("/v1/leases/:id/renew", post(leases::renew_lease))
        .route(
            "/v1/credentials",
            post(credentials::create_credential).get(credentials::list_credentials),
        )
        .route(
            "/v1/credentials/:id",
            delete(credentials::revoke_credential),
        )
        .route("/v1/jobs/:job_id/credential", post(jobs::job_credential))
        .route("/v1/jobs/:job_id/end", post(jobs::end_job))
        .route("/v1/budgets", get(budgets::list_budgets))
        .route("/v1/usage", get(usage::list_usage))
        .route(
            "/v1/budgets/:account",
            put(budgets::set_budget).delete(budgets::clear_budget),
        )
        .route("/v1/openapi.json", get(openapi))
        .route("/healthz", get(healthz))
        .route("/metrics", get(metrics))
        .fallback(|| async { StatusCode::NOT_FOUND })
        .layer(middleware::map_response(json_errors))
        .layer(middleware::from_fn_with_state(app.clone(), track))
        .layer(DefaultBodyLimit::max(MAX_BODY))
        .with_state(app)
}

/// Records each request's latency under a bounded set of labels: a
/// caller, authenticated or not, chooses the method and path, and each
/// new label value would be a new series kept until the replica stops.
async fn track(State(app): AppState, req: Request, next: Next) -> Response {
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map(|p| p.as_str().to_owned());
    let method = metrics::method_label(req.method());
    let start = Instant::now();
    let resp = next.run(req).await;
    app.metrics.observe(
        route.as_deref().unwrap_or(metrics::OTHER),
        method,
        resp.status().as_u16(),
        start.elapsed(),
    );
    resp
}

/// Health: `200` while this replica reaches its database, `503`
/// otherwise. Unauthenticated, so answered from the background refresh's
/// last round (every `refresh_ms`), never by a query of its own.
#[utoipa::path(get, path = "/healthz", security(()),
    responses((status = 200, description = "Serving")))]
async fn healthz(State(app): AppState) -> ApiResult<Json<serde_json::Value>> {
    if !app.reaches_database() {
        return Err(ApiError::DatabaseUnavailable);
    }
    Ok(Json(
        serde_json::json!({"status": "ok", "backend": app.store.backend().name()}),
    ))
}

async fn metrics(State(app): AppState) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        app.metrics.render(
            &app.view,
            now_ms(),
            app.settings.accounting.lost_after_ms,
            app.intervals(),
        ),
    )
}

async fn openapi() -> impl IntoResponse {
    Json(ApiDoc::openapi())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every operation of the document, by its `operationId`, with its
    /// responses.
    fn operations() -> Vec<(String, Vec<String>)> {
        let doc = serde_json::to_value(ApiDoc::openapi()).expect("the document serialises");
        let mut out = Vec::new();
        for item in doc["paths"].as_object().expect("paths").values() {
            for op in item.as_object().expect("a path item").values() {
                let id = op["operationId"].as_str().expect("an operationId");
                let statuses = op["responses"].as_object().expect("responses");
                out.push((id.to_owned(), statuses.keys().cloned().collect()));
            }
        }
        out
    }

    #[test]
    fn every_operation_documents_the_refusals_its_table_names() {
        let ops = operations();
        assert_eq!(ops.len(), 21, "{ops:?}");
        let tables = ALL_REFUSALS.0.iter().flat_map(|t| t.iter());
        for (id, kinds) in tables.clone() {
            let (_, statuses) = ops
                .iter()
                .find(|(op, _)| op == id)
                .unwrap_or_else(|| panic!("{id} refuses, but no operation has that id"));
            for k in *kinds {
                let status = k.wire().0.to_string();
                assert!(statuses.contains(&status), "{id}: no {status} for {k:?}");
            }
        }
        for (id, statuses) in &ops {
            assert!(
                tables.clone().any(|(op, _)| op == id),
                "{id} has no refusals table entry, so its errors are undocumented"
            );
            assert!(statuses.iter().any(|s| s == "4XX"), "{id}: {statuses:?}");
            if id != "healthz" {
                assert!(statuses.iter().any(|s| s == "401"), "{id}: {statuses:?}");
            }
        }
    }
}

//! The REST API under `/v1`, its OpenAPI document, `/healthz` and
//! `/metrics`.
//!
//! Every handler authenticates first ([`crate::auth`]), checks its input,
//! then makes one database transaction. Errors are [`ApiFailure`]s; axum's
//! own rejections become the same JSON through [`json_errors`].

use std::sync::Arc;
use std::time::Instant;

use axum::extract::{DefaultBodyLimit, MatchedPath, Path, Query, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post, put};
use axum::{Json, Router};
use rfaas_proto::accounting::BillingSlot;
use rfaas_proto::lease::LeaseClaims;
use rfaas_proto::manager::{
    ApiError, BudgetView, Credential, CredentialRequest, Heartbeat, HeartbeatReply,
    JobCredentialRequest, JobEnded, LeaseGrant, LeaseRequest, LeaseState, LeaseView, NodeLease,
    NodeProvider, NodeState, NodeView, RegisterNode, Registered, RenewRequest, Role, SetBudget,
    REQUEST_EXCEEDS_CLUSTER,
};
use rfaas_proto::text::count;
use serde::Deserialize;
use utoipa::OpenApi;

use crate::auth::{new_credential, new_job_credential, Caller};
use crate::db::retrying;
use crate::error::{json_errors, ApiFailure};
use crate::store::{GrantOutcome, GrantPlan, LeaseRow};
use crate::{now_ms, now_s, App};

/// Largest request body, bytes. A heartbeat of a node with thousands of
/// allocations fits.
pub const MAX_BODY: usize = 256 * 1024;

/// Longest node, user or account name.
const MAX_NAME: usize = 253;

/// Largest budget: far above any real one, and exact to a cent in a
/// double.
const MAX_BUDGET: f64 = 1e15;

/// The longest `Retry-After` of a `503 no_capacity`, seconds: the soonest
/// expiry is only the latest moment a core frees up (a release frees one
/// at any time), so clients are not told to wait longer than their own
/// backoff's cap (the client library's default, 10 s) would have them.
const MAX_RETRY_AFTER_S: u64 = 10;

type AppState = State<Arc<App>>;
type ApiResult<T> = Result<T, ApiFailure>;

/// The OpenAPI document, generated from the handlers and the bodies of
/// `rfaas_proto::manager`.
#[derive(Debug, OpenApi)]
#[openapi(
    info(
        title = "rfaas-manager",
        description = "The rfaas resource manager: nodes register and heartbeat, jobs lease cores. Every error is an ApiError. Authenticate with `Authorization: Bearer <token>`: the admin token, or a node or user credential."
    ),
    paths(
        register_node, heartbeat, list_nodes, show_node, drain_node, resume_node,
        request_lease, list_leases, show_lease, renew_lease, release_lease,
        create_credential, list_credentials, revoke_credential,
        job_credential, end_job, list_budgets, set_budget, clear_budget, healthz
    ),
    components(schemas(
        ApiError, RegisterNode, Registered, Heartbeat, HeartbeatReply, NodeView, NodeState,
        NodeProvider, LeaseRequest, LeaseGrant, NodeLease, BillingSlot, RenewRequest, LeaseView,
        LeaseState, CredentialRequest, Credential, Role, SetBudget, BudgetView,
        JobCredentialRequest, JobEnded
    )),
    modifiers(&BearerAuth),
    security(("bearer" = []))
)]
pub struct ApiDoc;

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
        .route("/v1/nodes", get(list_nodes))
        .route("/v1/nodes/:name", put(register_node).get(show_node))
        .route("/v1/nodes/:name/heartbeat", post(heartbeat))
        .route("/v1/nodes/:name/drain", post(drain_node))
        .route("/v1/nodes/:name/resume", post(resume_node))
        .route("/v1/leases", post(request_lease).get(list_leases))
        .route("/v1/leases/:id", get(show_lease).delete(release_lease))
        .route("/v1/leases/:id/renew", post(renew_lease))
        .route(
            "/v1/credentials",
            post(create_credential).get(list_credentials),
        )
        .route("/v1/credentials/:id", delete(revoke_credential))
        .route("/v1/jobs/:job_id/credential", post(job_credential))
        .route("/v1/jobs/:job_id/end", post(end_job))
        .route("/v1/budgets", get(list_budgets))
        .route("/v1/budgets/:account", put(set_budget).delete(clear_budget))
        .route("/v1/openapi.json", get(openapi))
        .route("/healthz", get(healthz))
        .route("/metrics", get(metrics))
        .fallback(|| async { StatusCode::NOT_FOUND })
        .layer(middleware::map_response(json_errors))
        .layer(middleware::from_fn_with_state(app.clone(), track))
        .layer(DefaultBodyLimit::max(MAX_BODY))
        .with_state(app)
}

async fn track(State(app): AppState, req: Request, next: Next) -> Response {
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map(|p| p.as_str().to_owned())
        .unwrap_or_else(|| "unmatched".into());
    let method = req.method().as_str().to_owned();
    let start = Instant::now();
    let resp = next.run(req).await;
    app.metrics
        .observe(&route, &method, resp.status().as_u16(), start.elapsed());
    resp
}

async fn caller(app: &App, headers: &HeaderMap) -> ApiResult<Caller> {
    let auth = headers
        .get(header::AUTHORIZATION)
        .map(|v| v.to_str().unwrap_or(""));
    app.auth.caller(&app.store, auth, now_s()).await
}

fn check_name(what: &str, name: &str) -> ApiResult<()> {
    let ok = !name.is_empty()
        && name.len() <= MAX_NAME
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-@".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(ApiFailure::malformed(format!(
            "the {what} {name:?} must be 1 to {MAX_NAME} letters, digits, '.', '_', '-' or '@'"
        )))
    }
}

/// Refuses a node name that does not follow the one pattern
/// ([`rfaas_proto::node_name`]), naming it.
fn check_node_name(name: &str) -> ApiResult<()> {
    rfaas_proto::node_name::check(name).map_err(|e| ApiFailure::malformed(e.to_string()))
}

/// Refuses control characters (NUL above all: PostgreSQL cannot store it
/// in text) in a free-text field.
fn check_text(what: &str, text: &str) -> ApiResult<()> {
    if text.chars().any(char::is_control) {
        return Err(ApiFailure::malformed(format!(
            "{what} {text:?} holds control characters; send printable text"
        )));
    }
    Ok(())
}

fn admin_only(c: &Caller) -> ApiResult<()> {
    match c {
        Caller::Admin => Ok(()),
        _ => Err(ApiFailure::forbidden(
            "this needs the admin token (rfaasctl reads it from its file)",
        )),
    }
}

fn node_or_admin(c: &Caller, name: &str) -> ApiResult<()> {
    match c {
        Caller::Admin => Ok(()),
        Caller::Node(n) if n == name => Ok(()),
        Caller::Node(n) => Err(ApiFailure::forbidden(format!(
            "this credential is node {n:?}'s; it cannot speak for node {name:?}"
        ))),
        Caller::User { .. } => Err(ApiFailure::forbidden(
            "registering and heartbeating need a node credential",
        )),
    }
}

fn check_memory(memory_mib: u64) -> ApiResult<()> {
    if memory_mib == 0 || memory_mib > u64::from(u32::MAX) {
        return Err(ApiFailure::malformed(format!(
            "memory_mib is {memory_mib}; it must be 1 to {}",
            u32::MAX
        )));
    }
    Ok(())
}

fn check_register(r: &RegisterNode) -> ApiResult<()> {
    if r.cores == 0 || r.cores > u32::from(u16::MAX) {
        return Err(ApiFailure::malformed(format!(
            "cores is {}; a node lends 1 to 65535 cores",
            r.cores
        )));
    }
    check_memory(r.memory_mib)?;
    let addr_ok = r
        .control_addr
        .rsplit_once(':')
        .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok_and(|p| p > 0));
    check_text("control_addr", &r.control_addr)?;
    if !addr_ok || r.control_addr.len() > 300 {
        return Err(ApiFailure::malformed(format!(
            "control_addr {:?} is not host:port",
            r.control_addr
        )));
    }
    if r.providers.is_empty() || r.providers.len() > 16 {
        return Err(ApiFailure::malformed(
            "providers must list 1 to 16 providers",
        ));
    }
    for p in &r.providers {
        check_text("provider name", &p.name)?;
        let known = p.name == "tcp" || p.name == "shm" || p.name.starts_with("verbs:");
        if !known || p.name.len() > 64 || p.host.as_ref().is_some_and(|h| h.len() > 255) {
            return Err(ApiFailure::malformed(format!(
                "provider {:?} is not tcp, shm or verbs:<device>",
                p.name
            )));
        }
        if let Some(h) = &p.host {
            check_text("provider host", h)?;
        }
    }
    check_text("version", &r.version)?;
    if r.version.len() > 64 {
        return Err(ApiFailure::malformed(
            "version is longer than 64 characters",
        ));
    }
    Ok(())
}

/// Register a node, or update its record. Idempotent. With fewer cores or
/// less memory than it has leased, the node keeps its leases and takes no
/// new one until they fit: its `draining_cores` and `draining_memory_mib`
/// say how much leaves as they end.
#[utoipa::path(put, path = "/v1/nodes/{name}", request_body = RegisterNode,
    params(("name" = String, Path, description = "The node's name (see rfaas_proto::node_name)", pattern = r"^[A-Za-z0-9][A-Za-z0-9_-]*(\.[A-Za-z0-9_-]+)*$", max_length = 253)),
    responses((status = 200, body = Registered), (status = "4XX", body = ApiError), (status = 503, body = ApiError)))]
async fn register_node(
    State(app): AppState,
    headers: HeaderMap,
    Path(name): Path<String>,
    Json(body): Json<RegisterNode>,
) -> ApiResult<Json<Registered>> {
    let c = caller(&app, &headers).await?;
    check_node_name(&name)?;
    node_or_admin(&c, &name)?;
    check_register(&body)?;
    let read = app.store.register(&name, &body, now_ms()).await?;
    let node = read.node.clone();
    app.view.upsert(read);
    tracing::info!(node = %name, cores = body.cores, addr = %body.control_addr, "node registered");
    if node.draining_cores > 0 || node.draining_memory_mib > 0 {
        tracing::warn!(
            node = %name,
            cores = body.cores,
            memory_mib = body.memory_mib,
            leased_cores = node.leased_cores,
            leased_memory_mib = node.leased_memory_mib,
            "node registered with less than it has leased: its leases run on, it takes no new one until they fit, and the difference drains as they end"
        );
    }
    Ok(Json(Registered {
        node,
        heartbeat_interval_ms: app.settings.heartbeat_interval_ms,
        lost_after_ms: app.settings.lost_after_ms,
    }))
}

/// A node's heartbeat: its free capacity and the leases it holds. The
/// answer lists those that have ended. `404`: register again.
#[utoipa::path(post, path = "/v1/nodes/{name}/heartbeat", request_body = Heartbeat,
    params(("name" = String, Path, description = "The node's name (see rfaas_proto::node_name)", pattern = r"^[A-Za-z0-9][A-Za-z0-9_-]*(\.[A-Za-z0-9_-]+)*$", max_length = 253)),
    responses((status = 200, body = HeartbeatReply), (status = 404, body = ApiError), (status = "4XX", body = ApiError)))]
async fn heartbeat(
    State(app): AppState,
    headers: HeaderMap,
    Path(name): Path<String>,
    Json(body): Json<Heartbeat>,
) -> ApiResult<Json<HeartbeatReply>> {
    let c = caller(&app, &headers).await?;
    check_node_name(&name)?;
    node_or_admin(&c, &name)?;
    match app.store.heartbeat(&name, &body, now_ms()).await? {
        Some((node, ended_leases)) => {
            app.view.upsert(node);
            Ok(Json(HeartbeatReply { ended_leases }))
        }
        None => Err(ApiFailure::not_found(format!(
            "node {name:?} is not registered here; register it (PUT /v1/nodes/{name})"
        ))),
    }
}

/// Query of `GET /v1/nodes`.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
struct NodesQuery {
    /// Read the database, not this replica's view.
    #[serde(default)]
    fresh: bool,
}

/// Every node, as this replica sees it (at most `refresh_ms` old), or as
/// the database has it now with `fresh=true`.
#[utoipa::path(get, path = "/v1/nodes", params(NodesQuery),
    responses((status = 200, body = Vec<NodeView>), (status = "4XX", body = ApiError)))]
async fn list_nodes(
    State(app): AppState,
    headers: HeaderMap,
    Query(q): Query<NodesQuery>,
) -> ApiResult<Json<Vec<NodeView>>> {
    caller(&app, &headers).await?;
    if q.fresh {
        let read = app.store.nodes().await?;
        return Ok(Json(read.into_iter().map(|n| n.node).collect()));
    }
    Ok(Json(app.view.all()))
}

/// One node.
#[utoipa::path(get, path = "/v1/nodes/{name}",
    params(("name" = String, Path, description = "The node's name (see rfaas_proto::node_name)", pattern = r"^[A-Za-z0-9][A-Za-z0-9_-]*(\.[A-Za-z0-9_-]+)*$", max_length = 253)),
    responses((status = 200, body = NodeView), (status = "4XX", body = ApiError)))]
async fn show_node(
    State(app): AppState,
    headers: HeaderMap,
    Path(name): Path<String>,
) -> ApiResult<Json<NodeView>> {
    caller(&app, &headers).await?;
    check_node_name(&name)?;
    app.view
        .get(&name)
        .map(Json)
        .ok_or_else(|| ApiFailure::not_found(format!("no node is named {name:?}")))
}

async fn set_drained(
    app: &App,
    headers: &HeaderMap,
    name: &str,
    drained: bool,
) -> ApiResult<Json<NodeView>> {
    admin_only(&caller(app, headers).await?)?;
    check_node_name(name)?;
    let read = app
        .store
        .set_drained(name, drained)
        .await?
        .ok_or_else(|| ApiFailure::not_found(format!("no node is named {name:?}")))?;
    let node = read.node.clone();
    app.view.upsert(read);
    tracing::info!(node = %name, drained, "node state set by an admin");
    Ok(Json(node))
}

/// Drain a node (admin): it is no longer offered; its leases run to their end.
#[utoipa::path(post, path = "/v1/nodes/{name}/drain",
    params(("name" = String, Path, description = "The node's name (see rfaas_proto::node_name)", pattern = r"^[A-Za-z0-9][A-Za-z0-9_-]*(\.[A-Za-z0-9_-]+)*$", max_length = 253)),
    responses((status = 200, body = NodeView), (status = "4XX", body = ApiError)))]
async fn drain_node(
    State(app): AppState,
    headers: HeaderMap,
    Path(name): Path<String>,
) -> ApiResult<Json<NodeView>> {
    set_drained(&app, &headers, &name, true).await
}

/// Resume a drained node (admin).
#[utoipa::path(post, path = "/v1/nodes/{name}/resume",
    params(("name" = String, Path, description = "The node's name (see rfaas_proto::node_name)", pattern = r"^[A-Za-z0-9][A-Za-z0-9_-]*(\.[A-Za-z0-9_-]+)*$", max_length = 253)),
    responses((status = 200, body = NodeView), (status = "4XX", body = ApiError)))]
async fn resume_node(
    State(app): AppState,
    headers: HeaderMap,
    Path(name): Path<String>,
) -> ApiResult<Json<NodeView>> {
    set_drained(&app, &headers, &name, false).await
}

fn check_lease_request(app: &App, r: &LeaseRequest) -> ApiResult<u32> {
    if r.cores == 0 || r.cores > 1 << 20 {
        return Err(ApiFailure::malformed(format!(
            "cores is {}; ask for 1 to {}",
            r.cores,
            1 << 20
        )));
    }
    let min = r.min_cores.unwrap_or(r.cores);
    if min == 0 || min > r.cores {
        return Err(ApiFailure::malformed(format!(
            "min_cores is {min}; it must be 1 to cores ({})",
            r.cores
        )));
    }
    check_memory(r.memory_mib)?;
    if r.duration_s == 0 || r.duration_s > app.settings.max_lease_s {
        return Err(ApiFailure::malformed(format!(
            "duration_s is {}; it must be 1 to {} (max_lease_s); renew a lease to keep it longer",
            r.duration_s, app.settings.max_lease_s
        ))
        .with("max_lease_s", app.settings.max_lease_s));
    }
    if r.nodes.len() > 1024 {
        return Err(ApiFailure::malformed("nodes lists more than 1024 nodes"));
    }
    for n in &r.nodes {
        check_node_name(n)?;
    }
    Ok(min)
}

fn node_lease(app: &App, l: &LeaseRow) -> NodeLease {
    let node = app.view.get(&l.view.node);
    let claims = LeaseClaims {
        key_id: app.signer.key_id().to_owned(),
        lease_id: l.view.lease_id,
        node: l.view.node.clone(),
        user: l.view.user.clone(),
        account: l.view.account.clone(),
        job_id: l.view.job_id,
        cores: l.view.cores.min(u32::from(u16::MAX)) as u16,
        memory_mib: l.view.memory_mib.min(u64::from(u32::MAX)) as u32,
        issued_at: l.view.issued_at,
        expires_at: l.view.expires_at,
        billing: l.billing.clone(),
    };
    NodeLease {
        lease_id: l.view.lease_id,
        node: l.view.node.clone(),
        control_addr: node
            .as_ref()
            .map(|n| n.control_addr.clone())
            .unwrap_or_default(),
        providers: node.map(|n| n.providers).unwrap_or_default(),
        cores: l.view.cores,
        memory_mib: l.view.memory_mib,
        token: app.signer.sign(&claims),
        billing: claims.billing.clone(),
    }
}

fn grant_body(app: &App, grant_id: u64, leases: &[LeaseRow]) -> LeaseGrant {
    LeaseGrant {
        id: grant_id,
        expires_at: leases.iter().map(|l| l.view.expires_at).max().unwrap_or(0),
        leases: leases.iter().map(|l| node_lease(app, l)).collect(),
    }
}

/// Ask for cores (user credential). Granted all or nothing up to
/// `min_cores`, possibly across nodes, each node lease with its own token
/// and, when an accounting service is up, its own billing slot.
#[utoipa::path(post, path = "/v1/leases", request_body = LeaseRequest,
    responses((status = 201, body = LeaseGrant),
        (status = 503, description = "no_capacity: nothing fits now (or no node has registered yet); retry after Retry-After, 1 to 10 s (when the soonest lease ends, at most 10 s: a release frees cores at any time); accounting_unavailable: billing is required and no accounting instance has a free slot", body = ApiError),
        (status = 422, description = "request_exceeds_cluster: no node that ever registered could hold the request, at the capacity it registered, whatever its state now: more memory per node lease than the largest node, or more cores (min_cores) than the nodes with that memory together. Not retryable; the message and largest_node_cores, largest_node_memory_mib, cluster_cores, nodes and cores_with_memory give the largest offer", body = ApiError),
        (status = 403, description = "forbidden; quota_exceeded with cap and in_use; budget_exhausted with budget and spend", body = ApiError),
        (status = "4XX", body = ApiError)))]
async fn request_lease(
    State(app): AppState,
    headers: HeaderMap,
    Json(body): Json<LeaseRequest>,
) -> ApiResult<(StatusCode, Json<LeaseGrant>)> {
    let c = caller(&app, &headers).await?;
    let Caller::User {
        user,
        account,
        job_id,
    } = &c
    else {
        return Err(ApiFailure::forbidden(
            "leases are asked for with a user credential (rfaasctl credential user ...)",
        ));
    };
    let min_cores = check_lease_request(&app, &body)?;
    beyond_cluster(&app, &body, min_cores)?;
    let now = now_s();
    let cap = app.settings.quota.cap(account);
    let accounting = app.settings.accounting;
    let billing = app
        .view
        .billing_candidates(now_ms(), accounting.lost_after_ms);
    if accounting.required && billing.is_empty() {
        return Err(accounting_unavailable(&app));
    }
    let mut plan = GrantPlan {
        owner: c.subject(),
        user: user.clone(),
        account: account.clone(),
        cap,
        candidates: app.view.candidates(body.memory_mib, &body.nodes),
        cores: body.cores,
        min_cores,
        memory_mib: body.memory_mib,
        issued_at: now,
        expires_at: now + body.duration_s,
        job_id: *job_id,
        billing,
        billing_required: accounting.required,
    };
    let mut outcome = retrying(|| app.store.grant(&plan)).await?;
    if outcome == GrantOutcome::NoCapacity {
        // The view may be behind: look at the database once before saying no.
        app.view.replace_all(app.store.nodes().await?);
        beyond_cluster(&app, &body, min_cores)?;
        plan.candidates = app.view.candidates(body.memory_mib, &body.nodes);
        outcome = retrying(|| app.store.grant(&plan)).await?;
    }
    match outcome {
        GrantOutcome::Granted { grant_id, leases } => {
            app.view.apply_slots(&leases);
            app.metrics.grants.inc();
            let unbilled = leases.iter().filter(|l| l.billing.is_none()).count();
            app.metrics.unbilled_leases.inc_by(unbilled as u64);
            tracing::info!(grant_id, %user, %account, cores = leases.iter().map(|l| l.view.cores).sum::<u32>(), nodes = leases.len(), unbilled, "lease granted");
            Ok((
                StatusCode::CREATED,
                Json(grant_body(&app, grant_id, &leases)),
            ))
        }
        GrantOutcome::NoCapacity => {
            app.metrics
                .denials
                .with_label_values(&["no_capacity"])
                .inc();
            let wait = match app.store.soonest_expiry().await? {
                Some(at) => at.saturating_sub(now_s()).clamp(1, MAX_RETRY_AFTER_S),
                None => 5,
            };
            Err(ApiFailure::new(
                503,
                "no_capacity",
                format!(
                    "{} with {} MiB each are not free now (at least {} wanted); retry after the Retry-After seconds",
                    count(body.cores, "core"),
                    body.memory_mib,
                    count(min_cores, "core")
                ),
            )
            .retry_after(wait))
        }
        GrantOutcome::Quota { cap, in_use } => {
            app.metrics
                .denials
                .with_label_values(&["quota_exceeded"])
                .inc();
            Err(ApiFailure::new(
                403,
                "quota_exceeded",
                format!(
                    "account {account:?} may hold {cap} cores at once and holds {in_use}; release a lease or ask for at most {}",
                    u64::from(cap).saturating_sub(in_use)
                ),
            )
            .with("account", account.clone())
            .with("cap", cap)
            .with("in_use", in_use))
        }
        GrantOutcome::BudgetExhausted { budget, spend } => {
            app.metrics
                .denials
                .with_label_values(&["budget_exhausted"])
                .inc();
            Err(ApiFailure::new(
                403,
                "budget_exhausted",
                format!(
                    "account {account:?} has spent {spend} of its budget of {budget}; leases it holds run on, but new ones need a larger budget (rfaasctl budget set)"
                ),
            )
            .with("account", account.clone())
            .with("budget", budget)
            .with("spend", spend))
        }
        GrantOutcome::AccountingUnavailable => Err(accounting_unavailable(&app)),
    }
}

/// `422 request_exceeds_cluster` (counted as a denial) when no node that
/// ever registered could hold `r` even with nothing leased: more memory per
/// node lease than the largest node registered, or fewer than `min_cores`
/// cores on the nodes that registered that much memory. Read from the
/// view's sums: no query, no walk over the nodes. With no node known yet
/// the cluster may still be coming up, and nothing is refused here.
fn beyond_cluster(app: &App, r: &LeaseRequest, min_cores: u32) -> ApiResult<()> {
    let o = app.view.offer(r.memory_mib);
    let why = if o.nodes == 0 {
        return Ok(());
    } else if r.memory_mib > o.largest_node_memory_mib {
        format!(
            "each node lease asks for {} MiB, more than any node lends",
            r.memory_mib
        )
    } else if u64::from(min_cores) > o.cores_with_memory && o.cores_with_memory < o.cluster_cores {
        format!(
            "it needs at least {}, and the nodes that lend {} MiB or more lend {} together",
            count(min_cores, "core"),
            r.memory_mib,
            count(o.cores_with_memory, "core")
        )
    } else if u64::from(min_cores) > o.cores_with_memory {
        format!(
            "it needs at least {}, more than all nodes together lend",
            count(min_cores, "core")
        )
    } else {
        return Ok(());
    };
    app.metrics
        .denials
        .with_label_values(&[REQUEST_EXCEEDS_CLUSTER])
        .inc();
    let mut failure = ApiFailure::new(
        422,
        REQUEST_EXCEEDS_CLUSTER,
        format!(
            "no node here could ever hold this request, so waiting will not help: {why}. The largest node lends {} and {} MiB; the whole cluster ({}) lends {}. Ask for less (with min_cores, a grant may take fewer cores)",
            count(o.largest_node_cores, "core"),
            o.largest_node_memory_mib,
            count(o.nodes, "node"),
            count(o.cluster_cores, "core"),
        ),
    );
    failure.body.details = o.to_details();
    Err(failure)
}

/// `503 accounting_unavailable`: billing is required and no live
/// accounting instance had a free slot. Slots free up as the instances
/// flush, every second by default.
fn accounting_unavailable(app: &App) -> ApiFailure {
    app.metrics
        .denials
        .with_label_values(&["accounting_unavailable"])
        .inc();
    ApiFailure::new(
        503,
        "accounting_unavailable",
        "no accounting service has a free billing slot now, and this manager grants no lease unbilled ([accounting] required); retry after the Retry-After seconds, and tell the admin if it lasts",
    )
    .retry_after(1)
}

/// Query of `GET /v1/leases`.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
struct ListQuery {
    /// Also ended leases.
    #[serde(default)]
    all: bool,
    /// At most this many (default 1000).
    #[serde(default)]
    limit: Option<u32>,
}

/// Leases, newest first: a user's own, or every lease for the admin.
#[utoipa::path(get, path = "/v1/leases", params(ListQuery),
    responses((status = 200, body = Vec<LeaseView>), (status = "4XX", body = ApiError)))]
async fn list_leases(
    State(app): AppState,
    headers: HeaderMap,
    Query(q): Query<ListQuery>,
) -> ApiResult<Json<Vec<LeaseView>>> {
    let c = caller(&app, &headers).await?;
    let owner = match &c {
        Caller::Admin => None,
        Caller::User { .. } => Some(c.subject()),
        Caller::Node(_) => return Err(ApiFailure::forbidden("nodes do not list leases")),
    };
    let limit = q.limit.unwrap_or(1000).min(100_000);
    let rows = app.store.leases(q.all, owner.as_deref(), limit).await?;
    Ok(Json(rows.into_iter().map(|r| r.view).collect()))
}

async fn owned_grant(app: &App, c: &Caller, id: u64) -> ApiResult<Vec<LeaseRow>> {
    let rows = app.store.grant_leases(id).await?;
    if rows.is_empty() {
        return Err(ApiFailure::not_found(format!("no lease has id {id}")));
    }
    if *c != Caller::Admin && rows[0].owner != c.subject() {
        return Err(ApiFailure::forbidden(format!(
            "lease {id} belongs to someone else"
        )));
    }
    Ok(rows)
}

/// A grant's node leases (owner or admin).
#[utoipa::path(get, path = "/v1/leases/{id}",
    params(("id" = u64, Path, description = "The grant's id")),
    responses((status = 200, body = Vec<LeaseView>), (status = "4XX", body = ApiError)))]
async fn show_lease(
    State(app): AppState,
    headers: HeaderMap,
    Path(id): Path<u64>,
) -> ApiResult<Json<Vec<LeaseView>>> {
    let c = caller(&app, &headers).await?;
    let rows = owned_grant(&app, &c, id).await?;
    Ok(Json(rows.into_iter().map(|r| r.view).collect()))
}

/// Renew a grant (owner): its active node leases now end `duration_s` from
/// now (never sooner than before), with new tokens to hand the executors,
/// each with the billing slot it was granted. A spent budget does not
/// refuse a renewal: leases granted run to their end. From its
/// `expires_at` second on, a grant has ended (`409 lease_ended`), whether
/// or not the reaper has marked it yet.
#[utoipa::path(post, path = "/v1/leases/{id}/renew", request_body = RenewRequest,
    params(("id" = u64, Path, description = "The grant's id")),
    responses((status = 200, body = LeaseGrant), (status = 409, description = "The lease has ended", body = ApiError), (status = "4XX", body = ApiError)))]
async fn renew_lease(
    State(app): AppState,
    headers: HeaderMap,
    Path(id): Path<u64>,
    Json(body): Json<RenewRequest>,
) -> ApiResult<Json<LeaseGrant>> {
    let c = caller(&app, &headers).await?;
    if body.duration_s == 0 || body.duration_s > app.settings.max_lease_s {
        return Err(ApiFailure::malformed(format!(
            "duration_s is {}; it must be 1 to {} (max_lease_s)",
            body.duration_s, app.settings.max_lease_s
        )));
    }
    owned_grant(&app, &c, id).await?;
    let now = now_ms();
    let rows = app
        .store
        .renew(id, now / 1000 + body.duration_s, now)
        .await?;
    if rows.is_empty() {
        return Err(ApiFailure::new(
            409,
            "lease_ended",
            format!(
                "lease {id} has ended (released, expired, or its nodes lost) and cannot be renewed; request a new lease"
            ),
        ));
    }
    Ok(Json(grant_body(&app, id, &rows)))
}

/// Release a grant (owner or admin). Releasing an ended grant is not an
/// error.
#[utoipa::path(delete, path = "/v1/leases/{id}",
    params(("id" = u64, Path, description = "The grant's id")),
    responses((status = 204, description = "Released"), (status = "4XX", body = ApiError)))]
async fn release_lease(
    State(app): AppState,
    headers: HeaderMap,
    Path(id): Path<u64>,
) -> ApiResult<StatusCode> {
    let c = caller(&app, &headers).await?;
    let owner = match &c {
        Caller::Admin => None,
        other => Some(other.subject()),
    };
    let ended = retrying(|| {
        app.store
            .end_grant_of(id, owner.as_deref(), LeaseState::Released, now_ms())
    })
    .await?;
    if ended.is_empty() {
        // Nothing of the caller's was active: say whether the grant is
        // unknown, someone else's, or already over (not an error).
        owned_grant(&app, &c, id).await?;
    }
    if !ended.is_empty() {
        tracing::info!(grant_id = id, by = %c.subject(), "lease released");
    }
    Ok(StatusCode::NO_CONTENT)
}

/// Mint a node or user credential (admin). Its token is shown only here.
#[utoipa::path(post, path = "/v1/credentials", request_body = CredentialRequest,
    responses((status = 201, body = Credential), (status = "4XX", body = ApiError)))]
async fn create_credential(
    State(app): AppState,
    headers: HeaderMap,
    Json(body): Json<CredentialRequest>,
) -> ApiResult<(StatusCode, Json<Credential>)> {
    admin_only(&caller(&app, &headers).await?)?;
    match body.role {
        Role::Node => check_node_name(&body.subject)?,
        Role::User => check_name("subject", &body.subject)?,
    }
    let account = match body.role {
        Role::User => body.account.clone().unwrap_or_else(|| body.subject.clone()),
        Role::Node => String::new(),
    };
    if body.role == Role::User {
        check_name("account", &account)?;
    } else if body.account.is_some() {
        return Err(ApiFailure::malformed("node credentials have no account"));
    }
    let expires_at = match body.ttl_s {
        Some(0) => return Err(ApiFailure::malformed("ttl_s must be above 0")),
        Some(t) if t > 100 * 365 * 86_400 => {
            return Err(ApiFailure::malformed(
                "ttl_s is over 100 years; leave it out for no expiry",
            ))
        }
        Some(t) => now_s() + t,
        None => 0,
    };
    let (row, token) = new_credential(body.role, &body.subject, &account, expires_at)
        .map_err(|e| ApiFailure::new(500, "internal", format!("no randomness: {e}")))?;
    app.store.add_credential(&row, now_ms()).await?;
    tracing::info!(id = %row.id, role = ?row.role, subject = %row.subject, "credential minted");
    Ok((
        StatusCode::CREATED,
        Json(Credential {
            id: row.id,
            role: row.role,
            subject: row.subject,
            account: (body.role == Role::User).then_some(account),
            expires_at: (expires_at != 0).then_some(expires_at),
            token: Some(token),
            job_id: None,
        }),
    ))
}

/// Credentials not revoked (admin), without their tokens.
#[utoipa::path(get, path = "/v1/credentials",
    responses((status = 200, body = Vec<Credential>), (status = "4XX", body = ApiError)))]
async fn list_credentials(
    State(app): AppState,
    headers: HeaderMap,
) -> ApiResult<Json<Vec<Credential>>> {
    admin_only(&caller(&app, &headers).await?)?;
    let rows = app.store.credentials().await?;
    Ok(Json(
        rows.into_iter()
            .map(|r| Credential {
                id: r.id,
                role: r.role,
                subject: r.subject,
                account: (r.role == Role::User).then_some(r.account),
                expires_at: (r.expires_at != 0).then_some(r.expires_at),
                token: None,
                job_id: r.job_id,
            })
            .collect(),
    ))
}

/// Revoke a credential (admin). Every replica refuses it within seconds.
#[utoipa::path(delete, path = "/v1/credentials/{id}",
    params(("id" = String, Path, description = "The credential's id", pattern = r"^[0-9a-f]{16}$")),
    responses((status = 204, description = "Revoked"), (status = "4XX", body = ApiError)))]
async fn revoke_credential(
    State(app): AppState,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> ApiResult<StatusCode> {
    admin_only(&caller(&app, &headers).await?)?;
    // Ids are hex (auth::new_credential); anything else names none, and
    // must not reach the database (PostgreSQL refuses a NUL in text).
    let well_formed = !id.is_empty() && id.len() <= 64 && id.bytes().all(|b| b.is_ascii_hexdigit());
    if !well_formed || !app.store.revoke_credential(&id).await? {
        return Err(ApiFailure::not_found(format!(
            "no credential has id {id:?}"
        )));
    }
    app.auth.forget(&id);
    Ok(StatusCode::NO_CONTENT)
}

/// A node, or the admin, for Slurm job `job_id` (1 and up).
fn job_caller(c: &Caller, job_id: u64) -> ApiResult<()> {
    match c {
        Caller::Admin | Caller::Node(_) if job_id > 0 => Ok(()),
        Caller::Admin | Caller::Node(_) => Err(ApiFailure::malformed(
            "Slurm job ids start at 1; job 0 names no job",
        )),
        Caller::User { .. } => Err(ApiFailure::forbidden(
            "job credentials are asked for by a node's executor daemon (node credential), for a job it runs",
        )),
    }
}

/// Mint a user credential for a Slurm job (node or admin): what a job
/// started with `--rfaas` finds in its environment. It expires with the
/// job's time limit (at most `max_job_credential_s` from now), leases
/// asked for with it name the job, and the job's end revokes it.
#[utoipa::path(post, path = "/v1/jobs/{job_id}/credential",
    params(("job_id" = u64, Path, description = "The Slurm job", minimum = 1)),
    request_body = JobCredentialRequest,
    responses((status = 201, body = Credential), (status = "4XX", body = ApiError)))]
async fn job_credential(
    State(app): AppState,
    headers: HeaderMap,
    Path(job_id): Path<u64>,
    Json(body): Json<JobCredentialRequest>,
) -> ApiResult<(StatusCode, Json<Credential>)> {
    let c = caller(&app, &headers).await?;
    job_caller(&c, job_id)?;
    check_name("user", &body.user)?;
    check_name("account", &body.account)?;
    let now = now_s();
    if body.expires_at <= now {
        return Err(ApiFailure::malformed(format!(
            "expires_at {} is not in the future (now {now}): the job's time is up",
            body.expires_at
        )));
    }
    let expires_at = body
        .expires_at
        .min(now.saturating_add(app.settings.max_job_credential_s));
    let (row, token) = new_job_credential(
        Role::User,
        &body.user,
        &body.account,
        expires_at,
        Some(job_id),
    )
    .map_err(|e| ApiFailure::new(500, "internal", format!("no randomness: {e}")))?;
    app.store.add_credential(&row, now_ms()).await?;
    tracing::info!(id = %row.id, job_id, user = %row.subject, account = %row.account, expires_at, by = %c.subject(), "job credential minted");
    Ok((
        StatusCode::CREATED,
        Json(Credential {
            id: row.id,
            role: Role::User,
            subject: row.subject,
            account: Some(row.account),
            expires_at: Some(expires_at),
            token: Some(token),
            job_id: Some(job_id),
        }),
    ))
}

/// A Slurm job ended (node or admin): revoke its job credentials and
/// release its leases. Every node of the job may say so; only the first
/// changes anything.
#[utoipa::path(post, path = "/v1/jobs/{job_id}/end",
    params(("job_id" = u64, Path, description = "The Slurm job", minimum = 1)),
    responses((status = 200, body = JobEnded), (status = "4XX", body = ApiError)))]
async fn end_job(
    State(app): AppState,
    headers: HeaderMap,
    Path(job_id): Path<u64>,
) -> ApiResult<Json<JobEnded>> {
    let c = caller(&app, &headers).await?;
    job_caller(&c, job_id)?;
    let (revoked, ended) = retrying(|| app.store.end_job(job_id, now_ms())).await?;
    for id in &revoked {
        app.auth.forget(id);
    }
    if !revoked.is_empty() || !ended.is_empty() {
        tracing::info!(job_id, credentials = revoked.len(), leases = ended.len(), by = %c.subject(), "Slurm job ended");
    }
    Ok(Json(JobEnded {
        revoked: revoked.len() as u64,
        released: ended.len() as u64,
    }))
}

/// Budgets and what each account has spent (admin).
#[utoipa::path(get, path = "/v1/budgets",
    responses((status = 200, body = Vec<BudgetView>), (status = "4XX", body = ApiError), (status = 503, body = ApiError)))]
async fn list_budgets(
    State(app): AppState,
    headers: HeaderMap,
) -> ApiResult<Json<Vec<BudgetView>>> {
    admin_only(&caller(&app, &headers).await?)?;
    Ok(Json(app.store.budgets().await?))
}

/// Set an account's budget (admin). Once its spend reaches the budget, the
/// account's new leases are refused `403 budget_exhausted`; leases it holds
/// run on, and renew.
#[utoipa::path(put, path = "/v1/budgets/{account}", request_body = SetBudget,
    params(("account" = String, Path, description = "The account", pattern = r"^[A-Za-z0-9._@-]{1,253}$")),
    responses((status = 200, body = BudgetView), (status = "4XX", body = ApiError), (status = 503, body = ApiError)))]
async fn set_budget(
    State(app): AppState,
    headers: HeaderMap,
    Path(account): Path<String>,
    Json(body): Json<SetBudget>,
) -> ApiResult<Json<BudgetView>> {
    admin_only(&caller(&app, &headers).await?)?;
    check_name("account", &account)?;
    if !(body.budget.is_finite() && (0.0..=MAX_BUDGET).contains(&body.budget)) {
        return Err(ApiFailure::malformed(format!(
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
    responses((status = 204, description = "Removed"), (status = "4XX", body = ApiError), (status = 503, body = ApiError)))]
async fn clear_budget(
    State(app): AppState,
    headers: HeaderMap,
    Path(account): Path<String>,
) -> ApiResult<StatusCode> {
    admin_only(&caller(&app, &headers).await?)?;
    check_name("account", &account)?;
    if !app.store.clear_budget(&account).await? {
        return Err(ApiFailure::not_found(format!(
            "account {account:?} has no budget"
        )));
    }
    tracing::info!(%account, "budget removed by an admin");
    Ok(StatusCode::NO_CONTENT)
}

/// Health: `200` while this replica reaches its database, `503` otherwise.
#[utoipa::path(get, path = "/healthz", security(()),
    responses((status = 200, description = "Serving"), (status = 503, body = ApiError)))]
async fn healthz(State(app): AppState) -> ApiResult<Json<serde_json::Value>> {
    app.store.ping().await?;
    Ok(Json(
        serde_json::json!({"status": "ok", "backend": app.store.backend().name()}),
    ))
}

async fn metrics(State(app): AppState) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        app.metrics
            .render(&app.view, now_ms(), app.settings.accounting.lost_after_ms),
    )
}

async fn openapi() -> impl IntoResponse {
    Json(ApiDoc::openapi())
}

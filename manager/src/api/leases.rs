//! Leases: a user asks for cores and gets a grant of node leases, each
//! with its signed token; its owner (or the admin) shows, renews and
//! releases it.

use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::Response;
use axum::Json;
use rfaas_proto::lease::LeaseClaims;
use rfaas_proto::manager::{
    LeaseGrant, LeaseRequest, LeaseState, LeaseView, NodeLease, RenewRequest,
};
use serde::Deserialize;

use super::check::{check_memory, check_node_name};
use super::extract::{within_credential, Holder, Sent, User};
use super::{page, ApiResult, AppState};
use crate::auth::Caller;
use crate::db::retrying;
use crate::error::{ApiError, Kind, RefusalTable};
use crate::store::{lease_state_name, Denied, GrantPlan, LeaseAsk, LeaseFilter, LeaseRow, Refused};
use crate::{now_ms, now_s, App};

/// The longest `Retry-After` of a `503 no_capacity`, seconds: the soonest
/// expiry is only the latest moment a core frees up (a release frees one
/// at any time), so clients are not told to wait longer than their own
/// backoff's cap (the client library's default, 10 s) would have them.
const MAX_RETRY_AFTER_S: u64 = 10;

/// What each operation here refuses, for the OpenAPI document.
pub(super) const REFUSALS: RefusalTable = &[
    (
        "request_lease",
        &[
            Kind::Malformed,
            Kind::Forbidden,
            Kind::QuotaExceeded,
            Kind::BudgetExhausted,
            Kind::RequestExceedsCluster,
            Kind::NoCapacity,
            Kind::AccountingUnavailable,
            Kind::DatabaseUnavailable,
        ],
    ),
    (
        "list_leases",
        &[Kind::Malformed, Kind::Forbidden, Kind::DatabaseUnavailable],
    ),
    (
        "show_lease",
        &[
            Kind::Malformed,
            Kind::Forbidden,
            Kind::NotFound,
            Kind::DatabaseUnavailable,
        ],
    ),
    (
        "renew_lease",
        &[
            Kind::Malformed,
            Kind::Forbidden,
            Kind::NotFound,
            Kind::LeaseEnded,
            Kind::DatabaseUnavailable,
        ],
    ),
    (
        "release_lease",
        &[
            Kind::Malformed,
            Kind::Forbidden,
            Kind::NotFound,
            Kind::DatabaseUnavailable,
        ],
    ),
];

fn check_lease_request(app: &App, r: &LeaseRequest) -> ApiResult<u32> {
    if r.cores == 0 || r.cores > 1 << 20 {
        return Err(ApiError::Malformed(format!(
            "cores is {}; ask for 1 to {}",
            r.cores,
            1 << 20
        )));
    }
    let min = r.min_cores.unwrap_or(r.cores);
    if min == 0 || min > r.cores {
        return Err(ApiError::Malformed(format!(
            "min_cores is {min}; it must be 1 to cores ({})",
            r.cores
        )));
    }
    check_memory(r.memory_mib)?;
    if r.duration_s == 0 || r.duration_s > app.settings.max_lease_s {
        return Err(ApiError::LeaseTooLong {
            duration_s: r.duration_s,
            max_lease_s: app.settings.max_lease_s,
        });
    }
    if r.nodes.len() > 1024 {
        return Err(ApiError::Malformed(
            "nodes lists more than 1024 nodes".into(),
        ));
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
        control_tls: node.as_ref().is_some_and(|n| n.control_tls),
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
/// and, when an accounting service is up, its own billing slot. It ends
/// `duration_s` from now, or when the credential asking expires if that
/// is sooner: a lease never outlives its credential.
#[utoipa::path(post, path = "/v1/leases", request_body = LeaseRequest,
    responses((status = 201, body = LeaseGrant)))]
pub(super) async fn request_lease(
    State(app): AppState,
    Sent(user, body): Sent<User, LeaseRequest>,
) -> ApiResult<(StatusCode, Json<LeaseGrant>)> {
    let min_cores = check_lease_request(&app, &body)?;
    let now = now_s();
    let ask = LeaseAsk {
        grant: GrantPlan {
            owner: user.subject(),
            user: user.user.clone(),
            account: user.account.clone(),
            cap: app.settings.quota.cap(&user.account),
            candidates: Vec::new(),
            cores: body.cores,
            min_cores,
            memory_mib: body.memory_mib,
            issued_at: now,
            expires_at: within_credential(now + body.duration_s, user.expires_at),
            job_id: user.job_id,
            billing: Vec::new(),
            billing_required: app.settings.accounting.required,
        },
        preferred: &body.nodes,
        accounting_lost_after_ms: app.settings.accounting.lost_after_ms,
    };
    let grant = match app.store.request(&app.view, &ask).await? {
        Ok(grant) => grant,
        Err(refused) => {
            let e = refusal(&ask.grant, refused);
            app.metrics
                .denials
                .with_label_values(&[e.kind().name()])
                .inc();
            return Err(e);
        }
    };
    let leases = &grant.leases;
    app.metrics.grants.inc();
    let unbilled = leases.iter().filter(|l| l.billing.is_none()).count();
    app.metrics.unbilled_leases.inc_by(unbilled as u64);
    tracing::info!(grant_id = grant.grant_id, user = %user.user, account = %user.account, cores = leases.iter().map(|l| l.view.cores).sum::<u32>(), nodes = leases.len(), unbilled, "lease granted");
    Ok((
        StatusCode::CREATED,
        Json(grant_body(&app, grant.grant_id, leases)),
    ))
}

/// The refusal of `ask`, with its figures.
fn refusal(ask: &GrantPlan, refused: Refused) -> ApiError {
    match refused {
        Refused::ExceedsCluster { beyond, offer } => ApiError::RequestExceedsCluster {
            beyond,
            memory_mib: ask.memory_mib,
            min_cores: ask.min_cores,
            offer,
        },
        Refused::NoCapacity { soonest_expiry } => ApiError::NoCapacity {
            cores: ask.cores,
            memory_mib: ask.memory_mib,
            min_cores: ask.min_cores,
            retry_after_s: match soonest_expiry {
                Some(at) => at.saturating_sub(now_s()).clamp(1, MAX_RETRY_AFTER_S),
                None => 5,
            },
        },
        Refused::Denied(Denied::Quota { cap, in_use }) => ApiError::QuotaExceeded {
            account: ask.account.clone(),
            cap,
            in_use,
        },
        Refused::Denied(Denied::BudgetExhausted { budget, spend }) => ApiError::BudgetExhausted {
            account: ask.account.clone(),
            budget,
            spend,
        },
        Refused::Denied(Denied::AccountingUnavailable) => ApiError::AccountingUnavailable,
    }
}

/// Query of `GET /v1/leases`.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
pub(super) struct ListQuery {
    /// Leases of every state, not only active ones (unless `state`).
    #[serde(default)]
    all: bool,
    /// Only leases in this state.
    state: Option<LeaseState>,
    /// Only leases whose workers run as this user.
    #[param(max_length = 256)]
    user: Option<String>,
    /// Only leases charged to this account.
    #[param(max_length = 256)]
    account: Option<String>,
    /// Only leases on this node.
    #[param(max_length = 253)]
    node: Option<String>,
    /// Only leases for this batch job.
    job: Option<u64>,
    /// At most this many leases a page (default 1000; more than 10000
    /// is read as 10000); a `Link` header with `rel="next"` gives the
    /// next page.
    #[param(minimum = 1)]
    limit: Option<u32>,
    /// The cursor from the previous page's `Link` header.
    #[param(max_length = 64)]
    after: Option<String>,
}

/// A lease cursor: the last row's issue time and id.
fn lease_cursor(text: &str) -> Option<(u64, u64)> {
    let (issued_at, id) = text.split_once('.')?;
    Some((issued_at.parse().ok()?, id.parse().ok()?))
}

/// Leases, newest first, in pages (a `Link: <...>; rel="next"` header
/// points to the next one): a user's own, or every lease for the admin,
/// active ones unless `all` or `state` says otherwise.
#[utoipa::path(get, path = "/v1/leases", params(ListQuery),
    responses((status = 200, body = Vec<LeaseView>,
        headers(("Link" = String, description = "`<url>; rel=\"next\"` while more leases remain")))))]
pub(super) async fn list_leases(
    State(app): AppState,
    Query(q): Query<ListQuery>,
    holder: Holder,
) -> ApiResult<Response> {
    let limit = page::limit(q.limit)?;
    let after = page::cursor(q.after.as_deref(), lease_cursor)?;
    for (name, value, max) in [
        ("user", &q.user, 256),
        ("account", &q.account, 256),
        ("node", &q.node, 253),
    ] {
        if let Some(v) = value {
            if v.is_empty() || v.len() > max {
                return Err(ApiError::Malformed(format!(
                    "{name} is {} bytes long; give 1 to {max}, or leave it out",
                    v.len()
                )));
            }
        }
    }
    let filter = LeaseFilter {
        state: q.state.or((!q.all).then_some(LeaseState::Active)),
        owner: holder.owner.as_deref(),
        user: q.user.as_deref(),
        account: q.account.as_deref(),
        node: q.node.as_deref(),
        job_id: q.job,
    };
    let mut rows = app.store.leases(&filter, after, limit as u32 + 1).await?;
    let more = rows.len() > limit;
    rows.truncate(limit);
    let next = more
        .then(|| {
            rows.last()
                .map(|r| format!("{}.{}", r.view.issued_at, r.view.lease_id))
        })
        .flatten();
    let mut query = vec![("limit", limit.to_string())];
    if q.all {
        query.push(("all", "true".into()));
    }
    if let Some(s) = q.state {
        query.push(("state", lease_state_name(s).into()));
    }
    for (name, value) in [("user", q.user), ("account", q.account), ("node", q.node)] {
        if let Some(v) = value {
            query.push((name, v));
        }
    }
    if let Some(job) = q.job {
        query.push(("job", job.to_string()));
    }
    let leases: Vec<LeaseView> = rows.into_iter().map(|r| r.view).collect();
    Ok(page::page("/v1/leases", leases, next, &query))
}

async fn owned_grant(app: &App, c: &Caller, id: u64) -> ApiResult<Vec<LeaseRow>> {
    let rows = app.store.grant_leases(id).await?;
    if rows.is_empty() {
        return Err(ApiError::NotFound(format!("no lease has id {id}")));
    }
    if *c != Caller::Admin && rows[0].owner != c.subject() {
        return Err(ApiError::Forbidden(format!(
            "lease {id} belongs to someone else"
        )));
    }
    Ok(rows)
}

/// A grant's node leases (owner or admin).
#[utoipa::path(get, path = "/v1/leases/{id}",
    params(("id" = u64, Path, description = "The grant's id")),
    responses((status = 200, body = Vec<LeaseView>)))]
pub(super) async fn show_lease(
    State(app): AppState,
    Path(id): Path<u64>,
    c: Caller,
) -> ApiResult<Json<Vec<LeaseView>>> {
    let rows = owned_grant(&app, &c, id).await?;
    Ok(Json(rows.into_iter().map(|r| r.view).collect()))
}

/// Renew a grant (owner): its active node leases now end `duration_s` from
/// now (never sooner than before), with new tokens to hand the executors,
/// each with the billing slot it was granted; never past the expiry of
/// the user credential renewing it. A spent budget does not
/// refuse a renewal: leases granted run to their end. From its
/// `expires_at` second on, a grant has ended (`409 lease_ended`), whether
/// or not the reaper has marked it yet.
#[utoipa::path(post, path = "/v1/leases/{id}/renew", request_body = RenewRequest,
    params(("id" = u64, Path, description = "The grant's id")),
    responses((status = 200, body = LeaseGrant)))]
pub(super) async fn renew_lease(
    State(app): AppState,
    Path(id): Path<u64>,
    Sent(c, body): Sent<Caller, RenewRequest>,
) -> ApiResult<Json<LeaseGrant>> {
    if body.duration_s == 0 || body.duration_s > app.settings.max_lease_s {
        return Err(ApiError::Malformed(format!(
            "duration_s is {}; it must be 1 to {} (max_lease_s)",
            body.duration_s, app.settings.max_lease_s
        )));
    }
    owned_grant(&app, &c, id).await?;
    let now = now_ms();
    let mut expires_at = now / 1000 + body.duration_s;
    if let Caller::User {
        expires_at: credential,
        ..
    } = c
    {
        expires_at = within_credential(expires_at, credential);
    }
    let rows = app.store.renew(id, expires_at, now).await?;
    if rows.is_empty() {
        return Err(ApiError::LeaseEnded { id });
    }
    Ok(Json(grant_body(&app, id, &rows)))
}

/// Release a grant (owner or admin). Releasing an ended grant is not an
/// error.
#[utoipa::path(delete, path = "/v1/leases/{id}",
    params(("id" = u64, Path, description = "The grant's id")),
    responses((status = 204, description = "Released")))]
pub(super) async fn release_lease(
    State(app): AppState,
    Path(id): Path<u64>,
    c: Caller,
) -> ApiResult<StatusCode> {
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

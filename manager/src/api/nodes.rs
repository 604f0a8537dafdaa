//! Nodes: registration and heartbeats (the node itself, or the admin),
//! listings (anyone), drain and resume (the admin). A node's registration
//! and heartbeat replies carry a fresh accounting ticket, signed with the
//! lease key, which the node shows accounting services instead of its
//! credential.

use axum::extract::{Path, Query, State};
use axum::response::Response;
use axum::Json;
use rfaas_proto::manager::{
    Heartbeat, HeartbeatReply, NodeState, NodeView, RegisterNode, Registered,
};
use serde::Deserialize;

use super::check::{check_memory, check_node_name, check_text};
use super::extract::{Admin, Sent, ThisNode};
use super::{page, ApiResult, AppState};
use crate::auth::Caller;
use crate::error::{ApiError, Kind, RefusalTable};
use crate::view::View;
use crate::{now_ms, App};

/// What each operation here refuses, for the OpenAPI document.
pub(super) const REFUSALS: RefusalTable = &[
    (
        "register_node",
        &[Kind::Malformed, Kind::Forbidden, Kind::DatabaseUnavailable],
    ),
    (
        "heartbeat",
        &[
            Kind::Malformed,
            Kind::Forbidden,
            Kind::NotFound,
            Kind::DatabaseUnavailable,
        ],
    ),
    ("list_nodes", &[Kind::Malformed, Kind::DatabaseUnavailable]),
    (
        "show_node",
        &[Kind::Malformed, Kind::NotFound, Kind::DatabaseUnavailable],
    ),
    (
        "drain_node",
        &[
            Kind::Malformed,
            Kind::Forbidden,
            Kind::NotFound,
            Kind::DatabaseUnavailable,
        ],
    ),
    (
        "resume_node",
        &[
            Kind::Malformed,
            Kind::Forbidden,
            Kind::NotFound,
            Kind::DatabaseUnavailable,
        ],
    ),
];

fn check_register(r: &RegisterNode) -> ApiResult<()> {
    if r.cores == 0 || r.cores > u32::from(u16::MAX) {
        return Err(ApiError::Malformed(format!(
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
        return Err(ApiError::Malformed(format!(
            "control_addr {:?} is not host:port",
            r.control_addr
        )));
    }
    if r.providers.is_empty() || r.providers.len() > 16 {
        return Err(ApiError::Malformed(
            "providers must list 1 to 16 providers".into(),
        ));
    }
    for p in &r.providers {
        check_text("provider name", &p.name)?;
        let known = p.name == "tcp" || p.name == "shm" || p.name.starts_with("verbs:");
        if !known || p.name.len() > 64 || p.host.as_ref().is_some_and(|h| h.len() > 255) {
            return Err(ApiError::Malformed(format!(
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
        return Err(ApiError::Malformed(
            "version is longer than 64 characters".into(),
        ));
    }
    rfaas_proto::manager::partitions(&r.partitions).map_err(ApiError::Malformed)
}
/// Register a node, or update its record. Idempotent. The reply carries
/// a fresh accounting ticket when the node's own credential asked. With fewer cores or
/// less memory than it has leased, the node keeps its leases and takes no
/// new one until they fit: its `draining_cores` and `draining_memory_mib`
/// say how much leaves as they end.
#[utoipa::path(put, path = "/v1/nodes/{name}", request_body = RegisterNode,
    params(("name" = String, Path, description = "The node's name (see rfaas_proto::node_name)", pattern = r"^[A-Za-z0-9][A-Za-z0-9_-]*(\.[A-Za-z0-9_-]+)*$", max_length = 253)),
    responses((status = 200, body = Registered)))]
pub(super) async fn register_node(
    State(app): AppState,
    Path(name): Path<String>,
    Sent(this, body): Sent<ThisNode, RegisterNode>,
) -> ApiResult<Json<Registered>> {
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
    let intervals = app.intervals();
    Ok(Json(Registered {
        node,
        heartbeat_interval_ms: intervals.heartbeat_ms,
        lost_after_ms: intervals.lost_after_ms,
        accounting_ticket: ticket(&app, &name, &this),
    }))
}

/// A fresh accounting ticket for node `name`, when its own credential
/// asked (the admin token has no credential id to name).
fn ticket(app: &App, name: &str, this: &ThisNode) -> Option<String> {
    let credential_id = this.credential_id.as_deref()?;
    let now_s = now_ms() / 1000;
    match app
        .signer
        .node_ticket(name, credential_id, now_s, app.settings.accounting_ticket_s)
    {
        Ok(t) => Some(t),
        Err(e) => {
            // Only a name too long for the hello gets here.
            tracing::warn!(node = %name, error = %e, "cannot sign an accounting ticket for the node: its usage cannot be posted; use a shorter lease key id");
            None
        }
    }
}

/// A node's heartbeat: its free capacity and the leases it holds. The
/// answer lists those that have ended, the interval to heartbeat at
/// (it grows with the fleet), and a fresh accounting ticket when the
/// node's own credential asked. `404`: register again.
///
/// A heartbeat that changes nothing grants go by is noted in memory and
/// written with the others in the replica's next round
/// ([`crate::liveness`]); one that does (a lost node back, other withheld
/// cores, a node this replica has not seen yet) is written at once.
#[utoipa::path(post, path = "/v1/nodes/{name}/heartbeat", request_body = Heartbeat,
    params(("name" = String, Path, description = "The node's name (see rfaas_proto::node_name)", pattern = r"^[A-Za-z0-9][A-Za-z0-9_-]*(\.[A-Za-z0-9_-]+)*$", max_length = 253)),
    responses((status = 200, body = HeartbeatReply)))]
pub(super) async fn heartbeat(
    State(app): AppState,
    Path(name): Path<String>,
    Sent(this, body): Sent<ThisNode, Heartbeat>,
) -> ApiResult<Json<HeartbeatReply>> {
    let now = now_ms();
    let ended_leases =
        if app.liveness.knows_ended() && app.view.beat(&name, now, body.withheld_cores) {
            app.liveness.heard(&name, now);
            app.metrics.heartbeats.with_label_values(&["memory"]).inc();
            app.liveness.ended_of(&name, &body.allocations)
        } else {
            let Some((node, ended)) = app.store.heartbeat(&name, &body, now).await? else {
                return Err(ApiError::NotFound(format!(
                    "node {name:?} is not registered here; register it (PUT /v1/nodes/{name})"
                )));
            };
            app.view.upsert(node);
            app.metrics
                .heartbeats
                .with_label_values(&["database"])
                .inc();
            ended
        };
    Ok(Json(HeartbeatReply {
        ended_leases,
        heartbeat_interval_ms: Some(app.intervals().heartbeat_ms),
        accounting_ticket: ticket(&app, &name, &this),
    }))
}

/// Query of `GET /v1/nodes`.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
pub(super) struct NodesQuery {
    /// Read the database, not this replica's view.
    #[serde(default)]
    fresh: bool,
    /// Only nodes in this state.
    state: Option<NodeState>,
    /// Only nodes whose name starts with this.
    #[param(max_length = 253)]
    prefix: Option<String>,
    /// Only nodes in this Slurm partition (read from the database, through
    /// its index of nodes by partition).
    #[param(pattern = r"^[A-Za-z0-9_.-]{1,64}$", min_length = 1, max_length = 64)]
    partition: Option<String>,
    /// At most this many nodes a page (default 1000; more than 10000 is
    /// read as 10000); a `Link` header with `rel="next"` gives the next
    /// page.
    #[param(minimum = 1)]
    limit: Option<u32>,
    /// The cursor from the previous page's `Link` header.
    #[param(max_length = 253)]
    after: Option<String>,
}

/// The nodes by name, as this replica sees them (at most `refresh_ms`
/// old), or as the database has them now with `fresh=true`, in pages: a
/// `Link: <...>; rel="next"` header points to the next one.
#[utoipa::path(get, path = "/v1/nodes", params(NodesQuery),
    responses((status = 200, body = Vec<NodeView>,
        headers(("Link" = String, description = "`<url>; rel=\"next\"` while more nodes remain")))))]
pub(super) async fn list_nodes(
    State(app): AppState,
    Query(q): Query<NodesQuery>,
    _: Caller,
) -> ApiResult<Response> {
    let limit = page::limit(q.limit)?;
    // The cursor is the last name of the page before.
    let after = page::cursor(q.after.as_deref(), |a| {
        check_node_name(a).is_ok().then(|| a.to_owned())
    })?;
    let prefix = q.prefix.unwrap_or_default();
    if prefix.len() > 253 {
        return Err(ApiError::Malformed(format!(
            "prefix is {} bytes long; node names have at most 253",
            prefix.len()
        )));
    }
    let keep = |n: &NodeView| q.state.map_or(true, |s| n.state == s);
    let (nodes, more) = if let Some(p) = &q.partition {
        rfaas_proto::manager::partition_name(p).map_err(ApiError::Malformed)?;
        partition_page(&app, p, after.as_deref(), &prefix, limit, keep).await?
    } else if q.fresh {
        let fresh = View::default();
        fresh.replace_all(app.store.nodes().await?);
        fresh.page(after.as_deref(), &prefix, limit, keep)
    } else {
        app.view.page(after.as_deref(), &prefix, limit, keep)
    };
    let next = more.then(|| nodes.last().map(|n| n.name.clone())).flatten();
    let mut query = vec![("limit", limit.to_string())];
    if q.fresh {
        query.push(("fresh", "true".into()));
    }
    if let Some(s) = q.state {
        query.push(("state", state_name(s).into()));
    }
    if !prefix.is_empty() {
        query.push(("prefix", prefix));
    }
    if let Some(p) = q.partition {
        query.push(("partition", p));
    }
    Ok(page::page("/v1/nodes", nodes, next, &query))
}

/// A page of the nodes of `partition` named after `after` and starting
/// with `prefix` that `keep` keeps, read from the database in batches
/// through the index of nodes by partition; whether more follow.
async fn partition_page(
    app: &App,
    partition: &str,
    after: Option<&str>,
    prefix: &str,
    limit: usize,
    keep: impl Fn(&NodeView) -> bool,
) -> ApiResult<(Vec<NodeView>, bool)> {
    let batch = u32::try_from(limit.saturating_add(1)).unwrap_or(u32::MAX);
    let mut cursor = after.unwrap_or("").to_owned();
    let mut out = Vec::new();
    loop {
        let read = app
            .store
            .nodes_in(partition, &cursor, prefix, batch)
            .await?;
        let full = read.len() == batch as usize;
        for n in read {
            if !n.node.name.starts_with(prefix) {
                return Ok((out, false));
            }
            cursor.clone_from(&n.node.name);
            if keep(&n.node) {
                if out.len() == limit {
                    return Ok((out, true));
                }
                out.push(n.node);
            }
        }
        if !full {
            return Ok((out, false));
        }
    }
}

fn state_name(s: NodeState) -> &'static str {
    match s {
        NodeState::Up => "up",
        NodeState::Drained => "drained",
        NodeState::Lost => "lost",
    }
}

/// One node.
#[utoipa::path(get, path = "/v1/nodes/{name}",
    params(("name" = String, Path, description = "The node's name (see rfaas_proto::node_name)", pattern = r"^[A-Za-z0-9][A-Za-z0-9_-]*(\.[A-Za-z0-9_-]+)*$", max_length = 253)),
    responses((status = 200, body = NodeView)))]
pub(super) async fn show_node(
    State(app): AppState,
    Path(name): Path<String>,
    _: Caller,
) -> ApiResult<Json<NodeView>> {
    check_node_name(&name)?;
    app.view
        .get(&name)
        .map(Json)
        .ok_or_else(|| ApiError::NotFound(format!("no node is named {name:?}")))
}

async fn set_drained(app: &App, name: &str, drained: bool) -> ApiResult<Json<NodeView>> {
    check_node_name(name)?;
    let read = app
        .store
        .set_drained(name, drained)
        .await?
        .ok_or_else(|| ApiError::NotFound(format!("no node is named {name:?}")))?;
    let node = read.node.clone();
    app.view.upsert(read);
    tracing::info!(node = %name, drained, "node state set by an admin");
    Ok(Json(node))
}

/// Drain a node (admin): it is no longer offered; its leases run to their end.
#[utoipa::path(post, path = "/v1/nodes/{name}/drain",
    params(("name" = String, Path, description = "The node's name (see rfaas_proto::node_name)", pattern = r"^[A-Za-z0-9][A-Za-z0-9_-]*(\.[A-Za-z0-9_-]+)*$", max_length = 253)),
    responses((status = 200, body = NodeView)))]
pub(super) async fn drain_node(
    State(app): AppState,
    Path(name): Path<String>,
    _: Admin,
) -> ApiResult<Json<NodeView>> {
    set_drained(&app, &name, true).await
}

/// Resume a drained node (admin).
#[utoipa::path(post, path = "/v1/nodes/{name}/resume",
    params(("name" = String, Path, description = "The node's name (see rfaas_proto::node_name)", pattern = r"^[A-Za-z0-9][A-Za-z0-9_-]*(\.[A-Za-z0-9_-]+)*$", max_length = 253)),
    responses((status = 200, body = NodeView)))]
pub(super) async fn resume_node(
    State(app): AppState,
    Path(name): Path<String>,
    _: Admin,
) -> ApiResult<Json<NodeView>> {
    set_drained(&app, &name, false).await
}

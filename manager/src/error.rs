//! Every refusal the API gives, as one [`ApiError`] variant, and the one
//! place ([`Kind`]) that decides each one's HTTP status and wire `kind`.
//!
//! On the wire every error is one JSON shape
//! ([`rfaas_proto::manager::ApiError`]), whatever produced it: a handler,
//! the database, or axum's own rejections (bad JSON, wrong method, unknown
//! route), which [`json_errors`] rewrites. The OpenAPI document's error
//! responses are generated from [`Kind`] ([`Refusals`]), so the document
//! says what the code answers.

use std::collections::BTreeMap;

use axum::body::Body;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use rfaas_proto::manager::{ApiError as ErrorBody, ClusterOffer, REQUEST_EXCEEDS_CLUSTER};
use rfaas_proto::text::count;
use utoipa::openapi::{path::Operation, RefOr, ResponseBuilder};

use crate::db::DbError;
use crate::store::Beyond;

/// A refused request: one variant per refusal, each with the figures its
/// message and body carry. Its status and wire kind come from [`Kind`].
#[derive(Debug, Clone, PartialEq)]
pub enum ApiError {
    /// No usable bearer token.
    Unauthorized(String),
    /// The credential was revoked by an admin.
    CredentialRevoked {
        /// The credential's id.
        id: String,
    },
    /// The credential is past its expiry.
    CredentialExpired {
        /// The credential's id.
        id: String,
        /// When it expired, Unix seconds.
        expires_at: u64,
    },
    /// The caller may not do this.
    Forbidden(String),
    /// The account's cap on cores held at once would be passed.
    QuotaExceeded {
        /// The account.
        account: String,
        /// Its cap.
        cap: u32,
        /// Cores it holds now.
        in_use: u64,
    },
    /// The account has spent its budget.
    BudgetExhausted {
        /// The account.
        account: String,
        /// Its budget.
        budget: f64,
        /// What it has spent.
        spend: f64,
    },
    /// The request is malformed; the message says which field and why.
    Malformed(String),
    /// A lease's `duration_s` is 0 or above `max_lease_s`.
    LeaseTooLong {
        /// What was asked.
        duration_s: u64,
        /// The manager's `max_lease_s`.
        max_lease_s: u64,
    },
    /// Nothing of that name or id.
    NotFound(String),
    /// The grant has ended and cannot be renewed.
    LeaseEnded {
        /// The grant's id.
        id: u64,
    },
    /// No node that ever registered could hold the request: waiting does
    /// not help.
    RequestExceedsCluster {
        /// What it asks beyond the cluster.
        beyond: Beyond,
        /// Memory per node lease asked for, MiB.
        memory_mib: u64,
        /// Fewest cores asked for.
        min_cores: u32,
        /// The largest request the cluster could ever hold.
        offer: ClusterOffer,
    },
    /// Not enough cores are free now.
    NoCapacity {
        /// Cores asked for.
        cores: u32,
        /// Memory per node lease, MiB.
        memory_mib: u64,
        /// Fewest cores worth granting.
        min_cores: u32,
        /// When to ask again, seconds.
        retry_after_s: u64,
    },
    /// Billing is required and no accounting instance has a free slot.
    AccountingUnavailable,
    /// The database cannot be reached now.
    DatabaseUnavailable,
    /// Slurm cannot be asked about a job now.
    SlurmUnavailable(String),
    /// A fault of the manager's own; the message says what, the log more.
    Internal(String),
}

/// The wire kinds of [`ApiError`] (and of axum's rejections): each one's
/// HTTP status and name, and what it means, for the OpenAPI document.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Kind {
    /// `400 malformed_request`.
    Malformed,
    /// `401 unauthorized`.
    Unauthorized,
    /// `401 credential_revoked`.
    CredentialRevoked,
    /// `401 credential_expired`.
    CredentialExpired,
    /// `403 forbidden`.
    Forbidden,
    /// `403 quota_exceeded`.
    QuotaExceeded,
    /// `403 budget_exhausted`.
    BudgetExhausted,
    /// `404 not_found`.
    NotFound,
    /// `405 method_not_allowed` (axum's rejection).
    MethodNotAllowed,
    /// `409 lease_ended`.
    LeaseEnded,
    /// `413 body_too_large` (axum's rejection; 411 too).
    BodyTooLarge,
    /// `415 unsupported_media_type` (axum's rejection).
    UnsupportedMediaType,
    /// `422 request_exceeds_cluster`.
    RequestExceedsCluster,
    /// `500 internal`.
    Internal,
    /// `503 no_capacity`.
    NoCapacity,
    /// `503 accounting_unavailable`.
    AccountingUnavailable,
    /// `503 database_unavailable`.
    DatabaseUnavailable,
    /// `503 slurm_unavailable`.
    SlurmUnavailable,
}

impl Kind {
    /// Every kind, in status order.
    pub const ALL: [Kind; 18] = [
        Kind::Malformed,
        Kind::Unauthorized,
        Kind::CredentialRevoked,
        Kind::CredentialExpired,
        Kind::Forbidden,
        Kind::QuotaExceeded,
        Kind::BudgetExhausted,
        Kind::NotFound,
        Kind::MethodNotAllowed,
        Kind::LeaseEnded,
        Kind::BodyTooLarge,
        Kind::UnsupportedMediaType,
        Kind::RequestExceedsCluster,
        Kind::Internal,
        Kind::NoCapacity,
        Kind::AccountingUnavailable,
        Kind::DatabaseUnavailable,
        Kind::SlurmUnavailable,
    ];

    /// The kinds a credential check gives: every operation that needs a
    /// bearer token may answer them.
    pub const AUTHENTICATION: [Kind; 3] = [
        Kind::Unauthorized,
        Kind::CredentialRevoked,
        Kind::CredentialExpired,
    ];

    /// Its HTTP status, its wire name, and when it is given.
    pub const fn wire(self) -> (u16, &'static str, &'static str) {
        match self {
            Kind::Malformed => (400, "malformed_request", "the request is malformed; the message names the field and the rule"),
            Kind::Unauthorized => (401, "unauthorized", "no bearer token, or one this manager does not know"),
            Kind::CredentialRevoked => (401, "credential_revoked", "an admin revoked the credential; ask for a new one"),
            Kind::CredentialExpired => (401, "credential_expired", "the credential is past its expiry; ask for a new one"),
            Kind::Forbidden => (403, "forbidden", "the credential may not do this (its role, or someone else's lease or node)"),
            Kind::QuotaExceeded => (403, "quota_exceeded", "the account would hold more cores than its cap; with account, cap and in_use"),
            Kind::BudgetExhausted => (403, "budget_exhausted", "the account has spent its budget; with account, budget and spend"),
            Kind::NotFound => (404, "not_found", "nothing has that name or id"),
            Kind::MethodNotAllowed => (405, "method_not_allowed", "the route does not take that method"),
            Kind::LeaseEnded => (409, "lease_ended", "the lease has ended (released, expired, or its nodes lost); request a new one"),
            Kind::BodyTooLarge => (413, "body_too_large", "the body is larger than the manager takes"),
            Kind::UnsupportedMediaType => (415, "unsupported_media_type", "the body is not application/json"),
            Kind::RequestExceedsCluster => (422, REQUEST_EXCEEDS_CLUSTER, "no node that ever registered could hold the request, at the capacity it registered, whatever its state now: more memory per node lease than the largest node, or more cores (min_cores) than the nodes with that memory together. Not retryable; the message and largest_node_cores, largest_node_memory_mib, cluster_cores, nodes and cores_with_memory give the largest offer"),
            Kind::Internal => (500, "internal", "a fault of the manager's own; its log says more"),
            Kind::NoCapacity => (503, "no_capacity", "nothing fits now (or no node has registered yet); retry after Retry-After, 1 to 10 s (when the soonest lease ends, at most 10 s: a release frees cores at any time)"),
            Kind::AccountingUnavailable => (503, "accounting_unavailable", "billing is required and no accounting instance has a free slot; retry after Retry-After"),
            Kind::DatabaseUnavailable => (503, "database_unavailable", "the manager's database cannot be reached now; retry after Retry-After"),
            Kind::SlurmUnavailable => (503, "slurm_unavailable", "the manager cannot ask Slurm about the job now (squeue failed or did not answer), and grants nothing on a node's word; retry after Retry-After"),
        }
    }

    /// Its HTTP status.
    pub fn status(self) -> StatusCode {
        StatusCode::from_u16(self.wire().0).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
    }

    /// Its wire name, the body's `error`.
    pub fn name(self) -> &'static str {
        self.wire().1
    }

    /// The kind of an error status that carries no JSON of its own (axum's
    /// rejections).
    fn of_status(status: StatusCode) -> &'static str {
        match status.as_u16() {
            400 | 422 => Kind::Malformed.name(),
            401 => Kind::Unauthorized.name(),
            403 => Kind::Forbidden.name(),
            404 => Kind::NotFound.name(),
            405 => Kind::MethodNotAllowed.name(),
            411 | 413 => Kind::BodyTooLarge.name(),
            415 => Kind::UnsupportedMediaType.name(),
            500..=599 => Kind::Internal.name(),
            _ => "request_refused",
        }
    }
}

impl ApiError {
    /// Its wire kind (and so its status).
    pub fn kind(&self) -> Kind {
        match self {
            ApiError::Unauthorized(_) => Kind::Unauthorized,
            ApiError::CredentialRevoked { .. } => Kind::CredentialRevoked,
            ApiError::CredentialExpired { .. } => Kind::CredentialExpired,
            ApiError::Forbidden(_) => Kind::Forbidden,
            ApiError::QuotaExceeded { .. } => Kind::QuotaExceeded,
            ApiError::BudgetExhausted { .. } => Kind::BudgetExhausted,
            ApiError::Malformed(_) | ApiError::LeaseTooLong { .. } => Kind::Malformed,
            ApiError::NotFound(_) => Kind::NotFound,
            ApiError::LeaseEnded { .. } => Kind::LeaseEnded,
            ApiError::RequestExceedsCluster { .. } => Kind::RequestExceedsCluster,
            ApiError::NoCapacity { .. } => Kind::NoCapacity,
            ApiError::AccountingUnavailable => Kind::AccountingUnavailable,
            ApiError::DatabaseUnavailable => Kind::DatabaseUnavailable,
            ApiError::SlurmUnavailable(_) => Kind::SlurmUnavailable,
            ApiError::Internal(_) => Kind::Internal,
        }
    }

    /// Seconds for `Retry-After` (also in the body as `retry_after_s`).
    fn retry_after(&self) -> Option<u64> {
        match self {
            ApiError::NoCapacity { retry_after_s, .. } => Some(*retry_after_s),
            ApiError::AccountingUnavailable
            | ApiError::DatabaseUnavailable
            | ApiError::SlurmUnavailable(_) => Some(1),
            _ => None,
        }
    }

    /// What happened and what to do.
    fn message(&self) -> String {
        match self {
            ApiError::Unauthorized(m)
            | ApiError::Forbidden(m)
            | ApiError::Malformed(m)
            | ApiError::NotFound(m)
            | ApiError::Internal(m) => m.clone(),
            ApiError::SlurmUnavailable(why) => format!(
                "{why}; nothing is granted without Slurm's word: retry after the Retry-After seconds, and tell the admin if it lasts ([slurm] in manager.toml)"
            ),
            ApiError::CredentialRevoked { id } => {
                format!("credential {id} was revoked by an admin; ask for a new one")
            }
            ApiError::CredentialExpired { id, expires_at } => format!(
                "credential {id} expired at {expires_at} (Unix seconds); ask for a new one"
            ),
            ApiError::QuotaExceeded { account, cap, in_use } => format!(
                "account {account:?} may hold {cap} cores at once and holds {in_use}; release a lease or ask for at most {}",
                u64::from(*cap).saturating_sub(*in_use)
            ),
            ApiError::BudgetExhausted { account, budget, spend } => format!(
                "account {account:?} has spent {spend} of its budget of {budget}; leases it holds run on, but new ones need a larger budget (rfaasctl budget set)"
            ),
            ApiError::LeaseTooLong { duration_s, max_lease_s } => format!(
                "duration_s is {duration_s}; it must be 1 to {max_lease_s} (max_lease_s); renew a lease to keep it longer"
            ),
            ApiError::LeaseEnded { id } => format!(
                "lease {id} has ended (released, expired, or its nodes lost) and cannot be renewed; request a new lease"
            ),
            ApiError::RequestExceedsCluster { beyond, memory_mib, min_cores, offer: o } => {
                let why = match beyond {
                    Beyond::Memory => format!(
                        "each node lease asks for {memory_mib} MiB, more than any node lends"
                    ),
                    Beyond::CoresWithMemory => format!(
                        "it needs at least {}, and the nodes that lend {memory_mib} MiB or more lend {} together",
                        count(*min_cores, "core"),
                        count(o.cores_with_memory, "core")
                    ),
                    Beyond::Cores => format!(
                        "it needs at least {}, more than all nodes together lend",
                        count(*min_cores, "core")
                    ),
                };
                format!(
                "no node here could ever hold this request, so waiting will not help: {why}. The largest node lends {} and {} MiB; the whole cluster ({}) lends {}. Ask for less (with min_cores, a grant may take fewer cores)",
                count(o.largest_node_cores, "core"),
                o.largest_node_memory_mib,
                count(o.nodes, "node"),
                count(o.cluster_cores, "core"),
            )
            }
            ApiError::NoCapacity { cores, memory_mib, min_cores, .. } => format!(
                "{} with {memory_mib} MiB each are not free now (at least {} wanted); retry after the Retry-After seconds",
                count(*cores, "core"),
                count(*min_cores, "core")
            ),
            ApiError::AccountingUnavailable => "no accounting service has a free billing slot now, and this manager grants no lease unbilled ([accounting] required); retry after the Retry-After seconds, and tell the admin if it lasts".to_owned(),
            ApiError::DatabaseUnavailable => {
                "the manager's database cannot be reached now; try again shortly".to_owned()
            }
        }
    }

    /// The figures the body carries beside `error` and `message`.
    fn details(&self) -> serde_json::Map<String, serde_json::Value> {
        let mut details = match self {
            ApiError::RequestExceedsCluster { offer, .. } => offer.to_details(),
            _ => serde_json::Map::new(),
        };
        let mut add = |key: &str, value: serde_json::Value| {
            details.insert(key.to_owned(), value);
        };
        match self {
            ApiError::QuotaExceeded {
                account,
                cap,
                in_use,
            } => {
                add("account", account.as_str().into());
                add("cap", (*cap).into());
                add("in_use", (*in_use).into());
            }
            ApiError::BudgetExhausted {
                account,
                budget,
                spend,
            } => {
                add("account", account.as_str().into());
                add("budget", (*budget).into());
                add("spend", (*spend).into());
            }
            ApiError::LeaseTooLong { max_lease_s, .. } => add("max_lease_s", (*max_lease_s).into()),
            _ => {}
        }
        if let Some(secs) = self.retry_after() {
            add("retry_after_s", secs.into());
        }
        details
    }

    /// The JSON body.
    pub fn body(&self) -> ErrorBody {
        ErrorBody {
            error: self.kind().name().to_owned(),
            message: self.message(),
            details: self.details(),
        }
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.message(), self.kind().name())
    }
}

impl std::error::Error for ApiError {}

impl From<DbError> for ApiError {
    fn from(e: DbError) -> ApiError {
        match e {
            DbError::Unavailable(why) | DbError::Conflict(why) => {
                tracing::warn!(%why, "database unavailable");
                ApiError::DatabaseUnavailable
            }
            DbError::Other(why) => {
                tracing::error!(%why, "database error");
                ApiError::Internal("the manager met an internal error; its log says more".into())
            }
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut resp = (self.kind().status(), axum::Json(self.body())).into_response();
        if let Some(secs) = self.retry_after() {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        resp
    }
}

/// The refusals of each operation, by its `operationId` (the handler's
/// name): what [`Refusals`] writes into the OpenAPI document. Every
/// operation that takes a bearer token may also answer
/// [`Kind::AUTHENTICATION`], which is added for it.
pub type RefusalTable = &'static [(&'static str, &'static [Kind])];

/// Writes each operation's error responses into the OpenAPI document from
/// the tables given: one response per status, naming its kinds, each an
/// [`ErrorBody`]; and `4XX` for the rejections axum gives before a handler
/// runs (malformed JSON, path or query; wrong media type; too large).
#[derive(Debug)]
pub struct Refusals(pub &'static [RefusalTable]);

impl Refusals {
    fn of(&self, operation_id: &str) -> Option<&'static [Kind]> {
        self.0
            .iter()
            .flat_map(|t| t.iter())
            .find(|(op, _)| *op == operation_id)
            .map(|(_, kinds)| *kinds)
    }

    fn write(&self, op: &mut Operation) {
        let Some(id) = op.operation_id.clone() else {
            return;
        };
        let Some(declared) = self.of(&id) else {
            return;
        };
        // `security(())`: open to anyone, no credential checked.
        let open = op
            .security
            .as_ref()
            .is_some_and(|s| s.iter().all(|r| *r == Default::default()));
        let mut kinds: Vec<Kind> = declared.to_vec();
        if !open {
            kinds.extend(Kind::AUTHENTICATION);
        }
        kinds.sort();
        kinds.dedup();
        let mut by_status: BTreeMap<u16, Vec<Kind>> = BTreeMap::new();
        for k in kinds {
            by_status.entry(k.wire().0).or_default().push(k);
        }
        let error_body = || {
            utoipa::openapi::ContentBuilder::new()
                .schema(Some(RefOr::Ref(utoipa::openapi::Ref::from_schema_name(
                    "ApiError",
                ))))
                .build()
        };
        for (status, kinds) in by_status {
            let description = kinds
                .iter()
                .map(|k| format!("{}: {}", k.name(), k.wire().2))
                .collect::<Vec<_>>()
                .join("; ");
            let response = ResponseBuilder::new()
                .description(description)
                .content("application/json", error_body())
                .build();
            op.responses
                .responses
                .insert(status.to_string(), RefOr::T(response));
        }
        let rejected = ResponseBuilder::new()
            .description("Refused before the handler ran: malformed_request (bad JSON, path or query), unsupported_media_type, body_too_large, method_not_allowed")
            .content("application/json", error_body())
            .build();
        op.responses
            .responses
            .entry("4XX".to_owned())
            .or_insert(RefOr::T(rejected));
    }
}

impl utoipa::Modify for Refusals {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        for item in openapi.paths.paths.values_mut() {
            for op in [
                &mut item.get,
                &mut item.put,
                &mut item.post,
                &mut item.delete,
                &mut item.patch,
            ]
            .into_iter()
            .flatten()
            {
                self.write(op);
            }
        }
    }
}

/// Rewrites any error response that is not already JSON (axum's
/// rejections are plain text) into an [`ErrorBody`] with the same status,
/// keeping its text as the message.
pub async fn json_errors(resp: Response) -> Response {
    let status = resp.status();
    let is_json = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/json"));
    if !(status.is_client_error() || status.is_server_error()) || is_json {
        return resp;
    }
    let (parts, body) = resp.into_parts();
    let text = axum::body::to_bytes(body, 64 * 1024)
        .await
        .map(|b| String::from_utf8_lossy(&b).trim().to_owned())
        .unwrap_or_default();
    let message = match (status.as_u16(), text.is_empty()) {
        (404, true) => "no such route; the API is under /v1 (see /v1/openapi.json)".to_owned(),
        (405, true) => "this route does not take that method (see /v1/openapi.json)".to_owned(),
        (_, true) => status
            .canonical_reason()
            .unwrap_or("request refused")
            .to_owned(),
        (_, false) => text,
    };
    let body = ErrorBody {
        error: Kind::of_status(status).to_owned(),
        message,
        details: serde_json::Map::new(),
    };
    let mut out = Response::from_parts(
        parts,
        Body::from(serde_json::to_vec(&body).expect("errors serialise")),
    );
    out.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    out.headers_mut().remove(header::CONTENT_LENGTH);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_is_listed_once_with_its_own_name() {
        // Exhaustive: a new kind needs a number here, and a place in ALL.
        let number = |k: Kind| match k {
            Kind::Malformed => 0,
            Kind::Unauthorized => 1,
            Kind::CredentialRevoked => 2,
            Kind::CredentialExpired => 3,
            Kind::Forbidden => 4,
            Kind::QuotaExceeded => 5,
            Kind::BudgetExhausted => 6,
            Kind::NotFound => 7,
            Kind::MethodNotAllowed => 8,
            Kind::LeaseEnded => 9,
            Kind::BodyTooLarge => 10,
            Kind::UnsupportedMediaType => 11,
            Kind::RequestExceedsCluster => 12,
            Kind::Internal => 13,
            Kind::NoCapacity => 14,
            Kind::AccountingUnavailable => 15,
            Kind::DatabaseUnavailable => 16,
            Kind::SlurmUnavailable => 17,
        };
        let mut listed = [0; Kind::ALL.len()];
        for k in Kind::ALL {
            listed[number(k)] += 1;
        }
        assert_eq!(listed, [1; Kind::ALL.len()], "ALL lists each kind once");
        let mut names: Vec<&str> = Kind::ALL.iter().map(|k| k.name()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), Kind::ALL.len(), "two kinds share a name");
        let statuses: Vec<u16> = Kind::ALL.iter().map(|k| k.wire().0).collect();
        assert!(
            statuses.windows(2).all(|w| w[0] <= w[1]),
            "ALL in status order"
        );
    }

    #[test]
    fn bodies_carry_the_kind_the_figures_and_retry_after() {
        let e = ApiError::QuotaExceeded {
            account: "physics".into(),
            cap: 4,
            in_use: 3,
        };
        let body = serde_json::to_value(e.body()).unwrap();
        assert_eq!(
            body,
            serde_json::json!({
                "error": "quota_exceeded",
                "message": "account \"physics\" may hold 4 cores at once and holds 3; release a lease or ask for at most 1",
                "account": "physics", "cap": 4, "in_use": 3
            })
        );
        let resp = ApiError::AccountingUnavailable.into_response();
        assert_eq!(resp.status(), 503);
        assert_eq!(resp.headers()[header::RETRY_AFTER], "1");
        assert_eq!(
            ApiError::DatabaseUnavailable.body().details["retry_after_s"],
            1
        );
        let resp = ApiError::Forbidden("no".into()).into_response();
        assert_eq!(resp.status(), 403);
        assert!(resp.headers().get(header::RETRY_AFTER).is_none());
    }
}

//! Every error the API answers, as one JSON shape
//! ([`rfaas_proto::manager::ApiError`]), whatever produced it: a handler,
//! the database, or axum's own rejections (bad JSON, wrong method, unknown
//! route), which [`json_errors`] rewrites.

use axum::body::Body;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use rfaas_proto::manager::ApiError;

use crate::db::DbError;

/// A failed request: status, JSON body, and for `503` a `Retry-After`.
#[derive(Debug)]
pub struct ApiFailure {
    /// HTTP status.
    pub status: u16,
    /// The body.
    pub body: ApiError,
    /// Seconds, for `Retry-After`.
    pub retry_after: Option<u64>,
}

impl ApiFailure {
    /// A failure of `kind` with a message saying what to do.
    pub fn new(status: u16, kind: &str, message: impl Into<String>) -> ApiFailure {
        ApiFailure {
            status,
            body: ApiError {
                error: kind.to_owned(),
                message: message.into(),
                details: serde_json::Map::new(),
            },
            retry_after: None,
        }
    }

    /// Adds a figure to the body.
    pub fn with(mut self, key: &str, value: impl Into<serde_json::Value>) -> ApiFailure {
        self.body.details.insert(key.to_owned(), value.into());
        self
    }

    /// Sets `Retry-After` (also given in the body as `retry_after_s`).
    pub fn retry_after(mut self, secs: u64) -> ApiFailure {
        self.retry_after = Some(secs);
        self.with("retry_after_s", secs)
    }

    /// `404 not_found`.
    pub fn not_found(what: impl Into<String>) -> ApiFailure {
        ApiFailure::new(404, "not_found", what)
    }

    /// `403 forbidden`.
    pub fn forbidden(what: impl Into<String>) -> ApiFailure {
        ApiFailure::new(403, "forbidden", what)
    }

    /// `400 malformed_request`.
    pub fn malformed(what: impl Into<String>) -> ApiFailure {
        ApiFailure::new(400, "malformed_request", what)
    }
}

impl From<DbError> for ApiFailure {
    fn from(e: DbError) -> ApiFailure {
        match e {
            DbError::Unavailable(why) | DbError::Conflict(why) => {
                tracing::warn!(%why, "database unavailable");
                ApiFailure::new(
                    503,
                    "database_unavailable",
                    "the manager's database cannot be reached now; try again shortly",
                )
                .retry_after(1)
            }
            DbError::Other(why) => {
                tracing::error!(%why, "database error");
                ApiFailure::new(
                    500,
                    "internal",
                    "the manager met an internal error; its log says more",
                )
            }
        }
    }
}

impl IntoResponse for ApiFailure {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let mut resp = (status, axum::Json(self.body)).into_response();
        if let Some(secs) = self.retry_after {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        resp
    }
}

/// The kind for an error status that carries no JSON of its own.
fn kind_of(status: StatusCode) -> &'static str {
    match status.as_u16() {
        400 | 422 => "malformed_request",
        401 => "unauthorized",
        403 => "forbidden",
        404 => "not_found",
        405 => "method_not_allowed",
        411 | 413 => "body_too_large",
        415 => "unsupported_media_type",
        500..=599 => "internal",
        _ => "request_refused",
    }
}

/// Rewrites any error response that is not already JSON (axum's
/// rejections are plain text) into an [`ApiError`] with the same status,
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
    let body = ApiError {
        error: kind_of(status).to_owned(),
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

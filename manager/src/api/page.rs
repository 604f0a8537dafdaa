//! Pages of list endpoints: a JSON array of at most `limit` rows, and,
//! when more remain, a `Link: <...>; rel="next"` header (RFC 8288) whose
//! URL carries the same filters and an opaque `after` cursor.

use axum::http::header::LINK;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Serialize;

use crate::error::ApiError;

/// Rows a page holds unless `limit` says otherwise.
pub(super) const DEFAULT_LIMIT: u32 = 1000;
/// The most rows a page holds.
pub(super) const MAX_LIMIT: u32 = 10_000;

/// `limit` as asked, checked: [`DEFAULT_LIMIT`] if absent, at most
/// [`MAX_LIMIT`] (a larger one, which listings took before they came in
/// pages, gets a full page and a link to the next).
pub(super) fn limit(asked: Option<u32>) -> Result<usize, ApiError> {
    match asked.unwrap_or(DEFAULT_LIMIT) {
        0 => Err(ApiError::Malformed(format!(
            "limit is 0; ask for 1 to {MAX_LIMIT} rows a page"
        ))),
        n => Ok(n.min(MAX_LIMIT) as usize),
    }
}

/// A cursor as the client sends it back, read by `parse`; a cursor this
/// manager did not give is refused with the advice to start over.
pub(super) fn cursor<T>(
    after: Option<&str>,
    parse: impl Fn(&str) -> Option<T>,
) -> Result<Option<T>, ApiError> {
    after
        .map(|a| {
            parse(a).ok_or_else(|| {
                ApiError::Malformed(format!(
                    "after is {a:?}, which is not a cursor this API gave; leave it out to start from the first page"
                ))
            })
        })
        .transpose()
}

/// A page of `rows`; `next` is the cursor after its last row when more
/// remain, and `query` the filters and limit to repeat in the next link.
pub(super) fn page<T: Serialize>(
    path: &str,
    rows: Vec<T>,
    next: Option<String>,
    query: &[(&str, String)],
) -> Response {
    let mut resp = Json(rows).into_response();
    if let Some(next) = next {
        let mut url = format!("{path}?after={}", crate::ctl::path_segment(&next));
        for (k, v) in query {
            url.push_str(&format!("&{k}={}", crate::ctl::path_segment(v)));
        }
        if let Ok(v) = format!("<{url}>; rel=\"next\"").parse() {
            resp.headers_mut().insert(LINK, v);
        }
    }
    resp
}

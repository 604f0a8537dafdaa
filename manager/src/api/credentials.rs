//! Credentials (the admin): mint node and user credentials, list and
//! revoke them.

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::Json;
use rfaas_proto::manager::{Credential, CredentialRequest, Role};

use super::check::{check_name, check_node_name};
use super::extract::{Admin, Sent};
use super::{ApiResult, AppState};
use crate::error::{ApiError, Kind, RefusalTable};
use crate::{now_ms, now_s};

/// What each operation here refuses, for the OpenAPI document.
pub(super) const REFUSALS: RefusalTable = &[
    (
        "create_credential",
        &[
            Kind::Malformed,
            Kind::Forbidden,
            Kind::Internal,
            Kind::DatabaseUnavailable,
        ],
    ),
    (
        "list_credentials",
        &[Kind::Forbidden, Kind::DatabaseUnavailable],
    ),
    (
        "revoke_credential",
        &[
            Kind::Malformed,
            Kind::Forbidden,
            Kind::NotFound,
            Kind::DatabaseUnavailable,
        ],
    ),
];

/// Mint a node or user credential (admin). Its token is shown only here.
#[utoipa::path(post, path = "/v1/credentials", request_body = CredentialRequest,
    responses((status = 201, body = Credential)))]
pub(super) async fn create_credential(
    State(app): AppState,
    Sent(Admin, body): Sent<Admin, CredentialRequest>,
) -> ApiResult<(StatusCode, Json<Credential>)> {
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
        return Err(ApiError::Malformed(
            "node credentials have no account".into(),
        ));
    }
    let expires_at = match body.ttl_s {
        Some(0) => return Err(ApiError::Malformed("ttl_s must be above 0".into())),
        Some(t) if t > 100 * 365 * 86_400 => {
            return Err(ApiError::Malformed(
                "ttl_s is over 100 years; leave it out for no expiry".into(),
            ))
        }
        Some(t) => now_s() + t,
        None => 0,
    };
    let (row, token) = app
        .auth
        .mint(body.role, &body.subject, &account, expires_at, None)
        .map_err(|e| ApiError::Internal(format!("no randomness: {e}")))?;
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
    responses((status = 200, body = Vec<Credential>)))]
pub(super) async fn list_credentials(
    State(app): AppState,
    _: Admin,
) -> ApiResult<Json<Vec<Credential>>> {
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
    responses((status = 204, description = "Revoked")))]
pub(super) async fn revoke_credential(
    State(app): AppState,
    Path(id): Path<String>,
    _: Admin,
) -> ApiResult<StatusCode> {
    // Ids are hex (auth::Auth::mint); anything else names none, and
    // must not reach the database (PostgreSQL refuses a NUL in text).
    let well_formed = !id.is_empty() && id.len() <= 64 && id.bytes().all(|b| b.is_ascii_hexdigit());
    if !well_formed || !app.store.revoke_credential(&id).await? {
        return Err(ApiError::NotFound(format!("no credential has id {id:?}")));
    }
    app.auth.forget(&id);
    Ok(StatusCode::NO_CONTENT)
}

//! Who may call a handler, said by its signature: each extractor here
//! authenticates the bearer token ([`crate::auth`]) and refuses, `403
//! forbidden`, a caller of another role.
//!
//! - [`Caller`]: anyone with a credential or the admin token;
//! - [`Admin`]: the admin token;
//! - [`User`]: a user credential;
//! - [`Holder`]: a user credential or the admin token;
//! - [`Node`]: a node credential or the admin token;
//! - [`ThisNode`]: the credential of the node the path names, or the
//!   admin token.
//!
//! [`Sent`] pairs one of them with a JSON body, checking the sender
//! first: the body of a caller who may not send it is never read.

use std::sync::Arc;

use axum::async_trait;
use axum::extract::{FromRequest, FromRequestParts, Path, Request};
use axum::http::request::Parts;
use axum::http::{header, HeaderMap};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::de::DeserializeOwned;

use super::check::check_node_name;
use crate::auth::Caller;
use crate::error::ApiError;
use crate::{now_s, App};

/// Who sent `headers`' `Authorization`.
async fn authenticate(app: &App, headers: &HeaderMap) -> Result<Caller, ApiError> {
    let auth = headers
        .get(header::AUTHORIZATION)
        .map(|v| v.to_str().unwrap_or(""));
    app.auth.caller(&app.store, auth, now_s()).await
}

#[async_trait]
impl FromRequestParts<Arc<App>> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, app: &Arc<App>) -> Result<Self, ApiError> {
        authenticate(app, &parts.headers).await
    }
}

/// The admin token.
#[derive(Debug, Clone, Copy)]
pub struct Admin;

/// A user credential: the user, the account charged, and the Slurm job of
/// a job credential.
#[derive(Debug, Clone)]
pub struct User {
    /// The user.
    pub user: String,
    /// The account charged.
    pub account: String,
    /// The Slurm job, for a job credential.
    pub job_id: Option<u64>,
    /// When the credential expires, Unix seconds (0: never): no lease
    /// asked for with it outlives it.
    pub expires_at: u64,
}

/// A user credential or the admin token: who may hold, and list, leases.
#[derive(Debug, Clone)]
pub struct Holder {
    /// The user's subject; `None` for the admin, who sees every lease.
    pub owner: Option<String>,
}

/// A node credential (an executor daemon, for a job it runs) or the admin
/// token.
#[derive(Debug, Clone)]
pub struct Node {
    /// Who, for logs.
    pub subject: String,
    /// The node's name; `None` for the admin.
    pub name: Option<String>,
}

/// The credential of the node the path names (`{name}`), or the admin
/// token. The name is checked against the node name pattern once the
/// token is known good.
#[derive(Debug, Clone)]
pub struct ThisNode {
    /// The id of the node's credential; `None` for the admin.
    pub credential_id: Option<String>,
}

/// A caller of one role, or the refusal of any other.
trait Role: Sized {
    fn admit(caller: Caller) -> Result<Self, ApiError>;
}

impl Role for Admin {
    fn admit(caller: Caller) -> Result<Self, ApiError> {
        match caller {
            Caller::Admin => Ok(Admin),
            _ => Err(ApiError::Forbidden(
                "this needs the admin token (rfaasctl reads it from its file)".into(),
            )),
        }
    }
}

impl Role for User {
    fn admit(caller: Caller) -> Result<Self, ApiError> {
        match caller {
            Caller::User {
                user,
                account,
                job_id,
                expires_at,
            } => Ok(User {
                user,
                account,
                job_id,
                expires_at,
            }),
            _ => Err(ApiError::Forbidden(
                "leases are asked for with a user credential (rfaasctl credential user ...)".into(),
            )),
        }
    }
}

impl User {
    /// Who, for logs and lease ownership (as [`Caller::subject`]).
    pub fn subject(&self) -> String {
        format!("user:{}", self.user)
    }
}

/// `expires_at`, cut to the expiry of the credential asking
/// (`credential_expires_at`, 0: never): a lease never outlives the
/// credential that asked for it.
pub fn within_credential(expires_at: u64, credential_expires_at: u64) -> u64 {
    match credential_expires_at {
        0 => expires_at,
        c => expires_at.min(c),
    }
}

impl Role for Holder {
    fn admit(caller: Caller) -> Result<Self, ApiError> {
        match caller {
            Caller::Admin => Ok(Holder { owner: None }),
            Caller::User { .. } => Ok(Holder {
                owner: Some(caller.subject()),
            }),
            Caller::Node { .. } => Err(ApiError::Forbidden("nodes do not list leases".into())),
        }
    }
}

impl Role for Node {
    fn admit(caller: Caller) -> Result<Self, ApiError> {
        match caller {
            Caller::Admin => Ok(Node {
                subject: caller.subject(),
                name: None,
            }),
            Caller::Node { node: ref n, .. } => Ok(Node {
                subject: caller.subject(),
                name: Some(n.clone()),
            }),
            Caller::User { .. } => Err(ApiError::Forbidden(
                "job credentials are asked for by a node's executor daemon (node credential), for a job it runs".into(),
            )),
        }
    }
}

macro_rules! extract_role {
    ($($role:ty),*) => {$(
        #[async_trait]
        impl FromRequestParts<Arc<App>> for $role {
            type Rejection = ApiError;

            async fn from_request_parts(
                parts: &mut Parts,
                app: &Arc<App>,
            ) -> Result<Self, ApiError> {
                <$role as Role>::admit(authenticate(app, &parts.headers).await?)
            }
        }
    )*};
}

extract_role!(Admin, User, Holder, Node);

#[async_trait]
impl FromRequestParts<Arc<App>> for ThisNode {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, app: &Arc<App>) -> Result<Self, ApiError> {
        let caller = authenticate(app, &parts.headers).await?;
        let Path(name) = Path::<String>::from_request_parts(parts, app)
            .await
            .map_err(|e| ApiError::Malformed(e.body_text()))?;
        check_node_name(&name)?;
        match caller {
            Caller::Admin => Ok(ThisNode {
                credential_id: None,
            }),
            Caller::Node {
                node,
                credential_id,
            } if node == name => Ok(ThisNode {
                credential_id: Some(credential_id),
            }),
            Caller::Node { node: n, .. } => Err(ApiError::Forbidden(format!(
                "this credential is node {n:?}'s; it cannot speak for node {name:?}"
            ))),
            Caller::User { .. } => Err(ApiError::Forbidden(
                "registering and heartbeating need a node credential".into(),
            )),
        }
    }
}

/// A JSON body of `T` sent by a `W` ([`Admin`], [`User`], ...). The
/// sender is checked first, and the body is read only once the sender may
/// send it: a stranger's body, however large or malformed, is never read
/// (nor waited for).
#[derive(Debug)]
pub struct Sent<W, T>(pub W, pub T);

#[async_trait]
impl<W, T> FromRequest<Arc<App>> for Sent<W, T>
where
    W: FromRequestParts<Arc<App>, Rejection = ApiError> + Send,
    T: DeserializeOwned + Send,
{
    type Rejection = Response;

    async fn from_request(req: Request, app: &Arc<App>) -> Result<Self, Response> {
        let (mut parts, body) = req.into_parts();
        let who = W::from_request_parts(&mut parts, app)
            .await
            .map_err(IntoResponse::into_response)?;
        let Json(body) = Json::<T>::from_request(Request::from_parts(parts, body), app)
            .await
            .map_err(IntoResponse::into_response)?;
        Ok(Sent(who, body))
    }
}

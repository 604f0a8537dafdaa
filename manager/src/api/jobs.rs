//! Slurm jobs (a node's executor daemon, or the admin): a job's own user
//! credential, and its end. What a node may do for a job is Slurm's word,
//! not the node's ([`crate::slurm`]): a credential only for a job Slurm
//! runs on that node, for the user and account Slurm has for it; an end
//! only for a job Slurm placed on it. The admin speaks for any node.

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::Json;
use rfaas_proto::manager::{slurm_job_account, Credential, JobCredentialRequest, JobEnded, Role};

use super::check::check_name;
use super::extract::{Node, Sent};
use super::{ApiResult, AppState};
use crate::db::retrying;
use crate::error::{ApiError, Kind, RefusalTable};
use crate::slurm::SlurmJob;
use crate::{now_ms, now_s, App};

/// What each operation here refuses, for the OpenAPI document.
pub(super) const REFUSALS: RefusalTable = &[
    (
        "job_credential",
        &[
            Kind::Malformed,
            Kind::Forbidden,
            Kind::Internal,
            Kind::DatabaseUnavailable,
            Kind::SlurmUnavailable,
        ],
    ),
    (
        "end_job",
        &[
            Kind::Malformed,
            Kind::Forbidden,
            Kind::DatabaseUnavailable,
            Kind::SlurmUnavailable,
        ],
    ),
];

/// Refuses job 0: Slurm's job ids start at 1.
fn check_job_id(job_id: u64) -> ApiResult<()> {
    if job_id == 0 {
        return Err(ApiError::Malformed(
            "Slurm job ids start at 1; job 0 names no job".into(),
        ));
    }
    Ok(())
}

/// Job `job_id` as Slurm reports it; a job Slurm does not know is
/// refused.
async fn slurm_job(app: &App, job_id: u64) -> ApiResult<SlurmJob> {
    app.slurm
        .job(job_id)
        .await
        .map_err(|e| ApiError::SlurmUnavailable(e.to_string()))?
        .ok_or_else(|| {
            ApiError::Forbidden(format!(
                "Slurm knows no job {job_id}: it was never submitted, or ended longer ago than Slurm keeps jobs (MinJobAge)"
            ))
        })
}

/// Refuses a node Slurm did not place job `job_id` on.
fn check_on_node(job_id: u64, job: &SlurmJob, node: &Node) -> ApiResult<()> {
    match &node.name {
        Some(name) if !job.on(name) => Err(ApiError::Forbidden(format!(
            "Slurm placed job {job_id} on {:?}, not on node {name:?}: a node speaks only for its own jobs",
            job.nodes
        ))),
        _ => Ok(()),
    }
}

/// Refuses a job credential Slurm's word on job `job_id` does not back:
/// the job must run, on the calling node, as the user (and uid, and
/// account) asked for. Returns the job as Slurm has it.
async fn check_with_slurm(
    app: &App,
    job_id: u64,
    node: &Node,
    body: &JobCredentialRequest,
) -> ApiResult<SlurmJob> {
    let job = slurm_job(app, job_id).await?;
    if !job.running() {
        return Err(ApiError::Forbidden(format!(
            "Slurm reports job {job_id} {}, not running: credentials are only for running jobs",
            job.state
        )));
    }
    check_on_node(job_id, &job, node)?;
    let user = &body.user;
    let account = body.account.as_deref().unwrap_or(&job.account);
    if job.user != *user || job.account != account {
        return Err(ApiError::Forbidden(format!(
            "Slurm runs job {job_id} as user {:?} in account {:?}, not as user {user:?} in account {account:?}: a job credential is for the job's own user and account",
            job.user, job.account
        )));
    }
    if let Some(uid) = body.uid.filter(|uid| *uid != job.uid) {
        return Err(ApiError::Forbidden(format!(
            "Slurm runs job {job_id} as uid {}, not as uid {uid}: a job credential is for the job's own user",
            job.uid
        )));
    }
    Ok(job)
}

/// Mint a user credential for a Slurm job (node or admin): what a job
/// started with `--rfaas` finds in its environment. Only for a job Slurm
/// reports running on the calling node, as the user (and uid, and
/// account, when given) Slurm has for it (`403` otherwise; `503
/// slurm_unavailable` when Slurm cannot be asked). It is charged to the
/// job's account and expires with the job's time limit, as Slurm reports
/// them unless the request names them (at most `max_job_credential_s`
/// from now); leases asked for with it name the job, and the job's end
/// revokes it.
#[utoipa::path(post, path = "/v1/jobs/{job_id}/credential",
    params(("job_id" = u64, Path, description = "The Slurm job", minimum = 1)),
    request_body = JobCredentialRequest,
    responses((status = 201, body = Credential)))]
pub(super) async fn job_credential(
    State(app): AppState,
    Path(job_id): Path<u64>,
    Sent(node, body): Sent<Node, JobCredentialRequest>,
) -> ApiResult<(StatusCode, Json<Credential>)> {
    check_job_id(job_id)?;
    check_name("user", &body.user)?;
    if let Some(account) = &body.account {
        check_name("account", account)?;
    }
    let now = now_s();
    if let Some(expires_at) = body.expires_at.filter(|at| *at <= now) {
        return Err(ApiError::Malformed(format!(
            "expires_at {expires_at} is not in the future (now {now}): the job's time is up"
        )));
    }
    let (account, ends_at) = if app.slurm.unchecked() {
        let account = body
            .account
            .clone()
            .unwrap_or_else(|| slurm_job_account("", &body.user));
        (account, body.expires_at)
    } else {
        let job = check_with_slurm(&app, job_id, &node, &body).await?;
        (job.account, body.expires_at.or(job.ends_at))
    };
    let cap = now.saturating_add(app.settings.max_job_credential_s);
    // Slurm's limit may have passed while a job runs over it (OverTimeLimit):
    // a second is left to it, as Slurm ends it anyway.
    let expires_at = ends_at.map_or(cap, |at| at.max(now + 1).min(cap));
    let (row, token) = app
        .auth
        .mint(Role::User, &body.user, &account, expires_at, Some(job_id))
        .map_err(|e| ApiError::Internal(format!("no randomness: {e}")))?;
    app.store.add_credential(&row, now_ms()).await?;
    tracing::info!(id = %row.id, job_id, user = %row.subject, account = %row.account, expires_at, by = %node.subject, "job credential minted");
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
/// changes anything. A node may end only a job Slurm placed on it.
#[utoipa::path(post, path = "/v1/jobs/{job_id}/end",
    params(("job_id" = u64, Path, description = "The Slurm job", minimum = 1)),
    responses((status = 200, body = JobEnded)))]
pub(super) async fn end_job(
    State(app): AppState,
    Path(job_id): Path<u64>,
    node: Node,
) -> ApiResult<Json<JobEnded>> {
    check_job_id(job_id)?;
    if node.name.is_some() && !app.slurm.unchecked() {
        check_on_node(job_id, &slurm_job(&app, job_id).await?, &node)?;
    }
    let (revoked, ended) = retrying(|| app.store.end_job(job_id, now_ms())).await?;
    // A running state cached from before must not mint a credential the
    // end already passed; the job's other nodes' ends are checked against
    // the nodes kept.
    app.slurm.ended(job_id);
    for id in &revoked {
        app.auth.forget(id);
    }
    if !revoked.is_empty() || !ended.is_empty() {
        tracing::info!(job_id, credentials = revoked.len(), leases = ended.len(), by = %node.subject, "Slurm job ended");
    }
    Ok(Json(JobEnded {
        revoked: revoked.len() as u64,
        released: ended.len() as u64,
    }))
}

//! Slurm jobs' credentials: what a job started with `--rfaas` finds in its
//! environment, and the end of those credentials with the job.
//!
//! The SPANK plugin asks on the local socket (root only) as a job step
//! starts ([`LocalRequest::SlurmJobEnv`]), with the job's id and uid as
//! slurmstepd gives them. The daemon does not ask Slurm: it names the
//! uid's user from the node's users database and asks a manager, with the
//! node's credential, for a user credential scoped to the job (`POST
//! /v1/jobs/{job_id}/credential`). The manager checks with Slurm that the
//! job runs on this node as that uid and user (one `squeue` per job per
//! replica, whichever of the job's nodes ask) and takes the job's account
//! and time limit from Slurm's answer. The credential is kept until the
//! job ends here, so the job's later steps get the same one without
//! asking again. At the job's end (the epilog's offer) the daemon tells a
//! manager (`POST /v1/jobs/{job_id}/end`), which revokes the job's
//! credentials and releases its leases; it keeps trying for
//! [`END_RETRY_FOR`] while no manager answers (after that the credential
//! still expires with the job's time limit).
//!
//! [`LocalRequest::SlurmJobEnv`]: rfaas_proto::control::local::LocalRequest::SlurmJobEnv

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rfaas_proto::control::local::LocalReply;
use rfaas_proto::control::ErrorCode;
use rfaas_proto::manager::{Credential, JobCredentialRequest, JobEnded};

pub(crate) mod store;

use super::clock::unix_now;
use super::register::{Backoff, CallError, Managers};
use super::shared::Shared;
use super::users;
use store::Held;

/// The bound on each request to a manager for a job (within the plugin's
/// own bound, 2 s by default).
const MANAGER_TIMEOUT: Duration = Duration::from_millis(1500);

/// How long the daemon keeps telling the managers that a job ended.
pub(crate) const END_RETRY_FOR: Duration = Duration::from_secs(300);

/// Most job credentials kept at once (jobs whose end this node has not
/// seen); the ones expiring first go first.
const KEPT: usize = 4096;

pub(crate) use rfaas_proto::control::local::{CREDENTIAL_VAR, MANAGERS_VAR};

/// Why a job gets no credential.
#[derive(Debug, thiserror::Error)]
pub(crate) enum JobError {
    #[error("this executor has no [manager] configured: it cannot get job credentials")]
    NoManager,
    #[error("Slurm job ids start at 1; the plugin could not tell the job")]
    NoJob,
    #[error("Slurm job {job_id} is user {actual}'s, not uid {asked}'s")]
    WrongUser {
        job_id: u64,
        asked: u32,
        actual: u32,
    },
    #[error("no user of this node's users database has uid {uid} (job {job_id}); check NSS (getent passwd {uid})")]
    NoUser { job_id: u64, uid: u32 },
    #[error("cannot look up uid {uid} in this node's users database (job {job_id}): {why}")]
    Users { job_id: u64, uid: u32, why: String },
    #[error("the manager refused a credential for job {job_id}: {why}")]
    Refused { job_id: u64, why: String },
    #[error("no manager minted a credential for job {job_id}: {why}")]
    Manager { job_id: u64, why: String },
}

impl JobError {
    /// The code the plugin sees.
    pub(crate) fn code(&self) -> ErrorCode {
        match self {
            JobError::NoJob => ErrorCode::MalformedRequest,
            JobError::WrongUser { .. } | JobError::NoUser { .. } | JobError::Refused { .. } => {
                ErrorCode::UserRefused
            }
            JobError::NoManager | JobError::Users { .. } | JobError::Manager { .. } => {
                ErrorCode::Internal
            }
        }
    }
}

/// The environment for job `job_id`'s step of user `uid`: from what this
/// node handed out before, else a new credential.
pub(crate) fn job_env(shared: &Shared, job_id: u64, uid: u32) -> Result<LocalReply, JobError> {
    let (Some(m), Some(node_credential)) = (&shared.settings.manager, &shared.jobs.node_credential)
    else {
        return Err(JobError::NoManager);
    };
    if job_id == 0 {
        return Err(JobError::NoJob);
    }
    let now = unix_now();
    if let Some(h) = shared.jobs.lock().get(&job_id) {
        if h.uid != uid {
            return Err(JobError::WrongUser {
                job_id,
                asked: uid,
                actual: h.uid,
            });
        }
        if h.expires_at > now {
            return Ok(LocalReply::JobEnv {
                vars: h.vars.clone(),
                expires_at: h.expires_at,
            });
        }
    }
    let user = match users::by_uid(uid) {
        Ok(Some(u)) => u.name,
        Ok(None) => return Err(JobError::NoUser { job_id, uid }),
        Err(e) => {
            return Err(JobError::Users {
                job_id,
                uid,
                why: e.to_string(),
            })
        }
    };
    // The account and the time limit are Slurm's, which the manager asks.
    let body = JobCredentialRequest {
        user,
        uid: Some(uid),
        account: None,
        expires_at: None,
    };
    let mut managers = Managers::with_timeout(m, node_credential.clone(), MANAGER_TIMEOUT);
    let c: Credential = managers
        .call(false, &format!("/v1/jobs/{job_id}/credential"), &body)
        .map_err(|e| match e {
            CallError::Rejected { .. } => JobError::Refused {
                job_id,
                why: e.to_string(),
            },
            CallError::Unreachable(_) => JobError::Manager {
                job_id,
                why: e.to_string(),
            },
        })?;
    let (Some(token), Some(expires_at)) = (c.token, c.expires_at) else {
        return Err(JobError::Manager {
            job_id,
            why: "the answer held no token".into(),
        });
    };
    let mut vars: BTreeMap<String, String> = [
        (MANAGERS_VAR.to_owned(), m.urls.join(",")),
        (CREDENTIAL_VAR.to_owned(), token),
    ]
    .into();
    // The job checks the managers' certificates as this node does.
    if let Some(ca) = &m.ca_file {
        vars.insert(rfaas_tls::CA_FILE_ENV.to_owned(), ca.display().to_string());
    }
    let mut held = shared.jobs.lock();
    if held.len() >= KEPT {
        if let Some(first) = held
            .iter()
            .min_by_key(|(_, h)| h.expires_at)
            .map(|(id, _)| *id)
        {
            held.remove(&first);
        }
    }
    held.insert(
        job_id,
        Held {
            uid,
            vars: vars.clone(),
            expires_at,
        },
    );
    tracing::info!(job_id, uid, user = %body.user, account = ?c.account, expires_at, credential = %c.id, "job credential minted");
    Ok(LocalReply::JobEnv { vars, expires_at })
}

/// Job `job_id` ended on this node: forget its credential and tell the
/// managers, on a thread of its own (retrying for [`END_RETRY_FOR`]), so
/// the epilog does not wait for them.
pub(crate) fn job_ended(shared: &Arc<Shared>, job_id: u64) {
    let had = shared.jobs.lock().remove(&job_id).is_some();
    let (Some(m), Some(credential)) = (
        shared.settings.manager.clone(),
        shared.jobs.node_credential.clone(),
    ) else {
        return;
    };
    if job_id == 0 {
        return;
    }
    let shared = Arc::clone(shared);
    let spawned = std::thread::Builder::new()
        .name("job-end".into())
        .spawn(move || {
            let mut managers = Managers::with_timeout(&m, credential, MANAGER_TIMEOUT);
            let mut backoff = Backoff::new(200, m.max_backoff_ms.min(10_000));
            let until = Instant::now() + END_RETRY_FOR;
            loop {
                let path = format!("/v1/jobs/{job_id}/end");
                match managers.call::<_, JobEnded>(false, &path, &serde_json::json!({})) {
                    Ok(e) => {
                        if had || e.revoked > 0 || e.released > 0 {
                            tracing::info!(job_id, revoked = e.revoked, released = e.released, "told the manager the Slurm job ended");
                        }
                        return;
                    }
                    Err(e @ CallError::Rejected { .. }) => {
                        tracing::warn!(job_id, error = %e, "the manager refused the Slurm job's end");
                        return;
                    }
                    Err(e) => {
                        if Instant::now() >= until {
                            tracing::warn!(job_id, error = %e, "gave up telling a manager the Slurm job ended; its credential expires with its time limit");
                            return;
                        }
                    }
                }
                let st = shared.lock();
                if shared
                    .wait_until(st, backoff.next(|n| fastrand::u64(0..=n)), |st| st.stopping)
                    .1
                {
                    return;
                }
            }
        });
    if let Err(e) = spawned {
        tracing::warn!(job_id, error = %e, "cannot start a thread to tell the manager the Slurm job ended");
    }
}

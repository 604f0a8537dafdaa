//! Slurm jobs' credentials: what a job started with `--rfaas` finds in its
//! environment, and the end of those credentials with the job.
//!
//! The SPANK plugin asks on the local socket (root only) as a job step
//! starts ([`LocalRequest::SlurmJobEnv`]). The daemon checks with Slurm
//! (`squeue`, next to `[slurm] scontrol`) that the job runs on this node
//! for that user, takes its user,
//! account and time left, and asks a manager, with the node's credential,
//! for a user credential scoped to the job (`POST
//! /v1/jobs/{job_id}/credential`). The credential is kept until the job
//! ends here, so the job's later steps get the same one without asking
//! again. At the job's end (the epilog's offer) the daemon tells a manager
//! (`POST /v1/jobs/{job_id}/end`), which revokes the job's credentials and
//! releases its leases; it keeps trying for [`END_RETRY_FOR`] while no
//! manager answers (after that the credential still expires with the
//! job's time limit).
//!
//! [`LocalRequest::SlurmJobEnv`]: rfaas_proto::control::local::LocalRequest::SlurmJobEnv

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rfaas_proto::control::local::LocalReply;
use rfaas_proto::control::ErrorCode;
use rfaas_proto::manager::{slurm_job_account, Credential, JobCredentialRequest, JobEnded};

pub(crate) mod store;

use super::clock::unix_now;
use super::register::{Backoff, CallError, Managers};
use super::shared::Shared;
use super::slurm::scontrol::run_bounded;
use store::Held;

/// The least bound on asking Slurm about a job.
pub(crate) const SLURM_TIMEOUT: Duration = Duration::from_millis(1500);

/// The bound on each request to a manager for a job.
const MANAGER_TIMEOUT: Duration = Duration::from_millis(1500);

/// How long the daemon keeps telling the managers that a job ended.
pub(crate) const END_RETRY_FOR: Duration = Duration::from_secs(300);

/// Most job credentials kept at once (jobs whose end this node has not
/// seen); the ones expiring first go first.
const KEPT: usize = 4096;

pub(crate) use rfaas_proto::control::local::{CREDENTIAL_VAR, MANAGERS_VAR};

/// A job as `squeue` shows it on this node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SlurmJob {
    pub uid: u32,
    pub user: String,
    /// The account it is charged to ([`slurm_job_account`]).
    pub account: String,
    /// Seconds until its time limit; `None`: no limit.
    pub time_left_s: Option<u64>,
    pub state: String,
}

/// Why a job gets no credential.
#[derive(Debug, thiserror::Error)]
pub(crate) enum JobError {
    #[error("this executor has no [manager] configured: it cannot get job credentials")]
    NoManager,
    #[error("Slurm job ids start at 1; the plugin could not tell the job")]
    NoJob,
    #[error("cannot ask Slurm about job {job_id}: {why}")]
    Slurm { job_id: u64, why: String },
    #[error("Slurm runs no job {job_id} on node {node} (or it has ended)")]
    NotHere { job_id: u64, node: String },
    #[error("Slurm job {job_id} is user {actual}'s, not uid {asked}'s")]
    WrongUser {
        job_id: u64,
        asked: u32,
        actual: u32,
    },
    #[error("Slurm job {job_id} is {state}, not running")]
    NotRunning { job_id: u64, state: String },
    #[error("no manager minted a credential for job {job_id}: {why}")]
    Manager { job_id: u64, why: String },
}

impl JobError {
    /// The code the plugin sees.
    pub(crate) fn code(&self) -> ErrorCode {
        match self {
            JobError::NoJob => ErrorCode::MalformedRequest,
            JobError::NotHere { .. } | JobError::WrongUser { .. } | JobError::NotRunning { .. } => {
                ErrorCode::UserRefused
            }
            JobError::NoManager | JobError::Slurm { .. } | JobError::Manager { .. } => {
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
    let squeue = Squeue::of(shared);
    let job = squeue.job(job_id)?.ok_or_else(|| JobError::NotHere {
        job_id,
        node: squeue.node.clone(),
    })?;
    if job.uid != uid {
        return Err(JobError::WrongUser {
            job_id,
            asked: uid,
            actual: job.uid,
        });
    }
    if !matches!(job.state.as_str(), "RUNNING" | "CONFIGURING") {
        return Err(JobError::NotRunning {
            job_id,
            state: job.state,
        });
    }
    // No time limit: the manager caps it (max_job_credential_s).
    let expires_at = now + job.time_left_s.unwrap_or(100 * 365 * 86_400).max(1);
    let body = JobCredentialRequest {
        account: job.account,
        user: job.user,
        expires_at,
    };
    let mut managers = Managers::with_timeout(m, node_credential.clone(), MANAGER_TIMEOUT);
    let c: Credential = managers
        .call(false, &format!("/v1/jobs/{job_id}/credential"), &body)
        .map_err(|e| JobError::Manager {
            job_id,
            why: e.to_string(),
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
    tracing::info!(job_id, uid, account = %body.account, expires_at, credential = %c.id, "job credential minted");
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

/// How to run `squeue`: next to `[slurm] scontrol`, with its `SLURM_CONF`
/// and bound; without `[slurm]`, from `PATH`, for the node `node_name`.
struct Squeue {
    program: PathBuf,
    conf: Option<PathBuf>,
    node: String,
    timeout: Duration,
}

impl Squeue {
    fn of(shared: &Shared) -> Squeue {
        match &shared.settings.slurm {
            Some(s) => Squeue {
                program: s.scontrol.with_file_name("squeue"),
                conf: s.conf.clone(),
                node: s.node.clone(),
                timeout: Duration::from_millis(s.timeout_ms).max(SLURM_TIMEOUT),
            },
            None => Squeue {
                program: PathBuf::from("squeue"),
                conf: None,
                node: shared.settings.node_name.clone(),
                timeout: SLURM_TIMEOUT,
            },
        }
    }

    /// Job `job_id` on this node; `None`: Slurm does not run it here.
    /// Only fixed fields are asked for, never the job's own text (its
    /// name, its comment), which its user could make look like fields.
    fn job(&self, job_id: u64) -> Result<Option<SlurmJob>, JobError> {
        let slurm = |why: String| JobError::Slurm { job_id, why };
        let mut cmd = Command::new(&self.program);
        cmd.args([
            "--noheader",
            "--jobs",
            &job_id.to_string(),
            "--nodelist",
            &self.node,
            "--format",
            "%U|%u|%a|%L|%T",
        ]);
        if let Some(conf) = &self.conf {
            cmd.env("SLURM_CONF", conf);
        }
        let (status, out, err) =
            run_bounded(cmd, &self.program, self.timeout).map_err(|e| slurm(e.to_string()))?;
        if !status.success() {
            // A job Slurm no longer knows: not here.
            if err.contains("Invalid job id") {
                return Ok(None);
            }
            return Err(slurm(format!(
                "{} failed ({status}): {}",
                self.program.display(),
                err.trim()
            )));
        }
        parse_squeue(&out).map_err(slurm)
    }
}

/// `uid|user|account|time left|state`, one line; empty: no such job here.
fn parse_squeue(out: &str) -> Result<Option<SlurmJob>, String> {
    let Some(line) = out.lines().map(str::trim).find(|l| !l.is_empty()) else {
        return Ok(None);
    };
    let f: Vec<&str> = line.split('|').collect();
    let [uid, user, account, left, state] = f[..] else {
        return Err(format!("unexpected squeue line {line:?}"));
    };
    let uid = uid
        .parse()
        .map_err(|_| format!("unexpected uid in squeue line {line:?}"))?;
    Ok(Some(SlurmJob {
        uid,
        user: user.to_owned(),
        account: slurm_job_account(account, user),
        time_left_s: parse_time_left(left)
            .ok_or_else(|| format!("unexpected time left {left:?} in squeue line {line:?}"))?,
        state: state.to_owned(),
    }))
}

/// Slurm's time left: `[days-][hours:]minutes:seconds`, or `UNLIMITED` /
/// `NOT_SET` (no limit: `Some(None)`). `None`: unreadable.
fn parse_time_left(s: &str) -> Option<Option<u64>> {
    if matches!(s, "UNLIMITED" | "NOT_SET" | "INVALID") {
        return Some(None);
    }
    let (days, rest) = match s.split_once('-') {
        Some((d, r)) => (d.parse::<u64>().ok()?, r),
        None => (0, s),
    };
    let parts: Vec<u64> = rest
        .split(':')
        .map(|p| p.parse::<u64>().ok())
        .collect::<Option<_>>()?;
    let (h, m, sec) = match parts[..] {
        [m, s] => (0, m, s),
        [h, m, s] => (h, m, s),
        _ => return None,
    };
    Some(Some(days * 86_400 + h * 3600 + m * 60 + sec))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn time_left_in_slurm_formats() {
        assert_eq!(parse_time_left("59:30"), Some(Some(3570)));
        assert_eq!(parse_time_left("1:00:00"), Some(Some(3600)));
        assert_eq!(
            parse_time_left("2-03:00:01"),
            Some(Some(2 * 86_400 + 3 * 3600 + 1))
        );
        assert_eq!(parse_time_left("UNLIMITED"), Some(None));
        assert_eq!(parse_time_left("NOT_SET"), Some(None));
        assert_eq!(parse_time_left("soon"), None);
        assert_eq!(parse_time_left("1:2:3:4"), None);
    }

    #[test]
    fn squeue_lines() {
        assert_eq!(parse_squeue("").unwrap(), None);
        assert_eq!(
            parse_squeue("1000|alice|physics|59:00|RUNNING\n").unwrap(),
            Some(SlurmJob {
                uid: 1000,
                user: "alice".into(),
                account: "physics".into(),
                time_left_s: Some(3540),
                state: "RUNNING".into(),
            })
        );
        let j = parse_squeue("0|root|(null)|UNLIMITED|CONFIGURING")
            .unwrap()
            .unwrap();
        assert_eq!((j.account.as_str(), j.time_left_s), ("root", None));
        assert!(parse_squeue("1000|alice|RUNNING").is_err());
        assert!(parse_squeue("x|alice|a|1:00|RUNNING").is_err());
    }
}

//! Slurm's word on a job: who runs it, charged to which account, in which
//! state, on which nodes. A node's credential only says which node is
//! calling; what it may do for a job ([`crate::api`]'s job routes) is
//! decided from what Slurm itself reports, asked with `squeue` (the
//! `[slurm]` table of `manager.toml`).
//!
//! Answers are cached for `cache_ms` (every node of a job asks once per
//! step), a few `squeue` run at once at most, each bounded by
//! `timeout_ms`, and a Slurm that cannot be asked refuses: nothing is
//! granted on a node's word alone, unless the admin turned the checks off
//! (`[slurm] unchecked = true`, for sites without Slurm and for tests).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use rfaas_proto::hostlist::hostlist_contains;
use rfaas_proto::manager::slurm_job_account;
use tokio::sync::Semaphore;

/// Cached answers kept at most; expired ones go first when it is full.
const CACHED: usize = 4096;

/// `squeue` processes run at once at most.
const AT_ONCE: usize = 4;

/// How the manager asks Slurm (`[slurm]` in `manager.toml`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlurmSettings {
    /// The `squeue` program.
    pub squeue: PathBuf,
    /// `SLURM_CONF` for it; `None`: Slurm's own default.
    pub conf: Option<PathBuf>,
    /// How long an answer is reused, ms.
    pub cache_ms: u64,
    /// The bound on one `squeue`, ms.
    pub timeout_ms: u64,
    /// Unsafe: take a node's word for its jobs without asking Slurm.
    pub unchecked: bool,
}

impl Default for SlurmSettings {
    fn default() -> Self {
        SlurmSettings {
            squeue: PathBuf::from("squeue"),
            conf: None,
            cache_ms: 2000,
            timeout_ms: 5000,
            unchecked: false,
        }
    }
}

/// A job as Slurm reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlurmJob {
    /// Its user's uid.
    pub uid: u32,
    /// Its user's login name.
    pub user: String,
    /// The account it is charged to ([`slurm_job_account`]).
    pub account: String,
    /// Slurm's state (`RUNNING`, `COMPLETED`, ...).
    pub state: String,
    /// Its nodes, as a Slurm host list (`node[1-3]`).
    pub nodes: String,
}

impl SlurmJob {
    /// Whether it runs now (its steps may start).
    pub fn running(&self) -> bool {
        matches!(self.state.as_str(), "RUNNING" | "CONFIGURING")
    }

    /// Whether Slurm placed it on `node` (a host list it cannot read
    /// places it nowhere).
    pub fn on(&self, node: &str) -> bool {
        hostlist_contains(&self.nodes, node) == Some(true)
    }
}

/// Why Slurm could not be asked.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("cannot ask Slurm about job {job_id} with {program}: {why}")]
pub struct SlurmUnavailable {
    /// The job asked about.
    pub job_id: u64,
    /// The program run.
    pub program: String,
    /// What failed.
    pub why: String,
}

/// Asks Slurm about jobs, with a short cache.
#[derive(Debug)]
pub struct Slurm {
    settings: SlurmSettings,
    cache: Mutex<HashMap<u64, (Instant, Option<SlurmJob>)>>,
    running: Semaphore,
}

impl Slurm {
    /// Asks as `settings` say.
    pub fn new(settings: SlurmSettings) -> Slurm {
        Slurm {
            settings,
            cache: Mutex::new(HashMap::new()),
            running: Semaphore::new(AT_ONCE),
        }
    }

    /// Whether the admin turned the checks off.
    pub fn unchecked(&self) -> bool {
        self.settings.unchecked
    }

    /// Job `job_id` as Slurm reports it, in any state it still keeps;
    /// `None`: Slurm knows no such job (never submitted, or ended longer
    /// ago than its `MinJobAge`).
    pub async fn job(&self, job_id: u64) -> Result<Option<SlurmJob>, SlurmUnavailable> {
        let ttl = Duration::from_millis(self.settings.cache_ms);
        if let Some((at, job)) = self.lock().get(&job_id) {
            if at.elapsed() < ttl {
                return Ok(job.clone());
            }
        }
        let job = self.ask(job_id).await?;
        let mut cache = self.lock();
        if cache.len() >= CACHED {
            cache.retain(|_, (at, _)| at.elapsed() < ttl);
            if cache.len() >= CACHED {
                cache.clear();
            }
        }
        cache.insert(job_id, (Instant::now(), job.clone()));
        Ok(job)
    }

    /// Forgets what Slurm said about job `job_id` (its end was recorded:
    /// the next question about it goes to Slurm).
    pub fn forget(&self, job_id: u64) {
        self.lock().remove(&job_id);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, (Instant, Option<SlurmJob>)>> {
        self.cache.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs `squeue` for `job_id`. Only fixed fields are asked for, the
    /// account (free text where Slurm keeps no accounts) last, never the
    /// job's name or comment.
    async fn ask(&self, job_id: u64) -> Result<Option<SlurmJob>, SlurmUnavailable> {
        let s = &self.settings;
        let unavailable = |why: String| SlurmUnavailable {
            job_id,
            program: s.squeue.display().to_string(),
            why,
        };
        let _turn = self
            .running
            .acquire()
            .await
            .map_err(|e| unavailable(e.to_string()))?;
        let mut cmd = tokio::process::Command::new(&s.squeue);
        cmd.args([
            "--noheader",
            "--states=all",
            "--jobs",
            &job_id.to_string(),
            "--format",
            "%U|%u|%T|%N|%a",
        ])
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true);
        if let Some(conf) = &s.conf {
            cmd.env("SLURM_CONF", conf);
        }
        let out = tokio::time::timeout(Duration::from_millis(s.timeout_ms), cmd.output())
            .await
            .map_err(|_| unavailable(format!("no answer within {} ms", s.timeout_ms)))?
            .map_err(|e| unavailable(e.to_string()))?;
        let stderr = String::from_utf8_lossy(&out.stderr);
        if !out.status.success() {
            if stderr.contains("Invalid job id") {
                return Ok(None);
            }
            return Err(unavailable(format!(
                "it failed ({}): {}",
                out.status,
                stderr.trim()
            )));
        }
        parse_squeue(&String::from_utf8_lossy(&out.stdout)).map_err(unavailable)
    }
}

/// `uid|user|state|nodes|account`, one line; nothing: no such job.
fn parse_squeue(out: &str) -> Result<Option<SlurmJob>, String> {
    let mut lines = out.lines().filter(|l| !l.trim().is_empty());
    let Some(line) = lines.next() else {
        return Ok(None);
    };
    if lines.next().is_some() {
        return Err(format!("more than one line for one job: {out:?}"));
    }
    let line = line.trim_end();
    let f: Vec<&str> = line.splitn(5, '|').collect();
    let [uid, user, state, nodes, account] = f[..] else {
        return Err(format!("unexpected squeue line {line:?}"));
    };
    let uid = uid
        .trim()
        .parse()
        .map_err(|_| format!("unexpected uid in squeue line {line:?}"))?;
    Ok(Some(SlurmJob {
        uid,
        user: user.to_owned(),
        account: slurm_job_account(account, user),
        state: state.to_owned(),
        nodes: nodes.to_owned(),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn squeue_lines() {
        assert_eq!(parse_squeue("").unwrap(), None);
        let j = parse_squeue("1000|alice|RUNNING|node[1-2]|physics\n")
            .unwrap()
            .unwrap();
        assert_eq!(
            j,
            SlurmJob {
                uid: 1000,
                user: "alice".into(),
                account: "physics".into(),
                state: "RUNNING".into(),
                nodes: "node[1-2]".into(),
            }
        );
        assert!(j.running() && j.on("node2") && !j.on("node3"));
        // No account kept: the user's name, as the executor asks.
        let j = parse_squeue("0|root|COMPLETED|node1|(null)")
            .unwrap()
            .unwrap();
        assert_eq!(j.account, "root");
        assert!(!j.running());
        // An account is free text: a `|` in it stays in it.
        let j = parse_squeue("7|bob|RUNNING|node1|a|RUNNING")
            .unwrap()
            .unwrap();
        assert_eq!(j.account, "a|RUNNING");
        assert!(parse_squeue("1000|alice|RUNNING").is_err());
        assert!(parse_squeue("x|alice|RUNNING|node1|a").is_err());
        assert!(parse_squeue("1|a|RUNNING|node1|a\n1|a|RUNNING|node2|a\n").is_err());
    }
}

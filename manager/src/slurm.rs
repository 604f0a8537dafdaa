//! Slurm's word on a job: who runs it, charged to which account, in which
//! state, on which nodes; and on a user: which accounts they coordinate.
//! A node's credential only says which node is calling; what it may do
//! for a job ([`crate::api`]'s job routes) is decided from what Slurm
//! itself reports, asked with `squeue` (the `[slurm]` table of
//! `manager.toml`). Whose usage a user may read beyond their own
//! ([`crate::api`]'s usage route) comes from Slurm's accounting database,
//! asked with `sacctmgr` when `[slurm] coordinators = true`.
//!
//! Answers are cached for `cache_ms`, and the nodes of a job that ask at
//! once (each node asks once per job, as its first step starts, and once
//! as the job ends) share one question to Slurm: a job on N nodes costs
//! each replica one `squeue` as it starts and one as it ends, not N. An
//! end keeps what Slurm said about the job's nodes but marks it ended, so
//! the other nodes' ends are checked without asking again and no
//! credential is minted for it from the cached running state.
//! A few Slurm commands run at once at most (one runner for both;
//! `sacctmgr` takes turns of its own, so usage reads never hold up job
//! checks), each bounded by `timeout_ms`, and a Slurm that cannot be asked
//! refuses:
//! nothing is granted on a node's word alone, unless the admin turned the
//! checks off (`[slurm] unchecked = true`, for sites without Slurm and for
//! tests), and no coordinator rights are given that sacctmgr did not
//! confirm.

use std::collections::HashMap;
use std::hash::Hash;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rfaas_proto::hostlist::hostlist_contains;
use rfaas_proto::manager::slurm_job_account;
use tokio::sync::{OnceCell, Semaphore};

/// Cached answers kept at most; expired ones go first when it is full.
const CACHED: usize = 4096;

/// `squeue` processes run at once at most.
const AT_ONCE: usize = 4;

/// `sacctmgr` processes run at once at most: apart from `squeue`'s, so
/// usage reads while slurmdbd is slow never hold up job checks.
const COORDINATOR_READS_AT_ONCE: usize = 2;

/// How the manager asks Slurm (`[slurm]` in `manager.toml`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct SlurmSettings {
    /// The `squeue` program.
    pub squeue: PathBuf,
    /// The `sacctmgr` program.
    pub sacctmgr: PathBuf,
    /// Whether account coordinators (from `sacctmgr`, which needs
    /// slurmdbd) read their accounts' usage.
    pub coordinators: bool,
    /// `SLURM_CONF` for them; `None`: Slurm's own default.
    pub conf: Option<PathBuf>,
    /// How long an answer is reused, ms.
    pub cache_ms: u64,
    /// The bound on one Slurm command, ms.
    pub timeout_ms: u64,
    /// Unsafe: take a node's word for its jobs without asking Slurm.
    pub unchecked: bool,
}

impl Default for SlurmSettings {
    fn default() -> Self {
        SlurmSettings {
            squeue: PathBuf::from("squeue"),
            sacctmgr: PathBuf::from("sacctmgr"),
            coordinators: false,
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
    /// When its time limit ends, Unix seconds (from the time left Slurm
    /// reported when asked); `None`: no limit.
    pub ends_at: Option<u64>,
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
#[error("cannot ask Slurm about {about} with {program}: {why}")]
pub struct SlurmUnavailable {
    /// What was asked about (`job 42`, `the accounts user alice
    /// coordinates`).
    pub about: String,
    /// The program run.
    pub program: String,
    /// What failed.
    pub why: String,
}

/// Slurm's answers, each reused for a while.
#[derive(Debug)]
struct Cache<K, V> {
    ttl: Duration,
    answers: Mutex<HashMap<K, (Instant, V)>>,
}

impl<K: Eq + Hash, V: Clone> Cache<K, V> {
    fn new(ttl_ms: u64) -> Self {
        Cache {
            ttl: Duration::from_millis(ttl_ms),
            answers: Mutex::new(HashMap::new()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<K, (Instant, V)>> {
        self.answers.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The answer for `key`, if it is recent enough.
    fn get(&self, key: &K) -> Option<V> {
        match self.lock().get(key) {
            Some((at, v)) if at.elapsed() < self.ttl => Some(v.clone()),
            _ => None,
        }
    }

    /// Keeps `value` for `key`; expired answers go first when full.
    fn insert(&self, key: K, value: V) {
        let mut answers = self.lock();
        if answers.len() >= CACHED {
            answers.retain(|_, (at, _)| at.elapsed() < self.ttl);
            if answers.len() >= CACHED {
                answers.clear();
            }
        }
        answers.insert(key, (Instant::now(), value));
    }

    /// Changes the answer kept for `key`, if any, keeping its age.
    fn update(&self, key: &K, change: impl FnOnce(&mut V)) {
        if let Some((_, v)) = self.lock().get_mut(key) {
            change(v);
        }
    }
}

/// One question to Slurm about a job, shared by whoever asks while it is
/// out.
type Flight = Arc<OnceCell<Result<Option<SlurmJob>, SlurmUnavailable>>>;

/// What an ended job's cached answer says it is: not running, so no
/// credential is minted from it, with the nodes Slurm placed it on.
const ENDED: &str = "COMPLETING";

/// Asks Slurm about jobs and coordinators, with a short cache.
#[derive(Debug)]
pub struct Slurm {
    settings: SlurmSettings,
    jobs: Cache<u64, Option<SlurmJob>>,
    /// The questions about jobs out now.
    flights: Mutex<HashMap<u64, Flight>>,
    coordinated: Cache<String, Vec<String>>,
    running: Semaphore,
    reading: Semaphore,
}

impl Slurm {
    /// Asks as `settings` say.
    pub fn new(settings: SlurmSettings) -> Slurm {
        Slurm {
            jobs: Cache::new(settings.cache_ms),
            flights: Mutex::new(HashMap::new()),
            coordinated: Cache::new(settings.cache_ms),
            settings,
            running: Semaphore::new(AT_ONCE),
            reading: Semaphore::new(COORDINATOR_READS_AT_ONCE),
        }
    }

    /// Whether coordinators are asked about (`[slurm] coordinators`).
    pub fn coordinators(&self) -> bool {
        self.settings.coordinators
    }

    /// Whether the admin turned the checks off.
    pub fn unchecked(&self) -> bool {
        self.settings.unchecked
    }

    /// Job `job_id` as Slurm reports it, in any state it still keeps;
    /// `None`: Slurm knows no such job (never submitted, or ended longer
    /// ago than its `MinJobAge`).
    /// Callers asking at once share one `squeue`, and its answer (or
    /// failure).
    pub async fn job(&self, job_id: u64) -> Result<Option<SlurmJob>, SlurmUnavailable> {
        if let Some(job) = self.jobs.get(&job_id) {
            return Ok(job);
        }
        let flight = Arc::clone(self.lock_flights().entry(job_id).or_default());
        flight
            .get_or_init(|| async {
                let answer = self.ask(job_id).await;
                if let Ok(job) = &answer {
                    self.jobs.insert(job_id, job.clone());
                }
                let mut flights = self.lock_flights();
                if flights
                    .get(&job_id)
                    .is_some_and(|f| Arc::ptr_eq(f, &flight))
                {
                    flights.remove(&job_id);
                }
                answer
            })
            .await
            .clone()
    }

    fn lock_flights(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Flight>> {
        self.flights.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Job `job_id`'s end was recorded: what Slurm said about it (if
    /// kept) now says it ended, so no credential is minted from a running
    /// state cached from before, and its other nodes' ends are checked
    /// against the nodes kept without asking Slurm again.
    pub fn ended(&self, job_id: u64) {
        self.jobs.update(&job_id, |job| {
            if let Some(job) = job {
                job.state = ENDED.to_owned();
            }
        });
    }

    /// The accounts `user` coordinates as Slurm's accounting database
    /// records them, sub-accounts included (slurmdbd makes a coordinator
    /// of an account one of each account below it); none for a user it
    /// does not know, or whose name no Slurm user could have.
    pub async fn coordinated(&self, user: &str) -> Result<Vec<String>, SlurmUnavailable> {
        if !slurm_name(user) {
            return Ok(Vec::new());
        }
        if let Some(accounts) = self.coordinated.get(&user.to_owned()) {
            return Ok(accounts);
        }
        let about = format!("the accounts user {user} coordinates");
        let program = &self.settings.sacctmgr;
        let out = self
            .run(
                &self.reading,
                program,
                &about,
                &[
                    "--noheader",
                    "--parsable2",
                    "show",
                    "user",
                    &format!("name={user}"),
                    "withcoord",
                    "format=User,Coordinators",
                ],
            )
            .await?;
        if !out.status.success() {
            return Err(unavailable(program, &about, failed(&out)));
        }
        let accounts = parse_coordinators(&String::from_utf8_lossy(&out.stdout), user)
            .map_err(|why| unavailable(program, &about, why))?;
        self.coordinated.insert(user.to_owned(), accounts.clone());
        Ok(accounts)
    }

    /// Runs Slurm command `program args` (about `about`, for errors) to
    /// its end with the configured `SLURM_CONF`, as many at once as
    /// `turns` has permits, each bounded by `timeout_ms`; its output
    /// whatever its exit status.
    async fn run(
        &self,
        turns: &Semaphore,
        program: &Path,
        about: &str,
        args: &[&str],
    ) -> Result<std::process::Output, SlurmUnavailable> {
        let s = &self.settings;
        let _turn = turns
            .acquire()
            .await
            .map_err(|e| unavailable(program, about, e.to_string()))?;
        let mut cmd = tokio::process::Command::new(program);
        cmd.args(args)
            .stdin(std::process::Stdio::null())
            .kill_on_drop(true);
        if let Some(conf) = &s.conf {
            cmd.env("SLURM_CONF", conf);
        }
        tokio::time::timeout(Duration::from_millis(s.timeout_ms), cmd.output())
            .await
            .map_err(|_| {
                unavailable(
                    program,
                    about,
                    format!("no answer within {} ms", s.timeout_ms),
                )
            })?
            .map_err(|e| unavailable(program, about, e.to_string()))
    }

    /// Runs `squeue` for `job_id`. Only fixed fields are asked for, the
    /// account (free text where Slurm keeps no accounts) last, never the
    /// job's name or comment. Its time left counts from now.
    async fn ask(&self, job_id: u64) -> Result<Option<SlurmJob>, SlurmUnavailable> {
        let about = format!("job {job_id}");
        let program = &self.settings.squeue;
        let out = self
            .run(
                &self.running,
                program,
                &about,
                &[
                    // No federation lookup: one slurmctld RPC less.
                    "--local",
                    "--noheader",
                    "--states=all",
                    "--jobs",
                    &job_id.to_string(),
                    "--format",
                    "%U|%u|%T|%N|%L|%a",
                ],
            )
            .await?;
        if !out.status.success() {
            if String::from_utf8_lossy(&out.stderr).contains("Invalid job id") {
                return Ok(None);
            }
            return Err(unavailable(program, &about, failed(&out)));
        }
        parse_squeue(&String::from_utf8_lossy(&out.stdout), crate::now_s())
            .map_err(|why| unavailable(program, &about, why))
    }
}

fn unavailable(program: &Path, about: &str, why: String) -> SlurmUnavailable {
    SlurmUnavailable {
        about: about.to_owned(),
        program: program.display().to_string(),
        why,
    }
}

/// What a command that exited with a failure said.
fn failed(out: &std::process::Output) -> String {
    format!(
        "it failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr).trim()
    )
}

/// Whether `name` can be a Slurm user's (a POSIX login name): nothing
/// sacctmgr would read as more than one name.
fn slurm_name(name: &str) -> bool {
    !name.is_empty()
        && !name.starts_with('-')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// `user|account,account,...` lines; the accounts on `user`'s line (none
/// without one).
fn parse_coordinators(out: &str, user: &str) -> Result<Vec<String>, String> {
    let mut accounts = Vec::new();
    for line in out.lines().filter(|l| !l.trim().is_empty()) {
        let Some((name, coordinated)) = line.trim_end().split_once('|') else {
            return Err(format!("unexpected sacctmgr line {line:?}"));
        };
        if name == user {
            accounts.extend(
                coordinated
                    .split(',')
                    .map(str::trim)
                    .filter(|a| !a.is_empty())
                    .map(str::to_owned),
            );
        }
    }
    Ok(accounts)
}

/// `uid|user|state|nodes|time left|account`, one line, read at Unix
/// second `now`; nothing: no such job.
fn parse_squeue(out: &str, now: u64) -> Result<Option<SlurmJob>, String> {
    let mut lines = out.lines().filter(|l| !l.trim().is_empty());
    let Some(line) = lines.next() else {
        return Ok(None);
    };
    if lines.next().is_some() {
        return Err(format!("more than one line for one job: {out:?}"));
    }
    let line = line.trim_end();
    let f: Vec<&str> = line.splitn(6, '|').collect();
    let [uid, user, state, nodes, left, account] = f[..] else {
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
        ends_at: parse_time_left(left)
            .ok_or_else(|| format!("unexpected time left {left:?} in squeue line {line:?}"))?
            .map(|left| now.saturating_add(left)),
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
        let parse_squeue = |out: &str| parse_squeue(out, 1000);
        assert_eq!(parse_squeue("").unwrap(), None);
        let j = parse_squeue("1000|alice|RUNNING|node[1-2]|59:00|physics\n")
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
                ends_at: Some(1000 + 3540),
            }
        );
        assert!(j.running() && j.on("node2") && !j.on("node3"));
        // No account kept: the user's name, as the executor asks.
        let j = parse_squeue("0|root|COMPLETED|node1|UNLIMITED|(null)")
            .unwrap()
            .unwrap();
        assert_eq!((j.account.as_str(), j.ends_at), ("root", None));
        assert!(!j.running());
        // An account is free text: a `|` in it stays in it.
        let j = parse_squeue("7|bob|RUNNING|node1|1:00|a|RUNNING")
            .unwrap()
            .unwrap();
        assert_eq!(j.account, "a|RUNNING");
        assert!(parse_squeue("1000|alice|RUNNING").is_err());
        assert!(parse_squeue("x|alice|RUNNING|node1|1:00|a").is_err());
        assert!(parse_squeue("1|a|RUNNING|node1|soon|a").is_err());
        assert!(parse_squeue("1|a|RUNNING|node1|1:00|a\n1|a|RUNNING|node2|1:00|a\n").is_err());
    }

    #[test]
    fn sacctmgr_coordinator_lines() {
        assert_eq!(
            parse_coordinators("dave|physics,theory\n", "dave").unwrap(),
            ["physics", "theory"]
        );
        assert!(parse_coordinators("dave|\n", "dave").unwrap().is_empty());
        assert!(parse_coordinators("", "dave").unwrap().is_empty());
        // Another user's line gives nothing.
        assert!(parse_coordinators("eve|physics\n", "dave")
            .unwrap()
            .is_empty());
        assert!(parse_coordinators("garbage\n", "dave").is_err());
        assert!(slurm_name("alice") && slurm_name("a.b_c-1"));
        for bad in ["", "-x", "a b", "a=b", "a,b", "ä"] {
            assert!(!slurm_name(bad), "{bad:?}");
        }
    }
}

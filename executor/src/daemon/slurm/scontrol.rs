//! Slurm's view of this node: which jobs hold CPUs here and which (Slurm's
//! CPU ids), read from `scontrol -d -o show job`, one job a line, whose
//! detail fields say per node `Nodes=node[1-2] CPU_IDs=0-3 Mem=...`.
//!
//! `scontrol` runs as a child with a bound on its time (killed after it)
//! and on what it prints.
//!
//! A job's own text (its name, comment, work directory) is printed inside
//! its line and may hold anything, newlines and fields such as
//! `JobState=` or `Nodes=` included. The reading here is such that it can
//! only add CPUs to a node's view, never hide a job's: a record holds CPUs
//! while any `JobState=` in it is a state that holds them, every
//! `Nodes= CPU_IDs=` pair of such a record counts, and records of the same
//! job id are merged. Slurm prints a job's real state and its real detail
//! fields together, after its name and before its other free text, so
//! they always land in one record. A crafted job name can make the daemon
//! withhold more than it should, never give a job's CPUs to rfaas.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use rfaas_proto::hostlist::hostlist_contains;

/// Most bytes of `scontrol` output read (every job of a large cluster
/// fits).
pub(crate) const MAX_OUTPUT: usize = 64 << 20;

/// Slurm CPU ids at or above this are not read: no node has that many.
const MAX_CPU_ID: u32 = 1 << 16;

/// Where a job is in its life, as far as its CPUs go.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Phase {
    /// It no longer holds CPUs (or never did): completed, cancelled,
    /// failed, pending.
    Gone,
    /// It is ending (`COMPLETING`: its epilog runs), or in a state this
    /// reading does not know: what the daemon withholds for it stays, but
    /// nothing new is withheld.
    Ending,
    /// It holds its CPUs: running, suspended, configuring.
    Runs,
}

impl Phase {
    /// The phase of a `JobState=` word.
    fn of(state: &str) -> Phase {
        match state {
            "RUNNING" | "CONFIGURING" | "SUSPENDED" | "STOPPED" | "RESIZING" | "SIGNALING" => {
                Phase::Runs
            }
            "PENDING" | "COMPLETED" | "CANCELLED" | "FAILED" | "TIMEOUT" | "NODE_FAIL"
            | "PREEMPTED" | "BOOT_FAIL" | "DEADLINE" | "OUT_OF_MEMORY" | "REQUEUED"
            | "REQUEUE_HOLD" | "REQUEUE_FED" | "RESV_DEL_HOLD" | "SPECIAL_EXIT" | "REVOKED" => {
                Phase::Gone
            }
            // COMPLETING, STAGE_OUT, and whatever a later Slurm adds.
            _ => Phase::Ending,
        }
    }
}

/// One job as `scontrol` shows it, seen from one node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Job {
    /// Its phase.
    pub phase: Phase,
    /// Whether it has CPUs on the node (a `Nodes=` pair names it).
    pub here: bool,
    /// Slurm's CPU ids it has on the node.
    pub cpu_ids: BTreeSet<u32>,
}

/// Every job of `scontrol -d -o show job` output `text`, seen from node
/// `node`, by job id.
pub(crate) fn parse(text: &str, node: &str) -> BTreeMap<u64, Job> {
    let mut jobs: BTreeMap<u64, Job> = BTreeMap::new();
    let mut record: Option<(u64, Vec<&str>)> = None;
    let mut finish = |record: Option<(u64, Vec<&str>)>| {
        if let Some((id, tokens)) = record {
            let job = read_record(&tokens, node);
            jobs.entry(id)
                .and_modify(|j| {
                    j.phase = j.phase.max(job.phase);
                    j.here |= job.here;
                    j.cpu_ids.extend(&job.cpu_ids);
                })
                .or_insert(job);
        }
    };
    for line in text.lines() {
        let mut tokens = line.split_whitespace().peekable();
        let id = tokens
            .peek()
            .and_then(|t| t.strip_prefix("JobId="))
            .and_then(|v| v.parse::<u64>().ok());
        match (id, &mut record) {
            (Some(id), _) => {
                finish(record.take());
                record = Some((id, tokens.collect()));
            }
            (None, Some((_, r))) => r.extend(tokens),
            // Before the first record: nothing to read.
            (None, None) => {}
        }
    }
    finish(record);
    jobs
}

/// One record's state and this node's CPU ids.
fn read_record(tokens: &[&str], node: &str) -> Job {
    let mut phase = None::<Phase>;
    for t in tokens {
        if let Some(state) = t.strip_prefix("JobState=") {
            let p = Phase::of(state);
            phase = Some(phase.map_or(p, |q| q.max(p)));
        }
    }
    let mut here = false;
    let mut cpu_ids = BTreeSet::new();
    for pair in tokens.windows(2) {
        let (Some(nodes), Some(ids)) = (
            pair[0].strip_prefix("Nodes="),
            pair[1].strip_prefix("CPU_IDs="),
        ) else {
            continue;
        };
        if hostlist_contains(nodes, node) == Some(true) {
            here = true;
            read_cpu_ids(ids, &mut cpu_ids);
        }
    }
    Job {
        // A record without a state is not understood: keep, add nothing.
        phase: phase.unwrap_or(Phase::Ending),
        here,
        cpu_ids,
    }
}

/// Adds the CPU ids of `0-1,4` to `out`; what is not a number or range is
/// skipped, ids from [`MAX_CPU_ID`] on too.
fn read_cpu_ids(list: &str, out: &mut BTreeSet<u32>) {
    for part in list.split(',') {
        let (a, b) = part.split_once('-').unwrap_or((part, part));
        let (Ok(a), Ok(b)) = (a.trim().parse::<u32>(), b.trim().parse::<u32>()) else {
            continue;
        };
        out.extend(a..=b.min(MAX_CPU_ID - 1));
    }
}

/// Why Slurm's view could not be read. Each is worth retrying later: the
/// daemon changes nothing meanwhile.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub(crate) enum ScontrolError {
    /// The program could not be started.
    #[error(
        "cannot run {program}: {source}; install Slurm's client commands on this node or set [slurm] scontrol"
    )]
    Start {
        /// The program.
        program: PathBuf,
        /// What exec said.
        #[source]
        source: std::io::Error,
    },
    /// It did not end in time and was killed.
    #[error(
        "{program} did not answer within {limit:?} and was killed; is slurmctld up? raise [slurm] timeout_ms if it is only slow"
    )]
    Timeout {
        /// The program.
        program: PathBuf,
        /// The bound.
        limit: Duration,
    },
    /// It failed.
    #[error("{program} {args} failed ({status}): {stderr}")]
    Failed {
        /// The program.
        program: PathBuf,
        /// Its arguments.
        args: String,
        /// How it ended.
        status: std::process::ExitStatus,
        /// What it said.
        stderr: String,
    },
    /// Slurm does not know the job.
    #[error("Slurm does not know job {0}")]
    UnknownJob(u64),
    /// It printed more than [`MAX_OUTPUT`] bytes.
    #[error("{program} printed more than {} MiB; the daemon does not read that much", MAX_OUTPUT >> 20)]
    TooLong {
        /// The program.
        program: PathBuf,
    },
    /// Reading its output failed.
    #[error("reading what {program} printed: {source}")]
    Read {
        /// The program.
        program: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// How to run `scontrol`.
#[derive(Debug, Clone)]
pub(crate) struct Scontrol {
    /// The program.
    pub program: PathBuf,
    /// `SLURM_CONF`, when set.
    pub conf: Option<PathBuf>,
    /// The bound on one run.
    pub timeout: Duration,
}

impl Scontrol {
    /// `scontrol --local -d -o show job [JOB]`: every job (or job `job`),
    /// as text. `--local` skips the federation lookup scontrol makes
    /// first: job `job` is one slurmctld RPC (`REQUEST_JOB_INFO_SINGLE`),
    /// every job two (`REQUEST_JOB_INFO`, `REQUEST_NODE_INFO`).
    pub(crate) fn show_jobs(&self, job: Option<u64>) -> Result<String, ScontrolError> {
        let mut args = vec!["-d", "-o", "show", "job"];
        let id = job.map(|j| j.to_string());
        if let Some(id) = &id {
            args.push(id);
        }
        self.show(&args, |stderr| {
            job.filter(|_| stderr.contains("Invalid job id"))
                .map(ScontrolError::UnknownJob)
        })
    }

    /// The Slurm partitions node `node` is in: `scontrol --local -o show
    /// node NODE`'s `Partitions=a,b` (none if it has no such field). One
    /// slurmctld RPC (`REQUEST_NODE_INFO_SINGLE`).
    pub(crate) fn node_partitions(&self, node: &str) -> Result<Vec<String>, ScontrolError> {
        let text = self.show(&["-o", "show", "node", node], |_| None)?;
        Ok(partitions_of(&text))
    }

    /// Runs `scontrol --local ARGS`: its output, or why it failed
    /// (`known` names a failure it recognises from its standard error).
    fn show(
        &self,
        args: &[&str],
        known: impl FnOnce(&str) -> Option<ScontrolError>,
    ) -> Result<String, ScontrolError> {
        let mut cmd = Command::new(&self.program);
        cmd.arg("--local").args(args);
        if let Some(conf) = &self.conf {
            cmd.env("SLURM_CONF", conf);
        }
        let (status, stdout, stderr) = run_bounded(cmd, &self.program, self.timeout)?;
        if status.success() {
            return Ok(stdout);
        }
        let stderr = stderr.trim().to_string();
        Err(known(&stderr).unwrap_or_else(|| ScontrolError::Failed {
            program: self.program.clone(),
            args: format!("--local {}", args.join(" ")),
            status,
            stderr,
        }))
    }
}

/// The partitions in `scontrol -o show node`'s one line: its
/// `Partitions=a,b` field, each name kept only if it is a partition name
/// rfaas accepts.
pub(crate) fn partitions_of(text: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    let field = text
        .split_whitespace()
        .find_map(|t| t.strip_prefix("Partitions="));
    for name in field.unwrap_or("").split(',') {
        if rfaas_proto::manager::partition_name(name).is_ok() && !out.iter().any(|p| p == name) {
            out.push(name.to_owned());
        }
    }
    out.truncate(rfaas_proto::manager::MAX_PARTITIONS);
    out
}

/// Runs `cmd` (named `program` in errors) for at most `limit`: its exit
/// status, standard output and standard error (lossy UTF-8).
pub(crate) fn run_bounded(
    mut cmd: Command,
    program: &Path,
    limit: Duration,
) -> Result<(std::process::ExitStatus, String, String), ScontrolError> {
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|source| ScontrolError::Start {
            program: program.to_path_buf(),
            source,
        })?;
    let until = Instant::now() + limit;
    // Read while it runs, so a full pipe never stops it.
    let readers = (|| {
        let out = child
            .stdout
            .take()
            .map(|s| reader(s, MAX_OUTPUT))
            .transpose()?;
        let err = child
            .stderr
            .take()
            .map(|s| reader(s, 64 << 10))
            .transpose()?;
        Ok((out, err))
    })();
    let (stdout, stderr) = match readers {
        Ok(r) => r,
        Err(source) => {
            let _ = child.kill();
            let _ = child.wait();
            return Err(ScontrolError::Read {
                program: program.to_path_buf(),
                source,
            });
        }
    };
    let mut nap = Duration::from_millis(1);
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if Instant::now() >= until => {
                // Still our unreaped child: the pid cannot be another's.
                let _ = child.kill();
                let _ = child.wait();
                return Err(ScontrolError::Timeout {
                    program: program.to_path_buf(),
                    limit,
                });
            }
            Ok(None) => {
                std::thread::sleep(nap.min(until.saturating_duration_since(Instant::now())));
                nap = (nap * 2).min(Duration::from_millis(20));
            }
            Err(source) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(ScontrolError::Read {
                    program: program.to_path_buf(),
                    source,
                });
            }
        }
    };
    let collect = |h: Option<Reader>| {
        let (bytes, whole) = match h.map(|h| h.join()) {
            Some(Ok(Ok(r))) => r,
            Some(Ok(Err(source))) => {
                return Err(ScontrolError::Read {
                    program: program.to_path_buf(),
                    source,
                })
            }
            // The reader panicked, or there was no pipe: nothing read.
            _ => (Vec::new(), true),
        };
        Ok((String::from_utf8_lossy(&bytes).into_owned(), whole))
    };
    // The child has exited; its pipes end now (unless it left a process
    // holding them, which scontrol does not).
    let (out, whole) = collect(stdout)?;
    let (err, _) = collect(stderr)?;
    if !whole {
        return Err(ScontrolError::TooLong {
            program: program.to_path_buf(),
        });
    }
    Ok((status, out, err))
}

/// A thread reading a pipe: what it kept, and whether that was all.
type Reader = std::thread::JoinHandle<std::io::Result<(Vec<u8>, bool)>>;

/// Reads `r` to its end on a thread, keeping at most `cap` bytes.
fn reader(mut r: impl Read + Send + 'static, cap: usize) -> std::io::Result<Reader> {
    std::thread::Builder::new()
        .name("scontrol-output".into())
        .spawn(move || {
            let mut kept = Vec::new();
            let mut buf = vec![0u8; 64 << 10];
            let mut whole = true;
            loop {
                let n = match r.read(&mut buf) {
                    Ok(0) => return Ok((kept, whole)),
                    Ok(n) => n,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    Err(e) => return Err(e),
                };
                let room = cap.saturating_sub(kept.len());
                kept.extend_from_slice(&buf[..n.min(room)]);
                whole &= n <= room;
            }
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `scontrol -d -o show job` on the loopback cluster
    /// (scripts/slurm-cluster.sh, NODES=3 CPUS=4, a 4 s prolog): jobs 1
    /// and 2 run on node1 (CPU 0, CPUs 1-2), job 3 on all three nodes, 4
    /// and 5 wait, and job 6, whose name holds a newline, a fake detail
    /// line and a fake `JobId=99` record, is in its prolog on node3.
    const RUNNING: &str = include_str!("testdata/show-job-running.txt");

    /// The same cluster later: job 1 cancelled, 2 suspended, 3 completing
    /// (its epilog runs), 4 completed, 5 pending, 6 (shown as 99) running.
    const ENDING: &str = include_str!("testdata/show-job-ending.txt");

    /// The loopback cluster with 3 nodes: job 1 has all of node1 and
    /// node2 (one `Nodes=node[1-2]` pair), job 2 two CPUs of node3.
    const GROUPED: &str = include_str!("testdata/show-job-grouped.txt");

    fn ids(v: &[u32]) -> BTreeSet<u32> {
        v.iter().copied().collect()
    }

    fn holding(text: &str, node: &str) -> BTreeMap<u64, (Phase, BTreeSet<u32>)> {
        parse(text, node)
            .into_iter()
            .filter(|(_, j)| j.here)
            .map(|(id, j)| (id, (j.phase, j.cpu_ids)))
            .collect()
    }

    #[test]
    fn running_jobs_and_their_cpus_per_node() {
        assert_eq!(
            holding(RUNNING, "node1"),
            BTreeMap::from([
                (1, (Phase::Runs, ids(&[0]))),
                (2, (Phase::Runs, ids(&[1, 2]))),
                (3, (Phase::Runs, ids(&[3]))),
                // The fake detail line of job 6's name, in a record with
                // no state (its real state went to the fake record 99).
                (6, (Phase::Ending, ids(&[0, 1, 2, 3]))),
            ])
        );
        assert_eq!(
            holding(RUNNING, "node2"),
            BTreeMap::from([(3, (Phase::Runs, ids(&[0, 1, 2, 3])))])
        );
        // Job 6's real CPU on node3 is in the record its name faked.
        assert_eq!(
            holding(RUNNING, "node3"),
            BTreeMap::from([
                (3, (Phase::Runs, ids(&[0]))),
                (99, (Phase::Runs, ids(&[1]))),
            ])
        );
        let all = parse(RUNNING, "node1");
        assert_eq!(all[&4].phase, Phase::Gone, "pending");
        assert!(!all[&4].here);
        assert!(holding(RUNNING, "node9").is_empty());
    }

    #[test]
    fn ending_suspended_and_finished_jobs() {
        assert_eq!(
            holding(ENDING, "node1"),
            BTreeMap::from([
                (1, (Phase::Gone, ids(&[0]))),
                (2, (Phase::Runs, ids(&[1, 2]))),
                (3, (Phase::Ending, ids(&[3]))),
                (4, (Phase::Gone, ids(&[0]))),
                (6, (Phase::Ending, ids(&[0, 1, 2, 3]))),
            ])
        );
    }

    #[test]
    fn nodes_with_the_same_cpus_share_one_pair() {
        for node in ["node1", "node2"] {
            assert_eq!(
                holding(GROUPED, node),
                BTreeMap::from([(1, (Phase::Runs, ids(&[0, 1, 2, 3])))]),
                "{node}"
            );
        }
        assert_eq!(
            holding(GROUPED, "node3"),
            BTreeMap::from([(2, (Phase::Runs, ids(&[0, 1])))])
        );
    }

    #[test]
    fn grouped_nodes_and_forged_fields_only_add() {
        let text = "JobId=7 JobName=a JobState=COMPLETED UserId=u(1) JobState=RUNNING \
                    JOB_GRES=(null)   Nodes=n[1-2] CPU_IDs=0-3 Mem=0 GRES=   Nodes=n3 CPU_IDs=1,3 Mem=0 \
                    Comment=x Nodes=n1 CPU_IDs=9\n\
                    JobId=7 JobName=again JobState=PENDING\n\
                    JobId=8 JobState=RUNNING Nodes=n1 CPU_IDs=oops Nodes=n1 CPU_IDs=70000-4294967295\n\
                    garbage without a record\n";
        assert_eq!(
            holding(text, "n2"),
            BTreeMap::from([(7, (Phase::Runs, ids(&[0, 1, 2, 3])))])
        );
        assert_eq!(
            holding(text, "n1"),
            BTreeMap::from([
                (7, (Phase::Runs, ids(&[0, 1, 2, 3, 9]))),
                (8, (Phase::Runs, BTreeSet::new())),
            ]),
            "a later COMPLETED or PENDING hides nothing; bad ids are skipped"
        );
        assert_eq!(
            holding(text, "n3"),
            BTreeMap::from([(7, (Phase::Runs, ids(&[1, 3])))])
        );
        assert!(parse("", "n1").is_empty());
        assert!(parse("No jobs in the system\n", "n1").is_empty());
    }

    #[test]
    fn a_nodes_partitions_are_read_from_its_line() {
        let line = "NodeName=n1 Arch=x86_64 CoresPerSocket=4 Partitions=batch,gpu,batch,bad=name State=IDLE Reason=none\n";
        assert_eq!(partitions_of(line), ["batch", "gpu"]);
        assert_eq!(
            partitions_of("NodeName=n1 State=IDLE\n"),
            Vec::<String>::new()
        );
        assert_eq!(
            partitions_of("NodeName=n1 Partitions= State=IDLE"),
            Vec::<String>::new()
        );
    }

    #[test]
    fn states() {
        for (s, p) in [
            ("RUNNING", Phase::Runs),
            ("SUSPENDED", Phase::Runs),
            ("CONFIGURING", Phase::Runs),
            ("COMPLETING", Phase::Ending),
            ("SOMETHING_NEW", Phase::Ending),
            ("COMPLETED", Phase::Gone),
            ("PENDING", Phase::Gone),
            ("CANCELLED", Phase::Gone),
        ] {
            assert_eq!(Phase::of(s), p, "{s}");
        }
    }

    /// A stand-in `scontrol` (a shell script): the real one needs a
    /// cluster, and these cases are about the child process, not Slurm.
    fn fake(dir: &Path, name: &str, body: &str) -> PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let p = dir.join(name);
        std::fs::write(&p, format!("#!/bin/sh\n{body}\n")).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
        p
    }

    fn scontrol(program: PathBuf, ms: u64) -> Scontrol {
        Scontrol {
            program,
            conf: Some(PathBuf::from("/etc/test/slurm.conf")),
            timeout: Duration::from_millis(ms),
        }
    }

    #[test]
    fn scontrol_runs_bounded_and_says_what_failed() {
        let dir = std::env::temp_dir().join(format!("rfaas-scontrol-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();

        let echo = fake(&dir, "echo", r#"echo "$SLURM_CONF $*""#);
        assert_eq!(
            scontrol(echo.clone(), 10_000).show_jobs(Some(12)).unwrap(),
            "/etc/test/slurm.conf --local -d -o show job 12\n"
        );
        assert_eq!(
            scontrol(echo, 10_000).show_jobs(None).unwrap(),
            "/etc/test/slurm.conf --local -d -o show job\n"
        );

        let hung = fake(&dir, "hung", "exec sleep 600");
        let e = scontrol(hung, 100).show_jobs(None).unwrap_err();
        assert!(matches!(e, ScontrolError::Timeout { .. }), "{e}");
        assert!(e.to_string().contains("timeout_ms"), "{e}");

        let unknown = fake(
            &dir,
            "unknown",
            "echo 'slurm_load_jobs error: Invalid job id specified' >&2; exit 1",
        );
        let e = scontrol(unknown.clone(), 10_000)
            .show_jobs(Some(5))
            .unwrap_err();
        assert!(matches!(e, ScontrolError::UnknownJob(5)), "{e}");
        let e = scontrol(unknown, 10_000).show_jobs(None).unwrap_err();
        assert!(
            e.to_string()
                .contains("failed (exit status: 1): slurm_load_jobs error"),
            "{e}"
        );

        let e = scontrol(dir.join("missing"), 10_000)
            .show_jobs(None)
            .unwrap_err();
        assert!(matches!(e, ScontrolError::Start { .. }), "{e}");
        assert!(e.to_string().contains("[slurm] scontrol"), "{e}");

        // More than the daemon reads: refused, and the child is not left
        // blocked on its pipe.
        let flood = fake(
            &dir,
            "flood",
            &format!("head -c {} /dev/zero", MAX_OUTPUT + 1),
        );
        let e = scontrol(flood, 60_000).show_jobs(None).unwrap_err();
        assert!(matches!(e, ScontrolError::TooLong { .. }), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

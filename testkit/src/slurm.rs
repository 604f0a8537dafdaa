//! A real Slurm cluster (Debian's Slurm: 22.05 on the host, 24.11 in
//! `scripts/roots.sh`'s trixie-slurm root) on loopback: munged, slurmctld
//! and one slurmd per node, in a private directory, stopped on drop; and
//! [`spank_plugin`], the rfaas SPANK plugin the tests load into it.
//!
//! Every step is `scripts/slurm-cluster.sh`, the script people use to try
//! rfaas with Slurm, so the tests prove the script. Several clusters may
//! run at once: the script gives each its own ports and node addresses.
//! It must run as root (slurmd starts job steps as their users) and
//! installs Slurm's packages if they are missing.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// What cluster to start.
#[derive(Debug, Clone)]
pub struct SlurmOptions {
    /// Nodes, `node1` to `nodeN` (1 to 62).
    pub nodes: u32,
    /// CPUs each node advertises.
    pub cpus: u32,
    /// A `plugstack.conf` (SPANK plugins), or none.
    pub plugstack: Option<PathBuf>,
    /// slurmd's `Prolog=` program, or none.
    pub prolog: Option<PathBuf>,
    /// slurmd's `Epilog=` program, or none.
    pub epilog: Option<PathBuf>,
    /// An accounting database as well (slurmdbd on a throwaway MariaDB,
    /// `ACCOUNTING=1`), for `sacctmgr`: accounts, users, coordinators.
    pub accounting: bool,
}

impl Default for SlurmOptions {
    /// 3 nodes of 4 CPUs, no plugins, no prolog or epilog, no
    /// accounting database.
    fn default() -> Self {
        SlurmOptions {
            nodes: 3,
            cpus: 4,
            plugstack: None,
            prolog: None,
            epilog: None,
            accounting: false,
        }
    }
}

/// A running cluster; stopped (every daemon by pid) on drop.
#[derive(Debug)]
pub struct SlurmCluster {
    dir: PathBuf,
    opts: SlurmOptions,
    running: bool,
    /// Keep the directory (its logs) on drop.
    keep: bool,
}

/// The rfaas SPANK plugin (`librfaas_spank.so`) the tests load: the file
/// `RFAAS_SPANK_PLUGIN` names (`scripts/test-slurm-releases.sh` points it
/// to a plugin built against another Slurm release's headers), else the
/// one cargo built next to the running test executable (`deps/` or its
/// parent), else `target_dir()/debug/`. `Err` says where it looked and how
/// to build it.
pub fn spank_plugin() -> Result<PathBuf, String> {
    if let Some(path) = std::env::var_os("RFAAS_SPANK_PLUGIN") {
        let path = PathBuf::from(path);
        return if path.is_file() {
            Ok(path)
        } else {
            Err(format!(
                "RFAAS_SPANK_PLUGIN={} is not a file; build the plugin or unset it",
                path.display()
            ))
        };
    }
    let mut candidates = Vec::new();
    if let Some(deps) = std::env::current_exe()
        .ok()
        .and_then(|e| e.parent().map(Path::to_path_buf))
    {
        candidates.push(deps.join("librfaas_spank.so"));
        if let Some(profile) = deps.parent() {
            candidates.push(profile.join("librfaas_spank.so"));
        }
    }
    candidates.push(crate::target_dir().join("debug").join("librfaas_spank.so"));
    candidates
        .iter()
        .find(|p| p.is_file())
        .cloned()
        .ok_or_else(|| {
            format!(
                "librfaas_spank.so is not built (looked for {}); run `cargo build -p \
             rfaas-slurm-spank` or set RFAAS_SPANK_PLUGIN",
                candidates
                    .iter()
                    .map(|p| p.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        })
}

fn script() -> PathBuf {
    crate::repo_root().join("scripts").join("slurm-cluster.sh")
}

impl SlurmCluster {
    /// Starts a cluster in a new temporary directory and waits until every
    /// node is idle. `Err` says why it could not, with the script's output,
    /// and where the cluster's logs stay.
    pub fn start(opts: SlurmOptions) -> Result<SlurmCluster, String> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let dir = loop {
            let dir = std::env::temp_dir().join(format!(
                "rfaas-slurm-{}-{}",
                std::process::id(),
                NEXT.fetch_add(1, Ordering::Relaxed)
            ));
            if !dir.exists() {
                break dir;
            }
        };
        let mut cluster = SlurmCluster {
            dir,
            opts,
            // Whatever the script started before failing is stopped on drop.
            running: true,
            keep: false,
        };
        if let Err(e) = cluster.script("start") {
            cluster.keep = true;
            return Err(format!(
                "{e}\nthe Slurm cluster's logs stay in {}",
                cluster.dir.display()
            ));
        }
        Ok(cluster)
    }

    /// The cluster's directory (`etc/`, `log/`, `run/`, ...).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Its `slurm.conf`, what `SLURM_CONF` names for every client.
    pub fn conf(&self) -> PathBuf {
        self.dir.join("etc").join("slurm.conf")
    }

    /// The node names, `node1` to `nodeN`.
    pub fn nodes(&self) -> Vec<String> {
        (1..=self.opts.nodes).map(|k| format!("node{k}")).collect()
    }

    /// The log of slurmd `node`.
    pub fn slurmd_log(&self, node: &str) -> String {
        std::fs::read_to_string(self.dir.join("log").join(format!("slurmd-{node}.log")))
            .unwrap_or_default()
    }

    /// slurmctld's log.
    pub fn slurmctld_log(&self) -> String {
        std::fs::read_to_string(self.dir.join("log").join("slurmctld.log")).unwrap_or_default()
    }

    /// Every slurmd's log, one after another, each under a header line.
    pub fn slurmd_logs(&self) -> String {
        self.nodes()
            .iter()
            .map(|n| format!("== slurmd {n}\n{}", self.slurmd_log(n)))
            .collect()
    }

    /// `program` (a Slurm client: srun, sbatch, scontrol, ...) with this
    /// cluster's `SLURM_CONF`.
    pub fn command(&self, program: &str) -> Command {
        let mut cmd = Command::new(program);
        cmd.env("SLURM_CONF", self.conf());
        cmd
    }

    /// Runs `program args` to its end and returns its output, whatever its
    /// exit status; `Err` only if it could not run.
    pub fn output(&self, program: &str, args: &[&str]) -> Result<Output, String> {
        self.command(program)
            .args(args)
            .output()
            .map_err(|e| format!("run {program}: {e}; scripts/slurm-cluster.sh installs Slurm"))
    }

    /// Runs `program args` and returns its standard output; `Err` if it
    /// failed, with its standard error.
    pub fn run(&self, program: &str, args: &[&str]) -> Result<String, String> {
        let out = self.output(program, args)?;
        if !out.status.success() {
            return Err(format!(
                "{program} {} failed ({}): {}{}",
                args.join(" "),
                out.status,
                String::from_utf8_lossy(&out.stderr).trim(),
                String::from_utf8_lossy(&out.stdout).trim()
            ));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// `srun args`, to its end: its standard output.
    pub fn srun(&self, args: &[&str]) -> Result<String, String> {
        self.run("srun", args)
    }

    /// `sbatch --parsable args`: the job id. The job's output goes to
    /// `log/slurm-JOBID.out` in the cluster's directory (not the current
    /// directory, which is a checkout), unless `args` say otherwise.
    pub fn sbatch(&self, args: &[&str]) -> Result<u32, String> {
        let output = format!("--output={}/log/slurm-%j.out", self.dir.display());
        let mut all = vec!["--parsable", output.as_str()];
        all.extend_from_slice(args);
        let out = self.run("sbatch", &all)?;
        let id = out.trim().split(';').next().unwrap_or_default();
        id.parse()
            .map_err(|_| format!("sbatch printed {out:?}, not a job id"))
    }

    /// `sacctmgr -i args` (no questions asked): its standard output. Only
    /// for a cluster started with [`SlurmOptions::accounting`].
    pub fn sacctmgr(&self, args: &[&str]) -> Result<String, String> {
        let mut all = vec!["-i"];
        all.extend_from_slice(args);
        self.run("sacctmgr", &all)
    }

    /// `scontrol args`: its standard output.
    pub fn scontrol(&self, args: &[&str]) -> Result<String, String> {
        self.run("scontrol", args)
    }

    /// `sinfo args`: its standard output.
    pub fn sinfo(&self, args: &[&str]) -> Result<String, String> {
        self.run("sinfo", args)
    }

    /// Job `job`'s fields as `scontrol show job -o` gives them (`JobState`,
    /// `NodeList`, `Reason`, ...).
    pub fn job(&self, job: u32) -> Result<BTreeMap<String, String>, String> {
        let out = self.scontrol(&["show", "job", "-o", &job.to_string()])?;
        Ok(fields(&out))
    }

    /// Job `job`'s state (`PENDING`, `RUNNING`, `COMPLETED`, ...).
    pub fn job_state(&self, job: u32) -> Result<String, String> {
        self.job(job)?
            .remove("JobState")
            .ok_or_else(|| format!("scontrol show job {job} gave no JobState"))
    }

    /// Waits up to `timeout` until job `job` is in one of `states`, and
    /// returns that state; `Err` names the last state seen.
    pub fn wait_job_state(
        &self,
        job: u32,
        states: &[&str],
        timeout: Duration,
    ) -> Result<String, String> {
        let mut last = String::new();
        let got = crate::wait::poll_for(timeout, || match self.job_state(job) {
            Ok(state) if states.contains(&state.as_str()) => Some(Ok(state)),
            Ok(state) => {
                last = state;
                None
            }
            Err(e) => Some(Err(e)),
        });
        got.unwrap_or_else(|| {
            Err(format!(
                "job {job} is {last} after {timeout:?}, not one of {states:?}; its fields: {:?}",
                self.job(job)
            ))
        })
    }

    /// Every node's state as sinfo names it (`idle`, `mixed`, `allocated`,
    /// `drained`, ... with sinfo's suffixes such as `*` when unreachable).
    pub fn node_states(&self) -> Result<BTreeMap<String, String>, String> {
        let out = self.sinfo(&["-h", "-N", "-o", "%N %T"])?;
        Ok(out
            .lines()
            .filter_map(|l| l.split_once(' '))
            .map(|(n, s)| (n.to_string(), s.trim().to_string()))
            .collect())
    }

    /// Node `node`'s fields as `scontrol show node -o` gives them (`State`,
    /// `Reason`, `CPUAlloc`, ...).
    pub fn node(&self, node: &str) -> Result<BTreeMap<String, String>, String> {
        let out = self.scontrol(&["show", "node", "-o", node])?;
        Ok(fields(&out))
    }

    /// Stops every daemon of the cluster (jobs are cancelled first).
    pub fn stop(&mut self) -> Result<(), String> {
        self.script("stop")?;
        self.running = false;
        Ok(())
    }

    fn script(&self, command: &str) -> Result<String, String> {
        let mut cmd = Command::new("bash");
        cmd.arg(script())
            .arg(command)
            .env("RFAAS_SLURM_DIR", &self.dir)
            .env("NODES", self.opts.nodes.to_string())
            .env("CPUS", self.opts.cpus.to_string())
            .env("ACCOUNTING", if self.opts.accounting { "1" } else { "0" })
            .env_remove("PLUGSTACK")
            .env_remove("PROLOG")
            .env_remove("EPILOG");
        if let Some(p) = &self.opts.plugstack {
            cmd.env("PLUGSTACK", p);
        }
        if let Some(p) = &self.opts.prolog {
            cmd.env("PROLOG", p);
        }
        if let Some(p) = &self.opts.epilog {
            cmd.env("EPILOG", p);
        }
        let out = cmd
            .output()
            .map_err(|e| format!("run scripts/slurm-cluster.sh {command}: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "scripts/slurm-cluster.sh {command} (RFAAS_SLURM_DIR={}) failed ({}): {}\n{}",
                self.dir.display(),
                out.status,
                String::from_utf8_lossy(&out.stderr).trim(),
                String::from_utf8_lossy(&out.stdout).trim(),
            ));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }
}

impl Drop for SlurmCluster {
    fn drop(&mut self) {
        if self.running {
            if let Err(e) = self.stop() {
                eprintln!("{e}");
            }
        }
        if std::thread::panicking() && !self.keep {
            // A failed test's logs stay for whoever reads its output.
            eprintln!("the Slurm cluster's logs stay in {}", self.dir.display());
        } else if !self.keep {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// `Key=Value` fields of one `scontrol show ... -o` line (values end at the
/// next space; the few values with spaces, such as `Reason`, keep only
/// their first word).
fn fields(line: &str) -> BTreeMap<String, String> {
    line.split_whitespace()
        .filter_map(|f| f.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scontrol_fields() {
        let f = fields("JobId=4 JobName=wrap JobState=RUNNING Reason=None NodeList=node[1-2]\n");
        assert_eq!(f["JobState"], "RUNNING");
        assert_eq!(f["NodeList"], "node[1-2]");
        assert_eq!(f.get("Missing"), None);
    }
}

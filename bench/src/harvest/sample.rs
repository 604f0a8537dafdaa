//! Slurm's and the manager's view of the nodes, sampled on threads of
//! their own while the stream runs: `sinfo -N -o "%N %C"` (CPUs allocated,
//! idle, other, total per node) and the manager's `GET /v1/nodes` (cores,
//! leased, withheld, state). Each sample carries the middle of the moment
//! it was asked for, on the wall clock the job stamps use. The bench asks
//! Slurm as `nobody` ([`OBSERVER_UID`]), so that `sdiag`'s counts by user
//! keep its own questions apart from what rfaas asks slurmctld.

use std::collections::BTreeMap;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rfaas_testkit::manager::Api;
use rfaas_testkit::slurm::SlurmCluster;

use super::unix_ns;

/// One node as Slurm sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlurmNode {
    pub alloc: u32,
    /// CPUs Slurm could give a job now (not allocated, not drained or down).
    pub idle: u32,
    pub total: u32,
}

/// One node as the manager sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LentNode {
    /// Its state is `up` (heartbeating, not drained).
    pub up: bool,
    pub cores: u32,
    pub leased: u32,
    pub withheld: u32,
}

impl LentNode {
    /// Cores the node lends: all it has but those it withholds, while up.
    pub fn lent(&self) -> u32 {
        if self.up {
            self.cores.saturating_sub(self.withheld)
        } else {
            0
        }
    }
}

/// A view of every node at one moment (unix ns).
#[derive(Debug, Clone, PartialEq)]
pub struct Sample<T> {
    pub at_ns: u64,
    pub nodes: BTreeMap<String, T>,
}

/// What a sampler collected: its samples in time order, and how many
/// times it could not get one (with the last reason).
#[derive(Debug, Clone, PartialEq)]
pub struct Samples<T> {
    pub samples: Vec<Sample<T>>,
    pub misses: u64,
    pub last_miss: Option<String>,
}

/// A thread asking for a view every `interval` until stopped.
#[derive(Debug)]
pub struct Sampler<T> {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<Samples<T>>>,
}

impl<T: Send + 'static> Sampler<T> {
    /// Starts asking `ask` now and every `interval` after.
    pub fn start(
        name: &str,
        interval: Duration,
        mut ask: impl FnMut() -> Result<BTreeMap<String, T>, String> + Send + 'static,
    ) -> std::io::Result<Sampler<T>> {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let thread = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || {
                let mut out = Samples {
                    samples: Vec::new(),
                    misses: 0,
                    last_miss: None,
                };
                let mut next = Instant::now();
                while !flag.load(Ordering::Acquire) {
                    let before = unix_ns();
                    match ask() {
                        Ok(nodes) => {
                            let after = unix_ns();
                            out.samples.push(Sample {
                                at_ns: before + (after.saturating_sub(before)) / 2,
                                nodes,
                            });
                        }
                        Err(e) => {
                            out.misses += 1;
                            out.last_miss = Some(e);
                        }
                    }
                    next += interval;
                    let now = Instant::now();
                    if next > now {
                        std::thread::sleep(next - now);
                    } else {
                        // Late: start again from now rather than catch up.
                        next = now;
                    }
                }
                out
            })?;
        Ok(Sampler {
            stop,
            thread: Some(thread),
        })
    }

    /// Stops it and returns what it collected.
    pub fn finish(mut self) -> Samples<T> {
        self.stop.store(true, Ordering::Release);
        let thread = self.thread.take().expect("a sampler is finished once");
        thread.join().unwrap_or_else(|_| Samples {
            samples: Vec::new(),
            misses: 1,
            last_miss: Some("the sampler thread panicked".into()),
        })
    }
}

impl<T> Drop for Sampler<T> {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Asks the cluster behind `conf` for every node's CPUs.
pub fn ask_slurm(conf: &Path) -> impl FnMut() -> Result<BTreeMap<String, SlurmNode>, String> {
    let conf: PathBuf = conf.to_owned();
    move || {
        let out = observer(Command::new("sinfo"))
            .env("SLURM_CONF", &conf)
            .args(["-N", "-h", "-o", "%N %C"])
            .output()
            .map_err(|e| format!("could not run sinfo: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "sinfo failed ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        parse_sinfo(&String::from_utf8_lossy(&out.stdout))
    }
}

/// The user the bench asks Slurm as while it watches (`nobody`), so that
/// slurmctld counts its questions apart from root's: rfaas's, sbatch's
/// and Slurm's own daemons'.
pub const OBSERVER_UID: u32 = 65534;

/// `cmd`, run as [`OBSERVER_UID`].
pub fn observer(mut cmd: Command) -> Command {
    cmd.uid(OBSERVER_UID).gid(OBSERVER_UID);
    cmd
}

/// Resets slurmctld's RPC counts (`sdiag -r`).
pub fn reset_rpcs(cluster: &SlurmCluster) -> Result<(), String> {
    cluster.run("sdiag", &["-r"]).map(drop)
}

/// The RPCs slurmctld had from root since [`reset_rpcs`] (its daemons,
/// sbatch and, with the plugin, rfaas), but `sdiag`'s own.
pub fn root_rpcs(cluster: &SlurmCluster) -> Result<u64, String> {
    parse_root_rpcs(&cluster.run("sdiag", &[])?)
}

/// From `sdiag`'s text: root's RPC count less the `REQUEST_STATS_INFO`
/// ones (only the bench runs sdiag, as root).
fn parse_root_rpcs(text: &str) -> Result<u64, String> {
    let count = |line: &str| -> Option<u64> {
        line.split("count:")
            .nth(1)?
            .split_whitespace()
            .next()?
            .parse()
            .ok()
    };
    let (by_type, by_user) = text
        .split_once("statistics by user")
        .ok_or_else(|| format!("sdiag printed no RPCs by user:\n{text}"))?;
    let root = by_user
        .lines()
        .find(|l| l.trim_start().starts_with("root "))
        .and_then(count)
        .unwrap_or(0);
    let stats = by_type
        .lines()
        .find(|l| l.trim_start().starts_with("REQUEST_STATS_INFO "))
        .and_then(count)
        .unwrap_or(0);
    Ok(root.saturating_sub(stats))
}

/// `node1 1/3/0/4` lines -> nodes.
fn parse_sinfo(text: &str) -> Result<BTreeMap<String, SlurmNode>, String> {
    let mut nodes = BTreeMap::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let bad = || format!("sinfo printed {line:?}, not `NODE alloc/idle/other/total`");
        let (name, cpus) = line.trim().split_once(' ').ok_or_else(bad)?;
        let n: Vec<u32> = cpus
            .trim()
            .split('/')
            .map(|f| f.parse().map_err(|_| bad()))
            .collect::<Result<_, _>>()?;
        let [alloc, idle, _other, total] = n[..] else {
            return Err(bad());
        };
        nodes.insert(name.to_owned(), SlurmNode { alloc, idle, total });
    }
    if nodes.is_empty() {
        return Err("sinfo listed no node".into());
    }
    Ok(nodes)
}

/// Asks the manager at `api` for every node it knows.
pub fn ask_manager(api: Api) -> impl FnMut() -> Result<BTreeMap<String, LentNode>, String> {
    move || {
        let (status, body) = api.call("GET", "/v1/nodes", None);
        if status != 200 {
            return Err(format!("GET /v1/nodes answered {status}: {body}"));
        }
        parse_nodes(&body)
    }
}

fn parse_nodes(body: &serde_json::Value) -> Result<BTreeMap<String, LentNode>, String> {
    let list = body
        .as_array()
        .ok_or_else(|| format!("GET /v1/nodes gave {body}, not a list"))?;
    let mut nodes = BTreeMap::new();
    for n in list {
        let number = |key: &str| {
            n[key]
                .as_u64()
                .map(|v| v as u32)
                .ok_or_else(|| format!("a node without {key}: {n}"))
        };
        let name = n["name"]
            .as_str()
            .ok_or_else(|| format!("a node without a name: {n}"))?;
        nodes.insert(
            name.to_owned(),
            LentNode {
                up: n["state"] == "up",
                cores: number("cores")?,
                leased: number("leased_cores")?,
                withheld: number("withheld_cores")?,
            },
        );
    }
    Ok(nodes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sdiag_root_rpcs_less_its_own() {
        let text = "Remote Procedure Call statistics by message type
	REQUEST_JOB_INFO_SINGLE                 ( 2021) count:15     ave_time:178    total_time:356
	REQUEST_STATS_INFO                      ( 2035) count:2      ave_time:208    total_time:208

Remote Procedure Call statistics by user
	nobody          (   65534) count:40     ave_time:228    total_time:915
	root            (       0) count:17     ave_time:187    total_time:1686

Pending RPC statistics
	No pending RPCs
";
        assert_eq!(parse_root_rpcs(text), Ok(15));
        assert!(parse_root_rpcs("garbage").is_err());
    }

    #[test]
    fn sinfo_lines() {
        let nodes = parse_sinfo("node1 1/3/0/4\nnode2 0/0/4/4\n").unwrap();
        assert_eq!(
            nodes["node1"],
            SlurmNode {
                alloc: 1,
                idle: 3,
                total: 4
            }
        );
        assert_eq!(nodes["node2"].idle, 0);
        assert!(parse_sinfo("node1 1/3/0\n").is_err());
        assert!(parse_sinfo("").is_err());
    }

    #[test]
    fn manager_nodes() {
        let body = serde_json::json!([
            {"name": "node1", "state": "up", "cores": 4, "leased_cores": 1, "withheld_cores": 2},
            {"name": "node2", "state": "lost", "cores": 4, "leased_cores": 0, "withheld_cores": 0},
        ]);
        let nodes = parse_nodes(&body).unwrap();
        assert_eq!(nodes["node1"].lent(), 2);
        assert_eq!(nodes["node2"].lent(), 0, "a lost node lends nothing");
        assert!(parse_nodes(&serde_json::json!([{"name": "x"}])).is_err());
    }

    #[test]
    fn a_sampler_samples_until_finished() {
        let (tx, rx) = std::sync::mpsc::channel();
        let mut n = 0u32;
        let s = Sampler::start("test-sampler", Duration::from_millis(1), move || {
            n += 1;
            let _ = tx.send(n);
            if n % 2 == 0 {
                Err("even".into())
            } else {
                Ok(BTreeMap::from([("a".to_owned(), n)]))
            }
        })
        .unwrap();
        while rx.recv().unwrap() < 4 {}
        let got = s.finish();
        assert!(got.samples.len() >= 2, "{got:?}");
        assert!(got.misses >= 2 && got.last_miss.is_some(), "{got:?}");
        for pair in got.samples.windows(2) {
            assert!(pair[0].at_ns <= pair[1].at_ns);
        }
    }
}

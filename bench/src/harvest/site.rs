//! What one run stands on: a loopback Slurm cluster (through
//! `scripts/slurm-cluster.sh`) and, for the run with the plugin, rfaas as
//! a site installs it: a manager (SQLite), one `rfaas-executord` per
//! Slurm node registered with it, with `[slurm]` (per-CPU take-back and
//! reconciliation), and `rfaas_spank.so` in `plugstack.conf`. The run
//! without the plugin has the same cluster with an empty `plugstack.conf`
//! and no executor daemons.
//!
//! Everything is stopped on drop: the daemons by pid, the cluster by its
//! script (which signals only its own pids).

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use rfaas_testkit::executord::{Executord, ExecutordOptions};
use rfaas_testkit::manager::{public_key_line, Api, Manager, ManagerOptions};
use rfaas_testkit::slurm::{SlurmCluster, SlurmOptions};

use super::records::JOB_SCRIPT;
use crate::cleanup;
use crate::error::{Context, Error, Result};

/// The programs a run with the plugin starts.
#[derive(Debug, Clone)]
pub struct Binaries {
    pub executord: PathBuf,
    pub manager: PathBuf,
    /// `librfaas_spank.so`.
    pub plugin: PathBuf,
}

/// The cluster's shape and the plugin's grace.
#[derive(Debug, Clone, Copy)]
pub struct Layout {
    pub nodes: u32,
    pub cpus: u32,
    pub grace_s: u32,
}

/// rfaas on the cluster.
#[derive(Debug)]
pub struct Rfaas {
    // Dropped first: the daemons stop before their manager.
    executords: Vec<(Executord, cleanup::Registered)>,
    pub manager: Manager,
    _manager_pid: Option<cleanup::Registered>,
}

/// A running site; everything stopped on drop.
#[derive(Debug)]
pub struct Site {
    // Dropped in this order: rfaas, the cluster, then the directory.
    pub rfaas: Option<Rfaas>,
    pub cluster: SlurmCluster,
    dir: RunDir,
}

/// The run's directory: the job script, the stamps, the plugin and its
/// configuration, the executor daemons' sockets and credentials.
#[derive(Debug)]
struct RunDir(PathBuf);

impl Drop for RunDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The manager's intervals: a site's, nothing sped up (a take-back and an
/// offer reach it at once, not at the next heartbeat).
const MANAGER_CONFIG: &str =
    "heartbeat_interval_ms = 1000\nlost_after_ms = 30000\nrefresh_ms = 1000\n";

impl Site {
    /// Starts the cluster, and rfaas on it when `binaries` are given;
    /// returns once every node is idle in Slurm and, with rfaas, up and
    /// lending every core in the manager.
    pub fn start(layout: Layout, binaries: Option<&Binaries>) -> Result<Site> {
        static SEQ: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "rfaas-harvest-{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("stamps"))
            .context(|| format!("could not create {}", dir.display()))?;
        let dir = RunDir(dir);
        std::fs::set_permissions(&dir.0, std::fs::Permissions::from_mode(0o755))
            .context(|| format!("could not open up {}", dir.0.display()))?;
        let script = dir.0.join("job.sh");
        std::fs::write(&script, JOB_SCRIPT)
            .and_then(|()| {
                std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755))
            })
            .context(|| format!("could not write {}", script.display()))?;

        let Some(bins) = binaries else {
            let cluster = start_cluster(layout, None)?;
            let site = Site {
                rfaas: None,
                cluster,
                dir,
            };
            site.warm_up(layout)?;
            return Ok(site);
        };
        let manager = Manager::try_start(
            &bins.manager,
            ManagerOptions {
                extra_config: MANAGER_CONFIG.into(),
                ..ManagerOptions::default()
            },
        )
        .map_err(|e| Error::new(format!("could not start rfaas-manager: {e}")))?;
        let manager_pid = manager.pid().map(cleanup::register);
        let plugstack = plugstack(&dir.0, bins, layout.grace_s)?;
        let cluster = start_cluster(layout, Some(plugstack))?;
        let mut rfaas = Rfaas {
            executords: Vec::new(),
            manager,
            _manager_pid: manager_pid,
        };
        let key = public_key_line(rfaas.manager.lease_key()).map_err(Error::new)?;
        for node in cluster.nodes() {
            let credential = node_credential(&rfaas.manager, &dir.0, &node)?;
            let d = Executord::try_start(
                &bins.executord,
                ExecutordOptions {
                    node_name: node.clone(),
                    cpus: format!("0-{}", layout.cpus - 1),
                    accept_keys: vec![key.clone()],
                    local_socket: Some(socket(&dir.0, &node)),
                    extra_config: format!(
                        "[manager]\nurls = [{:?}]\ncredential_file = {:?}\n[slurm]\nconf = {:?}\n",
                        rfaas.manager.url(),
                        credential.display().to_string(),
                        cluster.conf().display().to_string(),
                    ),
                    ..ExecutordOptions::default()
                },
            )
            .map_err(|e| Error::new(format!("could not start rfaas-executord for {node}: {e}")))?;
            let pid = cleanup::register(d.pid());
            rfaas.executords.push((d, pid));
        }
        let site = Site {
            rfaas: Some(rfaas),
            cluster,
            dir,
        };
        site.wait_all_lent(layout)?;
        site.warm_up(layout)?;
        Ok(site)
    }

    /// The run's directory.
    pub fn dir(&self) -> &Path {
        &self.dir.0
    }

    /// The job script.
    pub fn script(&self) -> PathBuf {
        self.dir.0.join("job.sh")
    }

    /// Job `index`'s stamp file.
    pub fn stamp(&self, index: usize) -> PathBuf {
        self.dir.0.join("stamps").join(format!("job-{index}"))
    }

    /// An admin caller of the manager, with rfaas.
    pub fn admin(&self) -> Option<Api> {
        self.rfaas.as_ref().map(|r| r.manager.admin())
    }

    /// Every log that says what went wrong, for an error message.
    pub fn logs(&self) -> String {
        let mut out = format!(
            "slurmctld's log:\n{}\n",
            tail(&self.cluster.slurmctld_log())
        );
        out += &format!(
            "the plugin's log:\n{}\n",
            tail(&std::fs::read_to_string(self.dir.0.join("spank.log")).unwrap_or_default())
        );
        if let Some(r) = &self.rfaas {
            out += &format!("the manager's log:\n{}\n", tail(&r.manager.log()));
            for (d, _) in &r.executords {
                out += &format!("{}'s log:\n{}\n", d.node_name(), tail(&d.log()));
            }
        }
        out
    }

    /// Runs one job on every node and waits until all are idle (and lent)
    /// again: both runs then start their streams on a cluster whose
    /// scheduler has made its first pass (slurmctld's first one comes
    /// seconds after its start) and whose nodes have each run a job.
    fn warm_up(&self, layout: Layout) -> Result<()> {
        let nodes = format!("-N{}", layout.nodes);
        self.cluster
            .srun(&[&nodes, "--exclusive", "true"])
            .map_err(|e| Error::new(format!("the warm-up job failed: {e}\n{}", self.logs())))?;
        let until = Instant::now() + Duration::from_secs(60);
        loop {
            let states = self.cluster.node_states().map_err(Error::new)?;
            if states.len() == layout.nodes as usize && states.values().all(|s| s == "idle") {
                break;
            }
            if Instant::now() > until {
                return Err(Error::new(format!(
                    "the nodes were not all idle within 60 s of the warm-up job: {states:?}"
                )));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        self.wait_all_lent(layout)
    }

    /// Waits until the manager shows every node up and lending every core.
    fn wait_all_lent(&self, layout: Layout) -> Result<()> {
        let Some(api) = self.admin() else {
            return Ok(());
        };
        let until = Instant::now() + Duration::from_secs(60);
        loop {
            let (_, nodes) = api.call("GET", "/v1/nodes", None);
            let lending = nodes.as_array().map_or(0, |list| {
                list.iter()
                    .filter(|n| {
                        n["state"] == "up"
                            && n["withheld_cores"] == 0
                            && n["cores"] == u64::from(layout.cpus)
                    })
                    .count()
            });
            if lending == layout.nodes as usize {
                return Ok(());
            }
            if Instant::now() > until {
                return Err(Error::new(format!(
                    "the manager did not show all {} nodes up and lending within 60 s: {nodes}\n{}",
                    layout.nodes,
                    self.logs()
                )));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

fn start_cluster(layout: Layout, plugstack: Option<PathBuf>) -> Result<SlurmCluster> {
    SlurmCluster::start(SlurmOptions {
        nodes: layout.nodes,
        cpus: layout.cpus,
        plugstack,
        ..SlurmOptions::default()
    })
    .map_err(|e| Error::new(format!("could not start the Slurm cluster: {e}")))
}

/// The executor daemon's socket for `node`, as `socket=...-%n.sock` names
/// it in plugstack.conf.
fn socket(dir: &Path, node: &str) -> PathBuf {
    dir.join(format!("executord-{node}.sock"))
}

/// Installs the plugin in `dir` under the name sites use and writes a
/// plugstack.conf for it (`required`: a plugin that does not load fails
/// the jobs, so a broken run shows).
fn plugstack(dir: &Path, bins: &Binaries, grace_s: u32) -> Result<PathBuf> {
    let installed = dir.join("rfaas_spank.so");
    std::fs::copy(&bins.plugin, &installed).context(|| {
        format!(
            "could not copy the plugin {} (build it: cargo build --release -p rfaas-slurm-spank, \
             or give --plugin)",
            bins.plugin.display()
        )
    })?;
    let conf = dir.join("plugstack.conf");
    std::fs::write(
        &conf,
        format!(
            "required {} socket={} grace={grace_s} log={}\n",
            installed.display(),
            socket(dir, "%n").display(),
            dir.join("spank.log").display()
        ),
    )
    .context(|| format!("could not write {}", conf.display()))?;
    Ok(conf)
}

/// Mints `node`'s credential through the admin API and writes it, private,
/// into `dir`.
fn node_credential(manager: &Manager, dir: &Path, node: &str) -> Result<PathBuf> {
    let token = mint(manager, "node", node, None)?;
    let path = dir.join(format!("{node}.credential"));
    std::fs::write(&path, token)
        .and_then(|()| std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)))
        .context(|| format!("could not write {}", path.display()))?;
    Ok(path)
}

/// A credential of `role` for `subject` (charged to `account`), minted by
/// the admin.
pub fn mint(manager: &Manager, role: &str, subject: &str, account: Option<&str>) -> Result<String> {
    let mut body = serde_json::json!({"role": role, "subject": subject});
    if let Some(a) = account {
        body["account"] = a.into();
    }
    let (status, reply) = manager.admin().call("POST", "/v1/credentials", Some(&body));
    match reply["token"].as_str() {
        Some(token) if status == 201 => Ok(token.to_owned()),
        _ => Err(Error::new(format!(
            "the manager would not mint a {role} credential for {subject} ({status}): {reply}"
        ))),
    }
}

/// The last 40 lines of `text`.
fn tail(text: &str) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(40)..].join("\n")
}

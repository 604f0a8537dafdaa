//! The daemon's configuration: one TOML file (every key is documented in
//! `rfaas-executord.example.toml`), defaults for what it leaves out, and
//! [`Config::resolve`], which turns it into checked [`Settings`].

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use super::host::{self, Source};

use rfaas_proto::files::{
    self, ConfigDir, Unreadable, EXECUTORD_TOML, LEASE_KEYS_PUB, NODE_CREDENTIAL,
};
use serde::{Deserialize, Serialize};

/// The configuration file as written: every key optional.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// This node's name as lease tokens name it (default: `slurmd -C`'s
    /// `NodeName`, else the short host name).
    pub node_name: Option<String>,
    /// TCP address of the control listener (default `0.0.0.0:7100`).
    pub control_listen: Option<String>,
    /// The control port's certificate chain (PEM): with `control_tls_key`,
    /// the port speaks TLS (default: none, plain TCP).
    pub control_tls_cert: Option<PathBuf>,
    /// The key of `control_tls_cert` (PEM, private to its owner).
    pub control_tls_key: Option<PathBuf>,
    /// With a certificate, whether plain connections are refused (default
    /// true).
    pub require_control_tls: Option<bool>,
    /// Host workers listen on for the `tcp` provider (default: the local
    /// address of the route to the first manager, else `127.0.0.1`).
    pub fabric_host: Option<String>,
    /// Fabric providers served (default `["tcp", "shm"]`).
    pub providers: Option<Vec<String>>,
    /// CPUs granted to allocations, as a cpulist (default: the online CPUs,
    /// as many as `slurmd -C` counts, less `reserve_cpus`).
    pub cpus: Option<String>,
    /// CPUs kept for the system when `cpus` is not set: the
    /// highest-numbered ones (default 0).
    pub reserve_cpus: Option<u32>,
    /// Whether lanes are pinned to the granted CPUs (default true).
    pub pin: Option<bool>,
    /// Refuse to start unless every allocation can have its own cgroup
    /// (default false: run without, and say so).
    pub enforce_isolation: Option<bool>,
    /// Memory granted to allocations, MiB (default: `slurmd -C`'s
    /// `RealMemory`, else `MemTotal`, less `reserve_memory_mib`).
    pub memory_mib: Option<u32>,
    /// Memory kept for the system when `memory_mib` is not set, MiB
    /// (default 1024).
    pub reserve_memory_mib: Option<u32>,
    /// Files of the public keys lease tokens are checked with (default
    /// `["/etc/rfaas/lease-keys.pub"]`).
    pub lease_keys: Option<Vec<PathBuf>>,
    /// The node tools' unix socket.
    pub local_socket: Option<PathBuf>,
    /// Where per-allocation directories (shm sockets) are made.
    pub runtime_dir: Option<PathBuf>,
    /// Pre-spawned idle workers (default 2).
    pub pool_size: Option<u32>,
    /// Whether workers keep running when the daemon stops or dies, for
    /// the next daemon to adopt (default true).
    pub workers_outlive_daemon: Option<bool>,
    /// Seconds an adopted allocation waits for its client to attach
    /// (default 60).
    pub attach_grace_s: Option<u64>,
    /// The `rfaas-worker` binary (default: next to the daemon's own).
    pub worker_path: Option<PathBuf>,
    /// `none` or `bubblewrap`.
    pub sandbox: Option<Sandbox>,
    /// Workers never run as a uid below this (default: `UID_MIN` from
    /// `/etc/login.defs`, 1000 without it).
    pub min_worker_uid: Option<u32>,
    /// Users workers never run as, by name or uid (default `["root"]`).
    pub deny_users: Option<Vec<String>>,
    /// The `bwrap` binary for `sandbox = "bubblewrap"` (default `bwrap`).
    pub bwrap_path: Option<PathBuf>,
    /// Largest function library accepted, MiB.
    pub max_library_mib: Option<u32>,
    /// Most lanes (connections) one allocation may ask for.
    pub max_lanes: Option<u16>,
    /// Largest lane input buffer, bytes.
    pub max_input_capacity: Option<u32>,
    /// Largest lane output buffer, bytes.
    pub max_output_capacity: Option<u32>,
    /// Function deadline when a request asks for none, milliseconds.
    pub default_deadline_ms: Option<u64>,
    /// Longest function deadline a request may ask for, milliseconds.
    pub max_deadline_ms: Option<u64>,
    /// How long a worker may take to load a library and listen, ms.
    pub worker_ready_timeout_ms: Option<u64>,
    /// Control connections open at once (default 1024).
    pub max_connections: Option<u32>,
    /// Control connections open at once from one address (default 256).
    pub max_connections_per_address: Option<u32>,
    /// How long a request's header and JSON may take to arrive, ms; the
    /// first request's from the connection's accept (default 10000).
    pub request_timeout_ms: Option<u64>,
    /// How long a checked request's library may take to arrive, ms
    /// (default 120000).
    pub library_timeout_ms: Option<u64>,
    /// How long a connection that never got an allocation may stay
    /// without a request, ms (default 60000).
    pub idle_timeout_ms: Option<u64>,
    /// Memory for libraries being received, MiB, all connections together
    /// (default 256; at least `max_library_mib`).
    pub library_memory_mib: Option<u32>,
    /// Threads that carry out allocations (default 8).
    pub request_threads: Option<u32>,
    /// `error`, `warn`, `info`, `debug` or `trace`.
    pub log_level: Option<String>,
    /// Address of the `/metrics` and `/healthz` listener (default: none).
    pub metrics_listen: Option<String>,
    /// The resource managers this node registers with; without it the
    /// daemon runs alone and serves hand-minted leases.
    pub manager: Option<ManagerConfig>,
    /// How the daemon posts leases' usage to accounting services.
    pub billing: Option<BillingConfig>,
    /// How the daemon asks Slurm which jobs hold this node's CPUs; without
    /// it a Slurm job's start takes the whole node back.
    pub slurm: Option<SlurmConfig>,
}

/// The `[slurm]` table: where the daemon reads Slurm's view of this node
/// (`scontrol -d -o show job`), to take back only a job's own CPUs and to
/// reconcile with Slurm what its prolog or epilog did not say.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct SlurmConfig {
    /// This node's name in Slurm (default: `node_name`).
    pub node: Option<String>,
    /// The `scontrol` program (default `scontrol`, found on `PATH`).
    pub scontrol: Option<PathBuf>,
    /// `SLURM_CONF` for `scontrol` (default: what the daemon was started
    /// with, else Slurm's own default).
    pub conf: Option<PathBuf>,
    /// How often the daemon compares what it took back with the jobs Slurm
    /// runs here, on average (each wait is drawn between half and one and
    /// a half of it), ms; 0: never (default 120000: one slurmctld RPC per
    /// node per minute).
    pub reconcile_interval_ms: Option<u64>,
    /// Longest wait for one `scontrol`, ms; it is killed after (default
    /// 1000).
    pub timeout_ms: Option<u64>,
    /// The grace period of take-backs the daemon decides itself (a job
    /// whose prolog never reached it), ms (default 30000, the plugin's).
    pub grace_ms: Option<u64>,
    /// How Slurm's CPU ids on this node name the daemon's CPUs: `"index"`
    /// (Slurm CPU id i is the i-th CPU of `cpus`, the default), `"same"`
    /// (Slurm CPU id i is CPU i), or a list in Slurm's order (`"4-7,0-3"`:
    /// Slurm CPU id 0 is CPU 4).
    pub cpu_map: Option<String>,
    /// The Slurm partitions this node is in, as it registers them with the
    /// managers (default: what `scontrol --local -o show node` says, asked
    /// once at start).
    pub partitions: Option<Vec<String>>,
}

/// How Slurm's CPU ids on this node name the daemon's CPUs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub enum CpuMap {
    /// Slurm CPU id i is the i-th CPU of `cpus` (ascending).
    Index,
    /// Slurm CPU id i is CPU i.
    Same,
    /// Slurm CPU id i is the i-th entry.
    List(Vec<u32>),
}

impl CpuMap {
    /// The daemon's CPUs among Slurm CPU ids `ids`, given the daemon's
    /// `cpus` (ascending). Ids that name none of them are not rfaas's.
    pub fn to_cpus(&self, ids: &std::collections::BTreeSet<u32>, cpus: &[u32]) -> Vec<u32> {
        let mut out: Vec<u32> = ids
            .iter()
            .filter_map(|&id| match self {
                CpuMap::Index => cpus.get(id as usize).copied(),
                CpuMap::Same => Some(id),
                CpuMap::List(l) => l.get(id as usize).copied(),
            })
            .filter(|c| cpus.contains(c))
            .collect();
        out.sort_unstable();
        out.dedup();
        out
    }
}

/// The checked `[slurm]` table.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SlurmSettings {
    /// This node's Slurm name.
    pub node: String,
    /// The `scontrol` program.
    pub scontrol: PathBuf,
    /// `SLURM_CONF` for it, when set.
    pub conf: Option<PathBuf>,
    /// ms; 0: no reconciliation.
    pub reconcile_interval_ms: u64,
    /// ms.
    pub timeout_ms: u64,
    /// ms.
    pub grace_ms: u64,
    /// Slurm CPU ids to the daemon's CPUs.
    pub cpu_map: CpuMap,
    /// The partitions the admin set; `None`: ask Slurm.
    pub partitions: Option<Vec<String>>,
}

impl SlurmConfig {
    fn resolve(&self, node_name: &str) -> Result<SlurmSettings, ConfigError> {
        let invalid =
            |key: &'static str, value: &dyn std::fmt::Debug, why: &str| ConfigError::Invalid {
                key,
                value: format!("{value:?}"),
                why: why.to_owned(),
            };
        let node = match &self.node {
            Some(n) if n.trim().is_empty() || n.contains(char::is_whitespace) => {
                return Err(invalid(
                    "slurm.node",
                    n,
                    "give the node's name as Slurm knows it (scontrol show node)",
                ))
            }
            Some(n) => n.clone(),
            None => node_name.to_owned(),
        };
        let timeout_ms = match self.timeout_ms {
            Some(0) => return Err(invalid("slurm.timeout_ms", &0, "use at least 1")),
            Some(v) => v,
            None => 1000,
        };
        let cpu_map = match self.cpu_map.as_deref().map(str::trim) {
            None | Some("index") => CpuMap::Index,
            Some("same") => CpuMap::Same,
            Some(list) => CpuMap::List(parse_ordered_cpulist(list).map_err(|why| {
                invalid(
                    "slurm.cpu_map",
                    &list,
                    &format!("use \"index\", \"same\" or a list of CPUs in Slurm's order ({why})"),
                )
            })?),
        };
        if let Some(p) = &self.partitions {
            rfaas_proto::manager::partitions(p)
                .map_err(|why| invalid("slurm.partitions", p, &why))?;
        }
        Ok(SlurmSettings {
            node,
            scontrol: self
                .scontrol
                .clone()
                .unwrap_or_else(|| PathBuf::from("scontrol")),
            conf: self.conf.clone(),
            reconcile_interval_ms: self
                .reconcile_interval_ms
                .unwrap_or(DEFAULT_RECONCILE_INTERVAL_MS),
            timeout_ms,
            grace_ms: self.grace_ms.unwrap_or(30_000),
            cpu_map,
            partitions: self.partitions.clone(),
        })
    }
}

/// The `[billing]` table. The daemon posts the usage of every lease whose
/// token names an accounting slot, with the node credential of
/// `[manager]`; without `[manager]` it posts nothing.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct BillingConfig {
    /// Post a lease's usage at most this often, ms (default 1000).
    pub granularity_ms: Option<u64>,
    /// Give up on an ended lease's usage that could not be posted after
    /// this long, s (default 300; keep it at most half the accounting
    /// services' `slot_hold_s`).
    pub keep_ended_s: Option<u64>,
    /// One connection attempt or one batch of adds, ms (default 2000).
    pub timeout_ms: Option<u64>,
    /// Journal of every add that landed, JSON lines, appended (default:
    /// none).
    pub journal: Option<PathBuf>,
}

/// The checked `[billing]` table.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct BillingSettings {
    /// ms.
    pub granularity_ms: u64,
    /// s.
    pub keep_ended_s: u64,
    /// ms.
    pub timeout_ms: u64,
    /// The journal, when set.
    pub journal: Option<PathBuf>,
}

impl Default for BillingSettings {
    fn default() -> Self {
        BillingSettings {
            granularity_ms: 1000,
            keep_ended_s: 300,
            timeout_ms: 2000,
            journal: None,
        }
    }
}

impl BillingConfig {
    fn resolve(&self) -> Result<BillingSettings, ConfigError> {
        let d = BillingSettings::default();
        let positive = |key: &'static str, v: Option<u64>, default: u64| match v {
            Some(0) => Err(ConfigError::Invalid {
                key,
                value: "0".into(),
                why: "use at least 1".into(),
            }),
            Some(v) => Ok(v),
            None => Ok(default),
        };
        Ok(BillingSettings {
            granularity_ms: positive(
                "billing.granularity_ms",
                self.granularity_ms,
                d.granularity_ms,
            )?,
            keep_ended_s: positive("billing.keep_ended_s", self.keep_ended_s, d.keep_ended_s)?,
            timeout_ms: positive("billing.timeout_ms", self.timeout_ms, d.timeout_ms)?,
            journal: self.journal.clone(),
        })
    }
}

/// The `[manager]` table: where to register and heartbeat.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ManagerConfig {
    /// Base URLs of the manager replicas (`https://host:port`; plain
    /// `http://` only to loopback, or with `allow_http`), tried in turn.
    pub urls: Vec<String>,
    /// Trust only the CAs in this PEM file for the managers' certificates
    /// (default: `RFAAS_CA_FILE` if set, else the system's roots).
    pub ca_file: Option<PathBuf>,
    /// Allow plain `http://` managers that are not on loopback: the node
    /// credential then crosses the network in clear (default false).
    #[serde(default)]
    pub allow_http: bool,
    /// The node's credential (minted by `rfaasctl credential node NAME`),
    /// in a file only its owner may read.
    pub credential_file: Option<PathBuf>,
    /// The control address clients are told to allocate on (default: the
    /// listener's address, with `fabric_host` when it listens on every
    /// interface).
    pub advertise: Option<String>,
    /// The longest wait between two registration attempts while no
    /// manager answers, ms (default 30000).
    pub max_backoff_ms: Option<u64>,
    /// The node lends capacity a batch system left idle, billed at the
    /// harvested discount (default false).
    #[serde(default)]
    pub harvested: bool,
}

/// The checked `[manager]` table.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ManagerSettings {
    /// Manager base URLs, without a trailing slash.
    pub urls: Vec<String>,
    /// The CA file the managers' certificates are checked with.
    pub ca_file: Option<PathBuf>,
    /// The node credential's file.
    pub credential_file: PathBuf,
    /// The advertised control address, when set.
    pub advertise: Option<String>,
    /// The longest backoff, ms.
    pub max_backoff_ms: u64,
    /// Lends harvested capacity.
    pub harvested: bool,
}

impl ManagerConfig {
    fn resolve(&self, dir: &ConfigDir) -> Result<ManagerSettings, ConfigError> {
        let invalid =
            |key: &'static str, value: &dyn std::fmt::Debug, why: &str| ConfigError::Invalid {
                key,
                value: format!("{value:?}"),
                why: why.to_owned(),
            };
        if self.urls.is_empty() {
            return Err(invalid(
                "manager.urls",
                &self.urls,
                "name at least one manager, such as \"http://manager1:7000\"",
            ));
        }
        let plain = if self.allow_http {
            rfaas_tls::PlainHttp::Allowed
        } else {
            rfaas_tls::PlainHttp::LoopbackOnly
        };
        let mut urls = Vec::with_capacity(self.urls.len());
        for url in &self.urls {
            let checked = rfaas_tls::manager_url(url, plain)
                .map_err(|e| invalid("manager.urls", url, &e.to_string()))?;
            urls.push(checked);
        }
        if let Some(ca) = &self.ca_file {
            rfaas_tls::agent(
                &rfaas_tls::AgentOptions::new(std::time::Duration::from_secs(1))
                    .ca_file(Some(ca.clone())),
            )
            .map_err(|e| invalid("manager.ca_file", ca, &e.to_string()))?;
        }
        if let Some(a) = &self.advertise {
            if a.rsplit_once(':')
                .and_then(|(_, p)| p.parse::<u16>().ok())
                .is_none()
            {
                return Err(invalid("manager.advertise", a, "use host:port"));
            }
        }
        let max_backoff_ms = match self.max_backoff_ms {
            Some(0) => return Err(invalid("manager.max_backoff_ms", &0, "use at least 1")),
            Some(v) => v,
            None => 30_000,
        };
        Ok(ManagerSettings {
            urls,
            ca_file: self.ca_file.clone(),
            credential_file: self
                .credential_file
                .clone()
                .unwrap_or_else(|| dir.file(NODE_CREDENTIAL)),
            advertise: self.advertise.clone(),
            max_backoff_ms,
            harvested: self.harvested,
        })
    }
}

/// How workers are isolated beyond their uid, pinning and memory limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Sandbox {
    /// Workers see the node's file system (as their user).
    None,
    /// Each worker runs under `bwrap` in its own pid/ipc/uts namespaces,
    /// with a read-only root, a private /tmp and only its allocation's
    /// runtime directory writable. No worker pool.
    Bubblewrap,
}

/// What is wrong with the configuration.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The file could not be read.
    #[error(transparent)]
    Read(#[from] Unreadable),
    /// The file is not valid TOML for this daemon.
    #[error("the configuration file {path} is invalid: {message}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// toml's account, with the line.
        message: String,
    },
    /// A key has a value the daemon cannot use.
    #[error("configuration key `{key}` = {value:?} is invalid: {why}")]
    Invalid {
        /// The key.
        key: &'static str,
        /// Its value.
        value: String,
        /// What is wrong and what is expected.
        why: String,
    },
}

/// TLS on the control port: the certificate and key files (reloaded on
/// SIGHUP), and whether a client that does not start TLS is refused.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ControlTls {
    /// The certificate chain, PEM.
    pub cert: PathBuf,
    /// Its key, PEM.
    pub key: PathBuf,
    /// Plain connections are refused.
    pub required: bool,
}

/// The checked configuration the daemon runs with.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Settings {
    /// This node's name.
    pub node_name: String,
    /// Control listener address.
    pub control_listen: SocketAddr,
    /// TLS on the control port, when configured.
    pub control_tls: Option<ControlTls>,
    /// Host for tcp worker listeners.
    pub fabric_host: String,
    /// Providers served.
    pub providers: Vec<String>,
    /// CPUs (or logical slots when `pin` is false), ascending.
    #[serde(serialize_with = "cpulist")]
    pub cpus: Vec<u32>,
    /// Whether lanes are pinned.
    pub pin: bool,
    /// Whether the daemon refuses to start without a cgroup per
    /// allocation.
    pub enforce_isolation: bool,
    /// Memory granted to allocations, MiB.
    pub memory_mib: u32,
    /// Files of the public keys lease tokens are checked with.
    pub lease_keys: Vec<PathBuf>,
    /// The node tools' unix socket.
    pub local_socket: PathBuf,
    /// Per-allocation directories go here.
    pub runtime_dir: PathBuf,
    /// Idle workers kept.
    pub pool_size: u32,
    /// Allocated workers keep running when the daemon stops (SIGTERM) or
    /// dies, and the next daemon adopts them; false: SIGTERM stops them
    /// and they die with the daemon (parent-death signal).
    pub workers_outlive_daemon: bool,
    /// How long an adopted allocation waits for its client to attach
    /// before it ends as a closed connection's allocations do.
    pub attach_grace: std::time::Duration,
    /// The worker binary.
    pub worker_path: PathBuf,
    /// Isolation.
    pub sandbox: Sandbox,
    /// The lowest uid a worker runs as.
    pub min_worker_uid: u32,
    /// Users (names or uids) workers never run as.
    pub deny_users: Vec<String>,
    /// The bwrap binary.
    pub bwrap_path: PathBuf,
    /// Largest library, bytes.
    pub max_library_bytes: u32,
    /// Most lanes per allocation.
    pub max_lanes: u16,
    /// Largest input buffer.
    pub max_input_capacity: u32,
    /// Largest output buffer.
    pub max_output_capacity: u32,
    /// Default deadline, ms.
    pub default_deadline_ms: u64,
    /// Longest deadline, ms.
    pub max_deadline_ms: u64,
    /// Worker load-and-listen timeout, ms.
    pub worker_ready_timeout_ms: u64,
    /// Control connections at once.
    pub max_connections: u32,
    /// Control connections at once from one address.
    pub max_connections_per_address: u32,
    /// A request's header and JSON, ms.
    pub request_timeout_ms: u64,
    /// A checked request's library, ms.
    pub library_timeout_ms: u64,
    /// A connection without an allocation and without a request, ms.
    pub idle_timeout_ms: u64,
    /// Libraries being received, MiB.
    pub library_memory_mib: u32,
    /// Allocation threads.
    pub request_threads: u32,
    /// Log level.
    #[serde(serialize_with = "shown")]
    pub log_level: tracing::Level,
    /// The `/metrics` and `/healthz` listener, when configured.
    pub metrics_listen: Option<SocketAddr>,
    /// Registration with the managers, when configured.
    pub manager: Option<ManagerSettings>,
    /// Posting usage to accounting services.
    pub billing: BillingSettings,
    /// Slurm's view of this node, when configured.
    pub slurm: Option<SlurmSettings>,
    /// The configuration directory the default files came from.
    #[serde(skip)]
    pub config_dir: ConfigDir,
    /// Where the values the host supplied came from (`node_name`,
    /// `fabric_host`, `cpus`, `memory_mib`), for the start's log and
    /// `--check-config`.
    #[serde(skip)]
    pub sources: BTreeMap<&'static str, Source>,
    /// What the daemon fell back on, for a warning at start.
    #[serde(skip)]
    pub notes: Vec<String>,
}

impl Settings {
    /// Whether workers outlive the daemon: `workers_outlive_daemon`,
    /// without a sandbox (bubblewrap's `--die-with-parent` ties a
    /// sandboxed worker to the daemon).
    pub fn workers_outlive(&self) -> bool {
        self.workers_outlive_daemon && self.sandbox == Sandbox::None
    }
}

/// The default place of the node tools' socket (one definition, in
/// rfaas-proto, which the Slurm hooks share).
pub const DEFAULT_LOCAL_SOCKET: &str = rfaas_proto::control::local::DEFAULT_LOCAL_SOCKET;

impl Config {
    /// Reads and parses `path`.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = files::read_named(path)?;
        Config::parse(&text).map_err(|message| ConfigError::Parse {
            path: path.to_owned(),
            message,
        })
    }

    /// The configuration the daemon starts with: `path` (`--config`) when
    /// given (it must load), else `executord.toml` in `dir` when it exists,
    /// else the defaults.
    pub fn load_or_default(path: Option<&Path>, dir: &ConfigDir) -> Result<Config, ConfigError> {
        match dir.read_own(path, EXECUTORD_TOML)? {
            Some((path, text)) => {
                Config::parse(&text).map_err(|message| ConfigError::Parse { path, message })
            }
            None => Ok(Config::default()),
        }
    }

    /// Parses TOML text.
    pub fn parse(text: &str) -> Result<Config, String> {
        toml::from_str(text).map_err(|e| e.to_string())
    }

    /// Fills in defaults (files in `/etc/rfaas`) and checks every value.
    pub fn resolve(&self) -> Result<Settings, ConfigError> {
        self.resolve_in(&ConfigDir::default())
    }

    /// Fills in defaults (files in `dir`, the rest from this host) and
    /// checks every value.
    pub fn resolve_in(&self, dir: &ConfigDir) -> Result<Settings, ConfigError> {
        self.resolve_with(dir, &host::System::default())
    }

    /// Fills in defaults (files in `dir`, the rest from what `probe` says
    /// of the host) and checks every value.
    pub fn resolve_with(
        &self,
        dir: &ConfigDir,
        probe: &dyn host::Probe,
    ) -> Result<Settings, ConfigError> {
        let invalid =
            |key: &'static str, value: &dyn std::fmt::Debug, why: &str| ConfigError::Invalid {
                key,
                value: format!("{value:?}"),
                why: why.to_owned(),
            };
        let mut sources = BTreeMap::new();
        let mut notes = Vec::new();
        let mut slurmd = || match probe.slurmd() {
            Some(Ok(node)) => Some(node),
            Some(Err(e)) => {
                notes.push(format!(
                    "slurmd -C gave nothing usable ({e}); the kernel's view is used"
                ));
                None
            }
            None => None,
        };
        let node = if self.node_name.is_none() || self.cpus.is_none() || self.memory_mib.is_none() {
            slurmd()
        } else {
            None
        };
        let node_name = match (&self.node_name, &node) {
            (Some(n), _) if n.trim().is_empty() => {
                return Err(invalid("node_name", n, "it must not be empty"))
            }
            (Some(n), _) => n.clone(),
            (None, Some(node)) => {
                sources.insert("node_name", Source::Slurmd);
                node.name.clone()
            }
            (None, None) => {
                sources.insert("node_name", Source::Hostname);
                let name = probe.hostname().map_err(|e| {
                    invalid(
                        "node_name",
                        &"",
                        &format!("the host name cannot be read ({e}); set node_name"),
                    )
                })?;
                host::short_name(&name).to_owned()
            }
        };
        // The host name too: it must be a name the managers take.
        rfaas_proto::node_name::check(&node_name).map_err(|e| {
            invalid(
                "node_name",
                &node_name,
                &format!("{e}; set node_name to the node's name in Slurm"),
            )
        })?;
        let listen = self.control_listen.as_deref().unwrap_or("0.0.0.0:7100");
        let control_listen: SocketAddr = listen.parse().map_err(|e| {
            invalid(
                "control_listen",
                &listen,
                &format!("expected an IP address and port such as \"0.0.0.0:7100\" ({e})"),
            )
        })?;
        let control_tls = match (&self.control_tls_cert, &self.control_tls_key) {
            (Some(cert), Some(key)) => Some(ControlTls {
                cert: cert.clone(),
                key: key.clone(),
                required: self.require_control_tls.unwrap_or(true),
            }),
            (None, None) if self.require_control_tls == Some(true) => {
                return Err(invalid(
                    "require_control_tls",
                    &true,
                    "TLS cannot be required without a certificate; set control_tls_cert and control_tls_key",
                ))
            }
            (None, None) => None,
            (cert, _) => {
                return Err(invalid(
                    if cert.is_some() { "control_tls_key" } else { "control_tls_cert" },
                    &"",
                    "control_tls_cert and control_tls_key go together: name both for TLS on the control port, or neither",
                ))
            }
        };
        let providers = self
            .providers
            .clone()
            .unwrap_or_else(|| vec!["tcp".into(), "shm".into()]);
        if providers.is_empty() {
            return Err(invalid(
                "providers",
                &providers,
                "name at least one provider",
            ));
        }
        for p in &providers {
            if !(p == "tcp" || p == "shm" || p.starts_with("verbs:")) {
                return Err(invalid(
                    "providers",
                    &providers,
                    &format!("unknown provider {p:?}; use \"tcp\", \"shm\" or \"verbs:<device>\""),
                ));
            }
        }
        let cpus = match &self.cpus {
            Some(list) => parse_cpulist(list).map_err(|why| invalid("cpus", list, &why))?,
            None => {
                sources.insert(
                    "cpus",
                    node.as_ref().map_or(Source::Machine, |_| Source::Slurmd),
                );
                let reserve = self.reserve_cpus.unwrap_or(0);
                host::lent_cpus(&probe.online_cpus(), node.as_ref().map(|n| n.cpus), reserve)
                    .map_err(|why| invalid("reserve_cpus", &reserve, &why))?
            }
        };
        if cpus.is_empty() {
            return Err(invalid("cpus", &self.cpus, "grant at least one CPU"));
        }
        if self.enforce_isolation == Some(true) && self.pin == Some(false) {
            return Err(invalid(
                "enforce_isolation",
                &true,
                "it holds each allocation to its leased CPUs, which pin = false makes logical \
                 slots; set pin = true, or enforce_isolation = false",
            ));
        }
        let memory_mib = match self.memory_mib {
            Some(0) => return Err(invalid("memory_mib", &0, "grant at least 1 MiB")),
            Some(m) => m,
            None => {
                let (total, source) = match &node {
                    Some(n) => (n.real_memory_mib, Source::Slurmd),
                    None => (probe.memory_mib(), Source::Machine),
                };
                sources.insert("memory_mib", source);
                let reserve = self
                    .reserve_memory_mib
                    .unwrap_or(DEFAULT_RESERVE_MEMORY_MIB);
                host::lent_memory_mib(total, reserve)
                    .map_err(|why| invalid("reserve_memory_mib", &reserve, &why))?
            }
        };
        let max_library_mib = self.max_library_mib.unwrap_or(64);
        if max_library_mib == 0 || max_library_mib > 4095 {
            return Err(invalid(
                "max_library_mib",
                &max_library_mib,
                "use 1 to 4095",
            ));
        }
        let max_lanes = self.max_lanes.unwrap_or(64);
        if max_lanes == 0 {
            return Err(invalid("max_lanes", &0, "allow at least one lane"));
        }
        let max_input_capacity = self.max_input_capacity.unwrap_or(16 << 20);
        if (max_input_capacity as usize) < rfaas_proto::InvocationHeader::LEN {
            return Err(invalid(
                "max_input_capacity",
                &max_input_capacity,
                "it must hold at least the 32-byte invocation header",
            ));
        }
        let default_deadline_ms = self.default_deadline_ms.unwrap_or(60_000);
        let max_deadline_ms = self.max_deadline_ms.unwrap_or(3_600_000);
        if default_deadline_ms == 0 || default_deadline_ms > max_deadline_ms {
            return Err(invalid(
                "default_deadline_ms",
                &default_deadline_ms,
                &format!("use 1 to max_deadline_ms ({max_deadline_ms})"),
            ));
        }
        let worker_path = match &self.worker_path {
            Some(p) => p.clone(),
            None => default_worker_path().map_err(|e| {
                invalid(
                    "worker_path",
                    &"",
                    &format!("the daemon's own path cannot be read ({e}); set worker_path"),
                )
            })?,
        };
        let positive = |key: &'static str, value: Option<u64>, default: u64| match value {
            Some(0) => Err(invalid(key, &0, "use a value of at least 1")),
            Some(v) => Ok(v),
            None => Ok(default),
        };
        let max_connections =
            positive("max_connections", self.max_connections.map(u64::from), 1024)?;
        let max_connections_per_address = positive(
            "max_connections_per_address",
            self.max_connections_per_address.map(u64::from),
            256,
        )?;
        let request_timeout_ms = positive("request_timeout_ms", self.request_timeout_ms, 10_000)?;
        let library_timeout_ms = positive("library_timeout_ms", self.library_timeout_ms, 120_000)?;
        let idle_timeout_ms = positive("idle_timeout_ms", self.idle_timeout_ms, 60_000)?;
        let request_threads = positive("request_threads", self.request_threads.map(u64::from), 8)?;
        let library_memory_mib = self.library_memory_mib.unwrap_or(256.max(max_library_mib));
        if library_memory_mib < max_library_mib {
            return Err(invalid(
                "library_memory_mib",
                &library_memory_mib,
                &format!(
                    "it must hold at least one library of max_library_mib ({max_library_mib}) MiB"
                ),
            ));
        }
        let metrics_listen = match &self.metrics_listen {
            Some(a) => Some(a.parse::<SocketAddr>().map_err(|e| {
                invalid(
                    "metrics_listen",
                    a,
                    &format!("expected an IP address and port such as \"127.0.0.1:9108\" ({e})"),
                )
            })?),
            None => None,
        };
        let lease_keys = self
            .lease_keys
            .clone()
            .unwrap_or_else(|| vec![dir.file(LEASE_KEYS_PUB)]);
        if lease_keys.is_empty() {
            return Err(invalid(
                "lease_keys",
                &lease_keys,
                "name at least one public key file (the manager's); with none every lease is refused",
            ));
        }
        let manager = self.manager.as_ref().map(|m| m.resolve(dir)).transpose()?;
        let fabric_host = match (&self.fabric_host, &manager) {
            (Some(h), _) => h.clone(),
            (None, None) => "127.0.0.1".to_owned(),
            (None, Some(m)) => {
                let first = &m.urls[0];
                match url_host_port(first).and_then(|(h, p)| probe.route_to(&h, p)) {
                    Ok(ip) => {
                        sources.insert("fabric_host", Source::Route);
                        ip.to_string()
                    }
                    Err(e) => {
                        notes.push(format!(
                            "no route to the manager {first} ({e}): workers listen on 127.0.0.1, \
                             which only clients on this node reach; set fabric_host to this \
                             node's address on the cluster network"
                        ));
                        "127.0.0.1".to_owned()
                    }
                }
            }
        };
        let level = self.log_level.as_deref().unwrap_or("info");
        let log_level: tracing::Level = level
            .parse()
            .map_err(|_| invalid("log_level", &level, "use error, warn, info, debug or trace"))?;
        Ok(Settings {
            control_listen,
            control_tls,
            fabric_host,
            providers,
            cpus,
            pin: self.pin.unwrap_or(true),
            enforce_isolation: self.enforce_isolation.unwrap_or(false),
            memory_mib,
            lease_keys,
            local_socket: self
                .local_socket
                .clone()
                .unwrap_or_else(|| PathBuf::from(DEFAULT_LOCAL_SOCKET)),
            runtime_dir: self
                .runtime_dir
                .clone()
                .unwrap_or_else(|| PathBuf::from("/run/rfaas/workers")),
            pool_size: self.pool_size.unwrap_or(2),
            workers_outlive_daemon: self.workers_outlive_daemon.unwrap_or(true),
            attach_grace: match self.attach_grace_s.unwrap_or(60) {
                s @ 1..=86_400 => std::time::Duration::from_secs(s),
                s => {
                    return Err(invalid(
                        "attach_grace_s",
                        &s,
                        "it must be 1 to 86400 seconds (a client reconnects within its \
                         reattach grace, 30 s by default)",
                    ))
                }
            },
            worker_path,
            sandbox: self.sandbox.unwrap_or(Sandbox::None),
            min_worker_uid: self
                .min_worker_uid
                .unwrap_or_else(|| uid_min(Path::new(LOGIN_DEFS))),
            deny_users: self
                .deny_users
                .clone()
                .unwrap_or_else(|| vec!["root".to_owned()]),
            bwrap_path: self
                .bwrap_path
                .clone()
                .unwrap_or_else(|| PathBuf::from("bwrap")),
            max_library_bytes: max_library_mib << 20,
            max_lanes,
            max_input_capacity,
            max_output_capacity: self.max_output_capacity.unwrap_or(16 << 20),
            default_deadline_ms,
            max_deadline_ms,
            worker_ready_timeout_ms: self.worker_ready_timeout_ms.unwrap_or(10_000),
            max_connections: max_connections as u32,
            max_connections_per_address: max_connections_per_address as u32,
            request_timeout_ms,
            library_timeout_ms,
            idle_timeout_ms,
            library_memory_mib,
            request_threads: request_threads as u32,
            log_level,
            metrics_listen,
            manager,
            billing: self
                .billing
                .as_ref()
                .map(BillingConfig::resolve)
                .transpose()?
                .unwrap_or_default(),
            slurm: self
                .slurm
                .as_ref()
                .map(|s| s.resolve(&node_name))
                .transpose()?,
            node_name,
            config_dir: dir.clone(),
            sources,
            notes,
        })
    }
}

/// Memory kept for the system when `memory_mib` is not set, MiB: room for
/// the kernel, slurmd, this daemon and the page cache of a node whose
/// Slurm jobs take the rest.
pub const DEFAULT_RESERVE_MEMORY_MIB: u32 = 1024;

/// `[slurm] reconcile_interval_ms` when not set: a round (two slurmctld
/// RPCs) every 120 s on average is one RPC per node per minute, what a
/// cluster of any size can afford.
pub const DEFAULT_RECONCILE_INTERVAL_MS: u64 = 120_000;

/// The system's account policy, read for `UID_MIN`.
const LOGIN_DEFS: &str = "/etc/login.defs";

/// `UID_MIN` from login.defs file `path` (the first uid of people, not
/// system accounts); 1000, the common default, without it.
pub fn uid_min(path: &Path) -> u32 {
    std::fs::read_to_string(path)
        .ok()
        .and_then(|text| {
            text.lines().find_map(|l| {
                let mut words = l.split_whitespace();
                (words.next() == Some("UID_MIN"))
                    .then(|| words.next()?.parse().ok())
                    .flatten()
            })
        })
        .unwrap_or(1000)
}

/// The cpulist parser lives with the host's values (`/sys`'s lists are
/// read there); the configuration names it here too.
pub use super::host::parse_cpulist;

/// Parses a cpulist keeping its order (`"4-7,0-3"` → 4, 5, 6, 7, 0, 1,
/// 2, 3); a CPU named twice is an error.
pub fn parse_ordered_cpulist(list: &str) -> Result<Vec<u32>, String> {
    let mut out = Vec::new();
    let mut seen = std::collections::BTreeSet::new();
    for part in list.split(',').map(str::trim) {
        let num = |s: &str| {
            s.trim()
                .parse::<u32>()
                .map_err(|_| format!("{s:?} is not a CPU number"))
        };
        let (a, b) = match part.split_once('-') {
            Some((a, b)) => (num(a)?, num(b)?),
            None => (num(part)?, num(part)?),
        };
        if a > b {
            return Err(format!("the range {part:?} runs backwards"));
        }
        if b - a >= 65_536 {
            return Err(format!("the range {part:?} is too long"));
        }
        for c in a..=b {
            if !seen.insert(c) {
                return Err(format!("CPU {c} is named twice"));
            }
            out.push(c);
        }
    }
    Ok(out)
}

/// Formats CPUs as a cpulist (`[0,1,2,5]` → `"0-2,5"`).
pub fn format_cpulist(cpus: &[u32]) -> String {
    let mut out = Vec::new();
    let mut i = 0;
    while i < cpus.len() {
        let start = cpus[i];
        let mut end = start;
        while i + 1 < cpus.len() && cpus[i + 1] == end + 1 {
            i += 1;
            end = cpus[i];
        }
        out.push(if start == end {
            start.to_string()
        } else {
            format!("{start}-{end}")
        });
        i += 1;
    }
    out.join(",")
}

fn cpulist<S: serde::Serializer>(cpus: &[u32], s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&format_cpulist(cpus))
}

fn shown<S: serde::Serializer>(v: &impl std::fmt::Display, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(v)
}

/// The host and port of manager URL `url` (checked, `scheme://host[:port]`).
fn url_host_port(url: &str) -> std::io::Result<(String, u16)> {
    let bad = || std::io::Error::new(std::io::ErrorKind::InvalidInput, "not scheme://host:port");
    let (scheme, rest) = url.split_once("://").ok_or_else(bad)?;
    let authority = rest.split('/').next().unwrap_or(rest);
    let default = if scheme == "https" { 443 } else { 80 };
    let (host, port) = match authority.rsplit_once(':') {
        Some((h, p)) if !p.contains(']') => (h, p.parse().map_err(|_| bad())?),
        _ => (authority, default),
    };
    Ok((
        host.trim_start_matches('[')
            .trim_end_matches(']')
            .to_owned(),
        port,
    ))
}

fn default_worker_path() -> std::io::Result<PathBuf> {
    let exe = std::env::current_exe()?;
    Ok(exe.with_file_name("rfaas-worker"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A host with fixed answers; counts how often slurmd is asked.
    struct Fixed {
        slurmd: Option<host::SlurmdNode>,
        route: Option<std::net::IpAddr>,
        asked: std::cell::Cell<u32>,
    }

    impl host::Probe for Fixed {
        fn slurmd(&self) -> Option<Result<host::SlurmdNode, String>> {
            self.asked.set(self.asked.get() + 1);
            self.slurmd.clone().map(Ok)
        }
        fn hostname(&self) -> std::io::Result<String> {
            Ok("cn08.cluster.example".into())
        }
        fn route_to(&self, host: &str, port: u16) -> std::io::Result<std::net::IpAddr> {
            assert_eq!((host, port), ("manager1", 7300), "the first manager's");
            self.route
                .ok_or_else(|| std::io::Error::other("network is unreachable"))
        }
        fn online_cpus(&self) -> Vec<u32> {
            (0..8).collect()
        }
        fn memory_mib(&self) -> u64 {
            16_000
        }
    }

    fn fixed(slurmd: bool, route: bool) -> Fixed {
        Fixed {
            slurmd: slurmd.then(|| host::SlurmdNode {
                name: "cn07".into(),
                cpus: 4,
                real_memory_mib: 8192,
            }),
            route: route.then(|| [10, 1, 0, 17].into()),
            asked: 0.into(),
        }
    }

    /// The shipped example with `[manager]` and its `urls` uncommented:
    /// what an admin changes on every node.
    fn example_with_manager() -> Config {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("rfaas-executord.example.toml");
        let text = std::fs::read_to_string(path).unwrap();
        let text: String = text
            .lines()
            .map(|l| match l {
                "# [manager]" => "[manager]",
                l if l.starts_with("# urls = ") => &l[2..],
                l => l,
            })
            .map(|l| format!("{l}\n"))
            .collect();
        Config::parse(&text).unwrap()
    }

    #[test]
    fn the_example_with_a_manager_url_takes_the_rest_from_the_host() {
        let dir = ConfigDir::resolve(Some(Path::new("/etc/site-rfaas")));
        let host = fixed(true, true);
        let s = example_with_manager().resolve_with(&dir, &host).unwrap();
        assert_eq!(s.node_name, "cn07", "slurmd -C's NodeName");
        assert_eq!(s.fabric_host, "10.1.0.17", "the route to manager1");
        assert_eq!(s.cpus, [0, 1, 2, 3], "as many as slurmd counts");
        assert_eq!(s.memory_mib, 8192 - 1024, "RealMemory less the reserve");
        assert_eq!(host.asked.get(), 1, "slurmd -C runs once");
        assert_eq!(
            s.sources,
            BTreeMap::from([
                ("node_name", Source::Slurmd),
                ("fabric_host", Source::Route),
                ("cpus", Source::Slurmd),
                ("memory_mib", Source::Slurmd),
            ])
        );
        let m = s.manager.unwrap();
        assert_eq!(
            m.credential_file,
            Path::new("/etc/site-rfaas/node.credential")
        );
        assert_eq!(s.lease_keys, [Path::new("/etc/site-rfaas/lease-keys.pub")]);
        assert!(s.notes.is_empty(), "{:?}", s.notes);
    }

    #[test]
    fn without_slurmd_the_host_name_and_the_kernel_less_the_reserves() {
        let host = fixed(false, false);
        let c = Config::parse("reserve_cpus = 2\nreserve_memory_mib = 2000\n").unwrap();
        let s = c.resolve_with(&ConfigDir::default(), &host).unwrap();
        assert_eq!(s.node_name, "cn08", "the short host name");
        assert_eq!(s.cpus, [0, 1, 2, 3, 4, 5], "the two highest are kept");
        assert_eq!(s.memory_mib, 14_000);
        assert_eq!(s.fabric_host, "127.0.0.1", "no manager: this node only");
        assert_eq!(s.sources["node_name"], Source::Hostname);
        assert_eq!(s.sources["cpus"], Source::Machine);
        assert!(!s.sources.contains_key("fabric_host"), "a default");
        let e = Config::parse("reserve_memory_mib = 16000")
            .unwrap()
            .resolve_with(&ConfigDir::default(), &host)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("reserve_memory_mib") && e.contains("16000 MiB"),
            "{e}"
        );
    }

    #[test]
    fn no_route_to_the_manager_is_loopback_with_a_warning() {
        let s = example_with_manager()
            .resolve_with(&ConfigDir::default(), &fixed(true, false))
            .unwrap();
        assert_eq!(s.fabric_host, "127.0.0.1");
        assert_eq!(s.notes.len(), 1);
        assert!(
            s.notes[0].contains("https://manager1:7300")
                && s.notes[0].contains("network is unreachable")
                && s.notes[0].contains("set fabric_host"),
            "{}",
            s.notes[0]
        );
    }

    #[test]
    fn explicit_settings_win_and_ask_nothing() {
        let host = fixed(true, true);
        let text =
            "node_name = \"n1\"\ncpus = \"6-7\"\nmemory_mib = 100\nfabric_host = \"10.9.9.9\"\n\
                    [manager]\nurls = [\"https://manager1:7300\"]\n";
        let s = Config::parse(text)
            .unwrap()
            .resolve_with(&ConfigDir::default(), &host)
            .unwrap();
        assert_eq!(
            (
                s.node_name.as_str(),
                s.cpus.as_slice(),
                s.memory_mib,
                s.fabric_host.as_str()
            ),
            ("n1", &[6, 7][..], 100, "10.9.9.9")
        );
        assert!(s.sources.is_empty());
        assert_eq!(host.asked.get(), 0, "slurmd -C is not run");
    }

    #[test]
    fn enforced_isolation_needs_real_cpus() {
        let text = "cpus = \"0\"\nmemory_mib = 64\nenforce_isolation = true\n";
        let s = Config::parse(text).unwrap().resolve().unwrap();
        assert!(s.enforce_isolation && s.pin);
        let err = Config::parse(&format!("{text}pin = false\n"))
            .unwrap()
            .resolve()
            .unwrap_err()
            .to_string();
        assert!(err.contains("enforce_isolation"), "{err}");
        assert!(err.contains("set pin = true"), "{err}");
    }

    #[test]
    fn cpulists() {
        assert_eq!(
            parse_cpulist("0-3,8, 10-11").unwrap(),
            [0, 1, 2, 3, 8, 10, 11]
        );
        assert_eq!(parse_cpulist("2,1,2").unwrap(), [1, 2]);
        assert!(parse_cpulist("3-1").unwrap_err().contains("backwards"));
        assert!(parse_cpulist("a").unwrap_err().contains("not a CPU number"));
        assert_eq!(format_cpulist(&[0, 1, 2, 5, 7, 8]), "0-2,5,7-8");
        assert_eq!(format_cpulist(&[]), "");
    }

    #[test]
    fn node_names_follow_the_one_pattern() {
        let resolve = |name: &str| {
            let name = toml::Value::String(name.into());
            Config::parse(&format!(
                "node_name = {name}\ncpus = \"0\"\nmemory_mib = 64\n"
            ))
            .unwrap()
            .resolve()
        };
        for name in [
            ".", "..", "../n1", "a/b", "a\u{7}b", "-n", "a..b", "n1.", "n 1",
        ] {
            let err = resolve(name).unwrap_err().to_string();
            assert!(
                err.contains("node_name") && err.contains(rfaas_proto::node_name::PATTERN),
                "{name:?}: {err}"
            );
        }
        for name in ["node01", "gpu-3", "cn_12", "node1.cluster"] {
            assert_eq!(resolve(name).unwrap().node_name, name);
        }
    }

    #[test]
    fn uid_min_comes_from_login_defs() {
        let dir = std::env::temp_dir().join(format!("rfaas-login-defs-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let defs = dir.join("login.defs");
        std::fs::write(
            &defs,
            "# UID_MIN 5
UID_MAX 60000
UID_MIN		 2000
",
        )
        .unwrap();
        assert_eq!(uid_min(&defs), 2000);
        std::fs::write(
            &defs,
            "UID_MIN lots
",
        )
        .unwrap();
        assert_eq!(uid_min(&defs), 1000);
        assert_eq!(uid_min(&dir.join("absent")), 1000);
        std::fs::remove_dir_all(&dir).unwrap();
        let s = Config::parse(
            "node_name = \"n1\"\nmin_worker_uid = 500\ndeny_users = [\"slurm\", \"0\"]\n",
        )
        .unwrap()
        .resolve()
        .unwrap();
        assert_eq!(
            (s.min_worker_uid, s.deny_users.as_slice()),
            (500, &["slurm".to_owned(), "0".to_owned()][..])
        );
        let s = Config::parse("node_name = \"n1\"\n")
            .unwrap()
            .resolve()
            .unwrap();
        assert_eq!(s.deny_users, ["root"]);
    }

    #[test]
    fn defaults_and_checks() {
        let c = Config::parse("node_name = \"n1\"\ncpus = \"0-1\"\nmemory_mib = 512\n").unwrap();
        let s = c.resolve().unwrap();
        assert_eq!(s.node_name, "n1");
        assert_eq!(s.cpus, [0, 1]);
        assert!(s.pin);
        assert_eq!(s.providers, ["tcp", "shm"]);
        assert_eq!(s.pool_size, 2);
        assert!(s.workers_outlive_daemon);
        assert_eq!(s.attach_grace, std::time::Duration::from_secs(60));
        let base = "node_name = \"n1\"\ncpus = \"0-1\"\nmemory_mib = 512\n";
        let s5 = Config::parse(&format!("{base}attach_grace_s = 5\n"))
            .unwrap()
            .resolve()
            .unwrap();
        assert_eq!(s5.attach_grace, std::time::Duration::from_secs(5));
        let err = Config::parse(&format!("{base}attach_grace_s = 0\n"))
            .unwrap()
            .resolve()
            .unwrap_err();
        assert!(err.to_string().contains("attach_grace_s"), "{err}");
        assert_eq!(s.local_socket, Path::new(DEFAULT_LOCAL_SOCKET));
        assert_eq!(s.lease_keys, [Path::new("/etc/rfaas/lease-keys.pub")]);
        let err = Config::parse("lease_keys = []")
            .unwrap()
            .resolve()
            .unwrap_err();
        assert!(err.to_string().contains("lease_keys"), "{err}");
        assert_eq!(s.worker_path.file_name().unwrap(), "rfaas-worker");

        assert_eq!(
            (
                s.max_connections,
                s.max_connections_per_address,
                s.library_memory_mib
            ),
            (1024, 256, 256)
        );
        let err = Config::parse("max_library_mib = 100\nlibrary_memory_mib = 64")
            .unwrap()
            .resolve()
            .unwrap_err();
        assert!(err.to_string().contains("max_library_mib (100)"), "{err}");
        let err = Config::parse("max_connections = 0")
            .unwrap()
            .resolve()
            .unwrap_err();
        assert!(err.to_string().contains("max_connections"), "{err}");

        let err = Config::parse("colour = 1").unwrap_err();
        assert!(err.contains("colour"), "{err}");
        let err = Config::parse("providers = [\"udp\"]")
            .unwrap()
            .resolve()
            .unwrap_err();
        assert!(
            err.to_string().contains("unknown provider \"udp\""),
            "{err}"
        );
        let err = Config::parse("control_listen = \"nowhere\"")
            .unwrap()
            .resolve()
            .unwrap_err();
        assert!(err.to_string().contains("control_listen"), "{err}");
    }

    #[test]
    fn billing_table_checks() {
        let resolve = |t: &str| Config::parse(t).unwrap().resolve();
        assert_eq!(resolve("").unwrap().billing, BillingSettings::default());
        let s = resolve(
            "[billing]\ngranularity_ms = 250\njournal = \"/var/lib/rfaas/billing.jsonl\"\n",
        )
        .unwrap()
        .billing;
        assert_eq!(s.granularity_ms, 250);
        assert_eq!(s.keep_ended_s, 300);
        assert_eq!(
            s.journal.as_deref(),
            Some(Path::new("/var/lib/rfaas/billing.jsonl"))
        );
        let e = resolve("[billing]\ngranularity_ms = 0\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("billing.granularity_ms"), "{e}");
        assert!(Config::parse("[billing]\ngranularity = 1\n").is_err());
    }

    #[test]
    fn slurm_table_checks() {
        let resolve = |t: &str| Config::parse(t).unwrap().resolve();
        assert_eq!(resolve("").unwrap().slurm, None, "no [slurm]: as before");
        let s = resolve("node_name = \"n7\"\n[slurm]\n")
            .unwrap()
            .slurm
            .unwrap();
        assert_eq!(
            s,
            SlurmSettings {
                node: "n7".into(),
                scontrol: PathBuf::from("scontrol"),
                conf: None,
                reconcile_interval_ms: 120_000,
                timeout_ms: 1000,
                grace_ms: 30_000,
                cpu_map: CpuMap::Index,
                partitions: None,
            }
        );
        let s = resolve(
            "[slurm]\nnode = \"node1\"\nscontrol = \"/usr/bin/scontrol\"\nconf = \"/etc/slurm/slurm.conf\"\nreconcile_interval_ms = 0\ntimeout_ms = 300\ngrace_ms = 0\ncpu_map = \"2-3,0-1\"\n",
        )
        .unwrap()
        .slurm
        .unwrap();
        assert_eq!(s.node, "node1");
        assert_eq!(s.reconcile_interval_ms, 0, "0 turns reconciliation off");
        assert_eq!(s.cpu_map, CpuMap::List(vec![2, 3, 0, 1]));
        assert_eq!(
            resolve("[slurm]\ncpu_map = \"same\"")
                .unwrap()
                .slurm
                .unwrap()
                .cpu_map,
            CpuMap::Same
        );
        for (text, key) in [
            ("[slurm]\ntimeout_ms = 0", "slurm.timeout_ms"),
            ("[slurm]\nnode = \"\"", "slurm.node"),
            ("[slurm]\ncpu_map = \"0,0\"", "named twice"),
            ("[slurm]\ncpu_map = \"cores\"", "slurm.cpu_map"),
            ("[slurm]\npartitions = [\"a b\"]", "slurm.partitions"),
            ("[slurm]\npartitions = [\"gpu\", \"gpu\"]", "listed twice"),
        ] {
            let err = resolve(text).unwrap_err().to_string();
            assert!(err.contains(key), "{text}: {err}");
        }
        let s = resolve("[slurm]\npartitions = [\"batch\", \"gpu\"]").unwrap();
        assert_eq!(
            s.slurm.unwrap().partitions,
            Some(vec!["batch".to_owned(), "gpu".to_owned()])
        );
        let err = Config::parse("[slurm]\ninterval_ms = 5").unwrap_err();
        assert!(err.contains("interval_ms"), "{err}");
    }

    #[test]
    fn slurm_cpu_ids_to_the_executors_cpus() {
        let cpus = [2, 3, 5, 8];
        let ids = [0, 2, 5].into();
        assert_eq!(CpuMap::Index.to_cpus(&ids, &cpus), [2, 5], "5 names none");
        assert_eq!(CpuMap::Same.to_cpus(&ids, &cpus), [2, 5], "0 is not ours");
        assert_eq!(
            CpuMap::List(vec![8, 7, 3, 2, 1, 0]).to_cpus(&ids, &cpus),
            [3, 8]
        );
    }

    #[test]
    fn manager_table_checks() {
        let resolve = |t: &str| Config::parse(t).unwrap().resolve();
        assert_eq!(resolve("").unwrap().manager, None);
        let s = resolve("[manager]\nurls = [\"https://m1:7000/\"]\n").unwrap();
        let m = s.manager.unwrap();
        assert_eq!(m.urls, ["https://m1:7000"], "a trailing slash is dropped");
        assert_eq!(m.credential_file, Path::new("/etc/rfaas/node.credential"));
        assert!(!m.harvested, "a node lends its own capacity unless told");
        let s = resolve("[manager]\nurls = [\"https://m1:7000\"]\nharvested = true\n").unwrap();
        assert!(s.manager.unwrap().harvested);
        // Plain http: to loopback, or where the site allows it.
        resolve("[manager]\nurls = [\"http://127.0.0.1:7000\"]\n").unwrap();
        resolve("[manager]\nurls = [\"http://m1:7000\"]\nallow_http = true\n").unwrap();
        for (text, key) in [
            ("[manager]\nurls = []", "manager.urls"),
            ("[manager]\nurls = [\"http://m1:7000\"]", "in clear"),
            ("[manager]\nurls = [\"https://\"]", "a host"),
            (
                "[manager]\nurls = [\"https://m\"]\nca_file = \"/nonexistent/ca.pem\"",
                "manager.ca_file",
            ),
            (
                "[manager]\nurls = [\"https://m\"]\nadvertise = \"nohost\"",
                "manager.advertise",
            ),
            (
                "[manager]\nurls = [\"https://m\"]\nmax_backoff_ms = 0",
                "manager.max_backoff_ms",
            ),
        ] {
            let err = resolve(text).unwrap_err().to_string();
            assert!(err.contains(key), "{text}: {err}");
        }
        let err = Config::parse("[manager]\nurls = [\"http://m\"]\nurl = 1").unwrap_err();
        assert!(err.contains("url"), "{err}");
    }
}

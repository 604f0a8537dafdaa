//! `manager.toml`: where the manager listens, its database, its keys and
//! its policies. Unknown keys are refused, as `rfaas-executord` does: a
//! misspelt option is an error, not a silent default.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use rfaas_proto::files::{ConfigDir, ADMIN_TOKEN, LEASE_KEY_SECRET};
use rfaas_service::config::{load_toml, parse_toml, ConfigError};
use serde::{Deserialize, Serialize};

use crate::slurm::SlurmSettings;

/// `[accounting] lost_after_ms` when not set.
pub const DEFAULT_ACCOUNTING_LOST_AFTER_MS: u64 = 10_000;

/// `heartbeats_per_s` when not set: up to 500 nodes heartbeat every
/// second, 10,000 every 20 s (docs/sizing.md). The fleet benchmark's grant
/// p99 at 10,000 nodes was 1.5 times its 100-node value at this rate, 2.2
/// times at 1,000 and 10 to 13 times at 2,000.
pub const DEFAULT_HEARTBEATS_PER_S: u64 = 500;

/// The configuration file as written.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    /// `host:port` the REST API listens on.
    pub listen: Option<String>,
    /// `sqlite:///path/to/file.db` or `postgres://user@host:port/db`.
    pub database: Option<String>,
    /// The PostgreSQL password's file (mode 0600), when `database` names
    /// none; default `database.password` in the configuration directory.
    pub database_password_file: Option<PathBuf>,
    /// The admin bearer token's file (root-only).
    pub admin_token_file: Option<PathBuf>,
    /// The Ed25519 secret key file that signs lease tokens.
    pub lease_key_file: Option<PathBuf>,
    /// How often nodes heartbeat, ms: the least interval, which grows
    /// with the fleet (see `heartbeats_per_s`).
    pub heartbeat_interval_ms: Option<u64>,
    /// The heartbeats a second the replicas together take at most: past
    /// `heartbeats_per_s × heartbeat_interval_ms / 1000` nodes the interval
    /// (and `lost_after_ms` with it) grows with the fleet. 0: it never
    /// grows.
    pub heartbeats_per_s: Option<u64>,
    /// How long an accounting ticket (in registration and heartbeat
    /// replies) lasts, seconds.
    pub accounting_ticket_s: Option<u64>,
    /// After how long without a heartbeat a node is lost, ms.
    pub lost_after_ms: Option<u64>,
    /// The longest lease (and renewal) granted, seconds.
    pub max_lease_s: Option<u64>,
    /// The longest a Slurm job credential lasts, seconds (jobs without a
    /// time limit get this).
    pub max_job_credential_s: Option<u64>,
    /// Database connections per replica (default 16 on PostgreSQL, 1 on
    /// SQLite).
    pub max_connections: Option<u32>,
    /// How often each replica reloads its whole view of the nodes and
    /// reaps expired leases and lost nodes, ms.
    pub refresh_ms: Option<u64>,
    /// Per-account caps.
    #[serde(default)]
    pub quota: QuotaConfig,
    /// Billing slots from the accounting services.
    #[serde(default)]
    pub accounting: AccountingConfig,
    /// The server certificate chain (PEM) for HTTPS; with `tls_key`.
    pub tls_cert: Option<PathBuf>,
    /// The server certificate's private key (PEM).
    pub tls_key: Option<PathBuf>,
    /// Serve plain HTTP on an address that is not loopback (default
    /// false: credentials would cross the network in clear).
    #[serde(default)]
    pub allow_http: bool,
    /// The REST port's timeouts and connection caps.
    #[serde(default)]
    pub http: HttpConfig,
    /// How Slurm is asked about jobs.
    #[serde(default)]
    pub slurm: SlurmConfig,
    /// `[retention]`.
    #[serde(default)]
    pub retention: RetentionConfig,
}

/// `[http]`: how long a connection may take and how many there may be.
#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct HttpConfig {
    /// The TLS handshake must end within this, ms (default 10000).
    pub handshake_timeout_ms: Option<u64>,
    /// A request's headers must arrive within this from the moment the
    /// connection waits for them, ms; it also closes a connection idle
    /// between requests (default 10000).
    pub header_timeout_ms: Option<u64>,
    /// A request's body must arrive within this, ms (default 10000).
    pub body_timeout_ms: Option<u64>,
    /// Open connections per replica (default: 8192, or less to stay
    /// below the descriptor limit).
    pub max_connections: Option<u32>,
    /// Open connections from one source address (default 512).
    pub max_connections_per_source: Option<u32>,
}

/// `[slurm]`: how the manager asks Slurm about the jobs nodes speak for
/// ([`crate::slurm`]).
#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct SlurmConfig {
    /// The `squeue` program (default: `squeue` from `PATH`).
    pub squeue: Option<PathBuf>,
    /// The `sacctmgr` program (default: `sacctmgr` from `PATH`).
    pub sacctmgr: Option<PathBuf>,
    /// Whether account coordinators, as Slurm's accounting database
    /// (slurmdbd) records them, read their accounts' usage (default
    /// false: sites without slurmdbd have no coordinators).
    #[serde(default)]
    pub coordinators: bool,
    /// `SLURM_CONF` for them (default: Slurm's own).
    pub conf: Option<PathBuf>,
    /// How long an answer is reused, ms (default 2000).
    pub cache_ms: Option<u64>,
    /// The bound on one Slurm command (`squeue`, `sacctmgr`), ms (default 5000).
    pub timeout_ms: Option<u64>,
    /// Unsafe: take a node's word for its jobs, never asking Slurm
    /// (default false).
    #[serde(default)]
    pub unchecked: bool,
}

/// The checked `[http]` table and TLS files.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct HttpSettings {
    /// HTTPS with this certificate chain and key, or plain HTTP.
    pub tls: Option<(PathBuf, PathBuf)>,
    /// TLS handshake bound, ms.
    pub handshake_timeout_ms: u64,
    /// Header (and idle) bound, ms.
    pub header_timeout_ms: u64,
    /// Body bound, ms.
    pub body_timeout_ms: u64,
    /// Connections per replica; `None`: the default, fitted to the
    /// descriptor limit at start.
    pub max_connections: Option<u32>,
    /// Connections per source address.
    pub max_connections_per_source: u32,
}

/// `[accounting]`: how grants use the accounting services' billing slots.
#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct AccountingConfig {
    /// An accounting instance whose heartbeat (`last_heartbeat_ms`) is
    /// older than this is not given new leases, ms (default 10000).
    pub lost_after_ms: Option<u64>,
    /// Refuse a lease (`503 accounting_unavailable`) rather than grant it
    /// unbilled when no live instance has a free slot (default false).
    #[serde(default)]
    pub required: bool,
}

/// The checked `[accounting]` table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct AccountingSettings {
    /// Instances silent for longer are not used, ms.
    pub lost_after_ms: u64,
    /// No slot: refuse instead of granting unbilled.
    pub required: bool,
}

/// `[retention]`: how long ended leases stay, with their usage and
/// snapshots, before the manager purges them (their usage rolled up per
/// day, which reports keep reading).
#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct RetentionConfig {
    /// Purge at all (default true).
    pub enabled: Option<bool>,
    /// Days an ended lease is kept (default 90).
    pub ended_lease_days: Option<u64>,
    /// Leases per batch, each one transaction (default 1000).
    pub batch: Option<u32>,
    /// Pause between batches, ms (default 100).
    pub pause_ms: Option<u64>,
    /// Time between purges, s (default 3600).
    pub interval_s: Option<u64>,
}

/// The checked `[retention]` table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct RetentionSettings {
    /// Purge at all.
    pub enabled: bool,
    /// Days an ended lease is kept.
    pub ended_lease_days: u64,
    /// Leases per batch.
    pub batch: u32,
    /// Pause between batches, ms.
    pub pause_ms: u64,
    /// Time between purges, s.
    pub interval_s: u64,
}

/// `[quota]`: a cap on the cores an account holds at once.
#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct QuotaConfig {
    /// The cap for accounts not listed (0: no cap).
    #[serde(default)]
    pub default_cores: u32,
    /// Caps by account name (0: no cap).
    #[serde(default)]
    pub accounts: BTreeMap<String, u32>,
}

impl QuotaConfig {
    /// The cap on `account`'s cores, if it has one.
    pub fn cap(&self, account: &str) -> Option<u32> {
        let cap = self
            .accounts
            .get(account)
            .copied()
            .unwrap_or(self.default_cores);
        (cap > 0).then_some(cap)
    }
}

/// The settings the manager runs with, defaults filled in.
#[derive(Debug, Clone, Serialize)]
pub struct Settings {
    /// `host:port` the REST API listens on.
    pub listen: String,
    /// The database URL.
    #[serde(serialize_with = "rfaas_service::config::redacted")]
    pub database: String,
    /// The admin token's file.
    pub admin_token_file: PathBuf,
    /// The lease signing key's file.
    pub lease_key_file: PathBuf,
    /// Heartbeat interval, ms (the least; [`Settings::intervals`]).
    pub heartbeat_interval_ms: u64,
    /// Heartbeats a second the replicas take at most (0: no growth).
    pub heartbeats_per_s: u64,
    /// Accounting ticket lifetime, seconds.
    pub accounting_ticket_s: u64,
    /// Lost after, ms.
    pub lost_after_ms: u64,
    /// Longest lease, seconds.
    pub max_lease_s: u64,
    /// Longest Slurm job credential, seconds.
    pub max_job_credential_s: u64,
    /// Database connections per replica.
    pub max_connections: u32,
    /// Full refresh and reaping period, ms.
    pub refresh_ms: u64,
    /// Quotas.
    pub quota: QuotaConfig,
    /// Billing slots.
    pub accounting: AccountingSettings,
    /// How Slurm is asked about jobs.
    pub slurm: SlurmSettings,
    /// How long ended leases stay.
    pub retention: RetentionSettings,
    /// HTTPS, timeouts and connection caps of the REST port.
    pub http: HttpSettings,
    /// The configuration directory the defaults came from.
    #[serde(skip)]
    pub config_dir: ConfigDir,
}

impl Settings {
    /// The heartbeat interval and loss timeout for `nodes` nodes.
    pub fn intervals(&self, nodes: usize) -> crate::liveness::Intervals {
        crate::liveness::Intervals::of(
            nodes,
            self.heartbeat_interval_ms,
            self.heartbeats_per_s,
            self.lost_after_ms,
            self.refresh_ms,
        )
    }
}

impl FileConfig {
    /// Reads and parses `path`.
    pub fn load(path: &Path) -> Result<FileConfig, ConfigError> {
        load_toml(path)
    }

    /// Parses configuration text.
    pub fn parse(text: &str) -> Result<FileConfig, String> {
        parse_toml(text)
    }

    /// Fills in defaults (files in `dir`) and checks the values.
    pub fn settings(self, dir: &ConfigDir) -> Result<Settings, ConfigError> {
        let database = self
            .database
            .unwrap_or_else(|| crate::db::DEFAULT_URL.into());
        let database =
            crate::db::with_password_file(&database, self.database_password_file.as_deref(), dir)
                .map_err(ConfigError::Unusable)?;
        // SQLite takes one writer at a time: more connections only make
        // them wait in its busy handler (milliseconds), and each connection
        // keeps its own page cache, which every other's commit makes stale.
        let max_connections =
            self.max_connections
                .unwrap_or(match crate::db::Backend::of(&database) {
                    crate::db::Backend::Sqlite => 1,
                    _ => 16,
                });
        let listen = self.listen.unwrap_or_else(|| "127.0.0.1:7300".into());
        let http = http_settings(
            &listen,
            self.tls_cert,
            self.tls_key,
            self.allow_http,
            &self.http,
        )?;
        let s = Settings {
            listen,
            http,
            database,
            admin_token_file: self
                .admin_token_file
                .unwrap_or_else(|| dir.file(ADMIN_TOKEN)),
            lease_key_file: self
                .lease_key_file
                .unwrap_or_else(|| dir.file(LEASE_KEY_SECRET)),
            heartbeat_interval_ms: self.heartbeat_interval_ms.unwrap_or(1000),
            heartbeats_per_s: self.heartbeats_per_s.unwrap_or(DEFAULT_HEARTBEATS_PER_S),
            accounting_ticket_s: self
                .accounting_ticket_s
                .unwrap_or(rfaas_proto::ticket::DEFAULT_LIFETIME_S),
            lost_after_ms: self.lost_after_ms.unwrap_or(10_000),
            max_lease_s: self.max_lease_s.unwrap_or(86_400),
            max_job_credential_s: self.max_job_credential_s.unwrap_or(7 * 86_400),
            max_connections,
            refresh_ms: self.refresh_ms.unwrap_or(1000),
            quota: self.quota,
            accounting: AccountingSettings {
                lost_after_ms: self
                    .accounting
                    .lost_after_ms
                    .unwrap_or(DEFAULT_ACCOUNTING_LOST_AFTER_MS),
                required: self.accounting.required,
            },
            slurm: {
                let d = SlurmSettings::default();
                SlurmSettings {
                    squeue: self.slurm.squeue.unwrap_or(d.squeue),
                    sacctmgr: self.slurm.sacctmgr.unwrap_or(d.sacctmgr),
                    coordinators: self.slurm.coordinators,
                    conf: self.slurm.conf,
                    cache_ms: self.slurm.cache_ms.unwrap_or(d.cache_ms),
                    timeout_ms: self.slurm.timeout_ms.unwrap_or(d.timeout_ms),
                    unchecked: self.slurm.unchecked,
                }
            },
            retention: RetentionSettings {
                enabled: self.retention.enabled.unwrap_or(true),
                ended_lease_days: self.retention.ended_lease_days.unwrap_or(90),
                batch: self.retention.batch.unwrap_or(1000),
                pause_ms: self.retention.pause_ms.unwrap_or(100),
                interval_s: self.retention.interval_s.unwrap_or(3600),
            },
            config_dir: dir.clone(),
        };
        if s.retention.batch == 0 || s.retention.batch > 10_000 || s.retention.interval_s == 0 {
            return Err(ConfigError::Invalid(format!(
                "[retention] batch ({}) must be between 1 and 10000 and interval_s ({}) above 0; the defaults are 1000 and 3600",
                s.retention.batch, s.retention.interval_s
            )));
        }
        if s.accounting.lost_after_ms == 0 {
            return Err(ConfigError::Invalid(
                "[accounting] lost_after_ms must be above 0 (an instance heartbeats once per flush, every second by default)".into(),
            ));
        }
        if s.heartbeat_interval_ms == 0 || s.refresh_ms == 0 {
            return Err(ConfigError::Invalid(
                "heartbeat_interval_ms and refresh_ms must be above 0".into(),
            ));
        }
        if s.lost_after_ms < 2 * s.heartbeat_interval_ms {
            return Err(ConfigError::Invalid(format!(
                "lost_after_ms ({}) must be at least twice heartbeat_interval_ms ({}), or one late heartbeat loses a node",
                s.lost_after_ms, s.heartbeat_interval_ms
            )));
        }
        if s.accounting_ticket_s.saturating_mul(1000) < 2 * s.heartbeat_interval_ms
            || s.accounting_ticket_s > 86_400
        {
            return Err(ConfigError::Invalid(format!(
                "accounting_ticket_s ({}) must last at least two heartbeats ({} ms each) and at most a day (86400); the default is {}",
                s.accounting_ticket_s,
                s.heartbeat_interval_ms,
                rfaas_proto::ticket::DEFAULT_LIFETIME_S
            )));
        }
        if s.max_lease_s == 0 || s.max_connections == 0 || s.max_job_credential_s == 0 {
            return Err(ConfigError::Invalid(
                "max_lease_s, max_job_credential_s and max_connections must be above 0".into(),
            ));
        }
        if s.slurm.timeout_ms == 0 {
            return Err(ConfigError::Invalid(
                "[slurm] timeout_ms must be above 0 (squeue and sacctmgr answer in milliseconds; 5000 is the default)".into(),
            ));
        }
        if !(s.database.starts_with("sqlite:") || s.database.starts_with("postgres")) {
            return Err(ConfigError::Invalid(format!(
                "database {:?} is neither sqlite:///path nor postgres://...",
                s.database
            )));
        }
        Ok(s)
    }
}

/// Checks the TLS files' pairing, that plain HTTP listens only on
/// loopback unless allowed, and the `[http]` bounds.
fn http_settings(
    listen: &str,
    cert: Option<PathBuf>,
    key: Option<PathBuf>,
    allow_http: bool,
    c: &HttpConfig,
) -> Result<HttpSettings, ConfigError> {
    let tls = match (cert, key) {
        (Some(c), Some(k)) => Some((c, k)),
        (None, None) => None,
        _ => {
            return Err(ConfigError::Invalid(
                "tls_cert and tls_key go together: name both (--tls-cert, --tls-key) for HTTPS, or neither".into(),
            ))
        }
    };
    if tls.is_none() && !allow_http && !rfaas_tls::is_loopback(listen) {
        return Err(ConfigError::Invalid(format!(
            "listen = {listen:?} without tls_cert and tls_key would serve credentials in clear to the network; \
             give the manager a certificate (--tls-cert FILE --tls-key FILE), listen on 127.0.0.1, \
             or set allow_http = true if a TLS proxy on this host fronts it"
        )));
    }
    let h = HttpSettings {
        tls,
        handshake_timeout_ms: c.handshake_timeout_ms.unwrap_or(10_000),
        header_timeout_ms: c.header_timeout_ms.unwrap_or(10_000),
        body_timeout_ms: c.body_timeout_ms.unwrap_or(10_000),
        max_connections: c.max_connections,
        max_connections_per_source: c.max_connections_per_source.unwrap_or(512),
    };
    if h.handshake_timeout_ms == 0
        || h.header_timeout_ms == 0
        || h.body_timeout_ms == 0
        || h.max_connections == Some(0)
        || h.max_connections_per_source == 0
    {
        return Err(ConfigError::Invalid(
            "[http] timeouts and connection caps must be above 0".into(),
        ));
    }
    Ok(h)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_example_file_loads() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("manager.example.toml");
        let file = FileConfig::load(&path).unwrap();
        let set = rfaas_proto::check::keys_set(&file);
        assert!(set.is_empty(), "as shipped it sets nothing: {set:?}");
        let s = file.settings(&ConfigDir::default()).unwrap();
        assert!(s.database.starts_with("sqlite:"));
        assert_eq!(s.quota.cap("physics"), None, "an example, commented out");
        assert_eq!(s.quota.cap("anyone"), None);
        assert_eq!(
            s.accounting,
            AccountingSettings {
                lost_after_ms: 10_000,
                required: false
            }
        );
    }

    #[test]
    fn sqlite_gets_one_connection_unless_told() {
        let conns = |text: &str| {
            FileConfig::parse(text)
                .unwrap()
                .settings(&ConfigDir::default())
                .unwrap()
                .max_connections
        };
        assert_eq!(conns("database = \"sqlite:///tmp/m.db\"\n"), 1);
        assert_eq!(conns("database = \"postgres://rfaas@db/rfaas\"\n"), 16);
        assert_eq!(
            conns("database = \"sqlite:///tmp/m.db\"\nmax_connections = 4\n"),
            4
        );
        assert_eq!(conns(""), 1);
    }

    #[test]
    fn unknown_keys_are_refused_by_name() {
        let err = FileConfig::parse("listn = \"127.0.0.1:1\"\n").unwrap_err();
        assert!(err.contains("listn"), "{err}");
        let err = FileConfig::parse("[quota]\ndefault_core = 3\n").unwrap_err();
        assert!(err.contains("default_core"), "{err}");
        let err = FileConfig::parse("[accounting]\nrequire = true\n").unwrap_err();
        assert!(err.contains("require"), "{err}");
    }

    #[test]
    fn a_node_is_not_lost_for_one_late_heartbeat() {
        let c = FileConfig::parse("heartbeat_interval_ms = 1000\nlost_after_ms = 1500\n").unwrap();
        let err = c.settings(&ConfigDir::default()).unwrap_err().to_string();
        assert!(err.contains("twice"), "{err}");
    }

    #[test]
    fn plain_http_listens_on_loopback_only_unless_allowed() {
        let settings = |text: &str| {
            FileConfig::parse(text)
                .unwrap()
                .settings(&ConfigDir::default())
        };
        assert!(settings("listen = \"127.0.0.1:7300\"\n").is_ok());
        let err = settings("listen = \"0.0.0.0:7300\"\n")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("in clear") && err.contains("--tls-cert"),
            "{err}"
        );
        assert!(settings("listen = \"0.0.0.0:7300\"\nallow_http = true\n").is_ok());
        let s =
            settings("listen = \"0.0.0.0:7300\"\ntls_cert = \"/c.pem\"\ntls_key = \"/k.pem\"\n")
                .unwrap();
        assert_eq!(s.http.tls, Some(("/c.pem".into(), "/k.pem".into())));
        let err = settings("tls_cert = \"/c.pem\"\n").unwrap_err().to_string();
        assert!(err.contains("go together"), "{err}");
        let err = settings("[http]\nmax_connections_per_source = 0\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("above 0"), "{err}");
    }

    #[test]
    fn quota_zero_means_no_cap() {
        let c = FileConfig::parse("[quota]\ndefault_cores = 8\naccounts = { big = 0 }\n").unwrap();
        assert_eq!(c.quota.cap("small"), Some(8));
        assert_eq!(c.quota.cap("big"), None);
    }
}

//! `accounting.toml`: the instance's name, its database, its region file,
//! where it listens, and how often it flushes. Unknown keys are refused by
//! name, as the manager and executord do: a misspelt option is an error,
//! not a silent default. Every key is documented in
//! `accounting/accounting.example.toml`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use rfaas_fabric::ProviderKind;
use rfaas_proto::accounting::MAX_SLOTS;
use rfaas_proto::files::{ConfigDir, BILLING_TOML, LEASE_KEYS_PUB};
use serde::{Deserialize, Serialize};

/// The configuration file as written.
#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    /// The instance's name, unique among the site's accounting instances.
    pub name: Option<String>,
    /// The manager's database: `sqlite:///path` or `postgres://...`.
    pub database: Option<String>,
    /// The PostgreSQL password's file (mode 0600), when `database` names
    /// none; default `database.password` in the configuration directory.
    pub database_password_file: Option<PathBuf>,
    /// The counter region's file.
    pub region_file: Option<PathBuf>,
    /// Slots in the region.
    pub slots: Option<u32>,
    /// The fabric provider: `tcp`, `shm` or `verbs:<device>`.
    pub provider: Option<String>,
    /// The fabric address executor daemons connect to.
    pub listen: Option<String>,
    /// The address written for the manager (and so the daemons), when it
    /// is not `listen` (a wildcard bind, NAT).
    pub advertise: Option<String>,
    /// `host:port` of `/metrics` and `/healthz`.
    pub metrics_listen: Option<String>,
    /// How often the flusher writes the slots to the database, ms.
    pub flush_interval_ms: Option<u64>,
    /// How often a lease's totals are snapshotted, ms.
    pub snapshot_interval_ms: Option<u64>,
    /// How long a slot stays assigned after its lease ended without the
    /// daemon closing it, seconds.
    pub slot_hold_s: Option<u64>,
    /// The rates file (`billing.toml`).
    pub billing_config: Option<PathBuf>,
    /// How long a new connection has to say its hello, ms.
    pub hello_timeout_ms: Option<u64>,
    /// The manager's public key files, which check the accounting tickets
    /// in hellos (the files executord's `lease_keys` names).
    pub lease_keys: Option<Vec<PathBuf>>,
}

/// The settings the service runs with, defaults filled in.
#[derive(Debug, Clone, Serialize)]
pub struct Settings {
    /// The instance's name.
    pub name: String,
    /// The database URL.
    #[serde(serialize_with = "rfaas_service::config::redacted")]
    pub database: String,
    /// The region file.
    pub region_file: PathBuf,
    /// Slots in the region.
    pub slots: u32,
    /// The fabric provider, as written (`tcp`, `shm`, `verbs:<device>`).
    pub provider: String,
    /// The fabric listen address.
    pub listen: String,
    /// The advertised fabric address (`None`: the listener's own).
    pub advertise: Option<String>,
    /// The metrics address.
    pub metrics_listen: String,
    /// Flush period.
    #[serde(
        rename = "flush_interval_ms",
        serialize_with = "rfaas_proto::check::millis"
    )]
    pub flush_interval: Duration,
    /// Snapshot period.
    #[serde(
        rename = "snapshot_interval_ms",
        serialize_with = "rfaas_proto::check::millis"
    )]
    pub snapshot_interval: Duration,
    /// Hold of an ended lease's slot.
    #[serde(rename = "slot_hold_s", serialize_with = "rfaas_proto::check::seconds")]
    pub slot_hold: Duration,
    /// The rates file.
    pub billing_config: PathBuf,
    /// Hello deadline.
    #[serde(
        rename = "hello_timeout_ms",
        serialize_with = "rfaas_proto::check::millis"
    )]
    pub hello_timeout: Duration,
    /// The manager's public key files (at least one).
    pub lease_keys: Vec<PathBuf>,
    /// The configuration directory the defaults came from.
    #[serde(skip)]
    pub config_dir: ConfigDir,
}

pub use rfaas_service::config::ConfigError;

/// What `rfaas-billing` reads of the manager's `manager.toml`: its
/// database, for a host where neither `billing.toml` nor
/// `accounting.toml` names one. The rest of the file is the manager's to
/// check.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct ManagerDatabase {
    /// `sqlite:///path/to/file.db` or `postgres://user@host:port/db`.
    pub database: Option<String>,
}

impl FileConfig {
    /// Reads and parses `path`.
    pub fn load(path: &Path) -> Result<FileConfig, ConfigError> {
        rfaas_service::config::load_toml(path)
    }

    /// Parses configuration text.
    pub fn parse(text: &str) -> Result<FileConfig, String> {
        rfaas_service::config::parse_toml(text)
    }

    /// Fills in defaults (files in `dir`) and checks the values.
    pub fn settings(self, dir: &ConfigDir) -> Result<Settings, ConfigError> {
        let invalid = |m: String| Err(ConfigError::Invalid(m));
        let name = match self.name {
            Some(n) => n,
            None => hostname().ok_or_else(|| {
                ConfigError::Invalid(
                    "no name is set and the host name cannot be read: set `name`".into(),
                )
            })?,
        };
        let s = Settings {
            name,
            database: rfaas_service::db::with_password_file(
                &self
                    .database
                    .unwrap_or_else(|| rfaas_service::db::DEFAULT_URL.into()),
                self.database_password_file.as_deref(),
                dir,
            )
            .map_err(ConfigError::Unusable)?,
            region_file: self
                .region_file
                .unwrap_or_else(|| "/var/lib/rfaas/accounting.region".into()),
            slots: self.slots.unwrap_or(4096),
            provider: self.provider.unwrap_or_else(|| "tcp".into()),
            listen: self.listen.unwrap_or_else(|| "127.0.0.1:7400".into()),
            advertise: self.advertise,
            metrics_listen: self
                .metrics_listen
                .unwrap_or_else(|| "127.0.0.1:7410".into()),
            flush_interval: Duration::from_millis(self.flush_interval_ms.unwrap_or(1000)),
            snapshot_interval: Duration::from_millis(self.snapshot_interval_ms.unwrap_or(60_000)),
            slot_hold: Duration::from_secs(self.slot_hold_s.unwrap_or(600)),
            billing_config: self
                .billing_config
                .unwrap_or_else(|| dir.file(BILLING_TOML)),
            hello_timeout: Duration::from_millis(self.hello_timeout_ms.unwrap_or(5000)),
            lease_keys: self
                .lease_keys
                .unwrap_or_else(|| vec![dir.file(LEASE_KEYS_PUB)]),
            config_dir: dir.clone(),
        };
        let name_ok = !s.name.is_empty()
            && s.name.len() <= 64
            && s.name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
        if !name_ok {
            return invalid(format!(
                "name {:?} must be 1 to 64 letters, digits, '.', '_' or '-'",
                s.name
            ));
        }
        if s.slots == 0 || s.slots > MAX_SLOTS {
            return invalid(format!(
                "slots = {}: a region holds 1 to {MAX_SLOTS} slots",
                s.slots
            ));
        }
        let kind: ProviderKind = s.provider.parse().map_err(|_| {
            ConfigError::Invalid(format!(
                "provider {:?} is none of tcp, shm, verbs:<device>",
                s.provider
            ))
        })?;
        if s.lease_keys.is_empty() {
            return invalid(
                "lease_keys = []: name the manager's public key file (as executord's lease_keys does); without it no executor daemon's hello can be checked".into(),
            );
        }
        if s.flush_interval.is_zero() || s.hello_timeout.is_zero() {
            return invalid("flush_interval_ms and hello_timeout_ms must be above 0".into());
        }
        if s.snapshot_interval < s.flush_interval {
            return invalid(format!(
                "snapshot_interval_ms ({}) must be at least flush_interval_ms ({}): snapshots are taken at flushes",
                s.snapshot_interval.as_millis(),
                s.flush_interval.as_millis()
            ));
        }
        if !(s.database.starts_with("sqlite:") || s.database.starts_with("postgres")) {
            return invalid(format!(
                "database {:?} is neither sqlite:///path nor postgres://...",
                s.database
            ));
        }
        let wildcard = s.listen.starts_with("0.0.0.0:") || s.listen.starts_with("[::]:");
        if kind != ProviderKind::Shm && wildcard && s.advertise.is_none() {
            return invalid(format!(
                "listen = {:?} is no address a daemon can connect to: set advertise to this host's address on the same port",
                s.listen
            ));
        }
        if kind == ProviderKind::Shm && s.listen.is_empty() && s.advertise.is_none() {
            return invalid(
                "with provider shm, listen must name a socket path (or @name) daemons can find"
                    .into(),
            );
        }
        Ok(s)
    }
}

/// The host's name, from the kernel.
fn hostname() -> Option<String> {
    let name = std::fs::read_to_string("/proc/sys/kernel/hostname").ok()?;
    let name = name.trim();
    (!name.is_empty()).then(|| name.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_example_file_loads() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("accounting.example.toml");
        let file = FileConfig::load(&path).unwrap();
        let set = rfaas_proto::check::keys_set(&file);
        assert!(set.is_empty(), "as shipped it sets nothing: {set:?}");
        let s = file.settings(&ConfigDir::default()).unwrap();
        assert_eq!(Some(s.name), hostname(), "the host's name");
        assert_eq!(s.slots, 4096);
        assert_eq!(s.provider, "tcp");
        assert_eq!(s.metrics_listen, "127.0.0.1:7410");
        assert_eq!(s.flush_interval, Duration::from_secs(1));
        assert_eq!(s.snapshot_interval, Duration::from_secs(60));
        assert_eq!(s.slot_hold, Duration::from_secs(600));
        assert_eq!(s.billing_config, Path::new("/etc/rfaas/billing.toml"));
        assert!(s.database.starts_with("sqlite:"));
    }

    #[test]
    fn defaults_fill_an_empty_file() {
        let s = FileConfig::parse("name = \"a\"\n")
            .unwrap()
            .settings(&ConfigDir::default())
            .unwrap();
        assert_eq!(
            (s.slots, s.listen.as_str(), s.advertise),
            (4096, "127.0.0.1:7400", None)
        );
        assert_eq!(s.hello_timeout, Duration::from_secs(5));
    }

    #[test]
    fn unknown_keys_are_refused_by_name() {
        let err = FileConfig::parse("slot = 3\n").unwrap_err();
        assert!(err.contains("slot"), "{err}");
        let err = FileConfig::parse("flush_interval = 3\n").unwrap_err();
        assert!(err.contains("flush_interval"), "{err}");
    }

    #[test]
    fn bad_values_say_what_to_change() {
        let bad = |text: &str, want: &str| {
            let err = FileConfig::parse(text)
                .unwrap()
                .settings(&ConfigDir::default())
                .unwrap_err()
                .to_string();
            assert!(err.contains(want), "{text}: {err}");
        };
        bad("name = \"a b\"\n", "letters");
        bad("name = \"a\"\nslots = 0\n", "1 to");
        bad("name = \"a\"\nprovider = \"udp\"\n", "none of");
        bad(
            "name = \"a\"\nsnapshot_interval_ms = 10\n",
            "at least flush_interval_ms",
        );
        bad("name = \"a\"\ndatabase = \"mysql://x\"\n", "neither");
        bad("name = \"a\"\nlisten = \"0.0.0.0:7400\"\n", "advertise");
        bad(
            "name = \"a\"\nprovider = \"shm\"\nlisten = \"\"\n",
            "socket path",
        );
        FileConfig::parse(
            "name = \"a\"\nlisten = \"0.0.0.0:7400\"\nadvertise = \"10.0.0.1:7400\"\n",
        )
        .unwrap()
        .settings(&ConfigDir::default())
        .unwrap();
    }
}

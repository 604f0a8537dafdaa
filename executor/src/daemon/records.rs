//! The runtime state directory (`<runtime_dir>/state/`, root's alone):
//! writing its files atomically (a temporary file, then a rename, mode
//! 0600), removing an ended allocation's record, and the lease carry files
//! ([`LeaseCarry`]) that keep a lease's figures over a restart. The
//! records themselves and adopting what they name are `adopt`'s; this
//! module depends on neither the shared state nor the supervisor, so both
//! can name it.

use std::io::{self, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use rfaas_proto::accounting::{SlotTotals, UsageFigures};

/// The runtime state directory under `runtime_dir`.
pub(crate) fn state_dir(runtime_dir: &Path) -> PathBuf {
    runtime_dir.join("state")
}

pub(crate) fn record_path(runtime_dir: &Path, id: u64) -> PathBuf {
    state_dir(runtime_dir).join(format!("{id}.json"))
}

/// Writes `bytes` to `dir/name` atomically (a temporary file, then a
/// rename), mode 0600, in a directory only root enters.
pub(crate) fn write_private(dir: &Path, name: &str, bytes: &[u8]) -> io::Result<()> {
    std::fs::create_dir_all(dir)?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
    let tmp = dir.join(format!(".{name}.tmp"));
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)?;
    f.write_all(bytes)?;
    f.sync_all()?;
    std::fs::rename(&tmp, dir.join(name))
}

/// Removes allocation `id`'s record (it ended).
pub(crate) fn remove(runtime_dir: &Path, id: u64) {
    match std::fs::remove_file(record_path(runtime_dir, id)) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => {
            tracing::warn!(allocation = id, error = %e, "cannot remove an ended allocation's runtime record")
        }
    }
}

/// What carries a lease's figures over a restart while one of its
/// allocations runs (`<runtime_dir>/state/lease-<id>.json`): what its
/// ended allocations used, and what its accounting slot held before this
/// daemon, or one it adopted from, first added. A daemon that adopts the
/// lease's workers starts the lease's figures from `closed` and counts
/// `slot - base` as already posted, so every figure is billed once.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct LeaseCarry {
    /// [`RECORD_VERSION`].
    pub version: u32,
    pub lease_id: u64,
    /// The slot before the first add; `None` until the poster read it.
    pub base: Option<SlotTotals>,
    /// The kernel's CPU time of the ended allocations, ns.
    pub closed_cpu_ns: u64,
    /// The ended allocations' figures.
    pub closed: UsageFigures,
    /// The lease's allocations that ended.
    pub allocations: u32,
}

/// One writer of lease files at a time (the poster and the watchers).
static LEASE_FILES: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn lease_file_name(lease_id: u64) -> String {
    format!("lease-{lease_id}.json")
}

pub(crate) fn is_lease_file(path: &Path) -> bool {
    path.file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| n.starts_with("lease-"))
}

/// Lease `lease_id`'s carry in `state_dir`; a missing one is `None`, a bad
/// one is refused (logged, moved aside) and `None`.
pub(crate) fn read_lease(state_dir: &Path, lease_id: u64) -> Option<LeaseCarry> {
    let path = state_dir.join(lease_file_name(lease_id));
    if !path.exists() {
        return None;
    }
    let read = check_file(&path)
        .and_then(|()| std::fs::read(&path).map_err(|e| format!("cannot read it: {e}")))
        .and_then(|b| {
            serde_json::from_slice::<LeaseCarry>(&b)
                .map_err(|e| format!("it is not a lease's carried figures: {e}"))
        })
        .and_then(|c| {
            (c.version == RECORD_VERSION && c.lease_id == lease_id)
                .then_some(c)
                .ok_or_else(|| "its version or lease id is not this daemon's".to_string())
        });
    match read {
        Ok(c) => Some(c),
        Err(why) => {
            refuse(&path, &why);
            None
        }
    }
}

/// Changes lease `lease_id`'s carry in `state_dir` with `f` (a new one
/// starts empty) and writes it back atomically.
pub(crate) fn update_lease(state_dir: &Path, lease_id: u64, f: impl FnOnce(&mut LeaseCarry)) {
    let _one = LEASE_FILES.lock().unwrap_or_else(|e| e.into_inner());
    let mut c = read_lease(state_dir, lease_id).unwrap_or(LeaseCarry {
        version: RECORD_VERSION,
        lease_id,
        ..LeaseCarry::default()
    });
    f(&mut c);
    let written = serde_json::to_vec(&c)
        .map_err(io::Error::other)
        .and_then(|b| write_private(state_dir, &lease_file_name(lease_id), &b));
    if let Err(e) = written {
        tracing::warn!(lease = lease_id, error = %e, "cannot write a lease's carried figures; a restarted daemon may bill its adopted workers from their adoption on only");
    }
}

/// Removes lease `lease_id`'s carry (its figures are all posted, or the
/// lease has no worker left to adopt).
pub(crate) fn remove_lease(state_dir: &Path, lease_id: u64) {
    let _one = LEASE_FILES.lock().unwrap_or_else(|e| e.into_inner());
    match std::fs::remove_file(state_dir.join(lease_file_name(lease_id))) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => {
            tracing::warn!(lease = lease_id, error = %e, "cannot remove a lease's carried figures")
        }
    }
}

/// The lease ids with a carry file in `state_dir`.
pub(crate) fn carried_leases(state_dir: &Path) -> Vec<u64> {
    let Ok(entries) = std::fs::read_dir(state_dir) else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| {
            let name = e.file_name();
            let id = name
                .to_str()?
                .strip_prefix("lease-")?
                .strip_suffix(".json")?;
            id.parse().ok()
        })
        .collect()
}

/// The record format's version; others are refused.
pub(crate) const RECORD_VERSION: u32 = 1;

/// A record must be root's and no one else's to read or write.
pub(crate) fn check_file(path: &Path) -> Result<(), String> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::symlink_metadata(path).map_err(|e| format!("cannot read it: {e}"))?;
    if !m.file_type().is_file() {
        return Err("it is not a regular file".into());
    }
    if m.uid() != 0 || m.mode() & 0o077 != 0 {
        return Err(format!(
            "it is owned by uid {} with mode {:o}; records are root's with mode 0600",
            m.uid(),
            m.mode() & 0o777
        ));
    }
    Ok(())
}

/// Logs why `path` is refused and moves it aside.
pub(crate) fn refuse(path: &Path, why: &str) {
    let aside = path.with_extension("json.refused");
    tracing::error!(
        record = %path.display(),
        moved_to = %aside.display(),
        "a runtime record was refused and its worker is not adopted: {why}; \
         the file is kept aside for inspection"
    );
    if let Err(e) = std::fs::rename(path, &aside) {
        tracing::warn!(record = %path.display(), error = %e, "cannot move a refused record aside");
    }
}

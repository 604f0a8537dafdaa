//! Workers that outlive the daemon (`workers_outlive_daemon`): each
//! running allocation's record in the runtime state directory
//! (`<runtime_dir>/state/<id>.json`, root's alone, mode 0600, written to a
//! temporary file and renamed into place), and, at start, the adoption of
//! the workers those records name.
//!
//! Adopting a record: the worker must be alive and the same process
//! (its pid's start time in `/proc` matches the record, against pid
//! reuse); the daemon connects to its `adopt.sock`, hears
//! [`WorkerRejoin`] with the meter area, checks the lease token's
//! signature again, takes the record's CPUs and memory, meters the worker
//! on from where its meter started ([`Origin`], kept in the record), and
//! watches it (a pidfd: it is not the daemon's child). A lease with a
//! running allocation also has a [`LeaseCarry`] (`lease-<id>.json`): its
//! ended allocations' figures and its slot before the first add, so the
//! adopting daemon bills only what the previous one had not posted.
//! Its client has `attach_grace_s` to take it up on a new connection
//! (`Attach`, with the allocation's secret); otherwise it ends as if the
//! client's connection had closed. A record that cannot be read, names a
//! dead worker or one that does not answer is refused with a log line,
//! moved aside (`.refused`) and its directory removed.

use std::io;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use rfaas_proto::control::client::Mode;
use rfaas_proto::control::worker::WorkerRejoin;
use rfaas_proto::control::{FrameLimits, Kind};

use super::process::pidfd_open;
use super::records::{
    carried_leases, check_file, is_lease_file, read_lease, record_path, refuse, remove_lease,
    state_dir, write_private, RECORD_VERSION,
};
use super::shared::Shared;
use super::state::Allocation;
use super::usage::cpu::CpuSource;
use super::usage::{Limits, Origin};
use crate::ipc;
use crate::meter::MeterArea;

/// How long the daemon tries to reach a worker's `adopt.sock` (the worker
/// makes it once it sees its previous daemon's socket end).
const REACH_WORKER: Duration = Duration::from_secs(5);

/// What the next daemon needs to adopt an allocation's worker.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Record {
    /// [`RECORD_VERSION`].
    pub version: u32,
    pub allocation_id: u64,
    pub lease_id: u64,
    pub user: String,
    pub cpus: Vec<u32>,
    pub memory_mib: u32,
    pub expires_at: u64,
    pub mode: Mode,
    pub lanes: u16,
    pub max_in: u64,
    pub max_out: u64,
    /// The worker's pid and its start time (`/proc/<pid>/stat`, clock
    /// ticks after boot).
    pub pid: u32,
    pub start_time: u64,
    /// The allocation's directory.
    pub runtime_dir: PathBuf,
    pub attach_secret: String,
    /// The lease token the allocation was made with: its claims are what
    /// the worker is metered under.
    pub token: String,
    /// Where its meter started.
    pub meter: Option<Origin>,
}

/// Writes `r` atomically (a temporary file, then a rename), mode 0600.
pub(crate) fn write(runtime_dir: &Path, r: &Record) -> io::Result<()> {
    let bytes = serde_json::to_vec(r).map_err(io::Error::other)?;
    write_private(
        &state_dir(runtime_dir),
        &format!("{}.json", r.allocation_id),
        &bytes,
    )
}

/// Reads and checks one record file.
pub(crate) fn parse(bytes: &[u8]) -> Result<Record, String> {
    let r: Record =
        serde_json::from_slice(bytes).map_err(|e| format!("it is not a record: {e}"))?;
    if r.version != RECORD_VERSION {
        return Err(format!(
            "its version is {}, this daemon reads version {RECORD_VERSION}",
            r.version
        ));
    }
    if r.allocation_id == 0 || r.pid <= 1 || r.lanes == 0 {
        return Err("it names allocation 0, pid 0 or 1, or no lanes".into());
    }
    Ok(r)
}

/// Every record in the state directory that reads as one; the rest are
/// logged and moved aside (`<name>.refused`) and never read again.
pub(crate) fn load(runtime_dir: &Path) -> Vec<Record> {
    let dir = state_dir(runtime_dir);
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for e in entries.flatten() {
        let path = e.path();
        if path.extension().and_then(|x| x.to_str()) != Some("json") || is_lease_file(&path) {
            continue;
        }
        let read = check_file(&path)
            .and_then(|()| std::fs::read(&path).map_err(|e| format!("cannot read it: {e}")))
            .and_then(|b| parse(&b))
            .and_then(|r| {
                (path.file_stem().and_then(|s| s.to_str())
                    == Some(r.allocation_id.to_string().as_str()))
                .then_some(r)
                .ok_or_else(|| "its name is not its allocation's id".to_string())
            });
        match read {
            Ok(r) => out.push(r),
            Err(why) => refuse(&path, &why),
        }
    }
    out.sort_by_key(|r| r.allocation_id);
    out
}

/// The start time of process `pid` (clock ticks after boot), from
/// `/proc/<pid>/stat`; `None` when it is gone or a zombie.
pub(crate) fn start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, rest) = stat.rsplit_once(')')?;
    let mut fields = rest.split_whitespace();
    // After the name: state (3rd field) ... starttime (22nd).
    let state = fields.next()?;
    if state == "Z" || state == "X" {
        return None;
    }
    fields.nth(18)?.parse().ok()
}

/// The record of allocation `a`, made with `token`.
pub(crate) fn record_of(
    a: &Allocation,
    limits: &Limits,
    token: &str,
    meter: Option<Origin>,
) -> Option<Record> {
    let pid = a.pid?;
    Some(Record {
        version: RECORD_VERSION,
        allocation_id: a.id,
        lease_id: a.lease_id,
        user: a.user.clone(),
        cpus: a.cpus.clone(),
        memory_mib: a.memory_mib,
        expires_at: a.expires_at,
        mode: a.mode,
        lanes: limits.lanes,
        max_in: limits.max_in,
        max_out: limits.max_out,
        pid,
        start_time: start_time(pid)?,
        runtime_dir: a.runtime_dir.clone(),
        attach_secret: a.attach_secret.clone(),
        token: token.to_owned(),
        meter,
    })
}

/// Adopts the worker of each record, or refuses the record. Call it
/// before the connection loop serves: the CPUs they hold are not free.
pub(crate) fn adopt_all(shared: &Arc<Shared>, records: Vec<Record>) {
    let runtime_dir = shared.settings.runtime_dir.clone();
    let mut adopted_leases = std::collections::BTreeSet::new();
    for r in records {
        let path = record_path(&runtime_dir, r.allocation_id);
        match adopt(shared, &r) {
            Ok(()) => {
                adopted_leases.insert(r.lease_id);
                tracing::info!(
                    allocation = r.allocation_id,
                    lease = r.lease_id,
                    pid = r.pid,
                    "adopted a running worker from the previous daemon"
                )
            }
            Err(why) => {
                refuse(&path, &why);
                if let Err(e) = std::fs::remove_dir_all(&r.runtime_dir) {
                    if e.kind() != io::ErrorKind::NotFound {
                        tracing::warn!(dir = %r.runtime_dir.display(), error = %e, "cannot remove a refused allocation's directory");
                    }
                }
                shared.limiter.kill(r.allocation_id, Duration::from_secs(5));
                shared.limiter.remove(r.allocation_id);
            }
        }
    }
    carry_leases(shared, &adopted_leases);
}

/// Gives the adopted leases the figures of their allocations that ended
/// under the previous daemon; forgets the carry of every other lease
/// (nothing of it runs any more: its figures start again from its slot).
fn carry_leases(shared: &Shared, adopted: &std::collections::BTreeSet<u64>) {
    let dir = state_dir(&shared.settings.runtime_dir);
    for lease_id in carried_leases(&dir) {
        if !adopted.contains(&lease_id) {
            remove_lease(&dir, lease_id);
            continue;
        }
        if let Some(c) = read_lease(&dir, lease_id) {
            shared
                .usage
                .carry(lease_id, c.closed_cpu_ns, &c.closed, c.allocations);
        }
    }
}

fn adopt(shared: &Arc<Shared>, r: &Record) -> Result<(), String> {
    let s = &shared.settings;
    if start_time(r.pid) != Some(r.start_time) {
        return Err(format!("its worker (pid {}) is no longer running", r.pid));
    }
    if !r.runtime_dir.starts_with(&s.runtime_dir) {
        return Err(format!(
            "its directory {} is not below the runtime directory {}",
            r.runtime_dir.display(),
            s.runtime_dir.display()
        ));
    }
    let claims = shared
        .lease_keys
        .verify_signature(&r.token)
        .map_err(|e| format!("its lease token does not check: {e}"))?;
    if claims.lease_id != r.lease_id || claims.node != s.node_name {
        return Err("its lease token is for another lease or node".into());
    }
    // Opened before the worker is reached: it must not exit unseen.
    let pidfd = pidfd_open(r.pid).map_err(|e| format!("cannot watch pid {}: {e}", r.pid))?;
    let (sock, rejoin, meter) = reach(&r.runtime_dir.join(crate::worker::adopt::ADOPT_SOCKET))?;
    if rejoin.allocation_id != r.allocation_id {
        return Err(format!(
            "the worker at its socket serves allocation {}",
            rejoin.allocation_id
        ));
    }
    let expires_at = r.expires_at.max(rejoin.expires_at);
    let limits = Limits {
        lanes: r.lanes,
        // As the allocation made them: a thread per core, at most one per
        // lane.
        threads: u16::try_from(r.cpus.len()).unwrap_or(u16::MAX).min(r.lanes),
        memory_mib: r.memory_mib,
        max_in: r.max_in,
        max_out: r.max_out,
    };
    let mut st = shared.lock();
    st.capacity
        .take(r.lease_id, &r.cpus, r.memory_mib)
        .map_err(|e| format!("its CPUs and memory are not this daemon's to give: {e}"))?;
    st.allocations.insert(
        r.allocation_id,
        Allocation {
            id: r.allocation_id,
            lease_id: r.lease_id,
            user: r.user.clone(),
            conn_id: 0,
            pid: Some(r.pid),
            worker_sock: Some(sock),
            cpus: r.cpus.clone(),
            memory_mib: r.memory_mib,
            expires_at,
            mode: r.mode,
            ready: true,
            stop: None,
            ended: None,
            runtime_dir: r.runtime_dir.clone(),
            attach_secret: r.attach_secret.clone(),
            attach_by: Some(Instant::now() + s.attach_grace),
        },
    );
    if let Some(area) = meter {
        let opening = match r.meter.clone() {
            Some(origin) => shared.usage.resume(area, origin),
            None => shared.usage.opening(
                area,
                CpuSource::Process {
                    pid: r.pid,
                    tree: false,
                },
            ),
        };
        shared.usage.open(r.allocation_id, &claims, opening, limits);
    }
    drop(st);
    super::supervise::watch_adopted(shared, r.pid, pidfd);
    Ok(())
}

/// Connects to a worker's adoption socket (retrying for
/// [`REACH_WORKER`]) and reads its [`WorkerRejoin`] and meter area.
fn reach(path: &Path) -> Result<(UnixStream, WorkerRejoin, Option<MeterArea>), String> {
    let until = Instant::now() + REACH_WORKER;
    let sock = loop {
        match UnixStream::connect(path) {
            Ok(s) => break s,
            Err(e) if Instant::now() >= until => {
                return Err(format!(
                    "its worker did not answer on {} within {} s: {e}",
                    path.display(),
                    REACH_WORKER.as_secs()
                ))
            }
            // Polling for a socket another process makes: no event to wait on.
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    };
    let _ = sock.set_read_timeout(Some(REACH_WORKER));
    let limits = FrameLimits {
        max_json: 4096,
        max_blob: 0,
    };
    let (frame, fds) = ipc::recv_frame(&sock, limits)
        .map_err(|e| format!("its worker did not say WorkerRejoin: {e}"))?;
    if frame.kind != Kind::WorkerRejoin {
        return Err(format!(
            "its worker sent {:?}, not WorkerRejoin",
            frame.kind
        ));
    }
    let rejoin: WorkerRejoin = frame
        .parse()
        .map_err(|e| format!("its worker's WorkerRejoin is unreadable: {e}"))?;
    let meter = match fds.into_iter().next() {
        Some(fd) => {
            use std::os::fd::AsFd;
            Some(
                MeterArea::map(fd.as_fd())
                    .map_err(|e| format!("its worker's meter area is unusable: {e}"))?,
            )
        }
        None => None,
    };
    let _ = sock.set_read_timeout(None);
    Ok((sock, rejoin, meter))
}

#[cfg(test)]
mod tests {
    use super::super::records::remove;
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn record() -> Record {
        Record {
            version: RECORD_VERSION,
            allocation_id: 7,
            lease_id: 3,
            user: "alice".into(),
            cpus: vec![1, 2],
            memory_mib: 256,
            expires_at: 1_800_000_000,
            mode: Mode::Warm,
            lanes: 2,
            max_in: 4096,
            max_out: 4096,
            pid: 4242,
            start_time: 99,
            runtime_dir: "/run/rfaas/workers/alloc-7".into(),
            attach_secret: "ab".into(),
            token: "rfaas2.x.y".into(),
            meter: None,
        }
    }

    #[test]
    fn records_round_trip_and_bad_ones_are_refused_with_the_reason() {
        let r = record();
        let bytes = serde_json::to_vec(&r).unwrap();
        assert_eq!(parse(&bytes).unwrap(), r);
        let e = parse(b"{\"version\":1").unwrap_err();
        assert!(e.starts_with("it is not a record"), "{e}");
        let mut v = r.clone();
        v.version = 2;
        let e = parse(&serde_json::to_vec(&v).unwrap()).unwrap_err();
        assert!(e.contains("version is 2"), "{e}");
        let mut v = r;
        v.pid = 1;
        assert!(parse(&serde_json::to_vec(&v).unwrap()).is_err());
        // A field this version does not know is a foreign file.
        let foreign = String::from_utf8(bytes)
            .unwrap()
            .replace("\"user\"", "\"owner\"");
        assert!(parse(foreign.as_bytes()).is_err());
    }

    #[test]
    fn records_are_written_atomically_root_only_and_loaded_back() {
        let dir = rfaas_testkit::TempDir::new("rfaas-adopt-records");
        let r = record();
        write(dir.path(), &r).unwrap();
        let path = record_path(dir.path(), 7);
        use std::os::unix::fs::MetadataExt;
        assert_eq!(std::fs::metadata(&path).unwrap().mode() & 0o777, 0o600);
        // A corrupt one beside it is moved aside, the good one read.
        std::fs::write(state_dir(dir.path()).join("8.json"), b"garbage").unwrap();
        std::fs::set_permissions(
            state_dir(dir.path()).join("8.json"),
            std::fs::Permissions::from_mode(0o600),
        )
        .unwrap();
        // One readable by others is refused too.
        let mut other = record();
        other.allocation_id = 9;
        write(dir.path(), &other).unwrap();
        std::fs::set_permissions(
            record_path(dir.path(), 9),
            std::fs::Permissions::from_mode(0o644),
        )
        .unwrap();
        assert_eq!(load(dir.path()), vec![r]);
        assert!(state_dir(dir.path()).join("8.json.refused").exists());
        assert!(state_dir(dir.path()).join("9.json.refused").exists());
        remove(dir.path(), 7);
        assert!(load(dir.path()).is_empty());
    }

    #[test]
    fn start_times_tell_a_process_from_a_recycled_pid() {
        let me = start_time(std::process::id()).expect("this process runs");
        assert_eq!(start_time(std::process::id()), Some(me));
        assert_eq!(start_time(u32::MAX - 1), None);
    }
}

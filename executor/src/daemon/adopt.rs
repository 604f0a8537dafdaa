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

use std::io::{self, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use rfaas_proto::accounting::{SlotTotals, UsageFigures};
use rfaas_proto::control::client::Mode;
use rfaas_proto::control::worker::WorkerRejoin;
use rfaas_proto::control::{FrameLimits, Kind};

use super::shared::Shared;
use super::state::Allocation;
use super::usage::cpu::CpuSource;
use super::usage::{Limits, Origin};
use crate::ipc;
use crate::meter::MeterArea;

/// The record format's version; others are refused.
pub(crate) const RECORD_VERSION: u32 = 1;

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

/// The runtime state directory under `runtime_dir`.
pub(crate) fn state_dir(runtime_dir: &Path) -> PathBuf {
    runtime_dir.join("state")
}

fn record_path(runtime_dir: &Path, id: u64) -> PathBuf {
    state_dir(runtime_dir).join(format!("{id}.json"))
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

/// Writes `bytes` to `dir/name` atomically (a temporary file, then a
/// rename), mode 0600, in a directory only root enters.
fn write_private(dir: &Path, name: &str, bytes: &[u8]) -> io::Result<()> {
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

fn is_lease_file(path: &Path) -> bool {
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

/// Keeps what lease `lease_id`'s ended allocations used for a daemon that
/// adopts its running ones; a lease with none running has nothing to
/// adopt (its carry, if any, goes once its figures are posted).
pub(crate) fn carry_ended(shared: &Shared, lease_id: u64) {
    let Some((cpu_ns, usage, ended, running)) = shared.usage.carried(lease_id) else {
        return;
    };
    if running == 0 {
        return;
    }
    update_lease(&state_dir(&shared.settings.runtime_dir), lease_id, |c| {
        c.closed_cpu_ns = cpu_ns;
        c.closed = usage;
        c.allocations = ended;
    });
}

/// The lease ids with a carry file in `state_dir`.
fn carried_leases(state_dir: &Path) -> Vec<u64> {
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

/// A record must be root's and no one else's to read or write.
fn check_file(path: &Path) -> Result<(), String> {
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
fn refuse(path: &Path, why: &str) {
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

/// A pidfd for `pid` (it becomes readable when the process ends).
pub(crate) fn pidfd_open(pid: u32) -> io::Result<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags; no memory is passed.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the kernel just returned this descriptor, ours alone.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// Blocks until the process behind `pidfd` has ended.
pub(crate) fn wait_pidfd(pidfd: &OwnedFd) {
    loop {
        let mut pfd = libc::pollfd {
            fd: pidfd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd for the duration of the call.
        let n = unsafe { libc::poll(&mut pfd, 1, -1) };
        if n > 0 {
            return;
        }
        if n < 0 && io::Error::last_os_error().kind() != io::ErrorKind::Interrupted {
            return;
        }
    }
}

/// Ends adopted allocations whose client did not attach in time, as a
/// closed connection ends them. Called by the lease ticker.
pub(crate) fn end_unattached(shared: &Shared, now: Instant) {
    let ids: Vec<u64> = shared
        .lock()
        .allocations
        .values()
        .filter(|a| a.stop.is_none() && a.attach_by.is_some_and(|t| t <= now))
        .map(|a| a.id)
        .collect();
    if ids.is_empty() {
        return;
    }
    tracing::info!(allocations = ?ids, "no client attached to these adopted allocations in time; deallocating");
    shared.end_allocations(&ids, super::state::Stop::Deallocate, Duration::ZERO);
}

#[cfg(test)]
mod tests {
    use super::*;

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

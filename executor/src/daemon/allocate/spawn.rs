//! Spawning: the allocation's runtime directory and memory limit, a pooled
//! or fresh worker process, its assignment, and its answer; and undoing it
//! all when a step fails.

use std::os::fd::AsFd;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use rfaas_proto::control::client::AllocateRequest;
use rfaas_proto::control::worker::{Assignment, WorkerFailed, WorkerReady};
use rfaas_proto::control::{ControlError, ErrorCode, Frame, FrameLimits, Kind};
use rfaas_proto::lease::LeaseClaims;

use super::reserve::Reserved;
use crate::daemon::config::Sandbox;
use crate::daemon::process::{self, Bwrap, Ended};
use crate::daemon::refusal::Refused;
use crate::daemon::shared::Shared;
use crate::daemon::state::Stop;
use crate::daemon::supervise;
use crate::daemon::usage::cpu::CpuSource;
use crate::daemon::usage::Limits;
use crate::daemon::users::User;
use crate::ipc;
use crate::meter::MeterArea;

/// What the daemon settled for an allocation beyond its request.
#[derive(Debug)]
pub(super) struct Terms<'a> {
    /// The lease's claims (its usage is metered under them).
    pub claims: &'a LeaseClaims,
    /// The function deadline in force, ms.
    pub deadline_ms: u64,
    /// The lease's end, Unix seconds.
    pub expires_at: u64,
    /// The allocation's lane key, hex.
    pub lane_key: &'a str,
    /// The largest payload a lane pulls, bytes.
    pub max_pull: u64,
}

/// Prepares the runtime directory and memory limit, attaches a worker,
/// sends it the assignment and waits for its answer. Returns the answer
/// and whether the worker came from the pool.
pub(super) fn start_worker(
    shared: &Arc<Shared>,
    reserved: &Reserved,
    req: &AllocateRequest,
    library: &[u8],
    terms: &Terms<'_>,
) -> Result<(WorkerReady, bool), Refused> {
    let Terms {
        claims,
        deadline_ms,
        expires_at,
        lane_key,
        max_pull,
    } = *terms;
    let Reserved {
        id,
        cpus,
        user,
        runtime_dir,
    } = reserved;
    let (id, runtime_dir) = (*id, runtime_dir.as_path());
    let s = &shared.settings;
    let internal = |what: &str, e: &dyn std::fmt::Display| {
        (
            ErrorCode::Internal,
            format!("the executor cannot {what}: {e}; retry"),
        )
    };
    make_runtime_dir(runtime_dir, user).map_err(|e| {
        internal(
            &format!("create the runtime directory {}", runtime_dir.display()),
            &e,
        )
    })?;
    let cgroup = shared
        .limiter
        .create(id, if s.pin { cpus } else { &[] }, req.memory_mib)
        .map_err(|e| internal("create the allocation's cgroup", &e))?;
    let memfd = ipc::sealed_memfd(&memfd_name(&req.library_name), library)
        .map_err(|e| internal("copy the library into a memfd", &e))?;
    let (area, area_fd) = MeterArea::create(req.lane_count(), shared.usage.clock())
        .map_err(|e| internal("create the allocation's meter area", &e))?;
    let mut area = Some(area);
    let listen_addr = if req.provider == "shm" {
        runtime_dir.join("fabric.sock").display().to_string()
    } else {
        format!("{}:0", s.fabric_host)
    };
    let assignment = Assignment {
        allocation_id: id,
        lane_key: lane_key.to_owned(),
        uid: user.uid,
        gid: user.gid,
        cpus: if s.pin { cpus.to_vec() } else { Vec::new() },
        lanes: req.lane_count(),
        threads: req.thread_count(),
        slots: req.slot_count(),
        memory_limit_bytes: shared.limiter.rlimit_bytes(req.memory_mib),
        memory_mib: req.memory_mib,
        // 0 would mean the worker's own rule.
        pull_limit_bytes: max_pull.max(1),
        mode: req.mode,
        hot_timeout_us: req.hot_timeout_us,
        input_capacity: req.input_capacity,
        output_capacity: req.output_capacity,
        deadline_ms,
        expires_at,
        functions: req.functions.clone(),
        provider: req.provider.clone(),
        listen_addr,
        read_only_input: req.read_only_input,
        adopt_dir: if s.workers_outlive() {
            runtime_dir.display().to_string()
        } else {
            String::new()
        },
    };
    let frame = Frame::new(&assignment, Vec::new());

    // A pooled worker that died idle shows only when the send fails; one
    // fresh spawn then takes its place.
    let mut tries = 0;
    let (sock, pid, pooled, opening) = loop {
        tries += 1;
        let (sock, pid, pooled) = attach_worker(shared, id, runtime_dir, cgroup.as_deref())?;
        if let (Some(procs), true) = (&cgroup, pooled) {
            if let Err(e) = crate::daemon::memlimit::join(procs, pid) {
                return Err(internal("move the worker into its allocation's cgroup", &e));
            }
        }
        let cpu = match &cgroup {
            Some(procs) => CpuSource::Cgroup(procs.with_file_name("cpu.stat")),
            None => CpuSource::Process {
                pid,
                tree: s.sandbox == Sandbox::Bubblewrap,
            },
        };
        // The meter starts with the assignment: what a pooled worker used
        // before is nobody's.
        let opening = shared
            .usage
            .opening(area.take().expect("taken once per try"), cpu);
        match ipc::send_frame(&sock, &frame, &[memfd.as_fd(), area_fd.as_fd()]) {
            Ok(()) => break (sock, pid, pooled, opening),
            Err(e) if pooled && tries == 1 => {
                tracing::warn!(pid, error = %e, "a pooled worker did not take its assignment; spawning another");
                area = Some(opening.into_area());
                detach_worker(shared, id);
            }
            Err(e) => return Err(internal("send the assignment to the worker", &e)),
        }
    };
    drop(memfd);
    drop(area_fd);
    tracing::debug!(allocation = id, pid, pooled, "assignment sent");

    let _ = sock.set_read_timeout(Some(Duration::from_millis(s.worker_ready_timeout_ms)));
    let limits = FrameLimits {
        max_json: 1 << 20,
        max_blob: 0,
    };
    let ready = match ipc::recv_frame(&sock, limits) {
        Ok((f, _)) if f.kind == Kind::WorkerReady => f
            .parse::<WorkerReady>()
            .map_err(|e| internal("understand the worker's answer", &e))?,
        Ok((f, _)) if f.kind == Kind::WorkerFailed => {
            let WorkerFailed(e) = f
                .parse()
                .map_err(|e| internal("understand the worker's answer", &e))?;
            return Err((e.code, e.message));
        }
        Ok((f, _)) => {
            return Err(internal(
                "use the worker's answer",
                &format!("it sent a {:?} message", f.kind),
            ))
        }
        Err(ControlError::Io(e))
            if matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ) =>
        {
            return Err((
                ErrorCode::Internal,
                format!(
                    "worker {pid} did not load the library and listen within {} ms; retry",
                    s.worker_ready_timeout_ms
                ),
            ))
        }
        Err(e) => return Err(internal("hear from the worker", &e)),
    };
    if req.slot_count() > 1 && ready.slot_stride == 0 {
        // A worker binary older than the daemon, left from an upgrade.
        return Err((
            ErrorCode::Internal,
            format!(
                "worker {pid} does not serve several slots per lane; ask for one slot, or restart \
                 the executor so its workers are the installed version"
            ),
        ));
    }
    let _ = sock.set_read_timeout(None);
    let mut st = shared.lock();
    let a = st
        .allocations
        .get_mut(&id)
        .expect("only the allocating thread removes a starting allocation");
    if a.stop.is_some() || a.pid.is_none() {
        return Err((
            ErrorCode::Internal,
            "the worker ended while starting".into(),
        ));
    }
    a.ready = true;
    a.worker_sock = Some(sock);
    let limits = Limits {
        lanes: req.lane_count(),
        threads: req.thread_count(),
        memory_mib: req.memory_mib,
        max_in: max_pull.max(u64::from(req.input_capacity)),
        max_out: u64::from(req.output_capacity),
    };
    shared.usage.open(id, claims, opening, limits);
    let record = s
        .workers_outlive()
        .then(|| {
            let meter = shared.usage.origin(id);
            crate::daemon::adopt::record_of(a, &limits, &req.token, meter)
        })
        .flatten();
    drop(st);
    // For the next daemon to adopt the worker (written outside the lock).
    if let Some(r) = record {
        if let Err(e) = crate::daemon::adopt::write(&s.runtime_dir, &r) {
            tracing::warn!(allocation = id, error = %e, "cannot write the allocation's runtime record; a restarted daemon will not adopt its worker");
        }
    }
    tracing::info!(allocation = id, pid, fabric_addr = %ready.fabric_addr, pooled, "worker ready");
    Ok((ready, pooled))
}

/// Attaches a worker to allocation `id`: a pooled one if any (and no
/// sandbox), else a fresh one. Returns its socket, pid and whether it was
/// pooled.
fn attach_worker(
    shared: &Arc<Shared>,
    id: u64,
    runtime_dir: &Path,
    cgroup: Option<&Path>,
) -> Result<(std::os::unix::net::UnixStream, u32, bool), Refused> {
    let s = &shared.settings;
    if s.sandbox == Sandbox::None {
        let mut st = shared.lock();
        if let Some(w) = st.pool.pop() {
            let a = st.allocations.get_mut(&id).expect("starting allocation");
            a.pid = Some(w.pid);
            if a.stop.is_some() {
                process::signal(w.pid, libc::SIGKILL);
            }
            drop(st);
            // A pooled worker may still be starting (it runs at POOL_NICE
            // until its assignment): it is on the allocation's path now.
            process::renice(w.pid, 0);
            return Ok((w.sock, w.pid, true));
        }
    }
    let bwrap = (s.sandbox == Sandbox::Bubblewrap).then(|| Bwrap {
        bwrap: s.bwrap_path.clone(),
        runtime_dir: runtime_dir.to_owned(),
    });
    let spawned = supervise::spawn_direct(shared, bwrap, cgroup.map(|p| p.to_owned()))
        .map_err(|e| (ErrorCode::Internal, format!("{e}; retry")))?;
    {
        let mut st = shared.lock();
        let a = st.allocations.get_mut(&id).expect("starting allocation");
        a.pid = Some(spawned.pid);
        if a.stop.is_some() {
            process::signal(spawned.pid, libc::SIGKILL);
        }
    }
    supervise::watch(shared, spawned.pid);
    Ok((spawned.sock, spawned.pid, false))
}

/// Kills the worker attached to starting allocation `id` and waits until
/// its watcher has seen it end, so another can be attached.
fn detach_worker(shared: &Shared, id: u64) {
    let st = shared.lock();
    if let Some(pid) = st.allocations.get(&id).and_then(|a| a.pid) {
        process::signal(pid, libc::SIGKILL);
    }
    let (mut st, _) = shared.wait_until(st, Duration::from_secs(10), |st| {
        st.allocations.get(&id).map_or(true, |a| a.pid.is_none())
    });
    if let Some(a) = st.allocations.get_mut(&id) {
        a.ended = None;
    }
}

/// Ends a starting allocation that failed: kills its worker, waits for it,
/// frees what it held. Returns the refusal to send, which says `draining`
/// when a drain or shutdown stopped it.
pub(super) fn abandon(shared: &Shared, id: u64, refused: Refused) -> Refused {
    let mut st = shared.lock();
    if let Some(a) = st.allocations.get_mut(&id) {
        a.stop.get_or_insert(Stop::Failed);
        if let Some(pid) = a.pid {
            process::signal(pid, libc::SIGKILL);
        }
    }
    let (mut st, _) = shared.wait_until(st, Duration::from_secs(10), |st| {
        st.allocations.get(&id).map_or(true, |a| a.pid.is_none())
    });
    let Some(a) = shared.remove_allocation(&mut st, id) else {
        return refused;
    };
    let node = &shared.settings.node_name;
    match a.stop {
        Some(Stop::Drained) => {
            return (
                ErrorCode::Draining,
                format!("executor {node} began draining (its node is being retrieved) while the worker started; allocate elsewhere"),
            )
        }
        Some(Stop::Shutdown) => {
            return (
                ErrorCode::Draining,
                format!("executor {node} began shutting down while the worker started; allocate elsewhere"),
            )
        }
        _ => {}
    }
    match (a.ended, refused.0) {
        // A worker that died while loading says more than "connection closed".
        (Some(ended), ErrorCode::Internal) => (
            ErrorCode::Internal,
            format!("{} (the worker {})", refused.1, ended_text(ended)),
        ),
        _ => refused,
    }
}

fn ended_text(ended: Ended) -> String {
    match ended {
        Ended::Signaled(sig) => format!("was killed by {}", process::signal_name(sig)),
        Ended::Exited(code) => format!("exited with code {code}"),
    }
}

/// Bytes of the library's name kept in its memfd's name. The kernel takes
/// at most 249 bytes (`NAME_MAX` less its own `memfd:` prefix); a longer
/// name would make every allocation with it fail.
const MEMFD_NAME_BYTES: usize = 200;

/// `rfaas:` and the library's name cut to [`MEMFD_NAME_BYTES`] bytes, at a
/// character boundary.
fn memfd_name(library_name: &str) -> String {
    let mut end = library_name.len().min(MEMFD_NAME_BYTES);
    while !library_name.is_char_boundary(end) {
        end -= 1;
    }
    let name = match &library_name[..end] {
        "" => "library",
        cut => cut,
    };
    format!("rfaas:{name}")
}

/// The allocation's directory: owned by the lease's user, mode 0700.
fn make_runtime_dir(dir: &Path, user: &User) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir(dir)?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes())
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    // SAFETY: c is a valid C string for the call.
    if unsafe { libc::chown(c.as_ptr(), user.uid, user.gid) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memfd_names_are_cut_at_bytes_within_the_kernels_limit() {
        // 200 three-byte characters: 600 bytes, over the kernel's 249, and
        // byte 200 is inside a character.
        let long = "€".repeat(200);
        let name = memfd_name(&long);
        assert!(
            name.len() <= "rfaas:".len() + MEMFD_NAME_BYTES,
            "{}",
            name.len()
        );
        assert!(long.starts_with(name.strip_prefix("rfaas:").unwrap()));
        crate::ipc::sealed_memfd(&name, b"\x7fELF").expect("the kernel takes the name");
        assert_eq!(memfd_name(""), "rfaas:library");
        assert_eq!(memfd_name("libf.so"), "rfaas:libf.so");
    }
}

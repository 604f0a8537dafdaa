//! The TCP control protocol with clients: allocation, deallocation, and
//! the end of a connection (which deallocates everything made on it).

use std::io::{BufReader, Read};
use std::net::TcpStream;
use std::os::fd::AsFd;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rfaas_proto::control::{
    AllocateOk, AllocatePhases, AllocateRequest, Assignment, ControlError, Deallocate, Deallocated,
    ErrorCode, ErrorReply, Frame, FrameLimits, Kind, WorkerFailed, WorkerReady,
};
use rfaas_proto::hello::LaneKey;
use rfaas_proto::lease::{self, TokenError};

use super::capacity::Refusal;
use super::config::Sandbox;
use super::process::{self, Bwrap, Ended};
use super::state::{Allocation, ConnWriter, Shared, Stop};
use super::supervise::{self, unix_now};
use super::users::{self, User};
use crate::ipc;

/// A refusal: the code and the sentence for the client.
type Refused = (ErrorCode, String);

/// Serves one client connection until it closes, then deallocates what it
/// allocated.
pub(crate) fn serve(shared: Arc<Shared>, stream: TcpStream) {
    let peer = stream
        .peer_addr()
        .map_or_else(|_| "?".to_owned(), |a| a.to_string());
    let _ = stream.set_nodelay(true);
    // A client that stops reading must not hold a watcher forever.
    let _ = stream.set_write_timeout(Some(Duration::from_secs(10)));
    let writer = match stream.try_clone() {
        Ok(w) => w,
        Err(e) => {
            tracing::warn!(%peer, error = %e, "cannot use a control connection");
            return;
        }
    };
    let conn = Arc::new(ConnWriter::new(writer));
    let conn_id = shared.next_id();
    tracing::debug!(%peer, conn = conn_id, "control connection");
    let limits = shared.client_limits();
    let mut reader = BufReader::new(stream);
    loop {
        let frame = match Frame::read_from(&mut reader, limits) {
            Ok(f) => f,
            Err(ControlError::Io(e)) => {
                tracing::debug!(%peer, error = %e, "control connection closed");
                break;
            }
            Err(e) => {
                let code = match e {
                    ControlError::TooLarge { what: "blob", .. } => ErrorCode::TooLarge,
                    _ => ErrorCode::MalformedRequest,
                };
                conn.error(0, code, format!("{e}; closing the connection"));
                linger(&conn, reader.get_mut(), limits);
                break;
            }
        };
        match frame.kind {
            Kind::AllocateRequest => {
                let reply = allocate(&shared, &conn, conn_id, &frame);
                conn.send(&reply);
                // Only now: spawning the pooled worker's successor (fork,
                // exec, dynamic linking) would compete for the CPU with the
                // allocation it replaces.
                shared.refill();
            }
            Kind::Deallocate => match frame.parse::<Deallocate>() {
                Ok(d) => deallocate(&shared, &conn, conn_id, d),
                Err(e) => conn.error(
                    request_id_of(&frame),
                    ErrorCode::MalformedRequest,
                    e.to_string(),
                ),
            },
            other => conn.error(
                request_id_of(&frame),
                ErrorCode::MalformedRequest,
                format!("a {other:?} message is not a client request; send AllocateRequest or Deallocate"),
            ),
        }
    }
    let ids: Vec<u64> = shared
        .lock()
        .allocations
        .values()
        .filter(|a| a.conn_id == conn_id)
        .map(|a| a.id)
        .collect();
    if !ids.is_empty() {
        tracing::info!(%peer, allocations = ?ids, "control connection closed; deallocating");
        let left = shared.end_allocations(&ids, Stop::Deallocate, Duration::from_secs(10));
        if left > 0 {
            tracing::error!(%peer, left, "workers did not end after SIGKILL");
        }
    }
}

/// After refusing a broken frame: stop writing, read (and drop) what the
/// client still sends for a moment, so closing does not reset the
/// connection before the client reads the refusal.
fn linger(conn: &ConnWriter, stream: &mut TcpStream, limits: FrameLimits) {
    conn.shutdown_write();
    let _ = stream.set_read_timeout(Some(Duration::from_secs(1)));
    let mut budget = u64::from(limits.max_blob) + (1 << 20);
    let mut buf = [0u8; 64 * 1024];
    let until = Instant::now() + Duration::from_secs(2);
    while budget > 0 && Instant::now() < until {
        match stream.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => budget = budget.saturating_sub(n as u64),
        }
    }
}

/// The `request_id` of a frame whose message did not parse, or 0.
fn request_id_of(frame: &Frame) -> u64 {
    serde_json::from_slice::<serde_json::Value>(&frame.json)
        .ok()
        .and_then(|v| v.get("request_id").and_then(serde_json::Value::as_u64))
        .unwrap_or(0)
}

fn deallocate(shared: &Shared, conn: &ConnWriter, conn_id: u64, d: Deallocate) {
    let known = shared
        .lock()
        .allocations
        .get(&d.allocation_id)
        .is_some_and(|a| a.conn_id == conn_id && a.ready);
    if !known {
        conn.error(
            d.request_id,
            ErrorCode::UnknownAllocation,
            format!(
                "allocation {} is not running on this connection (it ended or was made on another connection)",
                d.allocation_id
            ),
        );
        return;
    }
    let left = shared.end_allocations(
        &[d.allocation_id],
        Stop::Deallocate,
        Duration::from_secs(10),
    );
    if left > 0 {
        conn.error(
            d.request_id,
            ErrorCode::Internal,
            format!(
                "the worker of allocation {} did not end after SIGKILL",
                d.allocation_id
            ),
        );
        return;
    }
    tracing::info!(allocation = d.allocation_id, "deallocated");
    conn.send(&Frame::new(
        &Deallocated {
            request_id: d.request_id,
            allocation_id: d.allocation_id,
        },
        Vec::new(),
    ));
}

/// Handles one `AllocateRequest` and returns the reply frame.
fn allocate(shared: &Arc<Shared>, conn: &Arc<ConnWriter>, conn_id: u64, frame: &Frame) -> Frame {
    let started = Instant::now();
    let req = match frame.parse::<AllocateRequest>() {
        Ok(r) => r,
        Err(e) => {
            return error_frame(
                request_id_of(frame),
                ErrorCode::MalformedRequest,
                e.to_string(),
            )
        }
    };
    let rid = req.request_id;
    match allocate_checked(shared, conn, conn_id, &req, &frame.blob, started) {
        Ok(ok) => Frame::new(&ok, Vec::new()),
        Err((code, message)) => {
            tracing::info!(request_id = rid, ?code, %message, "allocation refused");
            error_frame(rid, code, message)
        }
    }
}

fn error_frame(request_id: u64, code: ErrorCode, message: String) -> Frame {
    Frame::new(
        &ErrorReply {
            request_id,
            code,
            message,
        },
        Vec::new(),
    )
}

/// The checks of docs/invocation.md, in order, then the worker.
fn allocate_checked(
    shared: &Arc<Shared>,
    conn: &Arc<ConnWriter>,
    conn_id: u64,
    req: &AllocateRequest,
    library: &[u8],
    started: Instant,
) -> Result<AllocateOk, Refused> {
    let s = &shared.settings;
    let malformed = |m: String| (ErrorCode::MalformedRequest, m);
    if req.cores == 0 {
        return Err(malformed(
            "the request asks for 0 cores; ask for at least one lane".into(),
        ));
    }
    if req.functions.is_empty() {
        return Err(malformed(
            "the request names no functions; list the symbols to call".into(),
        ));
    }
    if (req.input_capacity as usize) < rfaas_proto::InvocationHeader::LEN {
        return Err(malformed(format!(
            "input_capacity {} cannot hold the {}-byte invocation header",
            req.input_capacity,
            rfaas_proto::InvocationHeader::LEN
        )));
    }
    if !s.providers.contains(&req.provider) {
        return Err((
            ErrorCode::ProviderUnsupported,
            format!(
                "this executor serves the fabric providers {:?}, not {:?}; use one of them",
                s.providers, req.provider
            ),
        ));
    }
    let claims =
        lease::verify(&req.token, &shared.secret, unix_now(), &s.node_name).map_err(|e| {
            let code = match e {
                TokenError::BadSignature => ErrorCode::TokenForged,
                TokenError::Expired { .. } => ErrorCode::TokenExpired,
                TokenError::WrongNode { .. } => ErrorCode::TokenWrongNode,
                _ => ErrorCode::TokenMalformed,
            };
            (code, e.to_string())
        })?;
    if req.cores > claims.cores || req.memory_mib > claims.memory_mib {
        return Err((
            ErrorCode::ExceedsLease,
            format!(
                "the request asks for {} cores and {} MiB, but lease {} grants {} cores and {} MiB; ask for less or get a bigger lease",
                req.cores, req.memory_mib, claims.lease_id, claims.cores, claims.memory_mib
            ),
        ));
    }
    let deadline_ms = if req.deadline_ms == 0 {
        s.default_deadline_ms
    } else {
        req.deadline_ms
    };
    let too_large = |what: &str, asked: u64, limit: u64| {
        Err((
            ErrorCode::TooLarge,
            format!("{what} is {asked}, this executor allows at most {limit}"),
        ))
    };
    if library.len() as u64 > u64::from(s.max_library_bytes) {
        return too_large(
            "the library size in bytes",
            library.len() as u64,
            s.max_library_bytes.into(),
        );
    }
    if req.cores > s.max_lanes {
        return too_large(
            "the number of lanes (cores)",
            req.cores.into(),
            s.max_lanes.into(),
        );
    }
    if req.input_capacity > s.max_input_capacity {
        return too_large(
            "input_capacity",
            req.input_capacity.into(),
            s.max_input_capacity.into(),
        );
    }
    if req.output_capacity > s.max_output_capacity {
        return too_large(
            "output_capacity",
            req.output_capacity.into(),
            s.max_output_capacity.into(),
        );
    }
    if deadline_ms > s.max_deadline_ms {
        return too_large("deadline_ms", deadline_ms, s.max_deadline_ms);
    }
    // Looked up before the lock; reported in the documented order.
    let user = check_user(&claims.user, &s.node_name);
    let elf_ok = library.starts_with(b"\x7fELF");

    let id = shared.next_id();
    let runtime_dir = s.runtime_dir.join(format!("alloc-{id}"));
    let (cpus, user) = {
        let mut st = shared.lock();
        let cpus = st
            .capacity
            .grant(
                claims.lease_id,
                claims.cores,
                claims.memory_mib,
                req.cores,
                req.memory_mib,
            )
            .map_err(|r| match r {
                Refusal::ExceedsLease(m) => (ErrorCode::ExceedsLease, m),
                Refusal::NoCapacity(m) => (ErrorCode::NoCapacity, m),
            })?;
        let refuse = |st: &mut super::state::State, code, m| {
            st.capacity.release(claims.lease_id, &cpus, req.memory_mib);
            Err((code, m))
        };
        if st.draining {
            return refuse(
                &mut st,
                ErrorCode::Draining,
                format!(
                    "executor {} is draining (its node is being retrieved); allocate elsewhere",
                    s.node_name
                ),
            );
        }
        let user = match user {
            Ok(u) => u,
            Err(m) => return refuse(&mut st, ErrorCode::UserRefused, m),
        };
        if !elf_ok {
            return refuse(
                &mut st,
                ErrorCode::MalformedLibrary,
                format!(
                    "the library {:?} is not an ELF shared object (it does not start with \\x7fELF); send the .so file's bytes",
                    req.library_name
                ),
            );
        }
        st.allocations.insert(
            id,
            Allocation {
                id,
                lease_id: claims.lease_id,
                user: claims.user.clone(),
                conn_id,
                conn: Arc::clone(conn),
                pid: None,
                worker_sock: None,
                cpus: cpus.clone(),
                memory_mib: req.memory_mib,
                expires_at: claims.expires_at,
                ready: false,
                stop: None,
                ended: None,
                runtime_dir: runtime_dir.clone(),
            },
        );
        (cpus, user)
    };
    let validate_ns = started.elapsed().as_nanos() as u64;
    tracing::info!(
        allocation = id,
        lease = claims.lease_id,
        user = %user.name,
        cores = req.cores,
        memory_mib = req.memory_mib,
        cpus = ?cpus,
        library = %req.library_name,
        "allocation granted"
    );

    let started_worker = Instant::now();
    let lane_key = match LaneKey::random() {
        Ok(k) => k.to_hex(),
        Err(e) => {
            let refused = (
                ErrorCode::Internal,
                format!("the executor cannot draw a lane key from /dev/urandom: {e}; retry"),
            );
            return Err(abandon(shared, id, refused));
        }
    };
    let result = start_worker(
        shared,
        id,
        req,
        library,
        &user,
        &cpus,
        deadline_ms,
        claims.expires_at,
        &runtime_dir,
        &lane_key,
    );
    let (ready, pooled) = match result {
        Ok(r) => r,
        Err(refused) => {
            let refused = abandon(shared, id, refused);
            return Err(refused);
        }
    };
    let worker_ns = started_worker.elapsed().as_nanos() as u64;
    Ok(AllocateOk {
        request_id: req.request_id,
        allocation_id: id,
        lease_id: claims.lease_id,
        fabric_addr: ready.fabric_addr,
        lanes: ready.lanes,
        lane_key,
        functions: req.functions.clone(),
        output_capacity: req.output_capacity,
        deadline_ms,
        expires_at: claims.expires_at,
        pooled,
        phases: AllocatePhases {
            validate_ns,
            worker_ns: worker_ns.saturating_sub(ready.load_ns + ready.listen_ns),
            load_ns: ready.load_ns,
            listen_ns: ready.listen_ns,
        },
    })
}

/// Whether workers may run as `name` here.
fn check_user(name: &str, node: &str) -> Result<User, String> {
    let user = match users::lookup(name) {
        Ok(Some(u)) => u,
        Ok(None) => {
            return Err(format!(
                "the lease's user {name:?} does not exist on node {node}; the node's user database must know every job user"
            ))
        }
        Err(e) => return Err(format!("cannot look up the lease's user {name:?}: {e}")),
    };
    if user.uid == 0 {
        return Err(format!(
            "the lease's user {name:?} is root (uid 0); workers never run as root"
        ));
    }
    let euid = users::effective_uid();
    if euid != 0 && user.uid != euid {
        return Err(format!(
            "this executor runs as uid {euid}, not root, so it can run workers only as itself, not as {name:?} (uid {}); run rfaas-executord as root",
            user.uid
        ));
    }
    Ok(user)
}

/// Prepares the runtime directory and memory limit, attaches a worker,
/// sends it the assignment and waits for its answer. Returns the answer
/// and whether the worker came from the pool.
#[allow(clippy::too_many_arguments)]
fn start_worker(
    shared: &Arc<Shared>,
    id: u64,
    req: &AllocateRequest,
    library: &[u8],
    user: &User,
    cpus: &[u32],
    deadline_ms: u64,
    expires_at: u64,
    runtime_dir: &Path,
    lane_key: &str,
) -> Result<(WorkerReady, bool), Refused> {
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
        .create(id, req.memory_mib)
        .map_err(|e| internal("create the worker's memory cgroup", &e))?;
    let memfd = ipc::sealed_memfd(&memfd_name(&req.library_name), library)
        .map_err(|e| internal("copy the library into a memfd", &e))?;
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
        lanes: req.cores,
        memory_limit_bytes: shared.limiter.rlimit_bytes(req.memory_mib),
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
    };
    let frame = Frame::new(&assignment, Vec::new());

    // A pooled worker that died idle shows only when the send fails; one
    // fresh spawn then takes its place.
    let mut tries = 0;
    let (sock, pid, pooled) = loop {
        tries += 1;
        let (sock, pid, pooled) = attach_worker(shared, id, runtime_dir, cgroup.as_deref())?;
        if let (Some(procs), true) = (&cgroup, pooled) {
            if let Err(e) = super::memlimit::join(procs, pid) {
                return Err(internal("move the worker into its memory cgroup", &e));
            }
        }
        match ipc::send_frame(&sock, &frame, Some(memfd.as_fd())) {
            Ok(()) => break (sock, pid, pooled),
            Err(e) if pooled && tries == 1 => {
                tracing::warn!(pid, error = %e, "a pooled worker did not take its assignment; spawning another");
                detach_worker(shared, id);
            }
            Err(e) => return Err(internal("send the assignment to the worker", &e)),
        }
    };
    drop(memfd);
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
fn abandon(shared: &Shared, id: u64, refused: Refused) -> Refused {
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
    if a.stop == Some(Stop::Stopped) {
        return (
            ErrorCode::Draining,
            format!(
                "executor {} began draining while the worker started; allocate elsewhere",
                shared.settings.node_name
            ),
        );
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

fn memfd_name(library_name: &str) -> String {
    let mut name: String = library_name.chars().take(200).collect();
    if name.is_empty() {
        name = "library".into();
    }
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

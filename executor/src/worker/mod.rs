//! The worker process (`rfaas-worker`): one per allocation; serves its
//! lanes' invocations on one thread per core, each thread serving several
//! lanes (lane `i` on thread `i mod threads`). See `docs/invocation.md`.
//!
//! # Life
//!
//! Started by the daemon with one end of a socket pair (`--control-fd`),
//! the worker waits for an [`Assignment`] with the library's sealed memfd
//! (and the allocation's meter area, which it maps), then, in this order:
//! pins itself to the assignment's CPUs, applies the
//! address-space limit, becomes the lease's user (never root), loads the
//! library through `/proc/self/fd` and resolves the function table, opens
//! the fabric, registers each lane's buffers, listens and answers
//! [`WorkerReady`] (or [`WorkerFailed`], then
//! exits with [`EXIT_SETUP_FAILED`]). It accepts one connection per lane,
//! in order, each onto its thread's completion queue, and then starts the
//! worker threads (`rfaas-serve-<t>`). When every client has gone it exits
//! 0. After `WorkerReady` the control socket
//! carries only [`ExpiryMoved`] (a renewed lease's end), which a thread of
//! its own (`rfaas-control`) applies and echoes.
//! SIGUSR1 makes every later request answer `executor_draining`.
//! `expires_at` 0 means no lease end and `deadline_ms` 0 no deadline (the
//! daemon fills in its defaults); a bulk payload is bounded by
//! `memory_limit_bytes`, or [`DEFAULT_PULL_LIMIT`] without one.
//!
//! # Serving a request
//!
//! A worker thread polls (or waits on) the one completion queue of all its
//! lanes ([`thread`]). A request is a receive completion carrying a
//! [`RequestImm`](rfaas_proto::RequestImm); its connection tag names the
//! lane. The thread checks the [`InvocationHeader`] in the
//! input buffer (`malformed_request`), the function index
//! (`unknown_function`), the lease's end (`lease_expired`) and the drain
//! flag (`executor_draining`). A bulk payload is read from the client in
//! 1 MiB chunks, four in flight, into a pull buffer grown on demand
//! (`payload_too_large` past the memory limit). The thread publishes the
//! start time for the [`watchdog`], calls the function, and answers
//! with one write-with-immediate of the output into the client's output
//! buffer ([`ResponseImm`](rfaas_proto::ResponseImm); the output only with `ok`, and
//! `output_too_large` for a return value above the output capacity). A
//! `PeerLost` or `Flushed` completion ends the lane; a thread ends with its
//! last lane. The receive is posted again after the answer.
//!
//! Each lane publishes what it does in its record of the meter area the
//! daemon passed with the assignment ([`meter`], [`rfaas_proto::meter`]):
//! serving a request (from its arrival to its answer), with the clock read
//! when a request arrives and once it is answered; each thread publishes
//! its polling (hot) and blocked waiting (warm) in its first lane's record
//! (see [`thread`]).
//!
//! A function that dies of a signal cannot answer; the [`watchdog`]
//! marks the crash in the meter area (so the daemon counts the worker as
//! ending before it reaps it), answers for it, `function_crashed` with the
//! signal (see `crash`), and the process then dies of that signal. The
//! watchdog starts once every lane is connected, as the client library
//! waits for before its first call; a crash before that is reported by the
//! daemon alone. One function runs at a time per thread, so the watchdog
//! follows threads ([`watchdog::Running`]), each naming the lane it serves.
//!
//! # Output buffer and guard page
//!
//! Each lane's output region is registered with
//! [`Domain::register_guarded`](rfaas_fabric::Domain::register_guarded):
//! whole pages followed by a `PROT_NONE` page. The function's `out`
//! pointer is placed so that `out + output_capacity` (rounded up to 64
//! bytes) is exactly the region's end:
//!
//! ```text
//!  region start        out                        region end
//!  |   (slack < 1 page) |  output_capacity (↑64)  | guard page (PROT_NONE) |
//! ```
//!
//! so a function writing past its capacity (by more than the rounding)
//! faults at once with SIGSEGV: the client gets `function_crashed`, and
//! the daemon reports `crashed`.
//!
//! # Exit codes
//!
//! 0: every client went away; [`EXIT_FAILURE`]: internal or control-socket
//! failure; [`EXIT_SETUP_FAILED`]: the assignment failed (after
//! `WorkerFailed`); [`EXIT_DEADLINE`]: a function overran the deadline.
//! Killed by a signal: the function crashed (or was stopped).
//!
//! # Layout
//!
//! - [`adopt`]: outliving the daemon: waiting for the next one on
//!   `adopt.sock`, or ending at the lease's end.
//! - [`privileges`]: parent-death signal, pinning, memory limit, user drop.
//! - [`library`]: `dlopen` from the memfd, the function table.
//! - `lane`: one lane's resources and connection tags.
//! - [`thread`]: a worker thread's loop over its lanes.
//! - [`meter`]: a lane's counters and their record in the meter area.
//! - `crash`: the fatal-signal handler and the crash it hands the watchdog.
//! - [`watchdog`]: answers for crashed and overrunning functions.

pub mod adopt;
mod crash;
mod lane;
pub mod library;
pub mod meter;
pub mod privileges;
pub mod thread;
pub mod watchdog;

use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use std::time::{Duration, Instant};

use rfaas_fabric::{Access, EndpointOptions, Fabric};
use rfaas_proto::control::client::Descriptor;
use rfaas_proto::control::worker::{Assignment, ExpiryMoved, WorkerFailed, WorkerReady};
use rfaas_proto::control::{ControlError, ErrorCode, ErrorReply, Frame, FrameLimits, Kind};
use rfaas_proto::hello::{LaneHello, LaneKey, LANE_HELLO_IMM};
use rfaas_proto::{InvocationHeader, MAX_FUNCTIONS};

use crate::ipc;
use crate::meter::MeterArea;
use lane::{Lane, LaneBuffers, RECV_DEPTH};
use library::Library;
use meter::LaneMeter;
use thread::{ThreadConfig, WorkerThread, BATCH_WINDOW};
use watchdog::{Running, ThreadFabric, ThreadWatch};

/// Exit code of an internal or control-socket failure.
pub const EXIT_FAILURE: i32 = 1;

/// Exit code after the worker answered `WorkerFailed`.
pub const EXIT_SETUP_FAILED: i32 = 2;

/// Exit code when a function ran past the deadline (the daemon reports
/// `ExitCause::DeadlineExceeded`).
pub const EXIT_DEADLINE: i32 = 3;

/// Largest bulk payload pulled without a memory limit.
pub const DEFAULT_PULL_LIMIT: usize = 1 << 30;

/// Set by SIGUSR1: the executor is draining; requests are refused.
pub static DRAINING: AtomicBool = AtomicBool::new(false);

/// The lease's end, Unix seconds (0: none): the assignment's, later moved
/// by [`ExpiryMoved`]. Requests are refused from then on.
pub static EXPIRES_AT: AtomicU64 = AtomicU64::new(0);

/// Why a worker stopped before serving.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WorkerError {
    /// The control socket failed or carried something else than expected.
    #[error("the control socket to rfaas-executord failed: {0}")]
    Control(#[from] ControlError),
    /// The parent died before the worker could arm the parent-death signal.
    #[error("the daemon that started this worker has already exited; the worker ends with it")]
    Orphaned,
    /// The assignment could not be carried out; the daemon was told.
    #[error("{message}")]
    Failed {
        /// The code sent in `WorkerFailed`.
        code: ErrorCode,
        /// What failed and what to do.
        message: String,
    },
    /// Serving failed after `WorkerReady` (a lane could not start).
    #[error("the worker failed while serving: {0}")]
    Serving(String),
}

impl WorkerError {
    /// A failure reported to the daemon with `code`.
    pub fn failed(code: ErrorCode, message: String) -> WorkerError {
        WorkerError::Failed { code, message }
    }

    /// The exit code the worker ends with after this error.
    pub fn exit_code(&self) -> i32 {
        match self {
            WorkerError::Failed { .. } => EXIT_SETUP_FAILED,
            _ => EXIT_FAILURE,
        }
    }
}

/// Installs the SIGUSR1 handler that sets [`DRAINING`].
pub fn install_drain_handler() -> std::io::Result<()> {
    extern "C" fn on_usr1(_: libc::c_int) {
        DRAINING.store(true, Ordering::Relaxed);
    }
    // SAFETY: sigaction is plain data; all-zero is an empty mask, no flags.
    let mut act: libc::sigaction = unsafe { std::mem::zeroed() };
    act.sa_sigaction = on_usr1 as extern "C" fn(libc::c_int) as libc::sighandler_t;
    act.sa_flags = libc::SA_RESTART;
    // SAFETY: the handler only stores to an atomic (async-signal-safe).
    if unsafe { libc::sigaction(libc::SIGUSR1, &act, std::ptr::null_mut()) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Serves one assignment from `control` until every lane's client has gone.
pub fn run(control: UnixStream) -> Result<(), WorkerError> {
    let limits = FrameLimits {
        max_json: 1 << 20,
        max_blob: 0,
    };
    let (frame, fds) = ipc::recv_frame(&control, limits)?;
    let mut fds = fds.into_iter();
    let (memfd, meter_fd) = (fds.next(), fds.next());
    let assignment: Assignment = frame.parse()?;
    tracing::info!(
        allocation_id = assignment.allocation_id,
        uid = assignment.uid,
        lanes = assignment.lanes,
        provider = %assignment.provider,
        "assignment received"
    );
    let prepared = match memfd
        .ok_or_else(|| {
            WorkerError::failed(
                ErrorCode::MalformedRequest,
                "the assignment came without the library's memfd".into(),
            )
        })
        .and_then(|memfd| prepare(&assignment, memfd, meter_fd))
    {
        Ok(p) => p,
        Err(e) => {
            if let WorkerError::Failed { code, message } = &e {
                tracing::error!(code = ?code, "{message}");
                let reply = WorkerFailed(ErrorReply {
                    request_id: assignment.allocation_id,
                    code: *code,
                    message: message.clone(),
                });
                ipc::send_frame(&control, &Frame::new(&reply, vec![]), &[])
                    .map_err(ControlError::Io)?;
            }
            return Err(e);
        }
    };
    let ready = WorkerReady {
        fabric_addr: prepared.listener.local_addr(),
        lanes: prepared
            .lanes
            .iter()
            .map(|l| Descriptor {
                addr: l.input.as_ptr() as u64,
                rkey: l.input.rkey(),
                len: l.slot_capacity as u32,
            })
            .collect(),
        slot_stride: if assignment.slot_count() > 1 {
            prepared.lanes.first().map_or(0, |l| l.stride as u32)
        } else {
            0
        },
        load_ns: prepared.load_ns,
        listen_ns: prepared.listen_ns,
    };
    EXPIRES_AT.store(assignment.expires_at, Ordering::Relaxed);
    let assignment_dir = std::path::PathBuf::from(&assignment.adopt_dir);
    let assignment_id = assignment.allocation_id;
    ipc::send_frame(&control, &Frame::new(&ready, vec![]), &[]).map_err(ControlError::Io)?;
    // It only reads and echoes small frames: a small stack, which counts
    // against the allocation's memory under RLIMIT_AS like any mapping.
    std::thread::Builder::new()
        .name("rfaas-control".into())
        .stack_size(CONTROL_STACK)
        .spawn(move || follow_daemon(control, &assignment_dir, assignment_id))
        .map_err(|e| internal(format!("cannot start the control thread: {e}")))?;
    serve(&assignment, prepared)
}

/// A worker thread's stack: 2 MiB for the functions, and the guard the
/// thread makes of its lowest part (`crash::arm_thread`).
pub const THREAD_STACK: usize = (2 << 20) + crash::STACK_GUARD;

/// The stack of the thread that follows lease renewals.
const CONTROL_STACK: usize = 128 << 10;

/// Follows the daemon's socket; when it ends and the assignment named an
/// adoption directory, waits there for the next daemon and follows its
/// socket ([`adopt`]); without one, returns (the parent-death signal
/// follows).
fn follow_daemon(mut control: UnixStream, adopt_dir: &std::path::Path, allocation_id: u64) {
    loop {
        follow_expiry(&control);
        if adopt_dir.as_os_str().is_empty() {
            return;
        }
        control = match adopt::await_daemon(adopt_dir, allocation_id) {
            Ok(c) => c,
            Err(e) => {
                tracing::error!(dir = %adopt_dir.display(), error = %e, "cannot wait for a new daemon; the worker serves on until its clients go");
                return;
            }
        };
    }
}

/// Applies and echoes every [`ExpiryMoved`] from the daemon until the
/// socket ends (the daemon is gone, and the parent-death signal follows)
/// or carries something else.
fn follow_expiry(control: &UnixStream) {
    let limits = FrameLimits {
        max_json: 4096,
        max_blob: 0,
    };
    loop {
        let moved = match ipc::recv_frame(control, limits) {
            Ok((f, _)) if f.kind == Kind::ExpiryMoved => f.parse::<ExpiryMoved>(),
            Ok((f, _)) => {
                tracing::warn!(kind = ?f.kind, "unexpected message on the control socket; no more lease renewals");
                return;
            }
            Err(e) => {
                tracing::debug!(error = %e, "the control socket ended");
                return;
            }
        };
        let moved = match moved {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(error = %e, "unreadable ExpiryMoved; no more lease renewals");
                return;
            }
        };
        // The daemon never moves an end earlier; a stray message cannot either.
        let before = EXPIRES_AT.fetch_max(moved.expires_at, Ordering::Relaxed);
        tracing::info!(
            before,
            expires_at = moved.expires_at,
            "the lease was renewed"
        );
        if let Err(e) = ipc::send_frame(control, &Frame::new(&moved, vec![]), &[]) {
            tracing::debug!(error = %e, "cannot acknowledge the renewal");
            return;
        }
    }
}

/// Everything set up before `WorkerReady`.
struct Prepared {
    library: Library,
    /// The daemon's meter area, mapped for the worker's life; `None`
    /// without one (the lanes then publish into records nobody reads).
    meter: Option<&'static MeterArea>,
    _fabric: Fabric,
    domain: Arc<rfaas_fabric::Domain>,
    listener: rfaas_fabric::Listener,
    lanes: Vec<LaneBuffers>,
    /// One completion queue per worker thread.
    cqs: Vec<rfaas_fabric::CompletionQueue>,
    load_ns: u64,
    listen_ns: u64,
    /// The allocation's lane key, parsed from the assignment.
    key: LaneKey,
}

/// A lane's endpoint: a receive per slot and the spares, and room for
/// every slot's response besides a pull's reads.
fn endpoint_options(a: &Assignment) -> EndpointOptions {
    let slots = usize::from(a.slot_count());
    EndpointOptions {
        send_depth: 64.max(2 * slots + 8),
        recv_depth: slots - 1 + RECV_DEPTH,
        // The client connects right after AllocateOk: a peer slower than
        // this in the fabric's own handshake is not it, and is given up.
        connect_timeout: HELLO_TIMEOUT,
        ..EndpointOptions::default()
    }
}

/// Pins, limits, drops privileges, loads the library and listens.
fn prepare(
    a: &Assignment,
    memfd: std::os::fd::OwnedFd,
    meter_fd: Option<std::os::fd::OwnedFd>,
) -> Result<Prepared, WorkerError> {
    check(a)?;
    let meter = match meter_fd {
        Some(fd) => {
            let m = map_meter(a, &fd)?;
            adopt::keep_meter_fd(fd);
            Some(m)
        }
        None => None,
    };
    let key = LaneKey::from_hex(&a.lane_key).map_err(|e| {
        WorkerError::failed(
            ErrorCode::MalformedRequest,
            format!("the assignment's lane key is unusable: {e}"),
        )
    })?;
    if !a.cpus.is_empty() {
        privileges::pin_to(&a.cpus)?;
    }
    if a.memory_limit_bytes > 0 {
        privileges::limit_memory(a.memory_limit_bytes)?;
    }
    privileges::drop_privileges(a.uid, a.gid)?;

    let t = Instant::now();
    let library = Library::load(memfd, &a.functions).map_err(|e| load_failure(a, e))?;
    let load_ns = t.elapsed().as_nanos() as u64;

    let t = Instant::now();
    let fabric_failed = |what: &str, e: rfaas_fabric::Error| {
        let no_memory = matches!(&e, rfaas_fabric::Error::Io { source, .. }
            if source.raw_os_error() == Some(libc::ENOMEM));
        if no_memory && a.memory_limit_bytes > 0 {
            return too_small(a, &format!("{what} ({e}: out of memory)"));
        }
        WorkerError::failed(
            ErrorCode::Internal,
            format!("the worker cannot {what} on the {} fabric: {e}", a.provider),
        )
    };
    let fabric = Fabric::open(&a.provider).map_err(|e| match e {
        rfaas_fabric::Error::ProviderUnavailable { .. }
        | rfaas_fabric::Error::UnknownProvider(_) => {
            WorkerError::failed(ErrorCode::ProviderUnsupported, format!("{e}"))
        }
        e => fabric_failed("open the provider", e),
    })?;
    let domain = Arc::new(
        fabric
            .domain()
            .map_err(|e| fabric_failed("create a domain", e))?,
    );
    let opts = endpoint_options(a);
    let threads = usize::from(a.thread_count());
    let lanes_per_thread = usize::from(a.lanes).div_ceil(threads);
    let cqs = (0..threads)
        .map(|_| {
            // Room for every lane's operations and every connection on
            // probation at once (accept_lane).
            let depth = (opts.send_depth + opts.recv_depth) * (lanes_per_thread + MAX_CANDIDATES);
            fabric.completion_queue(depth + 1)
        })
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| fabric_failed("create a completion queue", e))?;
    let slots = usize::from(a.slot_count());
    let capacity = a.input_capacity as usize;
    // Each slot's part starts on a cache line; one slot's is the buffer.
    let stride = if slots > 1 {
        capacity.div_ceil(64) * 64
    } else {
        capacity
    };
    let mut lanes = Vec::with_capacity(a.lanes.into());
    for lane in 0..a.lanes {
        let input = domain
            .register(stride * slots, Access::REMOTE_WRITE)
            .map_err(|e| {
                let what = format!(
                    "register lane {lane}'s {}-byte input buffer",
                    stride * slots
                );
                fabric_failed(&what, e)
            })?;
        let out_len = (a.output_capacity as usize).div_ceil(64) * 64;
        let outputs = (0..slots)
            .map(|_| {
                domain
                    .register_guarded(out_len, Access::LOCAL)
                    .map(Arc::new)
            })
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| {
                let what = format!("register lane {lane}'s {out_len}-byte output buffers");
                fabric_failed(&what, e)
            })?;
        lanes.push(LaneBuffers {
            input,
            stride,
            slot_capacity: capacity,
            outputs,
        });
    }
    let listener = fabric
        .listen(&a.listen_addr)
        .map_err(|e| fabric_failed(&format!("listen on {:?}", a.listen_addr), e))?;
    let listen_ns = t.elapsed().as_nanos() as u64;
    Ok(Prepared {
        library,
        meter,
        _fabric: fabric,
        domain,
        listener,
        lanes,
        cqs,
        load_ns,
        listen_ns,
        key,
    })
}

/// Maps the meter area for the worker's life and checks it has a record
/// per lane.
fn map_meter(a: &Assignment, fd: &std::os::fd::OwnedFd) -> Result<&'static MeterArea, WorkerError> {
    use std::os::fd::AsFd;
    let unusable = |e: String| {
        WorkerError::failed(
            ErrorCode::Internal,
            format!("the worker cannot use the daemon's meter area: {e}"),
        )
    };
    let area = MeterArea::map(fd.as_fd()).map_err(|e| unusable(e.to_string()))?;
    if area.header().lanes < a.lanes {
        return Err(unusable(format!(
            "it has {} lane records for {} lanes",
            area.header().lanes,
            a.lanes
        )));
    }
    Ok(Box::leak(Box::new(area)))
}

/// A library that could not be mapped under the address-space limit is
/// the allocation's memory, not a malformed library.
fn load_failure(a: &Assignment, e: WorkerError) -> WorkerError {
    match &e {
        WorkerError::Failed {
            code: ErrorCode::MalformedLibrary,
            message,
        } if a.memory_limit_bytes > 0
            && [
                "failed to map segment",
                "cannot map zero-fill pages",
                "Cannot allocate memory",
            ]
            .iter()
            .any(|m| message.contains(m)) =>
        {
            too_small(a, "map the function library")
        }
        _ => e,
    }
}

/// `memory_too_small`: the worker could not do `what` within the
/// allocation's memory.
fn too_small(a: &Assignment, what: &str) -> WorkerError {
    WorkerError::failed(
        ErrorCode::MemoryTooSmall,
        format!(
            "the worker could not {what} within the allocation's {} MiB (an address-space limit: \
             the worker's own mappings, the library and every lane's buffers count); ask for \
             more memory_mib (docs/executor.md, \"Memory\", says how it is spent)",
            a.memory_mib
        ),
    )
}

/// Refuses assignments the worker cannot serve.
fn check(a: &Assignment) -> Result<(), WorkerError> {
    let bad = |m: String| Err(WorkerError::failed(ErrorCode::MalformedRequest, m));
    if a.lanes == 0 {
        return bad("the assignment has 0 lanes; at least one is needed".into());
    }
    if (a.input_capacity as usize) < InvocationHeader::LEN {
        return bad(format!(
            "the input capacity {} is smaller than the {}-byte invocation header",
            a.input_capacity,
            InvocationHeader::LEN
        ));
    }
    if let Some(why) = rfaas_proto::control::client::slots_refusal(a.slots) {
        return bad(why);
    }
    if a.functions.is_empty() || a.functions.len() > usize::from(MAX_FUNCTIONS) {
        return bad(format!(
            "the assignment names {} functions; between 1 and {MAX_FUNCTIONS} are allowed",
            a.functions.len()
        ));
    }
    Ok(())
}

/// One worker thread's part while the lanes are connected.
struct ThreadParts {
    cq: rfaas_fabric::CompletionQueue,
    endpoints: Vec<rfaas_fabric::Endpoint>,
    lanes: Vec<Lane>,
    regions: Vec<Box<[Arc<rfaas_fabric::MemoryRegion>]>>,
    /// Completions of its connected lanes taken while later lanes were
    /// being connected.
    early: Vec<rfaas_fabric::Completion>,
}

/// Accepts each lane's connection onto its thread's completion queue,
/// starts the worker threads and the watchdog, and waits for the threads
/// to end.
fn serve(a: &Assignment, p: Prepared) -> Result<(), WorkerError> {
    let functions: Arc<[library::Function]> = p.library.functions().into();
    let opts = endpoint_options(a);
    let pull_limit = if a.pull_limit_bytes > 0 {
        usize::try_from(a.pull_limit_bytes).unwrap_or(usize::MAX)
    } else if a.memory_limit_bytes > 0 {
        (a.memory_limit_bytes as usize).min(u32::MAX as usize)
    } else {
        DEFAULT_PULL_LIMIT
    };
    let threads = p.cqs.len();
    let mut parts: Vec<ThreadParts> = p
        .cqs
        .into_iter()
        .map(|cq| ThreadParts {
            cq,
            endpoints: Vec::new(),
            lanes: Vec::new(),
            regions: Vec::new(),
            early: Vec::new(),
        })
        .collect();
    let mut attempts = 0u64;
    for (index, l) in p.lanes.into_iter().enumerate() {
        let part = &mut parts[index % threads];
        let (endpoint, tag) = accept_lane(
            &p.listener,
            &p.domain,
            part,
            &l,
            &opts,
            index,
            &p.key,
            &mut attempts,
        )?;
        let meter = match p.meter {
            Some(area) => {
                let record = area
                    .record(index as u16)
                    .expect("map_meter checked a record per lane");
                LaneMeter::new(record, area.header().clock)
            }
            None => LaneMeter::unread(),
        };
        part.endpoints.push(endpoint);
        part.regions.push(l.outputs.clone().into());
        part.lanes
            .push(Lane::new(index, tag, l, a.output_capacity as usize, meter));
    }
    tracing::info!(lanes = a.lanes, threads, "every lane is connected");
    // The lanes' meter clock; without an area they read CLOCK_MONOTONIC.
    let ticks_per_sec = p
        .meter
        .map_or(1_000_000_000, |area| area.header().ticks_per_sec);
    let batch_window_ticks =
        (u128::from(ticks_per_sec) * BATCH_WINDOW.as_nanos() / 1_000_000_000) as u64;
    let runnings: Box<[Arc<Running>]> = (0..threads).map(|_| Arc::default()).collect();
    // Before any thread can run a function.
    crash::install(runnings.clone())
        .map_err(|e| internal(format!("cannot install the crash handler: {e}")))?;
    let mut handles = Vec::with_capacity(threads);
    let mut watches = Vec::with_capacity(threads);
    for (index, (part, running)) in parts.into_iter().zip(runnings.iter()).enumerate() {
        let fabric = Arc::new(ThreadFabric::new(part.endpoints, part.cq));
        watches.push(ThreadWatch {
            running: running.clone(),
            fabric: fabric.clone(),
            regions: part.regions,
        });
        let cfg = ThreadConfig {
            index,
            cpu: (!a.cpus.is_empty()).then(|| a.cpus[index % a.cpus.len()]),
            mode: a.mode,
            hot_timeout: Duration::from_micros(a.hot_timeout_us),
            output_capacity: a.output_capacity as usize,
            pull_limit,
            read_only_input: a.read_only_input,
            batch_window_ticks,
        };
        let worker = WorkerThread::new(
            cfg,
            functions.clone(),
            p.domain.clone(),
            fabric,
            part.lanes,
            running.clone(),
            part.early,
        );
        let handle = std::thread::Builder::new()
            .name(format!("rfaas-serve-{index}"))
            .stack_size(THREAD_STACK)
            .spawn(move || worker.run())
            .map_err(|e| internal(format!("cannot start worker thread {index}: {e}")))?;
        handles.push(handle);
    }
    let deadline = (a.deadline_ms > 0).then(|| Duration::from_millis(a.deadline_ms));
    watchdog::spawn(watches, deadline, p.meter)
        .map_err(|e| internal(format!("cannot start the watchdog: {e}")))?;
    for t in handles {
        if t.join().is_err() {
            return Err(internal("a worker thread panicked".into()));
        }
    }
    tracing::info!("every client has gone; the worker ends");
    Ok(())
}

/// How long a new connection has to present its lane hello.
const HELLO_TIMEOUT: Duration = Duration::from_secs(1);

/// How long the lane's accept loop waits on its completion queue before it
/// looks at the listener again, while some connection is on probation.
const HELLO_SLICE: Duration = Duration::from_millis(5);

/// Most connections on probation at once per lane; more wait in the
/// listener until one leaves (said its hello, failed, or timed out).
const MAX_CANDIDATES: usize = 4;

/// A connection on probation: accepted, not yet said its lane hello.
struct Candidate {
    endpoint: rfaas_fabric::Endpoint,
    tag: u64,
    deadline: Instant,
}

/// Accepts connections for lane `index` until one presents the allocation's
/// lane hello (see `rfaas_proto::hello`); others are dropped, logged. Several
/// connections can be on probation at once, so one that says nothing holds
/// up nobody behind it. Connections go onto the lane's thread's queue
/// (`part`), tagged by `attempts`, counted over the whole worker so that
/// tags never repeat on a queue. Leaves the endpoint with all
/// its receives posted (`opts.recv_depth`), and returns it with its connection tag
/// ([`lane::conn_tag`]).
#[allow(clippy::too_many_arguments)]
fn accept_lane(
    listener: &rfaas_fabric::Listener,
    domain: &rfaas_fabric::Domain,
    part: &mut ThreadParts,
    l: &LaneBuffers,
    opts: &EndpointOptions,
    index: usize,
    key: &LaneKey,
    attempts: &mut u64,
) -> Result<(rfaas_fabric::Endpoint, u64), WorkerError> {
    let mut candidates: Vec<Candidate> = Vec::new();
    let mut done = [rfaas_fabric::Completion::EMPTY; 16];
    let drop_one = |why: &str| {
        tracing::warn!(
            lane = index,
            "a connection {why}; dropped it, waiting for the client's"
        );
    };
    loop {
        // Wait for a connection while nobody is on probation; otherwise
        // only look, and not at all while the probation is full.
        let wait = (!candidates.is_empty()).then_some(Duration::ZERO);
        let accepted = if candidates.len() < MAX_CANDIDATES {
            listener.accept(domain, &mut part.cq, opts, wait)
        } else {
            Err(rfaas_fabric::Error::Timeout("the lane's probation is full"))
        };
        match accepted {
            Ok(endpoint) => {
                // Receives of dropped connections may still complete
                // (flushed), here or once the lane runs: the tag tells them
                // apart.
                let tag = lane::conn_tag(*attempts);
                *attempts += 1;
                for wr in 0..opts.recv_depth as u64 {
                    endpoint.post_recv(tag | wr).map_err(|e| {
                        internal(format!("posting lane {index}'s receives failed: {e}"))
                    })?;
                }
                candidates.push(Candidate {
                    endpoint,
                    tag,
                    deadline: Instant::now() + HELLO_TIMEOUT,
                });
            }
            Err(rfaas_fabric::Error::Timeout(_)) => {}
            // A peer that failed the fabric's handshake (silent, or not
            // speaking it): not the client; the listener is fine.
            Err(e @ rfaas_fabric::Error::Connect { .. }) => {
                drop_one(&format!("failed the fabric handshake ({e})"));
            }
            Err(e) => {
                return Err(internal(format!(
                    "accepting lane {index}'s connection failed: {e}"
                )))
            }
        }
        if candidates.is_empty() {
            continue;
        }
        let n = part
            .cq
            .wait(&mut done, HELLO_SLICE)
            .map_err(|e| internal(format!("waiting for lane {index}'s hello failed: {e}")))?;
        for c in &done[..n] {
            let tag = lane::tag_of(c.wr_id);
            let Some(at) = candidates.iter().position(|k| k.tag == tag) else {
                // A connected lane's (a request sent before every lane
                // was connected), kept for its thread; or a dropped
                // connection's.
                if part.lanes.iter().any(|l| l.tag == tag) {
                    part.early.push(*c);
                }
                continue;
            };
            let verdict = check_hello(l, index, key, c).and_then(|wr_id| {
                let k = &candidates[at];
                k.endpoint
                    .post_recv(wr_id)
                    .map_err(|e| format!("could not be given its receive back: {e}"))?;
                acknowledge_hello(&k.endpoint, &l.outputs[0], k.tag)
            });
            let k = candidates.swap_remove(at);
            match verdict {
                // The others on probation are dropped with `candidates`.
                Ok(()) => return Ok((k.endpoint, k.tag)),
                Err(why) => drop_one(&why),
            }
        }
        let now = Instant::now();
        candidates.retain(|k| {
            let keep = k.deadline > now;
            if !keep {
                drop_one(&format!(
                    "sent no lane hello within {} ms",
                    HELLO_TIMEOUT.as_millis()
                ));
            }
            keep
        });
    }
}

/// Checks that a connection's first completion `c` is the allocation's
/// hello for lane `index`. Returns the consumed receive's id, or why the
/// connection is refused.
fn check_hello(
    l: &LaneBuffers,
    index: usize,
    key: &LaneKey,
    c: &rfaas_fabric::Completion,
) -> Result<u64, String> {
    if c.opcode != rfaas_fabric::Opcode::RecvWithImm || !c.status.is_ok() {
        return Err(format!(
            "failed before its lane hello ({:?}: {})",
            c.opcode, c.status
        ));
    }
    if c.imm != LANE_HELLO_IMM || c.byte_len as usize != LaneHello::LEN {
        return Err(format!(
            "began with a write of {} bytes and immediate {:#x}, not a lane hello",
            c.byte_len, c.imm
        ));
    }
    // SAFETY: the input region holds at least InvocationHeader::LEN
    // (= LaneHello::LEN) bytes, and the peer's write of them completed
    // before the completion we hold.
    let bytes = unsafe { std::slice::from_raw_parts(l.input.as_ptr(), LaneHello::LEN) };
    let hello = LaneHello::decode(bytes).map_err(|e| format!("sent a bad hello: {e}"))?;
    if hello.lane as usize != index {
        return Err(format!(
            "said hello to lane {} while lane {index} was being connected",
            hello.lane
        ));
    }
    if !hello.key.matches(key) {
        return Err("presented a lane key that is not this allocation's".into());
    }
    Ok(c.wr_id)
}

/// Answers an accepted hello with a zero-length write-with-immediate
/// ([`LANE_HELLO_IMM`]). The client waits for it before its first request:
/// a request written earlier could overwrite the hello in the input buffer
/// before the worker read it. The write's own completion is left to the
/// lane (which ignores successful ones): the client's first request may
/// arrive before it, and must not be taken here.
fn acknowledge_hello(
    endpoint: &rfaas_fabric::Endpoint,
    any_region: &rfaas_fabric::MemoryRegion,
    tag: u64,
) -> Result<(), String> {
    let nowhere = rfaas_fabric::RemoteAddr { addr: 0, rkey: 0 };
    endpoint
        .write_with_imm(
            tag | HELLO_ACK_WR,
            any_region,
            0,
            0,
            nowhere,
            LANE_HELLO_IMM,
        )
        .map_err(|e| format!("could not be answered: {e}"))
}

/// wr_id (below the connection tag) of the hello's answer.
const HELLO_ACK_WR: u64 = 0xffff;

fn internal(message: String) -> WorkerError {
    WorkerError::Serving(message)
}

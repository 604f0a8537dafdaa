//! Rows measured through `rfaas-client` against a real `rfaas-executord`
//! on 127.0.0.1, which each row starts for itself (with one provider, a
//! worker pool and no sandbox) and stops by pid when it ends, fails or the
//! bench is interrupted (see `cleanup.rs`). The functions are the C
//! examples (`noop`, `echo`, `empty`).
//!
//! | row | what one sample is |
//! |---|---|
//! | `hot_noop` | `submit` + `spin` of `noop` with an input of `--sizes` bytes (inline), on a worker in `Mode::Hot`: both ends busy-poll |
//! | `hot_noop_billed` | `hot_noop` with billing on: the daemon is registered with a real `rfaas-manager`, the lease comes from it with a slot of a real `rfaas-accounting` (on the row's provider, one SQLite file for both), and the daemon posts the lease's usage there every second while the row runs |
//! | `hot_noop_rate` | `noop` calls per second at 64 B from one client thread with each `RATE_IN_FLIGHT` count in flight on one lane with that many slots (one `Pipeline`) of an allocation of one hot core, each resubmitted as soon as its result is in; next to `pingpong_rate` |
//! | `hot_noop_rate_staged` | `hot_noop_rate`, but the client collects every call that has ended, then stages their refills (`Pipeline::stage`), which the next collection sends in one batch |
//! | `warm_noop_rate` | `hot_noop_rate` on a worker in `Mode::Warm` (the client polls) |
//! | `warm_noop` | the same on a worker in `Mode::Warm`, the client blocking in `get`: both ends sleep in the kernel |
//! | `warm_noop_spin` | a worker in `Mode::Warm` and a client that busy-polls (`spin`): only the worker sleeps |
//! | `transfer` | `submit` + `spin` of `empty` (rFaaS's bandwidth function: returns `size` bytes of its output buffer untouched) with `--bw-sizes` bytes each way, on a hot worker whose input buffer holds the payload; reported as bandwidth (below); then again with 4 calls in flight, one per lane, on one worker thread |
//! | `echo` | the same with `echo`, which copies its input to its output |
//! | `echo_pulled` | `echo` on a lane with a 64 KiB input buffer: from 1 MiB the worker pulls the payload with one-sided reads |
//! | `echo_read_only` | `echo_pulled` with `read_only_input(true)`: on shm, bulk payloads are read in place instead of pulled |
//! | `cold_start` | a fresh `Client`: `allocate` (one core, the library shipped) up to the first `noop` result; then `deallocate`, untimed |
//! | `cold_start_<phase>` | the phases of the same cold starts, from `Allocation::cold_start()`; `first_result` is the rest: buffers and the first call |
//!
//! The bandwidth rows count the bytes that crossed the fabric per second
//! of round trip: `2 × size × calls / elapsed`, the payload in and the
//! result out. The fabric's `bandwidth` row counts the same way (bytes
//! placed in the peer's memory per second), so the two compare directly;
//! `derived.rs` prints their ratio. `transfer` is the invocation path
//! alone; `echo` adds the function's own copy of the payload, which one
//! round trip cannot overlap with either crossing (`echo_copy_estimate`).
//!
//! The daemon and its workers are placed on the peers' CPU, so a hot worker
//! does not share a CPU with the client: the bench moves itself there while
//! the daemon starts (every process inherits the mask) and back after.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use rfaas_client::lease::{Lease, LeaseRequest, Managers};
use rfaas_client::{
    Allocation, AllocationSpec, Buffer, Client, ClientOptions, FunctionId, Mode, Pipeline,
};
use rfaas_proto::InvocationHeader;
use rfaas_testkit::executord::{Executord, ExecutordOptions};

use crate::child;
use crate::cleanup;
use crate::error::{Context, Error, Result};
use crate::fabric_rows::{RATE_IN_FLIGHT, RATE_SIZE};
use crate::report::{Report, Row};
use crate::rows::{Ctx, Provider, RowSpec, Runner, Suite};
use crate::services::{billed_lease, sibling, write_credential, Services};
use crate::stats::{time_round_trips, Summary};

const HOT_NOOP: &str = "hot_noop";
const HOT_NOOP_BILLED: &str = "hot_noop_billed";
const WARM_NOOP: &str = "warm_noop";
const WARM_NOOP_SPIN: &str = "warm_noop_spin";
const HOT_NOOP_RATE: &str = "hot_noop_rate";
const HOT_NOOP_RATE_STAGED: &str = "hot_noop_rate_staged";
const WARM_NOOP_RATE: &str = "warm_noop_rate";
const ECHO: &str = "echo";
const ECHO_PULLED: &str = "echo_pulled";
const ECHO_READ_ONLY: &str = "echo_read_only";
const TRANSFER: &str = "transfer";
const COLD_START: &str = "cold_start";

/// Input capacity of the pulled rows' lane: 1 KiB and 64 KiB travel
/// inline, 1 MiB and more are pulled.
pub const PULLED_INPUT_CAPACITY: u32 = (64 << 10) + InvocationHeader::LEN as u32;

/// Lease users may not be root; the worker drops to this one.
const LEASE_USER: &str = "nobody";
const LEASE_MEMORY_MIB: u32 = 1024;
const ALLOCATION_MEMORY_MIB: u32 = 256;
/// The rate rows' allocations: up to 64 slots, each with its buffers.
const RATE_MEMORY_MIB: u32 = 2048;

/// The rate rows' worker threads: one core, the peers' side of this
/// machine's two, serving the one lane and its slots (the client holds
/// the other).
const RATE_CORES: u16 = 1;

pub const SUITE: Suite = Suite {
    rows: &[
        RowSpec {
            name: HOT_NOOP,
            help: "an invocation of the `noop` function with an input of --sizes bytes on a hot worker, the client spinning",
            runner: Runner::PerProvider {
                kind: None,
                run: |ctx, p, out| noop(ctx, p, HOT_NOOP, Mode::Hot, true, out),
            },
        },
        RowSpec {
            name: HOT_NOOP_BILLED,
            help: "hot_noop with billing on: a lease from a real rfaas-manager with a slot of a real rfaas-accounting, the daemon posting its usage (next to hot_noop)",
            runner: Runner::PerProvider {
                kind: None,
                run: noop_billed,
            },
        },
        RowSpec {
            name: HOT_NOOP_RATE,
            help: "noop calls per second from one client thread at 64 B, 1, 4, 16 and 64 in flight on one lane with as many slots, one hot worker thread (next to pingpong_rate)",
            runner: Runner::PerProvider {
                kind: None,
                run: |ctx, p, out| noop_rate(ctx, p, HOT_NOOP_RATE, Mode::Hot, out),
            },
        },
        RowSpec {
            name: HOT_NOOP_RATE_STAGED,
            help: "hot_noop_rate with the refills staged: the client collects every call that has ended, then sends their refills in one batch (Pipeline::stage, flush)",
            runner: Runner::PerProvider {
                kind: None,
                run: |ctx, p, out| noop_rate(ctx, p, HOT_NOOP_RATE_STAGED, Mode::Hot, out),
            },
        },
        RowSpec {
            name: WARM_NOOP_RATE,
            help: "hot_noop_rate on a warm worker thread (the client polls)",
            runner: Runner::PerProvider {
                kind: None,
                run: |ctx, p, out| noop_rate(ctx, p, WARM_NOOP_RATE, Mode::Warm, out),
            },
        },
        RowSpec {
            name: WARM_NOOP,
            help: "the same on a warm worker, the client asleep until the answer: both ends sleep in the kernel",
            runner: Runner::PerProvider {
                kind: None,
                run: |ctx, p, out| noop(ctx, p, WARM_NOOP, Mode::Warm, false, out),
            },
        },
        RowSpec {
            name: WARM_NOOP_SPIN,
            help: "noop on a warm worker with a client that busy-polls: only the worker sleeps",
            runner: Runner::PerProvider {
                kind: None,
                run: |ctx, p, out| noop(ctx, p, WARM_NOOP_SPIN, Mode::Warm, true, out),
            },
        },
        RowSpec {
            name: ECHO,
            help: "an invocation of `echo`, which copies its input to its output (bandwidth at --bw-sizes, both directions)",
            runner: Runner::PerProvider {
                kind: None,
                run: |ctx, p, out| payload(ctx, p, ECHO_ROW, out),
            },
        },
        RowSpec {
            name: ECHO_PULLED,
            help: "echo with a 64 KiB input buffer: bigger payloads are pulled by the worker with one-sided reads",
            runner: Runner::PerProvider {
                kind: None,
                run: |ctx, p, out| payload(ctx, p, ECHO_PULLED_ROW, out),
            },
        },
        RowSpec {
            name: ECHO_READ_ONLY,
            help: "echo_pulled with read-only input: on shm the function reads the job's buffer in place",
            runner: Runner::PerProvider {
                kind: None,
                run: |ctx, p, out| payload(ctx, p, ECHO_READ_ONLY_ROW, out),
            },
        },
        RowSpec {
            name: TRANSFER,
            help: "an invocation of `empty`, which returns as many bytes as it got without touching them: the invocation path alone",
            runner: Runner::PerProvider {
                kind: None,
                run: |ctx, p, out| payload(ctx, p, TRANSFER_ROW, out),
            },
        },
        RowSpec {
            name: COLD_START,
            help: "a fresh client allocates one core, ships the library and waits for the first result, --cold-iters times",
            runner: Runner::PerProvider {
                kind: None,
                run: cold_start,
            },
        },
    ],
    peers: &[],
};

/// What the invocation rows need from the command line.
#[derive(Debug, Clone, Default)]
pub struct Settings {
    /// The `rfaas-executord` binary; `None`: next to the bench's own.
    pub executord: Option<PathBuf>,
    /// Cold starts measured per provider (after one untimed).
    pub cold_iters: usize,
    /// The daemon's pool of pre-spawned workers.
    pub pool_size: u32,
}

/// `rfaas-client` errors as bench errors, with what was being done.
trait ClientContext<T> {
    fn ctx(self, what: impl FnOnce() -> String) -> Result<T>;
}

impl<T> ClientContext<T> for rfaas_client::Result<T> {
    fn ctx(self, what: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|e| Error::new(format!("{}: {e}", what())))
    }
}

/// A daemon started for one row, and its place in the signal handler.
struct Daemon {
    executord: Executord,
    pool_size: u32,
    _registered: cleanup::Registered,
}

impl Daemon {
    /// Starts `rfaas-executord` with `provider` only, on the peers' CPU.
    fn start(ctx: &Ctx, provider: &Provider) -> Result<Daemon> {
        Daemon::start_with(ctx, provider, 4)
    }

    /// As [`start`](Self::start), with `lanes` logical CPU slots (not
    /// pinned: the workers share the peers' CPU).
    fn start_with(ctx: &Ctx, provider: &Provider, lanes: u32) -> Result<Daemon> {
        Daemon::start_configured(ctx, provider, lanes, Vec::new(), String::new())
    }

    /// As [`start_with`](Self::start_with), also accepting the lease keys
    /// `accept_keys` and with `extra_config` appended to its configuration.
    fn start_configured(
        ctx: &Ctx,
        provider: &Provider,
        lanes: u32,
        accept_keys: Vec<String>,
        extra_config: String,
    ) -> Result<Daemon> {
        let bin = match &ctx.invoke.executord {
            Some(bin) => bin.clone(),
            None => sibling("rfaas-executord")?,
        };
        if !bin.exists() {
            return Err(Error::new(format!(
                "{} does not exist: build it next to the bench (cargo build --release \
                 -p rfaas-executor -p rfaas-bench) or pass --executord",
                bin.display()
            )));
        }
        let opts = ExecutordOptions {
            node_name: "rfaas-bench".into(),
            providers: vec![provider.spec.clone()],
            pool_size: ctx.invoke.pool_size,
            memory_mib: 4096,
            cpus: format!("0-{}", lanes.max(1) - 1),
            fabric_host: provider.host()?,
            accept_keys,
            extra_config,
            ..ExecutordOptions::default()
        };
        if let Some(cpu) = ctx.peer_cpu {
            child::pin_current_thread(cpu)
                .context(|| format!("could not move to CPU {cpu} to start the daemon"))?;
        }
        let started = Executord::try_start(&bin, opts);
        if let Some(cpu) = ctx.cpu {
            child::pin_current_thread(cpu)
                .context(|| format!("could not move the bench back to CPU {cpu}"))?;
        }
        let executord =
            started.map_err(|e| Error::new(format!("could not start {}: {e}", bin.display())))?;
        let registered = cleanup::register(executord.pid());
        Ok(Daemon {
            executord,
            pool_size: ctx.invoke.pool_size,
            _registered: registered,
        })
    }

    fn token(&self) -> String {
        self.token_for(4)
    }

    fn token_for(&self, cores: u16) -> String {
        self.executord.token(
            LEASE_USER,
            cores,
            LEASE_MEMORY_MIB.max(RATE_MEMORY_MIB),
            Duration::from_secs(3600),
        )
    }

    fn addr(&self) -> String {
        self.executord.control_addr().to_string()
    }

    /// Waits until the daemon is at rest but for the allocations' hot
    /// workers: its pool is full again and no other process of it has used
    /// the CPU for [`SETTLED`]. An allocation starts the pool's refill (a
    /// fork, an exec, a runtime's start) on the CPU its worker shares;
    /// measuring while that runs would time the refill too.
    fn settle(&self) -> Result<()> {
        let full = self.pool_size;
        catch_unwind(AssertUnwindSafe(|| {
            self.executord.wait_status(Duration::from_secs(30), |s| {
                matches!(s, rfaas_proto::control::local::LocalReply::Status {
                    pool_idle, ..
                } if *pool_idle >= full)
            })
        }))
        .map_err(|_| {
            Error::new(format!(
                "the daemon's pool did not refill within 30 s; its log:\n{}",
                self.executord.log()
            ))
        })?;
        let busy: Vec<u32> = match self.executord.status() {
            rfaas_proto::control::local::LocalReply::Status { allocations, .. } => {
                allocations.iter().map(|a| a.pid).collect()
            }
            _ => Vec::new(),
        };
        let until = Instant::now() + Duration::from_secs(10);
        let mut last = cpu_ns_of_tree(self.executord.pid(), &busy);
        loop {
            std::thread::sleep(SETTLED);
            let now = cpu_ns_of_tree(self.executord.pid(), &busy);
            // A few µs of bookkeeping is rest; a starting process is not.
            if now.saturating_sub(last) < SETTLED.as_nanos() as u64 / 100 {
                return Ok(());
            }
            if Instant::now() >= until {
                eprintln!("note: the daemon did not come to rest within 10 s; measuring anyway");
                return Ok(());
            }
            last = now;
        }
    }

    /// Waits until the pool holds a worker and no allocation is left, so
    /// each cold start begins from the same state.
    fn wait_idle(&self) -> Result<()> {
        catch_unwind(AssertUnwindSafe(|| {
            self.executord.wait_status(Duration::from_secs(30), |s| {
                matches!(s, rfaas_proto::control::local::LocalReply::Status {
                    pool_idle, allocations, ..
                } if *pool_idle >= 1 && allocations.is_empty())
            })
        }))
        .map(drop)
        .map_err(|_| {
            Error::new(format!(
                "the daemon's pool did not refill within 30 s; its log:\n{}",
                self.executord.log()
            ))
        })
    }
}

/// What `hot_noop_billed` runs on: the billing services (`services.rs`),
/// a daemon registered with the manager that posts its leases' usage to
/// the service, and a lease from the manager with a slot. Dropped in
/// field order: the lease is released, the daemon stops (it posts the
/// last figures), then the services, each stopped by pid.
struct Billing {
    _lease: Lease,
    daemon: Daemon,
    /// The lease's token, with its slot in it.
    token: String,
    services: Services,
    dir: PathBuf,
}

/// How often the daemon posts a lease's usage, ms: the executor's default.
const BILLING_GRANULARITY_MS: u64 = 1000;

impl Billing {
    fn start(ctx: &Ctx, provider: &Provider) -> Result<Billing> {
        let dir = std::env::temp_dir().join(format!("rfaas-bench-billing-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).context(|| format!("could not create {}", dir.display()))?;
        // The intervals a site would run with: nothing here is sped up.
        let services = Services::start(
            ctx,
            provider,
            HOT_NOOP_BILLED,
            "heartbeat_interval_ms = 1000\nlost_after_ms = 30000\nrefresh_ms = 1000\n",
        )?;
        let manager = &services.manager;
        let credential = dir.join("node.credential");
        write_credential(&credential, &manager.credential("node", NODE_NAME, None))?;
        let daemon = Daemon::start_configured(
            ctx,
            provider,
            4,
            vec![manager.public_key_line()],
            format!(
                "[manager]\nurls = [{:?}]\ncredential_file = {:?}\n\
                 [billing]\ngranularity_ms = {BILLING_GRANULARITY_MS}\n",
                manager.url(),
                credential.display().to_string(),
            ),
        )?;
        let user = manager.credential("user", LEASE_USER, Some("bench"));
        let managers = Managers::new([manager.url()], &user)
            .ctx(|| format!("{HOT_NOOP_BILLED}: the manager's URL"))?;
        let want = LeaseRequest {
            cores: 4,
            memory_mib: u64::from(LEASE_MEMORY_MIB.max(RATE_MEMORY_MIB)),
            duration_s: 3600,
            min_cores: None,
            nodes: vec![NODE_NAME.into()],
        };
        let (lease, node) = billed_lease(&managers, &want, HOT_NOOP_BILLED)?;
        Ok(Billing {
            _lease: lease,
            daemon,
            token: node.token,
            services,
            dir,
        })
    }

    /// Waits until the service has written the lease's usage to the
    /// database: proof that the row ran with billing on.
    fn wait_flushed(&self) -> Result<()> {
        self.services.wait_flushed(
            HOT_NOOP_BILLED,
            Duration::from_millis(5 * BILLING_GRANULARITY_MS + 5_000),
            || format!("the daemon's log:\n{}\n", self.daemon.executord.log()),
        )
    }
}

impl Drop for Billing {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The node's name at the manager.
const NODE_NAME: &str = "rfaas-bench";

/// How long the daemon's other processes must stay off the CPU before a row
/// starts timing (see [`Daemon::settle`]).
const SETTLED: Duration = Duration::from_millis(50);

/// CPU time in ns used so far by the threads of `pid` and of its
/// descendants, except the processes in `skip` (and theirs).
fn cpu_ns_of_tree(pid: u32, skip: &[u32]) -> u64 {
    if skip.contains(&pid) {
        return 0;
    }
    let mut total = 0;
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return 0;
    };
    for task in tasks.flatten() {
        let path = task.path();
        // schedstat: ns on the CPU, ns waiting, timeslices.
        if let Ok(s) = std::fs::read_to_string(path.join("schedstat")) {
            total += s
                .split_whitespace()
                .next()
                .and_then(|n| n.parse::<u64>().ok())
                .unwrap_or(0);
        }
        if let Ok(children) = std::fs::read_to_string(path.join("children")) {
            for child in children.split_whitespace().filter_map(|c| c.parse().ok()) {
                total += cpu_ns_of_tree(child, skip);
            }
        }
    }
    total
}

/// The C example functions, as a client ships them.
fn library() -> Result<Vec<u8>> {
    catch_unwind(rfaas_testkit::functions::c_library_bytes).map_err(|_| library_error())
}

/// Builds the C example functions the invocation rows ship, when a source
/// is newer than the library, and returns the library's path: for a
/// machine that runs the rows without a C compiler, such as the VM of
/// scripts/bench-verbs.sh, which finds it in the shared target directory.
pub fn build_functions() -> Result<std::path::PathBuf> {
    catch_unwind(rfaas_testkit::functions::c_library).map_err(|_| library_error())
}

fn library_error() -> Error {
    Error::new(
        "could not build examples/functions/c into libfunctions.so (needs cc); \
         the compiler's output is printed above",
    )
}

/// `noop` calls on a worker in `mode`, the client spinning or sleeping.
fn noop(
    ctx: &Ctx,
    provider: &Provider,
    name: &str,
    mode: Mode,
    spin: bool,
    out: &mut Report,
) -> Result<()> {
    let daemon = Daemon::start(ctx, provider)?;
    noop_on(
        ctx,
        provider,
        name,
        (mode, spin),
        &daemon,
        &daemon.token(),
        out,
    )
}

/// `hot_noop` on a lease the manager granted with a billing slot.
fn noop_billed(ctx: &Ctx, provider: &Provider, out: &mut Report) -> Result<()> {
    let billing = Billing::start(ctx, provider)?;
    noop_on(
        ctx,
        provider,
        HOT_NOOP_BILLED,
        (Mode::Hot, true),
        &billing.daemon,
        &billing.token,
        out,
    )?;
    billing.wait_flushed()
}

/// `noop` calls on `daemon` with `token`, on a worker in `mode`, the
/// client spinning or sleeping.
fn noop_on(
    ctx: &Ctx,
    provider: &Provider,
    name: &str,
    (mode, spin): (Mode, bool),
    daemon: &Daemon,
    token: &str,
    out: &mut Report,
) -> Result<()> {
    let client = Client::new(ClientOptions::with_provider(&provider.spec));
    let max = ctx.sizes.iter().copied().max().unwrap_or(1);
    let spec = AllocationSpec::new(library()?, &["noop"])
        .mode(mode)
        .memory_mib(ALLOCATION_MEMORY_MIB)
        .input_capacity(u32::try_from(max + 32).unwrap_or(u32::MAX).max(4096));
    let alloc = client
        .allocate(&daemon.addr(), token, &spec)
        .ctx(|| format!("{name}: allocating on {}", daemon.addr()))?;
    let f = alloc.function("noop").ctx(|| "finding noop".into())?;
    daemon.settle()?;
    let mut input = alloc.buffer::<u8>(max).ctx(|| "registering".into())?;
    input.fill(0xa5);
    let mut output = alloc.buffer::<u8>(64).ctx(|| "registering".into())?;
    for &size in &ctx.sizes {
        let summary = time_round_trips(ctx.warmup, ctx.iters, || {
            let inv = alloc
                .submit(f, &input, size, &mut output)
                .ctx(|| format!("{name}: submitting {size} bytes"))?;
            let len = if spin { inv.spin() } else { inv.get() }
                .ctx(|| format!("{name}: the {size}-byte call failed"))?;
            match len {
                0 => Ok(()),
                n => Err(Error::new(format!("{name}: noop returned {n} bytes"))),
            }
        })?;
        out.push(&Row::latency(name, &provider.spec, size, summary))?;
    }
    alloc.deallocate().ctx(|| format!("{name}: deallocating"))?;
    Ok(())
}

fn noop_rate(
    ctx: &Ctx,
    provider: &Provider,
    name: &str,
    mode: Mode,
    out: &mut Report,
) -> Result<()> {
    let most = RATE_IN_FLIGHT.into_iter().max().unwrap_or(1);
    let daemon = Daemon::start_with(ctx, provider, most)?;
    let client = Client::new(ClientOptions::with_provider(&provider.spec));
    for in_flight in RATE_IN_FLIGHT {
        let slots = u16::try_from(in_flight).unwrap_or(u16::MAX);
        let spec = AllocationSpec::new(library()?, &["noop"])
            .cores(RATE_CORES)
            .lanes(1)
            .slots(slots)
            .mode(mode)
            .memory_mib(RATE_MEMORY_MIB);
        let alloc = client
            .allocate(&daemon.addr(), &daemon.token_for(1), &spec)
            .ctx(|| format!("{name}: allocating {slots} slots on {}", daemon.addr()))?;
        let f = alloc.function("noop").ctx(|| "finding noop".into())?;
        let mut buffers = (0..in_flight)
            .map(|_| Ok((alloc.buffer::<u8>(RATE_SIZE)?, alloc.buffer::<u8>(64)?)))
            .collect::<rfaas_client::Result<Vec<_>>>()
            .ctx(|| "registering".into())?;
        let mut pipe = alloc
            .pipeline::<u8, u8>()
            .ctx(|| format!("{name}: taking the lane"))?;
        daemon.settle()?;
        let stage = name == HOT_NOOP_RATE_STAGED;
        buffers = pipelined(
            name,
            &mut pipe,
            f,
            buffers,
            RATE_SIZE,
            stage,
            ctx.warmup as u64,
        )?;
        let calls = ctx.rate_calls();
        let start = Instant::now();
        pipelined(name, &mut pipe, f, buffers, RATE_SIZE, stage, calls)?;
        let elapsed = start.elapsed();
        out.push(&Row::rate(
            name,
            &provider.spec,
            RATE_SIZE,
            in_flight,
            calls,
            elapsed,
        ))?;
        drop(pipe);
        alloc.deallocate().ctx(|| format!("{name}: deallocating"))?;
    }
    drop(daemon);
    Ok(())
}

/// `calls` calls of `f` (which returns nothing) with `size` input bytes
/// through one pipeline, as many in flight as there are (input, output)
/// pairs, collected by polling. Without `stage` a pair's next call is
/// submitted as soon as its result is in; with it, the client collects
/// every call that has ended, then stages their refills, which the next
/// collection sends as one batch. Returns the pairs. Hot loop of the rate
/// rows.
fn pipelined(
    name: &str,
    pipe: &mut Pipeline<'_, u8, u8>,
    f: FunctionId,
    mut free: Vec<(Buffer<u8>, Buffer<u8>)>,
    size: usize,
    stage: bool,
    calls: u64,
) -> Result<Vec<(Buffer<u8>, Buffer<u8>)>> {
    let (mut posted, mut done) = (0u64, 0u64);
    // Calls collected per pass before the refills go.
    let per_pass = if stage { usize::MAX } else { 1 };
    while done < calls {
        while posted < calls {
            let Some((input, output)) = free.pop() else {
                break;
            };
            let sent = if stage {
                pipe.stage(f, input, size, output)
            } else {
                pipe.submit(f, input, size, output)
            };
            sent.map_err(rfaas_client::Error::from)
                .ctx(|| format!("{name}: submitting {size} bytes"))?;
            posted += 1;
        }
        let mut collected = 0;
        while collected < per_pass {
            let Some(call) = pipe.test_any() else { break };
            collected += 1;
            match call
                .result
                .ctx(|| format!("{name}: a {size}-byte call failed"))?
            {
                0 => done += 1,
                n => {
                    return Err(Error::new(format!(
                        "{name}: {size} bytes in, {n} bytes out (noop returns none)"
                    )))
                }
            }
            free.push((call.input, call.output));
        }
        if collected == 0 {
            std::hint::spin_loop();
        }
    }
    Ok(free)
}

/// `calls` calls of `f` with `size` input bytes, one in flight per
/// (input, output) pair, each pair's next call submitted as soon as its
/// result is in; each must return `expect` bytes. Hot loop of the rate rows
/// and of `transfer` with calls in flight.
#[allow(clippy::too_many_arguments)]
fn calls_in_flight(
    name: &str,
    alloc: &Allocation,
    f: FunctionId,
    inputs: &[&Buffer<u8>],
    outputs: &mut [Buffer<u8>],
    size: usize,
    expect: usize,
    calls: u64,
) -> Result<()> {
    let submit = |i: usize, output: &mut Buffer<u8>| {
        let output: *mut Buffer<u8> = output;
        // SAFETY: only the borrow's lifetime is widened. An invocation
        // borrows its output buffer until it is dropped (it keeps no
        // pointer to it, only the lifetime), and each slot below drops its
        // invocation before it submits the next one on the same buffer, so
        // no two live invocations ever target one buffer.
        let output: &mut Buffer<u8> = unsafe { &mut *output };
        alloc
            .submit(f, inputs[i], size, output)
            .ctx(|| format!("{name}: submitting {size} bytes"))
    };
    let mut slots = Vec::with_capacity(outputs.len());
    let mut posted = 0u64;
    for (i, output) in outputs.iter_mut().enumerate() {
        if posted < calls {
            slots.push(Some(submit(i, output)?));
            posted += 1;
        }
    }
    let mut done = 0u64;
    while done < calls {
        for (i, (slot, output)) in slots.iter_mut().zip(outputs.iter_mut()).enumerate() {
            let Some(inv) = slot else { continue };
            let Some(result) = inv.try_get() else {
                continue;
            };
            *slot = None;
            match result.ctx(|| format!("{name}: a {size}-byte call failed"))? {
                n if n == expect => done += 1,
                n => {
                    return Err(Error::new(format!(
                        "{name}: {size} bytes in, {n} bytes out (expected {expect})"
                    )))
                }
            }
            if posted < calls {
                *slot = Some(submit(i, output)?);
                posted += 1;
            }
        }
    }
    Ok(())
}

/// A row that moves `--bw-sizes` bytes each way through one function.
#[derive(Debug, Clone, Copy)]
struct Payload {
    name: &'static str,
    function: &'static str,
    /// The lane's input buffer holds the largest payload, so every payload
    /// travels with its request; otherwise it is [`PULLED_INPUT_CAPACITY`].
    inline: bool,
    read_only: bool,
    /// The whole output is the input (`echo`), not only its first word
    /// (`empty`: the rest is the output buffer as it was).
    echoes: bool,
}

const ECHO_ROW: Payload = Payload {
    name: ECHO,
    function: "echo",
    inline: true,
    read_only: false,
    echoes: true,
};
const ECHO_PULLED_ROW: Payload = Payload {
    name: ECHO_PULLED,
    function: "echo",
    inline: false,
    read_only: false,
    echoes: true,
};
const ECHO_READ_ONLY_ROW: Payload = Payload {
    name: ECHO_READ_ONLY,
    function: "echo",
    inline: false,
    read_only: true,
    echoes: true,
};
const TRANSFER_ROW: Payload = Payload {
    name: TRANSFER,
    function: "empty",
    inline: true,
    read_only: false,
    echoes: false,
};

impl Payload {
    /// How much of the result must equal the input.
    fn checked_len(&self, size: usize) -> usize {
        if self.echoes {
            size
        } else {
            size.min(4)
        }
    }
}

fn payload(ctx: &Ctx, provider: &Provider, row: Payload, out: &mut Report) -> Result<()> {
    let name = row.name;
    let daemon = Daemon::start(ctx, provider)?;
    let client = Client::new(ClientOptions::with_provider(&provider.spec));
    let max = ctx.bw_sizes.iter().copied().max().unwrap_or(1);
    let capacity = u32::try_from(max)
        .ok()
        .and_then(|m| m.checked_add(InvocationHeader::LEN as u32))
        .ok_or_else(|| Error::new(format!("--bw-sizes must stay below 4 GiB for {name}")))?
        .max(4096);
    let spec = AllocationSpec::new(library()?, &[row.function])
        .mode(Mode::Hot)
        .memory_mib(ALLOCATION_MEMORY_MIB.max(capacity.div_ceil(1 << 20) * 4 + 64))
        .input_capacity(if row.inline {
            capacity
        } else {
            PULLED_INPUT_CAPACITY
        })
        .output_capacity(capacity)
        .read_only_input(row.read_only);
    let alloc = client
        .allocate(&daemon.addr(), &daemon.token(), &spec)
        .ctx(|| format!("{name}: allocating on {}", daemon.addr()))?;
    let f = alloc
        .function(row.function)
        .ctx(|| format!("finding {}", row.function))?;
    daemon.settle()?;
    let mut input = alloc.buffer::<u8>(max).ctx(|| "registering".into())?;
    // SAFETY: no call has used the buffer yet, so no worker holds its key.
    for (i, b) in unsafe { input.as_mut_slice() }.iter_mut().enumerate() {
        *b = (i % 251) as u8;
    }
    let mut output = alloc.buffer::<u8>(max).ctx(|| "registering".into())?;
    for &size in &ctx.bw_sizes {
        // Untimed: faults the pages in on both sides and grows the
        // worker's pull buffer.
        for _ in 0..4 {
            payload_call(name, &alloc, f, &input, size, &mut output)?;
        }
        let checked = row.checked_len(size);
        // SAFETY: every call on these buffers has returned, and the
        // worker runs the bench's own functions, which write only the
        // output of their call: nothing writes either buffer meanwhile.
        // In place, so that checking adds no copy of the payload.
        let same = unsafe { output.as_slice()[..checked] == input.as_slice()[..checked] };
        if !same {
            return Err(Error::new(format!(
                "{name}: the {size}-byte result differs from the input"
            )));
        }
        let calls = (ctx.bw_messages(size) / 2).max(8);
        let start = Instant::now();
        for _ in 0..calls {
            payload_call(name, &alloc, f, &input, size, &mut output)?;
        }
        let elapsed = start.elapsed();
        out.push(&Row::bandwidth(
            name,
            &provider.spec,
            size,
            2 * size as u64 * calls,
            elapsed,
        ))?;
    }
    alloc.deallocate().ctx(|| format!("{name}: deallocating"))?;
    if row.name == TRANSFER {
        transfer_in_flight(ctx, provider, &daemon, &client, capacity, out)?;
    }
    drop(daemon);
    Ok(())
}

/// Calls `transfer` keeps in flight in its second measurement.
const TRANSFER_IN_FLIGHT: u32 = 4;

/// `transfer` with [`TRANSFER_IN_FLIGHT`] calls in flight, each on its own
/// lane with its own buffers, all lanes on one hot worker thread: what
/// overlapping calls recover of the fabric's streaming bandwidth.
fn transfer_in_flight(
    ctx: &Ctx,
    provider: &Provider,
    daemon: &Daemon,
    client: &Client,
    capacity: u32,
    out: &mut Report,
) -> Result<()> {
    let name = TRANSFER;
    let lanes = TRANSFER_IN_FLIGHT as u16;
    let spec = AllocationSpec::new(library()?, &["empty"])
        .cores(1)
        .lanes(lanes)
        .mode(Mode::Hot)
        .memory_mib(
            ALLOCATION_MEMORY_MIB.max(capacity.div_ceil(1 << 20) * 4 * u32::from(lanes) + 64),
        )
        .input_capacity(capacity)
        .output_capacity(capacity);
    let alloc = client
        .allocate(&daemon.addr(), &daemon.token(), &spec)
        .ctx(|| format!("{name}: allocating {lanes} lanes on {}", daemon.addr()))?;
    let f = alloc.function("empty").ctx(|| "finding empty".into())?;
    let max = capacity as usize - InvocationHeader::LEN;
    let buffers = |n| {
        (0..n)
            .map(|_| alloc.buffer::<u8>(max))
            .collect::<rfaas_client::Result<Vec<_>>>()
            .ctx(|| "registering".into())
    };
    let inputs = buffers(lanes)?;
    let inputs: Vec<&Buffer<u8>> = inputs.iter().collect();
    let mut outputs = buffers(lanes)?;
    daemon.settle()?;
    for &size in &ctx.bw_sizes {
        let run = |outputs: &mut [Buffer<u8>], calls| {
            calls_in_flight(name, &alloc, f, &inputs, outputs, size, size, calls)
        };
        // Untimed: faults the pages in on both sides.
        run(&mut outputs, 4 * u64::from(lanes))?;
        let calls = (ctx.bw_messages(size) / 2).max(8 * u64::from(lanes));
        let start = Instant::now();
        run(&mut outputs, calls)?;
        let mut row = Row::bandwidth(
            name,
            &provider.spec,
            size,
            2 * size as u64 * calls,
            start.elapsed(),
        );
        row.in_flight = TRANSFER_IN_FLIGHT;
        out.push(&row)?;
    }
    alloc.deallocate().ctx(|| format!("{name}: deallocating"))?;
    Ok(())
}

/// One call of `size` bytes that must return `size` bytes. Hot path.
#[inline]
fn payload_call(
    name: &str,
    alloc: &Allocation,
    f: FunctionId,
    input: &Buffer<u8>,
    size: usize,
    output: &mut Buffer<u8>,
) -> Result<()> {
    let len = alloc
        .submit(f, input, size, output)
        .ctx(|| format!("{name}: submitting {size} bytes"))?
        .spin()
        .ctx(|| format!("{name}: the {size}-byte call failed"))?;
    match len {
        n if n == size => Ok(()),
        n => Err(Error::new(format!(
            "{name}: {size} bytes in, {n} bytes out"
        ))),
    }
}

/// The cold-start rows, in print order: the whole, the executor's and the
/// client's phases, and what follows `allocate`.
const COLD_PHASES: [&str; 8] = [
    COLD_START,
    "cold_start_connect",
    "cold_start_validate",
    "cold_start_worker",
    "cold_start_load",
    "cold_start_listen",
    "cold_start_lanes",
    "cold_start_first_result",
];

fn cold_start(ctx: &Ctx, provider: &Provider, out: &mut Report) -> Result<()> {
    let daemon = Daemon::start(ctx, provider)?;
    let library = library()?;
    let spec = AllocationSpec::new(library, &["noop"])
        .cores(1)
        .mode(Mode::HotThenWarm)
        .memory_mib(ALLOCATION_MEMORY_MIB);
    let (addr, token) = (daemon.addr(), daemon.token());
    let iters = ctx.invoke.cold_iters.max(1);
    let mut samples: [Vec<u64>; COLD_PHASES.len()] =
        std::array::from_fn(|_| Vec::with_capacity(iters));
    let mut pooled = 0usize;
    // One untimed first: the page cache, the daemon's first allocation.
    for i in 0..=iters {
        daemon.wait_idle()?;
        let start = Instant::now();
        let client = Client::new(ClientOptions::with_provider(&provider.spec));
        let alloc = client
            .allocate(&addr, &token, &spec)
            .ctx(|| format!("{COLD_START}: allocating on {addr}"))?;
        let allocated = start.elapsed();
        let f = alloc.function("noop").ctx(|| "finding noop".into())?;
        let input = alloc.buffer::<u8>(1).ctx(|| "registering".into())?;
        let mut output = alloc.buffer::<u8>(64).ctx(|| "registering".into())?;
        alloc
            .invoke(f, &input, 1, &mut output)
            .ctx(|| format!("{COLD_START}: the first call failed"))?;
        let total = start.elapsed();
        let cs = alloc.cold_start();
        alloc
            .deallocate()
            .ctx(|| format!("{COLD_START}: deallocating"))?;
        drop(client);
        if i == 0 {
            continue;
        }
        pooled += usize::from(cs.pooled);
        let phases = [
            total,
            cs.connect_control,
            cs.validate,
            cs.worker,
            cs.load,
            cs.listen,
            cs.connect_lanes,
            total.saturating_sub(allocated),
        ];
        for (s, d) in samples.iter_mut().zip(phases) {
            s.push(d.as_nanos() as u64);
        }
    }
    if pooled < iters {
        eprintln!(
            "note: {COLD_START} on {}: {} of {iters} allocations found no pooled worker",
            provider.spec,
            iters - pooled
        );
    }
    for (name, s) in COLD_PHASES.iter().zip(samples.iter_mut()) {
        let summary = Summary::of(s).ok_or_else(|| Error::new("no cold start was measured"))?;
        out.push(&Row::latency(name, &provider.spec, 1, summary))?;
    }
    drop(daemon);
    Ok(())
}

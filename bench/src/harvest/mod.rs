//! `rfaas-harvest`: how much of a Slurm cluster's idle capacity rfaas
//! harvests, and what that costs Slurm's jobs (issue 13's harvest
//! benchmark).
//!
//! One seeded job stream is replayed twice on a fresh loopback Slurm
//! cluster (`scripts/slurm-cluster.sh`): without rfaas (an empty
//! `plugstack.conf`, no executor daemons), then with it as a site
//! installs it (a manager, an `rfaas-executord` per node with `[slurm]`,
//! `rfaas_spank.so` in `plugstack.conf`) and offloading clients calling a
//! function all along. Each run gives one `harvest` row:
//!
//! - `offered_share`: the idle core-seconds the manager showed lent
//!   (cores a node does not withhold, while it is up, each node capped at
//!   Slurm's idle CPUs at that moment) over the idle core-seconds Slurm had
//!   (`sinfo`'s idle CPUs), both sampled all along and integrated from the
//!   first submission to the last job's end. Target ≥ 95 %.
//! - registration latency: from each job's end (its script's last line)
//!   to the first manager sample showing its nodes lending its CPUs again.
//!   Target p99 ≤ 1 s.
//! - start delay: from Slurm's allocation (slurmctld's log, to the
//!   millisecond) to the job script's first line; no job past the grace +
//!   2 s, and on nodes where no rfaas lease ran while the job started, at
//!   most 100 ms more at p99 than the same jobs without the plugin.
//! - `invocations`: the calls the clients had answered meanwhile.
//!
//! # Layout
//!
//! - [`stream`]: the seeded job stream;
//! - [`site`]: the cluster, and rfaas on it;
//! - [`clients`]: the offloading clients;
//! - [`sample`]: Slurm's and the manager's views, sampled;
//! - [`replay`]: one run, from a fresh site to its job records;
//! - [`records`]: each job's times, from its stamps and slurmctld's log;
//! - [`figures`]: the run's figures from those;
//! - [`output`]: the `harvest` rows (JSON lines) and the table.

pub mod clients;
pub mod figures;
pub mod output;
pub mod records;
pub mod replay;
pub mod sample;
pub mod site;
pub mod stream;

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::error::{Error, Result};
use clients::ClientSettings;
use output::{Output, RunRow};
use site::{Binaries, Layout};
use stream::StreamSpec;

/// Everything a harvest benchmark needs.
#[derive(Debug, Clone)]
pub struct Settings {
    pub stream: StreamSpec,
    /// The plugin's grace, seconds.
    pub grace_s: u32,
    pub clients: ClientSettings,
    /// Times both runs are made.
    pub rounds: usize,
    pub json: bool,
    pub binaries: Binaries,
    /// How often Slurm and the manager are sampled.
    pub slurm_interval: Duration,
    pub manager_interval: Duration,
    /// Sampling goes on this long after the last job.
    pub settle: Duration,
}

impl Settings {
    pub fn layout(&self) -> Layout {
        Layout {
            nodes: self.stream.nodes,
            cpus: self.stream.cpus,
            grace_s: self.grace_s,
        }
    }
}

/// Runs the benchmark and prints its rows.
pub fn run(settings: &Settings) -> Result<()> {
    settings.stream.check().map_err(Error::new)?;
    install_interrupt()?;
    for bin in [
        &settings.binaries.executord,
        &settings.binaries.manager,
        &settings.binaries.plugin,
    ] {
        if !bin.exists() {
            return Err(Error::new(format!(
                "{} does not exist: build it next to the bench (cargo build --release -p \
                 rfaas-executor -p rfaas-manager -p rfaas-slurm-spank -p rfaas-bench) or name it \
                 with --executord, --manager-bin or --plugin",
                bin.display()
            )));
        }
    }
    let jobs = settings.stream.generate();
    let s = &settings.stream;
    let span = jobs.last().map_or(0.0, |j| j.arrival.as_secs_f64());
    eprintln!(
        "harvest: seed {seed} (--seed {seed} repeats this stream): {} jobs arriving over {span:.0} s \
         on {} nodes x {} CPUs (load {}), jobs of {}-{} s, grace {} s, {} offloading clients",
        jobs.len(),
        s.nodes,
        s.cpus,
        s.load,
        s.min_seconds,
        s.max_seconds,
        settings.grace_s,
        settings.clients.count,
        seed = s.seed,
    );
    let mut out = Output::new(settings.json);
    for round in 1..=settings.rounds {
        let mut rows = Vec::new();
        for plugin in [false, true] {
            eprintln!(
                "harvest: round {round} of {}: the stream {} the plugin",
                settings.rounds,
                if plugin { "with" } else { "without" }
            );
            let run = replay::replay(settings, &jobs, plugin)?;
            let row = RunRow::of(settings, round, &run, rows.first());
            out.print(&row)?;
            rows.push(row);
        }
    }
    out.finish()
}

/// Now, unix ns (the clock the job stamps and slurmctld's log use).
pub fn unix_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

/// Whether SIGINT, SIGTERM or SIGHUP came: the run then stops at its next
/// step and everything it started is stopped as it returns.
pub fn interrupted() -> bool {
    INTERRUPTED.load(Ordering::Acquire)
}

extern "C" fn on_signal(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::Release);
}

/// The first signal asks the run to stop (the cluster and daemons are
/// then stopped in order); a second one kills the bench at once.
fn install_interrupt() -> Result<()> {
    for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        // SAFETY: sigaction is plain data; all zeroes is an empty mask and
        // no flags.
        let mut action: libc::sigaction = unsafe { std::mem::zeroed() };
        action.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
        action.sa_flags = libc::SA_RESETHAND;
        // SAFETY: `action` is initialised and the handler only stores to an
        // atomic, which is async-signal-safe.
        if unsafe { libc::sigaction(sig, &action, std::ptr::null_mut()) } != 0 {
            return Err(Error::new(format!(
                "could not install the signal handlers: {}",
                std::io::Error::last_os_error()
            )));
        }
    }
    Ok(())
}

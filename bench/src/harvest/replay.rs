//! One run: the stream replayed on a fresh site, sampled all along, and
//! what each job did read back at the end.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use super::clients::{Clients, Tally};
use super::records::{allocations, parse_stamps, take_backs, JobRecord};
use super::sample::{
    ask_manager, ask_slurm, observer, reset_rpcs, root_rpcs, LentNode, Sampler, Samples, SlurmNode,
};
use super::site::{mint, Site};
use super::stream::JobSpec;
use super::{interrupted, unix_ns, Settings};
use crate::error::{Error, Result};

/// What a run gives the figures.
#[derive(Debug)]
pub struct Run {
    pub plugin: bool,
    pub jobs: Vec<JobRecord>,
    pub slurm: Samples<SlurmNode>,
    /// With the plugin only.
    pub manager: Option<Samples<LentNode>>,
    /// Unix ns: the first submission and the last job's end.
    pub window: (u64, u64),
    pub clients: Tally,
    /// Jobs whose script did not write both stamps.
    pub failed_jobs: usize,
    /// Nodes Slurm shows drained, down or failing at the end.
    pub drained_nodes: Vec<String>,
    /// The RPCs slurmctld had from root (its daemons, sbatch, rfaas; not
    /// the bench's sampling, nor sdiag) from the first submission until
    /// the run settled, and that window's length; `None`: sdiag failed.
    pub slurmctld_rpcs: Option<(u64, Duration)>,
}

/// The clients' user: their workers run as this user on the nodes, so it
/// must exist there (a lease names its user, and the executor daemon
/// refuses users it does not know).
const CLIENT_USER: &str = "nobody";

/// How long the stream may go on after its last submission before the
/// run is given up: room for the longest job after a long queue.
const DRAIN_BOUND: Duration = Duration::from_secs(900);

/// Replays `stream` on a new site, with rfaas and the plugin when
/// `plugin`.
pub fn replay(settings: &Settings, stream: &[JobSpec], plugin: bool) -> Result<Run> {
    let site = Site::start(settings.layout(), plugin.then_some(&settings.binaries))?;
    let slurm_sampler = Sampler::start(
        "harvest-sinfo",
        settings.slurm_interval,
        ask_slurm(&site.cluster.conf()),
    )
    .map_err(|e| Error::new(format!("could not start the Slurm sampler: {e}")))?;
    let manager_sampler = match site.admin() {
        Some(api) => Some(
            Sampler::start("harvest-nodes", settings.manager_interval, ask_manager(api))
                .map_err(|e| Error::new(format!("could not start the manager sampler: {e}")))?,
        ),
        None => None,
    };
    let clients = match &site.rfaas {
        Some(rfaas) if settings.clients.count > 0 => {
            let credential = mint(&rfaas.manager, "user", CLIENT_USER, Some("bench"))?;
            Some(
                Clients::start(&settings.clients, rfaas.manager.url(), &credential)
                    .map_err(Error::new)?,
            )
        }
        _ => None,
    };

    // The logs say why the cluster failed; not when it was told to stop.
    let with_logs = |e: Error| match interrupted() {
        true => e,
        false => Error::new(format!("{e}\n{}", site.logs())),
    };
    let counted = reset_rpcs(&site.cluster)
        .map(|()| Instant::now())
        .map_err(|e| eprintln!("harvest: cannot reset slurmctld's RPC counts: {e}"))
        .ok();
    let submitted = submit_all(settings, &site, stream).map_err(with_logs)?;
    wait_drained(&site).map_err(with_logs)?;
    // The last ends' registrations, sampled.
    std::thread::sleep(settings.settle);
    let slurmctld_rpcs = counted.and_then(|since| {
        root_rpcs(&site.cluster)
            .map(|n| (n, since.elapsed()))
            .map_err(|e| eprintln!("harvest: cannot read slurmctld's RPC counts: {e}"))
            .ok()
    });

    let clients = clients.map(Clients::finish).unwrap_or_default();
    let slurm = slurm_sampler.finish();
    let manager = manager_sampler.map(Sampler::finish);

    let allocated = allocations(&site.cluster.slurmctld_log());
    let taken_back =
        take_backs(&std::fs::read_to_string(site.dir().join("spank.log")).unwrap_or_default());
    let jobs: Vec<JobRecord> = stream
        .iter()
        .zip(&submitted)
        .map(|(spec, &(id, submitted_ns))| {
            let (started_ns, ended_ns) =
                parse_stamps(&std::fs::read_to_string(site.stamp(spec.index)).unwrap_or_default());
            let (allocated_ns, nodes) = match allocated.get(&id) {
                Some((at, nodes)) => (Some(*at), nodes.clone()),
                None => (None, Vec::new()),
            };
            JobRecord {
                index: spec.index,
                id,
                size: spec.size,
                submitted_ns,
                allocated_ns,
                nodes,
                started_ns,
                ended_ns,
                taken_back_ns: taken_back.get(&id).copied(),
            }
        })
        .collect();
    let failed_jobs = jobs
        .iter()
        .filter(|j| j.started_ns.is_none() || j.ended_ns.is_none())
        .count();
    let from = jobs.iter().map(|j| j.submitted_ns).min().unwrap_or(0);
    let to = jobs.iter().filter_map(|j| j.ended_ns).max().unwrap_or(from);
    let drained_nodes = drained(&site);
    Ok(Run {
        plugin,
        jobs,
        slurm,
        manager,
        window: (from, to),
        clients,
        failed_jobs,
        drained_nodes,
        slurmctld_rpcs,
    })
}

/// Submits every job at its arrival; returns (job id, unix ns when sbatch
/// returned) per job.
fn submit_all(settings: &Settings, site: &Site, stream: &[JobSpec]) -> Result<Vec<(u32, u64)>> {
    let start = Instant::now();
    let limit = time_limit_minutes(settings);
    let mut out = Vec::with_capacity(stream.len());
    for (n, job) in stream.iter().enumerate() {
        loop {
            if interrupted() {
                return Err(Error::new("interrupted"));
            }
            let now = start.elapsed();
            if now >= job.arrival {
                break;
            }
            std::thread::sleep((job.arrival - now).min(Duration::from_millis(100)));
        }
        let mut cmd = site.cluster.command("sbatch");
        cmd.args(["--parsable", "-J", &format!("harvest-{}", job.index)])
            .arg(format!("--output={}/stamps/out-%j", site.dir().display()))
            .arg(format!("--time={limit}"))
            .args(job.size.sbatch_args())
            .arg(site.script())
            .arg(format!("{:.3}", job.seconds))
            .arg(site.stamp(job.index));
        let output = cmd
            .output()
            .map_err(|e| Error::new(format!("could not run sbatch: {e}")))?;
        let stdout = String::from_utf8_lossy(&output.stdout);
        let id = stdout.trim().split(';').next().and_then(|i| i.parse().ok());
        match (output.status.success(), id) {
            (true, Some(id)) => out.push((id, unix_ns())),
            _ => {
                return Err(Error::new(format!(
                    "sbatch of job {} failed ({}): {}{}",
                    job.index,
                    output.status,
                    String::from_utf8_lossy(&output.stderr).trim(),
                    stdout.trim()
                )))
            }
        }
        if (n + 1) % 50 == 0 {
            eprintln!(
                "harvest:   {} of {} jobs submitted ({:.0} s)",
                n + 1,
                stream.len(),
                start.elapsed().as_secs_f64()
            );
        }
    }
    Ok(out)
}

/// The jobs' time limit: their longest sleep, the grace and a margin,
/// in whole minutes (what backfill plans with).
fn time_limit_minutes(settings: &Settings) -> u64 {
    let seconds = settings.stream.max_seconds + f64::from(settings.grace_s) + 30.0;
    (seconds / 60.0).ceil().max(1.0) as u64
}

/// Waits until Slurm runs and queues no job.
fn wait_drained(site: &Site) -> Result<()> {
    let until = Instant::now() + DRAIN_BOUND;
    loop {
        if interrupted() {
            return Err(Error::new("interrupted"));
        }
        let out = observer(site.cluster.command("squeue"))
            .args(["-h", "-o", "%i %T %R"])
            .output()
            .map_err(|e| Error::new(format!("could not run squeue: {e}")))?;
        if !out.status.success() {
            return Err(Error::new(format!(
                "squeue failed ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
        let queue = String::from_utf8_lossy(&out.stdout);
        if queue.trim().is_empty() {
            return Ok(());
        }
        if Instant::now() > until {
            return Err(Error::new(format!(
                "jobs still queued {} s after the last submission; squeue shows:\n{queue}",
                DRAIN_BOUND.as_secs()
            )));
        }
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// Nodes in a state no healthy node is in.
fn drained(site: &Site) -> Vec<String> {
    let states: BTreeMap<String, String> = site.cluster.node_states().unwrap_or_default();
    states
        .into_iter()
        .filter(|(_, s)| s.contains("drain") || s.contains("down") || s.contains("fail"))
        .map(|(n, s)| format!("{n} ({s})"))
        .collect()
}

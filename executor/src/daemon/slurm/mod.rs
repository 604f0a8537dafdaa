//! Slurm jobs on this node: taking CPUs back when one starts (its prolog's
//! `slurm_retrieve`), giving them back when it ends (`slurm_offer`), and
//! reconciling with Slurm's own view what no prolog or epilog said.
//!
//! For each Slurm job the daemon keeps a [`Hold`]: the CPUs it withholds
//! for it, or the whole node. The withheld set is the union of the holds;
//! no allocation gets a withheld CPU ([`super::capacity`]), and the
//! allocations that hold one when it is withheld are told to stop
//! (SIGUSR1: their workers refuse new invocations), given the grace to
//! finish, then ended. Allocations on other CPUs go on. A hold of the
//! whole node also refuses every allocation (`draining`) and empties the
//! worker pool, as a drain does.
//!
//! Without `[slurm]` every job's hold is the whole node. With it, the
//! daemon asks Slurm for the job's CPU ids on this node ([`scontrol`]) and
//! maps them to its CPUs (`cpu_map`); if Slurm answers without them it
//! withholds as many CPUs as the hook counted, and if Slurm cannot be
//! asked in time (or the hook counted none) the whole node: more is safe,
//! less is not. Reconciliation puts such a guess right once Slurm answers.
//!
//! Reconciliation, at start and then about every `reconcile_interval_ms`
//! (each wait drawn between half and one and a half of it, so the nodes
//! of a cluster started together do not ask together): a job
//! Slurm runs here that the daemon holds nothing for is taken back (its
//! prolog was missed), a job the daemon holds that Slurm no longer runs
//! here is given back (its epilog was missed), and a running job's hold
//! becomes the CPUs Slurm says it has. A job a hook spoke of since the
//! round asked Slurm, or whose take-back is asking Slurm now, is left to
//! that hook. What Slurm shows unclearly never gives CPUs back: a job it
//! shows running on other nodes only keeps its hold, and one whose CPU
//! ids here cannot be read takes the whole node (a prolog: its count).
//! When Slurm cannot be asked, nothing changes.
//!
//! What it costs slurmctld: a round is one `scontrol --local -d -o show job` (two
//! RPCs, `REQUEST_JOB_INFO` and `REQUEST_NODE_INFO`), so the default of
//! 120 s is one RPC per node per minute on average at any cluster size; a
//! take-back is one `scontrol --local -d -o show job ID` (one RPC,
//! `REQUEST_JOB_INFO_SINGLE`; two for a job on several nodes, whose `-d`
//! adds `REQUEST_NODE_INFO`) per job start on the node; and unless
//! `[slurm]` sets `partitions`, the daemon asks once at start which
//! partitions its node is in (`scontrol --local -o show node`, one RPC),
//! to register them ([`node_partitions`]). Nothing asks Slurm as a job step starts
//! ([`super::jobs`]). A missed prolog or epilog (the hook could not reach
//! the daemon) is put right by the next round, up to 180 s later; a
//! daemon that was down puts everything right at start, before it
//! serves.

pub(crate) mod hold;
pub(crate) mod scontrol;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rfaas_proto::text::count;

use super::config::{format_cpulist, SlurmSettings};
use super::process;
use super::shared::Shared;
use super::state::State;
use hold::Hold;
use scontrol::{Phase, Scontrol, ScontrolError};

/// How long a hook's word about a job keeps reconciliation off it, at
/// most: longer than any round takes.
const EVENT_MEMORY: Duration = Duration::from_secs(600);

/// Most jobs whose last hook event is remembered.
const EVENTS_KEPT: usize = 65_536;

fn scontrol(s: &SlurmSettings) -> Scontrol {
    Scontrol {
        program: s.scontrol.clone(),
        conf: s.conf.clone(),
        timeout: Duration::from_millis(s.timeout_ms),
    }
}

/// Notes that a hook spoke of `job` now (reconciliation leaves it to the
/// hook for a round), forgetting old notes.
fn note_event(st: &mut State, job: u64, now: Instant) {
    st.slurm_events
        .retain(|_, at| now.saturating_duration_since(*at) < EVENT_MEMORY);
    if st.slurm_events.len() >= EVENTS_KEPT {
        if let Some(oldest) = st
            .slurm_events
            .iter()
            .min_by_key(|(_, at)| **at)
            .map(|(j, _)| *j)
        {
            st.slurm_events.remove(&oldest);
        }
    }
    st.slurm_events.insert(job, now);
}

/// Whether a hook spoke of `job` at or after `since`.
fn hook_spoke_since(st: &State, job: u64, since: Instant) -> bool {
    st.slurm_events.get(&job).is_some_and(|at| *at >= since)
}

/// What a change of holds did: the allocations to stop, and whether the
/// pool should be refilled (the node was drained and is no longer).
#[derive(Debug, Default)]
struct Changed {
    targets: Vec<u64>,
    /// Those of `targets` already ending for a reason of their own.
    ending: Vec<u64>,
    undrained: bool,
}

/// Sets (or, with `None`, drops) `job`'s hold and withholds the union of
/// the holds. The allocations on CPUs of the new hold (every allocation,
/// for the whole node) are told to stop now; they are returned, for the
/// caller to wait out their grace. The first whole-node hold drains the
/// node, the end of the last one takes allocations again.
fn set_hold(shared: &Shared, st: &mut State, job: u64, hold: Option<Hold>) -> Changed {
    let whole_before = st.slurm_jobs.values().any(|h| h.whole);
    let targets: Vec<u64> = match &hold {
        Some(h) => st
            .allocations
            .values()
            .filter(|a| h.whole || a.cpus.iter().any(|c| h.cpus.contains(c)))
            .map(|a| a.id)
            .collect(),
        None => Vec::new(),
    };
    match hold {
        Some(h) => st.slurm_jobs.insert(job, h),
        None => st.slurm_jobs.remove(&job),
    };
    withhold(shared, st);
    let whole_after = st.slurm_jobs.values().any(|h| h.whole);
    let mut undrained = false;
    if whole_after && !whole_before {
        st.draining = true;
        shared.empty_pool(st);
    } else if whole_before && !whole_after {
        st.draining = false;
        undrained = true;
    }
    for id in &targets {
        if let Some(pid) = st.allocations.get(id).and_then(|a| a.pid) {
            // Under bubblewrap the pid is bwrap's; the worker is below it.
            for p in std::iter::once(pid).chain(process::descendants(pid)) {
                process::signal(p, libc::SIGUSR1);
            }
        }
    }
    shared.beat_now(st);
    Changed {
        ending: st.ending(&targets),
        targets,
        undrained,
    }
}

/// Withholds the CPUs of every hold, and every CPU while a take-back
/// asks Slurm which CPUs are its job's.
fn withhold(shared: &Shared, st: &mut State) {
    let withheld: BTreeSet<u32> = if !st.slurm_asking.is_empty() {
        shared.settings.cpus.iter().copied().collect()
    } else {
        st.slurm_jobs
            .values()
            .flat_map(|h| h.cpus.iter().copied())
            .collect()
    };
    st.capacity.set_withheld(&withheld);
}

/// What a job's end (or a reconciliation) left: "CPUs 2-3 stay with
/// Slurm jobs [4]", or nothing.
fn still_held(st: &State) -> String {
    let withheld = st.capacity.withheld_cpus();
    if withheld.is_empty() {
        return String::new();
    }
    let jobs: Vec<u64> = st.slurm_jobs.keys().copied().collect();
    format!(
        "; CPUs {} stay with Slurm jobs {jobs:?}",
        format_cpulist(&withheld)
    )
}

/// What a take-back answers its hook, and what it left running.
pub(crate) struct Retrieval {
    /// For the hook (and people).
    pub message: String,
    /// When the answer came before Slurm said which CPUs are the job's
    /// (no allocation ran here, so nothing had to stop): the thread that
    /// asks, withholds the job's CPUs and gives back the others. It
    /// returns what it did.
    pub settling: Option<std::thread::JoinHandle<String>>,
}

impl Retrieval {
    /// What the whole take-back did, once it is over.
    #[cfg(test)]
    pub(crate) fn finished(self) -> String {
        match self.settling {
            Some(t) => t.join().unwrap_or_else(|_| {
                format!("{}; the rest of the take-back panicked", self.message)
            }),
            None => self.message,
        }
    }
}

/// The nice value of the daemon's threads that ask Slurm off any job's
/// path: the early-answered take-backs and the reconciliation.
const SLURM_QUERY_NICE: libc::c_int = 10;

/// Lowers the calling thread's CPU priority to [`SLURM_QUERY_NICE`], and
/// so that of the `scontrol` it starts (a child inherits its thread's
/// nice value): a job launching on the node's CPUs gets them first. A
/// failure is logged, not fatal.
fn yield_to_slurm() {
    let tid = crate::gettid();
    // SAFETY: `setpriority` on this thread only.
    let done =
        unsafe { libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, SLURM_QUERY_NICE) };
    if done != 0 {
        tracing::debug!(error = %std::io::Error::last_os_error(), "cannot lower this thread's priority");
    }
}

/// Slurm job `job` starts here (its prolog): withholds its CPUs at once,
/// lets the allocations on them run for what is left of `grace` (counted
/// from now), then ends them.
///
/// With `[slurm]`, every CPU is withheld while Slurm is asked which are
/// the job's. When no allocation holds a CPU at that moment, nothing of
/// rfaas's can be on the job's CPUs, so the hook is answered at once and
/// the asking goes on in [`Retrieval::settling`]: an idle node's job does
/// not wait for `scontrol`.
pub(crate) fn retrieve(shared: &Arc<Shared>, job: u64, cpus: u32, grace: Duration) -> Retrieval {
    let start = Instant::now();
    if shared.settings.slurm.is_none() {
        // Without Slurm's view: the whole node, whatever `cpus` says.
        let changed = {
            let mut st = shared.lock();
            note_event(&mut st, job, start);
            set_hold(
                shared,
                &mut st,
                job,
                Some(Hold::whole(&shared.settings.cpus)),
            )
        };
        let message = wait_out(shared, &changed, grace, start, true);
        return Retrieval {
            message: format!("taken back for Slurm job {job}: {message}"),
            settling: None,
        };
    }
    // No allocation may take a CPU while Slurm is asked which are the
    // job's: for that moment, every CPU is withheld (nobody is told to
    // stop for it).
    let mut asking = Asking::new(shared, job, start);
    if asking.idle {
        let on = Arc::clone(shared);
        let settling = std::thread::Builder::new()
            .name(format!("take-back-{job}"))
            .spawn(move || {
                // The job is starting on this node's CPUs meanwhile:
                // `scontrol` and the rest yield to its launch.
                yield_to_slurm();
                settle(&on, asking, job, cpus, grace, start)
            });
        match settling {
            Ok(t) => {
                let message = format!(
                    "taken back for Slurm job {job}: no allocation ran here; every CPU withheld until Slurm says which are the job's"
                );
                tracing::info!(job, %message, "take-back answered");
                return Retrieval {
                    message,
                    settling: Some(t),
                };
            }
            Err(e) => {
                // The failed spawn dropped (and unlisted) the asking: list
                // it again and do the rest here.
                tracing::warn!(job, error = %e, "cannot start a take-back thread");
                asking = Asking::new(shared, job, start);
            }
        }
    }
    Retrieval {
        message: settle(shared, asking, job, cpus, grace, start),
        settling: None,
    }
}

/// The rest of a take-back with `[slurm]`, from asking Slurm on: sets the
/// job's hold and ends the allocations on it within the grace.
fn settle(
    shared: &Shared,
    asking: Asking,
    job: u64,
    cpus: u32,
    grace: Duration,
    start: Instant,
) -> String {
    let slurm = shared
        .settings
        .slurm
        .as_ref()
        .expect("settle runs with [slurm]");
    let (hold, how) = decide(shared, slurm, job, cpus);
    let (changed, free) = {
        let mut st = shared.lock();
        asking.done(&mut st);
        // A short job's epilog may come while its prolog's answer settles:
        // the job is over, nothing is withheld for it.
        if st.slurm_events.get(&job).is_some_and(|at| *at > start) {
            let message = format!(
                "Slurm job {job} ended before Slurm said which CPUs were its; nothing withheld for it{}",
                still_held(&st)
            );
            tracing::info!(job, %message, "take-back done");
            return message;
        }
        let changed = set_hold(shared, &mut st, job, Some(hold.clone()));
        (changed, st.capacity.free_cpus().len())
    };
    if changed.undrained {
        shared.refill();
    }
    if hold.whole {
        let message = wait_out(shared, &changed, grace, start, true);
        return format!("taken back for Slurm job {job} ({how}): {message}");
    }
    let message = wait_out(shared, &changed, grace, start, false);
    if hold.cpus.is_empty() {
        return format!(
            "taken back for Slurm job {job}: none of its CPUs is rfaas's ({how}); {} free for rfaas",
            count(free as u64, "CPU")
        );
    }
    format!(
        "taken back for Slurm job {job}: CPUs {} withheld ({how}); {message}; {} free for rfaas",
        format_cpulist(&hold.cpus.iter().copied().collect::<Vec<_>>()),
        count(free as u64, "CPU")
    )
}

/// A take-back asking Slurm for its job's CPUs: listed in
/// `slurm_asking` from [`Asking::new`] to [`Asking::done`], or to its drop
/// should the asking panic.
struct Asking {
    shared: Arc<Shared>,
    job: u64,
    listed: bool,
    /// No allocation held a CPU when every CPU was withheld.
    idle: bool,
}

impl Asking {
    fn new(shared: &Arc<Shared>, job: u64, now: Instant) -> Asking {
        let mut st = shared.lock();
        note_event(&mut st, job, now);
        st.slurm_asking.push(job);
        withhold(shared, &mut st);
        Asking {
            shared: Arc::clone(shared),
            job,
            listed: true,
            idle: st.capacity.granted_cpus().is_empty(),
        }
    }

    /// Unlists it, under the caller's lock (which then sets the job's
    /// hold, so no allocation slips in between).
    fn done(mut self, st: &mut State) {
        self.unlist(st);
    }

    fn unlist(&mut self, st: &mut State) {
        if std::mem::replace(&mut self.listed, false) {
            if let Some(i) = st.slurm_asking.iter().position(|j| *j == self.job) {
                st.slurm_asking.swap_remove(i);
            }
            withhold(&self.shared, st);
        }
    }
}

impl Drop for Asking {
    fn drop(&mut self) {
        if self.listed {
            let shared = Arc::clone(&self.shared);
            let mut st = shared.lock();
            self.unlist(&mut st);
        }
    }
}

/// Ends `targets` within what is left of `grace` since `start`, and says
/// so: "drained in ..." for the whole node, else about the allocations on
/// the CPUs.
fn wait_out(
    shared: &Shared,
    changed: &Changed,
    grace: Duration,
    start: Instant,
    whole: bool,
) -> String {
    let targets = &changed.targets;
    tracing::info!(
        allocations = targets.len(),
        grace_ms = grace.saturating_sub(start.elapsed()).as_millis() as u64,
        whole,
        "Slurm takes CPUs back"
    );
    let taken = shared.take_back(targets, &changed.ending, grace, start);
    let message = if whole {
        format!("drained {}", taken.describe(""))
    } else if targets.is_empty() {
        "no allocation ran on them".to_string()
    } else {
        taken.describe(" on them")
    };
    taken.log("take-back done", &message);
    message
}

/// The hold for job `job` from Slurm's view, or from the hook's count
/// when that view lacks it; with the reason, for people.
fn decide(shared: &Shared, slurm: &SlurmSettings, job: u64, cpus: u32) -> (Hold, String) {
    let node = &slurm.node;
    let guess = |why: String| -> (Hold, String) {
        if cpus == 0 || cpus as usize >= shared.settings.cpus.len() {
            tracing::warn!(job, %why, "taking the whole node back");
            return (
                Hold::whole(&shared.settings.cpus),
                format!("the whole node: {why}"),
            );
        }
        // Slurm hands out its lowest free ids first; so does this guess.
        // Reconciliation puts it right once Slurm answers.
        let st = shared.lock();
        let withheld: BTreeSet<u32> = st
            .slurm_jobs
            .iter()
            .filter(|(j, _)| **j != job)
            .flat_map(|(_, h)| h.cpus.iter().copied())
            .collect();
        let picked: BTreeSet<u32> = shared
            .settings
            .cpus
            .iter()
            .copied()
            .filter(|c| !withheld.contains(c))
            .take(cpus as usize)
            .collect();
        tracing::warn!(job, %why, cpus, "withholding CPUs by the hook's count");
        (
            Hold::of(&shared.settings.cpus, picked),
            format!("{} by the hook's count: {why}", count(cpus, "CPU")),
        )
    };
    match scontrol(slurm).show_jobs(Some(job)) {
        Ok(text) => {
            let jobs = scontrol::parse(&text, node);
            match jobs.values().find(|j| j.here) {
                // Every record of the answer is this job's (a name may
                // have split it): all their ids here count.
                Some(_) => {
                    let ids: BTreeSet<u32> = jobs
                        .values()
                        .filter(|j| j.here)
                        .flat_map(|j| j.cpu_ids.iter().copied())
                        .collect();
                    if ids.is_empty() {
                        return guess(format!(
                            "Slurm shows job {job} on node {node:?} without CPU ids it can read"
                        ));
                    }
                    let mine = slurm.cpu_map.to_cpus(&ids, &shared.settings.cpus);
                    let hold = Hold::of(&shared.settings.cpus, mine.into_iter().collect());
                    let how = format!(
                        "Slurm's CPU_IDs {}",
                        format_cpulist(&ids.iter().copied().collect::<Vec<_>>())
                    );
                    if hold.whole {
                        (hold, format!("every CPU here: {how}"))
                    } else {
                        (hold, how)
                    }
                }
                None => guess(format!(
                    "Slurm shows job {job} without CPUs on node {node:?}; is [slurm] node this node's Slurm name?"
                )),
            }
        }
        Err(ScontrolError::UnknownJob(_)) => guess(format!("Slurm does not know job {job}")),
        Err(e) => {
            tracing::warn!(job, error = %e, "cannot ask Slurm which CPUs the job has; taking the whole node back");
            (
                Hold::whole(&shared.settings.cpus),
                format!("the whole node: {e}"),
            )
        }
    }
}

/// Slurm job `job` ended here (its epilog): gives back its CPUs but those
/// another Slurm job holds. Returns what it did, for people.
pub(crate) fn offer(shared: &Shared, job: u64) -> String {
    let (message, refill) = {
        let mut st = shared.lock();
        note_event(&mut st, job, Instant::now());
        let Some(old) = st.slurm_jobs.get(&job).cloned() else {
            let rest = still_held(&st);
            return format!("Slurm job {job} ended; nothing was withheld for it here{rest}");
        };
        let changed = set_hold(shared, &mut st, job, None);
        let whole_left: Vec<u64> = st
            .slurm_jobs
            .iter()
            .filter(|(_, h)| h.whole)
            .map(|(j, _)| *j)
            .collect();
        let message = if !whole_left.is_empty() {
            format!("Slurm job {job} ended; Slurm jobs {whole_left:?} still hold the node")
        } else if old.whole {
            format!(
                "Slurm job {job} ended: taking allocations again{}",
                still_held(&st)
            )
        } else {
            let withheld: BTreeSet<u32> = st.capacity.withheld_cpus().into_iter().collect();
            let given: Vec<u32> = old
                .cpus
                .iter()
                .copied()
                .filter(|c| !withheld.contains(c))
                .collect();
            format!(
                "Slurm job {job} ended: CPUs {} offered again{}",
                if given.is_empty() {
                    "none".to_string()
                } else {
                    format_cpulist(&given)
                },
                still_held(&st)
            )
        };
        (message, changed.undrained)
    };
    if refill {
        shared.refill();
    }
    tracing::info!(job, %message, "Slurm job ended");
    message
}

/// What one round of reconciliation changed.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Round {
    /// Jobs taken back (their prolog was missed).
    pub taken: Vec<u64>,
    /// Jobs given back (their epilog was missed).
    pub given: Vec<u64>,
    /// Jobs whose CPUs were put right.
    pub corrected: Vec<u64>,
}

/// One round: asks Slurm, then makes the holds match. Allocations on CPUs
/// taken back are ended after `grace_ms` on threads of their own.
pub(crate) fn reconcile(shared: &Arc<Shared>) -> Result<Round, ScontrolError> {
    let Some(slurm) = &shared.settings.slurm else {
        return Ok(Round::default());
    };
    let asked = Instant::now();
    let text = scontrol(slurm).show_jobs(None)?;
    let view = scontrol::parse(&text, &slurm.node);
    let node = &slurm.node;
    let mut round = Round::default();
    let mut targets: Vec<u64> = Vec::new();
    let mut refill = false;
    let ending = {
        let mut st = shared.lock();
        let held: Vec<(u64, Hold)> = st.slurm_jobs.iter().map(|(j, h)| (*j, h.clone())).collect();
        for (job, hold) in held {
            if hook_spoke_since(&st, job, asked) {
                continue;
            }
            if st.slurm_asking.contains(&job) {
                continue;
            }
            let seen = view.get(&job);
            match seen.map(|j| (j.phase, j.here)) {
                None | Some((Phase::Gone, _)) => {
                    tracing::warn!(
                        job,
                        node = %node,
                        "Slurm no longer runs this job here, but no epilog said so (missed epilog): offering its CPUs again"
                    );
                    refill |= set_hold(shared, &mut st, job, None).undrained;
                    round.given.push(job);
                }
                Some((Phase::Ending, _)) => {}
                // The job's prolog came from this node, so Slurm should
                // show it here: keep what is withheld rather than guess.
                Some((Phase::Runs, false)) => {
                    tracing::warn!(
                        job,
                        node = %node,
                        "Slurm shows a job this node took CPUs back for on other nodes only; is [slurm] node this node's Slurm name? Keeping its CPUs"
                    );
                }
                Some((Phase::Runs, true)) => {
                    let ids = &seen.map(|j| j.cpu_ids.clone()).unwrap_or_default();
                    if ids.is_empty() {
                        continue;
                    }
                    let mine = slurm.cpu_map.to_cpus(ids, &shared.settings.cpus);
                    let want = Hold::of(&shared.settings.cpus, mine.into_iter().collect());
                    if want != hold {
                        tracing::info!(
                            job,
                            had = %format_cpulist(&hold.cpus.iter().copied().collect::<Vec<_>>()),
                            now = %format_cpulist(&want.cpus.iter().copied().collect::<Vec<_>>()),
                            "the CPUs withheld for a Slurm job are put right from Slurm's view"
                        );
                        let changed = set_hold(shared, &mut st, job, Some(want));
                        refill |= changed.undrained;
                        targets.extend(changed.targets);
                        round.corrected.push(job);
                    }
                }
            }
        }
        for (job, seen) in &view {
            if !seen.here
                || seen.phase != Phase::Runs
                || st.slurm_jobs.contains_key(job)
                || st.slurm_asking.contains(job)
                || hook_spoke_since(&st, *job, asked)
            {
                continue;
            }
            let mine = slurm.cpu_map.to_cpus(&seen.cpu_ids, &shared.settings.cpus);
            // CPU ids it cannot read: the whole node, not none.
            let hold = if seen.cpu_ids.is_empty() {
                Hold::whole(&shared.settings.cpus)
            } else {
                Hold::of(&shared.settings.cpus, mine.iter().copied().collect())
            };
            tracing::warn!(
                job,
                node = %node,
                slurm_cpu_ids = %format_cpulist(&seen.cpu_ids.iter().copied().collect::<Vec<_>>()),
                cpus = %format_cpulist(&mine),
                "Slurm runs this job here, but no prolog said so (missed prolog): taking its CPUs back"
            );
            let changed = set_hold(shared, &mut st, *job, Some(hold));
            refill |= changed.undrained;
            targets.extend(changed.targets);
            round.taken.push(*job);
        }
        targets.sort_unstable();
        targets.dedup();
        st.ending(&targets)
    };
    if refill {
        shared.refill();
    }
    if !targets.is_empty() {
        let s = Arc::clone(shared);
        let grace = Duration::from_millis(slurm.grace_ms);
        let spawned = std::thread::Builder::new()
            .name("slurm-take-back".into())
            .spawn(move || {
                let taken = s.take_back(&targets, &ending, grace, Instant::now());
                taken.log("reconciled take-back done", &taken.describe(""));
            });
        if let Err(e) = spawned {
            tracing::error!(error = %e, "cannot start a thread to end the allocations on CPUs taken back; they were told to stop");
        }
    }
    Ok(round)
}

/// The reconciliation thread: a round every `reconcile_interval_ms` until
/// the daemon stops (the first round runs at start, before it serves).
/// Failures are logged when they start, once a minute while they last,
/// and when Slurm answers again.
pub(crate) fn run(shared: Arc<Shared>) {
    let Some(slurm) = shared.settings.slurm.clone() else {
        return;
    };
    if slurm.reconcile_interval_ms == 0 {
        return;
    }
    let interval = Duration::from_millis(slurm.reconcile_interval_ms);
    yield_to_slurm();
    let mut failing_since: Option<Instant> = None;
    let mut last_line: Option<Instant> = None;
    let mut rng = fastrand::Rng::new();
    loop {
        {
            let st = shared.lock();
            let wait = jittered(interval, &mut rng);
            if shared.wait_until(st, wait, |st| st.stopping).1 {
                return;
            }
        }
        round(&shared, &mut failing_since, &mut last_line);
    }
}

/// The wait before the next round: drawn evenly between half and one and
/// a half of `interval`, so rounds come `interval` apart on average and
/// the nodes of a cluster started at once spread their questions.
fn jittered(interval: Duration, rng: &mut fastrand::Rng) -> Duration {
    let ms = u64::try_from(interval.as_millis()).unwrap_or(u64::MAX);
    Duration::from_millis((ms / 2).saturating_add(rng.u64(0..=ms)))
}

/// The Slurm partitions this node is in, as `scontrol` says (one
/// slurmctld RPC); `None` without `[slurm]` or when Slurm cannot be asked
/// (logged).
pub(crate) fn node_partitions(shared: &Shared) -> Option<Vec<String>> {
    let s = shared.settings.slurm.as_ref()?;
    match scontrol(s).node_partitions(&s.node) {
        Ok(p) => {
            tracing::info!(node = %s.node, partitions = ?p, "Slurm says which partitions this node is in");
            Some(p)
        }
        Err(e) => {
            tracing::warn!(node = %s.node, error = %e, "cannot ask Slurm which partitions this node is in; registering without them and asking again at the next registration (set partitions in [slurm] to skip asking)");
            None
        }
    }
}

/// The first round, at start: once, before the daemon serves.
pub(crate) fn first_round(shared: &Arc<Shared>) {
    match &shared.settings.slurm {
        Some(s) if s.reconcile_interval_ms > 0 => {
            round(shared, &mut None, &mut None);
        }
        _ => {}
    }
}

/// How often a lasting failure to ask Slurm is logged.
const FAILURE_LINE_EVERY: Duration = Duration::from_secs(60);

fn round(
    shared: &Arc<Shared>,
    failing_since: &mut Option<Instant>,
    last_line: &mut Option<Instant>,
) {
    match reconcile(shared) {
        Ok(round) => {
            if let Some(since) = failing_since.take() {
                tracing::info!(
                    after_s = since.elapsed().as_secs(),
                    "Slurm answers again; reconciling"
                );
            }
            *last_line = None;
            if round != Round::default() {
                tracing::info!(taken = ?round.taken, given = ?round.given, corrected = ?round.corrected, "reconciled with Slurm");
            }
        }
        Err(e) => {
            let now = Instant::now();
            failing_since.get_or_insert(now);
            if last_line.map_or(true, |t| now.duration_since(t) >= FAILURE_LINE_EVERY) {
                tracing::warn!(error = %e, "cannot ask Slurm which jobs run here; nothing withheld or offered changes until it answers");
                *last_line = Some(now);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::daemon::config::Config;
    use crate::daemon::epoll::Waker;
    use crate::daemon::memlimit::MemoryLimiter;
    use crate::daemon::outbox::Outbox;
    use crate::daemon::state::Allocation;
    use std::path::{Path, PathBuf};

    #[test]
    fn rounds_come_an_interval_apart_on_average_and_spread() {
        let mut rng = fastrand::Rng::with_seed(7);
        let interval = Duration::from_secs(120);
        let waits: Vec<Duration> = (0..10_000).map(|_| jittered(interval, &mut rng)).collect();
        assert!(waits
            .iter()
            .all(|w| *w >= interval / 2 && *w <= interval * 3 / 2));
        let mean = waits.iter().sum::<Duration>() / waits.len() as u32;
        assert!(
            mean >= interval * 98 / 100 && mean <= interval * 102 / 100,
            "{mean:?}"
        );
        // Spread: not all in one tenth of the range.
        let early = waits.iter().filter(|w| **w < interval * 6 / 10).count();
        assert!(early > 500 && early < 1500, "{early}");
        assert_eq!(jittered(Duration::ZERO, &mut rng), Duration::ZERO);
    }

    #[test]
    fn slurm_queries_off_the_jobs_path_run_at_a_lower_priority() {
        let (own, child) = std::thread::spawn(|| {
            yield_to_slurm();
            // SAFETY: reads this thread's own nice value.
            let own =
                unsafe { libc::getpriority(libc::PRIO_PROCESS, crate::gettid() as libc::id_t) };
            // A child started from here, as `scontrol` is: field 19 of
            // its /proc/self/stat.
            let out = std::process::Command::new("cut")
                .args(["-d", " ", "-f19", "/proc/self/stat"])
                .output()
                .expect("run cut");
            (own, String::from_utf8_lossy(&out.stdout).trim().to_string())
        })
        .join()
        .unwrap();
        assert_eq!(own, SLURM_QUERY_NICE);
        assert_eq!(child, SLURM_QUERY_NICE.to_string());
    }

    /// A daemon's shared state without its threads: 4 CPUs, `[slurm]` as
    /// `slurm` says (empty: none). The receivers are kept alive with it.
    struct Daemon {
        shared: Arc<Shared>,
        _spawns: std::sync::mpsc::Receiver<crate::daemon::process::SpawnJob>,
        _inbox: std::sync::mpsc::Receiver<crate::daemon::outbox::LoopMsg>,
    }

    fn daemon(slurm: &str) -> Daemon {
        let text = format!("node_name = \"node1\"\ncpus = \"0-3\"\nmemory_mib = 1024\n{slurm}");
        let settings = Config::parse(&text).unwrap().resolve().unwrap();
        let (tx, _spawns) = std::sync::mpsc::channel();
        let (to_loop, _inbox) = std::sync::mpsc::channel();
        let outbox = Outbox::new(to_loop, Arc::new(Waker::new().unwrap()));
        let shared = Shared::new(
            settings,
            rfaas_proto::lease::LeaseKeys::new(),
            MemoryLimiter::Rlimit,
            tx,
            outbox,
            None,
        );
        Daemon {
            shared: Arc::new(shared),
            _spawns,
            _inbox,
        }
    }

    /// An allocation holding `cpus`, with no worker (nothing to signal).
    fn allocate(shared: &Shared, id: u64, cpus: &[u32]) {
        let mut st = shared.lock();
        let granted = st
            .capacity
            .grant(id, cpus.len() as u16, 10, cpus.len() as u16, 10)
            .unwrap();
        assert_eq!(granted, cpus, "the test asks for the lowest free CPUs");
        st.allocations.insert(
            id,
            Allocation {
                id,
                lease_id: id,
                user: "nobody".into(),
                conn_id: 0,
                pid: None,
                worker_sock: None,
                cpus: granted,
                memory_mib: 10,
                expires_at: u64::MAX,
                mode: rfaas_proto::control::client::Mode::Warm,
                ready: true,
                stop: None,
                ended: None,
                runtime_dir: PathBuf::from("/nonexistent/rfaas-test"),
                attach_secret: String::new(),
                attach_by: None,
            },
        );
    }

    fn cpus(v: &[u32]) -> BTreeSet<u32> {
        v.iter().copied().collect()
    }

    fn free(shared: &Shared) -> Vec<u32> {
        shared.lock().capacity.free_cpus()
    }

    #[test]
    fn holds_withhold_their_cpus_and_stop_only_what_runs_on_them() {
        let d = daemon("");
        let s = &d.shared;
        allocate(s, 1, &[0]);
        allocate(s, 2, &[1, 2]);
        let mut st = s.lock();
        st.beat_now = false;

        let c = set_hold(
            s,
            &mut st,
            10,
            Some(Hold {
                cpus: cpus(&[2]),
                whole: false,
            }),
        );
        assert_eq!(c.targets, [2], "only the allocation on CPU 2");
        assert!(!st.draining);
        assert!(st.beat_now, "the managers hear of it at once");
        assert_eq!(st.capacity.free_cpus(), [3]);
        assert_eq!(st.capacity.withheld_cpus(), [2]);

        let c = set_hold(s, &mut st, 11, Some(Hold::whole(&s.settings.cpus)));
        assert_eq!(c.targets, [1, 2], "the whole node: every allocation");
        assert!(st.draining);
        assert!(st.capacity.free_cpus().is_empty());

        let c = set_hold(s, &mut st, 11, None);
        assert!(c.undrained);
        assert!(!st.draining);
        assert_eq!(st.capacity.free_cpus(), [3], "job 10 still holds CPU 2");

        // The allocations end; job 10's CPU stays withheld until its end.
        s.remove_allocation(&mut st, 1);
        s.remove_allocation(&mut st, 2);
        assert_eq!(st.capacity.free_cpus(), [0, 1, 3]);
        let c = set_hold(s, &mut st, 10, None);
        assert!(!c.undrained && c.targets.is_empty());
        assert_eq!(st.capacity.free_cpus(), [0, 1, 2, 3]);
    }

    #[test]
    fn without_slurm_a_job_takes_the_whole_node_until_it_ends() {
        let d = daemon("");
        let s = &d.shared;
        let m = retrieve(s, 7, 1, Duration::ZERO).finished();
        assert_eq!(
            timeless(&m),
            "taken back for Slurm job 7: drained in _ ms: 0 allocations drained within the 0 ms grace period, 0 stopped after it, 0 had finished already"
        );
        assert!(s.lock().draining);
        assert!(free(s).is_empty());
        retrieve(s, 8, 1, Duration::ZERO).finished();
        assert_eq!(
            offer(s, 7),
            "Slurm job 7 ended; Slurm jobs [8] still hold the node"
        );
        assert_eq!(offer(s, 8), "Slurm job 8 ended: taking allocations again");
        assert!(!s.lock().draining);
        assert_eq!(free(s), [0, 1, 2, 3]);
        assert_eq!(
            offer(s, 9),
            "Slurm job 9 ended; nothing was withheld for it here"
        );
    }

    /// `m` with the time a take-back took ("in 12 ms") as "in _ ms".
    fn timeless(m: &str) -> String {
        let Some(at) = m.find(" in ") else {
            return m.to_owned();
        };
        let rest = &m[at + 4..];
        let digits = rest.chars().take_while(char::is_ascii_digit).count();
        format!("{} in _{}", &m[..at], &rest[digits..])
    }

    #[test]
    fn a_take_back_says_what_became_of_each_allocation() {
        let t = super::super::shared::TakenBack {
            took: Duration::from_millis(20),
            grace: Duration::from_secs(5),
            finished: 1,
            drained: 2,
            stopped: 1,
            stuck: 1,
        };
        assert_eq!(
            t.describe(" on them"),
            "in 20 ms: 2 allocations on them drained within the 5000 ms grace period, 1 stopped after it, 1 had finished already; 1 worker did not end after SIGKILL"
        );
    }

    /// A stand-in `scontrol`: a shell script printing `jobs.txt` for every
    /// job, or `job-N.txt` for job N (exit 1 when there is none), once no
    /// file `wait` is there. The real one needs a cluster:
    /// slurm-spank/tests/cluster.rs runs it.
    fn fake_scontrol(dir: &Path) -> PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let p = dir.join("scontrol");
        let body = format!(
            "#!/bin/sh\nd={dir}\nwhile [ -e \"$d/wait\" ]; do sleep 0.01; done\nif [ -n \"$6\" ]; then\n  [ -f \"$d/job-$6.txt\" ] || {{ echo 'slurm_load_jobs error: Invalid job id specified' >&2; exit 1; }}\n  exec cat \"$d/job-$6.txt\"\nfi\n[ -f \"$d/jobs.txt\" ] || {{ echo 'slurm_load_jobs error: Unable to contact slurm controller' >&2; exit 1; }}\nexec cat \"$d/jobs.txt\"\n",
            dir = dir.display()
        );
        std::fs::write(&p, body).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
        p
    }

    fn temp_dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("rfaas-slurm-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn with_slurm(dir: &Path) -> Daemon {
        daemon(&format!(
            "[slurm]\nscontrol = {:?}\ngrace_ms = 0\n",
            fake_scontrol(dir).display().to_string()
        ))
    }

    #[test]
    fn a_job_takes_back_the_cpus_slurm_gave_it_or_more() {
        let dir = temp_dir("retrieve");
        let d = with_slurm(&dir);
        let s = &d.shared;
        std::fs::write(
            dir.join("job-2.txt"),
            "JobId=2 JobName=wrap JobState=RUNNING NodeList=node1 JOB_GRES=(null)   Nodes=node1 CPU_IDs=1-2 Mem=0 GRES= MinCPUsNode=1\n",
        )
        .unwrap();
        let m = retrieve(s, 2, 2, Duration::ZERO).finished();
        assert_eq!(
            m,
            "taken back for Slurm job 2: CPUs 1-2 withheld (Slurm's CPU_IDs 1-2); no allocation ran on them; 2 CPUs free for rfaas"
        );
        assert_eq!(free(s), [0, 3]);
        assert!(!s.lock().draining);

        // Slurm does not know job 3: as many CPUs as the hook counted, the
        // lowest not withheld.
        let m = retrieve(s, 3, 1, Duration::ZERO).finished();
        assert!(m.starts_with("taken back for Slurm job 3: CPUs 0 withheld (1 CPU by the hook's count: Slurm does not know job 3)"), "{m}");
        assert_eq!(free(s), [3]);

        // ... and no count at all: the whole node.
        let m = retrieve(s, 4, 0, Duration::ZERO).finished();
        assert!(
            m.starts_with(
                "taken back for Slurm job 4 (the whole node: Slurm does not know job 4): drained"
            ),
            "{m}"
        );
        assert!(s.lock().draining);
        assert_eq!(
            offer(s, 4),
            "Slurm job 4 ended: taking allocations again; CPUs 0-2 stay with Slurm jobs [2, 3]"
        );
        assert_eq!(
            offer(s, 3),
            "Slurm job 3 ended: CPUs 0 offered again; CPUs 1-2 stay with Slurm jobs [2]"
        );
        assert_eq!(offer(s, 2), "Slurm job 2 ended: CPUs 1-2 offered again");
        assert_eq!(free(s), [0, 1, 2, 3]);

        // Slurm cannot be asked: the whole node, whatever the count.
        std::fs::write(dir.join("scontrol"), "#!/bin/sh\nexit 3\n").unwrap();
        let m = retrieve(s, 5, 1, Duration::ZERO).finished();
        assert!(
            m.starts_with("taken back for Slurm job 5 (the whole node: "),
            "{m}"
        );
        assert!(m.contains("failed (exit status: 3)"), "{m}");
        assert!(free(s).is_empty());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn an_idle_node_answers_before_slurm_does_and_settles_after() {
        let dir = temp_dir("early");
        let d = with_slurm(&dir);
        let s = &d.shared;
        std::fs::write(
            dir.join("job-2.txt"),
            "JobId=2 JobState=RUNNING   Nodes=node1 CPU_IDs=1-2 Mem=0 GRES=\n",
        )
        .unwrap();
        std::fs::write(dir.join("wait"), "").unwrap();
        let r = retrieve(s, 2, 2, Duration::from_secs(30));
        assert_eq!(
            r.message,
            "taken back for Slurm job 2: no allocation ran here; every CPU withheld until Slurm says which are the job's"
        );
        assert!(
            free(s).is_empty(),
            "every CPU withheld while Slurm is asked"
        );
        std::fs::remove_file(dir.join("wait")).unwrap();
        assert_eq!(
            r.finished(),
            "taken back for Slurm job 2: CPUs 1-2 withheld (Slurm's CPU_IDs 1-2); no allocation ran on them; 2 CPUs free for rfaas"
        );
        assert_eq!(free(s), [0, 3]);
        offer(s, 2);

        // A job so short that its epilog comes before Slurm answers its
        // prolog's question: nothing stays withheld for it.
        std::fs::write(dir.join("wait"), "").unwrap();
        let r = retrieve(s, 2, 2, Duration::from_secs(30));
        assert!(r.settling.is_some());
        offer(s, 2);
        std::fs::remove_file(dir.join("wait")).unwrap();
        let m = r.finished();
        assert!(
            m.starts_with(
                "Slurm job 2 ended before Slurm said which CPUs were its; nothing withheld for it"
            ),
            "{m}"
        );
        assert_eq!(free(s), [0, 1, 2, 3]);
        assert!(s.lock().slurm_jobs.is_empty());

        // With an allocation anywhere, the answer waits for Slurm's.
        allocate(s, 1, &[0]);
        let r = retrieve(s, 2, 2, Duration::ZERO);
        assert!(r.settling.is_none());
        assert!(
            r.message
                .starts_with("taken back for Slurm job 2: CPUs 1-2 withheld"),
            "{}",
            r.message
        );
        assert_eq!(s.lock().capacity.withheld_cpus(), [1, 2]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_job_on_every_cpu_drains_and_one_on_none_of_ours_takes_nothing() {
        let dir = temp_dir("whole");
        let d = with_slurm(&dir);
        let s = &d.shared;
        std::fs::write(
            dir.join("job-8.txt"),
            "JobId=8 JobState=RUNNING   Nodes=node[1-2] CPU_IDs=0-3 Mem=0 GRES=\n",
        )
        .unwrap();
        std::fs::write(
            dir.join("job-9.txt"),
            "JobId=9 JobState=RUNNING   Nodes=node1 CPU_IDs=4-7 Mem=0 GRES=\n",
        )
        .unwrap();
        let m = retrieve(s, 8, 4, Duration::ZERO).finished();
        assert!(
            m.starts_with(
                "taken back for Slurm job 8 (every CPU here: Slurm's CPU_IDs 0-3): drained"
            ),
            "{m}"
        );
        assert!(s.lock().draining);
        offer(s, 8);
        let m = retrieve(s, 9, 4, Duration::ZERO).finished();
        assert_eq!(m, "taken back for Slurm job 9: none of its CPUs is rfaas's (Slurm's CPU_IDs 4-7); 4 CPUs free for rfaas");
        assert!(!s.lock().draining);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn reconciling_takes_back_missed_prologs_and_gives_back_missed_epilogs() {
        let dir = temp_dir("reconcile");
        let d = with_slurm(&dir);
        let s = &d.shared;
        // Slurm cannot be asked: nothing changes.
        assert!(reconcile(s).is_err());
        assert_eq!(free(s), [0, 1, 2, 3]);

        // The loopback cluster's jobs (scontrol.rs tests): on node1, 1 has
        // CPU 0, 2 has 1-2, 3 has 3; 6's record is a name's fake.
        std::fs::copy(
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("src/daemon/slurm/testdata/show-job-running.txt"),
            dir.join("jobs.txt"),
        )
        .unwrap();
        {
            let mut st = s.lock();
            // Job 1 taken back by its prolog, by count (a wrong guess);
            // job 40 ended long ago, its epilog never came; a hook is
            // speaking of job 3 right now.
            set_hold(
                s,
                &mut st,
                1,
                Some(Hold {
                    cpus: cpus(&[3]),
                    whole: false,
                }),
            );
            set_hold(
                s,
                &mut st,
                40,
                Some(Hold {
                    cpus: cpus(&[2]),
                    whole: false,
                }),
            );
            note_event(&mut st, 3, Instant::now() + Duration::from_secs(3600));
        }
        let round = reconcile(s).unwrap();
        assert_eq!(
            round,
            Round {
                taken: vec![2],
                given: vec![40],
                corrected: vec![1],
            }
        );
        let st = s.lock();
        assert_eq!(st.slurm_jobs[&1].cpus, cpus(&[0]));
        assert_eq!(st.slurm_jobs[&2].cpus, cpus(&[1, 2]));
        assert_eq!(st.capacity.free_cpus(), [3], "job 3 is left to its hook");
        drop(st);

        // Everything ended: every job given back.
        std::fs::copy(
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("src/daemon/slurm/testdata/show-job-ending.txt"),
            dir.join("jobs.txt"),
        )
        .unwrap();
        std::fs::write(dir.join("jobs.txt"), "No jobs in the system\n").unwrap();
        let round = reconcile(s).unwrap();
        assert_eq!(round.given, [1, 2]);
        assert_eq!(free(s), [0, 1, 2, 3]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn what_slurm_shows_unclearly_never_gives_cpus_back() {
        let dir = temp_dir("unclear");
        let d = with_slurm(&dir);
        let s = &d.shared;
        // Job 20 runs, but Slurm shows it on node2 only (a wrong [slurm]
        // node?); job 21's CPU ids here cannot be read; job 22 is being
        // asked about by its prolog right now.
        std::fs::write(
            dir.join("jobs.txt"),
            "JobId=20 JobState=RUNNING   Nodes=node2 CPU_IDs=0 Mem=0\n\
             JobId=21 JobState=RUNNING   Nodes=node1 CPU_IDs=all Mem=0\n\
             JobId=22 JobState=RUNNING   Nodes=node1 CPU_IDs=3 Mem=0\n",
        )
        .unwrap();
        std::fs::write(
            dir.join("job-21.txt"),
            "JobId=21 JobState=RUNNING   Nodes=node1 CPU_IDs=all Mem=0\n",
        )
        .unwrap();
        {
            let mut st = s.lock();
            set_hold(
                s,
                &mut st,
                20,
                Some(Hold {
                    cpus: cpus(&[1]),
                    whole: false,
                }),
            );
            st.slurm_asking.push(22);
        }
        let round = reconcile(s).unwrap();
        assert_eq!(
            round,
            Round {
                taken: vec![21],
                given: vec![],
                corrected: vec![]
            }
        );
        {
            let st = s.lock();
            assert!(st.slurm_jobs[&21].whole, "unreadable ids: the whole node");
            assert_eq!(st.slurm_jobs[&20].cpus, cpus(&[1]), "kept");
            assert!(!st.slurm_jobs.contains_key(&22));
        }
        // A prolog that finds no ids it can read goes by its count.
        offer(s, 21);
        s.lock().slurm_asking.clear();
        let m = retrieve(s, 21, 2, Duration::ZERO).finished();
        assert!(
            m.contains("CPUs 0,2 withheld (2 CPUs by the hook's count: Slurm shows job 21 on node \"node1\" without CPU ids it can read)"),
            "{m}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn an_ending_job_keeps_its_cpus_and_is_not_taken_anew() {
        let dir = temp_dir("ending");
        let d = with_slurm(&dir);
        let s = &d.shared;
        std::fs::copy(
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("src/daemon/slurm/testdata/show-job-ending.txt"),
            dir.join("jobs.txt"),
        )
        .unwrap();
        {
            let mut st = s.lock();
            set_hold(
                s,
                &mut st,
                3,
                Some(Hold {
                    cpus: cpus(&[3]),
                    whole: false,
                }),
            );
        }
        // 2 is suspended (still holds 1-2), 3 completing (kept), 1 and 4
        // are over, 6's fake record has no state (not taken).
        let round = reconcile(s).unwrap();
        assert_eq!(
            round,
            Round {
                taken: vec![2],
                given: vec![],
                corrected: vec![]
            }
        );
        assert_eq!(free(s), [0]);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

//! From a run's jobs and samples to its figures: how much of Slurm's idle
//! capacity rfaas was offered, how soon a job's end was lent again, and
//! how long each job waited between Slurm's allocation and its script's
//! first line. Pure functions, so the rules are tested here on made-up
//! runs.

use std::collections::BTreeMap;

use super::records::JobRecord;
use super::sample::{LentNode, Sample, SlurmNode};

/// Core-seconds over the run's window.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Harvest {
    /// CPUs Slurm had idle (not allocated, node not drained or down).
    pub idle_core_s: f64,
    /// Of those, the ones the manager showed lent (each node's lent cores,
    /// capped at its idle CPUs at the same moment).
    pub offered_core_s: f64,
    /// Cores the manager showed lent beyond Slurm's idle CPUs: cores a
    /// Slurm job held that rfaas had not withheld yet (the moments between
    /// Slurm's allocation and the node's take-back), or that Slurm still
    /// counted in a job's epilog after the node lent them again.
    pub overlent_core_s: f64,
}

impl Harvest {
    /// `offered / idle`; `None` without idle capacity.
    pub fn share(&self) -> Option<f64> {
        (self.idle_core_s > 0.0).then(|| self.offered_core_s / self.idle_core_s)
    }
}

/// Integrates both views from `from` to `to` (unix ns): each holds from
/// its sample to the next. Before the first Slurm sample nothing counts;
/// before the first manager sample nothing is lent.
pub fn harvest(
    slurm: &[Sample<SlurmNode>],
    manager: &[Sample<LentNode>],
    from: u64,
    to: u64,
) -> Harvest {
    let mut cuts: Vec<u64> = slurm
        .iter()
        .map(|s| s.at_ns)
        .chain(manager.iter().map(|s| s.at_ns))
        .filter(|t| (from..to).contains(t))
        .chain([from, to])
        .collect();
    cuts.sort_unstable();
    cuts.dedup();
    let mut out = Harvest::default();
    for pair in cuts.windows(2) {
        let (a, b) = (pair[0], pair[1]);
        let Some(s) = latest(slurm, a) else {
            continue;
        };
        let m = latest(manager, a);
        let seconds = (b - a) as f64 / 1e9;
        for (name, node) in &s.nodes {
            let lent = m.and_then(|m| m.nodes.get(name)).map_or(0, LentNode::lent);
            out.idle_core_s += f64::from(node.idle) * seconds;
            out.offered_core_s += f64::from(lent.min(node.idle)) * seconds;
            out.overlent_core_s += f64::from(lent.saturating_sub(node.idle)) * seconds;
        }
    }
    out
}

/// The last sample at or before `t`.
fn latest<T>(samples: &[Sample<T>], t: u64) -> Option<&Sample<T>> {
    let n = samples.partition_point(|s| s.at_ns <= t);
    n.checked_sub(1).map(|i| &samples[i])
}

/// How soon the manager showed each job's CPUs lent again after its end.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Registrations {
    /// Per job whose every node was seen lending again: its script's end
    /// to the first manager sample showing the last of its nodes lending
    /// its CPUs again, ns.
    pub latencies_ns: Vec<u64>,
    /// Jobs whose CPUs Slurm gave another job before the manager showed
    /// them lent: there was nothing to lend.
    pub superseded: usize,
    /// Jobs a node of which the manager never showed lending again while
    /// sampled.
    pub missing: usize,
}

/// The registration of each job's end, per node: the first manager
/// sample at or after the end in which the node withholds no more than
/// the CPUs of the other jobs running there at that end. A node another
/// job was allocated before that sample is superseded. `cpus` is each
/// node's CPU count.
pub fn registrations(jobs: &[JobRecord], manager: &[Sample<LentNode>], cpus: u32) -> Registrations {
    let mut out = Registrations::default();
    for job in jobs {
        let Some(end) = job.ended_ns else {
            continue;
        };
        let (mut latest_seen, mut superseded, mut missing) = (None::<u64>, 0, 0);
        for node in &job.nodes {
            let others: u32 = jobs
                .iter()
                .filter(|o| o.id != job.id && o.holds(node, end))
                .map(|o| o.cpus_per_node(cpus))
                .sum();
            let start = manager.partition_point(|s| s.at_ns < end);
            let seen = manager[start..].iter().find(|s| {
                s.nodes
                    .get(node)
                    .is_some_and(|n| n.up && n.withheld <= others)
            });
            let Some(seen) = seen else {
                missing += 1;
                continue;
            };
            let taken = jobs.iter().any(|o| {
                o.id != job.id
                    && o.nodes.contains(node)
                    && o.allocated_ns.is_some_and(|a| a > end && a <= seen.at_ns)
            });
            if taken {
                superseded += 1;
            } else {
                latest_seen = latest_seen.max(Some(seen.at_ns));
            }
        }
        if missing > 0 {
            out.missing += 1;
        } else if let Some(seen) = latest_seen {
            out.latencies_ns.push(seen - end);
        } else if superseded > 0 {
            out.superseded += 1;
        }
    }
    out
}

/// Each job's start delay by stream index, ns (Slurm's allocation to the
/// script's first line; never below zero: the allocation's time is cut to
/// the millisecond).
pub fn start_delays(jobs: &[JobRecord]) -> BTreeMap<usize, u64> {
    jobs.iter()
        .filter_map(|j| Some((j.index, j.start_delay_ns()?.max(0) as u64)))
        .collect()
}

/// Each job's take-back time by stream index, ns (Slurm's allocation to
/// the end of the plugin's last take-back; never below zero).
pub fn take_back_times(jobs: &[JobRecord]) -> BTreeMap<usize, u64> {
    jobs.iter()
        .filter_map(|j| Some((j.index, j.take_back_ns()?.max(0) as u64)))
        .collect()
}

/// Where the jobs of a run started, as far as rfaas was concerned.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Placement {
    /// Stream indices of the jobs whose nodes had no leased core from the
    /// last manager sample before their allocation to their script's
    /// first line: rfaas had nothing there to take back.
    pub idle: Vec<usize>,
    /// Of the others, those whose nodes had none at their allocation but
    /// got a lease before they started: a client moved there, onto
    /// another core, or onto theirs before the job's prolog took them
    /// back.
    pub raced: Vec<usize>,
}

/// Sorts the jobs by whether a lease ran on their nodes while they were
/// started.
pub fn placement(jobs: &[JobRecord], manager: &[Sample<LentNode>]) -> Placement {
    let mut out = Placement::default();
    for j in jobs {
        let (Some(a), Some(started)) = (j.allocated_ns, j.started_ns) else {
            continue;
        };
        let unleased = |s: &Sample<LentNode>| {
            j.nodes
                .iter()
                .all(|n| s.nodes.get(n).is_some_and(|n| n.leased == 0))
        };
        let first = manager.partition_point(|s| s.at_ns <= a);
        let Some(at_allocation) = first.checked_sub(1).map(|i| &manager[i]) else {
            continue;
        };
        if !unleased(at_allocation) {
            continue;
        }
        let until = manager.partition_point(|s| s.at_ns <= started);
        if manager[first..until.max(first)].iter().all(unleased) {
            out.idle.push(j.index);
        } else {
            out.raced.push(j.index);
        }
    }
    out
}

/// Nearest-rank percentile of `values` (sorted in place); `None` when
/// empty.
pub fn percentile(values: &mut [u64], percent: usize) -> Option<u64> {
    if values.is_empty() {
        return None;
    }
    values.sort_unstable();
    let rank = (values.len() * percent).div_ceil(100).max(1);
    Some(values[rank - 1])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::harvest::stream::Size;

    const S: u64 = 1_000_000_000;

    fn slurm(at: u64, idle: &[(&str, u32)]) -> Sample<SlurmNode> {
        Sample {
            at_ns: at,
            nodes: idle
                .iter()
                .map(|(n, i)| {
                    (
                        n.to_string(),
                        SlurmNode {
                            alloc: 4 - i,
                            idle: *i,
                            total: 4,
                        },
                    )
                })
                .collect(),
        }
    }

    fn lent(at: u64, withheld: &[(&str, u32, u32)]) -> Sample<LentNode> {
        Sample {
            at_ns: at,
            nodes: withheld
                .iter()
                .map(|(n, w, leased)| {
                    (
                        n.to_string(),
                        LentNode {
                            up: true,
                            cores: 4,
                            leased: *leased,
                            withheld: *w,
                        },
                    )
                })
                .collect(),
        }
    }

    fn job(id: u32, size: Size, nodes: &[&str], alloc: u64, end: u64) -> JobRecord {
        JobRecord {
            index: id as usize,
            id,
            size,
            submitted_ns: 0,
            allocated_ns: Some(alloc),
            nodes: nodes.iter().map(|n| n.to_string()).collect(),
            started_ns: Some(alloc + 30_000_000),
            ended_ns: Some(end),
            taken_back_ns: None,
        }
    }

    #[test]
    fn the_share_counts_lent_cores_up_to_slurms_idle_ones() {
        // 0-10 s: node1 idle (4), lent 4. 10-20 s: a job takes 2 CPUs at
        // once in Slurm; the manager hears of it at 11 s. No sample before
        // 0: nothing counts before.
        let one = [slurm(0, &[("node1", 4)]), slurm(10 * S, &[("node1", 2)])];
        let manager = [
            lent(0, &[("node1", 0, 0)]),
            lent(11 * S, &[("node1", 2, 0)]),
        ];
        let h = harvest(&one, &manager, 0, 20 * S);
        assert!((h.idle_core_s - 60.0).abs() < 1e-9, "{h:?}");
        assert!((h.offered_core_s - 60.0).abs() < 1e-9, "{h:?}");
        // 10-11 s the manager still showed 4 lent of 2 idle.
        assert!((h.overlent_core_s - 2.0).abs() < 1e-9, "{h:?}");
        assert_eq!(h.share(), Some(1.0));

        // A node that lends nothing although idle halves the share.
        let manager = [lent(0, &[("node1", 0, 0), ("node2", 4, 0)])];
        let two = [slurm(0, &[("node1", 4), ("node2", 4)])];
        let h = harvest(&two, &manager, 0, 10 * S);
        assert_eq!(h.share(), Some(0.5));
        // Without the manager, nothing was offered.
        let h = harvest(&two, &[], 0, 10 * S);
        assert_eq!(h.share(), Some(0.0));
        assert_eq!(harvest(&[], &[], 0, 10 * S).share(), None);
    }

    #[test]
    fn a_registration_waits_for_the_jobs_cpus_only() {
        // Job 1 (2 CPUs) ends at 5 s while job 2 (1 CPU) runs on: node1 is
        // registered when it withholds 1, at the 5.2 s sample.
        let jobs = [
            job(1, Size::Cpus(2), &["node1"], 0, 5 * S),
            job(2, Size::Cpus(1), &["node1"], 0, 9 * S),
        ];
        let manager = [
            lent(4 * S, &[("node1", 3, 0)]),
            lent(5 * S + S / 10, &[("node1", 3, 0)]),
            lent(5 * S + S / 5, &[("node1", 1, 0)]),
            lent(9 * S + S / 2, &[("node1", 0, 0)]),
        ];
        let r = registrations(&jobs, &manager, 4);
        assert_eq!(r.latencies_ns, [S / 5, S / 2], "{r:?}");
        assert_eq!((r.superseded, r.missing), (0, 0));
    }

    #[test]
    fn a_multi_node_job_is_registered_when_its_last_node_is() {
        let jobs = [job(1, Size::Nodes(2), &["node1", "node2"], 0, 5 * S)];
        let manager = [
            lent(5 * S + 100, &[("node1", 0, 0), ("node2", 4, 0)]),
            lent(6 * S, &[("node1", 0, 0), ("node2", 0, 0)]),
        ];
        let r = registrations(&jobs, &manager, 4);
        assert_eq!(r.latencies_ns, [S]);
    }

    #[test]
    fn cpus_slurm_gives_on_at_once_are_superseded_and_unseen_ones_missing() {
        // Job 2 gets node1 0.1 s after job 1's end: node1 never lends.
        let jobs = [
            job(1, Size::Nodes(1), &["node1"], 0, 5 * S),
            job(2, Size::Nodes(1), &["node1"], 5 * S + S / 10, 8 * S),
            job(3, Size::Nodes(1), &["node2"], 0, 5 * S),
        ];
        let manager = [
            lent(5 * S + S / 2, &[("node1", 4, 0), ("node2", 4, 0)]),
            lent(8 * S + S / 4, &[("node1", 0, 0), ("node2", 4, 0)]),
        ];
        let r = registrations(&jobs, &manager, 4);
        assert_eq!(r.latencies_ns, [S / 4], "job 2's own end: {r:?}");
        assert_eq!((r.superseded, r.missing), (1, 1), "{r:?}");
    }

    #[test]
    fn delays_and_the_jobs_on_unleased_nodes() {
        let jobs = [
            job(1, Size::Cpus(1), &["node1"], 2 * S, 5 * S),
            job(2, Size::Cpus(1), &["node2"], 2 * S, 5 * S),
            job(3, Size::Cpus(1), &["node2"], S / 2, 5 * S),
        ];
        let manager = [
            lent(0, &[("node1", 0, 0), ("node2", 0, 0)]),
            lent(S, &[("node1", 0, 0), ("node2", 0, 1)]),
        ];
        // Job 3 was given node2 unleased and started (0.53 s) before the
        // lease there (1 s): idle. Job 2 was given a leased node.
        assert_eq!(
            placement(&jobs, &manager),
            Placement {
                idle: vec![1, 3],
                raced: vec![]
            }
        );
        let late = [job(4, Size::Cpus(1), &["node2"], S - S / 100, 5 * S)];
        assert_eq!(
            placement(&late, &manager),
            Placement {
                idle: vec![],
                raced: vec![4]
            },
            "given node2 at 0.99 s, leased at 1 s, started at 1.02 s"
        );
        let delays = start_delays(&jobs);
        assert_eq!(delays[&1], 30_000_000);
        let mut taken = jobs[0].clone();
        taken.taken_back_ns = Some(2 * S + 10);
        assert_eq!(take_back_times(&[taken])[&1], 10);
        assert!(take_back_times(&jobs).is_empty());
        let mut v = vec![5, 1, 4, 2, 3];
        assert_eq!(percentile(&mut v, 50), Some(3));
        assert_eq!(percentile(&mut v, 99), Some(5));
        assert_eq!(percentile(&mut [], 99), None);
    }
}

//! What the daemon withholds for a Slurm job: the state the allocation
//! table keeps per job ([`super`] decides it).

use std::collections::BTreeSet;

/// What the daemon withholds for one Slurm job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Hold {
    /// The daemon's CPUs the job has here (every CPU when `whole`).
    pub cpus: BTreeSet<u32>,
    /// The whole node: no allocation at all while the job runs.
    pub whole: bool,
}

impl Hold {
    /// Every CPU of the node, `node_cpus` (the daemon's).
    pub(crate) fn whole(node_cpus: &[u32]) -> Hold {
        Hold {
            cpus: node_cpus.iter().copied().collect(),
            whole: true,
        }
    }

    /// `cpus`, or the whole node when they are every CPU of it.
    pub(crate) fn of(node_cpus: &[u32], cpus: BTreeSet<u32>) -> Hold {
        if !cpus.is_empty() && cpus.len() == node_cpus.len() {
            Hold::whole(node_cpus)
        } else {
            Hold { cpus, whole: false }
        }
    }
}

//! What a hook knows of the job on this node, from the environment Slurm
//! gives prologs and epilogs (`SLURM_JOB_ID`, `SLURMD_NODENAME`,
//! `SLURM_NODELIST`, `SLURM_JOB_CPUS_PER_NODE`).

use rfaas_proto::hostlist::expand_hostlist;

/// The job, as far as the environment tells.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobOnNode {
    /// The Slurm job id (0 when unknown).
    pub job_id: u64,
    /// This node's Slurm name, when known.
    pub node: Option<String>,
    /// CPUs the job has on this node; 0 when the environment does not
    /// tell (then the whole node is taken back).
    pub cpus: u32,
}

impl JobOnNode {
    /// Reads the job from environment lookups (`std::env::var` in a
    /// process, a closure in tests).
    pub fn from_env(var: impl Fn(&str) -> Option<String>) -> JobOnNode {
        let job_id = var("SLURM_JOB_ID")
            .or_else(|| var("SLURM_JOBID"))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0);
        let node = var("SLURMD_NODENAME").filter(|n| !n.is_empty());
        let cpus = match (
            &node,
            var("SLURM_JOB_NODELIST").or_else(|| var("SLURM_NODELIST")),
            var("SLURM_JOB_CPUS_PER_NODE"),
        ) {
            (Some(node), Some(list), Some(per_node)) => {
                cpus_on(node, &list, &per_node).unwrap_or(0)
            }
            // One node's count needs no list to find it in.
            (_, _, Some(per_node)) => match cpus_per_node(&per_node).as_deref() {
                Some([only]) => *only,
                _ => 0,
            },
            _ => 0,
        };
        JobOnNode { job_id, node, cpus }
    }
}

/// CPUs on `node` from Slurm's node list (`node[1-3],gpu7`) and CPU counts
/// (`4(x2),2`), which go in the same order.
pub fn cpus_on(node: &str, nodelist: &str, per_node: &str) -> Option<u32> {
    let nodes = expand_hostlist(nodelist)?;
    let cpus = cpus_per_node(per_node)?;
    if nodes.len() != cpus.len() {
        return None;
    }
    let i = nodes.iter().position(|n| n == node)?;
    Some(cpus[i])
}

/// `4(x2),2` → `[4, 4, 2]`.
pub fn cpus_per_node(s: &str) -> Option<Vec<u32>> {
    let mut out = Vec::new();
    for item in s.trim().split(',') {
        let (count, times) = match item.split_once("(x") {
            Some((count, rest)) => (count, rest.strip_suffix(')')?.parse::<usize>().ok()?),
            None => (item, 1),
        };
        let count: u32 = count.parse().ok()?;
        if times > 4096 {
            return None;
        }
        out.extend(std::iter::repeat(count).take(times));
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn cpu_counts() {
        assert_eq!(cpus_per_node("4(x2),2").unwrap(), [4, 4, 2]);
        assert_eq!(cpus_per_node("1").unwrap(), [1]);
        assert_eq!(cpus_per_node("x"), None);
        assert_eq!(cpus_per_node("4(x2"), None);
    }

    #[test]
    fn this_nodes_cpus() {
        assert_eq!(cpus_on("node3", "node[1-3]", "4(x2),2"), Some(2));
        assert_eq!(cpus_on("node9", "node[1-3]", "4(x2),2"), None);
        assert_eq!(cpus_on("node1", "node[1-3]", "4"), None, "lengths differ");
    }

    #[test]
    fn from_the_prolog_environment() {
        let env: HashMap<&str, &str> = [
            ("SLURM_JOB_ID", "12"),
            ("SLURMD_NODENAME", "node2"),
            ("SLURM_NODELIST", "node[1-2]"),
            ("SLURM_JOB_CPUS_PER_NODE", "3,1"),
        ]
        .into();
        let job = JobOnNode::from_env(|k| env.get(k).map(|v| v.to_string()));
        assert_eq!(
            job,
            JobOnNode {
                job_id: 12,
                node: Some("node2".into()),
                cpus: 1
            }
        );
        let job = JobOnNode::from_env(|_| None);
        assert_eq!(job.job_id, 0);
        assert_eq!(job.cpus, 0, "unknown: the whole node");
    }
}

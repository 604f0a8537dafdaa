//! The node's own tools ↔ executor daemon (a unix socket): status,
//! draining, usage, and the Slurm hooks' requests.

use std::collections::BTreeMap;

use serde::ser::SerializeStruct;
use serde::{Deserialize, Serialize, Serializer};

use crate::accounting::UsageFigures;

use super::frame::message_kinds;

/// Where an executor daemon listens for the node's tools when its
/// configuration does not say (`local_socket`).
pub const DEFAULT_LOCAL_SOCKET: &str = "/run/rfaas/executord.sock";

/// The variable naming the managers in a job's environment (the client
/// library reads it).
pub const MANAGERS_VAR: &str = "RFAAS_MANAGERS";

/// The variable holding a job's credential.
pub const CREDENTIAL_VAR: &str = "RFAAS_CREDENTIAL";

/// The variable naming the CA file the client library trusts for
/// `https://` managers.
pub const CA_FILE_VAR: &str = "RFAAS_CA_FILE";

/// Every variable a [`LocalReply::JobEnv`] may set in a job's environment.
/// The Slurm plugin sets these and nothing else, whatever a reply names:
/// the reply comes from a socket, and the plugin runs as root in every
/// job's step.
pub const JOB_ENV_VARS: [&str; 3] = [MANAGERS_VAR, CREDENTIAL_VAR, CA_FILE_VAR];

/// Node tool → daemon (unix socket).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "command", rename_all = "snake_case")]
#[non_exhaustive]
pub enum LocalRequest {
    /// What the daemon has and runs.
    Status,
    /// Stop taking allocations, let running invocations finish for
    /// `grace_ms`, then stop every worker.
    Drain {
        /// Grace period, milliseconds.
        grace_ms: u64,
    },
    /// Take allocations again after a drain.
    Resume,
    /// What each lease used on this node ([`LeaseUsage`]), live and
    /// recently ended; only lease `lease_id` when given.
    Usage {
        /// One lease only.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        lease_id: Option<u64>,
    },
    /// Slurm's prolog: job `job_id` starts on this node. Stop allocating
    /// the CPUs it gets at once, let running invocations on them finish
    /// for `grace_ms`, then stop their workers. Answered with
    /// [`LocalReply::Done`] once the CPUs are free.
    SlurmRetrieve {
        /// The Slurm job.
        job_id: u64,
        /// CPUs the job gets on this node; 0 when the hook could not tell,
        /// which takes back every CPU.
        cpus: u32,
        /// Grace period, milliseconds.
        grace_ms: u64,
    },
    /// Slurm's epilog: job `job_id` ended on this node. Offer what Slurm
    /// has not allocated to another job. Answered with
    /// [`LocalReply::Done`].
    SlurmOffer {
        /// The Slurm job that ended.
        job_id: u64,
    },
    /// The SPANK plugin, as a job step started with `--rfaas` begins on
    /// this node: what to put in the job's environment so that its client
    /// can lease (manager URLs and a credential scoped to the job, which a
    /// manager mints at the node's request). Answered with
    /// [`LocalReply::JobEnv`]; refused when the node has no manager or
    /// Slurm does not run job `job_id` here for user `uid`.
    SlurmJobEnv {
        /// The Slurm job.
        job_id: u64,
        /// The job's user id.
        uid: u32,
    },
}

/// What one lease used on one node, over all its allocations there: the
/// executor daemon's cumulative figures. Every figure only grows, while the
/// lease runs and after it ended.
///
/// `cpu_ns` is the kernel's CPU time of the lease's workers (from their
/// assignment on); `hot_ns` and `compute_ns` split it (`hot_ns +
/// compute_ns == cpu_ns`) as the workers reported it, bounded by it.
/// `warm_ns`, `invocations` and the bytes are the workers' word, bounded
/// by what the daemon knows (see `docs/executor.md`, "What the executor
/// measures").
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct LeaseUsage {
    /// The lease's id.
    pub lease_id: u64,
    /// The node (this executor's `node_name`, as the lease names it).
    pub node: String,
    /// The lease's user.
    pub user: String,
    /// The account charged.
    pub account: String,
    /// The Slurm job, if the lease names one.
    #[serde(default)]
    pub job_id: Option<u64>,
    /// No allocation of the lease runs now, and every worker it had is
    /// reaped: the figures are final unless the lease allocates again.
    pub ended: bool,
    /// Allocations of the lease metered so far (running and ended).
    pub allocations: u32,
    /// CPU time of the workers as the kernel measures it, ns.
    pub cpu_ns: u64,
    /// The rest of the figures; `alloc_mib_ms` by the daemon's clock.
    #[serde(flatten)]
    pub usage: UsageFigures,
}

impl Serialize for LeaseUsage {
    /// Field by field: `cpu_ns` sits among the usage figures, after
    /// `alloc_mib_ms`, where the JSON has always had it.
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let u = &self.usage;
        let mut m = s.serialize_struct("LeaseUsage", 14 + usize::from(self.job_id.is_some()))?;
        m.serialize_field("lease_id", &self.lease_id)?;
        m.serialize_field("node", &self.node)?;
        m.serialize_field("user", &self.user)?;
        m.serialize_field("account", &self.account)?;
        match &self.job_id {
            Some(job_id) => m.serialize_field("job_id", job_id)?,
            None => m.skip_field("job_id")?,
        }
        m.serialize_field("ended", &self.ended)?;
        m.serialize_field("allocations", &self.allocations)?;
        m.serialize_field("alloc_mib_ms", &u.alloc_mib_ms)?;
        m.serialize_field("cpu_ns", &self.cpu_ns)?;
        m.serialize_field("compute_ns", &u.compute_ns)?;
        m.serialize_field("hot_ns", &u.hot_ns)?;
        m.serialize_field("warm_ns", &u.warm_ns)?;
        m.serialize_field("invocations", &u.invocations)?;
        m.serialize_field("bytes_in", &u.bytes_in)?;
        m.serialize_field("bytes_out", &u.bytes_out)?;
        m.end()
    }
}

/// One allocation, as [`LocalReply::Status`] lists it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AllocationStatus {
    /// Allocation id.
    pub allocation_id: u64,
    /// Lease id.
    pub lease_id: u64,
    /// The lease's user.
    pub user: String,
    /// Worker process id.
    pub pid: u32,
    /// CPUs held.
    pub cpus: Vec<u32>,
    /// Memory held, MiB.
    pub memory_mib: u32,
}

/// Daemon → node tool.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "reply", rename_all = "snake_case")]
#[non_exhaustive]
pub enum LocalReply {
    /// The answer to [`LocalRequest::Status`].
    Status {
        /// This node's name.
        node: String,
        /// Whether allocations are refused.
        draining: bool,
        /// Every configured CPU.
        cpus: Vec<u32>,
        /// CPUs not held by an allocation.
        free_cpus: Vec<u32>,
        /// Configured memory, MiB.
        memory_mib: u32,
        /// Memory not held, MiB.
        free_memory_mib: u32,
        /// Pre-spawned workers waiting.
        pool_idle: u32,
        /// Running allocations.
        allocations: Vec<AllocationStatus>,
    },
    /// The command was done.
    Done {
        /// What happened, for people.
        message: String,
    },
    /// The answer to [`LocalRequest::Usage`].
    Usage {
        /// This node's name.
        node: String,
        /// Leases running now or ended recently, by lease id.
        leases: Vec<LeaseUsage>,
    },
    /// The answer to [`LocalRequest::SlurmJobEnv`]: variables for the
    /// job's environment, named in [`JOB_ENV_VARS`].
    JobEnv {
        /// Name → value.
        vars: BTreeMap<String, String>,
        /// When the credential expires, Unix seconds.
        expires_at: u64,
    },
}

message_kinds! {
    LocalRequest => LocalRequest,
    LocalReply => LocalReply,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::{Frame, FrameLimits};

    /// The Slurm hooks' requests, byte for byte: header (kind 32) and JSON.
    #[test]
    fn slurm_request_bytes() {
        let cases = [
            (
                LocalRequest::SlurmRetrieve {
                    job_id: 42,
                    cpus: 4,
                    grace_ms: 30_000,
                },
                &br#"{"command":"slurm_retrieve","job_id":42,"cpus":4,"grace_ms":30000}"#[..],
            ),
            (
                LocalRequest::SlurmOffer { job_id: 42 },
                &br#"{"command":"slurm_offer","job_id":42}"#[..],
            ),
            (
                LocalRequest::SlurmJobEnv {
                    job_id: 42,
                    uid: 1000,
                },
                &br#"{"command":"slurm_job_env","job_id":42,"uid":1000}"#[..],
            ),
        ];
        for (req, json) in cases {
            let mut want = vec![b'R', b'F', b'A', b'X', 2, 0, 32, 0];
            want.extend_from_slice(&(json.len() as u32).to_le_bytes());
            want.extend_from_slice(&[0, 0, 0, 0]);
            want.extend_from_slice(json);
            let frame = Frame::new(&req, vec![]);
            assert_eq!(frame.to_bytes(), want, "{req:?}");
            let back = Frame::read_from(&mut &want[..], FrameLimits::default()).unwrap();
            assert_eq!(back.parse::<LocalRequest>().unwrap(), req);
        }
        let reply = LocalReply::JobEnv {
            vars: [("RFAAS_CREDENTIAL".to_string(), "rfaasc.ab.cd".to_string())].into(),
            expires_at: 7,
        };
        assert_eq!(
            serde_json::to_string(&reply).unwrap(),
            r#"{"reply":"job_env","vars":{"RFAAS_CREDENTIAL":"rfaasc.ab.cd"},"expires_at":7}"#
        );
        // A field missing is refused, not defaulted: a retrieval without
        // its grace must not become one without grace.
        assert!(serde_json::from_str::<LocalRequest>(
            r#"{"command":"slurm_retrieve","job_id":1,"cpus":2}"#
        )
        .is_err());
    }

    /// A lease in a Slurm job names it after its account, as the
    /// derived encoding did; the figures follow in their usual order.
    #[test]
    fn lease_usage_with_a_job_names_it() {
        let usage = LeaseUsage {
            lease_id: 1,
            node: "n".into(),
            user: "u".into(),
            account: "a".into(),
            job_id: Some(42),
            ended: false,
            allocations: 1,
            cpu_ns: 3,
            usage: UsageFigures {
                compute_ns: 2,
                hot_ns: 1,
                ..UsageFigures::default()
            },
        };
        let json = serde_json::to_string(&usage).unwrap();
        assert_eq!(
            json,
            r#"{"lease_id":1,"node":"n","user":"u","account":"a","job_id":42,"ended":false,"allocations":1,"alloc_mib_ms":0,"cpu_ns":3,"compute_ns":2,"hot_ns":1,"warm_ns":0,"invocations":0,"bytes_in":0,"bytes_out":0}"#
        );
        assert_eq!(serde_json::from_str::<LeaseUsage>(&json).unwrap(), usage);
    }

    #[test]
    fn usage_reply_json() {
        let reply = LocalReply::Usage {
            node: "n1".into(),
            leases: vec![LeaseUsage {
                lease_id: 7,
                node: "n1".into(),
                user: "alice".into(),
                account: "physics".into(),
                job_id: None,
                ended: true,
                allocations: 2,
                cpu_ns: 10,
                usage: UsageFigures {
                    alloc_mib_ms: 1,
                    compute_ns: 6,
                    hot_ns: 4,
                    warm_ns: 3,
                    invocations: 5,
                    bytes_in: 8,
                    bytes_out: 9,
                },
            }],
        };
        let json = serde_json::to_string(&reply).unwrap();
        assert_eq!(
            json,
            r#"{"reply":"usage","node":"n1","leases":[{"lease_id":7,"node":"n1","user":"alice","account":"physics","ended":true,"allocations":2,"alloc_mib_ms":1,"cpu_ns":10,"compute_ns":6,"hot_ns":4,"warm_ns":3,"invocations":5,"bytes_in":8,"bytes_out":9}]}"#
        );
        assert_eq!(serde_json::from_str::<LocalReply>(&json).unwrap(), reply);
    }
}

//! The node tools' unix socket: status, drain, resume, usage, and the
//! Slurm hooks' take-back and offer ([`super::slurm`]). The connection
//! loop ([`super::server`]) reads the frames; each request runs on a
//! request thread (a drain, which waits out its grace period, on a thread
//! of its own).

use std::sync::Arc;
use std::time::{Duration, Instant};

use rfaas_proto::control::local::{AllocationStatus, LocalReply, LocalRequest};
use rfaas_proto::control::{ErrorCode, Frame, FrameLimits, Kind};

use super::outbox::DoneGuard;
use super::process;
use super::refusal::refusal;
use super::shared::Shared;

/// Limits for the node tools' frames: small JSON, no blob.
pub(crate) const LIMITS: FrameLimits = FrameLimits {
    max_json: 64 << 10,
    max_blob: 0,
};

/// What the loop does with a node tool's message.
pub(crate) enum LocalNext {
    /// Send this answer.
    Reply(Frame),
    /// Run this on a request thread; it answers itself.
    Job(super::pool::Job),
    /// Run this on a thread of its own (it may take long).
    Long(super::pool::Job),
}

/// Decides about one message of local connection `conn`.
pub(crate) fn message(shared: &Arc<Shared>, conn: u64, kind: Kind, json: Vec<u8>) -> LocalNext {
    let frame = Frame {
        kind,
        json,
        blob: Vec::new(),
    };
    let req = match frame.parse::<LocalRequest>() {
        Ok(r) => r,
        Err(e) => return LocalNext::Reply(refusal(0, ErrorCode::MalformedRequest, e.to_string())),
    };
    tracing::info!(request = ?req, "local request");
    let long = matches!(
        req,
        LocalRequest::Drain { .. } | LocalRequest::SlurmRetrieve { .. }
    );
    let shared = Arc::clone(shared);
    let job: super::pool::Job = Box::new(move || {
        let _done = DoneGuard::new(&shared.outbox, conn, 0);
        let frame = match req {
            LocalRequest::SlurmJobEnv { job_id, uid } => {
                match super::jobs::job_env(&shared, job_id, uid) {
                    Ok(reply) => Frame::new(&reply, Vec::new()),
                    Err(e) => {
                        tracing::warn!(job_id, uid, error = %e, "no job credential");
                        refusal(0, e.code(), e.to_string())
                    }
                }
            }
            req => Frame::new(&handle(&shared, req), Vec::new()),
        };
        shared.send(conn, &frame);
    });
    if long {
        LocalNext::Long(job)
    } else {
        LocalNext::Job(job)
    }
}

/// Carries out one request.
pub(crate) fn handle(shared: &Arc<Shared>, req: LocalRequest) -> LocalReply {
    match req {
        LocalRequest::Status => status(shared),
        LocalRequest::Drain { grace_ms } => LocalReply::Done {
            message: drain(shared, Duration::from_millis(grace_ms)),
        },
        LocalRequest::Resume => {
            let was = std::mem::replace(&mut shared.lock().draining, false);
            shared.refill();
            tracing::info!("taking allocations again");
            LocalReply::Done {
                message: if was {
                    "resumed: taking allocations again".into()
                } else {
                    "was not draining: taking allocations".into()
                },
            }
        }
        LocalRequest::SlurmRetrieve {
            job_id,
            cpus,
            grace_ms,
        } => {
            let taken =
                super::slurm::retrieve(shared, job_id, cpus, Duration::from_millis(grace_ms));
            // The hook has its answer; what is left settles on its own.
            drop(taken.settling);
            LocalReply::Done {
                message: taken.message,
            }
        }
        LocalRequest::SlurmOffer { job_id } => {
            super::jobs::job_ended(shared, job_id);
            LocalReply::Done {
                message: super::slurm::offer(shared, job_id),
            }
        }
        LocalRequest::Usage { lease_id } => LocalReply::Usage {
            node: shared.settings.node_name.clone(),
            leases: match lease_id {
                Some(id) => shared.usage.lease(id).into_iter().collect(),
                None => shared.usage.snapshot(),
            },
        },
        _ => LocalReply::Done {
            message: "this executor does not know that command".into(),
        },
    }
}

fn status(shared: &Shared) -> LocalReply {
    let st = shared.lock();
    LocalReply::Status {
        node: shared.settings.node_name.clone(),
        draining: st.draining,
        cpus: st.capacity.cpus().to_vec(),
        free_cpus: st.capacity.free_cpus(),
        memory_mib: st.capacity.memory_mib(),
        free_memory_mib: st.capacity.free_memory_mib(),
        pool_idle: st.pool.len() as u32,
        allocations: st
            .allocations
            .values()
            .map(|a| AllocationStatus {
                allocation_id: a.id,
                lease_id: a.lease_id,
                user: a.user.clone(),
                pid: a.pid.unwrap_or(0),
                cpus: a.cpus.clone(),
                memory_mib: a.memory_mib,
            })
            .collect(),
    }
}

/// Refuses new allocations at once, tells every worker to refuse new
/// invocations (SIGUSR1), waits up to `grace` for allocations to end, then
/// stops the rest. Returns what it did, for people.
fn drain(shared: &Shared, grace: Duration) -> String {
    let start = Instant::now();
    let mut st = shared.lock();
    st.draining = true;
    shared.empty_pool(&mut st);
    let mut told = 0;
    for a in st.allocations.values() {
        if let Some(pid) = a.pid {
            // Under bubblewrap the pid is bwrap's; the worker is below it.
            for p in std::iter::once(pid).chain(process::descendants(pid)) {
                process::signal(p, libc::SIGUSR1);
            }
            told += 1;
        }
    }
    let targets: Vec<u64> = st.allocations.keys().copied().collect();
    let ending = st.ending(&targets);
    drop(st);
    tracing::info!(
        workers = told,
        grace_ms = grace.as_millis() as u64,
        "draining"
    );
    let taken = shared.take_back(&targets, &ending, grace, start);
    let message = format!("drained {}", taken.describe(""));
    taken.log("drain done", &message);
    message
}

//! Capacity: the allocation's cores and memory, taken under the state lock
//! together with the checks that must see the same state.

use std::sync::Arc;

use rfaas_proto::control::client::AllocateRequest;
use rfaas_proto::control::ErrorCode;
use rfaas_proto::lease::LeaseClaims;
use rfaas_proto::text::count;

use crate::daemon::capacity::Refusal;
use crate::daemon::config::Settings;
use crate::daemon::process;
use crate::daemon::refusal::Refused;
use crate::daemon::shared::Shared;
use crate::daemon::state::{Allocation, State};
use crate::daemon::users::{self, User};

/// A starting allocation: its id, the CPUs and memory it holds, and the
/// user its worker runs as.
#[derive(Debug)]
pub(super) struct Reserved {
    pub id: u64,
    pub cpus: Vec<u32>,
    pub user: User,
    pub runtime_dir: std::path::PathBuf,
}

/// Takes the cores and memory for `req` and records the starting
/// allocation, or refuses: capacity, then draining, then the user, then the
/// library's ELF magic (the order docs/invocation.md gives).
pub(super) fn reserve(
    shared: &Arc<Shared>,
    conn_id: u64,
    req: &AllocateRequest,
    claims: &LeaseClaims,
    library: &[u8],
) -> Result<Reserved, Refused> {
    let s = &shared.settings;
    // Looked up before the lock (the user database may be slow); reported
    // in the documented order.
    let user = check_user(&claims.user, s);
    let elf_ok = library.starts_with(b"\x7fELF");

    // Drawn before the lock; without one the allocation cannot be taken
    // up again after a restart, and is otherwise as good.
    let attach_secret = rfaas_proto::hello::LaneKey::random()
        .map(|k| k.to_hex())
        .unwrap_or_default();
    let id = shared.next_id();
    let runtime_dir = s.runtime_dir.join(format!("alloc-{id}"));
    let mut st = shared.lock();
    let draining = st.draining;
    let cpus = st
        .capacity
        .grant(
            claims.lease_id,
            claims.cores,
            claims.memory_mib,
            req.cores,
            req.memory_mib,
        )
        .map_err(|r| match r {
            Refusal::ExceedsLease { message, held } => {
                beyond_lease(shared, &st, claims, req, held, message, &s.node_name)
            }
            // A node taken back whole has no free CPU; "draining" says
            // more than "full".
            Refusal::NoCapacity(_) if draining => draining_refusal(&st, &s.node_name),
            Refusal::NoCapacity(m) => (ErrorCode::NoCapacity, m),
        })?;
    let refuse = |st: &mut State, (code, m): Refused| {
        st.capacity.release(claims.lease_id, &cpus, req.memory_mib);
        Err((code, m))
    };
    if st.ended_leases.contains_key(&claims.lease_id) {
        return refuse(&mut st, ended_lease_refusal(claims.lease_id));
    }
    if st.draining {
        let refused = draining_refusal(&st, &s.node_name);
        return refuse(&mut st, refused);
    }
    let user = match user {
        Ok(u) => u,
        Err(m) => return refuse(&mut st, (ErrorCode::UserRefused, m)),
    };
    if !elf_ok {
        return refuse(
            &mut st,
            (
                ErrorCode::MalformedLibrary,
                format!(
                    "the library {:?} is not an ELF shared object (it does not start with \\x7fELF); send the .so file's bytes",
                    req.library_name
                ),
            ),
        );
    }
    st.allocations.insert(
        id,
        Allocation {
            id,
            lease_id: claims.lease_id,
            user: claims.user.clone(),
            conn_id,
            pid: None,
            worker_sock: None,
            cpus: cpus.clone(),
            memory_mib: req.memory_mib,
            expires_at: claims.expires_at,
            mode: req.mode,
            ready: false,
            stop: None,
            ended: None,
            runtime_dir: runtime_dir.clone(),
            attach_secret,
            attach_by: None,
        },
    );
    drop(st);
    tracing::info!(
        allocation = id,
        lease = claims.lease_id,
        user = %user.name,
        cores = req.cores,
        memory_mib = req.memory_mib,
        cpus = ?cpus,
        library = %req.library_name,
        "allocation granted"
    );
    Ok(Reserved {
        id,
        cpus,
        user,
        runtime_dir,
    })
}

/// The refusal of a request beyond what lease `claims` grants here, where
/// its allocations hold `held` (cores, MiB). When it fits once the lease's
/// ending allocations are reaped (their cores are free only then), the
/// refusal is the retryable `allocation_ending`, unless the lease has
/// ended or the node drains, which retrying would not change; otherwise
/// `exceeds_lease` with `message`.
fn beyond_lease(
    shared: &Shared,
    st: &State,
    claims: &LeaseClaims,
    req: &AllocateRequest,
    held: (u32, u64),
    message: String,
    node: &str,
) -> Refused {
    let (ids, cores, mib) = ending(st, claims.lease_id, |a| {
        shared.usage.crashed(a.id).is_some() || a.pid.is_some_and(process::is_exiting)
    });
    let fits = held.0.saturating_sub(cores) + u32::from(req.cores) <= u32::from(claims.cores)
        && held.1.saturating_sub(mib) + u64::from(req.memory_mib) <= u64::from(claims.memory_mib);
    if ids.is_empty() || !fits {
        return (ErrorCode::ExceedsLease, message);
    }
    if st.ended_leases.contains_key(&claims.lease_id) {
        return ended_lease_refusal(claims.lease_id);
    }
    if st.draining {
        return draining_refusal(st, node);
    }
    let (them, are, hold) = match ids.as_slice() {
        [id] => (format!("allocation {id}"), "is", "holds"),
        _ => (format!("allocations {ids:?}"), "are", "hold"),
    };
    (
        ErrorCode::AllocationEnding,
        format!(
            "lease {}'s {them} here {are} ending (stopped, or crashed and exiting) and {hold} {} and {mib} MiB until reaped; the request fits once that is free: retry in a moment",
            claims.lease_id,
            count(cores, "core"),
        ),
    )
}

/// The allocations of lease `lease_id` that are ending, and the cores and
/// MiB they hold until their workers are reaped: the daemon decided to
/// end them, their worker ended before it was ready, or `dying` says so
/// (a crash the worker marked, a process that is exiting).
fn ending(st: &State, lease_id: u64, dying: impl Fn(&Allocation) -> bool) -> (Vec<u64>, u32, u64) {
    let mut out = (Vec::new(), 0u32, 0u64);
    for a in st.allocations.values().filter(|a| a.lease_id == lease_id) {
        if a.stop.is_some() || a.ended.is_some() || dying(a) {
            out.0.push(a.id);
            out.1 += a.cpus.len() as u32;
            out.2 += u64::from(a.memory_mib);
        }
    }
    out
}

/// The refusal of a lease the manager ended.
fn ended_lease_refusal(lease_id: u64) -> Refused {
    (
        ErrorCode::TokenExpired,
        format!(
            "lease {lease_id} was ended by the manager (released or revoked) before its expiry; request a new lease"
        ),
    )
}

/// The refusal of a draining (or stopping) executor.
fn draining_refusal(st: &State, node: &str) -> Refused {
    let why = if st.stopping {
        "is shutting down"
    } else {
        "is draining (its node is being retrieved)"
    };
    (
        ErrorCode::Draining,
        format!("executor {node} {why}; allocate elsewhere"),
    )
}

/// Whether workers may run as `name` here: a user the node knows, not
/// root, not in `deny_users`, not below `min_worker_uid`.
fn check_user(name: &str, s: &Settings) -> Result<User, String> {
    let node = &s.node_name;
    let user = match users::lookup(name) {
        Ok(Some(u)) => u,
        Ok(None) => {
            return Err(format!(
                "the lease's user {name:?} does not exist on node {node}; the node's user database must know every job user"
            ))
        }
        Err(e) => return Err(format!("cannot look up the lease's user {name:?}: {e}")),
    };
    if user.uid == 0 {
        return Err(format!(
            "the lease's user {name:?} is root (uid 0); workers never run as root"
        ));
    }
    let uid = user.uid.to_string();
    if s.deny_users.iter().any(|d| *d == user.name || *d == uid) {
        return Err(format!(
            "the lease's user {name:?} (uid {uid}) is in node {node}'s deny_users; workers never run as it"
        ));
    }
    if user.uid < s.min_worker_uid {
        return Err(format!(
            "the lease's user {name:?} has uid {uid}, below node {node}'s min_worker_uid {} (a system account); workers run only as people's accounts",
            s.min_worker_uid
        ));
    }
    let euid = users::effective_uid();
    if euid != 0 && user.uid != euid {
        return Err(format!(
            "this executor runs as uid {euid}, not root, so it can run workers only as itself, not as {name:?} (uid {}); run rfaas-executord as root",
            user.uid
        ));
    }
    Ok(user)
}

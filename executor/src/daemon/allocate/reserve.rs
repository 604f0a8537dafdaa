//! Capacity: the allocation's cores and memory, taken under the state lock
//! together with the checks that must see the same state.

use std::sync::Arc;

use rfaas_proto::control::{AllocateRequest, ErrorCode};
use rfaas_proto::lease::LeaseClaims;

use super::Refused;
use crate::daemon::capacity::Refusal;
use crate::daemon::state::{Allocation, Shared, State};
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
    let user = check_user(&claims.user, &s.node_name);
    let elf_ok = library.starts_with(b"\x7fELF");

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
            Refusal::ExceedsLease(m) => (ErrorCode::ExceedsLease, m),
            // A node taken back whole has no free CPU; "draining" says
            // more than "full".
            Refusal::NoCapacity(_) if draining => draining_refusal(&st, &s.node_name),
            Refusal::NoCapacity(m) => (ErrorCode::NoCapacity, m),
        })?;
    let refuse = |st: &mut State, code, m| {
        st.capacity.release(claims.lease_id, &cpus, req.memory_mib);
        Err((code, m))
    };
    if st.ended_leases.contains_key(&claims.lease_id) {
        return refuse(
            &mut st,
            ErrorCode::TokenExpired,
            format!(
                "lease {} was ended by the manager (released or revoked) before its expiry; request a new lease",
                claims.lease_id
            ),
        );
    }
    if st.draining {
        let (code, m) = draining_refusal(&st, &s.node_name);
        return refuse(&mut st, code, m);
    }
    let user = match user {
        Ok(u) => u,
        Err(m) => return refuse(&mut st, ErrorCode::UserRefused, m),
    };
    if !elf_ok {
        return refuse(
            &mut st,
            ErrorCode::MalformedLibrary,
            format!(
                "the library {:?} is not an ELF shared object (it does not start with \\x7fELF); send the .so file's bytes",
                req.library_name
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

/// Whether workers may run as `name` here.
fn check_user(name: &str, node: &str) -> Result<User, String> {
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
    let euid = users::effective_uid();
    if euid != 0 && user.uid != euid {
        return Err(format!(
            "this executor runs as uid {euid}, not root, so it can run workers only as itself, not as {name:?} (uid {}); run rfaas-executord as root",
            user.uid
        ));
    }
    Ok(user)
}

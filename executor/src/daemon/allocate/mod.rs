//! One allocation, step by step: the checks of docs/invocation.md in their
//! documented order, then a worker.
//!
//! - [`validate`]: the request's own shape and the executor's limits.
//! - [`lease`]: the token, and the request against what it grants.
//! - [`memory`]: the least memory the worker needs, with the library.
//! - [`reserve`]: cores and memory taken under the state lock, with the
//!   checks that must see the same state (draining, the user, the library).
//! - [`spawn`]: the worker: runtime directory, memory limit, pooled or fresh
//!   process, its assignment and its answer.

mod lease;

pub(crate) use lease::refusal as lease_refusal;
mod memory;
mod reserve;
mod spawn;
mod validate;

use std::sync::Arc;
use std::time::Instant;

use rfaas_proto::control::client::{AllocateOk, AllocatePhases, AllocateRequest};
use rfaas_proto::control::ErrorCode;
use rfaas_proto::hello::LaneKey;
use rfaas_proto::lease::LeaseClaims;

use super::refusal::Refused;
use super::shared::Shared;

/// A request that passed every check that needs neither the library's
/// bytes nor the node's state.
#[derive(Debug)]
pub(crate) struct Checked {
    claims: LeaseClaims,
    deadline_ms: u64,
    check_ns: u64,
}

/// The checks made before the library is read (so a client without a
/// valid lease never makes the daemon hold its library): the request's
/// shape and provider, the token, the request against the lease, the
/// executor's limits (the library's size from its frame header).
pub(crate) fn check(
    shared: &Shared,
    req: &AllocateRequest,
    library_len: u32,
) -> Result<Checked, Refused> {
    let started = Instant::now();
    let s = &shared.settings;
    validate::request(req, s)?;
    let claims = lease::check(req, &shared.lease_keys, s)?;
    let deadline_ms = validate::limits(req, library_len, s)?;
    Ok(Checked {
        claims,
        deadline_ms,
        check_ns: started.elapsed().as_nanos() as u64,
    })
}

/// Takes capacity for a [`check`]ed request and starts its worker with
/// `library`; the reply for the client either way.
pub(crate) fn start(
    shared: &Arc<Shared>,
    conn_id: u64,
    req: &AllocateRequest,
    checked: Checked,
    library: &[u8],
) -> Result<AllocateOk, Refused> {
    let started = Instant::now();
    let Checked {
        claims,
        deadline_ms,
        check_ns,
    } = checked;
    let max_pull = memory::check(req, library)?;
    let reserved = reserve::reserve(shared, conn_id, req, &claims, library)?;
    let validate_ns = check_ns + started.elapsed().as_nanos() as u64;
    let started_worker = Instant::now();
    let lane_key = match LaneKey::random() {
        Ok(k) => k.to_hex(),
        Err(e) => {
            let refused = (
                ErrorCode::Internal,
                format!("the executor cannot draw a lane key from /dev/urandom: {e}; retry"),
            );
            return Err(spawn::abandon(shared, reserved.id, refused));
        }
    };
    let (ready, pooled) = spawn::start_worker(
        shared,
        &reserved,
        req,
        library,
        &spawn::Terms {
            claims: &claims,
            deadline_ms,
            expires_at: claims.expires_at,
            lane_key: &lane_key,
            max_pull,
        },
    )
    .map_err(|refused| spawn::abandon(shared, reserved.id, refused))?;
    let worker_ns = started_worker.elapsed().as_nanos() as u64;
    let attach_secret = if shared.settings.workers_outlive() {
        shared
            .lock()
            .allocations
            .get(&reserved.id)
            .map(|a| a.attach_secret.clone())
            .unwrap_or_default()
    } else {
        String::new()
    };
    Ok(AllocateOk {
        attach_secret,
        request_id: req.request_id,
        allocation_id: reserved.id,
        lease_id: claims.lease_id,
        fabric_addr: ready.fabric_addr,
        lanes: ready.lanes,
        slots: if req.slot_count() > 1 {
            req.slot_count()
        } else {
            0
        },
        slot_stride: ready.slot_stride,
        lane_key,
        functions: req.functions.clone(),
        output_capacity: req.output_capacity,
        deadline_ms,
        expires_at: claims.expires_at,
        pooled,
        phases: AllocatePhases {
            validate_ns,
            worker_ns: worker_ns.saturating_sub(ready.load_ns + ready.listen_ns),
            load_ns: ready.load_ns,
            listen_ns: ready.listen_ns,
        },
        // A payload that fits the input buffer is never pulled.
        max_input_bytes: max_pull.max(
            u64::from(req.input_capacity).saturating_sub(rfaas_proto::InvocationHeader::LEN as u64),
        ),
    })
}

//! Lease renewal: a running allocation's end moved to that of a new token
//! for its lease, on the connection that made it. The worker is told
//! first, so it serves until the new end as soon as the client hears of
//! it; a refusal leaves the allocation as it was.

use std::time::{Duration, Instant};

use rfaas_proto::control::client::{LeaseRenewed, RenewLease};
use rfaas_proto::control::worker::ExpiryMoved;
use rfaas_proto::control::{ErrorCode, Frame, FrameLimits, Kind};

use super::allocate::lease_refusal;
use super::clock::unix_now;
use super::refusal::{refusal, Refused};
use super::shared::Shared;
use super::state::Allocation;
use crate::ipc;

/// How long the worker has to acknowledge a new end.
const WORKER_ANSWER: Duration = Duration::from_secs(5);

/// The answer to `r`, from control connection `conn`.
pub(crate) fn renew(shared: &Shared, conn: u64, r: &RenewLease) -> Frame {
    match try_renew(shared, conn, r) {
        Ok(expires_at) => {
            tracing::info!(allocation = r.allocation_id, expires_at, "lease renewed");
            Frame::new(
                &LeaseRenewed {
                    request_id: r.request_id,
                    allocation_id: r.allocation_id,
                    expires_at,
                },
                Vec::new(),
            )
        }
        Err((code, message)) => {
            tracing::info!(allocation = r.allocation_id, ?code, %message, "renewal refused");
            refusal(r.request_id, code, message)
        }
    }
}

fn try_renew(shared: &Shared, conn: u64, r: &RenewLease) -> Result<u64, Refused> {
    let id = r.allocation_id;
    let gone = || {
        (
            ErrorCode::UnknownAllocation,
            format!("allocation {id} is not running on this connection (it ended, or was made on another connection); nothing was renewed"),
        )
    };
    let running = |a: &&Allocation| a.conn_id == conn && a.ready && a.stop.is_none();
    // A connection without allocations costs no signature check.
    if !shared
        .lock()
        .allocations
        .get(&id)
        .is_some_and(|a| running(&a))
    {
        return Err(gone());
    }
    let claims = shared
        .lease_keys
        .verify(&r.token, unix_now(), &shared.settings.node_name)
        .map_err(lease_refusal)?;
    let sock = {
        let st = shared.lock();
        let a = st.allocations.get(&id).filter(running).ok_or_else(gone)?;
        if claims.lease_id != a.lease_id {
            return Err((
                ErrorCode::LeaseMismatch,
                format!(
                    "the token is for lease {}, but allocation {id} runs under lease {}; renew it with a token for lease {}",
                    claims.lease_id, a.lease_id, a.lease_id
                ),
            ));
        }
        if claims.expires_at < a.expires_at {
            return Err((
                ErrorCode::LeaseMismatch,
                format!(
                    "the token ends at {} (Unix seconds), before allocation {id}'s current end {}; a renewal cannot shorten a lease: use the manager's latest token",
                    claims.expires_at, a.expires_at
                ),
            ));
        }
        if st.ended_leases.contains_key(&claims.lease_id) {
            return Err((
                ErrorCode::TokenExpired,
                format!(
                    "lease {} was ended by the manager (released or revoked); request a new lease",
                    claims.lease_id
                ),
            ));
        }
        if claims.expires_at == a.expires_at {
            return Ok(a.expires_at);
        }
        a.worker_sock
            .as_ref()
            .and_then(|s| s.try_clone().ok())
            .ok_or_else(|| {
                (
                    ErrorCode::Internal,
                    format!("the executor cannot reach allocation {id}'s worker; retry"),
                )
            })?
    };
    // Outside the lock: the worker runs user code and may be slow to answer.
    tell_worker(&sock, claims.expires_at).map_err(|e| {
        (
            ErrorCode::Internal,
            format!("allocation {id}'s worker did not take the new end: {e}; retry"),
        )
    })?;
    let mut st = shared.lock();
    let a = st
        .allocations
        .get_mut(&id)
        .filter(|a| a.stop.is_none())
        .ok_or_else(gone)?;
    a.expires_at = a.expires_at.max(claims.expires_at);
    shared.usage.renewed(claims.lease_id, a.expires_at);
    Ok(a.expires_at)
}

/// Sends the worker its new end and waits for its echo (skipping a late
/// echo of an earlier renewal that timed out).
fn tell_worker(sock: &std::os::unix::net::UnixStream, expires_at: u64) -> std::io::Result<()> {
    let until = Instant::now() + WORKER_ANSWER;
    sock.set_write_timeout(Some(WORKER_ANSWER))?;
    ipc::send_frame(sock, &Frame::new(&ExpiryMoved { expires_at }, vec![]), &[])?;
    let limits = FrameLimits {
        max_json: 4096,
        max_blob: 0,
    };
    loop {
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(std::io::ErrorKind::TimedOut.into());
        }
        sock.set_read_timeout(Some(left))?;
        let (frame, _) = ipc::recv_frame(sock, limits).map_err(std::io::Error::other)?;
        if frame.kind != Kind::ExpiryMoved {
            return Err(std::io::Error::other(format!(
                "it answered a {:?} message",
                frame.kind
            )));
        }
        let echo: ExpiryMoved = frame.parse().map_err(std::io::Error::other)?;
        if echo.expires_at == expires_at {
            return Ok(());
        }
    }
}

//! The lease check: the token's signature, expiry and node, and the request
//! against what the lease grants.

use rfaas_proto::control::client::AllocateRequest;
use rfaas_proto::control::ErrorCode;
use rfaas_proto::lease::{LeaseClaims, LeaseKeys, TokenError};
use rfaas_proto::text::count;

use crate::daemon::clock::unix_now;
use crate::daemon::config::Settings;
use crate::daemon::refusal::Refused;

/// The lease's claims, if its token is good for this node now and the
/// request fits in what it grants.
pub(super) fn check(
    req: &AllocateRequest,
    keys: &LeaseKeys,
    s: &Settings,
) -> Result<LeaseClaims, Refused> {
    let claims = keys
        .verify(&req.token, unix_now(), &s.node_name)
        .map_err(refusal)?;
    if req.cores > claims.cores || req.memory_mib > claims.memory_mib {
        return Err((
            ErrorCode::ExceedsLease,
            format!(
                "the request asks for {} and {} MiB, but lease {} grants {} and {} MiB; ask for less or get a bigger lease",
                count(req.cores, "core"), req.memory_mib, claims.lease_id, count(claims.cores, "core"), claims.memory_mib
            ),
        ));
    }
    Ok(claims)
}

/// The control channel's code and sentence for a refused token.
pub(crate) fn refusal(e: TokenError) -> Refused {
    let code = match e {
        TokenError::Forged { .. } => ErrorCode::TokenForged,
        TokenError::Expired { .. } => ErrorCode::TokenExpired,
        TokenError::WrongNode { .. } => ErrorCode::TokenWrongNode,
        _ => ErrorCode::TokenMalformed,
    };
    (code, e.to_string())
}

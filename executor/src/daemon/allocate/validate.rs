//! The request's own shape, and the executor's limits on it: checks that
//! need neither the token nor the node's state.

use rfaas_proto::control::client::AllocateRequest;
use rfaas_proto::control::ErrorCode;

use crate::daemon::config::Settings;
use crate::daemon::refusal::Refused;

/// What a request must say to be a request at all, and a provider this
/// executor serves.
pub(super) fn request(req: &AllocateRequest, s: &Settings) -> Result<(), Refused> {
    let malformed = |m: String| Err((ErrorCode::MalformedRequest, m));
    if req.cores == 0 {
        return malformed("the request asks for 0 cores; ask for at least one".into());
    }
    if req.functions.is_empty() {
        return malformed("the request names no functions; list the symbols to call".into());
    }
    if (req.input_capacity as usize) < rfaas_proto::InvocationHeader::LEN {
        return malformed(format!(
            "input_capacity {} cannot hold the {}-byte invocation header",
            req.input_capacity,
            rfaas_proto::InvocationHeader::LEN
        ));
    }
    if let Some(why) = rfaas_proto::control::client::slots_refusal(req.slots) {
        return malformed(why);
    }
    if !s.providers.contains(&req.provider) {
        return Err((
            ErrorCode::ProviderUnsupported,
            format!(
                "this executor serves the fabric providers {:?}, not {:?}; use one of them",
                s.providers, req.provider
            ),
        ));
    }
    Ok(())
}

/// The executor's limits on sizes, lanes and the deadline. Returns the
/// deadline in force (the executor's default for 0).
pub(super) fn limits(
    req: &AllocateRequest,
    library_len: u32,
    s: &Settings,
) -> Result<u64, Refused> {
    let deadline_ms = if req.deadline_ms == 0 {
        s.default_deadline_ms
    } else {
        req.deadline_ms
    };
    let checks = [
        (
            "the library size in bytes",
            library_len.into(),
            u64::from(s.max_library_bytes),
        ),
        (
            "the number of lanes",
            req.lane_count().into(),
            s.max_lanes.into(),
        ),
        (
            "input_capacity",
            req.input_capacity.into(),
            s.max_input_capacity.into(),
        ),
        (
            "output_capacity",
            req.output_capacity.into(),
            s.max_output_capacity.into(),
        ),
        ("deadline_ms", deadline_ms, s.max_deadline_ms),
    ];
    for (what, asked, limit) in checks {
        if asked > limit {
            return Err((
                ErrorCode::TooLarge,
                format!("{what} is {asked}, this executor allows at most {limit}"),
            ));
        }
    }
    Ok(deadline_ms)
}

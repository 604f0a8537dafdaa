//! A refused request: the code and sentence a check gives ([`Refused`]),
//! and the frame that tells the client ([`refusal`]).

use rfaas_proto::control::{ErrorCode, ErrorReply, Frame};

/// A refusal: the code and the sentence for the client.
pub(crate) type Refused = (ErrorCode, String);

/// An [`ErrorReply`] frame. Not logged here: refusals of requests not
/// yet checked are counted in the loop's rate-limited summary instead, so
/// a flood of them does not flood the log.
pub(crate) fn refusal(request_id: u64, code: ErrorCode, message: String) -> Frame {
    Frame::new(
        &ErrorReply {
            request_id,
            code,
            message,
        },
        Vec::new(),
    )
}

//! Work completions: what a completion queue hands back.

use std::fmt;

/// The operation a completion belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Opcode {
    /// A one-sided write finished at the initiator.
    Write = 0,
    /// A write-with-immediate finished at the initiator.
    WriteWithImm = 1,
    /// A one-sided read finished: the local buffer holds the data.
    Read = 2,
    /// A fetch-and-add finished: the local word holds the old value.
    FetchAdd = 3,
    /// A compare-and-swap finished: the local word holds the old value.
    CompareSwap = 4,
    /// At the target: a posted receive consumed a write-with-immediate.
    RecvWithImm = 5,
}

/// How an operation ended. Anything but [`Status::Success`] is an error completion.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Status {
    /// The operation completed.
    Success = 0,
    /// The target refused the access: unknown rkey, an rkey of another
    /// protection domain, a range outside the region, or a missing access
    /// right. The target's memory is untouched.
    RemoteAccess = 1,
    /// The target could not perform a well-formed request (for example an
    /// atomic on an address that is not 8-byte aligned).
    RemoteOperation = 2,
    /// The local buffer given to the operation is not usable.
    LocalProtection = 3,
    /// The connection failed before the operation completed: the peer died,
    /// closed, or stopped answering. Operations posted later fail the same way.
    PeerLost = 4,
    /// The operation was cancelled because the endpoint was closed locally.
    Flushed = 5,
}

impl Status {
    /// Whether this is [`Status::Success`].
    pub fn is_ok(self) -> bool {
        self == Status::Success
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Status::Success => "success",
            Status::RemoteAccess => {
                "remote access error (bad rkey, other domain, out of bounds or missing right)"
            }
            Status::RemoteOperation => "remote operation error (malformed request)",
            Status::LocalProtection => "local protection error",
            Status::PeerLost => "peer lost",
            Status::Flushed => "flushed (endpoint closed)",
        })
    }
}

/// One work completion.
///
/// `byte_len` is the number of bytes transferred: for [`Opcode::RecvWithImm`]
/// the length of the write that carried the immediate, for reads the bytes
/// read. `imm` is meaningful only for [`Opcode::RecvWithImm`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Completion {
    /// The caller's work-request id given when posting.
    pub wr_id: u64,
    /// Which operation completed.
    pub opcode: Opcode,
    /// How it ended.
    pub status: Status,
    /// The immediate value of a received write-with-immediate.
    pub imm: u32,
    /// Bytes transferred.
    pub byte_len: u32,
}

impl Completion {
    /// An all-zero completion, for preallocating poll arrays.
    pub const EMPTY: Completion = Completion {
        wr_id: 0,
        opcode: Opcode::Write,
        status: Status::Success,
        imm: 0,
        byte_len: 0,
    };

    pub(crate) fn ok(wr_id: u64, opcode: Opcode, byte_len: u32) -> Self {
        Completion {
            wr_id,
            opcode,
            status: Status::Success,
            imm: 0,
            byte_len,
        }
    }

    pub(crate) fn error(wr_id: u64, opcode: Opcode, status: Status) -> Self {
        Completion {
            wr_id,
            opcode,
            status,
            imm: 0,
            byte_len: 0,
        }
    }
}

impl Default for Completion {
    fn default() -> Self {
        Completion::EMPTY
    }
}

//! The frame every control message travels in, on every channel: header,
//! kinds, limits and what can be wrong with a frame.

use std::io::{self, Read, Write};

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::VERSION;

/// The first four bytes of every control frame.
pub const MAGIC: [u8; 4] = *b"RFAX";

/// Bytes in a frame header.
pub const FRAME_HEADER_LEN: usize = 16;

/// Which message a frame holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u16)]
#[non_exhaustive]
pub enum Kind {
    /// [`AllocateRequest`](super::client::AllocateRequest), client → executor, blob: the library.
    AllocateRequest = 1,
    /// [`AllocateOk`](super::client::AllocateOk), executor → client.
    AllocateOk = 2,
    /// [`ErrorReply`](super::ErrorReply), executor → client (or daemon → tool).
    Error = 3,
    /// [`Deallocate`](super::client::Deallocate), client → executor.
    Deallocate = 4,
    /// [`Deallocated`](super::client::Deallocated), executor → client.
    Deallocated = 5,
    /// [`WorkerExited`](super::client::WorkerExited), executor → client, unsolicited.
    WorkerExited = 6,
    /// [`RenewLease`](super::client::RenewLease), client → executor.
    RenewLease = 7,
    /// [`LeaseRenewed`](super::client::LeaseRenewed), executor → client.
    LeaseRenewed = 8,
    /// [`Attach`](super::client::Attach), client → executor: take up an
    /// allocation again on a new connection (after the executor restarted).
    Attach = 9,
    /// [`Attached`](super::client::Attached), executor → client.
    Attached = 10,
    /// [`Assignment`](super::worker::Assignment), daemon → pooled worker, with the library's memfd
    /// passed alongside (SCM_RIGHTS).
    Assignment = 16,
    /// [`WorkerReady`](super::worker::WorkerReady), worker → daemon.
    WorkerReady = 17,
    /// [`WorkerFailed`](super::worker::WorkerFailed), worker → daemon: the assignment failed.
    WorkerFailed = 18,
    /// [`ExpiryMoved`](super::worker::ExpiryMoved), daemon → serving worker, and its echo back.
    ExpiryMoved = 19,
    /// [`WorkerRejoin`](super::worker::WorkerRejoin), serving worker → the
    /// daemon that adopts it, with its meter area passed alongside.
    WorkerRejoin = 20,
    /// [`LocalRequest`](super::local::LocalRequest), node tool → daemon (unix socket).
    LocalRequest = 32,
    /// [`LocalReply`](super::local::LocalReply), daemon → node tool.
    LocalReply = 33,
}

impl Kind {
    /// Every kind, in code order.
    pub const ALL: [Kind; 17] = [
        Kind::AllocateRequest,
        Kind::AllocateOk,
        Kind::Error,
        Kind::Deallocate,
        Kind::Deallocated,
        Kind::WorkerExited,
        Kind::RenewLease,
        Kind::LeaseRenewed,
        Kind::Attach,
        Kind::Attached,
        Kind::Assignment,
        Kind::WorkerReady,
        Kind::WorkerFailed,
        Kind::ExpiryMoved,
        Kind::WorkerRejoin,
        Kind::LocalRequest,
        Kind::LocalReply,
    ];

    /// The wire code.
    pub const fn code(self) -> u16 {
        self as u16
    }

    /// The kind with wire code `code`.
    pub fn from_code(code: u16) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| k.code() == code)
    }
}

/// A control message: the JSON body of a frame whose kind is fixed by the
/// message's type, so a frame's kind and its body cannot disagree.
pub trait Message: Serialize + DeserializeOwned {
    /// The frame kind that carries this message.
    const KIND: Kind;
}

/// Implements [`Message`] for each message type of a channel, with its
/// frame kind.
macro_rules! message_kinds {
    ($($ty:ty => $kind:ident),* $(,)?) => {
        $(impl $crate::control::Message for $ty {
            const KIND: $crate::control::Kind = $crate::control::Kind::$kind;
        })*
    };
}
pub(super) use message_kinds;

/// Largest sizes a receiver accepts; bigger frames are refused before their
/// body is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameLimits {
    /// Largest JSON part.
    pub max_json: u32,
    /// Largest blob.
    pub max_blob: u32,
}

impl Default for FrameLimits {
    /// 1 MiB of JSON, 64 MiB of blob.
    fn default() -> Self {
        FrameLimits {
            max_json: 1 << 20,
            max_blob: 64 << 20,
        }
    }
}

/// A decoded frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    /// The message kind.
    pub kind: Kind,
    /// Bytes of JSON that follow.
    pub json_len: u32,
    /// Bytes of blob after the JSON.
    pub blob_len: u32,
}

/// What is wrong with a control frame. Not retryable on the same
/// connection: the receiver closes it after answering with an
/// [`ErrorReply`](super::ErrorReply) where it can.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ControlError {
    /// The connection failed or closed.
    #[error("control connection: {0}")]
    Io(#[from] io::Error),
    /// Not an rfaas control frame.
    #[error("not an rfaas control frame: magic is {0:02x?}, expected \"RFAX\"")]
    BadMagic([u8; 4]),
    /// Another protocol version.
    #[error("the peer speaks rfaas protocol version {peer}, this side speaks {VERSION}; run the same rfaas release on both")]
    Version {
        /// The peer's version.
        peer: u16,
    },
    /// An unknown kind code.
    #[error("unknown control message kind {0}")]
    UnknownKind(u16),
    /// Over the receiver's limits.
    #[error("control frame too large: {what} is {len} bytes, the limit is {limit}")]
    TooLarge {
        /// `"json"` or `"blob"`.
        what: &'static str,
        /// Declared length.
        len: u32,
        /// The receiver's limit.
        limit: u32,
    },
    /// A frame of another kind than expected.
    #[error("expected a {expected:?} message, got {got:?}")]
    UnexpectedKind {
        /// What the receiver waited for.
        expected: Kind,
        /// What came.
        got: Kind,
    },
    /// The JSON does not describe the message its kind names.
    #[error("malformed {kind:?} message: {source}")]
    Json {
        /// The frame's kind.
        kind: Kind,
        /// serde_json's account.
        #[source]
        source: serde_json::Error,
    },
}

impl FrameHeader {
    /// Encodes the header.
    pub fn encode(&self) -> [u8; FRAME_HEADER_LEN] {
        let mut b = [0u8; FRAME_HEADER_LEN];
        b[0..4].copy_from_slice(&MAGIC);
        b[4..6].copy_from_slice(&VERSION.to_le_bytes());
        b[6..8].copy_from_slice(&self.kind.code().to_le_bytes());
        b[8..12].copy_from_slice(&self.json_len.to_le_bytes());
        b[12..16].copy_from_slice(&self.blob_len.to_le_bytes());
        b
    }

    /// Decodes and checks a header against `limits`.
    pub fn decode(b: &[u8; FRAME_HEADER_LEN], limits: FrameLimits) -> Result<Self, ControlError> {
        let magic = [b[0], b[1], b[2], b[3]];
        if magic != MAGIC {
            return Err(ControlError::BadMagic(magic));
        }
        let version = u16::from_le_bytes([b[4], b[5]]);
        if version != VERSION {
            return Err(ControlError::Version { peer: version });
        }
        let code = u16::from_le_bytes([b[6], b[7]]);
        let kind = Kind::from_code(code).ok_or(ControlError::UnknownKind(code))?;
        let json_len = u32::from_le_bytes([b[8], b[9], b[10], b[11]]);
        let blob_len = u32::from_le_bytes([b[12], b[13], b[14], b[15]]);
        if json_len > limits.max_json {
            return Err(ControlError::TooLarge {
                what: "json",
                len: json_len,
                limit: limits.max_json,
            });
        }
        if blob_len > limits.max_blob {
            return Err(ControlError::TooLarge {
                what: "blob",
                len: blob_len,
                limit: limits.max_blob,
            });
        }
        Ok(FrameHeader {
            kind,
            json_len,
            blob_len,
        })
    }
}

/// One received frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    /// The message kind.
    pub kind: Kind,
    /// The JSON part.
    pub json: Vec<u8>,
    /// The blob, empty when there is none.
    pub blob: Vec<u8>,
}

impl Frame {
    /// A frame holding `msg` (its kind is the message type's) and `blob`.
    pub fn new<M: Message>(msg: &M, blob: Vec<u8>) -> Frame {
        Frame {
            kind: M::KIND,
            json: serde_json::to_vec(msg).expect("control messages always serialise"),
            blob,
        }
    }

    /// The whole frame as bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        let header = FrameHeader {
            kind: self.kind,
            json_len: self.json.len() as u32,
            blob_len: self.blob.len() as u32,
        };
        let mut out = Vec::with_capacity(FRAME_HEADER_LEN + self.json.len() + self.blob.len());
        out.extend_from_slice(&header.encode());
        out.extend_from_slice(&self.json);
        out.extend_from_slice(&self.blob);
        out
    }

    /// Writes the frame (one `write_all` of header and JSON, one of the blob).
    pub fn write_to(&self, w: &mut impl Write) -> io::Result<()> {
        let header = FrameHeader {
            kind: self.kind,
            json_len: self.json.len() as u32,
            blob_len: self.blob.len() as u32,
        };
        let mut head = Vec::with_capacity(FRAME_HEADER_LEN + self.json.len());
        head.extend_from_slice(&header.encode());
        head.extend_from_slice(&self.json);
        w.write_all(&head)?;
        if !self.blob.is_empty() {
            w.write_all(&self.blob)?;
        }
        w.flush()
    }

    /// Reads one frame, refusing it before its body if it breaks `limits`.
    pub fn read_from(r: &mut impl Read, limits: FrameLimits) -> Result<Frame, ControlError> {
        let mut h = [0u8; FRAME_HEADER_LEN];
        r.read_exact(&mut h)?;
        let header = FrameHeader::decode(&h, limits)?;
        let mut json = vec![0u8; header.json_len as usize];
        r.read_exact(&mut json)?;
        let mut blob = vec![0u8; header.blob_len as usize];
        r.read_exact(&mut blob)?;
        Ok(Frame {
            kind: header.kind,
            json,
            blob,
        })
    }

    /// Parses the JSON as message `M`, which must be the frame's kind.
    pub fn parse<M: Message>(&self) -> Result<M, ControlError> {
        if self.kind != M::KIND {
            return Err(ControlError::UnexpectedKind {
                expected: M::KIND,
                got: self.kind,
            });
        }
        serde_json::from_slice(&self.json).map_err(|source| ControlError::Json {
            kind: self.kind,
            source,
        })
    }
}

/// The bytes of a version 2 frame of kind `kind` with `json` (under
/// 256 bytes) and no blob: magic, version, kind, JSON length, blob
/// length, little-endian.
#[cfg(test)]
pub(super) fn small_frame(kind: u8, json: &[u8]) -> Vec<u8> {
    let mut b = vec![b'R', b'F', b'A', b'X', 2, 0, kind, 0, json.len() as u8];
    b.extend_from_slice(&[0; 7]);
    b.extend_from_slice(json);
    b
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::control::client::Deallocate;

    #[test]
    fn header_bytes() {
        let h = FrameHeader {
            kind: Kind::AllocateRequest,
            json_len: 0x0102,
            blob_len: 0x0a0b0c0d,
        };
        let b = h.encode();
        assert_eq!(
            b,
            [b'R', b'F', b'A', b'X', 2, 0, 1, 0, 0x02, 0x01, 0, 0, 0x0d, 0x0c, 0x0b, 0x0a]
        );
        let limits = FrameLimits {
            max_json: u32::MAX,
            max_blob: u32::MAX,
        };
        assert_eq!(FrameHeader::decode(&b, limits).unwrap(), h);
    }

    #[test]
    fn kind_codes_are_stable() {
        let codes: Vec<u16> = Kind::ALL.iter().map(|k| k.code()).collect();
        assert_eq!(
            codes,
            [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 16, 17, 18, 19, 20, 32, 33]
        );
        for k in Kind::ALL {
            assert_eq!(Kind::from_code(k.code()), Some(k));
        }
        assert_eq!(Kind::from_code(11), None);
        assert_eq!(Kind::from_code(21), None);
    }

    #[test]
    fn bad_headers_are_refused_with_a_reason() {
        let good = FrameHeader {
            kind: Kind::Deallocate,
            json_len: 10,
            blob_len: 0,
        }
        .encode();
        let limits = FrameLimits::default();

        let mut b = good;
        b[0] = b'X';
        assert!(matches!(
            FrameHeader::decode(&b, limits),
            Err(ControlError::BadMagic(_))
        ));
        let mut b = good;
        b[4] = 9;
        let err = FrameHeader::decode(&b, limits).unwrap_err();
        assert!(matches!(err, ControlError::Version { peer: 9 }));
        assert!(err.to_string().contains("same rfaas release"), "{err}");
        let mut b = good;
        b[6] = 99;
        assert!(matches!(
            FrameHeader::decode(&b, limits),
            Err(ControlError::UnknownKind(99))
        ));
        let mut b = good;
        b[12..16].copy_from_slice(&(65u32 << 20).to_le_bytes());
        assert!(matches!(
            FrameHeader::decode(&b, limits),
            Err(ControlError::TooLarge { what: "blob", .. })
        ));
        let mut b = good;
        b[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            FrameHeader::decode(&b, limits),
            Err(ControlError::TooLarge { what: "json", .. })
        ));
    }

    #[test]
    fn malformed_json_says_which_message() {
        let frame = Frame {
            kind: Kind::Deallocate,
            json: b"{\"request_id\":1}".to_vec(),
            blob: vec![],
        };
        let err = frame.parse::<Deallocate>().unwrap_err();
        assert!(err.to_string().contains("Deallocate"), "{err}");
        assert!(err.to_string().contains("allocation_id"), "{err}");
    }

    #[test]
    fn truncated_frames_are_io_errors() {
        let bytes = Frame::new(
            &Deallocate {
                request_id: 1,
                allocation_id: 2,
            },
            vec![],
        )
        .to_bytes();
        let err = Frame::read_from(&mut &bytes[..bytes.len() - 1], FrameLimits::default());
        assert!(matches!(err, Err(ControlError::Io(_))));
    }
}

//! Frames of the fabric's `tcp` provider: software RDMA over a TCP stream.
//!
//! Every frame is a fixed 40-byte header, followed by a payload for the kinds
//! that carry data ([`FrameKind::Write`], [`FrameKind::WriteImm`],
//! [`FrameKind::ReadResp`]; its length is `arg0`). Fields a kind does not use
//! must be zero, so garbage is caught early.
//!
//! ```text
//!         0       1       2       3       4       5       6       7
//!       +-------+-------+-------+-------+-------+-------+-------+-------+
//!     0 | kind  |status | reserved (0)  |           seq (u32)           |
//!       +-------+-------+-------+-------+-------+-------+-------+-------+
//!     8 |           ack (u32)           |          rkey (u32)           |
//!       +-------+-------+-------+-------+-------+-------+-------+-------+
//!    16 |                          addr (u64)                           |
//!       +-------+-------+-------+-------+-------+-------+-------+-------+
//!    24 |                          arg0 (u64)                           |
//!       +-------+-------+-------+-------+-------+-------+-------+-------+
//!    32 |                          arg1 (u64)                           |
//!       +-------+-------+-------+-------+-------+-------+-------+-------+
//! ```
//!
//! | kind | seq | rkey, addr | arg0 | arg1 | payload |
//! |---|---|---|---|---|---|
//! | 1 `Hello` | 0 | version, [`HELLO_MAGIC`] | send depth | receive depth | none |
//! | 2 `Write` | request | target | length | 0 | length bytes |
//! | 3 `WriteImm` | request | target | length | immediate (u32) | length bytes |
//! | 4 `ReadReq` | request | source | length | 0 | none |
//! | 5 `ReadResp` | answered request | 0 | length (0 on error) | 0 | length bytes |
//! | 6 `FetchAdd` | request | target word | addend | 0 | none |
//! | 7 `CompareSwap` | request | target word | compare | swap | none |
//! | 8 `AtomicResp` | answered request | 0 | old value | 0 | none |
//! | 9 `Ack` | 0 | 0 | 0 | 0 | none |
//! | 10 `Nak` | refused request | 0 | 0 | 0 | none |
//!
//! `seq` numbers requests per direction, starting at 1 and wrapping. `ack`
//! in every frame is the sequence number of the last request its sender has
//! carried out (cumulative), so requests are acknowledged by whatever flows
//! back, and by a standalone `Ack` when nothing does. `status` is
//! [`FrameStatus`]: zero in requests, the outcome in `ReadResp`,
//! `AtomicResp` and `Nak` (which is never [`FrameStatus::Ok`]).

use std::fmt;

/// Bytes in a frame header.
pub const HEADER_LEN: usize = 40;
/// `addr` of a `Hello`: "RFAASTCP" in ASCII, read as a little-endian u64.
pub const HELLO_MAGIC: u64 = u64::from_le_bytes(*b"RFAASTCP");
/// `rkey` of a `Hello`: this version of the tcp frame format.
pub const FRAME_VERSION: u32 = 1;
/// The largest payload one frame may carry (one region is at most 4 GiB − 1).
pub const MAX_PAYLOAD: u64 = u32::MAX as u64;

/// What a frame asks for or answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum FrameKind {
    /// Connection set-up; both sides send one first.
    Hello = 1,
    /// One-sided write.
    Write = 2,
    /// One-sided write that consumes a posted receive at the target.
    WriteImm = 3,
    /// One-sided read request.
    ReadReq = 4,
    /// Data answering a read.
    ReadResp = 5,
    /// Atomic fetch-and-add on an 8-byte word.
    FetchAdd = 6,
    /// Atomic compare-and-swap on an 8-byte word.
    CompareSwap = 7,
    /// Old value answering an atomic.
    AtomicResp = 8,
    /// Standalone cumulative acknowledgement.
    Ack = 9,
    /// A write the target refused.
    Nak = 10,
}

impl FrameKind {
    fn from_u8(kind: u8) -> Option<FrameKind> {
        Some(match kind {
            1 => FrameKind::Hello,
            2 => FrameKind::Write,
            3 => FrameKind::WriteImm,
            4 => FrameKind::ReadReq,
            5 => FrameKind::ReadResp,
            6 => FrameKind::FetchAdd,
            7 => FrameKind::CompareSwap,
            8 => FrameKind::AtomicResp,
            9 => FrameKind::Ack,
            10 => FrameKind::Nak,
            _ => return None,
        })
    }

    /// Whether the kind answers a request (and so names it in `seq`).
    pub fn is_response(self) -> bool {
        matches!(
            self,
            FrameKind::ReadResp | FrameKind::AtomicResp | FrameKind::Nak
        )
    }

    /// Whether the kind is a request the target must acknowledge.
    pub fn is_request(self) -> bool {
        matches!(
            self,
            FrameKind::Write
                | FrameKind::WriteImm
                | FrameKind::ReadReq
                | FrameKind::FetchAdd
                | FrameKind::CompareSwap
        )
    }
}

/// Outcome carried by responses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum FrameStatus {
    /// Carried out.
    Ok = 0,
    /// Refused: unknown rkey, another domain's rkey, out of bounds, or a
    /// missing access right. The target's memory is untouched.
    RemoteAccess = 1,
    /// Refused: a well-formed request the target cannot carry out (an atomic
    /// on an address that is not 8-byte aligned).
    RemoteOperation = 2,
}

impl FrameStatus {
    fn from_u8(status: u8) -> Option<FrameStatus> {
        Some(match status {
            0 => FrameStatus::Ok,
            1 => FrameStatus::RemoteAccess,
            2 => FrameStatus::RemoteOperation,
            _ => return None,
        })
    }
}

/// A decoded frame header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameHeader {
    /// What the frame is.
    pub kind: FrameKind,
    /// Outcome (responses only).
    pub status: FrameStatus,
    /// Request number (requests) or the request answered (responses).
    pub seq: u32,
    /// Last request of the other direction carried out by the sender.
    pub ack: u32,
    /// Remote key (requests), or the frame version (`Hello`).
    pub rkey: u32,
    /// Target address (requests), or [`HELLO_MAGIC`] (`Hello`).
    pub addr: u64,
    /// Kind-specific; see the module table.
    pub arg0: u64,
    /// Kind-specific; see the module table.
    pub arg1: u64,
}

/// Why bytes are not a frame header. Any of these closes the connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FrameError {
    /// The kind byte is not a known frame kind.
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
    /// The status byte is not a known status, or does not fit the kind.
    #[error("status {status} is not valid in a {kind:?} frame")]
    BadStatus {
        /// The frame kind.
        kind: FrameKind,
        /// The status byte.
        status: u8,
    },
    /// The reserved bytes are not zero.
    #[error("reserved header bytes are {0:#06x}, not zero")]
    Reserved(u16),
    /// A field the kind does not use is not zero.
    #[error("field {field} of a {kind:?} frame must be 0, not {value:#x}")]
    NonZeroField {
        /// The frame kind.
        kind: FrameKind,
        /// The field's name.
        field: &'static str,
        /// Its value.
        value: u64,
    },
    /// A payload length beyond [`MAX_PAYLOAD`].
    #[error("payload length {0} exceeds the largest frame payload of {max} bytes", max = MAX_PAYLOAD)]
    TooLong(u64),
    /// A write-with-immediate whose immediate does not fit in 32 bits.
    #[error("immediate {0:#x} does not fit in 32 bits")]
    BadImmediate(u64),
    /// A `Hello` without the magic number or with another version.
    #[error("hello frame has magic {magic:#x} and version {version}; expected {expected_magic:#x} and version {expected_version}", expected_magic = HELLO_MAGIC, expected_version = FRAME_VERSION)]
    BadHello {
        /// The magic found.
        magic: u64,
        /// The version found.
        version: u32,
    },
}

impl FrameHeader {
    /// A header of `kind` with every other field zero.
    pub fn new(kind: FrameKind) -> FrameHeader {
        FrameHeader {
            kind,
            status: FrameStatus::Ok,
            seq: 0,
            ack: 0,
            rkey: 0,
            addr: 0,
            arg0: 0,
            arg1: 0,
        }
    }

    /// The `Hello` a side sends first, announcing its queue depths.
    pub fn hello(send_depth: u64, recv_depth: u64) -> FrameHeader {
        FrameHeader {
            rkey: FRAME_VERSION,
            addr: HELLO_MAGIC,
            arg0: send_depth,
            arg1: recv_depth,
            ..FrameHeader::new(FrameKind::Hello)
        }
    }

    /// Payload bytes that follow this header.
    pub fn payload_len(&self) -> u64 {
        match self.kind {
            FrameKind::Write | FrameKind::WriteImm | FrameKind::ReadResp => self.arg0,
            _ => 0,
        }
    }

    /// The 40 bytes of this header. Hot path: no allocation.
    #[inline]
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut out = [0u8; HEADER_LEN];
        out[0] = self.kind as u8;
        out[1] = self.status as u8;
        out[4..8].copy_from_slice(&self.seq.to_le_bytes());
        out[8..12].copy_from_slice(&self.ack.to_le_bytes());
        out[12..16].copy_from_slice(&self.rkey.to_le_bytes());
        out[16..24].copy_from_slice(&self.addr.to_le_bytes());
        out[24..32].copy_from_slice(&self.arg0.to_le_bytes());
        out[32..40].copy_from_slice(&self.arg1.to_le_bytes());
        out
    }

    /// Decodes and validates a header. Hot path: no allocation.
    #[inline]
    pub fn decode(bytes: &[u8; HEADER_LEN]) -> Result<FrameHeader, FrameError> {
        let u32_at = |at: usize| u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap_or([0; 4]));
        let u64_at = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap_or([0; 8]));
        let kind = FrameKind::from_u8(bytes[0]).ok_or(FrameError::UnknownKind(bytes[0]))?;
        let status = FrameStatus::from_u8(bytes[1]).ok_or(FrameError::BadStatus {
            kind,
            status: bytes[1],
        })?;
        let reserved = u16::from_le_bytes([bytes[2], bytes[3]]);
        if reserved != 0 {
            return Err(FrameError::Reserved(reserved));
        }
        let header = FrameHeader {
            kind,
            status,
            seq: u32_at(4),
            ack: u32_at(8),
            rkey: u32_at(12),
            addr: u64_at(16),
            arg0: u64_at(24),
            arg1: u64_at(32),
        };
        header.validate()?;
        Ok(header)
    }

    fn validate(&self) -> Result<(), FrameError> {
        let zero = |field: &'static str, value: u64| {
            if value == 0 {
                Ok(())
            } else {
                Err(FrameError::NonZeroField {
                    kind: self.kind,
                    field,
                    value,
                })
            }
        };
        let status_ok = match self.kind {
            FrameKind::ReadResp | FrameKind::AtomicResp => true,
            FrameKind::Nak => self.status != FrameStatus::Ok,
            _ => self.status == FrameStatus::Ok,
        };
        if !status_ok {
            return Err(FrameError::BadStatus {
                kind: self.kind,
                status: self.status as u8,
            });
        }
        if self.payload_len() > MAX_PAYLOAD {
            return Err(FrameError::TooLong(self.payload_len()));
        }
        match self.kind {
            FrameKind::Hello => {
                if self.addr != HELLO_MAGIC || self.rkey != FRAME_VERSION {
                    return Err(FrameError::BadHello {
                        magic: self.addr,
                        version: self.rkey,
                    });
                }
                zero("seq", self.seq.into())?;
                zero("ack", self.ack.into())
            }
            FrameKind::Write | FrameKind::ReadReq => zero("arg1", self.arg1),
            FrameKind::WriteImm => {
                if self.arg1 > u64::from(u32::MAX) {
                    return Err(FrameError::BadImmediate(self.arg1));
                }
                Ok(())
            }
            FrameKind::FetchAdd => zero("arg1", self.arg1),
            FrameKind::CompareSwap => Ok(()),
            FrameKind::ReadResp | FrameKind::AtomicResp => {
                zero("rkey", self.rkey.into())?;
                zero("addr", self.addr)?;
                zero("arg1", self.arg1)?;
                if self.kind == FrameKind::ReadResp && self.status != FrameStatus::Ok {
                    zero("arg0", self.arg0)?;
                }
                Ok(())
            }
            FrameKind::Ack | FrameKind::Nak => {
                if self.kind == FrameKind::Ack {
                    zero("seq", self.seq.into())?;
                }
                zero("rkey", self.rkey.into())?;
                zero("addr", self.addr)?;
                zero("arg0", self.arg0)?;
                zero("arg1", self.arg1)
            }
        }
    }
}

impl fmt::Display for FrameHeader {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:?} seq={} ack={} rkey={:#x} addr={:#x} arg0={} arg1={}",
            self.kind, self.seq, self.ack, self.rkey, self.addr, self.arg0, self.arg1
        )
    }
}

/// Walks a byte stream frame by frame, the way the tcp provider reads its
/// socket: a header, then its payload. Returns how many whole frames the
/// bytes hold, or the first error. Used by the fuzz target and tests.
pub fn walk(mut bytes: &[u8]) -> Result<usize, FrameError> {
    let mut frames = 0;
    while bytes.len() >= HEADER_LEN {
        let (head, rest) = bytes.split_at(HEADER_LEN);
        let header = FrameHeader::decode(head.try_into().unwrap_or(&[0; HEADER_LEN]))?;
        let payload = header.payload_len();
        if payload > rest.len() as u64 {
            break;
        }
        bytes = &rest[payload as usize..];
        frames += 1;
    }
    Ok(frames)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write_imm() -> FrameHeader {
        FrameHeader {
            seq: 7,
            ack: 5,
            rkey: 0xAABB_CCDD,
            addr: 0x1122_3344_5566_7788,
            arg0: 64,
            arg1: 0xDEAD_BEEF,
            ..FrameHeader::new(FrameKind::WriteImm)
        }
    }

    #[test]
    fn write_imm_exact_bytes() {
        let expected: [u8; HEADER_LEN] = [
            3, 0, 0, 0, // kind, status, reserved
            7, 0, 0, 0, // seq
            5, 0, 0, 0, // ack
            0xDD, 0xCC, 0xBB, 0xAA, // rkey
            0x88, 0x77, 0x66, 0x55, 0x44, 0x33, 0x22, 0x11, // addr
            64, 0, 0, 0, 0, 0, 0, 0, // arg0 = length
            0xEF, 0xBE, 0xAD, 0xDE, 0, 0, 0, 0, // arg1 = immediate
        ];
        assert_eq!(write_imm().encode(), expected);
        assert_eq!(FrameHeader::decode(&expected), Ok(write_imm()));
    }

    #[test]
    fn hello_exact_bytes() {
        let bytes = FrameHeader::hello(256, 128).encode();
        assert_eq!(&bytes[..4], &[1, 0, 0, 0]);
        assert_eq!(&bytes[12..16], &[1, 0, 0, 0]);
        assert_eq!(&bytes[16..24], b"RFAASTCP");
        assert_eq!(&bytes[24..32], &256u64.to_le_bytes());
        assert_eq!(&bytes[32..40], &128u64.to_le_bytes());
        assert_eq!(
            FrameHeader::decode(&bytes),
            Ok(FrameHeader::hello(256, 128))
        );
    }

    #[test]
    fn every_kind_round_trips() {
        let frames = [
            FrameHeader::hello(1, 1),
            FrameHeader {
                seq: 1,
                rkey: 9,
                addr: 8,
                arg0: 3,
                ..FrameHeader::new(FrameKind::Write)
            },
            write_imm(),
            FrameHeader {
                seq: u32::MAX,
                rkey: 9,
                addr: 8,
                arg0: 3,
                ..FrameHeader::new(FrameKind::ReadReq)
            },
            FrameHeader {
                seq: 2,
                ack: 9,
                arg0: 3,
                ..FrameHeader::new(FrameKind::ReadResp)
            },
            FrameHeader {
                seq: 2,
                rkey: 1,
                addr: 8,
                arg0: u64::MAX,
                ..FrameHeader::new(FrameKind::FetchAdd)
            },
            FrameHeader {
                seq: 2,
                rkey: 1,
                addr: 8,
                arg0: 1,
                arg1: 2,
                ..FrameHeader::new(FrameKind::CompareSwap)
            },
            FrameHeader {
                seq: 3,
                arg0: u64::MAX,
                ..FrameHeader::new(FrameKind::AtomicResp)
            },
            FrameHeader {
                ack: 77,
                ..FrameHeader::new(FrameKind::Ack)
            },
            FrameHeader {
                seq: 4,
                ack: 3,
                status: FrameStatus::RemoteAccess,
                ..FrameHeader::new(FrameKind::Nak)
            },
        ];
        for frame in frames {
            assert_eq!(FrameHeader::decode(&frame.encode()), Ok(frame), "{frame}");
        }
    }

    #[test]
    fn rejects_unknown_kinds() {
        for kind in [0u8, 11, 200, 255] {
            let mut bytes = write_imm().encode();
            bytes[0] = kind;
            assert_eq!(
                FrameHeader::decode(&bytes),
                Err(FrameError::UnknownKind(kind))
            );
        }
    }

    #[test]
    fn rejects_bad_status_reserved_and_fields() {
        let mut bytes = write_imm().encode();
        bytes[1] = 1;
        assert!(matches!(
            FrameHeader::decode(&bytes),
            Err(FrameError::BadStatus { .. })
        ));
        bytes[1] = 3;
        assert!(matches!(
            FrameHeader::decode(&bytes),
            Err(FrameError::BadStatus { .. })
        ));

        let mut bytes = write_imm().encode();
        bytes[2] = 1;
        assert_eq!(FrameHeader::decode(&bytes), Err(FrameError::Reserved(1)));

        let nak_ok = FrameHeader {
            seq: 1,
            ..FrameHeader::new(FrameKind::Nak)
        };
        assert!(matches!(
            FrameHeader::decode(&nak_ok.encode()),
            Err(FrameError::BadStatus { .. })
        ));

        let write_arg1 = FrameHeader {
            arg1: 1,
            ..FrameHeader::new(FrameKind::Write)
        };
        assert!(matches!(
            FrameHeader::decode(&write_arg1.encode()),
            Err(FrameError::NonZeroField { field: "arg1", .. })
        ));
        let ack_addr = FrameHeader {
            addr: 1,
            ..FrameHeader::new(FrameKind::Ack)
        };
        assert!(matches!(
            FrameHeader::decode(&ack_addr.encode()),
            Err(FrameError::NonZeroField { .. })
        ));
        let big_imm = FrameHeader {
            arg1: 1 << 32,
            ..write_imm()
        };
        assert_eq!(
            FrameHeader::decode(&big_imm.encode()),
            Err(FrameError::BadImmediate(1 << 32))
        );
        let too_long = FrameHeader {
            arg0: MAX_PAYLOAD + 1,
            ..write_imm()
        };
        assert_eq!(
            FrameHeader::decode(&too_long.encode()),
            Err(FrameError::TooLong(MAX_PAYLOAD + 1))
        );
        let failed_read_with_data = FrameHeader {
            status: FrameStatus::RemoteAccess,
            arg0: 5,
            ..FrameHeader::new(FrameKind::ReadResp)
        };
        assert!(FrameHeader::decode(&failed_read_with_data.encode()).is_err());
    }

    #[test]
    fn rejects_foreign_hello() {
        let mut bytes = FrameHeader::hello(1, 1).encode();
        bytes[16] = b'X';
        assert!(matches!(
            FrameHeader::decode(&bytes),
            Err(FrameError::BadHello { .. })
        ));
        let mut bytes = FrameHeader::hello(1, 1).encode();
        bytes[12] = 2;
        assert!(matches!(
            FrameHeader::decode(&bytes),
            Err(FrameError::BadHello { version: 2, .. })
        ));
    }

    #[test]
    fn walk_counts_frames_and_stops_at_partial_ones() {
        let mut stream = Vec::new();
        stream.extend_from_slice(&write_imm().encode());
        stream.extend_from_slice(&[0xAB; 64]);
        stream.extend_from_slice(
            &FrameHeader {
                ack: 1,
                ..FrameHeader::new(FrameKind::Ack)
            }
            .encode(),
        );
        assert_eq!(walk(&stream), Ok(2));
        assert_eq!(walk(&stream[..stream.len() - 1]), Ok(1));
        assert_eq!(walk(&stream[..50]), Ok(0));
        stream.push(0);
        assert_eq!(walk(&stream), Ok(2));
        stream.extend_from_slice(&[0; HEADER_LEN]);
        assert!(walk(&stream).is_err());
    }
}

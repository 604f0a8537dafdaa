//! The hello carried in rdma_cm private data at connect, accept and reject.
//!
//! 16 bytes, little-endian: magic `b"RFVB"`, version (u16), reason (u16, 0
//! in a connect or accept, why in a reject), send depth (u32), receive depth
//! (u32). rdma_cm hands the receiver the whole private-data area of the CM
//! message (56 bytes in a REQ, more in REP and REJ) padded with zeros, so
//! decoding reads the first 16 bytes and ignores the rest.
//!
//! This is a transport handshake of the verbs provider, not an rfaas wire
//! format (those live in `rfaas-proto`); it only lets both sides refuse a peer
//! that is not an rfaas verbs endpoint of the same version.

use std::fmt;

/// The magic at the start of every hello.
pub(crate) const MAGIC: [u8; 4] = *b"RFVB";
/// The version this build speaks.
pub(crate) const VERSION: u16 = 1;
/// Encoded size.
pub(crate) const LEN: usize = 16;

/// Why a passive side rejected a connection (carried in the reject's hello).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u16)]
pub(crate) enum RejectReason {
    /// The request carried no rfaas hello.
    NotRfaas = 1,
    /// The request's hello has another version.
    Version = 2,
    /// The connection arrived on another RDMA device than the listener's fabric.
    WrongDevice = 3,
    /// The passive side could not create or set up its queue pair.
    Resources = 4,
}

impl RejectReason {
    fn from_u16(v: u16) -> Option<RejectReason> {
        Some(match v {
            1 => RejectReason::NotRfaas,
            2 => RejectReason::Version,
            3 => RejectReason::WrongDevice,
            4 => RejectReason::Resources,
            _ => return None,
        })
    }
}

impl fmt::Display for RejectReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            RejectReason::NotRfaas => "our connect request carried no rfaas hello",
            RejectReason::Version => "it speaks another version of the verbs handshake",
            RejectReason::WrongDevice => {
                "the request reached another RDMA device than the listener's"
            }
            RejectReason::Resources => "it could not set up a queue pair (see its log)",
        })
    }
}

/// A decoded hello.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Hello {
    pub(crate) version: u16,
    pub(crate) reason: u16,
    pub(crate) send_depth: u32,
    pub(crate) recv_depth: u32,
}

/// Why bytes are not an acceptable hello.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum HelloError {
    /// Too short or wrong magic: the peer is not an rfaas verbs endpoint.
    NotRfaas,
    /// Right magic, other version.
    Version(u16),
}

impl fmt::Display for HelloError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HelloError::NotRfaas => f.write_str("the peer sent no rfaas hello (is it an rfaas verbs endpoint?)"),
            HelloError::Version(v) => write!(
                f,
                "the peer speaks verbs handshake version {v}, this build speaks {VERSION}: run the same rfaas release on both sides"
            ),
        }
    }
}

impl Hello {
    /// Our hello for a connect or an accept.
    pub(crate) fn new(send_depth: usize, recv_depth: usize) -> Hello {
        Hello {
            version: VERSION,
            reason: 0,
            send_depth: u32::try_from(send_depth).unwrap_or(u32::MAX),
            recv_depth: u32::try_from(recv_depth).unwrap_or(u32::MAX),
        }
    }

    /// Our hello for a reject.
    pub(crate) fn reject(reason: RejectReason) -> Hello {
        Hello {
            version: VERSION,
            reason: reason as u16,
            send_depth: 0,
            recv_depth: 0,
        }
    }

    pub(crate) fn encode(&self) -> [u8; LEN] {
        let mut out = [0u8; LEN];
        out[0..4].copy_from_slice(&MAGIC);
        out[4..6].copy_from_slice(&self.version.to_le_bytes());
        out[6..8].copy_from_slice(&self.reason.to_le_bytes());
        out[8..12].copy_from_slice(&self.send_depth.to_le_bytes());
        out[12..16].copy_from_slice(&self.recv_depth.to_le_bytes());
        out
    }

    /// Decodes without judging the version.
    pub(crate) fn decode(bytes: &[u8]) -> Result<Hello, HelloError> {
        if bytes.len() < LEN || bytes[0..4] != MAGIC {
            return Err(HelloError::NotRfaas);
        }
        let u16_at = |i: usize| u16::from_le_bytes([bytes[i], bytes[i + 1]]);
        let u32_at =
            |i: usize| u32::from_le_bytes([bytes[i], bytes[i + 1], bytes[i + 2], bytes[i + 3]]);
        Ok(Hello {
            version: u16_at(4),
            reason: u16_at(6),
            send_depth: u32_at(8),
            recv_depth: u32_at(12),
        })
    }

    /// Decodes and checks the version.
    pub(crate) fn accept(bytes: &[u8]) -> Result<Hello, HelloError> {
        let hello = Hello::decode(bytes)?;
        if hello.version != VERSION {
            return Err(HelloError::Version(hello.version));
        }
        Ok(hello)
    }

    /// The reject reason, if this hello came with a reject.
    pub(crate) fn reject_reason(&self) -> Option<RejectReason> {
        RejectReason::from_u16(self.reason)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_are_pinned() {
        let bytes = Hello::new(256, 128).encode();
        assert_eq!(
            bytes,
            [b'R', b'F', b'V', b'B', 1, 0, 0, 0, 0, 1, 0, 0, 128, 0, 0, 0]
        );
    }

    #[test]
    fn round_trips_with_cm_padding() {
        let mut area = [0u8; 56];
        area[..LEN].copy_from_slice(&Hello::new(7, 9).encode());
        let hello = Hello::accept(&area).unwrap();
        assert_eq!(
            (hello.send_depth, hello.recv_depth, hello.reason),
            (7, 9, 0)
        );
    }

    #[test]
    fn foreign_private_data_is_not_rfaas() {
        assert_eq!(Hello::accept(&[0u8; 56]), Err(HelloError::NotRfaas));
        assert_eq!(Hello::accept(b"RFVB"), Err(HelloError::NotRfaas));
        assert_eq!(Hello::accept(&[]), Err(HelloError::NotRfaas));
    }

    #[test]
    fn another_version_is_named() {
        let mut bytes = Hello::new(1, 1).encode();
        bytes[4] = 9;
        let err = Hello::accept(&bytes).unwrap_err();
        assert_eq!(err, HelloError::Version(9));
        assert!(err.to_string().contains("version 9"));
    }

    #[test]
    fn reject_reasons_round_trip() {
        for reason in [
            RejectReason::NotRfaas,
            RejectReason::Version,
            RejectReason::WrongDevice,
            RejectReason::Resources,
        ] {
            let hello = Hello::decode(&Hello::reject(reason).encode()).unwrap();
            assert_eq!(hello.reject_reason(), Some(reason));
        }
        assert_eq!(Hello::new(1, 1).reject_reason(), None);
    }

    #[test]
    fn huge_depths_saturate() {
        assert_eq!(Hello::new(usize::MAX, 0).send_depth, u32::MAX);
    }
}

//! The shm control protocol: the hello of connection set-up and the grant
//! messages, all 64 bytes, little-endian, over the unix stream socket.
//!
//! It never leaves the node and only the fabric's `shm` provider speaks it;
//! its bytes are pinned by the tests below.
//!
//! | message | bytes | descriptors (SCM_RIGHTS) |
//! |---|---|---|
//! | hello (connect / accept) | magic `RFAASSHM`, version u16, kind u16, pid u32, send depth u32, recv depth u32, ring capacity u32, reject reason u32, zeros | inbound ring memfd, wake-up socket, validity table memfd (read-only) |
//! | hello (reject) | as above, kind 3, reason set | none |
//! | grant request | kind u32 = 1, 0 u32, request id u64, rkey u32, zeros | none |
//! | grant reply | kind u32 = 2, status u32 (0 granted, 1 refused), request id u64, rkey u32, access u32, base u64, len u64, mapped len u64, serial u64, zeros | the region's memfd when granted |

/// Every message is this long.
pub const MSG_LEN: usize = 64;
/// First bytes of a hello.
pub const MAGIC: [u8; 8] = *b"RFAASSHM";
/// Protocol version; a peer with another one is refused at connect.
///
/// The version also covers the layout and meaning of the shared immediate
/// ring the hello passes (`rfaas_fabric`'s `shm/ring.rs`). Version 2: the
/// ring's `sleeping` word says how the consumer sleeps (1: on the wake-up
/// socket, 2: on the futex word next to it), so a version-1 producer, which
/// only kicks the socket, would miss a futex sleeper's wake-ups.
pub const VERSION: u16 = 2;

/// What a hello says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HelloKind {
    /// The connecting side's opening.
    Connect = 1,
    /// The accepting side's answer.
    Accept = 2,
    /// The accepting side refuses; see [`Hello::reason`].
    Reject = 3,
}

/// Why a hello was rejected.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RejectReason {
    /// Another protocol version.
    Version = 1,
    /// Descriptors missing or not what the protocol says.
    Descriptors = 2,
    /// Something else is wrong with the hello.
    Malformed = 3,
}

impl RejectReason {
    /// A sentence for a reject reason code (unknown codes included).
    pub fn describe(code: u32) -> &'static str {
        match code {
            1 => "the listener speaks another shm protocol version",
            2 => "the listener could not use the shared memory we passed",
            3 => "the listener found our hello malformed",
            _ => "the listener refused the connection",
        }
    }
}

/// The first message of each side.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hello {
    /// Which side, or a refusal.
    pub kind: HelloKind,
    /// [`VERSION`] of the sender.
    pub version: u16,
    /// The sender's process id (for logs: which peer is this).
    pub pid: u32,
    /// Operations the sender keeps outstanding at most.
    pub send_depth: u32,
    /// Receives the sender keeps posted at most.
    pub recv_depth: u32,
    /// Capacity (a power of two) of the sender's inbound immediate ring.
    pub ring_cap: u32,
    /// For [`HelloKind::Reject`]: a [`RejectReason`] code.
    pub reason: u32,
}

/// A hello that is not one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HelloError {
    /// Not our magic: the peer is not an rfaas shm endpoint.
    Magic,
    /// Our magic, another version.
    Version(u16),
    /// Unknown kind.
    Kind(u16),
}

impl std::fmt::Display for HelloError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HelloError::Magic => f.write_str("the peer is not an rfaas shm endpoint (bad magic)"),
            HelloError::Version(v) => write!(
                f,
                "the peer speaks shm protocol version {v}, this library speaks {VERSION}"
            ),
            HelloError::Kind(k) => write!(f, "the peer sent an unknown hello kind {k}"),
        }
    }
}

impl Hello {
    /// The 64 bytes of this hello.
    pub fn encode(&self) -> [u8; MSG_LEN] {
        let mut b = [0u8; MSG_LEN];
        b[0..8].copy_from_slice(&MAGIC);
        b[8..10].copy_from_slice(&self.version.to_le_bytes());
        b[10..12].copy_from_slice(&(self.kind as u16).to_le_bytes());
        b[12..16].copy_from_slice(&self.pid.to_le_bytes());
        b[16..20].copy_from_slice(&self.send_depth.to_le_bytes());
        b[20..24].copy_from_slice(&self.recv_depth.to_le_bytes());
        b[24..28].copy_from_slice(&self.ring_cap.to_le_bytes());
        b[28..32].copy_from_slice(&self.reason.to_le_bytes());
        b
    }

    /// Decodes a hello, refusing another magic, version or kind.
    pub fn decode(b: &[u8; MSG_LEN]) -> Result<Hello, HelloError> {
        if b[0..8] != MAGIC {
            return Err(HelloError::Magic);
        }
        let version = u16::from_le_bytes([b[8], b[9]]);
        if version != VERSION {
            return Err(HelloError::Version(version));
        }
        let kind = match u16::from_le_bytes([b[10], b[11]]) {
            1 => HelloKind::Connect,
            2 => HelloKind::Accept,
            3 => HelloKind::Reject,
            other => return Err(HelloError::Kind(other)),
        };
        Ok(Hello {
            kind,
            version,
            pid: u32_at(b, 12),
            send_depth: u32_at(b, 16),
            recv_depth: u32_at(b, 20),
            ring_cap: u32_at(b, 24),
            reason: u32_at(b, 28),
        })
    }
}

/// What a target grants for one region.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GrantInfo {
    /// `rfaas_fabric::Access` bits.
    pub access: u32,
    /// Address of the region's first byte in the target's address space.
    pub base: u64,
    /// Usable length.
    pub len: u64,
    /// Length of the memfd mapping (whole pages).
    pub map_len: u64,
    /// The registration's serial, compared with the target's validity table.
    pub serial: u64,
}

/// A message after set-up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Control {
    /// "Grant me the region named `rkey`."
    GrantRequest {
        /// Matches the reply to the request.
        req_id: u64,
        /// The region asked for.
        rkey: u32,
    },
    /// The answer; `None` refuses (unknown rkey, other domain, no remote right).
    GrantReply {
        /// The request answered.
        req_id: u64,
        /// The region asked for.
        rkey: u32,
        /// What is granted, if anything.
        grant: Option<GrantInfo>,
    },
}

const GRANT_REQUEST: u32 = 1;
const GRANT_REPLY: u32 = 2;

impl Control {
    /// The 64 bytes of this message.
    pub fn encode(&self) -> [u8; MSG_LEN] {
        let mut b = [0u8; MSG_LEN];
        match *self {
            Control::GrantRequest { req_id, rkey } => {
                b[0..4].copy_from_slice(&GRANT_REQUEST.to_le_bytes());
                b[8..16].copy_from_slice(&req_id.to_le_bytes());
                b[16..20].copy_from_slice(&rkey.to_le_bytes());
            }
            Control::GrantReply {
                req_id,
                rkey,
                grant,
            } => {
                b[0..4].copy_from_slice(&GRANT_REPLY.to_le_bytes());
                b[4..8].copy_from_slice(&u32::from(grant.is_none()).to_le_bytes());
                b[8..16].copy_from_slice(&req_id.to_le_bytes());
                b[16..20].copy_from_slice(&rkey.to_le_bytes());
                if let Some(g) = grant {
                    b[20..24].copy_from_slice(&g.access.to_le_bytes());
                    b[24..32].copy_from_slice(&g.base.to_le_bytes());
                    b[32..40].copy_from_slice(&g.len.to_le_bytes());
                    b[40..48].copy_from_slice(&g.map_len.to_le_bytes());
                    b[48..56].copy_from_slice(&g.serial.to_le_bytes());
                }
            }
        }
        b
    }

    /// `None` for a message this version does not know.
    pub fn decode(b: &[u8]) -> Option<Control> {
        let b: &[u8; MSG_LEN] = b.try_into().ok()?;
        let req_id = u64_at(b, 8);
        let rkey = u32_at(b, 16);
        match u32_at(b, 0) {
            GRANT_REQUEST => Some(Control::GrantRequest { req_id, rkey }),
            GRANT_REPLY => {
                let grant = match u32_at(b, 4) {
                    0 => Some(GrantInfo {
                        access: u32_at(b, 20),
                        base: u64_at(b, 24),
                        len: u64_at(b, 32),
                        map_len: u64_at(b, 40),
                        serial: u64_at(b, 48),
                    }),
                    1 => None,
                    _ => return None,
                };
                Some(Control::GrantReply {
                    req_id,
                    rkey,
                    grant,
                })
            }
            _ => None,
        }
    }
}

fn u32_at(b: &[u8; MSG_LEN], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

fn u64_at(b: &[u8; MSG_LEN], at: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(w)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hello_bytes_are_pinned() {
        let hello = Hello {
            kind: HelloKind::Accept,
            version: VERSION,
            pid: 0x0102_0304,
            send_depth: 256,
            recv_depth: 128,
            ring_cap: 128,
            reason: 0,
        };
        let b = hello.encode();
        assert_eq!(&b[0..8], b"RFAASSHM");
        assert_eq!(&b[8..12], &[2, 0, 2, 0]);
        assert_eq!(&b[12..16], &[4, 3, 2, 1]);
        assert_eq!(&b[16..20], &[0, 1, 0, 0]);
        assert_eq!(&b[20..24], &[128, 0, 0, 0]);
        assert_eq!(&b[24..28], &[128, 0, 0, 0]);
        assert!(b[28..].iter().all(|&x| x == 0));
        assert_eq!(Hello::decode(&b), Ok(hello));
    }

    #[test]
    fn hello_rejects_garbage_and_other_versions() {
        let mut b = [0x41u8; MSG_LEN];
        assert_eq!(Hello::decode(&b), Err(HelloError::Magic));
        b[0..8].copy_from_slice(&MAGIC);
        b[8..10].copy_from_slice(&7u16.to_le_bytes());
        assert_eq!(Hello::decode(&b), Err(HelloError::Version(7)));
        // Version 1 rings have no futex word: refused, not misread.
        b[8..10].copy_from_slice(&1u16.to_le_bytes());
        assert_eq!(Hello::decode(&b), Err(HelloError::Version(1)));
        b[8..10].copy_from_slice(&VERSION.to_le_bytes());
        b[10..12].copy_from_slice(&9u16.to_le_bytes());
        assert_eq!(Hello::decode(&b), Err(HelloError::Kind(9)));
    }

    #[test]
    fn grant_messages_round_trip_with_pinned_bytes() {
        let req = Control::GrantRequest {
            req_id: 5,
            rkey: 0x0000_0c01,
        };
        let b = req.encode();
        assert_eq!(
            &b[0..20],
            &[1, 0, 0, 0, 0, 0, 0, 0, 5, 0, 0, 0, 0, 0, 0, 0, 1, 12, 0, 0]
        );
        assert!(b[20..].iter().all(|&x| x == 0));
        assert_eq!(Control::decode(&b), Some(req));

        let grant = GrantInfo {
            access: 3,
            base: 0x7f00_0000_1000,
            len: 100,
            map_len: 4096,
            serial: 9,
        };
        let rep = Control::GrantReply {
            req_id: 5,
            rkey: 7,
            grant: Some(grant),
        };
        let b = rep.encode();
        assert_eq!(&b[0..8], &[2, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(&b[20..24], &[3, 0, 0, 0]);
        assert_eq!(&b[24..32], &0x7f00_0000_1000u64.to_le_bytes());
        assert_eq!(&b[48..56], &9u64.to_le_bytes());
        assert_eq!(Control::decode(&b), Some(rep));

        let refused = Control::GrantReply {
            req_id: 6,
            rkey: 7,
            grant: None,
        };
        let b = refused.encode();
        assert_eq!(&b[4..8], &[1, 0, 0, 0]);
        assert_eq!(Control::decode(&b), Some(refused));

        let mut junk = [0u8; MSG_LEN];
        junk[0] = 77;
        assert_eq!(Control::decode(&junk), None);
    }
}

//! [`LaneHello`]: the first write a client makes on each lane it connects
//! to a worker, proving it holds the allocation.
//!
//! A worker's fabric listener takes connections from anyone who can reach
//! it. The executor gives each allocation a random [`LaneKey`], sends it to
//! the worker with the assignment and to the client in `AllocateOk` (over
//! the control connection only). The client's first operation on a lane is a
//! write-with-immediate of these 32 bytes into the lane's input buffer, with
//! the immediate [`LANE_HELLO_IMM`]; the worker serves the lane only if the
//! magic, the lane index and the key match, and otherwise drops the
//! connection and waits for the next one. It answers an accepted hello with
//! a zero-length write-with-immediate carrying [`LANE_HELLO_IMM`]; the
//! client sends its first request only after that answer (a request
//! written earlier could overwrite the hello before the worker read it).
//!
//! ```text
//!  0      4      8                                 32
//!  +------+------+---------------------------------+
//!  | RFLH | lane |      key (24 bytes)             |
//!  +------+------+---------------------------------+
//! ```
//! `lane` is little-endian.

use std::fmt;

use crate::error::ProtoError;

/// The immediate of a lane hello.
pub const LANE_HELLO_IMM: u32 = u32::from_le_bytes(*b"RFLH");

const MAGIC: [u8; 4] = *b"RFLH";
const LANE: usize = 4;
const KEY: usize = 8;

/// Bytes of a lane key.
pub const LANE_KEY_LEN: usize = 24;

/// An allocation's lane key: 192 random bits.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct LaneKey(pub [u8; LANE_KEY_LEN]);

impl LaneKey {
    /// A fresh key from the kernel's random source (`/dev/urandom`).
    ///
    /// # Errors
    ///
    /// The error of opening or reading `/dev/urandom`.
    pub fn random() -> std::io::Result<LaneKey> {
        use std::io::Read;
        let mut key = [0u8; LANE_KEY_LEN];
        std::fs::File::open("/dev/urandom")?.read_exact(&mut key)?;
        Ok(LaneKey(key))
    }

    /// Lower-case hex, as the control messages carry it.
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Parses [`to_hex`](Self::to_hex)'s form.
    ///
    /// # Errors
    ///
    /// [`ProtoError::BadLaneKey`] unless `s` is exactly 48 hex digits.
    pub fn from_hex(s: &str) -> Result<LaneKey, ProtoError> {
        let bytes = s.as_bytes();
        if bytes.len() != 2 * LANE_KEY_LEN {
            return Err(ProtoError::BadLaneKey);
        }
        let mut key = [0u8; LANE_KEY_LEN];
        for (k, pair) in key.iter_mut().zip(bytes.chunks_exact(2)) {
            let hex = std::str::from_utf8(pair).map_err(|_| ProtoError::BadLaneKey)?;
            *k = u8::from_str_radix(hex, 16).map_err(|_| ProtoError::BadLaneKey)?;
        }
        Ok(LaneKey(key))
    }

    /// Compares in time independent of where the keys differ.
    pub fn matches(&self, other: &LaneKey) -> bool {
        self.0
            .iter()
            .zip(&other.0)
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
    }
}

impl fmt::Debug for LaneKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never in logs.
        f.write_str("LaneKey(..)")
    }
}

/// The first message on a lane.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaneHello {
    /// Which lane (connection order) the client means.
    pub lane: u32,
    /// The allocation's key.
    pub key: LaneKey,
}

impl LaneHello {
    /// Encoded size.
    pub const LEN: usize = 32;

    /// Writes the hello into `buf[..LEN]`.
    ///
    /// # Errors
    ///
    /// [`ProtoError::BufferTooShort`] when `buf` is shorter than [`Self::LEN`].
    pub fn encode(&self, buf: &mut [u8]) -> Result<(), ProtoError> {
        let buf = sized(buf.len(), buf)?;
        buf[..LANE].copy_from_slice(&MAGIC);
        buf[LANE..KEY].copy_from_slice(&self.lane.to_le_bytes());
        buf[KEY..Self::LEN].copy_from_slice(&self.key.0);
        Ok(())
    }

    /// Reads a hello from `buf[..LEN]`.
    ///
    /// # Errors
    ///
    /// [`ProtoError::BufferTooShort`], or [`ProtoError::NotALaneHello`] when
    /// the magic is wrong.
    pub fn decode(buf: &[u8]) -> Result<LaneHello, ProtoError> {
        if buf.len() < Self::LEN {
            return Err(ProtoError::BufferTooShort {
                what: "lane hello",
                needed: Self::LEN,
                len: buf.len(),
            });
        }
        if buf[..LANE] != MAGIC {
            return Err(ProtoError::NotALaneHello);
        }
        let mut key = [0u8; LANE_KEY_LEN];
        key.copy_from_slice(&buf[KEY..Self::LEN]);
        Ok(LaneHello {
            lane: u32::from_le_bytes(buf[LANE..KEY].try_into().expect("4 bytes")),
            key: LaneKey(key),
        })
    }
}

fn sized(len: usize, buf: &mut [u8]) -> Result<&mut [u8], ProtoError> {
    if len < LaneHello::LEN {
        return Err(ProtoError::BufferTooShort {
            what: "lane hello",
            needed: LaneHello::LEN,
            len,
        });
    }
    Ok(&mut buf[..LaneHello::LEN])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> LaneKey {
        let mut k = [0u8; LANE_KEY_LEN];
        for (i, b) in k.iter_mut().enumerate() {
            *b = i as u8 + 0xa0;
        }
        LaneKey(k)
    }

    #[test]
    fn bytes_are_as_documented() {
        let mut buf = [0xeeu8; 40];
        LaneHello {
            lane: 3,
            key: key(),
        }
        .encode(&mut buf)
        .unwrap();
        assert_eq!(&buf[..4], b"RFLH");
        assert_eq!(&buf[4..8], &[3, 0, 0, 0]);
        assert_eq!(buf[8], 0xa0);
        assert_eq!(buf[31], 0xa0 + 23);
        assert_eq!(&buf[32..], &[0xee; 8], "nothing past 32 bytes");
        assert_eq!(LANE_HELLO_IMM.to_le_bytes(), *b"RFLH");
        let back = LaneHello::decode(&buf).unwrap();
        assert_eq!(
            back,
            LaneHello {
                lane: 3,
                key: key()
            }
        );
    }

    #[test]
    fn bad_hellos_are_refused() {
        let mut buf = [0u8; 32];
        LaneHello {
            lane: 0,
            key: key(),
        }
        .encode(&mut buf)
        .unwrap();
        buf[0] = b'X';
        assert_eq!(LaneHello::decode(&buf), Err(ProtoError::NotALaneHello));
        assert!(matches!(
            LaneHello::decode(&buf[..31]),
            Err(ProtoError::BufferTooShort {
                needed: 32,
                len: 31,
                ..
            })
        ));
        assert!(LaneHello {
            lane: 0,
            key: key()
        }
        .encode(&mut [0u8; 16])
        .is_err());
    }

    #[test]
    fn keys_round_trip_as_hex_and_compare() {
        let k = key();
        let hex = k.to_hex();
        assert_eq!(hex.len(), 48);
        assert!(hex.starts_with("a0a1a2"));
        assert_eq!(LaneKey::from_hex(&hex).unwrap(), k);
        assert!(k.matches(&k));
        let mut other = k;
        other.0[23] ^= 1;
        assert!(!k.matches(&other));
        for bad in [
            "",
            "a0",
            &hex[..47],
            &format!("{}zz", &hex[..46]),
            &format!("{hex}00"),
        ] {
            assert_eq!(
                LaneKey::from_hex(bad),
                Err(ProtoError::BadLaneKey),
                "{bad:?}"
            );
        }
        assert_eq!(format!("{k:?}"), "LaneKey(..)", "keys stay out of logs");
    }

    #[test]
    fn random_keys_differ() {
        let a = LaneKey::random().unwrap();
        let b = LaneKey::random().unwrap();
        assert!(!a.matches(&b));
    }
}

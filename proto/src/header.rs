//! [`InvocationHeader`]: the 32 bytes a client writes in front of the payload
//! into a worker's input buffer. The layout diagram is in the
//! [crate documentation](crate#invocation-header).

use crate::error::ProtoError;

// Field offsets; encode and decode both read them from here.
const OUTPUT_ADDR: usize = 0;
const OUTPUT_RKEY: usize = 8;
const OUTPUT_CAPACITY: usize = 12;
const INPUT_ADDR: usize = 16;
const INPUT_RKEY: usize = 24;
const INPUT_LEN: usize = 28;

/// Where the worker answers: the client's output buffer, as the header's
/// first 16 bytes name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ReplyTo {
    /// Address of the client's output buffer.
    pub addr: u64,
    /// Its remote key.
    pub rkey: u32,
    /// Bytes the worker may write there.
    pub capacity: u32,
}

/// Where the worker writes the output and where it finds the input.
///
/// The payload is *inline* (it follows the header in the same write) when
/// `input_rkey` is 0, and then `input_addr` must be 0 too. Otherwise it is
/// *bulk*: the worker reads `input_len` bytes from `input_addr` with
/// `input_rkey`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct InvocationHeader {
    /// Address of the client's output buffer.
    pub output_addr: u64,
    /// Remote key of the client's output buffer.
    pub output_rkey: u32,
    /// Bytes the worker may write into the output buffer; 0 is allowed (the
    /// function has no output).
    pub output_capacity: u32,
    /// Source address of a bulk payload; 0 when the payload is inline.
    pub input_addr: u64,
    /// Remote key of a bulk payload; 0 when the payload is inline.
    pub input_rkey: u32,
    /// Total payload length in bytes.
    pub input_len: u32,
}

impl InvocationHeader {
    /// Encoded size in bytes.
    pub const LEN: usize = 32;

    /// Whether the payload follows the header in the input buffer rather than
    /// waiting to be read from the client.
    pub const fn is_inline(&self) -> bool {
        self.input_rkey == 0
    }

    /// Where the worker answers this request.
    pub const fn reply_to(&self) -> ReplyTo {
        ReplyTo {
            addr: self.output_addr,
            rkey: self.output_rkey,
            capacity: self.output_capacity,
        }
    }

    /// Where to answer the request whose header is `buf`, read without
    /// checking the rest of the header: a request whose header does not
    /// [`decode`](Self::decode) is still answered (`malformed_request`) at
    /// the output buffer it names.
    ///
    /// Hot path: no allocation.
    pub fn peek_reply_to(buf: &[u8; Self::LEN]) -> ReplyTo {
        ReplyTo {
            addr: read_u64(buf, OUTPUT_ADDR),
            rkey: read_u32(buf, OUTPUT_RKEY),
            capacity: read_u32(buf, OUTPUT_CAPACITY),
        }
    }

    /// Checks the rules [`decode`](Self::decode) enforces, so a client can
    /// catch a bad header before sending it.
    ///
    /// # Errors
    ///
    /// [`ProtoError::InlineWithAddress`] when `input_rkey` is 0 but
    /// `input_addr` is not.
    pub const fn validate(&self) -> Result<(), ProtoError> {
        if self.input_rkey == 0 && self.input_addr != 0 {
            return Err(ProtoError::InlineWithAddress {
                input_addr: self.input_addr,
            });
        }
        Ok(())
    }

    /// Checks that an inline payload is as long as the header says.
    /// `bytes_after_header` is the completion's byte length minus
    /// [`LEN`](Self::LEN). For a bulk header there is nothing to check and
    /// this returns `Ok`.
    ///
    /// Hot path: no allocation.
    ///
    /// # Errors
    ///
    /// [`ProtoError::InlineLengthMismatch`] when the header is inline and
    /// `input_len` differs from `bytes_after_header`.
    pub const fn validate_inline(&self, bytes_after_header: u32) -> Result<(), ProtoError> {
        if self.is_inline() && self.input_len != bytes_after_header {
            return Err(ProtoError::InlineLengthMismatch {
                input_len: self.input_len,
                arrived: bytes_after_header,
            });
        }
        Ok(())
    }

    /// Writes the header into the first [`LEN`](Self::LEN) bytes of `out`,
    /// leaving the rest of `out` untouched. Does not [`validate`](Self::validate).
    ///
    /// Hot path: no allocation.
    ///
    /// # Errors
    ///
    /// [`ProtoError::BufferTooShort`] when `out` is shorter than
    /// [`LEN`](Self::LEN); `out` is then untouched.
    pub fn encode(&self, out: &mut [u8]) -> Result<(), ProtoError> {
        let len = out.len();
        let Some(out) = out.first_chunk_mut::<{ Self::LEN }>() else {
            return Err(too_short(len));
        };
        self.write(out);
        Ok(())
    }

    /// The encoded header. Does not [`validate`](Self::validate).
    ///
    /// Hot path: no allocation.
    pub fn to_bytes(&self) -> [u8; Self::LEN] {
        let mut out = [0; Self::LEN];
        self.write(&mut out);
        out
    }

    fn write(&self, out: &mut [u8; Self::LEN]) {
        out[OUTPUT_ADDR..OUTPUT_RKEY].copy_from_slice(&self.output_addr.to_le_bytes());
        out[OUTPUT_RKEY..OUTPUT_CAPACITY].copy_from_slice(&self.output_rkey.to_le_bytes());
        out[OUTPUT_CAPACITY..INPUT_ADDR].copy_from_slice(&self.output_capacity.to_le_bytes());
        out[INPUT_ADDR..INPUT_RKEY].copy_from_slice(&self.input_addr.to_le_bytes());
        out[INPUT_RKEY..INPUT_LEN].copy_from_slice(&self.input_rkey.to_le_bytes());
        out[INPUT_LEN..Self::LEN].copy_from_slice(&self.input_len.to_le_bytes());
    }

    /// Reads a header from the first [`LEN`](Self::LEN) bytes of `buf` (the
    /// payload may follow) and [`validate`](Self::validate)s it.
    ///
    /// Hot path: no allocation.
    ///
    /// # Errors
    ///
    /// [`ProtoError::BufferTooShort`] when `buf` is shorter than
    /// [`LEN`](Self::LEN); [`ProtoError::InlineWithAddress`] when the header
    /// is inconsistent.
    pub fn decode(buf: &[u8]) -> Result<Self, ProtoError> {
        let Some(buf) = buf.first_chunk::<{ Self::LEN }>() else {
            return Err(too_short(buf.len()));
        };
        let header = InvocationHeader {
            output_addr: read_u64(buf, OUTPUT_ADDR),
            output_rkey: read_u32(buf, OUTPUT_RKEY),
            output_capacity: read_u32(buf, OUTPUT_CAPACITY),
            input_addr: read_u64(buf, INPUT_ADDR),
            input_rkey: read_u32(buf, INPUT_RKEY),
            input_len: read_u32(buf, INPUT_LEN),
        };
        header.validate()?;
        Ok(header)
    }
}

const fn too_short(len: usize) -> ProtoError {
    ProtoError::BufferTooShort {
        what: "invocation header",
        needed: InvocationHeader::LEN,
        len,
    }
}

fn read_u64(buf: &[u8; InvocationHeader::LEN], at: usize) -> u64 {
    let mut word = [0; 8];
    word.copy_from_slice(&buf[at..at + 8]);
    u64::from_le_bytes(word)
}

fn read_u32(buf: &[u8; InvocationHeader::LEN], at: usize) -> u32 {
    let mut word = [0; 4];
    word.copy_from_slice(&buf[at..at + 4]);
    u32::from_le_bytes(word)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every byte distinct, so a swapped or misplaced field shows.
    const KNOWN: InvocationHeader = InvocationHeader {
        output_addr: 0x0102_0304_0506_0708,
        output_rkey: 0x090A_0B0C,
        output_capacity: 0x0D0E_0F10,
        input_addr: 0x1112_1314_1516_1718,
        input_rkey: 0x191A_1B1C,
        input_len: 0x1D1E_1F20,
    };

    #[rustfmt::skip]
    const KNOWN_BYTES: [u8; 32] = [
        0x08, 0x07, 0x06, 0x05, 0x04, 0x03, 0x02, 0x01, // output_addr
        0x0C, 0x0B, 0x0A, 0x09,                         // output_rkey
        0x10, 0x0F, 0x0E, 0x0D,                         // output_capacity
        0x18, 0x17, 0x16, 0x15, 0x14, 0x13, 0x12, 0x11, // input_addr
        0x1C, 0x1B, 0x1A, 0x19,                         // input_rkey
        0x20, 0x1F, 0x1E, 0x1D,                         // input_len
    ];

    /// What a client sends for a 100-byte inline payload.
    const INLINE: InvocationHeader = InvocationHeader {
        output_addr: 0x7F00_DEAD_B000,
        output_rkey: 0x1234,
        output_capacity: 4096,
        input_addr: 0,
        input_rkey: 0,
        input_len: 100,
    };

    #[rustfmt::skip]
    const INLINE_BYTES: [u8; 32] = [
        0x00, 0xB0, 0xAD, 0xDE, 0x00, 0x7F, 0x00, 0x00, // output_addr
        0x34, 0x12, 0x00, 0x00,                         // output_rkey
        0x00, 0x10, 0x00, 0x00,                         // output_capacity
        0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, // input_addr
        0x00, 0x00, 0x00, 0x00,                         // input_rkey
        0x64, 0x00, 0x00, 0x00,                         // input_len
    ];

    #[test]
    fn known_header_exact_bytes() {
        assert_eq!(KNOWN.to_bytes(), KNOWN_BYTES);
        let mut out = [0xAA; 32];
        KNOWN.encode(&mut out).unwrap();
        assert_eq!(out, KNOWN_BYTES);
        assert_eq!(InvocationHeader::decode(&KNOWN_BYTES), Ok(KNOWN));
    }

    #[test]
    fn the_reply_address_is_the_first_16_bytes() {
        let expected = ReplyTo {
            addr: 0x0102_0304_0506_0708,
            rkey: 0x090A_0B0C,
            capacity: 0x0D0E_0F10,
        };
        assert_eq!(KNOWN.reply_to(), expected);
        assert_eq!(InvocationHeader::peek_reply_to(&KNOWN_BYTES), expected);
        // The rest of the header does not matter, even when it is malformed.
        let mut bad = KNOWN_BYTES;
        bad[16..].fill(0xFF);
        bad[24..28].fill(0); // inline rkey with an address: does not decode
        assert!(InvocationHeader::decode(&bad).is_err());
        assert_eq!(InvocationHeader::peek_reply_to(&bad), expected);
        assert_eq!(
            InvocationHeader::peek_reply_to(&INLINE_BYTES),
            ReplyTo {
                addr: 0x7F00_DEAD_B000,
                rkey: 0x1234,
                capacity: 4096
            }
        );
    }

    #[test]
    fn inline_header_exact_bytes() {
        assert_eq!(INLINE.to_bytes(), INLINE_BYTES);
        assert_eq!(InvocationHeader::decode(&INLINE_BYTES), Ok(INLINE));
        assert!(INLINE.is_inline());
        assert!(!KNOWN.is_inline());
    }

    #[test]
    fn encode_leaves_bytes_after_the_header_untouched() {
        let mut out = [0xAA; 40];
        KNOWN.encode(&mut out).unwrap();
        assert_eq!(out[..32], KNOWN_BYTES);
        assert_eq!(out[32..], [0xAA; 8]);
    }

    #[test]
    fn decode_ignores_the_payload_after_the_header() {
        let mut buf = [0xEE; 32 + 100];
        buf[..32].copy_from_slice(&INLINE_BYTES);
        assert_eq!(InvocationHeader::decode(&buf), Ok(INLINE));
    }

    #[test]
    fn round_trips_at_boundaries() {
        let u64s = [0, 1, u64::MAX - 1, u64::MAX];
        let u32s = [0, 1, u32::MAX - 1, u32::MAX];
        for addr in u64s {
            for word in u32s {
                let header = InvocationHeader {
                    output_addr: addr,
                    output_rkey: word,
                    output_capacity: word,
                    input_addr: addr,
                    // Nonzero so that every input_addr is valid.
                    input_rkey: word.max(1),
                    input_len: word,
                };
                assert_eq!(InvocationHeader::decode(&header.to_bytes()), Ok(header));
                let inline = InvocationHeader {
                    input_addr: 0,
                    input_rkey: 0,
                    ..header
                };
                assert_eq!(InvocationHeader::decode(&inline.to_bytes()), Ok(inline));
            }
        }
    }

    #[test]
    fn decode_rejects_every_short_length() {
        for len in 0..InvocationHeader::LEN {
            assert_eq!(
                InvocationHeader::decode(&KNOWN_BYTES[..len]),
                Err(ProtoError::BufferTooShort {
                    what: "invocation header",
                    needed: 32,
                    len
                }),
                "len {len}"
            );
        }
    }

    #[test]
    fn encode_rejects_every_short_length_and_writes_nothing() {
        for len in 0..InvocationHeader::LEN {
            let mut out = [0xAA; 32];
            assert_eq!(
                KNOWN.encode(&mut out[..len]),
                Err(ProtoError::BufferTooShort {
                    what: "invocation header",
                    needed: 32,
                    len
                }),
                "len {len}"
            );
            assert_eq!(out, [0xAA; 32], "len {len}");
        }
    }

    #[test]
    fn decode_rejects_inline_rkey_with_an_address() {
        for input_addr in [1, 0x1000, u64::MAX] {
            let bad = InvocationHeader {
                input_addr,
                ..INLINE
            };
            let err = ProtoError::InlineWithAddress { input_addr };
            assert_eq!(bad.validate(), Err(err));
            assert_eq!(InvocationHeader::decode(&bad.to_bytes()), Err(err));
        }
    }

    #[test]
    fn bulk_header_may_have_address_zero() {
        // A zero-based memory region starts at address 0.
        let bulk = InvocationHeader {
            input_addr: 0,
            input_rkey: 7,
            ..INLINE
        };
        assert_eq!(InvocationHeader::decode(&bulk.to_bytes()), Ok(bulk));
        assert!(!bulk.is_inline());
    }

    #[test]
    fn empty_output_is_allowed() {
        let header = InvocationHeader {
            output_capacity: 0,
            output_rkey: 0x1234,
            ..INLINE
        };
        assert_eq!(InvocationHeader::decode(&header.to_bytes()), Ok(header));
    }

    #[test]
    fn validate_inline_checks_the_arrived_length() {
        assert_eq!(INLINE.validate_inline(100), Ok(()));
        for arrived in [0, 99, 101, u32::MAX] {
            assert_eq!(
                INLINE.validate_inline(arrived),
                Err(ProtoError::InlineLengthMismatch {
                    input_len: 100,
                    arrived
                })
            );
        }
        let empty = InvocationHeader {
            input_len: 0,
            ..INLINE
        };
        assert_eq!(empty.validate_inline(0), Ok(()));
    }

    #[test]
    fn validate_inline_accepts_any_length_for_bulk() {
        for arrived in [0, 100, u32::MAX] {
            assert_eq!(KNOWN.validate_inline(arrived), Ok(()));
        }
    }

    #[test]
    fn messages_name_the_value() {
        assert_eq!(
            ProtoError::BufferTooShort {
                what: "invocation header",
                needed: 32,
                len: 5
            }
            .to_string(),
            "the invocation header is 32 bytes, but the buffer given for it is only 5 bytes long"
        );
        assert_eq!(
            ProtoError::BufferTooShort {
                what: "invocation header",
                needed: 32,
                len: 1
            }
            .to_string(),
            "the invocation header is 32 bytes, but the buffer given for it is only 1 byte long"
        );
        assert_eq!(
            ProtoError::InlineWithAddress { input_addr: 0x1000 }.to_string(),
            "invocation header has input_rkey 0, which marks an inline payload, \
             but input_addr is 0x1000; an inline payload must have input_addr 0"
        );
        assert_eq!(
            ProtoError::InlineLengthMismatch {
                input_len: 100,
                arrived: 99
            }
            .to_string(),
            "invocation header declares an inline payload of 100 bytes, \
             but 99 bytes arrived after the header"
        );
    }
}

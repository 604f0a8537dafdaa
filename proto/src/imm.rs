//! Immediate values: the 32 bits carried by a write-with-immediate.
//!
//! [`RequestImm`] rides on the client's write of header and payload;
//! [`ResponseImm`] on the worker's write of the output. Both put the
//! invocation id in bits 31..12, so a client matches a response to its
//! request by those bits alone. Layout diagrams are in the
//! [crate documentation](crate#immediate-values).

use crate::error::ProtoError;
use crate::status::InvocationStatus;

/// The largest invocation id: ids take the 20 high bits of an immediate.
pub const MAX_INVOCATION_ID: u32 = (1 << 20) - 1;

/// The number of entries a function table may have: indices take the 12 low
/// bits of a request immediate, so they run from 0 to `MAX_FUNCTIONS - 1`.
pub const MAX_FUNCTIONS: u16 = 1 << 12;

/// Bits below the invocation id.
const ID_SHIFT: u32 = 12;
/// The 12 low bits: function index (request) or status code (response).
const LOW_MASK: u32 = (1 << ID_SHIFT) - 1;

/// The invocation id that follows `id`: `id + 1`, wrapping to 0 after
/// [`MAX_INVOCATION_ID`]. An `id` beyond the maximum also yields 0, so the
/// result always encodes.
///
/// Hot path: no allocation.
pub const fn next_invocation_id(id: u32) -> u32 {
    if id >= MAX_INVOCATION_ID {
        0
    } else {
        id + 1
    }
}

const fn check_invocation_id(id: u32) -> Result<(), ProtoError> {
    if id > MAX_INVOCATION_ID {
        Err(ProtoError::InvocationIdOutOfRange { id })
    } else {
        Ok(())
    }
}

/// The immediate of a request: which invocation, which function.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RequestImm {
    /// Invocation id, at most [`MAX_INVOCATION_ID`].
    pub invocation_id: u32,
    /// Index into the allocation's function table, below [`MAX_FUNCTIONS`].
    pub function_index: u16,
}

impl RequestImm {
    /// Packs the fields into an immediate.
    ///
    /// Hot path: no allocation.
    ///
    /// # Errors
    ///
    /// [`ProtoError::InvocationIdOutOfRange`] or
    /// [`ProtoError::FunctionIndexOutOfRange`] when a field does not fit its
    /// bits.
    pub const fn encode(self) -> Result<u32, ProtoError> {
        if let Err(e) = check_invocation_id(self.invocation_id) {
            return Err(e);
        }
        if self.function_index >= MAX_FUNCTIONS {
            return Err(ProtoError::FunctionIndexOutOfRange {
                index: self.function_index,
            });
        }
        Ok((self.invocation_id << ID_SHIFT) | self.function_index as u32)
    }

    /// Unpacks an immediate. Every `u32` is a valid request immediate;
    /// whether the function index is in the table is the worker's check
    /// ([`InvocationStatus::UnknownFunction`]).
    ///
    /// Hot path: no allocation.
    pub const fn decode(imm: u32) -> RequestImm {
        RequestImm {
            invocation_id: imm >> ID_SHIFT,
            // Masked to 12 bits, so the cast cannot truncate.
            function_index: (imm & LOW_MASK) as u16,
        }
    }
}

/// The immediate of a response: which invocation, and how it ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ResponseImm {
    /// Invocation id of the request this answers, at most
    /// [`MAX_INVOCATION_ID`].
    pub invocation_id: u32,
    /// How the invocation ended.
    pub status: InvocationStatus,
}

impl ResponseImm {
    /// Packs the fields into an immediate.
    ///
    /// Hot path: no allocation.
    ///
    /// # Errors
    ///
    /// [`ProtoError::InvocationIdOutOfRange`] when the id does not fit its
    /// bits. (Every status code fits.)
    pub const fn encode(self) -> Result<u32, ProtoError> {
        if let Err(e) = check_invocation_id(self.invocation_id) {
            return Err(e);
        }
        Ok((self.invocation_id << ID_SHIFT) | self.status.code() as u32)
    }

    /// Unpacks an immediate.
    ///
    /// Hot path: no allocation.
    ///
    /// # Errors
    ///
    /// [`ProtoError::UnknownStatus`] when the low 12 bits are not a code this
    /// protocol version defines.
    pub fn decode(imm: u32) -> Result<ResponseImm, ProtoError> {
        // Masked to 12 bits, so the cast cannot truncate.
        let status = InvocationStatus::try_from((imm & LOW_MASK) as u16)?;
        Ok(ResponseImm {
            invocation_id: imm >> ID_SHIFT,
            status,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Marsaglia's xorshift32: deterministic, no dependency.
    struct XorShift32(u32);

    impl XorShift32 {
        fn next(&mut self) -> u32 {
            let mut x = self.0;
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            self.0 = x;
            x
        }
    }

    fn req(invocation_id: u32, function_index: u16) -> RequestImm {
        RequestImm {
            invocation_id,
            function_index,
        }
    }

    fn resp(invocation_id: u32, status: InvocationStatus) -> ResponseImm {
        ResponseImm {
            invocation_id,
            status,
        }
    }

    #[test]
    fn request_exact_bits() {
        let cases: [(RequestImm, u32); 6] = [
            (req(0, 0), 0x0000_0000),
            (req(1, 2), 0x0000_1002),
            (req(0, 1), 0x0000_0001),
            (req(1, 0), 0x0000_1000),
            (req(0xABCDE, 0x123), 0xABCD_E123),
            (req(MAX_INVOCATION_ID, 4095), 0xFFFF_FFFF),
        ];
        for (imm, bits) in cases {
            assert_eq!(imm.encode(), Ok(bits), "{imm:?}");
            assert_eq!(RequestImm::decode(bits), imm, "{bits:#010x}");
        }
    }

    #[test]
    fn response_exact_bits() {
        let cases: [(ResponseImm, u32); 5] = [
            (resp(0, InvocationStatus::Ok), 0x0000_0000),
            (resp(1, InvocationStatus::FunctionCrashed), 0x0000_1001),
            (resp(7, InvocationStatus::InternalError), 0x0000_7009),
            (
                resp(0xABCDE, InvocationStatus::ExecutorDraining),
                0xABCD_E004,
            ),
            (resp(MAX_INVOCATION_ID, InvocationStatus::Ok), 0xFFFF_F000),
        ];
        for (imm, bits) in cases {
            assert_eq!(imm.encode(), Ok(bits), "{imm:?}");
            assert_eq!(ResponseImm::decode(bits), Ok(imm), "{bits:#010x}");
        }
    }

    #[test]
    fn request_round_trips_at_boundaries() {
        for id in [0, 1, MAX_INVOCATION_ID - 1, MAX_INVOCATION_ID] {
            for index in [0, 1, MAX_FUNCTIONS - 2, MAX_FUNCTIONS - 1] {
                let imm = req(id, index);
                let bits = imm.encode().unwrap();
                assert_eq!(RequestImm::decode(bits), imm);
            }
        }
    }

    #[test]
    fn response_round_trips_at_boundaries() {
        for id in [0, 1, MAX_INVOCATION_ID - 1, MAX_INVOCATION_ID] {
            for status in InvocationStatus::ALL {
                let imm = resp(id, status);
                let bits = imm.encode().unwrap();
                assert_eq!(ResponseImm::decode(bits), Ok(imm));
            }
        }
    }

    #[test]
    fn request_rejects_overflowing_invocation_id() {
        for id in [MAX_INVOCATION_ID + 1, 1 << 24, u32::MAX] {
            assert_eq!(
                req(id, 0).encode(),
                Err(ProtoError::InvocationIdOutOfRange { id })
            );
        }
    }

    #[test]
    fn request_rejects_overflowing_function_index() {
        for index in [MAX_FUNCTIONS, MAX_FUNCTIONS + 1, u16::MAX] {
            assert_eq!(
                req(0, index).encode(),
                Err(ProtoError::FunctionIndexOutOfRange { index })
            );
        }
    }

    #[test]
    fn response_rejects_overflowing_invocation_id() {
        for id in [MAX_INVOCATION_ID + 1, u32::MAX] {
            assert_eq!(
                resp(id, InvocationStatus::Ok).encode(),
                Err(ProtoError::InvocationIdOutOfRange { id })
            );
        }
    }

    #[test]
    fn response_rejects_every_unknown_status_code() {
        for code in 10..=0xFFF_u16 {
            for id in [0, MAX_INVOCATION_ID] {
                let bits = (id << ID_SHIFT) | u32::from(code);
                assert_eq!(
                    ResponseImm::decode(bits),
                    Err(ProtoError::UnknownStatus { code }),
                    "{bits:#010x}"
                );
            }
        }
    }

    #[test]
    fn request_decode_encode_round_trips_pseudo_random_values() {
        let mut rng = XorShift32(0x2545_F491);
        for _ in 0..10_000 {
            let bits = rng.next();
            assert_eq!(RequestImm::decode(bits).encode(), Ok(bits), "{bits:#010x}");
        }
    }

    #[test]
    fn response_round_trips_pseudo_random_values() {
        let mut rng = XorShift32(0x9E37_79B9);
        for _ in 0..10_000 {
            let bits = rng.next();
            let code = (bits & LOW_MASK) as u16;
            match ResponseImm::decode(bits) {
                Ok(imm) => {
                    assert!(code <= InvocationStatus::MAX_CODE);
                    assert_eq!(imm.encode(), Ok(bits), "{bits:#010x}");
                }
                Err(e) => assert_eq!(e, ProtoError::UnknownStatus { code }),
            }
        }
    }

    #[test]
    fn next_invocation_id_wraps() {
        assert_eq!(next_invocation_id(0), 1);
        assert_eq!(next_invocation_id(1), 2);
        assert_eq!(next_invocation_id(MAX_INVOCATION_ID - 1), MAX_INVOCATION_ID);
        assert_eq!(next_invocation_id(MAX_INVOCATION_ID), 0);
        assert_eq!(next_invocation_id(MAX_INVOCATION_ID + 1), 0);
        assert_eq!(next_invocation_id(u32::MAX), 0);
    }

    #[test]
    fn overflow_messages_name_the_value_and_the_limit() {
        assert_eq!(
            ProtoError::InvocationIdOutOfRange { id: 1 << 20 }.to_string(),
            "invocation id 1048576 does not fit in 20 bits; the largest invocation id is 1048575"
        );
        assert_eq!(
            ProtoError::FunctionIndexOutOfRange { index: 4096 }.to_string(),
            "function index 4096 does not fit in 12 bits; a function table holds at most \
             4096 functions, indices 0 through 4095"
        );
    }
}

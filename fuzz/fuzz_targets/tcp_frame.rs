//! Fuzzes the tcp provider's frame decoder (`rfaas_proto::tcp_frame`).
//!
//! Any panic is a bug: the decoder reads bytes straight off a socket, so it
//! must answer every input with a header or a `FrameError`.

#![no_main]

use libfuzzer_sys::fuzz_target;
use rfaas_proto::tcp_frame::{walk, FrameHeader, HEADER_LEN, MAX_PAYLOAD};

fuzz_target!(|data: &[u8]| {
    // The stream as the provider reads it.
    let _ = walk(data);

    // Every 40-byte window, so a header is tried at each offset, not only at
    // the frame boundaries `walk` happens to reach.
    for window in data.windows(HEADER_LEN) {
        let bytes: &[u8; HEADER_LEN] = window.try_into().expect("windows are HEADER_LEN long");
        let Ok(header) = FrameHeader::decode(bytes) else {
            continue;
        };
        // Canonical: only one byte string decodes to a given header, so a
        // peer cannot smuggle bits the decoder ignores.
        let encoded = header.encode();
        assert_eq!(
            &encoded, bytes,
            "decode accepted a non-canonical encoding of {header}"
        );
        assert_eq!(
            FrameHeader::decode(&encoded),
            Ok(header),
            "re-decoding {header}"
        );
        assert!(
            header.payload_len() <= MAX_PAYLOAD,
            "decode accepted payload length {} > {MAX_PAYLOAD}",
            header.payload_len()
        );
    }
});

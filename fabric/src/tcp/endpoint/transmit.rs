//! The transmit side of a connection: frames go out at once when the
//! socket takes them, and wait in the transmit queue when it does not.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use rfaas_proto::tcp_frame::{FrameHeader, HEADER_LEN};

use super::{EpShared, EpState, TxItem};
use crate::memory::Buffer;

/// Frames up to this size (header included) are copied into one buffer
/// and sent with one plain `write`.
const SMALL_FRAME: usize = 1024;
/// Frames gathered into one `writev`.
const WRITEV_ITEMS: usize = 16;

impl TxItem {
    pub(super) fn total(&self) -> usize {
        HEADER_LEN + self.payload.as_ref().map_or(0, |p| p.2)
    }
}

impl EpShared {
    /// Sends a frame now if the queue is empty and the socket takes it,
    /// otherwise queues (the rest of) it. Stamps the cumulative ack.
    pub(super) fn send(
        &self,
        st: &mut EpState,
        mut header: FrameHeader,
        payload: Option<(&Arc<Buffer>, usize, usize)>,
    ) {
        header.ack = st.done_seq;
        if st.unacked > 0 {
            st.unacked = 0;
            self.ack_owed.store(false, Ordering::Relaxed);
        }
        st.idle_polls = 0;
        let bytes = header.encode();
        let mut sent = 0;
        let small = payload.map_or(0, |p| p.2);
        if st.txq.is_empty() && small <= SMALL_FRAME - HEADER_LEN {
            // Small frames go out as one contiguous buffer: one plain write.
            let mut frame = [0u8; SMALL_FRAME];
            frame[..HEADER_LEN].copy_from_slice(&bytes);
            if let Some((buf, off, len)) = payload {
                // SAFETY: off + len lies inside buf (checked when posting or
                // by the region table) and fits in `frame` (checked above).
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        buf.as_ptr().add(off),
                        frame.as_mut_ptr().add(HEADER_LEN),
                        len,
                    )
                };
            }
            let iov = [libc::iovec {
                iov_base: frame.as_mut_ptr().cast(),
                iov_len: HEADER_LEN + small,
            }];
            match self.writev(&iov) {
                Ok(n) if n == HEADER_LEN + small => return,
                Ok(n) => sent = n,
                Err(e) => {
                    self.fail(st, format!("sending to the peer failed: {e}"));
                    return;
                }
            }
        } else if st.txq.is_empty() {
            let mut iov = [
                libc::iovec {
                    iov_base: bytes.as_ptr() as *mut libc::c_void,
                    iov_len: HEADER_LEN,
                },
                libc::iovec {
                    iov_base: std::ptr::null_mut(),
                    iov_len: 0,
                },
            ];
            let mut count = 1;
            if let Some((buf, off, len)) = payload {
                // SAFETY: off + len lies inside buf (checked when posting or
                // by the region table); only the address is formed here.
                iov[1].iov_base = unsafe { buf.as_ptr().add(off) }.cast();
                iov[1].iov_len = len;
                count = 2;
            }
            match self.writev(&iov[..count]) {
                Ok(n) => sent = n,
                Err(e) => {
                    self.fail(st, format!("sending to the peer failed: {e}"));
                    return;
                }
            }
            let total = HEADER_LEN + payload.map_or(0, |p| p.2);
            if sent == total {
                return;
            }
        }
        st.txq.push_back(TxItem {
            header: bytes,
            payload: payload.map(|(buf, off, len)| (buf.clone(), off, len)),
            sent,
        });
        self.tx_pending.store(true, Ordering::Release);
        self.flush_tx(st);
    }

    /// Sends frames with one `writev` if the transmit queue is empty, and
    /// queues what the socket does not take (all of them behind queued
    /// output). Stamps each with the cumulative ack. At most
    /// `super::BATCH_FRAMES` frames.
    pub(super) fn send_frames(
        &self,
        st: &mut EpState,
        headers: &mut [FrameHeader],
        payloads: &[super::Payload<'_>],
    ) {
        const MAX: usize = super::BATCH_FRAMES;
        debug_assert!(headers.len() <= MAX && headers.len() == payloads.len());
        if st.unacked > 0 {
            st.unacked = 0;
            self.ack_owed.store(false, Ordering::Relaxed);
        }
        st.idle_polls = 0;
        let mut bytes = [[0u8; HEADER_LEN]; MAX];
        for (h, b) in headers.iter_mut().zip(&mut bytes) {
            h.ack = st.done_seq;
            *b = h.encode();
        }
        let mut sent = 0;
        if st.txq.is_empty() {
            let mut iov = [libc::iovec {
                iov_base: std::ptr::null_mut(),
                iov_len: 0,
            }; 2 * MAX];
            let mut count = 0;
            for (b, payload) in bytes.iter().zip(payloads) {
                iov[count] = libc::iovec {
                    iov_base: b.as_ptr() as *mut libc::c_void,
                    iov_len: HEADER_LEN,
                };
                count += 1;
                if let Some((buf, off, len)) = payload {
                    // SAFETY: off + len lies inside buf (checked when
                    // posting); only the address is formed here.
                    let base = unsafe { buf.as_ptr().add(*off) };
                    iov[count] = libc::iovec {
                        iov_base: base.cast(),
                        iov_len: *len,
                    };
                    count += 1;
                }
            }
            match self.writev(&iov[..count]) {
                Ok(n) => sent = n,
                Err(e) => {
                    self.fail(st, format!("sending to the peer failed: {e}"));
                    return;
                }
            }
        }
        for (b, payload) in bytes.iter().zip(payloads) {
            let total = HEADER_LEN + payload.map_or(0, |p| p.2);
            if sent >= total {
                sent -= total;
                continue;
            }
            st.txq.push_back(TxItem {
                header: *b,
                payload: payload.map(|(buf, off, len)| (buf.clone(), off, len)),
                sent,
            });
            sent = 0;
        }
        if !st.txq.is_empty() {
            self.tx_pending.store(true, Ordering::Release);
            self.flush_tx(st);
        }
    }

    /// Non-blocking `writev`; `Ok(0)` when the socket is full.
    fn writev(&self, iov: &[libc::iovec]) -> std::io::Result<usize> {
        loop {
            // SAFETY: every iovec points at memory kept alive by the caller
            // (a stack buffer or an Arc<Buffer>) for the duration of the call.
            let rc = unsafe {
                if let [one] = iov {
                    libc::write(self.fd(), one.iov_base, one.iov_len)
                } else {
                    libc::writev(self.fd(), iov.as_ptr(), iov.len() as i32)
                }
            };
            if rc >= 0 {
                return Ok(rc as usize);
            }
            let err = std::io::Error::last_os_error();
            match err.kind() {
                std::io::ErrorKind::WouldBlock => return Ok(0),
                std::io::ErrorKind::Interrupted => continue,
                _ => return Err(err),
            }
        }
    }

    /// Pushes queued frames into the socket until it is full or they are gone.
    pub(super) fn flush_tx(&self, st: &mut EpState) {
        while !st.txq.is_empty() && st.dead_reason.is_none() {
            let mut iov = [libc::iovec {
                iov_base: std::ptr::null_mut(),
                iov_len: 0,
            }; 2 * WRITEV_ITEMS];
            let mut count = 0;
            for item in st.txq.iter().take(WRITEV_ITEMS) {
                let mut skip = item.sent;
                if skip < HEADER_LEN {
                    iov[count] = libc::iovec {
                        iov_base: item.header[skip..].as_ptr() as *mut libc::c_void,
                        iov_len: HEADER_LEN - skip,
                    };
                    count += 1;
                    skip = 0;
                } else {
                    skip -= HEADER_LEN;
                }
                if let Some((buf, off, len)) = &item.payload {
                    if skip < *len {
                        // SAFETY: off + len lies inside buf, which the item keeps alive.
                        let base = unsafe { buf.as_ptr().add(off + skip) };
                        iov[count] = libc::iovec {
                            iov_base: base.cast(),
                            iov_len: len - skip,
                        };
                        count += 1;
                    }
                }
            }
            let mut sent = match self.writev(&iov[..count]) {
                Ok(0) => return,
                Ok(n) => n,
                Err(e) => {
                    self.fail(st, format!("sending to the peer failed: {e}"));
                    return;
                }
            };
            while sent > 0 {
                let Some(front) = st.txq.front_mut() else {
                    break;
                };
                let left = front.total() - front.sent;
                if sent >= left {
                    sent -= left;
                    st.txq.pop_front();
                } else {
                    front.sent += sent;
                    sent = 0;
                }
            }
        }
        if st.txq.is_empty() {
            self.tx_pending.store(false, Ordering::Release);
        }
    }
}

//! One tcp connection: posting, the receive state machine and the transmit
//! queue.
//!
//! All mutable state sits behind one mutex, [`EpShared::state`]. Posting
//! takes it (held only for a non-blocking send); progress from `poll` and
//! from the progress thread only *tries* it and skips the endpoint when it
//! is busy, so `poll` never waits for a lock.
//!
//! Requests are numbered per direction. The target carries them out in
//! order and acknowledges cumulatively: the `ack` field of every frame it
//! sends names the last request it carried out. Responses (read data, atomic
//! results, refusals) are sent in order too, so the initiator keeps its
//! outstanding operations in a FIFO and completes them from the front.

use std::collections::VecDeque;
use std::net::{Shutdown, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, TryLockError};

use crossbeam_queue::ArrayQueue;
use rfaas_proto::tcp_frame::{FrameHeader, FrameKind, FrameStatus, HEADER_LEN};

use super::cq::{CqShared, TcpCq};
use super::progress;
use crate::completion::{Completion, Opcode, Status};
use crate::error::{Error, Result};
use crate::memory::{Access, Buffer, MemoryRegion, RemoteAddr};
use crate::registry::Registry;
use crate::EndpointOptions;

/// Bytes read from the socket at once into the staging buffer.
const STAGING: usize = 64 * 1024;
/// Payloads at least this long are read straight into the target memory.
const DIRECT_READ: usize = 16 * 1024;
/// Requests after which an acknowledgement goes out on its own, so a
/// stream whose sender keeps only a few in flight is not held up.
const ACK_EVERY: usize = 8;
/// Empty polls after which a pending acknowledgement is sent on its own.
const IDLE_POLLS_BEFORE_ACK: u32 = 64;
/// Frames up to this size (header included) are copied into one buffer
/// and sent with one plain `write`.
const SMALL_FRAME: usize = 1024;
/// Frames gathered into one `writev`.
const WRITEV_ITEMS: usize = 16;

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// The application's handle on a connection. Dropping it closes the
/// connection; the peer sees its operations fail with `PeerLost`.
#[derive(Debug)]
pub(crate) struct TcpEndpoint {
    shared: Arc<EpShared>,
}

/// State shared by the application, its completion queue and the progress thread.
pub(crate) struct EpShared {
    pub(super) id: u64,
    stream: TcpStream,
    peer: String,
    registry: Arc<Registry>,
    pub(super) cq: Arc<CqShared>,
    recvs: ArrayQueue<u64>,
    send_depth: usize,
    /// Acknowledge on our own once this many requests are unacknowledged.
    ack_threshold: u32,
    /// The connection failed; everything completes with `PeerLost`.
    dead: AtomicBool,
    /// The application dropped its endpoint.
    pub(super) closed: AtomicBool,
    /// The transmit queue holds bytes the socket did not take yet.
    pub(super) tx_pending: AtomicBool,
    /// Requests were carried out and no acknowledgement has left yet; the
    /// progress thread sends one if the application stops polling.
    pub(super) ack_owed: AtomicBool,
    state: Mutex<EpState>,
}

impl std::fmt::Debug for EpShared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpEndpoint")
            .field("id", &self.id)
            .field("peer", &self.peer)
            .finish()
    }
}

/// What a receive is doing with the bytes after a header.
enum Rx {
    /// Expecting a frame header.
    Header,
    /// Placing (or, with `dst` None, discarding) `remaining` payload bytes.
    Payload {
        dst: Option<(Arc<Buffer>, usize)>,
        remaining: usize,
        then: AfterPayload,
    },
}

/// What to do once a payload has arrived.
enum AfterPayload {
    /// A write was placed: it is carried out.
    Written {
        seq: u32,
        recv: Option<(u64, u32, u32)>,
    },
    /// A refused write was discarded: refuse it.
    Refused { seq: u32 },
    /// Read data arrived: complete the read.
    ReadDone { wr_id: u64, len: u32, ack: u32 },
}

/// An operation posted and not yet completed.
struct Outstanding {
    seq: u32,
    wr_id: u64,
    opcode: Opcode,
    len: u32,
    /// Where read data or an atomic's old value goes.
    dst: Option<(Arc<Buffer>, usize)>,
}

/// A frame (or its remainder) waiting for the socket.
struct TxItem {
    header: [u8; HEADER_LEN],
    payload: Option<(Arc<Buffer>, usize, usize)>,
    sent: usize,
}

impl TxItem {
    fn total(&self) -> usize {
        HEADER_LEN + self.payload.as_ref().map_or(0, |p| p.2)
    }
}

struct EpState {
    staging: Box<[u8]>,
    start: usize,
    end: usize,
    rx: Rx,
    /// Last request of the peer carried out.
    done_seq: u32,
    /// Requests carried out since the last acknowledgement left.
    unacked: u32,
    idle_polls: u32,
    next_seq: u32,
    outstanding: VecDeque<Outstanding>,
    txq: VecDeque<TxItem>,
    dead_reason: Option<String>,
}

/// What one round of progress did.
#[derive(Clone, Copy, Default)]
pub(super) struct Progress {
    /// Completions were pushed.
    pub(super) completed: bool,
    /// Bytes arrived.
    pub(super) received: bool,
    /// Received frames cannot be processed yet (no posted receive for a
    /// write-with-immediate, or a full completion queue).
    pub(super) stalled: bool,
}

enum Step {
    More,
    Blocked,
    Stalled,
}

/// `a <= b` in wrapping sequence arithmetic.
fn seq_le(a: u32, b: u32) -> bool {
    (b.wrapping_sub(a) as i32) >= 0
}

fn next_seq(seq: u32) -> u32 {
    match seq.wrapping_add(1) {
        0 => 1,
        s => s,
    }
}

impl TcpEndpoint {
    pub(super) fn new(
        stream: TcpStream,
        peer: String,
        registry: Arc<Registry>,
        cq: &mut TcpCq,
        opts: &EndpointOptions,
        peer_send_depth: usize,
    ) -> TcpEndpoint {
        let tx_capacity = opts.send_depth + peer_send_depth + 4;
        let shared = Arc::new(EpShared {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            stream,
            peer,
            registry,
            cq: cq.shared().clone(),
            recvs: ArrayQueue::new(opts.recv_depth),
            send_depth: opts.send_depth,
            ack_threshold: (peer_send_depth / 2).clamp(1, ACK_EVERY) as u32,
            dead: AtomicBool::new(false),
            closed: AtomicBool::new(false),
            tx_pending: AtomicBool::new(false),
            ack_owed: AtomicBool::new(false),
            state: Mutex::new(EpState {
                staging: vec![0u8; STAGING].into_boxed_slice(),
                start: 0,
                end: 0,
                rx: Rx::Header,
                done_seq: 0,
                unacked: 0,
                idle_polls: 0,
                next_seq: 1,
                outstanding: VecDeque::with_capacity(opts.send_depth),
                txq: VecDeque::with_capacity(tx_capacity),
                dead_reason: None,
            }),
        });
        cq.attach(shared.clone(), opts);
        progress::register(shared.clone());
        TcpEndpoint { shared }
    }

    pub(crate) fn peer_addr(&self) -> String {
        self.shared.peer.clone()
    }

    /// Hot path (write-with-immediate is the invocation request and response).
    pub(crate) fn write(
        &self,
        wr_id: u64,
        local: &MemoryRegion,
        offset: usize,
        len: usize,
        remote: RemoteAddr,
        imm: Option<u32>,
    ) -> Result<()> {
        let (kind, opcode, arg1) = match imm {
            Some(imm) => (FrameKind::WriteImm, Opcode::WriteWithImm, u64::from(imm)),
            None => (FrameKind::Write, Opcode::Write, 0),
        };
        let header = FrameHeader {
            rkey: remote.rkey,
            addr: remote.addr,
            arg0: len as u64,
            arg1,
            ..FrameHeader::new(kind)
        };
        let payload = (len > 0).then_some((&local.buf, offset, len));
        self.shared
            .post(header, payload, wr_id, opcode, len as u32, None)
    }

    /// See [`crate::Endpoint::peer_view`]: the peer's memory is not mapped
    /// here, so there is no view; callers read.
    pub(crate) fn peer_view(
        &self,
        _remote: RemoteAddr,
        _len: usize,
    ) -> Option<std::result::Result<crate::PeerView, crate::Status>> {
        None
    }

    pub(crate) fn read(
        &self,
        wr_id: u64,
        local: &MemoryRegion,
        offset: usize,
        len: usize,
        remote: RemoteAddr,
    ) -> Result<()> {
        let header = FrameHeader {
            rkey: remote.rkey,
            addr: remote.addr,
            arg0: len as u64,
            ..FrameHeader::new(FrameKind::ReadReq)
        };
        let dst = Some((local.buf.clone(), offset));
        self.shared
            .post(header, None, wr_id, Opcode::Read, len as u32, dst)
    }

    pub(crate) fn fetch_add(
        &self,
        wr_id: u64,
        local: &MemoryRegion,
        offset: usize,
        remote: RemoteAddr,
        add: u64,
    ) -> Result<()> {
        let header = FrameHeader {
            rkey: remote.rkey,
            addr: remote.addr,
            arg0: add,
            ..FrameHeader::new(FrameKind::FetchAdd)
        };
        let dst = Some((local.buf.clone(), offset));
        self.shared
            .post(header, None, wr_id, Opcode::FetchAdd, 8, dst)
    }

    pub(crate) fn compare_swap(
        &self,
        wr_id: u64,
        local: &MemoryRegion,
        offset: usize,
        remote: RemoteAddr,
        compare: u64,
        swap: u64,
    ) -> Result<()> {
        let header = FrameHeader {
            rkey: remote.rkey,
            addr: remote.addr,
            arg0: compare,
            arg1: swap,
            ..FrameHeader::new(FrameKind::CompareSwap)
        };
        let dst = Some((local.buf.clone(), offset));
        self.shared
            .post(header, None, wr_id, Opcode::CompareSwap, 8, dst)
    }

    /// Hot path: a lock-free push.
    pub(crate) fn post_recv(&self, wr_id: u64) -> Result<()> {
        let shared = &self.shared;
        if shared.recvs.push(wr_id).is_err() {
            return Err(Error::QueueFull {
                what: "the receive queue",
                depth: shared.recvs.capacity(),
            });
        }
        if shared.dead.load(Ordering::SeqCst) {
            shared.flush_recvs();
        }
        Ok(())
    }
}

impl Drop for TcpEndpoint {
    fn drop(&mut self) {
        let shared = &self.shared;
        shared.closed.store(true, Ordering::SeqCst);
        let _ = shared.stream.shutdown(Shutdown::Both);
        shared.cq.forget(shared.fd());
    }
}

impl EpShared {
    pub(super) fn fd(&self) -> RawFd {
        self.stream.as_raw_fd()
    }

    /// Queues one request frame. Hot path for writes.
    fn post(
        &self,
        mut header: FrameHeader,
        payload: Option<(&Arc<Buffer>, usize, usize)>,
        wr_id: u64,
        opcode: Opcode,
        len: u32,
        dst: Option<(Arc<Buffer>, usize)>,
    ) -> Result<()> {
        let mut st = lock(&self.state);
        if st.dead_reason.is_some() {
            drop(st);
            return self.fail_now(wr_id, opcode);
        }
        if st.outstanding.len() >= self.send_depth {
            return Err(Error::QueueFull {
                what: "the send queue",
                depth: self.send_depth,
            });
        }
        let seq = st.next_seq;
        st.next_seq = next_seq(seq);
        header.seq = seq;
        st.outstanding.push_back(Outstanding {
            seq,
            wr_id,
            opcode,
            len,
            dst,
        });
        self.send(&mut st, header, payload);
        let pending = !st.txq.is_empty();
        if st.dead_reason.is_some() {
            self.flush_dead(&mut st);
        }
        drop(st);
        if pending {
            // The socket is full: make sure someone keeps sending if the
            // application stops polling. Slow path only.
            progress::kick(self.id);
        }
        Ok(())
    }

    /// An operation posted on a dead connection completes with `PeerLost`.
    fn fail_now(&self, wr_id: u64, opcode: Opcode) -> Result<()> {
        if !self
            .cq
            .push(Completion::error(wr_id, opcode, Status::PeerLost))
        {
            return Err(Error::QueueFull {
                what: "the completion queue",
                depth: self.cq.capacity(),
            });
        }
        self.cq.notify();
        Ok(())
    }

    /// Sends a frame now if the queue is empty and the socket takes it,
    /// otherwise queues (the rest of) it. Stamps the cumulative ack.
    fn send(
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
    fn flush_tx(&self, st: &mut EpState) {
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

    /// Tries to make progress without waiting for the lock (poll and the
    /// progress thread). `eager` acknowledges at once instead of waiting for
    /// a frame to ride on. Hot path.
    pub(super) fn try_progress(&self, eager: bool) -> Option<Progress> {
        let mut st = match self.state.try_lock() {
            Ok(st) => st,
            Err(TryLockError::WouldBlock) => return None,
            Err(TryLockError::Poisoned(p)) => p.into_inner(),
        };
        Some(self.progress(&mut st, eager))
    }

    fn progress(&self, st: &mut EpState, eager: bool) -> Progress {
        let mut progress = Progress::default();
        if st.dead_reason.is_some() {
            progress.completed = self.flush_dead(st);
            return progress;
        }
        if !st.txq.is_empty() {
            self.flush_tx(st);
        }
        self.receive(st, &mut progress);
        if st.dead_reason.is_some() {
            progress.completed |= self.flush_dead(st);
            return progress;
        }
        if st.unacked > 0 {
            if progress.received {
                st.idle_polls = 0;
            } else {
                st.idle_polls += 1;
            }
            if eager || st.unacked >= self.ack_threshold || st.idle_polls >= IDLE_POLLS_BEFORE_ACK {
                self.send(st, FrameHeader::new(FrameKind::Ack), None);
            } else {
                self.ack_owed.store(true, Ordering::Relaxed);
            }
        }
        progress
    }

    /// Reads and processes frames until the socket is empty or processing stalls.
    fn receive(&self, st: &mut EpState, progress: &mut Progress) {
        for _ in 0..64 {
            match self.process_buffered(st, progress) {
                Step::Stalled => {
                    progress.stalled = true;
                    return;
                }
                Step::Blocked => return,
                Step::More => {}
            }
            let drained = match self.read_some(st) {
                Ok((0, _)) => {
                    self.peer_closed(st);
                    return;
                }
                Ok((_, drained)) => drained,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
                Err(e) => {
                    self.fail(st, format!("receiving from the peer failed: {e}"));
                    return;
                }
            };
            progress.received = true;
            if drained {
                // A short read emptied the socket: process what came and
                // return without a `read` that would only say EAGAIN.
                if let Step::Stalled = self.process_buffered(st, progress) {
                    progress.stalled = true;
                }
                return;
            }
        }
    }

    /// One `read`: straight into the destination for a long payload, into
    /// the staging buffer otherwise. Returns the bytes read and whether the
    /// read was short (the socket is empty now).
    fn read_some(&self, st: &mut EpState) -> std::io::Result<(usize, bool)> {
        if let Rx::Payload {
            dst: Some((buf, off)),
            remaining,
            ..
        } = &mut st.rx
        {
            if st.start == st.end && *remaining >= DIRECT_READ {
                // SAFETY: off..off+remaining lies inside buf (checked against
                // the region table or the outstanding read), which the state keeps alive.
                let rc =
                    unsafe { libc::read(self.fd(), buf.as_ptr().add(*off).cast(), *remaining) };
                let wanted = *remaining;
                return match rc {
                    rc if rc > 0 => {
                        *off += rc as usize;
                        *remaining -= rc as usize;
                        Ok((rc as usize, (rc as usize) < wanted))
                    }
                    0 => Ok((0, true)),
                    _ => Err(std::io::Error::last_os_error()),
                };
            }
        }
        if st.start == st.end {
            st.start = 0;
            st.end = 0;
        } else if st.start > 0 && st.staging.len() - st.end < HEADER_LEN {
            st.staging.copy_within(st.start..st.end, 0);
            st.end -= st.start;
            st.start = 0;
        }
        let free = st.staging.len() - st.end;
        // SAFETY: staging[end..] is writable and owned by the state.
        let rc = unsafe { libc::read(self.fd(), st.staging.as_mut_ptr().add(st.end).cast(), free) };
        if rc < 0 {
            let err = std::io::Error::last_os_error();
            if err.kind() == std::io::ErrorKind::Interrupted {
                return Err(std::io::ErrorKind::WouldBlock.into());
            }
            return Err(err);
        }
        st.end += rc as usize;
        Ok((rc as usize, (rc as usize) < free))
    }

    /// Processes whole frames from the staging buffer.
    fn process_buffered(&self, st: &mut EpState, progress: &mut Progress) -> Step {
        loop {
            if st.dead_reason.is_some() {
                return Step::Blocked;
            }
            match &mut st.rx {
                Rx::Payload { dst, remaining, .. } => {
                    let n = (*remaining).min(st.end - st.start);
                    if let Some((buf, off)) = dst {
                        // SAFETY: off..off+remaining lies inside buf (checked
                        // before entering this state); the staging range is valid.
                        unsafe {
                            std::ptr::copy_nonoverlapping(
                                st.staging.as_ptr().add(st.start),
                                buf.as_ptr().add(*off),
                                n,
                            );
                        }
                        *off += n;
                    }
                    *remaining -= n;
                    st.start += n;
                    if *remaining > 0 {
                        return Step::More;
                    }
                    let Rx::Payload { then, .. } = std::mem::replace(&mut st.rx, Rx::Header) else {
                        unreachable!("matched a payload state above")
                    };
                    self.after_payload(st, then, progress);
                }
                Rx::Header => {
                    if st.end - st.start < HEADER_LEN {
                        return Step::More;
                    }
                    let mut bytes = [0u8; HEADER_LEN];
                    bytes.copy_from_slice(&st.staging[st.start..st.start + HEADER_LEN]);
                    let header = match FrameHeader::decode(&bytes) {
                        Ok(h) => h,
                        Err(e) => {
                            self.fail(st, format!("protocol violation: malformed frame: {e}"));
                            return Step::Blocked;
                        }
                    };
                    // Room for everything this frame may complete, and a
                    // posted receive for a write-with-immediate (else wait,
                    // like an RNR retry).
                    if self.cq.free() < st.outstanding.len() + 1 {
                        return Step::Stalled;
                    }
                    if header.kind == FrameKind::WriteImm
                        && self.recvs.is_empty()
                        && self.target_of(&header, Access::REMOTE_WRITE).is_ok()
                    {
                        return Step::Stalled;
                    }
                    st.start += HEADER_LEN;
                    if let Err(reason) = self.on_header(st, header, progress) {
                        self.fail(st, format!("protocol violation: {reason} (frame {header})"));
                        return Step::Blocked;
                    }
                }
            }
        }
    }

    /// Acts on a frame header; payload, if any, follows via `st.rx`.
    fn on_header(
        &self,
        st: &mut EpState,
        h: FrameHeader,
        progress: &mut Progress,
    ) -> Result<(), String> {
        if h.kind.is_request() {
            let expected = next_seq(st.done_seq);
            if h.seq != expected {
                return Err(format!(
                    "request {} arrived, {expected} was expected",
                    h.seq
                ));
            }
        }
        match h.kind {
            FrameKind::Write | FrameKind::WriteImm => {
                let len = h.arg0 as usize;
                let target = self.target_of(&h, Access::REMOTE_WRITE);
                let then = match &target {
                    Ok(_) => AfterPayload::Written {
                        seq: h.seq,
                        recv: (h.kind == FrameKind::WriteImm).then(|| {
                            let wr_id = self.recvs.pop().unwrap_or_default();
                            (wr_id, h.arg1 as u32, len as u32)
                        }),
                    },
                    Err(()) => AfterPayload::Refused { seq: h.seq },
                };
                st.rx = Rx::Payload {
                    dst: target.unwrap_or(None),
                    remaining: len,
                    then,
                };
            }
            FrameKind::ReadReq => {
                let len = h.arg0 as usize;
                let reply = match self.target_of(&h, Access::REMOTE_READ) {
                    Ok(source) => {
                        let header = FrameHeader {
                            seq: h.seq,
                            arg0: h.arg0,
                            ..FrameHeader::new(FrameKind::ReadResp)
                        };
                        self.done(st, h.seq);
                        let payload = source.as_ref().map(|(buf, off)| (buf, *off, len));
                        self.send(st, header, payload);
                        None
                    }
                    Err(()) => Some(FrameHeader {
                        seq: h.seq,
                        status: FrameStatus::RemoteAccess,
                        ..FrameHeader::new(FrameKind::ReadResp)
                    }),
                };
                if let Some(header) = reply {
                    self.done(st, h.seq);
                    self.send(st, header, None);
                }
            }
            FrameKind::FetchAdd | FrameKind::CompareSwap => {
                let header = self.atomic(h);
                self.done(st, h.seq);
                self.send(st, header, None);
            }
            FrameKind::ReadResp | FrameKind::AtomicResp | FrameKind::Nak => {
                self.complete_acked(st, h.seq.wrapping_sub(1), progress);
                let Some(head) = st.outstanding.front() else {
                    return Err("a response arrived with nothing outstanding".into());
                };
                let expected = match h.kind {
                    FrameKind::ReadResp => matches!(head.opcode, Opcode::Read),
                    FrameKind::AtomicResp => {
                        matches!(head.opcode, Opcode::FetchAdd | Opcode::CompareSwap)
                    }
                    _ => matches!(head.opcode, Opcode::Write | Opcode::WriteWithImm),
                };
                if head.seq != h.seq || !expected {
                    return Err(format!(
                        "the response answers request {} but request {} ({:?}) is next",
                        h.seq, head.seq, head.opcode
                    ));
                }
                let head = st.outstanding.pop_front().unwrap_or_else(|| unreachable!());
                let status = match h.status {
                    FrameStatus::Ok => Status::Success,
                    FrameStatus::RemoteAccess => Status::RemoteAccess,
                    FrameStatus::RemoteOperation => Status::RemoteOperation,
                };
                match (h.kind, status) {
                    (FrameKind::ReadResp, Status::Success) => {
                        if h.arg0 != u64::from(head.len) {
                            return Err(format!("{} bytes answer a read of {}", h.arg0, head.len));
                        }
                        st.rx = Rx::Payload {
                            dst: head.dst,
                            remaining: head.len as usize,
                            then: AfterPayload::ReadDone {
                                wr_id: head.wr_id,
                                len: head.len,
                                ack: h.ack,
                            },
                        };
                        return Ok(());
                    }
                    (FrameKind::AtomicResp, Status::Success) => {
                        if let Some((buf, off)) = &head.dst {
                            // SAFETY: off..off+8 lies inside buf (checked at post).
                            unsafe {
                                std::ptr::copy_nonoverlapping(
                                    h.arg0.to_ne_bytes().as_ptr(),
                                    buf.as_ptr().add(*off),
                                    8,
                                )
                            };
                        }
                        self.push(Completion::ok(head.wr_id, head.opcode, 8), progress);
                    }
                    _ => self.push(Completion::error(head.wr_id, head.opcode, status), progress),
                }
            }
            FrameKind::Ack => {}
            FrameKind::Hello => return Err("a second hello arrived".into()),
        }
        self.complete_acked(st, h.ack, progress);
        Ok(())
    }

    /// The memory a read or write request names: `Ok(None)` for a
    /// zero-length access, which (as on a NIC) names no memory and checks
    /// no rkey; `Err` when the target must refuse it. Hot path.
    #[inline]
    fn target_of(&self, h: &FrameHeader, need: Access) -> Result<Option<(Arc<Buffer>, usize)>, ()> {
        if h.arg0 == 0 {
            return Ok(None);
        }
        self.registry
            .check(h.rkey, h.addr, h.arg0, need)
            .map(Some)
            .ok_or(())
    }

    /// Carries out an atomic and builds its response.
    fn atomic(&self, h: FrameHeader) -> FrameHeader {
        let mut reply = FrameHeader {
            seq: h.seq,
            ..FrameHeader::new(FrameKind::AtomicResp)
        };
        if h.addr % 8 != 0 {
            reply.status = FrameStatus::RemoteOperation;
            return reply;
        }
        let Some((buf, off)) = self
            .registry
            .check(h.rkey, h.addr, 8, Access::REMOTE_ATOMIC)
        else {
            reply.status = FrameStatus::RemoteAccess;
            return reply;
        };
        // SAFETY: off..off+8 lies inside buf, the address is 8-byte aligned
        // (buffers are page-aligned and addr % 8 == 0), and all remote
        // accesses to the word go through atomics.
        let word = unsafe { &*(buf.as_ptr().add(off) as *const std::sync::atomic::AtomicU64) };
        reply.arg0 = if h.kind == FrameKind::FetchAdd {
            word.fetch_add(h.arg0, Ordering::SeqCst)
        } else {
            match word.compare_exchange(h.arg0, h.arg1, Ordering::SeqCst, Ordering::SeqCst) {
                Ok(old) | Err(old) => old,
            }
        };
        reply
    }

    fn after_payload(&self, st: &mut EpState, then: AfterPayload, progress: &mut Progress) {
        match then {
            AfterPayload::Written { seq, recv } => {
                self.done(st, seq);
                if let Some((wr_id, imm, len)) = recv {
                    self.push(
                        Completion {
                            wr_id,
                            opcode: Opcode::RecvWithImm,
                            status: Status::Success,
                            imm,
                            byte_len: len,
                        },
                        progress,
                    );
                }
            }
            AfterPayload::Refused { seq } => {
                let nak = FrameHeader {
                    seq,
                    status: FrameStatus::RemoteAccess,
                    ..FrameHeader::new(FrameKind::Nak)
                };
                self.send(st, nak, None);
                self.done(st, seq);
            }
            AfterPayload::ReadDone { wr_id, len, ack } => {
                self.push(Completion::ok(wr_id, Opcode::Read, len), progress);
                self.complete_acked(st, ack, progress);
            }
        }
    }

    /// Records that the peer's request `seq` has been carried out.
    fn done(&self, st: &mut EpState, seq: u32) {
        st.done_seq = seq;
        st.unacked += 1;
    }

    /// Completes outstanding writes up to and including `upto`.
    fn complete_acked(&self, st: &mut EpState, upto: u32, progress: &mut Progress) {
        while let Some(head) = st.outstanding.front() {
            if !matches!(head.opcode, Opcode::Write | Opcode::WriteWithImm)
                || !seq_le(head.seq, upto)
            {
                break;
            }
            let head = st.outstanding.pop_front().unwrap_or_else(|| unreachable!());
            self.push(Completion::ok(head.wr_id, head.opcode, head.len), progress);
        }
    }

    fn push(&self, completion: Completion, progress: &mut Progress) {
        // Room was checked before the frame was taken.
        let pushed = self.cq.push(completion);
        debug_assert!(pushed, "completion queue overflow");
        progress.completed = true;
    }

    /// The peer shut the connection down in order: between frames, that is
    /// how a peer says goodbye, not a failure, and it is not logged as one.
    /// Our operations it had not acknowledged yet (acknowledgements are
    /// lazy, so often the last write of a session) complete with
    /// `PeerLost`, which tells their owner.
    fn peer_closed(&self, st: &mut EpState) {
        if st.dead_reason.is_some() {
            return;
        }
        if !matches!(st.rx, Rx::Header) || st.start != st.end {
            self.fail(
                st,
                "the peer closed the connection in the middle of a frame".into(),
            );
            return;
        }
        let unanswered = st.outstanding.len();
        if unanswered == 0 {
            tracing::debug!(peer = %self.peer, "tcp peer closed the connection");
        } else {
            tracing::info!(peer = %self.peer, unanswered, "tcp peer closed the connection; operations it had not acknowledged complete with PeerLost");
        }
        self.mark_dead(st, "the peer closed the connection".into());
    }

    /// Marks the connection failed, once, and says why.
    fn fail(&self, st: &mut EpState, reason: String) {
        if st.dead_reason.is_some() {
            return;
        }
        if self.closed.load(Ordering::Relaxed) {
            tracing::debug!(peer = %self.peer, %reason, "tcp endpoint closed");
        } else {
            tracing::warn!(peer = %self.peer, %reason, "tcp connection failed; outstanding operations complete with PeerLost");
        }
        self.mark_dead(st, reason);
    }

    /// Ends the connection, once: everything outstanding completes with
    /// `PeerLost` from now on.
    fn mark_dead(&self, st: &mut EpState, reason: String) {
        if st.dead_reason.is_some() {
            return;
        }
        let _ = self.stream.shutdown(Shutdown::Both);
        st.dead_reason = Some(reason);
        st.txq.clear();
        st.rx = Rx::Header;
        self.tx_pending.store(false, Ordering::Release);
        self.dead.store(true, Ordering::SeqCst);
    }

    /// Completes everything outstanding and every posted receive with
    /// `PeerLost`, as far as the completion queue has room.
    fn flush_dead(&self, st: &mut EpState) -> bool {
        let mut any = false;
        while let Some(head) = st.outstanding.front() {
            if !self
                .cq
                .push(Completion::error(head.wr_id, head.opcode, Status::PeerLost))
            {
                return any;
            }
            st.outstanding.pop_front();
            any = true;
        }
        any | self.flush_recvs()
    }

    fn flush_recvs(&self) -> bool {
        let mut any = false;
        while self.cq.free() > 0 {
            let Some(wr_id) = self.recvs.pop() else { break };
            let lost = Completion::error(wr_id, Opcode::RecvWithImm, Status::PeerLost);
            if !self.cq.push(lost) {
                // Another producer took the last slot: keep the receive for
                // the next flush rather than lose it.
                let _ = self.recvs.push(wr_id);
                break;
            }
            any = true;
        }
        if any {
            self.cq.notify();
        }
        any
    }

    pub(super) fn is_dead(&self) -> bool {
        self.dead.load(Ordering::Relaxed)
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

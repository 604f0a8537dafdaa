//! One tcp connection, the data path: its state and posting. Frames leave
//! through [`transmit`] and arrive through [`receive`], which also drives
//! progress and carries out the peer's requests. Connection set-up is in
//! `super::connect`.
//!
//! The connection's mutable state, [`EpShared::state`], is driven by one
//! thread at a time: whoever claims it without waiting ([`Claimable`]),
//! be it the application posting, a poller of the completion queue, or the
//! progress thread. Nobody waits for it. `poll` skips an endpoint another
//! thread drives. A post that finds the state taken hands its request over
//! ([`EpShared::handover`]) and returns; the holder sends handed-over
//! requests before it lets go, and after letting go looks once more, so a
//! request handed over while it was letting go is not left behind (the
//! poster, for its part, tries to claim the state after handing over).
//! Requests keep their order: the holder takes earlier hand-overs before a
//! post of its own.
//!
//! Requests are numbered per direction. The target carries them out in
//! order and acknowledges cumulatively: the `ack` field of every frame it
//! sends names the last request it carried out. Responses (read data, atomic
//! results, refusals) are sent in order too, so the initiator keeps its
//! outstanding operations in a FIFO and completes them from the front.

mod receive;
mod transmit;

use std::collections::VecDeque;
use std::net::{Shutdown, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{fence, AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use crossbeam_queue::ArrayQueue;
use rfaas_proto::tcp_frame::{FrameHeader, FrameKind, HEADER_LEN};

use super::claim::{Claim, Claimable};
use super::queue::CqShared;
use super::wake;
use crate::completion::{Completion, Opcode, Status};
use crate::error::{Error, Result};
use crate::memory::{Buffer, PeerView, RemoteAddr};
use crate::provider::{self, Local, LocalWord, Write, Writes};
use crate::registry::Registry;
use crate::EndpointOptions;

/// Frames of a batch numbered and sent together (one `writev`).
const BATCH_FRAMES: usize = 32;
/// Empty polls after which a pending acknowledgement is sent on its own.
pub(in crate::tcp) const IDLE_POLLS_BEFORE_ACK: u32 = 64;

/// Bytes read from the socket at once into the staging buffer.
const STAGING: usize = 64 * 1024;
/// Requests after which an acknowledgement goes out on its own, so a
/// stream whose sender keeps only a few in flight is not held up.
const ACK_EVERY: usize = 8;

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
    /// Requests posted and not yet completed (handed over or outstanding);
    /// never above `send_depth`.
    in_flight: AtomicUsize,
    /// Requests posted while another thread held `state`, in posting
    /// order; that thread sends them. Never fuller than `in_flight`.
    handover: ArrayQueue<Request>,
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
    /// A post left bytes in the transmit queue: the progress thread should
    /// watch the socket for room (see `progress::kick`).
    pub(super) kicked: AtomicBool,
    /// Frames wait in the staging buffer for a posted receive or room in
    /// the completion queue; the socket will not signal them again.
    pub(super) stalled: AtomicBool,
    state: Claimable<EpState>,
    /// Requests handed over so far, so tests can tell the path was taken.
    #[cfg(test)]
    handed_over: AtomicU64,
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

/// A request frame and what its completion needs, as posted.
struct Op {
    header: FrameHeader,
    wr_id: u64,
    opcode: Opcode,
    len: u32,
    /// Where read data or an atomic's old value goes.
    dst: Option<(Arc<Buffer>, usize)>,
    /// An unsignaled write: no completion when acknowledged.
    quiet: bool,
}

/// A request posted while another thread held the connection state.
struct Request {
    op: Op,
    /// The bytes a write sends: `(buffer, offset, len)`.
    payload: Option<(Arc<Buffer>, usize, usize)>,
}

/// An operation posted and not yet completed.
struct Outstanding {
    seq: u32,
    wr_id: u64,
    opcode: Opcode,
    len: u32,
    /// Where read data or an atomic's old value goes.
    dst: Option<(Arc<Buffer>, usize)>,
    /// An unsignaled write: its acknowledgement retires it silently.
    pub(super) quiet: bool,
}

/// A frame (or its remainder) waiting for the socket.
struct TxItem {
    header: [u8; HEADER_LEN],
    payload: Option<(Arc<Buffer>, usize, usize)>,
    sent: usize,
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

fn next_seq(seq: u32) -> u32 {
    match seq.wrapping_add(1) {
        0 => 1,
        s => s,
    }
}

impl TcpEndpoint {
    /// The connection's state, for its completion queue and the progress
    /// thread.
    pub(super) fn shared(&self) -> &Arc<EpShared> {
        &self.shared
    }

    pub(super) fn new(
        stream: TcpStream,
        peer: String,
        registry: Arc<Registry>,
        cq: Arc<CqShared>,
        opts: &EndpointOptions,
        peer_send_depth: usize,
    ) -> TcpEndpoint {
        let tx_capacity = opts.send_depth + peer_send_depth + 4;
        let shared = Arc::new(EpShared {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            stream,
            peer,
            registry,
            cq,
            recvs: ArrayQueue::new(opts.recv_depth),
            send_depth: opts.send_depth,
            in_flight: AtomicUsize::new(0),
            handover: ArrayQueue::new(opts.send_depth),
            ack_threshold: (peer_send_depth / 2).clamp(1, ACK_EVERY) as u32,
            dead: AtomicBool::new(false),
            closed: AtomicBool::new(false),
            tx_pending: AtomicBool::new(false),
            ack_owed: AtomicBool::new(false),
            kicked: AtomicBool::new(false),
            stalled: AtomicBool::new(false),
            #[cfg(test)]
            handed_over: AtomicU64::new(0),
            state: Claimable::new(EpState {
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
        TcpEndpoint { shared }
    }
}

impl TcpEndpoint {
    /// How many of this endpoint's posts were handed to another thread.
    #[cfg(test)]
    pub(super) fn handed_over(&self) -> u64 {
        self.shared.handed_over.load(Ordering::Relaxed)
    }

    /// Claims the connection state as a poller would (waiting while the
    /// progress thread has it), so posts find it held until the claim is
    /// dropped. Dropping it, unlike a poller's release, sends nothing.
    #[cfg(test)]
    pub(super) fn hold_state(&self) -> impl Sized + '_ {
        loop {
            match self.shared.state.try_claim() {
                Some(claim) => return claim,
                None => std::thread::yield_now(),
            }
        }
    }
}

impl provider::Endpoint for TcpEndpoint {
    /// Hot path (write-with-immediate is the invocation request and response).
    fn write(&self, w: Write<'_>) -> Result<()> {
        let (op, payload) = write_op(w);
        self.shared.post_op(op, payload)
    }

    /// Hot path: the frames leave in one `writev` when this thread claims
    /// the connection state (see [`EpShared::post_batch`]).
    fn write_batch(&self, writes: Writes<'_>) -> Result<()> {
        self.shared.post_batch(writes)
    }

    fn read(&self, wr_id: u64, local: Local<'_>, remote: RemoteAddr) -> Result<()> {
        let header = FrameHeader {
            rkey: remote.rkey,
            addr: remote.addr,
            arg0: local.len() as u64,
            ..FrameHeader::new(FrameKind::ReadReq)
        };
        let dst = Some((local.buf().clone(), local.offset()));
        self.shared
            .post(header, None, wr_id, Opcode::Read, local.len() as u32, dst)
    }

    fn fetch_add(
        &self,
        wr_id: u64,
        local: LocalWord<'_>,
        remote: RemoteAddr,
        add: u64,
    ) -> Result<()> {
        let header = FrameHeader {
            rkey: remote.rkey,
            addr: remote.addr,
            arg0: add,
            ..FrameHeader::new(FrameKind::FetchAdd)
        };
        let word = local.bytes();
        let dst = Some((word.buf().clone(), word.offset()));
        self.shared
            .post(header, None, wr_id, Opcode::FetchAdd, 8, dst)
    }

    fn compare_swap(
        &self,
        wr_id: u64,
        local: LocalWord<'_>,
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
        let word = local.bytes();
        let dst = Some((word.buf().clone(), word.offset()));
        self.shared
            .post(header, None, wr_id, Opcode::CompareSwap, 8, dst)
    }

    /// Hot path: a lock-free push.
    fn post_recv(&self, wr_id: u64) -> Result<()> {
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

    /// See [`crate::Endpoint::peer_view`]: the peer's memory is not mapped
    /// here, so there is no view; callers read.
    fn peer_view(
        &self,
        _remote: RemoteAddr,
        _len: usize,
    ) -> Option<std::result::Result<PeerView, Status>> {
        None
    }

    fn peer_addr(&self) -> String {
        self.shared.peer.clone()
    }
}

/// The bytes a frame sends after its header: `(buffer, offset, len)`.
type Payload<'a> = Option<(&'a Arc<Buffer>, usize, usize)>;

/// The request frame of a write, and the bytes it sends. Hot path.
#[inline]
fn write_op(w: Write<'_>) -> (Op, Payload<'_>) {
    let len = w.local.len();
    let (kind, opcode, arg1) = match w.imm {
        Some(imm) => (FrameKind::WriteImm, Opcode::WriteWithImm, u64::from(imm)),
        None => (FrameKind::Write, Opcode::Write, 0),
    };
    let header = FrameHeader {
        rkey: w.remote.rkey,
        addr: w.remote.addr,
        arg0: len as u64,
        arg1,
        ..FrameHeader::new(kind)
    };
    let op = Op {
        header,
        wr_id: w.wr_id,
        opcode,
        len: len as u32,
        dst: None,
        quiet: w.unsignaled,
    };
    let payload = (len > 0).then_some((w.local.buf(), w.local.offset(), len));
    (op, payload)
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

    /// Posts one request frame. Hot path for writes: never waits. The
    /// frame leaves from this thread when it can claim the connection
    /// state, and otherwise from the thread holding it, which takes the
    /// hand-over before it lets go (see the module doc).
    fn post(
        &self,
        header: FrameHeader,
        payload: Option<(&Arc<Buffer>, usize, usize)>,
        wr_id: u64,
        opcode: Opcode,
        len: u32,
        dst: Option<(Arc<Buffer>, usize)>,
    ) -> Result<()> {
        let op = Op {
            header,
            wr_id,
            opcode,
            len,
            dst,
            quiet: false,
        };
        self.post_op(op, payload)
    }

    /// Posts `op`, as [`EpShared::post`] does. Hot path.
    fn post_op(&self, op: Op, payload: Option<(&Arc<Buffer>, usize, usize)>) -> Result<()> {
        if self.dead.load(Ordering::Acquire) {
            return self.fail_now(op.wr_id, op.opcode);
        }
        if self.in_flight.fetch_add(1, Ordering::AcqRel) >= self.send_depth {
            self.in_flight.fetch_sub(1, Ordering::AcqRel);
            return Err(Error::QueueFull {
                what: "the send queue",
                depth: self.send_depth,
            });
        }
        if let Some(mut st) = self.state.try_claim() {
            // Requests handed over earlier go first.
            let queued = self.take_handed_over(&mut st) | self.start(&mut st, op, payload);
            self.release(st, queued);
            return Ok(());
        }
        let request = Request {
            op,
            payload: payload.map(|(buf, off, len)| (buf.clone(), off, len)),
        };
        if self.handover.push(request).is_err() {
            // Cannot happen: in_flight bounds the hand-over to its capacity.
            self.in_flight.fetch_sub(1, Ordering::AcqRel);
            return Err(Error::QueueFull {
                what: "the send queue",
                depth: self.send_depth,
            });
        }
        #[cfg(test)]
        self.handed_over.fetch_add(1, Ordering::Relaxed);
        self.after_handover();
        Ok(())
    }

    /// After handing requests over: sends them from here if the holder let
    /// go meanwhile.
    fn after_handover(&self) {
        // Pairs with the fence in `release`: either the holder, letting go,
        // sees the request, or this claim sees the state free.
        fence(Ordering::SeqCst);
        match self.state.try_claim() {
            Some(mut st) => {
                let queued = self.take_handed_over(&mut st);
                self.release(st, queued);
            }
            // The holder may be the progress thread, preempted on this very
            // core (a pinned process shares its core with it): let it run
            // and send the request now rather than after this thread's time
            // slice. Only when posts meet; a yield, not a wait.
            None => std::thread::yield_now(),
        }
    }

    /// Posts a batch of writes: room for all of them in the send queue is
    /// claimed first, so the batch is posted whole or not at all. Then as
    /// [`EpShared::post`]: the frames leave from this thread, together,
    /// when it can claim the connection state, and otherwise are handed
    /// over in order to the thread holding it. A batch on a failed
    /// connection is posted too, and completes with `PeerLost`. Hot path.
    fn post_batch(&self, writes: Writes<'_>) -> Result<()> {
        let n = writes.len();
        writes.check_depth(self.send_depth)?;
        if self.in_flight.fetch_add(n, Ordering::AcqRel) + n > self.send_depth {
            self.in_flight.fetch_sub(n, Ordering::AcqRel);
            return Err(Error::QueueFull {
                what: "the send queue",
                depth: self.send_depth,
            });
        }
        if let Some(mut st) = self.state.try_claim() {
            // Requests handed over earlier go first.
            let queued = self.take_handed_over(&mut st) | self.start_batch(&mut st, writes);
            self.release(st, queued);
            return Ok(());
        }
        for w in writes.iter() {
            let (op, payload) = write_op(w);
            let request = Request {
                op,
                payload: payload.map(|(buf, off, len)| (buf.clone(), off, len)),
            };
            // Cannot fail: in_flight, which counted the whole batch, bounds
            // the hand-over to its capacity.
            let pushed = self.handover.push(request).is_ok();
            debug_assert!(pushed, "the hand-over overflowed");
            #[cfg(test)]
            self.handed_over.fetch_add(1, Ordering::Relaxed);
        }
        self.after_handover();
        Ok(())
    }

    /// Numbers the writes of a batch, makes them outstanding and sends
    /// them, [`BATCH_FRAMES`] frames to a `writev`. Returns whether bytes
    /// wait in the transmit queue.
    fn start_batch(&self, st: &mut EpState, writes: Writes<'_>) -> bool {
        let mut headers = [FrameHeader::new(FrameKind::Write); BATCH_FRAMES];
        let mut payloads: [Payload<'_>; BATCH_FRAMES] = [None; BATCH_FRAMES];
        let mut k = 0;
        for w in writes.iter() {
            let (op, payload) = write_op(w);
            headers[k] = self.make_outstanding(st, op);
            payloads[k] = payload;
            k += 1;
            if k == BATCH_FRAMES {
                if st.dead_reason.is_none() {
                    self.send_frames(st, &mut headers, &payloads);
                }
                k = 0;
            }
        }
        if k > 0 && st.dead_reason.is_none() {
            self.send_frames(st, &mut headers[..k], &payloads[..k]);
        }
        if st.dead_reason.is_some() {
            // The batch fails with PeerLost; a waiter on another thread is told.
            if self.flush_dead(st) {
                self.cq.notify();
            }
            return false;
        }
        !st.txq.is_empty()
    }

    /// Numbers a request and makes it outstanding; returns its frame.
    #[inline]
    fn make_outstanding(&self, st: &mut EpState, op: Op) -> FrameHeader {
        let seq = st.next_seq;
        st.next_seq = next_seq(seq);
        let mut header = op.header;
        header.seq = seq;
        st.outstanding.push_back(Outstanding {
            seq,
            wr_id: op.wr_id,
            opcode: op.opcode,
            len: op.len,
            dst: op.dst,
            quiet: op.quiet,
        });
        header
    }

    /// Numbers a request, makes it outstanding and sends it (what the
    /// socket does not take waits in the transmit queue). Returns whether
    /// bytes wait there.
    fn start(
        &self,
        st: &mut EpState,
        op: Op,
        payload: Option<(&Arc<Buffer>, usize, usize)>,
    ) -> bool {
        let header = self.make_outstanding(st, op);
        if st.dead_reason.is_none() {
            self.send(st, header, payload);
        }
        if st.dead_reason.is_some() {
            self.flush_dead(st);
            return false;
        }
        !st.txq.is_empty()
    }

    /// Starts the requests other threads handed over, in their order.
    /// Returns whether bytes wait in the transmit queue. Hot path (an empty
    /// hand-over costs two loads).
    #[inline]
    fn take_handed_over(&self, st: &mut EpState) -> bool {
        let mut queued = false;
        if self.handover.is_empty() {
            return false;
        }
        while let Some(Request { op, payload }) = self.handover.pop() {
            let payload = payload.as_ref().map(|(buf, off, len)| (buf, *off, *len));
            queued |= self.start(st, op, payload);
        }
        queued
    }

    /// Lets go of the connection state. A request handed over after the
    /// holder last looked is taken by claiming the state again; when
    /// another thread has claimed it by then, that thread takes it. With
    /// `queued`, bytes of a post wait in the transmit queue: the progress
    /// thread is told to watch for room, in case nobody polls.
    #[inline]
    fn release<'a>(&'a self, mut st: Claim<'a, EpState>, mut queued: bool) {
        loop {
            drop(st);
            // Pairs with the fence in `post`.
            fence(Ordering::SeqCst);
            if self.handover.is_empty() {
                break;
            }
            match self.state.try_claim() {
                Some(mut again) => {
                    queued |= self.take_handed_over(&mut again);
                    st = again;
                }
                None => break,
            }
        }
        if queued {
            // The socket is full: slow path only.
            self.kick();
        }
    }

    /// Tells the progress thread that a post left output queued here, so
    /// it watches the socket for room. Lock-free: it flags the endpoint and
    /// rings the thread's doorbell.
    fn kick(&self) {
        self.kicked.store(true, Ordering::Release);
        wake::ring();
    }

    /// Takes the oldest outstanding operation off the send queue.
    fn retire(&self, st: &mut EpState) -> Option<Outstanding> {
        let head = st.outstanding.pop_front()?;
        self.in_flight.fetch_sub(1, Ordering::AcqRel);
        Some(head)
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

    pub(super) fn is_dead(&self) -> bool {
        self.dead.load(Ordering::Relaxed)
    }

    /// Whether the endpoint has work its socket's readability does not
    /// announce: queued output, an acknowledgement owed, requests handed
    /// over, stalled frames, or a closed or failed connection to flush.
    /// A poller that watches readiness drives these on every poll as well.
    /// Hot path: a few loads.
    #[inline]
    pub(super) fn needs_drive(&self) -> bool {
        self.tx_pending.load(Ordering::Relaxed)
            || self.ack_owed.load(Ordering::Relaxed)
            || self.stalled.load(Ordering::Relaxed)
            || self.dead.load(Ordering::Relaxed)
            || self.closed.load(Ordering::Relaxed)
            || !self.handover.is_empty()
    }
}

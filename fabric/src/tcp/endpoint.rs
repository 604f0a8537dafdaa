//! One tcp connection, the data path: its state and posting. Frames leave
//! through [`transmit`] and arrive through [`receive`], which also drives
//! progress and carries out the peer's requests. Connection set-up is in
//! `super::connect`.
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

mod receive;
mod transmit;

use std::collections::VecDeque;
use std::net::{Shutdown, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use crossbeam_queue::ArrayQueue;
use rfaas_proto::tcp_frame::{FrameHeader, FrameKind, HEADER_LEN};

use super::cq::{CqShared, TcpCq};
use super::progress;
use crate::completion::{Completion, Opcode, Status};
use crate::error::{Error, Result};
use crate::memory::{Buffer, PeerView, RemoteAddr};
use crate::provider::{self, Local, LocalWord};
use crate::registry::Registry;
use crate::EndpointOptions;

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
}

impl provider::Endpoint for TcpEndpoint {
    /// Hot path (write-with-immediate is the invocation request and response).
    fn write(
        &self,
        wr_id: u64,
        local: Local<'_>,
        remote: RemoteAddr,
        imm: Option<u32>,
    ) -> Result<()> {
        let len = local.len();
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
        let payload = (len > 0).then_some((local.buf(), local.offset(), len));
        self.shared
            .post(header, payload, wr_id, opcode, len as u32, None)
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

    pub(super) fn is_dead(&self) -> bool {
        self.dead.load(Ordering::Relaxed)
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

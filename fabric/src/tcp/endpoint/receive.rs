//! The receive side of a connection: progress (poll and the progress
//! thread), the frame state machine, the target's side of every operation,
//! completions, and connection failure.

use std::net::Shutdown;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use rfaas_proto::tcp_frame::{FrameHeader, FrameKind, FrameStatus, HEADER_LEN};

use super::{next_seq, AfterPayload, EpShared, EpState, Rx, IDLE_POLLS_BEFORE_ACK};
use crate::completion::{Completion, Opcode, Status};
use crate::memory::{Access, Buffer};

/// Payloads at least this long are read straight into the target memory.
const DIRECT_READ: usize = 16 * 1024;

/// What one round of progress did.
#[derive(Clone, Copy, Default)]
pub(in crate::tcp) struct Progress {
    /// Completions were pushed.
    pub(in crate::tcp) completed: bool,
    /// Bytes arrived.
    pub(in crate::tcp) received: bool,
    /// Received frames cannot be processed yet (no posted receive for a
    /// write-with-immediate, or a full completion queue).
    pub(in crate::tcp) stalled: bool,
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

impl EpShared {
    /// Drives the connection unless another thread does (poll and the
    /// progress thread): sends the requests handed over, then reads and
    /// carries out what arrived. `None` when another thread holds the
    /// state; never waits. `eager` acknowledges at once instead of waiting
    /// for a frame to ride on. Without `read` only frames already in the
    /// staging buffer are processed: the caller knows the socket has
    /// nothing (a readiness poll did not report it). Hot path.
    pub(in crate::tcp) fn try_progress(&self, eager: bool, read: bool) -> Option<Progress> {
        let mut st = self.state.try_claim()?;
        let queued = self.take_handed_over(&mut st);
        let progress = self.progress(&mut st, eager, read);
        self.stalled.store(progress.stalled, Ordering::Relaxed);
        self.release(st, queued);
        Some(progress)
    }

    fn progress(&self, st: &mut EpState, eager: bool, read: bool) -> Progress {
        let mut progress = Progress::default();
        if st.dead_reason.is_some() {
            progress.completed = self.flush_dead(st);
            return progress;
        }
        if !st.txq.is_empty() {
            self.flush_tx(st);
        }
        if read {
            self.receive(st, &mut progress);
        } else if let Step::Stalled = self.process_buffered(st, &mut progress) {
            progress.stalled = true;
        }
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
        // Enough for one round: process what the last read brought, so
        // no whole frame waits in the staging buffer for a readiness poll
        // that the (perhaps emptied) socket would not give.
        if let Step::Stalled = self.process_buffered(st, progress) {
            progress.stalled = true;
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
                let head = self.retire(st).unwrap_or_else(|| unreachable!());
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
            let head = self.retire(st).unwrap_or_else(|| unreachable!());
            if !head.quiet {
                self.push(Completion::ok(head.wr_id, head.opcode, head.len), progress);
            }
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
    pub(super) fn fail(&self, st: &mut EpState, reason: String) {
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
    pub(super) fn flush_dead(&self, st: &mut EpState) -> bool {
        let mut any = false;
        while let Some(head) = st.outstanding.front() {
            if !self
                .cq
                .push(Completion::error(head.wr_id, head.opcode, Status::PeerLost))
            {
                return any;
            }
            self.retire(st);
            any = true;
        }
        any | self.flush_recvs()
    }

    pub(super) fn flush_recvs(&self) -> bool {
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
}

//! Completion queues: `ibv_cq` plus a completion channel for sleeping.

use std::fmt;
use std::mem::MaybeUninit;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crossbeam_queue::ArrayQueue;

use rdma_sys::{
    ibv_ack_cq_events, ibv_comp_channel, ibv_cq, ibv_create_comp_channel, ibv_create_cq,
    ibv_destroy_comp_channel, ibv_destroy_cq, ibv_get_cq_event, ibv_poll_cq, ibv_req_notify_cq,
    ibv_wc, ibv_wc_flags, ibv_wc_opcode, ibv_wc_status,
};

use super::device::FabricInner;
use super::fate::Fate;
use super::slots::{SlotData, SlotTable};
use super::sys::{
    deadline_after, errno_of, last_errno_or, set_nonblocking, verb_error, wait_any_readable,
};
use crate::completion::{Completion, Opcode, Status};
use crate::error::{Error, Result};
use crate::provider;

/// Work completions read per `ibv_poll_cq` call.
const BATCH: usize = 32;
/// CQ events acknowledged in one `ibv_ack_cq_events` call (it takes a mutex).
const ACK_BATCH: u32 = 64;

/// The CQ itself, shared with the queue pairs that complete into it (so it is
/// destroyed only after them).
pub(crate) struct CqShared {
    pub(crate) cq: *mut ibv_cq,
    channel: *mut ibv_comp_channel,
    /// Outstanding work requests of every QP on this CQ.
    pub(crate) slots: SlotTable,
    /// Completions the provider makes itself for requests it does not hand
    /// to the NIC (slot id, status); delivered before the CQ's own.
    synthetic: ArrayQueue<(u64, Status)>,
    /// How many `synthetic` holds: `poll` reads this one word, not the
    /// queue (whose empty pop costs a full fence), before every poll of
    /// the CQ.
    synthetic_len: AtomicUsize,
    /// Wakes a `wait` sleeping on the channel when a synthetic completion arrives.
    wake: OwnedFd,
    pub(crate) fabric: Arc<FabricInner>,
}

impl CqShared {
    /// Completes the request in slot `raw_id` with `status` without the NIC
    /// (e.g. an atomic on an unaligned remote word, which some providers
    /// refuse at post time and others fail at the target).
    pub(crate) fn complete_in_software(&self, raw_id: u64, status: Status) {
        // Cannot fail: every entry holds one of the table's slots.
        let _ = self.synthetic.push((raw_id, status));
        self.synthetic_len.fetch_add(1, Ordering::Release);
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a valid u64 to our eventfd.
        unsafe { libc::write(self.wake.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }
}

// SAFETY: ibv_cq and ibv_comp_channel are handles libibverbs uses thread-safely
// (posting QPs on other threads complete into the CQ); they are destroyed
// only in Drop. The slot table is Sync on its own.
unsafe impl Send for CqShared {}
// SAFETY: as above.
unsafe impl Sync for CqShared {}

impl Drop for CqShared {
    fn drop(&mut self) {
        // SAFETY: every QP using the CQ holds an Arc to self, so all are
        // destroyed; every CQ event was acknowledged by VerbsCq's Drop (the
        // only caller of ibv_get_cq_event). The channel goes after its CQ.
        unsafe {
            let rc = ibv_destroy_cq(self.cq);
            if rc != 0 {
                tracing::warn!(device = %self.fabric.device, error = %errno_of(rc), "ibv_destroy_cq failed");
            }
            let rc = ibv_destroy_comp_channel(self.channel);
            if rc != 0 {
                tracing::warn!(device = %self.fabric.device, error = %errno_of(rc), "ibv_destroy_comp_channel failed");
            }
        }
    }
}

impl fmt::Debug for CqShared {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CqShared")
            .field("device", &self.fabric.device)
            .field("slots", &self.slots)
            .finish()
    }
}

/// A completion queue of the verbs provider.
pub(crate) struct VerbsCq {
    shared: Arc<CqShared>,
    /// Where ibv_poll_cq writes; allocated once.
    wcs: Box<[MaybeUninit<ibv_wc>]>,
    /// Whether a notification is requested and not yet consumed.
    armed: bool,
    /// CQ events read but not yet acknowledged.
    unacked: u32,
    /// Tests run this between `wait`'s first poll and arming the CQ, to
    /// land a completion exactly in that window.
    #[cfg(test)]
    pub(crate) before_arm: Option<Box<dyn FnMut() + Send>>,
}

// SAFETY: the raw parts live in CqShared (Send + Sync); `wcs` is scratch
// space used only through &mut self.
unsafe impl Send for VerbsCq {}
// SAFETY: no method works through &self on the raw parts.
unsafe impl Sync for VerbsCq {}

impl fmt::Debug for VerbsCq {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("VerbsCq")
            .field("shared", &self.shared)
            .field("armed", &self.armed)
            .finish()
    }
}

impl Drop for VerbsCq {
    fn drop(&mut self) {
        if self.unacked > 0 {
            // SAFETY: the CQ lives (we hold shared); acknowledges exactly the
            // events this object read, which must happen before destroy.
            unsafe { ibv_ack_cq_events(self.shared.cq, self.unacked) };
            self.unacked = 0;
        }
    }
}

impl VerbsCq {
    pub(crate) fn new(fabric: Arc<FabricInner>, depth: usize) -> Result<VerbsCq> {
        let max = fabric.limits.max_cqe as usize;
        if depth > max {
            return Err(Error::InvalidArgument(format!(
                "a completion queue of depth {depth} is deeper than RDMA device {} allows ({max})",
                fabric.device
            )));
        }
        // SAFETY: the context is open while `fabric` lives.
        let channel = unsafe { ibv_create_comp_channel(fabric.ctx) };
        if channel.is_null() {
            return Err(verb_error(
                "ibv_create_comp_channel",
                &fabric.device,
                last_errno_or(libc::ENOMEM),
            ));
        }
        // SAFETY: channel was just created and is valid.
        if let Err(e) = set_nonblocking(unsafe { (*channel).fd }) {
            // SAFETY: channel has no CQ yet and is destroyed once.
            unsafe { ibv_destroy_comp_channel(channel) };
            return Err(verb_error(
                "fcntl(O_NONBLOCK) on the completion channel",
                &fabric.device,
                e,
            ));
        }
        // SAFETY: context open, channel valid; cq_context unused (null).
        let cq = unsafe {
            ibv_create_cq(
                fabric.ctx,
                depth as libc::c_int,
                std::ptr::null_mut(),
                channel,
                0,
            )
        };
        if cq.is_null() {
            let err = last_errno_or(libc::ENOMEM);
            // SAFETY: the channel has no CQ and is destroyed once.
            unsafe { ibv_destroy_comp_channel(channel) };
            return Err(verb_error("ibv_create_cq", &fabric.device, err));
        }
        // SAFETY: plain syscall; the descriptor is owned just below.
        let efd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if efd < 0 {
            let err = std::io::Error::last_os_error();
            // SAFETY: the CQ has no QP yet; destroyed once, before its channel.
            unsafe {
                ibv_destroy_cq(cq);
                ibv_destroy_comp_channel(channel);
            }
            return Err(verb_error("eventfd", &fabric.device, err));
        }
        // SAFETY: efd is a fresh descriptor we own.
        let wake = unsafe { OwnedFd::from_raw_fd(efd) };
        let wcs = (0..BATCH).map(|_| MaybeUninit::uninit()).collect();
        let slots = SlotTable::new(depth);
        Ok(VerbsCq {
            shared: Arc::new(CqShared {
                cq,
                channel,
                synthetic: ArrayQueue::new(slots.capacity()),
                synthetic_len: AtomicUsize::new(0),
                slots,
                wake,
                fabric,
            }),
            wcs,
            armed: false,
            unacked: 0,
            #[cfg(test)]
            before_arm: None,
        })
    }

    pub(crate) fn shared(&self) -> &Arc<CqShared> {
        &self.shared
    }
}

impl provider::CompletionQueue for VerbsCq {
    /// Moves up to `out.len()` completions into `out`.
    ///
    /// Hot path: no allocation, no lock, no log (dropping the last reference
    /// to a region's buffer, after its owner dropped the region, unmaps it).
    #[inline]
    fn poll(&mut self, out: &mut [Completion]) -> usize {
        let mut filled = 0;
        // Seen a poll late at worst: the next one delivers it, and `wait`
        // wakes for it through the eventfd written after the count.
        while filled < out.len() && self.shared.synthetic_len.load(Ordering::Acquire) > 0 {
            let Some((raw_id, status)) = self.shared.synthetic.pop() else {
                break;
            };
            self.shared.synthetic_len.fetch_sub(1, Ordering::Relaxed);
            if let Some(data) = self.shared.slots.release(raw_id) {
                out[filled] = Completion {
                    wr_id: data.wr_id,
                    opcode: data.opcode,
                    status,
                    imm: 0,
                    byte_len: 0,
                };
                filled += 1;
            }
        }
        while filled < out.len() {
            let want = (out.len() - filled).min(BATCH);
            // SAFETY: the CQ lives while shared does; wcs has room for BATCH
            // entries and ibv_poll_cq writes at most `want` of them.
            let n =
                unsafe { ibv_poll_cq(self.shared.cq, want as i32, self.wcs.as_mut_ptr().cast()) };
            if n <= 0 {
                break;
            }
            for wc in &self.wcs[..n as usize] {
                // SAFETY: ibv_poll_cq initialised the first n entries.
                let wc = unsafe { wc.assume_init_ref() };
                let Some(data) = self.shared.slots.release(wc.wr_id) else {
                    // Its endpoint was dropped and reclaimed the slot.
                    continue;
                };
                if data.opcode != Opcode::RecvWithImm {
                    if let Some(conn) = &data.conn {
                        conn.send_polled();
                    }
                    self.shared.slots.release_covered(data.covers);
                }
                let view = WcView::of(wc);
                let c = complete(&view, &data);
                if data.quiet && c.status == Status::Success {
                    continue;
                }
                out[filled] = c;
                filled += 1;
            }
            if (n as usize) < want {
                break;
            }
        }
        filled
    }

    /// Polls; sleeps on the completion channel until something arrives or
    /// `timeout` passes (then `Ok(0)`).
    fn wait(&mut self, out: &mut [Completion], timeout: Duration) -> Result<usize> {
        if out.is_empty() {
            return Ok(0);
        }
        let deadline = deadline_after(timeout);
        loop {
            let n = self.poll(out);
            if n > 0 {
                return Ok(n);
            }
            if !self.armed {
                #[cfg(test)]
                if let Some(hook) = self.before_arm.as_mut() {
                    hook();
                }
                // SAFETY: the CQ lives while shared does.
                let rc = unsafe { ibv_req_notify_cq(self.shared.cq, 0) };
                if rc != 0 {
                    return Err(verb_error(
                        "ibv_req_notify_cq",
                        &self.shared.fabric.device,
                        errno_of(rc),
                    ));
                }
                self.armed = true;
                // A completion that arrived between the poll above and arming
                // raised no event: look again before sleeping.
                let n = self.poll(out);
                if n > 0 {
                    return Ok(n);
                }
            }
            // SAFETY: the channel lives while shared does.
            let fd = unsafe { (*self.shared.channel).fd };
            let [cq_ready, wake_ready] =
                wait_any_readable([fd, self.shared.wake.as_raw_fd()], deadline).map_err(|e| {
                    verb_error(
                        "poll on the completion channel",
                        &self.shared.fabric.device,
                        e,
                    )
                })?;
            if wake_ready {
                let mut count = 0u64;
                // SAFETY: reads 8 bytes into a valid u64 from our non-blocking eventfd.
                unsafe {
                    libc::read(
                        self.shared.wake.as_raw_fd(),
                        (&mut count as *mut u64).cast(),
                        8,
                    )
                };
            }
            if !cq_ready {
                if wake_ready {
                    continue;
                }
                return Ok(0);
            }
            let mut cq: *mut ibv_cq = std::ptr::null_mut();
            let mut context: *mut libc::c_void = std::ptr::null_mut();
            // SAFETY: channel valid; out-pointers valid. The fd is
            // non-blocking, so a spurious wake-up returns EAGAIN.
            let rc = unsafe { ibv_get_cq_event(self.shared.channel, &mut cq, &mut context) };
            if rc == 0 {
                self.armed = false;
                self.unacked += 1;
                if self.unacked >= ACK_BATCH {
                    // SAFETY: acknowledges events read from this CQ.
                    unsafe { ibv_ack_cq_events(self.shared.cq, self.unacked) };
                    self.unacked = 0;
                }
            } else {
                let err = std::io::Error::last_os_error();
                if err.kind() != std::io::ErrorKind::WouldBlock
                    && err.kind() != std::io::ErrorKind::Interrupted
                {
                    return Err(verb_error(
                        "ibv_get_cq_event",
                        &self.shared.fabric.device,
                        err,
                    ));
                }
            }
        }
    }
}

/// The fields of an `ibv_wc` that matter here.
#[derive(Clone, Copy, Debug)]
pub(crate) struct WcView {
    pub(crate) status: u32,
    pub(crate) opcode: u32,
    pub(crate) flags: u32,
    pub(crate) byte_len: u32,
    /// Immediate data as it sits in the wc (network byte order).
    pub(crate) imm_be: u32,
}

impl WcView {
    fn of(wc: &ibv_wc) -> WcView {
        WcView {
            status: wc.status,
            opcode: wc.opcode,
            flags: wc.wc_flags,
            byte_len: wc.byte_len,
            // SAFETY: both union members are u32; reading either is defined.
            imm_be: unsafe { wc.imm_data_invalidated_rkey_union.imm_data },
        }
    }
}

/// How a work-completion status maps to the fabric's [`Status`].
///
/// | ibv_wc_status | Status |
/// |---|---|
/// | SUCCESS | Success |
/// | REM_ACCESS_ERR | RemoteAccess (bad rkey, other PD, out of bounds, missing right) |
/// | REM_INV_REQ_ERR, REM_OP_ERR, REM_INV_RD_REQ_ERR, REM_ABORT_ERR | RemoteOperation (e.g. unaligned atomic) |
/// | LOC_PROT_ERR, LOC_LEN_ERR, LOC_ACCESS_ERR, LOC_QP_OP_ERR, MW_BIND_ERR | LocalProtection |
/// | RETRY_EXC_ERR, RNR_RETRY_EXC_ERR, RESP_TIMEOUT_ERR, BAD_RESP_ERR, FATAL_ERR, GENERAL_ERR, others | PeerLost |
/// | WR_FLUSH_ERR | PeerLost when the connection was lost, Flushed otherwise |
pub(crate) fn map_status(status: u32, fate: Fate) -> Status {
    use ibv_wc_status::*;
    match status {
        IBV_WC_SUCCESS => Status::Success,
        IBV_WC_REM_ACCESS_ERR => Status::RemoteAccess,
        IBV_WC_REM_INV_REQ_ERR
        | IBV_WC_REM_OP_ERR
        | IBV_WC_REM_INV_RD_REQ_ERR
        | IBV_WC_REM_ABORT_ERR => Status::RemoteOperation,
        IBV_WC_LOC_PROT_ERR
        | IBV_WC_LOC_LEN_ERR
        | IBV_WC_LOC_ACCESS_ERR
        | IBV_WC_LOC_QP_OP_ERR
        | IBV_WC_MW_BIND_ERR => Status::LocalProtection,
        IBV_WC_WR_FLUSH_ERR => {
            if fate.is_peer_lost() {
                Status::PeerLost
            } else {
                Status::Flushed
            }
        }
        _ => Status::PeerLost,
    }
}

/// The fate an error completion gives its connection (None: no change);
/// recorded only if the connection had none yet.
pub(crate) fn fate_after(status: u32) -> Option<Fate> {
    use ibv_wc_status::*;
    match status {
        IBV_WC_SUCCESS => None,
        // A flush nobody here asked for: the QP went to ERR on its own (the
        // target side of a refused access, for one).
        IBV_WC_WR_FLUSH_ERR => Some(Fate::QpError),
        IBV_WC_RETRY_EXC_ERR | IBV_WC_RNR_RETRY_EXC_ERR | IBV_WC_RESP_TIMEOUT_ERR => {
            Some(Fate::PeerSilent)
        }
        _ => Some(Fate::QpError),
    }
}

/// Builds the completion of `wc` for the request `slot` remembers, and
/// records on the connection what an error completion means for it.
pub(crate) fn complete(wc: &WcView, slot: &SlotData) -> Completion {
    let mut fate = Fate::Alive;
    if let Some(conn) = &slot.conn {
        if let Some(next) = fate_after(wc.status) {
            conn.set_fate(next);
        }
        fate = conn.fate();
    }
    let status = map_status(wc.status, fate);
    let mut completion = Completion {
        wr_id: slot.wr_id,
        opcode: slot.opcode,
        status,
        imm: 0,
        byte_len: 0,
    };
    if status != Status::Success {
        return completion;
    }
    match slot.opcode {
        Opcode::RecvWithImm => {
            completion.byte_len = wc.byte_len;
            if wc.opcode == ibv_wc_opcode::IBV_WC_RECV_RDMA_WITH_IMM
                || wc.flags & ibv_wc_flags::IBV_WC_WITH_IMM.0 != 0
            {
                completion.imm = u32::from_be(wc.imm_be);
            }
        }
        // Undefined in the wc for writes: report what was posted.
        _ => completion.byte_len = slot.len,
    }
    completion
}

#[cfg(test)]
mod tests {
    use super::*;
    use ibv_wc_status::*;
    use rstest::rstest;

    #[rstest]
    #[case(IBV_WC_SUCCESS, Status::Success)]
    #[case(IBV_WC_REM_ACCESS_ERR, Status::RemoteAccess)]
    #[case(IBV_WC_REM_INV_REQ_ERR, Status::RemoteOperation)]
    #[case(IBV_WC_REM_OP_ERR, Status::RemoteOperation)]
    #[case(IBV_WC_REM_INV_RD_REQ_ERR, Status::RemoteOperation)]
    #[case(IBV_WC_LOC_PROT_ERR, Status::LocalProtection)]
    #[case(IBV_WC_LOC_LEN_ERR, Status::LocalProtection)]
    #[case(IBV_WC_LOC_ACCESS_ERR, Status::LocalProtection)]
    #[case(IBV_WC_RETRY_EXC_ERR, Status::PeerLost)]
    #[case(IBV_WC_RNR_RETRY_EXC_ERR, Status::PeerLost)]
    #[case(IBV_WC_FATAL_ERR, Status::PeerLost)]
    #[case(IBV_WC_GENERAL_ERR, Status::PeerLost)]
    #[case(IBV_WC_WR_FLUSH_ERR, Status::Flushed)]
    fn statuses_map_on_a_live_connection(#[case] wc: u32, #[case] want: Status) {
        assert_eq!(map_status(wc, Fate::Alive), want);
    }

    #[rstest]
    #[case(Fate::PeerClosed, Status::PeerLost)]
    #[case(Fate::PeerSilent, Status::PeerLost)]
    #[case(Fate::DeviceRemoved, Status::PeerLost)]
    #[case(Fate::QpError, Status::Flushed)]
    #[case(Fate::LocalClose, Status::Flushed)]
    fn flushes_say_whether_the_peer_was_lost(#[case] fate: Fate, #[case] want: Status) {
        assert_eq!(map_status(IBV_WC_WR_FLUSH_ERR, fate), want);
    }

    fn slot(opcode: Opcode, len: u32) -> SlotData {
        SlotData {
            wr_id: 77,
            opcode,
            len,
            buf: None,
            conn: None,
            quiet: false,
            covers: None,
        }
    }

    fn wc(status: u32, opcode: u32, byte_len: u32, imm: u32, flags: u32) -> WcView {
        WcView {
            status,
            opcode,
            flags,
            byte_len,
            imm_be: imm.to_be(),
        }
    }

    #[test]
    fn a_write_with_immediate_arrives_with_host_order_imm_and_length() {
        let c = complete(
            &wc(
                IBV_WC_SUCCESS,
                ibv_wc_opcode::IBV_WC_RECV_RDMA_WITH_IMM,
                64,
                0xdead_beef,
                ibv_wc_flags::IBV_WC_WITH_IMM.0,
            ),
            &slot(Opcode::RecvWithImm, 0),
        );
        assert_eq!(
            c,
            Completion {
                wr_id: 77,
                opcode: Opcode::RecvWithImm,
                status: Status::Success,
                imm: 0xdead_beef,
                byte_len: 64
            }
        );
    }

    #[rstest]
    #[case(Opcode::Write, ibv_wc_opcode::IBV_WC_RDMA_WRITE, 100)]
    #[case(Opcode::WriteWithImm, ibv_wc_opcode::IBV_WC_RDMA_WRITE, 100)]
    #[case(Opcode::Read, ibv_wc_opcode::IBV_WC_RDMA_READ, 100)]
    #[case(Opcode::FetchAdd, ibv_wc_opcode::IBV_WC_FETCH_ADD, 8)]
    #[case(Opcode::CompareSwap, ibv_wc_opcode::IBV_WC_COMP_SWAP, 8)]
    fn sends_report_the_posted_opcode_and_length(
        #[case] op: Opcode,
        #[case] wc_op: u32,
        #[case] len: u32,
    ) {
        // byte_len of send completions is undefined for writes: report what was posted.
        let c = complete(&wc(IBV_WC_SUCCESS, wc_op, 0, 0, 0), &slot(op, len));
        assert_eq!(
            (c.opcode, c.status, c.byte_len, c.imm),
            (op, Status::Success, len, 0)
        );
    }

    #[rstest]
    #[case(Opcode::FetchAdd)]
    #[case(Opcode::RecvWithImm)]
    #[case(Opcode::Read)]
    fn error_completions_keep_the_posted_opcode(#[case] op: Opcode) {
        // wc.opcode is garbage in error completions.
        let c = complete(&wc(IBV_WC_REM_ACCESS_ERR, 0xffff, 5, 5, 0), &slot(op, 8));
        assert_eq!(
            (c.wr_id, c.opcode, c.status, c.byte_len),
            (77, op, Status::RemoteAccess, 0)
        );
    }

    #[test]
    fn fates_after_errors() {
        assert_eq!(fate_after(IBV_WC_SUCCESS), None);
        assert_eq!(fate_after(IBV_WC_WR_FLUSH_ERR), Some(Fate::QpError));
        assert_eq!(fate_after(IBV_WC_RETRY_EXC_ERR), Some(Fate::PeerSilent));
        assert_eq!(fate_after(IBV_WC_REM_ACCESS_ERR), Some(Fate::QpError));
    }
}

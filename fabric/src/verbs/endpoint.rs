//! A connected RC endpoint, the data path: posting work requests to the
//! queue pair, and what a post on a lost connection does. Connection set-up
//! is in [`super::connect`], the connection itself in [`super::conn`].

use std::fmt;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use rdma_sys::{
    atomic_t, ibv_recv_wr, ibv_send_flags, ibv_send_wr, ibv_sge, ibv_wr_opcode,
    imm_data_invalidated_rkey_union_t, rdma_t, wr_t,
};

use super::conn::Conn;
use super::fate::Fate;
use super::pd::MrHandle;
use super::qp::QpInfo;
use super::slots::SlotData;
use super::sys::{errno_of, verb_error};
use crate::completion::{Opcode, Status};
use crate::error::{Error, Result};
use crate::memory::{PeerView, RemoteAddr};
use crate::provider::{self, Local, LocalWord, Write, Writes};

/// A connected RC endpoint of the verbs provider.
pub(crate) struct VerbsEndpoint {
    conn: Arc<Conn>,
    key: u64,
    /// Where a batch's work requests are chained; made by the first batch.
    /// Never contended: one thread at a time posts on an endpoint.
    chain: Mutex<Option<Chain>>,
}

/// The work requests of a batch and their scatter entries, `send_depth` of
/// each, rewritten by every batch.
struct Chain {
    wrs: Box<[ibv_send_wr]>,
    sges: Box<[ibv_sge]>,
}

// SAFETY: the pointers in `wrs` point into the chain itself or at memory
// of the batch being posted; they are rewritten before every post and
// followed only by `ibv_post_send`, on the thread that posts.
unsafe impl Send for Chain {}

impl Chain {
    fn new(depth: usize) -> Chain {
        Chain {
            // SAFETY: ibv_send_wr is plain old data; all-zero is valid.
            wrs: (0..depth).map(|_| unsafe { std::mem::zeroed() }).collect(),
            sges: (0..depth)
                .map(|_| ibv_sge {
                    addr: 0,
                    length: 0,
                    lkey: 0,
                })
                .collect(),
        }
    }
}

impl fmt::Debug for VerbsEndpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("VerbsEndpoint")
            .field("conn", &self.conn)
            .finish()
    }
}

impl Drop for VerbsEndpoint {
    fn drop(&mut self) {
        // After this the monitor neither holds nor touches the connection, so
        // dropping `conn` below (the last reference) tears it down here.
        let _ = self.conn.qp.domain.fabric.monitor.unregister(self.key);
    }
}

/// The one-sided operation of a send work request.
#[derive(Clone, Copy)]
enum SendOp {
    Write,
    WriteImm(u32),
    Read,
    FetchAdd(u64),
    CompareSwap { compare: u64, swap: u64 },
}

impl SendOp {
    fn opcode(self) -> Opcode {
        match self {
            SendOp::Write => Opcode::Write,
            SendOp::WriteImm(_) => Opcode::WriteWithImm,
            SendOp::Read => Opcode::Read,
            SendOp::FetchAdd(_) => Opcode::FetchAdd,
            SendOp::CompareSwap { .. } => Opcode::CompareSwap,
        }
    }
}

impl VerbsEndpoint {
    pub(super) fn register(conn: Conn) -> Result<VerbsEndpoint> {
        let conn = Arc::new(conn);
        let key = conn.qp.domain.fabric.monitor.register(conn.clone())?;
        Ok(VerbsEndpoint {
            conn,
            key,
            chain: Mutex::new(None),
        })
    }

    /// Whether a send of `op` with `len` bytes goes inline (copied at post
    /// time).
    #[inline]
    fn inline(&self, op: SendOp, len: usize) -> bool {
        matches!(op, SendOp::Write | SendOp::WriteImm(_))
            && len > 0
            && len as u32 <= self.conn.qp.max_inline
    }

    /// What the slot of a send remembers; `quiet` and `covers` as
    /// [`SlotData`] says.
    #[inline]
    fn send_slot(
        &self,
        wr_id: u64,
        op: SendOp,
        local: Local<'_>,
        inline: bool,
        quiet: bool,
        covers: Option<u64>,
    ) -> SlotData {
        SlotData {
            wr_id,
            opcode: op.opcode(),
            len: local.len() as u32, // regions hold at most u32::MAX bytes
            // Inline data is copied at post time; otherwise the NIC reads
            // or writes the buffer until the completion.
            buf: if inline {
                None
            } else {
                Some(local.buf().clone())
            },
            conn: Some(self.conn.shared.clone()),
            quiet,
            covers,
        }
    }

    /// Posts one signaled send work request; a `quiet` one (an unsignaled
    /// write alone) is signaled all the same, so that its completion frees
    /// its place in the send queue, and its success is not reported. Hot
    /// path: no allocation or lock (error paths allocate their message).
    #[inline]
    fn post_send(
        &self,
        wr_id: u64,
        op: SendOp,
        local: Local<'_>,
        remote: RemoteAddr,
        quiet: bool,
    ) -> Result<()> {
        let len = local.len();
        let conn = &*self.conn;
        let fate = conn.shared.fate();
        if fate != Fate::Alive {
            return self.post_after_loss(fate, wr_id, op.opcode());
        }
        let qp = &conn.qp;
        debug_assert!(
            local
                .region()
                ._registration
                .as_any()
                .downcast_ref::<MrHandle>()
                .is_some_and(|mr| mr.is_in(&qp.domain)),
            "the region is not registered in the endpoint's protection domain"
        );
        let inline = self.inline(op, len);
        let slots = &qp.cq.slots;
        let slot = self.send_slot(wr_id, op, local, inline, quiet, None);
        let raw_id = slots.acquire(qp.owner, slot).ok_or(Error::QueueFull {
            what: "completion queue",
            depth: slots.capacity(),
        })?;

        if matches!(op, SendOp::FetchAdd(_) | SendOp::CompareSwap { .. }) && remote.addr % 8 != 0 {
            // Providers differ (rxe refuses the post, NICs fail it at the
            // target): answer the same way everywhere, as the target would,
            // without handing it to the NIC. The queue pair stays usable.
            qp.cq.complete_in_software(raw_id, Status::RemoteOperation);
            return Ok(());
        }
        let mut sge = ibv_sge {
            addr: 0,
            length: 0,
            lkey: 0,
        };
        // SAFETY: ibv_send_wr is plain old data (pointers, integers, unions
        // of those); all-zero is a valid value that `fill_send` refines.
        let mut send: ibv_send_wr = unsafe { std::mem::zeroed() };
        fill_send(&mut send, &mut sge, raw_id, op, local, remote, inline, true);
        conn.shared.sends.fetch_add(1, Ordering::Relaxed);
        let mut bad: *mut ibv_send_wr = std::ptr::null_mut();
        // SAFETY: the QP is valid while conn lives; `send` and `sge` are
        // valid for the call (the provider copies them). The memory `sge`
        // names is in `local`, whose buffer the slot keeps alive until the
        // completion is polled (or was copied, for inline sends).
        let rc = unsafe { rdma_sys::ibv_post_send(qp.raw, &mut send, &mut bad) };
        if rc != 0 {
            conn.shared.sends.fetch_sub(1, Ordering::Relaxed);
            let _ = slots.release(raw_id);
            return self.post_failed(
                rc,
                "ibv_post_send",
                "send queue",
                conn.send_depth,
                wr_id,
                op.opcode(),
            );
        }
        Ok(())
    }

    /// Posts the writes of a batch as work requests chained into one
    /// `ibv_post_send`. Unsignaled writes go without `IBV_SEND_SIGNALED`
    /// but the batch's last, which is always signaled (quiet if it was
    /// asked unsignaled): a completion of every batch frees the send
    /// queue entries of the unsignaled requests it follows. Room is checked first: the send queue against
    /// the connection's count of sends not yet polled, and a slot for
    /// every write is taken before any is posted, so the batch is posted
    /// whole or not at all. Hot path after the first batch (which makes
    /// the chain).
    fn post_batch(&self, writes: Writes<'_>) -> Result<()> {
        let n = writes.len();
        if n == 0 {
            // Nothing to chain (and the chain's first entry is stale).
            return Ok(());
        }
        let conn = &*self.conn;
        writes.check_depth(conn.send_depth)?;
        let mut chain = self.chain.lock().unwrap_or_else(|p| p.into_inner());
        let chain = chain.get_or_insert_with(|| Chain::new(conn.send_depth));
        let fate = conn.shared.fate();
        if fate != Fate::Alive {
            return self.batch_after_loss(fate, writes, chain);
        }
        if conn.shared.sends.load(Ordering::Acquire) + n > conn.send_depth {
            return Err(Error::QueueFull {
                what: "send queue",
                depth: conn.send_depth,
            });
        }
        let qp = &conn.qp;
        let slots = &qp.cq.slots;
        let mut covers = None;
        for (i, w) in writes.iter().enumerate() {
            debug_assert!(
                w.local
                    .region()
                    ._registration
                    .as_any()
                    .downcast_ref::<MrHandle>()
                    .is_some_and(|mr| mr.is_in(&qp.domain)),
                "the region is not registered in the endpoint's protection domain"
            );
            let op = w.imm.map_or(SendOp::Write, SendOp::WriteImm);
            let inline = self.inline(op, w.local.len());
            let signaled = !w.unsignaled || i + 1 == n;
            let slot = self.send_slot(w.wr_id, op, w.local, inline, w.unsignaled, covers);
            let Some(raw_id) = slots.acquire(qp.owner, slot) else {
                for wr in &chain.wrs[..i] {
                    let _ = slots.release(wr.wr_id);
                }
                return Err(Error::QueueFull {
                    what: "completion queue",
                    depth: slots.capacity(),
                });
            };
            fill_send(
                &mut chain.wrs[i],
                &mut chain.sges[i],
                raw_id,
                op,
                w.local,
                w.remote,
                inline,
                signaled,
            );
            covers = (!signaled).then_some(raw_id);
        }
        let first = chain.wrs.as_mut_ptr();
        for i in 1..n {
            // SAFETY: i < n <= send_depth, the chain's length.
            chain.wrs[i - 1].next = unsafe { first.add(i) };
        }
        conn.shared.sends.fetch_add(n, Ordering::Relaxed);
        let mut bad: *mut ibv_send_wr = std::ptr::null_mut();
        // SAFETY: the QP is valid while conn lives; the n chained work
        // requests and their scatter entries live in `chain`, valid for the
        // call (the provider copies them); the memory they name is kept
        // alive by the slots (or was copied, for inline sends).
        let rc = unsafe { rdma_sys::ibv_post_send(qp.raw, first, &mut bad) };
        if rc == 0 {
            return Ok(());
        }
        // The work requests before `bad` were posted; it and those after not.
        let posted = if bad.is_null() {
            0
        } else {
            ((bad as usize - first as usize) / std::mem::size_of::<ibv_send_wr>()).min(n)
        };
        conn.shared.sends.fetch_sub(n - posted, Ordering::Relaxed);
        self.batch_post_failed(rc, posted, writes, chain)
    }

    /// What a refused chained `ibv_post_send` means. With none posted, what
    /// [`VerbsEndpoint::post_failed`] says for one request. With some
    /// posted (their room was checked, so only a failing device or
    /// connection does this), the rest complete in software, `PeerLost`
    /// after the peer was lost and `Flushed` otherwise, so every write of
    /// the batch still ends in one completion.
    #[cold]
    fn batch_post_failed(
        &self,
        rc: i32,
        posted: usize,
        writes: Writes<'_>,
        chain: &mut Chain,
    ) -> Result<()> {
        let conn = &*self.conn;
        let n = writes.len();
        let cq = &conn.qp.cq;
        let err = errno_of(rc);
        if posted == 0 {
            for wr in &chain.wrs[..n] {
                let _ = cq.slots.release(wr.wr_id);
            }
            if err.raw_os_error() == Some(libc::ENOMEM) {
                return Err(Error::QueueFull {
                    what: "send queue",
                    depth: conn.send_depth,
                });
            }
            let fate = conn.shared.fate();
            if fate != Fate::Alive {
                return self.batch_after_loss(fate, writes, chain);
            }
            return Err(verb_error("ibv_post_send", &conn.shared.device, err));
        }
        let status = if conn.shared.fate().is_peer_lost() {
            Status::PeerLost
        } else {
            Status::Flushed
        };
        // An unsignaled request among those posted, with no signaled one
        // posted after it, completes only if it fails; its slot otherwise
        // comes back when the endpoint is dropped.
        tracing::warn!(peer = %conn.shared.peer, device = %conn.shared.device, error = %err, posted, of = n, %status, "ibv_post_send took part of a batch; the rest complete in software");
        for wr in &chain.wrs[posted..n] {
            cq.complete_in_software(wr.wr_id, status);
        }
        Ok(())
    }

    /// A batch on a connection that is no longer alive, as
    /// [`VerbsEndpoint::post_after_loss`] does one request: each write
    /// completes with `PeerLost` (a slot for every one is taken first), or
    /// the batch fails with `Disconnected`.
    #[cold]
    fn batch_after_loss(&self, fate: Fate, writes: Writes<'_>, chain: &mut Chain) -> Result<()> {
        let conn = &*self.conn;
        if !fate.is_peer_lost() {
            return Err(conn.shared.disconnected(fate));
        }
        let qp = &conn.qp;
        let slots = &qp.cq.slots;
        for (i, w) in writes.iter().enumerate() {
            let data = SlotData {
                wr_id: w.wr_id,
                opcode: w.imm.map_or(SendOp::Write, SendOp::WriteImm).opcode(),
                len: 0,
                buf: None,
                conn: Some(conn.shared.clone()),
                quiet: false,
                covers: None,
            };
            let Some(raw_id) = slots.acquire(qp.owner, data) else {
                for wr in &chain.wrs[..i] {
                    let _ = slots.release(wr.wr_id);
                }
                return Err(Error::QueueFull {
                    what: "completion queue",
                    depth: slots.capacity(),
                });
            };
            chain.wrs[i].wr_id = raw_id;
        }
        for wr in &chain.wrs[..writes.len()] {
            qp.cq.complete_in_software(wr.wr_id, Status::PeerLost);
        }
        Ok(())
    }

    /// What a refused `ibv_post_send` / `ibv_post_recv` means (its slot is
    /// already released): a full queue, a connection that is gone (then the
    /// work completes as it would after the loss), or a verb error.
    #[cold]
    fn post_failed(
        &self,
        rc: i32,
        verb: &'static str,
        queue: &'static str,
        depth: usize,
        wr_id: u64,
        opcode: Opcode,
    ) -> Result<()> {
        let conn = &*self.conn;
        let err = errno_of(rc);
        if err.raw_os_error() == Some(libc::ENOMEM) {
            return Err(Error::QueueFull { what: queue, depth });
        }
        let fate = conn.shared.fate();
        if fate != Fate::Alive {
            return self.post_after_loss(fate, wr_id, opcode);
        }
        Err(verb_error(verb, &conn.shared.device, err))
    }

    /// A post on a connection that is no longer alive. After the peer was
    /// lost, the request completes with [`Status::PeerLost`] through the CQ,
    /// as on every provider, so code that waits for completions learns of
    /// the loss the same way everywhere. After this side's QP stopped at an
    /// error completion of its own (a refused access), the post fails at
    /// once with [`Error::Disconnected`] saying so.
    #[cold]
    fn post_after_loss(&self, fate: Fate, wr_id: u64, opcode: Opcode) -> Result<()> {
        let conn = &*self.conn;
        if !fate.is_peer_lost() {
            return Err(conn.shared.disconnected(fate));
        }
        let qp = &conn.qp;
        let slots = &qp.cq.slots;
        let raw_id = slots
            .acquire(
                qp.owner,
                SlotData {
                    wr_id,
                    opcode,
                    len: 0,
                    buf: None,
                    conn: Some(conn.shared.clone()),
                    quiet: false,
                    covers: None,
                },
            )
            .ok_or(Error::QueueFull {
                what: "completion queue",
                depth: slots.capacity(),
            })?;
        qp.cq.complete_in_software(raw_id, Status::PeerLost);
        Ok(())
    }

    /// The queue pair's attributes as the device reports them (ibv_query_qp):
    /// state, service level, P_Key index, source GID, timeouts, depths.
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) fn qp_attributes(&self) -> Result<QpInfo> {
        self.conn.qp.info(self.conn.local.map(|a| a.ip()))
    }

    /// Moves this side's QP to ERR without telling rdma_cm, so the peer sees
    /// a silent partner (its packets are dropped, never acknowledged).
    #[cfg(test)]
    pub(crate) fn go_silent(&self) {
        self.conn.qp.to_error().expect("move the queue pair to ERR");
    }

    /// `(service level, P_Key index)` of the queue pair.
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) fn qos(&self) -> Result<(u8, u16)> {
        let info = self.qp_attributes()?;
        Ok((info.sl, info.pkey_index))
    }
}

impl provider::Endpoint for VerbsEndpoint {
    fn write(&self, w: Write<'_>) -> Result<()> {
        let op = w.imm.map_or(SendOp::Write, SendOp::WriteImm);
        self.post_send(w.wr_id, op, w.local, w.remote, w.unsignaled)
    }

    /// Hot path after the endpoint's first batch: one `ibv_post_send`.
    fn write_batch(&self, writes: Writes<'_>) -> Result<()> {
        self.post_batch(writes)
    }

    fn read(&self, wr_id: u64, local: Local<'_>, remote: RemoteAddr) -> Result<()> {
        self.post_send(wr_id, SendOp::Read, local, remote, false)
    }

    fn fetch_add(
        &self,
        wr_id: u64,
        local: LocalWord<'_>,
        remote: RemoteAddr,
        add: u64,
    ) -> Result<()> {
        self.post_send(wr_id, SendOp::FetchAdd(add), local.bytes(), remote, false)
    }

    fn compare_swap(
        &self,
        wr_id: u64,
        local: LocalWord<'_>,
        remote: RemoteAddr,
        compare: u64,
        swap: u64,
    ) -> Result<()> {
        let op = SendOp::CompareSwap { compare, swap };
        self.post_send(wr_id, op, local.bytes(), remote, false)
    }

    /// Posts a receive without buffers: a write-with-immediate consumes it
    /// and its data lands where the writer said. Hot path.
    fn post_recv(&self, wr_id: u64) -> Result<()> {
        let conn = &*self.conn;
        let fate = conn.shared.fate();
        if fate != Fate::Alive {
            return self.post_after_loss(fate, wr_id, Opcode::RecvWithImm);
        }
        let qp = &conn.qp;
        let slots = &qp.cq.slots;
        let raw_id = slots
            .acquire(
                qp.owner,
                SlotData {
                    wr_id,
                    opcode: Opcode::RecvWithImm,
                    len: 0,
                    buf: None,
                    conn: Some(conn.shared.clone()),
                    quiet: false,
                    covers: None,
                },
            )
            .ok_or(Error::QueueFull {
                what: "completion queue",
                depth: slots.capacity(),
            })?;
        let mut recv = ibv_recv_wr {
            wr_id: raw_id,
            next: std::ptr::null_mut(),
            sg_list: std::ptr::null_mut(),
            num_sge: 0,
        };
        let mut bad: *mut ibv_recv_wr = std::ptr::null_mut();
        // SAFETY: the QP is valid while conn lives; `recv` is valid for the
        // call and names no memory.
        let rc = unsafe { rdma_sys::ibv_post_recv(qp.raw, &mut recv, &mut bad) };
        if rc != 0 {
            let _ = slots.release(raw_id);
            return self.post_failed(
                rc,
                "ibv_post_recv",
                "receive queue",
                conn.recv_depth,
                wr_id,
                Opcode::RecvWithImm,
            );
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
        self.conn.shared.peer.clone()
    }
}

/// Fills `send` (all of it) and `sge` for one send work request of `op`
/// in slot `raw_id`, `inline` as [`VerbsEndpoint::inline`] says, with
/// `IBV_SEND_SIGNALED` if `signaled`. `send` names `sge`, and no next
/// request. Hot path.
#[inline]
#[allow(clippy::too_many_arguments)]
fn fill_send(
    send: &mut ibv_send_wr,
    sge: &mut ibv_sge,
    raw_id: u64,
    op: SendOp,
    local: Local<'_>,
    remote: RemoteAddr,
    inline: bool,
    signaled: bool,
) {
    *sge = ibv_sge {
        addr: local.ptr() as u64,
        length: local.len() as u32, // regions hold at most u32::MAX bytes
        lkey: local.region().lkey,
    };
    let mut flags = 0;
    if signaled {
        flags |= ibv_send_flags::IBV_SEND_SIGNALED.0;
    }
    if inline {
        flags |= ibv_send_flags::IBV_SEND_INLINE.0;
    }
    let (opcode, imm, wr) = match op {
        SendOp::Write => (ibv_wr_opcode::IBV_WR_RDMA_WRITE, 0, rdma_wr(remote)),
        SendOp::WriteImm(imm) => (
            ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM,
            imm.to_be(),
            rdma_wr(remote),
        ),
        SendOp::Read => (ibv_wr_opcode::IBV_WR_RDMA_READ, 0, rdma_wr(remote)),
        SendOp::FetchAdd(add) => (
            ibv_wr_opcode::IBV_WR_ATOMIC_FETCH_AND_ADD,
            0,
            atomic_wr(remote, add, 0),
        ),
        SendOp::CompareSwap { compare, swap } => (
            ibv_wr_opcode::IBV_WR_ATOMIC_CMP_AND_SWP,
            0,
            atomic_wr(remote, compare, swap),
        ),
    };
    // SAFETY: ibv_send_wr is plain old data (pointers, integers, unions of
    // those); all-zero is a valid value that the fields below refine.
    *send = unsafe { std::mem::zeroed() };
    send.wr_id = raw_id;
    send.next = std::ptr::null_mut();
    send.sg_list = sge;
    send.num_sge = i32::from(local.len() > 0);
    send.opcode = opcode;
    send.send_flags = flags;
    send.imm_data_invalidated_rkey_union = imm_data_invalidated_rkey_union_t { imm_data: imm };
    send.wr = wr;
}

fn rdma_wr(remote: RemoteAddr) -> wr_t {
    wr_t {
        rdma: rdma_t {
            remote_addr: remote.addr,
            rkey: remote.rkey,
        },
    }
}

fn atomic_wr(remote: RemoteAddr, compare_add: u64, swap: u64) -> wr_t {
    wr_t {
        atomic: atomic_t {
            remote_addr: remote.addr,
            compare_add,
            swap,
            rkey: remote.rkey,
        },
    }
}

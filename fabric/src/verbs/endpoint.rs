//! Connected endpoints: connection set-up over rdma_cm (active and passive
//! sides), one-sided operations, and teardown.

use std::fmt;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rdma_sys::{
    atomic_t, ibv_recv_wr, ibv_send_flags, ibv_send_wr, ibv_sge, ibv_wr_opcode,
    imm_data_invalidated_rkey_union_t, rdma_accept, rdma_bind_addr, rdma_cm_event_type,
    rdma_conn_param, rdma_connect, rdma_disconnect, rdma_establish, rdma_get_src_port, rdma_listen,
    rdma_migrate_id, rdma_reject, rdma_resolve_addr, rdma_resolve_route, rdma_t, wr_t,
};

use super::cm::{reject_text, status_text, try_get_event, wait_event, CmEvent, CmId, EventChannel};
use super::cq::VerbsCq;
use super::domain::{DomainInner, VerbsDomain};
use super::hello::{self, Hello, HelloError, RejectReason};
use super::qp::{Qp, QpInfo, RETRY_COUNT, RNR_RETRY};
use super::slots::SlotData;
use super::sys::{
    deadline_after, errno_of, last_errno_or, remaining_ms, resolve, to_sockaddr, verb_error,
};
use super::FabricInner;
use crate::completion::{Opcode, Status};
use crate::error::{Error, Result};
use crate::memory::{MemoryRegion, Registration, RemoteAddr};
use crate::EndpointOptions;

/// What has become of a connection; the first cause recorded wins.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Fate {
    Alive = 0,
    /// rdma_cm reported RDMA_CM_EVENT_DISCONNECTED.
    PeerClosed = 1,
    /// Transport or RNR retries ran out: the peer stopped answering.
    PeerSilent = 2,
    /// rdma_cm reported RDMA_CM_EVENT_DEVICE_REMOVAL.
    DeviceRemoved = 3,
    /// An error completion (bad rkey, bounds, rights) stopped the QP.
    QpError = 4,
    /// This side closed the endpoint.
    LocalClose = 5,
}

impl Fate {
    fn from_u8(v: u8) -> Fate {
        match v {
            0 => Fate::Alive,
            1 => Fate::PeerClosed,
            2 => Fate::PeerSilent,
            3 => Fate::DeviceRemoved,
            4 => Fate::QpError,
            _ => Fate::LocalClose,
        }
    }

    /// Whether flushed requests are the peer's doing (Status::PeerLost).
    pub(crate) fn is_peer_lost(self) -> bool {
        matches!(
            self,
            Fate::PeerClosed | Fate::PeerSilent | Fate::DeviceRemoved
        )
    }

    fn reason(self, device: &str) -> String {
        match self {
            Fate::Alive => "it is open".into(),
            Fate::PeerClosed => "the peer disconnected (RDMA_CM_EVENT_DISCONNECTED)".into(),
            Fate::PeerSilent => "the peer stopped answering (transport retries exhausted)".into(),
            Fate::DeviceRemoved => {
                format!("RDMA device {device} was removed (RDMA_CM_EVENT_DEVICE_REMOVAL)")
            }
            Fate::QpError => {
                "its queue pair stopped at an error completion (a refused access, such as a bad \
                              rkey, stops an RC connection on both sides); connect again"
                    .into()
            }
            Fate::LocalClose => "it was closed locally".into(),
        }
    }
}

/// The part of a connection that completions and the monitor look at.
pub(crate) struct ConnShared {
    fate: AtomicU8,
    peer: String,
    device: String,
}

impl ConnShared {
    pub(crate) fn fate(&self) -> Fate {
        Fate::from_u8(self.fate.load(Ordering::Acquire))
    }

    /// Records `fate` unless another was recorded first.
    pub(crate) fn set_fate(&self, fate: Fate) {
        let _ = self.fate.compare_exchange(
            Fate::Alive as u8,
            fate as u8,
            Ordering::AcqRel,
            Ordering::Acquire,
        );
    }

    fn disconnected(&self, fate: Fate) -> Error {
        Error::Disconnected {
            peer: self.peer.clone(),
            reason: fate.reason(&self.device),
        }
    }
}

impl fmt::Debug for ConnShared {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConnShared")
            .field("peer", &self.peer)
            .field("fate", &self.fate())
            .finish()
    }
}

/// An established connection. Field order is drop order: the QP goes
/// before the cm id, the id before its event channel.
pub(crate) struct Conn {
    shared: Arc<ConnShared>,
    qp: Qp,
    id: CmId,
    channel: EventChannel,
    local: Option<SocketAddr>,
    send_depth: usize,
    recv_depth: usize,
    peer_hello: Hello,
}

impl Conn {
    pub(crate) fn channel_fd(&self) -> i32 {
        self.channel.fd()
    }

    /// Handles every queued rdma_cm event of this connection (monitor thread).
    pub(crate) fn handle_cm_events(&self) {
        loop {
            let event = match try_get_event(&self.channel) {
                Ok(Some(event)) => event,
                Ok(None) => return,
                Err(e) => {
                    tracing::debug!(peer = %self.shared.peer, error = %e, "rdma_get_cm_event failed");
                    return;
                }
            };
            match event.kind {
                rdma_cm_event_type::RDMA_CM_EVENT_DISCONNECTED => {
                    self.lost(Fate::PeerClosed, &event);
                    // Answer the peer's disconnect request (DREP) now rather than at drop.
                    // SAFETY: the id is valid while self lives.
                    unsafe { rdma_disconnect(self.id.raw()) };
                }
                rdma_cm_event_type::RDMA_CM_EVENT_DEVICE_REMOVAL => {
                    self.lost(Fate::DeviceRemoved, &event)
                }
                _ => {
                    tracing::debug!(peer = %self.shared.peer, event = %event.name(), "rdma_cm event ignored")
                }
            }
        }
    }

    fn lost(&self, fate: Fate, event: &CmEvent) {
        self.shared.set_fate(fate);
        tracing::info!(peer = %self.shared.peer, device = %self.shared.device, event = %event.name(), "verbs connection lost");
        if let Err(e) = self.qp.to_error() {
            tracing::warn!(peer = %self.shared.peer, error = %e, "could not move the queue pair to ERR");
        }
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        self.shared.set_fate(Fate::LocalClose);
        // Flush everything, then tell the peer; the fields then destroy the
        // QP (reclaiming its slots), the id and the channel, in that order.
        let _ = self.qp.to_error();
        // SAFETY: the id is valid; disconnecting twice only returns EINVAL.
        unsafe { rdma_disconnect(self.id.raw()) };
    }
}

impl fmt::Debug for Conn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Conn")
            .field("shared", &self.shared)
            .field("qp", &self.qp)
            .field("local", &self.local)
            .field("send_depth", &self.send_depth)
            .field("recv_depth", &self.recv_depth)
            .field("peer_hello", &self.peer_hello)
            .finish()
    }
}

/// A connected RC endpoint of the verbs provider.
pub(crate) struct VerbsEndpoint {
    conn: Arc<Conn>,
    key: u64,
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
    fn register(conn: Conn) -> Result<VerbsEndpoint> {
        let conn = Arc::new(conn);
        let key = conn.qp.domain.fabric.monitor.register(conn.clone())?;
        Ok(VerbsEndpoint { conn, key })
    }

    /// Posts one signaled send work request. Hot path: no allocation or
    /// lock (error paths allocate their message).
    #[inline]
    fn post_send(
        &self,
        wr_id: u64,
        op: SendOp,
        local: &MemoryRegion,
        offset: usize,
        len: usize,
        remote: RemoteAddr,
    ) -> Result<()> {
        let conn = &*self.conn;
        let fate = conn.shared.fate();
        if fate != Fate::Alive {
            return self.post_after_loss(fate, wr_id, op.opcode());
        }
        let qp = &conn.qp;
        debug_assert!(
            matches!(&local._registration, Registration::Verbs(mr) if mr.is_in(&qp.domain)),
            "the region is not registered in the endpoint's protection domain"
        );
        let len32 = len as u32; // regions hold at most u32::MAX bytes
        let inline =
            matches!(op, SendOp::Write | SendOp::WriteImm(_)) && len > 0 && len32 <= qp.max_inline;
        let slots = &qp.cq.slots;
        let raw_id = slots
            .acquire(
                qp.owner,
                SlotData {
                    wr_id,
                    opcode: op.opcode(),
                    len: len32,
                    // Inline data is copied at post time; otherwise the NIC
                    // reads or writes the buffer until the completion.
                    buf: if inline {
                        None
                    } else {
                        Some(local.buf.clone())
                    },
                    conn: Some(conn.shared.clone()),
                },
            )
            .ok_or(Error::QueueFull {
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
            addr: local.as_ptr() as u64 + offset as u64,
            length: len32,
            lkey: local.lkey,
        };
        let mut flags = ibv_send_flags::IBV_SEND_SIGNALED.0;
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
        // SAFETY: ibv_send_wr is plain old data (pointers, integers, unions
        // of those); all-zero is a valid value that the fields below refine.
        let mut send: ibv_send_wr = unsafe { std::mem::zeroed() };
        send.wr_id = raw_id;
        send.sg_list = &mut sge;
        send.num_sge = i32::from(len > 0);
        send.opcode = opcode;
        send.send_flags = flags;
        send.imm_data_invalidated_rkey_union = imm_data_invalidated_rkey_union_t { imm_data: imm };
        send.wr = wr;
        let mut bad: *mut ibv_send_wr = std::ptr::null_mut();
        // SAFETY: the QP is valid while conn lives; `send` and `sge` are
        // valid for the call (the provider copies them). The memory `sge`
        // names is in `local`, whose buffer the slot keeps alive until the
        // completion is polled (or was copied, for inline sends).
        let rc = unsafe { rdma_sys::ibv_post_send(qp.raw, &mut send, &mut bad) };
        if rc != 0 {
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

    pub(crate) fn write(
        &self,
        wr_id: u64,
        local: &MemoryRegion,
        offset: usize,
        len: usize,
        remote: RemoteAddr,
        imm: Option<u32>,
    ) -> Result<()> {
        let op = imm.map_or(SendOp::Write, SendOp::WriteImm);
        self.post_send(wr_id, op, local, offset, len, remote)
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
        self.post_send(wr_id, SendOp::Read, local, offset, len, remote)
    }

    pub(crate) fn fetch_add(
        &self,
        wr_id: u64,
        local: &MemoryRegion,
        offset: usize,
        remote: RemoteAddr,
        add: u64,
    ) -> Result<()> {
        self.post_send(wr_id, SendOp::FetchAdd(add), local, offset, 8, remote)
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
        self.post_send(
            wr_id,
            SendOp::CompareSwap { compare, swap },
            local,
            offset,
            8,
            remote,
        )
    }

    /// Posts a receive without buffers: a write-with-immediate consumes it
    /// and its data lands where the writer said. Hot path.
    pub(crate) fn post_recv(&self, wr_id: u64) -> Result<()> {
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

    /// A post on a connection that is no longer alive. After the peer was
    /// lost, the request completes with [`Status::PeerLost`] through the CQ,
    /// as on every provider, so code that waits for completions learns of
    /// the loss the same way everywhere. After this side's QP stopped at an
    /// error completion of its own (a refused access), the post fails at
    /// once with [`Error::Disconnected`] saying so.
    #[cold]
    /// What a refused `ibv_post_send` / `ibv_post_recv` means (its slot is
    /// already released): a full queue, a connection that is gone (then the
    /// work completes as it would after the loss), or a verb error.
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
                },
            )
            .ok_or(Error::QueueFull {
                what: "completion queue",
                depth: slots.capacity(),
            })?;
        qp.cq.complete_in_software(raw_id, Status::PeerLost);
        Ok(())
    }

    pub(crate) fn peer_addr(&self) -> String {
        self.conn.shared.peer.clone()
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

/// Read/atomic depths for a connection: ours capped by what the peer's CM
/// message proposes (rdma_cm reports them from the receiver's point of view:
/// `responder_resources` is what we should serve, `initiator_depth` what we
/// may issue). Returns `(max_dest_rd_atomic, max_rd_atomic)`.
pub(crate) fn rd_atomic_depths(ours: (u8, u8), event: (u8, u8)) -> (u8, u8) {
    let (our_resp, our_init) = ours;
    let (ev_resp, ev_init) = event;
    (our_resp.min(ev_resp), our_init.min(ev_init))
}

fn conn_param(
    hello: &[u8; hello::LEN],
    responder_resources: u8,
    initiator_depth: u8,
    qp_num: u32,
) -> rdma_conn_param {
    rdma_conn_param {
        private_data: hello.as_ptr().cast(),
        private_data_len: hello::LEN as u8,
        responder_resources,
        initiator_depth,
        flow_control: 1,
        retry_count: RETRY_COUNT,
        rnr_retry_count: RNR_RETRY,
        srq: 0,
        qp_num,
    }
}

fn same_fabric(fabric: &FabricInner, cq: &VerbsCq) -> Result<()> {
    if cq.shared().fabric.ctx != fabric.ctx {
        return Err(Error::DomainMismatch(
            "the completion queue belongs to another RDMA device than the domain",
        ));
    }
    Ok(())
}

/// Waits for the next event of a connection being set up.
fn next_event(
    channel: &EventChannel,
    deadline: Option<std::time::Instant>,
    device: &str,
    timeout_step: &'static str,
) -> Result<CmEvent> {
    match wait_event(channel, deadline) {
        Ok(Some(event)) => Ok(event),
        Ok(None) => Err(Error::Timeout(timeout_step)),
        Err(e) => Err(verb_error("rdma_get_cm_event", device, e)),
    }
}

/// Active side: connects to `addr` (see the module doc for the sequence).
pub(crate) fn connect(
    domain: &Arc<DomainInner>,
    addr: &str,
    cq: &mut VerbsCq,
    opts: &EndpointOptions,
) -> Result<VerbsEndpoint> {
    let hello = Hello::new(opts.send_depth, opts.recv_depth).encode();
    connect_with_hello(domain, addr, cq, opts, &hello)
}

/// [`connect`] with the private data to send (tests send broken hellos).
pub(crate) fn connect_with_hello(
    domain: &Arc<DomainInner>,
    addr: &str,
    cq: &mut VerbsCq,
    opts: &EndpointOptions,
    hello: &[u8; hello::LEN],
) -> Result<VerbsEndpoint> {
    let fabric = &*domain.fabric;
    let device = fabric.device.as_str();
    same_fabric(fabric, cq)?;
    let dst = resolve(addr)?;
    let fail = |reason: String| Error::Connect {
        addr: addr.to_owned(),
        reason,
    };
    let deadline = deadline_after(opts.connect_timeout);

    // Declaration order matters: locals drop in reverse, so the QP goes
    // before the id and the id before its channel.
    let channel = EventChannel::new(device)?;
    let id = CmId::new(&channel, device)?;

    let mut dst_sa = to_sockaddr(dst);
    // SAFETY: id valid; dst_sa is a valid socket address for the call.
    let rc = unsafe {
        rdma_resolve_addr(
            id.raw(),
            std::ptr::null_mut(),
            (&mut dst_sa as *mut libc::sockaddr_storage).cast(),
            remaining_ms(deadline),
        )
    };
    if rc != 0 {
        return Err(fail(format!(
            "rdma_resolve_addr failed on RDMA device {device}: {}; the address must be reachable through an \
             RDMA-capable interface (rdma_cm cannot use 127.0.0.1)",
            last_errno_or(libc::EINVAL)
        )));
    }
    let event = next_event(
        &channel,
        deadline,
        device,
        "connecting over rdma_cm: resolving the address",
    )?;
    match event.kind {
        rdma_cm_event_type::RDMA_CM_EVENT_ADDR_RESOLVED => {}
        rdma_cm_event_type::RDMA_CM_EVENT_ADDR_ERROR => {
            return Err(fail(format!(
                "resolving the address failed (RDMA_CM_EVENT_ADDR_ERROR: {}): no RDMA device has a route to {dst}; \
                 use an address of the peer's RDMA interface (not 127.0.0.1)",
                status_text(event.status)
            )))
        }
        _ => return Err(fail(unexpected(&event, "RDMA_CM_EVENT_ADDR_RESOLVED"))),
    }
    if id.verbs() != fabric.ctx {
        let other = if id.verbs().is_null() {
            "no device".to_owned()
        } else {
            // SAFETY: a non-null verbs pointer is an open context of librdmacm.
            unsafe { super::sys::c_str(rdma_sys::ibv_get_device_name((*id.verbs()).device)) }
        };
        return Err(fail(format!(
            "{dst} is reached through RDMA device {other}, but this fabric was opened on {device}: \
             open `verbs:{other}` or connect to an address on {device}'s network"
        )));
    }

    // SAFETY: id valid.
    if unsafe { rdma_resolve_route(id.raw(), remaining_ms(deadline)) } != 0 {
        return Err(fail(format!(
            "rdma_resolve_route failed on RDMA device {device}: {}",
            last_errno_or(libc::EINVAL)
        )));
    }
    let event = next_event(
        &channel,
        deadline,
        device,
        "connecting over rdma_cm: resolving the route",
    )?;
    match event.kind {
        rdma_cm_event_type::RDMA_CM_EVENT_ROUTE_RESOLVED => {}
        rdma_cm_event_type::RDMA_CM_EVENT_ROUTE_ERROR => {
            return Err(fail(format!(
                "resolving the route failed (RDMA_CM_EVENT_ROUTE_ERROR: {})",
                status_text(event.status)
            )))
        }
        _ => return Err(fail(unexpected(&event, "RDMA_CM_EVENT_ROUTE_RESOLVED"))),
    }

    let qp = Qp::create(domain, cq.shared(), opts)?;
    qp.to_init(&id, opts.pkey_index)?;
    let limits = fabric.limits;
    let mut param = conn_param(
        hello,
        limits.responder_resources,
        limits.initiator_depth,
        qp.qp_num(),
    );
    // SAFETY: id valid; param and the hello it points to live across the call
    // (librdmacm copies the private data).
    if unsafe { rdma_connect(id.raw(), &mut param) } != 0 {
        return Err(fail(format!(
            "rdma_connect failed on RDMA device {device}: {}",
            last_errno_or(libc::EINVAL)
        )));
    }
    let event = next_event(
        &channel,
        deadline,
        device,
        "connecting over rdma_cm: waiting for the peer to accept",
    )?;
    match event.kind {
        rdma_cm_event_type::RDMA_CM_EVENT_CONNECT_RESPONSE => {}
        rdma_cm_event_type::RDMA_CM_EVENT_REJECTED => {
            return Err(fail(reject_text(event.status, event.private_data())));
        }
        rdma_cm_event_type::RDMA_CM_EVENT_UNREACHABLE => {
            return Err(fail(format!(
                "the peer did not answer the connect request (RDMA_CM_EVENT_UNREACHABLE: {})",
                status_text(event.status)
            )));
        }
        _ => return Err(fail(unexpected(&event, "RDMA_CM_EVENT_CONNECT_RESPONSE"))),
    }
    // Dropping `id` from here on rejects the connection at the peer.
    let peer_hello = Hello::accept(event.private_data()).map_err(|e| fail(e.to_string()))?;
    let (max_dest, max_rd) = rd_atomic_depths(
        (limits.responder_resources, limits.initiator_depth),
        (event.responder_resources, event.initiator_depth),
    );
    qp.to_rtr(&id, opts.service_level, max_dest)?;
    qp.to_rts(&id, max_rd)?;
    // SAFETY: id valid, in the connect-response state; sends the RTU.
    if unsafe { rdma_establish(id.raw()) } != 0 {
        return Err(fail(format!(
            "rdma_establish failed on RDMA device {device}: {}",
            last_errno_or(libc::EINVAL)
        )));
    }
    let local = id.local_addr();
    tracing::debug!(
        peer = addr,
        device,
        qp_num = qp.qp_num(),
        max_rd,
        max_dest,
        "verbs connection established"
    );
    VerbsEndpoint::register(Conn {
        shared: Arc::new(ConnShared {
            fate: AtomicU8::new(Fate::Alive as u8),
            peer: addr.to_owned(),
            device: device.to_owned(),
        }),
        qp,
        id,
        channel,
        local,
        send_depth: opts.send_depth,
        recv_depth: opts.recv_depth,
        peer_hello,
    })
}

fn unexpected(event: &CmEvent, wanted: &str) -> String {
    format!(
        "rdma_cm reported {} ({}) while waiting for {wanted}",
        event.name(),
        status_text(event.status)
    )
}

/// A passive rdma_cm id listening for connections.
pub(crate) struct VerbsListener {
    // Field order is drop order: the id before its channel.
    id: CmId,
    channel: EventChannel,
    fabric: Arc<FabricInner>,
    local: String,
    /// Serialises accepts: events of the listening channel are consumed by one caller at a time.
    accepting: Mutex<()>,
}

impl fmt::Debug for VerbsListener {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("VerbsListener")
            .field("local", &self.local)
            .field("device", &self.fabric.device)
            .finish()
    }
}

impl VerbsListener {
    pub(crate) fn new(fabric: Arc<FabricInner>, addr: &str) -> Result<VerbsListener> {
        let device = fabric.device.clone();
        let at = resolve(addr)?;
        let channel = EventChannel::new(&device)?;
        let id = CmId::new(&channel, &device)?;
        let mut sa = to_sockaddr(at);
        // SAFETY: id valid; sa is a valid socket address for the call.
        if unsafe { rdma_bind_addr(id.raw(), (&mut sa as *mut libc::sockaddr_storage).cast()) } != 0
        {
            let err = last_errno_or(libc::EADDRNOTAVAIL);
            let hint = match err.raw_os_error() {
                Some(libc::EADDRINUSE) => "the port is taken; pick another or port 0".to_owned(),
                _ => format!(
                    "listen on the address of an RDMA interface (`rdma link` names {device}'s netdev; \
                     rdma_cm cannot use 127.0.0.1) or on 0.0.0.0"
                ),
            };
            return Err(Error::Connect {
                addr: addr.to_owned(),
                reason: format!("rdma_bind_addr failed on RDMA device {device}: {err}; {hint}"),
            });
        }
        if !id.verbs().is_null() && id.verbs() != fabric.ctx {
            return Err(Error::Connect {
                addr: addr.to_owned(),
                reason: format!(
                    "{at} belongs to another RDMA device than {device}: listen on an address of {device}'s netdev"
                ),
            });
        }
        // SAFETY: id valid and bound.
        if unsafe { rdma_listen(id.raw(), 128) } != 0 {
            return Err(verb_error(
                "rdma_listen",
                &device,
                last_errno_or(libc::EINVAL),
            ));
        }
        // SAFETY: id valid and bound; the port comes back in network order.
        let port = u16::from_be(unsafe { rdma_get_src_port(id.raw()) });
        let local = SocketAddr::new(at.ip(), port).to_string();
        tracing::debug!(%local, device, "verbs listener bound");
        Ok(VerbsListener {
            id,
            channel,
            fabric,
            local,
            accepting: Mutex::new(()),
        })
    }

    pub(crate) fn local_addr(&self) -> String {
        self.local.clone()
    }

    /// Waits for one connection request and establishes it (see the module
    /// doc for the sequence).
    pub(crate) fn accept(
        &self,
        domain: &VerbsDomain,
        cq: &mut VerbsCq,
        opts: &EndpointOptions,
        timeout: Option<Duration>,
    ) -> Result<VerbsEndpoint> {
        let fabric = &*self.fabric;
        let device = fabric.device.as_str();
        if domain.inner().fabric.ctx != fabric.ctx {
            return Err(Error::DomainMismatch(
                "the domain belongs to another RDMA device than the listener",
            ));
        }
        same_fabric(fabric, cq)?;
        let _one_at_a_time = self.accepting.lock().unwrap_or_else(|p| p.into_inner());
        let deadline = timeout.and_then(deadline_after);
        let request = loop {
            let event = next_event(
                &self.channel,
                deadline,
                device,
                "accepting a verbs connection",
            )?;
            match event.kind {
                rdma_cm_event_type::RDMA_CM_EVENT_CONNECT_REQUEST => break event,
                rdma_cm_event_type::RDMA_CM_EVENT_DEVICE_REMOVAL if event.id == self.id.raw() => {
                    return Err(Error::ProviderUnavailable {
                        provider: format!("verbs:{device}"),
                        reason: format!(
                            "RDMA device {device} was removed (RDMA_CM_EVENT_DEVICE_REMOVAL)"
                        ),
                    });
                }
                _ => {
                    // Late events of a request that failed before it got its
                    // own channel; nothing waits for them.
                    tracing::debug!(event = %event.name(), "rdma_cm event on the listener ignored");
                }
            }
        };
        self.establish(request, domain, cq, opts)
    }

    fn establish(
        &self,
        request: CmEvent,
        domain: &VerbsDomain,
        cq: &mut VerbsCq,
        opts: &EndpointOptions,
    ) -> Result<VerbsEndpoint> {
        let fabric = &*self.fabric;
        let device = fabric.device.as_str();
        // The channel is declared before the id so that it is dropped after it.
        let channel = EventChannel::new(device);
        // SAFETY: a CONNECT_REQUEST's id is a new id that the application
        // owns and must destroy.
        let id = unsafe { CmId::from_raw(request.id) };
        let peer = id
            .peer_addr()
            .map_or_else(|| "an unknown peer".to_owned(), |a| a.to_string());
        let fail = |reason: String| Error::Connect {
            addr: peer.clone(),
            reason,
        };
        let reject = |reason: RejectReason| {
            let hello = Hello::reject(reason).encode();
            // SAFETY: id valid; the hello lives across the call (copied).
            unsafe { rdma_reject(id.raw(), hello.as_ptr().cast(), hello::LEN as u8) };
        };

        let peer_hello = match Hello::accept(request.private_data()) {
            Ok(hello) => hello,
            Err(e) => {
                reject(match e {
                    HelloError::NotRfaas => RejectReason::NotRfaas,
                    HelloError::Version(_) => RejectReason::Version,
                });
                return Err(fail(format!("refused the connection: {e}")));
            }
        };
        if id.verbs() != fabric.ctx {
            reject(RejectReason::WrongDevice);
            return Err(fail(format!(
                "refused the connection: it arrived on another RDMA device than {device}; \
                 listen on an address of {device}'s netdev"
            )));
        }
        let channel = match channel {
            Ok(channel) => channel,
            Err(e) => {
                reject(RejectReason::Resources);
                return Err(e);
            }
        };
        // SAFETY: id and channel valid; the request event was acknowledged
        // already, so the migration does not wait for it.
        if unsafe { rdma_migrate_id(id.raw(), channel.raw()) } != 0 {
            let err = last_errno_or(libc::EINVAL);
            reject(RejectReason::Resources);
            return Err(verb_error("rdma_migrate_id", device, err));
        }
        // Our own channel from here on; rejects still go through the id.
        let limits = fabric.limits;
        let (max_dest, max_rd) = rd_atomic_depths(
            (limits.responder_resources, limits.initiator_depth),
            (request.responder_resources, request.initiator_depth),
        );
        let setup = || -> Result<Qp> {
            let qp = Qp::create(domain.inner(), cq.shared(), opts)?;
            qp.to_init(&id, opts.pkey_index)?;
            qp.to_rtr(&id, opts.service_level, max_dest)?;
            qp.to_rts(&id, max_rd)?;
            Ok(qp)
        };
        let qp = match setup() {
            Ok(qp) => qp,
            Err(e) => {
                reject(RejectReason::Resources);
                return Err(e);
            }
        };
        let hello = Hello::new(opts.send_depth, opts.recv_depth).encode();
        let mut param = conn_param(&hello, max_dest, max_rd, qp.qp_num());
        // SAFETY: id valid; param and the hello live across the call.
        if unsafe { rdma_accept(id.raw(), &mut param) } != 0 {
            return Err(fail(format!(
                "rdma_accept failed on RDMA device {device}: {}",
                last_errno_or(libc::EINVAL)
            )));
        }
        let deadline = deadline_after(opts.connect_timeout);
        let event = next_event(
            &channel,
            deadline,
            device,
            "accepting a verbs connection: waiting for the peer's ready-to-use",
        )?;
        match event.kind {
            rdma_cm_event_type::RDMA_CM_EVENT_ESTABLISHED => {}
            rdma_cm_event_type::RDMA_CM_EVENT_REJECTED => {
                return Err(fail(format!(
                    "the peer gave up on the connection after our accept ({})",
                    reject_text(event.status, event.private_data())
                )));
            }
            _ => return Err(fail(unexpected(&event, "RDMA_CM_EVENT_ESTABLISHED"))),
        }
        let local = id.local_addr();
        tracing::debug!(%peer, device, qp_num = qp.qp_num(), max_rd, max_dest, "verbs connection accepted");
        VerbsEndpoint::register(Conn {
            shared: Arc::new(ConnShared {
                fate: AtomicU8::new(Fate::Alive as u8),
                peer,
                device: device.to_owned(),
            }),
            qp,
            id,
            channel,
            local,
            send_depth: opts.send_depth,
            recv_depth: opts.recv_depth,
            peer_hello,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn depths_take_the_smaller_of_ours_and_the_peers() {
        // rdma_cm hands the values from the receiver's side: serve what the
        // peer will issue, issue what the peer will serve.
        assert_eq!(rd_atomic_depths((16, 16), (4, 8)), (4, 8));
        assert_eq!(rd_atomic_depths((2, 16), (16, 16)), (2, 16));
        assert_eq!(rd_atomic_depths((16, 16), (0, 0)), (0, 0));
    }

    #[test]
    fn fates_round_trip_and_only_the_first_sticks() {
        for fate in [
            Fate::Alive,
            Fate::PeerClosed,
            Fate::PeerSilent,
            Fate::DeviceRemoved,
            Fate::QpError,
            Fate::LocalClose,
        ] {
            assert_eq!(Fate::from_u8(fate as u8), fate);
        }
        let shared = ConnShared {
            fate: AtomicU8::new(Fate::Alive as u8),
            peer: "192.0.2.1:7000".into(),
            device: "rxe0".into(),
        };
        shared.set_fate(Fate::PeerClosed);
        shared.set_fate(Fate::LocalClose);
        assert_eq!(shared.fate(), Fate::PeerClosed);
        let err = shared.disconnected(shared.fate()).to_string();
        assert!(
            err.contains("192.0.2.1:7000") && err.contains("DISCONNECTED"),
            "{err}"
        );
    }

    #[test]
    fn dead_rc_queue_pairs_say_to_reconnect() {
        assert!(Fate::QpError.reason("rxe0").contains("connect again"));
        assert!(Fate::DeviceRemoved.reason("rxe0").contains("rxe0"));
    }
}

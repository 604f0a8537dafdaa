//! Connection set-up over rdma_cm, both sides: the active side's connect
//! (resolve address and route, create the QP, connect, establish) and the
//! passive side's listener and accept (see the module doc of `verbs` for
//! the sequences), with the hello carried as private data.

use std::fmt;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rdma_sys::{
    rdma_accept, rdma_bind_addr, rdma_cm_event_type, rdma_conn_param, rdma_connect, rdma_establish,
    rdma_get_src_port, rdma_listen, rdma_migrate_id, rdma_reject, rdma_resolve_addr,
    rdma_resolve_route,
};

use super::cm::{reject_text, status_text, wait_event, CmEvent, CmId, EventChannel};
use super::conn::Conn;
use super::cq::VerbsCq;
use super::device::FabricInner;
use super::endpoint::VerbsEndpoint;
use super::hello::{self, Hello, HelloError, RejectReason};
use super::pd::DomainInner;
use super::qp::{Qp, RETRY_COUNT, RNR_RETRY};
use super::sys::{deadline_after, last_errno_or, remaining_ms, resolve, to_sockaddr, verb_error};
use crate::error::{Error, Result};
use crate::EndpointOptions;

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
    tracing::debug!(
        peer = addr,
        device,
        qp_num = qp.qp_num(),
        max_rd,
        max_dest,
        "verbs connection established"
    );
    VerbsEndpoint::register(Conn::new(
        addr.to_owned(),
        device,
        qp,
        id,
        channel,
        opts,
        peer_hello,
    ))
}

impl VerbsListener {
    /// The address peers connect to.
    pub(super) fn local(&self) -> String {
        self.local.clone()
    }

    /// Waits for one connection request and establishes it (see the module
    /// doc for the sequence).
    pub(super) fn accept_into(
        &self,
        domain: &Arc<DomainInner>,
        cq: &mut VerbsCq,
        opts: &EndpointOptions,
        timeout: Option<Duration>,
    ) -> Result<VerbsEndpoint> {
        let fabric = &*self.fabric;
        let device = fabric.device.as_str();
        if domain.fabric.ctx != fabric.ctx {
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

    fn establish(
        &self,
        request: CmEvent,
        domain: &Arc<DomainInner>,
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
            let qp = Qp::create(domain, cq.shared(), opts)?;
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
        tracing::debug!(%peer, device, qp_num = qp.qp_num(), max_rd, max_dest, "verbs connection accepted");
        VerbsEndpoint::register(Conn::new(peer, device, qp, id, channel, opts, peer_hello))
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
}

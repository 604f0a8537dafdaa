//! rdma_cm plumbing: event channels, connection ids, events.

use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::time::Instant;

use rdma_sys::{
    ibv_context, rdma_ack_cm_event, rdma_cm_event, rdma_cm_event_type, rdma_cm_id,
    rdma_create_event_channel, rdma_create_id, rdma_destroy_event_channel, rdma_destroy_id,
    rdma_event_channel, rdma_event_str, rdma_get_cm_event, rdma_port_space,
};

use super::hello::Hello;
use super::sys::{c_str, from_sockaddr, last_errno_or, set_nonblocking, verb_error, wait_readable};
use crate::error::Result;

/// An rdma_cm event channel (a file descriptor), non-blocking.
pub(crate) struct EventChannel {
    raw: *mut rdma_event_channel,
}

// SAFETY: the channel is a file descriptor; librdmacm's calls on it are
// thread-safe, and it is destroyed once, in Drop.
unsafe impl Send for EventChannel {}
// SAFETY: as above.
unsafe impl Sync for EventChannel {}

impl EventChannel {
    pub(crate) fn new(device: &str) -> Result<EventChannel> {
        // SAFETY: no preconditions.
        let raw = unsafe { rdma_create_event_channel() };
        if raw.is_null() {
            return Err(verb_error(
                "rdma_create_event_channel",
                device,
                last_errno_or(libc::ENODEV),
            ));
        }
        let channel = EventChannel { raw };
        set_nonblocking(channel.fd())
            .map_err(|e| verb_error("fcntl(O_NONBLOCK) on the rdma_cm channel", device, e))?;
        Ok(channel)
    }

    pub(crate) fn raw(&self) -> *mut rdma_event_channel {
        self.raw
    }

    pub(crate) fn fd(&self) -> i32 {
        // SAFETY: raw is valid while self lives.
        unsafe { (*self.raw).fd }
    }
}

impl Drop for EventChannel {
    fn drop(&mut self) {
        // SAFETY: every id on this channel was destroyed before (CmId fields
        // are declared, and so dropped, before their channel).
        unsafe { rdma_destroy_event_channel(self.raw) };
    }
}

impl fmt::Debug for EventChannel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EventChannel")
            .field("fd", &self.fd())
            .finish()
    }
}

/// An rdma_cm id; destroyed on drop.
pub(crate) struct CmId {
    raw: *mut rdma_cm_id,
}

// SAFETY: librdmacm calls on one id are serialised by its users here (set-up
// on one thread, then the monitor under its lock); destroyed once, in Drop.
unsafe impl Send for CmId {}
// SAFETY: as above.
unsafe impl Sync for CmId {}

impl CmId {
    /// A new TCP-port-space id on `channel`.
    pub(crate) fn new(channel: &EventChannel, device: &str) -> Result<CmId> {
        let mut raw = std::ptr::null_mut();
        // SAFETY: channel is valid; raw is a valid out-pointer.
        let rc = unsafe {
            rdma_create_id(
                channel.raw(),
                &mut raw,
                std::ptr::null_mut(),
                rdma_port_space::RDMA_PS_TCP,
            )
        };
        if rc != 0 {
            return Err(verb_error(
                "rdma_create_id",
                device,
                last_errno_or(libc::ENOMEM),
            ));
        }
        Ok(CmId { raw })
    }

    /// Takes ownership of an id rdma_cm created (a connection request's).
    ///
    /// # Safety
    ///
    /// `raw` is a valid id nobody else destroys.
    pub(crate) unsafe fn from_raw(raw: *mut rdma_cm_id) -> CmId {
        CmId { raw }
    }

    pub(crate) fn raw(&self) -> *mut rdma_cm_id {
        self.raw
    }

    /// The device context the id is bound to (null before address resolution).
    pub(crate) fn verbs(&self) -> *mut ibv_context {
        // SAFETY: raw is valid while self lives.
        unsafe { (*self.raw).verbs }
    }

    /// The port the id is bound to.
    pub(crate) fn port_num(&self) -> u8 {
        // SAFETY: raw is valid while self lives.
        unsafe { (*self.raw).port_num }
    }

    pub(crate) fn local_addr(&self) -> Option<SocketAddr> {
        // SAFETY: raw is valid; the route's source address is a sockaddr
        // union as large as sockaddr_storage.
        unsafe { from_sockaddr(&(*self.raw).route.addr.src_addr_union.src_addr) }
    }

    pub(crate) fn peer_addr(&self) -> Option<SocketAddr> {
        // SAFETY: as for local_addr.
        unsafe { from_sockaddr(&(*self.raw).route.addr.dst_addr_union.dst_addr) }
    }
}

impl Drop for CmId {
    fn drop(&mut self) {
        // SAFETY: raw is valid and destroyed once. rdma_destroy_id waits for
        // the acknowledgement of every event read for it: events are copied
        // and acknowledged at once (`try_get_event`), so it does not block.
        unsafe { rdma_destroy_id(self.raw) };
    }
}

impl fmt::Debug for CmId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CmId")
            .field("local", &self.local_addr())
            .field("peer", &self.peer_addr())
            .finish()
    }
}

/// Private data rdma_cm may hand over (a REJ carries the most, 148 bytes).
const MAX_PRIVATE: usize = 256;

/// A copied, already acknowledged rdma_cm event.
pub(crate) struct CmEvent {
    pub(crate) kind: rdma_cm_event_type::Type,
    pub(crate) status: i32,
    /// The id the event is about (for CONNECT_REQUEST: the new connection's).
    pub(crate) id: *mut rdma_cm_id,
    pub(crate) responder_resources: u8,
    pub(crate) initiator_depth: u8,
    private: [u8; MAX_PRIVATE],
    private_len: usize,
}

impl CmEvent {
    pub(crate) fn private_data(&self) -> &[u8] {
        &self.private[..self.private_len]
    }

    pub(crate) fn name(&self) -> String {
        event_name(self.kind)
    }
}

impl fmt::Debug for CmEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CmEvent")
            .field("event", &self.name())
            .field("status", &self.status)
            .finish()
    }
}

/// The name of an event type (`RDMA_CM_EVENT_...`).
pub(crate) fn event_name(kind: rdma_cm_event_type::Type) -> String {
    // SAFETY: rdma_event_str returns a static string for any value.
    unsafe { c_str(rdma_event_str(kind)) }
}

/// Takes the next event of `channel` if one is queued: copies what matters
/// and acknowledges it at once (so rdma_destroy_id never waits on it).
pub(crate) fn try_get_event(channel: &EventChannel) -> io::Result<Option<CmEvent>> {
    let mut event: *mut rdma_cm_event = std::ptr::null_mut();
    // SAFETY: channel valid; event is a valid out-pointer. The channel is
    // non-blocking, so an empty queue gives EAGAIN.
    let rc = unsafe { rdma_get_cm_event(channel.raw(), &mut event) };
    if rc != 0 {
        let err = io::Error::last_os_error();
        return match err.kind() {
            io::ErrorKind::WouldBlock => Ok(None),
            _ => Err(err),
        };
    }
    // SAFETY: event is valid until acknowledged below; its conn parameters
    // are the valid union member for connected (RC) ids, and private_data
    // points to private_data_len readable bytes when non-null.
    let copied = unsafe {
        let ev = &*event;
        let conn = &ev.param.conn;
        let mut private = [0u8; MAX_PRIVATE];
        let mut private_len = 0;
        if !conn.private_data.is_null() {
            private_len = usize::from(conn.private_data_len).min(MAX_PRIVATE);
            std::ptr::copy_nonoverlapping(
                conn.private_data.cast::<u8>(),
                private.as_mut_ptr(),
                private_len,
            );
        }
        CmEvent {
            kind: ev.event,
            status: ev.status,
            id: ev.id,
            responder_resources: conn.responder_resources,
            initiator_depth: conn.initiator_depth,
            private,
            private_len,
        }
    };
    // SAFETY: event came from rdma_get_cm_event and is acknowledged once.
    unsafe { rdma_ack_cm_event(event) };
    Ok(Some(copied))
}

/// Waits for the next event until `deadline`; None on timeout.
pub(crate) fn wait_event(
    channel: &EventChannel,
    deadline: Option<Instant>,
) -> io::Result<Option<CmEvent>> {
    loop {
        if let Some(event) = try_get_event(channel)? {
            return Ok(Some(event));
        }
        if !wait_readable(channel.fd(), deadline)? {
            return Ok(None);
        }
    }
}

/// `IB_CM_REJ_INVALID_SERVICE_ID`: nobody listens on that port.
const REJ_INVALID_SERVICE_ID: i32 = 8;
/// `IB_CM_REJ_CONSUMER_DEFINED`: the peer's application rejected.
const REJ_CONSUMER_DEFINED: i32 = 28;

/// Explains a REJECTED event: the reject reason (IB CM code, or -errno on
/// iWARP) and the peer's hello if it sent one.
pub(crate) fn reject_text(status: i32, private: &[u8]) -> String {
    if let Ok(hello) = Hello::decode(private) {
        if let Some(reason) = hello.reject_reason() {
            return format!("the peer rejected the connection: {reason}");
        }
    }
    match status {
        REJ_INVALID_SERVICE_ID => {
            "nobody is listening on that port (RDMA_CM_EVENT_REJECTED, reason: invalid service id)".into()
        }
        REJ_CONSUMER_DEFINED => "the peer's application rejected the connection (RDMA_CM_EVENT_REJECTED)".into(),
        1 | 3 => format!("the peer has no resources for another connection (RDMA_CM_EVENT_REJECTED, reason {status})"),
        4 => "the connection request timed out at the peer (RDMA_CM_EVENT_REJECTED, reason: timeout)".into(),
        s if s < 0 => format!(
            "the peer refused the connection (RDMA_CM_EVENT_REJECTED: {})",
            io::Error::from_raw_os_error(-s)
        ),
        s => format!("the peer rejected the connection (RDMA_CM_EVENT_REJECTED, IB CM reason {s})"),
    }
}

/// Explains an event status that is an errno (`-ETIMEDOUT`, `-ENETUNREACH`, ...).
pub(crate) fn status_text(status: i32) -> String {
    if status < 0 {
        io::Error::from_raw_os_error(-status).to_string()
    } else {
        format!("status {status}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::verbs::hello::RejectReason;

    #[test]
    fn rejects_explain_themselves() {
        assert!(reject_text(8, &[0; 148]).contains("nobody is listening"));
        let hello = Hello::reject(RejectReason::Version).encode();
        let text = reject_text(28, &hello);
        assert!(text.contains("another version"), "{text}");
        assert!(reject_text(-libc::ECONNREFUSED, &[]).contains("refused"));
    }

    #[test]
    fn errno_statuses_read_as_sentences() {
        assert!(status_text(-libc::ETIMEDOUT)
            .to_lowercase()
            .contains("timed out"));
        assert_eq!(status_text(3), "status 3");
    }

    #[test]
    fn event_names_come_from_librdmacm() {
        assert_eq!(
            event_name(rdma_cm_event_type::RDMA_CM_EVENT_DISCONNECTED),
            "RDMA_CM_EVENT_DISCONNECTED"
        );
    }
}

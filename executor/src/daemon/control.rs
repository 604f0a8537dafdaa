//! The TCP control protocol with clients: allocation, deallocation, and
//! the end of a connection (which deallocates everything made on it).

use std::io::{BufReader, Read};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rfaas_proto::control::{
    AllocateRequest, ControlError, Deallocate, Deallocated, ErrorCode, ErrorReply, Frame,
    FrameLimits, Kind,
};

use super::allocate;
use super::state::{ConnWriter, Shared, Stop};

/// Serves one client connection until it closes, then deallocates what it
/// allocated.
pub(crate) fn serve(shared: Arc<Shared>, stream: TcpStream) {
    let peer = stream
        .peer_addr()
        .map_or_else(|_| "?".to_owned(), |a| a.to_string());
    let _ = stream.set_nodelay(true);
    // A client that stops reading must not hold a watcher forever.
    let _ = stream.set_write_timeout(Some(Duration::from_secs(10)));
    let writer = match stream.try_clone() {
        Ok(w) => w,
        Err(e) => {
            tracing::warn!(%peer, error = %e, "cannot use a control connection");
            return;
        }
    };
    let conn = Arc::new(ConnWriter::new(writer));
    let conn_id = shared.next_id();
    tracing::debug!(%peer, conn = conn_id, "control connection");
    let limits = shared.client_limits();
    let mut reader = BufReader::new(stream);
    loop {
        let frame = match Frame::read_from(&mut reader, limits) {
            Ok(f) => f,
            Err(ControlError::Io(e)) => {
                tracing::debug!(%peer, error = %e, "control connection closed");
                break;
            }
            Err(e) => {
                let code = match e {
                    ControlError::TooLarge { what: "blob", .. } => ErrorCode::TooLarge,
                    _ => ErrorCode::MalformedRequest,
                };
                conn.error(0, code, format!("{e}; closing the connection"));
                linger(&conn, reader.get_mut(), limits);
                break;
            }
        };
        match frame.kind {
            Kind::AllocateRequest => {
                let reply = allocate(&shared, &conn, conn_id, &frame);
                conn.send(&reply);
                // Only now: spawning the pooled worker's successor (fork,
                // exec, dynamic linking) would compete for the CPU with the
                // allocation it replaces.
                shared.refill();
            }
            Kind::Deallocate => match frame.parse::<Deallocate>() {
                Ok(d) => deallocate(&shared, &conn, conn_id, d),
                Err(e) => conn.error(
                    request_id_of(&frame),
                    ErrorCode::MalformedRequest,
                    e.to_string(),
                ),
            },
            other => conn.error(
                request_id_of(&frame),
                ErrorCode::MalformedRequest,
                format!("a {other:?} message is not a client request; send AllocateRequest or Deallocate"),
            ),
        }
    }
    let ids: Vec<u64> = shared
        .lock()
        .allocations
        .values()
        .filter(|a| a.conn_id == conn_id)
        .map(|a| a.id)
        .collect();
    if !ids.is_empty() {
        tracing::info!(%peer, allocations = ?ids, "control connection closed; deallocating");
        let left = shared.end_allocations(&ids, Stop::Deallocate, Duration::from_secs(10));
        if left > 0 {
            tracing::error!(%peer, left, "workers did not end after SIGKILL");
        }
    }
}

/// After refusing a broken frame: stop writing, read (and drop) what the
/// client still sends for a moment, so closing does not reset the
/// connection before the client reads the refusal.
fn linger(conn: &ConnWriter, stream: &mut TcpStream, limits: FrameLimits) {
    conn.shutdown_write();
    let _ = stream.set_read_timeout(Some(Duration::from_secs(1)));
    let mut budget = u64::from(limits.max_blob) + (1 << 20);
    let mut buf = [0u8; 64 * 1024];
    let until = Instant::now() + Duration::from_secs(2);
    while budget > 0 && Instant::now() < until {
        match stream.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => budget = budget.saturating_sub(n as u64),
        }
    }
}

/// The `request_id` of a frame whose message did not parse, or 0.
fn request_id_of(frame: &Frame) -> u64 {
    serde_json::from_slice::<serde_json::Value>(&frame.json)
        .ok()
        .and_then(|v| v.get("request_id").and_then(serde_json::Value::as_u64))
        .unwrap_or(0)
}

fn deallocate(shared: &Shared, conn: &ConnWriter, conn_id: u64, d: Deallocate) {
    let known = shared
        .lock()
        .allocations
        .get(&d.allocation_id)
        .is_some_and(|a| a.conn_id == conn_id && a.ready);
    if !known {
        conn.error(
            d.request_id,
            ErrorCode::UnknownAllocation,
            format!(
                "allocation {} is not running on this connection (it ended or was made on another connection)",
                d.allocation_id
            ),
        );
        return;
    }
    let left = shared.end_allocations(
        &[d.allocation_id],
        Stop::Deallocate,
        Duration::from_secs(10),
    );
    if left > 0 {
        conn.error(
            d.request_id,
            ErrorCode::Internal,
            format!(
                "the worker of allocation {} did not end after SIGKILL",
                d.allocation_id
            ),
        );
        return;
    }
    tracing::info!(allocation = d.allocation_id, "deallocated");
    conn.send(&Frame::new(
        &Deallocated {
            request_id: d.request_id,
            allocation_id: d.allocation_id,
        },
        Vec::new(),
    ));
}

/// Handles one `AllocateRequest` and returns the reply frame.
fn allocate(shared: &Arc<Shared>, conn: &Arc<ConnWriter>, conn_id: u64, frame: &Frame) -> Frame {
    let started = Instant::now();
    let req = match frame.parse::<AllocateRequest>() {
        Ok(r) => r,
        Err(e) => {
            return error_frame(
                request_id_of(frame),
                ErrorCode::MalformedRequest,
                e.to_string(),
            )
        }
    };
    let rid = req.request_id;
    match allocate::allocate(shared, conn, conn_id, &req, &frame.blob, started) {
        Ok(ok) => Frame::new(&ok, Vec::new()),
        Err((code, message)) => {
            tracing::info!(request_id = rid, ?code, %message, "allocation refused");
            error_frame(rid, code, message)
        }
    }
}

fn error_frame(request_id: u64, code: ErrorCode, message: String) -> Frame {
    Frame::new(
        &ErrorReply {
            request_id,
            code,
            message,
        },
        Vec::new(),
    )
}

//! The clients' TCP protocol: what each request does, and the end of a
//! connection (which deallocates everything made on it). The connection
//! loop ([`super::server`]) reads the frames; the checks that need no state
//! run on it, before an allocation's library is read, and the rest on
//! request threads.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use rfaas_proto::control::client::{
    AllocateRequest, Attach, Attached, Deallocate, Deallocated, RenewLease,
};
use rfaas_proto::control::{ErrorCode, Frame, Kind};

use super::allocate::{self, Checked};
use super::outbox::DoneGuard;
use super::pool::Job;
use super::refusal::refusal;
use super::shared::Shared;
use super::state::Stop;

/// A checked allocation request whose library is still to come.
#[derive(Debug)]
pub(crate) struct Pending {
    req: AllocateRequest,
    checked: Checked,
    library_len: u32,
}

impl Pending {
    /// The library's size, from the frame header.
    pub(crate) fn library_len(&self) -> u32 {
        self.library_len
    }

    /// The request's id.
    pub(crate) fn request_id(&self) -> u64 {
        self.req.request_id
    }
}

/// What the loop does with a control message whose JSON is in.
#[derive(Debug)]
pub(crate) enum Next {
    /// Read the library (the blob) and then [`allocate`].
    Library(Box<Pending>),
    /// Send this answer and drop the blob.
    Reply(Frame),
    /// Drop the blob and run this on a request thread; it answers itself.
    Job(JobFor),
}

/// A job and what it is, for logs.
pub(crate) struct JobFor(pub Job);

impl std::fmt::Debug for JobFor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("JobFor(..)")
    }
}

/// Decides about one message of control connection `conn`. `stopping`: the
/// daemon is shutting down, so an allocation is refused at once.
pub(crate) fn message(
    shared: &Arc<Shared>,
    conn: u64,
    kind: Kind,
    json: Vec<u8>,
    blob_len: u32,
    stopping: bool,
) -> Next {
    let frame = Frame {
        kind,
        json,
        blob: Vec::new(),
    };
    match kind {
        Kind::AllocateRequest => {
            let req = match frame.parse::<AllocateRequest>() {
                Ok(r) => r,
                Err(e) => {
                    return Next::Reply(refusal(
                        request_id_of(&frame),
                        ErrorCode::MalformedRequest,
                        e.to_string(),
                    ))
                }
            };
            let rid = req.request_id;
            if stopping {
                return Next::Reply(refusal(
                    rid,
                    ErrorCode::Draining,
                    format!(
                        "executor {} is shutting down; allocate elsewhere",
                        shared.settings.node_name
                    ),
                ));
            }
            match allocate::check(shared, &req, blob_len) {
                Ok(checked) => Next::Library(Box::new(Pending {
                    req,
                    checked,
                    library_len: blob_len,
                })),
                Err((code, message)) => {
                    shared.metrics.refused(code);
                    // Past a valid token, a refusal is worth an operator's
                    // line; before it, anyone can cause one per request
                    // (the loop sums those up instead).
                    if matches!(code, ErrorCode::ExceedsLease | ErrorCode::TooLarge) {
                        tracing::info!(request_id = rid, ?code, %message, "allocation refused");
                    } else {
                        tracing::trace!(request_id = rid, ?code, %message, "allocation refused");
                    }
                    Next::Reply(refusal(rid, code, message))
                }
            }
        }
        Kind::Deallocate => match frame.parse::<Deallocate>() {
            Ok(d) => {
                let shared = Arc::clone(shared);
                Next::Job(JobFor(Box::new(move || {
                    let _done = DoneGuard::new(&shared.outbox, conn, 0);
                    let reply = deallocate(&shared, conn, d);
                    shared.send(conn, &reply);
                })))
            }
            Err(e) => Next::Reply(refusal(
                request_id_of(&frame),
                ErrorCode::MalformedRequest,
                e.to_string(),
            )),
        },
        Kind::RenewLease => match frame.parse::<RenewLease>() {
            Ok(r) => {
                let shared = Arc::clone(shared);
                Next::Job(JobFor(Box::new(move || {
                    let _done = DoneGuard::new(&shared.outbox, conn, 0);
                    let reply = super::renew::renew(&shared, conn, &r);
                    shared.send(conn, &reply);
                })))
            }
            Err(e) => Next::Reply(refusal(
                request_id_of(&frame),
                ErrorCode::MalformedRequest,
                e.to_string(),
            )),
        },
        Kind::Attach => match frame.parse::<Attach>() {
            Ok(a) => {
                let shared = Arc::clone(shared);
                Next::Job(JobFor(Box::new(move || {
                    let mut done = DoneGuard::new(&shared.outbox, conn, 0);
                    let (reply, attached) = attach(&shared, conn, &a);
                    done.granted = attached;
                    shared.send(conn, &reply);
                })))
            }
            Err(e) => Next::Reply(refusal(
                request_id_of(&frame),
                ErrorCode::MalformedRequest,
                e.to_string(),
            )),
        },
        other => Next::Reply(refusal(
            request_id_of(&frame),
            ErrorCode::MalformedRequest,
            format!(
                "a {other:?} message is not a client request; send AllocateRequest, RenewLease, Attach or Deallocate"
            ),
        )),
    }
}

/// The job that starts a checked allocation with its `library`; it
/// answers, gives back `held` bytes of the library budget, and then tops
/// the pool up.
pub(crate) fn allocate(
    shared: &Arc<Shared>,
    conn: u64,
    pending: Box<Pending>,
    library: Vec<u8>,
    held: u64,
) -> Job {
    let shared = Arc::clone(shared);
    Box::new(move || {
        let mut done = DoneGuard::new(&shared.outbox, conn, held);
        let Pending { req, checked, .. } = *pending;
        let rid = req.request_id;
        let started = std::time::Instant::now();
        let reply = match allocate::start(&shared, conn, &req, checked, &library) {
            Ok(ok) => {
                done.granted = true;
                shared.metrics.granted(started.elapsed().as_secs_f64());
                Frame::new(&ok, Vec::new())
            }
            Err((code, message)) => {
                shared.metrics.refused(code);
                tracing::info!(request_id = rid, ?code, %message, "allocation refused");
                refusal(rid, code, message)
            }
        };
        drop(library);
        shared.send(conn, &reply);
        drop(done);
        // Only now: spawning the pooled worker's successor (fork, exec,
        // dynamic linking) would compete for the CPU with the allocation
        // it replaces.
        shared.refill();
    })
}

/// The job that deallocates what control connection `conn` (from `peer`)
/// made, once it has closed.
pub(crate) fn end(shared: &Arc<Shared>, conn: u64, peer: IpAddr) -> Job {
    let shared = Arc::clone(shared);
    Box::new(move || {
        if shared.settings.workers_outlive() && shared.lock().stopping {
            // The daemon stops, not the client: the workers serve on.
            return;
        }
        let ids: Vec<u64> = shared
            .lock()
            .allocations
            .values()
            .filter(|a| a.conn_id == conn)
            .map(|a| a.id)
            .collect();
        if ids.is_empty() {
            return;
        }
        tracing::info!(%peer, allocations = ?ids, "control connection closed; deallocating");
        let left = shared.end_allocations(&ids, Stop::Deallocate, Duration::from_secs(10));
        if left > 0 {
            tracing::error!(%peer, left, "workers did not end after SIGKILL");
        }
    })
}

/// Takes adopted allocation `a.allocation_id` up on connection `conn`
/// when `a.secret` is its secret; the reply, and whether it was.
fn attach(shared: &Shared, conn: u64, a: &Attach) -> (Frame, bool) {
    let mut st = shared.lock();
    let found = st.allocations.get_mut(&a.allocation_id).filter(|al| {
        al.attach_by.is_some()
            && al.stop.is_none()
            && !al.attach_secret.is_empty()
            && same_secret(&al.attach_secret, &a.secret)
    });
    let Some(al) = found else {
        drop(st);
        tracing::info!(
            allocation = a.allocation_id,
            "attach refused: no adopted allocation with this id and secret awaits a client"
        );
        return (
            refusal(
                a.request_id,
                ErrorCode::UnknownAllocation,
                format!(
                    "allocation {} does not await a client here (it ended, was never adopted by this executor, or the secret differs); allocate again",
                    a.allocation_id
                ),
            ),
            false,
        );
    };
    al.conn_id = conn;
    al.attach_by = None;
    let expires_at = al.expires_at;
    drop(st);
    tracing::info!(
        allocation = a.allocation_id,
        "a client attached to an adopted allocation"
    );
    (
        Frame::new(
            &Attached {
                request_id: a.request_id,
                allocation_id: a.allocation_id,
                expires_at,
            },
            Vec::new(),
        ),
        true,
    )
}

/// Compares two secrets in time that depends only on their lengths.
fn same_secret(a: &str, b: &str) -> bool {
    a.len() == b.len()
        && a.bytes()
            .zip(b.bytes())
            .fold(0u8, |acc, (x, y)| acc | (x ^ y))
            == 0
}

/// The `request_id` of a frame whose message did not parse, or 0.
fn request_id_of(frame: &Frame) -> u64 {
    serde_json::from_slice::<serde_json::Value>(&frame.json)
        .ok()
        .and_then(|v| v.get("request_id").and_then(serde_json::Value::as_u64))
        .unwrap_or(0)
}

fn deallocate(shared: &Shared, conn: u64, d: Deallocate) -> Frame {
    let known = shared
        .lock()
        .allocations
        .get(&d.allocation_id)
        .is_some_and(|a| a.conn_id == conn && a.ready);
    if !known {
        tracing::debug!(
            allocation = d.allocation_id,
            "deallocation of an unknown allocation refused"
        );
        return refusal(
            d.request_id,
            ErrorCode::UnknownAllocation,
            format!(
                "allocation {} is not running on this connection (it ended or was made on another connection)",
                d.allocation_id
            ),
        );
    }
    let left = shared.end_allocations(
        &[d.allocation_id],
        Stop::Deallocate,
        Duration::from_secs(10),
    );
    if left > 0 {
        return refusal(
            d.request_id,
            ErrorCode::Internal,
            format!(
                "the worker of allocation {} did not end after SIGKILL",
                d.allocation_id
            ),
        );
    }
    tracing::info!(allocation = d.allocation_id, "deallocated");
    Frame::new(
        &Deallocated {
            request_id: d.request_id,
            allocation_id: d.allocation_id,
        },
        Vec::new(),
    )
}

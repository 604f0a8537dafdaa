//! The REST port's accept loop: HTTPS (or plain HTTP on loopback) with
//! every phase of a connection bounded, so strangers who reach the port
//! cannot hold it.
//!
//! - Caps: connections per replica and per source address. One over the
//!   per-source cap is closed at once, before any byte is read. At the
//!   replica's cap a newcomer is let in and the connection idle longest
//!   (not inside a request: waiting for its handshake, its headers or its
//!   next request) is closed for it, so strangers who hold the cap cannot
//!   keep a good client out; only when every connection is inside a
//!   request is the newcomer closed. Each is counted in
//!   `rfaas_manager_connections_refused_total{cap}`.
//! - Timeouts: the TLS handshake, a request's headers (which also closes
//!   a connection idle between requests: hyper starts the same clock
//!   while it waits for the next request) and its body.
//! - The certificate is reloaded by [`Tls::reload`] (SIGHUP in the
//!   binary) without closing the listener.

use std::collections::{BTreeMap, HashMap};
use std::future::Future as _;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::Router;
use http_body::Frame;
use hyper::service::Service as _;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use prometheus::IntCounterVec;
use rfaas_tls::ServerCert;
use tokio::net::TcpListener;
use tokio::sync::Notify;

use crate::config::HttpSettings;

/// The server certificate, if the replica serves HTTPS.
#[derive(Debug, Clone, Default)]
pub struct Tls(Option<ServerCert>);

impl Tls {
    /// Loads the certificate and key named in `http`, if any.
    pub fn load(http: &HttpSettings) -> Result<Tls, rfaas_tls::TlsError> {
        match &http.tls {
            Some((cert, key)) => Ok(Tls(Some(ServerCert::load(cert, key)?))),
            None => Ok(Tls(None)),
        }
    }

    /// Whether connections speak TLS.
    pub fn enabled(&self) -> bool {
        self.0.is_some()
    }

    /// Rereads the certificate and key; new connections get the new
    /// certificate, open ones keep theirs. On an error the old stays and
    /// the error says which file.
    pub fn reload(&self) -> Result<(), rfaas_tls::TlsError> {
        match &self.0 {
            Some(cert) => cert.reload(),
            None => Ok(()),
        }
    }
}

/// Open connections, in total and by source address, and which of them
/// are idle.
#[derive(Debug)]
struct Slots {
    max: u32,
    per_source: u32,
    open: Mutex<Open>,
}

#[derive(Debug, Default)]
struct Open {
    total: u32,
    by_source: HashMap<IpAddr, u32>,
    /// Connections not inside a request, by when they last became idle
    /// (oldest first): what is closed to make room at the replica's cap.
    idle: BTreeMap<u64, Arc<Evict>>,
    /// The key the next connection to become idle is filed under.
    next: u64,
    /// Connections told to close that have not yet.
    closing: u32,
}

/// Not idle: the key of a connection inside a request.
const BUSY: u64 = u64::MAX;

/// One connection's place; given back when dropped.
#[derive(Debug)]
struct Slot {
    slots: Arc<Slots>,
    source: IpAddr,
    /// Its key in `Open::idle`, or [`BUSY`]; changed under the lock.
    idle_since: AtomicU64,
    evict: Arc<Evict>,
}

/// How a connection is told to close to make room.
#[derive(Debug, Default)]
struct Evict {
    close: Notify,
    /// Told (and counted in `Open::closing`); set under the lock.
    told: AtomicBool,
}

/// What [`Slots::take`] did.
enum Taken {
    /// A place under the caps.
    Slot(Slot),
    /// A place, made by telling the connection idle longest to close.
    Evicted(Slot),
}

impl Slots {
    /// A place for a connection from `source`, or the cap it would pass.
    fn take(self: &Arc<Self>, source: IpAddr) -> Result<Taken, &'static str> {
        let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        if open.by_source.get(&source).copied().unwrap_or(0) >= self.per_source {
            return Err("source");
        }
        let mut evicted = false;
        if open.total.saturating_sub(open.closing) >= self.max {
            // Connections told to close count until they have: a burst of
            // newcomers cannot pass the cap by more than an eighth (or one).
            if open.closing >= (self.max / 8).max(1) {
                return Err("replica");
            }
            let Some((_, victim)) = open.idle.pop_first() else {
                return Err("replica");
            };
            victim.told.store(true, Ordering::Relaxed);
            victim.close.notify_one();
            open.closing += 1;
            evicted = true;
        }
        *open.by_source.entry(source).or_insert(0) += 1;
        open.total += 1;
        let key = open.next;
        open.next += 1;
        let evict = Arc::new(Evict::default());
        open.idle.insert(key, evict.clone());
        let slot = Slot {
            slots: self.clone(),
            source,
            idle_since: AtomicU64::new(key),
            evict,
        };
        Ok(if evicted {
            Taken::Evicted(slot)
        } else {
            Taken::Slot(slot)
        })
    }
}

impl Slot {
    /// Marks the connection inside a request until the guard drops; it is
    /// not closed to make room meanwhile.
    fn busy(self: &Arc<Self>) -> Busy {
        let mut open = self.slots.open.lock().unwrap_or_else(|p| p.into_inner());
        let key = self.idle_since.swap(BUSY, Ordering::Relaxed);
        if key != BUSY {
            open.idle.remove(&key);
        }
        Busy(self.clone())
    }

    /// Waits until the connection is told to close to make room.
    async fn evicted(&self) {
        self.evict.close.notified().await;
    }
}

/// A connection inside a request ([`Slot::busy`]).
struct Busy(Arc<Slot>);

impl Drop for Busy {
    fn drop(&mut self) {
        let slot = &self.0;
        let mut open = slot.slots.open.lock().unwrap_or_else(|p| p.into_inner());
        if slot.evict.told.load(Ordering::Relaxed) {
            return;
        }
        let key = open.next;
        open.next += 1;
        open.idle.insert(key, slot.evict.clone());
        slot.idle_since.store(key, Ordering::Relaxed);
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut open = self.slots.open.lock().unwrap_or_else(|p| p.into_inner());
        if self.evict.told.load(Ordering::Relaxed) {
            open.closing -= 1;
        } else {
            let key = *self.idle_since.get_mut();
            if key != BUSY {
                open.idle.remove(&key);
            }
        }
        open.total -= 1;
        if let Some(n) = open.by_source.get_mut(&self.source) {
            *n -= 1;
            if *n == 0 {
                open.by_source.remove(&self.source);
            }
        }
    }
}

/// The most a connection buffers of a request's headers (and reads of
/// its body at once), bytes: hyper's floor, which every request of the
/// API fits in many times over; a connection costs no more than this in
/// read buffer whatever a stranger sends.
const MAX_BUF_SIZE: usize = 8192;

/// Descriptors kept for everything but the REST port's connections
/// (database pool, logs, listeners).
const RESERVED_DESCRIPTORS: u64 = 256;

/// Raises the descriptor limit to its hard limit and returns the
/// connection cap: the configured one, or 8192, either lowered to stay
/// below the limit (with a warning when a configured one is).
pub fn connection_cap(configured: Option<u32>) -> u32 {
    // Raised at start (rfaas_service::limits); raising again is harmless.
    let limit = rfaas_service::limits::raise_descriptor_limit().map_or(1024, |l| l.soft);
    let fits = limit.saturating_sub(RESERVED_DESCRIPTORS).max(16);
    let want = u64::from(configured.unwrap_or(8192));
    if want > fits && configured.is_some() {
        tracing::warn!(
            max_connections = want,
            descriptor_limit = limit,
            using = fits,
            "[http] max_connections is above what the descriptor limit allows; \
             raise LimitNOFILE in the unit to have it"
        );
    }
    u32::try_from(want.min(fits)).unwrap_or(u32::MAX)
}

/// Serves `router` on `listener` until `stop` turns true, then lets the
/// open requests finish.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    tls: Tls,
    http: HttpSettings,
    max_connections: u32,
    refused: IntCounterVec,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> std::io::Result<()> {
    let router = router.layer(middleware::from_fn_with_state(
        Duration::from_millis(http.body_timeout_ms),
        body_deadline,
    ));
    let slots = Arc::new(Slots {
        max: max_connections,
        per_source: http.max_connections_per_source,
        open: Mutex::new(Open::default()),
    });
    let handshake = Duration::from_millis(http.handshake_timeout_ms);
    let header = Duration::from_millis(http.header_timeout_ms);
    let graceful = GracefulShutdown::new();
    let mut backoff = Duration::from_millis(5);
    loop {
        let (stream, peer) = tokio::select! {
            got = listener.accept() => match got {
                Ok(got) => got,
                Err(e) => {
                    // Out of descriptors, most likely: wait for some to
                    // close rather than spin.
                    tracing::warn!(error = %e, "accept failed; retrying");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(1));
                    continue;
                }
            },
            _ = async { stop.wait_for(|s| *s).await.is_ok() } => break,
        };
        backoff = Duration::from_millis(5);
        let slot = match slots.take(peer.ip()) {
            Ok(Taken::Slot(slot)) => Arc::new(slot),
            Ok(Taken::Evicted(slot)) => {
                refused.with_label_values(&["replica"]).inc();
                Arc::new(slot)
            }
            Err(cap) => {
                refused.with_label_values(&[cap]).inc();
                drop(stream);
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let mut builder = hyper::server::conn::http1::Builder::new();
        builder
            .timer(TokioTimer::new())
            .header_read_timeout(header)
            .max_buf_size(MAX_BUF_SIZE);
        let service = {
            let (slot, router) = (slot.clone(), TowerToHyperService::new(router.clone()));
            hyper::service::service_fn(move |req| {
                let busy = slot.busy();
                let answer = router.call(req);
                async move {
                    let answer = answer.await;
                    drop(busy);
                    answer
                }
            })
        };
        let watcher = graceful.watcher();
        let acceptor = tls
            .0
            .as_ref()
            .map(|c| tokio_rustls::TlsAcceptor::from(c.config()));
        tokio::spawn(async move {
            let served = async {
                match acceptor {
                    Some(acceptor) => {
                        let stream =
                            match tokio::time::timeout(handshake, acceptor.accept(stream)).await {
                                Ok(Ok(s)) => s,
                                Ok(Err(e)) => {
                                    tracing::debug!(%peer, error = %e, "TLS handshake failed");
                                    return Ok(());
                                }
                                Err(_) => {
                                    tracing::debug!(%peer, "TLS handshake timed out");
                                    return Ok(());
                                }
                            };
                        let conn = builder.serve_connection(TokioIo::new(stream), service);
                        watcher.watch(conn).await
                    }
                    None => {
                        let conn = builder.serve_connection(TokioIo::new(stream), service);
                        watcher.watch(conn).await
                    }
                }
            };
            tokio::select! {
                result = served => {
                    if let Err(e) = result {
                        tracing::debug!(%peer, error = %e, "connection ended");
                    }
                }
                () = slot.evicted() => {
                    tracing::debug!(%peer, "idle connection closed to make room at the replica's cap");
                }
            }
        });
    }
    drop(listener);
    graceful.shutdown().await;
    Ok(())
}

/// Bounds the arrival of a request's body by `limit`. An answer given
/// without reading the whole body (a refusal before the body is parsed)
/// says `Connection: close`: the server closes that connection, and a
/// client told so does not send its next request on it.
async fn body_deadline(State(limit): State<Duration>, req: Request, next: Next) -> Response {
    let (parts, body) = req.into_parts();
    let read = Arc::new(AtomicBool::new(http_body::Body::is_end_stream(&body)));
    let body = Body::new(Deadline {
        inner: body,
        sleep: Box::pin(tokio::time::sleep(limit)),
        read: read.clone(),
    });
    let mut response = next.run(Request::from_parts(parts, body)).await;
    if !read.load(Ordering::Relaxed) {
        response.headers_mut().insert(
            axum::http::header::CONNECTION,
            axum::http::HeaderValue::from_static("close"),
        );
    }
    response
}

/// A body that fails once its deadline passes, and says when it was read
/// to its end.
struct Deadline {
    inner: Body,
    sleep: Pin<Box<tokio::time::Sleep>>,
    read: Arc<AtomicBool>,
}

/// A body that did not arrive in time.
#[derive(Debug, thiserror::Error)]
#[error("the request body did not arrive within [http] body_timeout_ms; send it at once after the headers")]
struct BodyTimeout;

impl http_body::Body for Deadline {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let this = &mut *self;
        if let Poll::Ready(frame) = Pin::new(&mut this.inner).poll_frame(cx) {
            if frame.is_none() || this.inner.is_end_stream() {
                this.read.store(true, Ordering::Relaxed);
            }
            return Poll::Ready(frame);
        }
        match this.sleep.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Some(Err(axum::Error::new(BodyTimeout)))),
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slots(max: u32, per_source: u32) -> Arc<Slots> {
        Arc::new(Slots {
            max,
            per_source,
            open: Mutex::new(Open::default()),
        })
    }

    fn slot(taken: Result<Taken, &'static str>) -> (Arc<Slot>, bool) {
        match taken {
            Ok(Taken::Slot(s)) => (Arc::new(s), false),
            Ok(Taken::Evicted(s)) => (Arc::new(s), true),
            Err(cap) => panic!("refused at the {cap} cap"),
        }
    }

    fn told(s: &Slot) -> bool {
        s.evict.told.load(Ordering::Relaxed)
    }

    #[test]
    fn at_the_replica_cap_the_connection_idle_longest_makes_room() {
        let slots = slots(3, 10);
        let ip = |k: u8| IpAddr::from([127, 0, 0, k]);
        let (a, _) = slot(slots.take(ip(2)));
        let (b, _) = slot(slots.take(ip(3)));
        let (c, _) = slot(slots.take(ip(4)));
        // `a` is inside a request, `b` became idle again after one: `c`
        // has been idle longest.
        let _inside = a.busy();
        drop(b.busy());
        let (d, evicted) = slot(slots.take(ip(5)));
        assert!(evicted && told(&c) && !told(&a) && !told(&b));
        // Until `c` has closed, no more room is made.
        assert_eq!(slots.take(ip(6)).err(), Some("replica"));
        drop(c);
        let (_e, evicted) = slot(slots.take(ip(6)));
        assert!(evicted && told(&b) && !told(&d));
        drop(b);
        let (_f, evicted) = slot(slots.take(ip(7)));
        assert!(evicted && told(&d) && !told(&a));
    }

    #[test]
    fn a_newcomer_is_refused_when_every_connection_is_inside_a_request() {
        let slots = slots(2, 10);
        let ip = IpAddr::from([127, 0, 0, 2]);
        let (a, _) = slot(slots.take(ip));
        let (b, _) = slot(slots.take(ip));
        let (_x, _y) = (a.busy(), b.busy());
        assert_eq!(slots.take(ip).err(), Some("replica"));
    }

    #[test]
    fn the_per_source_cap_refuses_the_newcomer() {
        let slots = slots(10, 1);
        let ip = IpAddr::from([127, 0, 0, 2]);
        let (_a, _) = slot(slots.take(ip));
        assert_eq!(slots.take(ip).err(), Some("source"));
        assert!(slots.take(IpAddr::from([127, 0, 0, 3])).is_ok());
    }
}

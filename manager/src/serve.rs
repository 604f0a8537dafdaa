//! The REST port's accept loop: HTTPS (or plain HTTP on loopback) with
//! every phase of a connection bounded, so strangers who reach the port
//! cannot hold it.
//!
//! - Caps: connections per replica and per source address; one over
//!   a cap is closed at once, before any byte is read, and counted in
//!   `rfaas_manager_connections_refused_total{cap}`.
//! - Timeouts: the TLS handshake, a request's headers (which also closes
//!   a connection idle between requests: hyper starts the same clock
//!   while it waits for the next request) and its body.
//! - The certificate is reloaded by [`Tls::reload`] (SIGHUP in the
//!   binary) without closing the listener.

use std::collections::HashMap;
use std::future::Future as _;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::Router;
use http_body::Frame;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use prometheus::IntCounterVec;
use rfaas_tls::ServerCert;
use tokio::net::TcpListener;

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

/// Open connections, in total and by source address.
#[derive(Debug)]
struct Slots {
    max: u32,
    per_source: u32,
    open: Mutex<(u32, HashMap<IpAddr, u32>)>,
}

/// One connection's place; given back when dropped.
#[derive(Debug)]
struct Slot {
    slots: Arc<Slots>,
    source: IpAddr,
}

impl Slots {
    /// A place for a connection from `source`, or the cap it would pass.
    fn take(self: &Arc<Self>, source: IpAddr) -> Result<Slot, &'static str> {
        let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        if open.0 >= self.max {
            return Err("replica");
        }
        let mine = open.1.entry(source).or_insert(0);
        if *mine >= self.per_source {
            return Err("source");
        }
        *mine += 1;
        open.0 += 1;
        Ok(Slot {
            slots: self.clone(),
            source,
        })
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut open = self.slots.open.lock().unwrap_or_else(|p| p.into_inner());
        open.0 -= 1;
        if let Some(n) = open.1.get_mut(&self.source) {
            *n -= 1;
            if *n == 0 {
                open.1.remove(&self.source);
            }
        }
    }
}

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
        open: Mutex::new((0, HashMap::new())),
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
            Ok(slot) => slot,
            Err(cap) => {
                refused.with_label_values(&[cap]).inc();
                drop(stream);
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let mut builder = hyper::server::conn::http1::Builder::new();
        builder.timer(TokioTimer::new()).header_read_timeout(header);
        let service = TowerToHyperService::new(router.clone());
        let watcher = graceful.watcher();
        let acceptor = tls
            .0
            .as_ref()
            .map(|c| tokio_rustls::TlsAcceptor::from(c.config()));
        tokio::spawn(async move {
            let _slot = slot;
            let result = match acceptor {
                Some(acceptor) => {
                    let stream =
                        match tokio::time::timeout(handshake, acceptor.accept(stream)).await {
                            Ok(Ok(s)) => s,
                            Ok(Err(e)) => {
                                tracing::debug!(%peer, error = %e, "TLS handshake failed");
                                return;
                            }
                            Err(_) => {
                                tracing::debug!(%peer, "TLS handshake timed out");
                                return;
                            }
                        };
                    let conn = builder.serve_connection(TokioIo::new(stream), service);
                    watcher.watch(conn).await
                }
                None => {
                    let conn = builder.serve_connection(TokioIo::new(stream), service);
                    watcher.watch(conn).await
                }
            };
            if let Err(e) = result {
                tracing::debug!(%peer, error = %e, "connection ended");
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

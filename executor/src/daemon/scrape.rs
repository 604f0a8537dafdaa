//! The metrics port (`metrics_listen`): `GET /metrics` (the
//! [`super::metrics`] exposition) and `GET /healthz`, served by one small
//! thread.
//!
//! The server reads at most one request of 8 KiB per connection, with a
//! short timeout, and answers only those two paths: a scrape is rare, and
//! the port must not become a way to hold the daemon's resources.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use super::shared::Shared;

/// Longest request head read, bytes.
const MAX_REQUEST: usize = 8192;
/// How long a scraper may take to send its request.
const READ_TIMEOUT: Duration = Duration::from_secs(2);

/// Serves `/metrics` and `/healthz` on `listener` until the daemon stops.
pub(crate) fn serve(shared: Arc<Shared>, listener: TcpListener) {
    for conn in listener.incoming() {
        if shared.lock().stopping {
            return;
        }
        match conn {
            Ok(stream) => {
                if let Err(e) = answer(&shared, stream) {
                    tracing::debug!(error = %e, "a metrics request failed");
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot accept on the metrics port");
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
}

fn answer(shared: &Shared, mut stream: TcpStream) -> std::io::Result<()> {
    stream.set_read_timeout(Some(READ_TIMEOUT))?;
    stream.set_write_timeout(Some(READ_TIMEOUT))?;
    let mut head = Vec::with_capacity(512);
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = stream.read(&mut buf)?;
        if n == 0 {
            return Ok(());
        }
        head.extend_from_slice(&buf[..n]);
        if head.len() > MAX_REQUEST {
            return respond(
                &mut stream,
                "431 Request Header Fields Too Large",
                "text/plain",
                b"request too large\n",
            );
        }
    }
    let line = head.split(|&b| b == b'\r').next().unwrap_or_default();
    let line = String::from_utf8_lossy(line);
    let mut parts = line.split(' ');
    let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    match (method, path) {
        ("GET", "/metrics") => {
            shared.metrics.gauge_state(&shared.lock());
            let body = shared.metrics.render(&shared.usage.totals().usage);
            respond(&mut stream, "200 OK", "text/plain; version=0.0.4", &body)
        }
        ("GET", "/healthz") => {
            let body = if shared.lock().stopping {
                return respond(
                    &mut stream,
                    "503 Service Unavailable",
                    "application/json",
                    b"{\"status\":\"stopping\"}\n",
                );
            } else {
                b"{\"status\":\"ok\"}\n".as_slice()
            };
            respond(&mut stream, "200 OK", "application/json", body)
        }
        ("GET", _) => respond(
            &mut stream,
            "404 Not Found",
            "text/plain",
            b"only /metrics and /healthz are served here\n",
        ),
        _ => respond(
            &mut stream,
            "405 Method Not Allowed",
            "text/plain",
            b"only GET is served here\n",
        ),
    }
}

fn respond(stream: &mut TcpStream, status: &str, kind: &str, body: &[u8]) -> std::io::Result<()> {
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes())?;
    stream.write_all(body)?;
    stream.flush()
}

//! Strangers on a manager's REST port, for tests and the REST bench:
//! requests written and read on raw connections (so a test chooses what is
//! sent, and when), a flood of requests with made-up credentials from
//! chosen loopback addresses, idle connections, and a slowloris that sends
//! a request's headers a byte a second. Connections come from the source
//! addresses given ([`crate::abuse::connect_from`]), so a replica's
//! per-address limits tell them apart from a good client on 127.0.0.1.
//! They speak plain HTTP, or HTTPS ([`Wire`]) to a replica that serves it:
//! then idle connections either never start the handshake
//! ([`idle_connections`]) or finish it and send nothing
//! ([`idle_after_handshake`]).

use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rustls::{ClientConfig, ClientConnection, StreamOwned};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, ServerName};

use crate::abuse::connect_from;

/// A credential of the manager's form whose id no manager minted (32
/// random hex digits, as minted ids are, whose tag is then wrong; from a
/// generator seeded at random, so a flood pays no system call per
/// credential).
pub fn made_up_credential() -> String {
    format!(
        "rfaasc.{:016x}{:016x}.made-up-secret",
        fastrand::u64(..),
        fastrand::u64(..)
    )
}

/// How strangers speak to a replica: plain HTTP, or HTTPS trusting a CA.
#[derive(Debug, Clone, Default)]
pub enum Wire {
    /// Plain TCP.
    #[default]
    Plain,
    /// TLS (resuming sessions, as a careful attacker would).
    Tls(Arc<ClientConfig>),
}

impl Wire {
    /// TLS to servers whose certificate `ca_file` (PEM) signed.
    pub fn tls(ca_file: &Path) -> Result<Wire, String> {
        let mut roots = rustls::RootCertStore::empty();
        let certs = CertificateDer::pem_file_iter(ca_file)
            .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
            .map_err(|e| format!("read the CA file {}: {e}", ca_file.display()))?;
        roots.add_parsable_certificates(certs);
        let config =
            ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
                .with_safe_default_protocol_versions()
                .map_err(|e| e.to_string())?
                .with_root_certificates(roots)
                .with_no_client_auth();
        Ok(Wire::Tls(Arc::new(config)))
    }

    /// What speaks to a replica at `url`: TLS trusting the test run's CA
    /// ([`crate::tls::test_ca`]) for `https://`, plain otherwise.
    pub fn for_url(url: &str) -> Result<Wire, String> {
        if url.starts_with("https://") {
            Wire::tls(&crate::tls::test_ca().ca_file())
        } else {
            Ok(Wire::Plain)
        }
    }

    /// A connection from `from` to `to`, its TLS handshake (if any) done.
    pub fn connect(&self, from: Ipv4Addr, to: SocketAddr) -> io::Result<Conn> {
        let tcp = connect_from(from, to)?;
        match self {
            Wire::Plain => Ok(Conn::Plain(tcp)),
            Wire::Tls(config) => {
                let name = ServerName::IpAddress(to.ip().into());
                let tls = ClientConnection::new(config.clone(), name).map_err(io::Error::other)?;
                let mut stream = StreamOwned::new(tls, tcp);
                while stream.conn.is_handshaking() {
                    stream.conn.complete_io(&mut stream.sock)?;
                }
                Ok(Conn::Tls(Box::new(stream)))
            }
        }
    }
}

/// A stranger's connection.
#[derive(Debug)]
pub enum Conn {
    /// Plain TCP.
    Plain(TcpStream),
    /// TLS over TCP, past its handshake.
    Tls(Box<StreamOwned<ClientConnection, TcpStream>>),
}

impl Conn {
    /// The TCP connection under it (for timeouts).
    pub fn tcp(&self) -> &TcpStream {
        match self {
            Conn::Plain(s) => s,
            Conn::Tls(s) => &s.sock,
        }
    }
}

impl Read for Conn {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Conn::Plain(s) => s.read(buf),
            Conn::Tls(s) => s.read(buf),
        }
    }
}

impl Write for Conn {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Conn::Plain(s) => s.write(buf),
            Conn::Tls(s) => s.write(buf),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        match self {
            Conn::Plain(s) => s.flush(),
            Conn::Tls(s) => s.flush(),
        }
    }
}

/// An HTTP/1.1 request's bytes: `body`, announced as `content_length`
/// bytes (by default its own length), with `token` as bearer if given.
pub fn request(
    method: &str,
    path: &str,
    token: Option<&str>,
    body: &[u8],
    content_length: Option<usize>,
) -> Vec<u8> {
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n");
    if let Some(t) = token {
        head.push_str(&format!("Authorization: Bearer {t}\r\n"));
    }
    if !body.is_empty() || content_length.is_some() {
        head.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            content_length.unwrap_or(body.len())
        ));
    }
    head.push_str("\r\n");
    let mut bytes = head.into_bytes();
    bytes.extend_from_slice(body);
    bytes
}

/// Reads one response from `s`: its status and body (by its
/// `Content-Length`).
pub fn read_response(s: &mut impl Read) -> io::Result<(u16, Vec<u8>)> {
    read_answer(s).map(|a| (a.status, a.body))
}

/// One response.
struct Answer {
    status: u16,
    body: Vec<u8>,
    /// The server said `Connection: close`.
    close: bool,
}

fn read_answer(s: &mut impl Read) -> io::Result<Answer> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let end = loop {
        if let Some(at) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break at + 4;
        }
        let n = s.read(&mut chunk)?;
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the server closed the connection before it answered",
            ));
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..end]).to_string();
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, head.clone()))?;
    let length: usize = head
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-length")
                .then(|| v.trim().parse().ok())?
        })
        .unwrap_or(0);
    let close = head.lines().any(|l| {
        l.split_once(':').is_some_and(|(k, v)| {
            k.eq_ignore_ascii_case("connection") && v.trim().eq_ignore_ascii_case("close")
        })
    });
    let mut body = buf[end..].to_vec();
    while body.len() < length {
        let n = s.read(&mut chunk)?;
        if n == 0 {
            break;
        }
        body.extend_from_slice(&chunk[..n]);
    }
    Ok(Answer {
        status,
        body,
        close,
    })
}

/// `n` connections from each of `from` to `to` that send nothing (on a
/// TLS port: that never start the handshake); the count that could not
/// be opened.
pub fn idle_connections(from: &[Ipv4Addr], n: usize, to: SocketAddr) -> (Vec<TcpStream>, usize) {
    open_each(from, n, |a| connect_from(a, to))
}

/// `n` connections from each of `from` to `to` that finish their TLS
/// handshake (with `wire`) and then send nothing; the count that could not
/// be opened.
pub fn idle_after_handshake(
    from: &[Ipv4Addr],
    n: usize,
    to: SocketAddr,
    wire: &Wire,
) -> (Vec<Conn>, usize) {
    open_each(from, n, |a| wire.connect(a, to))
}

/// `n` of `open` from each of `from`, and the count that failed.
fn open_each<T>(
    from: &[Ipv4Addr],
    n: usize,
    open: impl Fn(Ipv4Addr) -> io::Result<T>,
) -> (Vec<T>, usize) {
    let mut opened = Vec::new();
    let mut failed = 0;
    for a in from {
        for _ in 0..n {
            match open(*a) {
                Ok(s) => opened.push(s),
                Err(_) => failed += 1,
            }
        }
    }
    (opened, failed)
}

/// `n` connections from each of `from` that send a request's headers a
/// byte a second (over `wire`: on a TLS port, a record a byte), and never
/// end them; stopped on drop.
#[derive(Debug)]
pub struct Slowloris {
    stop: Arc<AtomicBool>,
    sender: Option<JoinHandle<()>>,
    /// Connections opened.
    pub open: usize,
}

impl Slowloris {
    /// Opens the connections and starts sending.
    pub fn start(from: &[Ipv4Addr], n: usize, to: SocketAddr, wire: &Wire) -> Slowloris {
        let (mut conns, _) = idle_after_handshake(from, n, to, wire);
        let open = conns.len();
        let stop = Arc::new(AtomicBool::new(false));
        let sender = {
            let stop = Arc::clone(&stop);
            std::thread::Builder::new()
                .name("slowloris".into())
                .spawn(move || {
                    let mut headers = request("GET", "/v1/leases", None, b"", None);
                    headers.truncate(headers.len() - 2);
                    let mut at = 0;
                    // One byte a second is the attack itself, not a wait;
                    // past the request line it repeats a header forever.
                    while !stop.load(Ordering::Relaxed) {
                        let byte = match headers.get(at) {
                            Some(b) => *b,
                            None => b"X-a: b\r\n"[(at - headers.len()) % 8],
                        };
                        for s in &mut conns {
                            let _ = s.write(&[byte]).and_then(|_| s.flush());
                        }
                        at += 1;
                        std::thread::park_timeout(Duration::from_secs(1));
                    }
                })
                .expect("start the slowloris sender")
        };
        Slowloris {
            stop,
            sender: Some(sender),
            open,
        }
    }
}

impl Drop for Slowloris {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.sender.take() {
            h.thread().unpark();
            let _ = h.join();
        }
    }
}

/// What a [`Flood`] got back.
#[derive(Debug, Default)]
pub struct FloodCounts {
    /// Requests answered.
    pub answered: AtomicU64,
    /// Of them, answered `401`.
    pub unauthorized: AtomicU64,
    /// Requests that got no answer (the connection failed; it is opened
    /// again).
    pub failed: AtomicU64,
}

/// Requests with made-up credentials (a new one each) to `path`, from
/// `threads` threads, each keeping `connections` keep-alive connections
/// open from its share of the source addresses and a request in flight on
/// each; at most `per_s` requests a second in all (`None`: as fast as
/// they are answered). Stopped on drop.
#[derive(Debug)]
pub struct Flood {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
    /// What came back so far.
    pub counts: Arc<FloodCounts>,
}

/// How to flood.
#[derive(Debug, Clone)]
pub struct FloodPlan {
    /// Source addresses, shared out over the threads.
    pub from: Vec<Ipv4Addr>,
    /// Threads sending.
    pub threads: usize,
    /// Connections per thread.
    pub connections: usize,
    /// The most requests a second, in all.
    pub per_s: Option<u64>,
    /// The request's method.
    pub method: &'static str,
    /// The request's path.
    pub path: String,
    /// The request's body.
    pub body: Vec<u8>,
}

impl Flood {
    /// Starts flooding `to` over plain TCP.
    pub fn start(to: SocketAddr, plan: &FloodPlan) -> Flood {
        Flood::start_over(to, plan, &Wire::Plain)
    }

    /// Starts flooding `to` over `wire`. A connection the server closes
    /// (after an answer that says `Connection: close`, or without one) is
    /// opened again.
    pub fn start_over(to: SocketAddr, plan: &FloodPlan, wire: &Wire) -> Flood {
        let stop = Arc::new(AtomicBool::new(false));
        let counts = Arc::new(FloodCounts::default());
        let threads = (0..plan.threads.max(1))
            .map(|t| {
                let (stop, counts, plan, wire) =
                    (stop.clone(), counts.clone(), plan.clone(), wire.clone());
                std::thread::Builder::new()
                    .name(format!("flood-{t}"))
                    .spawn(move || flood_thread(t, to, &plan, &wire, &stop, &counts))
                    .expect("start a flood thread")
            })
            .collect();
        Flood {
            stop,
            threads,
            counts,
        }
    }
}

impl Drop for Flood {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for h in self.threads.drain(..) {
            let _ = h.join();
        }
    }
}

fn flood_thread(
    t: usize,
    to: SocketAddr,
    plan: &FloodPlan,
    wire: &Wire,
    stop: &AtomicBool,
    counts: &FloodCounts,
) {
    let from = |k: usize| plan.from[(t * plan.connections + k) % plan.from.len().max(1)];
    let open = |k: usize| {
        let s = wire.connect(from(k), to).ok()?;
        // A bound on a wedged read, so that a stop is seen; not a pace.
        s.tcp()
            .set_read_timeout(Some(Duration::from_secs(5)))
            .ok()?;
        Some(s)
    };
    let mut conns: Vec<Option<Conn>> = (0..plan.connections).map(open).collect();
    let per_thread_s = plan
        .per_s
        .map(|r| (r as f64 / plan.threads.max(1) as f64).max(1.0));
    let start = Instant::now();
    let mut sent = 0u64;
    while !stop.load(Ordering::Relaxed) {
        for c in conns.iter_mut().filter_map(Option::as_mut) {
            let token = made_up_credential();
            let req = request(plan.method, &plan.path, Some(&token), &plan.body, None);
            let _ = c.write_all(&req);
            sent += 1;
        }
        for (k, slot) in conns.iter_mut().enumerate() {
            let answered = match slot.as_mut() {
                Some(c) => read_answer(c).ok(),
                None => None,
            };
            match answered {
                Some(a) => {
                    counts.answered.fetch_add(1, Ordering::Relaxed);
                    if a.status == 401 {
                        counts.unauthorized.fetch_add(1, Ordering::Relaxed);
                    }
                    if a.close {
                        *slot = open(k);
                    }
                }
                None => {
                    counts.failed.fetch_add(1, Ordering::Relaxed);
                    *slot = open(k);
                }
            }
        }
        if let Some(rate) = per_thread_s {
            // The rate is the flood's own shape: each thread sends its
            // share on schedule.
            let due = Duration::from_secs_f64(sent as f64 / rate);
            if let Some(wait) = due.checked_sub(start.elapsed()) {
                std::thread::sleep(wait);
            }
        }
    }
}

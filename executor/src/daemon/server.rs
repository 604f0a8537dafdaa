//! The connection loop: one thread owns every control and local connection
//! as a non-blocking socket in one epoll set, reads their frames
//! ([`FrameReader`]), and hands complete requests to request threads
//! ([`Pool`]); replies and `WorkerExited` reports come back through its
//! inbox ([`LoopMsg`]) and are written as the sockets take them.
//!
//! What one connection may cost the daemon is bounded before anyone is
//! trusted:
//!
//! - **Count.** At most `max_connections` control connections, and
//!   `max_connections_per_address` from one address. A new connection over
//!   either cap takes the place of the oldest one that has not yet sent a
//!   request with a valid token (closed at once); with none such, the new
//!   one is closed.
//! - **Time.** A request's header and JSON must arrive within
//!   `request_timeout_ms` (the first from the connection's accept); a
//!   checked request's library within `library_timeout_ms` (a refused one
//!   is dropped as it comes, within `request_timeout_ms` on a connection
//!   that never sent a valid token); a connection that never got an
//!   allocation is closed after `idle_timeout_ms` without a request.
//! - **Memory.** An allocation request's token, and the request against
//!   its lease and the executor's limits, are checked before its library
//!   is read: a refused request's library is dropped as it arrives. The
//!   libraries of checked requests share `library_memory_mib`; a request
//!   beyond it waits for room. JSON beyond [`FREE_JSON`](super::conn::FREE_JSON) per connection
//!   comes from a shared allowance ([`JSON_ALLOWANCE`]).
//! - **Writes.** A connection's unwritten replies are bounded
//!   ([`MAX_OUTGOING`]); a client that does not read is closed.
//!
//! With `control_tls_cert`, control connections may speak TLS: the first
//! byte a client sends says whether it starts a handshake (then rustls
//! runs inside this loop, non-blocking, and the frames are its plaintext)
//! or not (served in plain only when `require_control_tls = false`;
//! otherwise answered with a refusal in plain that says why, and closed).
//! The handshake counts against the first request's `request_timeout_ms`;
//! bytes rustls has decrypted but the reader has not taken are not seen by
//! epoll, so such connections are read again at the next turn. Only the
//! control connection changes: workers and invocations never see TLS.
//!
//! Closed and refused connections are counted and logged at most every
//! [`TALLY_EVERY`], not one line each (and those closed before their TLS
//! was up in `rfaas_executord_control_tls_refused_total`).

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::io;
use std::net::{IpAddr, TcpListener};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixListener;
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use rfaas_proto::control::{ErrorCode, FrameLimits, Kind};

use super::conn::{Conn, Peer, Phase, Step, Stream, TLS_HANDSHAKE_BYTE};
use super::control::{self, Next};
use super::epoll::{self, Epoll, Waker};
use super::local::{self, LocalNext};
use super::outbox::LoopMsg;
use super::pool::{Job, Pool};
use super::refusal::refusal;
use super::shared::Shared;

/// JSON bytes beyond [`FREE_JSON`](super::conn::FREE_JSON) all connections together may hold
/// before their messages are checked.
pub(crate) const JSON_ALLOWANCE: usize = 32 << 20;

/// Unwritten bytes a connection may have queued before it is closed.
pub(crate) const MAX_OUTGOING: usize = 4 << 20;

/// How often closed and refused connections are summed up in the log.
pub(crate) const TALLY_EVERY: Duration = Duration::from_secs(10);

/// Local (node tool) connections at once.
pub(crate) const MAX_LOCAL_CONNECTIONS: usize = 16;

/// How long a connection that is being closed may take to read its
/// answer, and to stop sending.
const LINGER: Duration = Duration::from_secs(2);

/// How long a stopping daemon waits for requests in flight, answers not
/// yet written and libraries still arriving.
const STOP_GRACE: Duration = Duration::from_secs(5);

/// Threads for deallocations, connection ends and node-tool requests, so
/// none waits behind an allocation.
const RELEASE_THREADS: usize = 2;

/// Connections accepted per listener per turn.
const ACCEPTS_PER_TURN: usize = 64;

const WAKER: u64 = u64::MAX;
const CONTROL: u64 = u64::MAX - 1;
const LOCAL: u64 = u64::MAX - 2;

/// The loop's limits, from the settings.
#[derive(Debug, Clone, Copy)]
struct Limits {
    max_connections: usize,
    per_address: usize,
    request_timeout: Duration,
    library_timeout: Duration,
    idle_timeout: Duration,
}

/// Connections per address, and which of them are not yet trusted
/// (oldest first: ids only grow).
#[derive(Debug, Default)]
struct Address {
    count: usize,
    untrusted: BTreeSet<u64>,
}

/// Counts of what happened to connections since the last log line.
#[derive(Debug)]
struct Tally {
    since: Instant,
    counts: BTreeMap<&'static str, u64>,
}

impl Tally {
    fn note(&mut self, what: &'static str) {
        *self.counts.entry(what).or_default() += 1;
    }

    fn flush(&mut self, now: Instant) {
        if now.duration_since(self.since) < TALLY_EVERY {
            return;
        }
        if !self.counts.is_empty() {
            let what: Vec<String> = self
                .counts
                .iter()
                .map(|(k, n)| format!("{n} {k}"))
                .collect();
            tracing::warn!(
                "in the last {} s: {}",
                now.duration_since(self.since).as_secs(),
                what.join(", ")
            );
            self.counts.clear();
        }
        self.since = now;
    }
}

/// A listener, paused for a while after running out of descriptors.
#[derive(Debug)]
struct Listening<L> {
    listener: L,
    token: u64,
    resume_at: Option<Instant>,
    backoff: Duration,
}

/// The first pause after a failed accept; it doubles up to a second.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(10);

impl<L: AsRawFd> Listening<L> {
    fn new(listener: L, token: u64) -> Self {
        Listening {
            listener,
            token,
            resume_at: None,
            backoff: ACCEPT_BACKOFF,
        }
    }

    fn accepted(&mut self) {
        self.backoff = ACCEPT_BACKOFF;
    }

    /// Stops watching the listener for the current backoff, and doubles it.
    fn pause(&mut self, epoll: &Epoll) {
        let _ = epoll.modify(self.listener.as_raw_fd(), 0, self.token);
        self.resume_at = Some(Instant::now() + self.backoff);
        self.backoff = (self.backoff * 2).min(Duration::from_secs(1));
    }

    fn resume_if_due(&mut self, epoll: &Epoll, now: Instant) {
        if self.resume_at.is_some_and(|t| t <= now) {
            self.resume_at = None;
            let _ = epoll.modify(self.listener.as_raw_fd(), epoll::IN, self.token);
        }
    }
}

/// What a failed accept means for this turn.
#[derive(Debug, PartialEq, Eq)]
enum AcceptError {
    /// Nothing more to accept now.
    Done,
    /// That one connection failed; go on.
    Skip,
    /// Out of descriptors or memory: pause the listener.
    Starved,
    /// Something else: log it and pause.
    Other,
}

fn classify(e: &io::Error) -> AcceptError {
    match e.kind() {
        io::ErrorKind::WouldBlock => AcceptError::Done,
        io::ErrorKind::Interrupted | io::ErrorKind::ConnectionAborted => AcceptError::Skip,
        _ if matches!(
            e.raw_os_error(),
            Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)
        ) =>
        {
            AcceptError::Starved
        }
        _ => AcceptError::Other,
    }
}

/// TLS on the control port: the certificate (reloaded on SIGHUP) and
/// whether clients that do not start TLS are refused.
#[derive(Debug, Clone)]
pub(crate) struct ControlTls {
    pub cert: rfaas_tls::ServerCert,
    pub required: bool,
}

/// The loop.
#[derive(Debug)]
pub(crate) struct Server {
    shared: Arc<Shared>,
    epoll: Epoll,
    waker: Arc<Waker>,
    inbox: mpsc::Receiver<LoopMsg>,
    control: Listening<TcpListener>,
    local: Listening<UnixListener>,
    limits: Limits,
    client_limits: FrameLimits,
    conns: HashMap<u64, Conn>,
    timers: BTreeSet<(Instant, u64)>,
    addresses: HashMap<IpAddr, Address>,
    untrusted: BTreeSet<u64>,
    control_count: usize,
    local_count: usize,
    /// Library bytes checked requests may still take.
    library_room: u64,
    /// Connections waiting for library room, in order.
    library_queue: VecDeque<u64>,
    json_room: usize,
    scratch: Vec<u8>,
    allocations: Pool,
    release: Pool,
    tally: Tally,
    /// Set once the daemon stops: the loop ends by then at the latest.
    stopping: Option<Instant>,
    /// TLS on the control port, when configured.
    tls: Option<ControlTls>,
    /// Connections with decrypted bytes waiting in rustls, which epoll
    /// does not report: read at the next turn.
    ready: BTreeSet<u64>,
}

impl Server {
    /// Sets the loop up on both listeners; `inbox` receives what the
    /// shared [`Outbox`](super::outbox::Outbox) posts, `waker` is its wake.
    pub(crate) fn new(
        shared: Arc<Shared>,
        control: TcpListener,
        local: UnixListener,
        inbox: mpsc::Receiver<LoopMsg>,
        waker: Arc<Waker>,
        tls: Option<ControlTls>,
    ) -> io::Result<Server> {
        let s = &shared.settings;
        control.set_nonblocking(true)?;
        local.set_nonblocking(true)?;
        let epoll = Epoll::new()?;
        epoll.add(waker.raw_fd(), epoll::IN, WAKER)?;
        epoll.add(control.as_raw_fd(), epoll::IN, CONTROL)?;
        epoll.add(local.as_raw_fd(), epoll::IN, LOCAL)?;
        let limits = Limits {
            max_connections: s.max_connections as usize,
            per_address: s.max_connections_per_address as usize,
            request_timeout: Duration::from_millis(s.request_timeout_ms),
            library_timeout: Duration::from_millis(s.library_timeout_ms),
            idle_timeout: Duration::from_millis(s.idle_timeout_ms),
        };
        let allocations = Pool::new("allocate", s.request_threads as usize)?;
        let release = Pool::new("release", RELEASE_THREADS)?;
        let library_room = u64::from(s.library_memory_mib) << 20;
        let client_limits = shared.client_limits();
        Ok(Server {
            epoll,
            waker,
            inbox,
            control: Listening::new(control, CONTROL),
            local: Listening::new(local, LOCAL),
            limits,
            client_limits,
            conns: HashMap::new(),
            timers: BTreeSet::new(),
            addresses: HashMap::new(),
            untrusted: BTreeSet::new(),
            control_count: 0,
            local_count: 0,
            library_room,
            library_queue: VecDeque::new(),
            json_room: JSON_ALLOWANCE,
            scratch: vec![0; 64 << 10],
            allocations,
            release,
            tally: Tally {
                since: Instant::now(),
                counts: BTreeMap::new(),
            },
            stopping: None,
            tls,
            ready: BTreeSet::new(),
            shared,
        })
    }

    /// Serves until told to stop and done stopping.
    pub(crate) fn run(mut self) -> io::Result<()> {
        let mut events = vec![libc::epoll_event { events: 0, u64: 0 }; 256];
        loop {
            let now = Instant::now();
            let timeout = if self.ready.is_empty() {
                self.next_wake().map(|t| t.saturating_duration_since(now))
            } else {
                Some(Duration::ZERO)
            };
            let n = self.epoll.wait(&mut events, timeout)?;
            for ev in &events[..n] {
                let (token, bits) = (ev.u64, ev.events);
                match token {
                    WAKER => self.waker.reset(),
                    CONTROL => self.accept_control(),
                    LOCAL => self.accept_local(),
                    id => self.on_event(id, bits),
                }
            }
            for id in std::mem::take(&mut self.ready) {
                self.on_event(id, epoll::IN);
            }
            self.read_inbox();
            let now = Instant::now();
            self.expire(now);
            self.resume_listeners(now);
            self.tally.flush(now);
            if let Some(until) = self.stopping {
                if now >= until || self.stopped() {
                    break;
                }
            }
        }
        let left = self.conns.values().filter(|c| c.busy).count();
        if left > 0 {
            tracing::warn!(requests = left, "stopping with requests still unanswered");
        }
        Ok(())
    }

    /// The earliest deadline or listener resume.
    fn next_wake(&self) -> Option<Instant> {
        [
            self.timers.first().map(|(t, _)| *t),
            self.control.resume_at,
            self.local.resume_at,
            self.stopping,
            // The tally's next line, when there is something to say.
            (!self.tally.counts.is_empty()).then(|| self.tally.since + TALLY_EVERY),
        ]
        .into_iter()
        .flatten()
        .min()
    }

    /// Whether a stopping loop has nothing left to finish: no request in
    /// flight, nothing unwritten, no library of a trusted client still
    /// arriving (dropped as it comes, so the client reads its refusal
    /// rather than a reset).
    fn stopped(&self) -> bool {
        self.conns.values().all(|c| {
            !c.busy && c.out.pending() == 0 && (c.gone || !c.trusted || c.phase != Phase::Blob)
        })
    }

    fn accept_control(&mut self) {
        for _ in 0..ACCEPTS_PER_TURN {
            match self.control.listener.accept() {
                Ok((stream, addr)) => {
                    self.control.accepted();
                    self.admit_control(stream, addr.ip().to_canonical());
                }
                Err(e) => {
                    if self.accept_failed(CONTROL, &e) {
                        return;
                    }
                }
            }
        }
    }

    fn accept_local(&mut self) {
        for _ in 0..ACCEPTS_PER_TURN {
            match self.local.listener.accept() {
                Ok((stream, _)) => {
                    self.local.accepted();
                    if self.local_count >= MAX_LOCAL_CONNECTIONS {
                        self.tally
                            .note("local connections refused (over the limit of 16)");
                        continue;
                    }
                    if stream.set_nonblocking(true).is_err() {
                        continue;
                    }
                    if self
                        .register(Peer::Local, Stream::Unix(stream), local::LIMITS)
                        .is_some()
                    {
                        self.local_count += 1;
                    }
                }
                Err(e) => {
                    if self.accept_failed(LOCAL, &e) {
                        return;
                    }
                }
            }
        }
    }

    /// Handles a failed accept on listener `token`; true when this turn's
    /// accepting is over. Out of descriptors or memory (or anything else
    /// unexpected) the listener is paused with an exponential backoff
    /// rather than retried at once.
    fn accept_failed(&mut self, token: u64, e: &io::Error) -> bool {
        let why = classify(e);
        match why {
            AcceptError::Done => return true,
            AcceptError::Skip => return false,
            AcceptError::Starved => self
                .tally
                .note("accept pauses for lack of descriptors or memory"),
            AcceptError::Other => {
                tracing::warn!(error = %e, "cannot accept a connection; pausing the listener");
            }
        }
        if token == CONTROL {
            self.control.pause(&self.epoll);
        } else {
            self.local.pause(&self.epoll);
        }
        true
    }

    fn resume_listeners(&mut self, now: Instant) {
        self.control.resume_if_due(&self.epoll, now);
        self.local.resume_if_due(&self.epoll, now);
    }

    /// Takes a new control connection from `ip`, within the caps.
    fn admit_control(&mut self, stream: std::net::TcpStream, ip: IpAddr) {
        let over_address = self
            .addresses
            .get(&ip)
            .is_some_and(|a| a.count >= self.limits.per_address);
        if over_address {
            let victim = self.oldest_idle(&self.addresses[&ip].untrusted);
            if !self.make_room(
                victim,
                "untrusted connections closed for a newer one from the same address",
                "control connections refused (over max_connections_per_address)",
            ) {
                return;
            }
        }
        if self.control_count >= self.limits.max_connections {
            let victim = self.oldest_idle(&self.untrusted);
            if !self.make_room(
                victim,
                "untrusted connections closed for a newer one (at max_connections)",
                "control connections refused (over max_connections)",
            ) {
                return;
            }
        }
        if stream.set_nonblocking(true).is_err() {
            return;
        }
        let _ = stream.set_nodelay(true);
        let Some(id) = self.register(
            Peer::Control(ip),
            Stream::Tcp(stream, None),
            self.client_limits,
        ) else {
            return;
        };
        if self.tls.is_some() {
            if let Some(conn) = self.conns.get_mut(&id) {
                conn.sniff = true;
            }
        }
        self.control_count += 1;
        let a = self.addresses.entry(ip).or_default();
        a.count += 1;
        a.untrusted.insert(id);
        self.untrusted.insert(id);
        tracing::trace!(conn = id, %ip, "control connection");
    }

    /// Watches a new connection; `None` (the connection dropped) when epoll
    /// cannot take it.
    /// The oldest of `untrusted` (ids only grow) with no request in flight.
    fn oldest_idle(&self, untrusted: &BTreeSet<u64>) -> Option<u64> {
        untrusted
            .iter()
            .copied()
            .find(|id| self.conns.get(id).is_some_and(|c| !c.busy))
    }

    /// Closes `victim` for a newer connection; false (the newer one is to
    /// be refused) without one. Counts either in the tally.
    fn make_room(
        &mut self,
        victim: Option<u64>,
        evicted: &'static str,
        refused: &'static str,
    ) -> bool {
        match victim {
            Some(id) => {
                self.tally.note(evicted);
                self.close(id);
                true
            }
            None => {
                self.tally.note(refused);
                false
            }
        }
    }

    fn register(&mut self, peer: Peer, stream: Stream, limits: FrameLimits) -> Option<u64> {
        let id = self.shared.next_id();
        if let Err(e) = self.epoll.add(stream.raw_fd(), epoll::IN, id) {
            tracing::warn!(error = %e, "cannot watch a new connection; closing it");
            return None;
        }
        let mut conn = Conn::new(id, peer, stream, limits);
        conn.interest = epoll::IN;
        self.conns.insert(id, conn);
        self.update(id);
        Some(id)
    }

    fn on_event(&mut self, id: u64, bits: u32) {
        let Some(conn) = self.conns.get_mut(&id) else {
            return;
        };
        if conn.gone {
            return;
        }
        if bits & epoll::HUP_OR_ERR != 0 && conn.busy {
            // Level-triggered: stop hearing about it until the request is done.
            self.epoll.delete(conn.stream.raw_fd());
            conn.gone = true;
            return;
        }
        if bits & epoll::OUT != 0 && !self.write(id) {
            return;
        }
        if bits & (epoll::IN | epoll::HUP_OR_ERR) != 0 {
            self.read(id);
        }
        if bits & epoll::HUP_OR_ERR != 0 {
            // Both directions are shut (or reset): nothing more can be
            // read or written.
            self.close(id);
            return;
        }
        self.update(id);
    }

    /// Writes what the socket takes; false when the connection was closed.
    fn write(&mut self, id: u64) -> bool {
        let Some(conn) = self.conns.get_mut(&id) else {
            return false;
        };
        let flushed = conn
            .stream
            .send_pending()
            .and_then(|()| conn.out.flush(&mut conn.stream));
        match flushed {
            Ok(done) => {
                if done && conn.closing.is_some() && !conn.write_shut {
                    conn.stream.shutdown_write();
                    conn.write_shut = true;
                }
                true
            }
            Err(_) => {
                self.close(id);
                false
            }
        }
    }

    /// Reads and acts on what connection `id` sent, until it would block,
    /// waits for the daemon, or is closed.
    fn read(&mut self, id: u64) {
        loop {
            let Some(conn) = self.conns.get_mut(&id) else {
                return;
            };
            if conn.busy || conn.gone || conn.eof {
                return;
            }
            if conn.sniff && !self.sniff(id) {
                return;
            }
            let Some(conn) = self.conns.get_mut(&id) else {
                return;
            };
            let step = conn
                .reader
                .step(&mut conn.stream, &mut self.scratch, &mut self.json_room);
            match step {
                Step::Wait => return,
                Step::Message {
                    kind,
                    json,
                    blob_len,
                    charged,
                } => {
                    self.json_room += charged;
                    conn.framed = true;
                    if conn.closing.is_some() {
                        conn.reader.skip_blob();
                        continue;
                    }
                    self.on_message(id, kind, json, blob_len);
                }
                Step::Blob(library) => self.on_library(id, library),
                Step::NoRoom => {
                    self.tally
                        .note("requests refused for lack of room for their JSON");
                    let reply = refusal(
                        0,
                        ErrorCode::NoCapacity,
                        "the executor holds too many large requests not yet checked; \
                         retry, or send fewer function names; closing the connection"
                            .into(),
                    );
                    self.queue(id, &reply.to_bytes());
                    self.start_closing(id);
                }
                Step::Eof { mid_frame } => {
                    if mid_frame && conn.closing.is_none() {
                        self.tally
                            .note("connections closed mid-request by the peer");
                    }
                    conn.eof = true;
                    if conn.out.pending() == 0 {
                        self.close(id);
                    } else {
                        self.start_closing(id);
                    }
                    return;
                }
                Step::Broken(e) => {
                    let code = match e {
                        rfaas_proto::control::ControlError::TooLarge { what: "blob", .. } => {
                            ErrorCode::TooLarge
                        }
                        _ => ErrorCode::MalformedRequest,
                    };
                    self.tally.note("connections refused for a broken frame");
                    let reply = refusal(0, code, format!("{e}; closing the connection"));
                    self.queue(id, &reply.to_bytes());
                    self.start_closing(id);
                }
                Step::Failed(e) => {
                    if conn.stream.handshaking() {
                        self.tally
                            .note("control connections closed for a failed TLS handshake");
                        self.shared.metrics.control_tls_refused("handshake_failed");
                        tracing::debug!(conn = id, error = %e, "a TLS handshake failed");
                    }
                    tracing::trace!(conn = id, error = %e, "reading a connection failed");
                    self.close(id);
                    return;
                }
            }
        }
    }

    /// Looks at the first byte of a control connection to a port with TLS:
    /// a TLS handshake starts TLS; anything else is a plain client, served
    /// unless TLS is required, and refused (in plain, so it can read why)
    /// when it is. True when reading goes on.
    fn sniff(&mut self, id: u64) -> bool {
        let Some((config, required)) = self.tls.as_ref().map(|t| (t.cert.config(), t.required))
        else {
            return true;
        };
        let Some(conn) = self.conns.get_mut(&id) else {
            return false;
        };
        let first = match conn.stream.peek_first() {
            Ok(Some(b)) => b,
            Ok(None) => {
                // Closed before a byte: nothing to answer.
                self.close(id);
                return false;
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return false,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => return false,
            Err(e) => {
                tracing::trace!(conn = id, error = %e, "reading a connection failed");
                self.close(id);
                return false;
            }
        };
        conn.sniff = false;
        if first == TLS_HANDSHAKE_BYTE {
            if let Err(e) = conn.stream.start_tls(config) {
                tracing::warn!(conn = id, error = %e, "cannot start a TLS session; closing the connection");
                self.close(id);
                return false;
            }
            return true;
        }
        if !required {
            return true;
        }
        self.tally
            .note("plain control connections refused (require_control_tls)");
        self.shared.metrics.control_tls_refused("plain");
        let node = &self.shared.settings.node_name;
        let reply = refusal(
            0,
            ErrorCode::MalformedRequest,
            format!(
                "executor {node} accepts control connections over TLS only \
                 (require_control_tls = true) and this one did not start TLS; \
                 connect with tls://host:port (as the manager's lease grant says, \
                 control_tls = true) and trust the site CA (RFAAS_CA_FILE); closing the connection"
            ),
        );
        self.queue(id, &reply.to_bytes());
        self.start_closing(id);
        self.update(id);
        false
    }

    /// A message's JSON is in: check it, answer it, or hand it out.
    fn on_message(&mut self, id: u64, kind: Kind, json: Vec<u8>, blob_len: u32) {
        let Some(conn) = self.conns.get_mut(&id) else {
            return;
        };
        match conn.peer {
            Peer::Control(ip) => {
                let stopping = self.stopping.is_some();
                match control::message(&self.shared, id, kind, json, blob_len, stopping) {
                    Next::Library(pending) => {
                        conn.trusted = true;
                        self.untrusted.remove(&id);
                        if let Some(a) = self.addresses.get_mut(&ip) {
                            a.untrusted.remove(&id);
                        }
                        conn.pending = Some(pending);
                        self.library_queue.push_back(id);
                        self.admit_libraries();
                    }
                    Next::Reply(reply) => {
                        conn.reader.skip_blob();
                        if !conn.trusted {
                            self.tally.note("requests refused before their library");
                        }
                        self.queue(id, &reply.to_bytes());
                    }
                    Next::Job(job) => {
                        conn.reader.skip_blob();
                        conn.busy = true;
                        self.release.run(job.0);
                    }
                }
            }
            Peer::Local => {
                conn.reader.skip_blob();
                match local::message(&self.shared, id, kind, json) {
                    LocalNext::Reply(reply) => {
                        self.queue(id, &reply.to_bytes());
                    }
                    LocalNext::Job(job) => {
                        conn.busy = true;
                        self.release.run(job);
                    }
                    LocalNext::Long(job) => {
                        conn.busy = true;
                        spawn_long(job, &self.release);
                    }
                }
            }
        }
    }

    /// Lets waiting requests read their libraries, in order, while they fit
    /// in the budget.
    fn admit_libraries(&mut self) {
        while let Some(&id) = self.library_queue.front() {
            let Some(conn) = self.conns.get_mut(&id) else {
                self.library_queue.pop_front();
                continue;
            };
            let Some(len) = conn.pending.as_ref().map(|p| u64::from(p.library_len())) else {
                self.library_queue.pop_front();
                continue;
            };
            if len > self.library_room {
                return;
            }
            self.library_queue.pop_front();
            self.library_room -= len;
            conn.held = len;
            conn.reader.take_blob();
            // Its bytes may be waiting already: level-triggered epoll says
            // so once it is watched again.
            self.update(id);
        }
    }

    /// A checked request's library is in: start the allocation.
    fn on_library(&mut self, id: u64, library: Vec<u8>) {
        let Some(conn) = self.conns.get_mut(&id) else {
            return;
        };
        let Some(pending) = conn.pending.take() else {
            return;
        };
        let held = std::mem::take(&mut conn.held);
        conn.busy = true;
        self.allocations
            .run(control::allocate(&self.shared, id, pending, library, held));
    }

    fn read_inbox(&mut self) {
        while let Ok(msg) = self.inbox.try_recv() {
            match msg {
                LoopMsg::Send { conn, bytes } => {
                    if self.queue(conn, &bytes) {
                        self.update(conn);
                    }
                }
                LoopMsg::Done {
                    conn,
                    granted,
                    release,
                } => self.done(conn, granted, release),
                LoopMsg::Stop => self.stop(),
            }
        }
    }

    /// Queues `bytes` for connection `id` and writes what the socket takes
    /// now; false when the connection is gone or was closed.
    fn queue(&mut self, id: u64, bytes: &[u8]) -> bool {
        let Some(conn) = self.conns.get_mut(&id) else {
            return false;
        };
        if conn.gone {
            return false;
        }
        conn.out.push(bytes);
        if conn.out.pending() > MAX_OUTGOING {
            self.tally
                .note("connections closed for not reading their replies");
            self.close(id);
            return false;
        }
        self.write(id)
    }

    fn done(&mut self, id: u64, granted: bool, release: u64) {
        self.library_room += release;
        if release > 0 {
            self.admit_libraries();
        }
        let Some(conn) = self.conns.get_mut(&id) else {
            return;
        };
        conn.busy = false;
        conn.granted |= granted;
        if conn.phase == Phase::Between {
            conn.phase_since = Instant::now();
        }
        if conn.gone {
            self.close(id);
            return;
        }
        self.read(id);
        self.update(id);
    }

    /// The daemon stops: refuse what waits for its library, and end once
    /// everything in flight is answered and written.
    fn stop(&mut self) {
        self.stopping = Some(Instant::now() + STOP_GRACE);
        let node = self.shared.settings.node_name.clone();
        let waiting: Vec<u64> = self
            .conns
            .values()
            .filter(|c| c.pending.is_some())
            .map(|c| c.id)
            .collect();
        for id in waiting {
            let Some(conn) = self.conns.get_mut(&id) else {
                continue;
            };
            let Some(pending) = conn.pending.take() else {
                continue;
            };
            // Its library is dropped as the client finishes sending it, so
            // the client reads the refusal instead of a reset.
            conn.reader.skip_rest();
            self.library_room += std::mem::take(&mut conn.held);
            let reply = refusal(
                pending.request_id(),
                ErrorCode::Draining,
                format!("executor {node} is shutting down; allocate elsewhere"),
            );
            self.queue(id, &reply.to_bytes());
            self.update(id);
        }
        self.library_queue.clear();
    }

    /// No more requests on `id`: write what is queued, drop what comes, and
    /// close by [`LINGER`] at the latest.
    fn start_closing(&mut self, id: u64) {
        let Some(conn) = self.conns.get_mut(&id) else {
            return;
        };
        if conn.closing.is_none() {
            conn.closing = Some(Instant::now() + LINGER);
            // JSON it held of the shared allowance (a refused one's).
            self.json_room += conn.reader.charged();
            conn.reader.drain();
            if let Some(_pending) = conn.pending.take() {
                self.library_room += std::mem::take(&mut conn.held);
            }
        }
        self.write(id);
    }

    /// Closes connection `id`, or, while a request of it is in flight,
    /// marks it to be closed when it is answered.
    fn close(&mut self, id: u64) {
        let Some(conn) = self.conns.get_mut(&id) else {
            return;
        };
        if conn.busy {
            if !conn.gone {
                self.epoll.delete(conn.stream.raw_fd());
                conn.gone = true;
            }
            return;
        }
        let conn = self.conns.remove(&id).expect("looked up above");
        self.ready.remove(&id);
        if let Some(t) = conn.deadline {
            self.timers.remove(&(t, id));
        }
        self.json_room += conn.reader.charged();
        self.library_room += conn.held;
        if conn.held > 0 {
            self.admit_libraries();
        }
        match conn.peer {
            Peer::Control(ip) => {
                self.control_count -= 1;
                self.untrusted.remove(&id);
                if let Some(a) = self.addresses.get_mut(&ip) {
                    a.count -= 1;
                    a.untrusted.remove(&id);
                    if a.count == 0 {
                        self.addresses.remove(&ip);
                    }
                }
                if conn.granted {
                    self.release.run(control::end(&self.shared, id, ip));
                }
            }
            Peer::Local => self.local_count -= 1,
        }
        tracing::trace!(conn = id, "connection closed");
        // Dropping `conn` closes the socket (and leaves the epoll set).
    }

    /// Closes the connections whose deadline passed.
    fn expire(&mut self, now: Instant) {
        while let Some(&(t, id)) = self.timers.first() {
            if t > now {
                return;
            }
            self.timers.remove(&(t, id));
            let Some(conn) = self.conns.get_mut(&id) else {
                continue;
            };
            conn.deadline = None;
            let handshake = conn.closing.is_none() && conn.stream.handshaking();
            if handshake {
                self.shared.metrics.control_tls_refused("handshake_timeout");
            }
            let what = match (conn.closing, conn.phase) {
                (Some(_), _) => None,
                (None, _) if handshake => Some(
                    "control connections closed for a TLS handshake not done within request_timeout_ms",
                ),
                (None, Phase::Between) if !conn.framed => {
                    Some("connections closed without a request within request_timeout_ms")
                }
                (None, Phase::Between) => Some("idle connections closed after idle_timeout_ms"),
                (None, Phase::Head) => {
                    Some("connections closed for a request slower than request_timeout_ms")
                }
                (None, Phase::Blob) if conn.trusted => {
                    Some("connections closed for a library slower than library_timeout_ms")
                }
                (None, Phase::Blob) => {
                    Some("connections closed for a refused library slower than request_timeout_ms")
                }
                (None, Phase::Drain) => None,
            };
            if let Some(what) = what {
                self.tally.note(what);
            }
            self.close(id);
        }
    }

    /// Brings connection `id`'s epoll interest and deadline up to date.
    fn update(&mut self, id: u64) {
        let Some(conn) = self.conns.get_mut(&id) else {
            return;
        };
        if conn.gone {
            if let Some(t) = conn.deadline.take() {
                self.timers.remove(&(t, id));
            }
            return;
        }
        let now = Instant::now();
        let phase = conn.reader.phase();
        if phase != conn.phase {
            // The first frame's time counts from the accept.
            let first = conn.phase == Phase::Between && phase == Phase::Head && !conn.framed;
            if !first {
                conn.phase_since = now;
            }
            conn.phase = phase;
        }
        let reading = !conn.busy && !conn.eof && !conn.reader.at_blob();
        let mut want = 0;
        if reading {
            want |= epoll::IN;
        }
        if conn.out.pending() > 0 || conn.stream.wants_write() {
            want |= epoll::OUT;
        }
        if reading && conn.stream.buffered() {
            self.ready.insert(id);
        }
        if want != conn.interest {
            if let Err(e) = self.epoll.modify(conn.stream.raw_fd(), want, id) {
                tracing::debug!(conn = id, error = %e, "cannot change what a connection is watched for");
            }
            conn.interest = want;
        }
        let l = &self.limits;
        let deadline = if let Some(t) = conn.closing {
            Some(t)
        } else if conn.busy {
            None
        } else {
            match conn.phase {
                Phase::Between if !conn.framed => Some(conn.phase_since + l.request_timeout),
                Phase::Between if conn.granted => None,
                Phase::Between => Some(conn.phase_since + l.idle_timeout),
                Phase::Head => Some(conn.phase_since + l.request_timeout),
                // A refused request's library is only dropped: a peer
                // without a valid token gets no longer than for its JSON.
                Phase::Blob if conn.trusted => Some(conn.phase_since + l.library_timeout),
                Phase::Blob => Some(conn.phase_since + l.request_timeout),
                Phase::Drain => Some(now + LINGER),
            }
        };
        if deadline != conn.deadline {
            if let Some(t) = conn.deadline {
                self.timers.remove(&(t, id));
            }
            if let Some(t) = deadline {
                self.timers.insert((t, id));
            }
            conn.deadline = deadline;
        }
    }
}

/// Runs a long request (a drain) on a thread of its own; when no thread can
/// be started, on `fallback` rather than never answering.
fn spawn_long(job: Job, fallback: &Pool) {
    let slot = Arc::new(std::sync::Mutex::new(Some(job)));
    let theirs = Arc::clone(&slot);
    let take =
        |s: &std::sync::Mutex<Option<Job>>| s.lock().unwrap_or_else(|e| e.into_inner()).take();
    let spawned = std::thread::Builder::new()
        .name("local-long".into())
        .spawn(move || {
            if let Some(j) = take(&theirs) {
                j();
            }
        });
    if let Err(e) = spawned {
        tracing::error!(error = %e, "cannot start a thread for a drain; queueing it with the other requests");
        if let Some(j) = take(&slot) {
            fallback.run(j);
        }
    }
}

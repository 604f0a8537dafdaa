//! The control connection to one executor: requests matched to replies by
//! `request_id`, and the fate of every allocation made on it.
//!
//! One reader thread per connection reads every frame. Replies go to the
//! waiting request through a channel; `WorkerExited` goes to the
//! allocation's [`Fate`]. When the connection ends (EOF or an error), the
//! reader connects again for its grace (`ClientOptions::reattach_grace`) and sends `Attach` for every
//! allocation the executor gave an attach secret (a restarted executor
//! adopted their workers; calls go on over the fabric meanwhile); the
//! allocations it cannot take up, or all of them when the executor does
//! not come back, are marked executor-lost, and every waiter is woken.
//!
//! An executor address `tls://host:port` (what a lease grant with
//! `control_tls` becomes) is reached over TLS: the executor's certificate
//! must chain to the CA in `RFAAS_CA_FILE` (or the system's roots, the same
//! trust as for the managers) and name `host`. One rustls session serves
//! both directions: writers encrypt under the writer lock, as they write
//! under it in plain; the reader thread reads the socket without the lock
//! and takes it only to decrypt what came.

use std::collections::HashMap;
use std::io::{self, BufReader, Read, Write};
use std::net::{Shutdown, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError, SyncSender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use rfaas_proto::control::client::{
    AllocateOk, Attach, Attached, Deallocate, Deallocated, LeaseRenewed, WorkerExited,
};
use rfaas_proto::control::{ErrorReply, Frame, FrameLimits, Kind};
use rfaas_proto::InvocationStatus;

use crate::error::{Error, Result};

/// Locks `m`, ignoring poisoning: every state behind these mutexes stays
/// consistent between statements.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// What happened to an allocation's worker, as the control connection
/// tells it.
#[derive(Debug, Clone)]
pub(crate) enum FateState {
    /// Running, as far as the executor said.
    Running,
    /// A lane's worker answered that a function crashed: the worker is
    /// ending, and the executor's report is still to come.
    Crashed {
        /// The signal, when the answer carried it.
        signal: Option<i32>,
    },
    /// A lane's worker answered a status after which it serves nothing
    /// more ([`InvocationStatus::ends_worker`]: the deadline, the lease's
    /// end, a drain). It may still finish calls under way on other lanes
    /// (a drain lets them run for its grace period).
    Refusing(InvocationStatus),
    /// The executor reported the worker's end.
    Exited(WorkerExited),
    /// The control connection ended.
    ExecutorLost,
    /// The client deallocated it.
    Deallocated,
}

/// An allocation's fate, shared by the connection's reader thread (which
/// writes it) and the allocation's lanes (which read it when a lane fails).
#[derive(Debug)]
pub(crate) struct Fate {
    executor: String,
    /// Fast checks for the hot path: [`RUNNING`], [`ENDED`] or [`GONE`].
    level: AtomicU8,
    state: Mutex<FateState>,
    cond: Condvar,
}

/// [`Fate::level`]: the worker takes calls.
const RUNNING: u8 = 0;
/// The worker takes no more calls, but may finish those under way.
const ENDED: u8 = 1;
/// The worker is gone (or about to be): nothing more comes from it.
const GONE: u8 = 2;

impl Fate {
    pub(crate) fn new(executor: String) -> Fate {
        Fate {
            executor,
            level: AtomicU8::new(RUNNING),
            state: Mutex::new(FateState::Running),
            cond: Condvar::new(),
        }
    }

    /// Whether the allocation takes no more calls. Hot path: one atomic
    /// load.
    #[inline]
    pub(crate) fn ended(&self) -> bool {
        self.level.load(Ordering::Acquire) != RUNNING
    }

    /// Whether the worker is known to be gone, so a call still waiting on
    /// it will get no answer.
    #[inline]
    pub(crate) fn gone(&self) -> bool {
        self.level.load(Ordering::Acquire) == GONE
    }

    /// Records the end, unless an earlier one is recorded (the first cause
    /// is the one every call hears); news that the worker is gone is
    /// recorded either way.
    pub(crate) fn set(&self, state: FateState) {
        let mut st = lock(&self.state);
        // The executor's report of a crash says more than the worker's.
        let replaces = matches!(
            (&*st, &state),
            (FateState::Running, _) | (FateState::Crashed { .. }, FateState::Exited(_))
        );
        let level = match state {
            FateState::Running => RUNNING,
            FateState::Refusing(_) => ENDED,
            _ => GONE,
        };
        if replaces {
            *st = state;
        }
        self.level.fetch_max(level, Ordering::AcqRel);
        drop(st);
        self.cond.notify_all();
    }

    /// Whether the executor needs no word of the allocation's end: it
    /// reported the worker's exit itself, the connection is gone, or the
    /// client deallocated already. A worker that only answered a crash in
    /// band, or refuses calls, is still the executor's until told or
    /// reaped.
    pub(crate) fn settled(&self) -> bool {
        matches!(
            *lock(&self.state),
            FateState::Exited(_) | FateState::ExecutorLost | FateState::Deallocated
        )
    }

    /// The error for an invocation whose lane failed: waits up to `grace`
    /// for the executor to say why.
    pub(crate) fn error(&self, grace: Duration) -> Error {
        let until = Instant::now() + grace;
        let mut st = lock(&self.state);
        while matches!(*st, FateState::Running) {
            let now = Instant::now();
            if now >= until {
                break;
            }
            st = self
                .cond
                .wait_timeout(st, until - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        match &*st {
            FateState::Crashed { signal } => Error::crashed_in_band(*signal),
            FateState::Refusing(status) => Error::FunctionFailed(*status),
            FateState::Exited(exit) => Error::from_exit(exit, &self.executor),
            FateState::ExecutorLost => Error::ExecutorLost {
                executor: self.executor.clone(),
            },
            FateState::Running | FateState::Deallocated => Error::WorkerLost,
        }
    }
}

/// A reply to a request.
#[derive(Debug)]
pub(crate) enum Reply {
    Allocated(Box<AllocateOk>, Arc<Fate>),
    Refused(ErrorReply),
    Deallocated,
    /// The allocation's lease now ends at this time (Unix seconds).
    Renewed(u64),
}

#[derive(Debug, Default)]
struct ConnState {
    waiters: HashMap<u64, SyncSender<Reply>>,
    allocations: HashMap<u64, Arc<Fate>>,
    /// Each allocation's attach secret (those the executor gave one).
    secrets: HashMap<u64, String>,
    /// Attach requests sent after a reconnection: request id → allocation.
    attaching: HashMap<u64, u64>,
    lost: Option<String>,
}

/// The longest pause between two tries to reach the executor again.
const REATTACH_BACKOFF_MAX: Duration = Duration::from_secs(1);

/// The writing side of a connection: the socket, and the TLS session when
/// there is one (which the reader thread also takes, to decrypt).
#[derive(Debug)]
struct Wire {
    stream: TcpStream,
    tls: Option<rustls::ClientConnection>,
}

impl Write for Wire {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let Some(tls) = &mut self.tls else {
            return self.stream.write(buf);
        };
        loop {
            let n = tls.writer().write(buf)?;
            while tls.wants_write() {
                tls.write_tls(&mut self.stream)?;
            }
            // Zero: rustls' buffer was full, and is empty now.
            if n > 0 || buf.is_empty() {
                return Ok(n);
            }
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// What the connection's handle and its reader thread share.
#[derive(Debug)]
struct ConnShared {
    executor: String,
    writer: Mutex<Wire>,
    state: Mutex<ConnState>,
    next_request: AtomicU64,
    /// How long a reconnection may take.
    timeout: Duration,
    /// How long to try reconnecting after the connection ended.
    reattach_grace: Duration,
    /// The handle was dropped: the connection's end is the client's doing.
    closed: std::sync::atomic::AtomicBool,
}

/// One control connection. Dropping the last handle closes it, which ends
/// every allocation still open on it at the executor.
#[derive(Debug)]
pub(crate) struct ControlConn {
    shared: Arc<ConnShared>,
}

impl ControlConn {
    /// Connects to `executor` (`host:port`, or `tls://host:port` for TLS)
    /// and starts the reader thread.
    pub(crate) fn connect(
        executor: &str,
        timeout: Duration,
        reattach_grace: Duration,
    ) -> Result<ControlConn> {
        let (wire, reader) = open_wire(executor, timeout)?;
        let tls = wire.tls.is_some();
        let shared = Arc::new(ConnShared {
            executor: executor.to_owned(),
            writer: Mutex::new(wire),
            state: Mutex::new(ConnState::default()),
            next_request: AtomicU64::new(1),
            timeout,
            reattach_grace,
            closed: std::sync::atomic::AtomicBool::new(false),
        });
        let for_reader = Arc::clone(&shared);
        std::thread::Builder::new()
            .name("rfaas-control".into())
            .spawn(move || reader_thread(reader, tls, &for_reader))
            .map_err(|source| Error::Connect {
                executor: executor.to_owned(),
                source,
            })?;
        Ok(ControlConn { shared })
    }

    /// The executor's address.
    pub(crate) fn executor(&self) -> &str {
        &self.shared.executor
    }

    /// Whether the connection has ended.
    pub(crate) fn is_lost(&self) -> bool {
        lock(&self.shared.state).lost.is_some()
    }

    /// A fresh request id.
    pub(crate) fn next_request_id(&self) -> u64 {
        self.shared.next_request.fetch_add(1, Ordering::Relaxed)
    }

    /// Sends `frame` (whose message carries `request_id`) and waits up to
    /// `timeout` for its reply.
    pub(crate) fn request(
        &self,
        frame: &Frame,
        request_id: u64,
        timeout: Duration,
    ) -> Result<Reply> {
        let lost = || Error::ExecutorLost {
            executor: self.shared.executor.clone(),
        };
        let (tx, rx) = mpsc::sync_channel(1);
        {
            let mut st = lock(&self.shared.state);
            if st.lost.is_some() {
                return Err(lost());
            }
            st.waiters.insert(request_id, tx);
        }
        let sent = frame.write_to(&mut *lock(&self.shared.writer));
        if let Err(e) = sent {
            lock(&self.shared.state).waiters.remove(&request_id);
            tracing::debug!(executor = %self.shared.executor, error = %e, "control write failed");
            return Err(lost());
        }
        match rx.recv_timeout(timeout) {
            Ok(reply) => Ok(reply),
            Err(RecvTimeoutError::Timeout) => {
                lock(&self.shared.state).waiters.remove(&request_id);
                Err(Error::Timeout {
                    what: "the executor's reply",
                    after: timeout,
                })
            }
            Err(RecvTimeoutError::Disconnected) => Err(lost()),
        }
    }

    /// Sends a `Deallocate` without waiting for its reply; best effort.
    pub(crate) fn deallocate_nowait(&self, allocation_id: u64) {
        self.forget(allocation_id);
        let msg = Deallocate {
            request_id: self.next_request_id(),
            allocation_id,
        };
        send_deallocate(&self.shared, &msg);
    }

    /// Stops tracking an allocation's fate.
    pub(crate) fn forget(&self, allocation_id: u64) {
        let mut st = lock(&self.shared.state);
        st.allocations.remove(&allocation_id);
        st.secrets.remove(&allocation_id);
    }
}

impl Drop for ControlConn {
    fn drop(&mut self) {
        // Wakes the reader with EOF; it ends and drops the shared state.
        self.shared.closed.store(true, Ordering::Release);
        let _ = lock(&self.shared.writer).stream.shutdown(Shutdown::Both);
    }
}

/// Connects to `executor` (`host:port`, or `tls://host:port`), with TLS
/// when it says so: the writing side and a clone of the socket to read.
fn open_wire(executor: &str, timeout: Duration) -> Result<(Wire, TcpStream)> {
    let connect_err = |source| Error::Connect {
        executor: executor.to_owned(),
        source,
    };
    let (tls, address) = match executor.strip_prefix(rfaas_proto::manager::CONTROL_TLS_SCHEME) {
        Some(rest) => (true, rest),
        None => (false, executor),
    };
    let addrs: Vec<_> = address.to_socket_addrs().map_err(connect_err)?.collect();
    let mut last = None;
    let mut stream = None;
    for addr in addrs {
        match TcpStream::connect_timeout(&addr, timeout) {
            Ok(s) => {
                stream = Some(s);
                break;
            }
            Err(e) => last = Some(e),
        }
    }
    let mut stream = stream.ok_or_else(|| {
        connect_err(last.unwrap_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::NotFound,
                "the address resolves to nothing",
            )
        }))
    })?;
    stream.set_nodelay(true).map_err(connect_err)?;
    let session = if tls {
        Some(handshake(&mut stream, address, timeout).map_err(connect_err)?)
    } else {
        None
    };
    let reader = stream.try_clone().map_err(connect_err)?;
    Ok((
        Wire {
            stream,
            tls: session,
        },
        reader,
    ))
}

fn send_deallocate(shared: &ConnShared, msg: &Deallocate) {
    let frame = Frame::new(msg, Vec::new());
    if let Err(e) = frame.write_to(&mut *lock(&shared.writer)) {
        tracing::debug!(executor = %shared.executor, error = %e, "cannot send Deallocate");
    }
}

/// Starts TLS on `stream` to `address` (`host:port`) and finishes the
/// handshake within `timeout`: the certificate must chain to the CA
/// `RFAAS_CA_FILE` names (or the system's roots) and name `host`.
fn handshake(
    stream: &mut TcpStream,
    address: &str,
    timeout: Duration,
) -> io::Result<rustls::ClientConnection> {
    let ca_file = rfaas_tls::env_ca_file();
    let config = rfaas_tls::client_config(ca_file.as_deref())
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e.to_string()))?;
    let host = rfaas_tls::client::host_of(address);
    let name = rustls::pki_types::ServerName::try_from(host.to_owned()).map_err(|e| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{host:?} is neither a host name nor an IP address for TLS: {e}"),
        )
    })?;
    let mut tls = rustls::ClientConnection::new(config, name)
        .map_err(|e| io::Error::other(format!("cannot start TLS: {e}")))?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    while tls.is_handshaking() {
        if let Err(e) = tls.complete_io(stream) {
            let trust = match &ca_file {
                Some(f) => format!("the CA in {} ({})", f.display(), rfaas_tls::CA_FILE_ENV),
                None => format!(
                    "the system's roots ({} names no site CA file)",
                    rfaas_tls::CA_FILE_ENV
                ),
            };
            return Err(io::Error::new(
                e.kind(),
                format!(
                    "the TLS handshake failed: {e}; the executor's certificate must be signed by \
                     a CA this client trusts, {trust}, and name {host:?}"
                ),
            ));
        }
    }
    stream.set_read_timeout(None)?;
    stream.set_write_timeout(None)?;
    Ok(tls)
}

/// The reader thread's side of a TLS connection: blocks on the socket
/// without the writer's lock, then takes it to decrypt what came (and to
/// answer what TLS itself asks, such as a key update).
struct TlsReader<'a> {
    stream: TcpStream,
    shared: &'a ConnShared,
    raw: Vec<u8>,
    plain: Vec<u8>,
    at: usize,
    closed: bool,
}

impl<'a> TlsReader<'a> {
    fn new(stream: TcpStream, shared: &'a ConnShared) -> TlsReader<'a> {
        TlsReader {
            stream,
            shared,
            raw: vec![0; 16 << 10],
            plain: Vec::new(),
            at: 0,
            closed: false,
        }
    }

    /// Decrypts `got` bytes read from the socket into `plain`.
    fn decrypt(&mut self, got: usize) -> io::Result<()> {
        self.plain.clear();
        self.at = 0;
        let mut wire = lock(&self.shared.writer);
        let Wire { stream, tls } = &mut *wire;
        let Some(tls) = tls else {
            return Err(io::Error::other("a TLS connection without its session"));
        };
        let mut input = &self.raw[..got];
        while !input.is_empty() {
            tls.read_tls(&mut input)?;
            let state = match tls.process_new_packets() {
                Ok(state) => state,
                Err(e) => {
                    let _ = tls.write_tls(stream);
                    return Err(io::Error::new(io::ErrorKind::InvalidData, e));
                }
            };
            let n = state.plaintext_bytes_to_read();
            if n > 0 {
                let from = self.plain.len();
                self.plain.resize(from + n, 0);
                tls.reader().read_exact(&mut self.plain[from..])?;
            }
            self.closed |= state.peer_has_closed();
        }
        while tls.wants_write() {
            tls.write_tls(stream)?;
        }
        Ok(())
    }
}

impl Read for TlsReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        while self.at == self.plain.len() {
            if self.closed {
                return Ok(0);
            }
            let got = self.stream.read(&mut self.raw)?;
            if got == 0 {
                return Ok(0);
            }
            self.decrypt(got)?;
        }
        let n = buf.len().min(self.plain.len() - self.at);
        buf[..n].copy_from_slice(&self.plain[self.at..self.at + n]);
        self.at += n;
        Ok(n)
    }
}

/// The reader thread: reads frames until the connection ends, then tries
/// to take the allocations up on a new connection ([`reattach`]); when
/// that fails, marks every allocation executor-lost and wakes every
/// waiter.
fn reader_thread(mut stream: TcpStream, mut tls: bool, shared: &ConnShared) {
    loop {
        let reason = if tls {
            read_loop(TlsReader::new(stream, shared), shared)
        } else {
            read_loop(stream, shared)
        };
        tracing::debug!(executor = %shared.executor, %reason, "control connection ended");
        // Requests in flight went with the connection.
        lock(&shared.state).waiters.clear();
        match reattach(shared) {
            Some((s, t)) => {
                stream = s;
                tls = t;
            }
            None => {
                let mut st = lock(&shared.state);
                st.lost = Some(reason);
                st.waiters.clear();
                st.secrets.clear();
                let fates: Vec<_> = st.allocations.drain().map(|(_, f)| f).collect();
                drop(st);
                for fate in fates {
                    fate.set(FateState::ExecutorLost);
                }
                return;
            }
        }
    }
}

/// Reads and routes frames until the connection ends; returns why.
fn read_loop(stream: impl Read, shared: &ConnShared) -> String {
    let mut reader = BufReader::new(stream);
    loop {
        match Frame::read_from(&mut reader, FrameLimits::default()) {
            Ok(frame) => {
                if let Err(e) = dispatch(shared, &frame) {
                    return e.to_string();
                }
            }
            Err(e) => return e.to_string(),
        }
    }
}

/// Tries, for its grace (`ClientOptions::reattach_grace`), to connect to the executor again and
/// sends an `Attach` for every allocation it gave a secret for (their
/// answers come to [`dispatch`]). Returns the new connection's socket to
/// read and whether it speaks TLS; `None` when the handle was dropped,
/// no allocation can be attached, or the executor did not come back.
fn reattach(shared: &ConnShared) -> Option<(TcpStream, bool)> {
    let until = Instant::now() + shared.reattach_grace;
    let mut pause = Duration::from_millis(20);
    loop {
        if shared.closed.load(Ordering::Acquire) {
            return None;
        }
        let todo: Vec<(u64, String)> = {
            let st = lock(&shared.state);
            st.allocations
                .keys()
                .filter_map(|id| st.secrets.get(id).map(|s| (*id, s.clone())))
                .collect()
        };
        if todo.is_empty() {
            return None;
        }
        match open_wire(&shared.executor, shared.timeout) {
            Ok((wire, reader)) => {
                let tls = wire.tls.is_some();
                *lock(&shared.writer) = wire;
                let mut sent = true;
                for (allocation_id, secret) in todo {
                    let request_id = shared.next_request.fetch_add(1, Ordering::Relaxed);
                    lock(&shared.state)
                        .attaching
                        .insert(request_id, allocation_id);
                    let msg = Attach {
                        request_id,
                        allocation_id,
                        secret,
                    };
                    if let Err(e) =
                        Frame::new(&msg, Vec::new()).write_to(&mut *lock(&shared.writer))
                    {
                        tracing::debug!(executor = %shared.executor, error = %e, "cannot send Attach");
                        sent = false;
                        break;
                    }
                }
                if sent {
                    tracing::info!(executor = %shared.executor, "reconnected to the executor; attaching the allocations again");
                    return Some((reader, tls));
                }
            }
            Err(e) => {
                tracing::debug!(executor = %shared.executor, error = %e, "the executor does not answer yet");
            }
        }
        let now = Instant::now();
        if now >= until {
            tracing::warn!(executor = %shared.executor, grace_ms = shared.reattach_grace.as_millis() as u64, "the executor did not come back within the grace; its allocations are lost");
            return None;
        }
        // Waiting for another process to listen: nothing to wait on but time.
        std::thread::sleep(pause.min(until - now));
        pause = (pause * 2).min(REATTACH_BACKOFF_MAX);
    }
}

/// Routes one frame from the executor.
fn dispatch(shared: &ConnShared, frame: &Frame) -> Result<()> {
    match frame.kind {
        Kind::AllocateOk => {
            let ok: AllocateOk = frame.parse()?;
            let fate = Arc::new(Fate::new(shared.executor.clone()));
            let mut st = lock(&shared.state);
            match st.waiters.remove(&ok.request_id) {
                Some(tx) => {
                    st.allocations.insert(ok.allocation_id, Arc::clone(&fate));
                    if !ok.attach_secret.is_empty() {
                        st.secrets
                            .insert(ok.allocation_id, ok.attach_secret.clone());
                    }
                    drop(st);
                    let _ = tx.send(Reply::Allocated(Box::new(ok), fate));
                }
                None => {
                    // The request timed out: nobody will use this worker.
                    drop(st);
                    tracing::warn!(
                        allocation = ok.allocation_id,
                        "an allocation arrived after its request timed out; deallocating it"
                    );
                    let msg = Deallocate {
                        request_id: shared.next_request.fetch_add(1, Ordering::Relaxed),
                        allocation_id: ok.allocation_id,
                    };
                    send_deallocate(shared, &msg);
                }
            }
        }
        Kind::Attached => {
            let a: Attached = frame.parse()?;
            lock(&shared.state).attaching.remove(&a.request_id);
            tracing::info!(executor = %shared.executor, allocation = a.allocation_id, "allocation attached again");
        }
        Kind::Error => {
            let e: ErrorReply = frame.parse()?;
            let refused_attach = {
                let mut st = lock(&shared.state);
                match st.attaching.remove(&e.request_id) {
                    Some(id) => {
                        st.secrets.remove(&id);
                        st.allocations.remove(&id)
                    }
                    None => None,
                }
            };
            if let Some(fate) = refused_attach {
                tracing::warn!(executor = %shared.executor, message = %e.message, "the executor did not take an allocation up again");
                fate.set(FateState::ExecutorLost);
                return Ok(());
            }
            if e.request_id == 0 {
                // The executor refuses the connection itself (before any
                // request was read): every request waiting hears why.
                let waiters: Vec<_> = lock(&shared.state).waiters.drain().collect();
                for (_, tx) in waiters {
                    let _ = tx.send(Reply::Refused(e.clone()));
                }
                return Ok(());
            }
            let tx = lock(&shared.state).waiters.remove(&e.request_id);
            match tx {
                Some(tx) => {
                    let _ = tx.send(Reply::Refused(e));
                }
                None => {
                    tracing::debug!(request_id = e.request_id, code = ?e.code, message = %e.message, "an error reply nobody waits for")
                }
            }
        }
        Kind::Deallocated => {
            let d: Deallocated = frame.parse()?;
            let mut st = lock(&shared.state);
            st.secrets.remove(&d.allocation_id);
            let fate = st.allocations.remove(&d.allocation_id);
            let tx = st.waiters.remove(&d.request_id);
            drop(st);
            if let Some(fate) = fate {
                fate.set(FateState::Deallocated);
            }
            if let Some(tx) = tx {
                let _ = tx.send(Reply::Deallocated);
            }
        }
        Kind::LeaseRenewed => {
            let r: LeaseRenewed = frame.parse()?;
            let tx = lock(&shared.state).waiters.remove(&r.request_id);
            if let Some(tx) = tx {
                let _ = tx.send(Reply::Renewed(r.expires_at));
            }
        }
        Kind::WorkerExited => {
            let w: WorkerExited = frame.parse()?;
            tracing::debug!(allocation = w.allocation_id, cause = ?w.cause, signal = ?w.signal, message = %w.message, "worker exited");
            let fate = lock(&shared.state).allocations.remove(&w.allocation_id);
            if let Some(fate) = fate {
                fate.set(FateState::Exited(w));
            }
        }
        other => {
            return Err(Error::Protocol(format!(
                "the executor sent a {other:?} message on a client connection"
            )))
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use rfaas_proto::control::client::ExitCause;

    #[test]
    fn the_executors_report_of_a_crash_replaces_the_workers() {
        let f = Fate::new("127.0.0.1:9".into());
        f.set(FateState::Crashed { signal: None });
        assert!(f.ended());
        assert!(matches!(
            f.error(Duration::ZERO),
            Error::WorkerCrashed {
                signal: None,
                cause: ExitCause::Crashed,
                ..
            }
        ));
        // Losing the executor afterwards changes nothing...
        f.set(FateState::ExecutorLost);
        assert!(matches!(
            f.error(Duration::ZERO),
            Error::WorkerCrashed { .. }
        ));
        // ...its report of the exit fills in the signal.
        f.set(FateState::Exited(WorkerExited {
            allocation_id: 1,
            cause: ExitCause::Crashed,
            signal: Some(6),
            exit_code: None,
            message: "worker 3 killed by SIGABRT".into(),
        }));
        assert!(matches!(
            f.error(Duration::ZERO),
            Error::WorkerCrashed {
                signal: Some(6),
                ..
            }
        ));
    }

    #[test]
    fn a_worker_that_refuses_calls_may_still_finish_those_under_way() {
        let f = Fate::new("127.0.0.1:9".into());
        f.set(FateState::Refusing(InvocationStatus::ExecutorDraining));
        assert!(f.ended(), "no more calls");
        assert!(!f.gone(), "a drain lets calls under way finish");
        // The worker's end, later, is news that it is gone; the cause every
        // call hears stays the first.
        f.set(FateState::Exited(WorkerExited {
            allocation_id: 1,
            cause: ExitCause::Drained,
            signal: Some(9),
            exit_code: None,
            message: "worker 3 stopped: its node is being retrieved".into(),
        }));
        assert!(f.gone());
        assert!(matches!(
            f.error(Duration::ZERO),
            Error::FunctionFailed(InvocationStatus::ExecutorDraining)
        ));
        let f = Fate::new("127.0.0.1:9".into());
        f.set(FateState::Crashed { signal: Some(11) });
        assert!(f.gone(), "a crashed worker is dying");
    }

    #[test]
    fn fate_errors() {
        let f = Fate::new("127.0.0.1:9".into());
        assert!(!f.ended());
        assert!(matches!(
            f.error(Duration::from_millis(10)),
            Error::WorkerLost
        ));
        f.set(FateState::Exited(WorkerExited {
            allocation_id: 1,
            cause: ExitCause::Crashed,
            signal: Some(9),
            exit_code: None,
            message: "worker 3 killed by SIGKILL".into(),
        }));
        assert!(f.ended());
        // The first end is kept.
        f.set(FateState::ExecutorLost);
        assert!(matches!(
            f.error(Duration::ZERO),
            Error::WorkerCrashed {
                signal: Some(9),
                ..
            }
        ));

        let f = Arc::new(Fate::new("127.0.0.1:9".into()));
        let g = Arc::clone(&f);
        let waiter = rfaas_testkit::wait::thread_id();
        // The news comes once this thread waits for it.
        let t = std::thread::spawn(move || {
            rfaas_testkit::wait::wait_until_asleep(std::process::id(), waiter);
            g.set(FateState::ExecutorLost);
        });
        // Waits for the late news instead of answering WorkerLost.
        let e = f.error(Duration::from_secs(10));
        assert!(
            matches!(e, Error::ExecutorLost { ref executor } if executor == "127.0.0.1:9"),
            "{e:?}"
        );
        t.join().unwrap();
    }
}

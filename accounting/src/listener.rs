//! The fabric listener: admits executor daemons, and keeps their
//! connections while they add.
//!
//! # Probation
//!
//! Anyone who can reach the listener may connect, so a new connection is
//! on probation. It is accepted into a protection domain of its own,
//! which holds nothing but the buffer its answer is written from: the
//! counter region is registered in that domain only once the hello's
//! credential is verified ([`Region::expose`]), so until then no rkey
//! names the counters on this connection, whatever a peer guesses, and
//! an rkey learnt on one connection names nothing on another. The
//! service posts [`HELLO_IMMS`] receives, and the peer
//! must send an [`AccountingHello`] in the immediates of as many
//! zero-length writes-with-immediate, the first being [`HELLO_IMM`],
//! within `hello_timeout`. A connection that begins otherwise, writes
//! bytes, or stays silent is dropped without an answer. The hello's
//! accounting ticket is checked ([`Verifier`], off this thread): its
//! signature under the manager's keys and its expiry, then the node
//! credential it names, which must be live; the answer is an [`AccountingReply`] written with immediate
//! [`REPLY_IMM`] into the buffer the hello names. Only an accepted reply
//! carries the region's address and rkey, those of the connection's own
//! registration, in the window of the ticket's node. A hello of another
//! version (a version 1 hello carried a bearer credential) is answered
//! `BadHello`. After a refusal the connection
//! is dropped once the reply's write completed. At most
//! [`MAX_PROBATION`] connections are on probation at once; more wait in
//! the listener's backlog, so a flood of silent peers delays daemons by at
//! most `hello_timeout`.
//!
//! # Accepted connections
//!
//! An accepted connection is kept with one posted receive, and its
//! completion queue is looked at every [`SWEEP`]: the receive completes
//! (`PeerLost`, `Flushed`) when the daemon goes away, and the connection
//! is dropped then. The daemon's fetch-and-adds never reach this thread:
//! the NIC (verbs), the fabric's progress thread (tcp) or the daemon
//! itself (shm) applies them to the region. A daemon that sends anything
//! else after its hello is dropped. Every [`WATCH`] the credentials the
//! kept connections were admitted under are looked up in one query
//! ([`Verifier::live`]); the connections of a credential revoked, expired
//! or deleted since are dropped and counted
//! (`rfaas_accounting_revoked_connections_total`), so a revocation closes
//! a node's connections within about [`WATCH`] plus a query. A database
//! outage keeps them (and is retried at the next period).
//!
//! Each connection has a completion queue of its own, so connections
//! need no shared capacity and a dead one takes nothing with it.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rfaas_fabric::{
    Access, Completion, CompletionQueue, Domain, Endpoint, EndpointOptions, Fabric, Listener,
    MemoryRegion, Opcode, RemoteAddr, Status,
};
use rfaas_proto::accounting::{
    AccountingHello, AccountingReply, ReplyStatus, HELLO_IMM, HELLO_IMMS, REPLY_IMM,
};

use crate::credentials::{Verdict, Verifier, WATCH};
use crate::ledger::Ledger;
use crate::metrics::Metrics;
use crate::region::Region;

/// Most connections on probation at once.
pub const MAX_PROBATION: usize = 16;

/// How often accepted connections are looked at for a departed daemon.
pub const SWEEP: Duration = Duration::from_millis(200);

const SEND_DEPTH: usize = 4;
const RECV_DEPTH: usize = HELLO_IMMS;
/// The wr_id of the reply's write.
const WR_REPLY: u64 = u64::MAX;
/// The wr_id of an accepted connection's one posted receive.
const WR_WATCH: u64 = u64::MAX - 1;

/// The options of the service's side of a connection.
pub fn endpoint_options(hello_timeout: Duration) -> EndpointOptions {
    EndpointOptions {
        send_depth: SEND_DEPTH,
        recv_depth: RECV_DEPTH,
        connect_timeout: hello_timeout,
        ..EndpointOptions::default()
    }
}

/// What the listener thread needs.
#[derive(Debug)]
pub struct ListenerParts {
    /// The provider.
    pub fabric: Arc<Fabric>,
    /// The listening endpoint.
    pub listener: Listener,
    /// The counter region and the nodes' windows: a connection whose
    /// hello is accepted gets its node's window, registered for it alone.
    pub ledger: Arc<Ledger>,
    /// Ticket and credential checks.
    pub verifier: Arc<Verifier>,
    /// Where the checks run.
    pub runtime: tokio::runtime::Handle,
    /// Metrics.
    pub metrics: Arc<Metrics>,
    /// The hello deadline.
    pub hello_timeout: Duration,
}

enum Stage {
    /// Collecting the hello's immediates.
    Hello(Vec<u32>),
    /// The credential is being checked.
    Checking {
        verdict: mpsc::Receiver<Verdict>,
        reply_to: RemoteAddr,
    },
    /// The reply's write is on its way.
    Replying {
        status: ReplyStatus,
        admitted: Option<Admitted>,
    },
}

/// Whom a connection was admitted as.
#[derive(Debug, Clone)]
struct Admitted {
    node: String,
    credential_id: String,
}

struct Candidate {
    endpoint: Endpoint,
    cq: CompletionQueue,
    stage: Stage,
    deadline: Instant,
    /// Where the answer is written from, in the connection's domain.
    reply_buf: MemoryRegion,
    /// The region as this connection names it, once the hello is accepted.
    exposed: Option<MemoryRegion>,
    /// The connection's own protection domain.
    domain: Domain,
    peer: String,
}

struct Kept {
    /// Held open: the daemon adds through it.
    _endpoint: Endpoint,
    /// The region registered for this connection alone.
    _exposed: MemoryRegion,
    _domain: Domain,
    cq: CompletionQueue,
    who: Admitted,
    peer: String,
}

/// What became of a candidate in one step.
enum Outcome {
    Waiting,
    Accepted(Admitted),
    Dropped { why: String, result: &'static str },
}

fn dropped(why: impl Into<String>, result: &'static str) -> Outcome {
    Outcome::Dropped {
        why: why.into(),
        result,
    }
}

/// The listener thread's state.
struct Acceptor {
    p: ListenerParts,
    opts: EndpointOptions,
    spare_cq: Option<CompletionQueue>,
    spare_domain: Option<Domain>,
    candidates: Vec<Candidate>,
    kept: Vec<Kept>,
    next_sweep: Instant,
    /// The answer of the credential watch under way, if one is.
    watch: Option<mpsc::Receiver<Option<HashSet<String>>>>,
    next_watch: Instant,
}

/// Starts the listener thread; it stops (dropping every connection) once
/// `stop` is set, within [`SWEEP`].
pub fn spawn(
    parts: ListenerParts,
    stop: Arc<AtomicBool>,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    let opts = endpoint_options(parts.hello_timeout);
    let mut a = Acceptor {
        p: parts,
        opts,
        spare_cq: None,
        spare_domain: None,
        candidates: Vec::new(),
        kept: Vec::new(),
        next_sweep: Instant::now() + SWEEP,
        watch: None,
        next_watch: Instant::now() + WATCH,
    };
    std::thread::Builder::new()
        .name("rfaas-acct-listen".into())
        .spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                a.step();
            }
            tracing::debug!(
                connections = a.kept.len(),
                "the listener stops; dropping its connections"
            );
        })
}

impl Acceptor {
    fn step(&mut self) {
        let accepted = self.accept_one();
        let progressed = self.progress();
        if Instant::now() >= self.next_sweep {
            self.sweep();
            self.next_sweep = Instant::now() + SWEEP;
        }
        self.watch_credentials();
        if !self.candidates.is_empty() && !accepted && !progressed {
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Accepts one connection if there is room on probation: waits until
    /// the next sweep when nobody is on probation, only looks otherwise.
    fn accept_one(&mut self) -> bool {
        if self.candidates.len() >= MAX_PROBATION {
            return false;
        }
        let mut cq = match self.spare_cq.take() {
            Some(cq) => cq,
            None => match self.p.fabric.completion_queue(SEND_DEPTH + RECV_DEPTH) {
                Ok(cq) => cq,
                Err(e) => {
                    tracing::warn!(error = %e, "cannot create a completion queue for a new connection; retrying");
                    std::thread::sleep(SWEEP);
                    return false;
                }
            },
        };
        let domain = match self.spare_domain.take() {
            Some(d) => d,
            None => match self.p.fabric.domain() {
                Ok(d) => d,
                Err(e) => {
                    self.spare_cq = Some(cq);
                    tracing::warn!(error = %e, "cannot create a protection domain for a new connection; retrying");
                    std::thread::sleep(SWEEP);
                    return false;
                }
            },
        };
        let wait = if self.candidates.is_empty() {
            self.next_sweep.saturating_duration_since(Instant::now())
        } else {
            Duration::ZERO
        };
        let endpoint = match self
            .p
            .listener
            .accept(&domain, &mut cq, &self.opts, Some(wait))
        {
            Ok(ep) => ep,
            Err(e) => {
                self.spare_cq = Some(cq);
                self.spare_domain = Some(domain);
                match e {
                    rfaas_fabric::Error::Timeout(_) => {}
                    rfaas_fabric::Error::Connect { .. } => {
                        tracing::debug!(error = %e, "a connection failed the fabric's handshake");
                    }
                    e => {
                        tracing::warn!(error = %e, "accepting a connection failed; retrying");
                        std::thread::sleep(Duration::from_millis(100));
                    }
                }
                return false;
            }
        };
        let peer = endpoint.peer_addr();
        let reply_buf = match domain.register(AccountingReply::LEN, Access::LOCAL) {
            Ok(b) => b,
            Err(e) => {
                tracing::warn!(%peer, error = %e, "cannot register the answer's buffer of a new connection; dropped the connection");
                self.p.metrics.hellos.with_label_values(&["dropped"]).inc();
                return true;
            }
        };
        for wr in 0..RECV_DEPTH as u64 {
            if let Err(e) = endpoint.post_recv(wr) {
                tracing::warn!(%peer, error = %e, "cannot post the receives of a hello; dropped the connection");
                self.p.metrics.hellos.with_label_values(&["dropped"]).inc();
                return true;
            }
        }
        self.candidates.push(Candidate {
            endpoint,
            cq,
            stage: Stage::Hello(Vec::with_capacity(HELLO_IMMS)),
            deadline: Instant::now() + self.p.hello_timeout,
            reply_buf,
            exposed: None,
            domain,
            peer,
        });
        true
    }

    /// Moves every candidate on; returns whether anything happened.
    fn progress(&mut self) -> bool {
        let mut any = false;
        let mut i = 0;
        while i < self.candidates.len() {
            let (outcome, moved) = self.step_candidate(i);
            any |= moved;
            match outcome {
                Outcome::Waiting => i += 1,
                Outcome::Accepted(who) => {
                    let node = who.node.clone();
                    let c = self.candidates.swap_remove(i);
                    let Some(exposed) = c.exposed else {
                        continue;
                    };
                    if let Err(e) = c.endpoint.post_recv(WR_WATCH) {
                        tracing::warn!(peer = %c.peer, %node, error = %e, "cannot watch an accepted connection; dropped it");
                        continue;
                    }
                    tracing::info!(peer = %c.peer, %node, "an executor daemon connected");
                    self.p.metrics.hellos.with_label_values(&["accepted"]).inc();
                    self.kept.push(Kept {
                        _endpoint: c.endpoint,
                        _exposed: exposed,
                        _domain: c.domain,
                        cq: c.cq,
                        who,
                        peer: c.peer,
                    });
                    self.p.metrics.connections.set(self.kept.len() as i64);
                }
                Outcome::Dropped { why, result } => {
                    let c = self.candidates.swap_remove(i);
                    tracing::warn!(peer = %c.peer, "a connection {why}; dropped it");
                    self.p.metrics.hellos.with_label_values(&[result]).inc();
                }
            }
        }
        any
    }

    fn step_candidate(&mut self, i: usize) -> (Outcome, bool) {
        let mut done = [Completion::EMPTY; 16];
        let c = &mut self.candidates[i];
        let n = c.cq.poll(&mut done);
        let mut moved = n > 0;
        for comp in &done[..n] {
            let outcome = match &mut c.stage {
                Stage::Hello(imms) => match hello_part(imms, comp) {
                    Err(o) => o,
                    Ok(false) => Outcome::Waiting,
                    Ok(true) => {
                        // The check answers within hello_timeout (or says
                        // Unavailable): this deadline is a backstop.
                        c.deadline = Instant::now() + 2 * self.p.hello_timeout;
                        match start_check(imms, &self.p) {
                            Ok(stage) => {
                                c.stage = stage;
                                Outcome::Waiting
                            }
                            Err((reply_to, why)) => {
                                tracing::debug!(peer = %c.peer, why, "a bad hello");
                                match reply_to {
                                    Some(to) => reply(
                                        c,
                                        to,
                                        ReplyStatus::BadHello,
                                        None,
                                        self.p.ledger.main(),
                                    ),
                                    None => dropped(
                                        format!("sent a hello that is not one ({why})"),
                                        "bad_hello",
                                    ),
                                }
                            }
                        }
                    }
                },
                Stage::Checking { .. } => dropped(
                    format!(
                        "sent more than its hello before the answer ({:?}, {})",
                        comp.opcode, comp.status
                    ),
                    "bad_hello",
                ),
                Stage::Replying { status, admitted } => {
                    if comp.wr_id != WR_REPLY || comp.opcode != Opcode::WriteWithImm {
                        dropped(
                            format!(
                                "sent more than its hello before the answer ({:?}, {})",
                                comp.opcode, comp.status
                            ),
                            "bad_hello",
                        )
                    } else if !comp.status.is_ok() {
                        dropped(
                            format!("could not be answered ({})", comp.status),
                            "dropped",
                        )
                    } else {
                        match (status, admitted.take()) {
                            (ReplyStatus::Accepted, Some(who)) => Outcome::Accepted(who),
                            (status, _) => dropped(
                                format!("was refused: {}", status.describe()),
                                match status {
                                    ReplyStatus::BadCredential => "bad_credential",
                                    ReplyStatus::Unavailable => "unavailable",
                                    _ => "bad_hello",
                                },
                            ),
                        }
                    }
                }
            };
            if !matches!(outcome, Outcome::Waiting) {
                return (outcome, true);
            }
        }
        if let Stage::Checking { verdict, reply_to } = &c.stage {
            let to = *reply_to;
            let answer = match verdict.try_recv() {
                Ok(v) => Some(v),
                Err(mpsc::TryRecvError::Empty) => None,
                Err(mpsc::TryRecvError::Disconnected) => {
                    Some(Verdict::Unavailable("the check was cut short".into()))
                }
            };
            if let Some(v) = answer {
                moved = true;
                let (status, admitted) = match v {
                    Verdict::Node {
                        node,
                        credential_id,
                    } => match self
                        .p
                        .ledger
                        .window(&node)
                        .and_then(|w| w.expose(&c.domain))
                    {
                        Ok(mr) => {
                            c.exposed = Some(mr);
                            (
                                ReplyStatus::Accepted,
                                Some(Admitted {
                                    node,
                                    credential_id,
                                }),
                            )
                        }
                        Err(e) => {
                            tracing::warn!(peer = %c.peer, %node, error = %e, "cannot register the region for an accepted daemon; it is told to retry");
                            (ReplyStatus::Unavailable, None)
                        }
                    },
                    Verdict::Refused(why) => {
                        tracing::info!(peer = %c.peer, why, "an accounting ticket was refused");
                        (ReplyStatus::BadCredential, None)
                    }
                    Verdict::Unavailable(why) => {
                        tracing::warn!(peer = %c.peer, why, "cannot check the credential a daemon's ticket names: the database is unavailable; it is told to retry");
                        (ReplyStatus::Unavailable, None)
                    }
                };
                c.deadline = Instant::now() + self.p.hello_timeout;
                let o = reply(c, to, status, admitted, self.p.ledger.main());
                if !matches!(o, Outcome::Waiting) {
                    return (o, true);
                }
            }
        }
        if Instant::now() >= c.deadline {
            let why = match c.stage {
                Stage::Hello(ref imms) => format!(
                    "sent {} of its hello's {HELLO_IMMS} immediates within {} ms",
                    imms.len(),
                    self.p.hello_timeout.as_millis()
                ),
                Stage::Checking { .. } => "was not checked in time".into(),
                Stage::Replying { .. } => "did not take its answer in time".into(),
            };
            return (dropped(why, "dropped"), true);
        }
        (Outcome::Waiting, moved)
    }

    /// Looks at every accepted connection; drops those whose daemon left.
    fn sweep(&mut self) {
        let mut done = [Completion::EMPTY; 4];
        let before = self.kept.len();
        self.kept.retain_mut(|k| {
            let n = k.cq.poll(&mut done);
            let Some(c) = done[..n].first() else {
                return true;
            };
            match c.status {
                Status::PeerLost | Status::Flushed => {
                    tracing::info!(peer = %k.peer, node = %k.who.node, "an executor daemon went away")
                }
                _ => tracing::warn!(peer = %k.peer, node = %k.who.node, opcode = ?c.opcode, status = %c.status, "an executor daemon sent something after its hello; dropped its connection"),
            }
            false
        });
        if self.kept.len() != before {
            self.p.metrics.connections.set(self.kept.len() as i64);
        }
    }
}

impl Acceptor {
    /// Every [`WATCH`], asks which credentials of the kept connections
    /// are still live (off this thread), and drops the connections of
    /// those that are not once the answer is in.
    fn watch_credentials(&mut self) {
        if let Some(rx) = &self.watch {
            let live = match rx.try_recv() {
                Ok(live) => live,
                Err(mpsc::TryRecvError::Empty) => return,
                Err(mpsc::TryRecvError::Disconnected) => None,
            };
            self.watch = None;
            self.next_watch = Instant::now() + WATCH;
            let Some(live) = live else {
                return;
            };
            let before = self.kept.len();
            self.kept.retain(|k| {
                let keep = live.contains(&k.who.credential_id);
                if !keep {
                    tracing::warn!(peer = %k.peer, node = %k.who.node, credential = %k.who.credential_id, "the node credential of an executor daemon's connection was revoked, expired or deleted; closed the connection");
                }
                keep
            });
            let closed = before - self.kept.len();
            if closed > 0 {
                self.p.metrics.revoked_connections.inc_by(closed as u64);
                self.p.metrics.connections.set(self.kept.len() as i64);
            }
            return;
        }
        if self.kept.is_empty() || Instant::now() < self.next_watch {
            return;
        }
        let admitted: Vec<(String, String)> = self
            .kept
            .iter()
            .map(|k| (k.who.credential_id.clone(), k.who.node.clone()))
            .collect();
        let (tx, rx) = mpsc::channel();
        let verifier = self.p.verifier.clone();
        let within = WATCH.max(self.p.hello_timeout);
        self.p.runtime.spawn(async move {
            let ask = verifier.live(&admitted, rfaas_service::now_s());
            let live = match tokio::time::timeout(within, ask).await {
                Ok(Ok(live)) => Some(live),
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, "cannot look up the credentials of the executor daemons' connections; they are kept, and looked up again shortly");
                    None
                }
                Err(_) => None,
            };
            let _ = tx.send(live);
        });
        self.watch = Some(rx);
    }
}

/// Takes one completion of the hello. `Ok(true)` once the hello is whole,
/// `Err` with the outcome when the connection is to be dropped.
fn hello_part(imms: &mut Vec<u32>, c: &Completion) -> Result<bool, Outcome> {
    if c.opcode != Opcode::RecvWithImm || !c.status.is_ok() {
        return Err(dropped(
            format!(
                "failed before its hello was whole ({:?}: {})",
                c.opcode, c.status
            ),
            "dropped",
        ));
    }
    if c.byte_len != 0 {
        return Err(dropped(
            format!("wrote {} bytes instead of a hello", c.byte_len),
            "bad_hello",
        ));
    }
    if imms.is_empty() && c.imm != HELLO_IMM {
        return Err(dropped(
            format!("began with immediate {:#x}, not an accounting hello", c.imm),
            "bad_hello",
        ));
    }
    imms.push(c.imm);
    Ok(imms.len() == HELLO_IMMS)
}

/// Decodes a whole hello and starts its ticket check. On a hello that
/// does not decode: where to send `BadHello` (if its reply address can be
/// read) and why.
fn start_check(imms: &[u32], p: &ListenerParts) -> Result<Stage, (Option<RemoteAddr>, String)> {
    let imms: &[u32; HELLO_IMMS] = imms.try_into().expect("a whole hello");
    let hello = match AccountingHello::from_imms(imms) {
        Ok(h) => h,
        Err(e) => {
            // Same magic, other version or a bad field: the reply address
            // sits where every version puts it.
            let to = RemoteAddr {
                addr: u64::from(imms[2]) | u64::from(imms[3]) << 32,
                rkey: imms[4],
            };
            return Err((Some(to), e.to_string()));
        }
    };
    let reply_to = RemoteAddr {
        addr: hello.reply_addr,
        rkey: hello.reply_rkey,
    };
    let (tx, rx) = mpsc::channel();
    let verifier = p.verifier.clone();
    let within = p.hello_timeout;
    p.runtime.spawn(async move {
        let check = verifier.check(&hello.ticket, rfaas_service::now_s());
        let v = tokio::time::timeout(within, check)
            .await
            .unwrap_or_else(|_| Verdict::Unavailable("the check took too long".into()));
        let _ = tx.send(v);
    });
    Ok(Stage::Checking {
        verdict: rx,
        reply_to,
    })
}

/// Writes the answer to `to`; the candidate then waits for the write's
/// completion. An accepted answer names the region as the connection's
/// own registration of it (`c.exposed`).
fn reply(
    c: &mut Candidate,
    to: RemoteAddr,
    status: ReplyStatus,
    admitted: Option<Admitted>,
    region: &Region,
) -> Outcome {
    let answer = match (status, &c.exposed) {
        (ReplyStatus::Accepted, Some(mr)) => {
            let header = region.header();
            let d = mr.descriptor();
            AccountingReply {
                status,
                region_addr: d.addr,
                region_rkey: d.rkey,
                slots: header.slots,
                region_id: header.region_id,
            }
        }
        (ReplyStatus::Accepted, None) => AccountingReply::refused(ReplyStatus::Unavailable),
        (other, _) => AccountingReply::refused(other),
    };
    let mut bytes = [0u8; AccountingReply::LEN];
    answer
        .encode(&mut bytes)
        .expect("the buffer is a reply long");
    c.reply_buf.write_from(0, &bytes);
    match c.endpoint.write_with_imm(
        WR_REPLY,
        &c.reply_buf,
        0,
        AccountingReply::LEN,
        to,
        REPLY_IMM,
    ) {
        Ok(()) => {
            c.stage = Stage::Replying { status, admitted };
            Outcome::Waiting
        }
        Err(e) => dropped(format!("could not be answered ({e})"), "dropped"),
    }
}

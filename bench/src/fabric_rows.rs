//! Rows measured through `rfaas-fabric`, for every selected provider.
//!
//! - `pingpong`: a write-with-immediate round trip, both sides busy-polling
//!   their completion queues, one message of each `--sizes` size each way.
//! - `bandwidth`: a stream of one-sided writes of each `--bw-sizes` size,
//!   up to `WINDOW` outstanding, ended by a write-with-immediate the peer
//!   answers, so the time covers every byte placed in the peer's memory.
//!   The peer busy-polls, as a hot rfaas worker does.
//! - `pingpong_bandwidth`: `pingpong` with each `--bw-sizes` size each way,
//!   reported as bandwidth (`2 × size` per round trip): what the fabric
//!   itself reaches in an invocation's pattern, one payload over and one
//!   back with nothing in flight between them.
//! - `bandwidth_passive`: the same with the peer asleep in `wait`: on shm
//!   (and verbs) the writes need no target CPU; on tcp the target's library
//!   wakes to place the data.
//! - `pingpong_rate`: the fabric's message rate: 64-byte writes-with-immediate
//!   the peer answers, with 1, 4, 16 and 64 outstanding on one endpoint (a new
//!   one is posted as each answer arrives), in answers per second. The
//!   ceiling `hot_noop_rate` is judged against.
//!
//! The peer (`--serve fabric_echo <provider> <addr> <region-len> <spin|wait>`)
//! echoes every write-with-immediate with one of the same length and
//! immediate, busy-polling (`spin`) or sleeping in `wait`.
//!
//! Both sides keep [`RECVS`] receives posted and give back the one an
//! answer consumed only after their next write is on its way (the peer:
//! after its answer), as perftest posts its receives ahead: re-posting
//! costs about a microsecond on verbs under emulation, and the round trip
//! is not the place for it.

use rfaas_fabric::{
    Access, Completion, CompletionQueue, EndpointOptions, Fabric, Opcode, RemoteAddr,
};

use crate::child::{peer_arg, PeerSpec, Ready};
use crate::error::{Error, Result};
use crate::report::{Report, Row};
use crate::rows::{Ctx, Kind, Provider, RowSpec, Runner, Suite};
use crate::stats::time_round_trips;

const PINGPONG: &str = "pingpong";
const BANDWIDTH: &str = "bandwidth";
const PINGPONG_BANDWIDTH: &str = "pingpong_bandwidth";
const BANDWIDTH_PASSIVE: &str = "bandwidth_passive";
const PINGPONG_RATE: &str = "pingpong_rate";
const ECHO: &str = "fabric_echo";

/// Immediate of the first message, which carries the initiator's reply descriptor.
const SETUP: u32 = u32::MAX;
/// Writes in flight in the bandwidth rows.
const WINDOW: usize = 32;
/// Receives posted on each side; one is given back after each answer.
const RECVS: u64 = 64;
/// Message size of the rate rows (`pingpong_rate`, `hot_noop_rate`).
pub const RATE_SIZE: usize = 64;
/// Messages outstanding in the rate rows.
pub const RATE_IN_FLIGHT: [u32; 4] = [1, 4, 16, 64];

pub const SUITE: Suite = Suite {
    rows: &[
        RowSpec {
            name: PINGPONG,
            help: "round trip of a write-with-immediate answered by one of the same size, both sides busy-polling (latency at --sizes)",
            runner: Runner::PerProvider {
                kind: None,
                run: pingpong,
            },
        },
        RowSpec {
            name: BANDWIDTH,
            help: "one-sided writes, 32 in flight, into a busy-polling peer, ended by a write-with-immediate it answers (at --bw-sizes)",
            runner: Runner::PerProvider {
                kind: None,
                run: bandwidth,
            },
        },
        RowSpec {
            name: PINGPONG_BANDWIDTH,
            help: "pingpong at --bw-sizes as bandwidth, both directions counted: one invocation's pattern with no rfaas in it",
            runner: Runner::PerProvider {
                kind: None,
                run: pingpong_bandwidth,
            },
        },
        RowSpec {
            name: BANDWIDTH_PASSIVE,
            help: "bandwidth with the peer asleep in the kernel (shm and verbs place the data without it; tcp wakes it)",
            runner: Runner::PerProvider {
                kind: None,
                run: bandwidth_passive,
            },
        },
        RowSpec {
            name: PINGPONG_RATE,
            help: "the fabric's message rate: 64-byte writes-with-immediate the peer answers, 1, 4, 16 and 64 outstanding on one endpoint",
            runner: Runner::PerProvider {
                kind: None,
                run: pingpong_rate,
            },
        },
    ],
    peers: &[PeerSpec {
        name: ECHO,
        serve: serve_echo,
    }],
};

trait FabricContext<T> {
    fn ctx(self, what: impl FnOnce() -> String) -> Result<T>;
}

impl<T> FabricContext<T> for rfaas_fabric::Result<T> {
    fn ctx(self, what: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|e| Error::new(format!("{}: {e}", what())))
    }
}

/// Where a provider's peer listens.
pub(crate) fn listen_addr(provider: &Provider) -> Result<String> {
    Ok(match provider.kind {
        Kind::Shm => String::new(),
        Kind::Tcp | Kind::Verbs => format!("{}:0", provider.host()?),
    })
}

/// A connection to an echo peer, with the initiator's side set up.
struct Session {
    _fabric: Fabric,
    cq: CompletionQueue,
    ep: rfaas_fabric::Endpoint,
    src: rfaas_fabric::MemoryRegion,
    _reply: rfaas_fabric::MemoryRegion,
    remote: RemoteAddr,
    done: [Completion; 16],
    /// Receives consumed by answers and not yet posted again (their wr_ids).
    consumed: Vec<u64>,
}

impl Session {
    fn open(
        ctx: &Ctx,
        provider: &Provider,
        region_len: usize,
        mode: &str,
    ) -> Result<(crate::child::Peer, Session)> {
        let peer = ctx.spawn_peer(
            ECHO,
            &[
                provider.spec.clone(),
                listen_addr(provider)?,
                region_len.to_string(),
                mode.to_owned(),
            ],
            &[],
        )?;
        let announced: Vec<&str> = peer.addr().split_whitespace().collect();
        let [addr, raddr, rkey] = announced[..] else {
            return Err(Error::new(format!(
                "the {ECHO} peer announced {:?}, not `<addr> <region-addr> <rkey>`",
                peer.addr()
            )));
        };
        let remote = RemoteAddr {
            addr: raddr
                .parse()
                .map_err(|_| Error::new("bad region address from the peer"))?,
            rkey: rkey
                .parse()
                .map_err(|_| Error::new("bad rkey from the peer"))?,
        };
        let fabric = Fabric::open(&provider.spec).ctx(|| format!("opening {}", provider.spec))?;
        let domain = fabric.domain().ctx(|| "creating a domain".into())?;
        let mut cq = fabric
            .completion_queue(1024)
            .ctx(|| "creating a completion queue".into())?;
        let ep = domain
            .connect(addr, &mut cq, &EndpointOptions::default())
            .ctx(|| format!("connecting to the {ECHO} peer at {addr}"))?;
        let mut src = domain
            .register(region_len, Access::LOCAL)
            .ctx(|| "registering".into())?;
        let reply = domain
            .register(region_len, Access::REMOTE_WRITE)
            .ctx(|| "registering".into())?;
        let d = reply.descriptor();
        src.write_from(0, &d.addr.to_le_bytes());
        src.write_from(8, &d.rkey.to_le_bytes());
        for i in 0..RECVS {
            ep.post_recv(i).ctx(|| "posting a receive".into())?;
        }
        let mut session = Session {
            _fabric: fabric,
            cq,
            ep,
            src,
            _reply: reply,
            remote,
            done: [Completion::EMPTY; 16],
            consumed: Vec::with_capacity(RECVS as usize),
        };
        session.round_trip(12, SETUP)?;
        Ok((peer, session))
    }

    /// `calls` writes-with-immediate of `size` bytes and their answers, with
    /// `in_flight` outstanding: a new one goes out as each answer arrives.
    /// Hot loop of `pingpong_rate`.
    fn answered(&mut self, size: usize, in_flight: u32, calls: u64) -> Result<()> {
        let (mut posted, mut answered) = (0u64, 0u64);
        while answered < calls {
            while posted < calls && posted - answered < u64::from(in_flight) {
                match self
                    .ep
                    .write_with_imm(0, &self.src, 0, size, self.remote, 1)
                {
                    Ok(()) => posted += 1,
                    Err(e) if e.is_retryable() => break,
                    Err(e) => {
                        return Err(Error::new(format!("posting a write-with-immediate: {e}")))
                    }
                }
            }
            self.repost()?;
            let n = self.cq.poll(&mut self.done);
            for c in &self.done[..n] {
                if !c.status.is_ok() {
                    return Err(Error::new(format!("{:?} failed: {}", c.opcode, c.status)));
                }
                if c.opcode == Opcode::RecvWithImm {
                    self.consumed.push(c.wr_id);
                    answered += 1;
                }
            }
        }
        Ok(())
    }

    /// One write-with-immediate and the peer's answer. Hot loop of `pingpong`.
    #[inline]
    fn round_trip(&mut self, size: usize, imm: u32) -> Result<()> {
        self.ep
            .write_with_imm(0, &self.src, 0, size, self.remote, imm)
            .ctx(|| "posting a write-with-immediate".into())?;
        self.repost()?;
        let (mut sent, mut answered) = (false, false);
        while !(sent && answered) {
            let n = self.cq.poll(&mut self.done);
            for c in &self.done[..n] {
                if !c.status.is_ok() {
                    return Err(Error::new(format!("{:?} failed: {}", c.opcode, c.status)));
                }
                if c.opcode == Opcode::RecvWithImm {
                    self.consumed.push(c.wr_id);
                    answered = true;
                } else {
                    sent = true;
                }
            }
        }
        Ok(())
    }

    /// Posts again the receives answers consumed, while a message is on its
    /// way: off the round trip. At most [`RECVS`] are ever consumed.
    #[inline]
    fn repost(&mut self) -> Result<()> {
        while let Some(wr_id) = self.consumed.pop() {
            self.ep
                .post_recv(wr_id)
                .ctx(|| "posting a receive".into())?;
        }
        Ok(())
    }
}

fn pingpong(ctx: &Ctx, provider: &Provider, out: &mut Report) -> Result<()> {
    let max = ctx.sizes.iter().copied().max().unwrap_or(1).max(4096);
    let (peer, mut session) = Session::open(ctx, provider, max, "spin")?;
    for &size in &ctx.sizes {
        let summary = time_round_trips(ctx.warmup, ctx.iters, || session.round_trip(size, 1))?;
        out.push(&Row::latency(PINGPONG, &provider.spec, size, summary))?;
    }
    drop(session);
    drop(peer);
    Ok(())
}

fn pingpong_bandwidth(ctx: &Ctx, provider: &Provider, out: &mut Report) -> Result<()> {
    let max = ctx.bw_sizes.iter().copied().max().unwrap_or(1).max(4096);
    let (peer, mut s) = Session::open(ctx, provider, max, "spin")?;
    for &size in &ctx.bw_sizes {
        // Untimed first, as in `bandwidth`.
        for _ in 0..4 {
            s.round_trip(size, 1)?;
        }
        let calls = (ctx.bw_messages(size) / 2).max(8);
        let start = std::time::Instant::now();
        for _ in 0..calls {
            s.round_trip(size, 1)?;
        }
        let elapsed = start.elapsed();
        out.push(&Row::bandwidth(
            PINGPONG_BANDWIDTH,
            &provider.spec,
            size,
            2 * size as u64 * calls,
            elapsed,
        ))?;
    }
    drop(s);
    drop(peer);
    Ok(())
}

fn pingpong_rate(ctx: &Ctx, provider: &Provider, out: &mut Report) -> Result<()> {
    let (peer, mut s) = Session::open(ctx, provider, 4096, "spin")?;
    for in_flight in RATE_IN_FLIGHT {
        // Untimed first, as in the latency rows.
        s.answered(RATE_SIZE, in_flight, ctx.warmup as u64)?;
        let calls = ctx.rate_calls();
        let start = std::time::Instant::now();
        s.answered(RATE_SIZE, in_flight, calls)?;
        out.push(&Row::rate(
            PINGPONG_RATE,
            &provider.spec,
            RATE_SIZE,
            in_flight,
            calls,
            start.elapsed(),
        ))?;
    }
    drop(s);
    drop(peer);
    Ok(())
}

fn bandwidth(ctx: &Ctx, provider: &Provider, out: &mut Report) -> Result<()> {
    bandwidth_with(ctx, provider, BANDWIDTH, "spin", out)
}

fn bandwidth_passive(ctx: &Ctx, provider: &Provider, out: &mut Report) -> Result<()> {
    bandwidth_with(ctx, provider, BANDWIDTH_PASSIVE, "wait", out)
}

fn bandwidth_with(
    ctx: &Ctx,
    provider: &Provider,
    name: &str,
    mode: &str,
    out: &mut Report,
) -> Result<()> {
    let max = ctx.bw_sizes.iter().copied().max().unwrap_or(1).max(4096);
    let (peer, mut s) = Session::open(ctx, provider, max, mode)?;
    for &size in &ctx.bw_sizes {
        // Untimed first: faults the pages in on both sides and fetches
        // region grants, as the baselines' warm-up copy does.
        stream(&mut s, size, WINDOW as u64)?;
        s.round_trip(0, 2)?;
        let messages = ctx.bw_messages(size);
        let start = std::time::Instant::now();
        stream(&mut s, size, messages)?;
        s.round_trip(0, 2)?;
        let elapsed = start.elapsed();
        out.push(&Row::bandwidth(
            name,
            &provider.spec,
            size,
            messages * size as u64,
            elapsed,
        ))?;
    }
    drop(s);
    drop(peer);
    Ok(())
}

/// Writes `messages` messages of `size` bytes, `WINDOW` in flight.
fn stream(s: &mut Session, size: usize, messages: u64) -> Result<()> {
    let (mut posted, mut completed) = (0u64, 0u64);
    while completed < messages {
        while posted < messages && posted - completed < WINDOW as u64 {
            match s.ep.write(posted, &s.src, 0, size, s.remote) {
                Ok(()) => posted += 1,
                Err(e) if e.is_retryable() => break,
                Err(e) => return Err(Error::new(format!("posting a write: {e}"))),
            }
        }
        let n = s.cq.poll(&mut s.done);
        for c in &s.done[..n] {
            if !c.status.is_ok() {
                return Err(Error::new(format!("{:?} failed: {}", c.opcode, c.status)));
            }
            completed += 1;
        }
    }
    Ok(())
}

/// `--serve fabric_echo <provider> <listen-addr> <region-len> <spin|wait>`.
fn serve_echo(args: &[String], ready: Ready) -> Result<()> {
    let spec: String = peer_arg(args, 0, "provider")?;
    let listen: String = args.get(1).cloned().unwrap_or_default();
    let len: usize = peer_arg(args, 2, "region length")?;
    let spin = match args.get(3).map(String::as_str) {
        Some("spin") => true,
        Some("wait") => false,
        other => {
            return Err(Error::new(format!(
                "the echo mode must be spin or wait, not {other:?}"
            )))
        }
    };
    let fabric = Fabric::open(&spec).ctx(|| format!("opening {spec}"))?;
    let domain = fabric.domain().ctx(|| "creating a domain".into())?;
    let region = domain
        .register(len, Access::REMOTE_WRITE)
        .ctx(|| "registering the echo region".into())?;
    let listener = fabric
        .listen(&listen)
        .ctx(|| format!("listening on {listen:?}"))?;
    let d = region.descriptor();
    ready.announce(&format!("{} {} {}", listener.local_addr(), d.addr, d.rkey))?;
    let mut cq = fabric
        .completion_queue(1024)
        .ctx(|| "creating a completion queue".into())?;
    let ep = listener
        .accept(&domain, &mut cq, &EndpointOptions::default(), None)
        .ctx(|| "accepting the bench".into())?;
    for i in 0..RECVS {
        ep.post_recv(i).ctx(|| "posting a receive".into())?;
    }
    let mut reply = RemoteAddr::default();
    let mut done = [Completion::EMPTY; 16];
    loop {
        let n = if spin {
            cq.poll(&mut done)
        } else {
            cq.wait(&mut done, std::time::Duration::from_secs(1))
                .ctx(|| "waiting for completions".into())?
        };
        for c in &done[..n] {
            match (c.opcode, c.status.is_ok()) {
                (Opcode::RecvWithImm, true) => {
                    if c.imm == SETUP {
                        let mut b = [0; 12];
                        region.read_into(0, &mut b);
                        reply = RemoteAddr {
                            addr: u64::from_le_bytes(b[..8].try_into().unwrap_or_default()),
                            rkey: u32::from_le_bytes(b[8..12].try_into().unwrap_or_default()),
                        };
                    }
                    ep.write_with_imm(0, &region, 0, c.byte_len as usize, reply, c.imm)
                        .ctx(|| "answering".into())?;
                    // After the answer, off the round trip.
                    ep.post_recv(c.wr_id).ctx(|| "posting a receive".into())?;
                }
                (_, true) => {}
                // The bench went away: done.
                (_, false) => return Ok(()),
            }
        }
    }
}

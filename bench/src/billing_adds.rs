//! How many fetch-and-adds per second one counter region absorbs from
//! several initiators: through a real `rfaas-accounting`, and into a plain
//! fabric target, side by side, for every selected provider.
//!
//! | row | what is measured |
//! |---|---|
//! | `billing_adds` | adds into a real `rfaas-accounting`'s region (on the row's provider, with the manager on one SQLite file, see `services.rs`); each initiator says the hello with the accounting ticket the manager's registration reply gave the node and adds into the slot of a lease the manager granted it, as an executor daemon does |
//! | `raw_fetch_add` | the same initiators against a plain fabric target (`--serve fetch_add_target`): a process that registers one region with remote atomic rights, of the service's size, accepts connections and does nothing else; initiator `i` adds into slot `i` |
//!
//! Each round runs the baseline first, then the service's row (as
//! `hot_noop` runs before `hot_noop_billed`).
//!
//! Both rows run the same [`Initiator`]s, [`INITIATORS`] of them at a
//! time (1 and 4): threads of the bench, each with its own fabric,
//! domain, completion queue and endpoint, as that many executor daemons
//! would have. Each adds 1 into the seven usage words of its own slot in
//! turn (never `closed`), with [`WINDOW`] fetch-and-adds in flight: it
//! posts [`WINDOW`], then one more as each completes. After untimed adds
//! (`ctx.warmup`), the initiators start together and add for [`ADDING`]
//! (1 s); the row's rate is every initiator's adds over the time from
//! that start to the last one's last completion.
//! Before and after the timed adds each initiator reads its words (adds
//! of 0) and fails unless each grew by exactly the adds it made there.
//!
//! Who applies an add: on shm the initiator itself, on the page it maps
//! (the service's region is its file, the target's a memfd); on tcp the
//! target's fabric progress thread (software RDMA), in the service as in
//! the plain target; on verbs the NIC. The service's other threads (its
//! listener looks at each connection every 200 ms; its flusher writes the
//! slots that grew every second) run on the peers' CPU as the plain
//! target does, and the bench's initiators share the bench's CPU.

use std::sync::Barrier;
use std::time::{Duration, Instant};

use rfaas_client::lease::{Lease, LeaseRequest, Managers};
use rfaas_fabric::{
    page_size, Access, Completion, CompletionQueue, Domain, Endpoint, EndpointOptions, Fabric,
    MemoryRegion, Opcode, RemoteAddr,
};
use rfaas_proto::accounting::{
    region_len, word_offset, AccountingHello, AccountingReply, Counter, ReplyStatus, REPLY_IMM,
};
use rfaas_proto::ticket::AccountingTicket;
use rfaas_testkit::manager::Api;

use crate::child::{peer_arg, PeerSpec, Ready};
use crate::error::{Error, Result};
use crate::fabric_rows::listen_addr;
use crate::report::{Report, Row};
use crate::rows::{Ctx, Kind, Provider, RowSpec, Runner, Suite};
use crate::services::{billed_lease, Services};

const BILLING_ADDS: &str = "billing_adds";
const RAW_FETCH_ADD: &str = "raw_fetch_add";
const TARGET: &str = "fetch_add_target";

/// Initiators at once, one measurement each.
pub const INITIATORS: [u32; 2] = [1, 4];
/// Fetch-and-adds each initiator keeps in flight.
pub const WINDOW: u32 = 16;
/// Bytes one add changes: the `size` of the rows.
pub const ADD_SIZE: usize = 8;
/// Slots of the plain target's region: the service's
/// (`AccountingOptions::new`).
const TARGET_SLOTS: u32 = 64;
/// The words an initiator adds into, in turn: a slot's but `closed`,
/// which would end the lease's billing.
const WORDS: [Counter; 7] = [
    Counter::AllocMibMs,
    Counter::ComputeNs,
    Counter::HotNs,
    Counter::WarmNs,
    Counter::Invocations,
    Counter::BytesIn,
    Counter::BytesOut,
];

/// The manager's intervals: a site's, except that the bench's node, which
/// has no daemon to heartbeat, is not lost while the row runs.
const MANAGER_CONFIG: &str =
    "heartbeat_interval_ms = 1000\nlost_after_ms = 600000\nrefresh_ms = 1000\n";
/// The node the initiators add for.
const NODE_NAME: &str = "rfaas-bench-adds";

pub const SUITE: Suite = Suite {
    rows: &[
        RowSpec {
            name: RAW_FETCH_ADD,
            help: "fetch-and-adds per second from 1 and 4 initiators, 16 in flight each, into a plain fabric target that registers one atomic region and does nothing else: the fabric's own rate",
            runner: Runner::PerProvider {
                kind: None,
                run: raw_fetch_add,
            },
        },
        RowSpec {
            name: BILLING_ADDS,
            help: "the same initiators' fetch-and-adds into a real rfaas-accounting's region, each after the hello with the node's accounting ticket, into its lease's slot (next to raw_fetch_add)",
            runner: Runner::PerProvider {
                kind: None,
                run: billing_adds,
            },
        },
    ],
    peers: &[PeerSpec {
        name: TARGET,
        serve: serve_target,
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

/// How long each initiator adds in a measurement: a fixed count would
/// take seconds on tcp and milliseconds on shm.
const ADDING: Duration = Duration::from_secs(1);

/// Where one initiator adds.
#[derive(Debug, Clone)]
struct Target {
    /// The fabric address to connect to.
    addr: String,
    /// The slot it adds into.
    slot: u32,
    reach: Reach,
}

/// How an initiator learns where the region is.
#[derive(Debug, Clone)]
enum Reach {
    /// From the service's answer to a hello with this accounting ticket
    /// (its text).
    Hello(String),
    /// As the plain target announced it.
    Region(RemoteAddr),
}

fn billing_adds(ctx: &Ctx, provider: &Provider, out: &mut Report) -> Result<()> {
    let services = Services::start(ctx, provider, BILLING_ADDS, MANAGER_CONFIG)?;
    let manager = &services.manager;
    let most = INITIATORS.into_iter().max().unwrap_or(1);
    let node = manager.credential("node", NODE_NAME, None);
    let ticket = register_node(manager.url(), &node, provider, most)?;
    let user = manager.credential("user", "bench", Some("bench"));
    let managers = Managers::new([manager.url()], &user)
        .map_err(|e| Error::new(format!("{BILLING_ADDS}: the manager's URL: {e}")))?;
    // One lease per initiator, as one per executor daemon: each has its
    // own slot.
    let want = LeaseRequest {
        cores: 1,
        memory_mib: 64,
        duration_s: 3600,
        min_cores: None,
        nodes: vec![NODE_NAME.into()],
    };
    let mut leases: Vec<Lease> = Vec::new();
    let mut targets = Vec::new();
    for _ in 0..most {
        let (lease, part) = billed_lease(&managers, &want, BILLING_ADDS)?;
        let slot = part
            .billing
            .ok_or_else(|| Error::new(format!("{BILLING_ADDS}: a lease without its slot")))?;
        if slot.provider != provider.spec {
            return Err(Error::new(format!(
                "{BILLING_ADDS}: the lease's slot is on {}, not {}",
                slot.provider, provider.spec
            )));
        }
        targets.push(Target {
            addr: slot.addr,
            slot: slot.slot,
            reach: Reach::Hello(ticket.clone()),
        });
        leases.push(lease);
    }
    for n in INITIATORS {
        measure(ctx, provider, BILLING_ADDS, &targets[..n as usize], out)?;
    }
    // The flusher saw the slots grow: the adds were counted.
    services.wait_flushed(
        BILLING_ADDS,
        Duration::from_millis(5 * crate::services::FLUSH_INTERVAL_MS + 5_000),
        String::new,
    )?;
    for lease in leases {
        let _ = lease.release();
    }
    Ok(())
}

/// Registers [`NODE_NAME`] at the manager with the node credential
/// `node`, as its daemon would, lending `cores` cores; the accounting
/// ticket of the reply.
fn register_node(url: &str, node: &str, provider: &Provider, cores: u32) -> Result<String> {
    let host = match provider.kind {
        Kind::Shm => None,
        _ => Some(provider.host()?),
    };
    let body = serde_json::json!({
        "control_addr": "127.0.0.1:9",
        "providers": [{"name": provider.spec, "host": host}],
        "cores": cores,
        "memory_mib": 64 * u64::from(cores),
        "version": "bench",
    });
    let (status, reply) =
        Api::new(url, node).call("PUT", &format!("/v1/nodes/{NODE_NAME}"), Some(&body));
    if status != 200 {
        return Err(Error::new(format!(
            "{BILLING_ADDS}: registering the node answered {status}: {reply}"
        )));
    }
    reply["accounting_ticket"]
        .as_str()
        .map(str::to_owned)
        .ok_or_else(|| {
            Error::new(format!(
                "{BILLING_ADDS}: the manager's registration reply has no accounting ticket: {reply}"
            ))
        })
}

fn raw_fetch_add(ctx: &Ctx, provider: &Provider, out: &mut Report) -> Result<()> {
    let peer = ctx.spawn_peer(
        TARGET,
        &[
            provider.spec.clone(),
            listen_addr(provider)?,
            TARGET_SLOTS.to_string(),
        ],
        &[],
    )?;
    let announced: Vec<&str> = peer.addr().split_whitespace().collect();
    let [addr, raddr, rkey] = announced[..] else {
        return Err(Error::new(format!(
            "the {TARGET} peer announced {:?}, not `<addr> <region-addr> <rkey>`",
            peer.addr()
        )));
    };
    let region = RemoteAddr {
        addr: raddr
            .parse()
            .map_err(|_| Error::new("bad region address from the peer"))?,
        rkey: rkey
            .parse()
            .map_err(|_| Error::new("bad rkey from the peer"))?,
    };
    let most = INITIATORS.into_iter().max().unwrap_or(1);
    let targets: Vec<Target> = (0..most)
        .map(|slot| Target {
            addr: addr.to_owned(),
            slot,
            reach: Reach::Region(region),
        })
        .collect();
    for n in INITIATORS {
        measure(ctx, provider, RAW_FETCH_ADD, &targets[..n as usize], out)?;
    }
    peer.finish()
}

/// One measurement: an initiator per target, started together.
fn measure(
    ctx: &Ctx,
    provider: &Provider,
    name: &str,
    targets: &[Target],
    out: &mut Report,
) -> Result<()> {
    let n = targets.len() as u64;
    let start = Barrier::new(targets.len() + 1);
    let (results, elapsed) = std::thread::scope(|scope| {
        let handles: Vec<_> = targets
            .iter()
            .map(|target| {
                let start = &start;
                scope.spawn(move || -> Result<(u64, Instant)> {
                    let ready = (|| {
                        let mut init = Initiator::open(provider, target)?;
                        init.add_ones(ctx.warmup as u64, None)?;
                        let before = init.read_words()?;
                        Ok((init, before))
                    })();
                    start.wait();
                    let (mut init, before) = ready?;
                    let added = init.add_ones(u64::MAX, Some(Instant::now() + ADDING))?;
                    let end = Instant::now();
                    init.check_grown(&before, added)?;
                    Ok((added, end))
                })
            })
            .collect();
        start.wait();
        let t0 = Instant::now();
        let mut end = t0;
        let mut results = Vec::new();
        for h in handles {
            let r = h
                .join()
                .unwrap_or_else(|_| Err(Error::new("an initiator thread panicked")));
            if let Ok((_, done)) = &r {
                end = end.max(*done);
            }
            results.push(r);
        }
        (results, end - t0)
    });
    let mut added = 0;
    for r in results {
        added += r
            .map_err(|e| Error::new(format!("{name} on {}: {e}", provider.spec)))?
            .0;
    }
    out.push(
        &Row::rate(name, &provider.spec, ADD_SIZE, WINDOW, added, elapsed).with("initiators", n),
    )
}

/// Where the hello's answer lands in an initiator's buffer.
const REPLY_OFF: usize = 0;
/// Where reads of the words land.
const READ_OFF: usize = 64;
/// Where the old values of the timed adds land, one word per add in
/// flight.
const FAA_OFF: usize = 128;
const LOCAL_LEN: usize = 4096;
const REPLY_WR: u64 = u64::MAX;
/// How long connecting, the hello and reading the words may take.
const TIMEOUT: Duration = Duration::from_secs(10);

/// One initiator: its own fabric, domain, completion queue and endpoint,
/// connected to a target, adding into one slot. Fields drop in order: the
/// endpoint before its queue and memory.
struct Initiator {
    ep: Endpoint,
    cq: CompletionQueue,
    local: MemoryRegion,
    _domain: Domain,
    _fabric: Fabric,
    /// The slot's words, in [`WORDS`] order.
    words: [RemoteAddr; WORDS.len()],
    done: [Completion; 32],
}

impl Initiator {
    /// Connects to `target`; says the hello first where the target is the
    /// service.
    fn open(provider: &Provider, target: &Target) -> Result<Initiator> {
        let fabric = Fabric::open(&provider.spec).ctx(|| format!("opening {}", provider.spec))?;
        let domain = fabric.domain().ctx(|| "creating a domain".into())?;
        let mut cq = fabric
            .completion_queue(256)
            .ctx(|| "creating a completion queue".into())?;
        // The service's answer is written here.
        let local = domain
            .register(LOCAL_LEN, Access::REMOTE_WRITE)
            .ctx(|| "registering".into())?;
        // As the executor daemon's link to the service.
        let opts = EndpointOptions {
            send_depth: 128,
            recv_depth: 4,
            connect_timeout: TIMEOUT,
            map_file_regions: true,
            ..EndpointOptions::default()
        };
        let ep = domain
            .connect(&target.addr, &mut cq, &opts)
            .ctx(|| format!("connecting to {}", target.addr))?;
        let mut init = Initiator {
            ep,
            cq,
            local,
            _domain: domain,
            _fabric: fabric,
            words: [RemoteAddr::default(); WORDS.len()],
            done: [Completion::EMPTY; 32],
        };
        let region = match &target.reach {
            Reach::Region(r) => *r,
            Reach::Hello(ticket) => init.hello(ticket, target.slot)?,
        };
        for (w, c) in init.words.iter_mut().zip(WORDS) {
            *w = RemoteAddr {
                addr: region.addr.wrapping_add(word_offset(target.slot, c)),
                rkey: region.rkey,
            };
        }
        Ok(init)
    }

    /// Says the hello with `ticket` (its text); the region the accepted
    /// answer names, which must hold `slot`.
    fn hello(&mut self, ticket: &str, slot: u32) -> Result<RemoteAddr> {
        let reply_to = self.local.descriptor().at(REPLY_OFF as u64);
        let ticket = AccountingTicket::from_text(ticket)
            .map_err(|e| Error::new(format!("the manager's accounting ticket: {e}")))?;
        let imms = AccountingHello {
            reply_addr: reply_to.addr,
            reply_rkey: reply_to.rkey,
            ticket,
        }
        .to_imms()
        .map_err(|e| Error::new(format!("the hello cannot be encoded: {e}")))?;
        self.ep
            .post_recv(REPLY_WR)
            .ctx(|| "posting the answer's receive".into())?;
        let nowhere = RemoteAddr { addr: 0, rkey: 0 };
        for (i, &imm) in imms.iter().enumerate() {
            self.ep
                .write_with_imm(i as u64, &self.local, 0, 0, nowhere, imm)
                .ctx(|| "sending the hello".into())?;
        }
        let deadline = Instant::now() + TIMEOUT;
        let (mut sent, mut answered) = (0, false);
        while sent < imms.len() || !answered {
            let c = self.next(deadline, "the hello's answer")?;
            match (c.opcode, c.status.is_ok()) {
                (Opcode::WriteWithImm, true) => sent += 1,
                (Opcode::RecvWithImm, true) if c.imm == REPLY_IMM => answered = true,
                (op, _) => {
                    return Err(Error::new(format!(
                        "the hello failed: {op:?} {} (the service dropped the connection)",
                        c.status
                    )))
                }
            }
        }
        let mut b = [0u8; AccountingReply::LEN];
        self.local.read_into(REPLY_OFF, &mut b);
        let reply = AccountingReply::decode(&b)
            .map_err(|e| Error::new(format!("the service's answer is garbled: {e}")))?;
        if reply.status != ReplyStatus::Accepted {
            return Err(Error::new(format!(
                "the service refused the hello: {}",
                reply.status.describe()
            )));
        }
        if slot >= reply.slots {
            return Err(Error::new(format!(
                "slot {slot} is beyond the service's {} slots",
                reply.slots
            )));
        }
        Ok(RemoteAddr {
            addr: reply.region_addr,
            rkey: reply.region_rkey,
        })
    }

    /// The next completion, waiting up to `deadline`.
    fn next(&mut self, deadline: Instant, what: &str) -> Result<Completion> {
        let mut one = [Completion::EMPTY; 1];
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::new(format!("{what} did not complete in time")));
            }
            let n = self
                .cq
                .wait(&mut one, left.min(Duration::from_millis(100)))
                .ctx(|| "waiting for completions".into())?;
            if n == 1 {
                return Ok(one[0]);
            }
        }
    }

    /// Adds of 1, add `k` into word `k % 7`, [`WINDOW`] in flight: one is
    /// posted as each completes, until `count` are posted or, with
    /// `until`, that moment has passed. Returns how many were made, all
    /// completed. Hot loop of both rows.
    fn add_ones(&mut self, mut count: u64, until: Option<Instant>) -> Result<u64> {
        let window = u64::from(WINDOW);
        let (mut posted, mut done, mut look) = (0u64, 0u64, 0u64);
        while done < count {
            // The clock is read once per window's worth of adds.
            if let Some(t) = until.filter(|_| posted >= look) {
                look = posted + window;
                if Instant::now() >= t {
                    count = posted;
                }
            }
            while posted < count && posted - done < window {
                let word = self.words[(posted % WORDS.len() as u64) as usize];
                let at = FAA_OFF + 8 * (posted % window) as usize;
                match self.ep.fetch_add(posted, &self.local, at, word, 1) {
                    Ok(()) => posted += 1,
                    Err(e) if e.is_retryable() => break,
                    Err(e) => return Err(Error::new(format!("posting a fetch-and-add: {e}"))),
                }
            }
            let n = self.cq.poll(&mut self.done);
            for c in &self.done[..n] {
                if !c.status.is_ok() {
                    return Err(Error::new(format!("a fetch-and-add failed: {}", c.status)));
                }
            }
            done += n as u64;
        }
        Ok(done)
    }

    /// The slot's words now (adds of 0).
    fn read_words(&mut self) -> Result<[u64; WORDS.len()]> {
        for (i, word) in self.words.iter().enumerate() {
            self.ep
                .fetch_add(i as u64, &self.local, READ_OFF + 8 * i, *word, 0)
                .ctx(|| "posting a read of a word".into())?;
        }
        let deadline = Instant::now() + TIMEOUT;
        for _ in 0..WORDS.len() {
            let c = self.next(deadline, "reading the words")?;
            if !c.status.is_ok() {
                return Err(Error::new(format!("reading a word failed: {}", c.status)));
            }
        }
        Ok(std::array::from_fn(|i| {
            self.local.read_u64(READ_OFF + 8 * i)
        }))
    }

    /// Fails unless each word grew from `before` by the adds of an
    /// [`add_ones`](Self::add_ones) that made `count`.
    fn check_grown(&mut self, before: &[u64; WORDS.len()], count: u64) -> Result<()> {
        let after = self.read_words()?;
        let n = WORDS.len() as u64;
        for (i, c) in WORDS.iter().enumerate() {
            let want = count / n + u64::from((i as u64) < count % n);
            let got = after[i].wrapping_sub(before[i]);
            if got != want {
                return Err(Error::new(format!(
                    "word {} of the slot grew by {got}, but {want} adds of 1 went there",
                    c.name()
                )));
            }
        }
        Ok(())
    }
}

/// `--serve fetch_add_target <provider> <listen-addr> <slots>`: registers
/// a region of `slots` slots with remote atomic rights, announces
/// `<addr> <region-addr> <rkey>`, and accepts connections, each with a
/// completion queue of its own (as the service does), until killed. It
/// never polls: on tcp the fabric's progress thread applies the adds.
fn serve_target(args: &[String], ready: Ready) -> Result<()> {
    let spec: String = peer_arg(args, 0, "provider")?;
    let listen: String = args.get(1).cloned().unwrap_or_default();
    let slots: u32 = peer_arg(args, 2, "slot count")?;
    let fabric = Fabric::open(&spec).ctx(|| format!("opening {spec}"))?;
    let domain = fabric.domain().ctx(|| "creating a domain".into())?;
    let len = (region_len(slots) as usize).div_ceil(page_size()) * page_size();
    let region = domain
        .register(len, Access::REMOTE_ATOMIC)
        .ctx(|| "registering the region".into())?;
    let listener = fabric
        .listen(&listen)
        .ctx(|| format!("listening on {listen:?}"))?;
    let d = region.descriptor();
    ready.announce(&format!("{} {} {}", listener.local_addr(), d.addr, d.rkey))?;
    let mut kept = Vec::new();
    loop {
        let opts = EndpointOptions::default();
        let mut cq = fabric
            .completion_queue(opts.send_depth + opts.recv_depth)
            .ctx(|| "creating a completion queue".into())?;
        match listener.accept(&domain, &mut cq, &opts, None) {
            Ok(ep) => kept.push((ep, cq)),
            Err(e) if e.is_retryable() => {}
            Err(e) => return Err(Error::new(format!("accepting: {e}"))),
        }
    }
}

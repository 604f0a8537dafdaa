//! The poster against a small accounting peer on the tcp provider: a
//! region registered for atomics and reads, and the hello's check.

use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;

use rfaas_fabric::{Access, Completion, Endpoint, EndpointOptions, MemoryRegion, Opcode};
use rfaas_proto::accounting::{
    region_len, word_offset, AccountingHello, AccountingReply, ReplyStatus, HELLO_IMMS, REPLY_IMM,
};

use rfaas_testkit::wait::{wait_until, TIMEOUT};

use super::*;
use rfaas_proto::accounting::UsageFigures;

/// The node whose ticket the peer accepts.
const CREDENTIAL: &str = "node1";

/// A ticket for `node`, as a manager's reply carries one (the peer reads
/// its node; the real service checks its signature).
fn tickets(node: &str) -> Arc<Tickets> {
    let signer = rfaas_proto::lease::LeaseSigner::from_seed("k1", [5; 32]).unwrap();
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let claims = rfaas_proto::ticket::TicketClaims {
        key_id: String::new(),
        node: node.into(),
        credential_id: "0a".into(),
        issued_at: now,
        expires_at: now + 600,
    };
    let t = Arc::new(Tickets::default());
    t.set(AccountingTicket::sign(&signer, &claims).unwrap());
    t
}
const SLOTS: u32 = 16;

/// An accounting peer: accepts connections, checks the hello, answers,
/// and keeps the accepted endpoints until told to drop them.
struct Peer {
    addr: String,
    region: Arc<MemoryRegion>,
    stop: Arc<AtomicBool>,
    drop_all: mpsc::Sender<()>,
    /// How many times the peer dropped every connection it held.
    dropped: Arc<AtomicU32>,
    refused: Arc<Mutex<u32>>,
    thread: Option<JoinHandle<()>>,
}

impl Peer {
    fn start() -> Peer {
        let fabric = Fabric::open("tcp").unwrap();
        let listener = fabric.listen("127.0.0.1:0").unwrap();
        let addr = listener.local_addr();
        let domain = fabric.domain().unwrap();
        let region = Arc::new(
            domain
                .register(
                    region_len(SLOTS) as usize,
                    Access::REMOTE_ATOMIC | Access::REMOTE_READ,
                )
                .unwrap(),
        );
        let mut scratch = domain.register(4096, Access::LOCAL).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let refused = Arc::new(Mutex::new(0));
        let (drop_all, drops) = mpsc::channel();
        let dropped = Arc::new(AtomicU32::new(0));
        let thread = {
            let (region, stop, refused, dropped) = (
                region.clone(),
                stop.clone(),
                refused.clone(),
                dropped.clone(),
            );
            std::thread::spawn(move || {
                let mut cq = fabric.completion_queue(1024).unwrap();
                let opts = EndpointOptions {
                    recv_depth: HELLO_IMMS,
                    ..EndpointOptions::default()
                };
                let mut kept: Vec<Endpoint> = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    if drops.try_recv().is_ok() {
                        kept.clear();
                        dropped.fetch_add(1, Ordering::Relaxed);
                    }
                    let Ok(ep) =
                        listener.accept(&domain, &mut cq, &opts, Some(Duration::from_millis(50)))
                    else {
                        continue;
                    };
                    for i in 0..HELLO_IMMS {
                        ep.post_recv(i as u64).unwrap();
                    }
                    let mut imms = [0u32; HELLO_IMMS];
                    let mut got = 0;
                    let mut out = [Completion::EMPTY; 64];
                    let deadline = Instant::now() + Duration::from_secs(5);
                    while got < HELLO_IMMS && Instant::now() < deadline {
                        let n = cq.wait(&mut out, Duration::from_millis(50)).unwrap();
                        for c in &out[..n] {
                            if c.opcode == Opcode::RecvWithImm && c.status.is_ok() {
                                imms[got] = c.imm;
                                got += 1;
                            }
                        }
                    }
                    let hello = AccountingHello::from_imms(&imms).unwrap();
                    let node = hello.ticket.claims_unverified().map(|c| c.node);
                    let reply = if node.as_deref() == Ok(CREDENTIAL) {
                        let d = region.descriptor();
                        AccountingReply {
                            status: ReplyStatus::Accepted,
                            region_addr: d.addr,
                            region_rkey: d.rkey,
                            slots: SLOTS,
                            region_id: 77,
                        }
                    } else {
                        *refused.lock().unwrap() += 1;
                        AccountingReply::refused(ReplyStatus::BadCredential)
                    };
                    let mut b = [0u8; AccountingReply::LEN];
                    reply.encode(&mut b).unwrap();
                    scratch.write_from(0, &b);
                    let to = rfaas_fabric::RemoteAddr {
                        addr: hello.reply_addr,
                        rkey: hello.reply_rkey,
                    };
                    ep.write_with_imm(999, &scratch, 0, AccountingReply::LEN, to, REPLY_IMM)
                        .unwrap();
                    kept.push(ep);
                }
            })
        };
        Peer {
            addr,
            region,
            stop,
            drop_all,
            dropped,
            refused,
            thread: Some(thread),
        }
    }

    fn word(&self, slot: u32, c: Counter) -> u64 {
        self.region.read_u64(word_offset(slot, c) as usize)
    }

    fn slot(&self, name: &str, slot: u32) -> BillingSlot {
        BillingSlot {
            instance: name.into(),
            provider: "tcp".into(),
            addr: self.addr.clone(),
            slot,
        }
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A fresh journal path, removed with its directory when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Scratch {
        let dir = std::env::temp_dir().join(format!("rfaas-billing-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }

    fn journal(&self) -> PathBuf {
        self.0.join("billing.jsonl")
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn settings(journal: Option<PathBuf>, node: &str) -> PosterSettings {
    PosterSettings {
        granularity: Duration::from_secs(1),
        keep_ended: Duration::from_secs(300),
        timeout: Duration::from_secs(5),
        journal,
        tickets: tickets(node),
        carry: None,
    }
}

fn usage(
    id: u64,
    slot: &BillingSlot,
    compute_ns: u64,
    invocations: u64,
    ended: bool,
) -> LeaseUsage {
    LeaseUsage {
        lease_id: id,
        billing: slot.clone(),
        totals: SlotTotals {
            usage: UsageFigures {
                alloc_mib_ms: compute_ns / 1000,
                compute_ns,
                invocations,
                ..UsageFigures::default()
            },
            closed: 0,
        },
        ended,
    }
}

/// Sums the journal's `added` lines per lease and counter, and lists the
/// closed leases.
fn journal_sums(path: &std::path::Path) -> (HashMap<(u64, String), u64>, Vec<u64>) {
    let mut sums = HashMap::new();
    let mut closed = Vec::new();
    for line in std::fs::read_to_string(path).unwrap().lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        let id = v["lease_id"].as_u64().unwrap();
        if let Some(added) = v["added"].as_object() {
            for (k, n) in added {
                *sums.entry((id, k.clone())).or_insert(0) += n.as_u64().unwrap();
            }
        }
        if v["closed"] == serde_json::Value::Bool(true) {
            closed.push(id);
        }
    }
    (sums, closed)
}

#[test]
fn deltas_land_once_per_granularity_and_close_at_the_end() {
    let peer = Peer::start();
    let dir = Scratch::new("close");
    let journal = dir.journal();
    let mut p = Poster::new(settings(Some(journal.clone()), CREDENTIAL)).unwrap();
    let slot = peer.slot("acct1", 3);
    let t0 = Instant::now();

    p.tick(&[usage(1, &slot, 5_000, 2, false)], t0);
    assert_eq!(peer.word(3, Counter::ComputeNs), 5_000);
    assert_eq!(peer.word(3, Counter::Invocations), 2);
    assert_eq!(peer.word(3, Counter::AllocMibMs), 5);

    // Within the granularity nothing more is posted.
    p.tick(
        &[usage(1, &slot, 9_000, 3, false)],
        t0 + Duration::from_millis(500),
    );
    assert_eq!(peer.word(3, Counter::ComputeNs), 5_000);
    // After it, the delta.
    p.tick(
        &[usage(1, &slot, 9_000, 3, false)],
        t0 + Duration::from_millis(1100),
    );
    assert_eq!(peer.word(3, Counter::ComputeNs), 9_000);
    assert_eq!(peer.word(3, Counter::Invocations), 3);
    assert_eq!(peer.word(3, Counter::Closed), 0);

    // A figure that goes down (a worker scribbling) is ignored.
    p.tick(
        &[usage(1, &slot, 100, 1, false)],
        t0 + Duration::from_millis(2200),
    );
    assert_eq!(peer.word(3, Counter::ComputeNs), 9_000);

    // The end posts at once, then closes, and the lease is forgotten.
    p.tick(
        &[usage(1, &slot, 12_000, 4, true)],
        t0 + Duration::from_millis(2300),
    );
    assert_eq!(peer.word(3, Counter::ComputeNs), 12_000);
    assert_eq!(peer.word(3, Counter::Closed), 1);
    assert!(p.is_idle());
    assert_eq!(p.stats().closed, 1);
    // The figures still list the ended lease for a while: it is not posted
    // or closed again.
    p.tick(
        &[usage(1, &slot, 12_000, 4, true)],
        t0 + Duration::from_millis(3400),
    );
    assert_eq!(peer.word(3, Counter::ComputeNs), 12_000);
    assert_eq!(peer.word(3, Counter::Closed), 1);
    assert!(p.is_idle());
    // Other slots are untouched.
    assert_eq!(peer.word(2, Counter::ComputeNs), 0);
    assert_eq!(peer.word(4, Counter::ComputeNs), 0);

    let (sums, closed) = journal_sums(&journal);
    assert_eq!(sums[&(1, "compute_ns".to_string())], 12_000);
    assert_eq!(sums[&(1, "invocations".to_string())], 4);
    assert_eq!(closed, vec![1]);
}

#[test]
fn a_slot_that_held_adds_before_is_added_to_not_overwritten() {
    let peer = Peer::start();
    let slot = peer.slot("acct1", 5);
    // A daemon before a restart added 1000 into this lease's slot.
    let mut before = Poster::new(settings(None, CREDENTIAL)).unwrap();
    before.tick(&[usage(9, &slot, 1_000, 1, false)], Instant::now());
    drop(before);
    let mut after = Poster::new(settings(None, CREDENTIAL)).unwrap();
    after.tick(&[usage(9, &slot, 300, 1, false)], Instant::now());
    assert_eq!(peer.word(5, Counter::ComputeNs), 1_300);
    assert_eq!(peer.word(5, Counter::Invocations), 2);
}

#[test]
fn a_lost_connection_keeps_the_usage_and_posts_it_once_when_back() {
    let peer = Peer::start();
    let dir = Scratch::new("lost");
    let journal = dir.journal();
    let mut p = Poster::new(settings(Some(journal.clone()), CREDENTIAL)).unwrap();
    let slot = peer.slot("acct1", 7);
    let mut now = Instant::now();
    p.tick(&[usage(2, &slot, 1_000, 1, false)], now);
    assert_eq!(peer.word(7, Counter::ComputeNs), 1_000);

    // The service drops every connection: the next post fails, and the
    // usage stays with the daemon.
    peer.drop_all.send(()).unwrap();
    wait_until("the peer to drop its connections", TIMEOUT, || {
        peer.dropped.load(Ordering::Relaxed) == 1
    });
    now += Duration::from_secs(2);
    p.tick(&[usage(2, &slot, 3_000, 2, false)], now);
    assert_eq!(p.stats().pending, 1);
    assert_eq!(
        peer.word(7, Counter::ComputeNs),
        1_000,
        "an add went through a dropped connection"
    );
    // Back after the backoff: read the slot, post what did not land, once.
    for _ in 0..20 {
        now += Duration::from_secs(11);
        p.tick(&[usage(2, &slot, 3_000, 2, true)], now);
        if p.is_idle() {
            break;
        }
    }
    assert!(
        p.is_idle(),
        "the lease was never posted after the service came back"
    );
    assert_eq!(peer.word(7, Counter::ComputeNs), 3_000);
    assert_eq!(peer.word(7, Counter::Invocations), 2);
    assert_eq!(peer.word(7, Counter::Closed), 1);
    let (sums, _) = journal_sums(&journal);
    assert_eq!(sums[&(2, "compute_ns".to_string())], 3_000);
}

#[test]
fn a_refused_credential_learns_nothing_and_adds_nothing() {
    let peer = Peer::start();
    let mut p = Poster::new(settings(None, "node2")).unwrap();
    let slot = peer.slot("acct1", 1);
    p.tick(&[usage(3, &slot, 1_000, 1, false)], Instant::now());
    assert_eq!(*peer.refused.lock().unwrap(), 1);
    assert_eq!(peer.word(1, Counter::ComputeNs), 0);
    assert_eq!(p.stats().pending, 1);
}

/// Before a manager gave the node a ticket, the poster connects to
/// nobody: it has nothing to show but its credential, which never
/// crosses the fabric.
#[test]
fn without_a_ticket_nothing_connects() {
    let peer = Peer::start();
    let mut p = Poster::new(PosterSettings {
        tickets: Arc::new(Tickets::default()),
        ..settings(None, CREDENTIAL)
    })
    .unwrap();
    let slot = peer.slot("acct1", 1);
    p.tick(&[usage(3, &slot, 1_000, 1, false)], Instant::now());
    assert_eq!(*peer.refused.lock().unwrap(), 0);
    assert_eq!(peer.word(1, Counter::ComputeNs), 0);
    assert_eq!(p.stats().pending, 1);
}

#[test]
fn an_ended_lease_unposted_past_keep_ended_is_dropped_and_journaled() {
    let dir = Scratch::new("dropped");
    let journal = dir.journal();
    let mut p = Poster::new(settings(Some(journal.clone()), CREDENTIAL)).unwrap();
    // Nobody listens at this address.
    let slot = BillingSlot {
        instance: "gone".into(),
        provider: "tcp".into(),
        addr: "127.0.0.1:1".into(),
        slot: 0,
    };
    let t0 = Instant::now();
    p.tick(&[usage(4, &slot, 1_000, 1, true)], t0);
    assert_eq!(p.stats().pending, 1);
    p.tick(&[], t0 + Duration::from_secs(301));
    assert!(p.is_idle());
    assert_eq!(p.stats().dropped, 1);
    let text = std::fs::read_to_string(&journal).unwrap();
    assert!(text.contains("\"dropped\":{"), "{text}");
    assert!(text.contains("\"compute_ns\":1000"), "{text}");
}

#[test]
fn landed_counts_what_the_slot_gained_up_to_the_batch() {
    let expected = SlotTotals {
        usage: UsageFigures {
            compute_ns: 100,
            hot_ns: 50,
            ..UsageFigures::default()
        },
        closed: 0,
    };
    let read = SlotTotals {
        usage: UsageFigures {
            compute_ns: 130,
            hot_ns: 50,
            ..UsageFigures::default()
        },
        closed: 0,
    };
    let mut d = [0u64; SLOT_WORDS];
    d[Counter::ComputeNs.index()] = 30;
    d[Counter::HotNs.index()] = 20;
    let l = landed(&expected, &read, &d);
    assert_eq!(l[Counter::ComputeNs.index()], 30);
    assert_eq!(l[Counter::HotNs.index()], 0);
}

#[test]
fn a_flush_posts_everything_now_and_closes_nothing() {
    let peer = Peer::start();
    let mut p = Poster::new(settings(None, CREDENTIAL)).unwrap();
    let slot = peer.slot("acct1", 8);
    let t0 = Instant::now();
    p.tick(&[usage(5, &slot, 1_000, 1, false)], t0);
    p.flush(
        &[usage(5, &slot, 1_500, 2, false)],
        t0 + Duration::from_millis(10),
    );
    assert_eq!(peer.word(8, Counter::ComputeNs), 1_500);
    assert_eq!(peer.word(8, Counter::Closed), 0);
    assert_eq!(p.stats().pending, 1);
}

#[test]
fn a_journal_cut_short_mid_line_gets_whole_lines_after_it() {
    let peer = Peer::start();
    let dir = Scratch::new("torn");
    let journal = dir.journal();
    // A daemon killed in the middle of writing a line.
    std::fs::write(&journal, "{\"at_ms\":1,\"lease_id\":6,\"add").unwrap();
    let mut p = Poster::new(settings(Some(journal.clone()), CREDENTIAL)).unwrap();
    let slot = peer.slot("acct1", 9);
    p.tick(&[usage(6, &slot, 2_000, 1, false)], Instant::now());
    let text = std::fs::read_to_string(&journal).unwrap();
    let mut lines = text.lines();
    assert_eq!(lines.next(), Some("{\"at_ms\":1,\"lease_id\":6,\"add"));
    let rest: Vec<serde_json::Value> = lines
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l:?}")))
        .collect();
    assert!(!rest.is_empty());
    assert!(text.ends_with('\n'));
    assert_eq!(rest.last().unwrap()["added"]["compute_ns"], 2_000);
}

/// The journal's lines of `key` (`recovered`, `unresolved`, ...) for
/// lease `id`.
fn lines_with(path: &std::path::Path, id: u64, key: &str) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| v["lease_id"] == id && v.get(key).is_some())
        .collect()
}

/// A daemon that posted lease `id` once, then died during its second
/// batch as `crash` says; returns the slot.
fn die_during_a_batch(
    peer: &Peer,
    journal: &std::path::Path,
    id: u64,
    crash: Crash,
) -> BillingSlot {
    let slot = peer.slot("acct1", id as u32);
    let t0 = Instant::now();
    let mut p = Poster::new(settings(Some(journal.to_owned()), CREDENTIAL)).unwrap();
    p.tick(&[usage(id, &slot, 1_000, 1, false)], t0);
    p.crash = Some(crash);
    p.tick(
        &[usage(id, &slot, 4_000, 3, false)],
        t0 + Duration::from_secs(2),
    );
    slot
}

#[test]
fn a_batch_that_landed_before_its_journal_line_is_journaled_at_restart() {
    let peer = Peer::start();
    let dir = Scratch::new("recover-landed");
    let journal = dir.journal();
    let slot = die_during_a_batch(&peer, &journal, 10, Crash::AfterAdd);
    // The slot holds the batch; the journal does not say so yet.
    assert_eq!(peer.word(10, Counter::ComputeNs), 4_000);
    assert_eq!(
        journal_sums(&journal).0[&(10, "compute_ns".to_string())],
        1_000
    );

    let mut after = Poster::new(settings(Some(journal.clone()), CREDENTIAL)).unwrap();
    after.tick(&[], Instant::now());
    let (sums, _) = journal_sums(&journal);
    assert_eq!(sums[&(10, "compute_ns".to_string())], 4_000);
    assert_eq!(sums[&(10, "invocations".to_string())], 3);
    assert_eq!(sums[&(10, "alloc_mib_ms".to_string())], 4);
    assert_eq!(lines_with(&journal, 10, "recovered").len(), 1);
    drop(after);

    // Resolved once: the next start reads nothing again. The lease
    // allocating again adds on top.
    let mut again = Poster::new(settings(Some(journal.clone()), CREDENTIAL)).unwrap();
    again.tick(&[usage(10, &slot, 500, 1, false)], Instant::now());
    assert_eq!(peer.word(10, Counter::ComputeNs), 4_500);
    let (sums, _) = journal_sums(&journal);
    assert_eq!(sums[&(10, "compute_ns".to_string())], 4_500);
    assert_eq!(lines_with(&journal, 10, "recovered").len(), 1);
}

#[test]
fn a_batch_that_never_left_is_journaled_as_nothing_at_restart() {
    let peer = Peer::start();
    let dir = Scratch::new("recover-none");
    let journal = dir.journal();
    die_during_a_batch(&peer, &journal, 11, Crash::BeforeAdd);
    assert_eq!(peer.word(11, Counter::ComputeNs), 1_000);
    assert_eq!(lines_with(&journal, 11, "posting").len(), 2);

    let mut after = Poster::new(settings(Some(journal.clone()), CREDENTIAL)).unwrap();
    after.tick(&[], Instant::now());
    let (sums, _) = journal_sums(&journal);
    assert_eq!(sums[&(11, "compute_ns".to_string())], 1_000);
    let recovered = lines_with(&journal, 11, "recovered");
    assert_eq!(recovered.len(), 1);
    assert_eq!(recovered[0]["added"]["compute_ns"], 0);
    assert_eq!(peer.word(11, Counter::ComputeNs), 1_000);
}

#[test]
fn a_batch_too_old_to_read_is_journaled_unresolved() {
    let peer = Peer::start();
    let dir = Scratch::new("recover-old");
    let journal = dir.journal();
    die_during_a_batch(&peer, &journal, 12, Crash::AfterAdd);
    // The clock is the subject: the batch must be older than keep_ended
    // (zero here), so the wall clock must have passed its millisecond.
    let journaled = unix_ms();
    wait_until(
        "the wall clock to pass the batch's millisecond",
        TIMEOUT,
        || unix_ms() > journaled,
    );
    let mut after = Poster::new(PosterSettings {
        keep_ended: Duration::ZERO,
        ..settings(Some(journal.clone()), CREDENTIAL)
    })
    .unwrap();
    after.tick(&[], Instant::now());
    let unresolved = lines_with(&journal, 12, "unresolved");
    assert_eq!(unresolved.len(), 1);
    assert_eq!(unresolved[0]["unresolved"]["compute_ns"], 3_000);
    assert_eq!(
        journal_sums(&journal).0[&(12, "compute_ns".to_string())],
        1_000
    );
    assert!(lines_with(&journal, 12, "recovered").is_empty());
}

#[test]
fn the_journal_is_created_private_and_never_through_a_link() {
    use std::os::unix::fs::PermissionsExt;
    let dir = Scratch::new("journal-link");
    let journal = dir.journal();
    drop(Poster::new(settings(Some(journal.clone()), CREDENTIAL)).unwrap());
    let mode = std::fs::metadata(&journal).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);

    let target = dir.0.join("elsewhere");
    std::fs::write(&target, "").unwrap();
    let link = dir.0.join("linked.jsonl");
    std::os::unix::fs::symlink(&target, &link).unwrap();
    let e = Poster::new(settings(Some(link), CREDENTIAL))
        .err()
        .expect("a journal path that is a link is refused");
    assert_eq!(e.raw_os_error(), Some(libc::ELOOP), "{e}");
    assert_eq!(std::fs::read_to_string(&target).unwrap(), "");
}

#[test]
fn a_daemon_that_adopted_the_leases_workers_posts_only_what_was_not_posted() {
    let peer = Peer::start();
    let dir = Scratch::new("carry");
    let slot = peer.slot("acct1", 6);
    // What an earlier daemon, whose workers did not live on, left.
    let mut earlier = Poster::new(settings(None, CREDENTIAL)).unwrap();
    earlier.tick(&[usage(4, &slot, 200, 1, false)], Instant::now());
    drop(earlier);
    let carrying = || PosterSettings {
        carry: Some(dir.0.clone()),
        ..settings(None, CREDENTIAL)
    };
    let mut before = Poster::new(carrying()).unwrap();
    before.tick(&[usage(4, &slot, 1_000, 3, false)], Instant::now());
    assert_eq!(peer.word(6, Counter::ComputeNs), 1_200);
    drop(before);
    // The next daemon adopted the workers: its figures go on from the
    // same start, and only what grew since is added.
    let mut after = Poster::new(carrying()).unwrap();
    after.tick(&[usage(4, &slot, 1_300, 4, false)], Instant::now());
    assert_eq!(peer.word(6, Counter::ComputeNs), 1_500);
    assert_eq!(peer.word(6, Counter::Invocations), 5);
    // Closed, the lease carries nothing over any more.
    assert!(dir.0.join("lease-4.json").exists());
    after.tick(&[usage(4, &slot, 1_300, 4, true)], Instant::now());
    assert_eq!(peer.word(6, Counter::Closed), 1);
    assert!(!dir.0.join("lease-4.json").exists());
}

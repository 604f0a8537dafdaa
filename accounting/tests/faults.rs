//! Faults under load: three executor daemons post usage into one
//! accounting service while client threads lease, call a function that
//! burns CPU and release, over and over. Meanwhile, each at a moment a
//! seeded generator picks, the service is killed (`kill -9`) and started
//! again on its region file, one executor daemon is killed and started
//! again with its configuration, journal and credential, one worker is
//! killed, and (on PostgreSQL) the database restarts.
//!
//! Afterwards every lease is over and finalized, and for each one the
//! stored totals are exactly the sum of what the executors' journals say
//! they added; no slot held two leases at once; no add went astray; and
//! the compute each lease was billed is what its function measured, more
//! by at most the worker's own work and a call cut short, and less only on
//! the killed daemon, by at most the documented bound: what the lease used
//! since that daemon's last post (`granularity_ms` plus the billing tick
//! while the service is reachable; since the service went away, while it
//! is not).
//!
//! The seed is printed; `RFAAS_FAULTS_SEED=N` repeats a run.

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::{journaled, Env};
use rfaas_client::lease::{LeaseRequest, Managers};
use rfaas_client::{AllocationSpec, Client, ClientOptions, LeaseOptions};
use rfaas_proto::control::local::LocalReply;
use rfaas_testkit::accounting::{Accounting, AccountingOptions};
use rfaas_testkit::executord::{daemon_binary, Executord, ExecutordOptions};
use rfaas_testkit::on_both;
use rfaas_testkit::wait::{wait_for, wait_until, TIMEOUT};
use sqlx::Row;

/// The seed when `RFAAS_FAULTS_SEED` is not set.
const SEED: u64 = 12;

/// The executors post a lease at most this often.
const GRANULARITY_MS: u64 = 200;
/// How often the executor's billing thread looks for posts due (its
/// tick, `min(100 ms, granularity)`).
const BILLING_TICK_MS: u64 = 100;
/// How late a busy machine may run the billing thread, on top.
const SCHEDULING_SLACK_MS: u64 = 200;

/// CPU each call burns, and calls per lease.
const BURN_MS: u32 = 20;
const CALLS: usize = 6;

/// Client threads, each leasing one core at a time.
const CLIENTS: usize = 4;
/// How long the clients go on leasing; the faults hit within it.
const LOAD: Duration = Duration::from_secs(8);
/// A lease's duration: one whose release failed (the database was
/// restarting) ends at its expiry.
const LEASE_S: u64 = 10;
/// How long the service holds the slot of a lease that ended without
/// being closed (its daemon was killed): above any delay of a daemon's
/// final post in this test.
const SLOT_HOLD_S: u64 = 6;

/// What can go wrong.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    KillService,
    KillExecutord,
    KillWorker,
    RestartPostgres,
}

/// One executor daemon and what it takes to start it again.
struct Node {
    name: String,
    journal: PathBuf,
    opts: ExecutordOptions,
    daemon: Option<Executord>,
}

impl Node {
    fn new(env: &Env, dir: &Path, name: &str) -> Node {
        let (opts, journal) = common::billing_node(env, dir, name, GRANULARITY_MS);
        let mut n = Node {
            name: name.into(),
            journal,
            opts,
            daemon: None,
        };
        n.start();
        n
    }

    fn start(&mut self) {
        self.daemon = Some(Executord::start(&daemon_binary(), self.opts.clone()));
    }

    fn daemon(&self) -> &Executord {
        self.daemon.as_ref().expect("the daemon runs")
    }
}

/// What one client did under one lease.
#[derive(Debug)]
struct Leased {
    lease_id: u64,
    node: String,
    /// Calls that returned, and the CPU they say they burned, ns.
    calls: usize,
    burned: u64,
    /// When each returned call returned, and what it burned.
    returns: Vec<(Instant, u64)>,
    /// The call that failed, if one did (it may have burned up to
    /// `BURN_MS` before it was cut short).
    failed: Option<String>,
}

/// A fault as it was done.
#[derive(Debug)]
struct Done {
    fault: Fault,
    at: Instant,
    /// When what was killed or stopped was back.
    back: Instant,
    /// The executor daemon killed, or whose worker was.
    node: Option<String>,
    /// The lease whose worker was killed.
    lease_id: Option<u64>,
}

fn seed() -> u64 {
    match std::env::var("RFAAS_FAULTS_SEED") {
        Ok(s) => s
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("RFAAS_FAULTS_SEED={s:?} is not a number")),
        Err(_) => SEED,
    }
}

/// One client: leases a core, calls `burn_cpu_ms` `CALLS` times, releases,
/// until `stop`; a failed call ends its lease early.
fn client(managers: &Managers, spec: &AllocationSpec, stop: &AtomicBool) -> (Vec<Leased>, usize) {
    let want = LeaseRequest {
        cores: 1,
        memory_mib: 256,
        duration_s: LEASE_S,
        min_cores: None,
        nodes: vec![],
    };
    let options = LeaseOptions::default()
        .deadline(Duration::from_secs(5))
        .retry_elsewhere(true);
    let client = Client::new(ClientOptions::with_provider("tcp"));
    let (mut leased, mut refused) = (Vec::new(), 0);
    while !stop.load(Ordering::Relaxed) {
        let la = match managers.allocate(&client, &want, spec, &options) {
            Ok(la) => la,
            Err(e) => {
                // A node or the database is down: try again. The pause
                // paces the retries, as a job's would; it orders nothing.
                eprintln!("faults: no allocation: {e}");
                refused += 1;
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
        };
        let lease_id = la.node_lease_id().unwrap();
        let node = la.node();
        let f = la.function("burn_cpu_ms").unwrap();
        let mut input = la.buffer::<u32>(1).unwrap();
        let mut output = la.buffer::<u64>(2).unwrap();
        input.write_from(0, &[BURN_MS]);
        let (mut calls, mut burned, mut failed) = (0, 0, None);
        let mut returns = Vec::new();
        for _ in 0..CALLS {
            match la.invoke(f, &input, 1, &mut output) {
                Ok(_) => {
                    calls += 1;
                    burned += output.to_vec()[0];
                    returns.push((Instant::now(), output.to_vec()[0]));
                }
                Err(e) => {
                    failed = Some(e.to_string());
                    break;
                }
            }
        }
        if let Err(e) = la.deallocate() {
            eprintln!("faults: lease {lease_id} on {node}: deallocating: {e}");
        }
        leased.push(Leased {
            lease_id,
            node,
            calls,
            burned,
            returns,
            failed,
        });
    }
    (leased, refused)
}

/// The stray-add counter of the running service.
fn strays(acct: &Accounting) -> u64 {
    acct.metric("rfaas_accounting_stray_adds_total")
        .unwrap_or(0.0) as u64
}

/// A random pause of 100 to 800 ms: how long a killed process stays down.
fn downtime(rng: &mut fastrand::Rng) -> Duration {
    Duration::from_millis(rng.u64(100..800))
}

/// Kills the worker of a random allocation on a random node, waiting for
/// one to run; returns the node and the allocation's lease.
fn kill_a_worker(nodes: &[Node], rng: &mut fastrand::Rng) -> (String, u64) {
    wait_for("a running worker to kill", Duration::from_secs(30), || {
        let n = &nodes[rng.usize(..nodes.len())];
        let LocalReply::Status { allocations, .. } = n.daemon().status() else {
            return None;
        };
        // A pid of 0 would be this test's own process group.
        let running: Vec<_> = allocations.iter().filter(|a| a.pid > 0).collect();
        if running.is_empty() {
            return None;
        }
        let a = running[rng.usize(..running.len())];
        // SAFETY: kill has no memory preconditions.
        let r = unsafe { libc::kill(a.pid as libc::pid_t, libc::SIGKILL) };
        (r == 0).then(|| (n.name.clone(), a.lease_id))
    })
}

fn usage_is_exact_and_losses_bounded_under_faults(kind: &str) {
    let seed = seed();
    eprintln!("faults: seed {seed} on {kind} (RFAAS_FAULTS_SEED={seed} repeats this run)");
    let mut rng = fastrand::Rng::with_seed(seed);

    // Every lease is billed: with the service down the manager refuses
    // (503) rather than grant a lease without a slot.
    let mut env = Env::with_manager_config(kind, "[accounting]\nrequired = true\n");
    let mut acct = Accounting::start(AccountingOptions {
        slot_hold_s: SLOT_HOLD_S,
        ..env.options()
    });
    let dir = common::scratch_dir("faults", kind);
    let mut nodes: Vec<Node> = ["fault-a", "fault-b", "fault-c"]
        .iter()
        .map(|name| Node::new(&env, &dir, name))
        .collect();
    common::wait_nodes_up(&env, nodes.len());
    let user = env.manager.credential("user", "nobody", Some("physics"));
    let managers = Managers::new([env.manager.url()], &user).unwrap();
    let spec = AllocationSpec::new(
        rfaas_testkit::functions::c_library_bytes(),
        &["burn_cpu_ms"],
    )
    .library_name("libfunctions.so")
    .memory_mib(128);

    // Each fault at a random moment of the load, in time order.
    let mut faults = vec![Fault::KillService, Fault::KillExecutord, Fault::KillWorker];
    if env.pg.is_some() {
        faults.push(Fault::RestartPostgres);
    }
    let mut plan: Vec<(Duration, Fault)> = faults
        .into_iter()
        .map(|f| {
            let ms = rng.u64(LOAD.as_millis() as u64 / 8..LOAD.as_millis() as u64 * 7 / 8);
            (Duration::from_millis(ms), f)
        })
        .collect();
    plan.sort_by_key(|(at, _)| *at);
    eprintln!("faults: plan {plan:?}");

    let stop = AtomicBool::new(false);
    let mut done: Vec<Done> = Vec::new();
    let mut stray_adds = 0;
    let start = Instant::now();
    let results: Vec<(Vec<Leased>, usize)> = std::thread::scope(|s| {
        let clients: Vec<_> = (0..CLIENTS)
            .map(|_| {
                let (managers, spec, stop) = (&managers, &spec, &stop);
                s.spawn(move || client(managers, spec, stop))
            })
            .collect();
        // The plan's times are the subject: each fault comes at its time
        // into the load, and the load runs for LOAD.
        for (at, fault) in &plan {
            std::thread::sleep((start + *at).saturating_duration_since(Instant::now()));
            let now = Instant::now();
            let mut record = Done {
                fault: *fault,
                at: now,
                back: now,
                node: None,
                lease_id: None,
            };
            match fault {
                Fault::KillService => {
                    stray_adds += strays(&acct);
                    acct.kill();
                    std::thread::sleep(downtime(&mut rng));
                    acct.restart().unwrap();
                }
                Fault::KillExecutord => {
                    let n = &mut nodes[rng.usize(..3)];
                    n.daemon.as_mut().unwrap().kill();
                    record.node = Some(n.name.clone());
                    std::thread::sleep(downtime(&mut rng));
                    n.start();
                }
                Fault::KillWorker => {
                    let (node, lease) = kill_a_worker(&nodes, &mut rng);
                    record.node = Some(node);
                    record.lease_id = Some(lease);
                }
                Fault::RestartPostgres => {
                    let pg = env.pg.as_mut().unwrap();
                    pg.stop().unwrap();
                    std::thread::sleep(downtime(&mut rng));
                    pg.start_again().unwrap();
                }
            }
            record.back = Instant::now();
            eprintln!(
                "faults: {fault:?} at {:?} took {:?} ({:?})",
                now - start,
                now.elapsed(),
                record
            );
            done.push(record);
        }
        std::thread::sleep((start + LOAD).saturating_duration_since(Instant::now()));
        stop.store(true, Ordering::Relaxed);
        clients.into_iter().map(|c| c.join().unwrap()).collect()
    });
    let refused: usize = results.iter().map(|r| r.1).sum();
    let leased: Vec<Leased> = results.into_iter().flat_map(|r| r.0).collect();
    eprintln!(
        "faults: {} leases ({} failed a call), {refused} allocations refused, load took {:?}",
        leased.len(),
        leased.iter().filter(|l| l.failed.is_some()).count(),
        start.elapsed()
    );
    assert!(
        leased.len() >= 2 * CLIENTS,
        "only {} leases ran under the load",
        leased.len()
    );

    // Every lease ends (released, or expired when its release failed),
    // its executor closes it (or the slot hold passes, for leases of the
    // killed daemon), and the flusher writes its final totals.
    for l in &leased {
        wait_until(
            &format!("lease {}'s usage is final", l.lease_id),
            TIMEOUT,
            || env.usage(l.lease_id).is_some_and(|u| u.finalized),
        );
    }
    stray_adds += strays(&acct);

    let journals: Vec<&Path> = nodes.iter().map(|n| n.journal.as_path()).collect();
    let sums = journaled(&journals);
    let executord_kill = done
        .iter()
        .find(|d| d.fault == Fault::KillExecutord)
        .expect("the executor daemon was killed");
    let killed_node = executord_kill.node.clone().unwrap();
    let worker_kill = done
        .iter()
        .find(|d| d.fault == Fault::KillWorker)
        .expect("a worker was killed");
    let burn_ns = u64::from(BURN_MS) * 1_000_000;
    let granularity_ns = GRANULARITY_MS * 1_000_000;
    // What the killed daemon had not posted: what its leases used since
    // its last post, at most a granularity and a tick before the kill...
    let post_window = Duration::from_millis(GRANULARITY_MS + BILLING_TICK_MS + SCHEDULING_SLACK_MS);
    let mut unposted_since = executord_kill.at - post_window;
    // ... or since the service went away, if the kill came before the
    // daemon was back on it: the service restarted, the daemon's backoff
    // (doubling, so at most the outage again) ran out and, when the
    // database restarted meanwhile, its hello could be checked.
    for s in done.iter().filter(|d| d.fault == Fault::KillService) {
        let mut reached = s.back + (s.back - s.at) + Duration::from_secs(1);
        for p in done.iter().filter(|d| d.fault == Fault::RestartPostgres) {
            if p.at <= reached && s.at <= p.back {
                reached = reached.max(p.back + (p.back - p.at) + Duration::from_secs(1));
            }
        }
        if s.at <= executord_kill.at && executord_kill.at <= reached {
            unposted_since = unposted_since.min(s.at - post_window);
        }
    }
    let mut lost_most = 0;
    for l in &leased {
        let id = l.lease_id;
        let row = env.usage(id).unwrap();
        let t = row.totals;
        let logged = sums.get(&id).cloned().unwrap_or_default();
        // Exact: what is stored is what the executors say they added.
        common::assert_journaled(&t, &logged, &format!("lease {id} on {} ({l:?})", l.node));
        // Bounded: the bill is the function's CPU, give or take.
        let billed = t.usage.compute_ns + t.usage.hot_ns;
        let cut_short = if l.failed.is_some() { burn_ns } else { 0 };
        assert!(
            billed <= l.burned + cut_short + granularity_ns,
            "lease {id} on {}: billed {billed} ns of CPU, its function burned {} ns ({l:?})",
            l.node,
            l.burned
        );
        let lost = l.burned.saturating_sub(billed);
        // Calls that ran in that window: those that returned after its
        // start and had begun by the kill. A call under way at the kill
        // may still return to its client (the worker ends the call before
        // it finds its daemon gone), but nobody posts it.
        let may_lose: u64 = if l.node == killed_node {
            l.returns
                .iter()
                .filter(|(at, ns)| {
                    let began = at.checked_sub(Duration::from_nanos(*ns)).unwrap_or(*at);
                    *at >= unposted_since && began <= executord_kill.at
                })
                .map(|(_, ns)| ns)
                .sum()
        } else {
            0
        };
        assert!(
            lost <= may_lose,
            "lease {id} on {}: billed {billed} ns of CPU, its function burned {} ns: {lost} ns \
             lost, where the bound allows {may_lose} ns, what it used since the killed \
             daemon's last post ({l:?}; the kill: {executord_kill:?})",
            l.node,
            l.burned
        );
        lost_most = lost_most.max(lost);
        if l.node != killed_node {
            // A call cut short may or may not have counted.
            assert!(
                t.usage.invocations == l.calls as u64
                    || (l.failed.is_some() && t.usage.invocations == l.calls as u64 + 1),
                "lease {id}: {} invocations billed, {} calls returned ({l:?})",
                t.usage.invocations,
                l.calls
            );
        }
    }
    eprintln!("faults: the most a lease lost: {lost_most} ns of CPU");

    let victim = worker_kill.lease_id.unwrap();
    eprintln!(
        "faults: the killed worker's lease: {:?}",
        leased.iter().find(|l| l.lease_id == victim)
    );

    // No slot held two leases at once: a slot is used again only after
    // the final flush of its last lease.
    let rows = env.block(async {
        sqlx::query("SELECT lease_id, instance, slot, first_ms, updated_ms FROM usage")
            .fetch_all(env.pool())
            .await
            .unwrap()
    });
    // (first flush, last flush, lease) by instance and slot.
    type Uses = Vec<(i64, i64, i64)>;
    let mut by_slot: HashMap<(String, i64), Uses> = HashMap::new();
    for r in &rows {
        by_slot
            .entry((r.get("instance"), r.get("slot")))
            .or_default()
            .push((r.get("first_ms"), r.get("updated_ms"), r.get("lease_id")));
    }
    for (slot, mut uses) in by_slot {
        uses.sort();
        for w in uses.windows(2) {
            assert!(
                w[0].1 <= w[1].0,
                "slot {slot:?}: lease {} (until {}) and lease {} (from {}) overlap",
                w[0].2,
                w[0].1,
                w[1].2,
                w[1].0
            );
        }
    }
    assert_eq!(stray_adds, 0, "adds landed in free slots");

    for n in &mut nodes {
        n.daemon = None;
    }
    drop(acct);
    let _ = std::fs::remove_dir_all(&dir);
}
on_both!(usage_is_exact_and_losses_bounded_under_faults);

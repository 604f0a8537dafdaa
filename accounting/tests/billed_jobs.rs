//! Jobs billed end to end: a manager and an accounting service on one
//! database, two executor daemons that register and post usage, and
//! clients that lease cores through the library and call a function that
//! burns CPU. Each lease's stored totals are what its executor journaled
//! (exactly), its compute time is what the function measured within the
//! granularity, and its account is charged for it.

mod common;

use std::path::{Path, PathBuf};

use common::{journaled, Env};
use rfaas_client::lease::{LeaseRequest, Managers};
use rfaas_client::{AllocationSpec, Client, ClientOptions, LeaseOptions};
use rfaas_testkit::executord::{daemon_binary, Executord};
use rfaas_testkit::on_both;
use rfaas_testkit::wait::{wait_until, TIMEOUT};

/// The executors post at most this often.
const GRANULARITY_MS: u64 = 200;

/// CPU each call burns, ms, and calls per lease.
const BURN_MS: u32 = 30;
const CALLS: usize = 8;

struct Node {
    /// Runs until the test ends.
    _daemon: Executord,
    journal: PathBuf,
}

fn node(env: &Env, dir: &Path, name: &str) -> Node {
    let (opts, journal) = common::billing_node(env, dir, name, GRANULARITY_MS);
    let daemon = Executord::start(&daemon_binary(), opts);
    Node {
        _daemon: daemon,
        journal,
    }
}

fn jobs_are_billed_for_what_they_used(kind: &str) {
    // Every lease billed: until the manager has seen the service alive it
    // refuses (503, retried by the client) rather than grant unbilled.
    let env = Env::with_manager_config(kind, "[accounting]\nrequired = true\n");
    let _acct = env.accounting();
    let dir = common::scratch_dir("billed-jobs", kind);
    let nodes = [node(&env, &dir, "bill-a"), node(&env, &dir, "bill-b")];
    common::wait_nodes_up(&env, 2);
    let user = env.manager.credential("user", "nobody", Some("physics"));
    let managers = Managers::new([env.manager.url()], &user).unwrap();
    let library = rfaas_testkit::functions::c_library_bytes();
    let spec = AllocationSpec::new(library, &["burn_cpu_ms"])
        .library_name("libfunctions.so")
        .memory_mib(128);
    let want = LeaseRequest {
        cores: 1,
        memory_mib: 256,
        duration_s: 600,
        min_cores: None,
        nodes: vec![],
    };

    // Four jobs at once, over both nodes; each sums the CPU its function
    // says it burned.
    let measured: Vec<(u64, u64)> = std::thread::scope(|s| {
        let jobs: Vec<_> = (0..4)
            .map(|_| {
                let (managers, spec, want) = (&managers, &spec, &want);
                s.spawn(move || {
                    let client = Client::new(ClientOptions::with_provider("tcp"));
                    let la = managers
                        .allocate(&client, want, spec, &LeaseOptions::default())
                        .unwrap();
                    let lease_id = la.node_lease_id().unwrap();
                    let f = la.function("burn_cpu_ms").unwrap();
                    let mut input = la.buffer::<u32>(1).unwrap();
                    let mut output = la.buffer::<u64>(2).unwrap();
                    input.write_from(0, &[BURN_MS]);
                    let mut burned = 0;
                    for _ in 0..CALLS {
                        la.invoke(f, &input, 1, &mut output).unwrap();
                        burned += output.to_vec()[0];
                    }
                    la.deallocate().unwrap();
                    (lease_id, burned)
                })
            })
            .collect();
        jobs.into_iter().map(|j| j.join().unwrap()).collect()
    });

    // Each lease ends (released), its executor posts the rest and closes
    // its slot, and the flusher writes the final totals.
    for (lease_id, _) in &measured {
        wait_until("the lease's usage is final", TIMEOUT, || {
            env.usage(*lease_id).is_some_and(|u| u.finalized)
        });
    }
    let journals: Vec<&Path> = nodes.iter().map(|n| n.journal.as_path()).collect();
    let sums = journaled(&journals);
    let mut spent = 0.0;
    for (lease_id, burned) in &measured {
        let row = env.usage(*lease_id).unwrap();
        let t = row.totals;
        common::assert_journaled(&t, &sums[lease_id], &format!("lease {lease_id}"));
        assert_eq!(t.usage.invocations, CALLS as u64, "lease {lease_id}");
        // The bill counts all the function's CPU, and the worker's own
        // work (its start, its polls) stays within the granularity.
        assert!(
            t.usage.compute_ns + t.usage.hot_ns >= *burned,
            "lease {lease_id}: billed {} ns of CPU, the function burned {burned} ns",
            t.usage.compute_ns + t.usage.hot_ns
        );
        assert!(
            t.usage.compute_ns + t.usage.hot_ns <= burned + GRANULARITY_MS * 1_000_000,
            "lease {lease_id}: billed {} ns of CPU, the function burned {burned} ns",
            t.usage.compute_ns + t.usage.hot_ns
        );
        assert!(t.usage.alloc_mib_ms > 0);
        spent += common::cost(&t, false);
    }
    wait_until("physics is charged for its leases", TIMEOUT, || {
        (env.spend("physics") - spent).abs() < 1e-6
    });
    drop(nodes);
    let _ = std::fs::remove_dir_all(&dir);
}
on_both!(jobs_are_billed_for_what_they_used);

/// A take-back posts what the allocations it stopped used at once, not a
/// granularity later (their lease is not over: its holder may allocate
/// elsewhere), so with a minute's granularity a drain's figures still
/// reach the database within seconds.
fn a_take_back_flushes_billing_at_once(kind: &str) {
    let env = Env::with_manager_config(kind, "[accounting]\nrequired = true\n");
    let _acct = env.accounting();
    let dir = common::scratch_dir("takeback", kind);
    let (opts, _journal) = common::billing_node(&env, &dir, "flush-a", 60_000);
    let daemon = Executord::start(&daemon_binary(), opts);
    common::wait_nodes_up(&env, 1);
    let user = env.manager.credential("user", "nobody", Some("physics"));
    let managers = Managers::new([env.manager.url()], &user).unwrap();
    let spec = AllocationSpec::new(
        rfaas_testkit::functions::c_library_bytes(),
        &["burn_cpu_ms"],
    )
    .library_name("libfunctions.so")
    .memory_mib(128);
    let want = LeaseRequest {
        cores: 1,
        memory_mib: 256,
        duration_s: 600,
        min_cores: None,
        nodes: vec![],
    };
    let client = Client::new(ClientOptions::with_provider("tcp"));
    let la = managers
        .allocate(&client, &want, &spec, &LeaseOptions::default())
        .unwrap();
    let lease_id = la.node_lease_id().unwrap();
    let f = la.function("burn_cpu_ms").unwrap();
    let mut input = la.buffer::<u32>(1).unwrap();
    let mut output = la.buffer::<u64>(2).unwrap();
    input.write_from(0, &[BURN_MS]);
    // The lease's first post goes out when the daemon first sees it (with
    // this call, or before it on a busy machine); the next would wait a
    // minute.
    la.invoke(f, &input, 1, &mut output).unwrap();
    wait_until("the first post is stored", TIMEOUT, || {
        env.usage(lease_id).is_some()
    });
    for _ in 1..CALLS {
        la.invoke(f, &input, 1, &mut output).unwrap();
    }
    let drained = std::time::Instant::now();
    let reply = daemon.local(rfaas_proto::control::local::LocalRequest::Drain { grace_ms: 0 });
    assert!(
        format!("{reply:?}").contains("drained"),
        "{reply:?}\n{}",
        daemon.log()
    );
    wait_until("every call is stored", TIMEOUT, || {
        env.usage(lease_id)
            .is_some_and(|u| u.totals.usage.invocations == CALLS as u64)
    });
    assert!(
        drained.elapsed() < std::time::Duration::from_secs(30),
        "the take-back's figures waited for the granularity\n{}",
        daemon.log()
    );
    drop(la);
    let _ = std::fs::remove_dir_all(&dir);
}
on_both!(a_take_back_flushes_billing_at_once);

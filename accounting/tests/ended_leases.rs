//! The billing slot of a lease is closed and freed soon after the lease
//! ends, whatever ended its use of the node: a take-back for a Slurm job,
//! a drain, a crash of its worker, its function's deadline, or its expiry.
//! A real manager, accounting service and executor daemon on one
//! database; leases through the client library, one after another on the
//! same node, as a busy site has them.

mod common;

use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use common::Env;
use rfaas_client::lease::{LeaseRequest, Managers};
use rfaas_client::{
    AllocationSpec, Client, ClientOptions, Error, InvocationStatus, LeaseOptions, LeasedAllocation,
};
use rfaas_proto::control::local::{LocalReply, LocalRequest};
use rfaas_testkit::accounting::{Accounting, AccountingOptions};
use rfaas_testkit::executord::{daemon_binary, Executord};
use rfaas_testkit::on_both;
use rfaas_testkit::wait::{poll_for, wait_until, TIMEOUT};
use sqlx::Row;

/// The accounting service's flush period, ms.
const FLUSH_MS: u64 = 1000;

/// How many flush periods after its end a lease's slot may stay taken
/// here: the executor learns of a release at its next heartbeat (200 ms in
/// the tests) and closes the slot at its next billing tick (100 ms); the
/// service frees it at the flush after that. The hold of a slot whose
/// executor never closes it is `slot_hold_s`, 600 s.
const FLUSHES: u32 = 5;

/// The slot lease `lease` holds, if it holds one.
fn slot_of(env: &Env, lease: u64) -> Option<i64> {
    env.block(async {
        sqlx::query("SELECT slot FROM billing_slots WHERE lease_id = $1")
            .bind(lease as i64)
            .fetch_optional(env.pool())
            .await
            .unwrap()
            .map(|r| r.try_get::<i64, _>("slot").unwrap())
    })
}

/// Waits until lease `lease`'s slot is free, at most [`FLUSHES`] flush
/// periods after `end`; then its usage must be final and its journal must
/// show the close.
fn assert_freed(env: &Env, d: &Executord, journal: &Path, how: &str, lease: u64, end: SystemTime) {
    let bound = Duration::from_millis(FLUSH_MS) * FLUSHES;
    let since_end = || SystemTime::now().duration_since(end).unwrap_or_default();
    poll_for(bound.saturating_sub(since_end()), || {
        slot_of(env, lease).is_none().then_some(())
    })
    .unwrap_or_else(|| {
        panic!(
            "lease {lease}, ended by {how}, still holds its slot {:?} after its end \
             (more than {FLUSHES} flushes of {FLUSH_MS} ms)\njournal:\n{}\nexecutor log:\n{}",
            since_end(),
            std::fs::read_to_string(journal).unwrap_or_default(),
            d.log()
        )
    });
    let usage = env
        .usage(lease)
        .unwrap_or_else(|| panic!("{how}: no usage row"));
    assert!(usage.finalized, "{how}: lease {lease}'s usage is not final");
    assert!(usage.totals.usage.invocations >= 1, "{how}: {usage:?}");
    let closed = std::fs::read_to_string(journal)
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .any(|v| v["lease_id"] == lease && v["closed"] == true);
    assert!(
        closed,
        "{how}: the journal has no closed line for lease {lease}"
    );
}

fn done(reply: LocalReply) -> String {
    match reply {
        LocalReply::Done { message } => message,
        other => panic!("the daemon answered {other:?}"),
    }
}

/// Calls echo once on `la` (so the lease has usage to bill).
fn echo(la: &LeasedAllocation) {
    let f = la.function("echo").unwrap();
    let input = la.buffer::<u32>(1).unwrap();
    let mut output = la.buffer::<u32>(1).unwrap();
    la.invoke(f, &input, 1, &mut output).unwrap();
}

fn slots_of_leases_ended_every_way_are_freed(kind: &str) {
    let env = Env::with_manager_config(kind, "[accounting]\nrequired = true\n");
    let _acct = Accounting::start(AccountingOptions {
        flush_interval_ms: FLUSH_MS,
        snapshot_interval_ms: FLUSH_MS,
        ..env.options()
    });
    let dir = common::scratch_dir("ended-leases", kind);
    let (opts, journal) = common::billing_node(&env, &dir, "ends-a", 200);
    let d = Executord::start(&daemon_binary(), opts);
    common::wait_nodes_up(&env, 1);
    let user = env.manager.credential("user", "nobody", Some("physics"));
    let managers = Managers::new([env.manager.url()], &user).unwrap();
    let client = Client::new(ClientOptions::with_provider("tcp"));
    let spec = AllocationSpec::new(
        rfaas_testkit::functions::c_library_bytes(),
        &["echo", "fault_segfault", "sleep_ms"],
    )
    .library_name("libfunctions.so")
    .memory_mib(128)
    .deadline(Duration::from_millis(300));
    let want = |duration_s| LeaseRequest {
        cores: 1,
        memory_mib: 256,
        duration_s,
        min_cores: None,
        nodes: vec![],
    };
    let leased = || {
        let la = managers
            .allocate(&client, &want(600), &spec, &LeaseOptions::default())
            .unwrap_or_else(|e| panic!("{e}\n{}", d.log()));
        echo(&la);
        la
    };
    // Its holder releases a lease whose allocation ended: the lease ends.
    let release = |la: LeasedAllocation| {
        let lease = la.node_lease_id().unwrap();
        la.deallocate().unwrap();
        (lease, SystemTime::now())
    };

    // A Slurm job takes the node back, then the job's own lease is
    // released.
    let la = leased();
    let message = done(d.local(LocalRequest::SlurmRetrieve {
        job_id: 41,
        cpus: 0,
        grace_ms: 0,
    }));
    assert!(message.contains("drained"), "{message}");
    let (lease, end) = release(la);
    assert_freed(&env, &d, &journal, "a take-back", lease, end);
    done(d.local(LocalRequest::SlurmOffer { job_id: 41 }));

    // The node is drained by hand.
    let la = leased();
    done(d.local(LocalRequest::Drain { grace_ms: 0 }));
    let (lease, end) = release(la);
    assert_freed(&env, &d, &journal, "a drain", lease, end);
    done(d.local(LocalRequest::Resume));

    // The worker crashes.
    let la = leased();
    let crash = la.function("fault_segfault").unwrap();
    let input = la.buffer::<u32>(1).unwrap();
    let mut output = la.buffer::<u32>(1).unwrap();
    let err = la.invoke(crash, &input, 0, &mut output).unwrap_err();
    assert!(matches!(err, Error::WorkerCrashed { .. }), "{err:?}");
    drop((input, output));
    let (lease, end) = release(la);
    assert_freed(&env, &d, &journal, "a crash", lease, end);

    // The function runs past its deadline.
    let la = leased();
    let sleep = la.function("sleep_ms").unwrap();
    let mut input = la.buffer::<u32>(1).unwrap();
    let mut output = la.buffer::<u32>(1).unwrap();
    input.write_from(0, &[5_000]);
    let err = la.invoke(sleep, &input, 1, &mut output).unwrap_err();
    assert!(
        matches!(
            err,
            Error::FunctionFailed(InvocationStatus::DeadlineExceeded)
        ),
        "{err:?}"
    );
    drop((input, output));
    let (lease, end) = release(la);
    assert_freed(&env, &d, &journal, "a deadline", lease, end);

    // The lease expires: nobody renews it.
    let short = managers
        .request(&want(3), Duration::from_secs(30))
        .unwrap_or_else(|e| panic!("{e}"));
    let node = short.nodes().into_iter().next().expect("a node lease");
    let alloc = client
        .allocate(&node.executor(), &node.token, &spec)
        .unwrap_or_else(|e| panic!("{e}\n{}", d.log()));
    let f = alloc.function("echo").unwrap();
    let input = alloc.buffer::<u32>(1).unwrap();
    let mut output = alloc.buffer::<u32>(1).unwrap();
    alloc.invoke(f, &input, 1, &mut output).unwrap();
    let end = UNIX_EPOCH + Duration::from_secs(short.expires_at());
    wait_until("the lease has expired", TIMEOUT, || {
        SystemTime::now() >= end
    });
    assert_freed(&env, &d, &journal, "its expiry", node.lease_id, end);
    drop((input, output, alloc));
    // Released after its end: refused, and nothing changes.
    let _ = short.release();
    let _ = std::fs::remove_dir_all(&dir);
}
on_both!(slots_of_leases_ended_every_way_are_freed);

//! The accounting service end to end: a real `rfaas-accounting` and a
//! real manager on one database (SQLite and PostgreSQL), a test peer that
//! says the hello with an accounting ticket and adds over the fabric as an
//! executor daemon does, and the database's rows as the flusher leaves
//! them.

mod common;

use common::{cost, some_usage, wait_for_usage, Env};
use rfaas_fabric::{RemoteAddr, Status};
use rfaas_proto::accounting::{region_len, Counter, ReplyStatus, SlotTotals, UsageFigures};
use rfaas_proto::ticket::AccountingTicket;
use rfaas_testkit::accounting::{credential_id, Accounting, AccountingOptions, Peer};
use rfaas_testkit::on_both;
use rfaas_testkit::wait::{wait_until, TIMEOUT};

/// Adds through the fabric become the lease's stored totals, priced into
/// its account's spend, with snapshots; the instance's rows, budgets and
/// metrics say what it did.
fn adds_reach_the_database(kind: &str) {
    let env = Env::new(kind);
    let acct = env.accounting();
    let cred = env.node_ticket("n1");
    let mut peer = Peer::hello("tcp", acct.fabric_addr(), &cred).expect("hello");
    let r = peer.reply;
    assert_eq!(r.status, ReplyStatus::Accepted);
    assert_eq!(r.slots, 64);
    assert_ne!((r.region_addr, r.region_rkey, r.region_id), (0, 0, 0));

    env.insert_lease(101, "physics", false);
    env.insert_lease(102, "physics", true);
    env.assign("acct1", 3, 101);
    env.assign("acct1", 4, 102);
    let (a, b) = (some_usage(2), some_usage(1));
    peer.add_totals(3, &a).unwrap();
    peer.add_totals(4, &b).unwrap();
    peer.add(4, Counter::ComputeNs, 5).unwrap();
    let b = SlotTotals {
        usage: UsageFigures {
            compute_ns: b.usage.compute_ns + 5,
            ..b.usage
        },
        ..b
    };
    assert_eq!(peer.read_slot(3).unwrap(), a);
    let row = wait_for_usage(&env, 101, &a);
    assert_eq!(
        (row.instance.as_str(), row.slot, row.finalized),
        ("acct1", 3, false)
    );
    wait_for_usage(&env, 102, &b);
    let want = cost(&a, false) + cost(&b, true);
    wait_until("the spend is priced", TIMEOUT, || {
        (env.spend("physics") - want).abs() < 1e-9
    });
    // A snapshot a second: the latest holds the totals.
    wait_until("a snapshot holds the totals", TIMEOUT, || {
        env.snapshots(101).last().is_some_and(|s| s.totals == a)
    });

    let inst = format!(
        "SELECT slots FROM accounting_instances WHERE name = 'acct1' AND fabric_addr = '{}' AND provider = 'tcp' AND region_id = {}",
        acct.fabric_addr(),
        r.region_id as i64
    );
    assert_eq!(env.scalar(&inst), 64.0);
    assert_eq!(
        env.scalar("SELECT COUNT(*) FROM billing_slots WHERE instance = 'acct1'"),
        64.0
    );
    assert_eq!(
        env.scalar("SELECT budget FROM budgets WHERE account = 'physics'"),
        100.0
    );
    let hb = "SELECT last_heartbeat_ms FROM accounting_instances WHERE name = 'acct1'";
    let first = env.scalar(hb);
    wait_until("the instance heartbeats", TIMEOUT, || {
        env.scalar(hb) > first
    });

    assert_eq!(acct.metric("rfaas_accounting_slots_in_use"), Some(2.0));
    assert_eq!(acct.metric("rfaas_accounting_slots"), Some(64.0));
    assert_eq!(acct.metric("rfaas_accounting_connections"), Some(1.0));
    assert_eq!(
        acct.metric("rfaas_accounting_hellos_total{result=\"accepted\"}"),
        Some(1.0)
    );
    assert!(acct.metric("rfaas_accounting_rows_written_total{table=\"usage\"}") >= Some(2.0));
    assert!(
        acct.metric("rfaas_accounting_rows_written_total{table=\"usage_snapshots\"}") >= Some(2.0)
    );
    // Counted, not necessarily 0: a loaded machine may time a flush out.
    assert!(acct.metric("rfaas_accounting_flush_errors_total").is_some());
    assert!(acct.metric("rfaas_accounting_flush_lag_seconds").is_some());
    let (status, body) = acct.http_get("/healthz");
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("\"ok\""), "{body}");

    // The daemon goes away: its connection is dropped.
    drop(peer);
    wait_until("the connection is dropped", TIMEOUT, || {
        acct.metric("rfaas_accounting_connections") == Some(0.0)
    });
}
on_both!(adds_reach_the_database);

/// Whoever does not show a live accounting ticket is refused, never
/// learns the region, and is dropped: a ticket forged (another key with
/// the manager's key id, or a changed byte), expired, malformed, naming a
/// user's credential, a revoked one, or another node's; and a hello of
/// the first release with a bearer credential in clear. A peer that says
/// nothing, or something else than a hello, gets no answer at all. The
/// service serves a daemon meanwhile.
fn only_live_tickets_learn_the_region(kind: &str) {
    let env = Env::new(kind);
    let acct = env.accounting();
    let addr = acct.fabric_addr().to_owned();
    let good = env.node_ticket("n1");
    let user = env.manager.credential("user", "alice", Some("physics"));
    let user_ticket = env.ticket_for("alice", &user);
    let revoked = env.node_credential("n2");
    let revoked_ticket = env.ticket_for("n2", &revoked);
    let (status, body) = env.manager.admin().call(
        "DELETE",
        &format!("/v1/credentials/{}", credential_id(&revoked)),
        None,
    );
    assert!((200..300).contains(&status), "revoke: {status} {body}");
    let other_nodes = env.ticket_for("n3", &env.node_credential("n1"));
    let mut altered = AccountingTicket::from_text(&good)
        .unwrap()
        .as_bytes()
        .to_vec();
    altered[5] ^= 1;
    let altered = AccountingTicket::from_bytes(&altered).unwrap().to_text();
    let malformed = AccountingTicket::from_bytes(&[7; 100]).unwrap().to_text();

    // Connections that never finish a hello hold up nobody.
    let silent = Peer::connect("tcp", &addr).unwrap();
    let mut half = Peer::connect("tcp", &addr).unwrap();
    let imms = half.hello_imms(&good);
    half.send_imms(&imms[..10]).unwrap();
    let refused = [
        ("a user's credential", user_ticket),
        ("a revoked credential", revoked_ticket),
        ("another node's credential", other_nodes),
        ("another key", env.forged_ticket("n1")),
        ("an altered byte", altered),
        ("expired", env.expired_ticket("n1", 120)),
        ("malformed", malformed),
    ];
    for (what, ticket) in &refused {
        let mut p = Peer::hello("tcp", &addr, ticket).expect("an answer");
        assert_eq!(p.reply.status, ReplyStatus::BadCredential, "{what}");
        assert_eq!(
            (
                p.reply.region_addr,
                p.reply.region_rkey,
                p.reply.slots,
                p.reply.region_id
            ),
            (0, 0, 0, 0),
            "{what}"
        );
        // And it is dropped: nothing it posts reaches the region.
        assert!(p.read_slot(0).is_err(), "{what}");
    }
    // The first release's hello, a node credential in clear: refused for
    // its version, and the region stays unknown.
    let mut v1 = Peer::connect("tcp", &addr).unwrap();
    let imms = v1.v1_hello_imms(&env.node_credential("n1"));
    v1.send_imms(&imms).unwrap();
    let answer = v1.await_reply(TIMEOUT).unwrap();
    assert_eq!(answer.status, ReplyStatus::BadHello);
    assert_eq!((answer.region_addr, answer.region_rkey), (0, 0));

    let mut daemon = Peer::hello("tcp", &addr, &good).unwrap();
    assert_eq!(daemon.reply.status, ReplyStatus::Accepted);
    daemon.add(0, Counter::Invocations, 1).unwrap();
    // Something other than a hello: no answer, dropped.
    let mut other = Peer::connect("tcp", &addr).unwrap();
    let mut imms = other.hello_imms(&good);
    imms[0] = 0x1234_5678;
    let answer = other
        .send_imms(&imms)
        .and_then(|()| other.await_reply(std::time::Duration::from_secs(3)));
    assert!(answer.is_err(), "{answer:?}");
    // The silent ones are dropped after the hello deadline (2 s here).
    wait_until("the silent connections are dropped", TIMEOUT, || {
        acct.metric("rfaas_accounting_hellos_total{result=\"dropped\"}") >= Some(2.0)
    });
    drop((silent, half));
    assert_eq!(
        acct.metric("rfaas_accounting_hellos_total{result=\"bad_credential\"}"),
        Some(refused.len() as f64)
    );
    assert_eq!(
        acct.metric("rfaas_accounting_hellos_total{result=\"bad_hello\"}"),
        Some(2.0),
        "the version 1 hello and the one with another magic"
    );
    assert_eq!(
        acct.metric("rfaas_accounting_hellos_total{result=\"accepted\"}"),
        Some(1.0)
    );
    assert_eq!(acct.metric("rfaas_accounting_connections"), Some(1.0));
    daemon.add(0, Counter::Invocations, 1).unwrap();
}
on_both!(only_live_tickets_learn_the_region);

/// An add with a wrong rkey, past the region, or unaligned fails at the
/// daemon that made it; the region is untouched and the service serves
/// others (and, on tcp, that daemon too).
fn bad_adds_fail_alone(kind: &str) {
    let env = Env::new(kind);
    let acct = env.accounting();
    let mut a = Peer::hello("tcp", acct.fabric_addr(), &env.node_ticket("n1")).unwrap();
    // Both connections are node n1's, which holds the lease.
    let mut b = Peer::hello("tcp", acct.fabric_addr(), &env.node_ticket("n1")).unwrap();
    env.insert_lease(7, "physics", false);
    env.assign("acct1", 1, 7);
    let region = RemoteAddr {
        addr: b.reply.region_addr,
        rkey: b.reply.region_rkey,
    };
    let bad = [
        (
            "a wrong rkey",
            RemoteAddr {
                rkey: region.rkey ^ 0x40_0000,
                ..region
            },
        ),
        (
            "the slot past the last",
            RemoteAddr {
                addr: region.addr + region_len(64),
                ..region
            },
        ),
        (
            "before the region",
            RemoteAddr {
                addr: region.addr - 8,
                ..region
            },
        ),
        (
            "an unaligned word",
            RemoteAddr {
                addr: region.addr + 64 + 4,
                ..region
            },
        ),
    ];
    for (what, at) in bad {
        let err = b.add_at(at, 1).unwrap_err();
        assert!(
            matches!(err, Status::RemoteAccess | Status::RemoteOperation),
            "{what}: {err:?}"
        );
        a.add(1, Counter::ComputeNs, 1_000).unwrap();
    }
    b.add(1, Counter::ComputeNs, 1_000).unwrap();
    let want = SlotTotals {
        usage: UsageFigures {
            compute_ns: 5_000,
            ..UsageFigures::default()
        },
        closed: 0,
    };
    wait_for_usage(&env, 7, &want);
    let whole = (0..64)
        .map(|s| a.read_slot(s).unwrap())
        .filter(|t| *t != SlotTotals::default())
        .count();
    assert_eq!(whole, 1, "only slot 1 was added to");
    assert_eq!(acct.metric("rfaas_accounting_connections"), Some(2.0));
}
on_both!(bad_adds_fail_alone);

/// Adds that completed survive a kill -9 of the service: restarted on the
/// same region file (flushing at once), it stores them all. The region
/// and its id are the same, and daemons reconnect.
fn a_kill_9_loses_no_add(kind: &str) {
    let env = Env::new(kind);
    let mut acct = Accounting::start(AccountingOptions {
        // No flush after the one at the start: what the database gets
        // later came through the region file.
        flush_interval_ms: 3_600_000,
        snapshot_interval_ms: 3_600_000,
        ..env.options()
    });
    let cred = env.node_ticket("n1");
    let mut peer = Peer::hello("tcp", acct.fabric_addr(), &cred).unwrap();
    let region_id = peer.reply.region_id;
    env.insert_lease(55, "physics", false);
    env.assign("acct1", 9, 55);
    let mut sum = SlotTotals::default();
    for i in 1..=50 {
        let u = some_usage(i);
        peer.add_totals(9, &u).unwrap();
        sum = SlotTotals::from_words(std::array::from_fn(|w| sum.to_words()[w] + u.to_words()[w]));
    }
    acct.kill();
    assert!(
        env.usage(55).is_none(),
        "nothing was flushed before the kill"
    );
    assert!(
        peer.add(9, Counter::Invocations, 1).is_err(),
        "the service is gone"
    );
    acct.restart().unwrap();
    let row = wait_for_usage(&env, 55, &sum);
    assert!(!row.finalized);
    wait_until("the spend is priced", TIMEOUT, || {
        (env.spend("physics") - cost(&sum, false)).abs() < 1e-6
    });
    let mut again = Peer::hello("tcp", acct.fabric_addr(), &cred).unwrap();
    assert_eq!(again.reply.region_id, region_id);
    assert_eq!(again.read_slot(9).unwrap(), sum);
}
on_both!(a_kill_9_loses_no_add);

/// A daemon's closing add makes the final flush: totals finalized, the
/// slot zeroed and freed; a lease that ended without closing is freed
/// after the hold. A reused slot starts at zero.
fn the_final_flush_frees_the_slot(kind: &str) {
    let env = Env::new(kind);
    let acct = Accounting::start(AccountingOptions {
        slot_hold_s: 60,
        ..env.options()
    });
    let mut peer = Peer::hello("tcp", acct.fabric_addr(), &env.node_ticket("n1")).unwrap();
    env.insert_lease(1, "physics", false);
    env.insert_lease(2, "physics", false);
    env.assign("acct1", 5, 1);
    env.assign("acct1", 6, 2);
    let (u1, u2) = (some_usage(3), some_usage(4));
    peer.add_totals(5, &u1).unwrap();
    peer.add_totals(6, &u2).unwrap();
    peer.add(5, Counter::Closed, 1).unwrap();
    // A closed slot whose lease is still active (renewed after its daemon
    // saw the token expire) is flushed but kept: it may be added to again.
    wait_for_usage(&env, 1, &u1);
    assert_eq!(
        env.slot_lease("acct1", 5),
        1,
        "kept while the lease is active"
    );
    assert!(!env.usage(1).unwrap().finalized);
    // Lease 1 is released; lease 2 ended two minutes ago and its daemon
    // never closed the slot.
    env.end_lease(1, rfaas_service::now_ms());
    env.end_lease(2, rfaas_service::now_ms() - 120_000);
    for (lease, slot, u) in [(1, 5, u1), (2, 6, u2)] {
        wait_until(&format!("slot {slot} is freed"), TIMEOUT, || {
            env.slot_lease("acct1", slot) == 0
        });
        let row = env.usage(lease).unwrap();
        assert_eq!((row.totals, row.finalized), (u, true), "lease {lease}");
        assert_eq!(env.snapshots(lease).last().unwrap().totals, u);
        assert_eq!(
            peer.read_slot(slot).unwrap(),
            SlotTotals::default(),
            "slot {slot} is zero"
        );
    }
    let spend = env.spend("physics");
    assert!((spend - cost(&u1, false) - cost(&u2, false)).abs() < 1e-6);
    assert!(acct.metric("rfaas_accounting_slots_freed_total") >= Some(2.0));
    // Reused: the new lease's totals are its own.
    env.insert_lease(3, "physics", false);
    env.assign("acct1", 5, 3);
    peer.add(5, Counter::Invocations, 2).unwrap();
    let small = SlotTotals {
        usage: UsageFigures {
            invocations: 2,
            ..UsageFigures::default()
        },
        closed: 0,
    };
    wait_for_usage(&env, 3, &small);
    assert_eq!(
        env.usage(1).unwrap().totals,
        u1,
        "the old lease is untouched"
    );
    assert_eq!(env.spend("physics"), spend, "invocations cost nothing");
}
on_both!(the_final_flush_frees_the_slot);

/// A PostgreSQL restart while daemons add: flushes fail while it is down
/// (the adds go on, and a new daemon is told to retry, not refused), and
/// once it is back every add is stored.
#[test]
fn a_postgres_restart_loses_nothing() {
    let mut env = Env::new("postgres");
    let acct = env.accounting();
    let cred = env.node_ticket("n1");
    let later = env.node_ticket("n2");
    let mut peer = Peer::hello("tcp", acct.fabric_addr(), &cred).unwrap();
    env.insert_lease(9, "physics", false);
    env.assign("acct1", 2, 9);
    peer.add(2, Counter::ComputeNs, 1).unwrap();
    wait_for_usage(
        &env,
        9,
        &SlotTotals {
            usage: UsageFigures {
                compute_ns: 1,
                ..UsageFigures::default()
            },
            closed: 0,
        },
    );
    let errors = acct.metric("rfaas_accounting_flush_errors_total").unwrap();
    env.pg.as_mut().unwrap().stop().unwrap();
    let mut sum = 1;
    for i in 0..20 {
        peer.add(2, Counter::ComputeNs, i).unwrap();
        sum += i;
    }
    wait_until("a flush fails", TIMEOUT, || {
        acct.metric("rfaas_accounting_flush_errors_total") > Some(errors)
    });
    let waiting = Peer::hello("tcp", acct.fabric_addr(), &later).unwrap();
    assert_eq!(waiting.reply.status, ReplyStatus::Unavailable);
    assert_eq!(waiting.reply.region_rkey, 0);
    for i in 0..20 {
        peer.add(2, Counter::ComputeNs, i).unwrap();
        sum += i;
    }
    env.pg.as_mut().unwrap().start_again().unwrap();
    let want = SlotTotals {
        usage: UsageFigures {
            compute_ns: sum,
            ..UsageFigures::default()
        },
        closed: 0,
    };
    wait_for_usage(&env, 9, &want);
    let back = Peer::hello("tcp", acct.fabric_addr(), &later).unwrap();
    assert_eq!(back.reply.status, ReplyStatus::Accepted);
}

/// The same over shm: the daemon maps the region's file. The socket a
/// killed service leaves behind does not keep it from starting again.
#[test]
fn adds_over_shm() {
    let env = Env::new("sqlite");
    let mut acct = Accounting::start(AccountingOptions {
        provider: "shm".into(),
        ..env.options()
    });
    let mut peer = Peer::hello("shm", acct.fabric_addr(), &env.node_ticket("n1")).unwrap();
    assert_eq!(peer.reply.status, ReplyStatus::Accepted);
    env.insert_lease(4, "physics", false);
    env.assign("acct1", 0, 4);
    let u = some_usage(5);
    peer.add_totals(0, &u).unwrap();
    assert_eq!(peer.read_slot(0).unwrap(), u);
    wait_for_usage(&env, 4, &u);
    let err = peer
        .add_at(
            RemoteAddr {
                addr: peer.reply.region_addr + region_len(64),
                rkey: peer.reply.region_rkey,
            },
            1,
        )
        .unwrap_err();
    assert_eq!(err, Status::RemoteAccess);
    acct.kill();
    acct.restart().unwrap();
    let mut again = Peer::hello("shm", acct.fabric_addr(), &env.node_ticket("n1")).unwrap();
    assert_eq!(again.read_slot(0).unwrap(), u);
}

/// A region file lost while leases are counted in it (moved away here; on
/// tmpfs, a reboot) is made anew and seeded with the stored totals, so the
/// leases' counters keep growing from there.
fn a_replaced_region_starts_from_the_stored_totals(kind: &str) {
    let env = Env::new(kind);
    let mut acct = env.accounting();
    let cred = env.node_ticket("n1");
    let mut peer = Peer::hello("tcp", acct.fabric_addr(), &cred).unwrap();
    let old_id = peer.reply.region_id;
    env.insert_lease(8, "physics", false);
    env.assign("acct1", 1, 8);
    let u = some_usage(2);
    peer.add_totals(1, &u).unwrap();
    wait_for_usage(&env, 8, &u);
    acct.kill();
    std::fs::remove_file(acct.region_file()).unwrap();
    acct.restart().unwrap();
    assert!(
        acct.log().contains("the region file is new"),
        "{}",
        acct.log()
    );
    let mut peer = Peer::hello("tcp", acct.fabric_addr(), &cred).unwrap();
    assert_ne!(peer.reply.region_id, old_id);
    assert_eq!(peer.read_slot(1).unwrap(), u);
    peer.add(1, Counter::Invocations, 1).unwrap();
    let more = SlotTotals {
        usage: UsageFigures {
            invocations: u.usage.invocations + 1,
            ..u.usage
        },
        ..u
    };
    wait_for_usage(&env, 8, &more);
}
on_both!(a_replaced_region_starts_from_the_stored_totals);

/// The same over verbs, where the NIC applies the adds to the file's
/// pages.
#[test]
#[ignore = "needs an RDMA device: scripts/test-verbs.sh runs it under Soft-RoCE (--features verbs)"]
fn adds_over_verbs() {
    let provider = rfaas_fabric::testing::verbs();
    let env = Env::new("sqlite");
    let acct = Accounting::start(AccountingOptions {
        provider: provider.into(),
        listen: Some(rfaas_fabric::testing::listen_addr(provider)),
        ..env.options()
    });
    let mut peer = Peer::hello(provider, acct.fabric_addr(), &env.node_ticket("n1")).unwrap();
    assert_eq!(peer.reply.status, ReplyStatus::Accepted);
    env.insert_lease(4, "physics", false);
    env.assign("acct1", 0, 4);
    let u = some_usage(5);
    peer.add_totals(0, &u).unwrap();
    assert_eq!(peer.read_slot(0).unwrap(), u);
    wait_for_usage(&env, 4, &u);
    let bad = Peer::hello(provider, acct.fabric_addr(), &env.forged_ticket("n1")).unwrap();
    assert_eq!(bad.reply.status, ReplyStatus::BadCredential);
}

/// The whole contract with the manager: a lease it grants carries a slot
/// of this instance, signed; the node's daemon adds into that slot, the
/// usage is stored and priced to the lease's account, and the daemon's
/// close frees the slot.
fn a_granted_lease_is_billed_through_its_slot(kind: &str) {
    let env = Env::new(kind);
    let acct = env.accounting();
    let node_cred = env.node_credential("n1");
    let node = rfaas_testkit::manager::Api::new(env.manager.url(), &node_cred);
    let body = serde_json::json!({
        "control_addr": "127.0.0.1:7100",
        "providers": [{"name": "tcp", "host": "127.0.0.1"}],
        "cores": 2,
        "memory_mib": 4096,
        "version": "test"
    });
    let (status, reply) = node.call("PUT", "/v1/nodes/n1", Some(&body));
    assert_eq!(status, 200, "register: {reply}");
    // The daemon shows the ticket of the manager's reply, not its
    // credential.
    let ticket = reply["accounting_ticket"]
        .as_str()
        .unwrap_or_else(|| panic!("no accounting ticket: {reply}"))
        .to_owned();
    let user = rfaas_testkit::manager::Api::new(
        env.manager.url(),
        &env.manager.credential("user", "alice", Some("chem")),
    );
    let ask = serde_json::json!({"cores": 1, "memory_mib": 64, "duration_s": 60});
    let mut granted = serde_json::Value::Null;
    wait_until("a grant carries a billing slot", TIMEOUT, || {
        let (status, grant) = user.call("POST", "/v1/leases", Some(&ask));
        assert_eq!(status, 201, "{grant}");
        let billed = !grant["leases"][0]["billing"].is_null();
        if !billed {
            let id = grant["id"].as_u64().unwrap();
            user.call("DELETE", &format!("/v1/leases/{id}"), None);
        }
        granted = grant;
        billed
    });
    let lease = &granted["leases"][0];
    let lease_id = lease["lease_id"].as_u64().unwrap();
    let slot: rfaas_proto::accounting::BillingSlot =
        serde_json::from_value(lease["billing"].clone()).unwrap();
    assert_eq!(
        (
            slot.instance.as_str(),
            slot.provider.as_str(),
            slot.addr.as_str()
        ),
        ("acct1", "tcp", acct.fabric_addr())
    );
    assert_eq!(env.slot_lease("acct1", slot.slot), lease_id);

    let mut daemon = Peer::hello(&slot.provider, &slot.addr, &ticket).unwrap();
    // What the lease just granted (one core, 64 MiB) can have used: the
    // flusher refuses more than its cores and memory over its time.
    let u = SlotTotals {
        usage: UsageFigures {
            alloc_mib_ms: 64 * 500,
            compute_ns: 500_000_000,
            hot_ns: 250_000_000,
            ..some_usage(1).usage
        },
        closed: 0,
    };
    daemon.add_totals(slot.slot, &u).unwrap();
    wait_for_usage(&env, lease_id, &u);
    wait_until("chem's spend is priced", TIMEOUT, || {
        (env.spend("chem") - cost(&u, false)).abs() < 1e-9
    });
    daemon.add(slot.slot, Counter::Closed, 1).unwrap();
    wait_until("the slot is freed", TIMEOUT, || {
        env.slot_lease("acct1", slot.slot) == 0
    });
    assert!(env.usage(lease_id).unwrap().finalized);
}
on_both!(a_granted_lease_is_billed_through_its_slot);

//! Who may add to the counter region: only an executor daemon whose hello
//! was accepted, through the registration made for its connection alone.
//! Real `rfaas-accounting` processes, a real manager and SQLite (and
//! PostgreSQL where the database's answer matters); tcp and shm.

mod common;

use common::{wait_for_usage, Env};
use rfaas_fabric::{RemoteAddr, Status};
use rfaas_proto::accounting::{word_offset, Counter, ReplyStatus, SlotTotals};
use std::time::Duration;

use rfaas_testkit::accounting::{credential_id, Accounting, AccountingOptions, Peer};
use rfaas_testkit::on_both;
use rfaas_testkit::wait::{wait_until, TIMEOUT};

const PROVIDERS: [&str; 2] = ["tcp", "shm"];

fn start(env: &Env, provider: &str) -> Accounting {
    Accounting::start(AccountingOptions {
        provider: provider.into(),
        listen: provider
            .starts_with("verbs:")
            .then(|| rfaas_fabric::testing::listen_addr(provider)),
        ..env.options()
    })
}

/// The RDMA device's provider, for the cases scripts/test-verbs.sh runs
/// under Soft-RoCE.
fn verbs() -> &'static str {
    rfaas_fabric::testing::verbs()
}

/// A refused operation: an error completion, or the connection dropped.
fn refused(r: Result<u64, Status>) -> bool {
    matches!(
        r,
        Err(Status::RemoteAccess | Status::RemoteOperation | Status::PeerLost | Status::Flushed)
    )
}

/// A connection that never said its hello cannot fetch-and-add nor
/// compare-and-swap the counters, even with the region's address and rkey
/// as an accepted daemon learnt them; the daemon's slot keeps only its own
/// adds.
fn without_a_hello(provider: &str) {
    let env = Env::new("sqlite");
    let acct = start(&env, provider);
    let mut daemon = Peer::hello(provider, acct.fabric_addr(), &env.node_ticket("n1")).unwrap();
    assert_eq!(daemon.reply.status, ReplyStatus::Accepted, "{provider}");
    env.insert_lease(11, "physics", false);
    env.assign("acct1", 2, 11);
    let mut word = daemon.region();
    word.addr += word_offset(2, Counter::ComputeNs);

    let mut stranger = Peer::connect(provider, acct.fabric_addr()).unwrap();
    let add = stranger.add_at(word, 1_000_000_000_000_000);
    assert!(
        refused(add),
        "{provider}: a fetch-and-add without a hello: {add:?}"
    );
    let mut stranger = Peer::connect(provider, acct.fabric_addr()).unwrap();
    let cas = stranger.cas_at(word, 0, u64::MAX);
    assert!(
        refused(cas),
        "{provider}: a compare-and-swap without a hello: {cas:?}"
    );

    daemon.add(2, Counter::ComputeNs, 5).unwrap();
    let want = SlotTotals::from_words([0, 5, 0, 0, 0, 0, 0, 0]);
    assert_eq!(daemon.read_slot(2).unwrap(), want, "{provider}");
    wait_for_usage(&env, 11, &want);
}

#[test]
fn a_connection_without_a_hello_cannot_touch_the_region() {
    for provider in PROVIDERS {
        without_a_hello(provider);
    }
}

#[test]
#[ignore = "needs an RDMA device: scripts/test-verbs.sh runs it under Soft-RoCE (--features verbs)"]
fn a_connection_without_a_hello_cannot_touch_the_region_over_verbs() {
    without_a_hello(verbs());
}

/// The rkey a daemon was given names the region on its own connection
/// only, and differs from run to run: one seen before a restart (or on
/// another connection) does not work, though the region is the same.
#[test]
fn an_rkey_from_a_previous_run_or_connection_does_not_work() {
    for provider in PROVIDERS {
        let env = Env::new("sqlite");
        let mut acct = start(&env, provider);
        let cred = env.node_ticket("n1");
        let first = Peer::hello(provider, acct.fabric_addr(), &cred).unwrap();
        let old = first.region();
        let region_id = first.reply.region_id;
        let mut second = Peer::hello(provider, acct.fabric_addr(), &cred).unwrap();
        let other = RemoteAddr {
            rkey: old.rkey,
            ..second.region()
        };
        assert_ne!(second.region().rkey, old.rkey, "{provider}");
        assert!(
            refused(second.add_at(other, 1)),
            "{provider}: another connection's rkey worked"
        );
        drop((first, second));
        acct.restart().unwrap();

        let mut again = Peer::hello(provider, acct.fabric_addr(), &cred).unwrap();
        assert_eq!(
            again.reply.region_id, region_id,
            "{provider}: the same region"
        );
        assert_ne!(
            again.region().rkey,
            old.rkey,
            "{provider}: the same rkey after a restart"
        );
        let guessed = RemoteAddr {
            rkey: old.rkey,
            ..again.region()
        };
        assert!(
            refused(again.add_at(guessed, 1)),
            "{provider}: an rkey of the previous run worked"
        );
    }
}

/// Node n2 adds to the slot of a lease on n1: the adds land in n2's
/// window, are never stored for n1's lease, and are counted as rejected;
/// n1's own adds and n2's adds to its own lease are stored.
#[test]
fn a_node_cannot_add_to_another_nodes_lease() {
    for provider in PROVIDERS {
        let env = Env::new("sqlite");
        let acct = start(&env, provider);
        let mut a = Peer::hello(provider, acct.fabric_addr(), &env.node_ticket("n1")).unwrap();
        let mut b = Peer::hello(provider, acct.fabric_addr(), &env.node_ticket("n2")).unwrap();
        env.insert_lease_on(21, "physics", false, "n1");
        env.insert_lease_on(22, "physics", false, "n2");
        env.assign("acct1", 1, 21);
        env.assign("acct1", 2, 22);
        let theirs = RemoteAddr {
            addr: b.region().addr + word_offset(1, Counter::ComputeNs),
            ..b.region()
        };
        b.add_at(theirs, 1_000_000_000_000_000)
            .expect("the add lands in b's own window");
        a.add(1, Counter::ComputeNs, 7).unwrap();
        b.add(2, Counter::ComputeNs, 9).unwrap();

        wait_until("the foreign add is counted", TIMEOUT, || {
            acct.metric("rfaas_accounting_rejected_adds_total{reason=\"foreign_slot\"}")
                >= Some(1.0)
        });
        let only = |n| SlotTotals::from_words([0, n, 0, 0, 0, 0, 0, 0]);
        wait_for_usage(&env, 21, &only(7));
        wait_for_usage(&env, 22, &only(9));
        assert_eq!(a.read_slot(1).unwrap(), only(7), "{provider}");
        assert_eq!(
            b.read_slot(1).unwrap(),
            SlotTotals::default(),
            "{provider}: the foreign add was taken out"
        );
        // Later flushes keep n1's lease at what n1 added.
        a.add(1, Counter::ComputeNs, 1).unwrap();
        assert_eq!(wait_for_usage(&env, 21, &only(8)).totals, only(8));
    }
}

/// Revoking a node's credential through the manager's API closes the
/// connections admitted under it: the service looks up the credentials of
/// its connections every second (`credentials::WATCH`), so within a few
/// seconds the connection is gone, counted, and the node's adds land no
/// more; a new hello with the same, unexpired ticket is refused. Another
/// node's connection stays. The poll's bound (10 s) is generous, not the
/// mechanism's period.
fn revoking(kind: &str, provider: &str) {
    let env = Env::new(kind);
    let acct = start(&env, provider);
    let cred = env.node_credential("n1");
    let ticket = env.ticket_for("n1", &cred);
    let mut daemon = Peer::hello(provider, acct.fabric_addr(), &ticket).unwrap();
    assert_eq!(daemon.reply.status, ReplyStatus::Accepted, "{provider}");
    let mut bystander = Peer::hello(provider, acct.fabric_addr(), &env.node_ticket("n2")).unwrap();
    assert_eq!(bystander.reply.status, ReplyStatus::Accepted, "{provider}");
    env.insert_lease(11, "physics", false);
    env.assign("acct1", 2, 11);
    env.insert_lease_on(12, "physics", false, "n2");
    env.assign("acct1", 3, 12);
    daemon.add(2, Counter::ComputeNs, 5).unwrap();

    let (status, body) = env.manager.admin().call(
        "DELETE",
        &format!("/v1/credentials/{}", credential_id(&cred)),
        None,
    );
    assert!((200..300).contains(&status), "revoke: {status} {body}");
    wait_until(
        "the revoked node's connection is closed",
        Duration::from_secs(10),
        || acct.metric("rfaas_accounting_revoked_connections_total") == Some(1.0),
    );
    assert_eq!(
        acct.metric("rfaas_accounting_connections"),
        Some(1.0),
        "{provider}: the other node's connection stays"
    );
    let add = daemon.add(2, Counter::ComputeNs, 1_000_000_000);
    assert!(
        refused(add),
        "{provider}: an add after the revocation: {add:?}"
    );
    let again = Peer::hello(provider, acct.fabric_addr(), &ticket).unwrap();
    assert_eq!(again.reply.status, ReplyStatus::BadCredential, "{provider}");
    bystander.add(3, Counter::ComputeNs, 9).unwrap();

    wait_for_usage(&env, 11, &SlotTotals::from_words([0, 5, 0, 0, 0, 0, 0, 0]));
    wait_for_usage(&env, 12, &SlotTotals::from_words([0, 9, 0, 0, 0, 0, 0, 0]));
    assert_eq!(
        acct.metric("rfaas_accounting_revoked_connections_total"),
        Some(1.0),
        "{provider}"
    );
}

fn revoking_a_credential_closes_its_connections(kind: &str) {
    for provider in PROVIDERS {
        revoking(kind, provider);
    }
}
on_both!(revoking_a_credential_closes_its_connections);

#[test]
#[ignore = "needs an RDMA device: scripts/test-verbs.sh runs it under Soft-RoCE (--features verbs)"]
fn revoking_a_credential_closes_its_connections_over_verbs() {
    revoking("sqlite", verbs());
}

/// A ticket signed by another key with the manager's key id, and one that
/// ended, are refused: the answer names no region, and the connection
/// adds nothing.
fn bad_tickets(provider: &str) {
    let env = Env::new("sqlite");
    let acct = start(&env, provider);
    env.insert_lease(11, "physics", false);
    env.assign("acct1", 2, 11);
    for (what, ticket) in [
        ("forged", env.forged_ticket("n1")),
        ("expired", env.expired_ticket("n1", 120)),
    ] {
        let mut p = Peer::hello(provider, acct.fabric_addr(), &ticket).unwrap();
        assert_eq!(
            p.reply.status,
            ReplyStatus::BadCredential,
            "{provider}: {what}"
        );
        assert_eq!(
            (p.reply.region_addr, p.reply.region_rkey),
            (0, 0),
            "{provider}: {what}"
        );
        assert!(
            p.read_slot(2).is_err(),
            "{provider}: {what}: read after a refusal"
        );
    }
    let mut daemon = Peer::hello(provider, acct.fabric_addr(), &env.node_ticket("n1")).unwrap();
    assert_eq!(daemon.reply.status, ReplyStatus::Accepted, "{provider}");
    assert_eq!(
        daemon.read_slot(2).unwrap(),
        SlotTotals::default(),
        "{provider}"
    );
}

#[test]
fn forged_and_expired_tickets_are_refused() {
    for provider in PROVIDERS {
        bad_tickets(provider);
    }
}

#[test]
#[ignore = "needs an RDMA device: scripts/test-verbs.sh runs it under Soft-RoCE (--features verbs)"]
fn forged_and_expired_tickets_are_refused_over_verbs() {
    bad_tickets(verbs());
}

//! Liveness without a database write per heartbeat: heartbeats that
//! change nothing are noted in memory and written in each replica's
//! round, a silent node is still lost, a replica's death loses none of
//! the nodes it heard, and ended leases are answered from memory.

mod common;

use std::time::{Duration, Instant};

use common::*;
use rfaas_testkit::manager::Api;
use rfaas_testkit::on_both;
use rfaas_testkit::wait::wait_for;
use serde_json::{json, Value};

fn beat(node: &Api, name: &str, held: &[u64]) -> Value {
    let allocations: Vec<Value> = held
        .iter()
        .map(|id| json!({"lease_id": id, "cores": 1, "memory_mib": 64}))
        .collect();
    let hb = json!({"free_cores": 1, "free_memory_mib": 512, "allocations": allocations});
    let (s, r) = node.call("POST", &format!("/v1/nodes/{name}/heartbeat"), Some(&hb));
    assert_eq!(s, 200, "heartbeat of {name}: {r}");
    r
}

/// `name`'s `last_heartbeat_ms` in the database itself.
fn stored_heartbeat(db: &Db, name: &str) -> u64 {
    let rows = db.sql(&[&format!(
        "SELECT last_heartbeat_ms FROM nodes WHERE name = '{name}'"
    )]);
    rows[0][0] as u64
}

fn heartbeats(m: &rfaas_testkit::manager::Manager, path: &str) -> f64 {
    metric(
        m,
        &format!("rfaas_manager_heartbeats_total{{path=\"{path}\"}}"),
    )
}

fn a_heartbeat_that_changes_nothing_is_written_in_a_batch_not_at_once(kind: &str) {
    let mut db = Db::new(kind);
    // No rounds while the test runs: only a stop writes.
    let mut m = db.manager_with("lost_after_ms = 600000\nrefresh_ms = 3600000\n", None);
    let node = register(&m, "a", 2, 1024);
    let registered = stored_heartbeat(&db, "a");
    let admin = m.admin();
    let seen = wait_for(
        "a heartbeat later than the registration",
        Duration::from_secs(10),
        || {
            let r = beat(&node, "a", &[]);
            assert_eq!(r["heartbeat_interval_ms"], 200, "{r}");
            let (_, n) = admin.call("GET", "/v1/nodes/a", None);
            let t = n["last_heartbeat_ms"].as_u64().unwrap();
            (t > registered).then_some(t)
        },
    );
    for _ in 0..5 {
        beat(&node, "a", &[]);
    }
    assert!(heartbeats(&m, "memory") >= 6.0);
    assert_eq!(
        heartbeats(&m, "database"),
        0.0,
        "nothing changed: nothing written at once"
    );
    assert_eq!(
        stored_heartbeat(&db, "a"),
        registered,
        "the database is not written per heartbeat"
    );
    let (_, fresh) = admin.call("GET", "/v1/nodes?fresh=true", None);
    assert_eq!(
        fresh[0]["last_heartbeat_ms"].as_u64(),
        Some(registered),
        "{fresh}"
    );
    // A stopping replica writes what it heard.
    m.stop();
    assert!(
        stored_heartbeat(&db, "a") >= seen,
        "the stop wrote the newest heartbeat"
    );
}
on_both!(a_heartbeat_that_changes_nothing_is_written_in_a_batch_not_at_once);

fn rounds_write_heartbeats_and_a_silent_node_is_still_lost(kind: &str) {
    let mut db = Db::new(kind);
    let m = db.manager_with("lost_after_ms = 2000\nrefresh_ms = 100\n", None);
    let a = register(&m, "a", 2, 1024);
    let b = register(&m, "b", 2, 1024);
    let admin = m.admin();
    let registered = stored_heartbeat(&db, "a");
    // Both heartbeat until a round has written a's.
    wait_for(
        "a round to write a's heartbeat",
        Duration::from_secs(10),
        || {
            beat(&a, "a", &[]);
            beat(&b, "b", &[]);
            std::thread::sleep(Duration::from_millis(100));
            (stored_heartbeat(&db, "a") > registered).then_some(())
        },
    );
    assert!(metric(&m, "rfaas_manager_heartbeats_written_total") >= 1.0);
    // b falls silent, a goes on: b is lost within lost_after and a round
    // or two, a never.
    let silent = Instant::now();
    let lost_after = wait_for("b to be lost", Duration::from_secs(15), || {
        beat(&a, "a", &[]);
        let (_, na) = admin.call("GET", "/v1/nodes/a", None);
        assert_eq!(na["state"], "up", "a heartbeats and must stay up: {na}");
        std::thread::sleep(Duration::from_millis(100));
        let (_, nb) = admin.call("GET", "/v1/nodes/b", None);
        (nb["state"] == "lost").then(|| silent.elapsed())
    });
    assert!(
        lost_after >= Duration::from_millis(1500),
        "b was lost too early: {lost_after:?}"
    );
    // b comes back with a heartbeat (written at once: it changes b).
    let before = heartbeats(&m, "database");
    beat(&b, "b", &[]);
    assert_eq!(heartbeats(&m, "database"), before + 1.0);
    let (_, nb) = admin.call("GET", "/v1/nodes/b", None);
    assert_eq!(nb["state"], "up", "{nb}");
}
on_both!(rounds_write_heartbeats_and_a_silent_node_is_still_lost);

fn ended_leases_are_answered_from_memory(kind: &str) {
    let mut db = Db::new(kind);
    let m = db.manager_with("lost_after_ms = 600000\nrefresh_ms = 100\n", None);
    let node = register(&m, "a", 2, 1024);
    let u = user(&m, "alice", "physics");
    let g = granted(&u, 1, 64, 600);
    let lease_id = g["leases"][0]["lease_id"].as_u64().unwrap();
    let r = beat(&node, "a", &[lease_id]);
    assert_eq!(r["ended_leases"], json!([]), "{r}");
    let (s, e) = u.call("DELETE", &format!("/v1/leases/{}", g["id"]), None);
    assert_eq!(s, 204, "{e}");
    let written = heartbeats(&m, "database");
    let r = wait_for(
        "the heartbeat to list the released lease",
        Duration::from_secs(10),
        || {
            let r = beat(&node, "a", &[lease_id, 999_999]);
            (r["ended_leases"] == json!([lease_id])).then_some(r)
        },
    );
    assert_eq!(
        r["ended_leases"],
        json!([lease_id]),
        "only the ended lease: {r}"
    );
    assert_eq!(
        heartbeats(&m, "database"),
        written,
        "answered without the database"
    );
}
on_both!(ended_leases_are_answered_from_memory);

/// Two replicas: the node heartbeats the first, which is killed (what it
/// heard and did not write is gone), then the second. The node is never
/// lost.
#[test]
fn a_replica_killed_loses_none_of_the_nodes_it_heard() {
    let mut db = Db::new("postgres");
    let config = "lost_after_ms = 3000\nrefresh_ms = 100\n";
    let mut m1 = db.manager_with(config, None);
    let m2 = db.manager_with(config, Some(&m1));
    let on_1 = register(&m1, "a", 2, 1024);
    let on_2 = Api::new(m2.url(), on_1.token());
    let watch = m2.admin();
    let up = |api: &Api| {
        let (_, n) = api.call("GET", "/v1/nodes/a", None);
        assert_eq!(
            n["state"], "up",
            "the node heartbeats and must stay up: {n}"
        );
    };
    wait_for(
        "the second replica to see the node",
        Duration::from_secs(10),
        || {
            let (s, _) = watch.call("GET", "/v1/nodes/a", None);
            (s == 200).then_some(())
        },
    );
    let until = Instant::now() + Duration::from_secs(2);
    while Instant::now() < until {
        beat(&on_1, "a", &[]);
        up(&watch);
        std::thread::sleep(Duration::from_millis(200));
    }
    m1.kill();
    // Longer than lost_after, heartbeating the other replica.
    let until = Instant::now() + Duration::from_secs(5);
    while Instant::now() < until {
        beat(&on_2, "a", &[]);
        up(&watch);
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(metric(&m2, "rfaas_manager_lost_nodes_total"), 0.0);
    assert_eq!(db.sql(&["SELECT lost FROM nodes WHERE name = 'a'"]), [[0]]);
}

/// The interval grows with the fleet past `heartbeats_per_s`, and so does
/// the loss timeout; nodes hear it in every heartbeat reply.
#[test]
fn the_heartbeat_interval_grows_with_the_fleet() {
    let mut db = Db::new("sqlite");
    let m = db.manager_with(
        "heartbeats_per_s = 10\nheartbeat_interval_ms = 200\nlost_after_ms = 1000\nrefresh_ms = 100\n",
        None,
    );
    let first = register(&m, "n0", 1, 256);
    assert_eq!(beat(&first, "n0", &[])["heartbeat_interval_ms"], 200);
    for k in 1..5 {
        register(&m, &format!("n{k}"), 1, 256);
    }
    // Five nodes at ten heartbeats a second: every 500 ms, once the
    // replica's view (read again every 100 ms) holds the last of them; a
    // loaded machine can answer the first heartbeat from a view of four.
    let interval = wait_for("a view of five nodes", Duration::from_secs(5), || {
        let ms = beat(&first, "n0", &[])["heartbeat_interval_ms"].as_u64()?;
        (ms >= 500).then_some(ms)
    });
    assert_eq!(interval, 500);
    let cred = m.credential("node", "n5", None);
    let (s, r) =
        Api::new(m.url(), &cred).call("PUT", "/v1/nodes/n5", Some(&node_body(7100, 1, 256)));
    assert_eq!(s, 200, "{r}");
    assert_eq!(r["heartbeat_interval_ms"], 600, "{r}");
    assert_eq!(r["lost_after_ms"], 3 * 600 + 2 * 100 + 2000, "{r}");
    // What the replica hands out, for the lag alert.
    assert_eq!(metric(&m, "rfaas_manager_heartbeat_interval_seconds"), 0.6);
    assert_eq!(metric(&m, "rfaas_manager_lost_after_seconds"), 4.0);
}

/// A verified credential is not read again at every request: each round
/// reads the revocations instead, so a revocation on one replica takes
/// effect on the others within a round, and a row changed behind the
/// replicas' back (no revocation time) is not re-read within
/// `CACHE_TTL`.
fn revocations_reach_every_replica_in_a_round(kind: &str) {
    let mut db = Db::new(kind);
    let config = "lost_after_ms = 600000\nrefresh_ms = 100\n";
    let m1 = db.manager_with(config, None);
    let m2 = db.manager_with(config, Some(&m1));
    let on_1 = register(&m1, "a", 2, 1024);
    let on_2 = Api::new(m2.url(), on_1.token());
    let id = on_1.token().split('.').nth(1).unwrap().to_owned();
    beat(&on_2, "a", &[]);
    // Behind the replicas' back: the cache is trusted past CACHE_TTL.
    db.sql(&[&format!(
        "UPDATE credentials SET revoked = 1 WHERE id = '{id}'"
    )]);
    std::thread::sleep(rfaas_service::credentials::CACHE_TTL + Duration::from_secs(1));
    beat(&on_2, "a", &[]);
    db.sql(&[&format!(
        "UPDATE credentials SET revoked = 0 WHERE id = '{id}'"
    )]);
    // Revoked on the first replica: the second refuses within a round.
    let (s, e) = m1
        .admin()
        .call("DELETE", &format!("/v1/credentials/{id}"), None);
    assert_eq!(s, 204, "{e}");
    let hb = json!({"free_cores": 1, "free_memory_mib": 512, "allocations": []});
    let refused = wait_for(
        "the second replica to refuse the credential",
        Duration::from_secs(3),
        || {
            let (s, _) = on_2.call("POST", "/v1/nodes/a/heartbeat", Some(&hb));
            (s == 401).then_some(s)
        },
    );
    assert_eq!(refused, 401);
}
on_both!(revocations_reach_every_replica_in_a_round);

/// A round reads only the heartbeat times the replicas wrote, not every
/// node's row; still, a node heard by one replica shows as heard in the
/// other's view (and its heartbeat-lag gauge) within a few rounds.
fn a_round_reads_other_replicas_heartbeats_not_every_row(kind: &str) {
    let mut db = Db::new(kind);
    let config = "lost_after_ms = 600000\nrefresh_ms = 100\n";
    let m1 = db.manager_with(config, None);
    let m2 = db.manager_with(config, Some(&m1));
    let on_1 = register(&m1, "a", 2, 1024);
    let registered = stored_heartbeat(&db, "a");
    let reads = |m: &rfaas_testkit::manager::Manager, read: &str| {
        metric(
            m,
            &format!("rfaas_manager_view_reads_total{{read=\"{read}\"}}"),
        )
    };
    let full_before = reads(&m2, "full");
    let seen = wait_for(
        "the second replica to see a heartbeat the first heard",
        Duration::from_secs(10),
        || {
            beat(&on_1, "a", &[]);
            std::thread::sleep(Duration::from_millis(100));
            let (_, n) = m2.admin().call("GET", "/v1/nodes/a", None);
            let t = n["last_heartbeat_ms"].as_u64().unwrap();
            (t > registered).then_some(t)
        },
    );
    assert!(seen > registered);
    let heard_before = reads(&m2, "heard");
    wait_for(
        "more rounds to read heartbeat times",
        Duration::from_secs(10),
        || (reads(&m2, "heard") >= heard_before + 3.0).then_some(()),
    );
    assert!(
        reads(&m2, "full") <= full_before + 1.0,
        "rounds must not reload every row each time: {} full reads",
        reads(&m2, "full") - full_before
    );
}
on_both!(a_round_reads_other_replicas_heartbeats_not_every_row);

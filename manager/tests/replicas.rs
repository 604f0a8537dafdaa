//! Replicas on one database under a storm of concurrent requests: no core
//! leased twice, no granted lease lost, through a replica's kill -9 and a
//! PostgreSQL restart.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use rfaas_testkit::manager::{Api, Manager};
use rfaas_testkit::on_both;
use rfaas_testkit::wait::{poll_for, wait_until};
use serde_json::{json, Value};

/// What one storm saw: the grants it holds (id → cores per node), how
/// many requests got each status, and the billing slot of every node lease
/// granted (by lease id; released ones too).
#[derive(Debug, Default)]
struct Seen {
    held: Vec<(u64, Vec<(String, u64)>)>,
    statuses: std::collections::BTreeMap<u16, u32>,
    slots: Vec<(u64, Option<(String, u64)>)>,
}

/// `threads` clients, each sending `per_thread` lease requests round-robin
/// over `urls`, releasing about a third of what they get.
fn storm(urls: &[String], tokens: &[String], threads: usize, per_thread: usize, seed: u64) -> Seen {
    let seen = Arc::new(Mutex::new(Seen::default()));
    std::thread::scope(|s| {
        for t in 0..threads {
            let seen = seen.clone();
            let token = tokens[t % tokens.len()].clone();
            s.spawn(move || {
                let mut rng = fastrand::Rng::with_seed(seed + t as u64);
                for k in 0..per_thread {
                    let api = Api::new(&urls[(t + k) % urls.len()], &token);
                    let cores = rng.u32(1..=4);
                    let body = json!({"cores": cores, "min_cores": rng.u32(1..=cores), "memory_mib": 64, "duration_s": 600});
                    let (status, g) = api.call("POST", "/v1/leases", Some(&body));
                    let mut seen_now = seen.lock().unwrap();
                    *seen_now.statuses.entry(status).or_default() += 1;
                    if status != 201 {
                        continue;
                    }
                    let id = g["id"].as_u64().unwrap();
                    let parts: Vec<(String, u64)> = g["leases"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|l| (l["node"].as_str().unwrap().to_owned(), l["cores"].as_u64().unwrap()))
                        .collect();
                    for l in g["leases"].as_array().unwrap() {
                        let slot = l["billing"].as_object().map(|b| {
                            (b["instance"].as_str().unwrap().to_owned(), b["slot"].as_u64().unwrap())
                        });
                        seen_now.slots.push((l["lease_id"].as_u64().unwrap(), slot));
                    }
                    drop(seen_now);
                    if rng.u32(0..3) == 0 {
                        let (s, e) = api.call("DELETE", &format!("/v1/leases/{id}"), None);
                        if s == 204 {
                            continue;
                        }
                        // The replica died under the release: the lease
                        // may or may not be released; release it elsewhere.
                        let other = Api::new(&urls[(t + k + 1) % urls.len()], &token);
                        let (s2, e2) = other.call("DELETE", &format!("/v1/leases/{id}"), None);
                        assert_eq!(s2, 204, "release: {s} {e}, then {s2} {e2}");
                        continue;
                    }
                    seen.lock().unwrap().held.push((id, parts));
                }
            });
        }
    });
    Arc::try_unwrap(seen).unwrap().into_inner().unwrap()
}

/// Every grant the storm holds is active in the database, with exactly
/// the cores it was told, and the counters agree with the leases. Active
/// leases no client holds are allowed only for requests that got no
/// answer (a replica killed between its commit and its reply): at most
/// one grant each. Those end at their expiry.
fn check_held(m: &Manager, seen: &Seen) {
    let (s, leases) = m.admin().call("GET", "/v1/leases?limit=100000", None);
    assert_eq!(s, 200);
    let active: Vec<&Value> = leases.as_array().unwrap().iter().collect();
    let mut expected = 0u64;
    for (id, parts) in &seen.held {
        let mut got: Vec<(String, u64)> = active
            .iter()
            .filter(|l| l["grant_id"] == *id && l["state"] == "active")
            .map(|l| {
                (
                    l["node"].as_str().unwrap().to_owned(),
                    l["cores"].as_u64().unwrap(),
                )
            })
            .collect();
        got.sort();
        let mut want = parts.clone();
        want.sort();
        assert_eq!(got, want, "grant {id} as granted and as stored");
        expected += want.iter().map(|p| p.1).sum::<u64>();
    }
    let held_ids: std::collections::HashSet<u64> = seen.held.iter().map(|h| h.0).collect();
    let orphans: std::collections::HashSet<u64> = active
        .iter()
        .filter(|l| l["state"] == "active")
        .map(|l| l["grant_id"].as_u64().unwrap())
        .filter(|g| !held_ids.contains(g))
        .collect();
    let unanswered = seen.statuses.get(&0).copied().unwrap_or(0) as usize;
    assert!(
        orphans.len() <= unanswered,
        "{} active grants no client holds, but only {unanswered} requests went unanswered",
        orphans.len()
    );
    let orphan_cores: u64 = active
        .iter()
        .filter(|l| l["state"] == "active" && orphans.contains(&l["grant_id"].as_u64().unwrap()))
        .map(|l| l["cores"].as_u64().unwrap())
        .sum();
    assert_eq!(
        check_no_core_leased_twice(m),
        expected + orphan_cores,
        "the nodes' counters and the active leases disagree"
    );
}

/// The storms' nodes do not heartbeat: keep them from being lost.
const QUIET_NODES: &str = "lost_after_ms = 600000\n";

/// Fewer billing slots than the storm's node leases (it must grant at
/// least 40), over two live instances and a dead one: grants compete for
/// the last slots too.
fn add_instances(db: &Db) {
    db.add_instance("acct-a", 16, rfaas_service::now_ms());
    db.add_instance("acct-b", 16, rfaas_service::now_ms());
    db.add_instance("acct-dead", 100, 1);
}

/// Every billing slot the storm was given went to one node lease only,
/// from a live instance, and the database agrees: the slots that hold a
/// lease are exactly those the clients were given.
fn check_slots(db: &Db, seen: &Seen) {
    let mut given = std::collections::HashMap::new();
    for (lease, slot) in &seen.slots {
        let Some((instance, slot)) = slot else {
            continue;
        };
        assert_ne!(instance, "acct-dead", "lease {lease} on a dead instance");
        if let Some(other) = given.insert((instance.clone(), *slot), *lease) {
            panic!("slot {slot} of {instance} given to leases {other} and {lease}");
        }
    }
    let rows = db.sql(&[
        "SELECT CASE instance WHEN 'acct-a' THEN 0 WHEN 'acct-b' THEN 1 ELSE 2 END, slot, lease_id
         FROM billing_slots WHERE lease_id <> 0",
    ]);
    let stored: std::collections::HashMap<(String, u64), u64> = rows
        .iter()
        .map(|r| {
            let instance = ["acct-a", "acct-b", "acct-dead"][r[0] as usize];
            ((instance.to_owned(), r[1] as u64), r[2] as u64)
        })
        .collect();
    assert_eq!(stored, given, "the slots as stored and as granted");
    let unbilled = seen.slots.iter().filter(|s| s.1.is_none()).count();
    assert!(
        !given.is_empty() && unbilled > 0,
        "the storm must use the slots up: {} billed, {unbilled} not",
        given.len()
    );
}

fn three_replicas_never_lease_a_core_twice(kind: &str) {
    let mut db = Db::new(kind);
    let quiet = format!("{QUIET_NODES}{ACCOUNTING}");
    let first = db.manager_with(&quiet, None);
    add_instances(&db);
    wait_for_instances(&first, 2, 1);
    let replicas = [
        db.manager_with(&quiet, Some(&first)),
        db.manager_with(&quiet, Some(&first)),
    ];
    // A few nodes, fewer cores than the storm asks for: grants compete
    // for the last cores, and some are refused.
    for k in 0..4 {
        register(&first, &format!("n{k}"), 24, 8192);
    }
    let tokens: Vec<String> = (0..4)
        .map(|k| first.credential("user", &format!("u{k}"), Some("physics")))
        .collect();
    let urls: Vec<String> = std::iter::once(&first)
        .chain(replicas.iter())
        .map(|m| m.url().to_owned())
        .collect();
    let seen = storm(&urls, &tokens, 24, 15, 7);
    assert_eq!(seen.statuses.values().sum::<u32>(), 360);
    let granted = seen.statuses.get(&201).copied().unwrap_or(0);
    let refused = seen.statuses.get(&503).copied().unwrap_or(0);
    assert!(
        granted >= 40 && refused > 0,
        "the storm must fill the pool: {:?}",
        seen.statuses
    );
    for status in seen.statuses.keys() {
        assert!(
            *status == 201 || *status == 503,
            "unexpected status {status}: {:?}",
            seen.statuses
        );
    }
    check_held(&first, &seen);
    check_slots(&db, &seen);
    let unbilled: f64 = std::iter::once(&first)
        .chain(replicas.iter())
        .map(|m| metric(m, "rfaas_manager_unbilled_leases_total"))
        .sum();
    assert_eq!(
        unbilled as usize,
        seen.slots.iter().filter(|s| s.1.is_none()).count(),
        "unbilled leases as counted and as granted"
    );
}
on_both!(three_replicas_never_lease_a_core_twice);

fn kill_9_of_a_replica_loses_no_granted_lease(kind: &str) {
    let mut db = Db::new(kind);
    let first = db.manager_with(QUIET_NODES, None);
    let mut victim = db.manager_with(QUIET_NODES, Some(&first));
    for k in 0..3 {
        register(&first, &format!("n{k}"), 64, 16384);
    }
    let tokens: Vec<String> = (0..3)
        .map(|k| first.credential("user", &format!("u{k}"), Some("physics")))
        .collect();
    let urls = vec![first.url().to_owned(), victim.url().to_owned()];
    let seen = std::thread::scope(|s| {
        let storm = s.spawn(|| storm(&urls, &tokens, 16, 20, 11));
        // Kill it once it has served part of the storm.
        wait_until(
            "the victim replica to grant 20 leases",
            Duration::from_secs(30),
            || victim.log().matches("lease granted").count() >= 20,
        );
        victim.kill();
        storm.join().unwrap()
    });
    assert!(
        seen.statuses.get(&0).copied().unwrap_or(0) > 0,
        "the kill hit no request: {:?}",
        seen.statuses
    );
    check_held(&first, &seen);
}
on_both!(kill_9_of_a_replica_loses_no_granted_lease);

/// A node registered at one replica shows in another's view long before
/// that replica's own reload (an hour here): through notices on
/// PostgreSQL, through SQLite's change counter on SQLite. A grant there
/// then shows in the first replica's view too.
fn other_replicas_see_changes_without_reloading(kind: &str) {
    let mut db = Db::new(kind);
    let slow = format!("{QUIET_NODES}refresh_ms = 3600000\n");
    let a = db.manager_with(&slow, None);
    let b = db.manager_with(&slow, Some(&a));
    let listed = |m: &Manager| -> Vec<Value> {
        let (status, nodes) = m.admin().call("GET", "/v1/nodes", None);
        assert_eq!(status, 200, "{nodes}");
        nodes.as_array().cloned().unwrap_or_default()
    };
    register(&a, "seen", 8, 4096);
    let within = Duration::from_secs(20);
    poll_for(within, || {
        listed(&b).iter().any(|n| n["name"] == "seen").then_some(())
    })
    .unwrap_or_else(|| {
        panic!(
            "replica b did not see the node within {within:?}: {}",
            b.log()
        )
    });
    let u = Api::new(b.url(), &b.credential("user", "u", Some("physics")));
    let (status, grant) = lease(&u, 3, None, 256, 600);
    assert_eq!(status, 201, "{grant}");
    let leased = |m: &Manager| {
        listed(m)
            .iter()
            .find(|n| n["name"] == "seen")
            .map(|n| n["leased_cores"].as_u64())
    };
    let wait_for_leased = |cores: u64, what: &str| {
        let mut last = None;
        poll_for(within, || {
            last = leased(&a);
            (last == Some(Some(cores))).then_some(())
        })
        .unwrap_or_else(|| {
            panic!("replica a did not see the {what} within {within:?}: leased cores {last:?}")
        });
    };
    wait_for_leased(3, "grant");
    // A burst of grants and releases on b: a ends with the last counters,
    // whatever order their batches came in.
    let mut ids = Vec::new();
    for _ in 0..4 {
        let (status, g) = lease(&u, 1, None, 256, 600);
        assert_eq!(status, 201, "{g}");
        ids.push(g["id"].as_u64().expect("id"));
    }
    ids.push(grant["id"].as_u64().expect("id"));
    for id in ids.iter().skip(1) {
        let (status, e) = u.call("DELETE", &format!("/v1/leases/{id}"), None);
        assert_eq!(status, 204, "{e}");
    }
    wait_for_leased(1, "releases");
}
on_both!(other_replicas_see_changes_without_reloading);

#[test]
fn postgres_restart_makes_grants_wait_then_resume_with_leases_intact() {
    let mut db = Db::new("postgres");
    let m = db.manager_that_loses_nodes();
    let nodes: Vec<Api> = (0..2)
        .map(|k| register(&m, &format!("n{k}"), 64, 65536))
        .collect();
    // The nodes heartbeat throughout, as executord does, until the test
    // ends, by success or by a failed assertion (the guard).
    let stop = AtomicBool::new(false);
    let u = user(&m, "alice", "physics");
    struct StopOnDrop<'a>(&'a AtomicBool);
    impl Drop for StopOnDrop<'_> {
        fn drop(&mut self) {
            self.0.store(true, Ordering::Relaxed);
        }
    }
    std::thread::scope(|s| {
        let _stop = StopOnDrop(&stop);
        for (k, node) in nodes.iter().enumerate() {
            let stop = &stop;
            s.spawn(move || {
                let hb = json!({"free_cores": 64, "free_memory_mib": 65536, "allocations": []});
                while !stop.load(Ordering::Relaxed) {
                    let _ = node.call("POST", &format!("/v1/nodes/n{k}/heartbeat"), Some(&hb));
                    // The heartbeat period, as executord keeps one: it
                    // paces the beats and orders nothing.
                    std::thread::sleep(Duration::from_millis(100));
                }
            });
        }
        let mut before = Vec::new();
        for _ in 0..10 {
            let (st, g) = lease(&u, 2, None, 64, 600);
            assert_eq!(st, 201, "{g}");
            before.push(g["id"].as_u64().unwrap());
        }
        let Db::Postgres(pg) = &mut db else {
            unreachable!()
        };
        pg.stop().unwrap();
        let (st, retry, e) = u.call_full(
            "POST",
            "/v1/leases",
            Some(&json!({"cores": 1, "memory_mib": 64, "duration_s": 60})),
        );
        assert_eq!(
            (st, e["error"].as_str()),
            (503, Some("database_unavailable")),
            "{e}"
        );
        assert!(retry.is_some(), "a 503 without Retry-After");
        // healthz says what the background round found (every
        // refresh_ms), so the outage shows at its next round.
        let open = Api::new(m.url(), "");
        wait_until(
            "healthz to answer 503 while the database is down",
            Duration::from_secs(20),
            || open.call("GET", "/healthz", None).0 == 503,
        );
        // Down for longer than lost_after (1 s): no node may be lost for
        // it. The outage's length is what this test is about, so it is
        // slept; what follows waits for the reaper, not for time.
        std::thread::sleep(Duration::from_millis(1500));
        pg.start_again().unwrap();
        let (st, g) = wait_for_grant(&u);
        assert_eq!(st, 201, "{g}");
        // A node that never heartbeats, registered now: once the reaper
        // has marked it lost, it has run a round that may mark nodes lost
        // after the outage, and the heartbeating nodes must have come
        // through that round.
        register(&m, "canary", 1, 64);
        let admin = m.admin();
        wait_until(
            "the reaper to mark the silent canary node lost",
            Duration::from_secs(20),
            || admin.call("GET", "/v1/nodes/canary", None).1["state"] == "lost",
        );
        for id in &before {
            let (st, l) = u.call("GET", &format!("/v1/leases/{id}"), None);
            assert_eq!(st, 200, "{l}");
            assert_eq!(
                l[0]["state"], "active",
                "lease {id} ended by the outage: {l}"
            );
        }
        stop.store(true, Ordering::Relaxed);
    });
    assert_eq!(check_no_core_leased_twice(&m), 21);
}

/// Asks for a lease until one is granted (up to 20 s, then returns the
/// last answer); every refusal on the way must be a 503.
fn wait_for_grant(u: &Api) -> (u16, Value) {
    let mut last = None;
    poll_for(Duration::from_secs(20), || {
        let r = lease(u, 1, None, 64, 600);
        if r.0 == 201 {
            return Some(r);
        }
        assert_eq!(r.0, 503, "{}", r.1);
        last = Some(r);
        None
    })
    .or(last)
    .expect("at least one answer")
}

//! The manager's REST API against a real `rfaas-manager`, each test on
//! SQLite and on a real PostgreSQL server.

mod common;

use std::time::Duration;

use common::*;
use rfaas_testkit::manager::Api;
use rfaas_testkit::on_both;
use rfaas_testkit::wait::{poll_for, wait_for};
use serde_json::json;

fn nodes_register_heartbeat_drain_resume(kind: &str) {
    let mut db = Db::new(kind);
    let m = db.manager();
    let n1 = register(&m, "n1", 4, 4096);
    // Registering again is idempotent.
    let (s, again) = n1.call("PUT", "/v1/nodes/n1", Some(&node_body(7100, 4, 4096)));
    assert_eq!(s, 200, "{again}");
    assert_eq!(again["node"]["state"], "up");
    assert_eq!(again["heartbeat_interval_ms"], 200);
    let hb = json!({"free_cores": 4, "free_memory_mib": 4096, "allocations": []});
    let (s, reply) = n1.call("POST", "/v1/nodes/n1/heartbeat", Some(&hb));
    assert_eq!((s, reply["ended_leases"].clone()), (200, json!([])));
    // A node credential speaks only for its node.
    let (s, e) = n1.call("PUT", "/v1/nodes/n2", Some(&node_body(7101, 2, 1024)));
    assert_eq!((s, e["error"].as_str()), (403, Some("forbidden")), "{e}");
    // An unknown node's heartbeat is told to register.
    let admin = m.admin();
    let (s, e) = admin.call("POST", "/v1/nodes/ghost/heartbeat", Some(&hb));
    assert_eq!((s, e["error"].as_str()), (404, Some("not_found")), "{e}");
    // Drain and resume, seen in the listing.
    let (s, v) = admin.call("POST", "/v1/nodes/n1/drain", None);
    assert_eq!((s, v["state"].as_str()), (200, Some("drained")), "{v}");
    let u = user(&m, "alice", "physics");
    let (s, e) = lease(&u, 1, None, 64, 60);
    assert_eq!(
        (s, e["error"].as_str()),
        (503, Some("no_capacity")),
        "a drained node is not offered: {e}"
    );
    let (s, v) = admin.call("POST", "/v1/nodes/n1/resume", None);
    assert_eq!((s, v["state"].as_str()), (200, Some("up")), "{v}");
    let (s, list) = u.call("GET", "/v1/nodes", None);
    assert_eq!(s, 200);
    assert_eq!(list[0]["name"], "n1");
    assert_eq!(list[0]["providers"][0]["host"], "127.0.0.1");
    // Users and nodes cannot drain.
    let (s, _) = u.call("POST", "/v1/nodes/n1/drain", None);
    assert_eq!(s, 403);
    let (s, _) = n1.call("POST", "/v1/nodes/n1/drain", None);
    assert_eq!(s, 403);
}
on_both!(nodes_register_heartbeat_drain_resume);

/// Each of `queries` on `path` is refused `400 malformed_request`, in
/// words.
fn malformed_queries(api: &Api, path: &str, queries: &[&str]) {
    for bad in queries {
        let (s, e) = api.call("GET", &format!("{path}?{bad}"), None);
        assert_eq!(
            (s, e["error"].as_str()),
            (400, Some("malformed_request")),
            "{bad}: {e}"
        );
        assert!(
            e["message"].as_str().is_some_and(|t| t.len() > 10),
            "{bad}: {e}"
        );
    }
}

/// rfaasctl's client for manager `m`, with `token`.
fn ctl_for(m: &rfaas_testkit::manager::Manager, token: &str) -> rfaas_manager::ctl::Ctl {
    rfaas_manager::ctl::Ctl::new(
        vec![m.url().to_owned()],
        token.to_owned(),
        None,
        rfaas_tls::PlainHttp::LoopbackOnly,
    )
    .expect("a client")
}

/// `GET /v1/nodes` pages by name, filtered, and `rfaas_manager::ctl`
/// follows the `Link` headers; from the view and, `fresh`, from the
/// database.
fn nodes_come_in_pages_that_ctl_follows(kind: &str) {
    use rfaas_proto::manager::NodeView;
    let mut db = Db::new(kind);
    let m = db.manager();
    for name in ["n4", "n1", "m1", "n3", "n5", "n2"] {
        register(&m, name, 2, 1024);
    }
    let admin = m.admin();
    let (s, v) = admin.call("POST", "/v1/nodes/n3/drain", None);
    assert_eq!(s, 200, "{v}");
    let ctl = ctl_for(&m, m.admin_token());
    let names = |path: &str| -> Vec<String> {
        let (_, nodes): (_, Vec<NodeView>) = ctl.get_pages(path).expect(path);
        nodes.into_iter().map(|n| n.name).collect()
    };
    let all = ["m1", "n1", "n2", "n3", "n4", "n5"];
    assert_eq!(names("/v1/nodes?limit=2"), all);
    assert_eq!(names("/v1/nodes?limit=1&fresh=true"), all);
    assert_eq!(names("/v1/nodes"), all);
    assert_eq!(names("/v1/nodes?state=drained&limit=1"), ["n3"]);
    assert_eq!(
        names("/v1/nodes?state=up&prefix=n&limit=1"),
        ["n1", "n2", "n4", "n5"]
    );
    assert_eq!(names("/v1/nodes?prefix=zz"), Vec::<String>::new());
    // One page without following: its rows only.
    let (s, page) = admin.call("GET", "/v1/nodes?limit=2", None);
    assert_eq!((s, page.as_array().map(Vec::len)), (200, Some(2)), "{page}");
    let (s, page) = admin.call("GET", "/v1/nodes?limit=100000", None);
    assert_eq!((s, page.as_array().map(Vec::len)), (200, Some(6)), "{page}");
    let (s, page) = admin.call("GET", "/v1/nodes?limit=2&after=n2", None);
    assert_eq!(page[0]["name"], "n3", "{s} {page}");
    malformed_queries(
        &admin,
        "/v1/nodes",
        &[
            "limit=0",
            "limit=many",
            "after=..",
            "state=sleepy",
            "colour=red",
        ],
    );
}
on_both!(nodes_come_in_pages_that_ctl_follows);

/// Registers node `name` in `partitions` with its own credential: the
/// status and reply.
fn register_in(
    m: &rfaas_testkit::manager::Manager,
    name: &str,
    partitions: serde_json::Value,
) -> (u16, serde_json::Value) {
    let api = Api::new(m.url(), &m.credential("node", name, None));
    let mut body = node_body(7100, 2, 1024);
    body["partitions"] = partitions;
    api.call("PUT", &format!("/v1/nodes/{name}"), Some(&body))
}

/// Nodes register their Slurm partitions: the views show them, a new
/// registration replaces them, bad names are refused with nothing stored,
/// and `GET /v1/nodes?partition=` pages the nodes of one partition
/// through the index of nodes by partition, with the other filters.
fn nodes_are_listed_by_partition_through_an_index(kind: &str) {
    use rfaas_proto::manager::NodeView;
    let mut db = Db::new(kind);
    let m = db.manager();
    for (name, parts) in [
        ("n4", json!(["batch", "gpu"])),
        ("n1", json!(["batch"])),
        ("m1", json!(["batch"])),
        ("n3", json!(["batch", "debug"])),
        ("n5", json!(["gpu"])),
        ("n2", json!(["batch"])),
        ("n6", json!([])),
    ] {
        let (s, r) = register_in(&m, name, parts.clone());
        assert_eq!(s, 200, "{name}: {r}");
        let shown = r["node"].get("partitions").cloned().unwrap_or(json!([]));
        assert_eq!(shown, parts, "{r}");
    }
    let admin = m.admin();
    let (s, v) = admin.call("POST", "/v1/nodes/n3/drain", None);
    assert_eq!(s, 200, "{v}");
    let ctl = ctl_for(&m, m.admin_token());
    let names = |path: &str| -> Vec<String> {
        let (_, nodes): (_, Vec<NodeView>) = ctl.get_pages(path).expect(path);
        nodes.into_iter().map(|n| n.name).collect()
    };
    assert_eq!(
        names("/v1/nodes?partition=batch&limit=1"),
        ["m1", "n1", "n2", "n3", "n4"]
    );
    assert_eq!(
        names("/v1/nodes?partition=batch&limit=2"),
        names("/v1/nodes?partition=batch")
    );
    assert_eq!(
        names("/v1/nodes?partition=batch&prefix=n&state=up&limit=1"),
        ["n1", "n2", "n4"]
    );
    assert_eq!(names("/v1/nodes?partition=gpu&limit=1"), ["n4", "n5"]);
    assert_eq!(names("/v1/nodes?partition=none"), Vec::<String>::new());
    // The first page's link carries the filters on to the next.
    let one_page = |path: &str| -> Vec<String> {
        let (s, page) = admin.call("GET", path, None);
        assert_eq!(s, 200, "{page}");
        page.as_array()
            .unwrap()
            .iter()
            .map(|n| n["name"].as_str().unwrap().to_owned())
            .collect()
    };
    assert_eq!(
        one_page("/v1/nodes?partition=batch&state=up&limit=2"),
        ["m1", "n1"]
    );
    assert_eq!(
        one_page("/v1/nodes?partition=batch&state=up&limit=2&after=n1"),
        ["n2", "n4"]
    );

    // A new registration replaces the node's partitions.
    let (s, r) = register_in(&m, "n4", json!(["debug"]));
    assert_eq!(s, 200, "{r}");
    assert_eq!(names("/v1/nodes?partition=gpu"), ["n5"]);
    assert_eq!(names("/v1/nodes?partition=debug"), ["n3", "n4"]);
    let (_, n4) = admin.call("GET", "/v1/nodes/n4", None);
    assert_eq!(n4["partitions"], json!(["debug"]), "{n4}");

    // Bad partitions are refused, saying which, and change nothing.
    let many: Vec<String> = (0..65).map(|k| format!("p{k}")).collect();
    for (bad, says) in [
        (json!(["a b"]), "is not a Slurm partition name"),
        (json!(["ok", "tab\t"]), "is not a Slurm partition name"),
        (json!([""]), "is not a Slurm partition name"),
        (json!(["p".repeat(65)]), "is not a Slurm partition name"),
        (json!(["gpu", "gpu"]), "listed twice"),
        (json!(many), "at most 64"),
    ] {
        let (s, e) = register_in(&m, "n4", bad.clone());
        assert_eq!(
            (s, e["error"].as_str()),
            (400, Some("malformed_request")),
            "{bad}: {e}"
        );
        assert!(
            e["message"].as_str().is_some_and(|t| t.contains(says)),
            "{bad}: {e}"
        );
    }
    let (_, n4) = admin.call("GET", "/v1/nodes/n4", None);
    assert_eq!(n4["partitions"], json!(["debug"]), "{n4}");
    assert_eq!(names("/v1/nodes?partition=debug&fresh=true"), ["n3", "n4"]);
    assert_eq!(
        db.sql(&["SELECT COUNT(*) FROM node_partitions WHERE node = 'n4'"]),
        [[1]]
    );
    malformed_queries(
        &admin,
        "/v1/nodes",
        &["partition=", "partition=a%20b", "partition=a,b"],
    );

    // Among many nodes, the listing of one partition reads the index in
    // name order, not the nodes table nor a sort.
    db.sql(&[
        "CREATE TEMP TABLE like_n1 AS SELECT * FROM nodes WHERE name = 'n1'",
        "ALTER TABLE like_n1 DROP COLUMN name",
        "WITH RECURSIVE k(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM k WHERE i < 20000)
         INSERT INTO nodes SELECT 'x' || i, like_n1.* FROM k, like_n1",
        "WITH RECURSIVE k(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM k WHERE i < 20000)
         INSERT INTO node_partitions (node, partition) SELECT 'x' || i, 'p' || (i % 2) FROM k",
        "ANALYZE",
    ]);
    let sql = rfaas_manager::store::nodes_in_sql()
        .replace("$1", "'p1'")
        .replace("$2", "'x1'")
        .replace("$3", "''")
        .replace("$4", "1001");
    let plan = db.plan(&sql);
    assert!(
        plan.contains("node_partitions_by_partition"),
        "{sql}\n{plan}"
    );
    assert!(
        !plan.contains("Sort") && !plan.contains("TEMP B-TREE"),
        "ordered by the index, not sorted: {sql}\n{plan}"
    );
}
on_both!(nodes_are_listed_by_partition_through_an_index);

/// `GET /v1/leases` pages newest first, filtered, each caller seeing its
/// own, with `rfaas_manager::ctl` following the links; among many ended
/// leases each listing reads an index in its order, not the table.
fn leases_come_in_pages_through_an_index(kind: &str) {
    use rfaas_manager::ctl::Ctl;
    use rfaas_manager::store::LeaseFilter;
    use rfaas_proto::manager::{LeaseState, LeaseView};
    let mut db = Db::new(kind);
    let m = db.manager_with("lost_after_ms = 600000\n", None);
    register(&m, "a", 8, 8192);
    register(&m, "b", 8, 8192);
    let alice = user(&m, "alice", "physics");
    let bob = user(&m, "bob", "chem");
    let mut grants = Vec::new();
    for _ in 0..5 {
        grants.push(granted(&alice, 1, 64, 600)["id"].clone());
    }
    for _ in 0..3 {
        granted(&bob, 1, 64, 600);
    }
    for g in &grants[..2] {
        let (s, e) = alice.call("DELETE", &format!("/v1/leases/{g}"), None);
        assert_eq!(s, 204, "{e}");
    }
    let ctl = |token: &str| ctl_for(&m, token);
    let admin = ctl(m.admin_token());
    let list = |c: &Ctl, path: &str| -> Vec<LeaseView> { c.get_pages(path).expect(path).1 };
    let everything = list(&admin, "/v1/leases?all=true&limit=1000");
    assert_eq!(everything.len(), 8);
    let key = |l: &LeaseView| {
        (
            std::cmp::Reverse(l.issued_at),
            std::cmp::Reverse(l.lease_id),
        )
    };
    assert!(
        everything.windows(2).all(|w| key(&w[0]) < key(&w[1])),
        "newest first"
    );
    assert_eq!(list(&admin, "/v1/leases?all=true&limit=3"), everything);
    let active = list(&admin, "/v1/leases?limit=2");
    assert_eq!(active.len(), 6);
    assert!(active.iter().all(|l| l.state == LeaseState::Active));
    assert_eq!(list(&admin, "/v1/leases?state=released&limit=1").len(), 2);
    assert_eq!(list(&admin, "/v1/leases?user=bob&limit=1").len(), 3);
    assert_eq!(
        list(&admin, "/v1/leases?account=physics&all=true&limit=2").len(),
        5
    );
    let on_a = list(&admin, "/v1/leases?node=a&all=true&limit=1");
    assert!(on_a.iter().all(|l| l.node == "a"));
    assert_eq!(
        on_a.len(),
        everything.iter().filter(|l| l.node == "a").count()
    );
    assert!(list(&admin, "/v1/leases?job=5").is_empty());
    // A user sees only their own, whatever the filters say.
    let hers = list(&ctl(alice.token()), "/v1/leases?all=true&limit=2");
    assert_eq!(hers.len(), 5);
    assert!(list(&ctl(alice.token()), "/v1/leases?user=bob").is_empty());
    let api = m.admin();
    malformed_queries(
        &api,
        "/v1/leases",
        &[
            "limit=0",
            "after=yesterday",
            "state=zombie",
            "job=-1",
            "user=",
            "sort=name",
        ],
    );

    // Many ended leases: each listing walks an index in its order.
    let now = rfaas_service::now_s();
    db.sql(&[
        &format!(
            "WITH RECURSIVE k(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM k WHERE i < 20000)
             INSERT INTO leases (id, grant_id, node, owner, user_name, account, cores, memory_mib,
                issued_at, expires_at, state, ended_ms, harvested)
             SELECT 1000000000 + i, 1000000000 + i, 'a', 'user:carol', 'carol', 'physics', 1, 64,
                {now} - 100000 - i, {now} - 90000, 'released', 1, 0 FROM k"
        ),
        "ANALYZE",
    ]);
    assert_eq!(list(&admin, "/v1/leases?limit=4").len(), 6);
    for (filter, index) in [
        (
            LeaseFilter {
                state: Some(LeaseState::Active),
                ..Default::default()
            },
            "leases_listed",
        ),
        (LeaseFilter::default(), "leases_listed_all"),
    ] {
        for after in [None, Some((now, 7))] {
            let (sql, texts, numbers) = filter.select(after, 1001);
            let mut sql = sql;
            for (k, n) in numbers.iter().enumerate().rev() {
                sql = sql.replace(&format!("${}", texts.len() + k + 1), &n.to_string());
            }
            for (k, t) in texts.iter().enumerate().rev() {
                sql = sql.replace(&format!("${}", k + 1), &format!("'{t}'"));
            }
            let plan = db.plan(&sql);
            assert!(plan.contains(index), "{sql}\n{plan}");
            assert!(
                !plan.contains("Sort") && !plan.contains("TEMP B-TREE"),
                "ordered by the index, not sorted: {sql}\n{plan}"
            );
        }
    }
}
on_both!(leases_come_in_pages_through_an_index);

fn leases_span_nodes_all_or_nothing(kind: &str) {
    let mut db = Db::new(kind);
    let m = db.manager();
    register(&m, "a", 2, 4096);
    register(&m, "b", 2, 4096);
    register(&m, "c", 2, 4096);
    let u = user(&m, "alice", "physics");
    // Five cores span three nodes, each with its own token.
    let (s, g) = lease(&u, 5, None, 256, 60);
    assert_eq!(s, 201, "{g}");
    assert_eq!(granted_cores(&g), 5);
    let leases = g["leases"].as_array().unwrap();
    assert_eq!(leases.len(), 3, "{g}");
    for l in leases {
        assert!(l["token"].as_str().unwrap().starts_with("rfaas"), "{l}");
        assert_eq!(l["control_addr"], "127.0.0.1:7100");
    }
    // One core is left: a request for 2 with min 2 gets nothing, with 1 it
    // gets the one.
    let (s, e) = lease(&u, 2, None, 256, 60);
    assert_eq!(s, 503, "{e}");
    let (s, g2) = lease(&u, 2, Some(1), 256, 60);
    assert_eq!((s, granted_cores(&g2)), (201, 1), "{g2}");
    assert_eq!(check_no_core_leased_twice(&m), 6);
    // Release gives the cores back; releasing twice is fine.
    let id = g["id"].as_u64().unwrap();
    let (s, _) = u.call("DELETE", &format!("/v1/leases/{id}"), None);
    assert_eq!(s, 204);
    let (s, _) = u.call("DELETE", &format!("/v1/leases/{id}"), None);
    assert_eq!(s, 204);
    assert_eq!(check_no_core_leased_twice(&m), 1);
    // Another user can neither see nor release alice's lease.
    let bob = user(&m, "bob", "chem");
    let id2 = g2["id"].as_u64().unwrap();
    let (s, e) = bob.call("DELETE", &format!("/v1/leases/{id2}"), None);
    assert_eq!((s, e["error"].as_str()), (403, Some("forbidden")), "{e}");
    let (s, mine) = bob.call("GET", "/v1/leases", None);
    assert_eq!((s, mine), (200, json!([])));
    // Renewal moves the expiry, never back, with fresh tokens.
    let before = g2["expires_at"].as_u64().unwrap();
    let (s, r) = u.call(
        "POST",
        &format!("/v1/leases/{id2}/renew"),
        Some(&json!({"duration_s": 600})),
    );
    assert_eq!(s, 200, "{r}");
    assert!(r["expires_at"].as_u64().unwrap() >= before + 500, "{r}");
    let (s, r2) = u.call(
        "POST",
        &format!("/v1/leases/{id2}/renew"),
        Some(&json!({"duration_s": 5})),
    );
    assert_eq!(s, 200, "{r2}");
    assert_eq!(
        r2["expires_at"], r["expires_at"],
        "a renewal never shortens a lease"
    );
    // A released lease cannot be renewed.
    let (s, e) = u.call(
        "POST",
        &format!("/v1/leases/{id}/renew"),
        Some(&json!({"duration_s": 60})),
    );
    assert_eq!((s, e["error"].as_str()), (409, Some("lease_ended")), "{e}");
    // Preferences are honoured.
    let (s, p) = u.call(
        "POST",
        "/v1/leases",
        Some(&json!({"cores": 1, "memory_mib": 64, "duration_s": 60, "nodes": ["b"]})),
    );
    assert_eq!(s, 201, "{p}");
    assert_eq!(p["leases"][0]["node"], "b");
}
on_both!(leases_span_nodes_all_or_nothing);

fn no_capacity_says_when_to_retry(kind: &str) {
    let mut db = Db::new(kind);
    // No reaper round: an expired lease holds its core until the end.
    let m = db.manager_with("refresh_ms = 600000\nlost_after_ms = 600000\n", None);
    register(&m, "a", 1, 1024);
    let u = user(&m, "alice", "physics");
    let (s, _) = lease(&u, 1, None, 64, 30);
    assert_eq!(s, 201);
    let (s, retry, e) = u.call_full(
        "POST",
        "/v1/leases",
        Some(&json!({"cores": 1, "memory_mib": 64, "duration_s": 30})),
    );
    assert_eq!((s, e["error"].as_str()), (503, Some("no_capacity")), "{e}");
    let retry = retry.expect("a Retry-After header");
    // The soonest expiry, 25 to 30 s away, beyond the cap: a release may
    // free the core at any time, so clients hear 10 s at most.
    assert_eq!(retry, 10, "Retry-After {retry} is not the cap");
    assert_eq!(e["retry_after_s"], retry);
    // Memory counts too.
    register(&m, "b", 4, 128);
    let (s, e) = lease(&u, 1, None, 256, 30);
    assert_eq!(s, 503, "{e}");
    // A lease that ends sooner than that: Retry-After is its end, never 0.
    register(&m, "c", 1, 1024);
    granted(&u, 1, 256, 2);
    let (s, retry, e) = u.call_full(
        "POST",
        "/v1/leases",
        Some(&json!({"cores": 1, "memory_mib": 256, "duration_s": 30})),
    );
    assert_eq!(s, 503, "{e}");
    assert!(matches!(retry, Some(1..=2)), "Retry-After {retry:?}: {e}");
}

/// A request no node could ever hold is refused at once, 422
/// `request_exceeds_cluster` with the largest offer: waiting would not
/// help. The nodes that count are every node that ever registered,
/// whatever its state now (a lost, drained or withholding node may come
/// back), at the capacity it registered. With no node yet, and for a
/// request that fits but finds no room now, the answer stays a retryable
/// 503.
fn a_request_beyond_the_cluster_is_refused_at_once(kind: &str) {
    let mut db = Db::new(kind);
    let m = db.manager_that_loses_nodes();
    let admin = m.admin();
    let u = user(&m, "alice", "physics");
    let ask = |cores: u32, min: Option<u32>, memory: u64| {
        let mut body = json!({"cores": cores, "memory_mib": memory, "duration_s": 60});
        if let Some(min) = min {
            body["min_cores"] = min.into();
        }
        u.call_full("POST", "/v1/leases", Some(&body))
    };
    let busy = |(s, retry, e): (u16, Option<u64>, serde_json::Value)| {
        assert_eq!((s, e["error"].as_str()), (503, Some("no_capacity")), "{e}");
        assert!(matches!(retry, Some(1..=5)), "Retry-After {retry:?}: {e}");
    };
    // The cluster may still be coming up.
    busy(ask(64, None, 1 << 20));

    // 2 cores with 2048 MiB, 2 with 1024, 4 with 512: every one of them
    // stops heartbeating and is lost, c is drained, a withholds its cores.
    let a = register(&m, "a", 2, 2048);
    register(&m, "b", 2, 1024);
    register(&m, "c", 4, 512);
    let (s, v) = admin.call("POST", "/v1/nodes/c/drain", None);
    assert_eq!(s, 200, "{v}");
    let hb =
        json!({"free_cores": 0, "free_memory_mib": 2048, "allocations": [], "withheld_cores": 2});
    let (s, r) = a.call("POST", "/v1/nodes/a/heartbeat", Some(&hb));
    assert_eq!(s, 200, "{r}");
    wait_for("every node to be lost", Duration::from_secs(20), || {
        let (_, nodes) = admin.call("GET", "/v1/nodes", None);
        let states: Vec<&str> = nodes
            .as_array()?
            .iter()
            .filter_map(|n| n["state"].as_str())
            .collect();
        (states == ["lost"; 3]).then_some(())
    });

    let refused = [
        // More cores than all nodes together.
        (9, None, 64, "9 cores"),
        // More memory than any node lends.
        (1, None, 1 << 20, "1048576 MiB"),
        // Only a and b lend 1024 MiB: 4 cores at most.
        (5, None, 1024, "4 cores"),
        (6, Some(5), 1024, "4 cores"),
    ];
    for (cores, min, memory, says) in refused {
        let (s, retry, e) = ask(cores, min, memory);
        let what = format!("{cores} cores (min {min:?}) with {memory} MiB");
        assert_eq!(
            (s, e["error"].as_str(), retry),
            (422, Some("request_exceeds_cluster"), None),
            "{what}: {e}"
        );
        let figures = [
            "largest_node_cores",
            "largest_node_memory_mib",
            "cluster_cores",
            "nodes",
        ]
        .map(|k| e[k].as_u64());
        assert_eq!(
            figures,
            [Some(4), Some(2048), Some(8), Some(3)],
            "{what}: {e}"
        );
        let message = e["message"].as_str().unwrap_or_default();
        for words in [says, "4 cores", "2048 MiB", "8 cores", "3 nodes"] {
            assert!(
                message.contains(words),
                "{what}: {words:?} not in {message:?}"
            );
        }
    }
    assert_eq!(
        metric(
            &m,
            "rfaas_manager_denials_total{reason=\"request_exceeds_cluster\"}"
        ),
        refused.len() as f64
    );
    // They fit what the nodes registered, though none is up now.
    busy(ask(8, None, 512));
    busy(ask(4, None, 1024));
    busy(ask(64, Some(8), 64));
    busy(ask(1, None, 2048));
}
on_both!(a_request_beyond_the_cluster_is_refused_at_once);
on_both!(no_capacity_says_when_to_retry);

/// A release and a renewal look a grant's active leases up in one index
/// on (grant, state), whatever the leases ended before left behind. With one index per column, PostgreSQL chose
/// to AND two bitmap scans, one of which read every lease that was ever
/// active and not yet vacuumed: each release got slower with the churn.
fn a_grant_is_found_by_one_index_however_many_leases_ended(kind: &str) {
    let mut db = Db::new(kind);
    // The node sends no heartbeats while the leases come and go.
    let m = db.manager_with("lost_after_ms = 600000\n", None);
    register(&m, "a", 4, 1024);
    let u = user(&m, "alice", "physics");
    for k in 0..200 {
        let (s, g) = lease(&u, 1, None, 64, 60);
        assert_eq!(s, 201, "grant {k}: {g}");
        let (s, e) = u.call("DELETE", &format!("/v1/leases/{}", g["id"]), None);
        assert_eq!(s, 204, "{e}");
    }
    let plan = db.plan(
        "UPDATE leases SET state = 'released', ended_ms = 1 WHERE grant_id = 7 AND state = 'active' RETURNING id",
    );
    assert!(
        plan.contains("leases_by_grant_state") && !plan.contains("leases_by_state"),
        "{plan}"
    );
}
on_both!(a_grant_is_found_by_one_index_however_many_leases_ended);

fn quotas_cap_an_account(kind: &str) {
    let mut db = Db::new(kind);
    let m = db.manager_with(
        "[quota]\ndefault_cores = 0\naccounts = { physics = 3 }\n",
        None,
    );
    register(&m, "a", 8, 8192);
    let u = user(&m, "alice", "physics");
    let (s, g) = lease(&u, 2, None, 64, 60);
    assert_eq!(s, 201, "{g}");
    let (s, e) = lease(&u, 2, None, 64, 60);
    assert_eq!(
        (s, e["error"].as_str()),
        (403, Some("quota_exceeded")),
        "{e}"
    );
    assert_eq!(
        (e["cap"].as_u64(), e["in_use"].as_u64()),
        (Some(3), Some(2)),
        "{e}"
    );
    // Within the cap with min_cores, and other accounts are not capped.
    let (s, g2) = lease(&u, 2, Some(1), 64, 60);
    assert_eq!((s, granted_cores(&g2)), (201, 1), "{g2}");
    let bob = user(&m, "bob", "chem");
    let (s, _) = lease(&bob, 4, None, 64, 60);
    assert_eq!(s, 201);
    // Releasing frees quota.
    let id = g["id"].as_u64().unwrap();
    assert_eq!(u.call("DELETE", &format!("/v1/leases/{id}"), None).0, 204);
    let (s, _) = lease(&u, 2, None, 64, 60);
    assert_eq!(s, 201);
}
on_both!(quotas_cap_an_account);

fn credentials_are_checked(kind: &str) {
    let mut db = Db::new(kind);
    let m = db.manager();
    register(&m, "a", 2, 1024);
    let body = json!({"cores": 1, "memory_mib": 64, "duration_s": 60});
    // No header, a wrong token, a forged secret for a real id.
    let none = Api::new(m.url(), "");
    let (s, e) = none.call("POST", "/v1/leases", Some(&body));
    assert_eq!((s, e["error"].as_str()), (401, Some("unauthorized")), "{e}");
    let wrong = Api::new(m.url(), "not-a-token");
    assert_eq!(wrong.call("GET", "/v1/nodes", None).0, 401);
    let real = m.credential("user", "alice", Some("physics"));
    let (prefix, _) = real.rsplit_once('.').unwrap();
    let forged = Api::new(
        m.url(),
        &format!("{prefix}.AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"),
    );
    let (s, e) = forged.call("POST", "/v1/leases", Some(&body));
    assert_eq!(s, 401, "{e}");
    assert!(e["message"].as_str().unwrap().contains("forged"), "{e}");
    // An expired credential.
    let (s, c) = m.admin().call(
        "POST",
        "/v1/credentials",
        Some(&json!({"role": "user", "subject": "eve", "ttl_s": 1})),
    );
    assert_eq!(s, 201, "{c}");
    let eve = Api::new(m.url(), c["token"].as_str().unwrap());
    let (s, e) = wait_for("the credential to expire", Duration::from_secs(5), || {
        let r = eve.call("GET", "/v1/leases", None);
        (r.0 != 200).then_some(r)
    });
    assert_eq!(
        (s, e["error"].as_str()),
        (401, Some("credential_expired")),
        "{e}"
    );
    // A revoked credential, on this replica at once.
    let alice = Api::new(m.url(), &real);
    assert_eq!(alice.call("GET", "/v1/leases", None).0, 200);
    let id = real.split('.').nth(1).unwrap();
    assert_eq!(
        m.admin()
            .call("DELETE", &format!("/v1/credentials/{id}"), None)
            .0,
        204
    );
    let (s, e) = alice.call("GET", "/v1/leases", None);
    assert_eq!(
        (s, e["error"].as_str()),
        (401, Some("credential_revoked")),
        "{e}"
    );
    // Roles: the admin cannot lease, a user cannot mint.
    let (s, _) = m.admin().call("POST", "/v1/leases", Some(&body));
    assert_eq!(s, 403);
    let bob = user(&m, "bob", "chem");
    let (s, _) = bob.call(
        "POST",
        "/v1/credentials",
        Some(&json!({"role": "user", "subject": "x"})),
    );
    assert_eq!(s, 403);
}
on_both!(credentials_are_checked);

fn malformed_requests_get_json_errors(kind: &str) {
    let mut db = Db::new(kind);
    let m = db.manager();
    let node = register(&m, "a", 2, 1024);
    let u = user(&m, "alice", "physics");
    let cases: Vec<(&Api, &str, &str, Option<String>, &str)> = vec![
        (&u, "POST", "/v1/leases", Some("{".into()), "application/json"),
        (&u, "POST", "/v1/leases", Some("[]".into()), "application/json"),
        (&u, "POST", "/v1/leases", Some(r#"{"cores":1}"#.into()), "application/json"),
        (&u, "POST", "/v1/leases", Some(r#"{"cores":1,"memory_mib":64,"duration_s":60,"colour":1}"#.into()), "application/json"),
        (&u, "POST", "/v1/leases", Some(r#"{"cores":-1,"memory_mib":64,"duration_s":60}"#.into()), "application/json"),
        (&u, "POST", "/v1/leases", Some(r#"{"cores":0,"memory_mib":64,"duration_s":60}"#.into()), "application/json"),
        (&u, "POST", "/v1/leases", Some(r#"{"cores":2,"min_cores":3,"memory_mib":64,"duration_s":60}"#.into()), "application/json"),
        (&u, "POST", "/v1/leases", Some(r#"{"cores":1,"memory_mib":64,"duration_s":99999999}"#.into()), "application/json"),
        (&u, "POST", "/v1/leases", Some(r#"{"cores":1,"memory_mib":64,"duration_s":60}"#.into()), "text/plain"),
        (&u, "POST", "/v1/leases", Some(format!(r#"{{"cores":1,"memory_mib":64,"duration_s":60,"nodes":["{}"]}}"#, "x".repeat(400_000))), "application/json"),
        (&u, "GET", "/v1/leases/notanumber", None, "application/json"),
        (&u, "GET", "/v1/leases?limit=-3", None, "application/json"),
        (&u, "DELETE", "/v1/leases/99999999999999999999999", None, "application/json"),
        (&u, "PATCH", "/v1/leases", None, "application/json"),
        (&u, "GET", "/v2/anything", None, "application/json"),
        (&node, "PUT", "/v1/nodes/a", Some(r#"{"control_addr":"nohost","providers":[{"name":"tcp"}],"cores":1,"memory_mib":1}"#.into()), "application/json"),
        (&node, "PUT", "/v1/nodes/a", Some(r#"{"control_addr":"h:1","providers":[{"name":"carrier-pigeon"}],"cores":1,"memory_mib":1}"#.into()), "application/json"),
        (&node, "PUT", "/v1/nodes/a", Some(r#"{"control_addr":"h:1","providers":[{"name":"tcp"}],"cores":0,"memory_mib":1}"#.into()), "application/json"),
        (&node, "POST", "/v1/nodes/a/heartbeat", Some(r#"{"free_cores":"x"}"#.into()), "application/json"),
        (&u, "GET", "/v1/nodes/%ff%fe", None, "application/json"),
    ];
    for (api, method, path, body, ctype) in cases {
        // A fresh connection each: the server may close one it refused.
        // A body over the limit is refused before it is read, and the
        // server closes without draining it, so a client still writing it
        // may see the connection reset before it reads the answer (status
        // 0): that case is asked again, a few times at most.
        let mut attempt = 0;
        let (s, e) = loop {
            let (s, _, e) = api.fresh().raw(method, path, body.clone(), ctype);
            attempt += 1;
            if s != 0 || attempt == 5 || body.as_ref().map_or(true, |b| b.len() < 64 * 1024) {
                break (s, e);
            }
        };
        assert!(
            (400..500).contains(&s),
            "{method} {path} {:?}: status {s}, {e}",
            body.map(|b| b.chars().take(80).collect::<String>())
        );
        assert!(
            e["error"].is_string() && e["message"].is_string(),
            "{method} {path}: not an ApiError: {e}"
        );
    }
    // Nothing was leased by any of it, and the manager still serves.
    assert_eq!(check_no_core_leased_twice(&m), 0);
    let (s, g) = lease(&u, 1, None, 64, 60);
    assert_eq!(s, 201, "{g}");
}
on_both!(malformed_requests_get_json_errors);

/// Each handler says who may call it; every other caller is refused with
/// what would serve, before its body is read: a malformed body is refused
/// as such only to a caller who may send one.
fn handlers_refuse_callers_of_other_roles(kind: &str) {
    let mut db = Db::new(kind);
    let m = db.manager();
    let node = register(&m, "a", 2, 1024);
    let u = user(&m, "alice", "physics");
    let admin = m.admin();
    let hb = json!({"free_cores": 2, "free_memory_mib": 1024, "allocations": []});
    let ask = json!({"cores": 1, "memory_mib": 64, "duration_s": 60});
    let job = json!({"user": "alice", "account": "physics", "expires_at": u64::MAX / 2});
    let admin_only = "this needs the admin token (rfaasctl reads it from its file)";
    let nodes_only = "registering and heartbeating need a node credential";
    let users_only = "leases are asked for with a user credential (rfaasctl credential user ...)";
    let jobs_only = "job credentials are asked for by a node's executor daemon (node credential), for a job it runs";
    let cases: Vec<(&Api, &str, &str, Option<&serde_json::Value>, &str)> = vec![
        (&u, "POST", "/v1/nodes/a/drain", None, admin_only),
        (&node, "GET", "/v1/credentials", None, admin_only),
        (&u, "GET", "/v1/budgets", None, admin_only),
        (&u, "POST", "/v1/nodes/a/heartbeat", Some(&hb), nodes_only),
        (
            &node,
            "POST",
            "/v1/nodes/b/heartbeat",
            Some(&hb),
            "this credential is node \"a\"'s; it cannot speak for node \"b\"",
        ),
        (&node, "POST", "/v1/leases", Some(&ask), users_only),
        (&admin, "POST", "/v1/leases", Some(&ask), users_only),
        (&node, "GET", "/v1/leases", None, "nodes do not list leases"),
        (&u, "POST", "/v1/jobs/7/credential", Some(&job), jobs_only),
        (&u, "POST", "/v1/jobs/7/end", None, jobs_only),
    ];
    for (api, method, path, body, message) in cases {
        let (s, e) = api.call(method, path, body);
        assert_eq!(
            (s, e["error"].as_str(), e["message"].as_str()),
            (403, Some("forbidden"), Some(message)),
            "{method} {path}"
        );
    }
    // The admin may speak for any node, and a node for its own.
    assert_eq!(
        admin.call("POST", "/v1/nodes/a/heartbeat", Some(&hb)).0,
        200
    );
    assert_eq!(node.call("POST", "/v1/nodes/a/heartbeat", Some(&hb)).0, 200);
    // The sender first: a stranger's body is not read.
    let anyone = Api::new(m.url(), "");
    let (s, _, e) = anyone.raw("PUT", "/v1/nodes/a", Some("{".into()), "application/json");
    assert_eq!((s, e["error"].as_str()), (401, Some("unauthorized")), "{e}");
    let (s, _, e) = node.raw("PUT", "/v1/nodes/a", Some("{".into()), "application/json");
    assert_eq!(
        (s, e["error"].as_str()),
        (400, Some("malformed_request")),
        "{e}"
    );
    let (s, _, e) = u
        .fresh()
        .raw("POST", "/v1/jobs/0/end", None, "application/json");
    assert_eq!((s, e["error"].as_str()), (403, Some("forbidden")), "{e}");
    let (s, e) = node.call("POST", "/v1/jobs/0/end", None);
    assert_eq!(
        (s, e["error"].as_str()),
        (400, Some("malformed_request")),
        "{e}"
    );
    let (s, e) = anyone.call("GET", "/v1/nodes", None);
    assert_eq!((s, e["error"].as_str()), (401, Some("unauthorized")), "{e}");
}
on_both!(handlers_refuse_callers_of_other_roles);

/// Fuzzing found these answered 500 on PostgreSQL, which refuses a NUL
/// byte in text: a registration's free-text fields went to the database
/// unchecked.
fn registration_text_with_control_characters_is_refused(kind: &str) {
    let mut db = Db::new(kind);
    let m = db.manager();
    let node = register(&m, "a", 2, 1024);
    for (field, value) in [
        ("version", json!("0.1\u{0}")),
        ("control_addr", json!("host\u{0}:7100")),
        ("providers", json!([{"name": "tcp", "host": "h\u{0}"}])),
        ("providers", json!([{"name": "verbs:mlx5\u{7}"}])),
    ] {
        let mut body = node_body(7100, 2, 1024);
        body[field] = value;
        let (s, e) = node.call("PUT", "/v1/nodes/a", Some(&body));
        assert_eq!(
            (s, e["error"].as_str()),
            (400, Some("malformed_request")),
            "{field}: {e}"
        );
        assert!(
            e["message"]
                .as_str()
                .unwrap()
                .contains("control characters"),
            "{e}"
        );
    }
    // The node's record is as registered.
    let (s, n) = m.admin().call("GET", "/v1/nodes/a", None);
    assert_eq!(
        (s, n["control_addr"].as_str()),
        (200, Some("127.0.0.1:7100")),
        "{n}"
    );
    assert_eq!(n["providers"][0]["host"], "127.0.0.1", "{n}");
}
on_both!(registration_text_with_control_characters_is_refused);

/// Fuzzing found these answered 500 on PostgreSQL: drain, resume and
/// revoke passed a path segment holding a NUL byte to the database.
fn path_names_are_checked_before_the_database(kind: &str) {
    let mut db = Db::new(kind);
    let m = db.manager();
    register(&m, "a", 2, 1024);
    let admin = m.admin();
    for path in ["/v1/nodes/a%00b/drain", "/v1/nodes/a%00b/resume"] {
        let (s, e) = admin.call("POST", path, None);
        assert_eq!(
            (s, e["error"].as_str()),
            (400, Some("malformed_request")),
            "{path}: {e}"
        );
    }
    for id in ["a%00b", "not-hex", "0123"] {
        let (s, e) = admin.call("DELETE", &format!("/v1/credentials/{id}"), None);
        assert_eq!(
            (s, e["error"].as_str()),
            (404, Some("not_found")),
            "{id}: {e}"
        );
    }
    // Well-formed names still work.
    let (s, v) = admin.call("POST", "/v1/nodes/a/drain", None);
    assert_eq!((s, v["state"].as_str()), (200, Some("drained")), "{v}");
}
on_both!(path_names_are_checked_before_the_database);

/// Node names follow one pattern (`rfaas_proto::node_name`): a name ends
/// up in paths, logs, URLs and metric labels, so `.`, `..`, a slash, a
/// control character or a leading `-` is refused wherever a node is named.
fn node_names_follow_one_pattern(kind: &str) {
    let mut db = Db::new(kind);
    let m = db.manager();
    let admin = m.admin();
    let u = user(&m, "alice", "physics");
    let refused = |what: &str, (s, e): (u16, serde_json::Value)| {
        assert_eq!(
            (s, e["error"].as_str()),
            (400, Some("malformed_request")),
            "{what}: {e}"
        );
        let message = e["message"].as_str().unwrap_or_default();
        assert!(
            message.contains(rfaas_proto::node_name::PATTERN),
            "{what}: the message does not give the pattern: {e}"
        );
    };
    for name in [
        ".",
        "..",
        "%2E",
        "%2E%2E",
        "a%2Fb",
        "a%00b",
        "a%0Ab",
        "-n",
        "_n",
        "a..b",
        "a.",
        ".a",
        "a%20b",
        "a@b",
        "n%C5%93ud",
    ] {
        let body = node_body(7100, 2, 1024);
        refused(
            &format!("register {name}"),
            admin.call("PUT", &format!("/v1/nodes/{name}"), Some(&body)),
        );
        let hb = json!({"free_cores": 2, "free_memory_mib": 1024, "allocations": []});
        refused(
            &format!("heartbeat {name}"),
            admin.call("POST", &format!("/v1/nodes/{name}/heartbeat"), Some(&hb)),
        );
        refused(
            &format!("drain {name}"),
            admin.call("POST", &format!("/v1/nodes/{name}/drain"), None),
        );
        refused(
            &format!("show {name}"),
            admin.call("GET", &format!("/v1/nodes/{name}"), None),
        );
    }
    for name in [".", "..", "a/b", "a\u{0}b", "-n", "a..b", "a@b"] {
        refused(
            &format!("a node credential for {name:?}"),
            admin.call(
                "POST",
                "/v1/credentials",
                Some(&json!({"role": "node", "subject": name})),
            ),
        );
        refused(
            &format!("a lease preferring {name:?}"),
            u.call(
                "POST",
                "/v1/leases",
                Some(&json!({"cores": 1, "memory_mib": 64, "duration_s": 60, "nodes": [name]})),
            ),
        );
    }
    let (s, nodes) = admin.call("GET", "/v1/nodes?fresh=true", None);
    assert_eq!((s, nodes), (200, json!([])), "nothing was registered");
    // Slurm's node names and host names pass.
    for name in ["node01", "gpu-3", "cn_12", "node1.cluster", "N7"] {
        register(&m, name, 1, 256);
    }
    let (s, p) = u.call(
        "POST",
        "/v1/leases",
        Some(&json!({"cores": 1, "memory_mib": 64, "duration_s": 60, "nodes": ["node1.cluster"]})),
    );
    assert_eq!(
        (s, p["leases"][0]["node"].as_str()),
        (201, Some("node1.cluster")),
        "{p}"
    );
}
on_both!(node_names_follow_one_pattern);

fn expired_leases_end_and_nodes_hear_of_it(kind: &str) {
    let mut db = Db::new(kind);
    let m = db.manager();
    let node = register(&m, "a", 2, 1024);
    let u = user(&m, "alice", "physics");
    let (s, short) = lease(&u, 1, None, 64, 1);
    assert_eq!(s, 201, "{short}");
    let (s, long) = lease(&u, 1, None, 64, 600);
    assert_eq!(s, 201, "{long}");
    let (s, full) = lease(&u, 1, None, 64, 600);
    assert_eq!(s, 503, "both cores are leased: {full}");
    let short_id = short["leases"][0]["lease_id"].as_u64().unwrap();
    let long_id = long["leases"][0]["lease_id"].as_u64().unwrap();
    let hb = json!({"free_cores": 0, "free_memory_mib": 896, "allocations": [
        {"lease_id": short_id, "cores": 1, "memory_mib": 64},
        {"lease_id": long_id, "cores": 1, "memory_mib": 64},
        {"lease_id": 12345, "cores": 1, "memory_mib": 64}
    ]});
    // The short lease expires; the node hears it ended, not the long one,
    // nor the one the manager never granted.
    let ended = wait_for("the short lease to expire", Duration::from_secs(10), || {
        let (s, r) = node.call("POST", "/v1/nodes/a/heartbeat", Some(&hb));
        assert_eq!(s, 200, "{r}");
        (r["ended_leases"] != json!([])).then_some(r["ended_leases"].clone())
    });
    assert_eq!(ended, json!([short_id]));
    let (s, all) = m.admin().call("GET", "/v1/leases?all=true", None);
    assert_eq!(s, 200);
    let states: Vec<(u64, String)> = all
        .as_array()
        .unwrap()
        .iter()
        .map(|l| {
            (
                l["lease_id"].as_u64().unwrap(),
                l["state"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    assert!(states.contains(&(short_id, "expired".into())), "{states:?}");
    assert!(states.contains(&(long_id, "active".into())), "{states:?}");
    assert_eq!(check_no_core_leased_twice(&m), 1);
    // The freed core is offered again.
    let (s, g) = lease(&u, 1, None, 64, 60);
    assert_eq!(s, 201, "{g}");
}
on_both!(expired_leases_end_and_nodes_hear_of_it);

/// A lease has ended at its `expires_at` (Unix seconds), whether or not
/// the reaper has marked it yet: a renewal from then on is refused, and
/// the lease keeps its end. Executors stop its workers at that second.
fn a_renewal_after_the_end_is_refused_before_the_reaper_runs(kind: &str) {
    let mut db = Db::new(kind);
    // No reaper round during the test.
    let m = db.manager_with("refresh_ms = 600000\nlost_after_ms = 600000\n", None);
    register(&m, "a", 2, 1024);
    let u = user(&m, "alice", "physics");
    let g = granted(&u, 1, 64, 1);
    let id = g["id"].as_u64().unwrap();
    let end_ms = g["expires_at"].as_u64().unwrap() * 1000;
    wait_for("the lease's end", Duration::from_secs(10), || {
        (rfaas_service::now_ms() > end_ms).then_some(())
    });
    let (s, e) = u.call(
        "POST",
        &format!("/v1/leases/{id}/renew"),
        Some(&json!({"duration_s": 600})),
    );
    assert_eq!((s, e["error"].as_str()), (409, Some("lease_ended")), "{e}");
    let (s, shown) = u.call("GET", &format!("/v1/leases/{id}"), None);
    assert_eq!(s, 200, "{shown}");
    assert_eq!(
        shown[0]["expires_at"].as_u64(),
        Some(end_ms / 1000),
        "the refused renewal moved the end: {shown}"
    );
    // To the millisecond, through the store: at the end and 1 ms after it
    // the grant is over; 1 ms before, it renews.
    let g = granted(&u, 1, 64, 60);
    let id = g["id"].as_u64().unwrap();
    let end = g["expires_at"].as_u64().unwrap();
    let url = db.url();
    let renewed = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(async {
            let backend = rfaas_service::db::Backend::of(&url);
            let pool = rfaas_service::db::open(&url, 1).await.unwrap();
            let store = rfaas_manager::store::Store::new(pool, backend);
            let mut renewed = Vec::new();
            for now_ms in [end * 1000 + 1, end * 1000, end * 1000 - 1] {
                let rows = store.renew(id, end + 60, now_ms).await.unwrap();
                renewed.push(rows.iter().map(|r| r.view.expires_at).collect::<Vec<_>>());
            }
            store.pool().close().await;
            renewed
        });
    assert_eq!(renewed, [vec![], vec![], vec![end + 60]]);
}
on_both!(a_renewal_after_the_end_is_refused_before_the_reaper_runs);

/// A node that registers again with fewer cores or less memory than it
/// has leased (a restart with a smaller configuration) keeps its leases:
/// the difference drains as they end. Its capacity stays at least what is
/// leased, in the database and in every replica's view, it takes no new
/// lease until one fits its new size, and once its leases are gone it
/// offers what it registered.
fn a_registration_below_the_leases_drains_the_difference(kind: &str) {
    let mut db = Db::new(kind);
    let quiet = "lost_after_ms = 600000\n";
    let m = db.manager_with(quiet, None);
    // A second replica that learns only from notices (or SQLite's watch).
    let m2 = db.manager_with(&format!("{quiet}refresh_ms = 3600000\n"), Some(&m));
    let node = register(&m, "a", 4, 4096);
    let u = user(&m, "alice", "physics");
    let big = granted(&u, 3, 1024, 600);
    let small = granted(&u, 1, 1024, 600);
    // cores, leased, draining; memory, leased, draining.
    let figures = |n: &serde_json::Value| {
        [
            "cores",
            "leased_cores",
            "draining_cores",
            "memory_mib",
            "leased_memory_mib",
            "draining_memory_mib",
        ]
        .map(|k| n[k].as_u64().unwrap_or(u64::MAX))
    };
    // The database and both replicas' views hold `want`, and every view
    // on the way kept leased within capacity.
    let everywhere = |want: [u64; 6]| {
        let stored = db.sql(&["SELECT cores, leased_cores, draining_cores, memory_mib, leased_memory_mib, draining_memory_mib FROM nodes WHERE name = 'a'"]);
        assert_eq!(stored, [want.map(|v| v as i64).to_vec()]);
        for (replica, what) in [(&m, "this replica"), (&m2, "another replica")] {
            let admin = replica.admin();
            let mut last = serde_json::Value::Null;
            poll_for(Duration::from_secs(20), || {
                let (s, n) = admin.call("GET", "/v1/nodes/a", None);
                if s == 404 && what == "another replica" {
                    // Not yet heard of the node: its notice is on the way.
                    last = n;
                    return None;
                }
                assert_eq!((s, n["state"].as_str()), (200, Some("up")), "{n}");
                assert!(
                    n["leased_cores"].as_u64() <= n["cores"].as_u64()
                        && n["leased_memory_mib"].as_u64() <= n["memory_mib"].as_u64(),
                    "{what} holds more leased than the node's capacity: {n}"
                );
                last = n;
                (figures(&last) == want).then_some(())
            })
            .unwrap_or_else(|| panic!("{what} never showed {want:?}: {last}"));
        }
        assert_eq!(check_no_core_leased_twice(&m), want[1]);
    };
    let nothing_fits = || {
        let (s, e) = lease(&u, 1, None, 64, 60);
        assert_eq!((s, e["error"].as_str()), (503, Some("no_capacity")), "{e}");
    };
    let release = |g: &serde_json::Value| {
        let (s, e) = u.call("DELETE", &format!("/v1/leases/{}", g["id"]), None);
        assert_eq!(s, 204, "{e}");
    };

    // Re-registered as 1 core and 1000 MiB while it holds 4 and 2048.
    let (s, r) = node.call("PUT", "/v1/nodes/a", Some(&node_body(7100, 1, 1000)));
    assert_eq!(s, 200, "{r}");
    let draining = [4, 4, 3, 2048, 2048, 1048];
    assert_eq!(figures(&r["node"]), draining, "{r}");
    everywhere(draining);
    nothing_fits();
    assert_eq!(metric(&m, "rfaas_manager_cores{state=\"free\"}"), 0.0);

    // The big lease ends: 1 core and 1024 MiB are leased, the memory still
    // drains by 24 MiB.
    release(&big);
    everywhere([1, 1, 0, 1024, 1024, 24]);
    nothing_fits();

    // The last one ends: the node offers what it registered.
    release(&small);
    everywhere([1, 0, 0, 1000, 0, 0]);
    assert_eq!(metric(&m, "rfaas_manager_cores{state=\"free\"}"), 1.0);
    let u2 = rfaas_testkit::manager::Api::new(m2.url(), u.token());
    assert_eq!(granted_cores(&granted(&u2, 1, 1000, 60)), 1);
    assert_eq!(check_no_core_leased_twice(&m), 1);

    // Registering larger again ends any drain at once.
    let (s, r) = node.call("PUT", "/v1/nodes/a", Some(&node_body(7100, 4, 4096)));
    assert_eq!(s, 200, "{r}");
    assert_eq!(figures(&r["node"]), [4, 1, 0, 4096, 1000, 0], "{r}");
}
on_both!(a_registration_below_the_leases_drains_the_difference);

fn silent_nodes_are_lost_and_their_leases_end(kind: &str) {
    let mut db = Db::new(kind);
    let m = db.manager_that_loses_nodes();
    let node = register(&m, "a", 2, 1024);
    let u = user(&m, "alice", "physics");
    let (s, g) = lease(&u, 2, None, 64, 600);
    assert_eq!(s, 201, "{g}");
    let lease_id = g["leases"][0]["lease_id"].as_u64().unwrap();
    // No heartbeats: lost after lost_after_ms (1 s here).
    let admin = m.admin();
    wait_for("the node to be lost", Duration::from_secs(10), || {
        let (_, n) = admin.call("GET", "/v1/nodes/a", None);
        (n["state"] == "lost").then_some(())
    });
    let (_, all) = admin.call("GET", "/v1/leases?all=true", None);
    assert_eq!(all[0]["state"], "lost", "{all}");
    assert_eq!(check_no_core_leased_twice(&m), 0);
    let (s, _) = lease(&u, 1, None, 64, 60);
    assert_eq!(s, 503, "a lost node is not offered");
    // It comes back with a heartbeat, and hears its lease ended.
    let hb = json!({"free_cores": 0, "free_memory_mib": 0, "allocations": [{"lease_id": lease_id, "cores": 2, "memory_mib": 64}]});
    let (s, r) = node.call("POST", "/v1/nodes/a/heartbeat", Some(&hb));
    assert_eq!(
        (s, r["ended_leases"].clone()),
        (200, json!([lease_id])),
        "{r}"
    );
    let (s, g) = wait_for(
        "the node to be offered again",
        Duration::from_secs(5),
        || {
            let _ = node.call("POST", "/v1/nodes/a/heartbeat", Some(&hb));
            let r = lease(&u, 1, None, 64, 60);
            (r.0 == 201).then_some(r)
        },
    );
    assert_eq!(s, 201, "{g}");
}
on_both!(silent_nodes_are_lost_and_their_leases_end);

#[test]
fn openapi_document_and_metrics() {
    let mut db = Db::new("sqlite");
    let m = db.manager();
    register(&m, "a", 3, 1024);
    let u = user(&m, "alice", "physics");
    assert_eq!(lease(&u, 1, None, 64, 60).0, 201);
    let open = Api::new(m.url(), "");
    let (s, doc) = open.call("GET", "/v1/openapi.json", None);
    assert_eq!(s, 200);
    assert!(doc["openapi"].as_str().unwrap().starts_with("3."), "{doc}");
    for path in [
        "/v1/leases",
        "/v1/nodes/{name}",
        "/v1/nodes/{name}/heartbeat",
        "/v1/credentials",
        "/v1/budgets",
        "/v1/budgets/{account}",
    ] {
        assert!(
            doc["paths"][path].is_object(),
            "{path} missing from the document"
        );
    }
    assert!(doc["components"]["schemas"]["LeaseRequest"].is_object());
    assert!(
        doc["components"]["schemas"]["RegisterNode"]["properties"]["harvested"].is_object(),
        "{doc}"
    );
    assert!(doc["components"]["schemas"]["BillingSlot"].is_object());
    // Partition names have one pattern, in bodies and in the listing's query.
    let partitions = &doc["components"]["schemas"]["RegisterNode"]["properties"]["partitions"];
    assert_eq!(partitions["maxItems"], 64, "{partitions}");
    assert_eq!(
        partitions["items"]["$ref"], "#/components/schemas/PartitionName",
        "{partitions}"
    );
    let name = &doc["components"]["schemas"]["PartitionName"];
    assert_eq!(
        name["pattern"].as_str(),
        Some(rfaas_proto::manager::PARTITION_PATTERN),
        "{name}"
    );
    let query = doc["paths"]["/v1/nodes"]["get"]["parameters"]
        .as_array()
        .and_then(|ps| ps.iter().find(|p| p["name"] == "partition"))
        .unwrap_or_else(|| panic!("no partition parameter: {doc}"));
    assert_eq!(
        query["schema"]["pattern"].as_str(),
        Some(rfaas_proto::manager::PARTITION_PATTERN),
        "{query}"
    );
    let refusals = &doc["paths"]["/v1/leases"]["post"]["responses"];
    assert!(
        refusals["422"]["description"]
            .as_str()
            .is_some_and(|d| d.contains("request_exceeds_cluster")),
        "{refusals}"
    );
    // The node name pattern is rfaas-proto's, on every route that names a node.
    for (path, method) in [
        ("/v1/nodes/{name}", "put"),
        ("/v1/nodes/{name}", "get"),
        ("/v1/nodes/{name}/heartbeat", "post"),
        ("/v1/nodes/{name}/drain", "post"),
        ("/v1/nodes/{name}/resume", "post"),
    ] {
        let schema = &doc["paths"][path][method]["parameters"][0]["schema"];
        assert_eq!(
            (schema["pattern"].as_str(), schema["maxLength"].as_u64()),
            (
                Some(rfaas_proto::node_name::PATTERN),
                Some(rfaas_proto::node_name::MAX_LEN as u64)
            ),
            "{path} {method}: {schema}"
        );
    }
    let (s, h) = open.call("GET", "/healthz", None);
    assert_eq!((s, h["status"].as_str()), (200, Some("ok")));
    let (s, text) = open.call("GET", "/metrics", None);
    assert_eq!(s, 200);
    let text = text.as_str().unwrap().to_owned();
    for line in [
        "rfaas_manager_grants_total 1",
        "rfaas_manager_nodes{state=\"up\"} 1",
        "rfaas_manager_cores{state=\"free\"} 2",
        "rfaas_manager_cores{state=\"leased\"} 1",
        "rfaas_manager_denials_total{reason=\"no_capacity\"} 0",
        "rfaas_manager_denials_total{reason=\"budget_exhausted\"} 0",
        "rfaas_manager_denials_total{reason=\"request_exceeds_cluster\"} 0",
        "rfaas_manager_unbilled_leases_total 1",
        "rfaas_manager_accounting_instances{state=\"live\"} 0",
    ] {
        assert!(text.lines().any(|l| l == line), "{line:?} not in\n{text}");
    }
    assert!(
        text.contains("rfaas_manager_request_seconds_bucket{method=\"POST\",route=\"/v1/leases\""),
        "{text}"
    );
}

/// What the store does with a job's credentials and leases, its jobs made
/// up: on a manager told explicitly not to ask Slurm (`unchecked`);
/// `slurm_jobs.rs` has what Slurm's word decides.
fn slurm_jobs_get_credentials_and_their_end_releases_their_leases(kind: &str) {
    let mut db = Db::new(kind);
    let m = db.manager_with("[slurm]\nunchecked = true\n", None);
    let node = register(&m, "a", 4, 4096);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let ask = |api: &Api, job: u64, body: serde_json::Value| {
        api.call("POST", &format!("/v1/jobs/{job}/credential"), Some(&body))
    };
    let body = json!({"user": "alice", "account": "physics", "expires_at": now + 3600});
    // The node mints one for job 17; the job leases with it.
    let (s, c) = ask(&node, 17, body.clone());
    assert_eq!(s, 201, "{c}");
    assert_eq!(
        (
            c["job_id"].as_u64(),
            c["subject"].as_str(),
            c["account"].as_str()
        ),
        (Some(17), Some("alice"), Some("physics")),
        "{c}"
    );
    assert_eq!(c["expires_at"].as_u64(), Some(now + 3600), "{c}");
    let job = Api::new(m.url(), c["token"].as_str().unwrap());
    let (s, g) = lease(&job, 2, None, 64, 60);
    assert_eq!(s, 201, "{g}");
    let id = g["id"].as_u64().unwrap();
    let (s, shown) = job.call("GET", &format!("/v1/leases/{id}"), None);
    assert_eq!(s, 200, "{shown}");
    assert_eq!(shown[0]["job_id"].as_u64(), Some(17), "{shown}");
    // Alice's own credential leases outside any job.
    let alice = user(&m, "alice", "physics");
    let (s, own) = lease(&alice, 1, None, 64, 60);
    assert_eq!(s, 201, "{own}");
    assert_eq!(check_no_core_leased_twice(&m), 3);
    // A credential far past the cap is cut to it.
    let (s, long) = ask(
        &node,
        18,
        json!({"user": "bob", "account": "chem", "expires_at": now + 100 * 86_400}),
    );
    assert_eq!(s, 201, "{long}");
    let cap = long["expires_at"].as_u64().unwrap();
    assert!(
        cap <= now + 7 * 86_400 + 5 && cap >= now + 7 * 86_400 - 5,
        "{long}"
    );

    // The job ends: its credential is revoked and its lease released,
    // alice's own lease stays; saying it again changes nothing.
    let (s, ended) = node.call("POST", "/v1/jobs/17/end", None);
    assert_eq!((s, ended), (200, json!({"revoked": 1, "released": 1})));
    let (s, again) = node.call("POST", "/v1/jobs/17/end", None);
    assert_eq!((s, again), (200, json!({"revoked": 0, "released": 0})));
    let (s, e) = job.call("GET", "/v1/leases", None);
    assert_eq!(
        (s, e["error"].as_str()),
        (401, Some("credential_revoked")),
        "{e}"
    );
    let (s, shown) = alice.call("GET", &format!("/v1/leases/{id}"), None);
    assert_eq!(
        (s, shown[0]["state"].as_str()),
        (200, Some("released")),
        "{shown}"
    );
    assert_eq!(check_no_core_leased_twice(&m), 1);

    // Only nodes and the admin speak for jobs; bad requests are 4xx.
    let (s, e) = ask(&alice, 19, body.clone());
    assert_eq!((s, e["error"].as_str()), (403, Some("forbidden")), "{e}");
    let (s, e) = alice.call("POST", "/v1/jobs/18/end", None);
    assert_eq!((s, e["error"].as_str()), (403, Some("forbidden")), "{e}");
    let (s, _) = ask(&m.admin(), 19, body.clone());
    assert_eq!(s, 201);
    for (job_id, bad) in [
        (0, body.clone()),
        (
            20,
            json!({"user": "alice", "account": "physics", "expires_at": now - 1}),
        ),
        (
            20,
            json!({"user": "al ice", "account": "physics", "expires_at": now + 60}),
        ),
        (
            20,
            json!({"user": "alice", "account": "", "expires_at": now + 60}),
        ),
        (
            20,
            json!({"user": "alice", "account": "physics", "expires_at": now + 60, "node": "a"}),
        ),
        (20, json!({"user": "alice", "uid": "root"})),
        (20, json!({"account": "physics"})),
    ] {
        let (s, e) = ask(&node, job_id, bad.clone());
        assert!((400..500).contains(&s), "{bad}: {s} {e}");
        assert!(e["error"].is_string(), "{bad}: {e}");
    }
    let (s, e) = node.call("POST", "/v1/jobs/0/end", None);
    assert_eq!(s, 400, "{e}");

    // A node that names only the user (and uid), as executord does: with
    // no Slurm to ask, the account is the user's name and the limit the
    // cap.
    let (s, c) = ask(&node, 21, json!({"user": "carol", "uid": 1234}));
    assert_eq!(s, 201, "{c}");
    assert_eq!(
        (c["subject"].as_str(), c["account"].as_str()),
        (Some("carol"), Some("carol")),
        "{c}"
    );
    let cap = c["expires_at"].as_u64().unwrap();
    assert!(
        cap <= now + 7 * 86_400 + 5 && cap >= now + 7 * 86_400 - 5,
        "{c}"
    );
}
on_both!(slurm_jobs_get_credentials_and_their_end_releases_their_leases);

fn cores_a_node_withholds_are_not_leased_on_any_replica(kind: &str) {
    let mut db = Db::new(kind);
    let m = db.manager();
    let m2 = db.manager_with("", Some(&m));
    let node = register(&m, "a", 4, 4096);
    let beat = |withheld: u32| {
        let (s, r) = node.call(
            "POST",
            "/v1/nodes/a/heartbeat",
            Some(&json!({"free_cores": 4, "free_memory_mib": 4096, "allocations": [], "withheld_cores": withheld})),
        );
        assert_eq!(s, 200, "{r}");
    };
    // Slurm takes three cores back: both replicas lease the one left.
    beat(3);
    for mgr in [&m, &m2] {
        let admin = mgr.admin();
        wait_for(
            "the replica to see the withheld cores",
            Duration::from_secs(10),
            || {
                let (_, n) = admin.call("GET", "/v1/nodes/a", None);
                (n["withheld_cores"] == 3).then_some(())
            },
        );
    }
    let u = user(&m, "alice", "physics");
    let u2 = Api::new(m2.url(), u.token());
    let (s, e) = lease(&u2, 2, None, 64, 60);
    assert_eq!(s, 503, "{e}");
    let (s, g) = lease(&u2, 2, Some(1), 64, 60);
    assert_eq!((s, granted_cores(&g)), (201, 1), "{g}");
    let (s, e) = lease(&u, 1, None, 64, 60);
    assert_eq!(s, 503, "{e}");
    // Given back: the rest can be leased again.
    beat(0);
    let u2 = Api::new(m2.url(), u.token());
    let g = wait_for(
        "the cores to be lent again",
        Duration::from_secs(10),
        || {
            let (s, g) = lease(&u2, 3, None, 64, 60);
            (s == 201).then_some(g)
        },
    );
    assert_eq!(granted_cores(&g), 3, "{g}");
    assert_eq!(check_no_core_leased_twice(&m), 4);
}
on_both!(cores_a_node_withholds_are_not_leased_on_any_replica);

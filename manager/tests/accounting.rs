//! Billing marks on leases and budgets against a real `rfaas-manager`,
//! each test on SQLite and on a real PostgreSQL server. The accounting
//! service's rows (`account_spend`) are written straight into the shared
//! database, as the service writes them.

mod common;

use common::*;
use rfaas_testkit::manager::Api;
use serde_json::json;

fn leases_carry_the_nodes_harvested_mark(kind: &str) {
    let mut db = Db::new(kind);
    let m = db.manager();
    register(&m, "own", 1, 4096);
    let cred = m.credential("node", "idle", None);
    let mut body = node_body(7101, 1, 4096);
    body["harvested"] = true.into();
    let (s, n) = Api::new(m.url(), &cred).call("PUT", "/v1/nodes/idle", Some(&body));
    assert_eq!(
        (s, n["node"]["harvested"].as_bool()),
        (200, Some(true)),
        "{n}"
    );
    let u = user(&m, "alice", "physics");
    let (s, g) = lease(&u, 2, None, 64, 60);
    assert_eq!(s, 201, "{g}");
    let (_, nodes) = m.admin().call("GET", "/v1/nodes?fresh=true", None);
    let marks: Vec<(&str, bool)> = nodes
        .as_array()
        .unwrap()
        .iter()
        .map(|n| {
            (
                n["name"].as_str().unwrap(),
                n["harvested"].as_bool().unwrap(),
            )
        })
        .collect();
    assert_eq!(marks, [("idle", true), ("own", false)]);
    let rows = db.sql(&[&format!(
        "SELECT harvested, CASE WHEN job_id IS NULL THEN 1 ELSE 0 END FROM leases WHERE grant_id = {} ORDER BY node",
        g["id"]
    )]);
    assert_eq!(rows, [[1, 1], [0, 1]], "harvested from the node, no job");
}
on_both!(leases_carry_the_nodes_harvested_mark);

fn a_spent_budget_refuses_new_leases_only(kind: &str) {
    let mut db = Db::new(kind);
    let m = db.manager();
    register(&m, "n1", 8, 8192);
    let admin = m.admin();
    let (s, b) = admin.call("PUT", "/v1/budgets/physics", Some(&json!({"budget": 10})));
    assert_eq!(s, 200, "{b}");
    assert_eq!(
        (
            b["account"].as_str(),
            b["budget"].as_f64(),
            b["spend"].as_f64()
        ),
        (Some("physics"), Some(10.0), Some(0.0)),
        "{b}"
    );
    let u = user(&m, "alice", "physics");
    let (s, g) = lease(&u, 1, None, 64, 60);
    assert_eq!(s, 201, "{g}");
    // The accounting service prices what the account used.
    db.sql(&["INSERT INTO account_spend (account, spend, updated_ms) VALUES ('physics', 12.5, 1)"]);
    let (s, e) = lease(&u, 1, None, 64, 60);
    assert_eq!(
        (s, e["error"].as_str()),
        (403, Some("budget_exhausted")),
        "{e}"
    );
    assert_eq!(
        (
            e["account"].as_str(),
            e["budget"].as_f64(),
            e["spend"].as_f64()
        ),
        (Some("physics"), Some(10.0), Some(12.5)),
        "{e}"
    );
    assert_eq!(check_no_core_leased_twice(&m), 1, "the refusal held cores");
    // The lease granted before runs on: it renews and releases.
    let id = g["id"].as_u64().unwrap();
    let (s, r) = u.call(
        "POST",
        &format!("/v1/leases/{id}/renew"),
        Some(&json!({"duration_s": 600})),
    );
    assert_eq!(s, 200, "{r}");
    assert_eq!(u.call("DELETE", &format!("/v1/leases/{id}"), None).0, 204);
    // Other accounts are not held back.
    let bob = user(&m, "bob", "chem");
    assert_eq!(lease(&bob, 1, None, 64, 60).0, 201);
    // Listed with the spend; a larger budget lets the account lease again.
    let (s, list) = admin.call("GET", "/v1/budgets", None);
    assert_eq!(s, 200, "{list}");
    assert_eq!(
        list,
        json!([{"account": "physics", "budget": 10.0, "spend": 12.5, "updated_ms": list[0]["updated_ms"]}])
    );
    let (s, b) = admin.call("PUT", "/v1/budgets/physics", Some(&json!({"budget": 20.5})));
    assert_eq!((s, b["budget"].as_f64()), (200, Some(20.5)), "{b}");
    assert_eq!(lease(&u, 1, None, 64, 60).0, 201);
    // Cleared: no budget, no refusal; clearing twice says so.
    db.sql(&["UPDATE account_spend SET spend = 1000 WHERE account = 'physics'"]);
    assert_eq!(lease(&u, 1, None, 64, 60).0, 403);
    assert_eq!(admin.call("DELETE", "/v1/budgets/physics", None).0, 204);
    assert_eq!(lease(&u, 1, None, 64, 60).0, 201);
    let (s, e) = admin.call("DELETE", "/v1/budgets/physics", None);
    assert_eq!((s, e["error"].as_str()), (404, Some("not_found")), "{e}");
    assert_eq!(admin.call("GET", "/v1/budgets", None), (200, json!([])));
    assert_eq!(
        metric(
            &m,
            "rfaas_manager_denials_total{reason=\"budget_exhausted\"}"
        ),
        2.0
    );
}
on_both!(a_spent_budget_refuses_new_leases_only);

fn budgets_are_the_admins(kind: &str) {
    let mut db = Db::new(kind);
    let m = db.manager();
    let node = register(&m, "n1", 1, 1024);
    let u = user(&m, "alice", "physics");
    let body = json!({"budget": 1000});
    for caller in [&u, &node] {
        for (method, path, body) in [
            ("GET", "/v1/budgets", None),
            ("PUT", "/v1/budgets/physics", Some(&body)),
            ("DELETE", "/v1/budgets/physics", None),
        ] {
            let (s, e) = caller.call(method, path, body);
            assert_eq!(
                (s, e["error"].as_str()),
                (403, Some("forbidden")),
                "{method} {path}: {e}"
            );
        }
    }
    let (s, _) = Api::new(m.url(), "").call("GET", "/v1/budgets", None);
    assert_eq!(s, 401);
    let admin = m.admin();
    for (path, body) in [
        ("/v1/budgets/physics", json!({"budget": -1})),
        ("/v1/budgets/physics", json!({"budget": 1e300})),
        ("/v1/budgets/physics", json!({"budget": "ten"})),
        (
            "/v1/budgets/physics",
            json!({"budget": 1, "currency": "CHF"}),
        ),
        ("/v1/budgets/a%20b", json!({"budget": 1})),
    ] {
        let (s, e) = admin.call("PUT", path, Some(&body));
        assert!(
            (400..500).contains(&s) && e["error"] == "malformed_request",
            "PUT {path} {body}: {s} {e}"
        );
    }
    assert_eq!(admin.call("GET", "/v1/budgets", None), (200, json!([])));
}
on_both!(budgets_are_the_admins);

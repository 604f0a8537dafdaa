//! Billing slots and budgets against a real `rfaas-manager`, each test on
//! SQLite and on a real PostgreSQL server. The accounting service's rows
//! (`accounting_instances`, `billing_slots`, `account_spend`) are written
//! straight into the shared database, as the service writes them.

mod common;

use std::collections::HashSet;

use common::*;
use rfaas_proto::accounting::BillingSlot;
use rfaas_proto::lease::LeaseKeys;
use rfaas_testkit::manager::{Api, Manager};
use rfaas_testkit::on_both;
use serde_json::{json, Value};

/// The billing slot of each node lease of `grant`, by lease id, after
/// checking that its token carries the same one, signed.
fn billing(m: &Manager, grant: &Value) -> Vec<(u64, Option<BillingSlot>)> {
    let mut keys = LeaseKeys::new();
    keys.add_text(&m.public_key_line()).unwrap();
    grant["leases"]
        .as_array()
        .expect("leases")
        .iter()
        .map(|l| {
            let claims = keys
                .verify_signature(l["token"].as_str().unwrap())
                .expect("a token the manager signed");
            let slot: Option<BillingSlot> = serde_json::from_value(l["billing"].clone()).ok();
            assert_eq!(claims.billing, slot, "token and grant disagree: {l}");
            assert_eq!(claims.lease_id, l["lease_id"].as_u64().unwrap());
            (claims.lease_id, slot)
        })
        .collect()
}

/// The lease each slot of `instance` holds, by slot (0: free).
fn slot_leases(db: &Db, instance: &str) -> Vec<u64> {
    db.sql(&[&format!(
        "SELECT lease_id FROM billing_slots WHERE instance = '{instance}' ORDER BY slot"
    )])
    .iter()
    .map(|r| r[0] as u64)
    .collect()
}

fn tokens_carry_a_slot_from_a_live_instance(kind: &str) {
    let mut db = Db::new(kind);
    // The nodes never heartbeat: they must not be lost however long the
    // test takes.
    let m = db.manager_with(&format!("{ACCOUNTING}lost_after_ms = 600000\n"), None);
    db.add_instance("acct-a", 3, rfaas_service::now_ms());
    db.add_instance("acct-dead", 50, 1);
    wait_for_instances(&m, 1, 1);
    register(&m, "n1", 2, 4096);
    register(&m, "n2", 2, 4096);
    let u = user(&m, "alice", "physics");

    // Two node leases, each with its own slot of the live instance.
    let (s, g) = lease(&u, 4, None, 64, 60);
    assert_eq!(s, 201, "{g}");
    let slots = billing(&m, &g);
    assert_eq!(slots.len(), 2, "{g}");
    let mut seen = HashSet::new();
    for (lease_id, slot) in &slots {
        let slot = slot
            .as_ref()
            .unwrap_or_else(|| panic!("lease {lease_id} unbilled: {g}"));
        assert_eq!(
            (
                slot.instance.as_str(),
                slot.provider.as_str(),
                slot.addr.as_str()
            ),
            ("acct-a", "tcp", "127.0.0.1:7400")
        );
        assert!(seen.insert(slot.slot), "two leases on slot {}", slot.slot);
        assert_eq!(slot_leases(&db, "acct-a")[slot.slot as usize], *lease_id);
    }

    // A renewal keeps the slots, in its tokens too.
    let id = g["id"].as_u64().unwrap();
    let (s, r) = u.call(
        "POST",
        &format!("/v1/leases/{id}/renew"),
        Some(&json!({"duration_s": 120})),
    );
    assert_eq!(s, 200, "{r}");
    let mut renewed = billing(&m, &r);
    let mut granted = slots.clone();
    renewed.sort_by_key(|l| l.0);
    granted.sort_by_key(|l| l.0);
    assert_eq!(renewed, granted, "a renewal moved a slot");

    // The slots stay assigned after the release (the accounting service
    // frees them after its final flush): the third lease takes the last
    // one, and the fourth finds none and runs unbilled.
    assert_eq!(u.call("DELETE", &format!("/v1/leases/{id}"), None).0, 204);
    let (s, g3) = lease(&u, 1, None, 64, 60);
    assert_eq!(s, 201, "{g3}");
    let third = billing(&m, &g3);
    let slot3 = third[0].1.clone().expect("the last free slot");
    assert!(
        !seen.contains(&slot3.slot),
        "slot {} given twice",
        slot3.slot
    );
    let (s, g4) = lease(&u, 1, None, 64, 60);
    assert_eq!(s, 201, "{g4}");
    assert_eq!(billing(&m, &g4)[0].1, None, "no slot is free: {g4}");
    assert!(g4["leases"][0].get("billing").is_none(), "{g4}");
    assert_eq!(metric(&m, "rfaas_manager_unbilled_leases_total"), 1.0);
    let mut held: Vec<u64> = slot_leases(&db, "acct-a");
    held.sort();
    let mut want: Vec<u64> = slots.iter().map(|l| l.0).chain([third[0].0]).collect();
    want.sort();
    assert_eq!(held, want);
    // The dead instance had room throughout and got nothing.
    assert!(
        slot_leases(&db, "acct-dead").iter().all(|l| *l == 0),
        "a slot of a dead instance was used"
    );

    // Once the service frees a slot, the next lease takes it.
    db.sql(&[&format!(
        "UPDATE billing_slots SET lease_id = 0 WHERE instance = 'acct-a' AND slot = {}",
        slot3.slot
    )]);
    let (s, g5) = lease(&u, 1, None, 64, 60);
    assert_eq!(s, 201, "{g5}");
    assert_eq!(
        billing(&m, &g5)[0].1.as_ref().map(|b| b.slot),
        Some(slot3.slot),
        "{g5}"
    );
}
on_both!(tokens_carry_a_slot_from_a_live_instance);

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

fn required_accounting_refuses_unbilled_leases(kind: &str) {
    let mut db = Db::new(kind);
    let m = db.manager_with(
        "accounting = { lost_after_ms = 600000, required = true }\n",
        None,
    );
    register(&m, "n1", 4, 4096);
    let u = user(&m, "alice", "physics");
    let body = json!({"cores": 1, "memory_mib": 64, "duration_s": 60});
    let refused = |u: &Api| {
        let (s, retry, e) = u.call_full("POST", "/v1/leases", Some(&body));
        assert_eq!(
            (s, e["error"].as_str()),
            (503, Some("accounting_unavailable")),
            "{e}"
        );
        assert_eq!(retry, Some(1), "{e}");
    };
    // No instance at all.
    refused(&u);
    // A dead one is no better.
    db.add_instance("acct-dead", 8, 1);
    wait_for_instances(&m, 0, 1);
    refused(&u);
    // A live one with one slot: one lease, then none (and no core is
    // held by the refused grant).
    db.add_instance("acct-a", 1, rfaas_service::now_ms());
    wait_for_instances(&m, 1, 1);
    let (s, g) = lease(&u, 1, None, 64, 60);
    assert_eq!(s, 201, "{g}");
    assert_eq!(billing(&m, &g)[0].1.as_ref().map(|b| b.slot), Some(0));
    refused(&u);
    assert_eq!(check_no_core_leased_twice(&m), 1);
    assert_eq!(metric(&m, "rfaas_manager_unbilled_leases_total"), 0.0);
    assert_eq!(
        metric(
            &m,
            "rfaas_manager_denials_total{reason=\"accounting_unavailable\"}"
        ),
        3.0
    );
}
on_both!(required_accounting_refuses_unbilled_leases);

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

//! Billing marks on leases against a real `rfaas-manager`, each test on
//! SQLite and on a real PostgreSQL server, read back straight from the
//! shared database, as the accounting service reads them.

mod common;

use common::*;
use rfaas_testkit::manager::Api;

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

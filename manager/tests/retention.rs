//! Retention against a real `rfaas-manager`, on SQLite and on a real
//! PostgreSQL server: `rfaas-manager purge` deletes ended leases with
//! their usage and snapshots, leaves live leases alone, and reports give
//! the same totals over whole days before and after.

mod common;

use std::collections::BTreeMap;
use std::process::Command;
use std::time::Duration;

use common::*;
use rfaas_service::usage::COUNTERS;
use rfaas_testkit::manager::{manager_binary, Api, Manager};
use rfaas_testkit::on_both;
use rfaas_testkit::wait::wait_for;
use serde_json::Value;

const DAY: u64 = 86_400_000;
const HOUR: u64 = 3_600_000;

/// Adds a snapshot of lease `lease` at `at_ms` whose counters all hold
/// `v` (each counter scaled, so a mix-up of columns shows).
fn snapshot(lease: u64, at_ms: u64, v: u64) -> String {
    format!(
        "INSERT INTO usage_snapshots (lease_id, at_ms, alloc_mib_ms, compute_ns, hot_ns, warm_ns, invocations, bytes_in, bytes_out) \
         VALUES ({lease}, {at_ms}, {}, {}, {}, {}, {}, {}, {})",
        v, 2 * v, 3 * v, 4 * v, 5 * v, 6 * v, 7 * v
    )
}

/// Sets lease `lease`'s current totals (`usage`) to `v`, flushed at
/// `updated_ms`.
fn current(lease: u64, updated_ms: u64, v: u64) -> String {
    format!(
        "INSERT INTO usage (lease_id, instance, slot, alloc_mib_ms, compute_ns, hot_ns, warm_ns, invocations, bytes_in, bytes_out, finalized, first_ms, updated_ms) \
         VALUES ({lease}, 'acct-1', 0, {}, {}, {}, {}, {}, {}, {}, 1, 0, {updated_ms})",
        v, 2 * v, 3 * v, 4 * v, 5 * v, 6 * v, 7 * v
    )
}

/// The usage report of `[start, end)` (end `None`: now), summed per
/// user, account, job, node and harvested flag: what any report groups
/// by once lease ids are gone.
fn report(admin: &Api, start: u64, end: Option<u64>, users: &str) -> BTreeMap<String, Vec<u64>> {
    let mut path = format!("/v1/usage?start_ms={start}");
    if let Some(end) = end {
        path.push_str(&format!("&end_ms={end}"));
    }
    if !users.is_empty() {
        path.push_str(&format!("&users={users}"));
    }
    let (s, rows) = admin.call("GET", &path, None);
    assert_eq!(s, 200, "{path}: {rows}");
    let mut out: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    for r in rows.as_array().expect("a list") {
        let key = format!(
            "{}/{}/{}/{}/{}",
            r["user"], r["account"], r["job"], r["node"], r["harvested"]
        );
        let sums = out.entry(key).or_insert_with(|| vec![0; 7]);
        for (k, c) in COUNTERS.iter().enumerate() {
            sums[k] += r["usage"][c]
                .as_u64()
                .unwrap_or_else(|| panic!("{c} in {r}"));
        }
    }
    out
}

fn lease_of(grant: &Value) -> (u64, u64) {
    (
        grant["id"].as_u64().expect("id"),
        grant["leases"][0]["lease_id"].as_u64().expect("lease_id"),
    )
}

fn purge(m: &Manager, days: &str) -> String {
    let out = Command::new(manager_binary())
        .arg("--config")
        .arg(m.config_file())
        .args(["purge", "--ended-before-days", days])
        .output()
        .expect("run rfaas-manager purge");
    assert!(
        out.status.success(),
        "rfaas-manager purge: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn purged_leases_keep_their_usage_in_reports(kind: &str) {
    let mut db = Db::new(kind);
    let m = db.manager();
    register(&m, "n1", 8, 8192);
    let alice = user(&m, "alice", "physics");
    let bob = user(&m, "bob", "chem");
    let (ga, a) = lease_of(&granted(&alice, 1, 64, 600));
    let (gb, b) = lease_of(&granted(&bob, 1, 64, 600));
    let (_, live) = lease_of(&granted(&alice, 1, 64, 600));
    for (u, g) in [(&alice, ga), (&bob, gb)] {
        assert_eq!(u.call("DELETE", &format!("/v1/leases/{g}"), None).0, 204);
    }
    // Five days ago at midnight UTC, and usage around the days after:
    // snapshots inside days and one exactly at midnight (it closes the day
    // before); an ended lease's last flush is a snapshot, as the
    // accounting service writes it. The live lease has usage flushed
    // after its last snapshot, which reports until now count.
    let now = rfaas_service::now_ms();
    let d0 = (now / DAY - 5) * DAY;
    db.sql(&[
        &snapshot(a, d0 + HOUR, 10),
        &snapshot(a, d0 + DAY, 30),
        &snapshot(a, d0 + DAY + 5 * HOUR, 70),
        &snapshot(a, d0 + 3 * DAY + 1, 100),
        &current(a, d0 + 3 * DAY + 1, 100),
        &snapshot(b, d0 + 2 * DAY + 3 * HOUR, 5),
        &snapshot(b, d0 + 4 * DAY, 9),
        &current(b, d0 + 4 * DAY, 9),
        &snapshot(live, d0 + HOUR, 7),
        &current(live, d0 + 2 * HOUR, 8),
    ]);
    let admin = m.admin();
    let periods = [
        (d0, Some(d0 + DAY), ""),
        (d0 + DAY, Some(d0 + 2 * DAY), ""),
        (d0 + 2 * DAY, Some(d0 + 4 * DAY), ""),
        (d0 - DAY, Some(d0 + 3 * DAY), ""),
        (d0 - DAY, Some(d0 + 4 * DAY), "bob"),
        (d0, None, ""),
        (d0 + DAY, None, "alice"),
    ];
    let before: Vec<_> = periods
        .iter()
        .map(|&(s, e, u)| report(&admin, s, e, u))
        .collect();
    assert!(
        before.iter().all(|r| !r.is_empty()),
        "every period has usage to compare: {before:?}"
    );

    // Nothing has ended 90 days ago: the default age purges nothing.
    assert!(purge(&m, "90").contains("purged 0 ended leases"));
    let out = purge(&m, "0");
    assert!(
        out.contains("purged 2 ended leases, 2 usage rows, 6 usage snapshots"),
        "{out}"
    );
    let after: Vec<_> = periods
        .iter()
        .map(|&(s, e, u)| report(&admin, s, e, u))
        .collect();
    for ((p, b), a) in periods.iter().zip(&before).zip(&after) {
        assert_eq!(b, a, "the report of {p:?} changed with the purge");
    }

    // The ended leases and their usage are gone; the live one is whole.
    let left = |table: &str, column: &str| {
        db.sql(&[&format!(
            "SELECT COUNT(*) FROM {table} WHERE {column} IN ({a}, {b})"
        )])[0][0]
    };
    assert_eq!(left("leases", "id"), 0);
    assert_eq!(left("usage", "lease_id"), 0);
    assert_eq!(left("usage_snapshots", "lease_id"), 0);
    assert_eq!(
        db.sql(&[&format!(
            "SELECT COUNT(*) FROM usage_snapshots WHERE lease_id = {live}"
        )])[0][0],
        1
    );
    let (s, leases) = alice.call("GET", "/v1/leases", None);
    assert_eq!(s, 200, "{leases}");
    assert_eq!(leases[0]["lease_id"].as_u64(), Some(live), "{leases}");
    // Grants go on.
    granted(&bob, 1, 64, 600);
}
on_both!(purged_leases_keep_their_usage_in_reports);

/// Inserts `n` leases of user `carol` on node `n1` that ended `days_ago`
/// days ago, in one statement (both databases count with a recursive
/// query), and refreshes the planner's statistics.
fn add_ended_leases(db: &Db, n: u64, days_ago: u64) {
    let ended = rfaas_service::now_ms() - days_ago * DAY;
    let s = ended / 1000;
    db.sql(&[
        &format!(
            "WITH RECURSIVE k(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM k WHERE i < {n})
             INSERT INTO leases (id, grant_id, node, owner, user_name, account, cores, memory_mib,
                issued_at, expires_at, state, ended_ms, harvested)
             SELECT 1000000000 + i, 1000000000 + i, 'n1', 'carol', 'carol', 'physics', 1, 64,
                {}, {s}, 'released', {ended}, 0 FROM k",
            s - 60
        ),
        "ANALYZE",
    ]);
}

/// With many ended leases in the table, what the request path and the
/// reaper read of the leases goes through the index on live ones, and the
/// purge finds the old ones through its own index. A replica's purge task
/// then removes them in batches, one replica at a time, and counts them.
fn the_purge_task_removes_old_leases_in_batches(kind: &str) {
    let mut db = Db::new(kind);
    let m = db.manager();
    register(&m, "n1", 8, 8192);
    let alice = user(&m, "alice", "physics");
    let (_, live) = lease_of(&granted(&alice, 1, 64, 600));
    add_ended_leases(&db, 20_000, 100);
    // Either index that leads with the state reads live leases only.
    for (statement, index) in [
        (
            "SELECT MIN(expires_at) AS soonest FROM leases WHERE state = 'active'",
            &["leases_by_state", "leases_listed"][..],
        ),
        (
            "UPDATE leases SET state = 'expired', ended_ms = 1 WHERE state = 'active' AND expires_at <= 5 RETURNING id",
            &["leases_by_state", "leases_listed"],
        ),
        (
            "SELECT id FROM leases WHERE state <> 'active' AND ended_ms < 5 ORDER BY ended_ms LIMIT 100",
            &["leases_ended"],
        ),
    ] {
        let plan = db.plan(statement);
        assert!(
            index.iter().any(|i| plan.contains(i)),
            "{statement}:\n{plan}"
        );
    }

    // Another replica, purging every second: the first replica's purge
    // comes an hour after its start.
    let purger = db.manager_with(
        "lost_after_ms = 600000\n[retention]\ninterval_s = 1\nbatch = 700\npause_ms = 0\n",
        Some(&m),
    );
    let purged = r#"rfaas_manager_retention_purged_rows_total{table="leases"} "#;
    wait_for(
        "the purge task to remove 20000 ended leases",
        Duration::from_secs(120),
        || (metric(&purger, purged) >= 20_000.0).then_some(()),
    );
    assert_eq!(metric(&purger, purged), 20_000.0);
    assert!(
        metric(
            &purger,
            "rfaas_manager_retention_last_run_timestamp_seconds "
        ) > 0.0
    );
    assert_eq!(metric(&m, purged), 0.0);
    assert_eq!(
        db.sql(&["SELECT COUNT(*) FROM leases"]),
        vec![vec![1]],
        "only the live lease is left"
    );
    let (s, leases) = alice.call("GET", "/v1/leases", None);
    assert_eq!(s, 200, "{leases}");
    assert_eq!(leases[0]["lease_id"].as_u64(), Some(live), "{leases}");
    granted(&alice, 1, 64, 600);
}
on_both!(the_purge_task_removes_old_leases_in_batches);

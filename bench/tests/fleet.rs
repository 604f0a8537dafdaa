//! `rfaas-fleet` end to end at two small fleets (100 and 1,000 nodes)
//! against three replicas of rfaas-manager's debug build on a throwaway
//! PostgreSQL with pg_stat_statements, short windows: every phase runs
//! (credentials, registration, heartbeats, grants, silent nodes marked
//! lost, a rolling restart, node_visible) and each row carries the keys
//! docs/benchmarks.md describes, with figures that hold whatever the
//! machine's speed. The targets are the benchmark's to judge.

use std::process::Command;

const INTERVAL_MS: u64 = 1000;
const LOST_AFTER_MS: u64 = 3000;

#[test]
fn a_row_per_point_with_every_figure() {
    let manager = rfaas_testkit::manager::manager_binary();
    let out = Command::new(env!("CARGO_BIN_EXE_rfaas-fleet"))
        .args(["--nodes", "100,1000", "--replicas", "3", "--window-s", "2"])
        .args(["--probes", "2", "--silent", "2", "--json"])
        .args(["--heartbeat-interval-ms", &INTERVAL_MS.to_string()])
        .args(["--lost-after-ms", &LOST_AFTER_MS.to_string()])
        // The configured interval at both sizes: it does not grow.
        .args(["--heartbeats-per-s", "0"])
        .arg("--manager-bin")
        .arg(&manager)
        .output()
        .expect("start rfaas-fleet");
    let rows = rfaas_testkit::json_lines(&out);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(rows.len(), 2, "{rows:#?}\n{stderr}");
    for (row, nodes) in rows.iter().zip([100u64, 1000]) {
        let n = |k: &str| row[k].as_f64().unwrap_or_else(|| panic!("no {k} in {row}"));
        assert_eq!(row["name"], "fleet", "{row}");
        assert_eq!(
            (row["nodes"].as_u64(), row["replicas"].as_u64()),
            (Some(nodes), Some(3))
        );
        // The nodes were handed the configured interval and honoured it:
        // never more than one heartbeat per node per interval (and a
        // margin for the window's edges).
        assert_eq!(row["heartbeat_interval_ms"], INTERVAL_MS, "{row}");
        assert_eq!(row["lost_after_ms"], LOST_AFTER_MS, "{row}");
        let most = nodes as f64 * 1000.0 / INTERVAL_MS as f64;
        assert!(n("heartbeats_per_s") > 0.0, "{row}");
        assert!(n("heartbeats_per_s") <= most * 1.5, "{row}");
        // The replicas ran statements and used CPU for the fleet, and
        // their liveness statements were told from the others by their tag.
        assert!(n("db_statements_per_node_min") > 0.0, "{row}");
        assert!(n("db_other_statements_per_node_min") > 0.0, "{row}");
        assert!(n("replica_cpu_ms_per_node_min") > 0.0, "{row}");
        assert!(
            n("grants") > 0.0 && n("grant_p99_ns") >= n("grant_p50_ns"),
            "{row}"
        );
        assert!(n("grant_p50_ns") > 0.0, "{row}");
        assert_eq!(row["probes"], 2, "{row}");
        assert!(n("node_visible_p99_ns") > 0.0, "{row}");
        // The silent nodes were found lost (how soon is the benchmark's to
        // judge: under load a replica may reap from a time another has
        // not flushed yet).
        assert_eq!(row["silent_nodes"], 2, "{row}");
        assert!(n("lost_detect_ns") > 0.0, "{row}");
        assert_eq!(
            row["lost_detect_target_ns"],
            (LOST_AFTER_MS + INTERVAL_MS) * 1_000_000,
            "{row}"
        );
        assert!(row["lost_in_restart"].is_u64(), "{row}");
        assert!(row["meets_target"].is_boolean(), "{row}");
        assert!(row["missed"].is_array(), "{row}");
    }
    assert_eq!(
        rows[0]["grant_p99_growth"], 1.0,
        "the smallest fleet is the base"
    );
    assert!(stderr.contains("liveness/node/min"), "the table: {stderr}");
}

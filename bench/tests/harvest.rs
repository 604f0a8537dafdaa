//! `rfaas-harvest` end to end with a handful of jobs: two real loopback
//! Slurm clusters in turn (scripts/slurm-cluster.sh), the second with
//! rfaas_spank.so, a manager and an executor daemon per node (their debug
//! builds), and offloading clients. It checks that both rows come out
//! with the keys docs/benchmarks.md describes and figures that make
//! sense, not how fast anything was: the targets are the benchmark's to
//! judge. Runs as root with Slurm installed, as the cluster tests do.

use std::process::Command;

use serde_json::Value;

const JOBS: u64 = 6;

#[test]
fn both_runs_give_a_harvest_row() {
    let plugin = rfaas_testkit::slurm::spank_plugin().unwrap_or_else(|e| panic!("{e}"));
    let executord = rfaas_testkit::executord::daemon_binary();
    let manager = rfaas_testkit::manager::manager_binary();
    let out = Command::new(env!("CARGO_BIN_EXE_rfaas-harvest"))
        .args(["--jobs", &JOBS.to_string()])
        .args(["--min-seconds", "0.5", "--max-seconds", "1", "--seed", "3"])
        .args(["--grace", "5", "--clients", "1", "--json"])
        .arg("--executord")
        .arg(&executord)
        .arg("--manager-bin")
        .arg(&manager)
        .arg("--plugin")
        .arg(&plugin)
        .output()
        .expect("start rfaas-harvest");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "rfaas-harvest failed ({}):\n{stdout}\n{stderr}",
        out.status
    );
    let rows: Vec<Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l:?} is not JSON: {e}")))
        .collect();
    assert_eq!(rows.len(), 2, "{stdout}\n{stderr}");
    assert!(
        stderr.contains("seed 3 (--seed 3 repeats this stream)"),
        "{stderr}"
    );

    for (row, plugin) in rows.iter().zip([false, true]) {
        assert_eq!(row["name"], "harvest", "{row}");
        assert_eq!(row["plugin"], plugin, "{row}");
        assert_eq!(
            (row["seed"].as_u64(), row["jobs"].as_u64()),
            (Some(3), Some(JOBS))
        );
        // Every job ran, every start was measured, no node drained.
        assert_eq!(row["failed_jobs"], 0, "{row}\n{stderr}");
        assert_eq!(row["drained_nodes"], serde_json::json!([]), "{row}");
        assert_eq!(row["start_delays"], JOBS, "{row}");
        let p50 = row["start_delay_p50_ns"].as_u64().unwrap();
        let p99 = row["start_delay_p99_ns"].as_u64().unwrap();
        let max = row["start_delay_max_ns"].as_u64().unwrap();
        assert!(0 < p50 && p50 <= p99 && p99 <= max, "{row}");
        assert_eq!(
            row["max_delay_over_grace_ns"].as_i64(),
            Some(max as i64 - 5_000_000_000),
            "{row}"
        );
        assert!(row["idle_core_s"].as_f64().unwrap() > 0.0, "{row}");
        assert!(row["duration_ms"].as_u64().unwrap() > 0, "{row}");
        assert!(row["slurm_samples"].as_u64().unwrap() > 0, "{row}");
    }

    let (without, with) = (&rows[0], &rows[1]);
    assert_eq!(without["offered_share"], Value::Null, "{without}");
    assert_eq!(without["registration_p99_ns"], Value::Null, "{without}");
    assert_eq!(without["invocations"], 0, "{without}");
    assert!(without.get("meets_target").is_none(), "{without}");

    let share = with["offered_share"].as_f64().unwrap();
    assert!(share > 0.0 && share <= 1.0, "{with}");
    let offered = with["offered_core_s"].as_f64().unwrap();
    assert!(offered <= with["idle_core_s"].as_f64().unwrap(), "{with}");
    // Each job's end was registered, or its CPUs went to another job
    // first; none went unseen.
    let registered = with["registrations"].as_u64().unwrap();
    assert!(registered >= 1, "{with}");
    assert_eq!(with["registrations_missing"], 0, "{with}\n{stderr}");
    assert_eq!(
        registered + with["registrations_superseded"].as_u64().unwrap(),
        JOBS,
        "{with}"
    );
    let p50 = with["registration_p50_ns"].as_u64().unwrap();
    assert!(
        p50 <= with["registration_p99_ns"].as_u64().unwrap(),
        "{with}"
    );
    assert!(with["manager_samples"].as_u64().unwrap() > 0, "{with}");
    // The client was answered, and always with the echo.
    assert!(
        with["invocations"].as_u64().unwrap() > 0,
        "{with}\n{stderr}"
    );
    assert_eq!(with["wrong_answers"], 0, "{with}");
    // The targets are judged and named.
    assert!(with["meets_target"].is_boolean(), "{with}");
    assert!(with["missed"].is_array(), "{with}");
    assert_eq!(with["target_offered_share_min"], 0.95);
    assert_eq!(with["target_registration_p99_max_ns"], 1_000_000_000);
    assert_eq!(with["target_delay_over_grace_max_ns"], 2_000_000_000);
    assert_eq!(with["target_added_idle_p99_max_ns"], 100_000_000);
}

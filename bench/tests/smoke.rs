//! Both binaries run a few rows end to end and print the JSON lines the
//! docs and scripts rely on. Few iterations: these check that every path
//! works (peers, the executor daemon, the manager's replicas and databases,
//! derived rows), not how fast it is.

use std::process::Command;

use serde_json::Value;

/// Runs `bin` with `args` and returns its JSON lines; panics with its
/// output when it fails.
fn json_rows(bin: &str, args: &[&str]) -> Vec<Value> {
    let out = Command::new(bin)
        .args(args)
        .args(["--json", "--cpu-pin", "off"])
        .output()
        .expect("start the bench");
    rfaas_testkit::json_lines(&out)
}

fn find<'a>(rows: &'a [Value], name: &str, provider: &str, size: u64) -> &'a Value {
    rows.iter()
        .find(|r| r["name"] == name && r["provider"] == provider && r["size"] == size)
        .unwrap_or_else(|| panic!("no {name}/{provider}/{size} row in {rows:#?}"))
}

#[test]
fn fabric_bench_rows() {
    let rows = json_rows(
        env!("CARGO_BIN_EXE_rfaas-fabric-bench"),
        &[
            "--provider",
            "shm",
            "--rows",
            "pingpong,raw_shm_pingpong_blocking",
            "--sizes",
            "64",
            "--iters",
            "50",
        ],
    );
    assert_eq!(rows.len(), 2, "{rows:#?}");
    for name in ["pingpong", "raw_shm_pingpong_blocking"] {
        let row = find(&rows, name, "shm", 64);
        assert!(row["median_ns"].as_u64().unwrap() > 0);
        assert!(row["p99_ns"].as_u64().unwrap() >= row["median_ns"].as_u64().unwrap());
        assert_eq!(row["iters"], 50);
    }
}

#[test]
fn invocation_rows_against_a_real_daemon() {
    let daemon = rfaas_testkit::executord::daemon_binary();
    let rows = json_rows(
        env!("CARGO_BIN_EXE_rfaas-bench"),
        &[
            "--provider",
            "tcp",
            "--rows",
            "hot_noop,pingpong,echo_pulled,transfer,bandwidth,pingpong_bandwidth,memcpy_bandwidth,cold_start,grpc_echo",
            "--sizes",
            "64",
            "--bw-sizes",
            "4096,200000",
            "--bw-bytes",
            "1000000",
            "--iters",
            "50",
            "--cold-iters",
            "2",
            "--executord",
            daemon.to_str().expect("a UTF-8 path"),
        ],
    );
    for name in [
        "hot_noop",
        "pingpong",
        "grpc_echo",
        "cold_start",
        "cold_start_worker",
    ] {
        let size = if name.starts_with("cold") { 1 } else { 64 };
        assert!(
            find(&rows, name, "tcp", size)["median_ns"]
                .as_u64()
                .unwrap()
                > 0
        );
    }
    assert_eq!(find(&rows, "cold_start", "tcp", 1)["iters"], 2);
    // 200000 bytes is above echo_pulled's input capacity: the worker
    // pulls the payload. transfer sends it with the request.
    for name in ["echo_pulled", "transfer"] {
        for size in [4096, 200_000] {
            assert!(
                find(&rows, name, "tcp", size)["bytes_per_s"]
                    .as_u64()
                    .unwrap()
                    > 0
            );
            assert_eq!(
                find(&rows, &format!("{name}_vs_bandwidth"), "tcp", size)["of"],
                format!("{name} / bandwidth")
            );
        }
    }
    for name in [
        "echo_copy_estimate",
        "pingpong_bandwidth_vs_bandwidth",
        "transfer_vs_pingpong_bandwidth",
    ] {
        let ratio = find(&rows, name, "tcp", 200_000)["ratio"].as_f64().unwrap();
        assert!(ratio > 0.0, "{name}: {ratio}");
    }
    let overhead = find(&rows, "hot_overhead", "tcp", 64);
    assert_eq!(overhead["of"], "hot_noop - pingpong");
    assert_eq!(overhead["target_max_ns"], 1000);
    assert!(overhead["meets_target"].is_boolean());
    let ratio = find(&rows, "grpc_echo_over_hot_noop", "tcp", 64);
    assert_eq!(ratio["target_min"], 5.0);
    assert!(ratio["ratio"].as_f64().unwrap() > 0.0);
}

/// The manager rows (rfaas-manager's debug build, PostgreSQL through
/// scripts/pg.sh and a SQLite file), a few grants each: every row of every
/// point is printed with the keys docs/benchmarks.md describes.
#[test]
fn manager_rows_on_both_databases() {
    let manager = rfaas_testkit::manager::manager_binary();
    assert!(
        manager.exists(),
        "{} is not built; run `cargo build -p rfaas-manager` first",
        manager.display()
    );
    let rows = json_rows(
        env!("CARGO_BIN_EXE_rfaas-bench"),
        &[
            "--manager",
            "--grants",
            "20",
            "--visible-iters",
            "2",
            "--concurrency",
            "1,2",
            "--replicas",
            "1,2",
            "--refresh-ms",
            "100",
            "--manager-bin",
            manager.to_str().expect("a UTF-8 path"),
        ],
    );
    let find = |name: &str, backend: &str, replicas: u64, concurrency: u64| -> &Value {
        rows.iter()
            .find(|r| {
                r["name"] == name
                    && r["backend"] == backend
                    && r["replicas"] == replicas
                    && r["concurrency"] == concurrency
            })
            .unwrap_or_else(|| panic!("no {name}/{backend}/{replicas}/{concurrency} in {rows:#?}"))
    };
    let timed = |row: &Value, ops: u64| {
        let median = row["median_ns"].as_u64().unwrap();
        assert!(median > 0, "{row}");
        assert!(row["p99_ns"].as_u64().unwrap() >= median, "{row}");
        assert_eq!(row["ops"], ops, "{row}");
    };
    for backend in ["postgres", "sqlite"] {
        for concurrency in [1, 2] {
            let raw = find("raw_db_grant", backend, 0, concurrency);
            timed(raw, 20);
            assert!(raw["ops_per_s"].as_u64().unwrap() > 0, "{raw}");
            for replicas in [1, 2] {
                let grant = find("lease_grant", backend, replicas, concurrency);
                timed(grant, 20);
                assert!(grant["ops_per_s"].as_u64().unwrap() > 0, "{grant}");
                let ratio = find(
                    "lease_grant_vs_raw_db_grant",
                    backend,
                    replicas,
                    concurrency,
                );
                assert!(ratio["ratio"].as_f64().unwrap() > 0.0, "{ratio}");
                assert_eq!(ratio["target_min"], 0.5);
                assert!(ratio["meets_target"].is_boolean());
            }
        }
        for replicas in [1, 2] {
            let paced = find("lease_grant_paced", backend, replicas, 2);
            timed(paced, 20);
            assert!(paced["offered_per_s"].as_u64().unwrap() > 0, "{paced}");
            assert_eq!(paced["target_p99_max_ns"], 5_000_000);
            assert!(paced["meets_target"].is_boolean());
        }
        let visible = find("node_visible", backend, 2, 1);
        timed(visible, 2);
        assert_eq!(visible["refresh_ms"], 100);
        assert_eq!(visible["target_p99_max_ns"], 100_000_000);
        assert!(visible.get("ops_per_s").is_none(), "{visible}");
    }
    assert_eq!(rows.len(), 2 * (2 * 2 + 2 + 1 + 2 + 2 * 2), "{rows:#?}");
}

/// `hot_noop_billed` next to `hot_noop` on both providers, with a real
/// manager and accounting service (their debug builds, next to the
/// bench's), and the derived ratio checked round by round.
#[test]
fn billed_rows_next_to_unbilled_ones() {
    let daemon = rfaas_testkit::executord::daemon_binary();
    let rows = json_rows(
        env!("CARGO_BIN_EXE_rfaas-bench"),
        &[
            "--provider",
            "tcp,shm",
            "--rows",
            "hot_noop,hot_noop_billed",
            "--sizes",
            "64",
            "--iters",
            "200",
            "--rounds",
            "2",
            "--executord",
            daemon.to_str().expect("a UTF-8 path"),
        ],
    );
    for provider in ["tcp", "shm"] {
        for name in ["hot_noop", "hot_noop_billed"] {
            let row = find(&rows, name, provider, 64);
            assert!(row["median_ns"].as_u64().unwrap() > 0, "{row}");
            assert_eq!(row["rounds"], 2, "{row}");
        }
        let ratio = find(&rows, "hot_noop_billed_over_hot_noop", provider, 64);
        assert_eq!(
            ratio["of"],
            "hot_noop_billed / hot_noop, interquartile means"
        );
        assert_eq!(ratio["target_max"], 1.02);
        assert!(ratio["ratio"].as_f64().unwrap() > 0.0, "{ratio}");
        assert!(ratio["meets_target"].is_boolean(), "{ratio}");
        assert_eq!(ratio["rounds"], 2, "{ratio}");
        assert!(ratio["rounds_met"].as_u64().unwrap() <= 2, "{ratio}");
    }
}

/// `billing_adds` next to `raw_fetch_add` on both providers (a real
/// manager and accounting service, their debug builds next to the
/// bench's) and `billing_flush` next to `raw_db_upsert` (PostgreSQL
/// through scripts/pg.sh): every point with its initiators or slots, and
/// the ratios with their targets. Each row checks its own adds and rows.
#[test]
fn billing_rows_next_to_their_baselines() {
    let rows = json_rows(
        env!("CARGO_BIN_EXE_rfaas-bench"),
        &[
            "--provider",
            "tcp,shm",
            "--rows",
            "billing_adds,raw_fetch_add,billing_flush,raw_db_upsert",
            "--iters",
            "50",
        ],
    );
    let find = |name: &str, provider: &str, key: &str, value: u64| -> &Value {
        rows.iter()
            .find(|r| r["name"] == name && r["provider"] == provider && r[key] == value)
            .unwrap_or_else(|| panic!("no {name}/{provider}/{key} {value} in {rows:#?}"))
    };
    for provider in ["tcp", "shm"] {
        for initiators in [1, 4] {
            for name in ["billing_adds", "raw_fetch_add"] {
                let row = find(name, provider, "initiators", initiators);
                assert_eq!((&row["size"], &row["in_flight"]), (&8.into(), &16.into()));
                assert!(row["per_s"].as_u64().unwrap() > 0, "{row}");
                assert!(row["calls"].as_u64().unwrap() > 0, "{row}");
            }
            let ratio = find(
                "billing_adds_vs_raw_fetch_add",
                provider,
                "initiators",
                initiators,
            );
            assert_eq!(ratio["of"], "billing_adds / raw_fetch_add");
            assert_eq!(ratio["target_min"], 0.8);
            assert!(ratio["ratio"].as_f64().unwrap() > 0.0, "{ratio}");
            assert!(ratio["meets_target"].is_boolean(), "{ratio}");
        }
    }
    for name in ["billing_flush", "raw_db_upsert"] {
        let row = find(name, "postgres", "slots", 4096);
        assert_eq!(row["calls"], 8 * 4096, "{row}");
        assert!(row["per_s"].as_u64().unwrap() > 0, "{row}");
    }
    let ratio = find("billing_flush_vs_raw_db_upsert", "postgres", "slots", 4096);
    assert_eq!(ratio["target_min"], 0.5);
    assert!(ratio["meets_target"].is_boolean(), "{ratio}");
    assert_eq!(rows.len(), 2 * 2 * 2 + 2 * 2 + 2 + 1, "{rows:#?}");
}

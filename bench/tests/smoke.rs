//! Both binaries run a few rows end to end and print the JSON lines the
//! docs and scripts rely on. Few iterations: these check that every path
//! works (peers, the executor daemon, derived rows), not how fast it is.

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
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{bin} {args:?} failed ({}):\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l:?} is not JSON: {e}")))
        .collect()
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

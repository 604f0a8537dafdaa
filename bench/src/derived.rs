//! Rows computed from the best round of measured rows, each against the
//! target DESIGN.md sets ("Performance targets"):
//!
//! | row | what | target |
//! |---|---|---|
//! | `hot_overhead` | median `hot_noop` − median `pingpong`, same provider and size | ≤ 300 ns on shm, ≤ 1 µs on tcp |
//! | `warm_overhead` | median `warm_noop` − median `raw_<tcp\|shm>_pingpong_blocking` | ≤ 5 µs |
//! | `echo_vs_bandwidth` | `echo` bytes/s over `bandwidth` bytes/s (both count bytes crossing the fabric) | ≥ 0.9 from 1 MB |
//! | `grpc_echo_over_hot_noop` | median `grpc_echo` over median `hot_noop` on tcp | ≥ 5 at 64 B |
//!
//! A derived row appears only when both of its rows were measured.

use crate::report::{Measure, Row};

const HOT_SHM_MAX_NS: u64 = 300;
const HOT_TCP_MAX_NS: u64 = 1_000;
const WARM_MAX_NS: u64 = 5_000;
const ECHO_MIN_RATIO: f64 = 0.9;
const ECHO_TARGET_FROM: u64 = 1_000_000;
const GRPC_MIN_RATIO: f64 = 5.0;
const GRPC_TARGET_SIZE: u64 = 64;

/// Every derived row `rows` allow, in a fixed order.
pub fn derive(rows: &[Row]) -> Vec<Row> {
    let mut out = Vec::new();
    for hot in rows.iter().filter(|r| r.name == "hot_noop") {
        if let (Some(a), Some(b)) = (median(hot), find_median(rows, "pingpong", hot)) {
            let target = match hot.provider.as_str() {
                "shm" => Some(HOT_SHM_MAX_NS),
                "tcp" => Some(HOT_TCP_MAX_NS),
                _ => None,
            };
            out.push(Row::difference(
                "hot_overhead",
                &hot.provider,
                hot.size,
                a as i64 - b as i64,
                "hot_noop - pingpong".into(),
                target,
            ));
        }
    }
    for warm in rows.iter().filter(|r| r.name == "warm_noop") {
        let baseline = match warm.provider.as_str() {
            "tcp" => "raw_tcp_pingpong_blocking",
            "shm" => "raw_shm_pingpong_blocking",
            _ => continue,
        };
        if let (Some(a), Some(b)) = (median(warm), find_median(rows, baseline, warm)) {
            out.push(Row::difference(
                "warm_overhead",
                &warm.provider,
                warm.size,
                a as i64 - b as i64,
                format!("warm_noop - {baseline}"),
                Some(WARM_MAX_NS),
            ));
        }
    }
    for echo in rows
        .iter()
        .filter(|r| r.name == "echo" || r.name == "echo_read_only")
    {
        let bandwidth = rows
            .iter()
            .find(|r| r.name == "bandwidth" && same_point(r, echo))
            .and_then(bytes_per_s);
        if let (Some(a), Some(b)) = (bytes_per_s(echo), bandwidth) {
            if b > 0 {
                out.push(Row::ratio(
                    &format!("{}_vs_bandwidth", echo.name),
                    &echo.provider,
                    echo.size,
                    a as f64 / b as f64,
                    format!("{} / bandwidth", echo.name),
                    (echo.size >= ECHO_TARGET_FROM).then_some(ECHO_MIN_RATIO),
                ));
            }
        }
    }
    for grpc in rows.iter().filter(|r| r.name == "grpc_echo") {
        let hot = rows
            .iter()
            .find(|r| r.name == "hot_noop" && r.provider == "tcp" && r.size == grpc.size)
            .and_then(median);
        if let (Some(a), Some(b)) = (median(grpc), hot) {
            if b > 0 {
                out.push(Row::ratio(
                    "grpc_echo_over_hot_noop",
                    "tcp",
                    grpc.size,
                    a as f64 / b as f64,
                    "grpc_echo / hot_noop".into(),
                    (grpc.size == GRPC_TARGET_SIZE).then_some(GRPC_MIN_RATIO),
                ));
            }
        }
    }
    out
}

fn same_point(a: &Row, b: &Row) -> bool {
    a.provider == b.provider && a.size == b.size
}

fn median(row: &Row) -> Option<u64> {
    match &row.measure {
        Measure::Latency(s) => Some(s.median_ns),
        _ => None,
    }
}

fn bytes_per_s(row: &Row) -> Option<u64> {
    match &row.measure {
        Measure::Bandwidth { bytes_per_s, .. } => Some(*bytes_per_s),
        _ => None,
    }
}

/// The median of row `name` at `like`'s provider and size.
fn find_median(rows: &[Row], name: &str, like: &Row) -> Option<u64> {
    rows.iter()
        .find(|r| r.name == name && same_point(r, like))
        .and_then(median)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stats::Summary;
    use std::time::Duration;

    fn lat(name: &str, provider: &str, size: usize, median: u64) -> Row {
        Row::latency(
            name,
            provider,
            size,
            Summary::of(&mut [median, median, median]).unwrap(),
        )
    }

    fn bw(name: &str, provider: &str, size: usize, bytes_per_s: u64) -> Row {
        Row::bandwidth(name, provider, size, bytes_per_s, Duration::from_secs(1))
    }

    #[test]
    fn overheads_and_ratios() {
        let rows = [
            lat("pingpong", "shm", 64, 250),
            lat("hot_noop", "shm", 64, 500),
            lat("pingpong", "tcp", 64, 10_000),
            lat("hot_noop", "tcp", 64, 10_800),
            lat("raw_shm_pingpong_blocking", "shm", 64, 9_000),
            lat("warm_noop", "shm", 64, 8_000),
            bw("bandwidth", "tcp", 1 << 20, 1000),
            bw("echo", "tcp", 1 << 20, 950),
            bw("bandwidth", "tcp", 1024, 1000),
            bw("echo", "tcp", 1024, 100),
            lat("grpc_echo", "tcp", 64, 54_000),
        ];
        let d = derive(&rows);
        let names: Vec<(&str, &str, u64)> = d
            .iter()
            .map(|r| (r.name.as_str(), r.provider.as_str(), r.size))
            .collect();
        assert_eq!(
            names,
            [
                ("hot_overhead", "shm", 64),
                ("hot_overhead", "tcp", 64),
                ("warm_overhead", "shm", 64),
                ("echo_vs_bandwidth", "tcp", 1 << 20),
                ("echo_vs_bandwidth", "tcp", 1024),
                ("grpc_echo_over_hot_noop", "tcp", 64),
            ]
        );
        let met: Vec<Option<bool>> = d.iter().map(Row::meets_target).collect();
        // shm 250 ns over its 300 ns budget is met, tcp 800 ns too; warm is
        // faster than its baseline (negative overhead); 1 KiB echo has no
        // target; 54/10.8 = 5.0 meets ">= 5".
        assert_eq!(
            met,
            [
                Some(true),
                Some(true),
                Some(true),
                Some(true),
                None,
                Some(true)
            ]
        );
        assert!(matches!(
            d[2].measure,
            Measure::Difference {
                median_ns: -1000,
                ..
            }
        ));
        let json: serde_json::Value = serde_json::from_str(&d[0].to_json()).unwrap();
        assert_eq!(json["median_ns"], 250);
        assert_eq!(json["meets_target"], true);
        let json: serde_json::Value = serde_json::from_str(&d[5].to_json()).unwrap();
        assert_eq!(json["ratio"], 5.0);
    }

    #[test]
    fn missing_partners_derive_nothing() {
        let rows = [
            lat("hot_noop", "shm", 64, 500),
            lat("pingpong", "shm", 1, 250),
            lat("warm_noop", "verbs:rxe0", 64, 500),
        ];
        assert!(derive(&rows).is_empty());
    }
}

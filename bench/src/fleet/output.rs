//! A fleet point's figures as one `fleet` row: a JSON line (with
//! `--json`, on stdout, the table then going to stderr, as the other
//! benches do) and a line of the table, with the targets each row is
//! judged against.

use std::io::{self, Write};

use serde_json::{json, Value};

use crate::error::{Context, Result};

/// Liveness statements per node per minute, at most, from
/// [`TARGET_AT_NODES`] nodes: a replica's own rounds cost the same at any
/// size, so a small fleet pays more per node.
pub const TARGET_DB_PER_NODE_MIN: f64 = 1.0;
/// Grant p99 over its value at the smallest fleet of the same replicas,
/// at most, from [`TARGET_AT_NODES`] nodes.
pub const TARGET_GRANT_P99_GROWTH: f64 = 2.0;
/// The fleet size the two targets above are set for.
pub const TARGET_AT_NODES: usize = 10_000;

/// One (nodes, replicas) point.
#[derive(Debug, Clone, PartialEq)]
pub struct FleetRow {
    pub nodes: usize,
    pub replicas: u32,
    pub window_s: f64,
    /// What the replicas handed the nodes.
    pub heartbeat_interval_ms: u64,
    pub lost_after_ms: u64,
    pub grants: u64,
    pub grant_failures: u64,
    pub grant_p50_ns: u64,
    pub grant_p99_ns: u64,
    /// This p99 over the p99 of the smallest fleet measured at the same
    /// replicas (1 for that one).
    pub grant_p99_growth: f64,
    pub heartbeats_per_s: f64,
    pub agent_failures: u64,
    pub db_statements_per_node_min: f64,
    pub db_other_statements_per_node_min: f64,
    pub replica_cpu_ms_per_node_min: f64,
    pub probes: u64,
    pub node_visible_p99_ns: u64,
    pub silent_nodes: u64,
    pub lost_detect_ns: u64,
    pub lost_in_restart: u64,
}

impl FleetRow {
    /// `lost_after_ms` + one interval.
    pub fn lost_detect_target_ns(&self) -> u64 {
        (self.lost_after_ms + self.heartbeat_interval_ms) * 1_000_000
    }

    /// The targets this row misses, by name.
    pub fn missed(&self) -> Vec<&'static str> {
        let mut missed = Vec::new();
        let large = self.nodes >= TARGET_AT_NODES;
        if large && self.db_statements_per_node_min > TARGET_DB_PER_NODE_MIN {
            missed.push("db_statements_per_node_min");
        }
        if large && self.grant_p99_growth > TARGET_GRANT_P99_GROWTH {
            missed.push("grant_p99");
        }
        if self.lost_detect_ns > self.lost_detect_target_ns() {
            missed.push("lost_detect");
        }
        if self.lost_in_restart > 0 {
            missed.push("lost_in_restart");
        }
        missed
    }

    pub fn to_json(&self) -> Value {
        let missed = self.missed();
        json!({
            "name": "fleet",
            "nodes": self.nodes,
            "replicas": self.replicas,
            "window_s": self.window_s,
            "heartbeat_interval_ms": self.heartbeat_interval_ms,
            "lost_after_ms": self.lost_after_ms,
            "grants": self.grants,
            "grant_failures": self.grant_failures,
            "grant_p50_ns": self.grant_p50_ns,
            "grant_p99_ns": self.grant_p99_ns,
            "grant_p99_growth": round3(self.grant_p99_growth),
            "heartbeats_per_s": round3(self.heartbeats_per_s),
            "agent_failures": self.agent_failures,
            "db_statements_per_node_min": round3(self.db_statements_per_node_min),
            "db_other_statements_per_node_min": round3(self.db_other_statements_per_node_min),
            "replica_cpu_ms_per_node_min": round3(self.replica_cpu_ms_per_node_min),
            "probes": self.probes,
            "node_visible_p99_ns": self.node_visible_p99_ns,
            "silent_nodes": self.silent_nodes,
            "lost_detect_ns": self.lost_detect_ns,
            "lost_detect_target_ns": self.lost_detect_target_ns(),
            "lost_in_restart": self.lost_in_restart,
            "meets_target": missed.is_empty(),
            "missed": missed,
        })
    }
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

/// The table's header.
pub const HEADER: &str = "nodes   replicas  hb/s      liveness/node/min  other/node/min  cpu ms/node/min  grant p99 ms (x smallest)  visible p99 ms  silent lost ms (target)  lost in restart  targets";

/// The row as a line of the table.
pub fn table_line(r: &FleetRow) -> String {
    let missed = r.missed();
    format!(
        "{:<7} {:<9} {:<9.1} {:<18.3} {:<15.3} {:<16.3} {:<26} {:<15.3} {:<24} {:<16} {}",
        r.nodes,
        r.replicas,
        r.heartbeats_per_s,
        r.db_statements_per_node_min,
        r.db_other_statements_per_node_min,
        r.replica_cpu_ms_per_node_min,
        format!(
            "{:.3} ({:.2})",
            r.grant_p99_ns as f64 / 1e6,
            r.grant_p99_growth
        ),
        r.node_visible_p99_ns as f64 / 1e6,
        format!(
            "{} ({})",
            r.lost_detect_ns / 1_000_000,
            r.lost_detect_target_ns() / 1_000_000
        ),
        r.lost_in_restart,
        if missed.is_empty() {
            "met".to_owned()
        } else {
            format!("MISSED {}", missed.join(", "))
        }
    )
}

/// Prints rows as they come: JSON lines on stdout with `json` (the table
/// on stderr), else the table on stdout.
#[derive(Debug)]
pub struct Output {
    json: bool,
    header: bool,
}

impl Output {
    pub fn new(json: bool) -> Output {
        Output {
            json,
            header: false,
        }
    }

    pub fn push(&mut self, row: &FleetRow) -> Result<()> {
        let mut table: Box<dyn Write> = if self.json {
            let mut out = io::stdout().lock();
            writeln!(out, "{}", row.to_json())
                .and_then(|()| out.flush())
                .context(|| "could not print a row".to_owned())?;
            Box::new(io::stderr())
        } else {
            Box::new(io::stdout())
        };
        if !self.header {
            writeln!(table, "{HEADER}").context(|| "could not print the table".to_owned())?;
            self.header = true;
        }
        writeln!(table, "{}", table_line(row)).context(|| "could not print the table".to_owned())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row() -> FleetRow {
        FleetRow {
            nodes: 100,
            replicas: 3,
            window_s: 60.0,
            heartbeat_interval_ms: 1000,
            lost_after_ms: 10_000,
            grants: 600,
            grant_failures: 0,
            grant_p50_ns: 2_000_000,
            grant_p99_ns: 4_000_000,
            grant_p99_growth: 1.0,
            heartbeats_per_s: 100.0,
            agent_failures: 0,
            db_statements_per_node_min: 0.5,
            db_other_statements_per_node_min: 12.0,
            replica_cpu_ms_per_node_min: 3.0,
            probes: 20,
            node_visible_p99_ns: 5_000_000,
            silent_nodes: 3,
            lost_detect_ns: 10_500_000_000,
            lost_in_restart: 0,
        }
    }

    #[test]
    fn each_target_is_judged() {
        let good = row();
        assert!(good.missed().is_empty());
        assert_eq!(good.to_json()["meets_target"], true);
        let mut small = row();
        small.db_statements_per_node_min = 3.0;
        small.grant_p99_growth = 1.0;
        assert!(
            small.missed().is_empty(),
            "the first two are set for 10,000 nodes"
        );
        let mut bad = row();
        bad.nodes = 10_000;
        bad.db_statements_per_node_min = 60.0;
        bad.grant_p99_growth = 2.5;
        bad.lost_detect_ns = 11_000_000_001;
        bad.lost_in_restart = 2;
        assert_eq!(
            bad.missed(),
            [
                "db_statements_per_node_min",
                "grant_p99",
                "lost_detect",
                "lost_in_restart"
            ]
        );
        let j = bad.to_json();
        assert_eq!(j["meets_target"], false);
        assert_eq!(j["lost_detect_target_ns"], 11_000_000_000u64);
        assert!(table_line(&bad).contains("MISSED"));
    }
}

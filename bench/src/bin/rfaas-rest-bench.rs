//! `rfaas-rest-bench`: a good client's lease grants on a real
//! `rfaas-manager`, quiet (`rest_quiet`) and then while strangers lean on
//! its REST port (`rest_abuse`): thousands of idle connections, a
//! slowloris sending headers a byte a second, and a flood of requests with
//! made-up credentials at a fixed rate (see `rfaas_testkit::strangers`).
//!
//! One sample is one `POST /v1/leases` of one core from 127.0.0.1 on a
//! keep-alive connection (its release, untimed, follows). The strangers
//! come from 127.1.0.1 and up (idle), 127.2.0.1 and up (slowloris) and
//! 127.3.0.1 and up (flood), so the replica's per-address limits tell
//! them apart from the good client. The replica (release build, next to
//! this binary or `--manager`) runs on a SQLite file of its own, with one
//! node of many cores that is never lost. `rss` is the replica's resident
//! memory, read after each phase; `rss_growth` is the abuse phase's over
//! the quiet one's.
//!
//! The bar: `rest_abuse`'s p99 at most 2 x `rest_quiet`'s p99 + 5 ms, and
//! the replica's RSS grown by less than 256 MiB. Each line of `--json` is
//! one row of one round.

use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::Ordering;
use std::time::Instant;

use clap::Parser;
use rfaas_bench::cleanup;
use rfaas_bench::stats::Summary;
use rfaas_testkit::abuse::{self, Usage};
use rfaas_testkit::manager::{Api, Manager, ManagerOptions};
use rfaas_testkit::strangers::{idle_connections, Flood, FloodPlan, Slowloris};
use serde_json::json;

/// A good client's grants, quiet and while strangers lean on the port.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// Rounds (a fresh replica each).
    #[arg(long, default_value_t = 3)]
    rounds: usize,

    /// Grants measured in each phase, after 20 untimed.
    #[arg(long, default_value_t = 500)]
    iters: usize,

    /// Idle connections, spread over 100 source addresses.
    #[arg(long, default_value_t = 20_000)]
    idle: usize,

    /// Slowloris connections, spread over 10 source addresses.
    #[arg(long, default_value_t = 200)]
    slow: usize,

    /// Requests with made-up credentials a second, each with a new one.
    #[arg(long, default_value_t = 5_000)]
    made_up_per_s: u64,

    /// Connections the flood keeps a request in flight on.
    #[arg(long, default_value_t = 256)]
    flood_connections: usize,

    /// More lines for the replica's configuration file (e.g. its caps).
    #[arg(long, default_value = "")]
    extra_config: String,

    /// The rfaas-manager binary (default: next to this one).
    #[arg(long)]
    manager: Option<PathBuf>,

    /// JSON lines instead of the table.
    #[arg(long)]
    json: bool,
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(2),
        Err(e) => {
            eprintln!("rfaas-rest-bench: {e}");
            ExitCode::FAILURE
        }
    }
}

/// One round's figures.
struct Round {
    quiet: Summary,
    abuse: Summary,
    quiet_rss_kib: u64,
    abuse_rss_kib: u64,
    fds: usize,
    idle_open: usize,
    idle_failed: usize,
    slow_open: usize,
    made_up_per_s: f64,
    made_up_failed: u64,
}

impl Round {
    fn bar_ns(&self) -> u64 {
        2 * self.quiet.p99_ns + 5_000_000
    }

    fn rss_growth_kib(&self) -> u64 {
        self.abuse_rss_kib.saturating_sub(self.quiet_rss_kib)
    }

    fn passes(&self) -> bool {
        self.abuse.p99_ns <= self.bar_ns() && self.rss_growth_kib() < 256 * 1024
    }
}

fn run(args: &Args) -> Result<bool, String> {
    cleanup::install().map_err(|e| format!("could not install the signal handlers: {e}"))?;
    let wanted = (args.idle + args.slow + args.flood_connections + 1024) as u64;
    // The replica inherits the hard limit and raises its soft one to it.
    let limit = abuse::raise_descriptor_limit(wanted);
    if limit < wanted {
        return Err(format!(
            "the descriptor limit is {limit}, too low for {wanted} connections; raise ulimit -Hn \
             or lower --idle"
        ));
    }
    let bin = rfaas_bench::cli::service_binary(
        args.manager.as_deref(),
        "rfaas-manager",
        "rfaas-manager",
        "--manager",
    )?;
    let mut rounds = Vec::new();
    for round in 0..args.rounds {
        let r = one_round(args, &bin)?;
        print_round(args, round, &r);
        rounds.push(r);
    }
    if !args.json {
        print_table(args, &rounds);
    }
    Ok(rounds.iter().all(Round::passes))
}

fn one_round(args: &Args, bin: &std::path::Path) -> Result<Round, String> {
    let m = Manager::try_start(
        bin,
        ManagerOptions {
            extra_config: format!(
                "heartbeat_interval_ms = 1000\nlost_after_ms = 86400000\nrefresh_ms = 1000\n{}\n",
                args.extra_config
            ),
            ..ManagerOptions::default()
        },
    )?;
    let pid = m.pid().ok_or("the replica has no pid")?;
    let _registered = cleanup::register(pid);
    m.register_node("n1", 4096, 1 << 22);
    let good = Api::new(m.url(), &m.credential("user", "alice", Some("physics")));
    let to = m
        .url()
        .trim_start_matches("http://")
        .parse()
        .map_err(|e| format!("the replica's address {}: {e}", m.url()))?;

    let quiet = measure(&good, args.iters)?;
    let quiet_rss_kib = Usage::of(pid).rss_kib;

    let (idle, idle_failed) = idle_connections(&addresses(1, 100), args.idle.div_ceil(100), to);
    let slow = Slowloris::start(&addresses(2, 10), args.slow.div_ceil(10), to);
    let flood = Flood::start(
        to,
        &FloodPlan {
            from: addresses(3, 50),
            threads: 4,
            connections: args.flood_connections.div_ceil(4),
            per_s: Some(args.made_up_per_s),
            method: "POST",
            path: "/v1/leases".into(),
            body: br#"{"cores": 1, "memory_mib": 64, "duration_s": 60}"#.to_vec(),
        },
    );
    let flood_start = Instant::now();
    let abuse = measure(&good, args.iters)?;
    let usage = Usage::of(pid);
    let answered = flood.counts.answered.load(Ordering::Relaxed);
    let made_up_failed = flood.counts.failed.load(Ordering::Relaxed);
    let made_up_per_s = answered as f64 / flood_start.elapsed().as_secs_f64();
    let slow_open = slow.open;
    drop(flood);
    drop(slow);
    let idle_open = idle.len();
    drop(idle);
    Ok(Round {
        quiet,
        abuse,
        quiet_rss_kib,
        abuse_rss_kib: usage.rss_kib,
        fds: usage.fds,
        idle_open,
        idle_failed,
        slow_open,
        made_up_per_s,
        made_up_failed,
    })
}

/// `n` loopback addresses 127.`block`.0.1 and up.
fn addresses(block: u8, n: u16) -> Vec<Ipv4Addr> {
    (0..n)
        .map(|i| Ipv4Addr::new(127, block, (i / 250) as u8, (i % 250) as u8 + 1))
        .collect()
}

/// `iters` timed grants (each released, untimed) after 20 untimed.
fn measure(good: &Api, iters: usize) -> Result<Summary, String> {
    let grant = || -> Result<u64, String> {
        let (s, g) = good.call(
            "POST",
            "/v1/leases",
            Some(&json!({"cores": 1, "memory_mib": 64, "duration_s": 60})),
        );
        if s != 201 {
            return Err(format!("a good client's grant was refused: {s} {g}"));
        }
        g["id"]
            .as_u64()
            .ok_or_else(|| format!("a grant without an id: {g}"))
    };
    let release = |id: u64| -> Result<(), String> {
        match good.call("DELETE", &format!("/v1/leases/{id}"), None) {
            (204, _) => Ok(()),
            (s, e) => Err(format!("a good client's release was refused: {s} {e}")),
        }
    };
    for _ in 0..20 {
        release(grant()?)?;
    }
    let mut samples = Vec::with_capacity(iters);
    for _ in 0..iters {
        let t = Instant::now();
        let id = grant()?;
        samples.push(t.elapsed().as_nanos() as u64);
        release(id)?;
    }
    Summary::of(&mut samples).ok_or_else(|| "no samples".into())
}

fn us(ns: u64) -> f64 {
    ns as f64 / 1e3
}

fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

fn print_round(args: &Args, round: usize, r: &Round) {
    if !args.json {
        return;
    }
    let quiet = json!({
        "row": "rest_quiet", "round": round, "iters": r.quiet.iters,
        "median_us": us(r.quiet.median_ns), "p99_us": us(r.quiet.p99_ns),
        "rss_mib": mib(r.quiet_rss_kib),
    });
    let abuse = json!({
        "row": "rest_abuse", "round": round, "iters": r.abuse.iters,
        "median_us": us(r.abuse.median_ns), "p99_us": us(r.abuse.p99_ns),
        "bar_p99_us": us(r.bar_ns()),
        "rss_mib": mib(r.abuse_rss_kib), "rss_growth_mib": mib(r.rss_growth_kib()),
        "fds": r.fds,
        "idle": r.idle_open, "idle_failed": r.idle_failed, "slow": r.slow_open,
        "made_up_per_s": r.made_up_per_s.round(), "made_up_failed": r.made_up_failed,
        "pass": r.passes(),
    });
    println!("{quiet}");
    println!("{abuse}");
}

fn print_table(args: &Args, rounds: &[Round]) {
    println!(
        "rfaas-rest-bench: {} idle connections, {} slowloris, {} made-up credentials/s on {} \
         connections; {} grants per phase",
        args.idle, args.slow, args.made_up_per_s, args.flood_connections, args.iters
    );
    println!(
        "{:<6} {:<11} {:>10} {:>10} {:>11} {:>9} {:>10} {:>6} {:>7} {:>11} {:>5}",
        "round",
        "row",
        "median_us",
        "p99_us",
        "bar_p99_us",
        "rss_mib",
        "growth_mib",
        "fds",
        "idle",
        "made_up/s",
        "pass"
    );
    for (k, r) in rounds.iter().enumerate() {
        println!(
            "{:<6} {:<11} {:>10.1} {:>10.1} {:>11} {:>9.1} {:>10} {:>6} {:>7} {:>11} {:>5}",
            k,
            "rest_quiet",
            us(r.quiet.median_ns),
            us(r.quiet.p99_ns),
            "-",
            mib(r.quiet_rss_kib),
            "-",
            "-",
            "-",
            "-",
            "-"
        );
        println!(
            "{:<6} {:<11} {:>10.1} {:>10.1} {:>11.1} {:>9.1} {:>10.1} {:>6} {:>7} {:>11.0} {:>5}",
            k,
            "rest_abuse",
            us(r.abuse.median_ns),
            us(r.abuse.p99_ns),
            us(r.bar_ns()),
            mib(r.abuse_rss_kib),
            mib(r.rss_growth_kib()),
            r.fds,
            r.idle_open,
            r.made_up_per_s,
            if r.passes() { "yes" } else { "no" }
        );
    }
}

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
//! this binary or `--manager`) serves HTTPS, as by default, on a SQLite
//! file of its own, with one node of many cores that is never lost; the
//! strangers speak TLS to it: half the idle connections never start the
//! handshake, the other half finish it and then send nothing, the
//! slowloris and the flood send their bytes over TLS. The flood's requests
//! carry no body, so each connection stays open for the next made-up
//! credential (an answer given before a body is read closes its
//! connection, which would make the flood a handshake flood). `rss` is the
//! replica's resident memory, read after each phase; `rss_growth` is the
//! abuse phase's over the quiet one's, and `rss_peak_growth` the peak's
//! (`VmHWM`) over the quiet phase's. The idle connections are held by
//! child processes of this binary (`--hold-idle`): the descriptor limit
//! counts per process, and its hard limit may not be raisable here.
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
use rfaas_testkit::strangers::{
    idle_after_handshake, idle_connections, Flood, FloodPlan, Slowloris, Wire,
};
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

    /// Internal: hold idle connections for the bench that started this
    /// process (`ADDRESS,FIRST,SOURCES,PER_SOURCE,HANDSHAKEN`).
    #[arg(long, hide = true)]
    hold_idle: Option<String>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let result = match &args.hold_idle {
        Some(what) => hold_idle(what).map(|()| true),
        None => run(&args),
    };
    match result {
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
    /// The replica's peak resident memory (`VmHWM`) after the abuse phase.
    peak_rss_kib: u64,
    fds: usize,
    idle_open: usize,
    idle_handshaken: usize,
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
    // The idle connections are held by processes of their own (the limit
    // counts per process); this one holds the slowloris and the flood.
    let wanted = (args.slow + args.flood_connections + 1024) as u64;
    // The replica inherits the hard limit and raises its soft one to it.
    raise_hard_descriptor_limit((args.idle + 1024) as u64);
    let limit = abuse::raise_descriptor_limit(wanted);
    if limit < wanted {
        return Err(format!(
            "the descriptor limit is {limit}, too low for {wanted} connections; raise ulimit -Hn \
             (or run as root, which may raise it up to /proc/sys/fs/nr_open) or lower --slow"
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
    let url = m.url();
    let to = url
        .split_once("://")
        .map_or(url, |(_, rest)| rest)
        .parse()
        .map_err(|e| format!("the replica's address {url}: {e}"))?;
    let wire = Wire::for_url(url)?;

    let quiet = measure(&good, args.iters)?;
    let quiet_rss_kib = Usage::of(pid).rss_kib;

    let idle = Holders::start(args.idle, to, matches!(wire, Wire::Tls(_)))?;
    let slow = Slowloris::start(&addresses(2, 10), args.slow.div_ceil(10), to, &wire);
    let flood = Flood::start_over(
        to,
        &FloodPlan {
            from: addresses(3, 50),
            threads: 4,
            connections: args.flood_connections.div_ceil(4),
            per_s: Some(args.made_up_per_s),
            method: "POST",
            path: "/v1/leases".into(),
            body: Vec::new(),
        },
        &wire,
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
    let (idle_open, idle_handshaken, idle_failed) = (idle.open, idle.handshaken, idle.failed);
    drop(idle);
    Ok(Round {
        quiet,
        abuse,
        quiet_rss_kib,
        abuse_rss_kib: usage.rss_kib,
        peak_rss_kib: peak_rss_kib(pid),
        fds: usage.fds,
        idle_open,
        idle_handshaken,
        idle_failed,
        slow_open,
        made_up_per_s,
        made_up_failed,
    })
}

/// Idle connections from 127.1.0.1 and up (100 addresses), held by child
/// processes of this binary (`--hold-idle`), each under its own
/// descriptor limit; closed when dropped.
struct Holders {
    children: Vec<(std::process::Child, cleanup::Registered)>,
    open: usize,
    handshaken: usize,
    failed: usize,
}

impl Holders {
    /// `idle` connections to `to`; over TLS, half from each address
    /// finish the handshake, the other half (all, on plain HTTP) never
    /// start it.
    fn start(idle: usize, to: std::net::SocketAddr, tls: bool) -> Result<Holders, String> {
        const SOURCES: usize = 100;
        let per_source = idle.div_ceil(SOURCES);
        let handshaken = if tls { per_source / 2 } else { 0 };
        let limit = abuse::raise_descriptor_limit(u64::MAX) as usize;
        let sources_each = (limit.saturating_sub(256) / per_source.max(1)).clamp(1, SOURCES);
        let me = std::env::current_exe().map_err(|e| format!("this binary's path: {e}"))?;
        let mut holders = Holders {
            children: Vec::new(),
            open: 0,
            handshaken: 0,
            failed: 0,
        };
        for first in (0..SOURCES).step_by(sources_each) {
            let n = sources_each.min(SOURCES - first);
            let child = std::process::Command::new(&me)
                .arg("--hold-idle")
                .arg(format!("{to},{first},{n},{per_source},{handshaken}"))
                .stdin(std::process::Stdio::piped())
                .stdout(std::process::Stdio::piped())
                .spawn()
                .map_err(|e| format!("start {}: {e}", me.display()))?;
            let registered = cleanup::register(child.id());
            holders.children.push((child, registered));
        }
        for (child, _) in &mut holders.children {
            let mut line = String::new();
            if let Some(out) = child.stdout.as_mut() {
                std::io::BufRead::read_line(&mut std::io::BufReader::new(out), &mut line)
                    .map_err(|e| format!("read an idle holder's count: {e}"))?;
            }
            let counts: Vec<usize> = line
                .split_whitespace()
                .filter_map(|w| w.parse().ok())
                .collect();
            let [open, handshaken, failed] = counts[..] else {
                return Err(format!(
                    "an idle holder said {line:?}, not its three counts"
                ));
            };
            holders.open += open;
            holders.handshaken += handshaken;
            holders.failed += failed;
        }
        Ok(holders)
    }
}

impl Drop for Holders {
    fn drop(&mut self) {
        for (child, _) in &mut self.children {
            // Closing its stdin tells a holder to close its connections and
            // end.
            drop(child.stdin.take());
            let _ = child.wait();
        }
    }
}

/// `--hold-idle`: opens the connections, prints how many are open, how
/// many of them finished a TLS handshake and how many failed, and holds
/// them until stdin closes.
fn hold_idle(what: &str) -> Result<(), String> {
    let bad = || format!("--hold-idle {what:?} is not ADDRESS,FIRST,SOURCES,PER_SOURCE,HANDSHAKEN");
    let mut parts = what.split(',');
    let to: std::net::SocketAddr = parts.next().and_then(|p| p.parse().ok()).ok_or_else(bad)?;
    let mut num =
        || -> Result<usize, String> { parts.next().and_then(|p| p.parse().ok()).ok_or_else(bad) };
    let (first, n, per_source, handshaken) = (num()?, num()?, num()?, num()?);
    abuse::raise_descriptor_limit(((per_source * n) + 64) as u64);
    let from = &addresses(1, 100)[first..first + n];
    let (bare, bare_failed) = idle_connections(from, per_source - handshaken, to);
    let (tls, tls_failed) = if handshaken > 0 {
        let ca = std::env::var_os(rfaas_tls::CA_FILE_ENV)
            .ok_or("an idle holder needs the CA file in its environment")?;
        let wire = Wire::tls(std::path::Path::new(&ca))?;
        idle_after_handshake(from, handshaken, to, &wire)
    } else {
        (Vec::new(), 0)
    };
    println!(
        "{} {} {}",
        bare.len() + tls.len(),
        tls.len(),
        bare_failed + tls_failed
    );
    let _ = std::io::Read::read_to_end(&mut std::io::stdin(), &mut Vec::new());
    drop((bare, tls));
    Ok(())
}

/// `pid`'s peak resident memory (`VmHWM`), KiB; 0 where it cannot be read.
fn peak_rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .and_then(|v| v.split_whitespace().next()?.parse().ok())
        })
        .unwrap_or(0)
}

/// Raises the hard descriptor limit (which the replica inherits) to
/// `wanted` where it is lower, up to `/proc/sys/fs/nr_open`; only root may,
/// and for anyone else the limit stays as it was.
fn raise_hard_descriptor_limit(wanted: u64) {
    let ceiling = std::fs::read_to_string("/proc/sys/fs/nr_open")
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok())
        .unwrap_or(wanted);
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit and setrlimit read or write only `lim`, ours.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 && lim.rlim_max < wanted {
            lim.rlim_max = wanted.min(ceiling);
            libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        }
    }
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
        "rss_peak_growth_mib": mib(r.peak_rss_kib.saturating_sub(r.quiet_rss_kib)),
        "fds": r.fds,
        "idle": r.idle_open, "idle_handshaken": r.idle_handshaken,
        "idle_failed": r.idle_failed, "slow": r.slow_open,
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

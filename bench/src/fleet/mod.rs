//! `rfaas-fleet`: a simulated fleet of node agents against real
//! `rfaas-manager` replicas on one throwaway PostgreSQL server, while
//! clients grant and release leases at a steady rate. One `fleet` row per
//! (nodes, replicas) point, each on a new server:
//!
//! | figure | how |
//! |---|---|
//! | `db_statements_per_node_min`, `db_other_statements_per_node_min` | `pg_stat_statements` calls during the window (utility statements such as `BEGIN` not counted), those whose text holds `rfaas:liveness` and the others, per node per minute |
//! | `replica_cpu_ms_per_node_min` | the replica processes' user and system time during the window (`/proc/<pid>/stat`), per node per minute |
//! | `grant_p99_ns` | `POST /v1/leases` of 1 core, open loop at `--grant-rate` during the window, each from its scheduled start, rotating over the replicas; each lease released right after (untimed) |
//! | `node_visible_p99_ns` | after the window, with the fleet still heartbeating: a new node's registration on one replica until every replica shows it (`rfaas-bench --manager`'s `node_visible`) |
//! | `lost_detect_ns` | a few agents fall silent; from each one's last answered heartbeat until every replica shows it lost, the slowest; they heartbeat again after. Its target is `lost_after_ms` plus one interval, as the replicas' gauges give them after the window |
//! | `lost_in_restart` | the replicas restarted one after the other (SIGTERM, start on the same port, wait until it serves), then `lost_after_ms` and two intervals more: the nodes the replicas marked lost meanwhile (`rfaas_manager_lost_nodes_total`) |
//!
//! The agents (see [`agents`]) run in `--agent-procs` processes of this
//! binary; every node has its own node credential, minted through the
//! API as an admin does for executord.
//!
//! # Layout
//!
//! - [`agents`]: the simulated nodes, a process of them;
//! - [`measure`]: the database's statement counts, CPU time, the lost
//!   nodes counter;
//! - [`output`]: the row, its targets, the table and the JSON line.

pub mod agents;
pub mod measure;
pub mod output;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crate::child::Peer;
use crate::cleanup;
use crate::error::{Context, Error, Result};
use crate::manager::{agent, call, credential, node_visible, Common, Replicas, Scratch};
use crate::stats::Summary;
use measure::Database;
use output::{FleetRow, Output};

/// What `rfaas-fleet` is told.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Fleet sizes; each is measured at each replica count.
    pub nodes: Vec<usize>,
    pub replicas: Vec<u32>,
    /// The measured window of each point.
    pub window: Duration,
    /// Grants per second during the window.
    pub grant_rate: f64,
    /// Client threads granting.
    pub grant_threads: usize,
    /// `node_visible` registrations per point.
    pub probes: usize,
    /// Agents silenced to time their loss.
    pub silent: usize,
    pub agent_procs: usize,
    /// Worker threads of each agent process.
    pub agent_threads: usize,
    /// Cores each node lends.
    pub node_cores: u32,
    /// The replicas' `heartbeat_interval_ms`, `heartbeats_per_s`,
    /// `lost_after_ms`, `refresh_ms`; `None`: the manager's default.
    pub heartbeat_interval_ms: Option<u64>,
    pub heartbeats_per_s: Option<u64>,
    pub lost_after_ms: Option<u64>,
    pub refresh_ms: Option<u64>,
    /// Skip the rolling restart.
    pub no_restart: bool,
    pub manager_bin: PathBuf,
    pub json: bool,
}

fn check(s: &Settings) -> Result<()> {
    if s.nodes.is_empty() || s.nodes.contains(&0) {
        return Err(Error::new("--nodes must list fleet sizes of at least 1"));
    }
    if s.replicas.is_empty() || s.replicas.iter().any(|&r| r == 0 || r > 4) {
        return Err(Error::new("--replicas must list counts from 1 to 4"));
    }
    if s.window.is_zero()
        || !s.grant_rate.is_finite()
        || s.grant_rate <= 0.0
        || s.grant_threads == 0
    {
        return Err(Error::new(
            "--window-s, --grant-rate and --grant-threads must be above 0",
        ));
    }
    if s.agent_procs == 0 || s.agent_threads == 0 || s.probes == 0 || s.node_cores == 0 {
        return Err(Error::new(
            "--agent-procs, --agent-threads, --probes and --node-cores must be at least 1",
        ));
    }
    if s.silent == 0 || s.nodes.iter().any(|&n| n < s.silent) {
        return Err(Error::new(format!(
            "--silent {} must be at least 1 and at most the smallest fleet",
            s.silent
        )));
    }
    if !s.manager_bin.exists() {
        return Err(Error::new(format!(
            "{} is not built; build it next to the bench (cargo build --release -p rfaas-manager -p rfaas-bench) or pass --manager-bin",
            s.manager_bin.display()
        )));
    }
    Ok(())
}

/// Every point, smallest fleet first at each replica count.
pub fn run(s: &Settings) -> Result<()> {
    check(s)?;
    cleanup::install()
        .map_err(|e| Error::new(format!("could not install the signal handlers: {e}")))?;
    // A few connections per agent thread and replica, and the bench's
    // own: well below the usual 1024, but the limit is raised anyway.
    rfaas_service::limits::raise_descriptor_limit();
    let dir = Scratch::new("fleet")?;
    let common = Common::new(&s.manager_bin, &dir.0, s.refresh_ms.unwrap_or(1000))?;
    let mut sizes = s.nodes.clone();
    sizes.sort_unstable();
    sizes.dedup();
    let mut out = Output::new(s.json);
    for &replicas in &s.replicas {
        let mut smallest = None;
        for &nodes in &sizes {
            eprintln!("fleet: {nodes} nodes, {replicas} replicas");
            let mut row = point(s, &common, &dir.0, nodes, replicas)?;
            let base = *smallest.get_or_insert(row.grant_p99_ns);
            row.grant_p99_growth = row.grant_p99_ns as f64 / base.max(1) as f64;
            out.push(&row)?;
        }
    }
    Ok(())
}

/// The agent processes of a point, and the names of their nodes.
struct Agents {
    procs: Vec<(Peer, Vec<String>)>,
}

/// What the agent processes say of themselves.
#[derive(Debug, Clone, Copy, Default)]
struct AgentStats {
    heartbeats: u64,
    failures: u64,
    /// The interval and loss timeout the replicas handed out last, ms.
    interval_ms: u64,
    lost_after_ms: u64,
}

impl Agents {
    /// Heartbeats and failures summed, the newest interval and loss
    /// timeout (the largest any process holds).
    fn stats(&mut self) -> Result<AgentStats> {
        let mut sum = AgentStats::default();
        for (peer, _) in &mut self.procs {
            let line = peer.request("stats", Duration::from_secs(30))?;
            let [heartbeats, failures, _, interval_ms, lost_after_ms] =
                figures::<5>(&line, "stats")?;
            sum.heartbeats += heartbeats;
            sum.failures += failures;
            sum.interval_ms = sum.interval_ms.max(interval_ms);
            sum.lost_after_ms = sum.lost_after_ms.max(lost_after_ms);
        }
        Ok(sum)
    }
}

/// The `N` numbers of an agents' answer `<word> <n>...`.
fn figures<const N: usize>(line: &str, word: &str) -> Result<[u64; N]> {
    let bad = || {
        Error::new(format!(
            "the agents answered {line:?}, not `{word}` and {N} numbers"
        ))
    };
    let rest = line
        .strip_prefix(word)
        .and_then(|r| r.strip_prefix(' '))
        .ok_or_else(bad)?;
    let numbers: Vec<u64> = rest
        .split(' ')
        .map(|x| x.parse().map_err(|_| bad()))
        .collect::<Result<_>>()?;
    numbers.try_into().map_err(|_| bad())
}

fn point(
    s: &Settings,
    common: &Common,
    dir: &Path,
    nodes: usize,
    replicas: u32,
) -> Result<FleetRow> {
    let db = Database::start()?;
    let mut config = String::new();
    for (key, value) in [
        ("heartbeat_interval_ms", s.heartbeat_interval_ms),
        ("heartbeats_per_s", s.heartbeats_per_s),
        ("lost_after_ms", s.lost_after_ms),
        ("refresh_ms", s.refresh_ms),
    ] {
        if let Some(v) = value {
            config.push_str(&format!("{key} = {v}\n"));
        }
    }
    let mut reps = Replicas::start_with(common, db.pg.url(), replicas, &config)?;
    let admin = &common.admin_token;
    let names: Vec<String> = (0..nodes).map(|k| format!("fleet-n{k:05}")).collect();
    let started = Instant::now();
    let tokens = mint(&reps.urls[0], admin, "node", &names)?;
    let users: Vec<String> = (0..s.grant_threads)
        .map(|k| format!("fleet-u{k}"))
        .collect();
    let user_tokens = mint(&reps.urls[0], admin, "user", &users)?;
    eprintln!(
        "fleet: {nodes} node credentials minted in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    let mut agents = spawn_agents(s, dir, &reps.urls, &names, &tokens)?;
    for (peer, own) in &mut agents.procs {
        let line = peer.request("wait-registered", Duration::from_secs(660))?;
        let f = figures::<3>(&line, "registered")?;
        if f[0] != own.len() as u64 {
            return Err(Error::new(format!(
                "not every node of an agent process registered: it said {line:?} of {} nodes",
                own.len()
            )));
        }
    }
    let AgentStats { interval_ms, .. } = agents.stats()?;
    eprintln!(
        "fleet: {nodes} nodes registered in {:.1} s; interval {interval_ms} ms",
        started.elapsed().as_secs_f64()
    );
    // Every node heartbeats once before the window: the first beats
    // spread over one interval.
    std::thread::sleep(Duration::from_millis(interval_ms));

    let pids = reps.pids();
    db.reset()?;
    let cpu0 = measure::cpu_ms(&pids);
    let stats0 = agents.stats()?;
    let t0 = Instant::now();
    let (grant, grants, grant_failures) = paced_grants(
        &reps.urls,
        &user_tokens,
        s.grant_threads,
        s.grant_rate,
        s.window,
    )?;
    let window = t0.elapsed();
    let statements = db.statements()?;
    for slow in db.slowest(5)? {
        eprintln!(
            "fleet:   slowest statement: max {:.1} ms, mean {:.2} ms, {} calls: {}",
            slow.max_ms, slow.mean_ms, slow.calls, slow.query
        );
    }
    let cpu1 = measure::cpu_ms(&pids);
    let stats1 = agents.stats()?;
    // What the replicas go by for this fleet (their gauges).
    let (interval_ms, lost_after_ms) = measure::intervals(&reps.urls, admin)?;
    let per_node_min = |x: u64| x as f64 / nodes as f64 / (window.as_secs_f64() / 60.0);

    let lost_detect = lost_detect(
        &mut agents,
        &reps.urls,
        admin,
        s.silent,
        lost_after_ms,
        interval_ms,
    )?;
    let lost_in_restart = if s.no_restart {
        0
    } else {
        rolling_restart(&mut reps, admin, &names, lost_after_ms, interval_ms)?
    };
    let visible = node_visible(&reps.urls, admin, s.probes, 0, s.refresh_ms.unwrap_or(1000))?;
    let stats2 = agents.stats()?;
    Ok(FleetRow {
        nodes,
        replicas,
        window_s: window.as_secs_f64(),
        heartbeat_interval_ms: interval_ms,
        lost_after_ms,
        grants,
        grant_failures,
        grant_p50_ns: grant.map_or(0, |g| g.median_ns),
        grant_p99_ns: grant.map_or(0, |g| g.p99_ns),
        grant_p99_growth: 1.0,
        heartbeats_per_s: (stats1.heartbeats - stats0.heartbeats) as f64 / window.as_secs_f64(),
        agent_failures: stats2.failures,
        db_statements_per_node_min: per_node_min(statements.liveness),
        db_other_statements_per_node_min: per_node_min(statements.other),
        replica_cpu_ms_per_node_min: per_node_min(cpu1.saturating_sub(cpu0)),
        probes: visible.iters,
        node_visible_p99_ns: visible.p99_ns,
        silent_nodes: s.silent as u64,
        lost_detect_ns: lost_detect,
        lost_in_restart,
    })
}

/// One credential of `role` per subject, minted through the API from a
/// few threads at once, in the subjects' order.
fn mint(url: &str, admin: &str, role: &str, subjects: &[String]) -> Result<Vec<String>> {
    let next = AtomicUsize::new(0);
    let threads = 8.min(subjects.len()).max(1);
    let mut tokens: Vec<Option<String>> = vec![None; subjects.len()];
    let minted: Vec<Result<Vec<(usize, String)>>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                let next = &next;
                scope.spawn(move || {
                    let a = agent();
                    let mut mine = Vec::new();
                    loop {
                        let k = next.fetch_add(1, Ordering::Relaxed);
                        let Some(subject) = subjects.get(k) else {
                            return Ok(mine);
                        };
                        mine.push((k, credential(&a, url, admin, role, subject)?));
                    }
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(Error::new("a minting thread panicked")))
            })
            .collect()
    });
    for part in minted {
        for (k, token) in part? {
            tokens[k] = Some(token);
        }
    }
    tokens
        .into_iter()
        .map(|t| t.ok_or_else(|| Error::new(format!("a {role} credential was not minted"))))
        .collect()
}

/// The agent processes, the nodes dealt round-robin.
fn spawn_agents(
    s: &Settings,
    dir: &Path,
    urls: &[String],
    names: &[String],
    tokens: &[String],
) -> Result<Agents> {
    let procs = s.agent_procs.min(names.len());
    let mut out = Vec::new();
    for p in 0..procs {
        let file = dir.join(format!("agents-{p}.txt"));
        let mut text = String::new();
        let mut own = Vec::new();
        for k in (p..names.len()).step_by(procs) {
            text.push_str(&format!("{} {}\n", names[k], tokens[k]));
            own.push(names[k].clone());
        }
        {
            use std::os::unix::fs::OpenOptionsExt;
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .open(&file)
                .context(|| format!("could not write {}", file.display()))?;
            f.write_all(text.as_bytes())
                .context(|| format!("could not write {}", file.display()))?;
        }
        let args = [
            file.display().to_string(),
            s.agent_threads.to_string(),
            s.node_cores.to_string(),
            urls.join(","),
        ];
        out.push((Peer::spawn_talking(agents::PEER.name, &args)?, own));
    }
    Ok(Agents { procs: out })
}

/// Grants of 1 core scheduled every `1 / rate` s for `window`, taken in
/// order by `threads` client threads, each with its own user; a sample
/// runs from the grant's scheduled start to its answer. The latencies
/// (`None` if none succeeded), the grants made, and those refused or
/// failed.
fn paced_grants(
    urls: &[String],
    users: &[String],
    threads: usize,
    rate: f64,
    window: Duration,
) -> Result<(Option<Summary>, u64, u64)> {
    let every = Duration::from_secs_f64(1.0 / rate);
    let total = (window.as_secs_f64() * rate).ceil().max(1.0) as usize;
    let next = AtomicUsize::new(0);
    let start = Instant::now() + Duration::from_millis(50);
    let body = crate::manager::GRANT_BODY;
    let results: Vec<(Vec<u64>, u64)> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let next = &next;
                scope.spawn(move || {
                    let a = agent();
                    let token = &users[t % users.len()];
                    let mut samples = Vec::new();
                    let mut failed = 0u64;
                    loop {
                        let k = next.fetch_add(1, Ordering::Relaxed);
                        if k >= total {
                            return (samples, failed);
                        }
                        let due = start + every * k as u32;
                        let now = Instant::now();
                        if due > now {
                            std::thread::sleep(due - now);
                        }
                        let url = &urls[k % urls.len()];
                        match call(&a, "POST", &format!("{url}/v1/leases"), token, Some(body)) {
                            Ok((201, text)) => {
                                samples.push(due.elapsed().as_nanos() as u64);
                                let id = serde_json::from_str::<serde_json::Value>(&text)
                                    .ok()
                                    .and_then(|v| v["id"].as_u64());
                                if let Some(id) = id {
                                    let _ = call(
                                        &a,
                                        "DELETE",
                                        &format!("{url}/v1/leases/{id}"),
                                        token,
                                        None,
                                    );
                                }
                            }
                            _ => failed += 1,
                        }
                    }
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_default())
            .collect()
    });
    let mut all = Vec::new();
    let mut failed = 0;
    for (samples, f) in results {
        all.extend(samples);
        failed += f;
    }
    let made = all.len() as u64;
    Ok((Summary::of(&mut all), made, failed))
}

/// The state of node `name` on the replica at `url`.
fn node_state(a: &ureq::Agent, url: &str, admin: &str, name: &str) -> Result<String> {
    let (status, text) = call(a, "GET", &format!("{url}/v1/nodes/{name}"), admin, None)?;
    if status != 200 {
        return Err(Error::new(format!(
            "GET {url}/v1/nodes/{name} answered {status}: {text}"
        )));
    }
    let v: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| Error::new(format!("a node that is not JSON ({e}): {text}")))?;
    Ok(v["state"].as_str().unwrap_or_default().to_owned())
}

/// Polls every replica until each shows every node of `names` in `state`;
/// for each node, when the last replica did (Unix ms).
fn until_state(
    urls: &[String],
    admin: &str,
    names: &[String],
    state: &str,
    within: Duration,
) -> Result<Vec<u64>> {
    let a = agent();
    let until = Instant::now() + within;
    let mut seen: Vec<Vec<bool>> = vec![vec![false; urls.len()]; names.len()];
    let mut when = vec![0u64; names.len()];
    loop {
        for (n, name) in names.iter().enumerate() {
            for (r, url) in urls.iter().enumerate() {
                if !seen[n][r] && node_state(&a, url, admin, name)? == state {
                    seen[n][r] = true;
                    if seen[n].iter().all(|&x| x) {
                        when[n] = rfaas_service::now_ms();
                    }
                }
            }
        }
        if seen.iter().all(|s| s.iter().all(|&x| x)) {
            return Ok(when);
        }
        if Instant::now() > until {
            return Err(Error::new(format!(
                "not every replica showed the nodes {} {state} within {} s",
                names.join(", "),
                within.as_secs()
            )));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Silences `silent` nodes, spread over the agent processes, and returns
/// the longest time from a node's last answered heartbeat until every
/// replica shows it lost, ns; then they heartbeat again, until every
/// replica shows them up.
fn lost_detect(
    agents: &mut Agents,
    urls: &[String],
    admin: &str,
    silent: usize,
    lost_after_ms: u64,
    interval_ms: u64,
) -> Result<u64> {
    let procs = agents.procs.len();
    let mut names = Vec::new();
    let mut last_ack = Vec::new();
    for p in 0..procs.min(silent) {
        let (peer, own) = &mut agents.procs[p];
        let mine: Vec<&String> = own
            .iter()
            .skip(1)
            .step_by(procs)
            .take(silent.div_ceil(procs))
            .collect();
        let mine: Vec<&String> = mine.into_iter().take(silent - names.len()).collect();
        if mine.is_empty() {
            continue;
        }
        let words: Vec<&str> = mine.iter().map(|n| n.as_str()).collect();
        let line = peer.request(
            &format!("silence {}", words.join(" ")),
            Duration::from_secs(30),
        )?;
        for pair in line
            .strip_prefix("silenced ")
            .unwrap_or_default()
            .split(' ')
        {
            let (name, ms) = pair
                .split_once(':')
                .ok_or_else(|| Error::new(format!("the agents answered {line:?} to silence")))?;
            names.push(name.to_owned());
            last_ack.push(ms.parse::<u64>().unwrap_or(0));
        }
    }
    let within = Duration::from_millis(2 * (lost_after_ms + interval_ms)) + Duration::from_secs(60);
    let lost = until_state(urls, admin, &names, "lost", within)?;
    let slowest = lost
        .iter()
        .zip(&last_ack)
        .map(|(l, a)| l.saturating_sub(*a))
        .max()
        .unwrap_or(0);
    for (peer, _) in &mut agents.procs {
        peer.request("resume", Duration::from_secs(30))?;
    }
    until_state(urls, admin, &names, "up", within)?;
    Ok(slowest * 1_000_000)
}

/// Restarts the replicas one after the other, each once it serves and its
/// view holds the fleet again, then waits `lost_after_ms` and two
/// intervals: the nodes the replicas marked lost meanwhile.
fn rolling_restart(
    reps: &mut Replicas,
    admin: &str,
    names: &[String],
    lost_after_ms: u64,
    interval_ms: u64,
) -> Result<u64> {
    let a = agent();
    let urls = reps.urls.clone();
    let mut lost = 0;
    let base: Vec<u64> = urls
        .iter()
        .map(|u| measure::lost_nodes(u, admin))
        .collect::<Result<_>>()?;
    let last = names.last().map(String::as_str).unwrap_or_default();
    for (i, url) in urls.iter().enumerate() {
        lost += measure::lost_nodes(url, admin)?.saturating_sub(base[i]);
        reps.restart(i)?;
        let until = Instant::now() + Duration::from_secs(120);
        while !matches!(
            call(&a, "GET", &format!("{url}/v1/nodes/{last}"), admin, None),
            Ok((200, _))
        ) {
            if Instant::now() > until {
                return Err(Error::new(format!(
                    "the replica at {url} did not show the fleet within 120 s of its restart"
                )));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    std::thread::sleep(Duration::from_millis(lost_after_ms + 2 * interval_ms));
    for url in &urls {
        lost += measure::lost_nodes(url, admin)?;
    }
    Ok(lost)
}

//! A run's figures as one `harvest` row: a JSON line (with `--json`, on
//! stdout, the table then going to stderr, as the other benches do) and a
//! line of the table, followed for the run with the plugin by its targets
//! and whether each was met. Several rounds end with how far the rounds'
//! figures moved.

use std::collections::BTreeMap;
use std::io::{self, Write};
use std::time::Duration;

use serde_json::Value;

use super::figures::{
    harvest, percentile, placement, registrations, start_delays, take_back_times, Harvest,
};
use super::records::JobRecord;
use super::replay::Run;
use super::Settings;
use crate::error::{Context, Result};

/// Idle core-seconds offered, at least.
pub const TARGET_SHARE_MIN: f64 = 0.95;
/// Registration after a job's end, at p99, at most.
pub const TARGET_REGISTRATION_P99_MAX_NS: u64 = 1_000_000_000;
/// How far past the grace a job may start, at most.
pub const TARGET_OVER_GRACE_MAX_NS: i64 = 2_000_000_000;
/// What the plugin may add to the start delay on nodes where no lease
/// ran, at p99, at most.
pub const TARGET_ADDED_IDLE_P99_MAX_NS: i64 = 100_000_000;

/// p50, p99 and the largest of some latencies, ns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Quantiles {
    pub count: usize,
    pub p50: u64,
    pub p99: u64,
    pub max: u64,
}

impl Quantiles {
    fn of(mut values: Vec<u64>) -> Option<Quantiles> {
        Some(Quantiles {
            count: values.len(),
            p50: percentile(&mut values, 50)?,
            p99: percentile(&mut values, 99)?,
            max: *values.last()?,
        })
    }
}

/// The jobs on nodes where no lease ran, with and without the plugin.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IdleNodes {
    pub count: usize,
    pub p99: u64,
    /// The same jobs' p99 in the run without the plugin.
    pub p99_without: u64,
    /// Their take-backs' p99 (Slurm's allocation to the plugin's answer).
    pub take_back_p99: Option<u64>,
}

impl IdleNodes {
    pub fn added(&self) -> i64 {
        self.p99 as i64 - self.p99_without as i64
    }
}

/// slurmctld RPCs one Slurm query of rfaas's costs at most (`squeue
/// --local` or `scontrol --local` about one job: `REQUEST_JOB_INFO_SINGLE`
/// and, for a job on several nodes or squeue, a node or partition
/// listing).
const RPCS_PER_QUERY: f64 = 2.0;

/// What rfaas may add to slurmctld per minute over a run of `jobs` on
/// `nodes` nodes lasting `window` (docs/slurm.md, "What rfaas asks
/// Slurm"): one RPC per node and minute, plus on each of a job's nodes a
/// query at its start and slurmd's epilog message at its end, plus a
/// manager's query at each job's start and end.
pub fn rpc_bound_per_min(nodes: u32, jobs: &[JobRecord], window: Duration) -> f64 {
    let minutes = window.as_secs_f64() / 60.0;
    if minutes <= 0.0 {
        return f64::from(nodes);
    }
    let node_starts: usize = jobs.iter().map(|j| j.nodes.len()).sum();
    let per_job =
        node_starts as f64 * (RPCS_PER_QUERY + 1.0) + jobs.len() as f64 * 2.0 * RPCS_PER_QUERY;
    f64::from(nodes) + per_job / minutes
}

/// One run's row.
#[derive(Debug, Clone, PartialEq)]
pub struct RunRow {
    pub plugin: bool,
    pub round: usize,
    pub rounds: usize,
    pub seed: u64,
    pub jobs: usize,
    pub nodes: u32,
    pub cpus: u32,
    pub grace_ms: u64,
    pub clients: usize,
    pub duration_ms: u64,
    pub failed_jobs: usize,
    pub drained_nodes: Vec<String>,
    pub harvest: Harvest,
    pub registration: Option<Quantiles>,
    pub superseded: usize,
    pub unregistered: usize,
    pub delay: Option<Quantiles>,
    pub idle: Option<IdleNodes>,
    /// Slurm's allocation to the end of the plugin's take-back, per job.
    pub take_back: Option<Quantiles>,
    /// The start delays of the jobs on nodes where a lease ran.
    pub leased: Option<Quantiles>,
    /// Of those, the jobs whose nodes had no lease at their allocation but
    /// one before their script's first line (a client moved there, to
    /// another core or to theirs before the prolog took them back).
    pub raced: usize,
    pub invocations: u64,
    pub moves: u64,
    pub client_waits: u64,
    pub client_errors: u64,
    pub wrong_answers: u64,
    /// The clients' last error, for people.
    pub client_error: Option<String>,
    pub slurm_samples: usize,
    pub manager_samples: usize,
    pub sample_misses: u64,
    /// slurmctld's RPCs from root over the run (its daemons, sbatch and,
    /// with the plugin, rfaas; not the bench's sampling), and per minute.
    pub slurmctld_rpcs: Option<u64>,
    pub slurmctld_rpcs_per_min: Option<f64>,
    /// With the plugin: what rfaas added to slurmctld, per node and
    /// minute (this run's rate less the run without it, over the nodes).
    pub rfaas_rpcs_per_node_min: Option<f64>,
    /// With the plugin: what rfaas may add per minute over the run
    /// ([`rpc_bound_per_min`]).
    pub rfaas_rpcs_bound_per_min: Option<f64>,
    /// Each job's start delay by stream index (not printed).
    pub delays: BTreeMap<usize, u64>,
}

impl RunRow {
    /// The row of `run`; `without` is the run without the plugin of the
    /// same round, for the start delays on idle nodes.
    pub fn of(settings: &Settings, round: usize, run: &Run, without: Option<&RunRow>) -> RunRow {
        let cpus = settings.stream.cpus;
        let (from, to) = run.window;
        let manager = run.manager.as_ref().map_or(&[][..], |m| &m.samples[..]);
        let h = harvest(&run.slurm.samples, manager, from, to);
        let slurmctld_rpcs_per_min = run
            .slurmctld_rpcs
            .filter(|(_, window)| !window.is_zero())
            .map(|(n, window)| n as f64 * 60.0 / window.as_secs_f64());
        let delays = start_delays(&run.jobs);
        let take_backs = take_back_times(&run.jobs);
        let (registration, superseded, unregistered) = match &run.manager {
            Some(m) => {
                let r = registrations(&run.jobs, &m.samples, cpus);
                (Quantiles::of(r.latencies_ns), r.superseded, r.missing)
            }
            None => (None, 0, 0),
        };
        let placed = run
            .manager
            .as_ref()
            .map(|m| placement(&run.jobs, &m.samples));
        // The others: a lease ran on a node of theirs while they started.
        let leased = placed.as_ref().and_then(|p| {
            Quantiles::of(
                delays
                    .iter()
                    .filter(|(i, _)| !p.idle.contains(i))
                    .map(|(_, d)| *d)
                    .collect(),
            )
        });
        let raced = placed.as_ref().map_or(0, |p| p.raced.len());
        let idle = match (placed.map(|p| p.idle), without) {
            (Some(idle), Some(w)) => {
                let mut with: Vec<u64> =
                    idle.iter().filter_map(|i| delays.get(i)).copied().collect();
                let mut before: Vec<u64> = idle
                    .iter()
                    .filter_map(|i| w.delays.get(i))
                    .copied()
                    .collect();
                let mut taken: Vec<u64> = idle
                    .iter()
                    .filter_map(|i| take_backs.get(i))
                    .copied()
                    .collect();
                match (percentile(&mut with, 99), percentile(&mut before, 99)) {
                    (Some(p99), Some(p99_without)) => Some(IdleNodes {
                        count: with.len(),
                        p99,
                        p99_without,
                        take_back_p99: percentile(&mut taken, 99),
                    }),
                    _ => None,
                }
            }
            _ => None,
        };
        RunRow {
            plugin: run.plugin,
            round,
            rounds: settings.rounds,
            seed: settings.stream.seed,
            jobs: run.jobs.len(),
            nodes: settings.stream.nodes,
            cpus,
            grace_ms: u64::from(settings.grace_s) * 1000,
            clients: if run.plugin {
                settings.clients.count
            } else {
                0
            },
            duration_ms: to.saturating_sub(from) / 1_000_000,
            failed_jobs: run.failed_jobs,
            drained_nodes: run.drained_nodes.clone(),
            harvest: h,
            registration,
            superseded,
            unregistered,
            delay: Quantiles::of(delays.values().copied().collect()),
            idle,
            take_back: Quantiles::of(take_backs.values().copied().collect()),
            leased,
            raced,
            invocations: run.clients.calls,
            moves: run.clients.moves,
            client_waits: run.clients.waits,
            client_errors: run.clients.errors,
            wrong_answers: run.clients.wrong,
            client_error: run.clients.last_error.clone(),
            slurm_samples: run.slurm.samples.len(),
            manager_samples: run.manager.as_ref().map_or(0, |m| m.samples.len()),
            sample_misses: run.slurm.misses + run.manager.as_ref().map_or(0, |m| m.misses),
            slurmctld_rpcs: run.slurmctld_rpcs.map(|(n, _)| n),
            slurmctld_rpcs_per_min,
            rfaas_rpcs_bound_per_min: match (run.plugin, run.slurmctld_rpcs) {
                (true, Some((_, window))) => {
                    Some(rpc_bound_per_min(settings.stream.nodes, &run.jobs, window))
                }
                _ => None,
            },
            rfaas_rpcs_per_node_min: match (run.plugin, slurmctld_rpcs_per_min, without) {
                (true, Some(with), Some(w)) => w
                    .slurmctld_rpcs_per_min
                    .map(|without| (with - without) / f64::from(settings.stream.nodes.max(1))),
                _ => None,
            },
            delays,
        }
    }

    /// The slowest start past the grace, ns (negative: that far within).
    pub fn max_delay_over_grace_ns(&self) -> Option<i64> {
        self.delay
            .map(|d| d.max as i64 - (self.grace_ms * 1_000_000) as i64)
    }

    /// The targets of the run with the plugin: (name, met, what).
    pub fn verdicts(&self) -> Vec<(&'static str, bool, String)> {
        if !self.plugin {
            return Vec::new();
        }
        let ms = |ns: f64| ns / 1e6;
        let mut out = Vec::new();
        let share = self.harvest.share();
        out.push((
            "offered_share",
            share.is_some_and(|s| s >= TARGET_SHARE_MIN),
            match share {
                Some(s) => format!(
                    "offered share {:.1} % >= {:.0} %",
                    s * 100.0,
                    TARGET_SHARE_MIN * 100.0
                ),
                None => "offered share: Slurm had no idle CPU".into(),
            },
        ));
        out.push((
            "registration_p99",
            self.unregistered == 0
                && self
                    .registration
                    .is_some_and(|r| r.p99 <= TARGET_REGISTRATION_P99_MAX_NS),
            match self.registration {
                Some(r) => format!(
                    "registration p99 {:.1} ms <= {:.0} ms{}",
                    ms(r.p99 as f64),
                    ms(TARGET_REGISTRATION_P99_MAX_NS as f64),
                    if self.unregistered > 0 {
                        format!(" ({} jobs never lent again)", self.unregistered)
                    } else {
                        String::new()
                    }
                ),
                None => "registration: no job's end was seen lent again".into(),
            },
        ));
        let over = self.max_delay_over_grace_ns();
        out.push((
            "delay_over_grace",
            self.failed_jobs == 0 && over.is_some_and(|o| o <= TARGET_OVER_GRACE_MAX_NS),
            match (self.delay, over) {
                (Some(d), Some(_)) => format!(
                    "slowest start {:.2} s <= grace {} s + {} s{}",
                    d.max as f64 / 1e9,
                    self.grace_ms / 1000,
                    TARGET_OVER_GRACE_MAX_NS / 1_000_000_000,
                    if self.failed_jobs > 0 {
                        format!(" ({} jobs did not run)", self.failed_jobs)
                    } else {
                        String::new()
                    }
                ),
                _ => "start delay: no job's start was measured".into(),
            },
        ));
        out.push((
            "added_idle_p99",
            self.idle
                .is_some_and(|i| i.added() <= TARGET_ADDED_IDLE_P99_MAX_NS),
            match self.idle {
                Some(i) => format!(
                    "idle nodes add {:.1} ms at p99 ({:.1} ms with the plugin, {:.1} ms without, {} jobs) <= {:.0} ms",
                    ms(i.added() as f64),
                    ms(i.p99 as f64),
                    ms(i.p99_without as f64),
                    i.count,
                    ms(TARGET_ADDED_IDLE_P99_MAX_NS as f64)
                ),
                None => "idle nodes: no job started where no lease ran".into(),
            },
        ));
        out
    }

    /// The row as one JSON object, keys in a fixed order.
    pub fn to_json(&self) -> String {
        let ns = |v: Option<u64>| v.map_or(Value::Null, Value::from);
        let core_s = |v: f64| Value::from((v * 10.0).round() / 10.0);
        let mut fields: Vec<(&str, Value)> =
            vec![("name", "harvest".into()), ("plugin", self.plugin.into())];
        if self.rounds > 1 {
            fields.push(("round", self.round.into()));
            fields.push(("rounds", self.rounds.into()));
        }
        fields.extend([
            ("seed", self.seed.into()),
            ("jobs", self.jobs.into()),
            ("nodes", self.nodes.into()),
            ("cpus", self.cpus.into()),
            ("grace_ms", self.grace_ms.into()),
            ("clients", self.clients.into()),
            ("duration_ms", self.duration_ms.into()),
            ("failed_jobs", self.failed_jobs.into()),
            ("drained_nodes", self.drained_nodes.clone().into()),
            ("idle_core_s", core_s(self.harvest.idle_core_s)),
        ]);
        if self.plugin {
            fields.extend([
                ("offered_core_s", core_s(self.harvest.offered_core_s)),
                ("overlent_core_s", core_s(self.harvest.overlent_core_s)),
                (
                    "offered_share",
                    self.harvest
                        .share()
                        .map_or(Value::Null, |s| ((s * 1000.0).round() / 1000.0).into()),
                ),
            ]);
        } else {
            fields.push(("offered_share", Value::Null));
        }
        let reg = self.registration;
        fields.extend([
            ("registrations", reg.map_or(0, |r| r.count).into()),
            ("registrations_superseded", self.superseded.into()),
            ("registrations_missing", self.unregistered.into()),
            ("registration_p50_ns", ns(reg.map(|r| r.p50))),
            ("registration_p99_ns", ns(reg.map(|r| r.p99))),
            ("registration_max_ns", ns(reg.map(|r| r.max))),
        ]);
        let d = self.delay;
        fields.extend([
            ("start_delays", d.map_or(0, |d| d.count).into()),
            ("start_delay_p50_ns", ns(d.map(|d| d.p50))),
            ("start_delay_p99_ns", ns(d.map(|d| d.p99))),
            ("start_delay_max_ns", ns(d.map(|d| d.max))),
            (
                "max_delay_over_grace_ns",
                self.max_delay_over_grace_ns()
                    .map_or(Value::Null, Value::from),
            ),
        ]);
        if self.plugin {
            let i = self.idle;
            fields.extend([
                ("idle_start_delays", i.map_or(0, |i| i.count).into()),
                ("idle_start_delay_p99_ns", ns(i.map(|i| i.p99))),
                (
                    "idle_start_delay_p99_without_ns",
                    ns(i.map(|i| i.p99_without)),
                ),
                (
                    "added_idle_p99_ns",
                    i.map_or(Value::Null, |i| i.added().into()),
                ),
                ("take_backs", self.take_back.map_or(0, |t| t.count).into()),
                ("take_back_p50_ns", ns(self.take_back.map(|t| t.p50))),
                ("take_back_p99_ns", ns(self.take_back.map(|t| t.p99))),
                ("take_back_max_ns", ns(self.take_back.map(|t| t.max))),
                ("idle_take_back_p99_ns", ns(i.and_then(|i| i.take_back_p99))),
                (
                    "leased_start_delays",
                    self.leased.map_or(0, |l| l.count).into(),
                ),
                ("leased_start_delay_p50_ns", ns(self.leased.map(|l| l.p50))),
                ("leased_start_delay_max_ns", ns(self.leased.map(|l| l.max))),
                ("leased_after_allocation", self.raced.into()),
            ]);
        }
        fields.extend([
            ("invocations", self.invocations.into()),
            ("client_moves", self.moves.into()),
            ("client_lease_waits", self.client_waits.into()),
            ("client_errors", self.client_errors.into()),
            ("wrong_answers", self.wrong_answers.into()),
            ("slurm_samples", self.slurm_samples.into()),
            ("manager_samples", self.manager_samples.into()),
            ("sample_misses", self.sample_misses.into()),
            (
                "slurmctld_rpcs",
                self.slurmctld_rpcs.map_or(Value::Null, Value::from),
            ),
            (
                "slurmctld_rpcs_per_min",
                self.slurmctld_rpcs_per_min.map_or(Value::Null, Value::from),
            ),
        ]);
        if self.plugin {
            fields.extend([
                (
                    "rfaas_slurmctld_rpcs_per_node_min",
                    self.rfaas_rpcs_per_node_min
                        .map_or(Value::Null, Value::from),
                ),
                (
                    "rfaas_slurmctld_rpcs_bound_per_node_min",
                    self.rfaas_rpcs_bound_per_min
                        .map(|b| b / f64::from(self.nodes.max(1)))
                        .map_or(Value::Null, Value::from),
                ),
            ]);
        }
        if self.plugin {
            let verdicts = self.verdicts();
            let missed: Vec<&str> = verdicts
                .iter()
                .filter(|(_, met, _)| !met)
                .map(|(n, _, _)| *n)
                .collect();
            fields.extend([
                ("target_offered_share_min", TARGET_SHARE_MIN.into()),
                (
                    "target_registration_p99_max_ns",
                    TARGET_REGISTRATION_P99_MAX_NS.into(),
                ),
                (
                    "target_delay_over_grace_max_ns",
                    TARGET_OVER_GRACE_MAX_NS.into(),
                ),
                (
                    "target_added_idle_p99_max_ns",
                    TARGET_ADDED_IDLE_P99_MAX_NS.into(),
                ),
                ("meets_target", missed.is_empty().into()),
                ("missed", missed.into()),
            ]);
        }
        let body: Vec<String> = fields
            .into_iter()
            .map(|(k, v)| format!("{}:{v}", Value::from(k)))
            .collect();
        format!("{{{}}}", body.join(","))
    }

    fn to_table_line(&self) -> String {
        let ms =
            |v: Option<u64>| v.map_or_else(|| "-".into(), |ns| format!("{:.1}", ns as f64 / 1e6));
        let share = match (self.plugin, self.harvest.share()) {
            (true, Some(s)) => format!("{:.1} %", s * 100.0),
            _ => "-".into(),
        };
        format!(
            "{:<8} {:>5} {:>5} {:>8.1} {:>11.1} {:>8} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>11}",
            if self.plugin { "plugin" } else { "without" },
            self.round,
            self.jobs,
            self.duration_ms as f64 / 1000.0,
            self.harvest.idle_core_s,
            share,
            ms(self.registration.map(|r| r.p50)),
            ms(self.registration.map(|r| r.p99)),
            ms(self.delay.map(|d| d.p50)),
            ms(self.delay.map(|d| d.p99)),
            ms(self.delay.map(|d| d.max)),
            ms(self.idle.map(|i| i.p99)),
            self.invocations
        )
    }
}

fn header() -> String {
    format!(
        "{:<8} {:>5} {:>5} {:>8} {:>11} {:>8} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>11}",
        "run",
        "round",
        "jobs",
        "span s",
        "idle core-s",
        "offered",
        "reg p50",
        "reg p99",
        "start p50",
        "start p99",
        "start max",
        "idle p99",
        "invocations"
    )
}

/// Where rows go.
#[derive(Debug)]
pub struct Output {
    json: bool,
    header_written: bool,
    rows: Vec<RunRow>,
}

impl Output {
    pub fn new(json: bool) -> Output {
        Output {
            json,
            header_written: false,
            rows: Vec::new(),
        }
    }

    /// Prints `row` now.
    pub fn print(&mut self, row: &RunRow) -> Result<()> {
        self.write(row)
            .context(|| "could not print a harvest row".to_owned())?;
        self.rows.push(row.clone());
        Ok(())
    }

    fn table(&self) -> Box<dyn Write> {
        if self.json {
            Box::new(io::stderr().lock())
        } else {
            Box::new(io::stdout().lock())
        }
    }

    fn write(&mut self, row: &RunRow) -> io::Result<()> {
        let mut table = self.table();
        if !self.header_written {
            writeln!(table, "(times in ms; start = Slurm's allocation to the job script's first line; idle p99 = jobs on nodes no lease ran on while they started)")?;
            writeln!(table, "{}", header())?;
            self.header_written = true;
        }
        writeln!(table, "{}", row.to_table_line())?;
        for (_, met, what) in row.verdicts() {
            writeln!(table, "  {what}: {}", if met { "met" } else { "MISSED" })?;
        }
        if row.plugin {
            writeln!(
                table,
                "  {} jobs' ends registered, {} superseded by another job, {} never seen; \
                 clients moved {} times, waited for a free core {} times, failed {} times; \
                 {:.1} core-s lent beyond Slurm's idle CPUs",
                row.registration.map_or(0, |r| r.count),
                row.superseded,
                row.unregistered,
                row.moves,
                row.client_waits,
                row.client_errors,
                row.harvest.overlent_core_s
            )?;
            if let Some(t) = row.take_back {
                writeln!(
                    table,
                    "  take-backs (Slurm's allocation to the plugin's answer): p50 {:.1} ms, \
                     p99 {:.1} ms, max {:.1} ms; on idle nodes p99 {}",
                    t.p50 as f64 / 1e6,
                    t.p99 as f64 / 1e6,
                    t.max as f64 / 1e6,
                    row.idle
                        .and_then(|i| i.take_back_p99)
                        .map_or_else(|| "-".into(), |p| format!("{:.1} ms", p as f64 / 1e6))
                )?;
            }
            if let Some(l) = row.leased {
                writeln!(
                    table,
                    "  {} jobs started where a lease ran on a node of theirs ({} of them had none \
                     there at their allocation): start p50 {:.1} ms, max {:.1} ms",
                    l.count,
                    row.raced,
                    l.p50 as f64 / 1e6,
                    l.max as f64 / 1e6
                )?;
            }
            if let Some(e) = &row.client_error {
                writeln!(table, "  the clients' last error: {e}")?;
            }
        }
        table.flush()?;
        if self.json {
            let mut out = io::stdout().lock();
            writeln!(out, "{}", row.to_json())?;
            out.flush()?;
        }
        Ok(())
    }

    /// With several rounds: how far the rounds' figures moved.
    pub fn finish(&mut self) -> Result<()> {
        let plugin: Vec<&RunRow> = self.rows.iter().filter(|r| r.plugin).collect();
        if plugin.len() < 2 {
            return Ok(());
        }
        let range = |values: Vec<f64>| {
            let lo = values.iter().copied().fold(f64::INFINITY, f64::min);
            let hi = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            (lo, hi)
        };
        let figure = |name: &str, unit: &str, scale: f64, f: &dyn Fn(&RunRow) -> Option<f64>| {
            let values: Vec<f64> = plugin.iter().filter_map(|r| f(r)).collect();
            if values.is_empty() {
                return format!("{name} -");
            }
            let (lo, hi) = range(values);
            // Counts are whole; the rest to a tenth.
            let digits = if unit.is_empty() { 0 } else { 1 };
            format!(
                "{name} {:.digits$}-{:.digits$}{unit}",
                lo * scale,
                hi * scale
            )
        };
        let line = [
            figure("offered share", " %", 100.0, &|r| r.harvest.share()),
            figure("registration p99", " ms", 1e-6, &|r| {
                r.registration.map(|x| x.p99 as f64)
            }),
            figure("start p99", " ms", 1e-6, &|r| r.delay.map(|x| x.p99 as f64)),
            figure("added on idle nodes at p99", " ms", 1e-6, &|r| {
                r.idle.map(|x| x.added() as f64)
            }),
            figure("invocations", "", 1.0, &|r| Some(r.invocations as f64)),
        ]
        .join(", ");
        let mut table = self.table();
        writeln!(table, "over {} rounds (plugin runs): {line}", plugin.len())
            .and_then(|()| table.flush())
            .context(|| "could not print the rounds' spread".to_owned())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(plugin: bool) -> RunRow {
        RunRow {
            plugin,
            round: 1,
            rounds: 1,
            seed: 7,
            jobs: 3,
            nodes: 4,
            cpus: 4,
            grace_ms: 30_000,
            clients: 2,
            duration_ms: 12_345,
            failed_jobs: 0,
            drained_nodes: Vec::new(),
            harvest: Harvest {
                idle_core_s: 100.0,
                offered_core_s: 96.0,
                overlent_core_s: 1.0,
            },
            registration: Some(Quantiles {
                count: 3,
                p50: 100_000_000,
                p99: 400_000_000,
                max: 400_000_000,
            }),
            superseded: 1,
            unregistered: 0,
            delay: Some(Quantiles {
                count: 3,
                p50: 30_000_000,
                p99: 90_000_000,
                max: 90_000_000,
            }),
            idle: Some(IdleNodes {
                count: 2,
                p99: 90_000_000,
                p99_without: 30_000_000,
                take_back_p99: Some(20_000_000),
            }),
            take_back: None,
            leased: Some(Quantiles {
                count: 1,
                p50: 60_000_000,
                p99: 60_000_000,
                max: 60_000_000,
            }),
            raced: 0,
            invocations: 1000,
            moves: 2,
            client_waits: 0,
            client_errors: 0,
            wrong_answers: 0,
            client_error: None,
            slurm_samples: 100,
            manager_samples: 400,
            sample_misses: 0,
            slurmctld_rpcs: Some(600),
            slurmctld_rpcs_per_min: Some(100.0),
            rfaas_rpcs_per_node_min: Some(2.5),
            rfaas_rpcs_bound_per_min: Some(40.0),
            delays: BTreeMap::new(),
        }
    }

    #[test]
    fn rpc_bound_per_node_minute_and_per_job() {
        let job = |nodes: &[&str]| JobRecord {
            index: 0,
            id: 1,
            size: crate::harvest::stream::Size::Nodes(nodes.len() as u32),
            submitted_ns: 0,
            allocated_ns: None,
            nodes: nodes.iter().map(|n| n.to_string()).collect(),
            started_ns: None,
            ended_ns: None,
            taken_back_ns: None,
        };
        let two_minutes = Duration::from_secs(120);
        // Nothing ran: one RPC per node and minute.
        assert_eq!(rpc_bound_per_min(32, &[], two_minutes), 32.0);
        // A job on two nodes and one on one: (3 × 3 + 2 × 2 × 2) / 2 min.
        let jobs = [job(&["node1", "node2"]), job(&["node3"])];
        assert_eq!(rpc_bound_per_min(32, &jobs, two_minutes), 32.0 + 8.5);
        assert_eq!(rpc_bound_per_min(4, &jobs, Duration::ZERO), 4.0);
    }

    #[test]
    fn the_plugin_row_has_every_figure_and_its_targets() {
        let v: Value = serde_json::from_str(&row(true).to_json()).unwrap();
        assert_eq!(v["name"], "harvest");
        assert_eq!(v["plugin"], true);
        assert_eq!(v["offered_share"], 0.96);
        assert_eq!(v["registration_p99_ns"], 400_000_000);
        assert_eq!(v["start_delay_p99_ns"], 90_000_000);
        assert_eq!(v["max_delay_over_grace_ns"], 90_000_000 - 30_000_000_000i64);
        assert_eq!(v["added_idle_p99_ns"], 60_000_000);
        assert_eq!(v["leased_start_delays"], 1);
        assert_eq!(v["idle_take_back_p99_ns"], 20_000_000);
        assert_eq!(v["take_back_p99_ns"], Value::Null);
        assert_eq!(v["invocations"], 1000);
        assert_eq!(v["meets_target"], true);
        assert_eq!(v["missed"], serde_json::json!([]));
        assert!(v.get("round").is_none());

        let mut slow = row(true);
        slow.harvest.offered_core_s = 90.0;
        slow.idle.as_mut().unwrap().p99 = 200_000_000;
        let v: Value = serde_json::from_str(&slow.to_json()).unwrap();
        assert_eq!(v["meets_target"], false);
        assert_eq!(
            v["missed"],
            serde_json::json!(["offered_share", "added_idle_p99"])
        );
    }

    #[test]
    fn the_row_without_the_plugin_has_no_targets() {
        let mut r = row(false);
        r.registration = None;
        r.idle = None;
        r.leased = None;
        r.invocations = 0;
        let v: Value = serde_json::from_str(&r.to_json()).unwrap();
        assert_eq!(v["plugin"], false);
        assert_eq!(v["offered_share"], Value::Null);
        assert_eq!(v["registration_p99_ns"], Value::Null);
        assert!(v.get("meets_target").is_none() && v.get("added_idle_p99_ns").is_none());
        assert!(v.get("leased_start_delays").is_none());
        assert!(r.verdicts().is_empty());
        assert!(r.to_table_line().starts_with("without"));
    }
}

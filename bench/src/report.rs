//! Rows -> a human table, and with `--json` one JSON object per line.
//!
//! With `--json` stdout carries only the JSON lines (so `| jq` works) and the
//! table goes to stderr. With one round, rows are printed as they finish.
//! With `--rounds N` every row is measured N times and its best round is
//! printed at the end (lowest median latency, highest bandwidth): on a
//! shared machine a slow round says more about the neighbours than about
//! the code, and the best rounds of two rows compare like with like.
//! Each such row also says how far its single rounds moved (`spread`: the
//! worst round's figure over the best's, ≥ 1), so a reader sees whether the
//! best round stands for the others. Derived rows (differences and ratios
//! of two rows, with their target) follow the measured ones, computed from
//! those best rounds.
//!
//! Rows of the manager mode (`--manager`) name their database, replicas
//! and client threads ([`ServicePoint`]) instead of a provider and a size,
//! in the table and in the JSON (`backend`, `replicas`, `concurrency`).

use std::io::{self, Write};

use crate::error::{Context, Result};
use crate::stats::Summary;

/// One measured row.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    pub name: String,
    /// `tcp`, `shm`, `verbs:rxe0`, or `mem` for in-process baselines.
    pub provider: String,
    /// Message size in bytes.
    pub size: u64,
    /// Operations outstanding at once, for rate rows and rows derived from
    /// them (per initiator where there are several); 0 for every other row.
    pub in_flight: u32,
    /// More coordinates of the point measured, where provider, size and
    /// in flight do not say it all (`initiators`, `slots`): a JSON key
    /// each, after `in_flight`, and the table's note. Rows that differ in
    /// them are different rows. Empty for most rows.
    pub params: Vec<(&'static str, u64)>,
    pub measure: Measure,
    /// With several rounds: how far this row's rounds moved.
    pub spread: Option<Spread>,
    /// A derived row with a target, with several rounds: the target
    /// checked on each round's own rows, not only on the best ones.
    pub per_round: Option<PerRound>,
    /// Manager rows: where they were measured; `provider`, `size` and
    /// `in_flight` are then unused.
    pub service: Option<ServicePoint>,
}

/// Where a manager row was measured.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServicePoint {
    /// `postgres` or `sqlite`.
    pub backend: String,
    /// Manager replicas serving; 0 for rows with no manager in them.
    pub replicas: u32,
    /// Clients (threads or tasks) sending at once.
    pub concurrency: u32,
}

/// Which figure of a [`Measure::Service`] row picks its best round.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Best {
    /// The most operations per second (closed-loop throughput rows).
    MostOps,
    /// The lowest median.
    LowestMedian,
    /// The lowest p99 (rows checked against a p99 target).
    LowestP99,
}

/// How far the rounds of one row moved.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Spread {
    pub rounds: u32,
    /// The worst round's figure over the best's (for latency the slowest
    /// median over the fastest, for bandwidth and rates the highest over
    /// the lowest): 1.0 when every round agreed.
    pub worst_over_best: f64,
}

/// A derived row's target, round by round: each round's measured rows make
/// their own derived row, which meets the target or not.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PerRound {
    pub rounds: u32,
    /// Rounds whose own derived row met the target.
    pub met: u32,
    /// The figure of the round farthest on the wrong side of the target
    /// (a difference's ns, a ratio).
    pub worst: f64,
    /// The median of the rounds' figures (of the two middle ones, their
    /// mean): what a typical single round gives.
    pub median: f64,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Measure {
    Latency(Summary),
    /// `bytes` moved in total; `bytes_per_s` = `bytes` / elapsed.
    Bandwidth {
        bytes_per_s: u64,
        bytes: u64,
    },
    /// Operations completed per second with `in_flight` outstanding at
    /// once; `calls` completed in all.
    Rate {
        per_s: u64,
        calls: u64,
    },
    /// Derived from two other rows' medians: `median_ns` = median of one
    /// minus median of the other (`of` says which), checked against an
    /// upper bound.
    Difference {
        median_ns: i64,
        of: String,
        target_max_ns: Option<u64>,
    },
    /// Derived from two other rows: `ratio` = one row's figure over the
    /// other's (`of` says which), checked against a lower bound, an upper
    /// bound, or both.
    Ratio {
        ratio: f64,
        of: String,
        target_min: Option<f64>,
        target_max: Option<f64>,
    },
    /// A manager row: the latency of each operation, operations per second
    /// where the row has a rate, an upper bound on its p99 where it has a
    /// target, and more figures by name (e.g. `offered_per_s`).
    Service {
        latency: Summary,
        ops_per_s: Option<u64>,
        best: Best,
        target_p99_max_ns: Option<u64>,
        extra: Vec<(&'static str, u64)>,
    },
}

impl Row {
    pub fn latency(name: &str, provider: &str, size: usize, summary: Summary) -> Self {
        Self {
            name: name.to_owned(),
            provider: provider.to_owned(),
            size: size as u64,
            measure: Measure::Latency(summary),
            in_flight: 0,
            params: Vec::new(),
            spread: None,
            per_round: None,
            service: None,
        }
    }

    pub fn bandwidth(
        name: &str,
        provider: &str,
        size: usize,
        bytes: u64,
        elapsed: std::time::Duration,
    ) -> Self {
        let bytes_per_s = (bytes as f64 / elapsed.as_secs_f64().max(1e-9)).round() as u64;
        Self {
            name: name.to_owned(),
            provider: provider.to_owned(),
            size: size as u64,
            measure: Measure::Bandwidth { bytes_per_s, bytes },
            in_flight: 0,
            params: Vec::new(),
            spread: None,
            per_round: None,
            service: None,
        }
    }

    /// `calls` operations of `size` bytes, `in_flight` at a time, in
    /// `elapsed`.
    pub fn rate(
        name: &str,
        provider: &str,
        size: usize,
        in_flight: u32,
        calls: u64,
        elapsed: std::time::Duration,
    ) -> Self {
        let per_s = (calls as f64 / elapsed.as_secs_f64().max(1e-9)).round() as u64;
        Self {
            name: name.to_owned(),
            provider: provider.to_owned(),
            size: size as u64,
            measure: Measure::Rate { per_s, calls },
            in_flight,
            params: Vec::new(),
            spread: None,
            per_round: None,
            service: None,
        }
    }

    /// A manager row measured at `point`; see [`Measure::Service`].
    pub fn service(name: &str, point: ServicePoint, measure: Measure) -> Self {
        Self {
            name: name.to_owned(),
            provider: String::new(),
            size: 0,
            in_flight: 0,
            params: Vec::new(),
            measure,
            spread: None,
            per_round: None,
            service: Some(point),
        }
    }

    /// The same row at a point with `key` = `value` too (see
    /// [`Row::params`]).
    pub fn with(mut self, key: &'static str, value: u64) -> Self {
        self.params.push((key, value));
        self
    }

    /// Whether `other` is a measurement (another round) of the same row.
    pub fn same_row(&self, other: &Row) -> bool {
        self.name == other.name && self.same_row_but_name(other)
    }

    /// Whether `other` measures the same point (provider, size, in flight)
    /// as this row, whatever its name.
    pub fn same_row_but_name(&self, other: &Row) -> bool {
        self.provider == other.provider
            && self.size == other.size
            && self.in_flight == other.in_flight
            && self.params == other.params
            && self.service == other.service
    }

    /// The figure rounds are compared by: median ns, bytes/s or calls/s.
    fn figure(&self) -> Option<f64> {
        match &self.measure {
            Measure::Latency(l) => Some(l.median_ns as f64),
            Measure::Bandwidth { bytes_per_s, .. } => Some(*bytes_per_s as f64),
            Measure::Rate { per_s, .. } => Some(*per_s as f64),
            Measure::Service {
                latency,
                ops_per_s,
                best,
                ..
            } => match best {
                Best::MostOps => ops_per_s.map(|o| o as f64),
                Best::LowestMedian => Some(latency.median_ns as f64),
                Best::LowestP99 => Some(latency.p99_ns as f64),
            },
            _ => None,
        }
    }

    /// A derived row's figure and which way it is worse: the larger is
    /// worse for a difference or a ratio with an upper bound, the smaller
    /// for a ratio with only a lower one. `None` without a target.
    fn derived_figure(&self) -> Option<(f64, bool)> {
        match &self.measure {
            Measure::Difference {
                median_ns,
                target_max_ns: Some(_),
                ..
            } => Some((*median_ns as f64, true)),
            Measure::Ratio {
                ratio,
                target_max: Some(_),
                ..
            } => Some((*ratio, true)),
            Measure::Ratio {
                ratio,
                target_min: Some(_),
                ..
            } => Some((*ratio, false)),
            _ => None,
        }
    }

    /// A derived row: `median_ns` = `a` − `b`, medians of two latency rows.
    pub fn difference(
        name: &str,
        provider: &str,
        size: u64,
        median_ns: i64,
        of: String,
        target_max_ns: Option<u64>,
    ) -> Self {
        Self {
            name: name.to_owned(),
            provider: provider.to_owned(),
            size,
            measure: Measure::Difference {
                median_ns,
                of,
                target_max_ns,
            },
            in_flight: 0,
            params: Vec::new(),
            spread: None,
            per_round: None,
            service: None,
        }
    }

    /// A derived row: one row's figure over another's.
    pub fn ratio(
        name: &str,
        provider: &str,
        size: u64,
        ratio: f64,
        of: String,
        target_min: Option<f64>,
    ) -> Self {
        Self {
            name: name.to_owned(),
            provider: provider.to_owned(),
            size,
            measure: Measure::Ratio {
                ratio,
                of,
                target_min,
                target_max: None,
            },
            in_flight: 0,
            params: Vec::new(),
            spread: None,
            per_round: None,
            service: None,
        }
    }

    /// The same derived ratio row, checked against an upper bound too.
    pub fn at_most(mut self, max: f64) -> Self {
        if let Measure::Ratio { target_max, .. } = &mut self.measure {
            *target_max = Some(max);
        }
        self
    }

    /// Whether a derived row meets its target; `None` for measured rows and
    /// derived rows without one.
    pub fn meets_target(&self) -> Option<bool> {
        match &self.measure {
            Measure::Ratio {
                ratio,
                target_min,
                target_max,
                ..
            } if target_min.is_some() || target_max.is_some() => Some(
                target_min.map_or(true, |min| *ratio >= min)
                    && target_max.map_or(true, |max| *ratio <= max),
            ),
            Measure::Difference {
                median_ns,
                target_max_ns: Some(max),
                ..
            } => Some(*median_ns <= *max as i64),
            Measure::Service {
                latency,
                target_p99_max_ns: Some(max),
                ..
            } => Some(latency.p99_ns <= *max),
            _ => None,
        }
    }

    /// The row as one JSON object, keys in a fixed order.
    pub fn to_json(&self) -> String {
        let mut s = match &self.service {
            Some(point) => format!(
                "{{\"name\":{},\"backend\":{},\"replicas\":{},\"concurrency\":{}",
                serde_json::Value::from(self.name.as_str()),
                serde_json::Value::from(point.backend.as_str()),
                point.replicas,
                point.concurrency
            ),
            None => format!(
                "{{\"name\":{},\"provider\":{},\"size\":{}",
                serde_json::Value::from(self.name.as_str()),
                serde_json::Value::from(self.provider.as_str()),
                self.size
            ),
        };
        if self.in_flight > 0 {
            s.push_str(&format!(",\"in_flight\":{}", self.in_flight));
        }
        for (key, value) in &self.params {
            s.push_str(&format!(",{}:{value}", serde_json::Value::from(*key)));
        }
        let met = self.meets_target();
        match &self.measure {
            Measure::Latency(l) => s.push_str(&format!(
                ",\"median_ns\":{},\"p99_ns\":{},\"min_ns\":{},\"mean_ns\":{},\"iqm_ns\":{},\"iters\":{}",
                l.median_ns, l.p99_ns, l.min_ns, l.mean_ns, l.iqm_ns, l.iters
            )),
            Measure::Bandwidth { bytes_per_s, bytes } => {
                s.push_str(&format!(",\"bytes_per_s\":{bytes_per_s},\"bytes\":{bytes}"))
            }
            Measure::Rate { per_s, calls } => {
                s.push_str(&format!(",\"per_s\":{per_s},\"calls\":{calls}"))
            }
            Measure::Difference {
                median_ns,
                of,
                target_max_ns,
            } => s.push_str(&format!(
                ",\"median_ns\":{median_ns},\"of\":{},\"target_max_ns\":{},\"meets_target\":{}",
                serde_json::Value::from(of.as_str()),
                serde_json::Value::from(*target_max_ns),
                serde_json::Value::from(met),
            )),
            Measure::Ratio {
                ratio,
                of,
                target_min,
                target_max,
            } => {
                s.push_str(&format!(
                    ",\"ratio\":{},\"of\":{},\"target_min\":{}",
                    serde_json::Value::from((ratio * 1000.0).round() / 1000.0),
                    serde_json::Value::from(of.as_str()),
                    serde_json::Value::from(*target_min),
                ));
                if let Some(max) = target_max {
                    s.push_str(&format!(
                        ",\"target_max\":{}",
                        serde_json::Value::from(*max)
                    ));
                }
                s.push_str(&format!(
                    ",\"meets_target\":{}",
                    serde_json::Value::from(met)
                ));
            }
            Measure::Service {
                latency: l,
                ops_per_s,
                target_p99_max_ns,
                extra,
                ..
            } => {
                s.push_str(&format!(
                    ",\"median_ns\":{},\"p99_ns\":{},\"min_ns\":{},\"mean_ns\":{},\"ops\":{}",
                    l.median_ns, l.p99_ns, l.min_ns, l.mean_ns, l.iters
                ));
                if let Some(o) = ops_per_s {
                    s.push_str(&format!(",\"ops_per_s\":{o}"));
                }
                for (key, value) in extra {
                    s.push_str(&format!(",{}:{value}", serde_json::Value::from(*key)));
                }
                if let Some(max) = target_p99_max_ns {
                    s.push_str(&format!(
                        ",\"target_p99_max_ns\":{max},\"meets_target\":{}",
                        serde_json::Value::from(met)
                    ));
                }
            }
        }
        if let Some(sp) = self.spread {
            s.push_str(&format!(
                ",\"rounds\":{},\"spread\":{}",
                sp.rounds,
                serde_json::Value::from((sp.worst_over_best * 1000.0).round() / 1000.0)
            ));
        }
        if let Some(pr) = self.per_round {
            s.push_str(&format!(
                ",\"rounds\":{},\"rounds_met\":{},\"worst_round\":{},\"median_round\":{}",
                pr.rounds,
                pr.met,
                serde_json::Value::from((pr.worst * 1000.0).round() / 1000.0),
                serde_json::Value::from((pr.median * 1000.0).round() / 1000.0)
            ));
        }
        s.push('}');
        s
    }

    fn to_table_line(&self) -> String {
        if let Some(point) = &self.service {
            return self.to_service_line(point);
        }
        let dash = || "-".to_owned();
        let (median, p99, bandwidth, note) = match &self.measure {
            Measure::Latency(l) => (micros(l.median_ns), micros(l.p99_ns), dash(), None),
            Measure::Bandwidth { bytes_per_s, .. } => (dash(), dash(), rate(*bytes_per_s), None),
            Measure::Rate { per_s, .. } => (dash(), dash(), calls_per_s(*per_s), None),
            Measure::Difference {
                median_ns,
                of,
                target_max_ns,
            } => {
                let target = target_max_ns.map(|t| format!(", target <= {} µs", micros(t)));
                let note = format!("{of}{}", target.unwrap_or_default());
                (signed_micros(*median_ns), dash(), dash(), Some(note))
            }
            Measure::Ratio {
                ratio,
                of,
                target_min,
                target_max,
            } => ratio_cells(*ratio, of, *target_min, *target_max),
            Measure::Service {
                latency, ops_per_s, ..
            } => (
                micros(latency.median_ns),
                micros(latency.p99_ns),
                ops_per_s.map_or_else(dash, calls_per_s),
                None,
            ),
        };
        let mut line = format!(
            "{:<28} {:<12} {:>9} {:>12} {:>12} {:>12}",
            self.name,
            self.provider,
            match self.size {
                // Rows with no message size (the database rows).
                0 => dash(),
                n => size(n),
            },
            median,
            p99,
            bandwidth
        );
        let mut point: Vec<String> = self
            .params
            .iter()
            .map(|(key, value)| format!("{key} {value}"))
            .collect();
        if self.in_flight > 0 {
            point.insert(0, format!("{} in flight", self.in_flight));
        }
        let in_flight = (!point.is_empty()).then(|| point.join(", "));
        let note = match (in_flight, note) {
            (Some(f), Some(n)) => Some(format!("{f}; {n}")),
            (f, n) => f.or(n),
        };
        self.push_note(&mut line, note);
        line
    }

    /// A manager row: backend, replicas and clients instead of provider
    /// and size, and operations per second instead of bandwidth.
    fn to_service_line(&self, point: &ServicePoint) -> String {
        let dash = || "-".to_owned();
        let (median, p99, ops, note) = match &self.measure {
            Measure::Service {
                latency,
                ops_per_s,
                target_p99_max_ns,
                extra,
                ..
            } => {
                let mut notes: Vec<String> =
                    extra.iter().map(|(k, v)| format!("{k} {v}")).collect();
                if let Some(max) = target_p99_max_ns {
                    notes.push(format!("target p99 <= {} ms", millis(*max)));
                }
                (
                    millis(latency.median_ns),
                    millis(latency.p99_ns),
                    ops_per_s.map_or_else(dash, |o| o.to_string()),
                    (!notes.is_empty()).then(|| notes.join(", ")),
                )
            }
            Measure::Ratio {
                ratio,
                of,
                target_min,
                target_max,
            } => ratio_cells(*ratio, of, *target_min, *target_max),
            _ => (dash(), dash(), dash(), None),
        };
        let mut line = format!(
            "{:<28} {:<9} {:>8} {:>7} {:>11} {:>11} {:>10}",
            self.name, point.backend, point.replicas, point.concurrency, median, p99, ops
        );
        self.push_note(&mut line, note);
        line
    }

    /// Appends the note, the spread and the verdict on the target.
    fn push_note(&self, line: &mut String, note: Option<String>) {
        let spread = self
            .spread
            .map(|sp| format!("{} rounds, worst/best {:.2}", sp.rounds, sp.worst_over_best))
            .or_else(|| {
                self.per_round.map(|pr| {
                    let figure = |f: f64| match self.measure {
                        Measure::Difference { .. } => format!("{} µs", signed_micros(f as i64)),
                        _ => format!("x {f:.3}"),
                    };
                    format!(
                        "met in {} of {} rounds, median round {}, worst round {}",
                        pr.met,
                        pr.rounds,
                        figure(pr.median),
                        figure(pr.worst)
                    )
                })
            });
        let note = match (note, spread) {
            (Some(n), Some(sp)) => Some(format!("{n}; {sp}")),
            (n, sp) => n.or(sp),
        };
        if let Some(note) = note {
            let verdict = match self.meets_target() {
                Some(true) => ": met",
                Some(false) => ": MISSED",
                None => "",
            };
            line.push_str(&format!("  ({note}{verdict})"));
        }
    }
}

/// How `row`'s target fared in each round's own derived rows.
fn round_verdict(row: &Row, rounds: &[Vec<Row>]) -> Option<PerRound> {
    let (_, larger_is_worse) = row.derived_figure()?;
    let mut verdict = PerRound {
        rounds: 0,
        met: 0,
        worst: if larger_is_worse { f64::MIN } else { f64::MAX },
        median: 0.0,
    };
    let mut figures = Vec::new();
    for same in rounds
        .iter()
        .flat_map(|r| r.iter().find(|d| d.same_row(row)))
    {
        let Some((figure, _)) = same.derived_figure() else {
            continue;
        };
        figures.push(figure);
        verdict.rounds += 1;
        verdict.met += u32::from(same.meets_target() == Some(true));
        verdict.worst = if larger_is_worse {
            verdict.worst.max(figure)
        } else {
            verdict.worst.min(figure)
        };
    }
    figures.sort_by(f64::total_cmp);
    let n = figures.len();
    if n > 0 {
        verdict.median = (figures[(n - 1) / 2] + figures[n / 2]) / 2.0;
    }
    (verdict.rounds > 1).then_some(verdict)
}

fn service_header() -> String {
    format!(
        "{:<28} {:<9} {:>8} {:>7} {:>11} {:>11} {:>10}",
        "row", "backend", "replicas", "clients", "median ms", "p99 ms", "ops/s"
    )
}

fn header() -> String {
    format!(
        "{:<28} {:<12} {:>9} {:>12} {:>12} {:>12}",
        "row", "provider", "size", "median µs", "p99 µs", "bandwidth"
    )
}

/// Where rows go.
#[derive(Debug)]
pub struct Report {
    json: bool,
    header_written: bool,
    rounds: usize,
    /// The best of each row so far, in first-seen order, with the figure
    /// of every round.
    best: Vec<Kept>,
    /// Every round's rows, for the derived rows' per-round check.
    round_rows: Vec<Vec<Row>>,
}

#[derive(Debug)]
struct Kept {
    best: Row,
    figures: Vec<f64>,
}

impl Kept {
    /// The best round, with the spread of all of them.
    fn row(&self) -> Row {
        let mut row = self.best.clone();
        let (lo, hi) = self
            .figures
            .iter()
            .fold((f64::INFINITY, 0f64), |(lo, hi), &f| (lo.min(f), hi.max(f)));
        if self.figures.len() > 1 && lo > 0.0 {
            row.spread = Some(Spread {
                rounds: self.figures.len() as u32,
                worst_over_best: hi / lo,
            });
        }
        row
    }
}

impl Row {
    /// Whether `self` is a better measurement than `other` of the same row.
    fn beats(&self, other: &Row) -> bool {
        match (&self.measure, &other.measure) {
            (Measure::Latency(a), Measure::Latency(b)) => a.median_ns < b.median_ns,
            (
                Measure::Bandwidth { bytes_per_s: a, .. },
                Measure::Bandwidth { bytes_per_s: b, .. },
            ) => a > b,
            (Measure::Rate { per_s: a, .. }, Measure::Rate { per_s: b, .. }) => a > b,
            (Measure::Service { best, .. }, Measure::Service { .. }) => {
                match (self.figure(), other.figure()) {
                    (Some(a), Some(b)) if *best == Best::MostOps => a > b,
                    (Some(a), Some(b)) => a < b,
                    _ => false,
                }
            }
            _ => false,
        }
    }
}

impl Report {
    pub fn new(json: bool, rounds: usize) -> Self {
        Self {
            json,
            header_written: false,
            rounds,
            best: Vec::new(),
            round_rows: Vec::new(),
        }
    }

    /// Marks the start of a round: rows pushed from here on are its own.
    pub fn start_round(&mut self) {
        self.round_rows.push(Vec::new());
    }

    /// Keeps `row` if it is its row's best so far, and prints it now when
    /// there is one round.
    pub fn push(&mut self, row: &Row) -> Result<()> {
        if let Some(round) = self.round_rows.last_mut() {
            round.push(row.clone());
        }
        let figure = row.figure();
        match self.best.iter_mut().find(|k| k.best.same_row(row)) {
            Some(kept) => {
                kept.figures.extend(figure);
                if row.beats(&kept.best) {
                    kept.best = row.clone();
                }
            }
            None => self.best.push(Kept {
                best: row.clone(),
                figures: figure.into_iter().collect(),
            }),
        }
        if self.rounds > 1 {
            return Ok(());
        }
        self.print(row)
    }

    /// Prints the best round of every row (several rounds only).
    pub fn finish(&mut self) -> Result<()> {
        self.finish_with(|_| Vec::new())
    }

    /// As [`finish`](Self::finish), then prints the rows `derive` makes
    /// from the best round of every row; with several rounds, each derived
    /// row with a target also says in how many rounds that target held on
    /// the round's own rows, and the worst round's figure.
    pub fn finish_with(&mut self, derive: impl Fn(&[Row]) -> Vec<Row>) -> Result<()> {
        let best = self.rows();
        if self.rounds > 1 {
            for row in &best {
                self.print(row)?;
            }
        }
        let per_round: Vec<Vec<Row>> = match self.round_rows.len() {
            0 | 1 => Vec::new(),
            _ => self.round_rows.iter().map(|r| derive(r)).collect(),
        };
        for mut row in derive(&best) {
            row.per_round = round_verdict(&row, &per_round);
            self.print(&row)?;
        }
        self.best.clear();
        self.round_rows.clear();
        Ok(())
    }

    /// The best round of each row so far, with its spread.
    pub fn rows(&self) -> Vec<Row> {
        self.best.iter().map(Kept::row).collect()
    }

    fn print(&mut self, row: &Row) -> Result<()> {
        self.write(row)
            .context(|| format!("could not print the result of row {}", row.name))
    }

    fn write(&mut self, row: &Row) -> io::Result<()> {
        let mut table: Box<dyn Write> = if self.json {
            Box::new(io::stderr().lock())
        } else {
            Box::new(io::stdout().lock())
        };
        if !self.header_written {
            let header = match row.service {
                Some(_) => service_header(),
                None => header(),
            };
            writeln!(table, "{header}")?;
            self.header_written = true;
        }
        writeln!(table, "{}", row.to_table_line())?;
        table.flush()?;
        if self.json {
            let mut out = io::stdout().lock();
            writeln!(out, "{}", row.to_json())?;
            out.flush()?;
        }
        Ok(())
    }
}

fn micros(ns: u64) -> String {
    format!("{:.2}", ns as f64 / 1000.0)
}

fn millis(ns: u64) -> String {
    format!("{:.3}", ns as f64 / 1e6)
}

fn signed_micros(ns: i64) -> String {
    format!("{:.2}", ns as f64 / 1000.0)
}

fn rate(bytes_per_s: u64) -> String {
    let b = bytes_per_s as f64;
    if b >= 1e9 {
        format!("{:.2} GB/s", b / 1e9)
    } else {
        format!("{:.1} MB/s", b / 1e6)
    }
}

fn calls_per_s(per_s: u64) -> String {
    let r = per_s as f64;
    if r >= 1e6 {
        format!("{:.2} M/s", r / 1e6)
    } else {
        format!("{:.1} k/s", r / 1e3)
    }
}

fn size(bytes: u64) -> String {
    const KIB: u64 = 1024;
    const MIB: u64 = 1024 * 1024;
    match bytes {
        b if b >= MIB && b % MIB == 0 => format!("{} MiB", b / MIB),
        b if b >= KIB && b % KIB == 0 => format!("{} KiB", b / KIB),
        b => format!("{b} B"),
    }
}

/// A ratio row's cells in a table: no latency, the ratio, and what it is
/// of with its target.
fn ratio_cells(
    ratio: f64,
    of: &str,
    target_min: Option<f64>,
    target_max: Option<f64>,
) -> (String, String, String, Option<String>) {
    let mut note = of.to_owned();
    if let Some(t) = target_min {
        note.push_str(&format!(", target >= {t}"));
    }
    if let Some(t) = target_max {
        note.push_str(&format!(", target <= {t}"));
    }
    (
        "-".to_owned(),
        "-".to_owned(),
        format!("x {ratio:.2}"),
        Some(note),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn several_rounds_keep_each_rows_best() {
        let lat = |median| {
            let mut samples = vec![median; 3];
            Row::latency("pingpong", "tcp", 64, Summary::of(&mut samples).unwrap())
        };
        let bw = |bytes: u64| {
            Row::bandwidth(
                "bandwidth",
                "tcp",
                64,
                bytes,
                std::time::Duration::from_secs(1),
            )
        };
        let mut report = Report::new(true, 3);
        for row in [lat(900), bw(10), lat(700), bw(30), lat(800), bw(20)] {
            report.push(&row).unwrap();
        }
        let rows = report.rows();
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[0].measure, lat(700).measure);
        assert_eq!(rows[1].measure, bw(30).measure);
        let spread = |r: &Row| r.spread.unwrap();
        assert_eq!(spread(&rows[0]).rounds, 3);
        assert!((spread(&rows[0]).worst_over_best - 900.0 / 700.0).abs() < 1e-9);
        assert!((spread(&rows[1]).worst_over_best - 3.0).abs() < 1e-9);
        assert!(
            rows[0]
                .to_json()
                .ends_with(r#","rounds":3,"spread":1.286}"#),
            "{}",
            rows[0].to_json()
        );
    }

    #[test]
    fn latency_row_json_has_exactly_the_latency_keys() {
        let summary = Summary {
            median_ns: 1500,
            p99_ns: 4000,
            min_ns: 1200,
            mean_ns: 1600,
            iqm_ns: 1550,
            iters: 10,
        };
        let row = Row::latency("raw_tcp_pingpong", "tcp", 64, summary);
        assert_eq!(
            row.to_json(),
            r#"{"name":"raw_tcp_pingpong","provider":"tcp","size":64,"median_ns":1500,"p99_ns":4000,"min_ns":1200,"mean_ns":1600,"iqm_ns":1550,"iters":10}"#
        );
        let parsed: serde_json::Value = serde_json::from_str(&row.to_json()).unwrap();
        assert_eq!(parsed.as_object().unwrap().len(), 9);
    }

    #[test]
    fn bandwidth_row_json_has_exactly_the_bandwidth_keys() {
        let row = Row::bandwidth(
            "memcpy_bandwidth",
            "mem",
            1 << 20,
            1 << 30,
            std::time::Duration::from_millis(500),
        );
        assert_eq!(
            row.to_json(),
            r#"{"name":"memcpy_bandwidth","provider":"mem","size":1048576,"bytes_per_s":2147483648,"bytes":1073741824}"#
        );
    }

    #[test]
    fn rate_rows_differ_by_what_is_in_flight() {
        let rate = |in_flight, calls| {
            Row::rate(
                "hot_noop_rate",
                "shm",
                64,
                in_flight,
                calls,
                std::time::Duration::from_millis(500),
            )
        };
        assert_eq!(
            rate(4, 1000).to_json(),
            r#"{"name":"hot_noop_rate","provider":"shm","size":64,"in_flight":4,"per_s":2000,"calls":1000}"#
        );
        let mut report = Report::new(true, 2);
        for row in [rate(1, 100), rate(4, 300), rate(1, 200), rate(4, 400)] {
            report.push(&row).unwrap();
        }
        let rows = report.rows();
        assert_eq!(rows.len(), 2, "{rows:?}");
        assert_eq!((rows[0].in_flight, rows[1].in_flight), (1, 4));
        assert!(matches!(rows[0].measure, Measure::Rate { per_s: 400, .. }));
        assert!((rows[1].spread.unwrap().worst_over_best - 4.0 / 3.0).abs() < 1e-9);
    }

    #[test]
    fn rows_at_other_params_are_other_rows() {
        let adds = |initiators, calls| {
            Row::rate(
                "billing_adds",
                "tcp",
                8,
                16,
                calls,
                std::time::Duration::from_secs(1),
            )
            .with("initiators", initiators)
        };
        assert_eq!(
            adds(4, 1000).to_json(),
            r#"{"name":"billing_adds","provider":"tcp","size":8,"in_flight":16,"initiators":4,"per_s":1000,"calls":1000}"#
        );
        assert!(adds(4, 1000)
            .to_table_line()
            .contains("(16 in flight, initiators 4)"));
        let mut report = Report::new(true, 2);
        for row in [adds(1, 100), adds(4, 300), adds(1, 200), adds(4, 250)] {
            report.push(&row).unwrap();
        }
        let rows = report.rows();
        assert_eq!(rows.len(), 2, "{rows:?}");
        assert!(matches!(rows[0].measure, Measure::Rate { per_s: 200, .. }));
        assert!(matches!(rows[1].measure, Measure::Rate { per_s: 300, .. }));
        // A row without a message size prints none.
        let flush = Row::rate(
            "billing_flush",
            "postgres",
            0,
            0,
            100,
            std::time::Duration::from_secs(1),
        )
        .with("slots", 4096);
        let line = flush.to_table_line();
        assert!(line.contains("postgres") && !line.contains("0 B"), "{line}");
    }

    #[test]
    fn service_rows_name_their_database_and_keep_the_best_by_their_figure() {
        let row = |name: &str, median: u64, p99: u64, ops: Option<u64>, best| {
            let mut samples = vec![median, median, p99];
            let latency = Summary::of(&mut samples).unwrap();
            Row::service(
                name,
                ServicePoint {
                    backend: "postgres".into(),
                    replicas: 3,
                    concurrency: 4,
                },
                Measure::Service {
                    latency,
                    ops_per_s: ops,
                    best,
                    target_p99_max_ns: (best == Best::LowestP99).then_some(5_000_000),
                    extra: vec![("offered_per_s", 100)],
                },
            )
        };
        assert_eq!(
            row(
                "lease_grant_paced",
                1_000_000,
                4_000_000,
                Some(99),
                Best::LowestP99
            )
            .to_json(),
            r#"{"name":"lease_grant_paced","backend":"postgres","replicas":3,"concurrency":4,"median_ns":1000000,"p99_ns":4000000,"min_ns":1000000,"mean_ns":2000000,"ops":3,"ops_per_s":99,"offered_per_s":100,"target_p99_max_ns":5000000,"meets_target":true}"#
        );
        let mut report = Report::new(true, 3);
        for (median, p99, ops) in [(3, 9, 100), (1, 20, 300), (2, 7, 200)] {
            report
                .push(&row("lease_grant", median, p99, Some(ops), Best::MostOps))
                .unwrap();
            report
                .push(&row(
                    "lease_grant_paced",
                    median,
                    p99,
                    Some(ops),
                    Best::LowestP99,
                ))
                .unwrap();
        }
        let rows = report.rows();
        assert_eq!(rows.len(), 2, "{rows:?}");
        let ops = |r: &Row| match &r.measure {
            Measure::Service {
                ops_per_s, latency, ..
            } => (ops_per_s.unwrap(), latency.p99_ns),
            _ => unreachable!(),
        };
        assert_eq!(ops(&rows[0]), (300, 20));
        assert_eq!(ops(&rows[1]), (200, 7));
        assert!((rows[0].spread.unwrap().worst_over_best - 3.0).abs() < 1e-9);
        assert!((rows[1].spread.unwrap().worst_over_best - 20.0 / 7.0).abs() < 1e-9);
        assert_eq!(rows[1].meets_target(), Some(true));
    }

    #[test]
    fn derived_targets_are_checked_round_by_round() {
        let ratio =
            |r: f64| Row::ratio("b_over_a", "tcp", 64, r, "b / a".into(), None).at_most(1.02);
        let diff = |ns: i64| Row::difference("overhead", "shm", 64, ns, "b - a".into(), Some(300));
        let rounds = vec![
            vec![ratio(1.01), diff(250)],
            vec![ratio(1.05), diff(310)],
            vec![ratio(0.99), diff(200)],
        ];
        // The best rounds' row met its target; one round of three did not.
        let v = round_verdict(&ratio(1.0), &rounds).unwrap();
        assert_eq!((v.rounds, v.met), (3, 2));
        assert!((v.worst - 1.05).abs() < 1e-9);
        assert!((v.median - 1.01).abs() < 1e-9);
        let v = round_verdict(&diff(200), &rounds).unwrap();
        assert_eq!((v.rounds, v.met, v.worst, v.median), (3, 2, 310.0, 250.0));
        // A lower bound: the smallest ratio is the worst.
        let min = |r: f64| Row::ratio("x", "tcp", 64, r, "x".into(), Some(0.9));
        let v = round_verdict(&min(0.95), &[vec![min(0.95)], vec![min(0.85)]]).unwrap();
        assert_eq!((v.rounds, v.met, v.worst), (2, 1, 0.85));
        assert!((v.median - 0.9).abs() < 1e-9, "the mean of the middle two");
        // No target, or a single round: nothing to say.
        let none = Row::ratio("y", "tcp", 64, 1.0, "y".into(), None);
        assert_eq!(
            round_verdict(&none, &[vec![none.clone()], vec![none.clone()]]),
            None
        );
        assert_eq!(round_verdict(&diff(1), &rounds[..1]), None);
        let mut row = ratio(1.0);
        row.per_round = round_verdict(&row, &rounds);
        let json: serde_json::Value = serde_json::from_str(&row.to_json()).unwrap();
        assert_eq!(
            (json["rounds"].as_u64(), json["rounds_met"].as_u64()),
            (Some(3), Some(2))
        );
        assert_eq!(json["worst_round"], 1.05);
        assert_eq!(json["median_round"], 1.01);
        assert!(row
            .to_table_line()
            .contains("met in 2 of 3 rounds, median round x 1.010, worst round x 1.050"));
    }

    #[test]
    fn names_are_json_escaped() {
        let row = Row::bandwidth(
            "a\"b",
            "verbs:rxe0",
            1,
            1,
            std::time::Duration::from_secs(1),
        );
        let parsed: serde_json::Value = serde_json::from_str(&row.to_json()).unwrap();
        assert_eq!(parsed["name"], "a\"b");
    }

    #[test]
    fn table_units() {
        assert_eq!(micros(1234), "1.23");
        assert_eq!(rate(2_500_000_000), "2.50 GB/s");
        assert_eq!(rate(750_000_000), "750.0 MB/s");
        assert_eq!(size(4096), "4 KiB");
        assert_eq!(size(5 << 20), "5 MiB");
        assert_eq!(size(64), "64 B");
    }
}

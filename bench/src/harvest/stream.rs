//! The seeded job stream both runs replay: Poisson arrivals, mixed sizes
//! (one CPU to every node) and lengths (log-uniform between two bounds,
//! so many short jobs and a few long ones).
//!
//! The same seed and flags give the same stream, job for job, so the run
//! with the plugin and the run without it see the same jobs at the same
//! offsets.

use std::time::Duration;

/// What the stream is made of.
#[derive(Debug, Clone, PartialEq)]
pub struct StreamSpec {
    pub seed: u64,
    pub jobs: usize,
    /// Nodes of the cluster and CPUs of each.
    pub nodes: u32,
    pub cpus: u32,
    /// Shortest and longest job, seconds.
    pub min_seconds: f64,
    pub max_seconds: f64,
    /// The core-seconds offered per second of arrivals, as a share of the
    /// cluster's cores (0.6: on average the jobs ask for 60 % of it).
    pub load: f64,
}

/// How much of the cluster one job asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Size {
    /// CPUs on one node, fewer than all of it.
    Cpus(u32),
    /// Whole nodes (`--exclusive`).
    Nodes(u32),
}

/// One job of the stream.
#[derive(Debug, Clone, PartialEq)]
pub struct JobSpec {
    /// Its place in the stream, from 0.
    pub index: usize,
    /// When it is submitted, from the stream's start.
    pub arrival: Duration,
    pub size: Size,
    /// How long its script sleeps.
    pub seconds: f64,
}

/// The size classes and how often each comes, in percent: a third of the
/// jobs one CPU, a fifth two, the rest whole nodes (one to all of them).
const CLASSES: &[(u32, SizeClass)] = &[
    (35, SizeClass::Cpus(1)),
    (20, SizeClass::Cpus(2)),
    (25, SizeClass::Nodes(1)),
    (12, SizeClass::Nodes(2)),
    (5, SizeClass::Nodes(3)),
    (3, SizeClass::AllNodes),
];

#[derive(Debug, Clone, Copy)]
enum SizeClass {
    Cpus(u32),
    Nodes(u32),
    AllNodes,
}

impl SizeClass {
    /// The class on a cluster of `nodes` x `cpus`: CPU counts that fill a
    /// node become a whole node, node counts are capped at the cluster's.
    fn on(self, nodes: u32, cpus: u32) -> Size {
        match self {
            SizeClass::Cpus(c) if c < cpus => Size::Cpus(c),
            SizeClass::Cpus(_) => Size::Nodes(1),
            SizeClass::Nodes(n) => Size::Nodes(n.min(nodes)),
            SizeClass::AllNodes => Size::Nodes(nodes),
        }
    }
}

impl Size {
    /// CPUs of the whole job on nodes of `cpus` CPUs.
    pub fn cores(self, cpus: u32) -> u32 {
        match self {
            Size::Cpus(c) => c,
            Size::Nodes(n) => n * cpus,
        }
    }

    /// The sbatch arguments that ask for it.
    pub fn sbatch_args(self) -> Vec<String> {
        match self {
            Size::Cpus(c) => vec!["-N1".into(), format!("-n{c}")],
            Size::Nodes(n) => vec![format!("-N{n}"), "--exclusive".into()],
        }
    }
}

impl StreamSpec {
    /// Checks the numbers; the error says which flag to change.
    pub fn check(&self) -> Result<(), String> {
        if self.jobs == 0 {
            return Err("--jobs must be at least 1".into());
        }
        if self.nodes == 0 || self.cpus == 0 {
            return Err("--nodes and --cpus must be at least 1".into());
        }
        if !(self.min_seconds >= 0.1 && self.max_seconds >= self.min_seconds) {
            return Err(format!(
                "job lengths {}..{} s: give --min-seconds of at least 0.1 and --max-seconds not below it",
                self.min_seconds, self.max_seconds
            ));
        }
        if !(self.load > 0.0 && self.load <= 4.0) {
            return Err(format!(
                "--load {}: give a share of the cluster's cores above 0 (1.0: all of them)",
                self.load
            ));
        }
        Ok(())
    }

    /// The mean length of a job, seconds (log-uniform between the bounds).
    pub fn mean_seconds(&self) -> f64 {
        let (lo, hi) = (self.min_seconds, self.max_seconds);
        if hi - lo < 1e-9 {
            lo
        } else {
            (hi - lo) / (hi / lo).ln()
        }
    }

    /// The mean CPUs of a job.
    pub fn mean_cores(&self) -> f64 {
        let total: u32 = CLASSES.iter().map(|(w, _)| w).sum();
        CLASSES
            .iter()
            .map(|(w, c)| f64::from(*w) * f64::from(c.on(self.nodes, self.cpus).cores(self.cpus)))
            .sum::<f64>()
            / f64::from(total)
    }

    /// Jobs per second that make the asked load.
    pub fn arrival_rate(&self) -> f64 {
        self.load * f64::from(self.nodes * self.cpus) / (self.mean_cores() * self.mean_seconds())
    }

    /// The stream: the same for the same spec.
    pub fn generate(&self) -> Vec<JobSpec> {
        let mut rng = fastrand::Rng::with_seed(self.seed);
        let rate = self.arrival_rate();
        let total: u32 = CLASSES.iter().map(|(w, _)| w).sum();
        let mut at = 0.0f64;
        (0..self.jobs)
            .map(|index| {
                // The first job comes at once; then exponential gaps.
                if index > 0 {
                    at += -(1.0 - rng.f64()).ln() / rate;
                }
                let mut pick = rng.u32(0..total);
                let class = CLASSES
                    .iter()
                    .find(|(w, _)| {
                        let hit = pick < *w;
                        pick = pick.saturating_sub(*w);
                        hit
                    })
                    .map_or(SizeClass::Cpus(1), |(_, c)| *c);
                let (lo, hi) = (self.min_seconds, self.max_seconds);
                let seconds = lo * (hi / lo).powf(rng.f64());
                JobSpec {
                    index,
                    arrival: Duration::from_secs_f64(at),
                    size: class.on(self.nodes, self.cpus),
                    // Milliseconds are what `sleep` is given.
                    seconds: (seconds * 1000.0).round() / 1000.0,
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(seed: u64) -> StreamSpec {
        StreamSpec {
            seed,
            jobs: 2000,
            nodes: 4,
            cpus: 4,
            min_seconds: 0.5,
            max_seconds: 10.0,
            load: 0.6,
        }
    }

    #[test]
    fn the_same_seed_gives_the_same_stream_and_another_another() {
        assert_eq!(spec(7).generate(), spec(7).generate());
        assert_ne!(spec(7).generate(), spec(8).generate());
    }

    #[test]
    fn jobs_stay_within_their_bounds_and_every_class_comes() {
        let s = spec(1);
        let jobs = s.generate();
        assert_eq!(jobs.len(), 2000);
        assert_eq!(jobs[0].arrival, Duration::ZERO);
        for pair in jobs.windows(2) {
            assert!(pair[0].arrival <= pair[1].arrival, "{pair:?}");
        }
        for j in &jobs {
            assert!((0.5..=10.0).contains(&j.seconds), "{j:?}");
            match j.size {
                Size::Cpus(c) => assert!((1..4).contains(&c), "{j:?}"),
                Size::Nodes(n) => assert!((1..=4).contains(&n), "{j:?}"),
            }
        }
        for size in [
            Size::Cpus(1),
            Size::Cpus(2),
            Size::Nodes(1),
            Size::Nodes(2),
            Size::Nodes(3),
            Size::Nodes(4),
        ] {
            assert!(jobs.iter().any(|j| j.size == size), "no {size:?}");
        }
        // Poisson arrivals at the asked rate: the mean gap is within a few
        // percent of 1/rate over 2000 jobs.
        let mean_gap = jobs[1999].arrival.as_secs_f64() / 1999.0;
        let expected = 1.0 / s.arrival_rate();
        assert!(
            (mean_gap / expected - 1.0).abs() < 0.1,
            "mean gap {mean_gap} s, expected {expected} s"
        );
        let mean_len = jobs.iter().map(|j| j.seconds).sum::<f64>() / 2000.0;
        assert!(
            (mean_len / s.mean_seconds() - 1.0).abs() < 0.1,
            "{mean_len}"
        );
    }

    #[test]
    fn sizes_fit_small_clusters() {
        assert_eq!(SizeClass::Cpus(2).on(4, 2), Size::Nodes(1));
        assert_eq!(SizeClass::Nodes(3).on(2, 4), Size::Nodes(2));
        assert_eq!(SizeClass::AllNodes.on(3, 4), Size::Nodes(3));
        assert_eq!(Size::Nodes(2).cores(4), 8);
        assert_eq!(Size::Cpus(2).sbatch_args(), ["-N1", "-n2"]);
        assert_eq!(Size::Nodes(2).sbatch_args(), ["-N2", "--exclusive"]);
    }

    #[test]
    fn bad_numbers_are_refused_with_the_flag_to_change() {
        let mut s = spec(1);
        s.jobs = 0;
        assert!(s.check().unwrap_err().contains("--jobs"));
        let mut s = spec(1);
        s.max_seconds = 0.2;
        assert!(s.check().unwrap_err().contains("--max-seconds"));
        let mut s = spec(1);
        s.load = 0.0;
        assert!(s.check().unwrap_err().contains("--load"));
        assert_eq!(spec(1).check(), Ok(()));
    }
}

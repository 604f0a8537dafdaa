//! Latency samples in nanoseconds -> median, p99, min, mean, and the
//! interquartile mean.

use std::time::Instant;

use crate::error::Result;

/// Summary of one latency row. Percentiles are nearest-rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Summary {
    pub median_ns: u64,
    pub p99_ns: u64,
    pub min_ns: u64,
    pub mean_ns: u64,
    /// The mean of the middle half of the samples (from the 25th to the
    /// 75th percentile): as robust as the median against a round's
    /// outliers, but finer than the clock's steps (about 10 ns here), which
    /// every median falls on.
    pub iqm_ns: u64,
    pub iters: u64,
}

impl Summary {
    /// Sorts `samples` in place. `None` when there are none.
    pub fn of(samples: &mut [u64]) -> Option<Self> {
        if samples.is_empty() {
            return None;
        }
        samples.sort_unstable();
        let n = samples.len();
        let sum: u128 = samples.iter().map(|&s| u128::from(s)).sum();
        Some(Self {
            median_ns: nearest_rank(samples, 50),
            p99_ns: nearest_rank(samples, 99),
            min_ns: samples[0],
            mean_ns: (sum / n as u128) as u64,
            iqm_ns: interquartile_mean(samples),
            iters: n as u64,
        })
    }
}

/// The mean of the sorted samples from the first quarter's end to the
/// third quarter's end (all of them when there are fewer than four).
fn interquartile_mean(sorted: &[u64]) -> u64 {
    let n = sorted.len();
    let middle = if n < 4 {
        sorted
    } else {
        &sorted[n / 4..n - n / 4]
    };
    let sum: u128 = middle.iter().map(|&s| u128::from(s)).sum();
    (sum / middle.len().max(1) as u128) as u64
}

/// The smallest sample with at least `percent` % of the samples at or below it.
fn nearest_rank(sorted: &[u64], percent: usize) -> u64 {
    let rank = (sorted.len() * percent).div_ceil(100).max(1);
    sorted[rank - 1]
}

/// Runs `round_trip` `warmup` times untimed, then `iters` times, timing each
/// call on its own with `Instant` (CLOCK_MONOTONIC).
///
/// Hot path: the samples are allocated before the first timed call, and
/// `round_trip` is inlined into the loop.
pub fn time_round_trips(
    warmup: usize,
    iters: usize,
    mut round_trip: impl FnMut() -> Result<()>,
) -> Result<Summary> {
    for _ in 0..warmup {
        round_trip()?;
    }
    let mut samples = Vec::with_capacity(iters);
    for _ in 0..iters {
        let start = Instant::now();
        round_trip()?;
        samples.push(start.elapsed().as_nanos() as u64);
    }
    Summary::of(&mut samples).ok_or_else(|| {
        crate::error::Error::new("no latency samples were taken; pass --iters 1 or more")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summary_of_one_to_hundred() {
        let mut samples: Vec<u64> = (1..=100).rev().collect();
        let s = Summary::of(&mut samples).unwrap();
        assert_eq!(s.median_ns, 50);
        assert_eq!(s.p99_ns, 99);
        assert_eq!(s.min_ns, 1);
        assert_eq!(s.mean_ns, 50);
        // 26..=75.
        assert_eq!(s.iqm_ns, 50);
        assert_eq!(s.iters, 100);
    }

    #[test]
    fn summary_of_one_sample() {
        let s = Summary::of(&mut [7]).unwrap();
        assert_eq!((s.median_ns, s.p99_ns, s.min_ns, s.mean_ns), (7, 7, 7, 7));
    }

    #[test]
    fn the_interquartile_mean_sees_below_the_clock_step() {
        // 15 of the middle 50 samples a step of 10 above: the median stays
        // on its step, the interquartile mean moves by 3.
        let mut samples = vec![280; 40];
        samples.extend([290; 20]);
        samples.extend([280; 20]);
        samples.extend([5000; 20]);
        let s = Summary::of(&mut samples).unwrap();
        assert_eq!(s.median_ns, 280);
        assert_eq!(s.iqm_ns, 283);
        assert!(s.mean_ns > 1000, "the tail pulls the mean");
    }

    #[test]
    fn summary_of_nothing() {
        assert_eq!(Summary::of(&mut []), None);
    }

    #[test]
    fn p99_picks_the_tail() {
        let mut samples = vec![10; 1000];
        samples[..11].fill(1000);
        let s = Summary::of(&mut samples).unwrap();
        assert_eq!(s.median_ns, 10);
        assert_eq!(s.p99_ns, 1000);
    }
}

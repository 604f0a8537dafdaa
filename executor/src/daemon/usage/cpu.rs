//! The kernel's figure of a worker's CPU time, the one number of
//! [`super`] that user code cannot touch.
//!
//! - With a cgroup per allocation (`cgroup`): its `cpu.stat`
//!   `usage_usec`, every process that ever ran in the group while it was
//!   there (a pooled worker joins at its assignment), read at the end once
//!   the group is empty, so a function's forked children count too.
//! - Otherwise the worker process's CPU clock (`clock_getcpuclockid` and
//!   `clock_gettime`: every thread, live ones and ended ones) while it runs,
//!   and at its end the `wait4` resource usage of it and of the children it
//!   waited for. Under bubblewrap the daemon's child is `bwrap`, and the
//!   live figure adds up the clocks of its descendants.

use std::path::PathBuf;

use crate::daemon::process;

/// Where an allocation's CPU time is read.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(crate) enum CpuSource {
    /// The `cpu.stat` file of the allocation's cgroup.
    Cgroup(PathBuf),
    /// The CPU clock of process `pid`; with `tree`, plus those of its
    /// descendants.
    Process {
        /// The daemon's child.
        pid: u32,
        /// Add the descendants' clocks (the worker runs below `bwrap`).
        tree: bool,
    },
}

impl CpuSource {
    /// CPU nanoseconds now; `None` when the source cannot be read (the
    /// process is gone, the group removed).
    pub(crate) fn read_ns(&self) -> Option<u64> {
        match self {
            CpuSource::Cgroup(stat) => cgroup_usage_ns(&std::fs::read_to_string(stat).ok()?),
            CpuSource::Process { pid, tree: false } => process_cpu_ns(*pid),
            CpuSource::Process { pid, tree: true } => {
                let own = process_cpu_ns(*pid)?;
                Some(
                    process::descendants(*pid)
                        .into_iter()
                        .filter_map(process_cpu_ns)
                        .fold(own, u64::saturating_add),
                )
            }
        }
    }
}

/// Process `pid`'s CPU time (all its threads), ns, from its CPU clock.
pub(crate) fn process_cpu_ns(pid: u32) -> Option<u64> {
    let mut clock: libc::clockid_t = 0;
    // SAFETY: clock is a valid out-pointer.
    if unsafe { libc::clock_getcpuclockid(pid as libc::pid_t, &mut clock) } != 0 {
        return None;
    }
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: ts is a valid out-pointer; a clock of a process that is gone
    // fails with EINVAL, which we report as None.
    if unsafe { libc::clock_gettime(clock, &mut ts) } != 0 {
        return None;
    }
    Some((ts.tv_sec as u64).saturating_mul(1_000_000_000) + ts.tv_nsec as u64)
}

/// `usage_usec` of a cgroup v2 `cpu.stat`, in ns.
pub(crate) fn cgroup_usage_ns(stat: &str) -> Option<u64> {
    stat.lines()
        .find_map(|l| l.strip_prefix("usage_usec "))
        .and_then(|n| n.trim().parse::<u64>().ok())
        .map(|us| us.saturating_mul(1000))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cgroup_usage_is_read_from_cpu_stat() {
        let stat = "usage_usec 1234567\nuser_usec 1000000\nsystem_usec 234567\nnr_periods 0\n";
        assert_eq!(cgroup_usage_ns(stat), Some(1_234_567_000));
        assert_eq!(cgroup_usage_ns("user_usec 5\n"), None);
        assert_eq!(cgroup_usage_ns("usage_usec x\n"), None);
    }

    #[test]
    fn a_process_clock_counts_every_thread_and_ends_with_the_process() {
        let me = std::process::id();
        let before = process_cpu_ns(me).unwrap();
        // Burn 20 ms of CPU on another thread, by its own CPU clock: the
        // process clock sees them.
        std::thread::spawn(|| {
            let thread_ns = || {
                let mut ts = libc::timespec {
                    tv_sec: 0,
                    tv_nsec: 0,
                };
                // SAFETY: ts is a valid out-pointer.
                unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
                ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
            };
            let start = thread_ns();
            while thread_ns() - start < 20_000_000 {
                std::hint::black_box(0u64);
            }
        })
        .join()
        .unwrap();
        let after = CpuSource::Process {
            pid: me,
            tree: false,
        }
        .read_ns()
        .unwrap();
        assert!(after >= before + 20_000_000, "{before} -> {after}");

        let mut child = std::process::Command::new("/bin/true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        assert_eq!(process_cpu_ns(pid), None, "a reaped process has no clock");
        let gone = CpuSource::Cgroup("/nonexistent/cpu.stat".into());
        assert_eq!(gone.read_ns(), None);
    }
}

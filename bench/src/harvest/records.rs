//! What each job of a run did, from three sources: the bench's own
//! submission time, the job script's stamps (`EPOCHREALTIME`, microseconds,
//! written as its first and last lines), and the moment Slurm allocated it,
//! from slurmctld's log.
//!
//! Why the log: `scontrol`'s `StartTime` has whole seconds, and the
//! submission time is no stand-in for the allocation, because slurmctld
//! allocates a batch job at its scheduler's next pass (about half a second
//! after sbatch here, and much later for a job that waits for room).
//! slurmctld logs every allocation as it makes it, to the millisecond
//! (`LogTimeFormat`'s default, `iso8601_ms`):
//!
//! ```text
//! [2026-11-26T02:09:24.572] sched: Allocate JobId=4 NodeList=node1 #CPUs=1 Partition=debug
//! [2026-11-26T02:10:45.631] sched/backfill: _start_job: Started JobId=3 in debug on node1
//! ```
//!
//! With the plugin, its own log (`log=` in plugstack.conf) says when each
//! node's take-back came back from the executor daemon, to the
//! millisecond: the plugin's part of a job's start.

use std::collections::BTreeMap;

use rfaas_proto::hostlist::expand_hostlist;

use super::stream::Size;

/// One job of a run.
#[derive(Debug, Clone, PartialEq)]
pub struct JobRecord {
    /// Its place in the stream.
    pub index: usize,
    /// Slurm's job id.
    pub id: u32,
    pub size: Size,
    /// Unix ns when sbatch returned.
    pub submitted_ns: u64,
    /// Unix ns when slurmctld allocated it (ms resolution), and where.
    pub allocated_ns: Option<u64>,
    pub nodes: Vec<String>,
    /// Unix ns of the script's first and last lines (µs resolution).
    pub started_ns: Option<u64>,
    pub ended_ns: Option<u64>,
    /// With the plugin: unix ns when the last of its nodes' take-backs
    /// came back (ms resolution).
    pub taken_back_ns: Option<u64>,
}

impl JobRecord {
    /// Slurm's allocation to the script's first line.
    pub fn start_delay_ns(&self) -> Option<i64> {
        Some(self.started_ns? as i64 - self.allocated_ns? as i64)
    }

    /// Slurm's allocation to the end of the plugin's take-back.
    pub fn take_back_ns(&self) -> Option<i64> {
        Some(self.taken_back_ns? as i64 - self.allocated_ns? as i64)
    }

    /// CPUs the job holds on each of its nodes, of nodes of `cpus` CPUs.
    pub fn cpus_per_node(&self, cpus: u32) -> u32 {
        match self.size {
            Size::Cpus(c) => c,
            Size::Nodes(_) => cpus,
        }
    }

    /// Whether it held `node`'s CPUs at `t` (from its allocation to its
    /// script's end).
    pub fn holds(&self, node: &str, t: u64) -> bool {
        matches!((self.allocated_ns, self.ended_ns), (Some(a), Some(e)) if a <= t && t < e)
            && self.nodes.iter().any(|n| n == node)
    }
}

/// The job script: both stamps, the sleep between. `$1` is the length,
/// `$2` the stamp file. Bash's `EPOCHREALTIME` costs no process.
pub const JOB_SCRIPT: &str = "#!/bin/bash
t=$EPOCHREALTIME
echo \"start $t\" > \"$2\"
sleep \"$1\"
echo \"end $EPOCHREALTIME\" >> \"$2\"
";

/// `start` and `end` of a stamp file, unix ns.
pub fn parse_stamps(text: &str) -> (Option<u64>, Option<u64>) {
    let mut start = None;
    let mut end = None;
    for line in text.lines() {
        match line.split_once(' ') {
            Some(("start", t)) => start = parse_epoch(t),
            Some(("end", t)) => end = parse_epoch(t),
            _ => {}
        }
    }
    (start, end)
}

/// `1795658958.583513` (or with a comma, as some locales write it) ->
/// unix ns.
fn parse_epoch(s: &str) -> Option<u64> {
    let s = s.trim();
    let (secs, frac) = s.split_once(['.', ',']).unwrap_or((s, ""));
    let secs: u64 = secs.parse().ok()?;
    if frac.len() > 9 || !frac.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let nanos: u64 = if frac.is_empty() {
        0
    } else {
        frac.parse::<u64>().ok()? * 10u64.pow(9 - frac.len() as u32)
    };
    Some(secs * 1_000_000_000 + nanos)
}

/// Every allocation slurmctld logged: job id -> (unix ns, nodes).
pub fn allocations(log: &str) -> BTreeMap<u32, (u64, Vec<String>)> {
    let mut out = BTreeMap::new();
    for line in log.lines() {
        let Some(rest) = line.strip_prefix('[') else {
            continue;
        };
        let Some((stamp, message)) = rest.split_once("] ") else {
            continue;
        };
        let parsed = if let Some(m) = message.strip_prefix("sched: Allocate JobId=") {
            // `4 NodeList=node1 #CPUs=1 Partition=debug`
            let mut words = m.split(' ');
            let id = words.next();
            let nodes = words.find_map(|w| w.strip_prefix("NodeList="));
            id.zip(nodes)
        } else if let Some((_, m)) = message.split_once("Started JobId=") {
            // `3 in debug on node1`
            let id = m.split(' ').next();
            let nodes = m.rsplit_once(" on ").map(|(_, n)| n);
            id.zip(nodes)
        } else {
            None
        };
        let Some((id, nodes)) = parsed else {
            continue;
        };
        let (Ok(id), Some(at), Some(nodes)) = (
            id.parse::<u32>(),
            parse_log_time(stamp),
            expand_hostlist(nodes),
        ) else {
            continue;
        };
        out.entry(id).or_insert((at, nodes));
    }
    out
}

/// When each job's take-backs came back, from the plugin's log: job id ->
/// unix ns of its last node's line. Lines look like
/// `1795659679.982 pid=29155 info job 4 on node2: take 2 CPUs back from
/// rfaas: ...`, or `... error job 4 on node2: could not take ...` when the
/// plugin failed open.
pub fn take_backs(log: &str) -> BTreeMap<u32, u64> {
    let mut out = BTreeMap::new();
    for line in log.lines() {
        let mut words = line.splitn(4, ' ');
        let (Some(time), Some(_pid), Some(_level), Some(rest)) =
            (words.next(), words.next(), words.next(), words.next())
        else {
            continue;
        };
        let Some((job, what)) = rest
            .strip_prefix("job ")
            .and_then(|r| r.split_once(" on "))
            .and_then(|(id, r)| Some((id, r.split_once(": ")?.1)))
        else {
            continue;
        };
        if !(what.starts_with("take ") || what.starts_with("could not take ")) {
            continue;
        }
        let (Ok(job), Some(at)) = (job.parse::<u32>(), parse_epoch(time)) else {
            continue;
        };
        let last = out.entry(job).or_insert(at);
        *last = (*last).max(at);
    }
    out
}

/// `2026-11-26T02:09:24.572`, local time as slurmctld wrote it (it
/// inherited the bench's `TZ`) -> unix ns.
fn parse_log_time(s: &str) -> Option<u64> {
    let (date, time) = s.split_once('T')?;
    let mut d = date.split('-').map(|p| p.parse::<i32>().ok());
    let (year, month, day) = (d.next()??, d.next()??, d.next()??);
    let (hms, ms) = time.split_once('.').unwrap_or((time, "0"));
    let mut t = hms.split(':').map(|p| p.parse::<i32>().ok());
    let (hour, minute, second) = (t.next()??, t.next()??, t.next()??);
    let ms: u64 = ms.parse().ok()?;
    if ms > 999 || !(1..=12).contains(&month) {
        return None;
    }
    let secs = rfaas_accounting::report::time::from_local(year, month, day, hour, minute, second)?;
    (secs >= 0).then(|| secs as u64 * 1_000_000_000 + ms * 1_000_000)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stamps_in_both_locales_and_partial_files() {
        assert_eq!(
            parse_stamps("start 1795658958.583513\nend 1795658959.1\n"),
            (
                Some(1_795_658_958_583_513_000),
                Some(1_795_658_959_100_000_000)
            )
        );
        assert_eq!(
            parse_stamps("start 1795658958,000007\n"),
            (Some(1_795_658_958_000_007_000), None)
        );
        assert_eq!(parse_stamps("start x\nend\n"), (None, None));
        assert_eq!(parse_stamps(""), (None, None));
    }

    #[test]
    fn allocations_from_the_main_scheduler_and_from_backfill() {
        let log = "\
[2026-11-26T02:09:15.628] _slurm_rpc_submit_batch_job: JobId=1 InitPrio=4294901759 usec=909
[2026-11-26T02:09:18.559] sched: Allocate JobId=1 NodeList=node1 #CPUs=2 Partition=debug
[2026-11-26T02:09:18.560] sched: Allocate JobId=2 NodeList=node[2-3] #CPUs=8 Partition=debug
[2026-11-26T02:10:45.631] sched/backfill: _start_job: Started JobId=3 in debug on node1
[2026-11-26T02:10:45.700] sched: Allocate JobId=1 NodeList=node4 #CPUs=2 Partition=debug
[broken line
";
        let a = allocations(log);
        assert_eq!(a.len(), 3, "{a:?}");
        assert_eq!(a[&2].1, ["node2", "node3"]);
        assert_eq!(a[&3].1, ["node1"]);
        // The first allocation of a job counts.
        assert_eq!(a[&1].1, ["node1"]);
        assert_eq!(a[&2].0 - a[&1].0, 1_000_000);
        assert_eq!(a[&3].0 - a[&1].0, (87 * 1000 + 72) * 1_000_000);
    }

    #[test]
    fn take_backs_from_the_plugins_log() {
        let log = "\
1795659679.982 pid=29155 info job 4 on node2: take 2 CPUs back from rfaas: taken back for Slurm job 4: CPUs 1-2 withheld
1795659679.997 pid=29170 info job 1 on node1: take 4 CPUs back from rfaas: drained
1795659680.010 pid=29171 info job 1 on node2: take 4 CPUs back from rfaas: drained
1795659680.572 pid=29296 info job 4 on node2: offer the idle CPUs to rfaas: Slurm job 4 ended
1795659681.000 pid=29300 error job 5 on node3: could not take 1 CPU back from rfaas: no executor daemon socket; the job starts anyway (fail open)
1795659681.000 pid=29300 info job 6: rfaas environment set
";
        let t = take_backs(log);
        assert_eq!(t.len(), 3, "{t:?}");
        assert_eq!(t[&4], 1_795_659_679_982_000_000);
        assert_eq!(t[&1], 1_795_659_680_010_000_000, "the last node's");
        assert_eq!(t[&5], 1_795_659_681_000_000_000);
    }

    #[test]
    fn log_times_are_local_times() {
        let t = parse_log_time("2026-11-26T02:09:18.559").unwrap();
        // SAFETY: `tm` is plain data; all zeroes is a valid value.
        let mut tm: libc::tm = unsafe { std::mem::zeroed() };
        let secs = (t / 1_000_000_000) as libc::time_t;
        // SAFETY: both pointers are valid for the call.
        unsafe { libc::localtime_r(&secs, &mut tm) };
        assert_eq!(
            (tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday, tm.tm_hour),
            (2026, 11, 26, 2)
        );
        assert_eq!(t % 1_000_000_000, 559_000_000);
        assert_eq!(parse_log_time("2026-13-26T02:09:18.559"), None);
        assert_eq!(parse_log_time("yesterday"), None);
    }

    #[test]
    fn a_job_holds_its_nodes_from_allocation_to_end() {
        let job = JobRecord {
            index: 0,
            id: 1,
            size: Size::Cpus(2),
            submitted_ns: 0,
            allocated_ns: Some(100),
            nodes: vec!["node1".into()],
            started_ns: Some(120),
            ended_ns: Some(500),
            taken_back_ns: Some(110),
        };
        assert_eq!(job.take_back_ns(), Some(10));
        assert_eq!(job.start_delay_ns(), Some(20));
        assert!(job.holds("node1", 100) && job.holds("node1", 499));
        assert!(!job.holds("node1", 500) && !job.holds("node2", 200));
        assert_eq!(job.cpus_per_node(4), 2);
    }
}

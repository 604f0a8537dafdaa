//! How a worker's memory is limited: a cgroup v2 `memory.max` when the node
//! has a unified hierarchy with the memory controller and the daemon may
//! create groups in it, otherwise `RLIMIT_AS`, which the worker sets on
//! itself from [`Assignment::memory_limit_bytes`](rfaas_proto::control::Assignment).

use std::io;
use std::path::{Path, PathBuf};

const CGROUP_ROOT: &str = "/sys/fs/cgroup";

/// The limit mechanism in force, chosen once at start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MemoryLimiter {
    /// One child group per allocation under this directory.
    Cgroup(PathBuf),
    /// `RLIMIT_AS`, set by the worker.
    Rlimit,
}

impl MemoryLimiter {
    /// Probes for a usable cgroup v2 memory controller and says which
    /// mechanism applies, and why, in the log.
    pub fn detect() -> MemoryLimiter {
        match probe_cgroup(Path::new(CGROUP_ROOT)) {
            Ok(dir) => {
                tracing::info!(cgroup = %dir.display(), "worker memory limits: cgroup v2 memory.max");
                MemoryLimiter::Cgroup(dir)
            }
            Err(why) => {
                tracing::info!(%why, "worker memory limits: RLIMIT_AS (no usable cgroup v2 memory controller)");
                MemoryLimiter::Rlimit
            }
        }
    }

    /// The `RLIMIT_AS` value to put in an assignment: 0 when a cgroup
    /// limits the worker.
    pub fn rlimit_bytes(&self, memory_mib: u32) -> u64 {
        match self {
            MemoryLimiter::Cgroup(_) => 0,
            MemoryLimiter::Rlimit => u64::from(memory_mib) << 20,
        }
    }

    /// Environment for every worker. Under `RLIMIT_AS`, glibc's malloc is
    /// kept to one arena: each further arena (one per thread that
    /// allocates, up to eight per CPU) reserves 64 MiB of address space,
    /// which the limit counts although almost none of it is used. With
    /// them, whether a worker fits depended on which thread allocated
    /// first, not on its memory; without, it needs what
    /// `allocate::memory` says. (Under a cgroup, which counts resident
    /// memory, the reservations cost nothing and lanes keep their own.)
    pub fn worker_env(&self) -> &'static [(&'static str, &'static str)] {
        match self {
            MemoryLimiter::Cgroup(_) => &[],
            MemoryLimiter::Rlimit => &[("MALLOC_ARENA_MAX", "1")],
        }
    }

    /// Makes allocation `id`'s group with `memory.max` = `memory_mib` and
    /// returns its `cgroup.procs` path (a process joins by writing its pid
    /// there); `None` with the rlimit mechanism.
    pub fn create(&self, id: u64, memory_mib: u32) -> io::Result<Option<PathBuf>> {
        let MemoryLimiter::Cgroup(root) = self else {
            return Ok(None);
        };
        let dir = root.join(format!("alloc-{id}"));
        match std::fs::create_dir(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(e),
        }
        std::fs::write(
            dir.join("memory.max"),
            (u64::from(memory_mib) << 20).to_string(),
        )?;
        // Swap would let a worker exceed its limit unnoticed.
        let _ = std::fs::write(dir.join("memory.swap.max"), "0");
        Ok(Some(dir.join("cgroup.procs")))
    }

    /// Whether the kernel's OOM killer ended a process of allocation `id`'s
    /// group (its `memory.events` counts an `oom_kill`). Read it before
    /// [`MemoryLimiter::remove`]; always false with the rlimit mechanism.
    pub fn oom_killed(&self, id: u64) -> bool {
        let MemoryLimiter::Cgroup(root) = self else {
            return false;
        };
        std::fs::read_to_string(root.join(format!("alloc-{id}")).join("memory.events"))
            .is_ok_and(|events| oom_kills(&events) > 0)
    }

    /// Removes allocation `id`'s group, once its processes are gone.
    pub fn remove(&self, id: u64) {
        if let MemoryLimiter::Cgroup(root) = self {
            let dir = root.join(format!("alloc-{id}"));
            if let Err(e) = std::fs::remove_dir(&dir) {
                if e.kind() != io::ErrorKind::NotFound {
                    tracing::warn!(cgroup = %dir.display(), error = %e, "cannot remove a worker's cgroup");
                }
            }
        }
    }
}

/// Puts `pid` into the group whose `cgroup.procs` is `procs`.
pub fn join(procs: &Path, pid: u32) -> io::Result<()> {
    std::fs::write(procs, pid.to_string())
}

/// The `oom_kill` count of a `memory.events` file (0 when absent).
fn oom_kills(events: &str) -> u64 {
    events
        .lines()
        .find_map(|l| l.strip_prefix("oom_kill "))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0)
}

fn probe_cgroup(root: &Path) -> Result<PathBuf, String> {
    let controllers = std::fs::read_to_string(root.join("cgroup.controllers")).map_err(|e| {
        format!(
            "{}/cgroup.controllers: {e} (cgroup v1 or hybrid hierarchy)",
            root.display()
        )
    })?;
    if !controllers.split_whitespace().any(|c| c == "memory") {
        return Err(format!(
            "the memory controller is not in {}/cgroup.controllers",
            root.display()
        ));
    }
    let ours = root.join("rfaas");
    match std::fs::create_dir(&ours) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(format!("cannot create {}: {e}", ours.display())),
    }
    let enabled = |dir: &Path| {
        std::fs::read_to_string(dir.join("cgroup.subtree_control"))
            .map(|s| s.split_whitespace().any(|c| c == "memory"))
            .unwrap_or(false)
    };
    if !enabled(root) {
        std::fs::write(root.join("cgroup.subtree_control"), "+memory").map_err(|e| {
            format!(
                "cannot enable the memory controller below {}: {e}",
                root.display()
            )
        })?;
    }
    if !enabled(&ours) {
        std::fs::write(ours.join("cgroup.subtree_control"), "+memory").map_err(|e| {
            format!(
                "cannot enable the memory controller below {}: {e}",
                ours.display()
            )
        })?;
    }
    let probe = ours.join(format!("probe-{}", std::process::id()));
    std::fs::create_dir(&probe)
        .map_err(|e| format!("cannot create a child group {}: {e}", probe.display()))?;
    let has_max = probe.join("memory.max").exists();
    let _ = std::fs::remove_dir(&probe);
    if !has_max {
        return Err(format!("{} has no memory.max", probe.display()));
    }
    Ok(ours)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rlimit_fallback_carries_the_limit() {
        assert_eq!(MemoryLimiter::Rlimit.rlimit_bytes(3), 3 << 20);
        assert_eq!(MemoryLimiter::Rlimit.create(1, 3).unwrap(), None);
        assert_eq!(MemoryLimiter::Cgroup("/x".into()).rlimit_bytes(3), 0);
    }

    #[test]
    fn oom_kills_are_read_from_memory_events() {
        let root = std::env::temp_dir().join(format!("rfaas-cg-events-{}", std::process::id()));
        let group = root.join("alloc-7");
        std::fs::create_dir_all(&group).unwrap();
        let limiter = MemoryLimiter::Cgroup(root.clone());
        assert!(!limiter.oom_killed(7), "no memory.events yet");
        std::fs::write(
            group.join("memory.events"),
            "low 0\nhigh 0\nmax 12\noom 1\noom_kill 0\noom_group_kill 0\n",
        )
        .unwrap();
        assert!(!limiter.oom_killed(7), "at the limit, nothing killed");
        std::fs::write(
            group.join("memory.events"),
            "low 0\nhigh 0\nmax 40\noom 2\noom_kill 1\noom_group_kill 0\n",
        )
        .unwrap();
        assert!(limiter.oom_killed(7));
        assert!(!limiter.oom_killed(8), "another allocation");
        assert!(!MemoryLimiter::Rlimit.oom_killed(7));
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn probe_explains_a_missing_unified_hierarchy() {
        let dir = std::env::temp_dir().join(format!("rfaas-cg-probe-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let err = probe_cgroup(&dir).unwrap_err();
        assert!(err.contains("cgroup.controllers"), "{err}");
        std::fs::write(dir.join("cgroup.controllers"), "cpu io\n").unwrap();
        let err = probe_cgroup(&dir).unwrap_err();
        assert!(err.contains("memory controller"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

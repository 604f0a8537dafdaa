//! How a worker's memory is limited: a cgroup v2 `memory.max` when the node
//! has a unified hierarchy with the memory controller and the daemon may
//! create groups in it, otherwise `RLIMIT_AS`, which the worker sets on
//! itself from [`Assignment::memory_limit_bytes`](rfaas_proto::control::worker::Assignment);
//! and the locked-memory limit verbs needs ([`allow_pinning`]).

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

/// Lifts the locked-memory limit (`RLIMIT_MEMLOCK`) of the daemon, which
/// every worker it starts inherits, when a configured provider is verbs:
/// verbs pins every registered buffer, and the default 8 MiB would refuse
/// a lease's worth of them. Pinned pages stay inside the memory limit
/// (`RLIMIT_AS`, or the cgroup's), which bounds a worker either way.
/// Raising a hard limit takes `CAP_SYS_RESOURCE`, which root has unless a
/// container or service manager dropped it; without it the limit stays as
/// inherited, said once here (not fatal). Without verbs nothing is pinned:
/// nothing is done, nor said. Called once, at start.
pub fn allow_pinning(providers: &[String]) {
    if !providers.iter().any(|p| p.starts_with("verbs:")) {
        return;
    }
    let lim = libc::rlimit {
        rlim_cur: libc::RLIM_INFINITY,
        rlim_max: libc::RLIM_INFINITY,
    };
    // SAFETY: setrlimit reads the struct we pass.
    if unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &lim) } != 0 {
        let error = io::Error::last_os_error();
        let cap_eff = std::fs::read_to_string("/proc/self/status")
            .ok()
            .and_then(|s| effective_capabilities(&s));
        // SAFETY: geteuid cannot fail.
        let euid = unsafe { libc::geteuid() };
        tracing::warn!(%error, ?providers, "{}", memlock_warning(euid, cap_eff));
    }
}

/// `CAP_SYS_RESOURCE`'s bit in a capability set.
const CAP_SYS_RESOURCE: u32 = 24;

/// The effective capability set (`CapEff:`) of a `/proc/<pid>/status` text.
fn effective_capabilities(status: &str) -> Option<u64> {
    let hex = status.lines().find_map(|l| l.strip_prefix("CapEff:"))?;
    u64::from_str_radix(hex.trim(), 16).ok()
}

/// Why the locked-memory limit could not be lifted, for a process running
/// as `euid` with the effective capabilities `cap_eff` (when readable).
fn memlock_warning(euid: u32, cap_eff: Option<u64>) -> String {
    const WHAT: &str = "cannot lift the locked-memory limit (RLIMIT_MEMLOCK)";
    const EFFECT: &str = "registering memory may fail on verbs";
    let has_cap = cap_eff.map(|c| c & (1 << CAP_SYS_RESOURCE) != 0);
    match has_cap {
        Some(false) if euid == 0 => format!(
            "{WHAT}: the executor runs as root but without CAP_SYS_RESOURCE (a container or \
             the service manager dropped it; give it back, e.g. systemd \
             AmbientCapabilities=CAP_SYS_RESOURCE or docker --cap-add SYS_RESOURCE); {EFFECT}"
        ),
        Some(false) => format!(
            "{WHAT}: the executor runs as uid {euid}, without CAP_SYS_RESOURCE; run it as \
             root; {EFFECT}"
        ),
        _ => format!("{WHAT}; {EFFECT}"),
    }
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

    #[test]
    fn the_memlock_warning_names_the_missing_capability() {
        // Root in a container: every capability but CAP_SYS_RESOURCE.
        let status = "Name:\trfaas-worker\nCapPrm:\t000001ffffffffff\nCapEff:\t000001fffeffffff\n";
        let caps = effective_capabilities(status);
        assert_eq!(caps, Some(0x1ff_feff_ffff));
        let root = memlock_warning(0, caps);
        assert!(
            root.contains("runs as root but without CAP_SYS_RESOURCE"),
            "{root}"
        );
        assert!(!root.contains("not run as root"), "{root}");

        let user = memlock_warning(1000, Some(0));
        assert!(
            user.contains("uid 1000, without CAP_SYS_RESOURCE"),
            "{user}"
        );
        assert!(user.contains("run it as root"), "{user}");

        // With the capability (or unknown), the limit failed for another
        // reason: no blame on either.
        for caps in [Some(1 << CAP_SYS_RESOURCE), None] {
            let other = memlock_warning(0, caps);
            assert!(!other.contains("CAP_SYS_RESOURCE"), "{other}");
            assert!(
                other.starts_with("cannot lift the locked-memory limit"),
                "{other}"
            );
        }
        assert_eq!(effective_capabilities("CapEff:\tzz\n"), None);
    }
}

//! How a worker's memory is limited: its allocation's cgroup
//! ([`super::cgroup`], `memory.max`) when the daemon has a delegated
//! cgroup v2 subtree, otherwise `RLIMIT_AS`, which the worker sets on
//! itself from [`Assignment::memory_limit_bytes`](rfaas_proto::control::worker::Assignment);
//! and the locked-memory limit verbs needs ([`allow_pinning`]).

use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::cgroup::Delegated;

/// The limit mechanism in force, chosen once at start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MemoryLimiter {
    /// One group per allocation in the delegated subtree, which also
    /// holds its CPUs and every process it starts.
    Cgroup(Delegated),
    /// `RLIMIT_AS`, set by the worker; nothing holds the processes a
    /// function starts.
    Rlimit,
}

impl MemoryLimiter {
    /// The cgroup mechanism when the daemon has a delegated subtree, else
    /// `RLIMIT_AS`; `Err` (why there is no cgroup) with `enforce`, which
    /// refuses to run without one. Says once, in the log, which applies
    /// and what the daemon cannot enforce without a cgroup.
    pub fn detect(enforce: bool, adopted: &[u64]) -> Result<MemoryLimiter, String> {
        match Delegated::detect(adopted) {
            Ok(d) => {
                tracing::info!(cgroup = %d.root().display(), "worker memory limits: cgroup v2 memory.max; each allocation runs in a cgroup of its own (cpuset.cpus, memory.max, cgroup.kill)");
                Ok(MemoryLimiter::Cgroup(d))
            }
            Err(why) if enforce => Err(format!(
                "enforce_isolation is set, but the executor cannot put allocations in cgroups: {why}"
            )),
            Err(why) => {
                tracing::warn!(%why, "no cgroup for allocations: the executor cannot enforce isolation. Processes a function starts can outlive their allocation and run on CPUs it was not leased, their CPU time is not billed, and memory is limited by RLIMIT_AS; set enforce_isolation = true to refuse to start like this");
                Ok(MemoryLimiter::Rlimit)
            }
        }
    }

    /// Whether the next daemon can start while allocations run: not in
    /// a cgroup layout the service manager cannot start it in (see
    /// [`Delegated::takes_a_new_daemon`]).
    pub fn takes_a_new_daemon(&self) -> bool {
        match self {
            MemoryLimiter::Cgroup(d) => d.takes_a_new_daemon(),
            MemoryLimiter::Rlimit => true,
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

    /// Makes allocation `id`'s group with `cpuset.cpus` = `cpus` (none
    /// when empty) and `memory.max` = `memory_mib`, and returns its
    /// `cgroup.procs` path (a process joins by writing its pid there);
    /// `None` with the rlimit mechanism.
    pub fn create(&self, id: u64, cpus: &[u32], memory_mib: u32) -> io::Result<Option<PathBuf>> {
        match self {
            MemoryLimiter::Cgroup(d) => d.create(id, cpus, memory_mib).map(Some),
            MemoryLimiter::Rlimit => Ok(None),
        }
    }

    /// Kills every process left in allocation `id`'s group (its worker
    /// ended or was killed) and waits until the group is empty, so its
    /// final CPU time is read after the last of them. Nothing to do with
    /// the rlimit mechanism.
    pub fn kill(&self, id: u64, timeout: Duration) {
        if let MemoryLimiter::Cgroup(d) = self {
            match d.kill(id, timeout) {
                Ok(true) => {}
                Ok(false) => tracing::error!(
                    allocation = id,
                    ?timeout,
                    "processes of the allocation's cgroup did not end after SIGKILL"
                ),
                Err(e) => {
                    tracing::error!(allocation = id, error = %e, "cannot kill the processes of the allocation's cgroup")
                }
            }
        }
    }

    /// Whether the kernel's OOM killer ended a process of allocation `id`'s
    /// group (its `memory.events` counts an `oom_kill`). Read it before
    /// [`MemoryLimiter::remove`]; always false with the rlimit mechanism.
    pub fn oom_killed(&self, id: u64) -> bool {
        match self {
            MemoryLimiter::Cgroup(d) => d.oom_killed(id),
            MemoryLimiter::Rlimit => false,
        }
    }

    /// Removes allocation `id`'s group, once its processes are gone.
    pub fn remove(&self, id: u64) {
        if let MemoryLimiter::Cgroup(d) = self {
            d.remove(id);
        }
    }
}

/// Puts `pid` into the group whose `cgroup.procs` is `procs`.
pub fn join(procs: &Path, pid: u32) -> io::Result<()> {
    std::fs::write(procs, pid.to_string())
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
        assert_eq!(MemoryLimiter::Rlimit.create(1, &[0], 3).unwrap(), None);
        assert!(!MemoryLimiter::Rlimit.oom_killed(7));
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

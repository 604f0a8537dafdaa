//! One cgroup (v2) per allocation, inside the subtree the service manager
//! delegated to the daemon (systemd `Delegate=yes`), never elsewhere in
//! the hierarchy.
//!
//! At start ([`Delegated::detect`]) the daemon reads its own group from
//! `/proc/self/cgroup`. Started in a leaf named `daemon` (systemd 254+
//! with `DelegateSubgroup=daemon`, as the shipped unit asks), the
//! delegated group is that leaf's parent. Started in the delegated group
//! itself (older systemd), it moves itself into `<own>/daemon` (cgroup v2
//! lets only leaves hold processes once controllers are enabled below a
//! group); such a group cannot take the next daemon while it holds
//! allocations, so workers then do not outlive the daemon
//! ([`Delegated::takes_a_new_daemon`]). It enables the `cpuset`, `cpu`
//! and `memory` controllers in the group's `cgroup.subtree_control`, and
//! removes the allocation groups an earlier run left, except those of
//! allocations being adopted.
//! Each allocation then gets `<own>/alloc-<id>` ([`Delegated::create`])
//! with `cpuset.cpus` = its leased CPUs (when pinning) and `memory.max` =
//! its memory; its worker joins before it runs user code, and so does
//! every process it starts. Stopping ([`Delegated::kill`]) is
//! `cgroup.kill` (freeze and SIGKILL every member where the kernel has no
//! `cgroup.kill`), then a wait until `cgroup.events` says `populated 0`.
//!
//! A daemon in the root group, on a cgroup v1 or hybrid hierarchy, or
//! without the controllers delegated gets an `Err` saying which, and runs
//! without isolation ([`super::memlimit::MemoryLimiter::Rlimit`]) unless
//! `enforce_isolation` asks it to refuse.

use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use super::config::format_cpulist;

/// Where the unified hierarchy is mounted.
const MOUNT: &str = "/sys/fs/cgroup";

/// The controllers each allocation's group needs.
const CONTROLLERS: [&str; 3] = ["cpuset", "cpu", "memory"];

/// The leaf the daemon moves itself (and its pooled workers) into.
const DAEMON_LEAF: &str = "daemon";

/// The prefix of allocation groups.
const ALLOC_PREFIX: &str = "alloc-";

/// The subtree delegated to the daemon, set up for allocation groups.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delegated {
    root: PathBuf,
    /// The service manager started the daemon in `<root>/daemon`, where
    /// the next one starts too.
    placed: bool,
}

impl Delegated {
    /// Finds the daemon's own group, moves the daemon into its leaf and
    /// enables the controllers below it. `Err` says, in a sentence, what
    /// is missing and what an admin does about it.
    /// Allocation groups an earlier run left are removed, except
    /// `alloc-<id>` for the ids in `adopted`.
    pub fn detect(adopted: &[u64]) -> Result<Delegated, String> {
        let own = std::fs::read_to_string("/proc/self/cgroup")
            .map_err(|e| format!("cannot read /proc/self/cgroup: {e}"))?;
        let d = Delegated::at(Path::new(MOUNT), &own)?;
        d.remove_stale(adopted);
        Ok(d)
    }

    /// Whether a new daemon can start in this layout while allocations
    /// hold groups in it: only when the service manager places daemons in
    /// the `daemon` leaf. systemd before 254 starts the main process in
    /// the delegated group itself, which cgroup v2 refuses once it has
    /// controllers enabled below it.
    pub fn takes_a_new_daemon(&self) -> bool {
        self.placed
    }

    /// [`Delegated::detect`] with the hierarchy mounted at `mount` and the
    /// text of `/proc/self/cgroup`.
    fn at(mount: &Path, self_cgroup: &str) -> Result<Delegated, String> {
        if !mount.join("cgroup.controllers").exists() {
            return Err(format!(
                "{} is not a cgroup v2 (unified) hierarchy (cgroup v1 or hybrid); boot the node \
                 with systemd.unified_cgroup_hierarchy=1",
                mount.display()
            ));
        }
        let mut path = own_group(self_cgroup)?;
        // Placed in the leaf by the service manager: the group is its parent.
        let placed = match path.rsplit_once('/') {
            Some((parent, DAEMON_LEAF)) if !parent.is_empty() => {
                path = parent;
                true
            }
            _ => false,
        };
        if path == "/" {
            return Err(
                "the executor runs in the root cgroup, outside any subtree delegated to it; run \
                 it as the rfaas-executord systemd service (Delegate=yes)"
                    .into(),
            );
        }
        let own = mount.join(path.trim_start_matches('/'));
        let available = read(&own.join("cgroup.controllers"))?;
        let missing: Vec<&str> = CONTROLLERS
            .into_iter()
            .filter(|c| !available.split_whitespace().any(|a| a == *c))
            .collect();
        if !missing.is_empty() {
            return Err(format!(
                "the controllers {} are not delegated to the executor's cgroup {} (it has: {}); \
                 set Delegate=cpuset cpu memory in its systemd unit",
                missing.join(", "),
                own.display(),
                available.trim()
            ));
        }
        let leaf = own.join(DAEMON_LEAF);
        mkdir(&leaf)?;
        // Every process of the group (the daemon, normally alone) into the
        // leaf, so the group itself may enable controllers below it.
        let in_group = if placed {
            String::new()
        } else {
            read(&own.join("cgroup.procs"))?
        };
        for pid in in_group.split_whitespace() {
            if let Err(e) = std::fs::write(leaf.join("cgroup.procs"), pid) {
                // One that ended meanwhile is no obstacle.
                if e.raw_os_error() != Some(libc::ESRCH) {
                    return Err(format!(
                        "cannot move process {pid} into {}: {e}; the executor needs the \
                         subtree delegated to it (Delegate=yes)",
                        leaf.display()
                    ));
                }
            }
        }
        let enable: Vec<String> = CONTROLLERS.iter().map(|c| format!("+{c}")).collect();
        std::fs::write(own.join("cgroup.subtree_control"), enable.join(" ")).map_err(|e| {
            format!(
                "cannot enable the {} controllers in {}: {e}",
                CONTROLLERS.join(", "),
                own.join("cgroup.subtree_control").display()
            )
        })?;
        Ok(Delegated { root: own, placed })
    }

    /// The delegated group (the daemon's own).
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Allocation `id`'s group.
    fn group(&self, id: u64) -> PathBuf {
        self.root.join(format!("{ALLOC_PREFIX}{id}"))
    }

    /// Makes allocation `id`'s group with `cpuset.cpus` = `cpus` (all of
    /// the daemon's when empty) and `memory.max` = `memory_mib`, swap 0;
    /// returns its `cgroup.procs` (a process joins by writing its pid).
    pub fn create(&self, id: u64, cpus: &[u32], memory_mib: u32) -> io::Result<PathBuf> {
        let dir = self.group(id);
        match std::fs::create_dir(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(e),
        }
        let named = |file: &str, e: io::Error| {
            io::Error::new(
                e.kind(),
                format!("cannot write {}: {e}", dir.join(file).display()),
            )
        };
        if !cpus.is_empty() {
            std::fs::write(dir.join("cpuset.cpus"), format_cpulist(cpus))
                .map_err(|e| named("cpuset.cpus", e))?;
        }
        std::fs::write(
            dir.join("memory.max"),
            (u64::from(memory_mib) << 20).to_string(),
        )
        .map_err(|e| named("memory.max", e))?;
        // Swap would let a worker exceed its limit unnoticed.
        let _ = std::fs::write(dir.join("memory.swap.max"), "0");
        Ok(dir.join("cgroup.procs"))
    }

    /// Kills every process in allocation `id`'s group and waits, up to
    /// `timeout`, until the group is empty. True when it is (or is gone).
    pub fn kill(&self, id: u64, timeout: Duration) -> io::Result<bool> {
        kill_group(&self.group(id), timeout)
    }

    /// Whether the kernel's OOM killer ended a process of allocation
    /// `id`'s group (its `memory.events` counts an `oom_kill`).
    pub fn oom_killed(&self, id: u64) -> bool {
        std::fs::read_to_string(self.group(id).join("memory.events"))
            .is_ok_and(|events| oom_kills(&events) > 0)
    }

    /// Removes allocation `id`'s group, which [`Delegated::kill`] emptied.
    pub fn remove(&self, id: u64) {
        let dir = self.group(id);
        if let Err(e) = std::fs::remove_dir(&dir) {
            if e.kind() != io::ErrorKind::NotFound {
                tracing::warn!(cgroup = %dir.display(), error = %e, "cannot remove an allocation's cgroup");
            }
        }
    }

    /// Kills and removes the allocation groups an earlier run of the
    /// daemon left (it forgot their allocations when it ended).
    fn remove_stale(&self, adopted: &[u64]) {
        let Ok(entries) = std::fs::read_dir(&self.root) else {
            return;
        };
        for e in entries.flatten() {
            let name = e.file_name();
            let Some(id) = name
                .to_string_lossy()
                .strip_prefix(ALLOC_PREFIX)
                .map(str::to_owned)
            else {
                continue;
            };
            if id.parse::<u64>().is_ok_and(|id| adopted.contains(&id)) {
                continue;
            }
            let dir = e.path();
            match kill_group(&dir, Duration::from_secs(5)) {
                Ok(true) => {
                    tracing::info!(cgroup = %dir.display(), "removing the cgroup of an allocation of an earlier run")
                }
                Ok(false) => {
                    tracing::warn!(cgroup = %dir.display(), "processes of an earlier run's allocation did not end after SIGKILL")
                }
                Err(e) => {
                    tracing::warn!(cgroup = %dir.display(), error = %e, "cannot kill the processes of an earlier run's allocation")
                }
            }
            let _ = std::fs::remove_dir(&dir);
        }
    }
}

/// `cgroup.kill` on `dir` (or, before Linux 5.14, freeze it and SIGKILL
/// every member), then waits until `cgroup.events` says it is empty.
fn kill_group(dir: &Path, timeout: Duration) -> io::Result<bool> {
    let events = match std::fs::File::open(dir.join("cgroup.events")) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(true),
        Err(e) => return Err(e),
    };
    let until = Instant::now() + timeout;
    let has_kill = dir.join("cgroup.kill").exists();
    loop {
        if !populated(&events)? {
            return Ok(true);
        }
        if has_kill {
            std::fs::write(dir.join("cgroup.kill"), "1")?;
        } else {
            // Frozen, nobody forks between the read and the kills; a fatal
            // signal ends a frozen task.
            std::fs::write(dir.join("cgroup.freeze"), "1")?;
            for pid in read_io(&dir.join("cgroup.procs"))?
                .split_whitespace()
                .filter_map(|p| p.parse::<libc::pid_t>().ok())
            {
                // SAFETY: kill has no memory preconditions.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
            std::fs::write(dir.join("cgroup.freeze"), "0")?;
        }
        let now = Instant::now();
        if now >= until {
            return Ok(!populated(&events)?);
        }
        // `cgroup.events` wakes pollers (POLLPRI) when it changes; the
        // slice bounds a wake-up missed between the read and the poll.
        let slice = (until - now).min(Duration::from_millis(100));
        let mut pfd = libc::pollfd {
            fd: events.as_raw_fd(),
            events: libc::POLLPRI,
            revents: 0,
        };
        // SAFETY: pfd is one valid pollfd for the call.
        unsafe { libc::poll(&mut pfd, 1, slice.as_millis() as libc::c_int) };
    }
}

/// Whether the group whose open `cgroup.events` is `events` has a process
/// in it or below it (reading it re-arms its poll notification).
fn populated(events: &std::fs::File) -> io::Result<bool> {
    let mut buf = [0u8; 256];
    let n = events.read_at(&mut buf, 0)?;
    Ok(populated_in(&String::from_utf8_lossy(&buf[..n])))
}

/// The `populated` field of a `cgroup.events` text (true when absent).
fn populated_in(events: &str) -> bool {
    events
        .lines()
        .find_map(|l| l.strip_prefix("populated "))
        .map_or(true, |v| v.trim() != "0")
}

/// The `oom_kill` count of a `memory.events` file (0 when absent).
fn oom_kills(events: &str) -> u64 {
    events
        .lines()
        .find_map(|l| l.strip_prefix("oom_kill "))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0)
}

/// The v2 group of a `/proc/<pid>/cgroup` text (its `0::` line).
fn own_group(self_cgroup: &str) -> Result<&str, String> {
    self_cgroup
        .lines()
        .find_map(|l| l.strip_prefix("0::"))
        .map(str::trim)
        .ok_or_else(|| {
            "/proc/self/cgroup names no cgroup v2 group (no \"0::\" line): the node mounts \
             cgroup v1 only"
                .to_string()
        })
}

fn mkdir(dir: &Path) -> Result<(), String> {
    match std::fs::create_dir(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(format!(
            "cannot create the cgroup {}: {e}; the executor needs the subtree delegated to it \
             (Delegate=yes)",
            dir.display()
        )),
    }
}

fn read(path: &Path) -> Result<String, String> {
    read_io(path).map_err(|e| format!("cannot read {}: {e}", path.display()))
}

fn read_io(path: &Path) -> io::Result<String> {
    std::fs::read_to_string(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_own_group_is_the_unified_line() {
        let hybrid = "12:cpuset:/\n1:name=systemd:/system.slice/x.service\n0::/system.slice/rfaas-executord.service\n";
        assert_eq!(
            own_group(hybrid).unwrap(),
            "/system.slice/rfaas-executord.service"
        );
        let v1 = "12:cpuset:/\n11:memory:/user.slice\n";
        assert!(own_group(v1).unwrap_err().contains("cgroup v1"));
    }

    #[test]
    fn what_is_missing_is_said() {
        let dir = std::env::temp_dir().join(format!("rfaas-cg-delegate-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let err = Delegated::at(&dir, "0::/x\n").unwrap_err();
        assert!(err.contains("not a cgroup v2"), "{err}");
        std::fs::write(dir.join("cgroup.controllers"), "cpuset cpu io memory\n").unwrap();
        let err = Delegated::at(&dir, "0::/\n").unwrap_err();
        assert!(err.contains("root cgroup"), "{err}");
        assert!(err.contains("Delegate=yes"), "{err}");
        std::fs::create_dir_all(dir.join("svc")).unwrap();
        std::fs::write(dir.join("svc/cgroup.controllers"), "cpu io\n").unwrap();
        let err = Delegated::at(&dir, "0::/svc\n").unwrap_err();
        assert!(err.contains("cpuset, memory are not delegated"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A plain directory stands in for the hierarchy: the files the
    /// daemon reads and writes are made by hand.
    fn fake_group(dir: &Path, group: &str) {
        let g = dir.join(group);
        std::fs::create_dir_all(g.join("daemon")).unwrap();
        std::fs::write(dir.join("cgroup.controllers"), "cpuset cpu io memory\n").unwrap();
        std::fs::write(g.join("cgroup.controllers"), "cpuset cpu io memory\n").unwrap();
        std::fs::write(g.join("cgroup.procs"), "").unwrap();
        std::fs::write(g.join("daemon/cgroup.procs"), "").unwrap();
    }

    #[test]
    fn a_daemon_placed_in_the_daemon_leaf_uses_its_parent_and_takes_a_successor() {
        let dir = std::env::temp_dir().join(format!("rfaas-cg-placed-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        fake_group(&dir, "system.slice/rfaas-executord.service");
        let d = Delegated::at(&dir, "0::/system.slice/rfaas-executord.service/daemon\n").unwrap();
        assert_eq!(d.root(), dir.join("system.slice/rfaas-executord.service"));
        assert!(d.takes_a_new_daemon());
        let subtree = dir.join("system.slice/rfaas-executord.service/cgroup.subtree_control");
        assert_eq!(
            std::fs::read_to_string(&subtree).unwrap(),
            "+cpuset +cpu +memory"
        );
        // Started in the group itself (systemd before 254): no successor
        // can start there while allocations hold groups.
        let d = Delegated::at(&dir, "0::/system.slice/rfaas-executord.service\n").unwrap();
        assert_eq!(d.root(), dir.join("system.slice/rfaas-executord.service"));
        assert!(!d.takes_a_new_daemon());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn stale_groups_go_and_adopted_ones_stay() {
        let dir = std::env::temp_dir().join(format!("rfaas-cg-stale-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        fake_group(&dir, "svc");
        let d = Delegated::at(&dir, "0::/svc/daemon\n").unwrap();
        for id in [3, 4] {
            std::fs::create_dir_all(dir.join(format!("svc/alloc-{id}"))).unwrap();
        }
        // No cgroup.events in a plain directory: nothing to kill, and
        // remove_dir takes the empty one.
        d.remove_stale(&[4]);
        assert!(!dir.join("svc/alloc-3").exists());
        assert!(dir.join("svc/alloc-4").exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn events_and_lists_are_read() {
        assert!(populated_in("populated 1\nfrozen 0\n"));
        assert!(!populated_in("populated 0\nfrozen 0\n"));
        assert_eq!(oom_kills("oom 2\noom_kill 1\n"), 1);
        assert_eq!(oom_kills("oom 0\n"), 0);
    }
}

//! The node's grantable CPUs and memory, and what each lease holds of them.
//! The caller keeps one [`Capacity`] behind one lock, so two requests never
//! take the same CPU.
//!
//! A CPU is free, granted (to an allocation), or withheld: taken back for
//! a Slurm job, so no allocation may have it. A withheld CPU an allocation
//! still holds (it is being stopped) stays withheld when that allocation
//! ends; one no longer withheld becomes free once nobody holds it.

use rfaas_proto::text::count;
use std::collections::{BTreeSet, HashMap};

/// Why a grant was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// The lease's allocations on this node would hold more than it grants.
    ExceedsLease {
        /// What failed and what to do.
        message: String,
        /// What the lease's allocations here hold: cores, MiB.
        held: (u32, u64),
    },
    /// Not enough free CPUs or memory.
    NoCapacity(String),
}

/// Free and held CPUs and memory.
#[derive(Debug)]
pub struct Capacity {
    cpus: Vec<u32>,
    free: BTreeSet<u32>,
    granted: BTreeSet<u32>,
    withheld: BTreeSet<u32>,
    memory_mib: u32,
    free_memory_mib: u32,
    /// lease id → (cores, MiB) held by its allocations.
    leases: HashMap<u64, (u32, u64)>,
}

impl Capacity {
    /// Everything free: `cpus` and `memory_mib`.
    pub fn new(cpus: &[u32], memory_mib: u32) -> Capacity {
        Capacity {
            cpus: cpus.to_vec(),
            free: cpus.iter().copied().collect(),
            granted: BTreeSet::new(),
            withheld: BTreeSet::new(),
            memory_mib,
            free_memory_mib: memory_mib,
            leases: HashMap::new(),
        }
    }

    /// Every configured CPU.
    pub fn cpus(&self) -> &[u32] {
        &self.cpus
    }

    /// CPUs neither granted nor withheld, ascending.
    pub fn free_cpus(&self) -> Vec<u32> {
        self.free.iter().copied().collect()
    }

    /// CPUs granted to allocations (withheld or not), ascending.
    pub fn granted_cpus(&self) -> Vec<u32> {
        self.granted.iter().copied().collect()
    }

    /// CPUs withheld for Slurm jobs (granted or not), ascending.
    pub fn withheld_cpus(&self) -> Vec<u32> {
        self.withheld.iter().copied().collect()
    }

    /// Makes `cpus` the withheld set: none of them is granted from now on,
    /// and every configured CPU not in it that nobody holds is free again.
    /// CPUs this executor does not have are ignored.
    pub fn set_withheld(&mut self, cpus: &BTreeSet<u32>) {
        self.withheld = self
            .cpus
            .iter()
            .copied()
            .filter(|c| cpus.contains(c))
            .collect();
        self.free = self
            .cpus
            .iter()
            .copied()
            .filter(|c| !self.withheld.contains(c) && !self.granted.contains(c))
            .collect();
    }

    /// Configured memory, MiB.
    pub fn memory_mib(&self) -> u32 {
        self.memory_mib
    }

    /// Memory not held, MiB.
    pub fn free_memory_mib(&self) -> u32 {
        self.free_memory_mib
    }

    /// Takes `cores` CPUs (the lowest free ones) and `memory_mib` for
    /// `lease_id`, whose lease grants `lease_cores` and `lease_memory_mib`
    /// in all.
    pub fn grant(
        &mut self,
        lease_id: u64,
        lease_cores: u16,
        lease_memory_mib: u32,
        cores: u16,
        memory_mib: u32,
    ) -> Result<Vec<u32>, Refusal> {
        let (held_cores, held_mem) = self.leases.get(&lease_id).copied().unwrap_or((0, 0));
        if held_cores + u32::from(cores) > u32::from(lease_cores)
            || held_mem + u64::from(memory_mib) > u64::from(lease_memory_mib)
        {
            return Err(Refusal::ExceedsLease {
                message: format!(
                    "lease {lease_id} grants {} and {lease_memory_mib} MiB; its allocations here already hold {} and {held_mem} MiB, so {} more and {memory_mib} MiB do not fit; deallocate first or request a bigger lease",
                    count(lease_cores, "core"),
                    count(held_cores, "core"),
                    count(cores, "core")
                ),
                held: (held_cores, held_mem),
            });
        }
        if self.free.len() < usize::from(cores) || self.free_memory_mib < memory_mib {
            return Err(Refusal::NoCapacity(format!(
                "this executor has {} and {} MiB free, the request needs {} and {memory_mib} MiB; retry later or on another node",
                count(self.free.len() as u64, "free core"),
                self.free_memory_mib,
                count(cores, "core")
            )));
        }
        let taken: Vec<u32> = self.free.iter().copied().take(usize::from(cores)).collect();
        for c in &taken {
            self.free.remove(c);
            self.granted.insert(*c);
        }
        self.free_memory_mib -= memory_mib;
        let e = self.leases.entry(lease_id).or_default();
        e.0 += u32::from(cores);
        e.1 += u64::from(memory_mib);
        Ok(taken)
    }

    /// Takes exactly `cpus` and `memory_mib` for `lease_id`: what an
    /// adopted worker holds. Refused when a CPU is not configured or not
    /// free, or the memory is not free.
    pub fn take(&mut self, lease_id: u64, cpus: &[u32], memory_mib: u32) -> Result<(), String> {
        if let Some(c) = cpus.iter().find(|c| !self.free.contains(c)) {
            return Err(format!(
                "CPU {c} is not a free CPU of this executor (cpus, or held twice)"
            ));
        }
        if self.free_memory_mib < memory_mib {
            return Err(format!(
                "{memory_mib} MiB do not fit in the {} MiB free (memory_mib)",
                self.free_memory_mib
            ));
        }
        for c in cpus {
            self.free.remove(c);
            self.granted.insert(*c);
        }
        self.free_memory_mib -= memory_mib;
        let e = self.leases.entry(lease_id).or_default();
        e.0 += cpus.len() as u32;
        e.1 += u64::from(memory_mib);
        Ok(())
    }

    /// Gives back what [`grant`](Self::grant) returned.
    pub fn release(&mut self, lease_id: u64, cpus: &[u32], memory_mib: u32) {
        for c in cpus {
            debug_assert!(self.cpus.contains(c));
            self.granted.remove(c);
            if !self.withheld.contains(c) {
                self.free.insert(*c);
            }
        }
        self.free_memory_mib = (self.free_memory_mib + memory_mib).min(self.memory_mib);
        if let Some(e) = self.leases.get_mut(&lease_id) {
            e.0 = e.0.saturating_sub(cpus.len() as u32);
            e.1 = e.1.saturating_sub(u64::from(memory_mib));
            if *e == (0, 0) {
                self.leases.remove(&lease_id);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grants_never_exceed_the_node_or_the_lease() {
        let mut c = Capacity::new(&[2, 3, 5], 1000);
        assert_eq!(c.grant(1, 2, 600, 2, 300).unwrap(), [2, 3]);
        assert!(matches!(
            c.grant(1, 2, 600, 1, 10),
            Err(Refusal::ExceedsLease { held: (2, 300), .. })
        ));
        assert!(matches!(
            c.grant(2, 4, 4000, 2, 10),
            Err(Refusal::NoCapacity(ref m)) if m.contains("has 1 free core and") && m.contains("needs 2 cores")
        ));
        assert!(matches!(
            c.grant(2, 4, 4000, 1, 701),
            Err(Refusal::NoCapacity(_))
        ));
        assert_eq!(c.grant(2, 4, 4000, 1, 700).unwrap(), [5]);
        assert_eq!(c.free_memory_mib(), 0);
        c.release(1, &[2, 3], 300);
        assert_eq!(c.free_cpus(), [2, 3]);
        assert_eq!(c.grant(1, 2, 600, 2, 300).unwrap(), [2, 3]);
        c.release(1, &[2, 3], 300);
        c.release(2, &[5], 700);
        assert_eq!(c.free_cpus(), [2, 3, 5]);
        assert_eq!(c.free_memory_mib(), 1000);
        assert!(c.leases.is_empty());
    }

    #[test]
    fn withheld_cpus_are_neither_free_nor_granted_again() {
        let mut c = Capacity::new(&[0, 1, 2, 3], 1000);
        assert_eq!(c.grant(1, 4, 1000, 2, 100).unwrap(), [0, 1]);
        // A Slurm job takes CPUs 1 and 2 back (and 9, which is not ours).
        c.set_withheld(&[1, 2, 9].into());
        assert_eq!(c.withheld_cpus(), [1, 2]);
        assert_eq!(c.free_cpus(), [3], "2 is withheld, 0 and 1 are granted");
        assert_eq!(c.granted_cpus(), [0, 1]);
        assert_eq!(
            c.grant(2, 4, 1000, 1, 100).unwrap(),
            [3],
            "only the free CPU goes"
        );
        assert!(matches!(
            c.grant(3, 4, 1000, 1, 100),
            Err(Refusal::NoCapacity(ref m)) if m.contains("has 0 free cores")
        ));
        // The allocation on 0 and 1 ends: 0 is free, 1 stays withheld.
        c.release(1, &[0, 1], 100);
        assert_eq!(c.free_cpus(), [0]);
        assert_eq!(c.granted_cpus(), [3]);
        // The job ends: its CPUs are free, what is granted stays granted.
        c.set_withheld(&BTreeSet::new());
        assert_eq!(c.free_cpus(), [0, 1, 2]);
        assert!(c.withheld_cpus().is_empty());
        c.release(2, &[3], 100);
        assert_eq!(c.free_cpus(), [0, 1, 2, 3]);
        assert_eq!(c.free_memory_mib(), 1000);
    }

    #[test]
    fn withholding_a_granted_cpu_and_giving_it_back_before_its_end() {
        let mut c = Capacity::new(&[4, 5], 100);
        assert_eq!(c.grant(1, 1, 100, 1, 10).unwrap(), [4]);
        c.set_withheld(&[4].into());
        assert_eq!(c.free_cpus(), [5]);
        // The job ended before the allocation did: 4 is still granted.
        c.set_withheld(&BTreeSet::new());
        assert_eq!(c.free_cpus(), [5]);
        assert_eq!(c.granted_cpus(), [4]);
        c.release(1, &[4], 10);
        assert_eq!(c.free_cpus(), [4, 5]);
        // Everything withheld: nothing to grant.
        c.set_withheld(&[4, 5].into());
        assert!(matches!(
            c.grant(2, 1, 100, 1, 10),
            Err(Refusal::NoCapacity(_))
        ));
    }
}

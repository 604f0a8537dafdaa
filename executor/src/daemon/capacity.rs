//! The node's grantable CPUs and memory, and what each lease holds of them.
//! The caller keeps one [`Capacity`] behind one lock, so two requests never
//! take the same CPU.

use rfaas_proto::text::count;
use std::collections::{BTreeSet, HashMap};

/// Why a grant was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// The lease's allocations on this node would hold more than it grants.
    ExceedsLease(String),
    /// Not enough free CPUs or memory.
    NoCapacity(String),
}

/// Free and held CPUs and memory.
#[derive(Debug)]
pub struct Capacity {
    cpus: Vec<u32>,
    free: BTreeSet<u32>,
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
            memory_mib,
            free_memory_mib: memory_mib,
            leases: HashMap::new(),
        }
    }

    /// Every configured CPU.
    pub fn cpus(&self) -> &[u32] {
        &self.cpus
    }

    /// CPUs not held, ascending.
    pub fn free_cpus(&self) -> Vec<u32> {
        self.free.iter().copied().collect()
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
            return Err(Refusal::ExceedsLease(format!(
                "lease {lease_id} grants {} and {lease_memory_mib} MiB; its allocations here already hold {} and {held_mem} MiB, so {} more and {memory_mib} MiB do not fit; deallocate first or request a bigger lease",
                count(lease_cores, "core"),
                count(held_cores, "core"),
                count(cores, "core")
            )));
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
        }
        self.free_memory_mib -= memory_mib;
        let e = self.leases.entry(lease_id).or_default();
        e.0 += u32::from(cores);
        e.1 += u64::from(memory_mib);
        Ok(taken)
    }

    /// Gives back what [`grant`](Self::grant) returned.
    pub fn release(&mut self, lease_id: u64, cpus: &[u32], memory_mib: u32) {
        for c in cpus {
            debug_assert!(self.cpus.contains(c));
            self.free.insert(*c);
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
            Err(Refusal::ExceedsLease(_))
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
}

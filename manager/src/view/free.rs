//! The placement index: the nodes a grant could take cores from (up, with
//! a lendable core), kept in step with every change to the view, so that
//! a grant draws a few of them at random instead of walking the fleet.
//!
//! Drawing at random spreads grants over the nodes that fit. When few of
//! the nodes have the memory a request asks, draws mostly miss; placement
//! then walks the same nodes by lendable memory, largest first, which
//! reaches only nodes that fit.

use std::collections::{BTreeMap, HashMap, HashSet};

use rfaas_proto::manager::{NodeState, NodeView};

use crate::store::StoredNode;

/// Draws placement makes beyond two per core asked before it walks the
/// index by memory instead.
const DRAWS: usize = 64;

/// Nodes offered beyond those that cover a request, for when the view is
/// behind the database on some of them.
const SPARE: usize = 4;

/// Cores of `n` neither leased, withheld by the node, nor draining.
pub(super) fn lendable(n: &NodeView) -> u32 {
    n.cores
        .saturating_sub(n.draining_cores)
        .saturating_sub(n.leased_cores)
        .saturating_sub(n.withheld_cores)
}

/// Memory of `n` neither leased nor draining, MiB.
pub(super) fn lendable_memory(n: &NodeView) -> u64 {
    n.memory_mib
        .saturating_sub(n.draining_memory_mib)
        .saturating_sub(n.leased_memory_mib)
}

/// The lendable memory `n` is indexed by, if it may be offered at all.
fn offered(n: &NodeView) -> Option<u64> {
    (n.state == NodeState::Up && lendable(n) > 0).then(|| lendable_memory(n))
}

/// The nodes that may be offered.
#[derive(Debug, Default)]
pub(super) struct Free {
    /// Their names, in no order, to draw from.
    names: Vec<String>,
    /// Where each is in `names` and `by_memory`.
    at: HashMap<String, Entry>,
    /// By lendable memory, then by how long ago they changed (the oldest
    /// first in a walk from the top).
    by_memory: BTreeMap<(u64, u64), String>,
    /// Counts changes, for `by_memory`'s second key.
    seq: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Entry {
    pos: usize,
    key: (u64, u64),
}

/// Nodes to try for a request, and how many nodes it took to find them.
#[derive(Debug, Default)]
pub(super) struct Placement {
    /// Names and lendable cores, best first.
    pub candidates: Vec<(String, u32)>,
    /// Nodes read to choose them.
    pub looked: usize,
}

impl Free {
    /// Puts `name` in step with `node` (`None`: the node is gone). A
    /// change that leaves its lendable memory as it was (a heartbeat)
    /// leaves its entry alone.
    pub(super) fn set(&mut self, name: &str, node: Option<&NodeView>) {
        let memory = node.and_then(offered);
        let held = self.at.get(name).copied();
        if held.map(|e| e.key.0) == memory {
            return;
        }
        if let Some(e) = held {
            self.at.remove(name);
            self.by_memory.remove(&e.key);
            self.names.swap_remove(e.pos);
            if let Some(moved) = self.names.get(e.pos) {
                if let Some(m) = self.at.get_mut(moved) {
                    m.pos = e.pos;
                }
            }
        }
        if let Some(memory) = memory {
            self.seq += 1;
            let key = (memory, u64::MAX - self.seq);
            self.by_memory.insert(key, name.to_owned());
            let pos = self.names.len();
            self.at.insert(name.to_owned(), Entry { pos, key });
            self.names.push(name.to_owned());
        }
    }

    /// Nodes to try for `cores` at `memory_mib` per node: the `preferred`
    /// that fit, in their order, then others that fit, drawn at random,
    /// until their cores cover the request with [`SPARE`] nodes to spare
    /// (or every node that fits, if they do not). It reads the preferred
    /// nodes, the nodes the request needs and a bounded number of misses,
    /// whatever the number of nodes.
    pub(super) fn place(
        &self,
        nodes: &HashMap<String, StoredNode>,
        memory_mib: u64,
        cores: u32,
        preferred: &[String],
    ) -> Placement {
        let mut picks = Picks {
            nodes,
            memory_mib,
            need: u64::from(cores),
            got: 0,
            spare: 0,
            taken: HashSet::with_capacity(preferred.len()),
            out: Placement::default(),
        };
        for name in preferred {
            picks.try_node(name);
        }
        let budget = DRAWS + 2 * cores as usize;
        if budget >= self.names.len() {
            // A small pool: all of it, in random order.
            let mut order: Vec<&String> = self.names.iter().collect();
            fastrand::shuffle(&mut order);
            for name in order {
                if picks.done() {
                    break;
                }
                picks.try_node(name);
            }
            return picks.out;
        }
        for _ in 0..budget {
            if picks.done() {
                return picks.out;
            }
            picks.try_node(&self.names[fastrand::usize(..self.names.len())]);
        }
        for name in self.by_memory.range((memory_mib, 0)..).rev().map(|e| e.1) {
            if picks.done() {
                break;
            }
            picks.try_node(name);
        }
        picks.out
    }

    /// Checks the index against a walk of `nodes`.
    #[cfg(test)]
    pub(super) fn check(&self, nodes: &HashMap<String, StoredNode>) {
        let want: HashMap<&str, u64> = nodes
            .iter()
            .filter_map(|(name, n)| offered(&n.node).map(|m| (name.as_str(), m)))
            .collect();
        assert_eq!(self.names.len(), want.len());
        assert_eq!(self.at.len(), want.len());
        assert_eq!(self.by_memory.len(), want.len());
        for (pos, name) in self.names.iter().enumerate() {
            let e = self.at[name];
            assert_eq!(e.pos, pos, "{name}");
            assert_eq!(Some(&e.key.0), want.get(name.as_str()), "{name}");
            assert_eq!(self.by_memory.get(&e.key), Some(name));
        }
    }
}

/// A placement being made.
struct Picks<'a> {
    nodes: &'a HashMap<String, StoredNode>,
    memory_mib: u64,
    need: u64,
    /// Cores of the nodes picked.
    got: u64,
    /// Nodes picked once `got` covered `need`.
    spare: usize,
    /// Names read (preferred or picked), never offered twice.
    taken: HashSet<&'a str>,
    out: Placement,
}

impl<'a> Picks<'a> {
    fn done(&self) -> bool {
        self.got >= self.need && self.spare >= SPARE
    }

    /// Reads `name` once: picked if it fits.
    fn try_node(&mut self, name: &'a str) {
        if !self.taken.insert(name) {
            return;
        }
        self.out.looked += 1;
        let Some(n) = self.nodes.get(name).map(|s| &s.node) else {
            return;
        };
        let free = lendable(n);
        if n.state != NodeState::Up || free == 0 || self.memory_mib > lendable_memory(n) {
            return;
        }
        if self.got >= self.need {
            self.spare += 1;
        }
        self.got += u64::from(free);
        self.out.candidates.push((name.to_owned(), free));
    }
}

//! Each replica's in-memory view of the nodes: what placement reads, so a
//! grant needs no query to choose its nodes.
//!
//! The view is a cache, never the truth: a grant's conditional updates in
//! the database decide. It is kept fresh three ways: this replica applies
//! its own changes at once; on PostgreSQL every change is announced on the
//! `rfaas_nodes` channel (`LISTEN/NOTIFY`): a registration, heartbeat or
//! drain names the node and each other replica reloads it, and grants and
//! releases send the nodes' leased counters in batches
//! ([`crate::announce`]); and every `refresh_ms` each replica reloads all
//! nodes, which also covers notifications lost while a connection was
//! down.
//!
//! Leased counters carry the node's `lease_seq`, and the view keeps the
//! counters with the highest one it has seen, whatever arrives in which
//! order: a batch, this replica's own commit, or a reload that read the
//! row before a commit the view already has.
//!
//! It also keeps what the nodes could ever hold ([`View::offer`]): every
//! node that ever registered, whatever its state now, at the capacity it
//! registered, summed up when a reload or a registration changes it, so
//! that a request no node could ever hold is told so without a query and
//! without walking the nodes.
//!
//! Placement reads an index of the nodes that may be offered
//! ([`free`]), kept in step with every change here, so a grant reads the
//! nodes it needs and a bounded number more, whatever the fleet's size.
//!
//! It also holds the accounting instances (`accounting_instances`, which
//! the accounting services write), reloaded with the nodes every
//! `refresh_ms`, so a grant picks a live instance for its billing slots
//! without a query of its own.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::ops::Bound;
use std::sync::RwLock;

use rfaas_proto::manager::{ClusterOffer, NodeState, NodeView};

use crate::store::{AccountingInstance, LeaseRow, StoredNode};

/// Nodes changed per hold of the view's lock by a bulk update
/// ([`View::replace_all`], [`View::heard`]).
pub const LOCK_CHUNK: usize = 256;

mod free;

use free::Free;

/// The view.
#[derive(Debug, Default)]
pub struct View {
    nodes: RwLock<Nodes>,
    /// Summed up from `nodes` (lock order: `nodes` first).
    reach: RwLock<Reach>,
    instances: RwLock<Vec<AccountingInstance>>,
}

/// The nodes by name, and the placement index over them.
#[derive(Debug, Default)]
struct Nodes {
    map: HashMap<String, StoredNode>,
    /// The same names in order, for pages of the listing.
    names: BTreeSet<String>,
    free: Free,
}

/// Every known node's registered capacity, summed up.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Reach {
    largest_cores: u32,
    cores: u64,
    /// Each node's registered memory, largest first, with the cores of
    /// the nodes that registered at least as much (a running sum).
    by_memory: Vec<(u64, u64)>,
}

/// What `n` registered (its capacity without what drains), cores and MiB:
/// what it may offer again, whatever its state or withheld cores now.
fn registered(n: &NodeView) -> (u32, u64) {
    (
        n.cores.saturating_sub(n.draining_cores),
        n.memory_mib.saturating_sub(n.draining_memory_mib),
    )
}

impl Reach {
    fn of(nodes: &HashMap<String, StoredNode>) -> Reach {
        let mut by_memory: Vec<(u64, u64)> = nodes
            .values()
            .map(|n| {
                let (cores, memory) = registered(&n.node);
                (memory, u64::from(cores))
            })
            .collect();
        by_memory.sort_unstable_by(|a, b| b.cmp(a));
        let mut sum = 0;
        for entry in &mut by_memory {
            sum += entry.1;
            entry.1 = sum;
        }
        Reach {
            largest_cores: nodes
                .values()
                .map(|n| registered(&n.node).0)
                .max()
                .unwrap_or(0),
            cores: sum,
            by_memory,
        }
    }
}

/// `read` as the view takes it over `held`: all of it, but the leased
/// counters only if they are newer.
///
/// A heartbeat this replica heard and has not written yet is newer than
/// the row: the later of the two times stays.
fn merge(read: StoredNode, held: Option<&StoredNode>) -> StoredNode {
    let mut out = match held {
        Some(h) if h.lease_seq > read.lease_seq => {
            let mut node = read.node;
            set_leased(&mut node, h.node.leased_cores, h.node.leased_memory_mib);
            StoredNode {
                node,
                lease_seq: h.lease_seq,
            }
        }
        _ => read,
    };
    if let Some(h) = held {
        let last = &mut out.node.last_heartbeat_ms;
        *last = (*last).max(h.node.last_heartbeat_ms);
    }
    out
}

/// Sets what `n` has leased, and its capacity as the database settles it
/// then (`store::NODE_CAPACITY`): what it registered, or what is leased
/// if that is more, the difference draining.
fn set_leased(n: &mut NodeView, cores: u32, memory_mib: u64) {
    let registered_cores = n.cores.saturating_sub(n.draining_cores);
    let registered_memory = n.memory_mib.saturating_sub(n.draining_memory_mib);
    n.leased_cores = cores;
    n.leased_memory_mib = memory_mib;
    n.cores = registered_cores.max(cores);
    n.draining_cores = n.cores - registered_cores;
    n.memory_mib = registered_memory.max(memory_mib);
    n.draining_memory_mib = n.memory_mib - registered_memory;
}

impl View {
    /// Replaces the whole view with what was read (the nodes not read are
    /// gone), keeping newer leased counters.
    ///
    /// It runs at start, every [`crate::liveness::FULL_RELOAD_MS`] and
    /// when a notice may have been missed, under the lock grants'
    /// placement reads through: it changes the view in place, node by
    /// node, a [`LOCK_CHUNK`] at a time, and the index and the summed
    /// capacity only where a node's offer or capacity changed (a
    /// heartbeat time changes neither), rather than building them again.
    pub fn replace_all(&self, read: Vec<StoredNode>) {
        let mut reach_changed = false;
        let mut seen = HashSet::with_capacity(read.len());
        let mut read = read.into_iter().peekable();
        // A few hundred nodes per hold of the lock, so that a grant's
        // placement waits for one chunk, not for a whole fleet's.
        while read.peek().is_some() {
            let mut nodes = self.nodes.write().unwrap_or_else(|p| p.into_inner());
            for n in read.by_ref().take(LOCK_CHUNK) {
                let name = n.node.name.clone();
                let held = nodes.map.get(&name);
                let before = held.map(|h| registered(&h.node));
                let n = merge(n, held);
                reach_changed |= before != Some(registered(&n.node));
                nodes.free.set(&name, Some(&n.node));
                if !nodes.names.contains(&name) {
                    nodes.names.insert(name.clone());
                }
                seen.insert(name.clone());
                nodes.map.insert(name, n);
            }
        }
        let mut nodes = self.nodes.write().unwrap_or_else(|p| p.into_inner());
        if seen.len() != nodes.map.len() {
            let gone: Vec<String> = nodes
                .map
                .keys()
                .filter(|k| !seen.contains(*k))
                .cloned()
                .collect();
            for name in gone {
                nodes.map.remove(&name);
                nodes.names.remove(&name);
                nodes.free.set(&name, None);
            }
            reach_changed = true;
        }
        if reach_changed {
            *self.reach.write().unwrap_or_else(|p| p.into_inner()) = Reach::of(&nodes.map);
        }
    }

    /// Heartbeat times read from the database (other replicas heard
    /// them): each moves a known node's last heartbeat forward, never
    /// back. Unknown nodes are left to the next full reload.
    pub fn heard(&self, heard: &[(String, u64)]) {
        for chunk in heard.chunks(LOCK_CHUNK) {
            let mut nodes = self.nodes.write().unwrap_or_else(|p| p.into_inner());
            for (name, at_ms) in chunk {
                if let Some(n) = nodes.map.get_mut(name) {
                    n.node.last_heartbeat_ms = n.node.last_heartbeat_ms.max(*at_ms);
                }
            }
        }
    }

    /// Adds or replaces one node, keeping newer leased counters.
    pub fn upsert(&self, read: StoredNode) {
        let mut nodes = self.nodes.write().unwrap_or_else(|p| p.into_inner());
        let name = read.node.name.clone();
        let n = merge(read, nodes.map.get(&name));
        let before = nodes.map.get(&name).map(|held| registered(&held.node));
        let changed = before != Some(registered(&n.node));
        nodes.free.set(&name, Some(&n.node));
        if !nodes.names.contains(&name) {
            nodes.names.insert(name.clone());
        }
        nodes.map.insert(name, n);
        // Heartbeats change nothing here; registrations may.
        if changed {
            *self.reach.write().unwrap_or_else(|p| p.into_inner()) = Reach::of(&nodes.map);
        }
    }

    /// What the known nodes could ever hold of a request for `memory_mib`
    /// per node lease: every node that ever registered, whatever its state
    /// now (a lost, drained or withholding node may come back), at the
    /// capacity it registered. Reads sums kept up to date, never the nodes.
    pub fn offer(&self, memory_mib: u64) -> ClusterOffer {
        let reach = self.reach.read().unwrap_or_else(|p| p.into_inner());
        let fitting = reach.by_memory.partition_point(|(m, _)| *m >= memory_mib);
        ClusterOffer {
            nodes: reach.by_memory.len() as u64,
            largest_node_cores: u64::from(reach.largest_cores),
            largest_node_memory_mib: reach.by_memory.first().map_or(0, |(m, _)| *m),
            cluster_cores: reach.cores,
            cores_with_memory: fitting.checked_sub(1).map_or(0, |k| reach.by_memory[k].1),
        }
    }

    /// Sets what `name` has leased after the commit that set its
    /// `lease_seq` to `seq`, unless the view has a later one; `false` when
    /// the view does not know the node.
    pub fn set_leased(&self, name: &str, cores: u32, memory_mib: u64, seq: u64) -> bool {
        let mut guard = self.nodes.write().unwrap_or_else(|p| p.into_inner());
        let nodes = &mut *guard;
        match nodes.map.get_mut(name) {
            Some(n) => {
                if seq > n.lease_seq {
                    set_leased(&mut n.node, cores, memory_mib);
                    n.lease_seq = seq;
                    nodes.free.set(name, Some(&n.node));
                }
                true
            }
            None => false,
        }
    }

    /// One node.
    pub fn get(&self, name: &str) -> Option<NodeView> {
        self.nodes
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .map
            .get(name)
            .map(|n| n.node.clone())
    }

    /// How many nodes are known.
    pub fn len(&self) -> usize {
        self.nodes
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .map
            .len()
    }

    /// Whether no node is known.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A heartbeat from `name` at `at_ms` that withholds `withheld_cores`:
    /// when the node is known, not lost, and withholds as many cores
    /// already, the heartbeat changes nothing grants go by, so it is only
    /// noted here (`true`); otherwise (`false`) it must go to the
    /// database ([`crate::liveness`]).
    pub fn beat(&self, name: &str, at_ms: u64, withheld_cores: u32) -> bool {
        let mut nodes = self.nodes.write().unwrap_or_else(|p| p.into_inner());
        match nodes.map.get_mut(name) {
            Some(n)
                if n.node.state != NodeState::Lost && n.node.withheld_cores == withheld_cores =>
            {
                n.node.last_heartbeat_ms = n.node.last_heartbeat_ms.max(at_ms);
                true
            }
            _ => false,
        }
    }

    /// Every node, by name.
    pub fn all(&self) -> Vec<NodeView> {
        let mut v: Vec<NodeView> = self
            .nodes
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .map
            .values()
            .map(|n| n.node.clone())
            .collect();
        v.sort_by(|a, b| a.name.cmp(&b.name));
        v
    }

    /// A page of the nodes by name: those after `after` whose name starts
    /// with `prefix` and that `keep` keeps, at most `limit`, and whether
    /// more remain. It reads the nodes from `after` on until the page is
    /// full.
    pub fn page(
        &self,
        after: Option<&str>,
        prefix: &str,
        limit: usize,
        keep: impl Fn(&NodeView) -> bool,
    ) -> (Vec<NodeView>, bool) {
        let nodes = self.nodes.read().unwrap_or_else(|p| p.into_inner());
        let start = match after {
            Some(a) if a >= prefix => Bound::Excluded(a),
            _ => Bound::Included(prefix),
        };
        let mut out = Vec::new();
        for name in nodes
            .names
            .range::<str, _>((start, Bound::Unbounded))
            .take_while(|n| n.starts_with(prefix))
        {
            let Some(n) = nodes.map.get(name).map(|s| &s.node) else {
                continue;
            };
            if keep(n) {
                if out.len() == limit {
                    return (out, true);
                }
                out.push(n.clone());
            }
        }
        (out, false)
    }

    /// Nodes to try for a lease of `cores` at `memory_mib` per node, with
    /// their free cores: the `preferred` ones first, in the order given,
    /// then others drawn at random, so that grants spread over the pool,
    /// until they cover the request with a few to spare (or all that fit,
    /// if they do not). It reads a bounded number of nodes beyond those the
    /// request needs, whatever the number of nodes ([`free`]).
    pub fn candidates(
        &self,
        memory_mib: u64,
        cores: u32,
        preferred: &[String],
    ) -> Vec<(String, u32)> {
        self.place(memory_mib, cores, preferred).candidates
    }

    fn place(&self, memory_mib: u64, cores: u32, preferred: &[String]) -> free::Placement {
        let nodes = self.nodes.read().unwrap_or_else(|p| p.into_inner());
        nodes.free.place(&nodes.map, memory_mib, cores, preferred)
    }

    /// Replaces the accounting instances.
    pub fn replace_instances(&self, instances: Vec<AccountingInstance>) {
        *self.instances.write().unwrap_or_else(|p| p.into_inner()) = instances;
    }

    /// Accounting instances live at `now_ms` (a heartbeat within
    /// `lost_after_ms`) and those not.
    pub fn instances_live(&self, now_ms: u64, lost_after_ms: u64) -> (usize, usize) {
        let all = self.instances.read().unwrap_or_else(|p| p.into_inner());
        let live = all.iter().filter(|a| a.live(now_ms, lost_after_ms)).count();
        (live, all.len() - live)
    }

    /// The live accounting instances a grant takes billing slots from, in
    /// the order to try them: those with free slots first, each drawn at
    /// random with a weight of its free slots (so leases spread over the
    /// instances in proportion to their room), then those this view
    /// believes full (they may have freed slots since the last reload).
    pub fn billing_candidates(&self, now_ms: u64, lost_after_ms: u64) -> Vec<AccountingInstance> {
        let all = self.instances.read().unwrap_or_else(|p| p.into_inner());
        let (mut roomy, mut full): (Vec<_>, Vec<_>) = all
            .iter()
            .filter(|a| a.live(now_ms, lost_after_ms) && a.slots > 0)
            .cloned()
            .partition(|a| a.free() > 0);
        drop(all);
        let mut out = Vec::with_capacity(roomy.len() + full.len());
        while !roomy.is_empty() {
            let total: u64 = roomy.iter().map(|a| u64::from(a.free())).sum();
            let mut pick = fastrand::u64(..total);
            let k = roomy
                .iter()
                .position(|a| {
                    let w = u64::from(a.free());
                    if pick < w {
                        true
                    } else {
                        pick -= w;
                        false
                    }
                })
                .unwrap_or(0);
            out.push(roomy.swap_remove(k));
        }
        fastrand::shuffle(&mut full);
        out.extend(full);
        out
    }

    /// Counts the billing slots this replica's grant took, until the next
    /// reload.
    pub fn apply_slots(&self, leases: &[LeaseRow]) {
        let mut all = self.instances.write().unwrap_or_else(|p| p.into_inner());
        for slot in leases.iter().filter_map(|l| l.billing.as_ref()) {
            if let Some(a) = all.iter_mut().find(|a| a.name == slot.instance) {
                a.used = a.used.saturating_add(1);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rfaas_proto::manager::NodeState;

    fn node(name: &str, cores: u32, leased: u32, state: NodeState) -> NodeView {
        NodeView {
            name: name.into(),
            state,
            control_addr: "127.0.0.1:1".into(),
            control_tls: false,
            providers: vec![],
            cores,
            memory_mib: 1024,
            leased_cores: leased,
            leased_memory_mib: 0,
            last_heartbeat_ms: 0,
            harvested: false,
            withheld_cores: 0,
            draining_cores: 0,
            draining_memory_mib: 0,
            partitions: Vec::new(),
        }
    }

    fn read(nodes: Vec<NodeView>) -> Vec<StoredNode> {
        nodes
            .into_iter()
            .map(|node| StoredNode { node, lease_seq: 0 })
            .collect()
    }

    #[test]
    fn withheld_cores_are_not_offered() {
        let v = View::default();
        let mut a = node("a", 4, 1, NodeState::Up);
        a.withheld_cores = 2;
        let mut b = node("b", 4, 0, NodeState::Up);
        b.withheld_cores = 4;
        v.replace_all(read(vec![a, b]));
        assert_eq!(v.candidates(1, 1, &[]), [("a".to_string(), 1)]);
    }

    #[test]
    fn a_draining_node_shrinks_with_its_leases_and_is_not_offered() {
        let v = View::default();
        let caps = |v: &View| {
            v.get("a").map(|n| {
                (
                    n.cores,
                    n.leased_cores,
                    n.draining_cores,
                    n.memory_mib,
                    n.leased_memory_mib,
                    n.draining_memory_mib,
                )
            })
        };
        // Registered as 1 core and 1000 MiB while 4 and 2048 are leased.
        let mut a = node("a", 4, 4, NodeState::Up);
        (a.draining_cores, a.memory_mib, a.leased_memory_mib) = (3, 2048, 2048);
        a.draining_memory_mib = 1048;
        v.replace_all(read(vec![a]));
        assert!(v.candidates(1, 1, &[]).is_empty());
        // A release another replica announces: 1 core and 1024 MiB left.
        assert!(v.set_leased("a", 1, 1024, 1));
        assert_eq!(caps(&v), Some((1, 1, 0, 1024, 1024, 24)));
        assert!(v.candidates(1, 1, &[]).is_empty(), "memory still drains");
        // A reload that read the row before that release keeps the newer
        // counters and the capacity they settle.
        let mut old = node("a", 4, 4, NodeState::Up);
        (old.draining_cores, old.memory_mib, old.leased_memory_mib) = (3, 2048, 2048);
        old.draining_memory_mib = 1048;
        v.upsert(StoredNode {
            node: old,
            lease_seq: 0,
        });
        assert_eq!(caps(&v), Some((1, 1, 0, 1024, 1024, 24)));
        // Every lease gone: what the node registered.
        assert!(v.set_leased("a", 0, 0, 2));
        assert_eq!(caps(&v), Some((1, 0, 0, 1000, 0, 0)));
        assert_eq!(v.candidates(1000, 1, &[]), [("a".to_string(), 1)]);
        assert!(v.candidates(1001, 1, &[]).is_empty());
    }

    #[test]
    fn the_offer_counts_every_node_ever_registered_at_its_registered_size() {
        let v = View::default();
        assert_eq!(v.offer(1).nodes, 0);
        let mut a = node("a", 2, 0, NodeState::Lost);
        a.memory_mib = 2048;
        let mut b = node("b", 2, 0, NodeState::Up);
        b.withheld_cores = 2;
        // Registered at 4 cores and 512 MiB under 6 and 600 leased.
        let mut c = node("c", 6, 6, NodeState::Drained);
        (c.draining_cores, c.memory_mib, c.leased_memory_mib) = (2, 600, 600);
        c.draining_memory_mib = 88;
        v.replace_all(read(vec![a, b, c]));
        let offer = |m| {
            let o = v.offer(m);
            (
                o.nodes,
                o.largest_node_cores,
                o.largest_node_memory_mib,
                o.cluster_cores,
                o.cores_with_memory,
            )
        };
        assert_eq!(offer(1), (3, 4, 2048, 8, 8));
        assert_eq!(offer(512), (3, 4, 2048, 8, 8));
        assert_eq!(offer(513), (3, 4, 2048, 8, 4));
        assert_eq!(offer(1024), (3, 4, 2048, 8, 4));
        assert_eq!(offer(1025), (3, 4, 2048, 8, 2));
        assert_eq!(offer(2049), (3, 4, 2048, 8, 0));
        // A heartbeat changes nothing; a registration does.
        v.upsert(StoredNode {
            node: node("b", 2, 1, NodeState::Up),
            lease_seq: 1,
        });
        assert_eq!(offer(1), (3, 4, 2048, 8, 8));
        v.upsert(StoredNode {
            node: node("d", 16, 0, NodeState::Up),
            lease_seq: 0,
        });
        assert_eq!(offer(1024), (4, 16, 2048, 24, 20));
        // Released leases leave what c registered.
        assert!(v.set_leased("c", 0, 0, 1));
        assert_eq!(offer(1), (4, 16, 2048, 24, 24));
    }

    #[test]
    fn candidates_put_preferences_first_and_skip_what_cannot_serve() {
        let v = View::default();
        v.replace_all(read(vec![
            node("a", 4, 0, NodeState::Up),
            node("b", 4, 4, NodeState::Up),
            node("c", 4, 1, NodeState::Up),
            node("d", 4, 0, NodeState::Drained),
            node("e", 4, 0, NodeState::Lost),
        ]));
        let c = v.candidates(64, 1, &["c".into(), "d".into(), "zz".into()]);
        assert_eq!(c[0], ("c".to_string(), 3));
        assert_eq!(c.len(), 2, "{c:?}");
        assert_eq!(c[1], ("a".to_string(), 4));
        assert!(v.candidates(2048, 1, &[]).is_empty(), "memory must fit");
    }

    #[test]
    fn the_newest_leased_counters_win_whatever_their_order() {
        let v = View::default();
        let leased = |v: &View| v.get("a").map(|n| (n.leased_cores, n.leased_memory_mib));
        v.replace_all(read(vec![node("a", 4, 1, NodeState::Up)]));
        // A grant's commit (seq 3), then an older batch (seq 2): kept.
        assert!(v.set_leased("a", 4, 512, 3));
        assert!(v.set_leased("a", 2, 256, 2));
        assert_eq!(leased(&v), Some((4, 512)));
        assert!(v.candidates(64, 1, &[]).is_empty(), "a is full");
        // A reload that read the row before seq 3: its other fields, not
        // its counters.
        let mut old = node("a", 8, 2, NodeState::Up);
        old.withheld_cores = 1;
        v.replace_all(vec![StoredNode {
            node: old.clone(),
            lease_seq: 2,
        }]);
        assert_eq!(leased(&v), Some((4, 512)));
        assert_eq!(
            v.get("a").map(|n| (n.cores, n.withheld_cores)),
            Some((8, 1))
        );
        assert_eq!(v.candidates(64, 1, &[]), [("a".to_string(), 3)]);
        // A heartbeat's read after a release (seq 4) takes over.
        old.leased_cores = 0;
        v.upsert(StoredNode {
            node: old,
            lease_seq: 4,
        });
        assert_eq!(leased(&v), Some((0, 0)));
        assert!(
            !v.set_leased("zz", 1, 1, 1),
            "an unknown node is read instead"
        );
    }

    #[test]
    fn placement_spreads_over_the_nodes_that_fit() {
        let v = View::default();
        v.replace_all(read(
            (0..8)
                .map(|k| node(&format!("n{k}"), 2, 0, NodeState::Up))
                .collect(),
        ));
        let firsts: std::collections::HashSet<String> = (0..200)
            .map(|_| v.candidates(1, 1, &[])[0].0.clone())
            .collect();
        assert!(firsts.len() >= 6, "placement is not randomised: {firsts:?}");
    }

    /// Checks the index, and a placement from it, against a walk of
    /// every node.
    fn check_against_a_walk(v: &View, memory_mib: u64, cores: u32, preferred: &[String]) {
        let nodes = v.nodes.read().unwrap_or_else(|p| p.into_inner());
        nodes.free.check(&nodes.map);
        let fits: HashMap<String, u32> = nodes
            .map
            .values()
            .map(|s| &s.node)
            .filter(|n| {
                n.state == NodeState::Up
                    && free::lendable(n) > 0
                    && memory_mib <= free::lendable_memory(n)
            })
            .map(|n| (n.name.clone(), free::lendable(n)))
            .collect();
        drop(nodes);
        let c = v.candidates(memory_mib, cores, preferred);
        let mut seen = std::collections::HashSet::new();
        for (name, free) in &c {
            assert_eq!(fits.get(name), Some(free), "{name} in {c:?}");
            assert!(seen.insert(name), "{name} twice in {c:?}");
        }
        let mut first: Vec<&String> = Vec::new();
        for p in preferred {
            if fits.contains_key(p) && !first.contains(&p) {
                first.push(p);
            }
        }
        let names: Vec<&String> = c.iter().map(|e| &e.0).collect();
        assert_eq!(names[..first.len()], first[..], "preferred first");
        let got: u64 = c.iter().map(|e| u64::from(e.1)).sum();
        let all: u64 = fits.values().map(|&f| u64::from(f)).sum();
        if all >= u64::from(cores) {
            assert!(got >= u64::from(cores), "{got} of {cores} cores: {c:?}");
        } else {
            assert_eq!(c.len(), fits.len(), "every node that fits");
        }
    }

    fn random_node(name: &str) -> NodeView {
        let state = match fastrand::u8(..8) {
            0 => NodeState::Lost,
            1 => NodeState::Drained,
            _ => NodeState::Up,
        };
        let mut n = node(name, fastrand::u32(..9), 0, state);
        n.leased_cores = fastrand::u32(..=n.cores + 1);
        n.withheld_cores = fastrand::u32(..3);
        n.draining_cores = fastrand::u32(..2);
        n.memory_mib = [0, 512, 1024, 4096, 65536][fastrand::usize(..5)];
        n.leased_memory_mib = fastrand::u64(..=n.memory_mib);
        n.draining_memory_mib = fastrand::u64(..=256);
        n
    }

    #[test]
    fn the_placement_index_agrees_with_a_walk_of_the_nodes() {
        fastrand::seed(27);
        let v = View::default();
        let names: Vec<String> = (0..300).map(|k| format!("n{k}")).collect();
        let pick = || names[fastrand::usize(..names.len())].clone();
        v.replace_all(read(names.iter().map(|n| random_node(n)).collect()));
        for step in 0..3000u64 {
            match fastrand::u8(..20) {
                0 => v.replace_all(read(
                    names
                        .iter()
                        .filter(|_| fastrand::bool())
                        .map(|n| random_node(n))
                        .collect(),
                )),
                1..=9 => v.upsert(StoredNode {
                    node: random_node(&pick()),
                    lease_seq: fastrand::u64(..step + 1),
                }),
                _ => {
                    let cores = fastrand::u32(..10);
                    let memory = fastrand::u64(..70_000);
                    v.set_leased(&pick(), cores, memory, step + 1);
                }
            }
            let preferred: Vec<String> = (0..fastrand::usize(..4)).map(|_| pick()).collect();
            let memory = [0, 1, 600, 2000, 5000, 60_000][fastrand::usize(..6)];
            check_against_a_walk(&v, memory, fastrand::u32(1..40), &preferred);
        }
    }

    #[test]
    fn a_grant_among_10000_nodes_reads_a_bounded_number_of_them() {
        // Bounded whatever the fleet's size: the nodes the request needs,
        // its preferred ones, and a fixed number of misses.
        const K: usize = 100;
        let v = View::default();
        let mut fleet: Vec<NodeView> = (0..10_000)
            .map(|k| {
                let mut n = node(&format!("n{k:05}"), 4, k % 4, NodeState::Up);
                n.memory_mib = 4096;
                n
            })
            .collect();
        for k in [17, 4242, 9999] {
            fleet[k].memory_mib = 65536;
        }
        v.replace_all(read(fleet));
        let preferred: Vec<String> = (0..10).map(|k| format!("n{:05}", k * 7)).collect();
        for (memory, prefer) in [(1024, &[][..]), (1024, &preferred[..]), (16384, &[][..])] {
            check_against_a_walk(&v, memory, 8, prefer);
            let p = v.place(memory, 8, prefer);
            assert!(
                p.looked <= K + prefer.len(),
                "{} nodes read for 8 cores at {memory} MiB",
                p.looked
            );
        }
        // Only three nodes have the memory: all three, found without a walk.
        let mut big: Vec<String> = v
            .candidates(16384, 8, &[])
            .into_iter()
            .map(|c| c.0)
            .collect();
        big.sort();
        assert_eq!(big, ["n00017", "n04242", "n09999"]);
    }

    fn instance(name: &str, slots: u32, used: u32, last_heartbeat_ms: u64) -> AccountingInstance {
        AccountingInstance {
            name: name.into(),
            provider: "tcp".into(),
            fabric_addr: "127.0.0.1:7400".into(),
            slots,
            used,
            last_heartbeat_ms,
        }
    }

    #[test]
    fn billing_skips_dead_instances_and_weighs_by_free_slots() {
        let v = View::default();
        v.replace_instances(vec![
            instance("big", 1000, 100, 50_000),
            instance("small", 100, 0, 50_000),
            instance("full", 10, 10, 50_000),
            instance("dead", 1000, 0, 1_000),
        ]);
        assert_eq!(v.instances_live(51_000, 10_000), (3, 1));
        let mut big_first = 0;
        for _ in 0..1000 {
            let c = v.billing_candidates(51_000, 10_000);
            let names: Vec<&str> = c.iter().map(|a| a.name.as_str()).collect();
            assert_eq!(names.len(), 3, "{names:?}");
            assert!(!names.contains(&"dead"), "{names:?}");
            assert_eq!(names[2], "full", "full instances go last: {names:?}");
            big_first += usize::from(names[0] == "big");
        }
        // 900 free against 100: "big" first about 90% of the time.
        assert!((800..980).contains(&big_first), "{big_first} of 1000");
    }

    #[test]
    fn slots_taken_count_until_the_next_reload() {
        let v = View::default();
        v.replace_instances(vec![instance("a", 2, 1, 0)]);
        let row = LeaseRow {
            view: rfaas_proto::manager::LeaseView {
                lease_id: 1,
                grant_id: 1,
                node: "n".into(),
                user: "u".into(),
                account: "a".into(),
                cores: 1,
                memory_mib: 1,
                issued_at: 0,
                expires_at: 1,
                state: rfaas_proto::manager::LeaseState::Active,
                job_id: None,
            },
            owner: "user:u".into(),
            billing: Some(rfaas_proto::accounting::BillingSlot {
                instance: "a".into(),
                provider: "tcp".into(),
                addr: "127.0.0.1:7400".into(),
                slot: 0,
            }),
        };
        v.apply_slots(&[row]);
        let c = v.billing_candidates(0, 10);
        assert_eq!((c.len(), c[0].free()), (1, 0));
    }
}

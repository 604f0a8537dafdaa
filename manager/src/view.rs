//! Each replica's in-memory view of the nodes: what placement reads, so a
//! grant needs no query to choose its nodes.
//!
//! The view is a cache, never the truth: a grant's conditional updates in
//! the database decide. It is kept fresh three ways: this replica applies
//! its own changes at once; on PostgreSQL every change is announced on the
//! `rfaas_nodes` channel (`LISTEN/NOTIFY`) and each other replica reloads
//! the nodes named; and every `refresh_ms` each replica reloads all nodes,
//! which also covers notifications lost while a connection was down.

use std::collections::HashMap;
use std::sync::RwLock;

use rfaas_proto::manager::{NodeState, NodeView};

use crate::store::LeaseRow;

/// The view.
#[derive(Debug, Default)]
pub struct View {
    nodes: RwLock<HashMap<String, NodeView>>,
}

impl View {
    /// Replaces the whole view.
    pub fn replace_all(&self, nodes: Vec<NodeView>) {
        let map = nodes.into_iter().map(|n| (n.name.clone(), n)).collect();
        *self.nodes.write().unwrap_or_else(|p| p.into_inner()) = map;
    }

    /// Adds or replaces one node.
    pub fn upsert(&self, node: NodeView) {
        self.nodes
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .insert(node.name.clone(), node);
    }

    /// One node.
    pub fn get(&self, name: &str) -> Option<NodeView> {
        self.nodes
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(name)
            .cloned()
    }

    /// Every node, by name.
    pub fn all(&self) -> Vec<NodeView> {
        let mut v: Vec<NodeView> = self
            .nodes
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .cloned()
            .collect();
        v.sort_by(|a, b| a.name.cmp(&b.name));
        v
    }

    /// Nodes to try for a lease of `memory_mib` per node, with their free
    /// cores: the `preferred` ones first, in the order given, then the
    /// others in random order, so that grants spread over the pool.
    pub fn candidates(&self, memory_mib: u64, preferred: &[String]) -> Vec<(String, u32)> {
        let nodes = self.nodes.read().unwrap_or_else(|p| p.into_inner());
        let fits = |n: &NodeView| {
            n.state == NodeState::Up
                && n.leased_cores < n.cores
                && n.leased_memory_mib.saturating_add(memory_mib) <= n.memory_mib
        };
        let mut out: Vec<(String, u32)> = preferred
            .iter()
            .filter_map(|p| nodes.get(p))
            .filter(|n| fits(n))
            .map(|n| (n.name.clone(), n.cores - n.leased_cores))
            .collect();
        let mut rest: Vec<(String, u32)> = nodes
            .values()
            .filter(|n| fits(n) && !preferred.contains(&n.name))
            .map(|n| (n.name.clone(), n.cores - n.leased_cores))
            .collect();
        rest.sort();
        fastrand::shuffle(&mut rest);
        out.extend(rest);
        out
    }

    /// Applies leases this replica granted (`sign` 1) or ended (`sign` -1).
    pub fn apply(&self, leases: &[LeaseRow], granted: bool) {
        let mut nodes = self.nodes.write().unwrap_or_else(|p| p.into_inner());
        for l in leases {
            if let Some(n) = nodes.get_mut(&l.view.node) {
                if granted {
                    n.leased_cores = n.leased_cores.saturating_add(l.view.cores);
                    n.leased_memory_mib = n.leased_memory_mib.saturating_add(l.view.memory_mib);
                } else {
                    n.leased_cores = n.leased_cores.saturating_sub(l.view.cores);
                    n.leased_memory_mib = n.leased_memory_mib.saturating_sub(l.view.memory_mib);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(name: &str, cores: u32, leased: u32, state: NodeState) -> NodeView {
        NodeView {
            name: name.into(),
            state,
            control_addr: "127.0.0.1:1".into(),
            providers: vec![],
            cores,
            memory_mib: 1024,
            leased_cores: leased,
            leased_memory_mib: 0,
            last_heartbeat_ms: 0,
            harvested: false,
        }
    }

    #[test]
    fn candidates_put_preferences_first_and_skip_what_cannot_serve() {
        let v = View::default();
        v.replace_all(vec![
            node("a", 4, 0, NodeState::Up),
            node("b", 4, 4, NodeState::Up),
            node("c", 4, 1, NodeState::Up),
            node("d", 4, 0, NodeState::Drained),
            node("e", 4, 0, NodeState::Lost),
        ]);
        let c = v.candidates(64, &["c".into(), "d".into(), "zz".into()]);
        assert_eq!(c[0], ("c".to_string(), 3));
        assert_eq!(c.len(), 2, "{c:?}");
        assert_eq!(c[1], ("a".to_string(), 4));
        assert!(v.candidates(2048, &[]).is_empty(), "memory must fit");
    }

    #[test]
    fn placement_spreads_over_the_nodes_that_fit() {
        let v = View::default();
        v.replace_all(
            (0..8)
                .map(|k| node(&format!("n{k}"), 2, 0, NodeState::Up))
                .collect(),
        );
        let firsts: std::collections::HashSet<String> = (0..200)
            .map(|_| v.candidates(1, &[])[0].0.clone())
            .collect();
        assert!(firsts.len() >= 6, "placement is not randomised: {firsts:?}");
    }
}

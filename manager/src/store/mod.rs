//! Every read and write of the manager's state, each one transaction,
//! one file per resource.
//!
//! See [`crate::db`] for the rules these statements follow (one SQL text
//! for both databases, conditional updates for counters, lock order).
//!
//! - [`nodes`]: registrations, heartbeats, drains, lost nodes.
//! - [`grants`]: a lease request from the view's candidates to the
//!   outcome ([`Store::request`]), and the one grant transaction.
//! - [`leases`]: renewals, releases, expiries, listings.
//! - [`billing`]: accounting instances and their billing slots.
//! - [`budgets`]: accounts' budgets and spend.
//! - [`credentials`]: node and user credentials.
//! - [`jobs`]: a Slurm job's end.
//! - [`retention`]: purging ended leases, their usage rolled up per day.

mod billing;
mod budgets;
mod credentials;
mod grants;
mod jobs;
mod leases;
mod nodes;
mod retention;

use std::sync::Arc;

use sqlx::{Any, AnyPool, Transaction};

use crate::announce::{Announcer, Leased};
use crate::db::{Backend, DbError};
use crate::view::View;

pub use billing::AccountingInstance;
pub use credentials::role_name;
pub use grants::{Beyond, Denied, Grant, GrantOutcome, GrantPlan, LeaseAsk, Refused};
pub use leases::{lease_state_name, LeaseFilter, LeaseRow};
pub use nodes::{nodes_in_sql, StoredNode, LIVENESS};
pub use retention::{Purged, DAY_MS};

/// The manager's database.
#[derive(Debug, Clone)]
pub struct Store {
    pool: AnyPool,
    backend: Backend,
    /// This replica's name in its notices: random per process.
    origin: String,
    /// Where committed leased counters go: this replica's view, if it has
    /// one ([`Store::with_view`]), and the other replicas, on PostgreSQL.
    announcer: Option<Arc<Announcer>>,
    view: Option<Arc<View>>,
}

/// What a notice on `rfaas_nodes` says of one node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Announced<'a> {
    /// `<node>`: it changed; read it again.
    Changed(&'a str),
    /// `<node>=<cores>/<memory_mib>/<seq>`: what it has leased since the
    /// commit that set its `lease_seq` to `seq` (a grant or a release),
    /// nothing else changed. Batches arrive out of commit order: the
    /// highest `seq` is the node's state.
    Leased {
        node: &'a str,
        cores: u32,
        memory_mib: u64,
        seq: u64,
    },
}

impl<'a> Announced<'a> {
    /// The node it is about.
    pub fn node(&self) -> &'a str {
        match *self {
            Announced::Changed(node) | Announced::Leased { node, .. } => node,
        }
    }

    fn parse(entry: &'a str) -> Announced<'a> {
        let leased = entry.split_once('=').and_then(|(node, counts)| {
            let mut counts = counts.split('/');
            let cores = counts.next()?.parse().ok()?;
            let memory_mib = counts.next()?.parse().ok()?;
            let seq = counts.next()?.parse().ok()?;
            counts.next().is_none().then_some(Announced::Leased {
                node,
                cores,
                memory_mib,
                seq,
            })
        });
        // Anything else names a node to read again (node names have no
        // `=`): a notice this replica cannot read costs a query, not a
        // stale view.
        leased.unwrap_or(Announced::Changed(entry.split('=').next().unwrap_or(entry)))
    }
}

/// A notice on `rfaas_nodes`, `<origin>:<entry>,<entry>...`: the replica
/// that sent it (`None` from a replica that did not say) and what changed
/// (see [`Announced`]).
pub fn notice(payload: &str) -> (Option<&str>, Vec<Announced<'_>>) {
    let (origin, entries) = match payload.split_once(':') {
        Some((origin, entries)) => (Some(origin), entries),
        None => (None, payload),
    };
    (
        origin,
        entries
            .split(',')
            .filter(|n| !n.is_empty())
            .map(Announced::parse)
            .collect(),
    )
}

/// A new random id: 53 bits, so that JSON readers that hold numbers as
/// doubles read it exactly.
pub fn new_id() -> u64 {
    fastrand::u64(1..1 << 53)
}

impl Store {
    /// Wraps an open, migrated pool.
    pub fn new(pool: AnyPool, backend: Backend) -> Store {
        let origin = format!("{:016x}", fastrand::u64(..));
        Store {
            announcer: (backend == Backend::Postgres)
                .then(|| Arc::new(Announcer::new(pool.clone(), origin.clone()))),
            pool,
            backend,
            origin,
            view: None,
        }
    }

    /// This store, applying every grant's and release's counters to `view`
    /// as it commits them.
    pub fn with_view(mut self, view: Arc<View>) -> Store {
        self.view = Some(view);
        self
    }

    /// After a commit: the leased counters it left go into this replica's
    /// view at once and to the other replicas with the next batch.
    fn committed(&self, leased: &[Leased]) {
        if let Some(view) = &self.view {
            for l in leased {
                view.set_leased(&l.node, l.cores, l.memory_mib, l.seq);
            }
        }
        if let Some(a) = &self.announcer {
            a.queue(leased);
        }
    }

    /// The origin this replica's notices carry (see [`notice`]).
    pub fn origin(&self) -> &str {
        &self.origin
    }

    /// The backend.
    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// The pool, for the PostgreSQL listener and benchmarks.
    pub fn pool(&self) -> &AnyPool {
        &self.pool
    }

    /// Tells every replica that these nodes changed (PostgreSQL; on SQLite
    /// the periodic reload covers other processes). Delivered at commit;
    /// the notice names this replica, which applies its own changes to its
    /// view and need not reload them.
    async fn notify(
        &self,
        tx: &mut Transaction<'static, Any>,
        nodes: &[&str],
    ) -> Result<(), DbError> {
        self.announce(tx, nodes.join(",")).await
    }

    async fn announce(
        &self,
        tx: &mut Transaction<'static, Any>,
        entries: String,
    ) -> Result<(), DbError> {
        if self.backend == Backend::Postgres && !entries.is_empty() {
            sqlx::query("SELECT COUNT(*) AS n FROM (SELECT pg_notify('rfaas_nodes', $1)) AS sent")
                .bind(format!("{}:{entries}", self.origin))
                .execute(&mut **tx)
                .await?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notices_name_their_replica_and_nodes() {
        use Announced::{Changed, Leased};
        assert_eq!(
            notice("00ab:n1,n-2.x@y"),
            (Some("00ab"), vec![Changed("n1"), Changed("n-2.x@y")])
        );
        // From a replica that did not say who it is: reloaded by every one.
        assert_eq!(notice("n1,n2"), (None, vec![Changed("n1"), Changed("n2")]));
        assert_eq!(notice("00ab:"), (Some("00ab"), vec![]));
        // Grants and releases carry the node's counters after the commit
        // and its lease_seq.
        assert_eq!(
            notice("00ab:n1=3/4096/17,n2=0/0/2"),
            (
                Some("00ab"),
                vec![
                    Leased {
                        node: "n1",
                        cores: 3,
                        memory_mib: 4096,
                        seq: 17
                    },
                    Leased {
                        node: "n2",
                        cores: 0,
                        memory_mib: 0,
                        seq: 2
                    }
                ]
            )
        );
        // What cannot be read, or counters without their seq (a replica
        // of an older release), names a node to read again.
        assert_eq!(
            notice("00ab:n1=x/1/1,n2=3,n3=3/4096,n4=1/2/3/4"),
            (
                Some("00ab"),
                vec![Changed("n1"), Changed("n2"), Changed("n3"), Changed("n4")]
            )
        );
        assert_eq!(Changed("n1").node(), "n1");
    }
}

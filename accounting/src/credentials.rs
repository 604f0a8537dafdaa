//! Who may add: executor daemons, which show the accounting ticket the
//! manager gave them in their hello. A ticket is checked without the
//! database first (its layout, its Ed25519 signature under the manager's
//! `lease_keys`, its expiry), so a stranger costs no query; then the node
//! credential it names must be live in the manager's `credentials` table:
//! a node's, for the ticket's node, neither revoked nor expired. The
//! listener asks again every [`WATCH`] for the credentials its
//! connections were admitted under ([`Verifier::live`]) and closes those
//! that stopped being live.

use std::collections::HashSet;
use std::time::Duration;

use rfaas_proto::lease::LeaseKeys;
use rfaas_proto::manager::Role;
use rfaas_proto::ticket::{AccountingTicket, TicketClaims};
use rfaas_service::credentials::{self, CredentialRow};
use rfaas_service::db::DbError;
use sqlx::AnyPool;

/// How often the credentials of live connections are looked at: a
/// revoked node's connections close within this and a query's time.
pub const WATCH: Duration = Duration::from_secs(1);

/// Most credential ids in one query.
const IDS_PER_QUERY: usize = 500;

/// What a hello's ticket is worth.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// A live node credential's ticket.
    Node {
        /// The node it was issued to.
        node: String,
        /// Its credential's id.
        credential_id: String,
    },
    /// Refused, and why (for the log).
    Refused(String),
    /// The database cannot answer now.
    Unavailable(String),
}

/// Checks tickets and the credentials they name.
#[derive(Debug)]
pub struct Verifier {
    pool: AnyPool,
    keys: LeaseKeys,
}

/// Whether `row` is a live node credential of `node` at `now_s`; why not.
fn live_for(row: &CredentialRow, node: &str, now_s: u64) -> Result<(), &'static str> {
    if row.revoked {
        Err("the credential was revoked")
    } else if row.expires_at != 0 && now_s >= row.expires_at {
        Err("the credential expired")
    } else if row.role != Role::Node {
        Err("the credential is not a node's")
    } else if row.subject != node {
        Err("the credential is another node's")
    } else {
        Ok(())
    }
}

impl Verifier {
    /// Checks signatures with `keys` and credentials in `pool`'s database.
    pub fn new(pool: AnyPool, keys: LeaseKeys) -> Verifier {
        Verifier { pool, keys }
    }

    /// The verdict on `ticket` at `now_s` (Unix seconds).
    pub async fn check(&self, ticket: &AccountingTicket, now_s: u64) -> Verdict {
        let TicketClaims {
            node,
            credential_id,
            ..
        } = match ticket.verify(&self.keys, now_s) {
            Ok(c) => c,
            Err(e) => return Verdict::Refused(e.to_string()),
        };
        match credentials::find(&self.pool, &credential_id).await {
            Err(e) => Verdict::Unavailable(e.to_string()),
            Ok(None) => Verdict::Refused(format!(
                "the ticket names credential {credential_id}, which does not exist (deleted)"
            )),
            Ok(Some(row)) => match live_for(&row, &node, now_s) {
                Ok(()) => Verdict::Node {
                    node,
                    credential_id,
                },
                Err(why) => Verdict::Refused(format!("{why} (credential {credential_id})")),
            },
        }
    }

    /// Of the connections admitted under `(credential id, node)`, the
    /// credential ids still live at `now_s`: a revoked, expired or deleted
    /// credential is not among them.
    ///
    /// # Errors
    ///
    /// The database's failure: nothing is known then.
    pub async fn live(
        &self,
        admitted: &[(String, String)],
        now_s: u64,
    ) -> Result<HashSet<String>, DbError> {
        let mut live = HashSet::new();
        let mut ids: Vec<&str> = admitted.iter().map(|(id, _)| id.as_str()).collect();
        ids.sort_unstable();
        ids.dedup();
        for chunk in ids.chunks(IDS_PER_QUERY) {
            let marks: Vec<String> = (1..=chunk.len()).map(|i| format!("${i}")).collect();
            let sql = format!(
                "SELECT {} FROM credentials WHERE id IN ({})",
                credentials::COLUMNS,
                marks.join(", ")
            );
            let mut q = sqlx::query(&sql);
            for id in chunk {
                q = q.bind(*id);
            }
            for row in q.fetch_all(&self.pool).await? {
                let row = credentials::from_row(&row)?;
                let node_ok = admitted
                    .iter()
                    .any(|(id, node)| *id == row.id && live_for(&row, node, now_s).is_ok());
                if node_ok {
                    live.insert(row.id);
                }
            }
        }
        Ok(live)
    }
}

//! `rfaas-billing`'s reports: usage and cost per user, account, job, node
//! or lease over a period, and the accounts' budgets.
//!
//! The usage of a lease in a period `[S, E)` is its totals at `E` minus its
//! totals at `S`, where a lease's totals at a time are those of its latest
//! snapshot (`usage_snapshots`) at or before that time, zero if none, and
//! its current totals (`usage`) when `E` is now or later. A report's period
//! edges are therefore only as fine as the accounting service's
//! `snapshot_interval`: usage flushed after the last snapshot before an
//! edge counts on the far side of it.
//!
//! Each lease is priced on its own (the harvested discount depends on the
//! lease) with the rates of `billing.toml`, then leases are summed into
//! rows.
//!
//! - [`time`]: the times of the command line, local as in `sacct`.
//! - [`api`]: the manager's `GET /v1/usage`, with the caller's credential:
//!   the default source of reports.
//! - [`query`]: the database (admins): connecting, the leases' usage in a period,
//!   the names a filter may give.
//! - [`format`]: the fields of `--format` and the table, `--parsable2`,
//!   CSV and JSON outputs.
//! - [`budgets`]: `rfaas-billing budget`: budgets, spend and what remains.

pub mod api;
pub mod budgets;
pub mod format;
pub mod query;
pub mod time;

use std::collections::BTreeMap;

use rfaas_proto::accounting::UsageFigures;

use crate::rates::{Rates, RatesError};

/// Why `rfaas-billing` cannot answer; each kind has its exit status
/// ([`BillingError::exit_code`]).
#[derive(Debug, thiserror::Error)]
pub enum BillingError {
    /// The command line is wrong (a time, a field, an amount): fix it.
    #[error("{0}")]
    Usage(String),
    /// `billing.toml` (or the manager's configuration) cannot be used.
    #[error(transparent)]
    Config(#[from] RatesError),
    /// The manager's configuration, read for its database, cannot be used.
    #[error("{0}")]
    ManagerConfig(String),
    /// A filter names a user, account or job no lease ever had, or
    /// `budget clear` an account without a budget.
    #[error("{0}")]
    Unknown(String),
    /// The database cannot be reached or opened.
    #[error("cannot use the database {url}: {why}; check the URL (--database, else `database` in the billing configuration, else the manager's) and that the database server runs")]
    Unreachable {
        /// The URL, without its password.
        url: String,
        /// Why.
        why: String,
    },
    /// A query failed.
    #[error("database error: {0}")]
    Database(String),
    /// No manager could be reached: each URL tried, and why.
    #[error("no manager answered; tried {0}. Check --manager (or RFAAS_MANAGERS) and that rfaas-manager runs there")]
    NoManager(String),
    /// The manager refused the credential.
    #[error("{0}; give your credential with --credential-file FILE or RFAAS_CREDENTIAL (an admin: the admin token's file)")]
    Refused(String),
}

impl BillingError {
    /// The process's exit status for this error: 1 a failed query, 2 a
    /// wrong command line, 3 a bad configuration, 4 an unknown user,
    /// account or job, 5 an unreachable database or manager, 6 a credential
    /// the manager refused.
    pub fn exit_code(&self) -> u8 {
        match self {
            BillingError::Database(_) => 1,
            BillingError::Usage(_) => 2,
            BillingError::Config(_) | BillingError::ManagerConfig(_) => 3,
            BillingError::Unknown(_) => 4,
            BillingError::Unreachable { .. } | BillingError::NoManager(_) => 5,
            BillingError::Refused(_) => 6,
        }
    }
}

impl From<sqlx::Error> for BillingError {
    fn from(e: sqlx::Error) -> BillingError {
        BillingError::Database(e.to_string())
    }
}

impl From<rfaas_service::db::DbError> for BillingError {
    fn from(e: rfaas_service::db::DbError) -> BillingError {
        BillingError::Database(e.to_string())
    }
}

/// What rows are totals of (`--by`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Key {
    /// The lease's user.
    User,
    /// The lease's account.
    Account,
    /// The batch job the lease was taken for (none for leases outside a
    /// job).
    Job,
    /// The node the lease was on.
    Node,
    /// The lease itself: a row per lease.
    Lease,
}

impl Key {
    /// Every key, as `--by` names them.
    pub const ALL: [(Key, &'static str); 5] = [
        (Key::User, "user"),
        (Key::Account, "account"),
        (Key::Job, "job"),
        (Key::Node, "node"),
        (Key::Lease, "lease"),
    ];

    /// Its name on the command line.
    pub fn name(self) -> &'static str {
        Key::ALL.iter().find(|k| k.0 == self).map_or("?", |k| k.1)
    }

    /// The keys named by a comma list, in its order, each once.
    pub fn parse_list(list: &str) -> Result<Vec<Key>, BillingError> {
        let mut keys = Vec::new();
        for name in list.split(',').map(str::trim) {
            let key = Key::ALL
                .iter()
                .find(|k| k.1.eq_ignore_ascii_case(name))
                .map(|k| k.0)
                .ok_or_else(|| {
                    BillingError::Usage(format!(
                        "--by {name:?}: rows are totals by user, account, job, node or lease (or a comma list of them)"
                    ))
                })?;
            if !keys.contains(&key) {
                keys.push(key);
            }
        }
        Ok(keys)
    }
}

pub use rfaas_service::usage::{Filters, LeaseUsage, Period};

/// One row of a report: the totals of the leases that share its keys.
/// The descriptive fields are set only where the grouping fixes them
/// (all of them for a row per lease).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Row {
    /// The user.
    pub user: Option<String>,
    /// The account.
    pub account: Option<String>,
    /// The job (`None` also for a lease outside a job).
    pub job: Option<u64>,
    /// The node.
    pub node: Option<String>,
    /// The lease.
    pub lease: Option<u64>,
    /// Whether the lease was on harvested capacity.
    pub harvested: Option<bool>,
    /// How many leases the row sums.
    pub leases: u64,
    /// Their usage.
    pub usage: UsageFigures,
    /// Their cost.
    pub cost: f64,
}

/// A row's place in the report: its keys, compared as they print.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum Sort {
    Text(String),
    Number(Option<u64>),
}

/// Sums priced leases into rows by `by`, sorted by their keys in `by`'s
/// order (names alphabetically, jobs and leases by number, no job first).
pub fn group(leases: &[LeaseUsage], by: &[Key], rates: &Rates) -> Vec<Row> {
    let mut rows: BTreeMap<Vec<Sort>, Row> = BTreeMap::new();
    for l in leases {
        let sort = by
            .iter()
            .map(|k| match k {
                Key::User => Sort::Text(l.user.clone()),
                Key::Account => Sort::Text(l.account.clone()),
                Key::Job => Sort::Number(l.job),
                Key::Node => Sort::Text(l.node.clone()),
                Key::Lease => Sort::Number(Some(l.lease)),
            })
            .collect();
        let row = rows.entry(sort).or_insert_with(|| {
            let per_lease = by.contains(&Key::Lease);
            let keep = |k: Key| per_lease || by.contains(&k);
            Row {
                user: keep(Key::User).then(|| l.user.clone()),
                account: keep(Key::Account).then(|| l.account.clone()),
                job: if keep(Key::Job) { l.job } else { None },
                node: keep(Key::Node).then(|| l.node.clone()),
                lease: per_lease.then_some(l.lease),
                harvested: per_lease.then_some(l.harvested),
                ..Row::default()
            }
        });
        row.leases += 1;
        row.usage.add(&l.usage);
        row.cost += rates.cost(&l.usage, l.harvested);
    }
    rows.into_values().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lease(id: u64, user: &str, account: &str, job: Option<u64>, harvested: bool) -> LeaseUsage {
        LeaseUsage {
            lease: id,
            user: user.into(),
            account: account.into(),
            job,
            node: format!("n{}", id % 2),
            harvested,
            usage: UsageFigures {
                compute_ns: id * 1_000_000_000,
                invocations: id,
                ..UsageFigures::default()
            },
        }
    }

    const RATES: Rates = Rates {
        alloc_per_gib_s: 0.0,
        compute_per_s: 1.0,
        hot_per_s: 0.0,
        harvested_discount: 0.5,
    };

    #[test]
    fn rows_sum_leases_priced_one_by_one() {
        let leases = [
            lease(1, "bob", "physics", Some(7), false),
            lease(2, "alice", "physics", None, true),
            lease(3, "alice", "chem", Some(7), false),
        ];
        let rows = group(&leases, &[Key::Account], &RATES);
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[0].account.as_deref(), Some("chem"));
        assert_eq!((rows[1].leases, rows[1].usage.invocations), (2, 3));
        // Lease 2 is harvested: half of its 2 s.
        assert_eq!(rows[1].cost, 1.0 + 1.0);
        assert_eq!(rows[1].user, None, "not fixed by the account");

        let rows = group(&leases, &[Key::Job, Key::User], &RATES);
        let keys: Vec<_> = rows
            .iter()
            .map(|r| (r.job, r.user.clone().unwrap()))
            .collect();
        assert_eq!(
            keys,
            [
                (None, "alice".into()),
                (Some(7), "alice".into()),
                (Some(7), "bob".into())
            ]
        );

        let rows = group(&leases, &[Key::Lease], &RATES);
        assert_eq!(rows[1].lease, Some(2));
        assert_eq!(rows[1].harvested, Some(true));
        assert_eq!(rows[1].node.as_deref(), Some("n0"));
        assert_eq!(rows[0].job, Some(7));
    }

    #[test]
    fn by_takes_a_comma_list_of_known_keys() {
        assert_eq!(
            Key::parse_list("Account,user,account").unwrap(),
            [Key::Account, Key::User]
        );
        let e = Key::parse_list("account,project").unwrap_err().to_string();
        assert!(
            e.contains("\"project\"") && e.contains("user, account, job"),
            "{e}"
        );
    }
}

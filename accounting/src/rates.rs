//! `billing.toml`: the currency, the rates of the cost model, the
//! accounts' budgets, and optionally the database. The accounting service
//! prices what it flushes with it and `rfaas-billing` prices its reports
//! with it, so both read it here.
//!
//! The cost of a lease's usage (IPDPS'23's model):
//! `(1 - harvested_discount if on a harvested node) * (C_a*t_a + C_c*t_c + C_h*t_h)`,
//! with `t_a` the allocation in GiB-seconds (memory times time), `t_c` the
//! compute seconds and `t_h` the hot-polling seconds. Warm (blocked) time,
//! invocations and bytes are counted, not priced.
//!
//! Unknown keys are refused by name, as in every rfaas configuration
//! file: a misspelt rate is an error, never a silent zero.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use rfaas_proto::accounting::UsageFigures;
use serde::Deserialize;

/// `billing.toml`, checked.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BillingConfig {
    /// The label costs are given in (`"CHF"`); only printed.
    pub currency: String,
    /// The database the manager and the accounting services share; when
    /// absent, `rfaas-billing` uses the manager's (`manager.toml`).
    #[serde(default)]
    pub database: Option<String>,
    /// The PostgreSQL password's file for reports (mode 0600), when the
    /// database URL names none; default `database.password` in the
    /// configuration directory.
    #[serde(default)]
    pub database_password_file: Option<std::path::PathBuf>,
    /// The rates.
    pub rates: Rates,
    /// Budgets by account, in `currency`; `rfaas-billing budget sync`
    /// writes them into the database, where the manager reads them.
    #[serde(default)]
    pub budgets: BTreeMap<String, f64>,
}

/// `[rates]`: every key is required.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rates {
    /// `C_a`: per GiB-second of allocation.
    pub alloc_per_gib_s: f64,
    /// `C_c`: per second of compute.
    pub compute_per_s: f64,
    /// `C_h`: per second of hot polling.
    pub hot_per_s: f64,
    /// The fraction taken off the cost of leases on harvested (batch-idle)
    /// nodes, 0 to 1.
    pub harvested_discount: f64,
}

/// Why `billing.toml` cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum RatesError {
    /// The file cannot be read.
    #[error("cannot read the billing configuration {path}: {source}; {hint}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
        /// What names another file
        /// ([`ConfigDir::hint`](rfaas_proto::files::ConfigDir::hint)).
        hint: String,
    },
    /// The file is not valid TOML for billing, or a value is out of range.
    #[error("the billing configuration {path} is invalid: {message}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// What is wrong (it names the key).
        message: String,
    },
}

/// Allocation in GiB-seconds from the counter's MiB·ms.
pub fn alloc_gib_s(alloc_mib_ms: u64) -> f64 {
    alloc_mib_ms as f64 / 1024.0 / 1000.0
}

/// Seconds from nanoseconds.
pub fn seconds(ns: u64) -> f64 {
    ns as f64 / 1e9
}

impl Rates {
    /// The cost of `totals` (a lease's usage, or a delta of it), less the
    /// harvested discount if the lease ran on a harvested node.
    pub fn cost(&self, totals: &UsageFigures, harvested: bool) -> f64 {
        let full = self.alloc_per_gib_s * alloc_gib_s(totals.alloc_mib_ms)
            + self.compute_per_s * seconds(totals.compute_ns)
            + self.hot_per_s * seconds(totals.hot_ns);
        if harvested {
            (1.0 - self.harvested_discount) * full
        } else {
            full
        }
    }

    fn check(&self) -> Result<(), String> {
        for (name, v) in [
            ("alloc_per_gib_s", self.alloc_per_gib_s),
            ("compute_per_s", self.compute_per_s),
            ("hot_per_s", self.hot_per_s),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(format!(
                    "rates.{name} is {v}; a rate is a number of 0 or more"
                ));
            }
        }
        let d = self.harvested_discount;
        if !(0.0..=1.0).contains(&d) {
            return Err(format!(
                "rates.harvested_discount is {d}; it is the fraction taken off, from 0 to 1"
            ));
        }
        Ok(())
    }
}

/// Whether `amount` can be a budget: a finite number of 0 or more.
pub fn valid_budget(amount: f64) -> bool {
    amount.is_finite() && amount >= 0.0
}

impl BillingConfig {
    /// Reads, parses and checks `path`.
    /// `hint` ends the message when it cannot be read: what names another.
    pub fn load(path: &Path, hint: &str) -> Result<BillingConfig, RatesError> {
        let text = std::fs::read_to_string(path).map_err(|source| RatesError::Read {
            path: path.to_owned(),
            source,
            hint: hint.to_owned(),
        })?;
        Self::parse(&text).map_err(|message| RatesError::Invalid {
            path: path.to_owned(),
            message,
        })
    }

    /// Parses and checks configuration text; `Err` says what is wrong.
    pub fn parse(text: &str) -> Result<BillingConfig, String> {
        let c: BillingConfig = toml::from_str(text).map_err(|e| e.to_string())?;
        c.check()?;
        Ok(c)
    }

    fn check(&self) -> Result<(), String> {
        if self.currency.trim().is_empty() {
            return Err("currency is empty; give the label costs are in, such as \"CHF\"".into());
        }
        self.rates.check()?;
        if let Some(db) = &self.database {
            if !(db.starts_with("sqlite:") || db.starts_with("postgres")) {
                return Err(format!(
                    "database {db:?} is neither sqlite:///path nor postgres://..."
                ));
            }
        }
        for (account, &amount) in &self.budgets {
            if account.is_empty() {
                return Err("budgets has an empty account name".into());
            }
            if !valid_budget(amount) {
                return Err(format!(
                    "budgets.{account} is {amount}; a budget is a number of 0 or more"
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const RATES: &str = "currency = \"CHF\"\n[rates]\nalloc_per_gib_s = 0.0001\ncompute_per_s = 0.01\nhot_per_s = 0.005\nharvested_discount = 0.5\n";

    #[test]
    fn the_example_file_loads() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("billing.example.toml");
        let c = BillingConfig::load(&path, "").unwrap();
        assert_eq!(c.currency, "CHF");
        assert_eq!(
            c.rates,
            Rates {
                alloc_per_gib_s: 0.0001,
                compute_per_s: 0.01,
                hot_per_s: 0.005,
                harvested_discount: 0.5
            }
        );
        assert!(c.budgets.is_empty(), "no account's budget is shipped");
        assert_eq!(c.database, None);
    }

    #[test]
    fn unknown_keys_are_refused_by_name() {
        for (text, key) in [
            (format!("{RATES}curency = \"X\"\n"), "curency"),
            (format!("{RATES}compute_per_sec = 1.0\n"), "compute_per_sec"),
            (format!("{RATES}[budget]\nphysics = 1.0\n"), "budget"),
        ] {
            let err = BillingConfig::parse(&text).unwrap_err();
            assert!(err.contains(key), "{key}: {err}");
        }
        let c = BillingConfig::parse(&format!("database = \"sqlite:///b.db\"\n{RATES}")).unwrap();
        assert_eq!(c.database.as_deref(), Some("sqlite:///b.db"));
    }

    #[test]
    fn every_rate_is_required_and_checked() {
        let err = BillingConfig::parse("currency = \"CHF\"\n[rates]\nalloc_per_gib_s = 1.0\n")
            .unwrap_err();
        assert!(err.contains("compute_per_s"), "{err}");
        for (from, to, says) in [
            (
                "harvested_discount = 0.5",
                "harvested_discount = 1.5",
                "from 0 to 1",
            ),
            ("hot_per_s = 0.005", "hot_per_s = -1.0", "rates.hot_per_s"),
            (
                "compute_per_s = 0.01",
                "compute_per_s = nan",
                "rates.compute_per_s",
            ),
            (
                "currency = \"CHF\"",
                "currency = \" \"",
                "currency is empty",
            ),
        ] {
            let err = BillingConfig::parse(&RATES.replace(from, to)).unwrap_err();
            assert!(err.contains(says), "{to}: {err}");
        }
        let err = BillingConfig::parse(&format!("{RATES}[budgets]\nphysics = -3.0\n")).unwrap_err();
        assert!(err.contains("budgets.physics"), "{err}");
        let err = BillingConfig::parse(&format!("database = \"mysql://x\"\n{RATES}")).unwrap_err();
        assert!(err.contains("mysql"), "{err}");
    }

    #[test]
    fn cost_follows_the_model() {
        let rates = Rates {
            alloc_per_gib_s: 0.5,
            compute_per_s: 2.0,
            hot_per_s: 1.0,
            harvested_discount: 0.25,
        };
        let totals = UsageFigures {
            // 4 GiB-s, 3 s compute, 2 s hot; warm time, invocations and
            // bytes are not priced.
            alloc_mib_ms: 4 * 1024 * 1000,
            compute_ns: 3_000_000_000,
            hot_ns: 2_000_000_000,
            warm_ns: 7_000_000_000,
            invocations: 9,
            bytes_in: 10,
            bytes_out: 11,
        };
        assert_eq!(rates.cost(&totals, false), 2.0 + 6.0 + 2.0);
        assert_eq!(rates.cost(&totals, true), 7.5);
        assert_eq!(rates.cost(&UsageFigures::default(), true), 0.0);
    }
}

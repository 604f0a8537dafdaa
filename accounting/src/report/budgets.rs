//! `rfaas-billing budget`: the `budgets` table the manager reads on every
//! grant (an account whose spend has reached its budget gets no new
//! lease), next to the `account_spend` the accounting services keep.
//! Writes go through [`rfaas_service::budgets`], as the manager's do.

use std::collections::BTreeMap;

use rfaas_service::{budgets, db};
use serde_json::{json, Map};
use sqlx::{AnyPool, Row};

use super::format::{Cell, Sheet, MONEY_DECIMALS};
use super::BillingError;

/// An account's budget and spend.
#[derive(Debug, Clone, PartialEq)]
pub struct Budget {
    /// The account.
    pub account: String,
    /// Its budget (`None`: it has none and is never refused for spend).
    pub budget: Option<f64>,
    /// What its leases have cost so far, as the accounting services
    /// flushed it.
    pub spend: f64,
}

impl Budget {
    /// What is left, negative once overspent (leases granted before the
    /// budget ran out run to their end); `None` without a budget.
    pub fn remaining(&self) -> Option<f64> {
        self.budget.map(|b| b - self.spend)
    }
}

/// Sets `account`'s budget to `amount`; returns the one it replaced.
pub async fn set(
    pool: &AnyPool,
    account: &str,
    amount: f64,
    now_ms: u64,
) -> Result<Option<f64>, BillingError> {
    let mut tx = pool.begin().await?;
    let old = budgets::set(&mut tx, account, amount, now_ms).await?;
    tx.commit().await?;
    Ok(old)
}

/// Removes `account`'s budget; `Unknown` if it had none.
pub async fn clear(pool: &AnyPool, account: &str) -> Result<f64, BillingError> {
    budgets::clear(&mut *pool.acquire().await?, account)
        .await?
        .ok_or_else(|| {
            BillingError::Unknown(format!(
                "account {account:?} has no budget; `rfaas-billing budget list` shows those that do"
            ))
        })
}

/// Every account with a budget or a spend, by name; only `accounts` if
/// not empty.
pub async fn list(pool: &AnyPool, accounts: &[String]) -> Result<Vec<Budget>, BillingError> {
    let mut all: BTreeMap<String, Budget> = BTreeMap::new();
    let wanted = |a: &str| accounts.is_empty() || accounts.iter().any(|x| x == a);
    for row in sqlx::query("SELECT account, budget FROM budgets")
        .fetch_all(pool)
        .await?
    {
        let account = db::text_col(&row, "account")?;
        if wanted(&account) {
            all.insert(
                account.clone(),
                Budget {
                    account,
                    budget: Some(row.try_get("budget")?),
                    spend: 0.0,
                },
            );
        }
    }
    for row in sqlx::query("SELECT account, spend FROM account_spend")
        .fetch_all(pool)
        .await?
    {
        let account = db::text_col(&row, "account")?;
        if wanted(&account) {
            all.entry(account.clone())
                .or_insert(Budget {
                    account,
                    budget: None,
                    spend: 0.0,
                })
                .spend = row.try_get("spend")?;
        }
    }
    Ok(all.into_values().collect())
}

/// Writes `budgets` (billing.toml's `[budgets]`) into the database; returns
/// each account with the budget it had before (equal ones are not
/// rewritten). Budgets the file does not name are left as they are.
pub async fn sync(
    pool: &AnyPool,
    budgets: &BTreeMap<String, f64>,
    now_ms: u64,
) -> Result<Vec<(String, f64, Option<f64>)>, BillingError> {
    let mut out = Vec::new();
    for (account, &amount) in budgets {
        let before = budgets::current(&mut *pool.acquire().await?, account).await?;
        if before != Some(amount) {
            set(pool, account, amount, now_ms).await?;
        }
        out.push((account.clone(), amount, before));
    }
    Ok(out)
}

/// The budgets as a sheet for any output; amounts in `currency`.
pub fn sheet(budgets: &[Budget], currency: Option<&str>) -> Sheet {
    let money = |v: Option<f64>| Cell::Real(v, MONEY_DECIMALS);
    let mut meta = Map::new();
    meta.insert("currency".into(), json!(currency));
    Sheet {
        title: match currency {
            Some(c) => format!("Budgets and spend in {c}"),
            None => "Budgets and spend".into(),
        },
        columns: vec![
            ("Account", "account"),
            ("Budget", "budget"),
            ("Spend", "spend"),
            ("Remaining", "remaining"),
        ],
        right: vec![false, true, true, true],
        rows: budgets
            .iter()
            .map(|b| {
                vec![
                    Cell::Text(Some(b.account.clone())),
                    money(b.budget),
                    money(Some(b.spend)),
                    money(b.remaining()),
                ]
            })
            .collect(),
        meta,
    }
}

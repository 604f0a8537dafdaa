//! Accounts' budgets, with the spend the accounting services price.

use rfaas_proto::manager::BudgetView;
use rfaas_service::budgets;
use sqlx::any::AnyRow;
use sqlx::{Any, Row, Transaction};

use super::Store;
use crate::db::{text_col, u64_col, DbError};

impl Store {
    /// Every budget with its account's spend, by account.
    pub async fn budgets(&self) -> Result<Vec<BudgetView>, DbError> {
        sqlx::query(&format!("{BUDGET_SELECT} ORDER BY b.account"))
            .fetch_all(&self.pool)
            .await?
            .iter()
            .map(budget_from_row)
            .collect()
    }

    /// Sets `account`'s budget; returns it with the spend so far.
    pub async fn set_budget(
        &self,
        account: &str,
        budget: f64,
        now_ms: u64,
    ) -> Result<BudgetView, DbError> {
        let mut tx = self.pool.begin().await?;
        budgets::set(&mut tx, account, budget, now_ms).await?;
        let view = budget_of(&mut tx, account)
            .await?
            .ok_or_else(|| DbError::Other(format!("the budget of {account:?} vanished")))?;
        tx.commit().await?;
        Ok(view)
    }

    /// Removes `account`'s budget. `false`: it had none.
    pub async fn clear_budget(&self, account: &str) -> Result<bool, DbError> {
        let mut conn = self.pool.acquire().await?;
        Ok(budgets::clear(&mut conn, account).await?.is_some())
    }
}

/// Budgets with their accounts' spend; an account the accounting
/// services have not priced yet has spent 0.
const BUDGET_SELECT: &str =
    "SELECT b.account, b.budget, COALESCE(s.spend, 0.0) AS spend, b.updated_ms
     FROM budgets b LEFT JOIN account_spend s ON s.account = b.account";

fn budget_from_row(row: &AnyRow) -> Result<BudgetView, DbError> {
    Ok(BudgetView {
        account: text_col(row, "account")?,
        budget: row.try_get("budget")?,
        spend: row.try_get("spend")?,
        updated_ms: u64_col(row, "updated_ms")?,
    })
}

/// `account`'s budget and spend, if it has a budget: one lookup by
/// primary key in each table.
pub(super) async fn budget_of(
    tx: &mut Transaction<'static, Any>,
    account: &str,
) -> Result<Option<BudgetView>, DbError> {
    sqlx::query(&format!("{BUDGET_SELECT} WHERE b.account = $1"))
        .bind(account)
        .fetch_optional(&mut **tx)
        .await?
        .as_ref()
        .map(budget_from_row)
        .transpose()
}

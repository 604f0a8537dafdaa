//! Budgets: the `budgets` table the manager reads on every grant (an
//! account whose spend has reached its budget gets no new lease). Every
//! write goes through here: the manager's REST API (`PUT` and `DELETE
//! /v1/budgets/{account}`), `rfaas-billing budget set|clear|sync` and the
//! accounting service's start-up sync of `billing.toml`'s `[budgets]`.

use sqlx::{AnyConnection, Row};

use crate::db::{i, DbError};

/// `account`'s budget, if it has one.
pub async fn current(conn: &mut AnyConnection, account: &str) -> Result<Option<f64>, DbError> {
    Ok(sqlx::query("SELECT budget FROM budgets WHERE account = $1")
        .bind(account)
        .fetch_optional(&mut *conn)
        .await?
        .map(|r| r.try_get("budget"))
        .transpose()?)
}

/// Sets `account`'s budget to `amount` at `now_ms`; returns the one it
/// replaced. Run it in a transaction for the two to agree.
pub async fn set(
    conn: &mut AnyConnection,
    account: &str,
    amount: f64,
    now_ms: u64,
) -> Result<Option<f64>, DbError> {
    let old = current(conn, account).await?;
    sqlx::query(
        "INSERT INTO budgets (account, budget, updated_ms) VALUES ($1, $2, $3) \
         ON CONFLICT (account) DO UPDATE SET budget = excluded.budget, updated_ms = excluded.updated_ms",
    )
    .bind(account)
    .bind(amount)
    .bind(i(now_ms))
    .execute(&mut *conn)
    .await?;
    Ok(old)
}

/// Removes `account`'s budget; returns it, `None` if it had none.
pub async fn clear(conn: &mut AnyConnection, account: &str) -> Result<Option<f64>, DbError> {
    Ok(
        sqlx::query("DELETE FROM budgets WHERE account = $1 RETURNING budget")
            .bind(account)
            .fetch_optional(&mut *conn)
            .await?
            .map(|r| r.try_get("budget"))
            .transpose()?,
    )
}

#[cfg(test)]
mod tests {
    use std::path::{Path, PathBuf};

    fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let path = entry.path();
            if path.is_dir() {
                sources(&path, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }

    /// No program's code but this module writes the table.
    #[test]
    fn this_module_is_the_only_writer() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
        let mut files = Vec::new();
        for krate in std::fs::read_dir(root).unwrap().flatten() {
            sources(&krate.path().join("src"), &mut files);
        }
        assert!(
            files.len() > 50,
            "{} sources under {}",
            files.len(),
            root.display()
        );
        let this = root.join(file!());
        let writers: Vec<&PathBuf> = files
            .iter()
            .filter(|f| **f != this)
            .filter(|f| {
                let text = std::fs::read_to_string(f).unwrap_or_default();
                ["INTO budgets", "UPDATE budgets", "DELETE FROM budgets"]
                    .iter()
                    .any(|w| text.contains(w))
            })
            .collect();
        assert!(writers.is_empty(), "budgets written by {writers:?}");
    }
}

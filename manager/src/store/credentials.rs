//! Node and user credentials, stored by the hash of their secret.

use rfaas_proto::manager::Role;
use sqlx::any::AnyRow;
use sqlx::Row;

use super::Store;
use crate::db::{i, text_col, u64_col, DbError};

/// A credential as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CredentialRow {
    /// Its id.
    pub id: String,
    /// SHA-256 of its secret, hex.
    pub secret_hash: String,
    /// Its role.
    pub role: Role,
    /// The node or user.
    pub subject: String,
    /// The account (users).
    pub account: String,
    /// Unix seconds, 0 for never.
    pub expires_at: u64,
    /// Revoked by an admin.
    pub revoked: bool,
    /// The Slurm job of a job credential.
    pub job_id: Option<u64>,
}

impl Store {
    /// Stores a new credential.
    pub async fn add_credential(&self, c: &CredentialRow, now_ms: u64) -> Result<(), DbError> {
        sqlx::query(
            "INSERT INTO credentials (id, secret_hash, role, subject, account, created_ms, expires_at, revoked, job_id)
             VALUES ($1, $2, $3, $4, $5, $6, $7, 0, $8)",
        )
        .bind(&c.id)
        .bind(&c.secret_hash)
        .bind(role_name(c.role))
        .bind(&c.subject)
        .bind(&c.account)
        .bind(i(now_ms))
        .bind(i(c.expires_at))
        .bind(c.job_id.map(i))
        .execute(&self.pool)
        .await?;
        Ok(())
    }

    /// One credential by id.
    pub async fn credential(&self, id: &str) -> Result<Option<CredentialRow>, DbError> {
        let row = sqlx::query(
            "SELECT id, secret_hash, role, subject, account, expires_at, revoked, job_id FROM credentials WHERE id = $1",
        )
        .bind(id)
        .fetch_optional(&self.pool)
        .await?;
        row.as_ref().map(credential_from_row).transpose()
    }

    /// Every credential not revoked.
    pub async fn credentials(&self) -> Result<Vec<CredentialRow>, DbError> {
        sqlx::query(
            "SELECT id, secret_hash, role, subject, account, expires_at, revoked, job_id FROM credentials WHERE revoked = 0 ORDER BY subject, id",
        )
        .fetch_all(&self.pool)
        .await?
        .iter()
        .map(credential_from_row)
        .collect()
    }

    /// Revokes a credential. `false`: unknown.
    pub async fn revoke_credential(&self, id: &str) -> Result<bool, DbError> {
        let done = sqlx::query("UPDATE credentials SET revoked = 1 WHERE id = $1")
            .bind(id)
            .execute(&self.pool)
            .await?;
        Ok(done.rows_affected() == 1)
    }
}

/// The stored name of a role.
pub fn role_name(r: Role) -> &'static str {
    match r {
        Role::Node => "node",
        Role::User => "user",
    }
}

fn credential_from_row(row: &AnyRow) -> Result<CredentialRow, DbError> {
    let role = match text_col(row, "role")?.as_str() {
        "node" => Role::Node,
        "user" => Role::User,
        other => return Err(DbError::Other(format!("stored credential role {other:?}"))),
    };
    Ok(CredentialRow {
        id: text_col(row, "id")?,
        secret_hash: text_col(row, "secret_hash")?,
        role,
        subject: text_col(row, "subject")?,
        account: text_col(row, "account")?,
        expires_at: u64_col(row, "expires_at")?,
        revoked: u64_col(row, "revoked")? != 0,
        job_id: row.try_get::<Option<i64>, _>("job_id")?.map(|v| v as u64),
    })
}

//! Node and user credentials, stored by the hash of their secret.

use rfaas_proto::manager::Role;
use rfaas_service::credentials::{self, CredentialRow};
use sqlx::Row as _;

use super::{Store, LIVENESS};
use crate::db::{i, DbError};

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
        credentials::find(&self.pool, id).await
    }

    /// Every credential not revoked.
    pub async fn credentials(&self) -> Result<Vec<CredentialRow>, DbError> {
        sqlx::query(&format!(
            "SELECT {} FROM credentials WHERE revoked = 0 ORDER BY subject, id",
            credentials::COLUMNS
        ))
        .fetch_all(&self.pool)
        .await?
        .iter()
        .map(credentials::from_row)
        .collect()
    }

    /// The key that tags credential ids ([`crate::auth::Auth`]): the one
    /// stored, or `fresh` when none is yet (the first replica to ask on a
    /// new database stores its own; every other reads that one).
    pub async fn credential_id_key(&self, fresh: &str) -> Result<String, DbError> {
        sqlx::query(
            "INSERT INTO manager_keys (name, value) VALUES ('credential_id', $1) ON CONFLICT (name) DO NOTHING",
        )
        .bind(fresh)
        .execute(&self.pool)
        .await?;
        let row = sqlx::query("SELECT value FROM manager_keys WHERE name = 'credential_id'")
            .fetch_one(&self.pool)
            .await?;
        Ok(row.try_get("value")?)
    }

    /// The ids of credentials minted before ids were tagged (16 hex
    /// digits, untagged), revoked or not.
    pub async fn untagged_credential_ids(&self) -> Result<Vec<String>, DbError> {
        sqlx::query("SELECT id FROM credentials WHERE length(id) = 16")
            .fetch_all(&self.pool)
            .await?
            .iter()
            .map(|r| Ok(r.try_get("id")?))
            .collect()
    }

    /// Revokes a credential. `false`: unknown.
    pub async fn revoke_credential(&self, id: &str) -> Result<bool, DbError> {
        let done = sqlx::query(
            "UPDATE credentials SET revoked = 1, revoked_ms = CASE WHEN revoked = 1 THEN revoked_ms ELSE $2 END WHERE id = $1",
        )
        .bind(id)
        .bind(i(crate::now_ms()))
        .execute(&self.pool)
        .await?;
        Ok(done.rows_affected() == 1)
    }

    /// The credentials revoked at `since_ms` or later, by any replica:
    /// each round's read, which keeps every replica's cache of verified
    /// credentials honest ([`crate::auth`]).
    pub async fn revoked_since(&self, since_ms: u64) -> Result<Vec<String>, DbError> {
        sqlx::query(&format!(
            "{LIVENESS} SELECT id FROM credentials WHERE revoked = 1 AND revoked_ms >= $1"
        ))
        .bind(i(since_ms))
        .fetch_all(&self.pool)
        .await?
        .iter()
        .map(|r| Ok(r.try_get("id")?))
        .collect()
    }
}

/// The stored name of a role.
pub fn role_name(r: Role) -> &'static str {
    match r {
        Role::Node => "node",
        Role::User => "user",
    }
}

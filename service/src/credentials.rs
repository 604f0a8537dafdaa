//! Credentials: `rfaasc.<id>.<secret>`, minted by a manager admin and
//! stored in the `credentials` table with the secret's SHA-256, never the
//! secret. The manager checks them on every request; the accounting
//! service checks executor daemons' node credentials against the same
//! table ([`verify_node_credential`]). Secrets kept in files must be
//! private to their owner ([`check_private_file`]).

use std::io::Read;
use std::time::Duration;

use rfaas_proto::manager::Role;
use sha2::{Digest, Sha256};
use sqlx::any::AnyRow;
use sqlx::{AnyPool, Row};

use crate::db::{text_col, u64_col, DbError};

/// How long a manager replica, or an accounting service, trusts a
/// credential it has checked: a revocation takes effect within it.
pub const CACHE_TTL: Duration = Duration::from_secs(5);

/// The credentials' prefix.
pub const CREDENTIAL_PREFIX: &str = "rfaasc";

/// Compares two byte strings in time that depends only on their lengths.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// SHA-256 of `secret`, hex.
pub fn hash_secret(secret: &str) -> String {
    Sha256::digest(secret.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// `n` random bytes from the kernel.
pub fn random_bytes(n: usize) -> std::io::Result<Vec<u8>> {
    let mut buf = vec![0u8; n];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut buf)?;
    Ok(buf)
}

pub use rfaas_tls::files::check_private_file;

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

/// The columns [`from_row`] reads, in a `SELECT`'s order.
pub const COLUMNS: &str = "id, secret_hash, role, subject, account, expires_at, revoked, job_id";

/// One credential by id.
pub async fn find(pool: &AnyPool, id: &str) -> Result<Option<CredentialRow>, DbError> {
    let row = sqlx::query(&format!("SELECT {COLUMNS} FROM credentials WHERE id = $1"))
        .bind(id)
        .fetch_optional(pool)
        .await?;
    row.as_ref().map(from_row).transpose()
}

/// Reads a credential from a row holding [`COLUMNS`].
pub fn from_row(row: &AnyRow) -> Result<CredentialRow, DbError> {
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

/// Why [`verify_node_credential`] refused a credential.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeRefusal {
    /// Not `rfaasc.<id>.<secret>`.
    Malformed,
    /// No credential has that id.
    Unknown,
    /// The secret does not match.
    WrongSecret,
    /// Revoked by an admin.
    Revoked,
    /// Past its expiry.
    Expired,
    /// A user's credential, not a node's.
    NotANode,
}

/// Checks a node credential (`rfaasc.<id>.<secret>`) as the manager checks
/// a node's bearer token: a stored credential of role node, whose secret
/// matches, neither revoked nor expired at `now_s`. `Ok(Ok(node))` names
/// the node it was minted for. For services that share the manager's
/// database (the accounting service); it reads the database every time,
/// so cache the verdicts.
///
/// # Errors
///
/// The database's failure, when it cannot answer.
pub async fn verify_node_credential(
    pool: &AnyPool,
    token: &str,
    now_s: u64,
) -> Result<Result<String, NodeRefusal>, DbError> {
    let Some(rest) = token
        .strip_prefix(CREDENTIAL_PREFIX)
        .and_then(|r| r.strip_prefix('.'))
    else {
        return Ok(Err(NodeRefusal::Malformed));
    };
    let (id, secret) = rest.split_once('.').unwrap_or((rest, ""));
    if id.is_empty() || id.len() > 64 || !id.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Ok(Err(NodeRefusal::Malformed));
    }
    let Some(row) = find(pool, id).await? else {
        return Ok(Err(NodeRefusal::Unknown));
    };
    Ok(
        if !constant_time_eq(hash_secret(secret).as_bytes(), row.secret_hash.as_bytes()) {
            Err(NodeRefusal::WrongSecret)
        } else if row.revoked {
            Err(NodeRefusal::Revoked)
        } else if row.expires_at != 0 && now_s >= row.expires_at {
            Err(NodeRefusal::Expired)
        } else if row.role != Role::Node {
            Err(NodeRefusal::NotANode)
        } else {
            Ok(row.subject)
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn constant_time_eq_compares() {
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"abc", b"abcd"));
    }
}

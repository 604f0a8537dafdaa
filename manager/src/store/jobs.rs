//! A Slurm job's end: its job credentials and its leases.

use super::leases::{LeaseRow, LEASE_COLS};
use super::Store;
use crate::db::{i, text_col, DbError};

impl Store {
    /// Ends Slurm job `job_id` here: revokes its job credentials and
    /// releases its active leases, in one transaction, and gives back
    /// what they held. Returns the ids of the credentials revoked and the
    /// leases ended (both empty once the job's end was already recorded).
    pub async fn end_job(
        &self,
        job_id: u64,
        now_ms: u64,
    ) -> Result<(Vec<String>, Vec<LeaseRow>), DbError> {
        let mut tx = self.pool.begin().await?;
        let sql = format!(
            "UPDATE leases SET state = 'released', ended_ms = $2 WHERE job_id = $1 AND state = 'active' RETURNING {LEASE_COLS}"
        );
        let (ended, leased) = self
            .end_leases_in(&mut tx, sqlx::query(&sql).bind(i(job_id)).bind(i(now_ms)))
            .await?;
        // Credentials last: leases, accounts and nodes keep their lock
        // order (see `crate::db`).
        let revoked = sqlx::query(
            "UPDATE credentials SET revoked = 1, revoked_ms = $2 WHERE job_id = $1 AND revoked = 0 RETURNING id",
        )
        .bind(i(job_id))
        .bind(i(now_ms))
        .fetch_all(&mut *tx)
        .await?
        .iter()
        .map(|r| text_col(r, "id"))
        .collect::<Result<Vec<_>, _>>()?;
        tx.commit().await?;
        self.committed(&leased);
        Ok((revoked, ended))
    }
}

//! The schema: numbered SQL files under `service/migrations/<owner>/`,
//! embedded in the binaries, applied once each and recorded in
//! `rfaas_migrations` (one row per owner and version).
//!
//! One owner per table: the manager's migrations create what the manager
//! writes (nodes, leases, accounts, credentials, budgets), the accounting
//! service's what it writes (accounting instances, billing slots, usage,
//! snapshots, spend). Each process reads the other's tables (a grant takes
//! a billing slot, a flush reads the lease), but only the manager changes
//! the schema: [`crate::db::open_and_migrate`] (`rfaas-manager migrate`,
//! and every manager at start) brings every owner's schema up to date, on
//! PostgreSQL under an advisory lock, so replicas starting together apply
//! each step exactly once. The accounting service and `rfaas-billing` open
//! the database with [`crate::db::open`], which only checks that the
//! schema is the one they know ([`check_current`]) and otherwise refuses,
//! saying to run `rfaas-manager migrate`: their database roles need no
//! right to create or alter tables (docs/manager.md, "Database roles").
//!
//! A file runs whole, in one transaction, as the database parses it (no
//! splitting on `;`). Never edit a file that has shipped: add the next
//! number.
//!
//! Databases made before the files (one list of six steps, recorded in
//! `rfaas_schema`) are adopted as they are: their steps map onto the files
//! they became, and `rfaas_schema` is left in place, unread.

use sqlx::{AnyConnection, Row};

use crate::db::{Backend, DbError};

/// One migration file.
#[derive(Debug, Clone, Copy)]
pub struct Migration {
    /// Its number, from 1, without gaps.
    pub version: i64,
    /// Its file name under its owner's folder.
    pub file: &'static str,
    /// Its statements; the first line is a `-- ` comment saying what it
    /// does.
    pub sql: &'static str,
}

impl Migration {
    /// What it does: its first line's comment.
    pub fn description(&self) -> &'static str {
        self.sql
            .lines()
            .next()
            .and_then(|l| l.strip_prefix("-- "))
            .unwrap_or(self.file)
    }
}

/// The migrations of one owner of tables.
#[derive(Debug, Clone, Copy)]
pub struct Owner {
    /// Its name, in `rfaas_migrations.owner`, and its folder.
    pub name: &'static str,
    /// Its files in order.
    pub migrations: &'static [Migration],
}

impl Owner {
    /// The tables its files create, each with the file that does.
    pub fn tables(&self) -> impl Iterator<Item = (&'static str, &'static Migration)> {
        self.migrations.iter().flat_map(|m| {
            m.sql
                .split("CREATE TABLE ")
                .skip(1)
                .map(move |w| (w.split_whitespace().next().unwrap_or_default(), m))
        })
    }
}

macro_rules! migrations {
    ($owner:literal: $($version:literal $file:literal),* $(,)?) => {
        Owner {
            name: $owner,
            migrations: &[$(Migration {
                version: $version,
                file: $file,
                sql: include_str!(concat!("../migrations/", $owner, "/", $file)),
            }),*],
        }
    };
}

/// The manager's tables.
pub const MANAGER: Owner = migrations!("manager":
    1 "0001_nodes_leases_accounts_credentials.sql",
    2 "0002_harvested_jobs_budgets.sql",
    3 "0003_slurm_jobs.sql",
    4 "0004_lease_seq.sql",
    5 "0005_leases_by_grant_state.sql",
    6 "0006_draining.sql",
    7 "0007_credential_id_key.sql",
    8 "0008_node_control_tls.sql",
    9 "0009_usage_daily.sql",
    10 "0010_leases_listed.sql",
    11 "0011_credentials_revoked_ms.sql",
    12 "0012_node_partitions.sql",
);

/// The accounting service's tables.
pub const ACCOUNTING: Owner = migrations!("accounting":
    1 "0001_instances_slots_usage.sql",
);

/// Every owner, in the order their migrations run.
pub const OWNERS: &[Owner] = &[MANAGER, ACCOUNTING];

/// What each database role may do on PostgreSQL, table by table: the
/// manager owns every table (it migrates them); the accounting service
/// writes its own tables and reads what a flush and a hello check need;
/// reports read usage, leases and budgets. A table not listed for a role
/// is closed to it.
pub const GRANTS: &[(&str, &str, &str)] = &[
    // (table, the accounting service's privileges, reports')
    ("rfaas_migrations", "SELECT", "SELECT"),
    ("leases", "SELECT", "SELECT"),
    ("credentials", "SELECT", ""),
    ("accounting_instances", "SELECT, INSERT, UPDATE, DELETE", ""),
    ("billing_slots", "SELECT, INSERT, UPDATE, DELETE", ""),
    ("usage", "SELECT, INSERT, UPDATE, DELETE", "SELECT"),
    (
        "usage_snapshots",
        "SELECT, INSERT, UPDATE, DELETE",
        "SELECT",
    ),
    ("account_spend", "SELECT, INSERT, UPDATE, DELETE", "SELECT"),
    ("budgets", "", "SELECT"),
    // Purged leases' usage, per day: written by the manager's retention.
    ("usage_daily", "", "SELECT"),
    // The key of credential ids' tags: the manager's alone.
    ("manager_keys", "", ""),
    // The nodes' Slurm partitions, for listing by partition: the manager's
    // alone.
    ("node_partitions", "", ""),
];

/// The names of the three database roles.
#[derive(Debug, Clone)]
pub struct Roles {
    /// The manager's: owns the schema.
    pub manager: String,
    /// The accounting service's.
    pub accounting: String,
    /// `rfaas-billing`'s reports.
    pub report: String,
}

impl Default for Roles {
    fn default() -> Roles {
        Roles {
            manager: "rfaas_manager".into(),
            accounting: "rfaas_accounting".into(),
            report: "rfaas_report".into(),
        }
    }
}

/// The PostgreSQL script that creates the three roles (without
/// passwords: set them with `ALTER ROLE ... PASSWORD` or psql's
/// `\password`) and gives each what it needs on the current database:
/// the manager the schema and every table, the others [`GRANTS`].
/// Idempotent; run by a superuser or the database's owner, before the
/// first `rfaas-manager migrate` and again after any (tables a migration
/// adds get their grants from it).
pub fn roles_sql(roles: &Roles) -> Result<String, String> {
    for name in [&roles.manager, &roles.accounting, &roles.report] {
        let ok = !name.is_empty()
            && name.len() <= 63
            && name.starts_with(|c: char| c.is_ascii_lowercase() || c == '_')
            && name
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
        if !ok {
            return Err(format!(
                "the role name {name:?} is not a plain PostgreSQL name; use 1 to 63 lower-case letters, digits or '_', not starting with a digit"
            ));
        }
    }
    let Roles {
        manager,
        accounting,
        report,
    } = roles;
    let mut sql = format!(
        "-- rfaas database roles: {manager} owns the schema and migrates it,\n\
         -- {accounting} is the accounting service's, {report} reports'.\n\
         -- Run as a superuser or the database's owner, before the first\n\
         -- `rfaas-manager migrate` and after every one. Set passwords apart:\n\
         -- ALTER ROLE name PASSWORD '...' (or psql's \\password name).\n\
         DO $rfaas$\nDECLARE r text;\nBEGIN\n\
         \x20 FOREACH r IN ARRAY ARRAY['{manager}', '{accounting}', '{report}'] LOOP\n\
         \x20   IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = r) THEN\n\
         \x20     EXECUTE format('CREATE ROLE %I LOGIN', r);\n\
         \x20   END IF;\n\
         \x20   EXECUTE format('GRANT CONNECT ON DATABASE %I TO %I', current_database(), r);\n\
         \x20 END LOOP;\n\
         END\n$rfaas$;\n\
         REVOKE CREATE ON SCHEMA public FROM PUBLIC;\n\
         GRANT USAGE, CREATE ON SCHEMA public TO {manager};\n\
         GRANT USAGE ON SCHEMA public TO {accounting}, {report};\n\
         -- Tables made before (by another role) pass to {manager}; each\n\
         -- existing table gets the others' grants.\n\
         DO $rfaas$\nBEGIN\n"
    );
    let tables = OWNERS.iter().flat_map(|o| o.tables().map(|(t, _)| t));
    for table in std::iter::once("rfaas_migrations").chain(tables) {
        let (acct, rep) = GRANTS
            .iter()
            .find(|g| g.0 == table)
            .map_or(("", ""), |g| (g.1, g.2));
        sql.push_str(&format!(
            "  IF to_regclass('public.{table}') IS NOT NULL THEN\n    ALTER TABLE public.{table} OWNER TO {manager};\n    REVOKE ALL ON public.{table} FROM PUBLIC, {accounting}, {report};\n"
        ));
        for (role, privs) in [(accounting, acct), (report, rep)] {
            if !privs.is_empty() {
                sql.push_str(&format!("    GRANT {privs} ON public.{table} TO {role};\n"));
            }
        }
        sql.push_str("  END IF;\n");
    }
    sql.push_str("END\n$rfaas$;\n");
    Ok(sql)
}

/// PostgreSQL's advisory lock key around the migrations.
const LOCK_KEY: i64 = 7_300_001;

/// Brings every owner's schema up to date on `conn`.
pub(crate) async fn migrate(conn: &mut AnyConnection, backend: Backend) -> Result<(), DbError> {
    if backend == Backend::Postgres {
        sqlx::query("SELECT COUNT(*) AS n FROM (SELECT pg_advisory_lock($1)) AS locked")
            .bind(LOCK_KEY)
            .execute(&mut *conn)
            .await?;
    }
    let result = apply_all(conn, backend).await;
    if backend == Backend::Postgres {
        sqlx::query("SELECT COUNT(*) AS n FROM (SELECT pg_advisory_unlock($1)) AS unlocked")
            .bind(LOCK_KEY)
            .execute(&mut *conn)
            .await?;
    }
    result
}

/// Refuses a database whose schema is not the one this release knows:
/// a step missing (the manager has not migrated it yet) or one unknown (a
/// newer release migrated it). Reads only.
pub(crate) async fn check_current(conn: &mut AnyConnection) -> Result<(), DbError> {
    let all = match applied(conn).await {
        Ok(all) => all,
        // No rfaas_migrations: a database no manager has opened.
        Err(DbError::Other(why)) => {
            return Err(DbError::Other(format!(
                "the database has no rfaas schema ({why}); run `rfaas-manager migrate` (or start rfaas-manager) on it first"
            )))
        }
        Err(e) => return Err(e),
    };
    for owner in OWNERS {
        let latest = owner.migrations.len() as i64;
        let mut done: Vec<i64> = all
            .iter()
            .filter(|(o, _)| o == owner.name)
            .map(|(_, v)| *v)
            .collect();
        done.sort_unstable();
        if let Some(unknown) = done.iter().find(|v| **v > latest) {
            return Err(DbError::Other(format!(
                "the database has {} schema step {unknown}, which this rfaas does not know: it was made by a newer release; run that release or newer",
                owner.name
            )));
        }
        if done.len() as i64 != latest {
            return Err(DbError::Other(format!(
                "the database's {} schema is out of date ({} of {latest} steps applied); run `rfaas-manager migrate` with this release, then start this again",
                owner.name,
                done.len()
            )));
        }
    }
    Ok(())
}

async fn apply_all(conn: &mut AnyConnection, backend: Backend) -> Result<(), DbError> {
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS rfaas_migrations (owner TEXT NOT NULL, version BIGINT NOT NULL, description TEXT NOT NULL, applied_ms BIGINT NOT NULL, PRIMARY KEY (owner, version))",
    )
    .execute(&mut *conn)
    .await?;
    // Up to date, the usual case: this one read and nothing else.
    let mut all = applied(conn).await?;
    if all.is_empty() {
        adopt_legacy(conn, backend).await?;
        all = applied(conn).await?;
    }
    for owner in OWNERS {
        let done: Vec<i64> = all
            .iter()
            .filter(|(o, _)| o == owner.name)
            .map(|(_, v)| *v)
            .collect();
        if let Some(unknown) = done.iter().find(|v| **v > owner.migrations.len() as i64) {
            return Err(DbError::Other(format!(
                "the database has {} schema step {unknown}, which this rfaas does not know: it was made by a newer release; run that release or newer",
                owner.name
            )));
        }
        for m in owner.migrations {
            if done.contains(&m.version) {
                continue;
            }
            let mut tx = sqlx::Connection::begin(&mut *conn).await?;
            // A bare string has no arguments: sent as it is (PostgreSQL's
            // simple query), every statement of the file in one go.
            sqlx::Executor::execute(&mut *tx, m.sql)
                .await
                .map_err(|e| {
                    DbError::Other(format!(
                        "schema step {} {} ({}) failed: {e}",
                        owner.name, m.version, m.file
                    ))
                })?;
            record(&mut tx, owner.name, m, crate::now_ms()).await?;
            tx.commit().await?;
            tracing::info!(
                owner = owner.name,
                version = m.version,
                description = m.description(),
                "applied schema step"
            );
        }
    }
    Ok(())
}

/// Every step recorded, as (owner, version).
async fn applied(conn: &mut AnyConnection) -> Result<Vec<(String, i64)>, DbError> {
    Ok(sqlx::query("SELECT owner, version FROM rfaas_migrations")
        .fetch_all(&mut *conn)
        .await?
        .iter()
        .map(|r| Ok((r.try_get("owner")?, r.try_get("version")?)))
        .collect::<Result<_, sqlx::Error>>()?)
}

async fn record(
    conn: &mut AnyConnection,
    owner: &str,
    m: &Migration,
    applied_ms: u64,
) -> Result<(), DbError> {
    sqlx::query(
        "INSERT INTO rfaas_migrations (owner, version, description, applied_ms) VALUES ($1, $2, $3, $4)",
    )
    .bind(owner)
    .bind(m.version)
    .bind(m.description())
    .bind(crate::db::i(applied_ms))
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// What became of each step of the former single list: the manager's
/// file of the same number, and step 2's accounting tables the accounting
/// service's first file.
fn legacy_steps(version: i64) -> Vec<(&'static Owner, i64)> {
    let mut to = vec![(&MANAGER, version)];
    if version == 2 {
        to.push((&ACCOUNTING, 1));
    }
    to
}

/// Records the steps a database made before the files went through as
/// the files they became; for a database whose `rfaas_migrations` is
/// empty.
async fn adopt_legacy(conn: &mut AnyConnection, backend: Backend) -> Result<(), DbError> {
    let exists = match backend {
        Backend::Sqlite => {
            "SELECT COUNT(*) AS n FROM sqlite_master WHERE type = 'table' AND name = 'rfaas_schema'"
        }
        Backend::Postgres => {
            "SELECT COUNT(*) AS n FROM information_schema.tables WHERE table_schema = current_schema() AND table_name = 'rfaas_schema'"
        }
    };
    let legacy: i64 = sqlx::query(exists)
        .fetch_one(&mut *conn)
        .await?
        .try_get(0)?;
    if legacy == 0 {
        return Ok(());
    }
    let mut tx = sqlx::Connection::begin(&mut *conn).await?;
    let steps = sqlx::query("SELECT version, applied_ms FROM rfaas_schema ORDER BY version")
        .fetch_all(&mut *tx)
        .await?;
    for row in &steps {
        let version: i64 = row.try_get("version")?;
        let applied_ms: i64 = row.try_get("applied_ms")?;
        for (owner, v) in legacy_steps(version) {
            let m = owner
                .migrations
                .iter()
                .find(|m| m.version == v)
                .ok_or_else(|| {
                    DbError::Other(format!(
                        "the database has schema step {version} (rfaas_schema), which this rfaas does not know: it was made by a newer release; run that release or newer"
                    ))
                })?;
            record(&mut tx, owner.name, m, applied_ms.max(0) as u64).await?;
        }
    }
    tx.commit().await?;
    tracing::info!(
        steps = steps.len(),
        "adopted the schema steps recorded in rfaas_schema"
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every file in an owner's folder is in its list, numbered as named,
    /// and says what it does on its first line.
    #[test]
    fn the_lists_hold_every_file_in_order() {
        for owner in OWNERS {
            let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("migrations")
                .join(owner.name);
            let mut files: Vec<String> = std::fs::read_dir(&dir)
                .unwrap()
                .map(|e| e.unwrap().file_name().into_string().unwrap())
                .collect();
            files.sort();
            let listed: Vec<&str> = owner.migrations.iter().map(|m| m.file).collect();
            assert_eq!(files, listed, "{}", dir.display());
            for (n, m) in owner.migrations.iter().enumerate() {
                assert_eq!(m.version, n as i64 + 1, "{}", m.file);
                assert!(
                    m.file.starts_with(&format!("{:04}_", m.version)),
                    "{}",
                    m.file
                );
                assert!(m.sql.starts_with("-- "), "{} has no description", m.file);
            }
        }
    }

    /// Each table is created by one owner only.
    #[test]
    fn each_table_has_one_owner() {
        let mut created: Vec<(String, &str)> = Vec::new();
        for owner in OWNERS {
            for (table, _) in owner.tables() {
                assert!(
                    !created.iter().any(|(t, _)| t == table),
                    "{table} is created twice"
                );
                created.push((table.to_owned(), owner.name));
            }
        }
        let owner_of = |t: &str| created.iter().find(|(n, _)| n == t).map(|(_, o)| *o);
        assert_eq!(owner_of("leases"), Some("manager"));
        assert_eq!(owner_of("budgets"), Some("manager"));
        assert_eq!(owner_of("usage"), Some("accounting"));
        assert_eq!(owner_of("billing_slots"), Some("accounting"));
        // Every table has its grants written down, even if none.
        for (table, _) in &created {
            assert!(
                GRANTS.iter().any(|g| g.0 == table)
                    || ["nodes", "accounts"].contains(&table.as_str()),
                "{table} is missing from GRANTS"
            );
        }
    }
}

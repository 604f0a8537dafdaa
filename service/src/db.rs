//! The database the manager and the accounting service share: one code
//! path for PostgreSQL and SQLite, through sqlx's `Any` driver.
//!
//! Every statement is plain SQL both databases run as written: `$N`
//! parameters, `BIGINT` and `TEXT` columns, `ON CONFLICT` upserts,
//! `RETURNING`. Counters that must never overflow a node or a quota
//! (`nodes.leased_cores`, `accounts.leased_cores`) are changed only by
//! conditional updates (`... SET x = x + n WHERE x + n <= cap`) whose row
//! count says whether they fit: PostgreSQL re-checks the condition after
//! waiting for the row's lock, SQLite has one writer at a time, so no core
//! is leased twice under any concurrency, without `SELECT ... FOR UPDATE`
//! (which SQLite lacks).
//!
//! A node's capacity (`nodes.cores`, `nodes.memory_mib`) never falls
//! below what is leased on it: a registration below its leases keeps the
//! leased figures and records the difference as draining
//! (`draining_cores`, `draining_memory_mib`), which releases give up as
//! the leases end (the manager's `Store::register`).
//!
//! A billing slot (`billing_slots.lease_id`, 0 when free) is taken the
//! same way: `UPDATE billing_slots SET lease_id = $1 ... WHERE instance =
//! $3 AND lease_id = 0 AND slot = (the first free slot from a random
//! start)`, and only a row count of 1 gives it, so no slot goes to two
//! leases. The manager never frees a slot: the accounting service does,
//! after the lease's final flush.
//!
//! Lock order, to keep PostgreSQL free of deadlocks: a lease row, then its
//! account, then its nodes by name, then billing slots. A transaction that
//! still meets a deadlock or a serialization failure (two grants reaching
//! for each other's slots) is retried ([`retrying`]).

use std::future::Future;
use std::path::Path;
use std::time::Duration;

use rfaas_proto::files::{ConfigDir, DATABASE_PASSWORD};
use sqlx::any::{AnyPoolOptions, AnyRow};
use sqlx::{AnyPool, Row};

/// Which database the URL names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// PostgreSQL: for replicas.
    Postgres,
    /// SQLite: the embedded default.
    Sqlite,
}

impl Backend {
    /// The backend of `url`.
    pub fn of(url: &str) -> Backend {
        if url.starts_with("sqlite:") {
            Backend::Sqlite
        } else {
            Backend::Postgres
        }
    }

    /// Its name in metrics and benchmark rows.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Postgres => "postgres",
            Backend::Sqlite => "sqlite",
        }
    }
}

/// The database when none is configured: a SQLite file of the manager's,
/// which the accounting service and `rfaas-billing` on the same host
/// share.
pub const DEFAULT_URL: &str = "sqlite:///var/lib/rfaas/manager.db";

/// `url` with the password of its password file, when `url` is
/// PostgreSQL's and names no password: `file` (a program's
/// `database_password_file`), else `database.password` in the
/// configuration directory if that exists; otherwise `url` as it is
/// (PostgreSQL's own `~/.pgpass` or `PGPASSFILE` may still give one).
/// The file must be private to its owner (root's, when read by root), as
/// every other secret of rfaas, and holds the password on its first line.
///
/// A URL that carries its own password is used but warned about: anyone
/// who can read the configuration file reads the password.
pub fn with_password_file(
    url: &str,
    file: Option<&Path>,
    dir: &ConfigDir,
) -> Result<String, String> {
    if Backend::of(url) != Backend::Postgres {
        return Ok(url.to_owned());
    }
    let mut parsed = url::Url::parse(url).map_err(|_| {
        "the database URL is not a URL; write postgres://user@host:port/database".to_owned()
    })?;
    if parsed.password().is_some() {
        if let Some(file) = file {
            return Err(format!(
                "the database URL carries a password and database_password_file names {} too; keep the password in the file only",
                file.display()
            ));
        }
        tracing::warn!(
            url = %redact(url),
            "the database URL carries its password, which anyone who can read the configuration file reads; move it to a password file (database_password_file, mode 0600)"
        );
        return Ok(url.to_owned());
    }
    let (file, hint) = match file {
        Some(f) => (f.to_owned(), "check database_password_file".to_owned()),
        None => {
            let f = dir.file(DATABASE_PASSWORD);
            if !f.exists() {
                return Ok(url.to_owned());
            }
            (f, dir.hint(&["database_password_file"]))
        }
    };
    let unusable = |e: String| format!("{e}; {hint}");
    crate::credentials::check_private_file(&file, "the database password file")
        .map_err(unusable)?;
    let text = std::fs::read_to_string(&file).map_err(|e| {
        unusable(format!(
            "cannot read the database password file {}: {e}",
            file.display()
        ))
    })?;
    let password = text.lines().next().unwrap_or_default();
    if password.is_empty() {
        return Err(unusable(format!(
            "the database password file {} is empty; write the password on its first line",
            file.display()
        )));
    }
    parsed.set_password(Some(password)).map_err(|()| {
        format!(
            "the database URL {} takes no password; name a user, as in postgres://rfaas@host/db",
            redact(url)
        )
    })?;
    Ok(parsed.into())
}

/// Refuses a database URL given on a command line (`flag`) that carries
/// a password: every user of the host reads command lines
/// (`/proc/*/cmdline`, `ps`).
pub fn refuse_password_in_argument(url: &str, flag: &str) -> Result<(), String> {
    match url::Url::parse(url) {
        Ok(u) if u.password().is_some() => Err(format!(
            "{flag} {} carries a password, which every user of this host can read on the command line; give the URL without it and the password in a file (database_password_file, mode 0600)",
            redact(url)
        )),
        _ => Ok(()),
    }
}

/// `url` without its password, fit for a message or a log.
pub fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let auth_end = rest.find('/').unwrap_or(rest.len());
    match rest[..auth_end].rfind('@') {
        Some(at) => match rest[..at].split_once(':') {
            Some((user, _)) => format!("{scheme}://{user}:***{}", &rest[at..]),
            None => url.to_owned(),
        },
        None => url.to_owned(),
    }
}

/// A database failure, classified by what the caller can do about it.
#[derive(Debug, thiserror::Error)]
pub enum DbError {
    /// The database cannot be reached now (down, restarting, pool
    /// exhausted): try again shortly.
    #[error("the database is unavailable: {0}")]
    Unavailable(String),
    /// A conflict between transactions (deadlock, serialization): retry the
    /// transaction.
    #[error("a transaction conflicted with another: {0}")]
    Conflict(String),
    /// Anything else: a bug or a damaged database.
    #[error("database error: {0}")]
    Other(String),
}

impl From<sqlx::Error> for DbError {
    fn from(e: sqlx::Error) -> DbError {
        match &e {
            sqlx::Error::PoolTimedOut
            | sqlx::Error::PoolClosed
            | sqlx::Error::Io(_)
            | sqlx::Error::Tls(_)
            | sqlx::Error::WorkerCrashed => DbError::Unavailable(e.to_string()),
            sqlx::Error::Database(d) => {
                let code = d.code().map(|c| c.into_owned()).unwrap_or_default();
                match code.as_str() {
                    // PostgreSQL: serialization failure, deadlock.
                    "40001" | "40P01" => DbError::Conflict(e.to_string()),
                    // SQLite: busy, locked.
                    "5" | "6" | "517" | "262" => DbError::Conflict(e.to_string()),
                    // PostgreSQL: shutting down, cannot connect now,
                    // connection exceptions.
                    c if c.starts_with("57P") || c.starts_with("08") => {
                        DbError::Unavailable(e.to_string())
                    }
                    _ => DbError::Other(e.to_string()),
                }
            }
            _ => DbError::Other(e.to_string()),
        }
    }
}

/// Runs `f` until it succeeds or fails other than by a conflict, at most
/// eight times, with a short random pause between tries.
pub async fn retrying<T, F, Fut>(mut f: F) -> Result<T, DbError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, DbError>>,
{
    let mut tries = 0;
    loop {
        match f().await {
            Err(DbError::Conflict(why)) => {
                tries += 1;
                if tries == 8 {
                    return Err(DbError::Unavailable(format!(
                        "gave up after {tries} conflicting tries: {why}"
                    )));
                }
                tokio::time::sleep(Duration::from_micros(fastrand::u64(100..2000 << tries))).await;
            }
            other => return other,
        }
    }
}

/// How often [`checkpoints`] copies SQLite's write-ahead log into the
/// database file. Often, so each one has little to sync: a checkpoint's
/// syncs stall the commits appending to the log meanwhile, for longer the
/// more it copies (docs/benchmarks.md, "SQLite checkpoints").
pub const CHECKPOINT_EVERY: Duration = Duration::from_millis(100);

/// The write-ahead log's size, in pages, at which a committing connection
/// checkpoints by itself: a backstop for a file no [`checkpoints`] task
/// looks after (SQLite's default is 1000, about 4 MiB).
const AUTOCHECKPOINT_PAGES: u32 = 16_384;

/// Opens a pool on `url` whose schema is the one this release knows,
/// changing nothing: what the accounting service and `rfaas-billing` do.
/// A database whose schema is missing or out of date is refused with a
/// sentence saying to run `rfaas-manager migrate`; a SQLite file that
/// does not exist is not created.
pub async fn open(url: &str, max_connections: u32) -> Result<AnyPool, DbError> {
    let pool = connect(url, max_connections, false).await?;
    crate::schema::check_current(&mut *pool.acquire().await?).await?;
    Ok(pool)
}

/// Opens a pool on `url` and brings the schema of every owner of tables
/// up to date ([`crate::schema`]): the manager's, and only the manager's.
///
/// SQLite files are created if missing, readable by their owner only.
/// Processes starting together on PostgreSQL take an advisory lock around
/// the migrations, so exactly one applies each step.
pub async fn open_and_migrate(url: &str, max_connections: u32) -> Result<AnyPool, DbError> {
    let pool = connect(url, max_connections, true).await?;
    crate::schema::migrate(&mut *pool.acquire().await?, Backend::of(url)).await?;
    Ok(pool)
}

/// The file a `sqlite:` URL names (`None` for other URLs and in-memory
/// databases).
pub fn sqlite_file(url: &str) -> Option<std::path::PathBuf> {
    let rest = url.strip_prefix("sqlite:")?;
    let rest = rest.strip_prefix("//").unwrap_or(rest);
    let path = rest.split('?').next().unwrap_or(rest);
    (!path.is_empty() && !path.starts_with(":memory:")).then(|| path.into())
}

/// Creates the SQLite file `file` empty with mode 0600 if it is missing,
/// so SQLite, which gives its log files the database's mode, never makes
/// any of them readable by others.
fn create_private(file: &std::path::Path) -> Result<(), DbError> {
    use std::os::unix::fs::OpenOptionsExt;
    match std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(file)
    {
        Ok(_) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(DbError::Other(format!(
            "cannot create the database file {}: {e}; check that its directory exists and is writable",
            file.display()
        ))),
    }
}

async fn connect(url: &str, max_connections: u32, create: bool) -> Result<AnyPool, DbError> {
    sqlx::any::install_default_drivers();
    let backend = Backend::of(url);
    let url = match backend {
        Backend::Sqlite if !url.contains("mode=") => {
            if let Some(file) = sqlite_file(url) {
                if create {
                    create_private(&file)?;
                } else if !file.exists() {
                    return Err(DbError::Other(format!(
                        "the database file {} does not exist; start rfaas-manager (or run `rfaas-manager migrate`) on it first, or check the URL",
                        file.display()
                    )));
                }
            }
            let sep = if url.contains('?') { '&' } else { '?' };
            format!("{url}{sep}mode={}", if create { "rwc" } else { "rw" })
        }
        _ => url.to_owned(),
    };
    let pool = AnyPoolOptions::new()
        .max_connections(max_connections)
        .acquire_timeout(Duration::from_secs(2))
        .after_connect(move |conn, _| {
            Box::pin(async move {
                if backend == Backend::Sqlite {
                    // With the write-ahead log, a commit is one append and no
                    // fsync (synchronous=NORMAL): a killed manager loses
                    // nothing committed; a power cut may lose the last
                    // commits since a checkpoint, never the file's
                    // consistency. Readers no longer wait for the writer.
                    sqlx::query("PRAGMA synchronous = NORMAL")
                        .execute(&mut *conn)
                        .await?;
                    // A checkpoint writes the log's pages back and syncs
                    // the file: milliseconds a commit would wait for. The
                    // checkpoints task does it off the requests' path.
                    sqlx::query(&format!(
                        "PRAGMA wal_autocheckpoint = {AUTOCHECKPOINT_PAGES}"
                    ))
                    .execute(&mut *conn)
                    .await?;
                }
                Ok(())
            })
        })
        .connect(&url)
        .await?;
    if backend == Backend::Sqlite && create {
        // Recorded in the file: every connection, of every replica and of
        // every process that only opens it, uses it.
        sqlx::query("PRAGMA journal_mode = WAL")
            .fetch_all(&pool)
            .await?;
    }
    Ok(pool)
}

/// Checkpoints the SQLite database at `url` every [`CHECKPOINT_EVERY`],
/// on a connection of its own, until `stop` says so. `PASSIVE`: it copies
/// what no reader still needs and never blocks a writer, so commits stay
/// appends to the log. Connections opened by [`open`] checkpoint by
/// themselves only when the log passes a large backstop.
pub async fn checkpoints(url: String, mut stop: tokio::sync::watch::Receiver<bool>) {
    let mut conn: Option<AnyPool> = None;
    loop {
        tokio::select! {
            _ = tokio::time::sleep(CHECKPOINT_EVERY) => {}
            _ = stop.changed() => return,
        }
        if conn.is_none() {
            conn = open(&url, 1).await.ok();
        }
        let Some(pool) = &conn else { continue };
        if let Err(e) = sqlx::query("PRAGMA wal_checkpoint(PASSIVE)")
            .fetch_all(pool)
            .await
        {
            tracing::debug!(error = %e, "checkpoint failed; reconnecting");
            conn = None;
        }
    }
}

/// Reads column `name` as an unsigned number (the schema keeps every
/// number in a `BIGINT`).
pub fn u64_col(row: &AnyRow, name: &str) -> Result<u64, DbError> {
    let v: i64 = row.try_get(name)?;
    u64::try_from(v).map_err(|_| DbError::Other(format!("column {name} holds {v}")))
}

/// Reads text column `name`.
pub fn text_col(row: &AnyRow, name: &str) -> Result<String, DbError> {
    Ok(row.try_get(name)?)
}

/// Converts a count for a `BIGINT` parameter.
pub fn i(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_password_file_fills_in_only_what_the_url_leaves_out() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("rfaas-dbpw-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let conf = ConfigDir::from_parts(Some(&dir), None);
        let pg = "postgres://rfaas@db:5432/rfaas";
        // No file: as it is.
        assert_eq!(with_password_file(pg, None, &conf).unwrap(), pg);
        let file = dir.join(DATABASE_PASSWORD);
        std::fs::write(&file, "p@ss:w/rd\nignored\n").unwrap();
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
        // Percent-encoded into the URL.
        assert_eq!(
            with_password_file(pg, None, &conf).unwrap(),
            "postgres://rfaas:p%40ss%3Aw%2Frd@db:5432/rfaas"
        );
        // A URL with its own password, and SQLite, are left alone.
        let own = "postgres://rfaas:mine@db/rfaas";
        assert_eq!(with_password_file(own, None, &conf).unwrap(), own);
        let lite = "sqlite:///var/lib/rfaas/manager.db";
        assert_eq!(with_password_file(lite, None, &conf).unwrap(), lite);
        // Others may read it: refused, naming the file and the directory.
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o640)).unwrap();
        let err = with_password_file(pg, None, &conf).unwrap_err();
        assert!(err.contains("has mode 0640"), "{err}");
        assert!(err.contains("was set by --config-dir"), "{err}");
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
        std::fs::write(&file, "\n").unwrap();
        let err = with_password_file(pg, None, &conf).unwrap_err();
        assert!(err.contains("is empty"), "{err}");
        // A file named in the configuration, instead of the directory's.
        let own_file = dir.join("manager.password");
        std::fs::write(&own_file, "other\n").unwrap();
        std::fs::set_permissions(&own_file, std::fs::Permissions::from_mode(0o644)).unwrap();
        let err = with_password_file(pg, Some(&own_file), &conf).unwrap_err();
        assert!(
            err.contains("chmod 600") && err.contains("database_password_file"),
            "{err}"
        );
        std::fs::set_permissions(&own_file, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(
            with_password_file(pg, Some(&own_file), &conf).unwrap(),
            "postgres://rfaas:other@db:5432/rfaas"
        );
        let err = with_password_file(own, Some(&own_file), &conf).unwrap_err();
        assert!(err.contains("keep the password in the file only"), "{err}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn passwords_stay_out_of_messages_and_command_lines() {
        assert_eq!(
            redact("postgres://rfaas:s3cret@db:5432/rfaas"),
            "postgres://rfaas:***@db:5432/rfaas"
        );
        assert_eq!(
            redact("postgres://rfaas@db/rfaas"),
            "postgres://rfaas@db/rfaas"
        );
        assert_eq!(
            redact("sqlite:///var/lib/a@b.db"),
            "sqlite:///var/lib/a@b.db"
        );
        let err = refuse_password_in_argument("postgres://rfaas:s3cret@db/rfaas", "--database")
            .unwrap_err();
        assert!(
            !err.contains("s3cret") && err.contains("--database"),
            "{err}"
        );
        refuse_password_in_argument("postgres://rfaas@db/rfaas", "--database").unwrap();
        refuse_password_in_argument("sqlite:///var/lib/rfaas/manager.db", "--database").unwrap();
    }

    #[test]
    fn sqlite_urls_name_their_file() {
        assert_eq!(sqlite_file("sqlite:///var/x.db"), Some("/var/x.db".into()));
        assert_eq!(sqlite_file("sqlite://x.db?mode=ro"), Some("x.db".into()));
        assert_eq!(sqlite_file("sqlite:x.db"), Some("x.db".into()));
        assert_eq!(sqlite_file("sqlite::memory:"), None);
        assert_eq!(sqlite_file("postgres://h/db"), None);
    }

    /// Commits stay in the log until the checkpoints task copies them into
    /// the database file.
    #[tokio::test]
    async fn the_checkpoints_task_moves_the_log_into_the_file() {
        let dir = std::env::temp_dir().join(format!("rfaas-ckpt-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("m.db");
        let url = format!("sqlite://{}", file.display());
        let pool = open_and_migrate(&url, 1).await.unwrap();
        sqlx::query("CREATE TABLE filler (v TEXT NOT NULL)")
            .execute(&pool)
            .await
            .unwrap();
        let text = "x".repeat(4000);
        for _ in 0..500 {
            sqlx::query("INSERT INTO filler (v) VALUES ($1)")
                .bind(&text)
                .execute(&pool)
                .await
                .unwrap();
        }
        let size = || std::fs::metadata(&file).unwrap().len();
        let before = size();
        // Two megabytes committed, under the backstop: all in the log.
        assert!(before < 1 << 20, "the file has {before} bytes already");
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let task = tokio::spawn(checkpoints(url.clone(), stopped));
        let until = std::time::Instant::now() + Duration::from_secs(5);
        while size() < 2 << 20 {
            assert!(
                std::time::Instant::now() < until,
                "no checkpoint: the file stays at {} bytes",
                size()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        stop.send(true).unwrap();
        task.await.unwrap();
        pool.close().await;
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

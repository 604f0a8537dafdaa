//! What a fleet point reads besides the HTTP answers: the statements the
//! replicas ran (PostgreSQL's `pg_stat_statements`), the CPU time of the
//! replica processes (`/proc/<pid>/stat`), and a replica's counter of the
//! nodes it marked lost (`/metrics`).

use std::time::Duration;

use rfaas_manager::store::LIVENESS;
use rfaas_testkit::postgres::Postgres;
use sqlx::Row as _;

use crate::cleanup;
use crate::error::{Error, Result};
use crate::manager::{agent, call};

/// A throwaway PostgreSQL server with `pg_stat_statements` loaded.
#[derive(Debug)]
pub struct Database {
    pub pg: Postgres,
    _pid: Option<cleanup::Registered>,
    runtime: tokio::runtime::Runtime,
}

/// Statements run since the last reset, by kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Statements {
    /// Those tagged [`LIVENESS`], the manager's liveness statements.
    pub liveness: u64,
    /// Every other (grants and releases mostly).
    pub other: u64,
}

impl Database {
    /// Starts the server (scripts/pg.sh), loads `pg_stat_statements`
    /// (preloaded, so a restart) and leaves utility statements (`BEGIN`,
    /// `COMMIT`, `LISTEN`) uncounted: the figures count the statements
    /// that read or write.
    pub fn start() -> Result<Database> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| Error::new(format!("could not start a tokio runtime: {e}")))?;
        let mut pg = Postgres::start()
            .map_err(|e| Error::new(format!("could not start PostgreSQL for the fleet: {e}")))?;
        let db = |e: sqlx::Error| {
            Error::new(format!(
                "could not load pg_stat_statements (Debian's postgresql-15 ships it): {e}"
            ))
        };
        runtime
            .block_on(execute(
                pg.url(),
                &["ALTER SYSTEM SET shared_preload_libraries = 'pg_stat_statements'"],
            ))
            .map_err(db)?;
        pg.stop()
            .and_then(|()| pg.start_again())
            .map_err(|e| Error::new(format!("could not restart PostgreSQL: {e}")))?;
        runtime
            .block_on(execute(
                pg.url(),
                &[
                    "CREATE EXTENSION IF NOT EXISTS pg_stat_statements",
                    "ALTER SYSTEM SET pg_stat_statements.track_utility = off",
                    "SELECT pg_reload_conf()",
                ],
            ))
            .map_err(db)?;
        let pid = pg.pid().map(cleanup::register);
        Ok(Database {
            pg,
            _pid: pid,
            runtime,
        })
    }

    /// Forgets the statements counted so far.
    pub fn reset(&self) -> Result<()> {
        self.runtime
            .block_on(execute(
                self.pg.url(),
                &["SELECT pg_stat_statements_reset()"],
            ))
            .map_err(|e| Error::new(format!("could not reset pg_stat_statements: {e}")))
    }

    /// The statements run since [`Database::reset`], but the bench's own.
    pub fn statements(&self) -> Result<Statements> {
        // The tag is the comment the manager's liveness statements start
        // with (`rfaas_manager::store::LIVENESS`).
        let sql =
            "SELECT CAST(COALESCE(SUM(calls) FILTER (WHERE strpos(query, $1) > 0), 0) AS BIGINT),
                    CAST(COALESCE(SUM(calls) FILTER (WHERE strpos(query, $1) = 0), 0) AS BIGINT)
             FROM pg_stat_statements WHERE strpos(query, 'pg_stat_statements') = 0";
        self.runtime
            .block_on(async {
                let pool = pool(self.pg.url()).await?;
                let row = sqlx::query(sql).bind(LIVENESS).fetch_one(&pool).await?;
                pool.close().await;
                Ok::<_, sqlx::Error>(Statements {
                    liveness: row.try_get::<i64, _>(0)?.max(0) as u64,
                    other: row.try_get::<i64, _>(1)?.max(0) as u64,
                })
            })
            .map_err(|e| Error::new(format!("could not read pg_stat_statements: {e}")))
    }
    /// The `n` statements with the longest single run since
    /// [`Database::reset`]: where a slow grant's time may have gone
    /// (a lock wait shows as a long maximum on a short statement).
    pub fn slowest(&self, n: u32) -> Result<Vec<Slow>> {
        let sql = "SELECT left(regexp_replace(query, '\\s+', ' ', 'g'), 90), calls,
                          mean_exec_time, max_exec_time
                   FROM pg_stat_statements WHERE strpos(query, 'pg_stat_statements') = 0
                   ORDER BY max_exec_time DESC LIMIT $1";
        self.runtime
            .block_on(async {
                let pool = pool(self.pg.url()).await?;
                let rows = sqlx::query(sql).bind(i64::from(n)).fetch_all(&pool).await?;
                pool.close().await;
                rows.iter()
                    .map(|row| {
                        Ok(Slow {
                            query: row.try_get(0)?,
                            calls: row.try_get::<i64, _>(1)?.max(0) as u64,
                            mean_ms: row.try_get(2)?,
                            max_ms: row.try_get(3)?,
                        })
                    })
                    .collect::<std::result::Result<Vec<_>, sqlx::Error>>()
            })
            .map_err(|e| Error::new(format!("could not read pg_stat_statements: {e}")))
    }
}

/// One statement's times, from `pg_stat_statements`.
#[derive(Debug, Clone, PartialEq)]
pub struct Slow {
    /// The statement's first 90 characters, spaces folded.
    pub query: String,
    pub calls: u64,
    pub mean_ms: f64,
    pub max_ms: f64,
}

async fn pool(url: &str) -> std::result::Result<sqlx::PgPool, sqlx::Error> {
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_secs(30))
        .connect(url)
        .await
}

async fn execute(url: &str, statements: &[&str]) -> std::result::Result<(), sqlx::Error> {
    let pool = pool(url).await?;
    for s in statements {
        sqlx::query(s).execute(&pool).await?;
    }
    pool.close().await;
    Ok(())
}

/// CPU time (user and system) the processes `pids` used so far, ms; a
/// process that ended counts nothing.
pub fn cpu_ms(pids: &[u32]) -> u64 {
    // SAFETY: sysconf reads a constant of the system.
    let tick = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    pids.iter()
        .filter_map(|pid| std::fs::read_to_string(format!("/proc/{pid}/stat")).ok())
        .filter_map(|stat| cpu_ticks(&stat))
        .map(|ticks| ticks * 1000 / tick)
        .sum()
}

/// utime + stime of a `/proc/<pid>/stat` line, in clock ticks.
fn cpu_ticks(stat: &str) -> Option<u64> {
    // The name (field 2) may hold spaces and parentheses: count after
    // its last ')'. utime and stime are fields 14 and 15, the 12th and
    // 13th after the name.
    let mut fields = stat[stat.rfind(')')? + 1..].split_whitespace();
    let utime: u64 = fields.nth(11)?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some(utime + stime)
}

/// The replica at `url`'s count of the nodes it marked lost since it
/// started (`rfaas_manager_lost_nodes_total`).
pub fn lost_nodes(url: &str, admin: &str) -> Result<u64> {
    metric(url, admin, "rfaas_manager_lost_nodes_total").map(|v| v as u64)
}

/// The heartbeat interval and loss timeout the replicas at `urls` go by
/// now, ms (the largest of their `rfaas_manager_heartbeat_interval_seconds`
/// and `rfaas_manager_lost_after_seconds`). A node keeps the loss timeout
/// of its registration, which a replica whose view was still filling
/// answered with a smaller fleet's; the reaping goes by these.
pub fn intervals(urls: &[String], admin: &str) -> Result<(u64, u64)> {
    let (mut interval, mut lost_after) = (0u64, 0u64);
    for url in urls {
        let ms = |name| metric(url, admin, name).map(|s| (s * 1000.0).round() as u64);
        interval = interval.max(ms("rfaas_manager_heartbeat_interval_seconds")?);
        lost_after = lost_after.max(ms("rfaas_manager_lost_after_seconds")?);
    }
    Ok((interval, lost_after))
}

/// An unlabelled sample `name` of the replica at `url`'s metrics.
fn metric(url: &str, admin: &str, name: &str) -> Result<f64> {
    let (status, text) = call(&agent(), "GET", &format!("{url}/metrics"), admin, None)?;
    if status != 200 {
        return Err(Error::new(format!(
            "GET {url}/metrics answered {status}: {text}"
        )));
    }
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .ok_or_else(|| Error::new(format!("the metrics of {url} have no {name}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_time_is_read_after_the_name() {
        let stat = "4242 (rfaas (x) y) S 1 4242 4242 0 -1 4194560 900 0 0 0 \
                    17 5 0 0 20 0 9 0 123 456 789";
        assert_eq!(cpu_ticks(stat), Some(22));
        assert_eq!(cpu_ticks("4242 (cut) S 1"), None);
        assert_eq!(cpu_ms(&[u32::MAX]), 0, "no such process");
    }
}

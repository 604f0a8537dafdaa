//! A real PostgreSQL 15 server (Debian's `postgresql-15`) in a private
//! directory on a free 127.0.0.1 port, with a database `rfaas`: stopped,
//! crashed and started again on the same port with its data, and stopped by
//! pid and removed on drop.
//!
//! Every step is `scripts/pg.sh`, the script people use to try rfaas with
//! PostgreSQL, so the tests prove the script and there is one way to run a
//! throwaway server, not two. Its binaries come from
//! `/usr/lib/postgresql/15/bin`, or `$PG_BINDIR`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};

/// A throwaway PostgreSQL server.
#[derive(Debug)]
pub struct Postgres {
    dir: PathBuf,
    bindir: PathBuf,
    url: String,
    port: u16,
    running: bool,
}

/// Where the server's binaries are: `$PG_BINDIR`, else Debian's
/// `/usr/lib/postgresql/15/bin`.
pub fn bindir() -> PathBuf {
    std::env::var_os("PG_BINDIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/usr/lib/postgresql/15/bin"))
}

fn script() -> PathBuf {
    crate::repo_root().join("scripts").join("pg.sh")
}

impl Postgres {
    /// Creates a cluster in a new temporary directory, starts it on a free
    /// 127.0.0.1 port and waits until it accepts connections. `Err` says
    /// why it could not (PostgreSQL not installed: `scripts/test.sh`
    /// installs Debian's `postgresql-15`).
    pub fn start() -> Result<Postgres, String> {
        Postgres::start_with(&bindir())
    }

    /// [`Postgres::start`] with the binaries in `bindir`.
    pub fn start_with(bindir: &Path) -> Result<Postgres, String> {
        if !bindir.join("postgres").exists() {
            return Err(format!(
                "{} is not installed; install Debian's postgresql-15 and postgresql-client-15 \
                 (scripts/test.sh does) or set PG_BINDIR",
                bindir.join("postgres").display()
            ));
        }
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let dir = loop {
            let dir = std::env::temp_dir().join(format!(
                "rfaas-postgres-{}-{}",
                std::process::id(),
                NEXT.fetch_add(1, Ordering::Relaxed)
            ));
            if !dir.exists() {
                break dir;
            }
        };
        let mut pg = Postgres {
            dir,
            bindir: bindir.to_path_buf(),
            url: String::new(),
            port: 0,
            // Whatever pg.sh started before failing is stopped on drop.
            running: true,
        };
        pg.url = pg.script("start")?;
        pg.port = pg
            .url
            .rsplit_once(':')
            .and_then(|(_, rest)| rest.split('/').next())
            .and_then(|port| port.parse().ok())
            .ok_or_else(|| format!("scripts/pg.sh printed {:?}, not a URL", pg.url))?;
        Ok(pg)
    }

    /// Its URL, `postgres://postgres:PASSWORD@127.0.0.1:PORT/rfaas`; the
    /// same for the server's whole life, across stops and crashes.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The CA file its TLS certificate (for 127.0.0.1) checks with, for
    /// `sslmode=verify-full&sslrootcert=...`.
    pub fn ca_file(&self) -> PathBuf {
        self.dir.join("tls").join("ca.pem")
    }

    /// Its port on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Its directory: data, log, and the socket (`psql -h DIR -p PORT -U
    /// postgres rfaas` needs no password).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The server's pid while it runs.
    pub fn pid(&self) -> Option<u32> {
        if !self.running {
            return None;
        }
        std::fs::read_to_string(self.dir.join("postgres.pid"))
            .ok()?
            .trim()
            .parse()
            .ok()
    }

    /// Its log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("postgres.log")).unwrap_or_default()
    }

    /// Stops it (fast shutdown: clients are disconnected), keeping its data
    /// and its port for [`Postgres::start_again`].
    pub fn stop(&mut self) -> Result<(), String> {
        self.script("stop")?;
        self.running = false;
        Ok(())
    }

    /// Kills it and its processes with SIGKILL, a crash: committed
    /// transactions survive it, [`Postgres::start_again`] recovers.
    pub fn kill(&mut self) -> Result<(), String> {
        self.script("kill")?;
        self.running = false;
        Ok(())
    }

    /// Starts it again after [`Postgres::stop`] or [`Postgres::kill`], on
    /// the same port with the same data, and waits until it accepts
    /// connections. Does nothing if it runs.
    pub fn start_again(&mut self) -> Result<(), String> {
        self.running = true;
        let url = self.script("start")?;
        if url != self.url {
            return Err(format!("the server came back as {url}, not {}", self.url));
        }
        Ok(())
    }

    /// [`Postgres::stop`], then [`Postgres::start_again`].
    pub fn restart(&mut self) -> Result<(), String> {
        self.stop()?;
        self.start_again()
    }

    /// Runs `sql` with `psql` (stopping at the first error) and returns
    /// what it printed: unaligned rows, `|` between columns, one line each.
    pub fn psql(&self, sql: &str) -> Result<String, String> {
        let psql = self.bindir.join("psql");
        let out = Command::new(&psql)
            .args(["-X", "-q", "-t", "-A", "-v", "ON_ERROR_STOP=1", "-d"])
            .arg(&self.url)
            .arg("-c")
            .arg(sql)
            .output()
            .map_err(|e| {
                format!(
                    "run {}: {e}; install Debian's postgresql-client-15 (scripts/test.sh does)",
                    psql.display()
                )
            })?;
        if !out.status.success() {
            return Err(format!(
                "psql -c {sql:?} failed ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        Ok(String::from_utf8_lossy(&out.stdout).trim_end().to_string())
    }

    /// Runs `scripts/pg.sh COMMAND DIR` and returns the last line it
    /// printed.
    fn script(&self, command: &str) -> Result<String, String> {
        let out = Command::new("bash")
            .arg(script())
            .arg(command)
            .arg(&self.dir)
            .env("PG_BINDIR", &self.bindir)
            .output()
            .map_err(|e| format!("run scripts/pg.sh {command}: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "scripts/pg.sh {command} {} failed ({}): {}\nthe server's log:\n{}",
                self.dir.display(),
                out.status,
                String::from_utf8_lossy(&out.stderr).trim(),
                self.log()
            ));
        }
        Ok(String::from_utf8_lossy(&out.stdout)
            .lines()
            .last()
            .unwrap_or_default()
            .to_string())
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        if self.running && self.stop().is_err() {
            let _ = self.kill();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

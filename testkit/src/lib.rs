//! Test support shared by the rfaas crates' integration tests and benches.
//!
//! # Layout
//!
//! - [`accounting`]: a real `rfaas-accounting` in a private directory
//!   (killed, restarted on its region file), and a peer that says the
//!   hello and adds into slots as an executor daemon does.
//! - [`abuse`]: connections that misbehave on a control port (idle, slow,
//!   stalled libraries) from chosen loopback addresses, and what a process
//!   holds (`/proc`).
//! - [`cpus`]: the CPUs a test may use, and pinning its thread to one.
//! - [`executord`]: a real `rfaas-executord` in a private directory, with
//!   token minting and the local socket, stopped by pid on drop.
//! - [`functions`]: builds the example function libraries
//!   (`examples/functions/c/*.c` into `libfunctions.so`) and finds the Rust
//!   cdylib.
//! - [`manager`]: a real `rfaas-manager` (one or several replicas), a
//!   small REST caller, and a loopback server that gives one fixed answer
//!   (a manager's reply no test manager gives).
//! - [`postgres`]: a real PostgreSQL 15 server on loopback (through
//!   `scripts/pg.sh`), stopped, crashed and started again with its data.
//! - [`process`]: a service started and waited for until it prints its
//!   ready line, stopped by pid (SIGTERM, then SIGKILL), and waiting for a
//!   process to end.
//! - [`prometheus`]: a real Prometheus server scraping given targets, and
//!   queries through its HTTP API.
//! - [`TempDir`], [`output_text`] and [`json_lines`]: a test's own
//!   directory, a finished command's output for an assertion's message,
//!   and a bench's JSON lines.
//! - [`slurm`]: a real Slurm cluster of several nodes on loopback (through
//!   `scripts/slurm-cluster.sh`), optionally with slurmdbd, its clients
//!   (srun, sbatch, sacctmgr, ...), and the SPANK plugin the tests load
//!   (`RFAAS_SPANK_PLUGIN` chooses another build).
//! - [`strangers`]: strangers on a manager's REST port, over plain HTTP or
//!   TLS: raw requests, a flood of made-up credentials, idle connections
//!   (before or after their handshake) and a slowloris, from chosen
//!   loopback addresses.
//! - [`tls`]: a throwaway CA per test run (`scripts/lib.sh`'s
//!   `make_test_ca`), whose certificate every test manager serves.
//! - [`wait`]: waiting for an event (a condition polled until it holds,
//!   a thread asleep in the kernel) instead of sleeping for a guessed time.
//! - [`on_both!`]: one test per database (SQLite and PostgreSQL).

pub mod abuse;
pub mod accounting;
pub mod cpus;
pub mod executord;
pub mod functions;
pub mod manager;
pub mod postgres;
pub mod process;
pub mod prometheus;
pub mod slurm;
pub mod strangers;
pub mod tls;
pub mod wait;

use std::path::{Path, PathBuf};
use std::process::Output;
use std::sync::atomic::{AtomicU32, Ordering};

/// The repository's root directory.
pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("testkit lives in the repository root")
        .to_path_buf()
}

/// The workspace's cargo target directory (`CARGO_TARGET_DIR` or `target/`).
pub fn target_dir() -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(dir) => PathBuf::from(dir),
        None => repo_root().join("target"),
    }
}

/// A loopback address with a port nobody listened on a moment ago, for a
/// listener whose port must be known before its process starts
/// (`metrics_listen`, say).
pub fn free_port() -> std::net::SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .unwrap_or_else(|e| panic!("bind a loopback port: {e}"))
}

/// A directory of a test's own under the system's temporary directory,
/// removed on drop unless the test is failing (then it stays to be read).
#[derive(Debug)]
pub struct TempDir(PathBuf);

impl TempDir {
    /// A new, empty directory whose name holds `name` and this process's id.
    pub fn new(name: &str) -> TempDir {
        static SEQ: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "rfaas-test-{}-{}-{name}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("create {}: {e}", dir.display()));
        TempDir(dir)
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.0
    }

    /// `name` in the directory.
    pub fn join(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

/// A finished command's exit status, standard output and standard error,
/// for an assertion's message.
pub fn output_text(o: &Output) -> String {
    format!(
        "status {:?}\nstdout: {}\nstderr: {}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// The JSON lines a bench printed on its stdout (with `--json`), one value
/// each; panics with the whole output when the command failed or a line
/// is not JSON.
pub fn json_lines(o: &Output) -> Vec<serde_json::Value> {
    assert!(o.status.success(), "the command failed: {}", output_text(o));
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(|l| {
            serde_json::from_str(l)
                .unwrap_or_else(|e| panic!("{l:?} is not JSON ({e}): {}", output_text(o)))
        })
        .collect()
}

/// Generates one test per database from `fn $name(kind: &str)`, called
/// with `"sqlite"` and with `"postgres"`: `on_both!(name)` for a plain
/// function, `on_both!(async name)` for an `async fn`, run on a
/// current-thread tokio runtime (the calling crate's `tokio`).
#[macro_export]
macro_rules! on_both {
    ($name:ident) => {
        mod $name {
            #[test]
            fn sqlite() {
                super::$name("sqlite");
            }
            #[test]
            fn postgres() {
                super::$name("postgres");
            }
        }
    };
    (async $name:ident) => {
        mod $name {
            fn run(kind: &str) {
                ::tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("a tokio runtime")
                    .block_on(super::$name(kind));
            }
            #[test]
            fn sqlite() {
                run("sqlite");
            }
            #[test]
            fn postgres() {
                run("postgres");
            }
        }
    };
}

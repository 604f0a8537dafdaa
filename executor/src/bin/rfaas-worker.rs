//! `rfaas-worker`: serves one allocation's invocations. Started by
//! `rfaas-executord` with one end of a socket pair; see
//! `rfaas_executor::worker` and `docs/invocation.md`.

use std::os::fd::{FromRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::process::ExitCode;

use anyhow::{bail, Context};
use clap::Parser;
use rfaas_executor::worker;

/// Serves one rfaas allocation: loads the job's function library and
/// answers its invocations. rfaas-executord starts it; there is no use in
/// running it by hand.
///
/// The daemon keeps a few started ahead of allocations. On its assignment a
/// worker pins itself to the granted cores, applies the memory limit, drops
/// to the lease's user and only then loads the library. It logs to the
/// daemon's stderr.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// The descriptor of the socket pair rfaas-executord hands over.
    #[arg(long)]
    control_fd: RawFd,
    /// Keep serving when rfaas-executord ends, and wait for the next one
    /// to adopt the worker (its `workers_outlive_daemon`).
    #[arg(long)]
    outlive_daemon: bool,
}

fn main() -> ExitCode {
    // First: die with the daemon (unless it asks the worker to outlive
    // it), and survive its SIGUSR1 (drain).
    if std::env::args_os().any(|a| a == "--outlive-daemon") {
        worker::privileges::outlive_parent();
    }
    let early = worker::privileges::die_with_parent()
        .map_err(anyhow::Error::from)
        .and_then(|()| worker::install_drain_handler().context("install the SIGUSR1 handler"));
    init_logging();
    if let Err(e) = early {
        tracing::error!("{e:#}");
        return ExitCode::from(worker::EXIT_FAILURE as u8);
    }
    let args = match Args::try_parse() {
        Ok(args) => args,
        // --help and --version print and exit 0; a usage error is a failure.
        Err(e) if !e.use_stderr() => e.exit(),
        Err(e) => {
            tracing::error!("{e}");
            return ExitCode::from(worker::EXIT_FAILURE as u8);
        }
    };
    let control = match take_control_fd(args.control_fd) {
        Ok(c) => c,
        Err(e) => {
            tracing::error!("{e:#}");
            return ExitCode::from(worker::EXIT_FAILURE as u8);
        }
    };
    match worker::run(control) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e}");
            ExitCode::from(e.exit_code() as u8)
        }
    }
}

/// Adopts `fd` as the control socket, after checking it is one, and keeps
/// it from leaking into anything the library might exec.
fn take_control_fd(fd: RawFd) -> anyhow::Result<UnixStream> {
    // SAFETY: fstat writes into the struct we pass.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above; a bad descriptor is reported as EBADF.
    if unsafe { libc::fstat(fd, &mut st) } != 0 {
        return Err(std::io::Error::last_os_error())
            .with_context(|| format!("--control-fd {fd} is not an open descriptor"));
    }
    if st.st_mode & libc::S_IFMT != libc::S_IFSOCK {
        bail!("--control-fd {fd} is not a socket; rfaas-worker is started by rfaas-executord");
    }
    // SAFETY: fcntl on a descriptor just checked to be open.
    if unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) } != 0 {
        return Err(std::io::Error::last_os_error())
            .context("set FD_CLOEXEC on the control socket");
    }
    // SAFETY: the daemon handed this descriptor to us alone; nothing else in
    // the process owns it.
    Ok(unsafe { UnixStream::from_raw_fd(fd) })
}

/// Logs to stderr, which the daemon captures; `RUST_LOG` may name a level.
fn init_logging() {
    let level = std::env::var("RUST_LOG")
        .ok()
        .and_then(|v| v.parse::<tracing::Level>().ok())
        .unwrap_or(tracing::Level::INFO);
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_max_level(level)
        .with_ansi(false)
        .init();
}

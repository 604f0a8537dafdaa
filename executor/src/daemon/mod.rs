//! The node daemon, `rfaas-executord`: checks lease tokens, owns the node's
//! configured CPUs and memory, starts and supervises `rfaas-worker`
//! processes, and tells clients when one ends. See `docs/executor.md`
//! (operation) and `docs/invocation.md` (protocol).
//!
//! Threads, all plain std threads: the connection loop (every control and
//! local connection, one epoll set), a fixed pool of request threads for
//! allocations and a smaller one for deallocations and node-tool requests,
//! the spawner (every worker is forked from it), one watcher per worker,
//! the lease ticker, the manager link and the billing poster (when
//! `[manager]` is set), Slurm reconciliation (when `[slurm]` is set), and
//! the main thread waiting for SIGTERM/SIGINT.
//!
//! # Layout
//!
//! - [`config`]: the TOML file, defaults, checked [`Settings`].
//! - [`host`]: what the host says of itself for the keys a file leaves
//!   out (`slurmd -C`, the host name, the route to the manager, the
//!   kernel's CPUs and memory), and where each value came from.
//! - [`keys`] (from `rfaas-tls`, which the accounting service and
//!   `rfaas-token` share): the lease key files: the public keys tokens are
//!   checked with, and the secret key `rfaas-token` mints with.
//! - `capacity`: free CPUs and memory, per-lease holdings.
//! - `users`: the lease's user in the node's user database.
//! - `cgroup`: one cgroup v2 per allocation inside the subtree delegated
//!   to the daemon: its CPUs (`cpuset.cpus`), its memory (`memory.max`),
//!   every process it starts, killed together (`cgroup.kill`).
//! - `memlimit`: the allocation's cgroup or, without one, `RLIMIT_AS`;
//!   the locked-memory limit verbs needs.
//! - `process`: spawning (plain or bubblewrap), signalling, waiting; the
//!   spawner's work.
//! - `clock`: the wall clock leases count in.
//! - `state`: the allocation table behind the daemon's one lock.
//! - `shared`: what every thread shares: settings, keys, the table, and
//!   the parts below, each owned by its module; ending allocations and
//!   take-backs. The parts never name it, so it depends only downward.
//! - `outbox`: the connection loop's inbox.
//! - `supervise`: the spawner and pool, worker watchers, lease expiry.
//! - `server`: the connection loop: accepting within the caps, deadlines,
//!   TLS on the control port (a client's first byte says whether it starts
//!   TLS; plain ones are refused when TLS is required), reading frames,
//!   handing requests out, writing replies.
//! - `refusal`: a refused request's code and sentence, and its frame.
//! - `conn`: one connection: its socket (a control one maybe inside a
//!   non-blocking rustls session), the frame reader and the outgoing
//!   buffer.
//! - `epoll`, `pool`: the loop's epoll set and the request threads.
//! - `control`: the clients' TCP protocol: what each request does, and the
//!   end of a connection.
//! - `records`: the runtime state directory's files, written atomically:
//!   an allocation record's removal and the lease carry files.
//! - `adopt`: the runtime records of running allocations and, at start,
//!   adopting the workers a previous daemon left running
//!   (`workers_outlive_daemon`).
//! - `allocate`: one allocation's steps in order (validation, the lease
//!   check, capacity, spawning the worker).
//! - `local`: the node tools' unix socket (status, drain, resume, usage,
//!   Slurm's take-back and offer).
//! - `jobs`: Slurm jobs' credentials (`jobs::store` keeps them).
//! - `slurm`: Slurm jobs on this node: taking back only their CPUs,
//!   giving them back, and reconciling with `scontrol`'s view (when
//!   `[slurm]` is set).
//! - `register`: registration and heartbeats with the resource managers.
//! - `billing`: posting each lease's usage into its accounting slot.
//! - `renew`: moving a running allocation's end with a renewed lease's
//!   token.
//! - `metrics`: Prometheus metrics; `scrape`: the port that serves them
//!   and the health check (`metrics_listen`).
//! - `usage`: what each lease used here, from the workers' meter areas
//!   bounded by the kernel's CPU time (the figures accounting is built on).

pub mod config;
pub mod host;

mod adopt;
mod allocate;
mod billing;
mod capacity;
mod cgroup;
mod clock;
mod conn;
mod control;
mod epoll;
mod jobs;
mod local;
mod memlimit;
mod metrics;
mod outbox;
mod pool;
mod process;
mod records;
mod refusal;
mod register;
mod renew;
mod scrape;
mod server;
mod shared;
mod slurm;
mod state;
mod supervise;
mod usage;
mod users;

use std::io;
use std::net::{SocketAddr, TcpListener};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::{mpsc, Arc};

pub use config::{
    BillingConfig, BillingSettings, Config, ConfigError, CpuMap, ManagerConfig, ManagerSettings,
    Sandbox, Settings, SlurmConfig, SlurmSettings,
};
pub use rfaas_tls::keys::{self, KeyFileError};

use epoll::Waker;
use memlimit::MemoryLimiter;
use outbox::{LoopMsg, Outbox};
use process::SpawnJob;
use server::{ControlTls, Server};
use shared::Shared;

/// Why the daemon cannot start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StartError {
    /// A lease key file is unusable.
    #[error("{why}; {hint}")]
    Keys {
        /// Why (its message says all its causes).
        why: KeyFileError,
        /// What names other files
        /// ([`ConfigDir::hint`](rfaas_proto::files::ConfigDir::hint)).
        hint: String,
    },
    /// A directory or socket could not be made.
    #[error("cannot {what} {path}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// With which path or address.
        path: String,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// The node credential for the managers is unusable.
    #[error("{0}")]
    Credential(String),
    /// `enforce_isolation` is set and allocations cannot have cgroups.
    #[error("{0}")]
    Isolation(String),
    /// The control port's certificate or key (`control_tls_cert`,
    /// `control_tls_key`) is unusable.
    #[error("{0} (control_tls_cert, control_tls_key in executord.toml)")]
    Tls(String),
    /// The worker binary is not there.
    #[error("the worker binary {0} does not exist; install rfaas-worker next to rfaas-executord or set worker_path")]
    NoWorker(PathBuf),
}

/// Every reason the daemon with `settings` would not start that the files
/// it reads before binding show (lease keys, node credential, control
/// certificate, worker binary), read as [`Daemon::bind`] reads them; for
/// `--check-config`. Binds nothing, connects nowhere.
pub fn check_files(settings: &Settings) -> Vec<String> {
    [
        read_lease_keys(settings).map(drop),
        read_node_credential(settings).map(drop),
        load_control_tls(settings).map(drop),
        find_worker(settings),
    ]
    .into_iter()
    .filter_map(|r| r.err().map(|e| e.to_string()))
    .collect()
}

fn read_lease_keys(settings: &Settings) -> Result<rfaas_proto::lease::LeaseKeys, StartError> {
    keys::read_lease_keys(&settings.lease_keys).map_err(|why| StartError::Keys {
        why,
        hint: settings
            .config_dir
            .hint(&["--lease-keys", "lease_keys in executord.toml"]),
    })
}

fn read_node_credential(settings: &Settings) -> Result<Option<String>, StartError> {
    let Some(m) = &settings.manager else {
        return Ok(None);
    };
    register::read_credential(&m.credential_file)
        .map(Some)
        .map_err(|e| {
            StartError::Credential(format!(
                "{e}; {}",
                settings
                    .config_dir
                    .hint(&["credential_file in [manager] of executord.toml"])
            ))
        })
}

fn load_control_tls(settings: &Settings) -> Result<Option<ControlTls>, StartError> {
    settings
        .control_tls
        .as_ref()
        .map(|t| {
            Ok(ControlTls {
                cert: rfaas_tls::ServerCert::load(&t.cert, &t.key)
                    .map_err(|e| StartError::Tls(e.to_string()))?,
                required: t.required,
            })
        })
        .transpose()
}

fn find_worker(settings: &Settings) -> Result<(), StartError> {
    if settings.worker_path.exists() {
        Ok(())
    } else {
        Err(StartError::NoWorker(settings.worker_path.clone()))
    }
}

/// A bound daemon, not yet serving.
#[derive(Debug)]
pub struct Daemon {
    /// Running allocations a previous daemon recorded, to adopt.
    records: Vec<adopt::Record>,
    shared: Arc<Shared>,
    jobs: mpsc::Receiver<SpawnJob>,
    control: TcpListener,
    local: UnixListener,
    control_addr: SocketAddr,
    inbox: mpsc::Receiver<LoopMsg>,
    waker: Arc<Waker>,
    /// The node credential, when `[manager]` is configured.
    credential: Option<String>,
    /// The `/metrics` listener, when configured.
    metrics: Option<TcpListener>,
    /// The control port's certificate, when it speaks TLS.
    tls: Option<ControlTls>,
}

impl Daemon {
    /// Reads the lease keys, probes the memory-limit mechanism, makes the
    /// runtime directory and binds both listeners.
    pub fn bind(settings: Settings) -> Result<Daemon, StartError> {
        let io_err = |what, path: &Path| {
            let path = path.display().to_string();
            move |source| StartError::Io { what, path, source }
        };
        let lease_keys = read_lease_keys(&settings)?;
        tracing::info!(key_ids = ?lease_keys.key_ids().collect::<Vec<_>>(), "lease keys read");
        let credential = read_node_credential(&settings)?;
        let tls = match load_control_tls(&settings)? {
            Some(t) => Some(t),
            None => {
                if !settings.control_listen.ip().is_loopback() {
                    tracing::warn!(
                        listen = %settings.control_listen,
                        "the control port carries lease tokens in clear; \
                         set control_tls_cert and control_tls_key for TLS"
                    );
                }
                None
            }
        };
        find_worker(&settings)?;
        if !settings.runtime_dir.exists() {
            std::fs::create_dir_all(&settings.runtime_dir).map_err(io_err(
                "create the runtime directory",
                &settings.runtime_dir,
            ))?;
            // Users reach their own allocation directories through it.
            std::fs::set_permissions(
                &settings.runtime_dir,
                std::fs::Permissions::from_mode(0o711),
            )
            .map_err(io_err("set the mode of", &settings.runtime_dir))?;
        }
        // Records of workers a previous daemon left running; their
        // directories stay, and new allocation ids follow theirs.
        let records = adopt::load(&settings.runtime_dir);
        let keep: Vec<PathBuf> = records.iter().map(|r| r.runtime_dir.clone()).collect();
        remove_stale_allocation_dirs(&settings.runtime_dir, &keep);

        let control =
            TcpListener::bind(settings.control_listen).map_err(|source| StartError::Io {
                what: "listen on",
                path: settings.control_listen.to_string(),
                source,
            })?;
        let control_addr = control.local_addr().map_err(|source| StartError::Io {
            what: "read the address of",
            path: settings.control_listen.to_string(),
            source,
        })?;
        let local = bind_local(&settings.local_socket)?;
        let metrics = match settings.metrics_listen {
            Some(addr) => Some(TcpListener::bind(addr).map_err(|source| StartError::Io {
                what: "listen on",
                path: format!("{addr} (metrics_listen)"),
                source,
            })?),
            None => None,
        };

        let adopted: Vec<u64> = records.iter().map(|r| r.allocation_id).collect();
        let limiter = MemoryLimiter::detect(settings.enforce_isolation, &adopted)
            .map_err(StartError::Isolation)?;
        let mut settings = settings;
        if settings.workers_outlive() && !limiter.takes_a_new_daemon() {
            tracing::warn!(
                "workers_outlive_daemon is set, but the service manager started the daemon in its \
                 delegated cgroup itself (systemd before 254, which has no DelegateSubgroup=): no \
                 new daemon could start there while allocations hold cgroups, so workers stop \
                 with this daemon"
            );
            settings.workers_outlive_daemon = false;
        }
        memlimit::allow_pinning(&settings.providers);
        if settings.sandbox == Sandbox::Bubblewrap && settings.pool_size > 0 {
            tracing::info!(
                "sandbox = bubblewrap: every worker starts per allocation, the pool is not used"
            );
        }
        raise_descriptor_limit(&settings);
        let waker = Arc::new(Waker::new().map_err(|source| StartError::Io {
            what: "create",
            path: "the connection loop's eventfd".into(),
            source,
        })?);
        let (to_loop, inbox) = mpsc::channel();
        let outbox = Outbox::new(to_loop, Arc::clone(&waker));
        let (tx, jobs) = mpsc::channel();
        let shared = Arc::new(Shared::new(
            settings,
            lease_keys,
            limiter,
            tx,
            outbox,
            credential.clone(),
        ));
        if let Some(last) = records.iter().map(|r| r.allocation_id).max() {
            shared.skip_ids_to(last + 1);
        }
        Ok(Daemon {
            records,
            shared,
            jobs,
            control,
            local,
            control_addr,
            inbox,
            waker,
            credential,
            metrics,
            tls,
        })
    }

    /// The bound control address (the real port when the configured one
    /// was 0).
    pub fn control_addr(&self) -> SocketAddr {
        self.control_addr
    }

    /// The node tools' socket.
    pub fn local_socket(&self) -> &Path {
        &self.shared.settings.local_socket
    }

    /// Adopts the workers a previous daemon left running, serves until
    /// SIGTERM or SIGINT, then stops every worker (only the pooled ones
    /// with `workers_outlive_daemon`) and returns; SIGHUP reloads the control port's certificate. Call it
    /// from the main thread before any other thread is started: it blocks
    /// those signals for every thread it creates.
    pub fn run(self) -> io::Result<()> {
        let set = block_termination_signals()?;
        let Daemon {
            records,
            shared,
            jobs,
            control,
            local,
            inbox,
            waker,
            control_addr,
            credential,
            metrics,
            tls,
        } = self;
        let spawn = |name: &str, f: Box<dyn FnOnce() + Send>| {
            std::thread::Builder::new().name(name.to_owned()).spawn(f)
        };
        let s = Arc::clone(&shared);
        spawn("spawner", Box::new(move || supervise::spawner(s, jobs)))?;
        // Before anything serves: their CPUs are not free.
        adopt::adopt_all(&shared, records);
        let s = Arc::clone(&shared);
        spawn("leases", Box::new(move || supervise::lease_ticker(s)))?;
        if let Some(listener) = metrics {
            let s = Arc::clone(&shared);
            spawn("metrics", Box::new(move || scrape::serve(s, listener)))?;
        }
        let mut billing = None;
        if let Some(credential) = credential {
            let s = Arc::clone(&shared);
            let record = register::node_record(&s.settings, control_addr);
            let tickets = Arc::new(billing::Tickets::default());
            let t = Arc::clone(&tickets);
            spawn(
                "manager",
                Box::new(move || register::run(s, record, credential, t)),
            )?;
            let s = Arc::clone(&shared);
            billing = Some(
                std::thread::Builder::new()
                    .name("billing".into())
                    .spawn(move || billing::run(s, tickets))?,
            );
        }
        // What Slurm runs here is withheld before the first allocation.
        slurm::first_round(&shared);
        let s = Arc::clone(&shared);
        spawn("slurm", Box::new(move || slurm::run(s)))?;
        let cert = tls.as_ref().map(|t| t.cert.clone());
        let server = Server::new(Arc::clone(&shared), control, local, inbox, waker, tls)?;
        let connections = std::thread::Builder::new()
            .name("connections".into())
            .spawn(move || {
                if let Err(e) = server.run() {
                    // Without it nobody can reach the daemon: stop, so the
                    // service manager starts it again.
                    tracing::error!(error = %e, "the connection loop failed; stopping");
                    // SAFETY: kill has no memory preconditions; the
                    // signal is blocked in every thread but sigwait's.
                    unsafe { libc::kill(libc::getpid(), libc::SIGTERM) };
                }
            })?;
        shared.refill();
        // Adopted workers are back and the loop serves: a `Type=notify`
        // unit counts as started from here.
        let status = format!("serving control={control_addr}");
        if let Err(e) = rfaas_proto::notify::ready(&status) {
            tracing::warn!(error = %e, "cannot tell systemd the daemon is ready (NOTIFY_SOCKET)");
        }

        let sig = loop {
            match wait_signal(&set)? {
                libc::SIGHUP => reload(cert.as_ref()),
                sig => break sig,
            }
        };
        tracing::info!(signal = %process::signal_name(sig), "stopping every worker and exiting");
        let _ = rfaas_proto::notify::stopping();
        shared.shutdown();
        // Requests in flight are answered (`draining`) and every queued
        // reply and report is written before the connections close.
        shared.outbox.post(LoopMsg::Stop);
        if connections.join().is_err() {
            tracing::error!("the connection loop panicked");
        }
        // The workers' final figures go to accounting before the exit.
        if let Some(b) = billing {
            if b.join().is_err() {
                tracing::error!("the billing thread panicked");
            }
        }
        let _ = std::fs::remove_file(&shared.settings.local_socket);
        Ok(())
    }
}

/// Raises the soft descriptor limit to the hard one: every connection and
/// every worker takes descriptors, and the service manager's soft default
/// (often 1024) is below what `max_connections` asks for.
fn raise_descriptor_limit(settings: &Settings) {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit and setrlimit read or write the struct we pass.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 {
            return;
        }
        if lim.rlim_cur < lim.rlim_max {
            lim.rlim_cur = lim.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
            libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim);
        }
    }
    // Control and local connections, and room for the workers' sockets.
    let wanted = u64::from(settings.max_connections) + 1024;
    if lim.rlim_cur < wanted {
        tracing::warn!(
            limit = lim.rlim_cur,
            wanted,
            "the descriptor limit (RLIMIT_NOFILE) is below max_connections + 1024; \
             raise it (systemd: LimitNOFILE=) or lower max_connections"
        );
    }
}

/// Directories a previous run left behind (it was killed) whose worker is
/// not to be adopted (not in `keep`): nobody uses them.
fn remove_stale_allocation_dirs(runtime_dir: &Path, keep: &[PathBuf]) {
    let Ok(entries) = std::fs::read_dir(runtime_dir) else {
        return;
    };
    for e in entries.flatten() {
        if e.file_name().to_string_lossy().starts_with("alloc-") && !keep.contains(&e.path()) {
            tracing::info!(dir = %e.path().display(), "removing a previous run's allocation directory");
            if let Err(err) = std::fs::remove_dir_all(e.path()) {
                tracing::warn!(dir = %e.path().display(), error = %err, "cannot remove a stale allocation directory");
            }
        }
    }
}

/// Binds the node tools' socket, replacing a stale one, mode 0600.
fn bind_local(path: &Path) -> Result<UnixListener, StartError> {
    let err = |what, source| StartError::Io {
        what,
        path: path.display().to_string(),
        source,
    };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| err("create the directory of", e))?;
    }
    if std::os::unix::net::UnixStream::connect(path).is_ok() {
        return Err(err(
            "bind",
            io::Error::new(
                io::ErrorKind::AddrInUse,
                "another rfaas-executord answers on this socket",
            ),
        ));
    }
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(err("remove the stale socket", e)),
    }
    // Bound under a umask that leaves the socket its owner's alone from
    // the moment it exists (a chmod after bind leaves a window in which
    // anyone may connect); the chmod then only makes sure of it.
    // SAFETY: umask has no preconditions and cannot fail; the daemon binds
    // this socket at start, before it creates files on other threads.
    let before = unsafe { libc::umask(0o177) };
    let bound = UnixListener::bind(path);
    // SAFETY: as above.
    unsafe { libc::umask(before) };
    let listener = bound.map_err(|e| err("bind", e))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
        .map_err(|e| err("set the mode of", e))?;
    Ok(listener)
}

/// SIGHUP: reads the control port's certificate and key again; on an
/// error the old ones stay.
fn reload(cert: Option<&rfaas_tls::ServerCert>) {
    match cert {
        Some(cert) => match cert.reload() {
            Ok(()) => tracing::info!(
                cert = %cert.files().0.display(),
                "SIGHUP: the control port's certificate was reloaded"
            ),
            Err(e) => tracing::error!(
                error = %e,
                "SIGHUP: the control port's certificate was not reloaded; the old one stays"
            ),
        },
        None => tracing::info!("SIGHUP: no control_tls_cert is configured, nothing to reload"),
    }
}

fn block_termination_signals() -> io::Result<libc::sigset_t> {
    // SAFETY: sigset_t is plain data, initialised by sigemptyset before use;
    // pthread_sigmask only changes this thread's mask.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGHUP);
        let rc = libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        if rc != 0 {
            return Err(io::Error::from_raw_os_error(rc));
        }
        Ok(set)
    }
}

fn wait_signal(set: &libc::sigset_t) -> io::Result<i32> {
    let mut sig = 0;
    // SAFETY: set was initialised by block_termination_signals; sig is a
    // valid out-pointer.
    let rc = unsafe { libc::sigwait(set, &mut sig) };
    if rc != 0 {
        return Err(io::Error::from_raw_os_error(rc));
    }
    Ok(sig)
}

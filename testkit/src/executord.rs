//! A real `rfaas-executord` for tests: [`Executord`] makes a lease key
//! pair, writes the public key and a configuration into a private
//! temporary directory, starts the daemon binary, waits for its ready line,
//! mints tokens for it with the secret key (which it keeps in memory, as a
//! manager would), speaks to its local socket, and stops it (and so every
//! worker) by pid when dropped.
//!
//! The daemon's binary path comes from the caller: only the executor
//! crate's tests know `CARGO_BIN_EXE_rfaas-executord`; elsewhere use
//! [`daemon_binary`]. The worker binary is the daemon's default,
//! `rfaas-worker` next to it (cargo builds both into the same directory).

use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rfaas_proto::control::client::{AllocateOk, AllocateRequest, Deallocate, Deallocated, Mode};
use rfaas_proto::control::local::{LocalReply, LocalRequest};
use rfaas_proto::control::{ErrorReply, Frame, FrameLimits, Kind};
use rfaas_proto::lease::{LeaseClaims, LeaseSigner};

/// How to configure the daemon. `Default` gives a test node: 4 logical CPU
/// slots (no pinning), 4096 MiB, one pooled worker, tcp and shm, no
/// sandbox.
#[derive(Debug, Clone)]
pub struct ExecutordOptions {
    /// `node_name`.
    pub node_name: String,
    /// `cpus`, a cpulist.
    pub cpus: String,
    /// `pin`.
    pub pin: bool,
    /// `memory_mib`.
    pub memory_mib: u32,
    /// `pool_size`.
    pub pool_size: u32,
    /// `providers`.
    pub providers: Vec<String>,
    /// `fabric_host`: where workers listen (an address of the RDMA device's
    /// interface for verbs).
    pub fabric_host: String,
    /// `sandbox`: `"none"` or `"bubblewrap"`.
    pub sandbox: String,
    /// `default_deadline_ms`.
    pub default_deadline_ms: u64,
    /// `max_deadline_ms`.
    pub max_deadline_ms: u64,
    /// Mode of the public key file (the daemon refuses one group or others
    /// can write).
    pub lease_keys_mode: u32,
    /// More public key lines (`rfaas-ed25519-public ...`) the daemon
    /// accepts besides its own test key: a manager's, say.
    pub accept_keys: Vec<String>,
    /// More TOML lines appended to the configuration as they are.
    pub extra_config: String,
    /// The node tools' socket; `None`: one in the daemon's directory.
    pub local_socket: Option<PathBuf>,
    /// Environment variables for the daemon (`SLURM_CONF`, say).
    pub env: Vec<(String, String)>,
    /// Start the daemon in a cgroup of its own below the directory
    /// `RFAAS_TEST_CGROUP` names, when it is set, as systemd does for a
    /// unit with `Delegate=yes` (default true); false leaves it in the
    /// test's cgroup.
    pub delegated_cgroup: bool,
    /// TLS on the control port, with the test CA's server certificate
    /// (for 127.0.0.1, ::1 and localhost; copied into the daemon's
    /// directory, key mode 0600, see [`Executord::control_tls_files`]):
    /// `None` plain (the default), `Some(true)` required, `Some(false)`
    /// offered with plain clients still served. Clients reach it at
    /// [`Executord::executor`].
    pub control_tls: Option<bool>,
    /// `workers_outlive_daemon`: allocated workers keep running when the
    /// daemon stops or dies, for the next one ([`Executord::restart`]) to
    /// adopt. Default false, so a stopped test daemon leaves nothing
    /// behind; dropping one started with true kills the workers its
    /// runtime records name.
    pub outlive_workers: bool,
}

impl Default for ExecutordOptions {
    fn default() -> Self {
        ExecutordOptions {
            node_name: "rfaas-test-node".into(),
            cpus: "0-3".into(),
            pin: false,
            memory_mib: 4096,
            pool_size: 1,
            providers: vec!["tcp".into(), "shm".into()],
            fabric_host: "127.0.0.1".into(),
            sandbox: "none".into(),
            default_deadline_ms: 10_000,
            max_deadline_ms: 60_000,
            lease_keys_mode: 0o644,
            accept_keys: Vec::new(),
            extra_config: String::new(),
            local_socket: None,
            env: Vec::new(),
            delegated_cgroup: true,
            control_tls: None,
            outlive_workers: false,
        }
    }
}

/// A running daemon, stopped (SIGTERM, then SIGKILL after 10 s) on drop.
#[derive(Debug)]
pub struct Executord {
    child: Child,
    dir: PathBuf,
    signer: LeaseSigner,
    node_name: String,
    control_addr: SocketAddr,
    local_socket: PathBuf,
    cgroup: Option<PathBuf>,
    control_tls: bool,
    /// How to start it again ([`Executord::restart`]).
    daemon_bin: PathBuf,
    env: Vec<(String, String)>,
}

/// The variable naming a cgroup v2 directory, with the `cpuset`, `cpu` and
/// `memory` controllers enabled below it, in which test daemons get groups
/// of their own (the VM's test run sets it).
pub const TEST_CGROUP_VAR: &str = "RFAAS_TEST_CGROUP";

/// The key id of the lease key every test daemon accepts.
pub const TEST_KEY_ID: &str = "rfaas-test";

static INSTANCE: AtomicU64 = AtomicU64::new(0);
static LEASE: AtomicU64 = AtomicU64::new(1);

/// `rfaas-executord` in the workspace's target directory (debug build),
/// for tests outside the executor crate. Panics when it is not built.
pub fn daemon_binary() -> PathBuf {
    let p = crate::target_dir().join("debug").join("rfaas-executord");
    assert!(
        p.exists(),
        "{} is not built; run `cargo build -p rfaas-executor` first",
        p.display()
    );
    p
}

impl Executord {
    /// Starts the daemon `daemon_bin` with `opts`; panics with the daemon's
    /// log when it does not come up.
    pub fn start(daemon_bin: &Path, opts: ExecutordOptions) -> Executord {
        Executord::try_start(daemon_bin, opts).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Starts the daemon; `Err` holds what it printed when it did not
    /// print its ready line (within 30 s).
    pub fn try_start(daemon_bin: &Path, opts: ExecutordOptions) -> Result<Executord, String> {
        let n = INSTANCE.fetch_add(1, Ordering::Relaxed);
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let dir = std::env::temp_dir().join(format!(
            "rfaas-executord-{}-{n}-{nanos:x}",
            std::process::id()
        ));
        std::fs::create_dir_all(&dir).map_err(|e| format!("create {}: {e}", dir.display()))?;
        // Workers run as other users and reach their directories below it.
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755))
            .map_err(|e| format!("chmod {}: {e}", dir.display()))?;

        let signer =
            LeaseSigner::generate(TEST_KEY_ID).map_err(|e| format!("make a lease key: {e}"))?;
        let keys_file = dir.join("lease-keys.pub");
        let mut lines = vec![signer.public_key().to_line()];
        lines.extend(opts.accept_keys.iter().cloned());
        std::fs::write(&keys_file, lines.join("\n") + "\n")
            .map_err(|e| format!("write the public key: {e}"))?;
        std::fs::set_permissions(
            &keys_file,
            std::fs::Permissions::from_mode(opts.lease_keys_mode),
        )
        .map_err(|e| format!("chmod the public key: {e}"))?;

        let local_socket = opts
            .local_socket
            .clone()
            .unwrap_or_else(|| dir.join("executord.sock"));
        let providers: Vec<String> = opts.providers.iter().map(|p| format!("{p:?}")).collect();
        let tls = match opts.control_tls {
            Some(required) => {
                let ca = crate::tls::test_ca();
                let (cert, key) = (dir.join("control.pem"), dir.join("control.key"));
                copy_private(&ca.cert(), &cert)?;
                copy_private(&ca.key(), &key)?;
                format!(
                    "control_tls_cert = {:?}\ncontrol_tls_key = {:?}\nrequire_control_tls = {required}\n",
                    cert.display().to_string(),
                    key.display().to_string()
                )
            }
            None => String::new(),
        };
        let config = format!(
            "node_name = {node:?}\n\
             control_listen = \"127.0.0.1:0\"\n\
             fabric_host = {host:?}\n\
             providers = [{providers}]\n\
             cpus = {cpus:?}\n\
             pin = {pin}\n\
             memory_mib = {mem}\n\
             lease_keys = [{keys:?}]\n\
             local_socket = {local:?}\n\
             runtime_dir = {run:?}\n\
             pool_size = {pool}\n\
             sandbox = {sandbox:?}\n\
             default_deadline_ms = {ddl}\n\
             max_deadline_ms = {mdl}\n\
             log_level = \"debug\"\n\
             workers_outlive_daemon = {outlive}\n\
             {tls}\
             {extra}\n",
            node = opts.node_name,
            providers = providers.join(", "),
            host = opts.fabric_host,
            cpus = opts.cpus,
            pin = opts.pin,
            mem = opts.memory_mib,
            keys = keys_file.display().to_string(),
            local = local_socket.display().to_string(),
            run = dir.join("run").display().to_string(),
            pool = opts.pool_size,
            sandbox = opts.sandbox,
            ddl = opts.default_deadline_ms,
            mdl = opts.max_deadline_ms,
            extra = opts.extra_config,
            outlive = opts.outlive_workers,
        );
        let config_file = dir.join("executord.toml");
        std::fs::write(&config_file, config).map_err(|e| format!("write the config: {e}"))?;

        let mut cmd = Command::new(daemon_bin);
        cmd.envs(opts.env.iter().map(|(k, v)| (k, v)))
            .arg("--config")
            .arg(&config_file);
        let cgroup = match std::env::var_os(TEST_CGROUP_VAR) {
            Some(parent) if opts.delegated_cgroup => {
                let group = Path::new(&parent)
                    .join(format!("executord-{}-{n}-{nanos:x}", std::process::id()));
                delegate(&mut cmd, &group)?;
                Some(group)
            }
            _ => None,
        };
        let (mut child, rest) = crate::process::spawn_ready(
            cmd,
            &dir.join("executord.log"),
            "rfaas-executord ready control=",
        )
        .inspect_err(|_| {
            let _ = std::fs::remove_dir_all(&dir);
        })?;
        let Some((control_addr, local)) = parse_ready(&rest) else {
            crate::process::stop(&mut child, crate::process::STOP_GRACE);
            return Err(format!(
                "unexpected ready line from rfaas-executord: {rest:?}"
            ));
        };
        Ok(Executord {
            child,
            dir,
            signer,
            node_name: opts.node_name,
            control_addr,
            local_socket: local,
            cgroup,
            control_tls: opts.control_tls.is_some(),
            daemon_bin: daemon_bin.to_owned(),
            env: opts.env,
        })
    }

    /// Ends the daemon with `signal` (`SIGTERM`: a stop or restart;
    /// `SIGKILL`: a crash), waits for it, and starts a new one on the same
    /// configuration, runtime directory and control port, as a service
    /// manager restarting the unit does. Panics with the log when the new
    /// one does not come up.
    pub fn restart(&mut self, signal: i32) {
        // SAFETY: kill has no memory preconditions; the pid is our unreaped
        // child (only `wait` below reaps it).
        unsafe { libc::kill(self.child.id() as libc::pid_t, signal) };
        let _ = self.child.wait();
        let config_file = self.dir.join("executord.toml");
        let config = std::fs::read_to_string(&config_file).expect("the daemon's configuration");
        // The same port: clients come back to the address they know.
        let config = config.replace(
            "control_listen = \"127.0.0.1:0\"",
            &format!("control_listen = \"{}\"", self.control_addr),
        );
        std::fs::write(&config_file, config).expect("rewrite the configuration");
        // The port is free again once the old daemon is gone, and the
        // kernel may hand it to another test's outgoing connection for a
        // moment: a start that finds it in use is tried again.
        let mut last = String::new();
        let started = crate::wait::poll_for(Duration::from_secs(30), || {
            let mut cmd = Command::new(&self.daemon_bin);
            cmd.envs(self.env.iter().map(|(k, v)| (k, v)))
                .arg("--config")
                .arg(&config_file);
            if let Some(group) = &self.cgroup {
                delegate(&mut cmd, group).unwrap_or_else(|e| panic!("{e}"));
            }
            match crate::process::spawn_ready(
                cmd,
                &self.dir.join("executord.log"),
                "rfaas-executord ready control=",
            ) {
                Ok(up) => Some(Ok(up)),
                Err(e) if e.contains("Address already in use") => {
                    last = e;
                    None
                }
                Err(e) => Some(Err(e)),
            }
        })
        .unwrap_or(Err(last));
        let (child, rest) =
            started.unwrap_or_else(|e| panic!("the restarted daemon did not come up: {e}"));
        self.child = child;
        let (addr, _) = parse_ready(&rest).expect("the restarted daemon's ready line");
        assert_eq!(addr, self.control_addr, "the same control port");
    }

    /// The pids of the workers the daemon's runtime records name (the
    /// allocations it would leave to the next daemon).
    pub fn recorded_workers(&self) -> Vec<u32> {
        let Ok(entries) = std::fs::read_dir(self.dir.join("run").join("state")) else {
            return Vec::new();
        };
        entries
            .flatten()
            .filter(|e| e.path().extension().is_some_and(|x| x == "json"))
            .filter_map(|e| std::fs::read(e.path()).ok())
            .filter_map(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
            .filter_map(|v| v.get("pid")?.as_u64())
            .map(|p| p as u32)
            .collect()
    }

    /// The control listener's address.
    pub fn control_addr(&self) -> SocketAddr {
        self.control_addr
    }

    /// The address the client library takes: `tls://` and the control
    /// address when the control port speaks TLS, else the control address.
    pub fn executor(&self) -> String {
        if self.control_tls {
            format!(
                "{}{}",
                rfaas_proto::manager::CONTROL_TLS_SCHEME,
                self.control_addr
            )
        } else {
            self.control_addr.to_string()
        }
    }

    /// The control port's certificate and key files (with
    /// [`ExecutordOptions::control_tls`]): replace them and send SIGHUP to
    /// have the daemon serve new ones.
    pub fn control_tls_files(&self) -> (PathBuf, PathBuf) {
        (self.dir.join("control.pem"), self.dir.join("control.key"))
    }

    /// The node tools' socket.
    pub fn local_socket(&self) -> &Path {
        &self.local_socket
    }

    /// The node name tokens must carry.
    pub fn node_name(&self) -> &str {
        &self.node_name
    }

    /// The key whose public half the daemon accepts (key id
    /// [`TEST_KEY_ID`]).
    pub fn signer(&self) -> &LeaseSigner {
        &self.signer
    }

    /// The daemon's pid.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The daemon's private directory (config, public key, log, `run/`).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// `kill -9` of the daemon, reaped: its workers die with it (they get
    /// SIGKILL when their parent dies). Start another with the same
    /// options to bring the node back.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// What the daemon logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("executord.log")).unwrap_or_default()
    }

    /// Claims for this node: a fresh lease id, account `"test"`, issued
    /// now, ending after `ttl`. Change fields before [`mint`](Self::mint)
    /// to test refusals.
    pub fn claims(&self, user: &str, cores: u16, memory_mib: u32, ttl: Duration) -> LeaseClaims {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .expect("clock after 1970")
            .as_secs();
        LeaseClaims {
            key_id: TEST_KEY_ID.into(),
            lease_id: (u64::from(std::process::id()) << 32) | LEASE.fetch_add(1, Ordering::Relaxed),
            node: self.node_name.clone(),
            user: user.to_owned(),
            account: "test".into(),
            job_id: None,
            cores,
            memory_mib,
            issued_at: now,
            expires_at: now + ttl.as_secs(),
            billing: None,
        }
    }

    /// Signs `claims` with the key the daemon accepts.
    pub fn mint(&self, claims: &LeaseClaims) -> String {
        self.signer.sign(claims)
    }

    /// Signs `claims` with a fresh key under the daemon's key id, as a
    /// forger who knows the id but not the key would: the daemon must
    /// refuse it as forged.
    pub fn mint_with_another_key(&self, claims: &LeaseClaims) -> String {
        LeaseSigner::generate(TEST_KEY_ID)
            .expect("/dev/urandom is readable")
            .sign(claims)
    }

    /// A valid token for this node.
    pub fn token(&self, user: &str, cores: u16, memory_mib: u32, ttl: Duration) -> String {
        self.mint(&self.claims(user, cores, memory_mib, ttl))
    }

    /// Sends one request on the local socket and returns the reply;
    /// panics on an error reply or a broken socket.
    pub fn local(&self, req: LocalRequest) -> LocalReply {
        let mut sock = UnixStream::connect(&self.local_socket)
            .unwrap_or_else(|e| panic!("connect {}: {e}", self.local_socket.display()));
        sock.set_read_timeout(Some(Duration::from_secs(120)))
            .expect("set a read timeout");
        Frame::new(&req, Vec::new())
            .write_to(&mut sock)
            .expect("send a local request");
        let frame = Frame::read_from(&mut sock, FrameLimits::default())
            .unwrap_or_else(|e| panic!("no reply to {req:?}: {e}\nlog:\n{}", self.log()));
        if frame.kind == Kind::Error {
            let e: ErrorReply = frame.parse().expect("an ErrorReply");
            panic!("{req:?} refused: {e:?}");
        }
        frame.parse().expect("a LocalReply")
    }

    /// One allocation of one core on a fresh control connection (user
    /// `nobody`, `library` with its function `echo`, the tcp provider) and
    /// its deallocation, as a client library does them; `Err` says what
    /// the daemon answered instead.
    pub fn allocate_and_deallocate(&self, library: &[u8]) -> Result<(), String> {
        let (mut s, ok) = self.allocate_raw(library)?;
        let dealloc = Deallocate {
            request_id: 2,
            allocation_id: ok.allocation_id,
        };
        let done: Deallocated = exchange(&mut s, Frame::new(&dealloc, Vec::new()))?
            .parse()
            .map_err(|e| e.to_string())?;
        if done.allocation_id != ok.allocation_id {
            return Err(format!("{done:?} answers another allocation than {ok:?}"));
        }
        Ok(())
    }

    /// One allocation of one core (user `nobody`, `library` with its
    /// function `echo`, the tcp provider, an hour's lease) on a fresh
    /// control connection, which is returned with the answer: a peer that
    /// never attaches again when the connection ends.
    pub fn allocate_raw(
        &self,
        library: &[u8],
    ) -> Result<(std::net::TcpStream, AllocateOk), String> {
        let mut s = std::net::TcpStream::connect(self.control_addr)
            .map_err(|e| format!("connect to {}: {e}", self.control_addr))?;
        s.set_read_timeout(Some(Duration::from_secs(60)))
            .map_err(|e| e.to_string())?;
        let _ = s.set_nodelay(true);
        let mut req = request(
            self.token("nobody", 1, 1024, Duration::from_secs(3600)),
            1,
            &["echo"],
        );
        req.request_id = 1;
        let ok: AllocateOk = exchange(&mut s, Frame::new(&req, library.to_vec()))?
            .parse()
            .map_err(|e| e.to_string())?;
        Ok((s, ok))
    }

    /// `local(LocalRequest::Status)`.
    pub fn status(&self) -> LocalReply {
        self.local(LocalRequest::Status)
    }

    /// Waits up to `timeout` for `cond` to hold on the status reply and
    /// returns the last reply; panics (with the log) when it never does.
    pub fn wait_status(
        &self,
        timeout: Duration,
        mut cond: impl FnMut(&LocalReply) -> bool,
    ) -> LocalReply {
        let mut last = None;
        crate::wait::poll_for(timeout, || {
            let s = self.status();
            if cond(&s) {
                return Some(s);
            }
            last = Some(s);
            None
        })
        .unwrap_or_else(|| {
            panic!(
                "waited {timeout:?} for the daemon's status to match; last: {last:?}\nlog:\n{}",
                self.log()
            )
        })
    }
}

impl Drop for Executord {
    fn drop(&mut self) {
        let workers = self.recorded_workers();
        crate::process::stop(&mut self.child, crate::process::STOP_GRACE);
        // Workers left to a next daemon that will not come.
        for pid in workers {
            let worker = std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| c.windows(12).any(|w| w == b"rfaas-worker"));
            if worker {
                // SAFETY: kill has no memory preconditions.
                unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
            }
        }
        if let Some(group) = &self.cgroup {
            // Whatever outlived the daemon (nothing, unless a test found
            // a hole), then the groups.
            let _ = std::fs::write(group.join("cgroup.kill"), "1");
            crate::wait::poll_for(Duration::from_secs(10), || {
                let events = std::fs::read_to_string(group.join("cgroup.events")).ok()?;
                events.lines().any(|l| l == "populated 0").then_some(())
            });
            remove_cgroup(group);
        }
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// Makes the cgroup `group` and has `cmd`'s process join it before it
/// execs: the subtree a service manager delegates to the daemon.
fn delegate(cmd: &mut Command, group: &Path) -> Result<(), String> {
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::process::CommandExt;
    // The daemon starts in `<group>/daemon`, as systemd's
    // `DelegateSubgroup=daemon` places it; a restarted daemon joins its
    // predecessor's leaf.
    let leaf = group.join("daemon");
    for dir in [group, leaf.as_path()] {
        match std::fs::create_dir(dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(format!("create the cgroup {}: {e}", dir.display())),
        }
    }
    let procs = std::ffi::CString::new(leaf.join("cgroup.procs").as_os_str().as_bytes())
        .map_err(|e| format!("the cgroup path {}: {e}", leaf.display()))?;
    // SAFETY: the closure runs in the forked child before exec and makes
    // only async-signal-safe calls (open, write, close) on memory prepared
    // before the fork.
    unsafe {
        cmd.pre_exec(move || {
            let f = libc::open(procs.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
            if f < 0 {
                return Err(std::io::Error::last_os_error());
            }
            // "0": the writing process itself.
            let ok = libc::write(f, b"0".as_ptr().cast(), 1) == 1;
            let err = std::io::Error::last_os_error();
            libc::close(f);
            if ok {
                Ok(())
            } else {
                Err(err)
            }
        });
    }
    Ok(())
}

/// Removes a daemon's cgroup and the groups it made below it (their
/// processes ended with the daemon), leaves first.
fn remove_cgroup(group: &Path) {
    if let Ok(entries) = std::fs::read_dir(group) {
        for e in entries.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                remove_cgroup(&e.path());
            }
        }
    }
    let _ = std::fs::remove_dir(group);
}

/// Sends `frame` on a control connection and reads the answer; an
/// `Error` frame is `Err` with its content.
fn exchange(s: &mut std::net::TcpStream, frame: Frame) -> Result<Frame, String> {
    frame.write_to(&mut *s).map_err(|e| format!("send: {e}"))?;
    let reply =
        Frame::read_from(&mut *s, FrameLimits::default()).map_err(|e| format!("no answer: {e}"))?;
    if reply.kind == Kind::Error {
        let e: ErrorReply = reply.parse().map_err(|e| e.to_string())?;
        return Err(format!("refused: {e:?}"));
    }
    Ok(reply)
}

/// An allocation request under `token` for `cores` lanes and `functions`
/// of `libfunctions.so` (request id 0): 1024 MiB, warm, 4 KiB buffers, the
/// executor's deadline, tcp. Change fields to test the others.
pub fn request(token: String, cores: u16, functions: &[&str]) -> AllocateRequest {
    AllocateRequest {
        request_id: 0,
        token,
        cores,
        memory_mib: 1024,
        mode: Mode::Warm,
        hot_timeout_us: 0,
        input_capacity: 4096,
        output_capacity: 4096,
        deadline_ms: 0,
        functions: functions.iter().map(|f| f.to_string()).collect(),
        library_name: "libfunctions.so".into(),
        provider: "tcp".into(),
        read_only_input: false,
        lanes: 0,
        slots: 0,
    }
}

/// The control address and local socket in the rest of the ready line,
/// after `rfaas-executord ready control=`.
fn parse_ready(rest: &str) -> Option<(SocketAddr, PathBuf)> {
    let (addr, local) = rest.split_once(" local=")?;
    Some((addr.parse().ok()?, PathBuf::from(local)))
}

/// Copies `from` to a new file `to` only its owner may read (a key's mode,
/// which the daemon checks).
pub fn copy_private(from: &Path, to: &Path) -> Result<(), String> {
    let bytes = std::fs::read(from).map_err(|e| format!("read {}: {e}", from.display()))?;
    std::fs::write(to, bytes).map_err(|e| format!("write {}: {e}", to.display()))?;
    std::fs::set_permissions(to, std::fs::Permissions::from_mode(0o600))
        .map_err(|e| format!("chmod {}: {e}", to.display()))
}

/// The `/metrics` text of a daemon whose `metrics_listen` is `metrics`
/// (empty when it does not answer).
pub fn scrape(metrics: SocketAddr) -> String {
    let agent = rfaas_tls::system_agent(Duration::from_secs(10));
    match agent.get(&format!("http://{metrics}/metrics")).call() {
        Ok(mut r) => r.body_mut().read_to_string().unwrap_or_default(),
        Err(_) => String::new(),
    }
}

/// The value of the sample named exactly `series` (name and labels) in a
/// `/metrics` text.
pub fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| {
        l.strip_prefix(series)?
            .strip_prefix(' ')?
            .trim()
            .parse()
            .ok()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_line() {
        assert_eq!(
            parse_ready("127.0.0.1:4000 local=/tmp/x y.sock"),
            Some((
                "127.0.0.1:4000".parse().unwrap(),
                PathBuf::from("/tmp/x y.sock")
            ))
        );
        assert_eq!(parse_ready("hello"), None);
    }
}

//! A real `rfaas-manager` for tests: [`Manager`] writes an admin token, a
//! lease key and a configuration into a private directory, starts the
//! binary on a free 127.0.0.1 port serving HTTPS with the test run's CA
//! ([`crate::tls::test_ca`]), and stops it by pid on drop. Several
//! [`Manager`]s on one database are replicas.
//!
//! [`Api`] is a small blocking REST caller that returns the status and
//! JSON body, whatever the status, so tests can check error bodies.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use serde_json::Value;

/// `rfaas-manager` in the workspace's target directory (debug build).
pub fn manager_binary() -> PathBuf {
    let p = crate::target_dir().join("debug").join("rfaas-manager");
    assert!(
        p.exists(),
        "{} is not built; run `cargo build -p rfaas-manager` first",
        p.display()
    );
    p
}

/// How to start a manager.
#[derive(Debug, Clone)]
pub struct ManagerOptions {
    /// The database URL; `None`: a fresh SQLite file in the manager's
    /// directory.
    pub database: Option<String>,
    /// The admin token; `None`: a random one.
    pub admin_token: Option<String>,
    /// The lease key file to sign with; `None`: a new key in the
    /// manager's directory (see [`Manager::lease_key`]).
    pub lease_key: Option<PathBuf>,
    /// More TOML for the configuration file.
    pub extra_config: String,
    /// Serve HTTPS (default), or plain HTTP.
    pub tls: bool,
    /// Serve this CA's server certificate instead of the test run's
    /// ([`crate::tls::test_ca`]).
    pub cert: Option<crate::tls::TestCa>,
}

impl Default for ManagerOptions {
    fn default() -> ManagerOptions {
        ManagerOptions {
            database: None,
            admin_token: None,
            lease_key: None,
            extra_config: "heartbeat_interval_ms = 200\nlost_after_ms = 1000\nrefresh_ms = 100\n"
                .into(),
            tls: true,
            cert: None,
        }
    }
}

/// A running manager.
#[derive(Debug)]
pub struct Manager {
    child: Option<Child>,
    dir: PathBuf,
    url: String,
    admin_token: String,
    lease_key: PathBuf,
    database: String,
    log: PathBuf,
    binary: PathBuf,
    scheme: &'static str,
}

static SEQ: AtomicU32 = AtomicU32::new(0);

fn random_bytes(n: usize) -> Vec<u8> {
    use std::io::Read;
    let mut buf = vec![0u8; n];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut buf))
        .expect("/dev/urandom");
    buf
}

fn random_text(n: usize) -> String {
    const A: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";
    random_bytes(n)
        .iter()
        .map(|b| A[*b as usize % A.len()] as char)
        .collect()
}

/// The key id of the test managers' lease keys.
pub const MANAGER_KEY_ID: &str = "manager-test";

/// Writes a new lease signing key to `path` (mode 0600) and returns its
/// public key line, for the executors that are to accept its tokens.
pub fn write_lease_key(path: &Path) -> Result<String, String> {
    let key = rfaas_proto::lease::LeaseSigner::generate(MANAGER_KEY_ID)
        .map_err(|e| format!("make a lease key: {e}"))?;
    std::fs::write(path, key.to_secret_line() + "\n")
        .map_err(|e| format!("write {path:?}: {e}"))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
        .map_err(|e| e.to_string())?;
    Ok(key.public_key().to_line())
}

/// The public key line of the secret key file at `path`.
pub fn public_key_line(path: &Path) -> Result<String, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("read {path:?}: {e}"))?;
    let key = rfaas_proto::lease::LeaseSigner::from_text(&text).map_err(|e| e.to_string())?;
    Ok(key.public_key().to_line())
}

impl Manager {
    /// Starts a manager with `opts`; panics with the reason if it cannot.
    pub fn start(opts: ManagerOptions) -> Manager {
        Manager::try_start(&manager_binary(), opts).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Starts a manager; `Err` says why it could not.
    pub fn try_start(binary: &Path, opts: ManagerOptions) -> Result<Manager, String> {
        let dir = std::env::temp_dir().join(format!(
            "rfaas-manager-{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).map_err(|e| format!("create {dir:?}: {e}"))?;
        let admin_token = opts.admin_token.unwrap_or_else(|| random_text(32));
        let token_file = dir.join("admin.token");
        std::fs::write(&token_file, format!("{admin_token}\n")).map_err(|e| e.to_string())?;
        std::fs::set_permissions(&token_file, std::fs::Permissions::from_mode(0o600))
            .map_err(|e| e.to_string())?;
        let lease_key = match opts.lease_key {
            Some(k) => k,
            None => {
                let k = dir.join("lease-key.secret");
                write_lease_key(&k)?;
                k
            }
        };
        let database = opts
            .database
            .unwrap_or_else(|| format!("sqlite://{}", dir.join("manager.db").display()));
        let tls = if opts.tls {
            let ca = opts.cert.as_ref().unwrap_or_else(|| crate::tls::test_ca());
            format!(
                "tls_cert = {:?}\ntls_key = {:?}\n",
                ca.cert().display().to_string(),
                ca.key().display().to_string()
            )
        } else {
            String::new()
        };
        let config = format!(
            "listen = \"127.0.0.1:0\"\ndatabase = \"{database}\"\nadmin_token_file = \"{}\"\nlease_key_file = \"{}\"\n{tls}{}",
            token_file.display(),
            lease_key.display(),
            opts.extra_config
        );
        std::fs::write(dir.join("manager.toml"), config).map_err(|e| e.to_string())?;
        let mut m = Manager {
            child: None,
            url: String::new(),
            admin_token,
            lease_key,
            database,
            log: dir.join("manager.log"),
            dir,
            binary: binary.to_owned(),
            scheme: if opts.tls { "https" } else { "http" },
        };
        m.spawn(None)?;
        Ok(m)
    }

    /// Starts the process (again), on `listen` if given.
    fn spawn(&mut self, listen: Option<&str>) -> Result<(), String> {
        let mut cmd = Command::new(&self.binary);
        cmd.arg("--config").arg(self.dir.join("manager.toml"));
        if let Some(l) = listen {
            cmd.arg("--listen").arg(l);
        }
        let (child, addr) =
            crate::process::spawn_ready(cmd, &self.log, "rfaas-manager listening on ")?;
        self.url = format!("{}://{addr}", self.scheme);
        self.child = Some(child);
        Ok(())
    }

    /// Its configuration file, for the `rfaas-manager` subcommands a test
    /// runs on the same database.
    pub fn config_file(&self) -> PathBuf {
        self.dir.join("manager.toml")
    }

    /// Its base URL, `https://127.0.0.1:port` (`http://` without TLS).
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The admin token.
    pub fn admin_token(&self) -> &str {
        &self.admin_token
    }

    /// The lease key file it signs with.
    pub fn lease_key(&self) -> &Path {
        &self.lease_key
    }

    /// The public key line executors need to accept its tokens.
    pub fn public_key_line(&self) -> String {
        public_key_line(&self.lease_key).unwrap_or_else(|e| panic!("{e}"))
    }

    /// The database URL.
    pub fn database(&self) -> &str {
        &self.database
    }

    /// Its pid.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// What it logged.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// An API caller with the admin token.
    pub fn admin(&self) -> Api {
        Api::new(&self.url, &self.admin_token)
    }

    /// Mints a credential through the API and returns its token.
    pub fn credential(&self, role: &str, subject: &str, account: Option<&str>) -> String {
        let mut body = serde_json::json!({"role": role, "subject": subject});
        if let Some(a) = account {
            body["account"] = a.into();
        }
        let (status, reply) = self.admin().call("POST", "/v1/credentials", Some(&body));
        assert_eq!(status, 201, "minting a credential: {reply}");
        reply["token"].as_str().expect("a token").to_owned()
    }

    /// Registers node `name` with `cores` and `memory_mib`, as its
    /// executor daemon would (with a node credential of its own), without
    /// a daemon: for tests of what the manager makes of its nodes.
    pub fn register_node(&self, name: &str, cores: u32, memory_mib: u64) {
        let api = Api::new(&self.url, &self.credential("node", name, None));
        let body = serde_json::json!({
            "control_addr": "127.0.0.1:7100",
            "providers": [{"name": "tcp", "host": "127.0.0.1"}],
            "cores": cores,
            "memory_mib": memory_mib,
        });
        let (status, reply) = api.call("PUT", &format!("/v1/nodes/{name}"), Some(&body));
        assert_eq!(status, 200, "registering {name}: {reply}");
    }

    /// Lease requests this replica refused for `reason` (`no_capacity`,
    /// `request_exceeds_cluster`, ...), from its `/metrics`.
    pub fn denials(&self, reason: &str) -> u64 {
        let (_, metrics) = Api::new(&self.url, "").call("GET", "/metrics", None);
        let prefix = format!("rfaas_manager_denials_total{{reason=\"{reason}\"}} ");
        metrics
            .as_str()
            .unwrap_or_default()
            .lines()
            .find_map(|l| l.strip_prefix(prefix.as_str()))
            .and_then(|n| n.trim().parse().ok())
            .unwrap_or(0)
    }

    /// Options for an executor daemon named `name` that registers with
    /// this manager (its node credential written, private, into `dir`)
    /// and accepts this manager's leases. Its control port requires TLS:
    /// it registers so, and clients learn it from their lease grants.
    pub fn node_options(&self, dir: &Path, name: &str) -> crate::executord::ExecutordOptions {
        let cred = dir.join(format!("{name}.credential"));
        std::fs::write(&cred, self.credential("node", name, None))
            .unwrap_or_else(|e| panic!("write {}: {e}", cred.display()));
        std::fs::set_permissions(&cred, std::fs::Permissions::from_mode(0o600))
            .unwrap_or_else(|e| panic!("chmod {}: {e}", cred.display()));
        crate::executord::ExecutordOptions {
            node_name: name.into(),
            accept_keys: vec![self.public_key_line()],
            extra_config: format!(
                "[manager]\nurls = [{:?}]\ncredential_file = {:?}\nmax_backoff_ms = 200\nca_file = {:?}\n",
                self.url,
                cred.display().to_string(),
                crate::tls::test_ca().ca_file().display().to_string()
            ),
            control_tls: Some(true),
            ..Default::default()
        }
    }

    /// kill -9.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            crate::process::kill(&mut c);
        }
    }

    /// SIGTERM, then wait (SIGKILL after 10 s).
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            crate::process::stop(&mut c, crate::process::STOP_GRACE);
        }
    }

    /// Starts it again on the same port, same database and keys.
    pub fn restart(&mut self) -> Result<(), String> {
        self.stop();
        let listen = self
            .url
            .split_once("://")
            .map_or(self.url.as_str(), |(_, a)| a)
            .to_owned();
        self.spawn(Some(&listen))
    }
}

impl Drop for Manager {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A blocking REST caller with a bearer token.
#[derive(Debug, Clone)]
pub struct Api {
    base: String,
    token: String,
    ca_file: Option<PathBuf>,
    agent: ureq::Agent,
}

impl Api {
    /// Calls `base` with `token`, trusting `RFAAS_CA_FILE` (the test
    /// run's CA once a manager started) or the system's roots.
    pub fn new(base: &str, token: &str) -> Api {
        Api::trusting(base, token, None).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Calls `base` with `token`, trusting only the CAs in `ca_file`
    /// (`None`: as [`Api::new`]).
    pub fn trusting(base: &str, token: &str, ca_file: Option<&Path>) -> Result<Api, String> {
        let options = rfaas_tls::AgentOptions::new(Duration::from_secs(30))
            .ca_file_or_env(ca_file.map(Path::to_owned));
        let agent = rfaas_tls::agent(&options).map_err(|e| e.to_string())?;
        Ok(Api {
            base: base.to_owned(),
            token: token.to_owned(),
            ca_file: ca_file.map(Path::to_owned),
            agent,
        })
    }

    /// Its bearer token.
    pub fn token(&self) -> &str {
        &self.token
    }

    /// The same caller with a connection pool of its own: for requests the
    /// server may answer by closing the connection (a body over its limit).
    pub fn fresh(&self) -> Api {
        Api::trusting(&self.base, &self.token, self.ca_file.as_deref())
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// `method path` with an optional JSON body: the status and the JSON
    /// answer (`Null` for an empty one, a string for one that is not JSON).
    pub fn call(&self, method: &str, path: &str, body: Option<&Value>) -> (u16, Value) {
        let (status, _, v) = self.call_full(method, path, body);
        (status, v)
    }

    /// As [`Api::call`], also returning `Retry-After`.
    pub fn call_full(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
    ) -> (u16, Option<u64>, Value) {
        self.raw(
            method,
            path,
            body.map(|b| b.to_string()),
            "application/json",
        )
    }

    /// Sends `body` as is, with `content_type`.
    pub fn raw(
        &self,
        method: &str,
        path: &str,
        body: Option<String>,
        content_type: &str,
    ) -> (u16, Option<u64>, Value) {
        let url = format!("{}{path}", self.base);
        let auth = format!("Bearer {}", self.token);
        let send = |agent: &ureq::Agent| {
            let req = ureq::http::Request::builder()
                .method(method)
                .uri(&url)
                .header("Authorization", &auth)
                .header("Content-Type", content_type);
            match &body {
                Some(b) => agent.run(req.body(b.clone()).expect("a request")),
                None => agent.run(req.body(()).expect("a request")),
            }
        };
        let mut result = send(&self.agent);
        // A kept-alive connection the manager closed after its last answer
        // (it does after a refusal whose body it did not read) may be
        // picked before its close arrives; a client sends an idempotent
        // request again, on a new connection.
        if result.is_err() && matches!(method, "GET" | "PUT" | "DELETE") {
            result = send(&self.fresh().agent);
        }
        let mut resp = match result {
            Ok(r) => r,
            Err(e) => return (0, None, Value::String(e.to_string())),
        };
        let status = resp.status().as_u16();
        let retry = resp
            .headers()
            .get("retry-after")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse().ok());
        let text = resp.body_mut().read_to_string().unwrap_or_default();
        let v = if text.is_empty() {
            Value::Null
        } else {
            serde_json::from_str(&text).unwrap_or(Value::String(text))
        };
        (status, retry, v)
    }
}

//! A real `rfaas-accounting` for tests, and a peer that speaks to it as an
//! executor daemon does.
//!
//! [`Accounting`] writes a configuration (and, if given, a billing
//! configuration) into a private directory, starts the binary on the
//! database given, on a free 127.0.0.1 port (tcp) or a socket in that
//! directory (shm), and stops it by pid on drop. [`Accounting::kill`] is a
//! `kill -9`; [`Accounting::restart`] starts it again on the same region
//! file and address.
//!
//! [`Peer`] connects over the fabric, says the hello with an accounting
//! ticket, and adds into slots with fetch-and-add, as the executor
//! daemon's poster does. [`sign_ticket`] makes tickets with a manager's
//! lease key, as the manager's replies carry them; tests that want a real
//! manager's ticket register a node with it.

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use rfaas_fabric::{
    Access, Completion, CompletionQueue, Domain, Endpoint, EndpointOptions, Fabric, MemoryRegion,
    Opcode, RemoteAddr, Status,
};
use rfaas_proto::accounting::{
    slot_offset, word_offset, AccountingHello, AccountingReply, Counter, ReplyStatus, SlotTotals,
    HELLO_IMMS, REPLY_IMM, SLOT_LEN,
};
use rfaas_proto::lease::LeaseSigner;
use rfaas_proto::ticket::{AccountingTicket, TicketClaims};

/// `rfaas-accounting` in the workspace's target directory (debug build).
pub fn accounting_binary() -> PathBuf {
    let p = crate::target_dir().join("debug").join("rfaas-accounting");
    assert!(
        p.exists(),
        "{} is not built; run `cargo build -p rfaas-accounting` first",
        p.display()
    );
    p
}

/// `rfaas-billing` in the workspace's target directory (debug build).
pub fn billing_binary() -> PathBuf {
    let p = crate::target_dir().join("debug").join("rfaas-billing");
    assert!(
        p.exists(),
        "{} is not built; run `cargo build -p rfaas-accounting` first",
        p.display()
    );
    p
}

/// How to start an accounting instance.
#[derive(Debug, Clone)]
pub struct AccountingOptions {
    /// The database URL (the manager's).
    pub database: String,
    /// The instance's name.
    pub name: String,
    /// The fabric provider: `tcp`, `shm` or `verbs:<device>`.
    pub provider: String,
    /// The fabric address to listen on; `None`: a free 127.0.0.1 port
    /// (tcp), a socket in the instance's directory (shm). verbs needs the
    /// RDMA netdev's address.
    pub listen: Option<String>,
    /// Slots in the region.
    pub slots: u32,
    /// Flush period, ms.
    pub flush_interval_ms: u64,
    /// Snapshot period, ms.
    pub snapshot_interval_ms: u64,
    /// Hold of an ended lease's slot, seconds.
    pub slot_hold_s: u64,
    /// Hello deadline, ms.
    pub hello_timeout_ms: u64,
    /// The text of `billing.toml`; `None`: no file (every rate 0).
    pub billing: Option<String>,
    /// More TOML for the configuration file.
    pub extra_config: String,
    /// The public key lines of the managers whose tickets it accepts;
    /// empty: a key of nobody's, so that no hello is accepted.
    pub lease_keys: Vec<String>,
}

impl AccountingOptions {
    /// Test defaults on `database`: tcp, 64 slots, flushes every 100 ms,
    /// snapshots every second, a hello deadline of 2 s.
    pub fn new(database: &str) -> AccountingOptions {
        AccountingOptions {
            database: database.to_owned(),
            name: "acct1".into(),
            provider: "tcp".into(),
            listen: None,
            slots: 64,
            flush_interval_ms: 100,
            snapshot_interval_ms: 1000,
            slot_hold_s: 600,
            hello_timeout_ms: 2000,
            billing: None,
            extra_config: String::new(),
            lease_keys: Vec::new(),
        }
    }

    /// [`AccountingOptions::new`] on `manager`'s database, accepting its
    /// tickets.
    pub fn for_manager(manager: &crate::manager::Manager) -> AccountingOptions {
        AccountingOptions {
            lease_keys: vec![manager.public_key_line()],
            ..AccountingOptions::new(manager.database())
        }
    }
}

/// An accounting ticket for `node` under the credential `credential_id`,
/// valid from `issued_at` to `expires_at` (Unix seconds), signed with the
/// secret key in `lease_key` (a manager's), as text.
pub fn sign_ticket(
    lease_key: &Path,
    node: &str,
    credential_id: &str,
    issued_at: u64,
    expires_at: u64,
) -> String {
    let text = std::fs::read_to_string(lease_key)
        .unwrap_or_else(|e| panic!("read {}: {e}", lease_key.display()));
    let signer = LeaseSigner::from_text(&text).unwrap_or_else(|e| panic!("{e}"));
    let claims = TicketClaims {
        key_id: String::new(),
        node: node.to_owned(),
        credential_id: credential_id.to_owned(),
        issued_at,
        expires_at,
    };
    AccountingTicket::sign(&signer, &claims)
        .unwrap_or_else(|e| panic!("{e}"))
        .to_text()
}

/// The id of a node credential `rfaasc.<id>.<secret>`.
pub fn credential_id(credential: &str) -> &str {
    credential
        .split('.')
        .nth(1)
        .unwrap_or_else(|| panic!("{credential:?} is not rfaasc.<id>.<secret>"))
}

/// A running accounting instance.
#[derive(Debug)]
pub struct Accounting {
    child: Option<Child>,
    dir: PathBuf,
    name: String,
    provider: String,
    fabric_addr: String,
    metrics_addr: String,
    log: PathBuf,
    binary: PathBuf,
}

static SEQ: AtomicU32 = AtomicU32::new(0);

impl Accounting {
    /// Starts an instance with `opts`; panics with the reason if it cannot.
    pub fn start(opts: AccountingOptions) -> Accounting {
        Accounting::try_start(&accounting_binary(), opts).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Starts an instance; `Err` says why it could not.
    pub fn try_start(binary: &Path, opts: AccountingOptions) -> Result<Accounting, String> {
        let dir = std::env::temp_dir().join(format!(
            "rfaas-accounting-{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).map_err(|e| format!("create {dir:?}: {e}"))?;
        let billing = dir.join("billing.toml");
        if let Some(text) = &opts.billing {
            std::fs::write(&billing, text).map_err(|e| e.to_string())?;
        }
        let keys_file = dir.join("lease-keys.pub");
        let keys = if opts.lease_keys.is_empty() {
            LeaseSigner::generate("nobody")
                .map_err(|e| e.to_string())?
                .public_key()
                .to_line()
        } else {
            opts.lease_keys.concat()
        };
        std::fs::write(&keys_file, keys).map_err(|e| e.to_string())?;
        let listen = match (&opts.listen, opts.provider.as_str()) {
            (Some(l), _) => l.clone(),
            (None, "shm") => dir.join("accounting.sock").display().to_string(),
            (None, _) => "127.0.0.1:0".into(),
        };
        let config = format!(
            "name = \"{}\"\ndatabase = \"{}\"\nregion_file = \"{}\"\nslots = {}\nprovider = \"{}\"\n\
             listen = \"{listen}\"\nmetrics_listen = \"127.0.0.1:0\"\nflush_interval_ms = {}\n\
             snapshot_interval_ms = {}\nslot_hold_s = {}\nbilling_config = \"{}\"\nhello_timeout_ms = {}\n\
             lease_keys = [\"{}\"]\n{}",
            opts.name,
            opts.database,
            dir.join("accounting.region").display(),
            opts.slots,
            opts.provider,
            opts.flush_interval_ms,
            opts.snapshot_interval_ms,
            opts.slot_hold_s,
            billing.display(),
            opts.hello_timeout_ms,
            keys_file.display(),
            opts.extra_config,
        );
        std::fs::write(dir.join("accounting.toml"), config).map_err(|e| e.to_string())?;
        let mut a = Accounting {
            child: None,
            log: dir.join("accounting.log"),
            dir,
            name: opts.name,
            provider: opts.provider,
            fabric_addr: String::new(),
            metrics_addr: String::new(),
            binary: binary.to_owned(),
        };
        a.spawn(None)?;
        Ok(a)
    }

    /// Starts the process (again), on `listen` if given.
    fn spawn(&mut self, listen: Option<&str>) -> Result<(), String> {
        let mut cmd = Command::new(&self.binary);
        cmd.arg("--config").arg(self.dir.join("accounting.toml"));
        if let Some(l) = listen {
            cmd.arg("--listen").arg(l);
        }
        let (mut child, addrs) =
            crate::process::spawn_ready(cmd, &self.log, "rfaas-accounting listening on ")?;
        let Some((fabric, metrics)) = addrs.split_once(" metrics ") else {
            crate::process::stop(&mut child, crate::process::STOP_GRACE);
            return Err(format!(
                "rfaas-accounting's ready line has no metrics address: {addrs:?}"
            ));
        };
        self.fabric_addr = fabric.to_owned();
        self.metrics_addr = metrics.to_owned();
        self.child = Some(child);
        Ok(())
    }

    /// The instance's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The fabric provider.
    pub fn provider(&self) -> &str {
        &self.provider
    }

    /// The fabric address daemons connect to.
    pub fn fabric_addr(&self) -> &str {
        &self.fabric_addr
    }

    /// `http://host:port` of `/metrics` and `/healthz`.
    pub fn metrics_url(&self) -> String {
        format!("http://{}", self.metrics_addr)
    }

    /// The region file.
    pub fn region_file(&self) -> PathBuf {
        self.dir.join("accounting.region")
    }

    /// Its private directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Its pid while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// What it logged.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// `GET path` on the metrics listener: the status and the body.
    pub fn http_get(&self, path: &str) -> (u16, String) {
        let agent = rfaas_tls::agent(&rfaas_tls::AgentOptions::new(Duration::from_secs(10)))
            .unwrap_or_else(|e| panic!("{e}"));
        match agent.get(&format!("{}{path}", self.metrics_url())).call() {
            Ok(mut r) => (
                r.status().as_u16(),
                r.body_mut().read_to_string().unwrap_or_default(),
            ),
            Err(e) => (0, e.to_string()),
        }
    }

    /// The value of metric `name` (a whole series name, with its labels
    /// as written: `rfaas_accounting_rows_written_total{table="usage"}`).
    pub fn metric(&self, name: &str) -> Option<f64> {
        let (status, text) = self.http_get("/metrics");
        assert_eq!(status, 200, "GET /metrics: {text}");
        text.lines()
            .filter(|l| !l.starts_with('#'))
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
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

    /// Starts it again (after [`kill`](Self::kill) or [`stop`](Self::stop),
    /// or stopping it first) on the same region file, configuration and
    /// fabric address.
    pub fn restart(&mut self) -> Result<(), String> {
        self.stop();
        let listen = self.fabric_addr.clone();
        self.spawn(Some(&listen))
    }
}

impl Drop for Accounting {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// How long a [`Peer`] waits for a completion.
pub const PEER_TIMEOUT: Duration = Duration::from_secs(10);

/// A connection to an accounting instance, as an executor daemon makes
/// one: hello with an accounting ticket, then fetch-and-adds into slots.
#[derive(Debug)]
pub struct Peer {
    /// The answer to the hello.
    pub reply: AccountingReply,
    endpoint: Endpoint,
    cq: CompletionQueue,
    scratch: MemoryRegion,
    reply_buf: MemoryRegion,
    answered: bool,
    _domain: Domain,
    _fabric: Fabric,
    next_wr: u64,
}

/// The endpoint options of a peer (shm: it maps the region's file).
pub fn peer_options() -> EndpointOptions {
    EndpointOptions {
        map_file_regions: true,
        connect_timeout: PEER_TIMEOUT,
        ..EndpointOptions::default()
    }
}

impl Peer {
    /// Connects to `addr` over `provider` and posts the receive of the
    /// answer; says nothing yet ([`Peer::reply`] is a placeholder until
    /// [`Peer::await_reply`]).
    pub fn connect(provider: &str, addr: &str) -> Result<Peer, String> {
        let fabric = Fabric::open(provider).map_err(|e| e.to_string())?;
        let domain = fabric.domain().map_err(|e| e.to_string())?;
        let mut cq = fabric.completion_queue(1024).map_err(|e| e.to_string())?;
        let reply_buf = domain
            .register(AccountingReply::LEN, Access::REMOTE_WRITE)
            .map_err(|e| e.to_string())?;
        let scratch = domain
            .register(SLOT_LEN * 2, Access::LOCAL)
            .map_err(|e| e.to_string())?;
        let endpoint = domain
            .connect(addr, &mut cq, &peer_options())
            .map_err(|e| format!("connect to {addr}: {e}"))?;
        endpoint.post_recv(1).map_err(|e| e.to_string())?;
        Ok(Peer {
            reply: AccountingReply::refused(ReplyStatus::BadHello),
            endpoint,
            cq,
            scratch,
            reply_buf,
            answered: false,
            _domain: domain,
            _fabric: fabric,
            next_wr: 100,
        })
    }

    /// The immediates of a hello with `ticket` (its text), the answer to
    /// go to this peer's reply buffer.
    pub fn hello_imms(&self, ticket: &str) -> [u32; HELLO_IMMS] {
        AccountingHello {
            reply_addr: self.reply_buf.descriptor().addr,
            reply_rkey: self.reply_buf.rkey(),
            ticket: AccountingTicket::from_text(ticket).expect("a ticket's text"),
        }
        .to_imms()
        .expect("a ticket always fits a hello")
    }

    /// The immediates of a hello of the first release (version 1), which
    /// carried the node's bearer `credential` in clear.
    pub fn v1_hello_imms(&self, credential: &str) -> [u32; HELLO_IMMS] {
        let mut b = [0u8; AccountingHello::LEN];
        b[..4].copy_from_slice(b"RFAH");
        b[4..8].copy_from_slice(&1u32.to_le_bytes());
        b[8..16].copy_from_slice(&self.reply_buf.descriptor().addr.to_le_bytes());
        b[16..20].copy_from_slice(&self.reply_buf.rkey().to_le_bytes());
        b[20..24].copy_from_slice(&(credential.len() as u32).to_le_bytes());
        b[24..24 + credential.len()].copy_from_slice(credential.as_bytes());
        let mut imms = [0u32; HELLO_IMMS];
        for (imm, four) in imms.iter_mut().zip(b.chunks_exact(4)) {
            *imm = u32::from_le_bytes(four.try_into().expect("4 bytes"));
        }
        imms
    }

    /// Sends `imms` as zero-length writes-with-immediate and waits for
    /// their completions.
    pub fn send_imms(&mut self, imms: &[u32]) -> Result<(), String> {
        let nowhere = RemoteAddr { addr: 0, rkey: 0 };
        for &imm in imms {
            self.endpoint
                .write_with_imm(2, &self.scratch, 0, 0, nowhere, imm)
                .map_err(|e| e.to_string())?;
        }
        let until = Instant::now() + PEER_TIMEOUT;
        for sent in 0..imms.len() {
            loop {
                let c = self.next_completion(until)?;
                match (c.opcode, c.status) {
                    (Opcode::WriteWithImm, Status::Success) => break,
                    (Opcode::RecvWithImm, Status::Success) if c.imm == REPLY_IMM => {
                        self.answered = true
                    }
                    _ => {
                        return Err(format!(
                            "the hello failed after {sent} immediates: {:?} {}",
                            c.opcode, c.status
                        ))
                    }
                }
            }
        }
        Ok(())
    }

    /// Waits up to `within` for the answer to the hello.
    pub fn await_reply(&mut self, within: Duration) -> Result<AccountingReply, String> {
        let until = Instant::now() + within;
        while !self.answered {
            let c = self.next_completion(until)?;
            match (c.opcode, c.status) {
                (Opcode::RecvWithImm, Status::Success) if c.imm == REPLY_IMM => {
                    self.answered = true
                }
                _ => return Err(format!("no answer: {:?} {}", c.opcode, c.status)),
            }
        }
        self.reply = AccountingReply::decode(&self.reply_buf.read_to_vec(..))
            .map_err(|e| format!("the reply does not decode: {e}"))?;
        Ok(self.reply)
    }

    /// Connects to `addr` over `provider`, says the hello with `ticket`
    /// (its text), and waits for the answer. `Ok` whatever the answer
    /// ([`Peer::reply`]); `Err` when there is none (refused silently,
    /// dropped, unreachable).
    pub fn hello(provider: &str, addr: &str, ticket: &str) -> Result<Peer, String> {
        let mut peer = Peer::connect(provider, addr)?;
        let imms = peer.hello_imms(ticket);
        peer.send_imms(&imms)?;
        peer.await_reply(PEER_TIMEOUT)?;
        Ok(peer)
    }

    fn next_completion(&mut self, until: Instant) -> Result<Completion, String> {
        let mut done = [Completion::EMPTY; 1];
        loop {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err("no completion within the peer's timeout".into());
            }
            let n = self
                .cq
                .wait(&mut done, left.min(Duration::from_millis(100)))
                .map_err(|e| e.to_string())?;
            if n == 1 {
                return Ok(done[0]);
            }
        }
    }

    /// The completion of `wr` (others are skipped); `PeerLost` when none
    /// comes in time.
    fn completion_of(&mut self, wr: u64) -> Result<Completion, Status> {
        let until = Instant::now() + PEER_TIMEOUT;
        loop {
            let c = self.next_completion(until).map_err(|_| Status::PeerLost)?;
            if c.wr_id == wr {
                return Ok(c);
            }
        }
    }

    /// Fetch-and-adds `delta` at `remote`; the old value, or the status of
    /// a failed add.
    pub fn add_at(&mut self, remote: RemoteAddr, delta: u64) -> Result<u64, Status> {
        let wr = self.next_wr;
        self.next_wr += 1;
        self.endpoint
            .fetch_add(wr, &self.scratch, 0, remote, delta)
            .map_err(|_| Status::LocalProtection)?;
        let c = self.completion_of(wr)?;
        if c.status != Status::Success {
            return Err(c.status);
        }
        Ok(self.scratch.read_u64(0))
    }

    /// Compare-and-swaps the word at `remote` (`swap` if it holds
    /// `compare`); the old value, or the status of a failed operation.
    pub fn cas_at(&mut self, remote: RemoteAddr, compare: u64, swap: u64) -> Result<u64, Status> {
        let wr = self.next_wr;
        self.next_wr += 1;
        self.endpoint
            .compare_swap(wr, &self.scratch, 0, remote, compare, swap)
            .map_err(|_| Status::LocalProtection)?;
        let c = self.completion_of(wr)?;
        if c.status != Status::Success {
            return Err(c.status);
        }
        Ok(self.scratch.read_u64(0))
    }

    /// The accepted region's address and rkey.
    pub fn region(&self) -> RemoteAddr {
        RemoteAddr {
            addr: self.reply.region_addr,
            rkey: self.reply.region_rkey,
        }
    }

    /// Adds `delta` to `counter` of `slot` in the accepted region.
    pub fn add(&mut self, slot: u32, counter: Counter, delta: u64) -> Result<u64, Status> {
        let mut at = self.region();
        at.addr = at.addr.wrapping_add(word_offset(slot, counter));
        self.add_at(at, delta)
    }

    /// Adds every nonzero word of `totals` into `slot`.
    pub fn add_totals(&mut self, slot: u32, totals: &SlotTotals) -> Result<(), Status> {
        for c in Counter::ALL {
            if totals.get(c) != 0 {
                self.add(slot, c, totals.get(c))?;
            }
        }
        Ok(())
    }

    /// Reads `slot`'s words back.
    pub fn read_slot(&mut self, slot: u32) -> Result<SlotTotals, Status> {
        let wr = self.next_wr;
        self.next_wr += 1;
        let mut at = self.region();
        at.addr = at.addr.wrapping_add(slot_offset(slot));
        self.endpoint
            .read(wr, &self.scratch, SLOT_LEN, SLOT_LEN, at)
            .map_err(|_| Status::LocalProtection)?;
        let c = self.completion_of(wr)?;
        if c.status != Status::Success {
            return Err(c.status);
        }
        let bytes = self.scratch.read_to_vec(SLOT_LEN..2 * SLOT_LEN);
        Ok(SlotTotals::decode(&bytes).expect("a slot's bytes"))
    }
}

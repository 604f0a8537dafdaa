//! Registration with the resource managers (`[manager]` in the
//! configuration): one thread registers the node, then heartbeats its free
//! capacity and its allocations, and ends the leases the manager says have
//! ended.
//!
//! Managers are optional to serving: the daemon checks lease tokens itself,
//! so while no manager answers it keeps serving the leases its clients hold
//! and retries, with exponential backoff and full jitter across the
//! configured URLs. A manager that no longer knows the node (its database
//! was reset, or it marked the node lost and forgot it) answers a heartbeat
//! `404`, and the daemon registers again.
//!
//! The node registers the Slurm partitions it is in: those `[slurm]`
//! `partitions` sets, or else what Slurm says, asked once before the first
//! registration ([`super::slurm::node_partitions`]) and again before the
//! next only if Slurm could not be asked.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use rfaas_proto::manager::{
    ApiError, Heartbeat, HeartbeatReply, HeldLease, NodeProvider, RegisterNode, Registered,
};
use serde::de::DeserializeOwned;
use serde::Serialize;

use super::billing::Tickets;
use super::clock::unix_now;
use super::config::{ManagerSettings, Settings};
use super::shared::Shared;

/// Timeout of one request to a manager.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// First backoff step, ms.
const BACKOFF_BASE_MS: u64 = 100;

/// Reads the node credential: one line, in a file only its owner may
/// access, owned by root when the daemon runs as root (the same rules as
/// any other secret of the daemon).
pub(crate) fn read_credential(path: &Path) -> Result<String, String> {
    let shown = path.display();
    rfaas_tls::files::check_private_file(path, "the node credential file")?;
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read the node credential file {shown}: {e}"))?;
    let token = text.trim();
    if token.is_empty() || token.contains(char::is_whitespace) {
        return Err(format!(
            "the node credential file {shown} must hold one token on one line, as `rfaasctl credential node` prints it"
        ));
    }
    Ok(token.to_owned())
}

/// What this node tells the managers about itself.
pub(crate) fn node_record(s: &Settings, control_addr: std::net::SocketAddr) -> RegisterNode {
    let m = s.manager.as_ref();
    let control_addr = match m.and_then(|m| m.advertise.clone()) {
        Some(a) => a,
        None if control_addr.ip().is_unspecified() => {
            format!("{}:{}", s.fabric_host, control_addr.port())
        }
        None => control_addr.to_string(),
    };
    RegisterNode {
        control_addr,
        // Clients use TLS wherever the port offers it, required or not.
        control_tls: s.control_tls.is_some(),
        providers: s
            .providers
            .iter()
            .map(|p| NodeProvider {
                name: p.clone(),
                host: (p != "shm").then(|| s.fabric_host.clone()),
            })
            .collect(),
        cores: s.cpus.len() as u32,
        memory_mib: u64::from(s.memory_mib),
        version: env!("CARGO_PKG_VERSION").into(),
        harvested: m.is_some_and(|m| m.harvested),
        partitions: s
            .slurm
            .as_ref()
            .and_then(|sl| sl.partitions.clone())
            .unwrap_or_default(),
    }
}

/// Exponential backoff with full jitter: the n-th wait is uniform in
/// `[0, min(cap, base · 2^n)]`, so daemons that lost the same manager do
/// not come back in step.
#[derive(Debug, Clone)]
pub(crate) struct Backoff {
    attempt: u32,
    base_ms: u64,
    cap_ms: u64,
}

impl Backoff {
    pub(crate) fn new(base_ms: u64, cap_ms: u64) -> Backoff {
        Backoff {
            attempt: 0,
            base_ms,
            cap_ms,
        }
    }

    /// The next wait; `uniform(n)` returns a number in `[0, n]`.
    pub(crate) fn next(&mut self, uniform: impl FnOnce(u64) -> u64) -> Duration {
        let ceiling = self
            .base_ms
            .saturating_mul(1u64 << self.attempt.min(32))
            .min(self.cap_ms);
        self.attempt = self.attempt.saturating_add(1);
        Duration::from_millis(uniform(ceiling).min(ceiling))
    }

    pub(crate) fn reset(&mut self) {
        self.attempt = 0;
    }
}

/// How a call to the managers failed.
#[derive(Debug)]
pub(crate) enum CallError {
    /// No manager answered (refused, timed out, or a 5xx from each).
    Unreachable(String),
    /// A manager answered with a 4xx: retrying the same request elsewhere
    /// will not help.
    Rejected { status: u16, error: ApiError },
}

impl std::fmt::Display for CallError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CallError::Unreachable(why) => write!(f, "no manager answered: {why}"),
            CallError::Rejected { status, error } => write!(f, "HTTP {status}: {error}"),
        }
    }
}

/// The managers, tried in turn from the last one that answered.
pub(crate) struct Managers {
    urls: Vec<String>,
    credential: String,
    agent: ureq::Agent,
    current: usize,
}

impl Managers {
    fn new(m: &ManagerSettings, credential: String) -> Managers {
        Managers::with_timeout(m, credential, REQUEST_TIMEOUT)
    }

    /// As `new`, each request bounded by `timeout`.
    pub(crate) fn with_timeout(
        m: &ManagerSettings,
        credential: String,
        timeout: Duration,
    ) -> Managers {
        let options = rfaas_tls::AgentOptions::new(timeout).ca_file_or_env(m.ca_file.clone());
        // The file was read when the configuration was; if it went bad
        // since, the system's roots still check the managers.
        let agent = rfaas_tls::agent(&options).unwrap_or_else(|e| {
            tracing::error!(error = %e, "manager CA file unusable; checking the managers' certificates with the system's roots");
            rfaas_tls::system_agent(timeout)
        });
        let current = first_manager(&credential, m.urls.len());
        Managers {
            urls: m.urls.clone(),
            credential,
            agent,
            current,
        }
    }

    pub(crate) fn url(&self) -> &str {
        &self.urls[self.current]
    }

    /// Sends `body` to `path` (PUT or POST) on one manager after another
    /// until one answers; a 5xx counts as no answer.
    pub(crate) fn call<B: Serialize, R: DeserializeOwned>(
        &mut self,
        put: bool,
        path: &str,
        body: &B,
    ) -> Result<R, CallError> {
        let mut failures = Vec::new();
        for _ in 0..self.urls.len() {
            let url = format!("{}{path}", self.url());
            let auth = format!("Bearer {}", self.credential);
            let sent = if put {
                self.agent
                    .put(&url)
                    .header("Authorization", &auth)
                    .send_json(body)
            } else {
                self.agent
                    .post(&url)
                    .header("Authorization", &auth)
                    .send_json(body)
            };
            match sent {
                Ok(mut resp) => {
                    let status = resp.status().as_u16();
                    if (200..300).contains(&status) {
                        return resp.body_mut().read_json::<R>().map_err(|e| {
                            CallError::Unreachable(format!("{url}: unreadable reply: {e}"))
                        });
                    }
                    let error =
                        resp.body_mut()
                            .read_json::<ApiError>()
                            .unwrap_or_else(|e| ApiError {
                                error: "unreadable_reply".into(),
                                message: format!("the reply was not an rfaas error ({e})"),
                                details: Default::default(),
                            });
                    if status < 500 {
                        return Err(CallError::Rejected { status, error });
                    }
                    failures.push(format!("{url}: HTTP {status}: {error}"));
                }
                Err(e) => failures.push(format!("{url}: {e}")),
            }
            self.current = (self.current + 1) % self.urls.len();
        }
        Err(CallError::Unreachable(failures.join("; ")))
    }
}

/// The registration thread's body: registers, heartbeats, ends leases, and
/// returns when the daemon stops.
pub(crate) fn run(
    shared: Arc<Shared>,
    mut record: RegisterNode,
    credential: String,
    tickets: Arc<Tickets>,
) {
    let Some(m) = shared.settings.manager.clone() else {
        return;
    };
    let node = shared.settings.node_name.clone();
    let mut managers = Managers::new(&m, credential);
    let mut backoff = Backoff::new(BACKOFF_BASE_MS, m.max_backoff_ms);
    let uniform = |n: u64| fastrand::u64(0..=n);
    let register_path = format!("/v1/nodes/{node}");
    let heartbeat_path = format!("/v1/nodes/{node}/heartbeat");
    // With `[slurm]` and no partitions set, Slurm is asked once; if it
    // cannot be, again at the next registration.
    let mut ask_slurm = shared
        .settings
        .slurm
        .as_ref()
        .is_some_and(|sl| sl.partitions.is_none());
    'register: loop {
        if ask_slurm {
            if let Some(p) = super::slurm::node_partitions(&shared) {
                record.partitions = p;
                ask_slurm = false;
            }
        }
        let mut failures = 0u32;
        let registered: Registered = loop {
            let result = managers.call(true, &register_path, &record);
            shared.metrics.manager_call("register", result.is_ok());
            match result {
                Ok(r) => break r,
                Err(e) => {
                    // The first failure and every tenth are worth a line.
                    if failures % 10 == 0 {
                        tracing::warn!(node = %node, error = %e, attempts = failures + 1, "cannot register with a manager; serving the leases held and retrying");
                    }
                    failures += 1;
                    if stopped_within(&shared, backoff.next(uniform)) {
                        return;
                    }
                }
            }
        };
        backoff.reset();
        keep_ticket(&tickets, registered.accounting_ticket.as_deref());
        tracing::info!(
            node = %node,
            manager = managers.url(),
            heartbeat_ms = registered.heartbeat_interval_ms,
            "registered with the manager"
        );
        let mut interval = beat_interval(registered.heartbeat_interval_ms);
        let mut outage = false;
        loop {
            if next_beat(&shared, interval) {
                return;
            }
            let beat = heartbeat(&shared);
            let result = managers.call::<_, HeartbeatReply>(false, &heartbeat_path, &beat);
            shared.metrics.manager_call("heartbeat", result.is_ok());
            match result {
                Ok(reply) => {
                    if outage {
                        tracing::info!(manager = managers.url(), "a manager answers again");
                        outage = false;
                    }
                    keep_ticket(&tickets, reply.accounting_ticket.as_deref());
                    if let Some(ms) = reply.heartbeat_interval_ms {
                        let next = beat_interval(ms);
                        if next != interval {
                            tracing::info!(heartbeat_ms = ms, "the manager set a new heartbeat interval (the fleet's size changed)");
                            interval = next;
                        }
                    }
                    if !reply.ended_leases.is_empty() {
                        let n = shared.end_leases(&reply.ended_leases, unix_now());
                        tracing::info!(leases = ?reply.ended_leases, workers = n, "the manager ended leases");
                    }
                }
                Err(CallError::Rejected { status: 404, .. }) => {
                    tracing::warn!(node = %node, "the manager does not know this node; registering again");
                    continue 'register;
                }
                Err(e) => {
                    if !outage {
                        tracing::warn!(node = %node, error = %e, "heartbeat failed; serving the leases held and retrying");
                        outage = true;
                    }
                }
            }
        }
    }
}

/// Which of `count` managers a node asks first: one picked by its
/// credential (so by the node), the same at every start, so a fleet's
/// nodes spread over the replicas and each keeps its connection to one.
fn first_manager(credential: &str, count: usize) -> usize {
    // FNV-1a: stable across releases and platforms.
    let hash = credential.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    (hash % count.max(1) as u64) as usize
}

/// The heartbeat interval a manager asked for, within bounds a wrong
/// value cannot push the daemon past.
fn beat_interval(ms: u64) -> Duration {
    Duration::from_millis(ms.clamp(50, 60_000))
}

/// Keeps the accounting ticket of a manager's reply for the billing
/// poster's next connections. A manager of an older release sends none:
/// the one held stays.
fn keep_ticket(tickets: &Tickets, text: Option<&str>) {
    let Some(text) = text else {
        return;
    };
    if let Err(e) = tickets.set_text(text) {
        tracing::warn!(error = %e, "the manager's accounting ticket is unreadable; keeping the previous one");
    }
}

/// Waits `d` unless the daemon starts stopping first; returns whether it
/// did.
fn stopped_within(shared: &Shared, d: Duration) -> bool {
    let st = shared.lock();
    shared.wait_until(st, d, |st| st.stopping).1
}

/// Waits `d`, or less when a change asks for a heartbeat at once (a
/// Slurm job took CPUs back or gave them back); returns whether the daemon
/// is stopping.
fn next_beat(shared: &Shared, d: Duration) -> bool {
    let st = shared.lock();
    let (mut st, _) = shared.wait_until(st, d, |st| st.stopping || st.beat_now);
    st.beat_now = false;
    st.stopping
}

/// The node's free capacity and its allocations, one entry per lease;
/// billed leases with no allocation left (and not expired) are listed with
/// nothing held, so the manager says when they end and their accounting
/// slot can be closed.
fn heartbeat(shared: &Shared) -> Heartbeat {
    let now = unix_now();
    let idle_billed: Vec<u64> = shared
        .usage
        .billed()
        .into_iter()
        .filter(|b| b.usage.ended && b.expires_at > now)
        .map(|b| b.usage.lease_id)
        .collect();
    let st = shared.lock();
    let mut held: Vec<HeldLease> = Vec::new();
    for a in st.allocations.values() {
        match held.iter_mut().find(|h| h.lease_id == a.lease_id) {
            Some(h) => {
                h.cores += a.cpus.len() as u32;
                h.memory_mib += u64::from(a.memory_mib);
            }
            None => held.push(HeldLease {
                lease_id: a.lease_id,
                cores: a.cpus.len() as u32,
                memory_mib: u64::from(a.memory_mib),
            }),
        }
    }
    for lease_id in idle_billed {
        if !held.iter().any(|h| h.lease_id == lease_id) && !st.ended_leases.contains_key(&lease_id)
        {
            held.push(HeldLease {
                lease_id,
                cores: 0,
                memory_mib: 0,
            });
        }
    }
    Heartbeat {
        free_cores: st.capacity.free_cpus().len() as u32,
        free_memory_mib: u64::from(st.capacity.free_memory_mib()),
        draining: st.draining,
        // A draining node lends nothing; otherwise Slurm's jobs hold
        // the CPUs withheld for them.
        withheld_cores: if st.draining {
            st.capacity.cpus().len() as u32
        } else {
            st.capacity.withheld_cpus().len() as u32
        },
        allocations: held,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nodes_spread_over_the_managers_and_keep_theirs() {
        let mut per = [0usize; 3];
        for k in 0..3000 {
            let cred = format!("rfaas_node.node{k}.secret{k}");
            let first = first_manager(&cred, 3);
            assert_eq!(first_manager(&cred, 3), first, "the same at every start");
            per[first] += 1;
        }
        assert!(per.iter().all(|&n| n > 800), "uneven: {per:?}");
        assert_eq!(first_manager("x", 1), 0);
        assert_eq!(first_manager("x", 0), 0);
    }

    #[test]
    fn backoff_doubles_to_its_cap_with_full_jitter() {
        let mut b = Backoff::new(100, 1_000);
        let ceilings: Vec<u64> = (0..6)
            .map(|_| {
                let mut seen = 0;
                b.next(|n| {
                    seen = n;
                    n
                });
                seen
            })
            .collect();
        assert_eq!(ceilings, vec![100, 200, 400, 800, 1_000, 1_000]);
        assert_eq!(
            b.next(|_| 0),
            Duration::ZERO,
            "full jitter may wait nothing"
        );
        assert_eq!(
            b.next(|n| n + 5),
            Duration::from_millis(1_000),
            "a random source that overshoots is clamped"
        );
        b.reset();
        assert_eq!(b.next(|n| n), Duration::from_millis(100));
    }

    #[test]
    fn backoff_survives_many_attempts() {
        let mut b = Backoff::new(100, 30_000);
        for _ in 0..200 {
            assert!(b.next(|n| n) <= Duration::from_millis(30_000));
        }
    }

    #[test]
    fn credential_file_rules() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("rfaas-cred-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("node.credential");
        std::fs::write(&path, "rfaasc_abc\n").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let err = read_credential(&path).unwrap_err();
        assert!(err.contains("chmod 600"), "{err}");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(read_credential(&path).unwrap(), "rfaasc_abc");
        std::fs::write(&path, "two words\n").unwrap();
        assert!(read_credential(&path).unwrap_err().contains("one token"));
        let err = read_credential(&dir.join("missing")).unwrap_err();
        assert!(err.contains("cannot read"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

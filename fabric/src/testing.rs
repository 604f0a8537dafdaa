//! Fixtures the fabric's tests share: the providers' unit tests (`tcp`,
//! `shm` and `verbs` each have a `tests` module) and the conformance suite
//! in `fabric/tests/`, which enables the `testing` feature to reach them.
//! Not part of the fabric's API.
//!
//! They open providers, connect pairs of endpoints and wait for
//! completions with a deadline. Waiting for other events (a condition, a
//! thread asleep in the kernel) is `rfaas_testkit::wait`'s.

use std::process::{Child, Command};
use std::time::{Duration, Instant};

use crate::{
    Completion, CompletionQueue, Domain, Endpoint, EndpointOptions, Fabric, Listener, MemoryRegion,
    RemoteAddr,
};

/// How long a test waits for anything before it fails.
pub const TIMEOUT: Duration = Duration::from_secs(20);

/// The RDMA device the verbs tests use, from `RDMA_DEVICE`. Panics, saying
/// where such tests run, when it is not set.
pub fn rdma_device() -> String {
    std::env::var("RDMA_DEVICE").unwrap_or_else(|_| {
        panic!(
            "RDMA_DEVICE is not set: this test needs an RDMA device; run scripts/test-verbs.sh \
             (Soft-RoCE in a VM), which sets RDMA_DEVICE and RDMA_VM_IP"
        )
    })
}

/// The verbs provider on [`rdma_device`], as `Fabric::open` takes it.
pub fn verbs() -> &'static str {
    Box::leak(format!("verbs:{}", rdma_device()).into_boxed_str())
}

/// The IPv4 address of the RDMA device's netdev: `RDMA_VM_IP` without a
/// prefix length (rdma_cm cannot use 127.0.0.1).
pub fn rdma_ip() -> String {
    let raw = std::env::var("RDMA_VM_IP").unwrap_or_else(|_| "192.0.2.1".into());
    raw.split('/').next().unwrap_or("192.0.2.1").to_owned()
}

/// An address a test listens on with `provider`: a fresh private socket
/// for shm, port 0 of the RDMA netdev for verbs, of 127.0.0.1 for tcp.
pub fn listen_addr(provider: &str) -> String {
    match provider {
        "shm" => String::new(),
        p if p.starts_with("verbs:") => format!("{}:0", rdma_ip()),
        _ => "127.0.0.1:0".into(),
    }
}

/// Two connected endpoints of one provider in one process: `ep` dialled
/// the listener and `target` is what it accepted, each with its own domain
/// and completion queue. Fields drop in order, endpoints first.
#[derive(Debug)]
pub struct Pair {
    /// The dialling side.
    pub ep: Endpoint,
    /// The accepted side.
    pub target: Endpoint,
    /// `ep`'s completions.
    pub cq: CompletionQueue,
    /// `target`'s completions.
    pub target_cq: CompletionQueue,
    /// `ep`'s domain.
    pub domain: Domain,
    /// `target`'s domain.
    pub target_domain: Domain,
    /// Where `target` was accepted.
    pub listener: Listener,
    /// The provider.
    pub fabric: Fabric,
    opts: EndpointOptions,
}

impl Pair {
    /// A pair with default options and completion queues of 1024.
    pub fn new(provider: &str) -> Pair {
        Pair::with(provider, &EndpointOptions::default(), 1024)
    }

    /// A pair whose endpoints have `opts` and whose completion queues hold
    /// `cq_depth` completions.
    pub fn with(provider: &str, opts: &EndpointOptions, cq_depth: usize) -> Pair {
        let fabric = Fabric::open(provider).expect("open the provider");
        let listener = fabric.listen(&listen_addr(provider)).expect("listen");
        let target_domain = fabric.domain().expect("target domain");
        let domain = fabric.domain().expect("domain");
        let mut target_cq = fabric.completion_queue(cq_depth).expect("target cq");
        let mut cq = fabric.completion_queue(cq_depth).expect("cq");
        let (target, ep) = connect_pair(
            &listener,
            &target_domain,
            &mut target_cq,
            &domain,
            &mut cq,
            opts,
        );
        Pair {
            ep,
            target,
            cq,
            target_cq,
            domain,
            target_domain,
            listener,
            fabric,
            opts: opts.clone(),
        }
    }

    /// Replaces both endpoints with a fresh connection between the same
    /// domains and completion queues.
    pub fn reconnect(&mut self) {
        let (target, ep) = connect_pair(
            &self.listener,
            &self.target_domain,
            &mut self.target_cq,
            &self.domain,
            &mut self.cq,
            &self.opts,
        );
        self.target = target;
        self.ep = ep;
    }
}

/// Connects an endpoint of `domain` to `listener`, which accepts it into
/// `target_domain`; returns `(target, ep)`.
pub fn connect_pair(
    listener: &Listener,
    target_domain: &Domain,
    target_cq: &mut CompletionQueue,
    domain: &Domain,
    cq: &mut CompletionQueue,
    opts: &EndpointOptions,
) -> (Endpoint, Endpoint) {
    let addr = listener.local_addr();
    std::thread::scope(|s| {
        let accepted = s.spawn(|| listener.accept(target_domain, target_cq, opts, Some(TIMEOUT)));
        let ep = domain.connect(&addr, cq, opts).expect("connect");
        (
            accepted.join().expect("accepting thread").expect("accept"),
            ep,
        )
    })
}

/// The remote address `offset` bytes into `region`.
pub fn at(region: &MemoryRegion, offset: u64) -> RemoteAddr {
    region.descriptor().at(offset)
}

/// `len` bytes that are never 0 (so untouched memory shows) and do not
/// repeat every 256 bytes (so a misplaced block shows), varied by `seed`.
pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| ((i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 8) as u8) | 1)
        .collect()
}

/// Polls `cq` (busy, as a hot worker does) until `n` completions came;
/// fails the test after [`TIMEOUT`].
pub fn poll_n(cq: &mut CompletionQueue, n: usize) -> Vec<Completion> {
    let mut got = Vec::with_capacity(n);
    let mut out = [Completion::EMPTY; 32];
    let deadline = Instant::now() + TIMEOUT;
    while got.len() < n {
        let want = (n - got.len()).min(out.len());
        let k = cq.poll(&mut out[..want]);
        got.extend_from_slice(&out[..k]);
        assert!(
            Instant::now() < deadline,
            "only {} of {n} completions within {TIMEOUT:?}: {got:?}",
            got.len()
        );
        if k == 0 {
            std::thread::yield_now();
        }
    }
    got
}

/// The next completion, polled for as [`poll_n`] does.
pub fn poll_one(cq: &mut CompletionQueue) -> Completion {
    poll_n(cq, 1)[0]
}

/// Sleeps in `wait` until `n` completions came; fails the test after
/// [`TIMEOUT`].
pub fn wait_n(cq: &mut CompletionQueue, n: usize) -> Vec<Completion> {
    let got = wait_up_to(cq, n, TIMEOUT);
    assert_eq!(got.len(), n, "completions within {TIMEOUT:?}: {got:?}");
    got
}

/// The next completion, waited for as [`wait_n`] does.
pub fn wait_one(cq: &mut CompletionQueue) -> Completion {
    wait_n(cq, 1)[0]
}

/// The completions, at most `n`, that come within `within`, waited for in
/// `wait`: for tests that check what arrives by a promised deadline.
pub fn wait_up_to(cq: &mut CompletionQueue, n: usize, within: Duration) -> Vec<Completion> {
    let deadline = Instant::now() + within;
    let mut got = Vec::with_capacity(n);
    let mut out = [Completion::EMPTY; 16];
    while got.len() < n {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        let want = (n - got.len()).min(out.len());
        let k = cq.wait(&mut out[..want], left).expect("wait");
        got.extend_from_slice(&out[..k]);
    }
    got
}

/// Asserts that `cq` holds no completion now.
pub fn assert_no_completion(cq: &mut CompletionQueue) {
    let mut out = [Completion::EMPTY; 4];
    let n = cq.poll(&mut out);
    assert_eq!(n, 0, "unexpected completions: {:?}", &out[..n]);
}

/// A child process, killed and reaped when dropped.
#[derive(Debug)]
pub struct KillOnDrop(pub Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A command that runs only the test `name` of the running test binary
/// (ignored or not), as a peer process of the current test.
pub fn rerun_test(name: &str) -> Command {
    let exe = std::env::current_exe().expect("the test binary's path");
    let mut cmd = Command::new(exe);
    cmd.args([
        name,
        "--exact",
        "--ignored",
        "--test-threads=1",
        "--nocapture",
    ]);
    cmd
}

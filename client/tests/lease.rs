//! Leases from a real `rfaas-manager`, with the retry schedule driven by
//! an injected clock: the test's clock "sleeps" by moving its own time
//! and running what the scenario does at that retry, so nothing waits.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rfaas_client::lease::{Backoff, Clock, Jitter, Lease, LeaseRequest, Managers};
use rfaas_client::{Error, Next};
use rfaas_testkit::manager::{Manager, ManagerOptions};

type Hook = Box<dyn FnMut(u32) + Send>;

/// Virtual time: `sleep` adds to it and calls the hook with the number of
/// sleeps so far.
struct TestClock {
    start: Instant,
    slept: Mutex<(Duration, Vec<Duration>)>,
    hook: Mutex<Hook>,
}

impl std::fmt::Debug for TestClock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestClock").finish_non_exhaustive()
    }
}

impl TestClock {
    fn new(hook: impl FnMut(u32) + Send + 'static) -> Arc<TestClock> {
        Arc::new(TestClock {
            start: Instant::now(),
            slept: Mutex::new((Duration::ZERO, Vec::new())),
            hook: Mutex::new(Box::new(hook)),
        })
    }

    fn sleeps(&self) -> Vec<Duration> {
        self.slept.lock().unwrap().1.clone()
    }
}

impl Clock for TestClock {
    fn now(&self) -> Instant {
        self.start + self.slept.lock().unwrap().0
    }
    fn sleep(&self, d: Duration) {
        let n = {
            let mut s = self.slept.lock().unwrap();
            s.0 += d;
            s.1.push(d);
            s.1.len() as u32
        };
        (self.hook.lock().unwrap())(n);
    }
}

/// Always the top of the range: the schedule is deterministic.
#[derive(Debug)]
struct Top;
impl Jitter for Top {
    fn uniform(&self, max: u64) -> u64 {
        max
    }
}

const BACKOFF: Backoff = Backoff {
    base: Duration::from_millis(100),
    cap: Duration::from_secs(2),
};

fn node(m: &Manager, name: &str, cores: u32) {
    m.register_node(name, cores, 4096);
}

fn request(cores: u32) -> LeaseRequest {
    LeaseRequest {
        cores,
        memory_mib: 64,
        duration_s: 600,
        min_cores: None,
        nodes: vec![],
    }
}

/// Silent test nodes must not be lost while a test runs.
fn manager() -> Manager {
    Manager::start(ManagerOptions {
        extra_config: "lost_after_ms = 600000\n".into(),
        ..ManagerOptions::default()
    })
}

/// Managers at `urls` with `credential`, on the virtual `clock`.
fn on_clock(urls: &[&str], credential: &str, clock: &Arc<TestClock>) -> Managers {
    Managers::with(
        urls.iter().copied(),
        credential,
        clock.clone(),
        Arc::new(Top),
        BACKOFF,
    )
    .unwrap()
}

/// Alice's view of `m`, on `clock`.
fn alice(m: &Manager, clock: &Arc<TestClock>) -> Managers {
    on_clock(&[m.url()], &m.credential("user", "alice", None), clock)
}

/// A manager whose one node, "a", has its one core leased to bob (for
/// 600 s, so Retry-After says 10, the manager's cap); the lease, for a
/// test's clock to release.
fn a_full_node() -> (Manager, Arc<Mutex<Option<Lease>>>) {
    let m = manager();
    node(&m, "a", 1);
    let bob = Managers::new([m.url()], &m.credential("user", "bob", None)).unwrap();
    let held = bob.request(&request(1), Duration::ZERO).unwrap();
    (m, Arc::new(Mutex::new(Some(held))))
}

#[test]
fn no_capacity_three_times_then_a_grant() {
    let (m, held) = a_full_node();
    // The third wait ends with bob's release.
    let clock = TestClock::new(move |n| {
        if n == 3 {
            held.lock().unwrap().take().unwrap().release().unwrap();
        }
    });
    let lease = alice(&m, &clock)
        .request(&request(1), Duration::from_secs(3600))
        .unwrap();
    assert_eq!(lease.cores(), 1);
    assert_eq!(lease.nodes()[0].node, "a");
    let sleeps = clock.sleeps();
    assert_eq!(sleeps.len(), 3, "{sleeps:?}");
    // Each wait honours Retry-After: bob's lease ends in 600 s, the manager
    // says 10 (its cap), above the backoff's own 100, 200, 400 ms.
    for s in &sleeps {
        assert!(
            *s >= Duration::from_secs(9),
            "a wait shorter than Retry-After: {sleeps:?}"
        );
    }
    lease.release().unwrap();
}

#[test]
fn a_manager_down_then_up() {
    let mut m = manager();
    node(&m, "a", 2);
    let cred = m.credential("user", "alice", None);
    m.stop();
    let m = Arc::new(Mutex::new(m));
    let m2 = m.clone();
    let clock = TestClock::new(move |n| {
        if n == 4 {
            m2.lock().unwrap().restart().unwrap();
        }
    });
    let url = m.lock().unwrap().url().to_owned();
    let lease = on_clock(&[url.as_str()], &cred, &clock)
        .request(&request(2), Duration::from_secs(60))
        .unwrap();
    assert_eq!(lease.cores(), 2);
    // Unreachable: the plain backoff, doubling from the base.
    let ms: Vec<u128> = clock.sleeps().iter().map(|d| d.as_millis()).collect();
    assert_eq!(ms, vec![100, 200, 400, 800]);
}

#[test]
fn failover_to_the_second_url() {
    let m = manager();
    node(&m, "a", 1);
    // Nothing listens on the first URL.
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dead_url = format!("http://{}", dead.local_addr().unwrap());
    drop(dead);
    let clock = TestClock::new(|_| {});
    let managers = on_clock(
        &[dead_url.as_str(), m.url()],
        &m.credential("user", "alice", None),
        &clock,
    );
    let lease = managers
        .request(&request(1), Duration::from_secs(10))
        .unwrap();
    assert_eq!(lease.cores(), 1);
    assert!(clock.sleeps().is_empty(), "failover needs no wait");
    // The replica that answered is tried first next time: a release goes
    // straight to it.
    lease.release().unwrap();
}

#[test]
fn the_deadline_ends_the_waiting_with_the_managers_reason() {
    let (m, _held) = a_full_node();
    let clock = TestClock::new(|_| {});
    let err = alice(&m, &clock)
        .request(&request(1), Duration::from_secs(25))
        .unwrap_err();
    match &err {
        Error::Manager { status, kind, .. } => {
            assert_eq!((*status, kind.as_str()), (503, "no_capacity"), "{err}");
        }
        other => panic!("not the manager's refusal: {other}"),
    }
    // 10 s waits fit twice in 25 s; the third ends at the deadline, for
    // the last try.
    let secs: Vec<u64> = clock.sleeps().iter().map(Duration::as_secs).collect();
    assert_eq!(secs, [10, 10, 5]);
}

/// A request that fits, on a node that is full now, waits up to its
/// deadline, even when the manager's Retry-After (the soonest expiry, 10 s
/// at most) lies beyond it: cores released before then are granted at
/// the deadline.
#[test]
fn a_full_node_is_waited_for_until_the_deadline() {
    let (m, held) = a_full_node();
    // Bob lets go while alice waits.
    let clock = TestClock::new(move |_| {
        if let Some(lease) = held.lock().unwrap().take() {
            lease.release().unwrap();
        }
    });
    let lease = alice(&m, &clock)
        .request(&request(1), Duration::from_secs(4))
        .unwrap_or_else(|e| panic!("alice got no lease: {e}"));
    assert_eq!(lease.nodes()[0].node, "a");
    // One wait, to the deadline: Retry-After said 10 s.
    assert_eq!(clock.sleeps(), [Duration::from_secs(4)]);
    lease.release().unwrap();
}

/// The manager's refusal of a request no node can ever hold comes back at
/// once, not retryable, with the largest offer in its figures and words.
#[test]
fn a_request_beyond_the_cluster_is_refused_at_once_with_the_largest_offer() {
    let manager = manager();
    for name in ["a", "b", "c"] {
        manager.register_node(name, 2, 2048);
    }
    let clock = TestClock::new(|_| {});
    let err = alice(&manager, &clock)
        .request(&request(64), Duration::from_secs(3600))
        .unwrap_err();
    match &err {
        Error::ExceedsCluster { offer, .. } => {
            assert_eq!(
                (
                    offer.largest_node_cores,
                    offer.largest_node_memory_mib,
                    offer.cluster_cores,
                    offer.nodes
                ),
                (2, 2048, 6, 3)
            );
        }
        other => panic!("not a request beyond the cluster: {other:?}"),
    }
    assert!(!err.is_retryable(), "{err}");
    assert_eq!(err.next(), Next::Fix);
    let text = err.to_string();
    assert!(text.contains("2 cores and 2048 MiB"), "{text}");
    assert!(clock.sleeps().is_empty(), "{:?}", clock.sleeps());
}

#[test]
fn refusals_that_waiting_cannot_change_come_back_at_once() {
    let m = Manager::start(ManagerOptions {
        extra_config: "lost_after_ms = 600000\n[quota]\ndefault_cores = 1\n".into(),
        ..ManagerOptions::default()
    });
    node(&m, "a", 4);
    let clock = TestClock::new(|_| {});
    let err = alice(&m, &clock)
        .request(&request(2), Duration::from_secs(3600))
        .unwrap_err();
    assert!(
        matches!(&err, Error::Manager { status: 403, kind, .. } if kind == "quota_exceeded"),
        "{err}"
    );
    let err = on_clock(&[m.url()], "rfaasc.00.forged", &clock)
        .request(&request(1), Duration::from_secs(3600))
        .unwrap_err();
    assert!(matches!(&err, Error::Manager { status: 401, .. }), "{err}");
    assert!(clock.sleeps().is_empty(), "{:?}", clock.sleeps());
}

#[test]
fn a_lease_is_released_when_dropped_and_renewed_on_request() {
    let m = manager();
    node(&m, "a", 1);
    let managers = Managers::new([m.url()], &m.credential("user", "alice", None)).unwrap();
    let lease = managers.request(&request(1), Duration::ZERO).unwrap();
    let before = lease.expires_at();
    let renewed = lease
        .renew(Duration::from_secs(3000), Duration::ZERO)
        .unwrap();
    assert_eq!(renewed.len(), 1);
    assert!(lease.expires_at() >= before + 2000);
    drop(lease);
    // Released: the core is free for the next request at once.
    let again = managers.request(&request(1), Duration::ZERO).unwrap();
    assert_eq!(again.cores(), 1);
}

use std::os::fd::AsFd;

use rfaas_proto::meter::{Clock, LaneValues};

use super::*;

const LIMITS: Limits = Limits {
    lanes: 2,
    threads: 2,
    memory_mib: 512,
    max_in: 1000,
    max_out: 100,
};

fn reported(hot_ns: u64, warm_ns: u64, invocations: u64) -> Reported {
    Reported {
        compute_ns: 0,
        hot_ns,
        warm_ns,
        invocations,
        bytes_in: invocations * 10,
        bytes_out: invocations,
    }
}

#[test]
fn honest_reports_pass_through_and_compute_is_the_rest_of_the_cpu() {
    let f = bound(
        &Figures::default(),
        1_000_000,
        2_000_000,
        &reported(300_000, 100_000, 7),
        &LIMITS,
    );
    assert_eq!(f.cpu_ns, 1_000_000);
    assert_eq!(f.usage.hot_ns, 300_000);
    assert_eq!(f.usage.compute_ns, 700_000);
    assert_eq!(f.usage.warm_ns, 100_000);
    assert_eq!(
        (f.usage.invocations, f.usage.bytes_in, f.usage.bytes_out),
        (7, 70, 7)
    );
    // 2 ms of 512 MiB.
    assert_eq!(f.usage.alloc_mib_ms, 1024);
}

#[test]
fn huge_reports_get_their_bounds() {
    let huge = Reported {
        compute_ns: u64::MAX,
        hot_ns: u64::MAX,
        warm_ns: u64::MAX,
        invocations: u64::MAX,
        bytes_in: u64::MAX,
        bytes_out: u64::MAX,
    };
    let f = bound(&Figures::default(), 1_000_000, 3_000_000, &huge, &LIMITS);
    assert_eq!(
        f.usage.hot_ns, 1_000_000,
        "hot-polling is at most the CPU time"
    );
    assert_eq!(f.usage.compute_ns, 0);
    assert_eq!(f.usage.warm_ns, 6_000_000, "two threads for 3 ms");
    // Many lanes on one thread wait once, not once per lane.
    let one_thread = Limits {
        lanes: 64,
        threads: 1,
        ..LIMITS
    };
    let f = bound(
        &Figures::default(),
        1_000_000,
        3_000_000,
        &huge,
        &one_thread,
    );
    assert_eq!(f.usage.warm_ns, 3_000_000, "one thread for 3 ms");
    assert_eq!(f.usage.invocations, 1_000_000 / MIN_INVOCATION_CPU_NS);
    assert_eq!(f.usage.bytes_in, f.usage.invocations * 1000);
    assert_eq!(f.usage.bytes_out, f.usage.invocations * 100);
}

#[test]
fn figures_never_shrink_whatever_is_reported() {
    let first = bound(
        &Figures::default(),
        1_000_000,
        1_000_000,
        &reported(400_000, 50_000, 10),
        &LIMITS,
    );
    // The worker now writes zeros: nothing goes back; the new CPU time is
    // compute.
    let zeros = bound(&first, 1_500_000, 2_000_000, &Reported::default(), &LIMITS);
    assert_eq!(zeros.usage.hot_ns, 400_000);
    assert_eq!(zeros.usage.compute_ns, 1_100_000);
    assert_eq!(zeros.usage.warm_ns, 50_000);
    assert_eq!(zeros.usage.invocations, 10);
    assert_eq!(zeros.usage.bytes_in, 100);
    // A kernel reading that went back (it cannot, but a source may fail
    // and come back) keeps the last.
    let back = bound(&zeros, 10, 2_000_000, &reported(0, 0, 0), &LIMITS);
    assert_eq!(back.cpu_ns, 1_500_000);
    // Hot-polling that grew by more than the CPU time did: only the CPU
    // time's growth, and compute keeps what it had.
    let jump = bound(
        &first,
        1_200_000,
        2_000_000,
        &reported(5_000_000, 0, 10),
        &LIMITS,
    );
    assert_eq!(jump.usage.compute_ns, first.usage.compute_ns);
    assert_eq!(jump.usage.hot_ns, 1_200_000 - first.usage.compute_ns);
}

#[test]
fn any_sequence_of_reports_keeps_the_invariants() {
    let mut rng = fastrand::Rng::with_seed(12);
    let any = |rng: &mut fastrand::Rng| match rng.u8(0..4) {
        0 => 0,
        1 => u64::MAX,
        2 => rng.u64(0..10_000_000),
        _ => rng.u64(..),
    };
    for _ in 0..200 {
        let mut prev = Figures::default();
        let (mut cpu, mut wall) = (0u64, 0u64);
        for _ in 0..50 {
            cpu += rng.u64(0..1_000_000);
            wall += rng.u64(0..2_000_000);
            let rep = Reported {
                compute_ns: any(&mut rng),
                hot_ns: any(&mut rng),
                warm_ns: any(&mut rng),
                invocations: any(&mut rng),
                bytes_in: any(&mut rng),
                bytes_out: any(&mut rng),
            };
            let f = bound(&prev, cpu, wall, &rep, &LIMITS);
            assert_eq!(f.usage.compute_ns + f.usage.hot_ns, f.cpu_ns, "{f:?}");
            assert_eq!(f.cpu_ns, cpu);
            assert!(f.usage.warm_ns <= wall * 2 || f.usage.warm_ns == prev.usage.warm_ns);
            for (new, old) in [
                (f.usage.alloc_mib_ms, prev.usage.alloc_mib_ms),
                (f.usage.compute_ns, prev.usage.compute_ns),
                (f.usage.hot_ns, prev.usage.hot_ns),
                (f.usage.warm_ns, prev.usage.warm_ns),
                (f.usage.invocations, prev.usage.invocations),
                (f.usage.bytes_in, prev.usage.bytes_in),
                (f.usage.bytes_out, prev.usage.bytes_out),
            ] {
                assert!(new >= old, "{prev:?} -> {f:?}");
            }
            prev = f;
        }
    }
}

fn claims(lease_id: u64) -> LeaseClaims {
    LeaseClaims {
        key_id: "k".into(),
        lease_id,
        node: "node-1".into(),
        user: "alice".into(),
        account: "physics".into(),
        job_id: Some(42),
        cores: 2,
        memory_mib: 1024,
        issued_at: 0,
        expires_at: u64::MAX,
        billing: None,
    }
}

/// Opens allocation `id` of `lease` in `ledger`, metering this test
/// process's CPU time; returns the worker's side of its area.
fn open(ledger: &Ledger, id: u64, lease: u64) -> MeterArea {
    let (area, fd) = MeterArea::create(LIMITS.lanes, ledger.clock()).unwrap();
    let worker = MeterArea::map(fd.as_fd()).unwrap();
    let me = CpuSource::Process {
        pid: std::process::id(),
        tree: false,
    };
    let opening = ledger.opening(area, me);
    ledger.open(id, &claims(lease), opening, LIMITS);
    worker
}

/// What the reaped "worker" (this process) used: its CPU time now.
fn reaped() -> Option<u64> {
    cpu::process_cpu_ns(std::process::id())
}

fn publish(area: &MeterArea, lane: u16, invocations: u64) {
    area.record(lane).unwrap().publish(
        0,
        &LaneValues {
            state: LaneState::Handling.code(),
            since: 0,
            invocations,
            ..LaneValues::default()
        },
    );
}

#[test]
fn a_lease_adds_up_its_allocations_and_ends_with_the_last() {
    let ledger = Ledger::new(TickClock::MONOTONIC);
    let finals = ledger.subscribe();
    let a = open(&ledger, 1, 7);
    let b = open(&ledger, 2, 7);
    let other = open(&ledger, 3, 8);
    publish(&a, 0, 3);
    publish(&a, 1, 4);
    publish(&b, 0, 5);
    publish(&other, 0, 100);

    let snap = ledger.snapshot();
    assert_eq!(snap.len(), 2);
    let seven = &snap[0];
    assert_eq!(seven.lease_id, 7);
    assert_eq!(seven.usage.invocations, 12, "both allocations, every lane");
    assert_eq!(seven.allocations, 2);
    assert!(!seven.ended);
    assert_eq!(
        (
            seven.node.as_str(),
            seven.user.as_str(),
            seven.account.as_str(),
            seven.job_id
        ),
        ("node-1", "alice", "physics", Some(42))
    );
    assert_eq!(seven.usage.compute_ns + seven.usage.hot_ns, seven.cpu_ns);

    // The first allocation ends: the lease runs on.
    assert!(ledger.close(1, ledger.now(), reaped()).is_none());
    assert!(finals.try_recv().is_err());
    // The worker's figures after its end change nothing.
    publish(&a, 0, 1_000);
    let done = ledger
        .close(2, ledger.now(), reaped())
        .expect("the last one");
    assert!(done.ended);
    assert_eq!(done.usage.invocations, 12);
    assert_eq!(finals.try_recv().unwrap(), done);
    assert_eq!(ledger.lease(7), Some(done.clone()));
    assert!(!ledger.lease(8).unwrap().ended);

    // The node's totals count every allocation, and only grow.
    let t = ledger.totals();
    assert_eq!(t.usage.invocations, 112);
    assert!(ledger.close(99, ledger.now(), None).is_none(), "unknown");
    assert!(ledger.close(3, ledger.now(), reaped()).is_some());
    assert_eq!(ledger.totals().usage.invocations, 112);
}

#[test]
fn a_lease_that_allocates_again_goes_on_from_its_figures() {
    let ledger = Ledger::new(TickClock::MONOTONIC);
    let a = open(&ledger, 1, 7);
    publish(&a, 0, 3);
    let first = ledger.close(1, ledger.now(), reaped()).unwrap();
    let b = open(&ledger, 2, 7);
    publish(&b, 0, 2);
    let again = ledger.lease(7).unwrap();
    assert!(!again.ended);
    assert_eq!(again.usage.invocations, 5);
    assert_eq!(again.allocations, 2);
    assert!(again.usage.alloc_mib_ms >= first.usage.alloc_mib_ms);
}

#[test]
fn live_phases_count_up_to_now() {
    let ledger = Ledger::new(TickClock::MONOTONIC);
    let a = open(&ledger, 1, 7);
    let since = crate::meter::ticks(Clock::Monotonic);
    a.record(0).unwrap().publish(
        0,
        &LaneValues {
            state: LaneState::Warm.code(),
            since,
            warm: 1_000,
            ..LaneValues::default()
        },
    );
    let later = Stamp {
        at: Instant::now() + Duration::from_millis(5),
        ticks: since + 5_000_000,
    };
    let inner = ledger.lock();
    let m = inner.running.get(&1).unwrap();
    let f = sample(m, ledger.clock(), later, Some(0));
    assert_eq!(f.usage.warm_ns, 5_001_000, "the phase under way, to now");
}

#[test]
fn ended_leases_are_forgotten_once_old_and_expired() {
    let ledger = Ledger::new(TickClock::MONOTONIC);
    let mut c = claims(7);
    c.expires_at = 1_000;
    let (area, _fd) = MeterArea::create(1, ledger.clock()).unwrap();
    let me = CpuSource::Process {
        pid: std::process::id(),
        tree: false,
    };
    let opening = ledger.opening(area, me);
    ledger.open(1, &c, opening, LIMITS);
    let ended = ledger.now();
    ledger.close(1, ended, reaped()).unwrap();
    let mut inner = ledger.lock();
    prune(&mut inner, ended.at + ENDED_KEPT / 2, 2_000);
    assert!(inner.leases.contains_key(&7), "ended recently");
    prune(&mut inner, ended.at + ENDED_KEPT * 2, 500);
    assert!(inner.leases.contains_key(&7), "its token still allocates");
    prune(&mut inner, ended.at + ENDED_KEPT * 2, 2_000);
    assert!(!inner.leases.contains_key(&7));
}

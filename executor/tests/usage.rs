//! What the executor meters, against a real `rfaas-executord` and its
//! workers, read back through the node tools' `usage` request: the figures
//! of a CPU-burning function against the kernel's, functions that attack
//! their own meter area, and a worker killed in the middle of a call.
//!
//! The kernel's figure the tests compare with is the worker process's CPU
//! clock, read by the test itself (`clock_getcpuclockid`, as root). The
//! daemon reads the same clock when it samples, so between two samples its
//! CPU figure grows by exactly what the test's readings around those
//! samples allow, with no tolerance (the test reads before it asks and
//! after the answer). Where a cgroup v2 meters the allocation instead, its
//! `usage_usec` is a different counter: it is rounded to microseconds and
//! does not include what a running thread used since the scheduler last
//! accounted it (a tick, 4 ms at most per CPU), so the comparison allows
//! [`CGROUP_SLACK_NS`] there.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use rfaas_client::{Allocation, AllocationSpec, Client, ClientOptions, Mode};
use rfaas_proto::control::local::{LeaseUsage, LocalReply, LocalRequest};
use rfaas_testkit::executord::{Executord, ExecutordOptions};
use rfaas_testkit::functions::c_library_bytes;
use rfaas_testkit::wait::{poll_for, wait_for, wait_until};

const DAEMON: &str = env!("CARGO_BIN_EXE_rfaas-executord");
const MINUTE: Duration = Duration::from_secs(60);

/// Two scheduler ticks on two CPUs, plus microsecond rounding: what a
/// cgroup's `usage_usec` may lag the process clock by (module docs).
const CGROUP_SLACK_NS: u64 = 16_000_000;

const FUNCTIONS: &[&str] = &["burn_cpu_ms", "meter_inflate", "meter_zero_burn", "echo"];

fn daemon() -> Executord {
    Executord::start(Path::new(DAEMON), ExecutordOptions::default())
}

fn allocate(d: &Executord, mode: Mode) -> Allocation {
    let spec = AllocationSpec::new(c_library_bytes(), FUNCTIONS)
        .library_name("libfunctions.so")
        .mode(mode)
        .memory_mib(256);
    Client::new(ClientOptions::with_provider("tcp"))
        .allocate(
            &d.control_addr().to_string(),
            &d.token("nobody", 1, 2048, Duration::from_secs(600)),
            &spec,
        )
        .unwrap_or_else(|e| panic!("allocation failed: {e}\ndaemon log:\n{}", d.log()))
}

/// Whether a cgroup v2 hierarchy meters allocations here (the daemon
/// then reads `cpu.stat`, not the process clock).
fn cgroup_metered() -> bool {
    Path::new("/sys/fs/cgroup/cgroup.controllers").exists()
}

fn slack() -> u64 {
    if cgroup_metered() {
        CGROUP_SLACK_NS
    } else {
        0
    }
}

/// The daemon's figures for `lease`.
fn usage(d: &Executord, lease: u64) -> LeaseUsage {
    match d.local(LocalRequest::Usage {
        lease_id: Some(lease),
    }) {
        LocalReply::Usage { mut leases, .. } => {
            assert_eq!(leases.len(), 1, "{leases:?}");
            leases.remove(0)
        }
        other => panic!("unexpected reply {other:?}"),
    }
}

/// The figures once the lease has ended, waited for.
fn final_usage(d: &Executord, lease: u64) -> LeaseUsage {
    let mut last = None;
    poll_for(MINUTE, || {
        let u = usage(d, lease);
        if u.ended {
            return Some(u);
        }
        last = Some(u);
        None
    })
    .unwrap_or_else(|| panic!("the lease never ended: {last:?}"))
}

/// A sample of the daemon's figures, with the worker's CPU clock read by
/// the test just before it asked and just after the answer.
#[derive(Debug)]
struct Sample {
    before: u64,
    usage: LeaseUsage,
    after: u64,
}

fn sample(d: &Executord, lease: u64, pid: u32) -> Sample {
    let before = worker_cpu_ns(pid);
    let usage = usage(d, lease);
    let after = worker_cpu_ns(pid);
    Sample {
        before,
        usage,
        after,
    }
}

/// Checks the daemon's CPU figure grew from `a` to `b` by what the
/// kernel's readings around the two samples allow, and that compute and
/// hot-polling add up to it in both.
fn assert_follows_the_kernel(a: &Sample, b: &Sample) {
    for s in [a, b] {
        let u = &s.usage;
        assert_eq!(u.usage.compute_ns + u.usage.hot_ns, u.cpu_ns, "{u:?}");
    }
    let grew = b.usage.cpu_ns - a.usage.cpu_ns;
    let least = b.before.saturating_sub(a.after);
    let most = b.after - a.before;
    assert!(
        grew + slack() >= least && grew <= most + slack(),
        "the daemon's CPU figure grew by {grew} ns; the kernel's readings allow {least}..={most}\n{a:?}\n{b:?}"
    );
}

/// The CPU time of process `pid`, all threads, ns.
fn worker_cpu_ns(pid: u32) -> u64 {
    let mut clock: libc::clockid_t = 0;
    // SAFETY: clock is a valid out-pointer.
    let rc = unsafe { libc::clock_getcpuclockid(pid as libc::pid_t, &mut clock) };
    assert_eq!(rc, 0, "the clock of worker {pid}");
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: ts is a valid out-pointer.
    assert_eq!(unsafe { libc::clock_gettime(clock, &mut ts) }, 0);
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

fn worker_pid(d: &Executord, allocation: u64) -> u32 {
    match d.status() {
        LocalReply::Status { allocations, .. } => {
            allocations
                .iter()
                .find(|a| a.allocation_id == allocation)
                .unwrap_or_else(|| panic!("allocation {allocation} not in {allocations:?}"))
                .pid
        }
        other => panic!("unexpected status reply {other:?}"),
    }
}

/// Calls `function` with `ms`; returns the CPU time the call itself
/// measured (its thread's clock) and whether it found its meter area.
fn call(alloc: &Allocation, function: &str, ms: u32) -> (u64, bool) {
    let f = alloc.function(function).unwrap();
    let mut input = alloc.buffer::<u32>(1).unwrap();
    input.write_from(0, &[ms]);
    let mut output = alloc.buffer::<u64>(2).unwrap();
    let n = alloc.invoke(f, &input, 1, &mut output).unwrap();
    assert_eq!(n, 16);
    let out = output.to_vec();
    (out[0], out[1] == 1)
}

#[test]
fn a_burning_function_is_billed_what_the_kernel_counted() {
    let d = daemon();
    let alloc = allocate(&d, Mode::Warm);
    let lease = alloc.lease_id();
    let pid = worker_pid(&d, alloc.id());
    let start = sample(&d, lease, pid);
    let calls = 8;
    let mut own = 0;
    for _ in 0..calls {
        own += call(&alloc, "burn_cpu_ms", 25).0;
    }
    let live = sample(&d, lease, pid);
    assert_follows_the_kernel(&start, &live);
    alloc.deallocate().unwrap();
    let end = final_usage(&d, lease);

    assert_eq!(end.usage.invocations, calls);
    assert_eq!(end.usage.bytes_in, 4 * calls);
    assert_eq!(end.usage.bytes_out, 16 * calls);
    assert_eq!(end.allocations, 1);
    assert_eq!(end.usage.compute_ns + end.usage.hot_ns, end.cpu_ns);
    // A warm lane never polls: every CPU nanosecond is compute.
    assert_eq!(end.usage.hot_ns, 0, "{end:?}");
    assert!(end.cpu_ns >= live.usage.cpu_ns);
    // The functions' own time is in it, and little else: what the worker
    // did around the calls (loading, connecting, waking up, answering,
    // exiting) is milliseconds where the calls are 200 ms.
    let compute = end.usage.compute_ns - start.usage.usage.compute_ns;
    assert!(
        compute >= own,
        "compute {compute} ns < the calls' own {own} ns"
    );
    assert!(
        compute <= own + own / 4,
        "compute {compute} ns, the calls' own {own} ns: the worker's own work should be far less"
    );
    // Blocked between calls, and never more than the allocation lasted.
    assert!(end.usage.warm_ns > 0, "{end:?}");
    assert!(end.usage.alloc_mib_ms > 0);
    assert!(
        end.usage.warm_ns / 1_000_000 * 256 <= end.usage.alloc_mib_ms + 256,
        "{end:?}"
    );
}

#[test]
fn a_hot_lane_splits_its_cpu_time_into_polling_and_compute() {
    let d = daemon();
    let alloc = allocate(&d, Mode::Hot);
    let lease = alloc.lease_id();
    let pid = worker_pid(&d, alloc.id());
    let start = sample(&d, lease, pid);
    for _ in 0..4 {
        call(&alloc, "burn_cpu_ms", 10);
    }
    let live = sample(&d, lease, pid);
    assert_follows_the_kernel(&start, &live);
    assert!(
        live.usage.usage.hot_ns > start.usage.usage.hot_ns,
        "{live:?}"
    );
    assert_eq!(live.usage.usage.invocations, 4);
    alloc.deallocate().unwrap();
    let end = final_usage(&d, lease);
    assert_eq!(end.usage.compute_ns + end.usage.hot_ns, end.cpu_ns);
    assert!(
        end.usage.hot_ns >= live.usage.usage.hot_ns
            && end.usage.compute_ns >= live.usage.usage.compute_ns
    );
}

/// Functions that write huge values, or keep writing zeros, into their own
/// meter area move neither bound: the daemon's CPU figure follows the
/// kernel's, and compute plus hot-polling equals it, at every sample, while
/// they run and after.
#[test]
fn a_function_that_scribbles_on_its_meter_cannot_change_its_cpu_bill() {
    let d = daemon();
    let alloc = allocate(&d, Mode::Hot);
    let lease = alloc.lease_id();
    let pid = worker_pid(&d, alloc.id());
    let mut last = sample(&d, lease, pid);

    // Huge values: every counter at its largest, odd sequence numbers.
    let (_, found) = call(&alloc, "meter_inflate", 50);
    assert!(found, "meter_inflate did not find its meter area");
    let inflated = sample(&d, lease, pid);
    assert_follows_the_kernel(&last, &inflated);
    let u = &inflated.usage;
    assert!(u.usage.invocations <= u.cpu_ns / 50, "{u:?}");
    // Warm time is the lanes' word, at most one lane's allocation time
    // (alloc_mib_ms is that time, ms, times 256 MiB).
    assert!(
        u.usage.warm_ns / 1_000_000 <= u.usage.alloc_mib_ms / 256 + 1,
        "{u:?}"
    );
    last = inflated;

    // Zeros, written while burning 600 ms; sampled all along.
    let done = AtomicBool::new(false);
    std::thread::scope(|s| {
        let burner = s.spawn(|| {
            let r = call(&alloc, "meter_zero_burn", 600);
            done.store(true, Ordering::Release);
            r
        });
        wait_until("meter_zero_burn to return", MINUTE, || {
            let next = sample(&d, lease, pid);
            assert_follows_the_kernel(&last, &next);
            assert!(next.usage.usage.invocations >= last.usage.usage.invocations);
            last = next;
            done.load(Ordering::Acquire)
        });
        let (own, found) = burner.join().unwrap();
        assert!(found, "meter_zero_burn did not find its meter area");
        assert!(own >= 600_000_000);
    });
    let after = sample(&d, lease, pid);
    assert_follows_the_kernel(&last, &after);

    alloc.deallocate().unwrap();
    let end = final_usage(&d, lease);
    assert_eq!(end.usage.compute_ns + end.usage.hot_ns, end.cpu_ns);
    assert!(end.cpu_ns >= after.usage.cpu_ns);
}

#[test]
fn a_worker_killed_in_a_call_still_has_its_final_usage() {
    let d = daemon();
    let alloc = allocate(&d, Mode::Warm);
    let lease = alloc.lease_id();
    let pid = worker_pid(&d, alloc.id());
    std::thread::scope(|s| {
        let call = s.spawn(|| {
            let f = alloc.function("burn_cpu_ms").unwrap();
            let mut input = alloc.buffer::<u32>(1).unwrap();
            input.write_from(0, &[60_000]);
            let mut output = alloc.buffer::<u64>(2).unwrap();
            alloc.invoke(f, &input, 1, &mut output)
        });
        // The call has started once the lane counted it.
        let started = wait_for("the call to start", MINUTE, || {
            let s = sample(&d, lease, pid);
            (s.usage.usage.invocations == 1).then_some(s)
        });
        // Let it burn another 100 ms of CPU, by the kernel, unsampled.
        wait_until("the call to burn 100 ms more CPU", MINUTE, || {
            worker_cpu_ns(pid) >= started.after + 100_000_000
        });
        let killed_after = worker_cpu_ns(pid);
        // SAFETY: kill has no memory preconditions; the pid is the worker
        // this test's allocation runs (the daemon has not reaped it).
        assert_eq!(unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) }, 0);
        assert!(call.join().unwrap().is_err(), "the call cannot succeed");

        let end = final_usage(&d, lease);
        assert_eq!(end.usage.invocations, 1);
        assert_eq!(end.usage.compute_ns + end.usage.hot_ns, end.cpu_ns);
        // The kernel's figure at reap holds everything up to the kill.
        let grew = end.cpu_ns - started.usage.cpu_ns;
        let least = killed_after - started.after;
        assert!(
            grew + slack() >= least,
            "the final CPU figure grew by {grew} ns after the call started; the worker used at least {least} ns"
        );
    });
}

//! The client against a real `rfaas-executord` and its workers, on the tcp
//! and shm providers, with the control port over TLS (required; the
//! invocations on the fabric never see it). Needs the daemon built: `cargo
//! build -p rfaas-executor` first.

use std::collections::BTreeSet;
use std::future::Future;
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant};

use rfaas_client::{
    Allocation, AllocationSpec, Client, ClientOptions, Error, ErrorCode, ExitCause,
    InvocationStatus, Mode, Next,
};
use rfaas_proto::control::local::{LeaseUsage, LocalReply, LocalRequest};
use rfaas_testkit::cpus;
use rfaas_testkit::executord::{daemon_binary, Executord, ExecutordOptions};
use rfaas_testkit::functions::{c_library_bytes, wait_in_sleep_ms};
use rfaas_testkit::wait::{poll_for, thread_states, wait_until};
use rstest::rstest;

const FUNCTIONS: &[&str] = &[
    "echo",
    "noop",
    "fault_segfault",
    "fault_overrun",
    "fault_claim",
    "sleep_ms",
    "fault_scribble_input",
    "fault_hog",
];

/// The options of the suite's daemons: TLS required on the control port.
fn tls_options() -> ExecutordOptions {
    ExecutordOptions {
        control_tls: Some(true),
        ..ExecutordOptions::default()
    }
}

fn daemon() -> Executord {
    Executord::start(&daemon_binary(), tls_options())
}

/// The verbs provider on the test machine's RDMA device: `RDMA_DEVICE`
/// (default rxe0). Its cases are ignored elsewhere; scripts/test-verbs.sh
/// runs them under Soft-RoCE in a VM.
fn verbs() -> &'static str {
    let device = std::env::var("RDMA_DEVICE").unwrap_or_else(|_| "rxe0".into());
    Box::leak(format!("verbs:{device}").into_boxed_str())
}

/// A daemon serving `provider`: for verbs, its workers listen on the RDMA
/// device's address (`RDMA_VM_IP`).
fn daemon_for(provider: &str) -> Executord {
    if !provider.starts_with("verbs:") {
        return daemon();
    }
    let opts = ExecutordOptions {
        providers: vec![provider.to_owned()],
        fabric_host: std::env::var("RDMA_VM_IP").expect("RDMA_VM_IP: the RDMA device's address"),
        ..tls_options()
    };
    Executord::start(&daemon_binary(), opts)
}

fn token(d: &Executord) -> String {
    d.token("nobody", 4, 2048, Duration::from_secs(600))
}

fn spec() -> AllocationSpec {
    AllocationSpec::new(c_library_bytes(), FUNCTIONS)
        .library_name("libfunctions.so")
        .mode(Mode::Warm)
        .memory_mib(256)
}

fn allocate(d: &Executord, provider: &str, spec: &AllocationSpec) -> Allocation {
    let client = Client::new(ClientOptions::with_provider(provider));
    client
        .allocate(&d.executor(), &token(d), spec)
        .unwrap_or_else(|e| panic!("allocation failed: {e}\ndaemon log:\n{}", d.log()))
}

/// A byte pattern that differs per size and position.
fn pattern(len: usize, seed: u32) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) as u8 ^ (i >> 8) as u8)
        .collect()
}

/// The worker pid of `allocation`, from the daemon's status.
fn worker_pid(d: &Executord, allocation: u64) -> i32 {
    match d.status() {
        LocalReply::Status { allocations, .. } => {
            allocations
                .iter()
                .find(|a| a.allocation_id == allocation)
                .unwrap_or_else(|| panic!("allocation {allocation} not in {allocations:?}"))
                .pid as i32
        }
        other => panic!("unexpected status reply {other:?}"),
    }
}

fn kill(pid: i32, signal: i32) {
    // SAFETY: kill has no memory preconditions; the pid is a process this
    // test started (through the daemon).
    assert_eq!(unsafe { libc::kill(pid, signal) }, 0, "kill {pid}");
}

/// One hot core, one lane of 8 slots: every call on one worker thread.
fn one_hot_lane_of_8_slots() -> AllocationSpec {
    spec().cores(1).lanes(1).slots(8).mode(Mode::Hot)
}

/// `e` says the worker died of SIGSEGV.
fn assert_segfault(e: &Error) {
    assert!(
        matches!(
            e,
            Error::WorkerCrashed {
                signal: Some(11),
                ..
            }
        ),
        "{e:?}"
    );
}

fn u32_input(alloc: &Allocation, value: u32) -> rfaas_client::Buffer<u32> {
    let mut b = alloc.buffer::<u32>(1).unwrap();
    b.write_from(0, &[value]);
    b
}

#[rstest]
#[case::tcp("tcp")]
#[case::shm("shm")]
#[ignore = "needs an RDMA device: scripts/test-verbs.sh runs it under Soft-RoCE"]
#[case::verbs(verbs())]
fn echo_inline_and_bulk_sizes(#[case] provider: &str) {
    let d = daemon_for(provider);
    let spec = spec().input_capacity(64 << 10).output_capacity(8 << 20);
    let alloc = allocate(&d, provider, &spec);
    let echo = alloc.function("echo").unwrap();
    let big = 5 << 20;
    let mut input = alloc.buffer::<u8>(big).unwrap();
    let mut output = alloc.buffer::<u8>(big).unwrap();
    // Around the inline limit (64 KiB - 32), then bulk, then 5 MiB.
    let sizes = [
        0usize,
        1,
        7,
        31,
        32,
        33,
        100,
        4096,
        65_503,
        65_504,
        65_505,
        65_536,
        300_000,
        1 << 20,
        big,
    ];
    for (seed, &n) in sizes.iter().enumerate() {
        let data = pattern(n, seed as u32);
        input.write_from(0, &data);
        output.write_from(0, &[0xee; 64][..n.min(64)]);
        let got = alloc
            .submit(echo, &input, n, &mut output)
            .unwrap()
            .get()
            .unwrap_or_else(|e| panic!("echo of {n} bytes failed: {e}\n{}", d.log()));
        assert_eq!(got, n, "output length of a {n}-byte echo");
        assert!(
            output.to_vec()[..n] == data[..],
            "output of a {n}-byte echo differs"
        );
    }
    alloc.deallocate().unwrap();
}

#[rstest]
#[case::tcp("tcp")]
#[case::shm("shm")]
#[ignore = "needs an RDMA device: scripts/test-verbs.sh runs it under Soft-RoCE"]
#[case::verbs(verbs())]
fn many_echoes_with_checked_outputs(#[case] provider: &str) {
    let d = daemon_for(provider);
    let alloc = allocate(&d, provider, &spec());
    let echo = alloc.function("echo").unwrap();
    let mut input = alloc.buffer::<u8>(64 << 10).unwrap();
    let mut output = alloc.buffer::<u8>(64 << 10).unwrap();
    for i in 0..300u32 {
        let n = (i as usize * 7919) % (64 << 10);
        let data = pattern(n, i);
        input.write_from(0, &data);
        // Alternate the ways of waiting.
        let inv = alloc.submit(echo, &input, n, &mut output).unwrap();
        let got = match i % 3 {
            0 => inv.get(),
            1 => inv.spin(),
            _ => {
                let mut inv = inv;
                loop {
                    if let Some(r) = inv.try_get() {
                        break r;
                    }
                    std::thread::yield_now();
                }
            }
        }
        .unwrap();
        assert_eq!(got, n);
        assert!(
            output.to_vec()[..n] == data[..],
            "invocation {i}: output differs"
        );
    }
    // Typed buffers: f64 in, f64 out.
    let mut fin = alloc.buffer::<f64>(1000).unwrap();
    let mut fout = alloc.buffer::<f64>(1000).unwrap();
    let halves: Vec<f64> = (0..1000).map(|i| i as f64 * 0.5).collect();
    fin.write_from(0, &halves);
    assert_eq!(alloc.invoke(echo, &fin, 1000, &mut fout).unwrap(), 8000);
    assert_eq!(fout.to_vec(), halves);
}

#[rstest]
#[case::tcp("tcp")]
#[case::shm("shm")]
#[ignore = "needs an RDMA device: scripts/test-verbs.sh runs it under Soft-RoCE"]
#[case::verbs(verbs())]
fn concurrent_clients(#[case] provider: &'static str) {
    let d = Arc::new(daemon_for(provider));
    let threads: Vec<_> = (0..3u32)
        .map(|t| {
            let d = Arc::clone(&d);
            std::thread::spawn(move || {
                let alloc = allocate(&d, provider, &spec());
                let echo = alloc.function("echo").unwrap();
                let mut input = alloc.buffer::<u8>(4096).unwrap();
                let mut output = alloc.buffer::<u8>(4096).unwrap();
                for i in 0..100u32 {
                    let n = ((i * 37 + t) % 4096) as usize;
                    let data = pattern(n, t * 1000 + i);
                    input.write_from(0, &data);
                    assert_eq!(alloc.invoke(echo, &input, n, &mut output).unwrap(), n);
                    assert!(output.to_vec()[..n] == data[..], "client {t} call {i}");
                }
                alloc.deallocate().unwrap();
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
}

#[rstest]
#[case::tcp("tcp")]
#[case::shm("shm")]
#[ignore = "needs an RDMA device: scripts/test-verbs.sh runs it under Soft-RoCE"]
#[case::verbs(verbs())]
fn parallel_submissions_across_two_lanes(#[case] provider: &str) {
    let d = daemon_for(provider);
    let alloc = allocate(&d, provider, &spec().cores(2));
    assert_eq!(alloc.lanes(), 2);
    let sleep = alloc.function("sleep_ms").unwrap();
    let noop = alloc.function("noop").unwrap();
    let a_in = u32_input(&alloc, 300);
    let b_in = u32_input(&alloc, 300);
    let mut a_out = alloc.buffer::<u32>(1).unwrap();
    let mut b_out = alloc.buffer::<u32>(1).unwrap();
    let mut c_out = alloc.buffer::<u32>(1).unwrap();
    let a = alloc.submit(sleep, &a_in, 1, &mut a_out).unwrap();
    let b = alloc.submit(sleep, &b_in, 1, &mut b_out).unwrap();
    assert_ne!(a.lane(), b.lane());
    // Both lanes are taken now.
    assert!(matches!(
        alloc.submit(noop, &a_in, 0, &mut c_out),
        Err(Error::AllLanesBusy)
    ));
    assert_eq!(b.get().unwrap(), 4);
    assert_eq!(a.get().unwrap(), 4);
    assert_eq!(a_out.to_vec(), [300]);
    assert_eq!(b_out.to_vec(), [300]);

    // Threads sharing the allocation, one input buffer on both lanes.
    let shared_in = u32_input(&alloc, 1);
    std::thread::scope(|s| {
        for _ in 0..2 {
            s.spawn(|| {
                let mut out = alloc.buffer::<u32>(1).unwrap();
                for _ in 0..50 {
                    assert_eq!(alloc.invoke(sleep, &shared_in, 1, &mut out).unwrap(), 4);
                    assert_eq!(out.to_vec(), [1]);
                }
            });
        }
    });
}

/// Lanes apart from cores: eight calls in flight at once on one core, each
/// on its own lane, answered on its own; one more is refused at once, and
/// the worker runs one thread.
#[rstest]
#[case::tcp("tcp")]
#[case::shm("shm")]
#[ignore = "needs an RDMA device: scripts/test-verbs.sh runs it under Soft-RoCE"]
#[case::verbs(verbs())]
fn eight_lanes_on_one_core_keep_eight_calls_in_flight(#[case] provider: &str) {
    let d = daemon_for(provider);
    let alloc = allocate(&d, provider, &spec().cores(1).lanes(8).mode(Mode::Hot));
    assert_eq!(alloc.lanes(), 8);
    let sleep = alloc.function("sleep_ms").unwrap();
    let inputs: Vec<_> = (0..8u32).map(|i| u32_input(&alloc, 20 + i)).collect();
    let mut outputs: Vec<_> = (0..8).map(|_| alloc.buffer::<u32>(1).unwrap()).collect();
    let mut spare = alloc.buffer::<u32>(1).unwrap();
    let calls: Vec<_> = inputs
        .iter()
        .zip(outputs.iter_mut())
        .map(|(input, output)| alloc.submit(sleep, input, 1, output).unwrap())
        .collect();
    let lanes: BTreeSet<usize> = calls.iter().map(|c| c.lane()).collect();
    assert_eq!(lanes.len(), 8, "a lane per call");
    assert!(matches!(
        alloc.submit(sleep, &inputs[0], 1, &mut spare),
        Err(Error::AllLanesBusy)
    ));
    // Taken in reverse: answers come in any order, each to its own call.
    for c in calls.into_iter().rev() {
        assert_eq!(c.get().unwrap(), 4);
    }
    for (i, out) in outputs.iter().enumerate() {
        assert_eq!(out.to_vec(), [20 + i as u32], "call {i}'s own answer");
    }
    // Every lane has answered: the worker's threads have all started.
    let pid = worker_pid(&d, alloc.id());
    let serving = std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .filter_map(Result::ok)
        .filter(|t| {
            std::fs::read_to_string(t.path().join("comm"))
                .is_ok_and(|c| c.starts_with("rfaas-serve-"))
        })
        .count();
    assert_eq!(serving, 1, "one thread for one core");
    alloc.deallocate().unwrap();
}

/// Slots: one lane holds eight calls at once from one thread; a ninth is
/// refused at once with its buffers back, and every answer reaches its own
/// call and buffers. Then a stream of calls keeps the slots full.
#[rstest]
#[case::tcp("tcp")]
#[case::shm("shm")]
#[ignore = "needs an RDMA device: scripts/test-verbs.sh runs it under Soft-RoCE"]
#[case::verbs(verbs())]
fn a_pipeline_keeps_eight_calls_in_flight_on_one_lane(#[case] provider: &str) {
    let d = daemon_for(provider);
    let alloc = allocate(&d, provider, &one_hot_lane_of_8_slots());
    assert_eq!((alloc.lanes(), alloc.slots()), (1, 8));
    let sleep = alloc.function("sleep_ms").unwrap();
    let echo = alloc.function("echo").unwrap();
    let mut pipe = alloc.pipeline::<u32, u32>().unwrap();
    assert_eq!(pipe.slots(), 8);
    // The lane is the pipeline's: a plain call finds no idle lane.
    let (input, mut output) = (u32_input(&alloc, 1), alloc.buffer::<u32>(1).unwrap());
    assert!(matches!(
        alloc.submit(echo, &input, 1, &mut output),
        Err(Error::AllLanesBusy)
    ));
    let mut sent = std::collections::BTreeMap::new();
    for i in 0..8u32 {
        let id = pipe
            .submit(sleep, u32_input(&alloc, 5 + i), 1, alloc.buffer(1).unwrap())
            .unwrap();
        sent.insert(id, 5 + i);
    }
    assert_eq!(pipe.in_flight(), 8);
    let refused = pipe
        .submit(sleep, u32_input(&alloc, 99), 1, alloc.buffer(1).unwrap())
        .unwrap_err();
    assert!(
        matches!(refused.error, Error::SlotsFull { slots: 8 }),
        "{:?}",
        refused.error
    );
    assert!(refused.error.is_retryable());
    assert_eq!(refused.input.to_vec(), [99], "the buffers come back");
    while pipe.in_flight() > 0 {
        let done = pipe.wait_any().unwrap();
        let value = sent.remove(&done.id).expect("each call ends once");
        assert_eq!(done.result.unwrap(), 4);
        assert_eq!(done.input.to_vec(), [value]);
        assert_eq!(
            done.output.to_vec(),
            [value],
            "call {:?}'s own answer",
            done.id
        );
    }
    assert!(sent.is_empty());
    assert!(pipe.test_any().is_none());
    assert!(matches!(pipe.wait_any(), Err(Error::InvalidArgument(_))));

    // A stream: 200 echoes, the slots kept full, each checked.
    let mut free: Vec<_> = (0..8)
        .map(|_| {
            (
                alloc.buffer::<u32>(1).unwrap(),
                alloc.buffer::<u32>(1).unwrap(),
            )
        })
        .collect();
    let (mut next, mut checked) = (0u32, 0u32);
    let mut expect = std::collections::BTreeMap::new();
    while checked < 200 {
        while next < 200 {
            let Some((mut input, output)) = free.pop() else {
                break;
            };
            input.write_from(0, &[1000 + next]);
            let id = pipe.submit(echo, input, 1, output).unwrap();
            expect.insert(id, 1000 + next);
            next += 1;
        }
        let done = pipe.spin_any().unwrap();
        assert_eq!(done.result.unwrap(), 4);
        assert_eq!(done.output.to_vec(), [expect.remove(&done.id).unwrap()]);
        checked += 1;
        free.push((done.input, done.output));
    }
    drop(pipe);
    // The lane is free again for plain calls.
    assert_eq!(alloc.invoke(echo, &input, 1, &mut output).unwrap(), 4);
    assert_eq!(output.to_vec(), [1]);
    alloc.deallocate().unwrap();
}

/// A pipeline dropped with calls in flight: their answers still land in
/// memory kept for them, and the lane serves again once they have.
#[rstest]
#[case::tcp("tcp")]
#[case::shm("shm")]
fn a_pipeline_dropped_with_calls_in_flight_leaves_the_lane_usable(#[case] provider: &str) {
    let d = daemon_for(provider);
    let alloc = allocate(&d, provider, &spec().lanes(1).slots(4));
    let sleep = alloc.function("sleep_ms").unwrap();
    let mut pipe = alloc.pipeline::<u32, u32>().unwrap();
    for ms in [30, 30, 30] {
        pipe.submit(sleep, u32_input(&alloc, ms), 1, alloc.buffer(1).unwrap())
            .unwrap();
    }
    drop(pipe);
    let echo = alloc.function("echo").unwrap();
    let input = u32_input(&alloc, 7);
    let mut output = alloc.buffer::<u32>(1).unwrap();
    // Busy while the abandoned answers are owed, then usable.
    let result = poll_for(Duration::from_secs(10), || {
        match alloc.submit(echo, &input, 1, &mut output) {
            Ok(call) => Some(call.get()),
            Err(Error::AllLanesBusy) => None,
            Err(e) => Some(Err(e)),
        }
    });
    assert_eq!(result.expect("the lane came back").unwrap(), 4);
    assert_eq!(output.to_vec(), [7]);
    // And a new pipeline starts clean.
    let mut pipe = alloc.pipeline::<u32, u32>().unwrap();
    pipe.submit(echo, u32_input(&alloc, 8), 1, alloc.buffer(1).unwrap())
        .unwrap();
    let done = pipe.wait_any().unwrap();
    assert_eq!((done.result.unwrap(), done.output.to_vec()), (4, vec![8]));
    drop(pipe);
    alloc.deallocate().unwrap();
}

/// Staged calls leave only at a flush (or a wait), together; each ends
/// once with its own answer. Staged calls dropped unsent never reach the
/// worker, and the lane is free at once.
#[rstest]
#[case::tcp("tcp")]
#[case::shm("shm")]
#[ignore = "needs an RDMA device: scripts/test-verbs.sh runs it under Soft-RoCE"]
#[case::verbs(verbs())]
fn staged_calls_leave_together_at_a_flush(#[case] provider: &str) {
    let d = daemon_for(provider);
    let alloc = allocate(&d, provider, &one_hot_lane_of_8_slots());
    let echo = alloc.function("echo").unwrap();
    let served = || lease_usage(&d, alloc.lease_id()).usage.invocations;
    let mut pipe = alloc.pipeline::<u32, u32>().unwrap();
    let mut sent = std::collections::BTreeMap::new();
    for value in 10..16u32 {
        let id = pipe
            .stage(echo, u32_input(&alloc, value), 1, alloc.buffer(1).unwrap())
            .unwrap();
        sent.insert(id, value);
    }
    assert_eq!(pipe.in_flight(), 6);
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(served(), 0, "nothing leaves before the flush");
    pipe.flush().unwrap();
    while pipe.in_flight() > 0 {
        let done = pipe.wait_any().unwrap();
        let value = sent.remove(&done.id).expect("each call ends once");
        assert_eq!(done.result.unwrap(), 4);
        assert_eq!(done.output.to_vec(), [value]);
    }
    assert!(sent.is_empty());
    assert_eq!(
        poll_for(Duration::from_secs(5), || (served() == 6).then_some(6)),
        Some(6)
    );
    // A wait flushes first.
    let id = pipe
        .stage(echo, u32_input(&alloc, 20), 1, alloc.buffer(1).unwrap())
        .unwrap();
    let done = pipe.wait_any().unwrap();
    assert_eq!((done.id, done.output.to_vec()), (id, vec![20]));
    // Staged and dropped: never sent, and the lane is free at once.
    for value in [30, 31] {
        pipe.stage(echo, u32_input(&alloc, value), 1, alloc.buffer(1).unwrap())
            .unwrap();
    }
    drop(pipe);
    let input = u32_input(&alloc, 40);
    let mut output = alloc.buffer::<u32>(1).unwrap();
    assert_eq!(alloc.invoke(echo, &input, 1, &mut output).unwrap(), 4);
    assert_eq!(output.to_vec(), [40]);
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(
        served(),
        8,
        "the dropped staged calls never reached the worker"
    );
    alloc.deallocate().unwrap();
}

/// A crash under one call of a pipeline ends every call in flight with
/// the crash, none hangs.
#[rstest]
#[case::tcp("tcp")]
#[case::shm("shm")]
fn a_crash_in_a_pipeline_ends_every_call_in_flight(#[case] provider: &str) {
    let d = daemon_for(provider);
    let alloc = allocate(&d, provider, &spec().lanes(1).slots(4));
    let sleep = alloc.function("sleep_ms").unwrap();
    let crash = alloc.function("fault_segfault").unwrap();
    let mut pipe = alloc.pipeline::<u32, u32>().unwrap();
    let first = pipe
        .submit(sleep, u32_input(&alloc, 20), 1, alloc.buffer(1).unwrap())
        .unwrap();
    let crashed = pipe
        .submit(crash, u32_input(&alloc, 0), 0, alloc.buffer(1).unwrap())
        .unwrap();
    let after = pipe
        .submit(sleep, u32_input(&alloc, 20), 1, alloc.buffer(1).unwrap())
        .unwrap();
    let mut ended = std::collections::BTreeMap::new();
    while pipe.in_flight() > 0 {
        let done = pipe.wait_any().unwrap();
        ended.insert(done.id, done.result);
    }
    assert_eq!(ended.len(), 3);
    assert_eq!(
        ended.remove(&first).unwrap().unwrap(),
        4,
        "served before the crash"
    );
    let e = ended.remove(&crashed).unwrap().unwrap_err();
    assert_segfault(&e);
    let e = ended.remove(&after).unwrap().unwrap_err();
    assert_segfault(&e);
    drop(pipe);
    alloc.deallocate().unwrap();
}

/// The answers a worker thread holds to send as one batch still reach the
/// client when a later call of the batch crashes: the watchdog sends them
/// before its own `function_crashed`. A sleep keeps the thread busy while
/// the batch arrives; `fault_overrun` ran short before, so the thread keeps
/// holding the echoes' answers across it (thread.rs, "Batches").
#[rstest]
#[case::tcp("tcp")]
#[case::shm("shm")]
#[ignore = "needs an RDMA device: scripts/test-verbs.sh runs it under Soft-RoCE"]
#[case::verbs(verbs())]
fn answers_held_for_a_batch_survive_a_crash_later_in_it(#[case] provider: &str) {
    let d = daemon_for(provider);
    let alloc = allocate(&d, provider, &one_hot_lane_of_8_slots());
    let sleep = alloc.function("sleep_ms").unwrap();
    let echo = alloc.function("echo").unwrap();
    let overrun = alloc.function("fault_overrun").unwrap();
    let mut pipe = alloc.pipeline::<u32, u32>().unwrap();
    // Each function once, short: the thread learns they are.
    for (f, value) in [(echo, 7), (overrun, 4)] {
        pipe.submit(f, u32_input(&alloc, value), 1, alloc.buffer(1).unwrap())
            .unwrap();
        let done = pipe.wait_any().unwrap();
        assert_eq!(done.result.unwrap(), 4);
    }
    let busy = pipe
        .submit(sleep, u32_input(&alloc, 50), 1, alloc.buffer(1).unwrap())
        .unwrap();
    let mut echoes = std::collections::BTreeMap::new();
    for value in 100..106u32 {
        let id = pipe
            .submit(echo, u32_input(&alloc, value), 1, alloc.buffer(1).unwrap())
            .unwrap();
        echoes.insert(id, value);
    }
    // Past the output buffer's guard page.
    let crash = pipe
        .submit(
            overrun,
            u32_input(&alloc, 1 << 24),
            1,
            alloc.buffer(1).unwrap(),
        )
        .unwrap();
    let mut crashed = None;
    while pipe.in_flight() > 0 {
        let done = pipe.wait_any().unwrap();
        if done.id == busy {
            assert_eq!(done.result.unwrap(), 4, "served before the batch");
        } else if done.id == crash {
            crashed = Some(done.result.unwrap_err());
        } else {
            let value = echoes.remove(&done.id).expect("each call ends once");
            let result = done.result.unwrap_or_else(|e| {
                panic!(
                    "echo {value}, computed before the crash, was lost: {e:?}\n{}",
                    d.log()
                )
            });
            assert_eq!(result, 4);
            assert_eq!(done.output.to_vec(), [value], "its own answer");
        }
    }
    assert!(echoes.is_empty());
    let e = crashed.expect("the crashing call ends");
    assert_segfault(&e);
    drop(pipe);
    alloc.deallocate().unwrap();
}

/// A pipelined call past the client's invocation timeout ends with
/// `Timeout` while the others go on; its slot comes back once its late
/// answer has come.
#[rstest]
#[case::tcp("tcp")]
#[case::shm("shm")]
fn a_pipelined_call_past_its_timeout_ends_alone(#[case] provider: &str) {
    let d = daemon_for(provider);
    let client = Client::new(ClientOptions {
        invocation_timeout: Some(Duration::from_millis(100)),
        ..ClientOptions::with_provider(provider)
    });
    let alloc = client
        .allocate(&d.executor(), &token(&d), &spec().lanes(1).slots(2))
        .unwrap();
    let sleep = alloc.function("sleep_ms").unwrap();
    let mut pipe = alloc.pipeline::<u32, u32>().unwrap();
    let slow = pipe
        .submit(sleep, u32_input(&alloc, 400), 1, alloc.buffer(1).unwrap())
        .unwrap();
    let started = Instant::now();
    let done = pipe.wait_any().unwrap();
    assert_eq!(done.id, slow);
    assert!(
        matches!(done.result, Err(Error::Timeout { .. })),
        "{:?}",
        done.result
    );
    assert!(
        started.elapsed() < Duration::from_millis(400),
        "gave up at the timeout"
    );
    // One slot is still the late call's: the other takes a call (served
    // after the late one, on the lane's one thread), a third is refused.
    let queued = pipe
        .submit(sleep, u32_input(&alloc, 1), 1, alloc.buffer(1).unwrap())
        .unwrap();
    let refused = pipe
        .submit(sleep, u32_input(&alloc, 1), 1, alloc.buffer(1).unwrap())
        .unwrap_err();
    assert!(
        matches!(refused.error, Error::SlotsFull { .. }),
        "{:?}",
        refused.error
    );
    let done = pipe.wait_any().unwrap();
    assert_eq!(done.id, queued);
    assert!(
        matches!(done.result, Ok(4) | Err(Error::Timeout { .. })),
        "{:?}",
        done.result
    );
    let back = poll_for(Duration::from_secs(5), || {
        pipe.submit(sleep, u32_input(&alloc, 2), 1, alloc.buffer(1).unwrap())
            .ok()
    });
    assert!(back.is_some(), "the late call's slot came back");
    let done = pipe.wait_any().unwrap();
    assert_eq!(done.output.to_vec(), [2]);
    drop(pipe);
    alloc.deallocate().unwrap();
}

/// Slots are a power of two up to 64, checked before anything is sent.
#[test]
fn slots_out_of_range_are_refused_before_allocating() {
    let d = daemon();
    let client = Client::new(ClientOptions::with_provider("tcp"));
    for bad in [3, 12, 128] {
        let e = client
            .allocate(&d.executor(), &token(&d), &spec().slots(bad))
            .unwrap_err();
        assert!(
            matches!(&e, Error::InvalidArgument(m) if m.contains("slots")),
            "{bad}: {e:?}"
        );
    }
}

#[rstest]
#[case::tcp("tcp")]
#[case::shm("shm")]
#[ignore = "needs an RDMA device: scripts/test-verbs.sh runs it under Soft-RoCE"]
#[case::verbs(verbs())]
fn hot_then_warm_switches_and_keeps_working(#[case] provider: &str) {
    let d = daemon_for(provider);
    let spec = spec()
        .mode(Mode::HotThenWarm)
        .hot_timeout(Duration::from_millis(1500));
    let alloc = allocate(&d, provider, &spec);
    let pid = worker_pid(&d, alloc.id());
    let echo = alloc.function("echo").unwrap();
    let input = u32_input(&alloc, 42);
    let mut output = alloc.buffer::<u32>(1).unwrap();
    for round in 0..2 {
        assert_eq!(alloc.invoke(echo, &input, 1, &mut output).unwrap(), 4);
        assert_eq!(output.to_vec(), [42]);
        // Hot: the lane thread polls, so it runs.
        assert!(
            poll_for(Duration::from_secs(1), || thread_states(pid as u32)
                .contains(&'R')
                .then_some(()))
            .is_some(),
            "round {round}: no running thread after an invocation: {:?}",
            thread_states(pid as u32)
        );
        // Warm once the hot period is over: every thread sleeps.
        assert!(
            poll_for(Duration::from_secs(10), || {
                let s = thread_states(pid as u32);
                (!s.is_empty() && !s.contains(&'R')).then_some(())
            })
            .is_some(),
            "round {round}: still running long after the hot period: {:?}",
            thread_states(pid as u32)
        );
    }
}

#[rstest]
#[case::tcp("tcp")]
#[case::shm("shm")]
#[ignore = "needs an RDMA device: scripts/test-verbs.sh runs it under Soft-RoCE"]
#[case::verbs(verbs())]
fn cold_start_to_first_result(#[case] provider: &str) {
    let d = daemon_for(provider);
    let alloc = allocate(&d, provider, &spec().cores(2));
    let c = alloc.cold_start();
    assert!(c.round_trip > Duration::ZERO);
    assert!(c.connect_lanes > Duration::ZERO);
    assert!(c.total >= c.round_trip + c.connect_lanes, "{c:?}");
    assert!(c.round_trip >= c.load + c.listen, "{c:?}");
    assert!(c.load > Duration::ZERO, "{c:?}");
    let noop = alloc.function("noop").unwrap();
    let input = alloc.buffer::<u8>(0).unwrap();
    let mut output = alloc.buffer::<u8>(0).unwrap();
    assert_eq!(alloc.invoke(noop, &input, 0, &mut output).unwrap(), 0);
    assert!(alloc
        .functions()
        .iter()
        .map(String::as_str)
        .eq(FUNCTIONS.iter().copied()));
    assert!(matches!(alloc.function("nope"), Err(Error::UnknownFunction(f)) if f == "nope"));
}

#[rstest]
#[case::tcp("tcp")]
#[case::shm("shm")]
#[ignore = "needs an RDMA device: scripts/test-verbs.sh runs it under Soft-RoCE"]
#[case::verbs(verbs())]
fn async_invocations(#[case] provider: &str) {
    let d = daemon_for(provider);
    let alloc = allocate(&d, provider, &spec().cores(2));
    let sleep = alloc.function("sleep_ms").unwrap();
    let a_in = u32_input(&alloc, 100);
    let b_in = u32_input(&alloc, 50);
    let mut a_out = alloc.buffer::<u32>(1).unwrap();
    let mut b_out = alloc.buffer::<u32>(1).unwrap();
    for _ in 0..5 {
        let a = alloc.submit(sleep, &a_in, 1, &mut a_out).unwrap();
        let b = alloc.submit(sleep, &b_in, 1, &mut b_out).unwrap();
        assert_eq!(block_on(b).unwrap(), 4);
        assert_eq!(block_on(a).unwrap(), 4);
        assert_eq!(a_out.to_vec(), [100]);
        assert_eq!(b_out.to_vec(), [50]);
    }
    // Polled once as a future (handed to the helper), then waited for.
    let mut inv = alloc.submit(sleep, &a_in, 1, &mut a_out).unwrap();
    let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
    let first = std::pin::Pin::new(&mut inv).poll(&mut Context::from_waker(&waker));
    assert!(first.is_pending());
    assert_eq!(inv.get().unwrap(), 4);
}

#[rstest]
#[case::tcp("tcp")]
#[case::shm("shm")]
#[ignore = "needs an RDMA device: scripts/test-verbs.sh runs it under Soft-RoCE"]
#[case::verbs(verbs())]
fn dropped_invocations_leave_the_lane_usable(#[case] provider: &str) {
    let d = daemon_for(provider);
    let alloc = allocate(&d, provider, &spec());
    let sleep = alloc.function("sleep_ms").unwrap();
    let echo = alloc.function("echo").unwrap();
    let slow = u32_input(&alloc, 300);
    let mut out = alloc.buffer::<u32>(1).unwrap();
    drop(alloc.submit(sleep, &slow, 1, &mut out).unwrap());
    // The only lane still owes the dropped invocation's answer.
    let fast = u32_input(&alloc, 7);
    let mut other = alloc.buffer::<u32>(1).unwrap();
    assert!(matches!(
        alloc.submit(echo, &fast, 1, &mut other),
        Err(Error::AllLanesBusy)
    ));
    assert!(matches!(
        alloc.submit(echo, &fast, 1, &mut out),
        Err(Error::BufferBusy)
    ));
    // submit_wait drains it, and the late answer does not leak into this one.
    assert_eq!(
        alloc
            .submit_wait(echo, &fast, 1, &mut out)
            .unwrap()
            .get()
            .unwrap(),
        4
    );
    assert_eq!(out.to_vec(), [7]);

    // The same, abandoned while awaited as a future.
    let mut inv = alloc.submit(sleep, &slow, 1, &mut out).unwrap();
    let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
    assert!(std::pin::Pin::new(&mut inv)
        .poll(&mut Context::from_waker(&waker))
        .is_pending());
    drop(inv);
    assert_eq!(alloc.invoke(echo, &fast, 1, &mut other).unwrap(), 4);
    assert_eq!(other.to_vec(), [7]);

    // A buffer a late answer may still land in cannot be read until it
    // is reclaimed; reclaim waits for that answer.
    alloc.reclaim(&out, Duration::from_secs(60)).unwrap();
    out.write_from(0, &[0]);
    drop(alloc.submit_wait(sleep, &slow, 1, &mut out).unwrap());
    assert!(out.is_busy());
    let read = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| out.to_vec()[0]));
    let payload = read.unwrap_err();
    let msg = payload
        .downcast_ref::<&str>()
        .copied()
        .or(payload.downcast_ref::<String>().map(String::as_str))
        .unwrap();
    assert!(msg.contains("Allocation::reclaim"), "{msg}");
    alloc.reclaim(&out, Duration::from_secs(60)).unwrap();
    assert!(!out.is_busy());
    // Reclaimed once the late answer (sleep_ms echoes its input) is in.
    assert_eq!(out.to_vec(), [300]);
}

/// With read-only input promised, shm reads bulk payloads in place (a
/// function that writes to its input then faults); tcp still copies.
#[rstest]
#[case::tcp("tcp")]
#[case::shm("shm")]
#[ignore = "needs an RDMA device: scripts/test-verbs.sh runs it under Soft-RoCE"]
#[case::verbs(verbs())]
fn read_only_input_is_read_in_place_on_shm(#[case] provider: &str) {
    let d = daemon_for(provider);
    let spec = spec()
        .mode(Mode::Hot)
        .read_only_input(true)
        .input_capacity(4096)
        .output_capacity(3 << 20);
    let alloc = allocate(&d, provider, &spec);
    let echo = alloc.function("echo").unwrap();
    let mut input = alloc.buffer::<u8>(3 << 20).unwrap();
    let mut output = alloc.buffer::<u8>(3 << 20).unwrap();
    for (seed, n) in [100, 4064, 4065, 1 << 20, (3 << 20) - 7]
        .into_iter()
        .enumerate()
    {
        let data = pattern(n, seed as u32);
        input.write_from(0, &data);
        let got = alloc.invoke(echo, &input, n, &mut output).unwrap();
        assert_eq!(got, n);
        assert!(
            output.to_vec()[..n] == data[..],
            "echo of {n} bytes differs"
        );
    }
    // A function that writes to its (bulk) input breaks the promise.
    let scribble = alloc.function("fault_scribble_input").unwrap();
    let n = 1 << 20;
    let data = pattern(n, 99);
    input.write_from(0, &data);
    let result = alloc.invoke(scribble, &input, n, &mut output);
    if provider == "shm" {
        let err = result.unwrap_err();
        assert!(
            matches!(
                err,
                Error::WorkerCrashed {
                    signal: Some(11),
                    ..
                }
            ),
            "{err:?}"
        );
    } else {
        assert_eq!(result.unwrap(), n, "tcp copies: the input is the worker's");
        assert_eq!(output.to_vec()[0], input.to_vec()[0] ^ 1);
    }
    // The client's buffer is untouched either way.
    assert!(input.to_vec()[..n] == data[..]);
}

#[rstest]
#[case::tcp("tcp")]
#[case::shm("shm")]
#[ignore = "needs an RDMA device: scripts/test-verbs.sh runs it under Soft-RoCE"]
#[case::verbs(verbs())]
fn segfault_is_a_worker_crash(#[case] provider: &str) {
    let d = daemon_for(provider);
    let alloc = allocate(&d, provider, &spec());
    let f = alloc.function("fault_segfault").unwrap();
    let input = alloc.buffer::<u8>(0).unwrap();
    // Room for the signal, which the worker answers in band.
    let mut output = alloc.buffer::<u8>(4).unwrap();
    let err = alloc.invoke(f, &input, 0, &mut output).unwrap_err();
    assert!(
        matches!(
            err,
            Error::WorkerCrashed {
                signal: Some(11),
                cause: ExitCause::Crashed,
                ref message,
            } if message.contains("its worker answered")
        ),
        "{err:?}\n{}",
        d.log()
    );
    assert!(err.is_retryable());
    assert!(!alloc.is_alive());
    // Later calls fail at once with the same news.
    let echo = alloc.function("echo").unwrap();
    let err = alloc.invoke(echo, &input, 0, &mut output).unwrap_err();
    assert!(
        matches!(
            err,
            Error::WorkerCrashed {
                signal: Some(11),
                ..
            }
        ),
        "{err:?}"
    );
    alloc.deallocate().unwrap();
}

/// Under a cgroup v2 `memory.max` the kernel kills a worker past its
/// allocation's memory, and the executor says so; under `RLIMIT_AS` (this
/// build machine: cgroup v1) the function's `malloc` fails and `fault_hog`
/// aborts. scripts/test-verbs.sh sets `RFAAS_TEST_CGROUP_V2` in its VM,
/// which mounts cgroup v2, so the cgroup path is proven there.
#[rstest]
#[case::tcp("tcp")]
#[case::shm("shm")]
#[ignore = "needs an RDMA device: scripts/test-verbs.sh runs it under Soft-RoCE"]
#[case::verbs(verbs())]
fn a_function_past_the_memory_limit_ends_its_worker(#[case] provider: &str) {
    let d = daemon_for(provider);
    let cgroup = d
        .log()
        .contains("worker memory limits: cgroup v2 memory.max");
    if std::env::var_os("RFAAS_TEST_CGROUP_V2").is_some() {
        assert!(cgroup, "cgroup v2 limits expected here:\n{}", d.log());
    }
    let alloc = allocate(&d, provider, &spec());
    let hog = alloc.function("fault_hog").unwrap();
    let mut input = alloc.buffer::<u32>(1).unwrap();
    let mut output = alloc.buffer::<u8>(4).unwrap();
    // A sixteenth of the allocation's 256 MiB is fine (RLIMIT_AS counts
    // the worker's whole address space, so not much more is).
    input.write_from(0, &[16]);
    assert_eq!(alloc.invoke(hog, &input, 1, &mut output).unwrap(), 0);
    // Four times it is not.
    input.write_from(0, &[1024]);
    let err = alloc.invoke(hog, &input, 1, &mut output).unwrap_err();
    let expected = if cgroup {
        (ExitCause::OutOfMemory, libc::SIGKILL)
    } else {
        (ExitCause::Crashed, libc::SIGABRT)
    };
    match &err {
        Error::WorkerCrashed {
            signal: Some(sig),
            cause,
            message,
        } => {
            assert_eq!((*cause, *sig), expected, "{err:?}\n{}", d.log());
            if cgroup {
                assert!(message.contains("more than its 256 MiB"), "{message}");
            }
        }
        _ => panic!("{err:?}\n{}", d.log()),
    }
    assert!(err.is_retryable());
    // The daemon serves on, with the allocation's memory free again.
    d.wait_status(
        Duration::from_secs(10),
        |s| matches!(s, LocalReply::Status { allocations, .. } if allocations.is_empty()),
    );
    let again = allocate(&d, provider, &spec());
    let echo = again.function("echo").unwrap();
    let input = again.buffer::<u32>(1).unwrap();
    let mut output = again.buffer::<u8>(4).unwrap();
    assert_eq!(again.invoke(echo, &input, 1, &mut output).unwrap(), 4);
    again.deallocate().unwrap();
}

#[rstest]
#[case::tcp("tcp")]
#[case::shm("shm")]
#[ignore = "needs an RDMA device: scripts/test-verbs.sh runs it under Soft-RoCE"]
#[case::verbs(verbs())]
fn overrunning_the_output_crashes_the_worker(#[case] provider: &str) {
    let d = daemon_for(provider);
    let alloc = allocate(&d, provider, &spec().output_capacity(4096));
    let f = alloc.function("fault_overrun").unwrap();
    let input = u32_input(&alloc, 4096 + 8192);
    let mut output = alloc.buffer::<u8>(64 << 10).unwrap();
    let err = alloc.invoke(f, &input, 1, &mut output).unwrap_err();
    assert!(
        matches!(
            err,
            Error::WorkerCrashed {
                signal: Some(11),
                ..
            }
        ),
        "{err:?}\n{}",
        d.log()
    );
}

#[rstest]
#[case::tcp("tcp")]
#[case::shm("shm")]
#[ignore = "needs an RDMA device: scripts/test-verbs.sh runs it under Soft-RoCE"]
#[case::verbs(verbs())]
fn claiming_too_much_output_is_output_too_large(#[case] provider: &str) {
    let d = daemon_for(provider);
    let alloc = allocate(&d, provider, &spec().output_capacity(4096));
    let f = alloc.function("fault_claim").unwrap();
    let mut output = alloc.buffer::<u8>(64 << 10).unwrap();
    let input = u32_input(&alloc, 4097);
    let err = alloc.invoke(f, &input, 1, &mut output).unwrap_err();
    assert!(
        matches!(err, Error::FunctionFailed(InvocationStatus::OutputTooLarge)),
        "{err:?}"
    );
    assert!(!err.is_retryable());
    // Bounded by the client's buffer too.
    let mut small = alloc.buffer::<u8>(16).unwrap();
    let input = u32_input(&alloc, 17);
    let err = alloc.invoke(f, &input, 1, &mut small).unwrap_err();
    assert!(
        matches!(err, Error::FunctionFailed(InvocationStatus::OutputTooLarge)),
        "{err:?}"
    );
    // The worker lives on.
    let input = u32_input(&alloc, 4096);
    assert_eq!(alloc.invoke(f, &input, 1, &mut output).unwrap(), 4096);
}

#[rstest]
#[case::tcp("tcp")]
#[case::shm("shm")]
#[ignore = "needs an RDMA device: scripts/test-verbs.sh runs it under Soft-RoCE"]
#[case::verbs(verbs())]
fn running_past_the_deadline(#[case] provider: &str) {
    let d = daemon_for(provider);
    let alloc = allocate(&d, provider, &spec().deadline(Duration::from_millis(200)));
    assert_eq!(alloc.deadline(), Duration::from_millis(200));
    let f = alloc.function("sleep_ms").unwrap();
    let input = u32_input(&alloc, 5000);
    let mut output = alloc.buffer::<u32>(1).unwrap();
    let err = alloc.invoke(f, &input, 1, &mut output).unwrap_err();
    assert!(
        matches!(
            err,
            Error::FunctionFailed(InvocationStatus::DeadlineExceeded)
        ),
        "{err:?}\n{}",
        d.log()
    );
    assert!(!err.allocation_usable());
    assert_eq!(err.next(), Next::Fix);
    // The answer ended the allocation: the next call fails at once, with
    // the same cause, before anything is sent.
    assert!(!alloc.is_alive());
    let echo = alloc.function("echo").unwrap();
    let err = alloc.invoke(echo, &input, 1, &mut output).unwrap_err();
    assert!(
        matches!(
            err,
            Error::FunctionFailed(InvocationStatus::DeadlineExceeded)
        ),
        "{err:?}"
    );
    // The executor saw the worker end itself for its deadline.
    d.wait_status(
        Duration::from_secs(10),
        |s| matches!(s, LocalReply::Status { allocations, .. } if allocations.is_empty()),
    );
    assert!(
        d.log().contains("a function ran past its deadline"),
        "{}",
        d.log()
    );
}

#[rstest]
#[case::tcp("tcp")]
#[case::shm("shm")]
#[ignore = "needs an RDMA device: scripts/test-verbs.sh runs it under Soft-RoCE"]
#[case::verbs(verbs())]
fn killing_the_worker_is_a_crash_with_sigkill(#[case] provider: &str) {
    let d = daemon_for(provider);
    let alloc = allocate(&d, provider, &spec());
    let pid = worker_pid(&d, alloc.id());
    let f = alloc.function("sleep_ms").unwrap();
    let input = u32_input(&alloc, 10_000);
    let mut output = alloc.buffer::<u32>(1).unwrap();
    let inv = alloc.submit(f, &input, 1, &mut output).unwrap();
    wait_in_sleep_ms(pid as u32);
    kill(pid, libc::SIGKILL);
    let err = inv.get().unwrap_err();
    assert!(
        matches!(
            err,
            Error::WorkerCrashed {
                signal: Some(9),
                ..
            }
        ),
        "{err:?}\n{}",
        d.log()
    );
}

#[rstest]
#[case::tcp("tcp")]
#[case::shm("shm")]
#[ignore = "needs an RDMA device: scripts/test-verbs.sh runs it under Soft-RoCE"]
#[case::verbs(verbs())]
fn killing_the_executor_is_executor_lost(#[case] provider: &str) {
    let (d, _, err) = signal_the_executor_under_a_call(provider, libc::SIGKILL);
    assert!(
        matches!(err, Error::ExecutorLost { ref executor } if *executor == d.executor()),
        "{err:?}"
    );
    assert!(err.is_retryable());
}

/// Sends `signal` to a fresh executor while a call of an allocation on it
/// is inside its function; returns the executor, the allocation and the
/// call's error.
fn signal_the_executor_under_a_call(provider: &str, signal: i32) -> (Executord, Allocation, Error) {
    let d = daemon_for(provider);
    let alloc = allocate(&d, provider, &spec());
    let f = alloc.function("sleep_ms").unwrap();
    let input = u32_input(&alloc, 10_000);
    let mut output = alloc.buffer::<u32>(1).unwrap();
    let inv = alloc.submit(f, &input, 1, &mut output).unwrap();
    wait_in_sleep_ms(worker_pid(&d, alloc.id()) as u32);
    kill(d.pid() as i32, signal);
    let err = inv.get().unwrap_err();
    (d, alloc, err)
}

#[rstest]
#[case::tcp("tcp")]
#[case::shm("shm")]
#[ignore = "needs an RDMA device: scripts/test-verbs.sh runs it under Soft-RoCE"]
#[case::verbs(verbs())]
fn stopping_the_executor_is_executor_stopped(#[case] provider: &str) {
    // What systemd does to stop the daemon.
    let (d, alloc, err) = signal_the_executor_under_a_call(provider, libc::SIGTERM);
    let executor = d.executor();
    assert!(
        matches!(err, Error::ExecutorStopped { executor: ref e } if *e == executor),
        "{err:?}\n{}",
        d.log()
    );
    let text = err.to_string();
    assert!(
        text.contains("is shutting down")
            && text.contains("on another executor if it does not come back"),
        "{text}"
    );
    assert!(
        !text.contains("retrieved"),
        "a shutdown is no drain: {text}"
    );
    assert!(err.is_retryable());
    assert!(!err.allocation_usable());
    assert_eq!(err.next(), Next::Elsewhere);
    // Later calls fail at once with the same news.
    let echo = alloc.function("echo").unwrap();
    let input = u32_input(&alloc, 1);
    let mut output = alloc.buffer::<u32>(1).unwrap();
    let err = alloc.invoke(echo, &input, 1, &mut output).unwrap_err();
    assert!(matches!(err, Error::ExecutorStopped { .. }), "{err:?}");
}

#[rstest]
#[case::tcp("tcp")]
#[case::shm("shm")]
#[ignore = "needs an RDMA device: scripts/test-verbs.sh runs it under Soft-RoCE"]
#[case::verbs(verbs())]
fn invoke_retrying_recovers_on_a_new_worker(#[case] provider: &str) {
    let d = daemon_for(provider);
    let mut alloc = allocate(&d, provider, &spec());
    let first = alloc.id();
    let echo = alloc.function("echo").unwrap();
    let input = u32_input(&alloc, 0xabcd);
    let mut output = alloc.buffer::<u32>(1).unwrap();
    // Kill the worker, then call: the first attempt fails, the retry
    // allocates again and succeeds with the same buffers.
    kill(worker_pid(&d, first), libc::SIGKILL);
    let n = alloc
        .invoke_retrying(echo, &input, 1, &mut output, 3)
        .unwrap_or_else(|e| panic!("{e}\n{}", d.log()));
    assert_eq!(n, 4);
    assert_eq!(output.to_vec(), [0xabcd]);
    assert_ne!(alloc.id(), first);
    assert!(alloc.is_alive());

    // A function that crashes crashes again: retries run out.
    let crash = alloc.function("fault_segfault").unwrap();
    let err = alloc
        .invoke_retrying(crash, &input, 0, &mut output, 1)
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::WorkerCrashed {
                signal: Some(11),
                ..
            }
        ),
        "{err:?}"
    );
    // Not retryable: returned at once.
    let claim = alloc.function("fault_claim").unwrap();
    let huge = u32_input(&alloc, u32::MAX);
    let before = alloc.id();
    let err = alloc.invoke_retrying(claim, &huge, 1, &mut output, 3);
    // The previous crash left the allocation dead: one re-allocation, then
    // the non-retryable answer.
    assert!(
        matches!(
            err,
            Err(Error::FunctionFailed(InvocationStatus::OutputTooLarge))
        ),
        "{err:?}"
    );
    assert_ne!(alloc.id(), before);
    alloc.deallocate().unwrap();
}

#[test]
fn invoke_retrying_moves_to_a_fallback_executor() {
    let first = daemon();
    let second = Executord::start(
        &daemon_binary(),
        ExecutordOptions {
            node_name: "node-b".into(),
            ..tls_options()
        },
    );
    let fallback = second.executor();
    let spec = spec().fallback_executor(&fallback, &token(&second));
    let mut alloc = allocate(&first, "tcp", &spec);
    assert_eq!(alloc.node(), first.node_name());
    assert_eq!(alloc.moves(), 0);
    let echo = alloc.function("echo").unwrap();
    let input = u32_input(&alloc, 99);
    let mut output = alloc.buffer::<u32>(1).unwrap();
    assert_eq!(alloc.invoke(echo, &input, 1, &mut output).unwrap(), 4);
    kill(first.pid() as i32, libc::SIGKILL);
    wait_until(
        "the allocation to see its executor gone",
        Duration::from_secs(10),
        || !alloc.is_alive(),
    );
    let n = alloc
        .invoke_retrying(echo, &input, 1, &mut output, 2)
        .unwrap_or_else(|e| panic!("{e}\n{}", second.log()));
    assert_eq!(n, 4);
    assert_eq!(output.to_vec(), [99]);
    assert_eq!(alloc.executor(), fallback);
    assert_eq!(alloc.node(), "node-b");
    assert_eq!(alloc.moves(), 1);
    alloc.deallocate().unwrap();
}

/// A client thread that spins on the CPU its hot worker is pinned to waits
/// for the scheduler on every call; the library notices (the thread gets
/// far less than its CPU while it spins) and sleeps instead.
#[test]
fn spinning_on_the_workers_cpu_turns_to_sleeping() {
    let cpu = cpus::allowed()[0];
    let opts = ExecutordOptions {
        cpus: cpu.to_string(),
        pin: true,
        ..tls_options()
    };
    let d = Executord::start(&daemon_binary(), opts);
    let token = d.token("nobody", 1, 512, Duration::from_secs(600));
    let addr = d.executor();
    std::thread::spawn(move || {
        cpus::pin_this_thread(cpu);
        let client = Client::new(ClientOptions::with_provider("tcp"));
        let alloc = client
            .allocate(&addr, &token, &spec().mode(Mode::Hot))
            .unwrap_or_else(|e| panic!("{e}"));
        let echo = alloc.function("echo").unwrap();
        let input = u32_input(&alloc, 7);
        let mut output = alloc.buffer::<u32>(1).unwrap();
        assert!(!rfaas_client::spin_sleeps());
        let mut calls = 0;
        while !rfaas_client::spin_sleeps() && calls < 500 {
            let n = alloc.submit(echo, &input, 1, &mut output).unwrap().spin();
            assert_eq!(n.unwrap(), 4);
            calls += 1;
        }
        assert!(
            rfaas_client::spin_sleeps(),
            "{calls} spins on the worker's CPU went unnoticed"
        );
        // It answers on, sleeping.
        output.write_from(0, &[0]);
        let n = alloc.submit(echo, &input, 1, &mut output).unwrap().spin();
        assert_eq!((n.unwrap(), output.to_vec()[0]), (4, 7));
    })
    .join()
    .unwrap();
}

/// The number right after `before` in `text`.
fn figure(text: &str, before: &str) -> u32 {
    let at = text
        .find(before)
        .unwrap_or_else(|| panic!("{before:?} not in {text:?}"));
    let digits: String = text[at + before.len()..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits
        .parse()
        .unwrap_or_else(|_| panic!("no figure after {before:?} in {text:?}"))
}

/// The memory figures that once came back as malformed_library, a
/// retryable internal error, a crash or payload_too_large without numbers
/// (1, 4 and 8 MiB with a 32 MiB input, 16 to 32 MiB): each is one clear
/// refusal, from the client's own check or the executor, that gives the
/// figure needed, and the figure is enough.
#[rstest]
#[case::tcp("tcp")]
#[case::shm("shm")]
#[ignore = "needs an RDMA device: scripts/test-verbs.sh runs it under Soft-RoCE"]
#[case::verbs(verbs())]
fn too_little_memory_is_one_clear_refusal_with_the_figure(#[case] provider: &str) {
    let d = daemon_for(provider);
    let client = Client::new(ClientOptions::with_provider(provider));
    let addr = d.executor();
    let spec = |mib: u32| spec().memory_mib(mib);

    // 1 MiB cannot hold even the buffers: the client says so without asking.
    let err = client.allocate(&addr, &token(&d), &spec(1)).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err:?}");
    assert!(
        err.to_string().contains("memory_mib 1 cannot hold"),
        "{err}"
    );

    // 4, 8 and 16 MiB: the executor refuses memory_too_small with the
    // figure, the same for each.
    let mut needed = 0;
    for mib in [4, 8, 16] {
        let err = client.allocate(&addr, &token(&d), &spec(mib)).unwrap_err();
        let Error::Refused {
            code: ErrorCode::MemoryTooSmall,
            message,
        } = &err
        else {
            panic!("{mib} MiB: {err:?}\n{}", d.log());
        };
        assert!(!err.is_retryable());
        assert!(
            message.contains("for the worker process itself"),
            "{message}"
        );
        let n = figure(message, "ask for memory_mib ");
        assert!(needed == 0 || n == needed, "{message}");
        needed = n;
    }
    assert!(needed > 16, "{needed}");

    // With the figure the worker serves...
    let alloc = client
        .allocate(&addr, &token(&d), &spec(needed))
        .unwrap_or_else(|e| panic!("{e}\n{}", d.log()));
    let echo = alloc.function("echo").unwrap();
    let input = u32_input(&alloc, 7);
    let mut out = alloc.buffer::<u8>(4).unwrap();
    assert_eq!(alloc.invoke(echo, &input, 1, &mut out).unwrap(), 4);
    drop(alloc);

    // ...but a 32 MiB input does not fit what 24 or 32 MiB leave: the
    // client says so before sending, with the figure that does.
    let mut figures = Vec::new();
    for mib in [24, 32] {
        let alloc = client.allocate(&addr, &token(&d), &spec(mib)).unwrap();
        let noop = alloc.function("noop").unwrap();
        let big = alloc.buffer::<u8>(32 << 20).unwrap();
        let mut out = alloc.buffer::<u8>(4).unwrap();
        let err = alloc.invoke(noop, &big, 32 << 20, &mut out).unwrap_err();
        assert!(
            matches!(err, Error::InvalidArgument(_)),
            "{mib} MiB: {err:?}"
        );
        figures.push(figure(&err.to_string(), "allocate with memory_mib "));
    }
    // The figure is enough for it.
    let mib = figures[0];
    assert_eq!(figures[0], figures[1], "{figures:?}");
    let alloc = client
        .allocate(&addr, &token(&d), &spec(mib))
        .unwrap_or_else(|e| panic!("{e}\n{}", d.log()));
    let noop = alloc.function("noop").unwrap();
    let big = alloc.buffer::<u8>(32 << 20).unwrap();
    let mut out = alloc.buffer::<u8>(4).unwrap();
    alloc
        .invoke(noop, &big, 32 << 20, &mut out)
        .unwrap_or_else(|e| panic!("{mib} MiB with a 32 MiB input: {e}\n{}", d.log()));
    alloc.deallocate().unwrap();
}

/// The executor's memory figure for four lanes is enough for all four to
/// serve at once.
#[rstest]
#[case::tcp("tcp")]
#[case::shm("shm")]
#[ignore = "needs an RDMA device: scripts/test-verbs.sh runs it under Soft-RoCE"]
#[case::verbs(verbs())]
fn the_memory_figure_serves_every_lane(#[case] provider: &str) {
    let d = daemon_for(provider);
    let client = Client::new(ClientOptions::with_provider(provider));
    let addr = d.executor();
    let spec = spec().cores(4).memory_mib(8);
    let err = client.allocate(&addr, &token(&d), &spec).unwrap_err();
    let Error::Refused {
        code: ErrorCode::MemoryTooSmall,
        message,
    } = &err
    else {
        panic!("{err:?}")
    };
    let needed = figure(message, "ask for memory_mib ");
    let alloc = client
        .allocate(&addr, &token(&d), &spec.memory_mib(needed))
        .unwrap_or_else(|e| panic!("{e}\n{}", d.log()));
    let echo = alloc.function("echo").unwrap();
    let input = u32_input(&alloc, 9);
    let mut outs: Vec<_> = (0..4)
        .map(|_| alloc.buffer::<u8>(1 << 20).unwrap())
        .collect();
    let calls: Vec<_> = outs
        .iter_mut()
        .map(|o| alloc.submit(echo, &input, 1, o).unwrap())
        .collect();
    for c in calls {
        assert_eq!(c.get().unwrap(), 4);
    }
}

#[test]
fn refusals_are_typed() {
    let d = daemon();
    let client = Client::new(ClientOptions::with_provider("tcp"));
    let addr = d.executor();
    let mut claims = d.claims("nobody", 4, 2048, Duration::from_secs(600));
    let good = d.mint(&claims);
    claims.cores = 64;
    let forged = format!("{}x", d.mint(&claims));
    let err = client.allocate(&addr, &forged, &spec()).unwrap_err();
    assert!(
        matches!(
            err,
            Error::Refused {
                code: ErrorCode::TokenForged | ErrorCode::TokenMalformed,
                ..
            }
        ),
        "{err:?}"
    );
    assert!(!err.is_retryable());
    let err = client.allocate(&addr, &good, &spec().cores(5)).unwrap_err();
    assert!(
        matches!(
            err,
            Error::Refused {
                code: ErrorCode::ExceedsLease,
                ..
            }
        ),
        "{err:?}"
    );
    let bad = AllocationSpec::new(c_library_bytes(), &["echo", "no_such_symbol"]);
    let err = client.allocate(&addr, &good, &bad).unwrap_err();
    assert!(
        matches!(
            err,
            Error::Refused {
                code: ErrorCode::UnknownFunction,
                ..
            }
        ),
        "{err:?}"
    );
    // The cached connection still serves.
    let alloc = client.allocate(&addr, &good, &spec()).unwrap();
    assert_eq!(alloc.cold_start().connect_control, Duration::ZERO);
    alloc.deallocate().unwrap();
}

struct Unpark(std::thread::Thread);

impl Wake for Unpark {
    fn wake(self: Arc<Self>) {
        self.0.unpark();
    }
}

/// Runs a future to completion on this thread.
fn block_on<F: Future>(f: F) -> F::Output {
    let mut f = std::pin::pin!(f);
    let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = Context::from_waker(&waker);
    loop {
        if let Poll::Ready(v) = f.as_mut().poll(&mut cx) {
            return v;
        }
        std::thread::park_timeout(Duration::from_secs(1));
    }
}

/// Milliseconds from now until Unix second `at`.
fn ms_until(at: u64) -> u64 {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap();
    (Duration::from_secs(at).saturating_sub(now)).as_millis() as u64
}

/// A lease renewed before it ends keeps its allocation serving past the
/// old end: the daemon does not stop the worker then, and the worker does
/// not refuse calls (without the renewal both happen, as
/// `an_expired_lease_stops_its_worker` in the executor's tests shows).
#[test]
fn a_renewed_lease_serves_past_its_old_end() {
    let d = daemon();
    let short = d.claims("nobody", 1, 2048, Duration::from_secs(3));
    let client = Client::new(ClientOptions::with_provider("tcp"));
    let mut alloc = client
        .allocate(&d.executor(), &d.mint(&short), &spec())
        .unwrap_or_else(|e| panic!("allocation failed: {e}\ndaemon log:\n{}", d.log()));
    assert_eq!(alloc.expires_at(), short.expires_at);

    let mut renewed = short.clone();
    renewed.expires_at = short.expires_at + 600;
    let new_end = alloc.renew(&d.mint(&renewed)).unwrap();
    assert_eq!(new_end, renewed.expires_at);
    assert_eq!(alloc.expires_at(), renewed.expires_at);

    // One call that runs across the old end (the lease ticker looks every
    // second), then calls that start after it.
    let sleep = alloc.function("sleep_ms").unwrap();
    let across = u32_input(&alloc, (ms_until(short.expires_at) + 1200) as u32);
    let mut out = alloc.buffer::<u32>(1).unwrap();
    alloc
        .invoke(sleep, &across, 1, &mut out)
        .unwrap_or_else(|e| panic!("{e}\ndaemon log:\n{}", d.log()));
    assert_eq!(ms_until(short.expires_at), 0, "the old end has passed");
    let echo = alloc.function("echo").unwrap();
    for v in 0..3 {
        let input = u32_input(&alloc, v);
        let n = alloc
            .invoke(echo, &input, 1, &mut out)
            .unwrap_or_else(|e| panic!("{e}\ndaemon log:\n{}", d.log()));
        assert_eq!((n, out.to_vec()[0]), (4, v));
    }
    assert!(alloc.is_alive());
    alloc.deallocate().unwrap();
}

/// A renewal the executor must refuse leaves the allocation as it was.
#[test]
fn a_renewal_for_another_lease_is_refused_and_the_allocation_goes_on() {
    let d = daemon();
    let claims = d.claims("nobody", 1, 2048, Duration::from_secs(600));
    let client = Client::new(ClientOptions::with_provider("tcp"));
    let mut alloc = client
        .allocate(&d.executor(), &d.mint(&claims), &spec())
        .unwrap_or_else(|e| panic!("allocation failed: {e}\ndaemon log:\n{}", d.log()));
    let end = alloc.expires_at();

    // Another lease (a fresh id), ending later.
    let mut other = d.claims("nobody", 1, 2048, Duration::from_secs(1200));
    assert_ne!(other.lease_id, claims.lease_id);
    other.expires_at = end + 600;
    let err = alloc.renew(&d.mint(&other)).unwrap_err();
    assert!(
        matches!(&err, Error::Refused { code: ErrorCode::LeaseMismatch, message }
            if message.contains(&other.lease_id.to_string())),
        "{err:?}"
    );
    // This lease, but ending earlier.
    let mut shorter = claims.clone();
    shorter.expires_at = end - 60;
    let err = alloc.renew(&d.mint(&shorter)).unwrap_err();
    assert!(
        matches!(&err, Error::Refused { code: ErrorCode::LeaseMismatch, message }
            if message.contains("cannot shorten")),
        "{err:?}"
    );
    // This lease, later, but signed with another key.
    let mut later = claims.clone();
    later.expires_at = end + 600;
    let err = alloc.renew(&d.mint_with_another_key(&later)).unwrap_err();
    assert!(
        matches!(
            err,
            Error::Refused {
                code: ErrorCode::TokenForged,
                ..
            }
        ),
        "{err:?}"
    );

    assert_eq!(alloc.expires_at(), end);
    assert!(alloc.is_alive());
    let echo = alloc.function("echo").unwrap();
    let input = u32_input(&alloc, 7);
    let mut out = alloc.buffer::<u32>(1).unwrap();
    assert_eq!(alloc.invoke(echo, &input, 1, &mut out).unwrap(), 4);
    assert_eq!(out.to_vec()[0], 7);
    // And the good renewal still goes through afterwards.
    assert_eq!(alloc.renew(&d.mint(&later)).unwrap(), later.expires_at);
    alloc.deallocate().unwrap();
}

/// A daemon for `provider` whose workers outlive it.
fn outliving_daemon(provider: &str) -> Executord {
    assert!(!provider.starts_with("verbs:") || std::env::var("RDMA_VM_IP").is_ok());
    let mut opts = tls_options();
    opts.outlive_workers = true;
    if provider.starts_with("verbs:") {
        opts.providers = vec![provider.to_owned()];
        opts.fabric_host = std::env::var("RDMA_VM_IP").expect("RDMA_VM_IP");
    }
    Executord::start(&daemon_binary(), opts)
}

fn process_runs(pid: i32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
        && !std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
            s.rsplit_once(')')
                .is_some_and(|(_, r)| r.trim_start().starts_with('Z'))
        })
}

/// The daemon's figures for `lease` (its `usage` view).
fn lease_usage(d: &Executord, lease: u64) -> LeaseUsage {
    match d.local(LocalRequest::Usage {
        lease_id: Some(lease),
    }) {
        LocalReply::Usage { mut leases, .. } if leases.len() == 1 => leases.remove(0),
        other => panic!("no figures for lease {lease}: {other:?}\n{}", d.log()),
    }
}

#[rstest]
#[case::tcp_term("tcp", libc::SIGTERM)]
#[case::tcp_kill("tcp", libc::SIGKILL)]
#[case::shm_term("shm", libc::SIGTERM)]
#[case::shm_kill("shm", libc::SIGKILL)]
#[ignore = "needs an RDMA device: scripts/test-verbs.sh runs it under Soft-RoCE"]
#[case::verbs_kill(verbs(), libc::SIGKILL)]
fn restarting_the_executor_keeps_calls_running(#[case] provider: &str, #[case] signal: i32) {
    let mut d = outliving_daemon(provider);
    let alloc = allocate(&d, provider, &spec());
    // The worker's assignment came before this.
    let assigned = Instant::now();
    let pid = worker_pid(&d, alloc.id());
    let f = alloc.function("sleep_ms").unwrap();
    let input = u32_input(&alloc, 1500);
    let mut output = alloc.buffer::<u32>(1).unwrap();
    let inv = alloc.submit(f, &input, 1, &mut output).unwrap();
    wait_in_sleep_ms(pid as u32);
    // An upgrade's restart (SIGTERM) or a crash (SIGKILL) mid-call.
    d.restart(signal);
    let n = inv
        .get()
        .unwrap_or_else(|e| panic!("the call failed: {e}\n{}", d.log()));
    assert_eq!(n, 4);
    assert_eq!(output.to_vec(), [1500]);
    // The new daemon adopted the worker and the client attached to it.
    assert_eq!(worker_pid(&d, alloc.id()), pid);
    // Its figures go on from the assignment, not from the adoption: the
    // memory is billed for the whole time, the call once.
    let elapsed = assigned.elapsed();
    let u = lease_usage(&d, alloc.lease_id());
    assert_eq!(u.usage.invocations, 1, "{u:?}\n{}", d.log());
    assert!(
        u.usage.alloc_mib_ms >= 256 * elapsed.as_millis() as u64,
        "{} MiB ms billed for {elapsed:?} of 256 MiB: {u:?}\n{}",
        u.usage.alloc_mib_ms,
        d.log()
    );
    assert_eq!(u.allocations, 1, "{u:?}");
    poll_for(Duration::from_secs(30), || {
        d.log()
            .contains("a client attached to an adopted allocation")
            .then_some(())
    })
    .unwrap_or_else(|| panic!("the client did not attach\n{}", d.log()));
    // A second call works, and the allocation is usable.
    let echo = alloc.function("echo").unwrap();
    let input = u32_input(&alloc, 77);
    let n = alloc
        .invoke(echo, &input, 1, &mut output)
        .unwrap_or_else(|e| panic!("{e}\n{}", d.log()));
    assert_eq!(n, 4);
    assert_eq!(output.to_vec(), [77]);
    assert!(alloc.is_alive());
    assert_eq!(lease_usage(&d, alloc.lease_id()).usage.invocations, 2);
    // Deallocating through the new daemon leaves no process.
    drop(alloc);
    poll_for(Duration::from_secs(30), || {
        (!process_runs(pid)).then_some(())
    })
    .unwrap_or_else(|| panic!("worker {pid} outlived its deallocation\n{}", d.log()));
    poll_for(Duration::from_secs(30), || {
        d.recorded_workers().is_empty().then_some(())
    })
    .unwrap_or_else(|| panic!("its runtime record outlived it\n{}", d.log()));
}

#[rstest]
#[case::tcp("tcp")]
#[case::shm("shm")]
fn a_worker_no_daemon_adopts_ends_at_its_leases_end(#[case] provider: &str) {
    let mut d = outliving_daemon(provider);
    let client = Client::new(ClientOptions::with_provider(provider));
    let token = d.token("nobody", 4, 2048, Duration::from_secs(4));
    let alloc = client
        .allocate(&d.executor(), &token, &spec())
        .unwrap_or_else(|e| panic!("{e}\n{}", d.log()));
    let pid = worker_pid(&d, alloc.id());
    d.kill();
    // Still serving without a daemon...
    let echo = alloc.function("echo").unwrap();
    let input = u32_input(&alloc, 5);
    let mut output = alloc.buffer::<u32>(1).unwrap();
    alloc
        .invoke(echo, &input, 1, &mut output)
        .unwrap_or_else(|e| panic!("{e}\n{}", d.log()));
    assert_eq!(output.to_vec(), [5]);
    assert!(process_runs(pid));
    // ...until its lease's end.
    poll_for(Duration::from_secs(30), || {
        (!process_runs(pid)).then_some(())
    })
    .unwrap_or_else(|| panic!("worker {pid} outlived its lease\n{}", d.log()));
    assert!(
        d.log()
            .contains("the lease ended and no daemon adopted the worker"),
        "{}",
        d.log()
    );
}

#[test]
fn a_client_gives_its_allocations_up_after_its_reattach_grace() {
    let mut d = outliving_daemon("tcp");
    let mut opts = ClientOptions::with_provider("tcp");
    opts.reattach_grace = Duration::from_millis(200);
    let alloc = Client::new(opts)
        .allocate(&d.executor(), &token(&d), &spec())
        .unwrap_or_else(|e| panic!("{e}\n{}", d.log()));
    // No daemon comes back: the allocation is lost once the grace is over
    // (with the default 30 s it would still be waiting).
    d.kill();
    poll_for(Duration::from_secs(10), || {
        (!alloc.is_alive()).then_some(())
    })
    .expect("the allocation outlived the client's reattach grace");
}

#[test]
fn an_adopted_allocation_no_client_attaches_ends_after_the_attach_grace() {
    let mut d = Executord::start(
        &daemon_binary(),
        ExecutordOptions {
            outlive_workers: true,
            extra_config: "attach_grace_s = 1\n".into(),
            ..ExecutordOptions::default()
        },
    );
    // A peer that never attaches again.
    let (conn, ok) = d
        .allocate_raw(&c_library_bytes())
        .unwrap_or_else(|e| panic!("{e}\n{}", d.log()));
    let pid = worker_pid(&d, ok.allocation_id);
    d.restart(libc::SIGKILL);
    drop(conn);
    assert_eq!(worker_pid(&d, ok.allocation_id), pid, "adopted");
    // Ended after one second, not the default 60.
    poll_for(Duration::from_secs(30), || {
        (!process_runs(pid)).then_some(())
    })
    .unwrap_or_else(|| panic!("worker {pid} outlived the attach grace\n{}", d.log()));
    assert!(
        d.log()
            .contains("no client attached to these adopted allocations in time"),
        "{}",
        d.log()
    );
}

#[test]
fn a_slurm_take_back_and_a_deallocation_end_adopted_allocations_and_leave_no_process() {
    let mut d = outliving_daemon("tcp");
    let taken = allocate(&d, "tcp", &spec());
    let freed = allocate(&d, "tcp", &spec());
    let (taken_pid, freed_pid) = (worker_pid(&d, taken.id()), worker_pid(&d, freed.id()));
    d.restart(libc::SIGKILL);
    poll_for(Duration::from_secs(30), || {
        (d.log()
            .matches("a client attached to an adopted allocation")
            .count()
            == 2)
            .then_some(())
    })
    .unwrap_or_else(|| panic!("the client did not attach both\n{}", d.log()));
    assert_eq!(worker_pid(&d, taken.id()), taken_pid);

    // Deallocated through the new daemon.
    freed
        .deallocate()
        .unwrap_or_else(|e| panic!("{e}\n{}", d.log()));
    poll_for(Duration::from_secs(30), || {
        (!process_runs(freed_pid)).then_some(())
    })
    .unwrap_or_else(|| panic!("worker {freed_pid} outlived its deallocation\n{}", d.log()));

    // Taken back for a Slurm job (what the plugin's prolog asks).
    let reply = d.local(LocalRequest::SlurmRetrieve {
        job_id: 7,
        cpus: 0,
        grace_ms: 0,
    });
    assert!(
        matches!(&reply, LocalReply::Done { message } if message.contains("taken back for Slurm job 7")),
        "{reply:?}\n{}",
        d.log()
    );
    poll_for(Duration::from_secs(30), || {
        (!process_runs(taken_pid)).then_some(())
    })
    .unwrap_or_else(|| panic!("worker {taken_pid} outlived the take-back\n{}", d.log()));
    poll_for(Duration::from_secs(30), || {
        (!taken.is_alive()).then_some(())
    })
    .expect("the client heard of the take-back");
    poll_for(Duration::from_secs(30), || {
        d.recorded_workers().is_empty().then_some(())
    })
    .unwrap_or_else(|| panic!("runtime records outlived their workers\n{}", d.log()));
}

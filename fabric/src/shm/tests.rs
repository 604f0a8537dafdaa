//! Unit tests of the shm provider, through the public API. The
//! cross-provider conformance suite lives in `fabric/tests/`.

use std::io::Write as _;
use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use rstest::rstest;

use rfaas_testkit::wait::{thread_id, wait_until_asleep};

use crate::testing::{
    assert_no_completion, at, connect_pair, pattern, rerun_test, wait_one, KillOnDrop, Pair,
    TIMEOUT,
};
use crate::{
    Access, Completion, CompletionQueue, Endpoint, EndpointOptions, Error, Fabric, Listener,
    MemoryRegion, Opcode, RemoteAddr, Status,
};

fn fabric() -> Fabric {
    Fabric::open("shm").expect("the shm provider opens")
}

fn pair() -> Pair {
    Pair::with("shm", &EndpointOptions::default(), 256)
}

#[rstest]
#[case(1, 0, 0)]
#[case(7, 3, 5)]
#[case(64, 1, 63)]
#[case(4095, 1, 2)]
#[case(4096, 0, 0)]
#[case(4097, 13, 4093)]
#[case(65539, 4093, 7)]
fn write_then_read_is_byte_exact(
    #[case] len: usize,
    #[case] local_off: usize,
    #[case] remote_off: usize,
) {
    let mut p = pair();
    let size = 80 * 1024;
    let mut src = p.domain.register(size, Access::LOCAL).unwrap();
    let sink = p.domain.register(size, Access::LOCAL).unwrap();
    let target = p
        .target_domain
        .register(size, Access::REMOTE_WRITE | Access::REMOTE_READ)
        .unwrap();
    let data = pattern(len, 7);
    src.write_from(local_off, &data);

    p.ep.write(1, &src, local_off, len, at(&target, remote_off as u64))
        .unwrap();
    assert_eq!(
        wait_one(&mut p.cq),
        Completion::ok(1, Opcode::Write, len as u32)
    );
    let t = target.read_to_vec(..);
    assert_eq!(&t[remote_off..remote_off + len], &data[..]);
    assert!(
        t[..remote_off].iter().all(|&b| b == 0),
        "bytes before the write changed"
    );
    assert!(
        t[remote_off + len..].iter().all(|&b| b == 0),
        "bytes after the write changed"
    );

    let back = 11;
    p.ep.read(2, &sink, back, len, at(&target, remote_off as u64))
        .unwrap();
    assert_eq!(
        wait_one(&mut p.cq),
        Completion::ok(2, Opcode::Read, len as u32)
    );
    assert_eq!(sink.read_to_vec(back..back + len), data);
    assert_no_completion(&mut p.target_cq);
}

#[test]
fn immediates_arrive_in_order_with_their_lengths() {
    let mut p = pair();
    let src = p.domain.register(4096, Access::LOCAL).unwrap();
    let target = p
        .target_domain
        .register(4096, Access::REMOTE_WRITE)
        .unwrap();
    for i in 0..64u64 {
        p.target.post_recv(1000 + i).unwrap();
    }
    for i in 0..64u32 {
        p.ep.write_with_imm(u64::from(i), &src, 0, i as usize + 1, at(&target, 0), i * 3)
            .unwrap();
    }
    let mut out = [Completion::EMPTY; 100];
    let mut got = Vec::new();
    while got.len() < 64 {
        let n = p.target_cq.wait(&mut out, TIMEOUT).unwrap();
        assert!(n > 0, "receives missing");
        got.extend_from_slice(&out[..n]);
    }
    for (i, c) in got.iter().enumerate() {
        let i = i as u32;
        assert_eq!(
            *c,
            Completion {
                wr_id: 1000 + u64::from(i),
                opcode: Opcode::RecvWithImm,
                status: Status::Success,
                imm: i * 3,
                byte_len: i + 1,
            }
        );
    }
    for i in 0..64u32 {
        assert_eq!(
            wait_one(&mut p.cq),
            Completion::ok(u64::from(i), Opcode::WriteWithImm, i + 1)
        );
    }
}

#[test]
fn immediates_wait_for_receives_and_a_full_ring_refuses_before_copying() {
    let opts = EndpointOptions {
        recv_depth: 16,
        ..EndpointOptions::default()
    };
    let mut p = Pair::with("shm", &opts, 256);
    let mut src = p.domain.register(4096, Access::LOCAL).unwrap();
    src.fill(.., 0xAB);
    let target = p
        .target_domain
        .register(4096, Access::REMOTE_WRITE)
        .unwrap();
    for i in 0..16u32 {
        p.ep.write_with_imm(u64::from(i), &src, 0, 8, at(&target, 0), i)
            .unwrap();
    }
    // Nothing is posted at b: the notifications wait, the 17th does not fit.
    let err =
        p.ep.write_with_imm(99, &src, 0, 100, at(&target, 1000), 99)
            .unwrap_err();
    assert!(matches!(err, Error::QueueFull { depth: 16, .. }), "{err}");
    assert!(
        target.read_to_vec(1000..1100).iter().all(|&b| b == 0),
        "a refused write copied bytes"
    );
    assert_no_completion(&mut p.target_cq);

    for i in 0..16u64 {
        p.target.post_recv(i).unwrap();
    }
    for i in 0..16u32 {
        let c = wait_one(&mut p.target_cq);
        assert_eq!(
            (c.wr_id, c.imm, c.status),
            (u64::from(i), i, Status::Success)
        );
    }
    p.ep.write_with_imm(99, &src, 0, 100, at(&target, 1000), 99)
        .unwrap();
    p.target.post_recv(16).unwrap();
    let c = wait_one(&mut p.target_cq);
    assert_eq!((c.wr_id, c.imm, c.byte_len), (16, 99, 100));
}

#[test]
fn fetch_add_from_four_threads_sums_exactly() {
    const THREADS: usize = 4;
    const ADDS: u64 = 1000;
    let fabric = fabric();
    let listener = fabric.listen("").unwrap();
    let addr = listener.local_addr();
    let dom = fabric.domain().unwrap();
    let mut cq = fabric.completion_queue(16).unwrap();
    let counter = dom.register(64, Access::REMOTE_ATOMIC).unwrap();
    let remote = at(&counter, 8);
    let olds = std::thread::scope(|s| {
        let workers: Vec<_> = (0..THREADS)
            .map(|_| {
                let (fabric, addr) = (&fabric, addr.clone());
                s.spawn(move || {
                    let dom = fabric.domain().unwrap();
                    let mut cq = fabric.completion_queue(16).unwrap();
                    let ep = dom
                        .connect(&addr, &mut cq, &EndpointOptions::default())
                        .unwrap();
                    let result = dom.register(8, Access::LOCAL).unwrap();
                    let mut olds = Vec::with_capacity(ADDS as usize);
                    for i in 0..ADDS {
                        ep.fetch_add(i, &result, 0, remote, 1).unwrap();
                        assert_eq!(wait_one(&mut cq), Completion::ok(i, Opcode::FetchAdd, 8));
                        olds.push(result.read_u64(0));
                    }
                    olds
                })
            })
            .collect();
        // Accept all, keep them open until the workers are done.
        let _accepted: Vec<_> = (0..THREADS)
            .map(|_| {
                listener
                    .accept(&dom, &mut cq, &EndpointOptions::default(), Some(TIMEOUT))
                    .unwrap()
            })
            .collect();
        workers
            .into_iter()
            .flat_map(|w| w.join().unwrap())
            .collect::<Vec<_>>()
    });
    assert_eq!(counter.read_u64(8), THREADS as u64 * ADDS);
    let mut olds = olds;
    olds.sort_unstable();
    assert_eq!(
        olds,
        (0..THREADS as u64 * ADDS).collect::<Vec<_>>(),
        "every add saw a distinct old value"
    );
}

#[test]
fn compare_swap_swaps_only_on_equality() {
    let mut p = pair();
    let result = p.domain.register(16, Access::LOCAL).unwrap();
    let mut word = p.target_domain.register(64, Access::REMOTE_ATOMIC).unwrap();
    word.write_u64(16, 5);
    p.ep.compare_swap(1, &result, 8, at(&word, 16), 5, 9)
        .unwrap();
    assert_eq!(
        wait_one(&mut p.cq),
        Completion::ok(1, Opcode::CompareSwap, 8)
    );
    assert_eq!((result.read_u64(8), word.read_u64(16)), (5, 9));
    p.ep.compare_swap(2, &result, 0, at(&word, 16), 5, 11)
        .unwrap();
    assert_eq!(
        wait_one(&mut p.cq),
        Completion::ok(2, Opcode::CompareSwap, 8)
    );
    assert_eq!(
        (result.read_u64(0), word.read_u64(16)),
        (9, 9),
        "a failed compare must not swap"
    );
    p.ep.fetch_add(3, &result, 0, at(&word, 16), u64::MAX)
        .unwrap();
    assert_eq!(wait_one(&mut p.cq).status, Status::Success);
    assert_eq!(
        (result.read_u64(0), word.read_u64(16)),
        (9, 8),
        "adds wrap around"
    );
}

#[derive(Debug, Clone, Copy)]
enum Bad {
    UnknownRkey,
    OtherDomainRkey,
    BeforeStart,
    PastEnd,
    WriteWithoutRight,
    ReadWithoutRight,
    AtomicWithoutRight,
    LocalOnlyRegion,
}

#[rstest]
#[case(Bad::UnknownRkey)]
#[case(Bad::OtherDomainRkey)]
#[case(Bad::BeforeStart)]
#[case(Bad::PastEnd)]
#[case(Bad::WriteWithoutRight)]
#[case(Bad::ReadWithoutRight)]
#[case(Bad::AtomicWithoutRight)]
#[case(Bad::LocalOnlyRegion)]
fn bad_accesses_are_remote_access_errors_and_touch_nothing(#[case] bad: Bad) {
    let mut p = pair();
    let mut local = p.domain.register(8192, Access::LOCAL).unwrap();
    local.fill(.., 0x5A);
    // The byte pattern the target starts with and must keep.
    let init = pattern(4096, 3);
    let fill = |mut r: MemoryRegion| {
        r.write_from(0, &init);
        r
    };
    let rw = fill(
        p.target_domain
            .register(4096, Access::REMOTE_WRITE | Access::REMOTE_READ)
            .unwrap(),
    );
    let read_only = fill(p.target_domain.register(4096, Access::REMOTE_READ).unwrap());
    let write_only = fill(
        p.target_domain
            .register(4096, Access::REMOTE_WRITE)
            .unwrap(),
    );
    let local_only = fill(p.target_domain.register(4096, Access::LOCAL).unwrap());
    let other_dom = fabric().domain().unwrap();
    let foreign = fill(other_dom.register(4096, Access::ALL).unwrap());

    let (wr_id, opcode) = (
        7,
        match bad {
            Bad::ReadWithoutRight => Opcode::Read,
            Bad::AtomicWithoutRight => Opcode::FetchAdd,
            _ => Opcode::Write,
        },
    );
    let (region, remote) = match bad {
        Bad::UnknownRkey => (
            &rw,
            RemoteAddr {
                addr: rw.descriptor().addr,
                rkey: u32::MAX,
            },
        ),
        Bad::OtherDomainRkey => (&foreign, at(&foreign, 0)),
        Bad::BeforeStart => (
            &rw,
            RemoteAddr {
                addr: rw.descriptor().addr - 8,
                rkey: rw.rkey(),
            },
        ),
        Bad::PastEnd => (&rw, at(&rw, 4000)),
        Bad::WriteWithoutRight => (&read_only, at(&read_only, 0)),
        Bad::ReadWithoutRight => (&write_only, at(&write_only, 0)),
        Bad::AtomicWithoutRight => (&rw, at(&rw, 0)),
        Bad::LocalOnlyRegion => (&local_only, at(&local_only, 0)),
    };
    match opcode {
        Opcode::Read => p.ep.read(wr_id, &local, 0, 200, remote).unwrap(),
        Opcode::FetchAdd => p.ep.fetch_add(wr_id, &local, 0, remote, 1).unwrap(),
        _ => p.ep.write(wr_id, &local, 0, 200, remote).unwrap(),
    }
    assert_eq!(
        wait_one(&mut p.cq),
        Completion::error(wr_id, opcode, Status::RemoteAccess),
        "{bad:?}"
    );
    assert_eq!(
        region.read_to_vec(..),
        &init[..],
        "{bad:?}: the target's memory changed"
    );
    if opcode == Opcode::Read {
        assert!(
            local.read_to_vec(..).iter().all(|&b| b == 0x5A),
            "a refused read wrote locally"
        );
    }
    // The endpoint still works afterwards.
    p.ep.write(8, &local, 0, 16, at(&rw, 0)).unwrap();
    assert_eq!(wait_one(&mut p.cq), Completion::ok(8, Opcode::Write, 16));
}

#[test]
fn unaligned_atomic_is_a_remote_operation_error() {
    let mut p = pair();
    let result = p.domain.register(8, Access::LOCAL).unwrap();
    let word = p.target_domain.register(64, Access::REMOTE_ATOMIC).unwrap();
    p.ep.fetch_add(1, &result, 0, at(&word, 4), 1).unwrap();
    assert_eq!(
        wait_one(&mut p.cq),
        Completion::error(1, Opcode::FetchAdd, Status::RemoteOperation)
    );
    p.ep.compare_swap(2, &result, 0, at(&word, 9), 0, 1)
        .unwrap();
    assert_eq!(
        wait_one(&mut p.cq),
        Completion::error(2, Opcode::CompareSwap, Status::RemoteOperation)
    );
    assert!(word.read_to_vec(..).iter().all(|&b| b == 0));
}

#[test]
fn a_deregistered_region_is_refused_even_when_cached() {
    let mut p = pair();
    let local = p.domain.register(64, Access::LOCAL).unwrap();
    let target = p.target_domain.register(4096, Access::REMOTE_READ).unwrap();
    let remote = at(&target, 0);
    p.ep.read(1, &local, 0, 64, remote).unwrap();
    assert_eq!(wait_one(&mut p.cq).status, Status::Success);
    drop(target);
    p.ep.read(2, &local, 0, 64, remote).unwrap();
    assert_eq!(
        wait_one(&mut p.cq),
        Completion::error(2, Opcode::Read, Status::RemoteAccess)
    );
    // A new region (likely in the same registry slot) is granted afresh.
    let again = p.target_domain.register(4096, Access::REMOTE_READ).unwrap();
    p.ep.read(3, &local, 0, 64, at(&again, 0)).unwrap();
    assert_eq!(wait_one(&mut p.cq).status, Status::Success);
    p.ep.read(4, &local, 0, 64, remote).unwrap();
    assert_eq!(wait_one(&mut p.cq).status, Status::RemoteAccess);
}

/// The shm endpoint behind a fabric endpoint.
fn shm(ep: &Endpoint) -> &super::ShmEndpoint {
    match &ep.imp {
        crate::Imp::Shm(e) => e,
        _ => unreachable!("not an shm endpoint"),
    }
}

#[test]
fn revoked_grants_do_not_accumulate() {
    let mut p = pair();
    let local = p.domain.register(64, Access::LOCAL).unwrap();
    let keep = p.target_domain.register(4096, Access::REMOTE_READ).unwrap();
    p.ep.read(0, &local, 0, 8, at(&keep, 0)).unwrap();
    assert_eq!(wait_one(&mut p.cq).status, Status::Success);
    // A client that registers a fresh buffer per invocation.
    for i in 1..=200 {
        let fresh = p.target_domain.register(4096, Access::REMOTE_READ).unwrap();
        p.ep.read(i, &local, 0, 8, at(&fresh, 0)).unwrap();
        assert_eq!(wait_one(&mut p.cq).status, Status::Success);
    }
    assert_eq!(
        shm(&p.ep).cached_grants(),
        2,
        "the live region and the last fresh one"
    );
    p.ep.read(999, &local, 0, 8, at(&keep, 0)).unwrap();
    assert_eq!(wait_one(&mut p.cq).status, Status::Success);
}

#[test]
fn full_queues_refuse_posts_without_doing_them() {
    let opts = EndpointOptions {
        send_depth: 3,
        ..EndpointOptions::default()
    };
    let mut p = Pair::with("shm", &opts, 256);
    let mut src = p.domain.register(64, Access::LOCAL).unwrap();
    src.fill(.., 1);
    let target = p
        .target_domain
        .register(4096, Access::REMOTE_WRITE)
        .unwrap();
    for i in 0..3 {
        p.ep.write(i, &src, 0, 8, at(&target, i * 8)).unwrap();
    }
    let err = p.ep.write(3, &src, 0, 8, at(&target, 24)).unwrap_err();
    assert!(matches!(err, Error::QueueFull { depth: 3, .. }), "{err}");
    assert!(target.read_to_vec(24..32).iter().all(|&b| b == 0));
    let mut out = [Completion::EMPTY; 8];
    assert_eq!(p.cq.poll(&mut out), 3);
    p.ep.write(3, &src, 0, 8, at(&target, 24)).unwrap();
    assert_eq!(wait_one(&mut p.cq).wr_id, 3);

    // A completion queue of 2 shared by a default endpoint.
    let mut p = Pair::with("shm", &EndpointOptions::default(), 2);
    let src = p.domain.register(64, Access::LOCAL).unwrap();
    let target = p
        .target_domain
        .register(4096, Access::REMOTE_WRITE)
        .unwrap();
    p.ep.write(0, &src, 0, 8, at(&target, 0)).unwrap();
    p.ep.write(1, &src, 0, 8, at(&target, 8)).unwrap();
    let err = p.ep.write(2, &src, 0, 8, at(&target, 16)).unwrap_err();
    assert!(matches!(err, Error::QueueFull { depth: 2, .. }), "{err}");
    assert_eq!(p.cq.poll(&mut out), 2);
}

/// Which kernel sleep a completion queue's `wait` uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Sleep {
    /// `futex_waitv` on the rings' futex words (the normal path).
    Futex,
    /// `epoll_wait` on the eventfd and the wake-up sockets (the fallback).
    Epoll,
}

/// The shm queue behind a fabric queue.
fn shm_cq(cq: &mut CompletionQueue) -> &mut super::ShmCq {
    match &mut cq.imp {
        crate::Imp::Shm(c) => c,
        _ => unreachable!("not an shm completion queue"),
    }
}

/// Makes `cq` sleep the `how` way.
fn sleep_with(cq: &mut CompletionQueue, how: Sleep) {
    if how == Sleep::Epoll {
        shm_cq(cq).force_epoll();
    }
}

/// Asserts that `cq` slept at least once, and only the `how` way.
fn assert_slept(cq: &mut CompletionQueue, how: Sleep) {
    let s = shm_cq(cq).sleeps();
    let (used, other) = match how {
        Sleep::Futex => (s.futex, s.epoll),
        Sleep::Epoll => (s.epoll, s.futex),
    };
    assert!(used > 0 && other == 0, "{how:?}: {s:?}");
}

/// Asserts that `cq` slept only the `how` way and was woken every time
/// (a missed wake-up would end a sleep of [`next`] by its timeout instead).
fn assert_woken(cq: &mut CompletionQueue, how: Sleep) {
    assert_slept(cq, how);
    let s = shm_cq(cq).sleeps();
    assert_eq!(s.timeouts, 0, "{how:?}: a sleep was not woken: {s:?}");
}

#[rstest]
#[case::futex(Sleep::Futex)]
#[case::epoll(Sleep::Epoll)]
fn wait_wakes_on_a_remote_immediate_and_on_a_local_completion(#[case] how: Sleep) {
    let mut p = pair();
    sleep_with(&mut p.cq, how);
    sleep_with(&mut p.target_cq, how);
    let Pair {
        ep,
        target,
        domain,
        target_domain,
        mut cq,
        mut target_cq,
        ..
    } = p;
    let src = domain.register(64, Access::LOCAL).unwrap();
    let region = target_domain.register(64, Access::REMOTE_WRITE).unwrap();
    let remote = at(&region, 0);
    target.post_recv(5).unwrap();
    // Each post waits until this thread has said it is about to wait, and
    // sleeps: the post must wake it.
    let (waiting, about_to_wait) = mpsc::channel::<()>();
    let waiter = thread_id();
    let writer = std::thread::spawn(move || {
        about_to_wait.recv().unwrap();
        wait_until_asleep(std::process::id(), waiter);
        ep.write_with_imm(1, &src, 0, 4, remote, 42).unwrap();
        about_to_wait.recv().unwrap();
        wait_until_asleep(std::process::id(), waiter);
        ep.write(2, &src, 0, 4, remote).unwrap();
        (ep, src)
    });
    waiting.send(()).unwrap();
    let c = wait_one(&mut target_cq);
    assert_eq!((c.wr_id, c.imm, c.opcode), (5, 42, Opcode::RecvWithImm));
    // The first write completed when it was posted, before we woke.
    assert_eq!(wait_one(&mut cq).wr_id, 1);
    // The second completes from the writer thread while we sleep.
    waiting.send(()).unwrap();
    assert_eq!(wait_one(&mut cq).wr_id, 2);
    let _keep = writer.join().unwrap();
    assert_woken(&mut target_cq, how);
    assert_woken(&mut cq, how);
}

#[rstest]
#[case::futex(Sleep::Futex)]
#[case::epoll(Sleep::Epoll)]
fn wait_times_out_with_zero(#[case] how: Sleep) {
    let mut p = pair();
    sleep_with(&mut p.target_cq, how);
    let mut out = [Completion::EMPTY; 4];
    let start = Instant::now();
    assert_eq!(
        p.target_cq
            .wait(&mut out, Duration::from_millis(50))
            .unwrap(),
        0
    );
    let took = start.elapsed();
    assert!(
        took >= Duration::from_millis(50) && took < Duration::from_secs(2),
        "{took:?}"
    );
    assert_eq!(p.cq.wait(&mut out, Duration::ZERO).unwrap(), 0);
    assert_slept(&mut p.target_cq, how);
}

#[test]
fn a_short_timeout_is_not_rounded_up_to_a_millisecond() {
    let mut p = pair();
    let mut out = [Completion::EMPTY; 4];
    let asked = Duration::from_micros(200);
    let mut fastest = Duration::MAX;
    for _ in 0..20 {
        let start = Instant::now();
        assert_eq!(p.target_cq.wait(&mut out, asked).unwrap(), 0);
        let took = start.elapsed();
        assert!(took >= asked, "returned after {took:?}, before {asked:?}");
        fastest = fastest.min(took);
    }
    // epoll_wait would take at least a whole millisecond every time.
    assert!(
        fastest < Duration::from_micros(900),
        "the fastest 200 µs wait took {fastest:?}"
    );
    assert_slept(&mut p.target_cq, Sleep::Futex);
}

#[rstest]
#[case::futex(Sleep::Futex)]
#[case::epoll(Sleep::Epoll)]
fn a_sleeping_waiter_is_woken_by_peer_loss(#[case] how: Sleep) {
    let mut p = pair();
    sleep_with(&mut p.target_cq, how);
    let Pair {
        ep,
        target,
        mut target_cq,
        ..
    } = p;
    target.post_recv(1).unwrap();
    let waiter = thread_id();
    let dropper = std::thread::spawn(move || {
        wait_until_asleep(std::process::id(), waiter);
        drop(ep);
    });
    let start = Instant::now();
    assert_eq!(
        wait_one(&mut target_cq),
        Completion::error(1, Opcode::RecvWithImm, Status::PeerLost)
    );
    let took = start.elapsed();
    assert!(took < Duration::from_secs(1), "woken after {took:?}");
    dropper.join().unwrap();
    assert_woken(&mut target_cq, how);
}

/// Raises the soft limit on open files to at least `want` if the hard
/// limit allows (`n` endpoints in one process hold about 8 `n` descriptors).
fn allow_open_files(want: u64) {
    // SAFETY: an all-zero rlimit is valid; getrlimit/setrlimit only read
    // and write it.
    unsafe {
        let mut lim: libc::rlimit = std::mem::zeroed();
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 && lim.rlim_cur < want {
            lim.rlim_cur = want.min(lim.rlim_max);
            libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        }
    }
}

#[test]
fn a_queue_with_more_endpoints_than_futex_waitv_takes_falls_back_to_epoll() {
    const MANY: usize = 128;
    allow_open_files(4096);
    let fabric = fabric();
    let listener = fabric.listen("").unwrap();
    let (domain, target_domain) = (fabric.domain().unwrap(), fabric.domain().unwrap());
    let mut cq = fabric.completion_queue(4 * MANY).unwrap();
    let mut target_cq = fabric.completion_queue(4 * MANY).unwrap();
    let opts = EndpointOptions {
        send_depth: 2,
        recv_depth: 2,
        ..EndpointOptions::default()
    };
    let (mut accepted, mut dialled): (Vec<Endpoint>, Vec<Option<Endpoint>>) = (0..MANY)
        .map(|_| {
            let (target, ep) = connect_pair(
                &listener,
                &target_domain,
                &mut target_cq,
                &domain,
                &mut cq,
                &opts,
            );
            (target, Some(ep))
        })
        .unzip();
    let src = std::sync::Arc::new(domain.register(64, Access::LOCAL).unwrap());
    let region = target_domain.register(64, Access::REMOTE_WRITE).unwrap();
    let remote = at(&region, 0);

    // One sleep of the target's queue, woken from another thread by an
    // immediate on the `which`-th connection. Returns its sleep counts.
    let waiter = thread_id();
    let mut round = |dialled: &mut [Option<Endpoint>],
                     accepted: &[Endpoint],
                     which: usize,
                     target_cq: &mut CompletionQueue| {
        accepted[which].post_recv(which as u64).unwrap();
        let ep = dialled[which].take().unwrap();
        let src = src.clone();
        let writer = std::thread::spawn(move || {
            wait_until_asleep(std::process::id(), waiter);
            ep.write_with_imm(0, &src, 0, 8, remote, which as u32)
                .unwrap();
            ep
        });
        let c = wait_one(target_cq);
        assert_eq!(
            (c.wr_id, c.imm, c.status),
            (which as u64, which as u32, Status::Success)
        );
        assert_eq!(
            shm_cq(target_cq).sleeps().timeouts,
            0,
            "the target's sleep was not woken"
        );
        dialled[which] = Some(writer.join().unwrap());
        assert_eq!(wait_one(&mut cq).status, Status::Success);
        shm_cq(target_cq).sleeps()
    };
    // 128 rings and the queue's own word: one too many for futex_waitv.
    let s = round(&mut dialled, &accepted, MANY - 1, &mut target_cq);
    assert!(s.epoll > 0 && s.futex == 0, "{s:?}");
    // Close one connection; once the target's queue has polled its end,
    // 127 rings and its own word fit.
    drop((dialled.pop(), accepted.pop()));
    let mut out = [Completion::EMPTY; 8];
    let _ = target_cq.poll(&mut out);
    let s = round(&mut dialled, &accepted, MANY / 2, &mut target_cq);
    assert!(s.futex > 0, "{s:?}");
}

#[test]
fn dropping_an_endpoint_is_peer_loss_for_the_other_side() {
    let p = pair();
    let Pair {
        ep,
        target,
        domain,
        target_domain,
        mut cq,
        mut target_cq,
        ..
    } = p;
    let local = target_domain.register(64, Access::LOCAL).unwrap();
    let ep_region = domain.register(64, Access::ALL).unwrap();
    for i in 0..3 {
        target.post_recv(i).unwrap();
    }
    ep.post_recv(100).unwrap();
    let start = Instant::now();
    drop(ep);
    for i in 0..3 {
        assert_eq!(
            wait_one(&mut target_cq),
            Completion::error(i, Opcode::RecvWithImm, Status::PeerLost)
        );
    }
    assert!(
        start.elapsed() < Duration::from_secs(1),
        "loss took {:?}",
        start.elapsed()
    );
    // Later operations and receives fail the same way, as completions.
    target.write(10, &local, 0, 8, at(&ep_region, 0)).unwrap();
    assert_eq!(
        wait_one(&mut target_cq),
        Completion::error(10, Opcode::Write, Status::PeerLost)
    );
    target
        .fetch_add(11, &local, 0, at(&ep_region, 0), 1)
        .unwrap();
    assert_eq!(
        wait_one(&mut target_cq),
        Completion::error(11, Opcode::FetchAdd, Status::PeerLost)
    );
    target.post_recv(12).unwrap();
    assert_eq!(
        wait_one(&mut target_cq),
        Completion::error(12, Opcode::RecvWithImm, Status::PeerLost)
    );
    // The dropped side's own receive is flushed.
    assert_eq!(
        wait_one(&mut cq),
        Completion::error(100, Opcode::RecvWithImm, Status::Flushed)
    );
    assert_no_completion(&mut cq);
}

#[test]
fn garbage_peers_get_clear_connect_errors_and_break_nothing() {
    let fabric = fabric();
    let dir = std::env::temp_dir();
    let path = dir.join(format!("rfaas-shm-test-{}.sock", std::process::id()));
    let path = path.to_str().unwrap().to_owned();
    let listener = fabric.listen(&path).unwrap();
    assert_eq!(listener.local_addr(), path);
    let dom = fabric.domain().unwrap();
    let mut cq = fabric.completion_queue(16).unwrap();
    let opts = EndpointOptions::default();

    // A client speaking garbage.
    let mut junk = std::os::unix::net::UnixStream::connect(&path).unwrap();
    junk.write_all(&[0x47; 64]).unwrap();
    let err = listener
        .accept(&dom, &mut cq, &opts, Some(TIMEOUT))
        .unwrap_err();
    assert!(
        matches!(&err, Error::Connect { reason, .. } if reason.contains("magic")),
        "{err}"
    );
    // A client that hangs up mid-hello.
    let mut half = std::os::unix::net::UnixStream::connect(&path).unwrap();
    half.write_all(b"RFAASSHM").unwrap();
    drop(half);
    let err = listener
        .accept(&dom, &mut cq, &opts, Some(TIMEOUT))
        .unwrap_err();
    assert!(matches!(err, Error::Connect { .. }), "{err}");

    // The listener still serves a real client.
    std::thread::scope(|s| {
        let client = s.spawn(|| {
            let dom = fabric.domain().unwrap();
            let mut cq = fabric.completion_queue(4).unwrap();
            dom.connect(&path, &mut cq, &opts).map(|_| ())
        });
        listener
            .accept(&dom, &mut cq, &opts, Some(TIMEOUT))
            .unwrap();
        client.join().unwrap().unwrap();
    });
    drop(listener);
    assert!(
        !std::path::Path::new(&path).exists(),
        "the socket file was not removed"
    );

    // A server speaking garbage, then one that never answers.
    let server = std::os::unix::net::UnixListener::bind(&path).unwrap();
    let (timed_out, until_timed_out) = mpsc::channel::<()>();
    let replier = std::thread::spawn(move || {
        let (mut conn, _) = server.accept().unwrap();
        conn.write_all(&[0x13; 64]).unwrap();
        // Held open, silent, until the client has given up on it.
        let (silent, _) = server.accept().unwrap();
        let _ = until_timed_out.recv();
        drop((conn, silent));
    });
    let err = dom.connect(&path, &mut cq, &opts).unwrap_err();
    assert!(
        matches!(&err, Error::Connect { reason, .. } if reason.contains("magic")),
        "{err}"
    );
    let quick = EndpointOptions {
        connect_timeout: Duration::from_millis(100),
        ..EndpointOptions::default()
    };
    let err = dom.connect(&path, &mut cq, &quick).unwrap_err();
    assert!(matches!(err, Error::Timeout(_)), "{err}");
    timed_out.send(()).unwrap();
    replier.join().unwrap();
    std::fs::remove_file(&path).unwrap();

    // Nobody listening, and an accept that times out.
    let err = dom.connect(&path, &mut cq, &opts).unwrap_err();
    assert!(
        matches!(err, Error::Connect { .. }) && err.is_retryable(),
        "{err}"
    );
    let idle = fabric.listen("").unwrap();
    assert!(idle.local_addr().contains("/rfaas-shm-"));
    let err = idle
        .accept(&dom, &mut cq, &opts, Some(Duration::from_millis(50)))
        .unwrap_err();
    assert!(matches!(err, Error::Timeout(_)), "{err}");
}

const CHILD_ENV: &str = "RFAAS_SHM_TEST_CHILD";

/// Not a test: the peer process of `a_killed_peer_process_is_peer_lost`
/// (run by re-executing this test binary). Adds to the parent's counter;
/// once the parent says on stdin that it waits, and its waiting thread
/// sleeps, writes 64 bytes with immediate 77; then waits to be killed.
#[test]
#[ignore = "helper process, started by a_killed_peer_process_is_peer_lost"]
fn child_peer() {
    let Ok(spec) = std::env::var(CHILD_ENV) else {
        return;
    };
    let fields: Vec<&str> = spec.split(' ').collect();
    let [addr, rkey, base, adds, parent, waiter] = fields[..] else {
        panic!("bad {CHILD_ENV}: {spec}")
    };
    let remote = |offset: u64| RemoteAddr {
        addr: base.parse::<u64>().unwrap() + offset,
        rkey: rkey.parse().unwrap(),
    };
    let fabric = fabric();
    let dom = fabric.domain().unwrap();
    let mut cq = fabric.completion_queue(16).unwrap();
    let ep = dom
        .connect(addr, &mut cq, &EndpointOptions::default())
        .unwrap();
    let mut local = dom.register(4096, Access::LOCAL).unwrap();
    for i in 0..adds.parse::<u64>().unwrap() {
        ep.fetch_add(i, &local, 0, remote(0), 1).unwrap();
        assert_eq!(wait_one(&mut cq).status, Status::Success);
    }
    local.fill(64..128, 0xC5);
    // While the parent sleeps in `wait`: our wake-up must cross processes.
    let mut go = String::new();
    std::io::stdin().read_line(&mut go).unwrap();
    wait_until_asleep(parent.parse().unwrap(), waiter.parse().unwrap());
    ep.write_with_imm(1, &local, 64, 64, remote(64), 77)
        .unwrap();
    assert_eq!(wait_one(&mut cq).status, Status::Success);
    loop {
        std::thread::park();
    }
}

#[rstest]
#[case::futex(Sleep::Futex)]
#[case::epoll(Sleep::Epoll)]
fn a_killed_peer_process_is_peer_lost(#[case] how: Sleep) {
    const ADDS: u64 = 2000;
    let fabric = fabric();
    let listener = fabric.listen("").unwrap();
    let dom = fabric.domain().unwrap();
    let mut cq = fabric.completion_queue(64).unwrap();
    sleep_with(&mut cq, how);
    let target = dom.register(4096, Access::ALL).unwrap();
    let spec = format!(
        "{} {} {} {ADDS} {} {}",
        listener.local_addr(),
        target.rkey(),
        target.descriptor().addr,
        std::process::id(),
        thread_id(),
    );
    let spawn = || {
        let child = rerun_test("shm::tests::child_peer")
            .env(CHILD_ENV, &spec)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        KillOnDrop(child)
    };
    let (mut first, mut second) = (spawn(), spawn());
    let opts = EndpointOptions::default();
    let eps: Vec<Endpoint> = (0..2)
        .map(|_| {
            listener
                .accept(&dom, &mut cq, &opts, Some(Duration::from_secs(30)))
                .unwrap()
        })
        .collect();
    // Both children add while this process adds through a loopback connection.
    let local_adds = AtomicU64::new(0);
    std::thread::scope(|s| {
        let adder = s.spawn(|| {
            let dom = fabric.domain().unwrap();
            let mut cq = fabric.completion_queue(16).unwrap();
            let ep = dom.connect(&listener.local_addr(), &mut cq, &opts).unwrap();
            let result = dom.register(8, Access::LOCAL).unwrap();
            for i in 0..ADDS {
                ep.fetch_add(i, &result, 0, at(&target, 0), 1).unwrap();
                assert_eq!(wait_one(&mut cq).status, Status::Success);
                local_adds.fetch_add(1, Ordering::Relaxed);
            }
        });
        let _loopback = listener
            .accept(&dom, &mut cq, &opts, Some(TIMEOUT))
            .unwrap();
        for (i, ep) in eps.iter().enumerate() {
            ep.post_recv(i as u64).unwrap();
        }
        for child in [&mut first, &mut second] {
            let stdin = child.0.stdin.as_mut().unwrap();
            stdin.write_all(b"waiting\n").unwrap();
        }
        // Sleeps in wait: the children's kicks cross processes.
        let mut from = Vec::new();
        while from.len() < 2 {
            let c = wait_one(&mut cq);
            assert_eq!(
                (c.opcode, c.status, c.imm, c.byte_len),
                (Opcode::RecvWithImm, Status::Success, 77, 64)
            );
            from.push(c.wr_id);
        }
        adder.join().unwrap();
    });
    // We slept while the children worked: their wake-ups crossed processes.
    assert_woken(&mut cq, how);
    assert_eq!(local_adds.load(Ordering::Relaxed), ADDS);
    assert_eq!(
        target.read_u64(0),
        3 * ADDS,
        "atomics from three processes' endpoints must sum exactly"
    );
    assert!(target.read_to_vec(64..128).iter().all(|&b| b == 0xC5));

    // Kill the first child: its endpoint's receive fails within a second.
    let pid = format!("pid {} ", first.0.id());
    let (dead, alive) = match eps[0].peer_addr().starts_with(&pid) {
        true => (&eps[0], &eps[1]),
        false => (&eps[1], &eps[0]),
    };
    assert!(
        dead.peer_addr().starts_with(&pid),
        "{} vs {pid}",
        dead.peer_addr()
    );
    dead.post_recv(100).unwrap();
    alive.post_recv(200).unwrap();
    let start = Instant::now();
    first.0.kill().unwrap();
    let c = wait_one(&mut cq);
    assert_eq!(
        c,
        Completion::error(100, Opcode::RecvWithImm, Status::PeerLost)
    );
    assert!(
        start.elapsed() < Duration::from_secs(1),
        "loss took {:?}",
        start.elapsed()
    );
    let local = dom.register(64, Access::LOCAL).unwrap();
    dead.write(
        101,
        &local,
        0,
        8,
        RemoteAddr {
            addr: 4096,
            rkey: 1,
        },
    )
    .unwrap();
    assert_eq!(
        wait_one(&mut cq),
        Completion::error(101, Opcode::Write, Status::PeerLost)
    );
    assert_woken(&mut cq, how);
    // The other child's connection is unaffected.
    assert_no_completion(&mut cq);
}

#[test]
fn options_and_addresses_are_validated() {
    let fabric = fabric();
    let dom = fabric.domain().unwrap();
    let mut cq = fabric.completion_queue(4).unwrap();
    let zero = EndpointOptions {
        recv_depth: 0,
        ..EndpointOptions::default()
    };
    assert!(matches!(
        dom.connect("@x", &mut cq, &zero),
        Err(Error::InvalidArgument(_))
    ));
    let opts = EndpointOptions::default();
    assert!(matches!(
        dom.connect("", &mut cq, &opts),
        Err(Error::InvalidArgument(_))
    ));
    let long = format!("/{}", "x".repeat(200));
    assert!(matches!(
        dom.connect(&long, &mut cq, &opts),
        Err(Error::InvalidArgument(_))
    ));
    let listener: Listener = fabric.listen("").unwrap();
    let path = listener.local_addr();
    assert!(
        fabric.listen(&path).is_err(),
        "a socket path is taken while its listener lives"
    );
}

/// No abstract socket, ever: `@name` is refused to listen and to connect,
/// and a fresh listener is a filesystem socket (so /proc/net/unix lists
/// its path) in a directory of mode 0700 that goes with it.
#[test]
fn shm_sockets_are_files_in_a_private_directory_never_abstract() {
    use std::os::unix::fs::PermissionsExt;
    let fabric = fabric();
    let dom = fabric.domain().unwrap();
    let mut cq = fabric.completion_queue(4).unwrap();
    let opts = EndpointOptions::default();
    for name in ["@", "@rfaas-shm-test-fixed-name"] {
        let err = fabric.listen(name).unwrap_err();
        assert!(
            matches!(&err, Error::InvalidArgument(m) if m.contains("abstract")),
            "{name}: {err}"
        );
        assert!(matches!(
            dom.connect(name, &mut cq, &opts),
            Err(Error::InvalidArgument(_))
        ));
    }
    let listener = fabric.listen("").unwrap();
    let path = std::path::PathBuf::from(listener.local_addr());
    assert!(path.is_absolute(), "{}", path.display());
    let unix = std::fs::read_to_string("/proc/net/unix").unwrap();
    let listed: Vec<&str> = unix
        .lines()
        .filter_map(|l| l.split_whitespace().nth(7))
        .collect();
    assert!(
        listed.contains(&path.to_str().unwrap()),
        "{} is not a filesystem socket in /proc/net/unix",
        path.display()
    );
    let dir = path.parent().unwrap().to_owned();
    let mode = std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o700, "{}", dir.display());
    drop(listener);
    assert!(!dir.exists(), "the listener's directory is removed with it");
}

#[test]
fn the_kernel_enforces_read_only_grants_and_sealed_sizes() {
    use std::os::fd::AsRawFd;
    let buf = crate::Buffer::new(4096).unwrap();
    let ro = super::sys::reopen_read_only(buf.fd()).unwrap();
    assert!(
        super::sys::Mapping::new(ro.as_raw_fd(), 4096, true).is_err(),
        "a read-only grant mapped writable"
    );
    assert!(super::sys::Mapping::new(ro.as_raw_fd(), 4096, false).is_ok());
    assert!(super::sys::check_peer_memfd(ro.as_raw_fd(), 4096).is_ok());
    assert!(
        super::sys::check_peer_memfd(ro.as_raw_fd(), 8192).is_err(),
        "too short"
    );
    // SAFETY: no pointers; the call must fail because the memfd is sealed.
    let shrunk = unsafe { libc::ftruncate(buf.fd(), 0) };
    assert_ne!(shrunk, 0, "a peer holding the descriptor could shrink it");
}

//! Unit tests of the tcp provider's posting path, through the public API.
//! The cross-provider conformance suite lives in `fabric/tests/`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use crate::testing::{Pair, TIMEOUT};
use crate::{Access, Completion, EndpointOptions, Error, Imp, Opcode, Status};

/// Posts while another thread polls the endpoint's completion queue, so the
/// poller (or the progress thread) holds the connection state for some of
/// the posts: every request still leaves once, in posting order, with its
/// completion. (Which posts find the state held is up to the scheduler;
/// `a_post_finding_the_state_held_is_sent_by_its_holder` takes that path
/// for certain.)
#[test]
fn posting_while_another_thread_polls_keeps_order() {
    const N: u32 = 3000;
    let opts = EndpointOptions {
        send_depth: 16,
        recv_depth: 64,
        ..EndpointOptions::default()
    };
    let Pair {
        ep,
        target,
        mut cq,
        mut target_cq,
        domain,
        target_domain,
        ..
    } = Pair::with("tcp", &opts, 256);
    let region = target_domain.register(4096, Access::REMOTE_WRITE).unwrap();
    let src = domain.register(64, Access::LOCAL).unwrap();
    for i in 0..64u64 {
        target.post_recv(i).unwrap();
    }
    let posting = AtomicBool::new(true);
    std::thread::scope(|s| {
        // The initiator's completions, polled on their own thread.
        let poller = s.spawn(|| {
            let mut out = [Completion::EMPTY; 16];
            let mut next = 0u64;
            let deadline = Instant::now() + TIMEOUT;
            while next < u64::from(N) {
                assert!(Instant::now() < deadline, "{next} of {N} completions");
                let n = cq.poll(&mut out);
                if n == 0 {
                    // Two cores run four busy threads here: let the others on.
                    std::thread::yield_now();
                }
                for c in &out[..n] {
                    assert_eq!(
                        (c.wr_id, c.opcode, c.status),
                        (next, Opcode::WriteWithImm, Status::Success)
                    );
                    next += 1;
                }
            }
            posting.store(false, Ordering::Relaxed);
        });
        // The target, receiving the immediates in order.
        let target_cq = &mut target_cq;
        let receiver = s.spawn(move || {
            let mut out = [Completion::EMPTY; 16];
            let mut next = 0u32;
            let deadline = Instant::now() + TIMEOUT;
            while next < N {
                assert!(Instant::now() < deadline, "{next} of {N} immediates");
                let n = target_cq.poll(&mut out);
                if n == 0 {
                    std::thread::yield_now();
                }
                for c in &out[..n] {
                    assert_eq!((c.status, c.imm), (Status::Success, next));
                    target.post_recv(c.wr_id).unwrap();
                    next += 1;
                }
            }
            // Kept open until the initiator has its last completions.
            target
        });
        let deadline = Instant::now() + TIMEOUT;
        let mut i = 0;
        while i < N {
            match ep.write_with_imm(u64::from(i), &src, 0, 8, region.descriptor().at(0), i) {
                Ok(()) => i += 1,
                // The poller has not retired enough yet.
                Err(Error::QueueFull { .. }) => std::thread::yield_now(),
                Err(e) => panic!("post {i}: {e}"),
            }
            assert!(Instant::now() < deadline, "posted {i} of {N}");
        }
        poller.join().unwrap();
        drop(receiver.join().unwrap());
    });
    assert!(!posting.load(Ordering::Relaxed));
}

/// A post that finds the connection state held is handed over and sent by
/// the next holder, after the requests handed over before it and before
/// the holder's own.
#[test]
fn a_post_finding_the_state_held_is_sent_by_its_holder() {
    let Pair {
        ep,
        target,
        mut cq,
        mut target_cq,
        domain,
        target_domain,
        ..
    } = Pair::new("tcp");
    let Imp::Tcp(tcp) = &ep.imp else {
        unreachable!("a tcp endpoint")
    };
    let region = target_domain.register(4096, Access::REMOTE_WRITE).unwrap();
    let src = domain.register(64, Access::LOCAL).unwrap();
    for i in 0..3 {
        target.post_recv(i).unwrap();
    }
    let write = |i: u32| {
        ep.write_with_imm(u64::from(i), &src, 0, 8, region.descriptor().at(0), i)
            .unwrap()
    };
    let held = tcp.hold_state();
    write(0);
    write(1);
    assert_eq!(tcp.handed_over(), 2, "both posts found the state held");
    drop(held);
    // Whoever claims the state next (this post, or the progress thread)
    // sends the two handed over first.
    write(2);
    let mut got = Vec::new();
    let deadline = Instant::now() + TIMEOUT;
    let mut out = [Completion::EMPTY; 4];
    while got.len() < 3 {
        assert!(Instant::now() < deadline, "immediates: {got:?}");
        let n = target_cq.poll(&mut out);
        got.extend(out[..n].iter().map(|c| (c.status, c.imm)));
    }
    assert_eq!(got, [0, 1, 2].map(|i| (Status::Success, i)));
    let mut done = Vec::new();
    while done.len() < 3 {
        assert!(Instant::now() < deadline, "completions: {done:?}");
        let n = cq.poll(&mut out);
        done.extend(out[..n].iter().map(|c| (c.wr_id, c.status)));
    }
    assert_eq!(done, [0, 1, 2].map(|i| (i, Status::Success)));

    // Handed over while held, then sent by the next poll.
    target.post_recv(3).unwrap();
    let before = tcp.handed_over();
    let held = tcp.hold_state();
    write(3);
    drop(held);
    assert_eq!(tcp.handed_over(), before + 1);
    let c = loop {
        assert!(Instant::now() < deadline, "no completion for the last post");
        if cq.poll(&mut out) == 1 {
            break out[0];
        }
    };
    assert_eq!(
        (c.wr_id, c.opcode, c.status),
        (3, Opcode::WriteWithImm, Status::Success)
    );
}

/// A batch that finds the connection state held is handed over whole, in
/// order, behind an earlier hand-over, and sent by the next holder.
#[test]
fn a_batch_finding_the_state_held_is_sent_in_order_by_its_holder() {
    let Pair {
        ep,
        target,
        mut cq,
        mut target_cq,
        domain,
        target_domain,
        ..
    } = Pair::new("tcp");
    let tcp = tcp_ep(&ep);
    let region = target_domain.register(4096, Access::REMOTE_WRITE).unwrap();
    let src = domain.register(64, Access::LOCAL).unwrap();
    for i in 0..5 {
        target.post_recv(i).unwrap();
    }
    let writes: Vec<crate::WriteRequest<'_>> = (1..4u32)
        .map(|i| crate::WriteRequest {
            wr_id: u64::from(i),
            local: &src,
            offset: 0,
            len: 8,
            remote: region.descriptor().at(8 * u64::from(i)),
            imm: Some(i),
            unsignaled: false,
        })
        .collect();
    let held = tcp.hold_state();
    ep.write_with_imm(0, &src, 0, 8, region.descriptor().at(0), 0)
        .unwrap();
    ep.write_batch(&writes).unwrap();
    assert_eq!(
        tcp.handed_over(),
        4,
        "the post and the batch were handed over"
    );
    drop(held);
    ep.write_with_imm(4, &src, 0, 8, region.descriptor().at(32), 4)
        .unwrap();
    let got: Vec<_> = crate::testing::poll_n(&mut target_cq, 5)
        .iter()
        .map(|c| (c.wr_id, c.status, c.imm))
        .collect();
    assert_eq!(
        got,
        [0, 1, 2, 3, 4].map(|i| (u64::from(i), Status::Success, i))
    );
    let done: Vec<_> = crate::testing::poll_n(&mut cq, 5)
        .iter()
        .map(|c| (c.wr_id, c.status))
        .collect();
    assert_eq!(done, [0, 1, 2, 3, 4].map(|i| (i, Status::Success)));
}

/// Endpoints enough that their completion queues poll by readiness: `n`
/// connections between two domains, the dialled ends on one queue and the
/// accepted ends on another.
struct Many {
    eps: Vec<crate::Endpoint>,
    targets: Vec<crate::Endpoint>,
    cq: crate::CompletionQueue,
    target_cq: crate::CompletionQueue,
    domain: crate::Domain,
    target_domain: crate::Domain,
    _listener: crate::Listener,
}

impl Many {
    /// `n` connections; only polls drive them (the progress thread keeps
    /// off both queues), so what the tests see is what poll does.
    fn new(n: usize) -> Many {
        let opts = EndpointOptions {
            send_depth: 16,
            recv_depth: 16,
            ..EndpointOptions::default()
        };
        let fabric = crate::Fabric::open("tcp").unwrap();
        let listener = fabric.listen("127.0.0.1:0").unwrap();
        let domain = fabric.domain().unwrap();
        let target_domain = fabric.domain().unwrap();
        let mut cq = fabric.completion_queue(32 * n).unwrap();
        let mut target_cq = fabric.completion_queue(32 * n).unwrap();
        let (mut eps, mut targets) = (Vec::new(), Vec::new());
        for _ in 0..n {
            let (target, ep) = crate::testing::connect_pair(
                &listener,
                &target_domain,
                &mut target_cq,
                &domain,
                &mut cq,
                &opts,
            );
            eps.push(ep);
            targets.push(target);
        }
        tcp_cq(&cq).keep_progress_thread_off();
        tcp_cq(&target_cq).keep_progress_thread_off();
        Many {
            eps,
            targets,
            cq,
            target_cq,
            domain,
            target_domain,
            _listener: listener,
        }
    }
}

impl Many {
    /// The next `n` completions of the dialled ends, polling the accepted
    /// ends' queue too (which has nothing to deliver), so they acknowledge.
    fn initiator_completions(&mut self, n: usize) -> Vec<Completion> {
        let mut got = Vec::new();
        let mut out = [Completion::EMPTY; 8];
        let deadline = Instant::now() + TIMEOUT;
        while got.len() < n {
            assert!(Instant::now() < deadline, "{} of {n}: {got:?}", got.len());
            assert_eq!(self.target_cq.poll(&mut out), 0, "{:?}", &out[..1]);
            let k = self.cq.poll(&mut out[..(n - got.len()).min(8)]);
            got.extend_from_slice(&out[..k]);
        }
        got
    }
}

fn tcp_cq(cq: &crate::CompletionQueue) -> &super::TcpCq {
    let Imp::Tcp(cq) = &cq.imp else {
        unreachable!("a tcp completion queue")
    };
    cq
}

fn tcp_ep(ep: &crate::Endpoint) -> &super::TcpEndpoint {
    let Imp::Tcp(ep) = &ep.imp else {
        unreachable!("a tcp endpoint")
    };
    ep
}

/// With many endpoints on each queue, poll reads only the sockets epoll
/// reports readable: writes on a few of the connections all arrive, each
/// connection's immediates in order, and every write completes.
#[test]
fn many_endpoints_on_one_queue_deliver_the_traffic_of_a_few() {
    const N: usize = 12;
    const BUSY: [usize; 3] = [2, 7, 11];
    const EACH: u64 = 5;
    let mut m = Many::new(N);
    let region = m
        .target_domain
        .register(4096, Access::REMOTE_WRITE)
        .unwrap();
    let src = m.domain.register(64, Access::LOCAL).unwrap();
    for (i, target) in m.targets.iter().enumerate() {
        for k in 0..EACH {
            target.post_recv(1000 * i as u64 + k).unwrap();
        }
    }
    for k in 0..EACH {
        for &i in &BUSY {
            let imm = (100 * i) as u32 + k as u32;
            let at = region.descriptor().at(64 * i as u64);
            m.eps[i]
                .write_with_imm(1000 * i as u64 + k, &src, 0, 8, at, imm)
                .unwrap();
        }
    }
    let total = BUSY.len() * EACH as usize;
    let (mut received, mut written) = (Vec::new(), Vec::new());
    let mut out = [Completion::EMPTY; 8];
    let deadline = Instant::now() + TIMEOUT;
    while received.len() < total || written.len() < total {
        assert!(
            Instant::now() < deadline,
            "received {received:?}, written {written:?}"
        );
        let n = m.target_cq.poll(&mut out);
        received.extend_from_slice(&out[..n]);
        let n = m.cq.poll(&mut out);
        written.extend_from_slice(&out[..n]);
    }
    for &i in &BUSY {
        let mine: Vec<_> = received
            .iter()
            .filter(|c| c.wr_id / 1000 == i as u64)
            .map(|c| (c.wr_id % 1000, c.status, c.imm, c.byte_len))
            .collect();
        let want: Vec<_> = (0..EACH)
            .map(|k| (k, Status::Success, (100 * i) as u32 + k as u32, 8))
            .collect();
        assert_eq!(mine, want, "endpoint {i}");
        let done: Vec<_> = written
            .iter()
            .filter(|c| c.wr_id / 1000 == i as u64)
            .map(|c| (c.wr_id % 1000, c.opcode, c.status))
            .collect();
        let want: Vec<_> = (0..EACH)
            .map(|k| (k, Opcode::WriteWithImm, Status::Success))
            .collect();
        assert_eq!(done, want, "endpoint {i}");
    }
    assert!(
        tcp_cq(&m.cq).ready_polls() > 0,
        "the initiators polled by readiness"
    );
    assert!(
        tcp_cq(&m.target_cq).ready_polls() > 0,
        "the targets polled by readiness"
    );
}

/// A target that only polls, on a queue polling by readiness, still sends
/// the acknowledgement it owes after `IDLE_POLLS_BEFORE_ACK` empty polls:
/// no frame arrives to signal it.
#[test]
fn a_delayed_ack_goes_out_while_the_target_only_polls() {
    let mut m = Many::new(12);
    let region = m
        .target_domain
        .register(4096, Access::REMOTE_WRITE)
        .unwrap();
    let src = m.domain.register(64, Access::LOCAL).unwrap();
    m.targets[5].post_recv(50).unwrap();
    let mut out = [Completion::EMPTY; 4];
    m.eps[5]
        .write_with_imm(5, &src, 0, 8, region.descriptor().at(0), 55)
        .unwrap();
    let c = crate::testing::poll_one(&mut m.target_cq);
    assert_eq!((c.wr_id, c.status, c.imm), (50, Status::Success, 55));
    // One request is below the acknowledgement threshold: it is owed.
    let owed = &tcp_ep(&m.targets[5]).shared().ack_owed;
    for _ in 0..=super::endpoint::IDLE_POLLS_BEFORE_ACK {
        assert_eq!(m.target_cq.poll(&mut out), 0);
    }
    assert!(
        !owed.load(Ordering::Relaxed),
        "the acknowledgement left within the idle polls"
    );
    let c = m.initiator_completions(1)[0];
    assert_eq!(
        (c.wr_id, c.opcode, c.status),
        (5, Opcode::WriteWithImm, Status::Success)
    );
    assert!(tcp_cq(&m.target_cq).ready_polls() > 0);
}

/// A write-with-immediate that arrives before its receive is posted waits
/// in the staging buffer, where no readiness announces it: it completes on
/// the first polls after the receive is posted, while the queue's other
/// endpoints are idle.
#[test]
fn a_stalled_receive_completes_once_posted_while_others_idle() {
    let mut m = Many::new(12);
    let region = m
        .target_domain
        .register(4096, Access::REMOTE_WRITE)
        .unwrap();
    let src = m.domain.register(64, Access::LOCAL).unwrap();
    let mut out = [Completion::EMPTY; 4];
    m.eps[4]
        .write_with_imm(4, &src, 0, 16, region.descriptor().at(0), 44)
        .unwrap();
    let stalled = &tcp_ep(&m.targets[4]).shared().stalled;
    let deadline = Instant::now() + TIMEOUT;
    while !stalled.load(Ordering::Relaxed) {
        assert!(Instant::now() < deadline, "the write never arrived");
        assert_eq!(m.target_cq.poll(&mut out), 0, "nothing to complete yet");
    }
    m.targets[4].post_recv(40).unwrap();
    let c = crate::testing::poll_one(&mut m.target_cq);
    assert_eq!(
        (c.wr_id, c.opcode, c.status, c.imm, c.byte_len),
        (40, Opcode::RecvWithImm, Status::Success, 44, 16)
    );
    assert!(!stalled.load(Ordering::Relaxed));
    let c = m.initiator_completions(1)[0];
    assert_eq!((c.wr_id, c.status), (4, Status::Success));
    assert!(tcp_cq(&m.target_cq).ready_polls() > 0);
}

/// Long writes arrive whole on a queue polling by readiness, their bytes
/// coming over many reads and polls, and the frame after a long payload
/// is not left behind.
#[test]
fn long_writes_arrive_whole_on_a_queue_polling_by_readiness() {
    const LEN: usize = 3 << 20;
    let mut m = Many::new(12);
    let region = m
        .target_domain
        .register(2 * LEN, Access::REMOTE_WRITE)
        .unwrap();
    let mut src = m.domain.register(2 * LEN, Access::LOCAL).unwrap();
    let data = crate::testing::pattern(2 * LEN, 9);
    src.write_from(0, &data);
    m.targets[8].post_recv(80).unwrap();
    m.targets[8].post_recv(81).unwrap();
    m.eps[8]
        .write(1, &src, 0, LEN, region.descriptor().at(0))
        .unwrap();
    // The second write's frame follows the long payload in the stream.
    m.eps[8]
        .write_with_imm(2, &src, LEN, LEN, region.descriptor().at(LEN as u64), 88)
        .unwrap();
    // Both queues are polled: the initiator's output waits for room in
    // its socket, and only its poll sends the rest.
    let (mut received, mut done) = (Vec::new(), Vec::new());
    let mut out = [Completion::EMPTY; 4];
    let deadline = Instant::now() + TIMEOUT;
    while received.is_empty() || done.len() < 2 {
        assert!(Instant::now() < deadline, "{received:?} {done:?}");
        let n = m.target_cq.poll(&mut out);
        received.extend(
            out[..n]
                .iter()
                .map(|c| (c.wr_id, c.status, c.imm, c.byte_len)),
        );
        let n = m.cq.poll(&mut out);
        done.extend(out[..n].iter().map(|c| (c.wr_id, c.status)));
    }
    assert_eq!(received, [(80, Status::Success, 88, LEN as u32)]);
    assert_eq!(done, [(1, Status::Success), (2, Status::Success)]);
    assert!(region.read_to_vec(..) == data, "the bytes differ");
    assert!(tcp_cq(&m.target_cq).ready_polls() > 0);
}

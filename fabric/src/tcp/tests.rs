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

//! The fabric conformance suite: one body per behaviour, run for every
//! provider. `tcp` and `shm` run everywhere; the cases named `verbs` need
//! an RDMA device: they are ignored elsewhere and run by
//! `scripts/test-verbs.sh` under Soft-RoCE. The fixtures (pairs of
//! endpoints, waiting for completions) are the ones the providers' unit
//! tests use, in `rfaas_fabric::testing`; waiting for other events is
//! `rfaas_testkit::wait`'s.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write as _};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use rfaas_fabric::testing::{
    assert_no_completion, at, connect_pair, listen_addr, pattern, poll_n, poll_one, verbs,
    KillOnDrop, Pair, TIMEOUT,
};
use rfaas_fabric::{
    Access, Completion, EndpointOptions, Error, Fabric, Opcode, RemoteAddr, Status, WriteRequest,
};
use rfaas_testkit::wait::{thread_id, wait_until_asleep};
use rstest::rstest;

/// A raw connection below the fabric: a TCP stream, or a unix stream for
/// shm (a socket path).
fn raw_connect(addr: &str) -> Box<dyn std::io::Write> {
    if let Ok(sa) = addr.parse::<std::net::SocketAddr>() {
        return Box::new(std::net::TcpStream::connect(sa).expect("raw tcp connect"));
    }
    Box::new(std::os::unix::net::UnixStream::connect(addr).expect("raw unix connect"))
}

/// A peer that connects and says nothing (or half a hello) holds up nobody
/// behind it: `accept` hands out the next peer whose hello is whole, and
/// gives the silent one up, with a clear error, after `connect_timeout`.
/// (Socket-level peers: verbs connects through the RDMA CM.)
#[rstest]
#[case::tcp("tcp")]
#[case::shm("shm")]
fn a_silent_peer_holds_up_no_other(#[case] provider: &str) {
    let fabric = Fabric::open(provider).expect("open the provider");
    let listener = fabric.listen(&listen_addr(provider)).expect("listen");
    let addr = listener.local_addr();
    let target_domain = fabric.domain().unwrap();
    let mut target_cq = fabric.completion_queue(1024).unwrap();
    let domain = fabric.domain().unwrap();
    let mut cq = fabric.completion_queue(1024).unwrap();
    let accepting = EndpointOptions {
        connect_timeout: Duration::from_secs(3),
        ..EndpointOptions::default()
    };
    let _silent = raw_connect(&addr);
    let mut half = raw_connect(&addr);
    half.write_all(b"RFAAS").unwrap();
    std::thread::scope(|s| {
        let connector = s.spawn(|| domain.connect(&addr, &mut cq, &EndpointOptions::default()));
        // Connected last, handed out first.
        let real = listener.accept(&target_domain, &mut target_cq, &accepting, Some(TIMEOUT));
        let connected = connector.join().unwrap();
        assert!(real.is_ok(), "{:?}", real.err());
        connected.expect("connect");
    });
    // The other two are given up once their three seconds are over.
    for _ in 0..2 {
        let start = Instant::now();
        let err = listener
            .accept(&target_domain, &mut target_cq, &accepting, Some(TIMEOUT))
            .unwrap_err();
        assert!(
            matches!(&err, Error::Connect { reason, .. } if reason.contains("no whole hello")),
            "{err}"
        );
        assert!(start.elapsed() < TIMEOUT);
    }
    drop(half);
}

/// Whether an endpoint stays usable after one of its operations failed at
/// the target. tcp and shm keep it; on verbs an error completion moves the
/// RC queue pair to the error state, and Soft-RoCE moves the target's too, so
/// the connection ends there (docs/fabric.md, "Errors").
fn survives_refusals(provider: &str) -> bool {
    !provider.starts_with("verbs:")
}

/// Byte-exact writes and reads, 0 B to 5 MB, at unaligned offsets.
#[rstest]
#[case::tcp("tcp")]
#[case::shm("shm")]
#[ignore = "needs an RDMA device: scripts/test-verbs.sh runs it under Soft-RoCE (--features verbs)"]
#[case::verbs(verbs())]
fn write_and_read_are_byte_exact(#[case] provider: &str) {
    let mut p = Pair::new(provider);
    let max = 5 << 20;
    let target = p.target_domain.register(max + 64, Access::ALL).unwrap();
    let mut src = p.domain.register(max + 64, Access::LOCAL).unwrap();
    let dst = p.domain.register(max + 64, Access::LOCAL).unwrap();
    let remote = target.descriptor();
    for (i, &len) in [0usize, 1, 7, 63, 64, 4095, 4096, 65537, 1 << 20, max]
        .iter()
        .enumerate()
    {
        let src_off = [0, 3, 13, 1][i % 4];
        let dst_off = [5, 0, 1, 11][i % 4];
        let data = pattern(len, i as u8);
        src.write_from(src_off, &data);
        p.ep.write(i as u64, &src, src_off, len, remote.at(dst_off as u64))
            .unwrap();
        let c = poll_one(&mut p.cq);
        assert_eq!(
            (c.wr_id, c.opcode, c.status, c.byte_len),
            (i as u64, Opcode::Write, Status::Success, len as u32)
        );
        assert!(
            target.read_to_vec(dst_off..dst_off + len) == data,
            "write of {len} B at offset {dst_off} differs"
        );
        p.ep.read(
            100 + i as u64,
            &dst,
            src_off,
            len,
            remote.at(dst_off as u64),
        )
        .unwrap();
        let c = poll_one(&mut p.cq);
        assert_eq!(
            (c.wr_id, c.opcode, c.status, c.byte_len),
            (100 + i as u64, Opcode::Read, Status::Success, len as u32)
        );
        assert!(
            dst.read_to_vec(src_off..src_off + len) == data,
            "read of {len} B differs"
        );
    }
}

/// In-place views of the peer's memory: shm offers them, checked like a
/// read; tcp and verbs do not.
#[rstest]
#[case::tcp("tcp")]
#[case::shm("shm")]
#[ignore = "needs an RDMA device: scripts/test-verbs.sh runs it under Soft-RoCE (--features verbs)"]
#[case::verbs(verbs())]
fn peer_views_are_checked_like_reads(#[case] provider: &str) {
    let p = Pair::new(provider);
    let mut readable = p.target_domain.register(8192, Access::REMOTE_READ).unwrap();
    let data = pattern(8192, 7);
    readable.write_from(0, &data);
    let writable_only = p
        .target_domain
        .register(4096, Access::REMOTE_WRITE)
        .unwrap();
    let remote = readable.descriptor();
    let Some(view) = p.ep.peer_view(remote.at(100), 5000) else {
        assert_ne!(provider, "shm", "shm shares memory with its peer");
        return;
    };
    assert_eq!(provider, "shm", "only shm maps the peer's memory");
    let view = view.unwrap();
    assert_eq!(view.len(), 5000);
    // SAFETY: no operation on the endpoint since the view was taken.
    let bytes = unsafe { std::slice::from_raw_parts(view.as_ptr(), view.len()) };
    assert!(bytes == &data[100..5100], "the view shows the peer's bytes");
    // The peer's later writes show through: it is the same memory.
    readable.write_from(100, &[data[100] ^ 0xff]);
    // SAFETY: as above.
    assert_eq!(unsafe { *view.as_ptr() }, data[100] ^ 0xff);
    // Refused like reads: past the end, a wrong rkey, no read right.
    let refused = |r: RemoteAddr, len| p.ep.peer_view(r, len).unwrap().map(|_| ()).unwrap_err();
    assert_eq!(refused(remote.at(4096), 4097), Status::RemoteAccess);
    let forged = RemoteAddr {
        addr: remote.addr,
        rkey: remote.rkey ^ 0x5a5a,
    };
    assert_eq!(refused(forged, 1), Status::RemoteAccess);
    assert_eq!(
        refused(writable_only.descriptor().at(0), 1),
        Status::RemoteAccess
    );
    assert!(
        p.ep.peer_view(forged, 0).unwrap().is_ok(),
        "zero bytes check no rkey"
    );
}

/// Immediates arrive in order, each consuming one posted receive, with the
/// write's length.
#[rstest]
#[case::tcp("tcp")]
#[case::shm("shm")]
#[ignore = "needs an RDMA device: scripts/test-verbs.sh runs it under Soft-RoCE (--features verbs)"]
#[case::verbs(verbs())]
fn immediates_arrive_in_order(#[case] provider: &str) {
    let mut p = Pair::new(provider);
    let target = p
        .target_domain
        .register(4096, Access::REMOTE_WRITE)
        .unwrap();
    let src = p.domain.register(4096, Access::LOCAL).unwrap();
    const N: u32 = 200;
    for i in 0..100u64 {
        p.target.post_recv(1000 + i).unwrap();
    }
    let mut received = Vec::new();
    let mut posted = 100;
    for i in 0..N {
        p.ep.write_with_imm(
            u64::from(i),
            &src,
            0,
            (i % 64) as usize,
            target.descriptor().at(64),
            i,
        )
        .unwrap();
        if i % 16 == 15 {
            poll_n(&mut p.cq, 16);
        }
        let mut buf = [Completion::EMPTY; 8];
        let n = p.target_cq.poll(&mut buf);
        for c in &buf[..n] {
            received.push(*c);
            if posted < N {
                p.target.post_recv(1000 + u64::from(posted) % 100).unwrap();
                posted += 1;
            }
        }
    }
    while received.len() < N as usize {
        let c = poll_one(&mut p.target_cq);
        received.push(c);
        if posted < N {
            p.target.post_recv(1000 + u64::from(posted) % 100).unwrap();
            posted += 1;
        }
    }
    for (i, c) in received.iter().enumerate() {
        assert_eq!(c.opcode, Opcode::RecvWithImm);
        assert_eq!(c.status, Status::Success);
        assert_eq!(c.imm, i as u32, "immediates out of order: {received:?}");
        assert_eq!(c.byte_len, (i % 64) as u32);
        assert_eq!(
            c.wr_id,
            1000 + (i as u64) % 100,
            "receives consumed out of order"
        );
    }
}

/// A batch of writes lands every payload, and its immediates consume the
/// posted receives in order, each with its write's length; every write
/// completes, in order, as if posted alone. Plain writes in a batch
/// consume no receive. (70 writes, one of them long: more than one
/// `writev` on tcp and more than one doorbell on shm.)
#[rstest]
#[case::tcp("tcp")]
#[case::shm("shm")]
#[ignore = "needs an RDMA device: scripts/test-verbs.sh runs it under Soft-RoCE (--features verbs)"]
#[case::verbs(verbs())]
fn a_batch_of_writes_lands_in_order_with_its_immediates(#[case] provider: &str) {
    const N: usize = 70;
    const SLOT: usize = 512;
    const LONG: usize = 33;
    let mut p = Pair::new(provider);
    let bytes = N * SLOT + 200_000;
    let target = p
        .target_domain
        .register(bytes, Access::REMOTE_WRITE)
        .unwrap();
    let mut src = p.domain.register(bytes, Access::LOCAL).unwrap();
    // Lengths from 0 up, one of 200 kB; the long one goes after the slots.
    let len_of = |i: usize| if i == LONG { 200_000 } else { (i * 37) % SLOT };
    let off_of = |i: usize| if i == LONG { N * SLOT } else { i * SLOT };
    for i in 0..N {
        src.write_from(off_of(i), &pattern(len_of(i), i as u8));
        p.target.post_recv(1000 + i as u64).unwrap();
    }
    let writes: Vec<WriteRequest<'_>> = (0..N)
        .map(|i| WriteRequest {
            wr_id: i as u64,
            local: &src,
            offset: off_of(i),
            len: len_of(i),
            remote: at(&target, off_of(i) as u64),
            imm: Some(500 + i as u32),
            unsignaled: false,
        })
        .collect();
    p.ep.write_batch(&writes).unwrap();
    let received = poll_n(&mut p.target_cq, N);
    for (i, c) in received.iter().enumerate() {
        assert_eq!(
            (c.wr_id, c.opcode, c.status, c.imm, c.byte_len),
            (
                1000 + i as u64,
                Opcode::RecvWithImm,
                Status::Success,
                500 + i as u32,
                len_of(i) as u32
            ),
            "receive {i}"
        );
    }
    let done = poll_n(&mut p.cq, N);
    for (i, c) in done.iter().enumerate() {
        assert_eq!(
            (c.wr_id, c.opcode, c.status, c.byte_len),
            (
                i as u64,
                Opcode::WriteWithImm,
                Status::Success,
                len_of(i) as u32
            ),
            "write {i}"
        );
    }
    for i in 0..N {
        assert!(
            target.read_to_vec(off_of(i)..off_of(i) + len_of(i)) == pattern(len_of(i), i as u8),
            "the payload of write {i} differs"
        );
    }

    // Plain writes and writes-with-immediate mixed: only the latter
    // consume receives.
    for i in 0..3 {
        p.target.post_recv(2000 + i).unwrap();
    }
    let mixed: Vec<WriteRequest<'_>> = (0..6)
        .map(|i| WriteRequest {
            wr_id: 100 + i as u64,
            local: &src,
            offset: 0,
            len: 16,
            remote: at(&target, 64 * i as u64),
            imm: (i % 2 == 1).then_some(600 + i as u32),
            unsignaled: false,
        })
        .collect();
    p.ep.write_batch(&mixed).unwrap();
    let received: Vec<_> = poll_n(&mut p.target_cq, 3)
        .iter()
        .map(|c| (c.wr_id, c.status, c.imm, c.byte_len))
        .collect();
    assert_eq!(
        received,
        [
            (2000, Status::Success, 601, 16),
            (2001, Status::Success, 603, 16),
            (2002, Status::Success, 605, 16)
        ]
    );
    let done: Vec<_> = poll_n(&mut p.cq, 6)
        .iter()
        .map(|c| (c.wr_id, c.opcode, c.status))
        .collect();
    let want: Vec<_> = (0..6u64)
        .map(|i| {
            let opcode = if i % 2 == 1 {
                Opcode::WriteWithImm
            } else {
                Opcode::Write
            };
            (100 + i, opcode, Status::Success)
        })
        .collect();
    assert_eq!(done, want);
}

/// A batch is posted whole or not at all: one longer than the send queue,
/// one with a bad local range, and one the send queue has no room for now
/// are refused, and nothing of them reaches the peer; the same batch goes
/// once there is room.
#[rstest]
#[case::tcp("tcp")]
#[case::shm("shm")]
#[ignore = "needs an RDMA device: scripts/test-verbs.sh runs it under Soft-RoCE (--features verbs)"]
#[case::verbs(verbs())]
fn a_batch_without_room_is_refused_whole(#[case] provider: &str) {
    let opts = EndpointOptions {
        send_depth: 8,
        recv_depth: 16,
        ..EndpointOptions::default()
    };
    let mut p = Pair::with(provider, &opts, 256);
    let target = p
        .target_domain
        .register(4096, Access::REMOTE_WRITE)
        .unwrap();
    let mut src = p.domain.register(4096, Access::LOCAL).unwrap();
    src.fill(.., 0xAB);
    // Writes-with-immediate `base..base + n`, to bytes `8 * base..` of the target.
    let batch = |base: u64, n: u64| -> Vec<WriteRequest<'_>> {
        (base..base + n)
            .map(|i| WriteRequest {
                wr_id: i,
                local: &src,
                offset: 0,
                len: 8,
                remote: at(&target, 8 * i),
                imm: Some(i as u32),
                unsignaled: false,
            })
            .collect()
    };
    let err = p.ep.write_batch(&batch(100, 9)).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
    let mut bad = batch(200, 3);
    bad[2].offset = 4090;
    assert!(p.ep.write_batch(&bad).is_err(), "8 bytes at 4090 of 4096");
    // Five writes-with-immediate wait for receives the target has not
    // posted, so they stay in the send queue: four more do not fit.
    for i in 0..5u64 {
        p.ep.write_with_imm(i, &src, 0, 8, at(&target, 8 * i), i as u32)
            .unwrap();
    }
    let err = p.ep.write_batch(&batch(300, 4)).unwrap_err();
    assert!(matches!(err, Error::QueueFull { .. }), "{err}");

    for i in 0..16 {
        p.target.post_recv(1000 + i).unwrap();
    }
    let imms: Vec<_> = poll_n(&mut p.target_cq, 5).iter().map(|c| c.imm).collect();
    assert_eq!(imms, [0, 1, 2, 3, 4], "only the single writes went");
    assert_eq!(poll_n(&mut p.cq, 5).len(), 5);
    p.ep.write_batch(&batch(400, 4)).unwrap();
    let got: Vec<_> = poll_n(&mut p.target_cq, 4)
        .iter()
        .map(|c| (c.status, c.imm))
        .collect();
    assert_eq!(
        got,
        (400..404).map(|i| (Status::Success, i)).collect::<Vec<_>>()
    );
    let done: Vec<_> = poll_n(&mut p.cq, 4).iter().map(|c| c.wr_id).collect();
    assert_eq!(done, [400, 401, 402, 403]);
    assert!(
        target.read_to_vec(800..2432).iter().all(|&b| b == 0),
        "refused batches wrote nothing"
    );
    assert_eq!(target.read_to_vec(3200..3232), [0xAB; 32]);
    assert_no_completion(&mut p.target_cq);
}

/// Unsignaled writes complete only when they fail. Many more of them than
/// the send queue holds go through it (their entries come back without a
/// completion to reap), each lands with its immediate in order, and the
/// initiator's queue stays empty but for the signaled write among them
/// and, at the end, a refused unsignaled write.
#[rstest]
#[case::tcp("tcp")]
#[case::shm("shm")]
#[ignore = "needs an RDMA device: scripts/test-verbs.sh runs it under Soft-RoCE (--features verbs)"]
#[case::verbs(verbs())]
fn unsignaled_writes_complete_only_when_they_fail(#[case] provider: &str) {
    const BATCHES: u64 = 12;
    const PER: u64 = 6;
    let opts = EndpointOptions {
        send_depth: 8,
        recv_depth: 16,
        ..EndpointOptions::default()
    };
    let mut p = Pair::with(provider, &opts, 64);
    let target = p
        .target_domain
        .register(4096, Access::REMOTE_WRITE)
        .unwrap();
    let mut src = p.domain.register(4096, Access::LOCAL).unwrap();
    for i in 0..BATCHES * PER {
        src.write_from(8 * i as usize, &i.to_le_bytes());
    }
    let write = |i: u64| WriteRequest {
        wr_id: i,
        local: &src,
        offset: 8 * i as usize,
        len: 8,
        remote: at(&target, 8 * i),
        imm: Some(i as u32),
        // One write of them all asks for its completion.
        unsignaled: i != 15,
    };
    for i in 0..PER {
        p.target.post_recv(1000 + i).unwrap();
    }
    let mut arrived = Vec::new();
    let mut done = Vec::new();
    for b in 0..BATCHES {
        let batch: Vec<_> = (b * PER..(b + 1) * PER).map(write).collect();
        let deadline = Instant::now() + TIMEOUT;
        // The send queue (8) holds one batch of 6 at a time: the next
        // fits once the provider knows the last one done.
        loop {
            match p.ep.write_batch(&batch) {
                Ok(()) => break,
                Err(Error::QueueFull { .. }) => {
                    let mut out = [Completion::EMPTY; 8];
                    let n = p.cq.poll(&mut out);
                    done.extend_from_slice(&out[..n]);
                    assert!(Instant::now() < deadline, "batch {b}: no room came back");
                    std::thread::yield_now();
                }
                Err(e) => panic!("batch {b}: {e}"),
            }
        }
        for c in poll_n(&mut p.target_cq, PER as usize) {
            assert_eq!(c.status, Status::Success, "{c:?}");
            arrived.push(c.imm);
            p.target.post_recv(c.wr_id).unwrap();
        }
    }
    let want: Vec<u32> = (0..(BATCHES * PER) as u32).collect();
    assert_eq!(arrived, want, "every immediate, in order");
    for i in 0..BATCHES * PER {
        let at = 8 * i as usize;
        assert_eq!(target.read_to_vec(at..at + 8), i.to_le_bytes(), "write {i}");
    }
    // A plain write after them all: once it completes, everything before
    // it is done, so a completion of theirs would be in the queue by now.
    p.ep.write(99, &src, 0, 8, at(&target, 4000)).unwrap();
    loop {
        let c = poll_one(&mut p.cq);
        if c.wr_id == 99 {
            break;
        }
        done.push(c);
    }
    let done: Vec<_> = done.iter().map(|c| (c.wr_id, c.status)).collect();
    assert_eq!(
        done,
        [(15, Status::Success)],
        "only the signaled write completes"
    );
    assert_no_completion(&mut p.cq);

    // A refused unsignaled write completes, with its own wr_id.
    let bad = RemoteAddr {
        addr: 0,
        rkey: target.descriptor().rkey ^ 0x5A5A_0000,
    };
    p.ep.write_batch(&[WriteRequest {
        remote: bad,
        imm: None,
        ..write(7)
    }])
    .unwrap();
    let c = poll_one(&mut p.cq);
    assert_eq!((c.wr_id, c.status), (7, Status::RemoteAccess), "{c:?}");
}

/// An empty batch posts nothing and completes nothing.
#[rstest]
#[case::tcp("tcp")]
#[case::shm("shm")]
#[ignore = "needs an RDMA device: scripts/test-verbs.sh runs it under Soft-RoCE (--features verbs)"]
#[case::verbs(verbs())]
fn an_empty_batch_does_nothing(#[case] provider: &str) {
    let mut p = Pair::new(provider);
    let target = p
        .target_domain
        .register(4096, Access::REMOTE_WRITE)
        .unwrap();
    let src = p.domain.register(64, Access::LOCAL).unwrap();
    p.ep.write_batch(&[]).unwrap();
    assert_no_completion(&mut p.cq);
    p.target.post_recv(7).unwrap();
    p.ep.write_with_imm(1, &src, 0, 8, at(&target, 0), 77)
        .unwrap();
    let c = poll_one(&mut p.target_cq);
    assert_eq!(
        (c.wr_id, c.imm),
        (7, 77),
        "the next write is the first to arrive"
    );
    assert_eq!(poll_one(&mut p.cq).wr_id, 1);
    assert_no_completion(&mut p.cq);
}

/// Fetch-and-add from several threads, each with its own endpoint and
/// domain, sums exactly.
#[rstest]
#[case::tcp("tcp")]
#[case::shm("shm")]
#[ignore = "needs an RDMA device: scripts/test-verbs.sh runs it under Soft-RoCE (--features verbs)"]
#[case::verbs(verbs())]
fn fetch_add_from_threads_sums_exactly(#[case] provider: &str) {
    let fabric = Fabric::open(provider).unwrap();
    let listener = fabric.listen(&listen_addr(provider)).unwrap();
    let addr = listener.local_addr();
    let target_domain = fabric.domain().unwrap();
    let counter = target_domain.register(64, Access::REMOTE_ATOMIC).unwrap();
    let remote = counter.descriptor().at(8);
    const THREADS: u64 = 4;
    const ADDS: u64 = 500;
    let mut target_cqs = Vec::new();
    let mut targets = Vec::new();
    std::thread::scope(|s| {
        let workers: Vec<_> = (0..THREADS)
            .map(|t| {
                let fabric = &fabric;
                let addr = addr.clone();
                s.spawn(move || {
                    let domain = fabric.domain().unwrap();
                    let mut cq = fabric.completion_queue(1024).unwrap();
                    let ep = domain
                        .connect(&addr, &mut cq, &EndpointOptions::default())
                        .unwrap();
                    let local = domain.register(8, Access::LOCAL).unwrap();
                    let mut olds = Vec::new();
                    for i in 0..ADDS {
                        ep.fetch_add(i, &local, 0, remote, t + 1).unwrap();
                        let c = poll_one(&mut cq);
                        assert_eq!(
                            (c.opcode, c.status, c.byte_len),
                            (Opcode::FetchAdd, Status::Success, 8)
                        );
                        olds.push(local.read_u64(0));
                    }
                    olds
                })
            })
            .collect();
        for _ in 0..THREADS {
            let mut cq = fabric.completion_queue(1024).unwrap();
            targets.push(
                listener
                    .accept(
                        &target_domain,
                        &mut cq,
                        &EndpointOptions::default(),
                        Some(TIMEOUT),
                    )
                    .unwrap(),
            );
            target_cqs.push(cq);
        }
        let mut all: Vec<u64> = workers
            .into_iter()
            .flat_map(|w| w.join().unwrap())
            .collect();
        all.sort_unstable();
        all.dedup();
        assert_eq!(
            all.len() as u64,
            THREADS * ADDS,
            "two adds saw the same old value"
        );
    });
    let expected: u64 = (1..=THREADS).map(|t| t * ADDS).sum();
    assert_eq!(counter.read_u64(8), expected);
    assert_eq!(counter.read_u64(0), 0, "the neighbouring word changed");
}

/// A child process running `rfaas-fabric-probe`.
struct Probe {
    child: KillOnDrop,
    /// The fields of its ready line.
    ready: HashMap<String, String>,
}

impl Probe {
    fn serve(provider: &str, listen: &str) -> Probe {
        let mut child = Command::new(env!("CARGO_BIN_EXE_rfaas-fabric-probe"))
            .args(["--provider", provider, "serve", "--listen", listen])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .spawn()
            .expect("start rfaas-fabric-probe");
        let (tx, rx) = mpsc::channel();
        let stdout = child.stdout.take().unwrap();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = BufReader::new(stdout).read_line(&mut line);
            let _ = tx.send(line);
        });
        let line = rx
            .recv_timeout(TIMEOUT)
            .expect("the probe did not get ready");
        // `rfaas-fabric-probe ready provider=P listen=A addr=X rkey=K len=L`
        let rest = line
            .strip_prefix("rfaas-fabric-probe ready ")
            .unwrap_or_else(|| panic!("probe said {line:?}"));
        let ready = rest
            .split_whitespace()
            .filter_map(|field| field.split_once('='))
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect();
        Probe {
            child: KillOnDrop(child),
            ready,
        }
    }

    fn field(&self, key: &str) -> &str {
        self.ready
            .get(key)
            .unwrap_or_else(|| panic!("the probe's ready line has no {key}=: {:?}", self.ready))
    }

    fn addr(&self) -> &str {
        self.field("listen")
    }

    fn remote(&self) -> RemoteAddr {
        RemoteAddr {
            addr: self.field("addr").parse().unwrap(),
            rkey: self.field("rkey").parse().unwrap(),
        }
    }

    fn kill(&mut self) {
        let _ = self.child.0.kill();
        let _ = self.child.0.wait();
    }
}

impl Drop for Probe {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Fetch-and-add from several processes sums exactly, on a target whose
/// application thread never polls (it only waits for its children).
#[rstest]
#[case::tcp("tcp")]
#[case::shm("shm")]
#[ignore = "needs an RDMA device: scripts/test-verbs.sh runs it under Soft-RoCE (--features verbs)"]
#[case::verbs(verbs())]
fn fetch_add_from_processes_on_a_passive_target(#[case] provider: &str) {
    let fabric = Fabric::open(provider).unwrap();
    let listener = fabric.listen(&listen_addr(provider)).unwrap();
    let domain = fabric.domain().unwrap();
    let counter = domain.register(4096, Access::REMOTE_ATOMIC).unwrap();
    let d = counter.descriptor();
    const PROCS: usize = 3;
    const ADDS: u64 = 300;
    let children: Vec<KillOnDrop> = (0..PROCS)
        .map(|_| {
            let child = Command::new(env!("CARGO_BIN_EXE_rfaas-fabric-probe"))
                .args([
                    "--provider",
                    provider,
                    "faa",
                    "--connect",
                    &listener.local_addr(),
                ])
                .args([
                    "--addr",
                    &d.addr.to_string(),
                    "--rkey",
                    &d.rkey.to_string(),
                    "--count",
                    &ADDS.to_string(),
                ])
                .stdout(Stdio::null())
                .spawn()
                .expect("start rfaas-fabric-probe");
            KillOnDrop(child)
        })
        .collect();
    let mut cqs = Vec::new();
    let mut eps = Vec::new();
    for _ in 0..PROCS {
        let mut cq = fabric.completion_queue(1024).unwrap();
        eps.push(
            listener
                .accept(&domain, &mut cq, &EndpointOptions::default(), Some(TIMEOUT))
                .unwrap(),
        );
        cqs.push(cq);
    }
    // The target's application thread now only sleeps in waitpid.
    for mut child in children {
        let status = child.0.wait().unwrap();
        assert!(status.success(), "a fetch-and-add process failed: {status}");
    }
    assert_eq!(counter.read_u64(0), PROCS as u64 * ADDS);
}

/// Compare-and-swap swaps only on a match and always returns the old value.
#[rstest]
#[case::tcp("tcp")]
#[case::shm("shm")]
#[ignore = "needs an RDMA device: scripts/test-verbs.sh runs it under Soft-RoCE (--features verbs)"]
#[case::verbs(verbs())]
fn compare_and_swap_semantics(#[case] provider: &str) {
    let mut p = Pair::new(provider);
    let mut word = p.target_domain.register(64, Access::REMOTE_ATOMIC).unwrap();
    word.write_u64(16, 7);
    let local = p.domain.register(64, Access::LOCAL).unwrap();
    let remote = word.descriptor().at(16);
    p.ep.compare_swap(1, &local, 8, remote, 5, 9).unwrap();
    assert_eq!(poll_one(&mut p.cq).status, Status::Success);
    assert_eq!(
        (local.read_u64(8), word.read_u64(16)),
        (7, 7),
        "swapped without a match"
    );
    p.ep.compare_swap(2, &local, 8, remote, 7, u64::MAX)
        .unwrap();
    let c = poll_one(&mut p.cq);
    assert_eq!(
        (c.wr_id, c.opcode, c.status),
        (2, Opcode::CompareSwap, Status::Success)
    );
    assert_eq!((local.read_u64(8), word.read_u64(16)), (7, u64::MAX));
    p.ep.fetch_add(3, &local, 0, remote, 2).unwrap();
    assert_eq!(poll_one(&mut p.cq).status, Status::Success);
    assert_eq!(
        (local.read_u64(0), word.read_u64(16)),
        (u64::MAX, 1),
        "fetch-and-add must wrap"
    );
}

/// One-sided operations complete while the target's application thread
/// sleeps, and while it computes without polling.
#[rstest]
#[case::tcp_sleeping("tcp", false)]
#[case::tcp_computing("tcp", true)]
#[case::shm_sleeping("shm", false)]
#[case::shm_computing("shm", true)]
#[ignore = "needs an RDMA device: scripts/test-verbs.sh runs it under Soft-RoCE (--features verbs)"]
#[case::verbs_sleeping(verbs(), false)]
#[ignore = "needs an RDMA device: scripts/test-verbs.sh runs it under Soft-RoCE (--features verbs)"]
#[case::verbs_computing(verbs(), true)]
fn one_sided_operations_need_no_target_thread(#[case] provider: &str, #[case] computing: bool) {
    let Pair {
        target_domain,
        target_cq,
        target,
        domain,
        mut cq,
        ep,
        listener: _listener,
        fabric: _fabric,
        ..
    } = Pair::new(provider);
    let region = target_domain.register(1 << 20, Access::ALL).unwrap();
    let remote = region.descriptor();
    let (stop_tx, stop_rx) = mpsc::channel::<()>();
    // The target side: hold everything alive and never poll.
    let target_thread = std::thread::spawn(move || {
        let _keep = (target_cq, target, target_domain);
        if computing {
            let mut x = 1u64;
            while stop_rx.try_recv().is_err() {
                for _ in 0..10_000 {
                    x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
                }
            }
        } else {
            let _ = stop_rx.recv();
        }
        region
    });
    let mut src = domain.register(1 << 20, Access::LOCAL).unwrap();
    let data = pattern(1 << 20, 9);
    src.write_from(0, &data);
    ep.write(1, &src, 0, 1 << 20, remote.at(0)).unwrap();
    assert_eq!(poll_one(&mut cq).status, Status::Success);
    let dst = domain.register(1 << 20, Access::LOCAL).unwrap();
    ep.read(2, &dst, 0, 1 << 20, remote.at(0)).unwrap();
    assert_eq!(poll_one(&mut cq).status, Status::Success);
    assert!(dst.read_to_vec(..) == data);
    ep.fetch_add(3, &dst, 0, remote.at(64), 5).unwrap();
    assert_eq!(poll_one(&mut cq).status, Status::Success);
    stop_tx.send(()).unwrap();
    let region = target_thread.join().unwrap();
    assert_eq!(
        region.read_u64(64),
        u64::from_ne_bytes(data[64..72].try_into().unwrap()).wrapping_add(5)
    );
}

/// Every refused access is a RemoteAccess (or RemoteOperation) completion
/// at the initiator, and the target's memory stays untouched.
#[rstest]
#[case::tcp("tcp")]
#[case::shm("shm")]
#[ignore = "needs an RDMA device: scripts/test-verbs.sh runs it under Soft-RoCE (--features verbs)"]
#[case::verbs(verbs())]
fn refused_accesses_leave_the_target_untouched(#[case] provider: &str) {
    let mut p = Pair::new(provider);
    let full = p.target_domain.register(4096, Access::ALL).unwrap();
    let read_only = p.target_domain.register(4096, Access::REMOTE_READ).unwrap();
    let write_only = p
        .target_domain
        .register(4096, Access::REMOTE_WRITE)
        .unwrap();
    let local_only = p.target_domain.register(4096, Access::LOCAL).unwrap();
    // A region of the initiator's own (another) domain: its rkey means nothing at the target.
    let foreign = p.domain.register(4096, Access::ALL).unwrap();
    let other_target_domain = p.fabric.domain().unwrap();
    let other = other_target_domain.register(4096, Access::ALL).unwrap();
    let mut src = p.domain.register(8192, Access::LOCAL).unwrap();
    src.fill(.., 0xEE);
    let d = full.descriptor();
    let cases: Vec<(&str, RemoteAddr, usize)> = vec![
        (
            "unknown rkey",
            RemoteAddr {
                addr: d.addr,
                rkey: d.rkey ^ 0x5A5A_0000,
            },
            8,
        ),
        (
            "rkey of the initiator's domain",
            foreign.descriptor().at(0),
            8,
        ),
        ("rkey of another target domain", other.descriptor().at(0), 8),
        ("past the end", d.at(4090), 8),
        (
            "before the start",
            RemoteAddr {
                addr: d.addr - 8,
                rkey: d.rkey,
            },
            8,
        ),
        ("longer than the region", d.at(0), 8192),
        (
            "wrapping address",
            RemoteAddr {
                addr: u64::MAX - 3,
                rkey: d.rkey,
            },
            8,
        ),
        (
            "write without REMOTE_WRITE",
            read_only.descriptor().at(0),
            8,
        ),
        (
            "write to a local-only region",
            local_only.descriptor().at(0),
            8,
        ),
    ];
    // On verbs every refusal ends its connection: give each a fresh one.
    let survives = survives_refusals(provider);
    let fresh = |p: &mut Pair| {
        if !survives {
            p.reconnect();
        }
    };
    for (i, (what, remote, len)) in cases.iter().enumerate() {
        fresh(&mut p);
        p.ep.write(i as u64, &src, 0, *len, *remote).unwrap();
        let c = poll_one(&mut p.cq);
        assert_eq!(
            (c.wr_id, c.status),
            (i as u64, Status::RemoteAccess),
            "{what}: {c:?}"
        );
        assert_eq!(c.opcode, Opcode::Write, "{what}");
    }
    let dst = p.domain.register(4096, Access::LOCAL).unwrap();
    fresh(&mut p);
    p.ep.read(50, &dst, 0, 8, write_only.descriptor().at(0))
        .unwrap();
    assert_eq!(
        poll_one(&mut p.cq).status,
        Status::RemoteAccess,
        "read without REMOTE_READ"
    );
    fresh(&mut p);
    p.ep.fetch_add(51, &dst, 0, write_only.descriptor().at(0), 1)
        .unwrap();
    assert_eq!(
        poll_one(&mut p.cq).status,
        Status::RemoteAccess,
        "atomic without REMOTE_ATOMIC"
    );
    fresh(&mut p);
    p.target.post_recv(99).unwrap();
    p.ep.write_with_imm(52, &src, 0, 8, read_only.descriptor().at(0), 7)
        .unwrap();
    assert_eq!(
        poll_one(&mut p.cq).status,
        Status::RemoteAccess,
        "write-with-immediate without REMOTE_WRITE"
    );
    // A refused write-with-immediate consumed no receive. (On verbs the
    // target's queue pair stopped too, which may flush the receive: that is
    // an error completion, never a delivered immediate.)
    let mut buf = [Completion::EMPTY; 4];
    let n = p.target_cq.poll(&mut buf);
    if survives {
        assert_eq!(n, 0, "the target saw a completion: {:?}", &buf[..1]);
    } else {
        assert!(
            buf[..n].iter().all(|c| !c.status.is_ok()),
            "the target received a refused immediate: {:?}",
            &buf[..n]
        );
    }
    fresh(&mut p);
    p.ep.fetch_add(53, &dst, 0, d.at(4), 1).unwrap();
    assert!(
        matches!(
            poll_one(&mut p.cq).status,
            Status::RemoteOperation | Status::RemoteAccess
        ),
        "a misaligned atomic must fail"
    );
    for (name, region) in [
        ("full", &full),
        ("read_only", &read_only),
        ("write_only", &write_only),
        ("local_only", &local_only),
        ("other", &other),
    ] {
        assert!(
            region.read_to_vec(..).iter().all(|&b| b == 0),
            "{name} region was touched"
        );
    }
    assert_eq!(
        p.target_cq.poll(&mut buf),
        0,
        "the target saw a completion: {:?}",
        &buf[..1]
    );
    // And the connection still works, with the receive still posted (tcp
    // and shm). On verbs the receive went with its connection; the one
    // made for the misaligned atomic works (the provider refuses those
    // without the NIC, so they do not end a connection).
    if !survives {
        p.target.post_recv(99).unwrap();
    }
    p.ep.write_with_imm(60, &src, 0, 8, d.at(0), 8).unwrap();
    assert_eq!(poll_one(&mut p.cq).status, Status::Success);
    let c = poll_one(&mut p.target_cq);
    assert_eq!((c.wr_id, c.imm, c.status), (99, 8, Status::Success));
    assert_eq!(full.read_to_vec(..8), [0xEE; 8]);
}

/// Zero-length operations name no memory: like a NIC, no rkey is checked,
/// and a zero-length write-with-immediate still delivers its immediate.
#[rstest]
#[case::tcp("tcp")]
#[case::shm("shm")]
#[ignore = "needs an RDMA device: scripts/test-verbs.sh runs it under Soft-RoCE (--features verbs)"]
#[case::verbs(verbs())]
fn zero_length_operations_check_no_rkey(#[case] provider: &str) {
    let mut p = Pair::new(provider);
    let region = p.target_domain.register(4096, Access::ALL).unwrap();
    let src = p.domain.register(64, Access::LOCAL).unwrap();
    let bogus = RemoteAddr {
        addr: 8,
        rkey: 0xDEAD_BEEF,
    };
    p.ep.write(1, &src, 0, 0, bogus).unwrap();
    p.ep.read(2, &src, 0, 0, bogus).unwrap();
    p.target.post_recv(3).unwrap();
    p.ep.write_with_imm(4, &src, 0, 0, region.descriptor().at(0), 99)
        .unwrap();
    for c in poll_n(&mut p.cq, 3) {
        assert_eq!((c.status, c.byte_len), (Status::Success, 0), "{c:?}");
    }
    let c = poll_one(&mut p.target_cq);
    assert_eq!((c.wr_id, c.imm, c.byte_len), (3, 99, 0));
}

/// Local mistakes are errors at once, not completions.
#[rstest]
#[case::tcp("tcp")]
#[case::shm("shm")]
#[ignore = "needs an RDMA device: scripts/test-verbs.sh runs it under Soft-RoCE (--features verbs)"]
#[case::verbs(verbs())]
fn local_mistakes_are_errors(#[case] provider: &str) {
    let p = Pair::new(provider);
    let target = p.target_domain.register(4096, Access::ALL).unwrap();
    let src = p.domain.register(4096, Access::LOCAL).unwrap();
    let other = p
        .fabric
        .domain()
        .unwrap()
        .register(4096, Access::LOCAL)
        .unwrap();
    let remote = target.descriptor().at(0);
    assert!(matches!(
        p.ep.write(1, &src, 4000, 200, remote),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        p.ep.read(1, &src, usize::MAX, 2, remote),
        Err(Error::InvalidArgument(_))
    ));
    assert!(matches!(
        p.ep.write(1, &other, 0, 8, remote),
        Err(Error::DomainMismatch(_))
    ));
    assert!(matches!(
        p.ep.fetch_add(1, &src, 4, remote, 1),
        Err(Error::InvalidArgument(_))
    ));
}

/// `wait` sleeps until a completion comes, and times out when none does.
#[rstest]
#[case::tcp("tcp")]
#[case::shm("shm")]
#[ignore = "needs an RDMA device: scripts/test-verbs.sh runs it under Soft-RoCE (--features verbs)"]
#[case::verbs(verbs())]
fn wait_wakes_on_a_completion_and_times_out(#[case] provider: &str) {
    let Pair {
        target_domain,
        mut target_cq,
        target,
        domain,
        mut cq,
        ep,
        listener: _listener,
        fabric: _fabric,
        ..
    } = Pair::new(provider);
    let region = target_domain.register(4096, Access::REMOTE_WRITE).unwrap();
    let mut out = [Completion::EMPTY; 4];
    let start = Instant::now();
    assert_eq!(
        target_cq.wait(&mut out, Duration::from_millis(50)).unwrap(),
        0
    );
    assert!(
        start.elapsed() >= Duration::from_millis(45),
        "wait returned early: {:?}",
        start.elapsed()
    );

    target.post_recv(77).unwrap();
    let remote = region.descriptor().at(0);
    let waiter = thread_id();
    let writer = std::thread::spawn(move || {
        let src = domain.register(64, Access::LOCAL).unwrap();
        // Written while the target sleeps in `wait`: it must be woken.
        wait_until_asleep(std::process::id(), waiter);
        ep.write_with_imm(1, &src, 0, 64, remote, 0xABCD).unwrap();
        assert_eq!(poll_one(&mut cq).status, Status::Success);
        (ep, cq)
    });
    let start = Instant::now();
    let n = target_cq.wait(&mut out, TIMEOUT).unwrap();
    assert_eq!(n, 1, "wait returned without a completion");
    assert_eq!(
        (out[0].wr_id, out[0].opcode, out[0].imm, out[0].byte_len),
        (77, Opcode::RecvWithImm, 0xABCD, 64)
    );
    assert!(start.elapsed() < Duration::from_secs(5));
    let _keep = writer.join().unwrap();
}

/// A write completes at the initiator even when the target's owner polled
/// it in, then stopped polling: acknowledgements need no application.
#[rstest]
#[case::tcp("tcp")]
#[case::shm("shm")]
#[ignore = "needs an RDMA device: scripts/test-verbs.sh runs it under Soft-RoCE (--features verbs)"]
#[case::verbs(verbs())]
fn writes_complete_after_the_target_stops_polling(#[case] provider: &str) {
    let mut p = Pair::new(provider);
    let region = p
        .target_domain
        .register(4096, Access::REMOTE_WRITE)
        .unwrap();
    let src = p.domain.register(64, Access::LOCAL).unwrap();
    p.target.post_recv(1).unwrap();
    p.ep.write_with_imm(2, &src, 0, 64, region.descriptor().at(0), 3)
        .unwrap();
    // The target polls hot until the request is in, then turns away.
    let c = poll_one(&mut p.target_cq);
    assert_eq!((c.wr_id, c.imm), (1, 3));
    let start = Instant::now();
    let c = poll_one(&mut p.cq);
    assert_eq!(
        (c.wr_id, c.opcode, c.status),
        (2, Opcode::WriteWithImm, Status::Success)
    );
    assert!(
        start.elapsed() < Duration::from_secs(1),
        "the completion took {:?}",
        start.elapsed()
    );
}

/// A peer that closes: posted receives, outstanding and later operations
/// (a later batch's writes too, each) complete with an error.
#[rstest]
#[case::tcp("tcp")]
#[case::shm("shm")]
#[ignore = "needs an RDMA device: scripts/test-verbs.sh runs it under Soft-RoCE (--features verbs)"]
#[case::verbs(verbs())]
fn closed_peer_fails_operations(#[case] provider: &str) {
    let mut p = Pair::new(provider);
    let region = p.target_domain.register(4096, Access::ALL).unwrap();
    let src = p.domain.register(4096, Access::LOCAL).unwrap();
    p.ep.post_recv(5).unwrap();
    drop(p.target);
    let start = Instant::now();
    let c = poll_one(&mut p.cq);
    assert_eq!(
        (c.wr_id, c.status),
        (5, Status::PeerLost),
        "posted receive: {c:?}"
    );
    p.ep.write(6, &src, 0, 8, region.descriptor().at(0))
        .unwrap();
    let c = poll_one(&mut p.cq);
    assert_eq!(
        (c.wr_id, c.status),
        (6, Status::PeerLost),
        "later write: {c:?}"
    );
    assert!(
        start.elapsed() < Duration::from_secs(2),
        "peer loss took {:?}",
        start.elapsed()
    );
    let later: Vec<WriteRequest<'_>> = (7..10)
        .map(|i| WriteRequest {
            wr_id: i,
            local: &src,
            offset: 0,
            len: 8,
            remote: region.descriptor().at(0),
            imm: Some(i as u32),
            unsignaled: false,
        })
        .collect();
    p.ep.write_batch(&later).unwrap();
    let got: Vec<_> = poll_n(&mut p.cq, 3)
        .iter()
        .map(|c| (c.wr_id, c.opcode, c.status))
        .collect();
    let want: Vec<_> = (7..10)
        .map(|i| (i, Opcode::WriteWithImm, Status::PeerLost))
        .collect();
    assert_eq!(got, want, "a later batch");
}

/// A peer process killed with SIGKILL: outstanding and later operations
/// complete with an error within a bounded time.
#[rstest]
#[case::tcp("tcp")]
#[case::shm("shm")]
#[ignore = "needs an RDMA device: scripts/test-verbs.sh runs it under Soft-RoCE (--features verbs)"]
#[case::verbs(verbs())]
fn killed_peer_process_fails_operations(#[case] provider: &str) {
    let mut probe = Probe::serve(provider, &listen_addr(provider));
    let fabric = Fabric::open(provider).unwrap();
    let domain = fabric.domain().unwrap();
    let mut cq = fabric.completion_queue(1024).unwrap();
    let ep = domain
        .connect(probe.addr(), &mut cq, &EndpointOptions::default())
        .unwrap();
    let local = domain.register(4096, Access::LOCAL).unwrap();
    ep.fetch_add(1, &local, 0, probe.remote(), 1).unwrap();
    assert_eq!(
        poll_one(&mut cq).status,
        Status::Success,
        "the probe works before it is killed"
    );
    ep.post_recv(2).unwrap();
    probe.kill();
    let start = Instant::now();
    let c = poll_one(&mut cq);
    assert_eq!(
        (c.wr_id, c.status),
        (2, Status::PeerLost),
        "posted receive: {c:?}"
    );
    for i in 0..3 {
        ep.read(10 + i, &local, 0, 64, probe.remote()).unwrap();
        let c = poll_one(&mut cq);
        assert_eq!((c.wr_id, c.opcode), (10 + i, Opcode::Read));
        assert!(!c.status.is_ok(), "an operation on a dead peer succeeded");
    }
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "peer loss took {:?}",
        start.elapsed()
    );
}

/// What the fabric logs through `tracing`, captured for assertions.
#[derive(Clone, Default)]
struct CapturedLog(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl CapturedLog {
    /// Installs the process-wide subscriber once and returns its buffer.
    fn install() -> CapturedLog {
        static LOG: std::sync::OnceLock<CapturedLog> = std::sync::OnceLock::new();
        LOG.get_or_init(|| {
            let log = CapturedLog::default();
            let writer = log.clone();
            tracing_subscriber::fmt()
                .with_ansi(false)
                .with_writer(move || writer.clone())
                .init();
            log
        })
        .clone()
    }

    fn contents(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

impl std::io::Write for CapturedLog {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(bytes);
        Ok(bytes.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Malformed bytes close only their own connection, with a logged reason.
#[test]
fn tcp_malformed_bytes_close_only_that_connection() {
    use std::io::{Read, Write};
    let log = CapturedLog::install();
    let fabric = Fabric::open("tcp").unwrap();
    let listener = fabric.listen("127.0.0.1:0").unwrap();
    let addr = listener.local_addr();
    let domain = fabric.domain().unwrap();
    let region = domain.register(4096, Access::ALL).unwrap();
    let mut target_cq = fabric.completion_queue(4096).unwrap();
    let opts = EndpointOptions::default();

    // A good connection first.
    let good_domain = fabric.domain().unwrap();
    let mut good_cq = fabric.completion_queue(1024).unwrap();
    let (_good_target, good) = connect_pair(
        &listener,
        &domain,
        &mut target_cq,
        &good_domain,
        &mut good_cq,
        &opts,
    );

    // A rogue peer: a valid hello, then garbage.
    let mut rogue = std::net::TcpStream::connect(&addr).unwrap();
    let hello = rfaas_proto::tcp_frame::FrameHeader::hello(16, 16).encode();
    rogue.write_all(&hello).unwrap();
    let _rogue_target = listener
        .accept(&domain, &mut target_cq, &opts, Some(TIMEOUT))
        .unwrap();
    let mut theirs = [0u8; 40];
    rogue.read_exact(&mut theirs).unwrap();
    rogue.write_all(&[0xFF; 64]).unwrap();
    rogue.set_read_timeout(Some(TIMEOUT)).unwrap();
    let mut rest = Vec::new();
    // The target drops the connection (the progress thread serves it).
    let n = rogue.read_to_end(&mut rest);
    assert!(
        matches!(n, Ok(0)) || n.is_err(),
        "the rogue connection stayed open: {n:?}"
    );
    let logged = log.contents();
    assert!(
        logged.contains("protocol violation: malformed frame: unknown frame kind 255"),
        "the reason was not logged: {logged:?}"
    );
    assert!(region.read_to_vec(..).iter().all(|&b| b == 0));

    // The good connection carries on.
    let local = good_domain.register(8, Access::LOCAL).unwrap();
    good.fetch_add(1, &local, 0, region.descriptor().at(0), 3)
        .unwrap();
    assert_eq!(poll_one(&mut good_cq).status, Status::Success);
    assert_eq!(region.read_u64(0), 3);
}

/// A queue too shallow for its endpoints is refused, not overrun later.
#[test]
fn tcp_completion_queue_must_fit_its_endpoints() {
    let fabric = Fabric::open("tcp").unwrap();
    let listener = fabric.listen("127.0.0.1:0").unwrap();
    let domain = fabric.domain().unwrap();
    let mut cq = fabric.completion_queue(16).unwrap();
    let err = domain
        .connect(&listener.local_addr(), &mut cq, &EndpointOptions::default())
        .unwrap_err();
    assert!(
        matches!(err, Error::InvalidArgument(ref m) if m.contains("completion queue")),
        "{err}"
    );
}

#[test]
fn unknown_providers_are_named_in_the_error() {
    for bad in ["", "udp", "verbs:", "TCP"] {
        let err = Fabric::open(bad).unwrap_err();
        assert!(
            err.to_string().contains("unknown fabric provider"),
            "{bad}: {err}"
        );
    }
}

#[cfg(not(feature = "verbs"))]
#[test]
fn verbs_without_the_feature_says_how_to_get_it() {
    let err = Fabric::open("verbs:rxe0").unwrap_err();
    assert!(err.to_string().contains("--features verbs"), "{err}");
}

/// A region kept in a file (`Buffer::map_file`) takes remote atomics and
/// reads like any other, refuses writes it was not given, and its words
/// are in the file: mapped again after everything is dropped, they are
/// still there. On shm only a peer that agreed to map file-backed regions
/// (`EndpointOptions::map_file_regions`) reaches it.
#[rstest]
#[case::tcp("tcp")]
#[case::shm("shm")]
#[ignore = "needs an RDMA device: scripts/test-verbs.sh runs it under Soft-RoCE (--features verbs)"]
#[case::verbs(verbs())]
fn a_file_backed_region_keeps_remote_atomics_in_its_file(#[case] provider: &str) {
    let path = std::env::temp_dir().join(format!(
        "rfaas-conformance-file-region-{}-{}",
        std::process::id(),
        provider.replace(':', "-")
    ));
    let page = rfaas_fabric::page_size();
    let open = || {
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .unwrap()
    };
    let file = open();
    file.set_len(page as u64).unwrap();
    let opts = EndpointOptions {
        map_file_regions: true,
        ..EndpointOptions::default()
    };
    {
        let mut p = Pair::with(provider, &opts, 1024);
        let buf = rfaas_fabric::Buffer::map_file(file, 128).unwrap();
        assert!(buf.is_file_backed());
        let region = p
            .target_domain
            .register_buffer(buf, Access::REMOTE_ATOMIC | Access::REMOTE_READ)
            .unwrap();
        assert_eq!(region.len(), 128);
        let local = p.domain.register(64, Access::LOCAL).unwrap();
        for (i, word) in [0u64, 8, 120].iter().enumerate() {
            p.ep.fetch_add(i as u64, &local, 0, at(&region, *word), 5 + *word)
                .unwrap();
            let c = poll_one(&mut p.cq);
            assert_eq!((c.opcode, c.status), (Opcode::FetchAdd, Status::Success));
        }
        p.ep.read(9, &local, 8, 16, at(&region, 0)).unwrap();
        assert_eq!(poll_one(&mut p.cq).status, Status::Success);
        assert_eq!((local.read_u64(8), local.read_u64(16)), (5, 13));
        p.ep.write(10, &local, 0, 8, at(&region, 0)).unwrap();
        assert_eq!(poll_one(&mut p.cq).status, Status::RemoteAccess);
        if survives_refusals(provider) {
            // Past the end of the 128 bytes, though inside the file's page.
            p.ep.fetch_add(11, &local, 0, at(&region, 128), 1).unwrap();
            assert_eq!(poll_one(&mut p.cq).status, Status::RemoteAccess);
        }
        if provider == "shm" {
            // A peer that did not agree to map files is refused the region.
            let wary = p.fabric.domain().unwrap();
            let mut wary_cq = p.fabric.completion_queue(1024).unwrap();
            let (_target, ep) = connect_pair(
                &p.listener,
                &p.target_domain,
                &mut p.target_cq,
                &wary,
                &mut wary_cq,
                &EndpointOptions::default(),
            );
            let scratch = wary.register(8, Access::LOCAL).unwrap();
            ep.fetch_add(12, &scratch, 0, at(&region, 0), 1).unwrap();
            assert_eq!(poll_one(&mut wary_cq).status, Status::RemoteAccess);
        }
        drop(region);
    }
    let again = rfaas_fabric::Buffer::map_file(open(), 128).unwrap();
    let mut words = [0u8; 128];
    // SAFETY: the mapping is ours alone and `words` is 128 bytes.
    unsafe { std::ptr::copy_nonoverlapping(again.as_ptr(), words.as_mut_ptr(), 128) };
    let word = |at: usize| u64::from_ne_bytes(words[at..at + 8].try_into().unwrap());
    assert_eq!((word(0), word(8), word(120), word(16)), (5, 13, 125, 0));
    drop(again);
    let _ = std::fs::remove_file(&path);
}

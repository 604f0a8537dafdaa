//! Tests that need an RDMA device: they run under Soft-RoCE in a VM.
//!
//! Each is `#[ignore]`d with the reason, so a plain `cargo test` lists them
//! as ignored rather than passing them silently. `scripts/test-verbs.sh`
//! builds this binary on the host and runs `verbs::tests:: --include-ignored`
//! in a VM with Soft-RoCE, where `RDMA_DEVICE` names the device (`rxe0`) and
//! `RDMA_VM_IP` the address on its netdev (rdma_cm cannot use 127.0.0.1).

use std::io::Write as _;
use std::time::{Duration, Instant};

use crate::provider::{Endpoint as _, Local, LocalWord, Write};
use rfaas_testkit::wait::{thread_id, wait_until, wait_until_asleep};

use crate::testing::{
    connect_pair, listen_addr, rdma_device, rdma_ip, rerun_test, verbs, wait_one, wait_up_to,
    KillOnDrop, Pair, TIMEOUT,
};
use crate::verbs::hello::Hello;
use crate::verbs::{connect, VerbsCq, VerbsEndpoint};
use crate::{
    Access, Completion, CompletionQueue, Endpoint, EndpointOptions, Error, Fabric, Imp, Opcode,
    Status,
};

fn fabric() -> Fabric {
    Fabric::open(verbs()).expect("open the verbs fabric")
}

/// A signaled write-with-immediate of `local` to `remote`.
fn signaled<'a>(wr_id: u64, local: Local<'a>, remote: crate::RemoteAddr, imm: u32) -> Write<'a> {
    Write {
        wr_id,
        local,
        remote,
        imm: Some(imm),
        unsignaled: false,
    }
}

fn verbs_ep(ep: &Endpoint) -> &VerbsEndpoint {
    match &ep.imp {
        Imp::Verbs(v) => v,
        _ => panic!("not a verbs endpoint"),
    }
}

fn verbs_cq(cq: &CompletionQueue) -> &VerbsCq {
    match &cq.imp {
        Imp::Verbs(v) => v,
        _ => panic!("not a verbs completion queue"),
    }
}

fn pair() -> Pair {
    Pair::new(verbs())
}

/// RNR NAKs the device's requesters received, as Soft-RoCE counts them
/// (`rcvd_rnr_err`); `None` on a device that does not.
fn rnr_naks_received() -> Option<u64> {
    let path = format!(
        "/sys/class/infiniband/{}/ports/1/hw_counters/rcvd_rnr_err",
        rdma_device()
    );
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test-verbs.sh (Soft-RoCE in a VM)"]
fn a_missing_device_is_unavailable_and_lists_the_present_ones() {
    let present = rdma_device();
    let err = Fabric::open("verbs:no-such-dev0").unwrap_err();
    let Error::ProviderUnavailable { provider, reason } = &err else {
        panic!("{err:?}")
    };
    assert_eq!(provider, "verbs:no-such-dev0");
    assert!(
        reason.contains("no-such-dev0") && reason.contains(&present),
        "{reason}"
    );
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test-verbs.sh (Soft-RoCE in a VM)"]
fn listener_reports_the_port_it_got() {
    let fabric = fabric();
    let listener = fabric.listen(&listen_addr(verbs())).unwrap();
    let addr: std::net::SocketAddr = listener.local_addr().parse().unwrap();
    assert_eq!(addr.ip().to_string(), rdma_ip());
    assert_ne!(addr.port(), 0);
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test-verbs.sh (Soft-RoCE in a VM)"]
fn write_with_immediate_read_and_atomics_round_trrdma_ip() {
    let mut p = pair();
    let mut target = p.target_domain.register(4096, Access::ALL).unwrap();
    target.write_u64(64, 40);
    let mut local = p.domain.register(4096, Access::LOCAL).unwrap();
    local.write_from(0, b"hello, rdma");
    let remote = target.descriptor();

    p.target.post_recv(500).unwrap();
    p.ep.write_with_imm(1, &local, 0, 11, remote.at(0), 0xfeed_beef)
        .unwrap();
    let sent = wait_one(&mut p.cq);
    assert_eq!(
        (sent.wr_id, sent.opcode, sent.status, sent.byte_len),
        (1, Opcode::WriteWithImm, Status::Success, 11)
    );
    let got = wait_one(&mut p.target_cq);
    assert_eq!(
        (got.wr_id, got.opcode, got.status, got.imm, got.byte_len),
        (500, Opcode::RecvWithImm, Status::Success, 0xfeed_beef, 11)
    );
    assert_eq!(target.read_to_vec(..11), b"hello, rdma");

    // A plain write, large enough not to be sent inline.
    let big = 64 * 1024;
    let mut src = p.domain.register(big, Access::LOCAL).unwrap();
    let bytes: Vec<u8> = (0..big).map(|i| (i % 251) as u8).collect();
    src.write_from(0, &bytes);
    let mut dst = p
        .target_domain
        .register(big, Access::REMOTE_WRITE | Access::REMOTE_READ)
        .unwrap();
    p.ep.write(2, &src, 0, big, dst.descriptor().at(0)).unwrap();
    let c = wait_one(&mut p.cq);
    assert_eq!(
        (c.wr_id, c.opcode, c.status, c.byte_len),
        (2, Opcode::Write, Status::Success, big as u32)
    );
    assert_eq!(dst.read_to_vec(..), bytes);

    // Read it back into another local buffer.
    dst.write_from(0, b"read me");
    let sink = p.domain.register(big, Access::LOCAL).unwrap();
    p.ep.read(3, &sink, 0, 7, dst.descriptor().at(0)).unwrap();
    let c = wait_one(&mut p.cq);
    assert_eq!(
        (c.wr_id, c.opcode, c.status, c.byte_len),
        (3, Opcode::Read, Status::Success, 7)
    );
    assert_eq!(sink.read_to_vec(..7), b"read me");

    // Fetch-and-add, then compare-and-swap, on the word at offset 64.
    p.ep.fetch_add(4, &local, 0, remote.at(64), 2).unwrap();
    let c = wait_one(&mut p.cq);
    assert_eq!(
        (c.wr_id, c.opcode, c.status),
        (4, Opcode::FetchAdd, Status::Success)
    );
    assert_eq!(local.read_u64(0), 40, "old value");
    assert_eq!(target.read_u64(64), 42);
    p.ep.compare_swap(5, &local, 8, remote.at(64), 42, 7)
        .unwrap();
    let c = wait_one(&mut p.cq);
    assert_eq!(
        (c.wr_id, c.opcode, c.status),
        (5, Opcode::CompareSwap, Status::Success)
    );
    assert_eq!(local.read_u64(8), 42);
    assert_eq!(target.read_u64(64), 7);
    p.ep.compare_swap(6, &local, 16, remote.at(64), 42, 9)
        .unwrap();
    assert_eq!(wait_one(&mut p.cq).status, Status::Success);
    assert_eq!(local.read_u64(16), 7, "compare failed: old value returned");
    assert_eq!(target.read_u64(64), 7, "and nothing swapped");

    assert_eq!(verbs_cq(&p.cq).shared().slots.in_use(), 0);
    assert_eq!(verbs_cq(&p.target_cq).shared().slots.in_use(), 0);
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test-verbs.sh (Soft-RoCE in a VM)"]
fn a_write_with_immediate_waits_for_a_late_receive() {
    let mut p = pair();
    let target = p
        .target_domain
        .register(4096, Access::REMOTE_WRITE)
        .unwrap();
    let local = p.domain.register(64, Access::LOCAL).unwrap();
    let naks = rnr_naks_received();
    if rdma_device().starts_with("rxe") {
        assert!(naks.is_some(), "Soft-RoCE counts RNR NAKs in rcvd_rnr_err");
    }
    p.ep.write_with_imm(1, &local, 0, 8, target.descriptor().at(0), 7)
        .unwrap();
    // No receive posted yet: the responder answers RNR and the requester
    // retries forever (rnr_retry 7) until one is. Soft-RoCE counts the
    // NAKs; elsewhere the write cannot have completed yet, at least.
    match naks {
        Some(before) => wait_until("an RNR NAK for the write", TIMEOUT, || {
            rnr_naks_received().is_some_and(|now| now > before)
        }),
        None => assert_eq!(p.cq.poll(&mut [Completion::EMPTY; 1]), 0),
    }
    p.target.post_recv(9).unwrap();
    let got = wait_one(&mut p.target_cq);
    assert_eq!((got.wr_id, got.status, got.imm), (9, Status::Success, 7));
    assert_eq!(wait_one(&mut p.cq).status, Status::Success);
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test-verbs.sh (Soft-RoCE in a VM)"]
fn a_bad_rkey_is_refused_with_the_target_untouched() {
    let mut p = pair();
    let target = p.target_domain.register(4096, Access::ALL).unwrap();
    let mut local = p.domain.register(64, Access::LOCAL).unwrap();
    local.write_from(0, &[0xab; 64]);
    let mut remote = target.descriptor().at(0);
    remote.rkey ^= 0x00ff_ff00;
    p.target.post_recv(77).unwrap();
    p.ep.write(1, &local, 0, 64, remote).unwrap();
    let c = wait_one(&mut p.cq);
    assert_eq!(
        (c.wr_id, c.opcode, c.status),
        (1, Opcode::Write, Status::RemoteAccess)
    );
    assert!(target.read_to_vec(..).iter().all(|&b| b == 0));
    // An RC queue pair stops at its first error, on both sides.
    assert_eq!(verbs_ep(&p.ep).qp_attributes().unwrap().state, "ERR");
    let err =
        p.ep.write(2, &local, 0, 8, target.descriptor().at(0))
            .unwrap_err();
    assert!(matches!(err, Error::Disconnected { .. }), "{err:?}");
    if rdma_device().starts_with("rxe") {
        // Soft-RoCE stops the target's QP too: its receive flushes, and the
        // next post says why instead of flushing silently.
        let c = wait_one(&mut p.target_cq);
        assert_eq!((c.wr_id, c.status), (77, Status::Flushed));
        let err = p.target.post_recv(78).unwrap_err().to_string();
        assert!(err.contains("error completion"), "{err}");
    }
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test-verbs.sh (Soft-RoCE in a VM)"]
fn out_of_bounds_and_missing_rights_are_remote_access_errors() {
    // Each case needs a fresh connection: the first error stops the QP.
    let cases: [(&str, Access, u64, usize); 3] = [
        ("past the end", Access::ALL, 4096 - 8, 64),
        ("read-only region", Access::REMOTE_READ, 0, 8),
        ("no remote rights", Access::LOCAL, 0, 8),
    ];
    for (what, access, offset, len) in cases {
        let mut p = pair();
        let target = p.target_domain.register(4096, access).unwrap();
        let local = p.domain.register(64, Access::LOCAL).unwrap();
        p.ep.write(1, &local, 0, len, target.descriptor().at(offset))
            .unwrap();
        let c = wait_one(&mut p.cq);
        assert_eq!(c.status, Status::RemoteAccess, "{what}");
        assert!(
            target.read_to_vec(..).iter().all(|&b| b == 0),
            "{what}: target untouched"
        );
    }
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test-verbs.sh (Soft-RoCE in a VM)"]
fn an_rkey_of_another_domain_is_refused() {
    let mut p = pair();
    // Same process, same device, another protection domain (another lease).
    let other = p.fabric.domain().unwrap();
    let foreign = other.register(4096, Access::ALL).unwrap();
    let local = p.domain.register(64, Access::LOCAL).unwrap();
    p.ep.write(1, &local, 0, 8, foreign.descriptor().at(0))
        .unwrap();
    assert_eq!(wait_one(&mut p.cq).status, Status::RemoteAccess);
    assert!(foreign.read_to_vec(..).iter().all(|&b| b == 0));
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test-verbs.sh (Soft-RoCE in a VM)"]
fn an_unaligned_atomic_is_an_error_completion() {
    let mut p = pair();
    let target = p.target_domain.register(4096, Access::ALL).unwrap();
    let local = p.domain.register(64, Access::LOCAL).unwrap();
    p.ep.fetch_add(1, &local, 0, target.descriptor().at(4), 1)
        .unwrap();
    p.ep.compare_swap(2, &local, 8, target.descriptor().at(12), 0, 1)
        .unwrap();
    let got = wait_up_to(&mut p.cq, 2, TIMEOUT);
    assert_eq!(
        got.iter()
            .map(|c| (c.wr_id, c.opcode, c.status))
            .collect::<Vec<_>>(),
        [
            (1, Opcode::FetchAdd, Status::RemoteOperation),
            (2, Opcode::CompareSwap, Status::RemoteOperation)
        ]
    );
    assert!(target.read_to_vec(..).iter().all(|&b| b == 0));
    // Caught before the NIC: the endpoint is still usable.
    p.ep.fetch_add(3, &local, 0, target.descriptor().at(8), 5)
        .unwrap();
    assert_eq!(wait_one(&mut p.cq).status, Status::Success);
    assert_eq!(target.read_u64(8), 5);
    // And a sleeping waiter wakes for such a completion.
    let client = verbs_ep(&p.ep);
    let waiter = thread_id();
    std::thread::scope(|s| {
        s.spawn(|| {
            wait_until_asleep(std::process::id(), waiter);
            let word = LocalWord::check(&local, 0, p.domain.id()).unwrap();
            client
                .fetch_add(4, word, target.descriptor().at(1), 1)
                .unwrap();
        });
        let c = wait_one(&mut p.cq);
        assert_eq!((c.wr_id, c.status), (4, Status::RemoteOperation));
    });
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test-verbs.sh (Soft-RoCE in a VM)"]
fn wait_times_out_then_wakes_for_a_completion() {
    let mut p = pair();
    let mut out = [Completion::EMPTY; 4];
    let start = Instant::now();
    assert_eq!(
        p.target_cq
            .wait(&mut out, Duration::from_millis(100))
            .unwrap(),
        0
    );
    let slept = start.elapsed();
    assert!(
        slept >= Duration::from_millis(90),
        "returned after {slept:?}"
    );

    let target = p
        .target_domain
        .register(4096, Access::REMOTE_WRITE)
        .unwrap();
    let local = p.domain.register(64, Access::LOCAL).unwrap();
    p.target.post_recv(1).unwrap();
    let remote = target.descriptor().at(0);
    // The provider endpoint is Sync (the public one is not).
    let client = verbs_ep(&p.ep);
    let waiter = thread_id();
    std::thread::scope(|s| {
        s.spawn(|| {
            wait_until_asleep(std::process::id(), waiter);
            let bytes = Local::check(&local, 0, 8, p.domain.id()).unwrap();
            client.write(signaled(2, bytes, remote, 3)).unwrap();
        });
        let n = p.target_cq.wait(&mut out, TIMEOUT).unwrap();
        assert_eq!(n, 1);
        assert_eq!((out[0].wr_id, out[0].imm), (1, 3));
    });
    // A second wait sleeps again (the CQ is re-armed after the event).
    assert_eq!(
        p.target_cq
            .wait(&mut out, Duration::from_millis(50))
            .unwrap(),
        0
    );
    assert_eq!(wait_one(&mut p.cq).status, Status::Success);
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test-verbs.sh (Soft-RoCE in a VM)"]
fn peer_loss_flushes_posted_receives_and_fails_later_posts() {
    let Pair {
        target,
        mut target_cq,
        ep,
        target_domain,
        cq: _cq,
        domain: _domain,
        listener: _listener,
        fabric: _fabric,
        ..
    } = pair();
    for i in 0..4 {
        target.post_recv(100 + i).unwrap();
    }
    let start = Instant::now();
    drop(ep);
    let flushed = wait_up_to(&mut target_cq, 4, Duration::from_secs(5));
    assert_eq!(
        flushed.len(),
        4,
        "posted receives complete after the peer left: {flushed:?}"
    );
    for c in &flushed {
        assert_eq!(c.opcode, Opcode::RecvWithImm);
        assert_eq!(c.status, Status::PeerLost, "{c:?}");
    }
    assert!(
        start.elapsed() < Duration::from_secs(3),
        "took {:?}",
        start.elapsed()
    );
    // Later posts complete with PeerLost too, as on every provider.
    target.post_recv(200).unwrap();
    let region = target_domain.register(64, Access::LOCAL).unwrap();
    target
        .write(201, &region, 0, 8, Default::default())
        .unwrap();
    let later = wait_up_to(&mut target_cq, 2, Duration::from_secs(1));
    assert_eq!(
        later
            .iter()
            .map(|c| (c.wr_id, c.opcode, c.status))
            .collect::<Vec<_>>(),
        [
            (200, Opcode::RecvWithImm, Status::PeerLost),
            (201, Opcode::Write, Status::PeerLost)
        ]
    );
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test-verbs.sh (Soft-RoCE in a VM)"]
fn dropping_an_endpoint_with_work_outstanding_frees_its_slots() {
    let mut p = pair();
    let target = p
        .target_domain
        .register(1 << 20, Access::REMOTE_WRITE)
        .unwrap();
    let local = p.domain.register(1 << 20, Access::LOCAL).unwrap();
    for i in 0..8 {
        p.ep.write(i, &local, 0, 1 << 20, target.descriptor().at(0))
            .unwrap();
    }
    for i in 0..8 {
        p.ep.post_recv(100 + i).unwrap();
    }
    // A second connection on the same queues, then the first goes.
    let (new_target, new_ep) = connect_pair(
        &p.listener,
        &p.target_domain,
        &mut p.target_cq,
        &p.domain,
        &mut p.cq,
        &EndpointOptions::default(),
    );
    drop(std::mem::replace(&mut p.ep, new_ep));
    assert_eq!(verbs_cq(&p.cq).shared().slots.in_use(), 0);
    drop(std::mem::replace(&mut p.target, new_target));
    // Whatever the provider left in the CQ is stale and skipped: the
    // completion of a write on the new connection, which the NIC produces
    // after the old queue pair was torn down, is the only one to come.
    p.ep.write(9, &local, 0, 8, target.descriptor().at(0))
        .unwrap();
    let mut out = [Completion::EMPTY; 32];
    let mut got = Vec::new();
    wait_until("the new connection's write completes", TIMEOUT, || {
        let n = p.cq.poll(&mut out);
        got.extend_from_slice(&out[..n]);
        !got.is_empty()
    });
    assert_eq!(
        got.iter().map(|c| (c.wr_id, c.status)).collect::<Vec<_>>(),
        [(9, Status::Success)],
        "a stale completion surfaced"
    );
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test-verbs.sh (Soft-RoCE in a VM)"]
fn a_full_completion_queue_refuses_more_work() {
    let fabric = fabric();
    let listener = fabric.listen(&listen_addr(verbs())).unwrap();
    let sd = fabric.domain().unwrap();
    let cd = fabric.domain().unwrap();
    let mut scq = fabric.completion_queue(64).unwrap();
    let mut ccq = fabric.completion_queue(4).unwrap();
    let opts = EndpointOptions::default();
    let (_server, client) = connect_pair(&listener, &sd, &mut scq, &cd, &mut ccq, &opts);
    for i in 0..4 {
        client.post_recv(i).unwrap();
    }
    let err = client.post_recv(4).unwrap_err();
    assert!(
        matches!(
            err,
            Error::QueueFull {
                what: "completion queue",
                depth: 4
            }
        ),
        "{err:?}"
    );
    assert!(err.is_retryable());
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test-verbs.sh (Soft-RoCE in a VM)"]
fn queue_pairs_carry_the_service_level_pkey_index_and_timeouts() {
    let opts = EndpointOptions {
        service_level: 3,
        pkey_index: 0,
        ..EndpointOptions::default()
    };
    let p = Pair::with(verbs(), &opts, 1024);
    for (side, ep) in [("client", &p.ep), ("server", &p.target)] {
        let info = verbs_ep(ep).qp_attributes().unwrap();
        eprintln!("{side}: {info:?}");
        assert_eq!(info.state, "RTS", "{side}");
        assert_eq!(info.pkey_index, 0, "{side}");
        assert_eq!(
            (info.timeout, info.retry_cnt, info.rnr_retry),
            (14, 6, 7),
            "{side}"
        );
        assert_eq!(info.min_rnr_timer, 12, "{side}");
        assert!(
            info.max_rd_atomic > 0 && info.max_dest_rd_atomic > 0,
            "{side}: reads and atomics enabled"
        );
        assert!(
            info.sgid_matches_local_ip,
            "{side}: source GID {} is not the local IP's",
            info.sgid
        );
        assert_eq!(info.expected_sgid_index, Some(info.sgid_index), "{side}");
        assert_eq!(info.sgid_kind, crate::verbs::gid::GidKind::RoceV2, "{side}");
        // Soft-RoCE does not keep the SL in its address vector (it reports
        // 0); a NIC that does must report what was set.
        if !rdma_device().starts_with("rxe") {
            assert_eq!(verbs_ep(ep).qos().unwrap(), (3, 0), "{side}");
        }
    }
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test-verbs.sh (Soft-RoCE in a VM)"]
fn connecting_where_nobody_listens_says_so() {
    let fabric = fabric();
    let domain = fabric.domain().unwrap();
    let mut cq = fabric.completion_queue(8).unwrap();
    // Bind and drop a listener to find a port nobody listens on.
    let port = {
        let l = fabric.listen(&listen_addr(verbs())).unwrap();
        l.local_addr().rsplit(':').next().unwrap().to_owned()
    };
    let addr = format!("{}:{port}", rdma_ip());
    let err = domain
        .connect(&addr, &mut cq, &EndpointOptions::default())
        .unwrap_err();
    let Error::Connect {
        addr: named,
        reason,
    } = &err
    else {
        panic!("{err:?}")
    };
    assert_eq!(named, &addr);
    assert!(reason.contains("nobody is listening"), "{reason}");
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test-verbs.sh (Soft-RoCE in a VM)"]
fn a_peer_without_the_hello_is_refused_on_both_sides() {
    let fabric = fabric();
    let listener = fabric.listen(&listen_addr(verbs())).unwrap();
    let addr = listener.local_addr();
    let sd = fabric.domain().unwrap();
    let cd = fabric.domain().unwrap();
    let mut scq = fabric.completion_queue(8).unwrap();
    let mut ccq = fabric.completion_queue(8).unwrap();
    let opts = EndpointOptions::default();
    let mut wrong = Hello::new(1, 1).encode();
    wrong[4] = 99; // another version
    let (server, client) = std::thread::scope(|s| {
        let server = s.spawn(|| listener.accept(&sd, &mut scq, &opts, Some(TIMEOUT)));
        let Imp::Verbs(vd) = &cd.imp else {
            unreachable!()
        };
        let Imp::Verbs(vcq) = &mut ccq.imp else {
            unreachable!()
        };
        let client = connect::connect_with_hello(vd.inner(), &addr, vcq, &opts, &wrong);
        (server.join().unwrap(), client)
    });
    let server_err = server.unwrap_err().to_string();
    assert!(server_err.contains("version 99"), "{server_err}");
    let client_err = client.unwrap_err().to_string();
    assert!(client_err.contains("another version"), "{client_err}");
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test-verbs.sh (Soft-RoCE in a VM)"]
fn endpoints_share_a_completion_queue() {
    let fabric = fabric();
    let listener = fabric.listen(&listen_addr(verbs())).unwrap();
    let sd = fabric.domain().unwrap();
    let cd = fabric.domain().unwrap();
    let mut scq = fabric.completion_queue(64).unwrap();
    let mut ccq = fabric.completion_queue(64).unwrap();
    let opts = EndpointOptions::default();
    let (s1, c1) = connect_pair(&listener, &sd, &mut scq, &cd, &mut ccq, &opts);
    let (s2, c2) = connect_pair(&listener, &sd, &mut scq, &cd, &mut ccq, &opts);
    let target = sd.register(4096, Access::REMOTE_WRITE).unwrap();
    let local = cd.register(64, Access::LOCAL).unwrap();
    s1.post_recv(1).unwrap();
    s2.post_recv(2).unwrap();
    c1.write_with_imm(10, &local, 0, 8, target.descriptor().at(0), 111)
        .unwrap();
    c2.write_with_imm(20, &local, 0, 8, target.descriptor().at(8), 222)
        .unwrap();
    let mut got = wait_up_to(&mut scq, 2, TIMEOUT);
    got.sort_by_key(|c| c.wr_id);
    assert_eq!(
        got.iter().map(|c| (c.wr_id, c.imm)).collect::<Vec<_>>(),
        [(1, 111), (2, 222)]
    );
    let mut sent = wait_up_to(&mut ccq, 2, TIMEOUT);
    sent.sort_by_key(|c| c.wr_id);
    assert_eq!(sent.iter().map(|c| c.wr_id).collect::<Vec<_>>(), [10, 20]);
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test-verbs.sh (Soft-RoCE in a VM)"]
fn registered_memory_survives_a_fork() {
    let mut p = pair();
    let target = p.target_domain.register(4096, Access::ALL).unwrap();
    let mut local = p.domain.register(4096, Access::LOCAL).unwrap();
    // Executors spawn workers: fork+exec with registered memory around.
    let status = std::process::Command::new("true")
        .status()
        .expect("spawn `true`");
    assert!(status.success());
    local.write_from(0, b"after fork");
    p.ep.write(1, &local, 0, 10, target.descriptor().at(0))
        .unwrap();
    assert_eq!(wait_one(&mut p.cq).status, Status::Success);
    assert_eq!(target.read_to_vec(..10), b"after fork");
    p.ep.read(2, &local, 100, 10, target.descriptor().at(0))
        .unwrap();
    assert_eq!(wait_one(&mut p.cq).status, Status::Success);
    assert_eq!(local.read_to_vec(100..110), b"after fork");
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test-verbs.sh (Soft-RoCE in a VM)"]
fn a_silent_peer_is_detected_by_transport_retries() {
    let mut p = pair();
    let target = p.target_domain.register(4096, Access::ALL).unwrap();
    let local = p.domain.register(64, Access::LOCAL).unwrap();
    verbs_ep(&p.target).go_silent();
    let start = Instant::now();
    p.ep.write(1, &local, 0, 8, target.descriptor().at(0))
        .unwrap();
    p.ep.post_recv(2).unwrap();
    let got = wait_up_to(&mut p.cq, 2, Duration::from_secs(10));
    let took = start.elapsed();
    eprintln!("silent peer noticed after {took:?}: {got:?}");
    assert_eq!(got.len(), 2, "{got:?}");
    assert!(got.iter().all(|c| c.status == Status::PeerLost), "{got:?}");
    // ACK timeout 14 (67 ms) x 7 tries, with slack for emulation.
    assert!(took < Duration::from_secs(5), "took {took:?}");
    p.ep.post_recv(3).unwrap();
    let c = wait_one(&mut p.cq);
    assert_eq!((c.wr_id, c.status), (3, Status::PeerLost), "a later post");
}

const CHILD_ADDR: &str = "RFAAS_VERBS_TEST_CHILD_ADDR";

#[test]
#[ignore = "needs an RDMA device: run scripts/test-verbs.sh (Soft-RoCE in a VM)"]
fn a_killed_peer_process_flushes_posted_receives() {
    const NAME: &str = "verbs::tests::a_killed_peer_process_flushes_posted_receives";
    if let Ok(addr) = std::env::var(CHILD_ADDR) {
        // Child: connect, say so, and die without closing anything.
        let fabric = fabric();
        let domain = fabric.domain().unwrap();
        let mut cq = fabric.completion_queue(8).unwrap();
        let _ep = domain
            .connect(&addr, &mut cq, &EndpointOptions::default())
            .unwrap();
        // Dies once the parent has posted its receives.
        let mut go = String::new();
        std::io::stdin().read_line(&mut go).unwrap();
        std::process::abort();
    }
    let fabric = fabric();
    let listener = fabric.listen(&listen_addr(verbs())).unwrap();
    let domain = fabric.domain().unwrap();
    let mut cq = fabric.completion_queue(16).unwrap();
    let mut child = KillOnDrop(
        rerun_test(NAME)
            .env(CHILD_ADDR, listener.local_addr())
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    let server = listener
        .accept(&domain, &mut cq, &EndpointOptions::default(), Some(TIMEOUT))
        .unwrap();
    for i in 0..3 {
        server.post_recv(i).unwrap();
    }
    let stdin = child.0.stdin.as_mut().unwrap();
    stdin.write_all(b"die\n").unwrap();
    let start = Instant::now();
    let status = child.0.wait().unwrap();
    assert!(!status.success(), "the child aborts");
    let got = wait_up_to(&mut cq, 3, Duration::from_secs(5));
    eprintln!(
        "peer death noticed {:?} after the child exited: {got:?}",
        start.elapsed()
    );
    assert_eq!(got.len(), 3, "{got:?}");
    assert!(
        got.iter()
            .all(|c| c.status == Status::PeerLost && c.opcode == Opcode::RecvWithImm),
        "{got:?}"
    );
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test-verbs.sh (Soft-RoCE in a VM)"]
fn a_pkey_index_outside_the_table_is_a_clear_error() {
    let fabric = fabric();
    let listener = fabric.listen(&listen_addr(verbs())).unwrap();
    let sd = fabric.domain().unwrap();
    let cd = fabric.domain().unwrap();
    let mut scq = fabric.completion_queue(8).unwrap();
    let mut ccq = fabric.completion_queue(8).unwrap();
    let bad = EndpointOptions {
        pkey_index: 1000,
        connect_timeout: Duration::from_secs(3),
        ..EndpointOptions::default()
    };
    let addr = listener.local_addr();
    let (server, client) = std::thread::scope(|s| {
        let server = s.spawn(|| {
            listener.accept(
                &sd,
                &mut scq,
                &EndpointOptions::default(),
                Some(Duration::from_secs(5)),
            )
        });
        let client = cd.connect(&addr, &mut ccq, &bad);
        (server.join().unwrap(), client)
    });
    let err = client.unwrap_err().to_string();
    assert!(
        err.contains("P_Key index 1000") && err.contains(&rdma_device()),
        "{err}"
    );
    assert!(server.is_err(), "nobody connected");
    // Soft-RoCE has only the default P_Key, at index 0: index 1 is refused too.
    if rdma_device().starts_with("rxe") {
        let next = EndpointOptions {
            pkey_index: 1,
            ..bad
        };
        let err = cd.connect(&addr, &mut ccq, &next).unwrap_err().to_string();
        assert!(err.contains("P_Key index 1 "), "{err}");
    }
}

fn verbs_cq_mut(cq: &mut CompletionQueue) -> &mut VerbsCq {
    match &mut cq.imp {
        Imp::Verbs(v) => v,
        _ => panic!("not a verbs completion queue"),
    }
}

#[test]
#[ignore = "needs an RDMA device: run scripts/test-verbs.sh (Soft-RoCE in a VM)"]
fn a_completion_between_poll_and_arm_still_wakes_the_waiter() {
    let mut p = pair();
    let target = p
        .target_domain
        .register(4096, Access::REMOTE_WRITE)
        .unwrap();
    let local = p.domain.register(64, Access::LOCAL).unwrap();
    p.target.post_recv(7).unwrap();
    let remote = target.descriptor().at(0);
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    let (landed_tx, landed_rx) = std::sync::mpsc::channel::<()>();
    // Between wait's first (empty) poll and arming the CQ, the client
    // writes and the completion lands: no event will ever announce it.
    verbs_cq_mut(&mut p.target_cq).before_arm = Some(Box::new(move || {
        let _ = go_tx.send(());
        let _ = landed_rx.recv();
    }));
    let client = verbs_ep(&p.ep);
    let domain = p.domain.id();
    let client_cq = &mut p.cq;
    let mut out = [Completion::EMPTY; 4];
    std::thread::scope(|s| {
        s.spawn(move || {
            go_rx.recv().unwrap();
            let bytes = Local::check(&local, 0, 8, domain).unwrap();
            client.write(signaled(1, bytes, remote, 9)).unwrap();
            // The responder completes the receive before it acknowledges
            // the write: once the write completes here, the receive's
            // completion is in the waiter's queue.
            assert_eq!(wait_one(client_cq).status, Status::Success);
            landed_tx.send(()).unwrap();
        });
        let start = Instant::now();
        let n = p.target_cq.wait(&mut out, Duration::from_secs(10)).unwrap();
        assert_eq!(n, 1, "the waiter missed the completion");
        assert_eq!((out[0].wr_id, out[0].imm), (7, 9));
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "the waiter slept past the completion: {:?}",
            start.elapsed()
        );
    });
    verbs_cq_mut(&mut p.target_cq).before_arm = None;
}

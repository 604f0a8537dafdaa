//! `rfaas-executord` as a black box: the real daemon and real workers,
//! spoken to with control frames over TCP and its local socket.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::time::{Duration, Instant};

use rfaas_client::{AllocationSpec, Client, ClientOptions};
use rfaas_executor::daemon::Config;
use rfaas_proto::control::client::{
    AllocateOk, AllocateRequest, Deallocate, Deallocated, ExitCause, WorkerExited,
};
use rfaas_proto::control::local::{LocalReply, LocalRequest};
use rfaas_proto::control::{ErrorCode, ErrorReply, Frame, FrameHeader, FrameLimits, Kind};
use rfaas_proto::lease::LeaseSigner;
use rfaas_testkit::executord::{request, Executord, ExecutordOptions};
use rfaas_testkit::functions::{c_library_bytes, CrashOnce};
use rfaas_testkit::process::wait_gone;
use rfaas_testkit::wait::poll_for;

const DAEMON: &str = env!("CARGO_BIN_EXE_rfaas-executord");
const MINUTE: Duration = Duration::from_secs(60);

fn start(opts: ExecutordOptions) -> Executord {
    Executord::start(Path::new(DAEMON), opts)
}

/// The client side of the control protocol, by hand.
struct Control {
    stream: TcpStream,
    next_id: u64,
}

impl Control {
    fn connect(d: &Executord) -> Control {
        let stream = TcpStream::connect(d.control_addr()).expect("connect to the daemon");
        stream.set_read_timeout(Some(MINUTE)).unwrap();
        Control { stream, next_id: 1 }
    }

    fn send(&mut self, frame: &Frame) {
        frame.write_to(&mut self.stream).expect("send a frame");
    }

    fn recv(&mut self) -> Frame {
        Frame::read_from(&mut self.stream, FrameLimits::default()).expect("a frame from the daemon")
    }

    /// Whether the daemon closed the connection (EOF within a minute).
    fn closed(&mut self) -> bool {
        let mut b = [0u8; 1];
        matches!(self.stream.read(&mut b), Ok(0))
    }

    fn allocate_frame(&mut self, mut req: AllocateRequest, library: Vec<u8>) -> Frame {
        req.request_id = self.next_id;
        self.next_id += 1;
        self.send(&Frame::new(&req, library));
        let reply = self.recv();
        if reply.kind == Kind::Error {
            let e: ErrorReply = reply.parse().unwrap();
            assert_eq!(
                e.request_id, req.request_id,
                "the reply repeats the request id"
            );
        }
        reply
    }

    fn allocate(
        &mut self,
        req: AllocateRequest,
        library: Vec<u8>,
    ) -> Result<AllocateOk, ErrorReply> {
        let id = self.next_id;
        let reply = self.allocate_frame(req, library);
        match reply.kind {
            Kind::AllocateOk => {
                let ok: AllocateOk = reply.parse().unwrap();
                assert_eq!(ok.request_id, id);
                Ok(ok)
            }
            Kind::Error => Err(reply.parse().unwrap()),
            other => panic!("unexpected reply {other:?}"),
        }
    }

    fn deallocate(&mut self, allocation_id: u64) -> Frame {
        let request_id = self.next_id;
        self.next_id += 1;
        self.send(&Frame::new(
            &Deallocate {
                request_id,
                allocation_id,
            },
            Vec::new(),
        ));
        self.recv()
    }

    fn worker_exited(&mut self) -> WorkerExited {
        let f = self.recv();
        f.parse().unwrap_or_else(|e| {
            panic!(
                "expected WorkerExited: {e}: {:?}",
                String::from_utf8_lossy(&f.json)
            )
        })
    }
}

fn good_request(d: &Executord, cores: u16) -> AllocateRequest {
    request(
        d.token("nobody", cores, 2048, MINUTE),
        cores,
        &["echo", "noop"],
    )
}

fn status(
    d: &Executord,
) -> (
    bool,
    Vec<u32>,
    u32,
    u32,
    Vec<rfaas_proto::control::local::AllocationStatus>,
) {
    match d.status() {
        LocalReply::Status {
            draining,
            free_cpus,
            free_memory_mib,
            pool_idle,
            allocations,
            ..
        } => (draining, free_cpus, free_memory_mib, pool_idle, allocations),
        other => panic!("expected a status reply, got {other:?}"),
    }
}

fn pid_of(d: &Executord, allocation_id: u64) -> u32 {
    let (_, _, _, _, allocs) = status(d);
    let a = allocs
        .iter()
        .find(|a| a.allocation_id == allocation_id)
        .unwrap_or_else(|| panic!("allocation {allocation_id} not in the status: {allocs:?}"));
    assert_ne!(a.pid, 0);
    a.pid
}

fn process_exists(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

fn uid_of(pid: u32) -> u32 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = s.lines().find(|l| l.starts_with("Uid:")).unwrap();
    line.split_whitespace().nth(2).unwrap().parse().unwrap()
}

/// Whether this process may raise its own locked-memory limit (root with
/// CAP_SYS_RESOURCE), as the daemon's workers try to.
fn can_raise_memlock() -> bool {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit and setrlimit read or write the struct we pass.
    unsafe {
        libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut lim);
        lim.rlim_max = libc::RLIM_INFINITY;
        libc::setrlimit(libc::RLIMIT_MEMLOCK, &lim) == 0
    }
}

/// The nice value of every thread of `pid`.
fn nice_of_threads(pid: u32) -> Vec<i32> {
    let mut nice = Vec::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
        let stat = std::fs::read_to_string(task.unwrap().path().join("stat")).unwrap();
        // Fields after the command's closing parenthesis; nice is field 19.
        let rest = &stat[stat.rfind(')').unwrap() + 2..];
        nice.push(rest.split_whitespace().nth(16).unwrap().parse().unwrap());
    }
    nice
}

fn all_free(d: &Executord) {
    d.wait_status(MINUTE, |s| {
        matches!(s, LocalReply::Status { free_cpus, cpus, allocations, free_memory_mib, memory_mib, .. }
            if free_cpus == cpus && allocations.is_empty() && free_memory_mib == memory_mib)
    });
}

#[test]
fn allocation_runs_a_pooled_worker_as_the_lease_user() {
    let d = start(ExecutordOptions::default());
    // The pool fills in the background.
    d.wait_status(MINUTE, |s| {
        matches!(s, LocalReply::Status { pool_idle: 1, .. })
    });
    let mut c = Control::connect(&d);
    let ok = c
        .allocate(good_request(&d, 2), c_library_bytes())
        .unwrap_or_else(|e| panic!("{e:?}\n{}", d.log()));
    assert_eq!(ok.lanes.len(), 2);
    assert_eq!(ok.functions, ["echo", "noop"]);
    assert!(ok.pooled, "the first allocation takes the pooled worker");
    assert_eq!(ok.deadline_ms, 10_000, "the executor's default deadline");
    assert!(
        ok.fabric_addr.starts_with("127.0.0.1:"),
        "{}",
        ok.fabric_addr
    );
    assert_ne!(ok.fabric_addr, "127.0.0.1:0");

    let (_, free, free_mem, _, allocs) = status(&d);
    assert_eq!(free, [2, 3]);
    assert_eq!(free_mem, 4096 - 1024);
    assert_eq!(allocs.len(), 1);
    assert_eq!(allocs[0].user, "nobody");
    assert_eq!(allocs[0].cpus, [0, 1]);
    let pid = allocs[0].pid;
    assert_eq!(uid_of(pid), 65534, "the worker runs as nobody");
    // Pooled workers start niced; serving, every thread is back to 0.
    let nice = nice_of_threads(pid);
    assert!(!nice.is_empty() && nice.iter().all(|&n| n == 0), "{nice:?}");
    let reply = c.deallocate(ok.allocation_id);
    let done: Deallocated = reply.parse().unwrap();
    assert_eq!(done.allocation_id, ok.allocation_id);
    assert!(
        !process_exists(pid),
        "the worker is reaped before Deallocated"
    );
    all_free(&d);
    // A second deallocation of the same id is refused.
    let again = c.deallocate(ok.allocation_id);
    let e: ErrorReply = again.parse().unwrap();
    assert_eq!(e.code, ErrorCode::UnknownAllocation);
}

/// How many lines of `d`'s log speak of the locked-memory limit.
fn memlock_lines(d: &Executord) -> usize {
    d.log().matches("RLIMIT_MEMLOCK").count()
}

/// The locked-memory limit matters to verbs alone, which pins what it
/// registers: with verbs configured, the daemon lifts it at start for
/// every worker where root may raise limits (CAP_SYS_RESOURCE; containers
/// often drop it), and says once, at start, why it cannot otherwise;
/// without verbs it leaves the limit alone and says nothing of it, however
/// many allocations come.
#[test]
fn the_locked_memory_limit_is_lifted_for_verbs_only_and_said_once() {
    let library = c_library_bytes();
    let plain = start(ExecutordOptions {
        providers: vec!["tcp".into()],
        ..ExecutordOptions::default()
    });
    for _ in 0..3 {
        plain
            .allocate_and_deallocate(&library)
            .unwrap_or_else(|e| panic!("{e}\n{}", plain.log()));
    }
    assert_eq!(memlock_lines(&plain), 0, "{}", plain.log());

    let verbs = start(ExecutordOptions {
        providers: vec!["tcp".into(), "verbs:rxe0".into()],
        ..ExecutordOptions::default()
    });
    let mut c = Control::connect(&verbs);
    let ok = c
        .allocate(good_request(&verbs, 1), library.clone())
        .unwrap_or_else(|e| panic!("{e:?}\n{}", verbs.log()));
    let pid = pid_of(&verbs, ok.allocation_id);
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
    let memlock = limits
        .lines()
        .find(|l| l.starts_with("Max locked memory"))
        .unwrap();
    let log = verbs.log();
    if can_raise_memlock() {
        assert!(
            memlock.split_whitespace().nth(3) == Some("unlimited"),
            "{memlock}"
        );
    } else {
        // It says what is missing: root without the capability is still
        // root.
        assert!(log.contains("without CAP_SYS_RESOURCE"), "{log}");
        let said = log.find("RLIMIT_MEMLOCK").unwrap();
        let granted = log.find("allocation granted").unwrap();
        assert!(said < granted, "said at start, not per allocation:\n{log}");
    }
    c.deallocate(ok.allocation_id);
    for _ in 0..2 {
        verbs
            .allocate_and_deallocate(&library)
            .unwrap_or_else(|e| panic!("{e}\n{}", verbs.log()));
    }
    assert!(memlock_lines(&verbs) <= 1, "{}", verbs.log());
}

#[test]
fn without_a_pool_a_worker_is_spawned() {
    let d = start(ExecutordOptions {
        pool_size: 0,
        ..Default::default()
    });
    let mut c = Control::connect(&d);
    let ok = c.allocate(good_request(&d, 1), c_library_bytes()).unwrap();
    assert!(!ok.pooled);
    assert_eq!(ok.lanes.len(), 1);
}

#[test]
fn shm_allocation_listens_in_the_users_directory() {
    let d = start(ExecutordOptions::default());
    let mut c = Control::connect(&d);
    let mut req = good_request(&d, 1);
    req.provider = "shm".into();
    let ok = c
        .allocate(req, c_library_bytes())
        .unwrap_or_else(|e| panic!("{e:?}\n{}", d.log()));
    let sock = Path::new(&ok.fabric_addr);
    assert!(sock.starts_with(d.dir().join("run")), "{}", ok.fabric_addr);
    let dir = sock.parent().unwrap();
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(dir).unwrap();
    assert_eq!((meta.uid(), meta.mode() & 0o777), (65534, 0o700));
    let id = ok.allocation_id;
    c.deallocate(id).parse::<Deallocated>().unwrap();
    assert!(!dir.exists(), "the runtime directory is removed");
}

/// Every refusal carries its own code, and the daemon serves the next
/// client normally.
#[test]
fn refusals_have_specific_codes_and_the_daemon_keeps_serving() {
    let d = start(ExecutordOptions {
        extra_config: "max_library_mib = 4\nmax_lanes = 3".into(),
        ..Default::default()
    });
    let lib = c_library_bytes();
    let good_after = |what: &str| {
        let mut c = Control::connect(&d);
        let ok = c
            .allocate(good_request(&d, 1), lib.clone())
            .unwrap_or_else(|e| panic!("after {what}: {e:?}"));
        c.deallocate(ok.allocation_id)
            .parse::<Deallocated>()
            .unwrap();
    };
    let expect = |what: &str, reply: Frame, code: ErrorCode| {
        assert_eq!(
            reply.kind,
            Kind::Error,
            "{what}: {:?}",
            String::from_utf8_lossy(&reply.json)
        );
        let e: ErrorReply = reply.parse().unwrap();
        assert_eq!(e.code, code, "{what}: {}", e.message);
        assert!(
            e.message.len() > 20,
            "{what}: a sentence, got {:?}",
            e.message
        );
        e
    };

    // Bytes that are not a frame: refused with request id 0, then closed.
    let mut c = Control::connect(&d);
    c.stream
        .write_all(b"GET / HTTP/1.1\r\nHost: rfaas\r\n\r\n")
        .unwrap();
    let e = expect("garbage", c.recv(), ErrorCode::MalformedRequest);
    assert_eq!(e.request_id, 0);
    assert!(e.message.contains("RFAX"), "{}", e.message);
    assert!(c.closed());
    good_after("garbage");

    // A frame whose blob is over the limit: refused before the body.
    let mut c = Control::connect(&d);
    let header = FrameHeader {
        kind: Kind::AllocateRequest,
        json_len: 2,
        blob_len: 5 << 20,
    };
    c.stream.write_all(&header.encode()).unwrap();
    c.stream.write_all(b"{}").unwrap();
    c.stream.write_all(&vec![0u8; 5 << 20]).unwrap();
    let e = expect("oversized blob", c.recv(), ErrorCode::TooLarge);
    assert_eq!(e.request_id, 0);
    assert!(c.closed());
    good_after("oversized blob");

    // Well-framed but not JSON: refused, and the connection goes on.
    let mut c = Control::connect(&d);
    c.send(&Frame {
        kind: Kind::AllocateRequest,
        json: b"{\"request_id\": 5, \"token\": ".to_vec(),
        blob: Vec::new(),
    });
    expect("bad json", c.recv(), ErrorCode::MalformedRequest);
    c.allocate(good_request(&d, 1), lib.clone())
        .expect("the same connection serves the next request");
    drop(c);

    // Each case on a fresh connection, a good allocation after each.
    let token = |d: &Executord| d.token("nobody", 2, 2048, MINUTE);
    let forged = d.mint_with_another_key(&d.claims("nobody", 2, 2048, MINUTE));
    let mut expired = d.claims("nobody", 2, 2048, MINUTE);
    expired.issued_at -= 120;
    expired.expires_at = expired.issued_at + 60;
    let mut other_node = d.claims("nobody", 2, 2048, MINUTE);
    other_node.node = "some-other-node".into();

    let mut truncated_elf = b"\x7fELF".to_vec();
    truncated_elf.extend(std::iter::repeat(0x42).take(1000));
    let random: Vec<u8> = (0..4096u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();

    let cases: Vec<(&str, AllocateRequest, Vec<u8>, ErrorCode)> = vec![
        (
            "unknown function",
            request(token(&d), 1, &["echo", "no_such_function"]),
            lib.clone(),
            ErrorCode::UnknownFunction,
        ),
        (
            "random bytes",
            request(token(&d), 1, &["echo"]),
            random,
            ErrorCode::MalformedLibrary,
        ),
        (
            "a shell script",
            request(token(&d), 1, &["echo"]),
            b"#!/bin/sh\necho hi\n".to_vec(),
            ErrorCode::MalformedLibrary,
        ),
        (
            "a broken ELF",
            request(token(&d), 1, &["echo"]),
            truncated_elf,
            ErrorCode::MalformedLibrary,
        ),
        (
            "forged token",
            request(forged, 1, &["echo"]),
            lib.clone(),
            ErrorCode::TokenForged,
        ),
        (
            "expired token",
            request(d.mint(&expired), 1, &["echo"]),
            lib.clone(),
            ErrorCode::TokenExpired,
        ),
        (
            "other node's token",
            request(d.mint(&other_node), 1, &["echo"]),
            lib.clone(),
            ErrorCode::TokenWrongNode,
        ),
        (
            "not a token",
            request("rfaas2.nonsense".into(), 1, &["echo"]),
            lib.clone(),
            ErrorCode::TokenMalformed,
        ),
        (
            "more cores than the lease",
            request(token(&d), 3, &["echo"]),
            lib.clone(),
            ErrorCode::ExceedsLease,
        ),
        (
            "more memory than the lease",
            AllocateRequest {
                memory_mib: 4096,
                ..request(token(&d), 1, &["echo"])
            },
            lib.clone(),
            ErrorCode::ExceedsLease,
        ),
        (
            "more lanes than the executor allows",
            request(d.token("nobody", 4, 2048, MINUTE), 4, &["echo"]),
            lib.clone(),
            ErrorCode::TooLarge,
        ),
        (
            "more lanes than the executor allows, on one core",
            AllocateRequest {
                lanes: 4,
                ..request(token(&d), 1, &["echo"])
            },
            lib.clone(),
            ErrorCode::TooLarge,
        ),
        (
            "slots that are not a power of two",
            AllocateRequest {
                slots: 12,
                ..request(token(&d), 1, &["echo"])
            },
            lib.clone(),
            ErrorCode::MalformedRequest,
        ),
        (
            "more slots than a lane holds",
            AllocateRequest {
                slots: 128,
                ..request(token(&d), 1, &["echo"])
            },
            lib.clone(),
            ErrorCode::MalformedRequest,
        ),
        (
            "an output buffer over the limit",
            AllocateRequest {
                output_capacity: 1 << 30,
                ..request(token(&d), 1, &["echo"])
            },
            lib.clone(),
            ErrorCode::TooLarge,
        ),
        (
            "unserved provider",
            AllocateRequest {
                provider: "verbs:mlx5_0".into(),
                ..request(token(&d), 1, &["echo"])
            },
            lib.clone(),
            ErrorCode::ProviderUnsupported,
        ),
        (
            "root",
            request(d.token("root", 1, 2048, MINUTE), 1, &["echo"]),
            lib.clone(),
            ErrorCode::UserRefused,
        ),
        (
            "unknown user",
            request(d.token("rfaas-no-such-user", 1, 2048, MINUTE), 1, &["echo"]),
            lib.clone(),
            ErrorCode::UserRefused,
        ),
        (
            "zero cores",
            request(token(&d), 0, &["echo"]),
            lib.clone(),
            ErrorCode::MalformedRequest,
        ),
    ];
    for (what, req, library, code) in cases {
        let mut c = Control::connect(&d);
        let reply = c.allocate_frame(req, library);
        expect(what, reply, code);
        good_after(what);
    }
    all_free(&d);
    let (draining, ..) = status(&d);
    assert!(!draining);
}

/// Workers never run as a system account (uid below `min_worker_uid`,
/// by default login.defs' UID_MIN) nor as a user in `deny_users`, whatever
/// a validly signed lease says; the refusal says which rule and how to
/// change it.
#[test]
fn workers_never_run_as_system_accounts_or_denied_users() {
    let refusal = |d: &Executord, user: &str| {
        let mut c = Control::connect(d);
        let reply = c.allocate_frame(
            request(d.token(user, 1, 2048, MINUTE), 1, &["echo"]),
            c_library_bytes(),
        );
        assert_eq!(
            reply.kind,
            Kind::Error,
            "{user}: {:?}",
            String::from_utf8_lossy(&reply.json)
        );
        let e: ErrorReply = reply.parse().unwrap();
        assert_eq!(e.code, ErrorCode::UserRefused, "{user}: {}", e.message);
        e.message
    };
    // `daemon` is uid 1 on every Debian system.
    let d = start(ExecutordOptions::default());
    let m = refusal(&d, "daemon");
    assert!(
        m.contains("\"daemon\" has uid 1, below") && m.contains("min_worker_uid"),
        "{m}"
    );
    let m = refusal(&d, "root");
    assert!(m.contains("root"), "{m}");
    all_free(&d);
    drop(d);

    let d = start(ExecutordOptions {
        extra_config: "deny_users = [\"root\", \"65534\"]\nmin_worker_uid = 1".into(),
        ..Default::default()
    });
    let m = refusal(&d, "nobody");
    assert!(m.contains("deny_users"), "{m}");
    // uid 1 is allowed once the floor says so.
    let mut c = Control::connect(&d);
    let ok = c
        .allocate(
            request(d.token("daemon", 1, 2048, MINUTE), 1, &["echo", "noop"]),
            c_library_bytes(),
        )
        .unwrap_or_else(|e| panic!("daemon above a floor of 1: {e:?}"));
    assert_eq!(uid_of(pid_of(&d, ok.allocation_id)), 1);
    c.deallocate(ok.allocation_id)
        .parse::<Deallocated>()
        .unwrap();
    all_free(&d);
}

/// A request that fits its lease once a crashed worker of that lease is
/// reaped is refused `allocation_ending` (retryable) until then, never
/// `exceeds_lease`: the crashed worker's cores count as free only once it
/// is reaped, and the client library retries such a refusal by itself.
/// The crashing function touches 256 MiB first, so its worker takes a
/// while to end, as a big one does.
#[test]
fn a_request_that_fits_once_a_crashed_worker_is_reaped_is_retryable() {
    let d = start(ExecutordOptions::default());
    let lib = c_library_bytes();
    let memory = 512;
    let token = d.token("nobody", 1, memory, MINUTE);
    let addr = d.control_addr().to_string();
    let spec = AllocationSpec::new(lib.clone(), &["echo", "fault_segfault_once"])
        .library_name("libfunctions.so")
        .memory_mib(memory);
    let client = || Client::new(ClientOptions::with_provider("tcp"));
    let first = client()
        .allocate(&addr, &token, &spec)
        .unwrap_or_else(|e| panic!("{e}\n{}", d.log()));
    let f = first.function("fault_segfault_once").unwrap();
    let marker = CrashOnce::new();
    let bytes = marker.input(256);
    let mut input = first.buffer::<u8>(bytes.len()).unwrap();
    input.write_from(0, &bytes);
    let mut output = first.buffer::<u8>(bytes.len()).unwrap();
    let err = first
        .invoke(f, &input, bytes.len(), &mut output)
        .unwrap_err();
    assert!(err.signal() == Some(11), "{err:?}");
    // At once, on another connection, with the first allocation not let
    // go: its worker is still exiting.
    let mut c = Control::connect(&d);
    let mut req = request(token.clone(), 1, &["echo"]);
    req.memory_mib = memory;
    match c.allocate(req, lib) {
        Err(e) => {
            assert_eq!(e.code, ErrorCode::AllocationEnding, "{e:?}");
            assert!(e.code.is_retryable());
            assert!(e.message.contains("retry in a moment"), "{}", e.message);
        }
        // The worker was reaped first.
        Ok(ok) => {
            c.deallocate(ok.allocation_id);
        }
    }
    let second = client()
        .allocate(&addr, &token, &spec)
        .unwrap_or_else(|e| panic!("{e}\n{}", d.log()));
    second.deallocate().unwrap();
    drop(first);
}

#[test]
fn capacity_is_never_granted_twice() {
    let d = start(ExecutordOptions {
        cpus: "0-3".into(),
        ..Default::default()
    });
    let lib = c_library_bytes();
    let mut a = Control::connect(&d);
    let mut b = Control::connect(&d);
    let first = a.allocate(good_request(&d, 2), lib.clone()).unwrap();
    let second = b.allocate(good_request(&d, 2), lib.clone()).unwrap();
    let (_, free, ..) = status(&d);
    assert!(free.is_empty());

    let mut c = Control::connect(&d);
    let e = c.allocate(good_request(&d, 1), lib.clone()).unwrap_err();
    assert_eq!(e.code, ErrorCode::NoCapacity, "{}", e.message);
    assert!(e.message.contains("0 free cores"), "{}", e.message);

    a.deallocate(first.allocation_id)
        .parse::<Deallocated>()
        .unwrap();
    let third = c.allocate(good_request(&d, 1), lib.clone()).unwrap();
    let (_, _, _, _, allocs) = status(&d);
    let mut held: Vec<u32> = allocs.iter().flat_map(|a| a.cpus.clone()).collect();
    held.sort_unstable();
    held.dedup();
    assert_eq!(held.len(), 3, "no CPU held twice: {allocs:?}");
    drop((second, third));
}

#[test]
fn concurrent_requests_do_not_overcommit() {
    let d = start(ExecutordOptions {
        cpus: "0-2".into(),
        pool_size: 2,
        ..Default::default()
    });
    let lib = c_library_bytes();
    let results: Vec<Result<AllocateOk, ErrorReply>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..5)
            .map(|_| {
                let lib = lib.clone();
                let d = &d;
                s.spawn(move || {
                    let mut c = Control::connect(d);
                    let r = c.allocate(good_request(d, 1), lib);
                    // Keep the connection (and so the allocation) until
                    // every request was answered.
                    (r, c)
                })
            })
            .collect();
        let pairs: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        pairs.into_iter().map(|(r, _c)| r).collect()
    });
    let ok = results.iter().filter(|r| r.is_ok()).count();
    assert_eq!(ok, 3, "exactly as many allocations as CPUs: {results:?}");
    for r in &results {
        if let Err(e) = r {
            assert_eq!(e.code, ErrorCode::NoCapacity, "{}", e.message);
        }
    }
}

#[test]
fn a_killed_worker_is_reported_and_its_capacity_freed() {
    let d = start(ExecutordOptions::default());
    let mut c = Control::connect(&d);
    let ok = c.allocate(good_request(&d, 2), c_library_bytes()).unwrap();
    let pid = pid_of(&d, ok.allocation_id);
    // SAFETY: kill has no memory preconditions.
    unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
    let exited = c.worker_exited();
    assert_eq!(exited.allocation_id, ok.allocation_id);
    assert_eq!(exited.cause, ExitCause::Crashed);
    assert_eq!(exited.signal, Some(9));
    assert!(exited.message.contains("SIGKILL"), "{}", exited.message);
    all_free(&d);
    let e = c
        .deallocate(ok.allocation_id)
        .parse::<ErrorReply>()
        .unwrap();
    assert_eq!(e.code, ErrorCode::UnknownAllocation);
}

#[test]
fn closing_the_connection_deallocates() {
    let d = start(ExecutordOptions::default());
    let mut c = Control::connect(&d);
    let one = c.allocate(good_request(&d, 1), c_library_bytes()).unwrap();
    let two = c.allocate(good_request(&d, 1), c_library_bytes()).unwrap();
    let pids = [pid_of(&d, one.allocation_id), pid_of(&d, two.allocation_id)];
    drop(c);
    for pid in pids {
        wait_gone(pid);
    }
    all_free(&d);
}

#[test]
fn an_expired_lease_stops_its_worker() {
    let d = start(ExecutordOptions::default());
    let mut c = Control::connect(&d);
    let token = d.token("nobody", 1, 1024, Duration::from_secs(2));
    let ok = c
        .allocate(request(token, 1, &["echo"]), c_library_bytes())
        .unwrap();
    let exited = c.worker_exited();
    assert_eq!(exited.allocation_id, ok.allocation_id);
    assert_eq!(exited.cause, ExitCause::LeaseExpired, "{}", exited.message);
    all_free(&d);
}

#[test]
fn drain_refuses_allocations_until_resumed() {
    let d = start(ExecutordOptions::default());
    let lib = c_library_bytes();
    let mut c = Control::connect(&d);
    let ok = c.allocate(good_request(&d, 1), lib.clone()).unwrap();
    let pid = pid_of(&d, ok.allocation_id);

    let reply = d.local(LocalRequest::Drain { grace_ms: 100 });
    assert!(matches!(reply, LocalReply::Done { .. }), "{reply:?}");
    let exited = c.worker_exited();
    assert_eq!(exited.cause, ExitCause::Drained, "{}", exited.message);
    assert!(exited.message.contains("retrieved"), "{}", exited.message);
    assert!(!process_exists(pid));
    let (draining, _, _, pool_idle, allocs) = status(&d);
    assert!(draining);
    assert!(allocs.is_empty());
    assert_eq!(pool_idle, 0, "no idle workers while drained");

    let e = Control::connect(&d)
        .allocate(good_request(&d, 1), lib.clone())
        .unwrap_err();
    assert_eq!(e.code, ErrorCode::Draining, "{}", e.message);

    let reply = d.local(LocalRequest::Resume);
    assert!(matches!(reply, LocalReply::Done { .. }), "{reply:?}");
    let (draining, ..) = status(&d);
    assert!(!draining);
    Control::connect(&d)
        .allocate(good_request(&d, 1), lib)
        .expect("allocations are taken again");
}

/// A Slurm job's prolog takes the node back with the grace (running
/// workers are told, then stopped; clients hear `drained`), and the node is
/// offered again only when the last Slurm job holding it has ended.
/// The milliseconds a take-back's answer says it took ("in N ms").
fn took_ms(message: &str) -> u64 {
    let at = message
        .find(" in ")
        .unwrap_or_else(|| panic!("no time in {message:?}"));
    message[at + 4..]
        .split(" ms")
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no time in {message:?}"))
}

/// A drain says how long it took and what became of each allocation:
/// those whose clients let go within the grace are drained, not stopped,
/// and the drain is over as soon as they are gone, not at the grace's end.
#[test]
fn a_drain_says_how_long_it_took_and_what_it_ended() {
    let d = start(ExecutordOptions::default());
    let lib = c_library_bytes();
    let mut a = Control::connect(&d);
    let a_ok = a.allocate(good_request(&d, 1), lib.clone()).unwrap();
    let mut b = Control::connect(&d);
    b.allocate(good_request(&d, 1), lib).unwrap();
    let (reply, seen) = std::thread::scope(|scope| {
        let asked = Instant::now();
        let drain = scope.spawn(|| d.local(LocalRequest::Drain { grace_ms: 600_000 }));
        d.wait_status(MINUTE, |s| {
            matches!(s, LocalReply::Status { draining: true, .. })
        });
        // One client deallocates, the other closes its connection.
        a.deallocate(a_ok.allocation_id);
        drop(b);
        (drain.join().unwrap(), asked.elapsed())
    });
    let LocalReply::Done { message } = reply else {
        panic!("the drain answered {reply:?}");
    };
    assert!(
        message.starts_with("drained in ")
            && message.ends_with(
                " ms: 2 allocations drained within the 600000 ms grace period, 0 stopped after it, 0 had finished already"
            ),
        "{message}"
    );
    assert!(
        Duration::from_millis(took_ms(&message)) <= seen,
        "{message}, but the test saw the drain take {seen:?}"
    );
    let log = d.log();
    let line = log
        .lines()
        .find(|l| l.contains("drain done"))
        .unwrap_or_else(|| panic!("no drain line:\n{log}"));
    for field in [
        "took_ms=",
        "drained=2",
        "stopped=0",
        "finished=0",
        "grace_ms=600000",
    ] {
        assert!(line.contains(field), "{field} not in {line}");
    }
}

#[test]
fn slurm_jobs_take_the_node_back_until_the_last_one_ends() {
    let d = start(ExecutordOptions::default());
    let lib = c_library_bytes();
    let mut c = Control::connect(&d);
    let ok = c.allocate(good_request(&d, 1), lib.clone()).unwrap();
    let pid = pid_of(&d, ok.allocation_id);

    let reply = d.local(LocalRequest::SlurmRetrieve {
        job_id: 7,
        cpus: 2,
        grace_ms: 100,
    });
    let LocalReply::Done { message } = reply else {
        panic!("{reply:?}")
    };
    assert!(message.contains("taken back for Slurm job 7"), "{message}");
    let exited = c.worker_exited();
    assert_eq!(exited.cause, ExitCause::Drained, "{}", exited.message);
    assert!(!process_exists(pid));
    let e = Control::connect(&d)
        .allocate(good_request(&d, 1), lib.clone())
        .unwrap_err();
    assert_eq!(e.code, ErrorCode::Draining, "{}", e.message);

    // A second job on the same node; the first ends, the second holds on.
    d.local(LocalRequest::SlurmRetrieve {
        job_id: 8,
        cpus: 1,
        grace_ms: 0,
    });
    let reply = d.local(LocalRequest::SlurmOffer { job_id: 7 });
    assert!(
        matches!(&reply, LocalReply::Done { message } if message.contains("[8] still hold")),
        "{reply:?}"
    );
    let (draining, ..) = status(&d);
    assert!(draining, "job 8 still runs here");

    let reply = d.local(LocalRequest::SlurmOffer { job_id: 8 });
    assert!(
        matches!(&reply, LocalReply::Done { message } if message.contains("taking allocations again")),
        "{reply:?}"
    );
    let (draining, ..) = status(&d);
    assert!(!draining);
    Control::connect(&d)
        .allocate(good_request(&d, 1), lib)
        .expect("offered again after the last Slurm job");
}

/// A stand-in `scontrol` in `dir` (a shell script): every job is
/// `jobs.txt`, job N is `job-N.txt` (Slurm does not know N without it),
/// the node is `node.txt` (Slurm cannot be asked without it); each run's
/// arguments are appended to `calls.txt`.
/// The daemon's side of Slurm is what these tests are about; the real
/// `scontrol` runs in slurm-spank/tests/cluster.rs.
fn fake_scontrol(dir: &Path) -> String {
    use std::os::unix::fs::PermissionsExt;
    let p = dir.join("scontrol");
    std::fs::write(
        &p,
        format!(
            "#!/bin/sh\nd={}\necho \"$*\" >> \"$d/calls.txt\"\nif [ \"$4\" = node ]; then\n  [ -f \"$d/node.txt\" ] || {{ echo 'slurm_load_node error: Unable to contact slurm controller' >&2; exit 1; }}\n  exec cat \"$d/node.txt\"\nfi\nif [ -n \"$6\" ]; then\n  [ -f \"$d/job-$6.txt\" ] || {{ echo 'slurm_load_jobs error: Invalid job id specified' >&2; exit 1; }}\n  exec cat \"$d/job-$6.txt\"\nfi\nexec cat \"$d/jobs.txt\"\n",
            dir.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
    format!("[slurm]\nscontrol = {:?}\n", p.display().to_string())
}

fn scratch(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!(
        "rfaas-executord-slurm-{}-{name}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// On a shared node a 1-CPU job takes back its CPU only: the allocation
/// on it is told, then stopped after the grace; the one on another CPU
/// goes on serving, and new allocations get neither the job's CPU.
#[test]
fn a_slurm_job_takes_back_only_its_own_cpus() {
    let dir = scratch("percore");
    let d = start(ExecutordOptions {
        extra_config: format!("{}reconcile_interval_ms = 0\n", fake_scontrol(&dir)),
        ..Default::default()
    });
    std::fs::write(
        dir.join("job-5.txt"),
        "JobId=5 JobName=wrap JobState=RUNNING JOB_GRES=(null)   Nodes=rfaas-test-node CPU_IDs=0 Mem=0 GRES=\n",
    )
    .unwrap();
    let lib = c_library_bytes();
    // A on CPU 0 (the job's), B on CPU 1, as the lowest free go first.
    let mut a = Control::connect(&d);
    let a_ok = a.allocate(good_request(&d, 1), lib.clone()).unwrap();
    let a_pid = pid_of(&d, a_ok.allocation_id);
    let b = Client::new(ClientOptions::with_provider("tcp"))
        .allocate(
            &d.control_addr().to_string(),
            &d.token("nobody", 1, 1024, MINUTE),
            &AllocationSpec::new(lib.clone(), &["echo"]).memory_mib(256),
        )
        .unwrap();
    let (_, free, ..) = status(&d);
    assert_eq!(free, [2, 3]);

    let reply = d.local(LocalRequest::SlurmRetrieve {
        job_id: 5,
        cpus: 1,
        grace_ms: 200,
    });
    let LocalReply::Done { message } = reply else {
        panic!("{reply:?}")
    };
    let (head, tail) = message
        .split_once(" in ")
        .unwrap_or_else(|| panic!("{message}"));
    assert_eq!(
        head,
        "taken back for Slurm job 5: CPUs 0 withheld (Slurm's CPU_IDs 0);"
    );
    assert!(
        tail.ends_with(
            " ms: 0 allocations on them drained within the 200 ms grace period, 1 stopped after it, 0 had finished already; 2 CPUs free for rfaas"
        ),
        "{message}"
    );
    assert!(
        took_ms(&message) >= 200,
        "stopped after the grace: {message}"
    );
    let exited = a.worker_exited();
    assert_eq!(exited.cause, ExitCause::Drained, "{}", exited.message);
    wait_gone(a_pid);
    let (draining, free, _, _, allocs) = status(&d);
    assert!(!draining, "only one CPU was taken back");
    assert_eq!(free, [2, 3], "CPU 0 is withheld, B holds CPU 1");
    assert_eq!(
        allocs.iter().map(|a| a.allocation_id).collect::<Vec<_>>(),
        [b.id()]
    );
    // B serves as before.
    let f = b.function("echo").unwrap();
    let input = b.buffer::<u64>(1).unwrap();
    let mut output = b.buffer::<u64>(1).unwrap();
    assert_eq!(b.invoke(f, &input, 1, &mut output).unwrap(), 8);
    // A new allocation gets a free CPU, never the job's.
    let mut c_conn = Control::connect(&d);
    let c_ok = c_conn.allocate(good_request(&d, 2), lib.clone()).unwrap();
    let (_, _, _, _, allocs) = status(&d);
    let c = allocs
        .iter()
        .find(|a| a.allocation_id == c_ok.allocation_id)
        .unwrap();
    assert_eq!(c.cpus, [2, 3]);

    let reply = d.local(LocalRequest::SlurmOffer { job_id: 5 });
    assert!(
        matches!(&reply, LocalReply::Done { message } if message == "Slurm job 5 ended: CPUs 0 offered again"),
        "{reply:?}"
    );
    let (_, free, ..) = status(&d);
    assert_eq!(free, [0]);
    assert_eq!(b.invoke(f, &input, 1, &mut output).unwrap(), 8);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The managers hear of a take-back at once, not at the next heartbeat
/// (a minute away here).
#[test]
fn a_take_back_sends_a_heartbeat_at_once() {
    use std::os::unix::fs::PermissionsExt;
    let m = rfaas_testkit::manager::Manager::start(rfaas_testkit::manager::ManagerOptions {
        extra_config: "heartbeat_interval_ms = 60000\nlost_after_ms = 600000\nrefresh_ms = 100\n"
            .into(),
        ..Default::default()
    });
    let dir = scratch("beat");
    let cred = dir.join("node.credential");
    std::fs::write(&cred, m.credential("node", "rfaas-test-node", None)).unwrap();
    std::fs::set_permissions(&cred, std::fs::Permissions::from_mode(0o600)).unwrap();
    std::fs::write(
        dir.join("job-5.txt"),
        "JobId=5 JobState=RUNNING   Nodes=rfaas-test-node CPU_IDs=0 Mem=0 GRES=\n",
    )
    .unwrap();
    let d = start(ExecutordOptions {
        extra_config: format!(
            "{}reconcile_interval_ms = 0\n[manager]\nurls = [{:?}]\ncredential_file = {:?}\n",
            fake_scontrol(&dir),
            m.url(),
            cred.display().to_string()
        ),
        ..Default::default()
    });
    let admin = m.admin();
    let beat = || {
        let (_, n) = admin.call("GET", "/v1/nodes/rfaas-test-node", None);
        (n["state"] == "up").then(|| n["last_heartbeat_ms"].as_u64().unwrap_or(0))
    };
    let registered =
        poll_for(MINUTE, beat).unwrap_or_else(|| panic!("never registered:\n{}", d.log()));
    d.local(LocalRequest::SlurmRetrieve {
        job_id: 5,
        cpus: 1,
        grace_ms: 0,
    });
    // Half the heartbeat interval: only a heartbeat sent for the
    // take-back arrives before it.
    poll_for(Duration::from_secs(30), || {
        (beat() > Some(registered)).then_some(())
    })
    .unwrap_or_else(|| panic!("no heartbeat after the take-back:\n{}", d.log()));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The daemon registers the Slurm partitions `scontrol` says its node is
/// in, asking once at start; partitions set in `[slurm]` win, and then
/// Slurm is not asked.
#[test]
fn executord_registers_its_slurm_partitions() {
    use std::os::unix::fs::PermissionsExt;
    let m = rfaas_testkit::manager::Manager::start(rfaas_testkit::manager::ManagerOptions {
        extra_config: "lost_after_ms = 600000\n".into(),
        ..Default::default()
    });
    let dir = scratch("partitions");
    let cred = dir.join("node.credential");
    std::fs::write(&cred, m.credential("node", "rfaas-test-node", None)).unwrap();
    std::fs::set_permissions(&cred, std::fs::Permissions::from_mode(0o600)).unwrap();
    let config = |partitions: &str| {
        format!(
            "{}reconcile_interval_ms = 0\n{partitions}[manager]\nurls = [{:?}]\ncredential_file = {:?}\n",
            fake_scontrol(&dir),
            m.url(),
            cred.display().to_string()
        )
    };
    let admin = m.admin();
    let registered_in = |want: serde_json::Value, d: &Executord| {
        poll_for(MINUTE, || {
            let (_, n) = admin.call("GET", "/v1/nodes/rfaas-test-node", None);
            (n["partitions"] == want).then_some(())
        })
        .unwrap_or_else(|| panic!("never registered in {want}:\n{}", d.log()));
    };
    let node_queries = || {
        std::fs::read_to_string(dir.join("calls.txt"))
            .unwrap_or_default()
            .lines()
            .filter(|l| l.contains(" node "))
            .map(str::to_owned)
            .collect::<Vec<_>>()
    };
    // Slurm cannot be asked: the daemon registers without partitions,
    // and says why.
    let d = start(ExecutordOptions {
        extra_config: config(""),
        ..Default::default()
    });
    let n = poll_for(MINUTE, || {
        let (_, n) = admin.call("GET", "/v1/nodes/rfaas-test-node", None);
        (n["state"] == "up").then_some(n)
    })
    .unwrap_or_else(|| panic!("never registered:\n{}", d.log()));
    assert!(n.get("partitions").is_none(), "{n}");
    assert!(
        d.log()
            .contains("cannot ask Slurm which partitions this node is in"),
        "{}",
        d.log()
    );
    drop(d);
    std::fs::remove_file(dir.join("calls.txt")).unwrap();

    std::fs::write(
        dir.join("node.txt"),
        "NodeName=rfaas-test-node Arch=x86_64 CPUTot=4 Partitions=batch,gpu State=IDLE Reason=none\n",
    )
    .unwrap();
    let d = start(ExecutordOptions {
        extra_config: config(""),
        ..Default::default()
    });
    registered_in(serde_json::json!(["batch", "gpu"]), &d);
    assert_eq!(
        node_queries(),
        ["--local -o show node rfaas-test-node"],
        "one query at start"
    );
    drop(d);

    let d = start(ExecutordOptions {
        extra_config: config("partitions = [\"debug\"]\n"),
        ..Default::default()
    });
    registered_in(serde_json::json!(["debug"]), &d);
    assert_eq!(
        node_queries().len(),
        1,
        "the configuration is not asked of Slurm"
    );
    drop(d);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A job Slurm runs here when the daemon starts is taken back before the
/// daemon serves (its prolog was missed), and given back once Slurm no
/// longer runs it though no epilog said so.
#[test]
fn reconciliation_makes_up_for_a_missed_prolog_and_epilog() {
    let dir = scratch("reconcile");
    std::fs::write(
        dir.join("jobs.txt"),
        "JobId=12 JobName=wrap JobState=RUNNING JOB_GRES=(null)   Nodes=rfaas-test-node CPU_IDs=1-2 Mem=0 GRES=\n\
         JobId=13 JobName=wrap JobState=COMPLETED JOB_GRES=(null)   Nodes=rfaas-test-node CPU_IDs=0 Mem=0 GRES=\n",
    )
    .unwrap();
    let d = start(ExecutordOptions {
        extra_config: format!("{}reconcile_interval_ms = 50\n", fake_scontrol(&dir)),
        ..Default::default()
    });
    let (draining, free, ..) = status(&d);
    assert!(!draining);
    assert_eq!(free, [0, 3], "job 12's CPUs from the start");
    assert!(d.log().contains("missed prolog"), "{}", d.log());

    std::fs::write(dir.join("jobs.txt"), "No jobs in the system\n").unwrap();
    d.wait_status(
        MINUTE,
        |s| matches!(s, LocalReply::Status { free_cpus, .. } if free_cpus == &[0, 1, 2, 3]),
    );
    assert!(d.log().contains("missed epilog"), "{}", d.log());
    Control::connect(&d)
        .allocate(good_request(&d, 1), c_library_bytes())
        .expect("offered again");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn stopping_the_daemon_stops_every_worker() {
    let d = start(ExecutordOptions {
        pool_size: 2,
        ..Default::default()
    });
    let mut c = Control::connect(&d);
    let ok = c.allocate(good_request(&d, 1), c_library_bytes()).unwrap();
    let pid = pid_of(&d, ok.allocation_id);
    drop(d); // SIGTERM
    let exited = c.worker_exited();
    assert_eq!(exited.cause, ExitCause::Stopped);
    assert!(
        exited.message.contains("shutting down"),
        "{}",
        exited.message
    );
    wait_gone(pid);
    assert!(c.closed(), "the daemon is gone");
}

#[test]
fn lease_keys_others_can_write_are_refused() {
    let err = Executord::try_start(
        Path::new(DAEMON),
        ExecutordOptions {
            lease_keys_mode: 0o664,
            ..Default::default()
        },
    )
    .unwrap_err();
    assert!(err.contains("mode 0664"), "{err}");
    assert!(err.contains("chmod go-w"), "{err}");
}

/// The node holds public keys only: a token signed by anyone else, under
/// the manager's key id or another, allocates nothing, and the daemon goes
/// on serving good tokens on the same connection.
#[test]
fn a_token_signed_with_another_key_is_refused_as_forged() {
    let d = start(ExecutordOptions::default());
    let lib = c_library_bytes();
    let mut c = Control::connect(&d);
    let claims = d.claims("nobody", 1, 2048, MINUTE);
    let unknown_id = LeaseSigner::generate("not-the-managers").unwrap();
    for (what, token, key_id) in [
        (
            "another key, the manager's id",
            d.mint_with_another_key(&claims),
            d.signer().key_id(),
        ),
        (
            "another key id",
            unknown_id.sign(&claims),
            "not-the-managers",
        ),
    ] {
        let e = c
            .allocate(request(token, 1, &["echo"]), lib.clone())
            .expect_err(what);
        assert_eq!(e.code, ErrorCode::TokenForged, "{what}: {}", e.message);
        assert!(
            e.message.contains(&format!("{key_id:?}")) && e.message.contains("lease_keys"),
            "{what}: {}",
            e.message
        );
        assert_eq!(status(&d).4.len(), 0, "{what}: nothing was allocated");
    }
    // The same claims, signed with the key the node accepts, allocate.
    let ok = c
        .allocate(request(d.mint(&claims), 1, &["echo"]), lib)
        .expect("the manager's token is accepted");
    assert_eq!(ok.lease_id, claims.lease_id);
}

#[test]
fn the_example_configuration_parses() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("rfaas-executord.example.toml");
    // As shipped it sets nothing: every node may use it unchanged.
    let config = Config::load(&path).unwrap();
    assert_eq!(config, Config::default(), "the example sets no key");
    // Every key is documented, commented out.
    let text = std::fs::read_to_string(&path).unwrap();
    for key in [
        "node_name",
        "control_listen",
        "fabric_host",
        "providers",
        "cpus",
        "pin",
        "memory_mib",
        "reserve_cpus",
        "reserve_memory_mib",
        "lease_keys",
        "local_socket",
        "runtime_dir",
        "pool_size",
        "worker_path",
        "metrics_listen",
        "urls",
        "credential_file",
        "advertise",
        "max_backoff_ms",
        "sandbox",
        "bwrap_path",
        "max_library_mib",
        "max_lanes",
        "max_input_capacity",
        "max_output_capacity",
        "default_deadline_ms",
        "max_deadline_ms",
        "worker_ready_timeout_ms",
        "max_connections",
        "max_connections_per_address",
        "request_timeout_ms",
        "library_timeout_ms",
        "idle_timeout_ms",
        "library_memory_mib",
        "request_threads",
        "log_level",
        "granularity_ms",
        "keep_ended_s",
        "timeout_ms",
        "journal",
        "node",
        "scontrol",
        "conf",
        "reconcile_interval_ms",
        "grace_ms",
        "cpu_map",
    ] {
        assert!(
            text.lines()
                .any(|l| l.trim_start_matches("# ").starts_with(&format!("{key} = "))),
            "{key} is not in the example"
        );
    }
}

#[test]
fn bubblewrap_sandbox_runs_the_worker_as_the_user() {
    let bwrap_ok = std::process::Command::new("bwrap")
        .args(["--ro-bind", "/", "/", "true"])
        .status()
        .is_ok_and(|s| s.success());
    // scripts/test.sh installs bubblewrap; a machine without it fails here
    // rather than passing an untested sandbox.
    assert!(
        bwrap_ok,
        "bwrap is not installed or cannot create namespaces here: install the bubblewrap package (scripts/test.sh does)"
    );
    // The worker binary under /tmp, which the sandbox replaces with a
    // tmpfs: the daemon must bind it back in (a build tree under /tmp, as
    // in many CI checkouts).
    let bin_dir = std::env::temp_dir().join(format!("rfaas-bwrap-worker-{}", std::process::id()));
    std::fs::create_dir_all(&bin_dir).unwrap();
    let worker_bin = bin_dir.join("rfaas-worker");
    std::fs::copy(env!("CARGO_BIN_EXE_rfaas-worker"), &worker_bin).unwrap();
    assert!(worker_bin.starts_with("/tmp"), "{}", worker_bin.display());
    let d = start(ExecutordOptions {
        sandbox: "bubblewrap".into(),
        pool_size: 0,
        extra_config: format!("worker_path = {:?}", worker_bin.display().to_string()),
        ..Default::default()
    });
    let mut c = Control::connect(&d);
    for provider in ["tcp", "shm"] {
        let mut req = good_request(&d, 1);
        req.provider = provider.into();
        let ok = c
            .allocate(req, c_library_bytes())
            .unwrap_or_else(|e| panic!("{provider}: {e:?}\n{}", d.log()));
        assert!(!ok.pooled);
        let bwrap_pid = pid_of(&d, ok.allocation_id);
        let worker = descendants(bwrap_pid)
            .into_iter()
            .find(|p| {
                std::fs::read_to_string(format!("/proc/{p}/comm"))
                    .is_ok_and(|c| c.trim() == "rfaas-worker")
            })
            .expect("the worker runs under bwrap");
        assert_eq!(uid_of(worker), 65534);
        if provider == "tcp" {
            c.deallocate(ok.allocation_id)
                .parse::<Deallocated>()
                .unwrap();
        } else {
            // SAFETY: kill has no memory preconditions.
            unsafe { libc::kill(worker as libc::pid_t, libc::SIGKILL) };
            let exited = c.worker_exited();
            assert_eq!(exited.cause, ExitCause::Crashed, "{}", exited.message);
            assert_eq!(exited.signal, Some(9));
        }
        wait_gone(worker);
    }
    all_free(&d);
    drop(d);
    std::fs::remove_dir_all(&bin_dir).unwrap();
}

fn descendants(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    let mut todo = vec![pid];
    while let Some(p) = todo.pop() {
        let children =
            std::fs::read_to_string(format!("/proc/{p}/task/{p}/children")).unwrap_or_default();
        for c in children.split_whitespace().filter_map(|c| c.parse().ok()) {
            out.push(c);
            todo.push(c);
        }
    }
    out
}

/// One lane of an allocation, driven by hand over the fabric: the client
/// side of docs/invocation.md's invocation steps, inline payloads only.
struct RawLane {
    _fabric: rfaas_fabric::Fabric,
    _domain: rfaas_fabric::Domain,
    cq: rfaas_fabric::CompletionQueue,
    ep: rfaas_fabric::Endpoint,
    input: rfaas_fabric::MemoryRegion,
    output: rfaas_fabric::MemoryRegion,
    remote: rfaas_proto::control::client::Descriptor,
    next_id: u32,
}

impl RawLane {
    fn connect(ok: &AllocateOk, provider: &str) -> RawLane {
        use rfaas_fabric::{Access, EndpointOptions, Fabric};
        let fabric = Fabric::open(provider).unwrap();
        let domain = fabric.domain().unwrap();
        let mut cq = fabric.completion_queue(512).unwrap();
        let ep = domain
            .connect(&ok.fabric_addr, &mut cq, &EndpointOptions::default())
            .unwrap();
        let mut input = domain.register(4096, Access::LOCAL).unwrap();
        let output = domain.register(4096, Access::REMOTE_WRITE).unwrap();
        // The lane hello first (rfaas_proto::hello), waited for.
        use rfaas_proto::hello::{LaneHello, LaneKey, LANE_HELLO_IMM};
        let key = LaneKey::from_hex(&ok.lane_key).unwrap();
        let mut hello = [0; LaneHello::LEN];
        LaneHello { lane: 0, key }.encode(&mut hello).unwrap();
        input.write_from(0, &hello);
        let remote = rfaas_fabric::RemoteAddr {
            addr: ok.lanes[0].addr,
            rkey: ok.lanes[0].rkey,
        };
        ep.post_recv(0).unwrap();
        ep.write_with_imm(0, &input, 0, LaneHello::LEN, remote, LANE_HELLO_IMM)
            .unwrap();
        // Its local completion and the worker's answer.
        let mut seen = 0;
        let mut done = [rfaas_fabric::Completion::EMPTY; 2];
        while seen < 2 {
            let n = cq.wait(&mut done, MINUTE).unwrap();
            assert!(n > 0, "the worker answers the hello");
            for c in &done[..n] {
                assert!(c.status.is_ok(), "{c:?}");
            }
            seen += n;
        }
        RawLane {
            _fabric: fabric,
            _domain: domain,
            cq,
            ep,
            input,
            output,
            remote: ok.lanes[0],
            next_id: 1,
        }
    }

    /// Sends one request; returns the response's status and output, or
    /// `None` when none came within `timeout`.
    fn invoke(
        &mut self,
        function: u16,
        payload: &[u8],
        timeout: Duration,
    ) -> Option<(rfaas_proto::InvocationStatus, Vec<u8>)> {
        use rfaas_fabric::{Completion, Opcode, RemoteAddr};
        use rfaas_proto::{InvocationHeader, RequestImm, ResponseImm};
        let id = self.next_id;
        self.next_id += 1;
        let out = self.output.descriptor();
        let header = InvocationHeader {
            output_addr: out.addr,
            output_rkey: out.rkey,
            output_capacity: out.len,
            input_addr: 0,
            input_rkey: 0,
            input_len: payload.len() as u32,
        };
        self.input.write_from(0, &header.to_bytes());
        self.input.write_from(InvocationHeader::LEN, payload);
        self.ep.post_recv(u64::from(id)).unwrap();
        let imm = RequestImm {
            invocation_id: id,
            function_index: function,
        }
        .encode()
        .unwrap();
        let remote = RemoteAddr {
            addr: self.remote.addr,
            rkey: self.remote.rkey,
        };
        self.ep
            .write_with_imm(
                0,
                &self.input,
                0,
                InvocationHeader::LEN + payload.len(),
                remote,
                imm,
            )
            .unwrap();
        let until = Instant::now() + timeout;
        let mut done = [Completion::EMPTY; 8];
        while Instant::now() < until {
            let n = self.cq.wait(&mut done, Duration::from_millis(100)).ok()?;
            for c in &done[..n] {
                if c.opcode == Opcode::RecvWithImm {
                    if !c.status.is_ok() {
                        return None;
                    }
                    let r = ResponseImm::decode(c.imm).unwrap();
                    assert_eq!(r.invocation_id, id);
                    let len = c.byte_len as usize;
                    return Some((r.status, self.output.read_to_vec(..len)));
                }
            }
        }
        None
    }
}

#[test]
fn the_allocated_worker_answers_invocations() {
    let d = start(ExecutordOptions::default());
    let mut c = Control::connect(&d);
    for provider in ["tcp", "shm"] {
        let mut req = good_request(&d, 1);
        req.provider = provider.into();
        let ok = c.allocate(req, c_library_bytes()).unwrap();
        let mut lane = RawLane::connect(&ok, provider);
        let (status, out) = lane
            .invoke(0, b"hello executor", MINUTE)
            .expect("a response");
        assert_eq!(status, rfaas_proto::InvocationStatus::Ok, "{provider}");
        assert_eq!(out, b"hello executor", "{provider}");
        c.deallocate(ok.allocation_id)
            .parse::<Deallocated>()
            .unwrap();
    }
}

#[test]
fn a_crashing_function_is_reported_as_a_crash() {
    let d = start(ExecutordOptions::default());
    let mut c = Control::connect(&d);
    let req = request(d.token("nobody", 1, 2048, MINUTE), 1, &["fault_segfault"]);
    let ok = c.allocate(req, c_library_bytes()).unwrap();
    let mut lane = RawLane::connect(&ok, "tcp");
    let _ = lane.invoke(0, b"", Duration::from_secs(5));
    let exited = c.worker_exited();
    assert_eq!(exited.allocation_id, ok.allocation_id);
    assert_eq!(exited.cause, ExitCause::Crashed, "{}", exited.message);
    assert_eq!(exited.signal, Some(libc::SIGSEGV));
    all_free(&d);
}

#[test]
fn a_function_past_its_deadline_ends_the_worker() {
    let d = start(ExecutordOptions::default());
    let mut c = Control::connect(&d);
    let mut req = request(d.token("nobody", 1, 2048, MINUTE), 1, &["sleep_ms"]);
    req.deadline_ms = 200;
    let ok = c.allocate(req, c_library_bytes()).unwrap();
    assert_eq!(ok.deadline_ms, 200);
    let mut lane = RawLane::connect(&ok, "tcp");
    let response = lane.invoke(0, &30_000u32.to_le_bytes(), MINUTE);
    if let Some((status, _)) = response {
        assert_eq!(status, rfaas_proto::InvocationStatus::DeadlineExceeded);
    }
    let exited = c.worker_exited();
    assert_eq!(
        exited.cause,
        ExitCause::DeadlineExceeded,
        "{}",
        exited.message
    );
    assert_eq!(exited.exit_code, Some(3));
    all_free(&d);
}

#[test]
fn a_draining_worker_refuses_new_invocations() {
    let d = start(ExecutordOptions::default());
    let mut c = Control::connect(&d);
    let ok = c.allocate(good_request(&d, 1), c_library_bytes()).unwrap();
    let mut lane = RawLane::connect(&ok, "tcp");
    let (status, _) = lane.invoke(0, b"before", MINUTE).expect("a response");
    assert_eq!(status, rfaas_proto::InvocationStatus::Ok);
    std::thread::scope(|s| {
        let drain = s.spawn(|| d.local(LocalRequest::Drain { grace_ms: 3_000 }));
        d.wait_status(MINUTE, |s| {
            matches!(s, LocalReply::Status { draining: true, .. })
        });
        // SIGUSR1 is asynchronous: the worker refuses once it has seen it.
        let until = Instant::now() + MINUTE;
        loop {
            let (status, _) = lane.invoke(0, b"during", MINUTE).expect("a response");
            if status == rfaas_proto::InvocationStatus::ExecutorDraining {
                break;
            }
            assert_eq!(status, rfaas_proto::InvocationStatus::Ok);
            assert!(Instant::now() < until, "the worker never refused");
        }
        let done = drain.join().unwrap();
        assert!(matches!(done, LocalReply::Done { .. }), "{done:?}");
    });
    assert_eq!(c.worker_exited().cause, ExitCause::Drained);
}

#[test]
fn a_long_multibyte_library_name_is_served() {
    let d = start(ExecutordOptions::default());
    let mut c = Control::connect(&d);
    // 600 bytes, past the kernel's limit for a memfd's name.
    let mut req = good_request(&d, 1);
    req.library_name = "€".repeat(200);
    let ok = c
        .allocate(req, c_library_bytes())
        .unwrap_or_else(|e| panic!("{e:?}\n{}", d.log()));
    c.deallocate(ok.allocation_id)
        .parse::<Deallocated>()
        .unwrap();
}

/// A library whose constructor tells the test it runs (a byte into the
/// FIFO `signal`) and never returns: its worker never answers
/// `WorkerReady`, so its allocation stays in flight.
fn never_loading_library(signal: &Path) -> Vec<u8> {
    let dir = signal.parent().unwrap();
    let src = dir.join("never.c");
    std::fs::write(
        &src,
        format!(
            "#include <fcntl.h>\n\
             #include <unistd.h>\n\
             __attribute__((constructor)) static void never_returns(void) {{\n\
             int fd = open({signal:?}, O_WRONLY);\n\
             if (fd >= 0) {{ (void)write(fd, \"x\", 1); close(fd); }}\n\
             for (;;) pause();\n\
             }}\n\
             unsigned int echo(void *in, unsigned int len, void *out) {{ (void)in; (void)out; return len; }}\n"
        ),
    )
    .unwrap();
    let lib = dir.join("libnever.so");
    let out = std::process::Command::new("cc")
        .args(["-shared", "-fPIC", "-o"])
        .arg(&lib)
        .arg(&src)
        .output()
        .expect("run cc");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::read(&lib).unwrap()
}

/// A FIFO the worker (user nobody) may write to, opened for reading
/// without blocking.
fn fifo(dir: &Path) -> (std::path::PathBuf, std::fs::File) {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    std::fs::create_dir_all(dir).unwrap();
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let path = dir.join("signal");
    let c = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
    // SAFETY: a valid C string.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666)).unwrap();
    let reader = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(&path)
        .unwrap();
    (path, reader)
}

/// Waits (in `poll`) until `f` has a byte to read.
fn wait_readable(f: &std::fs::File, timeout: Duration) -> bool {
    use std::os::fd::AsRawFd;
    let mut p = libc::pollfd {
        fd: f.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd.
    unsafe {
        libc::poll(&mut p, 1, timeout.as_millis() as i32) == 1 && p.revents & libc::POLLIN != 0
    }
}

/// Sends SIGTERM to the daemon (its `Drop` waits for the exit).
fn terminate(d: &Executord) {
    // SAFETY: kill has no memory preconditions; the pid is the test's child.
    unsafe { libc::kill(d.pid() as libc::pid_t, libc::SIGTERM) };
}

#[test]
fn an_allocation_in_flight_at_shutdown_is_refused_draining() {
    let d = start(ExecutordOptions::default());
    let dir = std::env::temp_dir().join(format!("rfaas-never-loads-{}", std::process::id()));
    let (signal, reader) = fifo(&dir);
    let mut c = Control::connect(&d);
    let mut req = request(d.token("nobody", 1, 1024, MINUTE), 1, &["echo"]);
    req.request_id = 9;
    c.send(&Frame::new(&req, never_loading_library(&signal)));
    // The worker is loading the library and hangs in its constructor.
    assert!(
        wait_readable(&reader, MINUTE),
        "the library was never loaded\n{}",
        d.log()
    );
    terminate(&d);
    let e: ErrorReply = c
        .recv()
        .parse()
        .expect("a refusal, not a closed connection");
    assert_eq!(
        (e.request_id, e.code),
        (9, ErrorCode::Draining),
        "{}",
        e.message
    );
    assert!(e.message.contains("shutting down"), "{}", e.message);
    assert!(c.closed(), "then the daemon is gone");
    drop(reader);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn allocations_sent_during_shutdown_are_refused_draining() {
    let d = start(ExecutordOptions::default());
    let lib = c_library_bytes();
    // One client is in the middle of sending its library...
    let mut sending = Control::connect(&d);
    let mut req = good_request(&d, 1);
    req.request_id = 1;
    let bytes = Frame::new(&req, lib.clone()).to_bytes();
    let half = bytes.len() - lib.len() / 2;
    sending.stream.write_all(&bytes[..half]).unwrap();
    // ...another is connected and idle.
    let mut later = Control::connect(&d);
    later
        .allocate(good_request(&d, 1), lib.clone())
        .expect("served before the shutdown");
    // (Its allocation is stopped by the shutdown.)
    terminate(&d);
    let e: ErrorReply = sending.recv().parse().unwrap();
    assert_eq!(
        (e.request_id, e.code),
        (1, ErrorCode::Draining),
        "{}",
        e.message
    );
    // The daemon is stopping now; a request sent meanwhile is refused too.
    let exited = later.worker_exited();
    assert_eq!(exited.cause, ExitCause::Stopped);
    let e = later.allocate(good_request(&d, 1), lib).unwrap_err();
    assert_eq!(e.code, ErrorCode::Draining, "{}", e.message);
    // The first finishes sending its library (the daemon drops it), and
    // both connections end.
    sending.stream.write_all(&bytes[half..]).unwrap();
    assert!(sending.closed());
    assert!(later.closed());
}

#[test]
fn too_little_memory_is_refused_with_the_figure_needed() {
    let d = start(ExecutordOptions::default());
    let mut c = Control::connect(&d);
    let lib = c_library_bytes();
    for provider in ["tcp", "shm"] {
        let mut figure = None;
        for mib in [1, 4, 8, 16] {
            let mut req = good_request(&d, 1);
            req.provider = provider.into();
            req.memory_mib = mib;
            let e = c.allocate(req, lib.clone()).unwrap_err();
            assert_eq!(
                e.code,
                ErrorCode::MemoryTooSmall,
                "{mib} MiB: {}",
                e.message
            );
            assert!(!e.code.is_retryable());
            for part in [
                &format!("asks for {mib} MiB")[..],
                "for the worker process itself",
                "for the library's loaded segments",
                "for its output buffer and guard page",
            ] {
                assert!(e.message.contains(part), "{part:?} not in {}", e.message);
            }
            let at = e.message.find("ask for memory_mib ").unwrap() + 19;
            let n: u32 = e.message[at..]
                .split_whitespace()
                .next()
                .unwrap()
                .parse()
                .unwrap();
            assert!(figure.is_none_or(|f| f == n), "{}", e.message);
            figure = Some(n);
        }
        // The figure is enough, and says what is left for a pulled input.
        let mut req = good_request(&d, 1);
        req.provider = provider.into();
        req.memory_mib = figure.unwrap();
        let ok = c
            .allocate(req.clone(), lib.clone())
            .unwrap_or_else(|e| panic!("{provider}: {e:?}\n{}", d.log()));
        // What is left is what rounding up to a MiB left.
        assert!(ok.max_input_bytes < 1 << 20, "{}", ok.max_input_bytes);
        let mut lane = RawLane::connect(&ok, provider);
        let (status, out) = lane.invoke(0, b"just enough", MINUTE).expect("a response");
        assert_eq!(status, rfaas_proto::InvocationStatus::Ok);
        assert_eq!(out, b"just enough");
        // Before the lane closes: a worker whose clients all left ends
        // itself, and the daemon would report that instead.
        c.deallocate(ok.allocation_id)
            .parse::<Deallocated>()
            .unwrap();
        drop(lane);
        // 16 MiB more: 16 MiB of input on tcp, a third of it on shm.
        req.memory_mib += 16;
        let ok = c.allocate(req, lib.clone()).unwrap();
        let expected = if provider == "shm" {
            (16 << 20) / 3
        } else {
            16 << 20
        };
        assert!(
            ok.max_input_bytes.abs_diff(expected) < 1 << 20,
            "{provider}: {}",
            ok.max_input_bytes
        );
        c.deallocate(ok.allocation_id)
            .parse::<Deallocated>()
            .unwrap();
    }
}

/// Under a `Type=notify` unit systemd learns the daemon serves from one
/// `READY=1` datagram on `$NOTIFY_SOCKET`, sent once the control port
/// answers; a stop sends `STOPPING=1`.
#[test]
fn the_daemon_tells_systemd_it_is_ready_once_its_port_answers() {
    let dir = rfaas_testkit::TempDir::new("notify");
    let path = dir.join("notify.sock");
    let sock = std::os::unix::net::UnixDatagram::bind(&path).expect("bind the notify socket");
    sock.set_read_timeout(Some(MINUTE)).unwrap();
    let d = start(ExecutordOptions {
        env: vec![("NOTIFY_SOCKET".into(), path.display().to_string())],
        ..Default::default()
    });
    let mut buf = [0u8; 512];
    let n = sock.recv(&mut buf).expect("READY=1 within a minute");
    let said = String::from_utf8_lossy(&buf[..n]).into_owned();
    assert!(
        said.starts_with("READY=1\nSTATUS=serving control="),
        "{said:?}"
    );
    TcpStream::connect(d.control_addr()).expect("the control port answers once READY=1 is sent");
    drop(d);
    let n = sock
        .recv(&mut buf)
        .expect("STOPPING=1 when the daemon stops");
    assert_eq!(&buf[..n], b"STOPPING=1");
}

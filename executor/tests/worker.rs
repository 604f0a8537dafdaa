//! `rfaas-worker` end to end: the test plays the daemon (a socket pair, an
//! `Assignment` with the library's sealed memfd) and the client (raw
//! rfaas-fabric endpoints and rfaas-proto headers), for the tcp and shm
//! providers.

use std::collections::BTreeSet;
use std::io::Write as _;
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::net::UnixStream;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rfaas_executor::ipc::{recv_frame, sealed_memfd, send_frame};
use rfaas_executor::meter::{MeterArea, TickClock};
use rfaas_executor::worker::EXIT_DEADLINE;
use rfaas_fabric::{
    Access, Completion, CompletionQueue, Domain, Endpoint, EndpointOptions, Fabric, MemoryRegion,
    Opcode, RemoteAddr, Status,
};
use rfaas_proto::control::client::{Descriptor, Mode};
use rfaas_proto::control::worker::{Assignment, WorkerFailed, WorkerReady};
use rfaas_proto::control::{ErrorCode, ErrorReply, Frame, FrameLimits, Kind};
use rfaas_proto::hello::{LaneHello, LaneKey, LANE_HELLO_IMM};
use rfaas_proto::meter::LaneState;
use rfaas_proto::{InvocationHeader, InvocationStatus, RequestImm, ResponseImm};
use rfaas_testkit::wait::{poll_for, wait_for, wait_until, wait_until_all_asleep};
use rstest::rstest;

const TIMEOUT: Duration = Duration::from_secs(30);
const FUNCTIONS: [&str; 8] = [
    "noop",
    "echo",
    "fault_segfault",
    "fault_overrun",
    "fault_claim",
    "sleep_ms",
    "fault_abort",
    "fault_stack_overflow",
];
const NOOP: u16 = 0;
const ECHO: u16 = 1;
const SEGFAULT: u16 = 2;
const OVERRUN: u16 = 3;
const CLAIM: u16 = 4;
const SLEEP: u16 = 5;
const ABORT: u16 = 6;
const STACK_OVERFLOW: u16 = 7;

fn is_root() -> bool {
    // SAFETY: geteuid cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// The user the worker runs as: nobody when the tests run as root (the
/// worker refuses root), else the tests' own user.
fn worker_user() -> (u32, u32) {
    if is_root() {
        (65534, 65534)
    } else {
        // SAFETY: getuid and getgid cannot fail.
        unsafe { (libc::getuid(), libc::getgid()) }
    }
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

/// A directory removed on drop; writable by everyone, so a worker that
/// dropped to another user can create its shm socket there.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> TempDir {
        static N: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "rfaas-worker-test-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let c = std::ffi::CString::new(dir.to_str().unwrap()).unwrap();
        // SAFETY: chmod on a path we just created.
        assert_eq!(unsafe { libc::chmod(c.as_ptr(), 0o777) }, 0);
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The lane key of every test assignment.
fn key() -> LaneKey {
    LaneKey([0x5a; 24])
}

/// The assignment most tests use: two lanes, hot, 64 KiB buffers.
fn assignment(provider: &str, dir: &TempDir) -> Assignment {
    let (uid, gid) = worker_user();
    Assignment {
        allocation_id: 7,
        lane_key: key().to_hex(),
        uid,
        gid,
        cpus: vec![],
        lanes: 2,
        threads: 0,
        slots: 0,
        memory_limit_bytes: 0,
        memory_mib: 0,
        pull_limit_bytes: 0,
        mode: Mode::Hot,
        hot_timeout_us: 1000,
        input_capacity: 64 << 10,
        output_capacity: 64 << 10,
        deadline_ms: 0,
        expires_at: unix_now() + 3600,
        functions: FUNCTIONS.iter().map(|s| s.to_string()).collect(),
        provider: provider.into(),
        listen_addr: match provider {
            "shm" => dir.0.join("worker.sock").to_str().unwrap().into(),
            _ => "127.0.0.1:0".into(),
        },
        read_only_input: false,
        adopt_dir: String::new(),
    }
}

/// A running rfaas-worker, killed on drop.
struct Worker {
    child: Child,
    control: UnixStream,
    status: Option<ExitStatus>,
}

impl Worker {
    fn spawn() -> Worker {
        let (control, theirs) = UnixStream::pair().unwrap();
        let fd = theirs.as_raw_fd();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_rfaas-worker"));
        cmd.arg("--control-fd").arg(fd.to_string());
        // SAFETY: the closure only calls fcntl, which is async-signal-safe.
        unsafe {
            cmd.pre_exec(move || {
                // Let the worker inherit its end of the socket pair.
                if libc::fcntl(fd, libc::F_SETFD, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = cmd.spawn().expect("start rfaas-worker");
        drop(theirs);
        Worker {
            child,
            control,
            status: None,
        }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends `a` with `library` as the memfd; returns the worker's reply.
    fn assign(&self, a: &Assignment, library: &[u8]) -> Frame {
        let memfd = sealed_memfd("libfunctions.so", library).unwrap();
        send_frame(&self.control, &Frame::new(a, vec![]), &[memfd.as_fd()]).unwrap();
        self.control.set_read_timeout(Some(TIMEOUT)).unwrap();
        let (frame, fds) = recv_frame(&self.control, FrameLimits::default()).unwrap();
        assert!(fds.is_empty());
        frame
    }

    /// [`Worker::ready`] with a meter area passed after the library, as the
    /// daemon passes it; returns the daemon's side of the area too.
    fn ready_metered(&self, a: &Assignment) -> (WorkerReady, MeterArea) {
        let (area, area_fd) = MeterArea::create(a.lanes, TickClock::MONOTONIC).unwrap();
        let library = rfaas_testkit::functions::c_library_bytes();
        let memfd = sealed_memfd("libfunctions.so", &library).unwrap();
        send_frame(
            &self.control,
            &Frame::new(a, vec![]),
            &[memfd.as_fd(), area_fd.as_fd()],
        )
        .unwrap();
        self.control.set_read_timeout(Some(TIMEOUT)).unwrap();
        let (frame, _) = recv_frame(&self.control, FrameLimits::default()).unwrap();
        assert_eq!(frame.kind, Kind::WorkerReady, "{frame:?}");
        (frame.parse().unwrap(), area)
    }

    /// The worker's threads named `rfaas-serve-<t>`.
    fn serving_threads(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/task", self.pid()))
            .unwrap()
            .filter_map(Result::ok)
            .filter(|t| {
                std::fs::read_to_string(t.path().join("comm"))
                    .is_ok_and(|c| c.starts_with("rfaas-serve-"))
            })
            .count()
    }

    fn ready(&self, a: &Assignment) -> WorkerReady {
        let frame = self.assign(a, &rfaas_testkit::functions::c_library_bytes());
        if frame.kind == Kind::WorkerFailed {
            let WorkerFailed(e) = frame.parse().unwrap();
            panic!("the worker failed: {e:?}");
        }
        frame.parse().unwrap()
    }

    /// Waits for the worker to end.
    fn wait(&mut self) -> ExitStatus {
        let status = wait_for("the worker to end", TIMEOUT, || {
            self.child.try_wait().unwrap()
        });
        self.status = Some(status);
        status
    }

    fn signal(&self, sig: libc::c_int) {
        // SAFETY: kill on our own child's pid.
        assert_eq!(unsafe { libc::kill(self.pid() as libc::pid_t, sig) }, 0);
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        if self.status.is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// A client lane: an endpoint with its own queue, a staging region holding
/// `[header][payload]`, and an output region the worker writes into.
struct ClientLane {
    ep: Endpoint,
    cq: CompletionQueue,
    input: MemoryRegion,
    output: MemoryRegion,
    remote: Descriptor,
    next_id: u32,
}

// The client's regions are not shared between threads at once: each lane
// belongs to one test thread.
struct Client {
    _fabric: Fabric,
    _domain: Domain,
    lanes: Vec<ClientLane>,
}

fn connect(provider: &str, ready: &WorkerReady, staging: usize, output: usize) -> Client {
    let fabric = Fabric::open(provider).unwrap();
    let domain = fabric.domain().unwrap();
    let lanes = ready
        .lanes
        .iter()
        .enumerate()
        .map(|(i, remote)| {
            let mut lane = ClientLane::connect(&fabric, &domain, ready, remote, staging, output);
            assert!(
                lane.hello(i as u32, &key()),
                "the worker answers lane {i}'s hello"
            );
            lane
        })
        .collect();
    Client {
        _fabric: fabric,
        _domain: domain,
        lanes,
    }
}

impl ClientLane {
    /// Connects to the worker's listener; says no hello.
    fn connect(
        fabric: &Fabric,
        domain: &Domain,
        ready: &WorkerReady,
        remote: &Descriptor,
        staging: usize,
        output: usize,
    ) -> ClientLane {
        let opts = EndpointOptions::default();
        Self::connect_with(fabric, domain, ready, remote, staging, output, &opts)
            .unwrap_or_else(|e| panic!("connecting to the worker: {e}"))
    }

    /// [`ClientLane::connect`] with `opts` (a shorter connect timeout), or
    /// the fabric's error.
    fn connect_with(
        fabric: &Fabric,
        domain: &Domain,
        ready: &WorkerReady,
        remote: &Descriptor,
        staging: usize,
        output: usize,
        opts: &EndpointOptions,
    ) -> Result<ClientLane, rfaas_fabric::Error> {
        let mut cq = fabric.completion_queue(1024).unwrap();
        let ep = domain.connect(&ready.fabric_addr, &mut cq, opts)?;
        for wr in 0..4 {
            ep.post_recv(wr).unwrap();
        }
        Ok(ClientLane {
            ep,
            cq,
            input: domain
                .register(InvocationHeader::LEN + staging, Access::REMOTE_READ)
                .unwrap(),
            output: domain.register(output, Access::REMOTE_WRITE).unwrap(),
            remote: *remote,
            next_id: 1,
        })
    }

    /// The lane hello, as the client library sends it first. Returns
    /// whether the worker answered it within two seconds.
    fn hello(&mut self, lane: u32, key: &LaneKey) -> bool {
        let mut hello = [0; LaneHello::LEN];
        LaneHello { lane, key: *key }.encode(&mut hello).unwrap();
        self.input.write_from(0, &hello);
        self.ep
            .write_with_imm(
                999,
                &self.input,
                0,
                LaneHello::LEN,
                RemoteAddr {
                    addr: self.remote.addr,
                    rkey: self.remote.rkey,
                },
                LANE_HELLO_IMM,
            )
            .unwrap();
        let start = Instant::now();
        let mut done = [Completion::EMPTY; 4];
        while start.elapsed() < Duration::from_secs(2) {
            let n = self.cq.poll(&mut done);
            for c in &done[..n] {
                if c.opcode == Opcode::RecvWithImm && c.status.is_ok() {
                    assert_eq!(c.imm, LANE_HELLO_IMM, "the answer to a hello");
                    assert_eq!(c.byte_len, 0);
                    self.ep.post_recv(c.wr_id).unwrap();
                    return true;
                }
            }
            std::thread::yield_now();
        }
        false
    }

    /// Whether the worker has closed this connection: a write to it fails
    /// (at post or in its completion) within `TIMEOUT`. One probe write is
    /// in flight at a time; the next is posted once it completed.
    fn is_dropped(&mut self) -> bool {
        const PROBE: u64 = 5;
        let mut done = [Completion::EMPTY; 8];
        let mut in_flight = false;
        poll_for(TIMEOUT, || {
            if !in_flight {
                let to = RemoteAddr {
                    addr: self.remote.addr,
                    rkey: self.remote.rkey,
                };
                if self.ep.write(PROBE, &self.input, 0, 8, to).is_err() {
                    return Some(());
                }
                in_flight = true;
            }
            let n = self.cq.poll(&mut done);
            if done[..n].iter().any(|c| c.status != Status::Success) {
                return Some(());
            }
            assert!(
                !done[..n].iter().any(|c| c.opcode == Opcode::RecvWithImm),
                "a connection without the lane key got an answer"
            );
            in_flight &= !done[..n].iter().any(|c| c.wr_id == PROBE);
            None
        })
        .is_some()
    }

    /// Invokes `function` on `payload`: inline when it fits the worker's
    /// input buffer, else bulk. Returns the status and the output.
    fn invoke(&mut self, function: u16, payload: &[u8]) -> (InvocationStatus, Vec<u8>) {
        let len = payload.len() as u32;
        if InvocationHeader::LEN + payload.len() <= self.remote.len as usize {
            self.call(function, self.inline_header(len), payload)
        } else {
            self.input.write_from(InvocationHeader::LEN, payload);
            self.call(function, self.bulk_header(len), &[])
        }
    }

    /// A header for `input_len` bytes sent inline, answered into the whole
    /// output region.
    fn inline_header(&self, input_len: u32) -> InvocationHeader {
        InvocationHeader {
            output_addr: self.output.as_ptr() as u64,
            output_rkey: self.output.rkey(),
            output_capacity: self.output.len() as u32,
            input_addr: 0,
            input_rkey: 0,
            input_len,
        }
    }

    /// A header for `input_len` bytes the worker reads from the staging
    /// region, after the header.
    fn bulk_header(&self, input_len: u32) -> InvocationHeader {
        InvocationHeader {
            input_addr: self.input.as_ptr() as u64 + InvocationHeader::LEN as u64,
            input_rkey: self.input.rkey(),
            ..self.inline_header(input_len)
        }
    }

    /// Posts a request, `header` then `inline` right after it, whatever
    /// the header claims, and does not wait for the response. Returns the
    /// invocation id.
    fn send(&mut self, function: u16, header: InvocationHeader, inline: &[u8]) -> u32 {
        self.input.write_from(0, &header.to_bytes());
        self.input.write_from(InvocationHeader::LEN, inline);
        let id = self.next_id;
        self.next_id = rfaas_proto::next_invocation_id(id);
        let imm = RequestImm {
            invocation_id: id,
            function_index: function,
        }
        .encode()
        .unwrap();
        self.ep
            .write_with_imm(
                1000 + u64::from(id),
                &self.input,
                0,
                InvocationHeader::LEN + inline.len(),
                RemoteAddr {
                    addr: self.remote.addr,
                    rkey: self.remote.rkey,
                },
                imm,
            )
            .unwrap();
        id
    }

    /// Sends a request as [`ClientLane::send`] does and waits for its
    /// response: the status and the output.
    fn call(
        &mut self,
        function: u16,
        header: InvocationHeader,
        inline: &[u8],
    ) -> (InvocationStatus, Vec<u8>) {
        let id = self.send(function, header, inline);
        let c = self.response();
        self.ep.post_recv(c.wr_id).unwrap();
        let resp = ResponseImm::decode(c.imm).unwrap();
        assert_eq!(resp.invocation_id, id, "the response names the request");
        let out = self.output.read_to_vec(..c.byte_len as usize);
        match resp.status {
            InvocationStatus::Ok => {}
            InvocationStatus::FunctionCrashed => {
                assert!(
                    c.byte_len == 0 || c.byte_len == 4,
                    "a crash carries its signal or nothing"
                )
            }
            _ => assert_eq!(c.byte_len, 0, "only ok carries output"),
        }
        (resp.status, out)
    }

    /// The next response; send completions must be successful.
    fn response(&mut self) -> Completion {
        let start = Instant::now();
        let mut done = [Completion::EMPTY; 8];
        let mut found = None;
        loop {
            let n = self.cq.poll(&mut done);
            for c in &done[..n] {
                if c.opcode == Opcode::RecvWithImm {
                    if found.is_some() {
                        // The spare receives fail once a worker that
                        // answered and ended is gone.
                        assert_ne!(c.status, Status::Success, "one response per request");
                        continue;
                    }
                    assert_eq!(c.status, Status::Success, "the response arrives");
                    found = Some(*c);
                } else {
                    assert_eq!(
                        c.status,
                        Status::Success,
                        "the request was delivered: {c:?}"
                    );
                }
            }
            if let Some(c) = found {
                return c;
            }
            assert!(start.elapsed() < TIMEOUT, "no response within {TIMEOUT:?}");
            std::thread::yield_now();
        }
    }
}

#[rstest]
#[case::tcp("tcp")]
#[case::shm("shm")]
fn connections_without_the_lane_key_are_dropped(#[case] provider: &str) {
    let (_dir, _worker, ready) = one_lane_worker(provider);
    let fabric = Fabric::open(provider).unwrap();
    let domain = fabric.domain().unwrap();
    let remote = &ready.lanes[0];
    let lane = |d: &Domain| ClientLane::connect(&fabric, d, &ready, remote, 4096, 4096);

    // A stranger with a wrong key, one naming another lane, one that says
    // nothing (dropped after a second): none is served.
    let mut wrong = lane(&domain);
    assert!(
        !wrong.hello(0, &LaneKey([0x11; 24])),
        "a wrong key gets no answer"
    );
    assert!(wrong.is_dropped(), "a wrong key is refused");
    let mut other_lane = lane(&domain);
    assert!(!other_lane.hello(1, &key()));
    assert!(
        other_lane.is_dropped(),
        "a hello for another lane is refused"
    );
    let mut silent = lane(&domain);
    assert!(silent.is_dropped(), "a silent connection is dropped");

    // The allocation's client still gets its lane.
    let mut real = lane(&domain);
    assert!(real.hello(0, &key()), "the allocation's client is answered");
    let (status, out) = real.invoke(ECHO, b"still served");
    assert_eq!(status, InvocationStatus::Ok);
    assert_eq!(out, b"still served");
}

#[rstest]
#[case::tcp("tcp")]
#[case::shm("shm")]
fn connections_that_never_say_hello_hold_up_nobody(#[case] provider: &str) {
    let (_dir, _worker, ready) = one_lane_worker(provider);
    let fabric = Fabric::open(provider).unwrap();
    let domain = fabric.domain().unwrap();
    let remote = &ready.lanes[0];
    // Three connections that finish the fabric's handshake and then say
    // nothing, connecting at once ahead of the client: each is on
    // probation for a second, all together, so the client connects well
    // within two seconds (one after the other, they would hold it up for
    // three, and its connect would time out).
    std::thread::scope(|s| {
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        let done_rx = std::sync::Arc::new(std::sync::Mutex::new(done_rx));
        let (connected_tx, connected_rx) = std::sync::mpsc::channel::<()>();
        let silent: Vec<_> = (0..3)
            .map(|_| {
                let done_rx = done_rx.clone();
                let connected_tx = connected_tx.clone();
                let (fabric, ready) = (&fabric, &ready);
                s.spawn(move || {
                    let domain = fabric.domain().unwrap();
                    let opts = EndpointOptions::default();
                    let connected =
                        ClientLane::connect_with(fabric, &domain, ready, remote, 4096, 4096, &opts);
                    connected_tx.send(()).unwrap();
                    // Refused outright is fine too: served it is not.
                    let Ok(mut lane) = connected else {
                        return true;
                    };
                    let _ = done_rx.lock().unwrap().recv();
                    lane.is_dropped()
                })
            })
            .collect();
        // The three are through the fabric's handshake (on probation at the
        // worker, which has room for four) before the client connects.
        for _ in 0..3 {
            connected_rx.recv_timeout(TIMEOUT).unwrap();
        }
        let quick = EndpointOptions {
            connect_timeout: Duration::from_secs(2),
            ..EndpointOptions::default()
        };
        let mut real =
            ClientLane::connect_with(&fabric, &domain, &ready, remote, 4096, 4096, &quick)
                .unwrap_or_else(|e| panic!("the client's connect: {e}"));
        assert!(real.hello(0, &key()), "the allocation's client is answered");
        let (status, out) = real.invoke(ECHO, b"not held up");
        assert_eq!(
            (status, &out[..]),
            (InvocationStatus::Ok, &b"not held up"[..])
        );
        drop(done_tx);
        for t in silent {
            assert!(t.join().unwrap(), "a silent connection is dropped");
        }
    });
}

/// A raw connection to a fabric address, below the fabric: a TCP stream,
/// or a unix stream for shm (`@name`: the abstract namespace).
fn raw_connect(addr: &str) -> Box<dyn std::io::Write> {
    if let Ok(sa) = addr.parse::<std::net::SocketAddr>() {
        return Box::new(std::net::TcpStream::connect(sa).unwrap());
    }
    let unix = match addr.strip_prefix('@') {
        Some(name) => {
            use std::os::linux::net::SocketAddrExt;
            std::os::unix::net::SocketAddr::from_abstract_name(name).unwrap()
        }
        None => std::os::unix::net::SocketAddr::from_pathname(addr).unwrap(),
    };
    Box::new(std::os::unix::net::UnixStream::connect_addr(&unix).unwrap())
}

#[rstest]
#[case::tcp("tcp")]
#[case::shm("shm")]
fn connections_that_fail_the_fabric_handshake_cost_the_worker_nothing(#[case] provider: &str) {
    let (_dir, mut worker, ready) = one_lane_worker(provider);
    // One peer that says nothing, one that says nonsense and leaves: each
    // is refused within the worker's one-second handshake bound...
    let _silent = raw_connect(&ready.fabric_addr);
    let mut noise = raw_connect(&ready.fabric_addr);
    noise.write_all(&[0x5a; 64]).unwrap();
    drop(noise);
    // ...and the allocation's client still gets its lane (its hello is
    // answered within two seconds of being sent).
    let fabric = Fabric::open(provider).unwrap();
    let domain = fabric.domain().unwrap();
    let mut real = ClientLane::connect(&fabric, &domain, &ready, &ready.lanes[0], 4096, 4096);
    assert!(real.hello(0, &key()), "the allocation's client is answered");
    let (status, out) = real.invoke(ECHO, b"served");
    assert_eq!((status, &out[..]), (InvocationStatus::Ok, &b"served"[..]));
    assert_eq!(worker.child.try_wait().unwrap(), None, "the worker lives");
}

/// A worker serving one lane, ready and not yet connected.
fn one_lane_worker(provider: &str) -> (TempDir, Worker, WorkerReady) {
    let dir = TempDir::new();
    let mut a = assignment(provider, &dir);
    a.lanes = 1;
    let worker = Worker::spawn();
    let ready = worker.ready(&a);
    (dir, worker, ready)
}

/// A worker serving one lane of `assignment` (changed by `tweak`), and a
/// client connected to it with `buffers` bytes of staging and output.
fn one_lane(
    provider: &str,
    buffers: usize,
    tweak: impl FnOnce(&mut Assignment),
) -> (TempDir, Worker, Client) {
    let dir = TempDir::new();
    let worker = Worker::spawn();
    let mut a = assignment(provider, &dir);
    a.lanes = 1;
    tweak(&mut a);
    let ready = worker.ready(&a);
    let client = connect(provider, &ready, buffers, buffers);
    (dir, worker, client)
}

fn pattern(len: usize, seed: u32) -> Vec<u8> {
    (0..len as u32)
        .map(|i| (i.wrapping_mul(31).wrapping_add(seed * 7) >> 3) as u8)
        .collect()
}

fn u32_input(n: u32) -> Vec<u8> {
    n.to_le_bytes().to_vec()
}

#[rstest]
#[case::tcp("tcp")]
#[case::shm("shm")]
fn echo_on_two_lanes_is_byte_exact(#[case] provider: &str) {
    let dir = TempDir::new();
    let worker = Worker::spawn();
    let a = assignment(provider, &dir);
    let ready = worker.ready(&a);
    assert_eq!(ready.lanes.len(), 2);
    assert!(ready.lanes.iter().all(|l| l.len == 64 << 10));
    let client = connect(provider, &ready, 64 << 10, 64 << 10);
    let max = (64 << 10) - InvocationHeader::LEN;
    std::thread::scope(|s| {
        for (lane_no, mut lane) in client.lanes.into_iter().enumerate() {
            s.spawn(move || {
                let sizes = [0, 1, 31, 32, 33, 4095, 4096, 4097, 10_000, max - 1, max];
                for round in 0..20u32 {
                    for (k, &len) in sizes.iter().enumerate() {
                        let seed = round * 100 + k as u32 + lane_no as u32 * 10_000;
                        let input = pattern(len, seed);
                        let (status, out) = lane.invoke(ECHO, &input);
                        assert_eq!(status, InvocationStatus::Ok);
                        assert!(out == input, "lane {lane_no}: echo of {len} bytes differs");
                    }
                }
                let (status, out) = lane.invoke(NOOP, b"ignored");
                assert_eq!(status, InvocationStatus::Ok);
                assert!(out.is_empty());
            });
        }
    });
}

#[rstest]
#[case::tcp("tcp")]
#[case::shm("shm")]
fn refused_requests_get_their_status(#[case] provider: &str) {
    let (_dir, mut worker, mut client) = one_lane(provider, 64 << 10, |_| {});
    let lane = &mut client.lanes[0];

    let (status, _) = lane.invoke(FUNCTIONS.len() as u16, b"x");
    assert_eq!(status, InvocationStatus::UnknownFunction);
    let (status, _) = lane.invoke(4095, b"x");
    assert_eq!(status, InvocationStatus::UnknownFunction);

    // The header says 100 bytes follow, 10 do.
    let (status, _) = lane.call(ECHO, lane.inline_header(100), &[0; 10]);
    assert_eq!(status, InvocationStatus::MalformedRequest);
    // An inline header with an input address.
    let bad = InvocationHeader {
        input_addr: 0x1000,
        ..lane.inline_header(0)
    };
    let (status, _) = lane.call(ECHO, bad, &[]);
    assert_eq!(status, InvocationStatus::MalformedRequest);

    // fault_claim returns a length it never wrote.
    let (status, _) = lane.invoke(CLAIM, &u32_input((64 << 10) + 1));
    assert_eq!(status, InvocationStatus::OutputTooLarge);
    let (status, out) = lane.invoke(CLAIM, &u32_input(64 << 10));
    assert_eq!((status, out.len()), (InvocationStatus::Ok, 64 << 10));
    // Above the header's output capacity, below the allocation's.
    let small = InvocationHeader {
        output_capacity: 8,
        ..lane.inline_header(4)
    };
    let (status, _) = lane.call(CLAIM, small, &u32_input(9));
    assert_eq!(status, InvocationStatus::OutputTooLarge);

    // The lane still serves, and the worker ends when the client goes.
    let (status, out) = lane.invoke(ECHO, b"still here");
    assert_eq!(
        (status, &out[..]),
        (InvocationStatus::Ok, &b"still here"[..])
    );
    drop(client);
    let status = worker.wait();
    assert_eq!(status.code(), Some(0), "{status:?}");
}

#[rstest]
#[case::tcp("tcp")]
#[case::shm("shm")]
fn bulk_payload_is_pulled_and_echoed(#[case] provider: &str) {
    let (_dir, _worker, mut client) = one_lane(provider, 4 << 20, |a| {
        a.output_capacity = 4 << 20;
    });
    let lane = &mut client.lanes[0];
    for len in [(3 << 20) + 12_345, 64 << 10, (1 << 20) * 2, 100_000] {
        let input = pattern(len, len as u32);
        let (status, out) = lane.invoke(ECHO, &input);
        assert_eq!(status, InvocationStatus::Ok);
        assert_eq!(out.len(), len);
        assert!(out == input, "bulk echo of {len} bytes differs");
    }
    // Inline again after bulk.
    let (status, out) = lane.invoke(ECHO, b"small");
    assert_eq!((status, &out[..]), (InvocationStatus::Ok, &b"small"[..]));
}

#[rstest]
#[case::tcp("tcp")]
#[case::shm("shm")]
fn bulk_payload_beyond_the_memory_limit_is_refused(#[case] provider: &str) {
    let (_dir, _worker, mut client) = one_lane(provider, 64 << 10, |a| {
        a.memory_limit_bytes = 1 << 30;
    });
    let lane = &mut client.lanes[0];
    // Refused before anything is read: the client region is much smaller.
    let (status, _) = lane.call(ECHO, lane.bulk_header((1 << 30) + 1), &[]);
    assert_eq!(status, InvocationStatus::PayloadTooLarge);
    // Within the limit, but naming more than the client registered.
    let (status, _) = lane.call(ECHO, lane.bulk_header(128 << 10), &[]);
    assert_eq!(status, InvocationStatus::MalformedRequest);
    let (status, out) = lane.invoke(ECHO, b"ok");
    assert_eq!((status, &out[..]), (InvocationStatus::Ok, &b"ok"[..]));
}

/// A null dereference, and a stack overflow (whose handler runs on the lane
/// thread's alternate signal stack).
#[rstest]
fn a_fault_is_answered_then_ends_the_worker_with_sigsegv(
    #[values("tcp", "shm")] provider: &str,
    #[values(SEGFAULT, STACK_OVERFLOW)] function: u16,
) {
    let (_dir, mut worker, mut client) = one_lane(provider, 64 << 10, |_| {});
    let lane = &mut client.lanes[0];
    // The watchdog answers for the crashed function, with the signal...
    let (status, out) = lane.call(function, lane.inline_header(0), &[]);
    assert_eq!(status, InvocationStatus::FunctionCrashed);
    assert_eq!(out, (libc::SIGSEGV as u32).to_le_bytes());
    // ...and the worker dies of it.
    let status = worker.wait();
    assert_eq!(status.signal(), Some(libc::SIGSEGV), "{status:?}");
}

#[rstest]
#[case::tcp("tcp")]
#[case::shm("shm")]
fn abort_is_answered_without_the_signal_when_the_output_is_too_small(#[case] provider: &str) {
    let (_dir, mut worker, mut client) = one_lane(provider, 64 << 10, |_| {});
    let lane = &mut client.lanes[0];
    let header = InvocationHeader {
        output_capacity: 3,
        ..lane.inline_header(0)
    };
    let (status, out) = lane.call(ABORT, header, &[]);
    assert_eq!(status, InvocationStatus::FunctionCrashed);
    assert!(out.is_empty(), "{out:?}");
    let status = worker.wait();
    assert_eq!(status.signal(), Some(libc::SIGABRT), "{status:?}");
}

#[rstest]
#[case::tcp("tcp")]
#[case::shm("shm")]
fn writing_past_the_output_capacity_hits_the_guard_page(#[case] provider: &str) {
    let (_dir, mut worker, mut client) = one_lane(provider, 64 << 10, |a| {
        // Not a multiple of 64: the guard page starts 1024 bytes after `out`.
        a.output_capacity = 1000;
    });
    let lane = &mut client.lanes[0];
    let (status, out) = lane.invoke(OVERRUN, &u32_input(1000));
    assert_eq!(status, InvocationStatus::Ok);
    assert!(out.len() == 1000 && out.iter().all(|&b| b == 0xab));
    // Within the rounding: written, but more than the capacity.
    let (status, _) = lane.invoke(OVERRUN, &u32_input(1024));
    assert_eq!(status, InvocationStatus::OutputTooLarge);
    assert_eq!(worker.child.try_wait().unwrap(), None, "still alive");

    // Past the rounding: into the guard page.
    lane.send(OVERRUN, lane.inline_header(4), &u32_input(1025));
    let status = worker.wait();
    assert_eq!(status.signal(), Some(libc::SIGSEGV), "{status:?}");
}

#[rstest]
#[case::tcp("tcp")]
#[case::shm("shm")]
fn deadline_answers_and_exits_with_code_3(#[case] provider: &str) {
    let dir = TempDir::new();
    let mut worker = Worker::spawn();
    let mut a = assignment(provider, &dir);
    a.deadline_ms = 200;
    let ready = worker.ready(&a);
    let mut client = connect(provider, &ready, 64 << 10, 64 << 10);
    // Within the deadline.
    let (status, out) = client.lanes[1].invoke(SLEEP, &u32_input(10));
    assert_eq!((status, out), (InvocationStatus::Ok, u32_input(10)));
    let (status, out) = client.lanes[0].invoke(SLEEP, &u32_input(5000));
    assert_eq!(status, InvocationStatus::DeadlineExceeded);
    assert!(out.is_empty());
    let status = worker.wait();
    assert_eq!(status.code(), Some(EXIT_DEADLINE), "{status:?}");
}

#[rstest]
#[case::tcp_hot("tcp", Mode::Hot)]
#[case::tcp_warm("tcp", Mode::Warm)]
#[case::tcp_hot_then_warm("tcp", Mode::HotThenWarm)]
#[case::shm_hot("shm", Mode::Hot)]
#[case::shm_warm("shm", Mode::Warm)]
#[case::shm_hot_then_warm("shm", Mode::HotThenWarm)]
fn every_mode_serves(#[case] provider: &str, #[case] mode: Mode) {
    let dir = TempDir::new();
    let worker = Worker::spawn();
    let mut a = assignment(provider, &dir);
    a.mode = mode;
    a.hot_timeout_us = 2_000;
    let ready = worker.ready(&a);
    let mut client = connect(provider, &ready, 64 << 10, 64 << 10);
    for i in 0..20u32 {
        let lane = &mut client.lanes[(i % 2) as usize];
        let input = pattern(100 + i as usize * 37, i);
        let (status, out) = lane.invoke(ECHO, &input);
        assert_eq!(status, InvocationStatus::Ok);
        assert_eq!(out, input);
        // Some gaps past the hot period: hot_then_warm goes to sleep, and
        // the next request has to wake it.
        if i % 5 == 0 && mode == Mode::HotThenWarm {
            wait_until_all_asleep(worker.pid());
        }
    }
}

/// Many lanes on fewer threads: every lane's calls, made at once from as
/// many client threads, come back byte-exact on their own lane, and the
/// worker runs one thread per core, not per lane.
#[rstest]
#[case::tcp_hot("tcp", Mode::Hot)]
#[case::shm_hot("shm", Mode::Hot)]
#[case::shm_warm("shm", Mode::Warm)]
fn many_lanes_share_few_threads(#[case] provider: &str, #[case] mode: Mode) {
    let dir = TempDir::new();
    let worker = Worker::spawn();
    let mut a = assignment(provider, &dir);
    a.lanes = 9;
    a.threads = 2;
    a.mode = mode;
    let ready = worker.ready(&a);
    assert_eq!(ready.lanes.len(), 9);
    let client = connect(provider, &ready, 64 << 10, 64 << 10);
    let lanes = std::thread::scope(|s| {
        let calls: Vec<_> = client
            .lanes
            .into_iter()
            .enumerate()
            .map(|(lane_no, mut lane)| {
                s.spawn(move || {
                    for round in 0..200u32 {
                        let len = 1 + (round as usize * 97 + lane_no * 13) % 5000;
                        let input = pattern(len, round + lane_no as u32 * 100_000);
                        let (status, out) = lane.invoke(ECHO, &input);
                        assert_eq!(status, InvocationStatus::Ok);
                        assert!(out == input, "lane {lane_no}, call {round}: echo differs");
                    }
                    lane
                })
            })
            .collect();
        calls
            .into_iter()
            .map(|c| c.join().unwrap())
            .collect::<Vec<_>>()
    });
    // Every lane has answered, so every thread has started; the clients
    // are still connected.
    assert_eq!(worker.serving_threads(), 2, "a thread per core");
    drop(lanes);
}

/// One thread serving several lanes keeps each lane's meter record its
/// own: invocations, bytes and compute per lane, exactly; polling once per
/// thread, in its first lane's record, and nowhere else.
#[rstest]
#[case::tcp("tcp")]
#[case::shm("shm")]
fn the_meter_stays_per_lane_when_a_thread_serves_many(#[case] provider: &str) {
    let dir = TempDir::new();
    let worker = Worker::spawn();
    let mut a = assignment(provider, &dir);
    a.lanes = 6;
    a.threads = 2;
    let started = Instant::now();
    let (ready, area) = worker.ready_metered(&a);
    let mut client = connect(provider, &ready, 64 << 10, 64 << 10);
    // Lane k gets k + 1 calls of 10 × (k + 1) bytes each.
    for (k, lane) in client.lanes.iter_mut().enumerate() {
        for _ in 0..=k {
            let (status, out) = lane.invoke(ECHO, &vec![k as u8; 10 * (k + 1)]);
            assert_eq!(status, InvocationStatus::Ok);
            assert_eq!(out.len(), 10 * (k + 1));
        }
    }
    // The last answers are out before their lanes' records move on.
    let settled = |k: u16| match k {
        0 | 1 => LaneState::Hot.code(),
        _ => LaneState::Handling.code(),
    };
    wait_until("every record to settle", TIMEOUT, || {
        (0..6u16).all(|k| area.record(k).unwrap().read(100).0.state == settled(k))
    });
    let records: Vec<_> = (0..6u16)
        .map(|k| {
            let (v, consistent) = area.record(k).unwrap().read(100);
            assert!(consistent, "lane {k}'s record reads consistently");
            v
        })
        .collect();
    let wall = started.elapsed().as_nanos() as u64;
    for (k, v) in records.iter().enumerate() {
        let calls = k as u64 + 1;
        assert_eq!(v.invocations, calls, "lane {k}: its own calls");
        assert_eq!(
            v.bytes_in,
            calls * 10 * calls,
            "lane {k}: its own input bytes"
        );
        assert_eq!(v.bytes_out, v.bytes_in, "lane {k}: its own output bytes");
        assert!(v.compute > 0, "lane {k}: compute time for its calls");
        assert_eq!(v.warm, 0, "lane {k}: nobody waited");
        if k < 2 {
            // Lanes 0 and 1 are threads 0 and 1's own: they say the
            // thread is polling.
            assert_eq!(v.state, LaneState::Hot.code(), "lane {k}");
        } else {
            assert_eq!(
                v.hot, 0,
                "lane {k}: polling counts once per thread, not per lane"
            );
            assert_eq!(v.state, LaneState::Handling.code(), "lane {k}");
        }
    }
    // Each thread's time is in one bucket at a time: its own lane's hot and
    // compute and its other lanes' compute fit in the wall time.
    for t in 0..2 {
        let busy: u64 = records
            .iter()
            .skip(t)
            .step_by(2)
            .map(|v| v.compute)
            .sum::<u64>()
            + records[t].hot;
        assert!(busy <= wall, "thread {t}: {busy} ns of {wall} ns");
    }
    drop(client);
    let mut worker = worker;
    assert!(worker.wait().success());
    for k in 0..6u16 {
        let (v, _) = area.record(k).unwrap().read(100);
        assert_eq!(v.state, LaneState::Off.code(), "lane {k} ends off");
        assert_eq!(v.invocations, u64::from(k) + 1);
    }
}

/// Hot-then-warm falls back per thread: with several lanes on a thread,
/// the thread goes to sleep once none of them has called for the hot
/// period, and wakes for a call on any of them.
#[rstest]
#[case::tcp("tcp")]
#[case::shm("shm")]
fn a_thread_of_many_lanes_falls_back_to_warm(#[case] provider: &str) {
    let dir = TempDir::new();
    let worker = Worker::spawn();
    let mut a = assignment(provider, &dir);
    a.lanes = 4;
    a.threads = 2;
    a.mode = Mode::HotThenWarm;
    a.hot_timeout_us = 2_000;
    let (ready, area) = worker.ready_metered(&a);
    let mut client = connect(provider, &ready, 64 << 10, 64 << 10);
    for round in 0..3u32 {
        for (k, lane) in client.lanes.iter_mut().enumerate() {
            let (status, out) = lane.invoke(ECHO, &u32_input(round * 10 + k as u32));
            assert_eq!(status, InvocationStatus::Ok);
            assert_eq!(out, u32_input(round * 10 + k as u32));
        }
        wait_until_all_asleep(worker.pid());
        for t in 0..2u16 {
            let (v, _) = area.record(t).unwrap().read(100);
            assert_eq!(
                v.state,
                LaneState::Warm.code(),
                "round {round}: thread {t} waits"
            );
        }
    }
    let (v, _) = area.record(0).unwrap().read(100);
    assert!(
        v.warm > 0 && v.hot > 0,
        "thread 0 polled, then slept: {v:?}"
    );
}

/// Parses a kernel CPU list such as `0-2,5`.
fn cpu_list(s: &str) -> BTreeSet<u32> {
    let mut out = BTreeSet::new();
    for part in s.trim().split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => out.extend(a.parse::<u32>().unwrap()..=b.parse::<u32>().unwrap()),
            None => {
                out.insert(part.parse().unwrap());
            }
        }
    }
    out
}

fn status_field(path: &str, field: &str) -> String {
    let text = std::fs::read_to_string(path).unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(field))
        .unwrap_or_else(|| panic!("{path} has no {field}"))
        .trim()
        .to_string()
}

#[rstest]
#[case::tcp("tcp")]
#[case::shm("shm")]
fn runs_as_the_user_pinned_and_limited(#[case] provider: &str) {
    let dir = TempDir::new();
    let worker = Worker::spawn();
    let mut a = assignment(provider, &dir);
    let cpus = rfaas_testkit::cpus::allowed();
    let lane_cpus = vec![cpus[0], *cpus.last().unwrap()];
    a.cpus = lane_cpus.clone();
    a.memory_limit_bytes = 8 << 30;
    let ready = worker.ready(&a);
    let mut client = connect(provider, &ready, 64 << 10, 64 << 10);
    for lane in &mut client.lanes {
        let (status, out) = lane.invoke(ECHO, b"who");
        assert_eq!((status, &out[..]), (InvocationStatus::Ok, &b"who"[..]));
    }

    let pid = worker.pid();
    let (uid, gid) = worker_user();
    let proc_status = format!("/proc/{pid}/status");
    let uids = status_field(&proc_status, "Uid:");
    assert_eq!(
        uids.split_whitespace().collect::<Vec<_>>(),
        vec![uid.to_string(); 4]
    );
    let gids = status_field(&proc_status, "Gid:");
    assert_eq!(
        gids.split_whitespace().collect::<Vec<_>>(),
        vec![gid.to_string(); 4]
    );
    if is_root() {
        assert_eq!(status_field(&proc_status, "Groups:"), "");
    }
    assert_eq!(status_field(&proc_status, "NoNewPrivs:"), "1");

    let union: BTreeSet<u32> = lane_cpus.iter().copied().collect();
    let main = status_field(&proc_status, "Cpus_allowed_list:");
    assert_eq!(cpu_list(&main), union);
    let mut lanes_seen = 0;
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
        let task = task.unwrap().path();
        let comm = std::fs::read_to_string(task.join("comm")).unwrap();
        if let Some(i) = comm.trim().strip_prefix("rfaas-serve-") {
            let i: usize = i.parse().unwrap();
            let list = status_field(task.join("status").to_str().unwrap(), "Cpus_allowed_list:");
            assert_eq!(cpu_list(&list), BTreeSet::from([lane_cpus[i]]), "lane {i}");
            lanes_seen += 1;
        }
    }
    assert_eq!(lanes_seen, 2);

    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max address space"))
        .unwrap();
    let limit = (8u64 << 30).to_string();
    assert_eq!(
        line.split_whitespace().filter(|w| *w == limit).count(),
        2,
        "{line}"
    );
}

fn failure(worker: &mut Worker, a: &Assignment, library: &[u8]) -> ErrorReply {
    let frame = worker.assign(a, library);
    let WorkerFailed(reply) = frame.parse().unwrap();
    let status = worker.wait();
    assert_eq!(
        status.code(),
        Some(rfaas_executor::worker::EXIT_SETUP_FAILED)
    );
    reply
}

#[rstest]
#[case::tcp("tcp")]
#[case::shm("shm")]
fn malformed_library_fails_the_assignment(#[case] provider: &str) {
    let dir = TempDir::new();
    let mut worker = Worker::spawn();
    let a = assignment(provider, &dir);
    let junk = pattern(10_000, 42);
    let reply = failure(&mut worker, &a, &junk);
    assert_eq!(reply.code, ErrorCode::MalformedLibrary);
    assert!(
        reply.message.contains("/proc/self/fd/"),
        "{}",
        reply.message
    );
    assert_eq!(reply.request_id, a.allocation_id);
}

/// Under an address-space limit too small for the library or the lanes'
/// buffers, the worker says memory_too_small, never malformed_library or a
/// retryable internal error. (The daemon refuses such allocations before
/// they reach a worker; this is the worker's own word.)
#[rstest]
#[case::library_tcp("tcp", 4, 64 << 10, "map the function library")]
#[case::library_shm("shm", 4, 64 << 10, "map the function library")]
#[case::buffers_tcp("tcp", 16, 16 << 20, "input buffer")]
#[case::buffers_shm("shm", 16, 16 << 20, "input buffer")]
fn too_little_address_space_fails_the_assignment_memory_too_small(
    #[case] provider: &str,
    #[case] mib: u32,
    #[case] input_capacity: u32,
    #[case] what: &str,
) {
    let dir = TempDir::new();
    let mut worker = Worker::spawn();
    let mut a = assignment(provider, &dir);
    a.input_capacity = input_capacity;
    a.memory_limit_bytes = u64::from(mib) << 20;
    a.memory_mib = mib;
    let reply = failure(
        &mut worker,
        &a,
        &rfaas_testkit::functions::c_library_bytes(),
    );
    assert_eq!(reply.code, ErrorCode::MemoryTooSmall, "{}", reply.message);
    assert!(reply.message.contains(what), "{}", reply.message);
    assert!(
        reply
            .message
            .contains(&format!("within the allocation's {mib} MiB")),
        "{}",
        reply.message
    );
}

#[rstest]
#[case::tcp("tcp")]
#[case::shm("shm")]
fn missing_function_fails_the_assignment(#[case] provider: &str) {
    let dir = TempDir::new();
    let mut worker = Worker::spawn();
    let mut a = assignment(provider, &dir);
    a.functions = vec!["echo".into(), "no_such_function".into()];
    let reply = failure(
        &mut worker,
        &a,
        &rfaas_testkit::functions::c_library_bytes(),
    );
    assert_eq!(reply.code, ErrorCode::UnknownFunction);
    assert!(
        reply.message.contains("\"no_such_function\""),
        "{}",
        reply.message
    );
}

#[test]
fn an_unusable_lane_key_fails_the_assignment() {
    let dir = TempDir::new();
    let mut worker = Worker::spawn();
    let mut a = assignment("tcp", &dir);
    a.lane_key = "not hex".into();
    let reply = failure(
        &mut worker,
        &a,
        &rfaas_testkit::functions::c_library_bytes(),
    );
    assert_eq!(reply.code, ErrorCode::MalformedRequest);
    assert!(reply.message.contains("lane key"), "{}", reply.message);
}

#[test]
fn root_is_refused() {
    let dir = TempDir::new();
    let mut worker = Worker::spawn();
    let mut a = assignment("tcp", &dir);
    a.uid = 0;
    a.gid = 0;
    let reply = failure(
        &mut worker,
        &a,
        &rfaas_testkit::functions::c_library_bytes(),
    );
    assert_eq!(reply.code, ErrorCode::UserRefused);
    assert!(reply.message.contains("root"), "{}", reply.message);
}

#[rstest]
#[case::tcp("tcp")]
#[case::shm("shm")]
fn expired_lease_refuses_invocations(#[case] provider: &str) {
    let dir = TempDir::new();
    let worker = Worker::spawn();
    let mut a = assignment(provider, &dir);
    a.expires_at = unix_now() - 10;
    let ready = worker.ready(&a);
    let mut client = connect(provider, &ready, 64 << 10, 64 << 10);
    let (status, out) = client.lanes[0].invoke(ECHO, b"late");
    assert_eq!(status, InvocationStatus::LeaseExpired);
    assert!(out.is_empty());
}

#[rstest]
#[case::tcp_hot("tcp", Mode::Hot)]
#[case::tcp_warm("tcp", Mode::Warm)]
#[case::shm_hot("shm", Mode::Hot)]
#[case::shm_warm("shm", Mode::Warm)]
fn sigusr1_drains(#[case] provider: &str, #[case] mode: Mode) {
    let dir = TempDir::new();
    let worker = Worker::spawn();
    let mut a = assignment(provider, &dir);
    a.mode = mode;
    let ready = worker.ready(&a);
    let mut client = connect(provider, &ready, 64 << 10, 64 << 10);
    let (status, _) = client.lanes[0].invoke(ECHO, b"before");
    assert_eq!(status, InvocationStatus::Ok);
    worker.signal(libc::SIGUSR1);
    // The signal lands asynchronously; requests turn to draining once it has.
    wait_until("SIGUSR1 to turn requests to draining", TIMEOUT, || {
        let (status, _) = client.lanes[1].invoke(ECHO, b"after");
        if status != InvocationStatus::ExecutorDraining {
            assert_eq!(status, InvocationStatus::Ok);
        }
        status == InvocationStatus::ExecutorDraining
    });
    let (status, _) = client.lanes[0].invoke(ECHO, b"again");
    assert_eq!(status, InvocationStatus::ExecutorDraining);
}

//! `rfaas-executord` under connections that misbehave without a valid
//! token: what they cost the daemon stays bounded, and a good client is
//! served all along. (How fast it is served is measured by
//! `rfaas-control-bench`, not here: no timed tests.)

use std::io::{Read, Write};
use std::net::{Ipv4Addr, TcpStream};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use rfaas_proto::control::local::LocalReply;
use rfaas_proto::control::{ErrorCode, ErrorReply, Frame, FrameLimits};

use rfaas_testkit::abuse::{self, Attack, Plan, Usage};
use rfaas_testkit::executord::{request, Executord, ExecutordOptions};
use rfaas_testkit::functions::c_library_bytes;
use rfaas_testkit::wait::wait_until;

const DAEMON: &str = env!("CARGO_BIN_EXE_rfaas-executord");
const MINUTE: Duration = Duration::from_secs(60);

/// The caps this test runs with (below the defaults, so a few hundred
/// connections reach them).
const MAX_CONNECTIONS: usize = 256;
const PER_ADDRESS: usize = 64;

fn allocate_and_deallocate(d: &Executord, library: &[u8]) {
    if let Err(e) = d.allocate_and_deallocate(library) {
        panic!("the good client was not served: {e}\n{}", d.log());
    }
}

#[test]
fn misbehaving_connections_cost_the_daemon_a_bounded_amount() {
    // Ours (500 attackers, the good client) and the daemon's own.
    abuse::raise_descriptor_limit(4096);
    let d = Executord::start(
        Path::new(DAEMON),
        ExecutordOptions {
            extra_config: format!(
                "max_connections = {MAX_CONNECTIONS}\n\
                 max_connections_per_address = {PER_ADDRESS}\n\
                 request_timeout_ms = 3000\n"
            ),
            ..ExecutordOptions::default()
        },
    );
    let library = c_library_bytes();
    // Warm: the pool, the allocator's arenas, the first worker.
    for _ in 0..3 {
        allocate_and_deallocate(&d, &library);
    }
    let quiet = Usage::of(d.pid());
    let log_before = d.log().lines().count();

    // 4 addresses × (100 idle + 20 slow + 5 stalled 64 MiB libraries): past
    // both caps, and 1.28 GB of libraries a daemon that held them would
    // hold.
    let plan = Plan {
        from: (2..=5).map(|i| Ipv4Addr::new(127, 0, 0, i)).collect(),
        idle: 100,
        slow: 20,
        stalled: 5,
    };
    let attack = Attack::start(d.control_addr(), &plan);
    let attacked = Usage::of(d.pid());
    let log_attacked = d.log().lines().count();

    // The good client, on 127.0.0.1, is served while they are connected.
    for _ in 0..10 {
        allocate_and_deallocate(&d, &library);
    }
    let serving = Usage::of(d.pid());
    eprintln!(
        "quiet {quiet:?}\nattacked {attacked:?}\nserving {serving:?}\n{} connections open, {} refused or closed",
        attack.open(),
        attack.failed
    );

    for u in [attacked, serving] {
        // One descriptor per connection it keeps, and a few for workers.
        assert!(
            u.fds <= quiet.fds + MAX_CONNECTIONS + 16,
            "{} descriptors under attack, {} quiet (max_connections = {MAX_CONNECTIONS})",
            u.fds,
            quiet.fds
        );
        // Refused libraries are dropped as they arrive; what is left is
        // buffers and the connections' bookkeeping.
        assert!(
            u.rss_kib <= quiet.rss_kib + (48 << 10),
            "{} KiB resident under attack, {} KiB quiet",
            u.rss_kib,
            quiet.rss_kib
        );
        // No thread per connection.
        assert!(
            u.threads <= quiet.threads + 4,
            "{} threads under attack, {} quiet",
            u.threads,
            quiet.threads
        );
    }
    // Not a line per connection: refusals are summed up, at most every 10 s.
    assert!(
        log_attacked - log_before < 20,
        "{} log lines for {} connections:\n{}",
        log_attacked - log_before,
        attack.open(),
        d.log()
    );
    // A connection that never sends a request is closed (request_timeout_ms).
    let idle = attack.idle.last().expect("some idle connection was kept");
    assert!(
        abuse::closed_by_peer(idle, MINUTE),
        "an idle connection stayed open"
    );
    drop(attack);
}

/// A request with a valid token that announces `library_len` bytes of
/// library: its frame without the library.
fn checked_request(d: &Executord, library_len: u32) -> Vec<u8> {
    let req = request(d.token("nobody", 1, 1024, MINUTE), 1, &["echo"]);
    abuse::request_without_library(&req, library_len)
}

/// Sends `n` zero bytes.
fn send_zeros(s: &mut TcpStream, mut n: usize) -> std::io::Result<()> {
    let chunk = vec![0u8; 1 << 20];
    while n > 0 {
        let k = n.min(chunk.len());
        s.write_all(&chunk[..k])?;
        n -= k;
    }
    Ok(())
}

/// Whether the daemon has read everything sent on `s` (its socket's
/// receive queue, as /proc/net/tcp shows it, is empty) or answered it (a
/// refusal waiting to be read).
fn settled(s: &TcpStream) -> bool {
    let mut peek = [0u8; 1];
    s.set_nonblocking(true).unwrap();
    let answered = s.peek(&mut peek).is_ok();
    s.set_nonblocking(false).unwrap();
    if answered {
        return true;
    }
    let (ours, theirs) = (
        s.local_addr().unwrap().port(),
        s.peer_addr().unwrap().port(),
    );
    let table = std::fs::read_to_string("/proc/net/tcp").unwrap();
    // Columns: sl local_address rem_address st tx_queue:rx_queue ...
    table.lines().skip(1).any(|line| {
        let f: Vec<&str> = line.split_whitespace().collect();
        let port = |a: &str| {
            a.rsplit(':')
                .next()
                .and_then(|p| u16::from_str_radix(p, 16).ok())
        };
        let rx = f[4]
            .split(':')
            .nth(1)
            .and_then(|q| u64::from_str_radix(q, 16).ok());
        port(f[1]) == Some(theirs) && port(f[2]) == Some(ours) && rx == Some(0)
    })
}

fn read_refusal(s: &mut TcpStream) -> ErrorReply {
    s.set_read_timeout(Some(MINUTE)).unwrap();
    let f = Frame::read_from(s, FrameLimits::default()).expect("an answer");
    f.parse().unwrap_or_else(|e| {
        panic!(
            "expected a refusal: {e}: {:?}",
            String::from_utf8_lossy(&f.json)
        )
    })
}

#[test]
fn checked_libraries_wait_for_room_in_library_memory() {
    let d = Executord::start(
        Path::new(DAEMON),
        ExecutordOptions {
            extra_config: "max_library_mib = 64\nlibrary_memory_mib = 64\n".into(),
            ..ExecutordOptions::default()
        },
    );
    d.allocate_and_deallocate(&c_library_bytes()).unwrap();
    let quiet = Usage::of(d.pid());
    const LIB: u32 = 64 << 20;

    // The first takes the whole budget, all but the last byte.
    let mut first = TcpStream::connect(d.control_addr()).unwrap();
    first.write_all(&checked_request(&d, LIB)).unwrap();
    send_zeros(&mut first, LIB as usize - 1).unwrap();
    // Two more wait for room, sending what their sockets take.
    let senders: Vec<_> = (0..2)
        .map(|_| {
            let mut s = TcpStream::connect(d.control_addr()).unwrap();
            s.write_all(&checked_request(&d, LIB)).unwrap();
            let mut w = s.try_clone().unwrap();
            (
                s,
                std::thread::spawn(move || send_zeros(&mut w, LIB as usize)),
            )
        })
        .collect();
    let held = Usage::of(d.pid());
    assert!(
        held.rss_kib >= quiet.rss_kib + (32 << 10),
        "the first library is held: {held:?}, quiet {quiet:?}"
    );
    assert!(
        held.rss_kib <= quiet.rss_kib + (64 << 10) + (24 << 10),
        "one library is held, not three: {held:?}, quiet {quiet:?}"
    );

    // Its last byte: refused (zeros are no ELF), and the room goes to the
    // next, which then gets its own answer.
    first.write_all(&[0]).unwrap();
    assert_eq!(read_refusal(&mut first).code, ErrorCode::MalformedLibrary);
    for (mut s, h) in senders {
        h.join()
            .unwrap()
            .expect("the library is read once there is room");
        assert_eq!(read_refusal(&mut s).code, ErrorCode::MalformedLibrary);
    }
}

#[test]
fn local_connections_are_capped_and_timed_out() {
    let d = Executord::start(
        Path::new(DAEMON),
        ExecutordOptions {
            extra_config: "request_timeout_ms = 1000\n".into(),
            ..ExecutordOptions::default()
        },
    );
    let idle: Vec<UnixStream> = (0..16)
        .map(|_| UnixStream::connect(d.local_socket()).unwrap())
        .collect();
    // Over the cap: closed at once.
    let extra = UnixStream::connect(d.local_socket()).unwrap();
    extra.set_read_timeout(Some(MINUTE)).unwrap();
    assert_eq!((&extra).read(&mut [0u8; 1]).unwrap(), 0);
    // Those that send nothing are closed after request_timeout_ms...
    for s in &idle {
        s.set_read_timeout(Some(MINUTE)).unwrap();
        assert_eq!((&*s).read(&mut [0u8; 1]).unwrap(), 0);
    }
    // ...and the node tools are served again.
    assert!(matches!(d.status(), LocalReply::Status { .. }));
}

#[test]
fn a_client_that_does_not_read_its_answers_is_dropped() {
    let d = Executord::start(Path::new(DAEMON), ExecutordOptions::default());
    let mut s = TcpStream::connect(d.control_addr()).unwrap();
    // Requests refused at once, never read: the answers pile up at the
    // daemon until it gives the connection up.
    let request = abuse::bogus_request(0);
    let burst: Vec<u8> = request
        .iter()
        .copied()
        .cycle()
        .take(request.len() * 1000)
        .collect();
    let mut sent = 0usize;
    let closed = loop {
        if s.write_all(&burst).is_err() {
            break true;
        }
        sent += burst.len();
        assert!(
            sent < (1 << 30),
            "1 GiB of requests and the daemon still reads"
        );
    };
    assert!(closed);
    let u = Usage::of(d.pid());
    assert!(u.rss_kib < 64 << 10, "{u:?}");
    d.allocate_and_deallocate(&c_library_bytes())
        .expect("the daemon serves the next client");
}

#[test]
fn large_unchecked_json_is_bounded_in_all() {
    let d = Executord::start(Path::new(DAEMON), ExecutordOptions::default());
    d.allocate_and_deallocate(&c_library_bytes()).unwrap();
    let quiet = Usage::of(d.pid());
    // 100 requests each announcing 1 MiB of JSON and sending all but its
    // last byte: 100 MiB, if the daemon held it.
    const JSON: usize = 1 << 20;
    let header = rfaas_proto::control::FrameHeader {
        kind: rfaas_proto::control::Kind::AllocateRequest,
        json_len: JSON as u32,
        blob_len: 0,
    }
    .encode();
    let mut open = Vec::new();
    for _ in 0..100 {
        let mut s = TcpStream::connect(d.control_addr()).unwrap();
        s.set_write_timeout(Some(MINUTE)).unwrap();
        s.write_all(&header).unwrap();
        // Past the shared allowance the daemon refuses and closes (so this
        // may fail).
        let _ = send_zeros(&mut s, JSON - 1);
        open.push(s);
    }
    // The daemon reads at its own pace: wait until it has read every byte
    // sent (or refused the connection), so the count below does not depend
    // on how busy the machine is.
    wait_until("the daemon to read every byte sent", MINUTE, || {
        open.iter().all(settled)
    });
    let held = Usage::of(d.pid());
    assert!(
        held.rss_kib <= quiet.rss_kib + (48 << 10),
        "{held:?}, quiet {quiet:?}"
    );
    // Each was either held (its last byte makes JSON of zeros: malformed)
    // or refused no_capacity for lack of room.
    let mut refused = 0;
    for mut s in open {
        let _ = s.write_all(&[0]);
        match read_refusal(&mut s).code {
            ErrorCode::NoCapacity => refused += 1,
            ErrorCode::MalformedRequest => {}
            other => panic!("{other:?}"),
        }
    }
    assert!((60..100).contains(&refused), "{refused} of 100 refused");
    // The allowance comes back with the connections: a large request is
    // read, and refused for its token.
    let mut req = request("rfaas2.not.a.token".into(), 1, &["echo"]);
    req.library_name = "x".repeat(JSON / 2);
    let mut s = TcpStream::connect(d.control_addr()).unwrap();
    Frame::new(&req, Vec::new()).write_to(&mut s).unwrap();
    assert_eq!(read_refusal(&mut s).code, ErrorCode::TokenMalformed);
}

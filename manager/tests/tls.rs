//! The REST port over HTTPS, and what it does to connections that are
//! slow, idle or too many: HTTPS works with the site CA and fails clearly
//! without it, a certificate for another name is refused, SIGHUP serves a
//! renewed certificate, idle and slow connections are closed after the
//! timeouts, the per-source cap refuses the connection over it at once,
//! and at the replica's cap the connection idle longest makes room, so
//! strangers holding every place do not keep a good client out.

use std::io::{Read as _, Write as _};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use rfaas_testkit::abuse::{closed_by_peer, connect_from};
use rfaas_testkit::manager::{Api, Manager, ManagerOptions};
use rfaas_testkit::tls::{test_ca, TestCa};
use rfaas_testkit::wait::wait_until;
use rfaas_testkit::TempDir;

/// Generous bound on anything the manager should do promptly.
const SOON: Duration = Duration::from_secs(30);

fn addr(m: &Manager) -> SocketAddr {
    let (_, a) = m.url().split_once("://").expect("a URL");
    a.parse().expect("an address")
}

fn manager(extra: &str, tls: bool, cert: Option<TestCa>) -> Manager {
    let defaults = ManagerOptions::default();
    Manager::start(ManagerOptions {
        extra_config: format!("{}{extra}", defaults.extra_config),
        tls,
        cert,
        ..defaults
    })
}

/// `rfaasctl nodes` against `m` with the CA file `ca` (`None`: neither
/// --ca-file nor RFAAS_CA_FILE).
fn rfaasctl_nodes(m: &Manager, dir: &Path, ca: Option<&Path>) -> std::process::Output {
    let token = dir.join("admin.token");
    std::fs::write(&token, m.admin_token()).unwrap();
    std::fs::set_permissions(&token, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_rfaasctl"));
    cmd.env_remove("RFAAS_CA_FILE")
        .env_remove("RFAAS_MANAGERS")
        .args(["--manager", m.url(), "--token-file"])
        .arg(&token);
    if let Some(ca) = ca {
        cmd.arg("--ca-file").arg(ca);
    }
    cmd.arg("nodes").output().expect("rfaasctl runs")
}

#[test]
fn https_works_with_the_site_ca_and_fails_clearly_without_it() {
    let m = manager("", true, None);
    assert!(m.url().starts_with("https://127.0.0.1:"), "{}", m.url());
    let ca = test_ca().ca_file();
    let api = Api::trusting(m.url(), m.admin_token(), Some(&ca)).unwrap();
    let (status, body) = api.call("GET", "/v1/nodes", None);
    assert_eq!(status, 200, "{body}");

    // Another CA (the system's roots would do the same): refused, and the
    // error says it is the certificate.
    let dir = TempDir::new("tls-other-ca");
    let other = TestCa::make(&dir.path().join("ca"), &[]).unwrap();
    let api = Api::trusting(m.url(), m.admin_token(), Some(&other.ca_file())).unwrap();
    let (status, body) = api.call("GET", "/v1/nodes", None);
    assert_eq!(status, 0, "answered over an untrusted certificate: {body}");
    assert!(body.to_string().contains("certificate"), "{body}");

    // rfaasctl: with --ca-file it works; without, it says why not.
    let o = rfaasctl_nodes(&m, dir.path(), Some(&ca));
    assert!(o.status.success(), "{}", rfaas_testkit::output_text(&o));
    let o = rfaasctl_nodes(&m, dir.path(), None);
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains(m.url()) && err.contains("certificate"),
        "{err}"
    );

    // Plain HTTP to the HTTPS port gets no answer.
    let plain = Api::new(&m.url().replacen("https://", "http://", 1), m.admin_token());
    let (status, _) = plain.call("GET", "/v1/nodes", None);
    assert_ne!(status, 200);
}

#[test]
fn a_certificate_for_another_name_is_refused() {
    let dir = TempDir::new("tls-wrong-name");
    let ca = TestCa::make(&dir.path().join("ca"), &["manager.invalid", "10.9.8.7"]).unwrap();
    let m = manager("", true, Some(ca.clone()));
    let api = Api::trusting(m.url(), m.admin_token(), Some(&ca.ca_file())).unwrap();
    let (status, body) = api.call("GET", "/v1/nodes", None);
    assert_eq!(
        status, 0,
        "answered with a certificate for another name: {body}"
    );
    let text = body.to_string();
    assert!(
        text.contains("certificate") && text.contains("127.0.0.1"),
        "{text}"
    );
}

#[test]
fn sighup_serves_a_renewed_certificate_without_closing_the_listener() {
    let dir = TempDir::new("tls-reload");
    let old = TestCa::make(&dir.path().join("old"), &[]).unwrap();
    let new = TestCa::make(&dir.path().join("new"), &[]).unwrap();
    // The manager's files: the old CA's, then overwritten by the new's.
    let live = TestCa::make(&dir.path().join("live"), &[]).unwrap();
    let install = |from: &TestCa| {
        std::fs::copy(from.cert(), live.cert()).unwrap();
        std::fs::copy(from.key(), live.key()).unwrap();
    };
    install(&old);
    let m = manager("", true, Some(live.clone()));
    let trusting = |ca: &TestCa| {
        // A fresh agent each time: a new connection, a new handshake.
        let api = Api::trusting(m.url(), m.admin_token(), Some(&ca.ca_file())).unwrap();
        api.call("GET", "/v1/nodes", None).0
    };
    assert_eq!(trusting(&old), 200);
    assert_eq!(trusting(&new), 0);

    install(&new);
    let pid = m.pid().expect("running");
    // SAFETY: kill(2) on the manager this test started.
    assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGHUP) }, 0);
    wait_until("the renewed certificate is served", SOON, || {
        trusting(&new) == 200
    });
    assert_eq!(trusting(&old), 0, "the old certificate is still served");
    assert!(m.pid().is_some());

    // A broken file on SIGHUP: the manager keeps its certificate, and says
    // why in its log.
    std::fs::write(live.key(), "not a key\n").unwrap();
    // SAFETY: as above.
    assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGHUP) }, 0);
    wait_until("the failed reload is logged", SOON, || {
        m.log().contains("certificate not reloaded")
    });
    assert_eq!(trusting(&new), 200);
}

#[test]
fn idle_and_slow_connections_are_closed_after_the_timeouts() {
    let limits =
        "[http]\nhandshake_timeout_ms = 1000\nheader_timeout_ms = 1000\nbody_timeout_ms = 1000\n";
    // HTTPS: a connection that never says hello.
    let m = manager(limits, true, None);
    let idle = TcpStream::connect(addr(&m)).unwrap();
    assert!(
        closed_by_peer(&idle, SOON),
        "an idle TLS connection stayed open"
    );

    // Plain HTTP on loopback (the same accept loop, readable by hand).
    let m = manager(limits, false, None);
    // Idle after a request: kept alive, then closed.
    let mut kept = TcpStream::connect(addr(&m)).unwrap();
    kept.write_all(b"GET /healthz HTTP/1.1\r\nHost: m\r\n\r\n")
        .unwrap();
    let mut head = [0u8; 12];
    kept.read_exact(&mut head).unwrap();
    assert!(head.starts_with(b"HTTP/1.1 "), "{head:?}");
    assert!(
        closed_by_peer(&kept, SOON),
        "an idle keep-alive connection stayed open"
    );

    // Slowloris: headers a byte a second, never ending; the header
    // timeout closes it while it still sends.
    let mut slow = TcpStream::connect(addr(&m)).unwrap();
    slow.set_read_timeout(Some(Duration::from_millis(1000)))
        .unwrap();
    let request = b"GET /v1/nodes HTTP/1.1\r\nHost: m\r\nX-Slow: ".repeat(1000);
    let mut closed = false;
    for byte in request.iter().take(SOON.as_secs() as usize) {
        if slow.write_all(&[*byte]).is_err() {
            closed = true;
            break;
        }
        // Paces the bytes (the attack itself), and sees the close.
        let mut buf = [0u8; 256];
        match slow.read(&mut buf) {
            Ok(0) => {
                closed = true;
                break;
            }
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {
                closed = true;
                break;
            }
            Err(_) => {}
        }
    }
    assert!(closed, "a slowloris connection stayed open");

    // A body that stops arriving (from a caller the manager knows, so it
    // is read): refused, the connection closed.
    let mut stalled = TcpStream::connect(addr(&m)).unwrap();
    let head = format!(
        "POST /v1/credentials HTTP/1.1\r\nHost: m\r\nAuthorization: Bearer {}\r\n\
         Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{{\"rol",
        m.admin_token()
    );
    stalled.write_all(head.as_bytes()).unwrap();
    assert!(
        closed_by_peer(&stalled, SOON),
        "a stalled body kept its connection"
    );
}

#[test]
fn the_caps_refuse_or_make_room_and_count_it() {
    let m = manager(
        "[http]\nmax_connections = 5\nmax_connections_per_source = 3\nhandshake_timeout_ms = 600000\n",
        true,
        None,
    );
    let to = addr(&m);
    let from = |last: u8| Ipv4Addr::new(127, 0, 0, last);
    let held: Vec<TcpStream> = (0..3).map(|_| connect_from(from(3), to).unwrap()).collect();
    // The fourth from the same source: closed at once.
    let fourth = connect_from(from(3), to).unwrap();
    assert!(
        closed_by_peer(&fourth, SOON),
        "the (cap+1)th connection from one source was kept"
    );
    for s in &held {
        assert!(
            !closed_by_peer(s, Duration::from_millis(200)),
            "a connection under the cap was closed"
        );
    }
    // Other sources fill the replica's cap; one over it gets in, and the
    // connection idle longest (the first from source 3) is closed for it.
    let others: Vec<TcpStream> = (0..2).map(|_| connect_from(from(4), to).unwrap()).collect();
    let over = connect_from(from(5), to).unwrap();
    assert!(
        closed_by_peer(&held[0], SOON),
        "the connection idle longest was kept at the replica's cap"
    );
    assert!(
        !closed_by_peer(&over, Duration::from_millis(200)),
        "the newcomer was closed although an idle connection could make room"
    );
    drop(others);

    let ca = test_ca().ca_file();
    let api = Api::trusting(m.url(), m.admin_token(), Some(&ca)).unwrap();
    let (_, metrics) = api.call("GET", "/metrics", None);
    let metrics = metrics.as_str().unwrap_or_default().to_owned();
    for cap in ["source", "replica"] {
        let line = format!("rfaas_manager_connections_refused_total{{cap=\"{cap}\"}} ");
        let n: u64 = metrics
            .lines()
            .find_map(|l| l.strip_prefix(line.as_str()))
            .and_then(|n| n.trim().parse().ok())
            .unwrap_or(0);
        assert!(n >= 1, "{cap}: {metrics}");
    }
    drop(held);
}

/// Strangers from many sources, each under the per-source cap, hold every
/// place of the replica (idle, never starting their TLS handshake): a good
/// client still gets in at its first try, each time, and the strangers'
/// connections are the ones closed.
#[test]
fn strangers_holding_the_replica_cap_do_not_keep_a_good_client_out() {
    let m = manager(
        "[http]\nmax_connections = 8\nmax_connections_per_source = 2\nhandshake_timeout_ms = 600000\nheader_timeout_ms = 600000\n",
        true,
        None,
    );
    let to = addr(&m);
    let strangers: Vec<TcpStream> = (0..8)
        .map(|k| connect_from(Ipv4Addr::new(127, 0, 0, 10 + k / 2), to).unwrap())
        .collect();
    let ca = test_ca().ca_file();
    let api = Api::trusting(m.url(), m.admin_token(), Some(&ca)).unwrap();
    for attempt in 0..3 {
        // A new connection each time, as a client whose keep-alive
        // connection was closed would open.
        let (status, body) = api.fresh().call("GET", "/v1/nodes", None);
        assert_eq!(status, 200, "attempt {attempt} at the full cap: {body}");
    }
    let closed = strangers
        .iter()
        .filter(|s| closed_by_peer(s, Duration::from_millis(200)))
        .count();
    assert!(closed >= 1, "no stranger made room for the good client");
}

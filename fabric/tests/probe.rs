//! `rfaas-fabric-probe` as a user runs it: `serve` announces itself in one
//! labelled line, a client takes its fields, and clients that finish and
//! leave are not logged as failed connections.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use rstest::rstest;

const PROBE: &str = env!("CARGO_BIN_EXE_rfaas-fabric-probe");

/// `serve --echo`, stopped by its pid when dropped.
struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn run(provider: &str, args: &[&str]) -> String {
    let out = Command::new(PROBE)
        .args(["--provider", provider])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("start rfaas-fabric-probe");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "rfaas-fabric-probe {args:?} failed ({}): {stdout}{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

#[rstest]
#[case::tcp("tcp", "127.0.0.1:0")]
#[case::shm("shm", "")]
fn clients_take_the_ready_line_and_leave_without_a_warning(
    #[case] provider: &str,
    #[case] listen: &str,
) {
    let mut server = Server(
        Command::new(PROBE)
            .args([
                "--provider",
                provider,
                "serve",
                "--echo",
                "--listen",
                listen,
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start rfaas-fabric-probe serve"),
    );
    let stdout = server.0.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        let _ = BufReader::new(stdout).read_line(&mut line);
        let _ = tx.send(line);
    });
    let line = rx
        .recv_timeout(Duration::from_secs(20))
        .expect("serve printed no ready line");
    let fields: HashMap<&str, &str> = line
        .strip_prefix("rfaas-fabric-probe ready ")
        .unwrap_or_else(|| panic!("serve's ready line is {line:?}"))
        .split_whitespace()
        .filter_map(|f| f.split_once('='))
        .collect();
    assert_eq!(fields.get("provider"), Some(&provider), "{line:?}");
    for key in ["listen", "addr", "rkey", "len"] {
        assert!(fields.contains_key(key), "no {key}= in {line:?}");
    }
    let target = [
        "--connect",
        fields["listen"],
        "--addr",
        fields["addr"],
        "--rkey",
        fields["rkey"],
    ];

    let pingpong = run(
        provider,
        &[&["pingpong"][..], &target, &["--iters", "200"]].concat(),
    );
    assert!(pingpong.contains("pingpong 64 B x 200"), "{pingpong}");
    // The echo server takes one client at a time, so once `check` is
    // served, the pingpong client's goodbye has been handled and logged.
    let check = run(
        provider,
        &[&["check"][..], &target, &["--len", fields["len"]]].concat(),
    );
    assert!(check.contains("compare-and-swap: ok"), "{check}");

    let _ = server.0.kill();
    let _ = server.0.wait();
    let mut log = String::new();
    server
        .0
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut log)
        .unwrap();
    assert!(
        !log.contains("WARN") && !log.contains("ERROR"),
        "a client that finished and left was logged as a failure:\n{log}"
    );
}

/// The shm provider refuses a peer of another user, even one that can
/// reach the socket: a probe run as `nobody` (uid 65534) against a socket
/// anyone may connect to is refused at accept with its uid named, and its
/// fetch-and-add fails. Needs root, to run the peer as another user (CI
/// runs as root); fails, not skips, without it.
#[test]
fn shm_refuses_a_peer_of_another_uid() {
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::process::CommandExt;
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    assert_eq!(euid, 0, "this test runs a peer as nobody, which needs root");
    let dir = std::env::temp_dir().join(format!("rfaas-uid-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
    let sock = dir.join("sock");
    let fabric = rfaas_fabric::Fabric::open("shm").unwrap();
    let domain = fabric.domain().unwrap();
    let mut cq = fabric.completion_queue(16).unwrap();
    let listener = fabric.listen(sock.to_str().unwrap()).unwrap();
    std::fs::set_permissions(&sock, std::fs::Permissions::from_mode(0o777)).unwrap();

    let peer = Command::new(PROBE)
        .args(["--provider", "shm", "faa", "--connect"])
        .arg(&sock)
        .args(["--addr", "4096", "--rkey", "1025", "--count", "1"])
        .uid(65534)
        .gid(65534)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start rfaas-fabric-probe as nobody");
    let accepted = listener.accept(
        &domain,
        &mut cq,
        &rfaas_fabric::EndpointOptions::default(),
        Some(Duration::from_secs(30)),
    );
    let out = peer.wait_with_output().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    match accepted {
        Err(rfaas_fabric::Error::Connect { reason, .. }) => {
            assert!(reason.contains("uid 65534"), "{reason}")
        }
        other => panic!("a peer running as nobody was not refused: {other:?}"),
    }
    assert!(
        !out.status.success(),
        "the refused peer's add succeeded: {}",
        String::from_utf8_lossy(&out.stdout)
    );
}

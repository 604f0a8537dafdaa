//! TLS on the control port (`control_tls_cert`, `control_tls_key`,
//! `require_control_tls`): a real daemon with the test CA's certificate,
//! reached by the real client library, a plain client, a client that
//! trusts another CA, a peer that never finishes its handshake, and a
//! certificate replaced under SIGHUP.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use rfaas_client::{Allocation, AllocationSpec, Client, ClientOptions, Error};
use rfaas_testkit::executord::{copy_private, sample, scrape, Executord, ExecutordOptions};
use rfaas_testkit::functions::c_library_bytes;
use rfaas_testkit::tls::{test_ca, TestCa};
use rfaas_testkit::wait::{poll_for, wait_for};
use rfaas_testkit::{free_port, TempDir};

const DAEMON: &str = env!("CARGO_BIN_EXE_rfaas-executord");

/// A daemon whose control port speaks TLS (`required`: only TLS), with its
/// metrics on the returned address and `more` configuration.
fn daemon(required: bool, more: &str) -> (Executord, SocketAddr) {
    let metrics = free_port();
    let d = Executord::start(
        std::path::Path::new(DAEMON),
        ExecutordOptions {
            control_tls: Some(required),
            extra_config: format!("metrics_listen = \"{metrics}\"\n{more}"),
            ..ExecutordOptions::default()
        },
    );
    (d, metrics)
}

/// One core of `echo` on the executor at `executor` (as the client library
/// takes it).
fn allocate(d: &Executord, executor: &str) -> Result<Allocation, Error> {
    allocate_with(
        &Client::new(ClientOptions::with_provider("tcp")),
        d,
        executor,
    )
}

/// As [`allocate`], with `client` (and its control connections).
fn allocate_with(client: &Client, d: &Executord, executor: &str) -> Result<Allocation, Error> {
    let spec = AllocationSpec::new(c_library_bytes(), &["echo"]).memory_mib(256);
    client.allocate(
        executor,
        &d.token("nobody", 1, 1024, Duration::from_secs(600)),
        &spec,
    )
}

/// Calls `echo` once on `a` and checks the answer.
fn echo(a: &Allocation, value: u32) {
    let f = a.function("echo").unwrap();
    let mut input = a.buffer::<u32>(1).unwrap();
    input.write_from(0, &[value]);
    let mut output = a.buffer::<u32>(1).unwrap();
    assert_eq!(a.invoke(f, &input, 1, &mut output).unwrap(), 4);
    assert_eq!(output.to_vec(), [value]);
}

/// Allocates over TLS, invokes, deallocates; panics with the log if not.
fn served(d: &Executord) {
    let a = allocate(d, &d.executor())
        .unwrap_or_else(|e| panic!("a TLS client is not served: {e}\nlog:\n{}", d.log()));
    echo(&a, 7);
    a.deallocate().unwrap();
}

/// `rfaas_executord_control_tls_refused_total{reason}` now.
fn refused(metrics: SocketAddr, reason: &str) -> f64 {
    let series = format!("rfaas_executord_control_tls_refused_total{{reason=\"{reason}\"}}");
    sample(&scrape(metrics), &series).unwrap_or(0.0)
}

fn trust(ca_file: &std::path::Path) {
    std::env::set_var(rfaas_tls::CA_FILE_ENV, ca_file);
}

#[test]
fn allocations_and_invocations_go_over_tls_when_it_is_required() {
    let (d, _) = daemon(true, "");
    assert!(d.executor().starts_with("tls://"), "{}", d.executor());
    let client = Client::new(ClientOptions::with_provider("tcp"));
    let a =
        allocate_with(&client, &d, &d.executor()).unwrap_or_else(|e| panic!("{e}\n{}", d.log()));
    for v in 0..100 {
        echo(&a, v);
    }
    // A second allocation shares the client's control connection: its
    // request and reply go through the same session.
    let b = allocate_with(&client, &d, &d.executor()).unwrap();
    echo(&b, 5);
    b.deallocate().unwrap();
    a.deallocate().unwrap();
}

#[test]
fn a_plain_client_is_refused_with_a_clear_error_and_others_are_served() {
    let (d, metrics) = daemon(true, "");
    let err = allocate(&d, &d.control_addr().to_string()).unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("over TLS only") && text.contains("tls://") && text.contains("RFAAS_CA_FILE"),
        "{text}"
    );
    // A client speaking the protocol by hand hears the same.
    let raw = d.allocate_and_deallocate(&c_library_bytes()).unwrap_err();
    assert!(raw.contains("over TLS only"), "{raw}");
    assert!(refused(metrics, "plain") >= 2.0);
    served(&d);
}

#[test]
fn plain_clients_are_still_served_where_tls_is_only_offered() {
    let (d, metrics) = daemon(false, "");
    let a = allocate(&d, &d.control_addr().to_string()).unwrap();
    echo(&a, 3);
    a.deallocate().unwrap();
    served(&d);
    assert_eq!(refused(metrics, "plain"), 0.0);
}

#[test]
fn a_client_that_trusts_another_ca_fails_clearly() {
    let (d, metrics) = daemon(true, "");
    let dir = TempDir::new("other-ca");
    let other = TestCa::make(dir.path(), &[]).unwrap();
    trust(&other.ca_file());
    let err = allocate(&d, &d.executor()).unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, Error::Connect { .. }), "{err:?}");
    assert!(
        text.contains("TLS handshake failed")
            && text.contains("certificate")
            && text.contains(&other.ca_file().display().to_string()),
        "{text}"
    );
    wait_for(
        "the failed handshake to be counted",
        Duration::from_secs(30),
        || (refused(metrics, "handshake_failed") >= 1.0).then_some(()),
    );
    trust(&test_ca().ca_file());
    served(&d);
}

#[test]
fn a_peer_that_never_finishes_its_handshake_is_dropped_while_others_are_served() {
    let (d, metrics) = daemon(true, "request_timeout_ms = 1000\n");
    // The first bytes of a TLS record, and nothing more.
    let mut stalled = TcpStream::connect(d.control_addr()).unwrap();
    stalled.write_all(&[0x16, 0x03, 0x01]).unwrap();
    served(&d);
    stalled
        .set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    let mut buf = [0u8; 64];
    match stalled.read(&mut buf) {
        Ok(0) => {}
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
        other => panic!("the stalled peer was not dropped: {other:?}"),
    }
    wait_for(
        "the dropped handshake to be counted",
        Duration::from_secs(30),
        || (refused(metrics, "handshake_timeout") >= 1.0).then_some(()),
    );
    served(&d);
}

#[test]
fn sighup_serves_a_renewed_certificate() {
    let (d, _) = daemon(true, "");
    served(&d);
    let dir = TempDir::new("renewed-ca");
    let renewed = TestCa::make(dir.path(), &[]).unwrap();
    trust(&renewed.ca_file());
    assert!(
        allocate(&d, &d.executor()).is_err(),
        "the old certificate is not the renewed CA's"
    );
    let (cert, key) = d.control_tls_files();
    copy_private(&renewed.cert(), &cert).unwrap();
    copy_private(&renewed.key(), &key).unwrap();
    // SAFETY: kill has no memory preconditions; the pid is the daemon this
    // test started.
    assert_eq!(unsafe { libc::kill(d.pid() as i32, libc::SIGHUP) }, 0);
    let a = poll_for(Duration::from_secs(30), || allocate(&d, &d.executor()).ok())
        .unwrap_or_else(|| panic!("the renewed certificate is not served\nlog:\n{}", d.log()));
    echo(&a, 11);
    a.deallocate().unwrap();
    trust(&test_ca().ca_file());
    assert!(
        allocate(&d, &d.executor()).is_err(),
        "the old certificate is still served"
    );
}

#[test]
fn a_control_key_others_may_read_is_refused_at_start() {
    let dir = TempDir::new("open-key");
    let ca = test_ca();
    let (cert, key) = (dir.join("control.pem"), dir.join("control.key"));
    copy_private(&ca.cert(), &cert).unwrap();
    copy_private(&ca.key(), &key).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o644)).unwrap();
    let err = Executord::try_start(
        std::path::Path::new(DAEMON),
        ExecutordOptions {
            extra_config: format!(
                "control_tls_cert = {:?}\ncontrol_tls_key = {:?}\n",
                cert.display().to_string(),
                key.display().to_string()
            ),
            ..ExecutordOptions::default()
        },
    )
    .unwrap_err();
    assert!(
        err.contains("the TLS key file")
            && err.contains("mode 0644")
            && err.contains("chmod 600")
            && err.contains("control_tls_key"),
        "{err}"
    );
}

//! `metrics_listen`: the daemon's Prometheus metrics and health check, read
//! over HTTP from a running daemon, and what the port does with requests
//! that are not scrapes.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::time::Duration;

use rfaas_client::{Allocation, AllocationSpec, Client, ClientOptions, Mode};
use rfaas_testkit::executord::{sample, Executord, ExecutordOptions};
use rfaas_testkit::functions::c_library_bytes;

const DAEMON: &str = env!("CARGO_BIN_EXE_rfaas-executord");

/// Sends `request` as is and returns the whole answer.
fn http(addr: SocketAddr, request: &[u8]) -> String {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(request).unwrap();
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out
}

fn get(addr: SocketAddr, path: &str) -> String {
    http(
        addr,
        format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes(),
    )
}

#[test]
fn metrics_follow_allocations_and_refusals() {
    let metrics = rfaas_testkit::free_port();
    let d = Executord::start(
        Path::new(DAEMON),
        ExecutordOptions {
            cpus: "0-1".into(),
            extra_config: format!("metrics_listen = \"{metrics}\""),
            ..ExecutordOptions::default()
        },
    );
    let before = get(metrics, "/metrics");
    assert!(before.starts_with("HTTP/1.1 200"), "{before}");
    assert_eq!(
        sample(&before, "rfaas_executord_cores{state=\"free\"}"),
        Some(2.0),
        "{before}"
    );
    assert_eq!(
        sample(&before, "rfaas_executord_allocations"),
        Some(0.0),
        "{before}"
    );
    // Alerts watch failures (monitoring/rfaas-alerts.yml): their series
    // are there, at 0, before the first one.
    for series in [
        "rfaas_executord_manager_calls_total{call=\"heartbeat\",outcome=\"failed\"}",
        "rfaas_executord_manager_calls_total{call=\"register\",outcome=\"failed\"}",
        "rfaas_executord_billing_posts_total{what=\"dropped\"}",
    ] {
        assert_eq!(sample(&before, series), Some(0.0), "{series}: {before}");
    }

    d.allocate_and_deallocate(&c_library_bytes()).unwrap();
    // A token signed with another key is refused, and counted as forged.
    let claims = d.claims("nobody", 1, 1024, std::time::Duration::from_secs(60));
    let mut forged =
        rfaas_testkit::executord::request(d.mint_with_another_key(&claims), 1, &["echo"]);
    forged.request_id = 9;
    let mut s = TcpStream::connect(d.control_addr()).unwrap();
    rfaas_proto::control::Frame::new(&forged, Vec::new())
        .write_to(&mut s)
        .unwrap();
    let reply = rfaas_proto::control::Frame::read_from(&mut s, Default::default()).unwrap();
    assert_eq!(reply.kind, rfaas_proto::control::Kind::Error);

    let after = get(metrics, "/metrics");
    assert_eq!(
        sample(
            &after,
            "rfaas_executord_allocations_total{result=\"granted\"}"
        ),
        Some(1.0),
        "{after}"
    );
    let refused: f64 = after
        .lines()
        .filter(|l| l.starts_with("rfaas_executord_allocations_total{result=\"token_forged\"}"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert_eq!(refused, 1.0, "{after}");
    assert_eq!(
        sample(&after, "rfaas_executord_cold_start_seconds_count"),
        Some(1.0),
        "{after}"
    );
    assert_eq!(
        sample(&after, "rfaas_executord_cores{state=\"free\"}"),
        Some(2.0),
        "{after}"
    );
    assert!(
        sample(&after, "rfaas_executord_workers{state=\"pooled\"}").is_some(),
        "{after}"
    );
    assert_eq!(
        sample(&after, "rfaas_executord_manager_registered"),
        Some(0.0),
        "{after}"
    );
    drop(d);
}

/// An allocation of `echo` on `d`, in `mode`.
fn echo_allocation(d: &Executord, mode: Mode) -> Allocation {
    let spec = AllocationSpec::new(c_library_bytes(), &["echo"])
        .mode(mode)
        .memory_mib(256);
    Client::new(ClientOptions::with_provider("tcp"))
        .allocate(
            &d.control_addr().to_string(),
            &d.token("nobody", 1, 1024, Duration::from_secs(600)),
            &spec,
        )
        .unwrap_or_else(|e| panic!("allocation failed: {e}\ndaemon log:\n{}", d.log()))
}

/// Calls `echo` `n` times with 8 bytes.
fn echo(alloc: &Allocation, n: u64) {
    let f = alloc.function("echo").unwrap();
    let input = alloc.buffer::<u64>(1).unwrap();
    let mut output = alloc.buffer::<u64>(1).unwrap();
    for _ in 0..n {
        assert_eq!(alloc.invoke(f, &input, 1, &mut output).unwrap(), 8);
    }
}

#[test]
fn invocations_total_counts_every_call_of_every_allocation() {
    let metrics = rfaas_testkit::free_port();
    let d = Executord::start(
        Path::new(DAEMON),
        ExecutordOptions {
            extra_config: format!("metrics_listen = \"{metrics}\""),
            ..ExecutordOptions::default()
        },
    );
    let invocations = || {
        sample(
            &get(metrics, "/metrics"),
            "rfaas_executord_invocations_total",
        )
    };
    assert_eq!(invocations(), Some(0.0));

    let warm = echo_allocation(&d, Mode::Warm);
    echo(&warm, 7);
    // Read from the running worker's meter, exactly.
    assert_eq!(invocations(), Some(7.0));
    let hot = echo_allocation(&d, Mode::Hot);
    echo(&hot, 5);
    echo(&warm, 1);
    assert_eq!(invocations(), Some(13.0));
    // Ended allocations keep counting.
    warm.deallocate().unwrap();
    hot.deallocate().unwrap();
    let after = get(metrics, "/metrics");
    assert_eq!(
        sample(&after, "rfaas_executord_invocations_total"),
        Some(13.0),
        "{after}"
    );
    let compute = sample(
        &after,
        "rfaas_executord_worker_cpu_seconds_total{use=\"compute\"}",
    );
    let hot_poll = sample(
        &after,
        "rfaas_executord_worker_cpu_seconds_total{use=\"hot_poll\"}",
    );
    assert!(compute.is_some_and(|s| s > 0.0), "{after}");
    assert!(
        hot_poll.is_some_and(|s| s > 0.0),
        "the hot lane polled: {after}"
    );
    assert!(
        sample(&after, "rfaas_executord_warm_wait_seconds_total").is_some_and(|s| s > 0.0),
        "{after}"
    );
    drop(d);
}

#[test]
fn the_metrics_port_answers_only_scrapes_and_health() {
    let metrics = rfaas_testkit::free_port();
    let d = Executord::start(
        Path::new(DAEMON),
        ExecutordOptions {
            extra_config: format!("metrics_listen = \"{metrics}\""),
            ..ExecutordOptions::default()
        },
    );
    let health = get(metrics, "/healthz");
    assert!(health.starts_with("HTTP/1.1 200"), "{health}");
    assert!(health.ends_with("{\"status\":\"ok\"}\n"), "{health}");
    assert!(get(metrics, "/nothing").starts_with("HTTP/1.1 404"));
    let post = http(
        metrics,
        b"POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n",
    );
    assert!(post.starts_with("HTTP/1.1 405"), "{post}");
    let mut huge = b"GET /metrics HTTP/1.1\r\nX-Pad: ".to_vec();
    huge.extend(std::iter::repeat(b'a').take(16 * 1024));
    huge.extend_from_slice(b"\r\n\r\n");
    let big = http(metrics, &huge);
    assert!(big.starts_with("HTTP/1.1 431"), "{big}");
    // A scraper that connects and says nothing does not stop the next one.
    let idle = TcpStream::connect(metrics).unwrap();
    let again = get(metrics, "/healthz");
    assert!(again.starts_with("HTTP/1.1 200"), "{again}");
    drop(idle);
    drop(d);
}

/// Debian's Prometheus scrapes the daemon, and a value comes back through
/// its query API: the exposition is one a real server accepts.
#[test]
fn prometheus_scrapes_the_daemon() {
    let metrics = rfaas_testkit::free_port();
    let d = Executord::start(
        Path::new(DAEMON),
        ExecutordOptions {
            cpus: "0-1".into(),
            extra_config: format!("metrics_listen = \"{metrics}\""),
            ..ExecutordOptions::default()
        },
    );
    let prom = rfaas_testkit::prometheus::Prometheus::start(&[metrics.to_string()]).unwrap();
    let free = prom
        .wait_for(
            "rfaas_executord_cores{state=\"free\"}",
            Duration::from_secs(30),
            |v| v == 2.0,
        )
        .unwrap();
    assert_eq!(free, 2.0);
    let up = prom.wait_for("up{job=\"rfaas\"}", Duration::from_secs(10), |v| v == 1.0);
    assert_eq!(up, Ok(1.0));
    // Invocations served, through Prometheus.
    let alloc = echo_allocation(&d, Mode::Warm);
    echo(&alloc, 3);
    alloc.deallocate().unwrap();
    let served = prom.wait_for(
        "rfaas_executord_invocations_total",
        Duration::from_secs(30),
        |v| v == 3.0,
    );
    assert_eq!(served, Ok(3.0));
    drop(prom);
    drop(d);
}

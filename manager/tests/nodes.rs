//! Real `rfaas-executord`s registering with a real manager, heartbeating,
//! and scraped by a real Prometheus with the manager.

mod common;

use std::net::{SocketAddr, TcpListener};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::*;
use rfaas_testkit::executord::{daemon_binary, Executord, ExecutordOptions};
use rfaas_testkit::manager::Manager;

fn free_port() -> SocketAddr {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

/// Writes node `name`'s credential from `m` into a private file.
fn credential_file(m: &Manager, name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("rfaas-node-cred-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("node.credential");
    std::fs::write(&path, m.credential("node", name, None)).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    path
}

/// An executord named `name` on `cpus`, registering with `managers`.
fn executord(name: &str, cpus: &str, managers: &[&Manager], cred: &Path, extra: &str) -> Executord {
    let urls: Vec<String> = managers.iter().map(|m| format!("{:?}", m.url())).collect();
    Executord::start(
        &daemon_binary(),
        ExecutordOptions {
            node_name: name.into(),
            cpus: cpus.into(),
            extra_config: format!(
                "{extra}\n[manager]\nurls = [{}]\ncredential_file = {:?}\nmax_backoff_ms = 200\n",
                urls.join(", "),
                cred.display().to_string()
            ),
            ..ExecutordOptions::default()
        },
    )
}

fn wait_for<T>(secs: u64, what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let until = Instant::now() + Duration::from_secs(secs);
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < until, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn executord_registers_heartbeats_and_serves_through_a_manager_outage() {
    let mut db = Db::new("sqlite");
    let mut m = db.manager();
    let cred = credential_file(&m, "node-a");
    let d = executord("node-a", "0-1", &[&m], &cred, "");
    let admin = m.admin();
    let node = wait_for(20, "the node to register", || {
        let (_, n) = admin.call("GET", "/v1/nodes/node-a", None);
        (n["state"] == "up").then_some(n)
    });
    assert_eq!(node["cores"], 2);
    assert_eq!(node["control_addr"], d.control_addr().to_string());
    // Heartbeats move last_heartbeat_ms.
    let heartbeat_after = |t: u64| {
        let (_, all) = admin.call("GET", "/v1/nodes?fresh=true", None);
        all[0]["last_heartbeat_ms"].as_u64().is_some_and(|h| h > t)
    };
    let first = node["last_heartbeat_ms"].as_u64().unwrap();
    wait_for(10, "a heartbeat", || heartbeat_after(first).then_some(()));
    // Every manager down: the daemon goes on serving.
    m.stop();
    d.allocate_and_deallocate(&rfaas_testkit::functions::rust_library_bytes())
        .expect("the daemon serves while no manager answers");
    // Back on the same database and port: heartbeats resume.
    let back = rfaas_manager::now_ms();
    m.restart().unwrap();
    let admin = m.admin();
    wait_for(20, "heartbeats to resume", || {
        let (_, all) = admin.call("GET", "/v1/nodes?fresh=true", None);
        all[0]["last_heartbeat_ms"]
            .as_u64()
            .is_some_and(|h| h > back)
            .then_some(())
    });
    let (_, n) = admin.call("GET", "/v1/nodes/node-a", None);
    assert_eq!(n["state"], "up", "{n}");
}

#[test]
fn prometheus_scrapes_the_manager_and_an_executord() {
    let mut db = Db::new("sqlite");
    let m = db.manager();
    let cred = credential_file(&m, "node-p");
    let metrics = free_port();
    let d = executord(
        "node-p",
        "0-1",
        &[&m],
        &cred,
        &format!("metrics_listen = \"{metrics}\""),
    );
    let manager_addr = m.url().trim_start_matches("http://").to_owned();
    let prom =
        rfaas_testkit::prometheus::Prometheus::start(&[manager_addr, metrics.to_string()]).unwrap();
    let up = prom
        .wait_for(
            "rfaas_manager_nodes{state=\"up\"}",
            Duration::from_secs(30),
            |v| v == 1.0,
        )
        .unwrap();
    assert_eq!(up, 1.0);
    let free = prom
        .wait_for(
            "rfaas_manager_cores{state=\"free\"}",
            Duration::from_secs(10),
            |v| v == 2.0,
        )
        .unwrap();
    assert_eq!(free, 2.0);
    let registered = prom
        .wait_for(
            "rfaas_executord_manager_registered",
            Duration::from_secs(10),
            |v| v == 1.0,
        )
        .unwrap();
    assert_eq!(registered, 1.0);
    drop(prom);
    drop(d);
}

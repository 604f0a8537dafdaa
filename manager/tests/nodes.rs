//! Real `rfaas-executord`s registering with a real manager, heartbeating,
//! and scraped by a real Prometheus with the manager.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::*;
use rfaas_testkit::executord::{daemon_binary, Executord, ExecutordOptions};
use rfaas_testkit::manager::Manager;
use rfaas_testkit::wait::wait_for;

/// Writes node `name`'s credential from `m` into a private file.
fn credential_file(m: &Manager, name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("rfaas-node-cred-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("node.credential");
    std::fs::write(&path, m.credential("node", name, None)).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    path
}

/// An executord named `name` on `cpus`, registering with `managers`;
/// `extra` is top-level configuration, `manager_extra` more of its
/// `[manager]` table.
fn executord(
    name: &str,
    cpus: &str,
    managers: &[&Manager],
    cred: &Path,
    extra: &str,
    manager_extra: &str,
) -> Executord {
    let urls: Vec<String> = managers.iter().map(|m| format!("{:?}", m.url())).collect();
    Executord::start(
        &daemon_binary(),
        ExecutordOptions {
            node_name: name.into(),
            cpus: cpus.into(),
            extra_config: format!(
                "{extra}\n[manager]\nurls = [{}]\ncredential_file = {:?}\nmax_backoff_ms = 200\n{manager_extra}\n",
                urls.join(", "),
                cred.display().to_string()
            ),
            ..ExecutordOptions::default()
        },
    )
}

#[test]
fn executord_registers_heartbeats_and_serves_through_a_manager_outage() {
    let mut db = Db::new("sqlite");
    let mut m = db.manager();
    let cred = credential_file(&m, "node-a");
    let d = executord("node-a", "0-1", &[&m], &cred, "", "harvested = true");
    let admin = m.admin();
    let node = wait_for("the node to register", Duration::from_secs(20), || {
        let (_, n) = admin.call("GET", "/v1/nodes/node-a", None);
        (n["state"] == "up").then_some(n)
    });
    assert_eq!(node["cores"], 2);
    assert_eq!(node["harvested"], true, "{node}");
    assert_eq!(node["control_addr"], d.control_addr().to_string());
    // Heartbeats move last_heartbeat_ms.
    let heartbeat_after = |t: u64| {
        let (_, all) = admin.call("GET", "/v1/nodes?fresh=true", None);
        all[0]["last_heartbeat_ms"].as_u64().is_some_and(|h| h > t)
    };
    let first = node["last_heartbeat_ms"].as_u64().unwrap();
    wait_for("a heartbeat", Duration::from_secs(10), || {
        heartbeat_after(first).then_some(())
    });
    // Every manager down: the daemon goes on serving.
    m.stop();
    d.allocate_and_deallocate(&rfaas_testkit::functions::rust_library_bytes())
        .expect("the daemon serves while no manager answers");
    // Back on the same database and port: heartbeats resume.
    let back = rfaas_service::now_ms();
    m.restart().unwrap();
    let admin = m.admin();
    wait_for("heartbeats to resume", Duration::from_secs(20), || {
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
    let metrics = rfaas_testkit::free_port();
    let d = executord(
        "node-p",
        "0-1",
        &[&m],
        &cred,
        &format!("metrics_listen = \"{metrics}\""),
        "",
    );
    let prom =
        rfaas_testkit::prometheus::Prometheus::start(&[m.url().to_owned(), metrics.to_string()])
            .unwrap();
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

/// An executord for `name` that registers with every manager in `urls`
/// and accepts `key` (a manager's public key line).
fn leased_executord(name: &str, urls: &[String], cred: &Path, key: &str) -> Executord {
    let list: Vec<String> = urls.iter().map(|u| format!("{u:?}")).collect();
    Executord::start(
        &daemon_binary(),
        ExecutordOptions {
            node_name: name.into(),
            cpus: "0-1".into(),
            memory_mib: 4096,
            accept_keys: vec![key.to_owned()],
            extra_config: format!(
                "[manager]\nurls = [{}]\ncredential_file = {:?}\nmax_backoff_ms = 200\n",
                list.join(", "),
                cred.display().to_string()
            ),
            ..ExecutordOptions::default()
        },
    )
}

/// Hundreds of concurrent lease requests through three replicas on one
/// PostgreSQL, onto three real executords, each grant allocated at once on
/// its node with its manager-signed token. Then the database and every
/// executord's own view are compared: each allocation runs under an
/// active lease for its node, no CPU is held twice, and each node's leased
/// cores are exactly its allocations'. Then PostgreSQL stops: invocations
/// on the leases held go on.
#[test]
fn a_lease_storm_onto_executords_holds_no_core_twice_and_survives_the_database() {
    use rfaas_client::lease::{LeaseRequest, Managers};
    use rfaas_client::{AllocationSpec, Client, ClientOptions};

    let mut db = Db::new("postgres");
    // A node whose heartbeats a loaded machine delays past the tests'
    // usual 1 s would be marked lost and its leases ended under the
    // storm's feet: this test is about grants, not about lost nodes.
    let patient = "lost_after_ms = 20000\n";
    let first = db.manager_with(patient, None);
    let others = [
        db.manager_with(patient, Some(&first)),
        db.manager_with(patient, Some(&first)),
    ];
    let urls: Vec<String> = std::iter::once(&first)
        .chain(others.iter())
        .map(|m| m.url().to_owned())
        .collect();
    let key = first.public_key_line();
    let nodes: Vec<Executord> = (0..3)
        .map(|k| {
            let name = format!("storm-{k}");
            let cred = credential_file(&first, &name);
            leased_executord(&name, &urls, &cred, &key)
        })
        .collect();
    let admin = first.admin();
    wait_for("three nodes up", Duration::from_secs(30), || {
        let (_, all) = admin.call("GET", "/v1/nodes", None);
        (all.as_array()
            .map(|a| a.iter().filter(|n| n["state"] == "up").count())
            == Some(3))
        .then_some(())
    });
    let creds: Vec<String> = (0..4)
        .map(|k| first.credential("user", "nobody", Some(&format!("acct{k}"))))
        .collect();
    let library = rfaas_testkit::functions::c_library_bytes();
    let spec = AllocationSpec::new(library, &["echo"])
        .library_name("libfunctions.so")
        .memory_mib(128);
    let want = LeaseRequest {
        cores: 1,
        memory_mib: 256,
        duration_s: 600,
        min_cores: None,
        nodes: vec![],
    };
    let held = std::sync::Mutex::new(Vec::new());
    let refused = std::sync::atomic::AtomicU32::new(0);
    std::thread::scope(|s| {
        for t in 0..16usize {
            let (urls, creds, spec, want, held, refused) =
                (&urls, &creds, &spec, &want, &held, &refused);
            s.spawn(move || {
                let mut rotated = urls.clone();
                rotated.rotate_left(t % urls.len());
                let managers = Managers::new(rotated, &creds[t % creds.len()]).unwrap();
                let client = Client::new(ClientOptions::with_provider("tcp"));
                for k in 0..16 {
                    let lease = match managers.request(want, Duration::ZERO) {
                        Ok(l) => l,
                        Err(rfaas_client::Error::Manager { status: 503, .. }) => {
                            refused.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            continue;
                        }
                        Err(e) => panic!("lease request: {e}"),
                    };
                    let node = lease.nodes().remove(0);
                    let alloc = client
                        .allocate(&node.executor(), &node.token, spec)
                        .unwrap_or_else(|e| panic!("{} refused a granted lease: {e}", node.node));
                    if (t + k) % 3 == 0 {
                        alloc.deallocate().unwrap();
                        lease.release().unwrap();
                    } else {
                        held.lock().unwrap().push((lease, alloc));
                    }
                }
            });
        }
    });
    let held = held.into_inner().unwrap();
    assert_eq!(held.len(), 6, "every core should end up held");
    assert!(
        refused.into_inner() > 100,
        "the storm must compete for the cores"
    );

    // The database and each executord's view.
    let (_, leases) = admin.call("GET", "/v1/leases?limit=100000", None);
    let (_, db_nodes) = admin.call("GET", "/v1/nodes?fresh=true", None);
    for d in &nodes {
        let rfaas_proto::control::local::LocalReply::Status { allocations, .. } = d.status() else {
            panic!("no status from {}", d.node_name());
        };
        let mut cpus: Vec<u32> = allocations.iter().flat_map(|a| a.cpus.clone()).collect();
        let n = cpus.len();
        cpus.sort();
        cpus.dedup();
        assert_eq!(cpus.len(), n, "{}: a CPU held twice", d.node_name());
        for a in &allocations {
            assert!(
                leases
                    .as_array()
                    .unwrap()
                    .iter()
                    .any(|l| l["lease_id"] == a.lease_id
                        && l["node"] == d.node_name()
                        && l["state"] == "active"),
                "{}: allocation under lease {} that the database does not hold active",
                d.node_name(),
                a.lease_id
            );
        }
        let record = db_nodes
            .as_array()
            .unwrap()
            .iter()
            .find(|n| n["name"] == d.node_name())
            .unwrap();
        assert_eq!(
            record["leased_cores"].as_u64().unwrap(),
            allocations.len() as u64,
            "{}: the manager's leased cores and the executord's allocations",
            d.node_name()
        );
    }

    // The database goes away; the held leases keep serving.
    let Db::Postgres(pg) = &mut db else {
        unreachable!()
    };
    pg.stop().unwrap();
    for (_, alloc) in &held {
        let echo = alloc.function("echo").unwrap();
        let mut input = alloc.buffer::<u8>(64).unwrap();
        let mut output = alloc.buffer::<u8>(64).unwrap();
        input.fill(7);
        for _ in 0..50 {
            let n = alloc.invoke(echo, &input, 64, &mut output).unwrap();
            assert_eq!(n, 64);
        }
    }
    let (s, _) = admin.call("POST", "/v1/nodes/storm-0/drain", None);
    assert_eq!(s, 503, "the manager cannot work without its database");
    pg.start_again().unwrap();
    for (lease, alloc) in held {
        alloc.deallocate().unwrap();
        lease.release().unwrap();
    }
}

/// A fleet that grows past `heartbeats_per_s` slows its heartbeats: the
/// daemon takes the interval of each heartbeat reply.
#[test]
fn executord_takes_the_interval_the_fleet_size_asks_for() {
    let mut db = Db::new("sqlite");
    let m = db.manager_with(
        "heartbeats_per_s = 5\nheartbeat_interval_ms = 200\nrefresh_ms = 100\n",
        None,
    );
    let cred = credential_file(&m, "node-a");
    let d = executord("node-a", "0", &[&m], &cred, "", "");
    let admin = m.admin();
    wait_for("the node to register", Duration::from_secs(20), || {
        let (_, n) = admin.call("GET", "/v1/nodes/node-a", None);
        (n["state"] == "up").then_some(())
    });
    assert!(!d.log().contains("new heartbeat interval"), "{}", d.log());
    // Four more nodes: five at five heartbeats a second is one a second.
    for k in 0..4 {
        m.register_node(&format!("extra{k}"), 1, 256);
    }
    wait_for(
        "the daemon to take the new interval",
        Duration::from_secs(20),
        || {
            d.log()
                .lines()
                .any(|l| l.contains("new heartbeat interval") && l.contains("heartbeat_ms=1000"))
                .then_some(())
        },
    );
}

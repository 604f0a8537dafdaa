//! A rolling restart of three manager replicas on one PostgreSQL, as an
//! upgrade does it: each replica in turn is stopped (SIGTERM, by pid) and
//! started again on its port, while jobs grant and release leases through
//! the client library with all three URLs. No grant fails, every grant is
//! released, and the database holds every lease a client was given.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use rfaas_client::lease::{LeaseRequest, Managers};
use rfaas_testkit::manager::{Manager, ManagerOptions};
use rfaas_testkit::postgres::Postgres;
use rfaas_testkit::wait::wait_until;

/// Client threads granting and releasing at once.
const JOBS: usize = 3;

/// What the jobs saw: the grants they were given (all released), and the
/// errors of grants and releases.
#[derive(Debug, Default)]
struct Seen {
    granted: BTreeSet<u64>,
    failures: Vec<String>,
}

/// `n` more grants than `from` have been made.
fn wait_for_grants(count: &AtomicU64, from: u64, n: u64, what: &str) -> u64 {
    wait_until(
        &format!("{n} more grants {what}"),
        Duration::from_secs(60),
        || count.load(Ordering::Relaxed) >= from + n,
    );
    count.load(Ordering::Relaxed)
}

#[test]
fn a_rolling_restart_of_three_replicas_fails_no_grant() {
    let pg = Postgres::start().unwrap_or_else(|e| panic!("{e}"));
    let options = |key: Option<&Manager>| {
        let mut o = ManagerOptions {
            database: Some(pg.url().to_owned()),
            // Nodes registered by hand do not heartbeat.
            extra_config: "lost_after_ms = 600000\nrefresh_ms = 100\n".into(),
            ..ManagerOptions::default()
        };
        if let Some(k) = key {
            o.lease_key = Some(k.lease_key().to_owned());
            o.admin_token = Some(k.admin_token().to_owned());
        }
        o
    };
    let first = Manager::start(options(None));
    let mut replicas = vec![first];
    for _ in 0..2 {
        let m = Manager::start(options(Some(&replicas[0])));
        replicas.push(m);
    }
    replicas[0].register_node("n0", 64, 65536);
    let credential = replicas[0].credential("user", "alice", Some("physics"));
    let urls: Vec<String> = replicas.iter().map(|m| m.url().to_owned()).collect();

    let stop = AtomicBool::new(false);
    let grants = AtomicU64::new(0);
    let seen = Mutex::new(Seen::default());
    std::thread::scope(|s| {
        // Stops the jobs when the test ends, by success or a failed
        // assertion.
        struct StopOnDrop<'a>(&'a AtomicBool);
        impl Drop for StopOnDrop<'_> {
            fn drop(&mut self) {
                self.0.store(true, Ordering::Relaxed);
            }
        }
        let _stop = StopOnDrop(&stop);
        for _ in 0..JOBS {
            let managers = Managers::new(&urls, &credential).expect("the managers");
            let (stop, grants, seen) = (&stop, &grants, &seen);
            s.spawn(move || {
                let request = LeaseRequest {
                    cores: 1,
                    memory_mib: 64,
                    duration_s: 600,
                    min_cores: None,
                    nodes: vec![],
                };
                while !stop.load(Ordering::Relaxed) {
                    match managers.request(&request, Duration::from_secs(60)) {
                        Ok(lease) => {
                            let id = lease.id();
                            seen.lock().unwrap().granted.insert(id);
                            grants.fetch_add(1, Ordering::Relaxed);
                            if let Err(e) = lease.release() {
                                seen.lock()
                                    .unwrap()
                                    .failures
                                    .push(format!("release of {id}: {e}"));
                            }
                        }
                        Err(e) => seen.lock().unwrap().failures.push(format!("grant: {e}")),
                    }
                }
            });
        }
        let mut count = wait_for_grants(&grants, 0, 20, "before the restarts");
        for (k, replica) in replicas.iter_mut().enumerate() {
            let pid = replica.pid();
            replica
                .restart()
                .unwrap_or_else(|e| panic!("replica {k} (pid {pid:?}) did not come back: {e}"));
            count = wait_for_grants(&grants, count, 20, &format!("after replica {k}'s restart"));
        }
        stop.store(true, Ordering::Relaxed);
    });

    let seen = seen.into_inner().unwrap();
    assert!(
        seen.failures.is_empty(),
        "{} of {} grants or releases failed: {:#?}",
        seen.failures.len(),
        seen.granted.len(),
        seen.failures
    );
    // Each replica served grants, so each restart took one that was in use
    // away (the client stays with the replica that answered last).
    for (k, m) in replicas.iter().enumerate() {
        let served = m.log().matches("lease granted").count();
        assert!(served > 0, "replica {k} granted nothing:\n{}", m.log());
    }
    let (status, leases) =
        replicas[1]
            .admin()
            .call("GET", "/v1/leases?all=true&limit=100000", None);
    assert_eq!(status, 200, "{leases}");
    let leases = leases.as_array().expect("a list of leases");
    let stored: BTreeSet<u64> = leases
        .iter()
        .map(|l| l["grant_id"].as_u64().expect("a grant id"))
        .collect();
    assert_eq!(stored, seen.granted, "the grants as stored and as given");
    let not_released: Vec<_> = leases.iter().filter(|l| l["state"] != "released").collect();
    assert!(
        not_released.is_empty(),
        "leases left unreleased: {not_released:#?}"
    );
}

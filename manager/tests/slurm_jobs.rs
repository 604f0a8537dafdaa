//! Job credentials on Slurm's word: a real manager, on SQLite and on a
//! real PostgreSQL server, asking a real Slurm cluster (Debian's Slurm
//! 22.05 on loopback, `scripts/slurm-cluster.sh`) about the jobs its nodes
//! speak for. Runs as root (slurmd starts the jobs), with Slurm installed
//! (`scripts/test.sh` installs it).

mod common;

use std::os::unix::fs::PermissionsExt;
use std::time::Duration;

use common::*;
use rfaas_testkit::manager::{Api, Manager};
use rfaas_testkit::on_both;
use rfaas_testkit::slurm::{SlurmCluster, SlurmOptions};
use rfaas_testkit::wait::wait_for;
use serde_json::{json, Value};

/// Bounds a hung cluster or manager; jobs here start in about a second.
const BOUND: Duration = Duration::from_secs(120);

fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

/// A two-node cluster, and a manager that asks it (answers reused 200
/// ms, so the test sees Slurm's changes soon).
fn start(db: &mut Db) -> (SlurmCluster, Manager) {
    let cluster = SlurmCluster::start(SlurmOptions {
        nodes: 2,
        ..SlurmOptions::default()
    })
    .unwrap_or_else(|e| panic!("{e}"));
    let m = db.manager_with(
        &format!(
            "[slurm]\nconf = {:?}\ncache_ms = 200\ntimeout_ms = 20000\n",
            cluster.conf().display().to_string()
        ),
        None,
    );
    (cluster, m)
}

/// A job of root's in account `physics` on `node`, running until
/// cancelled.
fn running_job(cluster: &SlurmCluster, node: &str) -> u32 {
    let job = cluster
        .sbatch(&["-N1", "-w", node, "-A", "physics", "--wrap", "sleep 600"])
        .unwrap();
    let state = cluster
        .wait_job_state(job, &["RUNNING", "FAILED", "CANCELLED"], BOUND)
        .unwrap();
    assert_eq!(state, "RUNNING");
    job
}

fn ask(api: &Api, job: u64, user: &str, account: &str) -> (u16, Value) {
    let body = json!({"user": user, "account": account, "expires_at": now() + 3600});
    api.call("POST", &format!("/v1/jobs/{job}/credential"), Some(&body))
}

/// `(status, error kind)` of an answer.
fn refusal(r: &(u16, Value)) -> (u16, Option<&str>) {
    (r.0, r.1["error"].as_str())
}

fn nodes_get_credentials_only_for_their_own_running_jobs(kind: &str) {
    let mut db = Db::new(kind);
    let (cluster, m) = start(&mut db);
    let node1 = register(&m, "node1", 4, 4096);
    let node2 = register(&m, "node2", 4, 4096);
    let job = u64::from(running_job(&cluster, "node1"));

    // A job Slurm never heard of.
    let r = ask(&node1, 987_654, "root", "physics");
    assert_eq!(refusal(&r), (403, Some("forbidden")), "{}", r.1);
    assert!(
        r.1["message"]
            .as_str()
            .unwrap()
            .contains("knows no job 987654"),
        "{}",
        r.1
    );
    // Another node's job.
    let r = ask(&node2, job, "root", "physics");
    assert_eq!(refusal(&r), (403, Some("forbidden")), "{}", r.1);
    assert!(
        r.1["message"]
            .as_str()
            .unwrap()
            .contains("not on node \"node2\""),
        "{}",
        r.1
    );
    // Another user, another account.
    for (user, account) in [("daemon", "physics"), ("root", "other")] {
        let r = ask(&node1, job, user, account);
        assert_eq!(
            refusal(&r),
            (403, Some("forbidden")),
            "{user} {account}: {}",
            r.1
        );
        assert!(
            r.1["message"]
                .as_str()
                .unwrap()
                .contains("as user \"root\" in account \"physics\""),
            "{}",
            r.1
        );
    }
    // Its own running job, as Slurm has it.
    let (s, c) = ask(&node1, job, "root", "physics");
    assert_eq!(s, 201, "{c}\n{}", m.log());
    assert_eq!(
        (
            c["job_id"].as_u64(),
            c["subject"].as_str(),
            c["account"].as_str()
        ),
        (Some(job), Some("root"), Some("physics")),
        "{c}"
    );
    let credential = Api::new(m.url(), c["token"].as_str().unwrap());

    // Another node cannot end it; its own node can.
    let (s, e) = node2.call("POST", &format!("/v1/jobs/{job}/end"), None);
    assert_eq!((s, e["error"].as_str()), (403, Some("forbidden")), "{e}");
    let (s, e) = node2.call("POST", "/v1/jobs/987654/end", None);
    assert_eq!((s, e["error"].as_str()), (403, Some("forbidden")), "{e}");
    let (s, _) = credential.call("GET", "/v1/leases", None);
    assert_eq!(s, 200, "a refused end revoked the credential");
    let (s, ended) = node1.call("POST", &format!("/v1/jobs/{job}/end"), None);
    assert_eq!((s, ended["revoked"].as_u64()), (200, Some(1)), "{ended}");

    // Once Slurm says it ended, it gets no credential.
    cluster.run("scancel", &[&job.to_string()]).unwrap();
    cluster
        .wait_job_state(job as u32, &["CANCELLED"], BOUND)
        .unwrap();
    let r = wait_for("a refusal for the ended job", BOUND, || {
        let r = ask(&node1, job, "root", "physics");
        (r.0 != 201).then_some(r)
    });
    assert_eq!(refusal(&r), (403, Some("forbidden")), "{}", r.1);
    assert!(
        r.1["message"].as_str().unwrap().contains("not running"),
        "{}",
        r.1
    );

    // No Slurm to ask: refused, never granted.
    let job = u64::from(running_job(&cluster, "node2"));
    let mut cluster = cluster;
    cluster.stop().unwrap();
    let r = wait_for("a refusal without Slurm", BOUND, || {
        let r = ask(&node2, job, "root", "physics");
        (r.0 != 201).then_some(r)
    });
    assert_eq!(refusal(&r), (503, Some("slurm_unavailable")), "{}", r.1);
    let (s, e) = node2.call("POST", &format!("/v1/jobs/{job}/end"), None);
    assert_eq!(
        (s, e["error"].as_str()),
        (503, Some("slurm_unavailable")),
        "{e}"
    );
}
on_both!(nodes_get_credentials_only_for_their_own_running_jobs);

/// A lease, and its renewal, end no later than the credential that asked.
fn a_lease_never_outlives_its_credential(kind: &str) {
    let mut db = Db::new(kind);
    let m = db.manager_with("[slurm]\nunchecked = true\n", None);
    let node = register(&m, "a", 4, 4096);
    let (s, c) = ask(&node, 5, "alice", "physics");
    assert_eq!(s, 201, "{c}");
    let until = c["expires_at"].as_u64().unwrap();
    let job = Api::new(m.url(), c["token"].as_str().unwrap());
    let (s, g) = lease(&job, 1, None, 64, 86_400);
    assert_eq!(s, 201, "{g}");
    assert!(
        g["expires_at"].as_u64().unwrap() <= until,
        "{g} outlives {c}"
    );
    let id = g["id"].as_u64().unwrap();
    let (s, r) = job.call(
        "POST",
        &format!("/v1/leases/{id}/renew"),
        Some(&json!({"duration_s": 86_400})),
    );
    assert_eq!(s, 200, "{r}");
    assert!(
        r["expires_at"].as_u64().unwrap() <= until,
        "{r} outlives {c}"
    );
    let (_, shown) = m.admin().call("GET", &format!("/v1/leases/{id}"), None);
    assert!(shown[0]["expires_at"].as_u64().unwrap() <= until, "{shown}");
}
on_both!(a_lease_never_outlives_its_credential);

/// Every node of a job asks for its credential as the job starts, and
/// says it ended as it ends: a replica asks Slurm once for all of them,
/// whether they ask at once or one after the other (answers kept long
/// here, so that nothing depends on timing). A node names only the job's
/// user and uid, as executord does: the account and time limit are
/// Slurm's, and a wrong uid is refused.
fn a_job_on_many_nodes_costs_a_replica_one_slurm_question(kind: &str) {
    let mut db = Db::new(kind);
    let cluster = SlurmCluster::start(SlurmOptions {
        nodes: 2,
        ..SlurmOptions::default()
    })
    .unwrap_or_else(|e| panic!("{e}"));
    // A real squeue, each run of it counted.
    let dir =
        std::env::temp_dir().join(format!("rfaas-squeue-count-{}-{kind}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let runs = dir.join("runs");
    let squeue = dir.join("squeue");
    std::fs::write(
        &squeue,
        format!(
            "#!/bin/sh\necho run >> {:?}\nexec squeue \"$@\"\n",
            runs.display().to_string()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&squeue, std::fs::Permissions::from_mode(0o755)).unwrap();
    let m = db.manager_with(
        &format!(
            "[slurm]\nconf = {:?}\nsqueue = {:?}\ncache_ms = 600000\ntimeout_ms = 20000\n",
            cluster.conf().display().to_string(),
            squeue.display().to_string()
        ),
        None,
    );
    let nodes = [
        register(&m, "node1", 4, 4096),
        register(&m, "node2", 4, 4096),
    ];
    let job = cluster
        .sbatch(&["-N2", "-t", "10", "-A", "physics", "--wrap", "sleep 600"])
        .unwrap();
    let state = cluster
        .wait_job_state(job, &["RUNNING", "FAILED", "CANCELLED"], BOUND)
        .unwrap();
    assert_eq!(state, "RUNNING");
    let count = || {
        std::fs::read_to_string(&runs)
            .unwrap_or_default()
            .lines()
            .count()
    };
    let before = now();
    let body = json!({"user": "root", "uid": 0});
    let path = format!("/v1/jobs/{job}/credential");
    let answers: Vec<(u16, Value)> = std::thread::scope(|s| {
        let asks: Vec<_> = nodes
            .iter()
            .map(|n| s.spawn(|| n.call("POST", &path, Some(&body))))
            .collect();
        asks.into_iter().map(|a| a.join().unwrap()).collect()
    });
    for (s, c) in &answers {
        assert_eq!(*s, 201, "{c}\n{}", m.log());
        assert_eq!(
            (c["subject"].as_str(), c["account"].as_str()),
            (Some("root"), Some("physics")),
            "{c}"
        );
        // Slurm's time limit: 10 minutes from the job's start.
        let until = c["expires_at"].as_u64().unwrap();
        assert!(until > before && until <= now() + 600, "{c}");
    }
    // A later step on a node, and a wrong uid.
    let (s, _) = nodes[0].call("POST", &path, Some(&body));
    assert_eq!(s, 201);
    let r = nodes[1].call("POST", &path, Some(&json!({"user": "root", "uid": 1000})));
    assert_eq!(refusal(&r), (403, Some("forbidden")), "{}", r.1);
    assert!(
        r.1["message"].as_str().unwrap().contains("not as uid 1000"),
        "{}",
        r.1
    );
    assert_eq!(count(), 1, "one squeue for the job's start\n{}", m.log());

    // Both nodes say it ended: checked against the nodes kept, and no
    // credential after, though what Slurm said of it was kept running.
    for n in &nodes {
        let (s, e) = n.call("POST", &format!("/v1/jobs/{job}/end"), None);
        assert_eq!(s, 200, "{e}");
    }
    let r = nodes[0].call("POST", &path, Some(&body));
    assert_eq!(refusal(&r), (403, Some("forbidden")), "{}", r.1);
    assert_eq!(count(), 1, "no squeue for the job's end\n{}", m.log());
    cluster.run("scancel", &[&job.to_string()]).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}
on_both!(a_job_on_many_nodes_costs_a_replica_one_slurm_question);

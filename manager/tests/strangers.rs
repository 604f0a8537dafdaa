//! A replica's REST port in front of strangers: callers without a valid
//! credential cost it little and change nothing for callers with one.
//! Each test runs a real `rfaas-manager`; where the database is involved,
//! on SQLite and on a real PostgreSQL server, whose statement log counts
//! the queries a request makes.

mod common;

use std::io::Write;
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use common::*;
use rfaas_testkit::manager::{Api, Manager};
use rfaas_testkit::on_both;
use rfaas_testkit::strangers::{
    idle_connections, made_up_credential, read_response, request, Flood, FloodPlan,
};

/// Long enough for any answer on a loaded machine: a bound on a hang, not
/// a measure of speed.
const ANSWER_WITHIN: Duration = Duration::from_secs(30);

fn addr(m: &Manager) -> SocketAddr {
    let url = m.url();
    url.split_once("://")
        .map_or(url, |(_, rest)| rest)
        .parse()
        .expect("a manager's address")
}

/// Loopback source addresses 127.0.0.2 and up.
fn sources(n: u8) -> Vec<Ipv4Addr> {
    (0..n).map(|i| Ipv4Addr::new(127, 0, 0, 2 + i)).collect()
}

/// Sets this process's soft descriptor limit to `soft` (at most the
/// hard one); returns the hard limit.
fn set_soft_descriptor_limit(soft: u64) -> u64 {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit and setrlimit read or write only `lim`, ours.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim), 0);
        lim.rlim_cur = soft.min(lim.rlim_max);
        assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &lim), 0);
    }
    lim.rlim_max
}

/// Started under the usual soft limit of 1024 descriptors, a replica
/// raises it to the hard limit, so 1,100 idle connections do not make it
/// unreachable (its accepts would fail with EMFILE, silently).
#[test]
fn the_descriptor_limit_is_raised_at_start() {
    let hard = set_soft_descriptor_limit(1024);
    assert!(
        hard >= 4096,
        "the hard descriptor limit is {hard}; this test needs at least 4096 (ulimit -Hn)"
    );
    let mut db = Db::new("sqlite");
    let m = db.plain_manager("");
    // The manager inherited 1024; this process needs more for the
    // connections.
    set_soft_descriptor_limit(hard);
    let limits = std::fs::read_to_string(format!("/proc/{}/limits", m.pid().unwrap())).unwrap();
    let open_files: Vec<u64> = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .expect("Max open files in /proc/pid/limits")
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect();
    assert_eq!(open_files, vec![hard, hard], "{limits}");
    assert!(
        m.log().contains(&format!("limit={hard}")),
        "the limit is not logged:\n{}",
        m.log()
    );
    let (idle, failed) = idle_connections(&sources(11), 100, addr(&m));
    assert_eq!((idle.len(), failed), (1100, 0));
    let (s, h) = Api::new(m.url(), "").call("GET", "/healthz", None);
    assert_eq!(s, 200, "healthz behind 1,100 idle connections: {h}");
}

/// The series of `/metrics`: its lines that are not comments.
fn series(text: &str) -> usize {
    text.lines().filter(|l| !l.starts_with('#')).count()
}

/// Made-up methods and paths, with or without a credential, fold into one
/// label value: 2,000 of them leave the number of series as it was, and
/// the text's size but for the counts' digits.
#[test]
fn made_up_methods_and_paths_add_no_series() {
    let mut db = Db::new("sqlite");
    let m = db.plain_manager("");
    let u = user(&m, "alice", "physics");
    let open = Api::new(m.url(), "");
    let mut conn = TcpStream::connect(addr(&m)).unwrap();
    conn.set_read_timeout(Some(ANSWER_WITHIN)).unwrap();
    let mut send = |method: &str, path: &str, token: Option<&str>| {
        conn.write_all(&request(method, path, token, b"", None))
            .unwrap();
        let (status, _) = read_response(&mut conn).unwrap();
        assert!((400..500).contains(&status), "{method} {path}: {status}");
    };
    let mut odd = |k: usize| {
        let token = [None, Some(u.token())][k % 2];
        send(&format!("M{k}"), "/v1/leases", token);
        send("GET", &format!("/made/up/{k}"), token);
        send(&format!("X{k}"), &format!("/x{k}"), token);
    };
    // The first of each kind makes the `other` series.
    (0..4).for_each(&mut odd);
    // So is the first scrape's.
    open.call("GET", "/metrics", None);
    let (_, before) = open.call("GET", "/metrics", None);
    let before = before.as_str().unwrap().to_owned();
    (4..671).for_each(&mut odd);
    let (_, after) = open.call("GET", "/metrics", None);
    let after = after.as_str().unwrap().to_owned();
    assert_eq!(series(&after), series(&before), "{after}");
    assert!(
        after.len() < before.len() + 1024,
        "/metrics grew from {} to {} bytes",
        before.len(),
        after.len()
    );
    assert!(
        after.contains("method=\"other\",route=\"other\""),
        "no `other` series:\n{after}"
    );
}

/// Sends `req` on a fresh connection and reads the answer, which must
/// come without the rest of the body announced.
fn answer_without_body(m: &Manager, req: &[u8]) -> (u16, serde_json::Value) {
    let mut s = TcpStream::connect(addr(m)).unwrap();
    s.set_read_timeout(Some(ANSWER_WITHIN)).unwrap();
    s.write_all(req).unwrap();
    let (status, body) = read_response(&mut s).unwrap_or_else(|e| {
        panic!(
            "no answer without the body ({e}) to {}",
            String::from_utf8_lossy(&req[..req.len().min(200)])
        )
    });
    (
        status,
        serde_json::from_slice(&body).unwrap_or(serde_json::Value::Null),
    )
}

/// A caller who may not send a body gets `401` (or `403` for a known
/// caller of another role) before the body is read: one announced as
/// 100 MB, of which only a malformed start is ever sent, is never waited
/// for, on every route that takes a body.
fn a_strangers_body_is_never_read(kind: &str) {
    let mut db = Db::new(kind);
    let m = db.plain_manager("");
    let u = user(&m, "alice", "physics");
    let routes = [
        ("PUT", "/v1/nodes/a"),
        ("POST", "/v1/nodes/a/heartbeat"),
        ("POST", "/v1/leases"),
        ("POST", "/v1/leases/1/renew"),
        ("POST", "/v1/credentials"),
        ("POST", "/v1/jobs/7/credential"),
        ("PUT", "/v1/budgets/physics"),
    ];
    let made_up = made_up_credential();
    let callers: [(Option<&str>, u16); 4] = [
        (None, 401),
        (Some(made_up.as_str()), 401),
        (Some("rfaasc.not-hex.x"), 401),
        (Some("not a credential at all"), 401),
    ];
    for (method, path) in routes {
        for (token, want) in callers {
            let req = request(method, path, token, b"{\"cores\": [[[", Some(100_000_000));
            let (status, e) = answer_without_body(&m, &req);
            assert_eq!(
                (status, e["error"].as_str()),
                (want, Some("unauthorized")),
                "{method} {path} with {token:?}: {e}"
            );
        }
    }
    // A user is known, but may not register a node: refused as such, the
    // body unread.
    let req = request(
        "PUT",
        "/v1/nodes/a",
        Some(u.token()),
        b"{",
        Some(100_000_000),
    );
    let (status, e) = answer_without_body(&m, &req);
    assert_eq!(
        (status, e["error"].as_str()),
        (403, Some("forbidden")),
        "{e}"
    );
    // A caller who may send it still has a malformed body refused as such.
    let (s, _, e) = u.raw("POST", "/v1/leases", Some("{".into()), "application/json");
    assert_eq!(
        (s, e["error"].as_str()),
        (400, Some("malformed_request")),
        "{e}"
    );
}
on_both!(a_strangers_body_is_never_read);

/// Statement lines of PostgreSQL's log (`log_statement = all`), and the
/// parameters' lines.
fn logged_statements(pg: &Postgres) -> Vec<String> {
    pg.log()
        .lines()
        .filter(|l| {
            l.contains("LOG:  statement:")
                || l.contains("LOG:  execute")
                || l.contains("DETAIL:  parameters:")
        })
        .map(str::to_owned)
        .collect()
}

fn log_every_statement(pg: &Postgres) {
    pg.psql("ALTER SYSTEM SET log_statement = 'all'").unwrap();
    pg.psql("SELECT pg_reload_conf()").unwrap();
}

/// Made-up credentials cost no database query: their ids fail the tag
/// the replicas' key puts on every id they mint (or, untagged, were not
/// held at start). A credential that passes the tag but not its secret
/// costs one query while the replica remembers it (2 s), however many
/// requests name it meanwhile, concurrent or not; malformed credentials
/// cost none.
#[test]
fn made_up_credentials_cost_no_query() {
    let mut db = Db::new("postgres");
    // Before the replica connects: every connection it opens logs.
    let Db::Postgres(pg) = &db else {
        unreachable!()
    };
    log_every_statement(pg);
    let m = db.plain_manager("");
    let Db::Postgres(pg) = &db else {
        unreachable!()
    };
    // A real id with a wrong secret passes the tag and is looked up.
    let real = m.credential("user", "alice", Some("physics"));
    let real_id = real.split('.').nth(1).unwrap().to_owned();
    let wrong_secret = format!("rfaasc.{real_id}.not-the-secret");
    let made_up = made_up_credential();
    let made_up_id = made_up.split('.').nth(1).unwrap().to_owned();
    let made_up_untagged = format!("rfaasc.{}.secret", &made_up_id[..16]);
    let start = Instant::now();
    std::thread::scope(|s| {
        for token in [&made_up, &made_up_untagged, &wrong_secret] {
            for _ in 0..3 {
                s.spawn(|| {
                    let api = Api::new(m.url(), token);
                    for _ in 0..25 {
                        let (st, e) = api.call("GET", "/v1/leases", None);
                        assert_eq!(
                            (st, e["error"].as_str()),
                            (401, Some("unauthorized")),
                            "{e}"
                        );
                    }
                });
            }
        }
    });
    let took = start.elapsed();
    for malformed in ["rfaasc.zz11.x", "rfaasc.", "rfaasc.00ff", "Basic abc"] {
        let (st, _) = Api::new(m.url(), malformed).call("GET", "/v1/leases", None);
        assert_eq!(st, 401, "{malformed}");
    }
    let lines = logged_statements(pg);
    // Lookups, not the INSERT that minted it: a statement that reads,
    // followed by its parameters naming the id.
    let lookups = lines
        .windows(2)
        .filter(|w| w[0].contains("SELECT") && w[1].contains(&real_id))
        .count();
    // One query per 2 s the 75 requests took at most: a slow machine
    // makes the bound looser, never the test flaky.
    let allowed = 1 + (took.as_secs() / 2) as usize;
    assert!(
        lookups <= allowed,
        "{lookups} lookups of one credential in {took:?} (at most {allowed}):\n{}",
        lines.join("\n")
    );
    assert!(
        lookups >= 1,
        "the real id's lookup was not logged:\n{}",
        lines.join("\n")
    );
    for never in [&made_up_id[..16], "zz11", "'00ff'"] {
        assert!(
            !lines.iter().any(|l| l.contains(never)),
            "a made-up or malformed credential ({never}) reached the database:\n{}",
            lines.join("\n")
        );
    }
}

/// `/healthz` needs no credential and makes no query: it answers from the
/// background refresh's last round.
#[test]
fn healthz_is_answered_without_a_query() {
    let mut db = Db::new("postgres");
    // No background round during the test: every statement logged would
    // be a request's.
    let m = db.plain_manager("refresh_ms = 3600000\n");
    let Db::Postgres(pg) = &db else {
        unreachable!()
    };
    log_every_statement(pg);
    let open = Api::new(m.url(), "");
    // The reload is applied once a statement of this session sees it.
    rfaas_testkit::wait::wait_until("PostgreSQL to log statements", ANSWER_WITHIN, || {
        pg.psql("SELECT 'log-probe'").unwrap();
        pg.log().contains("log-probe")
    });
    let before = logged_statements(pg).len();
    for _ in 0..100 {
        let (s, h) = open.call("GET", "/healthz", None);
        assert_eq!((s, h["status"].as_str()), (200, Some("ok")), "{h}");
    }
    let lines = logged_statements(pg);
    assert_eq!(
        lines.len(),
        before,
        "healthz made queries:\n{}",
        lines[before..].join("\n")
    );
}

/// A flood of made-up credentials, a new one each request from thousands
/// of connections, leaves a user's grants served on SQLite (one database
/// connection): none is refused `database_unavailable`.
#[test]
fn a_flood_of_made_up_credentials_leaves_grants_served() {
    let hard = set_soft_descriptor_limit(u64::MAX);
    assert!(
        hard >= 8192,
        "this test needs 8192 descriptors (ulimit -Hn)"
    );
    let mut db = Db::new("sqlite");
    // The node never heartbeats: it must not be lost meanwhile.
    let m = db.plain_manager("lost_after_ms = 3600000\n");
    register(&m, "a", 64, 65536);
    let u = user(&m, "alice", "physics");
    let flood = Flood::start(
        addr(&m),
        &FloodPlan {
            from: sources(40),
            threads: 8,
            connections: 500,
            per_s: None,
            method: "POST",
            path: "/v1/leases".into(),
            body: br#"{"cores": 1, "memory_mib": 64, "duration_s": 60}"#.to_vec(),
        },
    );
    rfaas_testkit::wait::wait_until("the flood to be answered", ANSWER_WITHIN, || {
        flood
            .counts
            .unauthorized
            .load(std::sync::atomic::Ordering::Relaxed)
            >= 4000
    });
    for _ in 0..100 {
        let (s, g) = lease(&u, 1, None, 64, 60);
        assert_eq!(s, 201, "a grant during the flood: {g}");
        let id = g["id"].as_u64().unwrap();
        let (s, r) = u.call("DELETE", &format!("/v1/leases/{id}"), None);
        assert_eq!(s, 204, "a release during the flood: {r}");
    }
    let answered = flood
        .counts
        .unauthorized
        .load(std::sync::atomic::Ordering::Relaxed);
    drop(flood);
    assert!(answered >= 4000, "{answered}");
}

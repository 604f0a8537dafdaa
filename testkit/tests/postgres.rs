//! The throwaway PostgreSQL server the tests use: it answers SQL on its
//! URL, keeps committed rows across a stop and a crash on the same port,
//! refuses connections while down, and leaves no process or directory
//! behind.

use std::net::TcpStream;
use std::path::Path;

use rfaas_testkit::postgres::Postgres;

/// True while `pid` runs (a zombie has stopped; nothing may reap it here).
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .map(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("State:"))
                .is_some_and(|state| !state.trim_start().starts_with('Z'))
        })
        .unwrap_or(false)
}

fn refuses(pg: &Postgres) -> bool {
    TcpStream::connect(("127.0.0.1", pg.port())).is_err()
}

#[test]
fn keeps_committed_rows_across_a_stop_and_a_crash() {
    let mut pg = Postgres::start().unwrap();
    let url = pg.url().to_string();
    assert!(
        url.starts_with("postgres://postgres:")
            && url.ends_with(&format!("@127.0.0.1:{}/rfaas", pg.port())),
        "{url}"
    );
    assert_eq!(
        pg.psql("select current_database(), 1 + 1").unwrap(),
        "rfaas|2"
    );
    assert!(
        pg.psql("show server_version").unwrap().starts_with("15."),
        "not PostgreSQL 15"
    );
    pg.psql("create table kept (n int); insert into kept values (1)")
        .unwrap();

    let first = pg.pid().unwrap();
    pg.stop().unwrap();
    assert!(!alive(first), "pid {first} still runs after stop");
    assert!(refuses(&pg), "port {} still answers after stop", pg.port());
    assert!(pg.psql("select 1").is_err());
    pg.start_again().unwrap();
    assert_eq!(pg.url(), url);
    assert_eq!(pg.psql("select n from kept").unwrap(), "1");

    pg.psql("insert into kept values (2)").unwrap();
    let second = pg.pid().unwrap();
    pg.kill().unwrap();
    assert!(!alive(second), "pid {second} still runs after kill");
    assert!(refuses(&pg), "port {} still answers after kill", pg.port());
    pg.start_again().unwrap();
    assert_eq!(
        pg.psql("select string_agg(n::text, ',' order by n) from kept")
            .unwrap(),
        "1,2"
    );

    pg.restart().unwrap();
    assert_eq!(pg.psql("select count(*) from kept").unwrap(), "2");
}

#[test]
fn refuses_a_wrong_password() {
    let pg = Postgres::start().unwrap();
    let wrong = format!("postgres://postgres:wrong@127.0.0.1:{}/rfaas", pg.port());
    let out = std::process::Command::new(rfaas_testkit::postgres::bindir().join("psql"))
        .args(["-X", "-d", &wrong, "-c", "select 1"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("password authentication failed"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn drop_stops_the_server_and_removes_its_directory() {
    let pg = Postgres::start().unwrap();
    let pid = pg.pid().unwrap();
    let dir = pg.dir().to_path_buf();
    let port = pg.port();
    assert!(alive(pid));
    drop(pg);
    assert!(!alive(pid), "pid {pid} still runs after drop");
    assert!(!dir.exists(), "{} is left behind", dir.display());
    assert!(TcpStream::connect(("127.0.0.1", port)).is_err());
}

#[test]
fn two_servers_run_side_by_side() {
    let a = Postgres::start().unwrap();
    let b = Postgres::start().unwrap();
    assert_ne!(a.port(), b.port());
    a.psql("create table only_in_a (n int)").unwrap();
    assert!(b.psql("select * from only_in_a").is_err());
}

#[test]
fn missing_binaries_say_how_to_install_them() {
    let err = Postgres::start_with(Path::new("/nonexistent/postgresql/bin")).unwrap_err();
    assert!(err.contains("scripts/test.sh"), "{err}");
    assert!(err.contains("postgresql-15"), "{err}");
}

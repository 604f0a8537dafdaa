//! `rfaasctl`, the real binary, against a real `rfaas-manager` on SQLite.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicU32, Ordering};

use common::*;
use rfaas_testkit::manager::{Api, Manager, ManagerOptions};
use serde_json::Value;

/// A private directory with an admin token file, removed on drop.
struct TokenDir(PathBuf);

impl TokenDir {
    fn new(token: &str, mode: u32) -> TokenDir {
        static SEQ: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "rfaasctl-test-{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("admin.token");
        std::fs::write(&file, format!("{token}\n")).unwrap();
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(mode)).unwrap();
        TokenDir(dir)
    }

    fn file(&self) -> PathBuf {
        self.0.join("admin.token")
    }
}

impl Drop for TokenDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Runs rfaasctl with `managers` and `token_file`, then `args`.
fn rfaasctl(managers: &str, token_file: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_rfaasctl"))
        .env_remove("RFAAS_MANAGERS")
        .env_remove("RFAAS_ADMIN_TOKEN_FILE")
        .arg("--manager")
        .arg(managers)
        .arg("--token-file")
        .arg(token_file)
        .args(args)
        .output()
        .expect("rfaasctl runs")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Runs rfaasctl as the admin of `m` and insists it succeeds; its stdout.
fn ok(m: &Manager, admin: &TokenDir, args: &[&str]) -> String {
    let o = rfaasctl(m.url(), &admin.file(), args);
    assert!(
        o.status.success(),
        "rfaasctl {args:?}: {:?}\nstdout: {}\nstderr: {}",
        o.status,
        stdout(&o),
        stderr(&o)
    );
    stdout(&o)
}

fn started() -> (Manager, TokenDir) {
    let m = Manager::start(ManagerOptions::default());
    let t = TokenDir::new(m.admin_token(), 0o600);
    (m, t)
}

#[test]
fn nodes_as_a_table_and_as_json() {
    let (m, admin) = started();
    register(&m, "n1", 4, 4096);
    let table = ok(&m, &admin, &["nodes"]);
    let lines: Vec<&str> = table.lines().collect();
    assert_eq!(lines.len(), 2, "{table}");
    assert!(lines[0].starts_with("NAME  STATE"), "{table}");
    let cells: Vec<&str> = lines[1].split_whitespace().collect();
    assert_eq!(
        cells[..7],
        ["n1", "up", "4", "0", "0", "4096", "0"],
        "{table}"
    );
    let at = lines[0].find("HARVESTED").unwrap();
    assert!(lines[1][at..].starts_with("no "), "{table}");
    assert_eq!(cells.last(), Some(&"127.0.0.1:7100"), "{table}");
    // Columns line up: each header starts where its cells start.
    let at = lines[0].find("ADDRESS").unwrap();
    assert_eq!(&lines[1][at..], "127.0.0.1:7100", "{table}");

    let json: Value = serde_json::from_str(&ok(&m, &admin, &["--json", "nodes", "--fresh"]))
        .expect("--json prints JSON");
    assert_eq!(json[0]["name"], "n1", "{json}");
    assert_eq!(json[0]["cores"], 4, "{json}");
    let one: Value = serde_json::from_str(&ok(&m, &admin, &["node", "n1", "--json"])).unwrap();
    assert_eq!(one["control_addr"], "127.0.0.1:7100", "{one}");
    assert!(ok(&m, &admin, &["node", "n1"]).contains("tcp (127.0.0.1), shm"));
}

#[test]
fn nodes_are_read_page_by_page_and_filtered() {
    let (m, admin) = started();
    for name in ["n3", "n1", "x1", "n2", "n5", "n4"] {
        register(&m, name, 2, 1024);
    }
    ok(&m, &admin, &["drain", "n2"]);
    let names = |args: &[&str]| -> Vec<String> {
        let mut all = vec!["--json", "nodes"];
        all.extend_from_slice(args);
        let json: Value = serde_json::from_str(&ok(&m, &admin, &all)).expect("JSON");
        json.as_array()
            .expect("a list")
            .iter()
            .map(|n| n["name"].as_str().unwrap_or_default().to_owned())
            .collect()
    };
    let all = ["n1", "n2", "n3", "n4", "n5", "x1"];
    assert_eq!(names(&["--page-size", "2"]), all);
    assert_eq!(names(&["--page-size", "1", "--fresh"]), all);
    assert_eq!(
        names(&["--page-size", "1", "--state", "up", "--prefix", "n"]),
        ["n1", "n3", "n4", "n5"]
    );
    assert_eq!(names(&["--state", "drained"]), ["n2"]);
    // n4 and x1 move into Slurm partition "gpu".
    for name in ["x1", "n4"] {
        let api = Api::new(m.url(), &m.credential("node", name, None));
        let mut body = node_body(7100, 2, 1024);
        body["partitions"] = serde_json::json!(["batch", "gpu"]);
        let (s, r) = api.call("PUT", &format!("/v1/nodes/{name}"), Some(&body));
        assert_eq!(s, 200, "{r}");
    }
    assert_eq!(
        names(&["--page-size", "1", "--partition", "gpu"]),
        ["n4", "x1"]
    );
    assert_eq!(names(&["--partition", "gpu", "--prefix", "x"]), ["x1"]);
    assert!(ok(&m, &admin, &["node", "x1"]).contains("partitions      batch, gpu"));
    let table = ok(&m, &admin, &["nodes", "--page-size", "4"]);
    assert_eq!(table.lines().count(), 7, "a header and six nodes: {table}");
}

#[test]
fn a_user_credential_it_prints_leases_cores() {
    let (m, admin) = started();
    register(&m, "n1", 4, 4096);
    let out = ok(
        &m,
        &admin,
        &[
            "credential",
            "user",
            "alice",
            "--account",
            "physics",
            "--ttl",
            "1h",
        ],
    );
    let token = out.strip_suffix('\n').expect("one line");
    assert!(!token.contains(char::is_whitespace), "{out:?}");
    let alice = Api::new(m.url(), token);
    let (s, g) = lease(&alice, 2, None, 64, 60);
    assert_eq!(s, 201, "{g}");

    let leases = ok(&m, &admin, &["leases"]);
    let row: Vec<&str> = leases
        .lines()
        .nth(1)
        .expect("a lease")
        .split_whitespace()
        .collect();
    assert_eq!(row[2..7], ["n1", "alice", "physics", "2", "64"], "{leases}");
    // Expires in 60 s, less the seconds the test took since.
    let left: u64 = row[8].strip_suffix('s').unwrap().parse().unwrap();
    assert_eq!((row[7], row[9]), ("in", "active"), "{leases}");
    assert!((1..=60).contains(&left), "{leases}");
    let grant = g["id"].as_u64().unwrap().to_string();
    assert_eq!(row[0], grant, "{leases}");
    ok(&m, &admin, &["release", &grant]);
    assert_eq!(
        ok(&m, &admin, &["leases"]).lines().count(),
        1,
        "only the header"
    );
    assert!(ok(&m, &admin, &["leases", "--all"]).contains("released"));

    // Listed, then revoked: the token stops working.
    let creds = ok(&m, &admin, &["credentials"]);
    let line = creds
        .lines()
        .find(|l| l.contains("alice"))
        .expect("alice's");
    assert!(
        line.contains("physics") && (line.ends_with("in 59m") || line.ends_with("in 60m")),
        "{creds}"
    );
    let id = line.split_whitespace().next().unwrap();
    ok(&m, &admin, &["revoke", id]);
    assert_eq!(lease(&alice, 1, None, 64, 60).0, 401);

    // With --json, the whole credential.
    let cred: Value =
        serde_json::from_str(&ok(&m, &admin, &["--json", "credential", "node", "n2"])).unwrap();
    assert_eq!(
        (cred["role"].as_str(), cred["subject"].as_str()),
        (Some("node"), Some("n2"))
    );
    assert!(
        cred["token"].as_str().unwrap().starts_with("rfaasc."),
        "{cred}"
    );
}

#[test]
fn a_drained_node_shows_drained() {
    let (m, admin) = started();
    register(&m, "n1", 2, 1024);
    let said = ok(&m, &admin, &["drain", "n1"]);
    assert!(said.contains("n1 is drained"), "{said}");
    let state = |m: &Manager| {
        let table = ok(m, &admin, &["nodes"]);
        table
            .lines()
            .nth(1)
            .unwrap()
            .split_whitespace()
            .nth(1)
            .unwrap()
            .to_owned()
    };
    assert_eq!(state(&m), "drained");
    ok(&m, &admin, &["resume", "n1"]);
    assert_eq!(state(&m), "up");
    // An unknown node: the manager's message and kind, exit 1.
    let o = rfaasctl(m.url(), &admin.file(), &["drain", "ghost"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("no node is named \"ghost\" (not_found)"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn budgets_are_set_listed_and_cleared() {
    let (m, admin) = started();
    let said = ok(&m, &admin, &["budget", "set", "physics", "100"]);
    assert_eq!(
        said,
        "account physics may spend 100.00; it has spent 0.00\n"
    );
    ok(&m, &admin, &["budget", "set", "chem", "12.5"]);
    let table = ok(&m, &admin, &["budget", "list"]);
    let lines: Vec<&str> = table.lines().collect();
    assert_eq!(
        lines,
        [
            "ACCOUNT  BUDGET  SPENT    LEFT  STATE",
            "chem      12.50   0.00   12.50  ok",
            "physics  100.00   0.00  100.00  ok",
        ],
        "{table}"
    );
    let json: Value = serde_json::from_str(&ok(&m, &admin, &["budget", "list", "--json"])).unwrap();
    assert_eq!(json[1]["account"], "physics", "{json}");
    assert_eq!(json[1]["budget"], 100.0, "{json}");
    let said = ok(&m, &admin, &["budget", "clear", "chem"]);
    assert_eq!(said, "account chem has no budget now\n");
    let table = ok(&m, &admin, &["budget", "list"]);
    assert_eq!(table.lines().count(), 2, "{table}");
    // No budget to clear: the manager's words, exit 1; a bad amount: exit 2.
    let o = rfaasctl(m.url(), &admin.file(), &["budget", "clear", "chem"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("account \"chem\" has no budget (not_found)"),
        "{}",
        stderr(&o)
    );
    let o = rfaasctl(m.url(), &admin.file(), &["budget", "set", "chem", "ten"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("not a budget"), "{}", stderr(&o));
}

#[test]
fn a_wrong_token_is_refused_with_the_managers_words() {
    let (m, _admin) = started();
    let wrong = TokenDir::new("0123456789abcdef0123456789abcdef", 0o600);
    let o = rfaasctl(m.url(), &wrong.file(), &["nodes"]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(
        err.contains("neither a credential of this manager nor its admin token (unauthorized)"),
        "{err}"
    );
    assert_eq!(stdout(&o), "");
}

#[test]
fn the_token_file_must_be_private() {
    let (m, _) = started();
    let open = TokenDir::new(m.admin_token(), 0o644);
    let o = rfaasctl(m.url(), &open.file(), &["nodes"]);
    assert_eq!(o.status.code(), Some(1));
    let err = stderr(&o);
    assert!(
        err.contains("mode 0644") && err.contains("chmod 600"),
        "{err}"
    );
    // A token from the environment instead of a file.
    let o = Command::new(env!("CARGO_BIN_EXE_rfaasctl"))
        .env("RFAAS_MANAGERS", m.url())
        .env("RFAASCTL_TEST_TOKEN", m.admin_token())
        .args(["--token-env", "RFAASCTL_TEST_TOKEN", "credentials"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).starts_with("ID "), "{}", stdout(&o));
}

#[test]
fn unreachable_managers_are_named_and_the_next_is_tried() {
    let (m, admin) = started();
    register(&m, "n1", 2, 1024);
    // Nothing listens on port 1 of the loopback.
    let dead = "http://127.0.0.1:1";
    let o = rfaasctl(dead, &admin.file(), &["nodes"]);
    assert_eq!(o.status.code(), Some(1));
    let err = stderr(&o);
    assert!(
        err.contains("no manager answered") && err.contains(dead),
        "{err}"
    );
    // With a live one after it, the live one answers.
    let both = format!("{dead},{}", m.url());
    let o = rfaasctl(&both, &admin.file(), &["nodes"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("n1"), "{}", stdout(&o));
}

#[test]
fn usage_errors_exit_2() {
    let (m, admin) = started();
    for args in [
        &["credential", "user", "alice", "--ttl", "3x"][..],
        &["release", "not-a-number"],
        &["frobnicate"],
    ] {
        let o = rfaasctl(m.url(), &admin.file(), args);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", stderr(&o));
    }
    let o = rfaasctl("m1:7300", &admin.file(), &["nodes"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("https://host:port"), "{}", stderr(&o));
    // The manager refusing a request is not a usage error.
    let o = rfaasctl(m.url(), &admin.file(), &["credential", "user", "bad name"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("(malformed_request)"), "{}", stderr(&o));
}

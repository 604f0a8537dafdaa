//! One configuration directory: `rfaas-manager` and `rfaasctl` find
//! their files in it when `RFAAS_CONFIG_DIR` or `--config-dir` moves it,
//! and a file they cannot read is reported with what moves it.

use std::io::{BufRead, BufReader};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};

use rfaas_testkit::manager::write_lease_key;
use rfaas_testkit::{output_text, TempDir};

/// A manager started with nothing but its configuration directory, ended
/// on drop.
struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `program` with neither the configuration directory's variable nor the
/// admin token's from the test's own environment.
fn command(program: &str) -> Command {
    let mut cmd = Command::new(program);
    cmd.env_remove("RFAAS_CONFIG_DIR")
        .env_remove("RFAAS_ADMIN_TOKEN_FILE")
        .env_remove("RFAAS_MANAGERS");
    cmd
}

/// Starts rfaas-manager with `cmd`; its URL, once it listens.
fn start(mut cmd: Command) -> (Running, String) {
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let running = Running(child);
    let addr = line
        .trim()
        .strip_prefix("rfaas-manager listening on ")
        .unwrap_or_else(|| panic!("no listening line: {line:?}"))
        .to_owned();
    (running, format!("http://{addr}"))
}

/// A configuration directory a manager runs from: manager.toml names
/// neither the admin token nor the lease key, which are found beside it.
fn manager_dir(name: &str) -> TempDir {
    let dir = TempDir::new(name);
    let db = dir.join("manager.db");
    std::fs::write(
        dir.join("manager.toml"),
        format!(
            "listen = \"127.0.0.1:0\"\ndatabase = \"sqlite://{}\"\n",
            db.display()
        ),
    )
    .unwrap();
    let token = dir.join("admin.token");
    std::fs::write(&token, "a-test-admin-token-of-some-length\n").unwrap();
    std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o600)).unwrap();
    write_lease_key(&dir.join("lease-key.secret")).unwrap();
    dir
}

fn rfaasctl_nodes(url: &str, dir_by: impl FnOnce(&mut Command)) -> Output {
    let mut cmd = command(env!("CARGO_BIN_EXE_rfaasctl"));
    cmd.args(["--manager", url, "nodes"]);
    dir_by(&mut cmd);
    cmd.output().unwrap()
}

#[test]
fn the_manager_and_rfaasctl_find_their_files_in_the_directory_named() {
    let dir = manager_dir("found");
    // By the variable.
    let mut cmd = command(env!("CARGO_BIN_EXE_rfaas-manager"));
    cmd.env("RFAAS_CONFIG_DIR", dir.path());
    let (manager, url) = start(cmd);
    let o = rfaasctl_nodes(&url, |c| {
        c.env("RFAAS_CONFIG_DIR", dir.path());
    });
    assert!(o.status.success(), "{}", output_text(&o));
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("NAME"),
        "{}",
        output_text(&o)
    );
    // By the flag, which beats the variable.
    let o = rfaasctl_nodes(&url, |c| {
        c.env("RFAAS_CONFIG_DIR", "/nonexistent")
            .arg("--config-dir")
            .arg(dir.path());
    });
    assert!(o.status.success(), "{}", output_text(&o));
    drop(manager);
    let mut cmd = command(env!("CARGO_BIN_EXE_rfaas-manager"));
    cmd.arg("--config-dir").arg(dir.path());
    let (_manager, url) = start(cmd);
    let o = rfaasctl_nodes(&url, |c| {
        c.arg("--config-dir").arg(dir.path());
    });
    assert!(o.status.success(), "{}", output_text(&o));
}

#[test]
fn what_cannot_be_read_names_what_moves_it() {
    let empty = TempDir::new("empty");
    // rfaasctl without a token: the message names each way to another.
    let o = rfaasctl_nodes("http://127.0.0.1:9", |c| {
        c.env("RFAAS_CONFIG_DIR", empty.path());
    });
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    let file = empty.join("admin.token");
    for words in [
        &format!("cannot read the admin token file {}", file.display()),
        "--token-file",
        "RFAAS_ADMIN_TOKEN_FILE",
        &format!(
            "the configuration directory {} was set by RFAAS_CONFIG_DIR",
            empty.path().display()
        ),
    ] {
        assert!(err.contains(words), "{words:?} missing: {err}");
    }
    // The default directory: how to move it.
    let o = command(env!("CARGO_BIN_EXE_rfaasctl"))
        .args(["--manager", "http://127.0.0.1:9", "--token-file"])
        .arg(empty.join("none"))
        .arg("nodes")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("--config-dir or RFAAS_CONFIG_DIR"), "{err}");

    // rfaas-manager with a directory that has no keys.
    let o = command(env!("CARGO_BIN_EXE_rfaas-manager"))
        .arg("--config-dir")
        .arg(empty.path())
        .arg("--database")
        .arg(format!("sqlite://{}", empty.join("m.db").display()))
        .output()
        .unwrap();
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    for words in [
        &format!("cannot read the admin token file {}", file.display()),
        "--admin-token-file",
        "admin_token_file in manager.toml",
        &format!(
            "the configuration directory {} was set by --config-dir",
            empty.path().display()
        ),
    ] {
        assert!(err.contains(words), "{words:?} missing: {err}");
    }
    // A configuration file named but missing.
    let o = command(env!("CARGO_BIN_EXE_rfaas-manager"))
        .arg("--config")
        .arg(empty.join("missing.toml"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("missing.toml") && err.contains("--config"),
        "{err}"
    );
}

#[test]
fn an_unreadable_file_in_the_directory_is_an_error_not_a_default() {
    let dir = manager_dir("unreadable");
    // A directory where manager.toml should be: not "no file".
    std::fs::remove_file(dir.join("manager.toml")).unwrap();
    std::fs::create_dir(dir.join("manager.toml")).unwrap();
    let o = command(env!("CARGO_BIN_EXE_rfaas-manager"))
        .env("RFAAS_CONFIG_DIR", dir.path())
        .output()
        .unwrap();
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    let path: &Path = &dir.join("manager.toml");
    assert!(
        err.contains(&format!(
            "cannot read the configuration file {}",
            path.display()
        )),
        "{err}"
    );
    assert!(err.contains("RFAAS_CONFIG_DIR"), "{err}");
}

#[test]
fn the_database_password_comes_from_its_own_file() {
    let pg = rfaas_testkit::postgres::Postgres::start().unwrap_or_else(|e| panic!("{e}"));
    let url = url_without_password(pg.url());
    let dir = manager_dir("password");
    std::fs::write(
        dir.join("manager.toml"),
        format!("listen = \"127.0.0.1:0\"\ndatabase = \"{url}\"\n"),
    )
    .unwrap();
    // Without the file, PostgreSQL refuses the manager.
    let o = command(env!("CARGO_BIN_EXE_rfaas-manager"))
        .env("RFAAS_CONFIG_DIR", dir.path())
        .output()
        .unwrap();
    assert!(!o.status.success(), "{}", output_text(&o));
    // A password file others may read is refused, naming it.
    let file = dir.join("database.password");
    let password = pg
        .url()
        .split(':')
        .nth(2)
        .unwrap()
        .split('@')
        .next()
        .unwrap();
    std::fs::write(&file, format!("{password}\n")).unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
    let o = command(env!("CARGO_BIN_EXE_rfaas-manager"))
        .env("RFAAS_CONFIG_DIR", dir.path())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{}", output_text(&o));
    assert!(
        err.contains(&format!(
            "the database password file {} has mode 0644",
            file.display()
        )),
        "{err}"
    );
    assert!(
        !err.contains(password),
        "the password is not printed: {err}"
    );
    // Private: the manager and rfaas-billing both connect with it.
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
    let mut cmd = command(env!("CARGO_BIN_EXE_rfaas-manager"));
    cmd.env("RFAAS_CONFIG_DIR", dir.path());
    let (_manager, url) = start(cmd);
    let o = rfaasctl_nodes(&url, |c| {
        c.env("RFAAS_CONFIG_DIR", dir.path());
    });
    assert!(o.status.success(), "{}", output_text(&o));
    let o = command(
        rfaas_testkit::accounting::billing_binary()
            .to_str()
            .unwrap(),
    )
    .env("RFAAS_CONFIG_DIR", dir.path())
    .args(["budget", "list"])
    .output()
    .unwrap();
    assert!(o.status.success(), "{}", output_text(&o));
}

/// `postgres://user:password@host/db` without its password.
fn url_without_password(url: &str) -> String {
    let (scheme, rest) = url.split_once("://").unwrap();
    let (auth, host) = rest.split_once('@').unwrap();
    let user = auth.split(':').next().unwrap();
    format!("{scheme}://{user}@{host}")
}

//! One configuration directory: `rfaas-token` writes and reads its key
//! files there, `rfaas-executord` finds `executord.toml` and the lease keys
//! there, when `RFAAS_CONFIG_DIR` or `--config-dir` moves it; a file they
//! cannot read is reported with what moves it.

use std::io::{BufRead, BufReader};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use rfaas_testkit::{output_text, TempDir};

fn command(program: &str) -> Command {
    let mut cmd = Command::new(program);
    cmd.env_remove("RFAAS_CONFIG_DIR");
    cmd
}

fn token(args: &[&str], dir_by: impl FnOnce(&mut Command)) -> Output {
    let mut cmd = command(env!("CARGO_BIN_EXE_rfaas-token"));
    dir_by(&mut cmd);
    cmd.args(args).output().unwrap()
}

#[test]
fn rfaas_token_keeps_its_keys_in_the_configuration_directory() {
    let dir = TempDir::new("token");
    let o = token(&["keygen", "--key-id", "site-1"], |c| {
        c.arg("--config-dir").arg(dir.path());
    });
    assert!(o.status.success(), "{}", output_text(&o));
    assert!(dir.join("lease-key.secret").exists());
    assert!(dir.join("lease-keys.pub").exists());
    let mint = [
        "mint",
        "--node",
        "n1",
        "--user",
        "nobody",
        "--account",
        "a",
        "--cores",
        "1",
        "--memory-mib",
        "64",
        "--ttl-secs",
        "60",
    ];
    let o = token(&mint, |c| {
        c.env("RFAAS_CONFIG_DIR", dir.path());
    });
    assert!(o.status.success(), "{}", output_text(&o));
    let minted = String::from_utf8_lossy(&o.stdout).trim().to_owned();
    let o = token(&["verify", "--node", "n1", &minted], |c| {
        c.env("RFAAS_CONFIG_DIR", dir.path());
    });
    assert!(o.status.success(), "{}", output_text(&o));
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("\"site-1\""),
        "{}",
        output_text(&o)
    );

    // Elsewhere, nothing to read: the message says what moves it.
    let empty = TempDir::new("token-empty");
    let o = token(&mint, |c| {
        c.env("RFAAS_CONFIG_DIR", empty.path());
    });
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains(&empty.join("lease-key.secret").display().to_string()),
        "{err}"
    );
    assert!(err.contains("--key"), "{err}");
    assert!(
        err.contains(&format!(
            "the configuration directory {} was set by RFAAS_CONFIG_DIR",
            empty.path().display()
        )),
        "{err}"
    );
}

#[test]
fn executord_reads_executord_toml_and_the_lease_keys_from_the_directory() {
    let dir = TempDir::new("daemon");
    let o = token(&["keygen", "--key-id", "site-1"], |c| {
        c.arg("--config-dir").arg(dir.path());
    });
    assert!(o.status.success(), "{}", output_text(&o));
    let socket = dir.join("executord.sock");
    std::fs::write(
        dir.join("executord.toml"),
        format!(
            "node_name = \"n1\"\ncontrol_listen = \"127.0.0.1:0\"\ncpus = \"0\"\nmemory_mib = 256\n\
             pool_size = 0\nlocal_socket = {:?}\nruntime_dir = {:?}\n",
            socket.display().to_string(),
            dir.join("run").display().to_string()
        ),
    )
    .unwrap();
    let mut child = command(env!("CARGO_BIN_EXE_rfaas-executord"))
        .env("RFAAS_CONFIG_DIR", dir.path())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        let _ = BufReader::new(stdout).read_line(&mut line);
        let _ = tx.send(line);
    });
    let line = rx.recv_timeout(Duration::from_secs(30)).unwrap_or_default();
    let _ = child.kill();
    let _ = child.wait();
    assert!(line.starts_with("rfaas-executord ready"), "{line:?}");
    assert!(
        line.trim_end()
            .ends_with(&format!("local={}", socket.display())),
        "the socket executord.toml names: {line:?}"
    );

    // Another directory, without keys: the message says what moves them.
    let empty = TempDir::new("daemon-empty");
    let o = command(env!("CARGO_BIN_EXE_rfaas-executord"))
        .arg("--config-dir")
        .arg(empty.path())
        .args([
            "--control-listen",
            "127.0.0.1:0",
            "--cpus",
            "0",
            "--memory-mib",
            "64",
        ])
        .arg("--local-socket")
        .arg(empty.join("s.sock"))
        .output()
        .unwrap();
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    for words in [
        &format!(
            "cannot read the public key file {}",
            empty.join("lease-keys.pub").display()
        ),
        "--lease-keys",
        "lease_keys in executord.toml",
        &format!(
            "the configuration directory {} was set by --config-dir",
            empty.path().display()
        ),
    ] {
        assert!(err.contains(words), "{words:?} missing: {err}");
    }
}

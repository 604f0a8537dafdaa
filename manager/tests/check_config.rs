//! `rfaas-manager --check-config`: every setting with its source, the
//! files' problems, the verdict, and no database opened.

use std::os::unix::fs::PermissionsExt;
use std::process::Command;

use rfaas_testkit::TempDir;

fn check(dir: &std::path::Path, extra: &[&str]) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_rfaas-manager"))
        .arg("--check-config")
        .arg("--config-dir")
        .arg(dir)
        .args(extra)
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.code().unwrap_or(-1), text)
}

#[test]
fn check_config_prints_sources_and_refuses_unusable_files() {
    let dir = TempDir::new("manager-check");
    let db = dir.join("never.db");
    std::fs::write(
        dir.join("manager.toml"),
        format!(
            "database = \"sqlite://{}\"\nmax_lease_s = 600\n",
            db.display()
        ),
    )
    .unwrap();
    let (code, text) = check(dir.path(), &["--listen", "127.0.0.1:7399"]);
    assert_eq!(code, 1, "{text}");
    assert!(
        text.contains("admin.token") && text.contains("lease-key.secret"),
        "{text}"
    );
    assert!(
        text.ends_with("rfaas-manager: it would not start (2 problems)\n"),
        "{text}"
    );

    let token = dir.join("admin.token");
    std::fs::write(&token, "a-long-enough-admin-token-for-the-check\n").unwrap();
    std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o600)).unwrap();
    rfaas_testkit::manager::write_lease_key(&dir.join("lease-key.secret")).unwrap();
    let (code, text) = check(dir.path(), &["--listen", "127.0.0.1:7399"]);
    assert_eq!(code, 0, "{text}");
    for line in [
        "listen                          = \"127.0.0.1:7399\"  (flag)",
        "max_lease_s                     = 600  (file)",
        "heartbeat_interval_ms           = 1000  (default)",
        "rfaas-manager: the configuration is usable; it would start",
    ] {
        assert!(text.contains(line), "{line:?} not in:\n{text}");
    }
    assert!(!db.exists(), "--check-config opened the database");

    // An unusable value is a reason too, said as the daemon says it.
    let (code, text) = check(dir.path(), &["--listen", "0.0.0.0:7399"]);
    assert_eq!(code, 1, "{text}");
    assert!(text.contains("in clear"), "{text}");
}

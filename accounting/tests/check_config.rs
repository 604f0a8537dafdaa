//! `rfaas-accounting --check-config`: every setting with its source, the
//! files' problems, the verdict; no database opened, no region made.

use std::process::Command;

use rfaas_testkit::TempDir;

fn check(dir: &std::path::Path) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_rfaas-accounting"))
        .arg("--check-config")
        .arg("--config-dir")
        .arg(dir)
        .args(["--name", "acct-check"])
        .output()
        .unwrap();
    // stdout: the report; stderr: the warnings the daemon would log.
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

#[test]
fn check_config_prints_sources_and_refuses_unusable_files() {
    let dir = TempDir::new("accounting-check");
    let (db, region) = (dir.join("never.db"), dir.join("never.region"));
    std::fs::write(
        dir.join("accounting.toml"),
        format!(
            "database = \"sqlite://{}\"\nregion_file = {:?}\nslots = 64\n",
            db.display(),
            region.display().to_string()
        ),
    )
    .unwrap();
    let (code, text) = check(dir.path());
    assert_eq!(code, 1, "{text}");
    assert!(text.contains("lease-keys.pub"), "{text}");
    assert!(
        text.ends_with("rfaas-accounting: it would not start (1 problem)\n"),
        "{text}"
    );

    let key = dir.join("lease-key.secret");
    rfaas_testkit::manager::write_lease_key(&key).unwrap();
    let public = rfaas_testkit::manager::public_key_line(&key).unwrap();
    std::fs::write(dir.join("lease-keys.pub"), public + "\n").unwrap();
    let (code, text) = check(dir.path());
    assert_eq!(code, 0, "{text}");
    for line in [
        "name                 = \"acct-check\"  (flag)",
        "slots                = 64  (file)",
        "flush_interval_ms    = 1000  (default)",
        "rfaas-accounting: the configuration is usable; it would start",
    ] {
        assert!(text.contains(line), "{line:?} not in:\n{text}");
    }
    assert!(
        !db.exists() && !region.exists(),
        "--check-config made files"
    );
}

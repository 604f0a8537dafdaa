//! A configuration with none of the site's values (no node name, fabric
//! address, CPUs or memory): `--check-config` says what the host supplies
//! and starts nothing, and the daemon registers with a real manager under
//! the host's name with the host's CPUs and memory.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use rfaas_executor::daemon::config::DEFAULT_RESERVE_MEMORY_MIB;
use rfaas_executor::daemon::host::{parse_slurmd_c, short_name};
use rfaas_testkit::manager::{Manager, ManagerOptions};
use rfaas_testkit::wait::poll_for;

const EXECUTORD: &str = env!("CARGO_BIN_EXE_rfaas-executord");

/// What this host is, found here independently of the daemon: slurmd -C
/// (name, CPUs, RealMemory) when slurmd is installed, else the short host
/// name, the online CPUs and MemTotal; and which source names it.
fn this_host() -> (String, u32, u64, &'static str) {
    if let Ok(out) = Command::new("slurmd").arg("-C").output() {
        let node = parse_slurmd_c(&String::from_utf8_lossy(&out.stdout)).unwrap();
        return (
            node.name,
            node.cpus,
            node.real_memory_mib,
            "discovered: slurmd -C",
        );
    }
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap();
    let cpus = std::thread::available_parallelism().unwrap().get() as u32;
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap();
    let kib: u64 = meminfo
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    (
        short_name(host.trim()).to_owned(),
        cpus,
        kib / 1024,
        "discovered: hostname",
    )
}

fn scratch() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("rfaas-host-defaults-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    dir
}

fn write(path: &Path, text: &str, mode: u32) {
    std::fs::write(path, text).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
}

fn check_config(dir: &Path) -> (bool, String) {
    let out = Command::new(EXECUTORD)
        .args(["--check-config", "--config-dir"])
        .arg(dir)
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(matches!(out.status.code(), Some(0 | 1)), "{text}");
    (out.status.success(), text)
}

#[test]
fn a_file_without_site_values_registers_the_host_as_it_is() {
    let (name, cpus, memory, source) = this_host();
    let m = Manager::start(ManagerOptions::default());
    let dir = scratch();
    write(&dir.join("lease-keys.pub"), &m.public_key_line(), 0o644);
    let socket = dir.join("executord.sock");
    write(
        &dir.join("executord.toml"),
        &format!(
            "control_listen = \"127.0.0.1:0\"\nlocal_socket = {:?}\nruntime_dir = {:?}\n\
             pool_size = 0\n[manager]\nurls = [{:?}]\n",
            socket.display().to_string(),
            dir.join("run").display().to_string(),
            m.url()
        ),
        0o644,
    );

    // Without the node credential it would not start, and says why.
    let (ok, text) = check_config(&dir);
    assert!(!ok, "{text}");
    assert!(
        text.contains("node.credential") && text.contains("it would not start (1 problem)"),
        "{text}"
    );
    let credential = dir.join("node.credential");
    write(&credential, &m.credential("node", &name, None), 0o644);
    let (ok, text) = check_config(&dir);
    assert!(!ok && text.contains("chmod 600"), "{text}");

    std::fs::set_permissions(&credential, std::fs::Permissions::from_mode(0o600)).unwrap();
    let (ok, text) = check_config(&dir);
    assert!(ok, "{text}");
    let lent = memory - u64::from(DEFAULT_RESERVE_MEMORY_MIB);
    for line in [
        format!("= {name:?}  ({source})"),
        format!("= {lent}  ({source}"),
        "fabric_host                 = \"127.0.0.1\"  (discovered: route)".to_owned(),
        "control_listen              = \"127.0.0.1:0\"  (file)".to_owned(),
        "pool_size                   = 0  (file)".to_owned(),
        "max_lanes                   = 64  (default)".to_owned(),
        "rfaas-executord: the configuration is usable; it would start".to_owned(),
    ] {
        assert!(text.contains(&line), "{line:?} not in:\n{text}");
    }
    assert!(!socket.exists(), "--check-config made the local socket");
    assert!(
        !dir.join("run").exists(),
        "--check-config made the runtime dir"
    );

    let mut cmd = Command::new(EXECUTORD);
    cmd.arg("--config-dir").arg(&dir);
    let (mut child, _) = rfaas_testkit::process::spawn_ready(
        cmd,
        &dir.join("executord.log"),
        "rfaas-executord ready control=",
    )
    .unwrap();
    let admin = m.admin();
    let node = poll_for(Duration::from_secs(60), || {
        let (_, n) = admin.call("GET", &format!("/v1/nodes/{name}"), None);
        (n["state"] == "up").then_some(n)
    });
    rfaas_testkit::process::stop(&mut child, rfaas_testkit::process::STOP_GRACE);
    let log = std::fs::read_to_string(dir.join("executord.log")).unwrap_or_default();
    let node = node.unwrap_or_else(|| panic!("{name} never registered:\n{log}"));
    assert_eq!(node["cores"], u64::from(cpus), "{node}");
    assert_eq!(node["memory_mib"], lent, "{node}");
    assert!(log.contains(&format!("node_source={source}")), "{log}");
    std::fs::remove_dir_all(&dir).unwrap();
}

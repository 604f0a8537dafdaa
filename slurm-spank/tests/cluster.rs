//! The plugin and the hook on a real Slurm cluster (Debian's Slurm 22.05,
//! or 24.11 under `scripts/test-slurm-releases.sh`; several slurmd on
//! loopback, started by `scripts/slurm-cluster.sh`), with
//! the plugin installed through `plugstack.conf` and the hook as slurmd's
//! `Prolog=` and `Epilog=`.
//!
//! With a real executor daemon on the node, a job takes the node back and
//! its end offers it again; with the daemon's `[slurm]` table, only the
//! job's own CPUs, and what no prolog or epilog said is made up for from
//! `scontrol`. With none (or one that never answers), every
//! job must still start and complete, no node may be drained, and the logs
//! must say why rfaas was left out. Slurm must be installed
//! (`scripts/test.sh` installs it), the tests run as root, and
//! `rfaas-executord` must be built (`cargo nextest run --workspace` does).

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use rfaas_client::{Allocation, AllocationSpec, Client, ClientOptions};
use rfaas_proto::control::local::{LocalReply, LocalRequest};
use rfaas_testkit::accounting::{billing_binary, Accounting, AccountingOptions};
use rfaas_testkit::executord::{daemon_binary, Executord, ExecutordOptions};
use rfaas_testkit::functions::{c_library_bytes, client_example, rust_library};
use rfaas_testkit::manager::{Api, Manager, ManagerOptions};
use rfaas_testkit::slurm::{spank_plugin, SlurmCluster, SlurmOptions};
use rfaas_testkit::wait::{poll_for, wait_for};
use serde_json::json;

const HOOK: &str = env!("CARGO_BIN_EXE_rfaas-slurm-hook");

/// Jobs here take well under a second; this bounds a hung cluster.
const JOB_BOUND: Duration = Duration::from_secs(120);

/// A directory of the test's own, removed when it passes.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> TempDir {
        let dir =
            std::env::temp_dir().join(format!("rfaas-spank-test-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }

    fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

/// The plugin (testkit's [`spank_plugin`]), installed under the name
/// sites use: `rfaas_spank.so`.
fn install_plugin(dir: &TempDir) -> PathBuf {
    let built = spank_plugin().unwrap_or_else(|e| panic!("{e}"));
    let installed = dir.path("rfaas_spank.so");
    std::fs::copy(&built, &installed).unwrap();
    installed
}

/// A plugstack.conf that loads the plugin with `args` (`required`: a
/// plugin that does not load fails the jobs, so the test sees it).
fn plugstack(dir: &TempDir, args: &str) -> PathBuf {
    let plugin = install_plugin(dir);
    let conf = dir.path("plugstack.conf");
    std::fs::write(&conf, format!("required {} {args}\n", plugin.display())).unwrap();
    conf
}

fn start(opts: SlurmOptions) -> SlurmCluster {
    SlurmCluster::start(opts).unwrap_or_else(|e| panic!("{e}"))
}

/// Waits until every node is idle again (its epilog done) and checks that
/// none is drained or down.
fn nodes_idle_and_undrained(cluster: &SlurmCluster) {
    let mut last = BTreeMap::new();
    poll_for(JOB_BOUND, || {
        last = cluster.node_states().unwrap();
        for (node, state) in &last {
            assert!(
                !state.contains("drain") && !state.contains("down") && !state.contains("fail"),
                "{node} is {state}; its fields: {:?}\n{}",
                cluster.node(node),
                cluster.slurmd_logs()
            );
        }
        (last.len() == cluster.nodes().len() && last.values().all(|s| s == "idle")).then_some(())
    })
    .unwrap_or_else(|| panic!("nodes not idle after {JOB_BOUND:?}: {last:?}"));
}

#[test]
fn the_cluster_runs_a_three_node_job() {
    let cluster = start(SlurmOptions::default());
    let out = cluster
        .srun(&["-N3", "-l", "printenv", "SLURMD_NODENAME"])
        .unwrap();
    let mut nodes: Vec<&str> = out
        .lines()
        .filter_map(|l| l.split_once(": "))
        .map(|(_, n)| n.trim())
        .collect();
    nodes.sort();
    assert_eq!(nodes, ["node1", "node2", "node3"], "{out}");
    let states = cluster.node_states().unwrap();
    assert_eq!(states.len(), 3, "{states:?}");
    nodes_idle_and_undrained(&cluster);
}

#[test]
fn srun_help_lists_rfaas() {
    let dir = TempDir::new("help");
    let cluster = start(SlurmOptions {
        nodes: 1,
        plugstack: Some(plugstack(&dir, "")),
        ..SlurmOptions::default()
    });
    let help = cluster.output("srun", &["--help"]).unwrap();
    let text = String::from_utf8_lossy(&help.stdout);
    assert!(text.contains("--rfaas=yes|no"), "{text}");
    let help = cluster.output("sbatch", &["--help"]).unwrap();
    let text = String::from_utf8_lossy(&help.stdout);
    assert!(text.contains("--rfaas=yes|no"), "{text}");
    // A wrong value is the user's to fix, at submission.
    let out = cluster
        .output("srun", &["-N1", "--rfaas=maybe", "true"])
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--rfaas=maybe: write --rfaas"), "{err}");
}

#[test]
fn a_bad_plugstack_argument_is_logged_and_jobs_still_run() {
    let dir = TempDir::new("badarg");
    let socket = dir.path("no-daemon.sock");
    let cluster = start(SlurmOptions {
        nodes: 1,
        plugstack: Some(plugstack(
            &dir,
            &format!("colour=blue grace=soon socket={}", socket.display()),
        )),
        ..SlurmOptions::default()
    });
    let out = cluster.srun(&["-N1", "echo", "ran"]).unwrap();
    assert_eq!(out.trim(), "ran");
    nodes_idle_and_undrained(&cluster);
    let log = cluster.slurmd_log("node1");
    assert!(
        log.contains(r#"rfaas_spank: ignored argument "colour=blue": unknown key "colour""#),
        "{log}"
    );
    assert!(
        log.contains(r#"rfaas_spank: ignored argument "grace=soon""#),
        "{log}"
    );
}

#[test]
fn without_an_executor_daemon_rfaas_jobs_start_and_no_node_drains() {
    let dir = TempDir::new("nodaemon");
    let socket = dir.path("no-daemon.sock");
    // A grace far beyond PrologEpilogTimeout (120 s): a prolog that waited
    // for it would be killed and its node drained.
    let cluster = start(SlurmOptions {
        plugstack: Some(plugstack(
            &dir,
            &format!("grace=600 socket={}", socket.display()),
        )),
        ..SlurmOptions::default()
    });
    let out = cluster
        .output(
            "srun",
            &["-N2", "--rfaas", "-l", "printenv", "SLURMD_NODENAME"],
        )
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(text.lines().count(), 2, "{text}");
    // The step asked for rfaas and got none: its stderr says why, once per
    // node, in one line each.
    let err = String::from_utf8_lossy(&out.stderr);
    let why: Vec<&str> = err
        .lines()
        .filter(|l| l.contains("no rfaas environment"))
        .collect();
    assert_eq!(why.len(), 2, "{err}");
    for line in &why {
        assert!(line.contains("no executor daemon socket"), "{line}");
        assert!(line.contains("the job runs without rfaas"), "{line}");
    }
    let job = cluster
        .sbatch(&["-N3", "--rfaas", "--wrap", "srun true"])
        .unwrap();
    let state = cluster
        .wait_job_state(
            job,
            &["COMPLETED", "FAILED", "CANCELLED", "NODE_FAIL"],
            JOB_BOUND,
        )
        .unwrap();
    assert_eq!(state, "COMPLETED", "{:?}", cluster.job(job));
    nodes_idle_and_undrained(&cluster);

    for node in cluster.nodes() {
        let log = cluster.slurmd_log(&node);
        assert!(
            log.contains(&format!("rfaas_spank: job {job} asks for rfaas")),
            "{node}: {log}"
        );
        let took_back = format!("rfaas_spank: job {job} on {node}: could not take");
        let line = log
            .lines()
            .find(|l| l.contains(&took_back))
            .unwrap_or_else(|| panic!("no prolog line for job {job} in {node}'s log:\n{log}"));
        assert!(line.contains("no executor daemon socket"), "{line}");
        assert!(line.contains("the job starts anyway (fail open)"), "{line}");
        assert!(
            log.contains(&format!(
                "rfaas_spank: job {job} on {node}: could not offer the idle CPUs to rfaas"
            )),
            "{node}: {log}"
        );
    }
    // The plain srun's steps said why in slurmd's log too.
    let logs = cluster.slurmd_logs();
    assert!(
        logs.lines()
            .filter(
                |l| l.contains("no rfaas environment") && l.contains("no executor daemon socket")
            )
            .count()
            >= 2,
        "{logs}"
    );
}

#[test]
fn a_job_takes_the_node_back_from_the_executor_and_its_end_offers_it() {
    let dir = TempDir::new("executord");
    let d = Executord::start(
        &daemon_binary(),
        ExecutordOptions {
            node_name: "node1".into(),
            ..ExecutordOptions::default()
        },
    );
    let cluster = start(SlurmOptions {
        nodes: 1,
        plugstack: Some(plugstack(
            &dir,
            &format!("grace=5 socket={}", d.local_socket().display()),
        )),
        ..SlurmOptions::default()
    });
    let job = cluster
        .sbatch(&["-N1", "--rfaas", "--wrap", "true"])
        .unwrap();
    let state = cluster
        .wait_job_state(
            job,
            &["COMPLETED", "FAILED", "CANCELLED", "NODE_FAIL"],
            JOB_BOUND,
        )
        .unwrap();
    assert_eq!(state, "COMPLETED", "{:?}", cluster.job(job));
    nodes_idle_and_undrained(&cluster);

    let log = cluster.slurmd_log("node1");
    assert!(
        log.contains(&format!(
            "rfaas_spank: job {job} on node1: take 1 CPU back from rfaas: taken back for Slurm job {job}: drained"
        )),
        "{log}\nexecutord:\n{}",
        d.log()
    );
    assert!(
        log.contains(&format!(
            "rfaas_spank: job {job} on node1: offer the idle CPUs to rfaas: Slurm job {job} ended: taking allocations again"
        )),
        "{log}\nexecutord:\n{}",
        d.log()
    );
    let LocalReply::Status { draining, .. } = d.status() else {
        panic!("no status")
    };
    assert!(!draining, "offered again after the job");
}

#[test]
fn a_daemon_that_never_answers_costs_the_bound_and_the_job_runs() {
    let dir = TempDir::new("silent");
    let socket = dir.path("silent.sock");
    // Accepts, reads nothing, answers nothing: a hung executor daemon.
    let listener = UnixListener::bind(&socket).unwrap();
    let cluster = start(SlurmOptions {
        nodes: 1,
        plugstack: Some(plugstack(
            &dir,
            &format!("grace=0 timeout_ms=300 socket={}", socket.display()),
        )),
        ..SlurmOptions::default()
    });
    let out = cluster.srun(&["-N1", "echo", "ran"]).unwrap();
    assert_eq!(out.trim(), "ran");
    nodes_idle_and_undrained(&cluster);
    let log = cluster.slurmd_log("node1");
    assert!(log.contains("did not answer within 300ms"), "{log}");
    assert!(log.contains("the job starts anyway (fail open)"), "{log}");
    drop(listener);
}

/// A Prolog=/Epilog= program is given no arguments: the hook finds its
/// settings next to slurm.conf.
fn write_hook_conf(cluster: &SlurmCluster, words: &str) {
    let conf = cluster
        .conf()
        .parent()
        .unwrap()
        .join("rfaas-slurm-hook.conf");
    std::fs::write(conf, format!("# rfaas-slurm-hook\n{words}\n")).unwrap();
}

#[test]
fn the_hook_as_prolog_and_epilog_fails_open() {
    let dir = TempDir::new("hook");
    let log_file = dir.path("hook.log");
    let cluster = start(SlurmOptions {
        prolog: Some(PathBuf::from(HOOK)),
        epilog: Some(PathBuf::from(HOOK)),
        ..SlurmOptions::default()
    });
    write_hook_conf(
        &cluster,
        &format!(
            "grace=600 socket={} log={} colour=blue",
            dir.path("no-daemon.sock").display(),
            log_file.display()
        ),
    );
    let out = cluster.srun(&["-N3", "-l", "true"]).unwrap();
    assert!(out.is_empty(), "{out}");
    let job = cluster.sbatch(&["-N2", "--wrap", "srun true"]).unwrap();
    let state = cluster
        .wait_job_state(
            job,
            &["COMPLETED", "FAILED", "CANCELLED", "NODE_FAIL"],
            JOB_BOUND,
        )
        .unwrap();
    assert_eq!(state, "COMPLETED", "{:?}", cluster.job(job));
    nodes_idle_and_undrained(&cluster);

    let log = std::fs::read_to_string(&log_file).unwrap_or_default();
    assert!(log.contains(r#"ignored argument "colour=blue""#), "{log}");
    for what in ["could not take", "could not offer"] {
        let lines: Vec<&str> = log
            .lines()
            .filter(|l| l.contains(&format!("job {job} on node")) && l.contains(what))
            .collect();
        assert_eq!(
            lines.len(),
            2,
            "one {what:?} line per node of job {job}:\n{log}"
        );
        assert!(
            lines[0].contains("no executor daemon socket"),
            "{}",
            lines[0]
        );
    }
}

#[test]
fn the_hook_reads_its_mode_and_exits_zero_by_hand() {
    let dir = TempDir::new("byhand");
    let out = std::process::Command::new(HOOK)
        .args(["bogus", "timeout_ms=x"])
        .env_remove("SLURM_SCRIPT_CONTEXT")
        .env("SLURM_CONF", dir.path("slurm.conf"))
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(r#"ignored argument "bogus""#), "{err}");
    assert!(err.contains(r#"ignored argument "timeout_ms=x""#), "{err}");
    assert!(err.contains("neither prolog nor epilog"), "{err}");

    let out = std::process::Command::new(HOOK)
        .arg("--config")
        .arg(dir.path("missing.conf"))
        .arg(format!("socket={}", dir.path("none.sock").display()))
        .env("SLURM_SCRIPT_CONTEXT", "prolog_slurmd")
        .env("SLURM_JOB_ID", "77")
        .env("SLURMD_NODENAME", "node4")
        .env("SLURM_JOB_CPUS_PER_NODE", "2")
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("cannot read"), "{err}");
    assert!(
        err.contains(
            "job 77 on node4: could not take 2 CPUs back from rfaas: no executor daemon socket"
        ),
        "{err}"
    );
    assert!(!Path::new(&dir.path("none.sock")).exists());
}

/// A manager, and on each Slurm node an executor daemon registered with
/// it, whose socket the plugin finds through `socket=...-%n.sock`.
/// With `billing`, an accounting service too, which every daemon posts
/// usage to.
struct RfaasOnSlurm {
    executords: Vec<Executord>,
    cluster: SlurmCluster,
    accounting: Option<Accounting>,
    manager: Manager,
}

impl RfaasOnSlurm {
    fn start(dir: &TempDir, nodes: u32, plugin_args: &str, billing: bool) -> RfaasOnSlurm {
        let socket = |node: &str| dir.path(&format!("executord-{node}.sock"));
        let cluster = start(SlurmOptions {
            nodes,
            plugstack: Some(plugstack(
                dir,
                &format!(
                    "socket={} log={} {plugin_args}",
                    socket("%n").display(),
                    dir.path("spank.log").display()
                ),
            )),
            ..SlurmOptions::default()
        });
        // The manager asks this cluster about the jobs the nodes speak for.
        let mut opts = ManagerOptions::default();
        opts.extra_config += &format!(
            "[slurm]\nconf = {:?}\n",
            cluster.conf().display().to_string()
        );
        let manager = Manager::start(opts);
        let accounting =
            billing.then(|| Accounting::start(AccountingOptions::for_manager(&manager)));
        let executords = cluster
            .nodes()
            .iter()
            .map(|node| {
                let mut opts = manager.node_options(&dir.0, node);
                opts.extra_config += &format!(
                    "[slurm]\nconf = {:?}\n",
                    cluster.conf().display().to_string()
                );
                if billing {
                    opts.extra_config += &format!(
                        "[billing]\ngranularity_ms = 200\njournal = {:?}\n",
                        dir.path(&format!("{node}.billing.jsonl"))
                            .display()
                            .to_string()
                    );
                }
                Executord::start(
                    &daemon_binary(),
                    ExecutordOptions {
                        cpus: "0-3".into(),
                        local_socket: Some(socket(node)),
                        ..opts
                    },
                )
            })
            .collect();
        let env = RfaasOnSlurm {
            executords,
            cluster,
            accounting,
            manager,
        };
        wait_for("registered nodes", JOB_BOUND, || {
            let (_, nodes) = env.manager.admin().call("GET", "/v1/nodes", None);
            let up = nodes
                .as_array()?
                .iter()
                .filter(|n| n["state"] == "up")
                .count();
            (up == env.executords.len()).then_some(())
        });
        env
    }

    fn logs(&self, dir: &TempDir) -> String {
        format!(
            "spank log:\n{}\n{}\nmanager log:\n{}\nexecutord logs:\n{}",
            std::fs::read_to_string(dir.path("spank.log")).unwrap_or_default(),
            self.cluster.slurmd_logs(),
            self.manager.log(),
            self.executords
                .iter()
                .map(|d| d.log())
                .collect::<Vec<_>>()
                .join("\n")
        )
    }
}

/// `KEY=value` lines → the `RFAAS_` ones, but `RFAAS_CA_FILE` and
/// `RFAAS_SPANK_PLUGIN`: the test process trusts its throwaway CA through
/// the one and may be told its plugin by the other, and jobs inherit the
/// submitting environment.
fn rfaas_vars(text: &str) -> BTreeMap<String, String> {
    text.lines()
        .filter_map(|l| l.split_once('='))
        .filter(|(k, _)| {
            k.starts_with("RFAAS_") && !matches!(*k, "RFAAS_CA_FILE" | "RFAAS_SPANK_PLUGIN")
        })
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
}

#[test]
fn a_job_with_rfaas_gets_a_job_credential_that_ends_with_it() {
    let dir = TempDir::new("jobenv");
    let env = RfaasOnSlurm::start(&dir, 2, "grace=5", false);
    let out = dir.path("job.out");
    let done = dir.path("done");
    let job = env
        .cluster
        .sbatch(&[
            "-N1",
            "-w",
            "node1",
            "--exclusive",
            "--rfaas",
            "-o",
            &out.display().to_string(),
            "--wrap",
            &format!(
                "env; for i in $(seq 1200); do [ -e {} ] && exit 0; sleep 0.1; done; exit 1",
                done.display()
            ),
        ])
        .unwrap();
    let vars = wait_for("job environment", JOB_BOUND, || {
        let vars = rfaas_vars(&std::fs::read_to_string(&out).ok()?);
        (!vars.is_empty()).then_some(vars)
    });
    assert_eq!(
        vars.get("RFAAS_MANAGERS").map(String::as_str),
        Some(env.manager.url()),
        "{vars:?}\n{}",
        env.logs(&dir)
    );
    let credential = vars.get("RFAAS_CREDENTIAL").expect("a credential");

    // The manager hears that node1 lends nothing while the job runs.
    wait_for("node1 withheld", JOB_BOUND, || {
        let (_, n) = env.manager.admin().call("GET", "/v1/nodes/node1", None);
        (n["withheld_cores"] == 4).then_some(())
    });
    // The job leases with it: on node2, since node1 runs the job; the
    // lease names the job.
    let api = Api::new(env.manager.url(), credential);
    let (s, grant) = api.call(
        "POST",
        "/v1/leases",
        Some(&json!({"cores": 2, "memory_mib": 256, "duration_s": 600})),
    );
    assert_eq!(s, 201, "{grant}\n{}", env.logs(&dir));
    assert_eq!(grant["leases"][0]["node"], "node2", "{grant}");
    let id = grant["id"].as_u64().unwrap();
    let (_, shown) = api.call("GET", &format!("/v1/leases/{id}"), None);
    assert_eq!(shown[0]["job_id"].as_u64(), Some(u64::from(job)), "{shown}");
    assert_eq!(shown[0]["user"], "root", "{shown}");

    // The job ends: its credential is revoked and its lease released.
    std::fs::write(&done, "").unwrap();
    let state = env
        .cluster
        .wait_job_state(job, &["COMPLETED", "FAILED", "CANCELLED"], JOB_BOUND)
        .unwrap();
    assert_eq!(state, "COMPLETED", "{}", env.logs(&dir));
    let (s, e) = wait_for("the credential's revocation", JOB_BOUND, || {
        let r = api.call("GET", "/v1/leases", None);
        (r.0 != 200).then_some(r)
    });
    assert_eq!(
        (s, e["error"].as_str()),
        (401, Some("credential_revoked")),
        "{e}"
    );
    let (_, shown) = env
        .manager
        .admin()
        .call("GET", &format!("/v1/leases/{id}"), None);
    assert_eq!(shown[0]["state"], "released", "{shown}");

    // A job without --rfaas gets nothing (the site's default is off).
    let plain = dir.path("plain.out");
    let job = env
        .cluster
        .sbatch(&["-N1", "-o", &plain.display().to_string(), "--wrap", "env"])
        .unwrap();
    env.cluster
        .wait_job_state(job, &["COMPLETED", "FAILED", "CANCELLED"], JOB_BOUND)
        .unwrap();
    let text = std::fs::read_to_string(&plain).unwrap();
    assert!(rfaas_vars(&text).is_empty(), "{text}");
    assert!(text.contains("SLURM_JOB_ID="), "{text}");
}

/// The node's name comes from slurmstepd (slurmd's configuration), not
/// from the job's environment: a user who names another node, or a path,
/// reaches no other socket, and the job still gets its environment from
/// its own node's daemon.
#[test]
fn the_jobs_own_slurmd_nodename_names_no_socket() {
    let dir = TempDir::new("nodename");
    let env = RfaasOnSlurm::start(&dir, 2, "grace=5", false);
    let out = dir.path("job.out");
    let job = env
        .cluster
        .sbatch(&[
            "-N1",
            "-w",
            "node1",
            "--rfaas",
            "--export=ALL,SLURMD_NODENAME=../../forged",
            "-o",
            &out.display().to_string(),
            "--wrap",
            "env",
        ])
        .unwrap();
    env.cluster
        .wait_job_state(job, &["COMPLETED", "FAILED", "CANCELLED"], JOB_BOUND)
        .unwrap();
    let text = std::fs::read_to_string(&out).unwrap_or_default();
    let vars = rfaas_vars(&text);
    assert_eq!(
        vars.get("RFAAS_MANAGERS").map(String::as_str),
        Some(env.manager.url()),
        "{text}\n{}",
        env.logs(&dir)
    );
    let log = std::fs::read_to_string(dir.path("spank.log")).unwrap_or_default();
    assert!(!log.contains("forged"), "{log}");
}

#[test]
fn srun_alone_with_rfaas_gets_the_environment_on_every_node() {
    let dir = TempDir::new("srunenv");
    let env = RfaasOnSlurm::start(&dir, 2, "grace=5", false);
    // Each task writes its environment to a file of its own: srun's I/O
    // channel from the nodes' slurmstepd is not what is tested here.
    let each = format!("printenv > {}/env.$SLURM_PROCID", dir.path("").display());
    let out = env
        .cluster
        .output("srun", &["-N2", "--rfaas", "sh", "-c", &each])
        .unwrap();
    assert!(out.status.success(), "{out:?}\n{}", env.logs(&dir));
    for task in ["0", "1"] {
        let text = std::fs::read_to_string(dir.path(&format!("env.{task}"))).unwrap();
        let vars = rfaas_vars(&text);
        assert_eq!(
            vars.get("RFAAS_MANAGERS").map(String::as_str),
            Some(env.manager.url()),
            "task {task}: {vars:?}\n{}\n{}",
            String::from_utf8_lossy(&out.stderr),
            env.logs(&dir)
        );
        assert!(
            vars.contains_key("RFAAS_CREDENTIAL"),
            "task {task}: {vars:?}"
        );
    }
    // --rfaas=no on srun alone: nothing, and nothing to explain.
    let out = env
        .cluster
        .output("srun", &["-N1", "--rfaas=no", "printenv"])
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(rfaas_vars(&text).is_empty(), "{text}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("rfaas"), "{err}");
}

/// Seconds since the epoch, as `date +%s.%N` writes them.
fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

#[test]
fn a_rfaas_job_offloads_moves_when_its_node_is_taken_back_and_is_billed() {
    const GRACE_S: f64 = 3.0;
    let dir = TempDir::new("offload");
    let env = RfaasOnSlurm::start(&dir, 3, "grace=3", true);
    // The job runs as nobody (workers never run as root): its program,
    // library and output where nobody reads and writes.
    let program = dir.path("offload_loop");
    std::fs::copy(client_example("offload_loop"), &program).unwrap();
    let library = dir.path("functions.so");
    std::fs::copy(rust_library(), &library).unwrap();
    let out_dir = dir.path("out");
    std::fs::create_dir(&out_dir).unwrap();
    std::fs::set_permissions(&out_dir, std::fs::Permissions::from_mode(0o1777)).unwrap();
    let out = out_dir.join("offload.out");
    let job = env
        .cluster
        .sbatch(&[
            "-N1",
            "-w",
            "node1",
            "--exclusive",
            "--rfaas",
            "--uid=nobody",
            "-o",
            &out.display().to_string(),
            "--wrap",
            &format!(
                "{} --library {} --seconds 12",
                program.display(),
                library.display()
            ),
        ])
        .unwrap();
    let first = wait_for("the job's first node", JOB_BOUND, || {
        let text = std::fs::read_to_string(&out).ok()?;
        let line = text.lines().find(|l| l.starts_with("calling echo on "))?;
        Some(line.split_whitespace().nth(3)?.to_owned())
    });
    assert!(
        first == "node2" || first == "node3",
        "the job leased {first}, not another node\n{}",
        env.logs(&dir)
    );
    // Mid-run: the node has served the job's calls (its executor counts
    // them) before another job takes it.
    let on_first = env
        .executords
        .iter()
        .find(|d| d.node_name() == first)
        .expect("an executor daemon on every node");
    wait_for(
        &format!("the job's calls served on {first}"),
        JOB_BOUND,
        || match on_first.local(LocalRequest::Usage { lease_id: None }) {
            LocalReply::Usage { leases, .. } => {
                leases.iter().any(|l| l.usage.invocations > 0).then_some(())
            }
            other => panic!("{first}'s executor answered {other:?} to a usage request"),
        },
    );

    // A job lands on that node mid-run: it starts within the grace (and
    // 2 s), and the offloading job moves on.
    let stamp = out_dir.join("started");
    let submitted = unix_now();
    let taker = env
        .cluster
        .sbatch(&[
            "-N1",
            "-w",
            &first,
            "--exclusive",
            "-o",
            "/dev/null",
            "--wrap",
            &format!("date +%s.%N > {}; sleep 1", stamp.display()),
        ])
        .unwrap();
    let started: f64 = wait_for("the second job's start", JOB_BOUND, || {
        std::fs::read_to_string(&stamp).ok()?.trim().parse().ok()
    });
    let delay = started - submitted;
    assert!(
        delay <= GRACE_S + 2.0,
        "the job on {first} started {delay:.2} s after its submission\n{}",
        env.logs(&dir)
    );
    let state = env
        .cluster
        .wait_job_state(taker, &["COMPLETED", "FAILED", "CANCELLED"], JOB_BOUND)
        .unwrap();
    assert_eq!(state, "COMPLETED");
    // Offered again within a second of that job's end.
    let ended = unix_now();
    wait_for("the node offered again", JOB_BOUND, || {
        let (_, n) = env
            .manager
            .admin()
            .call("GET", &format!("/v1/nodes/{first}"), None);
        (n["withheld_cores"] == 0).then_some(())
    });
    let offered = unix_now() - ended;

    let state = env
        .cluster
        .wait_job_state(job, &["COMPLETED", "FAILED", "CANCELLED"], JOB_BOUND)
        .unwrap();
    let text = std::fs::read_to_string(&out).unwrap();
    assert_eq!(state, "COMPLETED", "{text}\n{}", env.logs(&dir));
    assert!(
        text.contains(&format!("moved from {first} to ")),
        "{text}\n{}",
        env.logs(&dir)
    );
    let summary: serde_json::Value = text
        .lines()
        .rev()
        .find_map(|l| serde_json::from_str(l).ok())
        .unwrap_or_else(|| panic!("no summary line in {text}"));
    assert_eq!(summary["failed"], 0, "{text}");
    let calls = summary["calls"].as_u64().unwrap();
    assert!(calls > 0 && summary["moves"].as_u64() >= Some(1), "{text}");
    assert!(
        summary["nodes"].get("node1").is_none(),
        "nothing ran on the job's own node: {text}"
    );
    assert!(
        offered <= 1.5,
        "{first} was offered {offered:.2} s after the job's end (at most 1 s plus this poll)"
    );

    // Billed: to the job, its user and account, every call counted.
    let acct = env.accounting.as_ref().unwrap();
    let billing_conf = dir.path("billing.toml");
    std::fs::write(
        &billing_conf,
        "currency = \"CHF\"\n[rates]\nalloc_per_gib_s = 0.0001\ncompute_per_s = 0.01\n\
         hot_per_s = 0.005\nharvested_discount = 0.5\n",
    )
    .unwrap();
    let bill = || {
        let out = Command::new(billing_binary())
            .args([
                "--database",
                env.manager.database(),
                "--config",
                billing_conf.to_str().unwrap(),
                "-j",
                &job.to_string(),
                "--by",
                "job,user,account",
                "-o",
                "JobID,User,Account,Invocations",
                "--parsable2",
            ])
            .output()
            .unwrap();
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    };
    let mut text = String::new();
    let billed = poll_for(JOB_BOUND, || {
        text = bill();
        let row = text.lines().find(|l| l.starts_with(&format!("{job}|")))?;
        (row.rsplit('|').next().and_then(|n| n.parse::<u64>().ok()) >= Some(calls))
            .then(|| row.to_owned())
    })
    .unwrap_or_else(|| {
        panic!(
            "the job's {calls} calls were not billed within {JOB_BOUND:?}: rfaas-billing says\n{text}\n{}",
            acct.log()
        )
    });
    let fields: Vec<&str> = billed.split('|').collect();
    assert_eq!(
        &fields[..3],
        [&job.to_string()[..], "nobody", "nobody"],
        "{billed}"
    );
    let invocations: u64 = fields[3].parse().unwrap();
    assert!(
        invocations <= calls + 10,
        "{invocations} invocations billed for {calls} calls\n{}",
        acct.log()
    );
}

/// `ExecutordOptions` for node1 of a 4-CPU cluster whose slurm.conf is
/// (or will be) `conf`, with `[slurm]` and `more` of it.
fn executord_on_node1(conf: &Path, more: &str) -> ExecutordOptions {
    ExecutordOptions {
        node_name: "node1".into(),
        cpus: "0-3".into(),
        extra_config: format!(
            "[slurm]\nconf = {:?}\ngrace_ms = 2000\n{more}",
            conf.display().to_string()
        ),
        ..ExecutordOptions::default()
    }
}

/// One core of `echo` on `d`.
fn echo_allocation(d: &Executord) -> Allocation {
    let spec = AllocationSpec::new(c_library_bytes(), &["echo"]).memory_mib(256);
    Client::new(ClientOptions::with_provider("tcp"))
        .allocate(
            &d.executor(),
            &d.token("nobody", 1, 1024, Duration::from_secs(600)),
            &spec,
        )
        .unwrap_or_else(|e| panic!("allocation failed: {e}\nexecutord:\n{}", d.log()))
}

/// Calls `echo` once on `a`.
fn echo(a: &Allocation) -> Result<usize, String> {
    let f = a.function("echo").map_err(|e| e.to_string())?;
    let input = a.buffer::<u64>(1).map_err(|e| e.to_string())?;
    let mut output = a.buffer::<u64>(1).map_err(|e| e.to_string())?;
    a.invoke(f, &input, 1, &mut output)
        .map_err(|e| e.to_string())
}

/// The daemon's free CPUs and its allocations' ids.
fn free_and_allocations(d: &Executord) -> (Vec<u32>, Vec<u64>) {
    match d.status() {
        LocalReply::Status {
            free_cpus,
            allocations,
            ..
        } => (
            free_cpus,
            allocations.iter().map(|a| a.allocation_id).collect(),
        ),
        other => panic!("not a status: {other:?}"),
    }
}

/// A batch job of `cpus` CPUs on node1 that runs until `file` exists.
fn job_until(cluster: &SlurmCluster, cpus: u32, file: &Path, more: &[&str]) -> u32 {
    let wrap = format!("while [ ! -e {} ]; do sleep 0.1; done", file.display());
    let n = format!("-n{cpus}");
    let mut args = vec!["-N1", n.as_str(), "-w", "node1"];
    args.extend_from_slice(more);
    args.extend_from_slice(&["--wrap", wrap.as_str()]);
    let job = cluster.sbatch(&args).unwrap();
    let state = cluster
        .wait_job_state(job, &["RUNNING", "FAILED", "CANCELLED"], JOB_BOUND)
        .unwrap();
    assert_eq!(state, "RUNNING", "{:?}", cluster.job(job));
    job
}

fn end_job(cluster: &SlurmCluster, job: u32, file: &Path) {
    std::fs::write(file, "").unwrap();
    let state = cluster
        .wait_job_state(
            job,
            &["COMPLETED", "FAILED", "CANCELLED", "NODE_FAIL"],
            JOB_BOUND,
        )
        .unwrap();
    assert_eq!(state, "COMPLETED", "{:?}", cluster.job(job));
}

/// A shared node: a 1-CPU job takes back only the CPU Slurm gave it. The
/// allocation there is stopped after the grace; the one on another CPU
/// goes on serving, and the job's end offers its CPU again.
#[test]
fn on_a_shared_node_a_small_job_takes_back_only_its_cpu() {
    let dir = TempDir::new("percore");
    // The daemon's [slurm] conf names the cluster's slurm.conf through a
    // link made once the cluster (which needs the daemon's socket) is up.
    let conf = dir.path("slurm.conf");
    let d = Executord::start(
        &daemon_binary(),
        executord_on_node1(&conf, "reconcile_interval_ms = 0\n"),
    );
    let cluster = start(SlurmOptions {
        nodes: 1,
        plugstack: Some(plugstack(
            &dir,
            &format!("grace=2 socket={}", d.local_socket().display()),
        )),
        ..SlurmOptions::default()
    });
    std::os::unix::fs::symlink(cluster.conf(), &conf).unwrap();
    // The lowest free CPUs go first: `a` on 0, which Slurm gives the job,
    // `b` on 1.
    let a = echo_allocation(&d);
    let b = echo_allocation(&d);
    assert_eq!(free_and_allocations(&d).0, [2, 3]);
    assert_eq!(echo(&b), Ok(8));

    let done = dir.path("done");
    let job = job_until(&cluster, 1, &done, &["--rfaas"]);
    // The line says how long the take-back took (any time) and what became
    // of each allocation on the job's CPU.
    let head = format!(
        "rfaas_spank: job {job} on node1: take 1 CPU back from rfaas: taken back for Slurm job {job}: CPUs 0 withheld (Slurm's CPU_IDs 0); in "
    );
    let tail = " ms: 0 allocations on them drained within the 2000 ms grace period, 1 stopped after it, 0 had finished already; 2 CPUs free for rfaas";
    let said = |log: &str| {
        log.lines().any(|l| {
            l.split_once(&head).is_some_and(|(_, rest)| {
                rest.strip_suffix(tail)
                    .is_some_and(|ms| ms.parse::<u64>().is_ok())
            })
        })
    };
    poll_for(JOB_BOUND, || {
        said(&cluster.slurmd_log("node1")).then_some(())
    })
    .unwrap_or_else(|| {
        panic!(
            "no {head:?}..{tail:?} in node1's slurmd log within {JOB_BOUND:?}:\n{}\nexecutord:\n{}",
            cluster.slurmd_log("node1"),
            d.log()
        )
    });
    assert_eq!(
        free_and_allocations(&d),
        (vec![2, 3], vec![b.id()]),
        "CPU 0 withheld for job {job}, `a` gone, `b` on CPU 1"
    );
    assert!(echo(&a).is_err(), "`a` was stopped");
    assert_eq!(echo(&b), Ok(8), "`b` serves while the job runs");
    let LocalReply::Status { draining, .. } = d.status() else {
        panic!("no status")
    };
    assert!(!draining, "one CPU taken back is not a drain");

    end_job(&cluster, job, &done);
    nodes_idle_and_undrained(&cluster);
    let log = cluster.slurmd_log("node1");
    assert!(
        log.contains(&format!(
            "rfaas_spank: job {job} on node1: offer the idle CPUs to rfaas: Slurm job {job} ended: CPUs 0 offered again"
        )),
        "{log}\nexecutord:\n{}",
        d.log()
    );
    assert_eq!(free_and_allocations(&d), (vec![0, 2, 3], vec![b.id()]));
    assert_eq!(echo(&b), Ok(8));
}

/// A job that started while the daemon was down is taken back when it
/// starts (and again when it is restarted); its end is made up for though
/// the epilog never reached the daemon.
#[test]
fn reconciliation_takes_back_what_no_prolog_said_and_offers_what_no_epilog_said() {
    let dir = TempDir::new("reconcile");
    let hook_log = dir.path("hook.log");
    let cluster = start(SlurmOptions {
        nodes: 1,
        prolog: Some(PathBuf::from(HOOK)),
        epilog: Some(PathBuf::from(HOOK)),
        ..SlurmOptions::default()
    });
    // No daemon answers the hook, at the job's start or at its end.
    write_hook_conf(
        &cluster,
        &format!(
            "grace=2 socket={} log={}",
            dir.path("no-daemon.sock").display(),
            hook_log.display()
        ),
    );
    let done = dir.path("done");
    let job = job_until(&cluster, 2, &done, &[]);
    // slurmctld says RUNNING before node1's prolog has run: wait for it.
    let line = format!("job {job} on node1: could not take 2 CPUs back");
    wait_for(&format!("{line:?} in the hook's log"), JOB_BOUND, || {
        let hook = std::fs::read_to_string(&hook_log).unwrap_or_default();
        hook.contains(&line).then_some(())
    });

    let opts = executord_on_node1(&cluster.conf(), "reconcile_interval_ms = 200\n");
    let mut d = Executord::start(&daemon_binary(), opts.clone());
    // The first round runs before the daemon serves: its first answer
    // already withholds the job's CPUs.
    assert_eq!(free_and_allocations(&d).0, [2, 3], "{}", d.log());
    assert!(d.log().contains("missed prolog"), "{}", d.log());

    // Killed and started again while the job runs: the same.
    d.kill();
    let d = Executord::start(&daemon_binary(), opts);
    assert_eq!(free_and_allocations(&d).0, [2, 3], "{}", d.log());

    end_job(&cluster, job, &done);
    nodes_idle_and_undrained(&cluster);
    let line = format!("job {job} on node1: could not offer");
    wait_for(&format!("{line:?} in the hook's log"), JOB_BOUND, || {
        let hook = std::fs::read_to_string(&hook_log).unwrap_or_default();
        hook.contains(&line).then_some(())
    });
    d.wait_status(
        JOB_BOUND,
        |s| matches!(s, LocalReply::Status { free_cpus, .. } if free_cpus == &[0, 1, 2, 3]),
    );
    assert!(d.log().contains("missed epilog"), "{}", d.log());
}

/// Submits an exclusive job on `node` that writes when its script starts
/// into `stamp`; returns the job and how long after its submission it
/// started, seconds.
fn timed_job(env: &RfaasOnSlurm, node: &str, stamp: &Path) -> (u32, f64) {
    let submitted = unix_now();
    let job = env
        .cluster
        .sbatch(&[
            "-N1",
            "-w",
            node,
            "--exclusive",
            "-o",
            "/dev/null",
            "--wrap",
            &format!("date +%s.%N > {}", stamp.display()),
        ])
        .unwrap();
    let started: f64 = wait_for("the job's start", JOB_BOUND, || {
        std::fs::read_to_string(stamp).ok()?.trim().parse().ok()
    });
    let state = env
        .cluster
        .wait_job_state(job, &["COMPLETED", "FAILED", "CANCELLED"], JOB_BOUND)
        .unwrap();
    assert_eq!(state, "COMPLETED", "{:?}", env.cluster.job(job));
    (job, started - submitted)
}

#[test]
fn with_the_manager_killed_jobs_start_on_time_and_nodes_come_back_with_it() {
    const GRACE_S: f64 = 3.0;
    let dir = TempDir::new("nomanager");
    let mut env = RfaasOnSlurm::start(&dir, 2, "grace=3", false);
    env.manager.kill();
    let (_, delay) = timed_job(&env, "node1", &dir.path("started"));
    assert!(
        delay <= GRACE_S + 2.0,
        "with the manager down, the job started {delay:.2} s after its submission\n{}",
        env.logs(&dir)
    );
    nodes_idle_and_undrained(&env.cluster);
    // The executor took the node back and gave it back on its own.
    assert!(
        env.executords[0].log().contains("heartbeat failed"),
        "{}",
        env.executords[0].log()
    );
    let LocalReply::Status { free_cpus, .. } = env.executords[0].status() else {
        panic!("no status")
    };
    assert_eq!(free_cpus, [0, 1, 2, 3]);
    // The manager comes back: both nodes are up and lend every core.
    env.manager.restart().unwrap();
    wait_for("both nodes lent again", JOB_BOUND, || {
        let (_, nodes) = env.manager.admin().call("GET", "/v1/nodes", None);
        let lent = nodes
            .as_array()?
            .iter()
            .filter(|n| n["state"] == "up" && n["withheld_cores"] == 0)
            .count();
        (lent == 2).then_some(())
    });
}

#[test]
fn with_executord_killed_jobs_start_on_time_and_no_worker_survives() {
    const GRACE_S: f64 = 3.0;
    let dir = TempDir::new("noexecutord");
    let mut env = RfaasOnSlurm::start(&dir, 2, "grace=3", false);
    let alloc = echo_allocation(&env.executords[0]);
    echo(&alloc).unwrap();
    let LocalReply::Status { allocations, .. } = env.executords[0].status() else {
        panic!("no status")
    };
    let pids: Vec<u32> = allocations.iter().map(|a| a.pid).collect();
    assert_eq!(pids.len(), 1, "{allocations:?}");
    env.executords[0].kill();
    let (_, delay) = timed_job(&env, "node1", &dir.path("started"));
    assert!(
        delay <= GRACE_S + 2.0,
        "with executord down, the job started {delay:.2} s after its submission\n{}",
        env.logs(&dir)
    );
    nodes_idle_and_undrained(&env.cluster);
    // The worker died with its daemon: nothing of rfaas holds the job's
    // cores.
    for pid in pids {
        wait_for("the worker's end", JOB_BOUND, || {
            (!Path::new(&format!("/proc/{pid}")).exists()).then_some(())
        });
    }
    assert!(echo(&alloc).is_err(), "the allocation still answers");
    let log = std::fs::read_to_string(dir.path("spank.log")).unwrap_or_default();
    assert!(log.contains("fail open"), "{log}");
}

/// slurmctld's RPCs since its statistics were last reset, by message type
/// (`sdiag`), but `sdiag`'s own; and the jobs it has completed.
fn sdiag(cluster: &SlurmCluster) -> (BTreeMap<String, u64>, u64) {
    let text = cluster.run("sdiag", &[]).unwrap();
    let completed = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("Jobs completed:"))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("no jobs completed in sdiag's output:\n{text}"));
    let by_type = text
        .split("statistics by message type")
        .nth(1)
        .and_then(|t| t.split("statistics by user").next())
        .unwrap_or_else(|| panic!("no RPCs by type in sdiag's output:\n{text}"));
    let rpcs = by_type
        .lines()
        .filter_map(|l| {
            let (name, rest) = l.trim().split_once(' ')?;
            let count = rest.split("count:").nth(1)?.split_whitespace().next()?;
            Some((name.to_owned(), count.parse().ok()?))
        })
        .filter(|(name, _)| name != "REQUEST_STATS_INFO")
        .collect();
    (rpcs, completed)
}

/// The window both runs measure: `jobs` jobs on every node of `cluster`,
/// one after another (`srun -N.. sleep 1`, with `more` arguments),
/// counted by `sdiag` from a reset until slurmctld completed them all and
/// `settled` (what rfaas does at their ends is over). Returns slurmctld's
/// RPCs by type, and the window's length. Nothing here asks slurmctld but
/// for the jobs (`sdiag` is not counted).
fn rpcs_over_jobs(
    cluster: &SlurmCluster,
    jobs: u64,
    more: &[&str],
    settled: impl Fn() -> bool,
) -> (BTreeMap<String, u64>, Duration) {
    let nodes = format!("-N{}", cluster.nodes().len());
    cluster.run("sdiag", &["-r"]).unwrap();
    let start = std::time::Instant::now();
    for _ in 0..jobs {
        let mut args = vec![nodes.as_str()];
        args.extend_from_slice(more);
        args.extend_from_slice(&["sleep", "1"]);
        let out = cluster.output("srun", &args).unwrap();
        assert!(out.status.success(), "{out:?}");
    }
    let rpcs = poll_for(JOB_BOUND, || {
        let (rpcs, completed) = sdiag(cluster);
        (completed >= jobs && settled()).then_some(rpcs)
    })
    .unwrap_or_else(|| panic!("the jobs did not complete and settle within {JOB_BOUND:?}"));
    (rpcs, start.elapsed())
}

/// What rfaas adds to slurmctld stays within its budget, measured with
/// `sdiag` on the same jobs without rfaas and with it (a manager, an
/// executord with `[slurm]` on each of four nodes, the plugin, `--rfaas`
/// jobs): per node and minute one RPC (reconciliation, the default
/// interval), plus on each node one query per job start (the take-back's
/// `scontrol --local`: one RPC, and a second, `REQUEST_NODE_INFO`, for a
/// job on several nodes, as these are) and one RPC per job end (slurmd's
/// `MESSAGE_EPILOG_COMPLETE`, which it sends once a plugin has an
/// epilog), plus for the manager one query (`squeue --local`, two RPCs)
/// per job start and one per job end. Nothing may ask Slurm as a job step
/// starts on each node: that alone would be one RPC more per node and job.
#[test]
fn rfaas_adds_little_to_slurmctld_whatever_the_cluster_size() {
    const NODES: u64 = 4;
    const JOBS: u64 = 3;
    const MANAGER_QUERY_RPCS: u64 = 2;
    const TAKE_BACK_RPCS: u64 = 2;
    let (without, _) = {
        let cluster = start(SlurmOptions {
            nodes: NODES as u32,
            ..SlurmOptions::default()
        });
        rpcs_over_jobs(&cluster, JOBS, &[], || true)
    };

    let dir = TempDir::new("sdiag");
    let env = RfaasOnSlurm::start(&dir, NODES as u32, "grace=5", false);
    // Each daemon asked Slurm its node's partitions once, at start (one
    // RPC, before the window: the budget below has nothing for it), and
    // registered them.
    let (_, in_debug) = env
        .manager
        .admin()
        .call("GET", "/v1/nodes?partition=debug", None);
    assert_eq!(
        in_debug.as_array().map(Vec::len),
        Some(NODES as usize),
        "{in_debug}\n{}",
        env.logs(&dir)
    );
    let (with, window) = rpcs_over_jobs(&env.cluster, JOBS, &["--rfaas"], || {
        // Each job's end told the manager (the first node revokes its
        // credential), and every node has its CPUs back.
        env.manager.log().matches("Slurm job ended").count() as u64 >= JOBS
            && env.executords.iter().all(|d| {
                matches!(d.status(), LocalReply::Status { free_cpus, .. } if free_cpus.len() == 4)
            })
    });
    // Each job's steps got a credential on every node.
    let minted = env
        .executords
        .iter()
        .map(|d| d.log().matches("job credential minted").count() as u64)
        .sum::<u64>();
    assert_eq!(minted, JOBS * NODES, "{}", env.logs(&dir));

    let added: u64 = with
        .iter()
        .map(|(name, n)| n.saturating_sub(without.get(name).copied().unwrap_or(0)))
        .sum();
    let minutes = window.as_secs().div_ceil(60).max(1);
    let budget =
        NODES * minutes + JOBS * NODES * (TAKE_BACK_RPCS + 1) + JOBS * 2 * MANAGER_QUERY_RPCS;
    assert!(
        added <= budget,
        "rfaas added {added} slurmctld RPCs over {window:?} ({JOBS} jobs on {NODES} nodes), more than {budget}:\nwithout rfaas {without:?}\nwith rfaas {with:?}\n{}",
        env.logs(&dir)
    );
    // The bound can fail: rfaas's own queries are counted.
    assert!(
        with.get("REQUEST_JOB_INFO_SINGLE") > without.get("REQUEST_JOB_INFO_SINGLE"),
        "without rfaas {without:?}\nwith rfaas {with:?}"
    );
    eprintln!("rfaas added {added} of {budget} slurmctld RPCs over {window:?}:\nwithout {without:?}\nwith {with:?}");
}

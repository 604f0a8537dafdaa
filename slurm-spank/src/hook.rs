//! What happens at a job's start and end on a node, shared by the SPANK
//! plugin (`job_prolog`, `job_epilog`) and `rfaas-slurm-hook` (Prolog=,
//! Epilog=).
//!
//! Fail open: whatever goes wrong (no daemon, a dead one, a slow one, a
//! refusal, a panic here) is logged and the job goes on. A prolog that
//! failed would make Slurm drain the node and requeue the job; that must
//! never happen because of rfaas.

use std::any::Any;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::panic::{catch_unwind, AssertUnwindSafe};

use rfaas_proto::control::local::LocalRequest;

use std::collections::BTreeMap;

use rfaas_proto::control::local::{LocalReply, JOB_ENV_VARS};

use crate::daemon::{ask, ask_reply, TalkError};
use crate::job::JobOnNode;
use crate::settings::{BadWord, Settings};

/// Where log lines go: Slurm's log functions in the plugin, standard error
/// in the hook.
pub trait Log {
    /// Something worth knowing.
    fn info(&self, line: &str);
    /// Something went wrong (and the job goes on regardless).
    fn error(&self, line: &str);
}

/// A [`Log`] that also appends every line to the site's `log=` file.
#[derive(Debug)]
pub struct Logger<'a, L> {
    inner: &'a L,
    settings: &'a Settings,
}

impl<'a, L: Log> Logger<'a, L> {
    /// Lines go to `inner`, and to `settings.log_file` if set.
    pub fn new(inner: &'a L, settings: &'a Settings) -> Self {
        Logger { inner, settings }
    }

    fn to_file(&self, level: &str, line: &str) {
        let Some(path) = &self.settings.log_file else {
            return;
        };
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        // One write per line, so lines from several processes do not mix.
        let text = format!(
            "{}.{:03} pid={} {level} {line}\n",
            now.as_secs(),
            now.subsec_millis(),
            std::process::id()
        );
        // The plugin runs as root: a link at the path (planted where a
        // user may write) is never followed, and a new file is the
        // owner's alone.
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(path)
        {
            let _ = f.write_all(text.as_bytes());
        }
    }
}

impl<L: Log> Log for Logger<'_, L> {
    fn info(&self, line: &str) {
        self.inner.info(line);
        self.to_file("info", line);
    }

    fn error(&self, line: &str) {
        self.inner.error(line);
        self.to_file("error", line);
    }
}

/// Logs the words of the site's configuration that were not taken.
pub fn report_bad_words(log: &dyn Log, bad: &[BadWord]) {
    for b in bad {
        log.error(&format!("{b}; the default stays"));
    }
}

/// Which end of a job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// The job starts here: take the node's CPUs back from rfaas.
    Prolog,
    /// The job ended here: offer the node's idle CPUs to rfaas.
    Epilog,
}

/// Asks the node's executor daemon to take back (prolog) or offer
/// (epilog), within the bound, and logs the outcome. Never fails: the
/// caller returns success to Slurm whatever happened.
pub fn run(event: Event, settings: &Settings, job: &JobOnNode, log: &dyn Log) {
    let node = job.node.as_deref().unwrap_or("this node");
    let (req, limit, what) = match event {
        Event::Prolog => (
            LocalRequest::SlurmRetrieve {
                job_id: job.job_id,
                cpus: job.cpus,
                grace_ms: settings.grace.as_millis() as u64,
            },
            settings.grace + settings.timeout,
            match job.cpus {
                0 => "take every CPU back from rfaas".to_string(),
                1 => "take 1 CPU back from rfaas".to_string(),
                n => format!("take {n} CPUs back from rfaas"),
            },
        ),
        Event::Epilog => (
            LocalRequest::SlurmOffer { job_id: job.job_id },
            settings.timeout,
            "offer the idle CPUs to rfaas".to_string(),
        ),
    };
    let socket = match settings.socket_for(job.node.as_deref()) {
        Ok(socket) => socket,
        Err(why) => {
            log.error(&fail_open_line(event, job.job_id, node, &what, &why));
            return;
        }
    };
    match ask(&socket, req, limit) {
        Ok(message) => log.info(&format!("job {} on {node}: {what}: {message}", job.job_id)),
        Err(e) => log.error(&fail_open_line(event, job.job_id, node, &what, &e)),
    }
}

/// Asks the node's executor daemon for job `job_id`'s rfaas environment
/// (user `uid`), within the bound, and logs the outcome (never the
/// credential). `Err`: the job runs without it, and the line logged says
/// why (the plugin repeats it on the job's standard error).
pub fn job_env(
    settings: &Settings,
    node: Option<&str>,
    job_id: u64,
    uid: u32,
    log: &dyn Log,
) -> Result<BTreeMap<String, String>, String> {
    let req = LocalRequest::SlurmJobEnv { job_id, uid };
    let reply = settings
        .socket_for(node)
        .and_then(|socket| ask_reply(&socket, req, settings.timeout).map_err(|e| e.to_string()));
    let why = match reply {
        Ok(LocalReply::JobEnv {
            mut vars,
            expires_at,
        }) => {
            let unknown: Vec<String> = vars
                .keys()
                .filter(|name| !JOB_ENV_VARS.contains(&name.as_str()))
                .cloned()
                .collect();
            if !unknown.is_empty() {
                vars.retain(|name, _| JOB_ENV_VARS.contains(&name.as_str()));
                log.error(&format!(
                    "job {job_id}: the executor daemon's answer named variables the plugin does not set: {}; only {} are set",
                    unknown.join(", "),
                    JOB_ENV_VARS.join(", ")
                ));
            }
            let names: Vec<&str> = vars.keys().map(String::as_str).collect();
            log.info(&format!(
                "job {job_id}: rfaas environment set ({}; the credential expires at {expires_at})",
                names.join(", ")
            ));
            return Ok(vars);
        }
        Ok(other) => TalkError::Unexpected {
            reply: Box::new(other),
        }
        .to_string(),
        Err(why) => why,
    };
    let line = no_env_line(job_id, &why);
    log.error(&line);
    Err(line)
}

/// The one line that says why a job that asked for rfaas runs without it.
pub fn no_env_line(job_id: u64, why: &str) -> String {
    format!("job {job_id}: no rfaas environment: {why}; the job runs without rfaas")
}

fn fail_open_line(
    event: Event,
    job_id: u64,
    node: &str,
    what: &str,
    e: &dyn std::fmt::Display,
) -> String {
    let then = match event {
        Event::Prolog => "the job starts anyway (fail open)",
        Event::Epilog => "the node is not offered to rfaas until the next job ends (fail open)",
    };
    format!("job {job_id} on {node}: could not {what}: {e}; {then}")
}

/// Runs `f`, catching a panic: it is logged as `callback` failing, and the
/// caller goes on as if `f` had failed open. Nothing here holds a lock
/// across `f`, so a panic leaves nothing poisoned for the next callback.
pub fn guarded<T>(callback: &str, log: &dyn Log, fallback: T, f: impl FnOnce() -> T) -> T {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(v) => v,
        Err(payload) => {
            log.error(&format!(
                "{callback} panicked ({}); the job goes on (fail open)",
                panic_message(payload.as_ref())
            ));
            fallback
        }
    }
}

fn panic_message(payload: &(dyn Any + Send)) -> &str {
    if let Some(s) = payload.downcast_ref::<&str>() {
        s
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s
    } else {
        "no message"
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;
    use std::os::unix::fs::PermissionsExt;
    use std::time::{Duration, Instant};

    #[derive(Default)]
    struct Lines(RefCell<Vec<String>>);

    impl Log for Lines {
        fn info(&self, line: &str) {
            self.0.borrow_mut().push(format!("info {line}"));
        }
        fn error(&self, line: &str) {
            self.0.borrow_mut().push(format!("error {line}"));
        }
    }

    #[test]
    fn without_a_daemon_the_prolog_fails_open_at_once() {
        let (mut settings, _) = Settings::parse([]);
        settings.socket = std::env::temp_dir().join("rfaas-slurm-no-such-daemon.sock");
        let job = JobOnNode {
            job_id: 5,
            node: Some("node1".into()),
            cpus: 2,
        };
        let lines = Lines::default();
        let started = Instant::now();
        run(Event::Prolog, &settings, &job, &lines);
        assert!(started.elapsed() < settings.grace, "no grace is waited for");
        let lines = lines.0.into_inner();
        assert_eq!(lines.len(), 1, "{lines:?}");
        assert!(lines[0].starts_with("error job 5 on node1: could not take 2 CPUs back"));
        assert!(
            lines[0].contains("no executor daemon socket"),
            "{}",
            lines[0]
        );
        assert!(lines[0].contains("fail open"), "{}", lines[0]);
    }

    #[test]
    fn a_panic_is_logged_and_the_fallback_returned() {
        let lines = Lines::default();
        let got = guarded("job_prolog", &lines, 0, || -> i32 { panic!("boom {}", 7) });
        assert_eq!(got, 0);
        let lines = lines.0.into_inner();
        assert_eq!(
            lines,
            ["error job_prolog panicked (boom 7); the job goes on (fail open)"]
        );
        let lines = Lines::default();
        assert_eq!(guarded("x", &lines, 0, || 3), 3);
        assert!(lines.0.into_inner().is_empty());
    }

    #[test]
    fn the_log_file_gets_every_line() {
        let path = std::env::temp_dir().join(format!("rfaas-slurm-log-{}", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let settings = Settings {
            log_file: Some(path.clone()),
            timeout: Duration::from_millis(10),
            ..Settings::default()
        };
        let lines = Lines::default();
        let log = Logger::new(&lines, &settings);
        log.info("one");
        log.error("two");
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.contains(" info one\n"), "{text}");
        assert!(text.contains(" error two\n"), "{text}");
        assert_eq!(lines.0.into_inner().len(), 2);
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "a new log file is its owner's alone");
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn a_link_at_the_log_path_is_not_followed() {
        let dir = std::env::temp_dir().join(format!("rfaas-slurm-link-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let target = dir.join("elsewhere");
        std::fs::write(&target, "kept\n").unwrap();
        let link = dir.join("rfaas.log");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        let settings = Settings {
            log_file: Some(link.clone()),
            ..Settings::default()
        };
        let lines = Lines::default();
        Logger::new(&lines, &settings).error("through the link?");
        assert_eq!(std::fs::read_to_string(&target).unwrap(), "kept\n");
        assert_eq!(
            lines.0.into_inner().len(),
            1,
            "the line still reaches Slurm's log"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A daemon socket that answers one `JobEnv` naming `vars`.
    fn answering(
        name: &str,
        vars: &[(&str, &str)],
    ) -> (std::path::PathBuf, std::thread::JoinHandle<()>) {
        use rfaas_proto::control::{Frame, FrameLimits};
        let path =
            std::env::temp_dir().join(format!("rfaas-slurm-env-{}-{name}", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let reply = LocalReply::JobEnv {
            vars: vars
                .iter()
                .map(|(n, v)| (n.to_string(), v.to_string()))
                .collect(),
            expires_at: 4_000_000_000,
        };
        let server = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            Frame::read_from(&mut s, FrameLimits::default()).unwrap();
            Frame::new(&reply, vec![]).write_to(&mut s).unwrap();
        });
        (path, server)
    }

    #[test]
    fn only_the_rfaas_variables_reach_the_job() {
        let (path, server) = answering(
            "vars",
            &[
                ("RFAAS_MANAGERS", "https://m1:7000"),
                ("RFAAS_CREDENTIAL", "jc-1.secret"),
                ("LD_PRELOAD", "/tmp/evil.so"),
                ("PATH", "/tmp/evil"),
                ("RFAAS_SOMETHING_NEW", "x"),
            ],
        );
        let settings = Settings {
            socket: path.clone(),
            ..Settings::default()
        };
        let lines = Lines::default();
        let vars = job_env(&settings, Some("node1"), 7, 1000, &lines).unwrap();
        server.join().unwrap();
        assert_eq!(
            vars.keys().map(String::as_str).collect::<Vec<_>>(),
            ["RFAAS_CREDENTIAL", "RFAAS_MANAGERS"]
        );
        let lines = lines.0.into_inner();
        assert!(
            lines.iter().any(|l| l.starts_with("error job 7:")
                && l.contains("LD_PRELOAD, PATH, RFAAS_SOMETHING_NEW")),
            "{lines:?}"
        );
        let _ = std::fs::remove_file(&path);
    }

    #[test]
    fn a_node_name_from_outside_slurm_reaches_no_socket() {
        let (mut settings, _) = Settings::parse(["socket=/tmp/rfaas-%n.sock"]);
        settings.timeout = Duration::from_millis(100);
        let lines = Lines::default();
        let e = job_env(&settings, Some("../../x"), 7, 1000, &lines).unwrap_err();
        assert!(e.contains("not a Slurm node name"), "{e}");
        let job = JobOnNode {
            job_id: 8,
            node: Some("../x".into()),
            cpus: 1,
        };
        run(Event::Epilog, &settings, &job, &lines);
        let lines = lines.0.into_inner();
        assert!(
            lines.last().unwrap().contains("not a Slurm node name"),
            "{lines:?}"
        );
    }

    /// logrotate moves the file away (no copytruncate, no signal): the
    /// next line opens a new file at the path, and nothing is lost.
    #[test]
    fn a_rotated_log_file_is_left_at_the_next_line() {
        let dir = rfaas_testkit::TempDir::new("rotate");
        let path = dir.join("slurm.log");
        let (mut settings, _) = Settings::parse([]);
        settings.log_file = Some(path.clone());
        let inner = Lines::default();
        let log = Logger::new(&inner, &settings);
        log.info("before the rotation");
        std::fs::rename(&path, dir.join("slurm.log.1")).unwrap();
        log.error("after the rotation");
        let old = std::fs::read_to_string(dir.join("slurm.log.1")).unwrap();
        let new = std::fs::read_to_string(&path).unwrap();
        assert!(old.ends_with(" info before the rotation\n"), "{old:?}");
        assert!(new.ends_with(" error after the rotation\n"), "{new:?}");
        assert_eq!(new.lines().count(), 1, "{new:?}");
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
    }
}

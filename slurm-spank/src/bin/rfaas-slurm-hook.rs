//! `rfaas-slurm-hook`: Slurm's `Prolog=` and `Epilog=` for sites that do
//! not load SPANK plugins. At a job's start it takes the node's CPUs back
//! from rfaas within the grace; at its end it offers them. It always exits
//! 0: a failing prolog would drain the node.
//!
//! ```text
//! rfaas-slurm-hook [prolog|epilog] [--config FILE] [key=value ...]
//! ```
//!
//! Without `prolog` or `epilog` it goes by `SLURM_SCRIPT_CONTEXT`
//! (`prolog_slurmd`, `epilog_slurmd`), which slurmd sets. Its settings are
//! the plugin's `key=value` words (see `docs/slurm.md`), read from FILE,
//! else from `rfaas-slurm-hook.conf` next to `slurm.conf` (`$SLURM_CONF`'s
//! directory, `/etc/slurm` without it) if that exists, then from the
//! command line. Log lines go to standard error and to the `log=` file.

use std::path::{Path, PathBuf};

use rfaas_spank::hook::{self, guarded, Event, Log, Logger};
use rfaas_spank::job::JobOnNode;
use rfaas_spank::settings::Settings;

/// Standard error, one line each.
#[derive(Debug)]
struct Stderr;

impl Log for Stderr {
    fn info(&self, line: &str) {
        eprintln!("rfaas-slurm-hook: {line}");
    }

    fn error(&self, line: &str) {
        eprintln!("rfaas-slurm-hook: error: {line}");
    }
}

/// The configuration file next to slurm.conf.
fn default_config() -> PathBuf {
    let conf = std::env::var_os("SLURM_CONF")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/etc/slurm/slurm.conf"));
    conf.parent()
        .unwrap_or(Path::new("/etc/slurm"))
        .join("rfaas-slurm-hook.conf")
}

/// The words of a configuration file: whitespace-separated, `#` starts a
/// comment.
fn file_words(text: &str) -> Vec<String> {
    text.lines()
        .map(|l| l.split('#').next().unwrap_or_default())
        .flat_map(str::split_whitespace)
        .map(str::to_string)
        .collect()
}

fn run(args: Vec<String>) {
    let mut event = None;
    let mut config = None;
    let mut words = Vec::new();
    let mut problems = Vec::new();
    let mut it = args.into_iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "prolog" => event = Some(Event::Prolog),
            "epilog" => event = Some(Event::Epilog),
            "--config" => match it.next() {
                Some(f) => config = Some(PathBuf::from(f)),
                None => problems.push("--config needs a file".to_string()),
            },
            _ if a.contains('=') => words.push(a),
            _ => problems.push(format!(
                "ignored argument {a:?}: give prolog, epilog, --config FILE or key=value"
            )),
        }
    }
    let event = event.or_else(|| match std::env::var("SLURM_SCRIPT_CONTEXT").as_deref() {
        Ok("prolog_slurmd") => Some(Event::Prolog),
        Ok("epilog_slurmd") => Some(Event::Epilog),
        _ => None,
    });
    let (explicit, path) = match config {
        Some(p) => (true, p),
        None => (false, default_config()),
    };
    let mut all = match std::fs::read_to_string(&path) {
        Ok(text) => file_words(&text),
        Err(e) => {
            if explicit || e.kind() != std::io::ErrorKind::NotFound {
                problems.push(format!(
                    "cannot read {}: {e}; the defaults stay",
                    path.display()
                ));
            }
            Vec::new()
        }
    };
    all.extend(words);
    let (settings, bad) = Settings::parse(all.iter().map(String::as_str));
    let log = Logger::new(&Stderr, &settings);
    for p in &problems {
        log.error(p);
    }
    hook::report_bad_words(&log, &bad);
    let Some(event) = event else {
        log.error(
            "neither prolog nor epilog: give one, or run me as slurmd's Prolog= or Epilog= \
             (SLURM_SCRIPT_CONTEXT says which); nothing done",
        );
        return;
    };
    let job = JobOnNode::from_env(|k| std::env::var(k).ok());
    hook::run(event, &settings, &job, &log);
}

/// What `--help` prints.
const USAGE: &str = "\
Take a node's CPUs back from rfaas when a Slurm job starts there, and offer
them again when it ends: Slurm's Prolog= and Epilog= for sites that load no
SPANK plugin. Always exits 0 (a failing prolog would drain the node).

Usage: rfaas-slurm-hook [prolog|epilog] [--config FILE] [KEY=VALUE ...]

Arguments:
  prolog|epilog   Which end of the job; without it, SLURM_SCRIPT_CONTEXT
                  (set by slurmd) says which
  KEY=VALUE       A setting, as the plugin's in plugstack.conf: grace=,
                  socket=, timeout_ms=, default=, log=

Options:
      --config FILE  The settings file [default: rfaas-slurm-hook.conf next to
                     slurm.conf, if it exists]
  -h, --help         Print help
";

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "--help" || a == "-h") {
        print!("{USAGE}");
        return;
    }
    guarded("rfaas-slurm-hook", &Stderr, (), || run(args));
    // Always 0: Slurm drains a node whose prolog fails.
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_file_words() {
        let w =
            file_words("# rfaas\ngrace=10   socket=/run/x.sock # the daemon\n\n timeout_ms=5\n");
        assert_eq!(w, ["grace=10", "socket=/run/x.sock", "timeout_ms=5"]);
    }
}

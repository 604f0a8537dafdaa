//! The site's settings: the plugin's arguments in `plugstack.conf`, or the
//! hook's configuration file and command line, `key=value` words alike.
//!
//! A word that is wrong (an unknown key, a bad value) never stops the
//! plugin or the hook: it is reported, and the key keeps its default, so a
//! typo in `plugstack.conf` costs a log line, not the cluster's jobs.

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use rfaas_proto::control::local::DEFAULT_LOCAL_SOCKET;

/// The grace period when `grace=` does not say, seconds.
pub const DEFAULT_GRACE_SECS: u64 = 30;

/// The bound on one exchange with the executor daemon when `timeout_ms=`
/// does not say, milliseconds.
pub const DEFAULT_TIMEOUT_MS: u64 = 2000;

/// The longest grace accepted, seconds (Slurm's own PrologEpilogTimeout
/// is the real bound; this only catches a slip of the keyboard).
pub const MAX_GRACE_SECS: u64 = 3600;

/// The longest `timeout_ms` accepted.
pub const MAX_TIMEOUT_MS: u64 = 60_000;

/// Every key, for the messages that list them.
pub const KEYS: &[&str] = &["grace", "socket", "timeout_ms", "default", "log"];

/// What the plugin and the hook do, from the site's words.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    /// How long running invocations may go on when a job takes the node
    /// back (`grace=SECONDS`).
    pub grace: Duration,
    /// The executor daemon's local socket (`socket=PATH`).
    pub socket: PathBuf,
    /// The bound on each exchange with the daemon, on top of the grace for
    /// a retrieval (`timeout_ms=MS`).
    pub timeout: Duration,
    /// Whether a job asks for rfaas when it says nothing (`default=on|off`).
    pub rfaas_by_default: bool,
    /// A file every log line is also appended to (`log=PATH`).
    pub log_file: Option<PathBuf>,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            grace: Duration::from_secs(DEFAULT_GRACE_SECS),
            socket: PathBuf::from(DEFAULT_LOCAL_SOCKET),
            timeout: Duration::from_millis(DEFAULT_TIMEOUT_MS),
            rfaas_by_default: false,
            log_file: None,
        }
    }
}

/// One word that was not taken, and why; its key keeps its default.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadWord {
    /// The word as given.
    pub word: String,
    /// What is wrong and what to write instead.
    pub reason: String,
}

impl fmt::Display for BadWord {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ignored argument {:?}: {}", self.word, self.reason)
    }
}

/// Refuses a node name that could take a path elsewhere: only ASCII
/// letters, digits, `-`, `_` and `.`, not starting with `.`, at most 255
/// bytes (what Slurm's own node names hold).
pub fn check_node_name(name: &str) -> Result<(), String> {
    let fits = !name.is_empty()
        && name.len() <= 255
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    if fits {
        Ok(())
    } else {
        Err(format!(
            "the node name {name:?} is not a Slurm node name (letters, digits, '-', '_' and '.', \
             not starting with '.'); no socket path is made of it"
        ))
    }
}

impl Settings {
    /// The executor daemon's socket on Slurm node `node`: `%n` in
    /// `socket=` stands for the node's name (as in Slurm's own
    /// `SlurmdSpoolDir`), for hosts that run several slurmd. Without a
    /// name, `%n` stays as it is (and names no socket).
    ///
    /// `Err` says why `node` cannot stand in a path: a name with `/`, `..`
    /// or anything a Slurm node name does not hold is refused, never
    /// joined, because the plugin connects as root to what it names.
    pub fn socket_for(&self, node: Option<&str>) -> Result<PathBuf, String> {
        match (node, self.socket.to_str()) {
            (Some(node), Some(path)) if path.contains("%n") => {
                check_node_name(node)?;
                Ok(PathBuf::from(path.replace("%n", node)))
            }
            _ => Ok(self.socket.clone()),
        }
    }

    /// Reads `key=value` words. Returns the settings, with defaults where a
    /// word was missing or wrong, and the words that were not taken.
    pub fn parse<'a>(words: impl IntoIterator<Item = &'a str>) -> (Settings, Vec<BadWord>) {
        let mut s = Settings::default();
        let mut bad = Vec::new();
        for word in words {
            if let Err(reason) = s.apply(word) {
                bad.push(BadWord {
                    word: word.to_string(),
                    reason,
                });
            }
        }
        (s, bad)
    }

    fn apply(&mut self, word: &str) -> Result<(), String> {
        let Some((key, value)) = word.split_once('=') else {
            return Err(format!(
                "write key=value, with a key among {}",
                KEYS.join(", ")
            ));
        };
        match key {
            "grace" => {
                let secs = number(value, 0, MAX_GRACE_SECS, "seconds")?;
                self.grace = Duration::from_secs(secs);
            }
            "timeout_ms" => {
                let ms = number(value, 1, MAX_TIMEOUT_MS, "milliseconds")?;
                self.timeout = Duration::from_millis(ms);
            }
            "socket" => {
                if !value.starts_with('/') {
                    return Err(
                        "the executor daemon's socket must be an absolute path, such as \
                         socket=/run/rfaas/executord.sock"
                            .into(),
                    );
                }
                if value.split("%n").any(|part| part.contains('%')) {
                    return Err("in socket=, % may only stand in %n (the node's name)".into());
                }
                self.socket = PathBuf::from(value);
            }
            "default" => {
                self.rfaas_by_default = match value {
                    "on" => true,
                    "off" => false,
                    _ => return Err("write default=on or default=off".into()),
                };
            }
            "log" => {
                if !value.starts_with('/') {
                    return Err("the log file must be an absolute path".into());
                }
                self.log_file = Some(PathBuf::from(value));
            }
            _ => {
                return Err(format!(
                    "unknown key {key:?}; the keys are {}",
                    KEYS.join(", ")
                ))
            }
        }
        Ok(())
    }
}

fn number(value: &str, min: u64, max: u64, unit: &str) -> Result<u64, String> {
    match value.parse::<u64>() {
        Ok(n) if (min..=max).contains(&n) => Ok(n),
        _ => Err(format!(
            "{value:?} is not a whole number of {unit} from {min} to {max}"
        )),
    }
}

/// What a job said about rfaas with `--rfaas[=yes|no]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RfaasChoice {
    /// `--rfaas` or `--rfaas=yes`.
    Yes,
    /// `--rfaas=no`.
    No,
}

impl RfaasChoice {
    /// The option's argument (`None` when given without one). Slurm hands
    /// an option given without its optional argument on to job steps
    /// (`srun` in a batch script) as the text `(null)`, which is the same.
    pub fn parse(arg: Option<&str>) -> Result<RfaasChoice, String> {
        match arg {
            None | Some("") | Some("(null)") | Some("yes") => Ok(RfaasChoice::Yes),
            Some("no") => Ok(RfaasChoice::No),
            Some(other) => Err(format!(
                "--rfaas={other}: write --rfaas (or --rfaas=yes) to use rfaas, --rfaas=no not to"
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_without_words() {
        let (s, bad) = Settings::parse([]);
        assert!(bad.is_empty());
        assert_eq!(s.grace, Duration::from_secs(30));
        assert_eq!(s.socket, PathBuf::from("/run/rfaas/executord.sock"));
        assert_eq!(s.timeout, Duration::from_millis(2000));
        assert!(!s.rfaas_by_default);
        assert_eq!(s.log_file, None);
    }

    #[test]
    fn every_key() {
        let (s, bad) = Settings::parse([
            "grace=5",
            "socket=/tmp/x.sock",
            "timeout_ms=250",
            "default=on",
            "log=/var/log/rfaas-spank.log",
        ]);
        assert!(bad.is_empty(), "{bad:?}");
        assert_eq!(s.grace, Duration::from_secs(5));
        assert_eq!(s.socket, PathBuf::from("/tmp/x.sock"));
        assert_eq!(s.timeout, Duration::from_millis(250));
        assert!(s.rfaas_by_default);
        assert_eq!(s.log_file, Some(PathBuf::from("/var/log/rfaas-spank.log")));
    }

    #[test]
    fn bad_words_are_reported_and_keep_the_default() {
        let (s, bad) = Settings::parse([
            "grace=soon",
            "grace=99999",
            "timeout_ms=0",
            "socket=relative.sock",
            "default=maybe",
            "colour=blue",
            "verbose",
            "grace=7",
        ]);
        assert_eq!(s.grace, Duration::from_secs(7), "a later good word counts");
        assert_eq!(s.timeout, Duration::from_millis(DEFAULT_TIMEOUT_MS));
        assert_eq!(s.socket, PathBuf::from(DEFAULT_LOCAL_SOCKET));
        assert!(!s.rfaas_by_default);
        let words: Vec<&str> = bad.iter().map(|b| b.word.as_str()).collect();
        assert_eq!(
            words,
            [
                "grace=soon",
                "grace=99999",
                "timeout_ms=0",
                "socket=relative.sock",
                "default=maybe",
                "colour=blue",
                "verbose"
            ]
        );
        let unknown = bad[5].to_string();
        assert!(unknown.contains("unknown key \"colour\""), "{unknown}");
        assert!(unknown.contains("grace, socket"), "{unknown}");
        assert!(bad[0].reason.contains("seconds"), "{}", bad[0].reason);
    }

    #[test]
    fn rfaas_option_values() {
        assert_eq!(RfaasChoice::parse(None), Ok(RfaasChoice::Yes));
        assert_eq!(RfaasChoice::parse(Some("yes")), Ok(RfaasChoice::Yes));
        assert_eq!(RfaasChoice::parse(Some("(null)")), Ok(RfaasChoice::Yes));
        assert_eq!(RfaasChoice::parse(Some("no")), Ok(RfaasChoice::No));
        let e = RfaasChoice::parse(Some("maybe")).unwrap_err();
        assert!(e.contains("--rfaas=no"), "{e}");
    }

    #[test]
    fn the_socket_may_name_the_node() {
        let (s, bad) = Settings::parse(["socket=/run/rfaas/executord-%n.sock"]);
        assert!(bad.is_empty(), "{bad:?}");
        assert_eq!(
            s.socket_for(Some("node2")).unwrap(),
            PathBuf::from("/run/rfaas/executord-node2.sock")
        );
        assert_eq!(
            s.socket_for(None).unwrap(),
            PathBuf::from("/run/rfaas/executord-%n.sock")
        );
        let (plain, _) = Settings::parse(["socket=/run/rfaas/executord.sock"]);
        assert_eq!(
            plain.socket_for(Some("node2")).unwrap(),
            PathBuf::from("/run/rfaas/executord.sock")
        );
        let (_, bad) = Settings::parse(["socket=/run/%h.sock"]);
        assert_eq!(bad.len(), 1, "{bad:?}");
    }

    #[test]
    fn a_node_name_that_leaves_the_directory_names_no_socket() {
        let (s, _) = Settings::parse(["socket=/run/rfaas/executord-%n.sock"]);
        for name in [
            "../../x", "a/b", "..", ".hidden", "", "n\n1", "node 1", "nöde",
        ] {
            let e = s.socket_for(Some(name)).unwrap_err();
            assert!(e.contains("not a Slurm node name"), "{name:?}: {e}");
        }
        for name in ["node1", "cn-0042.cluster", "gpu_a100-7"] {
            assert!(s.socket_for(Some(name)).is_ok(), "{name}");
        }
    }
}

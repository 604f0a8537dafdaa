//! Where rfaas's daemons and tools find their files: one configuration
//! directory, `/etc/rfaas` unless `--config-dir` or `RFAAS_CONFIG_DIR`
//! moves it, in which each finds its own file (`manager.toml`,
//! `executord.toml`, ...) and the ones several share (the admin token, the
//! lease keys, the node credential).
//!
//! A file named by its own flag or key (`--config`, `--token-file`,
//! `lease_keys = [...]`) is used as given; the directory only supplies the
//! defaults. Every message about a file that cannot be read ends with
//! [`ConfigDir::hint`], which names what moves it.

use std::ffi::OsString;
use std::fmt;
use std::io;
use std::path::{Path, PathBuf};

/// The configuration directory when nothing moves it.
pub const DEFAULT_CONFIG_DIR: &str = "/etc/rfaas";

/// The environment variable that moves the configuration directory.
pub const CONFIG_DIR_ENV: &str = "RFAAS_CONFIG_DIR";

/// The flag that moves it, on every daemon and tool.
pub const CONFIG_DIR_FLAG: &str = "--config-dir";

/// `rfaas-manager`'s own file.
pub const MANAGER_TOML: &str = "manager.toml";
/// `rfaas-executord`'s own file.
pub const EXECUTORD_TOML: &str = "executord.toml";
/// `rfaas-accounting`'s own file.
pub const ACCOUNTING_TOML: &str = "accounting.toml";
/// The rates and budgets, read by `rfaas-accounting` and `rfaas-billing`.
pub const BILLING_TOML: &str = "billing.toml";
/// The admin token: the manager's copy and `rfaasctl`'s (root only).
pub const ADMIN_TOKEN: &str = "admin.token";
/// The Ed25519 secret key a manager signs lease tokens with (root only).
pub const LEASE_KEY_SECRET: &str = "lease-key.secret";
/// The public keys executor daemons check lease tokens with.
pub const LEASE_KEYS_PUB: &str = "lease-keys.pub";
/// A node's credential, with which its executor daemon speaks to the
/// managers and the accounting services (root only).
pub const NODE_CREDENTIAL: &str = "node.credential";
/// The PostgreSQL password of a `database` URL that names none, so the
/// configuration files need not hold it (root only).
pub const DATABASE_PASSWORD: &str = "database.password";

/// The configuration directory a process runs with, and what chose it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigDir {
    path: PathBuf,
    chosen_by: ChosenBy,
}

/// A program's own file that exists, or was named, but cannot be read.
#[derive(Debug, thiserror::Error)]
#[error("cannot read the configuration file {path}: {source}; {hint}")]
pub struct Unreadable {
    /// The file.
    pub path: PathBuf,
    /// Why.
    #[source]
    pub source: io::Error,
    /// What names another ([`ConfigDir::hint`]).
    pub hint: String,
}

/// What chose the configuration directory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChosenBy {
    /// `--config-dir`.
    Flag,
    /// `RFAAS_CONFIG_DIR`.
    Env,
    /// Nothing: [`DEFAULT_CONFIG_DIR`].
    Default,
}

impl ConfigDir {
    /// `--config-dir`'s value if given, else `RFAAS_CONFIG_DIR` if set and
    /// not empty, else `/etc/rfaas`.
    pub fn resolve(flag: Option<&Path>) -> ConfigDir {
        ConfigDir::from_parts(flag, std::env::var_os(CONFIG_DIR_ENV))
    }

    /// As [`resolve`](Self::resolve), with the environment's value given.
    pub fn from_parts(flag: Option<&Path>, env: Option<OsString>) -> ConfigDir {
        match (flag, env.filter(|v| !v.is_empty())) {
            (Some(dir), _) => ConfigDir {
                path: dir.to_path_buf(),
                chosen_by: ChosenBy::Flag,
            },
            (None, Some(dir)) => ConfigDir {
                path: PathBuf::from(dir),
                chosen_by: ChosenBy::Env,
            },
            (None, None) => ConfigDir::default(),
        }
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// What chose it.
    pub fn chosen_by(&self) -> ChosenBy {
        self.chosen_by
    }

    /// The file `name` in the directory.
    pub fn file(&self, name: &str) -> PathBuf {
        self.path.join(name)
    }

    /// The text of a program's own file, and its path: `given` (its
    /// `--config`), which must be read, else `name` in the directory when
    /// it exists; `None` when it does not (the program's defaults apply).
    pub fn read_own(
        &self,
        given: Option<&Path>,
        name: &str,
    ) -> Result<Option<(PathBuf, String)>, Unreadable> {
        if let Some(path) = given {
            return read_named(path).map(|text| Some((path.to_path_buf(), text)));
        }
        let path = self.file(name);
        match std::fs::read_to_string(&path) {
            Ok(text) => Ok(Some((path, text))),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(source) => Err(Unreadable {
                path,
                source,
                hint: self.hint(&["--config"]),
            }),
        }
    }

    /// The end of a message about a file that cannot be read: what moves
    /// it. `own` names the flags, variables or keys that name this file
    /// alone (`["--token-file", "RFAAS_ADMIN_TOKEN_FILE"]`), if any.
    pub fn hint(&self, own: &[&str]) -> String {
        let own = match own {
            [] => None,
            [one] => Some(format!("give another with {one}")),
            [first @ .., last] => Some(format!("give another with {} or {last}", first.join(", "))),
        };
        let dir = self.path.display();
        let set_by = match self.chosen_by {
            ChosenBy::Default => {
                let moving = format!(
                    "move the configuration directory {dir} with {CONFIG_DIR_FLAG} or {CONFIG_DIR_ENV}"
                );
                return match own {
                    Some(own) => format!("{own}, or {moving}"),
                    None => moving,
                };
            }
            ChosenBy::Flag => CONFIG_DIR_FLAG,
            ChosenBy::Env => CONFIG_DIR_ENV,
        };
        let from = format!("the configuration directory {dir} was set by {set_by}");
        match own {
            Some(own) => format!("{own}; {from}"),
            None => from,
        }
    }
}

/// The text of a configuration file named by `--config`.
pub fn read_named(path: &Path) -> Result<String, Unreadable> {
    std::fs::read_to_string(path).map_err(|source| Unreadable {
        path: path.to_path_buf(),
        source,
        hint: "give another with --config".to_owned(),
    })
}

impl Default for ConfigDir {
    fn default() -> ConfigDir {
        ConfigDir {
            path: PathBuf::from(DEFAULT_CONFIG_DIR),
            chosen_by: ChosenBy::Default,
        }
    }
}

impl fmt::Display for ConfigDir {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.path.display().fmt(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_flag_beats_the_variable_beats_the_default() {
        let d = ConfigDir::from_parts(Some(Path::new("/srv/a")), Some("/srv/b".into()));
        assert_eq!(
            (d.path(), d.chosen_by()),
            (Path::new("/srv/a"), ChosenBy::Flag)
        );
        let d = ConfigDir::from_parts(None, Some("/srv/b".into()));
        assert_eq!(
            (d.path(), d.chosen_by()),
            (Path::new("/srv/b"), ChosenBy::Env)
        );
        let d = ConfigDir::from_parts(None, Some("".into()));
        assert_eq!(
            (d.path(), d.chosen_by()),
            (Path::new("/etc/rfaas"), ChosenBy::Default)
        );
        let d = ConfigDir::from_parts(None, None);
        assert_eq!(d.file(ADMIN_TOKEN), Path::new("/etc/rfaas/admin.token"));
    }

    #[test]
    fn hints_name_what_moves_the_file() {
        let d = ConfigDir::default();
        assert_eq!(
            d.hint(&["--token-file", "RFAAS_ADMIN_TOKEN_FILE"]),
            "give another with --token-file or RFAAS_ADMIN_TOKEN_FILE, or move the \
             configuration directory /etc/rfaas with --config-dir or RFAAS_CONFIG_DIR"
        );
        assert_eq!(
            d.hint(&["--config"]),
            "give another with --config, or move the configuration directory /etc/rfaas \
             with --config-dir or RFAAS_CONFIG_DIR"
        );
        assert_eq!(
            d.hint(&[]),
            "move the configuration directory /etc/rfaas with --config-dir or RFAAS_CONFIG_DIR"
        );
        let d = ConfigDir::from_parts(None, Some("/srv/rfaas".into()));
        assert_eq!(
            d.hint(&["a", "b", "c"]),
            "give another with a, b or c; the configuration directory /srv/rfaas was set \
             by RFAAS_CONFIG_DIR"
        );
        let d = ConfigDir::from_parts(Some(Path::new("/srv/x")), None);
        assert_eq!(
            d.hint(&[]),
            "the configuration directory /srv/x was set by --config-dir"
        );
    }

    #[test]
    fn a_programs_own_file_is_read_or_absent_or_unreadable() {
        let dir = std::env::temp_dir().join(format!("rfaas-files-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("manager.toml")).unwrap();
        std::fs::write(dir.join("executord.toml"), "x = 1\n").unwrap();
        let d = ConfigDir::from_parts(Some(&dir), None);
        // Present: its text.
        let (path, text) = d.read_own(None, EXECUTORD_TOML).unwrap().unwrap();
        assert_eq!(
            (path, text.as_str()),
            (dir.join("executord.toml"), "x = 1\n")
        );
        // Absent from the directory: the defaults.
        assert!(d.read_own(None, ACCOUNTING_TOML).unwrap().is_none());
        // Named but absent, or there but unreadable: an error naming it.
        let e = d
            .read_own(Some(&dir.join("none.toml")), ACCOUNTING_TOML)
            .unwrap_err();
        assert!(
            e.to_string().contains("none.toml") && e.hint.contains("--config"),
            "{e}"
        );
        let e = d.read_own(None, MANAGER_TOML).unwrap_err();
        assert_eq!(e.path, dir.join("manager.toml"));
        assert!(e.to_string().contains("was set by --config-dir"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}

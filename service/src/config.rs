//! A program's TOML configuration file: read, parsed into the program's
//! type (whose serde attributes refuse unknown keys, so a misspelt option
//! is an error, not a silent default), and the errors that say which file
//! and key; and the servers' logging.

use std::path::{Path, PathBuf};

use rfaas_proto::files::{self, ConfigDir, Unreadable};
use serde::de::DeserializeOwned;

/// Why the configuration cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file cannot be read.
    #[error(transparent)]
    Read(#[from] Unreadable),
    /// The file is not valid TOML for the program.
    #[error("the configuration {path} is invalid: {message}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// The parser's message (it names the key).
        message: String,
    },
    /// A value is out of range.
    #[error("the configuration is invalid: {0}")]
    Invalid(String),
    /// A file the configuration refers to cannot be used (the message
    /// names it and what moves it).
    #[error("{0}")]
    Unusable(String),
}

/// Reads and parses the TOML configuration `path` into `T` (whose serde
/// attributes refuse unknown keys).
pub fn load_toml<T: DeserializeOwned>(path: &Path) -> Result<T, ConfigError> {
    let text = files::read_named(path)?;
    parse_toml(&text).map_err(|message| ConfigError::Parse {
        path: path.to_owned(),
        message,
    })
}

/// Parses TOML configuration text into `T`; the error is the parser's
/// message, which names the key.
pub fn parse_toml<T: DeserializeOwned>(text: &str) -> Result<T, String> {
    toml::from_str(text).map_err(|e| e.to_string())
}

/// The configuration a program starts with: `path` (`--config`) when
/// given (it must load), else the file `name` in the configuration
/// directory when it exists, else the defaults.
pub fn load_or_default<T: DeserializeOwned + Default>(
    path: Option<&Path>,
    dir: &ConfigDir,
    name: &str,
) -> Result<T, ConfigError> {
    match dir.read_own(path, name)? {
        Some((path, text)) => {
            parse_toml(&text).map_err(|message| ConfigError::Parse { path, message })
        }
        None => Ok(T::default()),
    }
}

/// Logs to stderr without colours, at info (debug with `verbose` > 0):
/// the manager's and the accounting service's logging.
pub fn init_logging(verbose: u8) {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_max_level(if verbose > 0 {
            tracing::Level::DEBUG
        } else {
            tracing::Level::INFO
        })
        .with_ansi(false)
        .init();
}

/// Serializes a database URL without its password, for `--check-config`.
pub fn redacted<S: serde::Serializer>(url: &str, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&crate::db::redact(url))
}

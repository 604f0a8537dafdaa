//! The bench's one error type: a sentence saying what failed, plus the
//! `io::Error` underneath when there is one.

use std::fmt;
use std::io;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug)]
pub struct Error {
    message: String,
    source: Option<io::Error>,
}

impl Error {
    pub fn new(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            source: None,
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.source {
            Some(source) => write!(f, "{}: {source}", self.message),
            None => f.write_str(&self.message),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source.as_ref().map(|e| e as _)
    }
}

/// `.context(|| format!(...))` on an `io::Result`, as `anyhow` would.
pub trait Context<T> {
    fn context(self, message: impl FnOnce() -> String) -> Result<T>;
}

impl<T> Context<T> for io::Result<T> {
    fn context(self, message: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|source| Error {
            message: message(),
            source: Some(source),
        })
    }
}

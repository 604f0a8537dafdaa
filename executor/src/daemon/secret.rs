//! The cluster secret: raw bytes in a file only its owner may read.

use std::io::Read;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use rfaas_proto::lease::MIN_SECRET_LEN;

/// Why the secret file cannot be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SecretError {
    /// It could not be read.
    #[error("cannot read the secret file {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Group or others have access.
    #[error("the secret file {path} has mode {mode:04o}: others than its owner may access it; run `chmod 600 {path}`")]
    Mode {
        /// The file.
        path: PathBuf,
        /// Its permission bits.
        mode: u32,
    },
    /// Running as root, but the file belongs to someone else, who could
    /// change the secret.
    #[error("the secret file {path} is owned by uid {uid}, but the daemon runs as root: it must be owned by root; run `chown root {path}`")]
    Owner {
        /// The file.
        path: PathBuf,
        /// Its owner.
        uid: u32,
    },
    /// Too short.
    #[error("the secret in {path} is {len} bytes; it must be at least {MIN_SECRET_LEN} bytes (make one with `rfaas-token gen-secret`)")]
    Short {
        /// The file.
        path: PathBuf,
        /// Its length after trimming.
        len: usize,
    },
}

/// Reads the secret in `path`: its bytes, less one trailing newline
/// (`\n` or `\r\n`). Refuses a file that group or others may access, one
/// not owned by root when this process runs as root, and one shorter than
/// [`MIN_SECRET_LEN`].
pub fn read_secret(path: &Path) -> Result<Vec<u8>, SecretError> {
    let read_err = |source| SecretError::Read {
        path: path.to_owned(),
        source,
    };
    let mut file = std::fs::File::open(path).map_err(read_err)?;
    let meta = file.metadata().map_err(read_err)?;
    let mode = meta.mode() & 0o7777;
    if mode & 0o077 != 0 {
        return Err(SecretError::Mode {
            path: path.to_owned(),
            mode,
        });
    }
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 && meta.uid() != 0 {
        return Err(SecretError::Owner {
            path: path.to_owned(),
            uid: meta.uid(),
        });
    }
    let mut bytes = Vec::new();
    file.read_to_end(&mut bytes).map_err(read_err)?;
    if bytes.last() == Some(&b'\n') {
        bytes.pop();
        if bytes.last() == Some(&b'\r') {
            bytes.pop();
        }
    }
    if bytes.len() < MIN_SECRET_LEN {
        return Err(SecretError::Short {
            path: path.to_owned(),
            len: bytes.len(),
        });
    }
    Ok(bytes)
}

/// Writes `len` random bytes (from `/dev/urandom`) to a new file `path`
/// with mode 0600. The last byte is never a newline, so no reader trims it.
pub fn generate_secret(path: &Path, len: usize) -> std::io::Result<()> {
    let mut bytes = vec![0u8; len];
    let mut urandom = std::fs::File::open("/dev/urandom")?;
    urandom.read_exact(&mut bytes)?;
    while matches!(bytes.last(), Some(b'\n' | b'\r')) {
        let mut b = [0u8; 1];
        urandom.read_exact(&mut b)?;
        *bytes.last_mut().expect("len > 0") = b[0];
    }
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)?;
    std::io::Write::write_all(&mut file, &bytes)?;
    file.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn temp(name: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("rfaas-secret-test-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir.join("secret")
    }

    #[test]
    fn generate_then_read() {
        let p = temp("gen");
        generate_secret(&p, 48).unwrap();
        let mode = std::fs::metadata(&p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        assert_eq!(read_secret(&p).unwrap().len(), 48);
        assert!(generate_secret(&p, 48).is_err(), "never overwrites");
        std::fs::remove_dir_all(p.parent().unwrap()).unwrap();
    }

    #[test]
    fn refuses_open_modes_and_short_secrets() {
        let p = temp("open");
        std::fs::write(&p, b"0123456789abcdef0123456789abcdef\n").unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
        let err = read_secret(&p).unwrap_err();
        assert!(err.to_string().contains("mode 0644"), "{err}");
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(
            read_secret(&p).unwrap(),
            b"0123456789abcdef0123456789abcdef"
        );
        std::fs::write(&p, b"short\n").unwrap();
        assert!(matches!(
            read_secret(&p),
            Err(SecretError::Short { len: 5, .. })
        ));
        std::fs::remove_dir_all(p.parent().unwrap()).unwrap();
    }
}

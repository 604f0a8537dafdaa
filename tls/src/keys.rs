//! Lease key files: the public keys an executor accepts lease tokens from
//! (`lease_keys`), and the secret key `rfaas-token mint` signs with.
//! Formats in [`rfaas_proto::lease`].
//!
//! An executor holds public keys only: whoever reads them can check
//! tokens, not mint them. Whoever can write them can make the daemon trust
//! a key of their own, so a public key file must not be writable by group
//! or others. A secret key mints leases for every node that accepts it:
//! only its owner may access it. Root or the daemon's user must own both
//! (root, under root): [`crate::files`] checks them.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use crate::files::{check_private_file, check_protected_file};
use rfaas_proto::lease::{KeyError, LeaseKeys, LeaseSigner};

/// Why a key file cannot be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KeyFileError {
    /// It could not be read.
    #[error("cannot read the key file {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Its mode or owner lets others than root or this daemon's user
    /// read a secret key or change a public one (the sentence says which,
    /// and the command that fixes it).
    #[error("{0}")]
    Unsafe(String),
    /// The text holds no usable key.
    #[error("the key file {path}: {source}")]
    Key {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        #[source]
        source: KeyError,
    },
    /// `lease_keys` names no file.
    #[error("lease_keys names no file: without a public key every lease is refused; set it to the manager's public key file")]
    NoFiles,
    /// A new key file could not be written.
    #[error("cannot write the key file {path}: {source}")]
    Write {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// Reads the text of `path` once `check` passed.
fn read_checked(
    path: &Path,
    check: impl FnOnce(&Path) -> Result<(), String>,
) -> Result<String, KeyFileError> {
    check(path).map_err(KeyFileError::Unsafe)?;
    std::fs::read_to_string(path).map_err(|source| KeyFileError::Read {
        path: path.to_owned(),
        source,
    })
}

/// Reads the secret key in `path`. Refuses a file that group or others may
/// access, and one not owned by root when this process runs as root.
pub fn read_secret_key(path: &Path) -> Result<LeaseSigner, KeyFileError> {
    let text = read_checked(path, |p| check_private_file(p, "the secret key file"))?;
    LeaseSigner::from_text(&text).map_err(|source| KeyFileError::Key {
        path: path.to_owned(),
        source,
    })
}

/// Reads every public key in `paths` (at least one file). Refuses a file
/// that group or others may write, and one not owned by root when this
/// process runs as root.
pub fn read_lease_keys(paths: &[PathBuf]) -> Result<LeaseKeys, KeyFileError> {
    if paths.is_empty() {
        return Err(KeyFileError::NoFiles);
    }
    let mut keys = LeaseKeys::new();
    for path in paths {
        let text = read_checked(path, |p| {
            check_protected_file(
                p,
                "the public key file",
                "others than its owner may change which leases this node accepts",
            )
        })?;
        keys.add_text(&text).map_err(|source| KeyFileError::Key {
            path: path.clone(),
            source,
        })?;
    }
    Ok(keys)
}

/// Writes `signer`'s secret key to a new file `secret` (mode 0600) and its
/// public key to a new file `public` (mode 0644). Existing files are never
/// overwritten.
pub fn write_key_pair(
    signer: &LeaseSigner,
    secret: &Path,
    public: &Path,
) -> Result<(), KeyFileError> {
    write_new(secret, 0o600, &signer.to_secret_line())?;
    write_new(public, 0o644, &signer.public_key().to_line())
}

fn write_new(path: &Path, mode: u32, text: &str) -> Result<(), KeyFileError> {
    let write_err = |source| KeyFileError::Write {
        path: path.to_owned(),
        source,
    };
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(path)
        .map_err(write_err)?;
    file.write_all(text.as_bytes()).map_err(write_err)?;
    file.sync_all().map_err(write_err)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn temp(name: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("rfaas-keys-test-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn mode_of(p: &Path) -> u32 {
        std::fs::metadata(p).unwrap().permissions().mode() & 0o777
    }

    #[test]
    fn write_then_read() {
        let dir = temp("pair");
        let (secret, public) = (dir.join("k.secret"), dir.join("k.pub"));
        let signer = LeaseSigner::generate("site-1").unwrap();
        write_key_pair(&signer, &secret, &public).unwrap();
        assert_eq!(mode_of(&secret), 0o600);
        assert_eq!(mode_of(&public), 0o644);
        let back = read_secret_key(&secret).unwrap();
        assert_eq!(back.public_key(), signer.public_key());
        let keys = read_lease_keys(std::slice::from_ref(&public)).unwrap();
        assert_eq!(keys.key_ids().collect::<Vec<_>>(), ["site-1"]);
        let err = write_key_pair(&signer, &secret, &dir.join("other.pub")).unwrap_err();
        assert!(
            matches!(err, KeyFileError::Write { .. }),
            "never overwrites"
        );
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn refuses_open_modes() {
        let dir = temp("modes");
        let (secret, public) = (dir.join("k.secret"), dir.join("k.pub"));
        write_key_pair(&LeaseSigner::generate("a").unwrap(), &secret, &public).unwrap();
        std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o640)).unwrap();
        let err = read_secret_key(&secret).unwrap_err();
        assert!(err.to_string().contains("mode 0640"), "{err}");
        std::fs::set_permissions(&public, std::fs::Permissions::from_mode(0o664)).unwrap();
        let err = read_lease_keys(std::slice::from_ref(&public)).unwrap_err();
        assert!(
            matches!(err, KeyFileError::Unsafe(ref m) if m.contains("mode 0664")),
            "{err}"
        );
        assert!(err.to_string().contains("chmod go-w"), "{err}");
        std::fs::set_permissions(&public, std::fs::Permissions::from_mode(0o444)).unwrap();
        assert_eq!(read_lease_keys(&[public]).unwrap().len(), 1);
        assert!(matches!(read_lease_keys(&[]), Err(KeyFileError::NoFiles)));
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn several_files_rotate_and_bad_text_names_the_file() {
        let dir = temp("rotate");
        let (old, new) = (
            LeaseSigner::generate("old").unwrap(),
            LeaseSigner::generate("new").unwrap(),
        );
        write_key_pair(&old, &dir.join("old.secret"), &dir.join("old.pub")).unwrap();
        write_key_pair(&new, &dir.join("new.secret"), &dir.join("new.pub")).unwrap();
        let keys = read_lease_keys(&[dir.join("old.pub"), dir.join("new.pub")]).unwrap();
        assert_eq!(keys.key_ids().collect::<Vec<_>>(), ["new", "old"]);
        // A secret key where a public one belongs.
        let err = read_lease_keys(&[dir.join("old.pub"), dir.join("new.secret")]).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("new.secret") && msg.contains("line 1"),
            "{msg}"
        );
        std::fs::remove_dir_all(dir).unwrap();
    }
}

//! Files whose mode and owner are checked before they are trusted: keys,
//! credentials, passwords (private to their owner) and files that say whom
//! to trust (written by their owner only). The owner must be root or the
//! user this process runs as (root, when it runs as root). One check for
//! every daemon and tool, so each refuses the same files with the same
//! sentence.

use std::path::Path;

/// Checks that `path` (a key, credential or password file; `what` names it
/// in the message) is private: no access for group or others, and owned
/// by root or by this process's user (by root when this runs as root).
pub fn check_private_file(path: &Path, what: &str) -> Result<(), String> {
    check_file(
        path,
        what,
        0o077,
        "others than its owner may access it",
        "chmod 600",
    )
}

/// Checks that `path` (a file that says whom to trust, such as public
/// keys; `what` names it) is written by its owner only, and owned by root
/// or by this process's user (by root when this runs as root). `risk`
/// says what a stranger who could write it would get.
pub fn check_protected_file(path: &Path, what: &str, risk: &str) -> Result<(), String> {
    check_file(path, what, 0o022, risk, "chmod go-w")
}

fn check_file(
    path: &Path,
    what: &str,
    forbidden: u32,
    problem: &str,
    fix: &str,
) -> Result<(), String> {
    use std::os::unix::fs::MetadataExt;
    let shown = path.display();
    let meta = std::fs::metadata(path).map_err(|e| format!("cannot read {what} {shown}: {e}"))?;
    let mode = meta.mode() & 0o7777;
    if mode & forbidden != 0 {
        return Err(format!(
            "{what} {shown} has mode {mode:04o}: {problem}; run `{fix} {shown}`"
        ));
    }
    // SAFETY: geteuid has no preconditions and cannot fail.
    let euid = unsafe { libc::geteuid() };
    let owner = meta.uid();
    if owner != 0 && (euid == 0 || owner != euid) {
        let who = if euid == 0 {
            "root".to_owned()
        } else {
            format!("root or uid {euid}, which this runs as")
        };
        return Err(format!(
            "{what} {shown} is owned by uid {owner}: it must be owned by {who}; run `chown root {shown}`"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_secret_file_others_may_read_is_refused_with_the_fix() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("rfaas-files-mode-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("server.key");
        std::fs::write(&f, "secret").unwrap();
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = check_private_file(&f, "the TLS key file").unwrap_err();
        assert!(
            e.contains("the TLS key file") && e.contains("mode 0644") && e.contains("chmod 600"),
            "{e}"
        );
        assert!(check_protected_file(&f, "the public key file", "x").is_ok());
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o600)).unwrap();
        check_private_file(&f, "the TLS key file").unwrap();
        std::fs::set_permissions(&f, std::fs::Permissions::from_mode(0o664)).unwrap();
        let e =
            check_protected_file(&f, "the public key file", "strangers pick the keys").unwrap_err();
        assert!(
            e.contains("strangers pick the keys") && e.contains("chmod go-w"),
            "{e}"
        );
        let e = check_private_file(&dir.join("missing"), "the TLS key file").unwrap_err();
        assert!(e.contains("cannot read the TLS key file"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

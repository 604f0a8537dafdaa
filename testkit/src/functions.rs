//! The example function libraries, built for tests.
//!
//! [`c_library`] compiles every `examples/functions/c/*.c` into one shared
//! object, `libfunctions.so`, under the target directory, once per source
//! change; concurrent test processes each build into a private file and
//! rename it into place, so none sees a half-written library.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::SystemTime;

use crate::{repo_root, target_dir};

/// The C example functions as one shared library; builds it when a source
/// is newer than the library. Panics with the compiler's output on failure.
pub fn c_library() -> PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        let dir = repo_root().join("examples/functions/c");
        let mut sources: Vec<PathBuf> = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("cannot list {}: {e}", dir.display()))
            .map(|e| e.expect("directory entry").path())
            .filter(|p| p.extension().is_some_and(|x| x == "c"))
            .collect();
        sources.sort();
        let out_dir = target_dir().join("rfaas-functions");
        std::fs::create_dir_all(&out_dir).expect("create the function library directory");
        let lib = out_dir.join("libfunctions.so");
        if !is_fresh(&lib, &sources) {
            compile(&sources, &lib, &["-lm"]);
        }
        lib
    })
    .clone()
}

/// The C example functions' bytes, as a client ships them.
pub fn c_library_bytes() -> Vec<u8> {
    std::fs::read(c_library()).expect("read libfunctions.so")
}

/// Compiles C `sources` into the shared object `out` with `cc -shared
/// -fPIC -O2`, then `extra` flags (libraries). Panics with the compiler's
/// output on failure.
pub fn compile(sources: &[PathBuf], out: &Path, extra: &[&str]) {
    let tmp = out.with_extension(format!("so.{}.tmp", std::process::id()));
    let output = Command::new("cc")
        .args(["-shared", "-fPIC", "-O2", "-Wall", "-Wextra", "-o"])
        .arg(&tmp)
        .args(sources)
        .args(extra)
        .output()
        .expect("run cc (install gcc)");
    assert!(
        output.status.success(),
        "cc failed for {sources:?}:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    std::fs::rename(&tmp, out).expect("move the library into place");
}

fn is_fresh(lib: &Path, sources: &[PathBuf]) -> bool {
    let mtime = |p: &Path| {
        std::fs::metadata(p)
            .and_then(|m| m.modified())
            .unwrap_or(SystemTime::UNIX_EPOCH)
    };
    let built = match std::fs::metadata(lib).and_then(|m| m.modified()) {
        Ok(t) => t,
        Err(_) => return false,
    };
    sources.iter().all(|s| mtime(s) <= built)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builds_a_library_with_the_basic_functions() {
        let lib = c_library();
        let bytes = std::fs::read(&lib).unwrap();
        assert_eq!(&bytes[..4], b"\x7fELF");
        let nm = Command::new("nm").arg("-D").arg(&lib).output().unwrap();
        let symbols = String::from_utf8_lossy(&nm.stdout);
        for f in ["noop", "echo", "fault_segfault", "sleep_ms"] {
            assert!(
                symbols.lines().any(|l| l.ends_with(&format!(" T {f}"))),
                "{f} not exported:\n{symbols}"
            );
        }
    }
}

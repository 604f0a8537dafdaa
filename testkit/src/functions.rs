//! The example function libraries, built for tests.
//!
//! - [`c_library`] compiles every `examples/functions/c/*.c` into one
//!   shared object, `libfunctions.so`, under the target directory, once per
//!   source change; concurrent test processes each build into a private
//!   file and rename it into place, so none sees a half-written library.
//! - [`rust_library`] finds the `rfaas-example-functions` cdylib that cargo
//!   builds with the workspace (and builds it when it is missing).
//! - [`rfaas_compat_library`] compiles `examples/functions/rfaas-compat/
//!   functions.cpp`, rFaaS's own example functions, with `c++`.
//! - [`wait_in_sleep_ms`] waits until a worker runs `sleep_ms`, so a test
//!   acts while a call is inside its function, not after a guessed delay.
//! - [`CrashOnce`] is the marker file `fault_segfault_once` crashes on
//!   creating.

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
            // No fused multiply-adds (aarch64 has them by default), so
            // matmul's results are bit-identical to the Rust library's.
            compile(&sources, &lib, &["-lm", "-ffp-contract=off"]);
        }
        lib
    })
    .clone()
}

/// The C example functions' bytes, as a client ships them.
pub fn c_library_bytes() -> Vec<u8> {
    std::fs::read(c_library()).expect("read libfunctions.so")
}

/// The Rust example functions (`examples/functions/rust`, crate
/// `rfaas-example-functions`): `target_dir()/debug/
/// librfaas_example_functions.so`. Cargo builds it with the workspace; when
/// it is missing or older than the crate's sources this runs `cargo build
/// -p rfaas-example-functions` once. Panics with cargo's output when the
/// library cannot be built.
pub fn rust_library() -> PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        let lib = target_dir().join("debug/librfaas_example_functions.so");
        let crate_dir = repo_root().join("examples/functions/rust");
        let src = crate_dir.join("src");
        let mut sources: Vec<PathBuf> = std::fs::read_dir(&src)
            .unwrap_or_else(|e| panic!("cannot list {}: {e}", src.display()))
            .map(|e| e.expect("directory entry").path())
            .collect();
        sources.push(crate_dir.join("Cargo.toml"));
        if is_fresh(&lib, &sources) {
            return lib;
        }
        // `CARGO` is set when cargo runs the tests: the same toolchain.
        let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
        let output = Command::new(cargo)
            .args(["build", "-p", "rfaas-example-functions"])
            .current_dir(repo_root())
            .output()
            .expect("run cargo to build rfaas-example-functions");
        assert!(
            output.status.success() && lib.is_file(),
            "`cargo build -p rfaas-example-functions` did not produce {}; run it by hand to \
             see why:\n{}",
            lib.display(),
            String::from_utf8_lossy(&output.stderr)
        );
        lib
    })
    .clone()
}

/// The Rust example functions' bytes, as a client ships them.
pub fn rust_library_bytes() -> Vec<u8> {
    std::fs::read(rust_library()).expect("read librfaas_example_functions.so")
}

/// rFaaS's own example functions (`empty`, `mmm`, `mmm3`), compiled from
/// `examples/functions/rfaas-compat/functions.cpp` into
/// `librfaas_compat.so` with `c++ -shared -fPIC -O2`, when the source is
/// newer than the library. Panics with the compiler's output on failure.
pub fn rfaas_compat_library() -> PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        let source = repo_root().join("examples/functions/rfaas-compat/functions.cpp");
        let out_dir = target_dir().join("rfaas-functions");
        std::fs::create_dir_all(&out_dir).expect("create the function library directory");
        let lib = out_dir.join("librfaas_compat.so");
        if !is_fresh(&lib, std::slice::from_ref(&source)) {
            compile_cxx(&[source], &lib, &[]);
        }
        lib
    })
    .clone()
}

/// rFaaS's example functions' bytes, as a client ships them.
pub fn rfaas_compat_library_bytes() -> Vec<u8> {
    std::fs::read(rfaas_compat_library()).expect("read librfaas_compat.so")
}

/// Compiles C `sources` into the shared object `out` with `cc -shared
/// -fPIC -O2`, then `extra` flags (libraries). Panics with the compiler's
/// output on failure.
pub fn compile(sources: &[PathBuf], out: &Path, extra: &[&str]) {
    compile_with("cc", sources, out, extra);
}

/// Compiles C++ `sources` into the shared object `out` with `c++ -shared
/// -fPIC -O2`, then `extra` flags. Panics with the compiler's output on
/// failure.
pub fn compile_cxx(sources: &[PathBuf], out: &Path, extra: &[&str]) {
    compile_with("c++", sources, out, extra);
}

fn compile_with(compiler: &str, sources: &[PathBuf], out: &Path, extra: &[&str]) {
    let tmp = out.with_extension(format!("so.{}.tmp", std::process::id()));
    let output = Command::new(compiler)
        .args(["-shared", "-fPIC", "-O2", "-Wall", "-Wextra", "-o"])
        .arg(&tmp)
        .args(sources)
        .args(extra)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {compiler} (install gcc and g++): {e}"));
    assert!(
        output.status.success(),
        "{compiler} failed for {sources:?}:\n{}",
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

/// Waits (up to 10 s, else panics) until a worker thread of the worker
/// process `pid` sleeps in `nanosleep`: it runs the C library's `sleep_ms`,
/// so a call is under way inside its function. Reads
/// `/proc/<pid>/task/*/syscall`, which needs the rights to trace the worker
/// (root, as the tests that start executors run).
pub fn wait_in_sleep_ms(pid: u32) {
    let in_sleep = |task: std::path::PathBuf| {
        let comm = std::fs::read_to_string(task.join("comm")).unwrap_or_default();
        let syscall = std::fs::read_to_string(task.join("syscall")).unwrap_or_default();
        let nr = syscall
            .split(' ')
            .next()
            .and_then(|n| n.parse::<i64>().ok());
        comm.starts_with("rfaas-serve")
            && nr.is_some_and(|n| n == libc::SYS_clock_nanosleep || n == libc::SYS_nanosleep)
    };
    crate::wait::wait_until(
        &format!("a lane of worker {pid} to enter sleep_ms"),
        std::time::Duration::from_secs(10),
        || {
            std::fs::read_dir(format!("/proc/{pid}/task"))
                .map(|tasks| tasks.filter_map(Result::ok).any(|t| in_sleep(t.path())))
                .unwrap_or(false)
        },
    );
}

/// The client library's example program `name` (`client/examples/`),
/// built by cargo when it is missing (`cargo build -p rfaas-client
/// --example name`). Panics with cargo's output when it cannot be built.
pub fn client_example(name: &str) -> PathBuf {
    let bin = target_dir().join("debug/examples").join(name);
    if bin.is_file() {
        return bin;
    }
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let output = Command::new(cargo)
        .args(["build", "-p", "rfaas-client", "--example", name])
        .current_dir(repo_root())
        .output()
        .expect("run cargo to build a client example");
    assert!(
        output.status.success() && bin.is_file(),
        "`cargo build -p rfaas-client --example {name}` did not produce {}:\n{}",
        bin.display(),
        String::from_utf8_lossy(&output.stderr)
    );
    bin
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
        for f in [
            "noop",
            "echo",
            "empty",
            "matmul",
            "jacobi",
            "black_scholes",
            "fault_segfault",
            "sleep_ms",
            "burn_cpu_ms",
            "meter_inflate",
            "meter_zero_burn",
        ] {
            assert!(
                symbols.lines().any(|l| l.ends_with(&format!(" T {f}"))),
                "{f} not exported:\n{symbols}"
            );
        }
    }
}

/// The input of `fault_segfault_once`: a path in the system's temporary
/// directory (which every user may create files in, the lease's user
/// too) that does not exist yet. The first call with it creates the file
/// and crashes; later ones echo it. The file is removed on drop.
#[derive(Debug)]
pub struct CrashOnce(PathBuf);

impl CrashOnce {
    /// A fresh marker path.
    pub fn new() -> CrashOnce {
        static SEQ: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let path =
            std::env::temp_dir().join(format!("rfaas-crash-once-{}-{n}", std::process::id()));
        let _ = std::fs::remove_file(&path);
        CrashOnce(path)
    }

    /// The function's input: `mib` of heap to touch before the crash,
    /// then the path.
    pub fn input(&self, mib: u32) -> Vec<u8> {
        use std::os::unix::ffi::OsStrExt;
        let mut v = mib.to_ne_bytes().to_vec();
        v.extend_from_slice(self.0.as_os_str().as_bytes());
        v
    }

    /// Whether the function has crashed on it (the file exists).
    pub fn crashed(&self) -> bool {
        self.0.exists()
    }
}

impl Default for CrashOnce {
    fn default() -> CrashOnce {
        CrashOnce::new()
    }
}

impl Drop for CrashOnce {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

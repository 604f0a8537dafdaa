//! Generates the plugin's Slurm declarations from the installed headers:
//! bindgen on `<slurm/spank.h>` and `<slurm/slurm_version.h>`, found in
//! `SLURM_INCLUDE_DIR`, else pkg-config's `includedir` for `slurm`, else
//! `/usr/include`. A missing header or a release outside the checked range
//! stops the build with one sentence saying what to do (see
//! `build/headers.rs`).

#[path = "build/headers.rs"]
#[allow(dead_code)]
mod headers;

use std::path::PathBuf;
use std::process::Command;

use headers::{Search, FUNCTIONS, INCLUDE_DIR_VAR, TYPES, UNCHECKED_VAR, VARS};

fn pkg_config_includedir() -> Option<PathBuf> {
    let out = Command::new("pkg-config")
        .args(["--variable=includedir", "slurm"])
        .output()
        .ok()?;
    let dir = String::from_utf8(out.stdout).ok()?;
    let dir = dir.trim();
    (out.status.success() && !dir.is_empty()).then(|| PathBuf::from(dir))
}

fn main() {
    println!("cargo:rerun-if-changed=build/headers.rs");
    println!("cargo:rerun-if-env-changed={INCLUDE_DIR_VAR}");
    println!("cargo:rerun-if-env-changed={UNCHECKED_VAR}");
    println!("cargo:rerun-if-env-changed=PKG_CONFIG_PATH");
    let from_env = std::env::var_os(INCLUDE_DIR_VAR)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from);
    let search = Search {
        from_pkg_config: if from_env.is_none() {
            pkg_config_includedir()
        } else {
            None
        },
        from_env,
        unchecked: std::env::var(UNCHECKED_VAR).is_ok_and(|v| v == "1"),
    };
    let found = match search.find() {
        Ok(found) => found,
        Err(message) => {
            // A sentence, not a panic's backtrace: cargo shows it as is.
            eprintln!("{message}");
            std::process::exit(1);
        }
    };
    let slurm = found.slurm_dir();
    let spank_h = slurm.join("spank.h");
    let version_h = slurm.join("slurm_version.h");
    println!("cargo:rerun-if-changed={}", spank_h.display());
    println!("cargo:rerun-if-changed={}", version_h.display());
    if !found.version.is_checked() {
        println!(
            "cargo:warning={}",
            headers::out_of_range(&version_h, found.version)
        );
    }
    // Not RFAAS_*: cargo sets these in the tests' environment too, and the
    // cluster tests read a job's RFAAS_* variables.
    println!("cargo:rustc-env=BUILT_FOR_SLURM={}", found.version);
    println!(
        "cargo:rustc-env=BUILT_FROM_SLURM_HEADERS={}",
        slurm.display()
    );

    let mut builder = bindgen::Builder::default()
        .header_contents(
            "rfaas_spank.h",
            "#include <slurm/spank.h>\n#include <slurm/slurm_version.h>\n",
        )
        .clang_arg(format!("-I{}", found.include_dir.display()))
        .prepend_enum_name(false)
        .layout_tests(false);
    for t in TYPES {
        builder = builder.allowlist_type(t);
    }
    for f in FUNCTIONS {
        builder = builder.allowlist_function(f);
    }
    for v in VARS {
        builder = builder.allowlist_var(v);
    }
    let bindings = match builder.generate() {
        Ok(b) => b,
        Err(e) => {
            eprintln!(
                "rfaas_spank: bindgen could not read {} ({e:?}); is libclang installed \
                 (libclang-dev on Debian/Ubuntu, clang-devel on the RHEL family)?",
                spank_h.display()
            );
            std::process::exit(1);
        }
    };
    let out = PathBuf::from(std::env::var_os("OUT_DIR").unwrap_or_default()).join("spank.rs");
    if let Err(e) = bindings.write_to_file(&out) {
        eprintln!("rfaas_spank: cannot write {}: {e}", out.display());
        std::process::exit(1);
    }
}

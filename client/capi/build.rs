//! Writes `include/rfaas.h` from the crate's `extern "C"` items with
//! cbindgen (`cbindgen.toml`). The header is checked in; the file is only
//! rewritten when its text changes, so an unchanged build leaves it (and
//! its timestamp) alone, and `scripts/build-capi.sh` can fail on a stale
//! checked-in copy.
//!
//! It also gives `librfaas.so` the SONAME `librfaas.so.1`: programs linked
//! against it record that name, so a package can ship `librfaas.so.1` for
//! them and an incompatible `librfaas.so.2` later beside it. (1 since
//! `rfaas_alloc_options` grew `lanes` and `slots`.)

use std::path::PathBuf;

fn main() {
    let crate_dir =
        PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    println!("cargo:rerun-if-changed=src");
    println!("cargo:rerun-if-changed=cbindgen.toml");
    // The major version of the C ABI; raise it with any incompatible change
    // to rfaas.h (docs/c-api.md, docs/packages.md).
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,librfaas.so.1");

    let config = cbindgen::Config::from_file(crate_dir.join("cbindgen.toml"))
        .unwrap_or_else(|e| panic!("cannot read client/capi/cbindgen.toml: {e}"));
    let bindings = cbindgen::Builder::new()
        .with_crate(&crate_dir)
        .with_config(config)
        .generate()
        .unwrap_or_else(|e| panic!("cbindgen cannot generate rfaas.h from client/capi/src: {e}"));
    let header = crate_dir.join("include").join("rfaas.h");
    // write_to_file compares first and only writes a changed header.
    bindings.write_to_file(&header);
}

#!/usr/bin/env bash
# Runs every rfaas test: unit, conformance (tcp and shm), benchmarks' own
# tests, doc tests, and a short fuzz run of the tcp frame decoder.
# Installs what it needs first (Debian packages, cargo tools).
#
#   scripts/test.sh            everything
#   FUZZ_SECONDS=0 scripts/test.sh   skip the fuzz run
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$(repo_root)"

ensure_packages "${BUILD_PACKAGES[@]}"
ensure_rust

echo "== build (with the verbs provider)"
cargo build --workspace --all-targets --features rfaas-fabric/verbs

echo "== lint"
cargo clippy --workspace --all-targets --features rfaas-fabric/verbs -- -D warnings
cargo fmt --all -- --check

echo "== tests"
if cargo nextest --version >/dev/null 2>&1; then
    cargo nextest run --workspace --features rfaas-fabric/verbs --no-fail-fast
else
    cargo test --workspace --features rfaas-fabric/verbs --no-fail-fast
fi
cargo test --workspace --features rfaas-fabric/verbs --doc

if [ "${FUZZ_SECONDS:-60}" != 0 ]; then
    echo "== fuzz"
    bash scripts/fuzz-smoke.sh
fi

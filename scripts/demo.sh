#!/usr/bin/env bash
# The rfaas demo on one machine: an executor daemon on loopback and a job
# that offloads half of a matrix multiplication to it, over the tcp and the
# shm provider, printing the latencies it measured.
#
#   scripts/demo.sh            (N=512 REPS=20 by default: N=1024 scripts/demo.sh)
#
# Installs what it needs first. Every process it starts is stopped by PID.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
root=$(repo_root)
cd "$root"

ensure_packages "${BUILD_PACKAGES[@]}"
ensure_rust
echo "== building (release)"
cargo build --release -q -p rfaas-executor -p rfaas-example-functions
cargo build --release -q -p rfaas-client --example offload_matmul
bin="${CARGO_TARGET_DIR:-$root/target}/release"

work=$(mktemp -d "${TMPDIR:-/tmp}/rfaas-demo.XXXXXX")
cleanup() {
    stop_executord
    rm -rf "$work"
}
trap cleanup EXIT

echo "== starting rfaas-executord"
start_executord "$bin" "$work"
token=$(mint_token nobody 2 1024)

for provider in tcp shm; do
    echo
    echo "== a job offloads half of C = A x B (${N:-512}x${N:-512}, f64) over $provider"
    "$bin/examples/offload_matmul" --executor "$EXECUTORD_CONTROL" --token "$token" \
        --library "$bin/librfaas_example_functions.so" --provider "$provider" \
        --n "${N:-512}" --reps "${REPS:-20}"
done

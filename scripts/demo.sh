#!/usr/bin/env bash
# The rfaas demo on one machine: an executor daemon on loopback and a job
# that offloads half of a matrix multiplication to it, over the tcp and the
# shm provider. For each it prints the product's time computed by the job
# alone and offloaded, the speedup or slowdown, the cold start and a noop's
# round trip.
#
#   scripts/demo.sh            (N=512 REPS=20 by default: N=1024 scripts/demo.sh)
#
# Needs root, as rfaas-executord does: the daemon starts each worker as the
# lease's user (here `nobody`). Installs what it needs first. Every process
# it starts is stopped by PID.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
root=$(repo_root)
cd "$root"

if [ "$(id -u)" -ne 0 ]; then
    echo "scripts/demo.sh: run it as root. rfaas-executord starts each worker as the" \
        "lease's user, here \`nobody\`, and a daemon that is not root may run workers" \
        "only as itself." >&2
    exit 1
fi
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

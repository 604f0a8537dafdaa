#!/usr/bin/env bash
# The rfaas demo on one machine: a whole local cluster. A resource manager
# on SQLite, an accounting service on the same database, two executor
# daemons that register with the manager and post usage, and a job that
# gets its lease from the manager (with the client library's backoff) and
# offloads half of a matrix multiplication, over the tcp and the shm
# provider. For each it prints the product's time computed by the job
# alone and offloaded, the speedup or slowdown, the cold start and a noop's
# round trip; around the job, the manager's view of the nodes and leases,
# and at the end the job's bill from rfaas-billing.
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
cargo build --release -q -p rfaas-executor -p rfaas-manager -p rfaas-accounting \
    -p rfaas-example-functions
cargo build --release -q -p rfaas-client --example offload_matmul
bin="${CARGO_TARGET_DIR:-$root/target}/release"

work=$(mktemp -d "${TMPDIR:-/tmp}/rfaas-demo.XXXXXX")
NODE_PIDS=()
cleanup() {
    stop_nodes
    stop_accounting
    stop_manager
    rm -rf "$work"
}
trap cleanup EXIT

echo "== starting rfaas-manager, rfaas-accounting and two executor daemons"
start_manager "$bin" "$work"
start_accounting "$bin" "$work"
start_node "$bin" "$work" node-1 0-1
start_node "$bin" "$work" node-2 0-1
for _i in $(seq 300); do
    up=$("${RFAASCTL[@]}" nodes --json | grep -o '"state": *"up"' | wc -l || true)
    [ "$up" -eq 2 ] && break
    sleep 0.1
done
if [ "$up" -ne 2 ]; then
    echo "the executor daemons did not register within 30 s; their logs:" >&2
    tail -n 20 "$work"/node-*/executord.log >&2
    exit 1
fi
echo
"${RFAASCTL[@]}" nodes

# The job's credential: workers run as `nobody`, billed to account `demo`.
RFAAS_MANAGERS=$MANAGER_URL
RFAAS_CREDENTIAL=$("${RFAASCTL[@]}" credential user nobody --account demo --ttl 1h)
export RFAAS_MANAGERS RFAAS_CREDENTIAL

for provider in tcp shm; do
    echo
    echo "== a job leases a core from the manager and offloads half of C = A x B (${N:-512}x${N:-512}, f64) over $provider"
    "$bin/examples/offload_matmul" --library "$bin/librfaas_example_functions.so" \
        --provider "$provider" --n "${N:-512}" --reps "${REPS:-20}"
done

echo
echo "== the job's leases, as the manager recorded them"
"${RFAASCTL[@]}" leases --all

# The leases are released; their executors post the last of their usage
# and close their slots, and the accounting service writes the final
# totals.
echo
echo "== the job's bill (rfaas-billing, account demo, by user)"
for _i in $(seq 100); do
    open=$("${BILLING[@]}" --json -A demo --by lease -S today 2>/dev/null |
        grep -c '"lease"' || true)
    [ "$open" -ge 2 ] && break
    sleep 0.1
done
sleep 2
"${BILLING[@]}" -A demo --by account,user -S today

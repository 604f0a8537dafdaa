#!/usr/bin/env bash
# The verbs provider between two machines: two VMs of scripts/rdma-vm.sh,
# two guest kernels with Soft-RoCE, their NICs joined by a TCP socket on
# 127.0.0.1 (RoCE v2 packets cross between the kernels; nothing else sees
# them). Node a (192.0.2.1) serves, node b (192.0.2.2) checks, with
# `rfaas-fabric-probe check`:
#  1. against `serve --echo`: connect, write-with-immediate there and back,
#     read back, fetch-and-add, compare-and-swap, each verified; then node a
#     kills its probe (SIGKILL) and node b must see PeerLost;
#  2. against a passive `serve`: the same without the echo; then node a's
#     machine powers off with the connection open (no disconnect is sent) and
#     node b must notice from transport retries alone.
#
#   scripts/test-verbs-two-node.sh     # about 30 s on 2 cores, one vCPU per VM
#
# The nodes coordinate through files in a host directory shared into both
# (ready, kill, vanish). RDMA_VM_TWO_NODE_PORT picks the socket's port
# (default: a free one). Both VMs are stopped by PID when this script ends.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

# Waits up to $2 seconds for file $1.
await_file() {
    local i
    for ((i = 0; i < $2 * 10; i++)); do
        [ -e "$1" ] && return 0
        sleep 0.1
    done
    echo "timed out after $2 s waiting for $1" >&2
    return 1
}

# Writes $2 into $1 in one step (the other node may be reading).
publish() {
    printf '%s\n' "$2" >"$1.tmp"
    mv "$1.tmp" "$1"
}

# Starts `probe serve ARGS...`, waits for its ready line, publishes it in $1.
serve() {
    local ready=$1 out
    shift
    out=$(mktemp)
    "$probe" --provider "verbs:$RDMA_DEVICE" serve "$@" >"$out" &
    server_pid=$!
    for _ in $(seq 200); do
        [ -s "$out" ] && break
        sleep 0.1
    done
    grep -q '^rfaas-fabric-probe ready ' "$out" || {
        echo "node a: the probe did not get ready"
        return 1
    }
    echo "node a: $(cat "$out")"
    publish "$ready" "$(cat "$out")"
}

# Runs `probe check ARGS...` against the server announced in $1; once it
# waits for the peer's loss, creates $2 (the server's cue to disappear).
check() {
    local ready=$1 cue=$2 out status=0
    shift 2
    await_file "$ready" 300
    # rfaas-fabric-probe ready provider=P listen=A addr=X rkey=K len=L
    local line
    line=$(cat "$ready")
    field() { sed -n "s/.* $1=\([^ ]*\).*/\1/p" <<<"$line"; }
    out=$(mktemp)
    "$probe" --provider "verbs:$RDMA_DEVICE" check --connect "$(field listen)" \
        --addr "$(field addr)" --rkey "$(field rkey)" --len "$(field len)" "$@" \
        > >(tee "$out") 2>&1 &
    local pid=$!
    for _ in $(seq 600); do
        grep -q '^awaiting peer loss' "$out" && break
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
    done
    touch "$cue"
    wait "$pid" || status=$?
    return "$status"
}

# In the guests (rdma-vm.sh exports RDMA_DEVICE and RDMA_VM_IP there).
# shellcheck disable=SC2153
case "${1:-}" in
--node-a)
    x=$2 probe=$3
    echo "node a: $RDMA_DEVICE on $RDMA_VM_IP"
    serve "$x/ready1" --echo --listen "$RDMA_VM_IP:7471"
    await_file "$x/kill1" 300
    kill -9 "$server_pid"
    wait "$server_pid" 2>/dev/null || true
    echo "node a: killed the echo server (SIGKILL)"
    serve "$x/ready2" --listen "$RDMA_VM_IP:7472"
    await_file "$x/vanish2" 300
    # Leave with the probe still connected: the VM powers off at once, and
    # no disconnect request ever leaves it.
    echo "node a: powering off with the connection open"
    exit 0
    ;;
--node-b)
    x=$2 probe=$3
    echo "node b: $RDMA_DEVICE on $RDMA_VM_IP"
    echo "node b: 1. echo server, then its process is killed"
    check "$x/ready1" "$x/kill1" --await-peer-loss 30
    echo "node b: 2. passive server, then its machine powers off"
    check "$x/ready2" "$x/vanish2" --no-echo --await-peer-loss 60
    echo "node b: all checks passed"
    exit 0
    ;;
esac

cd "$(repo_root)"
ensure_packages "${BUILD_PACKAGES[@]}" jq
ensure_rust
start=$SECONDS
bash scripts/rdma-vm.sh build
# CI's one build (CI_BUILD in lib.sh), as scripts/test.sh's first step made
# it; these checks are functional.
cargo build -q "${CI_BUILD[@]}"
target_dir=$(cargo metadata --format-version 1 --no-deps | jq -r .target_directory)
probe=$target_dir/debug/rfaas-fabric-probe

exchange=$(mktemp -d)
node_a="" node_b=""
# Each node's rdma-vm.sh stops its qemu when it ends.
cleanup() {
    local pid
    for pid in $node_a $node_b; do kill "$pid" 2>/dev/null || true; done
    for pid in $node_a $node_b; do wait "$pid" 2>/dev/null || true; done
    rm -rf "$exchange"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# A free port on 127.0.0.1 for node a's qemu to listen on.
listening() {
    local hex
    hex=$(printf ':%04X ' "$1")
    grep -q "$hex.* 0A " /proc/net/tcp /proc/net/tcp6 2>/dev/null
}
port=${RDMA_VM_TWO_NODE_PORT:-}
if [ -z "$port" ]; then
    port=$((20000 + RANDOM % 20000))
    while listening "$port"; do port=$((port + 1)); done
fi

export RDMA_VM_SMP=1 RDMA_VM_TIMEOUT=${RDMA_VM_TIMEOUT:-600}
export RDMA_VM_SHARE=$exchange:$target_dir${RDMA_VM_SHARE:+:$RDMA_VM_SHARE}
RDMA_VM_NET=listen:$port RDMA_VM_IP=192.0.2.1/24 \
    bash scripts/rdma-vm.sh run -- "$PWD/scripts/test-verbs-two-node.sh" --node-a "$exchange" "$probe" \
    > >(sed -u 's/^/[a] /') 2>&1 &
node_a=$!
for _ in $(seq 100); do
    listening "$port" && break
    kill -0 "$node_a" 2>/dev/null || break
    sleep 0.1
done
listening "$port" || {
    loud "node a's qemu never listened on 127.0.0.1:$port"
    exit 1
}

RDMA_VM_NET=connect:$port RDMA_VM_IP=192.0.2.2/24 \
    bash scripts/rdma-vm.sh run -- "$PWD/scripts/test-verbs-two-node.sh" --node-b "$exchange" "$probe" \
    > >(sed -u 's/^/[b] /') 2>&1 &
node_b=$!
status_b=0
wait "$node_b" || status_b=$?
node_b=""
if [ "$status_b" -ne 0 ]; then
    # Node a would wait for its cues until its own timeout.
    kill "$node_a" 2>/dev/null || true
fi
status_a=0
wait "$node_a" || status_a=$?
node_a=""
sleep 0.2 # sed's last lines of node a
if [ "$status_a" -ne 0 ] || [ "$status_b" -ne 0 ]; then
    loud "two-node verbs test FAILED: node a exited $status_a, node b $status_b"
    exit 1
fi
echo "two-node verbs test: ok ($((SECONDS - start)) s)"

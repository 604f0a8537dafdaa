#!/usr/bin/env bash
# Measures the verbs provider next to perftest on Soft-RoCE (rxe0) in the VM
# of scripts/rdma-vm.sh, in one boot:
#  - perftest's ib_write_lat, ib_atomic_lat (fetch-and-add) and ib_write_bw, server and
#    client in the guest over rxe0's loopback, pinned to different vCPUs
#    (under emulation the guest's TSCs disagree, and perftest times with
#    rdtsc);
#  - rfaas-fabric-bench --provider verbs:rxe0 --rows pingpong,bandwidth;
#  - rfaas-bench --provider verbs:rxe0 with the invocation rows (hot_noop,
#    warm_noop, warm_noop_spin) next to the fabric's pingpong and its
#    blocking baseline: a real rfaas-executord and its workers on rxe0.
#
#   scripts/bench-verbs.sh
#   BENCH_ITERS=2000 BENCH_BW_BYTES=16777216 scripts/bench-verbs.sh   # the defaults
#
# These are functional figures: the CPU is emulated (qemu TCG, several times
# slower than the host) and so is the NIC (rdma_rxe does RDMA in the guest
# kernel). They show that the paths work and how the provider compares with
# perftest on the same emulated device, never how fast RDMA is. Results go
# to docs/benchmarks.md by hand, with this command.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

iters=${BENCH_ITERS:-2000}
bw_bytes=${BENCH_BW_BYTES:-16777216}

# In the guest.
if [ "${1:-}" = --in-guest ]; then
    bench=$2 iters=$3 bw_bytes=$4 invoke_bench=$5
    # One perftest pair: the server on vCPU 1, the client on vCPU 0, then the
    # client's result line.
    perftest_pair() {
        local label=$1 server client status=0
        shift
        server=$(mktemp) client=$(mktemp)
        timeout 120 taskset -c 1 "$@" -d "$RDMA_DEVICE" >"$server" 2>&1 &
        local server_pid=$!
        sleep 1
        timeout 120 taskset -c 0 "$@" -d "$RDMA_DEVICE" "$RDMA_VM_IP" >"$client" 2>&1 || status=$?
        wait "$server_pid" || status=$?
        if [ "$status" -ne 0 ] || ! grep -q '^ *#bytes' "$client"; then
            echo "$label: FAILED (exit $status)"
            cat "$client" "$server"
            return 1
        fi
        awk -v label="$label" '/#bytes/ { getline; printf "%-28s", label
            for (i = 1; i <= NF; i++) printf " %9s", $i
            print ""; exit }' "$client"
    }
    echo "== perftest $(dpkg-query -W -f='${Version}' perftest 2>/dev/null), rxe0 loopback, µs" \
        "(ib_write_lat: half a round trip; ib_atomic_lat: a whole one)"
    printf '%-28s %9s %9s %9s %9s %9s %9s %9s %9s %9s\n' test bytes iters "t_min" "t_max" \
        "t_typical" "t_avg" "t_stdev" "99%" "99.9%"
    perftest_pair "ib_write_lat 8 B" ib_write_lat -n "$iters" -s 8
    perftest_pair "ib_write_lat 64 B" ib_write_lat -n "$iters" -s 64
    perftest_pair "ib_write_lat 4096 B" ib_write_lat -n "$iters" -s 4096
    perftest_pair "ib_atomic_lat FETCH_AND_ADD" ib_atomic_lat -n "$iters" -A FETCH_AND_ADD
    echo "== perftest ib_write_bw, rxe0 loopback, MB/s"
    printf '%-28s %9s %9s %9s %9s %9s\n' test bytes iters peak average "Mmsg/s"
    for size in 1024 65536 1048576; do
        perftest_pair "ib_write_bw $size B" ib_write_bw -s "$size" -n $((bw_bytes / size))
    done
    echo "== rfaas-fabric-bench"
    "$bench" --provider "verbs:$RDMA_DEVICE" --rows pingpong,bandwidth \
        --iters "$iters" --bw-bytes "$bw_bytes"
    echo "== rfaas-bench (invocations through rfaas-executord on $RDMA_DEVICE)"
    "$invoke_bench" --provider "verbs:$RDMA_DEVICE" \
        --rows hot_noop,warm_noop,warm_noop_spin,pingpong \
        --sizes 1,64 --iters "$iters"
    exit 0
fi

cd "$(repo_root)"
ensure_packages "${BUILD_PACKAGES[@]}" jq
ensure_rust
bash scripts/rdma-vm.sh build
cargo build --release -q -p rfaas-bench -p rfaas-executor --features rfaas-fabric/verbs
target_dir=$(cargo metadata --format-version 1 --no-deps | jq -r .target_directory)
start=$SECONDS
RDMA_VM_SHARE=$target_dir${RDMA_VM_SHARE:+:$RDMA_VM_SHARE} \
    bash scripts/rdma-vm.sh run -- "$PWD/scripts/bench-verbs.sh" --in-guest \
    "$target_dir/release/rfaas-fabric-bench" "$iters" "$bw_bytes" \
    "$target_dir/release/rfaas-bench"
echo "bench-verbs: one boot, $((SECONDS - start)) s"

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
# The latency rows run BENCH_ROUNDS times, perftest's round trips and both
# benches' one after the other in each round; the summary at the end gives
# each row's best round, how far its rounds moved (worst over best), and
# the ratios the targets in docs/benchmarks.md are about: the fabric's
# pingpong over perftest's round trip (twice ib_write_lat), hot_noop over
# the verbs pingpong, from the best rounds and the range over rounds.
#
#   scripts/bench-verbs.sh
#   BENCH_ITERS=2000 BENCH_BW_BYTES=16777216 BENCH_ROUNDS=3 scripts/bench-verbs.sh   # the defaults
#   scripts/bench-verbs.sh --rates
#
# --rates measures calls in flight instead, in one boot: rfaas-bench's
# hot_noop_rate, warm_noop_rate and pingpong_rate (1, 4, 16 and 64 in
# flight, 64 B, 10 x BENCH_ITERS calls per point), and transfer with 4
# calls in flight next to bandwidth at 1 MiB, BENCH_ROUNDS rounds; the
# JSON lines go to bench/results/DATE-HHMM-COMMIT-verbs-rates.jsonl.
#
# The guest boots with tsc=reliable: under TCG every vCPU reads the host's
# TSC, but the guest kernel calls it unstable and falls back to the HPET,
# which makes every clock read (the benches' timestamps, the client's and
# the workers' own) a system call and an emulated device access of about
# a microsecond. perftest times with rdtsc either way.
#
# These are functional figures: the CPU is emulated (qemu TCG, several times
# slower than the host) and so is the NIC (rdma_rxe does RDMA in the guest
# kernel). They show that the paths work and how the provider compares with
# perftest on the same emulated device, never how fast RDMA is. Results go
# to bench/results/ as a file of their own (see its README), and
# scripts/bench-report.py --write renders them into docs/benchmarks.md.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

iters=${BENCH_ITERS:-2000}
bw_bytes=${BENCH_BW_BYTES:-16777216}
rounds=${BENCH_ROUNDS:-3}

# In the guest, --rates: rfaas-bench's rate rows into $5.
if [ "${1:-}" = --in-guest-rates ]; then
    invoke_bench=$2 iters=$3 rounds=$4 out=$5
    "$invoke_bench" --provider "verbs:$RDMA_DEVICE" \
        --rows hot_noop_rate,warm_noop_rate,pingpong_rate,transfer,bandwidth \
        --sizes 64 --bw-sizes 1048576 --bw-bytes 67108864 \
        --rounds "$rounds" --iters "$iters" --json >"$out"
    exit 0
fi

# In the guest.
if [ "${1:-}" = --in-guest ]; then
    bench=$2 iters=$3 bw_bytes=$4 invoke_bench=$5 rounds=$6
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
    # perftest's latency header.
    perftest_header() {
        printf '%-28s %9s %9s %9s %9s %9s %9s %9s %9s %9s\n' test bytes iters "t_min" "t_max" \
            "t_typical" "t_avg" "t_stdev" "99%" "99.9%"
    }
    # Round $1's "round <n> <key> <median µs>" lines, from the tables on stdin.
    keys() {
        awk -v r="$1" '
            $1 ~ /^ib_write_lat$/ && $4 ~ /^[0-9]+$/ && $8 ~ /^[0-9.]+$/ {
                print "round", r, "perftest_rt_" $4, 2 * $8 }
            $1 !~ /_overhead$/ && $2 ~ /^verbs:/ && $4 == "B" && $5 ~ /^[0-9.]+$/ {
                print "round", r, $1 "_" $3, $5 }'
    }
    samples=$(mktemp) out=$(mktemp)
    echo "== perftest $(dpkg-query -W -f='${Version}' perftest 2>/dev/null), rxe0 loopback, µs" \
        "(ib_write_lat: half a round trip; ib_atomic_lat: a whole one)"
    perftest_header
    perftest_pair "ib_write_lat 4096 B" ib_write_lat -n "$iters" -s 4096
    perftest_pair "ib_atomic_lat FETCH_AND_ADD" ib_atomic_lat -n "$iters" -A FETCH_AND_ADD
    echo "== perftest ib_write_bw, rxe0 loopback, MB/s"
    printf '%-28s %9s %9s %9s %9s %9s\n' test bytes iters peak average "Mmsg/s"
    for size in 1024 65536 1048576; do
        perftest_pair "ib_write_bw $size B" ib_write_bw -s "$size" -n $((bw_bytes / size))
    done
    echo "== rfaas-fabric-bench"
    "$bench" --provider "verbs:$RDMA_DEVICE" --rows bandwidth --bw-bytes "$bw_bytes"
    for round in $(seq "$rounds"); do
        echo "== latency, round $round of $rounds: perftest, rfaas-fabric-bench, rfaas-bench" \
            "(invocations through rfaas-executord on $RDMA_DEVICE)"
        {
            perftest_header
            perftest_pair "ib_write_lat 8 B" ib_write_lat -n "$iters" -s 8
            perftest_pair "ib_write_lat 64 B" ib_write_lat -n "$iters" -s 64
            # The size of hot_noop's 64-byte request, header included.
            perftest_pair "ib_write_lat 96 B" ib_write_lat -n "$iters" -s 96
            "$bench" --provider "verbs:$RDMA_DEVICE" --rows pingpong --sizes 1,64,4096 \
                --iters "$iters" 2>&1 | sed 's/^pingpong /fabric_pingpong /'
            "$invoke_bench" --provider "verbs:$RDMA_DEVICE" \
                --rows hot_noop,warm_noop,warm_noop_spin,pingpong \
                --sizes 1,64 --iters "$iters" 2>&1
        } | tee "$out"
        keys "$round" <"$out" >>"$samples"
    done
    echo "== summary of $rounds rounds: median µs of each row's best round, worst round over best;" \
        "ratios from the best rounds, and their range over rounds"
    awk '
        { v[$3, $2] = $4; if (!($3 in best) || $4 < best[$3]) best[$3] = $4
          if ($4 > worst[$3]) worst[$3] = $4; seen[$3] = 1; if ($2 > n) n = $2 }
        function ratio(label, a, b,    r, lo, hi, x) {
            if (!(a in best) || !(b in best)) return
            lo = 1e9; hi = 0
            for (r = 1; r <= n; r++) if ((a, r) in v && (b, r) in v && v[b, r] > 0) {
                x = v[a, r] / v[b, r]; if (x < lo) lo = x; if (x > hi) hi = x }
            printf "%-44s %6.2f   (rounds %.2f-%.2f)\n", label, best[a] / best[b], lo, hi
        }
        END {
            printf "%-28s %9s %9s\n", "row", "best", "worst/best"
            for (k in seen) printf "%-28s %9.2f %9.2f\n", k, best[k], worst[k] / best[k] | "sort"
            close("sort")
            for (s = 1; s <= 64; s *= 64) {
                p = (s == 1) ? "perftest_rt_8" : "perftest_rt_64"
                ratio("fabric pingpong " s " B / perftest round trip", "fabric_pingpong_" s, p)
                ratio("hot_noop " s " B / pingpong " s " B", "hot_noop_" s, "pingpong_" s)
            }
        }' "$samples"
    exit 0
fi

cd "$(repo_root)"
ensure_packages "${BUILD_PACKAGES[@]}" jq
ensure_rust
bash scripts/rdma-vm.sh build
cargo build --release -q -p rfaas-bench -p rfaas-executor --features rfaas-fabric/verbs
target_dir=$(cargo metadata --format-version 1 --no-deps | jq -r .target_directory)
# The guest has no C compiler: build the function library the invocation
# rows ship here, into the target directory the guest shares.
"$target_dir/release/rfaas-bench" --build-functions >/dev/null
start=$SECONDS
if [ "${1:-}" = --rates ]; then
    out=$target_dir/verbs-rates.jsonl
    rm -f "$out"
    RDMA_VM_KERNEL_ARGS="tsc=reliable${RDMA_VM_KERNEL_ARGS:+ $RDMA_VM_KERNEL_ARGS}" \
        RDMA_VM_SHARE=$target_dir${RDMA_VM_SHARE:+:$RDMA_VM_SHARE} \
        bash scripts/rdma-vm.sh run -- "$PWD/scripts/bench-verbs.sh" --in-guest-rates \
        "$target_dir/release/rfaas-bench" "$iters" "$rounds" "$out"
    result=bench/results/$(date -u +%F-%H%M)-$(git rev-parse --short=7 HEAD)-verbs-rates.jsonl
    cp "$out" "$result"
    echo "bench-verbs --rates: one boot, $((SECONDS - start)) s; $result"
    exit 0
fi
RDMA_VM_KERNEL_ARGS="tsc=reliable${RDMA_VM_KERNEL_ARGS:+ $RDMA_VM_KERNEL_ARGS}" \
    RDMA_VM_SHARE=$target_dir${RDMA_VM_SHARE:+:$RDMA_VM_SHARE} \
    bash scripts/rdma-vm.sh run -- "$PWD/scripts/bench-verbs.sh" --in-guest \
    "$target_dir/release/rfaas-fabric-bench" "$iters" "$bw_bytes" \
    "$target_dir/release/rfaas-bench" "$rounds"
echo "bench-verbs: one boot, $((SECONDS - start)) s"

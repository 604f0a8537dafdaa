#!/usr/bin/env bash
# The rfaas demo on one machine. For now: the fabric between two processes.
#  1. write-with-immediate ping-pong over the tcp and shm providers;
#  2. three processes adding into a counter held by a passive target
#     (one-sided fetch-and-add; the target's own thread never polls).
# Installs what it needs first. Every process it starts is stopped by PID.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$(repo_root)"

ensure_packages "${BUILD_PACKAGES[@]}"
ensure_rust
cargo build --release -q -p rfaas-fabric --bins
probe=target/release/rfaas-fabric-probe

pids=()
cleanup() {
    local pid
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
}
trap cleanup EXIT

# Starts `rfaas-fabric-probe serve`, leaves its PID in `pids` and its
# `ready <addr> <region-addr> <rkey> <len>` line in $ready.
serve() {
    local out
    out=$(mktemp)
    "$probe" "$@" >"$out" &
    pids+=($!)
    for _ in $(seq 100); do
        [ -s "$out" ] && break
        sleep 0.05
    done
    read -r ready <"$out"
    rm -f "$out"
    [[ $ready == ready* ]] || { echo "the server did not start" >&2; exit 1; }
}

for provider in tcp shm; do
    listen=127.0.0.1:0
    [ "$provider" = shm ] && listen=""
    serve --provider "$provider" serve --echo --listen "$listen" --len 65536
    read -r _ addr raddr rkey _ <<<"$ready"
    for size in 64 4096; do
        "$probe" --provider "$provider" pingpong --connect "$addr" --addr "$raddr" --rkey "$rkey" \
            --size "$size" --iters 20000
    done
done

serve --provider tcp serve --listen 127.0.0.1:0
read -r _ addr raddr rkey _ <<<"$ready"
echo "three processes add 1000 each into a counter on a passive tcp target:"
adders=()
for _ in 1 2 3; do
    "$probe" --provider tcp faa --connect "$addr" --addr "$raddr" --rkey "$rkey" --count 1000 &
    adders+=($!)
done
for pid in "${adders[@]}"; do wait "$pid"; done

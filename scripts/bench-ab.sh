#!/usr/bin/env bash
# Compares two builds of rfaas-bench side by side: BASE (a git revision)
# and the working tree, run alternately, one round each, ROUNDS times, so
# that the machine's noise falls on both alike. Prints, per row, provider
# and size, each round's median of both and their ratio (working tree over
# BASE), then the median and worst ratio; the JSON lines of every run stay
# in the output directory.
#
#   scripts/bench-ab.sh BASE [ROUNDS] -- rfaas-bench arguments
#   scripts/bench-ab.sh origin/main 5 -- --rows hot_noop --provider shm,tcp --sizes 1,64
#
# BASE is built in a worktree of its own under $RFAAS_AB_DIR
# (default /var/tmp/rfaas-ab), with one target directory for both builds
# there, so the dependencies are built once. Release builds.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
repo=$(pwd)

usage() {
    sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'
    exit 2
}
[[ $# -ge 1 ]] || usage
base=$1
shift
rounds=5
if [[ $# -ge 1 && $1 != "--" ]]; then
    rounds=$1
    shift
fi
[[ $# -ge 1 && $1 == "--" ]] || usage
shift
[[ $rounds =~ ^[1-9][0-9]*$ ]] || { echo "bench-ab: ROUNDS must be a positive number, not $rounds" >&2; exit 2; }
rev=$(git rev-parse --verify --quiet "$base^{commit}") || { echo "bench-ab: $base is not a revision here" >&2; exit 2; }

dir=${RFAAS_AB_DIR:-/var/tmp/rfaas-ab}
mkdir -p "$dir"
target=$dir/target
tree=$dir/tree-${rev:0:12}
out=$dir/run-$(date -u +%Y%m%d-%H%M%S)
mkdir -p "$out"

# The checkout of BASE lives for this run only (the target directory
# stays, so the next run rebuilds little); it is unregistered on exit.
git worktree remove --force "$tree" 2>/dev/null || rm -rf "$tree"
git worktree add --detach --quiet "$tree" "$rev"
trap 'git -C "$repo" worktree remove --force "$tree" 2>/dev/null || true' EXIT

# Builds the bench, the daemon and the worker of source tree $1 into the
# shared target directory and copies them to $2.
build() {
    local src=$1 bin=$2
    (cd "$src" && CARGO_TARGET_DIR=$target cargo build --release --quiet \
        -p rfaas-executor -p rfaas-bench)
    mkdir -p "$bin"
    cp "$target/release/rfaas-bench" "$target/release/rfaas-executord" \
        "$target/release/rfaas-worker" "$bin/"
}
echo "bench-ab: building $base (${rev:0:12})"
build "$tree" "$out/bin-base"
echo "bench-ab: building the working tree"
build "$repo" "$out/bin-new"

for ((i = 1; i <= rounds; i++)); do
    for side in base new; do
        echo "bench-ab: round $i of $rounds, $side"
        "$out/bin-$side/rfaas-bench" --json --rounds 1 "$@" \
            > "$out/$side-$i.jsonl" 2> "$out/$side-$i.log" || {
            echo "bench-ab: the $side bench failed in round $i; see $out/$side-$i.log" >&2
            exit 1
        }
    done
done

python3 - "$out" "$rounds" <<'EOF'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])

def figure(row):
    for key in ("median_ns", "per_s", "bytes_per_s"):
        if key in row:
            return key, row[key]
    return None, None

pairs = {}
for i in range(1, rounds + 1):
    for side in ("base", "new"):
        with open(f"{out}/{side}-{i}.jsonl") as f:
            for line in f:
                line = line.strip()
                if not line.startswith("{"):
                    continue
                row = json.loads(line)
                key, value = figure(row)
                if key is None or row.get("round") not in (None, 1):
                    continue
                point = (row["name"], row.get("provider", ""), row.get("size", 0), row.get("in_flight", 0), key)
                pairs.setdefault(point, {}).setdefault(i, {})[side] = value

print(f"{'row':<24} {'provider':<8} {'size':>8} {'in flight':>9}  round ratios (working tree / base)  median  worst")
for (name, provider, size, in_flight, key), by_round in sorted(pairs.items()):
    ratios = [r["new"] / r["base"] for r in by_round.values() if "new" in r and "base" in r and r["base"]]
    if not ratios:
        continue
    # For latencies lower is better, so the worst ratio is the largest.
    worst = max(ratios) if key == "median_ns" else min(ratios)
    line = {
        "name": f"{name}_ab", "provider": provider, "size": size, "in_flight": in_flight,
        "figure": key, "ratios": [round(r, 4) for r in ratios],
        "median_ratio": round(statistics.median(ratios), 4), "worst_ratio": round(worst, 4),
    }
    print(f"{name:<24} {provider:<8} {size:>8} {in_flight:>9}  "
          f"{' '.join(f'{r:.3f}' for r in ratios):<34}  {statistics.median(ratios):.3f}  {worst:.3f}")
    print(json.dumps(line))
EOF
echo "bench-ab: runs in $out"

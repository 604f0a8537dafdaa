#!/usr/bin/env bash
# Short, bounded fuzz run of the tcp provider's frame decoder, for CI.
#
#   FUZZ_SECONDS=60 scripts/fuzz-smoke.sh     # the default is 60 s
#
# Fuzzes fuzz/fuzz_targets/tcp_frame.rs (see fuzz/README.md) for FUZZ_SECONDS
# seconds, starting from seeds this script writes, and exits non-zero on any
# crash, leaving the input in fuzz/artifacts/tcp_frame/.
#
# Toolchain: `cargo fuzz` passes rustc the nightly-only -Zsanitizer=address,
# and a machine may have only the stable toolchain, with no way to download
# another. RUSTC_BOOTSTRAP=1 lets the stable rustc accept it. Checked with
# rustc 1.95.0 and cargo-fuzz 0.13.2: the target builds with AddressSanitizer
# and libFuzzer's coverage counters (sancov) and fuzzes as on nightly, so
# neither `--sanitizer none` nor hand-written sancov flags are needed.
# `cargo +stable` pins the toolchain, so a machine that also has a nightly
# runs the same build as one that has only stable. RUSTC_BOOTSTRAP=1 is set
# for the fuzz build alone: it also lets dependencies' build scripts detect
# nightly features, which must not leak into the workspace's own builds.

set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
fuzz_dir="$repo/fuzz"
target=tcp_frame
seconds=${FUZZ_SECONDS:-60}
cargo_fuzz_version=0.13.2

if ! cargo +stable fuzz --version >/dev/null 2>&1; then
    echo "fuzz-smoke: installing cargo-fuzz $cargo_fuzz_version" >&2
    cargo +stable install cargo-fuzz --version "$cargo_fuzz_version" --locked
fi

# Little-endian bytes of $1 in $2 bytes, as printf escapes.
le() {
    local value=$1 width=$2 i
    for ((i = 0; i < width; i++)); do
        printf '\\x%02x' $(((value >> (8 * i)) & 0xff))
    done
}

# One 40-byte frame header: kind status seq ack rkey addr arg0 arg1
# (layout in proto/src/tcp_frame.rs).
header() {
    printf "$(le "$1" 1)$(le "$2" 1)\\x00\\x00$(le "$3" 4)$(le "$4" 4)$(le "$5" 4)$(le "$6" 8)$(le "$7" 8)$(le "$8" 8)"
}

# Valid frames of every kind, so the fuzzer starts past the validation
# checks instead of having to guess a kind, a zero reserved field and the
# hello magic. The corpus directory is gitignored; seeds are rewritten on
# every run, and whatever earlier runs found there is kept.
write_seeds() {
    local dir=$1
    local magic=$((0x5043545341414652)) # "RFAASTCP" read as a little-endian u64
    mkdir -p "$dir"
    header 1 0 0 0 1 "$magic" 256 128 >"$dir/seed-hello"
    { header 3 0 7 5 0xAABBCCDD 0x1122334455667788 4 0xDEADBEEF; printf 'abcd'; } >"$dir/seed-write-imm"
    header 10 1 4 3 0 0 0 0 >"$dir/seed-nak"
    {
        header 1 0 0 0 1 "$magic" 16 16
        header 2 0 1 0 9 8 3 0; printf 'xyz'
        header 3 0 2 0 9 8 0 0xFFFFFFFF
        header 4 0 3 0 9 8 3 0
        header 5 0 1 1 0 0 2 0; printf 'hi'
        header 5 1 2 1 0 0 0 0
        header 6 0 4 1 1 8 1 0
        header 7 0 5 1 1 8 1 2
        header 8 0 2 3 0 0 42 0
        header 8 2 3 3 0 0 0 0
        header 9 0 0 5 0 0 0 0
        header 10 2 6 5 0 0 0 0
    } >"$dir/seed-stream"
}

cd "$fuzz_dir"
# fuzz/ is its own workspace with its own committed Cargo.lock. When
# rfaas-proto gains a dependency that lock misses it, and every build would
# add it again in a fresh checkout (at whatever version is newest that day).
# --locked turns that into this error instead of a changed checkout.
if ! cargo +stable fetch --locked --quiet; then
    echo "fuzz-smoke: fuzz/Cargo.lock is out of date with fuzz/Cargo.toml or proto/Cargo.toml." \
        "Run \`cargo +stable update --workspace\` in fuzz/ (it adds what is missing and" \
        "changes nothing else) and commit fuzz/Cargo.lock." >&2
    exit 1
fi
write_seeds "corpus/$target"

log="$fuzz_dir/target/fuzz-smoke-$target.log"
mkdir -p "$(dirname "$log")"
start=$SECONDS
status=0
# The full output goes to the log; the console gets it without libFuzzer's
# line per new corpus entry (thousands in a minute). With pipefail, the
# pipeline's status is cargo's: tee and the filter always succeed.
RUSTC_BOOTSTRAP=1 cargo +stable fuzz run "$target" -- \
    -max_total_time="$seconds" -rss_limit_mb=2048 -print_final_stats=1 \
    2>&1 | tee "$log" | { grep --line-buffered -Ev '^#[0-9]+[[:space:]]+(NEW|REDUCE) ' || true; } \
    || status=$?
elapsed=$((SECONDS - start))

runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)
if [[ $status -eq 0 ]]; then
    fuzzed=$(sed -n 's/^Done [0-9]* runs in \([0-9]*\) second.*/\1/p' "$log" | tail -n 1)
    echo "fuzz $target: ${runs:-?} runs in ${fuzzed:-$seconds} s, no crash (${elapsed} s with the build; full log: $log)"
else
    crash=$(sed -n 's/.*Test unit written to *//p' "$log" | tail -n 1)
    echo "fuzz $target: FAILED (exit $status) after ${runs:-?} runs; input: ${crash:-none saved, see $log}" >&2
    exit "$status"
fi

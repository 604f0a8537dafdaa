#!/usr/bin/env bash
# Runs the Slurm tests under a second Slurm release: Debian 13's Slurm
# 24.11, in scripts/roots.sh's trixie-slurm root, next to the host's 22.05
# that `cargo nextest run` tests.
#
#   scripts/test-slurm-releases.sh
#
# 1. Builds rfaas_spank.so against the root's Slurm headers
#    (SLURM_INCLUDE_DIR=<root>/usr/include), in its own target directory,
#    target/slurm-<release>/, so the host's build stays as it is.
# 2. Asks cargo for the test executables of slurm-spank/tests/cluster.rs,
#    slurm-spank/tests/version.rs and bench/tests/harvest.rs with CI's
#    features (lib.sh CI_FEATURES: after CI's build nothing compiles), and
#    builds the C example functions on the host (the root has no compiler).
# 3. Runs those executables inside the root (its slurmd, slurmctld, munge
#    and srun; the host's rfaas-executord, manager and the rest from the
#    same target directory), with RFAAS_SPANK_PLUGIN naming the plugin of
#    step 1. They start their own loopback clusters through
#    scripts/slurm-cluster.sh, as on the host; the host's cluster slots
#    (/tmp/rfaas-slurm-slots) are shared with the root, so clusters inside
#    and outside never take the same ports.
#
# Fails if the root cannot be built, the plugin does not build, or any test
# fails (but for SKIP below). Needs root (chroot, mount). Prints each
# step's time.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
REPO=$(repo_root)
readonly REPO
cd "$REPO"
ensure_rust

readonly ROOT_NAME=trixie-slurm
# The tests run in the root, as `package/target` of `cargo test`.
readonly TESTS=(rfaas-slurm-spank/cluster rfaas-slurm-spank/version rfaas-bench/harvest)
# Tests of these executables that are not about the Slurm that runs: the
# plugin's build script on made-up headers (bindgen needs libclang, which
# the root lacks; the host's run covers them).
readonly SKIP=(--skip the_build_stops_with_one_sentence --skip an_unchecked_release_stops_the_build)
TARGET=${CARGO_TARGET_DIR:-$PWD/target}
TARGET=$(mkdir -p "$TARGET" && cd "$TARGET" && pwd)
readonly TARGET

step_start=$SECONDS
step() {
    echo "$1: $((SECONDS - step_start)) s"
    step_start=$SECONDS
}

bash scripts/roots.sh build "$ROOT_NAME"
root=$(bash scripts/roots.sh path "$ROOT_NAME")
# "#define SLURM_VERSION_NUMBER 0x180b05": 24.11.
number=$(sed -n 's/^#define SLURM_VERSION_NUMBER 0x\([0-9a-f]*\).*/\1/p' \
    "$root/usr/include/slurm/slurm_version.h")
release=""
[ -z "$number" ] || release=$(printf '%d.%02d' $((16#$number >> 16)) $(((16#$number >> 8) & 255)))
[ -n "$release" ] || {
    loud "FAILED: $root/usr/include/slurm/slurm_version.h names no Slurm release;" \
        "rebuild the root: scripts/roots.sh build $ROOT_NAME --force"
    exit 1
}
step "root $ROOT_NAME (Slurm $release)"

plugin_target=$TARGET/slurm-$release
echo "== rfaas_spank.so against Slurm $release's headers ($plugin_target)"
SLURM_INCLUDE_DIR=$root/usr/include CARGO_TARGET_DIR=$plugin_target \
    cargo build -p rfaas-slurm-spank --lib
plugin=$plugin_target/debug/librfaas_spank.so
[ -f "$plugin" ] || {
    loud "FAILED: cargo built no $plugin"
    exit 1
}
step "plugin for Slurm $release"

echo "== the test executables (${TESTS[*]}) and the C example functions"
# Each test executable, as "package/target path manifest_dir".
executables=$(cargo test "${CI_FEATURES[@]}" --no-run --message-format=json |
    python3 -c '
import json, os, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") != "compiler-artifact" or not m.get("executable") or not m["profile"]["test"]:
        continue
    pkg = m["package_id"]
    # "path+file:///dir#name@0.1.0" or "name 0.1.0 (path+file:///dir)"
    name = pkg.split("#")[1].split("@")[0] if "#" in pkg else pkg.split()[0]
    print(name + "/" + m["target"]["name"], m["executable"], os.path.dirname(m["manifest_path"]))
')
exe_of() { awk -v t="$1" '$1 == t { print $2, $3 }' <<<"$executables"; }
testkit=$(exe_of rfaas-testkit/rfaas_testkit)
[ -n "$testkit" ] || {
    loud "FAILED: cargo named no test executable of rfaas-testkit's library"
    exit 1
}
# testkit's own test builds target/rfaas-functions/libfunctions.so with cc.
read -r exe dir <<<"$testkit"
(cd "$dir" && "$exe" --exact functions::tests::builds_a_library_with_the_basic_functions -q) >/dev/null
step "test executables"

mkdir -p /tmp/rfaas-slurm-slots
chmod 1777 /tmp/rfaas-slurm-slots
failed=()
for t in "${TESTS[@]}"; do
    found=$(exe_of "$t")
    [ -n "$found" ] || {
        loud "FAILED: cargo named no test executable $t"
        exit 1
    }
    read -r exe dir <<<"$found"
    echo "== $t under Slurm $release (root $ROOT_NAME)"
    if ! (cd "$dir" && RFAAS_SPANK_PLUGIN=$plugin bash "$REPO/scripts/roots.sh" run "$ROOT_NAME" \
        --bind /tmp/rfaas-slurm-slots -- "$exe" --test-threads=2 "${SKIP[@]}"); then
        failed+=("$t")
    fi
    step "$t under Slurm $release"
done

if [ ${#failed[@]} -gt 0 ]; then
    loud "FAILED under Slurm $release (root $ROOT_NAME): ${failed[*]}" \
        "Their output is above; the same tests pass or fail on the host's Slurm in" \
        "cargo nextest run. Rerun one: scripts/test-slurm-releases.sh"
    exit 1
fi
echo "Slurm $release: ${TESTS[*]} passed in $SECONDS s"

#!/usr/bin/env bash
# Builds the C API and the C and MPI examples, starts an rfaas-executord on
# loopback and runs both examples against it:
#
#   scripts/examples.sh
#
# Installs what it needs first (build tools, pkg-config, OpenMPI). Exits
# non-zero, with a banner saying what failed, when any step fails; the
# daemon is stopped by its pid on every exit.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
root=$(repo_root)
cd "$root"

ensure_packages "${BUILD_PACKAGES[@]}" pkg-config openmpi-bin libopenmpi-dev
ensure_rust

target=${CARGO_TARGET_DIR:-$root/target}
step="starting"
work=$(mktemp -d "${TMPDIR:-/tmp}/rfaas-examples.XXXXXX")

cleanup() {
    local rc=$?
    stop_executord
    if [ "$rc" -ne 0 ]; then
        if [ -s "$work/executord.log" ]; then
            echo "---- last lines of the executor's log ($work/executord.log)" >&2
            tail -n 40 "$work/executord.log" >&2
        fi
        loud "FAILED: scripts/examples.sh, step: $step (exit code $rc)." \
            "The output above says why."
    fi
    rm -rf "$work"
}
trap cleanup EXIT

# The debug build of the whole workspace, CI's one build (CI_BUILD in
# lib.sh): after scripts/test.sh's first step there is nothing left to
# compile, and the daemon below comes from the same build.
step="building the C API (scripts/build-capi.sh --debug)"
prefix="$target/capi-prefix"
bash scripts/build-capi.sh --debug "$prefix"
export PKG_CONFIG_PATH="$prefix/lib/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"

step="building the C example (examples/c)"
make -C examples/c clean all static
step="building the MPI example (examples/mpi)"
make -C examples/mpi clean all

# rfaas-executord, rfaas-worker and rfaas-token: built with the C API above.
bin="$target/debug"

step="building the function library (examples/functions/c)"
library="$work/libfunctions.so"
cc -shared -fPIC -O2 -Wall -Wextra -o "$library" examples/functions/c/*.c -lm

step="starting rfaas-executord"
start_executord "$bin" "$work"
control=$EXECUTORD_CONTROL

step="running examples/c/matmul_offload against the executor"
token=$(mint_token nobody 1 1024)
RFAAS_REPS=10 timeout 300 examples/c/matmul_offload 256 "$control" "$token" "$library"

step="running examples/c/matmul_offload_static (librfaas.a) against the executor"
RFAAS_REPS=3 timeout 300 examples/c/matmul_offload_static 64 "$control" "$token" "$library"

step="running examples/mpi/mpi_offload (2 ranks) against the executor"
ranks=2
token=$(mint_token nobody "$ranks" 2048)
# Shared memory between the ranks, no network interfaces needed.
OMPI_MCA_btl=self,vader OMPI_MCA_btl_vader_single_copy_mechanism=none \
    RFAAS_REPS=10 timeout 300 mpirun --allow-run-as-root --oversubscribe -np "$ranks" \
    examples/mpi/mpi_offload 128 "$control" "$token" "$library"

step="done"
echo "examples: C and MPI examples passed against rfaas-executord"

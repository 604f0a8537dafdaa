#!/usr/bin/env bash
# Runs every rfaas test: unit, conformance (tcp and shm), benchmarks' own
# tests, the Slurm plugin and hook on loopback Slurm clusters (the host's
# Slurm 22.05, and 24.11 in a Debian 13 root: scripts/test-slurm-releases.sh),
# doc tests, the verbs provider on Soft-RoCE in a VM and between two VMs
# (scripts/test-verbs.sh, scripts/test-verbs-two-node.sh), schemathesis
# against the manager's REST API (scripts/fuzz-manager-api.sh), and a short
# fuzz run of the tcp frame decoder, and the .deb and .rpm packages: built
# (scripts/package.sh), checked (scripts/check-packages.sh) and installed,
# upgraded and removed in Debian 12 and 13 roots (scripts/test-packages.sh),
# then docs/install.md as written on two booted Debian 12 roots
# (scripts/test-install-guide.sh).
# Fails at the end if the run changed the git checkout (a stale lockfile or
# header, a stray output file), naming the files.
# Installs what it needs first (Debian packages, cargo tools, the VM image).
#
#   scripts/test.sh                      everything
#   FUZZ_SECONDS=0 scripts/test.sh       skip the fuzz run
#   FUZZ_API_EXAMPLES=0 scripts/test.sh  skip the manager API's fuzzing
#   RFAAS_SKIP_RDMA_VM=1 scripts/test.sh skip the verbs stage, saying so loudly
#                                        (for machines that cannot run qemu;
#                                        the verbs provider is then untested)
#
# The verbs stage needs root the first time (it builds the VM image with
# mmdebstrap into /var/cache/rfaas-rdma-vm, or $RFAAS_RDMA_VM_DIR). If qemu,
# the image build or the VM fails, the stage fails: it never passes silently.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$(repo_root)"
checkout_before=$(checkout_changes)

# SLURM_PACKAGES: the slurm-spank tests run real clusters on loopback
# (scripts/slurm-cluster.sh, under a second each to start);
# SLURMDBD_PACKAGES: the coordinator tests add slurmdbd to theirs.
ensure_packages "${BUILD_PACKAGES[@]}" "${TEST_PACKAGES[@]}" "${SLURM_PACKAGES[@]}" "${SLURMDBD_PACKAGES[@]}"
ensure_rust

# One build, used once: cargo's incremental caches would only add gigabytes
# to target/ (set CARGO_INCREMENTAL=1 to keep them between local runs).
export CARGO_INCREMENTAL=${CARGO_INCREMENTAL:-0}

# Every later stage reuses this build (CI_BUILD in lib.sh says why).
echo "== build (with the verbs provider)"
cargo build "${CI_BUILD[@]}"

echo "== lint"
cargo clippy "${CI_BUILD[@]}" -- -D warnings
cargo fmt --all -- --check

echo "== docs/benchmarks.md renders from bench/results (scripts/bench-report.py)"
python3 scripts/bench-report.py --self-test
python3 scripts/bench-report.py --check

echo "== import circles (scripts/check-imports.py)"
python3 scripts/check-imports.py --self-test
python3 scripts/check-imports.py "${IMPORT_CHECKED_DIRS[@]}"

echo "== tests"
if cargo nextest --version >/dev/null 2>&1; then
    cargo nextest run "${CI_FEATURES[@]}" --no-fail-fast
else
    cargo test "${CI_FEATURES[@]}" --no-fail-fast
fi
cargo test "${CI_FEATURES[@]}" --doc

if [ "${FUZZ_API_EXAMPLES:-100}" != 0 ]; then
    echo "== the manager's REST API under schemathesis (scripts/fuzz-manager-api.sh)"
    api_start=$SECONDS
    bash scripts/fuzz-manager-api.sh
    echo "manager API fuzz stage: $((SECONDS - api_start)) s"
fi

echo "== C API, C and MPI examples against a local executor (scripts/examples.sh)"
bash scripts/examples.sh

echo "== alert rules and dashboard against a real scrape (scripts/test-monitoring.sh)"
monitoring_start=$SECONDS
bash scripts/test-monitoring.sh
echo "monitoring stage: $((SECONDS - monitoring_start)) s"

echo "== the Slurm tests under Slurm 24.11, in a Debian 13 root (scripts/test-slurm-releases.sh)"
slurm_start=$SECONDS
bash scripts/test-slurm-releases.sh
echo "Slurm 24.11 stage: $((SECONDS - slurm_start)) s"

echo "== packages: built, checked, installed (scripts/package.sh, check-packages.sh, test-packages.sh)"
packages_start=$SECONDS
bash scripts/package.sh
# rfaas-slurm for Debian 13's Slurm 24.11 too, from the root of the stage above.
SLURM_INCLUDE_DIR="$(bash scripts/roots.sh path trixie-slurm)/usr/include" \
    bash scripts/package.sh deb --only rfaas-slurm
bash scripts/check-packages.sh
bash scripts/test-packages.sh
echo "stage: packages: $((SECONDS - packages_start)) s"

# After the packages are built: the guide installs them.
echo "== docs/install.md as written, on two booted Debian 12 roots (scripts/test-install-guide.sh)"
bash scripts/test-install-guide.sh

# After the packages are built: the Ansible roles install them on three hosts.
echo "== the Ansible collection: lint, and the play on booted Debian 12 roots (scripts/test-ansible.sh)"
bash scripts/test-ansible.sh

if [ "${RFAAS_SKIP_RDMA_VM:-0}" = 1 ]; then
    loud "SKIPPED: the verbs provider's tests under Soft-RoCE (RFAAS_SKIP_RDMA_VM=1)." \
        "The verbs provider is NOT tested by this run."
else
    verbs_start=$SECONDS
    for script in test-verbs.sh test-verbs-two-node.sh; do
        echo "== verbs under Soft-RoCE (scripts/$script)"
        if ! bash "scripts/$script"; then
            loud "FAILED: the verbs stage (scripts/$script) after $((SECONDS - verbs_start)) s." \
                "Its output above says whether a test, the VM or the image build failed." \
                "Only on a machine that cannot run qemu: RFAAS_SKIP_RDMA_VM=1 skips the stage."
            exit 1
        fi
    done
    echo "verbs stage: $((SECONDS - verbs_start)) s"
fi

if [ "${FUZZ_SECONDS:-60}" != 0 ]; then
    echo "== fuzz"
    bash scripts/fuzz-smoke.sh
fi

echo "== the checkout is as the run found it"
check_checkout_unchanged "$checkout_before"

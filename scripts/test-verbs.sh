#!/usr/bin/env bash
# Runs the verbs provider's tests on a real RDMA device: Soft-RoCE (rxe0) in
# a VM (scripts/rdma-vm.sh), because the build machines have no RDMA NIC.
#
#   scripts/test-verbs.sh
#
# Builds the test binaries on the host, then boots the VM once and runs in it
#  - the library's device tests (`verbs::tests::`, ignored elsewhere),
#  - the conformance suite's verbs cases (fabric/tests/conformance.rs, the
#    same bodies as tcp and shm), and
#  - the client's end-to-end verbs cases (client/tests/e2e.rs: a real
#    rfaas-executord and its workers on rxe0, the same bodies as tcp and
#    shm), and
#  - the accounting service's verbs case (accounting/tests/service.rs
#    `adds_over_verbs`: a real rfaas-accounting whose region the NIC adds
#    into) and its trust cases (accounting/tests/trust.rs `*_over_verbs`: a
#    connection without a hello adds nothing, forged and expired tickets
#    are refused, a revoked credential's connection is closed), and
#  - the executor's isolation tests (executor/tests/isolation.rs: a
#    function's detached child is killed with its allocation, kept on its
#    CPUs and billed), all with --include-ignored. The guest mounts cgroup
#    v2 and gives every test daemon a group of its own below
#    RFAAS_TEST_CGROUP, as systemd's Delegate=yes would, so these daemons
#    run each allocation in its own cgroup (RFAAS_TEST_CGROUP_V2 makes the
#    memory-limit test insist on it).
# Prints each runner's "test result:" line and fails if a test fails, if a
# binary ran no test, or if the VM could not run them (the VM script then
# says why, loudly). The image is built on first use (about a minute; see
# scripts/rdma-vm.sh for where it is cached).
#
# RDMA_VM_TIMEOUT (seconds, default 900 here) bounds the boot plus the tests.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

# In the guest: run both binaries, every test even after a failure.
if [ "${1:-}" = --in-guest ]; then
    lib=$2 conformance=$3 e2e=$4 acct=$5 isolation=$6 trust=$8 status=0
    # The guest has no openssl: the tests' managers serve HTTPS with a
    # throwaway CA the host made (testkit::tls::test_ca).
    export RFAAS_TEST_CA_DIR=$7
    # The guest's init mounts no cgroups; a unified (v2) hierarchy with the
    # memory controller lets the executor daemons here limit their workers
    # with memory.max, which the host (cgroup v1) cannot show.
    if [ ! -e /sys/fs/cgroup/cgroup.controllers ]; then
        mount -t cgroup2 cgroup2 /sys/fs/cgroup
    fi
    # The subtree test daemons get their groups in (testkit::executord),
    # with the controllers a site delegates to executord.
    controllers="+cpuset +cpu +memory"
    if echo "$controllers" >/sys/fs/cgroup/cgroup.subtree_control &&
        mkdir -p /sys/fs/cgroup/rfaas-tests &&
        echo "$controllers" >/sys/fs/cgroup/rfaas-tests/cgroup.subtree_control; then
        echo "== verbs: cgroup v2 (cpuset, cpu, memory): each allocation runs in its own group"
        export RFAAS_TEST_CGROUP_V2=1 RFAAS_TEST_CGROUP=/sys/fs/cgroup/rfaas-tests
    else
        echo "test-verbs: the guest cannot delegate cgroup v2 cpuset, cpu and memory" >&2
        status=1
    fi
    echo "== verbs: library device tests on $RDMA_DEVICE ($RDMA_VM_IP)"
    "$lib" verbs::tests:: --include-ignored --test-threads=1 || status=1
    echo "== verbs: conformance suite on verbs:$RDMA_DEVICE"
    "$conformance" verbs --include-ignored --test-threads=1 || status=1
    echo "== verbs: executor and client end to end on verbs:$RDMA_DEVICE"
    "$e2e" verbs --include-ignored --test-threads=1 || status=1
    echo "== verbs: the accounting service on verbs:$RDMA_DEVICE"
    "$acct" adds_over_verbs --include-ignored --test-threads=1 || status=1
    echo "== verbs: only a node with a live ticket adds, on verbs:$RDMA_DEVICE"
    "$trust" _over_verbs --include-ignored --test-threads=1 || status=1
    echo "== verbs: every process of an allocation stays in its cgroup"
    "$isolation" --include-ignored --test-threads=1 || status=1
    exit "$status"
fi

cd "$(repo_root)"
ensure_packages "${BUILD_PACKAGES[@]}" jq
ensure_rust

start=$SECONDS
bash scripts/rdma-vm.sh build

echo "== verbs: the test binaries"
# CI's one build (CI_BUILD in lib.sh; nothing to compile after
# scripts/test.sh's first step): the executables of the library's unit
# tests, the conformance suite and the client's end-to-end tests, and next
# to them in target/debug the daemon and worker those tests start, all with
# verbs.
binaries=$(cargo test "${CI_FEATURES[@]}" --no-run --message-format=json-render-diagnostics |
    jq -r 'select(.reason == "compiler-artifact" and .executable != null and .profile.test)
           | "\(.target.src_path) \(.executable)"')
# Each by its source file (several packages have an `e2e` test).
executable() {
    awk -v rel="/$1" 'substr($1, length($1) - length(rel) + 1) == rel { print $2 }' <<<"$binaries"
}
lib=$(executable fabric/src/lib.rs)
conformance=$(executable fabric/tests/conformance.rs)
e2e=$(executable client/tests/e2e.rs)
acct=$(executable accounting/tests/service.rs)
isolation=$(executable executor/tests/isolation.rs)
trust=$(executable accounting/tests/trust.rs)
if [ -z "$lib" ] || [ -z "$conformance" ] || [ -z "$e2e" ] || [ -z "$acct" ] || [ -z "$isolation" ] || [ -z "$trust" ]; then
    echo "test-verbs: cargo built no fabric library, fabric conformance, client e2e, accounting service, accounting trust or executor isolation test binary:" >&2
    echo "$binaries" >&2
    exit 1
fi
# The guest has no C compiler: one tcp case on the host builds the example
# function library into the target directory, where the guest finds it.
"$e2e" --exact echo_inline_and_bulk_sizes::case_1_tcp --test-threads=1

echo "== verbs: one VM boot for both (build took $((SECONDS - start)) s)"
log=$(mktemp)
trap 'rm -f "$log"' EXIT
vm_status=0
# The binaries live in cargo's target directory, which may be outside the repository.
target_dir=$(cargo metadata --format-version 1 --no-deps | jq -r .target_directory)
ca_dir=$target_dir/verbs-test-ca
rm -rf "$ca_dir"
make_test_ca "$ca_dir"
RDMA_VM_TIMEOUT=${RDMA_VM_TIMEOUT:-900} RDMA_VM_SHARE=$target_dir${RDMA_VM_SHARE:+:$RDMA_VM_SHARE} \
    bash scripts/rdma-vm.sh run -- "$PWD/scripts/test-verbs.sh" --in-guest "$lib" "$conformance" "$e2e" "$acct" "$isolation" "$ca_dir" "$trust" |
    tee "$log" || vm_status=$?
# With pipefail, the pipeline's status is the VM's (tee does not fail).

echo "== verbs: summary ($((SECONDS - start)) s in all)"
mapfile -t results < <(grep -E '^test result: ' "$log" || true)
[ ${#results[@]} -eq 0 ] || printf '%s\n' "${results[@]}"
failed=0
if [ "$vm_status" -ne 0 ]; then
    echo "test-verbs: FAILED: the run in the VM exited with $vm_status" >&2
    failed=1
fi
if [ ${#results[@]} -ne 6 ]; then
    echo "test-verbs: FAILED: expected 6 test summaries (library, conformance, e2e, accounting, isolation, accounting trust), got ${#results[@]}" >&2
    failed=1
fi
for line in "${results[@]}"; do
    passed=$(sed -n 's/^test result: ok\. \([0-9]*\) passed.*/\1/p' <<<"$line")
    if [ -z "$passed" ] || [ "$passed" -eq 0 ]; then
        echo "test-verbs: FAILED: no verbs test passed in: $line" >&2
        failed=1
    fi
done
[ "$failed" -eq 0 ] || exit 1
echo "test-verbs: ok"

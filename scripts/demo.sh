#!/usr/bin/env bash
# The rfaas demo on one machine: the whole local system on a real Slurm
# cluster on loopback (scripts/slurm-cluster.sh: munged, slurmctld, three
# slurmd), with the SPANK plugin rfaas_spank.so in its plugstack.conf. A
# resource manager on SQLite, an accounting service on the same database,
# and one executor daemon per Slurm node, which lends the node's idle CPUs
# and takes them back for Slurm's jobs.
#
# Then, as Slurm jobs:
#   1. `sbatch --rfaas` (as user nobody): the plugin puts the managers'
#      URLs and a credential for this job into its environment. The job
#      offloads half of a matrix product to a worker on another, idle
#      node (offload_matmul), then keeps calling a function there
#      (offload_loop);
#   2. a second job lands on the node job 1 offloads to: its prolog takes
#      the node back from rfaas within the grace period, and job 1 moves
#      to another node without losing a call;
#   3. job 1 ends: its credential is revoked, its leases released, and
#      its bill printed by rfaas-billing.
#
#   scripts/demo.sh            (N=512 REPS=20 by default: N=1024 scripts/demo.sh)
#
# Needs root, as slurmd and rfaas-executord do: the daemon starts each
# worker as the lease's user (here `nobody`). Installs what it needs first.
# Every process it starts is stopped by PID.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
root=$(repo_root)
cd "$root"

if [ "$(id -u)" -ne 0 ]; then
    echo "scripts/demo.sh: run it as root. slurmd starts jobs as their users, and" \
        "rfaas-executord starts each worker as the lease's user, here \`nobody\`;" \
        "a daemon that is not root may run workers only as itself." >&2
    exit 1
fi
ensure_packages "${BUILD_PACKAGES[@]}" "${SLURM_PACKAGES[@]}"
ensure_rust
echo "== building (release)"
cargo build --release -q -p rfaas-executor -p rfaas-manager -p rfaas-accounting \
    -p rfaas-example-functions -p rfaas-slurm-spank
cargo build --release -q -p rfaas-client --example offload_matmul --example offload_loop
bin="${CARGO_TARGET_DIR:-$root/target}/release"

work=$(mktemp -d "${TMPDIR:-/tmp}/rfaas-demo.XXXXXX")
chmod 0755 "$work"
NODE_PIDS=()
slurm_up=""
cleanup() {
    if [ -n "$slurm_up" ]; then
        RFAAS_SLURM_DIR="$work/slurm" scripts/slurm-cluster.sh stop >/dev/null 2>&1 || true
    fi
    stop_nodes
    stop_accounting
    stop_manager
    rm -rf "$work"
}
trap cleanup EXIT

# What the jobs run, where their user (nobody) can read it.
mkdir -p "$work/job" "$work/out"
chmod 0755 "$work/job"
chmod 1777 "$work/out"
cp "$bin/examples/offload_matmul" "$bin/examples/offload_loop" \
    "$bin/librfaas_example_functions.so" "$work/job/"
cp "$bin/librfaas_spank.so" "$work/rfaas_spank.so"
GRACE=5
echo "required $work/rfaas_spank.so grace=$GRACE socket=$work/%n/executord.sock log=$work/spank.log" \
    >"$work/plugstack.conf"

echo "== starting a Slurm cluster on loopback (3 nodes x 2 CPUs), the plugin in its plugstack.conf"
export RFAAS_SLURM_DIR="$work/slurm"
slurm_up=yes
NODES=3 CPUS=2 PLUGSTACK="$work/plugstack.conf" scripts/slurm-cluster.sh start
# shellcheck disable=SC1091
source "$RFAAS_SLURM_DIR/env"

# The manager asks this cluster (squeue, with SLURM_CONF from its
# environment) which jobs run where, as whom.
echo "== starting rfaas-manager and rfaas-accounting"
start_manager "$bin" "$work"
start_accounting "$bin" "$work"

echo "== starting an executor daemon on each Slurm node"
for node in node1 node2 node3; do
    start_node "$bin" "$work" "$node" 0-1 "[slurm]
conf = \"$SLURM_CONF\"
reconcile_interval_ms = 2000"
done
for _i in $(seq 300); do
    up=$("${RFAASCTL[@]}" nodes --json | grep -o '"state": *"up"' | wc -l || true)
    [ "$up" -eq 3 ] && break
    sleep 0.1
done
if [ "$up" -ne 3 ]; then
    echo "the executor daemons did not register within 30 s; their logs:" >&2
    tail -n 20 "$work"/node*/executord.log >&2
    exit 1
fi
echo
sinfo -N -o "%N %T %C"
echo
"${RFAASCTL[@]}" nodes

echo
echo "== job 1: sbatch --rfaas on node1, as nobody; it offloads to the idle nodes"
cat >"$work/job/job1.sh" <<SH
#!/bin/sh
echo "job \$SLURM_JOB_ID on \$SLURMD_NODENAME as \$(id -un): RFAAS_MANAGERS=\$RFAAS_MANAGERS, RFAAS_CREDENTIAL=\${RFAAS_CREDENTIAL%%.*}.(secret)"
echo
echo "-- half of C = A x B (${N:-512}x${N:-512}, f64) offloaded to a worker on another node"
$work/job/offload_matmul --library $work/job/librfaas_example_functions.so --n ${N:-512} --reps ${REPS:-20} || exit 1
echo
echo "-- calling a function there for 15 s, moving when the node is taken back"
exec $work/job/offload_loop --library $work/job/librfaas_example_functions.so --seconds 15
SH
chmod 0755 "$work/job/job1.sh"
job1=$(sbatch --parsable --rfaas --exclusive -N1 -w node1 --uid=nobody \
    -o "$work/out/job1.out" "$work/job/job1.sh")
echo "submitted job $job1"
target=""
for _i in $(seq 1200); do
    target=$(sed -n 's/^calling echo on \([^ ]*\) .*/\1/p' "$work/out/job1.out" 2>/dev/null |
        head -n 1 || true)
    [ -n "$target" ] && break
    state=$(squeue -h -j "$job1" -o %T 2>/dev/null || true)
    [ -z "$state" ] && break
    sleep 0.1
done
if [ -z "$target" ]; then
    echo "job $job1 did not start offloading; its output:" >&2
    cat "$work/out/job1.out" >&2 || true
    exit 1
fi
sleep 2

echo
echo "== job 2 lands on $target, where job 1 offloads: its prolog takes $target back (grace ${GRACE} s)"
submitted=$(date +%s.%N)
job2=$(sbatch --parsable --exclusive -N1 -w "$target" -o /dev/null \
    --wrap "date +%s.%N > $work/out/job2.started; sleep 3")
for _i in $(seq 600); do
    [ -s "$work/out/job2.started" ] && break
    sleep 0.1
done
started=$(cat "$work/out/job2.started" 2>/dev/null || echo "$submitted")
awk -v j="$job2" -v a="$submitted" -v b="$started" -v g="$GRACE" \
    'BEGIN { printf "job %s started %.2f s after its submission (at most grace + 2 s = %d s)\n", j, b - a, g + 2 }'
{ grep -h "job $job2 on $target" "$work/spank.log" || true; } | sed 's/^[0-9.]* pid=[0-9]* //'

for _i in $(seq 600); do
    state=$(squeue -h -j "$job1" -o %T 2>/dev/null || true)
    [ -z "$state" ] && break
    sleep 0.2
done
echo
echo "== job 1's output"
cat "$work/out/job1.out"

echo
echo "== the nodes after both jobs: every core lent again"
"${RFAASCTL[@]}" nodes

echo
echo "== job 1's leases, as the manager recorded them (released when the job ended)"
"${RFAASCTL[@]}" leases --all

# The job's end released its leases; their executors post the last of
# their usage and close their slots, and the accounting service writes the
# final totals.
echo
echo "== job 1's bill (rfaas-billing -j $job1)"
for _i in $(seq 100); do
    closed=$("${BILLING[@]}" --json -j "$job1" --by lease 2>/dev/null | grep -c '"lease"' || true)
    [ "$closed" -ge 2 ] && break
    sleep 0.1
done
sleep 2
"${BILLING[@]}" -j "$job1" --by job,account,user

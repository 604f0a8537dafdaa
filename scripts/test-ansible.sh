#!/usr/bin/env bash
# Lints the Ansible collection (ansible/) and runs its playbook against
# real hosts, for CI.
#
#   scripts/test-ansible.sh          lint, then the play on booted roots (as root)
#   scripts/test-ansible.sh lint     ansible-lint (production profile) and
#                                    ansible-playbook --syntax-check only
#
# ansible-core and ansible-lint come from PyPI, pinned below, into a
# virtualenv under target/ (kept between runs; delete it to reinstall).
#
# The hosts: four booted Debian 12 roots (scripts/roots.sh boot, recipe
# bookworm-ansible: systemd as PID 1, sshd, python3) sharing one network
# namespace made here, each on its own 127.0.20.x address and with every
# name in its /etc/hosts. Ansible runs in that namespace and reaches them
# over real ssh, as root, with a key made here:
#   manager1 127.0.20.1  rfaas_manager (PostgreSQL), rfaas_accounting,
#                        rfaas_monitoring; Slurm's client commands
#   compute1 127.0.20.2  slurmctld, slurmd, rfaas_executor, rfaas_slurm
#   compute2 127.0.20.3  slurmd, rfaas_executor, rfaas_slurm
#   compute3 127.0.20.4  slurmd; joins the inventory for the third run
# Slurm itself (munge, slurm.conf, the user alice) is set up here before
# the play, as a site's Slurm would be. The checks, each failing the stage:
# 1. the play (ansible/playbooks/site.yml) succeeds;
# 2. `sbatch --rfaas` on compute1, taking all its CPUs, runs the example job
#    (scripts/package.sh deb --example-job), whose offloaded result is
#    checked, and rfaas-billing on manager1 shows the job with its
#    allocation and invocations;
# 3. a second run reports changed=0 on every host;
# 4. with compute3 added to the inventory, a third run ends with the
#    managers listing compute3 with its cores (GET /v1/nodes, at once).
# Every root is stopped by its leader's PID, and the namespace deleted, on
# every exit. Prints `ansible stage: N s`.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
root=$(repo_root)

ANSIBLE_CORE_VERSION=2.17.7
ANSIBLE_LINT_VERSION=24.12.2
venv=${RFAAS_ANSIBLE_VENV:-$root/target/venv-ansible}
packages=${RFAAS_PACKAGES_DIR:-${CARGO_TARGET_DIR:-$root/target}/packages}
# The folder of alert rules and dashboard the monitoring role installs.
monitoring=${RFAAS_MONITORING_DIR:-$root/monitoring}
ROOT_RECIPE=bookworm-ansible
HOSTS=(manager1 compute1 compute2 compute3)
declare -A ADDR=([manager1]=127.0.20.1 [compute1]=127.0.20.2 [compute2]=127.0.20.3 [compute3]=127.0.20.4)
stage_start=$(date +%s)

ensure_ansible() {
    # (Not `ansible-lint --version`: it would make .ansible/ in the checkout.)
    if [ "$("$venv/bin/python3" -c 'import importlib.metadata as m
print(m.version("ansible-core"), m.version("ansible-lint"))' 2>/dev/null)" != \
        "$ANSIBLE_CORE_VERSION $ANSIBLE_LINT_VERSION" ]; then
        echo "test-ansible: installing ansible-core $ANSIBLE_CORE_VERSION and ansible-lint $ANSIBLE_LINT_VERSION into $venv" >&2
        rm -rf "$venv"
        python3 -m venv "$venv" || {
            echo "test-ansible: python3 cannot make a virtualenv; install python3-venv" >&2
            exit 1
        }
        "$venv/bin/pip" install --quiet --disable-pip-version-check \
            "ansible-core==$ANSIBLE_CORE_VERSION" "ansible-lint==$ANSIBLE_LINT_VERSION"
    fi
}

# Lints a copy of ansible/, as ansible-lint keeps its cache in the
# project's folder (.ansible/), which must not appear in the checkout.
lint() {
    echo "== ansible-lint (production profile) and --syntax-check"
    rm -rf "$work/lint"
    cp -r "$root/ansible" "$work/lint"
    (cd "$work/lint" &&
        PATH="$venv/bin:$PATH" ANSIBLE_HOME="$work/ansible-home" \
            ansible-playbook --syntax-check -i inventory/example.yml playbooks/site.yml &&
        PATH="$venv/bin:$PATH" ANSIBLE_HOME="$work/ansible-home" \
            ansible-lint --profile production --offline --nocolor playbooks/site.yml roles inventory galaxy.yml)
    echo "== each role's README documents every variable of its defaults/main.yml"
    local d v missing=()
    for d in "$root"/ansible/roles/*/; do
        for v in $(sed -n 's/^\([a-z][a-z0-9_]*\):.*/\1/p' "$d/defaults/main.yml"); do
            grep -q "^| \`$v\` |" "$d/README.md" || missing+=("${d#"$root"/}README.md: $v")
        done
    done
    if [ ${#missing[@]} -gt 0 ]; then
        printf 'a role variable its README does not document (add a table row for it): %s\n' "${missing[@]}" >&2
        return 1
    fi
}

case "${1:-run}" in
lint | run) ;;
*)
    echo "usage: $0 [run | lint]" >&2
    exit 2
    ;;
esac
ensure_packages python3 python3-venv
ensure_ansible
work=$(mktemp -d "${TMPDIR:-/tmp}/rfaas-ansible.XXXXXX")
chmod 0755 "$work"
if [ "${1:-run}" = lint ]; then
    trap 'rm -rf "$work"' EXIT
    lint
    exit 0
fi

if [ "$(id -u)" -ne 0 ]; then
    echo "scripts/test-ansible.sh: run it as root: it boots four Debian roots with systemd-nspawn." >&2
    exit 1
fi
ensure_packages systemd-container iproute2 openssh-client util-linux
netns="rfaas-ansible-$$"
declare -A LEADER=()
step="linting the collection"

cleanup() {
    local rc=$? h
    if [ "$rc" -ne 0 ]; then
        for h in "${HOSTS[@]}"; do
            [ -n "${LEADER[$h]:-}" ] || continue
            echo "---- $h: failed units, and the last lines of rfaas's and Slurm's logs" >&2
            in_root "$h" systemctl --no-pager --failed >&2 || true
            in_root "$h" journalctl --no-pager -n 30 -u 'rfaas-*' -u slurmctld -u slurmd >&2 || true
        done
        loud "FAILED: scripts/test-ansible.sh, step: $step (exit code $rc)." \
            "The output above says which task or check failed."
    fi
    for h in "${HOSTS[@]}"; do
        [ -n "${LEADER[$h]:-}" ] && bash "$root/scripts/roots.sh" stop "rfaas-ansible-$h" >/dev/null 2>&1
    done
    ip netns del "$netns" 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT

# in_root HOST CMD...: runs CMD as root in HOST's root (in_booted_root).
in_root() {
    local h=$1
    shift
    in_booted_root "${LEADER[$h]}" "$@"
}

lint

step="finding the packages"
if [ ! -x "$packages/example-job/offload_matmul" ] || ! ls "$packages"/rfaas-manager_*.deb >/dev/null 2>&1; then
    echo "test-ansible: no packages or example job in $packages; building them (scripts/package.sh deb --example-job)"
    bash "$root/scripts/package.sh" deb --example-job
fi
[ -d "$monitoring" ] || {
    echo "test-ansible: $monitoring (the alert rules and dashboard rfaas_monitoring installs) is missing;" \
        "set RFAAS_MONITORING_DIR to such a folder" >&2
    exit 1
}

step="booting the roots ($ROOT_RECIPE)"
bash "$root/scripts/roots.sh" build "$ROOT_RECIPE"
ip netns add "$netns"
ip -n "$netns" link set lo up
hosts_lines=$'127.0.0.1 localhost\n::1 localhost ip6-localhost ip6-loopback\n'
for h in "${HOSTS[@]}"; do
    ip -n "$netns" addr add "${ADDR[$h]}/8" dev lo
    hosts_lines+="${ADDR[$h]} $h"$'\n'
done
ssh-keygen -q -t ed25519 -N "" -C rfaas-ansible-test -f "$work/id_ed25519"
for h in "${HOSTS[@]}"; do
    LEADER[$h]=$(bash "$root/scripts/roots.sh" boot "$ROOT_RECIPE" --name "rfaas-ansible-$h" \
        --network-namespace-path "/run/netns/$netns" | tail -n 1)
    [[ ${LEADER[$h]} =~ ^[0-9]+$ ]] || {
        echo "scripts/roots.sh boot printed no leader PID for $h" >&2
        exit 1
    }
    r=/proc/${LEADER[$h]}/root
    printf '%s' "$hosts_lines" >"$r/etc/hosts"
    in_root "$h" sh -c "echo $h > /etc/hostname && hostname $h"
    # One network namespace for all: each sshd on its own address.
    printf 'ListenAddress %s\nPermitRootLogin prohibit-password\n' "${ADDR[$h]}" >"$r/etc/ssh/sshd_config.d/rfaas-test.conf"
    install -d -m 0700 "$r/root/.ssh"
    install -m 0600 "$work/id_ed25519.pub" "$r/root/.ssh/authorized_keys"
    in_root "$h" systemctl restart ssh
done
echo "roots up: $(for h in "${HOSTS[@]}"; do printf '%s (leader %s) ' "$h" "${LEADER[$h]}"; done)"

# A site's Slurm, as docs/install.md sets up the trial one: slurmctld on
# compute1, a slurmd on each compute node (each on its own port: they share
# the namespace), Slurm's clients and munge on manager1 (the manager asks
# squeue), one munge key, the user alice everywhere.
step="setting up Slurm on the roots"
cpus=$(nproc)
{
    cat <<END
ClusterName=ansible
SlurmctldHost=compute1(${ADDR[compute1]})
SlurmUser=slurm
StateSaveLocation=/var/lib/slurm/slurmctld
SlurmdSpoolDir=/var/lib/slurm/slurmd
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
PrologEpilogTimeout=120
END
    port=6818
    for h in compute1 compute2 compute3; do
        echo "NodeName=$h NodeAddr=${ADDR[$h]} Port=$port CPUs=$cpus State=UNKNOWN"
        port=$((port + 1))
    done
    echo "PartitionName=main Nodes=compute[1-3] Default=YES MaxTime=INFINITE State=UP"
} >"$work/slurm.conf"
head -c 1024 /dev/urandom >"$work/munge.key"
for h in "${HOSTS[@]}"; do
    pkgs="slurm-client munge"
    [ "$h" = manager1 ] || pkgs+=" slurmd"
    [ "$h" = compute1 ] && pkgs+=" slurmctld"
    # shellcheck disable=SC2086 # the package names are words
    in_root "$h" apt-get install -y -q --no-install-recommends $pkgs >/dev/null
    r=/proc/${LEADER[$h]}/root
    install -m 0644 "$work/slurm.conf" "$r/etc/slurm/slurm.conf"
    install -m 0400 "$work/munge.key" "$r/etc/munge/munge.key"
    in_root "$h" sh -c 'chown munge:munge /etc/munge/munge.key && systemctl restart munge &&
        useradd --create-home --uid 5001 alice'
    [ "$h" = compute1 ] && in_root "$h" systemctl restart slurmctld
done
for h in compute1 compute2 compute3; do in_root "$h" systemctl restart slurmd; done

# The inventory: the example's groups, the roots' addresses, ssh as root
# with the test's key. Daemons bind their host's address (one namespace).
write_inventory() {
    local computes=$1 h
    {
        cat <<END
all:
  vars:
    ansible_user: root
    ansible_ssh_private_key_file: $work/id_ed25519
    rfaas_common_package_source: dir
    rfaas_common_package_dir: $packages
    rfaas_manager_database: postgresql
    rfaas_manager_listen: "{{ rfaas_common_address }}:7300"
    rfaas_executor_control_listen: "{{ rfaas_common_address }}:7100"
    rfaas_executor_metrics_listen: "{{ rfaas_common_address }}:7110"
    rfaas_accounting_metrics_listen: "{{ rfaas_common_address }}:7410"
    rfaas_monitoring_source_dir: $monitoring
  children:
    rfaas_managers:
      hosts:
        manager1:
          ansible_host: ${ADDR[manager1]}
    rfaas_accounting:
      hosts:
        manager1:
    rfaas_monitoring:
      hosts:
        manager1:
    slurm_controllers:
      hosts:
        compute1:
    slurm_submit:
      hosts: {}
    rfaas_compute:
      hosts:
END
        for h in $computes; do
            printf '        %s:\n          ansible_host: %s\n' "$h" "${ADDR[$h]}"
        done
    } >"$work/inventory.yml"
}

# play LOG: runs the site playbook in the roots' namespace; the recap to LOG.
play() {
    ip netns exec "$netns" env ANSIBLE_CONFIG="$root/ansible/ansible.cfg" ANSIBLE_HOME="$work/ansible-home" \
        ANSIBLE_LOCAL_TEMP="$work/ansible-tmp" ANSIBLE_FORCE_COLOR=0 ANSIBLE_NOCOLOR=1 \
        ANSIBLE_SSH_ARGS="-o ControlMaster=no -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o LogLevel=ERROR" \
        "$venv/bin/ansible-playbook" -i "$work/inventory.yml" "$root/ansible/playbooks/site.yml" | tee "$1"
}

# The recap lines (HOST : ok=N changed=N ...) of LOG.
recap() { sed -n '/^PLAY RECAP/,$p' "$1" | grep ' : ok='; }

step="the first run of the play"
echo
echo "== the play, first run (manager1, compute1, compute2)"
write_inventory "compute1 compute2"
play "$work/run1.log"

step="an sbatch --rfaas job on compute1 and its bill"
echo
echo "== an sbatch --rfaas job on compute1, which keeps none of its CPUs for rfaas"
install -d "/proc/${LEADER[compute1]}/root/opt/rfaas-example"
cp "$packages/example-job/offload_matmul" "$packages/example-job/librfaas_example_functions.so" \
    "/proc/${LEADER[compute1]}/root/opt/rfaas-example/"
in_root compute1 runuser -u alice -- sbatch --parsable --wait --rfaas -w compute1 -n1 -c "$cpus" --chdir=/home/alice \
    --wrap "/opt/rfaas-example/offload_matmul --library /opt/rfaas-example/librfaas_example_functions.so --n 256 --reps 5"
out=$(cat "/proc/${LEADER[compute1]}/root/home/alice/"slurm-*.out 2>/dev/null || true)
printf '%s\n' "$out"
grep -q "result checked against the local product" <<<"$out" || {
    echo "the job's output on compute1 does not say its offloaded result was checked" >&2
    exit 1
}
billed=""
deadline=$((SECONDS + 60))
while [ $SECONDS -lt $deadline ]; do
    # The roots' executor daemons get no cgroup from nspawn, so workers'
    # CPU time (ComputeSec) is not measured there: the allocation is.
    billed=$(in_root manager1 rfaas-billing --database -S today --by job -n -P -o JobID,AllocGiBSec,Invocations |
        awk -F'|' '$1 != "" && $2 + 0 > 0 && $3 + 0 > 0 { print; exit }' || true)
    [ -n "$billed" ] && break
    sleep 0.1
done
[ -n "$billed" ] || {
    echo "rfaas-billing on manager1 shows no job with allocation and invocations after 60 s:" >&2
    in_root manager1 rfaas-billing --database -S today --by job,lease >&2 || true
    exit 1
}
echo "billed: job|allocation GiB s|invocations = $billed"

step="the second run of the play (changed=0 everywhere)"
echo
echo "== the play, second run: nothing changes"
play "$work/run2.log"
changed=$(recap "$work/run2.log" | grep -v 'changed=0 ' || true)
[ -z "$changed" ] || {
    echo "the second run changed these hosts (it must change none); the tasks marked 'changed' above say what:" >&2
    printf '%s\n' "$changed" >&2
    exit 1
}
[ "$(recap "$work/run2.log" | wc -l)" -eq 3 ] || {
    echo "the second run's recap does not list the three hosts" >&2
    exit 1
}

step="compute3 joins with one inventory line"
echo
echo "== the play, third run, with compute3 in the inventory"
write_inventory "compute1 compute2 compute3"
play "$work/run3.log"
nodes=$(in_root manager1 runuser -u rfaas -- rfaasctl --json --manager https://manager1:7300 \
    --ca-file /etc/rfaas/ca.pem nodes)
cores=$(python3 -c 'import json, sys
print(sum(n["cores"] for n in json.load(sys.stdin) if n["name"] == "compute3"))' <<<"$nodes")
[ "$cores" -gt 0 ] || {
    echo "after the third run the managers do not list compute3 with its cores; GET /v1/nodes:" >&2
    printf '%s\n' "$nodes" >&2
    exit 1
}
echo "compute3 offers $cores cores"
step="done"
echo "ansible stage: $(($(date +%s) - stage_start)) s"

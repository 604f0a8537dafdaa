#!/usr/bin/env bash
# Runs docs/install.md as written: takes its shell blocks from the page
# itself (each fenced as ```sh host=admin|manager|compute), in order, and
# runs each on its host, so the guide cannot drift from what works.
#
#   scripts/test-install-guide.sh                 run the guide (as root;
#                                                 RFAAS_INSTALL_GUIDE=FILE runs
#                                                 another page the same way)
#   scripts/test-install-guide.sh list [FILE]     print "N HOST LINE" per block
#   scripts/test-install-guide.sh extract FILE DIR
#                                                 write DIR/NN-HOST.sh per block
#
# The hosts:
#   admin    this machine, in a fresh directory where rfaas/ is this
#            checkout (the guide's "admin's machine": it builds the packages
#            and the example job, makes the trial CA, copies files);
#   manager  manager1, 127.0.10.1 } two booted Debian 12 roots (systemd as
#   compute  compute1, 127.0.10.2 } PID 1, scripts/roots.sh boot) sharing one
#            network namespace made here, each name in both roots' /etc/hosts.
# `ssh HOST CMD` and `scp [HOST:]PATH... [HOST:]PATH` on the admin host reach
# the roots through small stand-ins (nsenter into the root, and its
# /proc/PID/root); nothing else of the guide is replaced. apt-get in the roots
# finds what the guide installs among the archives their recipe downloaded.
#
# Passes only if every block succeeds and, at the end, the job's output on
# the node says its offloaded result was checked, and rfaas-billing on the
# manager host shows a job with compute time and invocations. Every root is stopped by its
# leader's PID, and the namespace deleted, on every exit. Prints
# `install guide stage: N s`.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
root=$(repo_root)

# RFAAS_INSTALL_GUIDE: another page to run the same way (a draft).
GUIDE=${RFAAS_INSTALL_GUIDE:-$root/docs/install.md}
# The hosts a block may name, and the roots' names and addresses.
GUIDE_HOSTS=(admin manager compute)
declare -A HOST_NAME=([manager]=manager1 [compute]=compute1)
declare -A HOST_ADDR=([manager]=127.0.10.1 [compute]=127.0.10.2)
ROOT_RECIPE=bookworm-base

# Writes DIR/NN-HOST.sh for each shell block of FILE and prints "NN HOST
# LINE" for each (LINE: the fence's line). Fails, naming the line, on a
# shell block without a known host=, or a fence left open.
extract_blocks() {
    local file=$1 dir=$2
    mkdir -p "$dir"
    local shown="${GUIDE_HOSTS[*]}"
    awk -v dir="$dir" -v file="$file" -v hosts=" ${GUIDE_HOSTS[*]} " -v shown="${shown// /, }" '
        function fail(msg) { printf "%s:%d: %s\n", file, NR, msg > "/dev/stderr"; bad = 1 }
        /^[ \t]*```/ {
            if (fence) {
                if (out != "") close(out)
                fence = 0; out = ""
                next
            }
            fence = 1; start = NR
            info = $0
            indent = match(info, /[^ \t]/) - 1
            sub(/^[ \t]*```/, "", info)
            split(info, words, /[ \t]+/)
            if (words[1] !~ /^(sh|bash|shell|console)$/) next
            host = ""
            for (i in words) if (words[i] ~ /^host=/) host = substr(words[i], 6)
            if (host == "") { fail("a shell block names no host: fence it as ```sh host=NAME, NAME one of " shown); next }
            if (index(hosts, " " host " ") == 0) { fail("host=" host " is none of the hosts: " shown); next }
            n++
            out = sprintf("%s/%02d-%s.sh", dir, n, host)
            printf "" > out
            printf "%02d %s %d\n", n, host, NR
            next
        }
        out != "" { line = $0; if (indent > 0) line = substr(line, indent + 1); print line > out }
        END {
            if (fence) { NR = start; fail("this fence is never closed") }
            if (n == 0 && !bad) { printf "%s: no ```sh host=NAME block\n", file > "/dev/stderr"; bad = 1 }
            exit bad
        }' "$file"
}

case "${1:-run}" in
list)
    dir=$(mktemp -d)
    trap 'rm -rf "$dir"' EXIT
    extract_blocks "${2:-$GUIDE}" "$dir"
    exit 0
    ;;
extract)
    [ $# -eq 3 ] || { echo "usage: $0 extract FILE DIR" >&2; exit 2; }
    extract_blocks "$2" "$3" >/dev/null
    exit 0
    ;;
run) ;;
*)
    echo "usage: $0 [run | list [FILE] | extract FILE DIR]" >&2
    exit 2
    ;;
esac

if [ "$(id -u)" -ne 0 ]; then
    echo "scripts/test-install-guide.sh: run it as root: it boots two Debian roots" \
        "with systemd-nspawn, and the guide's steps run as root on them." >&2
    exit 1
fi
ensure_packages systemd-container iproute2 openssl util-linux
ensure_rust

stage_start=$(date +%s)
work=$(mktemp -d "${TMPDIR:-/tmp}/rfaas-guide.XXXXXX")
chmod 0755 "$work"
netns="rfaas-guide-$$"
declare -A LEADER=()
step="extracting the blocks of docs/install.md"

cleanup() {
    local rc=$? h
    if [ "$rc" -ne 0 ]; then
        for h in manager compute; do
            [ -n "${LEADER[$h]:-}" ] || continue
            echo "---- ${HOST_NAME[$h]}: failed units, and the last lines of rfaas's and Slurm's logs" >&2
            in_root "$h" systemctl --no-pager --failed >&2 || true
            in_root "$h" journalctl --no-pager -n 40 -u 'rfaas-*' -u slurmctld -u slurmd -u munge \
                -u postgresql@15-main >&2 || true
        done
        loud "FAILED: scripts/test-install-guide.sh, step: $step (exit code $rc)." \
            "docs/install.md as written did not work; the output above says where."
    fi
    for h in manager compute; do
        [ -n "${LEADER[$h]:-}" ] && bash "$root/scripts/roots.sh" stop "rfaas-guide-$h" >/dev/null 2>&1
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

extract_blocks "$GUIDE" "$work/blocks" >"$work/blocks.list"

step="booting the manager and compute roots ($ROOT_RECIPE)"
bash "$root/scripts/roots.sh" build "$ROOT_RECIPE"
ip netns add "$netns"
ip -n "$netns" link set lo up
for h in manager compute; do
    ip -n "$netns" addr add "${HOST_ADDR[$h]}/8" dev lo
done
# A minbase root has no /etc/hosts: localhost, and the guide's two names.
hosts_lines=$'127.0.0.1 localhost\n::1 localhost ip6-localhost ip6-loopback\n'
for h in manager compute; do
    hosts_lines+="${HOST_ADDR[$h]} ${HOST_NAME[$h]}"$'\n'
done
for h in manager compute; do
    LEADER[$h]=$(bash "$root/scripts/roots.sh" boot "$ROOT_RECIPE" --name "rfaas-guide-$h" \
        --network-namespace-path "/run/netns/$netns" | tail -n 1)
    [[ ${LEADER[$h]} =~ ^[0-9]+$ ]] || {
        echo "scripts/roots.sh boot printed no leader PID for ${HOST_NAME[$h]}" >&2
        exit 1
    }
done
for h in manager compute; do
    state=""
    for _i in $(seq 600); do
        state=$(in_root "$h" systemctl is-system-running 2>/dev/null || true)
        [[ $state == running || $state == degraded ]] && break
        sleep 0.1
    done
    [[ $state == running || $state == degraded ]] || {
        echo "${HOST_NAME[$h]}'s systemd is not up after 60 s (is-system-running: ${state:-nothing})" >&2
        exit 1
    }
    in_root "$h" hostnamectl set-hostname "${HOST_NAME[$h]}" 2>/dev/null ||
        in_root "$h" sh -c "echo ${HOST_NAME[$h]} > /etc/hostname && hostname ${HOST_NAME[$h]}"
    printf '%s' "$hosts_lines" >"/proc/${LEADER[$h]}/root/etc/hosts"
done
echo "roots up: ${HOST_NAME[manager]} (leader ${LEADER[manager]}), ${HOST_NAME[compute]} (leader ${LEADER[compute]})"

# The admin's ssh and scp: to the roots by their names.
mkdir -p "$work/admin" "$work/bin"
ln -s "$root" "$work/admin/rfaas"
for h in manager compute; do
    echo "${HOST_NAME[$h]} ${LEADER[$h]}"
done >"$work/hosts"
cat >"$work/bin/ssh" <<SH
#!/usr/bin/env bash
# ssh HOST COMMAND...: COMMAND as root on HOST, one of the guide's roots.
set -euo pipefail
leader=\$(awk -v h="\$1" '\$1 == h { print \$2 }' "$work/hosts")
[ -n "\$leader" ] || { echo "ssh: Could not resolve hostname \$1" >&2; exit 255; }
shift
exec nsenter --target "\$leader" --all -- env -i HOME=/root LANG=C.UTF-8 \\
    PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin bash -c "cd /root && \$*"
SH
cat >"$work/bin/scp" <<SH
#!/usr/bin/env bash
# scp [-OPTIONS] SOURCE... TARGET: each [HOST:]PATH, HOST one of the
# guide's roots (a relative PATH is in root's home there).
set -euo pipefail
at() {
    case \$1 in
    *:*)
        local host=\${1%%:*} path=\${1#*:} leader
        leader=\$(awk -v h="\$host" '\$1 == h { print \$2 }' "$work/hosts")
        [ -n "\$leader" ] || { echo "scp: Could not resolve hostname \$host" >&2; exit 255; }
        [[ \$path == /* ]] || path=/root/\$path
        printf '%s' "/proc/\$leader/root\$path" ;;
    *) printf '%s' "\$1" ;;
    esac
}
args=()
for a in "\$@"; do [[ \$a == -* ]] || args+=("\$a"); done
[ \${#args[@]} -ge 2 ] || { echo "usage: scp SOURCE... TARGET" >&2; exit 1; }
target=\$(at "\${args[-1]}")
for src in "\${args[@]:0:\${#args[@]}-1}"; do
    cp -- "\$(at "\$src")" "\$target"
done
SH
chmod 0755 "$work/bin/ssh" "$work/bin/scp"

while read -r n host line; do
    block="$work/blocks/$n-$host.sh"
    step="the block at docs/install.md:$line (host=$host)"
    echo
    where="the admin's machine"
    [ "$host" = admin ] || where=${HOST_NAME[$host]}
    echo "== docs/install.md:$line, on $where"
    sed 's/^/    /' "$block"
    if [ "$host" = admin ]; then
        (cd "$work/admin" && env -u CARGO_TARGET_DIR PATH="$work/bin:$PATH" \
            bash -euo pipefail "$block") </dev/null
    else
        in_root "$host" bash -euo pipefail -c "$(cat "$block")" </dev/null
    fi
done <"$work/blocks.list"

step="checking the job's output and its bill"
echo
echo "== the job's output and its bill"
out=$(cat "/proc/${LEADER[compute]}/root/home/alice/"slurm-*.out 2>/dev/null || true)
grep -q "result checked against the local product" <<<"$out" || {
    echo "the job's output on ${HOST_NAME[compute]} does not say its offloaded result was checked:" >&2
    printf '%s\n' "$out" >&2
    exit 1
}
# The last usage of the job's lease lands within seconds of its end: wait
# for it, bounded.
billed=""
for _i in $(seq 600); do
    billed=$(in_root manager rfaas-billing --database -S today --by job -n -P \
        -o JobID,ComputeSec,Invocations |
        awk -F'|' '$1 != "" && $2 + 0 > 0 && $3 + 0 > 0 { print; exit }' || true)
    [ -n "$billed" ] && break
    sleep 0.1
done
if [ -z "$billed" ]; then
    echo "rfaas-billing on ${HOST_NAME[manager]} shows no job with compute time and invocations after 60 s:" >&2
    in_root manager rfaas-billing --database -S today --by job,lease >&2 || true
    exit 1
fi
in_root manager rfaas-billing --database -S today --by job,user
echo "billed: job|compute seconds|invocations = $billed"
step="done"
echo "install guide stage: $(($(date +%s) - stage_start)) s"

#!/usr/bin/env bash
# Installs the .debs scripts/package.sh built (target/packages/) into clean
# Debian 12 and Debian 13 roots (scripts/roots.sh: bookworm-base,
# trixie-base) and checks what an admin relies on:
#
#   scripts/test-packages.sh [DIR]        default DIR: target/packages
#
# 1. `apt-get install ./*.deb` and nothing else succeeds, offline (the
#    roots hold the archives of what the packages pull), and every binary
#    runs there; files, modes, the rfaas user and the plugstack.conf.d
#    snippet (commented out) are as docs/packages.md says.
# 2. Upgrade from the previous build (the packages of the last run that
#    passed, kept in /var/cache/rfaas/packages; the first time, this
#    build's repackaged as VERSION~prev with a different executord.toml):
#    an edited /etc/rfaas file and the contents of /var/lib/rfaas stay.
# 3. In the booted Debian 12 root (systemd as PID 1): with rfaas-executord
#    running under its unit with pooled workers, `apt-get remove` leaves
#    no rfaas process, no rfaas cgroup and no socket under /run/rfaas;
#    purging them removes /var/lib/rfaas.
#
# rfaas-slurm is built for one Slurm release: the host's (22.05,
# libslurm38) goes into Debian 12, and Debian 13 takes the one built
# against its own headers (24.11, libslurm42t64) by
# `SLURM_INCLUDE_DIR=<trixie-slurm root>/usr/include scripts/package.sh deb
# --only rfaas-slurm`, in DIR/slurm-24.11/. (The previous build installed
# before an upgrade holds the five packages of Debian 12; on Debian 13 the
# upgrade then installs its rfaas-slurm for the first time.)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
root=$(repo_root)
cd "$root"
dir=$(cd "${1:-target/packages}" && pwd)
readonly CACHE=/var/cache/rfaas/packages
readonly ROOTS=scripts/roots.sh

shopt -s nullglob
debs=("$dir"/*.deb)
[ ${#debs[@]} -ge 5 ] || {
    echo "test-packages.sh: ${#debs[@]} .deb in $dir, expected 5: run scripts/package.sh deb first" >&2
    exit 1
}
work=$(mktemp -d /tmp/rfaas-test-packages.XXXXXX)
booted=""
cleanup() {
    [ -z "$booted" ] || bash "$ROOTS" stop "$booted" >/dev/null 2>&1 || true
    rm -rf "$work"
}
trap cleanup EXIT

fail() {
    loud "FAILED: test-packages.sh: $*"
    exit 1
}

# Debian 13's own rfaas-slurm (see above).
trixie_slurm=$(ls "$dir"/slurm-24.11/rfaas-slurm_*.deb 2>/dev/null | head -1) || true
[ -n "$trixie_slurm" ] || fail "no rfaas-slurm for Debian 13's Slurm in $dir/slurm-24.11: build it with" \
    "SLURM_INCLUDE_DIR=\$(scripts/roots.sh path trixie-slurm)/usr/include scripts/package.sh deb --only rfaas-slurm"

# The packages, by file, each release installs: on Debian 13, its own
# rfaas-slurm in this build, none in the previous one.
#   install_set DIR SUITE
install_set() {
    local d=$1 suite=$2 f
    for f in "$d"/*.deb; do
        [[ $suite == trixie && $(basename "$f") == rfaas-slurm_* ]] && continue
        printf '%s\n' "$f"
    done
    if [ "$suite" = trixie ] && [ "$d" = "$dir" ]; then printf '%s\n' "$trixie_slurm"; fi
}

# Copies the .debs in FROM into TO as version VERSION~prev: what the next
# run upgrades from.
#   copy_as_previous TO FROM_DEBS...
copy_as_previous() {
    local to=$1 f
    shift
    cp "$@" "$to/"
    for f in "$to"/*.deb; do
        deb_rewrite "$f" "s/^Version: .*/Version: ${version%-*}~prev-1/"
    done
}

# The previous build: the cached packages of the last run that passed, or
# this build's, one version lower and with another executord.toml.
prev=$work/prev
mkdir -p "$prev"
version=$(dpkg-deb -f "$(ls "$dir"/rfaas-executor_*.deb)" Version)
cached=("$CACHE"/*.deb)
if [ ${#cached[@]} -ge 5 ]; then
    echo "== previous build: $CACHE ($(dpkg-deb -f "${cached[0]}" Version))"
    cp "${cached[@]}" "$prev/"
else
    echo "== previous build: none cached in $CACHE; this build as ${version%-*}~prev"
    copy_as_previous "$prev" "${debs[@]}"
    deb_rewrite "$prev"/rfaas-executor_*.deb "" etc/rfaas/executord.toml \
        "$(printf '# as shipped by the previous build\n%s' "$(cat executor/rfaas-executord.example.toml)")"
fi

# What each release's check runs inside its root, after installing.
# shellcheck disable=SC2016 # expanded inside the root
check_installed='
set -eu
fail() { echo "FAILED in $SUITE: $*" >&2; exit 1; }
for b in /usr/sbin/rfaas-executord /usr/sbin/rfaas-worker /usr/sbin/rfaas-manager \
    /usr/sbin/rfaas-accounting /usr/bin/rfaasctl /usr/bin/rfaas-token /usr/bin/rfaas-billing; do
    "$b" --help >/dev/null 2>&1 || fail "$b --help does not run here: $("$b" --help 2>&1 | head -3)"
done
for f in executord manager accounting billing; do
    [ -f /etc/rfaas/$f.toml ] || fail "/etc/rfaas/$f.toml is missing"
done
[ "$(stat -c %a /var/lib/rfaas)" = 700 ] || fail "/var/lib/rfaas has mode $(stat -c %a /var/lib/rfaas), not 700"
getent passwd rfaas >/dev/null || fail "no system user rfaas"
[ -L /usr/lib/x86_64-linux-gnu/librfaas.so ] && ldconfig -p | grep -q "librfaas.so.1 " ||
    fail "librfaas.so.1 is not in the linker cache"
s=/etc/slurm/plugstack.conf.d/rfaas.conf
grep -q "rfaas_spank.so" $s || fail "$s does not name the plugin"
! grep -v "^#" $s | grep -q . || fail "$s has a line that is not commented out"
[ -f /usr/lib/x86_64-linux-gnu/slurm-wlm/rfaas_spank.so ] || fail "the plugin is not in Slurm'"'"'s plugin directory"
echo "$SUITE: installed, every binary runs, files as documented"
'

# shellcheck disable=SC2016 # expanded inside the root
prepare_upgrade='
set -eu
echo "# edited by the admin" >>/etc/rfaas/executord.toml
echo state >/var/lib/rfaas/kept
'
# shellcheck disable=SC2016 # expanded inside the root
check_upgrade='
set -eu
fail() { echo "FAILED in $SUITE: $*" >&2; exit 1; }
tail -1 /etc/rfaas/executord.toml | grep -q "^# edited by the admin$" ||
    fail "the upgrade replaced the edited /etc/rfaas/executord.toml"
[ "$(cat /var/lib/rfaas/kept 2>/dev/null)" = state ] || fail "the upgrade lost /var/lib/rfaas/kept"
[ "$(dpkg-query -W -f="\${Version}" rfaas-executor)" = "$VERSION" ] || fail "rfaas-executor is not at $VERSION after the upgrade"
echo "$SUITE: upgraded to $VERSION, edited /etc/rfaas and /var/lib/rfaas kept"
'

apt_install() {
    printf 'DEBIAN_FRONTEND=noninteractive apt-get -o Dpkg::Options::=--force-confdef '
    printf -- '-o Dpkg::Options::=--force-confold install -y -q --no-install-recommends %s\n' "$*"
}

for suite in bookworm trixie; do
    start=$SECONDS
    name=$suite-base
    overlay=$work/$suite
    mkdir -p "$overlay"
    echo "== $name: install the previous build, then this one (scripts/roots.sh run $name)"
    mapfile -t now < <(install_set "$dir" "$suite")
    mapfile -t before < <(install_set "$prev" "$suite")
    bash "$ROOTS" run "$name" --overlay "$overlay" --bind "$dir" --bind "$prev" -- \
        env SUITE="$suite" bash -c "set -e; $(apt_install "${before[@]}") >/dev/null
$prepare_upgrade" ||
        fail "installing the previous build in $name failed (output above)"
    bash "$ROOTS" run "$name" --overlay "$overlay" --bind "$dir" -- \
        env SUITE="$suite" VERSION="$version" bash -c "set -e; $(apt_install "${now[@]}") >/dev/null
$check_upgrade
$check_installed" ||
        fail "upgrading to this build in $name failed (output above)"
    echo "stage: packages in $name: $((SECONDS - start)) s"
    # A clean root, this build alone: `apt-get install ./*.deb` and nothing else.
    start=$SECONDS
    bash "$ROOTS" run "$name" --bind "$dir" -- \
        env SUITE="$suite" bash -c "set -e; $(apt_install "${now[@]}") >/dev/null
$check_installed" ||
        fail "apt-get install of this build into a clean $name failed (output above)"
    echo "stage: clean install in $name: $((SECONDS - start)) s"
done

echo "== removal and purge in the booted Debian 12 root, rfaas-executord running"
start=$SECONDS
booted=rfaas-pkg-$$
leader=$(bash "$ROOTS" boot bookworm-base --name "$booted" --overlay "$work/bookworm")
inside() { nsenter -t "$leader" -a "$@"; }
# shellcheck disable=SC2016 # expanded inside the root
inside bash -c '
set -eu
# roots.sh run left its policy-rc.d in the overlay; a booted host has none.
if grep -q "roots.sh run" /usr/sbin/policy-rc.d 2>/dev/null; then rm /usr/sbin/policy-rc.d; fi
rfaas-token keygen --key-id local --secret /root/lease-key.secret --public /etc/rfaas/lease-keys.pub >/dev/null
cat >/etc/rfaas/executord.toml <<TOML
node_name = "pkgtest"
control_listen = "127.0.0.1:7100"
fabric_host = "127.0.0.1"
providers = ["tcp", "shm"]
cpus = "0"
pin = false
memory_mib = 512
pool_size = 2
sandbox = "none"
TOML
# Type=notify: start returns once the daemon said READY=1.
systemctl start rfaas-executord
systemctl is-active --quiet rfaas-executord
' || fail "starting rfaas-executord under its unit failed"
inside systemctl show -p Type,NotifyAccess,KillMode,Delegate rfaas-executord
echo "== systemd-analyze verify and security of the installed units"
units="rfaas-executord.service rfaas-manager.service rfaas-accounting.service"
# shellcheck disable=SC2086 # three unit names
verified=$(inside systemd-analyze verify $units 2>&1) ||
    fail "systemd-analyze verify failed on the installed units: $verified"
# systemd before 254 knows no DelegateSubgroup= and says so; nothing else.
unexpected=$(grep -v "Unknown key .DelegateSubgroup. in section \[Service\], ignoring" <<<"$verified" || true)
[ -z "$unexpected" ] || fail "systemd-analyze verify warned about the installed units: $unexpected"
for unit in $units; do
    exposure=$(inside systemd-analyze security --no-pager "$unit" | tail -1)
    echo "$unit: $exposure"
done
# Processes whose executable is one of rfaas's, inside the root.
rfaas_procs() {
    # shellcheck disable=SC2016 # expanded inside the root
    inside bash -c 'for e in /proc/[0-9]*/exe; do
        t=$(readlink "$e" 2>/dev/null) || continue
        case "$t" in /usr/sbin/rfaas-* | /usr/bin/rfaas*) echo "${e%/exe} $t" ;; esac
    done'
}
for _ in $(seq 300); do
    [ "$(rfaas_procs | grep -c rfaas-worker)" -ge 1 ] &&
        inside test -S /run/rfaas/executord.sock && break
    sleep 0.1
done
procs=$(rfaas_procs)
echo "running before removal:"
echo "$procs"
grep -q rfaas-executord <<<"$procs" && grep -q rfaas-worker <<<"$procs" &&
    inside test -S /run/rfaas/executord.sock || {
    inside journalctl -u rfaas-executord --no-pager | tail -30 >&2 || true
    fail "rfaas-executord with its pooled workers and socket did not come up within 30 s (journal above)"
}
inside bash -c "DEBIAN_FRONTEND=noninteractive apt-get remove -y -q rfaas-executor rfaas-manager rfaas-accounting rfaas-client rfaas-slurm >/dev/null" ||
    fail "apt-get remove in the booted root failed"
left=$(rfaas_procs)
[ -z "$left" ] || fail "after apt-get remove these rfaas processes are left: $left"
cgroups=$(inside find /sys/fs/cgroup -name '*rfaas*' 2>/dev/null || true)
[ -z "$cgroups" ] || fail "after apt-get remove these rfaas cgroups are left: $cgroups"
sockets=$(inside find /run/rfaas -type s 2>/dev/null || true)
[ -z "$sockets" ] || fail "after apt-get remove these sockets are left under /run/rfaas: $sockets"
inside test -d /var/lib/rfaas || fail "apt-get remove (not purge) removed /var/lib/rfaas"
# dpkg: apt no longer knows the packages without conffiles removal purged.
inside dpkg --purge rfaas-executor rfaas-manager rfaas-accounting rfaas-client rfaas-slurm >/dev/null ||
    fail "dpkg --purge in the booted root failed"
! inside test -e /var/lib/rfaas || fail "purging the packages left /var/lib/rfaas"
echo "removal left no rfaas process, cgroup or socket; purge removed /var/lib/rfaas"
bash "$ROOTS" stop "$booted"
booted=""
echo "stage: removal in the booted root: $((SECONDS - start)) s"

# The next run upgrades from this build.
mkdir -p "$CACHE"
(
    flock 9
    rm -f "$CACHE"/*.deb
    copy_as_previous "$CACHE" "${debs[@]}"
) 9>"$CACHE.lock"
echo "packages install, upgrade and go away cleanly on Debian 12 and 13"

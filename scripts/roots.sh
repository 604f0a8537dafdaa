#!/usr/bin/env bash
# roots.sh: Debian root file systems, built once per machine and cached, in
# which tests run another Debian release than the host's: a second Slurm
# release (Debian 13's 24.11 next to the host's 22.05), and clean hosts on
# which rfaas's packages are installed.
#
#   scripts/roots.sh build NAME [--force]
#       build root NAME unless it is current (a no-op then)
#   scripts/roots.sh path NAME
#       print the root's directory (fails if it is not built)
#   scripts/roots.sh run NAME [--overlay DIR] [--bind PATH]... -- CMD...
#       run CMD in the root (chroot), building it first if needed; exit
#       with CMD's status
#   scripts/roots.sh boot NAME --name X [--overlay DIR] [--network-namespace-path P]
#       boot the root with systemd as PID 1 (systemd-nspawn), wait until
#       it runs, print the PID of its systemd on stdout
#   scripts/roots.sh stop X
#       power the booted root X off, wait for it, remove what boot made
#   scripts/roots.sh list
#       print the recipes' names
#
# Recipes (minbase Debian from the mirror of /etc/apt/sources.list*, or
# $RFAAS_ROOTS_MIRROR):
#   trixie-slurm   Debian 13 with Slurm 24.11 (slurmctld, slurmd, clients,
#                  libslurm-dev's headers), munge, libibverbs1, librdmacm,
#                  openssl, binutils, procps: runs the Slurm tests
#   bookworm-base  Debian 12 and trixie-base Debian 13 with systemd (boots
#                  under nspawn), dbus, iproute2, procps, plus the package
#                  lists and the .deb archives of what rfaas's packages and
#                  the install guide pull (postgresql, slurmd, slurmctld,
#                  slurm-client, munge, libibverbs1, librdmacm, lintian), so
#                  that `apt-get install ./rfaas-*.deb` works with no network
#   bookworm-ansible bookworm-base plus openssh-server, python3, python3-apt,
#                  openssl and sudo: a host that Ansible reaches by ssh
#
# Roots live in $RFAAS_ROOTS_DIR (default /var/cache/rfaas/roots): NAME/ is
# the root, NAME.stamp the sha256 of its recipe (suite, mirror, packages,
# this script's build function); a changed recipe rebuilds it. NAME.lock is
# taken exclusively by a build and shared by every run and boot, so a root
# is never rebuilt under a user.
#
# `run` never writes the cached root: CMD sees an overlay of it whose upper
# layer is a fresh directory removed afterwards, or DIR/upper with
# --overlay DIR (kept, so successive runs see each other's changes). It
# runs in its own mount and UTS namespaces (`unshare --mount --uts
# --propagation private`: every mount goes with the namespace), sharing the
# host's PIDs and network. Inside: /proc, /sys (not its submounts: no
# cgroups), /dev (with /dev/pts and /dev/shm), a tmpfs on /run, the host's
# /etc/resolv.conf and /etc/hosts, a policy-rc.d that keeps package scripts
# from starting services, and, at the same paths as on the host, the
# checkout, $CARGO_TARGET_DIR, and every --bind PATH. CMD starts in the
# current directory when that is visible inside, else in /. The environment
# is the caller's. CMD must stop the daemons it starts: they keep its
# namespace and overlay alive.
#
# `boot` runs `systemd-nspawn --boot --register=no --keep-unit` (this host
# has no systemd and no machined) on an overlay as `run`'s, in a cgroup of
# its own (rfaas-root-X in the name=systemd and the unified hierarchy), so
# the container's systemd never takes over the host's root cgroup. The
# network is the namespace P, else a private one with only loopback. Roots
# whose systemd no longer runs on cgroup v1 (257 and later) get a pure
# cgroup2 hierarchy (SYSTEMD_NSPAWN_UNIFIED_HIERARCHY=1). Reach it with
# `nsenter -t PID -a CMD`. `stop` sends SIGRTMIN+4 (systemd's poweroff) to
# that PID, waits up to 60 s for nspawn to end (then kills it), and removes
# the cgroup and state directories; the console log is in
# $RFAAS_ROOTS_DIR/.boot/X/console.log until then.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

REPO=$(repo_root)
readonly REPO
readonly ROOTS_DIR=${RFAAS_ROOTS_DIR:-/var/cache/rfaas/roots}
readonly BOOT_DIR=$ROOTS_DIR/.boot

log() { printf 'roots: %s\n' "$*" >&2; }
die() {
    loud "roots.sh: $*"
    exit 1
}
usage() {
    sed -n '6,21p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
    exit 2
}

# The first Debian mirror apt on this host uses (deb822 or one-line
# sources), else deb.debian.org.
host_mirror() {
    local uri
    uri=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources 2>/dev/null |
        sed -n -e 's/^URIs:[[:space:]]*\([^[:space:]]*\).*/\1/p' \
            -e 's/^deb[[:space:]]\+\(\[[^]]*\][[:space:]]\+\)\{0,1\}\([^[:space:]]*\).*/\2/p' |
        grep -v -e security -e '^cdrom:' | head -n 1)
    printf '%s\n' "${uri:-http://deb.debian.org/debian}"
}
MIRROR=${RFAAS_ROOTS_MIRROR:-$(host_mirror)}
readonly MIRROR

# --- recipes ------------------------------------------------------------------

# Sets SUITE, INCLUDE (installed, comma-separated), DOWNLOAD (only
# downloaded, with the package lists kept; space-separated) and SLIM
# (1: no documentation, man pages or locales) for recipe $1.
recipe_vars() {
    DOWNLOAD="" SLIM=0
    case $1 in
    trixie-slurm)
        SUITE=trixie SLIM=1
        INCLUDE=slurmctld,slurmd,slurm-client,munge,libslurm-dev,libibverbs1,librdmacm1t64
        INCLUDE+=,openssl,binutils,procps,hostname,ca-certificates
        ;;
    bookworm-base | trixie-base | bookworm-ansible)
        SUITE=${1%-*}
        INCLUDE=systemd,systemd-sysv,dbus,iproute2,procps
        local rdmacm=librdmacm1 libslurm=libslurm38
        [ "$SUITE" = trixie ] && rdmacm=librdmacm1t64 libslurm=libslurm42t64
        # libslurm: rfaas-slurm depends on it; Slurm's daemons do not.
        DOWNLOAD="postgresql slurmd slurmctld slurm-client munge libibverbs1 $rdmacm $libslurm lintian"
        # A host Ansible manages: reached by ssh, modules run by python3
        # (the apt module needs python3-apt), the site CA made with openssl.
        if [ "$1" = bookworm-ansible ]; then
            INCLUDE+=,openssh-server,python3,python3-apt,openssl,sudo
        fi
        ;;
    *) die "there is no root recipe '$1'; the recipes are: $(recipe_names | tr '\n' ' ')" ;;
    esac
}

recipe_names() { printf '%s\n' trixie-slurm bookworm-base trixie-base bookworm-ansible; }

# Bootstraps recipe $1's root into $2, logging to $3.
# shellcheck disable=SC2016 # the hooks are expanded by mmdebstrap, root in $1
build_root() {
    local name=$1 root=$2 logfile=$3
    recipe_vars "$name"
    local args=(--mode=root --variant=minbase --include="$INCLUDE")
    if [ "$SLIM" = 1 ]; then
        local p
        for p in doc man locale info; do args+=(--dpkgopt="path-exclude=/usr/share/$p/*"); done
    fi
    if [ -n "$DOWNLOAD" ]; then
        args+=(--skip=cleanup/apt
            --customize-hook="chroot \"\$1\" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --download-only --no-install-recommends $DOWNLOAD")
    fi
    args+=(--customize-hook="echo $name >\"\$1/etc/hostname\"")
    mmdebstrap "${args[@]}" "$SUITE" "$root" "$MIRROR" >"$logfile" 2>&1
}

# Everything that decides root $1's content; its hash is the stamp.
recipe() {
    recipe_vars "$1"
    printf 'name=%s suite=%s mirror=%s include=%s download=%s slim=%s\n' \
        "$1" "$SUITE" "$MIRROR" "$INCLUDE" "$DOWNLOAD" "$SLIM"
    declare -f build_root
}

stamp() { recipe "$1" | sha256sum | cut -d' ' -f1; }

is_current() {
    [ -d "$ROOTS_DIR/$1/usr" ] && [ "$(cat "$ROOTS_DIR/$1.stamp" 2>/dev/null)" = "$(stamp "$1")" ]
}

ensure_host_tools() {
    local need=()
    command -v mmdebstrap >/dev/null || need+=(mmdebstrap)
    command -v flock >/dev/null || need+=(util-linux)
    if [ "${1:-}" = boot ] && ! command -v systemd-nspawn >/dev/null; then
        # The host's own systemd version, so apt upgrades nothing else.
        need+=("systemd-container=$(dpkg-query -W -f='${Version}' systemd)")
    fi
    [ ${#need[@]} -eq 0 ] && return 0
    [ "$(id -u)" -eq 0 ] || die "roots need ${need[*]}, and installing them needs root"
    ensure_packages "${need[@]}"
}

cmd_build() {
    local name=${1:-} force=0
    [ -n "$name" ] || usage
    case "${2:-}" in
    --force) force=1 ;;
    "") ;;
    *) usage ;;
    esac
    recipe_vars "$name"
    ensure_host_tools
    mkdir -p "$ROOTS_DIR"
    build_once "$ROOTS_DIR/$name.lock" "$force" "is_current $name" "rebuild $name"
    is_current "$name" || die "root $name is still not current after its build"
    log "$name is ready in $ROOTS_DIR/$name"
}

# Builds root $1 into a temporary directory, then puts it in place with
# its stamp. Called under the root's lock (build_once).
rebuild() {
    local name=$1
    [ "$(id -u)" -eq 0 ] || die "building root $name needs root (mmdebstrap --mode=root)"
    local work start
    work=$(mktemp -d "$ROOTS_DIR/.build-$name.XXXXXX")
    # shellcheck disable=SC2064 # expand $work now
    trap "rm -rf '$work'" EXIT
    start=$SECONDS
    log "bootstrapping $name (Debian $SUITE from $MIRROR; log: $work/mmdebstrap.log)"
    if ! build_root "$name" "$work/root" "$work/mmdebstrap.log"; then
        tail -n 40 "$work/mmdebstrap.log" >&2
        die "building root $name failed (mmdebstrap, log above); check that $MIRROR is reachable" \
            "or set RFAAS_ROOTS_MIRROR to a Debian mirror, then run: scripts/roots.sh build $name"
    fi
    rm -f "$ROOTS_DIR/$name.stamp"
    rm -rf "${ROOTS_DIR:?}/$name"
    mv "$work/root" "$ROOTS_DIR/$name"
    stamp "$name" >"$ROOTS_DIR/$name.stamp"
    rm -rf "$work"
    trap - EXIT
    log "$name built in $((SECONDS - start)) s: $ROOTS_DIR/$name ($(du -sh "$ROOTS_DIR/$name" | cut -f1))"
}

cmd_path() {
    local name=${1:-}
    [ -n "$name" ] || usage
    recipe_vars "$name"
    is_current "$name" || die "root $name is not built or out of date; run: scripts/roots.sh build $name"
    printf '%s\n' "$ROOTS_DIR/$name"
}

# --- overlays -----------------------------------------------------------------

# Makes the overlay directories for a run or boot: DIR/upper and DIR/work
# (on one file system, as overlayfs wants), DIR/merged as mount point.
# Prints DIR. With $1 empty, DIR is a fresh directory under ROOTS_DIR.
overlay_dir() {
    local dir=$1
    if [ -z "$dir" ]; then
        mkdir -p "$ROOTS_DIR/.runs"
        dir=$(mktemp -d "$ROOTS_DIR/.runs/run.XXXXXX")
    fi
    mkdir -p "$dir/upper" "$dir/work" "$dir/merged"
    (cd "$dir" && pwd)
}

# In a private mount namespace: mounts root $1 with overlay directory $2
# on $2/merged.
mount_overlay() {
    local root=$1 dir=$2
    mount -t overlay overlay -o "lowerdir=$root,upperdir=$dir/upper,workdir=$dir/work" "$dir/merged" ||
        die "cannot mount an overlay of $root on $dir/merged (upper $dir/upper)"
}

# Binds host path $2 at the same path inside the root mounted on $1.
bind_same() {
    local merged=$1 path=$2
    [ -e "$path" ] || die "--bind $path: no such file or directory on the host"
    if [ -d "$path" ]; then mkdir -p "$merged$path"; else
        mkdir -p "$(dirname "$merged$path")"
        [ -e "$merged$path" ] || : >"$merged$path"
    fi
    mount --rbind "$path" "$merged$path"
}

# The part of `run` inside the new namespaces:
#   __enter ROOT OVERLAY_DIR CWD BIND... -- CMD...
cmd_enter() {
    local root=$1 dir=$2 cwd=$3
    shift 3
    local binds=()
    while [ $# -gt 0 ] && [ "$1" != -- ]; do
        binds+=("$1")
        shift
    done
    shift
    local m=$dir/merged
    mount_overlay "$root" "$dir"
    mount -t proc proc "$m/proc"
    mount --bind /sys "$m/sys"
    mount --rbind /dev "$m/dev"
    mount -t tmpfs -o mode=0755 tmpfs "$m/run"
    cp -L /etc/resolv.conf "$m/etc/resolv.conf" 2>/dev/null || true
    cp -L /etc/hosts "$m/etc/hosts" 2>/dev/null || true
    if [ ! -e "$m/usr/sbin/policy-rc.d" ]; then
        printf '#!/bin/sh\n# roots.sh run: no services start in a chroot\nexit 101\n' >"$m/usr/sbin/policy-rc.d"
        chmod 0755 "$m/usr/sbin/policy-rc.d"
    fi
    local b
    for b in "${binds[@]}"; do bind_same "$m" "$b"; done
    [ -d "$m$cwd" ] || cwd=/
    # shellcheck disable=SC2016 # expanded by the shell inside
    exec chroot "$m" /bin/sh -c 'cd "$1" && shift && exec "$@"' roots-run "$cwd" "$@"
}

cmd_run() {
    local name=${1:-}
    [ -n "$name" ] || usage
    shift
    local overlay="" binds=("$REPO")
    while [ $# -gt 0 ]; do
        case $1 in
        --overlay) overlay=${2:?--overlay needs a directory}; shift 2 ;;
        --bind)
            local path
            path=$(realpath -e "${2:?--bind needs a path}") || die "--bind $2: no such file or directory on the host"
            binds+=("$path")
            shift 2
            ;;
        --) shift; break ;;
        *) usage ;;
        esac
    done
    [ $# -gt 0 ] || usage
    [ "$(id -u)" -eq 0 ] || die "running in a root needs root (mount, chroot)"
    if [ -n "${CARGO_TARGET_DIR:-}" ]; then
        mkdir -p "$CARGO_TARGET_DIR"
        binds+=("$(realpath "$CARGO_TARGET_DIR")")
    fi
    recipe_vars "$name"
    is_current "$name" || cmd_build "$name"
    exec 8>"$ROOTS_DIR/$name.lock"
    flock -s 8
    local dir keep=1
    [ -n "$overlay" ] || keep=0
    dir=$(overlay_dir "$overlay")
    local status=0
    # The lock stays with this process, not with daemons CMD starts.
    unshare --mount --uts --propagation private -- \
        bash "${BASH_SOURCE[0]}" __enter "$ROOTS_DIR/$name" "$dir" "$PWD" "${binds[@]}" -- "$@" 8>&- ||
        status=$?
    if [ $keep = 0 ]; then rm -rf "$dir"; else rmdir "$dir/merged" 2>/dev/null || true; fi
    return $status
}

# --- booting ------------------------------------------------------------------

# The cgroup directories of booted root $1, one per hierarchy systemd uses.
boot_cgroups() {
    local cg=rfaas-root-$1
    if [ -d /sys/fs/cgroup/unified ]; then
        printf '%s\n' "/sys/fs/cgroup/systemd/$cg" "/sys/fs/cgroup/unified/$cg"
    elif [ -f /sys/fs/cgroup/cgroup.controllers ]; then
        printf '%s\n' "/sys/fs/cgroup/$cg"
    else
        printf '%s\n' "/sys/fs/cgroup/systemd/$cg"
    fi
}

# True when the systemd in root $1 needs a pure cgroup2 hierarchy (257
# dropped cgroup v1).
needs_unified() {
    local lib version
    lib=$(find "$1/usr/lib" -maxdepth 3 -name 'libsystemd-shared-*.so' 2>/dev/null | head -n 1)
    version=$(basename "$lib" .so | sed -n 's/^libsystemd-shared-\([0-9]*\).*/\1/p')
    [ -n "$version" ] && [ "$version" -ge 256 ]
}

# The part of `boot` that becomes nspawn, in its own mount namespace:
#   __nspawn ROOT OVERLAY_DIR X NSPAWN_ARGS...
cmd_nspawn() {
    local root=$1 dir=$2 x=$3
    shift 3
    local cg
    while read -r cg; do
        mkdir -p "$cg"
        echo $$ >"$cg/cgroup.procs"
    done < <(boot_cgroups "$x")
    mount_overlay "$root" "$dir"
    needs_unified "$root" && export SYSTEMD_NSPAWN_UNIFIED_HIERARCHY=1
    exec systemd-nspawn -D "$dir/merged" --machine="$x" --boot --register=no --keep-unit \
        --console=read-only "$@"
}

# True while pid $1 runs (a zombie has ended; this machine's init may be
# slow to reap it).
alive() {
    local state
    state=$(sed -n 's/^State:[[:space:]]*\([A-Z]\).*/\1/p' "/proc/$1/status" 2>/dev/null) || return 1
    [ -n "$state" ] && [ "$state" != Z ]
}

# The container's PID 1: the child of nspawn (pid $1) that runs systemd.
leader_of() {
    { ps --ppid "$1" -o pid=,comm= 2>/dev/null || true; } | awk '$2 == "systemd" { print $1 }'
}

cmd_boot() {
    local name=${1:-}
    [ -n "$name" ] || usage
    shift
    local x="" overlay="" net=(--private-network)
    while [ $# -gt 0 ]; do
        case $1 in
        --name) x=${2:?--name needs a name}; shift 2 ;;
        --overlay) overlay=${2:?--overlay needs a directory}; shift 2 ;;
        --network-namespace-path) net=("--network-namespace-path=${2:?needs a path}"); shift 2 ;;
        *) usage ;;
        esac
    done
    [[ $x =~ ^[a-zA-Z0-9][a-zA-Z0-9-]{0,31}$ ]] ||
        die "boot needs --name X, X letters, digits and '-' (at most 32), not '$x'"
    [ "$(id -u)" -eq 0 ] || die "booting a root needs root (systemd-nspawn)"
    ensure_host_tools boot
    recipe_vars "$name"
    is_current "$name" || cmd_build "$name"
    local state=$BOOT_DIR/$x
    [ ! -e "$state/nspawn.pid" ] || die "root $x is booted already (pid file $state/nspawn.pid);" \
        "stop it first: scripts/roots.sh stop $x"
    mkdir -p "$state"
    local dir
    if [ -n "$overlay" ]; then dir=$(overlay_dir "$overlay"); else dir=$(overlay_dir "$state/overlay"); fi
    printf '%s\n' "$dir" >"$state/overlay.path"
    [ -n "$overlay" ] || : >"$state/overlay.temporary"
    # nspawn holds the shared lock until it ends; its own session, so the
    # caller's terminal and signals stay out of it.
    (
        exec 8>"$ROOTS_DIR/$name.lock"
        flock -s 8
        exec setsid unshare --mount --propagation private -- \
            bash "${BASH_SOURCE[0]}" __nspawn "$ROOTS_DIR/$name" "$dir" "$x" "${net[@]}" \
            </dev/null >"$state/console.log" 2>&1
    ) &
    local nspawn=$!
    echo "$nspawn" >"$state/nspawn.pid"
    local leader="" _i
    for _i in $(seq 300); do
        leader=$(leader_of "$nspawn")
        [ -n "$leader" ] && break
        alive "$nspawn" || break
        sleep 0.1
    done
    if [ -z "$leader" ]; then
        tail -n 30 "$state/console.log" >&2
        cmd_stop "$x" 2>/dev/null || true
        die "root $name (as $x) did not start under systemd-nspawn; its console is above"
    fi
    echo "$leader" >"$state/leader.pid"
    local running=""
    for _i in $(seq 600); do
        running=$(nsenter -t "$leader" -a systemctl is-system-running 2>/dev/null) || true
        case $running in running | degraded) break ;; esac
        alive "$leader" || break
        sleep 0.1
    done
    case $running in
    running) ;;
    degraded) log "$x booted, but degraded: $(nsenter -t "$leader" -a systemctl --failed --no-legend 2>&1 | tr '\n' ';')" ;;
    *)
        tail -n 30 "$state/console.log" >&2
        cmd_stop "$x" 2>/dev/null || true
        die "root $name (as $x) did not finish booting within 60 s (state: '${running:-gone}'); its console is above"
        ;;
    esac
    log "$x booted from $name: systemd is pid $leader; enter with: nsenter -t $leader -a CMD"
    printf '%s\n' "$leader"
}

cmd_stop() {
    local x=${1:-}
    [ -n "$x" ] || usage
    local state=$BOOT_DIR/$x
    [ -d "$state" ] || die "no root is booted as $x ($state is missing)"
    local nspawn leader _i
    nspawn=$(cat "$state/nspawn.pid" 2>/dev/null || true)
    leader=$(cat "$state/leader.pid" 2>/dev/null || true)
    [ -n "$leader" ] || [ -z "$nspawn" ] || leader=$(leader_of "$nspawn")
    [ -n "$leader" ] && alive "$leader" && kill -s RTMIN+4 "$leader" 2>/dev/null
    if [ -n "$nspawn" ]; then
        for _i in $(seq 600); do
            alive "$nspawn" || break
            sleep 0.1
        done
        if alive "$nspawn"; then
            log "$x did not power off within 60 s; killing systemd-nspawn (pid $nspawn)"
            kill -KILL "$nspawn" 2>/dev/null || true
            [ -n "$leader" ] && kill -KILL "$leader" 2>/dev/null || true
        fi
    fi
    local cg
    while read -r cg; do
        [ -d "$cg" ] && find "$cg" -depth -type d -exec rmdir {} + 2>/dev/null
        [ ! -d "$cg" ] || log "cgroup $cg is still there (processes left in it?)"
    done < <(boot_cgroups "$x")
    local dir
    dir=$(cat "$state/overlay.path" 2>/dev/null || true)
    if [ -e "$state/overlay.temporary" ]; then
        rm -rf "$state"
    else
        [ -z "$dir" ] || rmdir "$dir/merged" 2>/dev/null || true
        rm -rf "$state"
    fi
    # nspawn leaves this behind on a host whose /run is not a tmpfs.
    rmdir /run/systemd/nspawn/propagate/"$x" /run/systemd/nspawn/propagate /run/systemd/nspawn 2>/dev/null || true
    log "$x stopped"
}

case "${1:-}" in
build) shift; cmd_build "$@" ;;
path) shift; cmd_path "$@" ;;
run) shift; cmd_run "$@" ;;
boot) shift; cmd_boot "$@" ;;
stop) shift; cmd_stop "$@" ;;
list) recipe_names ;;
__enter) shift; cmd_enter "$@" ;;
__nspawn) shift; cmd_nspawn "$@" ;;
*) usage ;;
esac

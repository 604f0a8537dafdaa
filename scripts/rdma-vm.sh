#!/usr/bin/env bash
# rdma-vm.sh: runs commands in a throwaway Debian bookworm VM with real
# ibverbs over Soft-RoCE (the kernel's rdma_rxe), so the verbs provider can be
# tested on machines without an RDMA NIC or an RDMA-capable kernel.
#
#   scripts/rdma-vm.sh build [--force]   build the image once (host tools via apt)
#   scripts/rdma-vm.sh run [--] CMD...   boot, run CMD in the guest, exit with its status
#   scripts/rdma-vm.sh path              print the image directory
#
# The image (kernel, initrd, ext4 root with rdma-core, ibverbs-providers,
# perftest, iproute2) lives outside the work tree, in $RFAAS_RDMA_VM_DIR
# (default /var/cache/rfaas-rdma-vm). `build` is idempotent: it rebuilds only
# when the stamp (a hash of the recipe, package list and mirror) changes.
# `run` builds it first when missing.
#
# In the guest, before CMD starts: eth0 is a virtio NIC on an otherwise empty
# qemu hub (no packet leaves the guest) with 192.0.2.1/24 (TEST-NET-1), and
# rdma_rxe has made rxe0 on it. CMD sees RDMA_VM=1 RDMA_DEVICE=rxe0
# RDMA_VM_IP=<the address, no prefix>, plus the host's RUST_*, CARGO_* and
# NEXTEST_* variables and those named in RDMA_VM_PASSENV. The repository (and
# the directory of an absolute CMD) is shared at the same path over 9p,
# read-write, and CMD runs in the host's current directory. Its stdout and
# stderr are streamed to this script's stdout as they come.
#
# Exit status: CMD's own, or
#   124  the whole run took longer than RDMA_VM_TIMEOUT (qemu was killed)
#   125  the VM failed: qemu did not start, or the guest died without a status
#   126  the Soft-RoCE setup (eth0, rdma_rxe, rxe0) failed in the guest
# In those three cases the guest console's tail is printed on stderr.
#
# Knobs (environment):
#   RFAAS_RDMA_VM_DIR   image directory (default /var/cache/rfaas-rdma-vm)
#   RDMA_VM_MIRROR      Debian mirror for the build (default http://deb.debian.org/debian)
#   RDMA_VM_EXTRA_PKGS  more Debian packages for the image, comma-separated
#   RDMA_VM_TIMEOUT     seconds for boot plus CMD (default 1200)
#   RDMA_VM_SMP         vCPUs (default: the host's cores)   RDMA_VM_MEM  MiB (default 2048)
#   RDMA_VM_ACCEL       tcg | kvm | auto (default auto: kvm only if the CPU shows vmx or svm;
#                       this project's CI machine has only a PVM /dev/kvm, which cannot
#                       boot a Debian kernel, so it runs TCG)
#   RDMA_VM_NET         none (default) | listen:PORT | connect:PORT: join two VMs'
#                       NICs by a TCP socket on 127.0.0.1 (see test-verbs-two-node.sh)
#   RDMA_VM_IP          guest address, optionally /prefix (default 192.0.2.1/24)
#   RDMA_VM_KERNEL_ARGS more guest kernel arguments (scripts/bench-verbs.sh passes
#                       tsc=reliable, so clock reads in the guest stay off the HPET)
#   RDMA_VM_SHARE       more host directories to share, ':'-separated
#   RDMA_VM_PASSENV     more variable names to pass into the guest, space-separated
#   RDMA_VM_CONSOLE     1: stream the guest kernel console to stderr as well
#   RDMA_VM_KEEP_RUN    1: keep the per-run directory (console log, qemu log)
#
# Every qemu this script starts is stopped by its PID when the script exits,
# fails or is interrupted. Should the script itself be killed with SIGKILL,
# the guest powers itself off 30 s after RDMA_VM_TIMEOUT.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
readonly REPO
readonly VM_DIR=${RFAAS_RDMA_VM_DIR:-/var/cache/rfaas-rdma-vm}
readonly MIRROR=${RDMA_VM_MIRROR:-http://deb.debian.org/debian}
readonly SUITE=bookworm
GUEST_PKGS=linux-image-amd64,rdma-core,ibverbs-providers,ibverbs-utils,rdmacm-utils,perftest
GUEST_PKGS+=,iproute2,kmod,procps,util-linux,iputils-ping
GUEST_PKGS+=${RDMA_VM_EXTRA_PKGS:+,$RDMA_VM_EXTRA_PKGS}
readonly GUEST_PKGS

readonly EXIT_TIMEOUT=124 EXIT_VM_FAILED=125 EXIT_RXE_FAILED=126

log() { printf 'rdma-vm: %s\n' "$*" >&2; }
# A failure the reader of a CI log must not miss.
loud() {
    {
        printf '\n!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!\n'
        printf '!!! rdma-vm: %s\n' "$@"
        printf '!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!\n'
    } >&2
}
die() {
    loud "error: $*"
    exit "$EXIT_VM_FAILED"
}

# --- host tools -------------------------------------------------------------

ensure_host_tools() {
    local need=()
    command -v qemu-system-x86_64 >/dev/null || need+=(qemu-system-x86)
    command -v mmdebstrap >/dev/null || need+=(mmdebstrap)
    command -v mkfs.ext4 >/dev/null || need+=(e2fsprogs)
    command -v flock >/dev/null || need+=(util-linux)
    [ ${#need[@]} -eq 0 ] && return 0
    log "installing host packages: ${need[*]}"
    [ "$(id -u)" -eq 0 ] || die "installing ${need[*]} needs root; install them and run this again"
    apt-get -o DPkg::Lock::Timeout=300 update -q >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y -q \
        --no-install-recommends "${need[@]}" >/dev/null ||
        die "apt-get install ${need[*]} failed"
}

# --- the image ----------------------------------------------------------------

# PID 1 of the guest. It only mounts the basics and the per-run control
# share and hands over to the share's guest.sh, so how a run works can change
# without rebuilding the image.
guest_init() {
    cat <<'EOF'
#!/bin/sh
export PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root
# The initramfs hands over /proc, /sys and /dev already mounted.
mountpoint -q /proc || mount -t proc proc /proc
mountpoint -q /sys || mount -t sysfs sysfs /sys
mountpoint -q /dev || mount -t devtmpfs devtmpfs /dev
mkdir -p /dev/pts /dev/shm
mountpoint -q /dev/pts || mount -t devpts devpts /dev/pts
for d in /dev/shm /tmp /run /var/tmp; do mount -t tmpfs tmpfs "$d"; done
mkdir -p /run/rdma-vm
modprobe -q 9pnet_virtio
if mount -t 9p -o trans=virtio,version=9p2000.L,msize=524288 rdmavmctl /run/rdma-vm; then
    /bin/bash /run/rdma-vm/guest.sh
else
    echo "rdma-vm-init: cannot mount the control share" >/dev/console
fi
sync
echo o >/proc/sysrq-trigger
sleep 60
EOF
}

# Kernel module trees the guest never loads; dropping them shrinks the image.
readonly DROP_MODULES="sound drivers/gpu drivers/media drivers/net/wireless drivers/net/ethernet
drivers/usb drivers/bluetooth drivers/iio drivers/scsi drivers/hid drivers/input drivers/mtd
drivers/isdn drivers/staging drivers/infiniband/hw drivers/md drivers/hwmon drivers/platform"

# Everything that decides the image's content; its hash is the stamp.
recipe() {
    printf 'suite=%s mirror=%s pkgs=%s drop=%s\n' "$SUITE" "$MIRROR" "$GUEST_PKGS" "$DROP_MODULES"
    guest_init
    declare -f build_rootfs
}

stamp() { recipe | sha256sum | cut -d' ' -f1; }

image_is_current() {
    [ -f "$VM_DIR/rootfs.img" ] && [ -f "$VM_DIR/vmlinuz" ] && [ -f "$VM_DIR/initrd.img" ] &&
        [ "$(cat "$VM_DIR/stamp" 2>/dev/null)" = "$(stamp)" ]
}

# Bootstraps the guest's root file system into $1, logging to $2, with $3
# as its init. The hooks are expanded by mmdebstrap, which passes the root as $1.
# shellcheck disable=SC2016
build_rootfs() {
    local root=$1 logfile=$2 init=$3 drop=${DROP_MODULES//$'\n'/ }
    # The essential hook runs before the kernel package is configured, so its
    # initramfs is built once, holding only what mounts the root disk: 5 MB
    # instead of 35, which saves seconds on every boot under emulation.
    local initramfs_hook='mkdir -p "$1/etc/initramfs-tools/conf.d" &&
        echo MODULES=list >"$1/etc/initramfs-tools/conf.d/rdma-vm.conf" &&
        printf "%s\n" virtio_pci virtio_blk ext4 >"$1/etc/initramfs-tools/modules"'
    local modules_hook='for k in "$1"/usr/lib/modules/*; do
            for d in '"$drop"'; do rm -rf "$k/kernel/$d"; done
            chroot "$1" depmod -a "${k##*/}"
        done'
    mmdebstrap --mode=root --variant=minbase --include="$GUEST_PKGS" \
        --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
        --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-exclude=/usr/share/info/*' \
        --essential-hook="$initramfs_hook" \
        --customize-hook="install -m 0755 '$init' \"\$1/sbin/rdma-vm-init\"" \
        --customize-hook="$modules_hook" \
        --customize-hook='echo rdma-vm >"$1/etc/hostname"' \
        "$SUITE" "$root" "$MIRROR" >"$logfile" 2>&1
}

cmd_build() {
    local force=0
    case "${1:-}" in
    --force) force=1 ;;
    "") ;;
    *) die "usage: rdma-vm.sh build [--force]" ;;
    esac
    ensure_host_tools
    mkdir -p "$VM_DIR"
    # One build at a time; a second caller waits and then finds it current.
    exec 9>"$VM_DIR/.lock"
    flock 9
    if [ $force -eq 0 ] && image_is_current; then
        log "image is current in $VM_DIR"
        exec 9>&-
        return 0
    fi
    [ "$(id -u)" -eq 0 ] || die "building the image needs root (mmdebstrap --mode=root)"
    local work start
    work=$(mktemp -d "$VM_DIR/build.XXXXXX")
    # shellcheck disable=SC2064 # expand $work now
    trap "rm -rf '$work'" EXIT
    start=$SECONDS
    guest_init >"$work/rdma-vm-init"
    log "bootstrapping Debian $SUITE with $GUEST_PKGS (log: $work/mmdebstrap.log)"
    if ! build_rootfs "$work/rootfs" "$work/mmdebstrap.log" "$work/rdma-vm-init"; then
        tail -n 40 "$work/mmdebstrap.log" >&2
        loud "building the VM image failed (mmdebstrap); see the log above"
        exit "$EXIT_VM_FAILED"
    fi
    cp "$work"/rootfs/boot/vmlinuz-* "$work/vmlinuz"
    cp "$work"/rootfs/boot/initrd.img-* "$work/initrd.img"
    # Room for what tests write outside the tmpfs mounts.
    local size_mb=$(($(du -sm "$work/rootfs" | cut -f1) + 256))
    truncate -s "${size_mb}M" "$work/rootfs.img"
    mkfs.ext4 -q -F -L rdmavm -d "$work/rootfs" "$work/rootfs.img"
    rm -f "$VM_DIR/stamp"
    mv -f "$work/vmlinuz" "$work/initrd.img" "$work/rootfs.img" "$VM_DIR/"
    stamp >"$VM_DIR/stamp"
    rm -rf "$work"
    trap - EXIT
    exec 9>&-
    log "image built in $((SECONDS - start)) s: $VM_DIR ($(du -sh "$VM_DIR/rootfs.img" | cut -f1) used)"
}

# --- running ------------------------------------------------------------------

accel_args() {
    local accel=${RDMA_VM_ACCEL:-auto}
    if [ "$accel" = auto ]; then
        accel=tcg
        [ -w /dev/kvm ] && grep -qwE 'vmx|svm' /proc/cpuinfo && accel=kvm
    fi
    case $accel in
    kvm) echo "-accel kvm -cpu host" ;;
    tcg) echo "-accel tcg,thread=multi -cpu max" ;;
    *) die "RDMA_VM_ACCEL must be tcg, kvm or auto, not '$accel'" ;;
    esac
}

# The guest side of one run, executed by the image's init from the control
# share. Mounts the shares, sets up Soft-RoCE, runs cmd.sh, leaves its status.
guest_script() {
    local ip=$1 timeout=$2
    cat <<EOF
#!/bin/bash
ctl=/run/rdma-vm
console() { echo "rdma-vm guest: \$*" >/dev/console; }
ulimit -l unlimited
hostname rdma-vm
ip link set lo up
while read -r tag path; do
    mkdir -p "\$path" &&
        mount -t 9p -o trans=virtio,version=9p2000.L,msize=524288 "\$tag" "\$path" ||
        echo "rdma-vm guest: cannot mount \$path" >>\$ctl/out
done <\$ctl/shares
# A subshell, so its trace stays in setup.log.
setup_rxe() (
    set -x
    modprobe virtio_net
    for _ in \$(seq 50); do [ -e /sys/class/net/eth0 ] && break; sleep 0.1; done
    ip link set eth0 up || return 1
    ip addr add $ip dev eth0 || return 1
    # No udev in the guest: load what opens /dev/infiniband/* up front.
    modprobe rdma_rxe && modprobe ib_uverbs && modprobe rdma_ucm || return 1
    rdma link add rxe0 type rxe netdev eth0 || return 1
    # Ready when the port is ACTIVE and the IPv4 (RoCE v2) GID is in the table.
    gid="" state=""
    for _ in \$(seq 100); do
        state=\$(cat /sys/class/infiniband/rxe0/ports/1/state 2>/dev/null)
        gid=\$(grep -l '0000:0000:0000:0000:0000:ffff' /sys/class/infiniband/rxe0/ports/1/gids/* 2>/dev/null)
        [ -n "\$gid" ] && [[ \$state == *ACTIVE* ]] && return 0
        sleep 0.1
    done
    echo "rxe0 not ready: port state '\$state', no IPv4 GID"
    return 1
)
console "up after \$(cut -d' ' -f1 /proc/uptime) s"
if setup_rxe >\$ctl/setup.log 2>&1; then
    console "rxe0 ready after \$(cut -d' ' -f1 /proc/uptime) s"
    # A safety net for a VM whose host script was killed outright: the
    # host's watchdog (RDMA_VM_TIMEOUT) normally stops it first.
    timeout -k 10 $((timeout + 30)) /bin/bash \$ctl/cmd.sh </dev/null >>\$ctl/out 2>&1
    echo "exit \$?" >\$ctl/status
else
    { rdma link; ip addr; dmesg | tail -n 20; } >>\$ctl/setup.log 2>&1
    echo rxe >\$ctl/status
fi
console "done after \$(cut -d' ' -f1 /proc/uptime) s"
EOF
}

# The command with its directory and environment, as a script for the guest.
command_script() {
    local ip=$1
    shift
    echo "export RDMA_VM=1 RDMA_DEVICE=rxe0 RDMA_VM_IP=${ip%%/*}"
    local name
    for name in $(compgen -e); do
        case " $name " in
        " RUST_"* | " CARGO"* | " NEXTEST_"*) ;;
        *) [[ " ${RDMA_VM_PASSENV:-} " == *" $name "* ]] || continue ;;
        esac
        printf 'export %s=%q\n' "$name" "${!name}"
    done
    printf 'cd %q || exit 125\n' "$PWD"
    printf 'exec'
    printf ' %q' "$@"
    printf '\n'
}

# Set while a VM runs, for the exit trap.
QEMU_PID=""
WATCHDOG_PID=""
TAIL_PIDS=()
RUN_DIR=""

stop_vm() {
    local pid
    for pid in "$WATCHDOG_PID" "$QEMU_PID" "${TAIL_PIDS[@]}"; do
        if [ -n "$pid" ]; then kill "$pid" 2>/dev/null || true; fi
    done
    for pid in "$WATCHDOG_PID" "$QEMU_PID" "${TAIL_PIDS[@]}"; do
        if [ -n "$pid" ]; then wait "$pid" 2>/dev/null || true; fi
    done
    QEMU_PID="" WATCHDOG_PID="" TAIL_PIDS=()
    if [ -n "$RUN_DIR" ] && [ "${RDMA_VM_KEEP_RUN:-0}" != 1 ]; then
        rm -rf "$RUN_DIR"
    fi
}

console_tail() {
    log "last lines of the guest console ($RUN_DIR/console.log):"
    tail -n 40 "$RUN_DIR/console.log" >&2 2>/dev/null || true
    if [ -s "$RUN_DIR/qemu.log" ]; then
        log "qemu said:"
        tail -n 20 "$RUN_DIR/qemu.log" >&2
    fi
}

cmd_run() {
    [ "${1:-}" = -- ] && shift
    [ $# -gt 0 ] || die "usage: rdma-vm.sh run [--] CMD [ARGS...]"
    image_is_current || cmd_build
    command -v qemu-system-x86_64 >/dev/null || ensure_host_tools

    local ip=${RDMA_VM_IP:-192.0.2.1/24}
    [[ $ip == */* ]] || ip+=/24
    [[ $ip =~ ^[0-9]+\.[0-9]+\.[0-9]+\.[0-9]+/[0-9]+$ ]] ||
        die "RDMA_VM_IP must be an IPv4 address with an optional /prefix, not '$ip'"
    local net=${RDMA_VM_NET:-none}
    local timeout=${RDMA_VM_TIMEOUT:-1200}
    [[ $timeout =~ ^[0-9]+$ ]] || die "RDMA_VM_TIMEOUT must be a number of seconds, not '$timeout'"
    local smp=${RDMA_VM_SMP:-$(nproc)} mem=${RDMA_VM_MEM:-2048}

    RUN_DIR=$(mktemp -d "${TMPDIR:-/tmp}/rdma-vm-run.XXXXXX")
    trap 'stop_vm' EXIT
    trap 'stop_vm; exit 130' INT
    trap 'stop_vm; exit 143' TERM

    # Shares: the repository, RDMA_VM_SHARE, and the directory of an absolute CMD.
    local shares=("$REPO") extra dir
    if [ -n "${RDMA_VM_SHARE:-}" ]; then
        IFS=: read -r -a extra <<<"$RDMA_VM_SHARE"
        shares+=("${extra[@]}")
    fi
    [[ $1 == /* ]] && shares+=("$(dirname "$1")")
    local qemu_shares=() i=0 seen=() covered s
    : >"$RUN_DIR/shares"
    for dir in "${shares[@]}"; do
        [ -d "$dir" ] || die "cannot share $dir: not a directory"
        dir=$(cd "$dir" && pwd -P)
        covered=0
        for s in "${seen[@]}"; do [[ $dir/ == "$s"/* ]] && covered=1; done
        [ $covered -eq 1 ] && continue
        seen+=("$dir")
        qemu_shares+=(-virtfs "local,path=$dir,mount_tag=share$i,security_model=none,id=share$i")
        printf 'share%s %s\n' "$i" "$dir" >>"$RUN_DIR/shares"
        i=$((i + 1))
    done

    # One NIC. Alone on a qemu hub, nothing carries its packets anywhere;
    # listen/connect join it to one other VM's NIC over 127.0.0.1.
    local netdev last_octet
    case $net in
    none) netdev=hubport,id=net0,hubid=0 ;;
    listen:[0-9]*) netdev=socket,id=net0,listen=127.0.0.1:${net#listen:} ;;
    connect:[0-9]*) netdev=socket,id=net0,connect=127.0.0.1:${net#connect:} ;;
    *) die "RDMA_VM_NET must be none, listen:PORT or connect:PORT, not '$net'" ;;
    esac
    last_octet=${ip%%/*}
    last_octet=${last_octet##*.}
    local mac
    mac=$(printf '52:54:00:52:44:%02x' "$((last_octet % 256))")

    guest_script "$ip" "$timeout" >"$RUN_DIR/guest.sh"
    command_script "$ip" "$@" >"$RUN_DIR/cmd.sh"
    : >"$RUN_DIR/out"
    : >"$RUN_DIR/console.log"

    local accel
    accel=$(accel_args)
    local start=$SECONDS
    # shellcheck disable=SC2086 # accel is several words
    qemu-system-x86_64 -nodefaults -no-user-config $accel -smp "$smp" -m "$mem" \
        -display none -serial "file:$RUN_DIR/console.log" -no-reboot \
        -kernel "$VM_DIR/vmlinuz" -initrd "$VM_DIR/initrd.img" \
        -append "console=ttyS0 root=/dev/vda rw init=/sbin/rdma-vm-init panic=-1 quiet loglevel=3 net.ifnames=0${RDMA_VM_KERNEL_ARGS:+ $RDMA_VM_KERNEL_ARGS}" \
        -drive "file=$VM_DIR/rootfs.img,if=virtio,format=raw,snapshot=on" \
        -virtfs "local,path=$RUN_DIR,mount_tag=rdmavmctl,security_model=none,id=rdmavmctl" \
        "${qemu_shares[@]}" \
        -netdev "$netdev" -device "virtio-net-pci,netdev=net0,mac=$mac,romfile=" \
        </dev/null >"$RUN_DIR/qemu.log" 2>&1 &
    QEMU_PID=$!
    # The watchdog is the sleep itself, so stopping it leaves nothing behind.
    sleep "$timeout" >/dev/null 2>&1 &
    WATCHDOG_PID=$!
    if [ "${RDMA_VM_CONSOLE:-0}" = 1 ]; then
        tail -n +1 -f --pid="$QEMU_PID" "$RUN_DIR/console.log" >&2 &
        TAIL_PIDS+=($!)
    fi
    tail -n +1 -f --pid="$QEMU_PID" "$RUN_DIR/out" &
    TAIL_PIDS+=($!)

    local qemu_rc=0 first="" timed_out=0
    wait -n -p first "$QEMU_PID" "$WATCHDOG_PID" || qemu_rc=$?
    if [ "$first" = "$WATCHDOG_PID" ]; then
        timed_out=1
        WATCHDOG_PID=""
        kill "$QEMU_PID" 2>/dev/null || true
        wait "$QEMU_PID" || qemu_rc=$?
    fi
    QEMU_PID=""
    # tail notices the exit within a second and prints what is left.
    wait "${TAIL_PIDS[@]}" 2>/dev/null || true
    TAIL_PIDS=()
    if [ -n "$WATCHDOG_PID" ]; then
        kill "$WATCHDOG_PID" 2>/dev/null || true
        wait "$WATCHDOG_PID" 2>/dev/null || true
        WATCHDOG_PID=""
    fi

    local status rc
    status=$(cat "$RUN_DIR/status" 2>/dev/null || true)
    case $status in
    "exit "*)
        rc=${status#exit }
        log "guest command exited with $rc after $((SECONDS - start)) s"
        ;;
    rxe)
        cat "$RUN_DIR/setup.log" >&2
        console_tail
        loud "Soft-RoCE setup failed in the guest (eth0, rdma_rxe, rxe0); exit $EXIT_RXE_FAILED"
        rc=$EXIT_RXE_FAILED
        ;;
    *)
        console_tail
        if [ $timed_out -eq 1 ]; then
            loud "the VM ran longer than RDMA_VM_TIMEOUT=${timeout}s and was killed; exit $EXIT_TIMEOUT"
            rc=$EXIT_TIMEOUT
        else
            loud "the VM died without reporting an exit status (qemu exit $qemu_rc); exit $EXIT_VM_FAILED"
            rc=$EXIT_VM_FAILED
        fi
        ;;
    esac
    [ "${RDMA_VM_KEEP_RUN:-0}" = 1 ] && log "run directory kept: $RUN_DIR"
    return "$rc"
}

case "${1:-}" in
build)
    shift
    cmd_build "$@"
    ;;
run)
    shift
    cmd_run "$@"
    ;;
path) echo "$VM_DIR" ;;
*)
    sed -n '2,/^set -euo/p' "$0" | sed '$d' >&2
    exit 2
    ;;
esac

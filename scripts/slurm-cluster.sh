#!/usr/bin/env bash
# A real Slurm cluster (Debian's Slurm: 22.05 on Debian 12, 24.11 in
# scripts/roots.sh's trixie-slurm root) on one machine, on loopback,
# for the tests and for trying rfaas's Slurm integration: munged, slurmctld
# and one slurmd per node (`slurmd -N nodeK`), everything in one directory.
#
#   scripts/slurm-cluster.sh start   install what is missing, write the
#                                    configuration, start the daemons, wait
#                                    until every node is idle, write DIR/env
#   scripts/slurm-cluster.sh stop    cancel the jobs, stop the daemons (and
#                                    the job step daemons of this cluster)
#   scripts/slurm-cluster.sh status  say whether it runs; sinfo if it does
#
# Environment:
#   RFAAS_SLURM_DIR  the cluster's directory (default
#                    ${TMPDIR:-/tmp}/rfaas-slurm-$UID): etc/slurm.conf,
#                    log/, run/ (pid files), state/, spool/, munge/
#   NODES            nodes, node1..nodeN (default 3, at most 62)
#   CPUS             CPUs each node advertises (default 4; Slurm is told to
#                    believe the configuration, not the machine)
#   PLUGSTACK        a plugstack.conf to use (SPANK plugins); none by default
#   PROLOG, EPILOG   slurmd's Prolog= and Epilog= programs; none by default
#   ACCOUNTING       1: also an accounting database, as a site with
#                    slurmdbd has: a throwaway MariaDB (DIR/mariadb, its
#                    own port on 127.0.0.1, run as the mysql user) and a
#                    slurmdbd (DIR/etc/slurmdbd.conf, 0600) that slurmctld
#                    and sacctmgr use; the cluster is added to it, accounts
#                    and users are the caller's to make (`sacctmgr -i`).
#                    Default 0: AccountingStorageType=accounting_storage/none
#
# Several clusters may run at once (the tests start one each): every
# cluster takes a slot, 0 to 31, a file under /tmp/rfaas-slurm-slots. Slot S gives slurmctld port 16000+64*S, nodeK port 16000+64*S+K
# and nodeK the address 127.0.S.(10+K) (slurmd listens on every address,
# so the ports must differ; the addresses name the nodes). The ports lie
# below the kernel's ephemeral range and below scripts/pg.sh's. With
# ACCOUNTING=1, slot S's slurmdbd listens on 127.0.0.1 port 18048+2*S and
# its MariaDB on 18049+2*S.
#
# DIR/env is shell: `export SLURM_CONF=...` and the cluster's facts
# (RFAAS_SLURM_SLOT, RFAAS_SLURM_NODES, RFAAS_SLURM_CPUS,
# RFAAS_SLURM_CTLD_PORT). Clients need only SLURM_CONF.
#
# Runs as root: slurmd starts job steps as their users. Stop signals only
# the pids this cluster's daemons wrote into DIR/run (each checked to be a
# process of this cluster first) and the slurmstepd and slurmdbd processes whose
# environment names this cluster's slurm.conf.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

DIR=${RFAAS_SLURM_DIR:-${TMPDIR:-/tmp}/rfaas-slurm-$(id -u)}
NODES=${NODES:-3}
CPUS=${CPUS:-4}
SLOTS=/tmp/rfaas-slurm-slots
CONF="$DIR/etc/slurm.conf"

die() {
    echo "slurm-cluster.sh: $*" >&2
    exit 1
}

usage() {
    sed -n '6,12p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
    exit 2
}

# True while pid $1 runs (a zombie has stopped; this machine's init may
# not reap it soon).
alive() {
    local state
    state=$(sed -n 's/^State:[[:space:]]*\([A-Z]\).*/\1/p' "/proc/$1/status" 2>/dev/null) || return 1
    [ -n "$state" ] && [ "$state" != Z ]
}

# True if pid $1 belongs to this cluster: its command line names DIR, or
# its environment names this cluster's slurm.conf.
ours() {
    tr '\0' '\n' <"/proc/$1/cmdline" 2>/dev/null | grep -qF "$DIR/" && return 0
    tr '\0' '\n' <"/proc/$1/environ" 2>/dev/null | grep -qxF "SLURM_CONF=$CONF"
}

# True if the installed slurmd is release $1.$2 or later (`slurmd -V`
# prints "slurm-wlm 24.11.5" or "slurm 24.11.5").
slurm_at_least() {
    local v major minor
    v=$(slurmd -V 2>/dev/null | sed -n 's/^slurm[a-z-]* \([0-9]*\)\.\([0-9]*\).*/\1 \2/p' | head -n 1)
    [ -n "$v" ] || die "cannot tell Slurm's release from 'slurmd -V' ($(slurmd -V 2>&1 | head -n 1))"
    read -r major minor <<<"$v"
    [ "$major" -gt "$1" ] || { [ "$major" -eq "$1" ] && [ "$minor" -ge "$2" ]; }
}

# The pid in pid file $1, if that process runs and is this cluster's.
pid_from() {
    local pid
    pid=$(cat "$1" 2>/dev/null) || return 0
    [[ $pid =~ ^[0-9]+$ ]] || return 0
    alive "$pid" && ours "$pid" && echo "$pid"
    return 0
}

# SIGTERM to pid $1 (named $2), SIGKILL after 10 s.
stop_daemon() {
    local pid=$1 name=$2 _i
    kill -TERM "$pid" 2>/dev/null || return 0
    for _i in $(seq 100); do
        alive "$pid" || return 0
        sleep 0.1
    done
    echo "slurm-cluster.sh: $name (pid $pid) did not stop within 10 s; killing it" >&2
    kill -KILL "$pid" 2>/dev/null || true
}

# This cluster's running processes named $1 (slurmstepd, slurmdbd).
named() {
    local d pid
    for d in /proc/[0-9]*; do
        pid=${d#/proc/}
        [ "$(cat "$d/comm" 2>/dev/null)" = "$1" ] || continue
        alive "$pid" || continue
        tr '\0' '\n' <"$d/environ" 2>/dev/null | grep -qxF "SLURM_CONF=$CONF" && echo "$pid"
    done
    return 0
}

running() {
    [ -n "$(pid_from "$DIR/run/slurmctld.pid")" ]
}

# Takes a free slot for DIR and prints it. A slot is the file
# SLOTS/S holding its owner's directory, made with one link(2), so it
# never exists empty; a slot whose owner runs neither slurmctld nor munged
# and that is older than a minute (a start takes a second) is taken over,
# by one rename(2), which only one of two contenders wins.
take_slot() {
    mkdir -p "$SLOTS"
    chmod 1777 "$SLOTS" 2>/dev/null || true
    local s owner mine="$SLOTS/.new.$$"
    echo "$DIR" >"$mine"
    for s in $(seq 0 31); do
        if ! ln "$mine" "$SLOTS/$s" 2>/dev/null; then
            owner=$(cat "$SLOTS/$s" 2>/dev/null || true)
            if [ "$owner" != "$DIR" ]; then
                stale "$SLOTS/$s" "$owner" || continue
                mv "$SLOTS/$s" "$SLOTS/.stale.$$" 2>/dev/null || continue
                rm -f "$SLOTS/.stale.$$"
                ln "$mine" "$SLOTS/$s" 2>/dev/null || continue
            fi
        fi
        # Something else may listen there (then the slot stays taken).
        if busy $((16000 + 64 * s)) ||
            { [ "${ACCOUNTING:-0}" = 1 ] && { busy $((18048 + 2 * s)) || busy $((18049 + 2 * s)); }; }; then
            continue
        fi
        rm -f "$mine"
        echo "$s"
        return 0
    done
    rm -f "$mine"
    die "all 32 slots under $SLOTS are taken by running clusters; stop one (scripts/slurm-cluster.sh stop with its RFAAS_SLURM_DIR)"
}

# True if something listens on 127.0.0.1 port $1.
busy() {
    (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

# True if slot file $1, owned by the cluster in directory $2, is left over:
# older than a minute, and that cluster runs none of its daemons.
stale() {
    local slot=$1 dir=$2 f pid age
    age=$(($(date +%s) - $(stat -c %Y "$slot" 2>/dev/null || date +%s)))
    [ "$age" -gt 60 ] || return 1
    [ -n "$dir" ] && [ -d "$dir" ] || return 0
    for f in "$dir/run/slurmctld.pid" "$dir/run/munged.pid"; do
        pid=$(cat "$f" 2>/dev/null) || continue
        [[ $pid =~ ^[0-9]+$ ]] && alive "$pid" && return 1
    done
    return 0
}

free_slot() {
    local s=$1
    [ -n "$s" ] || return 0
    [ "$(cat "$SLOTS/$s" 2>/dev/null)" = "$DIR" ] || return 0
    rm -f "${SLOTS:?}/$s"
}

start() {
    [ "$(id -u)" -eq 0 ] || die "run me as root: slurmd starts job steps as their users"
    [[ $NODES =~ ^[0-9]+$ ]] && [ "$NODES" -ge 1 ] && [ "$NODES" -le 62 ] ||
        die "NODES=$NODES: give a number of nodes from 1 to 62"
    [[ $CPUS =~ ^[0-9]+$ ]] && [ "$CPUS" -ge 1 ] || die "CPUS=$CPUS: give a number of CPUs per node, 1 or more"
    running && die "a cluster already runs in $DIR; stop it first: RFAAS_SLURM_DIR=$DIR $0 stop"
    ensure_packages "${SLURM_PACKAGES[@]}"

    local slot ctld_port host
    slot=$(take_slot)
    ctld_port=$((16000 + 64 * slot))
    host=$(hostname -s)

    rm -rf "$DIR/run" "$DIR/log" "$DIR/state" "$DIR/spool" "$DIR/munge"
    mkdir -p "$DIR"/{etc,run,log,state,spool,munge}
    local k
    echo "$slot" >"$DIR/run/slot"
    for k in $(seq "$NODES"); do mkdir -p "$DIR/spool/node$k"; done
    # munged refuses a key others can read, and a socket directory others
    # cannot enter.
    chmod 0755 "$DIR" "$DIR/run"
    chmod 0700 "$DIR/munge"
    head -c 1024 /dev/urandom >"$DIR/munge/munge.key"
    chmod 0400 "$DIR/munge/munge.key"
    local munge_socket="$DIR/run/munge.socket"
    munged --key-file="$DIR/munge/munge.key" --socket="$munge_socket" \
        --pid-file="$DIR/run/munged.pid" --log-file="$DIR/log/munged.log" \
        --seed-file="$DIR/munge/munged.seed" ||
        { stop; die "munged did not start; its log: $DIR/log/munged.log"; }

    local plugstack="" prolog="" epilog=""
    if [ -n "${PLUGSTACK:-}" ]; then
        [ -f "$PLUGSTACK" ] || die "PLUGSTACK=$PLUGSTACK is not a file"
        plugstack="PlugStackConfig=$(realpath "$PLUGSTACK")"
    else
        : >"$DIR/etc/plugstack.conf"
        plugstack="PlugStackConfig=$DIR/etc/plugstack.conf"
    fi
    [ -z "${PROLOG:-}" ] || prolog="Prolog=$(realpath "$PROLOG")"
    [ -z "${EPILOG:-}" ] || epilog="Epilog=$(realpath "$EPILOG")"

    local accounting="AccountingStorageType=accounting_storage/none"
    if [ "${ACCOUNTING:-0}" = 1 ]; then
        start_dbd "$slot" "$host" "$munge_socket"
        accounting="AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$((18048 + 2 * slot))
AccountingStoragePass=$munge_socket"
    fi

    cat >"$CONF" <<CONF
# Written by scripts/slurm-cluster.sh (slot $slot); rewritten at every start.
ClusterName=rfaas$slot
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$ctld_port
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$munge_socket
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
$accounting
JobCompType=jobcomp/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
PrologFlags=Alloc
PrologEpilogTimeout=120
$plugstack
$prolog
$epilog
SlurmctldTimeout=30
SlurmdTimeout=30
MessageTimeout=10
InactiveLimit=0
MinJobAge=300
KillWait=5
Waittime=0
NodeName=node[1-$NODES] NodeHostname=$host NodeAddr=127.0.$slot.[11-$((10 + NODES))] Port=[$((ctld_port + 1))-$((ctld_port + NODES))] CPUs=$CPUS RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
    # Since 24.05 slurmd needs the cgroup file system even with
    # proctrack/linuxproc and task/none, unless told not to (a key 22.05
    # does not know). The cluster puts no job in a cgroup.
    rm -f "$DIR/etc/cgroup.conf"
    if slurm_at_least 24 5; then
        echo "CgroupPlugin=disabled" >"$DIR/etc/cgroup.conf"
    fi
    export SLURM_CONF="$CONF"
    if [ "${ACCOUNTING:-0}" = 1 ]; then
        # slurmctld registers with slurmdbd only as a cluster it knows;
        # slurmdbd may take a moment after it listens to answer.
        local said="" _i
        for _i in $(seq 100); do
            said=$(sacctmgr -i add cluster "rfaas$slot" 2>&1) && break
            said="failed: $said"
            sleep 0.3
        done
        case $said in failed:*)
            stop
            die "sacctmgr could not add cluster rfaas$slot to slurmdbd within 30 s ($said); its log: $DIR/log/slurmdbd.log"
            ;;
        esac
    fi

    slurmctld -c -f "$CONF" || { stop; die "slurmctld did not start; its log: $DIR/log/slurmctld.log"; }
    for k in $(seq "$NODES"); do
        slurmd -N "node$k" -f "$CONF" || { stop; die "slurmd node$k did not start; its log: $DIR/log/slurmd-node$k.log"; }
    done
    local idle=0 _i
    for _i in $(seq 300); do
        # slurmctld may not answer yet.
        idle=$(sinfo -h -N -t idle -o %N 2>/dev/null | sort -u | wc -l) || idle=0
        [ "$idle" -ge "$NODES" ] && break
        sleep 0.1
    done
    if [ "$idle" -lt "$NODES" ]; then
        sinfo -N >&2 || true
        tail -n 20 "$DIR/log/slurmctld.log" >&2 || true
        stop
        die "only $idle of $NODES nodes became idle within 30 s; the logs are in $DIR/log"
    fi

    cat >"$DIR/env" <<ENV
export SLURM_CONF=$CONF
export RFAAS_SLURM_SLOT=$slot
export RFAAS_SLURM_NODES=$NODES
export RFAAS_SLURM_CPUS=$CPUS
export RFAAS_SLURM_CTLD_PORT=$ctld_port
ENV
    echo "slurm cluster up in $DIR: $NODES nodes x $CPUS CPUs, slot $slot (slurmctld 127.0.0.1:$ctld_port); . $DIR/env"
}

# The accounting database of slot $1 on host $2, authenticating with the
# munged at socket $3: MariaDB in DIR/mariadb (a random password for
# slurmdbd's database user, kept in the 0600 slurmdbd.conf), then slurmdbd.
start_dbd() {
    local slot=$1 host=$2 munge_socket=$3
    local dbd_port=$((18048 + 2 * slot)) db_port=$((18049 + 2 * slot))
    local data="$DIR/mariadb" socket="$DIR/run/mariadb.sock" pass _i
    ensure_packages "${SLURMDBD_PACKAGES[@]}"
    rm -rf "$data"
    mkdir -p "$data"
    chown mysql: "$data"
    mariadb-install-db --no-defaults --user=mysql --datadir="$data" \
        --auth-root-authentication-method=socket --skip-test-db >"$DIR/log/mariadb-install.log" 2>&1 ||
        { stop; die "mariadb-install-db failed; its output: $DIR/log/mariadb-install.log"; }
    # The run directory is root's: mariadbd (as mysql) writes its pid and
    # socket into one of its own.
    mkdir -p "$DIR/run/mariadb"
    chown mysql: "$DIR/run/mariadb"
    socket="$DIR/run/mariadb/mariadb.sock"
    touch "$DIR/log/mariadbd.log"
    chown mysql: "$DIR/log/mariadbd.log"
    mariadbd --no-defaults --user=mysql --datadir="$data" --socket="$socket" \
        --bind-address=127.0.0.1 --port="$db_port" --pid-file="$DIR/run/mariadb/mariadbd.pid" \
        --log-error="$DIR/log/mariadbd.log" --skip-log-bin --innodb-buffer-pool-size=32M \
        --innodb-log-file-size=16M >/dev/null 2>&1 &
    for _i in $(seq 300); do
        mariadb --no-defaults --socket="$socket" -e 'SELECT 1' >/dev/null 2>&1 && break
        sleep 0.1
    done
    ln -sf mariadb/mariadbd.pid "$DIR/run/mariadbd.pid"
    mariadb --no-defaults --socket="$socket" -e 'SELECT 1' >/dev/null 2>&1 ||
        { stop; die "MariaDB did not answer within 30 s; its log: $DIR/log/mariadbd.log"; }
    pass=$(head -c 18 /dev/urandom | base64 | tr -d '/+=')
    mariadb --no-defaults --socket="$socket" -e \
        "CREATE USER 'slurm'@'127.0.0.1' IDENTIFIED BY '$pass'; GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';" ||
        { stop; die "could not make slurmdbd's database user in MariaDB"; }
    (
        umask 077
        cat >"$DIR/etc/slurmdbd.conf" <<DBD
# Written by scripts/slurm-cluster.sh (slot $slot); rewritten at every start.
AuthType=auth/munge
AuthInfo=socket=$munge_socket
DbdHost=$host
DbdAddr=127.0.0.1
DbdPort=$dbd_port
SlurmUser=root
PidFile=$DIR/run/slurmdbd.pid
LogFile=$DIR/log/slurmdbd.log
DebugLevel=info
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$db_port
StorageUser=slurm
StoragePass=$pass
StorageLoc=slurm_acct_db
DBD
    )
    # slurmdbd reads slurmdbd.conf next to SLURM_CONF.
    SLURM_CONF="$CONF" slurmdbd || { stop; die "slurmdbd did not start; its log: $DIR/log/slurmdbd.log"; }
    for _i in $(seq 300); do
        (exec 3<>"/dev/tcp/127.0.0.1/$dbd_port") 2>/dev/null && return 0
        sleep 0.1
    done
    stop
    die "slurmdbd did not listen on 127.0.0.1:$dbd_port within 30 s; its log: $DIR/log/slurmdbd.log"
}

stop() {
    local pid ctld f s
    ctld=$(pid_from "$DIR/run/slurmctld.pid")
    if [ -n "$ctld" ] && [ -f "$CONF" ]; then
        # Jobs first, so no step daemon outlives its slurmd.
        local jobs
        jobs=$(SLURM_CONF="$CONF" timeout 10 squeue -h -o %i 2>/dev/null || true)
        # shellcheck disable=SC2086 # one argument per job id
        [ -z "$jobs" ] || SLURM_CONF="$CONF" timeout 10 scancel --quiet $jobs 2>/dev/null || true
    fi
    for f in "$DIR"/run/slurmd-*.pid; do
        [ -f "$f" ] || continue
        pid=$(pid_from "$f")
        [ -z "$pid" ] || stop_daemon "$pid" "$(basename "$f" .pid)"
        rm -f "$f"
    done
    for pid in $(named slurmstepd); do
        stop_daemon "$pid" slurmstepd
    done
    [ -z "$ctld" ] || stop_daemon "$ctld" slurmctld
    rm -f "$DIR/run/slurmctld.pid"
    for f in slurmdbd mariadbd; do
        pid=$(pid_from "$DIR/run/$f.pid")
        [ -z "$pid" ] || stop_daemon "$pid" "$f"
        rm -f "$DIR/run/$f.pid"
    done
    # A slurmdbd whose pid file was not written yet, or no longer names it.
    for pid in $(named slurmdbd); do
        stop_daemon "$pid" slurmdbd
    done
    pid=$(pid_from "$DIR/run/munged.pid")
    [ -z "$pid" ] || stop_daemon "$pid" munged
    rm -f "$DIR/run/munged.pid"
    s=$(cat "$DIR/run/slot" 2>/dev/null || true)
    free_slot "$s"
    rm -f "$DIR/run/slot"
    return 0
}

status() {
    if running; then
        echo "slurm cluster in $DIR runs (slot $(cat "$DIR/run/slot" 2>/dev/null || echo '?'))"
        SLURM_CONF="$CONF" sinfo -N -o '%N %T %C' || true
    else
        echo "no slurm cluster runs in $DIR"
        return 3
    fi
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    status) status ;;
    *) usage ;;
esac

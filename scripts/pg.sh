#!/usr/bin/env bash
# A throwaway PostgreSQL 15 server in one directory, for tests and for trying
# rfaas with PostgreSQL on one machine. It listens on 127.0.0.1 only, keeps
# its socket, log and data inside DIR, and has nothing to do with the
# system's cluster (Debian's package creates `main` on port 5432; this
# neither needs nor touches it).
#
#   scripts/pg.sh start DIR [PORT]  create the cluster in DIR if it is new
#                                   (database `rfaas`), start it, wait until
#                                   it accepts connections, print its URL
#   scripts/pg.sh stop DIR          fast shutdown (SIGINT), SIGKILL after 30 s
#   scripts/pg.sh kill DIR          SIGKILL the server and its processes now
#                                   (a crash; `start` recovers from it)
#   scripts/pg.sh url DIR           print its URL
#
# A new cluster gets PORT, or a free port in 20000-32767 (below the kernel's
# ephemeral range, so no `bind(0)` elsewhere takes it while the server is
# stopped); later starts reuse it. The superuser `postgres` has a generated
# password, which the URL carries
# (postgres://postgres:PASSWORD@127.0.0.1:PORT/rfaas); over DIR's socket
# (`psql -h DIR -p PORT -U postgres rfaas`) no password is asked, and only
# DIR's owner and root can reach it. Its certificate for 127.0.0.1, from a
# throwaway CA in DIR/tls (make_test_ca in scripts/lib.sh), is configured
# with TLS off; `ALTER SYSTEM SET ssl = on` and `SELECT pg_reload_conf()`
# turn it on, and `?sslmode=verify-full&sslrootcert=DIR/tls/ca.pem` on the
# URL has clients check it. fsync is off: a committed transaction
# survives a crash of the server (`kill`), not a crash of the machine.
#
# Run as root, the server runs as the `postgres` user and DIR is created
# owned by it; otherwise it runs as whoever calls this. The pid of the
# server is in DIR/postgres.pid while it runs, its log in DIR/postgres.log.
# The binaries come from /usr/lib/postgresql/15/bin (Debian's postgresql-15,
# which scripts/test.sh installs), or $PG_BINDIR.
set -euo pipefail

PG_BINDIR=${PG_BINDIR:-/usr/lib/postgresql/15/bin}

# shellcheck source=scripts/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

die() {
    echo "pg.sh: $*" >&2
    exit 1
}

usage() {
    sed -n '8,14p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
    exit 2
}

# The prefix that runs a command as the server's user: `postgres` when we
# are root (setpriv execs, so a background server's $! is its own pid).
AS_OWNER=()
[ "$(id -u)" -ne 0 ] || AS_OWNER=(setpriv --reuid=postgres --regid=postgres --init-groups --)

# True while pid $1 runs (a zombie has stopped: nothing may reap it if the
# init of this machine does not).
alive() {
    local state
    state=$(sed -n 's/^State:[[:space:]]*\([A-Z]\).*/\1/p' "/proc/$1/status" 2>/dev/null) || return 1
    [ -n "$state" ] && [ "$state" != Z ]
}

# The pid of DIR's server if it runs, else nothing. The pid file is trusted
# only while that pid is a postgres serving DIR/data (pids are reused).
running_pid() {
    local pid
    pid=$(cat "$DIR/postgres.pid" 2>/dev/null) || return 0
    [[ $pid =~ ^[0-9]+$ ]] || return 0
    alive "$pid" || return 0
    # The postmaster keeps its command line and works in its data directory.
    if tr '\0' '\n' <"/proc/$pid/cmdline" 2>/dev/null | grep -qxF "$DIR/data" ||
        [ "$(readlink "/proc/$pid/cwd" 2>/dev/null)" = "$DIR/data" ]; then
        echo "$pid"
    fi
}

# The postmaster's children (backends, checkpointer, ...), from /proc.
children() {
    local stat
    for stat in /proc/[0-9]*/stat; do
        # Field 4 is the parent pid; field 2, the name, may hold spaces.
        sed -n "s/^\([0-9]*\) (.*) [A-Za-z] $1 .*/\1/p" "$stat" 2>/dev/null || true
    done
}

url() {
    [ -f "$DIR/url" ] || die "$DIR holds no cluster; create one with: scripts/pg.sh start $DIR"
    cat "$DIR/url"
}

# SIGKILL the server and its processes. Stopped first, the postmaster
# cannot fork while its children are listed; they must all be gone before a
# new server may start (they hold the old one's shared memory).
kill_server() {
    local pid=$1 kids kid _i
    kill -STOP "$pid" 2>/dev/null || true
    kids=$(children "$pid")
    kill -KILL "$pid" 2>/dev/null || true
    for kid in $kids; do
        kill -KILL "$kid" 2>/dev/null || true
    done
    for _i in $(seq 100); do
        local left=0
        for kid in "$pid" $kids; do
            alive "$kid" && left=1
        done
        [ "$left" = 0 ] && break
        sleep 0.1
    done
    rm -f "$DIR/postgres.pid"
}

stop() {
    local pid _i
    pid=$(running_pid)
    if [ -z "$pid" ]; then
        rm -f "$DIR/postgres.pid"
        echo "pg.sh: no server runs in $DIR" >&2
        return 0
    fi
    # SIGINT is PostgreSQL's fast shutdown: clients are disconnected, the
    # data is checkpointed.
    kill -INT "$pid" 2>/dev/null || true
    for _i in $(seq 300); do
        alive "$pid" || {
            rm -f "$DIR/postgres.pid"
            return 0
        }
        sleep 0.1
    done
    echo "pg.sh: the server (pid $pid) did not stop within 30 s; killing it" >&2
    kill_server "$pid"
}

# Prints a port nothing listens on, chosen at random in 20000-32767 (a
# connection to it is refused; a race with another server is caught when
# the server starts).
pick_port() {
    local port _i
    for _i in $(seq 50); do
        port=$((20000 + RANDOM % 12768))
        if ! (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
            echo "$port"
            return 0
        fi
    done
    die "found no free port in 20000-32767 after 50 tries; give one: scripts/pg.sh start DIR PORT"
}

init() {
    local port=$1
    mkdir -p "$DIR"
    [ -z "$(ls -A "$DIR")" ] || die "$DIR is not empty and holds no cluster; give a new or empty directory"
    [ "$(id -u)" -ne 0 ] || chown postgres:postgres "$DIR"
    chmod 0700 "$DIR"
    "${AS_OWNER[@]}" test -w "$DIR" -a -x "$DIR" ||
        die "$DIR must be writable by $([ "$(id -u)" -eq 0 ] && echo postgres || id -un), and every directory above it searchable; use a new directory (it is created) under /tmp, for example"
    # A unix socket's path is at most 107 bytes.
    [ ${#DIR} -le 90 ] || die "$DIR is too long for the server's socket path (90 characters at most)"

    local password
    password=$(od -An -tx1 -N16 /dev/urandom | tr -d ' \n')
    # initdb reads the password from a file only its user can read.
    (umask 077 && printf '%s\n' "$password" >"$DIR/password")
    [ "$(id -u)" -ne 0 ] || chown postgres:postgres "$DIR/password"
    "${AS_OWNER[@]}" "$PG_BINDIR/initdb" --pgdata="$DIR/data" --username=postgres \
        --pwfile="$DIR/password" --auth-local=trust --auth-host=scram-sha-256 \
        --encoding=UTF8 --locale=C.UTF-8 --no-sync >"$DIR/initdb.log" 2>&1 || {
        cat "$DIR/initdb.log" >&2
        die "initdb failed (above)"
    }
    rm -f "$DIR/password"
    make_test_ca "$DIR/tls" || die "could not make the server's certificate (above)"
    [ "$(id -u)" -ne 0 ] || chown -R postgres:postgres "$DIR/tls"
    cat >>"$DIR/data/postgresql.conf" <<CONF

# scripts/pg.sh: a throwaway server on loopback.
listen_addresses = '127.0.0.1'
port = $port
unix_socket_directories = '$DIR'
fsync = off
full_page_writes = off
shared_buffers = 32MB
ssl = off
ssl_cert_file = '$DIR/tls/server.pem'
ssl_key_file = '$DIR/tls/server.key'
CONF
    (umask 077 && printf 'postgres://postgres:%s@127.0.0.1:%s/rfaas\n' "$password" "$port" >"$DIR/url")
}

port_of() {
    sed -n "s/^port = \([0-9]*\)$/\1/p" "$DIR/data/postgresql.conf" | tail -n 1
}

# Starts the server once; fails with status 3 when its port was taken.
launch() {
    local port=$1 pid _i
    # A killed server leaves its lock files. PostgreSQL removes them itself
    # unless their pid names a zombie (the init of this machine may reap
    # nothing), which it takes for a live server.
    local lock
    for lock in "$DIR/data/postmaster.pid" "$DIR"/.s.PGSQL.*.lock; do
        [ -f "$lock" ] || continue
        pid=$(head -n 1 "$lock")
        if [[ $pid =~ ^[0-9]+$ ]] && ! alive "$pid"; then
            rm -f "$lock"
        fi
    done
    : >>"$DIR/postgres.log"
    [ "$(id -u)" -ne 0 ] || chown postgres:postgres "$DIR/postgres.log"
    local from
    from=$(wc -l <"$DIR/postgres.log")
    "${AS_OWNER[@]}" "$PG_BINDIR/postgres" -D "$DIR/data" </dev/null >>"$DIR/postgres.log" 2>&1 &
    pid=$!
    echo "$pid" >"$DIR/postgres.pid"
    for _i in $(seq 600); do
        if ! alive "$pid"; then
            rm -f "$DIR/postgres.pid"
            if tail -n +"$((from + 1))" "$DIR/postgres.log" | grep -q "Address already in use"; then
                return 3
            fi
            tail -n +"$((from + 1))" "$DIR/postgres.log" | tail -n 20 >&2
            die "the server in $DIR stopped while starting; its log is above"
        fi
        # Asked through its own socket, not the port, which another server
        # may hold. PostgreSQL binds its TCP port before it makes the socket.
        "$PG_BINDIR/pg_isready" -q -h "$DIR" -p "$port" -t 1 && return 0
        sleep 0.1
    done
    kill_server "$pid"
    tail -n 20 "$DIR/postgres.log" >&2
    die "the server in $DIR did not accept connections within 60 s; its log is above"
}

start() {
    local want=${1:-} pid port new=0 tries=1
    [ -z "$want" ] || [[ $want =~ ^[0-9]+$ && $want -ge 1 && $want -le 65535 ]] ||
        die "$want is not a port number"
    [ -x "$PG_BINDIR/postgres" ] ||
        die "$PG_BINDIR/postgres is missing; install Debian's postgresql-15 (scripts/test.sh does: apt-get install postgresql-15) or set PG_BINDIR"
    if [ "$(id -u)" -eq 0 ]; then
        id postgres >/dev/null 2>&1 || die "there is no postgres user to run the server as; install Debian's postgresql-15"
    fi
    if [ ! -f "$DIR/data/PG_VERSION" ]; then
        new=1
        [ -n "$want" ] || tries=20
        init "${want:-$(pick_port)}"
    fi
    port=$(port_of)
    [ -z "$want" ] || [ "$want" = "$port" ] ||
        die "the cluster in $DIR listens on port $port, not $want; start it without a port"
    pid=$(running_pid)
    if [ -n "$pid" ]; then
        echo "pg.sh: the server in $DIR already runs (pid $pid)" >&2
        url
        return 0
    fi
    local status=0
    for ((;;)); do
        status=0
        launch "$port" || status=$?
        [ "$status" = 3 ] || break
        tries=$((tries - 1))
        [ "$tries" -gt 0 ] || die "port $port is taken; free it, or start a new cluster on another port"
        # A new cluster without a given port moves to another free one.
        port=$(pick_port)
        sed -i "s/^port = [0-9]*$/port = $port/" "$DIR/data/postgresql.conf"
        sed -i "s/@127\.0\.0\.1:[0-9]*\//@127.0.0.1:$port\//" "$DIR/url"
    done
    if [ "$new" = 1 ]; then
        "$PG_BINDIR/createdb" -h "$DIR" -p "$port" -U postgres rfaas
    fi
    url
}

[ $# -ge 2 ] || usage
cmd=$1
DIR=$2
# Absolute, so the pid check and the socket path do not depend on where
# this runs.
case $DIR in
/*) ;;
*) DIR=$PWD/$DIR ;;
esac
DIR=${DIR%/}

case $cmd in
start)
    [ $# -le 3 ] || usage
    start "${3:-}"
    ;;
stop)
    [ $# -eq 2 ] || usage
    stop
    ;;
kill)
    [ $# -eq 2 ] || usage
    pid=$(running_pid)
    [ -z "$pid" ] || kill_server "$pid"
    ;;
url)
    [ $# -eq 2 ] || usage
    url
    ;;
*) usage ;;
esac

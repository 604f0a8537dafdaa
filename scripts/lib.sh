# Shared helpers for rfaas scripts. Source it; do not run it.
# shellcheck shell=bash

# Installs Debian packages that are missing, updating the package lists once.
ensure_packages() {
    local missing=()
    local pkg
    for pkg in "$@"; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    echo "rfaas: installing ${missing[*]}" >&2
    local sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo apt-get -o DPkg::Lock::Timeout=300 update -q >/dev/null
    DEBIAN_FRONTEND=noninteractive $sudo apt-get -o DPkg::Lock::Timeout=300 install -y -q \
        --no-install-recommends "${missing[@]}" >/dev/null
}

# What building rfaas needs (verbs: libibverbs, librdmacm; bindgen: libclang;
# the SPANK plugin's declarations: Slurm's headers).
# shellcheck disable=SC2034 # used by the scripts that source this file
BUILD_PACKAGES=(build-essential pkg-config libibverbs-dev librdmacm-dev libclang-dev clang libslurm-dev)

# What the tests need besides the build: bubblewrap (the executor's sandbox
# tests), OpenMPI (the MPI example), Debian's Prometheus server (the
# scrape tests; its package does not start it outside systemd) and
# PostgreSQL 15 with psql (the tests' throwaway servers, scripts/pg.sh; the
# package also creates and, under systemd, starts a `main` cluster on port
# 5432, which the tests neither use nor touch), and python3 with venv and
# curl (scripts/fuzz-manager-api.sh installs schemathesis into a virtualenv
# and sets up the manager it fuzzes with curl), and openssl (make_test_ca:
# the tests' and the demo's throwaway CA).
# shellcheck disable=SC2034
TEST_PACKAGES=(bubblewrap openmpi-bin libopenmpi-dev prometheus postgresql-15 postgresql-client-15
    python3 python3-venv curl openssl)

# What a loopback Slurm cluster needs (scripts/slurm-cluster.sh; the
# slurm-spank tests start one each): munge, Slurm's daemons and clients
# (the plugin's headers are in BUILD_PACKAGES).
# shellcheck disable=SC2034
SLURM_PACKAGES=(munge slurmctld slurmd slurm-client)

# What such a cluster's accounting database needs (ACCOUNTING=1
# scripts/slurm-cluster.sh; the coordinator tests start one): slurmdbd and
# MariaDB, whose packaged service is not used.
# shellcheck disable=SC2034
SLURMDBD_PACKAGES=(slurmdbd mariadb-server)

# What building and checking the packages needs (scripts/package.sh,
# scripts/check-packages.sh): dpkg-dev (cargo-deb's dependency lines),
# lintian, rpm (rpm -qpl/-qpR) and rpm2cpio (rpm2archive, to look inside),
# binutils (objdump, readelf).
# shellcheck disable=SC2034
PACKAGE_PACKAGES=(dpkg-dev lintian rpm rpm2cpio binutils)

# Rewrites a built .deb in place: applies the sed expression SED_EXPR
# (may be empty) to its control file, and writes CONTENT to PATH inside
# it (DEBIAN/shlibs, or a packaged file) if given. For what cargo-deb
# cannot say (a Depends computed at package time) and for the upgrade
# test's older packages.
#   deb_rewrite DEB SED_EXPR [PATH CONTENT]
deb_rewrite() {
    local deb=$1 expr=$2 tmp
    tmp=$(mktemp -d)
    chmod 0755 "$tmp"
    dpkg-deb -R "$deb" "$tmp"
    [ -z "$expr" ] || sed -i "$expr" "$tmp/DEBIAN/control"
    [ $# -lt 4 ] || printf '%s\n' "$4" >"$tmp/$3"
    dpkg-deb --root-owner-group -Zxz -b "$tmp" "$deb" >/dev/null
    rm -rf "$tmp"
}

# The one build CI makes, in scripts/test.sh's first step: the whole
# workspace, every target, with the verbs provider, debug profile, cargo's
# target directory. Every later stage asks cargo for exactly these units
# (CI_BUILD for builds, CI_FEATURES for `cargo test`), so it finds them
# fresh. A narrower command (`-p rfaas-executor`, `--features verbs` on one
# package) resolves features for fewer packages, changes the features of
# shared dependencies (syn, regex, bindgen) and compiles them, rdma-sys
# included, a second time.
# shellcheck disable=SC2034
CI_FEATURES=(--workspace --features rfaas-fabric/verbs)
# shellcheck disable=SC2034
CI_BUILD=("${CI_FEATURES[@]}" --all-targets)

# The source directories in which no file may depend, directly or through
# others, on a file that depends on it (scripts/check-imports.py,
# docs/testing.md).
# shellcheck disable=SC2034
IMPORT_CHECKED_DIRS=(executor/src/daemon fabric/src)

# Runs BUILD under an exclusive flock on LOCK_FILE unless CURRENT (a
# command: function and arguments, split at spaces) succeeds there, or
# FORCE is 1. So one cache is built at a time: a second caller waits for
# the first, then finds it current. Returns BUILD's status.
#   build_once LOCK_FILE FORCE CURRENT BUILD
build_once() {
    local lock=$1 force=$2 current=$3 build=$4 fd status=0
    exec {fd}>"$lock"
    flock "$fd"
    # shellcheck disable=SC2086 # the commands are split into their words
    if [ "$force" = 1 ] || ! $current; then
        $build || status=$?
    fi
    exec {fd}>&-
    return $status
}

ensure_rust() {
    if ! command -v cargo >/dev/null 2>&1; then
        [ -x "$HOME/.cargo/bin/cargo" ] && export PATH="$HOME/.cargo/bin:$PATH"
    fi
    command -v cargo >/dev/null 2>&1 || {
        echo "rfaas: cargo is missing; install Rust (https://rustup.rs) and run this again" >&2
        exit 1
    }
}

# Prints a banner nobody reading a CI log can miss, on stderr.
loud() {
    local bar='!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!'
    printf '\n%s\n' "$bar" >&2
    printf '!!! %s\n' "$@" >&2
    printf '%s\n\n' "$bar" >&2
}

# in_booted_root LEADER CMD...: runs CMD as root in the root booted with
# scripts/roots.sh boot whose systemd is pid LEADER, in /root, with a
# login's plain environment.
in_booted_root() {
    local leader=$1
    shift
    nsenter --target "$leader" --all -- env -i HOME=/root LANG=C.UTF-8 \
        PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        DEBIAN_FRONTEND=noninteractive sh -c 'cd /root && exec "$@"' sh "$@"
}

# The repository root.
repo_root() {
    cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd
}

# Prints what the sed expression EXPR extracts from the first line of FILE
# it matches, once process PID has written it: waits up to 30 s, and prints
# nothing if PID ends or the time passes first.
#   await_line PID FILE EXPR
await_line() {
    local pid=$1 file=$2 expr=$3 got _i
    for _i in $(seq 300); do
        got=$(sed -n "$expr" "$file" | head -n 1)
        [ -n "$got" ] && { printf '%s\n' "$got"; return 0; }
        kill -0 "$pid" 2>/dev/null || return 0
        sleep 0.1
    done
}

# Starts rfaas-executord on loopback with its files in a work directory.
#   start_executord BIN_DIR WORK_DIR [EXTRA_TOML_LINES]
# BIN_DIR holds rfaas-executord, rfaas-worker and rfaas-token. Sets
# EXECUTORD_PID, EXECUTORD_CONTROL (host:port), EXECUTORD_NODE and
# EXECUTORD_KEY (the secret key tokens are minted with; the daemon holds
# only its public half); the daemon's log is WORK_DIR/executord.log. Stop it with
# stop_executord (by its pid).
start_executord() {
    local bin=$1 work=$2 extra=${3:-}
    EXECUTORD_BIN=$bin
    # Workers run as the lease's user and reach their directories below it.
    chmod 0755 "$work"
    EXECUTORD_KEY="$work/lease-key.secret"
    EXECUTORD_NODE=rfaas-local
    "$bin/rfaas-token" keygen --key-id local --secret "$EXECUTORD_KEY" \
        --public "$work/lease-keys.pub" >/dev/null 2>&1
    cat >"$work/executord.toml" <<TOML
node_name = "$EXECUTORD_NODE"
control_listen = "127.0.0.1:0"
fabric_host = "127.0.0.1"
providers = ["tcp", "shm"]
cpus = "0-3"
pin = false
memory_mib = 4096
lease_keys = ["$work/lease-keys.pub"]
local_socket = "$work/executord.sock"
runtime_dir = "$work/run"
pool_size = 2
sandbox = "none"
log_level = "info"
$extra
TOML
    "$bin/rfaas-executord" --config "$work/executord.toml" \
        </dev/null >"$work/executord.out" 2>"$work/executord.log" &
    EXECUTORD_PID=$!
    EXECUTORD_CONTROL=$(await_line "$EXECUTORD_PID" "$work/executord.out" \
        's/^rfaas-executord ready control=\([^ ]*\) .*/\1/p')
    if [ -z "$EXECUTORD_CONTROL" ]; then
        echo "rfaas-executord did not print its ready line within 30 s; its log:" >&2
        tail -n 40 "$work/executord.log" >&2
        return 1
    fi
    echo "rfaas-executord (pid $EXECUTORD_PID) ready, control $EXECUTORD_CONTROL"
}

# Stops the daemon start_executord started (SIGTERM: it stops its workers;
# SIGKILL after 5 s), by its pid.
stop_executord() {
    stop_pid "${EXECUTORD_PID:-}"
    EXECUTORD_PID=""
}

# Makes a throwaway certificate authority and one server certificate it
# signed, for tests and demos (never for a site: its key sits next to it).
#   make_test_ca DIR [NAME...]
# Writes DIR/ca.pem (what clients trust: RFAAS_CA_FILE, ca_file,
# --ca-file), DIR/ca.key, DIR/server.pem and DIR/server.key (mode 0600).
# The server certificate names each NAME (a DNS name or an IP address);
# without any, 127.0.0.1, ::1 and localhost.
make_test_ca() {
    local dir=$1
    shift
    [ $# -gt 0 ] || set -- 127.0.0.1 ::1 localhost
    local san="" name
    for name in "$@"; do
        if [[ $name =~ ^[0-9.]+$ || $name == *:* ]]; then san+=",IP:$name"; else san+=",DNS:$name"; fi
    done
    san=${san#,}
    mkdir -p "$dir"
    (
        umask 077
        openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 30 \
            -subj "/CN=rfaas test CA" -keyout "$dir/ca.key" -out "$dir/ca.pem" \
            -addext "basicConstraints=critical,CA:TRUE" \
            -addext "keyUsage=critical,keyCertSign,cRLSign" &&
            openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes \
                -subj "/CN=localhost" -keyout "$dir/server.key" -out "$dir/server.csr" &&
            printf 'subjectAltName=%s\nextendedKeyUsage=serverAuth\nbasicConstraints=CA:FALSE\n' "$san" \
                >"$dir/server.ext" &&
            openssl x509 -req -in "$dir/server.csr" -CA "$dir/ca.pem" -CAkey "$dir/ca.key" \
                -CAcreateserial -days 30 -extfile "$dir/server.ext" -out "$dir/server.pem"
    ) >"$dir/openssl.log" 2>&1 || { cat "$dir/openssl.log" >&2; return 1; }
    chmod 0644 "$dir/ca.pem" "$dir/server.pem"
}

# Starts rfaas-manager on loopback on SQLite, serving HTTPS with a
# certificate of a throwaway CA (make_test_ca), with its admin token and
# lease key in WORK_DIR/manager.
#   start_manager BIN_DIR WORK_DIR
# Sets MANAGER_PID, MANAGER_URL (https://127.0.0.1:port), MANAGER_DIR,
# MANAGER_CA_DIR (the throwaway CA, whose server certificate executord's
# control port serves too),
# RFAAS_CA_FILE (exported: every client of the manager started from here
# on trusts the CA) and RFAASCTL (rfaasctl with the manager's URL and admin
# token). Stop it with stop_manager (by pid).
start_manager() {
    local bin=$1 work=$2
    MANAGER_DIR="$work/manager"
    mkdir -p "$MANAGER_DIR"
    chmod 0700 "$MANAGER_DIR"
    # Outside the private MANAGER_DIR: jobs, as their users, read ca.pem.
    MANAGER_CA_DIR="$work/ca"
    make_test_ca "$MANAGER_CA_DIR" || return 1
    export RFAAS_CA_FILE="$MANAGER_CA_DIR/ca.pem"
    head -c 32 /dev/urandom | base64 | tr -d '\n=' >"$MANAGER_DIR/admin.token"
    chmod 0600 "$MANAGER_DIR/admin.token"
    "$bin/rfaas-token" keygen --key-id manager --secret "$MANAGER_DIR/lease-key.secret" \
        --public "$MANAGER_DIR/lease-keys.pub" >"$MANAGER_DIR/keygen.log" 2>&1 ||
        { cat "$MANAGER_DIR/keygen.log" >&2; return 1; }
    chmod 0644 "$MANAGER_DIR/lease-keys.pub"
    "$bin/rfaas-manager" --listen 127.0.0.1:0 --database "sqlite://$MANAGER_DIR/manager.db" \
        --admin-token-file "$MANAGER_DIR/admin.token" \
        --lease-key-file "$MANAGER_DIR/lease-key.secret" \
        --tls-cert "$work/ca/server.pem" --tls-key "$work/ca/server.key" \
        </dev/null >"$MANAGER_DIR/manager.out" 2>"$MANAGER_DIR/manager.log" &
    MANAGER_PID=$!
    MANAGER_URL=""
    local addr
    addr=$(await_line "$MANAGER_PID" "$MANAGER_DIR/manager.out" \
        's/^rfaas-manager listening on \(.*\)$/\1/p')
    if [ -z "$addr" ]; then
        echo "rfaas-manager did not start within 30 s; its log:" >&2
        tail -n 40 "$MANAGER_DIR/manager.log" >&2
        return 1
    fi
    MANAGER_URL="https://$addr"
    RFAASCTL=("$bin/rfaasctl" --manager "$MANAGER_URL" --ca-file "$RFAAS_CA_FILE"
        --token-file "$MANAGER_DIR/admin.token")
    echo "rfaas-manager (pid $MANAGER_PID) serving $MANAGER_URL on SQLite"
}

# Stops the manager start_manager started, by its pid.
stop_manager() {
    stop_pid "${MANAGER_PID:-}"
    MANAGER_PID=""
}

# Starts an accounting service on the manager's SQLite database, with the
# rates of WORK_DIR/accounting/billing.toml (written here), listening on
# tcp on 127.0.0.1. Sets ACCOUNTING_PID and BILLING (the rfaas-billing
# command line). Stop it with stop_accounting.
#   start_accounting BIN_DIR WORK_DIR
start_accounting() {
    local bin=$1 work=$2
    ACCOUNTING_DIR="$work/accounting"
    mkdir -p "$ACCOUNTING_DIR"
    cat >"$ACCOUNTING_DIR/billing.toml" <<TOML
currency = "CHF"
[rates]
alloc_per_gib_s = 0.0001
compute_per_s = 0.01
hot_per_s = 0.005
harvested_discount = 0.5
TOML
    "$bin/rfaas-accounting" --name acct1 --database "sqlite://$MANAGER_DIR/manager.db" \
        --region-file "$ACCOUNTING_DIR/region" --provider tcp --listen 127.0.0.1:0 \
        --metrics-listen 127.0.0.1:0 --billing-config "$ACCOUNTING_DIR/billing.toml" \
        --lease-keys "$MANAGER_DIR/lease-keys.pub" \
        </dev/null >"$ACCOUNTING_DIR/accounting.out" 2>"$ACCOUNTING_DIR/accounting.log" &
    ACCOUNTING_PID=$!
    local ready
    ready=$(await_line "$ACCOUNTING_PID" "$ACCOUNTING_DIR/accounting.out" \
        's/^rfaas-accounting listening on \(.*\)$/\1/p')
    if [ -z "$ready" ]; then
        echo "rfaas-accounting did not start within 30 s; its log:" >&2
        tail -n 40 "$ACCOUNTING_DIR/accounting.log" >&2
        return 1
    fi
    BILLING=("$bin/rfaas-billing" --database "sqlite://$MANAGER_DIR/manager.db"
        --config "$ACCOUNTING_DIR/billing.toml")
    echo "rfaas-accounting (pid $ACCOUNTING_PID) listening on $ready"
}

# Stops the service start_accounting started, by its pid.
stop_accounting() {
    stop_pid "${ACCOUNTING_PID:-}"
    ACCOUNTING_PID=""
}

# Starts an executor daemon for node NAME that registers with the manager
# of start_manager and accepts its lease tokens.
# Its files are in WORK_DIR/NAME (its local socket WORK_DIR/NAME/
# executord.sock); EXTRA_TOML (a [slurm] table, say) ends its
# configuration; TOP_TOML (metrics_listen, say) goes among its top-level
# keys. Its pid is appended to NODE_PIDS. Stop them all with stop_nodes.
#   start_node BIN_DIR WORK_DIR NAME CPUS [EXTRA_TOML [TOP_TOML]]
start_node() {
    local bin=$1 work=$2 name=$3 cpus=$4 extra=${5:-} top=${6:-}
    local dir="$work/$name"
    mkdir -p "$dir"
    # Workers run as the lease's user and reach their directories below it.
    chmod 0755 "$work" "$dir"
    "${RFAASCTL[@]}" credential node "$name" >"$dir/node.credential" 2>/dev/null
    chmod 0600 "$dir/node.credential"
    cat >"$dir/executord.toml" <<TOML
node_name = "$name"
control_listen = "127.0.0.1:0"
fabric_host = "127.0.0.1"
providers = ["tcp", "shm"]
cpus = "$cpus"
pin = false
memory_mib = 2048
lease_keys = ["$MANAGER_DIR/lease-keys.pub"]
# The control port speaks TLS only, with the throwaway CA's certificate
# for 127.0.0.1, as a site's nodes would with theirs.
control_tls_cert = "$MANAGER_CA_DIR/server.pem"
control_tls_key = "$MANAGER_CA_DIR/server.key"
local_socket = "$dir/executord.sock"
runtime_dir = "$dir/run"
pool_size = 1
sandbox = "none"
log_level = "info"
$top

[manager]
urls = ["$MANAGER_URL"]
credential_file = "$dir/node.credential"
ca_file = "$RFAAS_CA_FILE"

[billing]
journal = "$dir/billing.jsonl"

$extra
TOML
    "$bin/rfaas-executord" --config "$dir/executord.toml" \
        </dev/null >"$dir/executord.out" 2>"$dir/executord.log" &
    NODE_PIDS+=("$!")
}

# Stops every daemon start_node started, by pid.
stop_nodes() {
    local pid
    for pid in "${NODE_PIDS[@]}"; do
        stop_pid "$pid"
    done
    NODE_PIDS=()
}

# SIGTERM to PID, SIGKILL after 5 s; waits for it.
stop_pid() {
    local pid=$1
    [ -n "$pid" ] || return 0
    if kill -0 "$pid" 2>/dev/null; then
        kill -TERM "$pid" 2>/dev/null || true
        local _i
        for _i in $(seq 50); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.1
        done
        kill -KILL "$pid" 2>/dev/null || true
    fi
    wait "$pid" 2>/dev/null || true
}

# Prints a lease token for the local daemon: mint_token USER CORES MEMORY_MIB
mint_token() {
    "$EXECUTORD_BIN/rfaas-token" mint --key "$EXECUTORD_KEY" --node "$EXECUTORD_NODE" \
        --user "$1" --account demo --cores "$2" --memory-mib "$3" --ttl-secs 3600
}

# Prints one line per file git reports as changed or new in this checkout:
# its status, its path and a hash of its content. Prints nothing outside a
# git checkout.
checkout_changes() {
    git rev-parse --is-inside-work-tree >/dev/null 2>&1 || return 0
    local entry path hash
    while IFS= read -r -d '' entry; do
        path=${entry:3}
        hash=deleted
        [ -f "$path" ] && hash=$(git hash-object -- "$path")
        printf '%s %s %s\n' "${entry:0:2}" "$hash" "$path"
    done < <(git status --porcelain=v1 -z --untracked-files=all --no-renames)
}

# Fails, naming the files, when the checkout differs from what
# checkout_changes printed before ($1): a test or build step wrote into the
# repository. On a clean checkout (CI's fresh clone) this is `git status
# --porcelain` staying empty.
check_checkout_unchanged() {
    local before=$1 after changed
    git rev-parse --is-inside-work-tree >/dev/null 2>&1 || {
        echo "not a git checkout: cannot check that the tests left the tree as they found it"
        return 0
    }
    after=$(checkout_changes)
    [ "$before" = "$after" ] && {
        echo "checkout: unchanged by the run"
        return 0
    }
    changed=$(diff <(printf '%s\n' "$before") <(printf '%s\n' "$after") |
        sed -n 's/^[<>] .. [^ ]* //p' | sort -u)
    loud "FAILED: the run changed the checkout; git status names:" \
        "${changed//$'\n'/ }" \
        "A step writes into the repository. If the file is generated and belongs" \
        "in git (a lockfile, a header), commit it up to date; otherwise make the" \
        "step write under target/ or list the file in .gitignore."
    echo "git status now (with whatever was changed before the run):" >&2
    git status --short --untracked-files=all >&2
    return 1
}

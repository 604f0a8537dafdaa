#!/usr/bin/env bash
# Fuzzes rfaas-manager's REST API with schemathesis, for CI.
#
#   scripts/fuzz-manager-api.sh                    # after `cargo build`
#   FUZZ_API_EXAMPLES=500 scripts/fuzz-manager-api.sh   # default 100 per operation
#   FUZZ_API_SEED=7 scripts/fuzz-manager-api.sh         # another fixed seed
#   FUZZ_API_BACKENDS=sqlite scripts/fuzz-manager-api.sh  # default: sqlite postgres
#
# For each backend, starts a real target/debug/rfaas-manager on a new
# database (SQLite in a temporary directory; PostgreSQL through
# scripts/pg.sh, which refuses text SQLite takes, such as a NUL byte),
# with a private admin token and lease key, mints a user and a node
# credential, registers a node so the lease routes have capacity to grant,
# and lets schemathesis generate requests, over HTTPS with a throwaway
# CA's certificate (make_test_ca), from the manager's own OpenAPI
# document (/v1/openapi.json): valid ones, and invalid ones the manager
# must refuse. It runs twice, as the admin and as a user, because each
# role reaches other code behind the same routes. It fails on:
#
# - any 5xx answer (not_a_server_error), except the 503 `no_capacity` that
#   POST /v1/leases documents, once the fuzzer's own leases fill the node;
# - an answer whose status, content type or body the document does not
#   describe (status_code_conformance, content_type_conformance,
#   response_schema_conformance);
# - any ERROR line, panic or unavailable database in the manager's log,
#   which also catches a 5xx the allowance above would hide.
#
# schemathesis comes from PyPI, pinned below, into a virtualenv under
# target/ (ignored by git, kept between runs and CI stages; delete it to
# reinstall). Everything it writes goes to a temporary directory, so the
# checkout is left as found. The manager and PostgreSQL are stopped by
# their pids on exit, whatever happens.

set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$repo/scripts/lib.sh"
schemathesis_version=4.32.5
examples=${FUZZ_API_EXAMPLES:-100}
seed=${FUZZ_API_SEED:-20240611}
backends=${FUZZ_API_BACKENDS:-sqlite postgres}
venv=${RFAAS_SCHEMATHESIS_VENV:-$repo/target/venv-schemathesis}
bin=$repo/target/debug

if [ ! -x "$bin/rfaas-manager" ]; then
    echo "fuzz-manager-api: $bin/rfaas-manager is missing; run \`cargo build -p rfaas-manager\` first" >&2
    exit 1
fi

if [ "$("$venv/bin/st" --version 2>/dev/null)" != "st, version $schemathesis_version" ]; then
    echo "fuzz-manager-api: installing schemathesis $schemathesis_version into $venv" >&2
    rm -rf "$venv"
    if ! python3 -m venv "$venv"; then
        echo "fuzz-manager-api: python3 cannot make a virtualenv; install python3-venv" >&2
        exit 1
    fi
    "$venv/bin/pip" install --quiet --disable-pip-version-check "schemathesis==$schemathesis_version"
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/rfaas-fuzz-api.XXXXXX")
# PostgreSQL's server runs as `postgres` under root and reaches its
# directory through this one.
chmod 0755 "$work"
manager_pid=""
pg_dir=""
stop_fuzzed_manager() {
    stop_pid "$manager_pid"
    manager_pid=""
}
stop_postgres() {
    if [ -n "$pg_dir" ]; then
        bash "$repo/scripts/pg.sh" stop "$pg_dir" >/dev/null 2>&1 || true
        pg_dir=""
    fi
}
cleanup() {
    stop_fuzzed_manager
    stop_postgres
    rm -rf "$work"
}
trap cleanup EXIT
# The managers serve HTTPS with this CA's certificate, as a site's would.
make_test_ca "$work/ca"

# call METHOD PATH TOKEN [BODY]: prints the answer; fails unless 2xx.
call() {
    local args=(-sS --fail-with-body --cacert "$work/ca/ca.pem" -X "$1" -H "Authorization: Bearer $3")
    [ $# -ge 4 ] && args+=(-H 'Content-Type: application/json' -d "$4")
    curl "${args[@]}" "$url$2"
}
token_of() { sed -n 's/.*"token":"\([^"]*\)".*/\1/p'; }

cat >"$work/schemathesis.toml" <<'TOML'
# POST /v1/leases answers 503 no_capacity once the fuzzer's leases fill
# the node, as its document says; the log check still catches a database
# failure behind a 503.
[[operations]]
include-method = "POST"
include-path = "/v1/leases"
checks.not_a_server_error.expected-statuses = ["2xx", "3xx", "4xx", "503"]
TOML
checks=not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance

# fuzz_on BACKEND: a manager on a new database of BACKEND (sqlite or
# postgres), fuzzed as a user, then as the admin. Returns non-zero on any
# failure.
fuzz_on() {
    local backend=$1 dir="$work/$1" database status=0
    mkdir -p "$dir"
    case $backend in
        sqlite) database="sqlite://$dir/manager.db" ;;
        postgres)
            pg_dir="$dir/pg"
            database=$(bash "$repo/scripts/pg.sh" start "$pg_dir") || return 1
            ;;
        *)
            echo "fuzz-manager-api: no backend $backend (sqlite or postgres)" >&2
            return 1
            ;;
    esac
    # The admin token and the lease key, private as the manager insists.
    (
        umask 077
        head -c 32 /dev/urandom | base64 | tr -d '\n=+/' >"$dir/admin.token"
        "$bin/rfaas-token" keygen --key-id fuzz --secret "$dir/lease-key.secret" \
            --public "$dir/lease-key.pub" >/dev/null
    )
    local admin user node
    admin=$(cat "$dir/admin.token")
    cat >"$dir/manager.toml" <<TOML
listen = "127.0.0.1:0"
database = "$database"
admin_token_file = "$dir/admin.token"
lease_key_file = "$dir/lease-key.secret"
tls_cert = "$work/ca/server.pem"
tls_key = "$work/ca/server.key"
# The registered node must stay up through the run without heartbeats.
heartbeat_interval_ms = 1000
lost_after_ms = 3600000
# No Slurm here: the job routes take the caller's word for the job ids the
# fuzzer makes up (unsafe, and said so in the log), so they reach the
# store rather than stopping at 503 slurm_unavailable.
[slurm]
unchecked = true
TOML
    "$bin/rfaas-manager" --config "$dir/manager.toml" </dev/null \
        >"$dir/manager.out" 2>"$dir/manager.log" &
    manager_pid=$!
    url=$(await_line "$manager_pid" "$dir/manager.out" \
        's/^rfaas-manager listening on \(.*\)$/https:\/\/\1/p')
    if [ -z "$url" ]; then
        echo "fuzz-manager-api: rfaas-manager did not start on $backend; its log:" >&2
        cat "$dir/manager.log" >&2
        return 1
    fi
    echo "rfaas-manager (pid $manager_pid) on $url, $backend"

    user=$(call POST /v1/credentials "$admin" '{"role":"user","subject":"fuzz","account":"fuzz"}' | token_of)
    node=$(call POST /v1/credentials "$admin" '{"role":"node","subject":"fuzz-node"}' | token_of)
    call PUT /v1/nodes/fuzz-node "$node" \
        '{"control_addr":"127.0.0.1:7100","providers":[{"name":"tcp","host":"127.0.0.1"}],"cores":64,"memory_mib":65536,"version":"fuzz"}' >/dev/null
    # A lease the user's run can show, renew and release.
    call POST /v1/leases "$user" '{"cores":1,"memory_mib":64,"duration_s":600}' >/dev/null

    # The user first: the admin's run revokes the credentials it lists and
    # drains the nodes.
    local role token
    for role in user admin; do
        token=$admin
        [ "$role" = user ] && token=$user
        echo "== schemathesis $schemathesis_version on $backend as $role: $examples examples per operation, seed $seed"
        # From the work directory: schemathesis and hypothesis write there.
        (cd "$dir" && "$venv/bin/st" --config-file "$work/schemathesis.toml" run "$url/v1/openapi.json" \
            --checks "$checks" \
            --header "Authorization: Bearer $token" --tls-verify "$work/ca/ca.pem" \
            --max-examples "$examples" --seed "$seed" \
            --generation-database none --workers 1 --no-color \
            --report junit --report-dir "$dir/report-$role") || status=1
    done

    if ! kill -0 "$manager_pid" 2>/dev/null; then
        echo "fuzz-manager-api: FAILED: rfaas-manager died during the run on $backend" >&2
        status=1
    fi
    if grep -nE ' ERROR |panicked|database unavailable' "$dir/manager.log" >&2; then
        echo "fuzz-manager-api: FAILED: the manager on $backend logged the errors above" >&2
        status=1
    fi
    if [ "$status" -ne 0 ]; then
        echo "fuzz-manager-api: the manager's log tail ($backend):" >&2
        tail -n 40 "$dir/manager.log" >&2
    fi
    stop_fuzzed_manager
    stop_postgres
    return "$status"
}

start=$SECONDS
failed=()
for backend in $backends; do
    fuzz_on "$backend" || failed+=("$backend")
done
elapsed=$((SECONDS - start))
if [ ${#failed[@]} -ne 0 ]; then
    echo "fuzz-manager-api: FAILED on ${failed[*]} after $elapsed s (see above)" >&2
    exit 1
fi
echo "fuzz-manager-api: schemathesis $schemathesis_version, $examples examples per operation, as a user and the admin, on $backends: no failure ($elapsed s)"

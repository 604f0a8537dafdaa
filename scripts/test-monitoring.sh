#!/usr/bin/env bash
# Checks monitoring/: the alert rules (promtool check rules, promtool test
# rules, and a firing and a quiet case for every alert), then runs a small
# real system on loopback (rfaas-manager and rfaas-accounting on SQLite, one
# rfaas-executord registered with the manager, a client calling a function
# there) scraped by a real Prometheus with monitoring/prometheus-example.yml,
# and checks that every metric selector of the rules and every query of the
# Grafana dashboard returns series (monitoring/check.py), and that no alert is
# pending or firing on this healthy system. Last, that the check
# fails on a dashboard naming a metric no daemon exposes.
#
#   scripts/test-monitoring.sh
#
# Needs root (the executor daemon starts the worker as the lease's user,
# here nobody). Uses the workspace's debug build (CI_BUILD in lib.sh). Every
# process it starts is stopped by PID.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
root=$(repo_root)
cd "$root"

ensure_packages "${BUILD_PACKAGES[@]}" prometheus python3-yaml curl sqlite3
ensure_rust
mon="$root/monitoring"

echo "== promtool check rules, test rules (monitoring/rfaas-alerts*.yml)"
promtool check rules "$mon/rfaas-alerts.yml"
promtool test rules "$mon/rfaas-alerts.test.yml"
python3 "$mon/check.py" cases "$mon/rfaas-alerts.yml" "$mon/rfaas-alerts.test.yml"
# ... and that check fails when an alert lacks its quiet case.
quiet_less=$(mktemp "${TMPDIR:-/tmp}/rfaas-alerts-test.XXXXXX")
python3 - "$mon/rfaas-alerts.test.yml" "$quiet_less" <<'PY'
import sys, yaml
tests = yaml.safe_load(open(sys.argv[1]))
cases = tests["tests"][0]["alert_rule_test"]
tests["tests"][0]["alert_rule_test"] = [c for c in cases if c.get("exp_alerts")]
yaml.safe_dump(tests, open(sys.argv[2], "w"))
PY
if python3 "$mon/check.py" cases "$mon/rfaas-alerts.yml" "$quiet_less" 2>/dev/null; then
    rm -f "$quiet_less"
    echo "check.py passed alert tests where an alert has no case that stays quiet" >&2
    exit 1
fi
rm -f "$quiet_less"

echo "== building the daemons and the client (the CI build's features)"
cargo build -q "${CI_FEATURES[@]}" --bins --lib --example offload_loop
bin="${CARGO_TARGET_DIR:-$root/target}/debug"

work=$(mktemp -d "${TMPDIR:-/tmp}/rfaas-monitoring.XXXXXX")
NODE_PIDS=()
PROM_PID=""
cleanup() {
    local rc=$?
    stop_pid "$PROM_PID"
    stop_nodes
    stop_accounting
    stop_manager
    if [ "$rc" -ne 0 ]; then
        for log in "$work"/prometheus/prometheus.log "$work"/node1/executord.log \
            "$work"/manager/manager.log "$work"/accounting/accounting.log; do
            [ -s "$log" ] && { echo "---- last lines of $log" >&2; tail -n 20 "$log" >&2; }
        done
        loud "FAILED: scripts/test-monitoring.sh (exit code $rc). The output above says why."
    fi
    rm -rf "$work"
}
trap cleanup EXIT

free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

echo "== a small system: manager, accounting, one executor daemon"
start_manager "$bin" "$work"
start_accounting "$bin" "$work"
accounting_metrics=$(sed -n 's/^rfaas-accounting listening on .* metrics \([^ ]*\)$/\1/p' \
    "$ACCOUNTING_DIR/accounting.out")
executord_metrics="127.0.0.1:$(free_port)"
start_node "$bin" "$work" node1 0-1 "" "metrics_listen = \"$executord_metrics\""
node_up() {
    local nodes
    nodes=$("${RFAASCTL[@]}" nodes --json 2>/dev/null) || return 1
    [[ $nodes =~ \"state\":\ *\"up\" ]]
}
for _i in $(seq 300); do
    node_up && break
    sleep 0.1
done
node_up || { echo "rfaas-executord did not register with the manager within 30 s" >&2; exit 1; }

echo "== Prometheus with monitoring/prometheus-example.yml (intervals of 1 s)"
prom="$work/prometheus"
mkdir -p "$prom/data"
cp "$mon/rfaas-alerts.yml" "$prom/"
# The example's jobs and file_sd files, pointed at this system.
sed -e 's/^\(  scrape_interval:\).*/\1 1s/' -e 's/^\(  scrape_timeout:\).*/\1 900ms/' \
    -e 's/^\(  evaluation_interval:\).*/\1 1s/' \
    -e "s|ca_file: /etc/rfaas/ca.pem|ca_file: $RFAAS_CA_FILE|" \
    "$mon/prometheus-example.yml" >"$prom/prometheus.yml"
echo "[{\"targets\": [\"${MANAGER_URL#https://}\"]}]" >"$prom/rfaas-manager.json"
echo "[{\"targets\": [\"$accounting_metrics\"]}]" >"$prom/rfaas-accounting.json"
echo "[{\"targets\": [\"$executord_metrics\"]}]" >"$prom/rfaas-executord.json"
promtool check config "$prom/prometheus.yml"
prom_port=$(free_port)
prometheus --config.file="$prom/prometheus.yml" --storage.tsdb.path="$prom/data" \
    --web.listen-address="127.0.0.1:$prom_port" </dev/null >/dev/null 2>"$prom/prometheus.log" &
PROM_PID=$!
prom_url="http://127.0.0.1:$prom_port"

echo "== a client leases a core and calls a function (offload_loop, as nobody's jobs would)"
credential=$("${RFAASCTL[@]}" credential user nobody --account demo)
RFAAS_MANAGERS=$MANAGER_URL RFAAS_CREDENTIAL=$credential \
    timeout 120 "$bin/examples/offload_loop" --library "$bin/librfaas_example_functions.so" \
    --seconds 5 >"$work/client.out"
tail -n 1 "$work/client.out"

echo "== every target is up and scraped twice"
targets_up() {
    local answer
    answer=$(curl -fsS "$prom_url/api/v1/query" \
        --data-urlencode 'query=count(up == 1) >= 3 and min(count_over_time(up[1m])) >= 3') || return 1
    [[ $answer == *'"result":[{'* ]]
}
for _i in $(seq 600); do
    targets_up && break
    sleep 0.1
done
if ! targets_up; then
    echo "Prometheus did not scrape the three daemons within 60 s; its targets:" >&2
    curl -sS "$prom_url/api/v1/targets" >&2 || true
    exit 1
fi

echo "== every selector of the rules and every dashboard query returns series"
python3 "$mon/check.py" series "$prom_url" "$mon/rfaas-alerts.yml" "$mon/grafana/rfaas.json"

echo "== the healthy system fires no alert, pending or firing"
# Prometheus evaluated the rules on the scrapes above (evaluation every 1 s).
alerts=$(curl -fsS "$prom_url/api/v1/query" --data-urlencode 'query=ALERTS')
harvest=$(curl -fsS "$prom_url/api/v1/query" --data-urlencode 'query=rfaas:harvest_share')
echo "rfaas:harvest_share: $harvest"
if [[ $alerts != *'"result":[]'* ]]; then
    echo "alerts pending or firing on a healthy system (a rule that misreads a metric?): $alerts" >&2
    exit 1
fi

echo "== the check fails on a dashboard that names a metric no daemon exposes"
python3 - "$mon/grafana/rfaas.json" "$work/bad-dashboard.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
d["panels"][1]["targets"][0]["expr"] = "sum(rfaas_manager_no_such_metric_total)"
json.dump(d, open(sys.argv[2], "w"))
PY
if python3 "$mon/check.py" series "$prom_url" "$mon/rfaas-alerts.yml" "$work/bad-dashboard.json" \
    2>"$work/bad.err"; then
    echo "check.py passed a dashboard naming rfaas_manager_no_such_metric_total" >&2
    exit 1
fi
grep -q 'rfaas_manager_no_such_metric_total returns no series' "$work/bad.err" || {
    echo "check.py failed without naming the missing metric:" >&2
    cat "$work/bad.err" >&2
    exit 1
}
echo "monitoring: rules, tests and dashboard checked against a real scrape"

echo "== an online SQLite backup of the running system bills the same (docs/operations.md)"
# The accounting service writes a lease's final totals a few seconds after
# it ends: the bill is final once two reads agree.
for _i in $(seq 30); do
    "${BILLING[@]}" -S today --by user -P >"$work/bill-live.txt"
    sleep 2
    "${BILLING[@]}" -S today --by user -P | cmp -s - "$work/bill-live.txt" && break
done
sqlite3 "$MANAGER_DIR/manager.db" ".backup $work/backup.db"
"$bin/rfaas-billing" --database "sqlite://$work/backup.db" \
    --config "$ACCOUNTING_DIR/billing.toml" -S today --by user -P >"$work/bill-backup.txt"
diff "$work/bill-live.txt" "$work/bill-backup.txt" || {
    echo "the backup's bill differs from the live database's (above)" >&2
    exit 1
}
grep -q '^nobody|' "$work/bill-backup.txt" || {
    echo "the backup's bill has no row for the client's user nobody:" >&2
    cat "$work/bill-backup.txt" >&2
    exit 1
}
cat "$work/bill-backup.txt"

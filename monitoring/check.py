#!/usr/bin/env python3
"""Checks rfaas's alert rules and Grafana dashboard (scripts/test-monitoring.sh).

  check.py cases RULES TESTS
      every alert of RULES has, in the promtool tests TESTS, a case where it
      does not fire (exp_alerts: []) and one where it fires.
  check.py series PROMETHEUS_URL RULES DASHBOARD
      against a Prometheus scraping the running daemons: every metric
      selector in RULES and DASHBOARD returns at least one series, and so does
      every dashboard query (alert expressions that compare fire nothing on a
      healthy system, so for them only their selectors are asked).

Exits 1 naming each expression, selector and file that fails.
"""

import json
import re
import sys
import urllib.parse
import urllib.request

import yaml

# Grafana's variables, as the check runs the dashboard's queries.
GRAFANA_VARS = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "5m"}

KEYWORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool",
    "and", "or", "unless", "offset", "inf", "nan",
}


def alerts_and_rules(path):
    """(name or record, expr) of every rule in the rules file at `path`."""
    with open(path, encoding="utf-8") as f:
        doc = yaml.safe_load(f)
    return [
        (r.get("alert") or r.get("record"), r["expr"], "alert" in r)
        for g in doc["groups"]
        for r in g["rules"]
    ]


def dashboard_queries(path):
    """(panel title, expr) of every query of the dashboard at `path`."""
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    out = []

    def walk(panels):
        for p in panels:
            for t in p.get("targets", []):
                if t.get("expr"):
                    out.append((p.get("title", "?"), t["expr"]))
            walk(p.get("panels", []))

    walk(doc.get("panels", []))
    return out


def grafana_expand(expr):
    for var, value in GRAFANA_VARS.items():
        expr = expr.replace(var, value)
    return expr


def selectors(expr):
    """The vector selectors (`name{matchers}`) that `expr` names."""
    # Label lists of grouping and matching clauses are not metric names.
    text = re.sub(
        r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr
    )
    text = re.sub(r"\[[^\]]*\]", " ", text)  # range and subquery durations
    found = []
    pattern = r'([A-Za-z_:][A-Za-z0-9_:]*)\s*(\{(?:[^}"]|"(?:[^"\\]|\\.)*")*\})?(\s*\()?'
    for m in re.finditer(pattern, text):
        name, matchers, call = m.group(1), m.group(2) or "", m.group(3)
        start = m.start()
        if call or name.lower() in KEYWORDS:
            continue
        if start and (text[start - 1].isdigit() or text[start - 1] in ".\"'"):
            continue  # part of a number (1e-9) or a string
        found.append(name + matchers)
    return found


def query(url, expr):
    """The number of series the instant query `expr` returns."""
    full = url.rstrip("/") + "/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(full, timeout=30) as resp:
        body = json.load(resp)
    if body.get("status") != "success":
        raise RuntimeError(f"Prometheus refused the query {expr!r}: {body}")
    return len(body["data"]["result"])


def check_cases(rules_path, tests_path):
    with open(tests_path, encoding="utf-8") as f:
        tests = yaml.safe_load(f)
    fires, quiet = set(), set()
    for group in tests.get("tests", []):
        for case in group.get("alert_rule_test", []):
            (fires if case.get("exp_alerts") else quiet).add(case["alertname"])
    errors = []
    for name, _, is_alert in alerts_and_rules(rules_path):
        if not is_alert:
            continue
        if name not in fires:
            errors.append(f"alert {name} has no case in {tests_path} where it fires")
        if name not in quiet:
            errors.append(f"alert {name} has no case in {tests_path} where it does not fire")
    return errors


def check_series(url, rules_path, dashboard_path):
    errors = []
    asked = {}

    def series(expr):
        if expr not in asked:
            asked[expr] = query(url, expr)
        return asked[expr]

    for name, expr, is_alert in alerts_and_rules(rules_path):
        sels = selectors(expr)
        if not sels:
            errors.append(f"{rules_path}: rule {name}: no metric selector found in {expr!r}")
        for sel in sels:
            if series(sel) == 0:
                errors.append(
                    f"{rules_path}: rule {name}: the selector {sel} returns no series "
                    "from the scraped daemons (a metric or label value that does not exist?)"
                )
        if not is_alert and series(expr) == 0:
            errors.append(f"{rules_path}: recording rule {name}: {expr!r} returns no series")
    for title, raw in dashboard_queries(dashboard_path):
        expr = grafana_expand(raw)
        for sel in selectors(expr):
            if series(sel) == 0:
                errors.append(
                    f"{dashboard_path}: panel {title!r}: the selector {sel} returns no series "
                    "from the scraped daemons (a metric or label value that does not exist?)"
                )
        if series(expr) == 0:
            errors.append(f"{dashboard_path}: panel {title!r}: {raw!r} returns no series")
    print(f"asked Prometheus {len(asked)} expressions")
    return errors


def self_test():
    got = selectors(
        'sum by (instance, reason) (increase(rfaas_a_total{reason=~"x|y"}[15m])) '
        "/ clamp_min(max(rfaas:share), 1e-9) > 0.5 and on(job) up{job=\"m\"} == 0"
    )
    want = ['rfaas_a_total{reason=~"x|y"}', "rfaas:share", 'up{job="m"}']
    if got != want:
        sys.exit(f"check.py self-test: selectors() gave {got}, not {want}")


def main(argv):
    self_test()
    if len(argv) == 4 and argv[1] == "cases":
        errors = check_cases(argv[2], argv[3])
    elif len(argv) == 5 and argv[1] == "series":
        errors = check_series(argv[2], argv[3], argv[4])
    else:
        sys.exit(__doc__)
    for e in errors:
        print(f"FAILED: {e}", file=sys.stderr)
    if errors:
        return 1
    print("check.py: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

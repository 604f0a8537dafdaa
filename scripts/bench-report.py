#!/usr/bin/env python3
"""Renders the tables of docs/benchmarks.md from bench/results/.

Each table in the page sits between two markers:

    <!-- bench-report: VIEW KIND -->
    ...rendered...
    <!-- /bench-report -->

KIND names a family of results files, bench/results/DATE-HHMM-COMMIT-KIND[-N].jsonl
(HHMM the time of the run, UTC; N tells several runs of one commit and day
apart), and the table is rendered from the newest file of that family: the
latest date and time, then the higher N (no git history needed). VIEW says how:

    table           the bench's own table, as it prints it (stderr with --json)
    targets         every row with a target: its figure, bound and verdict
    fabric-targets  the fabric bench's targets, computed from its rows
    latency-ns      name and median in ns (rows below a microsecond)
    control         rfaas-control-bench's phases
    harvest         rfaas-harvest's runs with the plugin, against its targets
    harvest-slurmctld
                    rfaas-harvest's runs: the cluster, and slurmctld's RPC
                    rate without rfaas, with it, and what rfaas added
    fleet           rfaas-fleet's points, against their targets

    scripts/bench-report.py --check   fail, naming the table, if the page
                                      differs from what the results render
    scripts/bench-report.py --write   rewrite the tables in the page
    scripts/bench-report.py --self-test
                                      show that --check fails on a page with
                                      one figure changed, and passes on the
                                      page as committed

Standard library only (Debian's python3).
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "benchmarks.md")
RESULTS = os.path.join(ROOT, "bench", "results")
NAME = re.compile(r"^(\d{4}-\d{2}-\d{2})-(\d{4})-([0-9a-f]{7,40})-(.+?)(?:-(\d+))?\.jsonl$")
BLOCK = re.compile(
    r"(<!-- bench-report: ([\w-]+) ([\w-]+) -->\n)(.*?)(<!-- /bench-report -->)", re.S
)


class Failure(Exception):
    """What went wrong, as a sentence for whoever runs the script."""


def newest(kind, results):
    """The newest results file of `kind`: (file name, date, commit)."""
    found = []
    for name in os.listdir(results):
        m = NAME.match(name)
        if m and m.group(4) == kind:
            date, hhmm, commit, _, n = m.groups()
            found.append((date, hhmm, int(n or 1), name, commit))
    if not found:
        raise Failure(
            f"no results file of kind {kind!r} in {results}: save the bench's JSON "
            f"lines there as DATE-HHMM-COMMIT-{kind}.jsonl"
        )
    date, _, _, name, commit = max(found)
    return name, date, commit


def load(path):
    rows = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise Failure(f"{path}:{number} is not a JSON object ({e}); fix or remove that line")
    return rows


# Cells, as rfaas-bench's report.rs prints them.
def micros(ns):
    return f"{ns / 1000:.2f}"


def millis(ns):
    return f"{ns / 1e6:.3f}"


def rate(bps):
    return f"{bps / 1e9:.2f} GB/s" if bps >= 1e9 else f"{bps / 1e6:.1f} MB/s"


def calls(per_s):
    return f"{per_s / 1e6:.2f} M/s" if per_s >= 1e6 else f"{per_s / 1e3:.1f} k/s"


def size(b):
    if b >= 1 << 20 and b % (1 << 20) == 0:
        return f"{b >> 20} MiB"
    if b >= 1024 and b % 1024 == 0:
        return f"{b >> 10} KiB"
    return f"{b} B"


def fmt_bound(x):
    """A bound as Rust's `{}` prints an f64: 5.0 -> 5, 0.9 -> 0.9."""
    return f"{x:g}"


def verdict(row):
    met = row.get("meets_target")
    return {True: ": met", False: ": MISSED"}.get(met, "")


def rounds_note(row, difference=False):
    if "spread" in row:
        return f"{row['rounds']} rounds, worst/best {row['spread']:.2f}"
    if "median_round" in row or "rounds_met" in row:
        fig = (lambda f: f"{f / 1000:.2f} µs") if difference else (lambda f: f"x {f:.3f}")
        parts = []
        if "rounds_met" in row:
            parts.append(f"met in {row['rounds_met']} of {row['rounds']} rounds")
        if "median_round" in row:
            parts.append(f"median round {fig(row['median_round'])}")
        if "worst_round" in row:
            parts.append(f"worst round {fig(row['worst_round'])}")
        return ", ".join(parts)
    return None


def ratio_note(row):
    note = row["of"]
    if row.get("target_min") is not None:
        note += f", target >= {fmt_bound(row['target_min'])}"
    if row.get("target_max") is not None:
        note += f", target <= {fmt_bound(row['target_max'])}"
    return note


def with_note(line, row, note, difference=False):
    notes = [n for n in (note, rounds_note(row, difference)) if n]
    if notes:
        line += f"  ({'; '.join(notes)}{verdict(row)})"
    return line


def service_line(row):
    dash = "-"
    if "ratio" in row:
        median, p99, ops, note = dash, dash, f"x {row['ratio']:.2f}", ratio_note(row)
    else:
        notes = [f"offered_per_s {row['offered_per_s']}"] if "offered_per_s" in row else []
        if row.get("target_p99_max_ns") is not None:
            notes.append(f"target p99 <= {millis(row['target_p99_max_ns'])} ms")
        median = millis(row["median_ns"]) if "median_ns" in row else dash
        p99 = millis(row["p99_ns"]) if "p99_ns" in row else dash
        ops = str(row["ops_per_s"]) if "ops_per_s" in row else dash
        note = ", ".join(notes) or None
    line = (
        f"{row['name']:<28} {row['backend']:<9} {row['replicas']:>8} "
        f"{row['concurrency']:>7} {median:>11} {p99:>11} {ops:>10}"
    )
    return with_note(line, row, note)


def table_line(row):
    if "backend" in row:
        return service_line(row)
    dash = "-"
    median = p99 = bandwidth = dash
    note = None
    difference = False
    if "ratio" in row:
        bandwidth, note = f"x {row['ratio']:.2f}", ratio_note(row)
    elif "of" in row:
        difference = True
        median = micros(row["median_ns"])
        note = row["of"]
        if row.get("target_max_ns") is not None:
            note += f", target <= {micros(row['target_max_ns'])} µs"
    elif "bytes_per_s" in row:
        bandwidth = rate(row["bytes_per_s"])
    elif "per_s" in row:
        bandwidth = calls(row["per_s"])
    else:
        median = micros(row["median_ns"]) if "median_ns" in row else dash
        p99 = micros(row["p99_ns"]) if "p99_ns" in row else dash
    point = [f"{row['in_flight']} in flight"] if row.get("in_flight") else []
    point += [f"{k} {row[k]}" for k in ("initiators", "slots") if k in row]
    if point:
        note = "; ".join(n for n in (", ".join(point), note) if n)
    line = (
        f"{row['name']:<28} {row['provider']:<12} "
        f"{size(row['size']) if row.get('size') else dash:>9} {median:>12} {p99:>12} {bandwidth:>12}"
    )
    return with_note(line, row, note, difference)


def view_table(rows):
    service = any("backend" in r for r in rows)
    if service:
        head = (
            f"{'row':<28} {'backend':<9} {'replicas':>8} {'clients':>7} "
            f"{'median ms':>11} {'p99 ms':>11} {'ops/s':>10}"
        )
    else:
        head = (
            f"{'row':<28} {'provider':<12} {'size':>9} {'median µs':>12} "
            f"{'p99 µs':>12} {'bandwidth':>12}"
        )
    lines = [head] + [table_line(r) for r in rows if "name" in r]
    return "```text\n" + "\n".join(lines) + "\n```\n"


def point(row):
    if "backend" in row:
        return f"{row['backend']}, {row['replicas']} replicas, {row['concurrency']} clients"
    p = f"{row['provider']}" + (f" {size(row['size'])}" if row.get("size") else "")
    if row.get("in_flight"):
        p += f", {row['in_flight']} in flight"
    for k in ("initiators", "slots"):
        if k in row:
            p += f", {k} {row[k]}"
    return p


def view_targets(rows):
    out = ["| row | point | figure | target | over rounds | |", "|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("meets_target") is None:
            continue
        if "ratio" in r:
            figure = f"{r['ratio']:.2f} ({r['of']})"
            bounds = []
            if r.get("target_min") is not None:
                bounds.append(f"≥ {fmt_bound(r['target_min'])}")
            if r.get("target_max") is not None:
                bounds.append(f"≤ {fmt_bound(r['target_max'])}")
            target = ", ".join(bounds)
        elif "of" in r:
            figure = f"{r['median_ns'] / 1000:.2f} µs ({r['of']})"
            target = f"≤ {r['target_max_ns'] / 1000:g} µs"
        else:
            figure = f"p99 {millis(r['p99_ns'])} ms"
            target = f"p99 ≤ {r['target_p99_max_ns'] / 1e6:g} ms"
        over = rounds_note(r, "of" in r and "ratio" not in r) or ""
        if "round_range" in r:
            lo, hi = r["round_range"]
            over = ", ".join(x for x in (over, f"rounds {lo:.2f}-{hi:.2f}") if x)
        met = "met" if r["meets_target"] else "**missed**"
        out.append(f"| `{r['name']}` | {point(r)} | {figure} | {target} | {over} | {met} |")
    return "\n".join(out) + "\n"


# The fabric bench prints no derived rows: its targets, from its own rows.
FABRIC_TARGETS = [
    ("tcp round trip at 64 B", "pingpong", "raw_tcp_pingpong", "tcp", 64, "median_ns", 1.2, "max"),
    ("shm round trip at 64 B", "pingpong", "raw_shm_pingpong", "shm", 64, "median_ns", 3.0, "max"),
    ("tcp bandwidth at 1 MiB", "bandwidth", "raw_socket_bandwidth", "tcp", 1 << 20, "bytes_per_s", 0.9, "min"),
    ("shm bandwidth at 1 MiB", "bandwidth", "memcpy_bandwidth", "shm", 1 << 20, "bytes_per_s", 0.9, "min"),
]


def view_fabric_targets(rows):
    def find(name, provider, sz):
        for r in rows:
            if r["name"] == name and r["size"] == sz and r["provider"] in (provider, "mem"):
                return r
        raise Failure(f"the fabric results have no {name} row at {sz} B on {provider}")

    out = ["| target | fabric row | baseline row | ratio | |", "|---|---|---|---|---|"]
    for label, row, base, prov, sz, key, bound, kind in FABRIC_TARGETS:
        a, b = find(row, prov, sz), find(base, prov, sz)
        ratio = a[key] / b[key]
        if key == "median_ns":
            cells = f"`{row}` {prov} {micros(a[key])} µs | `{base}` {micros(b[key])} µs"
            fig, tgt = f"{ratio:.2f} ×", f"≤ {bound:g} ×"
        else:
            cells = f"`{row}` {prov} {rate(a[key])} | `{base}` {rate(b[key])}"
            fig, tgt = f"{ratio * 100:.0f} %", f"≥ {bound * 100:.0f} %"
            passive = find("bandwidth_passive", prov, sz)
            fig += f" ({passive[key] / b[key] * 100:.0f} % with a sleeping target)"
        met = ratio <= bound if kind == "max" else ratio >= bound
        out.append(f"| {label} {tgt} | {cells} | **{fig}** | {'met' if met else '**missed**'} |")
    return "\n".join(out) + "\n"


def view_latency_ns(rows):
    out = ["| row | provider | median ns |", "|---|---|---|"]
    out += [f"| `{r['name']}` | {r['provider']} | {r['median_ns']} |" for r in rows]
    return "\n".join(out) + "\n"


def view_control(rows):
    out = [
        "| connections (per address: idle, slow, stalled) | phase | median | p99 | rss | fds | threads |",
        "|---|---|---|---|---|---|---|",
    ]
    dash = "-"
    for r in rows:
        where = f"{r['connections']} ({r['addresses']} × {r['idle']}, {r['slow']}, {r['stalled']})"
        if "phase" not in r:
            out.append(f"| {where} | attacked / quiet | {r['ratio']:.2f} × | | | | |")
            continue
        ms = lambda k: f"{r[k] / 1000:.2f} ms" if k in r else dash
        rss = f"{r['rss_mib']} MiB" if "rss_mib" in r else dash
        out.append(
            f"| {where} | {r['phase']} | {ms('median_us')} | {ms('p99_us')} | {rss} | "
            f"{r.get('fds', dash)} | {r.get('threads', dash)} |"
        )
    return "\n".join(out) + "\n"


def view_harvest(rows):
    out = [
        "| seed, round | offered share (≥ 95 %) | registration p99 (≤ 1 s) | slowest start (≤ grace + 2 s) "
        "| added on idle nodes at p99 (≤ 100 ms) | invocations | |",
        "|---|---|---|---|---|---|---|",
    ]
    dash = "-"
    for r in rows:
        if not r.get("plugin"):
            continue
        ms = lambda k: f"{r[k] / 1e6:.1f} ms" if r.get(k) is not None else dash
        share = f"{r['offered_share'] * 100:.1f} %" if r.get("offered_share") is not None else dash
        slowest = f"{r['start_delay_max_ns'] / 1e9:.2f} s" if "start_delay_max_ns" in r else dash
        added = dash
        if r.get("added_idle_p99_ns") is not None:
            added = f"+{r['added_idle_p99_ns'] / 1e6:.1f} ms"
            if "idle_start_delay_p99_ns" in r:
                added += (
                    f" ({r['idle_start_delay_p99_ns'] / 1e6:.1f} against "
                    f"{r['idle_start_delay_p99_without_ns'] / 1e6:.1f} ms"
                    + (f", {r['idle_start_delays']} jobs)" if "idle_start_delays" in r else ")")
                )
        inv = f"{r['invocations']} ({r['client_moves']} moves)" if "invocations" in r else dash
        met = {True: "met", False: "**missed** " + ", ".join(r.get("missed", [])), None: ""}[
            r.get("meets_target")
        ]
        out.append(
            f"| {r['seed']}, {r.get('round', 1)} | {share} | {ms('registration_p99_ns')} | {slowest} "
            f"| {added} | {inv} | {met} |"
        )
    return "\n".join(out) + "\n"


def view_harvest_slurmctld(rows):
    out = [
        "| seed, round | nodes × CPUs | jobs | slurmctld RPCs/min without rfaas | with rfaas "
        "| rfaas added, per node and minute | its bound |",
        "|---|---|---|---|---|---|---|",
    ]
    dash = "-"
    without = {}
    for r in rows:
        key = (r.get("seed"), r.get("round", 1))
        rate = r.get("slurmctld_rpcs_per_min")
        if not r.get("plugin"):
            without[key] = rate
            continue
        fmt = lambda v: f"{v:.0f}" if v is not None else dash
        per_node = lambda k: f"{r[k]:.1f}" if r.get(k) is not None else dash
        out.append(
            f"| {r['seed']}, {r.get('round', 1)} | {r['nodes']} × {r['cpus']} | {r['jobs']} "
            f"| {fmt(without.get(key))} | {fmt(rate)} "
            f"| {per_node('rfaas_slurmctld_rpcs_per_node_min')} "
            f"| {per_node('rfaas_slurmctld_rpcs_bound_per_node_min')} |"
        )
    return "\n".join(out) + "\n"


def view_fleet(rows):
    out = [
        "| nodes | replicas | heartbeats/s | liveness statements /node/min (≤ 1 at 10 000) | other statements /node/min "
        "| replica CPU ms /node/min | grant p99 (≤ 2 × smallest at 10 000) | node_visible p99 "
        "| silent node lost after (≤ lost_after + interval) | lost in restart (0) | |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.get("name") != "fleet":
            continue
        met = "met" if r.get("meets_target") else "**missed** " + ", ".join(r.get("missed", []))
        out.append(
            f"| {r['nodes']} | {r['replicas']} | {r['heartbeats_per_s']:.0f} "
            f"| {r['db_statements_per_node_min']:.3f} | {r['db_other_statements_per_node_min']:.3f} "
            f"| {r['replica_cpu_ms_per_node_min']:.3f} "
            f"| {r['grant_p99_ns'] / 1e6:.1f} ms ({r['grant_p99_growth']:.2f} ×) "
            f"| {r['node_visible_p99_ns'] / 1e6:.1f} ms "
            f"| {r['lost_detect_ns'] / 1e9:.2f} s ({r['lost_detect_target_ns'] / 1e9:.2f} s) "
            f"| {r['lost_in_restart']} | {met} |"
        )
    return "\n".join(out) + "\n"


VIEWS = {
    "table": view_table,
    "targets": view_targets,
    "fabric-targets": view_fabric_targets,
    "latency-ns": view_latency_ns,
    "control": view_control,
    "harvest": view_harvest,
    "harvest-slurmctld": view_harvest_slurmctld,
    "fleet": view_fleet,
}


def render(view, kind, results):
    if view not in VIEWS:
        raise Failure(f"unknown view {view!r} in docs/benchmarks.md; the views are {', '.join(VIEWS)}")
    name, date, commit = newest(kind, results)
    rows = load(os.path.join(results, name))
    source = f"Measured at commit `{commit}` on {date}: [`{name}`](../bench/results/{name}).\n\n"
    return source + VIEWS[view](rows)


def rendered_page(text, results):
    def one(m):
        return m.group(1) + render(m.group(2), m.group(3), results) + m.group(5)

    return BLOCK.sub(one, text)


def check(doc, results):
    """The names of the tables in `doc` that differ from what `results` render."""
    with open(doc, encoding="utf-8") as f:
        text = f.read()
    stale = []
    for m in BLOCK.finditer(text):
        if m.group(4) != render(m.group(2), m.group(3), results):
            stale.append(f"{m.group(2)} {m.group(3)}")
    if not BLOCK.search(text):
        raise Failure(f"{doc} has no <!-- bench-report: VIEW KIND --> table to check")
    return stale


def self_test(doc, results):
    """--check fails on a page with one figure changed, passes on the real one."""
    with open(doc, encoding="utf-8") as f:
        text = f.read()
    m = BLOCK.search(text)
    body = m.group(4)
    digit = re.search(r"\d", body)
    broken_body = body[: digit.start()] + str((int(digit.group()) + 1) % 10) + body[digit.end():]
    broken = text[: m.start(4)] + broken_body + text[m.end(4):]
    with tempfile.NamedTemporaryFile("w", suffix=".md", delete=False, encoding="utf-8") as f:
        f.write(broken)
    try:
        stale = check(f.name, results)
    finally:
        os.unlink(f.name)
    if stale != [f"{m.group(2)} {m.group(3)}"]:
        raise Failure(f"--check did not catch a changed figure in the first table (it said {stale})")
    if check(doc, results):
        raise Failure(f"--check fails on {doc} as it is; run --write and commit the result")
    print("bench-report self-test: a changed figure is caught, the page as committed passes")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true")
    mode.add_argument("--write", action="store_true")
    mode.add_argument("--self-test", action="store_true")
    p.add_argument("--doc", default=DOC)
    p.add_argument("--results", default=RESULTS)
    a = p.parse_args()
    try:
        if a.write:
            with open(a.doc, encoding="utf-8") as f:
                text = f.read()
            with open(a.doc, "w", encoding="utf-8") as f:
                f.write(rendered_page(text, a.results))
        elif a.self_test:
            self_test(a.doc, a.results)
        else:
            stale = check(a.doc, a.results)
            if stale:
                raise Failure(
                    f"{a.doc} differs from what bench/results renders in the table(s): "
                    f"{'; '.join(stale)}. Run scripts/bench-report.py --write and commit the page"
                )
    except Failure as e:
        print(f"bench-report: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

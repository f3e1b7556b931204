#!/usr/bin/env python3
"""Turns the JSON reports of the bench/ scripts into Markdown for docs/benchmarks.md.

Usage: python3 bench/report.py [--results DIR] > summary.md

DIR (default bench/results, or bench/results-quick when BENCH_QUICK=1) holds one directory
per mode (dev, distributed-1gw, distributed-2gw), each with run.json, machine.json and
<scenario>-<clients>.json files written by bench/matrix.sh. Prints the machine, the
commands, one section per scenario (throughput and latency by mode and clients, then the
cost of each run: CPU of the broker, NATS and PostgreSQL, memory, the load generator) and
how the cost grows with clients and with gateways.
"""

import argparse
import glob
import json
import os
import re
import shlex
import sys

SCENARIOS = [
    ("tasks", "tasks: UFO TASK frames from constellations, K = 1 command, run by the bench's devices"),
    ("rest", "rest: the same tasks via POST /api/tasks, followed by polling GET /api/tasks/{id}"),
    ("heartbeat", "heartbeat: closed-loop heartbeat round trips"),
    ("devinfo", "devinfo: constellations' device-info requests"),
    ("register", "register: connect, REGISTER, confirmation, close"),
    ("connect", "connect: idle registered devices set up and held"),
]
MODE_ORDER = ["dev", "distributed-1gw", "distributed-2gw"]
MODE_NAMES = {
    "dev": "embedded (`aip dev`)",
    "distributed-1gw": "distributed, 1 gateway",
    "distributed-2gw": "distributed, 2 gateways",
}


def load(path):
    with open(path) as f:
        return json.load(f)


def mode_name(mode):
    return MODE_NAMES.get(mode, mode)


def rate(v):
    if v is None:
        return "-"
    if v >= 100:
        return f"{v:,.0f}"
    return f"{v:.1f}"


def ms(v):
    if v is None:
        return "-"
    if v >= 100:
        return f"{v:.0f}"
    if v >= 10:
        return f"{v:.1f}"
    return f"{v:.2f}"


def mib(kb):
    return "-" if kb is None else f"{kb / 1024:.0f} MiB"


def pct(v):
    return "-" if v is None else f"{v:.0f} %"


def per_op_text(v):
    if v is None:
        return "-"
    return f"{v:.2f}" if v >= 1 else f"{v:.3f}"


def kind(proc):
    name = proc.get("name") or ""
    if name.startswith("aip"):
        return "aip"
    if name.startswith("nats"):
        return "nats"
    if name.startswith("postgres"):
        return "postgres"
    return "other"


class Run:
    """One cell: a scenario at some clients in some mode."""

    def __init__(self, report, clients):
        self.r = report
        self.clients = clients
        self.meta = report.get("bench_script", {})
        lats = report.get("latencies") or []
        self.lat = lats[0] if lats else None

    def cpu(self, k):
        procs = [p for p in self.r.get("broker", []) if kind(p) == k]
        if not procs:
            return None
        return sum(p["cpu_percent"] for p in procs)

    def cpu_secs(self, k=None):
        return sum(p["cpu_secs"] for p in self.r.get("broker", []) if k is None or kind(p) == k)

    def rss_end_kb(self, k="aip"):
        vals = [p.get("rss_after_kb") for p in self.r.get("broker", []) if kind(p) == k]
        vals = [v for v in vals if v is not None]
        return sum(vals) if vals else None

    def rss_per_connection_kib(self):
        """Growth of the broker's own RSS (aip processes: not NATS, not PostgreSQL) over the
        window, per connected device."""
        c = self.r.get("connect") or {}
        procs = [p for p in self.r.get("broker", []) if kind(p) == "aip"]
        if not c.get("connected") or not procs or any(
                p.get("rss_before_kb") is None or p.get("rss_after_kb") is None for p in procs):
            return None
        return sum(p["rss_after_kb"] - p["rss_before_kb"] for p in procs) / c["connected"]

    def cpu_ms_per_op(self, k=None):
        done = self.r.get("completed") or 0
        if not done or not self.r.get("broker"):
            return None
        return 1000.0 * self.cpu_secs(k) / done

    def marks(self):
        m = ""
        if self.r.get("failures"):
            m += "‡"
        if any("load generator itself" in n for n in self.r.get("notes", [])):
            m += "†"
        return m


def load_results(root):
    modes = {}
    for mode_dir in sorted(glob.glob(os.path.join(root, "*"))):
        if not os.path.isdir(mode_dir):
            continue
        mode = os.path.basename(mode_dir)
        runs = {}
        for path in glob.glob(os.path.join(mode_dir, "*.json")):
            m = re.fullmatch(r"([a-z]+)-(\d+)\.json", os.path.basename(path))
            if not m:
                continue
            try:
                runs[(m.group(1), int(m.group(2)))] = Run(load(path), int(m.group(2)))
            except (OSError, ValueError, KeyError) as e:
                print(f"report.py: skipping {path}: {e}", file=sys.stderr)
        run_info = {}
        if os.path.exists(os.path.join(mode_dir, "run.json")):
            run_info = load(os.path.join(mode_dir, "run.json"))
        machine = {}
        if os.path.exists(os.path.join(mode_dir, "machine.json")):
            machine = load(os.path.join(mode_dir, "machine.json"))
        failed = []
        if os.path.exists(os.path.join(mode_dir, "failed-runs.txt")):
            with open(os.path.join(mode_dir, "failed-runs.txt")) as f:
                failed = [line.strip() for line in f if line.strip()]
        # A directory of another script (a soak, a comparison) holds no scenario run: it is
        # not a mode of the matrix, and its machine (another day's) must not name this one's.
        if runs or (run_info and mode in MODE_ORDER):
            modes[mode] = {"runs": runs, "run": run_info, "machine": machine, "failed": failed}
    order = [m for m in MODE_ORDER if m in modes] + sorted(m for m in modes if m not in MODE_ORDER)
    return order, modes


def table(headers, rows, align=None):
    align = align or ["l"] + ["r"] * (len(headers) - 1)
    out = ["| " + " | ".join(headers) + " |",
           "|" + "|".join(" --- " if a == "l" else " ---: " for a in align) + "|"]
    for row in rows:
        out.append("| " + " | ".join(str(c) for c in row) + " |")
    return "\n".join(out)


def shell_line(argv, repo, pid_names=None):
    """A command as a shell line, with paths shortened to the repository's. With pid_names
    (pid -> process name), the run of `--server-pid N` options is shortened to one
    `--server-pid …` saying which processes they were."""
    words, pids = [], []
    i = 0
    while i < len(argv):
        w = argv[i]
        if pid_names is not None and w == "--server-pid" and i + 1 < len(argv):
            pids.append(argv[i + 1])
            i += 2
            continue
        if repo and w.startswith(repo + "/"):
            w = w[len(repo) + 1:]
        words.append(shlex.quote(w))
        i += 1
    if pids:
        counts = {}
        for p in pids:
            name = pid_names.get(int(p), "?") if p.isdigit() else "?"
            counts[name] = counts.get(name, 0) + 1
        what = ", ".join(f"{n}" if c == 1 else f"{c} × {n}" for n, c in counts.items())
        words.append(f"--server-pid …  # {len(pids)} pid{'' if len(pids) == 1 else 's'}: {what}")
    return " ".join(words)


def machine_section(order, modes):
    machine = {}
    for mode in order:
        m = modes[mode]["machine"]
        if m and (not machine or m.get("nats_version")):
            machine = m
    if not machine:
        return "## Machine\n\n(no machine.json found)\n"
    commits = {modes[m]["machine"].get("git_commit") for m in order if modes[m]["machine"]}
    rows = [
        ("CPU", f"{machine.get('cores')} cores, {machine.get('cpu_model')}"),
        ("memory", f"{machine.get('memory_gib')} GiB"),
        ("kernel / OS", f"{machine.get('kernel')} / {machine.get('os')}"),
        ("NATS", machine.get("nats_version") or "-"),
        ("PostgreSQL", machine.get("postgres_version") or "-"),
        ("rustc", machine.get("rustc") or "-"),
        ("commit", ", ".join(sorted(f"`{c[:12]}`" for c in commits if c))
         + (" (with uncommitted changes)" if any(modes[m]["machine"].get("git_dirty")
                                                  for m in order) else "")),
        ("recorded", ", ".join(f"{mode}: {modes[mode]['machine'].get('recorded_at', '?')}"
                               for mode in order if modes[mode]["machine"])),
    ]
    return "## Machine\n\n" + table(["", ""], rows, ["l", "l"]) + \
        "\n\nThe broker, NATS, PostgreSQL and the load generator (`aip bench`) share this machine.\n"


def method_section(order, modes, repo):
    out = ["## Method and commands", ""]
    out.append(
        "- Release build: `cargo build --release -p aip -p aip-gateway -p aip-registry -p aip-sessions`; "
        "all runs: `bench/run-all.sh` (one mode: `bench/dev.sh`, `bench/distributed.sh --gateways 1|2`).")
    out.append(
        "- Runs are time-bounded: each scenario is asked for far more operations than it can do "
        "and `--max-seconds` ends it (so `stopped_early` in the JSON is expected). `window` is the "
        "measured phase, after every client is set up. Latencies are from `aip bench`'s HDR histograms.")
    out.append(
        "- CPU % is of one core (200 % = both cores of a 2-core machine), over the measured window, "
        "from /proc for the processes passed with `--server-pid`: the broker's (`aip`), "
        "`nats-server`, and the PostgreSQL postmaster, its background writers and the backends "
        "connected to the run's database (after a warm-up, so the pools are open). "
        "CPU ms/op = CPU seconds of all of them over the window / operations completed.")
    out.append(
        "- With 2 gateways each run is one `aip bench` process given both URLs (`--url` twice): "
        "it spreads its clients over the gateways round robin, and in `devinfo` and `tasks` "
        "every constellation is on the other gateway than the device it drives, so every "
        "request crosses from one gateway to the other (also with 1 client: its device is on "
        "the first gateway, the constellation on the second).")
    out.append("- ‡: the run had failures (see the JSON). †: the load generator used ≥ 40 % "
               "of the machine's CPU, so the figure may be the generator's limit.")
    out.append("")
    for mode in order:
        info = modes[mode]["run"]
        out.append(f"**{mode_name(mode)}** ({info.get('description', mode)}):")
        out.append("")
        out.append("```sh")
        for cmd in info.get("broker_commands", []):
            out.append(shell_line(cmd, repo))
        out.append("```")
        out.append("")
    return "\n".join(out)


def commands_details(order, modes, scenario, repo):
    lines = []
    for mode in order:
        for (s, n), run in sorted(modes[mode]["runs"].items(), key=lambda kv: kv[0][1]):
            if s != scenario:
                continue
            names = {p["pid"]: p.get("name") or "?" for p in run.r.get("broker", [])}
            for cmd in run.meta.get("commands", []):
                lines.append(f"# {mode}, {n}\n{shell_line(cmd, repo, names)}")
    if not lines:
        return ""
    return ("<details><summary>exact commands</summary>\n\n```sh\n" + "\n".join(lines)
            + "\n```\n\n</details>\n")


def scenario_section(order, modes, scenario, title, repo):
    cells = {(mode, n): run for mode in order for (s, n), run in modes[mode]["runs"].items()
             if s == scenario}
    if not cells:
        return None
    counts = sorted({n for (_, n) in cells})
    present = [m for m in order if any((m, n) in cells for n in counts)]
    unit = next(iter(cells.values())).r.get("unit", "ops")
    out = [f"### {title}", ""]
    what = "devices" if scenario == "connect" else "clients"

    if scenario == "connect":
        headers = ["mode"] + [f"{n:,} devices" for n in counts]
        rows = []
        for mode in present:
            row = [mode_name(mode)]
            for n in counts:
                run = cells.get((mode, n))
                if not run:
                    row.append("-")
                    continue
                c = run.r.get("connect") or {}
                rss = run.rss_per_connection_kib()
                row.append(f"{rate(c.get('setup_per_sec'))}/s; "
                           f"{'-' if rss is None else f'{rss:.1f} KiB'}/conn{run.marks()}")
            rows.append(row)
        out.append("Setup rate (connections registered per second) and growth of the broker's "
                   "RSS (its own processes, not NATS or PostgreSQL) per held connection:")
        out.append("")
        out.append(table(headers, rows))
        out.append("")
        headers = ["mode", "devices", "connected", "drops", "register p50 / p99 ms", "setup s",
                   "held s", "aip CPU", "NATS CPU", "PG CPU", "aip RSS end", "generator CPU"]
        rows = []
        for mode in present:
            for n in counts:
                run = cells.get((mode, n))
                if not run:
                    continue
                c = run.r.get("connect") or {}
                lat = run.lat or {}
                rows.append([mode_name(mode), f"{n:,}", f"{c.get('connected', 0):,}{run.marks()}",
                             c.get("drops", 0),
                             f"{ms(lat.get('p50_ms'))} / {ms(lat.get('p99_ms'))}",
                             f"{c.get('setup_secs', 0):.1f}", f"{c.get('held_secs', 0):.1f}",
                             pct(run.cpu("aip")), pct(run.cpu("nats")), pct(run.cpu("postgres")),
                             mib(run.rss_end_kb()), pct(run.r["generator"]["cpu_percent"])])
        out.append(table(headers, rows))
    else:
        headers = ["mode"] + [f"{n} {what[:-1] if n == 1 else what}" for n in counts]
        rows = []
        for mode in present:
            row = [mode_name(mode)]
            for n in counts:
                run = cells.get((mode, n))
                if not run:
                    row.append("-")
                    continue
                lat = run.lat or {}
                row.append(f"**{rate(run.r['throughput_per_sec'])}**/s; "
                           f"{ms(lat.get('p50_ms'))} / {ms(lat.get('p99_ms'))} ms{run.marks()}")
            rows.append(row)
        out.append(f"{unit} per second; p50 / p99 latency "
                   f"({(next(iter(cells.values())).lat or {}).get('name', '')}):")
        out.append("")
        out.append(table(headers, rows))
        out.append("")
        headers = ["mode", what, f"{unit}/s", "p50", "p90", "p99", "p99.9", "done", "failures",
                   "window s", "aip CPU", "NATS CPU", "PG CPU", "CPU ms/op", "aip RSS end",
                   "generator CPU"]
        if scenario in ("tasks", "rest"):
            headers.append("event logs ok")
        rows = []
        for mode in present:
            for n in counts:
                run = cells.get((mode, n))
                if not run:
                    continue
                lat = run.lat or {}
                per_op = run.cpu_ms_per_op()
                row = [mode_name(mode), n, rate(run.r["throughput_per_sec"]) + run.marks(),
                       ms(lat.get("p50_ms")), ms(lat.get("p90_ms")), ms(lat.get("p99_ms")),
                       ms(lat.get("p999_ms")), f"{run.r['completed']:,}", run.r["failures"],
                       f"{run.r['window_secs']:.1f}", pct(run.cpu("aip")), pct(run.cpu("nats")),
                       pct(run.cpu("postgres")),
                       per_op_text(per_op),
                       mib(run.rss_end_kb()), pct(run.r["generator"]["cpu_percent"])]
                if scenario in ("tasks", "rest"):
                    v = run.r.get("verification")
                    row.append("-" if not v else
                               f"{v.get('complete', 0):,} of {v.get('checked', 0):,}"
                               + (f" ({v['not_checked']:,} not checked)" if v.get("not_checked") else ""))
                rows.append(row)
        out.append(table(headers, rows))
    out.append("")
    problems = []
    for (mode, n), run in sorted(cells.items()):
        for f in run.r.get("failure_reasons", [])[:3]:
            problems.append(f"{mode_name(mode)}, {n} {what}: {f['count']} × {f['reason']}")
        v = run.r.get("verification") or {}
        for p in v.get("problems", [])[:3]:
            problems.append(f"{mode_name(mode)}, {n} {what}: event log: {p}")
    if problems:
        out.append("Failures:")
        out.append("")
        out.extend(f"- {p}" for p in problems)
        out.append("")
    details = commands_details(order, modes, scenario, repo)
    if details:
        out.append(details)
    return "\n".join(out)


def ratio(a, b):
    if a is None or b is None or not b:
        return "-"
    return f"×{a / b:.2f}"


def growth_section(order, modes):
    out = ["## How the cost grows", ""]
    # With clients.
    rows = []
    for scenario, _ in SCENARIOS:
        if scenario == "connect":
            continue
        for mode in order:
            runs = {n: r for (s, n), r in modes[mode]["runs"].items() if s == scenario}
            if not runs:
                continue
            ns = sorted(runs)
            base = runs[ns[0]]
            cells = []
            for n in ns:
                r = runs[n]
                per_op = r.cpu_ms_per_op()
                lat = r.lat or {}
                cells.append(f"{n}: {rate(r.r['throughput_per_sec'])}/s "
                             f"({ratio(r.r['throughput_per_sec'], base.r['throughput_per_sec'])}), "
                             f"p99 {ms(lat.get('p99_ms'))} ms, "
                             f"{per_op_text(per_op)} CPU ms/op")
            rows.append([scenario, mode_name(mode), "<br>".join(cells)])
    if rows:
        out.append("**With clients.** Throughput (and its ratio to the fewest clients), p99 "
                   "latency and the CPU (broker + NATS + PostgreSQL) per operation:")
        out.append("")
        out.append(table(["scenario", "mode", "clients: throughput, p99, CPU per op"], rows,
                         ["l", "l", "l"]))
        out.append("")
    # Connect: memory per connection.
    rows = []
    for mode in order:
        runs = {n: r for (s, n), r in modes[mode]["runs"].items() if s == "connect"}
        if runs:
            cells = []
            for n in sorted(runs):
                rss = runs[n].rss_per_connection_kib()
                cells.append(f"{n:,}: {'-' if rss is None else f'{rss:.1f} KiB'}")
            rows.append([mode_name(mode), ", ".join(cells)])
    if rows:
        out.append("**Memory per connection** (growth of the broker's own RSS from before the "
                   "first connect to the end of the hold, per device):")
        out.append("")
        out.append(table(["mode", "devices: RSS per connection"], rows, ["l", "l"]))
        out.append("")
    # With gateways.
    if "distributed-1gw" in modes and "distributed-2gw" in modes:
        one, two = modes["distributed-1gw"]["runs"], modes["distributed-2gw"]["runs"]
        rows = []
        for scenario, _ in SCENARIOS:
            for (s, n) in sorted(k for k in one if k[0] == scenario):
                if (s, n) not in two:
                    continue
                a, b = one[(s, n)], two[(s, n)]
                pa, pb = a.cpu_ms_per_op(), b.cpu_ms_per_op()
                la, lb = a.lat or {}, b.lat or {}
                rows.append([scenario, n, rate(a.r["throughput_per_sec"]),
                             rate(b.r["throughput_per_sec"]),
                             ratio(b.r["throughput_per_sec"], a.r["throughput_per_sec"]),
                             f"{ms(la.get('p99_ms'))} → {ms(lb.get('p99_ms'))}",
                             f"{per_op_text(pa)} → {per_op_text(pb)}",
                             f"{pct(a.cpu('aip'))} → {pct(b.cpu('aip'))}"])
        if rows:
            out.append("**With gateways** (distributed, 1 → 2 gateways, same clients; on 2 cores "
                       "a second gateway adds a process, not a core):")
            out.append("")
            out.append(table(["scenario", "clients", "1 gw /s", "2 gw /s", "2 gw / 1 gw",
                              "p99 ms", "CPU ms/op", "aip CPU"], rows))
            out.append("")
    return "\n".join(out)


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    default = os.path.join(here, "results-quick" if os.environ.get("BENCH_QUICK") == "1"
                           else "results")
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", default=default, help=f"results directory (default {default})")
    args = parser.parse_args()
    if not os.path.isdir(args.results):
        sys.exit(f"report.py: no results in {args.results}: run bench/run-all.sh (or "
                 "bench/dev.sh, bench/distributed.sh) first")
    order, modes = load_results(args.results)
    if not order:
        sys.exit(f"report.py: {args.results} holds no mode directories with results")
    repo = os.path.dirname(here)

    print("# Benchmark results")
    print()
    print("Generated by `bench/report.py` from `" + os.path.relpath(args.results, repo) + "`.")
    print()
    print(machine_section(order, modes))
    print(method_section(order, modes, repo))
    failed = [(m, f) for m in order for f in modes[m]["failed"]]
    if failed:
        print("**Runs that failed** (no figures): "
              + ", ".join(f"{mode_name(m)} {f}" for m, f in failed))
        print()
    print("## Scenarios")
    print()
    for scenario, title in SCENARIOS:
        section = scenario_section(order, modes, scenario, title, repo)
        if section:
            print(section)
    print(growth_section(order, modes))


if __name__ == "__main__":
    try:
        main()
    except BrokenPipeError:
        sys.stderr.close()

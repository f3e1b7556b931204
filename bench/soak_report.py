#!/usr/bin/env python3
"""Report of a bench/soak.sh run: soak.md (table and verdict) and soak.png (plot).

Usage: bench/soak_report.py RESULTS_DIR

Verdict, as issue 14 asks:
- RSS flat within 10 %: for each process, the highest RSS of the last half of the soak is at
  most 10 % above the median of its first quarter after warm-up (the first 5 minutes, when
  pools, caches and allocator arenas fill, are left out of the reference);
- latency stable: the median of the windows' p50 and p99 in the last quarter is within 25 %
  (p50) and 50 % (p99) of the first quarter's, and no window failed a task.
"""
import json
import pathlib
import statistics
import sys

WARM_UP_SECS = 300


def load(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def task_latency(report):
    for lat in report.get("latencies", []):
        if lat["name"].startswith("task"):
            return lat
    return None


def main():
    out = pathlib.Path(sys.argv[1])
    run = json.loads((out / "run.json").read_text())
    windows = [w for w in load(out / "windows.jsonl") if "error" not in w["report"]]
    samples = load(out / "rss.jsonl")
    names = run["processes"]
    duration = samples[-1]["t"] if samples else 0

    rows = []
    for w in windows:
        r = w["report"]
        lat = task_latency(r) or {}
        rows.append({
            "t": w["t_end"], "rate": r["throughput_per_sec"], "completed": r["completed"],
            "failures": r["failures"], "p50": lat.get("p50_ms"), "p99": lat.get("p99_ms"),
            "max": lat.get("max_ms"),
        })

    verdicts = []
    rss_lines = []
    for name in names:
        series = [(s["t"], s[name]["rss_kib"]) for s in samples if s.get(name)]
        ref = [v for t, v in series if WARM_UP_SECS <= t <= max(WARM_UP_SECS, duration / 4)]
        late = [v for t, v in series if t >= duration / 2]
        if not ref or not late:
            verdicts.append(f"{name}: too few samples")
            continue
        base, peak, end = statistics.median(ref), max(late), series[-1][1]
        growth = (peak - base) / base * 100
        ok = growth <= 10
        verdicts.append(f"{name} RSS: {'flat' if ok else 'GROWS'} ({growth:+.1f} % peak of the "
                        f"last half against the first quarter's median)")
        rss_lines.append(f"| {name} | {base / 1024:.1f} | {peak / 1024:.1f} | {end / 1024:.1f} | "
                         f"{growth:+.1f} % | {'✅' if ok else '❌'} |")

    def median_of(key, lo, hi):
        vals = [r[key] for r in rows if r[key] is not None and lo <= r["t"] <= hi]
        return statistics.median(vals) if vals else None

    q1 = (0, duration / 4)
    q4 = (duration * 3 / 4, duration + 1)
    lat_lines = []
    for key, tolerance in (("p50", 25), ("p99", 50)):
        a, b = median_of(key, *q1), median_of(key, *q4)
        if a is None or b is None:
            verdicts.append(f"{key}: too few windows")
            continue
        change = (b - a) / a * 100
        ok = abs(change) <= tolerance
        verdicts.append(f"task {key}: {'stable' if ok else 'DRIFTS'} ({a:.2f} ms → {b:.2f} ms, "
                        f"{change:+.1f} %, tolerance ±{tolerance} %)")
        lat_lines.append(f"| {key} | {a:.2f} | {b:.2f} | {change:+.1f} % | {'✅' if ok else '❌'} |")
    failures = sum(r["failures"] for r in rows)
    completed = sum(r["completed"] for r in rows)
    rates = [r["rate"] for r in rows]

    md = [
        f"# Soak: {duration / 60:.0f} minutes at about half the peak task rate",
        "",
        f"Peak (100 constellations, closed loop, K = 1): {run['peak_tasks_per_sec']:.0f} tasks/s. "
        f"Soak load: {run['clients']} constellations, closed loop, in windows of "
        f"{run['window_secs']} s.",
        "",
        f"Tasks completed: {completed:,}; failed: {failures:,}; rate per window: "
        f"median {statistics.median(rates):.0f}/s, min {min(rates):.0f}/s, "
        f"max {max(rates):.0f}/s." if rates else "No window completed.",
        "",
        "| process | RSS MiB, first quarter (median, after 5 min) | RSS MiB, last half (max) | "
        "RSS MiB, end | growth | flat within 10 % |",
        "|---|---|---|---|---|---|",
        *rss_lines,
        "",
        "| task latency | first quarter (median of windows), ms | last quarter, ms | change | stable |",
        "|---|---|---|---|---|",
        *lat_lines,
        "",
        "Verdict:",
        *[f"- {v}" for v in verdicts],
        f"- failed tasks: {failures}",
        "",
    ]
    (out / "soak.md").write_text("\n".join(md))
    print("\n".join(md))

    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)", file=sys.stderr)
        return
    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(10, 10), sharex=True)
    for name in names:
        series = [(s["t"] / 60, s[name]["rss_kib"] / 1024) for s in samples if s.get(name)]
        ax1.plot([t for t, _ in series], [v for _, v in series], label=name)
    ax1.set_ylabel("RSS (MiB)")
    ax1.set_ylim(bottom=0)
    ax1.legend(loc="upper left")
    ax1.set_title("aip soak: RSS, task latency and rate per window")
    ts = [r["t"] / 60 for r in rows]
    ax2.plot(ts, [r["p50"] for r in rows], label="p50")
    ax2.plot(ts, [r["p99"] for r in rows], label="p99")
    ax2.set_ylabel("task latency (ms)")
    ax2.set_ylim(bottom=0)
    ax2.legend(loc="upper left")
    ax3.plot(ts, [r["rate"] for r in rows], label="tasks/s")
    ax3.set_ylabel("tasks/s")
    ax3.set_ylim(bottom=0)
    ax3.set_xlabel("minutes")
    fig.tight_layout()
    fig.savefig(out / "soak.png", dpi=80)


if __name__ == "__main__":
    main()

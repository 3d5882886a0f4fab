"""How each control-plane path's cost grows with the fleet: time and memory at each size, and where it crosses
its limit.

    python bench/scale.py [--quick] [--trials 3] [--trials-for AREA=N,..] [--only AREA[,AREA]] [--out FILE]
                          [--chart PNG]

Each area is a module ``bench/scale_<area>.py`` with ``CASES``: metric name -> (prepare, sizes). For every
size, every trial runs in a fresh interpreter (so one case's caches and heap never help or burden another):
``prepare(size)`` builds the synthetic input (a fleet's stacks documents, an inventory, an alert storm on the
bus ...) untimed, then the path runs once, timed; the peak resident memory before and after it is read from
the kernel (``ru_maxrss``), so ``extra_mb`` is what the path itself added at its peak.

Metrics: ``<metric>.<size>`` (seconds: median, p90 over the trials), with ``peak_mb`` and ``extra_mb`` (the
median over the trials); a metric with a limit carries it as ``target``, and ``limits`` in the setup says, per
metric, the first size whose median crossed its limit, or that none did up to the largest size run.
``--quick`` runs one trial of the smaller sizes only (a check that every case still runs).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import summarize, write_result  # noqa: E402

#: Each metric's limit (seconds) at the sizes the limit is stated for (the issue's targets); a limit given
#: for "*" applies at every size.
LIMITS: dict[str, dict[str, float]] = {
    "stack_analysis_s": {"100000": 2.0},
    "slow_vote_s": {"100000": 2.0},
    "restart_plan_s": {"12500": 0.5},
    "topology_setup_s": {"100000": 1.0},
    "ettr_report_s": {"90": 30.0},
    "alert_storm_open_s": {"100000": 3.0},
}
#: Memory limits (MB of peak resident memory of the run) where one is stated.
MEMORY_LIMITS_MB: dict[str, dict[str, float]] = {"stack_analysis_s": {"100000": 1024.0}}
#: Sizes named by what they stand for in the metric's key (90 days of steps is "3months").
SIZE_NAMES: dict[str, dict[str, str]] = {"ettr_report_s": {"1": "1day", "7": "7days", "90": "3months"}}
#: Each size's unit, for the table.
#: Metrics another benchmark writes into this file (bench/fanout.py: the SSH fan-out on namespace clusters).
FANOUT_KEYS = ("fanout_", "largest_fanout")
SIZE_UNITS: dict[str, str] = {"ettr_report_s": "days of 2 s steps", "restart_plan_s": "machines",
                              "bus_storm_read_s": "alerts", "bus_storm_drain_s": "alerts",
                              "guardian_ingest_s": "alerts", "alert_storm_open_s": "alerts",
                              "bus_idle_poll_s": "alerts read before"}


def areas() -> list[str]:
    return sorted(p.stem.removeprefix("scale_") for p in (ROOT / "bench").glob("scale_*.py"))


def _maxrss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: kilobytes


def child(area: str, metric: str, size: int) -> dict[str, Any]:
    """One trial, in this (fresh) interpreter: prepare untimed, run timed, memory around it."""
    module = importlib.import_module(f"bench.scale_{area}")
    prepare, _sizes = module.CASES[metric]
    run = prepare(size)
    before = _maxrss_mb()
    t0 = time.perf_counter()
    result = run()
    seconds = time.perf_counter() - t0
    peak = _maxrss_mb()
    return {"s": seconds, "rss_before_mb": round(before, 1), "peak_mb": round(peak, 1),
            "extra_mb": round(max(0.0, peak - before), 1), "result": repr(result)[:300]}


def trial(area: str, metric: str, size: int, timeout_s: float) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", area, metric, str(size)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT, check=False)
    except subprocess.TimeoutExpired:
        return {"error": f"did not finish within {timeout_s:.0f} s"}
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        return {"error": tail[:300]}
    try:
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"error": f"no result printed: {done.stdout[-200:]!r}"}


def key_of(metric: str, size: int) -> str:
    base, _, variant = metric.partition(".")  # "bus_storm_read_s.s3" -> size goes before the variant
    label = SIZE_NAMES.get(base, {}).get(str(size), str(size))
    return f"{base}.{label}" + (f".{variant}" if variant else "")


def points_from(metrics: dict[str, Any]) -> dict[str, list[tuple[int, float]]]:
    """A result document's metrics as (size, median seconds) per metric: the inverse of :func:`key_of`."""
    names = {label: int(size) for labels in SIZE_NAMES.values() for size, label in labels.items()}
    out: dict[str, list[tuple[int, float]]] = {}
    for key, m in metrics.items():
        if "." not in key or key.startswith(FANOUT_KEYS):  # the fan-out's sizes are machines of a cluster
            continue
        base, label, *variant = key.split(".")
        size = names.get(label) if not label.isdigit() else int(label)
        if size is not None:
            out.setdefault(".".join([base, *variant]), []).append((size, float(m["median"])))
    return out


def chart(points: dict[str, list[tuple[int, float]]], path: Path) -> None:
    """Seconds against size, log-log, one line per metric, the legend beside the plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 5.2), dpi=80)
    colours = plt.get_cmap("tab20").colors
    markers = "os^vD<>p*hX"
    for i, (metric, pts) in enumerate(sorted(points.items())):
        xs, ys = zip(*sorted(pts), strict=True)
        ax.plot(xs, [max(y, 1e-4) for y in ys], marker=markers[i % len(markers)], ms=5, lw=1.2,
                color=colours[i % len(colours)], label=metric)
    for limit, text in ((2.0, "2 s"), (30.0, "30 s")):
        ax.axhline(limit, color="grey", ls=":", lw=0.8)
        ax.text(1.0, limit * 1.1, text, fontsize=7, color="grey")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("size: ranks (stacks, topology), machines (restart plan), alerts (bus, ingest, storm), days (ETTR)")
    ax.set_ylabel("seconds (median)")
    ax.set_title("trainguard control-plane paths against fleet size (2 cores)")
    ax.grid(True, which="both", lw=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def main() -> int:
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        print(json.dumps(child(sys.argv[2], sys.argv[3], int(sys.argv[4]))))
        return 0
    if len(sys.argv) == 4 and sys.argv[1] == "--chart-only":  # redraw: --chart-only RESULT.json CHART.png
        chart(points_from(json.loads(Path(sys.argv[2]).read_text())["metrics"]), Path(sys.argv[3]))
        return 0
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="one trial of the two smallest sizes of each case")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--only", default="", help="comma-separated areas (default: every bench/scale_*.py)")
    ap.add_argument("--trials-for", default="", help="AREA=N,... trials of those areas (those whose set-up "
                                                      "alone takes minutes: the storm on moto_server)")
    ap.add_argument("--timeout-s", type=float, default=900.0, help="limit for one trial")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--chart", type=Path)
    args = ap.parse_args()
    chosen = [a for a in args.only.split(",") if a] or areas()
    unknown = sorted(set(chosen) - set(areas()))
    if unknown:
        print(f"no bench/scale_{unknown[0]}.py; areas are {', '.join(areas())}", file=sys.stderr)
        return 2
    trials = 1 if args.quick else max(1, args.trials)
    per_area: dict[str, int] = {}
    for item in filter(None, args.trials_for.split(",")):
        area, _, n = item.partition("=")
        if area not in areas() or not n.isdigit() or int(n) < 1:
            print(f"--trials-for {item!r}: write AREA=N with an area of {', '.join(areas())}", file=sys.stderr)
            return 2
        per_area[area] = 1 if args.quick else int(n)
    metrics: dict[str, Any] = {}
    limits: dict[str, Any] = {}
    errors: dict[str, str] = {}
    points: dict[str, list[tuple[int, float]]] = {}
    for area in chosen:
        cases = importlib.import_module(f"bench.scale_{area}").CASES
        for metric, (_prepare, sizes) in cases.items():
            base = metric.partition(".")[0]
            run_sizes = sorted(sizes)[:2] if args.quick else sorted(sizes)
            crossed: str | None = None
            for size in run_sizes:
                key = key_of(metric, size)
                runs = [trial(area, metric, size, args.timeout_s) for _ in range(per_area.get(area, trials))]
                failed = [r["error"] for r in runs if "error" in r]
                good = [r for r in runs if "error" not in r]
                if failed:
                    errors[key] = failed[0]
                    print(f"{key:45s} FAILED: {failed[0]}", flush=True)
                if not good:
                    continue
                target = LIMITS.get(base, {}).get(str(size), LIMITS.get(base, {}).get("*"))
                m = summarize([r["s"] for r in good], "s", target=target)
                m["peak_mb"] = statistics.median(r["peak_mb"] for r in good)
                m["extra_mb"] = statistics.median(r["extra_mb"] for r in good)
                mem_limit = MEMORY_LIMITS_MB.get(base, {}).get(str(size))
                if mem_limit is not None:
                    m["peak_mb_target"] = mem_limit
                m["result"] = good[0]["result"]
                metrics[key] = m
                points.setdefault(metric, []).append((size, m["median"]))
                over = (target is not None and m["median"] > target) or \
                       (mem_limit is not None and m["peak_mb"] > mem_limit)
                if over and crossed is None:
                    crossed = str(size)
                print(f"{key:45s} {m['median']:9.4f} s (p90 {m['p90']:.4f}, n {m['n']})  peak {m['peak_mb']:7.1f} MB "
                      f"(+{m['extra_mb']:.1f})" + ("  OVER LIMIT" if over else ""), flush=True)
            if run_sizes:
                limits[metric] = {"largest_size_run": max(run_sizes), "size_unit": SIZE_UNITS.get(base, "ranks"),
                                  "crosses_limit_at": crossed,
                                  "statement": (f"crosses its limit at {crossed}" if crossed else
                                                f"no limit crossed up to {max(run_sizes)}")}
    setup = {"trials": trials, "trials_per_area": per_area, "areas": chosen, "limits": limits, "errors": errors,
             "cpu_count": os.cpu_count()}
    if args.out and args.out.exists():  # what bench/fanout.py measured on namespace clusters stays
        with contextlib.suppress(ValueError):
            old = json.loads(args.out.read_text())
            metrics.update({k: v for k, v in old.get("metrics", {}).items() if k.startswith(FANOUT_KEYS)})
            if "fanout" in old.get("setup", {}):
                setup["fanout"] = old["setup"]["fanout"]
    if args.chart:
        chart(points, args.chart)
    print(write_result("scale", quick=args.quick, setup=setup, metrics=metrics, out=args.out)[:200])
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())

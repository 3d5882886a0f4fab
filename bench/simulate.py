"""ETTR at scale, simulated: 9,600 GPUs for 90 days with ByteRobust's published latencies and with
trainguard's measured ones (operators/sim), the breakdown, the sensitivity table and the chart.

    python bench/simulate.py [--quick] [--seeds 5] [--out FILE] [--chart PNG]

Metrics: ``ettr.byterobust``, ``ettr.measured`` and ``ettr.measured_degrade`` (the measured profile with the
degrade path: faults confined to a few data-parallel replicas trained through on the others; target 0.99)
(the median over the seeds, the mean beside it; min/max the spread),
``wall_s`` (one 90-day run at 9,600 GPUs; target <= 60 s on 2 cores). The setup holds the breakdowns of the
first seed's runs and the sensitivity table (measured profile, common random numbers).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import summarize, write_result
from trainguard.operators.sim import model, profiles, report


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="30 days, one seed, no sensitivity table")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--gpus", type=int, default=9600)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--chart", type=Path)
    args = ap.parse_args()
    days, seeds = (30.0, 1) if args.quick else (90.0, args.seeds)
    m = model.load_model()
    machines = args.gpus // m.gpus_per_machine
    metrics, setup, firsts, walls = {}, {"gpus": args.gpus, "days": days, "seeds": seeds, "layout": "TP=8 PP=8",
                                         "profiles": {}}, [], []
    for name in profiles.PROFILES:
        prof = profiles.profile(name, machines)
        runs = []
        for seed in range(1, seeds + 1):
            r, wall = report.timed(m, prof, gpus=args.gpus, days=days, seed=seed)
            runs.append(r)
            walls.append(wall)
        firsts.append(runs[0])
        values = [r.ettr for r in runs]
        metrics[f"ettr.{name}"] = {**summarize(values, "ratio", target=0.97 if name == "byterobust" else 0.985),
                                   "mean": round(statistics.mean(values), 4)}
        setup["profiles"][name] = {"first_seed": runs[0].as_dict(), "phases": {
            k: v for k, v in vars(prof).items() if k not in ("name", "sources")}, "sources": dict(prof.sources)}
        for line in report.breakdown_lines(runs[0]):
            print(line, flush=True)
        print(f"  ETTR over {seeds} seeds: mean {statistics.mean(values):.2%}, {min(values):.2%} .. "
              f"{max(values):.2%}", flush=True)
    # the degrade path (operators/policy/degrade.py) on the measured profile, the same seeds
    prof = profiles.profile("measured", machines)
    runs = [report.timed(m, prof, gpus=args.gpus, days=days, seed=seed, knobs=report.degrade_knobs(prof))[0]
            for seed in range(1, seeds + 1)]
    values = [r.ettr for r in runs]
    metrics["ettr.measured_degrade"] = {**summarize(values, "ratio", target=0.99),
                                        "mean": round(statistics.mean(values), 4)}
    setup["profiles"]["measured_degrade"] = {"first_seed": runs[0].as_dict(), "min_replicas": 1}
    for line in report.breakdown_lines(runs[0]):
        print(line, flush=True)
    print(f"  ETTR over {seeds} seeds: mean {statistics.mean(values):.2%}, {min(values):.2%} .. "
          f"{max(values):.2%}", flush=True)
    metrics["wall_s"] = summarize(walls, "s", target=60)
    if not args.quick:
        rows = report.sensitivity(m, profiles.profile("measured", machines), gpus=args.gpus, days=days, seed=1)
        setup["sensitivity_measured"] = rows
        print(report.sensitivity_markdown(rows), flush=True)
    if args.chart:
        report.chart(firsts, args.chart)
    print(write_result("simulate", quick=args.quick, setup=setup, metrics=metrics, out=args.out)[:200])
    return 0


if __name__ == "__main__":
    sys.exit(main())

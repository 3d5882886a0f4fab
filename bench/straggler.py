"""Straggler judgement: today's rule against scikit-learn's outlier models, on the same cases.

The fail-slow vote (:class:`trainguard.operators.policy.runtime.SlowVoter`) takes 5 rounds of every rank's
recent compute time; in each round it flags the ranks above ``slow_factor`` (1.25) times their pipeline
stage's median, and evicts the smallest parallel group holding the ranks flagged in at least half of the
rounds. This benchmark replaces the per-round flagging with robust outlier models of scikit-learn over each
rank's log compute ratio to its stage's median, keeps the rest of the vote (rounds, persistence, smallest
group), and runs every judgement on the same drawn cases:

- layouts: the emulated cluster's 2x2x2 (TP x PP x DP, 4 machines of 2 ranks) and a 4x4x8 (128 ranks);
- noise: "quiet" (each rank's compute varies by 3% from round to round) and "busy" (15% per rank, a
  machine-wide load factor of 10% per round, and one round in 20 a rank's compute doubles for that round only,
  as a host's other work does);
- one rank slowed by 0% (healthy), 15%, 30%, 50% or 100% of its compute.

Per judgement and case: the share of votes whose verdict holds the slowed rank's machine (for a slowed
rank), the share of healthy cases with any verdict (a false eviction), and the share of verdicts that took a
machine the smallest group holding the slowed rank does not hold. Medians of the time per vote.

    python bench/straggler.py [--quick] [--seeds N] [--out FILE]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import write_result
from trainguard.core.topology import Topology
from trainguard.operators.policy.runtime import SlowVoter, smallest_group

ROUNDS = 5
FACTOR = 1.25  # the slow_factor setting's default
LAYOUTS = {"2x2x2": Topology(tp=2, pp=2, dp=2, ranks_per_machine=2),
           "4x4x8": Topology(tp=4, pp=4, dp=8, ranks_per_machine=4)}
NOISE = {"quiet": {"rank": 0.03, "machine": 0.0, "spike": 0.0},
         "busy": {"rank": 0.15, "machine": 0.10, "spike": 0.05}}
SLOWDOWNS = (0.0, 0.15, 0.3, 0.5, 1.0)
STAGE_COMPUTE = (0.25, 0.22, 0.22, 0.3)  # seconds of compute per stage (the first embeds, the last computes the loss)
CHI2_999 = 10.828  # the 0.999 quantile of chi-squared with one degree of freedom

Flagger = Callable[[Topology, dict[int, float]], list[int]]


def _log_ratios(topo: Topology, times: dict[int, float]) -> tuple[list[int], np.ndarray]:
    """Each rank's log compute time over its stage's median (the features the models see)."""
    stages: dict[int, list[float]] = {}
    for r, t in times.items():
        stages.setdefault(topo.coords(r).pp, []).append(t)
    medians = {pp: float(np.median(ts)) for pp, ts in stages.items()}
    ranks = sorted(times)
    return ranks, np.array([[math.log(times[r] / medians[topo.coords(r).pp])] for r in ranks])


def rule(topo: Topology, times: dict[int, float]) -> list[int]:
    voter = SlowVoter(topo, rounds=1)
    return voter.add_round(times, factor=FACTOR)


def min_cov_det(topo: Topology, times: dict[int, float]) -> list[int]:
    """Minimum covariance determinant (a robust location and spread): ranks beyond its 0.999 quantile, slower."""
    from sklearn.covariance import MinCovDet

    ranks, x = _log_ratios(topo, times)
    if float(np.ptp(x)) == 0.0:
        return []
    try:
        d = MinCovDet(random_state=0).fit(x).mahalanobis(x)
    except ValueError:  # its reweighting kept no rank (a degenerate round): it cannot judge this round
        return []
    return [r for r, dist, v in zip(ranks, d, x[:, 0], strict=True) if dist > CHI2_999 and v > 0]


def min_cov_det_effect(topo: Topology, times: dict[int, float]) -> list[int]:
    """The same, and at least 10% slower than its stage (an outlier by a hair on a quiet host is no straggler)."""
    return [r for r in min_cov_det(topo, times) if times[r] > 1.1 * _stage_median(topo, times, r)]


def isolation_forest(topo: Topology, times: dict[int, float]) -> list[int]:
    from sklearn.ensemble import IsolationForest

    ranks, x = _log_ratios(topo, times)
    pred = IsolationForest(n_estimators=50, contamination="auto", random_state=0).fit_predict(x)
    return [r for r, p, v in zip(ranks, pred, x[:, 0], strict=True) if p == -1 and v > 0]


def local_outlier_factor(topo: Topology, times: dict[int, float]) -> list[int]:
    from sklearn.neighbors import LocalOutlierFactor

    ranks, x = _log_ratios(topo, times)
    pred = LocalOutlierFactor(n_neighbors=min(20, len(ranks) - 1)).fit_predict(x)
    return [r for r, p, v in zip(ranks, pred, x[:, 0], strict=True) if p == -1 and v > 0]


def _stage_median(topo: Topology, times: dict[int, float], rank: int) -> float:
    pp = topo.coords(rank).pp
    return float(np.median([t for r, t in times.items() if topo.coords(r).pp == pp]))


JUDGES: dict[str, Flagger] = {"rule_1.25x_stage_median": rule, "sklearn_min_cov_det": min_cov_det,
                              "sklearn_min_cov_det_and_10pct": min_cov_det_effect,
                              "sklearn_isolation_forest": isolation_forest,
                              "sklearn_local_outlier_factor": local_outlier_factor}


def draw_rounds(topo: Topology, noise: dict[str, float], slow_rank: int, slowdown: float,
                rng: np.random.Generator) -> list[dict[int, float]]:
    n, per = topo.world_size, topo.ranks_per_machine
    out = []
    for _ in range(ROUNDS):
        machine = np.exp(rng.normal(0.0, noise["machine"], n // per)) if noise["machine"] else np.ones(n // per)
        times = {}
        for r in range(n):
            t = STAGE_COMPUTE[topo.coords(r).pp % len(STAGE_COMPUTE)] * math.exp(rng.normal(0.0, noise["rank"]))
            t *= machine[r // per]
            if noise["spike"] and rng.random() < noise["spike"]:
                t *= 2.0
            if r == slow_rank:
                t *= 1.0 + slowdown
            times[r] = t
        out.append(times)
    return out


def judge(topo: Topology, flag: Flagger, rounds: Sequence[dict[int, float]]) -> tuple[list[int], float]:
    """The vote's verdict (machine indices; [] for none) with ``flag`` in place of the per-round rule."""
    voter = SlowVoter(topo, rounds=len(rounds))
    t0 = time.perf_counter()
    for times in rounds:
        voter.votes.update(flag(topo, times))
        voter.seen += 1
    verdict = voter.verdict()
    return ([] if verdict is None else sorted(verdict[1])), time.perf_counter() - t0


def run(seeds: int, layouts: Sequence[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    table: dict[str, Any] = {}
    for layout in layouts:
        topo = LAYOUTS[layout]
        for noise_name, noise in NOISE.items():
            for slowdown in SLOWDOWNS:
                cases = []
                for seed in range(seeds):
                    rng = np.random.default_rng([seed, int(slowdown * 100), len(noise_name), topo.world_size])
                    slow_rank = int(rng.integers(topo.world_size))
                    cases.append((slow_rank, draw_rounds(topo, noise, slow_rank, slowdown, rng)))
                for name, flag in JUDGES.items():
                    hit = false = wrong = 0
                    spent = []
                    for slow_rank, rounds in cases:
                        machines, s = judge(topo, flag, rounds)
                        spent.append(s)
                        if slowdown == 0.0:
                            false += bool(machines)
                            continue
                        right = set(smallest_group(topo, [slow_rank])[1])
                        hit += slow_rank // topo.ranks_per_machine in machines
                        wrong += bool(machines) and not set(machines) <= right
                    key = f"{layout}.{noise_name}.{int(slowdown * 100)}pct"
                    row = table.setdefault(name, {})
                    if slowdown == 0.0:
                        row[key] = {"false_eviction_rate": round(false / seeds, 4)}
                    else:
                        row[key] = {"caught_rate": round(hit / seeds, 4),
                                    "wrong_machines_rate": round(wrong / seeds, 4)}
                    row[key]["vote_ms_median"] = round(1000 * float(np.median(spent)), 3)
    return metrics_of(table, layouts, seeds), table


def metrics_of(table: dict[str, Any], layouts: Sequence[str], seeds: int) -> dict[str, Any]:
    """The benchmark table's rows: per judgement and layout, false evictions and 30% stragglers caught on the busy host,
    15% stragglers caught on the quiet one (the whole grid stays in the setup's table)."""
    metrics: dict[str, Any] = {}
    for name, row in table.items():
        for layout in layouts:
            for key, cell, field in ((f"{layout}.busy.false_eviction_rate", "busy.0pct", "false_eviction_rate"),
                                     (f"{layout}.busy.caught_30pct_rate", "busy.30pct", "caught_rate"),
                                     (f"{layout}.quiet.caught_15pct_rate", "quiet.15pct", "caught_rate")):
                metrics[f"{name}.{key}"] = {"value": row[f"{layout}.{cell}"][field], "n": seeds, "unit": "ratio"}
    return metrics


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="10 cases per cell, the small layout only")
    ap.add_argument("--seeds", type=int, default=50, help="cases per layout, noise and slowdown")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.seeds < 1:
        print(f"--seeds {args.seeds}: give at least 1", file=sys.stderr)
        return 2
    seeds = 10 if args.quick else args.seeds
    layouts = ["2x2x2"] if args.quick else list(LAYOUTS)
    t0 = time.time()
    metrics, table = run(seeds, layouts)
    setup = {"rounds": ROUNDS, "factor": FACTOR, "layouts": layouts, "noise": NOISE,
             "slowdowns": list(SLOWDOWNS), "cases_per_cell": seeds, "stage_compute_s": list(STAGE_COMPUTE),
             "table": table, "wall_s": round(time.time() - t0, 1)}
    for name, row in table.items():
        print(name)
        for key, cell in row.items():
            print(f"  {key:24s} {cell}")
    print(write_result("straggler", quick=args.quick, setup=setup, metrics=metrics, out=args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

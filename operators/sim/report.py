"""What a simulation reports: the sensitivity table (ETTR as one input varies, everything else and the random
draws held fixed), the chart, and a few lines of text."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trainguard.operators.sim.engine import Knobs, Result, simulate
from trainguard.operators.sim.model import FailureModel, Profile, SimError

# (row name, what varies, values, how a value becomes knobs)
SENSITIVITY: tuple[tuple[str, str, tuple[Any, ...]], ...] = (
    ("standby pool size", "pool_size", (0, 2, 5, None)),
    ("checkpoint interval (s)", "checkpoint_interval_s", (10.0, 60.0, 600.0, 3600.0)),
    ("detection latency (x)", "detect_scale", (0.0, 0.5, 1.0, 2.0)),
    ("over-eviction group (PP machines)", "pp", (2, 4, 8, 16)),
    ("restart time (x)", "restart_scale", (0.25, 0.5, 1.0, 2.0)),
    ("diagnosis time (x)", "diagnose_scale", (0.0, 0.5, 1.0, 2.0)),
    ("checkpoint write cost (x)", "phase:checkpoint", (0.0, 0.5, 1.0, 2.0)),
    ("human wait (x)", "phase:human", (0.0, 0.5, 1.0, 2.0)),
)


def sensitivity(model: FailureModel, prof: Profile, *, gpus: int, days: float, seed: int, pp: int = 8
                ) -> list[dict[str, Any]]:
    """One row per input: ETTR at each value, the same seed for every run (common random numbers, so a row's
    differences are the input's, not the draws')."""
    rows = []
    for label, what, values in SENSITIVITY:
        cells = []
        for v in values:
            knobs, layout = Knobs(), pp
            if what == "pp":
                layout = int(v)
            elif what.startswith("phase:"):
                knobs = Knobs(phase_scale=((what.split(":", 1)[1], float(v)),))
            elif what == "diagnose_scale":
                knobs = Knobs(phase_scale=(("diagnosis", float(v)),))
            else:
                knobs = Knobs(**{what: v})
            r = simulate(model, prof, gpus=gpus, days=days, pp=layout, seed=seed, knobs=knobs)
            cells.append({"value": "policy" if v is None else v, "ettr": round(r.ettr, 4)})
        rows.append({"input": label, "cells": cells})
    return rows


def sensitivity_markdown(rows: Sequence[dict[str, Any]]) -> str:
    out = ["| input | values -> ETTR |", "|---|---|"]
    for row in rows:
        cells = ", ".join(f"{c['value']}: {c['ettr']:.2%}" for c in row["cells"])
        out.append(f"| {row['input']} | {cells} |")
    return "\n".join(out)


def breakdown_lines(r: Result) -> list[str]:
    d = r.as_dict()
    paths = (f"; {r.actions.get('degrade', 0)} incidents trained through on fewer replicas, "
             f"{r.actions.get('stop_world', 0)} stopped the world" if r.degrade else "")
    lines = [f"{r.profile}{' with the degrade path' if r.degrade else ''}: {r.gpus} GPUs ({r.machines} machines) "
             f"for {r.days:g} days: ETTR {r.ettr:.2%} (weekly {min(r.weeks):.2%} .. {max(r.weeks):.2%}){paths}"]
    lines.append("  unproductive by phase (h): " + ", ".join(
        f"{k} {v:.1f}" for k, v in d["unproductive_h"]["by_phase"].items() if v))
    lines.append("  unproductive by cause (h): " + ", ".join(
        f"{k} {v:.1f}" for k, v in d["unproductive_h"]["by_cause"].items() if v))
    lines.append(f"  incidents: {sum(v for k, v in r.incidents.items() if not k.startswith('manual'))} failures, "
                 f"{r.incidents.get('manual', 0)} manual changes; evictions: {r.evictions.get('faulty', 0)} faulty, "
                 f"{r.evictions.get('healthy', 0)} healthy")
    p = r.pool
    lines.append(f"  standby pool: mean {p['mean']:.1f} (target {p['target_last']}), empty {p['empty_share']:.2%} "
                 f"of the time, the job waited for machines {p['waits']} times ({p['machines_short']} machines)")
    return lines


def chart(results: Sequence[Result], path: Path) -> None:
    """ETTR per week and cumulative, and unproductive hours by phase, for each profile (one PNG)."""
    try:
        import matplotlib
    except ModuleNotFoundError:
        from trainguard.core.errors import TrainguardError

        raise TrainguardError("--chart needs matplotlib: pip install 'trainguard[charts]', or leave --chart out",
                              exit_code=2) from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6), dpi=80)
    for r in results:
        weeks = list(range(1, len(r.weeks) + 1))
        line = ax1.plot(weeks, [w * 100 for w in r.weeks], marker="o", ms=3, label=f"{r.profile} weekly")[0]
        ax1.axhline(r.ettr * 100, color=line.get_color(), ls="--", lw=1, label=f"{r.profile} cumulative "
                                                                                f"{r.ettr:.1%}")
    ax1.axhline(97, color="grey", ls=":", lw=1, label="ByteRobust 97%")
    ax1.set_xlabel("week")
    ax1.set_ylabel("ETTR (%)")
    ax1.set_title(f"ETTR, {results[0].gpus} GPUs, {results[0].days:g} days")
    ax1.legend(fontsize=7)
    phases = [p for p in results[0].by_phase if any(r.by_phase.get(p, 0) for r in results)]
    width = 0.8 / len(results)
    for i, r in enumerate(results):
        ax2.barh([k + i * width for k in range(len(phases))], [r.by_phase.get(p, 0) / 3600 for p in phases],
                 height=width, label=r.profile)
    ax2.set_yticks([k + width * (len(results) - 1) / 2 for k in range(len(phases))], phases, fontsize=8)
    ax2.set_xlabel("unproductive hours")
    ax2.set_title("unproductive time by phase")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def degrade_knobs(prof: Profile, min_replicas: int = 1) -> Knobs:
    """The knobs of a run with the degrade path; a profile without its costs is refused in one line."""
    if prof.quorum_s <= 0:
        raise SimError(f"the {prof.name} profile has no cost for training on fewer replicas (ByteRobust stops the "
                       f"world for every fault); use --profile measured with --degrade")
    if min_replicas < 1:
        raise SimError(f"--min-replicas {min_replicas} must be at least 1")
    return Knobs(degrade=True, min_replicas=min_replicas)


def timed(model: FailureModel, prof: Profile, **kwargs: Any) -> tuple[Result, float]:
    t0 = time.perf_counter()
    r = simulate(model, prof, **kwargs)
    return r, time.perf_counter() - t0

"""False fail-slow alarms on healthy jobs of different step times, beside two CPU hogs, and a 30% straggler still
voted out: the fail-slow rules judged on each job's own noise (docs/operate.md, "Fail-slow on the job's own noise").

For each step time (``--step-s``, the reference job's emulated accelerator time a step: 10 ms, 50 ms, 200 ms), on
an emulated cluster of its own (the job TP=2 PP=2 DP=2 on 4 machines, 4 warm standbys, the control plane's default
fail-slow settings), the same measurement as ``bench/chaos.py``'s healthy-under-load scenario: ``--healthy-s``
seconds of healthy training with two CPU hogs beside the job, counting the incidents that open (the fail-slow ones
above all) and the slow alerts recorded without one; then one rank slowed by 30% of the job's step under the same
load, and whether its machine is voted out.

    python bench/false_slow.py --out bench/results/false_slow.json           # 30 min a step time
    python bench/false_slow.py --quick                                       # 2 min a step time
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.chaos import JOB, SPEC, Chaos, healthy_under_load
from bench.common import emulated_cluster, stop_on_sigterm, write_result
from trainguard.emulation.guarded import NO_SCHEDULES, GuardedJob

#: the control plane's defaults for everything fail-slow (TG_SLOW_FACTOR 1.25, 5 rounds 10 s apart), the
#: harness's own for the rest (its scenarios come quicker than production's hour)
SETTINGS = {"TG_ESCALATION_WINDOW_S": "1", "TG_BREAKER_SHARE": "0.75", "TG_BREAKER_WINDOW_S": "1",
            "TG_AGENT_SILENT_S": "10", "TG_RESUME_TIMEOUT_S": "120", "TG_STOP_GRACE_S": "2", **NO_SCHEDULES}


class Paced(Chaos):
    """The chaos harness's job, at another emulated accelerator time a step."""

    def __init__(self, inv: Any, home: Path, *, step_s: float) -> None:
        GuardedJob.__init__(self, inv, home, job=JOB, settings=SETTINGS,
                            train_args=("--checkpoint", "--emulate-device-s", f"{step_s:g}"))
        self.rng = random.Random(0)
        self.trials: list[dict[str, Any]] = []
        self.killed: list[int] = []
        self.compound: dict[str, Any] = {}


def measured_step_s(c: Chaos) -> float | None:
    """The job's median step time as rank 0 recorded it (its last 200 steps)."""
    recs = [float(r["step_time_s"]) for r in c.ctl.step_history(JOB, rank=0)[-200:]
            if isinstance(r.get("step_time_s"), float)]
    return round(statistics.median(recs), 4) if recs else None


def one(step_s: float, seconds: float) -> dict[str, Any]:
    with emulated_cluster(SPEC, "tg-bench-slow-") as (inv, home):
        c = Paced(inv, home, step_s=step_s)
        try:
            c.start()
            out = healthy_under_load(c, seconds)
            out["step_s_measured"] = measured_step_s(c)
        finally:
            c.stop()
    out["step_s_emulated"] = step_s
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 minutes of healthy training a step time")
    ap.add_argument("--step-s", default="0.01,0.05,0.2", help="emulated accelerator seconds a step, comma-separated")
    ap.add_argument("--healthy-s", type=float, default=1800.0, help="healthy seconds a step time (default 1800)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    stop_on_sigterm()
    try:
        steps = [float(x) for x in args.step_s.split(",") if x]
    except ValueError:
        print(f"--step-s {args.step_s!r}: write seconds separated by commas, e.g. 0.01,0.05,0.2", file=sys.stderr)
        return 2
    if not steps or any(s <= 0 for s in steps):
        print(f"--step-s {args.step_s!r}: every step time must be above 0", file=sys.stderr)
        return 2
    seconds = 120.0 if args.quick else args.healthy_s
    t0 = time.time()
    runs = [one(s, seconds) for s in steps]
    metrics: dict[str, Any] = {}
    for run in runs:
        key = f"{run['step_s_emulated'] * 1000:g}ms"
        metrics[f"false_slow_incidents_30min.{key}"] = {
            "value": round(run["slow_incidents"] * 1800.0 / run["seconds"], 2), "n": 1, "unit": "incidents",
            "target": 0, "window_s": run["seconds"]}
        metrics[f"incidents_healthy.{key}"] = {"value": len(run["incidents"]), "n": 1, "unit": "incidents",
                                               "target": 0, "window_s": run["seconds"]}
        metrics[f"slow_rank_30pct_voted_out.{key}"] = {"value": int(bool(run["slow_rank"]["voted_out"])), "n": 1,
                                                       "unit": "bool", "target": 1}
    text = write_result("false_slow", quick=bool(args.quick), out=args.out, metrics=metrics, setup={
        "cluster": f"{SPEC.machines} emulated machines (network namespaces, real sshd): the job's 4, "
                   f"{SPEC.standbys} warm standbys; two CPU hogs on the host during the whole measurement",
        "job": "reference GPT 2x2x2 (TP x PP x DP), checkpoint every step, the emulated accelerator time a step "
               "given per run (the measured step time beside it)",
        "control_plane": "airflow standalone; fail-slow settings at their defaults (TG_SLOW_FACTOR 1.25, 5 rounds "
                         "10 s apart)",
        "wall_s": round(time.time() - t0, 1), "runs": runs})
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

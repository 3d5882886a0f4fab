"""Training through the loss of a data-parallel replica (trainguard.replicas: torchft's quorum and live healing
behind trainguard's face), measured on this host: two replica groups of ``examples/replicas`` (one rank each,
one torchrun each, a lighthouse with a 2 s heartbeat timeout), one group's rank killed with SIGKILL mid-run,
torchrun restarting it.

    python bench/replicas.py [--trials 5] [--out FILE]

Metrics (medians over the trials):

* ``survivor_stall_s``: the longest interval between two of the surviving group's steps around the fault, less
  its usual step interval: how long the replica that did not fail stood still (the quorum change);
* ``heal_s``: the kill to the restarted group's first step trained with the live one's state (torchrun's
  restart, the interpreter and torch, the quorum, the transfer from the live group);
* ``full_width_s``: the kill to the survivor's first step with both groups again;
* ``steps_redone``: steps the survivor ran twice (target 0);
* ``digests_equal``: 1 when both groups hold the same state bit for bit at every step both logged after the heal;
* ``survivor_restarts``: times the surviving group's own process died and came back (target 0).

The simulator's degrade path reads ``survivor_stall_s`` and ``heal_s`` (operators/sim/profiles.py).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import summarize, write_result
from trainguard.emulation.replicas import ReplicaRun
from trainguard.emulation.standalone import poll

STEPS, STEP_S = 200, 0.05


def trial(folder: Path) -> dict[str, float]:
    # the live heal is measured: no checkpoint (a group restarted fast enough restores its own step instead)
    run = ReplicaRun(folder, steps=STEPS, step_s=STEP_S, heartbeat_timeout_ms=2000, args=["--no-checkpoint"])
    try:
        run.start()
        poll(lambda: len(run.records(1)) >= 40 and sum(r.get("participants") == 2 for r in run.records(0)) >= 30,
             timeout=120, interval=0.05, what="both groups to train together")
        killed = run.kill(1)
        poll(lambda: any(r.get("healed_from_step") is not None and r["ts"] > killed for r in run.records(1)),
             timeout=120, interval=0.05, what="the restarted group to heal")
        codes = run.finish()
        if any(codes.values()):
            raise RuntimeError(f"a group failed: {codes}; see {folder}")
    finally:
        run.stop()
    survivor = run.records(0)
    before = [b["ts"] - a["ts"] for a, b in itertools.pairwise(survivor) if b["ts"] < killed]
    around = [b["ts"] - a["ts"] for a, b in itertools.pairwise(survivor) if killed - 1 <= b["ts"] <= killed + 30]
    steps = [r["step"] for r in survivor]
    healed = next(r for r in run.records(1) if r.get("healed_from_step") is not None and r["ts"] > killed)
    back = next(r for r in survivor if r["ts"] > healed["ts"] and r.get("participants") == 2)
    d0, d1 = run.digests(0), run.digests(1)
    common = [s for s in set(d0) & set(d1) if s > healed["step"]]
    return {"survivor_stall_s": max(around) - statistics.median(before), "heal_s": healed["ts"] - killed,
            "full_width_s": back["ts"] - killed, "steps_redone": float(len(steps) - len(set(steps))),
            "digests_equal": float(bool(common) and all(d0[s] == d1[s] for s in common)),
            "survivor_restarts": float(sum(r["ts"] > killed and r.get("healed_from_step") is not None
                                           for r in survivor)),
            "step_s": statistics.median(before)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    trials = []
    with tempfile.TemporaryDirectory(prefix="tg-replicas-") as tmp:
        for i in range(args.trials):
            folder = Path(tmp) / f"trial{i}"
            folder.mkdir()
            t = trial(folder)
            trials.append(t)
            print(f"trial {i}: " + ", ".join(f"{k} {v:.3f}" for k, v in t.items()), flush=True)
    targets = {"steps_redone": 0, "digests_equal": 1, "survivor_restarts": 0}
    units = {"steps_redone": "steps", "digests_equal": "bool", "survivor_restarts": "restarts"}
    metrics = {k: summarize([t[k] for t in trials], units.get(k, "s"), target=targets.get(k))
               for k in ("survivor_stall_s", "heal_s", "full_width_s", "steps_redone", "digests_equal",
                         "survivor_restarts", "step_s")}
    setup = {"groups": 2, "ranks_per_group": 1, "gradients": "one flat all-reduce through torchft's manager",
             "steps": STEPS, "step_sleep_s": STEP_S,
             "lighthouse": {"heartbeat_timeout_ms": 2000, "quorum_tick_ms": 100, "join_timeout_ms": 1000},
             "fault": "SIGKILL of group 1's rank after 40 steps; torchrun restarts it", "trials": trials}
    print(write_result("replicas", quick=False, setup=setup, metrics=metrics, out=args.out)[:300])
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Foundation benchmark: cluster bring-up, launch to first step, steady step time.

Each trial starts from nothing: bring the emulated cluster up (namespaces, sshd,
reachable over ssh), launch the reference job (TP=2 PP=2 DP=2 on 4 machines)
and time until every rank has finished step 0, then let it run and take the
median step time, then stop it and bring the cluster down (timed too).

    python bench/foundation.py [--quick] [--trials N] [--steps N] [--out FILE]

Writes one JSON document in the project's benchmark format (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import summarize, write_result
from trainguard.core.topology import Topology
from trainguard.emulation import cluster
from trainguard.node_tools import launcher, monitor
from trainguard.node_tools.transport import transport_for
from trainguard.operators.jobspec import REFERENCE_ENTRY

SPEC = cluster.ClusterSpec(name="tgb", machines=6, standbys=2, subnet="10.213.11.0/24", disk_mb=64, gpus=8)


def trial(state_dir: Path, steps: int, port: int) -> dict:
    cluster.down(state_dir, name=SPEC.name, log=lambda *_: None)
    t = time.monotonic()
    inv = cluster.up(SPEC, state_dir, log=lambda *_: None)
    up_s = time.monotonic() - t

    transport = transport_for(inv)
    ssh_times = []
    for m in inv.machines:
        res = transport.run(m, ["true"], timeout=20)
        assert res.ok, res.describe()
        ssh_times.append(res.duration_s)

    topo = Topology(tp=2, pp=2, dp=2)
    plan = launcher.JobPlan(job="bench", topology=topo, machines=inv.by_role("active"),
                            train_args=["--steps", str(steps)], master_port=port, entry=REFERENCE_ENTRY,
                            pass_layout=True)
    t = time.monotonic()
    launcher.launch(inv, plan)
    launch_s = time.monotonic() - t
    dirs = {r: Path(plan.machines[topo.machine_of(r)].workdir) / "jobs" / plan.job for r in range(topo.world_size)}

    def all_at(step: int) -> bool:
        return all((monitor.read_heartbeat(d, r) or {}).get("step", -1) >= step for r, d in dirs.items())

    while not all_at(0):
        if time.monotonic() - t > 600:
            raise RuntimeError("no first step within 600 s")
        time.sleep(0.05)
    first_step_s = time.monotonic() - t
    while not all_at(steps - 1):
        if time.monotonic() - t > 1200:
            raise RuntimeError(f"step {steps - 1} not reached within 1200 s")
        time.sleep(0.1)
    records = monitor.read_steps(dirs[0], 0)
    steady = [r["step_time_s"] for r in records if r["step"] >= 3]
    walls = [b["ts"] - a["ts"] for a, b in itertools.pairwise(records) if a["step"] >= 3]
    losses = [r["loss"] for r in records]
    launcher.stop(inv, plan.job, plan.machines, grace_s=3)
    t = time.monotonic()
    cluster.down(state_dir, name=SPEC.name, log=lambda *_: None)
    down_s = time.monotonic() - t
    return {
        "cluster_up_s": up_s, "cluster_down_s": down_s, "ssh_true_s": statistics.median(ssh_times),
        "launch_rpc_s": launch_s, "launch_to_first_step_s": first_step_s,
        "step_time_s": statistics.median(steady), "step_wall_s": statistics.median(walls),
        "loss_first": losses[0], "loss_last": losses[-1],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one short trial (about a minute)")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    trials, steps = (1, 10) if args.quick else (args.trials, args.steps)
    if os.geteuid() != 0:
        print("bench/foundation.py needs root (network namespaces)", file=sys.stderr)
        return 2
    results = []
    with tempfile.TemporaryDirectory(prefix="tg-bench-") as tmp:
        state_dir = Path(tmp) / "state"
        try:
            for i in range(trials):
                r = trial(state_dir, steps, 29600 + i)
                results.append(r)
                print(json.dumps({"trial": i, **{k: round(v, 3) for k, v in r.items()}}), flush=True)
        finally:
            cluster.down(state_dir, name=SPEC.name, log=lambda *_: None)
    targets = {"cluster_up_s": None, "launch_to_first_step_s": None, "step_time_s": None}
    metrics = {
        key: summarize([r[key] for r in results], "s", targets.get(key))
        for key in ("cluster_up_s", "cluster_down_s", "ssh_true_s", "launch_rpc_s", "launch_to_first_step_s",
                    "step_time_s", "step_wall_s")
    }
    metrics["loss_ratio_last_first"] = summarize([r["loss_last"] / r["loss_first"] for r in results], "ratio")
    text = write_result("foundation", quick=bool(args.quick), out=args.out, metrics=metrics, setup={
        "machines": SPEC.machines, "standbys": SPEC.standbys, "topology": "tp=2,pp=2,dp=2", "ranks": 8,
        "steps": steps, "trials": trials})
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

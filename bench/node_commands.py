"""Node commands benchmark: stacks of a hung job, stop-time diagnostics, warm vs cold starts.

On an emulated cluster of its own:

* ``stacks_s.hung_8_ranks``: one rank of an 8-rank TP=2 PP=2 DP=2 job is stopped
  (SIGSTOP); ``tg-node stacks`` runs on its 4 machines at once over ssh; wall time
  until all 8 ranks' stacks are back (target <= 2 s).
* ``diag_l2_s``: ``tg-node diag --level 2`` over ssh on a healthy machine (target <= 60 s);
  ``diag_l2_catches_sdc``: share of runs on a wrong-arithmetic machine that fail (target 1).
* ``align_s``: ``tg-node align`` over ssh.
* ``first_step_s.cold`` / ``first_step_s.warm``: launch of the 8-rank job until every
  rank has finished step 0, started cold (torchrun + fresh interpreters) or on parked
  warm interpreters on every machine, alternating in one run; ``warm_vs_cold_speedup``
  is their ratio per pair; ``standby_park_s`` is what parking costs, off the critical path.

    python bench/node_commands.py [--quick] [--trials N] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import summarize, write_result
from trainguard.core.topology import Topology
from trainguard.emulation import cluster, inject
from trainguard.node_tools import launcher, monitor
from trainguard.node_tools.inventory import Inventory
from trainguard.node_tools.transport import transport_for

SPEC = cluster.ClusterSpec(name="tgn", machines=6, standbys=2, subnet="10.213.14.0/24", disk_mb=128, gpus=8)
TOPO = Topology(tp=2, pp=2, dp=2)


def all_at(inv: Inventory, plan: launcher.JobPlan, step: int) -> bool:
    for i, m in enumerate(plan.machines):
        for r in plan.topology.ranks_on(i):
            recs = monitor.read_steps(Path(m.workdir) / "jobs" / plan.job, r)
            if not recs or recs[-1]["step"] < step:
                return False
    return True


def wait_step(inv: Inventory, plan: launcher.JobPlan, step: int, timeout: float = 300) -> float:
    start = time.monotonic()
    while not all_at(inv, plan, step):
        if time.monotonic() - start > timeout:
            raise RuntimeError(f"job {plan.job} did not reach step {step} in {timeout:.0f}s")
        time.sleep(0.02)
    return time.monotonic() - start


def tg(inv: Inventory, machines: list, *args: str, timeout: float = 180) -> dict[str, Any]:
    return transport_for(inv).run_many(machines, lambda m: [inv.tg_node, *args], timeout=timeout)


def bench_stacks(inv: Inventory, trials: int, port: int) -> list[float]:
    active = inv.by_role("active")
    plan = launcher.JobPlan(job="hung", topology=TOPO, machines=active, master_port=port)
    launcher.launch(inv, plan)
    times = []
    try:
        wait_step(inv, plan, 5)
        inject.inject(inv, "m3", "hang", rank=6)
        for _ in range(trials):
            t = time.monotonic()
            results = tg(inv, active, "stacks", "--job", "hung", timeout=30)
            wall = time.monotonic() - t
            ranks = {p["rank"] for r in results.values() for p in (r.json() or {}).get("processes", [])
                     if p.get("role") == "rank" and p.get("threads")}
            if ranks != set(range(8)):
                raise RuntimeError(f"stacks returned ranks {sorted(ranks)}")
            times.append(wall)
            print(json.dumps({"stacks_s": round(wall, 3)}), flush=True)
    finally:
        inject.clear(inv, "m3", "hang")
        launcher.stop(inv, plan.job, plan.machines, grace_s=3)
    return times


def bench_diag(inv: Inventory, trials: int) -> tuple[list[float], list[float], list[float]]:
    m4, m5 = inv.machine("m4"), inv.machine("m5")
    l2, caught, align = [], [], []
    inject.inject(inv, "m5", "sdc")
    try:
        for _ in range(trials):
            t = time.monotonic()
            healthy = tg(inv, [m4], "diag", "--level", "2")["m4"]
            l2.append(time.monotonic() - t)
            if healthy.returncode != 0:
                raise RuntimeError(f"diag L2 failed on a healthy machine: {healthy.stdout[-500:]}")
            caught.append(1.0 if tg(inv, [m5], "diag", "--level", "2")["m5"].returncode == 1 else 0.0)
            t = time.monotonic()
            res = tg(inv, [m4], "align")["m4"]
            align.append(time.monotonic() - t)
            if res.returncode != 0:
                raise RuntimeError(f"align failed: {res.stdout[-300:]}")
            print(json.dumps({"diag_l2_s": round(l2[-1], 3), "sdc_caught": caught[-1],
                              "align_s": round(align[-1], 3)}), flush=True)
    finally:
        inject.clear(inv, "m5", "sdc")
    return l2, caught, align


def bench_warm(inv: Inventory, trials: int, port: int) -> dict[str, list[float]]:
    active = inv.by_role("active")
    out: dict[str, list[float]] = {"cold": [], "warm": [], "park": [], "speedup": []}
    for i in range(trials):
        pair = {}
        for mode in ("cold", "warm") if i % 2 == 0 else ("warm", "cold"):
            if mode == "warm":
                t = time.monotonic()
                parked = tg(inv, active, "standby", "park", "--nproc", "2")
                out["park"].append(time.monotonic() - t)
                bad = [n for n, r in parked.items() if r.returncode != 0]
                if bad:
                    raise RuntimeError(f"park failed on {bad}: {parked[bad[0]].stdout[-300:]}")
            port += 1
            plan = launcher.JobPlan(job=f"{mode}{i}", topology=TOPO, machines=active, master_port=port,
                                    warm={m.name for m in active} if mode == "warm" else set())
            t = time.monotonic()
            launcher.launch(inv, plan)
            try:
                wait_step(inv, plan, 0)
                pair[mode] = time.monotonic() - t  # from the launch call to every rank past step 0
            finally:
                launcher.stop(inv, plan.job, plan.machines, grace_s=3)
            out[mode].append(pair[mode])
        out["speedup"].append(pair["cold"] / pair["warm"])
        print(json.dumps({k: round(v, 3) for k, v in pair.items()}), flush=True)
    tg(inv, active, "standby", "unpark")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("bench/node_commands.py needs root (network namespaces)", file=sys.stderr)
        return 2
    trials = 1 if args.quick else args.trials
    with tempfile.TemporaryDirectory(prefix="tg-bench-node-") as tmp:
        state = Path(tmp) / "state"
        inv = cluster.up(SPEC, state, log=lambda *_: None)
        try:
            stacks = bench_stacks(inv, trials, 29900)
            l2, caught, align = bench_diag(inv, min(trials, 3))
            warm = bench_warm(inv, trials, 29910)
        finally:
            cluster.down(state, name=SPEC.name, log=lambda *_: None)
    metrics = {
        "stacks_s.hung_8_ranks": summarize(stacks, "s", 2.0),
        "diag_l2_s": summarize(l2, "s", 60.0),
        "diag_l2_catches_sdc": summarize(caught, "share", 1.0),
        "align_s": summarize(align, "s"),
        "standby_park_s": summarize(warm["park"], "s"),
        "first_step_s.cold": summarize(warm["cold"], "s"),
        "first_step_s.warm": summarize(warm["warm"], "s"),
        "warm_vs_cold_speedup": summarize(warm["speedup"], "ratio"),
    }
    print(write_result("node_commands", quick=bool(args.quick), out=args.out, metrics=metrics,
                       setup={"cluster": "6 machines, 4 active", "topology": str(TOPO), "trials": trials}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

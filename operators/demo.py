"""The main job on the embedded default: an emulated cluster and a training job on it.

``trainguard demo`` brings the emulated cluster up, launches the reference
TP x PP x DP job on its active machines, follows it over ssh and prints its
progress, then reports and cleans up (the cluster stays with ``--keep``).
Ctrl-C at any moment stops the job and brings the cluster down.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

from node_tools import cluster, launcher
from node_tools.errors import EXIT_OK, EXIT_UNHEALTHY
from node_tools.inventory import Inventory
from node_tools.topology import Topology

POLL_S = 1.0


def _say(t0: float, message: str) -> None:
    print(f"[{time.monotonic() - t0:7.1f}s] {message}", flush=True)


def follow(inv: Inventory, plan: launcher.JobPlan, t0: float, *, steps: int, timeout_s: float) -> dict[str, Any]:
    """Print progress until every machine's part has ended; returns the last statuses."""
    shown = -1
    first_step_s = None
    deadline = time.monotonic() + timeout_s
    while True:
        statuses = launcher.status(inv, plan.job, plan.machines)
        ranks = [r for doc in statuses.values() for r in doc.get("ranks", [])]
        done = launcher.min_step(statuses)
        if done > shown and len(ranks) == plan.topology.world_size:
            if first_step_s is None:
                first_step_s = time.monotonic() - t0
            last = next((r["last_step"] for r in ranks if r["rank"] == 0 and r["last_step"]), None)
            if last:
                _say(t0, f"step {last['step']:4d}/{steps}  loss {_fmt(last['loss'])}  "
                     f"step time {last['step_time_s']:.3f}s  {last['tokens_per_s']:.0f} tokens/s  "
                     f"({len(ranks)} ranks on {len(statuses)} machines)")
            shown = done
        unreachable = [n for n, d in statuses.items() if "error" in d]
        if unreachable:
            _say(t0, f"cannot reach {', '.join(unreachable)}")
        if statuses and all(d.get("state") == "exited" for d in statuses.values()):
            return {"statuses": statuses, "first_step_s": first_step_s}
        if time.monotonic() > deadline:
            _say(t0, f"the job did not finish within {timeout_s:.0f}s; stopping it")
            return {"statuses": statuses, "first_step_s": first_step_s, "timed_out": True}
        time.sleep(POLL_S)


def _fmt(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, float) else str(value)


def report(inv: Inventory, plan: launcher.JobPlan, result: dict[str, Any], t0: float) -> int:
    statuses = result["statuses"]
    codes = {name: doc.get("returncode") for name, doc in statuses.items()}
    first = plan.machines[0]
    steps = statuses.get(first.name, {})
    ok = all(c == 0 for c in codes.values()) and not result.get("timed_out")
    print()
    print("=== run report ===")
    print(f"job           {plan.job}  ({plan.topology}, {plan.topology.world_size} ranks on "
          f"{', '.join(m.name for m in plan.machines)})")
    print(f"exit codes    {codes}")
    if result.get("first_step_s") is not None:
        print(f"first step    {result['first_step_s']:.1f}s after the demo started")
    last = [r["last_step"] for r in steps.get("ranks", []) if r.get("last_step")]
    if last:
        print(f"final step    {last[0]['step']}  loss {_fmt(last[0]['loss'])}")
    records = launcher.steps(inv, plan.job, plan.machines[0], rank=0, incarnation=steps.get("incarnation"))
    if records:
        losses = [r["loss"] for r in records if isinstance(r["loss"], float)]
        times = [r["step_time_s"] for r in records[1:]]
        print(f"loss          {losses[0]:.4f} -> {losses[-1]:.4f}")
        if times:
            print(f"step time     median {statistics.median(times):.3f}s over {len(times)} steps")
    print(f"wall time     {time.monotonic() - t0:.1f}s")
    print("result        " + ("OK: the job trained to the end" if ok else "FAILED: see the machines' job logs"))
    return EXIT_OK if ok else EXIT_UNHEALTHY


def run_demo(args: argparse.Namespace) -> int:
    t0 = time.monotonic()
    topo = Topology.parse(args.topology)
    spec = cluster.ClusterSpec(name=args.name, machines=args.machines, standbys=args.standbys, subnet=args.subnet)
    spec.validate()
    active_needed = topo.machines
    if spec.machines - spec.standbys < active_needed:
        from node_tools.errors import TrainguardError

        raise TrainguardError(
            f"topology {topo} needs {active_needed} active machines; --machines {spec.machines} with "
            f"--standbys {spec.standbys} gives {spec.machines - spec.standbys}"
        )
    if args.steps < 1:
        from node_tools.errors import TrainguardError

        raise TrainguardError(f"--steps {args.steps} must be at least 1")
    _say(t0, f"bringing up the emulated cluster ({spec.machines} machines, {spec.standbys} standbys)")
    inv = cluster.up(spec, args.state_dir, log=lambda msg: _say(t0, msg))
    plan = None
    try:
        for m in inv.machines:
            _say(t0, f"  {m.name}  {m.role:8} {m.address}")
        active = inv.by_role("active")[:active_needed]
        plan = launcher.JobPlan(job="demo", topology=topo, machines=active, train_args=["--steps", str(args.steps)])
        launcher.stop(inv, plan.job, inv.machines, grace_s=3)  # a leftover of an interrupted demo
        launcher.launch(inv, plan)
        _say(t0, f"launched job demo ({topo}) on {', '.join(m.name for m in active)}; waiting for the first step")
        result = follow(inv, plan, t0, steps=args.steps, timeout_s=max(300.0, 10.0 * args.steps))
        return report(inv, plan, result, t0)
    except KeyboardInterrupt:
        _say(t0, "interrupted: cleaning up")
        raise
    finally:
        if plan is not None:
            launcher.stop(inv, plan.job, plan.machines, grace_s=3)
        if args.keep:
            _say(t0, f"cluster left up (--keep); inventory {inv.path}; 'trainguard cluster down' removes it")
        else:
            cluster.down(args.state_dir, name=spec.name, log=lambda msg: _say(t0, msg))
            _say(t0, "cluster down; nothing left running")
        sys.stdout.flush()

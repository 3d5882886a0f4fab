"""The degrade path against stop-the-world, side by side in one run, through the real control plane: GPU-seconds
lost per fault.

On an emulated cluster of its own (5 machines: a job on m0..m2, standbys m3 and m4 parked warm) with a real
``airflow standalone`` running tg_incident (on its alerts asset's watcher), and a torchft lighthouse on the cluster's
bridge:

* **degrade**: ``examples/replicas`` submitted with ``replicas:`` in its spec, three data-parallel replicas of one
  rank each (TP1 x PP1 x DP3, one machine each), every replica a ``torchrun`` group of its own
  (:mod:`trainguard.replicas`). An incident confined to one replica takes it out, swaps its machine for a warm
  standby and starts the group there, where it heals from a live replica; the other two never stop.
* **stop-the-world**: ``examples/plain``, the same model size class and step time, as a plain DDP job of three
  ranks on the same three machines, checkpointing every step (:class:`trainguard.torch.Guard`): today's ladder
  stops it everywhere, evicts or restarts, and restores.

Each path gets the same faults, one trial each by default: ``gpu_lost`` on the second machine, ``crash`` (SIGKILL
of its rank) on the second machine, ``hang`` (SIGSTOP of its rank) on the third. Per trial, over the window from
the fault to ``--window`` seconds after it, from every rank's step records (the ETTR ledger's reading):

* ``gpu_s_lost``: the job's GPU-seconds in the window less those of the steps kept (a step kept: executed and never
  executed again after a restore; one GPU per rank here), each kept step worth the job's median step interval
  before the fault;
* ``others_longest_pause_s`` (degrade): the longest interval between two steps of a replica that did not fail, less
  its usual interval;
* ``full_width_s``: the fault to the first step the whole job trains again (every replica in the quorum; for
  stop-the-world, the resume);
* ``digests_equal`` (degrade): every replica's state digest equal at each step all of them logged after the heal;
* ``steps_lost`` (stop-the-world): steps the restore recomputed.

The goal (the degrade issue): the degrade path's GPU-seconds per fault at most 20% of stop-the-world's.

    python bench/degrade.py [--faults gpu_lost,crash,hang] [--trials 1] [--window 60] [--out FILE]
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import emulated_cluster, stop_on_sigterm, summarize, write_result
from trainguard.core.topology import Topology
from trainguard.emulation import cluster
from trainguard.emulation.guarded import NO_SCHEDULES, Fault, GuardedJob
from trainguard.emulation.replicas import Lighthouse, rank_digests
from trainguard.emulation.standalone import Standalone, poll
from trainguard.operators.jobspec import JobSpec
from trainguard.operators.policy.ettr import StepHistory

SPEC = cluster.ClusterSpec(name="tgdg", machines=5, standbys=2, subnet="10.213.25.0/24", disk_mb=128, gpus=1)
TOPO = Topology(tp=1, pp=1, dp=3)
STEP_S = 0.2
FAULTS = {"gpu_lost": Fault("gpu_lost", node=1, what="a GPU falls off the bus (explicit fault)"),
          "crash": Fault("crash", node=1, rank=1, what="a rank dies with no log to blame"),
          "hang": Fault("hang", node=2, rank=2, what="a rank stops (SIGSTOP)")}
SETTINGS = {**NO_SCHEDULES, "TG_ESCALATION_WINDOW_S": "5", "TG_BREAKER_SHARE": "1.0", "TG_BREAKER_WINDOW_S": "20",
            "TG_RECONCILE_PERIOD_S": "30"}
GOAL = 0.20


def replica_spec(name: str, machines: list[str], lighthouse: str, timeout_s: float) -> JobSpec:
    return JobSpec.model_validate({
        "name": name, "command": ["-m", "examples.replicas.train", "--steps", "0", "--step-time-s", str(STEP_S),
                                  "--digest-every", "10", "--timeout-s", str(timeout_s)],
        "machines": machines, "replicas": {"lighthouse": lighthouse, "min_replicas": 1}})


def world_spec(name: str, machines: list[str]) -> JobSpec:
    return JobSpec.model_validate({
        "name": name, "command": ["-m", "examples.plain.train", "--steps", "0", "--step-time-s", str(STEP_S)],
        "machines": machines})


def _histories(b: GuardedJob) -> dict[int, list[dict[str, Any]]]:
    return {r: b.ctl.step_history(b.job, rank=r) for r in range(TOPO.world_size)}


def _back_to_full_width(records: list[dict[str, Any]]) -> float | None:
    """When a replica's steps after the fault came back to every replica training, after some without them."""
    low = next((i for i, x in enumerate(records) if x.get("participants", TOPO.dp) < TOPO.dp), None)
    if low is None:
        return None
    return next((x["ts"] for x in records[low:] if x.get("participants") == TOPO.dp), None)


def measure(b: GuardedJob, path: str, fault: str, window_s: float) -> dict[str, Any]:
    """One trial: inject, wait for the incident to close and the window to pass, read every rank's records."""
    f = FAULTS[fault]
    b.training(5, timeout=300)
    inc, machine, t_fault = b.fault_and_incident(f)
    end = t_fault + window_s
    poll(lambda: time.time() >= end, timeout=window_s + 5, interval=0.5, what="the window to pass")
    b.training(3, timeout=300)
    records = _histories(b)
    before = sorted(r["ts"] for r in records[0] if r["ts"] < t_fault)[-40:]
    step_s = statistics.median(b_ - a for a, b_ in itertools.pairwise(before))
    kept, redone = {}, {}
    for rank, recs in records.items():
        h = StepHistory(recs)
        kept[rank] = sum(1 for e, k in zip(h.end_ts, h.kept, strict=True) if k and t_fault < e <= end)
        # steps done before the fault and done again after it (the restore went back past them): lost work too
        redone[rank] = sum(1 for e, k in zip(h.end_ts, h.kept, strict=True) if not k and t_fault - 30 < e <= t_fault)
    lost = {rank: max(0.0, window_s - n * step_s) + redone[rank] * step_s for rank, n in kept.items()}
    out: dict[str, Any] = {
        "path": path, "fault": fault, "machine": machine, "incident": inc.id, "state": inc.state,
        "summary": inc.summary[-400:], "step_s": round(step_s, 4), "window_s": window_s,
        "gpu_s_lost": round(sum(lost.values()), 2), "kept_steps": kept, "redone_steps": redone,
        "gpu_s_lost_by_rank": {r: round(v, 2) for r, v in lost.items()}}
    if path == "degrade":
        hit = TOPO.ranks_on(f.node)
        others = [r for r in records if r not in hit]
        pauses = [b_["ts"] - a["ts"] for r in others for a, b_ in itertools.pairwise(records[r])
                  if t_fault <= b_["ts"] <= end]
        out["others_longest_pause_s"] = round(max(pauses) - step_s, 3) if pauses else None
        full = [_back_to_full_width([x for x in records[r] if x["ts"] > t_fault]) for r in others]
        full = [ts for ts in full if ts is not None]
        out["full_width_s"] = round(min(full) - t_fault, 3) if full else None
        healed = [x for x in records[hit[0]] if x["ts"] > t_fault and x.get("healed_from_step") is not None]
        out["healed_from_step"] = healed[0]["healed_from_step"] if healed else None
        digests = [rank_digests(Path(b.inv.machine(n).workdir) / "jobs" / b.job)
                   for n in b.ctl.fleet.job(b.job).machine_list]
        after = healed[0]["step"] if healed else 0
        common = sorted(s for s in set.intersection(*(set(d) for d in digests)) if s > after)
        out["digests_compared"] = len(common)
        out["digests_equal"] = float(bool(common) and all(len({d[s] for d in digests}) == 1 for s in common))
    else:
        out["full_width_s"] = round(inc.resumed_ts - t_fault, 3) if inc.resumed_ts else None
        out["steps_lost"] = inc.lost_steps
    return out


def run_path(b: GuardedJob, path: str, faults: list[str], trials: int, window_s: float,
             results: list[dict[str, Any]]) -> None:
    for fault in [f for f in faults for _ in range(trials)]:
        try:
            t = measure(b, path, fault, window_s)
        except (RuntimeError, TimeoutError) as exc:  # recorded as a failed trial; the next one runs
            print(f"{path} {fault}: failed: {exc}", file=sys.stderr, flush=True)
            t = {"path": path, "fault": fault, "state": "error", "error": str(exc)[:500]}
        results.append(t)
        print({k: v for k, v in t.items() if k not in ("summary", "kept_steps", "gpu_s_lost_by_rank")}, flush=True)
        b.settled()
        b.repair()


def metrics_of(trials: list[dict[str, Any]], faults: list[str]) -> dict[str, Any]:
    ok = [t for t in trials if t.get("state") == "resolved"]
    m: dict[str, Any] = {}
    ratios = []
    for fault in faults:
        lost = {p: [t["gpu_s_lost"] for t in ok if t["path"] == p and t["fault"] == fault]
                for p in ("degrade", "stop_world")}
        for p, values in lost.items():
            if values:
                m[f"gpu_s_lost.{p}.{fault}"] = summarize(values, "GPU-s")
        if lost["degrade"] and lost["stop_world"]:
            ratio = statistics.median(lost["degrade"]) / max(1e-9, statistics.median(lost["stop_world"]))
            ratios.append(ratio)
            m[f"ratio.{fault}"] = {"value": round(ratio, 3), "unit": "x", "target": GOAL, "met": ratio <= GOAL,
                                   "n": len(lost["degrade"]) + len(lost["stop_world"])}
    if ratios:
        m["ratio"] = {"value": round(statistics.median(ratios), 3), "unit": "x (median over the faults)",
                      "target": GOAL, "met": statistics.median(ratios) <= GOAL, "n": len(ratios)}
    pauses = [t["others_longest_pause_s"] for t in ok if t.get("others_longest_pause_s") is not None]
    if pauses:
        m["others_longest_pause_s"] = summarize(pauses, "s")
    for p in ("degrade", "stop_world"):
        full = [t["full_width_s"] for t in ok if t["path"] == p and t.get("full_width_s") is not None]
        if full:
            m[f"full_width_s.{p}"] = summarize(full, "s")
    digests = [t["digests_equal"] for t in ok if "digests_equal" in t]
    if digests:
        m["digests_equal"] = {"value": min(digests), "unit": "all equal (1) or not (0)", "n": len(digests)}
    m["trials_failed"] = {"value": len(trials) - len(ok), "unit": "trials", "n": len(trials)}
    return m


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--faults", default=",".join(FAULTS))
    ap.add_argument("--trials", type=int, default=1, help="trials per fault and path (default 1)")
    ap.add_argument("--window", type=float, default=45.0, help="seconds after each fault that are counted")
    ap.add_argument("--paths", default="degrade,stop_world")
    ap.add_argument("--heartbeat-ms", type=int, default=1000, help="the lighthouse's heartbeat timeout")
    ap.add_argument("--join-ms", type=int, default=300, help="the lighthouse's join timeout")
    ap.add_argument("--collective-timeout-s", type=float, default=2.0,
                    help="the replica job's collective timeout (a stopped group holds the others this long)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    stop_on_sigterm()
    if os.geteuid() != 0:
        print("bench/degrade.py needs root (network namespaces)", file=sys.stderr)
        return 2
    faults = [f for f in args.faults.split(",") if f]
    unknown = sorted(set(faults) - set(FAULTS))
    if unknown:
        print(f"--faults: unknown fault {', '.join(unknown)}; use some of {', '.join(FAULTS)}", file=sys.stderr)
        return 2
    paths = [p for p in args.paths.split(",") if p]
    trials: list[dict[str, Any]] = []
    with emulated_cluster(SPEC, "tg-bench-degrade-") as (inv, home):
        active = [m.name for m in inv.by_role("active")][: TOPO.machines]
        lighthouse = Lighthouse(SPEC.host_address, home / "lighthouse.log", heartbeat_timeout_ms=args.heartbeat_ms,
                                join_timeout_ms=args.join_ms).start()
        env = {"TG_FLEET_URL": str(home / "fleet.db"), "TG_INVENTORY": str(inv.path), "TG_CONTROL_HOME": str(home),
               **SETTINGS}
        airflow = Standalone(home / "airflow", env)
        launched = False
        try:
            for path in paths:
                job = "replicas" if path == "degrade" else "world"
                spec = (replica_spec(job, active, lighthouse.url, args.collective_timeout_s) if path == "degrade"
                        else world_spec(job, active))
                b = GuardedJob(inv, home, job=job, topology=TOPO, settings=SETTINGS, airflow=airflow, spec=spec)
                b.start(launch_airflow=not launched)
                launched = True
                try:
                    run_path(b, path, faults, args.trials, args.window, trials)
                finally:
                    active = list(b.ctl.fleet.job(job).machine_list)  # the next job runs where this one ended
                    b.ctl.release(job)
        finally:
            airflow.stop(grace_s=10.0)
            lighthouse.stop()
    text = write_result("degrade", quick=False, out=args.out, metrics=metrics_of(trials, faults), setup={
        "cluster": "5 emulated machines (network namespaces, real sshd), 3 active, 2 warm standbys",
        "layout": f"TP{TOPO.tp} x PP{TOPO.pp} x DP{TOPO.dp}, one rank (GPU) per machine",
        "degrade": f"examples/replicas as three replica groups (trainguard.replicas over torchft: a lighthouse with a "
                   f"{args.heartbeat_ms} ms heartbeat and {args.join_ms} ms join timeout, gloo with a "
                   f"{args.collective_timeout_s:g} s collective timeout), no checkpoint: a replica heals from a live "
                   f"one",
        "stop_world": "examples/plain as one DDP job, checkpoint every step (trainguard.torch.Guard), today's ladder",
        "step_sleep_s": STEP_S, "window_s": args.window,
        "control_plane": "airflow standalone (LocalExecutor), tg_incident on the alerts asset's watcher",
        "trials": trials})
    print(text)
    return 0 if trials and all(t.get("state") == "resolved" for t in trials) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Fault campaign: many faults of every kind, at random times and on random machines, under the real
control plane; how many were detected, whether the faulty machines (and only they, or their parallel
group) were evicted, how fast training resumed, and what the control plane did in the quiet periods
between faults.

On an emulated cluster of its own (8 machines: the guarded job, TP=2 PP=2 DP=2, on 4; 4 warm
standbys; a repair crew puts evicted machines back after each fault) with a real ``airflow
standalone``: for each trial a fault kind is drawn (seeded; every kind ``trials // kinds`` times or once more, in a
shuffled order), a machine of the job and, for rank faults,
one of its ranks; the fault is injected after a quiet period of random length, and the trial ends when
the incident holding its alerts closed (or its time ran out: not detected / not recovered).

Per fault: detected, time to the first alert, the machines evicted, whether the faulty machine was
among them (for faults that are the machine's: explicit GPU and disk faults, repeated NIC flaps, hangs
and slow ranks, silent corruption), healthy machines evicted beyond the faulty machine's parallel
group, fault -> training resumed, steps lost. In the quiet periods: incidents opened and machines
evicted with no fault injected.

    python bench/campaign.py [--quick] [--trials 30] [--seed 7] [--kinds gpu_lost,hang,...] [--out FILE]

Targets (the main-job issue): detection >= 98%, 100% of faulty machines evicted, no eviction in a quiet
period, over-eviction bounded by one parallel group.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import emulated_cluster, seconds_range, stop_on_sigterm, summarize, write_result
from trainguard.core.topology import Topology
from trainguard.emulation import cluster
from trainguard.emulation.guarded import DEVICE_TRAIN_ARGS, FAULTS, NO_SCHEDULES, TOPOLOGY, Fault, GuardedJob

SPEC = cluster.ClusterSpec(name="tgc", machines=8, standbys=4, subnet="10.213.20.0/24", disk_mb=256, gpus=8)
JOB = "campaign"
# faults that are the machine's: its eviction is the right answer. The others (a NaN, a crash with a
# clean diagnosis, a bad revision) are not, and evicting anybody for them is over-eviction.
MACHINE_FAULTS = frozenset({"gpu_lost", "disk_full", "nic_down", "hang", "slow", "sdc", "bitflip"})
KINDS = ("gpu_lost", "disk_full", "nic_down", "crash", "hang", "nan", "sdc", "slow", "user_error")
TARGETS = {"detection_rate": 0.98, "faulty_evicted_rate": 1.0, "healthy_evicted_quiet": 0,
           "over_eviction_groups_max": 1}
SETTINGS = {"TG_ESCALATION_WINDOW_S": "1", "TG_BREAKER_SHARE": "0.75", "TG_BREAKER_WINDOW_S": "1",
            "TG_SLOW_ROUNDS": "5", "TG_SLOW_INTERVAL_S": "3", **NO_SCHEDULES}


def where(kind: str, topo: Topology) -> list[tuple[int, int | None]]:
    """The (node, rank) places a fault of ``kind`` can hit: a machine fault any machine, a rank fault
    any rank where it acts (only the last pipeline stage computes the loss a NaN corrupts; the bad
    revision's bug is in the first rank's data path)."""
    base = FAULTS[kind]
    if base.rank is None:
        return [(n, None) for n in range(topo.machines)]
    if base.bad_revision:
        return [(base.node, base.rank)]
    ranks = range(topo.world_size)
    if kind == "nan":
        ranks = [r for r in ranks if topo.coords(r).pp == topo.pp - 1]
    return [(topo.machine_of(r), r) for r in ranks]


def groups_of(topo: Topology, node: int) -> list[set[int]]:
    """The node indices of each parallel group (pipeline, data-parallel) holding a rank of ``node``."""
    out = []
    for rank in topo.ranks_on(node):
        for kind in ("pp", "dp"):
            out.append(set(topo.machines_of_group(kind, rank)))
    return out


def over_eviction_groups(topo: Topology, machines: Sequence[str], faulty: str, evicted: set[str]) -> int:
    """How far the eviction reached beyond the faulty machine: 0 when it evicted at most the faulty
    machine, 1 when the rest lies within one parallel group holding it, otherwise 1 + the machines
    evicted outside the group that explains most of them (the bound is broken: 2 or more)."""
    extra = evicted - {faulty}
    if not extra:
        return 0
    if faulty not in machines:
        return 1 + len(extra)
    nodes = {machines.index(m) for m in evicted if m in machines}
    unknown = len([m for m in evicted if m not in machines])
    outside = min(len(nodes - g) for g in groups_of(topo, machines.index(faulty))) + unknown
    return 1 if outside == 0 else 1 + outside


def score(trial: Mapping[str, Any], topo: Topology) -> dict[str, Any]:
    """A trial's verdicts: detected, faulty machine evicted (None when its eviction is not the right
    answer), healthy machines evicted, the groups over-evicted."""
    evicted = set(trial.get("evicted") or ())
    faulty, machines = trial["machine"], trial["machines"]
    expected = trial["fault"] in MACHINE_FAULTS
    return {
        "detected": trial.get("incident") is not None,
        "faulty_evicted": (faulty in evicted) if expected else None,
        "healthy_evicted": sorted(evicted - {faulty}) if expected else sorted(evicted),
        "over_eviction_groups": over_eviction_groups(topo, machines, faulty, evicted) if expected
        else len(evicted),
    }


def metrics_of(trials: Sequence[Mapping[str, Any]], quiet: Mapping[str, Any],
               cumulative: Mapping[str, Any] | None) -> dict[str, Any]:
    """The campaign's metrics (../shared/DESIGN.md's names) from scored trials, the quiet periods and the
    job's cumulative ETTR report (``ettr``, ``productive_s``, ``wall_s``).

    The campaign injects the next fault once the last one's run ended and a quiet period passed, so a
    faster control plane also means faults come more often: the ETTR alone does not compare two runs.
    The job time lost per fault (wall minus productive, over the faults) and the faults per hour do."""
    n = len(trials)
    detected = [t for t in trials if t["detected"]]
    expected = [t for t in trials if t["faulty_evicted"] is not None]
    metrics: dict[str, Any] = {
        "detection_rate": {"value": round(len(detected) / n, 4) if n else None, "n": n, "unit": "ratio",
                           "target": TARGETS["detection_rate"]},
        "faulty_evicted_rate": {"value": round(sum(t["faulty_evicted"] for t in expected) / len(expected), 4)
                                if expected else None, "n": len(expected), "unit": "ratio",
                                "target": TARGETS["faulty_evicted_rate"]},
        "healthy_evicted_quiet": {"value": quiet["evicted"], "n": quiet["periods"], "unit": "machines",
                                  "target": TARGETS["healthy_evicted_quiet"]},
        "false_incidents_quiet": {"value": quiet["incidents"], "n": quiet["periods"], "unit": "incidents",
                                  "quiet_s": round(quiet["seconds"], 1)},
        "over_eviction_groups_max": {"value": max((t["over_eviction_groups"] for t in trials), default=0), "n": n,
                                     "unit": "groups", "target": TARGETS["over_eviction_groups_max"]},
        "healthy_evicted_per_incident": {"value": round(sum(len(t["healthy_evicted"]) for t in detected)
                                                        / len(detected), 3) if detected else None,
                                         "n": len(detected), "unit": "machines"},
    }
    resumed = [t["fault_to_resumed_s"] for t in trials if t.get("fault_to_resumed_s")]
    if resumed:
        s = summarize(resumed, "s")
        metrics["resume_s_p50"] = {"value": s["median"], "n": s["n"], "unit": "s"}
        metrics["resume_s_p90"] = {"value": s["p90"], "n": s["n"], "unit": "s"}
    detect = [t["detect_s"] for t in trials if t.get("detect_s") is not None]
    if detect:
        metrics["detect_s"] = summarize(detect, "s")
    if cumulative is not None:
        wall, productive = float(cumulative["wall_s"]), float(cumulative["productive_s"])
        metrics["ettr"] = {"value": round(float(cumulative["ettr"]), 4), "n": 1, "unit": "ratio",
                           "productive_s": round(productive, 1), "wall_s": round(wall, 1)}
        if n and wall > 0:
            metrics["lost_s_per_fault"] = {"value": round((wall - productive) / n, 2), "n": n, "unit": "s"}
            metrics["faults_per_hour"] = {"value": round(n / wall * 3600, 1), "n": n, "unit": "1/h"}
    return metrics


class Campaign(GuardedJob):
    def __init__(self, inv: Any, home: Path, *, seed: int) -> None:
        super().__init__(inv, home, job=JOB, settings=SETTINGS, train_args=DEVICE_TRAIN_ARGS)
        self.rng = random.Random(seed)
        self.trials: list[dict[str, Any]] = []
        self.quiet = {"periods": 0, "seconds": 0.0, "incidents": 0, "evicted": 0, "details": []}

    def quiet_period(self, seconds: float) -> None:
        """Train with no fault for ``seconds``; count incidents opened and machines evicted meanwhile."""
        last = self.last_incident()
        time.sleep(seconds)
        self.settled()
        new = [i for i in self.ctl.fleet.incidents(JOB) if i.id > last]
        evicted = sorted({m for i in new for a in self.ctl.fleet.actions(i.id) if a.kind == "evict"
                          and a.outcome == "done" for m in a.machines})
        self.quiet["periods"] += 1
        self.quiet["seconds"] += seconds
        self.quiet["incidents"] += len(new)
        self.quiet["evicted"] += len(evicted)
        if new:
            self.quiet["details"].append({"incidents": [(i.id, i.category, i.summary[:160]) for i in new],
                                          "evicted": evicted})
            print(f"quiet period: {len(new)} incident(s) with no fault: {self.quiet['details'][-1]}", flush=True)

    def trial(self, kind: str) -> dict[str, Any]:
        self.settled()
        self.repair()
        machines = list(self.ctl.fleet.job(JOB).machine_list)
        node, rank = self.rng.choice(where(kind, self.topology))
        fault: Fault = replace(FAULTS[kind], node=node, rank=rank)
        if fault.bad_revision:
            self.deploy_bad_revision()
            machines = list(self.ctl.fleet.job(JOB).machine_list)
        self.training()
        trial: dict[str, Any] = {"fault": kind, "machine": machines[node], "rank": rank, "machines": machines}
        try:
            inc, _, t_fault = self.fault_and_incident(fault, machine=machines[node])
        except TimeoutError as exc:
            trial.update({"incident": None, "state": "timeout", "error": str(exc)[:300]})
        else:
            alerts = self.ctl.fleet.alerts_of(inc.id)
            trial.update({
                "incident": inc.id, "state": inc.state, "category": inc.category,
                "evicted": sorted(self.swaps(inc.id)),
                "fault_ts": round(t_fault, 3),
                "detect_s": min((a.ts for a in alerts if a.ts >= t_fault), default=t_fault) - t_fault,
                "fault_to_resumed_s": inc.resumed_ts - t_fault if inc.resumed_ts else None,
                "lost_steps": inc.lost_steps})
        trial.update(score(trial, self.topology))
        print(f"trial {len(self.trials) + 1} {kind} on {trial['machine']}: " + ", ".join(
            f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in trial.items()
            if k not in ("fault", "machine", "machines", "error", "fault_ts")), flush=True)
        self.trials.append(trial)
        return trial


def balanced_draws(rng: random.Random, kinds: Sequence[str], n: int) -> list[str]:
    """``n`` fault kinds in a random order, each of ``kinds`` ``n // len(kinds)`` times and the remainder
    drawn without repetition: every kind is tried once ``n >= len(kinds)``, however the seed falls."""
    draws = list(kinds) * (n // len(kinds)) + rng.sample(list(kinds), n % len(kinds))
    rng.shuffle(draws)
    return draws


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="3 trials, short quiet periods")
    ap.add_argument("--trials", type=int, default=30)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"fault kinds to draw from (default {','.join(KINDS)})")
    ap.add_argument("--quiet-s", default="20,60", help="quiet period before each fault: MIN,MAX seconds")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    stop_on_sigterm()
    if os.geteuid() != 0:
        print("bench/campaign.py needs root (network namespaces)", file=sys.stderr)
        return 2
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = [k for k in kinds if k not in FAULTS]
    if unknown or not kinds:
        print(f"--kinds: unknown fault kind {', '.join(unknown) or '(none given)'}; use some of {', '.join(FAULTS)}",
              file=sys.stderr)
        return 2
    quiet_range = seconds_range(args.quiet_s)
    if quiet_range is None:
        print(f"--quiet-s {args.quiet_s!r}: write MIN,MAX seconds, MIN <= MAX, e.g. 20,60", file=sys.stderr)
        return 2
    lo, hi = quiet_range
    n = 3 if args.quick else args.trials
    if args.quick:
        lo, hi = 10.0, 15.0
    cumulative = None
    with emulated_cluster(SPEC, "tg-bench-campaign-") as (inv, home):
        c = Campaign(inv, home, seed=args.seed)
        draws = balanced_draws(c.rng, kinds, n)
        try:
            c.start()
            for kind in draws:
                c.quiet_period(c.rng.uniform(lo, hi))
                c.trial(kind)
            c.settled()
            cumulative = c.ctl.ettr_report(JOB)["cumulative"]
        finally:
            c.stop()
    metrics = metrics_of(c.trials, c.quiet, cumulative)
    text = write_result("campaign", quick=bool(args.quick), out=args.out, metrics=metrics, setup={
        "cluster": f"{SPEC.machines} emulated machines (network namespaces, real sshd): the job's "
                   f"{TOPOLOGY.machines}, {SPEC.standbys} warm standbys; evicted machines repaired after each fault",
        "job": f"reference GPT {TOPOLOGY.tp}x{TOPOLOGY.pp}x{TOPOLOGY.dp} (TP x PP x DP), checkpoint every step, "
               f"0.2 s of emulated accelerator time per step",
        "control_plane": "airflow standalone (LocalExecutor) running trainguard's DAGs; escalation and breaker "
                         "windows 1 s (every fault a first failure); fail-slow vote 5 rounds 3 s apart",
        "seed": args.seed, "kinds": kinds, "quiet_s": [lo, hi], "machine_faults": sorted(MACHINE_FAULTS),
        "quiet": c.quiet, "trials": c.trials,
    })
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

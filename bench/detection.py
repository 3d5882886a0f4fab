"""Detection benchmark: time from a fault taking effect to its alert on the bus.

On an emulated cluster of its own, for every fault kind: inject the real fault,
wait for the expected alert from the machine's agent, and record the alert's
time minus the time the fault took effect (recorded by the machine when it
applied it). Several trials per kind. Also counts alerts during a quiet,
healthy training period (false alerts per hour).

    python bench/detection.py [--quick] [--trials N] [--quiet-s S] [--out FILE]

Targets (from the data-plane issue; ByteRobust's are 2-30 s, a PyTorch
collective timeout 10 min): crash <= 1 s, hang <= 10 s, GPU lost / Xid <= 5 s,
NIC down <= 10 s, NaN within the step.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import summarize, write_result
from trainguard.core.topology import Topology
from trainguard.emulation import cluster, inject
from trainguard.node_tools import launcher, monitor
from trainguard.node_tools.alerts import Alert
from trainguard.node_tools.bus import BusReader, open_bus
from trainguard.node_tools.inventory import Inventory, Machine
from trainguard.operators.jobspec import REFERENCE_ENTRY

SPEC = cluster.ClusterSpec(name="tgd", machines=6, standbys=2, subnet="10.213.13.0/24", disk_mb=64, gpus=8)
TARGETS = {"crash": 1.0, "hang": 10.0, "hang_collective": 10.0, "gpu_lost": 5.0, "xid": 5.0, "nic_down": 10.0,
           "nan_steps_late": 0.0}
UNITS = {"nan_steps_late": "steps"}


class Watch:
    def __init__(self, inv: Inventory) -> None:
        self.reader = BusReader.from_now(open_bus(inv.bus_url))
        self.seen: list[Alert] = []

    def drain(self) -> list[Alert]:
        self.seen += self.reader.read()
        return self.seen

    def wait(self, pred: Callable[[Alert], bool], after: int, timeout: float) -> Alert:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for a in self.drain()[after:]:
                if pred(a):
                    return a
            time.sleep(0.05)
        saw = [(a.kind, a.machine) for a in self.seen[after:]]
        raise RuntimeError(f"no matching alert within {timeout:.0f}s; saw {saw}")


def run_dir(m: Machine, job: str) -> Path:
    return Path(m.workdir) / "jobs" / job


def wait_steps(plan: launcher.JobPlan, step: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = []
        for i, m in enumerate(plan.machines):
            for r in plan.topology.ranks_on(i):
                recs = monitor.read_steps(run_dir(m, plan.job), r)
                done.append(recs[-1]["step"] if recs else -1)
        if min(done) >= step:
            return
        time.sleep(0.1)
    raise RuntimeError(f"job {plan.job} did not reach step {step}")


class Bench:
    def __init__(self, inv: Inventory, trials: int) -> None:
        self.inv = inv
        self.trials = trials
        self.watch = Watch(inv)
        self.port = 29700
        self.results: dict[str, list[float]] = {}
        self.missed: dict[str, int] = {}

    def job(self, name: str, topo: Topology, machines: list[str]) -> launcher.JobPlan:
        self.port += 1
        plan = launcher.JobPlan(job=name, topology=topo, machines=[self.inv.machine(m) for m in machines],
                                master_port=self.port, entry=REFERENCE_ENTRY, pass_layout=True)
        launcher.stop(self.inv, name, plan.machines, grace_s=2)
        launcher.launch(self.inv, plan)
        wait_steps(plan, 12)  # calibration and baselines need some history
        return plan

    def measure(self, fault: str, machine: str, alert_kind: str, *, rank: int | None = None,
                alert_rank: int | None = None, params: dict[str, str] | None = None, severity: str | None = None,
                timeout: float = 60, plan: launcher.JobPlan | None = None) -> None:
        """Inject ``fault``; time until ``alert_kind`` from ``machine`` (for ``alert_rank``, default ``rank``)."""
        alert_rank = rank if alert_rank is None else alert_rank
        mark = len(self.watch.drain())
        before = time.time()
        doc = inject.inject(self.inv, machine, fault, rank=rank, params=params)
        effect_ts = doc.get("ts", before)
        try:
            alert = self.watch.wait(
                lambda a: a.kind == alert_kind and a.machine == machine and alert_rank in (None, a.rank)
                and (severity is None or a.severity == severity), mark, timeout)
            self.results.setdefault(fault, []).append(max(0.0, alert.ts - effect_ts))
            extra = self._nan_timing(plan, alert) if fault == "nan" and plan else {}
            print(json.dumps({"fault": fault, "alert": alert_kind, "detect_s": round(alert.ts - effect_ts, 3),
                              **extra}), flush=True)
        except RuntimeError as exc:
            self.missed[fault] = self.missed.get(fault, 0) + 1
            print(json.dumps({"fault": fault, "missed": str(exc)}), flush=True)
        finally:
            inject.clear(self.inv, machine, fault)

    def _nan_timing(self, plan: launcher.JobPlan, alert: Alert) -> dict[str, Any]:
        """For NaN: seconds from the end of the step that produced it, and steps finished before the alert."""
        rank = alert.rank or 0
        machine = plan.machines[plan.topology.machine_of(rank)]
        records = monitor.read_steps(run_dir(machine, plan.job), rank)
        first = next((r for r in records if r["loss"] == "nan"), None)
        if first is None:
            return {}
        late = sum(1 for r in records if first["ts"] < r["ts"] <= alert.ts)
        after_step = alert.ts - first["ts"]
        self.results.setdefault("nan_after_step", []).append(max(0.0, after_step))
        self.results.setdefault("nan_steps_late", []).append(float(late))
        return {"after_nan_step_s": round(after_step, 3), "steps_late": late}

    # ---- the faults ------------------------------------------------------------------------
    def rank_faults_that_end_jobs(self) -> None:
        one = Topology(tp=2, pp=1, dp=1)
        for fault in ("crash", "exit", "user_error", "nan"):
            for i in range(self.trials):
                machine = ("m4", "m5")[i % 2]
                plan = self.job(f"{fault}{i}", one, [machine])
                self.measure(fault, machine, "rank_exit" if fault != "nan" else "nan_loss", rank=1, plan=plan)
                launcher.stop(self.inv, plan.job, plan.machines, grace_s=2)

    def sdc(self) -> None:
        pair = Topology(tp=1, pp=1, dp=2, ranks_per_machine=1)
        for i in range(self.trials):
            plan = self.job(f"sdc{i}", pair, ["m4", "m5"])
            self.measure("sdc", "m5", "sdc_suspect", alert_rank=1)
            launcher.stop(self.inv, plan.job, plan.machines, grace_s=2)

    def faults_a_job_survives(self) -> None:
        plan = self.job("survive", Topology(tp=2, pp=2, dp=2), ["m0", "m1", "m2", "m3"])
        for i in range(self.trials):
            self.measure("hang", "m1", "rank_stopped", rank=3)
            wait_steps(plan, self._last(plan) + 3)
            self.measure("hang_collective", "m2", "rank_hang", rank=4)
            wait_steps(plan, self._last(plan) + 12)  # the agents' step-time baselines refill
            self.measure("slow", "m3", "rank_slow", rank=6, params={"seconds": "1.0"})
            wait_steps(plan, self._last(plan) + 12)
            print(json.dumps({"round": i, "step": self._last(plan)}), flush=True)
        launcher.stop(self.inv, plan.job, plan.machines, grace_s=2)

    def _last(self, plan: launcher.JobPlan) -> int:
        recs = monitor.read_steps(run_dir(plan.machines[0], plan.job), 0)
        return recs[-1]["step"] if recs else 0

    def machine_faults(self) -> None:
        for i in range(self.trials):
            m = ("m4", "m5")[i % 2]
            self.measure("gpu_lost", m, "gpu_lost")
            self.measure("xid", m, "gpu_xid", params={"xid": "79"})
            self.measure("ecc", m, "gpu_ecc")
            self.measure("thermal", m, "gpu_thermal")
            self.measure("disk_full", m, "disk_full")
            self.measure("nic_down", m, "nic_down", severity="fault")

    def quiet(self, seconds: float) -> dict[str, Any]:
        plan = self.job("quiet", Topology(tp=2, pp=2, dp=2), ["m0", "m1", "m2", "m3"])
        mark = len(self.watch.drain())
        start = time.monotonic()
        time.sleep(seconds)  # the measured period itself: a fault-free run of this length
        alerts = self.watch.drain()[mark:]
        launcher.stop(self.inv, plan.job, plan.machines, grace_s=2)
        hours = (time.monotonic() - start) / 3600
        return {"false_alerts": len(alerts), "hours": hours,
                "kinds": sorted({f"{a.kind}@{a.machine}" for a in alerts})}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one trial per fault and a short quiet period")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--quiet-s", type=float, default=180.0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("bench/detection.py needs root (network namespaces)", file=sys.stderr)
        return 2
    trials, quiet_s = (1, 30.0) if args.quick else (args.trials, args.quiet_s)
    with tempfile.TemporaryDirectory(prefix="tg-bench-detect-") as tmp:
        state = Path(tmp) / "state"
        cluster.down(state, name=SPEC.name, log=lambda *_: None)
        inv = cluster.up(SPEC, state, log=lambda *_: None)
        try:
            b = Bench(inv, trials)
            b.machine_faults()
            b.rank_faults_that_end_jobs()
            b.sdc()
            b.faults_a_job_survives()
            quiet = b.quiet(quiet_s)
        finally:
            cluster.down(state, name=SPEC.name, log=lambda *_: None)
    metrics: dict[str, Any] = {}
    for fault, values in sorted(b.results.items()):
        metrics[f"detect_s.{fault}"] = summarize(values, UNITS.get(fault, "s"), TARGETS.get(fault))
        if b.missed.get(fault):
            metrics[f"detect_s.{fault}"]["missed"] = b.missed[fault]
    metrics["false_alerts_per_hour"] = {"median": round(quiet["false_alerts"] / quiet["hours"], 2), "p90": None,
                                        "n": 1, "unit": "alerts/h", "target": 0,
                                        "observed_s": round(quiet["hours"] * 3600, 1), "kinds": quiet["kinds"]}
    text = write_result("detection", quick=bool(args.quick), out=args.out, metrics=metrics,
                        setup={"cluster": "6 machines, 4 active", "trials": trials, "quiet_s": quiet_s})
    print(text)
    return 1 if b.missed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Scheduled-operations benchmark: hot update vs full restart, standby activation vs cold provisioning,
checkpoint verification throughput, side by side in one run.

On an emulated cluster of its own (5 machines: the job, TP=2 DP=2, on m0 and m1; m2 a warm standby;
m3 and m4 free), through the same controller and pool code the DAG tasks call (Airflow's task start-up
is not in these numbers; the recovery benchmark measures it):

* **hot update** (``Controller.hot_update``, what ``tg_code_update`` does when urgent): stop, switch the
  revision, restart in place on the parked warm interpreters, until every rank passed the restored step;
  **full restart** of the same job for the same change, the way a requeue does it: stop, nothing warm,
  the L1 + L2 self-check of every machine of the allocation, every part started cold, restore. Trials
  alternate; the paper's hot update is ~10x faster (Table 7: 46-65 s vs 454-768 s).
* **standby activation vs cold provisioning**: a machine of the job is replaced by a parked standby
  (evict, restart: until training resumed) vs by a free machine provisioned on the spot (its L1 + L2
  self-check, then the same restart with that machine cold). Alternating.
* **verification throughput**: ``trainguard.checkpoint.verify.verify_step`` (checksums, safetensors load, finite
  values, great-expectations metric checks) over the newest committed step of every machine's
  checkpoint root, in GB of checkpoint verified per second.

    python bench/operations.py [--quick] [--trials N] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import emulated_cluster, stop_on_sigterm, summarize, write_result
from trainguard.checkpoint import layout
from trainguard.checkpoint.verify import verify_step
from trainguard.core.topology import Topology
from trainguard.emulation import cluster
from trainguard.emulation.standalone import poll
from trainguard.node_tools.inventory import Inventory
from trainguard.operators.control import ControlConfig, Controller
from trainguard.operators.fleet import states

SPEC = cluster.ClusterSpec(name="tgo", machines=5, standbys=1, free=2, subnet="10.213.19.0/24", disk_mb=256, gpus=8)
TOPO = Topology(tp=2, pp=1, dp=2)
JOB = "bench-ops"
TRAIN = ["--checkpoint", "--step-delay-s", "0.2"]
TARGETS = {"hot_vs_full_speedup": 10.0}


class Bench:
    def __init__(self, inv: Inventory, home: Path) -> None:
        self.inv = inv
        cfg = ControlConfig(fleet_url=str(home / "fleet.db"), inventory=str(inv.path), breaker_share=1.0,
                            breaker_window_s=1.0)
        self.ctl = Controller(cfg)
        self.ctl.sync_inventory()
        self.trials: list[dict[str, Any]] = []
        self.revision = 0

    def training(self, steps: int = 2) -> None:
        start = self.ctl.progress(JOB)["step"]
        poll(lambda: self.ctl.progress(JOB)["step"] >= start + steps, timeout=180, interval=0.5,
             what="the job to train")

    def resumed(self, restart_ts: float) -> dict[str, Any]:
        return poll(lambda: self.ctl.resumed(JOB, restart_ts), timeout=300, interval=0.25,
                    what="training after the restart")

    def next_revision(self) -> str:
        self.revision += 1
        rev = f"b{self.revision}"
        self.ctl.fleet.record_revision(JOB, rev, reason="benchmark")
        return rev

    # ---- hot update vs full restart -------------------------------------------------------------
    def hot(self) -> None:
        self.ctl.arm(JOB)
        self.training()
        t0 = time.time()
        out = self.ctl.hot_update(JOB, self.next_revision(), reason="benchmark: hot update")
        info = self.resumed(out["restart_ts"])
        self._add("hot_update", t0, info, warm=out["warm"])

    def full(self) -> None:
        machines = list(self.ctl.fleet.job(JOB).machine_list)
        self.training()
        t0 = time.time()
        self.ctl.stop(JOB)
        self.ctl.transport.run_many(self.ctl.machines(machines), lambda m: [self.inv.tg_node, "standby", "unpark"],
                                    timeout=60)
        check = self.ctl.diagnose(JOB, machines, levels=(1, 2))
        if check["failed"]:
            raise RuntimeError(f"the full restart's self-check failed: {check['failed']}")
        out = self.ctl.hot_update(JOB, self.next_revision(), reason="benchmark: full restart")  # nothing warm
        info = self.resumed(out["restart_ts"])
        self._add("full_restart", t0, info, warm=out["warm"], self_check_s=check["seconds"])

    # ---- standby activation vs cold provisioning --------------------------------------------------
    def spares(self) -> list[str]:
        """Machines no job holds and the pool has not checked: free inventory, or back from repair."""
        return [m.name for m in self.ctl.fleet.machines() if m.state in (states.PROVISIONING, states.REPAIR)]

    def ensure_parked_standby(self) -> None:
        """One self-checked standby with warm interpreters parked (outside the timed part)."""
        standbys = [m.name for m in self.ctl.fleet.machines(state=states.STANDBY)]
        name = standbys[0] if standbys else self.spares()[0]
        if not standbys:
            self.ctl.fleet.transition(name, states.SELF_CHECK, reason="pool: provision")
        parked = self.ctl.transport.run(self.inv.machine(name), [self.inv.tg_node, "standby", "park", "--nproc", "2"],
                                        timeout=240)
        if not parked.ok:
            raise RuntimeError(f"parking {name} failed: {parked.describe()}")
        self.ctl.fleet.transition(name, states.STANDBY, reason="self-check passed (parked warm)", checked=True)

    def replace(self, *, warm: bool) -> None:
        """Node rank 1 of the job is replaced: by a parked standby, or by a machine provisioned on the spot
        (its L1 + L2 self-check, then it joins with nothing warm). The survivor restarts warm either way."""
        self.ctl.arm(JOB)
        fresh = ""
        if warm:
            self.ensure_parked_standby()
        else:
            fresh = self.spares()[0]
            self.ctl.transport.run(self.inv.machine(fresh), [self.inv.tg_node, "standby", "unpark"], timeout=60)
        held = [m.name for m in self.ctl.fleet.machines(state=states.STANDBY)] if not warm else []
        for name in held:  # the standbys step aside, so the eviction takes the machine provisioned now
            self.ctl.fleet.transition(name, states.SELF_CHECK, reason="benchmark: held aside")
        self.training()
        leaving = self.ctl.fleet.job(JOB).machine_list[1]
        t0 = time.time()
        check_s = None
        if fresh:
            self.ctl.fleet.transition(fresh, states.SELF_CHECK, reason="pool: provision")
            check = self.ctl.diagnose("", [fresh], levels=(1, 2))
            if check["failed"]:
                raise RuntimeError(f"provisioning {fresh} failed its self-check: {check['failed']}")
            check_s = check["seconds"]
            self.ctl.fleet.transition(fresh, states.STANDBY, reason="self-check passed (not parked)", checked=True)
        inc, _ = self.ctl.fleet.open_incident(JOB, [], category="benchmark")
        self.ctl.evict(inc.id, [leaving], reason="benchmark: replace a machine")
        restart = self.ctl.recover(inc.id)
        info = self.resumed(restart["restart_ts"])
        self.ctl.close(inc.id, outcome="resolved", resumed=info, steps_before=restart["steps_before"],
                       note="benchmark replacement")
        joined = self.ctl.fleet.job(JOB).machine_list[1]
        self._add("standby_activation" if warm else "cold_provisioning", t0, info, joined=joined,
                  warm=restart["warm"], self_check_s=check_s)
        self.ctl.fleet.transition(leaving, states.REPAIR, reason="benchmark: replaced")
        for name in held:
            self.ctl.fleet.transition(name, states.STANDBY, reason="self-check passed (parked warm)", checked=True)

    # ---- verification ---------------------------------------------------------------------------------
    def verify(self) -> None:
        """Every machine's newest committed step, verified in full (the job stopped: retention would
        remove copies under the reader)."""
        totals = {"bytes": 0, "seconds": 0.0, "copies": 0}
        for name in self.ctl.fleet.job(JOB).machine_list:
            root = Path(self.inv.machine(name).workdir) / "jobs" / JOB / "checkpoints"
            committed = [s for s, _r, p in layout.list_copies(root, "local") if (p / layout.COMMITTED).exists()]
            if not committed:
                raise RuntimeError(f"no committed step under {root}")
            t0 = time.perf_counter()
            report = verify_step(root, max(committed), run_dir=root.parent, mark=False)
            totals["seconds"] += time.perf_counter() - t0
            if not report.ok:
                raise RuntimeError(f"verification of {name} failed: {[p.line() for p in report.problems]}")
            totals["copies"] += len(report.copies)
            totals["bytes"] += sum(f.stat().st_size for c in report.copies for f in Path(c.path).iterdir())
        self.trials.append({"kind": "verify", **totals, "gb_per_s": totals["bytes"] / 1e9 / totals["seconds"]})
        print(f"verify: {totals['copies']} copies, {totals['bytes'] / 1e6:.1f} MB in {totals['seconds']:.2f}s",
              flush=True)

    def _add(self, kind: str, t0: float, info: dict[str, Any], **extra: Any) -> None:
        trial = {"kind": kind, "seconds": info["ts"] - t0, "restored_step": info.get("restored_step"),
                 "first_step": info.get("first_step"), **extra}
        self.trials.append(trial)
        print(f"{kind}: {trial['seconds']:.2f}s " + ", ".join(f"{k} {v}" for k, v in extra.items()), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one trial of each")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    stop_on_sigterm()
    if os.geteuid() != 0:
        print("bench/operations.py needs root (network namespaces)", file=sys.stderr)
        return 2
    trials = 1 if args.quick else args.trials
    with emulated_cluster(SPEC, "tg-bench-ops-") as (inv, home):
        b = Bench(inv, home)
        try:
            b.ctl.transport.run(inv.machine("m2"), [inv.tg_node, "standby", "park", "--nproc", "2"], timeout=240)
            b.ctl.launch_job(JOB, TOPO, ["m0", "m1"], train_args=TRAIN)
            b.training(4)
            for _ in range(trials):
                b.hot()
                b.full()
            for _ in range(trials):
                b.replace(warm=True)
                b.replace(warm=False)
            b.ctl.stop(JOB)
            for _ in range(trials):
                b.verify()
        finally:
            try:
                b.ctl.stop(JOB)
            except Exception as exc:  # the cluster goes down next anyway
                print(f"stopping the job: {exc}", file=sys.stderr)

    def of(kind: str, key: str = "seconds") -> list[float]:
        return [t[key] for t in b.trials if t["kind"] == kind]

    metrics: dict[str, Any] = {
        "hot_update_s": summarize(of("hot_update"), "s"),
        "full_restart_s": summarize(of("full_restart"), "s"),
        "standby_activation_s": summarize(of("standby_activation"), "s"),
        "cold_provisioning_s": summarize(of("cold_provisioning"), "s"),
        "verify_gb_per_s": summarize(of("verify", "gb_per_s"), "GB/s"),
    }
    metrics["hot_vs_full_speedup"] = {
        "median": round(statistics.median(of("full_restart")) / statistics.median(of("hot_update")), 2),
        "p90": None, "n": 1, "unit": "x", "target": TARGETS["hot_vs_full_speedup"]}
    metrics["warm_vs_cold_provisioning"] = {
        "median": round(statistics.median(of("cold_provisioning")) / statistics.median(of("standby_activation")), 2),
        "p90": None, "n": 1, "unit": "x"}
    text = write_result("operations", quick=bool(args.quick), out=args.out, metrics=metrics, setup={
        "cluster": "5 emulated machines (network namespaces, real sshd): job on 2, 1 warm standby, 2 free",
        "job": f"reference GPT, {TOPO.tp}x{TOPO.pp}x{TOPO.dp} (TP x PP x DP), checkpoint every step, step delay 0.2 s",
        "path": "controller and pool code the DAG tasks call, without Airflow's task start-up",
        "full_restart": "stop; nothing warm; L1+L2 self-check of every machine of the allocation; cold start; restore",
        "cold_provisioning": "a free machine's L1+L2 self-check, then the job restarts with it cold",
        "trials": b.trials,
    })
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

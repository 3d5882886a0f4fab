"""Recovery benchmark: from a fault to training resumed, through the real control plane.

On an emulated cluster of its own (6 machines: the guarded job, TP=2 PP=2 DP=2, on m0..m3, standbys
m4 and m5 parked warm) with a real ``airflow standalone`` running tg_incident (the ``trainguard-alerts``
asset's watcher reading the bus):

* **warm path**, per fault kind (GPU lost, NIC flapping twice, disk full, crash, hang, user-code error,
  NaN, silent data corruption caught by the alignment test, a gradient bit flip caught only by
  dual-phase replay, slow rank): inject the fault, let the DAGs detect, decide, evict, swap in a warm
  standby (or restart in place) and wait for training to pass the restored checkpoint. Measured from
  the fleet database and Airflow's task instances: alert -> first tg_incident task (triage start),
  alert -> diagnosis start, localization (triage start -> the handler that named the culprit ends),
  fault -> training resumed, steps lost.
* **a lost GPU while a fail-slow vote samples**: a rank slowed until its incident's vote runs, then a GPU lost on
  another machine; the fault takes the incident over and is evicted at once. Its fault -> resumed against the
  clean GPU losses of the same run: ``gpu_lost_during_vote_over_clean`` (target: within 2x).
* **cold requeue**, in the same run, after Airflow is stopped: the same GPU fault handled the way a
  requeue does it: the alert is seen on the bus, the whole job is stopped, the replacement is a machine
  that was not pre-warmed (its parked interpreters are ended first), every machine of the new allocation
  runs the self-check (L1 + L2) a scheduler runs on machines it hands out, then every part starts cold
  and restores the newest committed checkpoint.

    python bench/recovery.py [--quick] [--trials N] [--faults gpu_lost,hang,...] [--out FILE]

Targets (the control-plane issue): alert -> first task <= 2 s; fault -> resumed <= 30 s for explicit
faults with a warm standby; warm path >= 10x faster than the cold requeue (ByteRobust: 10.87x).
What the emulated cold requeue leaves out (no scheduler queue, no image pull, no fresh machine to
provision: namespaces share the host's software) is in the setup's ``cold_requeue`` note; it makes
the measured ratio a lower bound.
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

from bench.common import emulated_cluster, stop_on_sigterm, summarize, timeline, write_result
from trainguard.emulation import cluster, inject
from trainguard.emulation.guarded import FAULTS, NO_SCHEDULES, TOPOLOGY, GuardedJob, fault_time
from trainguard.emulation.standalone import poll
from trainguard.node_tools.bus import BusReader, open_bus
from trainguard.node_tools.inventory import Inventory
from trainguard.operators.policy import ladder

SPEC = cluster.ClusterSpec(name="tgr", machines=6, standbys=2, subnet="10.213.16.0/24", disk_mb=256, gpus=8)
TOPO = TOPOLOGY
JOB = "bench"
SCENARIOS = FAULTS
# alert -> first task; fault -> resumed for explicit faults with a warm standby; cold requeue over warm path
TARGETS = {"alert_to_task_s": 2.0, "resume_s.gpu_lost": 30.0, "resume_s.disk_full": 30.0, "resume_s.nic_down": 30.0,
           "warm_vs_cold_speedup": 10.0, "gpu_lost_during_vote_over_clean": 2.0}


class Bench(GuardedJob):
    def __init__(self, inv: Inventory, home: Path) -> None:
        # every trial is a first failure (level 0) and within the breaker: the trials come seconds apart;
        # the same settings for the DAGs and for this process's controller (the cold requeue's evictions)
        super().__init__(inv, home, job=JOB, settings={
            "TG_ESCALATION_WINDOW_S": "1", "TG_BREAKER_SHARE": "0.75", "TG_BREAKER_WINDOW_S": "1", **NO_SCHEDULES})
        self.trials: list[dict[str, Any]] = []

    # ---- warm path --------------------------------------------------------------------------------
    def warm(self, fault: str) -> dict[str, Any]:
        sc = SCENARIOS[fault]
        self.settled()
        self.repair()
        if sc.bad_revision:  # the running revision trained healthy; the new one fails in user code
            self.deploy_bad_revision()
        self.training()
        inc, machine, t_fault = self.fault_and_incident(sc)
        conf, tasks = self.incident_run(inc.id)
        triage_start = tasks.get("triage", {}).get("start")
        handler = self.branch(tasks)
        trial = {
            "path": "warm", "fault": fault, "machine": machine, "incident": inc.id, "state": inc.state,
            "category": inc.category, "branch": handler.get("task_id"),
            "evicted": sorted({m for a in self.ctl.fleet.actions(inc.id) if a.kind == "evict" for m in a.machines}),
            "alert_s": inc.first_alert_ts - t_fault,
            # the triggerer read it off the bus (then the settle window gathers the rest of the burst)
            "alert_to_trigger_s": conf["first_seen_ts"] - inc.first_alert_ts if conf.get("first_seen_ts") else None,
            "alert_to_incident_s": inc.opened_ts - inc.first_alert_ts,
            "alert_to_first_task_s": triage_start - inc.first_alert_ts if triage_start else None,
            "alert_to_diagnosis_s": ((inc.diagnosis_start_ts or triage_start or 0) - inc.first_alert_ts
                                     if (inc.diagnosis_start_ts or triage_start) else None),
            "localization_s": handler["end"] - triage_start if handler.get("end") and triage_start else None,
            "fault_to_resumed_s": inc.resumed_ts - t_fault if inc.resumed_ts else None,
            "lost_steps": inc.lost_steps,
            # where the time went: each task's start after the fault and how long it ran, in start order
            "timeline": timeline(tasks, t_fault),
        }
        print(f"warm {fault}: {_fmt(trial)}", flush=True)
        print("  tasks: " + ", ".join(f"{n} +{s} ({d} s)" for n, s, d in trial["timeline"]), flush=True)
        self.trials.append(trial)
        return trial

    # ---- a lost GPU while a fail-slow vote samples ---------------------------------------------------------
    def during_vote(self, slow_s: float = 1.0) -> dict[str, Any]:
        """One rank slowed (``slow_s`` a step) until its incident's vote samples, then a GPU lost on another machine:
        the explicit fault takes the incident over (its category becomes machine_fault, the vote stops at its next
        round) and the machine is evicted at once. Measured as the GPU fault alone: fault -> training resumed."""
        self.settled()
        self.repair()
        self.training()
        machines = list(self.ctl.fleet.job(JOB).machine_list)
        slow_machine, lost_machine = machines[1], machines[2]
        last = self.last_incident()
        inject.inject(self.inv, slow_machine, "slow", rank=TOPO.ranks_on(1)[0], params={"seconds": f"{slow_s:g}"})
        try:
            def voting() -> Any:
                inc = next((i for i in self.ctl.fleet.incidents(JOB) if i.id > last and i.category == "slow"), None)
                if inc is None:
                    return None
                _conf, tasks = self.incident_run(inc.id)
                return inc if tasks.get("slow_vote", {}).get("state") in ("running", "deferred") else None

            inc = poll(voting, timeout=240, interval=0.5, what="the slow rank's vote to sample")
            sent = time.time()
            t_fault = fault_time(inject.inject(self.inv, lost_machine, "gpu_lost"), sent, time.time())
        finally:
            inject.clear(self.inv, slow_machine, "slow")
        try:
            done = poll(lambda: (lambda i: i if i.state != "open" else None)(self.ctl.fleet.incident(inc.id)),
                        timeout=300, interval=0.5, what="the incident the lost GPU took over to close")
        finally:
            inject.clear(self.inv, lost_machine, "gpu_lost")
        evicted = sorted({m for a in self.ctl.fleet.actions(done.id) if a.kind == "evict" for m in a.machines})
        trial = {"path": "warm", "fault": "gpu_lost_during_vote", "machine": lost_machine, "incident": done.id,
                 "state": done.state, "category": done.category, "evicted": evicted,
                 "slow_machine": slow_machine, "fault_to_resumed_s": done.resumed_ts - t_fault if done.resumed_ts
                 else None, "lost_steps": done.lost_steps, "alert_s": None, "alert_to_trigger_s": None,
                 "alert_to_incident_s": None, "alert_to_first_task_s": None, "alert_to_diagnosis_s": None,
                 "localization_s": None}
        print(f"warm gpu_lost during a vote: {_fmt(trial)} (category {done.category}, evicted {evicted})", flush=True)
        self.trials.append(trial)
        return trial

    # ---- cold requeue -------------------------------------------------------------------------------
    def cold(self) -> dict[str, Any]:
        self.repair()
        # nothing pre-warmed anywhere: the standbys' and the job's own parked interpreters end
        self.transport.run_many(self.inv.machines, lambda m: [self.inv.tg_node, "standby", "unpark"], timeout=60)
        self.training()
        machine = self.ctl.fleet.job(JOB).machine_list[1]
        reader = BusReader.from_now(open_bus(self.inv.bus_url))
        sent = time.time()
        t_fault = fault_time(inject.inject(self.inv, machine, "gpu_lost"), sent, time.time())
        try:
            alert = poll(lambda: next((a for a in reader.read() if a.machine == machine
                                       and a.kind in ladder.EXPLICIT | ladder.XID), None),
                         timeout=60, interval=0.05, what="the GPU fault's alert on the bus")
            t_alert = time.time()
            inc, _ = self.ctl.fleet.open_incident(JOB, [], category="requeue")
            self.ctl.stop(JOB)
            self.ctl.evict(inc.id, [machine], reason="cold requeue: new allocation")
            allocation = list(self.ctl.fleet.job(JOB).machine_list)
            check = self.ctl.diagnose(JOB, allocation, levels=(1, 2))
            if check["failed"]:
                raise RuntimeError(f"the requeue's self-check failed: {check['failed']}")
            t_checked = time.time()
            restart = self.ctl.recover(inc.id, found=self.ctl.stop_found(JOB))
            resumed = poll(lambda: self.ctl.resumed(JOB, restart["restart_ts"]), timeout=300, interval=0.5,
                           what="training after the cold requeue")
            self.ctl.close(inc.id, outcome="resolved", resumed=resumed, steps_before=restart["steps_before"],
                           note="cold requeue (benchmark)")
        finally:
            inject.clear(self.inv, machine, "gpu_lost")
        trial = {"path": "cold", "fault": "gpu_lost", "machine": machine, "alert_kind": alert.kind,
                 "alert_s": t_alert - t_fault, "self_check_s": t_checked - t_alert,
                 "cold_start_s": resumed["ts"] - t_checked, "fault_to_resumed_s": resumed["ts"] - t_fault,
                 "warm_machines": restart["warm"]}
        print(f"cold requeue: {_fmt(trial)}", flush=True)
        self.trials.append(trial)
        return trial


def metrics_of(trials: list[dict[str, Any]]) -> dict[str, Any]:
    """The result's metrics (names of ../shared/DESIGN.md's results format) from the trials."""
    warm = [t for t in trials if t["path"] == "warm" and t["state"] != "error"]
    cold = [t for t in trials if t["path"] == "cold"]
    metrics: dict[str, Any] = {}

    def add(key: str, values: list[float | None], unit: str = "s", target: float | None = None) -> None:
        got = [v for v in values if v is not None]
        if got:
            metrics[key] = summarize(got, unit, target)

    add("alert_to_task_s", [t["alert_to_first_task_s"] for t in warm], target=TARGETS["alert_to_task_s"])
    add("alert_to_trigger_s", [t["alert_to_trigger_s"] for t in warm])
    add("alert_to_incident_s", [t["alert_to_incident_s"] for t in warm])
    for fault in dict.fromkeys(t["fault"] for t in warm):
        these = [t for t in warm if t["fault"] == fault]
        add(f"alert_to_diagnosis_s.{fault}", [t["alert_to_diagnosis_s"] for t in these])
        add(f"localize_s.{fault}", [t["localization_s"] for t in these])
        add(f"resume_s.{fault}", [t["fault_to_resumed_s"] for t in these], target=TARGETS.get(f"resume_s.{fault}"))
        add(f"lost_steps.{fault}", [t["lost_steps"] for t in these], unit="steps", target=1)
    add("cold_requeue_s", [t["fault_to_resumed_s"] for t in cold])
    add("cold_requeue.self_check_s", [t["self_check_s"] for t in cold])
    warm_gpu = [t["fault_to_resumed_s"] for t in warm if t["fault"] == "gpu_lost" and t["fault_to_resumed_s"]]
    voted = [t["fault_to_resumed_s"] for t in warm if t["fault"] == "gpu_lost_during_vote" and t["fault_to_resumed_s"]]
    if warm_gpu and voted:  # a lost GPU during a vote, against a clean one of the same run
        metrics["gpu_lost_during_vote_over_clean"] = {
            "median": round(statistics.median(voted) / statistics.median(warm_gpu), 2), "p90": None, "n": len(voted),
            "unit": "x", "target": TARGETS["gpu_lost_during_vote_over_clean"]}
    if warm_gpu and cold:
        ratio = statistics.median(t["fault_to_resumed_s"] for t in cold) / statistics.median(warm_gpu)
        metrics["warm_vs_cold_speedup"] = {"median": round(ratio, 2), "p90": None, "n": 1, "unit": "x",
                                           "target": TARGETS["warm_vs_cold_speedup"]}
    return metrics


def _fmt(trial: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in trial.items()
                     if k not in ("path", "fault", "timeline"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one GPU-loss trial each way, no other fault kind")
    ap.add_argument("--trials", type=int, default=3, help="GPU-loss trials on the warm path (default 3)")
    ap.add_argument("--faults", default=",".join(k for k in SCENARIOS if k != "gpu_lost"),
                    help="the other fault kinds, one warm trial each, comma-separated (default: all of "
                         f"{', '.join(SCENARIOS)}; empty for none)")
    ap.add_argument("--cold-trials", type=int, default=2)
    ap.add_argument("--vote-trials", type=int, default=1,
                    help="trials of a GPU lost while a fail-slow vote samples (default 1; --quick: 1)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    stop_on_sigterm()
    if os.geteuid() != 0:
        print("bench/recovery.py needs root (network namespaces)", file=sys.stderr)
        return 2
    gpu_trials, cold_trials = (1, 1) if args.quick else (args.trials, args.cold_trials)
    extra = [] if args.quick else [f for f in args.faults.split(",") if f]
    unknown = [f for f in extra if f not in SCENARIOS]
    if unknown:
        print(f"--faults: unknown fault kind {', '.join(unknown)}; use some of {', '.join(SCENARIOS)}",
              file=sys.stderr)
        return 2
    with emulated_cluster(SPEC, "tg-bench-recovery-") as (inv, home):
        b = Bench(inv, home)
        try:
            b.start()
            b.training(2)
            for fault in ["gpu_lost"] * gpu_trials + extra + ["gpu_lost_during_vote"] * max(0, args.vote_trials):
                try:
                    b.during_vote() if fault == "gpu_lost_during_vote" else b.warm(fault)
                except (RuntimeError, TimeoutError) as exc:  # recorded as a failed trial; the next kind runs
                    print(f"warm {fault}: failed: {exc}", file=sys.stderr, flush=True)
                    b.trials.append({"path": "warm", "fault": fault, "state": "error", "error": str(exc)[:500]})
            b.settled()
            b.airflow.stop()  # the requeue baseline runs without the control plane
            for _ in range(cold_trials):
                b.cold()
        finally:
            b.stop()

    settings = b.ctl.cfg
    failed = [t for t in b.trials if t["path"] == "warm" and t["state"] != "resolved"]
    warm = [t for t in b.trials if t["path"] == "warm" and t["state"] != "error"]
    cold = [t for t in b.trials if t["path"] == "cold"]
    text = write_result("recovery", quick=bool(args.quick), out=args.out, metrics=metrics_of(b.trials), setup={
        "cluster": "6 emulated machines (network namespaces, real sshd), 4 active, 2 warm standbys",
        "job": f"reference GPT, {TOPO.tp}x{TOPO.pp}x{TOPO.dp} (TP x PP x DP), checkpoint every step, "
               f"step delay 0.2 s",
        "control_plane": f"airflow standalone (LocalExecutor), tg_incident + tg_sdc_replay; the "
                         f"alerts asset's watcher emits each batch, tg_incident runs on its asset events and its "
                         f"triage task records the batch; settle window "
                         f"{settings.alert_settle_s:g} s (none once a batch holds an explicit machine fault), "
                         f"fail-slow vote {settings.slow_rounds} rounds {settings.slow_interval_s:g} s apart",
        "warm_trials": {f: sum(1 for t in warm if t["fault"] == f) for f in dict.fromkeys(t["fault"] for t in warm)},
        "cold_trials": len(cold),
        "cold_requeue": "alert seen on the bus; job stopped everywhere; replacement not pre-warmed; L1+L2 "
                        "self-check of every machine of the new allocation; cold start of every part; restore. "
                        "Not emulated: scheduler queueing, image pulls, provisioning a fresh machine",
        "trials": b.trials,
    })
    print(text)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

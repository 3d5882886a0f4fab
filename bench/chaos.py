"""Chaos campaign: faults the ladder was not built around, under the real control plane. Two faults at
once, a control-plane process killed mid-incident, forged and oversized bus input, clocks an hour off,
a stopped agent, a dead standby, a busy machine under diagnosis, the two machines that hold each other's
checkpoint replicas failing together: what a month on a real fleet brings.

On an emulated cluster of its own (8 machines: the guarded job, TP=2 PP=2 DP=2, on 4; 4 warm standbys;
a remote checkpoint tier on a shared directory) with a real ``airflow standalone``: for each trial a
scenario is drawn (seeded; every scenario ``trials // scenarios`` times or once more, shuffled), its
faults are injected after a quiet period, and the trial ends when every incident holding an alert from
after the injection closed, or waits for a human, and the job trains again (or its time ran out).

Per trial: detected (an incident holding an alert of the fault), the right machines evicted (the faulty
ones, and nothing beyond the groups the scenario allows), resumed (the job trains at the end), waiting for
a human (with the reason recorded), steps lost, a checkpoint lost (the restart restored a step older than
the newest committed before the fault, less one), the job left dead (not training, no incident waiting
for a human), fault -> resumed. A trial that ends waiting for a human is put right by hand afterwards (the
incident resolved, machines repaired, the job restarted), as an operator would.

Compound trials inject a second fault (a crash, a hang, a lost GPU, a NaN, an agent stopped) while a given
task of the first fault's incident run runs (its triage, the rung's diagnosis or vote, the stop, the swap, the
restart, the resume wait); outage trials make the fleet database (its file moved away and back) or the alert
bus (its folder) unavailable for 10-60 s in the middle of an incident. Per trial also: a faulty machine left
serving the job, an incident left open.

Before the trials, ``--healthy-s`` seconds (1,800: 30 minutes) of healthy training on a busy host (two CPU hogs
beside the job on the 2 cores) count the fail-slow incidents opened (the target: none), and then a rank slowed so
that the job's step is 30% longer, under the same load, must still be voted out (its sleep starts at 30% of the
step and is widened by half, then interpolated, until a peer on another machine sees the step 25-40% longer:
measured here, a sleep of 30% of the step grew the job's step by 0.9%, the pipeline's slack absorbing it). A
clean ``gpu_lost`` trial is the reference the compound ones' resume times are compared with, in the same run.

    python bench/chaos.py [--quick] [--trials 62] [--seed 11] [--scenarios a,b,...] [--healthy-s 1800]
                          [--max-minutes M] [--out FILE]

Targets (the reliability issues): 0 jobs left dead, 0 checkpoints lost, 0 left on a faulty machine, every
trial resumed or waiting for a human with the reason recorded; 0 fail-slow incidents in 30 healthy minutes
under load.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.campaign import balanced_draws
from bench.common import emulated_cluster, seconds_range, stop_on_sigterm, summarize, write_result
from trainguard.core import procs
from trainguard.core.errors import FaultError
from trainguard.core.topology import Topology
from trainguard.emulation import cluster, inject
from trainguard.emulation.guarded import DEVICE_TRAIN_ARGS, NO_SCHEDULES, TOPOLOGY, GuardedJob
from trainguard.emulation.standalone import poll
from trainguard.node_tools.alerts import Alert
from trainguard.node_tools.bus import open_bus
from trainguard.operators.fleet import states

SPEC = cluster.ClusterSpec(name="tgx", machines=8, standbys=4, subnet="10.213.21.0/24", disk_mb=256, gpus=8)
JOB = "chaos"
SETTINGS = {"TG_ESCALATION_WINDOW_S": "1", "TG_BREAKER_SHARE": "0.75", "TG_BREAKER_WINDOW_S": "1",
            "TG_SLOW_ROUNDS": "5", "TG_SLOW_INTERVAL_S": "3", "TG_AGENT_SILENT_S": "10",
            "TG_RESUME_TIMEOUT_S": "120", "TG_STOP_GRACE_S": "2", "TG_ALERT_SETTLE_S": "1", **NO_SCHEDULES}
TARGETS = {"jobs_dead": 0, "checkpoints_lost": 0, "resumed_or_waiting_rate": 1.0, "left_on_faulty_machine": 0,
           "false_slow_incidents_30min": 0, "second_fault_resume_ratio_max": 2.0}
#: scenarios where a second machine's GPU fault joins the first machine's incident
JOINED = ("disk_full_and_gpu_lost", "two_gpus_lost")
TRIAL_TIMEOUT_S = 420.0


@dataclass(frozen=True)
class Scenario:
    """A chaos scenario: ``inject(chaos, machines)`` makes its faults on the job's machines (node-rank order)
    and returns what to undo afterwards; ``must``/``may``: node indices that must be evicted / may be (the
    over-eviction bound); ``incident``: whether an incident is the right answer at all."""

    name: str
    what: str
    inject: Callable[[Chaos, list[str]], Callable[[], None]]
    must: frozenset[int] = frozenset()
    may: frozenset[int] = frozenset()
    incident: bool = True
    kind: str = "single"  # single, compound (a second fault during a rung) or outage (a part unavailable)


def _rank(topo: Topology, node: int, i: int = 0) -> int:
    return topo.ranks_on(node)[i]


def _gpu(c: Chaos, m: str) -> Callable[[], None]:
    inject.inject(c.inv, m, "gpu_lost")
    return lambda: inject.clear(c.inv, m, "gpu_lost")


def _both(*undo: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        for u in undo:
            with contextlib.suppress(Exception):
                u()
    return run


def gpu_lost(c: Chaos, ms: list[str]) -> Callable[[], None]:
    """One GPU lost, nothing else: the reference the compound trials' resume times are compared with."""
    return _gpu(c, ms[1])


def two_gpus_lost(c: Chaos, ms: list[str]) -> Callable[[], None]:
    a = _gpu(c, ms[1])
    time.sleep(0.2)
    return _both(a, _gpu(c, ms[2]))


def gpu_lost_during_hang(c: Chaos, ms: list[str]) -> Callable[[], None]:
    inject.inject(c.inv, ms[3], "hang", rank=_rank(c.topology, 3))
    time.sleep(1.0)
    return _both(lambda: inject.clear(c.inv, ms[3], "hang"), _gpu(c, ms[0]))


def disk_full_and_gpu_lost(c: Chaos, ms: list[str]) -> Callable[[], None]:
    inject.inject(c.inv, ms[1], "disk_full")
    return _both(lambda: inject.clear(c.inv, ms[1], "disk_full"), _gpu(c, ms[2]))


def forged_alert_an_hour_ahead_then_gpu_lost(c: Chaos, ms: list[str]) -> Callable[[], None]:
    open_bus(c.inv.bus_url).publish(Alert("gpu_lost", "m99", job=JOB, ts=time.time() + 3600))
    time.sleep(1.0)
    return _gpu(c, ms[1])


def oversized_alert_then_crash(c: Chaos, ms: list[str]) -> Callable[[], None]:
    doc = Alert("kernel_xid", ms[0], evidence={"xid": 79, "blob": "x" * (10 << 20)}).to_dict()
    spool = Path(c.inv.bus_url.removeprefix("spool://")) / "alerts"
    (spool / f"{time.time_ns():020d}-{ms[0]}-{os.urandom(16).hex()}.json").write_text(json.dumps(doc))
    inject.inject(c.inv, ms[2], "crash", rank=_rank(c.topology, 2))
    return lambda: None


def alert_an_hour_behind(c: Chaos, ms: list[str]) -> Callable[[], None]:
    """A genuine fatal Xid reported by a machine whose clock runs an hour behind."""
    open_bus(c.inv.bus_url).publish(Alert("kernel_xid", ms[1], evidence={"xid": 79, "line": "NVRM: Xid 79"},
                                          ts=time.time() - 3600))
    return lambda: None


def _stop_agent(c: Chaos, machine: str) -> Callable[[], None]:
    """The machine's agent stopped (SIGSTOP); returns what continues it."""
    pid = c.agent_pid(machine)
    os.kill(pid, signal.SIGSTOP)
    return lambda: _cont(pid)


def agent_stopped(c: Chaos, ms: list[str]) -> Callable[[], None]:
    return _stop_agent(c, ms[2])


def agent_stopped_then_crash(c: Chaos, ms: list[str]) -> Callable[[], None]:
    undo = _stop_agent(c, ms[1])
    time.sleep(3.0)
    inject.inject(c.inv, ms[1], "crash", rank=_rank(c.topology, 1))
    return undo


def _cont(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)


def dead_standby_and_gpu_lost(c: Chaos, ms: list[str]) -> Callable[[], None]:
    standby = c.first_standby()
    cluster.kill_sshd(Path(c.inv.machine(standby).extra["machine_dir"]))  # with its connections
    return _both(_gpu(c, ms[1]), lambda: cluster.up(SPEC, c.inv.path.parent, log=lambda *_: None))


def standby_nic_down_and_gpu_lost(c: Chaos, ms: list[str]) -> Callable[[], None]:
    standby = c.first_standby()
    inject.inject(c.inv, standby, "nic_down")
    return _both(_gpu(c, ms[2]), lambda: inject.clear(c.inv, standby, "nic_down"))


def replica_holders_compute_wrong(c: Chaos, ms: list[str]) -> Callable[[], None]:
    """Nodes 0 and 3 keep each other's replicas: both compute wrong; the alignment test splits 2-2."""
    inject.inject(c.inv, ms[0], "sdc")
    inject.inject(c.inv, ms[3], "sdc")
    return _both(lambda: inject.clear(c.inv, ms[0], "sdc"), lambda: inject.clear(c.inv, ms[3], "sdc"))


def heartbeats_an_hour_behind(c: Chaos, ms: list[str]) -> Callable[[], None]:
    for r in c.topology.ranks_on(1):
        inject.inject(c.inv, ms[1], "clock", rank=r, params={"offset_s": "-3600"})
    return lambda: inject.clear(c.inv, ms[1], "clock")


def busy_machine_under_diagnosis(c: Chaos, ms: list[str]) -> Callable[[], None]:
    netns = c.inv.machine(ms[2]).extra["netns"]
    hogs = [subprocess.Popen(["ip", "netns", "exec", netns, sys.executable, "-c", "while True: pass"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
            for _ in range(2)]
    inject.inject(c.inv, ms[1], "crash", rank=_rank(c.topology, 1))

    def stop() -> None:
        for h in hogs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(h.pid, signal.SIGKILL)
            h.wait()
    return stop


def control_plane_killed_mid_incident(c: Chaos, ms: list[str]) -> Callable[[], None]:
    """A crash; once its incident's rung is working, every task process of Airflow is killed."""
    last = c.last_incident()
    inject.inject(c.inv, ms[2], "crash", rank=_rank(c.topology, 2))
    poll(lambda: any(i.id > last and i.diagnosis_start_ts for i in c.ctl.fleet.incidents(JOB)), timeout=120,
         interval=0.2, what="the crash's incident to start its rung")
    time.sleep(1.0)
    c.killed = c.kill_task_processes()
    return lambda: None


def nan_and_crash(c: Chaos, ms: list[str]) -> Callable[[], None]:
    last_stage = next(r for r in c.topology.ranks_on(1) if c.topology.coords(r).pp == c.topology.pp - 1)
    inject.inject(c.inv, ms[1], "nan", rank=last_stage)
    inject.inject(c.inv, ms[2], "crash", rank=_rank(c.topology, 2))
    return lambda: None


# ---- compound: a second fault while a given task of the first fault's incident run runs -----------------------
def _first_crash(c: Chaos, ms: list[str]) -> Callable[[], None]:
    inject.inject(c.inv, ms[2], "crash", rank=_rank(c.topology, 2))
    return lambda: None


RANK_WAIT_S = 60.0  # the longest a second rank fault waits for a rank of the job on its machine


def _first_slow(c: Chaos, ms: list[str]) -> Callable[[], None]:
    inject.inject(c.inv, ms[1], "slow", rank=_rank(c.topology, 1), params={"seconds": "3.0"})
    return lambda: inject.clear(c.inv, ms[1], "slow")


def _first_gpu(c: Chaos, ms: list[str]) -> Callable[[], None]:
    return _gpu(c, ms[2])


def _rank_fault(c: Chaos, machine: str, kind: str, rank: int) -> bool:
    """A rank fault on ``machine`` as soon as a rank of the job runs there (during a stop or a restart, none
    does for a while): at most RANK_WAIT_S later. False, and the trial says so, when none ran by then."""
    deadline = time.monotonic() + RANK_WAIT_S
    while True:
        try:
            inject.inject(c.inv, machine, kind, rank=rank)
            return True
        except FaultError as exc:
            # what a machine says while the job stops or starts there: no job, no rank heartbeat yet, a rank's
            # process not (yet) running, the rank not (yet) placed on it
            if not any(m in str(exc) for m in ("no job is running", "no rank heartbeat yet", "is not running",
                                               "is not on machine")):
                raise
            if time.monotonic() >= deadline:
                c.compound["second_not_applied"] = f"{kind} on {machine}: no rank of the job ran there for " \
                                                   f"{RANK_WAIT_S:.0f}s ({exc})"
                return False
        time.sleep(0.25)  # the job's start on the machine is what is waited for


def _second_crash(c: Chaos, ms: list[str]) -> Callable[[], None]:
    _rank_fault(c, ms[0], "crash", _rank(c.topology, 0))
    return lambda: None


def _second_hang(c: Chaos, ms: list[str]) -> Callable[[], None]:
    if not _rank_fault(c, ms[0], "hang", _rank(c.topology, 0)):
        return lambda: None
    return lambda: inject.clear(c.inv, ms[0], "hang")


def _second_gpu(c: Chaos, ms: list[str]) -> Callable[[], None]:
    return _gpu(c, ms[0])


def _second_nan(c: Chaos, ms: list[str]) -> Callable[[], None]:
    node = next(n for n in (0, 3) if any(c.topology.coords(r).pp == c.topology.pp - 1 for r in c.topology.ranks_on(n)))
    rank = next(r for r in c.topology.ranks_on(node) if c.topology.coords(r).pp == c.topology.pp - 1)
    _rank_fault(c, ms[node], "nan", rank)
    return lambda: None


def _second_agent(c: Chaos, ms: list[str]) -> Callable[[], None]:
    return _stop_agent(c, ms[0])


def _second_standby_nic(c: Chaos, ms: list[str]) -> Callable[[], None]:
    """The standby that has just taken a place in the job loses its network (as it is launched)."""
    joined = sorted(set(c.ctl.fleet.job(JOB).machine_list) - set(ms))
    for m in joined:
        inject.inject(c.inv, m, "nic_down")
    return _both(*[lambda m=m: inject.clear(c.inv, m, "nic_down") for m in joined])


FIRST = {"crash": _first_crash, "slow": _first_slow, "gpu_lost": _first_gpu}
SECOND = {"crash": _second_crash, "hang": _second_hang, "gpu_lost": _second_gpu, "nan": _second_nan,
          "agent_stopped": _second_agent, "standby_nic_down": _second_standby_nic}


def compound(first: str, task: str, second: str) -> Callable[[Chaos, list[str]], Callable[[], None]]:
    """The first fault; once its incident's run has started ``task``, the second fault."""

    def run(c: Chaos, ms: list[str]) -> Callable[[], None]:
        last, t0 = c.last_incident(), time.time()
        undo = FIRST[first](c, ms)
        try:
            c.compound = {"task": task, "seen": c.wait_task(last, t0, task), "second_s": None}
            undo_second = SECOND[second](c, ms)
            if "second_not_applied" not in c.compound:
                c.compound["second_s"] = round(time.time() - t0, 2)
            return _both(undo, undo_second)
        except Exception:
            undo()
            raise
    return run


# ---- outages: the fleet database or the bus unavailable mid-incident -------------------------------------------
class _Away:
    """A path moved aside now and back after ``seconds`` (or when undone, whichever comes first). With ``block``, a
    plain file stands in its place meanwhile, so that nothing can create it again (a bus folder its writers
    would otherwise make anew)."""

    def __init__(self, path: Path, seconds: float, *, block: bool = False) -> None:
        self.path, self.aside = path, path.with_name(path.name + ".away")
        self.lock = threading.Lock()
        shutil.move(str(self.path), str(self.aside))
        if block:
            self.path.write_text("unavailable\n")
        self.timer = threading.Timer(seconds, self.back)
        self.timer.start()

    def back(self) -> None:
        with self.lock:
            if self.aside.exists():
                if self.path.is_file():
                    self.path.unlink()
                shutil.move(str(self.aside), str(self.path))

    def undo(self) -> None:
        self.timer.cancel()
        self.back()


def outage(first: str, when: str, part: str, seconds: float) -> Callable[[Chaos, list[str]], Callable[[], None]]:
    """The first fault; once its incident opened (``when`` "opened") or its run started task ``when``, the fleet
    database's file (``part`` "fleet") or the bus's folder (``part`` "bus") is away for ``seconds``."""

    def run(c: Chaos, ms: list[str]) -> Callable[[], None]:
        last, t0 = c.last_incident(), time.time()
        if part == "bus":  # away first: the fault's alerts wait in the agents' outboxes
            away = _Away(c.bus_dir(), seconds, block=True)
            return _both(FIRST[first](c, ms), away.undo)
        undo = FIRST[first](c, ms)
        try:
            seen = c.wait_task(last, t0, when)
        except Exception:
            undo()
            raise
        c.compound = {"task": when, "seen": seen, "outage": part, "outage_s": seconds}
        away = _Away(Path(c.ctl.cfg.fleet_url), seconds)
        return _both(undo, away.undo)
    return run


def _pipeline(topo: Topology, node: int) -> frozenset[int]:
    return frozenset(topo.machines_of_group("pp", topo.ranks_on(node)[0]))


def _dp(topo: Topology, node: int) -> frozenset[int]:
    return frozenset(topo.machines_of_group("dp", topo.ranks_on(node)[0]))


def scenarios(topo: Topology) -> dict[str, Scenario]:
    pipe = {n: _pipeline(topo, n) for n in range(topo.machines)}
    items = [
        Scenario("gpu_lost", "a GPU lost (the clean reference)", gpu_lost, frozenset({1}), frozenset({1})),
        Scenario("two_gpus_lost", "GPUs lost on two machines 0.2 s apart", two_gpus_lost,
                 frozenset({1, 2}), frozenset({1, 2})),
        # the lost GPU must go; the hung rank's pipeline may too (when the analysis acted before the GPU's alert
        # came; after it, the explicit fault decides and the restart ends the stopped process)
        Scenario("gpu_lost_during_hang", "a rank hangs, a GPU falls off another machine a second later",
                 gpu_lost_during_hang, frozenset({0}), frozenset({0}) | pipe[3]),
        Scenario("disk_full_and_gpu_lost", "a disk fills on one machine while a GPU is lost on another",
                 disk_full_and_gpu_lost, frozenset({1, 2}), frozenset({2}) | pipe[1] | _dp(topo, 1)),
        Scenario("forged_alert_an_hour_ahead", "a forged alert for an unknown machine stamped an hour ahead, "
                 "then a GPU lost", forged_alert_an_hour_ahead_then_gpu_lost, frozenset({1}), frozenset({1})),
        Scenario("oversized_alert_then_crash", "a 10 MB alert on the bus, then a rank crash",
                 oversized_alert_then_crash),
        Scenario("alert_an_hour_behind", "a fatal Xid reported by a machine whose clock is an hour behind",
                 alert_an_hour_behind, frozenset({1}), frozenset({1})),
        Scenario("agent_stopped", "the agent of a machine of the job stopped (SIGSTOP)", agent_stopped),
        Scenario("agent_stopped_then_crash", "an agent stopped, then a rank of its machine crashes",
                 agent_stopped_then_crash),
        Scenario("dead_standby_and_gpu_lost", "the first standby's sshd dead, then a GPU lost",
                 dead_standby_and_gpu_lost, frozenset({1}), frozenset({1})),
        Scenario("standby_nic_down_and_gpu_lost", "the first standby's NIC down, then a GPU lost",
                 standby_nic_down_and_gpu_lost, frozenset({2}), frozenset({2})),
        Scenario("replica_holders_compute_wrong", "the two machines that hold each other's replicas compute wrong",
                 replica_holders_compute_wrong, frozenset({0, 3}), frozenset({0, 3})),
        Scenario("heartbeats_an_hour_behind", "a machine's ranks stamp their heartbeats an hour behind",
                 heartbeats_an_hour_behind, incident=False),
        Scenario("busy_machine_under_diagnosis", "a rank crashes while another machine is busy (CPU hogs)",
                 busy_machine_under_diagnosis),
        Scenario("control_plane_killed_mid_incident", "a crash, and Airflow's task processes killed mid-incident",
                 control_plane_killed_mid_incident),
        Scenario("nan_and_crash", "a NaN on one machine and a crash on another at once", nan_and_crash),
    ]
    # a second fault while each task of a first incident's run runs: node 0 takes the second fault (its pipeline
    # may go with a hang's analysis), node 2 a first crash or lost GPU, node 1 a first slowdown (voted out with
    # its group, or not once something stronger took the incident over)
    both = {"crash": (frozenset(), frozenset()), "slow": (frozenset(), pipe[1]), "gpu_lost": (frozenset({2}),
                                                                                           frozenset({2}))}
    then = {"crash": (frozenset(), frozenset()), "hang": (frozenset(), pipe[0]), "gpu_lost": (frozenset({0}),
                                                                                          frozenset({0})),
            "nan": (frozenset(), frozenset()), "agent_stopped": (frozenset(), frozenset({0})),
            "standby_nic_down": (frozenset(), frozenset())}
    for first, task, second in (("crash", "triage", "gpu_lost"), ("crash", "restart_at_once", "hang"),
                                ("crash", "stop_job", "nan"), ("crash", "swap_machines", "agent_stopped"),
                                ("crash", "restart_job", "crash"), ("crash", "wait_for_resume", "gpu_lost"),
                                ("slow", "slow_vote", "crash"), ("slow", "slow_vote", "agent_stopped"),
                                ("gpu_lost", "swap_machines", "gpu_lost"), ("gpu_lost", "restart_job", "hang"),
                                ("gpu_lost", "restart_job", "standby_nic_down"),
                                ("gpu_lost", "wait_for_resume", "agent_stopped")):
        must = both[first][0] | then[second][0]
        items.append(Scenario(f"{first}_then_{second}_during_{task}",
                              f"a {first.replace('_', ' ')}, and a {second.replace('_', ' ')} on another machine "
                              f"while its incident's {task} runs", compound(first, task, second), must,
                              must | both[first][1] | then[second][1], kind="compound"))
    outages = (("gpu_lost", "opened", "fleet", 25.0), ("crash", "restart_at_once", "fleet", 60.0),
               ("gpu_lost", "wait_for_resume", "fleet", 10.0), ("gpu_lost", "", "bus", 30.0))
    for first, when, part, secs in outages:
        what = "its incident opens" if when == "opened" else f"its incident's {when} runs" if when else "it happens"
        name = "fleet database" if part == "fleet" else "alert bus"
        must = both[first][0]
        items.append(Scenario(f"{part}_away_{secs:.0f}s_{first}" + (f"_{when}" if when else ""),
                              f"a {first.replace('_', ' ')}; the {name} unavailable for {secs:.0f} s as {what}",
                              outage(first, when, part, secs), must, must | both[first][1], kind="outage"))
    return {s.name: s for s in items}


class Chaos(GuardedJob):
    def __init__(self, inv: Any, home: Path, *, seed: int) -> None:
        super().__init__(inv, home, job=JOB, settings=SETTINGS, train_args=DEVICE_TRAIN_ARGS)
        self.rng = random.Random(seed)
        self.trials: list[dict[str, Any]] = []
        self.killed: list[int] = []
        self.compound: dict[str, Any] = {}

    # ---- helpers of the scenarios ---------------------------------------------------------------------
    def agent_pid(self, machine: str) -> int:
        from trainguard.node_tools import agent
        from trainguard.node_tools.config import NodeConfig

        doc = agent.processes(NodeConfig.load(Path(self.inv.machine(machine).extra["node_config"])))
        return int(doc["agent"]["pid"])

    def bus_dir(self) -> Path:
        return Path(self.inv.bus_url.removeprefix("spool://"))

    def wait_task(self, last: int, t0: float, task: str, timeout: float = 240.0) -> str:
        """Wait until the incident a fault after ``t0`` opened (after incident ``last``) exists (``task``
        "opened") or its run has started ``task``; the task's state when seen (it may have ended already)."""
        def seen() -> str | None:
            new = [i for i in self.ctl.fleet.incidents(JOB) if i.id > last]
            if not new:
                return None
            if task == "opened":
                return "open"
            run = self.airflow.incident_run(new[0].id)
            state = self.airflow.task_states("tg_incident", run["dag_run_id"]).get(task) if run else None
            return state if state in ("running", "deferred", "success", "failed", "up_for_retry") else None

        return poll(seen, timeout=timeout, interval=0.2, what=f"the first fault's incident to reach {task}")

    def first_standby(self) -> str:
        return sorted(m.name for m in self.ctl.fleet.machines(state=states.STANDBY))[0]

    def kill_task_processes(self) -> list[int]:
        """SIGKILL every process Airflow runs a task in (the children of its LocalExecutor's workers)."""
        workers = [p for p in procs.all_pids() if " ".join(_cmdline(p)).startswith("airflow worker")]
        children = [p for p in procs.all_pids() if _ppid(p) in workers]
        for p in children or workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
        return children or workers

    # ---- the operator --------------------------------------------------------------------------------
    def by_hand(self) -> list[str]:
        """What an operator does after a trial that waits for a human: the incidents resolved by hand, every
        machine in repair or evicted fixed and parked, the job restarted if it does not train."""
        from trainguard.operators.tasks.common import incident_by_hand as _incident_by_hand

        done = []
        for inc in self.ctl.fleet.incidents(JOB):
            if inc.state == "waiting_human":
                self.ctl.fleet.update_incident(inc.id, state="resolved", closed_ts=time.time(),
                                               summary=f"{inc.summary}; put right by hand")
                done.append(f"incident {inc.id} resolved by hand")
        broken = [m.name for m in self.ctl.fleet.machines() if m.state in (states.REPAIR, states.EVICTED)]
        for name in broken:
            inject.clear(self.inv, name)
            if self.ctl.fleet.machine(name).state == states.EVICTED:
                self.ctl.fleet.transition(name, states.REPAIR, reason="sent to repair")
            self.ctl.fleet.transition(name, states.SELF_CHECK, reason="repaired")
        if broken:
            cluster.up(SPEC, self.inv.path.parent, log=lambda *_: None)  # sshd and agents back where they died
            self.park(broken)
            for name in broken:
                self.ctl.fleet.transition(name, states.STANDBY, reason="self-check passed (parked warm)", checked=True)
            done.append(f"repaired {', '.join(broken)}")
        if not self.ctl.trains(JOB, within_s=20):
            inc = _incident_by_hand(self.ctl, JOB, "the job restarted by hand after a chaos trial")
            self.ctl.recover(inc)
            self.training(2, timeout=240)
            self.ctl.close(inc, outcome="resolved", note="restarted by hand")
            done.append("the job restarted by hand")
        self.ctl.fleet.set_job_state(JOB, "running")
        return done

    def newest_committed(self) -> int | None:
        records = self.ctl.step_history(JOB)
        return max((r["ckpt_committed"] for r in records if isinstance(r.get("ckpt_committed"), int)), default=None)

    def restored_after(self, ts: float) -> list[int]:
        """The steps restarts after ``ts`` restored (each restart's first step record)."""
        return [r["ckpt_restored_step"] for r in self.ctl.step_history(JOB)
                if r.get("ts", 0) > ts and isinstance(r.get("ckpt_restored_step"), int)]

    # ---- one trial -------------------------------------------------------------------------------------
    def done(self, last: int, t0: float, scenario: Scenario) -> bool:
        """Every incident after ``last`` with an alert from ``t0`` on has closed or waits for a human, and
        the job trains again (or waits for a human)."""
        new = [i for i in self.ctl.fleet.incidents(JOB) if i.id > last and
               any(a.ts >= t0 for a in self.ctl.fleet.alerts_of(i.id))]
        if scenario.incident and not new:
            return False
        if any(i.state == "open" for i in new):
            return False
        if any(r["state"] not in ("success", "failed") for r in self.airflow.runs("tg_incident")):
            return False
        return any(i.state == "waiting_human" for i in new) or self.ctl.trains(JOB, within_s=10)

    def trial(self, scenario: Scenario) -> dict[str, Any]:
        self.settled(timeout=600)
        fixed = self.by_hand()
        self.repair()
        self.armed()
        self.training(3, timeout=300)
        machines = list(self.ctl.fleet.job(JOB).machine_list)
        committed = self.newest_committed()
        last = self.last_incident()
        self.killed = []
        self.compound = {}
        t0 = time.time()
        trial: dict[str, Any] = {"scenario": scenario.name, "kind": scenario.kind, "machines": machines,
                                 "committed_before": committed, "fixed_before": fixed}
        undo = scenario.inject(self, machines)
        try:
            if scenario.incident:
                poll(lambda: self.done(last, t0, scenario), timeout=TRIAL_TIMEOUT_S, interval=1.0,
                     what=f"the {scenario.name} trial to end")
            else:  # nothing should happen: watch for a while
                time.sleep(30.0)
                self.settled(timeout=TRIAL_TIMEOUT_S)
            trial["timed_out"] = False
        except TimeoutError as exc:
            trial.update(timed_out=True, error=str(exc)[:300])
        finally:
            undo()
        new = [i for i in self.ctl.fleet.incidents(JOB) if i.id > last]
        mine = [i for i in new if any(a.ts >= t0 for a in self.ctl.fleet.alerts_of(i.id))]
        evicted = {old for i in new for old in self.swaps(i.id)}
        nodes = {machines.index(m) for m in evicted if m in machines}
        waiting = [i for i in new if i.state == "waiting_human"]
        trains = self.ctl.trains(JOB, within_s=15)
        restored = self.restored_after(t0)
        resumed_ts = [i.resumed_ts for i in mine if i.resumed_ts]
        lost_steps = sum(i.lost_steps or 0 for i in mine)
        ckpt_lost = bool(committed is not None and restored and min(restored) < committed - 1)
        trial.update({
            "incidents": [{"id": i.id, "category": i.category, "state": i.state, "level": i.level,
                           "summary": i.summary[:400], "evicted": self.swaps(i.id),
                           "actions": [a.kind for a in self.ctl.fleet.actions(i.id)]} for i in new],
            "detected": bool(mine) if scenario.incident else None,
            "quiet": not new and not evicted if not scenario.incident else None,
            "evicted": sorted(evicted), "evicted_nodes": sorted(nodes),
            "right_machines": scenario.must <= nodes <= (scenario.may | scenario.must),
            "resumed": trains, "waiting_human": [{"incident": i.id, "reason": i.summary[:400]} for i in waiting],
            "job_dead": not trains and not waiting, "steps_lost": lost_steps, "restored": restored,
            "checkpoint_lost": ckpt_lost,
            "resume_s": round(max(resumed_ts) - t0, 2) if resumed_ts and trains else None,
            "detect_s": round(min(a.ts for i in mine for a in self.ctl.fleet.alerts_of(i.id) if a.ts >= t0) - t0, 2)
            if mine else None,
            "killed_task_processes": len(self.killed),
            # a machine the scenario made faulty (an explicit fault) still serving the job, and nobody told
            "left_on_faulty_machine": bool(scenario.must - nodes) and not waiting,
            "left_open": [i.id for i in self.ctl.fleet.incidents(JOB) if i.state == "open"],
            **({"during": dict(self.compound)} if self.compound else {}),
        })
        print(f"trial {len(self.trials) + 1} {scenario.name}: " + ", ".join(
            f"{k} {v}" for k, v in trial.items() if k in ("detected", "evicted", "right_machines", "resumed",
                                                          "waiting_human", "job_dead", "steps_lost",
                                                          "checkpoint_lost", "resume_s", "timed_out",
                                                          "left_on_faulty_machine", "left_open", "during")),
              flush=True)
        self.trials.append(trial)
        return trial


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def _ppid(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


def metrics_of(trials: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    n = len(trials)
    dead = sum(1 for t in trials if t["job_dead"])
    lost = sum(1 for t in trials if t["checkpoint_lost"])
    ok = sum(1 for t in trials if t["resumed"] or t["waiting_human"])
    waiting = sum(1 for t in trials if t["waiting_human"])
    detect_n = [t for t in trials if t["detected"] is not None]
    metrics: dict[str, Any] = {
        "trials": {"value": n, "n": n, "unit": "trials"},
        "jobs_dead": {"value": dead, "n": n, "unit": "trials", "target": TARGETS["jobs_dead"]},
        "checkpoints_lost": {"value": lost, "n": n, "unit": "trials", "target": TARGETS["checkpoints_lost"]},
        "resumed_or_waiting_rate": {"value": round(ok / n, 4) if n else None, "n": n, "unit": "ratio",
                                    "target": TARGETS["resumed_or_waiting_rate"]},
        "waiting_human": {"value": waiting, "n": n, "unit": "trials"},
        "detection_rate": {"value": round(sum(bool(t["detected"]) for t in detect_n) / len(detect_n), 4)
                           if detect_n else None, "n": len(detect_n), "unit": "ratio"},
        "right_machines_rate": {"value": round(sum(bool(t["right_machines"]) for t in trials) / n, 4) if n else None,
                                "n": n, "unit": "ratio"},
        "compound_trials": {"value": sum(1 for t in trials if t.get("kind") == "compound"), "n": n, "unit": "trials"},
        "outage_trials": {"value": sum(1 for t in trials if t.get("kind") == "outage"), "n": n, "unit": "trials"},
        "left_on_faulty_machine": {"value": sum(1 for t in trials if t.get("left_on_faulty_machine")), "n": n,
                                   "unit": "trials", "target": TARGETS["left_on_faulty_machine"]},
        "left_open": {"value": sum(1 for t in trials if t.get("left_open")), "n": n, "unit": "trials", "target": 0},
    }
    resume = [t["resume_s"] for t in trials if t.get("resume_s")]
    if resume:
        metrics["resume_s"] = summarize(resume, "s")
    detect = [t["detect_s"] for t in trials if t.get("detect_s") is not None]
    if detect:
        metrics["detect_s"] = summarize(detect, "s")
    steps = [t["steps_lost"] for t in trials]
    if steps:
        metrics["steps_lost"] = summarize([float(s) for s in steps], "steps")
    # a second machine's GPU fault joining an incident (a full disk's, or another lost GPU's): the worst
    # trial's fault -> resumed against the median clean lost GPU of the same run
    clean = [t["resume_s"] for t in trials if t["scenario"] == "gpu_lost" and t.get("resume_s")]
    joined = [t["resume_s"] for t in trials if t["scenario"] in JOINED and t.get("resume_s")]
    if clean and joined:
        metrics["second_fault_resume_ratio_max"] = {
            "value": round(max(joined) / statistics.median(clean), 3), "n": len(joined), "unit": "x",
            "target": TARGETS["second_fault_resume_ratio_max"]}
    return metrics


def _job_step(c: Chaos, rank: int, *, since: float, least: int = 10) -> float | None:
    """The job's step time as ``rank`` saw it: the median of its last 20 steps recorded after ``since`` (None
    while fewer than ``least`` of them)."""
    recs = [float(r["step_time_s"]) for r in c.ctl.step_history(JOB, rank=rank)
            if isinstance(r.get("step_time_s"), float) and float(r.get("ts") or 0.0) >= since][-20:]
    return statistics.median(recs) if len(recs) >= least else None


def healthy_under_load(c: Chaos, seconds: float) -> dict[str, Any]:
    """``seconds`` of healthy training with two CPU hogs beside the job (the busy host): the incidents that open
    (the fail-slow ones above all) and the slowdowns recorded as shared; then, under the same load, one rank
    slowed by 30% of its step time: its incident, and whether its machine was voted out."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True) for _ in range(2)]
    out: dict[str, Any] = {"seconds": seconds, "hogs": len(hogs)}
    try:
        c.settled(timeout=600)
        c.training(3, timeout=300)
        last, t0 = c.last_incident(), time.time()
        time.sleep(seconds)  # the measurement window itself: healthy training, nothing injected
        new = [i for i in c.ctl.fleet.incidents(JOB) if i.id > last]
        shared = c.ctl.fleet.alerts_on(c.ctl.fleet.job(JOB).machine_list, kinds={"throughput_decline", "rank_slow"},
                                       since=t0)
        out.update(incidents=[{"id": i.id, "category": i.category, "state": i.state, "summary": i.summary[:300]}
                              for i in new],
                   slow_incidents=sum(1 for i in new if i.category == "slow"),
                   slow_alerts=len(shared),
                   slow_alerts_without_incident=sum(1 for a in shared if a.incident_id is None))
        c.settled(timeout=600)
        # a rank slowed by 30% of its step time, under the same load
        machines = list(c.ctl.fleet.job(JOB).machine_list)
        rank = _rank(c.topology, 1)
        records = [r for r in c.ctl.step_history(JOB, rank=rank)[-20:] if isinstance(r.get("step_time_s"), float)]
        times = sorted(float(r["step_time_s"]) for r in records)
        compute = sorted(max(0.0, r["step_time_s"] - float(r.get("comm_s") or 0.0)) for r in records)
        extra = round(0.3 * times[len(times) // 2], 3) if times else 0.2
        peer = _rank(c.topology, 0)
        before = _job_step(c, peer, since=0.0) or (times[len(times) // 2] if times else 0.0)
        last, t1 = c.last_incident(), time.time()
        inject.inject(c.inv, machines[1], "slow", rank=rank, params={"seconds": str(extra)})
        # what the job loses is what a straggler costs: a sleep of 30% of the rank's step grew the job's step by
        # 0.9% here (the pipeline's slack and the CPU it gives its peers absorb it). The sleep is scaled until the
        # job's step, as a peer on another machine sees it, is about 30% longer.
        tries: list[dict[str, float]] = []
        try:
            # (a rank moved off its machine by the vote meanwhile refuses the next sleep: measured so far, kept)
            with contextlib.suppress(TimeoutError, FaultError):
                below: tuple[float, float] = (0.0, 0.0)  # (sleep, growth) of the largest sleep found too small
                above: tuple[float, float] | None = None  # ... and of the smallest found too large
                for attempt in range(5 if before > 0 else 0):
                    since = time.time() + 2.0  # the steps under the sleep now set
                    after = poll(lambda since=since: _job_step(c, peer, since=since, least=15), timeout=120,
                                 interval=2.0, what="15 steps under the slow rank")
                    growth = after / before - 1.0
                    tries.append({"added_s": extra, "job_step_growth": round(growth, 3)})
                    if 0.25 <= growth <= 0.4 or c.last_incident() > last or attempt == 4:  # about 30%, an
                        break  # incident opened already, or the last try: the sleep that stays is the one measured
                    if growth < 0.25:
                        below = (extra, growth)
                    else:
                        above = (extra, growth)
                    # the pipeline's slack absorbs a first part of the sleep (growth is not linear in it): widen
                    # by half until 30% is bracketed, then interpolate between the two sleeps around it
                    nxt = extra * 1.5 if above is None else below[0] + (0.3 - below[1]) * (above[0] - below[0]) / max(
                        1e-6, above[1] - below[1])
                    extra = round(min(4 * before, max(0.01, nxt)), 3)
                    inject.clear(c.inv, machines[1], "slow")
                    inject.inject(c.inv, machines[1], "slow", rank=rank, params={"seconds": str(extra)})
            inc = poll(lambda: next((i for i in c.ctl.fleet.incidents(JOB) if i.id > last and i.category == "slow"
                                     and i.state != "open"), None), timeout=900, interval=2.0,
                       what="the 30% slow rank's incident to close")
        except TimeoutError:
            inc = None
        finally:
            with contextlib.suppress(FaultError):
                inject.clear(c.inv, machines[1], "slow")
        evicted = c.swaps(inc.id) if inc is not None else {}
        out["slow_rank"] = {"rank": rank, "machine": machines[1],
                            "step_s": times[len(times) // 2] if times else None,
                            "compute_s": compute[len(compute) // 2] if compute else None, "added_s": extra,
                            "job_step_s": before, "calibration": tries,
                            "incident": inc.id if inc else None,
                            "detected_s": round(inc.first_alert_ts - t1, 1) if inc else None,
                            "evicted": sorted(evicted), "voted_out": machines[1] in evicted}
    finally:
        for h in hogs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(h.pid, signal.SIGKILL)
            h.wait()
    print(f"healthy under load for {seconds:.0f}s: {out['slow_incidents']} fail-slow incidents "
          f"({len(out['incidents'])} in all), {out['slow_alerts_without_incident']} of {out['slow_alerts']} slow "
          f"alerts recorded as shared; 30% slow rank: {out['slow_rank']}", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="4 trials, short quiet periods")
    ap.add_argument("--trials", type=int, default=62)
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--scenarios", default="", help="scenarios to draw from (default: all)")
    ap.add_argument("--quiet-s", default="5,15", help="quiet period before each trial: MIN,MAX seconds")
    ap.add_argument("--healthy-s", type=float, default=1800.0,
                    help="seconds of healthy training under load before the trials (0: none)")
    ap.add_argument("--max-minutes", type=float, default=0.0,
                    help="draw no new trial past this many minutes of wall time (0: no limit); what ran is written")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    stop_on_sigterm()
    if os.geteuid() != 0:
        print("bench/chaos.py needs root (network namespaces)", file=sys.stderr)
        return 2
    catalogue = scenarios(TOPOLOGY)
    names = [s for s in args.scenarios.split(",") if s] or list(catalogue)
    unknown = [s for s in names if s not in catalogue]
    if unknown:
        print(f"--scenarios: unknown {', '.join(unknown)}; use some of {', '.join(catalogue)}", file=sys.stderr)
        return 2
    quiet_range = seconds_range(args.quiet_s)
    if quiet_range is None:
        print(f"--quiet-s {args.quiet_s!r}: write MIN,MAX seconds, MIN <= MAX, e.g. 5,15", file=sys.stderr)
        return 2
    lo, hi = quiet_range
    n = 4 if args.quick else args.trials
    t_start = time.time()
    with emulated_cluster(SPEC, "tg-bench-chaos-") as (inv, home):
        c = Chaos(inv, home, seed=args.seed)
        c.ctl.fleet.retry_s = 180.0  # this process's reads ride out the outages the trials make, as the DAGs do
        draws = balanced_draws(c.rng, names, n)
        healthy: dict[str, Any] | None = None
        stopped = ""
        try:
            c.start()
            if args.healthy_s > 0:
                healthy = healthy_under_load(c, 120.0 if args.quick else args.healthy_s)
            for i, name in enumerate(draws):
                if args.max_minutes and time.time() - t_start > 60.0 * args.max_minutes:
                    stopped = f"wall-time limit of {args.max_minutes:g} min reached after {i} of {n} trials"
                    print(stopped, flush=True)
                    break
                time.sleep(c.rng.uniform(lo, hi))
                try:
                    c.trial(catalogue[name])
                except Exception as exc:  # the harness itself failed (a repair, a park): what ran is still written
                    stopped = f"the harness failed in trial {i + 1} ({name}): {type(exc).__name__}: {exc}"[:1000]
                    print(stopped, flush=True)
                    break
            if not stopped:
                c.settled(timeout=600)
        finally:
            c.stop()
    metrics = metrics_of(c.trials)
    if healthy is not None:
        per_30min = healthy["slow_incidents"] * 1800.0 / healthy["seconds"]
        metrics["false_slow_incidents_30min"] = {"value": round(per_30min, 2), "n": 1, "unit": "incidents",
                                                 "target": TARGETS["false_slow_incidents_30min"],
                                                 "window_s": healthy["seconds"]}
        metrics["slow_rank_30pct_voted_out"] = {"value": int(bool(healthy["slow_rank"]["voted_out"])), "n": 1,
                                                "unit": "bool", "target": 1}
    text = write_result("chaos", quick=bool(args.quick), out=args.out, metrics=metrics, setup={
        "cluster": f"{SPEC.machines} emulated machines (network namespaces, real sshd): the job's "
                   f"{TOPOLOGY.machines}, {SPEC.standbys} warm standbys; a remote checkpoint tier on a shared "
                   f"directory; machines repaired after each trial",
        "job": f"reference GPT {TOPOLOGY.tp}x{TOPOLOGY.pp}x{TOPOLOGY.dp} (TP x PP x DP), checkpoint every step, "
               f"0.2 s of emulated accelerator time per step",
        "control_plane": "airflow standalone (LocalExecutor) running trainguard's DAGs; escalation and breaker "
                         "windows 1 s; breaker share 0.75; agents silent after 10 s; resume timeout 120 s",
        "seed": args.seed, "scenarios": {s: catalogue[s].what for s in names}, "quiet_s": [lo, hi],
        "wall_s": round(time.time() - t_start, 1), "healthy_under_load": healthy, "trials": c.trials,
        **({"stopped_early": stopped} if stopped else {}),
    })
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

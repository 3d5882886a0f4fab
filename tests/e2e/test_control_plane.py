"""The control plane end to end: a real ``airflow standalone`` (scheduler, triggerer, dag processor, api-server)
runs tg_incident (its alert watcher) and tg_reconcile against a namespace cluster of its own, with a guarded
reference job (TP=2 PP=2 DP=2 on m0..m3, checkpoints every step, standbys m4 and m5 parked warm).

Faults are injected for real; the tests then read the fleet database the DAGs wrote: which branch ran, which
machines were evicted, which standbys joined, from which step training resumed, and why.

This module is the suite's shared end-to-end tier (one Airflow, one cluster, one job): ``make test`` (CI) runs
the scenarios that prove the ladder's paths (explicit eviction onto a warm standby, passing over a dead one;
the graph as what runs; the restart at once, reached through a crash during a fail-slow vote; the reconciler's
look; the ETTR ledger; over-eviction without losing a checkpoint), ordered so that the scenarios that need no
fresh failure run while the last recovery's escalation window passes; the scenarios marked ``full`` (a
diagnosis by hand, the escalation, one per further fault kind, code rollback, forged and clock-skewed alerts,
the browser tests) run with ``make test-all``. Every rung's decision is also proven without Airflow against
fakes (tests/operators/tasks/test_rungs.py, tests/operators/tasks/test_incident.py,
tests/operators/control/test_ingest.py, tests/operators/policy/test_code.py, tests/operators/tasks/test_reconcile.py).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import own_cluster, wait_until
from tests.jobs import AlertWatch
from trainguard.core.topology import Topology
from trainguard.emulation import cluster, inject
from trainguard.emulation.standalone import Standalone
from trainguard.node_tools import launcher
from trainguard.node_tools.inventory import Inventory
from trainguard.node_tools.transport import transport_for
from trainguard.operators.control import ControlConfig, Controller
from trainguard.operators.fleet import states
from trainguard.operators.policy.rungs import BRANCHES

# a scenario waits out the last run's end, its fault's incident and its own run's end: each may take minutes
pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.airflow, pytest.mark.timeout(1500)]

SPEC = cluster.ClusterSpec(name="tgp", machines=6, standbys=2, subnet="10.213.15.0/24", disk_mb=256, gpus=8)
TOPO = Topology(tp=2, pp=2, dp=2)
JOB = "guarded"
TRAIN = ["--checkpoint", "--step-delay-s", "0.2"]
# a tg_incident run ends after its re-arm: warm interpreters importing torch at the lowest priority beside the busy
# job took 70-195 s here (one per rank and one for torchrun on each of the job's machines)
RUN_END_S = 420
ESCALATION_WINDOW_S = 90  # a failure this soon after a recovery climbs the ladder (production: 30 min); wide enough
# for a loaded host: the escalation scenario's second crash came 40 s after the first resumed on 2 busy cores (the
# close, two steps, the injection), and a fresh scenario waits out the last run's re-arm (above) anyway


@pytest.fixture(scope="module")
def cp_cluster() -> Iterator[Inventory]:
    with own_cluster(SPEC, "tg-test-cp-") as inv:
        yield inv


@pytest.fixture(scope="module")
def control(cp_cluster: Inventory) -> Iterator[tuple[Controller, Standalone]]:
    assert cp_cluster.path is not None
    home = cp_cluster.path.parent.parent / "control"
    home.mkdir()
    cfg = ControlConfig(fleet_url=str(home / "fleet.db"), inventory=str(cp_cluster.path))
    ctl = Controller(cfg)
    ctl.sync_inventory()
    # warm standbys, parked in parallel while Airflow starts
    parking = transport_for(cp_cluster)
    standbys = cp_cluster.by_role("standby")
    airflow = Standalone(home / "airflow", {"TG_FLEET_URL": cfg.fleet_url, "TG_INVENTORY": cfg.inventory,
                                            "TG_CONTROL_HOME": str(home),
                                            "TG_ESCALATION_WINDOW_S": str(ESCALATION_WINDOW_S),
                                            # 3 of the job's 4 machines per window; scenarios come quicker than
                                            # production's hour, so the window is short here
                                            "TG_BREAKER_SHARE": "0.75", "TG_BREAKER_WINDOW_S": "20",
                                            # the vote's default factor (1.25): each round counts every rank's
                                            # noise over its last seconds of steps
                                            "TG_SLOW_ROUNDS": "5", "TG_SLOW_INTERVAL_S": "2",
                                            # the scenarios' own repairs keep the pool; no scheduled pool job
                                            "TG_POOL_SCHEDULE": "", "TG_CODE_UPDATE_SCHEDULE": "",
                                            "TG_VERIFY_SCHEDULE": "", "TG_VERIFY_ON_COMMIT": "0",
                                            "TG_AGENT_SILENT_S": "8",
                                            # the reconciler looks every 30 s here (10 s by default): the tier
                                            # shares 2 cores; the Fleet page's scenario waits for its look
                                            "TG_RECONCILE_PERIOD_S": "30"})
    (home / "airflow").mkdir()
    try:
        parked = parking.run_many(standbys, lambda m: [cp_cluster.tg_node, "standby", "park", "--nproc", "2"],
                                  timeout=240)
        assert all(r.ok for r in parked.values()), {n: r.describe() for n, r in parked.items()}
        airflow.start()
        # the job every scenario guards, launched here so that any scenario runs alone (pytest -k)
        active = [m.name for m in cp_cluster.by_role("active")]
        launched = ctl.launch_job(JOB, TOPO, active, train_args=TRAIN)
        assert launched["armed"] == {"parked": active, "failed": {}}, launched
        wait_until(lambda: ctl.progress(JOB)["step"] >= 4, timeout=180, what="the guarded job to train 5 steps")
        yield ctl, airflow
    finally:
        airflow.stop()
        if _has_job(ctl):
            ctl.stop(JOB)


def _has_job(ctl: Controller) -> bool:
    try:
        ctl.fleet.job(JOB)
        return True
    except Exception:
        return False


def _incident_done(ctl: Controller, after_id: int, since_ts: float = 0.0) -> Any:
    """The first closed incident after ``after_id`` holding an alert raised at ``since_ts`` or later (one
    that closed on alerts from before, say a passing slowdown, is not the fault's)."""
    for inc in ctl.fleet.incidents(JOB):
        if inc.id > after_id and inc.state in ("resolved", "failed", "waiting_human") and \
                any(a.ts >= since_ts for a in ctl.fleet.alerts_of(inc.id)):
            return inc
    return None


def _last_incident(ctl: Controller) -> int:
    return max((i.id for i in ctl.fleet.incidents(JOB)), default=0)


def _ready_for_a_fault(ctl: Controller, airflow: Standalone, inv: Inventory, *, fresh: bool = True) -> int:
    """Wait until the job trains (and, with ``fresh``, the last recovery is older than the escalation window, its
    run is over and the job is quiet); returns the last incident's id (the fault's come after it)."""
    last = _last_incident(ctl)
    machines = list(ctl.fleet.job(JOB).machine_list)
    if fresh and last:
        # the ladder measures the window from the last recovery's resume (its close when none resumed)
        prev = ctl.fleet.incident(last)
        end = prev.resumed_ts or prev.closed_ts or 0
        wait_until(lambda: time.time() - end > ESCALATION_WINDOW_S + 1, timeout=ESCALATION_WINDOW_S + 5,
                   what="the escalation window to pass")
        # and its run is over (its rearm parks interpreters: load that slows every rank here); a failure
        # meant to escalate (not fresh) comes at once instead, within the escalation window
        wait_until(lambda: _runs_over(airflow), timeout=RUN_END_S, interval=1.0,
                   what="the last tg_incident run to end")
    step = ctl.progress(JOB)["step"]
    wait_until(lambda: ctl.progress(JOB)["step"] >= step + 2, timeout=120, what="the job to train")
    if fresh:  # (a failure meant to escalate comes at once instead)
        _quiet(ctl, airflow, inv)
    assert ctl.fleet.job(JOB).machine_list == machines, f"the job's machines changed before the fault: " \
                                                          f"{_recent(ctl, last)}"
    return _last_incident(ctl)  # an incident the harness's own load raised before the fault is not the fault's


def _fault_and_recovery(ctl: Controller, airflow: Standalone, inv: Inventory, machine: str, fault: str,
                        rank: int | None = None, *, fresh: bool = True, params: dict[str, str] | None = None,
                        flap_until: tuple[str, ...] = (), timeout: float = 300) -> Any:
    """Inject ``fault`` once the job trains (and, with ``fresh``, the last recovery is older than the
    escalation window); with ``flap_until``, clear it again once the machine raised one of those alert
    kinds; wait for the incident it causes to close; return it."""
    last = _ready_for_a_fault(ctl, airflow, inv, fresh=fresh)
    injected = time.time()
    watch = AlertWatch(inv) if flap_until else None
    inject.inject(inv, machine, fault, rank=rank, params=params)
    if watch is not None:  # a flap: the fault is undone as soon as the machine reported it
        try:
            wait_until(lambda: [a for a in watch.poll() if a.kind in flap_until and a.machine == machine],
                       timeout=30, what=f"{machine} to report {' or '.join(flap_until)}")
        finally:
            inject.clear(inv, machine, fault)
    return wait_until(lambda: _incident_done(ctl, last, injected), timeout=timeout, interval=1.0,
                      what=f"the {fault} incident to close (runs: "
                           f"{[r['state'] for r in airflow.runs('tg_incident')]})")


QUIET_S = 6.0


def _runs_over(airflow: Standalone) -> bool:
    """Every tg_incident run ended (re-arm included)."""
    return all(r["state"] in ("success", "failed") for r in airflow.runs("tg_incident"))


def _quiet(ctl: Controller, airflow: Standalone, inv: Inventory) -> None:
    """Wait until no alert came for ``QUIET_S``, no incident is open and no tg_incident run is left: the
    repair crew's parking of standbys shares these 2 cores with the job and may slow every rank enough
    for a ``rank_slow`` alert; its incident must be over before a fault is injected."""
    watch = AlertWatch(inv)
    state = {"alerts": 0, "last": time.time()}

    def quiet() -> bool:
        if len(watch.poll()) > state["alerts"]:
            state["alerts"], state["last"] = len(watch.seen), time.time()
        return (time.time() - state["last"] >= QUIET_S
                and not [i for i in ctl.fleet.incidents(JOB) if i.state == "open"]
                and _runs_over(airflow))

    wait_until(quiet, timeout=RUN_END_S, interval=1.0, what="a quiet job (no alert, incident or incident run)")


def _branch(airflow: Standalone, incident_id: int) -> str:
    """The handler task that ran in the incident's tg_incident run."""
    run = airflow.incident_run(incident_id)
    if run is None:
        return "no run"
    tasks = airflow.task_states("tg_incident", run["dag_run_id"])
    ran = [t for t in [*BRANCHES.values(), "no_recovery"] if tasks.get(t) == "success"]
    return ran[0] if ran else f"none ran: {tasks}"


def _why(ctl: Controller, airflow: Standalone, incident_id: int) -> str:
    """The incident's timeline and what its handler task returned (for failure messages)."""
    import json

    out = {"timeline": ctl.timeline(incident_id)}
    run = airflow.incident_run(incident_id)
    for task in [*BRANCHES.values(), "no_recovery", "stop_job", "swap_machines", "restart_job", "wait_for_resume"
                 ] if run else []:
        try:
            out[task] = airflow.xcom("tg_incident", run["dag_run_id"], task)
        except Exception:  # a skipped task has none
            continue
    return json.dumps(out, default=str)[:6000]


def _repair(ctl: Controller, inv: Inventory, name: str) -> None:
    """What a repair crew does for an evicted machine: fix it, self-check, park it warm as a standby."""
    ctl.fleet.transition(name, states.REPAIR, reason="sent to repair")
    ctl.fleet.transition(name, states.SELF_CHECK, reason="repaired")
    parked = transport_for(inv).run(inv.machine(name), [inv.tg_node, "standby", "park", "--nproc", "2"],
                                    timeout=240)
    assert parked.ok, parked.describe()
    ctl.fleet.transition(name, states.STANDBY, reason="self-check passed (parked warm)", checked=True)


def _kill_sshd(inv: Inventory, name: str) -> None:
    """A standby dies: its sshd is gone, with every connection to it (the machine answers nothing)."""
    cluster.kill_sshd(Path(inv.machine(name).extra["machine_dir"]))


def test_a_lost_gpu_evicts_its_machine_and_a_warm_standby_resumes_the_job_passing_over_a_dead_one(
        control, cp_cluster: Inventory):
    """A lost GPU is evicted at once, and a warm standby takes its machine's place. The first standby in line is
    dead (its sshd gone): it was once evicted onto without a check, the launch failed, the incident ended
    failed and the job stopped training. It is passed over (and sent to repair); the next one takes the place."""
    ctl, airflow = control
    assert ctl.fleet.job(JOB).machine_list == ["m0", "m1", "m2", "m3"]  # the fixture's launch, untouched
    standbys = sorted(m.name for m in ctl.fleet.machines(state=states.STANDBY))
    assert len(standbys) == 2, standbys
    dead, spare = standbys
    _kill_sshd(cp_cluster, dead)
    last = _last_incident(ctl)
    t_fault = time.time()
    inject.inject(cp_cluster, "m1", "gpu_lost")
    try:
        inc = wait_until(lambda: _incident_done(ctl, last), timeout=240, interval=1.0,
                         what=f"the incident to close (runs: {[r['state'] for r in airflow.runs('tg_incident')]})")
    finally:
        inject.clear(cp_cluster, "m1", "gpu_lost")
        cluster.up(SPEC, cp_cluster.path.parent, log=lambda *_: None)  # the dead standby's sshd back (repair)
    assert inc.state == "resolved", ctl.timeline(inc.id)
    # the driver's Xid line (kernel log, 1 s check) or NVML's missing GPU (5 s check), whichever comes first
    assert inc.category == "machine_fault" and ("m1: gpu_lost" in inc.summary or "m1: kernel_xid" in inc.summary)
    kinds = [(a.kind, a.machines, a.outcome) for a in ctl.fleet.actions(inc.id)]
    assert ("evict", ["m1"], "done") in kinds, kinds
    assert ctl.fleet.machine("m1").state == states.EVICTED
    job = ctl.fleet.job(JOB)
    assert job.machine_list == ["m0", spare, "m2", "m3"]  # same node rank, survivors stay, the dead one passed over
    assert ctl.fleet.machine(spare).state == states.ACTIVE
    assert ctl.fleet.machine(dead).state == states.REPAIR and "did not answer" in ctl.fleet.machine(dead).reason
    # training resumed from the newest committed checkpoint, losing at most one step
    assert inc.resumed_ts is not None and inc.lost_steps is not None and inc.lost_steps <= 1, ctl.timeline(inc.id)
    run = airflow.incident_run(inc.id)
    tasks = airflow.task_states("tg_incident", run["dag_run_id"])
    assert tasks["evict_now"] == "success" and tasks["stop_time_diagnosis"] == "skipped", tasks
    # the rung decided; stop, swap and restart are tasks of their own
    assert tasks["stop_job"] == tasks["swap_machines"] == tasks["restart_job"] == "success", tasks
    assert airflow.xcom("tg_incident", run["dag_run_id"], "swap_machines")["swaps"] == {"m1": spare}
    # the run's note in the UI says it in one line (its last task sets it)
    assert airflow.finished("tg_incident", run["dag_run_id"], timeout=RUN_END_S) == "success"
    note = airflow.run_note("tg_incident", run["dag_run_id"])
    assert note.startswith(f"incident {inc.id} resolved (machine_fault): evicted m1 -> standby {spare}; resumed "), note
    launch = next(a for a in ctl.fleet.actions(inc.id) if a.kind == "launch")
    # the standby joined on its warm interpreters, and the survivors restarted on theirs (armed at launch)
    assert launch.evidence["warm"] == sorted(job.machine_list)
    # the alert watcher's event started the run (an asset-triggered one), whose triage recorded the alert and took
    # the incident it opened as its own
    assert run["run_type"] == "asset_triggered" and ctl.fleet.claimed_by(run["dag_run_id"]) == [inc.id]
    print(f"gpu_lost: alert {inc.first_alert_ts - t_fault:.1f}s after the fault, incident run's first task "
          f"{_first_task_s(airflow, inc):.1f}s after the alert, resumed {inc.resumed_ts - t_fault:.1f}s after the "
          f"fault, lost {inc.lost_steps} steps")


def _first_task_s(airflow: Standalone, inc: Any) -> float:
    """Seconds from the incident's first alert to the start of its run's first task (triage)."""
    from datetime import datetime

    run = airflow.incident_run(inc.id)
    [triage] = [t for t in airflow.task_instances("tg_incident", run["dag_run_id"]) if t["task_id"] == "triage"]
    return datetime.fromisoformat(triage["start_date"]).timestamp() - inc.first_alert_ts


def _restarted_incident(ctl: Controller, airflow: Standalone) -> Any:
    """The newest resolved incident whose tg_incident run restarted the job and ended, if any."""
    for inc in sorted(ctl.fleet.incidents(JOB), key=lambda i: -i.id):
        run = airflow.incident_run(inc.id)
        if inc.state == "resolved" and run and run["state"] == "success" and \
                any(a.kind == "launch" and a.outcome == "done" for a in ctl.fleet.actions(inc.id)):
            return inc
    return None


@pytest.mark.full  # (the CI tier's budget; its restart and deferred wait are what every recovery above runs)
def test_clearing_restart_job_of_a_finished_incident_run_restarts_the_job_and_waits_for_it_deferred(
        control, cp_cluster):
    """The graph is what runs: clearing ``restart_job`` in the UI (here through the REST API, as the UI
    does) restarts the job from the run's own XCom; ``wait_for_resume`` waits in the triggerer, holding no
    worker slot; clearing ``wait_for_resume`` checks the resume again without restarting anything."""
    ctl, airflow = control
    inc = _restarted_incident(ctl, airflow)
    if inc is None:  # run alone: an incident of its own (a crash, restarted in place)
        inc = _fault_and_recovery(ctl, airflow, cp_cluster, ctl.fleet.job(JOB).machine_list[2], "crash", rank=4)
        assert inc.state == "resolved", _why(ctl, airflow, inc.id)
    run_id = airflow.incident_run(inc.id)["dag_run_id"]
    assert airflow.finished("tg_incident", run_id, timeout=RUN_END_S) == "success"
    _quiet(ctl, airflow, cp_cluster)
    before = ctl.progress(JOB)
    launches = [a for a in ctl.fleet.actions(inc.id) if a.kind == "launch"]

    cleared = airflow.clear("tg_incident", run_id, ["restart_job"])
    assert cleared == ["close_incident", "outcome", "rearm_job", "restart_job", "wait_for_resume"]
    seen: set[str] = set()

    def ended() -> str | None:
        seen.add(airflow.task_states("tg_incident", run_id).get("wait_for_resume") or "none")
        state = airflow.run_state("tg_incident", run_id)
        return state if state in ("success", "failed") else None

    assert wait_until(ended, timeout=RUN_END_S, interval=0.2, what="the cleared run to end") == "success", \
        _why(ctl, airflow, inc.id)
    again = [a for a in ctl.fleet.actions(inc.id) if a.kind == "launch"]
    assert len(again) == len(launches) + 1 and again[-1].outcome == "done"  # the job was started again
    now = ctl.progress(JOB)
    assert all(now["incarnations"][m] != before["incarnations"][m] for m in now["incarnations"]), (before, now)
    inc = ctl.fleet.incident(inc.id)
    assert inc.state == "resolved" and "restarted again" in inc.summary, inc.summary
    restart = airflow.xcom("tg_incident", run_id, "restart_job")
    assert restart["restarted"] and restart["again"], restart
    resume = airflow.xcom("tg_incident", run_id, "wait_for_resume")
    assert resume["first_step"] > before["step"] - 2, resume
    # the wait ran in the triggerer: the task deferred (its log says so) and came back with the trigger's answer
    [ti] = [t for t in airflow.task_instances("tg_incident", run_id) if t["task_id"] == "wait_for_resume"]
    log = airflow.task_log("tg_incident", run_id, "wait_for_resume", ti["try_number"])
    assert "Pausing task as DEFERRED" in log and "checks in the triggerer" in log, (seen, log[-2000:])
    print(f"wait_for_resume states seen while the restarted job came back: {sorted(seen)}")

    # clearing the resume check alone: it answers again from the same restart, nothing is restarted
    wait_until(lambda: ctl.progress(JOB)["step"] >= resume["first_step"] + 2, timeout=120, what="the job to train")
    cleared = airflow.clear("tg_incident", run_id, ["wait_for_resume"])
    assert "restart_job" not in cleared and "wait_for_resume" in cleared
    assert wait_until(ended, timeout=RUN_END_S, interval=0.5, what="the cleared run to end") == "success"
    assert [a.id for a in ctl.fleet.actions(inc.id) if a.kind == "launch"] == [a.id for a in again]
    assert airflow.xcom("tg_incident", run_id, "wait_for_resume")["first_step"] == resume["first_step"]
    recoveries = [e for e in ctl.fleet.ettr_events(JOB) if e.incident_id == inc.id and e.kind == "recovery"]
    assert len(recoveries) == 2, recoveries  # the first restart's and the second's, each once


def _crash_restarted_in_place(ctl: Controller, airflow: Standalone, inv: Inventory) -> tuple[Any, list[str]]:
    machines = list(ctl.fleet.job(JOB).machine_list)
    first = _fault_and_recovery(ctl, airflow, inv, machines[2], "crash", rank=4)
    assert first.state == "resolved" and first.category == "crash" and first.level == 0, _why(ctl, airflow, first.id)
    assert _branch(airflow, first.id) == "restart_at_once"
    check = _handler_output(airflow, first.id, "restart_at_once")["check"]
    assert check["machines"] == [machines[2]] and not check["failed"]  # L1 of it passed beside the restore
    assert not [a for a in ctl.fleet.actions(first.id) if a.kind == "evict"]
    assert ctl.fleet.job(JOB).machine_list == machines  # restarted in place
    assert first.lost_steps is not None and first.lost_steps <= 1
    return first, machines


@pytest.mark.full  # (the CI tier's budget: it took 45-210 s there; the scripted fleet's tests in test_reconcile.py
# prove the re-triage, the close that looks at the job, and the retried close, each failing without it)
def test_a_crash_during_a_slow_vote_that_found_nothing_is_triaged_again_and_restarted_in_place(control, cp_cluster):
    """A compound fault no single alert names: a slowdown opens a fail-slow incident and clears, so its vote
    finds nothing; after the vote's verdict a rank is killed, and its machines' rank_exit alerts join the slow
    incident (too late to take it over). The close does not call the incident resolved while every machine's
    part has ended: the crash re-triages it, a new run of it diagnoses (every machine passes L1-L3) and
    restarts the job in place, losing at most one step."""
    ctl, airflow = control
    machines = list(ctl.fleet.job(JOB).machine_list)
    last = _ready_for_a_fault(ctl, airflow, cp_cluster)
    slow_rank = TOPO.ranks_on(1)[0]
    inject.inject(cp_cluster, machines[1], "slow", rank=slow_rank, params={"seconds": "3.0"})
    try:
        slow = wait_until(lambda: next((i for i in ctl.fleet.incidents(JOB) if i.id > last and i.category == "slow"),
                                       None), timeout=180, interval=0.5, what="a fail-slow incident")
    finally:
        inject.clear(cp_cluster, machines[1], "slow")  # the slowdown clears: the vote will find nothing
    [vote] = wait_until(lambda: [a for a in ctl.fleet.actions(slow.id) if a.kind == "vote"], timeout=180,
                        interval=0.2, what="the vote's verdict")
    assert vote.machines == [], _why(ctl, airflow, slow.id)
    killed = time.time()
    inject.inject(cp_cluster, machines[2], "crash", rank=4)
    inc = wait_until(lambda: _incident_done(ctl, last, killed), timeout=420, interval=1.0,
                     what=f"the incident to close (runs: {[r['state'] for r in airflow.runs('tg_incident')]})")
    assert inc.id == slow.id, _why(ctl, airflow, inc.id)  # the crash joined the slow incident
    assert [a for a in ctl.fleet.alerts_of(inc.id) if a.kind == "rank_exit" and a.ts >= killed], _why(ctl, airflow,
                                                                                                     inc.id)
    assert inc.state == "resolved" and inc.category == "crash", _why(ctl, airflow, inc.id)
    [again] = [a for a in ctl.fleet.actions(inc.id) if a.kind == "retriage"]
    assert again.evidence["from"] == "slow" and again.evidence["to"] == "crash"
    assert _branch(airflow, inc.id) == "restart_at_once"  # the run that took it over
    assert not [a for a in ctl.fleet.actions(inc.id) if a.kind == "evict"]  # L1 of the crashed machine passed
    assert ctl.fleet.job(JOB).machine_list == machines  # restarted in place
    assert inc.lost_steps is not None and inc.lost_steps <= 1, _why(ctl, airflow, inc.id)
    step = ctl.progress(JOB)["step"]
    wait_until(lambda: ctl.progress(JOB)["step"] >= step + 2, timeout=120, what="the job to train on")
    print(f"slow vote found nothing, crash joined {killed - slow.opened_ts:.1f}s after the slow incident opened; "
          f"resumed {inc.resumed_ts - killed:.1f}s after the kill")


@pytest.mark.full  # (the browser scenario triggers tg_diagnose too)
def test_a_diagnosis_by_hand_fans_out_one_task_per_machine_in_the_ssh_pool(control, cp_cluster):
    ctl, airflow = control
    machines = list(ctl.fleet.job(JOB).machine_list)
    assert airflow.request("GET", "/api/v2/pools/tg_ssh")["slots"] == 16  # created when Airflow started
    run_id = airflow.trigger("tg_diagnose", {"job": JOB, "machines": [], "level": 1, "evict": False})
    state = wait_until(lambda: (s := airflow.run_state("tg_diagnose", run_id)) in ("success", "failed") and s,
                       timeout=240, what="the tg_diagnose run to end")
    tis = airflow.task_instances("tg_diagnose", run_id)
    assert state == "success", [(t["task_id"], t["state"]) for t in tis]
    mapped = [t for t in tis if t["task_id"] == "check_machine"]
    assert sorted(t["rendered_map_index"] for t in mapped) == sorted(machines)  # one task per machine, named
    assert {(t["pool"], t["state"]) for t in mapped} == {("tg_ssh", "success")}
    out = airflow.xcom("tg_diagnose", run_id, "conclude")
    assert out["failed"] == {} and sorted(out["machines"]) == sorted(machines)
    assert ctl.fleet.job(JOB).machine_list == machines  # nothing evicted without "evict"


def test_the_reconciler_looks_at_the_job_from_the_triggerer_and_status_says_when(control, cp_cluster):
    """tg_reconcile's look is its asset's watcher, in the triggerer (no task waits): each pass writes its beat into
    the asset's state store (Airflow's) and nothing of trainguard's; ``trainguard status``, with the operator's
    login, reads both watchers' beats through the REST API and finds nothing wrong with either."""
    import subprocess
    import sys

    from trainguard.operators.triggers.alerts import ALERTS_ASSET
    from trainguard.operators.triggers.reconcile import RECONCILE_ASSET

    ctl, airflow = control
    beat = wait_until(lambda: airflow.api.watcher_beat(RECONCILE_ASSET), timeout=120, interval=1.0,
                      what="the reconciler's first pass")
    assert time.time() - beat["ts"] < 3 * 30 and beat["passes"] >= 1, beat
    assert beat["runs_known"], beat  # it reads the live incident runs through the REST API
    assert time.time() - airflow.api.watcher_beat(ALERTS_ASSET)["ts"] < 30  # the alert watcher polls too
    pw = json.loads((airflow.home / "simple_auth_manager_passwords.json.generated").read_text())["admin"]
    env = {**os.environ, "TG_FLEET_URL": ctl.cfg.fleet_url, "TG_INVENTORY": ctl.cfg.inventory,
           "TG_RECONCILE_PERIOD_S": "30", "TG_AIRFLOW_URL": airflow.url, "TG_AIRFLOW_USER": "admin",
           "TG_AIRFLOW_PASSWORD": pw}
    out = subprocess.run([sys.executable, "-m", "trainguard.operators.cli", "--json", "status"], capture_output=True,
                         text=True, env=env, timeout=120, check=False)
    doc = json.loads(out.stdout)
    assert doc["reconciler"]["last_pass_age_s"] < 90 and doc["guardian"]["last_poll_age_s"] < 30, doc
    assert not [p for p in doc["problems"] if "reconciler" in p or "watcher" in p], doc["problems"]


def test_the_ettr_ledger_accounts_every_closed_incident_by_cause(control, cp_cluster):
    import json
    import subprocess
    import sys

    ctl, _airflow = control
    closed = [i for i in ctl.fleet.incidents(JOB) if i.state in ("resolved", "failed")]
    trained = ctl.progress(JOB)["step"]
    env = {**os.environ, "TG_FLEET_URL": ctl.cfg.fleet_url, "TG_INVENTORY": ctl.cfg.inventory}
    cli = subprocess.run([sys.executable, "-m", "trainguard.operators.cli", "--json", "ettr", "--job", JOB,
                          "--window-s", "600"],
                         capture_output=True, text=True, env=env, timeout=120, check=False)
    assert cli.returncode == 0, cli.stderr
    report = json.loads(cli.stdout)
    total = report["cumulative"]
    assert 0 < total["ettr"] < 1 and total["kept_steps"] >= trained + 1, (trained, total)  # steps 0 .. trained
    assert [x["incident"] for x in report["incidents"]] == [i.id for i in closed]
    assert set(report["by_cause"]) == {i.category for i in closed}
    assert sum(v["incidents"] for v in report["by_cause"].values()) == len(closed)
    # every step an incident lost was run again: the ledger counts it as lost work, not as progress
    assert total["lost_steps"] >= sum(i.lost_steps or 0 for i in closed)
    recovered = [x for x in report["incidents"] if x["recovery_s"] > 0]
    assert len(recovered) == len([i for i in closed if i.resumed_ts]), report["incidents"]
    bad = subprocess.run([sys.executable, "-m", "trainguard.operators.cli", "ettr", "--job", "nosuchjob"],
                         capture_output=True, text=True, env=env, timeout=120, check=False)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "nosuchjob" in bad.stderr, bad.stderr


@pytest.mark.full
def test_a_second_crash_right_after_a_recovery_escalates_one_rung(control, cp_cluster):
    """The same job fails again right after a recovery: the ladder goes one rung up (the first crash was
    restarted at once; now the stop-time diagnosis of every machine, and with every machine passing and no other
    known-good revision, a restart)."""
    ctl, airflow = control
    _first, machines = _crash_restarted_in_place(ctl, airflow, cp_cluster)
    second = _fault_and_recovery(ctl, airflow, cp_cluster, machines[2], "crash", rank=5, fresh=False)
    assert second.level == 1 and second.state == "resolved", _why(ctl, airflow, second.id)
    assert _branch(airflow, second.id) == "stop_time_diagnosis"
    out = _handler_output(airflow, second.id, "stop_time_diagnosis")
    assert sorted(out["diagnosis"]["machines"]) == sorted(machines) and not out["diagnosis"]["failed"]
    assert ctl.fleet.job(JOB).machine_list == machines


def _repair_evicted(ctl: Controller, inv: Inventory) -> None:
    """The repair crew: every machine evicted, or sent to repair (a standby that did not answer), is fixed
    and parked warm again."""
    for name in [m.name for m in [*ctl.fleet.machines(state=states.EVICTED), *ctl.fleet.machines(state=states.REPAIR)]]:
        inject.clear(inv, name)
        _repair(ctl, inv, name)


@pytest.mark.full  # (the CI tier's budget: the scale-out tier's hang, in the full tier too, checks the same)
def test_a_hung_rank_over_evicts_its_pipeline_and_no_checkpoint_is_lost(control, cp_cluster):
    ctl, airflow = control
    _repair_evicted(ctl, cp_cluster)
    assert len(ctl.fleet.machines(state=states.STANDBY)) == 2
    before = list(ctl.fleet.job(JOB).machine_list)
    stuck_rank = 6  # dp1 pp1 tp0, on node 3
    inc = _fault_and_recovery(ctl, airflow, cp_cluster, before[3], "hang", rank=stuck_rank)
    assert inc.state == "resolved" and inc.category == "hang", _why(ctl, airflow, inc.id)
    assert _branch(airflow, inc.id) == "runtime_analysis"
    evict = next(a for a in ctl.fleet.actions(inc.id) if a.kind == "evict")
    pipeline = {before[i] for i in TOPO.machines_of_group("pp", stuck_rank)}
    assert set(evict.machines) == pipeline == {before[2], before[3]}  # exactly the stuck rank's PP group
    after = ctl.fleet.job(JOB).machine_list
    assert after[:2] == before[:2] and not set(after[2:]) & pipeline
    assert inc.lost_steps is not None and inc.lost_steps <= 1  # their state came from the replicas


@pytest.mark.full
def test_a_user_code_error_rolls_back_to_the_last_known_good_revision(control, cp_cluster):
    ctl, airflow = control
    ctl.fleet.mark_known_good(JOB, "r0")  # it trained healthy for a while
    assert ctl.hot_update(JOB, "r1", reason="new data pipeline")["updated"]
    machines = list(ctl.fleet.job(JOB).machine_list)
    inc = _fault_and_recovery(ctl, airflow, cp_cluster, machines[0], "user_error", rank=0)
    assert inc.state == "resolved", _why(ctl, airflow, inc.id)
    assert _branch(airflow, inc.id) == "restart_at_once"  # the logs read as it stopped blame the code
    rollback = next(a for a in ctl.fleet.actions(inc.id) if a.kind == "rollback")
    assert rollback.evidence == {"to": "r0", "from": "r1"}
    assert ctl.fleet.job(JOB).revision == "r0" and ctl.fleet.job(JOB).machine_list == machines
    assert not [a for a in ctl.fleet.actions(inc.id) if a.kind == "evict"]


@pytest.mark.full
def test_a_full_disk_gets_its_machine_evicted(control, cp_cluster):
    ctl, airflow = control
    _repair_evicted(ctl, cp_cluster)
    machines = list(ctl.fleet.job(JOB).machine_list)
    try:
        inc = _fault_and_recovery(ctl, airflow, cp_cluster, machines[1], "disk_full")
    finally:
        inject.clear(cp_cluster, machines[1], "disk_full")
    assert inc.state == "resolved", _why(ctl, airflow, inc.id)
    evicted = next(a for a in ctl.fleet.actions(inc.id) if a.kind == "evict").machines
    assert machines[1] in evicted and machines[1] not in ctl.fleet.job(JOB).machine_list
    # the disk check (every 10 s) says disk_full; the ranks' heartbeat writes may fail first and
    # make it look like a hang: then the machine's whole pipeline goes, which still holds the culprit;
    # or a rank dies of a failed write first: L1 of its machine beside the restart (the disk check) fails, and
    # the stop-time diagnosis that follows finds it
    if inc.category == "machine_fault":  # (also when its alert joined a hang's incident before that acted)
        assert evicted == [machines[1]]
    elif inc.category == "crash":
        assert _branch(airflow, inc.id) == "restart_at_once" and evicted == [machines[1]]
    else:
        assert inc.category == "hang" and _branch(airflow, inc.id) == "runtime_analysis"
        groups = [{machines[i] for i in TOPO.machines_of_group(kind, TOPO.ranks_on(1)[0])} for kind in ("pp", "dp")]
        assert set(evicted) in groups  # one parallel group of the machine whose disk is full


def _handler_output(airflow: Standalone, incident_id: int, task: str) -> dict[str, Any]:
    """What ``task`` of the incident's tg_incident run returned (its XCom)."""
    run = airflow.incident_run(incident_id)
    assert run is not None, f"no tg_incident run for incident {incident_id}"
    return airflow.xcom("tg_incident", run["dag_run_id"], task)


@pytest.mark.full
def test_a_nan_loss_is_diagnosed_with_the_alignment_test_and_restarts_from_a_finite_checkpoint(control, cp_cluster):
    ctl, airflow = control
    _repair_evicted(ctl, cp_cluster)
    machines = list(ctl.fleet.job(JOB).machine_list)
    inc = _fault_and_recovery(ctl, airflow, cp_cluster, machines[1], "nan", rank=TOPO.ranks_on(1)[0])
    assert inc.state == "resolved" and inc.category == "nan", _why(ctl, airflow, inc.id)
    assert _branch(airflow, inc.id) == "stop_time_diagnosis"
    out = _handler_output(airflow, inc.id, "stop_time_diagnosis")
    # every machine ran L1-L3 and the alignment test, and they agreed: a transient NaN, restart in place
    assert sorted(out["diagnosis"]["report"]["align"]) == sorted(machines), out["diagnosis"]
    assert len(set(out["diagnosis"]["report"]["align"].values())) == 1 and not out["diagnosis"]["failed"]
    assert not [a for a in ctl.fleet.actions(inc.id) if a.kind == "evict"]
    assert ctl.fleet.job(JOB).machine_list == machines
    # restore skipped every step whose parameters were no longer finite: training goes on with finite losses
    nan_step = min(a.document["evidence"]["step"] for a in ctl.fleet.alerts_of(inc.id) if a.kind == "nan_loss")
    m0 = ctl.inventory.machine(machines[0])
    records = [r for r in launcher.steps(ctl.inventory, JOB, m0, rank=0, transport=ctl.transport)
               if r.get("ts", 0) > inc.decided_ts]
    assert records and records[0]["ckpt_restored_step"] < nan_step, (nan_step, records[:2])
    assert all(math.isfinite(float(r["loss"])) for r in records), [r["loss"] for r in records]


@pytest.mark.full
def test_silent_data_corruption_finds_and_evicts_the_machine_that_computes_wrong(control, cp_cluster):
    ctl, airflow = control
    _repair_evicted(ctl, cp_cluster)
    machines = list(ctl.fleet.job(JOB).machine_list)
    bad = machines[2]
    try:
        inc = _fault_and_recovery(ctl, airflow, cp_cluster, bad, "sdc")
    finally:
        inject.clear(cp_cluster, bad, "sdc")
    assert inc.state == "resolved" and inc.category == "sdc", _why(ctl, airflow, inc.id)
    assert _branch(airflow, inc.id) == "silent_corruption"
    out = _handler_output(airflow, inc.id, "silent_corruption")
    digests = out["diagnosis"]["report"]["align"]
    assert sorted(digests) == sorted(machines) and len({d for n, d in digests.items() if n != bad}) == 1
    assert digests[bad] != digests[machines[0]]
    evict = next(a for a in ctl.fleet.actions(inc.id) if a.kind == "evict")
    assert evict.machines == [bad]  # only the machine that computes wrong
    after = ctl.fleet.job(JOB).machine_list
    assert bad not in after and [m for m in after if m in machines] == [m for m in machines if m != bad]
    # the steps from the divergence on hold corrupted parameters: the restart restored the one before it,
    # and the data-parallel replicas agree again
    diverged = ctl.first_step_of(inc.id, ["sdc_suspect"])
    launch = next(a for a in ctl.fleet.actions(inc.id) if a.kind == "launch")
    assert launch.evidence["restore_max_step"] == diverged - 1
    m0 = ctl.inventory.machine(after[0])
    records = [r for r in launcher.steps(ctl.inventory, JOB, m0, rank=0, transport=ctl.transport)
               if r.get("ts", 0) > inc.decided_ts]
    assert records and records[0]["ckpt_restored_step"] <= diverged - 1, (diverged, records[:1])
    assert all(r["dp_digests_match"] for r in records)


def _recent(ctl: Controller, since_id: int) -> str:
    """Every incident from ``since_id`` on with its timeline (for failure messages)."""
    import json

    return json.dumps({i.id: ctl.timeline(i.id) for i in ctl.fleet.incidents(JOB) if i.id >= since_id},
                      default=str)[:8000]


def _assert_replaced(ctl: Controller, inc: Any, before: list[str], evicted: set[str]) -> None:
    """The evicted machines left the job, the survivors kept their places, and at most one step was lost."""
    after = ctl.fleet.job(JOB).machine_list
    assert not evicted & set(after) and [m for m in after if m in before] == [m for m in before if m not in evicted], \
        _recent(ctl, inc.id - 2)
    assert inc.lost_steps is not None and inc.lost_steps <= 1, ctl.timeline(inc.id)


@pytest.mark.full
def test_a_slow_rank_is_voted_out_with_its_group_while_the_job_trains(control, cp_cluster):
    ctl, airflow = control
    _repair_evicted(ctl, cp_cluster)
    machines = list(ctl.fleet.job(JOB).machine_list)
    slow_rank = TOPO.ranks_on(1)[0]
    try:
        inc = _fault_and_recovery(ctl, airflow, cp_cluster, machines[1], "slow", rank=slow_rank,
                                  params={"seconds": "3.0"})
    finally:
        inject.clear(cp_cluster, machines[1], "slow")
    assert inc.state == "resolved" and inc.category == "slow", _why(ctl, airflow, inc.id)
    assert _branch(airflow, inc.id) == "slow_vote"
    vote = _handler_output(airflow, inc.id, "slow_vote")["vote"]
    assert len(vote["rounds"]) == 5 and sum(slow_rank in r for r in vote["rounds"]) >= 3, vote
    evicted = set(next(a for a in ctl.fleet.actions(inc.id) if a.kind == "evict").machines)
    # the slow rank's machine, and at most its pipeline (the ranks waiting on it downstream may vote too)
    assert machines[1] in evicted <= {machines[i] for i in TOPO.machines_of_group("pp", slow_rank)}, vote
    _assert_replaced(ctl, inc, machines, evicted)


@pytest.mark.full
def test_a_nic_that_flaps_twice_gets_its_machine_evicted(control, cp_cluster):
    ctl, airflow = control
    _repair_evicted(ctl, cp_cluster)
    machines = list(ctl.fleet.job(JOB).machine_list)
    flaky = machines[2]
    link = ("kernel_link", "nic_down")
    first = _fault_and_recovery(ctl, airflow, cp_cluster, flaky, "nic_down", flap_until=link)
    assert first.state == "resolved" and first.category == "network", _why(ctl, airflow, first.id)
    assert _branch(airflow, first.id) == "no_recovery" and not ctl.fleet.actions(first.id)  # tolerated once
    assert ctl.fleet.job(JOB).machine_list == machines
    second = _fault_and_recovery(ctl, airflow, cp_cluster, flaky, "nic_down", fresh=False, flap_until=link)
    assert second.state == "resolved" and second.category == "network", _why(ctl, airflow, second.id)
    assert "repeated" in second.summary and _branch(airflow, second.id) == "evict_now"
    assert next(a for a in ctl.fleet.actions(second.id) if a.kind == "evict").machines == [flaky]
    _assert_replaced(ctl, second, machines, {flaky})


@pytest.mark.full
def test_a_gpu_that_computes_wrong_only_in_training_is_found_by_dual_phase_replay(control, cp_cluster):
    ctl, airflow = control
    _repair_evicted(ctl, cp_cluster)
    machines = list(ctl.fleet.job(JOB).machine_list)
    bad = machines[3]
    try:  # one GPU of the machine flips a gradient bit in every training step; the alignment test is clean
        inc = _fault_and_recovery(ctl, airflow, cp_cluster, bad, "bitflip", rank=TOPO.ranks_on(3)[0], timeout=480)
    finally:
        inject.clear(cp_cluster, bad, "bitflip")
    assert inc.state == "resolved" and inc.category == "sdc", _why(ctl, airflow, inc.id)
    assert _branch(airflow, inc.id) == "silent_corruption"
    out = _handler_output(airflow, inc.id, "silent_corruption")
    assert not out["diagnosis"]["failed"] and len(set(out["diagnosis"]["report"]["align"].values())) == 1
    replay = out["replay"]
    # horizontal: [m0 m1] [m2 m3] beside the standbys' reference pipeline; vertical: [m0 m3] [m2 m1]
    assert replay["horizontal"] == [machines[:2], machines[2:]] and len(replay["reference"]) == TOPO.pp
    h, v = replay["horizontal_results"], replay["vertical_results"]
    assert h["h0"] == h["ref"] != h["h1"] and v["v0"] != v["v1"] == h["ref"], replay
    assert replay["culprits"] == [bad] and not replay["inconclusive"]
    evict = next(a for a in ctl.fleet.actions(inc.id) if a.kind == "evict")
    assert evict.machines == [bad]
    after = ctl.fleet.job(JOB).machine_list
    assert bad not in after and after[:3] == machines[:3]
    diverged = ctl.first_step_of(inc.id, ["sdc_suspect"])
    launch = next(a for a in ctl.fleet.actions(inc.id) if a.kind == "launch")
    assert launch.evidence["restore_max_step"] == diverged - 1


def _agent_pid(inv: Inventory, name: str) -> int:
    """The pid of machine ``name``'s agent process (not its supervisor), as the kernel knows it."""
    import json

    from trainguard.node_tools import agent
    from trainguard.node_tools.config import NodeConfig

    cfg = NodeConfig.load(Path(inv.machine(name).extra["node_config"]))
    doc = agent.processes(cfg)
    assert doc["agent"]["state"] == "running", json.dumps(doc)
    return int(doc["agent"]["pid"])


@pytest.mark.full
def test_a_silent_agent_is_probed_and_restarted_while_the_job_trains_on(control, cp_cluster):
    """The node agent of an active machine was stopped for 143 s: no alert, no incident, the machine stayed
    active and 'cluster status' said it was fine."""
    ctl, airflow = control
    _repair_evicted(ctl, cp_cluster)
    machines = list(ctl.fleet.job(JOB).machine_list)
    quiet = machines[1]
    _quiet(ctl, airflow, cp_cluster)
    last = _last_incident(ctl)
    pid = _agent_pid(cp_cluster, quiet)
    os.kill(pid, signal.SIGSTOP)
    try:
        seen = {m["name"]: m["agent_state"] for m in cluster.status(cp_cluster.path.parent)["machines"]}
        assert seen[quiet] == "stopped" and all(v == "running" for n, v in seen.items() if n != quiet), seen
        inc = wait_until(lambda: _incident_done(ctl, last), timeout=120, interval=1.0,
                         what="the silent agent's incident to close")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    assert inc.category == "agent" and inc.state == "resolved", _why(ctl, airflow, inc.id)
    assert _branch(airflow, inc.id) == "probe_machine"
    [probe] = [a for a in ctl.fleet.actions(inc.id) if a.kind == "probe"]
    assert probe.machines == [quiet] and "passed L1" in probe.evidence["restarted"]
    assert _agent_pid(cp_cluster, quiet) != pid  # a fresh agent runs there now
    assert ctl.fleet.job(JOB).machine_list == machines  # the job was left alone: no stop, no restart
    assert not [a for a in ctl.fleet.actions(inc.id) if a.kind in ("launch", "evict")]


@pytest.mark.full
def test_forged_and_oversized_alerts_and_a_clock_an_hour_ahead_neither_blind_the_guardian_nor_stop_the_job(
        control, cp_cluster):
    """One alert stamped an hour ahead blinded the guardian for an hour; an alert naming a machine outside the
    inventory stopped and restarted the whole job; a 10 MB evidence field blinded it for 40 s."""
    from trainguard.node_tools.alerts import Alert
    from trainguard.node_tools.bus import open_bus

    ctl, airflow = control
    _repair_evicted(ctl, cp_cluster)
    machines = list(ctl.fleet.job(JOB).machine_list)
    _quiet(ctl, airflow, cp_cluster)
    last = _last_incident(ctl)
    bus = open_bus(cp_cluster.bus_url)
    t_bad = time.time()
    bus.publish(Alert("gpu_lost", "m99", job=JOB, ts=time.time() + 3600))  # forged, and an hour ahead
    huge = Alert("kernel_xid", machines[0], evidence={"xid": 79, "blob": "x" * (10 << 20)}).to_dict()
    (Path(cp_cluster.bus_url.removeprefix("spool://")) / "alerts" /
     f"{time.time_ns():020d}-{machines[0]}-{'b' * 32}.json").write_text(json.dumps(huge))

    def both() -> list[str]:
        reasons = [q.reason for q in ctl.fleet.quarantined(since=t_bad)]
        ok = any("machine 'm99' is not in the inventory" in r for r in reasons) and \
            any("over the limit of 65536 bytes" in r for r in reasons)
        return reasons if ok else []

    wait_until(both, timeout=60, what="both documents to be quarantined")
    assert _last_incident(ctl) == last  # nothing acted on
    t_fault = time.time()
    inject.inject(cp_cluster, machines[2], "gpu_lost")
    try:
        inc = wait_until(lambda: _incident_done(ctl, last, t_fault), timeout=240, interval=1.0,
                         what="the lost GPU's incident to close")
    finally:
        inject.clear(cp_cluster, machines[2], "gpu_lost")
    assert inc.state == "resolved" and inc.category == "machine_fault", _why(ctl, airflow, inc.id)
    assert inc.opened_ts - t_fault < 30, f"the incident opened {inc.opened_ts - t_fault:.1f}s after the fault"
    assert next(a for a in ctl.fleet.actions(inc.id) if a.kind == "evict").machines == [machines[2]]


@pytest.mark.full
@pytest.mark.timeout(1200)  # a first run installs chromium
def test_an_operator_triggers_a_diagnosis_from_the_airflow_ui_in_a_browser(control, cp_cluster):
    """Headless Chromium: log in, open tg_diagnose, fill its Params form for one machine, trigger; the
    run page then shows the run succeeded, its one mapped task named after the machine, and its note."""
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    from tests.browser import artifacts_dir, chrome, login

    ctl, airflow = control
    machine = ctl.fleet.job(JOB).machine_list[0]
    before = {r["dag_run_id"] for r in airflow.runs("tg_diagnose")}
    d = chrome()
    shot = artifacts_dir() / "airflow-ui-tg_diagnose-run.png"
    try:
        wait = WebDriverWait(d, 120)
        login(d, airflow)
        d.get(f"{airflow.url}/dags/tg_diagnose")
        wait.until(ec.element_to_be_clickable((By.CSS_SELECTOR, "button[aria-label='Trigger Dag']"))).click()
        form = wait.until(ec.presence_of_element_located(
            (By.XPATH, "//*[@role='dialog'][.//textarea[@name='element_machines']]")))
        # the job field is pre-filled with the fleet's job (the form offers the jobs there are)
        form.find_element(By.NAME, "element_machines").send_keys(machine)
        trigger = next(b for b in form.find_elements(By.TAG_NAME, "button")
                       if b.get_attribute("textContent").strip() == "Trigger")
        d.execute_script("arguments[0].scrollIntoView(true);", trigger)
        trigger.click()
        wait.until(lambda drv: "/dags/tg_diagnose/runs/" in drv.current_url)
        run_id = urllib.parse.unquote(d.current_url.split("/runs/", 1)[1].split("?")[0])
        assert run_id not in before
        # the run the form started has the form's parameters
        run = airflow.request("GET", f"/api/v2/dags/tg_diagnose/dagRuns/{urllib.parse.quote(run_id)}")
        assert run["conf"]["job"] == JOB and run["conf"]["machines"] == [machine], run["conf"]
        assert airflow.finished("tg_diagnose", run_id, timeout=300) == "success"
        note = airflow.run_note("tg_diagnose", run_id)
        assert note == f"{JOB}: 1 machine diagnosed; all passed", note
        d.refresh()
        # the page renders in parts (header, note, then the task table): wait for one rendering that shows
        # the note, the task and its state together
        wanted = (note, "Success", "check_machine", machine)

        def shown(drv):
            text = drv.find_element(By.TAG_NAME, "body").text
            return text if all(w in text for w in wanted) else False

        try:
            body = wait.until(shown)
        except TimeoutException:
            body = d.find_element(By.TAG_NAME, "body").text
        assert all(w in body for w in wanted), body
    finally:
        d.save_screenshot(str(shot))
        d.quit()
    assert shot.stat().st_size > 10_000


@pytest.mark.full
@pytest.mark.timeout(1200)  # a first run installs chromium
def test_the_fleet_page_in_the_airflow_ui_shows_a_running_job_then_one_stopped_behind_the_control_planes_back(
        control, cp_cluster):
    """Headless Chromium: the UI's navigation has a Fleet page (the trainguard plugin); it says the job is
    running; after the job's processes are stopped on its machines directly (the fleet database still
    says running, and no alert comes: a stop marks the job as stopping on purpose), the page says stopped and
    that the job is not training. The reconciler sees the same on its own looks, opens an incident for it (a
    job down), and the job trains again without anyone starting it; the page says running again."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    from tests.browser import artifacts_dir, chrome, login

    ctl, airflow = control
    machines = list(ctl.fleet.job(JOB).machine_list)
    d = chrome()
    shot = artifacts_dir() / "airflow-ui-fleet.png"
    stopped = False

    def job_state() -> str:
        """The page's state cell of the job (the page shown inside the UI, in its frame)."""
        d.switch_to.default_content()
        d.get(f"{airflow.url}/plugin/trainguard-fleet")
        frame = WebDriverWait(d, 60).until(ec.presence_of_element_located((By.TAG_NAME, "iframe")))
        d.switch_to.frame(frame)
        cell = WebDriverWait(d, 60).until(ec.presence_of_element_located(
            (By.CSS_SELECTOR, f"tr[data-job='{JOB}'] td.state")))
        return cell.text

    try:
        _quiet(ctl, airflow, cp_cluster)
        login(d, airflow)
        d.get(f"{airflow.url}/")
        nav = WebDriverWait(d, 60).until(lambda drv: [a for a in drv.find_elements(By.CSS_SELECTOR, "a[href]")
                                                      if "/plugin/trainguard-fleet" in a.get_attribute("href")])
        assert nav, "no Fleet link in the UI's navigation"
        assert job_state() == "running"
        # behind the control plane's back: the job's processes stopped on its machines, nothing recorded
        done = transport_for(cp_cluster).run_many([cp_cluster.machine(m) for m in machines],
                                                  lambda m: [cp_cluster.tg_node, "job", "stop", "--job", JOB],
                                                  timeout=60)
        stopped = True
        assert all(r.ok for r in done.values()), {n: r.describe() for n, r in done.items()}
        assert ctl.fleet.job(JOB).state == "running"  # what the database says
        last = _last_incident(ctl)
        assert wait_until(lambda: job_state() == "stopped", timeout=60, interval=1.0, what="the page to say stopped")
        body = d.find_element(By.TAG_NAME, "body").text
        assert "not training" in body, body
        d.save_screenshot(str(shot))
        # the reconciler: two looks agree the job is down, an incident through the ladder, the job trains again
        inc = wait_until(lambda: _incident_done(ctl, last), timeout=RUN_END_S, interval=1.0,
                         what="the reconciler's incident to close")
        assert inc.state == "resolved" and inc.category == "crash", _why(ctl, airflow, inc.id)
        kinds = {a.kind for a in ctl.fleet.alerts_of(inc.id)}
        assert kinds == {"job_down"}, kinds
        assert all(a.document["evidence"]["source"] == "reconciler" for a in ctl.fleet.alerts_of(inc.id))
        stopped = False
        assert wait_until(lambda: job_state() == "running", timeout=120, interval=1.0,
                          what="the page to say running again")
        print(f"job stopped behind the control plane's back: resumed {inc.resumed_ts - inc.first_alert_ts:.1f}s after "
              f"the reconciler's alert")
    finally:
        d.quit()
        if stopped:  # the reconciler did not bring it back: the next scenario still finds the job training
            ctl.start(JOB)
            wait_until(lambda: ctl.trains(JOB), timeout=180, interval=1.0, what="the job to train again")
    assert shot.stat().st_size > 10_000

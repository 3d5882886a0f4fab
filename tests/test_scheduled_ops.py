"""Scheduled operations end to end: a real ``airflow standalone`` runs tg_standby_pool and tg_code_update
(with tg_guardian and tg_incident behind them) against a namespace cluster of its own: a guarded job
(TP=2 DP=2) on m0 and m1, standby m2 parked warm, and m3, m4 free (unprovisioned) inventory.

The DAGs are triggered by hand through the REST API, as an operator does from the UI's form; the tests
read what they did from the fleet database, the machines and the runs' results and logs.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from node_tools import cluster, inject, launcher
from node_tools.inventory import Inventory
from node_tools.topology import Topology
from node_tools.transport import transport_for
from operators.airflow.standalone import Standalone
from operators.control import ControlConfig, Controller
from operators.fleet import states
from tests.conftest import own_cluster, wait_until

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.airflow]

SPEC = cluster.ClusterSpec(name="tgs", machines=5, standbys=1, free=2, subnet="10.213.18.0/24", disk_mb=256, gpus=8)
TOPO = Topology(tp=2, pp=1, dp=2)
JOB = "ops"
TRAIN = ["--checkpoint", "--step-delay-s", "0.2"]
KNOWN_GOOD_STEPS = 5


@pytest.fixture(scope="module")
def ops_cluster() -> Iterator[Inventory]:
    with own_cluster(SPEC, "tg-test-ops-") as inv:
        yield inv


@pytest.fixture(scope="module")
def ops(ops_cluster: Inventory) -> Iterator[tuple[Controller, Standalone]]:
    assert ops_cluster.path is not None
    home = ops_cluster.path.parent.parent / "control"
    home.mkdir()
    cfg = ControlConfig(fleet_url=str(home / "fleet.db"), inventory=str(ops_cluster.path))
    ctl = Controller(cfg)
    ctl.sync_inventory()
    airflow = Standalone(home / "airflow", {"TG_FLEET_URL": cfg.fleet_url, "TG_INVENTORY": cfg.inventory,
                                            "TG_CONTROL_HOME": str(home), "TG_ESCALATION_WINDOW_S": "5",
                                            # by hand here (the tests trigger them), as from the UI's form
                                            "TG_POOL_SCHEDULE": "", "TG_CODE_UPDATE_SCHEDULE": "",
                                            "TG_KNOWN_GOOD_STEPS": str(KNOWN_GOOD_STEPS)})
    (home / "airflow").mkdir()
    try:
        parked = transport_for(ops_cluster).run(ops_cluster.machine("m2"), [ops_cluster.tg_node, "standby", "park",
                                                                            "--nproc", "2"], timeout=240)
        assert parked.ok, parked.describe()
        airflow.start()
        launched = ctl.launch_job(JOB, TOPO, ["m0", "m1"], train_args=TRAIN)
        assert launched["armed"]["parked"] == ["m0", "m1"], launched
        wait_until(lambda: ctl.progress(JOB)["step"] >= 3, timeout=180, what="the job to train")
        yield ctl, airflow
    finally:
        airflow.stop()
        try:
            ctl.stop(JOB)
        except Exception as exc:  # the cluster goes down next anyway
            print(f"stopping the job: {exc}")


def _run(airflow: Standalone, dag_id: str, conf: dict[str, Any], *, timeout: float = 300) -> tuple[str, str]:
    run_id = airflow.trigger(dag_id, conf)
    return run_id, airflow.finished(dag_id, run_id, timeout=timeout)


def _revisions(ctl: Controller, inv: Inventory) -> set[str]:
    """The revision each machine of the job runs now (what its ranks were started with)."""
    j = ctl.fleet.job(JOB)
    st = launcher.status(inv, JOB, [inv.machine(n) for n in j.machine_list], transport=ctl.transport)
    return {d.get("revision") for d in st.values()}


def test_the_pool_fills_its_target_with_checked_standbys_and_refuses_a_faulty_machine(ops, ops_cluster):
    ctl, airflow = ops
    before = {m.name: m.state for m in ctl.fleet.machines()}
    # a target beyond the inventory (1 standby + 2 free) is refused, and nothing changes
    run_id, state = _run(airflow, "tg_standby_pool", {"target": 9})
    assert state == "failed"
    assert "pool target 9 is larger than the free inventory (3 machines" in airflow.task_log(
        "tg_standby_pool", run_id, "plan")
    assert {m.name: m.state for m in ctl.fleet.machines()} == before

    inject.inject(ops_cluster, "m4", "sdc")  # m4 computes wrong: its L2 self-check must catch it
    try:
        run_id, state = _run(airflow, "tg_standby_pool", {"target": 3})
    finally:
        inject.clear(ops_cluster, "m4", "sdc")
    assert state == "success"
    out = airflow.xcom("tg_standby_pool", run_id, "conclude")
    assert out["joined"] == ["m3"] and list(out["failed"]) == ["m4"], out
    assert out["note"].startswith("pool 2/3; joined or re-checked: m3; to repair: m4 (L2: "), out["note"]
    assert out["note"].endswith("short by 1: add machines to the inventory")
    m3, m4 = ctl.fleet.machine("m3"), ctl.fleet.machine("m4")
    assert m3.state == states.STANDBY and m3.checked_ts is not None
    assert m4.state == states.REPAIR and m4.reason.startswith("self-check failed: L2")
    assert ctl.parked(["m3"]) == {"m3"}  # parked warm: ready to join a job in seconds
    # each machine was one mapped task, named after it
    tasks = airflow.task_instances("tg_standby_pool", run_id)
    assert sorted(t.get("rendered_map_index") for t in tasks if t["task_id"] == "self_check") == ["m3", "m4"]
    # a full pool: the run changes nothing (m4 waits for repair; 3 is now more than the inventory holds)
    run_id, state = _run(airflow, "tg_standby_pool", {"target": 2})
    again = airflow.xcom("tg_standby_pool", run_id, "conclude")
    assert state == "success" and again["joined"] == [] and again["standbys"] == 2 and again["note"] == "pool 2/2"
    assert [e.to_state for e in ctl.fleet.events("m3")].count(states.STANDBY) == 1


def test_a_hot_update_switches_the_revision_in_place_and_training_resumes(ops, ops_cluster):
    ctl, airflow = ops
    ctl.fleet.record_revision(JOB, "r1", reason="faster data loader")
    machines = list(ctl.fleet.job(JOB).machine_list)
    run_id, state = _run(airflow, "tg_code_update", {"job": JOB, "revision": "r1", "urgency": "urgent",
                                                     "reason": "loader fix"})
    assert state == "success"
    out = airflow.xcom("tg_code_update", run_id, "conclude")
    assert out["note"].startswith(f"{JOB}: r0 -> r1 in place on m0, m1, resumed at step "), out["note"]
    assert ctl.fleet.job(JOB).revision == "r1" and ctl.fleet.job(JOB).machine_list == machines
    assert _revisions(ctl, ops_cluster) == {"r1"}
    assert out["warm"] == machines  # restarted on the interpreters parked beside the job
    audit = [a for a in ctl.fleet.actions() if a.kind == "code_update"]
    assert audit[-1].evidence == {"revision": "r1", "from": "r0", "urgency": "urgent", "reason": "loader fix"}
    assert ctl.parked(machines) == set(machines)  # re-armed for the next restart


def test_an_unknown_revision_is_refused_with_a_reason_and_changes_nothing(ops):
    ctl, airflow = ops
    run_id, state = _run(airflow, "tg_code_update", {"job": JOB, "revision": "r9", "urgency": "urgent"})
    assert state == "failed"
    assert "job ops has no revision 'r9'; record it first" in airflow.task_log("tg_code_update", run_id, "update")
    assert ctl.fleet.job(JOB).revision == "r1" and ctl.fleet.job(JOB).pending_revision is None


def test_a_lazy_update_waits_for_the_next_failure_and_is_applied_by_its_restart(ops, ops_cluster):
    ctl, airflow = ops
    ctl.fleet.record_revision(JOB, "r2")
    incarnations = ctl.progress(JOB)["incarnations"]
    run_id, state = _run(airflow, "tg_code_update", {"job": JOB, "revision": "r2", "urgency": "lazy"})
    assert state == "success"
    assert airflow.xcom("tg_code_update", run_id, "conclude")["note"].startswith(f"{JOB}: r2 waits for the next")
    job = ctl.fleet.job(JOB)
    assert (job.revision, job.pending_revision) == ("r1", "r2")
    step = ctl.progress(JOB)["step"]
    wait_until(lambda: ctl.progress(JOB)["step"] >= step + 2, timeout=60, what="the job to go on training")
    assert ctl.progress(JOB)["incarnations"] == incarnations and _revisions(ctl, ops_cluster) == {"r1"}
    # a rank crashes: the ladder's restart applies the waiting revision
    last = max((i.id for i in ctl.fleet.incidents(JOB)), default=0)
    inject.inject(ops_cluster, "m1", "crash", rank=3)
    inc = wait_until(lambda: next((i for i in ctl.fleet.incidents(JOB) if i.id > last
                                   and i.state in ("resolved", "failed", "waiting_human")), None),
                     timeout=300, interval=1.0, what="the crash incident to close")
    assert inc.state == "resolved", ctl.timeline(inc.id)
    job = ctl.fleet.job(JOB)
    assert (job.revision, job.pending_revision) == ("r2", None) and _revisions(ctl, ops_cluster) == {"r2"}


def test_the_sweep_marks_a_healthy_revision_good_and_the_ladder_rolls_a_buggy_one_back_to_it(ops, ops_cluster):
    ctl, airflow = ops
    wait_until(lambda: all(r["state"] in ("success", "failed") for r in airflow.runs("tg_incident")),
               timeout=300, interval=1.0, what="the last incident's run to end")
    step = ctl.progress(JOB)["step"]
    wait_until(lambda: ctl.progress(JOB)["step"] >= step + KNOWN_GOOD_STEPS, timeout=120,
               what=f"{KNOWN_GOOD_STEPS} healthy steps on r2")
    run_id, state = _run(airflow, "tg_code_update", {"job": ""})  # what the hourly schedule runs
    assert state == "success"
    swept = airflow.xcom("tg_code_update", run_id, "conclude")
    assert swept["sweep"][JOB]["known_good"] and swept["note"] == f"{JOB}: r2 known good", swept
    assert {r.revision for r in ctl.fleet.revisions(JOB) if r.known_good} == {"r2"}
    # r3 has a bug in the job's own code: the ladder rolls it back to r2, the last known-good revision
    ctl.fleet.record_revision(JOB, "r3")
    inject.inject(ops_cluster, "m0", "user_error", rank=0, params={"revision": "r3"})
    last = max((i.id for i in ctl.fleet.incidents(JOB)), default=0)
    started = time.time()
    run_id = airflow.trigger("tg_code_update", {"job": JOB, "revision": "r3", "urgency": "urgent"})
    inc = wait_until(lambda: next((i for i in ctl.fleet.incidents(JOB) if i.id > last
                                   and i.state in ("resolved", "failed", "waiting_human")), None),
                     timeout=300, interval=1.0, what="the user-code incident to close")
    assert inc.state == "resolved" and inc.first_alert_ts > started, ctl.timeline(inc.id)
    rollback = next(a for a in ctl.fleet.actions(inc.id) if a.kind == "rollback")
    assert rollback.evidence == {"to": "r2", "from": "r3"}
    assert ctl.fleet.job(JOB).revision == "r2" and _revisions(ctl, ops_cluster) == {"r2"}
    assert airflow.finished("tg_code_update", run_id) == "success"
    note = airflow.xcom("tg_code_update", run_id, "conclude")["note"]
    # the update reports what it saw: r3 ended without a step, or the rollback had already replaced it
    assert "r3 did not stay: the job runs r2 now" in note or "ended after the restart without a step" in note, note

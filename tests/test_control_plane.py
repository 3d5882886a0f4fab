"""The control plane end to end: a real ``airflow standalone`` (scheduler, triggerer, dag processor,
api-server) runs tg_guardian and tg_incident against a namespace cluster of its own, with a guarded
reference job (TP=2 PP=2 DP=2 on m0..m3, checkpoints every step, standbys m4 and m5 parked warm).

Faults are injected for real; the tests then read the fleet database the DAGs wrote: which branch ran,
which machines were evicted, which standbys joined, from which step training resumed, and why.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from node_tools import cluster, inject
from node_tools.inventory import Inventory
from node_tools.topology import Topology
from node_tools.transport import transport_for
from operators.control import ControlConfig, Controller
from operators.fleet import states
from tests.airflow_env import Standalone
from tests.conftest import can_namespace, wait_until

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.airflow]

SPEC = cluster.ClusterSpec(name="tgp", machines=6, standbys=2, subnet="10.213.15.0/24", disk_mb=64, gpus=8)
TOPO = Topology(tp=2, pp=2, dp=2)
JOB = "guarded"
TRAIN = ["--checkpoint", "--step-delay-s", "0.2"]


@pytest.fixture(scope="module")
def cp_cluster() -> Iterator[Inventory]:
    reason = can_namespace()
    if reason:
        pytest.skip(reason)
    state = Path(tempfile.mkdtemp(prefix="tg-test-cp-")) / "state"
    cluster.down(state, name=SPEC.name, log=lambda *_: None)
    inv = cluster.up(SPEC, state, log=lambda *_: None)
    try:
        yield inv
    finally:
        cluster.down(state, name=SPEC.name, log=lambda *_: None)
        shutil.rmtree(state.parent, ignore_errors=True)


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
                                            "TG_CONTROL_HOME": str(home)})
    (home / "airflow").mkdir()
    try:
        parked = parking.run_many(standbys, lambda m: [cp_cluster.tg_node, "standby", "park", "--nproc", "2"],
                                  timeout=240)
        assert all(r.ok for r in parked.values()), {n: r.describe() for n, r in parked.items()}
        airflow.start()
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


def _incident_done(ctl: Controller, after_id: int) -> Any:
    for inc in ctl.fleet.incidents(JOB):
        if inc.id > after_id and inc.state in ("resolved", "failed", "waiting_human"):
            return inc
    return None


def test_a_lost_gpu_evicts_its_machine_and_a_warm_standby_resumes_the_job(control, cp_cluster: Inventory):
    ctl, airflow = control
    active = [m.name for m in cp_cluster.by_role("active")]
    ctl.launch_job(JOB, TOPO, active, train_args=TRAIN)
    wait_until(lambda: ctl.progress(JOB)["step"] >= 4, timeout=180, what="the guarded job to train 5 steps")

    t_fault = time.time()
    inject.inject(cp_cluster, "m1", "gpu_lost")
    try:
        inc = wait_until(lambda: _incident_done(ctl, 0), timeout=240, interval=1.0,
                         what=f"the incident to close (runs: {[r['state'] for r in airflow.runs('tg_incident')]})")
    finally:
        inject.clear(cp_cluster, "m1", "gpu_lost")
    assert inc.state == "resolved", ctl.timeline(inc.id)
    # the driver's Xid line (kernel log, 1 s check) or NVML's missing GPU (5 s check), whichever comes first
    assert inc.category == "machine_fault" and ("m1: gpu_lost" in inc.summary or "m1: kernel_xid" in inc.summary)
    kinds = [(a.kind, a.machines, a.outcome) for a in ctl.fleet.actions(inc.id)]
    assert ("evict", ["m1"], "done") in kinds, kinds
    assert ctl.fleet.machine("m1").state == states.EVICTED
    job = ctl.fleet.job(JOB)
    assert job.machine_list[1] in ("m4", "m5") and job.machine_list[0] == "m0"  # same node rank, survivors stay
    assert ctl.fleet.machine(job.machine_list[1]).state == states.ACTIVE
    # training resumed from the newest committed checkpoint, losing at most one step
    assert inc.resumed_ts is not None and inc.lost_steps is not None and inc.lost_steps <= 1, ctl.timeline(inc.id)
    run = airflow.runs("tg_incident")[0]
    tasks = airflow.task_states("tg_incident", run["dag_run_id"])
    assert tasks["evict_now"] == "success" and tasks["stop_time_diagnosis"] == "skipped", tasks
    launch = next(a for a in ctl.fleet.actions(inc.id) if a.kind == "launch")
    assert launch.evidence["warm"] == [job.machine_list[1]]  # the standby joined on its warm interpreters
    print(f"gpu_lost: alert {inc.first_alert_ts - t_fault:.1f}s after the fault, resumed "
          f"{inc.resumed_ts - t_fault:.1f}s after it, lost {inc.lost_steps} steps")

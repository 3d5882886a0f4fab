"""Scheduled operations end to end: a real ``airflow standalone`` runs tg_checkpoint_verify, tg_standby_pool
and tg_code_update (with tg_incident and its alert watcher behind them) against a namespace cluster of its own: a
guarded job (TP=2 DP=2) on m0 and m1, standby m2 parked warm, and m3, m4 free (unprovisioned) inventory; a
real moto_server on the cluster's bridge is the S3 tier (the machines upload to it, the control plane
checks it through its Airflow connection ``tg_s3``).

The DAGs are triggered by hand through the REST API, as an operator does from the UI's form; the tests
read what they did from the fleet database, the machines and the runs' results and logs.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import moto_server, own_cluster, wait_until
from trainguard.core.topology import Topology
from trainguard.emulation import cluster, inject
from trainguard.emulation.standalone import Standalone
from trainguard.node_tools import launcher
from trainguard.node_tools.inventory import Inventory
from trainguard.node_tools.transport import transport_for
from trainguard.operators.control import ControlConfig, Controller
from trainguard.operators.fleet import states

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.airflow, pytest.mark.full]

SPEC = cluster.ClusterSpec(name="tgs", machines=5, standbys=1, free=2, subnet="10.213.18.0/24", disk_mb=256, gpus=8)
TOPO = Topology(tp=2, pp=1, dp=2)
JOB = "ops"
# a verification candidate every 150 steps (~1-2 min here): the background runs each take ~30-60 s on a
# loaded host, so a candidate a test targets stays held (two newer ones, or a newer verified one, drop it)
# long after a run queued behind another has verified it
VERIFY_EVERY = 150
TRAIN = ["--checkpoint", "--step-delay-s", "0.2", "--checkpoint-verify-every", str(VERIFY_EVERY)]
KNOWN_GOOD_STEPS = 5
BUCKET = "tg-ckpt"
S3_URL = f"s3://{BUCKET}/tier"


@pytest.fixture(scope="module")
def ops_cluster() -> Iterator[Inventory]:
    with own_cluster(SPEC, "tg-test-ops-") as inv:
        yield inv


@pytest.fixture(scope="module")
def ops_s3(ops_cluster: Inventory) -> Iterator[tuple[str, Any]]:
    """moto_server on the bridge's host address (the machines reach it there), with the tier's bucket."""
    import boto3

    with moto_server(SPEC.host_address) as (url, proc):
        boto3.client("s3", endpoint_url=url).create_bucket(Bucket=BUCKET)
        yield url, proc


@pytest.fixture(scope="module")
def ops(ops_cluster: Inventory, ops_s3: tuple[str, Any]) -> Iterator[tuple[Controller, Standalone]]:
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
                                            "TG_KNOWN_GOOD_STEPS": str(KNOWN_GOOD_STEPS),
                                            # checkpoints: verified when committed, by hand, not every 30 min
                                            "TG_VERIFY_SCHEDULE": "", "TG_CHECKPOINT_S3_URL": S3_URL,
                                            "TG_CHECKPOINT_S3_KEEP": "2",
                                            "AIRFLOW_CONN_TG_S3": json.dumps({
                                                "conn_type": "aws", "login": "testing", "password": "testing",
                                                "extra": {"endpoint_url": ops_s3[0], "region_name": "us-east-1"}})})
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


def _disk(inv: Inventory, machine: str) -> Path:
    """A machine's checkpoint root (the emulated machines' disks are folders of this host)."""
    assert inv.path is not None
    return inv.path.parent / "machines" / machine / "disk" / "jobs" / JOB / "checkpoints"


def _copies(inv: Inventory, step: int) -> list[Path]:
    return sorted(p for m in ("m0", "m1") for p in _disk(inv, m).glob(f"*/step_{step}/rank_*")
                  if (p / "manifest.json").exists())


def _s3_steps(endpoint: str) -> dict[int, dict[int, bool]]:
    from trainguard.checkpoint.s3 import S3Tier

    return S3Tier(f"{S3_URL}/{JOB}", endpoint_url=endpoint).steps()


def _conclusions(airflow: Standalone) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    out = []
    for r in airflow.runs("tg_checkpoint_verify"):
        if r["state"] in ("success", "failed"):
            with contextlib.suppress(Exception):
                out.append((r, airflow.xcom("tg_checkpoint_verify", r["dag_run_id"], "conclude")))
    return out


def test_a_committed_checkpoint_is_verified_marked_and_promoted_to_s3_on_its_asset_event(ops, ops_cluster, ops_s3):
    ctl, airflow = ops
    # the job commits candidate 49; m0's agent announces it; the watcher's asset event starts a run
    ran = wait_until(lambda: next(((r, c) for r, c in _conclusions(airflow)
                                   if r["run_type"] == "asset_triggered" and r["state"] == "success"), None),
                     timeout=480, interval=2.0, what="an asset-triggered verification run to succeed")
    run, concluded = ran
    verdict, promotion = concluded["verdicts"][0], concluded["promotions"][0]
    step = verdict["step"]
    assert (step + 1) % VERIFY_EVERY == 0 and verdict["ok"] and verdict["copies"] == 8, verdict  # 4 ranks x 2 tiers
    assert concluded["note"].startswith(f"{JOB} step {step}: 8 copies on m0, m1 verified and marked ("), concluded
    assert airflow.run_note("tg_checkpoint_verify", run["dag_run_id"]) == concluded["note"]  # the UI's run note
    assert f"uploaded to {S3_URL}/{JOB}, remote checksums match" in concluded["note"]
    # every copy of the step, on both machines and both tiers, carries the marker
    assert len(_copies(ops_cluster, step)) == 8
    assert all((p / "verified.json").exists() for p in _copies(ops_cluster, step))
    # S3 holds every rank of it, each remote copy checked and marked; the fleet database has the verdict
    assert _s3_steps(ops_s3[0])[step] == {0: True, 1: True, 2: True, 3: True}
    assert promotion["checked"] == 4 and promotion["problems"] == []
    record = next(c for c in ctl.fleet.checkpoints(JOB) if c.step == step)
    assert record.verified is True and record.problems == []
    # each (job, step) was one mapped task, named after it
    names = {t.get("rendered_map_index") for t in airflow.task_instances("tg_checkpoint_verify", run["dag_run_id"])
             if t["task_id"] == "verify"}
    assert names == {f"{JOB} step {step}"}


def test_a_corrupted_checkpoint_copy_is_caught_and_never_promoted(ops, ops_cluster, ops_s3):
    ctl, airflow = ops
    # the next candidate, as soon as it is committed (newer than any the job held when the test began, so no
    # run has started on it): damage rank 0's replica on m1 before anyone verifies it
    held = max(_candidates(ops_cluster), default=-1)
    step = wait_until(lambda: max((s for s in _candidates(ops_cluster) if s > held), default=None),
                      timeout=420, interval=0.1, what="a new verification candidate")
    replica = next(p for p in _copies(ops_cluster, step) if "/m1/" in str(p) and p.parent.parent.name == "replica")
    model = replica / "model.safetensors"
    data = bytearray(model.read_bytes())
    data[len(data) // 2] ^= 0x40
    model.write_bytes(bytes(data))
    run_id = airflow.trigger("tg_checkpoint_verify", {"job": JOB, "step": step})
    assert airflow.finished("tg_checkpoint_verify", run_id, timeout=300) == "failed"
    concluded = airflow.xcom("tg_checkpoint_verify", run_id, "conclude")
    rank = int(replica.name.split("_")[1])
    assert concluded["note"].startswith(
        f"{JOB} step {step}: NOT verified, nothing marked or uploaded: machine m1 rank {rank} step {step} tier "
        f"replica: model.safetensors sha256 mismatch"), concluded["note"]
    # never promoted: nothing was marked, no copy still on disk carries a marker (retention may drop the step
    # once a newer candidate is verified), S3 has none of it, and the fleet database says why
    assert concluded["verdicts"][0]["marked"] == 0 and concluded["promotions"][0]["promoted"] is False
    assert not any((p / "verified.json").exists() for p in _copies(ops_cluster, step))
    assert step not in _s3_steps(ops_s3[0])
    record = next(c for c in ctl.fleet.checkpoints(JOB) if c.step == step)
    named = f"tier replica: model.safetensors sha256 mismatch (corrupt) ({replica})"
    assert record.verified is False and any(named in p for p in record.problems), record.problems
    assert airflow.task_states("tg_checkpoint_verify", run_id)["outcome"] == "failed"


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
    assert airflow.run_note("tg_standby_pool", run_id) == out["note"]
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
    # re-armed for the next restart: by this run, or (when an incident of the job opened meanwhile, a
    # slowdown while the pool's self-checks shared the host's cores) by that incident's run as it ends
    rearmed = airflow.xcom("tg_code_update", run_id, "rearm")[JOB]
    assert "parked" in rearmed or "its run re-arms when it ends" in rearmed["skipped"], rearmed
    wait_until(lambda: all(r["state"] in ("success", "failed") for r in airflow.runs("tg_incident")),
               timeout=300, interval=1.0, what="every incident's run to end")
    assert ctl.parked(machines) == set(machines)


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


def test_an_s3_endpoint_that_is_down_fails_the_promotion_with_a_reason(ops, ops_cluster, ops_s3):
    ctl, airflow = ops
    endpoint, proc = ops_s3
    proc.terminate()
    proc.wait(timeout=10)
    verified = max((c.step for c in ctl.fleet.checkpoints(JOB) if c.verified), default=-1)
    step = wait_until(lambda: max((s for s in _candidates(ops_cluster) if s > verified), default=None),
                      timeout=420, interval=0.5, what="a new verification candidate")
    run_id, state = _run(airflow, "tg_checkpoint_verify", {"job": JOB, "step": step})
    assert state == "failed"
    verdict = airflow.xcom("tg_checkpoint_verify", run_id, "conclude")["verdicts"][0]
    assert verdict["step"] == step and verdict["ok"], (verdict["problems"], verdict)  # only the upload failed
    log = airflow.task_log("tg_checkpoint_verify", run_id, "promote", map_index=0)
    assert f"S3 tier {S3_URL}/{JOB} at {endpoint} is not usable (EndpointConnectionError" in log, log[-2000:]
    assert "start the endpoint or fix TG_CHECKPOINT_S3_URL / the S3 connection" in log
    # the copies themselves are fine: verified and marked; only the upload waits for the endpoint
    assert next(c for c in ctl.fleet.checkpoints(JOB) if c.step == step).verified is True


def _candidates(inv: Inventory) -> list[int]:
    out = []
    for marker in _disk(inv, "m0").glob("local/step_*/rank_0/committed.json"):
        with contextlib.suppress(OSError, ValueError):
            if json.loads(marker.read_text()).get("verify"):
                out.append(int(marker.parent.parent.name.split("_")[1]))
    return out


def test_a_trigger_while_another_writer_holds_the_metadata_database_starts_exactly_one_run(ops):
    """SQLite lets one writer at a time; a request that waits past its connection's timeout answers 500.
    A lock held longer than Python's default wait (5 s) must neither lose the operator's trigger nor
    start it twice."""
    _, airflow = ops
    hold_s = 8.0
    before = {r["dag_run_id"] for r in airflow.runs("tg_standby_pool")}
    db = sqlite3.connect(airflow.home / "airflow.db", isolation_level=None, timeout=60, check_same_thread=False)
    db.execute("BEGIN EXCLUSIVE")
    release = threading.Timer(hold_s, lambda: db.execute("COMMIT"))
    t0 = time.monotonic()
    release.start()
    try:
        run_id = airflow.trigger("tg_standby_pool", {"target": 9})
        took = time.monotonic() - t0
    finally:
        release.join()
        db.close()
    assert took >= hold_s - 0.5, f"the trigger returned in {took:.1f}s: the database was not held"
    assert {r["dag_run_id"] for r in airflow.runs("tg_standby_pool")} - before == {run_id}
    assert airflow.finished("tg_standby_pool", run_id) == "failed"  # the run ran: its plan refused target 9
    assert "pool target 9 is larger than the free inventory" in airflow.task_log("tg_standby_pool", run_id, "plan")

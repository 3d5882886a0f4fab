"""Every injected fault has its real effect on the emulated cluster, and the
machine's agent publishes the right alert for it on the bus.

Faults a running job survives (slow, hang, hang before a collective, bit flip,
NaN) share one 8-rank job; faults that end a job (crash, non-zero exit, user
code exception) each get a small job of their own on a standby machine; machine
faults (link down, disk full, GPU faults) need no job.
"""

from __future__ import annotations

import errno
import os
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import jobs
from tests.conftest import wait_until
from trainguard.core import procs
from trainguard.core.errors import FaultError
from trainguard.core.topology import Topology
from trainguard.emulation import inject
from trainguard.node_tools import launcher
from trainguard.node_tools.inventory import Inventory
from trainguard.node_tools.transport import transport_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


@pytest.fixture(scope="module")
def alerts(ns_cluster: Inventory) -> jobs.AlertWatch:
    return jobs.AlertWatch(ns_cluster)


@pytest.fixture(scope="module")
def job3d(ns_cluster: Inventory) -> Iterator[launcher.JobPlan]:
    plan = jobs.start(ns_cluster, "faults3d", Topology(tp=2, pp=2, dp=2), ns_cluster.by_role("active"))
    try:
        jobs.wait_all_reach(plan, 1)
        yield plan
    finally:
        launcher.stop(ns_cluster, plan.job, plan.machines, grace_s=3)
        for m in ns_cluster.machines:
            inject.clear(ns_cluster, m.name)


def _machine_of(plan: launcher.JobPlan, rank: int) -> str:
    return plan.machines[plan.topology.machine_of(rank)].name


def _new_steps(plan: launcher.JobPlan, rank: int, after: int) -> list[dict]:
    return [s for s in jobs.steps(plan, rank) if s["step"] > after]


def test_slow_rank_slows_every_step(ns_cluster, job3d, alerts):
    jobs.wait_all_reach(job3d, 12)  # the agents' step-time baseline needs history
    # the slowdown: three times a normal step (at least 1 s), well past the agent's 2.5x rule on a fast
    # machine or a slow one
    normal = statistics.median(s["step_time_s"] for s in jobs.steps(job3d, 2)[-8:])
    extra = round(max(1.0, 3.0 * normal), 2)
    mark = alerts.mark()
    inject.inject(ns_cluster, _machine_of(job3d, 2), "slow", rank=2, params={"seconds": str(extra)})
    start = jobs.last_step(job3d, 2)
    slow = wait_until(lambda: [s for s in _new_steps(job3d, 2, start + 1)], timeout=60, what="a slowed step")
    assert slow[0]["step_time_s"] >= extra
    # the ranks that wait for it at the collectives are slowed too
    wait_until(lambda: _new_steps(job3d, 7, start + 1), timeout=60, what="rank 7 to finish a slowed step")
    assert _new_steps(job3d, 7, start + 1)[0]["step_time_s"] >= 0.9 * extra
    # the straggler computes while the others wait for it in their collectives
    assert _new_steps(job3d, 2, start + 1)[0]["comm_s"] < _new_steps(job3d, 7, start + 1)[0]["comm_s"]
    alert = alerts.expect("rank_slow", machine=_machine_of(job3d, 2), rank=2, after=mark, timeout=20 + 6 * extra)
    assert alert.severity == "warning" and alert.evidence["compute_s"] >= 0.9 * extra
    inject.clear(ns_cluster, _machine_of(job3d, 2), "slow")
    cleared_at = jobs.last_step(job3d, 2)
    fast = wait_until(lambda: _new_steps(job3d, 2, cleared_at + 1), timeout=60, what="a step after clearing")
    assert fast[0]["step_time_s"] < extra


def test_hang_stops_the_process_and_progress(ns_cluster, job3d, alerts):
    machine = _machine_of(job3d, 6)
    mark = alerts.mark()
    doc = inject.inject(ns_cluster, machine, "hang", rank=6)
    pid = doc["pid"]
    assert procs.proc_state(pid) == "T"
    # its heartbeat goes stale while a healthy rank's keeps beating
    hb6 = jobs.heartbeat(job3d, 6)["alive_ts"]
    wait_until(lambda: jobs.heartbeat(job3d, 7)["alive_ts"] > hb6 + 2.0, timeout=30, what="rank 7 to beat on")
    assert jobs.heartbeat(job3d, 6)["alive_ts"] == hb6
    stuck_at = jobs.last_step(job3d, 7)
    assert jobs.last_step(job3d, 7) <= jobs.last_step(job3d, 6) + 1
    stopped = alerts.expect("rank_stopped", machine=machine, rank=6, after=mark)
    assert stopped.evidence["process_state"] == "T"
    alerts.expect("rank_hang", machine=_machine_of(job3d, 0), rank=0, after=mark)  # its peers stall
    inject.clear(ns_cluster, machine, "hang")
    assert procs.proc_state(pid) in ("R", "S")
    wait_until(lambda: jobs.last_step(job3d, 7) > stuck_at + 1, timeout=60, what="training to go on after SIGCONT")


def test_hang_before_a_collective_blocks_a_live_rank(ns_cluster, job3d, alerts):
    machine = _machine_of(job3d, 3)
    mark = alerts.mark()
    inject.inject(ns_cluster, machine, "hang_collective", rank=3)
    # alive (beating), not stopped, but no progress for a while
    def stalled():
        hb = jobs.heartbeat(job3d, 3)
        return hb and hb["alive_ts"] - hb["progress_ts"] > 2.0

    try:  # the module's later tests share the job: it must not stay hung when an assertion here fails
        wait_until(stalled, timeout=60, what="rank 3's progress to stall while it beats")
        hb = jobs.heartbeat(job3d, 3)
        assert procs.proc_state(hb["pid"]) in ("R", "S")
        assert time.time() - hb["alive_ts"] < 2.0
        stuck = hb["step"]
        hang = alerts.expect("rank_hang", machine=machine, rank=3, after=mark)
        # the agent alerts once the age passes the timeout; both are rounded to 3 decimals in the evidence
        assert hang.evidence["progress_age_s"] >= hang.evidence["timeout_s"] > 0
    finally:
        inject.clear(ns_cluster, machine, "hang_collective")
    wait_until(lambda: jobs.last_step(job3d, 3) > stuck + 1, timeout=60, what="rank 3 to progress again")


def test_bitflip_makes_a_rank_diverge_from_its_data_parallel_peer(ns_cluster, job3d, alerts):
    rank, peer = 5, 1
    assert job3d.topology.group("dp", rank) == (peer, rank)

    def digests_at(step):
        a = {s["step"]: s["param_digest"] for s in jobs.steps(job3d, rank)}
        b = {s["step"]: s["param_digest"] for s in jobs.steps(job3d, peer)}
        return a.get(step), b.get(step)

    before = min(jobs.last_step(job3d, rank), jobs.last_step(job3d, peer))
    a, b = digests_at(before)
    assert a == b and a is not None
    mark = alerts.mark()
    inject.inject(ns_cluster, _machine_of(job3d, rank), "bitflip", rank=rank)
    at = jobs.last_step(job3d, rank)
    wait_until(lambda: min(jobs.last_step(job3d, rank), jobs.last_step(job3d, peer)) > at + 1, timeout=60,
               what="two steps after the bit flip")
    a, b = digests_at(at + 2)
    assert a != b
    # silent: the loss stays finite, nothing crashes
    assert isinstance(jobs.steps(job3d, rank)[-1]["loss"], float)
    # but the DP replicas' digests disagree, and the agents say so (for both: DP=2 has no majority)
    sdc = alerts.expect("sdc_suspect", machine=_machine_of(job3d, rank), rank=rank, after=mark)
    assert len(set(sdc.evidence["dp_digests"])) == 2
    alerts.expect("sdc_suspect", machine=_machine_of(job3d, peer), rank=peer, after=mark)
    inject.clear(ns_cluster, _machine_of(job3d, rank), "bitflip")


def test_nan_in_one_rank_is_skipped_by_every_rank_which_then_holds_still(ns_cluster, job3d, alerts):
    rank = 3  # last pipeline stage: computes the loss (its tensor-parallel peer's stays finite)
    mark = alerts.mark()
    before = min(jobs.last_step(job3d, r) for r in range(8)) - 1  # the NaN comes at a later step
    inject.inject(ns_cluster, _machine_of(job3d, rank), "nan", rank=rank)

    def nan_steps(r):
        return [s["step"] for s in _new_steps(job3d, r, before) if s["grad_norm"] == "nan"]

    # the NaN loss of one rank reaches every rank at the same step, through the global gradient norm
    found = wait_until(lambda: all(nan_steps(r) for r in range(8)) and [nan_steps(r) for r in range(8)],
                       timeout=60, what="a NaN gradient norm on every rank")
    assert any(s["loss"] == "nan" for s in _new_steps(job3d, rank, before)), "the corrupted rank's own loss"
    assert {tuple(f) for f in found} == {(found[0][0],)}, found  # one step, the same on every rank
    step = found[0][0]
    # every rank skipped that update and holds still for the control plane, saying so in its heartbeat
    wait_until(lambda: all((jobs.heartbeat(job3d, r) or {}).get("status") == "held" for r in range(8)),
               timeout=30, what="every rank to hold still")
    assert all(jobs.last_step(job3d, r) == step for r in range(8))
    reason = jobs.heartbeat(job3d, 0)["hold"]["reason"]
    assert reason.startswith(f"step {step}: loss ") and reason.endswith("gradient norm nan: update skipped"), reason
    alerts.expect("nan_loss", machine=_machine_of(job3d, rank), rank=rank, after=mark)


# ---- faults that end a job --------------------------------------------------------------
def _small_job(ns_cluster: Inventory, name: str, machine: str) -> launcher.JobPlan:
    plan = jobs.start(ns_cluster, name, Topology(tp=2, pp=1, dp=1), [ns_cluster.machine(machine)])
    jobs.wait_all_reach(plan, 0)
    return plan


def _ended(ns_cluster, plan) -> int:
    m = plan.machines[0]
    code = wait_until(lambda: jobs.exit_code(plan, m) is not None and [jobs.exit_code(plan, m)], timeout=60,
                      what=f"job {plan.job} to end")
    return code[0]


@pytest.mark.full
def test_crash_kills_the_rank_and_ends_the_job(ns_cluster, alerts):
    plan = _small_job(ns_cluster, "crash1", "m4")
    mark = alerts.mark()
    doc = inject.inject(ns_cluster, "m4", "crash", rank=1)
    alert = alerts.expect("rank_exit", machine="m4", rank=1, after=mark)
    assert alert.job == "crash1" and alert.evidence["pid"] == doc["pid"]
    assert _ended(ns_cluster, plan) != 0
    assert not procs.alive(doc["pid"])
    status = launcher.status(ns_cluster, plan.job, plan.machines)["m4"]
    assert status["state"] == "exited" and all(r["process_state"] == "gone" for r in status["ranks"])


@pytest.mark.full
def test_exit_fault_ends_the_rank_with_its_code(ns_cluster, alerts):
    plan = _small_job(ns_cluster, "exit1", "m5")
    mark = alerts.mark()
    inject.inject(ns_cluster, "m5", "exit", rank=0, params={"code": "7"})
    alerts.expect("rank_exit", machine="m5", rank=0, after=mark)
    assert _ended(ns_cluster, plan) != 0
    assert "exits with code 7" in jobs.rank_log(plan, plan.machines[0], 0)
    # (torchrun's own report may list rank 0 with code 7 or as terminated: it depends on which exit it
    # observes first; the machine's log classification names the first failure instead)


@pytest.mark.full
def test_user_error_raises_in_the_jobs_own_code(ns_cluster, alerts):
    plan = _small_job(ns_cluster, "user1", "m4")
    mark = alerts.mark()
    inject.inject(ns_cluster, "m4", "user_error", rank=1)
    alert = alerts.expect("rank_exit", machine="m4", rank=1, after=mark)
    assert alert.job == "user1"
    assert _ended(ns_cluster, plan) != 0
    log = jobs.rank_log(plan, plan.machines[0], 1)
    tb = log[log.rindex("Traceback"):]
    frames = [line for line in tb.splitlines() if line.strip().lstrip("[rank1]: ").startswith("File ")]
    assert "examples/gpt3d/" in frames[-1], frames[-1]
    assert "Error" in tb.strip().splitlines()[-1]


def test_rank_faults_need_a_running_job_and_a_rank_of_the_machine(ns_cluster):
    with pytest.raises(FaultError, match="no job is running on machine m5"):
        inject.inject(ns_cluster, "m5", "hang")
    with pytest.raises(FaultError, match="takes no parameter"):
        inject.inject(ns_cluster, "m5", "slow", params={"sec": "1"})


# ---- machine faults ---------------------------------------------------------------------
def test_nic_down_cuts_the_machine_off_and_clear_restores_it(ns_cluster, alerts):
    m = ns_cluster.machine("m5")
    transport = transport_for(ns_cluster)
    mark = alerts.mark()
    inject.inject(ns_cluster, "m5", "nic_down")
    try:
        res = transport.run(m, ["true"], timeout=20)
        assert not res.reachable
        # tolerated once (a warning), a fault when it is still down at the next check
        first = alerts.expect("nic_down", machine="m5", after=mark)
        assert first.severity == "warning"
        alerts.expect("nic_down", machine="m5", severity="fault", after=mark)
    finally:
        inject.clear(ns_cluster, "m5", "nic_down")
    wait_until(lambda: transport.run(m, ["true"], timeout=20).ok, timeout=30, what="m5 reachable again")


def test_disk_full_makes_writes_fail(ns_cluster, alerts):
    m = ns_cluster.machine("m4")
    mark = alerts.mark()
    inject.inject(ns_cluster, "m4", "disk_full")
    try:
        st = os.statvfs(m.workdir)
        assert st.f_bavail * st.f_frsize < 1 << 20
        with pytest.raises(OSError) as info, open(Path(m.workdir) / "probe.bin", "wb") as fh:
            fh.write(b"x" * (1 << 20))
            fh.flush()
            os.fsync(fh.fileno())
        assert info.value.errno == errno.ENOSPC
        assert alerts.expect("disk_full", machine="m4", after=mark).evidence["free_bytes"] < 1 << 20
    finally:
        inject.clear(ns_cluster, "m4", "disk_full")
        (Path(m.workdir) / "probe.bin").unlink(missing_ok=True)
    st = os.statvfs(m.workdir)
    assert st.f_bavail * st.f_frsize > 32 << 20


@pytest.mark.parametrize(
    "kind,params,check,alert_kinds",
    [
        ("gpu_lost", {"gpu": "3"}, lambda s: s["device_count"] == 7 and 3 not in [d["index"] for d in s["devices"]],
         ["gpu_lost", "gpu_xid", "kernel_xid"]),
        ("xid", {"xid": "48"}, lambda s: [e["xid"] for e in s["xid_events"]] == [48], ["gpu_xid", "kernel_xid"]),
        ("ecc", {"gpu": "1"}, lambda s: s["devices"][1]["ecc_uncorrectable"] == 1 and s["devices"][1]["remap_pending"],
         ["gpu_ecc"]),
        ("thermal", {}, lambda s: s["devices"][0]["temperature_c"] >= 90 and s["devices"][0]["throttle_reasons"],
         ["gpu_thermal"]),
    ],
)
def test_gpu_faults_show_through_the_machines_nvml_backend(ns_cluster, alerts, kind, params, check, alert_kinds):
    m = ns_cluster.machine("m5")
    transport = transport_for(ns_cluster)

    def snapshot():
        res = transport.run(m, [ns_cluster.tg_node, "gpu"], timeout=20)
        assert res.ok, res.describe()
        return res.json()

    assert snapshot()["device_count"] == 8
    mark = alerts.mark()
    inject.inject(ns_cluster, "m5", kind, params=params)
    try:
        assert check(snapshot())
        for alert_kind in alert_kinds:
            alerts.expect(alert_kind, machine="m5", after=mark)
    finally:
        inject.clear(ns_cluster, "m5", kind)
    healthy = snapshot()
    assert healthy["device_count"] == 8 and healthy["xid_events"] == []

"""Degrade or stop the world (operators/policy/degrade.py), and the simulator's degrade path: which incidents a
job trains through on its other data-parallel replicas, what that costs in the ledger, and what still stops."""

from __future__ import annotations

import pytest

from trainguard.core.topology import Topology
from trainguard.operators.policy import degrade
from trainguard.operators.sim import engine, model
from trainguard.operators.sim.model import FailureKind, Profile, SimError

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

# the recovery benchmark's layout: TP=2 inside a machine, PP=2, DP=2 on four machines
SMALL = Topology(2, 2, 2, ranks_per_machine=2)
# the scale layout: TP is one machine, 8 stages, 150 replicas
LARGE = Topology(8, 8, 150, ranks_per_machine=8)


def test_a_replica_is_its_pipelines_machines():
    for topo in (SMALL, LARGE):
        for m in range(topo.machines):
            [replica] = degrade.replicas_of(topo, [m])
            machines = degrade.replica_machines(topo, [replica])
            assert m in machines and len(machines) == topo.pp
            assert {r for x in machines for r in degrade.replicas_of(topo, [x])} == {replica}


@pytest.mark.parametrize(("category", "action"), [("machine_fault", "evict"), ("crash", "diagnose"),
                                                    ("crash", "reattempt"), ("hang", "analyze"), ("slow", "vote"),
                                                    ("network", "evict")])
def test_a_fault_in_one_replica_is_trained_through_on_the_others(category, action):
    p = degrade.plan(LARGE, category=category, action=action, machines=[17])
    assert p.path == degrade.DEGRADE and p.replicas == degrade.replicas_of(LARGE, [17])
    assert p.width == pytest.approx(149 / 150) and 17 in p.machines and len(p.machines) == 8
    two = degrade.plan(SMALL, category=category, action=action, machines=[0])
    assert two.path == degrade.DEGRADE and two.width == 0.5


@pytest.mark.parametrize(("kwargs", "why"), [
    ({"category": "nan", "action": "diagnose"}, "nan: the job's state may be wrong on every replica"),
    ({"category": "sdc", "action": "replay"}, "sdc: the job's state may be wrong on every replica"),
    ({"category": "crash", "action": "rollback"}, "rollback acts on the whole job"),
    ({"category": "crash", "action": "wait_human"}, "wait_human acts on the whole job"),
    ({"category": "crash", "action": "diagnose", "log_verdict": "user_code"}, "the job's own code failed"),
    ({"category": "crash", "action": "diagnose", "level": 1}, "failed again after a recovery (level 1)"),
])
def test_what_the_whole_job_shares_stops_the_world(kwargs, why):
    p = degrade.plan(LARGE, machines=[3], **kwargs)
    assert p.path == degrade.STOP_WORLD and p.width == 0.0 and p.replicas == ()
    assert why in p.reason


def test_a_fault_across_more_replicas_than_the_job_may_lose_stops_the_world():
    both = degrade.plan(SMALL, category="machine_fault", action="evict", machines=[0, 1, 2, 3])
    assert both.path == degrade.STOP_WORLD and "spans 2 of 2 data-parallel replicas" in both.reason
    # one replica of two, but the job must keep two
    kept = degrade.plan(SMALL, category="hang", action="analyze", machines=[1], min_replicas=2)
    assert kept.path == degrade.STOP_WORLD and "no fewer than 2" in kept.reason
    # a DP group over-evicted at scale: one stage of every pipeline
    stage = [LARGE.machine_of(LARGE.rank_of(tp=0, pp=3, dp=d)) for d in range(150)]
    assert degrade.plan(LARGE, category="hang", action="analyze", machines=stage).path == degrade.STOP_WORLD
    # nothing named: nothing to take out alone
    assert degrade.plan(LARGE, category="crash", action="diagnose", machines=[]).path == degrade.STOP_WORLD


def test_what_stops_nothing_stays_so():
    for action in ("tolerate", "observe", "probe"):
        p = degrade.plan(LARGE, category="network", action=action, machines=[5])
        assert p.path == degrade.NONE and p.width == 1.0


def test_a_failure_among_replicas_that_never_stopped_repeats_no_recovery():
    assert degrade.repeats(None, [4])  # the last recovery stopped the world: any failure may repeat it
    assert degrade.repeats((4, 9), [9])  # the healed replica fails again
    assert not degrade.repeats((4,), [9])  # another replica: another failure


# ---- the simulator --------------------------------------------------------------------------------------
def _model(*kinds: FailureKind, rate: float = 0.05) -> model.FailureModel:
    return model.FailureModel(rate_per_machine_day=rate, gpus_per_machine=8, weak_machine_share=0.0,
                              weak_rate_multiplier=1.0, repair_days=1.0, manual_share=0.0, manual_urgent_share=0.0,
                              kinds=kinds)


def _profile(**over: float) -> Profile:
    diag = dict.fromkeys(("diagnose", "align", "analyze", "vote", "replay", "rollback"), 30.0)
    base = dict(name="fixed", detect_s={"machine_fault": 10.0, "crash_transient": 10.0, "nan": 10.0},
                diagnose_s=diag, restart_s=120.0, restore_s=20.0, swap_s=40.0, reschedule_s=0.0, hot_update_s=0.0,
                human_s=0.0, step_s=10.0, checkpoint_overhead=0.0, provision_s=60.0, quorum_s=5.0, heal_s=8.0)
    return Profile(**{**base, **over})


def test_machine_faults_cost_a_stall_and_a_narrower_window_instead_of_a_restart():
    m = _model(FailureKind("machine_fault", 1.0, "gpu_lost", machine_fault=True))
    kw = dict(gpus=64 * 8, days=20, pp=4, seed=5)  # 64 machines: 16 replicas of 4
    world = engine.simulate(m, _profile(), **kw)
    deg = engine.simulate(m, _profile(), knobs=engine.Knobs(degrade=True), **kw)
    n = deg.incidents["machine_fault"]
    assert n > 30 and deg.actions["degrade"] == n and deg.actions.get("stop_world", 0) == 0
    assert deg.by_phase["restart"] == 0 and deg.by_phase["restore"] == 0  # nobody restarted the world
    assert deg.by_phase["quorum"] == pytest.approx(n * 2 * 5.0)  # the others stalled twice per fault
    # a 16th of the job sat out each replica's window: detection, swap and heal
    assert deg.by_phase["degraded"] == pytest.approx(n * (10.0 + 40.0 + 8.0) / 16)
    assert deg.ettr > world.ettr
    lost = {k: v for k, v in deg.by_phase.items() if k not in ("checkpoint",)}
    assert deg.ettr == pytest.approx(1 - sum(lost.values()) / (20 * 86400), abs=1e-9)  # the ledger adds up


def test_a_nan_still_stops_the_world_and_a_single_replica_job_never_degrades():
    nan = _model(FailureKind("nan", 1.0, "nan_loss"))
    r = engine.simulate(nan, _profile(), gpus=64 * 8, days=10, pp=4, seed=2, knobs=engine.Knobs(degrade=True))
    assert r.incidents["nan"] > 5 and r.actions.get("degrade", 0) == 0 and r.by_phase["restart"] > 0
    one = _model(FailureKind("machine_fault", 1.0, "gpu_lost", machine_fault=True))
    r = engine.simulate(one, _profile(), gpus=8 * 8, days=10, pp=8, seed=2, knobs=engine.Knobs(degrade=True))
    assert r.actions.get("degrade", 0) == 0 and r.actions["stop_world"] == r.incidents["machine_fault"] > 0


def test_the_degrade_path_needs_a_profile_with_its_costs():
    from trainguard.operators.sim import profiles, report

    with pytest.raises(SimError, match="the byterobust profile has no cost for training on fewer replicas"):
        report.degrade_knobs(profiles.profile("byterobust", 1200))
    measured = profiles.profile("measured", 1200)
    assert measured.quorum_s > 0 and measured.heal_s > 0
    assert "replicas:survivor_stall_s" in measured.sources["degrade"]
    with pytest.raises(SimError, match="--min-replicas 0 must be at least 1"):
        report.degrade_knobs(measured, 0)


def test_a_job_run_as_replica_groups_counts_a_stretch_trained_by_fewer_replicas_as_partly_productive():
    from trainguard.operators.policy import ettr

    def steps(ends):  # one-second steps ending at ``ends``
        return [{"step": i, "ts": float(t), "step_time_s": 1.0, "incarnation": 0} for i, t in enumerate(ends)]

    always = steps(range(1, 61))  # a replica that trained the whole minute
    half = steps([*range(1, 31)])  # one that was out for its second half (its group taken out, not yet back)
    each = [ettr.ettr(r, start_ts=0.0, end_ts=60.0) for r in (always, half)]
    job = ettr.across_replicas(each)
    assert job.ratio == pytest.approx(0.75) and job.productive_s == pytest.approx(45.0)
    assert job.kept_steps == 60
    alone = ettr.across_replicas(each[:1])
    assert alone == each[0]  # one group: the replica's own figure, as before
    with pytest.raises(ValueError):
        ettr.across_replicas([])

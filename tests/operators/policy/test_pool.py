"""Standby pool policy: sizing (ByteRobust Table 5), the failure rate from fleet history, the pool plan."""

from __future__ import annotations

import pytest

from trainguard.operators.policy.pool import (
    DAY_S,
    PRIOR_RATE,
    Event,
    PoolError,
    Standby,
    failure_rate,
    over_eviction_floor,
    plan_pool,
    pool_target,
)


@pytest.mark.parametrize(("machines", "standbys"), [(128, 2), (256, 2), (512, 3), (1024, 4)])
def test_the_target_reproduces_the_papers_table_5(machines: int, standbys: int):
    assert pool_target(machines, PRIOR_RATE) == standbys


def test_the_target_grows_with_the_failure_rate_and_is_zero_without_machines():
    assert pool_target(1024, 0.01) > pool_target(1024, PRIOR_RATE) > pool_target(1024, 0.0001)
    assert pool_target(0, PRIOR_RATE) == 0 and pool_target(64, 0.0) == 0


@pytest.mark.parametrize(("layouts", "floor"), [
    ([], 0),
    ([(1, 2, 2, 2)], 1),  # a pipeline's 2 ranks on one machine
    ([(8, 8, 19, 8)], 8),  # 1,216 machines of 8 GPUs, PP=8: one hang evicts 8 machines
    ([(2, 3, 4, 4)], 2),  # pipelines of 6 ranks on machines of 4: each spans two machines
    ([(8, 8, 19, 8), (8, 16, 2, 8)], 16),  # the largest job's pipeline
])
def test_the_pool_never_holds_less_than_one_pipeline(layouts, floor):
    assert over_eviction_floor(layouts) == floor


def test_a_job_of_1200_machines_keeps_a_pipeline_of_standbys_not_the_p99_of_single_failures():
    assert pool_target(1216, PRIOR_RATE) == 5  # single-machine failures alone: 5 (a hang would wait)
    assert max(pool_target(1216, PRIOR_RATE), over_eviction_floor([(8, 8, 19, 8)])) == 8


def test_a_young_fleet_gets_the_prior_and_a_long_history_its_own_rate():
    now = 100 * DAY_S
    assert failure_rate([], now)["rate"] == pytest.approx(PRIOR_RATE)
    # 200 machines in service for the whole 30-day window, 60 evictions: 0.01 per machine-day
    events = [Event(f"m{i}", "active", 0.0) for i in range(200)]
    events += [Event(f"m{i}", "evicted", now - DAY_S) for i in range(60)]
    events += [Event(f"m{i}", "active", now - DAY_S + 1) for i in range(60)]  # back after repair
    got = failure_rate(events, now, prior_days=0.0)
    assert got["failures"] == 60 and got["machine_days"] == pytest.approx(30 * 200, rel=1e-3)
    assert got["rate"] == pytest.approx(0.01, rel=1e-3)
    smoothed = failure_rate(events, now)["rate"]
    assert PRIOR_RATE < smoothed < 0.01


def test_only_the_window_and_time_in_service_count():
    now = 100 * DAY_S
    events = [Event("a", "active", 0.0), Event("a", "evicted", 10 * DAY_S),  # evicted long before the window
              Event("a", "repair", 10 * DAY_S + 1),  # in repair ever since: no exposure
              Event("b", "standby", now - 2 * DAY_S)]
    got = failure_rate(events, now, prior_days=0.0, window_s=30 * DAY_S)
    assert got["failures"] == 0 and got["machine_days"] == pytest.approx(2.0)


def test_the_plan_fills_the_shortfall_rechecks_stale_standbys_and_retires_repeat_offenders():
    now = 1000.0 * 3600
    standbys = [Standby("s0", now - 60), Standby("s1", now - 7 * 3600), Standby("s2", None)]
    plan = plan_pool(5, standbys, ["f0", "f1", "f2"], {"s2": 3, "f0": 4, "f1": 1}, now)
    assert plan.retire == ["f0", "s2"]  # neither comes back into the pool
    assert plan.have == 2 and plan.provision == ["f1", "f2"] and plan.unmet == 1
    assert plan.recheck == ["s1"]  # idle 7 h > 6 h; s0 was just checked
    full = plan_pool(2, standbys[:2], ["f1"], {}, now)
    assert full.provision == [] and full.unmet == 0  # a full pool provisions nothing: rerunning is a no-op


@pytest.mark.parametrize(("call", "message"), [
    (lambda: pool_target(-1, PRIOR_RATE), "-1 machines"),
    (lambda: pool_target(8, 1.5), "failure rate 1.5"),
    (lambda: plan_pool(-2, [], [], {}, 0.0), "pool target -2"),
    (lambda: failure_rate([], 0.0, window_s=0), "history window"),
])
def test_bad_input_says_what_is_wrong(call, message: str):
    with pytest.raises(PoolError, match=message):
        call()


# ---- the pool job's plan and claim against a fleet database (self-checks need machines: the e2e test) ----
def _fleet(tmp_path, free: int = 3):
    from trainguard.node_tools.inventory import Inventory, Machine
    from trainguard.operators.control import ControlConfig, Controller

    roles = ["active"] * 4 + ["standby"] + ["free"] * free
    inv = Inventory(cluster="t", transport="local",
                    machines=[Machine(name=f"m{i}", address="127.0.0.1", role=r) for i, r in enumerate(roles)])
    inv.save(tmp_path / "inventory.json")
    c = Controller(ControlConfig(fleet_url=str(tmp_path / "fleet.db"), inventory=str(inv.path)), inventory=inv)
    c.sync_inventory()
    c.fleet.upsert_job("j", tp=1, pp=2, dp=2, ranks_per_machine=2, machines=["m0", "m1", "m2", "m3"])
    return c


def test_the_pool_job_claims_free_machines_for_a_target_and_refuses_one_it_cannot_fill(tmp_path):
    from trainguard.operators import standby_pool
    from trainguard.operators.fleet import states

    c = _fleet(tmp_path)
    plan = standby_pool.plan(c)
    # 4 machines at 0.0012/day make none by the P99; a pipeline (2 ranks on one machine of 2) makes one
    assert plan["computed_target"] == 1 and plan["serving_machines"] == 4
    assert plan["provision"] == [] and plan["recheck"] == []  # the inventory's standby counts as checked
    assert standby_pool.claim(c, plan) == []
    before = {m.name: m.state for m in c.fleet.machines()}
    with pytest.raises(PoolError, match=r"pool target 9 is larger than the free inventory \(4 machines"):
        standby_pool.plan(c, target=9)
    assert {m.name: m.state for m in c.fleet.machines()} == before  # refused: nothing changed
    plan = standby_pool.plan(c, target=3)
    assert plan["provision"] == ["m5", "m6"] and plan["nproc"] == 2
    targets = standby_pool.claim(c, plan)
    assert [t["machine"] for t in targets] == ["m5", "m6"]
    assert {c.fleet.machine(n).state for n in ("m5", "m6")} == {states.SELF_CHECK}
    assert standby_pool.claim(c, plan) == targets  # claiming again is a no-op on the fleet
    assert [e.to_state for e in c.fleet.events("m5")].count(states.SELF_CHECK) == 1
    # the next run does not pick them again while they are being checked
    again = standby_pool.plan(c, target=3)
    assert again["have"] == 3 and again["provision"] == []
    assert standby_pool.plan(c, target=4)["provision"] == ["m7"]
    note = standby_pool.summary(plan, [{"machine": "m5", "why": "provision", "healthy": True, "failed": None},
                                       {"machine": "m6", "why": "provision", "healthy": False, "failed": "L2: gemm"}])
    assert note["note"] == "pool 2/3; joined or re-checked: m5; to repair: m6 (L2: gemm); short by 1: the next " \
                           "run provisions more"  # m7 is still free
    last = standby_pool.summary({**plan, "free": ["m5", "m6"]}, [
        {"machine": "m5", "why": "provision", "healthy": True, "failed": None},
        {"machine": "m6", "why": "provision", "healthy": False, "failed": "L2: gemm"}])
    assert last["note"].endswith("short by 1: add machines to the inventory")  # none left to provision

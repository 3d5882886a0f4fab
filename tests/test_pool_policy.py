"""Standby pool policy: sizing (ByteRobust Table 5), the failure rate from fleet history, the pool plan."""

from __future__ import annotations

import pytest

from operators.policy.pool import DAY_S, PRIOR_RATE, Event, PoolError, Standby, failure_rate, plan_pool, pool_target


@pytest.mark.parametrize(("machines", "standbys"), [(128, 2), (256, 2), (512, 3), (1024, 4)])
def test_the_target_reproduces_the_papers_table_5(machines: int, standbys: int):
    assert pool_target(machines, PRIOR_RATE) == standbys


def test_the_target_grows_with_the_failure_rate_and_is_zero_without_machines():
    assert pool_target(1024, 0.01) > pool_target(1024, PRIOR_RATE) > pool_target(1024, 0.0001)
    assert pool_target(0, PRIOR_RATE) == 0 and pool_target(64, 0.0) == 0


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

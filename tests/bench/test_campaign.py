"""The fault campaign's scoring (bench/campaign.py): what counts as caught, over-evicted and false."""

from __future__ import annotations

from bench.campaign import balanced_draws, metrics_of, over_eviction_groups, score, where
from trainguard.core.topology import Topology

TOPO = Topology(tp=2, pp=2, dp=2)
MACHINES = ["m0", "m1", "m2", "m3"]  # pipelines [m0 m1] [m2 m3]; data-parallel pairs [m0 m2] [m1 m3]


def _trial(fault: str, machine: str, evicted: list[str], incident: int | None = 1) -> dict:
    t = {"fault": fault, "machine": machine, "machines": MACHINES, "evicted": evicted, "incident": incident,
         "fault_to_resumed_s": 20.0, "detect_s": 1.0}
    return {**t, **score(t, TOPO)}


def test_the_faulty_machine_alone_or_with_one_of_its_groups_is_not_over_eviction_beyond_a_group():
    assert over_eviction_groups(TOPO, MACHINES, "m1", {"m1"}) == 0
    assert {frozenset(TOPO.machines_of_group(k, TOPO.ranks_on(1)[0])) for k in ("pp", "dp")} == \
        {frozenset({0, 1}), frozenset({1, 3})}
    assert over_eviction_groups(TOPO, MACHINES, "m1", {"m1", "m0"}) == 1  # its pipeline
    assert over_eviction_groups(TOPO, MACHINES, "m1", {"m1", "m3"}) == 1  # its data-parallel peers
    # m2 shares no group with m1: no single group explains evicting it
    assert over_eviction_groups(TOPO, MACHINES, "m1", {"m1", "m2"}) == 2
    assert over_eviction_groups(TOPO, MACHINES, "m1", {"m0", "m1", "m3"}) == 2  # two groups
    assert over_eviction_groups(TOPO, MACHINES, "m1", {"m2"}) == 2  # the wrong machine, not even the faulty one


def test_a_machine_fault_must_evict_its_machine_and_a_code_fault_must_evict_nobody():
    caught = _trial("gpu_lost", "m1", ["m1"])
    assert caught["faulty_evicted"] is True and caught["healthy_evicted"] == [] and caught["over_eviction_groups"] == 0
    missed = _trial("gpu_lost", "m1", ["m2"])
    assert missed["faulty_evicted"] is False and missed["healthy_evicted"] == ["m2"]
    nan = _trial("nan", "m1", [])
    assert nan["faulty_evicted"] is None and nan["over_eviction_groups"] == 0
    wrong = _trial("user_error", "m0", ["m0"])  # the code's fault: evicting its machine is over-eviction
    assert wrong["healthy_evicted"] == ["m0"] and wrong["over_eviction_groups"] == 1
    undetected = _trial("hang", "m3", [], incident=None)
    assert not undetected["detected"] and undetected["faulty_evicted"] is False


def test_campaign_metrics_count_rates_over_the_trials_that_apply():
    trials = [_trial("gpu_lost", "m1", ["m1"]), _trial("hang", "m3", ["m3", "m2"]), _trial("nan", "m0", []),
              _trial("slow", "m2", [], incident=None)]
    m = metrics_of(trials, {"periods": 4, "seconds": 120.0, "incidents": 1, "evicted": 0, "details": []},
                   {"ettr": 0.9, "productive_s": 360.0, "wall_s": 400.0})
    assert m["detection_rate"]["value"] == 0.75 and m["detection_rate"]["n"] == 4
    assert m["faulty_evicted_rate"]["value"] == round(2 / 3, 4) and m["faulty_evicted_rate"]["n"] == 3
    assert m["over_eviction_groups_max"]["value"] == 1 and m["healthy_evicted_quiet"]["value"] == 0
    assert m["false_incidents_quiet"]["value"] == 1 and m["ettr"]["value"] == 0.9
    assert m["healthy_evicted_per_incident"]["value"] == round(1 / 3, 3)
    # 40 s of the job's 400 s lost over 4 faults; 4 faults in 400 s of job time is 36 an hour
    assert m["lost_s_per_fault"]["value"] == 10.0 and m["faults_per_hour"]["value"] == 36.0


def test_faults_are_drawn_only_where_they_act():
    assert where("gpu_lost", TOPO) == [(n, None) for n in range(4)]
    assert {r for _, r in where("hang", TOPO)} == set(range(8))
    # only the last pipeline stage computes the loss a NaN corrupts: ranks 2, 3, 6, 7 on nodes 1 and 3
    assert where("nan", TOPO) == [(1, 2), (1, 3), (3, 6), (3, 7)]
    assert where("user_error", TOPO) == [(0, 0)]


def test_the_draw_covers_every_kind_whatever_the_seed():
    import random
    from collections import Counter

    kinds = ["crash", "hang", "slow", "nan", "sdc", "user_error", "nic_down", "disk_full", "gpu_lost"]
    for seed in range(20):
        counts = Counter(balanced_draws(random.Random(seed), kinds, 20))
        assert sum(counts.values()) == 20 and set(counts) == set(kinds)
        assert set(counts.values()) <= {2, 3}
    orders = {tuple(balanced_draws(random.Random(seed), kinds, 9)) for seed in range(5)}
    assert len(orders) > 1  # shuffled, not round-robin

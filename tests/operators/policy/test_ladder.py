"""Control-plane policy without Airflow: triage, the ladder, the breaker, runtime analysis, replay, ETTR."""

from __future__ import annotations

import math
from typing import Any

import pytest

from trainguard.core.topology import Topology
from trainguard.operators.policy import ettr, ladder, runtime, sdc

JOB = ["m0", "m1", "m2", "m3"]
TOPO = Topology(tp=2, pp=2, dp=2)  # m0 = dp0 pp0, m1 = dp0 pp1, m2 = dp1 pp0, m3 = dp1 pp1


def alert(kind: str, machine: str = "m1", rank: int | None = None, ts: float = 100.0, **evidence: Any) -> dict:
    return {"id": f"{kind}{machine}{ts}", "job": "j", "machine": machine, "rank": rank, "kind": kind,
            "severity": "fault", "ts": ts, "evidence": evidence}


# ---- triage and the ladder ---------------------------------------------------------------------
@pytest.mark.parametrize(("batch", "category", "machines", "action"), [
    ([alert("gpu_lost", "m2")], "machine_fault", ("m2",), "evict"),
    ([alert("disk_full", "m3")], "machine_fault", ("m3",), "evict"),
    ([alert("kernel_xid", "m1", line="NVRM: Xid (PCI:0000:3b:00): 79", xid="79")], "machine_fault", ("m1",), "evict"),
    ([alert("gpu_xid", "m1", xid=13)], "observe", ("m1",), "observe"),  # a graphics-engine exception: not fatal
    ([alert("nic_down", "m0")], "network", ("m0",), "tolerate"),
    ([alert("rank_exit", "m0", 1), alert("rank_exit", "m2", 4, ts=101)], "crash", ("m0", "m2"), "restart"),
    ([alert("nan_loss", "m1", 2)], "nan", ("m1",), "diagnose"),
    ([alert("rank_hang", "m3", 6)], "hang", ("m3",), "analyze"),
    ([alert("rank_slow", "m2", 5)], "slow", ("m2",), "vote"),
    ([alert("sdc_suspect", "m0", 0)], "sdc", ("m0",), "replay"),
    ([alert("loss_spike", "m0", 0)], "observe", ("m0",), "observe"),
    # the strongest alert decides: a GPU loss explains the crashes it caused
    ([alert("rank_exit", "m0", 0), alert("gpu_lost", "m1"), alert("rank_hang", "m3", 7)], "machine_fault",
     ("m1",), "evict"),
])
def test_triage_and_first_decision(batch, category, machines, action):
    t = ladder.triage("j", batch, job_machines=JOB)
    assert t.category == category and t.machines == machines, t
    assert ladder.decide(t).action == action


def test_alerts_of_other_machines_do_not_implicate_the_job():
    t = ladder.triage("j", [{**alert("gpu_lost", "m5"), "job": ""}], job_machines=JOB)
    assert t.category == "observe"


def test_a_network_fault_is_evicted_when_it_repeats_within_five_minutes():
    first = alert("nic_down", "m2", ts=1000.0)
    assert ladder.decide(ladder.triage("j", [first], job_machines=JOB)).action == "tolerate"
    again = alert("nic_errors", "m2", ts=1200.0)
    t = ladder.triage("j", [again], job_machines=JOB, network_history=[first])
    assert (ladder.decide(t).action, t.machines) == ("evict", ("m2",))
    late = alert("nic_down", "m2", ts=1000.0 + 301 + 200)
    t = ladder.triage("j", [late], job_machines=JOB, network_history=[first])
    assert ladder.decide(t).action == "tolerate"  # the first one is older than the window
    # one flap raises the kernel log's line and, seconds later, the link check's: one episode, tolerated
    flap = [alert("kernel_link", "m2", ts=1000.0), alert("nic_down", "m2", ts=1004.5)]
    assert ladder.decide(ladder.triage("j", flap, job_machines=JOB)).action == "tolerate"
    t = ladder.triage("j", [alert("kernel_link", "m2", ts=1060.0)], job_machines=JOB, network_history=flap)
    assert (ladder.decide(t).action, t.machines) == ("evict", ("m2",))  # the second flap
    # a first blip that also crashed the job: the crash is handled
    t = ladder.triage("j", [first, alert("rank_exit", "m0", 0, ts=1001)], job_machines=JOB)
    assert t.category == "crash"


def test_the_network_decision_reads_the_triages_finding_not_its_wording():
    """Evict vs tolerate was chosen by the word "repeated" in the human-readable reason."""
    import dataclasses

    first = alert("nic_down", "m2", ts=1000.0)
    repeated = ladder.triage("j", [alert("nic_errors", "m2", ts=1200.0)], job_machines=JOB, network_history=[first])
    assert repeated.repeated and ladder.decide(dataclasses.replace(repeated, reason="m2 again")).action == "evict"
    once = ladder.triage("j", [first], job_machines=JOB)
    assert not once.repeated
    reworded = dataclasses.replace(once, reason="not repeated yet: tolerated")
    assert ladder.decide(reworded).action == "tolerate"


def test_the_crash_ladder_escalates_with_each_failed_recovery():
    t = ladder.triage("j", [alert("rank_exit", "m0", 0)], job_machines=JOB)
    first = ladder.decide(t, level=0)  # a first crash: restarted at once, L1 of its machine beside the restore
    assert first.action == "restart" and first.machines == ("m0",) and "L1 of m0" in first.reason
    # the check failed: the rung diagnoses; what the diagnosis finds decides as on level 0
    assert ladder.decide(t, level=0, diagnosis_done=True, diagnosis_failed=["m3"]).machines == ("m3",)
    assert ladder.decide(t, level=0, diagnosis_done=True).action == "reattempt"
    # the crash came back after its restart: now the stop-time diagnosis, then the rollback when all pass
    d = ladder.decide(t, level=1, rollback_to="r1")
    assert d.action == "diagnose" and d.diagnose["levels"] == ["L1", "L2", "L3"] and not d.diagnose["align"]
    assert ladder.decide(t, level=1, diagnosis_done=True, diagnosis_failed=["m2"]).machines == ("m2",)
    assert ladder.decide(t, level=1, rollback_to="r1", diagnosis_done=True).action == "rollback"
    assert ladder.decide(t, level=1, diagnosis_done=True).action == "replay"  # nothing to roll back to
    # a crash naming no machine has nothing to check beside a restore: diagnosed at once
    nameless = ladder.triage("j", [alert("job_down", "", None)], job_machines=())
    assert ladder.decide(nameless, level=0).action == "diagnose"
    assert ladder.decide(t, level=2, rollback_to="r1").action == "replay"
    assert ladder.decide(t, level=3).action == "wait_human"
    nan = ladder.triage("j", [alert("nan_loss", "m1", 2)], job_machines=JOB)
    assert ladder.decide(nan).diagnose["align"] is True


def _level(last: ladder.Triage | None, new: ladder.Triage, *, gap_s: float = 60.0, last_level: int = 0) -> int:
    """The level of ``new``, failing ``gap_s`` after the recovery from ``last`` (None: no recovery yet) ended,
    with the 30-minute window."""
    return ladder.escalation_level(
        last_level=None if last is None else last_level, last_recovery_end_ts=None if last is None else 1000.0,
        failed_ts=1000.0 + gap_s, window_s=1800.0, last_category=None if last is None else last.category,
        last_machines=() if last is None else last.machines, category=new.category, machines=new.machines)


def test_a_crash_that_comes_back_after_its_recovery_climbs_to_rollback_then_replay():
    """ByteRobust's "fails again after the reattempt": the same crash soon after the restart climbs, on any
    rank (the rank that dies first is not the cause), and climbs again after the rollback."""
    crash = ladder.triage("j", [alert("rank_exit", "m0", 0)], job_machines=JOB)
    again = ladder.triage("j", [alert("rank_exit", "m3", 6)], job_machines=JOB)
    assert _level(None, crash) == 0
    level = _level(crash, again)
    assert level == 1 and ladder.decide(again, level=level, rollback_to="r1").action == "diagnose"
    assert ladder.decide(again, level=level, rollback_to="r1", diagnosis_done=True).action == "rollback"
    level = _level(again, again, last_level=level)
    assert level == 2 and ladder.decide(again, level=level, rollback_to="r0").action == "replay"
    assert _level(crash, again, gap_s=1801.0) == 0  # long after the recovery: the recovery held


def test_an_unrelated_crash_right_after_a_gpu_eviction_starts_at_the_bottom_of_the_ladder():
    """At 1,200 machines unrelated failures often come minutes apart: a crash after a GPU was evicted is not
    that eviction failing again, and is diagnosed, not rolled back."""
    evicted = ladder.triage("j", [alert("gpu_lost", "m2")], job_machines=JOB)
    crash = ladder.triage("j", [alert("rank_exit", "m0", 0)], job_machines=JOB)
    level = _level(evicted, crash, gap_s=120.0)
    assert level == 0 and ladder.decide(crash, level=level, rollback_to="r1").action == "restart"
    nan = ladder.triage("j", [alert("nan_loss", "m1", 2)], job_machines=JOB)
    assert _level(crash, nan, last_level=1) == 0  # another category: another failure


def test_an_explicit_machine_fault_never_climbs_nor_makes_the_next_failure_climb():
    """The faulty machine is evicted at once: nothing of it is left to fail again, even when the same kind of
    fault strikes the same machine slot's successor or the machine itself again."""
    lost = ladder.triage("j", [alert("gpu_lost", "m2")], job_machines=JOB)
    other = ladder.triage("j", [alert("gpu_lost", "m3")], job_machines=JOB)
    assert _level(lost, lost, last_level=1) == 0 and _level(lost, other, last_level=1) == 0
    crash = ladder.triage("j", [alert("rank_exit", "m2", 4)], job_machines=JOB)
    assert _level(crash, lost, last_level=1) == 0


def test_a_silent_agent_climbs_only_when_it_is_the_same_machine_again():
    silent = ladder.triage("j", [alert("agent_silent", "m1")], job_machines=JOB)
    other = ladder.triage("j", [alert("agent_silent", "m3")], job_machines=JOB)
    assert _level(silent, silent) == 1 and _level(silent, other) == 0
    assert ladder.escalation_level(last_level=0, last_recovery_end_ts=1000.0, failed_ts=1060.0, window_s=1800.0,
                                   last_category="agent", last_machines=(), category="agent",
                                   machines=("m3",)) == 1  # an incident that named no machine: by category


def test_silent_corruption_evicts_the_machine_that_computes_wrong():
    t = ladder.triage("j", [alert("sdc_suspect", "m0", 0), alert("sdc_suspect", "m2", 4)], job_machines=JOB)
    assert ladder.decide(t).action == "replay"
    d = ladder.decide(t, diagnosis_done=True, diagnosis_failed=["m2"])
    assert (d.action, d.machines) == ("evict", ("m2",))
    assert ladder.decide(t, diagnosis_done=True).action == "reattempt"
    assert ladder.decide(t, level=1, diagnosis_done=True).action == "wait_human"


def test_user_code_errors_roll_back_or_wait_for_a_human():
    t = ladder.triage("j", [alert("rank_exit", "m0", 0)], job_machines=JOB)
    assert ladder.decide(t, log_verdict="user_code", rollback_to="r1").action == "rollback"
    assert ladder.decide(t, log_verdict="user_code").action == "wait_human"


def test_the_breaker_caps_evictions_per_window():
    ok = ladder.breaker(job_machines=100, evicted_recently={"a", "b"}, to_evict=["c"], max_share=0.05,
                        window_s=3600)
    assert ok.allowed
    no = ladder.breaker(job_machines=100, evicted_recently={"a", "b", "c", "d"}, to_evict=["e", "f"],
                        max_share=0.05, window_s=3600)
    assert not no.allowed and "limit 5" in no.reason
    # a small job may always lose one machine
    assert ladder.breaker(job_machines=4, evicted_recently=set(), to_evict=["m1"], max_share=0.1,
                          window_s=600).allowed
    assert not ladder.breaker(job_machines=4, evicted_recently={"m1"}, to_evict=["m2"], max_share=0.1,
                              window_s=600).allowed


def test_a_small_job_may_use_every_spare_kept_for_it_and_the_refusal_says_how_to_raise_the_allowance():
    """A two-machine job with two standbys could lose one machine an hour (half its machines): a lost GPU used
    that, and a hang localised to the other machine waited for a human with a standby free."""
    assert ladder.breaker(job_machines=2, evicted_recently={"m1"}, to_evict=["m0"], max_share=0.5, window_s=3600,
                          spares=2).allowed
    no = ladder.breaker(job_machines=2, evicted_recently={"m1", "m0"}, to_evict=["m4"], max_share=0.5,
                        window_s=3600, spares=2)
    assert not no.allowed and "limit 2: one per spare, 2" in no.reason
    assert "raise TG_BREAKER_SHARE (now 0.5)" in no.reason and "retry the incident" in no.reason
    # the share still rules a big job
    assert not ladder.breaker(job_machines=100, evicted_recently={"a", "b", "c", "d", "e"}, to_evict=["f"],
                              max_share=0.05, window_s=3600, spares=2).allowed


# ---- runtime analysis ------------------------------------------------------------------------------
WAIT = [{"name": "wait", "filename": "/x/torch/distributed/distributed_c10d.py"},
        {"name": "all_reduce", "filename": "/x/torch/distributed/distributed_c10d.py"},
        {"name": "step", "filename": "/job/train.py"}]
COMPUTE = [{"name": "forward", "filename": "/job/model.py"}, {"name": "step", "filename": "/job/train.py"}]


def stacks_doc(frames_by_rank: dict[int, list[dict]], counters: dict[int, int] | None = None) -> dict:
    return {
        "processes": [{"role": "rank", "rank": r, "error": None,
                       "threads": [{"name": "MainThread", "frames": f}]} for r, f in frames_by_rank.items()],
        "collectives": {str(r): {"dp": {"started": c}} for r, c in (counters or {}).items()},
    }


def documents(stuck: dict[int, list[dict]], counters: dict[int, int] | None = None) -> dict[str, dict]:
    docs = {}
    for i, m in enumerate(JOB):
        ranks = TOPO.ranks_on(i)
        docs[m] = stacks_doc({r: stuck.get(r, WAIT) for r in ranks},
                             {r: c for r, c in (counters or {}).items() if r in ranks})
    return docs


def test_a_rank_with_a_different_stack_is_evicted_with_its_pipeline_group():
    docs = documents({5: COMPUTE})  # rank 5 (m2) still computing; the other 7 wait in the all-reduce
    ranks = runtime.rank_stacks(docs, TOPO.world_size, {r: JOB[TOPO.machine_of(r)] for r in range(8)})
    a = runtime.analyze(TOPO, ranks)
    assert a.outliers == [5] and [len(g) for g in a.groups] == [7, 1]
    assert a.group_kind == "tp" and a.evict_machines == [2]  # one machine holds rank 5's TP group
    # two stuck ranks on two machines of one pipeline (dp1: m2 and m3): the PP group goes
    a = runtime.analyze(TOPO, runtime.rank_stacks(documents({5: COMPUTE, 6: COMPUTE}), 8,
                                                  {r: JOB[TOPO.machine_of(r)] for r in range(8)}))
    assert a.outliers == [5, 6] and a.group_kind == "pp" and a.evict_machines == [2, 3]


def test_a_rank_behind_in_collectives_or_without_a_stack_is_an_outlier():
    docs = documents({}, counters={r: (40 if r != 3 else 39) for r in range(8)})
    docs["m1"]["processes"][0]["error"] = "py-spy timed out"  # rank 2
    a = runtime.analyze(TOPO, runtime.rank_stacks(docs, 8, {r: JOB[TOPO.machine_of(r)] for r in range(8)}))
    assert a.outliers == [2, 3] and "collectives started 39 < 40" in a.reasons[3]
    assert a.group_kind == "tp" and a.evict_machines == [1]
    # an unreachable machine's ranks have no stack at all
    del docs["m3"]
    a = runtime.analyze(TOPO, runtime.rank_stacks(docs, 8, {r: JOB[TOPO.machine_of(r)] for r in range(8)}))
    assert {6, 7} <= set(a.outliers)


def test_identical_stacks_everywhere_mean_no_outlier():
    a = runtime.analyze(TOPO, runtime.rank_stacks(documents({}), 8, {}))
    assert a.outliers == [] and a.evict_machines == []


def test_group_stacks_uses_exact_identity():
    labels = runtime.group_stacks(["a < b", "a < b", "a < c", "d"])
    assert labels[0] == labels[1] and len(set(labels)) == 3


def test_near_identical_stacks_merge_and_a_function_only_some_ranks_are_in_stands_apart():
    """A recursion one level deeper is the same behaviour; a rank in a function no other rank is in is not."""
    sigs = ["walk < walk < step < main", "walk < step < main", "sleep < step < main", runtime.MISSING]
    labels = runtime.group_stacks(sigs)
    assert labels == [0, 0, 1, 2]


def test_stacks_of_thirty_thousand_ranks_group_by_their_few_distinct_signatures():
    """DBSCAN over one row per rank was quadratic: 11-14 s and 1.75 GB at 10,000 ranks, out of memory at
    30,000. Equal signatures are grouped by a dict, then the three distinct ones by their frame sets."""
    waiting = "wait < all_reduce < step < train < main"
    sigs = [waiting] * 30_000
    sigs[7], sigs[29_999] = "sleep < step < train < main", runtime.MISSING
    labels = runtime.group_stacks(sigs)
    assert labels[0] == 0 and labels.count(0) == 29_998 and labels[7] == 1 and labels[29_999] == 2


def test_fail_slow_votes_over_rounds():
    voter = runtime.SlowVoter(TOPO, rounds=5)
    base = {r: 0.3 for r in range(8)}
    for i in range(5):
        slow = {**base, 6: 0.9, 7: 0.9} if i != 2 else {**base, 1: 0.9}
        voter.add_round(slow)
    assert voter.done and voter.verdict() == ("tp", [3])  # ranks 6, 7 share machine m3


def test_the_vote_counts_each_rank_s_noise_so_a_healthy_noisy_job_flags_nobody_and_a_straggler_still_stands_out():
    """Two healthy ranks on two shared cores differed by over 25% from round to round, and the vote named a healthy
    machine in 3 of 5 rounds. With each figure's standard error (its steps' spread over the root of their count),
    that noise flags nobody; a rank 30% slower whose steps are steady does stand out."""
    two = Topology(tp=1, pp=1, dp=2)
    noisy = {r: 0.1 / math.sqrt(15) for r in range(2)}  # 15 steps of 0.2 s over 3 s, spread by half a step
    healthy = runtime.SlowVoter(two, rounds=5)
    for i in range(5):  # the slower rank changes from round to round, 30% behind the other
        healthy.add_round({i % 2: 0.2, (i + 1) % 2: 0.26}, factor=1.25, noise=noisy)
    assert healthy.verdict() is None and not healthy.votes
    straggler = runtime.SlowVoter(two, rounds=5)
    for _ in range(5):
        straggler.add_round({0: 0.2, 1: 0.26}, factor=1.25, noise={r: 0.01 / math.sqrt(15) for r in range(2)})
    assert straggler.verdict() == ("tp", [1])  # rank 1 alone on machine 1
    # without a word on the noise, the factor alone decides (as before)
    assert runtime.SlowVoter(two, rounds=1).add_round({0: 0.2, 1: 0.26}, factor=1.25) == [1]


def test_a_slowdown_every_rank_shares_or_one_that_passes_evicts_nobody():
    shared = runtime.SlowVoter(TOPO, rounds=5)
    for i in range(5):
        shared.add_round({r: 0.3 * (1 + i) for r in range(8)})  # the hosts are loaded: everyone slows
    assert shared.done and shared.verdict() is None
    passing = runtime.SlowVoter(TOPO, rounds=5)
    for i in range(5):
        passing.add_round({**{r: 0.3 for r in range(8)}, **({6: 0.9} if i < 2 else {})})
    assert passing.verdict() is None  # flagged in 2 rounds of 5: below half
    assert passing.verdict(min_share=0.4) == ("tp", [3])


def test_a_rank_flagged_now_and_then_does_not_split_the_vote_for_the_straggler():
    voter = runtime.SlowVoter(TOPO, rounds=5)
    base = {r: 0.3 for r in range(8)}
    for i in range(5):  # rank 2 (m1) every round; rank 6 (m3) and rank 5 (m2) once or twice, on a loaded host
        noise = {6: 0.9} if i in (1, 3) else {5: 0.9} if i == 4 else {}
        voter.add_round({**base, 2: 2.3, **noise})
    assert voter.persistent() == [2] and voter.verdict() == ("tp", [1])


def test_stragglers_that_fit_no_single_group_evict_nobody_unless_one_group_was_slow_every_round():
    # ranks on m0, m1 and m3 (no pipeline or data-parallel group holds all three) slow in most rounds:
    # a slowdown they share, the way a loaded host or a stalled link shows; no eviction of 3 of 4 machines
    spread = runtime.SlowVoter(TOPO, rounds=5)
    base = {r: 0.3 for r in range(8)}
    for i in range(5):
        spread.add_round({**base, 0: 0.9, 2: 0.9, 6: 0.9} if i != 1 else {**base, 0: 0.9, 6: 0.9})
    assert runtime.smallest_group(TOPO, [0, 2, 6])[0] == ""
    assert spread.persistent() == [0, 2, 6] and spread.verdict() is None
    # the same noise beside a rank slow in every round: that rank's machine is the verdict
    clear = runtime.SlowVoter(TOPO, rounds=5)
    for i in range(5):
        clear.add_round({**base, 4: 2.0, **({0: 0.9, 6: 0.9} if i in (0, 2, 4) else {})})
    assert clear.persistent() == [0, 4, 6] and clear.verdict() == ("tp", [2])


def test_stages_are_compared_within_themselves_and_a_whole_slow_machine_stands_out():
    # the last stage (ranks with pp 1: 2, 3, 6, 7) computes the loss too: twice the others, by design
    uneven = {r: (0.6 if TOPO.coords(r).pp == 1 else 0.3) for r in range(8)}
    voter = runtime.SlowVoter(TOPO, rounds=3)
    for _ in range(3):
        assert voter.add_round(uneven) == []
    assert voter.verdict() is None
    voter = runtime.SlowVoter(TOPO, rounds=3)
    for _ in range(3):  # both TP ranks of m2 (dp1 pp0: ranks 4, 5) throttled
        assert voter.add_round({**uneven, 4: 0.9, 5: 0.9}) == [4, 5]
    assert voter.verdict() == ("tp", [2])


@pytest.mark.parametrize(("current", "kinds", "taken_over"), [
    ("slow", ["rank_slow", "nan_loss"], True),
    ("slow", ["rank_slow", "rank_hang"], True),
    ("slow", ["rank_slow", "gpu_lost"], True),
    ("slow", ["rank_slow", "nic_down"], False),  # a first network blip is tolerated: the vote goes on
    ("slow", ["rank_slow", "loss_spike"], False),
    ("slow", ["rank_slow"], False),
    ("hang", ["rank_hang", "nan_loss"], False),  # acting already (the job is stopped): not taken over
])
def test_stronger_alerts_take_over_an_incident_still_being_watched(current, kinds, taken_over):
    t = ladder.triage("j", [alert(k, "m1", 2) for k in kinds])
    assert ladder.supersedes(current, t) is taken_over


# ---- dual-phase replay ---------------------------------------------------------------------------------
def test_replay_groups_intersect_in_one_machine():
    topo = Topology(tp=1, pp=2, dp=4, ranks_per_machine=1)
    machines = [f"m{i}" for i in range(8)]  # machine = dp*2 + pp
    plan = sdc.plan_replay(topo, machines, k=1)
    assert plan.horizontal == [["m0", "m1"], ["m2", "m3"], ["m4", "m5"], ["m6", "m7"]]
    assert plan.vertical[0] == ["m0", "m3"]  # stage 0 of replica 0, stage 1 of replica 1
    for h in plan.horizontal:
        for v in plan.vertical:
            assert len(set(h) & set(v)) <= 1
    bad = "m5"  # replica 2, stage 1
    h_res = {i: ("bad" if bad in g else "good") for i, g in enumerate(plan.horizontal)}
    v_res = {j: ("bad" if bad in g else "good") for j, g in enumerate(plan.vertical)}
    assert sdc.culprits(plan, h_res, v_res) == {bad}
    assert sdc.culprits(plan, {i: "good" for i in h_res}, {j: "good" for j in v_res}) == set()


def test_two_groups_need_a_reference_replay():
    plan = sdc.plan_replay(TOPO, JOB, k=1)
    h_res = {i: ("bad" if "m1" in g else "good") for i, g in enumerate(plan.horizontal)}
    v_res = {j: ("bad" if "m1" in g else "good") for j, g in enumerate(plan.vertical)}
    assert sdc.culprits(plan, h_res, v_res) == set(JOB)  # no majority: everything is suspect
    assert sdc.culprits(plan, h_res, v_res, reference="good") == {"m1"}
    with pytest.raises(Exception, match="must divide"):
        sdc.plan_replay(TOPO, JOB, k=3)


# ---- ETTR ------------------------------------------------------------------------------------------
def rec(step: int, inc: int, end: float, dt: float = 1.0) -> dict:
    return {"step": step, "incarnation": inc, "ts": end, "step_time_s": dt}


def test_ettr_counts_only_kept_steps():
    # incarnation 0 runs steps 0..9 (t 1..10), fails; down 10 s; restores step 7, reruns 8.. (t 21..)
    records = [rec(s, 0, s + 1.0) for s in range(10)] + [rec(s, 1, 21.0 + (s - 8)) for s in range(8, 14)]
    _good, lost = ettr.kept(ettr.executions(records))
    assert sorted(e.step for e in lost) == [8, 9]
    e = ettr.ettr(records, start_ts=0.0, end_ts=26.0)
    assert e.kept_steps == 14 and e.lost_steps == 2
    assert e.productive_s == pytest.approx(14.0) and e.lost_work_s == pytest.approx(2.0)
    assert e.ratio == pytest.approx(14.0 / 26.0)
    window = ettr.ettr(records, start_ts=16.0, end_ts=26.0)  # sliding: only the recovered stretch
    assert window.ratio == pytest.approx(6.0 / 10.0)
    with pytest.raises(ValueError):
        ettr.ettr(records, start_ts=5.0, end_ts=5.0)


def test_an_ettr_window_until_now_ends_at_the_last_step_only_while_the_job_is_stepping():
    records = [rec(s, 0, s + 1.0) for s in range(10)]  # steps of 1 s, the last ended at t=10
    assert ettr.window_end(records, 11.5, incident_open=False) == 10.0  # a step in flight
    assert ettr.window_end(records, 11.5, incident_open=True) == 11.5  # in an incident: time lost
    assert ettr.window_end(records, 12.5, incident_open=False) == 12.5  # past two step times: stalled
    assert ettr.window_end([], 3.0, incident_open=False) == 3.0


def test_incident_time_split():
    records = [rec(s, 0, s + 1.0) for s in range(10)] + [rec(s, 1, 21.0 + (s - 8)) for s in range(8, 14)]
    split = ettr.incident_split({"first_alert_ts": 10.5, "opened_ts": 11.0, "diagnosis_start_ts": 11.5,
                                 "decided_ts": 15.0, "resumed_ts": 20.0}, records)
    assert split == {"detection_s": 0.5, "diagnosis_s": 3.5, "recovery_s": 5.0, "lost_work_s": 2.0}


def test_a_stopped_rank_chooses_its_pipeline_whatever_its_peers_stacks_show():
    # stacks taken early: rank 6's data-parallel peer (rank 2) is still on its way into the all-reduce, so
    # the outliers {2, 6} fit the DP group; the alerts saw rank 6's process stopped: its pipeline goes
    docs = documents({2: COMPUTE, 6: [{"name": "_send", "filename": "train.py"}]})
    stacks = runtime.rank_stacks(docs, 8, {r: JOB[TOPO.machine_of(r)] for r in range(8)})
    by_stacks = runtime.analyze(TOPO, stacks, named=[6], kinds=("pp", "dp"))
    assert by_stacks.group_kind == "dp" and by_stacks.evict_machines == [1, 3]
    a = runtime.analyze(TOPO, stacks, named=[6], kinds=("pp", "dp"), stopped=[6])
    assert a.group_kind == "pp" and a.evict_machines == [2, 3]
    assert a.reasons[6] == "its process is stopped (the alerts)"


def test_when_the_outliers_fit_no_group_the_named_rank_chooses_and_hangs_evict_a_pipeline():
    # few ranks: healthy ones also wait in different collectives (grad-norm all-reduce, PP recv, TP)
    other = [{"name": "all_reduce", "filename": "c10d.py"}, {"name": "grad_norm", "filename": "train.py"}]
    recv = [{"name": "_recv", "filename": "train.py"}]
    send = [{"name": "_send", "filename": "train.py"}]
    docs = documents({3: other, 7: other, 4: recv, 6: send, 5: COMPUTE})
    stacks = runtime.rank_stacks(docs, 8, {r: JOB[TOPO.machine_of(r)] for r in range(8)})
    plain = runtime.analyze(TOPO, stacks)
    assert plain.group_kind == "" and len(plain.evict_machines) == 3  # no single group holds 3..7
    a = runtime.analyze(TOPO, stacks, named=[6], kinds=("pp", "dp"))
    assert a.group_kind == "pp" and a.evict_machines == [2, 3]  # rank 6's pipeline: m2, m3
    one = runtime.analyze(TOPO, runtime.rank_stacks(documents({6: send}), 8, {}), kinds=("pp", "dp"))
    assert one.outliers == [6] and one.group_kind == "pp" and one.evict_machines == [2, 3]

"""bench/peers.py's reading of the ranks' step lines: what it says about resume, full width and steps lost."""

from __future__ import annotations

from tests import REPO as ROOT
from tests.conftest import load_script


def _peers():
    return load_script("bench_peers", ROOT / "bench" / "peers.py")


def line(step: int, ts: float, replica: str, pid: int, participants: int = 4) -> dict:
    return {"step": step, "ts": ts, "replica": replica, "rank": 0, "participants": participants, "loss": 0.1,
            "pid": pid}


def test_a_restart_from_an_older_checkpoint_counts_the_steps_done_again():
    judge = _peers().judge
    before = [line(s, 100.0 + s, r, pid) for s in range(10) for r, pid in (("a", 1), ("b", 2))]
    # the fault at 110: the job restarts (new pids) from step 7, done again, at 120
    after = [line(s, 113.0 + s, r, pid) for s in range(7, 12) for r, pid in (("a", 3), ("b", 4))]
    got = judge(before + after, 110.0, 2)
    assert got["resumed"] and got["resume_s"] == 10.0 and got["steps_lost"] == 3  # 7, 8 and 9 again
    assert got["full_width_s"] == 10.0  # both replicas back at once, on new processes


def test_survivors_that_train_on_lose_nothing_and_full_width_waits_for_the_healed_replica():
    judge = _peers().judge
    before = [line(s, 100.0 + s, r, pid, 3) for s in range(10) for r, pid in (("0", 1), ("1", 2), ("2", 3))]
    narrow = [line(s, 100.5 + s, r, pid, 2) for s in range(10, 14) for r, pid in (("0", 1), ("1", 2))]
    healed = [line(s, 100.5 + s, r, pid, 3) for s in range(14, 16) for r, pid in (("0", 1), ("1", 2), ("2", 9))]
    got = judge(before + narrow + healed, 110.0, 3)
    # step 10 was in flight at the fault (it finished at 110.5 on the survivors); step 11 is the first begun after
    assert got["resumed"] and got["resume_s"] == 1.5 and got["steps_lost"] == 0
    assert got["full_width_s"] == 4.5  # step 14, the first at full width again


def test_gpu_seconds_lost_count_stopped_time_narrower_steps_and_steps_done_again():
    lost = _peers().gpu_seconds_lost
    before = [line(s, 100.0 + s, r, pid) for s in range(10) for r, pid in (("a", 1), ("b", 2))]
    for d in before:
        d["rank"] = 0 if d["replica"] == "a" else 1
    # stop the world at 110 (after step 9), back at 115 from step 8: steps 8 and 9 again
    after = [{**line(s, 115.0 + (s - 8), r, pid), "rank": rank} for s in range(8, 20)
             for r, pid, rank in (("a", 3, 0), ("b", 4, 1))]
    got = lost(before + after, 110.0, 130.0, by_replica=False, window_s=20.0, slots=2)
    # per rank: 109 -> 115 is 5 s beyond a 1 s step, 126 -> 130 (the trial watched on, nothing more came) 3 s,
    # and 2 steps done before and again: 10
    assert got["step_s"] == 1.0 and got["by_slot"] == {"0": 10.0, "1": 10.0} and got["gpu_s_lost"] == 20.0
    # replicas that train on narrower lose only the one that stopped: by replica group, not by rank; a pace faster
    # than before the fault (fewer processes on the cores) earns nothing back
    narrow = [line(s, 100.0 + s * 0.9 + 1.0, r, pid, 2) for s in range(10, 33) for r, pid in (("a", 1),)]
    got = lost(before + narrow, 110.0, 130.0, by_replica=True, window_s=20.0, slots=2)
    assert got["by_slot"] == {"a": 0.0, "b": 20.0} and got["gpu_s_lost"] == 20.0
    # steps with a NaN loss are not kept; a trial that ended early is charged up to its end
    nan = [{**line(s, 100.0 + s, "a", 1), "rank": 0, "loss": float("nan")} for s in range(11, 14)]
    got = lost(before + nan, 110.0, 113.5, by_replica=False, window_s=20.0, slots=2)
    assert got["by_slot"] == {"0": 3.5, "1": 3.5}
    assert lost(before, 110.0, 130.0, by_replica=False, window_s=20.0, slots=3)["gpu_s_lost"] == 60.0


def test_a_job_that_never_trains_again_did_not_resume():
    judge = _peers().judge
    # the step in flight at the fault finishes; nothing after it does
    got = judge([line(s, 106.0 + s, "a", 1) for s in range(5)], 109.5, 1)
    assert not got["resumed"] and got["resume_s"] is None and got["last_step_before"] == 3
    # a restart that finishes a step, then fails again (a NaN that comes back), in a loop: not resumed either
    loop = [line(s, 100.0 + s, "a", 1) for s in range(10)] + [line(9, 115.0 + 10 * k, "a", 10 + k) for k in range(4)]
    got = judge(loop, 110.0, 1)
    assert not got["resumed"] and got["steps_after"] == 1
    # steps that go on with a NaN loss: the NaN reached every replica's parameters
    nan = [line(s, 100.0 + s, "a", 1) for s in range(10)] + [{**line(s, 100.0 + s, "a", 1), "loss": float("nan")}
                                                             for s in range(10, 30)]
    assert not judge(nan, 109.5, 1)["resumed"]


def test_a_slow_rank_voted_out_is_back_at_pace_after_its_restart():
    peers = _peers()
    pace = [line(s, 100.0 + 0.2 * s, "m0", 1) for s in range(30)]  # 0.2 s a step; the fault at 106.0
    slow = [line(30 + k, 106.0 + 3.2 * (k + 1), "m0", 1) for k in range(4)]  # 3.2 s a step: slowed
    # stopped, swapped, restarted at 130.0 (a gap counted slow), then at pace
    back = [line(34 + k, 130.0 + 0.2 * k, "m0", 2) for k in range(8)]
    got = peers.judge_slow(pace + slow + back, 106.0, "m0")
    assert got["slowed"] and got["step_s_before"] == 0.2 and got["slow_step_s"] == 3.2
    # the first of five steps in a row at pace: the one finished at 130.2 (130.0 ends the restart's gap)
    assert got["resumed"] and got["resume_s"] == 24.2
    assert peers.human_work("slow", got) == "nothing"


def test_replica_groups_are_back_at_pace_only_when_every_group_is():
    """torchft's trials ended 5 s after a slow fault: the first group was back at its pace (the slow one left out of
    its quorums), while the slow group itself stepped on at 3.2 s a step."""
    peers = _peers()
    fast = [line(s, 100.0 + 0.2 * s, r, 1) for s in range(60) for r in ("0", "1")]
    slow = [line(s, 100.0 + 0.2 * s if s < 30 else 106.0 + 3.2 * (s - 29), "2", 2) for s in range(40)]
    assert peers.judge_slow(fast + slow, 106.0, "0")["resumed"] is False  # never slowed: nothing to be back from
    got = peers.judge_slow_job(fast + slow, 106.0, "torchft")
    assert not got["resumed"] and got["slowed"] and got["slow_step_s"] == 3.2
    assert peers.judge_slow_job(fast + slow, 106.0, "nvrx") == peers.judge_slow(fast + slow, 106.0, "m0")
    # the slow group voted out and back at pace: the job is back, when its slow group is
    healed = [line(s, 106.0 + 3.2 * 4 + 0.2 * (s - 33), "2", 3) for s in range(34, 60)]
    got = peers.judge_slow_job(fast + slow[:34] + healed, 106.0, "torchft")
    assert got["resumed"] and got["resume_s"] == peers.judge_slow(fast + slow[:34] + healed, 106.0, "2")["resume_s"]


def test_a_slow_rank_nothing_noticed_never_counts_as_back():
    peers = _peers()
    lines = [line(s, 100.0 + 0.2 * s, "0", 1) for s in range(30)] + \
        [line(30 + k, 106.0 + 3.2 * (k + 1), "0", 1) for k in range(20)]
    got = peers.judge_slow(lines, 106.0, "0")
    assert got["slowed"] and not got["resumed"] and got["resume_s"] is None
    assert peers.human_work("slow", got).startswith("find the slow machine")
    # a fault that never bit (no slow step) does not count as back at pace either
    steady = [line(s, 100.0 + 0.2 * s, "0", 1) for s in range(60)]
    assert not peers.judge_slow(steady, 106.0, "0")["resumed"]


def test_what_a_human_does_follows_the_verdict():
    peers = _peers()
    before = [line(s, 100.0 + s, r, pid, 3) for s in range(10) for r, pid in (("0", 1), ("1", 2), ("2", 3))]
    # the survivors train on at 2 of 3 and the lost replica never comes back
    narrow = [line(s, 100.5 + s, r, pid, 2) for s in range(10, 20) for r, pid in (("0", 1), ("1", 2))]
    got = peers.judge(before + narrow, 110.0, 3)
    assert got["resumed"] and got["narrowed"] and not got["restarted"] and got["full_width_s"] is None
    assert peers.human_work("machine_lost", got).startswith("bring a machine in place")
    assert peers.human_work("crash", {"resumed": False}).startswith("find the faulty machine")


def test_the_side_by_side_table_says_per_fault_what_each_system_did():
    peers = _peers()
    table = load_script("bench_table", ROOT / "bench" / "table.py")
    base = {"detected": True, "healthy_taken_out": [], "full_width_s": None, "steps_lost": 0, "narrowed": False}
    trials = [
        *({**base, "peer": "trainguard", "fault": "crash", "resumed": True, "resume_s": r, "full_width_s": r,
           "human": "nothing", "healthy_taken_out": h} for r, h in ((10.0, []), (12.0, ["m3"]), (11.0, []))),
        *({**base, "peer": "torchft", "fault": "crash", "resumed": True, "resume_s": 5.0, "narrowed": True,
           "human": "bring a machine in place of the lost one and restart the job at its full width"}
          for _ in range(3)),
        *({**base, "peer": "nvrx", "fault": "crash", "resumed": False, "resume_s": None, "steps_lost": None,
           "human": "find the faulty machine, take it out and restart the job (training did not resume on its own)"}
          for _ in range(2)),
        {"peer": "nvrx", "fault": "crash", "error": "the job did not reach its warm-up steps"},  # not counted
    ]
    metrics, human = peers.metrics_of(trials, ["trainguard", "nvrx", "torchft"], ["crash", "hang"])
    assert metrics["trainguard.crash.resume_s"]["median"] == 11.0 and metrics["trainguard.crash.resume_s"]["n"] == 3
    assert metrics["trainguard.crash.healthy_taken_out"]["value"] == 1
    assert metrics["nvrx.crash.resumed_rate"] == {"value": 0.0, "n": 2, "unit": "share"}
    assert "nvrx.crash.resume_s" not in metrics and not any(k.endswith(".hang.resumed_rate") for k in metrics)
    doc = {"metrics": metrics, "setup": {"trials": trials, "human": human,
                                         "versions": {"trainguard": "0.1.0", "nvidia-resiliency-ext": "0.4.1",
                                                      "torchft": "0.2.0"}}}
    rows = table.peers_rows(doc)
    assert rows[0] == "| fault | trainguard 0.1.0 | NVRx 0.4.1 | torchft 0.2.0 |"
    tg, nvrx, tft = rows[2].split(" | ")[1:]
    assert tg == "3/3 resumed, 11 s; full width 11 s; 0 steps again; 1 healthy machines out"
    assert nvrx.startswith("not resumed (0/2). A human: find the faulty machine")
    assert tft.startswith("3/3 resumed, 5 s; 0 steps again. A human: bring a machine in place")
    assert table.peers_rows(doc, detail=False)[2].endswith("| 3/3 resumed, 5 s; 0 steps again |")


def test_a_trial_ends_early_only_once_training_is_back_at_full_width_for_a_few_steps():
    peers = _peers()
    four = (("m0", 1), ("m1", 2), ("m2", 3), ("m3", 4))
    before = [line(s, 100.0 + s, r, pid) for s in range(10) for r, pid in four]

    def restarted(steps: int) -> list[dict]:  # the fault at 110: a restart on new pids from step 7, at 113
        return [line(s, 113.0 + s, r, pid + 10) for s in range(7, 7 + steps) for r, pid in four]

    assert not peers.settled(before, 110.0, "crash", "nvrx", None)  # nothing after the fault yet
    assert not peers.settled(before + restarted(peers.SETTLED_STEPS), 110.0, "crash", "nvrx", None)
    assert peers.settled(before + restarted(peers.SETTLED_STEPS + 1), 110.0, "crash", "nvrx", None)
    # survivors training on at three of four never settle: the lost replica is not back
    narrow = [line(s, 100.5 + s, r, pid, 3) for s in range(10, 40) for r, pid in four[:3]]
    assert not peers.settled(before + narrow, 110.0, "crash", "torchft", None)


def test_replicas_that_start_again_from_nothing_lose_every_step_and_are_not_back_at_full_width():
    """torchft's replica groups all restarted at once (no live peer to heal from): training goes on from step 0,
    at three of four replicas. Every step done before is lost, and the step in flight at the fault (at full
    width, on the old processes) does not count as full width again."""
    judge = _peers().judge
    four = (("0", 1), ("1", 2), ("2", 3), ("3", 4))
    before = [line(s, 100.0 + 0.5 * s, r, pid) for s in range(20) for r, pid in four]  # steps 0..19, last at 109.5
    in_flight = [line(20, 110.01, r, pid) for r, pid in four]
    again = [line(s, 130.0 + 0.2 * s, r, pid + 10, 3) for s in range(15) for r, pid in (four[0], four[1], four[3])]
    got = judge(before + in_flight + again, 110.0, 4)
    assert got["resumed"] and got["resume_s"] == 20.0 and got["steps_lost"] == 20
    assert got["full_width_s"] is None and got["narrowed"]


def test_a_rerun_replaces_only_the_trials_of_its_systems_and_faults_and_is_listed():
    peers = _peers()
    old = {"versions": {"torchft": "0.2.0"}, "trials": [
        {"peer": p, "fault": f, "n": 0} for p in ("trainguard", "torchft") for f in ("crash", "nan")]}
    new = [{"peer": "torchft", "fault": "nan", "n": 1}]
    setup, trials = peers.merged(old, new, ["torchft"], ["nan"])
    assert sorted((t["peer"], t["fault"], t["n"]) for t in trials) == [
        ("torchft", "crash", 0), ("torchft", "nan", 1), ("trainguard", "crash", 0), ("trainguard", "nan", 0)]
    [rerun] = setup["reruns"]
    assert rerun["peers"] == ["torchft"] and rerun["faults"] == ["nan"] and rerun["replaced"] == 1
    assert setup["versions"] == {"torchft": "0.2.0"}


def test_the_sockets_of_launchers_that_are_gone_are_removed_and_a_live_ones_kept(tmp_path):
    import os

    peers = _peers()
    (tmp_path / f"_ft_launcher{os.getpid()}.socket").write_text("")  # this process: alive
    (tmp_path / "_ft_launcher999999999_rmon0.socket").write_text("")  # no such process
    (tmp_path / "other.socket").write_text("")
    assert peers.remove_ft_sockets(tmp_path) == ["_ft_launcher999999999_rmon0.socket"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"_ft_launcher{os.getpid()}.socket", "other.socket"]

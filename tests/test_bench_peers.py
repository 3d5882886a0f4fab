"""bench/peers.py's reading of the ranks' step lines: what it says about resume, full width and steps lost."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import load_script

ROOT = Path(__file__).resolve().parent.parent


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

"""The ladder against faults it was not built around, on a scripted fleet (tests/fakes.py): every rung runs
through the real controller and task bodies, machines answer from a script. Each test names the failure it
guards against."""

from __future__ import annotations

from node_tools.topology import Topology
from tests.fakes import alert, fleet_controller, run_incident


def test_a_stopped_rank_the_stacks_see_running_is_not_evicted_on_the_alerts_word(tmp_path, monkeypatch):
    """Heartbeats an hour behind made the agent report rank_stopped, and runtime analysis trusted the alert
    over the process it could see running: two healthy machines evicted."""
    c, fleet = fleet_controller(tmp_path)
    out = run_incident(c, [alert("rank_stopped", "m1", rank=1), alert("rank_stopped", "m2", rank=2)], monkeypatch)
    assert out["decision"]["action"] == "analyze"
    analysis = out["result"]["analysis"]
    assert analysis["claimed_stopped"] == [1, 2] and analysis["refuted"] == [1, 2] and analysis["machines"] == []
    assert c.fleet.job("j").machine_list == ["m0", "m1", "m2", "m3"]
    assert not fleet.sent("job", "stop") and not [a for a in c.fleet.actions() if a.kind == "evict"]
    assert out["closed"]["state"] == "resolved" and "seen running" in c.fleet.incident(out["incident"]).summary


def test_a_rank_the_stacks_see_stopped_is_proof(tmp_path, monkeypatch):
    c, fleet = fleet_controller(tmp_path, topology=Topology(tp=1, pp=2, dp=2))
    fleet.process_state[3] = "T"
    fleet.frames[3] = ["wait", "step", "main"]
    out = run_incident(c, [alert("rank_stopped", "m3", rank=3)], monkeypatch)
    analysis = out["result"]["analysis"]
    assert analysis["claimed_stopped"] == [3] and analysis["refuted"] == []
    # rank 3 (dp 1, stage 1) on m3: its pipeline (m2, m3) is over-evicted
    assert sorted(analysis["machines"]) == ["m2", "m3"]
    assert out["closed"]["state"] == "resolved" and c.fleet.job("j").machine_list == ["m0", "m1", "m4", "m5"]


def _crashed_first_on(fleet, machine: str) -> None:
    """The logs after the stop: ``machine``'s rank died first (killed); its peers' ranks only echo it."""
    t = 1000.0
    fleet.logs = {m: {"class": "infrastructure", "kind": "peer_connection", "first_failure": {"ts": t + 1.0}}
                  for m in ("m0", "m1", "m2", "m3")}
    fleet.logs[machine] = {"class": "infrastructure", "kind": "signal", "evidence": "killed by SIGKILL",
                           "first_failure": {"ts": t}}


def test_a_machine_whose_rank_keeps_crashing_with_clean_diagnoses_is_swapped_at_its_next_failure(tmp_path, monkeypatch):
    """A machine whose rank crashed three times in three minutes, each diagnosis clean, was never singled
    out: nothing counted failures per machine."""
    c, fleet = fleet_controller(tmp_path, escalation_window_s=0.0)
    for n in range(2):
        _crashed_first_on(fleet, "m2")
        out = run_incident(c, [alert("rank_exit", "m2", rank=2), alert("rank_exit", "m0", rank=0)], monkeypatch)
        assert out["decision"]["action"] == "diagnose" and out["closed"]["state"] == "resolved", n
        assert c.fleet.job("j").machine_list == ["m0", "m1", "m2", "m3"]  # every machine passed: in place
        assert [a.machines for a in c.fleet.actions(out["incident"]) if a.kind == "implicate"] == [["m2"]]
    _crashed_first_on(fleet, "m2")
    fleet.commands.clear()
    out = run_incident(c, [alert("rank_exit", "m2", rank=2)], monkeypatch)
    assert out["result"]["repeat_offender"] == "m2" and "repeat offender" in out["result"]["reason"]
    assert not fleet.sent("diag")  # swapped at once, no third diagnosis
    assert c.fleet.job("j").machine_list == ["m0", "m1", "m4", "m3"] and out["closed"]["state"] == "resolved"


def test_crashes_that_start_on_different_machines_make_no_repeat_offender(tmp_path, monkeypatch):
    c, fleet = fleet_controller(tmp_path, escalation_window_s=0.0)
    for first in ("m1", "m2", "m3"):
        _crashed_first_on(fleet, first)
        out = run_incident(c, [alert("rank_exit", first, rank=int(first[1]))], monkeypatch)
        assert out["closed"]["state"] == "resolved" and "repeat_offender" not in out["result"]
    assert c.fleet.job("j").machine_list == ["m0", "m1", "m2", "m3"]


def test_a_rank_slowed_by_a_third_of_its_step_is_voted_out_after_the_throughput_declines(tmp_path, monkeypatch):
    """A rank slowed by 30% of a step raised nothing (rank_slow needs 2.5x the median): the agents now report
    the job's throughput decline, and the vote localises the rank by its compute time."""
    c, fleet = fleet_controller(tmp_path, slow_rounds=5, slow_interval_s=0.0)
    fleet.compute = {r: 0.36 for r in range(4)} | {1: 0.36 + 0.18}  # 0.18 s = 30% of a 0.6 s step
    declines = [alert("throughput_decline", f"m{r}", rank=r, decline=0.22) for r in range(4)]
    out = run_incident(c, declines, monkeypatch)
    assert (out["decision"]["category"], out["decision"]["action"]) == ("slow", "vote")
    vote = out["result"]["vote"]
    assert all(r == [1] for r in vote["rounds"]) and vote["machines"] == ["m1"]
    assert c.fleet.job("j").machine_list == ["m0", "m4", "m2", "m3"] and out["closed"]["state"] == "resolved"


def test_a_decline_every_rank_shares_evicts_nothing(tmp_path, monkeypatch):
    c, fleet = fleet_controller(tmp_path, slow_rounds=5, slow_interval_s=0.0)
    fleet.compute = {r: 0.5 + 0.01 * r for r in range(4)}  # the whole job slowed (a slow file system ...)
    out = run_incident(c, [alert("throughput_decline", f"m{r}", rank=r) for r in range(4)], monkeypatch)
    assert out["result"]["vote"]["machines"] == [] and not fleet.sent("job", "stop")
    assert out["closed"]["state"] == "resolved" and c.fleet.job("j").machine_list == ["m0", "m1", "m2", "m3"]

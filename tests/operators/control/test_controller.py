"""The controller's bookkeeping that needs no machine: alerts into incidents, and stronger alerts taking
over an incident whose slow vote is still running (the end-to-end paths are in test_control_plane.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainguard.node_tools.inventory import Inventory
from trainguard.node_tools.transport import RunResult, Transport
from trainguard.operators.control import Controller
from trainguard.operators.control.replay import Replay


def _alert(kind: str, machine: str, rank: int, ts: float) -> dict:
    return {"id": f"{kind}-{machine}-{ts}", "job": "j", "machine": machine, "rank": rank, "kind": kind,
            "severity": "fault", "ts": ts, "evidence": {}}


def _controller(tmp_path: Path, **settings) -> Controller:
    """Job j (TP=1 PP=2 DP=2) on m0..m3, standbys m4 and m5: scripted machines (tests/fakes.py)."""
    from tests.fakes import fleet_controller

    c, fleet = fleet_controller(tmp_path, train_args=(), **settings)
    fleet.compute[1] = 0.9  # rank 1 computes slower than the others: a fail-slow alert here is confirmed
    return c


@pytest.fixture
def ctl(tmp_path: Path) -> Controller:
    return _controller(tmp_path)


def test_a_dry_run_records_the_eviction_it_would_make_and_changes_nothing(tmp_path: Path):
    c = _controller(tmp_path, dry_run=True)
    [lost] = c.ingest([_alert("gpu_lost", "m1", 1, 100.0)])
    decision = c.triage(lost["incident"])
    assert decision["action"] == "evict" and decision["machines"] == ["m1"]
    out = c.evict(lost["incident"], decision["machines"], reason=decision["reason"])
    assert out["dry_run"] and out["swaps"] == {"m1": "m4"}
    [action] = c.fleet.actions(lost["incident"])
    assert action.kind == "evict" and action.outcome == "dry_run" and action.dry_run
    assert c.fleet.job("j").machine_list == ["m0", "m1", "m2", "m3"]
    assert c.fleet.machine("m1").state == "active" and c.fleet.machine("m4").state == "standby"
    assert c.arm("j")["dry_run"]


def test_the_breaker_stops_an_eviction_over_its_share_and_the_incident_waits_for_a_human(tmp_path: Path):
    c = _controller(tmp_path, breaker_share=0.25)  # one machine of four per window
    [first] = c.ingest([_alert("gpu_lost", "m1", 1, 100.0)])
    assert c.evict(first["incident"], ["m1"], reason="gpu lost")["swaps"] == {"m1": "m4"}
    c.fleet.update_incident(first["incident"], state="resolved", resumed_ts=110.0, closed_ts=111.0)
    [second] = c.ingest([_alert("gpu_lost", "m2", 2, 120.0)])
    out = c.evict(second["incident"], ["m2"], reason="gpu lost")
    assert out["waiting_human"] and "limit 1" in out["reason"]
    assert c.fleet.incident(second["incident"]).state == "waiting_human"
    assert c.fleet.job("j").machine_list == ["m0", "m4", "m2", "m3"] and c.fleet.machine("m5").state == "standby"
    again = c.evict(second["incident"], ["m2"], reason="gpu lost")  # repeating it changes nothing either
    assert again["waiting_human"] and c.fleet.job("j").machine_list == ["m0", "m4", "m2", "m3"]


def test_a_nan_during_a_slow_vote_takes_the_incident_over_once(ctl: Controller):
    [first] = ctl.ingest([_alert("rank_slow", "m0", 0, 100.0), _alert("rank_slow", "m1", 1, 100.5)])
    assert first["opened"] and not first["taken_over"]
    decision = ctl.triage(first["incident"])
    assert (decision["category"], decision["action"]) == ("slow", "vote")
    [more_slow] = ctl.ingest([_alert("rank_slow", "m2", 2, 101.0)])
    assert more_slow["incident"] == first["incident"] and not more_slow["taken_over"]
    [nan] = ctl.ingest([_alert("nan_loss", "m1", 1, 102.0)])
    assert nan["incident"] == first["incident"] and not nan["opened"] and nan["taken_over"]
    assert ctl.fleet.incident(first["incident"]).category == "nan"  # the vote sees this and stops
    assert ctl.triage(first["incident"])["action"] == "diagnose"
    [again] = ctl.ingest([_alert("nan_loss", "m3", 3, 102.5)])
    assert not again["taken_over"]  # handled as a NaN now: one new run, not one per batch


def test_a_lost_gpu_takes_over_a_vote_whose_incident_a_run_claimed(ctl: Controller):
    """In Airflow every incident carries the claim of the tg_incident run that opened it (and a redrive's, later):
    the take-over once counted that claim as "acted on" and refused, so a lost GPU waited out the vote's rounds
    and the incident was recorded as slow."""
    [slow] = ctl.ingest([_alert("rank_slow", "m0", 0, 100.0), _alert("rank_slow", "m1", 1, 100.5)],
                        claim={"run": "asset_triggered__1", "first_seen_ts": 100.0})
    assert slow["opened"] and ctl.fleet.claims_of(slow["incident"])
    ctl.fleet.record_action(f"redrive:{slow['incident']}:1", kind="redrive", incident_id=slow["incident"])
    ctl.triage(slow["incident"])
    [lost] = ctl.ingest([_alert("gpu_lost", "m2", 2, 101.0)], claim={"run": "asset_triggered__2"})
    assert lost["incident"] == slow["incident"] and lost["taken_over"]
    assert ctl.fleet.incident(slow["incident"]).category == "machine_fault"


def test_an_incident_that_waits_for_a_human_takes_no_new_alert(ctl: Controller):
    [hang] = ctl.ingest([_alert("rank_hang", "m0", 0, 100.0)])
    ctl.fleet.wait_for_human(hang["incident"], "the breaker: raise TG_BREAKER_SHARE")
    [crash] = ctl.ingest([_alert("rank_exit", "m1", 1, 200.0)])
    assert crash["opened"] and crash["incident"] != hang["incident"]
    assert ctl.fleet.incident(hang["incident"]).state == "waiting_human"
    assert [a.kind for a in ctl.fleet.alerts_of(crash["incident"])] == ["rank_exit"]


def test_a_claimed_vote_verdict_cannot_be_taken_over_and_a_taken_over_vote_claims_nothing(ctl: Controller):
    from trainguard.operators.policy import ladder

    [slow] = ctl.ingest([_alert("rank_slow", "m1", 1, 100.0)])
    ctl.triage(slow["incident"])
    # the vote concluded and claimed its verdict; the job is stopped next, and its ranks' alerts come in
    assert ctl.fleet.claim_watched(slow["incident"], "vote:x", watched=ladder.WATCHED, kind="vote", machines=["m1"])
    [stopped] = ctl.ingest([_alert("nan_loss", "m1", 1, 101.0)])
    assert not stopped["taken_over"] and ctl.fleet.incident(slow["incident"]).category == "slow"
    assert ctl.fleet.claim_watched(slow["incident"], "vote:x", watched=ladder.WATCHED, kind="vote")  # a no-op
    assert [a.kind for a in ctl.fleet.actions(slow["incident"])] == ["vote"]
    # the other order: stronger alerts first, then the vote's verdict is refused and nothing is recorded
    ctl.fleet.update_incident(slow["incident"], state="resolved", closed_ts=102.0)
    [second] = ctl.ingest([_alert("rank_slow", "m2", 2, 200.0)])
    ctl.triage(second["incident"])
    [nan] = ctl.ingest([_alert("nan_loss", "m2", 2, 201.0)])
    assert nan["taken_over"]
    assert not ctl.fleet.claim_watched(second["incident"], "vote:y", watched=ladder.WATCHED, kind="vote")
    assert not ctl.fleet.actions(second["incident"])


def test_an_incident_being_acted_on_is_not_taken_over(ctl: Controller):
    [hang] = ctl.ingest([_alert("rank_hang", "m0", 0, 100.0)])
    assert ctl.triage(hang["incident"])["action"] == "analyze"
    [nan] = ctl.ingest([_alert("nan_loss", "m1", 1, 101.0)])
    assert not nan["taken_over"] and ctl.fleet.incident(hang["incident"]).category == "hang"
    [blip] = ctl.ingest([_alert("nic_down", "m2", 2, 102.0)])
    assert not blip["taken_over"]


def _status(state: str, rc: int | None, inc: int, ranks: dict[int, tuple[int, str]]) -> dict:
    return {"state": state, "returncode": rc, "incarnation": inc,
            "ranks": [{"rank": r, "last_step": {"step": s, "param_digest": d, "incarnation": inc}}
                      for r, (s, d) in ranks.items()]}


def test_a_replay_group_result_is_its_ranks_digests_once_every_part_ended():
    from trainguard.operators.control.replay import _replay_result

    done = {"m0": _status("exited", 0, 2, {0: (1, "aa"), 1: (1, "bb")}),
            "m1": _status("exited", 0, 2, {2: (1, "cc"), 3: (1, "dd")})}
    assert _replay_result(done, 2, 4) == "0:aa,1:bb,2:cc,3:dd"
    assert _replay_result({**done, "m1": _status("running", None, 2, {})}, 2, 4) is None
    assert _replay_result({**done, "m1": _status("exited", 1, 2, {})}, 2, 4).startswith("failed: exit codes")
    stale = {**done, "m1": {**done["m1"], "incarnation": 3}}  # crashed before a step: old records
    assert _replay_result(stale, 2, 4).startswith("failed: rank 2")
    assert _replay_result({"m0": done["m0"]}, 2, 4) == "failed: 2 of 4 ranks reported"
    assert _replay_result({**done, "m1": {"error": "m1: unreachable"}}, 2, 4).startswith("failed: m1")


def test_the_replay_verdict_places_the_culprit_with_the_reference_or_says_it_cannot():
    plan = {"k": 1, "horizontal": [["m0", "m1"], ["m2", "m3"]], "vertical": [["m0", "m3"], ["m2", "m1"]]}
    good, bad = "0:aa,1:bb,2:cc,3:dd", "0:aa,1:bb,2:xx,3:dd"
    with_ref = Replay.replay_verdict(plan, {"h0": good, "h1": bad, "ref": good}, {"v0": good, "v1": bad})
    assert with_ref["culprits"] == ["m2"] and not with_ref["inconclusive"]
    clean = Replay.replay_verdict(plan, {"h0": good, "h1": good, "ref": good}, {"v0": good, "v1": good})
    assert clean["culprits"] == [] and not clean["inconclusive"]
    blind = Replay.replay_verdict(plan, {"h0": good, "h1": bad}, {"v0": good, "v1": bad})
    assert blind["inconclusive"] and blind["culprits"] == []
    failed_ref = Replay.replay_verdict(plan, {"h0": good, "h1": bad, "ref": "failed: m4 unreachable"},
                                           {"v0": good, "v1": bad})
    assert failed_ref["inconclusive"] and failed_ref["reference_result"] is None


def test_l3_pairs_neighbours_and_an_odd_one_out_joins_the_last_pair():
    from trainguard.operators.control import neighbour_groups

    # three machines left after one failed L1 (a full disk): one group of three, not a crash
    assert neighbour_groups(["m0", "m1", "m3"]) == [["m0", "m1", "m3"]]
    assert neighbour_groups(["a", "b", "c", "d", "e"]) == [["a", "b"], ["c", "d", "e"]]
    assert neighbour_groups(["a", "b", "c", "d"]) == [["a", "b"], ["c", "d"]]


def test_an_incident_run_ends_failed_when_its_incident_failed_or_waits_for_a_human(tmp_path: Path, monkeypatch):
    from trainguard.core.errors import TrainguardError
    from trainguard.operators.tasks import incident as steps

    c = _controller(tmp_path)
    monkeypatch.setenv("TG_FLEET_URL", c.cfg.fleet_url)
    monkeypatch.setenv("TG_INVENTORY", c.cfg.inventory)
    [inc] = c.ingest([_alert("gpu_lost", "m1", 1, 100.0)])
    c.fleet.update_incident(inc["incident"], state="resolved", closed_ts=120.0)
    assert steps.outcome(c, inc["incident"])["state"] == "resolved"
    c.fleet.update_incident(inc["incident"], state="waiting_human", summary="breaker: limit 1")
    with pytest.raises(TrainguardError, match=r"incident \d+ waiting for a human: breaker: limit 1"):
        steps.outcome(c, inc["incident"])
    c.fleet.update_incident(inc["incident"], state="failed", summary="training did not resume")
    with pytest.raises(TrainguardError, match=r"incident \d+ failed: training did not resume"):
        steps.outcome(c, inc["incident"])


def test_an_incident_runs_note_says_in_one_line_what_happened(tmp_path: Path, monkeypatch):
    from trainguard.operators.tasks import incident as steps

    c = _controller(tmp_path)
    [lost] = c.ingest([_alert("gpu_lost", "m1", 1, 100.0)])
    inc = lost["incident"]
    c.fleet.update_incident(inc, category="machine_fault")
    c.evict(inc, ["m1"], reason="gpu lost")
    c.fleet.update_incident(inc, resumed_ts=121.4, lost_steps=0)
    c.close(inc, outcome="resolved")
    assert steps.incident_note(c, inc) == (f"incident {inc} resolved (machine_fault): evicted m1 -> standby m4; "
                                           f"resumed 21s after the first alert, 0 steps lost")
    [other] = c.ingest([_alert("rank_hang", "m2", 2, 200.0)])
    c.fleet.update_incident(other["incident"], state="waiting_human", summary="hang; next: analyze; breaker: limit 1")
    assert steps.incident_note(c, other["incident"]) == \
        f"incident {other['incident']} waiting human (untriaged): breaker: limit 1"
    monkeypatch.setenv("TG_FLEET_URL", c.cfg.fleet_url)
    monkeypatch.setenv("TG_INVENTORY", c.cfg.inventory)
    assert steps.outcome(c, inc)["note"] == steps.incident_note(c, inc)  # outside a task: no run to annotate


def _diag_run(machine: str, *, l2_ok: bool = True, l3_ok: bool = True, digest: str = "d0", level: int = 2):
    import json

    from trainguard.node_tools.transport import RunResult

    tests = [{"name": "compute", "ok": l2_ok, "reason": "" if l2_ok else "3 wrong results", "duration_s": 0.25}] \
        if level == 2 else []
    tests.append({"name": "collective_neighbours", "ok": l3_ok, "reason": "" if l3_ok else "peer never came"})
    doc = {"machine": machine, "healthy": l2_ok and l3_ok, "tests": tests,
           "reasons": [f"{t['name']}: {t['reason']}" for t in tests if not t["ok"]],
           "align": {"exit_code": 0, "digest": digest}}
    return RunResult(machine, ["tg-node", "diag"], 0 if l2_ok and l3_ok else 1, json.dumps(doc), "", 1.0)


def test_l2_and_l3_in_one_round_blame_l2_failures_and_retest_the_partners_they_left_alone(ctl, monkeypatch):
    """NaN's diagnosis: one round runs L2, then L3 and the alignment test, on every machine. m1 fails L2,
    so its partner m0's failed collective says nothing of m0: m0 is tested again (L3 alone) with a
    healthy peer; m3's digest differs from the majority's."""
    calls = []

    def fake_l3(names, *, align=False, level=3):
        calls.append((list(names), align, level))
        if level == 2:
            return {"m0": _diag_run("m0", l3_ok=False), "m1": _diag_run("m1", l2_ok=False, l3_ok=False),
                    "m2": _diag_run("m2"), "m3": _diag_run("m3", digest="d1")}
        return {n: _diag_run(n, level=3) for n in names}

    monkeypatch.setattr(ctl.diagnosis, "_l3", fake_l3)
    ctl.transport.l2["m1"] = "3 wrong results"  # and again when its L2 is repeated alone
    out = ctl.diagnose("j", align=True)
    assert calls == [(["m0", "m1", "m2", "m3"], True, 2), (["m0", "m2"], False, 3)]
    assert ctl.transport.sent("diag") == ["m1"]  # the repeat, alone
    assert set(out["failed"]) == {"m1", "m3"}
    assert out["failed"]["m1"].startswith("L2: compute: 3 wrong results")
    assert out["failed"]["m3"].startswith("align: digest d1 differs")
    assert out["report"]["L3"]["m0"] == {"healthy": True, "reasons": [], "again": True}
    assert "L1" not in out["report"] and out["report"]["align"] == {"m0": "d0", "m2": "d0", "m3": "d1"}
    # where the combined round's time went on each machine: its session, and each test that said how long it took
    assert out["report"]["seconds"] == {n: {"session": 1.0, "compute": 0.25} for n in ("m0", "m1", "m2", "m3")}


def test_l2_and_l3_in_one_round_a_failed_collective_between_l2_healthy_machines_fails_both(ctl, monkeypatch):
    def fake_l3(names, *, align=False, level=3):
        assert level == 2, "nothing to test again"
        return {"m0": _diag_run("m0"), "m1": _diag_run("m1"), "m2": _diag_run("m2", l3_ok=False),
                "m3": _diag_run("m3", l3_ok=False)}

    monkeypatch.setattr(ctl.diagnosis, "_l3", fake_l3)
    out = ctl.diagnose("j")
    assert sorted(out["failed"]) == ["m2", "m3"] and out["failed"]["m2"].startswith("L3: collective_neighbours")
    assert "align" not in out["report"]


class _Machines(Transport):
    """Machines that answer tg-node job stop/status/start from a script, recording every command."""

    def __init__(self, inventory: Inventory, steps: dict[str, int]) -> None:
        super().__init__(inventory)
        self.steps, self.commands = steps, []

    def _status(self, machine: str, state: str) -> dict:
        return {"job": "j", "machine": machine, "state": state, "ranks": [{"rank": 0, "step": self.steps[machine]}]
                if machine in self.steps else []}

    def run(self, machine, argv, *, timeout=30.0, stdin=None, env=None) -> RunResult:
        self.commands.append((machine.name, argv[1:3]))
        if argv[1:3] == ["job", "status"]:
            doc = self._status(machine.name, "exited")
        elif argv[1:3] == ["job", "start"]:
            doc = {**self._status(machine.name, "running"), "warm": "--warm-if-parked" in argv}
        elif argv[1:3] == ["standby", "status"]:
            doc = {"state": "parked"}
        else:
            raise AssertionError(f"unexpected command {argv}")
        return RunResult(machine.name, list(argv), 0, json.dumps(doc), "", 0.1)

    def run_two_phase(self, machines, argv_for, *, timeout=30.0, ready_timeout=None) -> dict[str, RunResult]:
        out = {}
        for m in machines:
            argv = argv_for(m)
            self.commands.append((m.name, argv[1:3]))
            assert "--wait-go" in argv and "--status" in argv
            doc = {"job": "j", "machine": m.name, "stopped_pids": [1], "state": "running",
                   "status": self._status(m.name, "exited")}
            out[m.name] = RunResult(m.name, argv, 0, json.dumps(doc), "", 0.1, extra={"first": "{}"})
        return out


def test_a_restart_right_after_the_stop_starts_at_once_from_what_the_stop_found(tmp_path: Path):
    c = _controller(tmp_path)
    machines = _Machines(c.inventory, {"m0": 7, "m1": 6, "m2": 7, "m3": 7})
    c.transport = machines
    [lost] = c.ingest([_alert("gpu_lost", "m1", 1, 100.0)])
    assert c.stop("j") == dict.fromkeys(["m0", "m1", "m2", "m3"], "stopped")
    found = c.stop_found("j")  # what the rung hands restart_job through XCom
    assert found == {"machines": ["m0", "m1", "m2", "m3"], "step": 6, "copies": {m: [] for m in found["machines"]}}
    c.evict(lost["incident"], ["m1"], reason="gpu lost")
    machines.commands.clear()
    out = c.recover(lost["incident"], found=found)
    # no round of reads: every machine of the new list (the standby m4 in m1's place) just starts, warm
    # where it has interpreters parked
    assert machines.commands == [(n, ["job", "start"]) for n in ["m0", "m4", "m2", "m3"]]
    assert out["steps_before"] == 6 and out["stopped"] == dict.fromkeys(["m0", "m1", "m2", "m3"], "stopped")
    assert out["warm"] == ["m0", "m2", "m3", "m4"]
    [launch] = [a for a in c.fleet.actions(lost["incident"]) if a.kind == "launch"]
    assert launch.outcome == "done" and launch.evidence["warm"] == ["m0", "m2", "m3", "m4"]
    # a restart without what a stop found (a cleared restart_job, say) reads first what runs where
    machines.commands.clear()
    c.recover(lost["incident"])
    assert [cmd for _, cmd in machines.commands][:4] == [["job", "status"]] * 4


def test_a_crash_after_an_eviction_is_diagnosed_and_the_triage_sets_the_level_from_what_it_found(ctl: Controller):
    """The level an incident opens with comes from its first alerts; the triage judges it again on all of them.
    A crash soon after a GPU eviction is not that eviction failing again (level 0: restarted at once); a crash
    soon after that crash's restart is (level 1: the stop-time diagnosis), though its first alert alone (a
    slowdown) did not look like one."""
    [lost] = ctl.ingest([_alert("gpu_lost", "m1", 1, 100.0)])
    assert ctl.triage(lost["incident"])["action"] == "evict"
    ctl.fleet.update_incident(lost["incident"], state="resolved", resumed_ts=200.0, closed_ts=201.0)
    [crash] = ctl.ingest([_alert("rank_exit", "m2", 2, 300.0)])
    first = ctl.triage(crash["incident"])
    assert (first["level"], first["action"]) == (0, "restart")
    ctl.fleet.update_incident(crash["incident"], state="resolved", resumed_ts=400.0, closed_ts=401.0)
    [again] = ctl.ingest([_alert("rank_slow", "m0", 0, 500.0)])
    assert ctl.fleet.incident(again["incident"]).level == 0  # a slowdown does not repeat a crash
    ctl.ingest([_alert("rank_exit", "m3", 3, 501.0)])  # joins it before its triage
    second = ctl.triage(again["incident"])
    inc = ctl.fleet.incident(again["incident"])
    assert (second["category"], second["level"], second["action"]) == ("crash", 1, "diagnose")
    assert (inc.level, inc.category, inc.machines) == (1, "crash", ["m3"])

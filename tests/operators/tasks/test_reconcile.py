"""A job is never left dead or on a broken machine: the reconciler behind the incidents, the close that observes
the job before it closes, and the fleet database's outages waited out (all on the scripted fleet: the real
controller and task bodies, no processes)."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.fakes import alert, fleet_controller, recover, run_incident, use_controller
from trainguard.operators.control import Controller
from trainguard.operators.fleet.states import IncidentState
from trainguard.operators.fleet.store import FleetError, FleetStore, FleetUnavailable
from trainguard.operators.policy import reconcile as policy
from trainguard.operators.policy.reconcile import Finding, JobMemory, Look


@pytest.fixture()
def started(monkeypatch) -> list[dict]:
    """The tg_incident runs the tasks asked to start (instead of a REST API)."""
    from trainguard.operators.tasks import guardian

    asked: list[dict] = []

    def start_soon(starts):
        asked.extend(starts)
        return {s["trigger_run_id"]: "started" for s in starts}

    monkeypatch.setattr(guardian, "start_soon", start_soon)
    return asked


# ---- the close observes the job ------------------------------------------------------------------------------
def test_a_crash_that_joins_a_slow_vote_after_its_verdict_is_triaged_again_instead_of_closing(
        tmp_path, monkeypatch, started):
    """A false fail-slow incident's vote found nothing; meanwhile a rank was killed and every machine's part of
    the job ended, its rank_exit alerts joining the slow incident. The close does not call the incident
    resolved: the crash re-triages it, a new run of it restarts the job, and only then does it close."""
    from trainguard.operators.tasks import incident as steps
    from trainguard.operators.tasks import rungs

    c, fleet = fleet_controller(tmp_path, slow_rounds=1)
    use_controller(monkeypatch, c)
    fleet.compute[1] = 0.9  # a straggler as the alerts come, gone by the vote
    [item] = c.ingest([alert("throughput_decline", f"m{r}", rank=r) for r in range(4)])
    fleet.compute.clear()
    inc = item["incident"]
    decision = steps.triage(c, inc)
    assert steps.choose(decision) == "slow_vote"
    result = rungs.handle(c, "slow_vote", decision)  # every rank computes alike: nothing stands out
    assert result["vote"]["machines"] == [] and not result["restart"]
    fleet.running.clear()  # SIGKILL: every machine's part ends
    joined = c.ingest([alert("rank_exit", f"m{r}", rank=r) for r in range(4)])
    assert [i["incident"] for i in joined] == [inc] and not joined[0]["taken_over"]  # too late to take over
    recovery, _stop, _swap = recover(c, inc, result)
    assert not recovery["restarted"]
    resumed = steps.resumed(c, inc, recovery)
    assert resumed["skipped"]
    closed = steps.close(c, inc, None, recovery, resumed)
    assert c.fleet.incident(inc).state == IncidentState.OPEN, closed["summary"]
    assert c.fleet.incident(inc).category == "crash"
    assert [s["trigger_run_id"] for s in started] == [closed["triaged_again"]["run"]]
    assert closed["triaged_again"]["run"].startswith(f"incident__{inc}__crash")
    # the new run: the ladder decides for the crash, the job is restarted and trains again
    again = steps.triage(c, inc)
    assert again["category"] == "crash"
    branch = steps.choose(again)
    result = rungs.handle(c, branch, again)
    recovery, _stop, _swap = recover(c, inc, result)
    assert recovery["restarted"]
    resumed = None
    for _ in range(20):
        resumed = steps.resumed(c, inc, recovery)
        if resumed is not None:
            break
    steps.close(c, inc, None, recovery, resumed)
    assert c.fleet.incident(inc).state == IncidentState.RESOLVED
    assert c.trains("j")


def _a_slow_vote_that_found_nothing(tmp_path: Path, monkeypatch: Any) -> tuple[Any, Any, int, dict, dict | None]:
    """A fail-slow incident on the scripted fleet whose vote evicted nothing, run up to its close:
    ``(controller, fleet, incident, recovery, resume)``."""
    from trainguard.operators.tasks import incident as steps
    from trainguard.operators.tasks import rungs

    c, fleet = fleet_controller(tmp_path, slow_rounds=1)
    use_controller(monkeypatch, c)
    fleet.compute[1] = 0.9  # rank 1 straggles as the alerts come (the look before the incident sees it) ...
    [item] = c.ingest([alert("throughput_decline", f"m{r}", rank=r) for r in range(4)])
    fleet.compute.clear()  # ... and no longer when the vote looks
    inc = item["incident"]
    decision = steps.triage(c, inc)
    result = rungs.handle(c, steps.choose(decision), decision)
    assert result["vote"]["machines"] == []
    recovery, _stop, _swap = recover(c, inc, result)
    return c, fleet, inc, recovery, steps.resumed(c, inc, recovery)


def test_a_crash_whose_alerts_arrive_while_the_close_looks_at_the_job_is_triaged_again_not_restarted_blind(
        tmp_path, monkeypatch, started):
    """Seen in CI: the vote found nothing, a rank was killed just before the close; the close's first look at
    the incident's alerts found no crash yet, its look at the job found every part exited, and it escalated to a
    plain restart, so the crash skipped its stop-time diagnosis. The alerts that came while it looked are
    triaged again first."""
    from trainguard.operators.tasks import incident as steps

    c, fleet, inc, recovery, resumed = _a_slow_vote_that_found_nothing(tmp_path, monkeypatch)
    looked = c.not_training

    def not_training(job: str) -> str:  # every part ends, and the crash's alerts come in, while it looks
        fleet.running.clear()
        c.ingest([alert("rank_exit", f"m{r}", rank=r) for r in range(4)])
        return looked(job)

    monkeypatch.setattr(c.incidents, "not_training", not_training)
    closed = steps.close(c, inc, None, recovery, resumed)
    assert c.fleet.incident(inc).state == IncidentState.OPEN and c.fleet.incident(inc).category == "crash"
    assert [s["trigger_run_id"] for s in started] == [closed["triaged_again"]["run"]]
    assert not [a for a in c.fleet.actions(inc) if a.kind == "launch"]  # no restart without the crash's ladder


def test_a_close_tried_again_after_it_triaged_the_incident_again_hands_it_to_the_same_run_not_a_restart(
        tmp_path, monkeypatch, started):
    """The close of a slow vote triaged a crash that joined it again (the incident is a crash now, its new run
    named) and then failed before its task ended; its retry finds nothing that outranks a crash any more, and a
    job that does not train: it must not escalate to a blind restart beside the new run, but hand the incident
    to that run again."""
    from trainguard.operators.tasks import incident as steps

    c, fleet, inc, recovery, resumed = _a_slow_vote_that_found_nothing(tmp_path, monkeypatch)
    fleet.running.clear()
    c.ingest([alert("rank_exit", f"m{r}", rank=r) for r in range(4)])
    first = steps.close(c, inc, None, recovery, resumed, run_id="incident__1")
    run = first["triaged_again"]["run"]
    assert c.fleet.incident(inc).category == "crash"
    again = steps.close(c, inc, None, recovery, resumed, run_id="incident__1")  # the task's retry
    assert again["triaged_again"] == {"run": run, "started": again["triaged_again"]["started"],
                                      "by_an_earlier_try": True}
    assert [s["trigger_run_id"] for s in started] == [run, run]  # the same run asked for (a 409 if it landed)
    assert not [a for a in c.fleet.actions(inc) if a.kind == "launch"]
    assert c.fleet.incident(inc).state == IncidentState.OPEN
    # the run it handed the incident to is a run of its own: its close is not answered from the record
    escalated = steps.close_step(c, inc, None, recovery, resumed, run_id=run)
    assert escalated.state == "watching" and escalated.watch.attempt == 1, escalated  # (here: a job down)


def test_a_resume_check_that_ended_without_an_answer_is_asked_again_by_the_close_not_escalated(
        tmp_path, monkeypatch):
    """wait_for_resume can end without an answer (a deferred task failed by the scheduler, apache/airflow#66374,
    or its retries spent while a scheduler died): the close took that for a restart that did not hold and
    restarted the job a second time, though it trained. The close looks at the job itself first: one launch,
    resolved."""
    from trainguard.operators.tasks import incident as steps
    from trainguard.operators.tasks import rungs

    c, _fleet = fleet_controller(tmp_path)
    use_controller(monkeypatch, c)
    [item] = c.ingest([alert("gpu_lost", "m2")])
    inc = item["incident"]
    decision = steps.triage(c, inc)
    result = rungs.handle(c, steps.choose(decision), decision)
    recovery, _stop, _swap = recover(c, inc, result)
    assert recovery["restarted"]
    closed = steps.close(c, inc, None, recovery, None)  # no answer from the resume check's task
    assert closed["state"] == IncidentState.RESOLVED, closed
    assert len([a for a in c.fleet.actions(inc) if a.kind == "launch" and a.outcome == "done"]) == 1


def test_no_incident_closes_resolved_on_a_job_that_does_not_train(tmp_path, monkeypatch, started):
    """A decision that needed no restart (a network flap tolerated) closes resolved only once the job is seen
    training; a job found down instead climbs (a restart), and the close waits for its resume."""
    from trainguard.operators.tasks import incident as steps

    c, fleet = fleet_controller(tmp_path)
    use_controller(monkeypatch, c)
    [item] = c.ingest([alert("nic_errors", "m1")])
    inc = item["incident"]
    decision = steps.triage(c, inc)
    assert decision["action"] == "tolerate"
    idle = steps.no_recovery(c, decision)
    recovery = steps.restart_job(c, inc, [])
    resumed = steps.resumed(c, inc, recovery)
    fleet.running.pop("m3")  # the job ended on m3 behind the incident's back, with no alert of it
    step = steps.close_step(c, inc, idle, recovery, resumed)
    assert step.state == "watching", step  # not closed: restarted, its resume to be awaited
    assert c.fleet.incident(inc).state == IncidentState.OPEN
    assert "does not train" in step.watch.why and "m3" in step.watch.why
    assert len(fleet.running) == 4  # started again on every machine
    assert started == []  # no other category to re-triage to: the climb restarted it


# ---- transient control-plane faults ------------------------------------------------------------------------
def _task_controller(c: Controller, *, retry_s: float) -> Controller:
    """A controller as a task process makes it: the fleet database opened afresh (no migration), with the
    scripted machines."""
    return Controller(c.cfg, fleet=FleetStore(c.cfg.fleet_url, retry_s=retry_s), transport=c.transport,
                      inventory=c.inventory)


def _away(db: Path, *, for_s: float) -> threading.Thread:
    """The fleet database's file moved away now and back after ``for_s`` seconds (an outage of the database)."""
    aside = db.with_name("fleet.db.away")
    shutil.move(db, aside)
    back = threading.Timer(for_s, lambda: shutil.move(aside, db))
    back.start()
    return back


def test_a_fleet_database_away_for_seconds_is_waited_out_by_the_triage_and_the_close(tmp_path, monkeypatch):
    """The database goes away as a GPU fault's incident begins: its triage (a fresh task process opening the
    database) waits until it is back instead of failing the run, then evicts the machine; with no wait allowed
    the same triage fails with a one-line error naming the database."""
    from trainguard.operators.tasks import incident as steps

    c, fleet = fleet_controller(tmp_path)
    [item] = c.ingest([alert("gpu_lost", "m2")])
    inc = item["incident"]
    db = Path(c.cfg.fleet_url)
    # fail fast without retries: what the run saw before
    shutil.move(db, db.with_name("fleet.db.away"))
    try:
        with pytest.raises(FleetError, match="does not exist"):
            _task_controller(c, retry_s=0)
    finally:
        shutil.move(db.with_name("fleet.db.away"), db)
    back = _away(db, for_s=2.0)
    began = time.monotonic()
    decision = steps.triage(_task_controller(c, retry_s=60), inc)
    waited = time.monotonic() - began
    back.join()
    assert waited >= 1.5, waited
    assert decision["action"] == "evict" and decision["machines"] == ["m2"]
    # mid-task: a store already open meets the outage on its next call, and waits it out too
    store = FleetStore(c.cfg.fleet_url, retry_s=60)
    store.engine.dispose()  # the next call opens a new connection (as after a restart)
    back = _away(db, for_s=1.0)
    assert store.incident(inc).state == IncidentState.OPEN
    back.join()
    # bounded: a database that stays away fails with one line naming it
    quick = FleetStore(c.cfg.fleet_url, retry_s=0.5)
    quick.engine.dispose()
    shutil.move(db, db.with_name("fleet.db.away"))
    try:
        with pytest.raises(FleetUnavailable, match=r"did not answer for 0s.*TG_FLEET_URL"):
            quick.incident(inc)
    finally:
        shutil.move(db.with_name("fleet.db.away"), db)
    assert not db.with_name("fleet.db.away").exists() and fleet.running


def test_an_open_incident_whose_run_failed_is_driven_again_then_waits_for_a_human(tmp_path, monkeypatch):
    """A GPU fault's incident whose run failed (its triage met a database outage, no retry) stays open with no
    live run: the reconciler's pass finds it, starts a new run of it (which evicts the machine and closes it);
    an incident whose runs keep failing gets three new runs, then waits for a human, never left open."""
    from trainguard.operators.tasks import incident as steps
    from trainguard.operators.tasks import rungs

    c, _fleet = fleet_controller(tmp_path, reconcile_grace_s=0.0)
    use_controller(monkeypatch, c)
    [item] = c.ingest([alert("gpu_lost", "m2")])
    inc = item["incident"]
    memory: dict = {}
    # its run is live: nothing to do
    assert c.reconcile_pass(memory, live_runs=[f"incident__{inc}"]) == []
    # its run failed: the incident is open and no run of it is live
    [found] = c.reconcile_pass(memory, live_runs=["incident__999"])
    assert found.kind == "stuck_incident" and found.incident == inc
    out = c.reconcile_act([found])
    assert [s["trigger_run_id"] for s in out["starts"]] == [f"incident__{inc}__redrive1"]
    assert c.reconcile_act([found])["starts"] == []  # acting on the same finding again starts nothing more
    # the new run handles it: m2 is evicted, the job restarted on a standby, the incident resolved
    decision = steps.triage(c, inc)
    result = rungs.handle(c, steps.choose(decision), decision)
    recovery, _stop, swap = recover(c, inc, result)
    assert "m2" in swap["swaps"]
    resumed = next(r for r in (steps.resumed(c, inc, recovery) for _ in range(20)) if r is not None)
    steps.close(c, inc, None, recovery, resumed)
    assert c.fleet.incident(inc).state == IncidentState.RESOLVED
    assert c.reconcile_pass(memory, live_runs=[]) == []

    # an incident whose every run fails: three more runs, then a human
    [item] = c.ingest([alert("gpu_lost", "m1")])
    other = item["incident"]
    starts = []
    for _ in range(4):
        found = [f for f in c.reconcile_pass({}, live_runs=[]) if f.kind == "stuck_incident"]
        assert [f.incident for f in found] == [other]
        starts += c.reconcile_act(found)["starts"]
    assert [s["trigger_run_id"] for s in starts] == [f"incident__{other}__redrive{k}" for k in (1, 2, 3)]
    assert c.fleet.incident(other).state == IncidentState.WAITING_HUMAN
    assert "3 runs of it were started again" in c.fleet.incident(other).summary
    assert [f for f in c.reconcile_pass({}, live_runs=[]) if f.kind == "stuck_incident"] == []


def test_acting_twice_on_one_stuck_incident_starts_one_run(tmp_path):
    c, _fleet = fleet_controller(tmp_path, reconcile_grace_s=0.0)
    [item] = c.ingest([alert("gpu_lost", "m2")])
    [found] = c.reconcile_pass({}, live_runs=[])
    first = c.reconcile_act([found])
    again = c.reconcile_act([found])  # the act task retried with the same finding
    assert len(first["starts"]) == 1 and again["starts"] == []
    assert [a.kind for a in c.fleet.actions(item["incident"])].count("redrive") == 1


# ---- the reconciler's looks ----------------------------------------------------------------------------------
def test_a_job_down_behind_the_incidents_backs_is_an_incident_on_the_second_look(tmp_path, monkeypatch, started):
    """m3's part of the job ended and no alert said so: the first look remembers it, a second look
    ``confirm_s`` later with the same incarnations raises it (a crash incident through the ladder), and the same
    observation is never raised twice."""
    from trainguard.operators.tasks import reconcile as task

    c, fleet = fleet_controller(tmp_path, reconcile_confirm_s=0.0)
    use_controller(monkeypatch, c)
    memory: dict = {}
    assert c.reconcile_pass(memory, live_runs=[]) == []  # healthy
    fleet.running.pop("m3")
    assert c.reconcile_pass(memory, live_runs=[]) == []  # seen once: not yet
    [found] = c.reconcile_pass(memory, live_runs=[])
    assert found.kind == "job_down" and found.machines == ("m3",) and "m3 (exited)" in found.reason
    out = task.act(c, [found.dump()])
    [start] = started
    inc = start["conf"]["incident_id"]
    assert c.fleet.incident(inc).state == IncidentState.OPEN
    assert [a.kind for a in c.fleet.alerts_of(inc)] == ["job_down"]
    assert out["started"] == {start["trigger_run_id"]: "started"}
    assert c.triage(inc)["category"] == "crash"
    # while the incident is open the job is its: nothing found; acting on the same finding again adds nothing
    assert c.reconcile_pass(memory, live_runs=[start["trigger_run_id"]]) == []
    assert task.act(c, [found.dump()])["started"] == {}
    assert len(c.fleet.incidents("j")) == 1


def test_a_dead_job_behind_an_incident_that_waits_for_a_human_is_raised_once_after_each_wait(tmp_path, monkeypatch,
                                                                                            started):
    """The reconciler skipped every job with an incident waiting for a human: a job whose machines said "exited"
    for minutes stayed "running" in the fleet database and nothing restarted it. Now the dead job opens an
    incident of its own; if that one does not hold either, the reconciler leaves the job to the human."""
    c, fleet = fleet_controller(tmp_path, reconcile_confirm_s=0.0)
    use_controller(monkeypatch, c)
    [hang] = c.ingest([alert("rank_hang", "m3", rank=3)])
    c.fleet.wait_for_human(hang["incident"], "the breaker: raise TG_BREAKER_SHARE")
    assert c.fleet.job("j").state == "waiting_human"
    memory: dict = {}
    fleet.running.pop("m3")
    assert c.reconcile_pass(memory, live_runs=[]) == []  # seen once
    [found] = c.reconcile_pass(memory, live_runs=[])
    assert found.kind == "job_down" and found.machines == ("m3",)
    [start] = c.reconcile_act([found])["starts"]
    down = start["conf"]["incident_id"]
    assert down != hang["incident"] and c.fleet.incident(hang["incident"]).state == "waiting_human"
    c.close(down, outcome=IncidentState.FAILED, note="the restart did not hold")
    assert c.reconcile_pass(memory, live_runs=[]) == [] and c.reconcile_pass(memory, live_runs=[]) == []


def test_a_restart_between_two_looks_is_not_a_job_down(tmp_path):
    """A machine found down, then down again with another incarnation (it was started meanwhile, a code update
    in flight): the first look does not confirm the second."""
    memory = JobMemory()
    a = Look(ts=0.0, states={"m0": "running", "m1": "exited"}, incarnations={"m0": 1, "m1": 1}, step=10)
    b = Look(ts=30.0, states={"m0": "running", "m1": "exited"}, incarnations={"m0": 2, "m1": 2}, step=10)
    c = Look(ts=60.0, states={"m0": "running", "m1": "exited"}, incarnations={"m0": 2, "m1": 2}, step=10)
    assert policy.judge_look("j", a, memory, confirm_s=15, stall_s=300) == []
    assert policy.judge_look("j", b, memory, confirm_s=15, stall_s=300) == []
    [found] = policy.judge_look("j", c, memory, confirm_s=15, stall_s=300)
    assert found.kind == "job_down" and found.machines == ("m1",)
    # too soon after the first look: not confirmed
    memory = JobMemory()
    assert policy.judge_look("j", a, memory, confirm_s=15, stall_s=300) == []
    assert policy.judge_look("j", Look(ts=5.0, states=a.states, incarnations=a.incarnations, step=10), memory,
                             confirm_s=15, stall_s=300) == []


def test_a_stall_is_found_after_stall_s_unless_a_rank_holds_still(tmp_path):
    memory = JobMemory()
    run = {"m0": "running", "m1": "running"}
    for ts in (0.0, 100.0, 200.0):
        assert policy.judge_look("j", Look(ts=ts, states=run, step=50), memory, confirm_s=15, stall_s=300) == []
    # a rank holds still on purpose (the NaN guard waits for the control plane): not a stall
    held = Look(ts=400.0, states=run, step=50, held=(1,))
    assert policy.judge_look("j", held, memory, confirm_s=15, stall_s=300) == []
    [found] = policy.judge_look("j", Look(ts=401.0, states=run, step=50), memory, confirm_s=15, stall_s=300)
    assert found.kind == "job_stalled" and "no step past 50 for 401s" in found.reason
    # the step moves: the clock starts again
    assert policy.judge_look("j", Look(ts=500.0, states=run, step=51), memory, confirm_s=15, stall_s=300) == []
    assert policy.judge_look("j", Look(ts=700.0, states=run, step=51), memory, confirm_s=15, stall_s=300) == []
    # a look from status documents: the lowest step, the ranks held
    look = Look.of({"m0": {"state": "running", "incarnation": 3, "ranks": [{"rank": 0, "step": 7}]},
                    "m1": {"state": "running", "incarnation": 3, "ranks": [{"rank": 1, "step": 6, "status": "held"}]},
                    "m2": {"error": "ssh: No route to host"}}, 5.0)
    assert look.step == 6 and look.held == (1,) and look.down() == [] and look.states["m2"].startswith("unreadable")


def test_an_explicit_fault_left_on_a_machine_of_the_job_is_raised_again_once(tmp_path, monkeypatch, started):
    """A lost GPU on m2 recorded in an incident that closed without evicting it (absorbed): the reconciler raises
    it again as an incident of its own, once, and the ladder evicts m2. The same fault on a machine that was
    evicted and came back later to the job is not raised."""
    from trainguard.operators.tasks import incident as steps
    from trainguard.operators.tasks import reconcile as task
    from trainguard.operators.tasks import rungs

    c, _fleet = fleet_controller(tmp_path)
    use_controller(monkeypatch, c)
    [item] = c.ingest([alert("nic_errors", "m1")])
    c.ingest([alert("gpu_lost", "m2")])  # joins the network incident
    c.close(item["incident"], outcome=IncidentState.RESOLVED, note="closed by hand without acting")
    [found] = c.reconcile_pass({}, live_runs=[])
    assert found.kind == "unhandled_fault" and found.machines == ("m2",) and "gpu_lost" in found.reason
    task.act(c, [found.dump()])
    [start] = started
    inc = start["conf"]["incident_id"]
    decision = steps.triage(c, inc)
    assert decision["category"] == "machine_fault" and decision["machines"] == ["m2"]
    result = rungs.handle(c, steps.choose(decision), decision)
    _recovery, _stop, swap = recover(c, inc, result)
    assert "m2" in swap["swaps"]
    assert "m2" not in c.fleet.job("j").machine_list
    assert [f for f in c.reconcile_pass({}, live_runs=[start["trigger_run_id"]]) if f.kind == "unhandled_fault"] == []


def test_a_silent_agent_no_incident_handles_is_raised(tmp_path):
    c, _fleet = fleet_controller(tmp_path)
    now = time.time()
    [found] = c.reconcile_pass({}, live_runs=[], silent={"m1": now - 40, "m9": now - 40}, now=now)
    assert found.kind == "agent_silent" and found.machines == ("m1",)
    out = c.reconcile_act([found])
    [start] = out["starts"]
    assert c.triage(start["conf"]["incident_id"])["category"] == "agent"
    # raised once: the same silence is not raised again
    assert c.reconcile_pass({}, live_runs=[start["trigger_run_id"]], silent={"m1": now - 40}, now=now) == []


def test_findings_travel_as_json():
    f = Finding("j", "job_down", ("m1",), "why", None, {"states": {"m1": "exited"}})
    assert Finding.read(f.dump()) == f


def test_status_says_when_the_reconciler_has_not_looked(tmp_path):
    """The reconciler's watcher writes its beat into its asset's state store in Airflow (read through the REST
    API: ``beats``); without them the watchers' liveness is not judged."""
    from trainguard.operators import status

    c, _fleet = fleet_controller(tmp_path)
    now = time.time()
    doc = status.collect(c.fleet, silent_s=15.0, now=now, beats={"guardian": {"ts": now}, "reconciler": None})
    assert any("the reconciler has never looked" in p for p in doc["problems"])
    beats = {"guardian": {"ts": now}, "reconciler": {"ts": now, "passes": 3, "period_s": 10.0}}
    doc = status.collect(c.fleet, silent_s=15.0, now=now + 1, beats=beats)
    assert not any("reconciler" in p for p in doc["problems"])
    assert "reconciler looked" in status.render(doc)
    doc = status.collect(c.fleet, silent_s=15.0, now=now + 45, beats=beats)
    assert any("the reconciler last looked at the jobs 4" in p for p in doc["problems"])
    assert not any("reconciler" in p for p in status.collect(c.fleet, silent_s=15.0, now=now + 45, beats=beats,
                                                              reconcile_period_s=0)["problems"])
    # Airflow not asked (no URL): nothing judged of the watchers, however old the tasks' records
    assert not any("reconciler" in p or "watcher" in p
                   for p in status.collect(c.fleet, silent_s=15.0, now=now + 4500)["problems"])


# ---- fall-through at the speed of a probe ---------------------------------------------------------------------
def test_a_gpu_fault_that_joins_after_the_swap_of_an_evict_now_incident_is_evicted_in_the_same_restart(
        tmp_path, monkeypatch):
    """The first rung is already evict_now (a full disk on m1); a GPU lost on m2 joins after swap_machines ran
    and before the restart: m2 is evicted too before the launch, so the job is started once, on two standbys,
    and the resume check finds nothing pending (no second restart)."""
    from trainguard.operators.tasks import incident as steps
    from trainguard.operators.tasks import rungs

    c, _fleet = fleet_controller(tmp_path, machines=7, breaker_share=0.75)
    use_controller(monkeypatch, c)
    [item] = c.ingest([alert("disk_full", "m1")])
    inc = item["incident"]
    decision = steps.triage(c, inc)
    assert steps.choose(decision) == "evict_now"
    result = rungs.handle(c, "evict_now", decision)
    stop = steps.stop_job(c, inc, [result])
    swap = steps.swap_machines(c, inc, [result], stop)
    assert set(swap["swaps"]) == {"m1"}
    c.ingest([alert("gpu_lost", "m2")])  # joins now, before restart_job
    recovery = steps.restart_job(c, inc, [result], stop, swap)
    assert recovery["restarted"] and set(recovery["swap"]["swaps"]) == {"m1", "m2"}, recovery
    assert not {"m1", "m2"} & set(c.fleet.job("j").machine_list)
    resumed = next(r for r in (steps.resumed(c, inc, recovery) for _ in range(20)) if r is not None)
    assert not resumed.get("pending") and not resumed.get("failed"), resumed
    steps.close(c, inc, None, recovery, resumed)
    assert c.fleet.incident(inc).state == IncidentState.RESOLVED
    assert len([a for a in c.fleet.actions(inc) if a.kind == "launch"]) == 1  # one restart


# ---- fail-slow precision ------------------------------------------------------------------------------------
def _decline(rank: int, ratio: float | None) -> dict:
    extra = {} if ratio is None else {"compute_ratio": ratio}
    return alert("throughput_decline", f"m{rank // 2}", rank=rank, decline=0.2, **extra)


def test_a_slowdown_every_rank_shares_is_no_straggler_and_opens_no_incident(tmp_path):
    """A busy host slows every rank's compute alike: the batch of declines is recorded with why, and no incident
    (no vote) opens. One rank whose compute grew 1.3x while its peers' did not still opens the fail-slow
    incident; so does a batch from too few ranks, or one without the compute evidence (the vote decides)."""
    from trainguard.operators.policy import ladder

    load = [_decline(r, x) for r, x in enumerate((1.42, 1.55, 1.38, 1.61))]
    assert "load or data, not a straggler" in ladder.shared_slowdown(load, ranks=4, factor=1.25)
    straggler = [_decline(r, x) for r, x in enumerate((1.31, 1.02, 0.99, 1.01))]
    assert ladder.shared_slowdown(straggler, ranks=4, factor=1.25) == ""
    assert ladder.shared_slowdown(load[:1], ranks=4, factor=1.25) == ""  # one rank of four: not enough to judge
    assert ladder.shared_slowdown([_decline(r, None) for r in range(4)], ranks=4, factor=1.25) == ""
    assert ladder.shared_slowdown([*load, alert("rank_exit", "m0", rank=0)], ranks=4, factor=1.25) == ""

    c, fleet = fleet_controller(tmp_path)  # 4 ranks (TP=1 PP=2 DP=2), slow factor 1.25
    fleet.compute[0] = 0.9  # rank 0 does compute slower now: the look before an incident confirms its alerts
    assert c.ingest(load) == []
    recorded = c.fleet.alerts_on(["m0", "m1"], kinds={"throughput_decline"})
    assert len(recorded) == 4 and all(a.incident_id is None for a in recorded)
    assert "not a straggler" in recorded[0].document["shared_slowdown"]
    assert c.fleet.incidents("j") == []
    [item] = c.ingest(straggler)
    assert item["opened"] and c.triage(item["incident"])["action"] == "vote"
    # with an incident open, a shared slowdown's alerts join it as before
    again = [_decline(r, x) for r, x in enumerate((1.5, 1.5, 1.5, 1.5))]
    assert [i["incident"] for i in c.ingest(again)] == [item["incident"]]


def test_a_fail_slow_alert_no_rank_s_recent_compute_confirms_opens_no_incident(tmp_path):
    """On a healthy third-party job (10-30 ms steps, its own evaluation, 2 shared cores) a rank's few slow steps
    opened 15 fail-slow incidents in 33 minutes. An alert is the rank's word about its last steps; the look at
    every rank's compute over its last seconds decides whether an incident opens."""
    c, fleet = fleet_controller(tmp_path)
    lone = [alert("rank_slow", "m1", rank=1, compute_ratio=2.6)]  # one rank: no quorum to call it shared
    assert c.ingest(lone) == [] and c.fleet.incidents("j") == []
    [recorded] = c.fleet.alerts_on(["m1"], kinds={"rank_slow"})
    assert recorded.incident_id is None and recorded.document["shared_slowdown"].startswith("not confirmed")
    fleet.compute[1] = 0.6  # now rank 1 does compute 1.7x its stage's: the same claim opens the incident
    [item] = c.ingest([alert("rank_slow", "m1", rank=1, compute_ratio=2.6, ts=time.time() + 1)])
    assert item["opened"] and c.triage(item["incident"])["action"] == "vote"


def test_a_straggler_whose_history_learned_its_slowdown_still_stands_out_against_its_stage_now():
    """Measured on the busy 2-core host (2x2x2, the batch of 8 declines of the 30% slow rank): every rank's
    compute growth read 0.92x-1.13x, because rank 2's slowed compute (0.477 s) had become its own normal, and
    the batch was recorded as a shared slowdown; the slow rank was never voted out. Against its stage's ranks
    now (about 0.26 s) it stands out, and the batch goes to the vote."""
    from trainguard.core.topology import Topology
    from trainguard.operators.policy import ladder

    measured = {0: (0.9712, 0.259978), 1: (1.0156, 0.276517), 2: (0.9853, 0.476602), 3: (1.1339, 0.309698),
                4: (1.039, 0.273664), 5: (0.974, 0.260955), 6: (0.9249, 0.257208), 7: (0.955, 0.254151)}
    batch = [alert("throughput_decline", f"m{r // 2}", rank=r, decline=0.16, compute_ratio=ratio,
                   recent_compute_s=recent) for r, (ratio, recent) in measured.items()]
    topo = Topology(tp=2, pp=2, dp=2)
    assert ladder.shared_slowdown(batch, ranks=8, factor=1.25, topology=topo) == ""
    assert ladder.shared_slowdown(batch, ranks=8, factor=1.25) == ""  # against the whole batch, too
    evened = [alert("throughput_decline", f"m{r // 2}", rank=r, decline=0.16, compute_ratio=ratio,
                    recent_compute_s=0.27 if r == 2 else recent) for r, (ratio, recent) in measured.items()]
    assert "not a straggler" in ladder.shared_slowdown(evened, ranks=8, factor=1.25, topology=topo)


def test_a_job_with_steps_longer_than_the_closes_wait_is_training_while_its_ranks_make_progress(tmp_path,
                                                                                               monkeypatch):
    """A real job's step may take minutes: no step within the close's 15 s wait is not a dead job while every
    machine runs it and every rank's heartbeat shows progress (a collective completed); a rank without progress
    for longer than TG_RECONCILE_STALL_S is."""
    c, fleet = fleet_controller(tmp_path, reconcile_stall_s=300.0)
    monkeypatch.setattr(c.jobs, "trains", lambda job, **kw: False)  # no step within the wait: steps are long
    fleet.progress_age = 40.0
    assert c.not_training("j") == ""
    fleet.progress_age = 900.0
    assert c.not_training("j") == "no step within 15s and no progress for 900s"
    fleet.running.pop("m1")
    assert c.not_training("j") == "not running on m1 (exited)"


def test_what_the_reconciler_leaves_alone(tmp_path, monkeypatch):
    """An incident opened by hand (a replay's, a diagnosis's: its own DAG watches it) is not driven again; a run
    of an incident triggered by hand (its own run id, the incident in its conf) counts as live; a job whose part
    ended with code 0 everywhere has finished, not died; a launch that died with its task years ago does not
    hide the job; the reconciler's own copy of a fault is not raised again when its incident closes without
    an eviction (dry run, a human's call)."""
    from trainguard.operators.tasks import common

    c, fleet = fleet_controller(tmp_path, reconcile_grace_s=0.0, reconcile_confirm_s=0.0)
    manual = common.incident_by_hand(c, "j", "dual-phase replay by hand")
    assert c.reconcile_pass({}, live_runs=[]) == []
    c.close(manual, outcome=IncidentState.RESOLVED)
    [item] = c.ingest([alert("gpu_lost", "m2")])
    assert c.reconcile_pass({}, live_runs=["manual__2026-11-28T10:00:00", f"conf:{item['incident']}"]) == []
    c.close(item["incident"], outcome=IncidentState.RESOLVED, note="a human kept m2")
    # the fault left on m2 is raised once; its copy's incident closing without an eviction raises nothing more
    [found] = [f for f in c.reconcile_pass({}, live_runs=[]) if f.kind == "unhandled_fault"]
    [start] = c.reconcile_act([found])["starts"]
    c.close(start["conf"]["incident_id"], outcome=IncidentState.FAILED, note="not evicted (dry run)")
    assert [f for f in c.reconcile_pass({}, live_runs=[]) if f.kind == "unhandled_fault"] == []
    # finished everywhere (code 0): nothing to bring back, and the close's check calls it not a failure either
    fleet.running.clear()
    monkeypatch.setattr(fleet, "_status", lambda name: {"job": "j", "machine": name, "state": "exited",
                                                       "incarnation": 0, "returncode": 0, "ranks": []})
    memory: dict = {}
    assert c.reconcile_pass(memory, live_runs=[]) == [] and c.reconcile_pass(memory, live_runs=[]) == []
    assert c.not_training("j") == ""
    # a launch action left unfinished long ago (its task was killed) hides nothing
    a, _ = c.fleet.record_action("launch:j:stale:m0", kind="launch", machines=["m0"])
    monkeypatch.undo()
    with c.fleet.tx() as s:
        s.get(type(a), a.id).started_ts = time.time() - 7200
    memory = {}
    assert c.reconcile_pass(memory, live_runs=[]) == []
    assert [f.kind for f in c.reconcile_pass(memory, live_runs=[])] == ["job_down"]


def test_a_wrong_statement_is_not_an_outage():
    """Only the database's unavailability is waited for: a statement the database refuses fails at once."""
    import sqlalchemy as sa

    from trainguard.operators.fleet.store import transient

    locked = sa.exc.OperationalError("BEGIN", {}, __import__("sqlite3").OperationalError("database is locked"))
    assert transient(locked)
    assert not transient(sa.exc.OperationalError("SELECT", {}, __import__("sqlite3").OperationalError(
        "no such column: nosuch")))


def test_a_rank_held_by_the_nan_guard_with_no_incident_handling_it_is_found_on_the_second_look():
    """The NaN guard holds still and waits for the control plane; when no incident handles the job (the NaN's
    alerts joined an incident that closed), the wait would last for ever: two looks confirm_s apart report it."""
    memory = JobMemory()
    run = {"m0": "running", "m1": "running"}
    assert policy.judge_look("j", Look(ts=0.0, states=run, step=38), memory, confirm_s=15, stall_s=300) == []
    held = (0, 1)
    assert policy.judge_look("j", Look(ts=10.0, states=run, step=38, held=held), memory, confirm_s=15,
                             stall_s=300) == []
    assert policy.judge_look("j", Look(ts=20.0, states=run, step=38, held=held), memory, confirm_s=15,
                             stall_s=300) == []  # 10 s: not yet
    [found] = policy.judge_look("j", Look(ts=26.0, states=run, step=38, held=held, incarnations={"m0": 2}), memory,
                                confirm_s=15, stall_s=300)
    assert found.kind == "job_held" and found.machines == ("m0", "m1") and "hold still at step 38" in found.reason
    assert found.evidence["held"] == [0, 1]
    # a hold that ends (the job was restarted) clears it; a new hold needs two looks again
    assert policy.judge_look("j", Look(ts=30.0, states=run, step=39), memory, confirm_s=15, stall_s=300) == []
    assert policy.judge_look("j", Look(ts=50.0, states=run, step=40, held=(1,)), memory, confirm_s=15,
                             stall_s=300) == []
    # the alert it raises is a NaN's for the ladder, and the same observation raises the same alert once
    from trainguard.operators.control.reconcile import ALERT_KIND, finding_alert_id
    from trainguard.operators.policy import ladder

    assert ladder.triage("j", [{"kind": ALERT_KIND["job_held"], "machine": "m0", "job": "j", "ts": 26.0,
                                "severity": "fault"}]).category == "nan"
    assert finding_alert_id(found) == finding_alert_id(policy.Finding.read(found.dump()))


def test_a_nan_that_comes_back_after_the_restart_is_handed_to_a_new_incident_a_level_up(tmp_path, monkeypatch):
    """A machine that keeps making NaN: the first incident restores the last finite step and restarts; the
    NaN comes back at the next step and its alerts join that incident before it closes. Before, the incident
    closed "resumed" over them and the job held still for ever; now they open a new incident a level up (its
    run started), which the ladder handles as a repeat."""
    from trainguard.operators.tasks import incident as steps

    c, _fleet = fleet_controller(tmp_path)
    out = run_incident(c, [alert("nan_loss", f"m{r}", rank=r) for r in range(4)], monkeypatch,
                       joined_late=[alert("nan_loss", f"m{r}", rank=r, ts=time.time() + 1) for r in range(4)])
    first = c.fleet.incident(out["incident"])
    assert first.state == "resolved" and "the failure came back after the restart" in first.summary, first.summary
    [new] = [i for i in c.fleet.incidents("j") if i.id != first.id]
    assert new.state == "open" and new.level == first.level + 1
    assert len(c.fleet.alerts_of(first.id)) == 4 and len(c.fleet.alerts_of(new.id)) == 4  # moved, not copied
    assert out["closed"]["handed_on"]["incident"] == new.id
    decision = steps.triage(c, new.id)
    assert decision["action"] in ("rollback", "replay"), decision  # the ladder's level 1 for a NaN
    # closing again (a retry of close_incident) moves nothing more and opens nothing more
    steps.close(c, first.id, None, out["result"]["recovery"], out["resumed"])
    assert len(c.fleet.incidents("j")) == 2


def test_a_clean_restart_hands_nothing_on(tmp_path, monkeypatch):
    c, _fleet = fleet_controller(tmp_path)
    out = run_incident(c, [alert("nan_loss", f"m{r}", rank=r) for r in range(4)], monkeypatch)
    assert c.fleet.incident(out["incident"]).state == "resolved" and len(c.fleet.incidents("j")) == 1
    assert "handed_on" not in out["closed"]


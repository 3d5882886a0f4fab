"""The tasks of tg_incident one by one, on the scripted fleet of :mod:`tests.fakes`: what each hands the
next through XCom (typed, validated), ``stop_job``, ``swap_machines`` and ``restart_job`` safe to clear,
``wait_for_resume`` deferred."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from pydantic import ValidationError

from tests.fakes import alert, fleet_controller, recover, replicated_copies, run_incident, use_controller
from trainguard.operators.models import IncidentDecision, Restart, Resume, RungResult
from trainguard.operators.policy import ladder, rungs


def test_a_closed_incident_whose_restart_job_runs_again_restarts_the_job_and_closes_once_more(tmp_path, monkeypatch):
    from trainguard.operators.tasks import incident as steps

    c, fleet = fleet_controller(tmp_path)
    out = run_incident(c, [alert("gpu_lost", "m1")], monkeypatch)
    inc = out["incident"]
    assert out["closed"]["state"] == "resolved"
    starts = len(fleet.sent("job", "start")) + len(fleet.sent("standby", "activate"))
    ettr_before = sorted((e.kind, e.start_ts) for e in c.fleet.ettr_events("j"))
    # the operator clears restart_job (and what follows it) of the finished run: the same XCom input again
    again = steps.restart_job(c, inc, [out["result"]], out["result"]["stop"], out["result"]["swap"])
    assert again["restarted"] and again["again"] and c.fleet.incident(inc).state == "open"
    assert len(fleet.sent("job", "start")) + len(fleet.sent("standby", "activate")) == starts + 4  # all restarted
    assert c.fleet.job("j").machine_list == ["m0", "m4", "m2", "m3"]  # on the machines it runs on: no eviction
    resumed = steps.resumed(c, inc, again)
    assert Resume.read(resumed).resumed
    closed = steps.close(c, inc, None, again, resumed)
    assert closed["state"] == "resolved" and "restarted again" in c.fleet.incident(inc).summary
    launches = [a for a in c.fleet.actions(inc) if a.kind == "launch"]
    assert len(launches) == 2 and all(a.outcome == "done" for a in launches)
    ettr_after = sorted((e.kind, e.start_ts) for e in c.fleet.ettr_events("j"))
    # detection and diagnosis are counted once; the second restart's recovery is a stretch of its own
    assert [k for k, _ in ettr_after].count("detection") == [k for k, _ in ettr_before].count("detection") == 1
    assert [k for k, _ in ettr_after].count("recovery") == 2 and set(ettr_before) <= set(ettr_after)


def test_a_restart_job_run_again_while_another_incident_of_the_job_is_open_refuses_and_changes_nothing(
        tmp_path, monkeypatch):
    from trainguard.core.errors import TrainguardError
    from trainguard.operators.tasks import incident as steps

    c, fleet = fleet_controller(tmp_path)
    first = run_incident(c, [alert("gpu_lost", "m1")], monkeypatch)
    [second] = c.ingest([alert("gpu_lost", "m2")])
    starts = len(fleet.sent("job", "start"))
    with pytest.raises(TrainguardError, match=f"incident {second['incident']} of job j is open"):
        steps.restart_job(c, first["incident"], [first["result"]], first["result"]["stop"], first["result"]["swap"])
    assert len(fleet.sent("job", "start")) == starts and c.fleet.incident(first["incident"]).state == "resolved"


def test_stop_swap_and_restart_are_tasks_of_their_own_each_from_the_xcom_of_the_one_before(tmp_path, monkeypatch):
    """The rung decides (no stop, no eviction of its own); stop_job stops the job and hands on what it found
    (machines, steps, checkpoint copies); swap_machines evicts from that with no round of reads; restart_job
    starts the job from it with no round of reads either."""
    from trainguard.operators.models import Stop, Swap
    from trainguard.operators.tasks import incident as steps
    from trainguard.operators.tasks import rungs

    c, fleet = fleet_controller(tmp_path)
    use_controller(monkeypatch, c)
    fleet.copies = replicated_copies(fleet.topo, ["m0", "m1", "m2", "m3"], [9])
    [item] = c.ingest([alert("gpu_lost", "m1")])
    result = RungResult.read(rungs.handle(c, "evict_now", steps.triage(c, item["incident"])))
    assert result.restart and result.evict.machines == ["m1"] and result.stopped is None
    assert fleet.sent("job", "stop") == [] and c.fleet.job("j").machine_list == ["m0", "m1", "m2", "m3"]
    results = [None, result.dump(), None]  # the skipped rungs give None
    stop = Stop.read(steps.stop_job(c, item["incident"], results))
    assert stop.stopped and stop.found.machines == ["m0", "m1", "m2", "m3"]
    assert stop.found.copies == {m: [tuple(x) for x in held] for m, held in fleet.copies.items()}
    fleet.commands.clear()
    swap = Swap.read(steps.swap_machines(c, item["incident"], results, stop.dump()))
    assert swap.swaps == {"m1": "m4"} and c.fleet.job("j").machine_list == ["m0", "m4", "m2", "m3"]
    assert not fleet.sent("ckpt", "list")  # the copies came with the stop
    # cleared and run again: the eviction is not done twice
    assert Swap.read(steps.swap_machines(c, item["incident"], results, stop.dump())).swaps == {"m1": "m4"}
    assert len([a for a in c.fleet.actions(item["incident"]) if a.kind == "evict"]) == 1
    fleet.commands.clear()
    recovery = steps.restart_job(c, item["incident"], results, stop.dump(), swap.dump())
    assert Restart.read(recovery).steps_before == stop.found.step
    assert fleet.commands and {tuple(cmd[:2]) for _m, cmd in fleet.commands} <= {("job", "start"),
                                                                                 ("standby", "activate")}
    # stop_job cleared after the restart: it stops the job again (the tasks after it start it again)
    again = Stop.read(steps.stop_job(c, item["incident"], results))
    assert again.stopped and not again.by_rung and set(fleet.sent("job", "stop")) == {"m0", "m4", "m2", "m3"}


def test_stop_job_leaves_a_job_alone_that_the_rung_leaves_alone_unless_an_explicit_fault_joined(tmp_path,
                                                                                                monkeypatch):
    from trainguard.operators.models import Stop
    from trainguard.operators.tasks import incident as steps
    from trainguard.operators.tasks import rungs

    c, fleet = fleet_controller(tmp_path)
    use_controller(monkeypatch, c)
    [item] = c.ingest([alert("rank_stopped", "m1", rank=1)])
    result = rungs.handle(c, steps.choose(steps.triage(c, item["incident"])), steps.triage(c, item["incident"]))
    assert result["restart"] is False  # the stacks refute the claim: the job trains on
    assert Stop.read(steps.stop_job(c, item["incident"], [result])).skipped and fleet.sent("job", "stop") == []
    c.ingest([alert("gpu_lost", "m2")])  # joins the open incident
    assert Stop.read(steps.stop_job(c, item["incident"], [result])).stopped and fleet.sent("job", "stop")


def test_a_rung_that_leaves_the_job_alone_is_not_restarted_and_its_result_reaches_close(tmp_path, monkeypatch):

    c, fleet = fleet_controller(tmp_path)  # the stacks refute the alert and the job trains: nothing to do
    out = run_incident(c, [alert("rank_stopped", "m1", rank=1)], monkeypatch)
    assert out["result"]["restart"] is False and out["result"]["recovery"]["restarted"] is False
    assert out["result"]["recovery"]["resolved"] == out["result"]["resolved"]  # the rung's word reaches close
    assert out["resumed"] == {"skipped": True} and fleet.sent("job", "start") == []
    assert out["closed"]["state"] == "resolved" and "seen running" in c.fleet.incident(out["incident"]).summary


def test_payloads_are_validated_when_read_and_name_what_is_wrong():
    good = {"incident": 3, "job": "my_job", "level": 0, "category": "machine_fault", "machines": ["m1"],
            "action": "evict", "reason": "anything at all"}
    d = IncidentDecision.read(good)
    assert d.action is ladder.Action.EVICT and d.category is ladder.Category.MACHINE_FAULT
    assert d.dump()["action"] == "evict"  # plain JSON for XCom
    with pytest.raises(ValidationError, match="action"):
        IncidentDecision.read({**good, "action": "evict_everything"})
    with pytest.raises(ValidationError, match="incident"):
        IncidentDecision.read({k: v for k, v in good.items() if k != "incident"})
    with pytest.raises(ValidationError, match="restart_ts"):
        Restart.read({"restarted": True, "restart_ts": "soon"})
    with pytest.raises(ValueError, match="nonsense"):
        ladder.Decision("nonsense")


def test_every_rung_of_the_registry_has_a_branch_and_anything_else_goes_to_no_recovery():
    for r in rungs.RUNGS:
        assert rungs.branch(r.action) == r.task_id == rungs.branch(r.action.value)
    for action in ("tolerate", "observe", "wait_human"):
        assert rungs.branch(action) == rungs.NO_RECOVERY
    assert len(set(rungs.TASK_IDS)) == len(rungs.RUNGS)


def test_the_resume_sensor_defers_at_once_and_holds_no_worker_while_it_waits():
    from airflow.sdk.exceptions import TaskDeferred

    from trainguard.operators.sensors.resume import ResumeSensor
    from trainguard.operators.triggers.resume import ResumeTrigger

    sensor = ResumeSensor(task_id="wait_for_resume", incident_id="7",
                          recovery={"restarted": True, "job": "j", "restart_ts": 100.0, "steps_before": 5})
    with pytest.raises(TaskDeferred) as deferred:
        sensor.execute({})
    trigger = deferred.value.trigger
    assert isinstance(trigger, ResumeTrigger) and deferred.value.method_name == "execute_complete"
    path, kwargs = trigger.serialize()
    assert path == "trainguard.operators.triggers.resume.ResumeTrigger" and kwargs["incident_id"] == 7
    assert ResumeTrigger(**kwargs).recovery["restart_ts"] == 100.0  # the triggerer rebuilds it from JSON
    # nothing restarted: nothing to wait for
    assert ResumeSensor(task_id="w", incident_id=7, recovery={"restarted": False}).execute({}) == {"skipped": True}
    done = sensor.execute_complete({}, {"first_step": 6, "restored_step": 5, "ts": 101.0, "checks": 3})
    assert done == {"first_step": 6, "restored_step": 5, "ts": 101.0}


def test_the_resume_trigger_asks_until_every_rank_trained_past_the_restart_then_fires_once(tmp_path, monkeypatch):
    from trainguard.operators.tasks import incident as steps
    from trainguard.operators.tasks import rungs
    from trainguard.operators.triggers.resume import ResumeTrigger

    c, _fleet = fleet_controller(tmp_path)
    use_controller(monkeypatch, c)
    [item] = c.ingest([alert("gpu_lost", "m1")])
    decision = steps.triage(c, item["incident"])
    recovery, _stop, _swap = recover(c, item["incident"], rungs.handle(c, "evict_now", decision))
    answers = []
    real = steps.resumed

    def resumed(*args):  # the first two checks find no step after the restart yet
        answers.append(None if len(answers) < 2 else real(*args))
        return answers[-1]

    monkeypatch.setattr(steps, "resumed", resumed)

    async def first_event():
        async for event in ResumeTrigger(item["incident"], recovery, poll_s=0.01).run():
            return event.payload

    payload = asyncio.run(first_event())
    assert len(answers) == 3 and payload["checks"] == 3 and Resume.read(
        {k: v for k, v in payload.items() if k != "checks"}).resumed


def test_the_code_updates_resume_wait_defers_and_fires_once_every_restarted_job_answered(tmp_path, monkeypatch):
    """tg_code_update's training_resumed holds no worker: it defers to a trigger that asks every poll whether
    each job the update restarted trained again (or ended), and fires once with the answers."""
    from airflow.sdk.exceptions import TaskDeferred

    from trainguard.operators.sensors.resume import CodeResumeSensor
    from trainguard.operators.tasks import code_update
    from trainguard.operators.triggers.resume import CodeResumeTrigger

    update = {"restarts": [{"job": "j", "restart_ts": 100.0}]}
    sensor = CodeResumeSensor(task_id="training_resumed", update=update)
    with pytest.raises(TaskDeferred) as deferred:
        sensor.execute({})
    trigger = deferred.value.trigger
    assert isinstance(trigger, CodeResumeTrigger) and deferred.value.method_name == "execute_complete"
    path, kwargs = trigger.serialize()
    assert path == "trainguard.operators.triggers.resume.CodeResumeTrigger"
    assert deferred.value.timeout is not None and deferred.value.timeout.total_seconds() == 600
    # a lazy update or the sweep restarted nothing: nothing to wait for
    assert CodeResumeSensor(task_id="w", update={"restarts": []}).execute({}) == {"resumed": {}, "ended": {}}

    c, _fleet = fleet_controller(tmp_path)
    use_controller(monkeypatch, c)
    answers: list = []

    def resumed(ctl, upd):  # the first two checks: the job has not trained since its restart
        assert ctl is c and upd == update  # the triggerer's shared controller, the update rebuilt from JSON
        answers.append(None if len(answers) < 2 else {"resumed": {"j": {"first_step": 6}}, "ended": {}})
        return answers[-1]

    monkeypatch.setattr(code_update, "code_resumed", resumed)

    async def first_event():
        async for event in CodeResumeTrigger(**{**kwargs, "poll_s": 0.01}).run():
            return event.payload

    payload = asyncio.run(first_event())
    assert len(answers) == 3 and payload["checks"] == 3
    assert sensor.execute_complete({}, payload) == {"resumed": {"j": {"first_step": 6}}, "ended": {}}


def test_a_restart_job_run_again_while_its_incident_waits_for_a_human_restarts_and_reopens_it(tmp_path, monkeypatch):
    from trainguard.operators.tasks import incident as steps

    c, fleet = fleet_controller(tmp_path)
    out = run_incident(c, [alert("gpu_lost", "m1")], monkeypatch)
    c.wait_for_human(out["incident"], "the operator looked at it")  # say a later check sent it to a human
    starts = len(fleet.sent("job", "start")) + len(fleet.sent("standby", "activate"))
    again = steps.restart_job(c, out["incident"], [out["result"]], out["result"]["stop"], out["result"]["swap"])
    assert again["again"] and c.fleet.incident(out["incident"]).state == "open"
    assert len(fleet.sent("job", "start")) + len(fleet.sent("standby", "activate")) == starts + 4
    closed = steps.close(c, out["incident"], None, again, steps.resumed(c, out["incident"], again))
    assert closed["state"] == "resolved" and c.fleet.job("j").state == "running"


def test_a_runs_own_resume_limit_overrides_the_setting_and_is_checked(tmp_path, monkeypatch):
    """The ``resume_timeout_s`` Param of a tg_incident run (an operator's override for a job that takes
    long to load) travels in restart_job's XCom to the resume check; without it the setting holds."""
    import time

    from trainguard.operators.tasks import incident as steps
    from trainguard.operators.tasks import rungs

    c, _fleet = fleet_controller(tmp_path)
    use_controller(monkeypatch, c)
    [item] = c.ingest([alert("gpu_lost", "m1")])
    inc = item["incident"]
    result = rungs.handle(c, "evict_now", steps.triage(c, inc))
    recovery, stop, swap = recover(c, inc, result, resume_timeout_s=30)
    assert recovery["resume_timeout_s"] == 30 and c.cfg.resume_timeout_s > 60
    monkeypatch.setattr(c.jobs, "resumed", lambda *_: None)  # no rank trained since the restart
    ago = {**recovery, "restart_ts": time.time() - 60}  # ... for a minute
    assert steps.resumed(c, inc, ago) == {"failed": "training did not pass the restored step within 30s of the "
                                                 "restart"}
    assert steps.resumed(c, inc, {**ago, "resume_timeout_s": None}) is None  # the setting's limit: keep waiting
    # cleared and run again, the run's limit still holds; a limit that is not a positive number is refused
    assert steps.restart_job(c, inc, [result], stop, swap, resume_timeout_s=45)["resume_timeout_s"] == 45
    with pytest.raises(ValidationError, match="resume_timeout_s"):
        Restart.read({**recovery, "resume_timeout_s": 0})


def test_the_slow_vote_defers_its_rounds_to_the_triggerer_then_decides_from_them(tmp_path, monkeypatch):
    """No worker slot is held while the vote samples the job: the operator takes the first round and defers
    with a serialisable trigger, the trigger takes the other rounds on the first round's clock, the operator
    resumes with them and decides as the rung does."""
    from airflow.sdk.exceptions import TaskDeferred

    from trainguard.operators.operators.vote import SlowVoteOperator
    from trainguard.operators.tasks import incident as steps
    from trainguard.operators.triggers.vote import SlowVoteTrigger

    c, fleet = fleet_controller(tmp_path, slow_rounds=3, slow_interval_s=0.01)
    use_controller(monkeypatch, c)
    for key, value in {"TG_SLOW_ROUNDS": "3", "TG_SLOW_INTERVAL_S": "0.01", "TG_FLEET_URL": c.cfg.fleet_url,
                       "TG_INVENTORY": c.cfg.inventory}.items():
        monkeypatch.setenv(key, value)
    fleet.compute = {r: 0.36 for r in range(4)} | {1: 0.9}  # rank 1 (m1) computes 2.5x its peers
    [item] = c.ingest([alert("throughput_decline", f"m{r}", rank=r) for r in range(4)])
    decision = steps.triage(c, item["incident"])
    assert steps.choose(decision) == "slow_vote"
    op = SlowVoteOperator(task_id="slow_vote", decision=decision)
    with pytest.raises(TaskDeferred) as deferred:
        op.execute({})
    trigger = deferred.value.trigger
    path, kwargs = trigger.serialize()
    assert path == "trainguard.operators.triggers.vote.SlowVoteTrigger"
    assert {k: kwargs[k] for k in ("incident_id", "rounds", "interval_s")} == {
        "incident_id": item["incident"], "rounds": 3, "interval_s": 0.01}
    assert len(kwargs["taken"]) == 1 and kwargs["taken"][0]["times"]["1"] == pytest.approx(0.9)
    assert time.time() - 5 < kwargs["started"] <= time.time()
    asked = len(fleet.sent("job", "status"))

    async def fire(t):
        async for event in t.run():
            return event.payload

    event = asyncio.run(fire(SlowVoteTrigger(**json.loads(json.dumps(kwargs)))))
    assert len(event["rounds"]) == 3 and not event.get("superseded")
    assert len(fleet.sent("job", "status")) > asked  # the other two rounds were taken by the trigger
    # the rounds keep the first round's clock: rounds whose time has passed are taken at once, not a full
    # interval after the triggerer picked the vote up
    late = {**kwargs, "interval_s": 600.0, "started": time.time() - 1300}
    begun = time.monotonic()
    assert len(asyncio.run(fire(SlowVoteTrigger(**late)))["rounds"]) == 3
    assert time.monotonic() - begun < 60
    result = RungResult.read(op.execute_complete({}, event))
    assert result.rung == "slow_vote" and result.restart and result.evict.machines == ["m1"]
    assert result.model_extra["vote"]["rounds"] == [[1], [1], [1]]
    # stronger alerts take the incident over while the vote runs: the trigger fires at once, nothing decided
    [other] = c.ingest([alert("throughput_decline", f"m{r}", rank=r, job="j") for r in range(4)])
    assert other["incident"] == item["incident"]
    c.fleet.update_incident(item["incident"], category="crash")
    early = asyncio.run(fire(SlowVoteTrigger(item["incident"], 5, 0.01)))
    assert early == {"rounds": [], "superseded": True}


def test_an_explicit_fault_that_joined_before_the_vote_decides_without_deferring(tmp_path, monkeypatch):
    from trainguard.operators.operators.vote import SlowVoteOperator
    from trainguard.operators.tasks import incident as steps

    c, fleet = fleet_controller(tmp_path)
    use_controller(monkeypatch, c)
    fleet.compute[1] = 0.9
    [item] = c.ingest([alert("throughput_decline", f"m{r}", rank=r) for r in range(4)])
    decision = steps.triage(c, item["incident"])
    c.ingest([alert("gpu_lost", "m2")])  # joins before the vote began
    asked = len(fleet.sent("job", "status"))  # the look that confirmed the slow alerts
    out = SlowVoteOperator(task_id="slow_vote", decision=decision).execute({})
    assert out["rung"] == "evict_now" and out["evict"]["machines"] == ["m2"]
    assert len(fleet.sent("job", "status")) == asked  # no round of the vote taken


def test_close_incident_escalates_a_restart_that_did_not_hold_and_waits_for_its_resume_deferred(tmp_path, monkeypatch):
    """A restart that restored nothing climbs (its copies rescued from the evicted machine, the job started
    again) and the new restart's resume is awaited in the triggerer: close_incident defers, then closes."""
    from airflow.sdk.exceptions import TaskDeferred

    from trainguard.operators.operators.close import CloseIncidentOperator
    from trainguard.operators.tasks import incident as steps
    from trainguard.operators.tasks import rungs
    from trainguard.operators.triggers.resume import ResumeTrigger

    url = f"file://{tmp_path / 'remote'}"
    c, fleet = fleet_controller(tmp_path, train_args=["--checkpoint", "--checkpoint-remote", url])
    use_controller(monkeypatch, c)
    fleet.copies = replicated_copies(fleet.topo, ["m0", "m1", "m2", "m3"], [238])
    fleet.restore_fails = True  # the restart finds no step it can restore on every rank
    [item] = c.ingest([alert("gpu_lost", "m1")])
    inc = item["incident"]
    recovery, _stop, _swap = recover(c, inc, rungs.handle(c, "evict_now", steps.triage(c, inc)))
    resume = steps.resumed(c, inc, recovery)
    assert resume["failed"].startswith("job j ended on every machine after the restart without a step")
    op = CloseIncidentOperator(task_id="close_incident", incident_id=str(inc), recovery=recovery, resume=resume)
    with pytest.raises(TaskDeferred) as deferred:
        op.execute({})
    trigger, kwargs = deferred.value.trigger, deferred.value.kwargs
    assert isinstance(trigger, ResumeTrigger) and deferred.value.method_name == "resumed"
    assert kwargs["watch"]["attempt"] == 1 and "rescued" in kwargs["watch"]["tried"][0]
    assert c.fleet.incident(inc).state == "open"  # not closed while its restart is watched
    launches = [a.id for a in c.fleet.actions(inc) if a.kind == "launch"]
    # the try fails while deferred (the scheduler's race); its retry watches the same restart, restarts nothing
    with pytest.raises(TaskDeferred) as retried:
        op.execute({})
    assert retried.value.kwargs["watch"]["attempt"] == 1
    assert retried.value.trigger.recovery["restart_ts"] >= trigger.recovery["restart_ts"] - 5
    assert [a.id for a in c.fleet.actions(inc) if a.kind == "launch"] == launches

    async def fire(t):
        async for event in t.run():
            return event.payload

    event = asyncio.run(fire(ResumeTrigger(**{**trigger.serialize()[1], "poll_s": 0.01})))
    done = op.resumed({}, event=event, watch=kwargs["watch"])
    assert done["state"] == "resolved" and "after 1 more restart(s)" in c.fleet.incident(inc).summary


def test_silent_corruption_watches_both_replay_phases_in_the_triggerer_then_evicts_the_machine_both_blame(
        tmp_path, monkeypatch):
    """Every machine passes the alignment test; the replay's groups (a machine that computes wrong only in
    training spoils each group it is in) are launched in the worker and watched deferred, phase by phase;
    the machine in a failing horizontal and a failing vertical group is evicted."""
    from airflow.sdk.exceptions import TaskDeferred

    from trainguard.operators.operators.replay import SilentCorruptionOperator
    from trainguard.operators.tasks import incident as steps
    from trainguard.operators.triggers.replay import ReplayTrigger

    c, fleet = fleet_controller(tmp_path)
    use_controller(monkeypatch, c)
    launched_groups, stopped = [], []

    def launch(job, groups, *, k, steps=2):  # the replicas start: what replay_launch hands the trigger
        launched_groups.append(dict(groups))
        return {"job": job, "k": k, "steps": steps, "world_size": 4,
                "groups": {t: {"job": f"{job}-replay-{t}", "machines": list(m), "failed": None}
                           for t, m in groups.items()}}

    polls = []

    def poll(launched):  # the first read finds them computing; then m2 spoils every group it is in
        polls.append(1)
        return {t: None if len(polls) == 1 else ("0:bad" if "m2" in g["machines"] else "0:good")
                for t, g in launched["groups"].items()}

    monkeypatch.setattr(c.replay, "replay_launch", launch)
    monkeypatch.setattr(c.replay, "replay_poll", poll)
    monkeypatch.setattr(c.replay, "replay_stop", lambda launched: stopped.append(sorted(launched["groups"])))
    [item] = c.ingest([alert("sdc_suspect", "m0", rank=0, step=7), alert("sdc_suspect", "m2", rank=2, step=7)])
    decision = steps.triage(c, item["incident"])
    assert steps.choose(decision) == "silent_corruption"
    op = SilentCorruptionOperator(task_id="silent_corruption", decision=decision)

    async def fire(t):
        async for event in t.run():
            return event.payload

    with pytest.raises(TaskDeferred) as h:
        op.execute({})
    assert fleet.sent("align") or fleet.sent("diag")  # the alignment test ran, in the worker
    assert sorted(launched_groups[0]) == ["h0", "h1", "ref"] and not stopped  # computing: nothing stopped yet
    path, kwargs = h.value.trigger.serialize()
    assert path == "trainguard.operators.triggers.replay.ReplayTrigger"
    event = asyncio.run(fire(ReplayTrigger(**{**kwargs, "poll_s": 0.01})))
    assert not stopped and len(polls) == 2  # watched until done: the trigger only watches
    with pytest.raises(TaskDeferred) as v:
        op.phase_done({}, event=event, **h.value.kwargs)
    assert stopped == [["h0", "h1", "ref"]]  # the operator ended the phase's groups as it resumed
    assert sorted(launched_groups[1]) == ["v0", "v1"] and v.value.kwargs["phase"] == "vertical"
    event = asyncio.run(fire(ReplayTrigger(**{**v.value.trigger.serialize()[1], "poll_s": 0.01})))
    result = RungResult.read(op.phase_done({}, event=event, **v.value.kwargs))
    assert result.rung == "silent_corruption" and result.evict.machines == ["m2"] and result.restart
    assert result.evict.max_step == 6  # restored before the step the peers first diverged at
    assert result.stopped is not None  # what the rung's own stop found came through both deferrals
    assert result.model_extra["replay"]["culprits"] == ["m2"]


def test_a_lost_gpu_during_a_replay_stops_it_and_decides_the_incident_at_once(tmp_path, monkeypatch):
    """A GPU lost while the dual-phase replay ran waited out the replay's minutes (and its groups computed on the
    machine that lost it). The explicit fault takes the incident over: the replay's groups end and the machine is
    evicted at once."""
    from airflow.sdk.exceptions import TaskDeferred

    from trainguard.operators.operators.replay import SilentCorruptionOperator
    from trainguard.operators.tasks import incident as steps
    from trainguard.operators.triggers.replay import ReplayTrigger

    c, _fleet = fleet_controller(tmp_path)
    use_controller(monkeypatch, c)
    stopped: list[list[str]] = []
    monkeypatch.setattr(c.replay, "replay_launch", lambda job, groups, *, k, steps=2: {
        "job": job, "k": k, "steps": steps, "world_size": 4,
        "groups": {t: {"job": f"{job}-replay-{t}", "machines": list(m), "failed": None} for t, m in groups.items()}})
    monkeypatch.setattr(c.replay, "replay_poll", lambda launched: {t: None for t in launched["groups"]})  # computing
    monkeypatch.setattr(c.replay, "replay_stop", lambda launched: stopped.append(sorted(launched["groups"])))
    [item] = c.ingest([alert("sdc_suspect", "m0", rank=0, step=7), alert("sdc_suspect", "m2", rank=2, step=7)])
    decision = steps.triage(c, item["incident"])
    op = SilentCorruptionOperator(task_id="silent_corruption", decision=decision)
    with pytest.raises(TaskDeferred) as h:
        op.execute({})
    _path, kwargs = h.value.trigger.serialize()
    assert kwargs["incident_id"] == item["incident"]
    c.ingest([alert("gpu_lost", "m3")])  # joins while the replicas compute

    async def fire(t):
        async for event in t.run():
            return event.payload

    event = asyncio.run(fire(ReplayTrigger(**{**kwargs, "poll_s": 0.01, "timeout_s": 60})))
    assert event["preempted"] == {"m3": "gpu_lost"}
    result = RungResult.read(op.phase_done({}, event=event, **h.value.kwargs))
    assert stopped == [["h0", "h1", "ref"]]  # the replay's groups ended
    assert result.rung == "evict_now" and result.evict.machines == ["m3"] and result.restart
    assert result.model_extra["instead_of"] == "silent_corruption"
    assert c.fleet.incident(item["incident"]).category == "machine_fault"


def test_a_replay_group_without_a_result_in_time_counts_as_failed_and_the_trigger_stops_nothing(tmp_path,
                                                                                                monkeypatch):
    from trainguard.operators.triggers.replay import ReplayTrigger

    c, _fleet = fleet_controller(tmp_path)
    use_controller(monkeypatch, c)
    stopped = []
    monkeypatch.setattr(c.replay, "replay_poll", lambda launched: {"h0": "0:aa", "h1": None})  # h1 never ends
    monkeypatch.setattr(c.replay, "replay_stop", lambda launched: stopped.append(sorted(launched["groups"])))
    launched = {"job": "j", "k": 1, "steps": 2, "world_size": 4,
                "groups": {t: {"job": f"j-replay-{t}", "machines": ["m0"], "failed": None} for t in ("h0", "h1")}}

    async def fire():
        async for event in ReplayTrigger(launched, timeout_s=0.05, poll_s=0.01).run():
            return event.payload

    assert asyncio.run(fire()) == {"results": {"h0": "0:aa", "h1": "failed: no result within 0s"}}
    assert stopped == []  # the task that resumes ends the groups (SilentCorruptionOperator.phase_done)


def test_a_vote_taken_over_by_a_lost_gpu_leaves_the_restart_to_the_run_that_took_it_over(tmp_path, monkeypatch):
    """A GPU lost while the vote sampled: the take-over run evicts the machine and restarts the job. The vote's own
    run, superseded, goes on through stop_job, swap_machines and restart_job: it must restart nothing (it once
    read the incident's launch action as its own task run again and restarted the job a second time, opening the
    incident again, 3 s after the job came back)."""
    from trainguard.operators.tasks import incident as steps
    from trainguard.operators.tasks import rungs as handlers

    c, fleet = fleet_controller(tmp_path)
    use_controller(monkeypatch, c)
    fleet.compute[1] = 0.9
    [item] = c.ingest([alert("throughput_decline", f"m{r}", rank=r) for r in range(4)])
    inc = item["incident"]
    vote_decision = steps.triage(c, inc)
    assert steps.choose(vote_decision) == "slow_vote"
    [lost] = c.ingest([alert("gpu_lost", "m1")])
    assert lost["incident"] == inc and lost["taken_over"]
    takeover = steps.triage(c, inc)
    result = handlers.handle(c, steps.choose(takeover), takeover)
    restart, _stop, _swap = recover(c, inc, result)
    assert restart["restarted"]
    starts = len(fleet.sent("job", "start"))
    from trainguard.operators.operators.vote import SlowVoteOperator

    superseded = SlowVoteOperator(task_id="slow_vote", decision=vote_decision).execute_complete(
        {}, {"rounds": [], "superseded": True})
    again, stop, swap = recover(c, inc, superseded)
    assert stop["skipped"] and swap["skipped"] and not again["restarted"], again
    assert "taken over" in again["reason"] and len(fleet.sent("job", "start")) == starts
    assert c.fleet.incident(inc).state == "open"  # the take-over run's resume check closes it

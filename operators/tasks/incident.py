"""The bodies of ``tg_incident``'s tasks: the triage and its branch, the rung's run, the restart, the resume
check, the close (or the escalation of a restart that did not hold), the re-arm and the run's outcome. Each
takes and returns JSON documents (typed: :mod:`trainguard.operators.models`), so the DAG file stays wiring and every
task is safe to clear.
"""

from __future__ import annotations

import time
from typing import Any

from trainguard.core.errors import TrainguardError
from trainguard.operators.control import Controller
from trainguard.operators.fleet.states import RELEASED_JOB_STATES, IncidentState
from trainguard.operators.models import (
    Escalation,
    EscalationWatch,
    IncidentDecision,
    Restart,
    Resume,
    RungResult,
    Stop,
    StopFound,
    Swap,
)
from trainguard.operators.policy import rungs
from trainguard.operators.policy.rungs import NO_RECOVERY
from trainguard.operators.tasks import common


def triage(c: Controller, incident_id: int) -> dict[str, Any]:
    """The incident's :class:`~trainguard.operators.models.IncidentDecision` (an XCom document)."""
    return IncidentDecision.model_validate(c.incidents.triage(int(incident_id))).model_dump(mode="json")


def choose(decision: dict[str, Any]) -> str:
    """The task that handles the decision (:data:`trainguard.operators.policy.rungs.RUNGS`); anything without a
    recovery goes to ``no_recovery``."""
    return rungs.branch(IncidentDecision.read(decision).action)


def _rung(results: list[dict[str, Any] | None]) -> RungResult:
    """The result of the rung that ran (the skipped ones give None); none ran: nothing to restart."""
    done = [RungResult.read(r) for r in results if r]
    return done[0] if done else RungResult(rung=NO_RECOVERY, restart=False, no_restart=True)


def stop_job(c: Controller, incident_id: int, results: list[dict[str, Any] | None]) -> dict[str, Any]:
    """Stop the job on every machine of it that answers (reading in the same sessions the steps every rank
    finished and the checkpoint copies each machine holds), when the rung restarts it or an explicit
    machine fault joined the incident meanwhile; the rung's own stop stands when it stopped the job for
    its evidence. Cleared and run again, it stops the job again (the tasks after it start it again).
    Returns a :class:`~trainguard.operators.models.Stop`."""
    c.handling(int(incident_id))
    rung = _rung(results)
    job = c.fleet.incident(int(incident_id)).job
    joined = not (rung.waiting_human or rung.dry_run) and (c.incidents.unhandled_faults(int(incident_id))
                                                           or c.unreachable(job))
    if not (rung.restart or joined):
        return Stop(stopped=False, skipped=True).dump()
    if rung.relaunched is not None and not joined and not _restarted(c, int(incident_id), rung):
        return Stop(stopped=False, skipped=True, by_rung=True).dump()  # stopped and started again by the rung
    if rung.stopped is not None and not _restarted(c, int(incident_id), rung):
        return Stop(stopped=True, found=rung.stopped, by_rung=True).dump()
    said = c.jobs.stop(job)
    found = c.jobs.stop_found(job)
    return Stop(stopped=True, found=StopFound.read(found) if found else None, said=said).dump()


def _restarted(c: Controller, incident_id: int, rung: RungResult | None = None) -> bool:
    """Whether this incident restarted its job already (its ``restart_job`` ran, and now runs again); the launches
    of a rung that restarts the job itself (``rung.rung_launched_ts``: when they ended) are the rung's, not a run
    of ``restart_job``."""
    after = rung.rung_launched_ts if rung is not None else None
    return any(a.kind == "launch" and a.outcome == "done" and (after is None or (a.started_ts or 0) > after)
               for a in c.fleet.actions(incident_id))


def swap_machines(c: Controller, incident_id: int, results: list[dict[str, Any] | None], stop: dict[str, Any] | None
                  ) -> dict[str, Any]:
    """Replace the machines the rung decided to evict with standbys (each checked reachable, through the
    breaker, never taking the last copy of a checkpoint: the copies ``stop_job`` found), then any explicit
    machine fault that joined the incident meanwhile (a second GPU lost 0.2 s after the first, a lost GPU
    during a hang's analysis), in the same restart. Each eviction is an action of the incident, done once:
    cleared and run again, it answers what was done. Returns a :class:`~trainguard.operators.models.Swap`."""
    c.handling(int(incident_id))
    rung = _rung(results)
    if rung.waiting_human or rung.dry_run:
        return Swap(skipped=True, waiting_human=rung.waiting_human, dry_run=rung.dry_run).dump()
    incident_id = int(incident_id)
    found = Stop.read(stop).found if stop else None
    copies = found.copies if found else None
    out: dict[str, Any] = {}
    if rung.evict is not None:
        ev = c.evictions.evict(incident_id, rung.evict.machines, reason=rung.evict.reason, max_step=rung.evict.max_step,
                     copies=copies, priority=rung.evict.priority)
        out = {**ev, "swaps": dict(ev.get("swaps") or {})}
        if ev.get("waiting_human") or ev.get("dry_run"):
            return Swap.read(out).dump()
    out = {**out, **_evict_joined(c, incident_id, copies, out.get("swaps") or {})}
    return Swap.read(out or {"skipped": rung.evict is None}).dump()


def _evict_joined(c: Controller, incident_id: int, copies: Any, swaps: dict[str, str]) -> dict[str, Any]:
    """Explicit machine faults that joined the incident and still serve its job, and its machines that did not answer
    a session of it, evicted (their standbys added to ``swaps``); {} when there are none."""
    extra = {**{m: "unreachable" for m in c.unreachable(c.fleet.incident(incident_id).job)},
             **c.incidents.unhandled_faults(incident_id)}
    if not extra:
        return {}
    ev = c.evictions.evict(incident_id, sorted(extra), copies=copies,
                 reason="explicit machine fault that joined the incident: "
                        + "; ".join(f"{m}: {k}" for m, k in extra.items()))
    out = {"joined": extra, "joined_eviction": {k: v for k, v in ev.items() if k != "swaps"},
           "swaps": {**swaps, **(ev.get("swaps") or {})}}
    if ev.get("waiting_human"):
        out.update(waiting_human=True, reason=ev["reason"])
    return out


def restart_job(c: Controller, incident_id: int, results: list[dict[str, Any] | None],
                stop: dict[str, Any] | None = None, swap: dict[str, Any] | None = None, *,
                resume_timeout_s: float | None = None) -> dict[str, Any]:
    """After whichever rung ran (skipped ones give None), ``stop_job`` and ``swap_machines``: start the job on
    its machine list (the standbys in the evicted machines' places), from what the stop found, restoring
    its newest committed checkpoint (or the step the rung names), unless the rung leaves it alone or the
    swap waits for a human. Its inputs are XCom only, so the task is safe to clear: run again (cleared in
    the UI, or retried) after the job was restarted once, it restarts the job again from what runs now
    (:func:`restart_again`). Returns a :class:`~trainguard.operators.models.Restart` (with the rung's result when
    nothing was restarted). ``resume_timeout_s``: the run's own limit on the resume wait (None: the
    setting's)."""
    c.handling(int(incident_id))
    rung = _rung(results)
    swapped = Swap.read(swap) if swap else Swap(skipped=True)
    stopped = Stop.read(stop) if stop else Stop(stopped=False, skipped=True)
    incident_id = int(incident_id)
    limit = {"resume_timeout_s": resume_timeout_s}
    if (getattr(rung, "vote", None) or {}).get("superseded"):
        # stronger alerts took the incident over while this run's vote sampled: the run they started handles it
        # (its restart is not this run's to repeat, though the incident's launch action is recorded)
        return Restart.read({**rung.dump(), "restart": False, "restarted": False,
                             "reason": "taken over by stronger alerts: their run restarts the job"}).dump()
    if _restarted(c, incident_id, rung):
        return Restart.read({**restart_again(c, incident_id), **limit}).dump()
    if rung.relaunched is not None and not swapped.joined and not c.incidents.unhandled_faults(incident_id):
        # the rung restarted the job itself (the restart at once): that restart is this task's; run again (cleared,
        # retried) it restarts the job again like any restart_job run again
        action, first = c.fleet.record_action(f"adopted:{incident_id}", kind="adopted", incident_id=incident_id)
        if not first:
            return Restart.read({**restart_again(c, incident_id), **limit}).dump()
        c.fleet.finish_action(action.id, "done", f"the restart {rung.rung} made")
        return Restart.read({**rung.relaunched, "restarted": True, "by_rung": rung.rung, **limit}).dump()
    inc = c.fleet.incident(incident_id)
    waited = inc.state == IncidentState.WAITING_HUMAN and (swapped.waiting_human or rung.waiting_human)
    if waited and c.fleet.record_action(f"waited:{incident_id}", kind="waited", incident_id=incident_id)[1]:
        pass  # this run's own pass: the incident waits for a human, and this task says so below
    elif waited:
        # run again (cleared by a person, or 'trainguard incident retry') once the cause was put right: the incident
        # opens again and what stopped it (the breaker, no standby, the checkpoint's last copy) is judged again
        if rung.waiting_human:
            raise TrainguardError(f"incident {incident_id}: its rung decided to wait for a human ({inc.summary}); "
                                  f"clear the rung's task to decide again")
        c.fleet.set_job_state(inc.job, "running", unless=RELEASED_JOB_STATES)  # a stopped job is submitted again
        _reopen(c, inc, "acted on again by hand")
        swapped = Swap.read(swap_machines(c, incident_id, results, stop))
    result = rung.dump()
    if swapped.joined and not swapped.waiting_human:  # a fault that joined forces the restart the rung spared
        result = {k: v for k, v in result.items() if k not in ("no_restart", "resolved")}
        result["restart"] = True
    if swapped.waiting_human or swapped.dry_run:
        result.update(restart=False, waiting_human=swapped.waiting_human, dry_run=swapped.dry_run,
                      reason=swapped.reason or result.get("reason"))
    if result["restart"] and not (swapped.waiting_human or swapped.dry_run):
        # a fault that joined after swap_machines ran (a GPU lost while the first rung evicted a full disk) is
        # evicted before this launch, not found by the resume check after the job was restarted onto it
        late = _evict_joined(c, incident_id, stopped.found.copies if stopped.found else None, {})
        if late:
            swapped = Swap.read({**swapped.dump(), "joined": {**(swapped.joined or {}), **late["joined"]},
                                 "swaps": {**(swapped.swaps or {}), **late["swaps"]},
                                 **({"waiting_human": True, "reason": late["reason"]}
                                    if late.get("waiting_human") else {})})
            if swapped.waiting_human:
                result.update(restart=False, waiting_human=True, reason=swapped.reason)
    result["swap"] = swapped.dump()
    degraded = result.get("degraded")
    if degraded and degraded.get("machines") and not (swapped.joined or result.get("waiting_human")):
        # the groups that left were started again on their machines by the rung; the rest never stopped
        return Restart.read({**result, "restarted": True, "job": c.fleet.incident(incident_id).job,
                             "restart_ts": float(degraded["restart_ts"]), **limit}).dump()
    if not result["restart"]:
        return Restart.read({**result, "restarted": False}).dump()
    cap = rung.restore_max_step if rung.restore_max_step is not None else rung.evict.max_step if rung.evict else None
    out = c.recovery.recover(incident_id, restore_max_step=cap, found=stopped.found.dump() if stopped.found else None)
    return Restart.read({**out, "restarted": True, "swap": result["swap"], **limit}).dump()


def restart_again(c: Controller, incident_id: int) -> dict[str, Any]:
    """``restart_job`` run again after it restarted the job (an operator cleared it, or a retry): the
    incident opens again (unless another incident of the job is open: then that one's run acts, and this
    refuses), the job is stopped and started again on its machines, from its newest committed checkpoint;
    the tasks after it check the resume and close the incident again."""
    inc = c.fleet.incident(incident_id)
    if inc.state != IncidentState.OPEN:  # closed, or waiting for a human who now asks for the restart
        _reopen(c, inc, "restarted again (its run's restart_job ran again)")
    begun = time.time()
    out = c.recovery.recover(incident_id)
    return Restart.read({**out, "restarted": True, "again": True, "again_ts": begun}).dump()


def _reopen(c: Controller, inc: Any, why: str) -> None:
    """Open the incident again for its run's ``restart_job`` run again (``why`` added to its summary); refused while
    another incident of the job is open (its run acts on the job)."""
    busy = common.open_incidents(c, inc.job, other_than=inc.id)
    if busy:
        raise TrainguardError(f"incident {busy[0]} of job {inc.job} is open and its run acts on the job; "
                              f"clear this task again once it closed")
    c.fleet.update_incident(inc.id, state=IncidentState.OPEN, summary=f"{inc.summary}; {why}")


def resumed(c: Controller, incident_id: int, recovery: dict[str, Any]) -> dict[str, Any] | None:
    """For the resume trigger: a :class:`~trainguard.operators.models.Resume` once training passed the restored step;
    ``failed`` once the restart ended without a step or did not get there within ``resume_timeout_s``;
    ``pending`` when explicit machine faults joined the incident meanwhile; else None (ask again). ``c``: a
    controller to reuse between calls (the trigger keeps one)."""
    rec = Restart.read(recovery)
    if not rec.restarted:
        return Resume(skipped=True).dump()
    recovery = rec.dump()
    pending = c.incidents.unhandled_faults(int(incident_id))
    if pending:
        return Resume(pending=pending).dump()
    degraded = recovery.get("degraded")
    try:
        info = (c.jobs.rejoined(recovery["job"], list(degraded["machines"]), float(recovery["restart_ts"]))
                if degraded else c.jobs.resumed(recovery["job"], recovery["restart_ts"]))
    except TrainguardError as exc:
        return Resume(failed=str(exc)).dump()
    limit = rec.resume_timeout_s or c.cfg.resume_timeout_s
    if info is None and time.time() - float(recovery["restart_ts"]) > limit:
        return Resume(failed=f"training did not pass the restored step within {limit:.0f}s of "
                             f"the restart").dump()
    return None if info is None else Resume.read(info).dump()


def _wait_resumed(c: Controller, incident_id: int, recovery: dict[str, Any], *, poll_s: float = 2.0
                  ) -> dict[str, Any]:
    """:func:`resumed`'s answer, polled until it is one (outside Airflow; there the resume trigger asks)."""
    while True:
        info = resumed(c, incident_id, recovery)
        if info is not None:
            return info
        time.sleep(poll_s)


def escalate(c: Controller, incident_id: int, why: str, *, resume_timeout_s: float | None = None) -> dict[str, Any]:
    """A recovery that did not hold climbs on instead of leaving the job dead (:func:`escalation_step`), its
    resume waits polled here (outside Airflow; ``close_incident`` defers them to the triggerer)."""
    step = escalation_step(c, incident_id, why, resume_timeout_s=resume_timeout_s)
    while step.watch is not None:
        step = escalation_after(c, incident_id, step.watch, _wait_resumed(c, incident_id, step.watch.recovery))
    return dict(step.timeline or {})


def escalation_step(c: Controller, incident_id: int, why: str, *, attempt: int = 0, tried: list[str] | None = None,
                    resume_timeout_s: float | None = None) -> Escalation:
    """One climb of a recovery that did not hold (``why``): before each new restart (at most
    ``restart_attempts`` in all) the controller removes what stands in the way (explicit faults that joined,
    machines that failed, the last copies of a checkpoint still on evicted machines: :meth:`Controller.
    before_retry`) and restarts the job; when that runs out, the incident and the job wait for a human, with
    why and what next. Returns the :class:`~trainguard.operators.models.Escalation`: ``done``, or ``watching`` a
    restart whose resume is to be waited for (then :func:`escalation_after` with the answer). ``resume_timeout_s``:
    the run's own limit on each resume wait (None: the setting's)."""
    tried = list(tried or [])
    while attempt < c.cfg.restart_attempts:
        attempt += 1
        try:
            step = c.evictions.before_retry(incident_id, why)
            if step.get("give_up"):
                why = step["give_up"]
                break
            tried.append(step["did"])
            out = c.recovery.recover(incident_id, found=c.jobs.stop_found(c.fleet.incident(incident_id).job))
        except TrainguardError as exc:  # the escalation itself failed (a machine lost meanwhile): climb on
            why = f"the restart itself failed: {exc}"
            continue
        if out.get("waiting_human"):
            return Escalation.done(c.incidents.timeline(incident_id))
        recovery = Restart.read({**out, "restarted": True, "resume_timeout_s": resume_timeout_s}).dump()
        return Escalation.watching(EscalationWatch(recovery=recovery, attempt=attempt, tried=tried, why=why,
                                                   resume_timeout_s=resume_timeout_s))
    reason = (f"recovery did not hold: {why}"[:700] + (f"; tried: {'; '.join(tried)}"[:400] if tried else "")
              + "; next: look at 'tg-node logs --job J' on its machines, fix what stands in the way, then resolve "
                "the incident (or trigger tg_diagnose with evict)")
    c.fleet.wait_for_human(incident_id, reason)
    return Escalation.done(c.incidents.timeline(incident_id))


def escalation_after(c: Controller, incident_id: int, watch: EscalationWatch | dict[str, Any],
                     info: dict[str, Any]) -> Escalation:
    """The transition of a ``watching`` escalation on the resume check's answer (``watch``: what
    :func:`escalation_step` asked to watch): resumed, the incident closes resolved (``done``); else the
    escalation climbs on (:func:`escalation_step`)."""
    watch = EscalationWatch.read(watch)
    if not info.get("failed") and not info.get("pending"):
        return Escalation.done(c.incidents.close(incident_id, outcome=IncidentState.RESOLVED, resumed=info,
                                                 steps_before=int(watch.recovery.get("steps_before", -1)),
                                                 note=f"resumed at step {info['first_step']} after {len(watch.tried)} "
                                                      f"more restart(s): {'; '.join(watch.tried)}"))
    why = info.get("failed") or "explicit faults joined again: " + ", ".join(sorted(info["pending"]))
    return escalation_step(c, incident_id, why, attempt=watch.attempt, tried=list(watch.tried),
                           resume_timeout_s=watch.resume_timeout_s)


def close(c: Controller, incident_id: int, decision: dict[str, Any] | None, recovery: dict[str, Any] | None,
          resume: dict[str, Any] | None, *, run_id: str | None = None) -> dict[str, Any]:
    """Close the incident (:func:`close_step`), its escalation's resume waits polled here (outside Airflow;
    ``close_incident`` defers them to the triggerer). Returns the incident's timeline."""
    step = close_step(c, incident_id, decision, recovery, resume, run_id=run_id)
    while step.watch is not None:
        step = escalation_after(c, int(incident_id), step.watch, _wait_resumed(c, int(incident_id),
                                                                              step.watch.recovery))
    return dict(step.timeline or {})


def close_step(c: Controller, incident_id: int, decision: dict[str, Any] | None, recovery: dict[str, Any] | None,
               resume: dict[str, Any] | None, *, run_id: str | None = None) -> Escalation:
    """Close the incident: resolved when training resumed (or nothing needed recovering and the job trains);
    a restart that did not hold, a rung that failed or a job left down escalates (:func:`escalation_step`);
    an incident waiting for a human stays so. ``decision``: what ``no_recovery`` returned (its ``action``),
    None when a rung handled the incident. Returns the :class:`~trainguard.operators.models.Escalation`: ``done``, or
    ``watching`` when the escalation restarted the job and its resume is to be waited for. ``run_id``: the run closing
    it (a try of its close that comes again after it triaged the incident again hands the incident to that run once
    more)."""
    incident_id = int(incident_id)
    c.handling(incident_id)
    c.evictions.judge_passed_over(incident_id)  # standbys its evictions passed over, silent when called: judged now
    inc = c.fleet.incident(incident_id)

    RESOLVED, FAILED = IncidentState.RESOLVED, IncidentState.FAILED

    def closed(outcome: str, note: str, **kw: Any) -> Escalation:
        return Escalation.done(c.incidents.close(incident_id, outcome=outcome, note=note, **kw))

    if inc.state == IncidentState.WAITING_HUMAN:
        return Escalation.done(c.incidents.timeline(incident_id))
    restarted = bool(recovery and recovery.get("restarted"))
    in_flight = _escalated_before(c, incident_id, recovery) if restarted else None
    if in_flight is not None:  # a try of this task before (it failed while deferred) restarted the job already
        return Escalation.watching(in_flight)
    if restarted and not (resume and any(k in resume for k in ("first_step", "failed", "pending", "skipped"))):
        # the resume check's task ended without an answer (it failed while a scheduler or the database was away):
        # whether the job resumed is looked at now, not assumed either way
        resume = resumed(c, incident_id, recovery) or resume
    if restarted and resume and not resume.get("skipped") and not resume.get("failed") and not resume.get("pending"):
        # the failure back after the restart (a NaN a machine keeps making, a crash that comes again): a new
        # incident a level up handles it, not this one, whose recovery it would otherwise close over
        back = _hand_on(c, incident_id, inc, since=float(recovery.get("again_ts") or recovery["restart_ts"]))
        if recovery.get("degraded") and not recovery.get("again"):
            d = recovery["degraded"]
            healed = "healed from a live replica" if resume.get("healed_from_step") is not None else "rejoined"
            done = closed(RESOLVED, f"path degrade: replica(s) {', '.join(map(str, d['replicas']))} {healed} on "
                                    f"{', '.join(d['machines'])} at step {resume['first_step']} "
                                    f"({time.time() - inc.first_alert_ts:.1f}s after the first alert); the others "
                                    f"trained on{back['note']}", resumed=resume)
        elif recovery.get("again"):  # its second restart: the job was down from the stop to the resume
            start = float(recovery["again_ts"])
            c.fleet.add_ettr(inc.job, "recovery", start, max(start, float(resume["ts"])),
                             incident_id=incident_id, detail="restarted again (restart_job ran again)")
            done = closed(RESOLVED, f"resumed at step {resume['first_step']} after the restart again{back['note']}")
        else:
            done = closed(RESOLVED, f"resumed at step {resume['first_step']} ({time.time() - inc.first_alert_ts:.1f}s "
                                    f"after the first alert){back['note']}",
                          resumed=resume, steps_before=int(recovery.get("steps_before", -1)))
        if back["incident"] is not None:
            done = Escalation.done({**(done.timeline or {}), "handed_on": _start_run(c, back["incident"], inc.job)})
        return done
    if restarted:  # the restart did not hold, faults joined after it, or the resume check itself failed
        why = (resume or {}).get("failed") or (
            "explicit faults joined after the restart: " + ", ".join(sorted((resume or {})["pending"]))
            if (resume or {}).get("pending") else "the resume check ended without an answer")
        return escalation_step(c, incident_id, why, resume_timeout_s=recovery.get("resume_timeout_s"))
    vote = (recovery or {}).get("vote") or {}
    if vote.get("superseded"):  # stronger alerts took the incident over: its new run closes it
        return Escalation.done(c.incidents.timeline(incident_id))
    if (recovery or {}).get("error"):  # the rung itself failed: the job may be stopped halfway
        if c.jobs.trains(inc.job):
            return closed(FAILED, f"{recovery['error']}; the job still trains; next: look at the task's log, then "
                                    f"trigger tg_diagnose")
        return escalation_step(c, incident_id, recovery["error"])
    if (recovery or {}).get("not_evicted") and c.jobs.trains(inc.job):  # closed (failed), so that later alerts
        # open incidents of their own instead of joining one that waits while the job trains
        return closed(FAILED, recovery["not_evicted"])
    spared = _spared(decision, recovery)
    if spared:  # nothing was restarted: whether the job trains is observed, never assumed
        again = _triage_again(c, incident_id, run_id)
        if again is not None:
            return again
        why = c.incidents.not_training(inc.job)
        if why:  # the alerts of what stopped it (a crash's rank_exit) have arrived while the job was looked at
            again = _triage_again(c, incident_id, run_id)
            if again is not None:
                return again
            return escalation_step(c, incident_id, f"{spared}; but the job does not train: {why}")
        return closed(RESOLVED, spared)
    if c.jobs.trains(inc.job):
        return closed(FAILED, "the incident's run ended without a recovery while the job trains on; next: look at "
                                "its tasks' logs")
    return escalation_step(c, incident_id, "the incident's run ended without a recovery and the job does not train")


def _hand_on(c: Controller, incident_id: int, inc: Any, *, since: float) -> dict[str, Any]:
    """The incident's alerts after its restart (``since``) that say the job failed again, moved to a new incident
    a level up (:meth:`Controller.recurred`, :meth:`FleetStore.split_off`); ``{"note", "incident"}`` for the
    close (``incident`` None when nothing came back)."""
    back = c.incidents.recurred(incident_id, since=since)
    new = c.fleet.split_off(incident_id, [a.id for a in back], level=inc.level + 1) if back else None
    if new is None:
        return {"note": "", "incident": None}
    kinds = ", ".join(sorted({f"{a.machine}:{a.kind}" for a in back})[:8])
    return {"note": f"; the failure came back after the restart ({kinds}): incident {new.id} handles it at "
                    f"level {new.level}", "incident": new.id}


def _start_run(c: Controller, incident_id: int, job: str) -> dict[str, Any]:
    """Start the tg_incident run of an incident opened here (the guardian's sweep starts it if this start
    is lost)."""
    from trainguard.operators.tasks import guardian

    run = guardian.run_id(incident_id)
    started = guardian.start_soon([rungs.run_start(incident_id, job, run)])
    return {"incident": incident_id, "run": run, "started": started.get(run)}


def _spared(decision: dict[str, Any] | None, recovery: dict[str, Any] | None) -> str:
    """Why the incident's decision needed no restart ("" when it needed one): a slow vote that evicted nothing,
    a decision to tolerate or observe, a rung that fixed what it found in place (an agent restarted ...)."""
    vote = (recovery or {}).get("vote") or {}
    if vote and not vote.get("machines"):
        return (f"no rank stood out in most of {len(vote['rounds'])} rounds: a shared or passing slowdown, nothing "
                f"evicted")
    if decision and decision.get("action") in ("tolerate", "observe"):
        return f"no recovery needed ({decision['action']})"
    if recovery and recovery.get("resolved"):
        return str(recovery["resolved"])
    return ""


def _triage_again(c: Controller, incident_id: int, by: str | None = None) -> Escalation | None:
    """Before an incident closes without a restart: alerts that joined after its decision and say something
    stronger (a crash during a slow vote, a hang while a network flap was tolerated) re-triage it. The incident
    takes their category and a new tg_incident run handles it through the ladder (started now when the REST
    API answers, else by the reconciler's next pass); this run ends without closing it. None when nothing
    joined that its decision does not explain. ``by``: the run closing it; when an earlier try of that close
    triaged it again already (the incident has the new category now, so nothing outranks it any more), the
    run it named handles it (started again: a start that landed is not repeated), not an escalation."""
    from trainguard.operators.policy import ladder
    from trainguard.operators.tasks import guardian

    inc = c.fleet.incident(incident_id)
    earlier = next((a for a in c.fleet.actions(incident_id) if by and a.kind == "retriage"
                    and (a.evidence or {}).get("by") == by), None)
    if earlier is not None and inc.state == IncidentState.OPEN:
        return _handed_to(c, incident_id, inc.job, str(earlier.evidence["run"]), by_an_earlier_try=True)
    t = c.incidents.triage_again(incident_id)
    if not ladder.outranks(inc.category, t):
        return None
    run = guardian.run_id(incident_id, f"{t.category}_{len(c.fleet.actions(incident_id))}")
    # recorded before the incident takes the new category: a retry after either finds the record
    action, _ = c.fleet.record_action(f"retriage:{incident_id}:{t.category}", kind="retriage",
                                      incident_id=incident_id, machines=list(t.machines),
                                      evidence={"from": inc.category, "to": t.category, "reason": t.reason[:500],
                                                "run": run, "by": by})
    c.fleet.update_incident(incident_id, category=t.category,
                            summary=f"{inc.summary}; alerts that joined after its decision: {t.reason}; "
                                    f"next: triaged again (run {run})"[-2000:])
    c.fleet.finish_action(action.id, "done")
    return _handed_to(c, incident_id, inc.job, run)


def _handed_to(c: Controller, incident_id: int, job: str, run: str, **note: Any) -> Escalation:
    """The incident handed to its tg_incident run ``run`` (started now, or found started: a start that landed is
    not repeated); this run ends without closing it."""
    from trainguard.operators.tasks import guardian

    started = guardian.start_soon([rungs.run_start(incident_id, job, run)])
    return Escalation.done({**c.incidents.timeline(incident_id),
                            "triaged_again": {"run": run, "started": started.get(run), **note}})


def _escalated_before(c: Controller, incident_id: int, recovery: dict[str, Any]) -> EscalationWatch | None:
    """The escalation restart an earlier try of ``close_incident`` made after ``recovery``'s restart, while
    the incident is still open (the try failed while its resume was awaited): the resume of that restart is
    awaited again, instead of a second escalation restarting the job once more."""
    rec = Restart.read(recovery)
    if rec.restart_ts is None or c.fleet.incident(incident_id).state != IncidentState.OPEN:
        return None
    later = [a for a in c.fleet.actions(incident_id) if a.kind == "launch" and a.outcome == "done"
             and (a.started_ts or 0) > rec.restart_ts]
    if not later:
        return None
    restart = Restart(restarted=True, job=rec.job, restart_ts=float(later[-1].finished_ts or later[-1].started_ts),
                      resume_timeout_s=rec.resume_timeout_s).dump()
    return EscalationWatch(recovery=restart, attempt=len(later),
                           tried=[f"{len(later)} restart(s) by an earlier try of this task"], why="",
                           resume_timeout_s=rec.resume_timeout_s)


def rearm(c: Controller, incident_id: int) -> dict[str, Any]:
    """When the incident's run ends: warm interpreters again on every machine of the job, for the next
    restart (after this run's restart consumed them, or after another run skipped its re-arm while this
    incident was open)."""
    return common.arm_unless_busy(c, c.fleet.incident(incident_id).job, own_incident=incident_id)


def outcome(c: Controller, incident_id: int) -> dict[str, Any]:
    """The run's last task: fails when the incident failed or waits for a human, so the run's colour in
    the UI says how the incident ended (its record holds the details)."""
    inc = c.fleet.incident(int(incident_id))
    note = incident_note(c, int(incident_id))
    common.note(note)
    if inc.state in (IncidentState.FAILED, IncidentState.WAITING_HUMAN):
        raise TrainguardError(f"incident {inc.id} {inc.state.replace('_', ' for a ')}: {inc.summary}")
    return {"incident": inc.id, "state": inc.state, "summary": inc.summary, "note": note}


def incident_note(c: Controller, incident_id: int) -> str:
    """The incident's run in one line: outcome, category, evictions with their standbys, rollback, and the
    resume (step, seconds after the first alert)."""
    import json

    inc = c.fleet.incident(incident_id)
    parts = []
    for a in c.fleet.actions(incident_id):
        if a.kind == "evict" and a.outcome == "done":
            swaps = json.loads(a.detail or "{}")
            parts.append("evicted " + ", ".join(f"{old} -> standby {new}" for old, new in sorted(swaps.items())))
            if a.evidence.get("deferred"):  # a partial swap: the pool was short of the whole group
                parts.append(f"kept {', '.join(a.evidence['deferred'])} of the group (too few standbys)")
        elif a.kind == "degrade" and a.outcome == "done":
            d = json.loads(a.detail or "{}").get("degraded") or {}
            parts.append(f"path degrade: replica(s) {', '.join(map(str, d.get('replicas', [])))} out, the others "
                         f"trained on at width {d.get('width')}")
        elif a.kind == "degrade" and a.outcome == "stop_world":
            parts.append("path stop_world: " + json.loads(a.detail or "{}").get("stop_world", ""))
        elif a.kind == "rollback" and a.outcome == "done":
            parts.append(f"rolled back {a.evidence.get('from')} -> {a.evidence.get('to')}")
    if inc.resumed_ts and inc.first_alert_ts:
        parts.append(f"resumed {inc.resumed_ts - inc.first_alert_ts:.0f}s after the first alert"
                     + (f", {inc.lost_steps} steps lost" if inc.lost_steps is not None else ""))
    elif inc.summary:
        parts.append(inc.summary.split("; ")[-1])
    head = f"incident {inc.id} {inc.state.replace('_', ' ')} ({inc.category or 'untriaged'})"
    return head + (": " + "; ".join(parts) if parts else "")


def no_recovery(c: Controller, decision: dict[str, Any]) -> dict[str, Any]:
    if decision["action"] == "wait_human":
        c.fleet.wait_for_human(decision["incident"], decision["reason"])
    return {"action": decision["action"], "reason": decision["reason"]}

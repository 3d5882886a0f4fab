"""The bodies of the control plane's DAG tasks: each takes and returns JSON-able dicts, so the DAG
files stay wiring. Configuration comes from the environment of the Airflow processes (``TG_FLEET_URL``,
``TG_INVENTORY``, ``TG_DRY_RUN`` ...; see :class:`operators.settings.ControlSettings`), SSH credentials
from the Airflow connection ``tg_ssh`` (or the inventory), through :class:`NodeHook`.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from node_tools.errors import TrainguardError
from operators.control import ControlConfig, Controller
from operators.fleet.store import OPEN_INCIDENT_STATES
from operators.models import IncidentDecision, Restart, Resume, RungResult, StopFound
from operators.policy import ladder, rungs
from operators.policy.rungs import BRANCHES, NO_RECOVERY

__all__ = ["BRANCHES", "NO_RECOVERY"]

def controller(**overrides: Any) -> Controller:
    from operators.airflow.node_hook import NodeHook

    cfg = ControlConfig.from_env(**overrides)
    hook = NodeHook(cfg.inventory)
    return Controller(cfg, transport=hook.transport(), inventory=hook.inventory)


_SHARED: dict[tuple[str, str], Controller] = {}


def shared_controller() -> Controller:
    """One controller per process and fleet for the triggers of a triggerer: one fleet database engine and
    one SSH credential lookup for all of them, built once (the first trigger pays it; the rest start
    checking at once). Its calls are reads: safe from the triggers' threads at once."""
    cfg = ControlConfig.from_env()
    key = (cfg.fleet_url, cfg.inventory)
    if key not in _SHARED:
        _SHARED[key] = controller()
    return _SHARED[key]


def alert_source() -> tuple[str, str]:
    """The bus to watch (the inventory's) and the fleet database that keeps the readers' cursors."""
    from node_tools.inventory import Inventory

    cfg = ControlConfig.from_env()
    inv = Inventory.load(Path(cfg.inventory))
    return inv.bus_url, cfg.fleet_url


# ---- tg_guardian ---------------------------------------------------------------------------------------
def group_alerts(event: dict[str, Any]) -> list[dict[str, Any]]:
    """Record the batch in one transaction (alerts into incidents, the bus cursor, quarantined documents, the
    agents' liveness); returns the confs of incidents newly opened, or taken over by stronger alerts during
    a slow vote (one tg_incident run each)."""
    items = controller().ingest(event["alerts"], reader=event.get("reader") or "guardian", read=event.get("read"),
                                gone=event.get("gone") or (), quarantined=event.get("quarantined") or (),
                                liveness=event.get("liveness"))
    return [{"incident_id": i["incident"], "job": i["job"], "first_seen_ts": event.get("first_seen_ts")}
            for i in items if i["opened"] or i["taken_over"]]


# ---- tg_incident -----------------------------------------------------------------------------------------
def triage(incident_id: int) -> dict[str, Any]:
    """The incident's :class:`~operators.models.IncidentDecision` (an XCom document)."""
    return IncidentDecision.read(controller().triage(int(incident_id))).dump()


def choose(decision: dict[str, Any]) -> str:
    """The task that handles the decision (:data:`operators.policy.rungs.RUNGS`); anything without a
    recovery goes to ``no_recovery``."""
    return rungs.branch(IncidentDecision.read(decision).action)


def handle(name: str, decision: dict[str, Any]) -> dict[str, Any]:
    """The rung ``name`` (a task id of :data:`operators.policy.rungs.RUNGS`): its action (stop, evict, roll
    back ...); then the explicit machine faults that joined the incident meanwhile (:func:`act_on_joined`).
    Returns a :class:`~operators.models.RungResult`: whether the job is to restart, and what the rung's stop
    found (``restart_job`` starts the job from that, with no round of reads). A rung that fails returns its
    error (the incident's close escalates from there)."""
    decision = IncidentDecision.read(decision).dump()
    c = controller()
    if name != "evict_now":
        explicit = c.unhandled_faults(decision["incident"])
        if explicit:  # an explicit fault joined before the rung acted: the first rung decides (evict it alone)
            why = ("explicit machine fault that joined the incident before its rung acted: "
                   + "; ".join(f"{m}: {k}" for m, k in explicit.items()))
            c.fleet.update_incident(decision["incident"], category="machine_fault", summary=f"{why}; next: evict")
            decision = {**decision, "category": "machine_fault", "action": "evict", "machines": sorted(explicit),
                        "reason": why, "instead_of": name}
            name = "evict_now"
    try:
        result = RUNG_ACTIONS[name](c, decision)
    except TrainguardError as exc:
        return RungResult(rung=name, restart=False, error=f"{name} failed: {exc}"[:900], no_restart=True).dump()
    result = act_on_joined(c, decision, result)
    found = c.stop_found(decision["job"])
    return RungResult.read({**result, "rung": name, "restart": not _leaves_it_alone(result),
                            "stopped": StopFound.read(found) if found else None}).dump()


def act_on_joined(c: Controller, decision: dict[str, Any], result: dict[str, Any]) -> dict[str, Any]:
    """Alerts that joined the incident after its triage (a second GPU lost 0.2 s after the first, a lost GPU
    during a hang's analysis): an explicit machine fault on a machine still in the job is evicted now, in the
    same restart, before the incident closes."""
    if result.get("waiting_human") or result.get("dry_run"):
        return result
    extra = c.unhandled_faults(decision["incident"])
    if not extra:
        return result
    if result.get("no_restart"):  # the rung left the job running (a vote that found nothing): it stops now
        c.stop(decision["job"])
    ev = c.evict(decision["incident"], sorted(extra), reason="explicit machine fault that joined the incident: "
                 + "; ".join(f"{m}: {k}" for m, k in extra.items()))
    out = {k: v for k, v in result.items() if k not in ("no_restart", "resolved")}
    out["joined"] = {"faults": extra, **ev}
    if ev.get("waiting_human"):
        out.update(waiting_human=True, reason=ev["reason"])
    return out


def evict_now(c: Controller, decision: dict[str, Any]) -> dict[str, Any]:
    """An explicit machine fault: stop the job, evict the machines, restart. A decision naming no machine of
    the job (an alert about a machine that left it) touches nothing."""
    machines = c.fleet.job(decision["job"]).machine_list
    if not [m for m in decision["machines"] if m in machines]:
        named = ", ".join(decision["machines"]) or "no machine"
        why = f"nothing to evict: {named} does not serve job {decision['job']}"
        return {"swaps": {}, "no_restart": True, "reason": why, "resolved": why}
    c.stop(decision["job"])
    return c.evict(decision["incident"], decision["machines"], reason=decision["reason"])


def _stop_and_implicate(c: Controller, decision: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Stop the job, reading its logs in the same sessions. When they say on which machine the failure started
    (and it is not the job's own code), that is recorded against the incident; a machine implicated this way
    ``repeat_count`` times within ``repeat_window_s``, each time left in the job, is a repeat offender: it is
    evicted now (returned as the rung's result), whatever its diagnosis would say."""
    _, logs = c.stop_and_read_logs(decision["job"])
    culprit = logs.get("culprit")
    if logs["verdict"] == "user_code" or not culprit or culprit not in c.fleet.job(decision["job"]).machine_list:
        return logs, None
    first = logs["machines"].get(culprit) or {}
    c.implicate(decision["incident"], culprit, f"{first.get('class')} {first.get('kind') or ''}: "
                                               f"{first.get('evidence') or ''}")
    before = c.failures_of(decision["job"], culprit, other_than=decision["incident"])
    if len(before) < c.cfg.repeat_count:
        return logs, None
    reason = (f"repeat offender: {culprit} was where the job failed first in incidents {', '.join(map(str, before))} "
              f"within {c.cfg.repeat_window_s:.0f}s, each of which left it in the job; it is swapped out now")
    return logs, {**c.evict(decision["incident"], [culprit], reason=reason), "logs": logs, "repeat_offender": culprit}


def stop_time_diagnosis(c: Controller, decision: dict[str, Any]) -> dict[str, Any]:
    """Stop the job; logs and exit codes; if not the job's own code, L1 -> L2 -> L3 (+ alignment for NaN);
    then what the ladder says: evict what failed, roll back, or restart in place. A repeat offender is
    evicted without a diagnosis."""
    incident = decision["incident"]
    logs, offender = _stop_and_implicate(c, decision)
    if offender is not None:
        return offender
    t = ladder.Triage(decision["job"], decision["category"], tuple(decision["machines"]))
    if logs["verdict"] == "user_code":
        d = ladder.decide(t, level=decision["level"], log_verdict="user_code", rollback_to=decision["rollback_to"])
        return _follow(c, incident, d, {"logs": logs}, decision["rollback_to"])
    diag = c.diagnose(decision["job"], align=bool(decision["diagnose"].get("align")))
    d = ladder.decide(t, level=decision["level"], rollback_to=decision["rollback_to"], diagnosis_done=True,
                      diagnosis_failed=sorted(diag["failed"]))
    return _follow(c, incident, d, {"logs": logs, "diagnosis": diag}, decision["rollback_to"])


def runtime_analysis(c: Controller, decision: dict[str, Any]) -> dict[str, Any]:
    """Stacks of every rank while the job still hangs; over-evict the outliers' parallel group."""
    a = c.analyze(decision["job"], decision["incident"])
    if not a["machines"]:
        if a["refuted"] and c.trains(decision["job"]):  # the alerts' claim is refuted and the job trains on
            return {"swaps": {}, "no_restart": True, "analysis": a,
                    "resolved": f"rank(s) {', '.join(map(str, a['refuted']))} reported stopped were seen running "
                                f"and the job trains: nothing to do"}
        out = stop_time_diagnosis(c, {**decision, "diagnose": {"align": False}})  # nothing stands out
        return {**out, "analysis": a}
    c.stop(decision["job"])
    ev = c.evict(decision["incident"], a["machines"],
                 reason=f"{decision['category']}: ranks {a['outliers']} stand out; {a['group_kind'] or 'machine'} "
                        f"group evicted")
    return {**ev, "analysis": a}


def slow_vote(c: Controller, decision: dict[str, Any]) -> dict[str, Any]:
    """Throughput decline: vote over rounds on each rank's compute time while the job trains; evict the
    group flagged in most rounds (then recover), or nothing when the slowdown was shared or passed."""
    vote = c.vote_slow(decision["incident"])
    if vote.get("superseded") or not vote["machines"]:
        return {"swaps": {}, "no_restart": True, "vote": vote}
    blocked = c.eviction_blocked(decision["incident"], vote["machines"])
    if blocked:  # a slow job trains on: stopping it for an eviction that cannot happen would stop all progress
        return {"swaps": {}, "no_restart": True, "vote": vote,
                "not_evicted": f"the slow {vote['verdict'] or 'machine'} group ({', '.join(vote['machines'])}) was "
                               f"not evicted: {blocked}; the job trains on at its reduced speed"}
    c.stop(decision["job"])
    ev = c.evict(decision["incident"], vote["machines"],
                 reason=f"slow: the {vote['verdict'] or 'machine'} group of {', '.join(vote['machines'])} held the "
                        f"slowest ranks in most of {len(vote['rounds'])} rounds")
    return {**ev, "vote": vote}


def silent_corruption(c: Controller, decision: dict[str, Any]) -> dict[str, Any]:
    """Parameters differ between data-parallel peers (or a failure recurred past a rollback): stop, run
    the alignment test on every machine; when every machine agrees, replay real training steps in groups
    (dual-phase replay); evict the machines either finds (a repeat offender at once)."""
    _logs, offender = _stop_and_implicate(c, decision)
    if offender is not None:
        return offender
    diag = c.diagnose(decision["job"], levels=(), align=True)
    failed = sorted(diag["failed"])
    evidence: dict[str, Any] = {"diagnosis": diag}
    if not failed:  # the alignment test's compute is clean; the fault may show only in training
        try:
            evidence["replay"] = c.dual_phase_replay(decision["job"])
            failed = evidence["replay"]["culprits"]
        except TrainguardError as exc:  # a layout the replay cannot split, too few machines ...
            evidence["replay"] = {"error": str(exc)}
    t = ladder.Triage(decision["job"], decision["category"], tuple(decision["machines"]))
    d = ladder.decide(t, level=decision["level"], diagnosis_done=True, diagnosis_failed=failed, log_verdict="")
    diverged = c.first_step_of(decision["incident"], ["sdc_suspect"])
    if diverged is not None:  # the steps from the divergence on hold corrupted parameters: restore before it
        evidence["restore_max_step"] = max(0, diverged - 1)
    return _follow(c, decision["incident"], d, evidence)


def roll_back(c: Controller, decision: dict[str, Any]) -> dict[str, Any]:
    _logs, offender = _stop_and_implicate(c, decision)
    if offender is not None:  # the failure keeps starting on one machine: that, not the code
        return offender
    return c.rollback(decision["incident"], decision["rollback_to"])


def no_culprit(c: Controller, decision: dict[str, Any]) -> dict[str, Any]:
    _logs, offender = _stop_and_implicate(c, decision)
    return offender if offender is not None else {"swaps": {}, "reattempt": True}


def probe_machine(c: Controller, decision: dict[str, Any]) -> dict[str, Any]:
    """A silent agent: reach its machine over SSH and run L1. Unreachable or unhealthy: a machine fault (stop,
    evict, restart). Healthy: its agent is restarted and the job left alone (the fresh agent reports whatever
    happened to the job's ranks meanwhile)."""
    probe = c.probe(decision["incident"], decision["machines"])
    if not probe["faulty"]:
        return {"swaps": {}, "no_restart": True, "probe": probe,
                "resolved": "; ".join(f"{m}: {why}" for m, why in sorted(probe["restarted"].items()))}
    c.stop(decision["job"])
    ev = c.evict(decision["incident"], sorted(probe["faulty"]),
                 reason="silent agent, and the machine " + "; ".join(f"{m} {why}" for m, why in
                                                                   sorted(probe["faulty"].items())))
    return {**ev, "probe": probe}


# the function of each rung (by its task id in :data:`operators.policy.rungs.RUNGS`)
RUNG_ACTIONS = {"evict_now": evict_now, "stop_time_diagnosis": stop_time_diagnosis,
                "runtime_analysis": runtime_analysis, "slow_vote": slow_vote, "silent_corruption": silent_corruption,
                "roll_back": roll_back, "no_culprit": no_culprit, "probe_machine": probe_machine}


def _follow(c: Controller, incident: int, d: ladder.Decision, evidence: dict[str, Any],
            rollback_to: str | None = None) -> dict[str, Any]:
    if d.action == "evict":
        return {**c.evict(incident, d.machines, reason=d.reason, max_step=evidence.get("restore_max_step")),
                **evidence}
    if d.action == "rollback" and rollback_to:
        return {**c.rollback(incident, rollback_to), **evidence}
    if d.action in ("reattempt", "replay"):
        return {"swaps": {}, "reattempt": True, "note": d.reason, **evidence}
    return {**c.wait_for_human(incident, d.reason), **evidence}


def _leaves_it_alone(result: dict[str, Any]) -> bool:
    """Whether a rung's result asks for no restart: waiting for a human, a dry run, a slow vote that
    evicted nothing."""
    return bool(result.get("waiting_human") or result.get("dry_run") or result.get("no_restart"))


def restart_job(incident_id: int, results: list[dict[str, Any] | None], *,
                resume_timeout_s: float | None = None) -> dict[str, Any]:
    """After whichever rung ran (skipped ones give None): restart the job on its machine list (standbys
    swapped in by the rung), from what the rung's stop found, restoring its newest committed checkpoint (or
    the step the rung names), unless the rung leaves the job alone. Its input is the rung's XCom only, so
    the task is safe to clear: run again (cleared in the UI, or retried) after the job was restarted once,
    it restarts the job again from what runs now (:func:`restart_again`). Returns a
    :class:`~operators.models.Restart` (with the rung's result when nothing was restarted).
    ``resume_timeout_s``: the run's own limit on the resume wait (None: the setting's)."""
    done = [RungResult.read(r) for r in results if r]
    result = done[0].dump() if done else {"rung": NO_RECOVERY, "restart": False, "no_restart": True}
    c = controller()
    incident_id = int(incident_id)
    limit = {"resume_timeout_s": resume_timeout_s}
    if any(a.kind == "launch" and a.outcome == "done" for a in c.fleet.actions(incident_id)):
        return Restart.read({**restart_again(c, incident_id), **limit}).dump()
    if not result["restart"]:
        return Restart.read({**result, "restarted": False}).dump()
    out = c.recover(incident_id, restore_max_step=result.get("restore_max_step"), found=result.get("stopped"))
    return Restart.read({**out, "restarted": True, **limit}).dump()


def restart_again(c: Controller, incident_id: int) -> dict[str, Any]:
    """``restart_job`` run again after it restarted the job (an operator cleared it, or a retry): the
    incident opens again (unless another incident of the job is open: then that one's run acts, and this
    refuses), the job is stopped and started again on its machines, from its newest committed checkpoint;
    the tasks after it check the resume and close the incident again."""
    inc = c.fleet.incident(incident_id)
    if inc.state != "open":  # closed, or waiting for a human who now asks for the restart
        busy = _open_incidents(c, inc.job, other_than=incident_id)
        if busy:
            raise TrainguardError(f"incident {busy[0]} of job {inc.job} is open and its run acts on the job; "
                                  f"clear this task again once it closed")
        c.fleet.update_incident(incident_id, state="open",
                                summary=f"{inc.summary}; restarted again (its run's restart_job ran again)")
    begun = time.time()
    out = c.recover(incident_id)
    return Restart.read({**out, "restarted": True, "again": True, "again_ts": begun}).dump()


def resumed(incident_id: int, recovery: dict[str, Any], c: Controller | None = None) -> dict[str, Any] | None:
    """For the resume trigger: a :class:`~operators.models.Resume` once training passed the restored step;
    ``failed`` once the restart ended without a step or did not get there within ``resume_timeout_s``;
    ``pending`` when explicit machine faults joined the incident meanwhile; else None (ask again). ``c``: a
    controller to reuse between calls (the trigger keeps one)."""
    rec = Restart.read(recovery)
    if not rec.restarted:
        return Resume(skipped=True).dump()
    recovery = rec.dump()
    c = c or controller()
    pending = c.unhandled_faults(int(incident_id))
    if pending:
        return Resume(pending=pending).dump()
    try:
        info = c.resumed(recovery["job"], recovery["restart_ts"])
    except TrainguardError as exc:
        return Resume(failed=str(exc)).dump()
    limit = rec.resume_timeout_s or c.cfg.resume_timeout_s
    if info is None and time.time() - float(recovery["restart_ts"]) > limit:
        return Resume(failed=f"training did not pass the restored step within {limit:.0f}s of "
                             f"the restart").dump()
    return None if info is None else Resume.read(info).dump()


def _wait_resumed(c: Controller, incident_id: int, recovery: dict[str, Any], *, poll_s: float = 2.0
                  ) -> dict[str, Any]:
    """:func:`resumed`'s answer, polled until it is one (the follow-up restarts of :func:`escalate`)."""
    while True:
        info = resumed(incident_id, recovery, c)
        if info is not None:
            return info
        time.sleep(poll_s)


def escalate(c: Controller, incident_id: int, why: str, *, resume_timeout_s: float | None = None) -> dict[str, Any]:
    """A recovery that did not hold climbs on instead of leaving the job dead: before each new restart (at
    most ``restart_attempts``) the controller removes what stands in the way (explicit faults that joined,
    machines that failed, the last copies of a checkpoint still on evicted machines: :meth:`Controller.
    before_retry`); when that runs out, the incident and the job wait for a human, with why and what next.
    ``resume_timeout_s``: the run's own limit on each resume wait (None: the setting's)."""
    tried: list[str] = []
    for _attempt in range(c.cfg.restart_attempts):
        try:
            step = c.before_retry(incident_id, why)
            if step.get("give_up"):
                why = step["give_up"]
                break
            tried.append(step["did"])
            out = c.recover(incident_id, found=c.stop_found(c.fleet.incident(incident_id).job))
        except TrainguardError as exc:  # the escalation itself failed (a machine lost meanwhile): climb on
            why = f"the restart itself failed: {exc}"
            continue
        if out.get("waiting_human"):
            return c.timeline(incident_id)
        recovery = {"restarted": True, **out, "resume_timeout_s": resume_timeout_s}
        info = _wait_resumed(c, incident_id, recovery)
        if not info.get("failed") and not info.get("pending"):
            return c.close(incident_id, outcome="resolved", resumed=info,
                           steps_before=int(out.get("steps_before", -1)),
                           note=f"resumed at step {info['first_step']} after {len(tried)} more restart(s): "
                                f"{'; '.join(tried)}")
        why = info.get("failed") or "explicit faults joined again: " + ", ".join(sorted(info["pending"]))
    reason = (f"recovery did not hold: {why}"[:700] + (f"; tried: {'; '.join(tried)}"[:400] if tried else "")
              + "; next: look at 'tg-node logs --job J' on its machines, fix what stands in the way, then resolve "
                "the incident (or trigger tg_diagnose with evict)")
    c.wait_for_human(incident_id, reason)
    return c.timeline(incident_id)


def close(incident_id: int, decision: dict[str, Any] | None, recovery: dict[str, Any] | None,
          resume: dict[str, Any] | None) -> dict[str, Any]:
    """Close the incident: resolved when training resumed (or nothing needed recovering and the job trains);
    a restart that did not hold, a rung that failed or a job left down escalates (:func:`escalate`); an
    incident waiting for a human stays so. ``decision``: what ``no_recovery`` returned (its ``action``), None
    when a rung handled the incident."""
    c = controller()
    incident_id = int(incident_id)
    inc = c.fleet.incident(incident_id)
    if inc.state == "waiting_human":
        return c.timeline(incident_id)
    restarted = bool(recovery and recovery.get("restarted"))
    if restarted and resume and not resume.get("skipped") and not resume.get("failed") and not resume.get("pending"):
        if recovery.get("again"):  # its second restart: the job was down from the stop to the resume
            start = float(recovery["again_ts"])
            c.fleet.add_ettr(inc.job, "recovery", start, max(start, float(resume["ts"])),
                             incident_id=incident_id, detail="restarted again (restart_job ran again)")
            return c.close(incident_id, outcome="resolved",
                           note=f"resumed at step {resume['first_step']} after the restart again")
        return c.close(incident_id, outcome="resolved", resumed=resume,
                       steps_before=int(recovery.get("steps_before", -1)),
                       note=f"resumed at step {resume['first_step']} ({time.time() - inc.first_alert_ts:.1f}s "
                            f"after the first alert)")
    if restarted:  # the restart did not hold, faults joined after it, or the resume check itself failed
        why = (resume or {}).get("failed") or (
            "explicit faults joined after the restart: " + ", ".join(sorted((resume or {})["pending"]))
            if (resume or {}).get("pending") else "the resume check ended without an answer")
        return escalate(c, incident_id, why, resume_timeout_s=recovery.get("resume_timeout_s"))
    vote = (recovery or {}).get("vote") or {}
    if vote.get("superseded"):  # stronger alerts took the incident over: its new run closes it
        return c.timeline(incident_id)
    if (recovery or {}).get("error"):  # the rung itself failed: the job may be stopped halfway
        if c.trains(inc.job):
            return c.close(incident_id, outcome="failed", note=f"{recovery['error']}; the job still trains; next: "
                                                               f"look at the task's log, then trigger tg_diagnose")
        return escalate(c, incident_id, recovery["error"])
    if (recovery or {}).get("not_evicted") and c.trains(inc.job):  # closed (failed), so that later alerts
        # open incidents of their own instead of joining one that waits while the job trains
        return c.close(incident_id, outcome="failed", note=recovery["not_evicted"])
    if vote and not vote.get("machines"):
        return c.close(incident_id, outcome="resolved",
                       note=f"no rank stood out in most of {len(vote['rounds'])} rounds: a shared or passing "
                            f"slowdown, nothing evicted")
    if decision and decision.get("action") in ("tolerate", "observe"):
        return c.close(incident_id, outcome="resolved", note=f"no recovery needed ({decision['action']})")
    if recovery and recovery.get("resolved"):  # a rung that needed no restart (an agent restarted ...)
        return c.close(incident_id, outcome="resolved", note=str(recovery["resolved"]))
    if c.trains(inc.job):
        return c.close(incident_id, outcome="failed",
                       note="the incident's run ended without a recovery while the job trains on; next: look at "
                            "its tasks' logs")
    return escalate(c, incident_id, "the incident's run ended without a recovery and the job does not train")


def _open_incidents(c: Controller, job: str, *, other_than: int | None = None) -> list[int]:
    """The ids of the job's open incidents (open or waiting for a human), oldest first, but ``other_than``."""
    return [i.id for i in c.fleet.incidents(job) if i.state in OPEN_INCIDENT_STATES and i.id != other_than]


def _arm_unless_busy(c: Controller, job: str, *, own_incident: int | None = None) -> dict[str, Any]:
    """Warm interpreters on every machine of a running job that has none ready, unless another incident of
    the job is open: its own run re-arms when it ends (arming here would race its restart)."""
    others = _open_incidents(c, job, other_than=own_incident)
    if others:
        return {"skipped": f"incident {others[0]} of job {job} is open; its run re-arms when it ends"}
    state = c.fleet.job(job).state
    if state != "running":
        return {"skipped": f"job {job} is {state}"}
    return c.arm(job)


def rearm(incident_id: int) -> dict[str, Any]:
    """When the incident's run ends: warm interpreters again on every machine of the job, for the next
    restart (after this run's restart consumed them, or after another run skipped its re-arm while this
    incident was open)."""
    c = controller()
    return _arm_unless_busy(c, c.fleet.incident(incident_id).job, own_incident=incident_id)


def outcome(incident_id: int) -> dict[str, Any]:
    """The run's last task: fails when the incident failed or waits for a human, so the run's colour in
    the UI says how the incident ended (its record holds the details)."""
    c = controller()
    inc = c.fleet.incident(int(incident_id))
    note = incident_note(c, int(incident_id))
    _note(note)
    if inc.state in ("failed", "waiting_human"):
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
        elif a.kind == "rollback" and a.outcome == "done":
            parts.append(f"rolled back {a.evidence.get('from')} -> {a.evidence.get('to')}")
    if inc.resumed_ts and inc.first_alert_ts:
        parts.append(f"resumed {inc.resumed_ts - inc.first_alert_ts:.0f}s after the first alert"
                     + (f", {inc.lost_steps} steps lost" if inc.lost_steps is not None else ""))
    elif inc.summary:
        parts.append(inc.summary.split("; ")[-1])
    head = f"incident {inc.id} {inc.state.replace('_', ' ')} ({inc.category or 'untriaged'})"
    return head + (": " + "; ".join(parts) if parts else "")


def _note(text: str) -> None:
    """The run's one-line note, in the UI (see :mod:`operators.airflow.notes`)."""
    from operators.airflow.notes import set_run_note

    set_run_note(text)


def no_recovery(decision: dict[str, Any]) -> dict[str, Any]:
    c = controller()
    if decision["action"] == "wait_human":
        c.wait_for_human(decision["incident"], decision["reason"])
    return {"action": decision["action"], "reason": decision["reason"]}


# ---- by hand: tg_sdc_replay, tg_diagnose --------------------------------------------------------------
def _incident_by_hand(c: Controller, job: str, summary: str) -> int:
    """An incident recording an operation run by hand (refused while the job has one open: alerts join
    the open incident, and two hands on one job is one too many)."""
    busy = _open_incidents(c, job)
    if busy:
        raise TrainguardError(f"job {job} has incident {busy[-1]} open; run this by hand once it is closed")
    inc, _ = c.fleet.open_incident(job, [], category="manual")
    c.fleet.update_incident(inc.id, summary=summary, diagnosis_start_ts=time.time())
    return inc.id


def _finish_by_hand(c: Controller, incident: int, culprits: list[str], *, evict: bool, reason: str,
                    restart: bool, note: str) -> dict[str, Any]:
    """Evict ``culprits`` (if asked, through the breaker), restart the job when it was stopped or its
    machines changed, close the incident. Over the breaker, the incident waits for a human."""
    out: dict[str, Any] = {"incident": incident}
    c.fleet.update_incident(incident, decided_ts=time.time())
    if evict and culprits:
        out["eviction"] = c.evict(incident, culprits, reason=reason)
    if c.fleet.incident(incident).state == "waiting_human":
        return out
    if restart or (out.get("eviction") or {}).get("swaps"):
        out["recovery"] = c.recover(incident)
    out["closed"] = c.close(incident, outcome="resolved", note=note)["state"]
    return out


def replay_prepare(job: str, k: int) -> dict[str, Any]:
    """A dual-phase replay by hand: an incident records it; the job is stopped; returns the plan."""
    c = controller()
    plan = c.replay_plan(job, k=k)
    incident = _incident_by_hand(c, job, f"dual-phase replay by hand (k={k})")
    c.stop(job)
    return {**plan, "incident": incident}


def replay_phase(plan: dict[str, Any], phase: str) -> dict[str, str]:
    """One phase of the replay: ``horizontal`` (with the standbys' reference group) or ``vertical``."""
    return controller().replay_phase(plan, phase)


def replay_conclude(plan: dict[str, Any] | None, h: dict[str, str] | None, v: dict[str, str] | None,
                    evict: bool) -> dict[str, Any]:
    """The culprits; with ``evict``, replace them with standbys; then restart the job (its newest
    committed checkpoint) and close the incident. A phase that failed leaves no verdict; the job is
    restarted all the same."""
    if not plan:
        raise TrainguardError("the replay was not prepared (see the prepare task's log); nothing to conclude")
    c = controller()
    verdict = c.replay_verdict(plan, h, v) if h is not None and v is not None else None
    culprits = verdict["culprits"] if verdict else []
    note = (f"culprits {', '.join(culprits)}" if culprits else "no culprit" if verdict else
            "a phase failed: no verdict") + "; job restarted"
    done = _finish_by_hand(c, int(plan["incident"]), culprits, evict=evict, restart=True, note=note,
                           reason=f"dual-phase replay by hand: {', '.join(culprits)} computed wrong")
    _note(f"{plan.get('job', '')}: replay {note}" + (" (culprits evicted)" if evict and culprits else ""))
    return {**done, "verdict": verdict, "culprits": culprits}


# ---- tg_diagnose ------------------------------------------------------------------------------------------
def diagnose_targets(job: str, machines: list[str], level: int) -> list[dict[str, Any]]:
    """One target per machine to diagnose (the job's machines when none are named)."""
    c = controller()
    names = list(machines) or list(c.fleet.job(job).machine_list)
    for n in names:
        c.inventory.machine(n)  # an unknown name: a one-line error naming the machines there are
    return [{"job": job, "machine": n, "level": int(level)} for n in names]


def _name_mapped_task(machine: str) -> None:
    """Names the running mapped task after its machine in the UI (its ``map_index_template``)."""
    from airflow.sdk import get_current_context

    get_current_context()["machine"] = machine


def diagnose_machine(target: dict[str, Any]) -> dict[str, Any]:
    """L1, then L2 (when the level asks) on one machine: one mapped task each, in the SSH pool."""
    _name_mapped_task(target["machine"])
    levels = tuple(range(1, min(int(target["level"]), 2) + 1))
    out = controller().diagnose(target["job"], [target["machine"]], levels=levels)
    return {"machine": target["machine"], "failed": out["failed"].get(target["machine"]),
            "report": {lv: r.get(target["machine"]) for lv, r in out["report"].items()}, "seconds": out["seconds"]}


def diagnose_neighbours(job: str, results: list[dict[str, Any]], level: int) -> dict[str, Any]:
    """L3 (collectives with neighbours, in pairs) on the machines that passed L1/L2, when asked."""
    passed = [r["machine"] for r in results if not r["failed"]]
    if int(level) < 3 or len(passed) < 2:
        return {"failed": {}, "skipped": True}
    out = controller().diagnose(job, passed, levels=(3,))
    return {"failed": out["failed"], "report": out["report"].get("L3", {})}


def diagnose_conclude(job: str, results: list[dict[str, Any]], neighbours: dict[str, Any] | None,
                      evict: bool) -> dict[str, Any]:
    """Every machine's verdict; with ``evict``, the failed ones are replaced by standbys, the job restarts
    on its new machine list, and an incident records it."""
    failed = {r["machine"]: r["failed"] for r in results if r["failed"]}
    failed.update((neighbours or {}).get("failed") or {})
    out: dict[str, Any] = {"job": job, "machines": [r["machine"] for r in results], "failed": failed}
    if evict and failed:
        c = controller()
        incident = _incident_by_hand(c, job, f"diagnosis by hand: {', '.join(sorted(failed))} failed")
        out.update(_finish_by_hand(c, incident, sorted(failed), evict=True, restart=False,
                                   reason="failed a diagnosis run by hand",
                                   note=f"{', '.join(sorted(failed))} failed a diagnosis run by hand"))
    verdicts = "; ".join(f"{m} failed {str(why)[:80]}" for m, why in sorted(failed.items()))
    n = len(out["machines"])
    _note(f"{job}: {n} machine{'' if n == 1 else 's'} diagnosed; " + (verdicts + ("; evicted" if evict else "")
                                                                      if failed else "all passed"))
    return out


# ---- tg_ettr ----------------------------------------------------------------------------------------------
def ettr_reports(job: str, window_s: float) -> dict[str, Any]:
    """The ETTR report of ``job`` (every job in the fleet database when empty); a job with no steps yet
    is listed with its error."""
    c = controller()
    names = [job] if job else [j.name for j in c.fleet.jobs()]
    out: dict[str, Any] = {}
    for name in names:
        try:
            out[name] = c.ettr_report(name, window_s=window_s)
        except TrainguardError as exc:
            out[name] = {"error": str(exc)}
            continue
        # kept in the audit trail: the metrics exporter publishes the newest report of each job
        rep = out[name]
        c.fleet.record_action(f"ettr_report:{name}:{time.time():.3f}", kind="ettr_report",
                              evidence={"cumulative": rep["cumulative"]["ettr"], "sliding": rep["sliding"]["ettr"],
                                        "window_s": window_s, "by_cause": rep["by_cause"]})
    _note("; ".join(f"{n}: {r['error']}" if "error" in r else
                    f"{n}: ETTR {r['cumulative']['ettr']:.1%} since its first step, {r['sliding']['ettr']:.1%} over "
                    f"the last {window_s:.0f}s" for n, r in out.items()) or "no job")
    return out


# ---- tg_standby_pool --------------------------------------------------------------------------------------
def pool_plan(target: int) -> dict[str, Any]:
    """Size the pool (``target`` < 0: from the fleet's failure history), retire repeat offenders and claim
    the machines to self-check; returns the plan and one target per machine."""
    from operators import standby_pool

    c = controller()
    the_plan = standby_pool.plan(c, target=None if int(target) < 0 else int(target))
    return {"plan": the_plan, "targets": standby_pool.claim(c, the_plan)}


def pool_check(target: dict[str, Any]) -> dict[str, Any]:
    """One machine's self-check (L1 + L2); healthy ones are parked warm as standbys, the rest repaired."""
    _name_mapped_task(target["machine"])
    from operators import standby_pool

    return standby_pool.check(controller(), target)


def pool_conclude(planned: dict[str, Any], results: list[dict[str, Any]] | None) -> dict[str, Any]:
    from operators import standby_pool

    out = standby_pool.summary(planned["plan"], list(results or []))
    _note(out["note"])
    return out


# ---- tg_code_update ---------------------------------------------------------------------------------------
def code_update(job: str, revision: str, urgency: str, reason: str) -> dict[str, Any]:
    """A request from the form (job given): urgent/rollback -> hot update now, lazy -> pending. Without a
    job (the schedule): the sweep, forcing overdue lazy updates and marking known-good revisions."""
    from operators import code_updates

    c = controller()
    if not job:
        swept = code_updates.sweep(c, force_after_s=c.cfg.lazy_force_s, known_good_steps=c.cfg.known_good_steps)
        forced = [dict(f["forced"]) for f in swept.values() if f.get("forced", {}).get("restarted")]
        return {"sweep": swept, "restarted": bool(forced), "restarts": forced}
    out = code_updates.request(c, job, revision, urgency, reason)
    return {**out, "restarts": [out] if out.get("restarted") else []}


def code_resumed(update: dict[str, Any]) -> dict[str, Any] | None:
    """For the sensor: every restarted job trained past its restored step, or ended without a step
    (then the ladder handles it as an incident); None until each did one or the other."""
    c = controller()
    seen: dict[str, Any] = {}
    ended: dict[str, str] = {}
    for r in update.get("restarts", []):
        try:
            info = c.resumed(r["job"], r["restart_ts"])
        except TrainguardError as exc:
            ended[r["job"]] = str(exc)
            continue
        if info is None:
            return None
        seen[r["job"]] = info
    return {"resumed": seen, "ended": ended}


def code_rearm(update: dict[str, Any]) -> dict[str, Any]:
    """Warm interpreters again beside every restarted job (the update consumed them), unless an incident
    of the job is open: its own run re-arms after its recovery."""
    c = controller()
    return {r["job"]: _arm_unless_busy(c, r["job"]) for r in update.get("restarts", [])}


def code_conclude(update: dict[str, Any], resumed_info: dict[str, Any] | None) -> dict[str, Any]:
    """The run's one-line note."""
    if "sweep" in update:
        parts = [f"{job}: forced {v['forced']['revision']}" if v.get("forced") else
                 f"{job}: {v['revision']} known good" if v.get("known_good") else
                 f"{job}: {v.get('error') or 'nothing due'}" for job, v in update["sweep"].items()]
        _note("; ".join(parts) or "no running job")
        return {**update, "note": "; ".join(parts) or "no running job"}
    if update["action"] == "hot":
        info = (resumed_info or {}).get("resumed", {}).get(update["job"], {})
        note = (f"{update['job']}: {update['from']} -> {update['revision']} in place on "
                f"{', '.join(update['machines'])}, resumed at step {info.get('first_step')} "
                f"({float(info.get('ts', update['restart_ts'])) - update['restart_ts']:.0f}s after the restart)")
        ended = (resumed_info or {}).get("ended", {}).get(update["job"])
        if ended:
            note = (f"{update['job']}: {update['from']} -> {update['revision']} in place on "
                    f"{', '.join(update['machines'])}; the job ended after the restart without a step ({ended}); "
                    f"the ladder handles it as an incident")
        now = controller().fleet.job(update["job"]).revision
        if now != update["revision"]:  # it failed and the ladder rolled it back meanwhile
            note += f"; {update['revision']} did not stay: the job runs {now} now (see its incidents)"
    elif update["action"] == "pending":
        note = f"{update['job']}: {update['reason']}"
    else:
        note = f"{update['job']}: nothing to do ({update['reason']})"
    _note(note)
    return {**update, "resumed": resumed_info, "note": note}


# ---- tg_checkpoint_verify ---------------------------------------------------------------------------------
def _announced(asset_events: Any) -> list[dict[str, Any]]:
    """The notices carried by the asset events that started the run (none for a scheduled or manual run)."""
    out: list[dict[str, Any]] = []
    for events in (dict(asset_events) if asset_events else {}).values():
        for e in events:
            extra = getattr(e, "extra", None) if not isinstance(e, dict) else e.get("extra")
            out += ((extra or {}).get("payload") or {}).get("notices", [])
    return out


def ckpt_targets(job: str, step: int | None, asset_events: Any = None) -> list[dict[str, Any]]:
    """The (job, step) pairs this run verifies: the form's, the notices', or the schedule's sweep."""
    from operators import checkpoints

    return checkpoints.targets(controller(), job=(job or "").strip(), step=step, announced=_announced(asset_events))


def ckpt_verify(target: dict[str, Any]) -> dict[str, Any]:
    from airflow.sdk import get_current_context

    from operators import checkpoints

    get_current_context()["target"] = f"{target['job']} step {target['step']}"
    return checkpoints.verify(controller(), target)


def _s3() -> tuple[Any, Any, dict[str, str]]:
    """Settings, a boto3 client and the machines' credentials, from the Airflow connection
    ``TG_S3_CONN_ID`` (default ``tg_s3``: type aws, ``endpoint_url`` in its extra for an S3-compatible
    store); short timeouts, so an endpoint that is down fails the task in seconds."""
    from airflow.providers.amazon.aws.hooks.s3 import S3Hook
    from botocore.config import Config

    from operators import checkpoints

    hook = S3Hook(aws_conn_id=os.environ.get("TG_S3_CONN_ID", "tg_s3"),
                  config=Config(connect_timeout=5, read_timeout=30, retries={"max_attempts": 2, "mode": "standard"}))
    settings = checkpoints.S3Settings.from_env(endpoint_url=hook.conn_config.endpoint_url or "")
    creds = hook.get_credentials()
    env = checkpoints.s3_credentials(creds.access_key, creds.secret_key, creds.token, hook.conn_region_name)
    return settings, hook.get_conn(), env


def ckpt_promote(verdict: dict[str, Any]) -> dict[str, Any]:
    from airflow.sdk import get_current_context

    from operators import checkpoints

    get_current_context()["target"] = f"{verdict['job']} step {verdict['step']}"
    settings, client, env = checkpoints.S3Settings.from_env(), None, {}
    if verdict.get("ok") and settings.url:  # the S3 connection only when there is something to upload
        settings, client, env = _s3()
    return checkpoints.promote(controller(), verdict, settings, client=client, credentials=env)


def ckpt_conclude(verdicts: list[dict[str, Any]] | None, promotions: list[dict[str, Any]] | None) -> dict[str, Any]:
    """The run's one-line note; the run fails (its ``outcome`` task) when a step was not verified or not
    promoted."""
    from operators import checkpoints

    verdicts, promotions = list(verdicts or []), [p for p in (promotions or []) if p]
    done = {(p["job"], p["step"]) for p in promotions}
    promotions += [{"job": v["job"], "step": v["step"], "promoted": False,
                    "problems": ["the promote task failed: see its log"]}
                   for v in verdicts if v["ok"] and (v["job"], v["step"]) not in done]
    failed = [v for v in verdicts if not v["ok"]] + [p for p in promotions if p.get("problems")]
    note = checkpoints.note(verdicts, promotions)
    _note(note)
    return {"note": note, "ok": not failed, "verdicts": verdicts,
            "promotions": promotions}


def ckpt_outcome(concluded: dict[str, Any]) -> dict[str, Any]:
    if not concluded.get("ok"):
        raise TrainguardError(concluded.get("note") or "checkpoint verification failed")
    return {"note": concluded["note"]}

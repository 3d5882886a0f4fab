"""The ladder's rungs as a typed pipeline: each branch task of ``tg_incident`` (listed in
:data:`trainguard.operators.policy.rungs.RUNGS`) reads the triage's decision, gathers its evidence from the services
of :mod:`trainguard.operators.control` into :class:`~trainguard.operators.models.Evidence`, and hands it to the ladder
(:mod:`trainguard.operators.policy.ladder`), whose :class:`~trainguard.operators.policy.ladder.Verdict` says what the
rung does: evict (``swap_machines`` acts), roll back, restart as it is, wait for a human, or leave the job alone.
A rung stops the job itself only when its evidence needs a stopped job (the logs read as it stops, the diagnosis of
its machines); otherwise ``stop_job`` stops it. Every rung's answer is a
:class:`~trainguard.operators.models.RungResult`.

Before the rung gathers anything, two things may send the incident elsewhere: an explicit machine fault that joined
it since the triage decides it (the first rung: evict that machine alone), and a job run as replica groups whose
incident is confined to some of them takes the degrade path (those groups out, healed from a live replica, while the
others train on). The slow vote and the silent-corruption replay wait in the triggerer between their steps
(:class:`~trainguard.operators.operators.vote.SlowVoteOperator`,
:class:`~trainguard.operators.operators.replay.SilentCorruptionOperator`): :func:`vote_begin` / :func:`vote_end` and
:func:`sdc_begin` / :func:`sdc_phase_done` are their halves.

Each pipeline is written straight through, a service call or a verdict a line, so that following one decision reads
one function: ``python scripts/walk.py`` measures how far it walks.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from trainguard.core.errors import TrainguardError
from trainguard.operators.control import Controller
from trainguard.operators.jobspec import replica_groups
from trainguard.operators.models import DiagnosisReport, Evidence, IncidentDecision, Logs, RungResult, StopFound
from trainguard.operators.policy import degrade, ladder
from trainguard.operators.policy.ladder import Verdict


def handle(c: Controller, name: str, decision: Mapping[str, Any]) -> dict[str, Any]:
    """The rung ``name`` (a task id of :data:`trainguard.operators.policy.rungs.RUNGS`) on the triage's ``decision``:
    its evidence and its verdict, as a :class:`~trainguard.operators.models.RungResult` (whether the job is to
    restart, what to evict, what the rung's own stop found). A rung that fails returns its error (the incident's close
    escalates from there)."""
    c.handling(int(decision["incident"]))
    name, d, redirected = _redirected(c, name, IncidentDecision.model_validate(decision))
    return _result(c, name, d, lambda: _degraded_or(c, name, d), redirected)


def _redirected(c: Controller, name: str, d: IncidentDecision) -> tuple[str, IncidentDecision, dict[str, Any]]:
    """An explicit machine fault that joined the incident before its rung acted decides it: the first rung (evict
    that machine alone) instead of ``name``. Returns the rung to run, its decision, and what the result records of
    the change ({} when there was none)."""
    if name == "evict_now":
        return name, d, {}
    serving = c.fleet.job(d.job).machine_list
    explicit = ladder.explicit_faults([a.document for a in c.fleet.alerts_of(d.incident, kinds=ladder.EXPLICIT
                                                                              | ladder.XID)], serving)
    why = ladder.joined_fault(name, explicit)
    if not why:
        return name, d, {}
    c.fleet.update_incident(d.incident, category="machine_fault", summary=f"{why}; next: evict")
    instead = IncidentDecision.model_validate({**d.model_dump(mode="json"), "category": "machine_fault",
                                               "action": "evict", "machines": sorted(explicit), "reason": why})
    return "evict_now", instead, {"instead_of": name}


def _result(c: Controller, name: str, d: IncidentDecision, act: Callable[[], dict[str, Any]],
            extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The rung's result as a :class:`~trainguard.operators.models.RungResult` (its error, when it failed); what the
    rung's own stop found comes from the controller's memory of it."""
    try:
        result = act()
    except TrainguardError as exc:
        return RungResult(rung=name, restart=False, error=f"{name} failed: {exc}"[:900],
                          no_restart=True).model_dump(mode="json")
    found = c.memory.stopped.get(d.job)
    leaves = bool(result.get("waiting_human") or result.get("dry_run") or result.get("no_restart"))
    return RungResult.model_validate({**result, **(extra or {}), "rung": name, "restart": not leaves,
                                      "stopped": StopFound.model_validate(found) if found else None}
                                     ).model_dump(mode="json")


def _acted(c: Controller, d: IncidentDecision, v: Verdict, evidence: Evidence) -> dict[str, Any]:
    """What the verdict asks, as the rung's result: an eviction for ``swap_machines``, a rollback or a wait for a
    human done now (recorded on the incident), a restart as it is, or the job left alone; with the evidence."""
    ev = evidence.model_dump(mode="json", exclude_none=True)
    if v.kind == "evict":
        return {"evict": {"machines": list(v.machines), "reason": v.reason, "max_step": v.max_step,
                          "priority": list(v.priority)}, **ev}
    if v.kind == "rollback":
        return {**c.evictions.rollback(d.incident, str(v.revision)), **ev}
    if v.kind == "reattempt":
        return {"swaps": {}, "reattempt": True, **({"note": v.reason} if v.reason else {}), **ev}
    if v.kind == "wait_human":
        return {**c.fleet.wait_for_human(d.incident, v.reason), **ev}
    left = {"reason": v.reason, "resolved": v.resolved, "not_evicted": v.not_evicted}
    return {"swaps": {}, "no_restart": True, **{k: x for k, x in left.items() if x}, **ev}


# ---- the degrade path ----------------------------------------------------------------------------------------------
def _degraded_or(c: Controller, name: str, d: IncidentDecision) -> dict[str, Any]:
    """A job run as replica groups whose incident is confined to some of them takes the degrade path (those groups
    out, their machines swapped, healed from a live replica while the others train on:
    :meth:`~trainguard.operators.control.degrade.Degrade.take_out`); anything else, or groups whose logs blame the
    job's own code, goes to the rung ``name``, which stops the whole job. For a replica job the result says which
    ``path`` it took and why. A slow vote decides its path once it named the slow group, a silent agent's probe once
    it found its machine unreachable or unhealthy (:func:`_evicting_groups`)."""
    if d.action == ladder.Action.VOTE:
        return _evicting_groups(c, d, RUNG_ACTIONS[name](c, d))
    if d.action == ladder.Action.PROBE:  # a machine fault once the probe says so: its groups alone leave
        return _evicting_groups(c, d, RUNG_ACTIONS[name](c, d), category=ladder.Category.MACHINE_FAULT, key="probe")
    replicated = replica_groups(c.fleet.job(d.job), degrading=True) is not None
    degraded, why, p = _degrade_first(c, d) if replicated else (None, "", None)
    if degraded is not None:
        return degraded
    result = RUNG_ACTIONS[name](c, d)
    return result if p is None else {**result, "path": degrade.STOP_WORLD if p.path != degrade.NONE else degrade.NONE,
                                     "path_reason": why}


def _evicting_groups(c: Controller, d: IncidentDecision, result: dict[str, Any], *, category: str | None = None,
                     key: str = "vote") -> dict[str, Any]:
    """A rung's result that evicts (the slow vote's, or a probe's: its evidence under ``key``), or, when the group it
    would evict lies in replicas a replica job may lose, the degrade path for those machines instead, as an incident
    of ``category`` (None: its own) that evicts them (the evidence kept in the result)."""
    machines = (result.get("evict") or {}).get("machines")
    if not machines or replica_groups(c.fleet.job(d.job), degrading=True) is None:
        return result
    as_fault = {"category": str(category), "action": ladder.Action.EVICT.value} if category else {}
    degraded, why, p = _degrade_first(c, IncidentDecision.model_validate({**d.model_dump(mode="json"),
                                                                          "machines": list(machines), **as_fault}))
    if degraded is not None:
        return {**degraded, key: result.get(key)}
    return result if p is None else {**result, "path": degrade.STOP_WORLD, "path_reason": why}


def _degrade_first(c: Controller, d: IncidentDecision) -> tuple[dict[str, Any] | None, str, Any]:
    """The degrade path of the decision when it takes it: ``(the rung's result, why, the plan)``; ``(None, why the
    world stops, the plan)`` otherwise (the plan None: the job is not run as replica groups)."""
    p = c.degrade.degrade_plan(d.model_dump(mode="json"))
    if p is None:
        return None, "", None
    if p.path != degrade.DEGRADE:
        return None, p.reason, p
    out = c.degrade.take_out(d.incident, p)
    if "degraded" not in out:
        return None, out["stop_world"], p
    g = out["degraded"]
    where = (f"{', '.join(g['left'])} swapped for {', '.join(g['machines'])}" if g.get("swaps")
             else f"restarted in place on {', '.join(g['left'])}" if g.get("machines") else "left out")
    c.fleet.update_incident(d.incident, summary=f"path: degrade ({p.reason}); replica(s) "
                            f"{', '.join(map(str, p.replicas))} {where}; healing from a live replica")
    return ({"no_restart": True, "path": degrade.DEGRADE, "path_reason": p.reason, "degraded": g,
             **({"waiting_human": True, "reason": g.get("reason", "")} if g.get("waiting_human") else {})},
            p.reason, p)


# ---- the rungs -----------------------------------------------------------------------------------------------------
def evict_now(c: Controller, d: IncidentDecision) -> dict[str, Any]:
    """An explicit machine fault: evict the machines (no diagnosis), restart. A decision naming no machine of the job
    (an alert about a machine that left it) touches nothing."""
    v = ladder.evict_named(d.job, d.machines, c.fleet.job(d.job).machine_list, d.reason)
    return _acted(c, d, v, Evidence())


def restart_at_once(c: Controller, d: IncidentDecision) -> dict[str, Any]:
    """A first crash naming its machines, with no machine alert: stop the job reading its logs (a repeat offender is
    evicted, logs that blame the job's own code roll it back, as on the stop-time diagnosis' rung), then restart it
    in place at once, from what the stop found; then L1 of the machine where the crash started, while the job
    restores. The check failed: the stop-time diagnosis decides instead (it stops the restarted job, L1 -> L2 -> L3
    on every machine, evicts what fails). ``restart_job`` adopts the rung's restart."""
    logs, offender = _stop_and_implicate(c, d)
    v = ladder.after_stop(d.job, d.category, d.machines, level=d.level, rollback_to=d.rollback_to,
                          log_verdict=logs.verdict, offender=offender)
    if v.kind != "diagnose":
        return _acted(c, d, v, Evidence(logs=logs, repeat_offender=offender.machines[0] if offender else None))
    gone = c.unreachable(d.job)
    if gone:  # a machine the stop could not reach is not restarted onto: it is evicted
        return _acted(c, d, ladder.evict_unreachable(gone), Evidence(logs=logs))
    serving = c.fleet.job(d.job).machine_list
    suspects = [logs.culprit] if logs.culprit in serving else [m for m in d.machines if m in serving]
    relaunched = c.recovery.recover(d.incident, found=c.memory.stopped.get(d.job))
    if relaunched.get("waiting_human"):  # the restart itself failed on every try: recover() says why
        return {"relaunched": relaunched, "waiting_human": True, "reason": relaunched.get("reason", ""),
                **Evidence(logs=logs).model_dump(mode="json", exclude_none=True)}
    check = DiagnosisReport.model_validate(c.diagnosis.diagnose(d.job, suspects, levels=(1,))) if suspects else None
    if check is not None and check.failed:
        what = "; ".join(f"{m}: {why}" for m, why in sorted(check.failed.items()))[:300]
        c.fleet.update_incident(d.incident, summary=f"{c.fleet.incident(d.incident).summary}; but L1 beside the "
                                                    f"restore failed ({what}): stop-time diagnosis",
                                diagnosis_start_ts=time.time())
        return {**stop_time_diagnosis(c, d), "check": check.model_dump(mode="json"),
                "rung_launched_ts": relaunched["restart_ts"]}
    return {"swaps": {}, "reattempt": True, "relaunched": relaunched, "rung_launched_ts": relaunched["restart_ts"],
            **({"check": check.model_dump(mode="json")} if check is not None else {}),
            **Evidence(logs=logs).model_dump(mode="json", exclude_none=True)}


def stop_time_diagnosis(c: Controller, d: IncidentDecision) -> dict[str, Any]:
    """Stop the job and read its logs (the machine where the failure started recorded; a repeat offender evicted at
    once); logs that blame the job's own code roll it back; else L1 -> L2 -> L3 (+ alignment for NaN), and the
    ladder's verdict on what failed: evict it, or restart in place."""
    _said, doc = c.jobs.stop_and_read_logs(d.job, incident=d.incident)
    logs = Logs.model_validate(doc)
    offender = ladder.repeat_offender(logs.culprit, logs.implicated, count=c.cfg.repeat_count,
                                      window_s=c.cfg.repeat_window_s)
    v = ladder.after_stop(d.job, d.category, d.machines, level=d.level, rollback_to=d.rollback_to,
                          log_verdict=logs.verdict, offender=offender)
    if v.kind != "diagnose":
        return _acted(c, d, v, Evidence(logs=logs, repeat_offender=offender.machines[0] if offender else None))
    diag = DiagnosisReport.model_validate(c.diagnosis.diagnose(d.job, align=bool(d.diagnose.get("align"))))
    v = ladder.after_diagnosis(d.job, d.category, d.machines, level=d.level, rollback_to=d.rollback_to,
                               failed=list(diag.failed))
    return _acted(c, d, v, Evidence(logs=logs, diagnosis=diag))


def _stop_and_implicate(c: Controller, d: IncidentDecision) -> tuple[Logs, Verdict | None]:
    """Stop the job, reading its logs in the same sessions; the machine where they say the failure started recorded,
    and the verdict when it is a repeat offender (evict it now), else None."""
    _said, doc = c.jobs.stop_and_read_logs(d.job, incident=d.incident)
    logs = Logs.model_validate(doc)
    return logs, ladder.repeat_offender(logs.culprit, logs.implicated, count=c.cfg.repeat_count,
                                        window_s=c.cfg.repeat_window_s)


def runtime_analysis(c: Controller, d: IncidentDecision) -> dict[str, Any]:
    """Stacks of every rank while the job still hangs; over-evict the outliers' parallel group. Nothing stands out:
    the stop-time diagnosis, unless the ranks reported stopped were seen running and the job trains. Every rank past
    the stall: nothing to do (a pause of the job's own)."""
    a = c.analysis.analyze(d.job, d.incident)
    v = ladder.after_analysis(str(d.category), a)
    if v.kind in ("evict", "leave"):
        return _acted(c, d, v, Evidence(analysis=a))
    if a["refuted"] and c.jobs.trains(d.job):  # the alerts' claim is refuted and the job trains on
        why = (f"rank(s) {', '.join(map(str, a['refuted']))} reported stopped were seen running and the job trains: "
               f"nothing to do")
        return _acted(c, d, Verdict("leave", resolved=why), Evidence(analysis=a))
    plain = IncidentDecision.model_validate({**d.model_dump(mode="json"), "diagnose": {"align": False}})
    return {**stop_time_diagnosis(c, plain), "analysis": a}


def slow_vote(c: Controller, d: IncidentDecision) -> dict[str, Any]:
    """Throughput decline: vote over rounds on each rank's compute time while the job trains; evict the group flagged
    in most rounds (then recover), or nothing when the slowdown was shared or passed. In Airflow the rounds are taken
    in the triggerer (:class:`trainguard.operators.operators.vote.SlowVoteOperator`), then :func:`slow_vote_decide`
    decides as here."""
    return slow_vote_decide(c, d, c.analysis.vote_slow(d.incident))


def slow_vote_decide(c: Controller, d: IncidentDecision, vote: Mapping[str, Any]) -> dict[str, Any]:
    """What the vote's verdict asks: the slow group evicted, or nothing (superseded, nothing stood out, or the group
    could not be replaced: then the job is not stopped, it trains on at its reduced speed)."""
    machines = [] if vote.get("superseded") else list(vote.get("machines") or ())
    blocked = c.evictions.eviction_blocked(d.incident, machines) if machines else ""
    return _acted(c, d, ladder.after_vote(vote, blocked=blocked), Evidence(vote=dict(vote)))


def silent_corruption(c: Controller, d: IncidentDecision) -> dict[str, Any]:
    """Parameters differ between data-parallel peers (or a failure recurred past a rollback): stop, run the alignment
    test on every machine; when every machine agrees, replay real training steps in groups (dual-phase replay); evict
    the machines either finds (a repeat offender at once). In Airflow the replay's groups are watched in the
    triggerer (:class:`trainguard.operators.operators.replay.SilentCorruptionOperator`), the same evidence decided by
    :func:`sdc_decide`."""
    early, evidence = sdc_before_replay(c, d)
    if early is not None:
        return early
    if evidence.diagnosis is not None and not evidence.diagnosis.failed:
        # the alignment test's compute is clean; the fault may show only in training
        try:
            evidence = evidence.model_copy(update={"replay": c.replay.dual_phase_replay(d.job)})
        except TrainguardError as exc:  # a layout the replay cannot split, too few machines ...
            evidence = evidence.model_copy(update={"replay": {"error": str(exc)}})
    return sdc_decide(c, d, evidence)


def sdc_before_replay(c: Controller, d: IncidentDecision) -> tuple[dict[str, Any] | None, Evidence]:
    """The silent-corruption rung up to the replay: stop (a repeat offender is evicted at once: returned as the
    result), then the alignment test on every machine. Returns ``(result or None, evidence)``; a diagnosis in which
    no machine failed means only a replay can place the fault."""
    logs, offender = _stop_and_implicate(c, d)
    if offender is not None:
        return _acted(c, d, offender, Evidence(logs=logs, repeat_offender=offender.machines[0])), Evidence()
    diag = DiagnosisReport.model_validate(c.diagnosis.diagnose(d.job, levels=(), align=True))
    return None, Evidence(diagnosis=diag)


def sdc_decide(c: Controller, d: IncidentDecision, evidence: Evidence) -> dict[str, Any]:
    """What the ladder says from the alignment test's failures, else the replay's culprits; the restore is capped
    before the step where the peers first diverged (those steps hold corrupted parameters)."""
    failed = sorted(evidence.diagnosis.failed if evidence.diagnosis else {}) \
        or sorted((evidence.replay or {}).get("culprits") or [])
    diverged = c.incidents.first_step_of(d.incident, ["sdc_suspect"])
    if diverged is not None:  # the steps from the divergence on hold corrupted parameters: restore before it
        evidence = evidence.model_copy(update={"restore_max_step": max(0, diverged - 1)})
    v = ladder.after_diagnosis(d.job, d.category, d.machines, level=d.level, rollback_to=None, failed=failed,
                               max_step=evidence.restore_max_step)
    return _acted(c, d, v, evidence)


def roll_back(c: Controller, d: IncidentDecision) -> dict[str, Any]:
    """The job's own code failed: stop (a repeat offender is evicted: the failure keeps starting on one machine, not
    in the code) and roll back to the last known-good revision."""
    logs, offender = _stop_and_implicate(c, d)
    if offender is not None:
        return _acted(c, d, offender, Evidence(logs=logs, repeat_offender=offender.machines[0]))
    return c.evictions.rollback(d.incident, str(d.rollback_to))


def no_culprit(c: Controller, d: IncidentDecision) -> dict[str, Any]:
    """Nothing to blame: stop (a repeat offender is evicted) and restart in place."""
    logs, offender = _stop_and_implicate(c, d)
    if offender is not None:
        return _acted(c, d, offender, Evidence(logs=logs, repeat_offender=offender.machines[0]))
    return _acted(c, d, Verdict("reattempt"), Evidence())


def probe_machine(c: Controller, d: IncidentDecision) -> dict[str, Any]:
    """A silent agent: reach its machine over SSH and run L1. Unreachable or unhealthy: a machine fault (stop, evict,
    restart). Healthy: its agent is restarted and the job left alone (the fresh agent reports whatever happened to the
    job's ranks meanwhile)."""
    probe = c.diagnosis.probe(d.incident, d.machines)
    return _acted(c, d, ladder.after_probe(probe), Evidence(probe=probe))


RUNG_ACTIONS: dict[str, Callable[[Controller, IncidentDecision], dict[str, Any]]] = {
    "evict_now": evict_now, "restart_at_once": restart_at_once, "stop_time_diagnosis": stop_time_diagnosis,
    "runtime_analysis": runtime_analysis, "slow_vote": slow_vote, "silent_corruption": silent_corruption,
    "roll_back": roll_back, "no_culprit": no_culprit, "probe_machine": probe_machine}


# ---- the rungs that wait in the triggerer ------------------------------------------------------------------------
def vote_begin(c: Controller, decision: Mapping[str, Any]) -> dict[str, Any]:
    """The slow vote's rung in Airflow, up to its deferral: ``{"result": RungResult}`` when it decided at once (an
    explicit fault joined: evict_now decides; stronger alerts took the incident over; a vote of one round), else
    ``{"first": one round's compute times, "started": when it began}``: the other rounds are the triggerer's, on
    that round's clock."""
    c.handling(int(decision["incident"]))
    name, d, redirected = _redirected(c, "slow_vote", IncidentDecision.model_validate(decision))
    if name != "slow_vote":
        return {"result": _result(c, name, d, lambda: RUNG_ACTIONS[name](c, d), redirected)}
    started = time.time()
    first = c.analysis.vote_round(d.incident)
    if first.get("superseded"):
        return {"result": _vote_end(c, d, [], superseded=True)}
    if c.cfg.slow_rounds <= 1:
        return {"result": _vote_end(c, d, [first])}
    return {"first": first, "started": started}


def vote_end(c: Controller, decision: Mapping[str, Any], rounds: list[dict[str, float]], *,
             superseded: bool = False) -> dict[str, Any]:
    """The slow vote's rung after its rounds (each rank's compute times, per round): the verdict, claimed on the
    incident, and what it asks (:func:`slow_vote_decide`)."""
    c.handling(int(decision["incident"]))
    return _vote_end(c, IncidentDecision.model_validate(decision), rounds, superseded=superseded)


def _vote_end(c: Controller, d: IncidentDecision, rounds: list[dict[str, float]], *,
              superseded: bool = False) -> dict[str, Any]:
    def decide() -> dict[str, Any]:
        vote = c.analysis.vote_verdict(d.incident, rounds, superseded=superseded)
        return _evicting_groups(c, d, slow_vote_decide(c, d, vote))

    return _result(c, "slow_vote", d, decide)


def sdc_begin(c: Controller, decision: Mapping[str, Any]) -> dict[str, Any]:
    """The silent-corruption rung in Airflow, up to its replay: ``{"result": RungResult}`` when it decided without one
    (a repeat offender, the alignment test found the machine, a layout the replay cannot split, an explicit fault
    that joined), else ``{"replay": ...}``: the horizontal phase launched, its groups to be watched in the triggerer
    (then :func:`sdc_phase_done`)."""
    c.handling(int(decision["incident"]))
    name, d, redirected = _redirected(c, "silent_corruption", IncidentDecision.model_validate(decision))
    if name != "silent_corruption":
        return {"result": _result(c, name, d, lambda: RUNG_ACTIONS[name](c, d), redirected)}
    replay: dict[str, Any] = {}

    def act() -> dict[str, Any]:
        early, evidence = sdc_before_replay(c, d)
        if early is not None:
            return early
        if evidence.diagnosis is not None and not evidence.diagnosis.failed:
            try:
                plan = c.replay.replay_plan(d.job)
                replay.update(plan=plan, evidence=evidence.model_dump(mode="json", exclude_none=True), t0=time.time(),
                              launched=c.replay.replay_launch(d.job, c.replay.phase_groups(plan, "horizontal"),
                                                              k=int(plan["k"])))
                return {}
            except TrainguardError as exc:  # a layout the replay cannot split, too few machines ...
                evidence = evidence.model_copy(update={"replay": {"error": str(exc)}})
        return sdc_decide(c, d, evidence)

    result = _result(c, name, d, act)
    if not replay or result.get("error"):
        return {"result": result}
    return {"replay": {**replay, "stopped": result.get("stopped")}}


def sdc_preempted(c: Controller, decision: Mapping[str, Any], replay: Mapping[str, Any]) -> dict[str, Any]:
    """An explicit machine fault joined the incident while its replay ran: the replay's groups were ended and the
    fault decides the incident (the first rung: evict that machine), as it would have before the replay began.
    ``{"result": RungResult}``, with ``instead_of`` the silent-corruption rung."""
    c.handling(int(decision["incident"]))
    name, d, redirected = _redirected(c, "silent_corruption", IncidentDecision.model_validate(decision))
    if name == "silent_corruption":  # the trigger saw a fault no longer there (evicted meanwhile): the rung climbs
        return {"result": RungResult(rung=name, restart=False, no_restart=True,
                                     error="silent_corruption: replay preempted, but no explicit fault is left to "
                                           "act on").model_dump(mode="json")}
    result = _result(c, name, d, lambda: RUNG_ACTIONS[name](c, d), {**redirected, "replay_preempted": True})
    if replay.get("stopped") and not result.get("stopped"):  # what the rung's own stop found, before the replay
        result = RungResult.model_validate({**result, "stopped": replay["stopped"]}).model_dump(mode="json")
    return {"result": result}


def sdc_phase_done(c: Controller, decision: Mapping[str, Any], replay: Mapping[str, Any], phase: str,
                   results: Mapping[str, str]) -> dict[str, Any]:
    """A replay phase's results are in: after the horizontal one, the vertical one is launched (``{"replay": ...}``
    again); after both, the verdict and the rung's result (``{"result": RungResult}``)."""
    c.handling(int(decision["incident"]))
    d = IncidentDecision.model_validate(decision)
    replay = {**replay, phase: dict(results)}
    plan = replay["plan"]
    if phase == "horizontal":
        try:
            launched = c.replay.replay_launch(d.job, c.replay.phase_groups(plan, "vertical"), k=int(plan["k"]))
        except TrainguardError as exc:
            return {"result": RungResult(rung="silent_corruption", restart=False, no_restart=True,
                                         error=f"silent_corruption failed: {exc}"[:900]).model_dump(mode="json")}
        return {"replay": {**replay, "launched": launched}}
    verdict = {**plan, **c.replay.replay_verdict(plan, replay["horizontal"], replay["vertical"]),
               "seconds": round(time.time() - float(replay["t0"]), 3)}
    evidence = Evidence.model_validate({**replay["evidence"], "replay": verdict})
    result = _result(c, "silent_corruption", d, lambda: sdc_decide(c, d, evidence))
    if replay.get("stopped") and not result.get("stopped"):  # what the rung's own stop found, before the replay
        result = RungResult.model_validate({**result, "stopped": replay["stopped"]}).model_dump(mode="json")
    return {"result": result}

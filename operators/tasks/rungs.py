"""The ladder's rungs, one function each (the branch tasks of ``tg_incident``, listed in
:data:`trainguard.operators.policy.rungs.RUNGS`): each takes the triage's decision, gathers its evidence and decides;
it returns what it found and decided (:class:`~trainguard.operators.models.RungResult`): the machines to evict
(``evict``, with the reason and the newest step the restart may restore), whether the job is to restart,
or why it is left alone. A rung stops the job itself only when its evidence needs a stopped job (the logs
read as it stops, the diagnosis of its machines); otherwise ``stop_job`` stops it, ``swap_machines``
evicts, ``restart_job`` starts it again: tasks of their own.
"""

from __future__ import annotations

from typing import Any

from trainguard.core.errors import TrainguardError
from trainguard.operators.control import Controller
from trainguard.operators.policy import ladder


def evict_now(c: Controller, decision: dict[str, Any]) -> dict[str, Any]:
    """An explicit machine fault: evict the machines (no diagnosis), restart. A decision naming no machine of
    the job (an alert about a machine that left it) touches nothing."""
    machines = c.fleet.job(decision["job"]).machine_list
    if not [m for m in decision["machines"] if m in machines]:
        named = ", ".join(decision["machines"]) or "no machine"
        why = f"nothing to evict: {named} does not serve job {decision['job']}"
        return {"swaps": {}, "no_restart": True, "reason": why, "resolved": why}
    return {"evict": {"machines": list(decision["machines"]), "reason": decision["reason"]}}


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
    return logs, {"evict": {"machines": [culprit], "reason": reason}, "logs": logs, "repeat_offender": culprit}


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
    group = a["group_kind"] or "machine"
    return {"evict": {"machines": a["machines"], "priority": [m for m in a.get("culprits", []) if m in a["machines"]],
                      "reason": f"{decision['category']}: ranks {a['outliers']} stand out; {group} group evicted"},
            "analysis": a}


def slow_vote(c: Controller, decision: dict[str, Any]) -> dict[str, Any]:
    """Throughput decline: vote over rounds on each rank's compute time while the job trains; evict the
    group flagged in most rounds (then recover), or nothing when the slowdown was shared or passed. In
    Airflow the rounds are taken in the triggerer (:class:`trainguard.operators.operators.vote.SlowVoteOperator`), then
    :func:`slow_vote_decide` decides as here."""
    return slow_vote_decide(c, decision, c.vote_slow(decision["incident"]))


def slow_vote_decide(c: Controller, decision: dict[str, Any], vote: dict[str, Any]) -> dict[str, Any]:
    """What the vote's verdict asks: the slow group evicted, or nothing (superseded, nothing stood out, or
    the group could not be replaced: then the job is not stopped, it trains on at its reduced speed)."""
    if vote.get("superseded") or not vote["machines"]:
        return {"swaps": {}, "no_restart": True, "vote": vote}
    blocked = c.eviction_blocked(decision["incident"], vote["machines"])
    if blocked:  # a slow job trains on: stopping it for an eviction that cannot happen would stop all progress
        return {"swaps": {}, "no_restart": True, "vote": vote,
                "not_evicted": f"the slow {vote['verdict'] or 'machine'} group ({', '.join(vote['machines'])}) was "
                               f"not evicted: {blocked}; the job trains on at its reduced speed"}
    return {"evict": {"machines": vote["machines"],
                      "reason": f"slow: the {vote['verdict'] or 'machine'} group of {', '.join(vote['machines'])} held "
                                f"the slowest ranks in most of {len(vote['rounds'])} rounds"}, "vote": vote}


def silent_corruption(c: Controller, decision: dict[str, Any]) -> dict[str, Any]:
    """Parameters differ between data-parallel peers (or a failure recurred past a rollback): stop, run
    the alignment test on every machine; when every machine agrees, replay real training steps in groups
    (dual-phase replay); evict the machines either finds (a repeat offender at once). In Airflow the
    replay's groups are watched in the triggerer
    (:class:`trainguard.operators.operators.replay.SilentCorruptionOperator`),
    the same evidence decided by :func:`sdc_decide`."""
    early, evidence = sdc_before_replay(c, decision)
    if early is not None:
        return early
    if evidence.pop("needs_replay"):  # the alignment test's compute is clean; the fault may show only in training
        try:
            evidence["replay"] = c.dual_phase_replay(decision["job"])
        except TrainguardError as exc:  # a layout the replay cannot split, too few machines ...
            evidence["replay"] = {"error": str(exc)}
    return sdc_decide(c, decision, evidence)


def sdc_before_replay(c: Controller, decision: dict[str, Any]) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """The silent-corruption rung up to the replay: stop (a repeat offender is evicted at once: returned as
    the result), then the alignment test on every machine. Returns ``(result or None, evidence)``; the
    evidence's ``needs_replay`` says whether every machine agreed (then only a replay can place the fault)."""
    _logs, offender = _stop_and_implicate(c, decision)
    if offender is not None:
        return offender, {}
    diag = c.diagnose(decision["job"], levels=(), align=True)
    return None, {"diagnosis": diag, "needs_replay": not diag["failed"]}


def sdc_decide(c: Controller, decision: dict[str, Any], evidence: dict[str, Any]) -> dict[str, Any]:
    """What the ladder says from the alignment test's failures, else the replay's culprits; the restore is
    capped before the step where the peers first diverged (those steps hold corrupted parameters)."""
    failed = sorted(evidence["diagnosis"]["failed"]) or sorted((evidence.get("replay") or {}).get("culprits") or [])
    t = ladder.Triage(decision["job"], decision["category"], tuple(decision["machines"]))
    d = ladder.decide(t, level=decision["level"], diagnosis_done=True, diagnosis_failed=failed, log_verdict="")
    diverged = c.first_step_of(decision["incident"], ["sdc_suspect"])
    if diverged is not None:  # the steps from the divergence on hold corrupted parameters: restore before it
        evidence = {**evidence, "restore_max_step": max(0, diverged - 1)}
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
    return {"evict": {"machines": sorted(probe["faulty"]),
                      "reason": "silent agent, and the machine " + "; ".join(f"{m} {why}" for m, why in
                                                                         sorted(probe["faulty"].items()))},
            "probe": probe}


RUNG_ACTIONS = {"evict_now": evict_now, "stop_time_diagnosis": stop_time_diagnosis,
                "runtime_analysis": runtime_analysis, "slow_vote": slow_vote, "silent_corruption": silent_corruption,
                "roll_back": roll_back, "no_culprit": no_culprit, "probe_machine": probe_machine}


def _follow(c: Controller, incident: int, d: ladder.Decision, evidence: dict[str, Any],
            rollback_to: str | None = None) -> dict[str, Any]:
    if d.action == "evict":
        return {"evict": {"machines": list(d.machines), "reason": d.reason,
                          "max_step": evidence.get("restore_max_step")}, **evidence}
    if d.action == "rollback" and rollback_to:
        return {**c.rollback(incident, rollback_to), **evidence}
    if d.action in ("reattempt", "replay"):
        return {"swaps": {}, "reattempt": True, "note": d.reason, **evidence}
    return {**c.wait_for_human(incident, d.reason), **evidence}

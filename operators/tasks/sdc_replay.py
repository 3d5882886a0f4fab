"""The bodies of ``tg_sdc_replay``'s tasks: dual-phase replay by hand.
"""

from __future__ import annotations

from typing import Any

from trainguard.core.errors import TrainguardError
from trainguard.operators.control import Controller
from trainguard.operators.tasks import common


def replay_prepare(c: Controller, job: str, k: int) -> dict[str, Any]:
    """A dual-phase replay by hand: an incident records it; the job is stopped; returns the plan."""
    plan = c.replay.replay_plan(job, k=k)
    incident = common.incident_by_hand(c, job, f"dual-phase replay by hand (k={k})")
    c.jobs.stop(job)
    return {**plan, "incident": incident}


def replay_phase(c: Controller, plan: dict[str, Any], phase: str) -> dict[str, str]:
    """One phase of the replay, run to its end: ``horizontal`` (with the standbys' reference group) or
    ``vertical`` (outside Airflow; there :func:`phase_launch` starts it and the triggerer watches it)."""
    return c.replay.replay_phase(plan, phase)


def phase_launch(c: Controller, plan: dict[str, Any], phase: str) -> dict[str, Any]:
    """Start one phase's groups (:meth:`trainguard.operators.control.Controller.replay_launch`); the triggerer watches
    them (:class:`trainguard.operators.triggers.replay.ReplayTrigger`)."""
    return c.replay.replay_launch(plan["job"], c.replay.phase_groups(plan, phase), k=int(plan["k"]))


def replay_conclude(c: Controller, plan: dict[str, Any] | None, h: dict[str, str] | None, v: dict[str, str] | None,
                    evict: bool) -> dict[str, Any]:
    """The culprits; with ``evict``, replace them with standbys; then restart the job (its newest
    committed checkpoint) and close the incident. A phase that failed leaves no verdict; the job is
    restarted all the same."""
    if not plan:
        raise TrainguardError("the replay was not prepared (see the prepare task's log); nothing to conclude")
    verdict = c.replay.replay_verdict(plan, h, v) if h is not None and v is not None else None
    culprits = verdict["culprits"] if verdict else []
    note = (f"culprits {', '.join(culprits)}" if culprits else "no culprit" if verdict else
            "a phase failed: no verdict") + "; job restarted"
    done = common.finish_by_hand(c, int(plan["incident"]), culprits, evict=evict, restart=True, note=note,
                           reason=f"dual-phase replay by hand: {', '.join(culprits)} computed wrong")
    common.note(f"{plan.get('job', '')}: replay {note}" + (" (culprits evicted)" if evict and culprits else ""))
    return {**done, "verdict": verdict, "culprits": culprits}

"""The bodies of ``tg_code_update``'s tasks: hot, lazy and forced code updates, and the known-good sweep.
"""

from __future__ import annotations

from typing import Any

from trainguard.core.errors import TrainguardError
from trainguard.operators.control import Controller
from trainguard.operators.tasks import common


def code_update(c: Controller, job: str, revision: str, urgency: str, reason: str) -> dict[str, Any]:
    """A request from the form (job given): urgent/rollback -> hot update now, lazy -> pending. Without a
    job (the schedule): the sweep, forcing overdue lazy updates and marking known-good revisions."""
    from trainguard.operators import code_updates
    if not job:
        swept = code_updates.sweep(c, force_after_s=c.cfg.lazy_force_s, known_good_steps=c.cfg.known_good_steps)
        forced = [dict(f["forced"]) for f in swept.values() if f.get("forced", {}).get("restarted")]
        return {"sweep": swept, "restarted": bool(forced), "restarts": forced}
    out = code_updates.request(c, job, revision, urgency, reason)
    return {**out, "restarts": [out] if out.get("restarted") else []}


def code_resumed(c: Controller, update: dict[str, Any]) -> dict[str, Any] | None:
    """For the sensor's trigger: every restarted job trained past its restored step, or ended without a step
    (then the ladder handles it as an incident); None until each did one or the other."""
    seen: dict[str, Any] = {}
    ended: dict[str, str] = {}
    for r in update.get("restarts", []):
        try:
            info = c.jobs.resumed(r["job"], r["restart_ts"])
        except TrainguardError as exc:
            ended[r["job"]] = str(exc)
            continue
        if info is None:
            return None
        seen[r["job"]] = info
    return {"resumed": seen, "ended": ended}


def code_rearm(c: Controller, update: dict[str, Any]) -> dict[str, Any]:
    """Warm interpreters again beside every restarted job (the update consumed them), unless an incident
    of the job is open: its own run re-arms after its recovery."""
    return {r["job"]: common.arm_unless_busy(c, r["job"]) for r in update.get("restarts", [])}


def code_conclude(c: Controller, update: dict[str, Any], resumed_info: dict[str, Any] | None) -> dict[str, Any]:
    """The run's one-line note."""
    if "sweep" in update:
        parts = [f"{job}: forced {v['forced']['revision']}" if v.get("forced") else
                 f"{job}: {v['revision']} known good" if v.get("known_good") else
                 f"{job}: {v.get('error') or 'nothing due'}" for job, v in update["sweep"].items()]
        common.note("; ".join(parts) or "no running job")
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
        now = c.fleet.job(update["job"]).revision
        if now != update["revision"]:  # it failed and the ladder rolled it back meanwhile
            note += f"; {update['revision']} did not stay: the job runs {now} now (see its incidents)"
    elif update["action"] == "pending":
        note = f"{update['job']}: {update['reason']}"
    else:
        note = f"{update['job']}: nothing to do ({update['reason']})"
    common.note(note)
    return {**update, "resumed": resumed_info, "note": note}

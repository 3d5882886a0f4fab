"""Code updates as plain Python for ``tg_code_update`` (no Airflow import): a request by hand (hot now,
lazy at the next restart, or a rollback), and the sweep that forces lazy updates waiting past their
window and marks revisions known-good after enough healthy steps. The decisions are
:mod:`trainguard.operators.policy.code`'s; every change goes through the fleet database and is recorded as an
action with its evidence, so the UI's run and the fleet's audit trail say the same.
"""

from __future__ import annotations

import math
import time
from typing import Any

from trainguard.core.errors import TrainguardError
from trainguard.operators.control import Controller
from trainguard.operators.policy import code


def _request_key(job: str, revision: str) -> str:
    return f"code_update:{job}:{revision}"


def request(ctl: Controller, job: str, revision: str, urgency: str, reason: str = "") -> dict[str, Any]:
    """Apply one request. Urgent (and rollback): a hot update now, in place (the caller waits for
    training to resume); lazy: the revision waits for the job's next restart. Bad requests raise
    :class:`trainguard.operators.policy.code.UpdateError` or FleetError with a one-line reason, before any change."""
    j = ctl.fleet.job(job)
    if not j.machine_list:
        raise code.UpdateError(f"job {job} has no machines; launch it before updating its code")
    revs = ctl.fleet.revisions(job)
    plan = code.plan_update(job=job, current=j.revision, pending=j.pending_revision, requested=revision.strip(),
                            urgency=urgency, recorded=[r.revision for r in revs],
                            known_good=[r.revision for r in sorted((r for r in revs if r.known_good),
                                                                   key=lambda r: (r.good_ts or 0.0, r.id))])
    out: dict[str, Any] = {"job": job, "action": plan.action, "revision": plan.revision, "urgency": urgency,
                           "reason": plan.reason, "from": j.revision, "restarted": False}
    if plan.action == "none":
        return out
    action, _ = ctl.fleet.record_action(f"{_request_key(job, plan.revision)}:{urgency}:{time.time():.3f}",
                                        kind="code_update", machines=j.machine_list, dry_run=ctl.cfg.dry_run,
                                        evidence={"revision": plan.revision, "from": j.revision, "urgency": urgency,
                                                  "reason": reason})
    if ctl.cfg.dry_run:
        ctl.fleet.finish_action(action.id, "dry_run", plan.reason)
        return {**out, "dry_run": True}
    if plan.action == "pending":
        ctl.fleet.set_revision(job, plan.revision, pending=True)
        ctl.fleet.finish_action(action.id, "done", plan.reason)
        return out
    try:
        hot = ctl.jobs.hot_update(job, plan.revision, reason=reason or plan.reason)
    except TrainguardError as exc:
        ctl.fleet.finish_action(action.id, "failed", str(exc))
        raise
    ctl.fleet.finish_action(action.id, "done", plan.reason)
    return {**out, **hot, "restarted": bool(hot.get("updated"))}


def pending_since(ctl: Controller, job: str) -> float | None:
    """When the job's pending revision was asked for (its lazy request's time)."""
    j = ctl.fleet.job(job)
    if not j.pending_revision:
        return None
    asked = [a.started_ts for a in ctl.fleet.actions() if a.kind == "code_update"
             and a.key.startswith(_request_key(job, j.pending_revision) + ":lazy:")]
    return max(asked) if asked else j.updated_ts


def revision_since(ctl: Controller, job: str) -> float:
    """When the job's current revision started running (its latest launch with that revision)."""
    j = ctl.fleet.job(job)
    launches = [a for a in ctl.fleet.actions() if a.kind == "launch" and a.key.startswith(f"launch:{job}:")
                and (a.evidence or {}).get("revision") == j.revision and a.outcome == "done"]
    return max((a.started_ts for a in launches), default=j.created_ts)


def sweep(ctl: Controller, *, force_after_s: float = code.LAZY_FORCE_S,
          known_good_steps: int = code.KNOWN_GOOD_STEPS, now: float | None = None) -> dict[str, Any]:
    """Every running job: a lazy update that waited ``force_after_s`` is applied by a hot update; the
    current revision becomes known-good after ``known_good_steps`` healthy steps (finite loss) on it."""
    now = time.time() if now is None else now
    out: dict[str, Any] = {}
    for j in ctl.fleet.jobs():
        if j.state != "running" or not j.machine_list:
            continue
        item: dict[str, Any] = {"revision": j.revision, "pending": j.pending_revision}
        try:
            since = pending_since(ctl, j.name)
            if code.lazy_due(since, now, force_after_s=force_after_s):
                item["forced"] = request(ctl, j.name, j.pending_revision or "", "urgent",
                                         reason=f"lazy update waited {now - (since or now):.0f}s for a restart")
            revs = {r.revision: r for r in ctl.fleet.revisions(j.name)}
            current = revs.get(j.revision)
            if current is not None and not current.known_good and not item.get("forced"):
                start = revision_since(ctl, j.name)
                healthy = [r for r in ctl.ettr.step_history(j.name) if float(r.get("ts", 0.0)) >= start
                           and _finite(r.get("loss"))]
                item["healthy_steps"] = len(healthy)
                if code.becomes_known_good(len(healthy), threshold=known_good_steps):
                    item["known_good"] = ctl.fleet.mark_known_good(j.name, j.revision)
        except TrainguardError as exc:
            item["error"] = str(exc)
        out[j.name] = item
    return out


def _finite(value: Any) -> bool:
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError):
        return False

"""The body of ``tg_reconcile``'s task: what the reconciler's look found, acted on (each finding an incident
through the same ladder, or a stuck incident's next run), and those runs started."""

from __future__ import annotations

from typing import Any

from trainguard.operators.control import Controller
from trainguard.operators.policy.reconcile import Finding
from trainguard.operators.tasks import common, guardian


def act(c: Controller, findings: list[dict[str, Any]]) -> dict[str, Any]:
    """Act on ``findings`` (:meth:`trainguard.operators.control.Controller.reconcile_act`) and start the runs it
    asks for (a run that cannot be started now is started by the next look: an open incident without a live
    run). Returns what was done, one line per finding, and each run's start."""
    out = c.reconciliation.reconcile_act([Finding.read(f) for f in findings])
    started = guardian.start_soon(out["starts"])
    common.note("reconciler: " + "; ".join(out["done"]) if out["done"] else "reconciler: nothing left to do")
    return {"done": out["done"], "started": started}

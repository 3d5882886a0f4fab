"""The body of ``tg_reconcile``'s task: what the reconciler's look found (the events of its watcher that started
the run), acted on (each finding an incident through the same ladder, or a stuck incident's next run), and those
runs started."""

from __future__ import annotations

import time
from typing import Any

from trainguard.operators.control import Controller
from trainguard.operators.policy.reconcile import Finding
from trainguard.operators.tasks import common, guardian
from trainguard.operators.triggers.reconcile import RECONCILER


def findings_of(triggering_asset_events: Any) -> list[dict[str, Any]]:
    """The findings the watcher's events that started the run carry, each once (the same difference found by two
    passes before it was acted on is one)."""
    import json

    out: dict[str, dict[str, Any]] = {}
    for events in (dict(triggering_asset_events) if triggering_asset_events else {}).values():
        for e in events:
            extra = getattr(e, "extra", None) if not isinstance(e, dict) else e.get("extra")
            for f in ((extra or {}).get("payload") or {}).get("findings") or ():
                out.setdefault(json.dumps(f, sort_keys=True), f)
    return list(out.values())


def act(c: Controller, findings: list[dict[str, Any]]) -> dict[str, Any]:
    """Act on ``findings`` (:meth:`trainguard.operators.control.Controller.reconcile_act`) and start the runs it
    asks for (a run that cannot be started now is started by the next look: an open incident without a live
    run). Returns what was done, one line per finding, and each run's start."""
    out = c.reconciliation.reconcile_act([Finding.read(f) for f in findings])
    started = guardian.start_soon(out["starts"])
    c.fleet.beat(RECONCILER, {"acted_ts": time.time(), "found": len(findings)})
    common.note("reconciler: " + "; ".join(out["done"]) if out["done"] else "reconciler: nothing left to do")
    return {"done": out["done"], "started": started}

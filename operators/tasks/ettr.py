"""The body of ``tg_ettr``'s task: every job's ETTR report, kept in the audit trail.
"""

from __future__ import annotations

import time
from typing import Any

from trainguard.core.errors import TrainguardError
from trainguard.operators.control import Controller
from trainguard.operators.tasks import common


def ettr_reports(c: Controller, job: str, window_s: float) -> dict[str, Any]:
    """The ETTR report of ``job`` (every job in the fleet database when empty); a job with no steps yet
    is listed with its error."""
    names = [job] if job else [j.name for j in c.fleet.jobs()]
    out: dict[str, Any] = {}
    for name in names:
        try:
            out[name] = c.ettr.ettr_report(name, window_s=window_s)
        except TrainguardError as exc:
            out[name] = {"error": str(exc)}
            continue
        # kept in the audit trail: the metrics exporter publishes the newest report of each job
        rep = out[name]
        c.fleet.record_action(f"ettr_report:{name}:{time.time():.3f}", kind="ettr_report",
                              evidence={"cumulative": rep["cumulative"]["ettr"], "sliding": rep["sliding"]["ettr"],
                                        "window_s": window_s, "by_cause": rep["by_cause"]})
    common.note("; ".join(f"{n}: {r['error']}" if "error" in r else
                    f"{n}: ETTR {r['cumulative']['ettr']:.1%} since its first step, {r['sliding']['ettr']:.1%} over "
                    f"the last {window_s:.0f}s" + _partial(r) for n, r in out.items()) or "no job")
    return out


def _partial(report: dict[str, Any]) -> str:
    missing = report.get("unanswered") or []
    if not missing:
        return ""
    shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
    return f" (partial: {shown} did not answer)"

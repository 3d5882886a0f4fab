"""An incident's timeline, as the fleet database recorded it: its alerts, the run that took it, every action with
when it started and how long it took, and its milestones (opened, diagnosis, decision, resumed, closed), each on
the clock of its first alert. What ``trainguard incident show N`` prints: where an incident's seconds went."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from trainguard.operators.fleet import FleetStore

ALERTS_SHOWN = 8  # an alert storm holds one alert per rank: the first few, and a count of the rest

MILESTONES = (("opened_ts", "incident opened"), ("diagnosis_start_ts", "diagnosis began"),
              ("decided_ts", "decided"), ("resumed_ts", "job trained again"), ("closed_ts", "incident closed"))


def incident_timeline(fleet: FleetStore, incident_id: int,
                      tasks: Mapping[str, Sequence[Mapping[str, Any]]] | None = None) -> dict[str, Any]:
    """The incident's events in time order, each ``{"t": seconds after the first alert, "what": ..., "took_s"}``
    (``took_s``: an action's duration, None while it is pending), with the incident's state and summary.
    ``tasks``: the task instances of the tg_incident runs that handled it, by run id (as
    :meth:`~trainguard.operators.hooks.airflow_api.AirflowApi.task_instances` answers): each task's start, with
    the seconds it waited in the queue and ran."""
    inc = fleet.incident(incident_id)
    t0 = float(inc.first_alert_ts)
    alerts = fleet.alerts_of(incident_id)
    events: list[dict[str, Any]] = []

    def add(ts: float | None, what: str, took: float | None = None) -> None:
        if ts is not None:
            events.append({"t": round(float(ts) - t0, 3), "what": what,
                           "took_s": None if took is None else round(took, 3)})

    for a in alerts[:ALERTS_SHOWN]:
        add(a.ts, f"alert {a.kind} on {a.machine or '-'}" + (f" rank {a.rank}" if a.rank is not None else ""))
    if len(alerts) > ALERTS_SHOWN:
        add(alerts[ALERTS_SHOWN].ts, f"... and {len(alerts) - ALERTS_SHOWN} more alerts")
    for claim in fleet.claims_of(incident_id):
        add(claim.get("first_seen_ts"), f"alert watcher saw it (run {claim['run']})")
    for key, what in MILESTONES:
        add(getattr(inc, key), what)
    for a in fleet.actions(incident_id):
        took = None if a.finished_ts is None else a.finished_ts - a.started_ts
        on = f" {','.join(a.machines)}" if a.machines else ""
        run = f" {(a.evidence or {}).get('run')}" if a.kind == "run" else ""
        detail = f": {a.detail[:120]}" if a.detail and a.outcome != "done" else ""
        add(a.started_ts, f"{a.kind}{on}{run} {a.outcome}{detail}", took)
    for run, instances in (tasks or {}).items():
        for ti in instances:
            if ti.get("started") is None:
                continue
            queued = ti.get("queued")  # a deferred task is queued again when its trigger fires: after its start
            waited = f", queued {ti['started'] - queued:.2f}s" if queued is not None and queued <= ti["started"] \
                else ""
            index = f"[{ti['map_index']}]" if isinstance(ti.get("map_index"), int) and ti["map_index"] >= 0 else ""
            ran = None if ti.get("ended") is None else ti["ended"] - ti["started"]
            add(ti["started"], f"task {ti['task_id']}{index} {ti.get('state') or '-'} (run {run}{waited})", ran)
    events.sort(key=lambda e: e["t"])
    return {"incident": inc.id, "job": inc.job, "state": inc.state, "category": inc.category, "level": inc.level,
            "first_alert_ts": t0, "summary": inc.summary, "lost_steps": inc.lost_steps, "events": events}


def format_timeline(doc: dict[str, Any]) -> str:
    lost = f", {doc['lost_steps']} steps lost" if doc.get("lost_steps") is not None else ""
    head = f"incident {doc['incident']} of job {doc['job']}: {doc['state']}, {doc['category'] or '-'}, " \
           f"level {doc['level']}{lost}"
    lines = [head, f"  {doc['summary'][:400]}"] if doc.get("summary") else [head]
    for e in doc["events"]:
        took = "" if e["took_s"] is None else f"  ({e['took_s']:.2f}s)"
        lines.append(f"  {e['t']:+9.2f}s  {e['what']}{took}")
    return "\n".join(lines)

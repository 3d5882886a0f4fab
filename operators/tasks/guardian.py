"""Recording what the alert watcher saw: where the alerts are, a batch recorded into incidents, and the incident a
tg_incident run handles.

The watcher (:class:`trainguard.operators.triggers.alerts.AlertTrigger`, in the triggerer) only reads; each batch
it emits is an asset event of ``trainguard-alerts``, and Airflow starts a tg_incident run for it. That run's first
task records the batch (:func:`record`: alerts into incidents, the bus cursor, quarantined documents and what the
watcher saw of the agents, in one transaction), moves the quarantined documents out of the folder and retires old
names from it, and takes the incident the batch opened as its own (a ``run`` action of the incident:
:meth:`~trainguard.operators.fleet.store.FleetStore.claimed_by`). A batch that only joined an incident already open
ends its run there. Recording a batch twice is a no-op (alerts are keyed by id); a retry of the task finds the
incident it claimed. Runs started for an incident through the REST API (handed on, triaged again, driven again by the
reconciler) are named after it (``incident__7...``) and claim it as they start.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from trainguard.node_tools.bus import ALERTS
from trainguard.operators.control import Controller
from trainguard.operators.policy.rungs import run_id, run_start
from trainguard.operators.triggers.alerts import DEFAULT_RETAIN_S, GONE_PER_EVENT, GUARDIAN, RETIRE_ROUND

INCIDENT_DAG = "tg_incident"
__all__ = ["INCIDENT_DAG", "events_of", "incident_of_run", "record", "retire", "run_id",
           "start_runs", "start_soon"]
log = logging.getLogger(__name__)


def events_of(triggering_asset_events: Any) -> list[dict[str, Any]]:
    """The watcher's events that started a run, oldest first (the payloads of its asset events; none for a run
    started by hand or through the REST API)."""
    out: list[tuple[float, dict[str, Any]]] = []
    for events in (dict(triggering_asset_events) if triggering_asset_events else {}).values():
        for e in events:
            extra = getattr(e, "extra", None) if not isinstance(e, dict) else e.get("extra")
            payload = (extra or {}).get("payload")
            if isinstance(payload, dict) and "alerts" in payload:
                out.append((float(payload.get("fired_ts") or 0.0), payload))
    return [p for _, p in sorted(out, key=lambda x: x[0])]


def record(c: Controller, event: dict[str, Any], *, run: str = "", retain_s: float = DEFAULT_RETAIN_S
           ) -> list[dict[str, Any]]:
    """Record one batch of the watcher in one transaction (alerts into incidents, the bus cursor, quarantined
    documents, the agents' liveness; the incidents it opens handled by the tg_incident run ``run``), then move the
    quarantined documents out of the bus's folder, retire the names recorded more than ``retain_s`` ago, and say so
    in the guardian's beat. Returns each incident the batch's alerts went to: ``{"incident", "job", "opened",
    "taken_over", "alerts"}`` (a taken-over one needs a new run: the one that held it ends at its next round)."""
    claim = {"run": run, "first_seen_ts": event.get("first_seen_ts")} if run else None
    reader = event.get("reader") or GUARDIAN
    items = c.incidents.ingest(event.get("alerts") or [], reader=reader, read=event.get("read"),
                               gone=event.get("gone") or (), quarantined=event.get("quarantined") or (),
                               liveness=event.get("liveness"), claim=claim)
    _move_quarantined(c, event.get("quarantined") or ())
    retired = retire(c, reader, retain_s=retain_s) if _retire_due(c, reader) else 0
    c.fleet.beat(GUARDIAN, {**(event.get("watcher") or {}), "recorded_ts": time.time(), "run": run,
                            "alerts": len(event.get("alerts") or ()), "retired": retired})
    return items


#: a process records a storm batch after batch: the old names are looked for at most this often (each look reads the
#: reader's whole cursor)
RETIRE_EVERY_S = 5.0
_RETIRED_AT: dict[tuple[str, str], float] = {}


def _retire_due(c: Controller, reader: str) -> bool:
    key, now = (c.cfg.fleet_url, reader), time.monotonic()
    if now - _RETIRED_AT.get(key, -RETIRE_EVERY_S) < RETIRE_EVERY_S:
        return False
    _RETIRED_AT[key] = now
    return True


def _move_quarantined(c: Controller, quarantined: Any) -> None:
    """The documents the watcher quarantined (recorded with their reasons already) moved out of the alerts folder,
    the reason beside each (best effort: the cursor keeps them from being read again)."""
    from trainguard.node_tools.bus import BusError, open_bus

    names = [(str(q.get("name") or ""), str(q.get("reason") or "")) for q in quarantined]
    if not any(n for n, _ in names):
        return
    try:
        bus = open_bus(c.inventory.bus_url)
        for name, reason in names:
            if name:
                bus.quarantine(name, f"{name}: {reason}")
    except (BusError, OSError) as exc:
        log.warning("quarantined documents left on the bus: %s", exc)


def retire(c: Controller, reader: str = GUARDIAN, *, retain_s: float = DEFAULT_RETAIN_S, folder: str = ALERTS,
           now: float | None = None) -> int:
    """Remove from the bus the names ``reader`` recorded more than ``retain_s`` ago (by the watcher's clock), at most
    :data:`~trainguard.operators.triggers.alerts.RETIRE_ROUND` of them, and drop them from its cursor (the fleet
    database keeps every alert's document), so the folder the watcher lists holds only what is unread or recent.
    Returns how many left."""
    from trainguard.node_tools.bus import open_bus

    now = time.time() if now is None else now
    old = [n for n, ts in c.fleet.cursor(reader).items() if now - ts > retain_s][:RETIRE_ROUND]
    if not old:
        return 0
    try:
        done = open_bus(c.inventory.bus_url, folder=folder).retire(old)
    except Exception as exc:  # a bus error now: the next recording tries again
        log.warning("old bus names not retired: %s", exc)
        return 0
    for i in range(0, len(done), GONE_PER_EVENT):
        c.fleet.advance_cursor(reader, {}, done[i:i + GONE_PER_EVENT])
    return len(done)


def incident_of_run(c: Controller, events: list[dict[str, Any]], *, run: str
                    ) -> tuple[int | None, list[dict[str, Any]], str]:
    """The incident an asset-triggered tg_incident run handles, after recording the watcher's ``events`` that started
    it (oldest first): the first incident they opened or took over, claimed by ``run`` (a retry of the task finds the
    one it claimed: recording again opens nothing). None when every alert joined an incident already open (the run
    ends there). Also returns what starts the runs of any other incident they opened (a batch of two jobs' alerts),
    and what was recorded, in a line."""
    items: list[dict[str, Any]] = []
    for event in events:
        items += record(c, event, run=run)
    new = [i for i in items if i["opened"] or i["taken_over"]]
    mine = c.fleet.claimed_by(run)
    first = mine[0] if mine else next((n["incident"] for n in new if n["taken_over"]), None)
    if first is not None and first not in mine:  # taken over: this run handles it from now on
        c.fleet.claim_run(first, run, first_seen_ts=events[0].get("first_seen_ts") if events else None)
    others = [n for n in new if n["incident"] != first]
    starts = [run_start(n["incident"], n["job"], run_id(n["incident"], c.fleet.incident(n["incident"]).category
                                                        if n["taken_over"] else "")) for n in others]
    joined = sorted({i["incident"] for i in items if not (i["opened"] or i["taken_over"])})
    alerts = sum(len(e.get("alerts") or ()) for e in events)
    line = (f"recorded {alerts} alert(s) of {len(events)} batch(es)"
            + (f": they joined incident(s) {', '.join(map(str, joined))}" if joined else "")
            + (f"; incident {first} opened, handled by this run" if first is not None else ""))
    return first, starts, line


def start_runs(starts: list[dict[str, Any]], api: Any) -> dict[str, str]:
    """Start the tg_incident runs ``starts`` names through the REST API (``api``: an
    :class:`~trainguard.operators.hooks.airflow_api.AirflowApi`): each run id -> ``started``, ``exists`` (started
    before: nothing to do) or why it could not be started."""
    from trainguard.operators.hooks.airflow_api import ApiError

    out: dict[str, str] = {}
    for s in starts:
        try:
            api.request("POST", f"/api/v2/dags/{INCIDENT_DAG}/dagRuns",
                        {"dag_run_id": s["trigger_run_id"], "logical_date": None, "conf": s["conf"]}, repeatable=True)
            out[s["trigger_run_id"]] = "started"
        except ApiError as exc:
            out[s["trigger_run_id"]] = "exists" if exc.status == 409 else f"not started: {exc}"[:300]
    return out


def start_soon(starts: list[dict[str, Any]]) -> dict[str, str]:
    """Start the tg_incident runs ``starts`` names from inside a task, through the Airflow connection
    ``TG_AIRFLOW_API_CONN_ID`` (default ``tg_airflow_api``); each run id -> what happened. Never raises: a run that
    could not be started is started by the reconciler's next pass (an open incident without a live run)."""
    from trainguard.operators.hooks.airflow_api import AirflowApiHook, api_conn_id

    if not starts:
        return {}
    conn_id = api_conn_id()
    try:
        with AirflowApiHook(conn_id, retry_s=10.0).get_client() as api:
            return start_runs(starts, api)
    except Exception as exc:  # no connection, the api-server down: the reconciler starts it
        log.warning("could not start %s now (%s); the reconciler will", [s["trigger_run_id"] for s in starts], exc)
        return {s["trigger_run_id"]: f"not started: {exc}"[:300] for s in starts}

"""The bodies of ``tg_guardian``'s work: where the alerts are, a batch recorded into incidents, and one
``tg_incident`` run started per incident opened (or taken over by stronger alerts during a slow vote).

The recording and the runs' start happen where the batch is read, in the triggerer
(:class:`trainguard.operators.triggers.alerts.AlertTrigger` with ``record``), so that an alert's incident run starts
about a second after the alert: no task has to be scheduled in between. The guardian's tasks repeat both
when the triggerer could not (the fleet database, or the REST API, did not answer there): recording a
batch twice is a no-op (alerts are keyed by id), and a run's id names its incident (``incident__7``), so a
run is never started twice. An incident whose run was never started (its starter died in between) is
started by the sweep the trigger runs while it waits (:func:`orphans`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from trainguard.operators.control import ControlConfig, Controller
from trainguard.operators.fleet.states import IncidentState
from trainguard.operators.policy.rungs import run_id

INCIDENT_DAG = "tg_incident"
__all__ = ["INCIDENT_DAG", "alert_source", "group_alerts", "orphans", "run_id", "start_runs", "start_soon"]
# an open incident without a run this old is an orphan (its run's start was lost); younger: being started
ORPHAN_AFTER_S = 20.0


def alert_source() -> tuple[str, str]:
    """The bus to watch (the inventory's) and the fleet database that keeps the readers' cursors."""
    from trainguard.node_tools.inventory import Inventory

    cfg = ControlConfig.from_env()
    inv = Inventory.load(Path(cfg.inventory))
    return inv.bus_url, cfg.fleet_url


def group_alerts(c: Controller, event: dict[str, Any]) -> list[dict[str, Any]]:
    """Record the batch in one transaction (alerts into incidents, the bus cursor, quarantined documents, the
    agents' liveness); returns what starts the runs of the incidents newly opened or taken over (each
    ``{"conf", "trigger_run_id"}``, as the start_incident task takes them)."""
    items = c.incidents.ingest(event["alerts"], reader=event.get("reader") or "guardian", read=event.get("read"),
                     gone=event.get("gone") or (), quarantined=event.get("quarantined") or (),
                     liveness=event.get("liveness"))
    out = []
    for i in items:
        if not (i["opened"] or i["taken_over"]):
            continue
        taken = c.fleet.incident(i["incident"]).category if i["taken_over"] else ""
        conf = {"incident_id": i["incident"], "job": i["job"], "first_seen_ts": event.get("first_seen_ts")}
        out.append({"conf": conf, "trigger_run_id": run_id(i["incident"], taken)})
    return out


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
    """Start the tg_incident runs ``starts`` names from inside a task or a trigger, through the Airflow connection
    ``TG_AIRFLOW_API_CONN_ID`` (default ``tg_airflow_api``); each run id -> what happened. Never raises: a run
    that could not be started is started by the reconciler's next pass (an open incident without a live run)."""
    import logging
    import os

    from trainguard.operators.hooks.airflow_api import AirflowApiHook

    if not starts:
        return {}
    conn_id = os.environ.get("TG_AIRFLOW_API_CONN_ID", "tg_airflow_api")
    try:
        with AirflowApiHook(conn_id, retry_s=10.0).get_client() as api:
            return start_runs(starts, api)
    except Exception as exc:  # no connection, the api-server down: the reconciler starts it
        logging.getLogger(__name__).warning("could not start %s now (%s); the reconciler will",
                                            [s["trigger_run_id"] for s in starts], exc)
        return {s["trigger_run_id"]: f"not started: {exc}"[:300] for s in starts}


def orphans(c: Controller, *, older_than_s: float = ORPHAN_AFTER_S, now: float | None = None) -> list[dict[str, Any]]:
    """The runs to start again, in case their start was lost: one per open incident of the guardian's (it
    holds alerts; incidents opened by hand hold none) opened more than ``older_than_s`` ago. Starting one
    that runs already answers "exists" and changes nothing."""
    now = time.time() if now is None else now
    out = []
    for job in c.fleet.jobs():
        for inc in c.fleet.incidents(job.name):
            if inc.state != IncidentState.OPEN or now - inc.opened_ts < older_than_s or not c.fleet.alerts_of(inc.id):
                continue
            out.append({"conf": {"incident_id": inc.id, "job": inc.job, "first_seen_ts": None},
                        "trigger_run_id": run_id(inc.id)})
    return out

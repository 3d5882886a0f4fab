"""``trainguard status``: trainguard's own health and its jobs' in one screen.

What it reads, and what it calls unhealthy (exit 1; 0 when all is well, 2 when it cannot read):

* **guardian**: when the watcher of the alert bus last polled it (the beat it writes every few seconds into its
  asset's state store in Airflow: ``trainguard-alerts``), read through the REST API: older than ``STALE_S`` means
  nothing is watching the alerts; and when a task last recorded a batch of it (the fleet database), which is not
  judged (a quiet fleet records nothing);
* **reconciler**: when its watcher last took its look at the running jobs (its beat, ``trainguard-reconcile``):
  older than three periods (at least ``STALE_S``) means nothing looks behind the incidents;
* **airflow**: the api-server's ``/api/v2/monitor/health`` (metadatabase, scheduler, triggerer, dag
  processor), when an Airflow URL is known;
* **agents**: for every machine serving a running job, whether the guardian reported its agent silent (past
  ``TG_AGENT_SILENT_S``: it raises an incident of its own) and how long ago, as last recorded, it saw its heartbeat
  change;
* **jobs**: each job's state in the fleet database, its machines and revision;
* **incidents**: open ones, and those waiting for a human with their reason and next step (a human needed);
* **bus**: documents quarantined in the last hour (unknown machines, oversized, not alerts).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from trainguard.core.procs import group_alive
from trainguard.operators.fleet import FleetStore
from trainguard.operators.fleet.states import IncidentState
from trainguard.operators.fleet.store import OPEN_INCIDENT_STATES

STALE_S = 30.0


def kept_airflow_url(home: Path) -> str:
    """The URL of an ``airflow standalone`` a demo left running in ``home`` (``--keep``): its process group in
    ``standalone.pid``, its URL in ``standalone.url``; "" when none runs there."""
    try:
        if not group_alive(int((home / "standalone.pid").read_text())):
            return ""
        return (home / "standalone.url").read_text().strip()
    except (OSError, ValueError):
        return ""


def airflow_health(url: str, *, timeout: float = 5.0) -> dict[str, Any]:
    """The api-server's health document, or ``{"error": ...}`` when it does not answer."""
    from trainguard.operators.hooks.airflow_api import AirflowApi

    try:
        with AirflowApi(url, timeout_s=timeout, retry_s=0) as api:
            doc = api.health()
    except Exception as exc:  # refused, a timeout, an HTTP error: one line
        return {"error": f"{url}: {type(exc).__name__}: {str(exc)[:200]}"}
    return doc if isinstance(doc, dict) else {"error": f"{url}: not a health document"}


def watcher_beats(api: Any) -> dict[str, dict[str, Any] | None]:
    """The beats the control plane's watchers write into their assets' state stores (the alert watcher's, the
    reconciler's), through the REST API ``api`` (an :class:`~trainguard.operators.hooks.airflow_api.AirflowApi`)."""
    from trainguard.operators.triggers.alerts import ALERTS_ASSET
    from trainguard.operators.triggers.reconcile import RECONCILE_ASSET

    return {"guardian": api.watcher_beat(ALERTS_ASSET), "reconciler": api.watcher_beat(RECONCILE_ASSET)}


def collect(fleet: FleetStore, *, silent_s: float, airflow_url: str = "", now: float | None = None,
            reconcile_period_s: float = 10.0, beats: dict[str, dict[str, Any] | None] | None = None,
            observed: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """The status document; ``problems`` lists every line that needs a human's attention.
    ``reconcile_period_s``: the reconciler's period (0: it is off and not checked); ``beats``: the watchers' beats
    (:func:`watcher_beats`; None: Airflow's REST API was not asked, and the watchers' liveness is not judged);
    ``observed``: what each job's machines report now (job -> ``{"seen", "held"}``, :func:`observe`), so that a job
    the fleet database calls running while its machines say exited is told apart."""
    now = time.time() if now is None else now
    problems: list[str] = []
    components = fleet.components()
    guardian = components.get("guardian")  # the last batch a task recorded
    recorded_age = None if guardian is None else round(now - guardian.seen_ts, 1)
    watcher = (beats or {}).get("guardian")
    g_age = _age(watcher, now)
    if beats is not None and g_age is None:
        problems.append("the alert watcher has written no beat: is tg_incident unpaused and the triggerer up?")
    elif g_age is not None and g_age > STALE_S:
        problems.append(f"the alert watcher last polled the bus {g_age:.0f}s ago: nothing watches the alerts; check "
                        f"the triggerer (and tg_incident's asset watcher)")
    reconciler = components.get("reconciler")  # the last findings a task acted on
    looked = (beats or {}).get("reconciler")
    r_age = _age(looked, now)
    if reconcile_period_s > 0 and beats is not None:
        if r_age is None:
            problems.append("the reconciler has never looked at the jobs: is tg_reconcile unpaused and the "
                            "triggerer up?")
        elif r_age > max(STALE_S, 3 * reconcile_period_s):
            problems.append(f"the reconciler last looked at the jobs {r_age:.0f}s ago: nothing looks behind the "
                            f"incidents; check the triggerer (and tg_reconcile's asset watcher)")
    airflow: dict[str, Any] = {}
    if airflow_url:
        airflow = airflow_health(airflow_url)
        if "error" in airflow:
            problems.append(f"airflow does not answer: {airflow['error']}")
        for part in ("metadatabase", "scheduler", "triggerer", "dag_processor"):
            st = (airflow.get(part) or {}).get("status")
            if "error" not in airflow and st not in (None, "healthy"):
                problems.append(f"airflow {part} is {st}")
    jobs = fleet.jobs()
    running = {j.name for j in jobs if j.state == "running"}
    liveness = fleet.liveness()
    agents: dict[str, Any] = {}
    for m in fleet.machines(state="active"):
        if m.job not in running:
            continue
        seen = liveness.get(m.name)
        age = None if seen is None else round(now - seen.changed_ts, 1)
        silent = bool(seen and seen.reported_ts)
        agents[m.name] = {"job": m.job, "heartbeat_age_s": age, "silent": silent}
        if silent:  # the watcher reported it (a task recorded that with the batch of its agent_silent alert)
            problems.append(f"agent of {m.name} ({m.job}) silent for {age:.0f}s")
    incidents = []
    for j in jobs:
        for inc in fleet.incidents(j.name):
            if inc.state in OPEN_INCIDENT_STATES:
                incidents.append({"incident": inc.id, "job": j.name, "state": inc.state, "category": inc.category,
                                  "level": inc.level, "summary": inc.summary,
                                  "open_s": round(now - inc.opened_ts, 1)})
                if inc.state == IncidentState.WAITING_HUMAN:
                    problems.append(f"HUMAN NEEDED: incident {inc.id} of job {j.name}: {inc.summary}")
    for j in jobs:
        if j.state not in ("running", "stopped") and not any(i["job"] == j.name for i in incidents):
            problems.append(f"job {j.name} is {j.state} and no incident handles it")
        seen = (observed or {}).get(j.name)
        if seen is not None:
            from trainguard.operators.fleet_view import job_problem

            why = job_problem(j.state, seen["seen"], seen.get("held") or [], [])
            if why:
                problems.append(f"job {j.name}: {why}")
    quarantined = fleet.quarantined(since=now - 3600)
    return {
        "ts": now,
        "guardian": {"last_poll_age_s": g_age, "last_recorded_age_s": recorded_age,
                     **{k: v for k, v in (watcher or {}).items() if k != "updated_at"}},
        "reconciler": {"last_pass_age_s": r_age, **{k: v for k, v in (looked or {}).items() if k != "updated_at"},
                       **({"last_acted_age_s": round(now - reconciler.seen_ts, 1)} if reconciler else {})},
        "airflow": airflow,
        "agents": agents,
        "jobs": [{"job": j.name, "state": j.state, "machines": j.machine_list, "revision": j.revision,
                  **({"observed": (observed or {})[j.name]["seen"]} if j.name in (observed or {}) else {})}
                 for j in jobs],
        "incidents": incidents,
        "quarantined_last_hour": {"count": len(quarantined),
                                  "latest": quarantined[-1].reason if quarantined else None},
        "problems": problems,
        "healthy": not problems,
    }


def observe(c: Any, jobs: list[Any]) -> dict[str, dict[str, Any]]:
    """What the machines of each job the fleet database calls running (or waiting for a human) report now: one
    ``tg-node job status`` round per job (``{"seen": running|stopped|partly running|unreachable, "held": ranks}``)."""
    from trainguard.operators.fleet_view import observed_state

    out: dict[str, dict[str, Any]] = {}
    for j in jobs:
        if j.state not in ("running", "waiting_human"):
            continue
        try:
            progress = c.jobs.progress(j.name)
        except Exception as exc:  # a machine that cannot be asked leaves the job to the database's word
            out[j.name] = {"seen": "unknown", "held": [], "error": f"{type(exc).__name__}: {exc}"[:200]}
            continue
        out[j.name] = {"seen": observed_state(progress), "held": progress.get("held") or []}
    return out


def _age(beat: dict[str, Any] | None, now: float) -> float | None:
    ts = (beat or {}).get("ts")
    return round(now - float(ts), 1) if isinstance(ts, (int, float)) else None


def render(doc: dict[str, Any]) -> str:
    """The status document as one screen of text."""
    g = doc["guardian"]
    age, recorded = g["last_poll_age_s"], g.get("last_recorded_age_s")
    polled = "polled: unknown (Airflow not asked)" if age is None else f"polled {age:.1f}s ago"
    watching = f", watching {g['watched']} machines" if "watched" in g else ""
    last = "" if recorded is None else f"; last batch recorded {recorded:.0f}s ago"
    lines = [f"guardian   {polled}{watching}{last}"]
    r = doc.get("reconciler") or {}
    if r.get("last_pass_age_s") is not None:
        lines.append(f"reconciler looked {r['last_pass_age_s']:.1f}s ago (pass {r.get('passes', '?')}, "
                     f"every {r.get('period_s', '?')}s)")
    a = doc["airflow"]
    if a:
        parts = ("metadatabase", "scheduler", "triggerer", "dag_processor")
        lines.append("airflow    " + (a["error"] if "error" in a else ", ".join(
            f"{part} {(a.get(part) or {}).get('status', '?')}" for part in parts if part in a)))
    beating = [f"{m} {v['heartbeat_age_s']}s" for m, v in sorted(doc["agents"].items())]
    lines.append(f"agents     {len(doc['agents'])} serving running jobs" + (f": {', '.join(beating)}" if beating
                                                                             else ""))
    for j in doc["jobs"]:
        seen = j.get("observed")
        said = "" if seen is None or seen == j["state"] else f" (its machines say {seen})"
        lines.append(f"job        {j['job']} {j['state']}{said} on {', '.join(j['machines'])} "
                     f"(revision {j['revision'] or '-'})")
    for i in doc["incidents"]:
        lines.append(f"incident   {i['incident']} of {i['job']}: {i['state'].replace('_', ' ')} "
                     f"({i['category'] or 'untriaged'}, open {i['open_s']:.0f}s): {i['summary'][:160]}")
    q = doc["quarantined_last_hour"]
    if q["count"]:
        lines.append(f"bus        {q['count']} documents quarantined in the last hour (latest: {q['latest']})")
    lines += [f"!! {p}" for p in doc["problems"]] or ["all well"]
    return "\n".join(lines)

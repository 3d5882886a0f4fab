"""What the Airflow UI's Fleet page shows (:mod:`trainguard.operators.plugins.fleet` renders it): every job with the
state the fleet database records *and* the state its machines report now (read over SSH with a short
timeout: a job stopped behind the control plane's back shows as not training, whatever the database
says), its revision and newest step, its machines and their states, its open incidents with the rung
handling them, the standby pool against its target, and the newest ETTR report.

Plain Python over a :class:`~trainguard.operators.control.Controller`: unit-tested on the scripted fleet.
"""

from __future__ import annotations

import time
from typing import Any

from trainguard.core.errors import TrainguardError
from trainguard.operators.fleet import states
from trainguard.operators.fleet.store import OPEN_INCIDENT_STATES


def observed_state(progress: dict[str, Any]) -> str:
    """One word for what the machines report: ``running`` when every machine runs the job, ``stopped``
    when none does, ``partly running`` otherwise, ``unreachable`` when no machine answered."""
    seen = dict(progress.get("states") or {})
    if not seen or all(s not in ("running", "exited", "absent") for s in seen.values()):
        return "unreachable"
    running = [m for m, s in seen.items() if s == "running"]
    if len(running) == len(seen):
        return "running"
    return "stopped" if not running else "partly running"


def job_problem(recorded: str, seen: str, held: list[int], waiting: list[Any]) -> str:
    """What needs a look about a job, in one line ("" when nothing does): an incident that waits for a human, a job
    the fleet database calls running that its machines say is not, ranks holding still on a non-finite step."""
    out = [f"incident {i.id} waits for a human: {(i.summary or '')[:200]}" for i in waiting]
    if recorded in ("running", "waiting_human") and seen not in ("running", "degraded", "unknown"):
        out.append(f"the fleet database says {recorded}, its machines say {seen}: the job is not training")
    if held:
        out.append(f"rank(s) {', '.join(map(str, held[:8]))} hold still on a non-finite step")
    return "; ".join(out)


def _rung(incident: Any) -> str:
    """The rung handling an open incident: its summary's ``next:`` (what triage decided), else its state."""
    for part in reversed((incident.summary or "").split("; ")):
        if part.startswith("next: "):
            return part[len("next: "):]
    return incident.state


def _degraded(c: Any, job: str, states_now: dict[str, Any], *, open_ids: set[int], now: float
              ) -> dict[str, Any] | None:
    """For a job run as replica groups that trains without some of them: which replicas are out, since when and for
    how long, and the share still training; None when it trains at full width (or is not such a job). Out: the
    replicas an open incident's degrade path took out (until their groups rejoin and it closes), or whose
    machines are down while enough others run (their incident not opened yet)."""
    taken = [a for a in c.fleet.actions() if a.kind == "degrade" and a.incident_id in open_ids
             and a.outcome in ("done", "pending")]
    if taken:
        a = taken[0]
        since = float(a.started_ts or now)
        ev = a.evidence or {}
        return {"replicas": list(ev.get("replicas") or []), "width": ev.get("width"), "since": since,
                "for_s": round(now - since, 1), "incident": a.incident_id}
    if not states_now or all(s == "running" for s in states_now.values()):
        return None
    training = c.jobs.training_groups(job, states_now)
    if not training:
        return None
    from trainguard.operators.policy import degrade

    j = c.fleet.job(job)
    out = list(degrade.replicas_of(c.topology(job), [i for i, n in enumerate(j.machine_list)
                                                     if n not in set(training)]))
    return {"replicas": out, "width": round((j.dp - len(out)) / j.dp, 4), "since": None, "for_s": None,
            "incident": None}


def collect(c: Any, *, now: float | None = None) -> dict[str, Any]:
    """The Fleet page's document."""
    from trainguard.operators import standby_pool
    from trainguard.operators.metrics import newest_ettr_reports

    now = time.time() if now is None else now
    ettr = newest_ettr_reports(c.fleet.actions())
    fleet_states = {m.name: m.state for m in c.fleet.machines()}  # one read for every job's machines
    jobs = []
    for j in c.fleet.jobs():
        try:
            progress = c.jobs.progress(j.name)
        except TrainguardError as exc:
            progress = {"step": None, "states": {}, "error": str(exc)}
        seen = observed_state(progress)
        machines = [{"machine": name, "state": fleet_states.get(name, "unknown"),
                     "job_process": progress["states"].get(name)} for name in j.machine_list]
        incidents = [{"incident": i.id, "state": i.state, "category": i.category or "untriaged",
                      "rung": _rung(i), "open_s": round(now - i.opened_ts, 1)}
                     for i in c.fleet.incidents(j.name) if i.state in OPEN_INCIDENT_STATES]
        degraded = _degraded(c, j.name, progress["states"], open_ids={i["incident"] for i in incidents}, now=now)
        if degraded is not None and seen == "partly running":
            seen = "degraded"  # some replica groups are down, enough of the others train on
        report = ettr.get(j.name)
        problem = job_problem(j.state, seen, progress.get("held") or [],
                              [i for i in c.fleet.incidents(j.name) if i.state == states.IncidentState.WAITING_HUMAN])
        jobs.append({"job": j.name, "state": seen, "recorded_state": j.state, "revision": j.revision or "-",
                     "step": progress.get("step"), "machines": machines, "incidents": incidents,
                     "ettr": None if report is None else {"cumulative": report.evidence.get("cumulative"),
                                                          "sliding": report.evidence.get("sliding")},
                     "degraded": degraded, "problem": problem})
    _history, _rate, serving, target = standby_pool.sizing(c.fleet, now)
    standbys = [m.name for m in c.fleet.machines(state=states.STANDBY)]
    return {"ts": now, "jobs": jobs, "pool": {"standbys": standbys, "target": target, "serving": serving,
                                              "short": max(0, target - len(standbys))}}

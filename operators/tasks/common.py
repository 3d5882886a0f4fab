"""What every task body shares: the run's note, the job's open incidents, work done by hand; and the one controller
of a triggerer's triggers (and of the api-server's Fleet page). A task body is handed its controller (its first
argument): the DAGs' tasks make it with :func:`trainguard.operators.hooks.fleet.task_controller`.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from trainguard.core.errors import TrainguardError
from trainguard.operators.control import ControlConfig, Controller
from trainguard.operators.fleet.states import IncidentState
from trainguard.operators.fleet.store import OPEN_INCIDENT_STATES

_SHARED: dict[tuple[str, str], Controller] = {}
_SHARED_LOCK = threading.Lock()


def shared_controller() -> Controller:
    """One controller per process and fleet for the triggers of a triggerer (and the api-server's Fleet
    page): one fleet database engine, one SSH credential lookup and one held connection per machine for
    all of them, built once (the first trigger pays it; the rest start checking at once). Its calls are
    reads: safe from the triggers' threads at once."""
    cfg = ControlConfig.from_env()
    key = (cfg.fleet_url, cfg.inventory)
    with _SHARED_LOCK:
        if key not in _SHARED:
            from trainguard.operators.hooks.fleet import task_controller

            _SHARED[key] = task_controller()
        return _SHARED[key]


def note(text: str) -> None:
    """The run's one-line note, in the UI (see :mod:`trainguard.operators.utils.notes`)."""
    from trainguard.operators.utils.notes import set_run_note

    set_run_note(text)


def open_incidents(c: Controller, job: str, *, other_than: int | None = None) -> list[int]:
    """The ids of the job's open incidents (open or waiting for a human), oldest first, but ``other_than``."""
    return [i.id for i in c.fleet.incidents(job) if i.state in OPEN_INCIDENT_STATES and i.id != other_than]


def arm_unless_busy(c: Controller, job: str, *, own_incident: int | None = None) -> dict[str, Any]:
    """Warm interpreters on every machine of a running job that has none ready, unless another incident of
    the job is open: its own run re-arms when it ends (arming here would race its restart)."""
    others = open_incidents(c, job, other_than=own_incident)
    if others:
        return {"skipped": f"incident {others[0]} of job {job} is open; its run re-arms when it ends"}
    state = c.fleet.job(job).state
    if state != "running":
        return {"skipped": f"job {job} is {state}"}
    return c.jobs.arm(job)


def name_mapped_task(machine: str) -> None:
    """Names the running mapped task after its machine (or its batch: see
    :func:`trainguard.operators.utils.mapping.label`) in the UI (its ``map_index_template``)."""
    from airflow.sdk import get_current_context

    get_current_context()["machine"] = machine


def max_mapped_tasks() -> int:
    """The most mapped task instances one expansion may have here (``[core] max_map_length``)."""
    from airflow.configuration import conf

    from trainguard.operators.utils.mapping import DEFAULT_MAX_MAP_LENGTH

    return conf.getint("core", "max_map_length", fallback=DEFAULT_MAX_MAP_LENGTH)


def incident_by_hand(c: Controller, job: str, summary: str) -> int:
    """An incident recording an operation run by hand (refused while the job has one open: alerts join
    the open incident, and two hands on one job is one too many; one that waits for a human is no hand on the
    job, and its reason may ask for this very operation)."""
    busy = [i for i in open_incidents(c, job) if c.fleet.incident(i).state == IncidentState.OPEN]
    if busy:
        raise TrainguardError(f"job {job} has incident {busy[-1]} open; run this by hand once it is closed")
    inc, _ = c.fleet.open_incident(job, [], category="manual")
    c.fleet.update_incident(inc.id, summary=summary, diagnosis_start_ts=time.time())
    return inc.id


def finish_by_hand(c: Controller, incident: int, culprits: list[str], *, evict: bool, reason: str,
                    restart: bool, note: str) -> dict[str, Any]:
    """Evict ``culprits`` (if asked, through the breaker), restart the job when it was stopped or its
    machines changed, close the incident. Over the breaker, the incident waits for a human."""
    out: dict[str, Any] = {"incident": incident}
    c.fleet.update_incident(incident, decided_ts=time.time())
    if evict and culprits:
        out["eviction"] = c.evictions.evict(incident, culprits, reason=reason)
    if c.fleet.incident(incident).state == IncidentState.WAITING_HUMAN:
        return out
    if restart or (out.get("eviction") or {}).get("swaps"):
        out["recovery"] = c.recovery.recover(incident)
    out["closed"] = c.incidents.close(incident, outcome=IncidentState.RESOLVED, note=note)["state"]
    return out

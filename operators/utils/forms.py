"""What the DAGs' trigger forms offer: read when a DAG file is parsed, so light and read-only (the fleet
database is never created or migrated from here)."""

from __future__ import annotations

from typing import Any

NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$"


def fleet_jobs() -> list[str]:
    """The jobs in the fleet database (its connection ``tg_fleet``, else ``TG_FLEET_URL``); empty when it is not
    there yet or unreadable."""
    from trainguard.core.errors import TrainguardError
    from trainguard.operators.fleet.store import FleetStore
    from trainguard.operators.settings import ControlSettings

    try:
        return FleetStore.job_names(ControlSettings.from_env().fleet_url)
    except (TrainguardError, ValueError, OSError):
        return []


def job_param(description: str) -> Any:
    """A form field for a job of the fleet: pre-filled with its first job and offering all of them (free
    text allowed); with no job in the fleet yet, empty and required."""
    from airflow.sdk import Param

    jobs = fleet_jobs()
    if not jobs:
        return Param(type="string", pattern=NAME, description=f"{description} (no job in the fleet database yet)")
    return Param(jobs[0], type="string", pattern=NAME, examples=jobs, description=description)


def free_machines() -> list[str]:
    """The machines a submitted job may take (checked standbys serving no job); empty when the fleet database is
    not there yet or unreadable."""
    from trainguard.core.errors import TrainguardError
    from trainguard.operators.fleet.store import FleetStore
    from trainguard.operators.settings import ControlSettings

    try:
        return FleetStore.free_machine_names(ControlSettings.from_env().fleet_url)
    except (TrainguardError, ValueError, OSError):
        return []

"""The fleet database (SQLAlchemy): machines and their states, jobs, revisions, incidents, alerts,
actions, checkpoints and ETTR events. See :class:`operators.fleet.store.FleetStore`."""

from operators.fleet.store import FleetError, FleetStore

__all__ = ["FleetError", "FleetStore"]

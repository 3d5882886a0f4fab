"""The fleet database (SQLAlchemy): machines and their states, jobs, revisions, incidents, alerts,
actions, checkpoints and ETTR events. See :class:`trainguard.operators.fleet.store.FleetStore`."""

from trainguard.operators.fleet.store import FleetError, FleetStore

__all__ = ["FleetError", "FleetStore"]

"""The fleet database's tables (SQLAlchemy 2 ORM): the current schema.

The schema a database actually has is built by :mod:`trainguard.operators.fleet.migrations`; a test checks that
migrating an empty database yields exactly these tables, so the two never drift apart.

Times are UNIX seconds (floats, UTC). JSON columns hold plain documents (never pickles).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import JSON, Boolean, Float, ForeignKey, Integer, String, Text, UniqueConstraint
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from trainguard.core.topology import Topology


class Base(DeclarativeBase):
    pass


class Machine(Base):
    """A machine and where it is in its life: see :data:`trainguard.operators.fleet.states.TRANSITIONS`."""

    __tablename__ = "machines"

    name: Mapped[str] = mapped_column(String(128), primary_key=True)
    address: Mapped[str] = mapped_column(String(256), default="")
    state: Mapped[str] = mapped_column(String(32), index=True)
    state_since: Mapped[float] = mapped_column(Float)
    job: Mapped[str | None] = mapped_column(String(128), ForeignKey("jobs.name"), nullable=True, index=True)
    reason: Mapped[str] = mapped_column(Text, default="")
    evictions: Mapped[int] = mapped_column(Integer, default=0)
    checked_ts: Mapped[float | None] = mapped_column(Float, nullable=True)  # last passed self-check


class MachineEvent(Base):
    """One state change of a machine (the audit trail)."""

    __tablename__ = "machine_events"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    machine: Mapped[str] = mapped_column(String(128), ForeignKey("machines.name"), index=True)
    from_state: Mapped[str | None] = mapped_column(String(32), nullable=True)
    to_state: Mapped[str] = mapped_column(String(32))
    ts: Mapped[float] = mapped_column(Float)
    reason: Mapped[str] = mapped_column(Text, default="")
    incident_id: Mapped[int | None] = mapped_column(Integer, ForeignKey("incidents.id"), nullable=True)
    job: Mapped[str | None] = mapped_column(String(128), nullable=True, index=True)  # the job it left or served


class Job(Base):
    """A training job: its layout, its machines in node-rank order, its code revisions."""

    __tablename__ = "jobs"

    name: Mapped[str] = mapped_column(String(128), primary_key=True)
    tp: Mapped[int] = mapped_column(Integer)
    pp: Mapped[int] = mapped_column(Integer)
    dp: Mapped[int] = mapped_column(Integer)
    ranks_per_machine: Mapped[int] = mapped_column(Integer)
    machine_list: Mapped[list[str]] = mapped_column(JSON, default=list)
    state: Mapped[str] = mapped_column(String(32), default="running")
    revision: Mapped[str] = mapped_column(String(128), default="")
    pending_revision: Mapped[str | None] = mapped_column(String(128), nullable=True)  # lazy update
    train_args: Mapped[list[str]] = mapped_column(JSON, default=list)
    # the job's spec as submitted (trainguard.operators.jobspec.JobSpec): what every launch and restart runs
    spec: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    created_ts: Mapped[float] = mapped_column(Float)
    updated_ts: Mapped[float] = mapped_column(Float)

    @property
    def topology(self) -> Topology:
        """The job's parallel layout (its ranks on its machines)."""
        return Topology(self.tp, self.pp, self.dp, ranks_per_machine=self.ranks_per_machine)


class Revision(Base):
    """A code revision of a job; ``known_good`` once it ran healthy steps."""

    __tablename__ = "revisions"
    __table_args__ = (UniqueConstraint("job", "revision"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job: Mapped[str] = mapped_column(String(128), ForeignKey("jobs.name"), index=True)
    revision: Mapped[str] = mapped_column(String(128))
    recorded_ts: Mapped[float] = mapped_column(Float)
    known_good: Mapped[bool] = mapped_column(Boolean, default=False)
    good_ts: Mapped[float | None] = mapped_column(Float, nullable=True)
    reason: Mapped[str] = mapped_column(Text, default="")


class Incident(Base):
    """One failure of a job and what was done about it. ``level`` is its position on the ladder."""

    __tablename__ = "incidents"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job: Mapped[str] = mapped_column(String(128), ForeignKey("jobs.name"), index=True)
    state: Mapped[str] = mapped_column(String(32), index=True)  # open, waiting_human, resolved, failed
    category: Mapped[str] = mapped_column(String(32), default="")  # triage outcome
    machines: Mapped[list[str]] = mapped_column(JSON, default=list)  # the machines its triage implicated
    level: Mapped[int] = mapped_column(Integer, default=0)
    opened_ts: Mapped[float] = mapped_column(Float)
    first_alert_ts: Mapped[float] = mapped_column(Float)
    diagnosis_start_ts: Mapped[float | None] = mapped_column(Float, nullable=True)
    decided_ts: Mapped[float | None] = mapped_column(Float, nullable=True)
    resumed_ts: Mapped[float | None] = mapped_column(Float, nullable=True)
    closed_ts: Mapped[float | None] = mapped_column(Float, nullable=True)
    summary: Mapped[str] = mapped_column(Text, default="")
    lost_steps: Mapped[int | None] = mapped_column(Integer, nullable=True)


class Alert(Base):
    """An alert from the bus, attached to the incident it became part of."""

    __tablename__ = "alerts"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)  # the bus's alert id
    ts: Mapped[float] = mapped_column(Float, index=True)
    job: Mapped[str] = mapped_column(String(128), default="", index=True)
    machine: Mapped[str] = mapped_column(String(128), default="")
    rank: Mapped[int | None] = mapped_column(Integer, nullable=True)
    kind: Mapped[str] = mapped_column(String(64))
    severity: Mapped[str] = mapped_column(String(16), default="")
    incident_id: Mapped[int | None] = mapped_column(Integer, ForeignKey("incidents.id"), nullable=True, index=True)
    document: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)


class Action(Base):
    """A decision and its execution: evict, diagnose, roll back, restart ... with evidence and outcome.

    ``key`` makes it idempotent: recording the same action twice returns the first."""

    __tablename__ = "actions"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    key: Mapped[str] = mapped_column(String(256), unique=True)
    incident_id: Mapped[int | None] = mapped_column(Integer, ForeignKey("incidents.id"), nullable=True, index=True)
    kind: Mapped[str] = mapped_column(String(32))
    machines: Mapped[list[str]] = mapped_column(JSON, default=list)
    evidence: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    outcome: Mapped[str] = mapped_column(String(32), default="pending")  # pending, done, failed, skipped, dry_run
    detail: Mapped[str] = mapped_column(Text, default="")
    dry_run: Mapped[bool] = mapped_column(Boolean, default=False)
    started_ts: Mapped[float] = mapped_column(Float)
    finished_ts: Mapped[float | None] = mapped_column(Float, nullable=True)


class Checkpoint(Base):
    """A committed checkpoint step of a job and its verification."""

    __tablename__ = "checkpoints"
    __table_args__ = (UniqueConstraint("job", "step"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job: Mapped[str] = mapped_column(String(128), ForeignKey("jobs.name"), index=True)
    step: Mapped[int] = mapped_column(Integer)
    committed_ts: Mapped[float] = mapped_column(Float)
    verified: Mapped[bool | None] = mapped_column(Boolean, nullable=True)  # None: not yet checked
    verified_ts: Mapped[float | None] = mapped_column(Float, nullable=True)
    problems: Mapped[list[str]] = mapped_column(JSON, default=list)


class EttrEvent(Base):
    """A stretch of a job's wall time and what it was: productive steps, or time lost to an incident
    (``kind``: productive, detection, diagnosis, recovery, lost_work)."""

    __tablename__ = "ettr_events"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job: Mapped[str] = mapped_column(String(128), ForeignKey("jobs.name"), index=True)
    kind: Mapped[str] = mapped_column(String(16))
    start_ts: Mapped[float] = mapped_column(Float)
    end_ts: Mapped[float] = mapped_column(Float)
    incident_id: Mapped[int | None] = mapped_column(Integer, ForeignKey("incidents.id"), nullable=True)
    detail: Mapped[str] = mapped_column(Text, default="")


class BusCursor(Base):
    """A reader's cursor on the alert bus: every name it has read and recorded that is still in its folder,
    with the time it first read it by its own clock. Committed in the transaction that records what the
    names held, so a failure in between reads them again (recording them again is a no-op)."""

    __tablename__ = "bus_cursor"

    reader: Mapped[str] = mapped_column(String(64), primary_key=True)  # "guardian", "checkpoint-notices"
    name: Mapped[str] = mapped_column(String(256), primary_key=True)
    seen_ts: Mapped[float] = mapped_column(Float)


class QuarantinedAlert(Base):
    """A document of the bus that is never acted on, and why: over the size limit, not a valid alert, or
    naming a machine or job the inventory and the fleet do not know."""

    __tablename__ = "quarantined_alerts"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    reader: Mapped[str] = mapped_column(String(64), default="")
    name: Mapped[str] = mapped_column(String(256), default="")
    machine: Mapped[str] = mapped_column(String(128), default="")  # as the document claims (unchecked)
    kind: Mapped[str] = mapped_column(String(64), default="")
    reason: Mapped[str] = mapped_column(Text, default="")
    ts: Mapped[float] = mapped_column(Float, index=True)
    document: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)  # bounded; {} when never parsed


class AgentLiveness(Base):
    """What the guardian last saw of a machine's agent heartbeat: its change token, when (the guardian's
    clock) it last changed, and when the guardian reported it silent (None: not silent)."""

    __tablename__ = "agent_liveness"

    machine: Mapped[str] = mapped_column(String(128), primary_key=True)
    token: Mapped[str] = mapped_column(String(256), default="")
    changed_ts: Mapped[float] = mapped_column(Float)
    reported_ts: Mapped[float | None] = mapped_column(Float, nullable=True)


class Component(Base):
    """A part of trainguard's own control plane and when it last said it is alive (the guardian's poll)."""

    __tablename__ = "components"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    seen_ts: Mapped[float] = mapped_column(Float)
    detail: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)

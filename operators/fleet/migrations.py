"""Schema migrations of the fleet database, applied in order with Alembic's operations API.

Each migration is a function of an :class:`alembic.operations.Operations` and is frozen once released:
a schema change is a new migration (and the same change in :mod:`trainguard.operators.fleet.models`). The applied
version lives in the table ``tg_schema``; :func:`migrate` applies what is missing, each migration in
its own transaction, and refuses a database newer than this code.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import sqlalchemy as sa

from trainguard.core.errors import TrainguardError

if TYPE_CHECKING:  # Alembic (and Mako, Pygments under it) is imported only to migrate: a task opening the
    # fleet database never pays for it
    from alembic.operations import Operations

VERSION_TABLE = sa.Table("tg_schema", sa.MetaData(),
                         sa.Column("version", sa.Integer, primary_key=True, autoincrement=False),
                         sa.Column("description", sa.String(200), nullable=False),
                         sa.Column("applied_ts", sa.Float, nullable=False))


def _v1(op: Operations) -> None:
    """The first schema: machines, their events, jobs, revisions, incidents, alerts, actions,
    checkpoints, ETTR events."""
    col = sa.Column
    s32, s64, s128 = sa.String(32), sa.String(64), sa.String(128)
    op.create_table(
        "jobs",
        col("name", s128, primary_key=True), col("tp", sa.Integer, nullable=False),
        col("pp", sa.Integer, nullable=False), col("dp", sa.Integer, nullable=False),
        col("ranks_per_machine", sa.Integer, nullable=False), col("machine_list", sa.JSON, nullable=False),
        col("state", s32, nullable=False), col("revision", s128, nullable=False),
        col("pending_revision", s128), col("train_args", sa.JSON, nullable=False),
        col("created_ts", sa.Float, nullable=False), col("updated_ts", sa.Float, nullable=False))
    op.create_table(
        "incidents",
        col("id", sa.Integer, primary_key=True, autoincrement=True),
        col("job", s128, sa.ForeignKey("jobs.name"), nullable=False, index=True),
        col("state", s32, nullable=False, index=True), col("category", s32, nullable=False),
        col("level", sa.Integer, nullable=False), col("opened_ts", sa.Float, nullable=False),
        col("first_alert_ts", sa.Float, nullable=False), col("diagnosis_start_ts", sa.Float),
        col("decided_ts", sa.Float), col("resumed_ts", sa.Float), col("closed_ts", sa.Float),
        col("summary", sa.Text, nullable=False), col("lost_steps", sa.Integer))
    op.create_table(
        "machines",
        col("name", s128, primary_key=True), col("address", sa.String(256), nullable=False),
        col("state", s32, nullable=False, index=True), col("state_since", sa.Float, nullable=False),
        col("job", s128, sa.ForeignKey("jobs.name"), index=True), col("reason", sa.Text, nullable=False),
        col("evictions", sa.Integer, nullable=False), col("checked_ts", sa.Float))
    op.create_table(
        "machine_events",
        col("id", sa.Integer, primary_key=True, autoincrement=True),
        col("machine", s128, sa.ForeignKey("machines.name"), nullable=False, index=True),
        col("from_state", s32), col("to_state", s32, nullable=False), col("ts", sa.Float, nullable=False),
        col("reason", sa.Text, nullable=False), col("incident_id", sa.Integer, sa.ForeignKey("incidents.id")))
    op.create_table(
        "revisions",
        col("id", sa.Integer, primary_key=True, autoincrement=True),
        col("job", s128, sa.ForeignKey("jobs.name"), nullable=False, index=True),
        col("revision", s128, nullable=False), col("recorded_ts", sa.Float, nullable=False),
        col("known_good", sa.Boolean, nullable=False), col("good_ts", sa.Float),
        col("reason", sa.Text, nullable=False), sa.UniqueConstraint("job", "revision"))
    op.create_table(
        "alerts",
        col("id", s64, primary_key=True), col("ts", sa.Float, nullable=False, index=True),
        col("job", s128, nullable=False, index=True), col("machine", s128, nullable=False),
        col("rank", sa.Integer), col("kind", s64, nullable=False), col("severity", sa.String(16), nullable=False),
        col("incident_id", sa.Integer, sa.ForeignKey("incidents.id"), index=True),
        col("document", sa.JSON, nullable=False))
    op.create_table(
        "actions",
        col("id", sa.Integer, primary_key=True, autoincrement=True), col("key", sa.String(256), nullable=False,
                                                                         unique=True),
        col("incident_id", sa.Integer, sa.ForeignKey("incidents.id"), index=True),
        col("kind", s32, nullable=False), col("machines", sa.JSON, nullable=False),
        col("evidence", sa.JSON, nullable=False), col("outcome", s32, nullable=False),
        col("detail", sa.Text, nullable=False), col("dry_run", sa.Boolean, nullable=False),
        col("started_ts", sa.Float, nullable=False), col("finished_ts", sa.Float))
    op.create_table(
        "checkpoints",
        col("id", sa.Integer, primary_key=True, autoincrement=True),
        col("job", s128, sa.ForeignKey("jobs.name"), nullable=False, index=True),
        col("step", sa.Integer, nullable=False), col("committed_ts", sa.Float, nullable=False),
        col("verified", sa.Boolean), col("verified_ts", sa.Float), col("problems", sa.JSON, nullable=False),
        sa.UniqueConstraint("job", "step"))
    op.create_table(
        "ettr_events",
        col("id", sa.Integer, primary_key=True, autoincrement=True),
        col("job", s128, sa.ForeignKey("jobs.name"), nullable=False, index=True),
        col("kind", sa.String(16), nullable=False), col("start_ts", sa.Float, nullable=False),
        col("end_ts", sa.Float, nullable=False), col("incident_id", sa.Integer, sa.ForeignKey("incidents.id")),
        col("detail", sa.Text, nullable=False))


def _v2(op: Operations) -> None:
    """The bus cursor, quarantined alerts, agent liveness and the control plane's own components."""
    col = sa.Column
    op.create_table(
        "bus_cursor",
        col("reader", sa.String(64), primary_key=True), col("name", sa.String(256), primary_key=True),
        col("seen_ts", sa.Float, nullable=False))
    op.create_table(
        "quarantined_alerts",
        col("id", sa.Integer, primary_key=True, autoincrement=True), col("reader", sa.String(64), nullable=False),
        col("name", sa.String(256), nullable=False), col("machine", sa.String(128), nullable=False),
        col("kind", sa.String(64), nullable=False), col("reason", sa.Text, nullable=False),
        col("ts", sa.Float, nullable=False, index=True), col("document", sa.JSON, nullable=False))
    op.create_table(
        "agent_liveness",
        col("machine", sa.String(128), primary_key=True), col("token", sa.String(256), nullable=False),
        col("changed_ts", sa.Float, nullable=False), col("reported_ts", sa.Float))
    op.create_table(
        "components",
        col("name", sa.String(64), primary_key=True), col("seen_ts", sa.Float, nullable=False),
        col("detail", sa.JSON, nullable=False))


def _v3(op: Operations) -> None:
    """Each machine event names the job the machine left or joined (the eviction breaker counts by it, not
    by the reason's wording); events recorded before it get theirs from the reason it was written with."""
    op.add_column("machine_events", sa.Column("job", sa.String(128), nullable=True))
    op.create_index("ix_machine_events_job", "machine_events", ["job"])
    conn = op.get_bind()
    events = sa.table("machine_events", sa.column("id", sa.Integer), sa.column("reason", sa.Text),
                      sa.column("job", sa.String(128)))
    jobs = sorted((row[0] for row in conn.execute(sa.text("SELECT name FROM jobs"))), key=len, reverse=True)
    for row in conn.execute(sa.select(events.c.id, events.c.reason)).all():
        job = next((j for j in jobs if row.reason.startswith(f"evicted from {j}: ") or row.reason == f"serves job {j}"
                    or (row.reason.startswith("replaces ") and row.reason.endswith(f" in {j}"))), None)
        if job is not None:
            conn.execute(events.update().where(events.c.id == row.id).values(job=job))


def _v4(op: Operations) -> None:
    """Each incident names the machines its triage implicated: whether the next failure repeats it (and climbs
    the ladder) depends on them. Incidents triaged before it name none, and the rule then goes by their
    category alone."""
    op.add_column("incidents", sa.Column("machines", sa.JSON, nullable=False, server_default="[]"))


def _v5(op: Operations) -> None:
    """Each job stores its spec (what to run: command, working directory, environment, launcher, layout), which
    every launch and restart runs. A job recorded before ran the reference job with the layout on its command
    line: its spec says so."""
    op.add_column("jobs", sa.Column("spec", sa.JSON, nullable=False, server_default="{}"))
    conn = op.get_bind()
    jobs = sa.table("jobs", *(sa.column(n, sa.Integer) for n in ("tp", "pp", "dp", "ranks_per_machine")),
                    sa.column("name", sa.String(128)), sa.column("machine_list", sa.JSON),
                    sa.column("train_args", sa.JSON), sa.column("revision", sa.String(128)),
                    sa.column("spec", sa.JSON))
    for row in conn.execute(sa.select(jobs)).all():
        spec = {"name": row.name, "command": ["examples/gpt3d/train.py", *(row.train_args or [])],
                "machines": max(1, row.tp * row.pp * row.dp // max(1, row.ranks_per_machine)),
                "processes_per_machine": row.ranks_per_machine,
                "layout": {"tp": row.tp, "pp": row.pp, "dp": row.dp}, "pass_layout": True,
                "revision": row.revision or "r0"}
        conn.execute(jobs.update().where(jobs.c.name == row.name).values(spec=spec))


MIGRATIONS: list[tuple[int, str, Callable[[Operations], None]]] = [
    (1, "initial schema", _v1),
    (2, "bus cursor, quarantined alerts, agent liveness, components", _v2),
    (3, "machine events name their job", _v3),
    (4, "incidents name the machines their triage implicated", _v4),
    (5, "jobs store their spec", _v5),
]
LATEST = MIGRATIONS[-1][0]


class SchemaError(TrainguardError):
    """The database's schema is newer than this code, or a migration failed."""


@contextlib.contextmanager
def _quiet_alembic() -> Iterator[None]:
    """Alembic's context logs two INFO lines per migration; a command's stdout (``--json``) is its document."""
    log = logging.getLogger("alembic.runtime.migration")
    level = log.level
    log.setLevel(logging.WARNING)
    try:
        yield
    finally:
        log.setLevel(level)


def current_version(conn: sa.Connection) -> int:
    if not sa.inspect(conn).has_table(VERSION_TABLE.name):
        return 0
    return int(conn.execute(sa.select(sa.func.max(VERSION_TABLE.c.version))).scalar() or 0)


def migrate(engine: sa.Engine) -> list[int]:
    """Bring the database to :data:`LATEST`; returns the versions applied (none: already there)."""
    from alembic.operations import Operations
    from alembic.runtime.migration import MigrationContext

    applied = []
    with engine.begin() as conn:
        VERSION_TABLE.create(conn, checkfirst=True)
        have = current_version(conn)
    if have > LATEST:
        raise SchemaError(f"the fleet database {engine.url.render_as_string(hide_password=True)} has schema "
                          f"version {have}, newer than this trainguard's {LATEST}; upgrade trainguard")
    for version, description, step in MIGRATIONS:
        if version <= have:
            continue
        try:
            with engine.begin() as conn, _quiet_alembic():
                step(Operations(MigrationContext.configure(conn)))
                conn.execute(VERSION_TABLE.insert().values(version=version, description=description,
                                                           applied_ts=time.time()))
        except sa.exc.SQLAlchemyError as exc:
            raise SchemaError(f"fleet database migration {version} ({description}) failed and was rolled "
                              f"back: {str(exc).splitlines()[0]}") from None
        applied.append(version)
    return applied

"""The fleet database: every state change a transaction, every action idempotent. ``FleetStore(url)`` opens a
database: a SQLite file by default, Postgres by URL. Its schema is brought up to date only when the fleet is
provisioned (``migrate=True``: ``trainguard fleet migrate``, the compose file's provisioner, a controller
made outside Airflow); anywhere else (every task, trigger and command) an out-of-date schema is a one-line
error saying what to run. The methods are the only way trainguard changes fleet state; each runs in one
transaction (on SQLite ``BEGIN IMMEDIATE``, so two writers serialise instead of both reading the old state),
and applying the same change twice is a no-op that says so (``changed`` False), never a second row or a
double eviction.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from trainguard.operators.fleet.db import (
    CHUNK,
    FREE,
    INCIDENT_STATES,
    OPEN_INCIDENT_STATES,
    RETRY_FIRST_S,
    RETRY_MAX_S,
    FleetError,
    FleetUnavailable,
    chunks,
    retrying,
    sqlite_immediate,
    transient,
    url_for,
)
from trainguard.operators.fleet.incidents import IncidentRecords
from trainguard.operators.fleet.jobs import JobRecords
from trainguard.operators.fleet.ledger import LedgerRecords
from trainguard.operators.fleet.machines import MachineRecords
from trainguard.operators.fleet.migrations import LATEST, current_version
from trainguard.operators.fleet.migrations import migrate as apply_migrations
from trainguard.operators.fleet.models import (
    Action,
    Incident,
    Job,
    Machine,
)

__all__ = ["CHUNK", "INCIDENT_STATES", "OPEN_INCIDENT_STATES", "FleetError", "FleetStore", "FleetUnavailable",
           "transient", "url_for"]

log = logging.getLogger(__name__)


class FleetStore(MachineRecords, JobRecords, IncidentRecords, LedgerRecords):
    """The fleet database of one control plane."""

    def __init__(self, url: str | Path, *, clock: Any = time.time, migrate: bool = False,
                 retry_s: float = 0.0) -> None:
        """``retry_s``: how long a call waits out an unavailable database (:func:`transient`) before it fails
        (0: at once; the control plane's tasks and triggers wait ``TG_FLEET_RETRY_S``). Opened without
        ``migrate``, a SQLite file is never created: one that is missing is an error (or, with ``retry_s``,
        waited for: a file moved away and back)."""
        self.url = url_for(url)
        self.retry_s = float(retry_s)
        sqlite_path = self.url.removeprefix("sqlite:///") if self.url.startswith("sqlite:///") else ""
        if sqlite_path and migrate:
            Path(sqlite_path).parent.mkdir(parents=True, exist_ok=True)
        try:
            # read-write, never create: a connection made while the file is away fails instead of leaving an
            # empty database in its place
            engine_url = f"sqlite:///file:{sqlite_path}?mode=rw&uri=true" if sqlite_path and not migrate else self.url
            self.engine = sa.create_engine(engine_url, pool_pre_ping=not sqlite_path)
        except (sa.exc.ArgumentError, ImportError) as exc:
            raise FleetError(f"fleet database URL {url!s} is not usable ({exc}); give a SQLite path or a "
                             f"postgresql:// URL", exit_code=2) from None
        if self.engine.dialect.name == "sqlite":
            sqlite_immediate(self.engine)
        self.migrations_applied: list[int] = []
        if migrate:
            try:
                self.migrations_applied = apply_migrations(self.engine)
            except sa.exc.OperationalError as exc:
                raise FleetError(f"fleet database {self.url} cannot be opened ({exc.orig!s}); check the path "
                                 f"or URL and its permissions", exit_code=2) from None
        else:
            self._patiently("open", lambda: self._check_schema(url), missing_is_transient=True)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)
        self.clock = clock

    def _patiently(self, what: str, call: Any, *, missing_is_transient: bool = False) -> Any:
        """``call()``, tried again while the database is unavailable, for at most ``retry_s`` (0: once)."""
        import tenacity

        def again(exc: BaseException) -> bool:
            return transient(exc) or (missing_is_transient and isinstance(exc, FleetError)
                                      and "does not exist" in str(exc))

        def waited(state: tenacity.RetryCallState) -> None:
            log.warning("fleet database %s unavailable for %s (try %d): %s", self._safe_url(), what,
                        state.attempt_number, state.outcome.exception() if state.outcome else "")

        try:
            for attempt in tenacity.Retrying(
                    retry=tenacity.retry_if_exception(again), reraise=True, before_sleep=waited,
                    wait=tenacity.wait_exponential(multiplier=RETRY_FIRST_S, max=RETRY_MAX_S),
                    stop=tenacity.stop_after_delay(max(0.0, self.retry_s))):
                with attempt:
                    return call()
        except FleetError:
            raise
        except sa.exc.SQLAlchemyError as exc:
            if not transient(exc):
                raise
            orig = getattr(exc, "orig", None) or exc
            waited_s = f" for {self.retry_s:.0f}s" if self.retry_s > 0 else ""
            raise FleetUnavailable(f"fleet database {self._safe_url()} did not answer{waited_s} ({str(orig)[:200]}); "
                                   f"check that it runs and TG_FLEET_URL names it") from None
        return None  # not reached: the last try returns or raises

    def _safe_url(self) -> str:
        return self.engine.url.render_as_string(hide_password=True) if hasattr(self, "engine") else self.url

    def _check_schema(self, url: str | Path) -> None:
        """Refuse a database whose schema is not this code's (none yet, older, or newer), in one line."""
        if self.url.startswith("sqlite:///") and not Path(self.url.removeprefix("sqlite:///")).exists():
            raise FleetError(f"fleet database {url!s} does not exist; provision it first: trainguard fleet migrate "
                             f"(TG_FLEET_URL names it)", exit_code=2)
        with self.engine.connect() as conn:
            have = current_version(conn)
        if have != LATEST:
            raise FleetError(f"fleet database {self.engine.url.render_as_string(hide_password=True)} has schema "
                             f"version {have}, this trainguard needs {LATEST}; "
                             + ("upgrade trainguard" if have > LATEST else "run: trainguard fleet migrate"),
                             exit_code=2)

    def close(self) -> None:
        self.engine.dispose()

    @staticmethod
    def job_names(url: str | Path) -> list[str]:
        """The jobs of the fleet database at ``url``, read only (no migration, nothing created): what the
        DAGs' forms offer. Empty when there is no such database yet."""
        return FleetStore._read_names(url, sa.select(Job.name).order_by(Job.name))

    @staticmethod
    def free_machine_names(url: str | Path) -> list[str]:
        """The machines a submitted job may take (checked standbys serving no job), read only: what the launch
        form offers. Empty when there is no such database yet."""
        return FleetStore._read_names(url, FREE)

    @staticmethod
    def _read_names(url: str | Path, query: Any) -> list[str]:
        url = url_for(url)
        if url.startswith("sqlite:///") and not Path(url.removeprefix("sqlite:///")).exists():
            return []
        engine = sa.create_engine(url)
        try:
            with engine.connect() as conn:
                return [r[0] for r in conn.execute(query)]
        except sa.exc.SQLAlchemyError:
            return []
        finally:
            engine.dispose()

    @staticmethod
    def _required(s: Session, model: type, key: Any, *, lock: bool = False) -> Any:
        """The row of ``model`` with primary key ``key``, or a one-line FleetError naming what is missing."""
        row = s.get(model, key, with_for_update=lock)
        if row is None:
            what = {Machine: f"machine {key} is not in the fleet database; register it first",
                    Job: f"job {key} is not in the fleet database",
                    Incident: f"incident {key} does not exist",
                    Action: f"action {key} does not exist"}[model]
            raise FleetError(what, exit_code=2)
        return row

    @contextmanager
    def tx(self) -> Iterator[Session]:
        """One transaction: committed at the end, rolled back on any error."""
        with self._sessions() as session, session.begin():
            yield session

    @staticmethod
    def _dialect_insert(s: Session) -> Any:
        """The ``insert`` of the session's database with ON CONFLICT (SQLite, Postgres), or None."""
        dialect = s.get_bind().dialect.name
        if dialect == "postgresql":
            from sqlalchemy.dialects.postgresql import insert as pg_insert

            return pg_insert
        if dialect == "sqlite":
            from sqlalchemy.dialects.sqlite import insert as sqlite_insert

            return sqlite_insert
        return None

    @classmethod
    def _insert_new(cls, s: Session, model: type, rows: Sequence[dict[str, Any]], keys: Sequence[str]) -> int:
        """Insert those of ``rows`` whose key (``keys``: the primary key or a unique one) ``model``'s table does
        not hold yet, leaving the rows it holds as they are: a statement per :data:`CHUNK` rows (INSERT ... ON
        CONFLICT DO NOTHING), written as plain rows (no ORM objects). Returns the rows inserted."""
        if not rows:
            return 0
        table: sa.Table = model.__table__  # type: ignore[attr-defined]
        insert = cls._dialect_insert(s)
        if insert is None:  # another database: look the keys up first (a statement per chunk all the same)
            cols = [table.c[k] for k in keys]
            held: set[tuple[Any, ...]] = set()
            for chunk in chunks(rows):
                wanted = sa.tuple_(*cols).in_([tuple(r[k] for k in keys) for r in chunk])
                held.update(tuple(r) for r in s.execute(select(*cols).where(wanted)))
            rows = [r for r in rows if tuple(r[k] for k in keys) not in held]
            for chunk in chunks(rows):
                s.execute(sa.insert(table), chunk)
            return len(rows)
        stmt = insert(table).on_conflict_do_nothing(index_elements=list(keys))
        inserted = 0
        for chunk in chunks(rows):
            inserted += max(0, s.execute(stmt, chunk).rowcount or 0)
        return inserted

    @classmethod
    def _upsert(cls, s: Session, model: type, rows: Sequence[dict[str, Any]], keys: Sequence[str]) -> None:
        """Insert ``rows`` into ``model``'s table, a row whose primary key (``keys``) is there already updating its
        other columns: a statement per :data:`CHUNK` rows (INSERT ... ON CONFLICT DO UPDATE, on SQLite and
        Postgres alike)."""
        if not rows:
            return
        insert = cls._dialect_insert(s)
        if insert is None:  # another database: one merge per row (correct, not bulk)
            for row in rows:
                s.merge(model(**row))
            return
        stmt = insert(model.__table__)  # type: ignore[attr-defined]
        stmt = stmt.on_conflict_do_update(index_elements=list(keys),
                                          set_={c: stmt.excluded[c] for c in rows[0] if c not in keys})
        for chunk in chunks(rows):
            s.execute(stmt, chunk)


# every public call of the store is one transaction (its own methods and its parts'): tried again while the
# database is unavailable
for _name in sorted({n for klass in FleetStore.__mro__[:-1] for n in vars(klass)}):
    _fn = inspect.getattr_static(FleetStore, _name)
    if not _name.startswith("_") and callable(_fn) and not isinstance(_fn, (staticmethod, classmethod)) \
            and _name not in ("close", "tx"):
        setattr(FleetStore, _name, retrying(_fn))

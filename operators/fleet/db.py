"""The fleet database's ground floor: its errors, which failures are transient and retried, URLs, SQLite's
write lock at BEGIN, and the queries the store's parts share."""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event, select

from trainguard.core.errors import EXIT_REFUSED, TrainguardError
from trainguard.operators.fleet import states
from trainguard.operators.fleet.models import (
    Machine,
)

OPEN_INCIDENT_STATES = states.OPEN_INCIDENT_STATES
INCIDENT_STATES = states.INCIDENT_STATES
#: rows (or ids) per statement when the store writes or looks up many at once: well within every database's
#: limit on a statement's parameters
CHUNK = 1000


class FleetError(TrainguardError):
    """A fleet change that is not allowed (unknown machine, forbidden transition ...)."""

    exit_code = EXIT_REFUSED


class JobReleased(FleetError):
    """The job was released (stopped by hand, or its launch failed) while something meant to set it running: a
    new submission runs it again."""

    exit_code = 3


class FleetUnavailable(FleetError):
    """The fleet database did not answer (a restart, its file moved away, a dropped connection) for longer than
    the store waits (``retry_s``)."""

    exit_code = 2


log = logging.getLogger(__name__)
#: the first wait between two tries of a call the database did not answer, and the longest one, seconds
RETRY_FIRST_S, RETRY_MAX_S = 0.25, 4.0
_CALLING = threading.local()  # a retrying call in progress on this thread: the calls it makes do not retry again


#: what SQLite says when its file cannot be reached now (moved away, its disk busy) or another writer holds it
SQLITE_UNAVAILABLE = ("unable to open database file", "database is locked", "disk i/o error")
#: PostgreSQL's SQLSTATE classes and codes of a server that cannot be reached or is going down, and of a
#: transaction the server aborted to be tried again (serialization failure, deadlock)
PG_UNAVAILABLE = ("08", "57P01", "57P02", "57P03", "40001", "40P01")


def transient(exc: BaseException) -> bool:
    """Whether ``exc`` says the database is unavailable now (not that the call is wrong): a connection refused
    or dropped, a server restarting, a file that cannot be opened, a lock held too long. Retrying the whole
    call is safe: each is one transaction, rolled back when it failed. A wrong statement (no such column, a
    syntax error, a value of a type the driver refuses) is not: it fails at once."""
    if isinstance(exc, FleetUnavailable):
        return True
    if isinstance(exc, sa.exc.DBAPIError) and exc.connection_invalidated:
        return True
    if not isinstance(exc, (sa.exc.OperationalError, sa.exc.InterfaceError)):
        return False
    orig = getattr(exc, "orig", None)
    if type(orig).__module__.startswith("sqlite3"):
        return any(m in str(orig).lower() for m in SQLITE_UNAVAILABLE)
    state = str(getattr(orig, "sqlstate", "") or "")
    # a psycopg error without a SQLSTATE is the client's: no connection, a connection that broke
    return not state or state.startswith(PG_UNAVAILABLE)


def retrying(fn: Any) -> Any:
    """``fn`` (a public method of :class:`FleetStore`) tried again, with a growing wait, while the database is
    unavailable (:func:`transient`), for at most the store's ``retry_s`` (0: tried once); then a one-line
    :class:`FleetUnavailable`. Calls made from within a retrying call are not retried on their own."""

    @functools.wraps(fn)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(_CALLING, "active", False):
            return fn(self, *args, **kwargs)
        _CALLING.active = True
        try:
            return self._patiently(fn.__name__, lambda: fn(self, *args, **kwargs))
        finally:
            _CALLING.active = False

    return call


def chunks(items: Sequence[Any], size: int = CHUNK) -> Iterator[list[Any]]:
    """``items`` in consecutive lists of at most ``size``."""
    for start in range(0, len(items), size):
        yield list(items[start:start + size])


def url_for(path_or_url: str | Path) -> str:
    """A SQLAlchemy URL from a URL or a file path (a path means SQLite)."""
    text = str(path_or_url)
    if "://" in text:
        return text
    return f"sqlite:///{Path(text).resolve()}"


def sqlite_immediate(engine: sa.Engine) -> None:
    """pysqlite starts transactions lazily and without a write lock; take it at BEGIN instead."""

    @event.listens_for(engine, "connect")
    def _connect(dbapi_conn: Any, _record: Any) -> None:
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA foreign_keys=ON")
        cur.execute("PRAGMA busy_timeout=30000")
        cur.execute("PRAGMA journal_mode=WAL")
        cur.close()

    @event.listens_for(engine, "begin")
    def _begin(conn: sa.Connection) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE")


#: machines a submitted job may take: checked standbys serving no job, by name
FREE = select(Machine.name).where(Machine.state == states.STANDBY, Machine.job.is_(None)).order_by(Machine.name)



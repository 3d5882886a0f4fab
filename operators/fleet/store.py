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

import functools
import logging
import threading
import time
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy import and_, event, or_, select
from sqlalchemy.orm import Session, sessionmaker

from trainguard.node_tools.errors import EXIT_REFUSED, TrainguardError
from trainguard.operators.fleet import states
from trainguard.operators.fleet.migrations import LATEST, current_version
from trainguard.operators.fleet.migrations import migrate as apply_migrations
from trainguard.operators.fleet.models import (
    Action,
    AgentLiveness,
    Alert,
    BusCursor,
    Checkpoint,
    Component,
    EttrEvent,
    Incident,
    Job,
    Machine,
    MachineEvent,
    QuarantinedAlert,
    Revision,
)
from trainguard.operators.policy import ladder

OPEN_INCIDENT_STATES = states.OPEN_INCIDENT_STATES
INCIDENT_STATES = states.INCIDENT_STATES
#: rows (or ids) per statement when the store writes or looks up many at once: well within every database's
#: limit on a statement's parameters
CHUNK = 1000


class FleetError(TrainguardError):
    """A fleet change that is not allowed (unknown machine, forbidden transition ...)."""

    exit_code = EXIT_REFUSED


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


def _retrying(fn: Any) -> Any:
    """``fn`` (a public method of :class:`FleetStore`) tried again, with a growing wait, while the database is
    unavailable (:func:`transient`), for at most the store's ``retry_s`` (0: tried once); then a one-line
    :class:`FleetUnavailable`. Calls made from within a retrying call are not retried on their own."""

    @functools.wraps(fn)
    def call(self: FleetStore, *args: Any, **kwargs: Any) -> Any:
        if getattr(_CALLING, "active", False):
            return fn(self, *args, **kwargs)
        _CALLING.active = True
        try:
            return self._patiently(fn.__name__, lambda: fn(self, *args, **kwargs))
        finally:
            _CALLING.active = False

    return call


def _chunks(items: Sequence[Any], size: int = CHUNK) -> Iterator[list[Any]]:
    """``items`` in consecutive lists of at most ``size``."""
    for start in range(0, len(items), size):
        yield list(items[start:start + size])


def url_for(path_or_url: str | Path) -> str:
    """A SQLAlchemy URL from a URL or a file path (a path means SQLite)."""
    text = str(path_or_url)
    if "://" in text:
        return text
    return f"sqlite:///{Path(text).resolve()}"


def _sqlite_immediate(engine: sa.Engine) -> None:
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
_FREE = select(Machine.name).where(Machine.state == states.STANDBY, Machine.job.is_(None)).order_by(Machine.name)


class FleetStore:
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
            _sqlite_immediate(self.engine)
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
        return FleetStore._read_names(url, _FREE)

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

    # ---- machines -----------------------------------------------------------------------------
    def register_machine(self, name: str, *, address: str = "", state: str = states.STANDBY,
                         reason: str = "registered") -> bool:
        """Add a machine in ``state``; a machine already known is left as it is (returns False)."""
        if state not in states.STATES:
            raise FleetError(f"unknown machine state {state!r}; use one of {', '.join(states.STATES)}")
        with self.tx() as s:
            if s.get(Machine, name) is not None:
                return False
            now = self.clock()
            s.add(Machine(name=name, address=address, state=state, state_since=now, reason=reason, evictions=0))
            s.add(MachineEvent(machine=name, from_state=None, to_state=state, ts=now, reason=reason))
            return True

    def register_machines(self, machines: Sequence[tuple[str, str, str, str]]) -> list[str]:
        """Add each of ``machines`` (``(name, address, state, reason)``) the database does not know yet, in one
        transaction (a statement per :data:`CHUNK` machines: an inventory of 12,500 machines is not 12,500
        transactions), each with its first event; machines already known (or registered meanwhile by another
        writer) are left as they are. Returns the names added, in order."""
        bad = sorted({state for _n, _a, state, _r in machines} - set(states.STATES))
        if bad:
            raise FleetError(f"unknown machine state {bad[0]!r}; use one of {', '.join(states.STATES)}")
        now = self.clock()
        rows: dict[str, dict[str, Any]] = {}
        for name, address, state, reason in machines:
            rows.setdefault(name, {"name": name, "address": address, "state": state, "state_since": now,
                                   "reason": reason, "evictions": 0})
        added: set[str] = set()
        with self.tx() as s:
            known: set[str] = set()
            for chunk in _chunks(list(rows)):
                known.update(s.scalars(select(Machine.name).where(Machine.name.in_(chunk))))
            fresh = [r for n, r in rows.items() if n not in known]
            insert = self._dialect_insert(s)
            table = Machine.__table__  # type: ignore[attr-defined]
            for chunk in _chunks(fresh):
                if insert is None:
                    s.execute(sa.insert(table), chunk)
                    added.update(r["name"] for r in chunk)
                else:  # the names this statement inserted: not those another writer registered meanwhile
                    stmt = insert(table).on_conflict_do_nothing(index_elements=["name"]).returning(table.c.name)
                    added.update(s.execute(stmt, chunk).scalars().all())
            events = [{"machine": n, "from_state": None, "to_state": rows[n]["state"], "ts": now,
                       "reason": rows[n]["reason"], "incident_id": None, "job": None} for n in rows if n in added]
            for chunk in _chunks(events):
                s.execute(sa.insert(MachineEvent.__table__), chunk)  # type: ignore[attr-defined]
        return [n for n in rows if n in added]

    def machine(self, name: str) -> Machine:
        with self.tx() as s:
            return self._required(s, Machine, name)

    def machines(self, *, state: str | None = None, job: str | None = None) -> list[Machine]:
        with self.tx() as s:
            q = select(Machine).order_by(Machine.name)
            if state is not None:
                q = q.where(Machine.state == state)
            if job is not None:
                q = q.where(Machine.job == job)
            return list(s.scalars(q))

    def jobs_of(self, names: Collection[str]) -> dict[str, str | None]:
        """The job each machine of ``names`` serves (None: it serves none), read in chunks of :data:`CHUNK`
        names; a machine the fleet database does not know is left out."""
        out: dict[str, str | None] = {}
        with self.tx() as s:
            for chunk in _chunks(sorted(set(names))):
                rows = s.execute(select(Machine.name, Machine.job).where(Machine.name.in_(chunk)))
                out.update((name, job) for name, job in rows)
        return out

    def _move(self, s: Session, m: Machine, to_state: str, reason: str, incident_id: int | None, *,
              job: str | None = None, checked: bool = False) -> bool:
        if m.state == to_state:
            return False
        if not states.allowed(m.state, to_state):
            raise FleetError(f"machine {m.name} cannot go from {m.state} to {to_state}; allowed: "
                             f"{', '.join(sorted(states.TRANSITIONS[m.state])) or 'none'}")
        now = self.clock()
        s.add(MachineEvent(machine=m.name, from_state=m.state, to_state=to_state, ts=now, reason=reason,
                           incident_id=incident_id, job=job or m.job))
        m.state, m.state_since, m.reason = to_state, now, reason
        if to_state == states.EVICTED:
            m.evictions += 1
        if to_state in (states.EVICTED, states.STANDBY, states.REPAIR, states.RETIRED, states.SELF_CHECK):
            m.job = None
        if checked and to_state == states.STANDBY:
            m.checked_ts = now
        return True

    def transition(self, name: str, to_state: str, *, reason: str, incident_id: int | None = None,
                   checked: bool = False) -> bool:
        """Move a machine to ``to_state``. Already there: no-op (False). Not allowed: FleetError.
        ``checked``: a standby that has just passed its self-check (its ``checked_ts`` is now)."""
        with self.tx() as s:
            return self._move(s, self._required(s, Machine, name, lock=True), to_state, reason, incident_id,
                              checked=checked)

    def events(self, name: str) -> list[MachineEvent]:
        with self.tx() as s:
            return list(s.scalars(select(MachineEvent).where(MachineEvent.machine == name)
                                  .order_by(MachineEvent.id)))

    def all_events(self, *, since: float = 0.0) -> list[MachineEvent]:
        """Every machine's state changes at ``since`` or later, oldest first, with each machine's last
        change before ``since`` (the state it entered the period in)."""
        with self.tx() as s:
            later = list(s.scalars(select(MachineEvent).where(MachineEvent.ts >= since).order_by(MachineEvent.id)))
            last_before = (select(sa.func.max(MachineEvent.id)).where(MachineEvent.ts < since)
                           .group_by(MachineEvent.machine))
            before = list(s.scalars(select(MachineEvent).where(MachineEvent.id.in_(last_before))))
            return sorted(before + later, key=lambda e: e.id)

    def joined_ts(self, names: Collection[str]) -> dict[str, float]:
        """When each of ``names`` last became active (joined the job it serves), from its audit trail; machines
        never active are left out."""
        out: dict[str, float] = {}
        with self.tx() as s:
            for chunk in _chunks(sorted(set(names))):
                rows = s.execute(select(MachineEvent.machine, sa.func.max(MachineEvent.ts))
                                 .where(MachineEvent.machine.in_(chunk), MachineEvent.to_state == states.ACTIVE)
                                 .group_by(MachineEvent.machine))
                out.update({str(m): float(ts) for m, ts in rows})
        return {m: float(ts) for m, ts in out.items()}

    # ---- jobs --------------------------------------------------------------------------------
    def upsert_job(self, name: str, *, tp: int, pp: int, dp: int, ranks_per_machine: int,
                   machines: Sequence[str], revision: str = "", train_args: Sequence[str] = (),
                   spec: Mapping[str, Any] | None = None) -> bool:
        """Record a job running on ``machines`` (node-rank order); they become active for it. A job
        already recorded keeps its state (returns False). ``spec``: the job's spec
        (:class:`trainguard.operators.jobspec.JobSpec` as JSON), which every launch runs; None records the
        reference job with these arguments."""
        with self.tx() as s:
            if s.get(Job, name) is not None:
                return False
            if spec is None:
                from trainguard.node_tools.topology import Topology
                from trainguard.operators.jobspec import reference_spec

                spec = reference_spec(name, Topology(tp, pp, dp, ranks_per_machine=ranks_per_machine),
                                      train_args=list(train_args), revision=revision).document()
            now = self.clock()
            s.add(Job(name=name, tp=tp, pp=pp, dp=dp, ranks_per_machine=ranks_per_machine,
                      machine_list=list(machines), state="running", revision=revision,
                      train_args=list(train_args), spec=dict(spec), created_ts=now, updated_ts=now))
            s.flush()
            for mname in machines:
                m = s.get(Machine, mname, with_for_update=True)
                if m is None:
                    raise FleetError(f"job {name}: machine {mname} is not in the fleet database", exit_code=2)
                if m.job not in (None, name):
                    raise FleetError(f"job {name}: machine {mname} already serves job {m.job}")
                self._move(s, m, states.ACTIVE, f"serves job {name}", None, job=name)
                m.job = name
            if revision:
                s.add(Revision(job=name, revision=revision, recorded_ts=now, known_good=False,
                               reason="the job's revision at start"))
            return True

    def submit_job(self, name: str, *, spec: Mapping[str, Any], machines: Sequence[str], tp: int, pp: int, dp: int,
                   ranks_per_machine: int, train_args: Sequence[str], revision: str) -> bool:
        """Record a submitted job (state ``launching``) on ``machines`` (node-rank order), which become active for
        it, in one transaction. The same spec submitted again while it launches or runs is a no-op (False); a job
        of that name that was stopped or failed is replaced; one that runs another spec is refused."""
        with self.tx() as s:
            j = s.get(Job, name, with_for_update=True)
            if j is not None and j.state in ("launching", "running"):
                if j.spec == dict(spec):
                    return False
                raise FleetError(f"job {name} is {j.state} with another spec; stop it first "
                                 f"('trainguard job stop {name}') or submit under another name")
            now = self.clock()
            fields = {"tp": tp, "pp": pp, "dp": dp, "ranks_per_machine": ranks_per_machine,
                      "machine_list": list(machines), "state": "launching", "revision": revision,
                      "pending_revision": None, "train_args": list(train_args), "spec": dict(spec), "updated_ts": now}
            if j is None:
                s.add(Job(name=name, created_ts=now, **fields))
            else:  # a stopped or failed job of that name: the new spec replaces it (its history stays)
                for key, value in {**fields, "created_ts": now}.items():
                    setattr(j, key, value)
            s.flush()
            for mname in machines:
                m = s.get(Machine, mname, with_for_update=True)
                if m is None:
                    raise FleetError(f"job {name}: machine {mname} is not in the fleet database; add it to the "
                                     f"inventory and run 'trainguard fleet migrate'", exit_code=2)
                if m.job not in (None, name):
                    raise FleetError(f"job {name}: machine {mname} already serves job {m.job}; name another")
                if m.state not in (states.STANDBY, states.SELF_CHECK, states.ACTIVE):
                    raise FleetError(f"job {name}: machine {mname} is {m.state}; name a checked machine "
                                     f"(a standby)")
                self._move(s, m, states.ACTIVE, f"serves job {name}", None, job=name)
                m.job = name
            if not s.scalars(select(Revision).where(Revision.job == name, Revision.revision == revision)).first():
                s.add(Revision(job=name, revision=revision, recorded_ts=now, known_good=False,
                               reason="the job's revision at submission"))
            return True

    def free_machines(self) -> list[str]:
        """Machines a job may take: checked standbys that serve no job, by name."""
        with self.tx() as s:
            return list(s.scalars(_FREE))

    def release_job(self, name: str, *, state: str = "stopped", reason: str = "") -> list[str]:
        """End a job in the fleet database: its state becomes ``state`` ("stopped" or "failed") and its machines
        return to the pool (standby; one under suspicion is evicted), in one transaction. Returns the machines
        released; a job already released releases nothing."""
        released: list[str] = []
        with self.tx() as s:
            j = self._required(s, Job, name, lock=True)
            for mname in j.machine_list:
                m = s.get(Machine, mname, with_for_update=True)
                if m is None or m.job != name:
                    continue
                why = f"released by job {name}" + (f": {reason}" if reason else "")
                self._move(s, m, states.EVICTED if m.state == states.SUSPECT else states.STANDBY, why, None, job=name)
                m.job = None
                released.append(mname)
            if j.state != state:
                j.state, j.updated_ts = state, self.clock()
        return released

    def jobs(self) -> list[Job]:
        with self.tx() as s:
            return list(s.scalars(select(Job).order_by(Job.name)))

    def job(self, name: str) -> Job:
        with self.tx() as s:
            return self._required(s, Job, name)

    def set_job_state(self, name: str, state: str) -> bool:
        with self.tx() as s:
            j = self._required(s, Job, name, lock=True)
            if j.state == state:
                return False
            j.state, j.updated_ts = state, self.clock()
            return True

    def swap(self, job: str, replacements: dict[str, str], *, reason: str, incident_id: int | None = None,
             ) -> dict[str, str]:
        """Evict each machine of ``replacements`` from ``job`` and put its standby in its place (same
        node rank), all in one transaction. Returns the swaps done; a swap already done is skipped."""
        done: dict[str, str] = {}
        with self.tx() as s:
            j = self._required(s, Job, job, lock=True)
            order = list(j.machine_list)
            at = {n: i for i, n in enumerate(order)}  # node rank by machine: a swap per machine, not a scan
            for old, new in replacements.items():
                if old not in at and new in at:
                    continue  # done before
                if old not in at:
                    raise FleetError(f"machine {old} does not serve job {job} ({', '.join(order)})")
                m_old = s.get(Machine, old, with_for_update=True)
                m_new = s.get(Machine, new, with_for_update=True)
                if m_new is None or m_new.state != states.STANDBY:
                    state = m_new.state if m_new else "unknown"
                    raise FleetError(f"machine {new} cannot replace {old}: it is {state}, not a standby")
                assert m_old is not None
                self._move(s, m_old, states.EVICTED, f"evicted from {job}: {reason}", incident_id, job=job)
                self._move(s, m_new, states.ACTIVE, f"replaces {old} in {job}", incident_id)
                m_new.job = job
                order[at[old]] = new
                at[new] = at.pop(old)
                done[old] = new
            if done:
                j.machine_list, j.updated_ts = order, self.clock()
        return done

    # ---- revisions ----------------------------------------------------------------------------
    def record_revision(self, job: str, revision: str, *, reason: str = "") -> bool:
        with self.tx() as s:
            if s.scalar(select(Revision).where(Revision.job == job, Revision.revision == revision)):
                return False
            s.add(Revision(job=job, revision=revision, recorded_ts=self.clock(), known_good=False, reason=reason))
            return True

    def revisions(self, job: str) -> list[Revision]:
        """The job's recorded revisions, oldest first."""
        with self.tx() as s:
            self._required(s, Job, job)
            return list(s.scalars(select(Revision).where(Revision.job == job).order_by(Revision.id)))

    def mark_known_good(self, job: str, revision: str) -> bool:
        with self.tx() as s:
            r = s.scalar(select(Revision).where(Revision.job == job, Revision.revision == revision))
            if r is None:
                raise FleetError(f"job {job} has no revision {revision} recorded", exit_code=2)
            if r.known_good:
                return False
            r.known_good, r.good_ts = True, self.clock()
            return True

    def last_known_good(self, job: str, *, other_than: str = "") -> str | None:
        with self.tx() as s:
            q = (select(Revision.revision).where(Revision.job == job, Revision.known_good.is_(True),
                                                 Revision.revision != other_than)
                 .order_by(Revision.good_ts.desc(), Revision.id.desc()))
            return s.scalar(q)

    def set_revision(self, job: str, revision: str, *, pending: bool = False) -> bool:
        """Switch the job to ``revision`` now, or (``pending``) at its next restart."""
        with self.tx() as s:
            j = self._required(s, Job, job, lock=True)
            if pending:
                if j.pending_revision == revision:
                    return False
                j.pending_revision = revision
            else:
                if j.revision == revision and j.pending_revision is None:
                    return False
                j.revision, j.pending_revision = revision, None
            j.updated_ts = self.clock()
            return True

    # ---- incidents, alerts, actions -----------------------------------------------------------
    def open_incident(self, job: str, alerts: Iterable[dict[str, Any]], *, category: str = "",
                      escalation_window_s: float = 1800.0) -> tuple[Incident, bool]:
        """Attach ``alerts`` to the job's open incident, or open one. Returns (incident, opened). A new
        incident within ``escalation_window_s`` of the job's last closed one starts a level above it."""
        with self.tx() as s:
            return self._attach(s, job, list(alerts), category=category, escalation_window_s=escalation_window_s)

    def _attach(self, s: Session, job: str, alerts: list[dict[str, Any]], *, category: str = "",
                escalation_window_s: float) -> tuple[Incident, bool]:
        """Attach ``alerts`` to the job's open incident (or open one) within ``s``. An alert whose id is
        recorded already keeps its incident; one that comes twice in ``alerts`` is attached once. The alerts
        are written in bulk: a statement per :data:`CHUNK` alerts, not per alert."""
        # the job's row first: two writers attaching to a job that has no open incident yet (two guardians, a
        # retried event) queue here, so the second sees the incident the first opened (Postgres runs them
        # concurrently at READ COMMITTED; SQLite's BEGIN IMMEDIATE had serialised them already)
        s.execute(select(Job.name).where(Job.name == job).with_for_update())
        inc = s.scalar(select(Incident).where(Incident.job == job, Incident.state.in_(OPEN_INCIDENT_STATES))
                       .order_by(Incident.id.desc()).with_for_update())
        opened = inc is None
        if inc is None:
            first = min((float(a.get("ts", self.clock())) for a in alerts), default=self.clock())
            what, machines = self._what_failed(job, alerts, category)
            inc = Incident(job=job, state=states.IncidentState.OPEN, category=category,
                           level=self._next_level(s, job, escalation_window_s, failed_ts=first, category=what,
                                                  machines=machines),
                           opened_ts=self.clock(), first_alert_ts=first, summary="")
            s.add(inc)
            s.flush()
        rows, batch = [], set()
        for a in alerts:
            alert_id = str(a["id"])
            if alert_id in batch:
                continue
            batch.add(alert_id)
            rows.append({"id": alert_id, "ts": float(a.get("ts", 0.0)), "job": a.get("job") or "",
                         "machine": a.get("machine") or "", "rank": a.get("rank"), "kind": a["kind"],
                         "severity": a.get("severity") or "", "incident_id": inc.id, "document": a})
        self._insert_new(s, Alert, rows, keys=("id",))
        return inc, opened

    @staticmethod
    def _recorded_alerts(s: Session, ids: Sequence[str]) -> set[str]:
        """Which of ``ids`` are recorded already (within ``s``), read in chunks of :data:`CHUNK` ids."""
        found: set[str] = set()
        for chunk in _chunks(sorted(set(ids))):
            found.update(s.scalars(select(Alert.id).where(Alert.id.in_(chunk))))
        return found

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
            for chunk in _chunks(rows):
                wanted = sa.tuple_(*cols).in_([tuple(r[k] for k in keys) for r in chunk])
                held.update(tuple(r) for r in s.execute(select(*cols).where(wanted)))
            rows = [r for r in rows if tuple(r[k] for k in keys) not in held]
            for chunk in _chunks(rows):
                s.execute(sa.insert(table), chunk)
            return len(rows)
        stmt = insert(table).on_conflict_do_nothing(index_elements=list(keys))
        inserted = 0
        for chunk in _chunks(rows):
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
        for chunk in _chunks(rows):
            s.execute(stmt, chunk)

    def ingest(self, by_job: dict[str, list[dict[str, Any]]], *, escalation_window_s: float, reader: str = "",
               read: dict[str, float] | None = None, gone: Sequence[str] = (),
               quarantined: Sequence[dict[str, Any]] = (), liveness: dict[str, dict[str, Any]] | None = None,
               unattached: Sequence[dict[str, Any]] = ()) -> list[tuple[Incident, bool]]:
        """One batch of the bus in one transaction: each job's alerts attached to its open incident (or one
        opened; ``unattached``: alerts recorded without an incident), the ``reader``'s cursor advanced (the
        names ``read`` with the reader's time; ``gone``: names that left the bus), ``quarantined`` documents
        recorded, the agents' ``liveness`` as the reader last saw
        it. Returns (incident, opened) per job, in job order. Either all of it is recorded or none. Recording
        the same batch again changes nothing. Every part is written in bulk (a statement per :data:`CHUNK`
        rows), so a burst of 100,000 alerts and names costs about a hundred statements per part."""
        with self.tx() as s:
            out = [self._attach(s, job, list(alerts), escalation_window_s=escalation_window_s)
                   for job, alerts in sorted(by_job.items())]
            # alerts recorded for the record only (a slowdown the whole job shares): no incident
            self._insert_new(s, Alert, [{"id": str(a["id"]), "ts": float(a.get("ts", 0.0)), "job": a.get("job") or "",
                                         "machine": a.get("machine") or "", "rank": a.get("rank"), "kind": a["kind"],
                                         "severity": a.get("severity") or "", "incident_id": None, "document": a}
                                        for a in {str(a["id"]): a for a in unattached}.values()], keys=("id",))
            self._upsert(s, BusCursor, [{"reader": reader, "name": name, "seen_ts": float(ts)}
                                        for name, ts in (read or {}).items()], keys=("reader", "name"))
            for chunk in _chunks(sorted(set(gone))):
                s.execute(sa.delete(BusCursor).where(BusCursor.reader == reader, BusCursor.name.in_(chunk)))
            rows = [{"reader": reader, "name": str(q.get("name", ""))[:256], "machine": str(q.get("machine", ""))[:128],
                     "kind": str(q.get("kind", ""))[:64], "reason": str(q.get("reason", ""))[:2000],
                     "ts": float(q.get("ts") or self.clock()), "document": dict(q.get("document") or {})}
                    for q in quarantined]
            for chunk in _chunks(rows):
                s.execute(sa.insert(QuarantinedAlert.__table__), chunk)
            if liveness:
                self._record_liveness(s, liveness)
            return out

    def record_liveness(self, liveness: Mapping[str, Mapping[str, Any]]) -> None:
        """The agents' ``liveness`` as a reader sees it now (the machines whose record changed are written)."""
        with self.tx() as s:
            self._record_liveness(s, {m: dict(v) for m, v in liveness.items()})

    def _record_liveness(self, s: Session, liveness: dict[str, dict[str, Any]]) -> None:
        """The agents' ``liveness`` as the reader last saw it, within ``s``: only the machines whose record
        changed are written (the reader sends every watched machine's each time; most have not changed)."""
        held = {r.machine: (r.token, r.changed_ts, r.reported_ts) for r in s.execute(select(
            AgentLiveness.machine, AgentLiveness.token, AgentLiveness.changed_ts, AgentLiveness.reported_ts))}
        rows = []
        for machine, st in liveness.items():
            row = {"machine": machine, "token": str(st.get("token", ""))[:256], "changed_ts": float(st["changed_ts"]),
                   "reported_ts": st.get("reported_ts")}
            if held.get(machine) != (row["token"], row["changed_ts"], row["reported_ts"]):
                rows.append(row)
        self._upsert(s, AgentLiveness, rows, keys=("machine",))

    def cursor(self, reader: str) -> dict[str, float]:
        """The ``reader``'s cursor: name -> when it first read it."""
        with self.tx() as s:
            return {c.name: c.seen_ts for c in s.scalars(select(BusCursor).where(BusCursor.reader == reader))}

    def advance_cursor(self, reader: str, read: dict[str, float], gone: Sequence[str] = ()) -> None:
        """The ``reader``'s cursor alone (a reader that records nothing else in the fleet database)."""
        self.ingest({}, escalation_window_s=0.0, reader=reader, read=read, gone=gone)

    def quarantined(self, *, since: float = 0.0) -> list[QuarantinedAlert]:
        with self.tx() as s:
            return list(s.scalars(select(QuarantinedAlert).where(QuarantinedAlert.ts >= since)
                                  .order_by(QuarantinedAlert.id)))

    def liveness(self) -> dict[str, AgentLiveness]:
        with self.tx() as s:
            return {a.machine: a for a in s.scalars(select(AgentLiveness))}

    def beat(self, component: str, detail: dict[str, Any] | None = None) -> None:
        """``component`` (the guardian ...) is alive now."""
        with self.tx() as s:
            s.merge(Component(name=component, seen_ts=self.clock(), detail=dict(detail or {})))

    def components(self) -> dict[str, Component]:
        with self.tx() as s:
            return {c.name: c for c in s.scalars(select(Component))}

    @staticmethod
    def _what_failed(job: str, alerts: Sequence[dict[str, Any]], category: str = "") -> tuple[str, tuple[str, ...]]:
        """A failure's category and implicated machines for the escalation rule: ``category`` when the caller
        names one (a manual incident), else what :func:`ladder.triage` makes of ``alerts`` (all of them: they
        were routed to this job already). The triage task judges the incident again with all its evidence and
        re-levels it (:meth:`relevel`)."""
        if category:
            return category, ()
        t = ladder.triage(job, alerts)
        return t.category.value, t.machines

    def split_off(self, incident_id: int, alert_ids: Collection[str], *, level: int) -> Incident | None:
        """Move ``alert_ids`` of the incident to a new open incident of its job at ``level``, in one
        transaction (its category left for its triage); None when none of them is the incident's any more (a
        retry after the move). What a recovery that held but saw its failure come back hands on: the failure
        after the restart is a new failure, a level up, not part of the incident that restarted the job."""
        with self.tx() as s:
            old = s.get(Incident, incident_id, with_for_update=True)
            if old is None:
                raise FleetError(f"no incident {incident_id}")
            ids = sorted(set(map(str, alert_ids)))
            mine = list(s.scalars(select(Alert).where(Alert.incident_id == incident_id, Alert.id.in_(ids))))
            if not mine:
                return None
            inc = Incident(job=old.job, state=states.IncidentState.OPEN, category="", level=level,
                           opened_ts=self.clock(), first_alert_ts=min(a.ts for a in mine), summary="")
            s.add(inc)
            s.flush()
            s.execute(sa.update(Alert).where(Alert.id.in_([a.id for a in mine])).values(incident_id=inc.id))
            new_id = inc.id
        return self.incident(new_id)

    def _next_level(self, s: Session, job: str, window_s: float, *, failed_ts: float, category: str,
                    machines: Sequence[str], before: int | None = None) -> int:
        """The level of a failure of ``job`` (its first alert at ``failed_ts``, triaged as ``category`` on
        ``machines``) by :func:`ladder.escalation_level`: one above the job's last recovery when it comes within
        ``window_s`` of that recovery's end and repeats it, else 0. The failure's own time counts, not when the
        control plane got to it. Incidents closed without a recovery (a tolerated network blip, a passing
        slowdown) are not recoveries and do not count. The last incident's category and machines are what its
        triage recorded; one closed before its triage ran is judged by :func:`ladder.triage` of its alerts.
        ``before``: only incidents older than this one (re-levelling an open incident)."""
        q = select(Incident).where(
            Incident.job == job,
            or_(Incident.state == states.IncidentState.FAILED,
                and_(Incident.state == states.IncidentState.RESOLVED, Incident.resumed_ts.is_not(None))))
        if before is not None:
            q = q.where(Incident.id < before)
        last = s.scalar(q.order_by(Incident.id.desc()))
        if last is None:
            return 0
        last_category, last_machines = last.category, tuple(last.machines or ())
        if not last_category:
            alerts = s.scalars(select(Alert.document).where(Alert.incident_id == last.id).order_by(Alert.ts))
            last_category, last_machines = self._what_failed(job, list(alerts))
        return ladder.escalation_level(last_level=last.level, last_recovery_end_ts=last.resumed_ts or last.closed_ts,
                                       failed_ts=failed_ts, window_s=window_s, last_category=last_category,
                                       last_machines=last_machines, category=category, machines=machines)

    def relevel(self, incident_id: int, *, category: str, machines: Sequence[str], window_s: float) -> int:
        """Record the triage's ``category`` and ``machines`` on the open incident and its level from them
        (:meth:`_next_level`): the level set when it opened came from its first alerts alone. Returns the
        level."""
        with self.tx() as s:
            inc = self._required(s, Incident, incident_id, lock=True)
            inc.level = self._next_level(s, inc.job, window_s, failed_ts=inc.first_alert_ts, category=category,
                                         machines=machines, before=inc.id)
            inc.category, inc.machines = category, sorted(machines)
            return inc.level

    def known_alerts(self, ids: Sequence[str]) -> set[str]:
        """Which of ``ids`` are recorded already (read in chunks of :data:`CHUNK` ids)."""
        if not ids:
            return set()
        with self.tx() as s:
            return self._recorded_alerts(s, ids)

    def alerts_on(self, machines: Collection[str], *, kinds: Collection[str], since: float = 0.0) -> list[Alert]:
        """The alerts of ``kinds`` about ``machines`` recorded at ``since`` or later, oldest first."""
        out: list[Alert] = []
        with self.tx() as s:
            for chunk in _chunks(sorted(set(machines))):
                out += s.scalars(select(Alert).where(Alert.machine.in_(chunk), Alert.kind.in_(sorted(kinds)),
                                                     Alert.ts >= since))
        return sorted(out, key=lambda a: a.ts)

    def in_flight(self, key_prefix: str) -> list[Action]:
        """Actions whose key starts with ``key_prefix`` that started and have not finished (a launch under way)."""
        with self.tx() as s:
            return list(s.scalars(select(Action).where(Action.key.startswith(key_prefix, autoescape=True),
                                                       Action.finished_ts.is_(None))))

    def incident(self, incident_id: int) -> Incident:
        with self.tx() as s:
            return self._required(s, Incident, incident_id)

    def incidents(self, job: str | None = None) -> list[Incident]:
        with self.tx() as s:
            q = select(Incident).order_by(Incident.id)
            if job is not None:
                q = q.where(Incident.job == job)
            return list(s.scalars(q))

    def alerts_of(self, incident_id: int, *, kinds: Collection[str] | None = None, limit: int | None = None
                  ) -> list[Alert]:
        """The incident's alerts, oldest first; only those of ``kinds`` and the first ``limit`` when given (an
        incident of an alert storm holds one alert per rank: a question about a few kinds need not load them
        all)."""
        q = select(Alert).where(Alert.incident_id == incident_id)
        if kinds is not None:
            q = q.where(Alert.kind.in_(sorted(kinds)))
        q = q.order_by(Alert.ts, Alert.id)
        if limit is not None:
            q = q.limit(limit)
        with self.tx() as s:
            return list(s.scalars(q))

    def update_incident(self, incident_id: int, **fields: Any) -> None:
        allowed = {"state", "category", "level", "diagnosis_start_ts", "decided_ts", "resumed_ts", "closed_ts",
                   "summary", "lost_steps"}
        unknown = set(fields) - allowed
        if unknown:
            raise FleetError(f"incident fields {sorted(unknown)} cannot be set")
        if "state" in fields and fields["state"] not in INCIDENT_STATES:
            raise FleetError(f"incident state {fields['state']!r} is not one of {', '.join(INCIDENT_STATES)}")
        with self.tx() as s:
            inc = self._required(s, Incident, incident_id, lock=True)
            for key, value in fields.items():
                if key.endswith("_ts") and getattr(inc, key) is not None:
                    continue  # the first time a milestone is reached counts
                setattr(inc, key, value)

    def record_action(self, key: str, *, kind: str, incident_id: int | None = None,
                      machines: Sequence[str] = (), evidence: dict[str, Any] | None = None,
                      dry_run: bool = False) -> tuple[Action, bool]:
        """Record a decision under an idempotency ``key``; the same key again returns the first record
        (created False)."""
        with self.tx() as s:
            row = {"key": key, "kind": kind, "incident_id": incident_id, "machines": list(machines),
                   "evidence": evidence or {}, "outcome": "dry_run" if dry_run else "pending", "detail": "",
                   "dry_run": dry_run, "started_ts": self.clock()}
            # one statement that inserts or leaves the first record: two handlers claiming the same key at once
            # (a duplicate task, a takeover) get one record, and the second its "created False"
            created = self._insert_new(s, Action, [row], keys=("key",))
            a = s.scalar(select(Action).where(Action.key == key))
            return a, bool(created)

    def claim_watched(self, incident_id: int, key: str, *, watched: Collection[str], kind: str,
                      machines: Sequence[str] = (), evidence: dict[str, Any] | None = None, detail: str = "") -> bool:
        """A watched incident's verdict (a fail-slow vote's), recorded as a done action in the same
        transaction that checks the incident is still of a ``watched`` category: after it, stronger
        alerts can no longer take the incident over (:meth:`take_over`); when they did first, nothing is
        recorded and the answer is False. Claiming twice is a no-op (True)."""
        with self.tx() as s:
            inc = self._required(s, Incident, incident_id, lock=True)
            if s.scalar(select(Action).where(Action.key == key)) is not None:
                return True
            if inc.category not in watched:
                return False
            now = self.clock()
            s.add(Action(key=key, kind=kind, incident_id=incident_id, machines=list(machines), evidence=evidence or {},
                         outcome="done", detail=detail, dry_run=False, started_ts=now, finished_ts=now))
            return True

    def take_over(self, incident_id: int, *, watched: Collection[str], category: str, summary: str) -> bool:
        """Give an open incident of a ``watched`` category on which nothing was acted yet (no action, no
        claimed verdict) the stronger ``category``, in one transaction; False when it is too late."""
        with self.tx() as s:
            inc = self._required(s, Incident, incident_id, lock=True)
            if inc.state != states.IncidentState.OPEN or inc.category not in watched:
                return False
            if s.scalar(select(Action.id).where(Action.incident_id == incident_id).limit(1)) is not None:
                return False
            inc.category, inc.summary = category, summary
            return True

    def finish_action(self, action_id: int, outcome: str, detail: str = "",
                      evidence: dict[str, Any] | None = None) -> bool:
        """Record how an action ended; ``evidence``: what it learnt on the way, added to its evidence."""
        with self.tx() as s:
            a = self._required(s, Action, action_id, lock=True)
            if a.finished_ts is not None:
                return False
            a.outcome, a.detail, a.finished_ts = outcome, detail, self.clock()
            if evidence:
                a.evidence = {**(a.evidence or {}), **evidence}
            return True

    def actions(self, incident_id: int | None = None) -> list[Action]:
        with self.tx() as s:
            q = select(Action).order_by(Action.id)
            if incident_id is not None:
                q = q.where(Action.incident_id == incident_id)
            return list(s.scalars(q))

    def evicted_recently(self, job: str, window_s: float) -> set[str]:
        """Machines evicted from ``job`` (for real, not dry runs) within the last ``window_s`` seconds."""
        since = self.clock() - window_s
        with self.tx() as s:
            q = (select(MachineEvent.machine).where(MachineEvent.to_state == states.EVICTED,
                                                    MachineEvent.ts >= since, MachineEvent.job == job))
            return set(s.scalars(q))

    # ---- checkpoints, ETTR ---------------------------------------------------------------------
    def record_checkpoint(self, job: str, step: int, *, committed_ts: float | None = None) -> bool:
        row = {"job": job, "step": step, "problems": [], "verified": None, "verified_ts": None,
               "committed_ts": committed_ts or self.clock()}
        with self.tx() as s:  # one statement: two recorders of the same step at once make one row
            return self._insert_new(s, Checkpoint, [row], keys=("job", "step")) == 1

    def mark_checkpoint(self, job: str, step: int, *, verified: bool, problems: Sequence[str] = ()) -> None:
        with self.tx() as s:
            c = s.scalar(select(Checkpoint).where(Checkpoint.job == job, Checkpoint.step == step)
                         .with_for_update())
            if c is None:
                raise FleetError(f"job {job} has no checkpoint step {step} recorded", exit_code=2)
            c.verified, c.verified_ts, c.problems = verified, self.clock(), list(problems)

    def checkpoints(self, job: str) -> list[Checkpoint]:
        with self.tx() as s:
            return list(s.scalars(select(Checkpoint).where(Checkpoint.job == job).order_by(Checkpoint.step)))

    def add_ettr(self, job: str, kind: str, start_ts: float, end_ts: float, *, incident_id: int | None = None,
                 detail: str = "") -> None:
        """Record a stretch of the job's time; the same stretch again (job, kind, start and incident: an
        incident closed a second time) is a no-op."""
        if end_ts < start_ts:
            raise FleetError(f"ETTR event {kind} of job {job} ends before it starts ({start_ts} > {end_ts})")
        with self.tx() as s:
            same = s.scalar(select(EttrEvent.id).where(
                EttrEvent.job == job, EttrEvent.kind == kind, EttrEvent.start_ts == start_ts,
                EttrEvent.incident_id.is_(None) if incident_id is None else EttrEvent.incident_id == incident_id))
            if same is not None:
                return
            s.add(EttrEvent(job=job, kind=kind, start_ts=start_ts, end_ts=end_ts, incident_id=incident_id,
                            detail=detail))

    def ettr_events(self, job: str) -> list[EttrEvent]:
        with self.tx() as s:
            return list(s.scalars(select(EttrEvent).where(EttrEvent.job == job).order_by(EttrEvent.start_ts)))


# every public call of the store is one transaction: tried again while the database is unavailable
for _name, _fn in list(vars(FleetStore).items()):
    if not _name.startswith("_") and callable(_fn) and not isinstance(_fn, (staticmethod, classmethod)) \
            and _name not in ("close", "tx"):
        setattr(FleetStore, _name, _retrying(_fn))

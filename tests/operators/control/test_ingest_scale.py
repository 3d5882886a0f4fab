"""The guardian's ingest of an alert burst (every rank of a large job alerting at once, an NCCL hang): one incident
per job, every alert attached once, the batch's writes one transaction of a bounded number of statements whatever
its size, untrusted alerts still quarantined, and a repeat a no-op. On SQLite, and on a private PostgreSQL
server (:mod:`tests.pg`) where its binaries and driver are installed."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from trainguard.node_tools.alerts import Alert
from trainguard.node_tools.inventory import Inventory, Machine
from trainguard.operators.control import ControlConfig, Controller
from trainguard.operators.control.incidents import LISTED_MACHINES
from trainguard.operators.fleet import FleetStore
from trainguard.operators.fleet.store import CHUNK

RANKS_PER_MACHINE = 8
BIG = 250  # machines of the large job: 2,000 ranks, two chunks of alerts


def _postgres_missing() -> str:
    """Why the Postgres variant cannot run here ("" when it can)."""
    try:
        import psycopg  # noqa: F401

        from tests import pg
    except ImportError as exc:
        return f"no PostgreSQL driver or test server helper ({exc})"
    from trainguard.core.errors import ClusterError

    try:
        pg.ensure_pg_binaries()
    except ClusterError as exc:
        return str(exc)
    return ""


@pytest.fixture(scope="module")
def pg_url() -> Iterator[str]:
    """A private PostgreSQL server for this module (:mod:`tests.pg`)."""
    from tests import pg

    yield from pg.private_server()


@pytest.fixture(params=["sqlite", "postgres"])
def fleet_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A fresh fleet database: a SQLite file, or a schema of its own on the Postgres server (dropped after)."""
    if request.param == "sqlite":
        yield str(tmp_path / "fleet.db")
        return
    if why := _postgres_missing():
        pytest.skip(why)
    server = request.getfixturevalue("pg_url")
    schema = f"tg_test_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(server)
    with admin.begin() as conn:
        conn.execute(sa.text(f"CREATE SCHEMA {schema}"))
    try:
        yield sa.make_url(server).update_query_dict({"options": f"-csearch_path={schema}"}).render_as_string(
            hide_password=False)
    finally:
        with admin.begin() as conn:
            conn.execute(sa.text(f"DROP SCHEMA {schema} CASCADE"))
        admin.dispose()


def _controller(tmp_path: Path, url: str, jobs: dict[str, int], spares: int = 2) -> Controller:
    """A controller over jobs of ``jobs[name]`` machines each (8 ranks a machine) and ``spares`` standbys."""
    machines = [Machine(name=f"{job}-{i:04d}", address="127.0.0.1") for job, n in jobs.items() for i in range(n)]
    machines += [Machine(name=f"spare-{i}", address="127.0.0.1", role="standby") for i in range(spares)]
    inv = Inventory(cluster="t", transport="local", bus_url=f"spool://{tmp_path / 'bus'}", machines=machines)
    inv.save(tmp_path / "inventory.json")
    c = Controller(ControlConfig(fleet_url=url, inventory=str(inv.path)), inventory=inv)
    c.sync_inventory()
    for job, n in jobs.items():
        c.fleet.upsert_job(job, tp=RANKS_PER_MACHINE, pp=1, dp=n, ranks_per_machine=RANKS_PER_MACHINE,
                           machines=[f"{job}-{i:04d}" for i in range(n)])
    return c


def _alert(kind: str, machine: str, *, job: str = "", rank: int | None = None, **evidence: Any) -> dict[str, Any]:
    """An alert document as the guardian's trigger reads it off the bus."""
    a = Alert(kind, machine, job=job, rank=rank, evidence=evidence)
    a.received_ts = a.ts + 0.01
    a.bus_name = f"{time.time_ns():020d}-{machine}-{a.id}.json"
    return a.record()


def _hang(job: str, machines: int) -> list[dict[str, Any]]:
    """A rank_hang from every rank of ``job``."""
    return [_alert("rank_hang", f"{job}-{r // RANKS_PER_MACHINE:04d}", job=job, rank=r, step=77)
            for r in range(machines * RANKS_PER_MACHINE)]


def _event(alerts: list[dict[str, Any]], machines: list[str] | None = None) -> dict[str, Any]:
    """The trigger's event of ``alerts`` (and what it saw of the agents of ``machines``)."""
    now = time.time()
    return {"alerts": alerts, "first_seen_ts": now, "reader": "guardian",
            "read": {a["bus_name"]: a["received_ts"] for a in alerts}, "gone": [], "quarantined": [],
            "liveness": {m: {"token": "t1", "changed_ts": now, "reported_ts": None} for m in machines or []}}


class _Statements:
    """The statements the fleet database runs, and the transactions that wrote (while counting)."""

    def __init__(self, engine: sa.Engine) -> None:
        self.statements = 0
        self.writing: list[int] = []  # per transaction: how many statements wrote
        sa.event.listen(engine, "begin", self._begin)
        sa.event.listen(engine, "before_cursor_execute", self._execute)
        self.engine = engine

    def _begin(self, _conn: Any) -> None:
        self.writing.append(0)

    def _execute(self, _conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        self.statements += 1
        if statement.lstrip().split(" ", 1)[0].upper() in ("INSERT", "UPDATE", "DELETE"):
            self.writing[-1] += 1

    def close(self) -> None:
        sa.event.remove(self.engine, "begin", self._begin)
        sa.event.remove(self.engine, "before_cursor_execute", self._execute)


def group_alerts(c: Controller, event: dict[str, Any]) -> list[dict[str, Any]]:
    """What the recording of a batch does in the fleet database (the ingest of tg_incident's triage task,
    :func:`trainguard.operators.tasks.guardian.record`): the incidents it opened or took over."""
    items = c.incidents.ingest(event["alerts"], reader=event.get("reader") or "guardian", read=event.get("read"),
                               gone=event.get("gone") or (), quarantined=event.get("quarantined") or (),
                               liveness=event.get("liveness"))
    return [i for i in items if i["opened"] or i["taken_over"]]


def _recorded(c: Controller) -> dict[str, int | None]:
    """Every recorded alert -> its incident."""
    return {a.id: a.incident_id for i in c.fleet.incidents() for a in c.fleet.alerts_of(i.id)}


def test_a_burst_from_every_rank_is_one_incident_each_alert_once_in_one_transaction(tmp_path: Path, fleet_url):
    c = _controller(tmp_path, fleet_url, {"big": BIG})
    burst = _hang("big", BIG)
    event = _event([*burst, *burst[:50]], [f"big-{i:04d}" for i in range(BIG)])  # 50 delivered twice
    seen = _Statements(c.fleet.engine)
    try:
        [start] = group_alerts(c, event)
    finally:
        seen.close()
    [inc] = c.fleet.incidents("big")
    assert start["incident"] == inc.id and start["opened"]
    ids = [a.id for a in c.fleet.alerts_of(inc.id)]
    assert sorted(ids) == sorted(a["id"] for a in burst)  # 2,000 alerts, each once
    assert [w for w in seen.writing if w] == [seen.writing[-1]]  # every write in one transaction
    # a statement per chunk of alerts, names, heartbeats: not per alert (2,050 alerts here)
    assert seen.statements <= 3 * len(burst) // CHUNK + 20
    assert c.fleet.cursor("guardian") == pytest.approx(event["read"])
    assert len(c.fleet.liveness()) == BIG and c.fleet.quarantined() == []
    before = _recorded(c)
    assert group_alerts(c, event) == []  # delivered again: nothing new, no run to start
    assert _recorded(c) == before and [i.id for i in c.fleet.incidents("big")] == [inc.id]
    assert c.fleet.cursor("guardian") == pytest.approx(event["read"])


def test_a_burst_in_ten_batches_joins_the_one_incident_it_opened(tmp_path: Path, fleet_url):
    c = _controller(tmp_path, fleet_url, {"big": BIG})
    burst = _hang("big", BIG)
    events = [_event(burst[i::10]) for i in range(10)]
    opened = [group_alerts(c, e) for e in events]
    assert len(opened[0]) == 1 and not any(opened[1:])  # one run: the incident the first batch opened
    [inc] = c.fleet.incidents("big")
    assert set(_recorded(c).values()) == {inc.id} and sorted(_recorded(c)) == sorted(a["id"] for a in burst)
    before = _recorded(c)
    assert group_alerts(c, events[3]) == [] and _recorded(c) == before
    assert set(c.fleet.cursor("guardian")) == {a["bus_name"] for a in burst}


def test_a_batch_of_two_jobs_opens_two_incidents_and_a_machine_alert_goes_to_the_job_its_machine_serves(
        tmp_path: Path, fleet_url):
    c = _controller(tmp_path, fleet_url, {"a": 3, "b": 4})
    xid = _alert("kernel_xid", "b-0002", xid=79)  # names no job: its machine serves b
    batch = [*_hang("a", 3), *_hang("b", 4), xid]
    items = c.ingest(batch, read={x["bus_name"]: x["received_ts"] for x in batch})
    assert [(i["job"], i["opened"], i["alerts"]) for i in items] == [("a", True, 24), ("b", True, 33)]
    [inc_a], [inc_b] = c.fleet.incidents("a"), c.fleet.incidents("b")
    assert {x.machine for x in c.fleet.alerts_of(inc_a.id)} == {f"a-{i:04d}" for i in range(3)}
    assert xid["id"] in {x.id for x in c.fleet.alerts_of(inc_b.id)}
    assert c.ingest(batch) == [] and len(_recorded(c)) == len(batch)


def test_untrusted_alerts_in_a_burst_are_quarantined_with_a_short_reason_and_the_rest_recorded(
        tmp_path: Path, fleet_url):
    c = _controller(tmp_path, fleet_url, {"big": BIG})
    burst = _hang("big", BIG)
    forged = [_alert("rank_hang", "nosuch", job="big", rank=1),
              _alert("rank_hang", "spare-0", job="big", rank=2),
              _alert("rank_hang", "big-0001", job="big", rank=BIG * RANKS_PER_MACHINE),
              _alert("rank_hang", "big-0001", job="nojob", rank=3)]
    [item] = c.ingest([*burst[:1000], *forged, *burst[1000:]])
    assert item["alerts"] == len(burst) and len(_recorded(c)) == len(burst)
    reasons = {q.document["id"]: q.reason for q in c.fleet.quarantined()}
    assert sorted(reasons) == sorted(f["id"] for f in forged)
    assert reasons[forged[0]["id"]] == "machine 'nosuch' is not in the inventory"
    assert reasons[forged[2]["id"]] == f"rank {BIG * RANKS_PER_MACHINE} is outside job big's 2000 ranks"
    assert reasons[forged[3]["id"]] == "job 'nojob' is not in the fleet database"
    listed = ", ".join(f"big-{i:04d}" for i in range(LISTED_MACHINES))
    assert reasons[forged[1]["id"]] == f"machine spare-0 does not serve job big ({listed}, ... {BIG} in all)"


def test_the_cursor_and_the_liveness_are_inserted_or_updated_in_bulk(tmp_path: Path, fleet_url):
    store = FleetStore(fleet_url, migrate=True)
    first = {f"n{i:05d}": 100.0 + i for i in range(2500)}
    store.advance_cursor("guardian", first)
    again = {f"n{i:05d}": 5000.0 + i for i in range(2000, 3200)}  # 500 read before (a retry), 700 new
    gone = [f"n{i:05d}" for i in range(1500)] + ["never-read"]
    store.advance_cursor("guardian", again, gone)
    store.advance_cursor("other", {"n00000": 1.0})
    assert store.cursor("guardian") == {**{n: t for n, t in first.items() if n not in gone}, **again}
    assert store.cursor("other") == {"n00000": 1.0}
    live = {f"m{i}": {"token": "a", "changed_ts": 1.0, "reported_ts": None} for i in range(1200)}
    store.ingest({}, escalation_window_s=0.0, liveness=live)
    m7 = {"token": "b", "changed_ts": 2.0, "reported_ts": 3.0}
    store.ingest({}, escalation_window_s=0.0, liveness={"m7": m7})
    seen = _Statements(store.engine)
    try:  # every watched agent again, none changed: nothing written
        store.ingest({}, escalation_window_s=0.0, liveness={**live, "m7": m7})
    finally:
        seen.close()
    assert sum(seen.writing) == 0
    now = store.liveness()
    assert len(now) == 1200 and (now["m7"].token, now["m7"].changed_ts, now["m7"].reported_ts) == ("b", 2.0, 3.0)
    assert (now["m8"].token, now["m8"].reported_ts) == ("a", None)
    store.close()


def test_a_database_without_on_conflict_records_the_same(tmp_path: Path, monkeypatch):
    """Other databases than SQLite and Postgres: the keys looked up in chunks, the cursor merged row by row."""
    monkeypatch.setattr(FleetStore, "_dialect_insert", staticmethod(lambda _s: None))
    c = _controller(tmp_path, str(tmp_path / "fleet.db"), {"big": 150})
    burst = _hang("big", 150)
    event = _event([*burst, *burst[:10]], ["big-0000"])
    [_] = group_alerts(c, event)
    [inc] = c.fleet.incidents("big")
    assert sorted(_recorded(c)) == sorted(a["id"] for a in burst) and set(_recorded(c).values()) == {inc.id}
    # an alert recorded before keeps its incident; the new one is added
    c.fleet.open_incident("big", [burst[0], _alert("rank_hang", "big-0001", job="big", rank=9)])
    assert len(_recorded(c)) == len(burst) + 1 and set(_recorded(c).values()) == {inc.id}
    assert group_alerts(c, event) == [] and c.fleet.cursor("guardian") == pytest.approx(event["read"])
    assert list(c.fleet.liveness()) == ["big-0000"]

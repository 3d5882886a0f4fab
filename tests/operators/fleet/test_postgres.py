"""The fleet database on PostgreSQL (the scale-out profile's): the migrations, and eight writers at once (the
guardian's ingest, incident handlers claiming actions, the standby pool, checkpoint verification), each with
its own engine as each Airflow worker has: no lost update, no second incident or action, no deadlock.

SQLite serialises writers (``BEGIN IMMEDIATE``); PostgreSQL runs them concurrently at READ COMMITTED, so
every check-then-insert of the store must hold up there."""

from __future__ import annotations

import threading
import time

import pytest

from tests import pg
from trainguard.operators.fleet import states
from trainguard.operators.fleet.migrations import LATEST, MIGRATIONS
from trainguard.operators.fleet.store import FleetStore

JOB = "j"
MACHINES = [f"m{i}" for i in range(8)]
STANDBYS = [f"s{i}" for i in range(6)]


@pytest.fixture(scope="module")
def pg_url():
    yield from pg.private_server()


@pytest.fixture
def fleet(pg_url):
    import sqlalchemy as sa

    engine = sa.create_engine(pg_url)
    with engine.begin() as conn:  # a fresh schema for each test
        conn.exec_driver_sql("DROP SCHEMA public CASCADE; CREATE SCHEMA public")
    engine.dispose()
    store = FleetStore(pg_url, migrate=True)
    for name in MACHINES + STANDBYS:
        store.register_machine(name, address="10.0.0.1")
    store.upsert_job(JOB, tp=1, pp=2, dp=4, ranks_per_machine=1, machines=MACHINES)
    yield store
    store.close()


def test_the_migrations_run_on_postgres_once(pg_url, fleet):
    assert fleet.migrations_applied == [v for v, _d, _s in MIGRATIONS]
    again = FleetStore(pg_url, migrate=True)
    assert again.migrations_applied == []  # already at LATEST: nothing applied twice
    plain = FleetStore(pg_url)  # every task opens it without migrating: the schema check passes
    assert plain.job(JOB).machine_list == MACHINES and max(v for v, _d, _s in MIGRATIONS) == LATEST
    again.close()
    plain.close()


def _alert(i: int, writer: int) -> dict:
    return {"id": f"a-{writer}-{i}", "ts": time.time(), "job": JOB, "machine": MACHINES[i % len(MACHINES)],
            "rank": i % 8, "kind": "rank_hang", "severity": "fault"}


def test_eight_writers_at_once_lose_nothing_and_double_nothing(pg_url, fleet):
    rounds = 30
    errors: list[str] = []
    start = threading.Barrier(8)

    def guardian(writer: int) -> None:  # four readers of the bus ingesting the same storm (a takeover, a retry)
        store = FleetStore(pg_url)
        try:
            start.wait()
            for i in range(rounds):
                batch = [_alert(i * 3 + k, writer) for k in range(3)]
                # a retried event: the same alerts of writer 0 come through every guardian
                batch.append(_alert(i, 0))
                store.ingest({JOB: batch}, escalation_window_s=1800.0, reader=f"guardian{writer}",
                             read={f"n-{writer}-{i}": time.time(), "shared-name": time.time()})
        except Exception as exc:
            errors.append(f"guardian{writer}: {type(exc).__name__}: {exc}"[:300])
        finally:
            store.close()

    def handler(writer: int) -> None:  # two incident handlers claiming the same actions (a duplicate task)
        store = FleetStore(pg_url)
        try:
            start.wait()
            for i in range(rounds):
                store.record_action(f"stop:{i}", kind="stop")
                store.record_checkpoint(JOB, i)
        except Exception as exc:
            errors.append(f"handler{writer}: {type(exc).__name__}: {exc}"[:300])
        finally:
            store.close()

    def pool() -> None:  # the standby pool's self-checks
        store = FleetStore(pg_url)
        try:
            start.wait()
            for _ in range(rounds // 3):
                for name in STANDBYS:
                    store.transition(name, states.SELF_CHECK, reason="pool: recheck")
                    store.transition(name, states.STANDBY, reason="self-check passed", checked=True)
        except Exception as exc:
            errors.append(f"pool: {type(exc).__name__}: {exc}"[:300])
        finally:
            store.close()

    def verifier() -> None:  # checkpoint verification marking what the handlers record
        store = FleetStore(pg_url)
        try:
            start.wait()
            marked = 0
            deadline = time.monotonic() + 60
            while marked < rounds and time.monotonic() < deadline:
                have = {c.step for c in store.checkpoints(JOB)}
                if marked in have:
                    store.mark_checkpoint(JOB, marked, verified=True)
                    marked += 1
        except Exception as exc:
            errors.append(f"verifier: {type(exc).__name__}: {exc}"[:300])
        finally:
            store.close()

    threads = [threading.Thread(target=guardian, args=(w,)) for w in range(4)]
    threads += [threading.Thread(target=handler, args=(w,)) for w in range(2)]
    threads += [threading.Thread(target=pool), threading.Thread(target=verifier)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    assert not [t.name for t in threads if t.is_alive()], "a writer never finished (a deadlock or a lock wait)"
    assert errors == [], "\n".join(e[:200] for e in errors)
    incidents = fleet.incidents(JOB)
    assert len(incidents) == 1  # one storm, one incident, whoever ingested first
    alerts = fleet.alerts_of(incidents[0].id)
    expected = {f"a-{w}-{i}" for w in range(4) for i in range(rounds * 3)}
    assert sorted(a.id for a in alerts) == sorted(expected)  # every alert once, the retried ones not twice
    assert [a.key for a in fleet.actions()] == [f"stop:{i}" for i in range(rounds)]  # one record per key
    ckpts = fleet.checkpoints(JOB)
    assert [c.step for c in ckpts] == list(range(rounds)) and all(c.verified for c in ckpts)
    for name in STANDBYS:  # every transition recorded, none lost
        moves = [e.to_state for e in fleet.events(name)][1:]
        assert moves == [states.SELF_CHECK, states.STANDBY] * (rounds // 3)
        assert fleet.machine(name).state == states.STANDBY
    for w in range(4):
        assert "shared-name" in fleet.cursor(f"guardian{w}")


def test_two_controllers_syncing_a_large_inventory_at_once_register_each_machine_once(pg_url, fleet):
    names = [f"n{i}" for i in range(3000)]
    machines = [(n, "10.1.0.1", states.STANDBY, "from the inventory") for n in names]
    added: list[list[str]] = []
    errors: list[str] = []
    start = threading.Barrier(2)

    def sync() -> None:
        store = FleetStore(pg_url)
        try:
            start.wait()
            added.append(store.register_machines(machines))
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}"[:300])
        finally:
            store.close()

    threads = [threading.Thread(target=sync) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert errors == []
    assert sorted(added[0] + added[1]) == sorted(names)  # each machine added by exactly one of them
    assert all(len(fleet.events(n)) == 1 for n in ("n0", "n1500", "n2999"))  # and registered once
    assert len([m for m in fleet.machines() if m.name.startswith("n")]) == 3000


def test_a_restart_of_the_postgres_server_mid_incident_is_waited_out(tmp_path, monkeypatch):
    """The scale-out profile's fleet database restarts while a GPU fault's incident is handled: the triage of a
    task that opens the database during the restart waits until it is back, and a store whose connections the
    restart broke answers its next call on new ones; with no wait allowed, the call fails in one line."""
    import shutil
    import tempfile
    from pathlib import Path

    from tests.fakes import alert, fleet_controller
    from trainguard.emulation.servers import Postgres
    from trainguard.operators.control import Controller
    from trainguard.operators.fleet.store import FleetUnavailable
    from trainguard.operators.tasks import incident as steps

    folder = Path(tempfile.mkdtemp(prefix="tgpg-"))
    server = Postgres(folder / "pg", port=5439)
    try:
        server.start()
        server.create("tg", "tg_owner", "unused")
        url = server.socket_url("tg")
        FleetStore(url, migrate=True).close()
        c, _fleet = fleet_controller(tmp_path, fleet_url=url)
        [item] = c.ingest([alert("gpu_lost", "m2")])
        held = FleetStore(url, retry_s=60)  # an engine whose pooled connection the restart breaks
        assert held.incident(item["incident"]).state == "open"
        impatient = FleetStore(url, retry_s=0)
        assert impatient.incident(item["incident"]).state == "open"
        server.stop()
        with pytest.raises(FleetUnavailable, match="did not answer"):
            impatient.incident(item["incident"])
        back = threading.Timer(3.0, server.start)
        back.start()
        began = time.monotonic()
        task = Controller(c.cfg, fleet=FleetStore(url, retry_s=60), transport=c.transport, inventory=c.inventory)
        decision = steps.triage(task, item["incident"])
        waited = time.monotonic() - began
        back.join()
        assert waited >= 2.5 and decision["action"] == "evict" and decision["machines"] == ["m2"], (waited, decision)
        assert held.incident(item["incident"]).summary.endswith("next: evict")
    finally:
        server.stop()
        shutil.rmtree(folder, ignore_errors=True)

"""The fleet database through one Airflow connection (``tg_fleet``): its URL from a postgres, sqlite or
trainguard_fleet connection, over ``TG_FLEET_URL``; a connection of another type is refused in one line; the
store a task's hook opens is the connection's, and a real PostgreSQL server is reached through one."""

from __future__ import annotations

import json

import pytest

from trainguard.operators.hooks import connections
from trainguard.operators.hooks.connections import FleetConnectionError, fleet_url_of
from trainguard.operators.settings import ControlSettings


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    connections._CACHE.clear()
    for var in ("AIRFLOW_CONN_TG_FLEET", "AIRFLOW_CONN_OTHER_DB", "TG_FLEET_CONN_ID", "TG_FLEET_URL"):
        monkeypatch.delenv(var, raising=False)
    yield
    connections._CACHE.clear()


def _conn(monkeypatch, value, name="TG_FLEET"):
    monkeypatch.setenv(f"AIRFLOW_CONN_{name}", value if isinstance(value, str) else json.dumps(value))
    connections._CACHE.clear()


@pytest.mark.parametrize(("value", "url"), [
    ({"conn_type": "postgres", "login": "tg@ops", "password": "p/w:d?", "host": "db1", "port": 5433,
      "schema": "fleet"}, "postgresql+psycopg://tg%40ops:p%2Fw%3Ad%3F@db1:5433/fleet"),
    ({"conn_type": "postgres", "login": "tg", "schema": "fleet", "extra": {"host": "/run/postgresql"}},
     "postgresql+psycopg://tg@/fleet?host=%2Frun%2Fpostgresql"),
    ("postgresql://tg:pw@db2/fleet", "postgresql+psycopg://tg:pw@db2/fleet"),
    ({"conn_type": "sqlite", "host": "/srv/tg/fleet.db"}, "sqlite:////srv/tg/fleet.db"),
    ("sqlite:////srv/tg/fleet.db", "sqlite:////srv/tg/fleet.db"),
    ({"conn_type": "trainguard_fleet", "extra": {"url": "postgresql+psycopg://a@/tg?host=/tmp/s"}},
     "postgresql+psycopg://a@/tg?host=/tmp/s"),
])
def test_the_connection_names_the_fleet_database_over_the_variable(monkeypatch, value, url):
    monkeypatch.setenv("TG_FLEET_URL", "/somewhere/else.db")
    _conn(monkeypatch, value)
    assert ControlSettings.from_env().fleet_url == url


def test_without_the_connection_the_variable_stands_in_and_another_connection_can_be_named(monkeypatch):
    monkeypatch.setenv("TG_FLEET_URL", "/srv/tg/fleet.db")
    assert ControlSettings.from_env().fleet_url == "/srv/tg/fleet.db"
    _conn(monkeypatch, {"conn_type": "sqlite", "host": "/srv/other.db"}, name="OTHER_DB")
    assert ControlSettings.from_env().fleet_url == "/srv/tg/fleet.db"  # not the one trainguard reads
    monkeypatch.setenv("TG_FLEET_CONN_ID", "other_db")
    assert ControlSettings.from_env().fleet_url == "sqlite:////srv/other.db"
    assert ControlSettings.from_env(fleet_url="/given.db").fleet_url == "/given.db"  # an explicit value wins


def test_a_connection_that_names_no_database_is_one_line():
    from airflow.sdk import Connection

    with pytest.raises(FleetConnectionError, match=r"^connection tg_fleet has type 'http', which trainguard cannot"):
        fleet_url_of(Connection(conn_id="tg_fleet", conn_type="http", host="h"))
    with pytest.raises(FleetConnectionError, match="has no host: put the fleet database's file path there"):
        fleet_url_of(Connection(conn_id="tg_fleet", conn_type="sqlite"))


def test_a_tasks_hook_opens_the_database_the_connection_names(monkeypatch, tmp_path):
    from trainguard.operators.fleet.store import FleetStore
    from trainguard.operators.hooks.fleet import FleetHook

    real = tmp_path / "fleet.db"
    FleetStore(real, migrate=True).register_machine("m7", address="10.0.0.7")
    monkeypatch.setenv("TG_FLEET_URL", str(tmp_path / "missing.db"))  # would fail: the file does not exist
    monkeypatch.setenv("TG_FLEET_RETRY_S", "0")
    _conn(monkeypatch, {"conn_type": "sqlite", "host": str(real)})
    assert [m.name for m in FleetHook().store.machines()] == ["m7"]
    hook = FleetHook(fleet_conn_id="nowhere")
    with pytest.raises(FleetConnectionError, match="connection 'nowhere' is not defined"):
        _ = hook.settings


def test_a_postgres_connection_reaches_a_real_server(monkeypatch):
    from sqlalchemy.engine import make_url

    from tests import pg
    from trainguard.operators.fleet.store import FleetStore

    server = pg.private_server()
    url = next(server)
    try:
        FleetStore(url, migrate=True).register_machine("m3", address="10.0.0.3")
        u = make_url(url)
        _conn(monkeypatch, {"conn_type": "postgres", "login": u.username, "password": u.password or "",
                            "host": u.host or "", "port": u.port or None, "schema": u.database,
                            "extra": {k: str(v) for k, v in u.query.items()}})
        got = ControlSettings.from_env().fleet_url
        assert make_url(got).database == u.database
        assert [m.name for m in FleetStore(got).machines()] == ["m3"]
    finally:
        server.close()


@pytest.mark.parametrize("url", ["postgresql+psycopg://tg:s3cr%2Ft@db:5433/fleet?sslmode=require",
                                 "postgresql+psycopg://tg@/fleet?host=/run/postgresql", "sqlite:////srv/tg/fleet.db",
                                 "mysql+pymysql://tg:pw@db/fleet"])
def test_the_connection_install_writes_names_the_same_database_and_keeps_a_password_out_of_the_extra(
        monkeypatch, url):
    from sqlalchemy.engine import make_url

    doc = connections.fleet_connection(url)
    if doc["conn_type"] == "postgres":
        assert "s3cr" not in doc.get("extra", "")  # the password is in the field Airflow masks
    _conn(monkeypatch, doc)
    got = make_url(ControlSettings.from_env().fleet_url)
    want = make_url(url)
    assert (got.drivername.split("+")[0], got.username, got.password, got.host, got.port, got.database,
            dict(got.query)) == (want.drivername.split("+")[0], want.username, want.password, want.host, want.port,
                                 want.database, dict(want.query))


def test_a_variable_that_is_not_a_connection_is_refused_in_one_line(monkeypatch):
    _conn(monkeypatch, "{not json")
    with pytest.raises(FleetConnectionError, match=r"^AIRFLOW_CONN_TG_FLEET is not a connection Airflow can read"):
        ControlSettings.from_env()

"""Airflow connections the control plane reads, and the fleet database's URL from one.

:func:`get_connection` asks Airflow for a connection where there is an Airflow to ask (a task, the triggerer,
the api-server, or any process with the connection in an ``AIRFLOW_CONN_*`` variable), and answers None
elsewhere without importing Airflow (a tool run outside it).

The fleet database is the connection ``TG_FLEET_CONN_ID`` (default ``tg_fleet``) where it is defined:

- type ``postgres`` (``postgresql://user:password@host:5432/fleet``): PostgreSQL through psycopg, the extra's
  keys as the URL's query (``{"host": "/run/postgresql"}`` for a Unix socket);
- type ``sqlite``: the SQLite file named by its host (an absolute path), or ``sqlite:////path/fleet.db``;
- type ``trainguard_fleet``: any SQLAlchemy URL, in its extra's ``url``.

Elsewhere ``TG_FLEET_URL`` (a SQLite path or a SQLAlchemy URL) stands in.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

from trainguard.core.errors import EXIT_USAGE, TrainguardError
from trainguard.operators.provider_info import FLEET_CONN_TYPE

DEFAULT_FLEET_CONN_ID = "tg_fleet"
#: how long a process keeps what Airflow said of a connection (settings are read many times in a task), seconds
CACHE_S = 30.0
_CACHE: dict[tuple[str, str], tuple[float, Any]] = {}
_LOCK = threading.Lock()


class FleetConnectionError(TrainguardError):
    """A connection that is defined but cannot serve (a type trainguard cannot use, a field missing)."""

    exit_code = EXIT_USAGE


def get_connection(conn_id: str, env: Mapping[str, str] | None = None) -> Any | None:
    """Airflow's connection ``conn_id``, or None when it is not defined or there is no Airflow to ask."""
    env = os.environ if env is None else env
    in_env = env.get(f"AIRFLOW_CONN_{conn_id.upper()}", "")
    if not in_env and "airflow.sdk" not in sys.modules:  # not an Airflow process: nothing else to ask
        return None
    key, now = (conn_id, in_env), time.monotonic()
    with _LOCK:
        hit = _CACHE.get(key)
    if hit is not None and now - hit[0] < CACHE_S:
        return hit[1]
    if in_env:  # as Airflow reads an AIRFLOW_CONN_* variable: a JSON document or a URI
        from airflow.sdk import Connection

        try:
            conn = Connection.from_json(in_env, conn_id=conn_id) if in_env.lstrip().startswith("{") \
                else Connection.from_uri(in_env, conn_id=conn_id)
        except Exception as exc:  # a variable that names a connection and cannot be one: say so, never guess
            raise FleetConnectionError(f"AIRFLOW_CONN_{conn_id.upper()} is not a connection Airflow can read "
                                       f"({type(exc).__name__}: {str(exc)[:120]}); fix it or unset it") from None
    else:
        from airflow.sdk import BaseHook
        from airflow.sdk.exceptions import AirflowNotFoundException

        try:
            conn = BaseHook.get_connection(conn_id)
        except AirflowNotFoundException:
            conn = None  # not defined: remembered like a found one
        except Exception:  # no Airflow to ask here, or it did not answer now: not remembered, asked again next time
            return None
    with _LOCK:
        _CACHE[key] = (now, conn)
    return conn


def fleet_conn_id(env: Mapping[str, str] | None = None) -> str:
    env = os.environ if env is None else env
    return env.get("TG_FLEET_CONN_ID", "").strip() or DEFAULT_FLEET_CONN_ID


def fleet_url_of(conn: Any) -> str:
    """The SQLAlchemy URL a fleet connection names (see the module); a one-line error when it names none."""
    extra = conn.extra_dejson if hasattr(conn, "extra_dejson") else {}
    name = getattr(conn, "conn_id", "") or DEFAULT_FLEET_CONN_ID
    kind = (conn.conn_type or "").lower()
    if extra.get("url"):
        return str(extra["url"])
    if kind == "sqlite":  # the file in the host field (Airflow's form), or in the path of a sqlite:////file URI
        path = conn.host or conn.schema
        if not path:
            raise FleetConnectionError(f"connection {name} (sqlite) has no host: put the fleet database's file path "
                                       f"there")
        return f"sqlite:///{os.path.abspath(path)}"
    if kind in ("postgres", "postgresql"):
        from sqlalchemy.engine import URL

        return URL.create("postgresql+psycopg", username=conn.login or None, password=conn.password or None,
                          host=conn.host or None, port=conn.port or None, database=conn.schema or None,
                          query={str(k): str(v) for k, v in extra.items()}).render_as_string(hide_password=False)
    raise FleetConnectionError(f"connection {name} has type {conn.conn_type!r}, which trainguard cannot open as its "
                               f"fleet database; use postgres, sqlite, or {FLEET_CONN_TYPE} with the URL in its "
                               f"extra's url")


def fleet_url_from_connection(env: Mapping[str, str] | None = None) -> str | None:
    """The fleet database's URL from its connection, or None when the connection is not defined."""
    conn = get_connection(fleet_conn_id(env), env)
    return None if conn is None else fleet_url_of(conn)


def fleet_connection(url: str) -> dict[str, Any]:
    """The fleet connection that names ``url``, as ``airflow connections import`` reads it: a PostgreSQL URL as a
    ``postgres`` connection (its password in the password field, which Airflow keeps secret and masks), a SQLite
    file as a ``sqlite`` one, anything else as a ``trainguard_fleet`` one with the URL in its extra."""
    from sqlalchemy.engine import make_url

    u = make_url(url)
    if u.drivername.startswith("postgresql"):
        doc: dict[str, Any] = {"conn_type": "postgres", "host": u.host or "", "login": u.username or "",
                               "password": u.password or "", "schema": u.database or ""}
        if u.port:
            doc["port"] = u.port
        if u.query:
            doc["extra"] = json.dumps({k: v if isinstance(v, str) else v[0] for k, v in u.query.items()})
        return doc
    if u.drivername == "sqlite" and u.database:
        return {"conn_type": "sqlite", "host": u.database}
    return {"conn_type": FLEET_CONN_TYPE, "extra": json.dumps({"url": url})}

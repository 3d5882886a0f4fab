"""The emulated control plane's Airflow on SQLite: the connect arguments its components' engines take
(``[database] sql_alchemy_connect_args``, set by :class:`trainguard.emulation.standalone.Standalone`), and,
imported with them into every component that opens the metadata database, ``now()`` at SQLite's full
precision.

Airflow's scheduler starts a queued DAG run once ``run_after <= now()`` holds (and makes a cron DAG's run once
``next_dagrun_create_after <= now()``). SQLAlchemy renders ``now()`` on SQLite as ``CURRENT_TIMESTAMP``, which
has whole seconds ('2026-12-04 19:24:31'), while Airflow stores ``run_after`` with microseconds
('2026-12-04 19:24:31.346103'): the text comparison holds only from the next whole second on, so every run
made on an alert waited 0-1 s (0.6 s median in a recovery benchmark run) before the scheduler started it.
PostgreSQL's ``now()`` has microseconds. Here ``now()`` becomes the current UTC time in the layout SQLAlchemy
stores SQLite datetimes in (milliseconds from SQLite, zero-padded to six digits).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql import functions

# SQLite connections of the standalone's components wait this long for another writer's lock (Python's
# default is 5 s; on a loaded 2-core host the scheduler, dag processor, triggerer and api-server queue
# longer than that, and a request that gives up answers 500). The tasks' calls to the execution API wait
# longer than that for their answer (Airflow's default, 5 s, would give up on a request still waiting for
# the lock, and its retry would meet the first one's work: a task that started twice fails).
SQLITE_BUSY_S = 30
CONNECT_ARGS = {"timeout": SQLITE_BUSY_S}

#: SQLite's current UTC time as SQLAlchemy stores datetimes there ('YYYY-MM-DD HH:MM:SS.ffffff')
NOW_SQL = "(STRFTIME('%Y-%m-%d %H:%M:%f', 'now') || '000')"


@compiles(functions.now, "sqlite")
def _now(element: Any, compiler: Any, **kw: Any) -> str:
    return NOW_SQL

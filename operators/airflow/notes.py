"""One line per DAG run saying what happened, set as the run's note (the UI shows it in the runs list and
on the run's page), e.g. ``incident 7 resolved (machine_fault): evicted m2 -> standby m4; resumed at step
312, 21s after the first alert``.

Tasks cannot write the metadata database in Airflow 3, so the note goes through the public REST API
(``PATCH /api/v2/dags/{dag_id}/dagRuns/{run_id}``) with the credentials of the Airflow connection
``TG_AIRFLOW_API_CONN_ID`` (default ``tg_airflow_api``: type http, host, port, login, password; schema
``https`` for TLS). Its login needs only the simple auth manager's ``user`` role (``tg_notes`` in
``airflow standalone`` and the compose file), never the admin's. Without that connection the note
stays in the task's return value only; a failure to set it is logged and never fails the run.
"""

from __future__ import annotations

import logging
import os
import urllib.parse
from typing import Any

from operators.airflow import rest

log = logging.getLogger(__name__)
MAX_NOTE = 1000  # Airflow keeps at most 1000 characters of a note
# a note is set once the task's work is done: a busy metadata database (5xx) is waited out this long
NOTE_RETRY_S = 20.0


def _api(conn: Any) -> str:
    scheme = conn.schema if conn.schema in ("http", "https") else "http"
    return f"{scheme}://{conn.host}:{conn.port or (443 if scheme == 'https' else 8080)}"


def set_run_note(note: str) -> bool:
    """Set the running task's DAG run note to ``note`` (one line, at most 1000 characters). True when set."""
    from airflow.sdk import BaseHook, get_current_context

    line = " ".join(note.split())[:MAX_NOTE]
    try:
        ctx = get_current_context()
    except RuntimeError:  # not inside a task (a unit test, the command line): nothing to annotate
        return False
    dag_id, run_id = ctx["dag"].dag_id, ctx["run_id"]
    conn_id = os.environ.get("TG_AIRFLOW_API_CONN_ID", "tg_airflow_api")
    try:
        conn = BaseHook.get_connection(conn_id)
    except Exception:
        log.info("no connection %s: the run's note stays in the task's result: %s", conn_id, line)
        return False
    base = _api(conn)
    try:
        token = rest.call(f"{base}/auth/token", {"username": conn.login, "password": conn.password},
                          method="POST", timeout=10, retry_s=NOTE_RETRY_S)["access_token"]
        rest.call(f"{base}/api/v2/dags/{dag_id}/dagRuns/{urllib.parse.quote(run_id, safe='')}?update_mask=note",
                  {"note": line}, method="PATCH", token=token, timeout=10, retry_s=NOTE_RETRY_S)
    except Exception as exc:  # the note is a courtesy: never fail the run for it
        log.warning("could not set the run's note through %s (%s): %s", base, exc, line)
        return False
    log.info("run note: %s", line)
    return True

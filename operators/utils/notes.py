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

log = logging.getLogger(__name__)
MAX_NOTE = 1000  # Airflow keeps at most 1000 characters of a note
# a note is set once the task's work is done: a busy metadata database (5xx) is waited out this long
NOTE_RETRY_S = 20.0


def set_run_note(note: str) -> bool:
    """Set the running task's DAG run note to ``note`` (one line, at most 1000 characters). True when set."""
    from airflow.sdk import get_current_context

    from trainguard.operators.hooks.airflow_api import AirflowApiHook, api_conn_id

    line = " ".join(note.split())[:MAX_NOTE]
    try:
        ctx = get_current_context()
    except RuntimeError:  # not inside a task (a unit test, the command line): nothing to annotate
        return False
    dag_id, run_id = ctx["dag"].dag_id, ctx["run_id"]
    conn_id = api_conn_id()
    try:
        api = AirflowApiHook(conn_id, retry_s=NOTE_RETRY_S).get_client()
    except Exception:
        log.info("no connection %s: the run's note stays in the task's result: %s", conn_id, line)
        return False
    try:
        with api:
            api.set_run_note(dag_id, run_id, line)
    except Exception as exc:  # the note is a courtesy: never fail the run for it
        log.warning("could not set the run's note through %s (%s): %s", api.base_url, exc, line)
        return False
    log.info("run note: %s", line)
    return True

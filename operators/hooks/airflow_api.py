"""A client of an Airflow api-server's public REST API (``/api/v2``), over httpx, with tenacity's retries.

trainguard's clients of the REST API are the tasks' run notes (:mod:`trainguard.operators.utils.notes`, through the
Airflow connection ``tg_airflow_api``: :class:`AirflowApiHook`), ``trainguard status`` (the api-server's
health) and the emulation harness that drives Airflow in the tests, the demo and the benchmarks.

A request that is safe to repeat (a read, a PATCH, a creation that names what it creates: a DAG run with
its own id answers 409 when repeated) may ask for retries: it is sent again while the api-server answers
5xx (with the SQLite metadata database of ``airflow standalone``, a request that meets another process's
write lock answers 500 "database is locked" and wrote nothing) or takes longer than the client's timeout
to answer (it is busy; the request may have landed, which repeating it tolerates), for up to ``retry_s``
seconds, and while it refuses the connection (it is starting, or nothing is there) for up to
``connect_retry_s``, with exponential back-off. Anything else fails at once: a 4xx is the caller's
mistake, never worth repeating.
"""

from __future__ import annotations

import os
import time
from typing import Any

import httpx
import tenacity

# how long a client that asks for retries keeps trying an api-server that answers 5xx (SQLite's writers
# hold their lock for well under a second each; a minute covers a queue of them on a loaded host)
RETRY_S = 60.0
DEFAULT_CONN_ID = "tg_airflow_api"


def api_conn_id() -> str:
    """The Airflow connection of the REST API the tasks and triggers use: ``TG_AIRFLOW_API_CONN_ID`` (default
    ``tg_airflow_api``)."""
    return os.environ.get("TG_AIRFLOW_API_CONN_ID", DEFAULT_CONN_ID)


class ApiError(Exception):
    """The api-server answered with an error status (``status``), or did not answer."""

    def __init__(self, message: str, status: int | None = None, body: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.body = body


# nothing accepted the connection: no api-server there (yet)
_UNREACHED = (httpx.ConnectError, httpx.ConnectTimeout)
# one accepted it and then failed, or was too slow to answer: a busy or restarting api-server
_BUSY = (httpx.RemoteProtocolError, httpx.ReadError, httpx.ReadTimeout, httpx.WriteTimeout, httpx.PoolTimeout)


def _retryable(exc: BaseException) -> bool:
    if isinstance(exc, ApiError):
        return exc.status is not None and exc.status >= 500
    return isinstance(exc, _UNREACHED + _BUSY)


class AirflowApi:
    """JSON over HTTP to one api-server, authenticated with a JWT from ``/auth/token``.

    :param base_url: the api-server, e.g. ``http://127.0.0.1:8080``
    :param username: the login (the simple auth manager's, or the deployment's)
    :param password: its password
    :param timeout_s: seconds for one request
    :param retry_s: how long repeatable requests are retried (see the module)
    :param connect_retry_s: how long while nothing accepts the connection (default ``retry_s``): a command
        line that should say soon that an address is wrong waits less for it than for a busy api-server
    """

    def __init__(self, base_url: str, *, username: str = "", password: str = "", timeout_s: float = 30.0,
                 retry_s: float = RETRY_S, connect_retry_s: float | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.username = username
        self.password = password
        self.retry_s = retry_s
        self.connect_retry_s = retry_s if connect_retry_s is None else min(connect_retry_s, retry_s)
        self._client = httpx.Client(base_url=self.base_url, timeout=timeout_s,
                                    headers={"Content-Type": "application/json"})
        self._token = ""

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> AirflowApi:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def token(self) -> str:
        """A JWT for this client's login (fetched once)."""
        if not self._token:
            doc = self.request("POST", "/auth/token", {"username": self.username, "password": self.password},
                               auth=False, repeatable=True)
            self._token = doc["access_token"]
        return self._token

    def _once(self, method: str, path: str, body: Any, auth: bool) -> Any:
        headers = {"Authorization": f"Bearer {self.token()}"} if auth else {}
        r = self._client.request(method, path, json=body, headers=headers)
        if r.status_code == 401 and auth:  # the token expired (a client kept for long): a new one, once
            self._token = ""
            r = self._client.request(method, path, json=body, headers={"Authorization": f"Bearer {self.token()}"})
        if r.status_code >= 400:
            raise ApiError(f"{method} {path}: HTTP {r.status_code}: {r.text[:300]}", r.status_code, r.text)
        return r.json() if r.content.strip() else None

    def request(self, method: str, path: str, body: Any = None, *, auth: bool = True,
                repeatable: bool | None = None) -> Any:
        """``method`` ``path`` with ``body`` as JSON; the answer's JSON (None when empty). Raises
        :class:`ApiError` for an error status, httpx's errors when nothing answered. ``repeatable``
        (default: GET and PATCH): retried on 5xx and refused connections for up to ``retry_s``."""
        if repeatable is None:
            repeatable = method in ("GET", "PATCH")
        if not repeatable or self.retry_s <= 0:
            return self._once(method, path, body, auth)
        retrying = tenacity.Retrying(retry=tenacity.retry_if_exception(_retryable), stop=self._stop,
                                     wait=tenacity.wait_exponential(multiplier=0.25, max=2.0),
                                     sleep=time.sleep, reraise=True)
        return retrying(self._once, method, path, body, auth)

    def _stop(self, state: tenacity.RetryCallState) -> bool:
        exc = state.outcome.exception() if state.outcome else None
        limit = self.connect_retry_s if isinstance(exc, _UNREACHED) else self.retry_s
        return (state.seconds_since_start or 0.0) >= limit

    # ---- the endpoints trainguard's product code uses ----------------------------------------------------
    def health(self) -> dict[str, Any]:
        """``/api/v2/monitor/health``: the metadatabase's, scheduler's, triggerer's, dag processor's."""
        return self.request("GET", "/api/v2/monitor/health", auth=False, repeatable=False)

    def live_runs(self, dag_id: str, *, page: int = 100) -> list[str]:
        """The ids of ``dag_id``'s runs that are queued or running (a deferred task's run is running), and for a
        run whose conf names an incident (``incident_id``: a run triggered by hand names its own) ``conf:<id>``."""
        out: list[str] = []
        read = 0
        while True:
            doc = self.request("GET", f"/api/v2/dags/{dag_id}/dagRuns?state=queued&state=running&limit={page}"
                                      f"&offset={read}") or {}
            runs = list(doc.get("dag_runs") or ())
            read += len(runs)
            for r in runs:
                out.append(str(r["dag_run_id"]))
                incident = (r.get("conf") or {}).get("incident_id")
                if incident is not None:
                    out.append(f"conf:{incident}")
            if len(runs) < page:
                return out

    def watcher_beat(self, asset: str, key: str = "watcher") -> dict[str, Any] | None:
        """What the watcher of the asset called ``asset`` last wrote of itself in the asset's state store (its
        ``key`` entry's value, with ``updated_at``), or None when the asset is not known or nothing was written."""
        from urllib.parse import quote

        doc = self.request("GET", f"/api/v2/assets?name_pattern={quote(asset)}&limit=20") or {}
        ids = [a["id"] for a in doc.get("assets") or () if a.get("name") == asset]
        if not ids:
            return None
        try:
            entry = self.request("GET", f"/api/v2/assets/{ids[0]}/state-store/{quote(key)}") or {}
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise
        value = entry.get("value")
        return {**value, "updated_at": entry.get("updated_at")} if isinstance(value, dict) else None

    def trigger_run(self, dag_id: str, conf: dict[str, Any], *, run_id: str = "") -> str:
        """Start a run of ``dag_id`` with ``conf`` (as the UI's trigger form does); its run id. The run id is
        chosen here, so a try whose answer was lost is repeated safely: a 409 says it landed."""
        import secrets
        from datetime import UTC, datetime

        run_id = run_id or f"manual__{datetime.now(UTC).isoformat()}_{secrets.token_hex(3)}"
        try:
            self.request("POST", f"/api/v2/dags/{dag_id}/dagRuns",
                         {"dag_run_id": run_id, "logical_date": None, "conf": conf}, repeatable=True)
        except ApiError as exc:
            if exc.status != 409:
                raise
        return run_id

    def run_state(self, dag_id: str, run_id: str) -> str:
        """A DAG run's state (queued, running, success, failed)."""
        from urllib.parse import quote

        return self.request("GET", f"/api/v2/dags/{dag_id}/dagRuns/{quote(run_id, safe='')}")["state"]

    def task_instances(self, dag_id: str, run_id: str) -> list[dict[str, Any]]:
        """A run's task instances: ``task_id``, ``map_index``, ``state``, ``try_number`` and the epoch seconds it was
        ``queued``, ``started`` and ``ended`` (None where it has not)."""
        from datetime import datetime
        from urllib.parse import quote

        def epoch(value: Any) -> float | None:
            return datetime.fromisoformat(value).timestamp() if isinstance(value, str) and value else None

        doc = self.request("GET", f"/api/v2/dags/{dag_id}/dagRuns/{quote(run_id, safe='')}/taskInstances")
        return [{"task_id": str(ti.get("task_id")), "map_index": ti.get("map_index", -1), "state": ti.get("state"),
                 "try_number": ti.get("try_number"), "queued": epoch(ti.get("queued_when")),
                 "started": epoch(ti.get("start_date")), "ended": epoch(ti.get("end_date"))}
                for ti in (doc or {}).get("task_instances") or []]

    def clear_tasks(self, dag_id: str, run_id: str, task_ids: list[str], *, downstream: bool = True) -> list[str]:
        """Clear ``task_ids`` of a run (and the tasks after them with ``downstream``), as the UI's Clear does: they
        run again and the run with them. The task ids cleared."""
        out = self.request("POST", f"/api/v2/dags/{dag_id}/clearTaskInstances",
                           {"dry_run": False, "dag_run_id": run_id, "task_ids": list(task_ids),
                            "include_downstream": downstream, "only_failed": False, "reset_dag_runs": True},
                           repeatable=True)
        return sorted({str(ti.get("task_id")) for ti in (out or {}).get("task_instances") or []})

    def set_run_note(self, dag_id: str, run_id: str, note: str) -> Any:
        """Set a DAG run's note (the simple auth manager's ``user`` role may)."""
        from urllib.parse import quote

        return self.request("PATCH", f"/api/v2/dags/{dag_id}/dagRuns/{quote(run_id, safe='')}?update_mask=note",
                            {"note": note})


class AirflowApiHook:
    """The REST API of the connection ``conn_id`` (type http: host, port, login, password; schema ``https``
    for TLS), as an :class:`AirflowApi`. Its login needs no more than the simple auth manager's ``user``
    role: trainguard only sets run notes through it.

    :param conn_id: the Airflow connection (default ``tg_airflow_api``)
    :param retry_s: how long repeatable requests are retried
    """

    def __init__(self, conn_id: str = DEFAULT_CONN_ID, *, retry_s: float = RETRY_S, timeout_s: float = 10.0) -> None:
        self.conn_id = conn_id
        self.retry_s = retry_s
        self.timeout_s = timeout_s

    def get_client(self) -> AirflowApi:
        from airflow.sdk import BaseHook

        conn = BaseHook.get_connection(self.conn_id)
        scheme = conn.schema if conn.schema in ("http", "https") else "http"
        url = f"{scheme}://{conn.host}:{conn.port or (443 if scheme == 'https' else 8080)}"
        return AirflowApi(url, username=conn.login or "", password=conn.password or "", timeout_s=self.timeout_s,
                          retry_s=self.retry_s)

"""A real ``airflow standalone`` with trainguard's DAGs: its own AIRFLOW_HOME, port and process group, and
what the harness asks of its REST API v2 (through :class:`trainguard.operators.hooks.airflow_api.AirflowApi`, as the
admin). The end-to-end tests, the demo and the benchmarks run the control plane in it; an operator would
run the same processes (scheduler, triggerer, dag processor, api-server) as services."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from trainguard.core.procs import group_alive
from trainguard.emulation import airflow_sqlite
from trainguard.operators.fleet.db import url_for
from trainguard.operators.hooks.airflow_api import RETRY_S, AirflowApi, ApiError
from trainguard.operators.provider_info import FLEET_CONN_TYPE

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def poll(predicate: Callable[[], Any], *, timeout: float, what: str, interval: float = 0.2) -> Any:
    """Call ``predicate`` until it returns something truthy and return that; TimeoutError naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


# ending airflow standalone: its components end on SIGINT within seconds; the scheduler on SIGTERM; what is
# left then (idle LocalExecutor workers, whose tasks ended) is killed
STOP_TERM_S = 4.0
STOP_GRACE_S = 6.0

SSH_POOL = "tg_ssh"
API_CONN = "tg_airflow_api"  # what the DAGs' tasks set their run's note through (trainguard.operators.utils.notes)
# the login of that connection: the simple auth manager's ``user`` role (may edit DAG runs, e.g. their
# notes; no connections, variables, pools or configuration), never the admin's
NOTES_USER = "tg_notes"
USERS = f"admin:admin,{NOTES_USER}:user"


class Standalone:
    def __init__(self, home: Path, env: Mapping[str, str], *, port: int | None = None, stock: bool = False) -> None:
        """``stock``: none of trainguard's provisioning (its DAG folder, its DAGs unpaused, the run notes' login, the
        ``tg_ssh`` pool and the ``tg_airflow_api`` connection): what the deployment's own commands do
        (``trainguard airflow install``, docs/deploy.md) is left to the caller; only this host's settings remain
        (ports, the SQLite waits, the loops' pace)."""
        self.home = home
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {
            **os.environ,
            "AIRFLOW_HOME": str(home),
            **({} if stock else {"AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "dags"),
                                 "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False",
                                 "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": USERS}),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__PARALLELISM": "8",
            "AIRFLOW__API__PORT": str(self.port),
            "AIRFLOW__API__HOST": "127.0.0.1",
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"http://127.0.0.1:{self.port}/execution/",
            "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(free_port()),
            "AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT": str(free_port()),
            "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
            # a DAG file is parsed again when it changed (the processor compares its mtime on every refresh), not
            # every 30 s (Airflow's default): ten files parsed again twice a minute, each a process importing the
            # control plane and a write to the metadata database, took the CPU and SQLite's write lock from the
            # scheduler when an incident's run was being made (asset event -> run up to 1.7 s here)
            "AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": "600",
            "AIRFLOW__SCHEDULER__SCHEDULER_IDLE_SLEEP_TIME": "0.25",
            "AIRFLOW__TRIGGERER__JOB_HEARTBEAT_SEC": "1",
            "PYTHONPATH": str(REPO),
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",  # its subprocesses
            **env,
        }
        if self.env.get("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", "sqlite").startswith("sqlite"):
            for key in ("SQL_ALCHEMY_CONNECT_ARGS", "SQL_ALCHEMY_CONNECT_ARGS_ASYNC"):
                self.env.setdefault(f"AIRFLOW__DATABASE__{key}", f"{airflow_sqlite.__name__}.CONNECT_ARGS")
            self.env.setdefault("AIRFLOW__WORKERS__EXECUTION_API_TIMEOUT", str(2 * airflow_sqlite.SQLITE_BUSY_S))
        self.env.pop("AIRFLOW_CONN_TG_SSH", None)
        # where the harness reads the incidents' runs (the fleet database)
        self.fleet_url = url_for(self.env["TG_FLEET_URL"]) if self.env.get("TG_FLEET_URL") else ""
        if not stock and self.env.get("TG_FLEET_URL"):  # the fleet database reached as a deployment does: a connection
            del self.env["TG_FLEET_URL"]
            self.env["AIRFLOW_CONN_TG_FLEET"] = json.dumps({"conn_type": FLEET_CONN_TYPE,
                                                             "extra": {"url": self.fleet_url}})
        self.stock = stock
        self.proc: subprocess.Popen[bytes] | None = None
        self._api: AirflowApi | None = None

    def start(self, timeout: float = 240) -> None:
        self.launch()
        self.ready(timeout)

    def launch(self) -> None:
        """Start ``airflow standalone`` and return at once (:meth:`ready` waits for it)."""
        log = open(self.home / "standalone.log", "wb")  # noqa: SIM115  (closed with the process)
        airflow = str(Path(sys.executable).parent / "airflow")
        self.proc = subprocess.Popen([airflow, "standalone"], env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT,
                                                                                             signal.SIG_DFL))
        (self.home / "standalone.pid").write_text(str(self.proc.pid))  # its process group, for a later stop
        (self.home / "standalone.url").write_text(self.url)  # where ``trainguard status`` finds it

    def ready(self, timeout: float = 240) -> None:
        """Wait until the api-server answers and trainguard's DAGs are parsed; then (unless ``stock``) provision
        the ``tg_ssh`` pool and the ``tg_airflow_api`` connection."""
        poll(self._healthy, timeout=timeout, interval=1.0, what=f"airflow standalone on {self.url}")
        poll(lambda: self.dag_ids() >= {"tg_incident", "tg_reconcile", "tg_diagnose", "tg_sdc_replay"}, timeout=120,
                   interval=1.0, what="the trainguard DAGs to be parsed")
        self.request("GET", "/execution/health", auth=False)  # warm the execution API (first task waits otherwise)
        if self.stock:
            return
        slots = int(self.env.get("TG_SSH_POOL_SLOTS", "16"))
        # the metadata database is busy while the scheduler starts (SQLite): a write may fail once
        poll(lambda: self._try(lambda: self.ensure_pool(SSH_POOL, slots)), timeout=120, interval=1.0,
             what=f"the {SSH_POOL} pool to be created")
        poll(lambda: self._try(self.ensure_api_connection), timeout=60, interval=1.0,
             what=f"the {API_CONN} connection to be created")

    @staticmethod
    def _try(action: Callable[[], Any]) -> bool:
        try:
            action()
            return True
        except ApiError as exc:
            if (exc.status or 500) < 500:
                raise
            return False

    def ensure_pool(self, name: str, slots: int) -> None:
        """The pool (``tg_ssh``: concurrent SSH sessions of the mapped node tasks) with ``slots`` slots."""
        settings = {"slots": slots, "description": "concurrent SSH sessions of trainguard's node tasks"}
        try:
            self.request("GET", f"/api/v2/pools/{name}")
        except ApiError as exc:
            if exc.status != 404:
                raise
            self.request("POST", "/api/v2/pools", {"name": name, **settings})
            return
        # Airflow 3.3 validates a patch as a whole pool: its name ("pool") and include_deferred with it
        self.request("PATCH", f"/api/v2/pools/{name}", {"pool": name, "include_deferred": False, **settings})

    def ensure_api_connection(self) -> None:
        """The connection the tasks use to set their run's note: this api-server, as ``NOTES_USER`` (a
        ``user``-role login, not the admin's)."""
        pw_file = self.home / "simple_auth_manager_passwords.json.generated"
        host = urllib.parse.urlparse(self.url).hostname  # where the tasks reach it (a worker: not loopback)
        body = {"connection_id": API_CONN, "conn_type": "http", "host": host, "port": self.port,
                "login": NOTES_USER, "password": json.loads(pw_file.read_text())[NOTES_USER], "schema": "http"}
        try:
            self.request("POST", "/api/v2/connections", body)
        except ApiError as exc:
            if exc.status != 409:
                raise
            self.request("PATCH", f"/api/v2/connections/{API_CONN}", body)

    def run_note(self, dag_id: str, run_id: str) -> str | None:
        return self.request("GET", f"/api/v2/dags/{dag_id}/dagRuns/{urllib.parse.quote(run_id)}").get("note")

    def _healthy(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"airflow standalone exited {self.proc.returncode}; see {self.home}/standalone.log")
        try:
            with AirflowApi(self.url, timeout_s=2, retry_s=0) as api:
                return bool(api.health())
        except Exception:  # not up yet: refused, reset, a 5xx while it starts
            return False

    @property
    def api(self) -> AirflowApi:
        """The REST API as the admin (the harness clears, triggers and reads everything)."""
        if self._api is None:
            pw_file = self.home / "simple_auth_manager_passwords.json.generated"
            poll(pw_file.exists, timeout=60, what="the admin password file")
            self._api = AirflowApi(self.url, username="admin", password=json.loads(pw_file.read_text())["admin"],
                                   timeout_s=2 * airflow_sqlite.SQLITE_BUSY_S, retry_s=RETRY_S)
        return self._api

    def request(self, method: str, path: str, body: Any = None, *, auth: bool = True,
                retry: bool | None = None) -> Any:
        """``method`` ``path`` on the api-server with ``body`` as JSON; the answer's JSON. A request that is
        safe to repeat (``retry``; by default every method but POST) is tried again while the server
        answers 5xx (its SQLite database locked by another writer), for up to a minute."""
        repeatable = method != "POST" if retry is None else retry
        try:
            return self.api.request(method, path, body, auth=auth, repeatable=repeatable)
        except ApiError as exc:
            if (exc.status or 0) >= 500:
                raise ApiError(f"{exc}; the api-server's last error: {self.last_error() or 'none logged'}",
                               exc.status, exc.body) from None
            raise

    def last_error(self) -> str | None:
        """The api-server's last logged error (what a 500 was), if any."""
        try:
            with open(self.home / "standalone.log", "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - 256 * 1024))
                lines = f.read().decode(errors="replace").splitlines()
        except OSError:
            return None
        found = [ln.strip() for ln in lines if ln.startswith("api-server") and "[error" in ln]
        return found[-1][:400] if found else None

    def dag_ids(self) -> set[str]:
        try:
            return {d["dag_id"] for d in self.request("GET", "/api/v2/dags?limit=100")["dags"]}
        except (OSError, ApiError, KeyError):
            return set()

    def trigger(self, dag_id: str, conf: dict[str, Any]) -> str:
        """Start a run of ``dag_id`` with ``conf`` (as the UI's trigger form does); its run id. The run id is
        chosen here, so a try that the server failed to answer is repeated safely: a 409 says it landed."""
        try:
            return self.api.trigger_run(dag_id, conf)
        except ApiError as exc:
            if (exc.status or 0) >= 500:
                raise ApiError(f"{exc}; the api-server's last error: {self.last_error() or 'none logged'}",
                               exc.status, exc.body) from None
            raise

    def runs(self, dag_id: str) -> list[dict[str, Any]]:
        return self.request("GET", f"/api/v2/dags/{dag_id}/dagRuns?limit=100&order_by=-start_date")["dag_runs"]

    def run_state(self, dag_id: str, run_id: str) -> str:
        return self.api.run_state(dag_id, run_id)

    def task_instances(self, dag_id: str, run_id: str) -> list[dict[str, Any]]:
        doc = self.request("GET", f"/api/v2/dags/{dag_id}/dagRuns/{urllib.parse.quote(run_id)}/taskInstances")
        return doc["task_instances"]

    def task_states(self, dag_id: str, run_id: str) -> dict[str, str]:
        return {t["task_id"]: t["state"] for t in self.task_instances(dag_id, run_id)}

    def xcom(self, dag_id: str, run_id: str, task_id: str) -> Any:
        """What a task returned (its ``return_value`` XCom); ApiError 404 when it has none."""
        return self.request("GET", f"/api/v2/dags/{dag_id}/dagRuns/{urllib.parse.quote(run_id)}/taskInstances/"
                                   f"{task_id}/xcomEntries/return_value")["value"]

    def clear(self, dag_id: str, run_id: str, task_ids: list[str], *, downstream: bool = True) -> list[str]:
        """Clear ``task_ids`` of a run (and, with ``downstream``, the tasks after them), as the UI's Clear
        does: they run again and the run is running again. Returns the task ids cleared."""
        doc = self.request("POST", f"/api/v2/dags/{dag_id}/clearTaskInstances",
                           {"dry_run": False, "dag_run_id": run_id, "task_ids": task_ids, "only_failed": False,
                            "include_downstream": downstream, "reset_dag_runs": True}, retry=True)
        return sorted(t["task_id"] for t in doc["task_instances"])

    def finished(self, dag_id: str, run_id: str, *, timeout: float = 300) -> str:
        """Wait for the run to end; its final state (success or failed)."""
        return poll(lambda: (lambda st: st if st in ("success", "failed") else None)(self.run_state(dag_id, run_id)),
                    timeout=timeout, interval=1.0, what=f"{dag_id} run {run_id} to end")

    def task_log(self, dag_id: str, run_id: str, task_id: str, try_number: int = 1, *, map_index: int = -1) -> str:
        """A task's log of one try, as text: one line per entry, each entry's JSON (an error's message is
        in its ``error_detail``, not its ``event``). ``map_index``: which instance of a mapped task."""
        doc = self.request("GET", f"/api/v2/dags/{dag_id}/dagRuns/{urllib.parse.quote(run_id)}/taskInstances/"
                                  f"{task_id}/logs/{try_number}?full_content=true&map_index={map_index}")
        content = doc.get("content") if isinstance(doc, dict) else doc
        if isinstance(content, list):
            return "\n".join(json.dumps(c) if isinstance(c, dict) else str(c) for c in content)
        return str(content)

    def incident_run(self, incident_id: int, fleet: Any = None) -> dict[str, Any] | None:
        """The tg_incident run of ``incident_id``: the first that took it as its own (the run Airflow started for the
        batch that opened it, as the fleet database records: ``fleet``, else the one this Airflow's tasks reach) or was
        started for it (its conf names it); None when there is none yet."""
        if fleet is None and self.fleet_url:
            from trainguard.operators.hooks.fleet import fleet_store

            fleet = fleet_store(self.fleet_url)
        for claim in fleet.claims_of(incident_id) if fleet is not None else ():
            try:
                return self.request("GET", f"/api/v2/dags/tg_incident/dagRuns/{urllib.parse.quote(claim['run'])}")
            except ApiError as exc:
                if exc.status != 404:
                    raise
        return next((run for run in self.runs("tg_incident")
                     if (run.get("conf") or {}).get("incident_id") == incident_id), None)

    def stop(self, *, grace_s: float = STOP_GRACE_S) -> None:
        """End airflow standalone and its components: SIGINT, SIGTERM after ``STOP_TERM_S`` and SIGKILL after
        ``grace_s`` for what is left (its LocalExecutor's idle workers heed neither of the first two, and its
        scheduler waits for them: a stop that waited for it to end them took the whole grace every time)."""
        if self._api is not None:
            self._api.close()
            self._api = None
        if self.proc is None:
            return
        stop_group(self.proc.pid, grace_s=grace_s, term_s=STOP_TERM_S)
        self.proc.wait(timeout=10)
        self.proc = None
        (self.home / "standalone.pid").unlink(missing_ok=True)

    @staticmethod
    def stop_kept(home: Path) -> bool:
        """Stop the standalone a finished process left running in ``home`` (a demo run with ``--keep``);
        True when there was one."""
        pid_file = home / "standalone.pid"
        try:
            pid = int(pid_file.read_text())
        except (OSError, ValueError):
            return False
        running = stop_group(pid, grace_s=STOP_GRACE_S, term_s=STOP_TERM_S)
        pid_file.unlink(missing_ok=True)
        return running


def stop_group(pid: int, grace_s: float = 30.0, sig: int = signal.SIGINT, *, term_s: float | None = None) -> bool:
    """End the process group ``pid`` leads: ``sig`` (SIGINT: airflow standalone ends its components), SIGTERM
    after ``term_s`` to what is left (none by default), SIGKILL after ``grace_s``. True when it was running."""
    return pid in stop_groups([pid], grace_s=grace_s, sig=sig, term_s=term_s)


def stop_groups(pids: Iterable[int], grace_s: float = 30.0, sig: int = signal.SIGINT, *,
                term_s: float | None = None) -> set[int]:
    """End the process groups ``pids`` lead, all at once (one grace for all of them, not one after another):
    ``sig``, SIGTERM after ``term_s`` to what is left, SIGKILL after ``grace_s``. Returns the leaders whose
    group was running."""
    running: set[int] = set()
    for pid in dict.fromkeys(pids):
        try:
            os.killpg(pid, sig)
            running.add(pid)
        except ProcessLookupError:
            pass
    start = time.monotonic()
    steps = [(start + term_s, signal.SIGTERM)] if term_s is not None and term_s < grace_s else []
    steps.append((start + grace_s, signal.SIGKILL))
    left = set(running)
    for at, then in steps:
        while left and time.monotonic() < at:
            for pid in list(left):
                try:
                    os.waitpid(pid, os.WNOHANG)  # our own child: reap it
                except ChildProcessError:
                    pass
                if not group_alive(pid):  # gone, or only zombies left for init to reap
                    left.discard(pid)
            if left:
                time.sleep(0.2)
        for pid in list(left):
            try:
                os.killpg(pid, then)
            except ProcessLookupError:
                left.discard(pid)
    return running

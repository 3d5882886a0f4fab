"""trainguard in an Airflow it did not start: what ``trainguard airflow bundles`` and ``trainguard airflow install``
do, in the environment of that Airflow (its ``AIRFLOW_HOME``, its configuration, its ``airflow`` command).

- **Where the DAGs come from**: trainguard's DAG files are installed with it (``trainguard.dags``); Airflow 3
  loads them as a local DAG bundle of their own, beside the deployment's own bundles.
  :func:`bundle_list` is the deployment's ``[dag_processor] dag_bundle_config_list`` with that bundle added
  (or put right), to set as ``AIRFLOW__DAG_PROCESSOR__DAG_BUNDLE_CONFIG_LIST`` for every component.
- **What the DAGs need** (:func:`install`; each step a no-op when it is in place already): the fleet database
  (its schema, the inventory's machines), the ``tg_ssh`` pool, the run notes' least-privileged login (with
  Airflow's simple auth manager: ``tg_notes``, role ``user``, its password added to the auth manager's passwords
  file; with another auth manager: a login made there, given as ``TG_NOTES_LOGIN`` and ``TG_NOTES_PASSWORD``)
  and the ``tg_airflow_api`` connection that carries it (imported from a private file, never a command line).

Every refusal is a :class:`TrainguardError` of exit code 2 whose one line says what to set or run.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from trainguard.core.errors import TrainguardError

BUNDLE = "trainguard"
LOCAL_BUNDLE = "airflow.dag_processing.bundles.local.LocalDagBundle"
SSH_POOL = "tg_ssh"
API_CONN = "tg_airflow_api"
NOTES_USER = "tg_notes"
SIMPLE_AUTH = "SimpleAuthManager"
AIRFLOW_RANGE = ((3, 3), (3, 4))  # the versions trainguard's DAGs, triggers and plugin are built and tested on

Runner = Callable[[Sequence[str]], "subprocess.CompletedProcess[str]"]


def dags_path() -> Path:
    """The folder of trainguard's DAG files (``trainguard.dags``), installed or in a source checkout."""
    import trainguard.dags

    return Path(trainguard.dags.__file__).resolve().parent


def bundle_list(current: Sequence[Mapping[str, Any]], path: Path | None = None) -> list[dict[str, Any]]:
    """The deployment's DAG bundles with trainguard's: an entry named ``trainguard`` is replaced (a reinstall into
    another environment moves it), every other entry kept as it is, in its order."""
    ours = {"name": BUNDLE, "classpath": LOCAL_BUNDLE, "kwargs": {"path": str(path or dags_path())}}
    return [dict(b) for b in current if b.get("name") != BUNDLE] + [ours]


def loads_our_dags(current: Sequence[Mapping[str, Any]], dags_folder: str, path: Path | None = None) -> bool:
    """Whether this configuration parses trainguard's DAG files: a local bundle at their folder, or the
    ``dags-folder`` bundle (a local bundle without a path) while ``[core] dags_folder`` is that folder."""
    want = str((path or dags_path()).resolve())
    for b in current:
        if b.get("classpath") != LOCAL_BUNDLE:
            continue
        where = (b.get("kwargs") or {}).get("path") or dags_folder
        if where and str(Path(where).resolve()) == want:
            return True
    return False


def simple_users(setting: str) -> dict[str, str]:
    """``[core] simple_auth_manager_users`` (``name:role,name:role[:teams]``) -> name -> role."""
    out = {}
    for item in (s.strip() for s in setting.split(",") if s.strip()):
        name, _, rest = item.partition(":")
        out[name] = rest.partition(":")[0]
    return out


def ensure_password(path: Path, user: str) -> str:
    """``user``'s password in the simple auth manager's passwords file, added (random) when it has none; every
    other login's kept. The file is written whole with mode 0600, then renamed."""
    from trainguard.core.files import write_atomic

    try:
        have = json.loads(path.read_text()) if path.exists() else {}
    except ValueError:
        raise TrainguardError(f"{path} is not the auth manager's JSON passwords file; move it away and run again",
                              exit_code=2) from None
    if not isinstance(have, dict):
        raise TrainguardError(f"{path} is not a JSON object of logins; move it away and run again", exit_code=2)
    if not have.get(user):
        have[user] = secrets.token_urlsafe(24)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(have) + "\n", mode=0o600)
    return str(have[user])


def api_url(config: Mapping[str, str]) -> str:
    """Where the tasks and the triggerer reach the api-server: ``[api] base_url``, else its host and port (a
    wildcard host read as this host)."""
    if config.get("base_url"):
        return config["base_url"].rstrip("/")
    host = config.get("host") or "127.0.0.1"
    # listening everywhere says nothing of where it is reached: this host (workers elsewhere: --api-url)
    host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host  # noqa: S104  (read, not bound)
    return f"http://{host}:{config.get('port') or 8080}"


def connection_document(url: str, login: str, password: str) -> dict[str, Any]:
    """``tg_airflow_api`` as ``airflow connections import`` reads it."""
    from urllib.parse import urlparse

    u = urlparse(url)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise TrainguardError(f"--api-url {url!r} is not an http(s) URL of the api-server; pass one like "
                              "http://airflow.example:8080", exit_code=2)
    if u.path not in ("", "/"):
        raise TrainguardError(f"the api-server's URL {url!r} has a path; trainguard reaches it at a host's root: pass "
                              "--api-url with the scheme, host and port the tasks reach it at", exit_code=2)
    return {API_CONN: {"conn_type": "http", "host": u.hostname, "port": u.port or (443 if u.scheme == "https" else 80),
                       "schema": u.scheme, "login": login, "password": password,
                       "description": "trainguard: run notes and incident runs (a least-privileged login)"}}


def check_version(version: str) -> None:
    parts = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
    low, high = AIRFLOW_RANGE
    if not low <= parts < high:
        raise TrainguardError(f"this Airflow is {version}; trainguard runs on Airflow {low[0]}.{low[1]}.x "
                              f"(install apache-airflow>={low[0]}.{low[1]},<{high[0]}.{high[1]})", exit_code=2)


def _airflow_command() -> str:
    beside = Path(sys.executable).with_name("airflow")
    return str(beside) if beside.exists() else "airflow"


def _run(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run([_airflow_command(), *argv], capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        raise TrainguardError(f"'airflow {' '.join(argv[:2])}' did not answer in 300 s; is the metadata database "
                              "reachable?", exit_code=2) from None
    except OSError as exc:
        raise TrainguardError(f"cannot run airflow ({exc.strerror}); run this in the environment Airflow is "
                              "installed in", exit_code=2) from None


def _airflow(run: Runner, argv: Sequence[str], what: str) -> None:
    done = run(argv)
    if done.returncode != 0:
        last = next((ln for ln in reversed((done.stderr or done.stdout or "").splitlines()) if ln.strip()), "")
        raise TrainguardError(f"'airflow {' '.join(argv[:2])}' failed ({what}): {last.strip()[:300]}; is the "
                              "metadata database migrated ('airflow db migrate') and reachable?", exit_code=2)


def _config() -> dict[str, Any]:
    """The parts of the Airflow configuration in force here that the install reads."""
    import airflow
    from airflow.api_fastapi.auth.managers.simple.simple_auth_manager import SimpleAuthManager
    from airflow.configuration import conf

    return {
        "version": airflow.__version__,
        "bundles": _bundles_in_force(),
        "dags_folder": conf.get("core", "dags_folder", fallback=""),
        "auth_manager": conf.get("core", "auth_manager", fallback=""),
        "simple_users": conf.get("core", "simple_auth_manager_users", fallback=""),
        "passwords_file": SimpleAuthManager.get_generated_password_file(),
        "api": {"base_url": conf.get("api", "base_url", fallback="") or "",
                "host": conf.get("api", "host", fallback=""), "port": conf.get("api", "port", fallback="8080")},
    }


def _bundles_in_force() -> list[dict[str, Any]]:
    from airflow.configuration import conf
    from airflow.exceptions import AirflowConfigException

    try:
        out = conf.getjson("dag_processor", "dag_bundle_config_list", fallback=[]) or []
    except AirflowConfigException as exc:
        raise TrainguardError(f"[dag_processor] dag_bundle_config_list is not valid JSON ({exc}); fix it first",
                              exit_code=2) from None
    if not isinstance(out, list):
        raise TrainguardError("[dag_processor] dag_bundle_config_list is not a JSON list; fix it first", exit_code=2)
    return out


def bundles_json() -> str:
    """``trainguard airflow bundles``: the value of ``AIRFLOW__DAG_PROCESSOR__DAG_BUNDLE_CONFIG_LIST`` that keeps
    this deployment's bundles and adds trainguard's (unchanged when they load its DAGs already, through the
    dags folder or a bundle of its own: never the same DAGs twice)."""
    from airflow.configuration import conf

    current = _bundles_in_force()
    if loads_our_dags(current, conf.get("core", "dags_folder", fallback="")):
        return json.dumps(current)
    return json.dumps(bundle_list(current))


def install(*, pool_slots: int | None = None, url: str = "", env: Mapping[str, str] | None = None,
            config: Mapping[str, Any] | None = None, run: Runner = _run,
            provision: Callable[[], dict[str, Any]] | None = None) -> list[str]:
    """Provision what trainguard's DAGs need in this Airflow; returns one line per step. Checks first and
    changes nothing when a prerequisite is missing. ``pool_slots``: the ``tg_ssh`` pool's size, set whether or
    not the pool exists; None keeps an existing pool as it is and makes a missing one with ``TG_SSH_POOL_SLOTS``
    (16) slots."""
    env = os.environ if env is None else env
    if pool_slots is not None and pool_slots < 1:
        raise TrainguardError(f"--pool-slots {pool_slots} must be at least 1", exit_code=2)
    default_slots = env.get("TG_SSH_POOL_SLOTS") or "16"
    if not default_slots.isdigit() or int(default_slots) < 1:
        raise TrainguardError(f"TG_SSH_POOL_SLOTS={default_slots!r} is not a whole number of at least 1; unset it "
                              "for the default (16)", exit_code=2)
    missing = [v for v in ("TG_FLEET_URL", "TG_INVENTORY") if not env.get(v)]
    if missing:
        raise TrainguardError(f"{' and '.join(missing)} not set: set them here and in the environment of every "
                              "Airflow component (the fleet database's URL or SQLite path, the inventory file)",
                              exit_code=2)
    if not Path(env["TG_INVENTORY"]).is_file():
        raise TrainguardError(f"TG_INVENTORY={env['TG_INVENTORY']} is not a file; write the inventory first "
                              "(docs: Deploy on your fleet, 'The inventory')", exit_code=2)
    cfg = dict(config) if config is not None else _config()
    check_version(cfg["version"])
    if not loads_our_dags(cfg["bundles"], cfg["dags_folder"]):
        raise TrainguardError("this Airflow does not load trainguard's DAGs: set AIRFLOW__DAG_PROCESSOR__DAG_BUNDLE_"
                              "CONFIG_LIST=\"$(trainguard airflow bundles)\" for every Airflow component, here too",
                              exit_code=2)
    simple = cfg["auth_manager"].rsplit(".", 1)[-1] == SIMPLE_AUTH
    if simple:
        role = simple_users(cfg["simple_users"]).get(NOTES_USER)
        if role != "user":
            raise TrainguardError(f"the simple auth manager has no login {NOTES_USER} of role user: add "
                                  f"'{NOTES_USER}:user' to AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS (now "
                                  f"{cfg['simple_users']!r}) for every Airflow component", exit_code=2)
    elif not (env.get("TG_NOTES_LOGIN") and env.get("TG_NOTES_PASSWORD")):
        raise TrainguardError("with this auth manager, make a login that may trigger DAG runs and edit their notes "
                              "(and nothing more), and pass it as TG_NOTES_LOGIN and TG_NOTES_PASSWORD", exit_code=2)
    connection = connection_document(url or api_url(cfg["api"]), "-", "-")  # the URL checked before any change

    lines = []
    if provision is None:
        from trainguard.operators.hooks.fleet import provision as _provision
        from trainguard.operators.settings import ControlSettings

        def provision() -> dict[str, Any]:  # the database TG_FLEET_URL names: the one tg_fleet is made to name
            return _provision(ControlSettings.from_env(env, fleet_url=env["TG_FLEET_URL"]))
    from sqlalchemy.exc import SQLAlchemyError

    try:
        fleet = provision()
    except (OSError, ValueError, SQLAlchemyError) as exc:
        raise TrainguardError(f"the fleet database {env['TG_FLEET_URL']} could not be provisioned: "
                              f"{str(exc).splitlines()[0][:300]}", exit_code=2) from None
    applied = ", ".join(map(str, fleet["migrations_applied"])) or "none"
    lines.append(f"fleet database {fleet['fleet_url']}: migrations applied {applied}, "
                 f"machines added {', '.join(fleet['machines_added']) or 'none'}")
    have = run(["pools", "get", SSH_POOL, "--output", "json"]) if pool_slots is None else None
    if have is not None and have.returncode == 0:
        lines.append(f"pool {SSH_POOL}: kept as it is (--pool-slots N resizes it)")
    else:
        slots = pool_slots or int(default_slots)
        _airflow(run, ["pools", "set", SSH_POOL, str(slots), "concurrent SSH sessions of trainguard's node tasks"],
                 f"the {SSH_POOL} pool")
        lines.append(f"pool {SSH_POOL}: {slots} slots")
    if simple:
        login, password = NOTES_USER, ensure_password(Path(cfg["passwords_file"]), NOTES_USER)
        lines.append(f"login {NOTES_USER} (role user): its password in {cfg['passwords_file']}")
    else:
        login, password = env["TG_NOTES_LOGIN"], env["TG_NOTES_PASSWORD"]
        lines.append(f"login {login}: from TG_NOTES_LOGIN")
    conn = connection[API_CONN]
    conn.update(login=login, password=password)
    from trainguard.operators.fleet.db import url_for
    from trainguard.operators.hooks.connections import fleet_conn_id, fleet_connection

    fleet_conn = fleet_conn_id(env)  # the fleet database as every component reads it: a connection
    connection[fleet_conn] = {**fleet_connection(url_for(env["TG_FLEET_URL"])),
                              "description": "trainguard: the fleet database"}
    with tempfile.TemporaryDirectory(prefix="tg-install-") as tmp:  # mode 0700: the passwords never leave it
        doc = Path(tmp) / "connections.json"
        doc.write_text(json.dumps(connection))
        doc.chmod(0o600)
        _airflow(run, ["connections", "import", str(doc), "--overwrite"],
                 f"the {API_CONN} and {fleet_conn} connections")
    lines.append(f"connection {API_CONN}: {conn['schema']}://{conn['host']}:{conn['port']} as {login}")
    lines.append(f"connection {fleet_conn}: the fleet database (type {connection[fleet_conn]['conn_type']})")
    lines.append(f"DAGs: bundle {BUNDLE} at {dags_path()}; start (or restart) every Airflow component with "
                 f"TG_INVENTORY in its environment (the fleet database is the connection {fleet_conn}; TG_FLEET_URL "
                 f"is read only where a process finds no such connection)")
    return lines

"""trainguard in an Airflow it did not start (``trainguard airflow bundles|install``): the policy against a scripted
``airflow`` command and configuration; the real ``airflow`` command against a metadata database of its own."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests import REPO
from trainguard.core.errors import TrainguardError
from trainguard.operators import airflow_setup as setup

DEFAULT_BUNDLES = [{"name": "dags-folder", "classpath": setup.LOCAL_BUNDLE, "kwargs": {}}]


def test_our_bundle_is_added_beside_the_deployments_own_and_put_right_when_it_moved():
    theirs = [*DEFAULT_BUNDLES, {"name": "team", "classpath": "x.GitDagBundle", "kwargs": {"tracking_ref": "main"}}]
    out = setup.bundle_list(theirs, Path("/opt/a/dags"))
    assert out[:2] == theirs and out[2] == {"name": "trainguard", "classpath": setup.LOCAL_BUNDLE,
                                            "kwargs": {"path": "/opt/a/dags"}}
    again = setup.bundle_list(out, Path("/opt/b/dags"))  # reinstalled elsewhere: one entry, the new path
    assert [b["name"] for b in again] == ["dags-folder", "team", "trainguard"]
    assert again[2]["kwargs"]["path"] == "/opt/b/dags"
    assert setup.dags_path() == (REPO / "dags").resolve()  # a source checkout: its dags/ folder


def test_our_dags_are_loaded_by_our_bundle_or_by_a_dags_folder_that_is_ours(tmp_path):
    ours = tmp_path / "dags"
    ours.mkdir()
    assert not setup.loads_our_dags(DEFAULT_BUNDLES, str(tmp_path / "elsewhere"), ours)
    assert setup.loads_our_dags(DEFAULT_BUNDLES, str(ours), ours)
    assert setup.loads_our_dags(setup.bundle_list(DEFAULT_BUNDLES, ours), str(tmp_path / "elsewhere"), ours)
    git = [{"name": "trainguard", "classpath": "x.GitDagBundle", "kwargs": {"path": str(ours)}}]
    assert not setup.loads_our_dags(git, "", ours)


def test_the_notes_password_is_added_once_and_every_other_login_kept(tmp_path):
    f = tmp_path / "passwords.json"
    f.write_text(json.dumps({"admin": "secret"}))
    first = setup.ensure_password(f, "tg_notes")
    assert len(first) >= 24 and json.loads(f.read_text()) == {"admin": "secret", "tg_notes": first}
    assert stat.S_IMODE(f.stat().st_mode) == 0o600
    assert setup.ensure_password(f, "tg_notes") == first  # run again: the same login, nothing changed
    f.write_text("not json")
    with pytest.raises(TrainguardError, match="move it away"):
        setup.ensure_password(f, "tg_notes")
    assert f.read_text() == "not json"


def test_the_api_servers_url_comes_from_the_configuration():
    assert setup.api_url({"base_url": "https://airflow.example/", "host": "0.0.0.0", "port": "8080"}) == \
        "https://airflow.example"
    assert setup.api_url({"base_url": "", "host": "0.0.0.0", "port": "8793"}) == "http://127.0.0.1:8793"
    doc = setup.connection_document("https://airflow.example", "tg_notes", "pw")["tg_airflow_api"]
    assert (doc["conn_type"], doc["host"], doc["port"], doc["schema"]) == ("http", "airflow.example", 443, "https")
    with pytest.raises(TrainguardError, match="not an http"):
        setup.connection_document("airflow.example:8080", "a", "b")


class Airflow:
    """The ``airflow`` command as the install calls it: what it was asked, and the connection file's contents
    as it saw them (the file is gone once the install returns)."""

    def __init__(self, fail: str = "") -> None:
        self.calls: list[list[str]] = []
        self.imported: list[dict[str, Any]] = []
        self.fail = fail
        self.fail_only = ""  # with fail: only this subcommand of it fails

    def __call__(self, argv):
        self.calls.append(list(argv))
        if argv[:2] == ["connections", "import"]:
            path = Path(argv[2])
            assert stat.S_IMODE(path.stat().st_mode) == 0o600
            self.imported.append(json.loads(path.read_text()))
        if self.fail and argv[0] == self.fail and self.fail_only in ("", argv[1]):
            return subprocess.CompletedProcess(argv, 1, "", "error\nOperationalError: no such table: slot_pool\n")
        return subprocess.CompletedProcess(argv, 0, "", "")


def _config(tmp_path: Path, **over: Any) -> dict[str, Any]:
    return {"version": "3.3.2", "bundles": setup.bundle_list(DEFAULT_BUNDLES), "dags_folder": str(tmp_path),
            "auth_manager": "airflow.api_fastapi.auth.managers.simple.simple_auth_manager.SimpleAuthManager",
            "simple_users": "admin:admin,tg_notes:user", "passwords_file": str(tmp_path / "pw.json"),
            "api": {"base_url": "", "host": "0.0.0.0", "port": "8080"}, **over}


def _env(tmp_path: Path) -> dict[str, str]:
    inv = tmp_path / "inventory.json"
    inv.write_text("{}")
    return {"TG_FLEET_URL": str(tmp_path / "fleet.db"), "TG_INVENTORY": str(inv)}


def _fleet() -> dict[str, Any]:
    return {"fleet_url": "fleet.db", "migrations_applied": [1, 2], "machines_added": ["m0"]}


def test_install_provisions_the_pool_the_login_and_the_connection_and_again_changes_nothing(tmp_path):
    airflow = Airflow()
    lines = setup.install(pool_slots=12, env=_env(tmp_path), config=_config(tmp_path), run=airflow, provision=_fleet)
    assert airflow.calls[0] == ["pools", "set", "tg_ssh", "12", "concurrent SSH sessions of trainguard's node tasks"]
    assert airflow.calls[1][:2] == ["connections", "import"] and airflow.calls[1][3:] == ["--overwrite"]
    password = json.loads((tmp_path / "pw.json").read_text())["tg_notes"]
    conn = airflow.imported[0]["tg_airflow_api"]
    assert (conn["host"], conn["port"], conn["login"], conn["password"]) == ("127.0.0.1", 8080, "tg_notes", password)
    assert not any(password in " ".join(c) for c in airflow.calls)  # never on a command line
    assert not Path(airflow.calls[1][2]).exists()
    fleet = airflow.imported[0]["tg_fleet"]  # every component reads the fleet database from this connection
    assert (fleet["conn_type"], fleet["host"]) == ("sqlite", str((tmp_path / "fleet.db").resolve()))
    assert "connection tg_fleet: the fleet database (type sqlite)" in lines
    assert lines[0] == "fleet database fleet.db: migrations applied 1, 2, machines added m0"
    assert any(line.startswith("DAGs: bundle trainguard at ") for line in lines)
    setup.install(pool_slots=12, env=_env(tmp_path), config=_config(tmp_path), run=airflow, provision=_fleet)
    assert airflow.imported[1] == airflow.imported[0]  # the same login and password: a no-op for Airflow


def test_a_pool_that_exists_is_kept_unless_a_size_is_asked_and_a_missing_one_takes_the_setting(tmp_path):
    kept = Airflow()  # `pools get` answers: the pool is there
    lines = setup.install(env=_env(tmp_path), config=_config(tmp_path), run=kept, provision=_fleet)
    assert kept.calls[0] == ["pools", "get", "tg_ssh", "--output", "json"]
    assert not any(c[:2] == ["pools", "set"] for c in kept.calls) and "pool tg_ssh: kept as it is" in lines[1]
    missing = Airflow(fail="pools")
    missing.fail_only = "get"
    env = {**_env(tmp_path), "TG_SSH_POOL_SLOTS": "24"}
    setup.install(env=env, config=_config(tmp_path), run=missing, provision=_fleet)
    assert ["pools", "set", "tg_ssh", "24", "concurrent SSH sessions of trainguard's node tasks"] in missing.calls
    with pytest.raises(TrainguardError, match="TG_SSH_POOL_SLOTS='many'"):
        setup.install(env={**env, "TG_SSH_POOL_SLOTS": "many"}, config=_config(tmp_path), run=Airflow(),
                      provision=_fleet)


@pytest.mark.parametrize("over,env_drop,message", [
    ({}, "TG_INVENTORY", "TG_INVENTORY not set"),
    ({"version": "3.2.1"}, "", "this Airflow is 3.2.1; trainguard runs on Airflow 3.3.x"),
    ({"bundles": DEFAULT_BUNDLES}, "", "does not load trainguard's DAGs"),
    ({"simple_users": "admin:admin"}, "", "no login tg_notes of role user"),
    ({"simple_users": "admin:admin,tg_notes:admin"}, "", "no login tg_notes of role user"),
    ({"auth_manager": "airflow.providers.fab.auth_manager.fab_auth_manager.FabAuthManager"}, "",
     "TG_NOTES_LOGIN and TG_NOTES_PASSWORD"),
])
def test_a_missing_prerequisite_is_one_line_exit_2_and_nothing_changed(tmp_path, over, env_drop, message):
    airflow, provisioned = Airflow(), []
    env = _env(tmp_path)
    env.pop(env_drop, None)
    with pytest.raises(TrainguardError, match=message) as refused:
        setup.install(env=env, config=_config(tmp_path, **over), run=airflow,
                      provision=lambda: provisioned.append(1) or _fleet())
    assert refused.value.exit_code == 2 and "\n" not in str(refused.value)
    assert airflow.calls == [] and provisioned == [] and not (tmp_path / "pw.json").exists()


def test_another_auth_managers_login_comes_from_the_environment(tmp_path):
    airflow = Airflow()
    env = {**_env(tmp_path), "TG_NOTES_LOGIN": "svc-trainguard", "TG_NOTES_PASSWORD": "pw"}
    setup.install(env=env, url="https://airflow.example", run=airflow, provision=_fleet,
                  config=_config(tmp_path, auth_manager="airflow.providers.fab.auth_manager.FabAuthManager"))
    conn = airflow.imported[0]["tg_airflow_api"]
    assert (conn["login"], conn["password"], conn["host"]) == ("svc-trainguard", "pw", "airflow.example")
    assert not (tmp_path / "pw.json").exists()


def test_an_airflow_command_that_fails_says_what_to_run(tmp_path):
    with pytest.raises(TrainguardError, match=r"'airflow pools set' failed .*no such table.*airflow db migrate"):
        setup.install(env=_env(tmp_path), config=_config(tmp_path), run=Airflow(fail="pools"), provision=_fleet)


@pytest.mark.slow
@pytest.mark.full  # CI's tier runs the same command on its way to a recovery (tests/e2e/test_user_jobs.py)
def test_the_real_airflow_command_takes_the_pool_and_the_connection(tmp_path):
    """``trainguard airflow bundles`` and ``install`` in a fresh AIRFLOW_HOME with its metadata database migrated:
    the pool and the connection are in Airflow afterwards, as Airflow's own command reads them."""
    inv = tmp_path / "inventory.json"
    inv.write_text(json.dumps({"schema": 1, "cluster": "t", "transport": "local",
                               "machines": [{"name": "m0", "address": "127.0.0.1"}]}))
    home = tmp_path / "airflow"
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "TG_"))},
           "AIRFLOW_HOME": str(home), "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
           "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": "admin:admin,tg_notes:user",
           "TG_FLEET_URL": str(tmp_path / "fleet.db"), "TG_INVENTORY": str(inv)}
    bin_dir = Path(sys.executable).parent

    def run(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(list(argv), env=env, capture_output=True, text=True, timeout=300)

    bundles = run(str(bin_dir / "trainguard"), "airflow", "bundles")
    assert bundles.returncode == 0, bundles.stderr
    env["AIRFLOW__DAG_PROCESSOR__DAG_BUNDLE_CONFIG_LIST"] = bundles.stdout.strip()
    assert run(str(bin_dir / "airflow"), "db", "migrate").returncode == 0
    done = run(str(bin_dir / "trainguard"), "airflow", "install", "--pool-slots", "7")
    assert done.returncode == 0, done.stderr
    pools = json.loads(run(str(bin_dir / "airflow"), "pools", "get", "tg_ssh", "--output", "json").stdout)
    assert pools[0]["slots"] in (7, "7")
    conns = json.loads(run(str(bin_dir / "airflow"), "connections", "get", "tg_airflow_api", "--output", "json").stdout)
    assert conns[0]["login"] == "tg_notes" and conns[0]["host"] == "127.0.0.1"
    fleet = json.loads(run(str(bin_dir / "airflow"), "connections", "get", "tg_fleet", "--output", "json").stdout)
    assert fleet[0]["conn_type"] == "sqlite" and fleet[0]["host"] == str((tmp_path / "fleet.db").resolve())
    assert "machines added m0" in done.stdout
    again = run(str(bin_dir / "trainguard"), "airflow", "install")
    assert again.returncode == 0 and "machines added none" in again.stdout and "pool tg_ssh: kept" in again.stdout
    pools = json.loads(run(str(bin_dir / "airflow"), "pools", "get", "tg_ssh", "--output", "json").stdout)
    assert pools[0]["slots"] in (7, "7")

"""docker/: the compose file agrees with the code, and the node image's entrypoint brings a machine up.

There is no container engine here, so the compose file is checked against what the code expects (the
services of Airflow's official layout, images, ports, volumes, the environment and connections the
DAGs read), and the node image's ENTRYPOINT is run for real: in a network namespace of its own, as a
container's PID 1 would, from nothing but the environment the compose file gives a node. The control
plane then reaches it over ssh with the inventory and known_hosts that airflow-init's provisioner
builds from the host key the node published.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests import REPO
from tests.conftest import can_namespace, wait_until
from trainguard.core import procs
from trainguard.emulation import cluster
from trainguard.node_tools.inventory import Inventory
from trainguard.node_tools.transport import known_hosts_lines, transport_for

DOCKER = REPO / "docker"
sys.path.insert(0, str(DOCKER))
import provision  # noqa: E402  (docker/provision.py: airflow-init's entrypoint)

AIRFLOW_SERVICES = {"airflow-init", "airflow-apiserver", "airflow-scheduler", "airflow-dag-processor",
                    "airflow-triggerer", "airflow-worker"}


def _compose() -> dict[str, Any]:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


def _expand(value: str) -> str:
    """Compose's ``${VAR:-default}`` with the defaults (nothing set in the environment)."""
    return re.sub(r"\$\{[A-Z0-9_]+:-([^}]*)\}", r"\1", value)


def _entrypoint(dockerfile: Path) -> list[str]:
    text = dockerfile.read_text().replace("\\\n", " ")
    line = next(ln for ln in text.splitlines() if ln.startswith("ENTRYPOINT"))
    return json.loads(line.split(None, 1)[1])


def _pins() -> dict[str, str]:
    return dict(ln.split("==", 1) for ln in (REPO / "requirements.txt").read_text().splitlines()
                if "==" in ln and not ln.startswith("#"))


def test_the_compose_file_has_airflows_official_services_on_the_trainguard_images():
    c = _compose()
    services = c["services"]
    assert AIRFLOW_SERVICES | {"postgres", "s3", "redis"} <= set(services)
    airflow_image = c["x-airflow-common"]["image"]
    for name in AIRFLOW_SERVICES:
        assert services[name]["image"] == airflow_image, name
        assert services[name]["build"]["dockerfile"] == "docker/airflow.Dockerfile"
    assert [services[n]["command"] for n in ("airflow-apiserver", "airflow-scheduler", "airflow-dag-processor",
                                              "airflow-triggerer")] == ["api-server", "scheduler", "dag-processor",
                                                                        "triggerer"]
    # the scale-out profile as emulation/scaleout.py runs it: Celery with Redis, two workers, two schedulers,
    # psycopg 3 for both the metadata and the fleet database, every Airflow service after Redis is healthy
    env = c["x-airflow-common"]["environment"]
    assert env["AIRFLOW__CORE__EXECUTOR"] == "CeleryExecutor" and "profiles" not in services["redis"]
    assert services["airflow-worker"]["deploy"]["replicas"] == 2 == services["airflow-scheduler"]["deploy"]["replicas"]
    for key in ("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN_ASYNC", "TG_FLEET_URL"):
        assert env[key].startswith("postgresql+psycopg://"), key
    assert env["AIRFLOW__CELERY__RESULT_BACKEND"].startswith("db+postgresql+psycopg://")
    assert "psycopg[binary]" in _pins() and "apache-airflow-providers-celery" in _pins()
    assert c["x-airflow-common"]["depends_on"]["redis"]["condition"] == "service_healthy"
    # the images are the pinned Airflow and its Python
    first = (DOCKER / "airflow.Dockerfile").read_text().split("\nFROM ", 1)[1].split()[0]
    assert first == f"apache/airflow:{_pins()['apache-airflow']}-python3.11"
    node_from = (DOCKER / "node.Dockerfile").read_text().split("\nFROM ", 1)[1].split()[0]
    assert node_from.startswith("python:3.11")
    # each image installs its side of trainguard (its extra) under the pins; torch only on the node; no test tools
    for df, extra in (("airflow.Dockerfile", "control"), ("node.Dockerfile", "node")):
        text = (DOCKER / df).read_text()
        installs = " ".join(line for line in text.splitlines() if "pip install" in line)
        assert f'".[{extra}]" -c constraints.txt' in installs, df
        assert ("torch" in installs) == (extra == "node"), df
        assert "requirements" not in installs, df  # requirements.txt carries the examples' trainers
        if extra == "node":
            assert f'"torch=={_pins()["torch"]}"' in installs
        for src in re.findall(r"^COPY (?:--\S+ )*(\S+)", text, flags=re.M):
            assert (REPO / src).exists(), f"{df} copies {src}, which is not in the repository"
    # every service starts after what it needs; Airflow after its provisioning
    for name in AIRFLOW_SERVICES - {"airflow-init"}:
        assert services[name]["depends_on"]["airflow-init"]["condition"] == "service_completed_successfully"
    assert services["airflow-init"]["entrypoint"] == ["python", "/opt/trainguard/docker/provision.py"]


def test_ports_connections_and_settings_match_what_the_code_reads():
    from trainguard.emulation import standalone
    from trainguard.operators.checkpoints import S3Settings
    from trainguard.operators.control import ControlConfig

    c = _compose()
    services = c["services"]
    env = {k: _expand(str(v)) for k, v in c["x-airflow-common"]["environment"].items()}
    assert "8080:8080" in services["airflow-apiserver"]["ports"]
    assert env["AIRFLOW__CORE__EXECUTION_API_SERVER_URL"] == "http://airflow-apiserver:8080/execution/"
    # the note-setting connection points at the api-server, the S3 one at the store's port
    api = json.loads(env[f"AIRFLOW_CONN_{standalone.API_CONN.upper()}"])
    assert (api["host"], api["port"], api["conn_type"]) == ("airflow-apiserver", 8080, "http")
    # as the notes' own login (role user), whose password the provisioner writes into the passwords file
    assert api["login"] == standalone.NOTES_USER and f"{standalone.NOTES_USER}:user" in \
        env["AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS"].split(",")
    assert api["password"] == env["TG_NOTES_PASSWORD"]
    s3 = json.loads(env["AIRFLOW_CONN_TG_S3"])
    s3_port = services["s3"]["ports"][0].split(":")[1]
    assert s3["conn_type"] == "aws" and s3["extra"]["endpoint_url"] == f"http://s3:{s3_port}"
    assert s3["login"] == _expand(services["s3"]["environment"]["MINIO_ROOT_USER"])
    # the control plane reads the fleet database and the inventory where the compose file puts them
    cfg = ControlConfig.from_env(env)
    assert cfg.fleet_url == env["TG_FLEET_URL"] and cfg.inventory == env["TG_INVENTORY"]
    mounts = dict(v.split(":", 2)[:2][::-1] for v in c["x-airflow-common"]["volumes"])
    assert mounts[env["TG_CONTROL_HOME"]] == "fleet" and env["TG_INVENTORY"].startswith(env["TG_CONTROL_HOME"] + "/")
    assert mounts[str(provision.CONTROL_KEYS)] == "control-keys" and mounts[str(provision.HOST_KEYS)] == "host-keys"
    old = dict(os.environ)
    try:
        os.environ["TG_CHECKPOINT_S3_URL"] = env["TG_CHECKPOINT_S3_URL"]
        assert S3Settings.from_env().url == env["TG_CHECKPOINT_S3_URL"]
    finally:
        os.environ.clear()
        os.environ.update(old)
    # every bucket a URL names is one airflow-init creates
    buckets = set(env["TG_BUCKETS"].split(","))
    assert {re.match(r"s3://([^/]+)", env[k]).group(1) for k in ("TG_BUS_URL", "TG_CHECKPOINT_S3_URL")} <= buckets


def test_the_nodes_match_the_inventory_airflow_init_writes():
    c = _compose()
    services = c["services"]
    env = c["x-airflow-common"]["environment"]
    nodes = provision.parse_nodes(env["TG_NODES"])
    assert sorted(n for n, _ in nodes) == sorted(s for s in services if s.startswith("node-"))
    assert [r for _, r in nodes].count("standby") >= 2  # a hang evicts a pipeline of two machines
    entry = _entrypoint(DOCKER / "node.Dockerfile")
    keys_dir = str(Path(entry[entry.index("--authorized-keys") + 1]).parent)
    for name, _ in nodes:
        node = services[name]
        assert node["image"] == c["x-node"]["image"] and node["hostname"] == name
        assert node["environment"]["TG_MACHINE"] == name
        assert node["environment"]["TG_BUS_URL"] == env["TG_BUS_URL"]  # the agents publish where Airflow reads
        mounts = {v.split(":")[1]: v.split(":") for v in node["volumes"]}
        assert mounts[keys_dir][0] == "control-keys" and mounts[keys_dir][-1] == "ro"  # the public key only
        assert mounts[node["environment"]["TG_HOST_KEY_DIR"]][0] == "host-keys"
        assert mounts["/etc/trainguard"][0] == name  # its configuration and host key survive a restart
    used = {v.split(":")[0] for s in services.values() for v in s.get("volumes", [])}
    used |= {v.split(":")[0] for v in c["x-airflow-common"]["volumes"]}
    assert used <= set(c["volumes"]), used - set(c["volumes"])
    # the control plane's private key stays in the fleet volume, which no node mounts
    assert not any(v.startswith("fleet:") for n, _ in nodes for v in services[n]["volumes"])


def test_the_node_entrypoint_is_tg_node_up_in_the_foreground():
    from trainguard.node_tools.cli import build_parser

    entry = _entrypoint(DOCKER / "node.Dockerfile")
    assert entry[:2] == ["tg-node", "up"]
    ns = build_parser().parse_args(entry[1:])
    assert ns.command == "up" and ns.foreground and ns.sshd == "/usr/sbin/sshd"
    assert ns.config == "/etc/trainguard/node.json"


SPEC = cluster.ClusterSpec(name="tgdk", machines=1, standbys=0, subnet="10.213.19.0/24")


@pytest.mark.cluster
@pytest.mark.skipif(bool(can_namespace()), reason=can_namespace() or "ok")
def test_the_node_entrypoint_brings_a_machine_up_that_the_control_plane_reaches(tmp_path: Path):
    """The ENTRYPOINT, paths moved under a scratch folder, in a namespace of its own with the compose
    file's node environment; then ssh with the provisioner's inventory; then SIGTERM ends it all."""
    c = _compose()
    node_env = {k: _expand(str(v)) for k, v in c["services"]["node-0"]["environment"].items()}
    etc = tmp_path / "etc"
    entry = [str(etc / a[len("/etc/trainguard/"):]) if a.startswith("/etc/trainguard/") else a
             for a in _entrypoint(DOCKER / "node.Dockerfile")]
    entry[0] = str(Path(sys.executable).parent / "tg-node")
    entry[entry.index("--sshd") + 1] = cluster.ensure_openssh(lambda *_: None)
    host_keys = tmp_path / "host-keys"
    env = {**os.environ, **node_env, "TG_HOST_KEY_DIR": str(host_keys), "TG_WORKDIR": str(tmp_path / "disk"),
           "TG_BUS_URL": f"spool://{tmp_path / 'bus'}", "TG_NVML_BACKEND": "none"}
    env.pop("TG_NODE_CONFIG", None)
    # the control plane's key, as airflow-init hands it to the nodes
    (tmp_path / "fleet" / "keys").mkdir(parents=True)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "fleet/keys/id_ed25519")],
                   check=True)
    (etc / "keys").mkdir(parents=True)
    (etc / "keys" / "authorized_keys").write_text((tmp_path / "fleet/keys/id_ed25519.pub").read_text())
    state = tmp_path / "netns"
    cluster.down(state, name=SPEC.name, log=lambda *_: None)
    proc = None
    try:
        cluster._network_up(SPEC)
        cluster._namespace_up(SPEC, 0)
        proc = subprocess.Popen(["ip", "netns", "exec", SPEC.netns(0), *entry], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        assert proc.stdout is not None
        up = json.loads(proc.stdout.readline() or json.dumps({"error": proc.stderr.read() if proc.stderr else ""}))
        assert up.get("machine") == "node-0" and up["sshd_pid"] and up["agent_pid"], up
        # the configuration came from the environment; the host key was published for the provisioner
        cfg = json.loads((etc / "node.json").read_text())
        assert cfg["machine"] == "node-0" and cfg["bus_url"] == env["TG_BUS_URL"]
        assert (host_keys / "node-0.pub").read_text().strip() == up["host_key"]
        keys = provision.wait_host_keys(["node-0"], timeout_s=5, folder=host_keys)
        doc = provision.inventory_doc([("node-0", "active")], keys, bus_url=env["TG_BUS_URL"])
        doc["machines"][0]["address"] = SPEC.address(0)  # compose resolves node-0; here its namespace address
        doc["tg_node"] = entry[0]
        inv = Inventory.from_dict(doc)
        inv.path = tmp_path / "fleet" / "inventory.json"
        inv.save(inv.path)
        (inv.path.parent / "known_hosts").write_text("\n".join(known_hosts_lines(inv)) + "\n")
        res = transport_for(inv).run(inv.machines[0], [inv.tg_node, "info"], timeout=30)
        assert res.ok and res.json()["machine"] == "node-0", res.describe()
        # a wrong host key is refused: the provisioner's known_hosts is what makes it trusted
        other = tmp_path / "other.pub"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "other")], check=True)
        doc["machines"][0]["host_key"] = " ".join(other.read_text().split()[:2])
        bad = Inventory.from_dict(doc)
        bad.path = tmp_path / "fleet" / "bad.json"
        (tmp_path / "fleet" / "known_hosts").write_text("\n".join(known_hosts_lines(bad)) + "\n")
        assert not transport_for(bad).run(bad.machines[0], [inv.tg_node, "info"], timeout=30).ok
        # docker stop: SIGTERM to PID 1 ends sshd and the agent, and the entrypoint exits 0
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        wait_until(lambda: not procs.alive(up["sshd_pid"]) and not procs.alive(up["agent_pid"]), timeout=15,
                   what="sshd and the agent to end")
    finally:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        procs.terminate(procs.pids_with_env("TG_NODE_CONFIG", str(etc / "node.json")))
        cluster.down(state, name=SPEC.name, log=lambda *_: None)


def test_a_node_without_a_name_gets_a_one_line_refusal(tmp_path: Path):
    env = {k: v for k, v in os.environ.items() if k not in ("TG_NODE_CONFIG", "TG_MACHINE")}
    proc = subprocess.run([str(Path(sys.executable).parent / "tg-node"), "up", "--config",
                           str(tmp_path / "node.json")], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "set TG_MACHINE" in json.loads(proc.stdout)["error"]
    assert not (tmp_path / "node.json").exists()


def test_provision_refuses_a_bad_node_list_in_one_line():
    with pytest.raises(SystemExit, match="role must be active, standby or free"):
        provision.parse_nodes("node-0:boss")
    with pytest.raises(SystemExit, match="names no machine"):
        provision.parse_nodes(" , ")


def test_the_provisioner_adds_the_notes_login_to_the_passwords_file_and_keeps_what_is_there(tmp_path):
    path = tmp_path / "fleet" / "passwords.json"
    provision.passwords_file(path, {"tg_notes": "n1"})
    assert json.loads(path.read_text()) == {"tg_notes": "n1"} and path.stat().st_mode & 0o777 == 0o600
    path.write_text(json.dumps({"admin": "a", "tg_notes": "kept"}))  # the api-server added the admin's
    provision.passwords_file(path, {"tg_notes": "n2"})  # run again: nothing already there changes
    assert json.loads(path.read_text()) == {"admin": "a", "tg_notes": "kept"}

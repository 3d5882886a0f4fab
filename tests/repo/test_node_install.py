"""A training machine installed without the emulation (as the node image is: ``docker/node.Dockerfile`` leaves
``emulation/`` out) runs the agent and a guarded job, and a fault control file left on it changes nothing.

The install is real: the package is built from a copy of the source tree without ``emulation/`` into a fresh
virtual environment, non-editable, whose ``tg-node`` and ``torchrun`` run here. Only the third-party
dependencies (torch, psutil, ...) come from the development environment, through a path file."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

from tests import REPO
from trainguard.emulation.standalone import free_port

SOURCES = ("trainguard", "checkpoint", "node_tools", "operators", "dags")


@pytest.fixture(scope="module")
def bare_node(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A virtual environment with trainguard installed from a tree that has no ``emulation/``."""
    root = tmp_path_factory.mktemp("bare-node")
    src = root / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(REPO / name, src / name)
    for name in SOURCES:
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    uv = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")
    assert uv, "uv is part of the development environment (scripts/venv.sh)"
    venv = root / "venv"
    subprocess.run([uv, "venv", "-q", "--python", sys.executable, str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    # the dependencies only: this environment's site-packages after the new one's (whose trainguard comes first)
    (site / "zz_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([uv, "pip", "install", "-q", "--python", str(py), "--no-deps", "--no-build-isolation", str(src)],
                   check=True, timeout=300, capture_output=True)
    return venv


def _node(venv: Path, *argv: str, config: Path, timeout: float = 120) -> tuple[int, dict]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TG_", "VIRTUAL_ENV"))}
    env.update(TG_NODE_CONFIG=str(config), PATH=f"{venv / 'bin'}:{env.get('PATH', '')}")
    proc = subprocess.run([str(venv / "bin" / "tg-node"), *argv], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=venv.parent, check=False)
    return proc.returncode, json.loads(proc.stdout.strip().splitlines()[-1])


def _site(venv: Path) -> str:
    return next(str(p) for p in (venv / "lib").glob("python3*/site-packages"))


def _config(tmp_path: Path, venv: Path, name: str = "node.json", **extra: object) -> Path:
    # install_dir as tg-node up writes it on a node image: where the package is installed
    doc = {"machine": "m0", "workdir": str(tmp_path / "disk"), "install_dir": _site(venv), "gpus": 0,
           "nvml_backend": "none", "kmsg_path": str(tmp_path / "kmsg"),
           "bus_url": f"spool://{tmp_path / 'bus'}", **extra}
    (tmp_path / "kmsg").touch()
    (tmp_path / "disk").mkdir(exist_ok=True)
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return path


@pytest.mark.slow
def test_a_node_installed_without_the_emulation_runs_the_agent_and_a_guarded_job(bare_node: Path, tmp_path: Path):
    py = bare_node / "bin" / "python"
    probe = subprocess.run([str(py), "-c", (
        "import importlib.util, trainguard.node_tools, trainguard.torch;"
        "print(trainguard.node_tools.__file__);"
        "print(importlib.util.find_spec('trainguard.emulation') is None)")],
        capture_output=True, text=True, check=True, cwd=tmp_path)
    where, absent = probe.stdout.split()
    assert not where.startswith(str(REPO)) and absent == "True"  # the installed copy, and no emulation in it

    # a fault control file on the machine asks rank 0 for a NaN loss: without the emulation nothing applies it
    faults = tmp_path / "faults.json"
    faults.write_text(json.dumps({"faults": [{"id": "f1", "kind": "nan", "rank": 0, "params": {}}]}))
    config = _config(tmp_path, bare_node, fault_file=str(faults))

    code, doc = _node(bare_node, "agent", "--once", config=config)
    assert code == 0 and doc["machine"] == "m0" and doc["alerts"] == [], doc
    code, doc = _node(bare_node, "check", "all", config=config)
    assert code == 0 and doc["healthy"] is True, doc

    code, doc = _node(bare_node, "fault", "list", config=config)  # the emulation's command is not there
    assert code == 2 and "fault" in doc["error"], doc

    code, doc = _node(bare_node, "gpu", config=_config(tmp_path, bare_node, "gpu.json", nvml_backend="emulated"))
    assert code == 2 and "nvml_backend 'emulated' is not installed on this node" in doc["error"], doc

    user = tmp_path / "team"  # the team's own training script, in its own folder
    user.mkdir()
    shutil.copy2(REPO / "examples" / "plain" / "train.py", user / "train.py")
    code, started = _node(bare_node, "job", "start", "--job", "bare", "--nnodes", "1", "--node-rank", "0",
                          "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
                          "--entry", "train.py", "--workdir", str(user), "--",
                          "--steps", "6", "--batch", "8", "--width", "16", config=config)
    assert code == 0 and started["state"] == "running", started
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            code, status = _node(bare_node, "job", "status", "--job", "bare", config=config)
            if status["state"] != "running":
                break
            time.sleep(0.5)
        assert status["state"] == "exited" and status["returncode"] == 0, status
        code, steps = _node(bare_node, "job", "steps", "--job", "bare", "--rank", "0", config=config)
        records = steps["steps"]
        assert [r["step"] for r in records] == list(range(6)), records
        assert all(r.get("loss") is not None and r["loss"] == r["loss"] for r in records), records  # no NaN
        log_dir = Path(json.loads((Path(status["run_dir"]) / "job.json").read_text())["log_dir"])
        said = [p for p in log_dir.rglob("stderr.log") if "no fault points are installed" in p.read_text()]
        assert len(said) == 2, list(log_dir.rglob("*.log"))  # the file is named, ignored, and each rank says so
    finally:
        _node(bare_node, "job", "stop", "--job", "bare", "--grace-s", "5", config=config)

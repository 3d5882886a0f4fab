"""Shared fixtures: the emulated cluster (real namespaces and sshd) and waiting helpers."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from trainguard.emulation import cluster
from trainguard.emulation.standalone import free_port, poll
from trainguard.node_tools.inventory import Inventory


def pytest_configure(config: pytest.Config) -> None:
    """A run ended by SIGTERM (a CI job's time limit, ``timeout``, a kill) tears down as Ctrl-C does: the
    fixtures' Airflow, job processes and namespaces are removed, not left running for the next run to trip on
    (three Airflow standalones left by killed runs once put this host's load at 16)."""
    import signal

    def interrupt(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)

# A cluster of its own for the tests, so a demo cluster ("tg") on the same host is left alone.
TEST_CLUSTER = cluster.ClusterSpec(name="tgt", machines=6, standbys=2, subnet="10.213.9.0/24", disk_mb=64, gpus=8)


@pytest.fixture(scope="session", autouse=True)
def _no_saver_left_running(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Checkpoint saver processes outlive the jobs that start them (their memory snapshots serve the next
    start); the ones this session started end with it, and only those: a saver inherits this session's
    marker in its environment, or serves a root under this session's temporary directory (another session's
    or a real job's savers on the same host are left alone)."""
    import uuid

    import psutil

    marker = uuid.uuid4().hex
    os.environ["TG_TEST_SESSION"] = marker
    base = str(tmp_path_factory.getbasetemp())
    yield
    left = []
    for proc in psutil.process_iter(["cmdline"]):
        cmd = proc.info.get("cmdline") or []
        if "trainguard.checkpoint.saver" not in cmd:
            continue
        with contextlib.suppress(psutil.Error):
            root = cmd[cmd.index("--root") + 1] if "--root" in cmd[:-1] else ""
            if root.startswith(base) or proc.environ().get("TG_TEST_SESSION") == marker:
                proc.terminate()
                left.append(proc)
    psutil.wait_procs(left, timeout=10)
    for proc in left:
        with contextlib.suppress(psutil.Error):
            proc.kill()


def can_namespace() -> str:
    """Why the namespace cluster cannot run here, or "" if it can."""
    if os.geteuid() != 0:
        return "needs root for network namespaces"
    if not shutil.which("ip"):
        return "needs iproute2 ('ip')"
    return ""


def wait_until(predicate: Callable[[], Any], *, timeout: float, what: str, interval: float = 0.2) -> Any:
    """Poll ``predicate`` until it returns something truthy; fail the test with ``what`` otherwise."""
    try:
        return poll(predicate, timeout=timeout, what=what, interval=interval)
    except TimeoutError as exc:
        pytest.fail(str(exc))


def _state_dir() -> Path:
    """A folder for a cluster's state outside pytest's basetemp, which a concurrent pytest run may prune."""
    import tempfile

    return Path(tempfile.mkdtemp(prefix="tg-test-cluster-")) / "state"


@contextlib.contextmanager
def own_cluster(spec: cluster.ClusterSpec, prefix: str) -> Iterator[Inventory]:
    """A namespace cluster of a test module's own (its control plane's home beside its state), brought
    down at the end; ``TG_KEEP_TEST_STATE=1`` keeps the folder (fleet database, Airflow logs)."""
    reason = can_namespace()
    if reason:
        pytest.skip(reason)
    import tempfile

    state = Path(tempfile.mkdtemp(prefix=prefix)) / "state"
    cluster.down(state, name=spec.name, log=lambda *_: None)
    inv = cluster.up(spec, state, log=lambda *_: None)
    try:
        yield inv
    finally:
        cluster.down(state, name=spec.name, log=lambda *_: None)
        if os.environ.get("TG_KEEP_TEST_STATE"):
            print(f"kept {state.parent}")
        else:
            shutil.rmtree(state.parent, ignore_errors=True)


@pytest.fixture
def cluster_dir() -> Iterator[Path]:
    """State folder for a cluster made by one test; removed afterwards."""
    state = _state_dir()
    yield state
    shutil.rmtree(state.parent, ignore_errors=True)


@pytest.fixture(scope="session")
def ns_cluster() -> Iterator[Inventory]:
    """The 6-machine namespace cluster (4 active, 2 standby), brought down at the end."""
    reason = can_namespace()
    if reason:
        pytest.skip(reason)
    state_dir = _state_dir()
    cluster.down(state_dir, name=TEST_CLUSTER.name, log=lambda *_: None)  # leftovers of an aborted run
    inv = cluster.up(TEST_CLUSTER, state_dir, log=lambda *_: None)
    try:
        yield inv
    finally:
        cluster.down(state_dir, name=TEST_CLUSTER.name, log=lambda *_: None)
        shutil.rmtree(state_dir.parent, ignore_errors=True)


@pytest.fixture(scope="session")
def state_dir(ns_cluster: Inventory) -> Path:
    assert ns_cluster.path is not None
    return ns_cluster.path.parent


@contextlib.contextmanager
def moto_server(host: str = "127.0.0.1") -> Iterator[tuple[str, Any]]:
    """A real moto_server listening on ``host`` (loopback, or the cluster bridge's address so that the
    machines reach it too): ``(endpoint URL, process)``; ended by pid at the end."""
    import subprocess
    import sys
    import urllib.request

    port = free_port()
    server = Path(sys.executable).parent / "moto_server"
    proc = subprocess.Popen([str(server), "-H", host, "-p", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"http://{host}:{port}"

    def answers() -> bool:
        try:
            with urllib.request.urlopen(url, timeout=1):
                return True
        except OSError:
            return proc.poll() is not None and pytest.fail("moto_server exited at start")
    try:
        wait_until(answers, timeout=30, what="moto_server to answer")
        os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
        os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
        os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
        yield url, proc
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """A real moto_server on loopback: the S3 endpoint of the tests."""
    with moto_server() as (url, _proc):
        yield url



def load_script(name: str, path: Path) -> Any:
    """A script of the repository (``bench/``, ``scripts/``: not a package) as a module named ``name``."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def marked_bash_blocks(text: str) -> list[tuple[str, str, str]]:
    """The bash blocks of a docs page with their test marker: ``(kind, reason, body)``, where a block is preceded by
    ``<!-- test: KIND (REASON) -->`` (both empty when it has none)."""
    import re

    return re.findall(r"(?:<!-- test: (\w+) ?(\(.*?\))? -->\n)?```bash\n(.*?)```", text, flags=re.S)


def deploy_page_environment(env: dict[str, str], page: Path | None = None) -> tuple[dict[str, str], str]:
    """The environment docs/deploy.md's "Into an Airflow you run" leaves behind, and what its commands printed:
    its blocks marked ``<!-- test: runs -->`` run, as written, in one bash with ``env``; every other block of the
    section says why a test does not run it (``skip``; ``site``: the test's own values are in ``env`` already;
    ``starts``: the caller starts Airflow with what this returns)."""
    import subprocess

    text = (page or Path(__file__).resolve().parents[1] / "docs" / "deploy.md").read_text()
    section = text.split("## Into an Airflow you run", 1)[1].split("\n## ", 1)[0]
    blocks = marked_bash_blocks(section)
    assert blocks and all(mark in ("runs", "skip", "site", "starts") for mark, _, _ in blocks), \
        f"every bash block of the deploy page's section needs a test marker: {[m for m, _, _ in blocks]}"
    # the page's own output goes to stderr; stdout carries only the environment it leaves
    script = "exec 3>&1 1>&2\nset -euo pipefail\n" + "".join(b for m, _, b in blocks if m == "runs") + "env -0 >&3\n"
    done = subprocess.run(["bash", "-c", script], env=env, capture_output=True, timeout=600)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    pairs = (item.split("=", 1) for item in done.stdout.decode().split("\0") if "=" in item)
    return {k: v for k, v in pairs}, done.stderr.decode()

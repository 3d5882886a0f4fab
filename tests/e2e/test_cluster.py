"""The emulated cluster: real namespaces, real sshd, host keys verified, clean up and down."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tests.conftest import TEST_CLUSTER, can_namespace, wait_until
from trainguard.core import procs
from trainguard.core.errors import ClusterError
from trainguard.emulation import cluster
from trainguard.node_tools.inventory import Inventory
from trainguard.node_tools.transport import LocalTransport, SshTransport, transport_for

pytestmark = pytest.mark.cluster


def _netns_of(pid: int) -> int:
    return os.stat(f"/proc/{pid}/ns/net").st_ino


def test_every_machine_answers_over_ssh_from_its_own_namespace(ns_cluster: Inventory):
    assert ns_cluster.transport == "ssh"
    assert [m.role for m in ns_cluster.machines] == ["active"] * 4 + ["standby"] * 2
    transport = SshTransport(ns_cluster)
    results = transport.run_many(ns_cluster.machines, lambda m: [ns_cluster.tg_node, "info"], timeout=20)
    for m in ns_cluster.machines:
        res = results[m.name]
        assert res.ok, res.describe()
        info = res.json()
        assert info["machine"] == m.name
        assert info["netns"] == f"{TEST_CLUSTER.name}-{m.name}"
        # sshd really lives in the machine's namespace, and listens on the machine's address
        pid = int((Path(m.extra["machine_dir"]) / "sshd.pid").read_text())
        assert _netns_of(pid) == os.stat(f"/run/netns/{info['netns']}").st_ino
        assert _netns_of(pid) != _netns_of(os.getpid())


def test_each_machine_has_its_own_size_limited_disk(ns_cluster: Inventory):
    inodes = set()
    for m in ns_cluster.machines:
        st = os.statvfs(m.workdir)
        size_mb = st.f_blocks * st.f_frsize / 2**20
        assert size_mb == pytest.approx(TEST_CLUSTER.disk_mb, rel=0.01)
        inodes.add(os.stat(m.workdir).st_dev)
    assert len(inodes) == len(ns_cluster.machines)


def test_an_unknown_or_wrong_host_key_is_refused(ns_cluster: Inventory, tmp_path: Path):
    doc = ns_cluster.to_dict()
    m0, m1 = doc["machines"][:2]
    m0["host_key"] = m1["host_key"]  # m1's key claimed for m0
    inv = Inventory.from_dict(doc)
    inv.path = ns_cluster.path
    res = SshTransport(inv).run(inv.machine("m0"), ["true"], timeout=20)
    assert not res.reachable and res.returncode is None and res.extra["status"] == "host_key_mismatch"
    assert "another host key" in res.stderr, res.stderr
    # no key for the machine anywhere: refused too, never trusted on first use
    inv.machine("m0").host_key = ""
    inv.ssh = dict(inv.ssh, known_hosts=str(tmp_path / "known_hosts"))
    (tmp_path / "known_hosts").write_text("")
    res = SshTransport(inv).run(inv.machine("m0"), ["true"], timeout=20)
    assert not res.reachable and res.extra["status"] == "host_key_mismatch" and "no host key" in res.stderr
    # with its own key it answers
    assert SshTransport(ns_cluster).run(ns_cluster.machine("m0"), ["true"], timeout=20).ok


def test_sessions_to_a_machine_share_one_connection(ns_cluster: Inventory):
    m = ns_cluster.machines[1]
    listener = psutil.Process(int((Path(m.extra["machine_dir"]) / "sshd.pid").read_text()))
    before = {c.pid for c in listener.children()}  # each connection is a process under the machine's sshd
    transport = SshTransport(ns_cluster)
    assert transport.run(m, ["true"], timeout=20).ok
    held = {c.pid for c in listener.children()} - before
    assert len(held) == 1  # the session ended, its connection stays
    for _ in range(3):
        assert transport.run(m, ["true"], timeout=20).ok
    assert {c.pid for c in listener.children()} - before == held  # no new connection
    transport.close()
    wait_until(lambda: not {c.pid for c in listener.children()} & held, timeout=10, what="the connection to end")


def test_password_login_is_off(ns_cluster: Inventory):
    m = ns_cluster.machines[0]
    proc = subprocess.run(
        ["ssh", "-o", "BatchMode=yes", "-o", "PubkeyAuthentication=no", "-o", "StrictHostKeyChecking=yes",
         "-o", f"UserKnownHostsFile={ns_cluster.resolve('known_hosts')}", f"root@{m.address}", "true"],
        capture_output=True, text=True, timeout=20, check=False,
    )
    assert proc.returncode == 255 and "permission denied" in proc.stderr.lower()


def test_up_twice_changes_nothing(ns_cluster: Inventory, state_dir: Path):
    def sshd_pids():
        return [int((Path(m.extra["machine_dir"]) / "sshd.pid").read_text()) for m in ns_cluster.machines]

    before_pids, before = sshd_pids(), ns_cluster.to_dict()
    again = cluster.up(TEST_CLUSTER, state_dir, log=lambda *_: None)
    assert again.to_dict() == before
    assert sshd_pids() == before_pids


def test_up_repairs_a_dead_sshd(ns_cluster: Inventory, state_dir: Path):
    m = ns_cluster.machines[5]
    pid_file = Path(m.extra["machine_dir"]) / "sshd.pid"
    assert transport_for(ns_cluster).run(m, ["true"], timeout=15).ok  # a master connection is held now
    old = cluster.kill_sshd(Path(m.extra["machine_dir"]), signal.SIGTERM)  # with the connection it holds
    wait_until(lambda: not procs.alive(old), timeout=5, what="sshd to end")
    assert not transport_for(ns_cluster).run(m, ["true"], timeout=15).reachable
    cluster.up(TEST_CLUSTER, state_dir, log=lambda *_: None)
    assert int(pid_file.read_text()) != old
    assert transport_for(ns_cluster).run(m, ["true"], timeout=15).ok


def test_a_different_shape_is_refused_while_up(ns_cluster: Inventory, state_dir: Path):
    other = cluster.ClusterSpec(**{**TEST_CLUSTER.__dict__, "machines": 3, "standbys": 1})
    with pytest.raises(ClusterError, match="cluster down"):
        cluster.up(other, state_dir, log=lambda *_: None)


def _leftovers(name: str, state_dir: Path) -> list[str]:
    found = []
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    found += [line.split()[0] for line in ns.splitlines() if line.startswith(f"{name}-m")]
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=False).stdout
    found += [line.split(":")[1].strip() for line in links.splitlines()
              if line.split(":")[1].strip().split("@")[0] in {f"{name}br", *(f"{name}v{i}" for i in range(8))}]
    mounts = Path("/proc/mounts").read_text()
    found += [line.split()[1] for line in mounts.splitlines() if line.split()[1].startswith(str(state_dir))]
    return found


@pytest.mark.skipif(bool(can_namespace()), reason=can_namespace() or "ok")
def test_down_after_a_crash_removes_everything(cluster_dir: Path):
    spec = cluster.ClusterSpec(name="tgc", machines=2, standbys=0, subnet="10.213.10.0/24", disk_mb=16, gpus=1)
    state_dir = cluster_dir
    inv = cluster.up(spec, state_dir, log=lambda *_: None)
    try:
        # A stray process inside a machine, then the state is lost as in a crash of the host tool.
        sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
        stray = subprocess.Popen(["ip", "netns", "exec", "tgc-m1", *sleeper])
        wait_until(lambda: procs.alive(stray.pid), timeout=10, what="the stray process")
        (state_dir / "inventory.json").unlink()
        assert _leftovers("tgc", state_dir)
    finally:
        report = cluster.down(state_dir, name="tgc", log=lambda *_: None)
    stray.wait(timeout=10)
    assert stray.returncode is not None
    assert set(report["namespaces"]) == {"tgc-m0", "tgc-m1"}
    assert {"tgcbr"} <= set(report["links"])
    assert len(report["killed"]) >= 3  # two sshd and the stray
    assert _leftovers("tgc", state_dir) == []
    assert not state_dir.exists()
    assert all(not procs.alive(int(p)) for p in report["killed"])
    # and down again is a no-op
    again = cluster.down(state_dir, name="tgc", log=lambda *_: None)
    assert again["killed"] == [] and again["namespaces"] == [] and not again["removed"]
    assert inv.cluster == "tgc"


def test_local_transport_fallback(cluster_dir: Path):
    spec = cluster.ClusterSpec(name="tgl", machines=2, standbys=1, transport="local")
    messages: list[str] = []
    inv = cluster.up(spec, cluster_dir, log=messages.append)
    try:
        assert inv.transport == "local"
        assert isinstance(transport_for(inv), LocalTransport)
        res = transport_for(inv).run(inv.machine("m1"), [inv.tg_node, "info"], timeout=20)
        assert res.ok and res.json()["machine"] == "m1"
        with pytest.raises(Exception, match="no network namespace"):
            from trainguard.emulation import inject

            inject.inject(inv, "m0", "nic_down")
    finally:
        cluster.down(cluster_dir, name="tgl", log=lambda *_: None)
    assert not cluster_dir.exists()


@pytest.mark.parametrize(
    "argv,match",
    [
        (["cluster", "up", "--machines", "0"], "--machines 0 must be 1..1000"),
        (["cluster", "up", "--machines", "300"], "must be a private network with room for 300 machines"),
        (["cluster", "up", "--standbys", "6"], "--standbys 6 must be 0..5"),
        (["cluster", "up", "--name", "Bad_Name"], "cluster name 'Bad_Name'"),
        (["cluster", "up", "--subnet", "8.8.8.0/24"], "must be a private network"),
        (["inject", "--machine", "m0", "--fault", "hang"], "no inventory at"),
    ],
)
def test_cli_bad_input_is_one_line_and_exit_2(argv, match, tmp_path: Path):
    proc = subprocess.run(
        [sys.executable, "-m", "trainguard.operators.cli", "--state-dir", str(tmp_path / "none"), *argv],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and match in lines[0], proc.stderr
    assert not (tmp_path / "none").exists() or not any((tmp_path / "none").iterdir())


def _cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "trainguard.operators.cli", *argv], capture_output=True, text=True,
                          timeout=120, check=False)


def test_cli_refuses_a_malformed_inventory(tmp_path: Path):
    state = tmp_path / "state"
    state.mkdir()
    (state / "inventory.json").write_text('{"schema": 1, "machines": [{"name": "m0"}]}')
    proc = _cli("--state-dir", str(state), "inject", "--machine", "m0", "--fault", "hang")
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "needs at least 'name' and 'address'" in proc.stderr


@pytest.mark.parametrize(
    "topology,match",
    [
        ("tp=2,pp=2,dp=3", "needs 6 machines, but 4 were given"),
        ("tp=2,pp=2", "lacks dp"),
        ("tp=2,pp=0,dp=2", "pp=0 must be a positive integer"),
    ],
)
def test_cli_refuses_a_topology_that_does_not_fit(ns_cluster: Inventory, state_dir: Path, topology, match):
    proc = _cli("--state-dir", str(state_dir), "cluster", "job", "launch", "--job", "bad", "--topology", topology)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and match in proc.stderr
    # nothing was started anywhere
    assert not any((Path(m.workdir) / "jobs" / "bad").exists() for m in ns_cluster.machines)

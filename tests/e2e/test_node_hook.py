"""NodeHook (the Airflow face of trainguard.node_tools.transport.SshTransport: paramiko, host keys pinned, one held
connection per machine) against the namespace cluster's real sshd."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainguard.emulation import inject
from trainguard.node_tools.inventory import Inventory
from trainguard.node_tools.transport import SshCredentials
from trainguard.operators.hooks.node import NodeHook

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def test_fan_out_returns_each_machines_json(ns_cluster: Inventory, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("AIRFLOW_CONN_TG_SSH", raising=False)
    hook = NodeHook(ns_cluster)
    results = hook.run_many(ns_cluster.machines, ["info"], timeout_s=30)
    assert sorted(results) == sorted(m.name for m in ns_cluster.machines)
    for name, r in results.items():
        assert r.status == "ok" and r.exit_code == 0, r
        assert r.document["machine"] == name


def test_credentials_come_from_the_airflow_connection(ns_cluster: Inventory, monkeypatch: pytest.MonkeyPatch):
    key = str(ns_cluster.resolve(ns_cluster.ssh["identity_file"]))
    # trainguard's own connection type; one of the SSH provider's type "ssh" is read the same way
    monkeypatch.setenv("AIRFLOW_CONN_TG_SSH", json.dumps({"conn_type": "trainguard_ssh", "login": "root",
                                                           "extra": {"key_file": key}}))
    hook = NodeHook(ns_cluster)
    assert hook.credentials() == SshCredentials("root", key, None)
    assert hook.run("m0", ["info"]).status == "ok"
    monkeypatch.setenv("AIRFLOW_CONN_TG_SSH", json.dumps({"conn_type": "ssh", "login": "nobody-here",
                                                           "extra": {"key_file": key}}))
    refused = NodeHook(ns_cluster).run("m0", ["info"])
    assert refused.status == "unreachable" and "Authentication" in refused.stderr
    # the key's text in the connection (a secrets backend's way: nothing on disk), not a file
    text = Path(key).read_text()
    monkeypatch.setenv("AIRFLOW_CONN_TG_SSH", json.dumps({"conn_type": "trainguard_ssh", "login": "root",
                                                           "extra": {"private_key": text}}))
    hook = NodeHook(ns_cluster)
    assert hook.credentials().key_text == text
    assert hook.run("m0", ["info"]).status == "ok"
    monkeypatch.setenv("AIRFLOW_CONN_TG_SSH", json.dumps({"conn_type": "trainguard_ssh", "login": "root",
                                                           "extra": {"private_key": "not a key"}}))
    bad = NodeHook(ns_cluster).run("m0", ["info"])
    assert bad.status == "unreachable" and "private_key extra" in bad.stderr


def test_a_machine_with_another_host_key_is_refused(ns_cluster: Inventory, tmp_path: Path):
    doc = ns_cluster.to_dict()
    keys = {m["name"]: m["host_key"] for m in doc["machines"]}
    for m in doc["machines"]:
        if m["name"] == "m0":
            m["host_key"] = keys["m1"]  # each machine has its own generated key
    doc["ssh"]["identity_file"] = str(ns_cluster.resolve(ns_cluster.ssh["identity_file"]))
    path = tmp_path / "inventory.json"
    path.write_text(json.dumps(doc))
    hook = NodeHook(Inventory.load(path), ssh_conn_id=None)
    r = hook.run("m0", ["info"])
    assert r.status == "host_key_mismatch" and "refused" in r.stderr
    assert hook.run("m1", ["info"]).status == "ok"


def test_unreachable_and_slow_machines_are_explicit_results(ns_cluster: Inventory):
    hook = NodeHook(ns_cluster, ssh_conn_id=None, connect_timeout_s=2, connect_attempts=1)
    inject.inject(ns_cluster, "m5", "nic_down")
    try:
        results = hook.run_many(["m4", "m5"], ["info"], timeout_s=10)
    finally:
        inject.clear(ns_cluster, "m5", "nic_down")
    assert results["m4"].status == "ok"
    assert results["m5"].status == "unreachable" and results["m5"].seconds < 10, results["m5"]
    slow = hook.run("m4", ["diag", "--level", "2"], timeout_s=1)
    assert slow.status == "timeout" and slow.seconds < 5, slow
    assert hook.run("m5", ["info"]).status == "ok"  # back once the link is up


def test_one_connection_per_machine_is_held_and_opened_again_once_it_broke(ns_cluster: Inventory):
    """Every command after the first opens a channel on the machine's held connection (no new handshake);
    a connection that broke meanwhile (closed under the hook, as a restarted sshd or a rebooted machine
    leaves it) is opened again before the next command runs, and the command runs once."""
    hook = NodeHook(ns_cluster, ssh_conn_id=None)
    m0 = ns_cluster.machine("m0")
    try:
        assert hook.run(m0, ["info"]).status == "ok"
        held = hook.connection(m0).get_transport()
        assert [hook.run(m0, ["info"]).status for _ in range(3)] == ["ok"] * 3
        assert hook.connection(m0).get_transport() is held  # the same connection all along
        held.close()  # it breaks under the hook
        again = hook.run(m0, ["info"])
        assert again.status == "ok" and again.document["machine"] == "m0"
        assert hook.connection(m0).get_transport() is not held and hook.connection(m0).get_transport().is_active()
    finally:
        hook.close()
    assert not held.is_active()


def test_a_machine_whose_network_dies_mid_command_is_given_up_in_seconds(ns_cluster: Inventory, tmp_path: Path):
    """A command runs on the held connection when the machine's link goes down (a standby's NIC dying as it is
    swapped in): the hook answers "unreachable" within seconds of the link's loss (keepalives, the kernel's limit
    on unacknowledged data), not after the command's own timeout."""
    import threading
    import time

    from tests.conftest import wait_until
    from trainguard.node_tools.transport import DEAD_PEER_S

    hook = NodeHook(ns_cluster, ssh_conn_id=None, connect_timeout_s=2, connect_attempts=1)
    m5 = ns_cluster.machine("m5")
    marker = tmp_path / "running"
    out: dict = {}
    try:
        assert hook.run(m5, ["info"]).status == "ok"  # the connection is held
        worker = threading.Thread(target=lambda: out.update(r=hook.exec(m5, ["sh", "-c", f"touch {marker}; sleep 50"],
                                                                        timeout_s=60)))
        worker.start()
        wait_until(marker.exists, timeout=30, what="the command to run on m5")
        lost = time.monotonic()
        inject.inject(ns_cluster, "m5", "nic_down")
        try:
            worker.join(timeout=40)
            given_up = time.monotonic() - lost
        finally:
            inject.clear(ns_cluster, "m5", "nic_down")
        assert not worker.is_alive(), "the command was still waited for 40 s after the link went down"
        assert not out["r"].reachable and not out["r"].timed_out, out["r"]
        assert given_up < DEAD_PEER_S + 6, given_up
        assert hook.run(m5, ["info"]).status == "ok"  # a new connection once the link is back
    finally:
        hook.close()

"""Inventory validation, and what the SSH transport trusts and sends."""

from __future__ import annotations

import json
import os
import shlex
import types

import pytest

from trainguard.core.errors import InventoryError
from trainguard.node_tools.inventory import Inventory
from trainguard.node_tools.transport import SshTransport, known_hosts_lines

KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIHc2m0VvCq6S7yJ7w0QpR0Zt3xGk0b8h8m3c8c8c8c8c"


def doc(**over):
    d = {
        "schema": 1,
        "cluster": "c1",
        "transport": "ssh",
        "ssh": {"user": "root", "identity_file": "keys/id", "known_hosts": "known_hosts"},
        "machines": [
            {"name": "m0", "address": "10.0.0.10", "role": "active", "host_key": KEY},
            {"name": "m1", "address": "node-1.example", "port": 2222, "role": "standby", "host_key": KEY},
        ],
    }
    d.update(over)
    return d


def test_round_trip(tmp_path):
    inv = Inventory.from_dict(doc())
    path = inv.save(tmp_path / "inv.json")
    back = Inventory.load(path)
    assert [m.name for m in back.machines] == ["m0", "m1"]
    assert back.machine("m1").port == 2222
    assert [m.name for m in back.by_role("standby")] == ["m1"]
    assert back.resolve("keys/id") == tmp_path / "keys/id"


@pytest.mark.parametrize(
    "change,match",
    [
        ({"schema": 9}, "schema 9 is not supported"),
        ({"transport": "telnet"}, "transport 'telnet' is unknown"),
        ({"machines": []}, "non-empty list"),
        ({"machines": [{"name": "m0"}]}, "needs at least 'name' and 'address'"),
        ({"machines": [{"name": "m0", "address": "10.0.0.1", "host_key": KEY, "colour": "red"}]}, "unknown field"),
        ({"machines": [{"name": "m0", "address": "10.0.0.1", "host_key": KEY}] * 2}, "appears twice"),
        ({"machines": [{"name": "m0", "address": "10.0.0.1"}]}, "host_key is required"),
        ({"machines": [{"name": "m0", "address": "10.0.0.1", "host_key": "hello"}]}, "must look like"),
        ({"machines": [{"name": "m0", "address": "10.0.0.1", "host_key": KEY, "role": "boss"}]}, "role 'boss'"),
        ({"machines": [{"name": "m0", "address": "a b", "host_key": KEY}]}, "neither an IP address"),
        ({"machines": [{"name": "m0; rm -rf /", "address": "10.0.0.1", "host_key": KEY}]}, "must be letters"),
        ({"machines": [{"name": "m0", "address": "10.0.0.1", "host_key": KEY, "port": 0}]}, "port 0"),
        ({"ssh": {"connect_timeout_s": 0}}, "connect_timeout_s 0 must be a number of seconds > 0"),
    ],
)
def test_malformed_inventories_are_refused_with_one_line(change, match):
    with pytest.raises(InventoryError, match=match) as info:
        Inventory.from_dict(doc(**change))
    assert "\n" not in str(info.value)


def test_load_reports_missing_and_broken_files(tmp_path):
    with pytest.raises(InventoryError, match="trainguard cluster up"):
        Inventory.load(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(InventoryError, match="not valid JSON"):
        Inventory.load(bad)


def test_unknown_machine_lists_known_ones():
    with pytest.raises(InventoryError, match="m0, m1"):
        Inventory.from_dict(doc()).machine("m7")


class _Channel:
    """What a paramiko channel is asked to run: the command line and the environment, nothing else."""

    def __init__(self) -> None:
        self.command: str | None = None
        self.env: dict[str, str] | None = None
        self._r, self._w = os.pipe()

    def fileno(self) -> int:
        return self._r

    def update_environment(self, env: dict[str, str]) -> None:
        self.env = env

    def exec_command(self, command: str) -> None:
        self.command = command

    def shutdown_write(self) -> None:
        pass

    def recv_ready(self) -> bool:
        return False

    recv_stderr_ready = recv_ready

    def exit_status_ready(self) -> bool:
        return True

    def recv_exit_status(self) -> int:
        return 0

    def get_transport(self):
        return types.SimpleNamespace(is_active=lambda: True)

    def close(self) -> None:
        os.close(self._r)
        os.close(self._w)


def test_every_argument_reaches_the_remote_shell_quoted_and_secrets_go_in_the_session(tmp_path, monkeypatch):
    inv = Inventory.from_dict(doc())
    inv.path = tmp_path / "inventory.json"
    transport = SshTransport(inv)
    channel = _Channel()
    monkeypatch.setattr(transport, "_channel", lambda machine, fresh=False: channel)
    nasty = "job; touch /tmp/pwned $(id)"
    argv = ["tg-node", "job", "status", "--job", nasty]
    res = transport.run(inv.machine("m1"), argv, env={"AWS_SECRET_ACCESS_KEY": "s3cr3t"})
    assert res.ok, res.describe()
    assert shlex.split(channel.command) == argv  # one argument each, whatever the shell would make of it
    assert "s3cr3t" not in channel.command and channel.env == {"AWS_SECRET_ACCESS_KEY": "s3cr3t"}


def _host_key() -> tuple[str, object]:
    import paramiko

    key = paramiko.RSAKey.generate(1024)
    return f"{key.get_name()} {key.get_base64()}", key


def test_a_machine_is_trusted_only_with_its_own_key_never_on_first_use(tmp_path):
    import paramiko

    from trainguard.node_tools.transport import Unreachable

    pinned, key = _host_key()
    listed, other = _host_key()
    inv = Inventory.from_dict(doc(machines=[
        {"name": "m0", "address": "10.0.0.10", "role": "active", "host_key": pinned},
        {"name": "m1", "address": "node-1.example", "port": 2222, "role": "standby", "host_key": KEY},
    ]))
    inv.path = tmp_path / "inventory.json"
    transport = SshTransport(inv)
    client = paramiko.SSHClient()
    transport._trusted(client, inv.machine("m0"))  # the inventory's key for the machine
    assert client.get_host_keys().lookup("10.0.0.10")[key.get_name()] == key
    # a machine without a key of its own in the inventory: its entry in the inventory's known_hosts file
    m1 = inv.machine("m1")
    m1.host_key = ""
    (tmp_path / "known_hosts").write_text(f"[node-1.example]:2222 {listed}\n")
    client = paramiko.SSHClient()
    transport._trusted(client, m1)
    assert client.get_host_keys().lookup("[node-1.example]:2222")[other.get_name()] == other
    # ... and none there: refused before a connection is made
    (tmp_path / "known_hosts").write_text("10.0.0.10 " + listed + "\n")
    with pytest.raises(Unreachable, match="no host key") as refused:
        transport._trusted(paramiko.SSHClient(), m1)
    assert refused.value.status == "host_key_mismatch"


def test_known_hosts_lines_carry_ports():
    lines = known_hosts_lines(Inventory.from_dict(doc()))
    assert lines[0] == f"10.0.0.10 {KEY}"
    assert lines[1] == f"[node-1.example]:2222 {KEY}"


def test_local_inventory_needs_no_host_keys(tmp_path):
    d = doc(transport="local", machines=[{"name": "m0", "address": "127.0.0.1"}])
    (tmp_path / "i.json").write_text(json.dumps(d))
    assert Inventory.load(tmp_path / "i.json").transport == "local"

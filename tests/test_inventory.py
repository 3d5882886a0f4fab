"""Inventory validation and the ssh command the transport builds."""

from __future__ import annotations

import json
import os
import shlex

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
        ({"ssh": {"control_persist_s": "2m"}}, "control_persist_s '2m' must be whole seconds"),
        ({"ssh": {"control_persist_s": -1}}, "control_persist_s -1"),
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


def test_ssh_command_verifies_host_keys_and_quotes_every_argument(tmp_path):
    inv = Inventory.from_dict(doc())
    inv.path = tmp_path / "inventory.json"
    nasty = "job; touch /tmp/pwned $(id)"
    argv, _ = SshTransport(inv).command(inv.machine("m1"), ["tg-node", "job", "status", "--job", nasty])
    assert "StrictHostKeyChecking=yes" in argv
    assert f"UserKnownHostsFile={tmp_path / 'known_hosts'}" in argv
    assert argv[argv.index("-p") + 1] == "2222"
    remote = argv[-1]
    assert shlex.split(remote) == ["tg-node", "job", "status", "--job", nasty]


def test_known_hosts_lines_carry_ports():
    lines = known_hosts_lines(Inventory.from_dict(doc()))
    assert lines[0] == f"10.0.0.10 {KEY}"
    assert lines[1] == f"[node-1.example]:2222 {KEY}"


def test_local_inventory_needs_no_host_keys(tmp_path):
    d = doc(transport="local", machines=[{"name": "m0", "address": "127.0.0.1"}])
    (tmp_path / "i.json").write_text(json.dumps(d))
    assert Inventory.load(tmp_path / "i.json").transport == "local"


def _mux(argv: list[str]) -> dict[str, str]:
    opts = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "-o"]
    return dict(o.split("=", 1) for o in opts if o.startswith("Control"))


def _inventory(tmp_path, known_hosts: str, **ssh):
    inv = Inventory.from_dict(doc(ssh={**doc()["ssh"], **ssh}))
    inv.path = tmp_path / "inventory.json"
    (tmp_path / "known_hosts").write_text(known_hosts)
    return inv


def test_sessions_share_a_master_connection_only_with_the_same_trust(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    inv = _inventory(tmp_path, "\n".join(known_hosts_lines(Inventory.from_dict(doc()))))
    mux = _mux(SshTransport(inv).command(inv.machine("m0"), ["true"])[0])
    folder = tmp_path / f"tg-ssh-{os.getuid()}"
    assert mux["ControlMaster"] == "auto" and mux["ControlPath"].startswith(f"{folder}/")
    assert folder.stat().st_mode & 0o777 == 0o700
    assert int(mux["ControlPersist"]) > 0
    # another host key for the machine (it was reinstalled): the old master is not used
    (tmp_path / "known_hosts").write_text(f"10.0.0.10 {KEY[:-4]}AAAA\n")
    other = _mux(SshTransport(inv).command(inv.machine("m0"), ["true"])[0])
    assert other["ControlPath"] != mux["ControlPath"]
    # another key to log in with: neither
    inv.ssh["identity_file"] = "keys/other"
    assert _mux(SshTransport(inv).command(inv.machine("m0"), ["true"])[0])["ControlPath"] != other["ControlPath"]


def test_no_master_connection_when_turned_off_or_the_socket_folder_is_not_private(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    inv = _inventory(tmp_path, "", control_persist_s=0)
    assert _mux(SshTransport(inv).command(inv.machine("m0"), ["true"])[0]) == {}
    inv.ssh["control_persist_s"] = 60
    folder = tmp_path / f"tg-ssh-{os.getuid()}"
    folder.mkdir(mode=0o755)
    folder.chmod(0o755)  # others may enter: another user could stand a socket of theirs there
    assert _mux(SshTransport(inv).command(inv.machine("m0"), ["true"])[0]) == {}
    folder.rmdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    folder.symlink_to(elsewhere)  # a link planted in its place
    argv, _ = SshTransport(inv).command(inv.machine("m0"), ["true"])
    assert _mux(argv) == {} and "StrictHostKeyChecking=yes" in argv

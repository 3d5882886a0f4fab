"""The inventory: the machines trainguard may use, how to reach them, and their roles.

An inventory is one JSON document. The emulated cluster writes one at
``<state_dir>/inventory.json``; a real fleet writes its own in the same format::

    {
      "schema": 1,
      "cluster": "tg",
      "transport": "ssh",                      # or "local" (processes on this host)
      "ssh": {"user": "root", "identity_file": "keys/id_ed25519",
              "known_hosts": "known_hosts", "connect_timeout_s": 5},
      "tg_node": "/opt/trainguard/.venv/bin/tg-node",
      "bus_url": "spool:///shared/trainguard/bus",   # where the agents publish alerts
      "machines": [
        {"name": "m0", "address": "10.213.7.10", "port": 22, "role": "active",
         "host_key": "ssh-ed25519 AAAA...", "workdir": "/var/lib/trainguard", "gpus": 8}
      ]
    }

Relative paths in ``ssh`` are relative to the inventory file's folder. Host keys
are required for the ssh transport: a machine whose key is unknown is refused,
never trusted on first use.
"""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from trainguard.core.errors import InventoryError
from trainguard.core.files import write_json_atomic

SCHEMA_VERSION = 1
ROLES = ("active", "standby", "free", "evicted")
TRANSPORTS = ("ssh", "local")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
_KEY_RE = re.compile(r"^(ssh-ed25519|ssh-rsa|ecdsa-sha2-nistp(256|384|521)) [A-Za-z0-9+/=]+$")


@dataclass
class Machine:
    """One machine of the inventory.

    Attributes:
        name: unique name (letters, digits, ``-_.``), used everywhere to refer to it.
        address: IP address or DNS name that ssh connects to.
        port: ssh port.
        role: "active" (runs the job), "standby" (warm spare), "free", "evicted".
        host_key: the machine's ssh host public key ("ssh-ed25519 AAAA..."); required for ssh.
        workdir: the machine's local working directory (checkpoints, logs, run dirs).
        gpus: GPUs the machine is expected to have (0 for CPU-only machines).
        extra: emulated-cluster details (namespace, node config path ...), opaque to others.
    """

    name: str
    address: str
    port: int = 22
    role: str = "active"
    host_key: str = ""
    workdir: str = ""
    gpus: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


#: machine names an unknown-machine error lists before it says how many more there are
_NAMES_IN_ERRORS = 20


@dataclass(frozen=True, eq=False)
class _NameIndex:
    """Where each name first appears in one machine list, as that list was when indexed."""

    machines: list[Machine]  # the list indexed (kept, so that its identity cannot be reused)
    snapshot: list[Machine]  # a copy of it then
    positions: dict[str, int]
    names: frozenset[str]

    @classmethod
    def of(cls, machines: list[Machine]) -> _NameIndex:
        positions: dict[str, int] = {}
        for at, m in enumerate(machines):
            positions.setdefault(m.name, at)
        return cls(machines=machines, snapshot=list(machines), positions=positions, names=frozenset(positions))


@dataclass
class Inventory:
    cluster: str
    transport: str
    machines: list[Machine]
    ssh: dict[str, Any] = field(default_factory=dict)
    tg_node: str = "tg-node"
    bus_url: str = ""
    path: Path | None = None

    # ---- lookup ----------------------------------------------------------------------
    def machine(self, name: str) -> Machine:
        """The first machine called ``name``, in O(1) on average. Follows every change to ``machines``
        (appended, removed or replaced machines, a new list, a machine renamed in place)."""
        index = self._name_index()
        machines = self.machines
        at = index.positions.get(name)
        if at is None or at >= len(machines) or machines[at].name != name:  # unknown, or the list changed
            at = self._name_index(rebuild=True).positions.get(name)
        if at is not None:
            return machines[at]
        known = ", ".join(m.name for m in machines[:_NAMES_IN_ERRORS]) or "none"
        if len(machines) > _NAMES_IN_ERRORS:
            known += f" and {len(machines) - _NAMES_IN_ERRORS} more"
        raise InventoryError(f"unknown machine {name!r}; the inventory has: {known}")

    def named(self, names: Iterable[str]) -> list[Machine]:
        """The machines called ``names``, in that order (an unknown name: :meth:`machine`'s one-line error)."""
        return [self.machine(n) for n in names]

    def by_role(self, role: str) -> list[Machine]:
        return [m for m in self.machines if m.role == role]

    def names(self) -> frozenset[str]:
        """The names of every machine of the inventory, as a read-only set. Follows every change to the
        ``machines`` list (not a machine renamed in place: a name is a machine's identity) at the cost of one
        comparison of the list with its indexed copy (identity checks, no Python loop)."""
        index = self._name_index()
        if index.snapshot != self.machines:  # machines appended, removed or replaced since it was indexed
            index = self._name_index(rebuild=True)
        return index.names

    def _name_index(self, *, rebuild: bool = False) -> _NameIndex:
        """The index of ``machines`` by name, rebuilt when asked or when ``machines`` is another list."""
        index: _NameIndex | None = self.__dict__.get("_index")
        if rebuild or index is None or index.machines is not self.machines:
            index = _NameIndex.of(self.machines)
            self.__dict__["_index"] = index  # one assignment: readers see the old index or the new one
        return index

    def resolve(self, relative: str) -> Path:
        """A path from the ``ssh`` section, relative to the inventory's folder."""
        p = Path(relative)
        if p.is_absolute() or self.path is None:
            return p
        return self.path.parent / p

    # ---- (de)serialisation -----------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA_VERSION,
            "cluster": self.cluster,
            "transport": self.transport,
            "ssh": self.ssh,
            "tg_node": self.tg_node,
            "bus_url": self.bus_url,
            "machines": [asdict(m) for m in self.machines],
        }

    def save(self, path: Path | None = None) -> Path:
        target = Path(path or self.path or "inventory.json")
        write_json_atomic(target, self.to_dict(), indent=2)
        self.path = target
        return target

    @classmethod
    def load(cls, path: Path) -> Inventory:
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise InventoryError(
                f"no inventory at {path}; bring the emulated cluster up with 'trainguard cluster up' "
                f"or pass --inventory FILE"
            ) from None
        except OSError as exc:
            raise InventoryError(f"cannot read inventory {path}: {exc.strerror}") from None
        try:
            document = json.loads(text)
        except ValueError as exc:
            raise InventoryError(f"inventory {path} is not valid JSON ({exc}); fix or regenerate it") from None
        inv = cls.from_dict(document, source=str(path))
        inv.path = path
        return inv

    @classmethod
    def from_dict(cls, document: Any, *, source: str = "inventory") -> Inventory:
        def bad(what: str) -> InventoryError:
            return InventoryError(f"{source}: {what}")

        if not isinstance(document, dict):
            raise bad("top level must be a JSON object")
        schema = document.get("schema")
        if schema != SCHEMA_VERSION:
            raise bad(f"schema {schema!r} is not supported; this trainguard reads schema {SCHEMA_VERSION}")
        transport = document.get("transport", "ssh")
        if transport not in TRANSPORTS:
            raise bad(f"transport {transport!r} is unknown; use one of {', '.join(TRANSPORTS)}")
        cluster = document.get("cluster", "cluster")
        if not isinstance(cluster, str) or not _NAME_RE.match(cluster):
            raise bad(f"cluster name {cluster!r} must be letters, digits and -_.")
        raw_machines = document.get("machines")
        if not isinstance(raw_machines, list) or not raw_machines:
            raise bad("'machines' must be a non-empty list")
        machines: list[Machine] = []
        seen: set[str] = set()
        allowed = {f for f in Machine.__dataclass_fields__}
        for i, raw in enumerate(raw_machines):
            where = f"machines[{i}]"
            if not isinstance(raw, dict):
                raise bad(f"{where} must be an object")
            unknown = sorted(set(raw) - allowed)
            if unknown:
                raise bad(f"{where} has unknown field(s) {', '.join(unknown)}")
            try:
                m = Machine(**raw)
            except TypeError:
                raise bad(f"{where} needs at least 'name' and 'address'") from None
            if not isinstance(m.name, str) or not _NAME_RE.match(m.name):
                raise bad(f"{where}.name {m.name!r} must be letters, digits and -_.")
            if m.name in seen:
                raise bad(f"machine name {m.name!r} appears twice")
            seen.add(m.name)
            where = f"machine {m.name}"
            if not isinstance(m.address, str) or not m.address:
                raise bad(f"{where}: address must be a non-empty string")
            if not _is_host(m.address):
                raise bad(f"{where}: address {m.address!r} is neither an IP address nor a host name")
            if not isinstance(m.port, int) or not 0 < m.port < 65536:
                raise bad(f"{where}: port {m.port!r} must be 1..65535")
            if m.role not in ROLES:
                raise bad(f"{where}: role {m.role!r} is unknown; use one of {', '.join(ROLES)}")
            if not isinstance(m.gpus, int) or m.gpus < 0:
                raise bad(f"{where}: gpus {m.gpus!r} must be a whole number >= 0")
            if transport == "ssh":
                if not m.host_key:
                    raise bad(f"{where}: host_key is required for the ssh transport (host keys are verified)")
                if not _KEY_RE.match(m.host_key.strip()):
                    raise bad(f"{where}: host_key must look like 'ssh-ed25519 AAAA...'")
            machines.append(m)
        ssh = document.get("ssh", {})
        if not isinstance(ssh, dict):
            raise bad("'ssh' must be an object")
        timeout = ssh.get("connect_timeout_s", 5)
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
            raise bad(f"ssh.connect_timeout_s {timeout!r} must be a number of seconds > 0")
        tg_node = document.get("tg_node", "tg-node")
        if not isinstance(tg_node, str) or not tg_node:
            raise bad("'tg_node' must be the path of the tg-node command on the machines")
        bus_url = document.get("bus_url", "")
        if not isinstance(bus_url, str):
            raise bad("'bus_url' must be a string like spool:///dir or s3://bucket/prefix")
        return cls(cluster=cluster, transport=transport, machines=machines, ssh=ssh, tg_node=tg_node,
                   bus_url=bus_url)


def _is_host(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        return bool(re.match(r"^[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?$", text))

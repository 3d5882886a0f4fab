"""``NodeHook``: run ``tg-node`` on fleet machines over SSH, get JSON back: the Airflow face of
:class:`trainguard.node_tools.transport.SshTransport`, the one SSH path of trainguard (host keys pinned from the
inventory, never trusted on first use; one held connection per machine; a dead peer given up in seconds).

The user and private key come from the Airflow connection ``ssh_conn_id`` (default ``tg_ssh``: login and the
``key_file`` or ``private_key`` extra) when it exists, else from the inventory's ``ssh`` section; a first
connection is tried ``connect_attempts`` times. The hook holds one transport (and so one connection per machine)
for its life: a task's, or a triggerer's for the hooks it shares; :meth:`NodeHook.close` ends them.

Every call returns a result per machine, never raises for a machine that is down: ``unreachable`` (no TCP/SSH
session in ``connect_timeout_s``), ``host_key_mismatch``, ``timeout`` (the command ran past ``timeout_s``; the
channel is closed), or the command's exit code and parsed JSON.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from airflow.sdk import BaseHook

from trainguard.node_tools.inventory import Inventory, Machine
from trainguard.node_tools.transport import FANOUT, RunResult, SshCredentials, Transport, transport_for
from trainguard.operators.provider_info import CONN_TYPE

DEFAULT_CONN_ID = "tg_ssh"


@dataclass
class NodeResult:
    """What one machine answered."""

    machine: str
    status: str  # ok, failed (non-zero exit), unreachable, host_key_mismatch, timeout, bad_output
    exit_code: int | None = None
    document: Any = None
    stderr: str = ""
    seconds: float = 0.0

    @property
    def reachable(self) -> bool:
        return self.status in ("ok", "failed", "bad_output")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class NodeHook(BaseHook):
    """Runs ``tg-node`` commands on the machines of an inventory, over one held connection per machine.

    :param inventory: the fleet's inventory (or its path)
    :param ssh_conn_id: the Airflow connection with the login and key (None: the inventory's settings)
    :param connect_timeout_s: seconds to wait for a TCP connection, the SSH banner and authentication
    :param connect_attempts: tries of a first connection to a machine (3 to 5 s apart)
    :param max_parallel: the most machines :meth:`run_many` talks to at once
    """

    conn_name_attr = "ssh_conn_id"
    default_conn_name = DEFAULT_CONN_ID
    # a type of its own (registered by trainguard.operators.provider_info), not the SSH provider's "ssh"; a
    # connection of type "ssh" works as well: only its login and the extra's key_file or private_key are read
    conn_type = CONN_TYPE
    hook_name = "trainguard machines (SSH)"

    def __init__(self, inventory: Inventory | str | Path, *, ssh_conn_id: str | None = DEFAULT_CONN_ID,
                 connect_timeout_s: float = 5.0, connect_attempts: int = 2, max_parallel: int = FANOUT) -> None:
        super().__init__()
        self.inventory = inventory if isinstance(inventory, Inventory) else Inventory.load(Path(inventory))
        self.ssh_conn_id = ssh_conn_id
        self.connect_timeout_s = connect_timeout_s
        self.connect_attempts = max(1, int(connect_attempts))
        self.max_parallel = max_parallel

    def credentials(self) -> SshCredentials:
        """The login: the Airflow connection's when it exists, else the inventory's."""
        return self._credentials

    @cached_property
    def _credentials(self) -> SshCredentials:
        own = SshCredentials.of(self.inventory)
        if not self.ssh_conn_id:
            return own
        try:
            conn = self.get_connection(self.ssh_conn_id)
        except Exception:  # no such connection: the inventory's settings stand
            return own
        extra = conn.extra_dejson
        return SshCredentials(conn.login or own.user, extra.get("key_file") or own.key_file,
                              extra.get("private_key") or None)

    def transport(self) -> Transport:
        """The transport every command of this hook takes (the inventory's kind: SSH, or local for machines that
        are process groups of this host), held for the hook's life."""
        return self._transport

    @cached_property
    def _transport(self) -> Transport:
        return transport_for(self.inventory, fanout=self.max_parallel, credentials=self.credentials(),
                             connect_timeout_s=self.connect_timeout_s, connect_attempts=self.connect_attempts)

    def connection(self, machine: Machine, *, fresh: bool = False) -> Any:
        """The held paramiko connection to ``machine`` (see :meth:`trainguard.node_tools.transport.SshTransport
        .connection`)."""
        return self.transport().connection(machine, fresh=fresh)  # type: ignore[attr-defined]

    def close(self) -> None:
        """End every held connection."""
        if "_transport" in self.__dict__:
            self._transport.close()

    def exec(self, machine: Machine, argv: Sequence[str], *, timeout_s: float = 60.0,
             env: dict[str, str] | None = None) -> RunResult:
        """Run an argument list on ``machine``, as a transport result."""
        return self.transport().run(machine, argv, timeout=timeout_s, env=env)

    def run(self, machine: Machine | str, argv: Sequence[str], *, timeout_s: float = 60.0) -> NodeResult:
        """Run ``tg-node <argv>`` on one machine."""
        m = machine if isinstance(machine, Machine) else self.inventory.machine(machine)
        return _node_result(self.exec(m, [self.inventory.tg_node, *argv], timeout_s=timeout_s))

    def run_many(self, machines: Sequence[Machine | str], argv: Sequence[str] | Callable[[Machine], Sequence[str]],
                 *, timeout_s: float = 60.0) -> dict[str, NodeResult]:
        """Run on every machine at once (at most ``max_parallel`` sessions); results by machine name."""
        ms = [m if isinstance(m, Machine) else self.inventory.machine(m) for m in machines]
        if not ms:
            return {}

        def one(m: Machine) -> NodeResult:
            return self.run(m, argv(m) if callable(argv) else argv, timeout_s=timeout_s)

        with ThreadPoolExecutor(max_workers=min(len(ms), self.max_parallel)) as pool:
            return {r.machine: r for r in pool.map(one, ms)}


def _node_result(res: RunResult) -> NodeResult:
    seconds = round(res.duration_s, 3)
    if not res.reachable or res.timed_out:
        return NodeResult(res.machine, res.extra.get("status", "timeout" if res.timed_out else "unreachable"),
                          stderr=res.stderr, seconds=seconds)
    text = res.stdout.strip()
    try:
        doc = json.loads(text) if text else None
    except ValueError:
        return NodeResult(res.machine, "bad_output", res.returncode, None, res.stderr or text[-400:], seconds)
    return NodeResult(res.machine, "ok" if res.returncode == 0 else "failed", res.returncode, doc, res.stderr,
                      seconds)

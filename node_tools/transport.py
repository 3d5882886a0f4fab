"""How the host reaches a machine: over ssh (host keys verified), or locally.

A transport runs one command (an argument list, never a shell string) on one
machine with a timeout, and always returns a :class:`RunResult`: an unreachable
machine or a command that outlives its timeout is an explicit result, never a
hang or an exception. Over ssh the argument list is quoted with ``shlex.join``
before it reaches the remote shell, so no value is interpreted by it.

The control plane in Airflow reaches machines through providers-ssh's SSHHook;
this module serves the command line, the emulated cluster and the tests.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from node_tools.inventory import Inventory, Machine

SSH_UNREACHABLE = 255


@dataclass
class RunResult:
    machine: str
    argv: list[str]
    returncode: int | None
    stdout: str
    stderr: str
    duration_s: float
    reachable: bool = True
    timed_out: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.reachable and not self.timed_out and self.returncode == 0

    def json(self) -> Any:
        """The command's stdout parsed as one JSON document (tg-node always prints one)."""
        try:
            return json.loads(self.stdout)
        except ValueError:
            return None

    def answer(self) -> Any:
        """The JSON document of a command that ran through; None when the machine was unreachable, the
        command timed out, or its stdout is not JSON."""
        return self.json() if self.reachable and not self.timed_out else None

    def describe(self) -> str:
        if not self.reachable:
            return f"machine {self.machine} is unreachable: {self.stderr.strip()[-300:]}"
        if self.timed_out:
            return f"'{shlex.join(self.argv)}' on {self.machine} timed out after {self.duration_s:.1f}s"
        return (
            f"'{shlex.join(self.argv)}' on {self.machine} exited {self.returncode}: "
            f"{(self.stderr or self.stdout).strip()[-300:]}"
        )


class Transport:
    """Runs argument lists on machines of an inventory."""

    def __init__(self, inventory: Inventory) -> None:
        self.inventory = inventory

    def command(self, machine: Machine, argv: Sequence[str]) -> tuple[list[str], dict[str, str] | None]:
        raise NotImplementedError

    def tg_node(self, machine: Machine, *args: str) -> list[str]:
        """The argument list that runs ``tg-node args...`` on ``machine``."""
        return [self.inventory.tg_node, *args]

    def run(
        self, machine: Machine, argv: Sequence[str], *, timeout: float = 30.0, stdin: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> RunResult:
        """Run ``argv`` on ``machine``. ``env``: variables for the remote command, sent inside the session
        (secrets such as S3 credentials: never on a command line); the node's sshd must accept them
        (``AcceptEnv``, as the emulated cluster's does)."""
        argv = [str(a) for a in argv]
        local_argv, local_env = self.command(machine, argv)
        if env:
            local_argv, local_env = self.with_env(local_argv, local_env, env)
        start = time.monotonic()
        try:
            proc = subprocess.run(
                local_argv,
                input=stdin,
                capture_output=True,
                text=True,
                timeout=timeout,
                env=local_env,
                stdin=None if stdin is not None else subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired as exc:
            return RunResult(
                machine.name, argv, None, _text(exc.stdout), _text(exc.stderr),
                time.monotonic() - start, timed_out=True,
            )
        except OSError as exc:
            return RunResult(machine.name, argv, None, "", str(exc), time.monotonic() - start, reachable=False)
        reachable = not self.unreachable(proc.returncode, proc.stderr)
        return RunResult(
            machine.name, argv, proc.returncode, proc.stdout, proc.stderr, time.monotonic() - start,
            reachable=reachable,
        )

    def with_env(self, argv: list[str], env: dict[str, str] | None, extra: Mapping[str, str]
                 ) -> tuple[list[str], dict[str, str]]:
        """The local command and environment that hand ``extra`` to the remote command."""
        return argv, {**(env if env is not None else os.environ), **extra}

    def unreachable(self, returncode: int, stderr: str) -> bool:
        return False

    def run_many(
        self, machines: Sequence[Machine], argv_for: Any, *, timeout: float = 30.0, parallel: int = 32,
        env: Mapping[str, str] | None = None,
    ) -> dict[str, RunResult]:
        """Run on many machines at once; ``argv_for(machine)`` gives each one's argument list."""
        if not machines:
            return {}
        with ThreadPoolExecutor(max_workers=min(parallel, len(machines))) as pool:
            futures = {m.name: pool.submit(self.run, m, argv_for(m), timeout=timeout, env=env) for m in machines}
            return {name: f.result() for name, f in futures.items()}


class SshTransport(Transport):
    """OpenSSH client with strict host key checking against the inventory's keys."""

    def known_hosts_path(self) -> str:
        return str(self.inventory.resolve(self.inventory.ssh.get("known_hosts", "known_hosts")))

    def command(self, machine: Machine, argv: Sequence[str]) -> tuple[list[str], dict[str, str] | None]:
        ssh = self.inventory.ssh
        cmd = [
            "ssh",
            "-o", "BatchMode=yes",
            "-o", "StrictHostKeyChecking=yes",
            "-o", f"UserKnownHostsFile={self.known_hosts_path()}",
            "-o", "GlobalKnownHostsFile=/dev/null",
            "-o", f"ConnectTimeout={int(ssh.get('connect_timeout_s', 5))}",
            "-o", "LogLevel=ERROR",
            "-p", str(machine.port),
        ]
        identity = ssh.get("identity_file")
        if identity:
            cmd += ["-i", str(self.inventory.resolve(identity)), "-o", "IdentitiesOnly=yes"]
        cmd += ["-l", str(ssh.get("user", "root")), machine.address, "--", shlex.join(argv)]
        return cmd, None

    def with_env(self, argv: list[str], env: dict[str, str] | None, extra: Mapping[str, str]
                 ) -> tuple[list[str], dict[str, str]]:
        at = argv.index("-l")  # options go before the destination
        send = [o for name in sorted(extra) for o in ("-o", f"SendEnv={name}")]
        return argv[:at] + send + argv[at:], {**(env if env is not None else os.environ), **extra}

    def unreachable(self, returncode: int, stderr: str) -> bool:
        return returncode == SSH_UNREACHABLE


class LocalTransport(Transport):
    """Machines that are process groups on this host (the emulated cluster without root)."""

    def command(self, machine: Machine, argv: Sequence[str]) -> tuple[list[str], dict[str, str] | None]:
        env = dict(os.environ)
        env.update({str(k): str(v) for k, v in machine.extra.get("env", {}).items()})
        return list(argv), env


def transport_for(inventory: Inventory) -> Transport:
    return SshTransport(inventory) if inventory.transport == "ssh" else LocalTransport(inventory)


def known_hosts_lines(inventory: Inventory) -> list[str]:
    """known_hosts entries for every machine ("[addr]:port key" when the port is not 22)."""
    lines = []
    for m in inventory.machines:
        host = m.address if m.port == 22 else f"[{m.address}]:{m.port}"
        lines.append(f"{host} {m.host_key.strip()}")
    return lines


def _text(value: bytes | str | None) -> str:
    if value is None:
        return ""
    return value.decode(errors="replace") if isinstance(value, bytes) else value

"""``NodeHook``: run ``tg-node`` on fleet machines over SSH (providers-ssh ``SSHHook``), get JSON back.

The inventory says where each machine is and what its host key is; the key is pinned on the SSH
client, so a machine answering with another key is refused (never trusted on first use). The user and
private key come from the Airflow connection ``ssh_conn_id`` (default ``tg_ssh``: login and the
``key_file`` or ``private_key`` extra) when it exists, else from the inventory's ``ssh`` section.

Every call returns a :class:`NodeResult` per machine, never raises for a machine that is down:
``unreachable`` (no TCP/SSH session in ``connect_timeout_s``), ``host_key_mismatch``, ``timeout`` (the
command ran past ``timeout_s``; the channel is closed), or the command's exit code and parsed JSON.
Commands are argv lists, joined with :func:`shlex.join`: no value reaches the remote shell unquoted.
"""

from __future__ import annotations

import base64
import io
import json
import shlex
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import paramiko
from airflow.providers.ssh.hooks.ssh import SSHHook
from airflow.sdk import BaseHook

from node_tools.inventory import Inventory, Machine
from node_tools.transport import RunResult, Transport

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


def _host_key(machine: Machine) -> paramiko.PKey:
    kind, data = machine.host_key.split()[:2]
    return paramiko.PKey.from_type_string(kind, base64.b64decode(data))


class NodeHook(BaseHook):
    """Runs ``tg-node`` commands on the machines of an inventory."""

    conn_name_attr = "ssh_conn_id"
    default_conn_name = DEFAULT_CONN_ID
    conn_type = "ssh"
    hook_name = "trainguard node"

    def __init__(self, inventory: Inventory | str | Path, *, ssh_conn_id: str | None = DEFAULT_CONN_ID,
                 connect_timeout_s: float = 5.0, max_parallel: int = 32) -> None:
        super().__init__()
        self.inventory = inventory if isinstance(inventory, Inventory) else Inventory.load(Path(inventory))
        self.ssh_conn_id = ssh_conn_id
        self.connect_timeout_s = connect_timeout_s
        self.max_parallel = max_parallel
        self._credentials: tuple[str, str | None, str | None] | None = None

    def credentials(self) -> tuple[str, str | None, str | None]:
        """(user, key file, private key text): the Airflow connection's when it exists, else the inventory's."""
        if self._credentials is None:
            user, key_file, key_text = str(self.inventory.ssh.get("user", "root")), None, None
            identity = self.inventory.ssh.get("identity_file")
            if identity:
                key_file = str(self.inventory.resolve(identity))
            if self.ssh_conn_id:
                try:
                    conn = self.get_connection(self.ssh_conn_id)
                except Exception:  # no such connection: the inventory's settings stand
                    conn = None
                if conn is not None:
                    extra = conn.extra_dejson
                    user = conn.login or user
                    key_file = extra.get("key_file") or key_file
                    key_text = extra.get("private_key") or None
            self._credentials = (user, key_file, key_text)
        return self._credentials

    def _ssh_hook(self, machine: Machine, timeout_s: float) -> SSHHook:
        user, key_file, key_text = self.credentials()
        hook = SSHHook(remote_host=machine.address, port=machine.port, username=user, key_file=key_file,
                       conn_timeout=int(max(1, self.connect_timeout_s)), cmd_timeout=timeout_s,
                       banner_timeout=self.connect_timeout_s, auth_timeout=int(max(1, self.connect_timeout_s)),
                       conn_retry_attempts=1, keepalive_interval=0, no_host_key_check=False)
        if key_text:
            hook.pkey = paramiko.PKey.from_private_key(io.StringIO(key_text))
        hook.host_key = _host_key(machine)  # pinned: a different key is refused (BadHostKeyException)
        hook.look_for_keys = False
        return hook

    def exec(self, machine: Machine, argv: Sequence[str], *, timeout_s: float = 60.0,
             env: Mapping[str, str] | None = None) -> RunResult:
        """Run an argument list on ``machine`` (joined with :func:`shlex.join`), as a transport result:
        ``reachable`` False for no session or a refused host key, ``timed_out`` past ``timeout_s``.
        ``env`` is sent inside the session (the node's sshd must accept the names: ``AcceptEnv``)."""
        argv = [str(a) for a in argv]
        t0 = time.monotonic()

        def result(code: int | None, out: str = "", err: str = "", **kw: Any) -> RunResult:
            return RunResult(machine.name, argv, code, out, err, time.monotonic() - t0, **kw)

        if not machine.host_key:
            return result(None, err=f"machine {machine.name} has no host key in the inventory; refused",
                          reachable=False, extra={"status": "host_key_mismatch"})
        hook = self._ssh_hook(machine, timeout_s)
        try:
            client = hook.get_conn()
        except paramiko.BadHostKeyException:
            return result(None, err=f"machine {machine.name} ({machine.address}) presented another host key "
                                    f"than the inventory's; refused", reachable=False,
                          extra={"status": "host_key_mismatch"})
        except (OSError, paramiko.SSHException, EOFError) as exc:
            return result(None, err=f"{machine.name} ({machine.address}:{machine.port}): {type(exc).__name__}: "
                                    f"{exc}", reachable=False, extra={"status": "unreachable"})
        try:
            code, out, err = hook.exec_ssh_client_command(client, shlex.join(argv), get_pty=False,
                                                          environment=dict(env) if env else None,
                                                          timeout=timeout_s)
        except Exception as exc:  # providers-ssh raises AirflowException when its command timeout passes
            text = str(exc)
            if "timed out" in text.lower():
                return result(None, err=f"{machine.name}: {text[:300]}", timed_out=True,
                              extra={"status": "timeout"})
            return result(None, err=f"{machine.name}: {type(exc).__name__}: {text[:300]}", reachable=False,
                          extra={"status": "unreachable"})
        finally:
            client.close()
        return result(code, out.decode("utf-8", "replace"), err.decode("utf-8", "replace")[-8000:])

    def transport(self) -> Transport:
        """This hook as a :class:`node_tools.transport.Transport`, for :mod:`node_tools.launcher` and the
        other host-side helpers."""
        return HookTransport(self)

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


class HookTransport(Transport):
    """A :class:`node_tools.transport.Transport` whose sessions are the NodeHook's (paramiko, pinned keys)."""

    def __init__(self, hook: NodeHook) -> None:
        super().__init__(hook.inventory)
        self.hook = hook

    def run(self, machine: Machine, argv: Sequence[str], *, timeout: float = 30.0, stdin: str | None = None,
            env: Mapping[str, str] | None = None) -> RunResult:
        if stdin is not None:
            raise ValueError("NodeHook sessions take no standard input")
        return self.hook.exec(machine, argv, timeout_s=timeout, env=env)

    def open_two_phase(self, machine: Machine, argv: Sequence[str], *, timeout: float) -> _ChannelSession:
        """A paramiko session (the hook's pinned host key) with its stdin open. Raises OSError when no
        session comes: the machine counts as unreachable."""
        if not machine.host_key:
            raise OSError(f"machine {machine.name} has no host key in the inventory; refused")
        try:
            client = self.hook._ssh_hook(machine, timeout).get_conn()
        except paramiko.BadHostKeyException:
            raise OSError(f"machine {machine.name} ({machine.address}) presented another host key than the "
                          f"inventory's; refused") from None
        except (paramiko.SSHException, EOFError) as exc:
            raise OSError(f"{machine.name} ({machine.address}:{machine.port}): {type(exc).__name__}: {exc}") from None
        return _ChannelSession(client, machine.name, [str(a) for a in argv], timeout, self.hook.log)


class _ChannelSession:
    """A two-phase session over one paramiko channel; what it runs and answers goes to the task's log."""

    def __init__(self, client: paramiko.SSHClient, machine: str, argv: list[str], timeout: float, log: Any) -> None:
        self.client, self.machine, self.argv, self.log = client, machine, argv, log
        self.started = time.monotonic()
        log.info("Running command (two phases) on %s: %s", machine, shlex.join(argv))
        self.stdin, self.stdout, self.stderr = client.exec_command(shlex.join(argv), timeout=timeout)

    def first_line(self) -> str:
        try:
            line = self.stdout.readline()
        except (OSError, paramiko.SSHException):
            return ""
        self.log.info("%s, first phase: %s", self.machine, line.strip())
        return line

    def finish(self) -> RunResult:
        try:
            self.stdin.write("go\n")
            self.stdin.flush()
            self.stdin.channel.shutdown_write()
            out = self.stdout.read().decode("utf-8", "replace")
            err = self.stderr.read().decode("utf-8", "replace")[-8000:]
            code = self.stdout.channel.recv_exit_status()
        except (OSError, paramiko.SSHException) as exc:  # the channel timed out or was closed
            return RunResult(self.machine, self.argv, None, "", f"{self.machine}: {type(exc).__name__}: {exc}",
                             time.monotonic() - self.started, timed_out=True, extra={"status": "timeout"})
        finally:
            self.client.close()
        self.log.info("%s, exit %s: %s", self.machine, code, out.strip()[-2000:])
        return RunResult(self.machine, self.argv, code, out, err, time.monotonic() - self.started)

    def abort(self) -> None:
        self.client.close()


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

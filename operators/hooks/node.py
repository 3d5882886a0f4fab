"""``NodeHook``: run ``tg-node`` on fleet machines over SSH (providers-ssh ``SSHHook``), get JSON back.

The inventory says where each machine is and what its host key is; the key is pinned on the SSH
client, so a machine answering with another key is refused (never trusted on first use). The user and
private key come from the Airflow connection ``ssh_conn_id`` (default ``tg_ssh``: login and the
``key_file`` or ``private_key`` extra) when it exists, else from the inventory's ``ssh`` section.

One connection per machine is held for the hook's life (a task's, or a triggerer's for the hooks it
shares): every command after the first opens a channel on it instead of a new TCP and SSH handshake.
A connection that broke meanwhile (the machine rebooted, sshd restarted) is opened again once, before
the command runs; a first connection is tried ``connect_attempts`` times (providers-ssh's retry).
:meth:`NodeHook.close` ends them all.

Every call returns a result per machine, never raises for a machine that is down: ``unreachable`` (no
TCP/SSH session in ``connect_timeout_s``), ``host_key_mismatch``, ``timeout`` (the command ran past
``timeout_s``; the channel is closed), or the command's exit code and parsed JSON. Commands are argv
lists, joined with :func:`shlex.join`: no value reaches the remote shell unquoted.
"""

from __future__ import annotations

import base64
import io
import json
import selectors
import shlex
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import paramiko
from airflow.providers.ssh.hooks.ssh import SSHHook
from airflow.sdk import BaseHook

from trainguard.node_tools.inventory import Inventory, Machine
from trainguard.node_tools.transport import FANOUT, RunResult, Transport
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


def _host_key(machine: Machine) -> paramiko.PKey:
    kind, data = machine.host_key.split()[:2]
    return paramiko.PKey.from_type_string(kind, base64.b64decode(data))


#: a held connection whose machine stopped answering (its network gone, the machine down) is given up after this
#: long: SSH keepalives every KEEPALIVE_S, and the kernel ends a connection whose data goes unacknowledged this
#: long (TCP_USER_TIMEOUT), so a command on it fails in seconds instead of waiting out its own timeout
DEAD_PEER_S = 10.0
KEEPALIVE_S = 2


def _detect_dead_peer(client: paramiko.SSHClient) -> paramiko.SSHClient:
    """``client`` with keepalives and the kernel's limit on unacknowledged data set on its connection (once)."""
    transport = client.get_transport()
    if transport is not None and not getattr(transport, "_tg_dead_peer", False):
        transport.set_keepalive(KEEPALIVE_S)
        sock = transport.sock
        if hasattr(socket, "TCP_USER_TIMEOUT") and isinstance(sock, socket.socket):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(DEAD_PEER_S * 1000))
        transport._tg_dead_peer = True  # type: ignore[attr-defined]
    return client


class _Unreachable(Exception):
    """No session to the machine: its result says why (``status``)."""

    def __init__(self, message: str, status: str) -> None:
        super().__init__(message)
        self.status = status


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
        self._credentials: tuple[str, str | None, str | None] | None = None
        self._held: dict[tuple[str, str, int], SSHHook] = {}
        self._lock = threading.Lock()
        self._machine_locks: dict[str, threading.Lock] = {}

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

    def _ssh_hook(self, machine: Machine) -> SSHHook:
        user, key_file, key_text = self.credentials()
        hook = SSHHook(remote_host=machine.address, port=machine.port, username=user, key_file=key_file,
                       conn_timeout=int(max(1, self.connect_timeout_s)), banner_timeout=self.connect_timeout_s,
                       auth_timeout=int(max(1, self.connect_timeout_s)), conn_retry_attempts=self.connect_attempts,
                       keepalive_interval=15, no_host_key_check=False)
        if key_text:
            hook.pkey = paramiko.PKey.from_private_key(io.StringIO(key_text))
        hook.host_key = _host_key(machine)  # pinned: a different key is refused (BadHostKeyException)
        hook.look_for_keys = False
        return hook

    def connection(self, machine: Machine, *, fresh: bool = False) -> paramiko.SSHClient:
        """The held connection to ``machine`` (opened now if there is none, it broke, or ``fresh``). Raises
        :class:`_Unreachable` when no session comes."""
        if not machine.host_key:
            raise _Unreachable(f"machine {machine.name} has no host key in the inventory; refused",
                               "host_key_mismatch")
        key = (machine.name, machine.address, machine.port)
        with self._lock:
            lock = self._machine_locks.setdefault(machine.name, threading.Lock())
        with lock:  # one handshake per machine, whatever the number of threads asking
            hook = self._held.get(key)
            if hook is None or fresh:
                if hook is not None and hook.client is not None:
                    hook.client.close()
                hook = self._held[key] = self._ssh_hook(machine)
            try:
                return _detect_dead_peer(hook.get_conn())  # the held client while its transport is active
            except paramiko.BadHostKeyException:
                self._held.pop(key, None)
                raise _Unreachable(f"machine {machine.name} ({machine.address}) presented another host key than "
                                   f"the inventory's; refused", "host_key_mismatch") from None
            except (OSError, paramiko.SSHException, EOFError) as exc:
                self._held.pop(key, None)
                raise _Unreachable(f"{machine.name} ({machine.address}:{machine.port}): {type(exc).__name__}: {exc}",
                                   "unreachable") from None

    def close(self) -> None:
        """End every held connection."""
        with self._lock:
            held, self._held = list(self._held.values()), {}
        for hook in held:
            if hook.client is not None:
                hook.client.close()

    def exec(self, machine: Machine, argv: Sequence[str], *, timeout_s: float = 60.0,
             env: Mapping[str, str] | None = None) -> RunResult:
        """Run an argument list on ``machine`` (joined with :func:`shlex.join`), as a transport result:
        ``reachable`` False for no session or a refused host key, ``timed_out`` past ``timeout_s``.
        ``env`` is sent inside the session (the node's sshd must accept the names: ``AcceptEnv``)."""
        argv = [str(a) for a in argv]
        t0 = time.monotonic()

        def result(code: int | None, out: str = "", err: str = "", **kw: Any) -> RunResult:
            return RunResult(machine.name, argv, code, out, err, time.monotonic() - t0, **kw)

        for attempt in (1, 2):
            try:
                client = self.connection(machine, fresh=attempt > 1)
                channel = client.get_transport().open_session(timeout=self.connect_timeout_s)  # type: ignore[union-attr]
            except _Unreachable as exc:
                return result(None, err=str(exc), reachable=False, extra={"status": exc.status})
            except (OSError, paramiko.SSHException, EOFError, AttributeError) as exc:
                if attempt == 1:  # the held connection broke: once more on a new one (nothing ran yet)
                    continue
                return result(None, err=f"{machine.name}: {type(exc).__name__}: {exc}", reachable=False,
                              extra={"status": "unreachable"})
            return self._run_on(channel, machine, argv, timeout_s, env, result)
        raise AssertionError("unreachable")  # pragma: no cover

    def _run_on(self, channel: paramiko.Channel, machine: Machine, argv: list[str], timeout_s: float,
                env: Mapping[str, str] | None, result: Callable[..., RunResult]) -> RunResult:
        """Run ``argv`` on an open channel, reading its output until it exits or ``timeout_s`` passes."""
        deadline = time.monotonic() + timeout_s
        out, err = bytearray(), bytearray()
        try:
            if env:
                channel.update_environment(dict(env))
            channel.exec_command(shlex.join(argv))
            channel.shutdown_write()
            # the channel's pipe is readable when output, an end of output or the exit status arrives
            # (a selector, not select(): a task process may hold descriptors above FD_SETSIZE)
            with selectors.DefaultSelector() as selector:
                selector.register(channel, selectors.EVENT_READ)
                while True:
                    while channel.recv_ready():
                        out += channel.recv(65536)
                    while channel.recv_stderr_ready():
                        err += channel.recv_stderr(65536)
                    if channel.exit_status_ready() and not channel.recv_ready() and not channel.recv_stderr_ready():
                        break
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return result(None, out.decode("utf-8", "replace"), f"{machine.name}: the command timed "
                                      f"out after {timeout_s:.0f}s", timed_out=True, extra={"status": "timeout"})
                    selector.select(min(left, 1.0))
            code = channel.recv_exit_status()
            transport = channel.get_transport()
            if code == -1 and (transport is None or not transport.is_active()):  # the connection died under it
                return result(None, out.decode("utf-8", "replace"), f"{machine.name}: the connection was lost while "
                              f"the command ran (no answer for {DEAD_PEER_S:.0f}s)", reachable=False,
                              extra={"status": "unreachable"})
        except (OSError, paramiko.SSHException, EOFError) as exc:
            return result(None, err=f"{machine.name}: {type(exc).__name__}: {str(exc)[:300]}", reachable=False,
                          extra={"status": "unreachable"})
        finally:
            channel.close()
        self.log.debug("%s: exit %s: %s", machine.name, code, shlex.join(argv))
        return result(code, out.decode("utf-8", "replace"), err.decode("utf-8", "replace")[-8000:])

    def transport(self) -> Transport:
        """This hook as a :class:`trainguard.node_tools.transport.Transport`, for
        :mod:`trainguard.node_tools.launcher` and the other host-side helpers."""
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
    """A :class:`trainguard.node_tools.transport.Transport` whose sessions are the NodeHook's (paramiko, pinned keys,
    one held connection per machine)."""

    def __init__(self, hook: NodeHook) -> None:
        super().__init__(hook.inventory, fanout=hook.max_parallel)
        self.hook = hook

    def run(self, machine: Machine, argv: Sequence[str], *, timeout: float = 30.0, stdin: str | None = None,
            env: Mapping[str, str] | None = None) -> RunResult:
        if stdin is not None:
            raise ValueError("NodeHook sessions take no standard input")
        return self.hook.exec(machine, argv, timeout_s=timeout, env=env)

    def open_two_phase(self, machine: Machine, argv: Sequence[str], *, timeout: float) -> _ChannelSession:
        """A channel on the machine's held connection with its stdin open. Raises OSError when no session
        comes: the machine counts as unreachable."""
        try:
            client = self.hook.connection(machine)
            try:
                channel = client.get_transport().open_session(timeout=self.hook.connect_timeout_s)  # type: ignore[union-attr]
            except (OSError, paramiko.SSHException, EOFError, AttributeError):
                client = self.hook.connection(machine, fresh=True)  # it broke: once more on a new one
                channel = client.get_transport().open_session(timeout=self.hook.connect_timeout_s)  # type: ignore[union-attr]
        except _Unreachable as exc:
            raise OSError(str(exc)) from None
        except (paramiko.SSHException, EOFError, AttributeError) as exc:
            raise OSError(f"{machine.name} ({machine.address}:{machine.port}): {type(exc).__name__}: {exc}") from None
        return _ChannelSession(channel, machine.name, [str(a) for a in argv], timeout, self.hook.log)


class _ChannelSession:
    """A two-phase session over one channel of a held connection; what it runs and answers goes to the
    task's log."""

    def __init__(self, channel: paramiko.Channel, machine: str, argv: list[str], timeout: float, log: Any) -> None:
        self.channel, self.machine, self.argv, self.log = channel, machine, argv, log
        self.started = time.monotonic()
        log.info("Running command (two phases) on %s: %s", machine, shlex.join(argv))
        channel.settimeout(timeout)
        channel.exec_command(shlex.join(argv))
        self.stdin = channel.makefile_stdin("wb")
        self.stdout = channel.makefile("rb")
        self.stderr = channel.makefile_stderr("rb")

    def first_line(self) -> str:
        try:
            line = self.stdout.readline()
        except (OSError, paramiko.SSHException):
            return ""
        text = line.decode("utf-8", "replace") if isinstance(line, bytes) else line
        self.log.info("%s, first phase: %s", self.machine, text.strip())
        return text

    def finish(self) -> RunResult:
        try:
            self.stdin.write(b"go\n")
            self.stdin.flush()
            self.channel.shutdown_write()
            out = self.stdout.read().decode("utf-8", "replace")
            err = self.stderr.read().decode("utf-8", "replace")[-8000:]
            code = self.channel.recv_exit_status()
        except (OSError, paramiko.SSHException) as exc:  # the channel timed out or was closed
            return RunResult(self.machine, self.argv, None, "", f"{self.machine}: {type(exc).__name__}: {exc}",
                             time.monotonic() - self.started, timed_out=True, extra={"status": "timeout"})
        finally:
            self.channel.close()
        self.log.info("%s, exit %s: %s", self.machine, code, out.strip()[-2000:])
        return RunResult(self.machine, self.argv, code, out, err, time.monotonic() - self.started)

    def abort(self) -> None:
        self.channel.close()


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

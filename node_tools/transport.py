"""How the host reaches a machine: over SSH (:class:`SshTransport`), or locally (machines that are process groups on
this host, :class:`LocalTransport`).

A transport runs one command (an argument list, never a shell string) on one machine with a timeout, and always
returns a :class:`RunResult`: an unreachable machine or a command that outlives its timeout is an explicit result,
never a hang or an exception. The control plane's tasks (through :class:`trainguard.operators.hooks.node.NodeHook`,
which hands the SSH transport the Airflow connection's login and key), its triggers, the command line, the
provisioner and the emulated cluster all take the same path (:func:`transport_for`). Over SSH:

- **host keys are verified**: each machine's key is the inventory's (``host_key``, else the inventory's
  ``known_hosts`` file); a machine answering with another key, or one the inventory has no key for, is refused
  (never trusted on first use), and the machine's result says ``host_key_mismatch``;
- **one connection per machine** is held for the transport's life: every command after the first opens a channel
  on it instead of a new TCP and SSH handshake; a connection that broke meanwhile (the machine rebooted, sshd
  restarted) is opened again once, before the command runs; a first connection is tried ``connect_attempts``
  times, 3 to 5 s apart, except when its TCP handshake got no answer within :data:`TCP_CONNECT_S` (a machine
  powered off or cut off, which another try would only wait out again);
- **a dead peer is given up in seconds**: keepalives every :data:`KEEPALIVE_S` and the kernel's limit on
  unacknowledged data (``TCP_USER_TIMEOUT``, :data:`DEAD_PEER_S`), so a command on a connection whose machine
  vanished fails fast instead of waiting out its own timeout;
- **no value reaches the remote shell unquoted**: commands are argument lists joined with :func:`shlex.join`;
  ``env`` is sent inside the session (the node's sshd must accept the names: ``AcceptEnv``), never on a command
  line.

An SSH result that did not run says why in ``extra["status"]``: ``unreachable``, ``host_key_mismatch`` or
``timeout``. paramiko is imported where a connection is made: a training machine, which never reaches another
one, does not need it.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import os
import random
import selectors
import shlex
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any, Protocol

from trainguard.node_tools.inventory import Inventory, Machine

if TYPE_CHECKING:
    import paramiko

log = logging.getLogger(__name__)


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


class TwoPhaseSession(Protocol):
    """One machine's session of :meth:`Transport.run_two_phase`."""

    def first_line(self) -> str:
        """Block until the command printed its first line (or ended: then "")."""

    def finish(self) -> RunResult:
        """Send the go (a line on its stdin, then its end) and read the rest to the command's exit."""

    def abort(self) -> None:
        """End the session now (from another thread): its pending read returns."""


# SSH sessions a fan-out (stop, restart, status round) opens at once: every machine of a fleet up to this size
# in one wave (a fixed 32 made a stop of 256 machines eight waves); each session is a thread and a client
# process or connection on the control plane, one login on its machine
FANOUT = 256


class Transport:
    """Runs argument lists on machines of an inventory."""

    #: the most sessions :meth:`run_two_phase` holds open at once (each waits for all the others); callers
    #: with more machines than this do the two phases in two rounds
    max_two_phase = 256

    def __init__(self, inventory: Inventory, *, fanout: int = FANOUT) -> None:
        self.inventory = inventory
        self.fanout = max(1, int(fanout))
        #: machines whose TCP handshake gets less than :data:`TCP_CONNECT_S`: name -> seconds (an incident's machines
        #: whose agents went quiet: :class:`trainguard.operators.hooks.reach.IncidentReach`)
        self.quick: dict[str, float] = {}

    def command(self, machine: Machine, argv: Sequence[str]) -> tuple[list[str], dict[str, str] | None]:
        raise NotImplementedError

    def close(self) -> None:
        """End what the transport holds (its connections); it opens them again when used."""

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
        self, machines: Sequence[Machine], argv_for: Any, *, timeout: float = 30.0, parallel: int | None = None,
        env: Mapping[str, str] | None = None,
    ) -> dict[str, RunResult]:
        """Run on many machines at once (at most ``parallel`` sessions, default :attr:`fanout`: the whole fleet
        in one wave up to that many machines); ``argv_for(machine)`` gives each one's argument list."""
        if not machines:
            return {}
        with ThreadPoolExecutor(max_workers=min(parallel or self.fanout, len(machines))) as pool:
            futures = {m.name: pool.submit(self.run, m, argv_for(m), timeout=timeout, env=env) for m in machines}
            return {name: f.result() for name, f in futures.items()}

    def open_two_phase(self, machine: Machine, argv: Sequence[str], *, timeout: float) -> TwoPhaseSession:
        """A session running ``argv`` with its stdin open (see :meth:`run_two_phase`)."""
        argv = [str(a) for a in argv]
        local_argv, local_env = self.command(machine, argv)
        return _ProcessSession(self, machine.name, argv, local_argv, local_env)

    def run_two_phase(self, machines: Sequence[Machine], argv_for: Any, *, timeout: float = 30.0,
                      ready_timeout: float | None = None) -> dict[str, RunResult]:
        """Run a command of two phases on many machines, one session each, the second phase everywhere
        only once the first is done everywhere: each command prints one line when its first phase is
        done and waits for a line on its stdin (or its end) before the second. Once every machine
        printed (or ended, or ``ready_timeout`` passed, default ``timeout``), all get the go at once.
        A stop across machines marks everywhere, then stops, in one round of sessions instead of two.
        Each result's stdout is what the command printed after its first line; ``extra["first"]``
        that line. A session still running after ``timeout`` is ended: timed out."""
        if not machines:
            return {}
        start = time.monotonic()
        ready = {m.name: threading.Event() for m in machines}
        go = threading.Event()
        sessions: dict[str, TwoPhaseSession] = {}
        results: dict[str, RunResult] = {}

        def one(m: Machine) -> None:
            argv = [str(a) for a in argv_for(m)]
            try:
                session = sessions[m.name] = self.open_two_phase(m, argv, timeout=timeout)
                first = session.first_line()
            except OSError as exc:
                results[m.name] = RunResult(m.name, argv, None, "", str(exc), time.monotonic() - start,
                                            reachable=False)
                return
            finally:
                ready[m.name].set()
            go.wait()
            r = session.finish()
            r.extra["first"] = first.strip()
            results[m.name] = r

        threads = [threading.Thread(target=one, args=(m,), name=f"two-phase-{m.name}", daemon=True)
                   for m in machines]
        for t in threads:
            t.start()
        ready_by = start + (timeout if ready_timeout is None else ready_timeout)
        for event in ready.values():
            event.wait(max(0.0, ready_by - time.monotonic()))
        go.set()
        for t in threads:
            t.join(max(0.0, start + timeout - time.monotonic()))
        late = [m for m, t in zip(machines, threads, strict=True) if t.is_alive()]
        for m in late:
            if m.name in sessions:
                sessions[m.name].abort()
        for m, t in zip(machines, threads, strict=True):
            t.join(5.0)
            r = results.get(m.name)
            if m in late or r is None:
                results[m.name] = RunResult(m.name, [str(a) for a in argv_for(m)], None, r.stdout if r else "",
                                            r.stderr if r else "", time.monotonic() - start, timed_out=True)
        return {m.name: results[m.name] for m in machines}


class _ProcessSession:
    """A two-phase session of a local process (ssh, or the command itself)."""

    def __init__(self, transport: Transport, machine: str, argv: list[str], local_argv: list[str],
                 env: dict[str, str] | None) -> None:
        self.transport, self.machine, self.argv = transport, machine, argv
        self.started = time.monotonic()
        self.err = tempfile.TemporaryFile()  # noqa: SIM115 - read and closed in finish()
        self.proc = subprocess.Popen(local_argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err,
                                     env=env)

    def first_line(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline().decode(errors="replace")

    def finish(self) -> RunResult:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(b"go\n")
            self.proc.stdin.close()
        except OSError:  # it ended already
            pass
        out = self.proc.stdout.read().decode(errors="replace")
        code = self.proc.wait()
        self.err.seek(0)
        err = self.err.read().decode(errors="replace")[-8000:]
        self.err.close()
        return RunResult(self.machine, self.argv, code, out, err, time.monotonic() - self.started,
                         reachable=not self.transport.unreachable(code, err))

    def abort(self) -> None:
        self.proc.kill()


class LocalTransport(Transport):
    """Machines that are process groups on this host (the emulated cluster without root)."""

    def command(self, machine: Machine, argv: Sequence[str]) -> tuple[list[str], dict[str, str] | None]:
        env = dict(os.environ)
        env.update({str(k): str(v) for k, v in machine.extra.get("env", {}).items()})
        return list(argv), env


# ---- over SSH -----------------------------------------------------------------------------------------------

#: a held connection whose machine stopped answering (its network gone, the machine down) is given up after this
#: long: SSH keepalives every KEEPALIVE_S, and the kernel ends a connection whose data goes unacknowledged this
#: long (TCP_USER_TIMEOUT), so a command on it fails in seconds instead of waiting out its own timeout
DEAD_PEER_S = 10.0
KEEPALIVE_S = 2
#: seconds between two tries of a first connection (when ``connect_attempts`` > 1)
RETRY_WAIT_S = (3.0, 5.0)
#: seconds for the TCP handshake of a connection (the SSH banner and the login get ``connect_timeout_s``): long
#: enough for a lost SYN to be sent again once (Linux's first retransmission comes after 1 s)
TCP_CONNECT_S = 2.0


@dataclass(frozen=True)
class SshCredentials:
    """Who logs in: the user and the private key (a file, or the key's text: an Airflow connection's
    ``private_key`` extra, never written to disk)."""

    user: str = "root"
    key_file: str | None = None
    key_text: str | None = None

    @classmethod
    def of(cls, inventory: Inventory) -> SshCredentials:
        """The inventory's own (its ``ssh`` section's ``user`` and ``identity_file``)."""
        identity = inventory.ssh.get("identity_file")
        return cls(str(inventory.ssh.get("user", "root")), str(inventory.resolve(identity)) if identity else None)


def private_key(text: str) -> paramiko.PKey:
    """The private key in ``text`` (OpenSSH or PEM; Ed25519, ECDSA or RSA), whatever its type: paramiko's base
    ``PKey`` cannot load one itself. Raises ``ValueError`` naming what to fix when none of them reads it."""
    import paramiko

    for kind in (paramiko.Ed25519Key, paramiko.ECDSAKey, paramiko.RSAKey):
        try:
            return kind.from_private_key(io.StringIO(text))
        except (paramiko.SSHException, ValueError):
            continue
    raise ValueError("the SSH connection's private_key extra is not an unencrypted Ed25519, ECDSA or RSA private "
                     "key: paste the whole key file (BEGIN ... END lines included), or set key_file instead")


class Unreachable(Exception):
    """No session to the machine: its result says why (``status``: ``unreachable`` or ``host_key_mismatch``)."""

    def __init__(self, message: str, status: str) -> None:
        super().__init__(message)
        self.status = status


def _host_entry(machine: Machine) -> str:
    return machine.address if machine.port == 22 else f"[{machine.address}]:{machine.port}"


class SshTransport(Transport):
    """Runs argument lists on the machines of an inventory over SSH (see the module). ``credentials``: the login
    (default: the inventory's); ``connect_timeout_s``: seconds for the TCP connection, the SSH banner and the
    authentication (default: the inventory's ``ssh.connect_timeout_s``, 5)."""

    def __init__(self, inventory: Inventory, *, fanout: int = FANOUT, credentials: SshCredentials | None = None,
                 connect_timeout_s: float | None = None, connect_attempts: int = 1) -> None:
        super().__init__(inventory, fanout=fanout)
        self.credentials = credentials or SshCredentials.of(inventory)
        self.connect_timeout_s = float(connect_timeout_s if connect_timeout_s is not None
                                       else inventory.ssh.get("connect_timeout_s", 5))
        self.connect_attempts = max(1, int(connect_attempts))
        self._held: dict[tuple[str, str, int], paramiko.SSHClient] = {}
        self._lock = threading.Lock()
        self._machine_locks: dict[str, threading.Lock] = {}

    # ---- connections --------------------------------------------------------------------------------------
    def _trusted(self, client: paramiko.SSHClient, machine: Machine) -> None:
        """Pin the machine's host key on ``client`` (the inventory's, else its known_hosts file's)."""
        import paramiko

        entry = _host_entry(machine)
        if machine.host_key:
            kind, data = machine.host_key.split()[:2]
            client.get_host_keys().add(entry, kind, paramiko.PKey.from_type_string(kind, base64.b64decode(data)))
            return
        path = self.inventory.resolve(self.inventory.ssh.get("known_hosts", "known_hosts"))
        known = paramiko.HostKeys()
        try:
            known.load(str(path))
        except OSError:
            pass
        if entry not in known:
            raise Unreachable(f"machine {machine.name} has no host key in the inventory (nor in {path}); refused",
                              "host_key_mismatch")
        for kind, key in known[entry].items():
            client.get_host_keys().add(entry, kind, key)

    @cached_property
    def _pkey(self) -> paramiko.PKey | None:
        """The connection's key text, parsed once for every machine (None: the key file, or none)."""
        return private_key(self.credentials.key_text) if self.credentials.key_text else None

    def _connect(self, machine: Machine) -> paramiko.SSHClient:
        import paramiko

        client = paramiko.SSHClient()
        self._trusted(client, machine)
        client.set_missing_host_key_policy(paramiko.RejectPolicy())  # never trusted on first use
        creds = self.credentials
        try:
            pkey = self._pkey
        except ValueError as exc:
            raise Unreachable(f"{machine.name}: {exc}", "unreachable") from None
        attempt = 0
        # the TCP handshake alone gets TCP_CONNECT_S: on a data-center network it takes milliseconds, and the kernel
        # answers it however loaded the machine is; no answer at all is a machine gone (powered off, its link
        # down), which a second try would only wait out again. A machine in ``quick`` gets less (its agent is quiet)
        handshake = min(TCP_CONNECT_S, self.connect_timeout_s, self.quick.get(machine.name, TCP_CONNECT_S))
        while True:
            attempt += 1
            try:
                sock = socket.create_connection((machine.address, machine.port), timeout=handshake)
            except TimeoutError:
                client.close()
                raise Unreachable(f"{machine.name} ({machine.address}:{machine.port}): no answer to a TCP connection "
                                  f"within {handshake:g}s", "unreachable") from None
            except OSError as exc:  # refused, reset, no route: sshd restarting, a link coming back; tried again
                if attempt >= self.connect_attempts:
                    client.close()
                    raise Unreachable(f"{machine.name} ({machine.address}:{machine.port}): {type(exc).__name__}: "
                                      f"{exc}", "unreachable") from None
                time.sleep(random.uniform(*RETRY_WAIT_S))  # noqa: S311 (a retry's jitter)
                continue
            try:
                client.connect(machine.address, port=machine.port, username=creds.user, pkey=pkey,
                               key_filename=None if pkey else creds.key_file, timeout=self.connect_timeout_s,
                               banner_timeout=self.connect_timeout_s, auth_timeout=self.connect_timeout_s,
                               look_for_keys=False, allow_agent=False, sock=sock)
                break
            except paramiko.BadHostKeyException:
                client.close()
                raise Unreachable(f"machine {machine.name} ({machine.address}) presented another host key than the "
                                  f"inventory's; refused", "host_key_mismatch") from None
            except (OSError, paramiko.SSHException, EOFError) as exc:
                sock.close()
                if attempt >= self.connect_attempts:
                    client.close()
                    raise Unreachable(f"{machine.name} ({machine.address}:{machine.port}): {type(exc).__name__}: "
                                      f"{exc}", "unreachable") from None
                time.sleep(random.uniform(*RETRY_WAIT_S))  # noqa: S311 (a retry's jitter)
        transport = client.get_transport()
        if transport is not None:
            transport.set_keepalive(KEEPALIVE_S)
            sock = transport.sock
            if hasattr(socket, "TCP_USER_TIMEOUT") and isinstance(sock, socket.socket):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(DEAD_PEER_S * 1000))
        return client

    def connection(self, machine: Machine, *, fresh: bool = False) -> paramiko.SSHClient:
        """The held connection to ``machine`` (opened now if there is none, it broke, or ``fresh``). Raises
        :class:`Unreachable` when no session comes."""
        key = (machine.name, machine.address, machine.port)
        with self._lock:
            lock = self._machine_locks.setdefault(machine.name, threading.Lock())
        with lock:  # one handshake per machine, whatever the number of threads asking
            client = self._held.get(key)
            transport = client.get_transport() if client is not None else None
            if client is not None and not fresh and transport is not None and transport.is_active():
                return client
            if client is not None:
                client.close()
                self._held.pop(key, None)
            client = self._held[key] = self._connect(machine)
            return client

    def close(self) -> None:
        """End every held connection."""
        with self._lock:
            held, self._held = list(self._held.values()), {}
        for client in held:
            client.close()

    def _channel(self, machine: Machine, *, fresh: bool = False) -> paramiko.Channel:
        return self.connection(machine, fresh=fresh).get_transport().open_session(  # type: ignore[union-attr]
            timeout=self.connect_timeout_s)

    def _open_channel(self, machine: Machine) -> paramiko.Channel:
        """A new channel on the machine's held connection, or, when that connection broke, on a new one (nothing
        ran on it yet). Raises :class:`Unreachable` when no connection comes, else the second try's error."""
        import paramiko

        try:
            return self._channel(machine)
        except (OSError, paramiko.SSHException, EOFError, AttributeError):
            return self._channel(machine, fresh=True)

    # ---- commands -----------------------------------------------------------------------------------------
    def run(self, machine: Machine, argv: Sequence[str], *, timeout: float = 30.0, stdin: str | None = None,
            env: Mapping[str, str] | None = None) -> RunResult:
        """Run ``argv`` on ``machine`` (see the module); ``stdin``: text written to the command's input."""
        import paramiko

        argv = [str(a) for a in argv]
        t0 = time.monotonic()
        try:
            channel = self._open_channel(machine)
        except Unreachable as exc:
            return RunResult(machine.name, argv, None, "", str(exc), time.monotonic() - t0, reachable=False,
                             extra={"status": exc.status})
        except (OSError, paramiko.SSHException, EOFError, AttributeError) as exc:
            return RunResult(machine.name, argv, None, "", f"{machine.name}: {type(exc).__name__}: {exc}",
                             time.monotonic() - t0, reachable=False, extra={"status": "unreachable"})
        return self._run_on(channel, machine, argv, timeout, stdin, env, t0)

    def _run_on(self, channel: paramiko.Channel, machine: Machine, argv: list[str], timeout: float,
                stdin: str | None, env: Mapping[str, str] | None, t0: float) -> RunResult:
        """Run ``argv`` on an open channel, reading its output until it exits or ``timeout`` passes."""
        import paramiko

        def result(code: int | None, out: bytes | str = "", err: bytes | str = "", **kw: Any) -> RunResult:
            text = out.decode("utf-8", "replace") if isinstance(out, bytes) else out
            errs = err.decode("utf-8", "replace")[-8000:] if isinstance(err, bytes) else err
            return RunResult(machine.name, argv, code, text, errs, time.monotonic() - t0, **kw)

        deadline = t0 + timeout
        out, err = bytearray(), bytearray()
        try:
            if env:
                channel.update_environment(dict(env))
            channel.exec_command(shlex.join(argv))
            if stdin:
                channel.sendall(stdin.encode())
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
                        return result(None, bytes(out), f"{machine.name}: the command timed out after {timeout:.0f}s",
                                      timed_out=True, extra={"status": "timeout"})
                    selector.select(min(left, 1.0))
            code = channel.recv_exit_status()
            transport = channel.get_transport()
            if code == -1 and (transport is None or not transport.is_active()):  # the connection died under it
                return result(None, bytes(out), f"{machine.name}: the connection was lost while the command ran (no "
                              f"answer for {DEAD_PEER_S:.0f}s)", reachable=False, extra={"status": "unreachable"})
        except (OSError, paramiko.SSHException, EOFError) as exc:
            return result(None, err=f"{machine.name}: {type(exc).__name__}: {str(exc)[:300]}", reachable=False,
                          extra={"status": "unreachable"})
        finally:
            channel.close()
        log.debug("%s: exit %s: %s", machine.name, code, shlex.join(argv))
        return result(code, bytes(out), bytes(err))

    def open_two_phase(self, machine: Machine, argv: Sequence[str], *, timeout: float) -> _ChannelSession:
        """A channel on the machine's held connection with its stdin open. Raises OSError when no session comes:
        the machine counts as unreachable."""
        import paramiko

        try:
            channel = self._open_channel(machine)
        except Unreachable as exc:
            raise OSError(str(exc)) from None
        except (paramiko.SSHException, EOFError, AttributeError) as exc:
            raise OSError(f"{machine.name} ({machine.address}:{machine.port}): {type(exc).__name__}: {exc}") from None
        return _ChannelSession(channel, machine.name, [str(a) for a in argv], timeout)


class _ChannelSession:
    """A two-phase session over one channel of a held connection; what it runs and answers goes to the log."""

    def __init__(self, channel: paramiko.Channel, machine: str, argv: list[str], timeout: float) -> None:
        self.channel, self.machine, self.argv = channel, machine, argv
        self.started = time.monotonic()
        log.info("Running command (two phases) on %s: %s", machine, shlex.join(argv))
        channel.settimeout(timeout)
        channel.exec_command(shlex.join(argv))
        self.stdin = channel.makefile_stdin("wb")
        self.stdout = channel.makefile("rb")
        self.stderr = channel.makefile_stderr("rb")

    def first_line(self) -> str:
        import paramiko

        try:
            line = self.stdout.readline()
        except (OSError, paramiko.SSHException):
            return ""
        text = line.decode("utf-8", "replace") if isinstance(line, bytes) else line
        log.info("%s, first phase: %s", self.machine, text.strip())
        return text

    def finish(self) -> RunResult:
        import paramiko

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
        log.info("%s, exit %s: %s", self.machine, code, out.strip()[-2000:])
        return RunResult(self.machine, self.argv, code, out, err, time.monotonic() - self.started)

    def abort(self) -> None:
        self.channel.close()


def transport_for(inventory: Inventory, *, fanout: int = FANOUT, credentials: SshCredentials | None = None,
                  connect_timeout_s: float | None = None, connect_attempts: int = 1) -> Transport:
    """The inventory's transport: :class:`SshTransport` for an ``ssh`` inventory (with
    ``credentials``, an :class:`SshCredentials`: another login than the inventory's;
    ``connect_timeout_s`` None: the inventory's), :class:`LocalTransport` otherwise."""
    if inventory.transport != "ssh":
        return LocalTransport(inventory, fanout=fanout)
    return SshTransport(inventory, fanout=fanout, credentials=credentials, connect_timeout_s=connect_timeout_s,
                        connect_attempts=connect_attempts)


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

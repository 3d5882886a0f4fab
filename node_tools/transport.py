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

import contextlib
import hashlib
import json
import os
import shlex
import stat
import subprocess
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from trainguard.node_tools.inventory import Inventory, Machine

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


# seconds an OpenSSH master connection outlives its last session (the inventory's ``ssh.control_persist_s``;
# 0: every session its own connection): an incident's rounds (stop, swap, restart, status) come within it
CONTROL_PERSIST_S = 120


def control_dir() -> Path | None:
    """The private folder of this user's OpenSSH master sockets (``$XDG_RUNTIME_DIR`` or the temporary
    folder, ``tg-ssh-<uid>``), made 0700; None when what is there is not a folder of this user's that
    nobody else may enter (a link, another owner, wider modes): sessions then connect each on its own."""
    base = Path(os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir())
    path = base / f"tg-ssh-{os.getuid()}"
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    try:
        st = path.lstat()
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        return None
    return path


class SshTransport(Transport):
    """OpenSSH client with strict host key checking against the inventory's keys.

    Sessions to a machine share one connection (OpenSSH's ``ControlMaster``): the first opens it, and it
    stays ``control_persist_s`` after the last; every later session is a channel on it, without a new
    handshake on either side (the client's side of OpenSSH 9.2's default key exchange alone cost 70-80 ms
    of CPU a session). The master sockets are in :func:`control_dir`. A machine that stops answering (its
    network gone) would hold every session on its master until the session's own timeout, where a new
    connection fails in ``connect_timeout_s``: the master ends after three missed keepalives 2 s apart, and
    its sessions with it, as unreachable (exit 255); a session that finds no master connects on its own."""

    def known_hosts_path(self) -> str:
        return str(self.inventory.resolve(self.inventory.ssh.get("known_hosts", "known_hosts")))

    def multiplex(self) -> list[str]:
        """The options that share one connection per machine ([] when turned off or no private folder).
        A master serves only sessions of the same trust: its socket's name carries a digest of the
        known_hosts it verified the machine against and of the key it logged in with (a session checking
        another host key, or logging in with another key, opens its own connection)."""
        persist = int(self.inventory.ssh.get("control_persist_s", CONTROL_PERSIST_S))
        folder = control_dir() if persist > 0 else None
        if folder is None:
            return []
        trust = hashlib.sha256()
        try:
            trust.update(Path(self.known_hosts_path()).read_bytes())
        except OSError:  # no known_hosts: the session fails its host key check on its own
            return []
        identity = self.inventory.ssh.get("identity_file")
        trust.update(str(self.inventory.resolve(identity) if identity else "").encode())
        return ["-o", "ControlMaster=auto", "-o", f"ControlPath={folder}/{trust.hexdigest()[:12]}-%C",
                "-o", f"ControlPersist={persist}", "-o", "ServerAliveInterval=2", "-o", "ServerAliveCountMax=3"]

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
            *self.multiplex(),
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


def transport_for(inventory: Inventory, *, fanout: int = FANOUT) -> Transport:
    cls = SshTransport if inventory.transport == "ssh" else LocalTransport
    return cls(inventory, fanout=fanout)


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

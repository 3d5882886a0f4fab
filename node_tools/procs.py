"""Finding and ending processes by what they are, not by what we remember of them.

Every process trainguard starts carries a marker in its environment
(``TG_JOB_TOKEN`` for a job's processes, ``TG_NODE_CONFIG`` for anything on an
emulated machine). Workers that torchrun puts in sessions of their own, and
orphans of a crashed parent, still carry it, so :func:`pids_with_env` finds them
all and :func:`terminate` ends them: SIGCONT (a stopped process cannot act on
SIGTERM), SIGTERM, then SIGKILL after a grace period.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

PROC = Path("/proc")


def alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie."""
    state = proc_state(pid)
    return state is not None and state not in ("Z", "X")


def _stat_fields(pid: int) -> list[str] | None:
    """``/proc/<pid>/stat`` from its third field (state) on, or None if the process is gone."""
    try:
        stat = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    # the command name is in parentheses and may contain spaces
    return stat.rsplit(")", 1)[1].split()


def proc_state(pid: int, start_ticks: int | None = None) -> str | None:
    """The one-letter state of ``pid`` (R, S, D, T for stopped, Z ...), or None if it is gone. With
    ``start_ticks`` (what :func:`start_ticks` said for the process once), None also when the pid now
    belongs to another process (pids are reused)."""
    fields = _stat_fields(pid)
    if fields is None:
        return None
    if start_ticks is not None and len(fields) > 19 and fields[19] != str(start_ticks):
        return None
    return fields[0]


def start_ticks(pid: int) -> int | None:
    """When ``pid`` started, in clock ticks since boot (``/proc/<pid>/stat`` field 22): with the pid,
    it names one process for good."""
    fields = _stat_fields(pid)
    return int(fields[19]) if fields is not None and len(fields) > 19 and fields[19].isdigit() else None


def cpu_ticks(pid: int) -> int | None:
    """CPU time ``pid`` has used (user + system, in clock ticks: ``/proc/<pid>/stat`` fields 14 and 15), or
    None if it is gone. A process whose count does not move is not running."""
    fields = _stat_fields(pid)
    if fields is None or len(fields) < 13 or not (fields[11].isdigit() and fields[12].isdigit()):
        return None
    return int(fields[11]) + int(fields[12])


def environ(pid: int) -> dict[str, str]:
    try:
        raw = (PROC / str(pid) / "environ").read_bytes()
    except OSError:
        return {}
    env = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            env[key.decode(errors="replace")] = value.decode(errors="replace")
    return env


def all_pids() -> list[int]:
    return [int(p.name) for p in PROC.iterdir() if p.name.isdigit()]


def pids_with_env(key: str, value: str | None = None, *, prefix: bool = False) -> list[int]:
    """Live processes whose environment has ``key`` (equal to ``value``, or starting with it)."""
    me = os.getpid()
    found = []
    for pid in all_pids():
        if pid == me:
            continue
        got = environ(pid).get(key)
        if got is None:
            continue
        matches = value is None or got == value or (prefix and got.startswith(value))
        if matches and alive(pid):
            found.append(pid)
    return sorted(found)


def terminate(pids: Iterable[int], *, grace_s: float = 5.0) -> list[int]:
    """End ``pids``: SIGCONT, SIGTERM, and SIGKILL whatever is left after ``grace_s``.

    Returns the pids that were signalled. Never signals this process.
    """
    targets = [p for p in set(pids) if p != os.getpid() and alive(p)]
    for sig in (signal.SIGCONT, signal.SIGTERM):
        for pid in targets:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(alive(p) for p in targets):
        time.sleep(0.05)
    for pid in targets:
        if alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and any(alive(p) for p in targets):
        time.sleep(0.02)
    return sorted(targets)


NICE_ENV = "TG_JOB_NICE"


def nice_from_env(env: Mapping[str, str] | None = None) -> int:
    """Lower this process's CPU priority to ``$TG_JOB_NICE`` (the node's ``job_nice``, set for the
    job's processes and its warm interpreters); never raises it. Returns the niceness now."""
    raw = (os.environ if env is None else env).get(NICE_ENV, "")
    current = os.getpriority(os.PRIO_PROCESS, 0)
    try:
        wanted = min(19, int(raw)) if raw else 0
    except ValueError:
        return current
    if wanted > current:
        os.setpriority(os.PRIO_PROCESS, 0, wanted)
        return wanted
    return current

"""Finding and ending processes by what they are, not by what we remember of them (psutil underneath).

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

import psutil

# psutil's status names as the kernel's one-letter states (``ps``'s STAT column), which the checks and
# the stacks' evidence speak
_STATE = {psutil.STATUS_RUNNING: "R", psutil.STATUS_SLEEPING: "S", psutil.STATUS_DISK_SLEEP: "D",
          psutil.STATUS_STOPPED: "T", psutil.STATUS_TRACING_STOP: "t", psutil.STATUS_ZOMBIE: "Z",
          psutil.STATUS_DEAD: "X", psutil.STATUS_WAKING: "W",
          psutil.STATUS_IDLE: "I", psutil.STATUS_PARKED: "P"}


def _process(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(int(pid))
    except (psutil.Error, ValueError, TypeError):
        return None


def alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie."""
    state = proc_state(pid)
    return state is not None and state not in ("Z", "X")


def proc_state(pid: int, started_at: float | None = None) -> str | None:
    """The one-letter state of ``pid`` (R, S, D, T for stopped, Z ...), or None if it is gone. With
    ``started_at`` (what :func:`started` said for the process once), None also when the pid now
    belongs to another process (pids are reused)."""
    p = _process(pid)
    if p is None:
        return None
    try:
        if started_at is not None and round(p.create_time(), 2) != round(float(started_at), 2):
            return None
        return _STATE.get(p.status(), "?")
    except (psutil.Error, ValueError, TypeError):
        return None


def started(pid: int) -> float | None:
    """When ``pid`` started (seconds since the epoch, to the kernel's tick): with the pid, it names one
    process for good."""
    p = _process(pid)
    try:
        return None if p is None else round(p.create_time(), 2)
    except psutil.Error:
        return None


def cpu_seconds(pid: int) -> float | None:
    """CPU time ``pid`` has used (user + system, seconds), or None if it is gone. A process whose count
    does not move is not running."""
    p = _process(pid)
    try:
        return None if p is None else round(sum(p.cpu_times()[:2]), 2)
    except psutil.Error:
        return None


def environ(pid: int) -> dict[str, str]:
    p = _process(pid)
    try:
        return {} if p is None else p.environ()
    except psutil.Error:
        return {}


def cmdline(pid: int) -> list[str]:
    """The process's command line, or [] when it is gone (or a kernel thread)."""
    p = _process(pid)
    try:
        return [] if p is None else p.cmdline()
    except psutil.Error:
        return []


def group_alive(pgid: int) -> bool:
    """Whether the process group ``pgid`` has a member that has not exited. A group of zombies has ended: its
    members wait for a parent to reap them, which for children of an exited leader is the host's init, and an
    init that reaps lazily would otherwise keep a stopped group "alive" for as long as it pleases."""
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                return True
        except (psutil.Error, OSError):
            continue
    return False


def all_pids() -> list[int]:
    return psutil.pids()


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


def _until_gone(pids: Iterable[int], timeout_s: float, interval_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(interval_s)


def terminate(pids: Iterable[int], *, grace_s: float = 5.0) -> list[int]:
    """End ``pids``: SIGCONT, SIGTERM, and SIGKILL whatever is left after ``grace_s``.

    Returns the pids that were signalled. Never signals this process.
    """
    targets = {pid: p for pid in set(pids) if pid != os.getpid() and alive(pid) and (p := _process(pid))}
    for sig in (signal.SIGCONT, signal.SIGTERM):
        for p in targets.values():
            try:
                p.send_signal(sig)
            except psutil.Error:
                pass
    # polled, not psutil.wait_procs: waiting would reap our own children behind their Popen's back
    # (whose wait() would then report exit status 0)
    _until_gone(targets, grace_s, 0.05)
    for pid in [pid for pid in targets if alive(pid)]:
        try:
            targets[pid].kill()
        except psutil.Error:
            pass
    _until_gone(targets, 5.0, 0.02)
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

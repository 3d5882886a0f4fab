"""Which training ranks of this host are busy: the host's CPUs idle only when every one of them waits.

A rank's saver persists its snapshot when the rank says its host idles
(:meth:`trainguard.checkpoint.engine.Checkpointer.host_idle`: the device computes, the host thread waits). But one
host runs several ranks (eight GPUs to a machine; every rank of a cluster emulated on one host), and they
do not idle at the same moment: pipeline stages are offset, a rank's data loading runs while another's
device computes. Work that starts at one rank's idle moment competes with a neighbour's busy phase, and
the whole job waits for the slowest rank at its next collective. On the checkpoint benchmark's ``device``
setting (4 ranks on 2 cores), the savers' work, done on CPU time left idle by their own ranks, still cost
about 2% of the step (6 runs with checkpoints against 6 without); waiting for this board, 0.7% in the same
experiment and 0.3% in the committed benchmark.

So the ranks of a host keep a board: a small ``/dev/shm`` file (per user, mode 0600) with one record per
rank process: its pid, whether its host thread is busy or idle, and since when. A rank claims a record
when its checkpointing starts, marks it at each idle and busy moment (one store into shared memory), and
frees it at the end. A saver that may persist reads the board and waits, briefly and within a bound its
caller sets, until no live rank on it is busy. A record whose process is gone counts for nothing; a rank
that hangs busy holds the savers back only until their bound.

Nothing here is pickled or executed: fixed-size records of integers and a float. A board that cannot be
used privately (a link, another owner, wider modes) is not used: savers then go by their own rank alone.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import stat
import struct
import time
from pathlib import Path

from trainguard.core import procs

SHM_DIR = Path("/dev/shm")
SLOTS = 128
RECORD = struct.Struct("<qqd8x")  # pid, state, since (CLOCK_MONOTONIC, the same clock for every process)
STRIDE = RECORD.size
SIZE = SLOTS * STRIDE
FREE, BUSY, IDLE = 0, 1, 2
POLL_S = 0.005  # how often a waiting saver reads the board


def default_path() -> Path:
    """``/dev/shm/tg-host-<uid>``, or ``$TG_HOST_BOARD`` (ranks and savers that must not see each other's)."""
    return Path(os.environ.get("TG_HOST_BOARD") or SHM_DIR / f"tg-host-{os.getuid()}")


class HostBoard:
    """The host's board, mapped into this process (see the module)."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = Path(path) if path is not None else default_path()
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
                raise PermissionError(f"{self.path} is not a private file of this user")
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                if st.st_size < SIZE:
                    os.ftruncate(fd, SIZE)
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
            self.mm = mmap.mmap(fd, SIZE)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        self.slot: int | None = None
        self.state = FREE

    @classmethod
    def open(cls, path: Path | None = None) -> HostBoard | None:
        """The board, or None where it cannot be used privately (the callers then go without)."""
        try:
            return cls(path)
        except OSError:
            return None

    # ---- a rank's record ---------------------------------------------------------------------
    def claim(self, pid: int | None = None) -> int | None:
        """Take a record for ``pid`` (this process): its own if it has one, else a free one or one whose
        process is gone. None when all are taken by live processes."""
        pid = os.getpid() if pid is None else pid
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        try:
            chosen = None
            for i in range(SLOTS):
                owner = RECORD.unpack_from(self.mm, i * STRIDE)[0]
                if owner == pid:
                    chosen = i
                    break
                if chosen is None and (owner == 0 or not _alive(owner)):
                    chosen = i
            if chosen is not None:
                RECORD.pack_into(self.mm, chosen * STRIDE, pid, BUSY, time.monotonic())
        finally:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
        self.slot = chosen
        self.state = BUSY if chosen is not None else FREE
        return chosen

    def mark(self, state: int) -> None:
        """Say this rank's host thread is now ``BUSY`` or ``IDLE`` (no-op if unchanged or unclaimed)."""
        if self.slot is None or state == self.state:
            return
        self.state = state
        off = self.slot * STRIDE
        struct.pack_into("<d", self.mm, off + 16, time.monotonic())
        struct.pack_into("<q", self.mm, off + 8, state)

    def release(self) -> None:
        if self.slot is None:
            return
        RECORD.pack_into(self.mm, self.slot * STRIDE, 0, FREE, 0.0)
        self.slot, self.state = None, FREE

    # ---- a saver's view ----------------------------------------------------------------------
    def busy(self) -> list[int]:
        """The pids of live processes whose record says busy."""
        found = []
        for pid, state, _since in RECORD.iter_unpack(self.mm[:SIZE]):
            if pid > 0 and state == BUSY and _alive(pid):
                found.append(pid)
        return found

    def wait_idle(self, deadline: float, *, give_up: object = None) -> float:
        """Wait until no live rank on the board is busy, or until ``deadline`` (monotonic), or until
        ``give_up()`` says so; the seconds waited."""
        t0 = time.monotonic()
        while time.monotonic() < deadline and self.busy():
            if give_up is not None and give_up():  # type: ignore[operator]
                break
            time.sleep(min(POLL_S, max(0.0, deadline - time.monotonic())))
        return time.monotonic() - t0

    def close(self) -> None:
        self.release()
        with contextlib.suppress(BufferError, ValueError):
            self.mm.close()
        with contextlib.suppress(OSError):
            os.close(self.fd)


def _alive(pid: int) -> bool:
    return procs.alive(pid)

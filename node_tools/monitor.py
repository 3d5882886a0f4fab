"""In-job monitor hook: what every training rank tells its machine's agent.

A training script adds three lines::

    from trainguard.node_tools.monitor import JobMonitor
    monitor = JobMonitor.from_env()          # reads RANK, LOCAL_RANK, TG_RUN_DIR ...
    ...
    with monitor.collective("dp", "all_reduce"):   # around each collective
        dist.all_reduce(grad, group=dp_group)
    monitor.step_end(step, loss=..., grad_norm=..., step_time_s=..., tokens_per_s=...)

and the hook keeps two files per rank under ``<run_dir>/ranks/``:

``rank<R>.json``
    The heartbeat: rewritten atomically every ``flush_interval_s`` by a daemon
    thread. ``beat`` counts the rewrites and ``alive_ts`` advances while the
    process runs (both stop when the process is stopped or dead); ``progress_ts``
    advances at each step end and each completed collective (it stops when the
    rank hangs). The agent judges both by whether they change, on its own clock. It also carries
    the per-process-group collective sequence numbers (started / completed),
    the last step and the process identity.
``rank<R>.steps.jsonl``
    One JSON line per step: step, loss, grad norm, step time, tokens/s, the time
    spent waiting in collectives (``comm_s``: a straggler waits least), the
    job's incarnation (how many times it was started on this machine before) and
    any extra fields the job adds. The file grows across incarnations, so a
    restarted job's history stays readable.

The hook never blocks training on I/O beyond an append of one line per step, and
never raises into the training loop because of its own files. It imports no
torch. Its fault points (:mod:`trainguard.node_tools.faultpoints`) are inert unless
``TG_FAULT_FILE`` names a control file and a harness (the emulated cluster's) is installed.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from trainguard.core import procs
from trainguard.core.files import write_json_atomic as _write_json_atomic
from trainguard.node_tools import faultpoints

SCHEMA_VERSION = 1


def heartbeat_path(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / "ranks" / f"rank{rank}.json"


def steps_path(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / "ranks" / f"rank{rank}.steps.jsonl"


def write_json_atomic(path: Path, document: Any) -> None:
    """Write ``document`` as compact JSON to ``path`` (its folder exists) atomically
    (:func:`trainguard.core.files.write_json_atomic`)."""
    _write_json_atomic(path, document, compact=True, make_parent=False)


@dataclass
class CollectiveCounter:
    """Sequence numbers of one process group, in the manner of a flight recorder."""

    started: int = 0
    completed: int = 0
    last_op: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {"started": self.started, "completed": self.completed, "last_op": self.last_op}


@dataclass
class JobMonitor:
    """The per-rank hook. Build it with :meth:`from_env` inside a torchrun worker."""

    run_dir: Path
    rank: int
    local_rank: int = 0
    world_size: int = 1
    job: str = "job"
    machine: str = ""
    coords: dict[str, int] = field(default_factory=dict)
    flush_interval_s: float = 0.5
    incarnation: int = 0
    faults: faultpoints.FaultPoints | None = None

    def __post_init__(self) -> None:
        self.run_dir = Path(self.run_dir)
        (self.run_dir / "ranks").mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._collectives: dict[str, CollectiveCounter] = {}
        self._comm_s = 0.0  # time spent inside collectives since the last step end
        self._step = -1
        self._status = "starting"
        self._hold: dict[str, Any] | None = None  # why and how long the rank holds still (hold())
        now = time.time()
        self._started_ts = now
        self._pid_start = procs.started(os.getpid())  # with the pid: this process, not a later namesake
        self._progress_ts = now
        self._beats = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._steps_fh = open(  # noqa: SIM115 - kept open for the rank's life, closed in close()
            steps_path(self.run_dir, self.rank), "a", encoding="utf-8", buffering=1)
        if self.faults is None:
            self.faults = faultpoints.from_env(rank=self.rank, local_rank=self.local_rank)

    @classmethod
    def from_env(cls, *, coords: dict[str, int] | None = None, **overrides: Any) -> JobMonitor:
        """Build the hook from torchrun's and tg-node's environment.

        ``TG_RUN_DIR`` (set by ``tg-node job start``) says where to write; outside a
        trainguard launch it falls back to ``./tg-run``.
        """
        env = os.environ
        kwargs: dict[str, Any] = {
            "run_dir": Path(env.get("TG_RUN_DIR", "tg-run")),
            "rank": int(env.get("RANK", "0")),
            "local_rank": int(env.get("LOCAL_RANK", "0")),
            "world_size": int(env.get("WORLD_SIZE", "1")),
            "job": env.get("TG_JOB", "job"),
            "incarnation": int(env.get("TG_INCARNATION", "0")),
            "machine": env.get("TG_MACHINE", socket.gethostname()),
            "coords": dict(coords or {}),
        }
        kwargs.update(overrides)
        monitor = cls(**kwargs)
        monitor.start()
        return monitor

    # ---- lifecycle -------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._status = "running"
        self.flush()
        self._thread = threading.Thread(target=self._flush_loop, name="tg-monitor", daemon=True)
        self._thread.start()

    def close(self, status: str = "finished") -> None:
        """Stop the flush thread and leave a final heartbeat saying how the rank ended."""
        self._status = status
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.flush_interval_s + 1)
        self.flush()
        with contextlib.suppress(OSError):
            self._steps_fh.close()

    def _flush_loop(self) -> None:
        while not self._stop.wait(self.flush_interval_s):
            self.flush()

    def _now(self) -> float:
        """This rank's clock: the host's, or off by what a ``clock`` fault of the emulated cluster says."""
        return time.time() + self.faults.clock_offset()

    def snapshot(self) -> dict[str, Any]:
        now = self._now()
        with self._lock:
            self._beats += 1
            return {
                "schema": SCHEMA_VERSION,
                "job": self.job,
                "incarnation": self.incarnation,
                "rank": self.rank,
                "local_rank": self.local_rank,
                "world_size": self.world_size,
                "machine": self.machine,
                "pid": os.getpid(),
                "pid_start": self._pid_start,
                "coords": self.coords,
                "status": "held" if self._hold is not None else self._status,
                **({"hold": dict(self._hold)} if self._hold is not None else {}),
                "beat": self._beats,
                "started_ts": self._started_ts,
                "alive_ts": now,
                "progress_ts": self._progress_ts,
                "step": self._step,
                "collectives": {g: c.as_dict() for g, c in self._collectives.items()},
            }

    def flush(self) -> None:
        """Write the heartbeat now. Errors (disk full, read-only) are swallowed: never stall training."""
        with contextlib.suppress(OSError):
            write_json_atomic(heartbeat_path(self.run_dir, self.rank), self.snapshot())

    # ---- what the training loop calls ---------------------------------------------------
    def hold(self, reason: str, *, seconds: float) -> None:
        """Say that the rank stops stepping on purpose for up to ``seconds`` (it found a non-finite loss
        and waits for the control plane): the heartbeat goes on and says ``status: held`` with the reason,
        so the agent does not take the missing progress for a hang until ``seconds`` have passed on its
        own clock. :meth:`release` ends it."""
        with self._lock:
            self._hold = {"reason": reason, "seconds": float(seconds), "step": self._step}
        self.flush()

    def release(self) -> None:
        with self._lock:
            self._hold = None
        self.flush()

    def comm_s(self) -> float:
        """Seconds spent inside counted collectives since the last step ended (what the step's ``comm_s`` holds
        so far)."""
        with self._lock:
            return self._comm_s

    def step_begin(self, step: int) -> None:
        """Called before each step; the fault points' (a harness's slow rank or exit)."""
        self.faults.before_step(step)

    @contextlib.contextmanager
    def collective(self, group: str, op: str) -> Iterator[None]:
        """Count a collective on ``group`` (e.g. "tp", "pp", "dp") as started, then completed."""
        self.faults.before_collective(group, op)
        with self._lock:
            counter = self._collectives.setdefault(group, CollectiveCounter())
            counter.started += 1
            counter.last_op = op
        began = time.perf_counter()
        yield
        now = self._now()
        with self._lock:
            counter.completed += 1
            self._comm_s += time.perf_counter() - began
            self._progress_ts = now

    def step_end(
        self,
        step: int,
        *,
        loss: float,
        grad_norm: float,
        step_time_s: float,
        tokens_per_s: float,
        **extra: Any,
    ) -> None:
        """Record one finished step (append a line, advance the heartbeat's progress)."""
        now = self._now()
        record = {
            "step": step,
            "ts": now,
            "rank": self.rank,
            "incarnation": self.incarnation,
            "loss": _finite_or_str(loss),
            "grad_norm": _finite_or_str(grad_norm),
            "step_time_s": step_time_s,
            "tokens_per_s": tokens_per_s,
        }
        for key, value in extra.items():
            record[key] = _finite_or_str(value) if isinstance(value, float) else value
        with self._lock:
            self._step = step
            self._progress_ts = now
            record["collectives"] = {g: c.completed for g, c in self._collectives.items()}
            record["comm_s"] = round(self._comm_s, 6)
            self._comm_s = 0.0
        with contextlib.suppress(OSError):
            self._steps_fh.write(json.dumps(record, separators=(",", ":")) + "\n")


def _finite_or_str(value: float) -> float | str:
    """JSON has no NaN/Inf; write them as strings ("nan", "inf") so readers see them."""
    value = float(value)
    return value if math.isfinite(value) else str(value)


def step_compute(rec: Mapping[str, Any]) -> float:
    """A step record's compute time, the part of the step that is the rank's own: its local part (``local_s``: up
    to the first wait inside the framework's collectives, DDP's gradient all-reduce, which ``comm_s`` does not
    see) when the guard measured it, else the step less its counted wait in collectives (``comm_s``); NaN when
    the record says neither. A straggler's grew; its peers', who wait for it, did not."""
    local = number(rec.get("local_s"))
    if math.isfinite(local) and local >= 0:
        return local
    return number(rec.get("step_time_s")) - number(rec.get("comm_s"))


def number(value: Any) -> float:
    """``value`` as a float; NaN when a record holds something else there (or nothing)."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return float("nan")


def read_heartbeat(run_dir: Path, rank: int) -> dict[str, Any] | None:
    """The rank's last heartbeat, or None if it has not written one (or it is unreadable)."""
    try:
        return json.loads(heartbeat_path(run_dir, rank).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def lines_back(fh: BinaryIO, *, block: int = 1 << 16) -> Iterator[tuple[int, bytes]]:
    """The complete lines of an open binary file, newest first, each with the offset where it begins, read from
    the end in blocks: what a reader of the file's last stretch reads, however long its history. A torn last
    line (one being written) is skipped."""
    pos = fh.seek(0, os.SEEK_END)
    carry, torn_dropped = b"", False
    while pos > 0:
        start = max(0, pos - block)
        fh.seek(start)
        parts = (fh.read(pos - start) + carry).split(b"\n")
        pos = start
        if not torn_dropped:
            if len(parts) == 1:  # no newline read yet: all of it belongs to the torn last line
                carry = parts[0]
                continue
            parts.pop()  # after the last newline: empty, or a torn line being written
            torn_dropped = True
        carry = parts.pop(0) if start > 0 else b""  # possibly cut: completed by the next block read
        offset = start + len(carry) + 1 if start > 0 else 0
        offsets = []
        for line in parts:
            offsets.append(offset)
            offset += len(line) + 1
        yield from zip(reversed(offsets), reversed(parts), strict=True)


def records_back(run_dir: Path, rank: int, *, block: int = 1 << 16) -> Iterator[dict[str, Any]]:
    """A rank's complete step records, newest first, read from the end of its file backwards (:func:`lines_back`;
    a blank or unreadable line is passed over): a reader that stops early reads only the file's end."""
    try:
        fh = open(steps_path(run_dir, rank), "rb")  # noqa: SIM115 - closed below
    except OSError:
        return
    with fh:
        for _offset, line in lines_back(fh, block=block):
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                yield record


def read_steps_since(run_dir: Path, rank: int, since_ts: float, *, block: int = 1 << 16,
                     limit: int | None = None) -> list[dict[str, Any]]:
    """The complete step records of a rank that ended after ``since_ts`` (their ``ts``, this machine's clock),
    oldest first, read from the end of its file backwards (:func:`records_back`): the records are appended as steps
    end, so the first record at or before ``since_ts`` ends the search, and what is read is what is new, however
    long the job's history (three months of steps are millions of records). A torn last line is ignored.
    ``limit``: at most this many, the newest (``since_ts`` -inf and a limit: the file's last records)."""
    out: list[dict[str, Any]] = []
    for record in records_back(run_dir, rank, block=block):
        if not isinstance(record.get("ts"), int | float) or record["ts"] <= since_ts:
            break
        out.append(record)
        if limit is not None and len(out) >= limit:
            break
    out.reverse()
    return out


def read_steps_after(run_dir: Path, rank: int, step: int, *, block: int = 1 << 16) -> list[dict[str, Any]]:
    """The newest stretch of a rank's step records after ``step``, oldest first, read from the end of its file
    backwards (:func:`records_back`) up to the last record of ``step`` or an earlier one: the steps around a
    checkpoint that was just committed, not the months before it."""
    out: list[dict[str, Any]] = []
    for record in records_back(run_dir, rank, block=block):
        if isinstance(record.get("step"), int) and record["step"] <= step:
            break
        out.append(record)
    out.reverse()
    return out


def read_steps(run_dir: Path, rank: int) -> list[dict[str, Any]]:
    """Every complete step record of a rank (a torn last line is ignored)."""
    records: list[dict[str, Any]] = []
    try:
        with open(steps_path(run_dir, rank), encoding="utf-8") as fh:
            for line in fh:
                if not line.endswith("\n"):
                    break
                with contextlib.suppress(ValueError):
                    records.append(json.loads(line))
    except OSError:
        return []
    return records

"""The training-side checkpointer: per-step asynchronous snapshots, tiered, replicated, committed, restored.

What it guarantees to the training loop:

* **Blocking is one copy.** :meth:`Checkpointer.after_step` copies model,
  optimizer, RNG and data position into one of two pre-allocated CPU buffers
  (pinned, on a side CUDA stream, on GPU hosts; there the step only waits for
  the copy before the next optimizer update, :meth:`before_update`). Everything
  else (manifest, checksums, disk, replica, S3) runs on background threads.
* **Back-pressure waits, bounded; a stuck persister costs snapshots, never the
  training.** When both buffers are still being written or sent, the step waits
  for the older one (its host idles meanwhile: the saver persists at once), at
  most ``backpressure_wait_s`` (``SnapshotInfo.waited_s``), so a persister that
  is only slower than the steps (early in a run, a host whose CPUs training keeps
  busy) slows the training to its pace instead of letting ranks skip different
  steps: a step is committed only when every rank holds it, and ranks that
  skipped 2 and 3 respectively leave step 1 the newest. A wait that runs out
  skips the snapshot (``SnapshotInfo.skipped``) and every due step after it
  skips at once until the persister frees a buffer: a stuck one costs the
  training one wait.
* **Tiers.** Each snapshot is written atomically to the machine's local disk
  (:mod:`trainguard.checkpoint.layout`), sent to the rank's backup rank
  (:meth:`trainguard.node_tools.topology.Topology.backup_rank`: shares none of its TP, PP,
  DP groups, on another machine) over a gloo group of the checkpoint's own, and
  every ``s3_every_steps`` steps (or on request) uploaded to S3.
* **Commit.** A rank's step is done when its local copy is durable and its
  backup acknowledged a replica that matched its checksums. A step is
  *committed* when it is done on every rank (learned by a tiny all-gather every
  ``commit_interval_s`` on the control group); committed steps get a
  ``committed.json`` marker. Retention keeps ``keep`` steps per rank and tier (the
  newest committed and in-flight ones; always the newest committed) plus the newest
  verified step, so a machine's disk holds about ``keep`` x (its ranks' states + the
  replicas it keeps).
* **Restore** (:meth:`restore`, before training, all ranks together): every rank
  reports what it holds, all compute the same :class:`trainguard.checkpoint.plan.RestorePlan`
  (newest step every rank can get, own local copy first, then the replica
  holder, then S3), copies are verified (checksums, tensors, finite values) as
  they are read, received or downloaded; a bad one is reported with machine,
  rank, step, tier and path, excluded, and the plan made again (another copy of
  the step, or an older step). The state goes back bit for bit; training resumes
  at ``data_position["next_step"]``.

Errors on background threads never reach the training loop: they are reported
on stderr as one line naming machine, rank, step and tier, and the affected
tier stops (a step without its replica is never committed).
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import re
import socket
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from trainguard.checkpoint import layout, wire
from trainguard.checkpoint import manifest as mf
from trainguard.checkpoint.config import CheckpointConfig
from trainguard.checkpoint.errors import UNRESTORABLE, CheckpointError, RestoreError, S3TierError
from trainguard.checkpoint.hostboard import BUSY, IDLE, HostBoard
from trainguard.checkpoint.plan import S3_HOLDER, Holding, RestorePlan, explain, plan_restore
from trainguard.checkpoint.s3 import open_tier
from trainguard.checkpoint.saver import SaverLink, ShmFile, _b64, files_sha, non_finite
from trainguard.checkpoint.shards import (
    MODEL_FILE,
    OPTIM_FILE,
    STATE_FILES,
    ShardLayout,
    StateReader,
    apply_state,
    meta_json,
)
from trainguard.checkpoint.verify import CopyCheck, Problem, check_data, check_s3_copy, inspect_copy, verify_copy
from trainguard.node_tools.topology import Topology


@dataclass
class SnapshotInfo:
    """What one step's checkpointing cost and did.

    Attributes:
        blocking_s: time the training thread spent in the checkpointer this step. Seconds.
        taken: a snapshot of this step was copied and queued.
        skipped: the step was due but both buffers stayed busy (back-pressure: the wait ran out, or the
            persister had not freed a buffer since a wait ran out).
        waited_s: of ``blocking_s``, the time the step waited for the persister to free a buffer (0 when
            one was free, the normal case). Seconds.
        refused: the step was due but its state is not worth keeping (its gradients were not finite, or
            its data-parallel replicas disagree): not snapshotted, so the newest committed step stays the
            last good one and retention keeps it.
        memcpy_s: time of a plain copy of the same state (only with ``measure_memcpy``). Seconds.
    """

    blocking_s: float = 0.0
    taken: bool = False
    skipped: bool = False
    refused: bool = False
    memcpy_s: float | None = None
    waited_s: float = 0.0


@dataclass
class RestoreResult:
    """A finished restore.

    Attributes:
        step: the restored step (training resumes at ``data_position["next_step"]``).
        tier: where this rank's state came from: "local", "replica" or "s3".
        holder: the rank that sent it (for "replica"), else -1.
        seconds: wall time of the whole restore on this rank (inventory, plan, transfer, verify, load).
        counts: ranks per source tier, over the whole job.
        rounds: plans made (1 unless a copy failed verification on the way).
        problems: one line per copy found bad.
        data_position: the data loader position saved with the step.
    """

    step: int
    tier: str
    holder: int
    seconds: float
    counts: dict[str, int]
    rounds: int
    problems: list[str] = field(default_factory=list)
    data_position: dict[str, Any] = field(default_factory=dict)


class _Slot:
    """One pre-allocated snapshot buffer: a flat uint8 tensor per file, typed views into it."""

    def __init__(self, tensors: dict[str, dict[str, torch.Tensor]], pin: bool, identity: tuple[Any, ...],
                 flats: dict[str, torch.Tensor] | None = None) -> None:
        self.layouts = {name: ShardLayout.for_tensors(ts) for name, ts in tensors.items()}
        self.flats = flats if flats is not None else {
            name: torch.empty(lay.data_bytes, dtype=torch.uint8, pin_memory=pin) for name, lay in self.layouts.items()}
        self.index = -1  # its number at the saver process (saver "process")
        self.mapped: list[Any] = []  # the shared-memory files its buffers live in (saver "process")
        self.views = {name: lay.views(self.flats[name]) for name, lay in self.layouts.items()}
        self.signature = {name: lay.signature for name, lay in self.layouts.items()}
        self.identity = identity
        self._pairs: tuple[Any, list[torch.Tensor], list[torch.Tensor], list[tuple[str, str]]] | None = None
        self.busy = False
        self.step = -1
        self.meta: dict[str, Any] = {}
        self.data_position: dict[str, Any] = {}
        self.event: Any = None

    def fits(self, tensors: dict[str, dict[str, torch.Tensor]], identity: tuple[Any, ...]) -> bool:
        """Whether ``tensors`` has this slot's layout (same tensor objects: no need to look closer)."""
        if identity == self.identity:
            return True
        if {name: ShardLayout.signature_of(ts) for name, ts in tensors.items()} == self.signature:
            self.identity = identity
            return True
        return False

    def copy_from(self, tensors: dict[str, dict[str, torch.Tensor]], non_blocking: bool,
                  identity: tuple[Any, ...] | None = None) -> None:
        """Copy ``tensors`` in. With ``identity`` (the same tensor objects as the last copy with it), the
        pairs of live tensors and buffer views are reused; the RNG states (new objects each step) are
        paired anew."""
        if identity is None or self._pairs is None or self._pairs[0] != identity:
            dst: list[torch.Tensor] = []
            src: list[torch.Tensor] = []
            rng: list[tuple[str, str]] = []
            for name, ts in tensors.items():
                views = self.views[name]
                for key, t in ts.items():
                    if key.startswith("rng."):
                        rng.append((name, key))
                    else:
                        dst.append(views[key])
                        src.append(t)
            self._pairs = (identity, dst + [self.views[n][k] for n, k in rng], src, rng)
        _, dst, src, rng = self._pairs
        with torch.no_grad():
            _copy_all(dst, src + [tensors[n][k] for n, k in rng], non_blocking)

    def non_finite(self) -> str:
        """The first floating-point tensor of the snapshot holding a NaN or an infinity ("" if none): the
        saver process's check (:func:`trainguard.checkpoint.saver.non_finite`), on this buffer."""
        for name, lay in self.layouts.items():
            bad = non_finite(memoryview(self.flats[name].numpy()), _entries(lay))
            if bad:
                return f"{bad} ({name})"
        return ""

    def parts(self, name: str) -> list[Any]:
        return [self.layouts[name].prefix, memoryview(self.flats[name].numpy())]


def _copy_all(dst: list[torch.Tensor], src: list[torch.Tensor], non_blocking: bool) -> None:
    foreach = getattr(torch, "_foreach_copy_", None)
    if foreach is not None:
        foreach(dst, src, non_blocking=non_blocking)
    else:
        for d, s in zip(dst, src, strict=True):
            d.copy_(s, non_blocking=non_blocking)


def _entries(lay: ShardLayout) -> list[list[Any]]:
    """A layout's tensors as the saver takes them: ``[name, dtype, shape, begin, end]``."""
    return [[e.name, e.dtype, list(e.shape), e.begin, e.end] for e in lay.entries]


def _timed_copy(slot: _Slot, tensors: dict[str, dict[str, torch.Tensor]], identity: tuple[Any, ...],
                cuda: bool) -> float:
    t0 = time.perf_counter()
    slot.copy_from(tensors, non_blocking=cuda, identity=identity)
    if cuda:
        torch.cuda.current_stream().synchronize()
    return time.perf_counter() - t0


class ReferenceCopy:
    """A plain copy of a rank's whole state (the tensors a snapshot holds) into a spare buffer, pinned on
    GPU hosts, timed: what checkpoint blocking is measured against, in runs of its own."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        self._reader = StateReader(model, optimizer)
        self._slot: _Slot | None = None
        self.cuda = torch.cuda.is_available() and any(p.is_cuda for p in model.parameters())

    def measure(self) -> float:
        tensors, _meta, key = self._reader.read()
        identity = (key, tuple(tensors[MODEL_FILE]), tuple(tensors[OPTIM_FILE]))
        if self._slot is None or not self._slot.fits(tensors, identity):
            self._slot = _Slot(tensors, self.cuda, identity)
        return _timed_copy(self._slot, tensors, identity, self.cuda)


# how long a step waits for the saver process to lay out buffers for a new state shape (once per shape)
LOG = logging.getLogger("trainguard.checkpoint")
CONFIGURE_WAIT_S = 10.0
COPY_LATEST_S = 0.25  # with copy_at_idle: the soonest the copier copies without waiting for host_idle
COMMIT_IDLE_S = 2.0  # the longest a rank waits for a step of its own to report before the next commit round
RETAIN_EVERY_S = 5.0  # retention runs after each commit, and at least this often without one
EMPTY_STEP_S = 60.0  # a step folder empty this long holds no copy being written: retention removes it


class Checkpointer:
    """One rank's checkpointing. Build it on every rank (it creates process groups), then
    :meth:`restore`, :meth:`start`, and per step :meth:`before_update` / :meth:`after_step`;
    :meth:`close` at the end."""

    def __init__(self, config: CheckpointConfig, *, topology: Topology, rank: int, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer | None, job: str = "job", incarnation: int = 0,
                 log: Any = None) -> None:
        self.cfg = config
        self.rank = rank
        self.model = model
        self.optimizer = optimizer
        self.job = job
        self.incarnation = incarnation
        self.world = topology.world_size
        self.layout_key = f"tp={topology.tp},pp={topology.pp},dp={topology.dp}"
        rpm = config.ranks_per_machine or topology.ranks_per_machine
        self.placement = Topology(topology.tp, topology.pp, topology.dp, ranks_per_machine=rpm)
        self.machine_index = self.placement.machine_of(rank)
        base = config.machine or os.environ.get("TG_MACHINE") or socket.gethostname()
        self.machine = f"{base}/m{self.machine_index}" if config.ranks_per_machine else base
        self._log_fn = log
        self._logged: dict[str, int] = {}

        self.distributed = dist.is_available() and dist.is_initialized() and self.world > 1
        self.ctl = self.data = None
        if self.distributed:  # every rank creates both groups, in this order
            self.ctl, self.data = _background_groups(self.world, config)
        self.replicate = config.replicate and self.distributed and self.placement.machines >= 2
        self.backup = self.placement.backup_rank(rank) if self.replicate else None
        self.sources = list(self.placement.backed_up_by(rank)) if self.replicate else []
        self.s3 = open_tier(config.s3_url, endpoint_url=config.s3_endpoint_url, timeout_s=config.s3_timeout_s) \
            if config.s3_url else None

        self.root = config.root
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            layout.write_json(self.root / layout.MACHINE_INFO, {
                "machine": self.machine, "machine_index": self.machine_index, "job": job})
        except OSError as exc:
            raise CheckpointError(f"machine {self.machine} rank {rank}: checkpoint root {self.root} is not "
                                  f"writable ({exc.strerror}); fix the disk or pass --no-checkpoint") from None
        self.use_cuda = torch.cuda.is_available() and any(p.is_cuda for p in model.parameters())
        self.stream = torch.cuda.Stream() if self.use_cuda else None
        self.segment = uuid.uuid4().hex[:12]  # replaced by rank 0's in restore()

        self._lock = threading.Lock()
        self._persisted = threading.Condition(self._lock)
        self._processed = 0  # snapshots the writer has finished with (written, replicated, or failed)
        self._slots: list[_Slot] = []
        self._reader = StateReader(model, optimizer)
        self._spare: _Slot | None = None
        self._pending_event: Any = None
        # copy_at_idle: the snapshot taken by after_step whose copy waits for the host to idle, and whether
        # the copier may start it (host_idle or before_update said so)
        self._deferred: tuple[_Slot, dict[str, dict[str, torch.Tensor]], tuple[Any, ...]] | None = None
        self._copy_go = False
        self._copied = threading.Condition(self._lock)
        self._deferred_at = 0.0  # when after_step deferred it (monotonic)
        self._idle_gap_s = COPY_LATEST_S / 2  # how long the host usually takes from after_step to host_idle
        # the host's board (hostboard): this rank's busy and idle moments, for every saver of the host
        self._board: HostBoard | None = None
        self._idle_at: float | None = None  # when host_idle() last said so (monotonic); None while busy
        self._idle_span_s = 0.0  # how long this rank's host usually idles (host_idle() to its next busy moment)
        self._writer_q: queue.Queue[_Slot | None] = queue.Queue()
        # the next upload for the S3 thread: the newest due snapshot wins (one waiting, one in flight at most)
        self._s3_next: tuple[int, bytes, list[tuple[str, bytes]]] | None = None
        self._s3_wake = threading.Condition(threading.Lock())
        self._s3_closing = False
        self._s3_requested = False
        self._done: deque[int] = deque(maxlen=16)  # steps done on this rank (local durable + replica acked)
        self._done_count = 0  # how many steps were ever added to it (the commit thread waits for news)
        self.committed: set[int] = set()
        self.s3_uploaded: deque[int] = deque()
        self.s3_superseded = 0  # due uploads replaced by a newer snapshot before their turn came
        self.skipped = 0
        self.refused = 0
        self.snapshots = 0
        self.waits = 0  # due steps that waited for a free buffer (back-pressure)
        self.waited_s = 0.0  # and how long in all. Seconds
        # a wait for a free buffer ran out: due steps skip at once until the persister frees one
        self._stalled = False
        self.errors: list[str] = []
        self._replica_broken = False
        self._stop = threading.Event()
        # set by close(flush=False): the job is failing and tears its process groups down; the background
        # threads stop talking to peers and keep their errors to themselves (a teardown error printed in the
        # middle of the job's own traceback would hide why it failed)
        self._abandoned = threading.Event()
        self._writer_finished = threading.Event()
        self._threads: list[threading.Thread] = []
        self._commit_thread: threading.Thread | None = None
        self._started = False
        self._finished_cpu_s = 0.0  # CPU time of background threads that have ended
        self._finished: set[threading.Thread] = set()
        self.link: SaverLink | None = None
        self._configuring: tuple[Any, ...] | None = None  # the layout the saver is making buffers for
        self._memory: dict[str, Any] | None = None  # the saver's newest snapshot of this rank, at start
        self._saver_lost = False  # the saver process closed its connection: snapshots stop, training goes on
        if config.saver == "process":
            try:
                self.link = SaverLink(self.root, rank=rank, job=job, host=_reachable_host(),
                                      idle_s=config.saver_idle_s,
                                      nice=config.background_nice, on_done=self._saved,
                                      on_configured=self._configured,
                                      on_error=lambda line: self._error(line, kind="saver"))
            except OSError as exc:
                raise CheckpointError(f"machine {self.machine} rank {rank}: the checkpoint saver process did not "
                                      f"start ({exc}); pass --checkpoint-saver thread to persist in the training "
                                      f"process") from None
            self._memory = self.link.memory
        else:  # a saver process of this root would be writing its own temporaries
            layout.clean_temporaries(self.root)

    # ---- reporting ---------------------------------------------------------------------
    def _log(self, message: str, *, kind: str = "") -> None:
        """One warning of the ``trainguard.checkpoint`` logger, naming machine and rank (stderr when the job configured
        no logging); a repeated kind is logged 1st, 10th, 100th ... time."""
        kind = kind or message
        n = self._logged.get(kind, 0) + 1
        self._logged[kind] = n
        if n & (n - 1) and n not in (10, 100, 1000):
            return
        line = f"checkpoint: machine {self.machine} rank {self.rank}: {message}" + (f" (x{n})" if n > 1 else "")
        if self._log_fn is not None:
            self._log_fn(line)
        else:  # the training job's own logging; one that configured none still sees it on stderr (lastResort)
            LOG.warning(line)

    def _error(self, message: str, *, kind: str = "") -> None:
        with self._lock:
            self.errors.append(message)
            del self.errors[:-50]
        if not self._abandoned.is_set():
            self._log(message, kind=kind)

    def status(self) -> dict[str, Any]:
        with self._lock:
            return {"machine": self.machine, "rank": self.rank, "snapshots": self.snapshots,
                    "skipped": self.skipped, "refused": self.refused, "waits": self.waits,
                    "waited_s": round(self.waited_s, 3), "stalled": self._stalled,
                    "committed": max(self.committed, default=None),
                    "replica": self.backup, "replica_broken": self._replica_broken,
                    "s3_uploaded": list(self.link.uploaded[-5:] if self.link else self.s3_uploaded),
                    "s3_superseded": self.s3_superseded, "saver": self.cfg.saver,
                    "saver_pid": self.link.pid if self.link else None, "errors": list(self.errors[-5:])}

    def background_cpu_s(self) -> float:
        """CPU seconds the checkpoint's background threads have used so far (all tiers, commit, retention)."""
        with self._lock:
            total = self._finished_cpu_s
            threads = [t for t in self._threads if t.ident is not None and t not in self._finished]
        for t in threads:
            with contextlib.suppress(OSError, OverflowError):  # it may have just ended
                total += time.clock_gettime(time.pthread_getcpuclockid(t.ident))
        if self.link is not None:  # the saver process's, as of its last report (all ranks it serves)
            total += self.link.saver_cpu_s
        return total

    @property
    def newest_committed(self) -> int | None:
        with self._lock:
            return max(self.committed, default=None)

    # ---- the training thread -------------------------------------------------------------
    def before_update(self) -> float:
        """Wait until the last snapshot's device-to-host copy is done (GPU hosts); call before the
        optimizer changes the parameters. Returns the seconds waited (0 on CPU, where the copy is synchronous,
        unless ``copy_at_idle`` left it to the host's idle moment and it is not done yet)."""
        self.host_busy()
        if self._defers:
            t0 = time.perf_counter()
            self._copy_now(wait=True)
            return time.perf_counter() - t0
        if self._pending_event is None:
            return 0.0
        t0 = time.perf_counter()
        self._pending_event.synchronize()
        self._pending_event = None
        return time.perf_counter() - t0

    def host_idle(self) -> None:
        """Say that this rank's host is about to idle (its device computes; the host thread waits): the
        saver process persists the last snapshot now (with ``copy_at_idle``, the last snapshot's copy
        starts first). Optional; cheap (a message queued). Say :meth:`host_busy` when the host thread works
        again (else the next :meth:`before_update` or :meth:`after_step` says it)."""
        if self._idle_at is None:
            self._idle_at = time.monotonic()
            if self._board is not None:
                self._board.mark(IDLE)
        if self._defers:
            with self._lock:
                if self._deferred is not None:  # learn the loop's pace: the copier's deadline follows it
                    gap = time.monotonic() - self._deferred_at
                    self._idle_gap_s = 0.8 * self._idle_gap_s + 0.2 * gap
            if self._copy_now(wait=False):
                return  # the copier says so once the snapshot is handed over
        if self.link is not None and self._started:
            self.link.post(self._quiet)

    def host_busy(self) -> None:
        """Say that this rank's host thread works again (the device's result is in): the host's savers
        hold back from here until every rank of the host idles (:mod:`trainguard.checkpoint.hostboard`). Cheap."""
        if self._idle_at is None:
            return
        span = time.monotonic() - self._idle_at
        self._idle_at = None
        self._idle_span_s = span if not self._idle_span_s else 0.8 * self._idle_span_s + 0.2 * span
        if self._board is not None:
            self._board.mark(BUSY)

    def _quiet(self) -> dict[str, Any]:
        """The saver may persist now; the host usually stays idle about ``idle_s``."""
        return {"op": "quiet", "idle_s": round(self._idle_span_s, 4)}

    @property
    def _defers(self) -> bool:
        return self.cfg.copy_at_idle and not self.use_cuda and self._started

    def _copy_now(self, *, wait: bool) -> bool:
        """Let the copier start the deferred snapshot's copy; with ``wait``, until it is done. Whether one
        was waiting."""
        with self._lock:
            if self._deferred is None:
                return False
            self._copy_go = True
            self._copied.notify_all()
            while wait and self._deferred is not None:
                self._copied.wait()
        return True

    def due(self, step: int) -> bool:
        return (step + 1) % self.cfg.every_steps == 0

    def after_step(self, step: int, data_position: dict[str, Any] | None = None, *,
                   healthy: bool = True, why: str = "") -> SnapshotInfo:
        """Snapshot the state at the end of ``step`` into a free buffer and queue it; skip if none is free.

        ``healthy``: False when the step's state must not be kept (``why``: its gradients were not
        finite, its data-parallel replicas disagree); every rank of the job must say the same (a global
        gradient norm, an all-gathered digest), so no rank commits a step the others refused."""
        self.host_busy()
        if not self._started or not self.due(step):
            return SnapshotInfo()
        if self.link is not None and not self._saver_lost and self.link.lost.is_set():
            self._saver_gone("it closed its connection")
        if self._saver_lost:
            with self._lock:
                self.skipped += 1
            return SnapshotInfo(skipped=True)
        if not healthy:
            with self._lock:
                self.refused += 1
            self._log(f"step {step}: not snapshotted: {why or 'its state is not healthy'}", kind="refused")
            return SnapshotInfo(refused=True)
        if self._defers:  # the last snapshot's copy should have run at this step's idle moment
            self._drop_deferred("its copy had not started when the next step ended (copy_at_idle needs "
                                "host_idle() or before_update() before the state changes)")
        t0 = time.perf_counter()
        tensors, meta, key = self._reader.read()
        identity = (key, tuple(tensors[MODEL_FILE]), tuple(tensors[OPTIM_FILE]))
        memcpy = None
        if self.cfg.measure_memcpy and step % 2 == 0:  # the reference copy goes first on even steps, last on odd
            t1 = time.perf_counter()
            memcpy = self._measure_memcpy(tensors, identity)
            t0 += time.perf_counter() - t1  # not part of the blocking time
        slot = self._take_slot(tensors, identity)
        waited = None
        if slot is None:
            waited = self._await_free_slot(step)
            if waited is not None:
                slot = self._take_slot(tensors, identity)
        waited = waited or 0.0
        if slot is None:
            with self._lock:
                self.skipped += 1
            return SnapshotInfo(blocking_s=time.perf_counter() - t0, skipped=True, memcpy_s=memcpy, waited_s=waited)
        if self.link is not None:
            try:
                self.link.send({"op": "fill", "slot": slot.index})  # its memory snapshot is no more
            except OSError as exc:  # the saver is gone (killed, out of memory): training goes on without
                with self._lock:
                    slot.busy = False
                    self.skipped += 1
                self._saver_gone(str(exc))
                return SnapshotInfo(blocking_s=time.perf_counter() - t0, skipped=True, memcpy_s=memcpy)
        slot.step = step
        slot.meta = meta
        slot.data_position = dict(data_position or {"next_step": step + 1})
        if self._defers:  # copied while the host idles, before the next update (the copier thread)
            with self._lock:
                self._deferred = (slot, tensors, identity)
                self._deferred_at = time.monotonic()
                self.snapshots += 1
                self._copied.notify_all()  # the copier's deadline starts now
            blocking = time.perf_counter() - t0
        else:
            filled = self._fill(slot, tensors, identity)
            if filled is None:
                return SnapshotInfo(blocking_s=time.perf_counter() - t0, skipped=True, memcpy_s=memcpy)
            with self._lock:
                self.snapshots += 1
            self._publish(filled)
            blocking = time.perf_counter() - t0
        if self.cfg.measure_memcpy and memcpy is None:
            memcpy = self._measure_memcpy(tensors, identity)
        return SnapshotInfo(blocking_s=blocking, taken=True, memcpy_s=memcpy, waited_s=waited)

    def _await_free_slot(self, step: int) -> float | None:
        """Back-pressure: both buffers are still being persisted. Wait until the persister frees one, at most
        ``backpressure_wait_s``; meanwhile this rank's host idles (the training thread waits), so the saver
        process is told to persist now instead of at the next idle moment. Returns the seconds waited, or None
        when the snapshot is skipped at once (waiting is off, the buffers are being laid out, or an earlier
        wait ran out and the persister has freed nothing since). A wait that runs out leaves the rank
        *stalled*, skipping due steps without waiting until the persister frees a buffer."""
        limit = self.cfg.backpressure_wait_s
        with self._lock:
            if limit <= 0 or self._stalled or not self._slots or self._configuring is not None:
                return None
            if not all(s.busy for s in self._slots):
                return 0.0  # freed since the caller looked: take it
        t0 = time.monotonic()
        if self._board is not None:
            self._board.mark(IDLE)
        if self.link is not None:  # persist what is queued now (a "quiet" would also gate later snapshots)
            self.link.post(lambda: {"op": "now"})
        free = False
        try:
            with self._lock:
                deadline = t0 + limit
                while not self._stop.is_set() and not (self.link is not None and self.link.lost.is_set()):
                    free = bool(self._slots) and any(not s.busy for s in self._slots)
                    left = deadline - time.monotonic()
                    if free or left <= 0:
                        break
                    self._persisted.wait(min(left, 0.25))  # the saver's loss is noticed within 0.25 s
                self._stalled = not free
                waited = time.monotonic() - t0
                self.waits += 1
                self.waited_s += waited
        finally:
            if self._board is not None:
                self._board.mark(BUSY)
        if free:
            self._log(f"step {step}: both snapshot buffers were still being persisted; waited {waited:.3f}s for "
                      f"one (the {self.cfg.saver} persists slower than the job steps; if this repeats, raise "
                      f"--checkpoint-every)", kind="backpressure")
        else:
            self._error(f"step {step}: snapshot skipped: no buffer was freed within {limit:g}s; due steps skip "
                        f"without waiting until the {self.cfg.saver} persister frees one", kind="stalled")
        return waited

    def _saver_gone(self, why: str) -> None:
        """The saver process died: snapshots stop for this run (the training goes on), and its buffers go from
        /dev/shm (it cannot remove them itself; a new saver never reuses a dead one's). This process keeps its
        mappings until it ends, so nothing it still holds becomes invalid."""
        self._saver_lost = True
        for slot in self._slots:
            for shm in slot.mapped:
                with contextlib.suppress(OSError):
                    shm.path.unlink()
        self._error(f"the checkpoint saver is gone ({why}); no more snapshots in this run: restart the job to "
                    f"start a new one", kind="saver-lost")

    def _fill(self, slot: _Slot, tensors: dict[str, dict[str, torch.Tensor]], identity: tuple[Any, ...],
              ) -> _Slot | None:
        """Copy the state into ``slot``; the slot that holds it (a new one when a tensor changed shape in
        place since the buffers were laid out), or None (the snapshot skipped, its buffer freed) when they
        live in the saver's memory."""
        try:
            self._copy_into(slot, tensors, identity)
            return slot
        except RuntimeError:  # a tensor changed shape in place since the slot was laid out
            if self.link is not None:
                with self._lock:
                    slot.busy = False
                    self._slots = []  # laid out anew (both buffers) at the next snapshot
                    self.skipped += 1
                return None
            with self._lock:
                fresh = _Slot(tensors, self.use_cuda, identity)
                fresh.busy, fresh.step, fresh.meta, fresh.data_position = True, slot.step, slot.meta, \
                    slot.data_position
                self._slots[self._slots.index(slot)] = fresh
            self._copy_into(fresh, tensors, identity)
            return fresh

    def _publish(self, slot: _Slot) -> None:
        """A filled snapshot goes to the saver process, or to the writer thread."""
        if self.link is not None:
            self._hand_over(slot)
        else:
            self._writer_q.put(slot)

    def _copier_loop(self) -> None:
        """``copy_at_idle``: copy each deferred snapshot once the host idles (or the update is due), or at the
        latest twice the loop's usual time to its idle moment after ``after_step`` (at least ``COPY_LATEST_S``):
        a step that never gets there (a hung collective, a rank blocked on a dead peer) must not cost the
        snapshot of the step before it, which the state still holds."""
        while True:
            with self._lock:
                while not self._stop.is_set():
                    if self._deferred is not None:
                        left = self._deferred_at + max(COPY_LATEST_S, 2 * self._idle_gap_s) - time.monotonic()
                        if self._copy_go or left <= 0:
                            self._copy_go = True
                            break
                        self._copied.wait(left)
                    else:
                        self._copied.wait()
                if self._deferred is None or not self._copy_go:
                    return  # closing, nothing left to copy
                slot, tensors, identity = self._deferred
            published = False
            try:
                filled = self._fill(slot, tensors, identity)
                if filled is not None:
                    self._publish(filled)
                    published = True
            except Exception as exc:  # report it; the training thread must never wait for a dead copier
                self._error(f"step {slot.step}: snapshot copy failed: {type(exc).__name__}: {exc}", kind="copy")
                with self._lock:
                    slot.busy = False
                    self.skipped += 1
            finally:
                with self._lock:
                    if not published:  # never to be processed: drain() must not wait for it
                        self.snapshots -= 1
                    self._deferred = None
                    self._copy_go = False
                    self._copied.notify_all()
            if published and self.link is not None:
                self.link.post(self._quiet)  # the host idles now: the saver persists this snapshot at once

    def _drop_deferred(self, why: str = "") -> None:
        """Forget a deferred snapshot whose copy has not started (its buffer freed, counted skipped); one
        being copied is waited for instead."""
        with self._lock:
            while self._deferred is not None and self._copy_go:
                self._copied.wait()
            pending, self._deferred = self._deferred, None
            if pending is None:
                return
            pending[0].busy = False
            self.snapshots -= 1
            self.skipped += 1
            self._copied.notify_all()
        if why:
            self._error(f"step {pending[0].step}: snapshot dropped: {why}", kind="deferred")

    def _copy_into(self, slot: _Slot, tensors: dict[str, dict[str, torch.Tensor]], identity: tuple[Any, ...],
                   ) -> None:
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.stream):
                slot.copy_from(tensors, non_blocking=True, identity=identity)
                slot.event = torch.cuda.Event()
                slot.event.record(self.stream)
            self._pending_event = slot.event
        else:
            slot.copy_from(tensors, non_blocking=False, identity=identity)

    def _take_slot(self, tensors: dict[str, dict[str, torch.Tensor]], identity: tuple[Any, ...]) -> _Slot | None:
        if self.link is not None:
            return self._take_shared_slot(tensors, identity)
        with self._lock:
            if not self._slots:
                self._slots = [_Slot(tensors, self.use_cuda, identity), _Slot(tensors, self.use_cuda, identity)]
            for index, slot in enumerate(self._slots):
                if not slot.busy:
                    if not slot.fits(tensors, identity):  # the state changed shape (new optimizer state)
                        self._slots[index] = slot = _Slot(tensors, self.use_cuda, identity)
                    slot.busy = True
                    return slot
        return None

    # ---- the saver process (saver "process") ----------------------------------------------------------
    def _take_shared_slot(self, tensors: dict[str, dict[str, torch.Tensor]],
                          identity: tuple[Any, ...]) -> _Slot | None:
        """A free buffer in the saver's shared memory, the one holding the older snapshot first (the newer
        one is the saver's copy in memory). When the state has no buffers of its shape yet (the first
        snapshot, or the optimizer created its state), the saver is asked for them and this step waits for
        its answer up to ``CONFIGURE_WAIT_S`` (milliseconds when the machine has CPU to spare), then goes on
        without a snapshot; the buffers are used from the next step."""
        with self._lock:
            fits = bool(self._slots) and all(s.fits(tensors, identity) for s in self._slots)
            if fits:
                free = [s for s in self._slots if not s.busy]
                if not free:
                    return None
                slot = min(free, key=lambda s: s.step)
                slot.busy = True
                return slot
            if any(s.busy for s in self._slots) or self._configuring is not None:
                return None  # laid out anew once both are free / once the saver answered
            layouts = {name: ShardLayout.for_tensors(ts) for name, ts in tensors.items()}
            self._configuring = (tensors, identity, layouts)
        assert self.link is not None
        self.link.post(lambda: {"op": "configure", "layouts": {
            name: {"prefix": _b64(lay.prefix), "size": lay.data_bytes, "tensors": lay.describe(),
                   "entries": _entries(lay)}
            for name, lay in layouts.items()}})
        deadline = time.monotonic() + CONFIGURE_WAIT_S
        with self._lock:
            while self._configuring is not None and time.monotonic() < deadline:
                self._persisted.wait(max(0.0, deadline - time.monotonic()))
            if self._slots and all(s.fits(tensors, identity) for s in self._slots):
                self._slots[0].busy = True
                return self._slots[0]
        return None

    def _configured(self, reply: dict[str, Any]) -> None:
        """The saver's buffers for the layout asked for (its reader thread): mapped here, then used."""
        with self._lock:
            pending = self._configuring
        if pending is None:
            return
        tensors, identity, layouts = pending
        slots = []
        try:
            for index, paths in enumerate(reply["slots"]):
                mapped, flats = [], {}
                for name, lay in layouts.items():
                    shm = ShmFile(Path(paths[name]), lay.data_bytes, create=False)
                    mapped.append(shm)
                    flats[name] = torch.frombuffer(shm.mm, dtype=torch.uint8, count=lay.data_bytes) \
                        if lay.data_bytes else torch.empty(0, dtype=torch.uint8)
                    if self.use_cuda and lay.data_bytes:
                        _pin(flats[name], self._log)
                slot = _Slot(tensors, self.use_cuda, identity, flats=flats)
                slot.index, slot.mapped = index, mapped
                slots.append(slot)
        except (OSError, KeyError, ValueError) as exc:
            self._error(f"the saver's snapshot buffers could not be mapped ({exc}); snapshots stop", kind="map")
            with self._lock:
                self._persisted.notify_all()  # _configuring stays set: no new layout is asked for
            return
        with self._lock:
            self._slots, self._configuring = slots, None
            self._persisted.notify_all()

    def _hand_over(self, slot: _Slot) -> None:
        """Tell the saver the buffer holds the snapshot of ``slot.step`` (after the device copy, on GPUs)."""
        assert self.link is not None
        if slot.event is not None:
            slot.event.synchronize()
        every = self.cfg.s3_every_steps
        request = self._s3_requested or (self.s3 is not None and (self.root / layout.S3_REQUEST).exists())
        due = self.s3 is not None and (request or bool(every and (slot.step + 1) % every == 0))
        doc = {"op": "snapshot", "slot": slot.index, "step": slot.step, "created_ts": time.time(),
               "data_position": slot.data_position, "s3": due}
        meta, segment = slot.meta, self.segment
        # the state's description becomes JSON on the link's thread, not the training thread's
        self.link.post(lambda: doc | {"meta": meta_json(meta) | {"segment": segment}})
        if request:
            self._s3_requested = False
            with contextlib.suppress(OSError):
                (self.root / layout.S3_REQUEST).unlink()

    def _saved(self, doc: dict[str, Any]) -> None:
        """The saver's report on one snapshot (its reader thread)."""
        step = int(doc["step"])
        with self._lock:
            for slot in self._slots:
                if slot.index == int(doc["slot"]) and slot.step == step:
                    slot.busy = False
                    self._stalled = False  # the persister frees buffers again: back-pressure waits again
            self._processed += 1
            if doc.get("local") and doc.get("replica"):
                self._mark_done(step)
            self._persisted.notify_all()
        if doc.get("error"):  # repeated ones (every step's) are logged 1st, 10th, 100th ... time
            self._error(str(doc["error"]), kind=re.sub(r"\d+", "N", str(doc["error"]))[:80])

    def _mark_done(self, step: int) -> None:
        """``step`` is on this rank's disk and its replica acknowledged (caller holds the lock): the commit
        thread's next exchange says so."""
        self._done.append(step)
        self._done_count += 1
        self._persisted.notify_all()

    def _start_saver(self) -> None:
        """Every rank: tell its saver where its backup's saver listens and what the snapshots share."""
        assert self.link is not None
        mine = {"host": self.link.host, "port": self.link.port, "token": uuid.uuid4().hex}
        everyone = wire.gather_json(mine, self.ctl, self.world) if self.distributed else [mine]
        backup = None
        if self.replicate and self.backup is not None:
            b = everyone[self.backup]
            backup = {"rank": self.backup, "address": [b["host"], int(b["port"])]}
        coords = self.placement.coords(self.rank)
        reply = self.link.request({"op": "static", "static": {
            "token": everyone[0]["token"], "backup": backup, "world_size": self.world,
            "topology": {"tp": self.placement.tp, "pp": self.placement.pp, "dp": self.placement.dp,
                         "ranks_per_machine": self.placement.ranks_per_machine},
            "coords": {"tp": coords.tp, "pp": coords.pp, "dp": coords.dp}, "machine": self.machine,
            "incarnation": self.incarnation, "fsync": self.cfg.fsync, "s3_url": self.cfg.s3_url,
            "s3_endpoint_url": self.cfg.s3_endpoint_url, "s3_timeout_s": self.cfg.s3_timeout_s,
            "s3_keep": self.cfg.s3_keep, "replica_timeout_s": self.cfg.replica_timeout_s}}, "ready")
        if not reply.get("replica"):
            self._error(f"tier replica: {reply.get('why')}; steps are not committed without it", kind="replica")
        if self.distributed:  # every saver knows its job before any rank sends it a replica
            wire.gather_json({}, self.ctl, self.world)

    def _measure_memcpy(self, tensors: dict[str, dict[str, torch.Tensor]], identity: tuple[Any, ...]) -> float:
        """A plain copy of the same tensors into a spare buffer (the benchmark's reference)."""
        if self._spare is None or not self._spare.fits(tensors, identity):
            self._spare = _Slot(tensors, self.use_cuda, identity)
        return _timed_copy(self._spare, tensors, identity, self.use_cuda)

    def drain(self, timeout_s: float = 60.0) -> bool:
        """Wait until every snapshot taken so far is written and replicated (or failed), and a due S3
        upload has been picked up by the uploader. For tests and benchmarks; training never calls it.
        Returns False on timeout."""
        self._copy_now(wait=True)
        deadline = time.monotonic() + timeout_s
        with self._persisted:
            while self._processed < self.snapshots:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._persisted.wait(left)
        with self._s3_wake:
            while self._s3_next is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._s3_wake.wait(left)
        return True

    def request_s3(self) -> None:
        """Upload the next snapshot to S3 (whatever ``s3_every_steps`` says)."""
        self._s3_requested = True

    # ---- background: writer, receivers, committer, S3 -----------------------------------------
    def start(self) -> None:
        """Start the background threads. Call on every rank, after :meth:`restore`."""
        if self._started:
            return
        self._started = True
        if self._defers:  # the copy is the training's own work, done while its host idles: not niced
            self._spawn("tg-ckpt-copier", self._copier_loop, nice=0)
        if self.link is not None:  # the saver process writes, sends and uploads; the rank commits
            self._board = HostBoard.open()
            if self._board is None:
                self._log("the host's board (trainguard.checkpoint.hostboard) cannot be used privately: the saver "
                          "goes by this rank's idle moments alone", kind="board")
            elif self._board.claim() is None:
                self._board.close()
                self._board = None
            self._start_saver()
            self._commit_thread = self._spawn("tg-ckpt-commit", self._commit_loop)
            return
        self._spawn("tg-ckpt-writer", self._writer_loop)
        for src in self.sources:
            self._spawn(f"tg-ckpt-replica-from-{src}", self._receiver_loop, src)
        if self.s3 is not None:
            self._spawn("tg-ckpt-s3", self._s3_loop)
        self._commit_thread = self._spawn("tg-ckpt-commit", self._commit_loop)

    def _spawn(self, name: str, target: Any, *args: Any, nice: int | None = None) -> threading.Thread:
        nice = self.cfg.background_nice if nice is None else nice

        def run() -> None:
            _lower_priority(nice)
            try:
                target(*args)
            finally:
                with self._lock:
                    self._finished_cpu_s += time.thread_time()
                    self._finished.add(threading.current_thread())

        t = threading.Thread(target=run, name=name, daemon=True)
        t.start()
        self._threads.append(t)
        return t

    def _manifest(self, slot: _Slot, files: list[tuple[str, list[Any]]]) -> bytes:
        sums = files_sha(files)
        coords = self.placement.coords(self.rank)
        return mf.seal(mf.build(
            step=slot.step, rank=self.rank, world_size=self.world,
            topology={"tp": self.placement.tp, "pp": self.placement.pp, "dp": self.placement.dp,
                      "ranks_per_machine": self.placement.ranks_per_machine},
            coords={"tp": coords.tp, "pp": coords.pp, "dp": coords.dp}, machine=self.machine, job=self.job,
            incarnation=self.incarnation, created_ts=time.time(), data_position=slot.data_position,
            state=meta_json(slot.meta) | {"segment": self.segment},
            files=[{"name": name, "size": size, "sha256": sha, "tensors": slot.layouts[name].describe()}
                   for (name, _), (size, sha) in zip(files, sums, strict=True)]))

    def _writer_loop(self) -> None:
        while True:
            slot = self._writer_q.get()
            if slot is None:
                break
            try:
                self._persist(slot)
            except Exception as exc:  # never let the writer die: report and go on with the next snapshot
                self._error(f"step {slot.step}: snapshot failed: {type(exc).__name__}: {exc}", kind="writer")
            finally:
                with self._lock:
                    slot.busy = False
                    self._stalled = False
                    self._processed += 1
                    self._persisted.notify_all()
        if self.s3 is not None:  # the S3 thread uploads what is still waiting, then ends
            with self._s3_wake:
                self._s3_closing = True
                self._s3_wake.notify_all()
        if self.replicate and not self._replica_broken and not self._abandoned.is_set():
            try:
                wire.end_stream(self.data, self.backup)
            except Exception as exc:
                self._error(f"could not close the replica stream to rank {self.backup}: {exc}", kind="end")
        self._writer_finished.set()

    def _persist(self, slot: _Slot) -> None:
        step = slot.step
        if slot.event is not None:
            slot.event.synchronize()
        bad = slot.non_finite()
        if bad:  # whatever the training loop said: a state holding NaN or Inf is never written nor committed
            self._error(f"step {step}: snapshot not kept: {bad}", kind="non-finite")
            return
        files = [(name, slot.parts(name)) for name in STATE_FILES]
        manifest = self._manifest(slot, files)
        dest = layout.copy_dir(self.root, "local", step, self.rank)
        local_ok = False
        try:
            layout.write_copy(dest, manifest, files, fsync=self.cfg.fsync)
            local_ok = True
        except OSError as exc:
            self._error(f"step {step} tier local: write to {dest} failed ({exc.strerror or exc}); "
                        f"this step has no local copy", kind="local-write")
        if self.s3 is not None:
            self._maybe_queue_s3(step, manifest, files)
        replica_ok = not self.replicate
        if self.replicate and not self._replica_broken:
            try:
                wire.send_copy(self.data, self.backup, step=step, manifest=manifest, files=files)
                acked_step, acked = wire.recv_ack(self.data, self.backup)
                replica_ok = acked and acked_step == step
                if not replica_ok:
                    self._error(f"step {step} tier replica: rank {self.backup} refused the replica "
                                f"(checksums did not match after transfer)", kind="replica-refused")
            except Exception as exc:
                self._replica_broken = True
                self._error(f"step {step} tier replica: sending to rank {self.backup} failed "
                            f"({type(exc).__name__}: {str(exc)[:160]}); replication stops", kind="replica")
        if local_ok and replica_ok:
            with self._lock:
                self._mark_done(step)

    def _maybe_queue_s3(self, step: int, manifest: bytes, files: list[tuple[str, list[Any]]]) -> None:
        request = self.root / layout.S3_REQUEST
        requested = self._s3_requested or request.exists()
        every = self.cfg.s3_every_steps
        if not (requested or (every and (step + 1) % every == 0)):
            return
        body = [(name, b"".join(bytes(p) for p in parts)) for name, parts in files]
        with self._s3_wake:
            if self._s3_next is not None:  # the upload before is still running: this newer one replaces it
                self.s3_superseded += 1
            self._s3_next = (step, manifest, body)
            self._s3_wake.notify_all()
        self._s3_requested = False
        if requested:
            with contextlib.suppress(OSError):
                request.unlink()

    def _s3_loop(self) -> None:
        assert self.s3 is not None
        while True:
            with self._s3_wake:
                while self._s3_next is None and not self._s3_closing:
                    self._s3_wake.wait()
                item, self._s3_next = self._s3_next, None
                self._s3_wake.notify_all()  # drain() waits for this
            if item is None:  # closing, nothing left
                break
            step, manifest, body = item
            try:
                self.s3.upload_copy(step, self.rank, body, manifest)
                self.s3_uploaded.append(step)
                self._retain_s3()
            except S3TierError as exc:
                self._error(f"step {step} tier s3: {exc}", kind="s3")

    def _retain_s3(self) -> None:
        assert self.s3 is not None
        while len(self.s3_uploaded) > self.cfg.s3_keep:
            old = self.s3_uploaded[0]
            newer_verified = any(self.s3.is_verified(s, self.rank) for s in list(self.s3_uploaded)[1:])
            if not newer_verified and self.s3.is_verified(old, self.rank):
                break  # the newest verified copy stays
            self.s3.delete_copy(old, self.rank)
            self.s3_uploaded.popleft()

    def _receiver_loop(self, src: int) -> None:
        while True:
            try:
                step, ok, manifest, files = wire.recv_copy(self.data, src)
            except Exception as exc:
                if not self._stop.is_set():
                    self._error(f"tier replica: receiving from rank {src} failed ({type(exc).__name__}: "
                                f"{str(exc)[:160]}); no more replicas of rank {src} here", kind=f"recv-{src}")
                return
            if step == wire.END_OF_STREAM:
                return
            if not ok:
                continue
            dest = layout.copy_dir(self.root, "replica", step, src)
            check = self._check_received(manifest, files, rank=src, step=step, tier="replica", path=dest)
            good = check.ok
            if good:
                try:
                    names = [e["name"] for e in (check.manifest or {})["files"]]
                    layout.write_copy(dest, manifest, [(n, [f]) for n, f in zip(names, files, strict=True)],
                                      extra={layout.REPLICA_INFO: _json_bytes({"holder": self.rank, "owner": src})},
                                      fsync=self.cfg.fsync)
                except OSError as exc:
                    good = False
                    self._error(f"rank {src} step {step} tier replica: write to {dest} failed "
                                f"({exc.strerror or exc})", kind="replica-write")
            else:
                for p in check.problems:
                    self._error(p.line(), kind=f"replica-bad-{src}")
            try:
                wire.send_ack(self.data, src, step, good)
            except Exception as exc:
                self._error(f"tier replica: acknowledging to rank {src} failed ({exc})", kind=f"ack-{src}")
                return

    def _check_received(self, manifest: bytes, files: list[memoryview], *, rank: int, step: int, tier: str,
                        path: Path, deep: bool = False, keep: bool = False) -> CopyCheck:
        names = mf.file_names(manifest)
        data = dict(zip(names, files, strict=False))
        return check_data(manifest, data, machine=self.machine, rank=rank, step=step, tier=tier, path=str(path),
                          deep=deep, keep_files=keep)

    def _commit_loop(self) -> None:
        """Learn which steps are done on every rank; mark them committed; apply retention."""
        retained = 0.0
        while True:
            stopping = self._writer_finished.is_set()  # every snapshot written, replicated and acknowledged
            with self._lock:
                mine = sorted(self._done)
                said = self._done_count
            try:
                everyone = wire.gather_json({"stop": stopping, "done": mine}, self.ctl, self.world)
            except Exception as exc:
                if not self._stop.is_set():
                    self._error(f"commit exchange failed ({type(exc).__name__}: {str(exc)[:160]}); "
                                f"no more commits this run", kind="commit")
                return
            common = set.intersection(*(set(d["done"]) for d in everyone))
            fresh = sorted(common - self.committed)
            if fresh:
                with self._lock:
                    self.committed.update(fresh)
                    while len(self.committed) > max(64, 2 * self.cfg.keep):  # only the newest matter
                        self.committed.discard(min(self.committed))
                for step in fresh:
                    path = layout.copy_dir(self.root, "local", step, self.rank)
                    with contextlib.suppress(OSError):
                        layout.write_marker(path, layout.COMMITTED, {"step": step, "committed_ts": time.time(),
                                                                     "verify": self.cfg.is_candidate(step)})
            # after commits, and every RETAIN_EVERY_S without any: a rank whose replica stopped (or a peer
            # that never acknowledges) must not stop retention, or the disk fills with uncommitted steps
            if fresh or stopping or time.monotonic() - retained >= RETAIN_EVERY_S:
                self._retain()
                retained = time.monotonic()
            if all(d["stop"] for d in everyone):
                return
            if stopping:
                time.sleep(0.01)
                continue
            # the next round: at most every commit_interval_s, once this rank has a step more to say (each
            # round's all-gather and JSON hold the interpreter lock the training thread needs; a round per
            # snapshot is enough), or COMMIT_IDLE_S without one (a rank that finishes none must not keep the
            # others' rounds waiting for long)
            self._stop.wait(self.cfg.commit_interval_s)
            with self._lock:
                self._persisted.wait_for(lambda said=said: self._done_count != said or self._stop.is_set(),
                                         timeout=COMMIT_IDLE_S)

    def _retain(self) -> None:
        """Delete old copies here. Kept: the newest ``keep`` steps that are committed or still in
        flight (newer than the newest committed), and always the newest committed and the newest
        verified step, and the two newest verification candidates newer than it (the control plane
        verifies them later), and any copy a verification has pinned (``verifying.json``, younger than
        ``layout.PIN_TTL_S``). Older uncommitted steps (skipped by some rank) go."""
        groups = [("local", self.rank)] + [("replica", s) for s in self.sources]
        with self._lock:
            committed = set(self.committed)
        newest_committed = max(committed, default=-1)
        for tier, rank in groups:
            copies = layout.list_copies(self.root, tier, rank=rank)
            candidates = sorted((s for s, _r, _p in copies if s in committed or s > newest_committed), reverse=True)
            keep = set(candidates[:self.cfg.keep]) | {newest_committed}
            verified = [s for s, _r, p in copies if (p / layout.VERIFIED).exists()]
            newest_verified = max(verified, default=-1)
            if verified:
                keep.add(newest_verified)
            # held by their step number alone: a restart (empty committed set) or a long wait for the
            # verifier must not drop them; an uncommitted one is displaced by the next candidates
            waiting = sorted((s for s, _r, _p in copies if s > newest_verified and self.cfg.is_candidate(s)),
                             reverse=True)
            keep.update(waiting[:2])
            keep.update(s for s, _r, p in copies if layout.pinned(p))  # a verification is reading it
            for step, _r, path in copies:
                if step not in keep:
                    layout.remove_copy(path)
        if self.rank == min(self.placement.ranks_on(self.machine_index)):  # one rank per machine does the rest
            self._retain_foreign()

    def _retain_foreign(self) -> None:
        """Delete the copies this machine keeps for ranks it no longer serves: local copies of ranks that are not
        its own now, and replicas no rank of it answers for (their holder is not one of its ranks). A machine
        evicted and swapped back in under other ranks, or a standby that served another placement, keeps them
        otherwise: nothing restores from them (a rank restores from its own machine, its replica holder or the
        remote tier), and over a job's recoveries they filled the machines' disks until the disk-full rung
        evicted healthy machines one after another (measured: 256 MiB disks full after 25 recoveries). Step
        folders left empty go too; a copy a verification is reading stays."""
        mine = set(self.placement.ranks_on(self.machine_index))
        for tier in ("local", "replica"):
            for _step, owner, path in layout.list_copies(self.root, tier):
                if tier == "local":
                    foreign = owner not in mine
                else:
                    holder = (layout.read_json(path / layout.REPLICA_INFO) or {}).get("holder")
                    if holder is None:
                        holder = self.placement.backup_rank(owner) if self.replicate else None
                    foreign = holder not in mine
                if foreign and not layout.pinned(path):
                    layout.remove_copy(path)
            base = self.root / tier
            with contextlib.suppress(OSError):
                for step_dir in base.iterdir():  # empty for a minute: not a copy about to be written
                    if step_dir.is_dir() and not any(step_dir.iterdir()) \
                            and time.time() - step_dir.stat().st_mtime > EMPTY_STEP_S:
                        with contextlib.suppress(OSError):
                            step_dir.rmdir()

    # ---- end ---------------------------------------------------------------------------
    def close(self, *, flush: bool = True, timeout_s: float = 120.0) -> None:
        """Stop. With ``flush``, first write and replicate every queued snapshot and commit what every
        rank finished (all ranks must call it); without, just stop (the job is failing)."""
        if not self._started:
            return
        if flush or self.link is not None:
            # a deferred copy still holds its step's state (the optimizer has not run since): the saver process
            # persists it even as this process fails; the threads of a failing process would not
            self._copy_now(wait=True)
        else:
            self._drop_deferred()
        if not flush:
            self._abandoned.set()
        with self._lock:
            self._stop.set()
            self._copied.notify_all()  # the copier ends
            self._persisted.notify_all()  # the commit thread stops waiting for news
        if self._board is not None:  # this rank holds no saver back any more
            self._board.close()
            self._board = None
        if self.link is not None:
            try:
                self.link.close(flush=flush)  # with flush: every snapshot handed over is written and sent
            except OSError as exc:
                if flush:
                    self._error(f"closing: {exc}", kind="close")
            self._writer_finished.set()
        else:
            self._writer_q.put(None)  # the writer then ends the S3 thread and (flushing) the replica stream
        if not flush:
            return
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        stuck = [t.name for t in self._threads if t.is_alive()]
        if stuck:
            self._log(f"closing: {', '.join(stuck)} still running after {timeout_s:.0f}s", kind="close")

    # ---- restore -------------------------------------------------------------------------
    def _my_copies(self) -> list[tuple[int, Path, str]]:
        """``(step, path, tier)`` of the copies this rank answers for: its local ones and the replicas
        it holds for others."""
        found = [(s, p, "local") for s, _r, p in layout.list_copies(self.root, "local", rank=self.rank)]
        for s, owner, p in layout.list_copies(self.root, "replica"):
            info = layout.read_json(p / layout.REPLICA_INFO) or {}
            holder = info.get("holder")
            if holder == self.rank or (holder is None and self.replicate
                                       and self.placement.backup_rank(owner) == self.rank):
                found.append((s, p, "replica"))
        return found

    def _scan(self) -> tuple[list[Holding], list[str]]:
        """The copies this rank holds that pass the cheap check; lines for those that do not."""
        holdings, problems = [], []
        for _step, path, tier in self._my_copies():
            check = inspect_copy(path, machine=self.machine)
            if not check.ok or check.manifest is None:
                problems += [p.line() for p in check.problems]
                continue
            doc = check.manifest
            holdings.append(Holding(check.step, check.rank, tier, self.rank, mf.topology_key(doc),
                                    str(doc.get("state", {}).get("segment", ""))))
        mem = self._memory
        if mem and mem.get("layout"):  # checked when fetched, as any copy
            holdings.append(Holding(int(mem["step"]), self.rank, "memory", self.rank, str(mem["layout"]),
                                    str(mem.get("segment", ""))))
        return holdings, problems

    def restore(self) -> RestoreResult | None:
        """Restore the newest step every rank can get (all ranks call this together, before training).

        Returns None when there is nothing to restore (or restore is "off"); raises
        :class:`RestoreError` when copies exist but no step can be restored on all ranks
        (mode "auto" or "require"), or nothing exists in mode "require".
        """
        t0 = time.monotonic()
        mode = self.cfg.restore
        holdings, problems = self._scan() if mode != "off" else ([], [])
        mine = {"holdings": [h.as_list() for h in holdings], "problems": problems, "segment": self.segment}
        everyone = wire.gather_json(mine, self.ctl, self.world)
        self.segment = everyone[0]["segment"]  # the new segment's id: rank 0's
        for line in problems:
            self._log(line)
        if mode == "off":
            return None
        every = self._not_after(Holding.from_list(item) for doc in everyone for item in doc["holdings"])
        # S3 is the last resort: listed (a boto3 import and a listing, ~0.5 s) only once disks and
        # replicas cannot give every rank the newest step some rank holds; the same decision on every rank
        newest = max((h.step for h in every if h.layout == self.layout_key), default=-1)
        s3_asked = self.s3 is None
        excluded: set[tuple[int, int, str, int]] = set()
        bad_lines: list[str] = [line for doc in everyone for line in doc["problems"]]
        rounds = 0
        while True:
            plan = plan_restore(every, world_size=self.world, layout=self.layout_key, excluded=excluded)
            if not s3_asked and (plan is None or plan.step < newest):
                every += self._not_after(self._list_s3())
                s3_asked = True
                continue
            if not every:
                if mode == "require":
                    raise RestoreError(f"checkpoint: --restore was given but no copy exists on any of the "
                                       f"{self.world} ranks{' or in S3' if self.s3 else ''}; start without --restore")
                return None
            rounds += 1
            if plan is None:
                why = explain(every, world_size=self.world, layout=self.layout_key, excluded=excluded)
                raise RestoreError(
                    f"checkpoint: {len(every)} {UNRESTORABLE} {self.world} "
                    f"ranks: {why}; see the lines above for damaged copies, or pass --no-restore to start "
                    f"from step 0")
            got, failures, lines = self._execute(plan)
            for line in lines:
                self._log(f"restore of step {plan.step}: {line}")
            results = wire.gather_json({"failures": [list(f) for f in failures], "problems": lines},
                                       self.ctl, self.world)
            all_failures = {tuple(f) for doc in results for f in doc["failures"]}
            bad_lines += [line for doc in results for line in doc["problems"]]
            if not all_failures:
                break
            excluded |= all_failures  # type: ignore[arg-type]
        assert got is not None
        self._apply(got)
        src = plan.sources[self.rank]
        self._memory = None
        if src.tier not in ("local", "memory"):  # this machine gets its own copy back (the saver wrote it)
            self._keep_locally(plan.step, got)
        self._drop_newer(plan.step)
        with self._lock:
            self.committed.add(plan.step)
        result = RestoreResult(step=plan.step, tier=src.tier, holder=src.holder if src.tier == "replica" else -1,
                               seconds=time.monotonic() - t0, counts=plan.counts(), rounds=rounds,
                               problems=bad_lines,
                               data_position=dict(got.manifest.get("data_position", {}) if got.manifest else {}))
        with contextlib.suppress(OSError):
            layout.write_json(self.root / "reports" / f"restore-rank{self.rank}-inc{self.incarnation}.json",
                              {"step": result.step, "tier": result.tier, "holder": result.holder,
                               "seconds": result.seconds, "counts": result.counts, "rounds": rounds,
                               "problems": bad_lines, "segment": self.segment, "ts": time.time()})
        return result

    def _not_after(self, holdings: Any) -> list[Holding]:
        limit = self.cfg.restore_max_step
        return [h for h in holdings if limit is None or h.step <= limit]

    def _drop_newer(self, step: int) -> None:
        """Training goes on from ``step``: the copies of later steps here (local, and replicas held for
        others) belong to the timeline that was left and must never be restored; they go. (Copies in
        S3 are superseded as the new timeline uploads the same steps again.)"""
        if self.link is not None:
            with contextlib.suppress(OSError):
                self.link.send({"op": "forget", "after": step})
        newer = [(s, p) for s, p, _tier in self._my_copies() if s > step]
        for _s, p in newer:
            with contextlib.suppress(OSError):
                layout.remove_copy(p)
        dropped = sorted({s for s, _p in newer})
        if dropped:
            self._log(f"restored step {step}: dropped this rank's copies of the later steps "
                      f"{', '.join(map(str, dropped))} (the timeline they belong to was left)", kind="drop-newer")

    def _list_s3(self) -> list[Holding]:
        """What the S3 tier holds: rank 0 lists, every rank takes part in sharing it."""
        assert self.s3 is not None
        listing: list[list[object]] = []
        error = ""
        if self.rank == 0:
            try:
                listing = [Holding(step, rank, "s3", S3_HOLDER, self.layout_key).as_list()
                           for (step, rank) in self.s3.list_copies()]
            except S3TierError as exc:
                error = str(exc)
        shared = wire.gather_json({"s3": listing, "error": error}, self.ctl, self.world)[0]
        if shared["error"]:
            self._log(f"tier s3 unavailable for restore: {shared['error']}")
        return [Holding.from_list(item) for item in shared["s3"]]

    def _execute(self, plan: RestorePlan) -> tuple[CopyCheck | None, set[tuple[int, int, str, int]], list[str]]:
        """Get this rank's copy for ``plan`` (and serve the peers it holds replicas for)."""
        failures: set[tuple[int, int, str, int]] = set()
        lines: list[str] = []
        got: CopyCheck | None = None
        step = plan.step

        def fail(h: Holding, check: CopyCheck | None, what: str = "") -> None:
            failures.add(h.key)
            if check is not None:
                lines.extend(p.line() for p in check.problems)
            if what:
                lines.append(what)

        for holder, owner in plan.transfers():
            h = plan.sources[owner]
            if holder == self.rank:
                check = verify_copy(layout.copy_dir(self.root, "replica", step, owner), machine=self.machine,
                                    keep_files=True)
                if check.ok and not self._same_segment(check, plan):
                    check.problems.append(Problem(self.machine, owner, step, "replica", check.path,
                                                  "copy belongs to another training segment"))
                if check.ok:
                    wire.send_copy(self.data, owner, step=step, manifest=check.manifest_bytes,
                                   files=[(n, [d]) for n, d in check.files.items()], tag=wire.TAG_RESTORE)
                else:
                    wire.send_copy(self.data, owner, step=step, ok=False, tag=wire.TAG_RESTORE)
                    fail(h, check)
            if owner == self.rank:
                rstep, ok, manifest, files = wire.recv_copy(self.data, holder, tag=wire.TAG_RESTORE)
                if not ok or rstep != step:
                    fail(h, None)  # the holder reported why
                    continue
                check = self._check_received(manifest, files, rank=owner, step=step, tier="replica",
                                             path=Path(f"received from rank {holder}"), deep=True, keep=True)
                if check.ok:
                    got = check
                else:
                    fail(h, check)
        src = plan.sources[self.rank]
        check = None
        where = "s3" if src.tier == "s3" else self.machine
        if src.tier == "local":
            check = verify_copy(layout.copy_dir(self.root, "local", step, self.rank), machine=self.machine,
                                keep_files=True)
        elif src.tier == "memory":
            fetched = self.link.fetch(step) if self.link is not None else None
            if fetched is None:
                fail(src, None, f"machine {self.machine} rank {self.rank} step {step} tier memory: the saver no "
                                f"longer holds it")
            else:
                check = check_data(fetched[0], fetched[1], machine=self.machine, rank=self.rank, step=step,
                                   tier="memory", path=f"saver memory of {self.root}", deep=True, keep_files=True)
        elif src.tier == "s3":
            if self.s3 is None:
                fail(src, None, f"machine {self.machine} rank {self.rank} step {step} tier s3: no S3 tier configured")
            else:
                check = check_s3_copy(self.s3, step, self.rank, deep=True, keep_files=True)
                if check.ok and check.manifest and mf.topology_key(check.manifest) != self.layout_key:
                    check.problems.append(Problem("s3", self.rank, step, "s3", check.path,
                                                  f"saved with layout {mf.topology_key(check.manifest)}"))
        if check is not None:  # this rank's own copy (local, memory, S3), judged alike
            if check.ok and not self._same_segment(check, plan):
                check.problems.append(Problem(where, self.rank, step, src.tier, check.path,
                                              "copy belongs to another training segment"))
            if check.ok:
                got = check
            else:
                fail(src, check)
        return got, failures, lines

    @staticmethod
    def _same_segment(check: CopyCheck, plan: RestorePlan) -> bool:
        seg = str((check.manifest or {}).get("state", {}).get("segment", ""))
        return not plan.segment or not seg or seg == plan.segment

    def _apply(self, check: CopyCheck) -> None:
        from safetensors.torch import load

        assert check.manifest is not None
        # load_state_dict copies into the live parameters and moves optimizer state to their devices
        tensors = {name: load(bytes(data)) for name, data in check.files.items()}
        apply_state(self.model, self.optimizer, tensors, check.manifest["state"])

    def _keep_locally(self, step: int, check: CopyCheck) -> None:
        dest = layout.copy_dir(self.root, "local", step, self.rank)
        try:
            layout.write_copy(dest, check.manifest_bytes, [(n, [d]) for n, d in check.files.items()],
                              fsync=self.cfg.fsync)
        except OSError as exc:
            self._error(f"step {step} tier local: keeping the restored copy at {dest} failed "
                        f"({exc.strerror or exc})", kind="local-write")


def _reachable_host() -> str:
    """This machine's address as the job's other machines reach it: the one it uses towards the job's
    rendezvous host (``MASTER_ADDR``)."""
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((master, int(os.environ.get("MASTER_PORT", "29500"))))  # no packet is sent
        return str(s.getsockname()[0])
    return "127.0.0.1"


def _pin(flat: torch.Tensor, log: Any) -> None:
    """Page-lock a shared-memory buffer for the device-to-host copies (CUDA hosts)."""
    rc = torch.cuda.cudart().cudaHostRegister(flat.data_ptr(), flat.numel(), 0)
    if int(rc) != 0:
        log(f"could not page-lock a {flat.numel()}-byte snapshot buffer (cudaHostRegister returned {int(rc)}); "
            f"device-to-host copies into it are synchronous", kind="pin")


def _lower_priority(nice: int) -> None:
    """Lower the calling thread's CPU priority by ``nice`` (Linux nice values are per thread; threads
    it creates inherit it)."""
    if nice and hasattr(os, "setpriority"):
        with contextlib.suppress(OSError):
            tid = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + nice)


def _background_groups(world: int, config: CheckpointConfig) -> tuple[Any, Any]:
    """The checkpoint's control and data gloo groups, created on a thread of lowered priority so that
    the threads gloo starts for them (its transport loop and workers, which copy every replica byte)
    inherit that priority instead of the training thread's."""
    made: dict[str, Any] = {}

    def create() -> None:
        try:
            _lower_priority(config.background_nice)
            ranks = list(range(world))
            made["ctl"] = dist.new_group(ranks, backend="gloo", timeout=timedelta(seconds=config.control_timeout_s))
            made["data"] = dist.new_group(ranks, backend="gloo",
                                          timeout=timedelta(seconds=config.replica_timeout_s))
        except BaseException as exc:  # re-raised on the calling thread
            made["error"] = exc

    t = threading.Thread(target=create, name="tg-ckpt-groups", daemon=True)
    t.start()
    t.join()
    if "error" in made:
        raise made["error"]
    return made["ctl"], made["data"]


def _json_bytes(doc: dict[str, Any]) -> bytes:
    import json

    return json.dumps(doc, sort_keys=True).encode("utf-8")

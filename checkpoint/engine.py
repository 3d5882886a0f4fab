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
  (:meth:`trainguard.core.topology.Topology.backup_rank`: shares none of its TP, PP,
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
import socket
import threading
import time
import uuid
from collections import deque
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from trainguard.checkpoint import layout, timing
from trainguard.checkpoint.commit import Committing
from trainguard.checkpoint.config import CheckpointConfig
from trainguard.checkpoint.errors import CheckpointError
from trainguard.checkpoint.hostboard import HostBoard
from trainguard.checkpoint.persist import Persisting
from trainguard.checkpoint.replicate import Replicating
from trainguard.checkpoint.restore import Restoring
from trainguard.checkpoint.s3 import open_tier
from trainguard.checkpoint.saverlink import SaverLink
from trainguard.checkpoint.shards import (
    StateReader,
)
from trainguard.checkpoint.slots import Slot
from trainguard.checkpoint.snapshots import Snapshotting
from trainguard.core.topology import Topology

LOG = logging.getLogger("trainguard.checkpoint")


class Checkpointer(Snapshotting, Persisting, Replicating, Committing, Restoring):
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
        self._slots: list[Slot] = []
        self._reader = StateReader(model, optimizer)
        self._spare: Slot | None = None
        self._pending_event: Any = None
        # copy_at_idle: the snapshot taken by after_step whose copy waits for the host to idle (its buffer,
        # tensors, their identity, and (step, meta, data position), which the copier labels the buffer with),
        # and whether the copier may start it (host_idle or before_update said so)
        self._deferred: tuple[Slot, dict[str, dict[str, torch.Tensor]], tuple[Any, ...],
                              tuple[int, dict[str, Any], dict[str, Any]]] | None = None
        self._copy_go = False
        self._copied = threading.Condition(self._lock)
        self._deferred_at = 0.0  # when after_step deferred it (monotonic)
        self._idle_gap_s = timing.COPY_LATEST_S / 2  # how long the host usually takes from after_step to host_idle
        # the host's board (hostboard): this rank's busy and idle moments, for every saver of the host
        self._board: HostBoard | None = None
        self._idle_at: float | None = None  # when host_idle() last said so (monotonic); None while busy
        self._idle_span_s = 0.0  # how long this rank's host usually idles (host_idle() to its next busy moment)
        self._writer_q: queue.Queue[Slot | None] = queue.Queue()
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


    # ---- the saver process (saver "process") ----------------------------------------------------------

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


def _reachable_host() -> str:
    """This machine's address as the job's other machines reach it: the one it uses towards the job's
    rendezvous host (``MASTER_ADDR``)."""
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((master, int(os.environ.get("MASTER_PORT", "29500"))))  # no packet is sent
        return str(s.getsockname()[0])
    return "127.0.0.1"


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



"""The training thread's side of a :class:`trainguard.checkpoint.engine.Checkpointer`: a step's snapshot into
one of two buffers (at once, or at the host's idle moment with ``copy_at_idle``), back-pressure, and the
buffers' allocation (in this process, or in the saver process's shared memory).

Its methods use the state ``Checkpointer.__init__`` sets up; the class is one of the checkpointer's bases."""

from __future__ import annotations

import time
from typing import Any

import torch

from trainguard.checkpoint import timing
from trainguard.checkpoint.hostboard import BUSY, IDLE
from trainguard.checkpoint.info import SnapshotInfo
from trainguard.checkpoint.saverproto import b64
from trainguard.checkpoint.shards import MODEL_FILE, OPTIM_FILE, ShardLayout
from trainguard.checkpoint.slots import Slot, entries, timed_copy


class Snapshotting:
    """Taking snapshots: the training thread's calls and the copier thread.
    A part of :class:`~trainguard.checkpoint.engine.Checkpointer`."""

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
        # the saver forgets the buffer's snapshot before it is overwritten: now, or (copy_at_idle) by the copier
        if self.link is not None and not self._defers and not self._tell_filling(slot):
            return SnapshotInfo(blocking_s=time.perf_counter() - t0, skipped=True, memcpy_s=memcpy)
        what = (step, meta, dict(data_position or {"next_step": step + 1}))
        if self._defers:  # copied while the host idles, before the next update (the copier thread), which
            # labels the buffer: one dropped before its copy still holds (and is labelled) the step it held
            with self._lock:
                self._deferred = (slot, tensors, identity, what)
                self._deferred_at = time.monotonic()
                self.snapshots += 1
                self._copied.notify_all()  # the copier's deadline starts now
            blocking = time.perf_counter() - t0
        else:
            slot.step, slot.meta, slot.data_position = what
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

    def _tell_filling(self, slot: Slot) -> bool:
        """Tell the saver that ``slot``'s snapshot in its memory is about to be overwritten; False (the buffer
        freed, the snapshot counted skipped) when the saver is gone (killed, out of memory): training goes on
        without it."""
        assert self.link is not None
        try:
            self.link.send({"op": "fill", "slot": slot.index})
            return True
        except OSError as exc:
            with self._lock:
                slot.busy = False
                self.skipped += 1
            self._saver_gone(str(exc))
            return False

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
                      f"one (the {self.cfg.saver} persists slower than the job steps; if this repeats, take a "
                      f"snapshot every few steps: CheckpointConfig(every_steps=N), or the reference job's "
                      f"--checkpoint-every N)", kind="backpressure")
        else:
            self._error(f"step {step}: snapshot skipped: no buffer was freed within {limit:g}s; due steps skip "
                        f"without waiting until the {self.cfg.saver} persister frees one", kind="stalled")
        return waited

    def _fill(self, slot: Slot, tensors: dict[str, dict[str, torch.Tensor]], identity: tuple[Any, ...],
              ) -> Slot | None:
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
                fresh = Slot(tensors, self.use_cuda, identity)
                fresh.busy, fresh.step, fresh.meta, fresh.data_position = True, slot.step, slot.meta, \
                    slot.data_position
                self._slots[self._slots.index(slot)] = fresh
            self._copy_into(fresh, tensors, identity)
            return fresh

    def _publish(self, slot: Slot) -> None:
        """A filled snapshot goes to the saver process, or to the writer thread."""
        if self.link is not None:
            self._hand_over(slot)
        else:
            self._writer_q.put(slot)

    def _copier_loop(self) -> None:
        """``copy_at_idle``: copy each deferred snapshot once the host idles (or the update is due), or at the
        latest twice the loop's usual time to its idle moment after ``after_step`` (at least ``timing.COPY_LATEST_S``):
        a step that never gets there (a hung collective, a rank blocked on a dead peer) must not cost the
        snapshot of the step before it, which the state still holds."""
        while True:
            with self._lock:
                while not self._stop.is_set():
                    if self._deferred is not None:
                        left = self._deferred_at + max(timing.COPY_LATEST_S, 2 * self._idle_gap_s) - time.monotonic()
                        if self._copy_go or left <= 0:
                            self._copy_go = True
                            break
                        self._copied.wait(left)
                    else:
                        self._copied.wait()
                if self._deferred is None or not self._copy_go:
                    return  # closing, nothing left to copy
                slot, tensors, identity, (step, meta, position) = self._deferred
            published = False
            try:
                # the saver forgets the buffer's snapshot before it is overwritten (False: the saver is gone)
                if self.link is None or self._tell_filling(slot):
                    with self._lock:
                        slot.step, slot.meta, slot.data_position = step, meta, position
                    filled = self._fill(slot, tensors, identity)
                    if filled is not None:
                        self._publish(filled)
                        published = True
            except Exception as exc:  # report it; the training thread must never wait for a dead copier
                with self._lock:
                    slot.busy = False
                    self.skipped += 1
                self._error(f"step {step}: snapshot copy failed: {type(exc).__name__}: {exc}", kind="copy")
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
            self._error(f"step {pending[3][0]}: snapshot dropped: {why}", kind="deferred")

    def _copy_into(self, slot: Slot, tensors: dict[str, dict[str, torch.Tensor]], identity: tuple[Any, ...],
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

    def _take_slot(self, tensors: dict[str, dict[str, torch.Tensor]], identity: tuple[Any, ...]) -> Slot | None:
        if self.link is not None:
            return self._take_shared_slot(tensors, identity)
        with self._lock:
            if not self._slots:
                self._slots = [Slot(tensors, self.use_cuda, identity), Slot(tensors, self.use_cuda, identity)]
            for index, slot in enumerate(self._slots):
                if not slot.busy:
                    if not slot.fits(tensors, identity):  # the state changed shape (new optimizer state)
                        self._slots[index] = slot = Slot(tensors, self.use_cuda, identity)
                    slot.busy = True
                    return slot
        return None

    def _take_shared_slot(self, tensors: dict[str, dict[str, torch.Tensor]],
                          identity: tuple[Any, ...]) -> Slot | None:
        """A free buffer in the saver's shared memory, the one holding the older snapshot first (the newer
        one is the saver's copy in memory). When the state has no buffers of its shape yet (the first
        snapshot, or the optimizer created its state), the saver is asked for them and this step waits for
        its answer up to ``timing.CONFIGURE_WAIT_S`` (milliseconds when the machine has CPU to spare), then goes on
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
            name: {"prefix": b64(lay.prefix), "size": lay.data_bytes, "tensors": lay.describe(),
                   "entries": entries(lay)}
            for name, lay in layouts.items()}})
        deadline = time.monotonic() + timing.CONFIGURE_WAIT_S
        with self._lock:
            while self._configuring is not None and time.monotonic() < deadline:
                self._persisted.wait(max(0.0, deadline - time.monotonic()))
            if self._slots and all(s.fits(tensors, identity) for s in self._slots):
                self._slots[0].busy = True
                return self._slots[0]
        return None

    def _measure_memcpy(self, tensors: dict[str, dict[str, torch.Tensor]], identity: tuple[Any, ...]) -> float:
        """A plain copy of the same tensors into a spare buffer (the benchmark's reference)."""
        if self._spare is None or not self._spare.fits(tensors, identity):
            self._spare = Slot(tensors, self.use_cuda, identity)
        return timed_copy(self._spare, tensors, identity, self.use_cuda)

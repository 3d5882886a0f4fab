"""Persisting a :class:`trainguard.checkpoint.engine.Checkpointer`'s snapshots: the writer thread (local disk,
the replica to the backup rank, the S3 queue) or the saver process that does the same (its link's callbacks),
and the S3 uploader with its retention.

Its methods use the state ``Checkpointer.__init__`` sets up; the class is one of the checkpointer's bases."""

from __future__ import annotations

import contextlib
import re
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from trainguard.checkpoint import layout, wire
from trainguard.checkpoint import manifest as mf
from trainguard.checkpoint.errors import S3TierError
from trainguard.checkpoint.saverproto import ShmFile, files_sha
from trainguard.checkpoint.shards import STATE_FILES, meta_json
from trainguard.checkpoint.slots import Slot, pin


class Persisting:
    """Persisting snapshots: the writer thread or the saver process, and the S3 uploader.
    A part of :class:`~trainguard.checkpoint.engine.Checkpointer`."""

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
                        pin(flats[name], self._log)
                slot = Slot(tensors, self.use_cuda, identity, flats=flats)
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

    def _hand_over(self, slot: Slot) -> None:
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

    def request_s3(self) -> None:
        """Upload the next snapshot to S3 (whatever ``s3_every_steps`` says)."""
        self._s3_requested = True

    def _manifest(self, slot: Slot, files: list[tuple[str, list[Any]]]) -> bytes:
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

    def _persist(self, slot: Slot) -> None:
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

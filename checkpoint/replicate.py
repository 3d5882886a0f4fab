"""The replica tier of a :class:`trainguard.checkpoint.engine.Checkpointer`: receiving the snapshots of the ranks
this rank backs up, checked against their manifests before they are acknowledged.

Its methods use the state ``Checkpointer.__init__`` sets up; the class is one of the checkpointer's bases."""

from __future__ import annotations

import json
from pathlib import Path

from trainguard.checkpoint import layout, wire
from trainguard.checkpoint import manifest as mf
from trainguard.checkpoint.verify import CopyCheck, check_data


class Replicating:
    """Receiving and checking the replicas of the ranks this rank backs up.
    A part of :class:`~trainguard.checkpoint.engine.Checkpointer`."""

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
                    info = json.dumps({"holder": self.rank, "owner": src}, sort_keys=True).encode()
                    layout.write_copy(dest, manifest, [(n, [f]) for n, f in zip(names, files, strict=True)],
                                      extra={layout.REPLICA_INFO: info}, fsync=self.cfg.fsync)
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

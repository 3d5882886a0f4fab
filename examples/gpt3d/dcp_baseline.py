"""The peer a user would pick instead of trainguard's checkpoints: ``torch.distributed.checkpoint.async_save``.

``--dcp-dir DIR`` makes the reference job checkpoint every step with PyTorch's distributed checkpoint
(DCP), as its documentation shows: the model's and optimizer's state dicts (``get_state_dict``) saved
with ``async_save`` (its default: staging on the training thread, the writing on a thread of the
process), the previous save waited for before the next one starts. Every rank's entries carry its rank
(``r<rank>.``), so that DCP stores each rank's shard instead of treating same-named tensors of
different ranks as one replicated tensor. ``DIR/step_<n>`` holds a step on storage every rank reaches;
the three newest are kept. ``--dcp-restore`` loads the newest complete step before training.

The benchmark (``bench/checkpoint.py``) runs it against trainguard's checkpoints on the same job, the
same steps and the same disk.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

KEEP = 3


class DcpCheckpointer:
    def __init__(self, root: Path, *, rank: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.root = Path(root)
        self.rank = rank
        self.model = model
        self.optimizer = optimizer
        self.future: Any = None
        self.saved: list[int] = []
        self.group = dist.new_group(backend="gloo")  # DCP's own collectives, off the training's groups
        if rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)

    def _state(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {f"r{self.rank}": {"model": model_sd, "optim": optim_sd}}

    def save(self, step: int) -> float:
        """Checkpoint the state after ``step``; the seconds the training thread spent here."""
        t0 = time.perf_counter()
        self._finish()
        self.future = dcp.async_save(self._state(), checkpoint_id=str(self.root / f"step_{step}"),
                                     process_group=self.group)
        self.saved.append(step)
        return time.perf_counter() - t0

    def _finish(self) -> None:
        if self.future is None:
            return
        self.future.result()
        self.future = None
        if self.rank == 0:  # every rank's part of the last step is written: the oldest beyond KEEP go
            for old in self.saved[:-KEEP]:
                shutil.rmtree(self.root / f"step_{old}", ignore_errors=True)
        del self.saved[:-KEEP]

    def restore(self) -> tuple[int, float] | None:
        """Load the newest complete step (all ranks together); ``(step, seconds)``, or None."""
        t0 = time.perf_counter()
        done = sorted((int(p.name.split("_")[1]) for p in self.root.glob("step_*") if (p / ".metadata").exists()),
                      reverse=True) if self.root.is_dir() else []
        newest = torch.tensor([done[0] if done else -1], dtype=torch.int64)
        dist.broadcast(newest, src=0, group=self.group)  # rank 0's listing decides, for all
        step = int(newest.item())
        if step < 0:
            return None
        state = self._state()
        dcp.load(state, checkpoint_id=str(self.root / f"step_{step}"), process_group=self.group)
        mine = state[f"r{self.rank}"]
        set_state_dict(self.model, self.optimizer, model_state_dict=mine["model"], optim_state_dict=mine["optim"])
        return step, time.perf_counter() - t0

    def close(self) -> None:
        self._finish()

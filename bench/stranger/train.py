"""A program trainguard's authors did not write, guarded as its docs say: Lightning's own ``BoringModel`` (from
``lightning.pytorch.demos.boring_classes``, installed with Lightning) fitted by Lightning's own loop with DDP,
gradient accumulation over 2 micro-batches and its own validation every 200 batches. Its steps take a few
milliseconds. The lines marked ``# trainguard`` are the guard; the loader is a resumable one, as the guide asks of
a loop that restores mid-epoch (docs/guard-your-job.md).

``--record DIR``: each rank writes the indexes of the samples each micro-batch trained, by optimizer step, to
``DIR/samples-<rank>-<incarnation>-<pid>-<ns>.jsonl``, one file per process (what a check that no sample is
trained twice or skipped reads).
The indexes are found by value (``RandomDataset``'s rows are distinct), so the model and the loop stay Lightning's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

from trainguard.lightning import TrainguardCallback  # trainguard
from trainguard.torch import TrainguardError  # trainguard


class Record(L.Callback):
    """The samples each micro-batch holds (by value: ``RandomDataset``'s rows are distinct), by optimizer step."""

    def __init__(self, folder: Path, data: RandomDataset) -> None:
        self.index = {tuple(row[:4].tolist()): i for i, row in enumerate(data.data)}
        rank, inc = os.environ.get("RANK", "0"), os.environ.get("TG_INCARNATION", "0")
        folder.mkdir(parents=True, exist_ok=True)
        name = f"samples-{rank}-{inc}-{os.getpid()}-{time.time_ns()}.jsonl"  # one file per process, never reused
        self.out = open(folder / name, "x", buffering=1)  # noqa: SIM115
        self.step = 0

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self.step = trainer.global_step  # the optimizer step this micro-batch belongs to

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        idx = [self.index[tuple(row[:4].tolist())] for row in batch]
        self.out.write(json.dumps({"step": self.step, "epoch": trainer.current_epoch, "idx": idx,
                                   "ts": time.time()}) + "\n")


class Paced(BoringModel):
    """``BoringModel`` whose micro-batch also waits ``pace_s`` as a bigger model's device would keep the host
    waiting: a third in its forward, the rest in its backward (a hook on the output's gradient)."""

    def __init__(self, pace_s: float) -> None:
        super().__init__()
        self.pace_s = pace_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.pace_s / 3)
        out = super().forward(x)
        if out.requires_grad:
            out.register_hook(lambda grad: time.sleep(2 * self.pace_s / 3))
        return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="boring")
    p.add_argument("--samples", type=int, default=4096)
    p.add_argument("--record", default="", help="write each micro-batch's sample indexes under this folder")
    p.add_argument("--pace-s", type=float, default=0.0,
                   help="each micro-batch also waits this long, as a bigger model's device compute would")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    data = RandomDataset(32, args.samples)
    sampler = StatefulDistributedSampler(data, num_replicas=world, rank=int(os.environ.get("RANK", "0")), seed=0)
    train = StatefulDataLoader(data, batch_size=2, sampler=sampler, generator=torch.Generator().manual_seed(0))
    val = DataLoader(RandomDataset(32, 64), batch_size=2)
    # the record of a micro-batch is written before the guard's snapshot of its step: a process killed between the
    # two then trained the step again from the snapshot before (recorded twice, the later kept), never trained a
    # step whose record it did not write
    callbacks: list[L.Callback] = [Record(Path(args.record), data)] if args.record else []
    callbacks.append(TrainguardCallback())  # trainguard
    trainer = L.Trainer(accelerator="cpu", devices=local, num_nodes=world // local,
                        strategy="ddp" if world > 1 else "auto", max_epochs=-1, accumulate_grad_batches=2,
                        val_check_interval=200, limit_val_batches=8, num_sanity_val_steps=0,
                        callbacks=callbacks, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    try:
        trainer.fit(Paced(args.pace_s) if args.pace_s > 0 else BoringModel(), train, val)
    except TrainguardError as exc:  # trainguard
        print(f"boring: error: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())

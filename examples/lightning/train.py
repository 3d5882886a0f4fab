"""PyTorch Lightning under trainguard: Lightning's own demo transformer (``lightning.pytorch.demos``) trained by
a ``Trainer`` with DDP, guarded by one callback.

Runs under torchrun (each process one Lightning device) or alone::

    torchrun --nproc-per-node 2 examples/lightning/train.py --steps 50
    python examples/lightning/train.py --steps 50 --checkpoint-dir /tmp/ckpt

The data are synthetic token sequences that follow a fixed random bigram table (nothing to download), served
by torchdata's ``StatefulDataLoader`` so that an epoch resumes at the batch after the restored step. The lines
marked ``# trainguard`` are all the guard asks of the script.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import lightning as L
import torch
from lightning.pytorch.demos import LightningTransformer
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler

from trainguard.lightning import TrainguardCallback  # trainguard
from trainguard.torch import TrainguardError, checkpoint_config_from_env  # trainguard


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="lightning-demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=100, help="optimizer steps to run; 0 = until stopped (default 100)")
    p.add_argument("--batch", type=int, default=8, help="sequences per rank and step")
    p.add_argument("--seq", type=int, default=32, help="tokens per sequence")
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--samples", type=int, default=2048, help="sequences in the data set (one epoch)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step-time-s", type=float, default=0.0,
                   help="sleep this long in each step, as a real model's compute would take (paces a demo)")
    p.add_argument("--checkpoint-dir", default="",
                   help="checkpoint root when run outside a trainguard launch (a launch sets TG_CHECKPOINT)")
    return p.parse_args(argv)


class BigramTokens(Dataset):
    """Sequence ``i``: tokens that follow a fixed random bigram table 90% of the time (a function of ``i``)."""

    def __init__(self, samples: int, seq: int, vocab: int, seed: int) -> None:
        self.samples, self.seq, self.vocab, self.seed = samples, seq, vocab, seed
        self.table = torch.randint(0, vocab, (vocab,), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        tokens = torch.empty(self.seq + 1, dtype=torch.long)
        tokens[0] = int(torch.randint(0, self.vocab, (1,), generator=g))
        for t in range(self.seq):
            keep = bool(torch.rand(1, generator=g) < 0.9)
            tokens[t + 1] = self.table[tokens[t]] if keep else int(torch.randint(0, self.vocab, (1,), generator=g))
        return tokens[:-1], tokens[1:]


class Demo(LightningTransformer):
    """Lightning's demo model as it is, but for its data: this one trains on the loader given to ``fit`` and
    downloads nothing (the demo's own ``prepare_data`` fetches WikiText-2)."""

    def prepare_data(self) -> None:
        pass


class Pace(L.Callback):
    """The stand-in for a bigger model's compute: each step takes at least this long."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        time.sleep(self.seconds)


class PrintLoss(L.Callback):
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, *args: Any) -> None:
        if trainer.global_rank == 0:
            print(f"step {trainer.global_step - 1} loss {float(outputs['loss']):.6f}", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    L.seed_everything(args.seed, verbose=False)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    model = Demo(vocab_size=args.vocab)
    data = BigramTokens(args.samples, args.seq, args.vocab, args.seed)
    # each rank its part of the data, shuffled anew each epoch (Lightning sets the epoch); a resumable loader
    sampler = StatefulDistributedSampler(data, num_replicas=world, rank=int(os.environ.get("RANK", "0")),
                                         seed=args.seed)
    loader = StatefulDataLoader(data, batch_size=args.batch, sampler=sampler,
                                generator=torch.Generator().manual_seed(args.seed))  # no draws from the global one
    checkpoint = checkpoint_config_from_env(root=args.checkpoint_dir) if args.checkpoint_dir else None  # trainguard
    guard = TrainguardCallback(checkpoint=checkpoint)  # trainguard
    callbacks: list[L.Callback] = [guard, PrintLoss()] + ([Pace(args.step_time_s)] if args.step_time_s > 0 else [])
    trainer = L.Trainer(accelerator="cpu", devices=local, num_nodes=world // local,
                        strategy="ddp" if world > 1 else "auto", max_steps=args.steps or -1, max_epochs=-1,
                        callbacks=callbacks, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    try:
        trainer.fit(model, loader)
    except TrainguardError as exc:  # e.g. checkpoints exist but none can be restored: one line
        print(f"lightning-demo: error: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())

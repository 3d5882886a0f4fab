"""A plain PyTorch FSDP2 training script under trainguard: a small causal language model whose blocks are
sharded with ``torch.distributed.fsdp.fully_shard`` (ZeRO-3: parameters, gradients and optimizer state split
across the ranks).

Runs under torchrun (gloo on CPU, nccl on GPUs)::

    torchrun --nproc-per-node 2 examples/fsdp2/train.py --steps 50 --checkpoint-dir /tmp/ckpt

The guard snapshots each rank's own shards (FSDP2's DTensors, local parts) every step and restores them onto
the same number of ranks. Each step's tokens come from a generator seeded by (seed, step, rank), so a restored
run sees exactly the batches the uninterrupted one saw. The lines marked ``# trainguard`` are all the guard asks.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

from checkpoint import export  # this folder's own module named "checkpoint"
from trainguard.torch import Guard, TrainguardError, checkpoint_config_from_env  # trainguard


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="fsdp2", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=100, help="steps to run; 0 = until stopped (default 100)")
    p.add_argument("--batch", type=int, default=8, help="sequences per rank and step")
    p.add_argument("--seq", type=int, default=32, help="tokens per sequence")
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step-time-s", type=float, default=0.0,
                   help="sleep this long in each step, as a real model's compute would take (paces a demo)")
    p.add_argument("--checkpoint-dir", default="",
                   help="checkpoint root when run outside a trainguard launch (a launch sets TG_CHECKPOINT)")
    p.add_argument("--export", default="", help="write the trained weights here at the end (torch DCP)")
    return p.parse_args(argv)


class LanguageModel(nn.Module):
    def __init__(self, vocab: int, width: int, layers: int, seq: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Embedding(seq, width)
        self.blocks = nn.ModuleList(nn.TransformerEncoderLayer(width, nhead=4, dim_feedforward=4 * width, dropout=0.0,
                                                               batch_first=True, norm_first=True)
                                    for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.position(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            h = block(h, src_mask=self.mask, is_causal=True)
        return self.head(self.norm(h))


def batch(args: argparse.Namespace, step: int, rank: int) -> torch.Tensor:
    """Sequences that follow a fixed random bigram table: something a model can learn."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 1009 + rank)
    table = torch.randint(0, args.vocab, (args.vocab,), generator=torch.Generator().manual_seed(args.seed))
    seqs = torch.empty(args.batch, args.seq + 1, dtype=torch.long)
    seqs[:, 0] = torch.randint(0, args.vocab, (args.batch,), generator=g)
    for t in range(args.seq):
        noise = torch.randint(0, args.vocab, (args.batch,), generator=g)
        keep = torch.rand(args.batch, generator=g) < 0.9
        seqs[:, t + 1] = torch.where(keep, table[seqs[:, t]], noise)
    return seqs


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", timeout=timedelta(minutes=30))
    rank, world = dist.get_rank(), dist.get_world_size()
    model = LanguageModel(args.vocab, args.width, args.layers, args.seq)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=1000)

    checkpoint = checkpoint_config_from_env(root=args.checkpoint_dir) if args.checkpoint_dir else None  # trainguard
    guard = Guard(model, optimizer, state={"scheduler": scheduler}, checkpoint=checkpoint)  # trainguard
    try:
        step = guard.restore()  # trainguard: 0, or the step after the restored one
        while args.steps == 0 or step < args.steps:
            with guard.step(step, tokens=args.batch * args.seq * world) as s:  # trainguard
                seqs = batch(args, step, rank)
                logits = model(seqs[:, :-1])
                loss = nn.functional.cross_entropy(logits.reshape(-1, args.vocab), seqs[:, 1:].reshape(-1))
                loss.backward()
                norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
                if args.step_time_s > 0:
                    time.sleep(args.step_time_s)
                if s.ok(loss, grad_norm=float(norm.full_tensor())):  # trainguard: finite on every rank?
                    optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                scheduler.step()
            if rank == 0:
                print(f"step {step} loss {s.loss:.6f}", flush=True)
            step += 1
        if args.export:
            export(model, args.export)
    except TrainguardError as exc:  # e.g. checkpoints exist but none can be restored: one line
        guard.close("failed")
        print(f"fsdp2: error: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    except BaseException:
        guard.close("failed")
        raise
    guard.close()  # trainguard: the last snapshots written and committed
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())

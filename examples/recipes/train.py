"""A real loop's habits under trainguard: epochs over a DataLoader with a DistributedSampler, gradient accumulation,
mixed precision with a GradScaler, the program's own evaluation on rank 0 and its own snapshot to resume from,
a first batch fetched before the loop, and a loop body that is not re-indented for the guard.

Runs under torchrun (gloo on CPU) or as a single process::

    torchrun --nproc-per-node 2 examples/recipes/train.py --epochs 2
    TG_CHECKPOINT=/tmp/ckpt python examples/recipes/train.py --epochs 2     # a local run, with checkpoints

The data is a synthetic regression set whose every sample carries its index; each step records the indices it
trained on (``samples``), so a test can check that a restored run trains every sample exactly once an epoch.
The lines marked ``# trainguard`` are all the guard asks of the loop.
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from trainguard.torch import Guard, TrainguardError  # trainguard


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="recipes", description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--samples", type=int, default=512, help="samples in the data set")
    p.add_argument("--batch", type=int, default=4, help="samples per rank and micro-batch")
    p.add_argument("--accum", type=int, default=4, help="micro-batches per optimizer step (gradient accumulation)")
    p.add_argument("--eval-every", type=int, default=10, help="steps between evaluations on rank 0 (0: none)")
    p.add_argument("--stop-after", type=int, default=0, help="end after this many steps of this run (0: never)")
    p.add_argument("--snapshot", default="", help="the program's own snapshot file (written every epoch)")
    p.add_argument("--init-from", choices=("scratch", "resume"), default="scratch",
                   help="resume: load the program's own snapshot first")
    p.add_argument("--amp", action="store_true", help="autocast (bfloat16) and a GradScaler")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def dataset(args: argparse.Namespace) -> TensorDataset:
    g = torch.Generator().manual_seed(args.seed)
    x = torch.randn(args.samples, 16, generator=g)
    y = x @ torch.randn(16, 1, generator=g) + 0.01 * torch.randn(args.samples, 1, generator=g)
    return TensorDataset(torch.arange(args.samples), x, y)


def evaluate(model: torch.nn.Module, data: TensorDataset) -> float:
    with torch.no_grad():
        _index, x, y = data[:64]
        return float(torch.nn.functional.mse_loss(model(x), y))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo", timeout=timedelta(minutes=30))
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
    ddp = DistributedDataParallel(model) if dist.is_initialized() else model
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", enabled=args.amp)
    data = dataset(args)
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(data, batch_size=args.batch, sampler=sampler, drop_last=True)
    steps_per_epoch = len(loader) // args.accum

    if args.init_from == "resume" and Path(args.snapshot).is_file():  # the program's own resume, first
        own = torch.load(args.snapshot, weights_only=True)
        model.load_state_dict(own["model"])
        optimizer.load_state_dict(own["optimizer"])
    guard = Guard(ddp, optimizer, state={"scaler": scaler}, scaler=scaler if args.amp else None)  # trainguard
    try:
        step = guard.restore()  # trainguard: after the program's own resume, so the newer state wins
        epoch, done = divmod(step, steps_per_epoch)  # the epoch, and the steps of it already trained
        ran = 0
        while epoch < args.epochs and not (args.stop_after and ran >= args.stop_after):
            sampler.set_epoch(epoch)  # the sampler has no state: the epoch and the step say where it is
            batches = iter(loader)
            for _ in range(done * args.accum):  # the micro-batches the restored steps trained on
                next(batches)
            first = next(batches, None)  # a batch fetched before the loop: after restore(), never before
            while first is not None and done < steps_per_epoch:
                s = guard.begin(step, tokens=args.batch * args.accum * world)  # trainguard: no re-indent
                micro, seen = first, []
                for i in range(args.accum):
                    index, x, y = micro
                    seen += index.tolist()
                    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.amp):
                        loss = torch.nn.functional.mse_loss(ddp(x), y) / args.accum
                    scaler.scale(loss).backward()
                    micro = next(batches) if i + 1 < args.accum else None
                if s.ok(loss * args.accum):  # trainguard: the whole step's loss, finite on every rank?
                    scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
                s.report(samples=seen, epoch=epoch)  # trainguard: any JSON field for the step's record
                guard.end_step(s)  # trainguard
                step, done, ran = step + 1, done + 1, ran + 1
                first = next(batches, None)
                if args.eval_every and step % args.eval_every == 0:
                    if rank == 0:  # the program's own evaluation, outside the step: its time is not the step's
                        print(f"step {step} eval loss {evaluate(model, data):.6f}", flush=True)
                    if dist.is_initialized():
                        dist.barrier()
                if args.stop_after and ran >= args.stop_after:
                    break
            else:
                if args.snapshot and rank == 0:  # the program's own snapshot, every epoch
                    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, args.snapshot)
                epoch, done = epoch + 1, 0
    except TrainguardError as exc:
        guard.close("failed")
        print(f"recipes: error: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    except BaseException:
        guard.close("failed")
        raise
    guard.close()  # trainguard
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

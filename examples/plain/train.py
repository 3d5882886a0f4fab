"""A plain PyTorch DDP training script under trainguard: what a team's own script looks like with the guard.

Runs under torchrun (gloo on CPU, nccl on GPUs) or as a single process::

    torchrun --nproc-per-node 2 examples/plain/train.py --steps 50
    python examples/plain/train.py --steps 50 --checkpoint-dir /tmp/ckpt

The model is a small MLP regressing a fixed random teacher on synthetic data; each step's batch is
drawn from a generator seeded by (seed, step, rank), so a restored run sees exactly the batches the
uninterrupted one saw. The lines marked ``# trainguard`` are all the guard asks of the script.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from trainguard.torch import Guard, TrainguardError, checkpoint_config_from_env  # trainguard


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="plain", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=100, help="steps to run; 0 = until stopped (default 100)")
    p.add_argument("--batch", type=int, default=32, help="samples per rank and step")
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step-time-s", type=float, default=0.0,
                   help="sleep this long in each step, as a real model's compute would take (paces a demo)")
    p.add_argument("--checkpoint-dir", default="",
                   help="checkpoint root when run outside a trainguard launch (a launch sets TG_CHECKPOINT)")
    return p.parse_args(argv)


def batch(args: argparse.Namespace, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 1009 + rank)
    x = torch.randn(args.batch, args.width, generator=g)
    teacher = torch.Generator().manual_seed(args.seed)
    w = torch.randn(args.width, 1, generator=teacher) / args.width ** 0.5
    return x, x @ w + 0.01 * torch.randn(args.batch, 1, generator=g)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", timeout=timedelta(minutes=30))
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    # a GPU per rank where there is one (NCCL needs the tensors there), else the CPU; the data is drawn on the CPU
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if torch.cuda.is_available() \
        else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    model = torch.nn.Sequential(torch.nn.Linear(args.width, args.width), torch.nn.GELU(),
                                torch.nn.Linear(args.width, 1)).to(device)
    if dist.is_initialized():
        model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=20, gamma=0.5)

    checkpoint = checkpoint_config_from_env(root=args.checkpoint_dir) if args.checkpoint_dir else None  # trainguard
    guard = Guard(model, optimizer, state={"scheduler": scheduler}, checkpoint=checkpoint)  # trainguard
    try:
        step = guard.restore()  # trainguard: 0, or the step after the restored one
        while args.steps == 0 or step < args.steps:
            with guard.step(step, tokens=args.batch * world) as s:  # trainguard
                x, y = (t.to(device) for t in batch(args, step, rank))
                optimizer.zero_grad(set_to_none=True)
                loss = torch.nn.functional.mse_loss(model(x), y)
                loss.backward()
                if args.step_time_s > 0:
                    time.sleep(args.step_time_s)
                if s.ok(loss):  # trainguard: finite on every rank?
                    optimizer.step()
                scheduler.step()
            if rank == 0:
                print(f"step {step} loss {s.loss:.6f}", flush=True)
            step += 1
    except TrainguardError as exc:  # e.g. checkpoints exist but none can be restored: one line
        guard.close("failed")
        print(f"plain: error: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    except BaseException:
        guard.close("failed")
        raise
    guard.close()  # trainguard: the last snapshots written and committed
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

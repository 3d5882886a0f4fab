"""A data-parallel job as replica groups under trainguard.replicas: each group (one torchrun) a full copy of
``examples/plain``'s MLP; when one dies, the others train on, and when it comes back it heals from a live one.

    torchft_lighthouse --min_replicas 1 --bind 127.0.0.1:29510 &
    TORCHFT_LIGHTHOUSE=http://127.0.0.1:29510 TG_REPLICA=0 torchrun --nproc-per-node 1 --max-restarts 3 \\
        examples/replicas/train.py --steps 200
    (and TG_REPLICA=1, ... with another --master-port each)

Every committed step is a line of the rank's step records (``$TG_RUN_DIR``, default ``./tg-run``) with
``participants``; ``--digest-every N`` adds the replica's state digest every N steps, so two replicas can be
compared bit for bit at the same step.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from examples.plain.train import batch
from trainguard.replicas import Replicas, ReplicasError


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="replicas", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=100, help="steps to run; 0 = until stopped")
    p.add_argument("--batch", type=int, default=64, help="samples per replica and step")
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step-time-s", type=float, default=0.0, help="sleep this long in each step (a model's compute)")
    p.add_argument("--timeout-s", type=float, default=5.0,
                   help="a collective with another group that takes longer fails the step, which the groups then try "
                        "again without the silent one (a stopped group holds the others this long)")
    p.add_argument("--nonfinite-hold-s", type=float, default=300.0,
                   help="after a non-finite step, hold still this long for the control plane (seconds)")
    p.add_argument("--no-checkpoint", action="store_true",
                   help="keep no checkpoint (a group that restarts then always heals from a live one)")
    p.add_argument("--digest-every", type=int, default=0, help="log the state digest every N steps (0: at the end)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(args.seed)  # every replica starts from the same weights; a healed one gets the live ones'
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(args.width, args.width), torch.nn.Tanh(),
                                torch.nn.Linear(args.width, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    try:
        rep = Replicas(model, opt, timeout_s=args.timeout_s, nonfinite_hold_s=args.nonfinite_hold_s,
                       checkpoint=False if args.no_checkpoint else None)
    except ReplicasError as exc:
        print(f"replicas: error: {exc}", file=sys.stderr)
        return exc.exit_code
    model, optimizer = rep.model, rep.optimizer
    while args.steps == 0 or rep.step < args.steps:
        rep.begin()
        optimizer.zero_grad()  # joins this step's quorum
        x, y = batch(args, rep.step, rep.index)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        if args.step_time_s:
            time.sleep(args.step_time_s)
        optimizer.step()  # averaged over the replicas that train this step; applied if every one commits
        if rep.end(loss) and args.digest_every and rep.step % args.digest_every == 0:
            print(f"digest {rep.step} {rep.digest()}", flush=True)
    print(f"digest {rep.step} {rep.digest()}", flush=True)
    rep.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

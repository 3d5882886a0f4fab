"""The one small training job ``bench/peers.py`` runs four ways: under trainguard (as one DDP job, and as replica
groups), under NVIDIA's nvidia-resiliency-ext (``ft_launcher`` and its rank monitor), and with torchft (replica
groups, a lighthouse).

The model, the data and the step are the same in every mode (``examples/plain``'s MLP on a fixed random
teacher, each step's batch drawn from a generator seeded by (seed, step, rank)); what differs is only the
integration each system documents:

- ``trainguard``: the :class:`trainguard.torch.Guard` lines of ``examples/plain`` (checkpoints every step,
  restored by trainguard's restart);
- ``trainguard_replicas``: the lines of ``examples/replicas``: one replica group per machine
  (:class:`trainguard.replicas.Replicas` over torchft's manager and lighthouse), launched by trainguard from a
  spec with ``replicas:``; a failure confined to one group takes it out while the others train on (the degrade
  path), and its replacement heals from a live group;
- ``nvrx``: plain DDP launched by ``ft_launcher``, a heartbeat to its rank monitor every step (its timeouts
  calculated from the intervals observed, once ``--calc-timeouts-after`` steps ran), and the job's own
  ``torch.save`` of its state every ``--save-every`` steps (NVRx restarts the workers; what they resume from is
  the job's business);
- ``torchft``: one replica group per machine, ``torchft.Manager`` with ``DistributedDataParallel`` and
  ``Optimizer`` wrappers over ``ProcessGroupGloo``; a group that restarts heals from a live peer
  (``PGTransport``), the others train on; each group saves its own checkpoint every ``--save-every`` steps (what
  it resumes from when no live replica is left).

Every rank appends one JSON line per finished step to ``$PEERS_LOG/<mode>-<replica>-<rank>.jsonl``
(``step``, ``ts``, ``participants``, ``loss``): the harness reads detection, resume and steps lost from them.
Faults the job cannot be given from outside come from files in ``$PEERS_FAULTS`` (``nan``: the next step's loss
is NaN on this machine; ``slow``: each step sleeps that many extra seconds; ``stall``: the step waits before its
backward pass while the file is there), the way a bad batch, a throttled GPU or a deadlocked data loader would show
in the step.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from examples.plain.train import batch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="peers_job", description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=("trainguard", "trainguard_replicas", "nvrx", "torchft"), required=True)
    p.add_argument("--steps", type=int, default=0, help="steps to run; 0 = until stopped")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step-time-s", type=float, default=0.2, help="compute time of one step (slept)")
    p.add_argument("--save-every", type=int, default=1, help="nvrx, torchft: steps between the job's own checkpoints")
    p.add_argument("--state-dir", default="", help="nvrx, torchft: where the job's own checkpoint goes")
    p.add_argument("--collective-timeout-s", type=float, default=5.0,
                   help="torchft, trainguard_replicas: the collectives' timeout")
    p.add_argument("--calc-timeouts-after", type=int, default=10,
                   help="nvrx: steps after which the heartbeat timeouts are calculated from those observed")
    return p.parse_args(argv)


class StepLog:
    """One JSON line per finished step, flushed at once (a killed rank's last line is on disk)."""

    def __init__(self, mode: str, replica: str, rank: int) -> None:
        root = Path(os.environ.get("PEERS_LOG", "."))
        root.mkdir(parents=True, exist_ok=True)
        self.fh = open(root / f"{mode}-{replica}-{rank}.jsonl", "a", buffering=1)  # noqa: SIM115
        self.replica, self.rank = replica, rank

    def step(self, step: int, loss: float, participants: int) -> None:
        self.fh.write(json.dumps({"step": step, "ts": time.time(), "replica": self.replica, "rank": self.rank,
                                  "participants": participants, "loss": loss, "pid": os.getpid()}) + "\n")


def machine() -> str:
    """This rank's machine: the harness names it (NVRx, torchft), trainguard's launch does (``TG_MACHINE``)."""
    return os.environ.get("PEERS_MACHINE", os.environ.get("TG_MACHINE", "m"))


def fault(name: str) -> str:
    """The content of this machine's fault file ``name`` ("" when there is none). ``$PEERS_FAULTS`` may hold
    ``{machine}`` (one spec's environment for every machine of a trainguard launch)."""
    root = os.environ.get("PEERS_FAULTS", "").replace("{machine}", machine())
    path = Path(root) / name if root else None
    return path.read_text().strip() if path is not None and path.exists() else ""


def model_and_optimizer(args: argparse.Namespace) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(args.seed)
    model = torch.nn.Sequential(torch.nn.Linear(args.width, args.width), torch.nn.GELU(),
                                torch.nn.Linear(args.width, 1))
    return model, torch.optim.AdamW(model.parameters(), lr=args.lr)


def compute(args: argparse.Namespace, model: torch.nn.Module, step: int, rank: int) -> torch.Tensor:
    """One step's forward and backward (the gradients all-reduced by whichever DDP wraps ``model``)."""
    x, y = batch(args, step, rank)
    # a throttled device is slower in all of its compute: a third of the slow fault's extra time in the forward
    # pass, the rest with the backward (a forward is about a third of a step's compute)
    slow = float(fault("slow") or 0.0)
    time.sleep(slow / 3)
    loss = torch.nn.functional.mse_loss(model(x), y)
    if fault("nan"):
        loss = loss * float("nan")
    while fault("stall"):  # alive, threads running, never at the all-reduce: every other rank waits inside it
        time.sleep(0.2)
    loss.backward()
    time.sleep(args.step_time_s + slow * 2 / 3)
    return loss


def run_nvrx(args: argparse.Namespace) -> int:
    from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    monitor = RankMonitorClient()
    monitor.init_workload_monitoring()
    model, optimizer = model_and_optimizer(args)
    ddp = DistributedDataParallel(model)
    state = Path(args.state_dir) / "state.pt"
    step = 0
    if state.exists():  # every rank reads the same file: the job's own checkpoint, written by rank 0
        saved: dict[str, Any] = torch.load(state, weights_only=True)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        step = int(saved["step"]) + 1
    log = StepLog("nvrx", machine(), rank)
    calc_at = step + args.calc_timeouts_after  # (every rank restarts at the same step: the call is collective)
    while args.steps == 0 or step < args.steps:
        optimizer.zero_grad(set_to_none=True)
        loss = compute(args, ddp, step, rank)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"step {step}: loss is {loss.item()}")
        optimizer.step()
        monitor.send_heartbeat()
        if step == calc_at:  # NVRx's own timeouts, from the heartbeat intervals it observed
            monitor.calculate_and_set_hb_timeouts(skip_if_not_ready=True)
        if rank == 0 and step % args.save_every == 0:
            tmp = state.with_suffix(".tmp")
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, tmp)
            os.replace(tmp, state)
        log.step(step, float(loss.item()), world)
        step += 1
    monitor.shutdown_workload_monitoring()
    dist.destroy_process_group()
    return 0


def run_torchft(args: argparse.Namespace) -> int:
    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo
    from torchft.checkpointing.pg_transport import PGTransport

    replica = os.environ.get("REPLICA_GROUP_ID", "0")
    model, inner = model_and_optimizer(args)
    timeout = timedelta(seconds=args.collective_timeout_s)
    pg = ProcessGroupGloo(timeout=timeout)
    manager = Manager(
        pg=pg, min_replica_size=1, replica_id=f"peers_{replica}",
        load_state_dict=lambda sd: (model.load_state_dict(sd["model"]), inner.load_state_dict(sd["optim"])),
        state_dict=lambda: {"model": model.state_dict(), "optim": inner.state_dict()},
        timeout=timeout, hostname=os.environ.get("PEERS_ADDRESS", "localhost"),
        checkpoint_transport=PGTransport(pg, timeout=timedelta(seconds=10), device=torch.device("cpu")))
    # the group's own checkpoint, as torchft's example asks: what a restart resumes from when no live replica is left
    state = Path(args.state_dir or ".") / f"torchft-{replica}.pt"
    if state.exists():
        saved: dict[str, Any] = torch.load(state, weights_only=True)
        model.load_state_dict(saved["model"])
        inner.load_state_dict(saved["optim"])
        manager.load_state_dict(saved["manager"])
    ddp = DistributedDataParallel(manager, model)
    optimizer = Optimizer(manager, inner)
    log = StepLog("torchft", replica, int(os.environ.get("RANK", "0")))
    while args.steps == 0 or manager.current_step() < args.steps:
        optimizer.zero_grad()  # starts the quorum
        before = manager.current_step()
        loss = compute(args, ddp, before, int(replica))
        optimizer.step()  # steps the optimizer if every participant commits (the manager's step then advances)
        if manager.current_step() > before:  # (a replica that healed meanwhile jumped to the live peers' step)
            log.step(manager.current_step() - 1, float(loss.item()), manager.num_participants())
            if manager.current_step() % args.save_every == 0:
                tmp = state.with_suffix(".tmp")
                torch.save({"model": model.state_dict(), "optim": inner.state_dict(),
                            "manager": manager.state_dict()}, tmp)
                os.replace(tmp, state)
    return 0


def run_trainguard(args: argparse.Namespace) -> int:
    from torch.nn.parallel import DistributedDataParallel

    from trainguard.torch import Guard, TrainguardError

    dist.init_process_group("gloo", timeout=timedelta(minutes=30))
    rank, world = dist.get_rank(), dist.get_world_size()
    model, optimizer = model_and_optimizer(args)
    ddp = DistributedDataParallel(model)
    guard = Guard(ddp, optimizer)
    log = StepLog("trainguard", machine(), rank)
    try:
        step = guard.restore()
        while args.steps == 0 or step < args.steps:
            with guard.step(step, tokens=args.batch * world) as s:
                optimizer.zero_grad(set_to_none=True)
                loss = compute(args, ddp, step, rank)
                if s.ok(loss):
                    optimizer.step()
            log.step(step, float(loss.item()), world)
            step += 1
    except TrainguardError as exc:
        guard.close("failed")
        print(f"peers_job: error: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    except BaseException:
        guard.close("failed")
        raise
    guard.close()
    dist.destroy_process_group()
    return 0


def run_trainguard_replicas(args: argparse.Namespace) -> int:
    from trainguard.replicas import Replicas, ReplicasError

    model, optimizer = model_and_optimizer(args)
    try:
        rep = Replicas(model, optimizer, timeout_s=args.collective_timeout_s)
    except ReplicasError as exc:
        print(f"peers_job: error: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    model, optimizer = rep.model, rep.optimizer
    # the group's number names it, as torchft's do: a group started on a swapped-in machine is the same group
    log = StepLog("trainguard_replicas", str(rep.index), 0)
    try:
        while args.steps == 0 or rep.step < args.steps:
            rep.begin()
            optimizer.zero_grad()  # joins this step's quorum
            loss = compute(args, model, rep.step, rep.index)
            optimizer.step()  # averaged over the groups that train this step; applied if every one commits
            if rep.end(loss):
                log.step(rep.step - 1, float(loss.item()), rep.participants)
    except BaseException:
        rep.close("failed")
        raise
    rep.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    return {"nvrx": run_nvrx, "torchft": run_torchft, "trainguard": run_trainguard,
            "trainguard_replicas": run_trainguard_replicas}[args.mode](args)


if __name__ == "__main__":
    sys.exit(main())

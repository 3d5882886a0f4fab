"""Reference training job: a small GPT with tensor, pipeline and data parallelism.

Launched once per machine by torchrun (static rendezvous)::

    torchrun --nnodes 4 --nproc-per-node 2 --node-rank I --master-addr A --master-port P \\
        examples/gpt3d/train.py --tp 2 --pp 2 --dp 2 --steps 30

or as ``python -m examples.gpt3d.train`` (a single process without torchrun runs
with world size 1, e.g. ``--tp 1 --pp 1 --dp 1``). The backend is gloo on CPU and
nccl (one GPU per local rank) when CUDA is available.

Ranks are laid out by :class:`trainguard.core.topology.Topology`
(``rank = (dp * PP + pp) * TP + tp``). A step runs a GPipe schedule (every
micro-batch forward, then every micro-batch backward, activations and their
gradients sent point to point between consecutive stages), averages gradients
over the DP group, computes the global gradient norm, clips and applies AdamW.

Each step every rank records (``guard.step``) the same ``loss``: the last
stage's mean micro-batch loss, broadcast over the PP group (an all-reduce where
the other stages contribute zero) and averaged over the DP replicas. The extra
field ``replica_loss`` keeps the loss of the rank's own replica (before the DP
mean), ``param_digest`` a CRC32 of the rank's parameters, equal on DP peers, and
``dp_digests`` / ``dp_digests_match``: every DP peer's digest, gathered each step,
so a replica whose parameters drifted (silent data corruption) shows at once.
The job meets trainguard through its public face only, :class:`trainguard.torch.Guard`:
every collective and point-to-point transfer is counted by ``guard.collective``, each
step runs in ``guard.step`` (heartbeat, step record, snapshot), ``s.ok`` decides
whether the update is applied (a non-finite loss or gradient norm skips it and the
rank holds still for the control plane), and ``guard.restore`` says where to resume.

Checkpoints (:mod:`trainguard.checkpoint`): with ``--checkpoint`` (off by default), every
``--checkpoint-every`` steps each rank snapshots its parameters, optimizer
state, RNG and data position (the step) into a CPU buffer; the background
writes it to the machine's disk (``--checkpoint-dir``, default ``TG_CHECKPOINT``
or ``<TG_RUN_DIR>/checkpoints``), replicates it to the rank's backup rank and,
with ``--checkpoint-s3``, uploads it to S3. At start the job restores the newest
step every rank can get (``--restore`` insists, ``--no-restore`` starts from
step 0) and resumes at the next step, bit for bit. Step records gain
``ckpt_blocking_s`` (time the step spent in the checkpointer), ``ckpt_saved``,
``ckpt_skipped`` (back-pressure), ``ckpt_waited_s`` (of the blocking time, the wait for a
free snapshot buffer), ``ckpt_refused`` (not snapshotted: the step's
gradient norm was not finite, or its parameters differ from the data-parallel
peers'), ``ckpt_committed`` (newest step committed on
every rank), ``ckpt_bg_cpu_s`` (CPU seconds of the checkpoint's background
threads so far) and, on the first step after a restore, ``ckpt_restored_step``,
``ckpt_restore_s``, ``ckpt_restore_source``.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run by file path (torchrun examples/gpt3d/train.py)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import argparse
import os
import time
import zlib
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from examples.gpt3d.data import MarkovData
from examples.gpt3d.model import GPTConfig, Stage, TPComm, full_parameter_count
from trainguard.torch import (
    GROUP_KINDS,
    Guard,
    JobMonitor,
    RankCoords,
    ReferenceCopy,
    RestoreError,
    Topology,
    TopologyError,
    TrainguardError,
    checkpoint_config_from_env,
    heartbeat,
)

PROG = "gpt3d"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel degree (default 2)")
    p.add_argument("--pp", type=int, default=2, help="pipeline stages (default 2)")
    p.add_argument("--dp", type=int, default=2, help="data-parallel replicas (default 2)")
    p.add_argument("--steps", type=int, default=0, help="steps to run; 0 = until stopped (default 0)")
    p.add_argument("--micro-batches", type=int, default=4, help="micro-batches per step per replica")
    p.add_argument("--micro-batch-size", type=int, default=4, help="sequences per micro-batch")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=4, help="transformer blocks, split evenly across stages")
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    p.add_argument("--grad-clip", type=float, default=1.0, help="clip the global grad norm to this; 0 = off")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--step-delay-s", type=float, default=0.0, help="sleep after each step (pace a demo)")
    p.add_argument("--emulate-device-s", type=float, default=0.0,
                   help="wait this long inside each step, before the gradient all-reduce, as a GPU host's training "
                        "thread waits for its kernels with the CPU idle (benchmarks on CPU-only hosts; default 0)")
    p.add_argument("--nonfinite-hold-s", type=float, default=300.0,
                   help="on a non-finite loss or gradient norm the update is skipped, the step recorded and the "
                        "job holds still this long for the control plane to restore the last finite step, then "
                        "goes on with the next batch (default 300; 0 = go on at once)")
    p.add_argument("--collective-timeout-s", type=float, default=1800.0,
                   help="timeout of every collective (init_process_group(timeout=...))")
    c = p.add_argument_group("checkpoints")
    c.add_argument("--checkpoint", dest="checkpoint", action="store_true",
                   help="take per-step checkpoints and restore from them (off unless given)")
    c.add_argument("--no-checkpoint", dest="checkpoint", action="store_false",
                   help="take no checkpoints and restore none (the default)")
    c.add_argument("--checkpoint-dir", default="",
                   help="this machine's checkpoint root; may hold {machine}, {rank}, {local_rank} "
                        "(default: TG_CHECKPOINT, else <TG_RUN_DIR>/checkpoints)")
    c.add_argument("--checkpoint-every", type=int, default=1, help="snapshot every N steps (default 1)")
    c.add_argument("--checkpoint-keep", type=int, default=3, help="committed steps kept per tier (default 3)")
    c.add_argument("--checkpoint-s3", "--checkpoint-remote", dest="checkpoint_s3", default=None,
                   help="the remote tier: s3://bucket/prefix (endpoint from TG_S3_ENDPOINT_URL) or file:///dir on "
                        "storage every machine mounts (default: TG_CHECKPOINT when it is an s3:// URL)")
    c.add_argument("--checkpoint-s3-every", type=int, default=10,
                   help="upload to S3 every K steps; 0 = only on request (default 10)")
    c.add_argument("--checkpoint-verify-every", type=int, default=20,
                   help="every N steps a committed snapshot is a verification candidate, kept until the "
                        "control plane verified it (0 = none; default 20)")
    c.add_argument("--checkpoint-ranks-per-machine", type=int, default=0,
                   help="ranks per machine for replica placement (default: torchrun's LOCAL_WORLD_SIZE); "
                        "set it to emulate several machines on one host")
    c.add_argument("--checkpoint-nice", type=int, default=10,
                   help="nice increment of the checkpoint's background threads, 0..19 (default 10)")
    c.add_argument("--checkpoint-saver", choices=("process", "thread"), default="process",
                   help="persist snapshots in a saver process on the machine, which also keeps the newest in memory "
                        "for a restart there (default), or in background threads of the training process")
    c.add_argument("--checkpoint-wait-s", type=float, default=2.0,
                   help="when both snapshot buffers are still being persisted, a step waits at most this long for "
                        "one (0 = skip the snapshot at once; default 2, below the node agent's 3 s floor for a hang)")
    c.add_argument("--checkpoint-saver-idle-s", type=float, default=600.0,
                   help="a saver process ends this long after the last rank left (default 600)")
    c.add_argument("--checkpoint-measure-memcpy", action="store_true",
                   help="also time a plain copy of the state each step (ckpt_memcpy_s; for benchmarks)")
    b = p.add_argument_group("benchmark references")
    b.add_argument("--measure-memcpy", action="store_true",
                   help="time a plain copy of the rank's state into a spare buffer each step (memcpy_s), with "
                        "checkpoints off: the reference checkpoint blocking is measured against")
    b.add_argument("--dcp-dir", default="",
                   help="checkpoint every step with torch.distributed.checkpoint.async_save into DIR/step_<n> "
                        "(storage every rank reaches) instead: the peer trainguard is compared with")
    b.add_argument("--dcp-restore", action="store_true", help="with --dcp-dir: load the newest step first")
    r = c.add_mutually_exclusive_group()
    r.add_argument("--restore", dest="restore", action="store_const", const="require",
                   help="restore from a checkpoint or fail (default: restore if anything usable exists)")
    r.add_argument("--no-restore", dest="restore", action="store_const", const="off",
                   help="start from step 0 even if checkpoints exist")
    c.add_argument("--restore-max-step", type=int, default=None, metavar="N",
                   help="restore no step newer than N (after silent data corruption: the last step before it)")
    p.set_defaults(restore="auto", checkpoint=False)
    return p.parse_args(argv)


def check_layout(args: argparse.Namespace, world_size: int, ranks_per_machine: int) -> Topology:
    """The job's topology, or a TopologyError/TrainguardError saying what does not fit."""
    Topology(args.tp, args.pp, args.dp)  # degrees are positive integers
    product = args.tp * args.pp * args.dp
    if product != world_size:
        raise TopologyError(
            f"--tp {args.tp} x --pp {args.pp} x --dp {args.dp} = {product} ranks, but the job has "
            f"WORLD_SIZE={world_size}; choose degrees whose product is {world_size}"
        )
    topo = Topology(args.tp, args.pp, args.dp, ranks_per_machine=ranks_per_machine)
    if args.layers % args.pp:
        raise TopologyError(f"--layers {args.layers} do not split evenly into --pp {args.pp} stages")
    if args.heads % args.tp:
        raise TopologyError(f"--heads {args.heads} do not split evenly across --tp {args.tp} ranks")
    if args.d_model % args.heads:
        raise TrainguardError(f"--d-model {args.d_model} is not a multiple of --heads {args.heads}")
    for name in ("steps", "micro_batches", "micro_batch_size", "seq_len", "vocab"):
        if getattr(args, name) < (0 if name == "steps" else 1):
            raise TrainguardError(f"--{name.replace('_', '-')} {getattr(args, name)} is out of range")
    if args.checkpoint:
        for name in ("checkpoint_every", "checkpoint_keep"):
            if getattr(args, name) < 1:
                raise TrainguardError(f"--{name.replace('_', '-')} {getattr(args, name)} must be >= 1")
        if min(args.checkpoint_s3_every, args.checkpoint_ranks_per_machine, args.checkpoint_verify_every) < 0:
            raise TrainguardError("--checkpoint-s3-every, --checkpoint-ranks-per-machine and "
                                  "--checkpoint-verify-every must be >= 0")
        if not args.checkpoint_wait_s >= 0:
            raise TrainguardError(f"--checkpoint-wait-s {args.checkpoint_wait_s} must be >= 0")
        if not 0 <= args.checkpoint_nice <= 19:
            raise TrainguardError(f"--checkpoint-nice {args.checkpoint_nice} must be 0..19")
        rpm = args.checkpoint_ranks_per_machine
        if rpm and world_size % rpm:
            raise TopologyError(f"--checkpoint-ranks-per-machine {rpm} does not divide the {world_size} ranks")
    return topo


def checkpoint_config(args: argparse.Namespace) -> Any:
    """The rank's checkpoint configuration from the command line, or False."""
    if not args.checkpoint:
        return False
    return checkpoint_config_from_env(
        root=args.checkpoint_dir, s3_url=args.checkpoint_s3, ranks_per_machine=args.checkpoint_ranks_per_machine,
        every_steps=args.checkpoint_every, keep=args.checkpoint_keep,
        s3_every_steps=args.checkpoint_s3_every, verify_every_steps=args.checkpoint_verify_every,
        restore=args.restore, restore_max_step=args.restore_max_step,
        control_timeout_s=args.collective_timeout_s, measure_memcpy=args.checkpoint_measure_memcpy,
        background_nice=args.checkpoint_nice, saver=args.checkpoint_saver,
        # an emulated accelerator: the state is copied while the host waits for it, as a side stream does; only
        # with the saver process, which persists a snapshot handed over even as the rank fails
        copy_at_idle=args.emulate_device_s > 0 and args.checkpoint_saver == "process",
        saver_idle_s=args.checkpoint_saver_idle_s, backpressure_wait_s=args.checkpoint_wait_s)


def shuffle_window(tokens: torch.Tensor, window: int) -> torch.Tensor:
    """Reverse the token order inside each window of ``window`` positions (a data augmentation).

    This is the job's deliberate user bug: the index is off by one, so the last
    window reads one position past the end and raises IndexError. It runs only
    when the emulated cluster injects a ``user_error`` fault, and the traceback's
    last frame is this function, in the job's own file.
    """
    out = tokens.clone()
    length = tokens.shape[-1]
    for start in range(0, length, window):
        for i in range(window):
            out[..., start + i] = tokens[..., start + window - i]  # should be start + window - 1 - i
    return out


class Trainer:
    """One rank of the job: its stage of the model, its groups, and the step loop."""

    def __init__(self, args: argparse.Namespace, topo: Topology, rank: int, device: torch.device,
                 local_rank: int = 0, monitor: JobMonitor | None = None) -> None:
        self.args = args
        self.topo = topo
        self.rank = rank
        self.coords: RankCoords = topo.coords(rank)
        self.device = device

        # Every rank creates every group, in the same order.
        self.groups: dict[str, Any] = {}
        self.members: dict[str, tuple[int, ...]] = {}
        for kind in GROUP_KINDS:
            for ranks in topo.groups(kind):
                group = dist.new_group(list(ranks))
                if rank in ranks:
                    self.groups[kind], self.members[kind] = group, ranks

        c = self.coords
        self.is_first = c.pp == 0
        self.is_last = c.pp == topo.pp - 1
        pp_ranks = self.members["pp"]
        self.prev_rank = pp_ranks[c.pp - 1] if not self.is_first else None
        self.next_rank = pp_ranks[c.pp + 1] if not self.is_last else None

        self.cfg = GPTConfig(vocab=args.vocab, seq_len=args.seq_len, d_model=args.d_model,
                             heads=args.heads, layers=args.layers)
        comm = TPComm(self.groups["tp"], topo.tp, c.tp, wrap=self._collective)
        self.model = Stage(self.cfg, stage=c.pp, stages=topo.pp, comm=comm, seed=args.seed, device=device)
        self.params = list(self.model.parameters())
        self.optimizer = torch.optim.AdamW(self.params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
        self.data = MarkovData(vocab=args.vocab, seq_len=args.seq_len, micro_batches=args.micro_batches,
                               micro_batch_size=args.micro_batch_size, seed=args.seed)
        self.act_shape = (args.micro_batch_size, args.seq_len, args.d_model)
        self.global_tokens = self.data.tokens_per_batch * topo.dp
        self.reporter = c.tp == 0 and self.is_last and c.dp == 0
        # the loss and the norm are the same on every rank already (reported_loss, grad_norm): no extra sync
        self.guard = Guard(self.model, self.optimizer, topology=topo,
                           checkpoint=checkpoint_config(args),
                           nonfinite_hold_s=args.nonfinite_hold_s, sync=False,
                           collective_timeout_s=args.collective_timeout_s, monitor=monitor, log=self._log)
        self.faults = self.guard.faults
        self.reference = None
        if args.measure_memcpy:
            self.reference = ReferenceCopy(self.model, self.optimizer)
        self.dcp = None
        self.dcp_restored: tuple[int, float] | None = None
        if args.dcp_dir:
            from examples.gpt3d.dcp_baseline import DcpCheckpointer

            self.dcp = DcpCheckpointer(Path(args.dcp_dir), rank=rank, model=self.model, optimizer=self.optimizer)

    def _log(self, line: str) -> None:
        if self.reporter:
            print(f"{PROG}: {line}", flush=True)

    # ---- communication ----------------------------------------------------------------
    def _collective(self, group: str, op: str) -> Any:
        # the guard is built after the model: TPComm asks for the wrapper only when it communicates
        return self.guard.collective(group, op)

    def _send(self, tensor: torch.Tensor, dst: int) -> None:
        with self._collective("pp", "send"):
            dist.isend(tensor.contiguous(), dst=dst, group=self.groups["pp"]).wait()

    def _recv(self, src: int) -> torch.Tensor:
        buf = torch.empty(self.act_shape, dtype=torch.float32, device=self.device)
        with self._collective("pp", "recv"):
            dist.irecv(buf, src=src, group=self.groups["pp"]).wait()
        return buf

    def _all_reduce(self, kind: str, tensor: torch.Tensor) -> torch.Tensor:
        if len(self.members[kind]) > 1:
            with self._collective(kind, "all_reduce"):
                dist.all_reduce(tensor, group=self.groups[kind])
        return tensor

    # ---- one step ---------------------------------------------------------------------
    def forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """GPipe: every micro-batch forward, then every micro-batch backward. Returns the last
        stage's micro-batch losses (``None`` on other stages); gradients are left in ``.grad``."""
        m_count = inputs.shape[0]
        stage_inputs: list[torch.Tensor] = []
        outputs: list[torch.Tensor] = []
        losses: list[torch.Tensor] = []
        for m in range(m_count):
            # the first stage embeds token ids; the others receive the previous stage's activations
            x = inputs[m].to(self.device) if self.is_first else self._recv(self.prev_rank).requires_grad_(True)
            out = self.model(x)
            if self.is_last:
                loss = self.model.loss(out, targets[m].to(self.device))
                loss = self.faults.corrupt_loss(loss)
                losses.append(loss.detach())
                outputs.append(loss / m_count)
            else:
                self._send(out.detach(), self.next_rank)
                outputs.append(out)
            stage_inputs.append(x)
        for m in range(m_count):
            if self.is_last:
                outputs[m].backward()
            else:
                torch.autograd.backward(outputs[m], self._recv(self.next_rank))
            if not self.is_first:
                self._send(stage_inputs[m].grad, self.prev_rank)
        stage_inputs.clear()
        outputs.clear()
        return torch.stack(losses) if self.is_last else None

    def all_reduce_grads(self) -> None:
        """Average every gradient over the DP group, through one flat buffer."""
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.topo.dp == 1:
            return
        grads = [p.grad for p in self.params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        self._all_reduce("dp", flat).div_(self.topo.dp)
        offset = 0
        for g in grads:
            n = g.numel()
            g.copy_(flat[offset:offset + n].view_as(g))
            offset += n

    def grad_norm(self) -> float:
        """The global gradient norm; TP-replicated parameters are counted once (by tp index 0)."""
        sq = torch.zeros((), dtype=torch.float32, device=self.device)
        for p in self.params:
            if getattr(p, "tensor_parallel", False) or self.coords.tp == 0:
                sq += p.grad.float().pow(2).sum()
        self._all_reduce("tp", sq)
        self._all_reduce("pp", sq)
        return float(sq.sqrt())

    def reported_loss(self, losses: torch.Tensor | None) -> tuple[float, float]:
        """``(loss, replica_loss)``: the mean micro-batch loss of this DP replica (from the
        last stage, summed over the PP group where other stages contribute zero), and its
        mean over the DP replicas, which every rank of the job reports."""
        loss = losses.mean() if losses is not None else torch.zeros((), device=self.device)
        replica_loss = float(self._all_reduce("pp", loss))
        mean = self._all_reduce("dp", loss.clone()) / self.topo.dp
        return float(mean), replica_loss

    def param_digest(self) -> str:
        crc = 0
        with torch.no_grad():
            for p in self.params:
                crc = zlib.crc32(p.detach().float().cpu().contiguous().numpy(), crc)
        return f"{crc:08x}"

    def dp_digests(self, digest: str) -> tuple[bool, list[str]]:
        """Every DP peer's parameter digest (one tiny all-gather), and whether they all agree.

        DP peers hold identical parameters in a healthy job; a replica that differs
        computed something wrong (silent data corruption), and the agent reports it.
        """
        if self.topo.dp == 1:
            return True, [digest]
        mine = torch.tensor([int(digest, 16)], dtype=torch.int64, device=self.device)
        gathered = [torch.zeros_like(mine) for _ in range(self.topo.dp)]
        with self._collective("dp", "all_gather"):
            dist.all_gather(gathered, mine, group=self.groups["dp"])
        values = [f"{int(t.item()):08x}" for t in gathered]
        return len(set(values)) == 1, values

    def step(self, step: int) -> None:
        t0 = time.perf_counter()
        # the step's time starts before the guard's step_begin: a "slow" fault's delay counts as this rank's
        with self.guard.step(step, tokens=self.global_tokens) as s:
            inputs, targets = self.data.batch(step, self.coords.dp)
            if self.faults.active("user_error") is not None:
                inputs = shuffle_window(inputs, window=8)
            self.optimizer.zero_grad(set_to_none=True)
            losses = self.forward_backward(inputs, targets)
            self.guard.host_idle()  # the host waits for the device from here: the saver's moment
            if self.args.emulate_device_s > 0:  # an accelerator's kernels: the host thread waits, its CPU idles
                time.sleep(self.args.emulate_device_s)
            self.guard.host_busy()  # the device's result is in: the host works again
            self.all_reduce_grads()
            self.faults.corrupt_grads(self.params)
            norm = self.grad_norm()
            if self.args.grad_clip > 0:
                scale = min(1.0, self.args.grad_clip / (norm + 1e-6))
                if scale < 1.0:
                    for p in self.params:
                        p.grad.mul_(scale)
            # the loss (a mean over the job) and the global norm are the same on every rank: all skip together
            loss, replica_loss = self.reported_loss(losses)
            if s.ok(loss, grad_norm=norm, sync=False):
                self.optimizer.step()
            # else: never trained on; the parameters stay those of the last finite step
            digest = self.param_digest()
            match, peers = self.dp_digests(digest)
            if not match:  # silent corruption: not snapshotted, so it cannot displace the last good state
                s.refuse("parameters differ from the data-parallel peers'")
            extra: dict[str, Any] = {}
            if self.dcp is not None and not s.refused:
                extra["dcp_blocking_s"] = round(self.dcp.save(step), 6)
            if self.reference is not None:
                extra["memcpy_s"] = round(self.reference.measure(), 6)
            extra["cpu_s"] = round(time.thread_time(), 6)  # the training thread's CPU time so far
            extra["proc_cpu_s"] = round(time.process_time(), 6)  # and the whole process's (its other threads too)
            if self.dcp_restored is not None:
                extra.update(dcp_restored_step=self.dcp_restored[0], dcp_restore_s=round(self.dcp_restored[1], 4))
                self.dcp_restored = None
            s.report(loss=loss, grad_norm=norm, param_digest=digest, replica_loss=replica_loss,
                     dp_digests_match=match, dp_digests=peers, **extra)
            if self.reporter:
                step_time = time.perf_counter() - t0
                print(f"step {step} loss {loss:.4f} grad_norm {norm:.3g} step_time {step_time:.3f}s "
                      f"tokens/s {self.global_tokens / step_time:.0f}", flush=True)

    def run(self) -> None:
        if self.reporter:
            print(f"{PROG}: {self.topo} world {self.topo.world_size} backend {dist.get_backend()} "
                  f"params {full_parameter_count(self.cfg) / 1e6:.2f}M tokens/step {self.global_tokens} "
                  f"loss floor ~{self.data.entropy_rate():.2f}", flush=True)
        step = self.restore()
        while self.args.steps == 0 or step < self.args.steps:
            self.step(step)
            step += 1
            if self.args.step_delay_s > 0:
                time.sleep(self.args.step_delay_s)
        self.guard.close("finished")  # write, replicate and commit the last snapshots before the groups go
        if self.dcp is not None:
            self.dcp.close()

    def restore(self) -> int:
        """Restore the newest usable checkpoint (all ranks together); the step to run next."""
        if self.dcp is not None and self.args.dcp_restore:
            self.dcp_restored = self.dcp.restore()
            return 0 if self.dcp_restored is None else self.dcp_restored[0] + 1
        return self.guard.restore()


@record  # torchrun then names the rank that failed first, with its traceback, in its report
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    env = os.environ
    launched = "WORLD_SIZE" in env
    world_size = int(env.get("WORLD_SIZE", "1"))
    rank = int(env.get("RANK", "0"))
    local_rank = int(env.get("LOCAL_RANK", "0"))
    local_world = int(env.get("LOCAL_WORLD_SIZE", str(world_size)))
    try:
        topo = check_layout(args, world_size, local_world)
    except TrainguardError as exc:
        if local_rank == 0:
            print(f"{PROG}: error: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code

    torch.set_num_threads(1)
    if torch.cuda.is_available():
        backend, device = "nccl", torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        backend, device = "gloo", torch.device("cpu")

    c = topo.coords(rank)
    # the heartbeat starts before the rendezvous (which waits for every machine): the agent sees the rank at once
    monitor = heartbeat(coords={"tp": c.tp, "pp": c.pp, "dp": c.dp})
    timeout = timedelta(seconds=args.collective_timeout_s)
    trainer: Trainer | None = None
    try:
        if launched:
            dist.init_process_group(backend, timeout=timeout)
        else:  # a single process outside torchrun
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        trainer = Trainer(args, topo, rank, device, local_rank, monitor)
        trainer.run()
    except TrainguardError as exc:  # e.g. no checkpoint can be restored: one line, no traceback
        (trainer.guard.close if trainer is not None else monitor.close)("failed")
        if local_rank == 0 or not isinstance(exc, RestoreError):  # every rank raises the same RestoreError
            print(f"{PROG}: error: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    except BaseException:
        (trainer.guard.close if trainer is not None else monitor.close)("failed")
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())

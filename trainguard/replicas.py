"""Train through the loss of a data-parallel replica: torchft's quorum, reconfigurable process group and live
healing behind trainguard's face.

A job that runs its data-parallel replicas as replica groups (one ``torchrun`` each, every group a full copy of
the model in its own TP x PP layout) keeps training when a group dies: the others agree on who trains each step
(torchft's lighthouse and :class:`torchft.Manager`), average gradients among themselves (one all-reduce over
torchft's reconfigurable process group, in the optimizer's step), and a group that comes back receives the
state from a live one at its first step (torchft's checkpoint transport; the state is applied at that step's
commit, so the step's own loss was computed on the state from before, and its record says ``healed_from_step``).
trainguard adds what the machines' side needs: every committed step is checkpointed (trainguard's checkpoint,
under a launch: a restart of every group, a fault that stops the world, loses at most the step in flight) and
goes into the rank's step records and heartbeat (:class:`trainguard.node_tools.monitor.JobMonitor`), so the
agent sees progress, hangs and slow steps as for any guarded job, and :meth:`Replicas.digest` says whether two
replicas hold the same parameters bit for bit.

In the training script::

    rep = Replicas(model, optimizer)          # the replica group from TG_REPLICA, the lighthouse from
    model, optimizer = rep.model, rep.optimizer   # TORCHFT_LIGHTHOUSE
    while rep.step < steps:
        rep.begin()
        optimizer.zero_grad()                 # joins this step's quorum
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()                      # gradients averaged over the replicas that train this step,
                                              # then applied only if every participant commits
        rep.end(loss)                         # a committed step goes into the step records
    rep.close()

Environment: ``TG_REPLICA`` (or torchft's ``REPLICA_GROUP_ID``) names the group; ``TORCHFT_LIGHTHOUSE`` is the
lighthouse's URL (``http://host:port``); ``TG_REPLICA_HOST`` the address other groups reach this one at
(default: this host's name); ``TG_MIN_REPLICAS`` the fewest groups that may train a step (default 1);
``TG_REPLICAS`` the job's groups. A job spec with ``replicas:`` (:mod:`trainguard.operators.jobspec`) launches
one group per data-parallel replica and sets them all.
"""

from __future__ import annotations

import hashlib
import os
import socket
import time
from datetime import timedelta
from typing import Any

import torch

from trainguard.core.errors import TrainguardError
from trainguard.node_tools.monitor import JobMonitor

__all__ = ["Replicas", "ReplicasError", "state_digest"]


class ReplicasError(TrainguardError):
    """The replica group cannot start (no group name, no lighthouse)."""


def state_digest(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> str:
    """sha256 of every parameter and buffer (and the optimizer's tensors), in name order: two replicas that hold
    the same state bit for bit have the same digest."""
    h = hashlib.sha256()

    def feed(name: str, t: torch.Tensor) -> None:
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())

    for name, t in sorted(model.state_dict().items()):
        feed(name, t)
    if optimizer is not None:
        for pid, st in sorted(optimizer.state_dict()["state"].items()):
            for key, v in sorted(st.items()):
                if isinstance(v, torch.Tensor):
                    feed(f"optim.{pid}.{key}", v)
    return h.hexdigest()


class Replicas:
    """One rank of one replica group (see the module).

    :param model: the replica's model (on its device)
    :param optimizer: its optimizer
    :param replica: the group's name (default ``TG_REPLICA`` or ``REPLICA_GROUP_ID``)
    :param min_replicas: the fewest groups that may train a step
    :param timeout_s: a collective or a transfer that takes longer fails the step (the group is then left out)
    :param quorum_timeout_s: how long a step waits for its quorum
    :param monitor: the rank's hook (default: one from the environment)
    :param checkpoint: trainguard's checkpoint of the group's state every committed step (its own tiers: memory, this
        machine's disk, a replica on another machine of the group, the remote tier): a
        :class:`~trainguard.checkpoint.config.CheckpointConfig`, True for the launch's default
        (:func:`trainguard.torch.checkpoint_config_from_env`), False for none; None (the default) checkpoints when
        trainguard launched the job (``TG_RUN_DIR`` or ``TG_CHECKPOINT`` set). A group that starts restores its
        newest step first; a live replica ahead of it still heals it. A restart of every group (a fault that stops
        the world) so loses at most the step in flight.
    :param nonfinite_hold_s: after a step whose averaged gradients are not finite (a NaN on any replica reaches every
        one through the average): no replica applies it, its record says ``loss`` NaN (the agent's ``nan_loss``),
        and the group holds still this long for the control plane, which stops the job and restores the last
        finite step; then it goes on with the next batch. Seconds (0: at once).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, replica: str | None = None,
                 min_replicas: int | None = None, timeout_s: float = 30.0, quorum_timeout_s: float = 60.0,
                 monitor: JobMonitor | None = None, checkpoint: Any = None,
                 nonfinite_hold_s: float | None = None) -> None:
        from torchft import Manager, ProcessGroupGloo
        from torchft.checkpointing.pg_transport import PGTransport

        replica = replica or os.environ.get("TG_REPLICA") or os.environ.get("REPLICA_GROUP_ID")
        if not replica:
            raise ReplicasError("no replica group: set TG_REPLICA (its name, e.g. its data-parallel index)")
        if not os.environ.get("TORCHFT_LIGHTHOUSE"):
            raise ReplicasError("no lighthouse: set TORCHFT_LIGHTHOUSE to its URL (http://host:port); start one "
                                "with torchft_lighthouse --min_replicas N --bind host:port")
        _answers(os.environ["TORCHFT_LIGHTHOUSE"])
        if min_replicas is None:
            min_replicas = _env_int("TG_MIN_REPLICAS", 1)
        if min_replicas < 1:
            raise ReplicasError(f"min_replicas={min_replicas} must be at least 1")
        if nonfinite_hold_s is None:  # as trainguard.torch.Guard: hold only when trainguard launched the job
            nonfinite_hold_s = 300.0 if os.environ.get("TG_RUN_DIR") else 0.0
        if not nonfinite_hold_s >= 0:
            raise ReplicasError(f"nonfinite_hold_s={nonfinite_hold_s} must be >= 0 (seconds)")
        self.nonfinite_hold_s = float(nonfinite_hold_s)
        self.replica = str(replica)
        self.index = _index(self.replica)  # the group's number (the digits of its name; 0 without any)
        #: the job's replica groups when its launch says (``TG_REPLICAS``; 0: not said): a step's record holds it
        #: beside ``participants``, so the ETTR ledger counts a step trained by fewer groups as partly productive
        self.width = _env_int("TG_REPLICAS", 0)
        self._inner_model, self._inner_optimizer = model, optimizer
        timeout = timedelta(seconds=timeout_s)
        pg = ProcessGroupGloo(timeout=timeout)
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self.manager = Manager(
            pg=pg, min_replica_size=min_replicas, replica_id=f"tg_{self.replica}",
            load_state_dict=self._load, state_dict=self._state, timeout=timeout,
            quorum_timeout=timedelta(seconds=quorum_timeout_s),
            hostname=os.environ.get("TG_REPLICA_HOST") or socket.gethostname(),
            checkpoint_transport=PGTransport(pg, timeout=timeout, device=device))
        # the gradients are averaged by the optimizer's step (one flat all-reduce of them all through the
        # manager), not by torchft's DistributedDataParallel: its communication hook asserts on the work the
        # manager hands back once a step has failed, which killed the surviving group when its peer died
        # mid-backward (torchft 0.2.0, ddp.py _comm_hook), the one thing this must survive
        self.model = model
        self.checkpointer = self._checkpointer(checkpoint, model, optimizer)
        if monitor is None:
            # launched by trainguard as one group of TG_REPLICAS: the rank's records carry its rank in the whole job
            # (the groups' ranks in replica order), so every group's records sit beside the others', as one job's
            group_world, group_rank = _env_int("WORLD_SIZE", 1), _env_int("RANK", 0)
            whole = {"rank": self.index * group_world + group_rank, "world_size": group_world * self.width} \
                if self.width else {}
            monitor = JobMonitor.from_env(coords={"dp": self.index}, **whole)
        self.monitor = monitor
        self.optimizer = _AveragingOptimizer(self.manager, optimizer, self.monitor, self.checkpointer)
        self.monitor.start()
        self.healed = 0  # times this group jumped ahead by receiving a live replica's state
        self.restored: Any = None  # the checkpoint step this group restored at its start (None: none)
        if self.checkpointer is not None:
            self.restored = self.checkpointer.restore()
            self.checkpointer.start()
            if self.restored is not None:  # the job's step and the manager's count, as the snapshot holds them
                held = self.restored.data_position.get("manager") or {}
                nxt = int(self.restored.data_position.get("next_step", self.restored.step + 1))
                self.manager.load_state_dict({"step": int(held.get("step", nxt)),
                                              "batches_committed": int(held.get("batches_committed", 0))})
        self._start_step = self.step  # where this process began: 0, or the step after the restored one
        self._report_restore = self.restored is not None
        self._began = (self.step, time.monotonic())
        self._fresh = True  # no step committed by this process yet
        self._open = False  # a step begun and not committed yet

    @staticmethod
    def _checkpointer(checkpoint: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Any:
        if checkpoint is None:
            checkpoint = bool(os.environ.get("TG_CHECKPOINT") or os.environ.get("TG_RUN_DIR"))
        if not checkpoint:
            return None
        from trainguard.checkpoint.engine import Checkpointer
        from trainguard.core.topology import Topology
        from trainguard.torch import checkpoint_config_from_env

        world, rank = _env_int("WORLD_SIZE", 1), _env_int("RANK", 0)
        if world > 1 and not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            raise ReplicasError(f"a checkpoint of a group of {world} ranks needs torch.distributed initialised for the "
                                f"group (init_process_group) before Replicas; or pass checkpoint=False")
        if checkpoint is True:
            checkpoint = checkpoint_config_from_env()
        local = _env_int("LOCAL_WORLD_SIZE", world)
        return Checkpointer(checkpoint, topology=Topology(1, 1, world, ranks_per_machine=local if world % local == 0
                                                         else 1),
                            rank=rank, model=model, optimizer=optimizer, job=os.environ.get("TG_JOB", "job"),
                            incarnation=_env_int("TG_INCARNATION", 0))

    def _state(self) -> dict[str, Any]:
        return {"model": self._inner_model.state_dict(), "optim": self._inner_optimizer.state_dict()}

    def _load(self, state: dict[str, Any]) -> None:
        self._inner_model.load_state_dict(state["model"])
        self._inner_optimizer.load_state_dict(state["optim"])

    @property
    def step(self) -> int:
        """The job's step: how many steps the replicas committed (a group that healed has the live ones')."""
        return int(self.manager.current_step())

    @property
    def participants(self) -> int:
        """How many replica groups trained the last step."""
        return int(self.manager.num_participants())

    def begin(self) -> None:
        """Before a step (before ``optimizer.zero_grad()``, which joins its quorum). A step that did not commit is
        tried again under the same clock: its record's step time covers every try, as its ``comm_s`` does."""
        if not self._open:
            self._began = (self.step, time.monotonic())
            self._open = True
        self.monitor.step_begin(self.step)

    def end(self, loss: torch.Tensor | float, *, tokens: int = 0) -> bool:
        """After ``optimizer.step()``: whether the step was committed (the job's step advanced). A committed
        step goes into the step records with ``participants`` (the groups that trained it) and this replica; a
        group that healed meanwhile (it received a live replica's state and jumped to its step) says so."""
        before, t0 = self._began
        now = self.step
        refused = self.optimizer.refused
        if refused:  # not applied by any replica: recorded as what it was, then held for the control plane
            self.optimizer.refused = ""
            self._open = False
            step_time = time.monotonic() - t0
            self.monitor.step_end(before, loss=float("nan"), grad_norm=float("nan"), step_time_s=step_time,
                                  tokens_per_s=0.0, participants=self.participants, replica=self.replica,
                                  refused=refused, **({"width": self.width} if self.width else {}))
            self._hold(before, refused)
            return False
        if now <= before:
            return False
        self._open = False
        step_time = time.monotonic() - t0
        extra: dict[str, Any] = {"participants": self.participants, "replica": self.replica,
                                 **({"width": self.width} if self.width else {})}
        if self.checkpointer is not None:  # the state after the step, snapshotted (written in the background)
            snap = self.checkpointer.after_step(now - 1, {"next_step": now, "manager": self.manager.state_dict()},
                                                healthy=True, why="")
            extra |= {"ckpt_saved": snap.taken, "ckpt_committed": self.checkpointer.newest_committed}
            if self._report_restore:
                extra |= {"ckpt_restored_step": self.restored.step, "ckpt_restore_source": self.restored.tier}
                self._report_restore = False
        # healed: the step jumped while this group waited for its quorum, or this process (which starts from the
        # script's own initial state, at step 0) got its first committed step past the first: a live group's state
        if now > before + 1 or (self._fresh and now > self._start_step + 1):
            self.healed += 1
            extra["healed_from_step"] = before if now > before + 1 else self._start_step
        self._fresh = False
        self.monitor.step_end(now - 1, loss=float(loss), grad_norm=0.0, step_time_s=step_time,
                              tokens_per_s=tokens / step_time if step_time > 0 else 0.0, **extra)
        return True

    def _hold(self, step: int, why: str) -> None:
        """After a non-finite step: the heartbeat says the rank holds still on purpose until the control plane stops
        the job (and restores the last finite step); if nobody comes within ``nonfinite_hold_s``, go on."""
        if self.nonfinite_hold_s <= 0:
            return
        self.monitor.hold(f"step {step}: {why}", seconds=self.nonfinite_hold_s)
        time.sleep(self.nonfinite_hold_s)  # the control plane's stop ends the process
        self.monitor.release()

    def digest(self) -> str:
        """:func:`state_digest` of this replica's model and optimizer."""
        return state_digest(self._inner_model, self._inner_optimizer)

    def close(self, status: str = "finished") -> None:
        if self.checkpointer is not None:  # the last snapshots written and committed
            self.checkpointer.close(flush=status == "finished")
        self.monitor.close(status)
        self.manager.shutdown(wait=False)


#: how long a group waits at its start for the lighthouse to answer (seconds)
LIGHTHOUSE_WAIT_S = 10.0


def _answers(url: str) -> None:
    """Refuse to start (one line) when nothing listens at the lighthouse's address: torchft would otherwise wait for
    its quorum until the quorum timeout, and the job would only be seen making no step."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        host, port = parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as exc:
        raise ReplicasError(f"TORCHFT_LIGHTHOUSE={url!r} is not a URL ({exc}); write http://host:port") from None
    if parts.scheme not in ("http", "https") or not host:
        raise ReplicasError(f"TORCHFT_LIGHTHOUSE={url!r} is not a URL; write http://host:port")
    deadline = time.monotonic() + LIGHTHOUSE_WAIT_S
    while True:
        try:
            socket.create_connection((host, port), timeout=2.0).close()
            return
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise ReplicasError(f"the lighthouse {url} does not answer ({exc}); start torchft_lighthouse there, or "
                                    f"point TORCHFT_LIGHTHOUSE (replicas.lighthouse in the job spec) at the one "
                                    f"that runs") from None
            time.sleep(0.5)


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "")
    try:
        return int(raw) if raw else default
    except ValueError:
        raise ReplicasError(f"{name}={raw!r} is not a whole number; unset it or set the number") from None


def _index(replica: str) -> int:
    digits = "".join(ch for ch in replica if ch.isdigit())
    return int(digits) if digits else 0


class _AveragingOptimizer:
    """The optimizer as torchft's wrapper drives it (``zero_grad`` joins the step's quorum, ``step`` applies only
    a step every participant commits), whose ``step`` first averages the gradients over the replicas training the
    step: one all-reduce of them all, flattened, through the manager (which turns a failed all-reduce into a step
    that does not commit)."""

    def __init__(self, manager: Any, optimizer: torch.optim.Optimizer, monitor: JobMonitor, checkpointer: Any
                 ) -> None:
        self.manager, self.optim, self.monitor, self.checkpointer = manager, optimizer, monitor, checkpointer
        self.refused = ""  # why the last step was applied by no replica (its averaged gradients were not finite)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.manager.start_quorum()
        self.optim.zero_grad(set_to_none)

    def step(self) -> None:
        # counted as the step's communication (the quorum it may wait for included): the rank check judges a
        # rank's compute without it, so a replica's quorum change is not taken for a slow machine
        with self.monitor.collective("dp", "all_reduce"):
            finite = _average_gradients(self.manager, self.optim, self.monitor.faults)
            if not finite:  # every replica that took part sees the same average: none applies it
                self.refused = "the averaged gradients are not finite: update skipped on every replica"
                self.manager.report_error(RuntimeError(self.refused))
            committed = self.manager.should_commit()
        if committed:
            if self.checkpointer is not None:  # the last snapshot's copy of the state is done before it changes
                self.checkpointer.before_update()
            self.optim.step()

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optim.param_groups

    def state_dict(self) -> dict[str, Any]:
        return self.optim.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optim.load_state_dict(state)


def _average_gradients(manager: Any, optimizer: torch.optim.Optimizer, faults: Any) -> bool:
    """Average the gradients over the replicas training the step (one flat all-reduce); whether the average is
    finite."""
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    if not grads:
        return True
    # the emulated cluster's nan fault on this rank: its gradients non-finite, as a NaN loss makes them
    flat = faults.corrupt_loss(_flatten_dense_tensors(grads))
    manager.allreduce(flat).wait()  # averaged over the participants; a failure leaves the step uncommitted
    finite = bool(torch.isfinite(flat).all())
    for g, averaged in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
        g.copy_(averaged)
    return finite

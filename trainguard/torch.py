"""The face a training loop meets: one object, :class:`Guard`, at the natural points of a step.

Plain PyTorch (DDP or a single process) needs a few added lines::

    from trainguard.torch import Guard

    guard = Guard(model, optimizer, state={"scheduler": scheduler})
    step = guard.restore()                     # the step to run next: 0, or the one after the restored step
    while step < steps:
        with guard.step(step, tokens=batch_tokens) as s:
            loss = model(batch(step)).mean()
            loss.backward()
            if s.ok(loss):                     # finite loss and gradients on every rank?
                optimizer.step()
            scheduler.step()
        step += 1
    guard.close()

What the guard does for the loop:

* **Heartbeat and step records** for the machine's agent (:class:`trainguard.node_tools.monitor.JobMonitor`):
  each rank's heartbeat, one record a step (loss, gradient norm, step time, throughput), collectives counted
  when the loop wraps them in :meth:`Guard.collective`.
* **Per-step checkpoints** (:class:`trainguard.checkpoint.engine.Checkpointer`): the model, the optimizer, the
  random number generators and every object in ``state`` (anything with ``state_dict``/``load_state_dict``
  whose state is JSON: a learning-rate scheduler, a sampler's position) are snapshotted into a CPU buffer at
  the end of each step and persisted, replicated to another machine and uploaded in the background.
  :meth:`Guard.restore` loads the newest step every rank holds and returns the step to run next.
* **Non-finite steps**: :meth:`GuardedStep.ok` says whether the step's loss and gradients are finite on every
  rank (one tiny all-reduce, so every rank takes the same decision). A non-finite step is not applied, not
  snapshotted, and recorded; the rank then holds still (its heartbeat says why) for the control plane to stop
  the job and restore the last finite step, or goes on after ``nonfinite_hold_s``.
* **Host busy and idle**: the checkpoint's background work runs while the host waits for the device
  (:meth:`Guard.host_idle` / :meth:`Guard.host_busy`, and the moment :meth:`GuardedStep.ok` is called).

Outside a trainguard launch (no ``TG_RUN_DIR``), the guard still works: it writes its records under
``./tg-run`` and takes checkpoints only when asked (``checkpoint=True`` or a :class:`CheckpointConfig`).
Inside one it takes them by default, where the job's spec says (``TG_CHECKPOINT``) or in the job's run
directory on each machine.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import math
import os
import random
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

from trainguard.checkpoint.config import CheckpointConfig, default_s3_url, expand_root, root_template
from trainguard.checkpoint.errors import RestoreError
from trainguard.checkpoint.info import RestoreResult, SnapshotInfo
from trainguard.checkpoint.shards import local_part
from trainguard.checkpoint.slots import ReferenceCopy  # noqa: F401 - importable from here, as before
from trainguard.core.errors import TopologyError, TrainguardError  # noqa: F401
from trainguard.core.topology import GROUP_KINDS, RankCoords, Topology  # noqa: F401
from trainguard.node_tools.monitor import JobMonitor

# the face: what a training loop uses (the module's other names serve the adapters and stay importable)
__all__ = ["CheckpointConfig", "Guard", "GuardError", "GuardedStep", "RestoreError", "Topology", "TrainguardError",
           "checkpoint_config_from_env", "heartbeat"]

#: how long a rank holds still after a non-finite step when trainguard launched the job (``TG_RUN_DIR``): the
#: control plane stops the job and restores the last finite step well within it
LAUNCHED_HOLD_S = 300.0

STATE_KEY = "state"  # where the ``state`` objects' states live in a checkpoint's data position


def logger() -> logging.Logger:
    """The ``trainguard`` logger the guard's lines go to (restores, non-finite steps), at INFO. A job that
    configured logging (a handler on the root logger) gets them through its own handlers; one that did not
    gets them on standard error, prefixed ``trainguard:``, as Lightning does for its own logger."""
    log = logging.getLogger("trainguard")
    if not log.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("trainguard: %(message)s"))
        log.addHandler(handler)
        log.propagate = False
    if log.level == logging.NOTSET:
        log.setLevel(logging.INFO)
    return log


class GuardError(TrainguardError):
    """A guard used wrongly (a state that is not JSON, a step out of order); the message says what to change."""


class Stateful(Protocol):
    def state_dict(self) -> Mapping[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any], /) -> Any: ...


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        raise GuardError(f"{name}={os.environ.get(name)!r} is not an integer; fix the job's environment") from None


def checkpoint_config_from_env(*, root: str = "", s3_url: str | None = None, ranks_per_machine: int = 0,
                               **fields: Any) -> CheckpointConfig:
    """The checkpoint configuration of this rank of a launched job.

    ``root``: the machine's checkpoint root; may hold ``{machine}``, ``{rank}``, ``{local_rank}`` ("" =
    ``TG_CHECKPOINT``, set by ``tg-node job start``, else ``<TG_RUN_DIR>/checkpoints``). ``s3_url``: the remote
    tier (None = ``TG_CHECKPOINT`` when it is an ``s3://`` URL; "" = none), its endpoint from
    ``TG_S3_ENDPOINT_URL``. ``ranks_per_machine``: for replica placement (0 = ``LOCAL_WORLD_SIZE``). ``fields``
    set any other field of :class:`CheckpointConfig`; ``restore_max_step`` comes from ``TG_RESTORE_MAX_STEP``
    when the launch sets it (a restart after silent corruption or a non-finite loss)."""
    rank = _env_int("RANK", 0)
    rpm = ranks_per_machine or _env_int("LOCAL_WORLD_SIZE", _env_int("WORLD_SIZE", 1))
    cap = os.environ.get("TG_RESTORE_MAX_STEP", "")
    if cap and "restore_max_step" not in fields:  # the control plane's: no step after a silent corruption
        fields["restore_max_step"] = _env_int("TG_RESTORE_MAX_STEP", 0)
    base: dict[str, Any] = {
        "root": expand_root(root_template(root), machine=rank // max(1, rpm), rank=rank,
                            local_rank=_env_int("LOCAL_RANK", 0)),
        "s3_url": default_s3_url() if s3_url is None else s3_url, "ranks_per_machine": ranks_per_machine,
        "s3_endpoint_url": os.environ.get("TG_S3_ENDPOINT_URL", "")}
    return CheckpointConfig(**(base | fields))


def heartbeat(*, coords: dict[str, int] | None = None) -> JobMonitor:
    """Start this rank's heartbeat now, before a long rendezvous (``init_process_group`` waits for every
    machine): the agent sees the rank from its start. Hand it to :class:`Guard` (``monitor=``)."""
    return JobMonitor.from_env(coords=coords)


def _json_state(name: str, obj: Stateful) -> Any:
    """``obj.state_dict()`` as plain JSON (a deep copy: the snapshot must not change with the object)."""
    try:
        return json.loads(json.dumps(obj.state_dict(), allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise GuardError(f"state {name!r} ({type(obj).__name__}): its state_dict() is not JSON ({exc}); pass "
                         f"objects whose state is numbers, strings, lists and dicts, or keep tensors in the "
                         f"model or the optimizer") from None


TENSOR_TAG = "__tensor__"  # a small tensor inside a JSON state (see json_tensors)
JSON_TENSOR_MAX_BYTES = 1 << 20


def json_tensors(value: Any) -> Any:
    """``value`` with each tensor in it (in dicts, lists, tuples) written as JSON: its dtype, shape and bytes in
    base64, as ``{"__tensor__": {...}}``; for small tensors inside a state that is otherwise JSON (a sampler's or
    a data loader's generator state). A tensor over 1 MiB is refused: keep it in the model or the optimizer."""
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        size = t.numel() * t.element_size()
        if size > JSON_TENSOR_MAX_BYTES:
            raise GuardError(f"a tensor of {size} bytes ({tuple(t.shape)}, {t.dtype}) in a JSON state; keep tensors "
                             f"over {JSON_TENSOR_MAX_BYTES} bytes in the model or the optimizer")
        raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return {TENSOR_TAG: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                             "data": base64.b64encode(raw).decode("ascii")}}
    if isinstance(value, Mapping):
        return {k: json_tensors(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_tensors(v) for v in value]
    return value


def tensors_from_json(value: Any) -> Any:
    """The inverse of :func:`json_tensors` (lists stay lists)."""
    if isinstance(value, Mapping):
        if set(value) == {TENSOR_TAG}:
            d = value[TENSOR_TAG]
            dtype = getattr(torch, d["dtype"])
            raw = bytearray(base64.b64decode(d["data"]))
            flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
            return flat.view(dtype).reshape(d["shape"]).clone()
        return {k: tensors_from_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [tensors_from_json(v) for v in value]
    return value


def rng_states() -> dict[str, Any]:
    """This process's random generators, in the Hugging Face Trainer's ``rng_state.pth`` layout: ``python``,
    ``cpu``, and ``numpy`` and ``cuda`` where they are in use."""
    states: dict[str, Any] = {"python": random.getstate(), "cpu": torch.get_rng_state()}
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        states["numpy"] = numpy.random.get_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: Mapping[str, Any]) -> None:
    """Put back what :func:`rng_states` returned."""
    random.setstate(states["python"])
    torch.set_rng_state(states["cpu"])
    if "numpy" in states:
        sys.modules["numpy"].random.set_state(states["numpy"])
    if "cuda" in states:
        torch.cuda.set_rng_state_all(states["cuda"])


def _all_finite(values: list[float | torch.Tensor]) -> bool:
    for v in values:
        if isinstance(v, torch.Tensor):
            if not bool(torch.isfinite(v.detach()).all()):
                return False
        elif not math.isfinite(float(v)):
            return False
    return True


def _scalar(value: float | torch.Tensor) -> float:
    """A loss as a number (a tensor's mean)."""
    return float(value.detach().float().mean()) if isinstance(value, torch.Tensor) else float(value)


def gradient_norm(parameters: Iterator[torch.nn.Parameter] | list[torch.nn.Parameter]) -> float:
    """The 2-norm of this rank's gradients (``inf``/``nan`` when one is not finite). Under DDP every rank's
    gradients are the reduced ones; under sharding each rank measures its shard."""
    grads = [local_part(p.grad) for p in parameters if p.grad is not None]
    if not grads:
        return 0.0
    # one tensor at a time, half precision measured in float32 (a norm above 65,504 is no overflow of the job's):
    # converting every half-precision gradient first, for torch's get_total_norm, would hold a float32 copy of
    # all of them at once
    norms = [torch.linalg.vector_norm(g.float()) for g in grads]
    return float(torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms])))


@dataclass
class GuardedStep:
    """One step under guard, from :meth:`Guard.step`. Call :meth:`ok` before the optimizer's step; the step is
    recorded (and snapshotted) when its ``with`` block ends."""

    guard: Guard
    step: int
    tokens: float = 0.0
    began: float = field(default_factory=time.perf_counter)
    loss: float = float("nan")
    grad_norm: float = float("nan")
    finite: bool | None = None  # what ok() decided; None until it is called
    refused: str = ""  # why the step's state must not be kept (a non-finite step, replicas that differ)
    extra: dict[str, Any] = field(default_factory=dict)
    update_wait_s: float = 0.0
    unsaved: str = ""  # why the step is not snapshotted though its state is sound (see skip_snapshot)
    local_end: float | None = None  # when the step's first forward ended (see mark_local)
    local_comm_s: float = 0.0  # the step's time in counted collectives by then
    comm_at_begin: float = 0.0  # the monitor's counted collective time when the step began
    device_began: bool = False  # the device timer's start was recorded for this step
    device_marked: bool = False  # ... and its end, at the mark

    def mark_local(self) -> None:
        """The step's first forward pass ended: what came before is the rank's own work, and a wait for the other
        ranks can come next (DDP's gradient all-reduce in backward, the first micro-batch's too when the framework
        does not hold it back). The guard marks it when the model's forward returns; an adapter that sees the
        backward begin marks it there; the first mark of a step counts. Recorded as the step's ``local_s``: the
        compute the fail-slow rules compare across ranks, since a wait inside the framework's own collectives is
        invisible to ``comm_s`` (a straggler's peers wait there, and read as slow as it). Timed on the host, the
        forward's own counted collectives (a pipeline's receive, a tensor-parallel all-reduce) are taken out of it,
        as from the step; timed on a GPU, it is the device's time up to the mark, its collectives' kernels
        included."""
        if self.local_end is not None:
            return
        self.local_end = time.perf_counter()
        # a pipeline's or tensor-parallel forward's own waits
        self.local_comm_s = self.guard.monitor.comm_s() - self.comm_at_begin
        self.device_marked = self.device_began and self.guard._record_device(1)

    def ok(self, loss: float | torch.Tensor | None = None, *, grad_norm: float | None = None,
           sync: bool | None = None) -> bool:
        """Whether the optimizer may apply this step: the loss and the gradients are finite on every rank.

        ``loss``: the step's loss (a tensor or a number; NaN injected by the emulated cluster's ``nan`` fault
        shows here). ``grad_norm``: the gradient norm if the loop computed it already (after clipping's
        measurement, for instance); otherwise the guard measures the model's gradients. ``sync``: take the
        decision on every rank together (one all-reduce of a flag on the default group, so a NaN on one rank
        skips the step everywhere); the guard's default. A loop whose loss and norm are already the same on
        every rank may pass ``sync=False``.

        Also waits for the last snapshot's copy before the parameters change. A non-finite step is not
        snapshotted, and the rank holds still after it (see :class:`Guard`)."""
        g = self.guard
        together = g.sync if sync is None else sync
        if loss is not None:
            # the emulated cluster's "nan" fault on this rank; only when the decision is taken together: a loop that
            # passes sync=False promises a loss already the same on every rank, and applies faults in its own loss
            if together and g.faults is not None:
                loss = g.faults.corrupt_loss(loss)
            self.loss = _scalar(loss)
        if grad_norm is None:
            grad_norm = gradient_norm(g.model.parameters()) if g.model is not None else 0.0
        self.grad_norm = float(grad_norm)
        loss_ok = _all_finite([self.loss if loss is not None else 0.0])
        finite = loss_ok and _all_finite([self.grad_norm])
        if g.scaler is not None:
            # mixed precision: gradients that overflowed are the scaler's to skip (it lowers its scale); only a
            # loss that is not finite is a fault. The decision is taken on the loss alone, together
            if together:
                loss_ok = g.all_ranks(loss_ok)
            self.finite = loss_ok
            if not loss_ok:
                self.refuse(f"loss {self.loss}, gradient norm {self.grad_norm}: update skipped")
            elif not finite:
                self.extra["scaler_skipped"] = True
            self.update_wait_s = g.before_update()
            return loss_ok  # the scaler's step skips the update itself when the gradients overflowed
        if together:
            finite = g.all_ranks(finite)
        self.finite = finite
        if not finite:
            self.refuse(f"loss {self.loss}, gradient norm {self.grad_norm}: update skipped")
        self.update_wait_s = g.before_update()
        return finite

    def refuse(self, why: str) -> None:
        """Keep no snapshot of this step (``why`` goes into the rank's log and the checkpoint's counters): its
        parameters are not worth restoring. Every rank must refuse the same steps."""
        self.refused = self.refused or why

    def skip_snapshot(self, why: str) -> None:
        """Take no snapshot of this (sound) step: a restore then goes back to the step before, and this one runs
        again (for a step whose state the trainer cannot resume from exactly). Every rank must skip the same."""
        self.unsaved = self.unsaved or why

    def report(self, *, loss: float | torch.Tensor | None = None, grad_norm: float | None = None,
               tokens: float | None = None, **extra: Any) -> None:
        """Fields for the step's record: the loss and gradient norm to record (instead of what :meth:`ok`
        saw), the tokens the step trained on (for throughput), and any extra JSON fields."""
        if loss is not None:
            self.loss = _scalar(loss)
        if grad_norm is not None:
            self.grad_norm = float(grad_norm)
        if tokens is not None:
            self.tokens = float(tokens)
        self.extra.update(extra)


class Guard:
    """One rank's guard: the monitor hook, the checkpointer and the non-finite policy behind one object.

    Build it on every rank after ``torch.distributed.init_process_group`` (it creates the checkpoint's own
    process groups, in the same order on every rank), with the objects whose state makes the training:

    Args:
        model: the model (plain, DDP-wrapped or a pipeline stage): its ``state_dict`` is snapshotted.
        optimizer: its optimizer (state and parameter groups are snapshotted), or None.
        state: other objects to restore with the step (``state_dict``/``load_state_dict``, JSON states): a
            learning-rate scheduler, a sampler, a data loader's position.
        checkpoint: a :class:`CheckpointConfig`; True for the launch's default (:func:`checkpoint_config_from_env`);
            False for none; None (the default) takes checkpoints when trainguard launched the job (``TG_RUN_DIR``
            or ``TG_CHECKPOINT`` is set: under ``TG_CHECKPOINT``, else ``<TG_RUN_DIR>/checkpoints``) and none
            otherwise.
        topology: the job's tensor x pipeline x data parallel layout (checkpoint replicas are placed on other
            machines by it); None = data parallel only, ``LOCAL_WORLD_SIZE`` ranks a machine.
        coords: the rank's coordinates to report (default: from ``topology``).
        nonfinite_hold_s: after a non-finite step, hold still this long for the control plane (which stops the
            job and restores the last finite step), then go on with the next batch; 0 = go on at once. Seconds.
            None (the default): 300 s when trainguard launched the job (``TG_RUN_DIR``), 0 otherwise: a run by
            hand has no control plane to wait for.
        scaler: the loop's ``torch.amp.GradScaler`` (mixed precision): a step whose loss is finite but whose
            gradients are not is the scaler's to skip (it lowers its scale and skips the optimizer's step), not a
            fault: :meth:`GuardedStep.ok` judges the loss alone (call ``scaler.step(optimizer)`` when it says True:
            the scaler skips the update itself), the rank is not held, and the step is snapshotted as the scaler
            left it (recorded ``scaler_skipped``). Put the scaler in ``state`` too, so that its scale comes back
            with a restore.
        sync: :meth:`GuardedStep.ok` decides on every rank together (default True).
        collective_timeout_s: timeout of the checkpoint's own collectives. Seconds.
        monitor: a :class:`JobMonitor` built already (default: one from the environment).
        log: where the guard's lines go (default: the ``trainguard`` logger, from local rank 0 only; see
            :func:`logger`).
    """

    def __init__(self, model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None = None, *,
                 state: Mapping[str, Stateful] | None = None, checkpoint: CheckpointConfig | bool | None = None,
                 topology: Topology | None = None, coords: dict[str, int] | None = None,
                 nonfinite_hold_s: float | None = None, sync: bool = True, collective_timeout_s: float = 1800.0,
                 monitor: JobMonitor | None = None, log: Callable[[str], None] | None = None,
                 scaler: Any = None) -> None:
        if nonfinite_hold_s is None:
            nonfinite_hold_s = LAUNCHED_HOLD_S if os.environ.get("TG_RUN_DIR") else 0.0
        if not nonfinite_hold_s >= 0:
            raise GuardError(f"nonfinite_hold_s={nonfinite_hold_s} must be >= 0 (seconds)")
        self.model = model
        self.optimizer = optimizer
        # the step's local part ends when the model's first forward returns (see GuardedStep.mark_local); on a GPU
        # it is timed by a pair of CUDA events (the host returns from forward before the device computed it); the hook
        # stays out of torch.compile's graphs (it reads the host's clock)
        self._local_timer: tuple[Any, Any, Any] | None = None  # (start, end, device), made at the first step
        self._device_timing = True  # False once the device timer failed: the host's clock from then on
        self._hook = model.register_forward_hook(torch.compiler.disable(self._forward_returned)) if model is not None \
            else None
        self.state: dict[str, Stateful] = dict(state or {})
        for name, obj in self.state.items():
            if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
                raise GuardError(f"state {name!r} ({type(obj).__name__}) has no state_dict()/load_state_dict(); "
                                 f"pass objects that have both")
            _json_state(name, obj)  # refused now, in one line, rather than at the first step
        self.distributed = dist.is_available() and dist.is_initialized()
        self.world_size = dist.get_world_size() if self.distributed else _env_int("WORLD_SIZE", 1)
        self.rank = dist.get_rank() if self.distributed else _env_int("RANK", 0)
        self.local_rank = _env_int("LOCAL_RANK", 0)
        rpm = _env_int("LOCAL_WORLD_SIZE", self.world_size)
        if topology is None:
            topology = Topology(1, 1, self.world_size, ranks_per_machine=rpm if self.world_size % rpm == 0 else 1)
        if topology.world_size != self.world_size:
            raise GuardError(f"topology {topology} has {topology.world_size} ranks but the job has "
                             f"{self.world_size}; pass the layout the job runs")
        self.topology = topology
        self.nonfinite_hold_s = float(nonfinite_hold_s)
        self.scaler = scaler
        self.sync = sync
        self._stepped = False  # the first step began (checked: see _first_step)
        self._restore_called = False
        self._params_at_restore: tuple[int, ...] | None = None
        self._log_fn = log
        if coords is None:
            c = topology.coords(self.rank)
            coords = {"tp": c.tp, "pp": c.pp, "dp": c.dp}
        self.monitor = monitor if monitor is not None else JobMonitor.from_env(coords=coords)
        self.faults = self.monitor.faults
        self.restored: RestoreResult | None = None
        self._report_restore = False
        self._closed = False
        self._current: GuardedStep | None = None
        self.last_snapshot: SnapshotInfo | None = None
        self._flag = None  # the finite flag's buffer (on the model's device)
        if checkpoint is None:
            checkpoint = bool(os.environ.get("TG_CHECKPOINT") or os.environ.get("TG_RUN_DIR"))
        if checkpoint is True:
            checkpoint = checkpoint_config_from_env(control_timeout_s=collective_timeout_s)
        self.checkpointer = None
        if checkpoint:
            if model is None:
                raise GuardError("checkpoints need the model: pass Guard(model, optimizer, ...)")
            from trainguard.checkpoint.engine import Checkpointer

            self.checkpointer = Checkpointer(checkpoint, topology=topology, rank=self.rank, model=model,
                                             optimizer=optimizer, job=os.environ.get("TG_JOB", "job"),
                                             incarnation=_env_int("TG_INCARNATION", 0))

    # ---- start ----------------------------------------------------------------------
    def restore(self) -> int:
        """Restore the newest step every rank can get (all ranks together, before the first step) and start the
        checkpoint's background work. Returns the step to run next: 0 when there is nothing to restore.

        Raises :class:`trainguard.checkpoint.errors.RestoreError` when checkpoints exist but none can be
        restored on every rank (the job should stop: ``close("failed")``)."""
        ck = self.checkpointer
        if ck is None:
            return 0
        result = ck.restore()
        ck.start()
        self._restore_called = True
        if result is None:
            return 0
        self._params_at_restore = self._param_fingerprint()
        saved = result.data_position.get(STATE_KEY) or {}
        missing = sorted(set(self.state) - set(saved))
        if missing:
            self._log(f"restored step {result.step} holds no state for {', '.join(missing)}: kept as built")
        for name, obj in self.state.items():
            if name in saved:
                obj.load_state_dict(saved[name])
        self.restored = result
        self._report_restore = True
        sources = ", ".join(f"{tier} {n}" for tier, n in sorted(result.counts.items()))
        nxt = int(result.data_position.get("next_step", result.step + 1))
        self._log(f"restored step {result.step} ({sources}) in {result.seconds:.2f}s; resuming at step {nxt}")
        return nxt

    # ---- a step -----------------------------------------------------------------------
    @contextlib.contextmanager
    def step(self, step: int, *, tokens: float = 0.0) -> Iterator[GuardedStep]:
        """One training step: ``with guard.step(n, tokens=...) as s:`` around the step's work. ``tokens``: what
        the step trains on, job-wide (tokens or samples), for the throughput the agent watches.

        At the end of the block the step is recorded and snapshotted; after a non-finite step the rank holds
        still (see :class:`Guard`). An exception inside the block is raised as it is, nothing recorded."""
        s = self.begin(step, tokens=tokens)
        try:
            yield s
        finally:
            self._current = None
        self.end_step(s)

    def begin(self, step: int, *, tokens: float = 0.0) -> GuardedStep:
        """Begin a step without a ``with`` block (for adapters whose trainer owns the loop: call
        :meth:`end_step` from the trainer's step-end hook)."""
        if self._current is not None:
            raise GuardError(f"step {step} began inside step {self._current.step}; end one step before the next")
        if not self._stepped:
            self._first_step(step)
        s = GuardedStep(self, step, tokens=tokens, comm_at_begin=self.monitor.comm_s())
        self._current = s
        if self._local_timer is None and self._device_timing and self.model is not None \
                and torch.cuda.is_available():
            device = next((p.device for p in self.model.parameters()), None)
            if device is not None and device.type == "cuda":
                self._local_timer = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True),
                                     device)
            else:
                self._device_timing = False
        s.device_began = self._record_device(0)
        self.monitor.step_begin(step)
        return s

    def _record_device(self, which: int) -> bool:
        """Record the device timer's start (0) or end (1) on the model's device's current stream; False when there
        is no device timer, or it cannot record now (a CUDA graph being captured), or it failed (then the host's
        clock times every step from here on: timing never stops a step)."""
        timer = self._local_timer
        if timer is None:
            return False
        try:
            if torch.cuda.is_current_stream_capturing():
                return False
            with torch.cuda.device(timer[2]):
                timer[which].record(torch.cuda.current_stream(timer[2]))
            return True
        except Exception as exc:  # a hook fired on another device's thread (DataParallel), a driver error
            self._local_timer, self._device_timing = None, False
            self._log(f"the device timer of a step's local part failed ({type(exc).__name__}: {exc}); timing it on "
                      f"the host from here on")
            return False

    def _forward_returned(self, _module: Any, _inputs: Any, _output: Any) -> None:
        s = self._current
        if s is not None:
            s.mark_local()

    def _local_s(self, s: GuardedStep) -> float | None:
        """The step's local part (seconds): from its beginning to :meth:`GuardedStep.mark_local`'s mark, on the
        device's clock when it is a GPU; None when nothing marked it."""
        if s.local_end is None:
            return None
        if s.device_marked and self._local_timer is not None:
            start, end, _device = self._local_timer
            try:
                end.synchronize()
                return start.elapsed_time(end) / 1000.0
            except Exception:  # timing never stops a step: the host's clock instead
                self._local_timer, self._device_timing = None, False
        return max(0.0, s.local_end - s.began - s.local_comm_s)

    def _first_step(self, step: int) -> None:
        """The first step of this process: checkpoints start even when :meth:`restore` was not called (they would
        otherwise be off without a word), and a program that loaded its own checkpoint after :meth:`restore` is
        stopped, in one line, before it trains on with a state older than trainguard's."""
        self._stepped = True
        ck = self.checkpointer
        if ck is None:
            return
        if not self._restore_called:
            self._log("guard.restore() was not called: checkpoints start now and nothing was restored; call "
                      "step = guard.restore() before the loop to resume from trainguard's newest step")
            ck.start()
            return
        if self.restored is not None and self._params_at_restore is not None \
                and self._param_fingerprint() != self._params_at_restore:
            raise GuardError(f"the model's parameters changed between guard.restore() (step {self.restored.step}) "
                             f"and step {step}: the program loaded a checkpoint of its own over trainguard's newer "
                             f"one; call guard.restore() after the program's own resume (it wins only where "
                             f"trainguard has nothing), or skip the program's resume when guard.restore() > 0")

    def _param_fingerprint(self) -> tuple[float, ...]:
        """A cheap fingerprint of the model's values: each parameter's (local part's) sum. A wrapper that writes the
        same values again (DDP broadcasting rank 0's restored state) leaves it; a program's own checkpoint does not."""
        if self.model is None:
            return ()
        with torch.no_grad():
            return tuple(float(local_part(p).detach().double().sum()) for p in self.model.parameters())

    def end_step(self, s: GuardedStep) -> None:
        """Snapshot and record a step begun with :meth:`begin` (what the end of :meth:`step`'s block does)."""
        self._current = None
        if s.finite is None:  # ok() was not called: the update's copy must still be done before anything changes
            s.update_wait_s = self.before_update()
        extra: dict[str, Any] = {}
        ck = self.checkpointer
        if ck is not None and s.unsaved and not s.refused:
            extra["ckpt_unsaved"] = s.unsaved
        elif ck is not None:
            data_position: dict[str, Any] = {"next_step": s.step + 1}
            if self.state and not s.refused:  # read only for a snapshot
                data_position[STATE_KEY] = {name: _json_state(name, obj) for name, obj in self.state.items()}
            snap = ck.after_step(s.step, data_position, healthy=not s.refused, why=s.refused)
            self.last_snapshot = snap
            extra |= {"ckpt_blocking_s": round(s.update_wait_s + snap.blocking_s, 6), "ckpt_saved": snap.taken,
                      "ckpt_skipped": snap.skipped, "ckpt_refused": snap.refused,
                      "ckpt_waited_s": round(snap.waited_s, 6), "ckpt_committed": ck.newest_committed,
                      "ckpt_bg_cpu_s": round(ck.background_cpu_s(), 6)}
            if snap.memcpy_s is not None:
                extra["ckpt_memcpy_s"] = round(snap.memcpy_s, 6)
        if ck is not None and self._report_restore and self.restored is not None:
            r = self.restored
            extra |= {"ckpt_restored_step": r.step, "ckpt_restore_s": round(r.seconds, 4),
                      "ckpt_restore_source": r.tier}
            self._report_restore = False
        local = self._local_s(s)
        if local is not None:
            extra["local_s"] = round(local, 6)
        step_time = time.perf_counter() - s.began
        self.monitor.step_end(s.step, loss=s.loss, grad_norm=s.grad_norm, step_time_s=step_time,
                              tokens_per_s=s.tokens / step_time if step_time > 0 else 0.0,
                              **extra, **s.extra)
        if s.finite is False:
            self.hold_still(s.step, s.refused)

    def hold_still(self, step: int, why: str) -> None:
        """After a non-finite step: the heartbeat says the rank holds still on purpose; wait for the control
        plane to stop the job and restore the last finite step. If nobody comes within ``nonfinite_hold_s``, go
        on with the next batch (the parameters are still those of the last finite step)."""
        hold = self.nonfinite_hold_s
        self._log(f"step {step}: {why}; holding up to {hold:.0f}s for the control plane")
        if hold <= 0:
            return
        self.monitor.hold(f"step {step}: {why}", seconds=hold)
        time.sleep(hold)  # the control plane's stop ends the process
        self.monitor.release()
        self._log(f"step {step}: nobody came in {hold:.0f}s; going on with the next batch")

    # ---- inside a step ---------------------------------------------------------------
    def collective(self, group: str, op: str) -> contextlib.AbstractContextManager[None]:
        """``with guard.collective("dp", "all_reduce"):`` around a collective the loop issues itself: counted in
        the heartbeat, so a hang names the group and the operation."""
        return self.monitor.collective(group, op)

    def host_idle(self) -> None:
        """The host thread starts waiting for the device (the checkpoint's background work may run now)."""
        if self.checkpointer is not None:
            self.checkpointer.host_idle()

    def host_busy(self) -> None:
        """The host thread works again."""
        if self.checkpointer is not None:
            self.checkpointer.host_busy()

    def before_update(self) -> float:
        """Wait until the last snapshot's copy is done (the parameters are about to change); seconds waited."""
        return self.checkpointer.before_update() if self.checkpointer is not None else 0.0

    def all_ranks(self, flag: bool) -> bool:
        """True when ``flag`` is true on every rank (one all-reduce on the default group; the flag itself
        outside a distributed job)."""
        if not self.distributed or self.world_size == 1:
            return flag
        device = torch.device("cpu")
        if dist.get_backend() == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
        t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
        with self.monitor.collective("world", "all_reduce"):
            dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t.item())

    # ---- end ------------------------------------------------------------------------
    def close(self, status: str = "finished", *, flush: bool | None = None) -> None:
        """End the guard: write, replicate and commit the last snapshots (``flush``, default: when the job
        finished) and leave a last heartbeat saying how the rank ended ("finished" or "failed"). Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._hook is not None:  # a fit run again builds a guard of its own: this one's hook leaves the model
            self._hook.remove()
            self._hook = None
        if self.checkpointer is not None:
            self.checkpointer.close(flush=status == "finished" if flush is None else flush)
        self.monitor.close(status)

    def __enter__(self) -> Guard:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.close("finished" if exc_type is None else "failed")

    def status(self) -> dict[str, Any]:
        """The checkpoint's counters (snapshots taken, skipped, refused, waits), for a loop's own report."""
        return self.checkpointer.status() if self.checkpointer is not None else {}

    def _log(self, line: str) -> None:
        if self._log_fn is not None:
            self._log_fn(line)
        elif self.local_rank == 0:
            logger().info("rank %d: %s", self.rank, line)

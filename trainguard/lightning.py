"""PyTorch Lightning under trainguard: one callback.

::

    import lightning as L
    from torchdata.stateful_dataloader import StatefulDataLoader
    from trainguard.lightning import TrainguardCallback

    loader = StatefulDataLoader(dataset, batch_size=32, shuffle=True)  # resumable mid-epoch
    trainer = L.Trainer(strategy="ddp", callbacks=[TrainguardCallback()], enable_checkpointing=False)
    trainer.fit(model, loader)

The callback builds a :class:`trainguard.torch.Guard` when the fit starts (the optimizer and the process group
exist then) and restores the newest step every rank holds: the module's weights, the optimizer, the random
number generators, the learning-rate schedulers and the fit loop's own state (Lightning's progress counters
and, for a resumable data loader such as torchdata's ``StatefulDataLoader``, the loader's position), so the
epoch goes on at the batch after the restored step as a Lightning checkpoint resume would. Every optimizer
step is one guarded step (give the data loader a ``generator`` of its own: then no iterator the fit creates
draws from the global random generator, and the random state a step starts from is the same with or without a
restore, epoch boundaries included): the heartbeat and the step record for the machine's agent, the finite check of the
loss and gradients on every rank before the optimizer applies them (a non-finite step is skipped, its
gradients dropped, and the rank holds still for the control plane), and the per-step asynchronous snapshot.

Lightning's own ``ModelCheckpoint`` may stay on for the team's exports; the guard does not need it. One
optimizer per module is supported (``configure_optimizers`` returning several is refused in one line).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from trainguard.torch import (
    CheckpointConfig,
    Guard,
    GuardedStep,
    GuardError,
    Stateful,
    Topology,
    json_tensors,
    rng_states,
    set_rng_states,
    tensors_from_json,
)

__all__ = ["TrainguardCallback"]


class _FitState:
    """Lightning's side of a step's state: the fit loop (progress counters, the data loader's position) and the
    learning-rate schedulers, as :class:`Guard` keeps any ``state`` object."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        t = self.trainer
        # a loader's state may hold a generator's state (a small tensor): written as JSON, read back as a tensor
        return json_tensors({"fit_loop": t.fit_loop.state_dict(),
                             "schedulers": [c.scheduler.state_dict() for c in t.lr_scheduler_configs]})

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        t = self.trainer
        state = tensors_from_json(state)
        t.fit_loop.load_state_dict(dict(state["fit_loop"]))  # marks the loops as restarting, as a resume does
        schedulers = list(state.get("schedulers", []))
        if len(schedulers) != len(t.lr_scheduler_configs):
            raise GuardError(f"the restored step has {len(schedulers)} learning-rate schedulers, the module "
                             f"configures {len(t.lr_scheduler_configs)}; restore with the code it was saved with")
        for config, saved in zip(t.lr_scheduler_configs, schedulers, strict=True):
            config.scheduler.load_state_dict(saved)


def _batch_elements(batch: Any) -> int:
    """Elements of the batch's first tensor (tokens of a token batch, samples of a feature batch's rows...)."""
    if isinstance(batch, torch.Tensor):
        return batch.numel()
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    if isinstance(batch, list | tuple):
        for item in batch:
            n = _batch_elements(item)
            if n:
                return n
    return 0


class TrainguardCallback(Callback):
    """The guard as a Lightning callback (see the module's documentation).

    Args:
        state: more objects to restore with each step (``state_dict``/``load_state_dict`` with JSON states);
            the fit loop and the schedulers are kept already.
        checkpoint, topology, nonfinite_hold_s, sync, collective_timeout_s: as :class:`trainguard.torch.Guard`.
        tokens: what one step trains on, for the throughput the agent watches: a number (job-wide), or a function
            of a rank's batch returning that rank's count (default: the elements of the batch's first tensor,
            times the number of ranks).
    """

    def __init__(self, *, state: Mapping[str, Stateful] | None = None,
                 checkpoint: CheckpointConfig | bool | None = None, topology: Topology | None = None,
                 nonfinite_hold_s: float | None = None, sync: bool = True, collective_timeout_s: float = 1800.0,
                 tokens: float | Callable[[Any], float] | None = None) -> None:
        if state and "lightning" in state:
            raise GuardError("state name 'lightning' is the callback's own (the fit loop); name yours otherwise")
        self._state = dict(state or {})
        self._options: dict[str, Any] = {"checkpoint": checkpoint, "topology": topology,
                                         "nonfinite_hold_s": nonfinite_hold_s, "sync": sync,
                                         "collective_timeout_s": collective_timeout_s}
        self._tokens = tokens
        self.guard: Guard | None = None
        self.resumed_at: int = 0  # the step the fit went on from (0 when nothing was restored)
        self._step: GuardedStep | None = None
        self._loss: torch.Tensor | None = None
        self._stepped = False
        self._rng: dict[str, Any] | None = None

    # ---- fit start: the guard, and the restore --------------------------------------------------------
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        optimizers = trainer.optimizers
        if len(optimizers) > 1:
            raise GuardError(f"the module configures {len(optimizers)} optimizers; the guard keeps one: return "
                             f"one optimizer from configure_optimizers")
        self.guard = Guard(pl_module, optimizers[0] if optimizers else None,
                           state={"lightning": _FitState(trainer), **self._state}, **self._options)
        nxt = self.guard.restore()
        if nxt and trainer.global_step != nxt:
            raise GuardError(f"restored step {nxt - 1}, but Lightning's step counter says {trainer.global_step}; "
                             f"the fit loop's state did not come back")
        self.resumed_at = nxt
        # the fit creates its data loader's iterator after this hook, and that draws a seed from the global random
        # generator unless the loader has a generator of its own: the restored generators are put back once more
        # when training starts, so the first batch sees the state the uninterrupted run saw
        self._rng = rng_states() if nxt else None

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._rng is not None:
            set_rng_states(self._rng)
            self._rng = None

    # ---- a step ------------------------------------------------------------------------------------
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self.guard is None or self._step is not None:  # a later micro-batch of an accumulated step
            return
        if self._tokens is None:
            tokens = float(_batch_elements(batch) * trainer.world_size)
        elif callable(self._tokens):
            tokens = float(self._tokens(batch)) * trainer.world_size
        else:
            tokens = float(self._tokens)
        self._step = self.guard.begin(trainer.global_step, tokens=tokens)
        self._stepped = False

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule, loss: torch.Tensor) -> None:
        self._loss = loss.detach()
        if self._step is not None:  # the step's local work ends here, if its forward did not say so (a module
            # whose training_step calls an inner module, never its own forward)
            self._step.mark_local()

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        s = self._step
        if s is None:
            return
        self._stepped = True
        if not s.ok(self._loss):
            optimizer.zero_grad(set_to_none=True)  # the optimizer then leaves every parameter as it is

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        s = self._step
        if s is None or not self._stepped:
            return
        self._step = None
        self._loss = None
        if trainer.fit_loop.epoch_loop.batch_progress.is_last_batch:
            # Lightning resumes a fit saved at an epoch's last batch in the epoch after next (its loop counts
            # the finished epoch and then meets the finished iterator): this step runs again after a restore
            s.skip_snapshot("the last step of an epoch")
        assert self.guard is not None
        self.guard.end_step(s)

    # ---- the end -----------------------------------------------------------------------------------
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.guard is not None:
            self.guard.close("finished")

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        if self.guard is not None:
            self.guard.close("failed")

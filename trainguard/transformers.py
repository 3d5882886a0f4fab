"""Hugging Face ``transformers.Trainer`` under trainguard: one callback, and one argument to ``train``.

::

    from transformers import Trainer
    from trainguard.transformers import TrainguardCallback

    guard = TrainguardCallback()
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[guard])
    trainer.train(resume_from_checkpoint=guard.restore(trainer))

:meth:`TrainguardCallback.restore` creates the trainer's optimizer (as ``train`` would), builds a
:class:`trainguard.torch.Guard` on the model and the optimizer, and restores the newest step every rank holds:
the weights and the optimizer's state go straight back into the live objects. What only the Trainer knows how to
resume (its state: the step counter, the epoch, the data it has already seen; the random number generators at
that point) is handed to it the way it resumes itself: a checkpoint folder on this machine, written from the
restored step (the weights, ``trainer_state.json`` and each rank's ``rng_state_<rank>.pth``; no optimizer file,
so the restored optimizer stays as it is), whose path goes to ``train(resume_from_checkpoint=...)``. The Trainer
then skips the batches the restored steps consumed, exactly as a resume from its own checkpoint does.

Every optimizer step is one guarded step: the heartbeat and the step record for the machine's agent, the finite
check of the loss (read from the model's output, ``output.loss``) and of the gradients on every rank before the
optimizer applies them (a non-finite step is skipped, its gradients dropped, and the rank holds still for the
control plane), and the per-step asynchronous snapshot. The Trainer's own ``save_strategy`` may stay on for the
team's exports; the guard does not need it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_model
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from trainguard.torch import CheckpointConfig, Guard, GuardedStep, GuardError, Stateful, Topology, rng_states

__all__ = ["TrainguardCallback"]

LOG_KEPT = 16  # log entries of the Trainer's state kept in each step's snapshot
RESUME_DIR = "hf-resume"  # under the job's run directory: the folder handed to train(resume_from_checkpoint=...)


class _TrainerSide:
    """What the Trainer keeps besides the model and the optimizer, as :class:`Guard` keeps any ``state`` object:
    its state (``trainer_state.json``'s content) and its learning-rate scheduler."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.restored: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        t = self.trainer
        scheduler = t.lr_scheduler.state_dict() if t.lr_scheduler is not None else None
        # the log grows by an entry a logging step: a snapshot every step keeps its end only, so its cost stays
        # the same over a long run (the Trainer reads the log back for its reports, not to train); the whole log
        # is not even copied (asdict copies deeply), it is set aside while the rest is
        log = t.state.log_history
        t.state.log_history = log[-LOG_KEPT:]
        try:
            state = dataclasses.asdict(t.state)
        finally:
            t.state.log_history = log
        return {"trainer_state": state, "scheduler": scheduler}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.restored = dict(state)  # the scheduler does not exist yet: it comes back when training begins


def _batch_tokens(batch: Any) -> int:
    if isinstance(batch, Mapping):
        ids = batch.get("input_ids")
        if isinstance(ids, torch.Tensor):
            return ids.numel()
    return 0


class TrainguardCallback(TrainerCallback):
    """The guard as a ``transformers.TrainerCallback`` (see the module's documentation).

    Args:
        state: more objects to restore with each step (``state_dict``/``load_state_dict`` with JSON states).
        checkpoint, topology, nonfinite_hold_s, sync, collective_timeout_s: as :class:`trainguard.torch.Guard`.
        resume_dir: where :meth:`restore` writes the folder for the Trainer (default: ``<TG_RUN_DIR>/hf-resume``,
            else ``<output_dir>/hf-resume``); replaced at each restore.
        tokens: a function of the step's number returning the tokens it trains on job-wide, for the throughput
            the agent watches (default: the ``input_ids`` the model saw in the step, times the ranks).
    """

    def __init__(self, *, state: Mapping[str, Stateful] | None = None,
                 checkpoint: CheckpointConfig | bool | None = None, topology: Topology | None = None,
                 nonfinite_hold_s: float | None = None, sync: bool = True, collective_timeout_s: float = 1800.0,
                 resume_dir: str | os.PathLike[str] | None = None,
                 tokens: Callable[[int], float] | None = None) -> None:
        if state and "transformers" in state:
            raise GuardError("state name 'transformers' is the callback's own (the Trainer's state); name yours "
                             "otherwise")
        self._state = dict(state or {})
        self._options: dict[str, Any] = {"checkpoint": checkpoint, "topology": topology,
                                         "nonfinite_hold_s": nonfinite_hold_s, "sync": sync,
                                         "collective_timeout_s": collective_timeout_s}
        self._resume_dir = resume_dir
        self._tokens = tokens
        self.guard: Guard | None = None
        self.resumed_at = 0  # the step training went on from (0 when nothing was restored)
        self._side: _TrainerSide | None = None
        self._step: GuardedStep | None = None
        self._losses: list[torch.Tensor] = []
        self._seen_tokens = 0
        self._hook: Any = None
        self._norm: Any = None  # the gradient norm the Trainer measured in this step (its clipping's)

    # ---- before train(): the guard, and the restore ---------------------------------------------------
    def restore(self, trainer: Trainer) -> str | None:
        """Build the guard and restore the newest step every rank holds (every rank together). Returns the
        folder to pass to ``trainer.train(resume_from_checkpoint=...)``, or None when there is nothing to
        restore. Raises :class:`trainguard.torch.RestoreError` when checkpoints exist but none can be restored."""
        if self.guard is not None:
            raise GuardError("restore() was called already; call it once, before trainer.train()")
        if trainer.optimizer is None:
            trainer.create_optimizer()  # what train() would do; it keeps an optimizer that exists
        self._side = _TrainerSide(trainer)
        self.guard = Guard(trainer.model, trainer.optimizer, state={"transformers": self._side, **self._state},
                           **self._options)
        self._hook = trainer.model.register_forward_hook(self._record, with_kwargs=True)
        self._keep_norm(trainer)
        nxt = self.guard.restore()
        self.resumed_at = nxt
        if not nxt:
            return None
        saved = (self._side.restored or {}).get("trainer_state")
        if not saved or int(saved.get("global_step", -1)) != nxt:
            raise GuardError(f"restored step {nxt - 1} holds no Trainer state for step {nxt}; restore with the "
                             f"code it was saved with")
        return str(self._write_resume_folder(trainer, saved))

    def _write_resume_folder(self, trainer: Trainer, saved: dict[str, Any]) -> Path:
        """The Trainer's checkpoint folder for the restored step, on every machine: written by the machine's first
        rank (the weights, the state), each rank its random generators; every rank waits until the folders are
        complete."""
        base = Path(self._resume_dir or os.path.join(os.environ.get("TG_RUN_DIR") or trainer.args.output_dir,
                                                         RESUME_DIR))
        folder = base / f"checkpoint-{saved['global_step']}"
        args = trainer.args
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            shutil.rmtree(base, ignore_errors=True)
            folder.mkdir(parents=True)
            # not save_pretrained: it writes on the job's rank 0 only, and every machine needs its own folder
            save_model(trainer.model, str(folder / "model.safetensors"), metadata={"format": "pt"})
            (folder / "trainer_state.json").write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")
        if dist.is_available() and dist.is_initialized():
            dist.barrier()
        name = f"rng_state_{args.process_index}.pth" if args.world_size > 1 else "rng_state.pth"
        torch.save(rng_states(), folder / name)  # the Trainer's own format; it never leaves this machine
        if dist.is_available() and dist.is_initialized():
            dist.barrier()
        return folder

    def _record(self, module: torch.nn.Module, args: Any, kwargs: dict[str, Any], output: Any) -> None:
        """The model's forward inside a guarded step: its loss (for the finite check) and its tokens."""
        if self._step is None:
            return
        loss = getattr(output, "loss", None)
        if loss is None and isinstance(output, Mapping):
            loss = output.get("loss")
        if isinstance(loss, torch.Tensor):
            self._losses.append(loss.detach())
        self._seen_tokens += _batch_tokens(kwargs) or _batch_tokens(args[0] if args else None)

    def _keep_norm(self, trainer: Trainer) -> None:
        """The Trainer measures the gradients' norm every step (to clip them, or with an infinite bound only to
        report it) through its accelerator's ``clip_grad_norm_``: the guard's finite check takes that figure
        instead of measuring the gradients a second time. Not under DeepSpeed, whose engine reports a norm of its
        own (the last one it took, after an overflow) and updates in its backward; a step with no figure of the
        Trainer's (a second guard's wrapper, another engine) measures the gradients itself."""
        accelerator = getattr(trainer, "accelerator", None)
        clip = getattr(accelerator, "clip_grad_norm_", None)
        if not callable(clip) or getattr(clip, "trainguard_keeps", False) \
                or str(getattr(accelerator, "distributed_type", "")).upper().endswith("DEEPSPEED"):
            return

        def clip_grad_norm_(*args: Any, **kwargs: Any) -> Any:
            norm = clip(*args, **kwargs)
            self._norm = norm
            return norm

        clip_grad_norm_.trainguard_keeps = True  # type: ignore[attr-defined]
        accelerator.clip_grad_norm_ = clip_grad_norm_  # type: ignore[union-attr]

    # ---- training ------------------------------------------------------------------------------------
    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        if self.guard is None:
            raise GuardError("the guard was not restored: call trainer.train(resume_from_checkpoint="
                             "guard.restore(trainer))")
        assert self._side is not None  # built with the guard
        restored = self._side.restored
        scheduler = kwargs.get("lr_scheduler")
        if restored and restored.get("scheduler") is not None and scheduler is not None:
            scheduler.load_state_dict(restored["scheduler"])
            # a new scheduler set the optimizer's rates to its first step's; the restored step's rates go back
            for group, lr in zip(scheduler.optimizer.param_groups, scheduler.get_last_lr(), strict=True):
                group["lr"] = lr
        self._side.restored = None

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                      **kwargs: Any) -> None:
        assert self.guard is not None
        self._losses = []
        self._seen_tokens = 0
        self._norm = None
        tokens = float(self._tokens(state.global_step)) if self._tokens is not None else 0.0
        self._step = self.guard.begin(state.global_step, tokens=tokens)

    def on_pre_optimizer_step(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                              **kwargs: Any) -> None:
        s = self._step
        if s is None:
            return
        loss = torch.stack([x.float().mean() for x in self._losses]).mean() if self._losses else None
        model = kwargs.get("model")
        norm, self._norm = self._norm, None
        if not s.ok(loss, grad_norm=None if norm is None else float(norm)):
            for p in (model or self.guard.model).parameters():  # the optimizer then leaves every parameter as is
                p.grad = None

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        s = self._step
        if s is None:
            return
        self._step = None
        if self._tokens is None:
            s.tokens = float(self._seen_tokens * args.world_size)
        assert self.guard is not None
        self.guard.end_step(s)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        self.close("finished")

    def close(self, status: str = "finished") -> None:
        """End the guard (the last snapshots written and committed when ``status`` is "finished"); call it with
        "failed" from the script's own error handling. Idempotent."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self.guard is not None:
            self.guard.close(status)

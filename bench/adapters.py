"""The trainers' adapters' cost: the same Lightning fit and the same HF Trainer run, with and without trainguard.

    python bench/adapters.py [--trials 9] [--steps 80] [--out bench/results/adapters.json]

Each trial runs the examples' programs (``examples/lightning``: Lightning's demo transformer; ``examples/hf``:
GPT-2 with 2 layers from a configuration) in this process, one rank, on synthetic data, four ways side by side
in alternating order: without the guard and with it (``TrainguardCallback``, a per-step snapshot persisted to a
local folder by the saver process, as in a launch), each in two settings:

* **host**: the step is all host compute (CPU training): the snapshot's copy and the background persist compete
  with the training for the same two cores;
* **device**: each step also waits ``--device-ms`` with the host idle after the update, as a GPU step's compute
  would keep it. The wait tells the guard that the host idles (``guard.host_idle()``) and the snapshot's copy is
  taken then (``CheckpointConfig(copy_at_idle=True)``): the CPU counterpart of the copy on a side CUDA stream that
  a GPU job gets without asking, so the guard's background work runs in that wait, as it does on a GPU machine.

A step's time is the time from one batch's start to the next's; a run's figure is the median over the steps after
``--warmup``; the overhead of a trial is guarded / plain - 1 of the same setting, and the result is its median over
the trials.

Where the guard's time goes: each trial also runs each trainer once more, guarded in the device setting, with the
guard's parts timed on the training thread (``guard_ms.<part>``: milliseconds a step, over the whole run):
``hooks`` (everything the adapter's callback does in a step; the HF adapter's forward hook, which keeps the loss,
aside), of which ``gradient_norm`` (the finite check's measurement of
the gradients, when the trainer gave none), ``state`` (the trainer's and loader's state as JSON), ``snapshot`` (the
checkpoint's part at the step's end) and ``record`` (the step's line for the agent). These runs are not among the
timed ones.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import summarize, write_result  # noqa: E402


def checkpoint(root: Path, device_s: float) -> Any:
    """The guard's checkpoint settings of a launch (every step, the saver process); in the device setting the
    snapshot's copy waits for the host's idle moment, as a GPU's side-stream copy runs beside the device's work."""
    import dataclasses

    from trainguard.torch import checkpoint_config_from_env

    cfg = checkpoint_config_from_env(root=str(root))
    return dataclasses.replace(cfg, copy_at_idle=True) if device_s > 0 else cfg


def device_wait(guard: Any, seconds: float) -> None:
    """The host waits ``seconds`` for the emulated device, and says so to the guard (when there is one)."""
    if guard is not None:
        guard.host_idle()
    time.sleep(seconds)
    if guard is not None:
        guard.host_busy()


PARTS = ("hooks", "gradient_norm", "state", "snapshot", "record")


@contextlib.contextmanager
def timed_parts(trainer: str) -> Iterator[dict[str, float]]:
    """Seconds the training thread spends in each of ``PARTS`` while the block runs (the functions wrapped for
    it, and put back after)."""
    import trainguard.lightning
    import trainguard.torch
    import trainguard.transformers
    from trainguard.checkpoint.snapshots import Snapshotting
    from trainguard.node_tools.monitor import JobMonitor

    spent = dict.fromkeys(PARTS, 0.0)
    callback = (trainguard.lightning if trainer == "lightning" else trainguard.transformers).TrainguardCallback
    hooks = ["on_train_batch_start", "on_before_backward", "on_before_optimizer_step", "on_train_batch_end"] \
        if trainer == "lightning" else ["on_step_begin", "on_pre_optimizer_step", "on_step_end"]  # each step's
    targets = [(callback, n, "hooks") for n in hooks] + [
        (trainguard.torch, "gradient_norm", "gradient_norm"), (trainguard.torch, "_json_state", "state"),
        (Snapshotting, "after_step", "snapshot"), (JobMonitor, "step_end", "record")]
    saved = [(owner, name, getattr(owner, name) if owner is not callback else vars(owner)[name])
             for owner, name, _part in targets]
    main = threading.main_thread()

    def timed(fn: Callable[..., Any], part: str) -> Callable[..., Any]:
        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> Any:
            if threading.current_thread() is not main:
                return fn(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[part] += time.perf_counter() - t0
        return inner

    for (owner, name, part), (_o, _n, fn) in zip(targets, saved, strict=True):
        setattr(owner, name, timed(fn, part))
    try:
        yield spent
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


def _lightning(steps: int, device_s: float, guarded: bool, root: Path) -> list[float]:
    import lightning as L
    import torch
    from torchdata.stateful_dataloader import StatefulDataLoader

    from examples.lightning.train import BigramTokens, Demo
    from trainguard.lightning import TrainguardCallback

    starts: list[float] = []

    class Clock(L.Callback):
        def on_train_batch_start(self, *_args: Any) -> None:
            starts.append(time.perf_counter())

    class Device(L.Callback):
        """The device's part of the step: the host idles ``device_s`` after the update."""

        def on_train_batch_end(self, *_args: Any) -> None:
            device_wait(guard.guard if guard else None, device_s)

    L.seed_everything(0, verbose=False)
    model = Demo(vocab_size=128)
    data = BigramTokens(4096, 32, 128, 0)
    loader = StatefulDataLoader(data, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(0))
    guard = TrainguardCallback(checkpoint=checkpoint(root, device_s)) if guarded else None
    callbacks: list[L.Callback] = [Clock(), *([guard] if guard else [])]
    if device_s > 0:
        callbacks.append(Device())
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, callbacks=callbacks, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, loader)
    return [b - a for a, b in itertools.pairwise(starts)]


def _hf(steps: int, device_s: float, guarded: bool, root: Path) -> list[float]:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    from examples.hf.train import BigramTokens
    from trainguard.transformers import TrainguardCallback

    starts: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, *_args: Any, **_kwargs: Any) -> None:
            starts.append(time.perf_counter())

    class Device(TrainerCallback):
        """The device's part of the step: the host idles ``device_s`` after the update."""

        def on_step_end(self, *_args: Any, **_kwargs: Any) -> None:
            device_wait(guard.guard if guard else None, device_s)

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=32, n_embd=64, n_layer=2, n_head=4))
    args = TrainingArguments(output_dir=str(root / "out"), max_steps=steps, per_device_train_batch_size=8,
                             learning_rate=1e-3, logging_steps=10**6, save_strategy="no", report_to=[], seed=0,
                             use_cpu=True, dataloader_num_workers=0, disable_tqdm=True)
    guard = TrainguardCallback(checkpoint=checkpoint(root, device_s)) if guarded else None
    callbacks: list[TrainerCallback] = [Clock(), *([guard] if guard else []), *([Device()] if device_s > 0 else [])]
    trainer = Trainer(model=model, args=args, train_dataset=BigramTokens(4096, 32, 256, 0), callbacks=callbacks)
    trainer.train(resume_from_checkpoint=guard.restore(trainer) if guard else None)
    return [b - a for a, b in itertools.pairwise(starts)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=9)
    ap.add_argument("--steps", type=int, default=80, help="optimizer steps per run")
    ap.add_argument("--warmup", type=int, default=10, help="steps not counted at the start of a run")
    ap.add_argument("--device-ms", type=float, default=50.0, help="the device setting's idle wait per step")
    ap.add_argument("--quick", action="store_true", help="one trial of 25 steps")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    trials, steps = (1, 25) if args.quick else (args.trials, args.steps)
    warmup = min(args.warmup, steps // 3)
    os.environ.pop("TG_CHECKPOINT", None)
    import torch

    torch.set_num_threads(1)
    runners = {"lightning": _lightning, "hf": _hf}
    settings = {"host": 0.0, "device": args.device_ms / 1000}
    step_s: dict[str, list[float]] = {}
    overhead: dict[str, list[float]] = {}
    parts: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="tg-bench-adapters-") as tmp:
        os.environ["TG_RUN_DIR"] = str(Path(tmp) / "run")  # the guard's records: not ./tg-run of the checkout
        for trial in range(trials):
            for trainer, run in runners.items():
                for setting, device_s in settings.items():
                    figures = {}
                    order = (False, True) if trial % 2 == 0 else (True, False)  # neither always goes first
                    for guarded in order:
                        root = Path(tmp) / f"{trainer}-{setting}-{trial}-{int(guarded)}"
                        times = run(steps, device_s, guarded, root)[warmup:]
                        figures[guarded] = statistics.median(times)
                        key = f"{trainer}.{setting}.{'guarded' if guarded else 'plain'}_step_s"
                        step_s.setdefault(key, []).append(figures[guarded])
                    ratio = figures[True] / figures[False] - 1
                    overhead.setdefault(f"{trainer}.{setting}.overhead_pct", []).append(100 * ratio)
                    print(f"trial {trial} {trainer} {setting}: plain {figures[False] * 1e3:.1f} ms, guarded "
                          f"{figures[True] * 1e3:.1f} ms, overhead {100 * ratio:+.2f}%", flush=True)
                with timed_parts(trainer) as spent:  # where the guard's time goes (a run not timed above)
                    run(steps, settings["device"], True, Path(tmp) / f"{trainer}-parts-{trial}")
                for part, seconds in spent.items():
                    parts.setdefault(f"{trainer}.device.guard_ms.{part}", []).append(1000 * seconds / steps)
    metrics: dict[str, Any] = {}
    for key, values in overhead.items():
        metrics[key] = summarize(values, "%", 1.0 if ".device." in key else None)
    for key, values in step_s.items():
        metrics[key] = summarize(values, "s")
    for key, values in parts.items():
        metrics[key] = summarize(values, "ms")
    import lightning
    import transformers

    text = write_result("adapters", quick=bool(args.quick), out=args.out, metrics=metrics, setup={
        "trials": trials, "steps": steps, "warmup_steps": warmup, "device_wait_s": args.device_ms / 1000,
        "ranks": 1, "checkpoint": "every step, saver process, local folder (tmp), no replica (one rank), no S3; "
                                 "device setting: copy_at_idle, the device wait says host_idle",
        "lightning": lightning.__version__, "transformers": transformers.__version__,
        "torch": torch.__version__, "models": {"lightning": "lightning.pytorch.demos LightningTransformer, "
                                               "vocab 128, batch 8 x 32 tokens",
                                               "hf": "GPT-2, 2 layers, 64 wide, vocab 256, batch 8 x 32 tokens"}})
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

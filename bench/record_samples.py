"""Runs one of the programs in ``examples/`` unchanged, writing down the samples each step trains (what
``bench/day.py`` checks, by index, for a sample trained twice or skipped across restores).

Copied beside the example's ``train.py`` in the job's working directory and given as the job's command::

    record.py --program plain --record DIR -- --steps 0 --step-time-s 0.1

Each rank writes ``DIR/samples-<rank>-<incarnation>-<pid>-<ns>.jsonl``, one file per process, a line per step:
``{"step", "epoch", "idx", "ts"}``. The example's own code is not edited; the recorder wraps what the example
already names at its module level, and writes a step's line before the step's snapshot is taken (a process killed
between the two trains that step again, never one it did not write down):

* ``plain``: its batches are drawn from (seed, step, rank), so a step's samples are known from the step itself; the
  recorder wraps ``batch``;
* ``lightning`` and ``hf``: samples come from ``BigramTokens`` through a sampler. The recorder notes each index the
  loader fetches (a loader fetches ahead, so a queue) and, when the model's training forward runs, takes the
  batch's indexes off the queue and checks them against the tokens the model was given: a mismatch stops the
  program (the record would be wrong, not the training).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import train  # the example's own train.py, beside this file


class Recorder:
    def __init__(self, folder: Path, steps_per_epoch: int) -> None:
        rank, inc = os.environ.get("RANK", "0"), os.environ.get("TG_INCARNATION", "0")
        folder.mkdir(parents=True, exist_ok=True)
        name = f"samples-{rank}-{inc}-{os.getpid()}-{time.time_ns()}.jsonl"  # one file per process, never reused
        self.out = open(folder / name, "x", buffering=1)  # noqa: SIM115 - open for the process's life
        self.steps_per_epoch = steps_per_epoch
        self.fetched: collections.deque[int] = collections.deque()

    def write(self, step: int, idx: list[int]) -> None:
        self.out.write(json.dumps({"step": step, "epoch": step // self.steps_per_epoch, "idx": idx,
                                   "ts": time.time()}) + "\n")

    def take(self, tokens: torch.Tensor, data: Any, key: Any) -> list[int]:
        """The indexes of the batch the model was given (``tokens``: a row per sample), checked by value."""
        if len(self.fetched) < len(tokens):
            raise SystemExit(f"record_samples: the model got {len(tokens)} samples, the loader fetched "
                             f"{len(self.fetched)}")
        idx = [self.fetched.popleft() for _ in range(len(tokens))]
        for i, row in zip(idx, tokens, strict=True):
            if not torch.equal(original_item(data, i)[key].to(row.device), row):
                raise SystemExit(f"record_samples: sample {i} is not the one the model was given")
        return idx


ORIGINAL_GETITEM = None


def original_item(data: Any, i: int) -> Any:
    return ORIGINAL_GETITEM(data, i)  # type: ignore[misc]


def note_fetches(recorder: Recorder) -> None:
    """Every index the example's loader fetches from ``BigramTokens``, in order."""
    global ORIGINAL_GETITEM
    ORIGINAL_GETITEM = train.BigramTokens.__getitem__

    def getitem(self: Any, i: int) -> Any:
        recorder.fetched.append(int(i))
        return ORIGINAL_GETITEM(self, i)  # type: ignore[misc]

    train.BigramTokens.__getitem__ = getitem


def main() -> int:
    p = argparse.ArgumentParser(prog="record_samples", description=__doc__.split("\n\n")[0])
    p.add_argument("--program", choices=("plain", "lightning", "hf"), required=True)
    p.add_argument("--record", type=Path, required=True, help="the folder for the records")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="-- then the example's own arguments")
    args = p.parse_args()
    rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
    own = train.parse_args(rest)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.program != "plain" and own.samples % (own.batch * world):  # a sampler pads: epochs would drift
        raise SystemExit(f"record_samples: --samples {own.samples} is not a multiple of --batch x ranks "
                         f"({own.batch} x {world}); the records need whole epochs")
    if args.program == "plain":
        recorder = Recorder(args.record, steps_per_epoch=64)
        drawn = train.batch

        def batch(a: argparse.Namespace, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
            first = ((step % 64) * world + rank) * a.batch  # sample j of (step, rank): its place in the epoch
            recorder.write(step, list(range(first, first + a.batch)))
            return drawn(a, step, rank)

        train.batch = batch
        return train.main(rest)
    recorder = Recorder(args.record, steps_per_epoch=own.samples // (own.batch * world))
    note_fetches(recorder)
    data = train.BigramTokens(own.samples, own.seq, own.vocab, own.seed)  # to check each batch against
    if args.program == "lightning":
        step_of = train.Demo.training_step

        def training_step(self: Any, batch: Any, batch_idx: int) -> Any:
            recorder.write(self.trainer.global_step, recorder.take(batch[0], data, 0))
            return step_of(self, batch, batch_idx)

        train.Demo.training_step = training_step
        return train.main(rest)
    trainers: list[Any] = []  # hf: the Trainer (its step) and the model's training forward

    class Trainer(train.Trainer):
        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, **kw)
            trainers.append(self)

    def before_forward(model: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if model.training and ids is not None:
            recorder.write(trainers[0].state.global_step, recorder.take(ids, data, "input_ids"))

    model_of = train.GPT2LMHeadModel

    def hooked_model(config: Any) -> Any:  # stands where the example names the class
        model = model_of(config)
        model.register_forward_pre_hook(before_forward, with_kwargs=True)
        return model

    train.Trainer, train.GPT2LMHeadModel = Trainer, hooked_model
    return train.main(rest)


if __name__ == "__main__":
    sys.exit(main())

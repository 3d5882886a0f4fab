"""bench/day.py's check that a job trained every sample once, on records written as its program writes them."""

from __future__ import annotations

import json
from pathlib import Path

from bench.day import exact_once

SAMPLES = 16  # 2 ranks x 2 micro-batches x 2 samples: 2 steps an epoch


def _process(folder: Path, rank: int, ts: float, steps: range, *, twice: bool = False) -> None:
    """A process of ``rank`` that trained ``steps`` (each 2 micro-batches of 2 samples: rank r takes the samples
    of its half of each epoch in order); ``twice``: its last micro-batch repeats the one before."""
    lines = []
    for s in steps:
        epoch, within = divmod(s, 2)
        for mb in range(2):
            first = rank * 8 + within * 4 + mb * 2
            idx = [first, first + 1]
            if twice and s == steps[-1] and mb == 1:
                idx = [first - 2, first - 1]
            lines.append(json.dumps({"step": s, "epoch": epoch, "idx": idx, "ts": ts + s}))
    (folder / f"samples-{rank}-0-{int(ts)}-{int(ts * 1e9)}.jsonl").write_text("\n".join(lines) + "\n")


def test_restores_that_train_steps_again_from_the_restored_one_keep_every_sample_once(tmp_path):
    for rank in (0, 1):
        _process(tmp_path, rank, 100.0, range(0, 7))  # trained steps 0-6, then crashed
        _process(tmp_path, rank, 200.0, range(5, 9))  # restored step 4: steps 5 and 6 trained again
    out = exact_once(tmp_path, SAMPLES)
    assert out["problems"] == [] and out["steps"] == 9 and out["restores"] == 1 and out["epochs_finished"] == 4
    assert out["most_steps_redone"] == 2


def test_a_sample_trained_twice_or_a_step_skipped_is_reported(tmp_path):
    for rank in (0, 1):
        _process(tmp_path, rank, 100.0, range(0, 4), twice=rank == 1)
        _process(tmp_path, rank, 200.0, range(5, 8))  # step 4 never trained
    problems = exact_once(tmp_path, SAMPLES)["problems"]
    assert any("steps missing [4]" in p for p in problems), problems
    assert any(p.startswith("epoch 1:") and "trained twice" in p for p in problems), problems

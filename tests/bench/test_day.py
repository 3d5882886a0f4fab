"""bench/day.py's check that a job trained every sample once, on records written as its program writes them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench.day import REPO, Day, Plane, exact_once

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


def test_a_step_recorded_twice_by_one_process_is_reported_when_a_step_is_one_micro_batch(tmp_path):
    lines = [json.dumps({"step": s, "epoch": 0, "idx": [s], "ts": 1.0 + s}) for s in (0, 1, 1, 2, 3)]
    (tmp_path / "samples-0-0-1-1.jsonl").write_text("\n".join(lines) + "\n")
    out = exact_once(tmp_path, 4, world=1, micro=1)
    assert "rank 0: steps without exactly 1 micro-batch(es): [1]" in out["problems"], out


@pytest.mark.parametrize("program", ["lightning", "hf"])
def test_the_examples_recorder_names_the_samples_the_model_trained_across_a_restore(tmp_path, program):
    """``bench/record_samples.py`` around an example, stopped after 5 steps and restored from its checkpoint for 7
    more: every sample of the finished epoch once (checked by value against what the model was given), and the
    resumed process's indexes are the uninterrupted run's."""
    work = tmp_path / "job"
    work.mkdir()
    shutil.copy(REPO / "examples" / program / "train.py", work / "train.py")
    shutil.copy(REPO / "bench" / "record_samples.py", work / "record_samples.py")
    small = ["--samples", "32", "--batch", "4", "--checkpoint-dir", str(tmp_path / "ckpt")]  # 8 steps an epoch

    def run(steps: int, folder: Path) -> None:
        proc = subprocess.run([sys.executable, "record_samples.py", "--program", program, "--record", str(folder),
                               "--", "--steps", str(steps), *small], cwd=work, capture_output=True, text=True,
                              timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
        assert proc.returncode == 0, proc.stderr[-3000:]

    run(5, tmp_path / "rec")
    run(12, tmp_path / "rec")
    out = exact_once(tmp_path / "rec", 32, world=1, micro=1)
    assert out["problems"] == [] and out["steps"] == 12 and out["restores"] == 1 and out["epochs_finished"] == 1, out
    small[-1] = str(tmp_path / "ckpt-once")
    run(12, tmp_path / "once")
    resumed = sorted((tmp_path / "rec").glob("*.jsonl"), key=lambda f: f.stat().st_mtime)[-1]
    once = next((tmp_path / "once").glob("*.jsonl"))
    assert [json.loads(x)["idx"] for x in resumed.read_text().splitlines()] == \
        [json.loads(x)["idx"] for x in once.read_text().splitlines()][5:]


def test_the_job_is_back_with_the_first_process_that_trains_not_one_begun_before_the_stop_ended(tmp_path):
    day = Day(Plane(tmp_path))
    day.samples.mkdir(parents=True)
    _process(day.samples, 0, 1000.0, range(0, 50))  # the job before the fault
    _process(day.samples, 0, 1100.0, range(0, 1))  # a restart in place, blocked on a hung rank after one record
    _process(day.samples, 0, 1150.0, range(0, 5))  # the resubmit's process, training
    assert day.back(1099.0, timeout=1) == pytest.approx(1150.0 - 1099.0)  # a process that trained 3 steps
    assert day.back(1099.0, timeout=1, begun_after=1120.0) == pytest.approx(1150.0 - 1099.0)
    _process(day.samples, 0, 1101.0, range(0, 4))  # this one trained, and began before the stop ended
    assert day.back(1099.0, timeout=1) == pytest.approx(1101.0 - 1099.0)
    assert day.back(1099.0, timeout=1, begun_after=1120.0) == pytest.approx(1150.0 - 1099.0)

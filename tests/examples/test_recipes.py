"""The guide's recipes for a real loop (examples/recipes/train.py) run for real: epochs over a DataLoader with a
DistributedSampler, gradient accumulation, a GradScaler, evaluation on rank 0, the program's own snapshot and
resume, begin/end_step. Stopped mid-epoch and started again (the program's own resume first, then the guard's
newer one), two ranks under torchrun train every sample exactly once an epoch."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from tests import REPO
from tests.conftest import free_port
from trainguard.node_tools.monitor import read_steps

pytestmark = pytest.mark.slow

RECIPES = REPO / "examples" / "recipes" / "train.py"
SAMPLES, EPOCHS, STEPS_PER_EPOCH = 512, 2, 16  # 2 ranks x 4 samples x 4 micro-batches a step


def _run(tmp: Path, incarnation: int, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TG_")}
    env |= {"TG_RUN_DIR": str(tmp / "run"), "TG_CHECKPOINT": str(tmp / "ckpt"), "TG_INCARNATION": str(incarnation),
            "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
                          "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(RECIPES),
                          "--epochs", str(EPOCHS), "--samples", str(SAMPLES), "--snapshot", str(tmp / "own.pt"),
                          *args], cwd=tmp, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    return out


@pytest.mark.parametrize("amp", [False, True])
def test_a_loop_stopped_mid_epoch_resumes_at_the_next_batch_and_trains_every_sample_once_an_epoch(tmp_path, amp):
    flags = ["--amp"] if amp else []
    first = _run(tmp_path, 0, "--stop-after", "20", *flags)  # an epoch and four steps; its own snapshot at step 16
    assert "step 10 eval loss" in first.stdout and (tmp_path / "own.pt").is_file()
    _run(tmp_path, 1, "--init-from", "resume", *flags)  # its own (older) snapshot first, then the guard's
    timeline: dict[int, dict] = {}
    for rank in (0, 1):
        records = read_steps(tmp_path / "run", rank)
        again = [r for r in records if r["incarnation"] == 1]
        assert again[0]["step"] == 20 and again[0]["ckpt_restored_step"] == 19  # nothing lost, nothing again
        for r in records:  # each step as the newest incarnation ran it
            timeline.setdefault(rank, {})[r["step"]] = r
    assert all(sorted(t) == list(range(EPOCHS * STEPS_PER_EPOCH)) for t in timeline.values())
    for epoch in range(EPOCHS):
        seen = Counter(i for t in timeline.values() for r in t.values() if r["epoch"] == epoch for i in r["samples"])
        assert sorted(seen) == list(range(SAMPLES)) and set(seen.values()) == {1}, epoch

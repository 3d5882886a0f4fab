"""bench/gpu.py, the prepared run for a machine with a GPU, on the CPU (``--dry-run``): every part runs and says
what the GPU run will, so the one call a GPU allows is known to work before it comes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests import REPO


@pytest.mark.slow
def test_the_dry_run_measures_every_part_and_restores_bit_for_bit(tmp_path):
    out = tmp_path / "gpu.json"
    done = subprocess.run([sys.executable, "bench/gpu.py", "--dry-run", "--out", str(out), "--budget-s", "240"],
                          cwd=REPO, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["name"] == "gpu" and doc["quick"] is True and doc["setup"]["errors"] == {}
    m = doc["metrics"]
    for key in ("nvml.snapshot_ms", "trainguard.step_overhead_ratio", "trainguard.blocking_s",
                "trainguard.blocking_vs_memcpy", "dcp.step_overhead_ratio", "dcp.blocking_s", "memcpy_s",
                "recovery.kill_to_step_s"):
        assert key in m, key
    assert m["trainguard.restore_exact"]["value"] == 1  # a fresh model restored from the copies, every tensor equal
    rec = doc["setup"]["parts"]["recovery"]
    assert rec["exact"] and rec["finished"] and rec["lost_steps"] <= 1, rec  # the killed rank came back, bit for bit


def test_without_a_gpu_it_says_to_dry_run():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the script would run")
    done = subprocess.run([sys.executable, "bench/gpu.py"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--dry-run" in done.stderr and len(done.stderr.strip().splitlines()) == 1

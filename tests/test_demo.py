"""The README's run command (``trainguard demo``) end to end, on a cluster of its own."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import can_namespace

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


@pytest.mark.skipif(bool(can_namespace()), reason=can_namespace() or "ok")
def test_demo_trains_reports_and_leaves_nothing_behind(cluster_dir: Path):
    state = cluster_dir
    proc = subprocess.run(
        [sys.executable, "-m", "operators.cli", "--state-dir", str(state), "demo", "--steps", "6",
         "--name", "tgd", "--subnet", "10.213.12.0/24"],
        capture_output=True, text=True, timeout=600, check=False,
    )
    out = proc.stdout
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "launched job demo (tp=2,pp=2,dp=2) on m0, m1, m2, m3" in out
    assert "exit codes    {'m0': 0, 'm1': 0, 'm2': 0, 'm3': 0}" in out
    assert "final step    5" in out
    first, last = (float(x) for x in out.split("\nloss", 1)[1].split("\n", 1)[0].split("->"))
    assert last < first
    assert "result        OK" in out
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    assert "tgd-m" not in ns
    assert not state.exists()

"""The README's run command (``trainguard demo``) end to end: a fault schedule under the real control plane
on a cluster of its own, its live timeline, report and chart, and nothing left behind. The rungs are proven
one by one in test_control_plane.py, so this runs two faults of the default schedule (one that evicts, one
that restarts in place), 45 s apart instead of 90 (the second still waits until the first was handled):
this is the demo's own machinery, not the ladder again."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import can_namespace
from trainguard.core import procs

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.airflow, pytest.mark.full]


@pytest.mark.skipif(bool(can_namespace()), reason=can_namespace() or "ok")
@pytest.mark.timeout(1500)
def test_the_demo_recovers_its_scripted_faults_reports_and_leaves_nothing_behind(cluster_dir: Path):
    state, report = cluster_dir, cluster_dir.parent / "demo-report"
    proc = subprocess.run(
        [sys.executable, "-m", "trainguard.operators.cli", "--state-dir", str(state), "demo", "--port", "0",
         "--name", "tgd", "--subnet", "10.213.12.0/24", "--report-dir", str(report), "--every", "45",
         "--first", "15", "--faults", "gpu_lost,nan"],
        capture_output=True, text=True, timeout=1400, check=False,
    )
    out = proc.stdout
    assert proc.returncode == 0, out[-6000:] + proc.stderr[-3000:]
    doc = json.loads((report / "report.json").read_text())
    faults = {f["fault"]: f for f in doc["faults"]}
    assert list(faults) == ["gpu_lost", "nan"]
    assert doc["recovered"] == doc["injected"] == 2
    for f in faults.values():
        assert f["state"] == "resolved" and f["resumed_ts"] > f["t_fault"], f
    # the report names what each recovery did: the lost GPU's machine replaced by a standby, the NaN
    # restarted in place
    assert list(faults["gpu_lost"]["evicted"]) == [faults["gpu_lost"]["machine"]]
    assert faults["nan"]["category"] == "nan" and not faults["nan"]["evicted"]
    # the live timeline told the story as it happened, and the report's ETTR is the ledger's
    for i in range(1, 3):
        assert f"FAULT {i}/2" in out
    assert out.count("training resumed") >= 2 and "decision: machine_fault" in out
    assert re.search(r"evicted m\d -> standby m\d", out)
    ettr = doc["ettr"]["cumulative"]["ettr"]
    assert 0 < ettr <= 1 and f"ETTR {ettr * 100:.1f}%" in out
    html = (report / "timeline.html").read_text()
    assert html.count("<circle") >= doc["ettr"]["cumulative"]["kept_steps"] and "ETTR" in html
    assert html.count("stroke-dasharray") == 2  # one marked line per fault
    assert "demo OK: every fault was recovered automatically" in out
    # nothing left running: namespaces, the cluster's processes, Airflow
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    assert "tgd-m" not in ns
    assert not procs.pids_with_env("TG_NODE_CONFIG", str(state), prefix=True)
    assert not (state.parent / "control" / "airflow" / "standalone.pid").exists()
    assert not [p for p in procs.all_pids() if str(state.parent) in " ".join(procs.cmdline(p))]

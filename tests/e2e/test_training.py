"""The reference job on the emulated cluster: TP=2 PP=2 DP=2 over 4 machines, loss falls."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests import jobs
from tests.conftest import wait_until
from trainguard.core.topology import Topology
from trainguard.node_tools import launcher
from trainguard.node_tools.inventory import Inventory

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.full]

STEPS = 12


def test_3d_parallel_job_trains_across_machines(ns_cluster: Inventory):
    active = ns_cluster.by_role("active")
    topo = Topology(tp=2, pp=2, dp=2)
    alerts = jobs.AlertWatch(ns_cluster)
    plan = jobs.start(ns_cluster, "train3d", topo, active, "--steps", str(STEPS))
    # starting again while it runs is a no-op, not a second job
    again = launcher.launch(ns_cluster, plan)
    assert all(doc.get("already_running") for doc in again.values())

    wait_until(lambda: all(jobs.exit_code(plan, m) is not None for m in active), timeout=300,
               what="the job to end on every machine")
    assert [jobs.exit_code(plan, m) for m in active] == [0, 0, 0, 0]

    # over ssh, every machine reports its two ranks finished at the last step
    status = launcher.status(ns_cluster, "train3d", active)
    for i, m in enumerate(active):
        doc = status[m.name]
        assert doc["state"] == "exited" and doc["returncode"] == 0
        assert [r["rank"] for r in doc["ranks"]] == list(topo.ranks_on(i))
        assert all(r["status"] == "finished" and r["step"] == STEPS - 1 for r in doc["ranks"])

    records = {r: jobs.steps(plan, r) for r in range(topo.world_size)}
    assert all([s["step"] for s in recs] == list(range(STEPS)) for recs in records.values())
    losses = [s["loss"] for s in records[0]]
    # every rank reports the same (pipeline-broadcast) loss at every step
    for r, recs in records.items():
        assert [s["loss"] for s in recs] == losses, r
    # the loss falls
    assert sum(losses[-3:]) / 3 < 0.8 * losses[0], losses
    # data-parallel peers hold identical parameters at every step; other ranks do not
    for r in range(topo.world_size):
        for peer in topo.group("dp", r):
            assert [s["param_digest"] for s in records[peer]] == [s["param_digest"] for s in records[r]]
    assert records[0][-1]["param_digest"] != records[2][-1]["param_digest"]
    # collectives of all three kinds ran on every rank, and DP all-reduces once per step at least
    for r, recs in records.items():
        counts = recs[-1]["collectives"]
        assert {"tp", "pp", "dp"} <= set(counts), (r, counts)
        assert counts["dp"] >= STEPS
    # the standbys ran nothing
    assert not (jobs.run_dir(ns_cluster.machine("m4"), "train3d")).exists()

    # a healthy run raises no alert: wait until every agent has run all its checks (the slowest,
    # the disk check, every 10 s) after the job ended, then look at the bus
    ended = time.time()

    def agent_ts(m):
        try:
            return json.loads((Path(m.extra["machine_dir"]) / "agent" / "status.json").read_text())["ts"]
        except (OSError, ValueError, KeyError):
            return 0.0

    wait_until(lambda: all(agent_ts(m) > ended + 10.5 for m in ns_cluster.machines), timeout=60,
               what="every agent to finish a full round of checks after the job")
    assert alerts.poll() == [], [(a.kind, a.machine, a.rank) for a in alerts.seen]

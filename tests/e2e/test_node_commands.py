"""The stop-time node commands over ssh on the emulated cluster: stacks, diag L1-L3, align, logs."""

from __future__ import annotations

import pytest

from tests import jobs
from tests.conftest import free_port
from trainguard.core.topology import Topology
from trainguard.emulation import inject
from trainguard.node_tools import launcher
from trainguard.node_tools.inventory import Inventory
from trainguard.node_tools.transport import transport_for
from trainguard.operators.jobspec import REFERENCE_ENTRY

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def _tg(inv: Inventory, machines, *args: str, timeout: float = 120):
    transport = transport_for(inv)
    return transport.run_many(machines, lambda m: [inv.tg_node, *args], timeout=timeout)


@pytest.mark.full
def test_stacks_of_a_hung_8_rank_job_from_every_machine(ns_cluster: Inventory):
    active = ns_cluster.by_role("active")
    plan = jobs.start(ns_cluster, "stacks8", Topology(tp=2, pp=2, dp=2), active)
    try:
        jobs.wait_all_reach(plan, 2)
        inject.inject(ns_cluster, "m3", "hang", rank=6)
        results = _tg(ns_cluster, active, "stacks", "--job", "stacks8", timeout=30)
        ranks = {}
        for res in results.values():
            assert res.returncode in (0, 1), res.describe()
            for p in res.json()["processes"]:
                if p["role"] == "rank":
                    ranks[p["rank"]] = p
        assert sorted(ranks) == list(range(8))
        assert ranks[6]["process_state"] in ("T", "t") and ranks[6]["threads"]  # stopped, still dumped
        for r, p in ranks.items():
            names = [f["name"] for t in p["threads"] for f in t["frames"]]
            assert any("Trainer" in n or "main" in n for n in names), (r, names[:10])
        # the heartbeats' collective counters come along
        doc = results["m0"].json()
        assert set(doc["collectives"]) == {"0", "1"} and doc["collectives"]["0"]
    finally:
        inject.clear(ns_cluster, "m3", "hang")
        launcher.stop(ns_cluster, plan.job, plan.machines, grace_s=3)


def test_diag_l2_passes_on_a_healthy_machine_and_catches_wrong_arithmetic(ns_cluster: Inventory):
    m4, m5 = ns_cluster.machine("m4"), ns_cluster.machine("m5")
    inject.inject(ns_cluster, "m5", "sdc")
    try:
        results = _tg(ns_cluster, [m4, m5], "diag", "--level", "2")
        healthy, broken = results["m4"], results["m5"]
        assert healthy.returncode == 0, healthy.stdout[-2000:]
        assert healthy.json()["healthy"] is True
        assert broken.returncode == 1
        failed = [t["name"] for t in broken.json()["tests"] if not t["ok"]]
        assert failed == ["compute"], broken.json()["tests"]
        # the alignment test tells the machines apart too
        digests = {n: r.json()["digest"] for n, r in _tg(ns_cluster, [m4, m5, ns_cluster.machine("m3")],
                                                        "align").items()}
        assert digests["m4"] == digests["m3"] != digests["m5"]
    finally:
        inject.clear(ns_cluster, "m5", "sdc")


def test_diag_l3_between_neighbour_machines(ns_cluster: Inventory):
    m4, m5 = ns_cluster.machine("m4"), ns_cluster.machine("m5")
    port = str(free_port())
    transport = transport_for(ns_cluster)

    def argv(m):
        rank = "0" if m.name == "m4" else "1"
        return [ns_cluster.tg_node, "diag", "--level", "3", "--rank", rank, "--world-size", "2",
                "--master-addr", m4.address, "--master-port", port, "--timeout-s", "60"]

    results = transport.run_many([m4, m5], argv, timeout=120)
    for name, res in results.items():
        assert res.returncode == 0, (name, res.stdout[-2000:], res.stderr[-500:])
        assert res.json()["healthy"] is True


def test_logs_over_ssh_classify_a_user_code_failure(ns_cluster: Inventory):
    plan = jobs.start(ns_cluster, "logs1", Topology(tp=2, pp=1, dp=1), [ns_cluster.machine("m4")])
    try:
        jobs.wait_all_reach(plan, 0)
        inject.inject(ns_cluster, "m4", "user_error", rank=0)
        from tests.conftest import wait_until

        wait_until(lambda: jobs.exit_code(plan, plan.machines[0]) is not None, timeout=60, what="the job to end")
        res = _tg(ns_cluster, plan.machines, "logs", "--job", "logs1")["m4"]
        assert res.returncode == 0, res.describe()
        doc = res.json()
        assert doc["verdict"]["class"] == "user_code" and doc["verdict"]["rank"] == 0
        assert "shuffle_window" in str(doc["verdict"])
    finally:
        launcher.stop(ns_cluster, plan.job, plan.machines, grace_s=3)


@pytest.mark.full
def test_a_parked_standby_joins_a_3d_job_warm(ns_cluster: Inventory):
    m4 = ns_cluster.machine("m4")
    parked = _tg(ns_cluster, [m4], "standby", "park", "--nproc", "2")["m4"]
    assert parked.returncode == 0, parked.describe()
    warm = {s["pid"] for s in parked.json()["slots"]}
    machines = [ns_cluster.machine(n) for n in ("m0", "m1", "m2")] + [m4]  # m4 stands in for m3
    plan = launcher.JobPlan(job="warm3d", topology=Topology(tp=2, pp=2, dp=2), machines=machines,
                            train_args=["--steps", "6"], master_port=free_port(), warm={"m4"}, entry=REFERENCE_ENTRY,
                            pass_layout=True)
    try:
        launcher.launch(ns_cluster, plan)
        from tests.conftest import wait_until

        wait_until(lambda: all(jobs.exit_code(plan, m) is not None for m in machines), timeout=300,
                   what="the job to end on every machine")
        assert [jobs.exit_code(plan, m) for m in machines] == [0, 0, 0, 0]
        # ranks 6 and 7 ran in m4's warm interpreters, in step with everyone
        assert {jobs.heartbeat(plan, r)["pid"] for r in (6, 7)} <= warm
        steps = {r: [s["step"] for s in jobs.steps(plan, r)] for r in range(8)}
        assert all(v == list(range(6)) for v in steps.values())
        assert all(s["dp_digests_match"] for r in range(8) for s in jobs.steps(plan, r))
        status = _tg(ns_cluster, [m4], "standby", "status")["m4"].json()
        assert status["state"] == "empty"
    finally:
        launcher.stop(ns_cluster, plan.job, plan.machines, grace_s=3)
        _tg(ns_cluster, [m4], "standby", "unpark")


def test_a_killed_agent_is_restarted_by_its_supervisor(ns_cluster: Inventory):
    import json
    import os
    import signal
    from pathlib import Path

    from tests.conftest import wait_until
    from trainguard.core import procs

    status = Path(ns_cluster.machine("m5").extra["machine_dir"]) / "agent" / "status.json"

    def agent_pid():
        try:
            return json.loads(status.read_text())["pid"]
        except (OSError, ValueError, KeyError):
            return None

    old = wait_until(agent_pid, timeout=30, what="the agent's status")
    os.kill(old, signal.SIGKILL)
    new = wait_until(lambda: agent_pid() not in (None, old) and agent_pid(), timeout=60,
                     what="a restarted agent writing its status")
    assert procs.alive(new) and not procs.alive(old)

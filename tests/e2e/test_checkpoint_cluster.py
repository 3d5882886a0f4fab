"""Checkpoints of the reference job on the emulated cluster (TP=2 PP=2 DP=2 on m0..m3, two ranks a machine).

Each machine's checkpoints live on its own tmpfs disk (``<workdir>/jobs/<job>/checkpoints``), reached
only through its own sshd and process tree. Placement (``Topology.backup_rank``, the backup shares no
TP, PP or DP group): the replicas of m0's ranks live on m3, m1's on m2, m2's on m1, m3's on m0.

One test, in three phases, against an uninterrupted reference run with the same seed and data:

1. a rank on m2 is SIGKILLed mid-run (``inject crash``); the job is stopped and relaunched on the same
   machines: it resumes from the newest committed step, losing at most one, and every step after it has
   parameters bit-identical (``param_digest``) to the reference;
2. a rank on m0 is killed, and the whole pipeline of data-parallel replica 0 (m0 and m1: every stage of
   it) is evicted; the job restarts on the standbys m4, m5 (empty disks) with m2, m3: the ranks of the
   new machines get their state from the replicas on m3 and m2, again bit-identical, at most one step lost.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests import jobs
from tests.conftest import wait_until
from trainguard.core.topology import Topology
from trainguard.emulation import inject
from trainguard.node_tools import launcher
from trainguard.node_tools.inventory import Inventory, Machine

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.full]

TOPO = Topology(tp=2, pp=2, dp=2)
STEPS = 22
PACE = ["--step-delay-s", "0.25"]  # room to act between steps


def incarnation_steps(plan: launcher.JobPlan, rank: int) -> list[dict[str, Any]]:
    """The rank's step records of the newest incarnation that recorded any."""
    records = jobs.steps(plan, rank)
    newest = max((r.get("incarnation", 0) for r in records), default=0)
    return [r for r in records if r.get("incarnation", 0) == newest]


def wait_exited(plan: launcher.JobPlan, machines: list[Machine]) -> None:
    wait_until(lambda: all(jobs.exit_code(plan, m) is not None for m in machines), timeout=300,
               what=f"job {plan.job} to end on {', '.join(m.name for m in machines)}")


def crash_and_stop(inv: Inventory, plan: launcher.JobPlan, machine: str, rank: int, after: int) -> int:
    """Kill ``rank`` on ``machine`` once every rank finished ``after``; stop the rest. Returns the last
    step every rank finished."""
    jobs.wait_all_reach(plan, after)
    inject.inject(inv, machine, "crash", rank=rank)
    wait_until(lambda: jobs.exit_code(plan, inv.machine(machine)) is not None, timeout=60,
               what=f"the crash to end the job's part on {machine}")
    launcher.stop(inv, plan.job, plan.machines, grace_s=5)
    return min(jobs.last_step(plan, r) for r in range(TOPO.world_size))


def check_resumed(plan: launcher.JobPlan, reference: dict[int, dict[int, str]], finished: int,
                  source: str | set[str], ranks: list[int], *, complete: bool) -> int:
    """The relaunched job restored one step on every rank, lost at most one, named ``source`` (one of them)
    for ``ranks``, and matched the reference bit for bit at every step after it (up to the end when
    ``complete``, else as far as each rank got). Returns the restored step."""
    firsts = {r: incarnation_steps(plan, r)[0] for r in range(TOPO.world_size)}
    restored = {f["ckpt_restored_step"] for f in firsts.values()}
    assert len(restored) == 1, firsts
    step = restored.pop()
    assert finished - 1 <= step <= finished, (finished, step)
    for r in ranks:
        assert firsts[r]["ckpt_restore_source"] in ({source} if isinstance(source, str) else source), (r, firsts[r])
    for r in range(TOPO.world_size):
        records = incarnation_steps(plan, r)
        last = STEPS - 1 if complete else records[-1]["step"]
        assert [x["step"] for x in records] == list(range(step + 1, last + 1)), r
        assert {x["step"]: x["param_digest"] for x in records} == \
            {s: d for s, d in reference[r].items() if step < s <= last}, r
    return step


def test_killed_ranks_and_an_evicted_pipeline_resume_bit_identical(ns_cluster: Inventory):
    active = ns_cluster.by_role("active")
    standbys = ns_cluster.by_role("standby")
    assert len(active) == 4 and len(standbys) == 2
    assert {TOPO.machine_of(TOPO.backup_rank(r)) for r in TOPO.ranks_on(0)} == {3}  # m0 -> m3

    ref = jobs.start(ns_cluster, "ckref", TOPO, active, "--steps", str(STEPS))
    wait_exited(ref, active)
    assert [jobs.exit_code(ref, m) for m in active] == [0, 0, 0, 0]
    reference = {r: {x["step"]: x["param_digest"] for x in jobs.steps(ref, r)} for r in range(TOPO.world_size)}
    assert all(len(d) == STEPS for d in reference.values())

    args = ["--steps", str(STEPS), "--checkpoint", *PACE]
    plan = jobs.start(ns_cluster, "ck", TOPO, active, *args)
    try:
        # 1. a killed rank: same machines, local copies
        finished = crash_and_stop(ns_cluster, plan, "m2", rank=5, after=5)
        plan = jobs.start(ns_cluster, "ck", TOPO, active, *args)
        jobs.wait_all_reach(plan, finished + 3)
        check_resumed(plan, reference, finished, "local", ranks=[0, 1, 2, 3], complete=False)

        # 2. a killed rank, then its whole pipeline (m0, m1) evicted for the standbys
        finished = crash_and_stop(ns_cluster, plan, "m0", rank=0, after=finished + 4)
        moved = [standbys[0], standbys[1], active[2], active[3]]
        plan = jobs.start(ns_cluster, "ck", TOPO, moved, *args)
        wait_exited(plan, moved)
        assert [jobs.exit_code(plan, m) for m in moved] == [0, 0, 0, 0]
        check_resumed(plan, reference, finished, "replica", ranks=[0, 1, 2, 3], complete=True)
    finally:
        launcher.stop(ns_cluster, "ck", active + standbys, grace_s=5)

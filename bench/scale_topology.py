"""Scale benchmark of the parallel layout and the restart plan: what grows with the fleet.

* ``topology_setup_s``: what one rank's checkpoint engine computes from the topology when it starts (its
  backup rank, the ranks it backs up, its TP/PP/DP groups), from a fresh process's empty caches; sizes are
  ranks of a TP=8 x PP x DP layout on machines of 8 ranks (target at 100,000 ranks: <= 1 s).
* ``restart_plan_s``: the launch plan of a restart on that many machines (TP=8, PP=10): the job's machines
  looked up in a fresh inventory by name, the plan built and validated, and every machine's start command
  (target at 12,500 machines: <= 0.5 s).
* ``topology_groups_s``: every TP, PP and DP group of the layout (what each rank of a training job builds).

``CASES`` maps each metric to ``(prepare, sizes)``: ``prepare(size)`` builds the input, untimed, and returns
the callable to time. ``python bench/scale_topology.py`` runs each case once per size and prints seconds.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainguard.core.topology import GROUP_KINDS, Topology, clear_layout_caches
from trainguard.node_tools.inventory import Inventory, Machine
from trainguard.node_tools.launcher import JobPlan
from trainguard.operators.jobspec import REFERENCE_ENTRY

RANKS_PER_MACHINE = 8


def _layout(ranks: int) -> Topology:
    """TP=8 on each machine, PP=10 (PP=5 below 8,000 ranks), DP the rest."""
    pp = 5 if ranks < 8000 else 10
    if ranks % (RANKS_PER_MACHINE * pp):
        raise SystemExit(f"{ranks} ranks do not fill TP={RANKS_PER_MACHINE} x PP={pp}; use a multiple of "
                         f"{RANKS_PER_MACHINE * pp}")
    return Topology(tp=RANKS_PER_MACHINE, pp=pp, dp=ranks // (RANKS_PER_MACHINE * pp),
                    ranks_per_machine=RANKS_PER_MACHINE)


def prepare_topology_setup(ranks: int) -> Callable[[], Any]:
    topology = _layout(ranks)
    rank = ranks // 2 + 3  # a rank inside the layout, off every edge

    def start() -> tuple[int, int, int]:
        clear_layout_caches()  # a starting rank's process has computed nothing yet
        backup = topology.backup_rank(rank)
        sources = list(topology.backed_up_by(rank))
        groups = [topology.group(kind, rank) for kind in GROUP_KINDS]
        return backup, len(sources), sum(len(g) for g in groups)

    return start


def prepare_restart_plan(machines: int) -> Callable[[], Any]:
    topology = Topology(tp=RANKS_PER_MACHINE, pp=10, dp=machines // 10, ranks_per_machine=RANKS_PER_MACHINE)
    fleet = [Machine(name=f"m{i:05d}", address=f"10.{i // 65536}.{i // 256 % 256}.{i % 256}", gpus=8)
             for i in range(machines)]
    machine_list = [m.name for m in reversed(fleet)]  # the job's order is not the inventory's

    def plan() -> int:
        inventory = Inventory(cluster="bench", transport="ssh", machines=list(fleet))  # nothing indexed yet
        job_machines = [inventory.machine(name) for name in machine_list]
        job = JobPlan(job="bench", topology=topology, machines=job_machines, checkpoint="/ckpt", entry=REFERENCE_ENTRY,
                      pass_layout=True)
        job.validate()
        return sum(len(job.start_argv(inventory, m)) for m in job_machines)

    return plan


def prepare_topology_groups(ranks: int) -> Callable[[], Any]:
    topology = _layout(ranks)
    return lambda: [len(topology.groups(kind)) for kind in GROUP_KINDS]


CASES: dict[str, tuple[Callable[[int], Callable[[], Any]], list[int]]] = {
    "topology_setup_s": (prepare_topology_setup, [1000, 10000, 100000]),
    "restart_plan_s": (prepare_restart_plan, [1000, 12500]),
    "topology_groups_s": (prepare_topology_groups, [100000]),
}


def main() -> None:
    for metric, (prepare, sizes) in CASES.items():
        for size in sizes:
            run = prepare(size)
            t0 = time.perf_counter()
            run()
            print(f"{metric}[{size}]: {time.perf_counter() - t0:.3f} s", flush=True)


if __name__ == "__main__":
    main()

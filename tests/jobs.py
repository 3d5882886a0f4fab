"""Helpers for tests that run the reference job on the emulated cluster."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.conftest import free_port, wait_until
from trainguard.core.topology import Topology
from trainguard.node_tools import launcher, monitor
from trainguard.node_tools.inventory import Inventory, Machine
from trainguard.operators.jobspec import REFERENCE_ENTRY


def run_dir(machine: Machine, job: str) -> Path:
    return Path(machine.workdir) / "jobs" / job


def start(inv: Inventory, job: str, topology: Topology, machines: list[Machine], *train_args: str) -> launcher.JobPlan:
    plan = launcher.JobPlan(job=job, topology=topology, machines=machines, train_args=list(train_args),
                            master_port=free_port(), entry=REFERENCE_ENTRY, pass_layout=True)
    launcher.launch(inv, plan)
    return plan


def rank_dirs(plan: launcher.JobPlan) -> dict[int, Path]:
    """Global rank -> the run directory holding its files."""
    out = {}
    for i, m in enumerate(plan.machines):
        for r in plan.topology.ranks_on(i):
            out[r] = run_dir(m, plan.job)
    return out


def steps(plan: launcher.JobPlan, rank: int) -> list[dict[str, Any]]:
    return monitor.read_steps(rank_dirs(plan)[rank], rank)


def heartbeat(plan: launcher.JobPlan, rank: int) -> dict[str, Any]:
    return monitor.read_heartbeat(rank_dirs(plan)[rank], rank) or {}


def last_step(plan: launcher.JobPlan, rank: int) -> int:
    """The rank's last finished step, from its step records (the heartbeat lags by up to its flush interval)."""
    records = steps(plan, rank)
    return records[-1]["step"] if records else -1


def wait_all_reach(plan: launcher.JobPlan, step: int, timeout: float = 180) -> None:
    ranks = range(plan.topology.world_size)
    wait_until(lambda: all(last_step(plan, r) >= step for r in ranks), timeout=timeout,
               what=f"every rank of {plan.job} to finish step {step}")


def exit_code(plan: launcher.JobPlan, machine: Machine) -> int | None:
    try:
        return json.loads((run_dir(machine, plan.job) / "exit.json").read_text())["returncode"]
    except (OSError, ValueError, KeyError):
        return None


def rank_log(plan: launcher.JobPlan, machine: Machine, local_rank: int, stream: str = "stderr") -> str:
    logs = sorted((run_dir(machine, plan.job) / "logs").glob(f"inc*/*/attempt_*/{local_rank}/{stream}.log"))
    return logs[-1].read_text(errors="replace") if logs else ""


class AlertWatch:
    """Reads the cluster's alert bus from a moment on and waits for alerts."""

    def __init__(self, inv: Inventory) -> None:

        from trainguard.node_tools.bus import BusReader, open_bus

        self.reader = BusReader.from_now(open_bus(inv.bus_url))
        self.seen: list[Any] = []

    def poll(self) -> list[Any]:
        self.seen += self.reader.read()
        return self.seen

    def mark(self) -> int:
        return len(self.poll())

    def expect(self, kind: str, *, machine: str | None = None, rank: int | None = None, after: int = 0,
               severity: str | None = None, timeout: float = 40) -> Any:
        def match() -> Any:
            for a in self.poll()[after:]:
                if a.kind == kind and machine in (None, a.machine) and rank in (None, a.rank) \
                        and severity in (None, a.severity):
                    return a
            return None

        return wait_until(match, timeout=timeout,
                          what=f"alert {kind} (machine {machine}, rank {rank}); seen "
                               f"{[(a.kind, a.machine, a.rank) for a in self.seen[after:]]}")

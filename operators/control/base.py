"""The controller's parts every responsibility shares: its settings, the fleet database, the inventory and the
transport to the machines, and the few helpers they all use."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from trainguard.core.topology import Topology
from trainguard.node_tools.inventory import Inventory, Machine
from trainguard.node_tools.transport import RunResult, Transport, transport_for
from trainguard.operators.fleet import FleetStore, states
from trainguard.operators.settings import ControlSettings

ROLE_STATE = {"active": states.STANDBY, "standby": states.STANDBY, "free": states.PROVISIONING,
              "evicted": states.REPAIR}

PORT_BASE = 29400  # a job's rendezvous port: PORT_BASE + its launches modulo PORT_SPAN
PORT_SPAN = 400
REPLAY_PORT_BASE = 29900  # a replay's groups rendezvous on 29900.. (the job uses 29400..29799)

# the control plane's settings (one typed, bounded object read from TG_* variables): see trainguard.operators.settings
ControlConfig = ControlSettings


def described(results: Mapping[str, RunResult]) -> dict[str, str]:
    """What each machine's stop said: "stopped", or why not."""
    return {n: ("stopped" if r.ok else r.describe()) for n, r in results.items()}


def held_copies(copies: Any) -> list[tuple[str, int, int]]:
    """``(tier, step, rank)`` of the copies a ``tg-node ckpt list`` document lists."""
    return [(str(c["tier"]), int(c["step"]), int(c["rank"])) for c in copies or []
            if isinstance(c, Mapping) and isinstance(c.get("step"), int) and isinstance(c.get("rank"), int)]


def asdict_action(a: Any) -> dict[str, Any]:
    return {"id": a.id, "kind": a.kind, "machines": a.machines, "outcome": a.outcome, "detail": a.detail,
            "dry_run": a.dry_run, "evidence": a.evidence}


class ControllerBase:
    """What every part of the controller stands on: one fleet, its inventory, a transport."""

    def __init__(self, config: ControlConfig, *, transport: Transport | None = None,
                 inventory: Inventory | None = None, fleet: FleetStore | None = None) -> None:
        """``fleet``: the fleet database as the caller holds it (the tasks': :class:`~trainguard.operators.hooks.fleet.
        FleetHook`'s, one engine per process); without it, the controller opens it and provisions its schema
        (a controller made outside Airflow: the provisioner, the harness, a script)."""
        self.cfg = config
        self.inventory = inventory or Inventory.load(Path(config.inventory))
        self.transport = transport or transport_for(self.inventory, fanout=config.ssh_fanout)
        self.fleet = fleet if fleet is not None else FleetStore(config.fleet_url, migrate=True)
        # what this controller's last stop of each job found when it ended the job everywhere: its machines
        # and the lowest step every rank finished; a restart right after needs no round of reads
        self._stopped: dict[str, dict[str, Any]] = {}
        # the checkpoint copies each machine of a job held when this controller last stopped it
        self._copies: dict[str, dict[str, list[tuple[str, int, int]] | None]] = {}
        # when a restart's wait last asked every machine whether the job ended everywhere: (job, restart) -> time
        self._exited_checked: dict[tuple[str, float], float] = {}

    def sync_inventory(self) -> list[str]:
        """Register the inventory's machines that the fleet database does not know yet."""
        return self.fleet.register_machines([(m.name, m.address, ROLE_STATE.get(m.role, states.STANDBY),
                                              f"from the inventory (role {m.role})") for m in self.inventory.machines])

    def machines(self, names: Sequence[str]) -> list[Machine]:
        return [self.inventory.machine(n) for n in names]

    def topology(self, job: str) -> Topology:
        j = self.fleet.job(job)
        return Topology(j.tp, j.pp, j.dp, ranks_per_machine=j.ranks_per_machine)

    def _run(self, machines: Sequence[Machine], argv_for: Any, timeout: float,
             env: Mapping[str, str] | None = None) -> dict[str, RunResult]:
        return self.transport.run_many(list(machines), argv_for, timeout=timeout, env=env)


"""What every service of the controller stands on: its settings, the fleet database, the inventory, the transport
to the machines, and what the last stop of each job found (:class:`StopMemory`).

A service holds these as plain attributes and calls them directly (``self.transport.run_many``,
``self.inventory.named``, ``self.fleet.job(...).topology``): nothing here is called while a decision is taken,
so following one never passes through this module."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trainguard.node_tools.inventory import Inventory
from trainguard.node_tools.transport import Transport
from trainguard.operators.fleet import FleetStore, states
from trainguard.operators.settings import ControlSettings

ROLE_STATE = {"active": states.STANDBY, "standby": states.STANDBY, "free": states.PROVISIONING,
              "evicted": states.REPAIR}

PORT_BASE = 29400  # a job's rendezvous port: PORT_BASE + its launches modulo PORT_SPAN
PORT_SPAN = 400
REPLAY_PORT_BASE = 29900  # a replay's groups rendezvous on 29900.. (the job uses 29400..29799)

# the control plane's settings (one typed, bounded object read from TG_* variables): see trainguard.operators.settings
ControlConfig = ControlSettings


def asdict_action(a: Any) -> dict[str, Any]:
    return {"id": a.id, "kind": a.kind, "machines": a.machines, "outcome": a.outcome, "detail": a.detail,
            "dry_run": a.dry_run, "evidence": a.evidence}


def waiting(reason: str) -> dict[str, Any]:
    """What an action answers when it left the incident waiting for a human (``reason``: why, and what next)."""
    return {"swaps": {}, "waiting_human": True, "reason": reason}


@dataclass
class StopMemory:
    """What this controller's last stop of each job found, shared by the services that act right after it (a
    restart needs no round of reads; an eviction checks the checkpoint copies the stop saw)."""

    #: job -> its machines, the lowest step every rank finished, the copies: when the stop ended it everywhere
    stopped: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: job -> the checkpoint copies each machine held once nothing wrote them (None: it did not say)
    copies: dict[str, dict[str, list[tuple[str, int, int]] | None]] = field(default_factory=dict)
    #: (job, restart) -> when a restart's wait last asked every machine whether the job ended everywhere
    exited_checked: dict[tuple[str, float], float] = field(default_factory=dict)

    def forget(self, job: str) -> None:
        """The job runs again: what a stop found no longer holds."""
        self.stopped.pop(job, None)
        self.copies.pop(job, None)


class Part:
    """One service of the controller: the settings, the fleet database, the inventory, the transport, and the
    memory of the last stops, the same objects for every service of one controller."""

    def __init__(self, cfg: ControlConfig, fleet: FleetStore, inventory: Inventory, transport: Transport,
                 memory: StopMemory) -> None:
        self.cfg = cfg
        self.fleet = fleet
        self.inventory = inventory
        self.transport = transport
        self.memory = memory

    @classmethod
    def sharing(cls, other: Part, **services: Any) -> Any:
        """A service over ``other``'s settings, database, inventory, transport and memory, with the services it
        calls (``services``: each passed to its constructor by name)."""
        return cls(other.cfg, other.fleet, other.inventory, other.transport, other.memory, **services)

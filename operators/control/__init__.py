"""The recovery workflow as plain Python, with no Airflow import: the services the tasks of the DAGs call, by
responsibility, each over the same fleet database, inventory and transport, and each given the services it calls
when it is made (no service looks another up).

- :class:`~trainguard.operators.control.jobs.Jobs`: a job's launch, stop, progress and resume;
- :class:`~trainguard.operators.control.incidents.Incidents` (over the jobs): alerts into incidents, triage, close and
  timeline;
- :class:`~trainguard.operators.control.evictions.Evictions` (over the jobs and the incidents): standbys swapped in
  through the breaker, checkpoints protected, rollback, what to change before a retry;
- :class:`~trainguard.operators.control.recovery.Recovery` (over the jobs and the evictions): the restart after a
  recovery's evictions;
- :class:`~trainguard.operators.control.diagnosis.Diagnosis`: stop-time diagnosis (L1-L3, alignment) and the probe;
- :class:`~trainguard.operators.control.analysis.Analysis`: stacks of a hang and the fail-slow vote;
- :class:`~trainguard.operators.control.replay.Replay`: dual-phase replay;
- :class:`~trainguard.operators.control.degrade.Degrade` (over the jobs and the evictions): the degrade path (a
  replica group taken out and healed from a live one while the others train on);
- :class:`~trainguard.operators.control.ettr.Ettr`: the ETTR ledger;
- :class:`~trainguard.operators.control.reconcile.Reconciliation` (over the incidents): the reconciler's looks behind
  the incidents, and what it does about what it finds.

:class:`Controller` makes them, once, for one fleet: the tasks are handed one (the DAGs' tasks get theirs from
:class:`~trainguard.operators.hooks.fleet.FleetHook`) and call the service they need (``c.jobs.stop(job)``). Scripts,
the command line and the harness may also call a service's method on the controller itself (``c.stop(job)``): each
public method name belongs to exactly one service (:data:`FLAT`).

Every method that changes fleet state goes through :class:`trainguard.operators.fleet.store.FleetStore` (one
transaction, idempotent), records an action with its evidence, and in dry-run mode records the decision
without acting.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from trainguard.node_tools.inventory import Inventory
from trainguard.node_tools.transport import Transport, transport_for
from trainguard.operators.control.analysis import Analysis
from trainguard.operators.control.base import ControlConfig, Part, StopMemory, asdict_action
from trainguard.operators.control.degrade import Degrade
from trainguard.operators.control.diagnosis import Diagnosis, neighbour_groups
from trainguard.operators.control.ettr import Ettr
from trainguard.operators.control.evictions import Evictions
from trainguard.operators.control.incidents import Incidents
from trainguard.operators.control.jobs import Jobs
from trainguard.operators.control.reconcile import Reconciliation
from trainguard.operators.control.recovery import Recovery
from trainguard.operators.control.replay import Replay
from trainguard.operators.fleet import FleetError, FleetStore
from trainguard.operators.hooks.reach import IncidentReach
from trainguard.operators.policy.liveness import QUIET_S

__all__ = ["FLAT", "SERVICES", "ControlConfig", "Controller", "asdict_action", "neighbour_groups"]

#: the controller's services: attribute -> class
SERVICES: dict[str, type[Part]] = {
    "jobs": Jobs, "incidents": Incidents, "evictions": Evictions, "recovery": Recovery, "diagnosis": Diagnosis,
    "analysis": Analysis, "replay": Replay, "degrade": Degrade, "ettr": Ettr, "reconciliation": Reconciliation}


def _flat() -> dict[str, str]:
    out: dict[str, str] = {}
    for attr, cls in SERVICES.items():
        for name in vars(cls):
            if name.startswith("_") or not callable(getattr(cls, name)):
                continue
            if name in out:
                raise TypeError(f"{name} is a method of both {out[name]} and {attr}: one name, one service")
            out[name] = attr
    return out


#: each public method name of a service -> the service it belongs to (for :meth:`Controller.__getattr__`)
FLAT: dict[str, str] = _flat()


class Controller:
    """The control plane's services over one fleet database, inventory and transport (see the module)."""

    jobs: Jobs
    incidents: Incidents
    evictions: Evictions
    recovery: Recovery
    diagnosis: Diagnosis
    analysis: Analysis
    replay: Replay
    degrade: Degrade
    ettr: Ettr
    reconciliation: Reconciliation

    def __init__(self, config: ControlConfig, *, transport: Transport | None = None,
                 inventory: Inventory | None = None, fleet: FleetStore | None = None) -> None:
        """``fleet``: the fleet database as the caller holds it (the tasks': :class:`~trainguard.operators.hooks.fleet.
        FleetHook`'s, one engine per process); without it, the controller opens it and provisions its schema
        (a controller made outside Airflow: the provisioner, the harness, a script)."""
        self.cfg = config
        self.inventory = inventory or Inventory.load(Path(config.inventory))
        self.fleet = fleet if fleet is not None else FleetStore(config.fleet_url, migrate=True)
        self.memory = StopMemory()
        self._transport = IncidentReach(transport or transport_for(self.inventory, fanout=config.ssh_fanout))
        self._make_services()

    def _make_services(self) -> None:
        base = Part(self.cfg, self.fleet, self.inventory, self._transport, self.memory)
        self.jobs = Jobs.sharing(base)
        self.incidents = Incidents.sharing(base, jobs=self.jobs)
        self.evictions = Evictions.sharing(base, jobs=self.jobs, incidents=self.incidents)
        self.recovery = Recovery.sharing(base, jobs=self.jobs, evictions=self.evictions)
        self.diagnosis = Diagnosis.sharing(base)
        self.analysis = Analysis.sharing(base)
        self.replay = Replay.sharing(base)
        self.degrade = Degrade.sharing(base, jobs=self.jobs, evictions=self.evictions)
        self.ettr = Ettr.sharing(base)
        self.reconciliation = Reconciliation.sharing(base, incidents=self.incidents)

    @property
    def transport(self) -> Transport:
        """How the services reach the machines."""
        return self._transport

    @transport.setter
    def transport(self, transport: Transport) -> None:
        """Another way to the machines (a test's scripted fleet): every service is made again over it."""
        self._transport = IncidentReach(transport)
        self._make_services()

    def handling(self, incident_id: int) -> None:
        """The sessions from now on are incident ``incident_id``'s: a machine it found unreachable before (in any
        task) is not contacted again, and one found so now is recorded against it
        (:class:`~trainguard.operators.hooks.reach.IncidentReach`)."""
        incident_id = int(incident_id)
        gone = {a.machines[0]: str((a.evidence or {}).get("why") or "") for a in self.fleet.actions(incident_id)
                if a.kind == "unreachable" and a.machines}

        def record(machine: str, why: str) -> None:
            action, new = self.fleet.record_action(f"unreachable:{incident_id}:{machine}", kind="unreachable",
                                                   incident_id=incident_id, machines=[machine],
                                                   evidence={"why": why[:300]})
            if new:
                self.fleet.finish_action(action.id, "done", why[:200])

        self._transport.enter(incident_id, gone, record)
        self._transport.hurry(self._quiet(incident_id))

    def _quiet(self, incident_id: int) -> dict[str, float]:
        """The machines of the incident's job whose agents the guardian last saw quiet (:data:`QUIET_S`): machine ->
        for how long (the reach leaves out those already gone)."""
        try:
            job = self.fleet.job(self.fleet.incident(incident_id).job)
        except FleetError:  # an incident of machines alone, or of a job since removed
            return {}
        now, live = time.time(), self.fleet.liveness()  # (the guardian's clock, as the rows are)
        return {m: now - live[m].changed_ts for m in job.machine_list
                if m in live and now - live[m].changed_ts >= QUIET_S}

    def unreachable(self, job: str) -> dict[str, str]:
        """The machines of ``job`` the incident being handled found unreachable: machine -> why."""
        serving = set(self.fleet.job(job).machine_list)
        return {m: why for m, why in self._transport.gone.items() if m in serving}

    # ---- for scripts, the command line and the harness -------------------------------------------------------
    def machines(self, names: Any) -> list[Any]:
        """The inventory's machines called ``names``."""
        return self.inventory.named(names)

    def topology(self, job: str) -> Any:
        """The job's parallel layout."""
        return self.fleet.job(job).topology

    def wait_for_human(self, incident_id: int, reason: str) -> dict[str, Any]:
        """The incident and its job wait for a human (:meth:`FleetStore.wait_for_human`)."""
        return self.fleet.wait_for_human(incident_id, reason)

    def __getattr__(self, name: str) -> Any:
        """A service's method called on the controller (``c.stop(job)`` is ``c.jobs.stop(job)``): for scripts, the
        command line and the harness; the tasks name the service."""
        owner = FLAT.get(name)
        if owner is None:
            raise AttributeError(f"{type(self).__name__} has no attribute {name!r} (no service of it has that method)")
        return getattr(self.__dict__[owner], name)

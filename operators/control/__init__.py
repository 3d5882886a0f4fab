"""The recovery workflow as plain Python, with no Airflow import: what the tasks of the DAGs do, by
responsibility (the DAGs call these methods through :mod:`trainguard.operators.tasks` and pass their results on).

A :class:`Controller` holds the fleet database, the inventory and a transport (the
:class:`~trainguard.operators.hooks.node.NodeHook`'s SSH sessions in Airflow; the inventory's own transport
elsewhere). Its parts, one module each:

- :mod:`~trainguard.operators.control.jobs`: a job's launch, stop, restart, progress and resume;
- :mod:`~trainguard.operators.control.incidents`: alerts into incidents, triage, close and timeline;
- :mod:`~trainguard.operators.control.evictions`: standbys swapped in through the breaker, checkpoints protected,
  rollback, what to change before a retry;
- :mod:`~trainguard.operators.control.diagnosis`: stop-time diagnosis (L1-L3, alignment) and the probe;
- :mod:`~trainguard.operators.control.analysis`: stacks of a hang and the fail-slow vote;
- :mod:`~trainguard.operators.control.replay`: dual-phase replay;
- :mod:`~trainguard.operators.control.degrade`: the degrade path (a replica group taken out and healed from a live
  one while the others train on);
- :mod:`~trainguard.operators.control.ettr`: the ETTR ledger;
- :mod:`~trainguard.operators.control.reconcile`: the reconciler's looks behind the incidents, and what it does
  about what it finds.

Every method that changes fleet state goes through :class:`trainguard.operators.fleet.store.FleetStore` (one
transaction, idempotent), records an action with its evidence, and in dry-run mode records the decision
without acting.
"""

from __future__ import annotations

from trainguard.operators.control.analysis import RuntimeAnalysis
from trainguard.operators.control.base import ControlConfig, asdict_action
from trainguard.operators.control.degrade import ReplicaDegrade
from trainguard.operators.control.diagnosis import Diagnosis, neighbour_groups
from trainguard.operators.control.ettr import EttrLedger
from trainguard.operators.control.evictions import Evictions
from trainguard.operators.control.incidents import Incidents
from trainguard.operators.control.jobs import JobLifecycle
from trainguard.operators.control.reconcile import Reconciliation
from trainguard.operators.control.replay import Replay

__all__ = ["ControlConfig", "Controller", "asdict_action", "neighbour_groups"]


class Controller(Incidents, JobLifecycle, Evictions, Diagnosis, RuntimeAnalysis, Replay, EttrLedger, Reconciliation,
                 ReplicaDegrade):
    """The control plane's actions on one fleet: every part above over one fleet database, inventory and
    transport."""

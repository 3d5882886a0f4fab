"""Train through the loss of a data-parallel replica, or stop the world: which path an incident takes.

Most machine faults touch one data-parallel replica (with TP inside a machine, one pipeline of ``pp``
machines). The other replicas need not stop: the job keeps training on them (each step on fewer samples,
or with more gradient accumulation, as the job chose), while the replica's machines are diagnosed,
evicted and replaced off the critical path, and the replacement catches up from a live replica before it
rejoins. :func:`plan` says when that holds:

=========================================================  ========================================
the incident                                               path
=========================================================  ========================================
an explicit machine fault, a machine's repeated network    ``degrade``: the replicas its machines
fault, a crash, a hang or a slow group, first failure      belong to leave; the rest train on
(level 0), its machines in at most ``dp - min_replicas``
replicas
the same, in more replicas than that (a DP-wide            ``stop_world``
over-eviction, a fault on every pipeline)
a NaN, silent corruption (the state itself is suspect),    ``stop_world``: today's ladder
a user-code error (a rollback), a repeat failure (level
>= 1), a wait for a human
a network flap tolerated, an observation, a probe          ``none``: nothing stops
=========================================================  ========================================

Plain Python, called by the simulator (``trainguard simulate --degrade``) and by the control plane for a job run as
replica groups (its spec's ``replicas``: :mod:`trainguard.operators.control.degrade`): before a rung stops the job,
and for the fail-slow vote once it named the slow group (:mod:`trainguard.operators.tasks.incident`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from trainguard.core.topology import Topology

DEGRADE, STOP_WORLD, NONE = "degrade", "stop_world", "none"
#: categories a replica can be taken out for: the fault is in machines, not in the state every replica shares
REPLICA_FAULTS = frozenset({"machine_fault", "network", "crash", "hang", "slow"})
#: ladder actions that take machines out or restart them: the ones a degraded replica can carry out alone
REPLICA_ACTIONS = frozenset({"evict", "restart", "diagnose", "analyze", "vote", "reattempt"})
NOTHING_STOPS = frozenset({"tolerate", "observe", "probe"})


@dataclass(frozen=True)
class DegradePlan:
    """Which path an incident takes. ``replicas``: the data-parallel replicas that leave (``degrade``);
    ``machines``: their machines (node ranks); ``width``: the share of replicas training meanwhile (1.0 when
    nothing stops, 0.0 when the world stops)."""

    path: str
    replicas: tuple[int, ...] = ()
    machines: tuple[int, ...] = ()
    width: float = 1.0
    reason: str = ""


def replicas_of(topology: Topology, machines: Iterable[int]) -> tuple[int, ...]:
    """The data-parallel replicas (DP coordinates) any rank of ``machines`` (node ranks) belongs to."""
    return tuple(sorted({topology.coords(r).dp for m in machines for r in topology.ranks_on(m)}))


def replica_machines(topology: Topology, replicas: Iterable[int]) -> tuple[int, ...]:
    """Every machine (node rank) holding a rank of ``replicas``."""
    wanted = {d for d in replicas if 0 <= d < topology.dp}
    return tuple(sorted({topology.machine_of(topology.rank_of(tp=t, pp=p, dp=d)) for d in wanted
                         for p in range(topology.pp) for t in range(topology.tp)}))


def plan(topology: Topology, *, category: str, action: str, machines: Iterable[int], level: int = 0,
         min_replicas: int = 1, log_verdict: str = "") -> DegradePlan:
    """The path of an incident of ``category`` whose ladder decision is ``action`` on ``machines`` (node ranks:
    the machines to evict, or where the failure showed), at escalation ``level``; the job may train on no fewer
    than ``min_replicas`` replicas. ``log_verdict`` ``user_code``: the job's own code failed (every replica runs
    it)."""
    if action in NOTHING_STOPS:
        return DegradePlan(NONE, reason=f"{action}: the job is not stopped")
    stop = DegradePlan(STOP_WORLD, width=0.0)
    if category not in REPLICA_FAULTS:
        return _why(stop, f"{category}: the job's state may be wrong on every replica; stop and restore")
    if action not in REPLICA_ACTIONS:
        return _why(stop, f"{action} acts on the whole job")
    if log_verdict == "user_code":
        return _why(stop, "the job's own code failed: every replica runs it; roll back the whole job")
    if level > 0:
        return _why(stop, f"failed again after a recovery (level {level}): the ladder climbs for the whole job")
    touched = replicas_of(topology, machines)
    if not touched:
        return _why(stop, "no machine of the job is named: nothing to take out alone")
    dp = topology.dp
    if dp - len(touched) < max(1, min_replicas):
        return _why(stop, f"the fault spans {len(touched)} of {dp} data-parallel replicas; the job may train on no "
                          f"fewer than {max(1, min_replicas)}")
    return DegradePlan(DEGRADE, replicas=touched, machines=replica_machines(topology, touched),
                       width=(dp - len(touched)) / dp,
                       reason=f"{category}: replica(s) {', '.join(map(str, touched))} of {dp} leave; "
                              f"{dp - len(touched)} train on")


def _why(p: DegradePlan, reason: str) -> DegradePlan:
    return DegradePlan(p.path, p.replicas, p.machines, p.width, reason)


def repeats(recovered: Iterable[int] | None, replicas: Iterable[int]) -> bool:
    """Whether a failure in ``replicas`` can repeat the last recovery, when that recovery healed ``recovered``
    replicas while the others trained on (None: it stopped the world, so any failure can). The others never
    stopped and were never restored: a failure among them is another failure, not that recovery failing to hold,
    and climbs no ladder."""
    return recovered is None or bool(set(recovered) & set(replicas))

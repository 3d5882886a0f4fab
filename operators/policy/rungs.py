"""The ladder's rungs as the branches of ``tg_incident``: one registry, from which the DAG generates its
branch tasks, the triage chooses the branch, and whoever reads a run (the tests, the benchmarks, the demo)
finds the rung that ran. Adding a rung is one line here and its function in
:data:`trainguard.operators.tasks.rungs.RUNG_ACTIONS` (a test checks both agree)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trainguard.operators.policy.ladder import Action


@dataclass(frozen=True)
class Rung:
    action: Action  # the ladder's decision it handles
    task_id: str  # its task in tg_incident
    does: str  # one line: what the task does (its doc in the UI)
    deferred: bool = False  # its wait runs in the triggerer (a deferrable operator), holding no worker slot


RUNGS: tuple[Rung, ...] = (
    Rung(Action.EVICT, "evict_now", "An explicit machine fault: stop the job and swap the named machines for "
                                    "standbys."),
    Rung(Action.RESTART, "restart_at_once", "A first crash: stop (logs read: a repeat offender evicted, user code "
                                            "rolled back) and restart in place at once; L1 of the crashed machine "
                                            "beside the restore, the stop-time diagnosis only if it fails."),
    Rung(Action.DIAGNOSE, "stop_time_diagnosis", "Stop the job and read its logs; then L1 -> L2 -> L3 and act on the "
                                                 "verdict (evict what failed, roll back, or restart in place)."),
    Rung(Action.ANALYZE, "runtime_analysis", "A hang: every rank's stack while it hangs; stop and over-evict the "
                                             "outliers' parallel group."),
    Rung(Action.VOTE, "slow_vote", "A throughput decline: vote over rounds of compute times while the job trains "
                                   "(the rounds in the triggerer); stop and evict the slow group, or nothing.",
         deferred=True),
    Rung(Action.REPLAY, "silent_corruption", "Peers disagree: stop; alignment test, then dual-phase replay (its "
                                             "groups watched in the triggerer); evict the machine that computes wrong.",
         deferred=True),
    Rung(Action.ROLLBACK, "roll_back", "The job's own code failed: stop and roll back to the last known-good "
                                       "revision."),
    Rung(Action.REATTEMPT, "no_culprit", "Nothing to blame: stop (a repeat offender is evicted) and restart in "
                                         "place."),
    Rung(Action.PROBE, "probe_machine", "A silent agent: reach its machine and run L1; evict it if unreachable or "
                                        "unhealthy, else restart the agent."),
)

# the branch for every decision that needs no recovery (tolerate, observe, wait for a human)
NO_RECOVERY = "no_recovery"
BRANCHES: dict[str, str] = {r.action.value: r.task_id for r in RUNGS}
TASK_IDS: tuple[str, ...] = tuple(r.task_id for r in RUNGS)


def branch(action: str) -> str:
    """The task that handles the ladder's ``action``."""
    return BRANCHES.get(str(action), NO_RECOVERY)


def run_id(incident_id: int, taken_over: str = "") -> str:
    """The id of the tg_incident run of an incident: one per incident (``incident__7``), and one more each
    time it is handed to a new run (``taken_over``: stronger alerts took a slow vote over, alerts that joined
    re-triaged it, the reconciler drove it again after its run failed)."""
    return f"incident__{int(incident_id)}" + (f"__{taken_over}" if taken_over else "")


def run_start(incident_id: int, job: str, run: str) -> dict[str, Any]:
    """What starts the tg_incident run ``run`` of an incident through the REST API (one item of
    :func:`trainguard.operators.tasks.guardian.start_runs`): its conf names the incident and its job."""
    return {"conf": {"incident_id": int(incident_id), "job": job, "first_seen_ts": None}, "trigger_run_id": run}

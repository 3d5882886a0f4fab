"""tg_incident: one incident, task by task. ``triage`` decides (the ladder) and branches to its rung; the
rung gathers its evidence and decides (what to evict, roll back, or restart as it is); ``stop_job`` stops
the job (unless the rung left it running, or stopped it itself for its evidence); ``swap_machines`` puts
standbys in the evicted machines' places; ``restart_job`` starts the job again on its machine list from
what the stop found; ``wait_for_resume`` waits, deferred in the triggerer, until training passed the
restored checkpoint; ``close_incident`` closes it (or escalates a restart that did not hold);
``rearm_job`` parks warm interpreters again beside the job for the next restart; ``outcome`` gives the run
its colour. Every task takes its input from XCom: clearing ``stop_job``, ``swap_machines``,
``restart_job`` or ``wait_for_resume`` in the UI does that again (an eviction done once is not done twice)."""

from __future__ import annotations

from datetime import datetime, timedelta

from airflow.sdk import Param, dag, task

from trainguard.operators.operators.close import CloseIncidentOperator
from trainguard.operators.operators.replay import SilentCorruptionOperator
from trainguard.operators.operators.vote import SlowVoteOperator
from trainguard.operators.policy.rungs import NO_RECOVERY, RUNGS
from trainguard.operators.sensors.resume import ResumeSensor

# A deferred task whose trigger fires before the executor reported the deferral's own end is failed by the
# scheduler (apache/airflow#66374, #71580); each of these is safe to try again (a wait defers again; the close
# resumes the watch of an escalation restart an earlier try made, instead of restarting the job once more)
RETRY_DEFERRED = {"retries": 2, "retry_delay": timedelta(seconds=2)}


# the rungs whose waits run in the triggerer (trainguard.operators.policy.rungs marks them deferred)
DEFERRED_RUNGS = {"slow_vote": SlowVoteOperator, "silent_corruption": SilentCorruptionOperator}


@dag(dag_id="tg_incident", is_paused_upon_creation=False,
     schedule=None, start_date=datetime(2026, 1, 1), catchup=False, max_active_runs=8,
     tags=["trainguard"], doc_md=__doc__,
     params={"incident_id": Param(1, type="integer", minimum=1),
             "resume_timeout_s": Param(None, type=["null", "number"], exclusiveMinimum=0,
                                       description="this run's limit on the wait for training to resume, "
                                                   "seconds; empty: TG_RESUME_TIMEOUT_S")})
def tg_incident():
    @task.branch
    def triage(params: dict | None = None) -> str:
        """The decision (XCom ``decision``), and the rung that handles it (the branch to follow)."""
        from airflow.sdk import get_current_context

        from trainguard.operators.hooks.fleet import task_controller
        from trainguard.operators.tasks import incident

        decision = incident.triage(task_controller(), params["incident_id"])
        get_current_context()["ti"].xcom_push(key="decision", value=decision)
        return incident.choose(decision)

    def rung_task(rung):
        if rung.deferred:  # its waits run in the triggerer
            operator = DEFERRED_RUNGS[rung.task_id]
            return lambda decision: operator(task_id=rung.task_id, doc_md=rung.does, decision=decision,
                                             **RETRY_DEFERRED).output

        @task(task_id=rung.task_id, doc_md=rung.does)
        def act(decision: dict) -> dict:
            from trainguard.operators.hooks.fleet import task_controller
            from trainguard.operators.tasks import rungs

            return rungs.handle(task_controller(), rung.task_id, decision)

        return act

    @task(trigger_rule="none_failed_min_one_success")
    def stop_job(results: list, params: dict | None = None) -> dict:
        """Stop the job on every machine, reading the steps finished and the checkpoint copies held (unless
        the rung leaves it running or stopped it already)."""
        from trainguard.operators.hooks.fleet import task_controller
        from trainguard.operators.tasks import incident

        return incident.stop_job(task_controller(), params["incident_id"], list(results))

    @task(trigger_rule="none_failed_min_one_success")  # (the rungs not taken are skipped)
    def swap_machines(results: list, stop: dict, params: dict | None = None) -> dict:
        """Put standbys in the places of the machines the rung evicts (and of explicit faults that joined)."""
        from trainguard.operators.hooks.fleet import task_controller
        from trainguard.operators.tasks import incident

        return incident.swap_machines(task_controller(), params["incident_id"], list(results), stop)

    @task(trigger_rule="none_failed_min_one_success")
    def restart_job(results: list, stop: dict, swap: dict, params: dict | None = None) -> dict:
        """Start the job again on its machine list, from what the stop found (or leave it alone when the
        rung says so); cleared after it ran, it restarts the job again."""
        from trainguard.operators.hooks.fleet import task_controller
        from trainguard.operators.tasks import incident

        return incident.restart_job(task_controller(), params["incident_id"], list(results), stop, swap,
                                    resume_timeout_s=params.get("resume_timeout_s"))

    @task(trigger_rule="all_done")
    def rearm_job(params: dict | None = None) -> dict:
        from trainguard.operators.hooks.fleet import task_controller
        from trainguard.operators.tasks import incident

        return incident.rearm(task_controller(), params["incident_id"])

    @task(trigger_rule="all_done")
    def outcome(params: dict | None = None) -> dict:
        from trainguard.operators.hooks.fleet import task_controller
        from trainguard.operators.tasks import incident

        return incident.outcome(task_controller(), params["incident_id"])

    @task(task_id=NO_RECOVERY)
    def no_recovery(decision: dict) -> dict:
        from trainguard.operators.hooks.fleet import task_controller
        from trainguard.operators.tasks import incident

        return incident.no_recovery(task_controller(), decision)

    branch = triage()  # one task for the triage and the branch: a task hop less before every rung
    decision = branch["decision"]
    acted = [rung_task(r)(decision) for r in RUNGS]
    branch >> acted
    idle = no_recovery(decision)
    branch >> idle
    stopped = stop_job(acted)
    swapped = swap_machines(acted, stopped)
    recovery = restart_job(acted, stopped, swapped)
    # the resume limit is TG_RESUME_TIMEOUT_S, applied by the check (it answers "failed" past it)
    resume = ResumeSensor(task_id="wait_for_resume", incident_id="{{ params.incident_id }}", recovery=recovery,
                          **RETRY_DEFERRED)
    # what no_recovery says stands for the decision here: a task downstream of the branch would be skipped
    # closes the incident; a recovery that did not hold climbs, its restarts' resume waits in the triggerer
    done = CloseIncidentOperator(task_id="close_incident", trigger_rule="all_done",
                                 incident_id="{{ params.incident_id }}", decision=idle, recovery=recovery,
                                 resume=resume.output, **RETRY_DEFERRED)
    # after the incident closed: the next restart starts warm everywhere; then the run ends failed if the
    # incident did
    done >> rearm_job() >> outcome()


tg_incident()

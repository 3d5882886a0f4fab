"""tg_incident: one incident, task by task. Airflow starts a run for each batch of alerts the watcher of the
``trainguard-alerts`` asset emits; ``triage`` records the batch (alerts into incidents), takes the incident it opened
as the run's own, decides (the ladder) and branches to its rung (a batch that only joined an open incident ends the
run there). A run started for an incident (its ``incident_id``: handed on, driven again, by hand) triages that one.
The rung gathers its evidence and decides (what to evict, roll back, or restart as it is); ``stop_job`` stops the job
(unless the rung left it running, or stopped it itself for its evidence); ``swap_machines`` puts standbys in the
evicted machines' places; ``restart_job`` starts the job again on its machine list from what the stop found;
``wait_for_resume`` waits, deferred in the triggerer, until training passed the restored checkpoint;
``close_incident`` closes it (or escalates a restart that did not hold); ``rearm_job`` parks warm interpreters again
beside the job for the next restart; ``outcome`` gives the run its colour. Every task takes its input from XCom:
clearing ``stop_job``, ``swap_machines``, ``restart_job`` or ``wait_for_resume`` in the UI does that again (an
eviction done once is not done twice)."""

from __future__ import annotations

from datetime import datetime, timedelta

from airflow.sdk import Asset, AssetWatcher, Param, dag, task

from trainguard.operators.operators.close import CloseIncidentOperator
from trainguard.operators.operators.replay import SilentCorruptionOperator
from trainguard.operators.operators.triage import TriageOperator
from trainguard.operators.operators.vote import SlowVoteOperator
from trainguard.operators.policy.rungs import NO_RECOVERY, RUNGS
from trainguard.operators.sensors.resume import ResumeSensor
from trainguard.operators.triggers.alerts import ALERTS_ASSET, AlertTrigger

# A deferred task whose trigger fires before the executor reported the deferral's own end is failed by the
# scheduler (apache/airflow#66374, #71580); each of these is safe to try again (a wait defers again; the close
# resumes the watch of an escalation restart an earlier try made, instead of restarting the job once more)
RETRY_DEFERRED = {"retries": 2, "retry_delay": timedelta(seconds=2)}

# the rungs whose waits run in the triggerer (trainguard.operators.policy.rungs marks them deferred)
DEFERRED_RUNGS = {"slow_vote": SlowVoteOperator, "silent_corruption": SilentCorruptionOperator}

# the alert bus, watched from the triggerer (settle window TG_ALERT_SETTLE_S, 1 s): each batch an asset event
alerts = Asset(ALERTS_ASSET, watchers=[AssetWatcher(name="alert_bus", trigger=AlertTrigger())])

INCIDENT = "{{ ti.xcom_pull(task_ids='triage', key='incident') }}"


@dag(dag_id="tg_incident", is_paused_upon_creation=False,
     schedule=[alerts], start_date=datetime(2026, 1, 1), catchup=False, max_active_runs=32,
     tags=["trainguard"], doc_md=__doc__,
     params={"incident_id": Param(None, type=["null", "integer"], minimum=1,
                                  description="the incident to handle; empty: the alerts that started the run"),
             "resume_timeout_s": Param(None, type=["null", "number"], exclusiveMinimum=0,
                                       description="this run's limit on the wait for training to resume, "
                                                   "seconds; empty: TG_RESUME_TIMEOUT_S")})
def tg_incident():
    # one task for the recording, the triage and the branch: a task hop less before every rung
    branch = TriageOperator(task_id="triage", retries=3, retry_delay=timedelta(seconds=1))
    incident = branch.output["incident"]
    decision = branch.output["decision"]

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
    def stop_job(results: list, incident: int) -> dict:
        """Stop the job on every machine, reading the steps finished and the checkpoint copies held (unless
        the rung leaves it running or stopped it already)."""
        from trainguard.operators.hooks.fleet import task_controller
        from trainguard.operators.tasks import incident as steps

        return steps.stop_job(task_controller(), incident, list(results))

    @task(trigger_rule="none_failed_min_one_success")  # (the rungs not taken are skipped)
    def swap_machines(results: list, stop: dict, incident: int) -> dict:
        """Put standbys in the places of the machines the rung evicts (and of explicit faults that joined)."""
        from trainguard.operators.hooks.fleet import task_controller
        from trainguard.operators.tasks import incident as steps

        return steps.swap_machines(task_controller(), incident, list(results), stop)

    @task(trigger_rule="none_failed_min_one_success")
    def restart_job(results: list, stop: dict, swap: dict, incident: int, params: dict | None = None) -> dict:
        """Start the job again on its machine list, from what the stop found (or leave it alone when the
        rung says so); cleared after it ran, it restarts the job again."""
        from trainguard.operators.hooks.fleet import task_controller
        from trainguard.operators.tasks import incident as steps

        return steps.restart_job(task_controller(), incident, list(results), stop, swap,
                                 resume_timeout_s=params.get("resume_timeout_s"))

    @task(trigger_rule="all_done")
    def rearm_job(incident: int) -> dict:
        from trainguard.operators.hooks.fleet import task_controller
        from trainguard.operators.tasks import incident as steps

        return steps.rearm(task_controller(), incident)

    @task(trigger_rule="all_done")
    def outcome(incident: int) -> dict:
        from trainguard.operators.hooks.fleet import task_controller
        from trainguard.operators.tasks import incident as steps

        return steps.outcome(task_controller(), incident)

    @task(task_id=NO_RECOVERY)
    def no_recovery(decision: dict) -> dict:
        from trainguard.operators.hooks.fleet import task_controller
        from trainguard.operators.tasks import incident as steps

        return steps.no_recovery(task_controller(), decision)

    acted = [rung_task(r)(decision) for r in RUNGS]
    branch >> acted
    idle = no_recovery(decision)
    branch >> idle
    stopped = stop_job(acted, incident)
    swapped = swap_machines(acted, stopped, incident)
    recovery = restart_job(acted, stopped, swapped, incident)
    # the resume limit is TG_RESUME_TIMEOUT_S, applied by the check (it answers "failed" past it)
    resume = ResumeSensor(task_id="wait_for_resume", incident_id=INCIDENT, recovery=recovery, **RETRY_DEFERRED)
    # what no_recovery says stands for the decision here: a task downstream of the branch would be skipped
    # closes the incident; a recovery that did not hold climbs, its restarts' resume waits in the triggerer
    done = CloseIncidentOperator(task_id="close_incident", trigger_rule="all_done", incident_id=INCIDENT,
                                 decision=idle, recovery=recovery, resume=resume.output, **RETRY_DEFERRED)
    # after the incident closed: the next restart starts warm everywhere; then the run ends failed if the
    # incident did
    done >> rearm_job(incident) >> outcome(incident)


tg_incident()

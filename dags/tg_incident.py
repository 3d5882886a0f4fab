"""tg_incident: triage one incident and climb the ladder (evict / diagnose / analyse / roll back), then
recover (in the rung's own task, right after its action): standbys in, job restarted, newest committed
checkpoint restored, training seen past it; after the incident closes, warm interpreters are parked
again beside the job for the next restart."""

from __future__ import annotations

from datetime import datetime

from airflow.sdk import Param, dag, task

HANDLERS = ["evict_now", "stop_time_diagnosis", "runtime_analysis", "slow_vote", "silent_corruption", "roll_back",
            "no_culprit", "probe_machine"]


@dag(dag_id="tg_incident", schedule=None, start_date=datetime(2026, 1, 1), catchup=False, max_active_runs=8,
     tags=["trainguard"], doc_md=__doc__, params={"incident_id": Param(1, type="integer", minimum=1)})
def tg_incident():
    @task.branch
    def triage(params: dict | None = None) -> str:
        """The decision (XCom ``decision``), and the rung that handles it (the branch to follow)."""
        from airflow.sdk import get_current_context

        from operators.airflow import steps

        decision = steps.triage(params["incident_id"])
        get_current_context()["ti"].xcom_push(key="decision", value=decision)
        return steps.choose(decision)

    def handler(name: str):
        @task(task_id=name)
        def run(decision: dict) -> dict:
            from operators.airflow import steps

            return steps.handle(name, decision)

        return run

    @task(trigger_rule="none_failed_min_one_success")
    def recover(results: list, params: dict | None = None) -> dict:
        """The restart: the handler restarted the job as soon as it acted; this passes its result on (or
        restarts, when the handler's result asks for it and holds none)."""
        from operators.airflow import steps

        return steps.recover(params["incident_id"], list(results))

    # the resume limit is TG_RESUME_TIMEOUT_S, applied by the task body (it answers "failed" past it); this
    # timeout only guards against a body that never answers
    @task.sensor(poke_interval=2, timeout=3600, mode="poke")
    def training_resumed(recovery: dict, params: dict | None = None):
        from airflow.sdk import PokeReturnValue

        from operators.airflow import steps

        info = steps.resumed(params["incident_id"], recovery)
        return PokeReturnValue(is_done=info is not None, xcom_value=info)

    @task(trigger_rule="all_done")
    def close(decision: dict | None = None, recovery: dict | None = None, resume: dict | None = None,
              params: dict | None = None) -> dict:
        from operators.airflow import steps

        return steps.close(params["incident_id"], decision, recovery, resume)

    @task(trigger_rule="all_done")
    def rearm(params: dict | None = None) -> dict:
        from operators.airflow import steps

        return steps.rearm(params["incident_id"])

    @task(trigger_rule="all_done")
    def outcome(params: dict | None = None) -> dict:
        from operators.airflow import steps

        return steps.outcome(params["incident_id"])

    @task
    def no_recovery(decision: dict) -> dict:
        from operators.airflow import steps

        return steps.no_recovery(decision)

    branch = triage()  # one task for the triage and the branch: a task hop less before every rung
    decision = branch["decision"]
    handled = [handler(name)(decision) for name in HANDLERS]
    branch >> handled
    idle = no_recovery(decision)
    branch >> idle
    recovery = recover(handled)
    resume = training_resumed(recovery)
    # what no_recovery says stands for the decision here: a task downstream of the branch would be skipped
    done = close(idle, recovery, resume)
    # after the incident closed: the next restart starts warm everywhere; then the run ends failed if the
    # incident did
    done >> rearm() >> outcome()


tg_incident()

"""tg_code_update: code revisions of a job, by hand from the UI (job, revision, urgency, reason) and hourly.

* urgent: a hot update now: the job stops, every machine switches to the revision and restarts in place
  (same machines, on their warm interpreters), restores its newest committed checkpoint; the run waits
  until training passes it, then parks warm interpreters again.
* lazy: the revision waits for the next restart the ladder makes anyway (the job keeps training); it is
  forced by a hot update after ``TG_LAZY_FORCE_S`` (24 h by default).
* rollback: back to the last known-good revision (or the one named, if it is known good).

A revision must be recorded first (``trainguard revision add``). Scheduled runs (no job) force overdue
lazy updates and mark a job's revision known-good after ``TG_KNOWN_GOOD_STEPS`` healthy steps on it
(``TG_CODE_UPDATE_SCHEDULE``: the schedule; empty for by hand only)."""

from __future__ import annotations

from datetime import datetime

from airflow.sdk import Param, dag, task

from trainguard.operators.sensors.resume import CodeResumeSensor
from trainguard.operators.utils.schedules import schedule_from_env

NAME = r"^([A-Za-z0-9][A-Za-z0-9_.-]{0,62})?$"


@dag(dag_id="tg_code_update", is_paused_upon_creation=False,
     schedule=schedule_from_env("TG_CODE_UPDATE_SCHEDULE", "@hourly"),
     start_date=datetime(2026, 1, 1), catchup=False,
     max_active_runs=1, tags=["trainguard"], doc_md=__doc__, params={
         "job": Param("", type="string", pattern=NAME, description="the job; empty = the hourly sweep"),
         "revision": Param("", type="string", pattern=r"^([A-Za-z0-9][A-Za-z0-9_.+-]{0,127})?$",
                           description="a recorded revision (empty with rollback: the last known-good one)"),
         "urgency": Param("lazy", type="string", enum=["urgent", "lazy", "rollback"],
                          description="urgent: hot update now; lazy: at the next restart; rollback"),
         "reason": Param("", type="string", maxLength=500, description="why, for the audit trail"),
     })
def tg_code_update():
    @task
    def update(params: dict | None = None) -> dict:
        from trainguard.operators.hooks.fleet import task_controller
        from trainguard.operators.tasks import code_update

        return code_update.code_update(task_controller(), params["job"], params["revision"], params["urgency"],
                                       params["reason"])

    @task(trigger_rule="all_done")
    def rearm(result: dict | None = None) -> dict:
        from trainguard.operators.hooks.fleet import task_controller
        from trainguard.operators.tasks import code_update

        return code_update.code_rearm(task_controller(), result or {})

    @task
    def conclude(result: dict, resumed: dict | None = None) -> dict:
        from trainguard.operators.hooks.fleet import task_controller
        from trainguard.operators.tasks import code_update

        return code_update.code_conclude(task_controller(), result, resumed)

    result = update()
    # deferred: no worker slot is held while the restarted jobs come back
    resumed = CodeResumeSensor(task_id="training_resumed", update=result)
    rearmed = rearm(result)
    resumed >> rearmed
    rearmed >> conclude(result, resumed.output)  # last: the run fails when the update or its resume did


tg_code_update()

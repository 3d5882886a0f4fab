"""tg_job_launch: a job put under guard. ``trainguard job submit SPEC`` starts a run with the spec; the form
starts one by hand (it offers the free machines). The run validates the spec, reserves its machines (a count
taken from the free, checked standbys, or the machines named), checks them (L1), starts the job on them and
waits for its first step; from then on the job is on the Fleet page and every recovery restarts the spec's own
command. A step that fails releases the machines."""

from __future__ import annotations

from datetime import datetime

from airflow.sdk import Param, dag, task

from trainguard.operators.utils.forms import NAME, free_machines

FIRST_STEP_TIMEOUT_S = 900.0


@dag(dag_id="tg_job_launch", is_paused_upon_creation=False,
     schedule=None, start_date=datetime(2026, 1, 1), catchup=False, tags=["trainguard"],
     doc_md=__doc__, params={
         "name": Param("", type="string", pattern=f"({NAME})|^$", description="the job's name"),
         "command": Param("", type="string",
                          description="the training script and its arguments (or -m package.module ...)"),
         # a field the form may leave empty is typed with "null" (Airflow's form requires the others)
         "machines": Param(None, type=["null", "array"], items={"type": "string", "pattern": NAME},
                           examples=free_machines(), description="machines in node-rank order (free ones listed); "
                                                                 "empty: take 'count' free machines"),
         "count": Param(0, type="integer", minimum=0, description="free machines to take when none is named"),
         "processes_per_machine": Param(1, type="integer", minimum=1, description="ranks per machine"),
         "workdir": Param(None, type=["null", "string"], description="where the command runs on every machine"),
         "checkpoint": Param(None, type=["null", "string"],
                             description="checkpoint root or s3:// URL (TG_CHECKPOINT)"),
         "env": Param(None, type=["null", "object"], description="environment variables for every rank"),
         "revision": Param("r0", type="string", description="the code revision"),
         "spec": Param(None, type=["null", "object"],
                       description="a whole job spec (what 'trainguard job submit' sends); the fields above are "
                                   "ignored when it is given"),
     })
def tg_job_launch():
    @task
    def validate(params: dict | None = None) -> dict:
        from trainguard.operators.tasks import launch

        return launch.validate(dict(params or {}))

    @task
    def reserve(spec: dict) -> dict:
        from trainguard.operators.hooks.fleet import task_controller
        from trainguard.operators.tasks import launch

        return launch.reserve(task_controller(), spec)

    @task(pool="tg_ssh")
    def check_machines(reserved: dict) -> dict:
        from trainguard.operators.hooks.fleet import task_controller
        from trainguard.operators.tasks import launch

        return launch.check(task_controller(), reserved)

    @task(pool="tg_ssh")
    def start_job(checked: dict) -> dict:
        from trainguard.operators.hooks.fleet import task_controller
        from trainguard.operators.tasks import launch

        return launch.start(task_controller(), checked)

    @task
    def first_step(started: dict) -> dict:
        from trainguard.operators.hooks.fleet import task_controller
        from trainguard.operators.tasks import launch

        return launch.first_step(task_controller(), started, FIRST_STEP_TIMEOUT_S)

    @task(pool="tg_ssh")
    def arm_job(trains: dict) -> dict:
        from trainguard.operators.hooks.fleet import task_controller
        from trainguard.operators.tasks import launch

        return launch.arm(task_controller(), trains)

    arm_job(first_step(start_job(check_machines(reserve(validate())))))


tg_job_launch()

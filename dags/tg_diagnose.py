"""tg_diagnose: the stop-time diagnosis hierarchy on chosen machines, by hand from the UI. Each machine is
one mapped task (L1 quick health, then L2 compute + memory + intra-machine collective; past Airflow's
``max_map_length`` machines go in batches, one after another in a task), run in the ``tg_ssh`` pool that
caps concurrent SSH sessions; L3 (collectives with neighbours, in pairs) follows on
the machines that passed. With "evict", machines that fail are replaced by standbys, the job restarts on
its new machine list, and an incident records it."""

from __future__ import annotations

from datetime import datetime

from airflow.sdk import Param, dag, task

from trainguard.operators.utils.forms import NAME, job_param


@dag(dag_id="tg_diagnose", is_paused_upon_creation=False,
     schedule=None, start_date=datetime(2026, 1, 1), catchup=False, tags=["trainguard"],
     doc_md=__doc__, params={
         "job": job_param("the job whose machines are diagnosed"),
         "machines": Param([], type="array", items={"type": "string", "pattern": NAME},
                           description="machine names; empty = every machine of the job"),
         "level": Param(2, type="integer", enum=[1, 2, 3], description="run levels 1 .. this"),
         "evict": Param(False, type="boolean", description="replace machines that fail with standbys"),
     })
def tg_diagnose():
    @task
    def targets(params: dict | None = None) -> list:
        from trainguard.operators.hooks.fleet import task_controller
        from trainguard.operators.tasks import diagnose

        return diagnose.diagnose_targets(task_controller(), params["job"], list(params["machines"]),
                                         int(params["level"]))

    @task(pool="tg_ssh", map_index_template="{{ machine }}")
    def check_machine(target: dict) -> list:
        from trainguard.operators.hooks.fleet import task_controller
        from trainguard.operators.tasks import diagnose

        return diagnose.diagnose_machine(task_controller(), target)

    @task(pool="tg_ssh")
    def neighbours(results: list, params: dict | None = None) -> dict:
        from trainguard.operators.hooks.fleet import task_controller
        from trainguard.operators.tasks import diagnose

        return diagnose.diagnose_neighbours(task_controller(), params["job"], list(results), int(params["level"]))

    @task
    def conclude(results: list, l3: dict, params: dict | None = None) -> dict:
        from trainguard.operators.hooks.fleet import task_controller
        from trainguard.operators.tasks import diagnose

        return diagnose.diagnose_conclude(task_controller(), params["job"], list(results), l3, bool(params["evict"]))

    checked = check_machine.expand(target=targets())
    conclude(checked, neighbours(checked))


tg_diagnose()

"""tg_standby_pool: keeps the warm standby pool at its target, every 10 minutes (``TG_POOL_SCHEDULE``)
and by hand. The target is the P99 of Binomial(machines serving jobs, p), p the per-machine daily failure
rate from the fleet's history (with a prior while it is short), or a number given in the form. Free
inventory machines fill the shortfall; each new machine, and each standby idle past its re-check age,
runs the self-check (L1 + L2) as one mapped task in the ``tg_ssh`` pool (in batches past Airflow's
``max_map_length``); healthy ones are parked warm as
standbys, failures go to repair, and machines evicted too often are retired."""

from __future__ import annotations

from datetime import datetime

from airflow.sdk import Param, dag, task

from trainguard.operators.utils.schedules import schedule_from_env


@dag(dag_id="tg_standby_pool", is_paused_upon_creation=False,
     schedule=schedule_from_env("TG_POOL_SCHEDULE", "*/10 * * * *"),
     start_date=datetime(2026, 1, 1), catchup=False,
     max_active_runs=1, tags=["trainguard"], doc_md=__doc__, params={
         "target": Param(-1, type="integer", minimum=-1,
                         description="standbys to keep; -1 = computed from the fleet's failure history"),
     })
def tg_standby_pool():
    @task
    def plan(params: dict | None = None) -> dict:
        from trainguard.operators.hooks.fleet import task_controller
        from trainguard.operators.tasks import standby_pool

        return standby_pool.pool_plan(task_controller(), int(params["target"]))

    @task
    def machines(planned: dict) -> list:
        return planned["targets"]

    @task(pool="tg_ssh", map_index_template="{{ machine }}")
    def self_check(target: list) -> list:
        from trainguard.operators.hooks.fleet import task_controller
        from trainguard.operators.tasks import standby_pool

        return standby_pool.pool_check(task_controller(), target)

    @task(trigger_rule="none_failed")
    def conclude(planned: dict, results: list | None = None) -> dict:
        from trainguard.operators.tasks import standby_pool

        return standby_pool.pool_conclude(planned, results)

    planned = plan()
    conclude(planned, self_check.expand(target=machines(planned)))


tg_standby_pool()

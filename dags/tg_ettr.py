"""tg_ettr: the effective training time ratio of every job (or the one named), hourly and by hand:
cumulative and over a trailing window, and each closed incident's time split into detection,
diagnosis, recovery and lost work (steps recomputed after a restore), summed by failure cause. The
report is the task's return value (XCom), readable in the UI."""

from __future__ import annotations

from datetime import datetime

from airflow.sdk import Param, dag, task


@dag(dag_id="tg_ettr", is_paused_upon_creation=False,
     schedule="@hourly", start_date=datetime(2026, 1, 1), catchup=False, max_active_runs=1,
     tags=["trainguard"], doc_md=__doc__, params={
         "job": Param("", type="string", pattern=r"^([A-Za-z0-9][A-Za-z0-9_.-]{0,62})?$",
                      description="the job; empty = every job in the fleet database"),
         "window_s": Param(3600, type="number", exclusiveMinimum=0, description="the sliding window, seconds"),
     })
def tg_ettr():
    @task
    def report(params: dict | None = None) -> dict:
        from trainguard.operators.hooks.fleet import task_controller
        from trainguard.operators.tasks import ettr

        return ettr.ettr_reports(task_controller(), params["job"], float(params["window_s"]))

    report()


tg_ettr()

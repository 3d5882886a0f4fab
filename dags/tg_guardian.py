"""tg_guardian: waits (deferred, in the triggerer) for alerts, groups each batch into incidents per job,
and starts one tg_incident run per newly opened incident. Continuous, one active run."""

from __future__ import annotations

from datetime import datetime, timedelta

from airflow.providers.standard.operators.trigger_dagrun import TriggerDagRunOperator
from airflow.sdk import dag, task

from operators.airflow.alerts import AlertSensor


@dag(dag_id="tg_guardian", schedule="@continuous", max_active_runs=1, start_date=datetime(2026, 1, 1),
     catchup=False, tags=["trainguard"], doc_md=__doc__)
def tg_guardian():
    # settle window: TG_ALERT_SETTLE_S (3 s)
    batch = AlertSensor(task_id="wait_for_alerts", retries=3, retry_delay=timedelta(seconds=1))

    @task
    def group_into_incidents(event: dict) -> list[dict]:
        from operators.airflow import steps

        return steps.group_alerts(event)

    opened = group_into_incidents(batch.output)  # records the batch, then commits the bus cursor
    TriggerDagRunOperator.partial(task_id="start_incident", trigger_dag_id="tg_incident").expand(conf=opened)


tg_guardian()

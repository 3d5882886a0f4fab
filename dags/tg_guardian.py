"""tg_guardian: waits (deferred, in the triggerer) for alerts, groups each batch into incidents per job as
it resumes, and starts one tg_incident run per newly opened incident. Continuous, one active run."""

from __future__ import annotations

from datetime import datetime, timedelta

from airflow.providers.standard.operators.trigger_dagrun import TriggerDagRunOperator
from airflow.sdk import dag

from operators.sensors.alerts import IncidentSensor


@dag(dag_id="tg_guardian", schedule="@continuous", max_active_runs=1, start_date=datetime(2026, 1, 1),
     catchup=False, tags=["trainguard"], doc_md=__doc__)
def tg_guardian():
    # settle window: TG_ALERT_SETTLE_S (3 s); the batch is recorded (incidents, then the bus cursor) as the
    # sensor resumes, and it returns the incidents to start
    opened = IncidentSensor(task_id="wait_for_alerts", retries=3, retry_delay=timedelta(seconds=1))
    TriggerDagRunOperator.partial(task_id="start_incident", trigger_dag_id="tg_incident").expand(conf=opened.output)


tg_guardian()

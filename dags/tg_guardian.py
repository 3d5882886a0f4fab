"""tg_guardian: waits (deferred, in the triggerer) for alerts; the trigger groups each batch into incidents
per job and starts one tg_incident run per newly opened incident (the tasks do what it could not).
Continuous, one active run: one run per batch, its note and log the batch's audit trail."""

from __future__ import annotations

from datetime import datetime, timedelta

from airflow.providers.standard.operators.trigger_dagrun import TriggerDagRunOperator
from airflow.sdk import dag

from trainguard.operators.sensors.alerts import IncidentSensor


@dag(dag_id="tg_guardian", is_paused_upon_creation=False,
     schedule="@continuous", max_active_runs=1, start_date=datetime(2026, 1, 1),
     catchup=False, tags=["trainguard"], doc_md=__doc__)
def tg_guardian():
    # settle window: TG_ALERT_SETTLE_S (1 s); the trigger records the batch (incidents and the bus cursor in one
    # transaction) and starts the incidents' runs; the sensor returns them, and start_incident starts any the
    # trigger could not (a run's id names its incident: one that exists is skipped)
    opened = IncidentSensor(task_id="wait_for_alerts", retries=3, retry_delay=timedelta(seconds=1))
    TriggerDagRunOperator.partial(task_id="start_incident", trigger_dag_id="tg_incident",
                                  skip_when_already_exists=True).expand_kwargs(opened.output)


tg_guardian()

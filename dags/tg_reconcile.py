"""tg_reconcile: the level-triggered look behind the incidents. Its sensor waits, deferred in the triggerer,
while the reconciler looks every ``TG_RECONCILE_PERIOD_S`` (10 s) at every job the fleet database calls running:
its processes on every machine, its steps advancing, explicit faults left on its machines, silent agents, and
open incidents without a live run. A difference no incident handles fires it; ``act`` opens an incident for it
(through the same ladder as an alert) or starts the stuck incident's next run. Continuous, one active run: each
run's note says what was found and done."""

from __future__ import annotations

from datetime import datetime, timedelta

from airflow.sdk import dag, task

from trainguard.operators.sensors.reconcile import ReconcileSensor


@dag(dag_id="tg_reconcile", is_paused_upon_creation=False,
     schedule="@continuous", max_active_runs=1, start_date=datetime(2026, 1, 1),
     catchup=False, tags=["trainguard"], doc_md=__doc__)
def tg_reconcile():
    found = ReconcileSensor(task_id="look", retries=3, retry_delay=timedelta(seconds=2))

    @task(retries=2, retry_delay=timedelta(seconds=5))
    def act(findings: list) -> dict:
        """Each finding: an incident opened through the ladder, or a stuck incident's next run."""
        from trainguard.operators.hooks.fleet import task_controller
        from trainguard.operators.tasks import reconcile

        return reconcile.act(task_controller(), findings)

    act(found.output)


tg_reconcile()

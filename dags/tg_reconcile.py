"""tg_reconcile: the level-triggered look behind the incidents. The watcher of the ``trainguard-reconcile`` asset
looks, in the triggerer, every ``TG_RECONCILE_PERIOD_S`` (10 s) at every job the fleet database calls running: its
processes on every machine, its steps advancing, explicit faults left on its machines, silent agents, and open
incidents without a live run. Each difference no incident handles is an asset event, and Airflow starts a run for
it: ``act`` opens an incident for it (through the same ladder as an alert) or starts the stuck incident's next run.
Each run's note says what was found and done."""

from __future__ import annotations

from datetime import datetime, timedelta

from airflow.sdk import Asset, AssetWatcher, dag, task

from trainguard.operators.triggers.reconcile import RECONCILE_ASSET, ReconcileTrigger

reconcile_asset = Asset(RECONCILE_ASSET, watchers=[AssetWatcher(name="reconciler", trigger=ReconcileTrigger())])


@dag(dag_id="tg_reconcile", is_paused_upon_creation=False,
     schedule=[reconcile_asset], max_active_runs=1, start_date=datetime(2026, 1, 1),
     catchup=False, tags=["trainguard"], doc_md=__doc__)
def tg_reconcile():
    @task(retries=2, retry_delay=timedelta(seconds=5))
    def act(triggering_asset_events=None) -> dict:
        """Each finding: an incident opened through the ladder, or a stuck incident's next run."""
        from trainguard.operators.hooks.fleet import task_controller
        from trainguard.operators.tasks import reconcile

        return reconcile.act(task_controller(), reconcile.findings_of(triggering_asset_events))

    act()


tg_reconcile()

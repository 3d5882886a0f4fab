"""The reconciler's wait: ``ReconcileSensor`` defers to
:class:`trainguard.operators.triggers.reconcile.ReconcileTrigger` (no worker slot held between its looks) and
returns what the trigger found."""

from __future__ import annotations

from typing import Any

from airflow.sdk import BaseSensorOperator

from trainguard.operators.settings import ControlSettings
from trainguard.operators.triggers.reconcile import ReconcileTrigger


class ReconcileSensor(BaseSensorOperator):
    """Waits, deferred, until the reconciler's look finds a difference no incident handles; returns the findings
    (each a :class:`~trainguard.operators.policy.reconcile.Finding` as JSON). Its period is
    ``TG_RECONCILE_PERIOD_S`` (0: the reconciler is off and the sensor never fires)."""

    def execute(self, context: Any) -> Any:
        period = ControlSettings.from_env().reconcile_period_s
        self.defer(trigger=ReconcileTrigger(period_s=period), method_name="execute_complete")

    def execute_complete(self, context: Any, event: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        findings = list((event or {}).get("findings") or ())
        for f in findings:
            self.log.warning("reconciler: %s", f.get("reason"))
        return findings

"""Waiting for alerts without holding a worker: the deferrable ``AlertSensor`` (its trigger,
:class:`trainguard.operators.triggers.alerts.AlertTrigger`, runs in the triggerer) and ``IncidentSensor``, which records
the batch as it resumes and returns the incidents to start."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from airflow.sdk import BaseSensorOperator

from trainguard.operators.settings import ControlSettings
from trainguard.operators.triggers.alerts import DEFAULT_POLL_S, AlertTrigger


def settle_from_env(env: Any = None) -> float:
    """``TG_ALERT_SETTLE_S`` (default 1 s): how long a batch keeps collecting after its first alert."""
    return ControlSettings.from_env(env).alert_settle_s


def silent_from_env(env: Any = None) -> float:
    """``TG_AGENT_SILENT_S`` (default 15 s): an agent of a running job silent this long is an incident;
    0 switches the watch off."""
    return ControlSettings.from_env(env).agent_silent_s


class AlertSensor(BaseSensorOperator):
    """Waits (deferred, no worker slot held) until alerts arrive on the bus; returns the batch. Without
    ``bus_url``/``fleet_url``, the control plane's (see :func:`trainguard.operators.tasks.guardian.alert_source`)."""

    template_fields = ("bus_url", "fleet_url")
    record = False  # the trigger records the batch and starts the incidents' runs (IncidentSensor)

    def __init__(self, *, bus_url: str = "", fleet_url: str = "", settle_s: float | None = None,
                 poll_s: float = DEFAULT_POLL_S, kinds: Sequence[str] = (), max_wait: timedelta | None = None,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.bus_url = bus_url
        self.fleet_url = fleet_url
        self.settle_s = settle_s
        self.poll_s = poll_s
        self.kinds = list(kinds)
        self.max_wait = max_wait

    def execute(self, context: Any) -> Any:
        bus_url, fleet_url = self.bus_url, self.fleet_url
        if not bus_url or not fleet_url:  # the control plane's: the inventory's bus, the fleet database
            from trainguard.operators.tasks.guardian import alert_source

            default_bus, default_fleet = alert_source()
            bus_url, fleet_url = bus_url or default_bus, fleet_url or default_fleet
        settle_s = self.settle_s if self.settle_s is not None else settle_from_env()
        self.defer(trigger=AlertTrigger(bus_url, fleet_url, settle_s=settle_s, poll_s=self.poll_s, kinds=self.kinds,
                                        silent_s=silent_from_env(), record=self.record),
                   method_name="execute_complete", timeout=self.max_wait)

    def execute_complete(self, context: Any, event: dict[str, Any] | None = None) -> dict[str, Any]:
        if not event or not (event.get("alerts") or event.get("quarantined")):
            raise RuntimeError("the alert trigger fired without alerts or quarantined documents; nothing to "
                               "record (the next run reads the bus again)")
        if event.get("alerts"):
            self.log.info("%d alerts, first at %.3f: %s", len(event["alerts"]), event["alerts"][0]["ts"],
                          ", ".join(sorted({f"{a['machine']}:{a['kind']}" for a in event["alerts"]})))
        for q in event.get("quarantined") or ():
            self.log.warning("quarantined %s: %s", q.get("name"), q.get("reason"))
        return event


class IncidentSensor(AlertSensor):
    """An :class:`AlertSensor` for the guardian: its trigger records the batch (the alerts join incidents or
    open new ones, the bus cursor is committed) and starts each new incident's ``tg_incident`` run itself;
    as it resumes, the sensor returns what starts those runs (the ``start_incident`` task answers "exists"
    for each). When the trigger could not record the batch, the sensor does (a failure here fails the task
    before the cursor moves, so its retry reads the same alerts again)."""

    record = True

    def execute_complete(self, context: Any, event: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        from trainguard.operators.tasks import guardian

        if event and event.get("recorded"):
            self.log.info("%d alerts recorded in the triggerer (%s); runs: %s", event.get("alerts", 0),
                          ", ".join(event.get("kinds") or []), event.get("started"))
            for q in event.get("quarantined") or ():
                self.log.warning("quarantined %s: %s", q.get("name"), q.get("reason"))
            return list(event.get("starts") or [])
        batch = super().execute_complete(context, event)
        from trainguard.operators.hooks.fleet import task_controller

        return guardian.group_alerts(task_controller(), batch)

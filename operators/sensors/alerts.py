"""Waiting for alerts without holding a worker: the deferrable ``AlertSensor``, for tools and DAGs of their own (the
control plane itself watches the bus with an asset watcher: :class:`trainguard.operators.triggers.alerts.AlertTrigger`
on ``trainguard-alerts``, tg_incident's schedule). Its trigger only reads the bus; the sensor returns the batch and
records nothing."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from airflow.sdk import BaseSensorOperator

from trainguard.operators.settings import ControlSettings
from trainguard.operators.triggers.alerts import DEFAULT_POLL_S, AlertTrigger, alert_source


def settle_from_env(env: Any = None) -> float:
    """``TG_ALERT_SETTLE_S`` (default 1 s): how long a batch keeps collecting after its first alert."""
    return ControlSettings.from_env(env).alert_settle_s


def silent_from_env(env: Any = None) -> float:
    """``TG_AGENT_SILENT_S`` (default 15 s): an agent of a running job silent this long is an incident;
    0 switches the watch off."""
    return ControlSettings.from_env(env).agent_silent_s


class AlertSensor(BaseSensorOperator):
    """Waits (deferred, no worker slot held) until alerts arrive on the bus; returns the batch (its alerts, the names
    read, what was quarantined). Without ``bus_url``/``fleet_url``, the control plane's (see
    :func:`trainguard.operators.triggers.alerts.alert_source`). ``reader``: whose cursor it reads from (not the
    guardian's unless it records what it returns: nothing here moves a cursor)."""

    template_fields = ("bus_url", "fleet_url")

    def __init__(self, *, bus_url: str = "", fleet_url: str = "", reader: str = "alert-sensor",
                 settle_s: float | None = None, poll_s: float = DEFAULT_POLL_S, kinds: Sequence[str] = (),
                 max_wait: timedelta | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.bus_url = bus_url
        self.fleet_url = fleet_url
        self.reader = reader
        self.settle_s = settle_s
        self.poll_s = poll_s
        self.kinds = list(kinds)
        self.max_wait = max_wait

    def execute(self, context: Any) -> Any:
        bus_url, fleet_url = self.bus_url, self.fleet_url
        if not bus_url or not fleet_url:  # the control plane's: the inventory's bus, the fleet database
            default_bus, default_fleet = alert_source()
            bus_url, fleet_url = bus_url or default_bus, fleet_url or default_fleet
        settle_s = self.settle_s if self.settle_s is not None else settle_from_env()
        self.defer(trigger=AlertTrigger(bus_url, fleet_url, reader=self.reader, settle_s=settle_s, poll_s=self.poll_s,
                                        kinds=self.kinds, silent_s=silent_from_env(), once=True),
                   method_name="execute_complete", timeout=self.max_wait)

    def execute_complete(self, context: Any, event: dict[str, Any] | None = None) -> dict[str, Any]:
        if not event or not (event.get("alerts") or event.get("quarantined")):
            raise RuntimeError("the alert trigger fired without alerts or quarantined documents (the next run reads "
                               "the bus again)")
        if event.get("alerts"):
            self.log.info("%d alerts, first at %.3f: %s", len(event["alerts"]), event["alerts"][0]["ts"],
                          ", ".join(sorted({f"{a['machine']}:{a['kind']}" for a in event["alerts"]})))
        for q in event.get("quarantined") or ():
            self.log.warning("quarantined %s: %s", q.get("name"), q.get("reason"))
        return event

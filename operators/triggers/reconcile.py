"""The reconciler's look, in the triggerer: ``ReconcileTrigger``, the watcher of the ``trainguard-reconcile`` asset
(tg_reconcile's schedule: each event a set of findings, and Airflow starts a run whose ``act`` task acts on them).

Every ``TG_RECONCILE_PERIOD_S`` (10 s; 0: the reconciler is off) the watcher takes one pass
(:meth:`trainguard.operators.control.reconcile.Reconciliation.reconcile_pass`): the running jobs no incident handles
are looked at on their machines (one brief status round each), their machines' unhandled faults and silent agents are
read from the fleet database, and the open incidents are checked against the live tg_incident runs (the REST API's
list of queued and running runs). It changes nothing: it emits the findings, and writes its own beat into its asset's
state store (Airflow's: what ``trainguard status`` reads to say how old its last pass is). A pass that fails (the
fleet database restarting, the api-server away) is logged and the next one tries again. The same difference found
again before ``act`` recorded it is emitted again; acting on it twice changes nothing (each finding's alert id is
derived from what was observed).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseEventTrigger, TriggerEvent

from trainguard.operators.triggers import write_beat

RECONCILER = "reconciler"
INCIDENT_DAG = "tg_incident"
#: the asset whose events are the findings (tg_reconcile's schedule)
RECONCILE_ASSET = "trainguard-reconcile"
#: the guardian's view of the agents counts while its last beat is younger than this
GUARDIAN_STALE_S = 30.0


class ReconcileTrigger(BaseEventTrigger):
    """Emits ``{"findings": [...], "ts"}`` each pass that finds a difference no incident handles. ``period_s``:
    None, the setting's (``TG_RECONCILE_PERIOD_S``, read where the trigger runs); 0, it never looks."""

    def __init__(self, period_s: float | None = None) -> None:
        super().__init__()
        self.period_s = None if period_s is None else float(period_s)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return f"{type(self).__module__}.{type(self).__qualname__}", {"period_s": self.period_s}

    def _period(self) -> float:
        if self.period_s is not None:
            return self.period_s
        from trainguard.operators.settings import ControlSettings

        return ControlSettings.from_env().reconcile_period_s

    async def run(self) -> AsyncIterator[TriggerEvent]:
        period = await asyncio.to_thread(self._period)
        memory: dict[str, Any] = {}
        passes = 0
        while period <= 0:  # the reconciler is off (TG_RECONCILE_PERIOD_S=0): never emits
            await asyncio.sleep(3600)
        while True:
            began = time.monotonic()
            passes += 1
            try:
                findings, beat = await asyncio.to_thread(self._pass, memory, passes, period)
            except Exception as exc:  # the fleet database restarting, a machine's answer garbled: look again
                self.log.warning("reconciler pass %d failed (the next one tries again): %s", passes, exc)
                findings, beat = [], None
            if beat is not None:
                await write_beat(self, beat)
            if findings:
                self.log.info("reconciler pass %d found: %s", passes, "; ".join(f["reason"] for f in findings))
                yield TriggerEvent({"findings": findings, "ts": time.time()})
            await asyncio.sleep(max(0.5, period - (time.monotonic() - began)))

    def _pass(self, memory: dict[str, Any], passes: int, period: float) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        from trainguard.operators.tasks import common

        c = common.shared_controller()
        began = time.monotonic()
        live = self._live_runs()
        # the agents the guardian finds silent now (machine -> since when), while the guardian itself is alive
        guardian = self._guardian_seen(c)
        silent = {} if guardian is None or time.time() - guardian > GUARDIAN_STALE_S else {
            m: a.changed_ts for m, a in c.fleet.liveness().items() if a.reported_ts is not None}
        found = c.reconciliation.reconcile_pass(memory, live_runs=live, silent=silent)
        beat = {"ts": time.time(), "passes": passes, "period_s": period, "pid": os.getpid(),
                "pass_s": round(time.monotonic() - began, 3), "runs_known": live is not None, "found": len(found)}
        return [f.dump() for f in found], beat


    def _guardian_seen(self, c: Any) -> float | None:
        """When the alert watcher last said it watches (its beat in Airflow's asset state store; without the REST
        API, the last batch a task recorded)."""
        from trainguard.operators.triggers.alerts import ALERTS_ASSET, triggerer_api

        try:
            beat = triggerer_api().watcher_beat(ALERTS_ASSET)
            if beat and isinstance(beat.get("ts"), (int, float)):
                return float(beat["ts"])
        except Exception as exc:  # no connection, the api-server away
            self.log.info("the alert watcher's beat is unknown this pass: %s", exc)
        component = c.fleet.components().get("guardian")
        return None if component is None else float(component.seen_ts)

    def _live_runs(self) -> list[str] | None:
        """The tg_incident runs queued or running, or None when the REST API does not answer."""
        from trainguard.operators.triggers.alerts import triggerer_api

        try:
            return triggerer_api().live_runs(INCIDENT_DAG)
        except Exception as exc:  # no connection, the api-server away: the stuck-incident check waits
            self.log.info("live runs unknown this pass: %s", exc)
            return None

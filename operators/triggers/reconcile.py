"""The reconciler's look, in the triggerer: ``ReconcileTrigger`` (its deferrable sensor:
:class:`trainguard.operators.sensors.reconcile.ReconcileSensor`).

Every ``period_s`` the trigger takes one pass (:meth:`trainguard.operators.control.Controller.reconcile_pass`):
the running jobs no incident handles are looked at on their machines (one brief status round each), their
machines' unhandled faults and silent agents are read from the fleet database, and the open incidents are
checked against the live tg_incident runs (the REST API's list of queued and running runs). It changes nothing
but its own liveness (component ``reconciler`` in the fleet database: ``trainguard status`` and the metrics say
how old its last pass is); it fires with the findings, and the DAG's task acts on them. A pass that fails (the
fleet database restarting, the api-server away) is logged and the next one tries again.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

RECONCILER = "reconciler"
INCIDENT_DAG = "tg_incident"
#: the guardian's view of the agents counts while its last poll is younger than this
GUARDIAN_STALE_S = 30.0


class ReconcileTrigger(BaseTrigger):
    """Fires with ``{"findings": [...], "ts"}`` once a pass finds a difference no incident handles."""

    def __init__(self, period_s: float = 10.0) -> None:
        super().__init__()
        self.period_s = float(period_s)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return f"{type(self).__module__}.{type(self).__qualname__}", {"period_s": self.period_s}

    async def run(self) -> AsyncIterator[TriggerEvent]:
        memory: dict[str, Any] = {}
        passes = 0
        while self.period_s <= 0:  # the reconciler is off (TG_RECONCILE_PERIOD_S=0): never fires
            await asyncio.sleep(3600)
        while True:
            began = time.monotonic()
            passes += 1
            try:
                findings = await asyncio.to_thread(self._pass, memory, passes)
            except Exception as exc:  # the fleet database restarting, a machine's answer garbled: look again
                self.log.warning("reconciler pass %d failed (the next one tries again): %s", passes, exc)
                findings = []
            if findings:
                self.log.info("reconciler pass %d found: %s", passes, "; ".join(f["reason"] for f in findings))
                yield TriggerEvent({"findings": findings, "ts": time.time()})
                return
            await asyncio.sleep(max(0.5, self.period_s - (time.monotonic() - began)))

    def _pass(self, memory: dict[str, Any], passes: int) -> list[dict[str, Any]]:
        from trainguard.operators.tasks import common

        c = common.shared_controller()
        began = time.monotonic()
        live = self._live_runs()
        # the agents the guardian finds silent now (machine -> since when), while the guardian itself is alive
        guardian = c.fleet.components().get("guardian")
        silent = {} if guardian is None or time.time() - guardian.seen_ts > GUARDIAN_STALE_S else {
            m: a.changed_ts for m, a in c.fleet.liveness().items() if a.reported_ts is not None}
        found = c.reconciliation.reconcile_pass(memory, live_runs=live, silent=silent)
        c.fleet.beat(RECONCILER, {"passes": passes, "period_s": self.period_s, "pid": os.getpid(),
                                  "pass_s": round(time.monotonic() - began, 3), "runs_known": live is not None,
                                  "found": len(found)})
        return [f.dump() for f in found]

    def _live_runs(self) -> list[str] | None:
        """The tg_incident runs queued or running, or None when the REST API does not answer."""
        from trainguard.operators.triggers.alerts import triggerer_api

        try:
            return triggerer_api().live_runs(INCIDENT_DAG)
        except Exception as exc:  # no connection, the api-server away: the stuck-incident check waits
            self.log.info("live runs unknown this pass: %s", exc)
            return None

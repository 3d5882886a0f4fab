"""Scale benchmark of an alert storm end to end: from the storm on the bus to the job's one incident recorded.

Every rank of a job of 100,000 ranks on 12,500 machines alerts at once (an NCCL hang: ``size`` ``rank_hang``
alerts, one batch document per machine as the agents publish them, stamped within 5 s by the machines' own
clocks, one of them an hour ahead and one an hour behind). The fleet database knows the machines and the job.
What is timed is the guardian's recording trigger from its start, the whole storm already on the bus, until
its first batch is recorded: the bus read in batches (:class:`trainguard.operators.triggers.alerts.AlertTrigger`), the
batch ingested into the fleet database (:func:`trainguard.operators.tasks.guardian.group_alerts`: the incident opened,
the alerts attached, the cursor committed). Starting the incident's DAG run through Airflow's REST API is left
out (one call, whatever the fleet's size).

``alert_storm_open_s.<size>`` on the spool bus, ``alert_storm_open_s.<size>.s3`` on S3 (``moto_server``);
``alert_storm_recorded_s``: until the trigger recorded the whole storm, batch by batch, into that one incident
(every alert once).

    python bench/scale_storm.py [SIZE ...]

prints the seconds of one run per case and size (a quick self-check; the scale harness imports ``CASES``).
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import scale_bus, scale_ingest
from trainguard.node_tools.bus import open_bus
from trainguard.operators.settings import DEFAULT_SETTLE_S
from trainguard.operators.triggers.alerts import DEFAULT_POLL_S, AlertTrigger

SIZES = [10_000, 100_000]


class _Opening(AlertTrigger):
    """The recording trigger over a given controller, stopping once its first batch is recorded."""

    controller: Any = None
    opened: tuple[dict[str, Any], ...] = ()
    whole = False  # record the whole storm before the first event, not only its first batch
    follow_s = 0.0  # what is timed is the first event: staying on the bus after it is not

    def _warm(self) -> None:
        return None

    def _record(self, event: dict[str, Any]) -> dict[str, Any]:
        from trainguard.operators.tasks import guardian

        starts = guardian.group_alerts(self.controller, event)
        self.opened = self.opened or tuple(starts)
        self.drain_s = 900.0 if self.whole else 0.0  # else the incident is open: the rest is recorded untimed
        return {"recorded": True, "starts": starts, "started": {}, "alerts": len(event["alerts"]), "kinds": [],
                "first_seen_ts": event["first_seen_ts"], "fired_ts": event["fired_ts"], "quarantined": []}


def _prepare(backend: str, *, whole: bool = False) -> Callable[[int], Callable[[], Any]]:
    def prepare(size: int) -> Callable[[], Any]:
        tmp = tempfile.TemporaryDirectory(prefix="tg-scale-storm-")
        folder = Path(tmp.name)
        c = scale_ingest._fleet(folder)
        url = scale_bus._bus_url(backend, folder)
        c.inventory.bus_url = url
        objects = scale_bus.publish_storm(open_bus(url), size, batched=True)

        def run() -> Any:
            trigger = _Opening(url, c.fleet.url, settle_s=DEFAULT_SETTLE_S, poll_s=DEFAULT_POLL_S, record=True)
            trigger.controller, trigger.whole = c, whole
            asyncio.run(scale_bus.first_event(trigger))
            incidents = c.fleet.incidents(scale_ingest.JOB)
            if len(incidents) != 1 or not trigger.opened:
                raise RuntimeError(f"{len(incidents)} incidents after the first batch, not one")
            if whole and len(c.fleet.alerts_of(incidents[0].id)) != size:
                raise RuntimeError(f"{len(c.fleet.alerts_of(incidents[0].id))} of {size} alerts recorded")
            return {"objects": objects, "incident": incidents[0].id,
                    "alerts_recorded": len(c.fleet.alerts_of(incidents[0].id))}

        weakref.finalize(run, lambda: (c.fleet.close(), tmp.cleanup()))
        return run

    return prepare


CASES: dict[str, tuple[Callable[[int], Callable[[], Any]], list[int]]] = {
    "alert_storm_open_s": (_prepare("spool"), SIZES),
    "alert_storm_open_s.s3": (_prepare("s3"), SIZES),
    "alert_storm_recorded_s": (_prepare("spool", whole=True), SIZES),
    "alert_storm_recorded_s.s3": (_prepare("s3", whole=True), [10_000]),
}


if __name__ == "__main__":
    from bench.common import run_cases

    sys.exit(run_cases(CASES, sys.argv[1:]))

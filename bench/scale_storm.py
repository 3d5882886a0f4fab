"""Scale benchmark of an alert storm end to end: from the storm on the bus to the job's one incident recorded.

Every rank of a job of 100,000 ranks on 12,500 machines alerts at once (an NCCL hang: ``size`` ``rank_hang``
alerts, one batch document per machine as the agents publish them, stamped within 5 s by the machines' own
clocks, one of them an hour ahead and one an hour behind). The fleet database knows the machines and the job.
What is timed is the alert watcher from its start, the whole storm already on the bus, until its first batch is
recorded: the bus read in batches (:class:`trainguard.operators.triggers.alerts.AlertTrigger`), the batch recorded
into the fleet database as tg_incident's triage task records it (:func:`trainguard.operators.tasks.guardian.record`:
the incident opened, the alerts attached, the cursor committed). Airflow's part between an event and the task (the
asset event, the run's start) is left out (the same whatever the fleet's size).

``alert_storm_open_s.<size>`` on the spool bus, ``alert_storm_open_s.<size>.s3`` on S3 (``moto_server``);
``alert_storm_recorded_s``: until the whole storm was recorded, batch after batch, into that one incident (every
alert once).

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


async def _record_storm(c: Any, url: str, size: int, *, whole: bool) -> int:
    """Watch the bus and record each batch as it comes, until the first opened the incident (or, ``whole``, until
    every alert of the storm is recorded); the incident."""
    from trainguard.operators.tasks import guardian

    events = AlertTrigger(url, c.fleet.url, settle_s=DEFAULT_SETTLE_S, poll_s=DEFAULT_POLL_S, silent_s=0).run()
    opened, recorded = None, 0
    try:
        while True:
            event = (await events.__anext__()).payload
            items = await asyncio.to_thread(guardian.record, c, event, run="scale")
            opened = opened or next((i["incident"] for i in items if i["opened"]), None)
            recorded += len(event["alerts"])
            if opened is not None and (not whole or recorded >= size):
                return opened
    finally:
        await events.aclose()


def _prepare(backend: str, *, whole: bool = False) -> Callable[[int], Callable[[], Any]]:
    def prepare(size: int) -> Callable[[], Any]:
        tmp = tempfile.TemporaryDirectory(prefix="tg-scale-storm-")
        folder = Path(tmp.name)
        c = scale_ingest._fleet(folder)
        url = scale_bus._bus_url(backend, folder)
        c.inventory.bus_url = url
        objects = scale_bus.publish_storm(open_bus(url), size, batched=True)

        def run() -> Any:
            asyncio.run(_record_storm(c, url, size, whole=whole))
            incidents = c.fleet.incidents(scale_ingest.JOB)
            if len(incidents) != 1:
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

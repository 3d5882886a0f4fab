"""The bodies of ``tg_guardian``'s tasks: where the alerts are, and a batch recorded into incidents (one
``tg_incident`` run each).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from operators.control import ControlConfig
from operators.tasks import common


def alert_source() -> tuple[str, str]:
    """The bus to watch (the inventory's) and the fleet database that keeps the readers' cursors."""
    from node_tools.inventory import Inventory

    cfg = ControlConfig.from_env()
    inv = Inventory.load(Path(cfg.inventory))
    return inv.bus_url, cfg.fleet_url


def group_alerts(event: dict[str, Any]) -> list[dict[str, Any]]:
    """Record the batch in one transaction (alerts into incidents, the bus cursor, quarantined documents, the
    agents' liveness); returns the confs of incidents newly opened, or taken over by stronger alerts during
    a slow vote (one tg_incident run each)."""
    items = common.controller().ingest(event["alerts"], reader=event.get("reader") or "guardian",
                                       read=event.get("read"), gone=event.get("gone") or (),
                                       quarantined=event.get("quarantined") or (), liveness=event.get("liveness"))
    return [{"incident_id": i["incident"], "job": i["job"], "first_seen_ts": event.get("first_seen_ts")}
            for i in items if i["opened"] or i["taken_over"]]

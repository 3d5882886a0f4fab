"""The provider's triggers: they only watch and emit events (see tests/repo/test_architecture.py)."""

from __future__ import annotations

from typing import Any


async def write_beat(trigger: Any, beat: dict[str, Any]) -> None:
    """The watcher's beat (``beat``) in its asset's state store (Airflow's; only an asset's watcher has one), under
    ``watcher``; a store away for a moment is logged and the next beat tries again."""
    store = getattr(trigger, "asset_state_store", None)
    if store is None:
        return
    try:
        await store.aset("watcher", beat)
    except Exception as exc:
        trigger.log.warning("watcher beat not written: %s", exc)

"""Waiting for alerts without holding a worker: ``AlertTrigger`` (runs in the triggerer) and the
deferrable ``AlertSensor``.

The trigger polls the alert bus (:class:`node_tools.bus.BusReader`) every ``poll_s``, starting from the
cursor in ``cursor_path``. On the first alert it keeps reading for ``settle_s`` more (default 3 s), so a
burst from a thousand ranks timing out together becomes one batch, then fires (at once instead when the
batch holds an alert the ladder acts on by itself, an explicit machine fault: waiting would only delay the
eviction; what comes later joins the open incident) with every alert of the
batch as JSON documents and the advanced cursor. The trigger never writes the cursor: the task that has
recorded the batch commits it (:func:`commit_cursor`), so a run that fails after the trigger fired
leaves the alerts for the next run (recording them again is a no-op: alerts are keyed by id).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

from airflow.sdk import BaseSensorOperator
from airflow.triggers.base import BaseEventTrigger, BaseTrigger, TriggerEvent

from operators.policy import ladder

DEFAULT_SETTLE_S = 3.0
DEFAULT_POLL_S = 0.25


def load_cursor(cursor_path: str) -> dict[str, Any]:
    try:
        doc = json.loads(Path(cursor_path).read_text())
        return {"horizon_ns": int(doc.get("horizon_ns", 0)), "seen": {str(k): int(v) for k, v in doc["seen"].items()}}
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return {"horizon_ns": 0, "seen": {}}


def read_batch(bus_url: str, cursor: dict[str, Any], lookback_s: float, folder: str = "alerts"
               ) -> tuple[list[dict[str, Any]], dict]:
    """New documents in a bus folder after ``cursor`` (JSON documents) and the cursor after them."""
    from node_tools.bus import BusReader, open_bus

    reader = BusReader(open_bus(bus_url, folder=folder), lookback_s=lookback_s, horizon_ns=int(cursor["horizon_ns"]),
                       seen=dict(cursor["seen"]))
    alerts = [a.to_dict() for a in reader.read()]
    return alerts, {"horizon_ns": reader.horizon_ns, "seen": reader.seen}


def commit_cursor(cursor_path: str, cursor: dict[str, Any]) -> None:
    """Persist the cursor a fired trigger reported (after its batch was recorded)."""
    path = Path(cursor_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"horizon_ns": int(cursor["horizon_ns"]), "seen": cursor["seen"]}))
    os.replace(tmp, path)


class AlertTrigger(BaseTrigger):
    """Fires with a batch of alerts: the first one found plus all that arrive within ``settle_s`` (or the
    batch so far, once it holds an explicit machine fault)."""

    def __init__(self, bus_url: str, cursor_path: str, *, settle_s: float = DEFAULT_SETTLE_S,
                 poll_s: float = DEFAULT_POLL_S, lookback_s: float = 120.0, kinds: Sequence[str] = ()) -> None:
        super().__init__()
        self.bus_url = bus_url
        self.cursor_path = cursor_path
        self._cursor: dict[str, Any] = {"horizon_ns": 0, "seen": {}}
        self.settle_s = settle_s
        self.poll_s = poll_s
        self.lookback_s = lookback_s
        self.kinds = list(kinds)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{type(self).__module__}.{type(self).__qualname__}",
                {"bus_url": self.bus_url, "cursor_path": self.cursor_path, "settle_s": self.settle_s,
                 "poll_s": self.poll_s, "lookback_s": self.lookback_s, "kinds": self.kinds})

    async def _read(self) -> list[dict[str, Any]]:
        alerts, self._cursor = await asyncio.to_thread(read_batch, self.bus_url, self._cursor, self.lookback_s)
        return [a for a in alerts if not self.kinds or a["kind"] in self.kinds]

    async def run(self) -> AsyncIterator[TriggerEvent]:
        self._cursor = await asyncio.to_thread(load_cursor, self.cursor_path)
        batch: list[dict[str, Any]] = []
        while not batch:
            batch = await self._read()
            if not batch:
                await asyncio.sleep(self.poll_s)
        first_seen = time.time()
        deadline = time.monotonic() + self.settle_s
        while time.monotonic() < deadline and not any(ladder.decisive(a) for a in batch):
            await asyncio.sleep(min(self.poll_s, max(0.0, deadline - time.monotonic())))
            batch += await self._read()
        batch.sort(key=lambda a: a["ts"])
        yield TriggerEvent({"alerts": batch, "first_seen_ts": first_seen, "fired_ts": time.time(),
                            "cursor": self._cursor, "cursor_path": self.cursor_path})


def settle_from_env(env: Any = None) -> float:
    """``TG_ALERT_SETTLE_S`` (default 3 s): how long a batch keeps collecting after its first alert."""
    env = os.environ if env is None else env
    raw = env.get("TG_ALERT_SETTLE_S", "")
    try:
        value = float(raw) if raw else DEFAULT_SETTLE_S
    except ValueError:
        raise ValueError(f"TG_ALERT_SETTLE_S={raw!r} is not a number of seconds; set it to e.g. 3") from None
    if not 0 <= value <= 60:
        raise ValueError(f"TG_ALERT_SETTLE_S={raw} is outside 0..60 s; set it to e.g. 3")
    return value


class AlertSensor(BaseSensorOperator):
    """Waits (deferred, no worker slot held) until alerts arrive on the bus; returns the batch. Without
    ``bus_url``/``cursor_path``, the control plane's (see :func:`operators.airflow.steps.alert_source`)."""

    template_fields = ("bus_url", "cursor_path")

    def __init__(self, *, bus_url: str = "", cursor_path: str = "", settle_s: float | None = None,
                 poll_s: float = DEFAULT_POLL_S, lookback_s: float = 120.0, kinds: Sequence[str] = (),
                 max_wait: timedelta | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.bus_url = bus_url
        self.cursor_path = cursor_path
        self.settle_s = settle_s
        self.poll_s = poll_s
        self.lookback_s = lookback_s
        self.kinds = list(kinds)
        self.max_wait = max_wait

    def execute(self, context: Any) -> Any:
        bus_url, cursor_path = self.bus_url, self.cursor_path
        if not bus_url or not cursor_path:  # the control plane's: the inventory's bus, a cursor by the fleet DB
            from operators.airflow.steps import alert_source

            default_bus, default_cursor = alert_source()
            bus_url, cursor_path = bus_url or default_bus, cursor_path or default_cursor
        settle_s = self.settle_s if self.settle_s is not None else settle_from_env()
        self.defer(trigger=AlertTrigger(bus_url, cursor_path, settle_s=settle_s,
                                        poll_s=self.poll_s, lookback_s=self.lookback_s, kinds=self.kinds),
                   method_name="execute_complete", timeout=self.max_wait)

    def execute_complete(self, context: Any, event: dict[str, Any] | None = None) -> dict[str, Any]:
        if not event or not event.get("alerts"):
            raise RuntimeError("the alert trigger fired without alerts")
        self.log.info("%d alerts, first at %.3f: %s", len(event["alerts"]), event["alerts"][0]["ts"],
                      ", ".join(sorted({f"{a['machine']}:{a['kind']}" for a in event["alerts"]})))
        return event


class IncidentSensor(AlertSensor):
    """An :class:`AlertSensor` that records its batch as soon as it resumes: the alerts join incidents (or
    open new ones), the bus cursor is committed, and it returns the confs of the incidents to start (one
    ``tg_incident`` run each). One task less between an alert and its incident's run; a failure here
    fails the task before the cursor moves, so its retry reads the same alerts again."""

    def execute_complete(self, context: Any, event: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        batch = super().execute_complete(context, event)
        from operators.airflow import steps

        return steps.group_alerts(batch)


class CheckpointNoticeTrigger(BaseEventTrigger):
    """The watcher of the ``checkpoint_committed`` asset: fires once with the notices found on the bus's
    notices folder (``{"notices": [{"job", "step", "machine", "ts"}]}``), then ends; the triggerer starts
    it again for the next ones. Its cursor (beside the fleet database unless given) is committed as it
    fires: a notice lost to a crash right then is covered by the verification DAG's schedule."""

    def __init__(self, bus_url: str = "", cursor_path: str = "", *, poll_s: float = 1.0,
                 lookback_s: float = 120.0) -> None:
        super().__init__()
        self.bus_url = bus_url
        self.cursor_path = cursor_path
        self.poll_s = poll_s
        self.lookback_s = lookback_s

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{type(self).__module__}.{type(self).__qualname__}",
                {"bus_url": self.bus_url, "cursor_path": self.cursor_path, "poll_s": self.poll_s,
                 "lookback_s": self.lookback_s})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        bus_url, cursor_path = self.bus_url, self.cursor_path
        if not bus_url or not cursor_path:
            from operators.airflow.steps import notice_source

            default_bus, default_cursor = await asyncio.to_thread(notice_source)
            bus_url, cursor_path = bus_url or default_bus, cursor_path or default_cursor
        cursor = await asyncio.to_thread(load_cursor, cursor_path)
        while True:
            docs, cursor = await asyncio.to_thread(read_batch, bus_url, cursor, self.lookback_s, "notices")
            notices = [{"job": d["job"], "step": d["evidence"].get("step"), "machine": d["machine"], "ts": d["ts"]}
                       for d in docs if d["kind"] == "checkpoint_committed"]
            if notices:
                await asyncio.to_thread(commit_cursor, cursor_path, cursor)
                yield TriggerEvent({"notices": notices})
                return
            await asyncio.sleep(self.poll_s)

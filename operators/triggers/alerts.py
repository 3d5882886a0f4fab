"""Waiting for alerts without holding a worker: ``AlertTrigger`` (runs in the triggerer) and the
deferrable ``AlertSensor`` (:mod:`operators.sensors.alerts`).

The trigger polls the alert bus (:class:`node_tools.bus.BusReader`) every ``poll_s``, from the reader's cursor
in the fleet database (every name it has read and recorded, whatever the writers' clocks say). On the first
alert it keeps reading for ``settle_s`` more (default 3 s), so a burst from a thousand ranks timing out
together becomes one batch, then fires (at once instead when the batch holds an alert the ladder acts on by
itself, an explicit machine fault or a silent agent: waiting would only delay the eviction; what comes later
joins the open incident) with every alert of the batch as JSON documents, the names it read, the documents
it quarantined, and what it saw of the agents' heartbeats. With ``record`` (the guardian's), the
trigger records the batch itself as it fires (:func:`operators.tasks.guardian.group_alerts`: alerts into
incidents, the bus cursor committed in the same transaction) and starts each new incident's tg_incident
run through the REST API: an incident's run starts about a second after its alert, with no task to
schedule in between; the event then carries what was started. When it cannot (the fleet database or the
REST API does not answer there), the event carries the batch and the guardian's tasks record it and start
the runs (recording a batch twice is a no-op: alerts are keyed by id; a run's id names its incident).
Without ``record`` the trigger never writes the cursor.

While it waits the trigger also watches trainguard itself: every second it lists the agents' heartbeats
(:class:`operators.policy.liveness.AgentWatch`) and reports an agent silent past ``silent_s`` on a machine
of a running job as an ``agent_silent`` alert of its own; every few seconds it records its own poll in the
fleet database (component ``guardian``: ``trainguard status`` and the metrics say how old it is); it
moves names recorded longer than ``retain_s`` ago to the bus's archive, so the folder it lists stays short;
and, recording, every ``ORPHAN_SWEEP_S`` it starts the run of any open incident whose start was lost
(:func:`operators.tasks.guardian.orphans`: starting one that exists changes nothing).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from airflow.triggers.base import BaseEventTrigger, BaseTrigger, TriggerEvent

from operators.policy import ladder
from operators.settings import DEFAULT_SETTLE_S

DEFAULT_POLL_S = 0.25
DEFAULT_RETAIN_S = 600.0
GUARDIAN = "guardian"
NOTICES_READER = "checkpoint-notices"
LIVENESS_EVERY_S = 1.0
BEAT_EVERY_S = 5.0
WATCHED_EVERY_S = 5.0
ORPHAN_SWEEP_S = 10.0
# the REST API's clients of the triggerer's recording triggers, one per connection id (their tokens kept)
_APIS: dict[str, Any] = {}
_API_LOCK = threading.Lock()


def _fleet(fleet_url: str) -> Any:
    """The process's fleet database (one engine for every trigger of the triggerer), or None without one."""
    from operators.hooks.fleet import fleet_store

    return fleet_store(fleet_url) if fleet_url else None


def watched_machines(fleet: Any) -> dict[str, str]:
    """Machines whose agent must be alive: active ones serving a running job (machine -> job)."""
    from operators.fleet import states

    running = {j.name for j in fleet.jobs() if j.state == "running"}
    return {m.name: m.job for m in fleet.machines(state=states.ACTIVE) if m.job in running}


class _Watch:
    """The trigger's reading state: the bus reader over the committed cursor, the agent watch, clocks."""

    def __init__(self, bus_url: str, fleet_url: str, reader: str, *, folder: str, silent_s: float, skew_s: float,
                 retain_s: float) -> None:
        from node_tools.bus import BusReader, open_bus
        from operators.policy.liveness import AgentWatch

        self.bus = open_bus(bus_url, folder=folder)
        self.fleet = _fleet(fleet_url)
        self.reader_name = reader
        self.committed = self.fleet.cursor(reader) if self.fleet else {}
        self.reader = BusReader(self.bus, seen=dict(self.committed), skew_s=skew_s)
        self.retain_s = retain_s
        self.watch: AgentWatch | None = None
        if self.fleet is not None and silent_s > 0:
            self.watch = AgentWatch(silent_s=silent_s, state={
                m: {"token": a.token, "changed_ts": a.changed_ts, "reported_ts": a.reported_ts}
                for m, a in self.fleet.liveness().items()})
        self.watched: dict[str, str] = {}
        self.next = {"liveness": 0.0, "beat": 0.0, "watched": 0.0, "archive": 0.0}
        self.polls = 0

    def archive(self) -> int:
        """Move names recorded more than ``retain_s`` ago (by this reader's clock) to the archive."""
        now = time.time()
        old = [n for n, ts in self.committed.items() if now - ts > self.retain_s]
        done = 0
        for name in old:
            try:
                self.bus.archive(name)
                done += 1
            except Exception:  # noqa: S112 - a bus error now: the next run tries again
                continue
            self.committed.pop(name, None)
            if self.reader.seen.pop(name, None) is not None:
                self.reader.gone.append(name)
        return done

    def poll(self) -> list[dict[str, Any]]:
        """One round: new alerts, and (when due) agents found silent, the guardian's own beat, archiving."""
        self.polls += 1
        if self.fleet is not None and time.monotonic() >= self.next["archive"]:
            self.next["archive"] = time.monotonic() + 60.0
            self.archive()
        out = [a.record() for a in self.reader.read()]
        now, mono = time.time(), time.monotonic()
        if self.fleet is not None:
            if mono >= self.next["watched"]:
                self.next["watched"] = mono + WATCHED_EVERY_S
                self.watched = watched_machines(self.fleet)
            if self.watch is not None and mono >= self.next["liveness"]:
                self.next["liveness"] = mono + LIVENESS_EVERY_S
                for found in self.watch.observe(self.bus.heartbeats(), self.watched, now):
                    out.append(self.watch.silent_alert(found, now))
            if mono >= self.next["beat"]:
                self.next["beat"] = mono + BEAT_EVERY_S
                self.fleet.beat(self.reader_name, {"polls": self.polls, "watched": len(self.watched),
                                                   "pid": os.getpid()})
        return out

    def event(self, batch: list[dict[str, Any]], first_seen: float) -> dict[str, Any]:
        read = {n: ts for n, ts in self.reader.seen.items() if n not in self.committed}
        now = time.time()
        quarantined = [{**q, "ts": now} for q in self.reader.quarantined]
        return {"alerts": batch, "first_seen_ts": first_seen, "fired_ts": now, "reader": self.reader_name,
                "read": read, "gone": list(self.reader.gone), "quarantined": quarantined,
                "liveness": self.watch.state if self.watch is not None else None}


class AlertTrigger(BaseTrigger):
    """Fires with a batch of alerts: the first one found plus all that arrive within ``settle_s`` (or the
    batch so far, once it holds an alert the ladder acts on by itself). ``fleet_url``: the fleet database
    holding the cursor of ``reader`` (empty: no cursor, no agent watch; for tools and tests);
    ``silent_s``: an agent of a running job silent this long is reported (0: not watched)."""

    def __init__(self, bus_url: str, fleet_url: str = "", *, reader: str = GUARDIAN,
                 settle_s: float = DEFAULT_SETTLE_S, poll_s: float = DEFAULT_POLL_S, kinds: Sequence[str] = (),
                 silent_s: float = 0.0, skew_s: float = 60.0, retain_s: float = DEFAULT_RETAIN_S,
                 record: bool = False) -> None:
        super().__init__()
        self.record = bool(record)
        self.bus_url = bus_url
        self.fleet_url = fleet_url
        self.reader = reader
        self.settle_s = settle_s
        self.poll_s = poll_s
        self.kinds = list(kinds)
        self.silent_s = silent_s
        self.skew_s = skew_s
        self.retain_s = retain_s

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{type(self).__module__}.{type(self).__qualname__}",
                {"bus_url": self.bus_url, "fleet_url": self.fleet_url, "reader": self.reader,
                 "settle_s": self.settle_s, "poll_s": self.poll_s, "kinds": self.kinds, "silent_s": self.silent_s,
                 "skew_s": self.skew_s, "retain_s": self.retain_s, "record": self.record})

    def _keep(self, alerts: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [a for a in alerts if not self.kinds or a["kind"] in self.kinds]

    async def run(self) -> AsyncIterator[TriggerEvent]:
        from node_tools.bus import ALERTS

        watch = await asyncio.to_thread(_Watch, self.bus_url, self.fleet_url, self.reader, folder=ALERTS,
                                        silent_s=self.silent_s, skew_s=self.skew_s, retain_s=self.retain_s)
        if self.record:  # what recording needs, ready before the first alert (a fresh triggerer's first
            # connection lookup takes seconds): the controller, the REST API's client and its token
            await asyncio.to_thread(self._warm)
        # a document quarantined on its own (oversized, not an alert) fires too: it has left the alerts folder,
        # and only the task that records the batch records why; waiting for the next alert would lose it
        sweep_at = time.monotonic() + ORPHAN_SWEEP_S
        while True:
            batch = self._keep(await asyncio.to_thread(watch.poll))
            if batch or watch.reader.quarantined:
                break
            if self.record and time.monotonic() >= sweep_at:
                sweep_at = time.monotonic() + ORPHAN_SWEEP_S
                await asyncio.to_thread(self._sweep)
            await asyncio.sleep(self.poll_s)
        first_seen = time.time()
        deadline = time.monotonic() + self.settle_s
        while batch and time.monotonic() < deadline and not any(ladder.decisive(a) for a in batch):
            await asyncio.sleep(min(self.poll_s, max(0.0, deadline - time.monotonic())))
            batch += self._keep(await asyncio.to_thread(watch.poll))
        batch.sort(key=lambda a: a["ts"])
        event = watch.event(batch, first_seen)
        if self.record:
            event = await asyncio.to_thread(self._record, event)
        yield TriggerEvent(event)

    def _api(self) -> Any:
        """The REST API's client, one per triggerer process (its token kept): built on first use."""
        from operators.hooks.airflow_api import AirflowApiHook

        conn_id = os.environ.get("TG_AIRFLOW_API_CONN_ID", "tg_airflow_api")
        with _API_LOCK:
            if conn_id not in _APIS:
                _APIS[conn_id] = AirflowApiHook(conn_id, retry_s=10.0).get_client()
            return _APIS[conn_id]

    def _warm(self) -> None:
        from operators.tasks import common

        t0 = time.monotonic()
        try:
            common.shared_controller()
            self._api().token()
        except Exception as exc:  # recording falls back to the guardian's tasks for what it cannot do
            self.log.warning("recording is not ready (%s): the guardian's tasks do what the trigger cannot", exc)
        self.log.info("ready to record in %.2fs", time.monotonic() - t0)

    def _record(self, event: dict[str, Any]) -> dict[str, Any]:
        """Record the batch and start its incidents' runs; the event says what was done. Whatever fails here
        is left to the guardian's tasks (the event then carries the batch itself)."""
        from operators.tasks import common, guardian

        began = time.monotonic()
        try:
            starts = guardian.group_alerts(event, common.shared_controller())
        except Exception as exc:
            self.log.warning("batch not recorded in the triggerer (the guardian's task records it): %s", exc)
            return event
        recorded = time.monotonic()
        try:
            started = guardian.start_runs(starts, self._api()) if starts else {}
        except Exception as exc:  # no connection, the api-server down: the start_incident task starts them
            started = {s["trigger_run_id"]: f"not started: {exc}"[:300] for s in starts}
        summary = sorted({f"{a['machine']}:{a['kind']}" for a in event["alerts"]})
        self.log.info("recorded %d alerts (%s) in %.2fs; runs: %s in %.2fs", len(event["alerts"]), ", ".join(summary),
                      recorded - began, started, time.monotonic() - recorded)
        return {"recorded": True, "starts": starts, "started": started, "alerts": len(event["alerts"]),
                "kinds": summary, "first_seen_ts": event["first_seen_ts"], "fired_ts": time.time(),
                "quarantined": [{k: q.get(k) for k in ("name", "reason")} for q in event["quarantined"]]}

    def _sweep(self) -> None:
        """Start the run of any open incident whose start was lost (a no-op for those that run)."""
        from operators.tasks import common, guardian

        try:
            starts = guardian.orphans(common.shared_controller())
            if starts:
                started = guardian.start_runs(starts, self._api())
                if any(v == "started" for v in started.values()):
                    self.log.warning("started the runs of incidents whose start was lost: %s", started)
        except Exception as exc:  # the next sweep tries again
            self.log.warning("orphan sweep: %s", exc)


class CheckpointNoticeTrigger(BaseEventTrigger):
    """The watcher of the ``checkpoint_committed`` asset: fires once with the notices found on the bus's
    notices folder (``{"notices": [{"job", "step", "machine", "ts"}]}``), then ends; the triggerer starts
    it again for the next ones. Its cursor (reader ``checkpoint-notices`` in the fleet database) is committed
    as it fires: a notice lost to a crash right then is covered by the verification DAG's schedule."""

    def __init__(self, bus_url: str = "", fleet_url: str = "", *, poll_s: float = 1.0) -> None:
        super().__init__()
        self.bus_url = bus_url
        self.fleet_url = fleet_url
        self.poll_s = poll_s

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{type(self).__module__}.{type(self).__qualname__}",
                {"bus_url": self.bus_url, "fleet_url": self.fleet_url, "poll_s": self.poll_s})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        from node_tools.bus import NOTICES

        bus_url, fleet_url = self.bus_url, self.fleet_url
        if not bus_url or not fleet_url:
            from operators.tasks.guardian import alert_source

            default_bus, default_fleet = await asyncio.to_thread(alert_source)
            bus_url, fleet_url = bus_url or default_bus, fleet_url or default_fleet
        watch = await asyncio.to_thread(_Watch, bus_url, fleet_url, NOTICES_READER, folder=NOTICES, silent_s=0.0,
                                        skew_s=60.0, retain_s=DEFAULT_RETAIN_S)
        while True:
            docs = await asyncio.to_thread(lambda: [a.record() for a in watch.reader.read()])
            notices = [{"job": d["job"], "step": d["evidence"].get("step"), "machine": d["machine"], "ts": d["ts"]}
                       for d in docs if d["kind"] == "checkpoint_committed"]
            if notices:
                event = watch.event([], 0.0)
                if watch.fleet is not None:
                    await asyncio.to_thread(watch.fleet.advance_cursor, NOTICES_READER, event["read"], event["gone"])
                    await asyncio.to_thread(watch.archive)
                yield TriggerEvent({"notices": notices})
                return
            await asyncio.sleep(self.poll_s)

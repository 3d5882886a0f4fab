"""Watching the alert bus from the triggerer: ``AlertTrigger``, the watcher of the ``trainguard-alerts`` asset
(tg_incident's schedule: each batch it emits becomes an asset event, and Airflow starts a tg_incident run for it),
and the deferrable ``AlertSensor`` (:mod:`trainguard.operators.sensors.alerts`) for tools, which fires once.

The trigger only watches: it reads the bus (:class:`trainguard.node_tools.bus.BusReader`, from the guardian's
cursor in the fleet database: every name read and recorded, whatever the writers' clocks say) and the agents'
heartbeats, and it reads the fleet database (the cursor, which machines serve running jobs, what was last recorded
of the agents), and it writes none of them: it records nothing, starts no run and moves or removes nothing on the
bus. What it saw goes out in its events; the run's first task (tg_incident's ``triage``:
:func:`trainguard.operators.tasks.guardian.record`) records each batch (alerts into incidents and the bus cursor in
one transaction), moves the documents it quarantined, retires old names from the bus and keeps what it saw of the
agents.

On the first alert it keeps reading for ``settle_s`` more (default 1 s, ``TG_ALERT_SETTLE_S``), so a burst from a
thousand ranks timing out together becomes one batch, then emits it (at once instead when the batch holds an alert
the ladder acts on by itself, an explicit machine fault or a silent agent, or a crash or NaN that names its machine
(:func:`~trainguard.operators.policy.ladder.urgent`): waiting would only delay the rung; or when every machine of
the jobs it names has spoken in it or has an agent gone quiet (a hang in a collective: every survivor times out
together, and a lost machine's agent stopped beating with it); or when the batch is full;
fail-slow alerts alone wait :data:`SLOW_SETTLE_S`, the whole job's reports judged together). An alert storm (every
rank of a 100,000-rank job at once) is cut into batches of at most :data:`BATCH_ALERTS` alerts and
:data:`BATCH_BYTES` of documents, each read within about :data:`READ_S`, one event each: no event grows with the
storm, and the first one goes out within a second or so.

A batch is emitted once; the names of what it carried become the cursor when a task records them. Level-triggered,
not edge-triggered: every :data:`CURSOR_EVERY_S` the watcher reads the committed cursor again, and a batch emitted
more than :data:`REEMIT_S` ago whose names are still not in it (its run failed, the database blinked, the event was
lost) is read and emitted again; recording it twice is a no-op (alerts are keyed by id).

While it waits the watcher also watches trainguard itself: every second it lists the agents' heartbeats
(:class:`trainguard.operators.policy.liveness.AgentWatch`) and emits an agent silent past ``silent_s`` on a machine
of a running job as an ``agent_silent`` alert of its own (and a batch with no alert when an agent reported silent
talks again, so that its record is forgiven); every :data:`BEAT_EVERY_S` it writes its own beat into the asset's
state store (Airflow's, not trainguard's: what ``trainguard status`` reads to say whether anything watches the
bus).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from airflow.triggers.base import BaseEventTrigger, TriggerEvent

from trainguard.operators.policy import ladder
from trainguard.operators.triggers import write_beat

DEFAULT_POLL_S = 0.25
#: a name recorded this long ago (by the reader's clock) leaves the bus's folder (the recording task retires it);
#: other readers of the folder (tools, a demo's watchers) poll far more often than this
DEFAULT_RETAIN_S = 30.0
#: names retired per recording (S3: one DeleteObjects call per 1,000)
RETIRE_ROUND = 20_000
#: one event holds at most this many alerts (quarantined documents count as alerts) ...
BATCH_ALERTS = 5_000
#: ... and this many bytes of documents read; the rest comes with the next batch
BATCH_BYTES = 8 << 20
#: a poll reads for at most this long (once it holds something): a bus slower than the storm it carries (S3 at
#: one GET an alert) still emits the first batch within about this, the rest following batch by batch
READ_S = 1.0
#: names an event reports gone, at most (each a cursor row to delete in the same transaction as the batch)
GONE_PER_EVENT = 5_000
GUARDIAN = "guardian"
NOTICES_READER = "checkpoint-notices"
#: the asset whose events are the batches (tg_incident's schedule)
ALERTS_ASSET = "trainguard-alerts"
LIVENESS_EVERY_S = 1.0
BEAT_EVERY_S = 5.0
WATCHED_EVERY_S = 5.0
#: how often the committed cursor is read again (what the recording tasks recorded)
CURSOR_EVERY_S = 5.0
#: a batch emitted this long ago whose names are not recorded yet is emitted again. Not only failed runs: the
#: scheduler keeps one queue row per asset and DAG, so a second event of the asset that comes while the first's
#: run is being made waits for the asset's next event (a lost GPU's kernel Xid and NVML loss, 0.5 s apart, are
#: two batches); far above the 1-3 s a run takes to record its batch here
REEMIT_S = 20.0
#: a batch holding only fail-slow alerts keeps collecting this long (the job's ranks report a shared slowdown
#: within a step or two of each other)
SLOW_SETTLE_S = 5.0
# the REST API's clients of the triggerer's triggers, one per connection id (their tokens kept)
_APIS: dict[str, Any] = {}
_API_LOCK = threading.Lock()


def alert_source() -> tuple[str, str]:
    """The bus to watch (the inventory's) and the fleet database that keeps the readers' cursors."""
    from pathlib import Path

    from trainguard.node_tools.inventory import Inventory
    from trainguard.operators.settings import ControlSettings

    cfg = ControlSettings.from_env()
    return Inventory.load(Path(cfg.inventory)).bus_url, cfg.fleet_url


def _fleet(fleet_url: str) -> Any:
    """The process's fleet database (one engine for every trigger of the triggerer), or None without one."""
    from trainguard.operators.hooks.fleet import fleet_store

    return fleet_store(fleet_url) if fleet_url else None


def triggerer_api() -> Any:
    """The REST API's client of the triggerer's triggers, one per process and connection (its token kept): built on
    first use, from the connection ``TG_AIRFLOW_API_CONN_ID`` (default ``tg_airflow_api``). The triggers only read
    through it (the runs that are live)."""
    from trainguard.operators.hooks.airflow_api import AirflowApiHook, api_conn_id

    conn_id = api_conn_id()
    with _API_LOCK:
        if conn_id not in _APIS:
            _APIS[conn_id] = AirflowApiHook(conn_id, retry_s=10.0).get_client()
        return _APIS[conn_id]


def watched_machines(fleet: Any) -> dict[str, str]:
    """Machines whose agent must be alive: active ones serving a running job (machine -> job)."""
    from trainguard.operators.fleet import states

    running = {j.name for j in fleet.jobs() if j.state == "running"}
    return {m.name: m.job for m in fleet.machines(state=states.ACTIVE) if m.job in running}


class _Watch:
    """The watcher's reading state: the bus reader over the committed cursor (read, never written), the names
    emitted and not recorded yet, the agent watch, clocks."""

    def __init__(self, bus_url: str, fleet_url: str, reader: str, *, folder: str, silent_s: float,
                 skew_s: float, reemit_s: float = REEMIT_S) -> None:
        from trainguard.node_tools.bus import BusReader, open_bus
        from trainguard.operators.policy.liveness import AgentWatch

        self.bus = open_bus(bus_url, folder=folder)
        self.fleet = _fleet(fleet_url)
        self.reader_name = reader
        self.reemit_s = reemit_s
        self.committed = self.fleet.cursor(reader) if self.fleet else {}
        self.reader = BusReader(self.bus, seen=dict(self.committed), skew_s=skew_s, moves=False)
        self.emitted: dict[str, float] = {}  # name -> when (monotonic) it went out in an event
        self.watch: AgentWatch | None = None
        if self.fleet is not None and silent_s > 0:
            self.watch = AgentWatch(silent_s=silent_s, state={
                m: {"token": a.token, "changed_ts": a.changed_ts, "reported_ts": a.reported_ts}
                for m, a in self.fleet.liveness().items()})
        self.forgiven = False  # an agent reported silent talks again since the last event
        self.watched: dict[str, str] = {}
        self.next = {"liveness": 0.0, "watched": 0.0, "cursor": time.monotonic() + CURSOR_EVERY_S}
        self.polls = 0
        self.reemitted = 0

    def refresh(self) -> None:
        """The committed cursor read again: what was emitted and recorded since is done; what was emitted more than
        ``reemit_s`` ago and is still not recorded is read again (and emitted again); names the recorder dropped from
        the cursor (retired from the bus, gone) leave the reader too."""
        if self.fleet is None:
            return
        self.committed = self.fleet.cursor(self.reader_name)
        now = time.monotonic()
        for name in [n for n in self.emitted if n in self.committed]:
            del self.emitted[name]
        late = [n for n, at in self.emitted.items() if now - at > self.reemit_s]
        for name in late:
            del self.emitted[name]
        self.reader.forget(late, again=True)  # read again, each alert with the time it first arrived
        self.reemitted += len(late)
        gone = set(self.reader.gone)
        for name, ts in self.committed.items():
            if name not in gone:
                self.reader.seen.setdefault(name, ts)
        self.reader.forget([n for n in self.reader.seen if n not in self.committed and n not in self.emitted])

    def poll(self, room: int | None = None, *, tidy: bool = True, read_s: float = READ_S) -> list[dict[str, Any]]:
        """One round: the new alerts read within ``read_s``, at most ``room`` (default :data:`BATCH_ALERTS`; the
        last document read may hold a few more), and (when due) agents found silent; with ``tidy`` (not while a
        batch is being gathered), the committed cursor read again (:meth:`refresh`)."""
        room = BATCH_ALERTS if room is None else room
        self.polls += 1
        mono = time.monotonic()
        if tidy and mono >= self.next["cursor"]:
            self.next["cursor"] = mono + CURSOR_EVERY_S
            self.refresh()
        out = [a.record() for a in self.reader.read(max(1, room), max_read_bytes=BATCH_BYTES, max_read_s=read_s)]
        now, mono = time.time(), time.monotonic()
        if self.fleet is not None:
            if mono >= self.next["watched"]:
                self.next["watched"] = mono + WATCHED_EVERY_S
                self.watched = watched_machines(self.fleet)
            if self.watch is not None and mono >= self.next["liveness"]:
                self.next["liveness"] = mono + LIVENESS_EVERY_S
                reported = {m for m, st in self.watch.state.items() if st.get("reported_ts") is not None}
                for found in self.watch.observe(self.bus.heartbeats(), self.watched, now):
                    out.append(self.watch.silent_alert(found, now))
                self.forgiven |= any(self.watch.state.get(m, {}).get("reported_ts") is None for m in reported)
        return out

    def heard_from_all(self, batch: list[dict[str, Any]]) -> bool:
        """Whether the batch holds a word from every machine of the jobs it names but those whose agents are quiet
        (:func:`~trainguard.operators.policy.liveness.heard_from_all`); never for fail-slow alerts alone, which wait
        to be judged together."""
        from trainguard.operators.policy.liveness import heard_from_all

        if self.watch is None or all(a.get("kind") in ladder.SLOW for a in batch):
            return False
        return heard_from_all(batch, self.watched, self.watch.state, time.time())

    def pending(self) -> bool:
        """Whether there is something to emit besides alerts: documents quarantined, an agent forgiven."""
        return bool(self.reader.quarantined) or self.forgiven

    def event(self, batch: list[dict[str, Any]], first_seen: float) -> dict[str, Any]:
        """The event of ``batch``: the names read and not emitted yet, at most :data:`GONE_PER_EVENT` names gone,
        what was quarantined (for the recording task to move out of the folder), the agents' liveness, the
        watcher's own counters; ``more``: unread documents wait on the bus. The names become emitted."""
        read = {n: ts for n, ts in self.reader.seen.items() if n not in self.committed and n not in self.emitted}
        now = time.time()
        quarantined = [{**q, "ts": now} for q in self.reader.quarantined]
        gone = self.reader.gone[:GONE_PER_EVENT]
        out = {"alerts": batch, "first_seen_ts": first_seen, "fired_ts": now, "reader": self.reader_name,
               "read": read, "gone": gone, "quarantined": quarantined,
               "liveness": self.watch.state if self.watch is not None else None, "more": self.reader.more,
               "watcher": {"polls": self.polls, "watched": len(self.watched), "pid": os.getpid(),
                           "reemitted": self.reemitted}}
        mono = time.monotonic()
        self.emitted.update((n, mono) for n in read)
        del self.reader.gone[:len(gone)]
        del self.reader.quarantined[:len(quarantined)]
        self.forgiven = False
        return out


def _deadline(batch: list[dict[str, Any]], began: float, settle_s: float) -> float:
    """When a batch begun at ``began`` (monotonic) goes out: after the settle window; a batch of fail-slow alerts
    only waits longer, the whole job's reports judged together telling a straggler from a slowdown every rank
    shares (nothing in it is urgent: a vote takes a minute)."""
    slow_only = all(a.get("kind") in ladder.SLOW for a in batch)
    return began + (max(settle_s, SLOW_SETTLE_S) if slow_only else settle_s)


def _settings() -> tuple[float, float]:
    """The batch window and the silence that makes an agent an incident (``TG_ALERT_SETTLE_S``,
    ``TG_AGENT_SILENT_S``), as the triggerer's environment says."""
    from trainguard.operators.settings import ControlSettings

    s = ControlSettings.from_env()
    return s.alert_settle_s, s.agent_silent_s


class AlertTrigger(BaseEventTrigger):
    """Emits the bus's alerts in batches: the first one found plus all that arrive within ``settle_s`` (or the batch
    so far, once it holds an alert the ladder acts on by itself). Without ``bus_url``/``fleet_url``: the control
    plane's (the inventory's bus, the fleet database; :func:`alert_source`);
    ``fleet_url`` may be empty only with a bus given (then: no cursor, no agent watch; for tools and tests).
    ``settle_s``/``silent_s`` None: the settings'; ``silent_s`` 0: the agents are not watched. ``once``: emit one
    batch and end (a deferred task's trigger); else it watches for good (an asset's watcher)."""

    def __init__(self, bus_url: str = "", fleet_url: str = "", *, reader: str = GUARDIAN,
                 settle_s: float | None = None, poll_s: float = DEFAULT_POLL_S, kinds: Sequence[str] = (),
                 silent_s: float | None = None, skew_s: float = 60.0, reemit_s: float = REEMIT_S,
                 once: bool = False) -> None:
        super().__init__()
        self.bus_url = bus_url
        self.fleet_url = fleet_url
        self.reader = reader
        self.settle_s = settle_s
        self.poll_s = poll_s
        self.kinds = list(kinds)
        self.silent_s = silent_s
        self.skew_s = skew_s
        self.reemit_s = reemit_s
        self.once = bool(once)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{type(self).__module__}.{type(self).__qualname__}",
                {"bus_url": self.bus_url, "fleet_url": self.fleet_url, "reader": self.reader,
                 "settle_s": self.settle_s, "poll_s": self.poll_s, "kinds": self.kinds, "silent_s": self.silent_s,
                 "skew_s": self.skew_s, "reemit_s": self.reemit_s, "once": self.once})

    def _keep(self, alerts: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [a for a in alerts if not self.kinds or a["kind"] in self.kinds]

    def _open(self) -> tuple[_Watch, float]:
        """The watch over the bus and the fleet database, and the batch window."""
        from trainguard.node_tools.bus import ALERTS

        bus_url, fleet_url = self.bus_url, self.fleet_url
        if not bus_url:
            bus_url, default_fleet = alert_source()
            fleet_url = fleet_url or default_fleet
        settle_s, silent_s = self.settle_s, self.silent_s
        if settle_s is None or silent_s is None:
            from_env = _settings()
            settle_s = from_env[0] if settle_s is None else settle_s
            silent_s = from_env[1] if silent_s is None else silent_s
        return _Watch(bus_url, fleet_url, self.reader, folder=ALERTS, silent_s=silent_s, skew_s=self.skew_s,
                      reemit_s=self.reemit_s), settle_s

    async def run(self) -> AsyncIterator[TriggerEvent]:
        watch, settle_s = await asyncio.to_thread(self._open)
        beat_at = 0.0
        while True:
            # a document quarantined on its own (oversized, not an alert) is emitted too: only the task that records
            # the batch records why and moves it; waiting for the next alert would leave it where it is
            while True:
                batch = self._keep(await asyncio.to_thread(watch.poll))
                if time.monotonic() >= beat_at:
                    beat_at = time.monotonic() + BEAT_EVERY_S
                    await self._beat(watch)
                if batch or watch.pending():
                    break
                await asyncio.sleep(self.poll_s)
            first_seen = time.time()
            began = time.monotonic()
            while batch and time.monotonic() < _deadline(batch, began, settle_s) and not watch.reader.more \
                    and len(batch) < BATCH_ALERTS and not any(ladder.urgent(a) for a in batch) \
                    and not watch.heard_from_all(batch):
                await asyncio.sleep(min(self.poll_s, max(0.0, _deadline(batch, began, settle_s) - time.monotonic())))
                left = _deadline(batch, began, settle_s) - time.monotonic()
                batch += self._keep(await asyncio.to_thread(watch.poll, BATCH_ALERTS - len(batch), tidy=False,
                                                            read_s=max(0.1, left)))
            batch.sort(key=lambda a: a["ts"])
            event = watch.event(batch, first_seen)
            self.log.info("emitting %d alerts (%s), %d names read, %d quarantined", len(batch),
                          ", ".join(_summary({f"{a['machine']}:{a['kind']}" for a in batch})), len(event["read"]),
                          len(event["quarantined"]))
            yield TriggerEvent(event)
            if self.once:
                return

    async def _beat(self, watch: _Watch) -> None:
        await write_beat(self, {"ts": time.time(), "polls": watch.polls, "watched": len(watch.watched),
                                "pid": os.getpid(), "emitted": len(watch.emitted), "reemitted": watch.reemitted})


#: machine:kind pairs an event's log line names, at most (a storm's are counted, not listed)
SUMMARY_MAX = 50


def _summary(pairs: set[str]) -> list[str]:
    """The sorted ``machine:kind`` pairs, at most :data:`SUMMARY_MAX` of them and then how many more."""
    ordered = sorted(pairs)
    if len(ordered) <= SUMMARY_MAX:
        return ordered
    return [*ordered[:SUMMARY_MAX], f"... {len(ordered) - SUMMARY_MAX} more"]


class CheckpointNoticeTrigger(BaseEventTrigger):
    """The watcher of the ``checkpoint_committed`` asset: emits the notices found on the bus's notices folder
    (``{"notices": [{"job", "step", "machine", "ts"}], "read": names}``), one event per round that found some, and
    watches on. It reads its cursor (reader ``checkpoint-notices`` in the fleet database) and writes nothing: the
    verification run's first task records the names it was sent (:func:`trainguard.operators.tasks.checkpoint_verify
    .ckpt_targets`); notices emitted and not recorded within ``reemit_s`` are emitted again, and the verification
    DAG's schedule covers whatever a lost event missed."""

    def __init__(self, bus_url: str = "", fleet_url: str = "", *, poll_s: float = 1.0,
                 reemit_s: float = REEMIT_S) -> None:
        super().__init__()
        self.bus_url = bus_url
        self.fleet_url = fleet_url
        self.poll_s = poll_s
        self.reemit_s = reemit_s

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{type(self).__module__}.{type(self).__qualname__}",
                {"bus_url": self.bus_url, "fleet_url": self.fleet_url, "poll_s": self.poll_s,
                 "reemit_s": self.reemit_s})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        from trainguard.node_tools.bus import NOTICES

        bus_url, fleet_url = self.bus_url, self.fleet_url
        if not bus_url or not fleet_url:
            default_bus, default_fleet = await asyncio.to_thread(alert_source)
            bus_url, fleet_url = bus_url or default_bus, fleet_url or default_fleet
        watch = await asyncio.to_thread(_Watch, bus_url, fleet_url, NOTICES_READER, folder=NOTICES, silent_s=0.0,
                                        skew_s=60.0, reemit_s=self.reemit_s)
        while True:
            docs = await asyncio.to_thread(watch.poll)
            notices = [{"job": d["job"], "step": d["evidence"].get("step"), "machine": d["machine"], "ts": d["ts"]}
                       for d in docs if d["kind"] == "checkpoint_committed"]
            if notices:
                event = watch.event([], 0.0)
                yield TriggerEvent({"notices": notices, "reader": NOTICES_READER, "read": event["read"],
                                    "gone": event["gone"]})
            await asyncio.sleep(self.poll_s)

"""Waiting for alerts without holding a worker: ``AlertTrigger`` (runs in the triggerer) and the
deferrable ``AlertSensor`` (:mod:`trainguard.operators.sensors.alerts`).

The trigger polls the alert bus (:class:`trainguard.node_tools.bus.BusReader`) every ``poll_s``, from the reader's
cursor in the fleet database (every name it has read and recorded, whatever the writers' clocks say). On the first
alert it keeps reading for ``settle_s`` more (default 1 s), so a burst from a thousand ranks timing out
together becomes one batch, then fires (at once instead when the batch holds an alert the ladder acts on by
itself, an explicit machine fault or a silent agent: waiting would only delay the eviction; or when the batch
is full: what comes later joins the open incident) with every alert of the batch as JSON documents, the names
it read, the documents it quarantined, and what it saw of the agents' heartbeats. With ``record`` (the
guardian's), the trigger records the batch itself as it fires (:func:`trainguard.operators.tasks.guardian.group_alerts`:
alerts into incidents, the bus cursor committed in the same transaction) and starts each new incident's
tg_incident run through the REST API: an incident's run starts about a second after its alert, with no task to
schedule in between; the event then carries what was started. When it cannot (the fleet database or the
REST API does not answer there), the event carries the batch and the guardian's tasks record it and start
the runs (recording a batch twice is a no-op: alerts are keyed by id; a run's id names its incident).
Without ``record`` the trigger never writes the cursor.

An alert storm (every rank of a 100,000-rank job at once) is cut into batches of at most
:data:`BATCH_ALERTS` alerts and :data:`BATCH_BYTES` of documents, each read within about :data:`READ_S`: the
first batch that is full (or that its reading time ended with documents still unread) fires at once, so the
incident opens within a second or so of the storm's first alerts whatever its size and however slow the bus,
and no event grows with the storm. Recording, the trigger then records the next batches one after the
other (each joins the open incident; each commits the cursor) until the bus holds nothing unread or
:attr:`AlertTrigger.drain_s` has passed, and fires once with what it recorded; a batch it cannot record is
left unrecorded, and the next run reads it again. When it started incident runs, it then stays on the bus
for :attr:`AlertTrigger.follow_s` more, recording each batch as it comes: a second machine's fault seconds
after the first joins the open incident before its swap, rather than ~10 s later when the next guardian run
is scheduled and deferred (on a loaded host), after the job was restarted onto that machine. Without
``record``, each run fires with one batch and the next run reads the next.

While it waits the trigger also watches trainguard itself: every second it lists the agents' heartbeats
(:class:`trainguard.operators.policy.liveness.AgentWatch`) and reports an agent silent past ``silent_s`` on a machine
of a running job as an ``agent_silent`` alert of its own; every few seconds it records its own poll in the
fleet database (component ``guardian``: ``trainguard status`` and the metrics say how old it is); every
:data:`RETIRE_EVERY_S` it removes from the bus the names recorded longer than ``retain_s`` ago by its own
clock (:meth:`trainguard.node_tools.bus.AlertBus.retire`, in bulk; the fleet database keeps every alert's document), so
the folder it lists holds only what is unread or recent; recording, it drops them from the committed cursor
at once, otherwise its event reports them ``gone``. And, recording, every ``ORPHAN_SWEEP_S`` it starts the run
of any open incident whose start was lost (:func:`trainguard.operators.tasks.guardian.orphans`: starting one that exists
changes nothing).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from airflow.triggers.base import BaseEventTrigger, BaseTrigger, TriggerEvent

from trainguard.operators.policy import ladder
from trainguard.operators.settings import DEFAULT_SETTLE_S

DEFAULT_POLL_S = 0.25
#: a name recorded this long ago (by the reader's clock) leaves the bus's folder; other readers of the folder
#: (tools, a demo's watchers) poll far more often than this
DEFAULT_RETAIN_S = 30.0
RETIRE_EVERY_S = 5.0
#: names retired per round (S3: one DeleteObjects call per 1,000)
RETIRE_ROUND = 20_000
#: one event holds at most this many alerts (quarantined documents count as alerts) ...
BATCH_ALERTS = 5_000
#: ... and this many bytes of documents read; the rest comes with the next batch
BATCH_BYTES = 8 << 20
#: a poll reads for at most this long (once it holds something): a bus slower than the storm it carries (S3 at
#: one GET an alert) still fires the first batch within about this, the rest following batch by batch
READ_S = 1.0
#: names an event reports gone, at most (each a cursor row to delete in the same transaction as the batch)
GONE_PER_EVENT = 5_000
GUARDIAN = "guardian"
NOTICES_READER = "checkpoint-notices"
LIVENESS_EVERY_S = 1.0
BEAT_EVERY_S = 5.0
WATCHED_EVERY_S = 5.0
ORPHAN_SWEEP_S = 10.0
#: a batch holding only fail-slow alerts keeps collecting this long (the job's ranks report a shared slowdown
#: within a step or two of each other)
SLOW_SETTLE_S = 5.0
# the REST API's clients of the triggerer's recording triggers, one per connection id (their tokens kept)
_APIS: dict[str, Any] = {}
_API_LOCK = threading.Lock()


def _fleet(fleet_url: str) -> Any:
    """The process's fleet database (one engine for every trigger of the triggerer), or None without one."""
    from trainguard.operators.hooks.fleet import fleet_store

    return fleet_store(fleet_url) if fleet_url else None


def triggerer_api() -> Any:
    """The REST API's client of the triggerer's triggers, one per process and connection (its token kept): built on
    first use, from the connection ``TG_AIRFLOW_API_CONN_ID`` (default ``tg_airflow_api``)."""
    from trainguard.operators.hooks.airflow_api import AirflowApiHook

    conn_id = os.environ.get("TG_AIRFLOW_API_CONN_ID", "tg_airflow_api")
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
    """The trigger's reading state: the bus reader over the committed cursor, the agent watch, clocks.
    ``commits``: this watch may write the reader's cursor itself (a recording trigger's)."""

    def __init__(self, bus_url: str, fleet_url: str, reader: str, *, folder: str, silent_s: float, skew_s: float,
                 retain_s: float, commits: bool = False) -> None:
        from trainguard.node_tools.bus import BusReader, open_bus
        from trainguard.operators.policy.liveness import AgentWatch

        self.bus = open_bus(bus_url, folder=folder)
        self.fleet = _fleet(fleet_url)
        self.reader_name = reader
        self.commits = commits and self.fleet is not None
        self.committed = self.fleet.cursor(reader) if self.fleet else {}
        self.reader = BusReader(self.bus, seen=dict(self.committed), skew_s=skew_s)
        self.retain_s = retain_s
        self.watch: AgentWatch | None = None
        if self.fleet is not None and silent_s > 0:
            self.watch = AgentWatch(silent_s=silent_s, state={
                m: {"token": a.token, "changed_ts": a.changed_ts, "reported_ts": a.reported_ts}
                for m, a in self.fleet.liveness().items()})
        self.watched: dict[str, str] = {}
        self.next = {"liveness": 0.0, "beat": 0.0, "watched": 0.0, "retire": 0.0}
        self.polls = 0

    def retire(self) -> int:
        """Remove from the bus the names recorded more than ``retain_s`` ago (by this reader's clock), at most
        :data:`RETIRE_ROUND` of them; returns how many left. They leave the cursor: committed at once when this
        watch commits, else reported ``gone`` by the next event (none is retired while that list is full)."""
        if not self.commits and len(self.reader.gone) >= GONE_PER_EVENT:
            return 0
        now = time.time()
        old = [n for n, ts in self.committed.items() if now - ts > self.retain_s][:RETIRE_ROUND]
        if not old:
            return 0
        try:
            done = self.bus.retire(old)
        except Exception:  # a bus error now: the next round tries again
            return 0
        for name in done:
            self.committed.pop(name, None)
        self.reader.forget(done)
        if self.commits and self.fleet is not None:
            for i in range(0, len(done), GONE_PER_EVENT):
                try:
                    self.fleet.advance_cursor(self.reader_name, {}, done[i:i + GONE_PER_EVENT])
                except Exception:  # the next event reports the rest gone
                    self.reader.gone += done[i:]
                    break
        else:
            self.reader.gone += done
        return len(done)

    def poll(self, room: int | None = None, *, tidy: bool = True, read_s: float = READ_S) -> list[dict[str, Any]]:
        """One round: the new alerts read within ``read_s``, at most ``room`` (default :data:`BATCH_ALERTS`;
        the last document read may hold a few more), and (when due) agents found silent, the guardian's own
        beat and, with ``tidy`` (not while a batch is being gathered), the retirement of old names."""
        room = BATCH_ALERTS if room is None else room
        self.polls += 1
        if self.fleet is not None and tidy and time.monotonic() >= self.next["retire"]:
            self.next["retire"] = time.monotonic() + RETIRE_EVERY_S
            self.retire()
        out = [a.record() for a in self.reader.read(max(1, room), max_read_bytes=BATCH_BYTES, max_read_s=read_s)]
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
                if self.watch is not None and self.commits:  # what it saw of the agents, kept as fresh as its beat
                    self.fleet.record_liveness(self.watch.state)
        return out

    def event(self, batch: list[dict[str, Any]], first_seen: float) -> dict[str, Any]:
        """The event of ``batch``: the names read and not committed, at most :data:`GONE_PER_EVENT` names gone,
        what was quarantined, the agents' liveness; ``more``: unread documents wait on the bus."""
        read = {n: ts for n, ts in self.reader.seen.items() if n not in self.committed}
        now = time.time()
        quarantined = [{**q, "ts": now} for q in self.reader.quarantined]
        return {"alerts": batch, "first_seen_ts": first_seen, "fired_ts": now, "reader": self.reader_name,
                "read": read, "gone": self.reader.gone[:GONE_PER_EVENT], "quarantined": quarantined,
                "liveness": self.watch.state if self.watch is not None else None, "more": self.reader.more}

    def commit(self, event: dict[str, Any]) -> None:
        """``event`` was recorded (its cursor committed): what it read is committed, what it reported is done."""
        self.committed.update(event["read"])
        for name in event["gone"]:
            self.committed.pop(name, None)
        del self.reader.gone[:len(event["gone"])]
        del self.reader.quarantined[:len(event["quarantined"])]


class AlertTrigger(BaseTrigger):
    """Fires with a batch of alerts: the first one found plus all that arrive within ``settle_s`` (or the
    batch so far, once it holds an alert the ladder acts on by itself). ``fleet_url``: the fleet database
    holding the cursor of ``reader`` (empty: no cursor, no agent watch; for tools and tests);
    ``silent_s``: an agent of a running job silent this long is reported (0: not watched)."""

    #: how long a recording trigger goes on recording the batches of a storm before it fires
    drain_s = 60.0
    #: how long a recording trigger that started incident runs stays on the bus, recording each batch as it
    #: comes: a second machine's fault a few seconds after the first joins the open incident before its swap
    #: (the next guardian run would read it only once it is scheduled and deferred, ~10 s on a loaded host)
    follow_s = 20.0

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
        from trainguard.node_tools.bus import ALERTS

        watch = await asyncio.to_thread(_Watch, self.bus_url, self.fleet_url, self.reader, folder=ALERTS,
                                        silent_s=self.silent_s, skew_s=self.skew_s, retain_s=self.retain_s,
                                        commits=self.record)
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
        began = time.monotonic()

        def deadline() -> float:
            # a batch of fail-slow alerts only waits longer: the whole job's reports, judged together, tell a
            # straggler from a slowdown every rank shares (nothing in it is urgent: a vote takes a minute)
            slow_only = all(a.get("kind") in ladder.SLOW for a in batch)
            return began + (max(self.settle_s, SLOW_SETTLE_S) if slow_only else self.settle_s)

        while batch and time.monotonic() < deadline() and not watch.reader.more and len(batch) < BATCH_ALERTS \
                and not any(ladder.decisive(a) for a in batch):
            await asyncio.sleep(min(self.poll_s, max(0.0, deadline() - time.monotonic())))
            batch += self._keep(await asyncio.to_thread(watch.poll, BATCH_ALERTS - len(batch), tidy=False,
                                                        read_s=max(0.1, deadline() - time.monotonic())))
        batch.sort(key=lambda a: a["ts"])
        event = watch.event(batch, first_seen)
        if self.record:
            event = await asyncio.to_thread(self._record_all, watch, event)
        yield TriggerEvent(event)

    def _record_all(self, watch: _Watch, event: dict[str, Any]) -> dict[str, Any]:
        """Record ``event``'s batch, then the batches still waiting on the bus one after the other (each joins
        the incidents open by then) until none is left or :attr:`drain_s` has passed; returns what was recorded
        (or, when the first batch could not be, that event itself for the guardian's task). A later batch that
        cannot be recorded is left: its names are not committed, so the next run reads them again."""
        out = self._record(event)
        if not out.get("recorded"):
            return out
        watch.commit(event)
        began = time.monotonic()
        while (watch.reader.more or watch.reader.gone) and time.monotonic() - began < self.drain_s:
            done = self._record_next(watch)
            if not done:  # nothing left, or a batch that cannot be recorded (left for the next run)
                break
            out = _merged(out, done)
        # a run it could not start is the guardian's task's to start: following would only delay that
        follow = out.get("starts") and all(v == "started" for v in out["started"].values())
        return self._follow(watch, out) if follow and self.follow_s > 0 else out

    def _record_next(self, watch: _Watch) -> dict[str, Any] | None:
        """Read the next batch and record it, its names committed: what was recorded, ``{}`` when the bus held
        nothing new, None when the batch could not be recorded (its names are left for the next run)."""
        batch = sorted(self._keep(watch.poll(tidy=False)), key=lambda a: a["ts"])
        nxt = watch.event(batch, time.time())
        if not (batch or nxt["read"] or nxt["gone"] or nxt["quarantined"]):
            return {}
        done = self._record(nxt)
        if not done.get("recorded"):
            return None
        watch.commit(nxt)
        return done

    def _follow(self, watch: _Watch, out: dict[str, Any]) -> dict[str, Any]:
        """Record each batch that reaches the bus within :attr:`follow_s` (every ``poll_s``), joining the
        incidents just started; returns ``out`` with what was recorded merged in. A batch that cannot be
        recorded ends the follow uncommitted: the next run reads it again."""
        until = time.monotonic() + self.follow_s
        while time.monotonic() < until:
            done = self._record_next(watch)
            if done is None:
                break
            if done:
                out = _merged(out, done)
            else:
                time.sleep(min(self.poll_s, max(0.0, until - time.monotonic())))
        return out

    def _api(self) -> Any:
        return triggerer_api()

    def _warm(self) -> None:
        from trainguard.operators.tasks import common

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
        from trainguard.operators.tasks import common, guardian

        began = time.monotonic()
        try:
            starts = guardian.group_alerts(common.shared_controller(), event)
        except Exception as exc:
            self.log.warning("batch not recorded in the triggerer (the guardian's task records it): %s", exc)
            return event
        recorded = time.monotonic()
        try:
            started = guardian.start_runs(starts, self._api()) if starts else {}
        except Exception as exc:  # no connection, the api-server down: the start_incident task starts them
            started = {s["trigger_run_id"]: f"not started: {exc}"[:300] for s in starts}
        summary = _summary({f"{a['machine']}:{a['kind']}" for a in event["alerts"]})
        self.log.info("recorded %d alerts (%s) in %.2fs; runs: %s in %.2fs", len(event["alerts"]), ", ".join(summary),
                      recorded - began, started, time.monotonic() - recorded)
        return {"recorded": True, "starts": starts, "started": started, "alerts": len(event["alerts"]),
                "kinds": summary, "first_seen_ts": event["first_seen_ts"], "fired_ts": time.time(),
                "quarantined": [{k: q.get(k) for k in ("name", "reason")} for q in event["quarantined"]]}

    def _sweep(self) -> None:
        """Start the run of any open incident whose start was lost (a no-op for those that run)."""
        from trainguard.operators.tasks import common, guardian

        try:
            starts = guardian.orphans(common.shared_controller())
            if starts:
                started = guardian.start_runs(starts, self._api())
                if any(v == "started" for v in started.values()):
                    self.log.warning("started the runs of incidents whose start was lost: %s", started)
        except Exception as exc:  # the next sweep tries again
            self.log.warning("orphan sweep: %s", exc)


#: machine:kind pairs an event names, at most (a storm's are counted, not listed)
SUMMARY_MAX = 50


def _summary(pairs: set[str]) -> list[str]:
    """The sorted ``machine:kind`` pairs, at most :data:`SUMMARY_MAX` of them and then how many more."""
    ordered = sorted(pairs)
    if len(ordered) <= SUMMARY_MAX:
        return ordered
    return [*ordered[:SUMMARY_MAX], f"... {len(ordered) - SUMMARY_MAX} more"]


def _merged(out: dict[str, Any], done: dict[str, Any]) -> dict[str, Any]:
    """Two recorded events as one: the runs started by either, the alerts of both counted, their
    ``machine:kind`` pairs up to :data:`SUMMARY_MAX` (then "..." when either had more)."""
    both = [*out["kinds"], *done["kinds"]]
    kinds = sorted({k for k in both if not k.startswith("...")})
    if len(kinds) > SUMMARY_MAX or any(k.startswith("...") for k in both):
        kinds = [*kinds[:SUMMARY_MAX], "... more"]
    starts = {s["trigger_run_id"]: s for s in [*out["starts"], *done["starts"]]}
    return {**out, "starts": list(starts.values()), "started": {**out["started"], **done["started"]},
            "alerts": out["alerts"] + done["alerts"], "kinds": kinds, "fired_ts": done["fired_ts"],
            "quarantined": [*out["quarantined"], *done["quarantined"]][:BATCH_ALERTS]}


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
        from trainguard.node_tools.bus import NOTICES

        bus_url, fleet_url = self.bus_url, self.fleet_url
        if not bus_url or not fleet_url:
            from trainguard.operators.tasks.guardian import alert_source

            default_bus, default_fleet = await asyncio.to_thread(alert_source)
            bus_url, fleet_url = bus_url or default_bus, fleet_url or default_fleet
        watch = await asyncio.to_thread(_Watch, bus_url, fleet_url, NOTICES_READER, folder=NOTICES, silent_s=0.0,
                                        skew_s=60.0, retain_s=DEFAULT_RETAIN_S, commits=True)
        while True:
            docs = await asyncio.to_thread(lambda: [a.record() for a in watch.reader.read()])
            notices = [{"job": d["job"], "step": d["evidence"].get("step"), "machine": d["machine"], "ts": d["ts"]}
                       for d in docs if d["kind"] == "checkpoint_committed"]
            if notices:
                event = watch.event([], 0.0)
                if watch.fleet is not None:
                    await asyncio.to_thread(watch.fleet.advance_cursor, NOTICES_READER, event["read"], event["gone"])
                    watch.commit(event)
                    await asyncio.to_thread(watch.retire)
                yield TriggerEvent({"notices": notices})
                return
            await asyncio.sleep(self.poll_s)

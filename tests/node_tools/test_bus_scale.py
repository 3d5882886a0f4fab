"""The alert bus in an alert storm: batch documents, reading in bounded batches page by page, retention in bulk,
and the guardian's trigger firing with the first full batch, on a spool and on S3 (a real moto_server)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from pathlib import Path

import pytest

from tests.operators.triggers.test_alerts import first_event
from trainguard.node_tools.alerts import (
    ALERT_JSON_SCHEMA,
    MAX_ALERT_BYTES,
    MAX_BATCH_ALERTS,
    Alert,
    AlertError,
    _plainly_valid,
    batch_document,
    parse_document,
    validate,
)
from trainguard.node_tools.bus import BusReader, S3Bus, SpoolBus, open_bus
from trainguard.operators.fleet import FleetStore, states
from trainguard.operators.triggers import alerts as trigger_module
from trainguard.operators.triggers.alerts import AlertTrigger, _Watch


def hang(machine: str, rank: int, **over) -> Alert:
    fields = {"job": "j", "rank": rank, "evidence": {"step": 7, "silent_s": 612.5}}
    fields.update(over)
    return Alert("rank_hang", machine, **fields)


def storm(bus, machines: int, ranks: int, *, t0: float | None = None) -> list[Alert]:
    """Each machine publishes its ranks' alerts as its agent does (one batch document); returns them all."""
    t0 = time.time() if t0 is None else t0
    out = []
    for m in range(machines):
        alerts = [hang(f"m{m}", m * ranks + r, ts=t0 + m * 1e-3) for r in range(ranks)]
        while alerts:
            _name, count = bus.publish_batch(alerts)
            out += alerts[:count]
            alerts = alerts[count:]
    return out


# ---- the documents ------------------------------------------------------------------------------------------
def _schema_accepts(doc) -> bool:
    import jsonschema

    return jsonschema.Draft202012Validator(ALERT_JSON_SCHEMA).is_valid(doc)


BASE = hang("m1", 3).to_dict()
DROP = object()


@pytest.mark.parametrize("change", [
    {}, {"rank": None}, {"ts": 12}, {"job": ""}, {"evidence": {}},
    {"schema": True}, {"schema": 1.0}, {"schema": 2}, {"rank": True}, {"rank": 3.0}, {"rank": -1}, {"rank": 1 << 25},
    {"ts": float("nan")}, {"ts": float("inf")}, {"ts": -1}, {"ts": 2e11}, {"ts": "1"}, {"id": "ABCDEF12"},
    {"id": "abcdef12\n"}, {"id": "abc"}, {"machine": ""}, {"machine": "-m"}, {"machine": "m" * 64},
    {"job": "j" * 65}, {"kind": "meteor"}, {"severity": "loud"}, {"evidence": []},
    {"evidence": {str(i): i for i in range(65)}}, {"agent_version": "banana"}, {"agent_version": "1.2.3-rc1"},
    {"agent_version": "1" * 40}, {"extra": 1}, {"evidence": DROP}, {"id": DROP},
])
def test_the_quick_check_accepts_only_what_the_json_schema_accepts_and_leaves_it_the_reasons(change):
    import jsonschema

    doc = {k: v for k, v in {**BASE, **change}.items() if v is not DROP}
    schema = jsonschema.Draft202012Validator(ALERT_JSON_SCHEMA)
    if _plainly_valid(doc):
        assert schema.is_valid(doc)
    if not change:
        assert _plainly_valid(doc)  # the common case never reaches the JSON Schema
    errors = sorted(schema.iter_errors(doc), key=lambda e: list(e.path))
    if errors and doc.get("schema") in (None, 1):  # refused with the JSON Schema's own words
        with pytest.raises(AlertError) as info:
            validate(doc)
        assert errors[0].message in str(info.value)


def test_a_batch_document_round_trips_and_one_bad_alert_refuses_the_whole_batch():
    alerts = [hang("m7", r) for r in range(8)]
    count, text = batch_document(alerts)
    assert count == 8 and json.loads(text)["schema"] == 1
    assert parse_document(text) == alerts
    doc = alerts[0].to_dict()
    doc["evidence"]["step"] = -1
    assert alerts[0].evidence["step"] == 7  # a document shares nothing mutable with its alert
    lone_count, lone = batch_document(alerts[:1])
    assert lone_count == 1 and lone == alerts[0].to_json()  # a lone alert is a single-alert document
    assert parse_document(lone) == alerts[:1]
    doc = json.loads(text)
    doc["alerts"][3]["kind"] = "meteor"
    with pytest.raises(AlertError, match=r"^alerts/3/kind: 'meteor' is not one of"):
        parse_document(json.dumps(doc))
    for bad, reason in [({"schema": 1, "alerts": []}, "a batch holds 1 to"),
                        ({"schema": 1, "alerts": {"a": 1}}, "a batch holds 1 to"),
                        ({"schema": 1, "alerts": [BASE], "by": "me"}, "additional properties"),
                        ({"schema": 9, "alerts": [BASE]}, "batch schema 9 is unknown")]:
        with pytest.raises(AlertError, match=reason):
            parse_document(json.dumps(bad))


def test_a_batch_holds_one_machines_alerts_within_the_document_limits():
    mixed = [hang("m1", 0), hang("m1", 1), hang("m2", 2)]
    assert batch_document(mixed)[0] == 2  # stops at another machine's alert
    wide = [hang("m1", r, evidence={"tail": ["z" * 500] * 14}) for r in range(20)]  # ~7 KB each
    sizes, left = [], list(wide)
    while left:
        count, text = batch_document(left)
        sizes.append(len(text.encode()))
        left = left[count:]
    assert len(sizes) > 1 and max(sizes) <= MAX_ALERT_BYTES
    many = [Alert("rank_hang", "m1", rank=r, evidence={}) for r in range(MAX_BATCH_ALERTS + 5)]
    assert batch_document(many)[0] == MAX_BATCH_ALERTS


def test_the_agent_publishes_the_alerts_of_one_round_as_one_object(tmp_path):
    from trainguard.node_tools.agent import Agent, AgentSettings
    from trainguard.node_tools.checks import Check, Finding
    from trainguard.node_tools.config import NodeConfig

    class Ranks(Check):
        name, interval_s = "ranks", 1.0

        def __init__(self) -> None:
            self.findings: list[Finding] = []

        def run(self, now):
            return list(self.findings)

    check = Ranks()
    bus = SpoolBus(tmp_path / "bus")
    agent = Agent(NodeConfig(machine="m3", workdir=tmp_path, install_dir=tmp_path), bus, [check],
                  settings=AgentSettings(heartbeat_every_s=0))
    reader = BusReader(bus)
    check.findings = [Finding("rank_hang", f"hang:{r}", "no progress", job="j", rank=r) for r in range(8)]
    assert len(agent.tick(100)) == 8
    [name] = [e.name for e in bus.entries()]
    got = reader.read()
    assert sorted(a.rank for a in got) == list(range(8)) and {a.bus_name for a in got} == {name}
    assert agent.status()["published"] == 8
    check.findings = [Finding("disk_full", "disk", "full")]  # a lone alert: a single-alert document, as before
    [lone] = agent.tick(200)
    [doc] = [json.loads((bus.alerts / e.name).read_text()) for e in bus.entries() if e.name != name]
    assert doc["id"] == lone.id and doc["kind"] == "disk_full"


# ---- reading in bounded batches ---------------------------------------------------------------------------
@pytest.fixture
def s3_bus(s3_endpoint):
    import boto3

    bucket = f"tg-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket=bucket)
    return open_bus(f"s3://{bucket}/fleet?endpoint_url={s3_endpoint}", page_size=10)


@pytest.fixture(params=["spool", "s3"])
def bus(request, tmp_path):
    if request.param == "spool":
        return SpoolBus(tmp_path / "bus")
    return request.getfixturevalue("s3_bus")


def test_a_storm_is_read_in_bounded_batches_every_alert_once_whatever_the_clocks(bus):
    published = storm(bus, machines=12, ranks=4)
    ahead, behind = hang("fast", 900, ts=time.time() + 3600), hang("slow", 901, ts=time.time() - 3600)
    bus.publish(ahead)
    bus.publish(behind)
    reader = BusReader(bus)
    first = reader.read(10)
    assert 10 <= len(first) < 10 + 4 and reader.more  # stops at the document that reaches the limit
    late = hang("slower", 902, ts=time.time() - 7200)  # sorts before everything read so far
    bus.publish(late)
    got = list(first)
    while True:
        batch = reader.read(10)
        assert len(batch) < 10 + 4
        got += batch
        if not reader.more:
            break
    got += reader.read(10)  # a new pass: what sorted before where the last one had got to
    ids = [a.id for a in got]
    assert len(ids) == len(set(ids))
    assert set(ids) == {a.id for a in [*published, ahead, behind, late]}
    assert reader.read(10) == [] and not reader.more


def test_the_first_batch_needs_one_listing_page_and_a_pass_lists_each_page_once(s3_bus):
    storm(s3_bus, machines=45, ranks=2)  # 45 objects: 5 pages of 10
    lists: list[str] = []
    s3_bus.s3.meta.events.register("before-call.s3.ListObjectsV2", lambda **kw: lists.append("list"))
    reader = BusReader(s3_bus)
    assert len(reader.read(6)) == 6 and len(lists) == 1
    while reader.more:
        reader.read(6)
    assert len(lists) == 5  # the pass: every page once, none twice
    assert reader.read(6) == [] and len(lists) == 10  # an idle read: one whole pass


def test_s3_bodies_are_fetched_concurrently_and_a_vanished_one_is_skipped(s3_bus):
    import threading

    storm(s3_bus, machines=20, ranks=1)
    threads: set[str] = set()
    s3_bus.s3.meta.events.register("before-call.s3.GetObject",
                                   lambda **kw: threads.add(threading.current_thread().name))
    names = sorted(e.name for e in s3_bus.entries())
    s3_bus.retire([names[3]])
    bodies = s3_bus.get_many(names)
    assert isinstance(bodies[3], FileNotFoundError) and all(isinstance(b, bytes) for i, b in enumerate(bodies)
                                                            if i != 3)
    assert len(threads) > 1 and all(t.startswith("s3-bus-get") for t in threads)


def test_retire_removes_in_bulk_and_only_the_names_it_is_given(bus, tmp_path):
    storm(bus, machines=30, ranks=1)
    calls: list[int] = []
    if isinstance(bus, S3Bus):
        bus.s3.meta.events.register("before-parameter-build.s3.DeleteObjects",
                                    lambda params, **kw: calls.append(len(params["Delete"]["Objects"])))
    reader = BusReader(bus)
    reader.read(12)
    read = sorted(reader.seen)
    assert bus.retire([*read, "00000000000000000001-m0-gone.json"]) == [*read, "00000000000000000001-m0-gone.json"]
    left = {e.name for e in bus.entries()}
    assert len(left) == 18 and not left & set(read)
    if isinstance(bus, S3Bus):
        assert calls == [13]  # one call for all of them
    else:
        assert all((tmp_path / "bus" / "archive" / "alerts" / n).exists() for n in read)
    reader.forget(read)
    assert len(reader.read()) == 18 and reader.gone == []  # retired by this reader: not reported gone


# ---- the guardian's trigger -------------------------------------------------------------------------------


def _fleet(tmp_path: Path) -> FleetStore:
    fleet = FleetStore(tmp_path / "fleet.db", migrate=True)
    for i in range(40):
        fleet.register_machine(f"m{i}", state=states.STANDBY)
    return fleet


def test_a_storm_fires_with_the_first_full_batch_and_the_next_runs_deliver_the_rest(tmp_path, monkeypatch):
    monkeypatch.setattr(trigger_module, "BATCH_ALERTS", 40)
    url = f"spool://{tmp_path / 'bus'}"
    published = storm(open_bus(url), machines=30, ranks=5)  # 150 alerts, none decisive
    fleet = _fleet(tmp_path)
    event = first_event(AlertTrigger(url, fleet.url, settle_s=30.0, poll_s=0.05), timeout=10.0)
    assert 40 <= len(event["alerts"]) < 45 and event["more"]
    assert event["fired_ts"] - event["first_seen_ts"] < 5.0  # not the 30 s settle window
    assert set(event) >= {"alerts", "first_seen_ts", "fired_ts", "reader", "read", "gone", "quarantined", "liveness"}
    got = list(event["alerts"])
    for _ in range(10):
        fleet.advance_cursor(event["reader"], event["read"], event["gone"])  # what recording commits
        if not event["more"]:
            break
        event = first_event(AlertTrigger(url, fleet.url, settle_s=0.0, poll_s=0.05), timeout=10.0)
        got += event["alerts"]
    assert sorted(a["id"] for a in got) == sorted(a.id for a in published)


def test_one_watcher_emits_a_whole_storm_batch_after_batch_and_the_runs_record_it_into_one_incident(
        tmp_path, monkeypatch):
    """A storm of 100 hang alerts with batches of at most 40: the watcher emits batch after batch (no event grows
    with the storm); the runs recording them open one incident and the later batches join it."""
    from tests.fakes import fleet_controller
    from trainguard.operators.tasks import guardian

    monkeypatch.setattr(trigger_module, "BATCH_ALERTS", 40)
    c, _ = fleet_controller(tmp_path)
    bus = open_bus(c.inventory.bus_url)
    published = [hang(f"m{r % 4}", r % 4, ts=time.time() + r * 1e-3) for r in range(100)]
    for a in published:
        bus.publish(a)
    got = []

    async def batches():
        agen = AlertTrigger(c.inventory.bus_url, c.cfg.fleet_url, settle_s=0.5, poll_s=0.05, silent_s=0).run()
        try:
            while sum(len(e["alerts"]) for e in got) < 100:
                got.append((await asyncio.wait_for(agen.__anext__(), 10.0)).payload)
        finally:
            await agen.aclose()

    asyncio.run(batches())
    assert len(got) >= 3 and max(len(e["alerts"]) for e in got) <= 41
    opened = [guardian.incident_of_run(c, [e], run=f"asset_{i}")[0] for i, e in enumerate(got)]
    [inc] = c.fleet.incidents("j")
    assert opened[0] == inc.id and set(opened[1:]) == {None}  # one incident: the later batches joined it
    assert len(c.fleet.alerts_of(inc.id)) == 100 and len(c.fleet.cursor("guardian")) == 100


def test_retention_removes_recorded_names_by_the_readers_clock_and_commits_them_out(tmp_path, monkeypatch):
    from tests.fakes import fleet_controller
    from trainguard.operators.tasks import guardian

    c, _ = fleet_controller(tmp_path)
    url = c.inventory.bus_url
    bus = open_bus(url)
    storm(bus, machines=6, ranks=1, t0=time.time() + 3600)  # stamped an hour ahead: no matter
    watch = _Watch(url, c.cfg.fleet_url, "guardian", folder="alerts", silent_s=0.0, skew_s=60.0)
    event = watch.event(watch.poll(), time.time())
    c.fleet.advance_cursor("guardian", event["read"], event["gone"])  # what recording commits
    watch.refresh()  # the watcher reads the cursor again every few seconds: recorded, so done
    assert guardian.retire(c, retain_s=30.0) == 0  # recorded just now by the reader's clock: kept
    newer = hang("m9", 99)
    bus.publish(newer)
    assert guardian.retire(c, retain_s=0.0) == 6
    assert [e.name for e in bus.entries()] == [f"{int(newer.ts * 1e9):020d}-m9-{newer.id}.json"]  # the unread stays
    assert c.fleet.cursor("guardian") == {}  # out of the cursor with them
    watch.refresh()  # the watcher forgets what the recorder dropped, and reports nothing of it gone
    assert [a["id"] for a in watch.poll()] == [newer.id] and watch.reader.gone == []


def test_an_event_reports_a_bounded_number_of_names_gone(tmp_path, monkeypatch):
    """Names that left the folder by another hand (a tool archived them): each event carries at most
    GONE_PER_EVENT of them, the rest the next."""
    monkeypatch.setattr(trigger_module, "GONE_PER_EVENT", 4)
    url = f"spool://{tmp_path / 'bus'}"
    bus = open_bus(url)
    storm(bus, machines=10, ranks=1)
    fleet = _fleet(tmp_path)
    watch = _Watch(url, fleet.url, "guardian", folder="alerts", silent_s=0.0, skew_s=60.0)
    first = watch.event(watch.poll(), time.time())
    fleet.advance_cursor("guardian", first["read"], first["gone"])
    bus.retire(list(first["read"]))  # out of the folder behind the watcher's back
    watch.refresh()
    watch.poll()  # the next pass lists the folder: all ten gone
    event = watch.event([], time.time())
    assert len(event["gone"]) == 4 and len(watch.reader.gone) == 6
    fleet.advance_cursor("guardian", {}, event["gone"])
    assert len(watch.event([], time.time())["gone"]) == 4

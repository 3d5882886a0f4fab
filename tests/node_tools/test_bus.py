"""Alert schema and the alert bus: spool and S3 (a real moto_server), cursor, quarantine."""

from __future__ import annotations

import json
import time
import uuid

import pytest

from tests.conftest import free_port
from trainguard.node_tools.alerts import Alert, AlertError, validate
from trainguard.node_tools.bus import BusError, BusReader, S3Bus, SpoolBus, object_name, open_bus


def alert(**over) -> Alert:
    fields = {"kind": "rank_exit", "machine": "m1", "job": "j", "rank": 3, "evidence": {"pid": 1}}
    fields.update(over)
    return Alert(**fields)


def test_alert_round_trips_and_validates():
    a = alert()
    b = Alert.from_json(a.to_json())
    assert b == a


@pytest.mark.parametrize(
    "change,match",
    [
        ({"kind": "meteor"}, "kind"),
        ({"severity": "panic"}, "severity"),
        ({"rank": -1}, "rank"),
        ({"schema": 2}, "schema 2 is unknown"),
        ({"agent_version": "9.0.0"}, "major version differs"),
        ({"agent_version": "banana"}, "agent_version"),
        ({"extra": 1}, "Additional properties"),
    ],
)
def test_invalid_alerts_are_refused_with_a_reason(change, match):
    doc = alert().to_dict() | change
    with pytest.raises(AlertError, match=match):
        validate(doc)
    with pytest.raises(AlertError):
        Alert.from_json(json.dumps(doc))


def test_missing_field_is_refused():
    doc = alert().to_dict()
    del doc["machine"]
    with pytest.raises(AlertError, match="'machine' is a required property"):
        validate(doc)


def test_object_names_sort_by_time():
    a, b = alert(ts=1000.5), alert(ts=999.0)
    assert object_name(b) < object_name(a)


def _spool(tmp_path):
    return SpoolBus(tmp_path / "bus")


def test_spool_reader_sees_each_alert_once_across_restarts(tmp_path):
    bus = _spool(tmp_path)
    cursor = tmp_path / "cursor.json"
    first = [alert(rank=i) for i in range(3)]
    for a in first:
        bus.publish(a)
    reader = BusReader(bus, cursor_path=cursor)
    assert [a.id for a in reader.read()] == [a.id for a in sorted(first, key=lambda a: a.ts)]
    assert reader.read() == []
    late = alert(rank=9, ts=time.time() - 30)  # a machine whose clock lags 30 s
    bus.publish(late)
    restarted = BusReader(bus, cursor_path=cursor)
    assert [a.id for a in restarted.read()] == [late.id]
    assert BusReader(bus, cursor_path=cursor).read() == []


def test_an_alert_stamped_an_hour_ahead_does_not_hide_the_alerts_after_it(tmp_path):
    """A machine whose clock runs an hour ahead (or one forged file) once moved the cursor to its own time:
    every correctly stamped alert after it sorted below the cursor and was never read."""
    bus = _spool(tmp_path)
    cursor = tmp_path / "cursor.json"
    ahead = alert(kind="nic_errors", ts=time.time() + 3600)
    bus.publish(ahead)
    reader = BusReader(bus, cursor_path=cursor)
    [got] = reader.read()
    assert got.id == ahead.id and 3590 < got.clock_skew_s < 3610 and abs(got.received_ts - time.time()) < 5
    lost = [alert(kind="kernel_xid", machine="m2", evidence={"xid": 79}), alert(kind="gpu_lost", machine="m2")]
    for a in lost:
        bus.publish(a)
    assert sorted(a.id for a in reader.read()) == sorted(a.id for a in lost)
    assert all(a.clock_skew_s is None for a in lost)
    late = alert(kind="rank_exit", rank=4)
    bus.publish(late)
    restarted = BusReader(bus, cursor_path=cursor)  # the cursor is persisted: a restart sees the same
    assert [a.id for a in restarted.read()] == [late.id]


def test_an_alert_stamped_an_hour_behind_is_read_and_marked_not_dropped(tmp_path):
    bus = _spool(tmp_path)
    reader = BusReader(bus)
    reader.read()
    behind = alert(kind="gpu_lost", ts=time.time() - 3600)
    bus.publish(behind)
    [got] = reader.read()
    assert got.id == behind.id and -3610 < got.clock_skew_s < -3590
    assert got.record()["clock_skew_s"] == got.clock_skew_s and "clock_skew_s" not in got.to_dict()


def test_a_reader_from_now_reads_only_what_comes_after_it_whatever_the_stamps(tmp_path):
    bus = _spool(tmp_path)
    bus.publish(alert(ts=time.time() + 3600))
    bus.publish(alert(ts=time.time() - 3600))
    reader = BusReader.from_now(bus)
    assert reader.read() == []
    fresh = alert(ts=time.time() - 7200)  # stamped before everything else, arrived after the reader started
    bus.publish(fresh)
    assert [a.id for a in reader.read()] == [fresh.id]


class CountingSpool(SpoolBus):
    def __init__(self, root):
        super().__init__(root)
        self.got: list[str] = []

    def get(self, name):
        self.got.append(name)
        return super().get(name)


def test_an_oversized_alert_is_quarantined_unread_and_large_evidence_is_cut_and_marked(tmp_path):
    from trainguard.node_tools.alerts import MAX_ALERT_BYTES, MAX_EVIDENCE_BYTES

    bus = CountingSpool(tmp_path / "bus")
    (tmp_path / "bus" / "alerts").mkdir(parents=True)
    huge = alert(kind="gpu_lost", evidence={"blob": "x" * (10 << 20)}).to_dict()
    big_name = f"{time.time_ns():020d}-m1-{uuid.uuid4().hex}.json"
    (tmp_path / "bus" / "alerts" / big_name).write_text(json.dumps(huge))  # a writer that ignores the limits
    wide = alert(kind="rank_exit", evidence={"pid": 7, "returncode": -9, "log_tail": ["y" * 2000] * 20})
    wide_name = f"{time.time_ns():020d}-m1-{wide.id}.json"
    (tmp_path / "bus" / "alerts" / wide_name).write_text(json.dumps(wide.to_dict()))
    normal = alert(kind="nan_loss", rank=2)
    bus.publish(normal)
    reader = BusReader(bus)
    got = {a.kind: a for a in reader.read()}
    assert big_name not in bus.got  # never read: its size alone says enough
    [q] = reader.quarantined
    assert q["name"] == big_name and f"over the limit of {MAX_ALERT_BYTES} bytes" in q["reason"]
    assert (tmp_path / "bus" / "quarantine" / big_name).exists()
    assert set(got) == {"rank_exit", "nan_loss"} and got["nan_loss"].id == normal.id
    ev = got["rank_exit"].evidence
    assert ev["pid"] == 7 and ev["returncode"] == -9  # the small facts the ladder reads survive
    assert ev["_truncated"]["bytes"] > 30_000 and len(json.dumps(ev, separators=(",", ":"))) <= MAX_EVIDENCE_BYTES
    # a writer that keeps the rules cuts its own evidence before publishing
    bus.publish(alert(kind="rank_exit", evidence={"log_tail": ["z" * 5000] * 40}))
    [own] = reader.read()
    assert own.evidence["_truncated"]["limit"] == MAX_EVIDENCE_BYTES


def test_archived_names_leave_the_cursor_and_heartbeats_change_with_every_beat(tmp_path):
    bus = _spool(tmp_path)
    a = alert()
    bus.publish(a)
    reader = BusReader(bus)
    [got] = reader.read()
    bus.archive(got.bus_name)
    bus.archive(got.bus_name)  # again: a no-op
    assert reader.read() == [] and reader.gone == [got.bus_name] and reader.seen == {}
    assert (tmp_path / "bus" / "archive" / "alerts" / got.bus_name).exists()
    assert bus.heartbeats() == {}
    bus.beat("m1", {"seq": 1, "ts": time.time()})
    first = bus.heartbeats()["m1"]
    bus.beat("m1", {"seq": 1, "ts": time.time()})  # the same document again: still a new beat
    assert bus.heartbeats()["m1"] != first
    with pytest.raises(BusError, match="not a machine name"):
        bus.beat("../etc", {})


def test_spool_writes_atomically(tmp_path):
    bus = _spool(tmp_path)
    bus.publish(alert())
    assert list((tmp_path / "bus" / ".tmp").iterdir()) == []
    assert len(list((tmp_path / "bus" / "alerts").iterdir())) == 1


@pytest.mark.parametrize(
    "body,reason",
    [
        ('{"schema": 1, "kind": "rank_ex', "not JSON"),  # a half-written file
        (json.dumps(alert().to_dict() | {"agent_version": "7.1.0"}), "major version differs"),
        (json.dumps(alert().to_dict() | {"severity": "loud"}), "severity"),
    ],
)
def test_malformed_files_are_quarantined_with_the_reason(tmp_path, body, reason):
    bus = _spool(tmp_path)
    good = alert()
    bus.publish(good)
    name = f"{time.time_ns():020d}-m9-{uuid.uuid4().hex}.json"
    (tmp_path / "bus" / "alerts" / name).write_text(body)
    reader = BusReader(bus)
    assert [a.id for a in reader.read()] == [good.id]
    assert reader.quarantined[0]["name"] == name and reason in reader.quarantined[0]["reason"]
    assert (tmp_path / "bus" / "quarantine" / name).exists()
    assert reason in (tmp_path / "bus" / "quarantine" / f"{name}.reason.txt").read_text()
    assert not (tmp_path / "bus" / "alerts" / name).exists()


def test_open_bus_urls(tmp_path):
    assert isinstance(open_bus(f"spool://{tmp_path}"), SpoolBus)
    assert isinstance(open_bus(str(tmp_path)), SpoolBus)
    with pytest.raises(BusError, match="unknown scheme"):
        open_bus("ftp://x/y")
    with pytest.raises(BusError, match="names no bucket"):
        open_bus("s3:///prefix")


def test_unusable_spool_is_a_clear_error(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(BusError, match="not usable"):
        SpoolBus(tmp_path / "file" / "bus").publish(alert())


@pytest.fixture
def s3_bus(s3_endpoint):
    import boto3

    bucket = f"tg-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket=bucket)
    return open_bus(f"s3://{bucket}/fleet/alerts-bus?endpoint_url={s3_endpoint}")


def test_s3_bus_publishes_reads_once_and_quarantines(s3_bus, tmp_path):
    assert isinstance(s3_bus, S3Bus)
    alerts = [alert(rank=i) for i in range(5)]
    for a in alerts:
        s3_bus.publish(a)
    s3_bus.put(f"{time.time_ns():020d}-m9-bad.json", b"{half")
    ahead = alert(rank=7, ts=time.time() + 3600)
    s3_bus.publish(ahead)
    reader = BusReader(s3_bus, cursor_path=tmp_path / "c.json")
    got = reader.read()
    assert sorted(a.id for a in got) == sorted(a.id for a in [*alerts, ahead])
    assert reader.quarantined and "not JSON" in reader.quarantined[0]["reason"]
    assert reader.read() == []
    later = alert(rank=8)
    s3_bus.publish(later)
    assert [a.id for a in reader.read()] == [later.id]  # not hidden by the alert an hour ahead
    s3_bus.archive(got[0].bus_name)
    assert reader.read() == [] and got[0].bus_name in reader.gone and got[0].bus_name not in reader.seen
    s3_bus.beat("m1", {"seq": 1})
    first = s3_bus.heartbeats()["m1"]
    s3_bus.beat("m1", {"seq": 2})
    assert s3_bus.heartbeats()["m1"] != first
    keys = [o["Key"] for o in s3_bus.s3.list_objects_v2(Bucket=s3_bus.bucket)["Contents"]]
    assert any(k.startswith("fleet/alerts-bus/quarantine/") for k in keys)
    assert any(k.startswith("fleet/alerts-bus/archive/alerts/") for k in keys)


def test_s3_endpoint_down_is_a_clear_error(s3_endpoint):
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    bus = open_bus(f"s3://bucket/p?endpoint_url={dead}")
    started = time.monotonic()
    with pytest.raises(BusError, match=r"S3 alert bus s3://bucket/p \(http://127.0.0.1:\d+\): put failed") as info:
        bus.publish(alert())
    assert "\n" not in str(info.value)
    assert time.monotonic() - started < 30

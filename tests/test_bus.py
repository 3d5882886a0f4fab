"""Alert schema and the alert bus: spool and S3 (a real moto_server), cursor, quarantine."""

from __future__ import annotations

import json
import time
import uuid

import pytest

from node_tools.alerts import Alert, AlertError, validate
from node_tools.bus import BusError, BusReader, S3Bus, SpoolBus, object_name, open_bus
from tests.conftest import free_port


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
    reader = BusReader(s3_bus, cursor_path=tmp_path / "c.json")
    got = reader.read()
    assert sorted(a.id for a in got) == sorted(a.id for a in alerts)
    assert reader.quarantined and "not JSON" in reader.quarantined[0]["reason"]
    assert reader.read() == []
    keys = [o["Key"] for o in s3_bus.s3.list_objects_v2(Bucket=s3_bus.bucket)["Contents"]]
    assert any(k.startswith("fleet/alerts-bus/quarantine/") for k in keys)


def test_s3_endpoint_down_is_a_clear_error(s3_endpoint):
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    bus = open_bus(f"s3://bucket/p?endpoint_url={dead}")
    started = time.monotonic()
    with pytest.raises(BusError, match=r"S3 alert bus s3://bucket/p \(http://127.0.0.1:\d+\): put failed") as info:
        bus.publish(alert())
    assert "\n" not in str(info.value)
    assert time.monotonic() - started < 30

"""The alert trigger against a real spool bus: a burst becomes one batch; every alert is delivered once."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

from node_tools.alerts import Alert
from node_tools.bus import open_bus
from operators.airflow.alerts import AlertTrigger, commit_cursor


def first_event(trigger: AlertTrigger, timeout: float = 20.0) -> dict:
    async def go() -> dict:
        agen = trigger.run()
        event = await asyncio.wait_for(agen.__anext__(), timeout)
        await agen.aclose()
        return event.payload

    return asyncio.run(go())


def test_a_burst_within_the_settle_window_is_one_batch_and_later_alerts_the_next(tmp_path: Path):
    url = f"spool://{tmp_path / 'bus'}"
    bus = open_bus(url)
    cursor = str(tmp_path / "cursor.json")
    trigger = AlertTrigger(url, cursor, settle_s=1.0, poll_s=0.05)
    started = threading.Event()

    def publish() -> None:
        started.wait()
        for r in range(8):  # eight ranks time out within 0.4 s
            bus.publish(Alert("rank_hang", f"m{r // 2}", job="j", rank=r))
            time.sleep(0.05)
        time.sleep(2.0)  # well after the settle window: the next batch
        bus.publish(Alert("gpu_lost", "m3", job="j"))

    t = threading.Thread(target=publish)
    t.start()
    started.set()
    first = first_event(trigger)
    assert [a["rank"] for a in first["alerts"]] == list(range(8))
    assert first["fired_ts"] - first["first_seen_ts"] >= 1.0
    # not committed (the run failed before recording it): the next run gets the same batch
    again = first_event(AlertTrigger(url, cursor, settle_s=0.1, poll_s=0.05))
    assert [a["id"] for a in again["alerts"]][:8] == [a["id"] for a in first["alerts"]]
    commit_cursor(first["cursor_path"], first["cursor"])
    second = first_event(AlertTrigger(url, cursor, settle_s=0.2, poll_s=0.05))  # a new run, committed cursor
    t.join()
    assert [a["kind"] for a in second["alerts"]] == ["gpu_lost"]  # nothing from the first batch again


def test_the_trigger_serialises_to_its_arguments(tmp_path: Path):
    trigger = AlertTrigger("spool:///x", str(tmp_path / "c"), settle_s=3.0, kinds=["gpu_lost"])
    path, kwargs = trigger.serialize()
    assert path == "operators.airflow.alerts.AlertTrigger"
    again = AlertTrigger(**kwargs)
    assert again.serialize() == (path, kwargs)


def test_kinds_filter_what_fires(tmp_path: Path):
    url = f"spool://{tmp_path / 'bus'}"
    bus = open_bus(url)
    bus.publish(Alert("loss_spike", "m0", job="j", rank=0, severity="warning"))
    bus.publish(Alert("nan_loss", "m0", job="j", rank=0))
    event = first_event(AlertTrigger(url, str(tmp_path / "c"), settle_s=0.1, poll_s=0.05, kinds=["nan_loss"]))
    assert [a["kind"] for a in event["alerts"]] == ["nan_loss"]


def test_an_explicit_machine_fault_fires_without_waiting_out_the_settle_window(tmp_path: Path):
    url = f"spool://{tmp_path / 'bus'}"
    bus = open_bus(url)
    bus.publish(Alert("rank_slow", "m1", job="j", rank=2, severity="warning"))
    bus.publish(Alert("gpu_lost", "m0", job="j"))
    event = first_event(AlertTrigger(url, str(tmp_path / "c"), settle_s=10.0, poll_s=0.05), timeout=5.0)
    assert [a["kind"] for a in event["alerts"]] == ["rank_slow", "gpu_lost"]
    assert event["fired_ts"] - event["first_seen_ts"] < 1.0
    # a benign Xid (13: a user's illegal memory access) is not decisive: the window is waited out
    other = f"spool://{tmp_path / 'bus2'}"
    open_bus(other).publish(Alert("kernel_xid", "m0", job="j", evidence={"xid": "13"}))
    slow = first_event(AlertTrigger(other, str(tmp_path / "c2"), settle_s=1.0, poll_s=0.05))
    assert slow["fired_ts"] - slow["first_seen_ts"] >= 1.0


def test_the_settle_window_comes_from_the_environment_and_bad_values_are_named():
    from operators.airflow.alerts import DEFAULT_SETTLE_S, settle_from_env

    assert settle_from_env({}) == DEFAULT_SETTLE_S
    assert settle_from_env({"TG_ALERT_SETTLE_S": "1"}) == 1.0
    with pytest.raises(ValueError, match="TG_ALERT_SETTLE_S='soon' is not a number"):
        settle_from_env({"TG_ALERT_SETTLE_S": "soon"})
    with pytest.raises(ValueError, match=r"outside 0\.\.60"):
        settle_from_env({"TG_ALERT_SETTLE_S": "600"})

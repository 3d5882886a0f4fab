"""The guardian's recording of a batch read off the bus, which is an untrusted input: names checked against
the inventory and the fleet, clocks that lie, and the cursor committed with the incidents it produced."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.fakes import use_controller
from trainguard.node_tools.alerts import Alert
from trainguard.node_tools.bus import BusReader, open_bus
from trainguard.node_tools.inventory import Inventory, Machine
from trainguard.node_tools.transport import RunResult, Transport
from trainguard.operators.control import ControlConfig, Controller


def _controller(tmp_path: Path) -> Controller:
    inv = Inventory(cluster="t", transport="local", bus_url=f"spool://{tmp_path / 'bus'}", machines=[
        Machine(name=f"m{i}", address="127.0.0.1", role="active" if i < 4 else "standby") for i in range(6)])
    inv.save(tmp_path / "inventory.json")
    c = Controller(ControlConfig(fleet_url=str(tmp_path / "fleet.db"), inventory=str(inv.path)), inventory=inv)
    c.sync_inventory()
    c.fleet.upsert_job("j", tp=1, pp=2, dp=2, ranks_per_machine=1, machines=["m0", "m1", "m2", "m3"])
    return c


@pytest.fixture
def ctl(tmp_path: Path) -> Controller:
    return _controller(tmp_path)


def _read(c: Controller, *alerts: Alert) -> dict:
    """Publish ``alerts`` on the controller's bus and read them as the guardian's trigger does."""
    bus = open_bus(c.inventory.bus_url)
    for a in alerts:
        bus.publish(a)
    reader = BusReader(bus, seen=c.fleet.cursor("guardian"))
    docs = [a.record() for a in reader.read()]
    return {"alerts": docs, "read": {n: t for n, t in reader.seen.items() if n not in c.fleet.cursor("guardian")},
            "gone": reader.gone, "quarantined": reader.quarantined}


def _ingest(c: Controller, event: dict) -> list[dict]:
    return c.ingest(event["alerts"], read=event["read"], gone=event["gone"], quarantined=event["quarantined"])


@pytest.mark.parametrize("forged,why", [
    (Alert("gpu_lost", "mX", job="j"), "machine 'mX' is not in the inventory"),
    (Alert("rank_exit", "m1", job="nosuchjob", rank=1), "job 'nosuchjob' is not in the fleet database"),
    (Alert("rank_exit", "m5", job="j", rank=1), "machine m5 does not serve job j"),
    (Alert("rank_exit", "m1", job="j", rank=12), "rank 12 is outside job j's 4 ranks"),
])
def test_an_alert_naming_what_the_fleet_does_not_know_is_quarantined_and_never_acted_on(ctl, forged, why):
    event = _read(ctl, forged)
    assert _ingest(ctl, event) == []  # no incident: nothing stops or restarts the job
    assert ctl.fleet.incidents("j") == [] and ctl.fleet.known_alerts([forged.id]) == set()
    [q] = ctl.fleet.quarantined()
    assert why in q.reason and q.kind == forged.kind and q.document["id"] == forged.id
    name = event["alerts"][0]["bus_name"]
    assert (Path(ctl.inventory.bus_url.removeprefix("spool://")) / "quarantine" / name).exists()
    assert ctl.fleet.cursor("guardian") == event["read"]  # read, recorded, never read again


def test_the_readers_own_quarantine_is_recorded_with_the_batch(ctl, tmp_path: Path):
    (tmp_path / "bus" / "alerts").mkdir(parents=True)
    (tmp_path / "bus" / "alerts" / f"{time.time_ns():020d}-m1-{'a' * 32}.json").write_text("x" * (1 << 20))
    event = _read(ctl, Alert("rank_exit", "m1", job="j", rank=1))
    [item] = _ingest(ctl, event)
    assert item["opened"] and item["alerts"] == 1
    [q] = ctl.fleet.quarantined()
    assert "over the limit of 65536 bytes" in q.reason and q.machine == "m1"


def test_an_alert_whose_writer_is_an_hour_off_is_handled_by_its_arrival(ctl):
    ahead = Alert("rank_exit", "m2", job="j", rank=2, ts=time.time() + 3600)
    event = _read(ctl, ahead)
    [item] = _ingest(ctl, event)
    inc = ctl.fleet.incident(item["incident"])
    [recorded] = ctl.fleet.alerts_of(inc.id)
    arrived = event["alerts"][0]["received_ts"]
    assert inc.first_alert_ts == pytest.approx(arrived) and recorded.ts == pytest.approx(arrived)
    assert recorded.document["sent_ts"] == ahead.ts and recorded.document["clock_skew_s"] > 3500


def test_the_cursor_commits_with_the_incidents_or_not_at_all(ctl, monkeypatch):
    event = _read(ctl, Alert("gpu_lost", "m1", job="j"), Alert("kernel_xid", "m1", evidence={"xid": 79}))
    from trainguard.operators.fleet import FleetStore

    real = FleetStore._attach

    def broken(self, s, job, alerts, **kw):
        real(self, s, job, alerts, **kw)
        raise RuntimeError("database went away mid-batch")

    monkeypatch.setattr(FleetStore, "_attach", broken)
    with pytest.raises(RuntimeError, match="went away"):
        _ingest(ctl, event)
    assert ctl.fleet.incidents("j") == [] and ctl.fleet.cursor("guardian") == {}  # nothing half-done
    monkeypatch.setattr(FleetStore, "_attach", real)
    [item] = _ingest(ctl, event)  # the retry reads the same alerts again and records them once
    assert item["opened"] and item["alerts"] == 2 and set(ctl.fleet.cursor("guardian")) == set(event["read"])
    assert _ingest(ctl, event) == []  # delivered a third time: a no-op


class _Quiet(Transport):
    """Machines that must not be touched: any command fails the test."""

    def run(self, machine, argv, *, timeout=30.0, stdin=None, env=None) -> RunResult:
        raise AssertionError(f"{machine.name}: {argv} was sent")

    def run_two_phase(self, machines, argv_for, *, timeout=30.0, ready_timeout=None):
        raise AssertionError(f"a stop was sent to {[m.name for m in machines]}")


def test_an_eviction_of_machines_outside_the_job_neither_stops_nor_restarts_it(ctl, monkeypatch):
    """Defence in depth: when the explicit fault names a machine that has left the job by the time the rung
    runs (replaced by hand meanwhile), evict_now touches nothing."""
    from trainguard.operators.tasks import incident as steps
    from trainguard.operators.tasks import rungs

    ctl.transport = _Quiet(ctl.inventory)
    [item] = ctl.ingest([Alert("gpu_lost", "m1", job="j").record()])
    decision = ctl.triage(item["incident"])
    assert decision["action"] == "evict" and decision["machines"] == ["m1"]
    ctl.fleet.swap("j", {"m1": "m4"}, reason="replaced by hand")
    use_controller(monkeypatch, ctl)
    out = rungs.handle(ctl, "evict_now", decision)
    assert out["swaps"] == {} and not out["restart"] and "nothing to evict" in out["reason"]
    assert steps.stop_job(ctl, item["incident"], [out])["skipped"]  # no stop (the transport refuses one)
    assert ctl.fleet.job("j").machine_list == ["m0", "m4", "m2", "m3"]
    assert json.dumps(out)  # the handler's result is still a plain document


def test_a_batch_object_with_one_untrusted_alert_stays_on_the_bus_for_the_alerts_it_recorded(ctl):
    """An agent publishes its ranks' alerts as one object: the rank outside the job is quarantined in the fleet
    database, but the object, whose other alerts were recorded, is not moved to the bus's quarantine; an object
    of untrusted alerts only still is."""
    bus = open_bus(ctl.inventory.bus_url)
    good, bad = Alert("rank_hang", "m1", job="j", rank=1), Alert("rank_hang", "m1", job="j", rank=12)
    name, held = bus.publish_batch([good, bad])
    assert held == 2
    forged = Alert("rank_hang", "m1", job="j", rank=40)
    lone = bus.publish(forged)
    reader = BusReader(bus, seen=ctl.fleet.cursor("guardian"))
    docs = [a.record() for a in reader.read()]
    [item] = ctl.ingest(docs, read=dict(reader.seen), gone=reader.gone, quarantined=reader.quarantined)
    assert item["alerts"] == 1 and ctl.fleet.known_alerts([good.id, bad.id, forged.id]) == {good.id}
    assert sorted(q.document["id"] for q in ctl.fleet.quarantined()) == sorted([bad.id, forged.id])
    spool = Path(ctl.inventory.bus_url.removeprefix("spool://"))
    assert (spool / "alerts" / name).exists() and not (spool / "quarantine" / name).exists()
    assert (spool / "quarantine" / lone).exists()


def test_an_explicit_fault_sends_a_standby_to_repair_unless_it_predates_the_standbys_self_check(ctl):
    """An alert delivered again a minute late (its first event lost) about a machine that was evicted, repaired
    and parked since speaks of the machine it was: the parked standby stays in the pool. A fresh one sends it to
    repair."""
    late = _read(ctl, Alert("gpu_lost", "m4"))  # read (its event then lost) before m4 was repaired and parked
    ctl.fleet.transition("m4", "repair", reason="sent to repair")
    ctl.fleet.transition("m4", "self_check", reason="repaired")
    ctl.fleet.transition("m4", "standby", reason="self-check passed (parked warm)")
    assert _ingest(ctl, late) == []
    assert ctl.fleet.machine("m4").state == "standby"
    assert _ingest(ctl, _read(ctl, Alert("gpu_lost", "m4"))) == []
    m4 = ctl.fleet.machine("m4")
    assert m4.state == "repair" and m4.reason == "gpu_lost while standby"


def test_observations_alone_open_no_incident_and_are_recorded_and_join_one_that_is_open(ctl):
    """A stranger's loss on random data is above 5x its median every few steps: a spike, a hot GPU or a non-fatal
    Xid is recorded without an incident (nothing to recover, and an incident open for nothing is one a real fault
    would join); beside an explicit fault, or while an incident is open, it is that incident's evidence."""
    spikes = [Alert("loss_spike", "m1", job="j", rank=1, severity="warning"),
              Alert("gpu_thermal", "m2", severity="warning"),
              Alert("gpu_xid", "m2", severity="warning", evidence={"xid": 13})]
    assert _ingest(ctl, _read(ctl, *spikes)) == []
    assert ctl.fleet.incidents("j") == []
    recorded = ctl.fleet.alerts_on(["m1", "m2"], kinds=["loss_spike", "gpu_thermal", "gpu_xid"])
    assert sorted(a.id for a in recorded) == sorted(a.id for a in spikes)
    assert all(a.incident_id is None and "observed only" in a.document["observed_only"] for a in recorded)
    crash = Alert("rank_exit", "m1", job="j", rank=1)
    later = Alert("loss_spike", "m0", job="j", rank=0, severity="warning")
    [item] = _ingest(ctl, _read(ctl, crash))
    assert item["opened"]
    [joined] = _ingest(ctl, _read(ctl, later))
    assert joined["incident"] == item["incident"] and not joined["opened"]
    assert {a.kind for a in ctl.fleet.alerts_of(item["incident"])} == {"rank_exit", "loss_spike"}

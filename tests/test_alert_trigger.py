"""The alert trigger against a real spool bus and a fleet database: a burst becomes one batch; every alert is
delivered once, whatever the writers' clocks; the cursor moves only when the batch is recorded; a silent
agent of a running job is reported once per silence; the guardian records its own poll."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

from trainguard.node_tools.alerts import Alert
from trainguard.node_tools.bus import open_bus
from trainguard.operators.fleet import FleetStore, states
from trainguard.operators.policy.liveness import AgentWatch
from trainguard.operators.triggers.alerts import AlertTrigger


def first_event(trigger: AlertTrigger, timeout: float = 20.0) -> dict:
    async def go() -> dict:
        agen = trigger.run()
        event = await asyncio.wait_for(agen.__anext__(), timeout)
        await agen.aclose()
        return event.payload

    return asyncio.run(go())


def _fleet(tmp_path: Path, *, running: bool = True) -> FleetStore:
    fleet = FleetStore(tmp_path / "fleet.db", migrate=True)
    for i in range(4):
        fleet.register_machine(f"m{i}", state=states.STANDBY)
    fleet.upsert_job("j", tp=1, pp=1, dp=2, ranks_per_machine=1, machines=["m0", "m1"])
    if not running:
        fleet.set_job_state("j", "stopped")
    return fleet


def _commit(fleet: FleetStore, event: dict) -> None:
    """What the guardian's task does with an event (the alerts aside): the cursor and the liveness."""
    fleet.ingest({}, escalation_window_s=0.0, reader=event["reader"], read=event["read"], gone=event["gone"],
                 liveness=event["liveness"])


def test_a_burst_within_the_settle_window_is_one_batch_and_later_alerts_the_next(tmp_path: Path):
    url = f"spool://{tmp_path / 'bus'}"
    bus = open_bus(url)
    fleet = _fleet(tmp_path)
    trigger = AlertTrigger(url, fleet.url, settle_s=1.0, poll_s=0.05)
    started = threading.Event()

    def publish() -> None:
        started.wait()
        for r in range(8):  # eight ranks time out within 0.4 s
            bus.publish(Alert("rank_hang", f"m{r // 4}", job="j", rank=r))
            time.sleep(0.05)
        time.sleep(2.0)  # well after the settle window: the next batch
        bus.publish(Alert("gpu_lost", "m1", job="j"))

    t = threading.Thread(target=publish)
    t.start()
    started.set()
    first = first_event(trigger)
    assert [a["rank"] for a in first["alerts"]] == list(range(8))
    assert first["fired_ts"] - first["first_seen_ts"] >= 1.0
    assert sorted(first["read"]) == sorted(a["bus_name"] for a in first["alerts"])
    # not committed (the run failed before recording it): the next run gets the same batch
    again = first_event(AlertTrigger(url, fleet.url, settle_s=0.1, poll_s=0.05))
    assert [a["id"] for a in again["alerts"]][:8] == [a["id"] for a in first["alerts"]]
    _commit(fleet, first)
    second = first_event(AlertTrigger(url, fleet.url, settle_s=0.2, poll_s=0.05))  # a new run, committed cursor
    t.join()
    assert [a["kind"] for a in second["alerts"]] == ["gpu_lost"]  # nothing from the first batch again


def test_an_alert_an_hour_ahead_neither_blinds_the_guardian_nor_hides_the_next_ones(tmp_path: Path):
    url = f"spool://{tmp_path / 'bus'}"
    bus = open_bus(url)
    fleet = _fleet(tmp_path)
    bus.publish(Alert("nic_errors", "m0", job="j", severity="warning", ts=time.time() + 3600))
    first = first_event(AlertTrigger(url, fleet.url, settle_s=0.1, poll_s=0.05))
    [ahead] = first["alerts"]
    assert ahead["clock_skew_s"] > 3500
    _commit(fleet, first)
    bus.publish(Alert("kernel_xid", "m1", evidence={"xid": 79}))
    second = first_event(AlertTrigger(url, fleet.url, settle_s=0.1, poll_s=0.05), timeout=5.0)
    assert [a["kind"] for a in second["alerts"]] == ["kernel_xid"] and "clock_skew_s" not in second["alerts"][0]


def test_the_trigger_serialises_to_its_arguments(tmp_path: Path):
    trigger = AlertTrigger("spool:///x", str(tmp_path / "f.db"), settle_s=3.0, kinds=["gpu_lost"], silent_s=15.0)
    path, kwargs = trigger.serialize()
    assert path == "trainguard.operators.triggers.alerts.AlertTrigger"
    again = AlertTrigger(**kwargs)
    assert again.serialize() == (path, kwargs)


def test_kinds_filter_what_fires(tmp_path: Path):
    url = f"spool://{tmp_path / 'bus'}"
    bus = open_bus(url)
    bus.publish(Alert("loss_spike", "m0", job="j", rank=0, severity="warning"))
    bus.publish(Alert("nan_loss", "m0", job="j", rank=0))
    event = first_event(AlertTrigger(url, settle_s=0.1, poll_s=0.05, kinds=["nan_loss"]))
    assert [a["kind"] for a in event["alerts"]] == ["nan_loss"]


def test_an_explicit_machine_fault_fires_without_waiting_out_the_settle_window(tmp_path: Path):
    url = f"spool://{tmp_path / 'bus'}"
    bus = open_bus(url)
    bus.publish(Alert("rank_slow", "m1", job="j", rank=2, severity="warning"))
    bus.publish(Alert("gpu_lost", "m0", job="j"))
    event = first_event(AlertTrigger(url, settle_s=10.0, poll_s=0.05), timeout=5.0)
    assert [a["kind"] for a in event["alerts"]] == ["rank_slow", "gpu_lost"]
    assert event["fired_ts"] - event["first_seen_ts"] < 1.0
    # a benign Xid (13: a user's illegal memory access) is not decisive: the window is waited out
    other = f"spool://{tmp_path / 'bus2'}"
    open_bus(other).publish(Alert("kernel_xid", "m0", job="j", evidence={"xid": "13"}))
    slow = first_event(AlertTrigger(other, settle_s=1.0, poll_s=0.05))
    assert slow["fired_ts"] - slow["first_seen_ts"] >= 1.0


def test_the_settle_window_and_the_silence_threshold_come_from_the_environment_and_bad_values_are_named():
    from trainguard.operators.sensors.alerts import settle_from_env, silent_from_env
    from trainguard.operators.settings import DEFAULT_SETTLE_S

    assert settle_from_env({}) == DEFAULT_SETTLE_S
    assert settle_from_env({"TG_ALERT_SETTLE_S": "1"}) == 1.0
    with pytest.raises(ValueError, match="TG_ALERT_SETTLE_S='soon' is not a number"):
        settle_from_env({"TG_ALERT_SETTLE_S": "soon"})
    with pytest.raises(ValueError, match=r"TG_ALERT_SETTLE_S=600 is above 60"):
        settle_from_env({"TG_ALERT_SETTLE_S": "600"})
    assert silent_from_env({}) == 15.0 and silent_from_env({"TG_AGENT_SILENT_S": "0"}) == 0.0
    with pytest.raises(ValueError, match=r"TG_AGENT_SILENT_S=2 must be 0 .off. or at least 5 s"):
        silent_from_env({"TG_AGENT_SILENT_S": "2"})


def test_the_agent_watch_reports_a_silence_once_and_forgives_an_agent_that_talks_again():
    watch = AgentWatch(silent_s=15.0)
    jobs = {"m0": "j", "m1": "j"}
    assert watch.observe({"m0": "a", "m1": "b"}, jobs, now=100.0) == []  # first sight: 15 s from now
    assert watch.observe({"m0": "a2", "m1": "b"}, jobs, now=110.0) == []
    [silent] = watch.observe({"m0": "a3", "m1": "b"}, jobs, now=116.0)
    assert silent == {"machine": "m1", "job": "j", "silent_s": 16.0, "last_change_ts": 100.0}
    assert watch.observe({"m0": "a4", "m1": "b"}, jobs, now=170.0) == []  # reported once per silence ...
    [still] = watch.observe({"m0": "a4", "m1": "b"}, jobs, now=177.0)  # ... and again a minute on, if still silent
    assert still["machine"] == "m1" and still["silent_s"] == 77.0
    assert watch.observe({"m0": "a5", "m1": "b2"}, jobs, now=201.0) == []  # it talks again
    [again] = watch.observe({"m0": "a6", "m1": "b2"}, jobs, now=217.0)
    assert again["machine"] == "m1"
    # a machine no longer watched (its job ended, it left the job) is never reported
    assert watch.observe({"m0": "a6"}, {}, now=500.0) == []
    alert = watch.silent_alert(again, now=217.0)
    assert alert["kind"] == "agent_silent" and alert["machine"] == "m1" and alert["job"] == "j"
    assert alert["evidence"]["silent_s"] == 16.0 and alert["received_ts"] == 217.0


def test_a_silent_agent_of_a_running_job_fires_the_trigger_and_the_guardian_records_its_poll(tmp_path: Path):
    url = f"spool://{tmp_path / 'bus'}"
    bus = open_bus(url)
    fleet = _fleet(tmp_path)
    stop = threading.Event()

    def m0_beats() -> None:  # m0's agent talks; m1's never does
        seq = 0
        while not stop.is_set():
            seq += 1
            bus.beat("m0", {"seq": seq})
            stop.wait(0.2)

    t = threading.Thread(target=m0_beats)
    t.start()
    try:
        event = first_event(AlertTrigger(url, fleet.url, settle_s=5.0, poll_s=0.05, silent_s=1.0), timeout=15.0)
    finally:
        stop.set()
        t.join()
    [silent] = event["alerts"]
    assert (silent["kind"], silent["machine"], silent["job"]) == ("agent_silent", "m1", "j")
    assert event["fired_ts"] - event["first_seen_ts"] < 1.0  # decisive: no settle window
    assert event["liveness"]["m1"]["reported_ts"] and event["liveness"]["m0"]["reported_ts"] is None
    guardian = fleet.components()["guardian"]
    assert abs(guardian.seen_ts - time.time()) < 10 and guardian.detail["watched"] == 2


def test_recorded_names_older_than_the_retention_go_to_the_archive(tmp_path: Path):
    url = f"spool://{tmp_path / 'bus'}"
    bus = open_bus(url)
    fleet = _fleet(tmp_path)
    old, new = Alert("loss_spike", "m0", job="j", rank=0, severity="warning"), Alert("nan_loss", "m0", job="j")
    bus.publish(old)
    first = first_event(AlertTrigger(url, fleet.url, settle_s=0.0, poll_s=0.05))
    [name] = first["read"]
    first["read"][name] = time.time() - 700  # recorded 700 s ago by the reader's clock
    _commit(fleet, first)
    bus.publish(new)
    second = first_event(AlertTrigger(url, fleet.url, settle_s=0.0, poll_s=0.05, retain_s=600.0))
    assert [a["id"] for a in second["alerts"]] == [new.id]
    assert (tmp_path / "bus" / "archive" / "alerts" / name).exists() and name in second["gone"]


def test_a_document_quarantined_on_its_own_fires_the_trigger_and_is_recorded_without_an_incident(tmp_path: Path):
    """An oversized document that arrived just after the alert it followed (an explicit fault fires at once)
    was moved to quarantine by the next run's reader, and that run waited for an alert that never came: the
    quarantine was never recorded."""
    import json

    from trainguard.operators.sensors.alerts import AlertSensor

    url = f"spool://{tmp_path / 'bus'}"
    (tmp_path / "bus" / "alerts").mkdir(parents=True)
    fleet = _fleet(tmp_path)
    huge = Alert("kernel_xid", "m0", evidence={"xid": 79, "blob": "x" * (1 << 20)}).to_dict()
    name = f"{time.time_ns():020d}-m0-{'b' * 32}.json"
    (tmp_path / "bus" / "alerts" / name).write_text(json.dumps(huge))
    event = first_event(AlertTrigger(url, fleet.url, settle_s=5.0, poll_s=0.05), timeout=3.0)  # no settle wait
    assert event["alerts"] == [] and [q["name"] for q in event["quarantined"]] == [name]
    # the sensor hands it on to be recorded (it refused an event without alerts before)
    assert AlertSensor(task_id="w").execute_complete({}, event) is event
    fleet.ingest({}, escalation_window_s=0.0, reader=event["reader"], read=event["read"], gone=event["gone"],
                 quarantined=event["quarantined"])
    [q] = fleet.quarantined()
    assert "over the limit" in q.reason and fleet.incidents("j") == []
    with pytest.raises(RuntimeError, match="without alerts or quarantined documents"):
        AlertSensor(task_id="w").execute_complete({}, {"alerts": [], "quarantined": []})


class _DagRuns:
    """A loopback HTTP server standing in for the api-server's ``POST /api/v2/dags/{dag}/dagRuns``: 200 for a
    new run id, 409 for one it has; every run it created, by id."""

    def __init__(self) -> None:
        import json
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        runs = self.runs = {}

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                if self.path == "/auth/token":
                    out, code = {"access_token": "jwt"}, 200
                elif body["dag_run_id"] in runs:
                    out, code = {"detail": "exists"}, 409
                else:
                    runs[body["dag_run_id"]] = {"dag": self.path.split("/")[4], "conf": body["conf"]}
                    out, code = {"dag_run_id": body["dag_run_id"]}, 200
                data = json.dumps(out).encode()
                self.send_response(code)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def dag_runs():
    server = _DagRuns()
    yield server
    server.close()


def _recording(tmp_path, monkeypatch, api_url: str | None):
    """A recording trigger over the scripted fleet's controller (its bus a real spool), its REST API the
    loopback server (None: no connection to it)."""
    from tests.fakes import fleet_controller, use_controller
    from trainguard.operators.hooks.airflow_api import AirflowApi

    c, _fleet = fleet_controller(tmp_path)
    use_controller(monkeypatch, c)

    def api(self):
        if api_url is None:
            raise LookupError("The conn_id `tg_airflow_api` isn't defined")
        return AirflowApi(api_url, username="tg_notes", password="pw", retry_s=1.0)

    monkeypatch.setattr(AlertTrigger, "_api", api)
    monkeypatch.setattr(AlertTrigger, "follow_s", 0.0)  # the follow has a test of its own
    trigger = AlertTrigger(c.inventory.bus_url, c.cfg.fleet_url, settle_s=0.2, poll_s=0.05, record=True)
    return c, trigger


def test_a_second_machines_fault_soon_after_joins_the_incident_the_trigger_just_started(tmp_path, monkeypatch,
                                                                                        dag_runs):
    """The trigger stays on the bus for ``follow_s`` after starting an incident's run: a GPU lost on a
    second machine while the first machine's full disk is being handled joins that incident within a poll
    (before its swap), instead of waiting ~10 s for the next guardian run to be scheduled."""
    c, trigger = _recording(tmp_path, monkeypatch, dag_runs.url)
    monkeypatch.setattr(AlertTrigger, "follow_s", 3.0)
    bus = open_bus(c.inventory.bus_url)
    joined: dict[str, float] = {}

    def second_fault() -> None:
        deadline = time.monotonic() + 15
        while not c.fleet.incidents("j") and time.monotonic() < deadline:
            time.sleep(0.02)  # polling for the condition: the first incident exists
        bus.publish(Alert("gpu_lost", "m2"))
        published = time.monotonic()
        while time.monotonic() < deadline:
            [inc] = c.fleet.incidents("j")
            if any(a.kind == "gpu_lost" for a in c.fleet.alerts_of(inc.id)):
                joined["s"] = time.monotonic() - published
                return
            time.sleep(0.02)

    t = threading.Thread(target=second_fault)
    began = time.monotonic()
    bus.publish(Alert("disk_full", "m1"))
    t.start()
    event = first_event(trigger)
    t.join()
    [inc] = c.fleet.incidents("j")  # one incident: the second fault joined it
    assert joined["s"] < 1.0, joined
    assert sorted(a.kind for a in c.fleet.alerts_of(inc.id)) == ["disk_full", "gpu_lost"]
    assert c.unhandled_faults(inc.id) == {"m1": "disk_full", "m2": "gpu_lost"}
    assert event["alerts"] == 2 and event["kinds"] == ["m1:disk_full", "m2:gpu_lost"]
    assert list(dag_runs.runs) == [f"incident__{inc.id}"]  # one run
    assert time.monotonic() - began >= 3.0  # it followed


def test_the_guardians_trigger_records_the_batch_and_starts_the_incidents_run_itself(tmp_path, monkeypatch, dag_runs):
    """No task between an alert and its incident's run: the trigger records the batch (incident, cursor) and
    starts the run; the sensor then only hands on what was started, and the start_incident task finds it."""
    from trainguard.operators.sensors.alerts import IncidentSensor

    c, trigger = _recording(tmp_path, monkeypatch, dag_runs.url)
    assert trigger.serialize()[1]["record"] is True
    open_bus(c.inventory.bus_url).publish(Alert("gpu_lost", "m1"))
    event = first_event(trigger)
    [inc] = c.fleet.incidents("j")
    assert event["recorded"] and event["started"] == {f"incident__{inc.id}": "started"}
    assert dag_runs.runs == {f"incident__{inc.id}": {"dag": "tg_incident", "conf": {
        "incident_id": inc.id, "job": "j", "first_seen_ts": event["first_seen_ts"]}}}
    assert c.fleet.cursor("guardian")  # committed with the incident, in the triggerer
    starts = IncidentSensor(task_id="wait_for_alerts").execute_complete({}, event)
    assert starts == [{"conf": dag_runs.runs[f"incident__{inc.id}"]["conf"], "trigger_run_id": f"incident__{inc.id}"}]
    assert "alerts" not in event or isinstance(event["alerts"], int)  # the batch itself does not travel again


def test_without_the_rest_api_the_start_incident_task_starts_the_run(tmp_path, monkeypatch):
    from trainguard.operators.sensors.alerts import IncidentSensor

    c, trigger = _recording(tmp_path, monkeypatch, None)
    open_bus(c.inventory.bus_url).publish(Alert("gpu_lost", "m1"))
    event = first_event(trigger)
    [inc] = c.fleet.incidents("j")
    assert event["recorded"] and event["started"][f"incident__{inc.id}"].startswith("not started: ")
    # the task after the sensor (start_incident) is handed the run to start
    assert [s["trigger_run_id"] for s in IncidentSensor(task_id="w").execute_complete({}, event)] == [
        f"incident__{inc.id}"]


def test_a_batch_the_trigger_cannot_record_is_recorded_by_the_sensor(tmp_path, monkeypatch, dag_runs):
    from trainguard.operators.sensors.alerts import IncidentSensor
    from trainguard.operators.tasks import guardian

    c, trigger = _recording(tmp_path, monkeypatch, dag_runs.url)
    real = guardian.group_alerts

    calls: list[str] = []

    def locked(ctl, event):  # the fleet database does not answer in the triggerer (its first call)
        calls.append("call")
        if len(calls) == 1:
            raise RuntimeError("database is locked")
        return real(ctl, event)

    monkeypatch.setattr(guardian, "group_alerts", locked)
    open_bus(c.inventory.bus_url).publish(Alert("gpu_lost", "m1"))
    event = first_event(trigger)
    assert not event.get("recorded") and [a["kind"] for a in event["alerts"]] == ["gpu_lost"]
    assert c.fleet.incidents("j") == [] and dag_runs.runs == {}  # nothing recorded, nothing started
    [start] = IncidentSensor(task_id="w").execute_complete({}, event)
    [inc] = c.fleet.incidents("j")
    assert start["trigger_run_id"] == f"incident__{inc.id}" and c.fleet.cursor("guardian")


def test_an_open_incident_whose_run_was_never_started_is_started_by_the_sweep_once(tmp_path, monkeypatch, dag_runs):
    """The starter died between recording the incident and starting its run: the trigger's sweep starts it;
    incidents whose runs exist, incidents opened by hand and young ones are left alone."""
    from tests.fakes import alert
    from trainguard.operators.tasks import guardian

    c, trigger = _recording(tmp_path, monkeypatch, dag_runs.url)
    [item] = c.ingest([alert("gpu_lost", "m1")])
    c.fleet.upsert_job("k", tp=1, pp=1, dp=1, ranks_per_machine=1, machines=["m5"])
    by_hand, _ = c.fleet.open_incident("k", [], category="manual")  # a diagnosis by hand: no alerts
    assert guardian.orphans(c) == []  # too young: its start may be on its way
    later = time.time() + guardian.ORPHAN_AFTER_S + 1
    [orphan] = guardian.orphans(c, now=later)  # not the one by hand
    assert orphan["trigger_run_id"] == f"incident__{item['incident']}" and by_hand.id != item["incident"]
    monkeypatch.setattr(guardian, "ORPHAN_AFTER_S", 0.0)
    monkeypatch.setattr(guardian, "orphans", lambda ctl: [orphan])
    trigger._sweep()
    trigger._sweep()  # again: the run exists
    assert list(dag_runs.runs) == [f"incident__{item['incident']}"]

"""The alert watcher against a real spool bus and a fleet database: a burst becomes one batch; every alert is
delivered once, whatever the writers' clocks; the watcher writes nothing (not the fleet database, not the bus): the
cursor moves only when a task records the batch, and a batch nobody recorded is emitted again; a silent agent of a
running job is reported once per silence. The recording (tg_incident's triage task): the batch into incidents, the
incident claimed by the run, a batch that only joined an open incident ending its run."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from trainguard.node_tools.alerts import Alert
from trainguard.node_tools.bus import open_bus
from trainguard.operators.fleet import FleetStore, states
from trainguard.operators.policy.liveness import AgentWatch
from trainguard.operators.triggers.alerts import AlertTrigger


def first_event(trigger: AlertTrigger, timeout: float = 20.0) -> dict:
    return events(trigger, 1, timeout=timeout)[0]


def events(trigger: AlertTrigger, n: int, *, timeout: float = 20.0, between: Any = None) -> list[dict]:
    """The first ``n`` events of one run of ``trigger`` (a watcher emits batch after batch); ``between(i, event)``
    runs after the i-th."""
    async def go() -> list[dict]:
        agen = trigger.run()
        out = []
        try:
            for i in range(n):
                out.append((await asyncio.wait_for(agen.__anext__(), timeout)).payload)
                if between is not None:
                    await asyncio.to_thread(between, i, out[-1])
        finally:
            await agen.aclose()
        return out

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
        for r in range(8):  # eight ranks of m0 time out within 0.4 s (m1, whose agent was never seen, says nothing)
            bus.publish(Alert("rank_hang", "m0", job="j", rank=r))
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


def test_a_crash_that_names_its_machine_fires_without_waiting_out_the_settle_window(tmp_path: Path):
    """Its rung restarts the job at once: a second of settling was a quarter of the whole recovery."""
    url = f"spool://{tmp_path / 'bus'}"
    open_bus(url).publish(Alert("rank_exit", "m2", job="j", rank=2, evidence={"exit_code": -9}))
    event = first_event(AlertTrigger(url, settle_s=10.0, poll_s=0.05), timeout=5.0)
    assert [a["kind"] for a in event["alerts"]] == ["rank_exit"] and event["fired_ts"] - event["first_seen_ts"] < 1.0
    # a hang's reports gather for the window (thousands of ranks time out together: one batch, one run), and so
    # do fail-slow reports (a shared slowdown is told from a straggler on the job's reports together)
    other = f"spool://{tmp_path / 'bus2'}"
    open_bus(other).publish(Alert("rank_hang", "m2", job="j", rank=2))
    hang = first_event(AlertTrigger(other, settle_s=1.0, poll_s=0.05))
    assert hang["fired_ts"] - hang["first_seen_ts"] >= 1.0
    third = f"spool://{tmp_path / 'bus3'}"
    open_bus(third).publish(Alert("throughput_decline", "m2", job="j", rank=2, severity="warning"))
    slow = first_event(AlertTrigger(third, settle_s=1.0, poll_s=0.05))
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


def test_a_silent_agent_of_a_running_job_fires_the_trigger_and_nothing_is_written_until_a_task_records_it(
        tmp_path: Path):
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
    assert event["watcher"]["watched"] == 2 and event["watcher"]["polls"] >= 1
    # the watcher wrote nothing: no beat, no liveness, no cursor in the fleet database
    assert fleet.components() == {} and fleet.liveness() == {} and fleet.cursor("guardian") == {}


def test_recorded_names_older_than_the_retention_go_to_the_archive_when_a_task_records(tmp_path: Path, monkeypatch):
    from tests.fakes import fleet_controller
    from trainguard.operators.tasks import guardian

    c, _fake = fleet_controller(tmp_path)
    bus = open_bus(c.inventory.bus_url)
    old, new = Alert("loss_spike", "m0", job="j", rank=0, severity="warning"), Alert("nan_loss", "m0", job="j")
    bus.publish(old)
    first = first_event(AlertTrigger(c.inventory.bus_url, c.cfg.fleet_url, settle_s=0.0, poll_s=0.05, silent_s=0))
    [name] = first["read"]
    first["read"][name] = time.time() - 700  # read 700 s ago by the watcher's clock
    guardian.record(c, first, retain_s=600.0)
    assert (Path(c.inventory.bus_url.removeprefix("spool://")) / "archive" / "alerts" / name).exists()
    assert name not in c.fleet.cursor("guardian")  # out of the folder and of the cursor in one go
    bus.publish(new)
    second = first_event(AlertTrigger(c.inventory.bus_url, c.cfg.fleet_url, settle_s=0.0, poll_s=0.05, silent_s=0))
    assert [a["id"] for a in second["alerts"]] == [new.id]


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
    assert (tmp_path / "bus" / "alerts" / name).exists()  # the watcher moves nothing
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


def _snapshot(fleet: FleetStore, bus_root: Path) -> dict:
    """What the fleet database holds that a recording would change, and every file on the bus."""
    return {"incidents": [(i.id, i.state) for i in fleet.incidents("j")], "alerts": fleet.known_alerts([]),
            "cursor": fleet.cursor("guardian"), "components": sorted(fleet.components()),
            "liveness": sorted(fleet.liveness()), "quarantined": len(fleet.quarantined()),
            "actions": len(fleet.actions()),
            "files": sorted(str(p.relative_to(bus_root)) for p in bus_root.rglob("*") if p.is_file()
                            and "heartbeats" not in p.parts)}


def test_the_watcher_only_watches_it_writes_no_database_row_and_moves_no_bus_object(tmp_path: Path):
    """Alerts, an oversized document, an agent silent and a job running: the watcher emits all of it and leaves the
    fleet database and the bus exactly as they were (recording is the tasks')."""
    import json

    url = f"spool://{tmp_path / 'bus'}"
    bus = open_bus(url)
    fleet = _fleet(tmp_path)
    bus.publish(Alert("rank_exit", "m0", job="j", rank=0))
    huge = Alert("kernel_xid", "m1", evidence={"xid": 79, "blob": "x" * (1 << 20)}).to_dict()
    (tmp_path / "bus" / "alerts" / f"{time.time_ns():020d}-m1-{'c' * 32}.json").write_text(json.dumps(huge))
    bus.beat("m0", {"seq": 1})
    before = _snapshot(fleet, tmp_path / "bus")
    got = events(AlertTrigger(url, fleet.url, settle_s=0.3, poll_s=0.05, silent_s=5.0), 1, timeout=10.0)
    assert [a["kind"] for a in got[0]["alerts"]] == ["rank_exit"] and len(got[0]["quarantined"]) == 1
    assert _snapshot(fleet, tmp_path / "bus") == before


def test_a_batch_nobody_recorded_is_emitted_again_and_a_recorded_one_never(tmp_path: Path, monkeypatch):
    """Level-triggered: the run for a batch failed (the database blinked); the same watcher reads the committed
    cursor again and emits the batch once more; once a task records it, nothing of it comes again."""
    from trainguard.operators.triggers import alerts as watcher

    monkeypatch.setattr(watcher, "CURSOR_EVERY_S", 0.1)
    url = f"spool://{tmp_path / 'bus'}"
    bus = open_bus(url)
    fleet = _fleet(tmp_path)
    bus.publish(Alert("nan_loss", "m0", job="j", rank=0))
    seen: list[dict] = []

    def after(i: int, event: dict) -> None:
        seen.append(event)
        if i == 1:  # the second time: recorded now
            _commit(fleet, event)
            bus.publish(Alert("gpu_lost", "m1"))

    got = events(AlertTrigger(url, fleet.url, settle_s=0.0, poll_s=0.05, silent_s=0, reemit_s=0.5), 3,
                 timeout=10.0, between=after)
    first, again, third = got
    assert [a["id"] for a in again["alerts"]] == [a["id"] for a in first["alerts"]]  # the same alert, once more
    assert again["watcher"]["reemitted"] >= 1 and again["fired_ts"] - first["fired_ts"] >= 0.5
    # it arrived when first read: a late emission neither looks like a writer's skewed clock nor like news
    assert [a["received_ts"] for a in again["alerts"]] == [a["received_ts"] for a in first["alerts"]]
    assert not any(a.get("clock_skew_s") for a in again["alerts"])
    assert [a["kind"] for a in third["alerts"]] == ["gpu_lost"]  # recorded: never again


def _asset_events(*payloads: dict) -> dict:
    class Event:
        def __init__(self, payload: dict) -> None:
            self.extra = {"from_trigger": True, "payload": payload}

    return {"trainguard-alerts": [Event(p) for p in payloads]}


def test_a_run_for_a_batch_records_it_claims_the_incident_it_opened_and_a_retry_finds_it(tmp_path: Path):
    from tests.fakes import fleet_controller
    from trainguard.operators.tasks import guardian

    c, _fake = fleet_controller(tmp_path)
    bus = open_bus(c.inventory.bus_url)
    bus.publish(Alert("gpu_lost", "m1"))
    event = first_event(AlertTrigger(c.inventory.bus_url, c.cfg.fleet_url, settle_s=0.1, poll_s=0.05, silent_s=0))
    incident, starts, line = guardian.incident_of_run(c, guardian.events_of(_asset_events(event)), run="asset_1")
    [inc] = c.fleet.incidents("j")
    assert incident == inc.id and starts == [] and f"incident {inc.id} opened" in line
    assert c.fleet.claimed_by("asset_1") == [inc.id] and c.fleet.cursor("guardian")
    assert c.fleet.claims_of(inc.id) == [{"run": "asset_1", "first_seen_ts": event["first_seen_ts"]}]
    assert c.fleet.components()["guardian"].detail["run"] == "asset_1"  # the beat, from the task
    # the task tried again (it failed after recording): the same incident, nothing recorded twice
    again, _, _ = guardian.incident_of_run(c, guardian.events_of(_asset_events(event)), run="asset_1")
    assert again == inc.id and len(c.fleet.alerts_of(inc.id)) == 1 and len(c.fleet.incidents("j")) == 1


def test_a_batch_that_only_joined_an_open_incident_ends_its_run_at_the_triage(tmp_path: Path, monkeypatch):
    """A second machine's fault after the first one's batch: its run records it into the open incident and skips
    every task after the triage (the first run evicts both in one restart)."""
    from airflow.sdk import DAG
    from airflow.sdk.exceptions import DownstreamTasksSkipped

    from tests.fakes import fleet_controller, use_controller
    from trainguard.operators.operators.triage import TriageOperator

    c, _fake = fleet_controller(tmp_path)
    use_controller(monkeypatch, c)
    notes: list[str] = []
    monkeypatch.setattr("trainguard.operators.tasks.common.note", notes.append)
    bus = open_bus(c.inventory.bus_url)
    with DAG("t", schedule=None):
        op = TriageOperator(task_id="triage")
        after = TriageOperator(task_id="after")  # anything downstream
        op >> after

    class TI:
        map_index = -1

        def __init__(self) -> None:
            self.xcom: dict = {}

        def xcom_push(self, key: str, value: object) -> None:
            self.xcom[key] = value

    def run(name: str, payload: dict) -> tuple[TI, object]:
        ti = TI()
        ctx = {"ti": ti, "run_id": name, "params": {}, "task": op, "triggering_asset_events": _asset_events(payload)}
        try:
            return ti, op.choose_branch(ctx)
        except DownstreamTasksSkipped as skipped:
            return ti, skipped

    watcher = AlertTrigger(c.inventory.bus_url, c.cfg.fleet_url, settle_s=0.1, poll_s=0.05, silent_s=0)
    bus.publish(Alert("disk_full", "m1"))
    ti, branch = run("asset_1", first_event(watcher))
    [inc] = c.fleet.incidents("j")
    assert branch == "evict_now" and ti.xcom["incident"] == inc.id and ti.xcom["decision"]["machines"] == ["m1"]
    bus.publish(Alert("gpu_lost", "m2"))
    _commit_by = c.fleet.cursor("guardian")
    assert _commit_by  # the first batch's names are recorded: the next watcher does not send them again
    ti2, skipped = run("asset_2", first_event(AlertTrigger(c.inventory.bus_url, c.cfg.fleet_url, settle_s=0.1,
                                                           poll_s=0.05, silent_s=0)))
    assert isinstance(skipped, DownstreamTasksSkipped) and list(skipped.tasks) == ["after"]
    assert "incident" not in ti2.xcom and c.fleet.claimed_by("asset_2") == []
    assert c.incidents.unhandled_faults(inc.id) == {"m1": "disk_full", "m2": "gpu_lost"}  # one incident, both
    assert notes and f"joined incident(s) {inc.id}" in notes[-1]


def test_a_batch_of_two_jobs_opens_two_incidents_this_run_handles_one_and_starts_the_other(tmp_path: Path,
                                                                                         monkeypatch, dag_runs):
    from tests.fakes import alert, fleet_controller
    from trainguard.operators.hooks.airflow_api import AirflowApi, AirflowApiHook
    from trainguard.operators.tasks import guardian

    c, _fake = fleet_controller(tmp_path)
    c.fleet.upsert_job("k", tp=1, pp=1, dp=1, ranks_per_machine=1, machines=["m4"])
    monkeypatch.setattr(AirflowApiHook, "get_client",
                        lambda self: AirflowApi(dag_runs.url, username="u", password="p", retry_s=1.0))
    event = {"alerts": [alert("gpu_lost", "m1"), alert("gpu_lost", "m4", job="k")], "first_seen_ts": time.time(),
             "fired_ts": time.time(), "reader": "guardian", "read": {}, "gone": [], "quarantined": []}
    incident, starts, _ = guardian.incident_of_run(c, [event], run="asset_9")
    [mine] = c.fleet.incidents("j")
    [other] = c.fleet.incidents("k")
    assert incident == mine.id and c.fleet.claimed_by("asset_9") == [mine.id]
    assert [s["trigger_run_id"] for s in starts] == [f"incident__{other.id}"]
    assert guardian.start_soon(starts) == {f"incident__{other.id}": "started"}
    assert dag_runs.runs[f"incident__{other.id}"]["conf"]["incident_id"] == other.id
    assert guardian.start_soon(starts) == {f"incident__{other.id}": "exists"}  # started once


def test_a_hang_batch_goes_out_once_every_machine_of_its_job_spoke_or_went_quiet(tmp_path: Path):
    """A lost machine: the survivors' ranks time out together and its agent stopped beating with it; the settle
    window had nothing more to gather, and cost a second of every GPU of the job."""
    url = f"spool://{tmp_path / 'bus'}"
    bus = open_bus(url)
    fleet = _fleet(tmp_path)
    now = time.time()
    fleet.record_liveness({"m0": {"token": "", "changed_ts": now}, "m1": {"token": "", "changed_ts": now - 10.0}})
    bus.publish(Alert("rank_hang", "m0", job="j", rank=0))  # m1 says nothing: its agent quiet for 10 s
    event = first_event(AlertTrigger(url, fleet.url, settle_s=10.0, poll_s=0.05, silent_s=60.0), timeout=8.0)
    assert [a["machine"] for a in event["alerts"]] == ["m0"] and event["fired_ts"] - event["first_seen_ts"] < 1.0
    # m1's agent beating (recorded a moment ago): the window is waited out for its word
    other = tmp_path / "other"
    other.mkdir()
    fleet2 = _fleet(other)
    fleet2.record_liveness({"m0": {"token": "", "changed_ts": time.time()},
                            "m1": {"token": "", "changed_ts": time.time()}})
    url2 = f"spool://{other / 'bus'}"
    open_bus(url2).publish(Alert("rank_hang", "m0", job="j", rank=0))
    waited = first_event(AlertTrigger(url2, fleet2.url, settle_s=1.5, poll_s=0.05, silent_s=60.0))
    assert waited["fired_ts"] - waited["first_seen_ts"] >= 1.5


def test_heard_from_all_counts_a_word_or_a_quiet_agent_from_every_machine_of_the_named_jobs():
    from trainguard.operators.policy.liveness import QUIET_S, heard_from_all

    watched = {"m0": "j", "m1": "j", "m2": "k"}
    state = {"m0": {"changed_ts": 100.0}, "m1": {"changed_ts": 100.0}, "m2": {"changed_ts": 0.0}}
    hang = [{"kind": "rank_hang", "machine": "m0", "job": "j"}]
    assert not heard_from_all(hang, watched, state, 101.0)  # m1's agent beat a second ago: its word may come
    assert heard_from_all(hang, watched, state, 100.0 + QUIET_S)  # quiet for QUIET_S: nothing will come from it
    assert heard_from_all([*hang, {"kind": "rank_hang", "machine": "m1", "job": "j"}], watched, state, 101.0)
    assert not heard_from_all(hang, watched, {"m0": {"changed_ts": 100.0}}, 200.0)  # m1 never seen: wait for it
    assert not heard_from_all([{"kind": "gpu_lost", "machine": "m0", "job": ""}], watched, state, 500.0)  # no job
    assert not heard_from_all([{"kind": "rank_hang", "machine": "x", "job": "gone"}], watched, state, 500.0)
    assert not heard_from_all(hang, watched, {**state, "m1": {"changed_ts": "soon"}}, 500.0)  # a lying record

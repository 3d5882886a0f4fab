"""The trainguard command line: what its help promises exists."""

from __future__ import annotations

import json

from trainguard.emulation import faults
from trainguard.operators.cli import main


def test_inject_list_names_every_fault_kind_its_help_points_to(capsys):
    """``trainguard inject --help`` pointed to an ``inject --list`` that did not exist."""
    assert main(["inject", "--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == list(faults.FAULT_KINDS)
    assert main(["--json", "inject", "--list"]) == 0
    kinds = json.loads(capsys.readouterr().out)
    assert {k["kind"]: k["target"] for k in kinds} == {n: f.target for n, f in faults.FAULT_KINDS.items()}
    assert {k["kind"]: k["params"] for k in kinds}["slow"] == {"seconds": 0.5}


def test_inject_without_a_machine_is_one_line_and_exit_2(capsys, tmp_path):
    assert main(["--state-dir", str(tmp_path), "inject", "--fault", "crash"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "trainguard: inject needs --machine NAME (or --list for the fault kinds)"


def test_fleet_migrate_provisions_the_database_once_and_readers_never_migrate(capsys, tmp_path, monkeypatch):
    """Only ``trainguard fleet migrate`` creates or migrates the fleet database; a command that reads it
    before says what to run, in one line, and creates nothing."""
    from trainguard.node_tools.inventory import Inventory, Machine

    inv = Inventory(cluster="t", transport="local", bus_url=f"spool://{tmp_path / 'bus'}",
                    machines=[Machine(name=f"m{i}", address=f"10.0.0.{i + 1}", role="active") for i in range(2)])
    inv.save(tmp_path / "inventory.json")
    monkeypatch.setenv("TG_FLEET_URL", str(tmp_path / "fleet.db"))
    monkeypatch.setenv("TG_INVENTORY", str(tmp_path / "inventory.json"))
    assert main(["ettr", "--job", "j"]) == 2
    assert "provision it first: trainguard fleet migrate" in capsys.readouterr().err
    assert not (tmp_path / "fleet.db").exists()
    assert main(["--json", "fleet", "migrate"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["migrations_applied"] and doc["machines_added"] == ["m0", "m1"]
    assert main(["--json", "fleet", "migrate"]) == 0  # again: nothing to do
    again = json.loads(capsys.readouterr().out)
    assert again["migrations_applied"] == [] and again["machines_added"] == []
    assert main(["revision", "list", "--job", "nosuch"]) == 2  # a reader of the provisioned database
    assert "job nosuch is not in the fleet database" in capsys.readouterr().err


def test_the_emulation_commands_come_from_their_entry_point():
    from trainguard.operators.cli import build_parser

    _parser, handlers = build_parser()
    assert {"cluster", "inject", "demo", "controlplane"} <= set(handlers) and "job" not in handlers  # the product's
    assert all(h.__module__ == "trainguard.emulation.cli" for h in handlers.values())


def test_incident_close_ends_a_waiting_incident_and_hands_its_job_back_to_the_reconciler(capsys, tmp_path,
                                                                                         monkeypatch):
    """No documented command closed an incident: one that waited for a human stayed waiting after the job was
    put right, and 'trainguard status' said HUMAN NEEDED while the job trained."""
    from tests.fakes import alert, fleet_controller

    c, _fleet = fleet_controller(tmp_path)
    monkeypatch.setenv("TG_FLEET_URL", c.cfg.fleet_url)
    monkeypatch.setenv("TG_INVENTORY", c.cfg.inventory)
    [item] = c.ingest([alert("rank_hang", "m1", rank=1)])
    c.fleet.wait_for_human(item["incident"], "the breaker: raise TG_BREAKER_SHARE")
    capsys.readouterr()
    assert main(["incident", "list"]) == 0
    assert f"{item['incident']}" in capsys.readouterr().out
    assert main(["incident", "close", str(item["incident"]), "--note", "m1 reseated"]) == 0
    assert f"incident {item['incident']} closed (failed); job j is running" in capsys.readouterr().out
    inc = c.fleet.incident(item["incident"])
    assert inc.state == "failed" and inc.summary.startswith("closed by hand: m1 reseated")
    assert main(["incident", "close", str(item["incident"])]) == 0  # again: nothing to do
    assert "was closed already" in capsys.readouterr().out
    assert main(["incident", "retry", str(item["incident"])]) == 2  # a closed incident is not retried
    assert "only one that is open or waits for a human" in capsys.readouterr().err
    assert main(["incident", "close", "999"]) == 2


def test_incident_show_prints_where_an_incidents_seconds_went(capsys, tmp_path, monkeypatch):
    """A recovery that took 29 s where the same fault took 11 s earlier left no trace of which step took the
    time: ``incident show`` prints the timeline the fleet database recorded, on the first alert's clock."""
    from tests.fakes import alert, fleet_controller, run_incident

    c, _fleet = fleet_controller(tmp_path)
    monkeypatch.setenv("TG_FLEET_URL", c.cfg.fleet_url)
    monkeypatch.setenv("TG_INVENTORY", c.cfg.inventory)
    out = run_incident(c, [alert("gpu_lost", "m1")], monkeypatch)
    capsys.readouterr()
    assert main(["--json", "incident", "show", str(out["incident"])]) == 0
    doc = json.loads(capsys.readouterr().out)
    whats = [e["what"] for e in doc["events"]]
    assert doc["state"] == "resolved" and whats[0] == "alert gpu_lost on m1"
    assert [e["t"] for e in doc["events"]] == sorted(e["t"] for e in doc["events"])
    for milestone in ("incident opened", "decided", "job trained again", "incident closed"):
        assert milestone in whats
    evict = next(e for e in doc["events"] if e["what"].startswith("evict m1"))
    assert evict["took_s"] is not None and evict["took_s"] >= 0
    inc = c.fleet.incident(out["incident"])
    closed = next(e for e in doc["events"] if e["what"] == "incident closed")
    assert closed["t"] == round(inc.closed_ts - inc.first_alert_ts, 3)
    assert main(["incident", "show", str(out["incident"])]) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"incident {out['incident']} of job j: resolved") and "evict m1" in text
    assert main(["incident", "show", "999"]) == 2
    assert "incident 999 does not exist" in capsys.readouterr().err


def test_an_incidents_timeline_places_its_runs_tasks_with_their_queue_wait():
    from types import SimpleNamespace

    from trainguard.operators.control.timeline import format_timeline, incident_timeline

    inc = SimpleNamespace(id=3, job="j", state="resolved", category="crash", level=0, summary="", lost_steps=None,
                          first_alert_ts=100.0, opened_ts=100.5, diagnosis_start_ts=None, decided_ts=103.0,
                          resumed_ts=110.0, closed_ts=111.0)
    fleet = SimpleNamespace(incident=lambda _i: inc, alerts_of=lambda _i: [], actions=lambda _i: [],
                            claims_of=lambda _i: [{"run": "r1", "first_seen_ts": 100.2}])
    tasks = {"r1": [{"task_id": "triage", "map_index": -1, "state": "success", "queued": 100.6, "started": 101.6,
                     "ended": 102.0},
                    {"task_id": "stop_job", "map_index": -1, "state": "skipped", "queued": None, "started": None,
                     "ended": None},
                    {"task_id": "restart_job", "map_index": -1, "state": "running", "queued": 103.0,
                     "started": 103.1, "ended": None},
                    {"task_id": "wait_for_resume", "map_index": -1, "state": "success", "queued": 109.0,
                     "started": 104.0, "ended": 110.5},  # deferred: queued again when its trigger fired
                    {"task_id": "probe", "map_index": 0, "state": "success", "queued": 103.9, "started": 104.0,
                     "ended": 104.5}]}
    doc = incident_timeline(fleet, 3, tasks)
    rows = {e["what"]: e for e in doc["events"]}
    assert rows["task triage success (run r1, queued 1.00s)"] == {"t": 1.6, "what": "task triage success (run r1, "
                                                                              "queued 1.00s)", "took_s": 0.4}
    assert rows["task restart_job running (run r1, queued 0.10s)"]["took_s"] is None  # still running
    assert not any("stop_job" in w for w in rows)  # never started: no time to place
    assert rows["task wait_for_resume success (run r1)"]["took_s"] == 6.5  # no negative queue wait
    assert "task probe[0] success (run r1, queued 0.10s)" in rows  # a mapped task's first index is shown too
    assert [e["t"] for e in doc["events"]] == [0.2, 0.5, 1.6, 3.0, 3.1, 4.0, 4.0, 10.0, 11.0]
    assert "+1.60s  task triage success (run r1, queued 1.00s)  (0.40s)" in format_timeline(doc)

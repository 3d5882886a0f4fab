"""Submitting a job (trainguard job submit -> tg_job_launch's task bodies) on the scripted fleet: machines are
reserved from the free pool in one transaction, checked, started and watched to their first step; a failed step
releases them; the same submission twice is one job; stopping returns the machines to the pool."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from tests.fakes import fleet_controller, use_controller
from trainguard.operators.cli import main
from trainguard.operators.fleet import states
from trainguard.operators.fleet.store import FleetError
from trainguard.operators.jobspec import parse_spec
from trainguard.operators.tasks import launch

SPEC = {"name": "team", "command": ["train.py", "--epochs", "3"], "workdir": "/srv/team", "machines": 2}


def _launch(c, spec: dict) -> dict:
    checked = launch.check(c, launch.reserve(c, launch.validate({"spec": spec})))
    return launch.first_step(c, launch.start(c, checked), timeout_s=30)


def test_a_submitted_job_takes_free_machines_starts_there_and_is_running_after_its_first_step(tmp_path, monkeypatch):
    c, fleet = fleet_controller(tmp_path)  # m0..m3 run job j; m4, m5 are free standbys
    use_controller(monkeypatch, c)
    assert c.fleet.free_machines() == ["m4", "m5"]
    out = _launch(c, SPEC)
    assert out["job"] == "team" and out["step"] >= 0
    job = c.fleet.job("team")
    assert job.state == "running" and job.machine_list == ["m4", "m5"] and job.spec == parse_spec(SPEC).document()
    assert {c.fleet.machine(n).state for n in ("m4", "m5")} == {states.ACTIVE} and c.fleet.free_machines() == []
    starts = [(m, argv) for m, argv in fleet.commands if argv[:2] == ["job", "start"] and "team" in argv]
    assert sorted(m for m, _ in starts) == ["m4", "m5"]
    argv = starts[0][1]
    assert argv[argv.index("--entry") + 1] == "train.py" and argv[argv.index("--workdir") + 1] == "/srv/team"
    assert argv[argv.index("--") + 1:] == ["--epochs", "3"]
    # the same submission again is the same job: nothing reserved or started twice
    again = launch.reserve(c, launch.validate({"spec": SPEC}))
    assert again == {"job": "team", "machines": ["m4", "m5"], "submitted": False, "any_free": True}


def test_a_machine_that_fails_its_check_ends_the_launch_when_no_free_one_can_take_its_place(tmp_path, monkeypatch):
    c, fleet = fleet_controller(tmp_path)
    use_controller(monkeypatch, c)
    fleet.l1 = {"m5": "GPU 3 lost"}
    reserved = launch.reserve(c, launch.validate({"spec": SPEC}))
    with pytest.raises(Exception, match=r"machines failed L1: m5: .*GPU 3 lost; 0 free machines left"):
        launch.check(c, reserved)
    assert c.fleet.job("team").state == "failed"
    assert c.fleet.machine("m4").state == states.STANDBY and c.fleet.machine("m4").job is None
    assert not fleet.sent("job", "start") or "m4" not in fleet.sent("job", "start")
    # the machine that failed is not handed back to the pool, where the next submission would take it again
    assert c.fleet.machine("m5").state == states.EVICTED and c.fleet.free_machines() == ["m4"]


def test_a_machine_that_fails_its_check_is_replaced_by_a_free_one_and_the_launch_goes_on(tmp_path, monkeypatch):
    """A resubmitted job once took the machine with the lost GPU (back in the pool after a stop), failed its
    check on it, and ended there though other machines were free."""
    c, fleet = fleet_controller(tmp_path, machines=7)  # m4, m5, m6 free
    use_controller(monkeypatch, c)
    fleet.l1 = {"m4": "7 of 8 GPUs visible"}
    checked = launch.check(c, launch.reserve(c, launch.validate({"spec": SPEC})))
    assert checked["replaced"] == {"m4": "m6"} and checked["machines"] == ["m6", "m5"]
    assert c.fleet.machine("m4").state == states.EVICTED
    out = launch.first_step(c, launch.start(c, checked), timeout_s=30)
    assert out["step"] >= 0 and c.fleet.job("team").machine_list == ["m6", "m5"]
    assert sorted(m for m, argv in fleet.commands if argv[:2] == ["job", "start"] and "team" in argv) == ["m5", "m6"]


def test_a_job_that_named_its_machines_takes_no_other_when_one_fails_its_check(tmp_path, monkeypatch):
    c, fleet = fleet_controller(tmp_path, machines=7)
    use_controller(monkeypatch, c)
    fleet.l1 = {"m4": "7 of 8 GPUs visible"}
    reserved = launch.reserve(c, launch.validate({"spec": {**SPEC, "machines": ["m4", "m5"]}}))
    with pytest.raises(Exception, match=r"machines failed L1: m4: .*7 of 8 GPUs visible$"):
        launch.check(c, reserved)
    assert c.fleet.free_machines() == ["m5", "m6"]


def test_the_same_spec_submitted_again_never_touches_the_running_job_even_when_a_check_would_fail(
        tmp_path, monkeypatch):
    c, fleet = fleet_controller(tmp_path)
    use_controller(monkeypatch, c)
    _launch(c, SPEC)
    starts = len(fleet.sent("job", "start"))
    fleet.l1 = {"m5": "GPU 3 lost"}  # were it checked again, the launch would release the machines
    out = _launch(c, SPEC)
    assert out["skipped"] == "job team was launched by an earlier submission"
    assert c.fleet.job("team").state == "running" and c.fleet.job("team").machine_list == ["m4", "m5"]
    assert len(fleet.sent("job", "start")) == starts and not fleet.sent("job", "stop")


def test_a_released_job_is_never_restarted_by_a_recovery_that_was_under_way(tmp_path, monkeypatch):
    """A launch that failed (or a stop) released the machines while an incident of the job was open: its
    restart must not start the job on machines that may serve another job by now."""
    c, fleet = fleet_controller(tmp_path)
    use_controller(monkeypatch, c)
    _launch(c, SPEC)
    c.release("team", state="failed", reason="test")
    starts = len(fleet.sent("job", "start"))
    with pytest.raises(Exception, match=r"job team was stopped .* and its machines released; submit it again"):
        c.launch_submitted("team")
    assert len(fleet.sent("job", "start")) == starts


def test_a_job_stopped_while_a_restart_of_it_starts_stays_stopped_and_what_the_restart_started_is_ended(
        tmp_path, monkeypatch):
    """``trainguard job stop`` while a restart of the job is under way (an incident's): the restart's start lands
    after the stop's. The launch must neither leave the job's processes on machines that went back to the pool nor
    set the released job running again."""
    c, fleet = fleet_controller(tmp_path)
    use_controller(monkeypatch, c)
    _launch(c, SPEC)
    run, once = fleet.run, threading.Lock()

    def stopped_meanwhile(machine, argv, **kw):
        out = run(machine, argv, **kw)
        if [str(a) for a in argv][1:3] == ["job", "start"] and once.acquire(blocking=False):
            c.release("team")  # the person's stop, between the restart's check and its start
        return out

    monkeypatch.setattr(fleet, "run", stopped_meanwhile)
    stops = len(fleet.sent("job", "stop"))
    with pytest.raises(Exception, match=r"job team was stopped while it launched: what the launch started was "
                                        r"ended again"):
        c.jobs.launch("team", tag="restart")
    assert c.fleet.job("team").state == "stopped" and c.fleet.free_machines() == ["m4", "m5"]
    assert sorted(fleet.sent("job", "stop")[stops:]) == ["m4", "m4", "m5", "m5"]  # the person's stop, then ours
    assert not fleet.running.get("m4") and not fleet.running.get("m5")
    with pytest.raises(FleetError, match="job team is stopped, not set running: submit it again"):
        c.fleet.set_job_state("team", "running", unless=states.RELEASED_JOB_STATES)


def test_a_start_that_fails_on_one_machine_releases_every_reserved_machine(tmp_path, monkeypatch):
    c, fleet = fleet_controller(tmp_path)
    use_controller(monkeypatch, c)
    fleet.start_fails = {"m5": "training script /srv/team/train.py does not exist"}
    checked = launch.check(c, launch.reserve(c, launch.validate({"spec": SPEC})))
    with pytest.raises(Exception, match="does not exist"):
        launch.start(c, checked)
    assert c.fleet.job("team").state == "failed" and c.fleet.free_machines() == ["m4", "m5"]


def test_too_few_free_machines_or_a_busy_one_is_refused_before_anything_is_reserved(tmp_path, monkeypatch):
    c, _fleet = fleet_controller(tmp_path)
    use_controller(monkeypatch, c)
    with pytest.raises(Exception, match=r"job team needs 3 machines, 2 are free \(m4, m5\); free more"):
        launch.reserve(c, launch.validate({"spec": SPEC | {"machines": 3}}))
    with pytest.raises(FleetError, match="machine m1 already serves job j; name another"):
        launch.reserve(c, launch.validate({"spec": SPEC | {"machines": ["m4", "m1"]}}))
    assert c.fleet.free_machines() == ["m4", "m5"]  # the failed transaction reserved nothing
    assert c.fleet.machine("m4").job is None


def test_a_running_job_is_not_replaced_by_another_spec_and_a_stopped_one_is(tmp_path, monkeypatch):
    c, _fleet = fleet_controller(tmp_path)
    use_controller(monkeypatch, c)
    _launch(c, SPEC)
    with pytest.raises(Exception, match="job team is running with another spec; stop it first"):
        launch.reserve(c, launch.validate({"spec": SPEC | {"command": ["other.py"]}}))
    out = c.release("team")
    assert out["released"] == ["m4", "m5"] and c.fleet.job("team").state == "stopped"
    assert c.release("team")["released"] == []  # stopping again is a no-op
    assert launch.reserve(c, launch.validate({"spec": SPEC | {"command": ["other.py"]}}))["submitted"]


def test_the_form_fields_make_a_spec_when_no_whole_spec_is_given():
    doc = launch.spec_from_conf({"name": "f", "command": "train.py --lr 1", "machines": [], "count": 2,
                                 "processes_per_machine": 1, "workdir": "", "checkpoint": "", "env": {},
                                 "revision": "r0", "spec": {}})
    assert parse_spec(doc).machines == 2 and parse_spec(doc).args == ["--lr", "1"]


def test_the_job_commands_of_the_command_line(tmp_path, monkeypatch, capsys):
    c, _fleet = fleet_controller(tmp_path)
    monkeypatch.setenv("TG_FLEET_URL", c.cfg.fleet_url)
    monkeypatch.setenv("TG_INVENTORY", c.cfg.inventory)
    monkeypatch.delenv("TG_AIRFLOW_URL", raising=False)
    spec = tmp_path / "team.yaml"
    spec.write_text("name: team\ncommand: [train.py]\nmachines: 2\n")
    assert main(["--state-dir", str(tmp_path / "none"), "job", "submit", str(spec)]) == 2
    assert capsys.readouterr().err.strip() == ("trainguard: no Airflow api-server to submit to: pass --airflow-url "
                                               "or set TG_AIRFLOW_URL (and TG_AIRFLOW_USER, TG_AIRFLOW_PASSWORD)")
    from tests.conftest import free_port

    monkeypatch.setenv("TG_AIRFLOW_URL", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    monkeypatch.delenv("TG_AIRFLOW_USER", raising=False)
    assert main(["job", "submit", str(spec)]) == 2  # and no login for it: said before anything is tried
    url = os.environ["TG_AIRFLOW_URL"]
    assert capsys.readouterr().err.strip() == (f"trainguard: no login for the api-server at {url}: set "
                                               f"TG_AIRFLOW_USER and TG_AIRFLOW_PASSWORD (an Airflow user allowed to "
                                               f"trigger DAG runs)")
    monkeypatch.setenv("TG_AIRFLOW_USER", "admin")
    monkeypatch.setenv("TG_AIRFLOW_PASSWORD", "x")
    assert main(["job", "submit", str(spec)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("trainguard: no api-server answered at http://127.0.0.1:") and err.count("\n") == 1, err
    assert "check --airflow-url or TG_AIRFLOW_URL" in err
    monkeypatch.delenv("TG_AIRFLOW_URL")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: team\ncommand: [train.py]\n")
    assert main(["job", "submit", str(bad)]) == 2
    assert capsys.readouterr().err.strip() == f"trainguard: job spec {bad}: machines is missing; add it"
    assert main(["--json", "job", "list"]) == 0
    assert [d["job"] for d in json.loads(capsys.readouterr().out)] == ["j"]
    assert main(["job", "status", "nosuch"]) == 2 and "job nosuch is not in the fleet database" in \
        capsys.readouterr().err


def test_a_job_stopped_from_the_command_line_gives_its_machines_back(tmp_path, monkeypatch, capsys):
    c, _fleet = fleet_controller(tmp_path)
    use_controller(monkeypatch, c)
    _launch(c, SPEC)
    monkeypatch.setattr("trainguard.operators.control.Controller", lambda _cfg: c)
    assert main(["job", "stop", "team"]) == 0
    assert capsys.readouterr().out.strip() == "job team stopped; machines m4, m5 back in the pool"
    assert c.fleet.free_machines() == ["m4", "m5"]


def test_a_spec_path_that_is_not_there(tmp_path: Path, capsys):
    assert main(["job", "submit", str(tmp_path / "x.yaml")]) == 2
    assert "cannot be read (No such file or directory)" in capsys.readouterr().err


def _gpu_lost(machine: str, ts: float) -> dict:
    return {"id": f"gpu_lost-{machine}-{ts}", "job": "team", "machine": machine, "rank": None, "kind": "gpu_lost",
            "severity": "fault", "ts": ts, "evidence": {}}


def test_stopping_a_job_closes_its_waiting_incident_and_sends_its_unhandled_faulty_machine_to_repair(
        tmp_path, monkeypatch):
    """A lost GPU's eviction was refused (the breaker) and its incident waited for a human; the job was stopped as
    the docs said, and the machine went back to the pool, the incident stayed waiting, and the next fault of the
    job submitted again joined it."""
    c, _fleet = fleet_controller(tmp_path)
    use_controller(monkeypatch, c)
    _launch(c, SPEC)
    [lost] = c.ingest([_gpu_lost("m5", 100.0)])
    c.fleet.wait_for_human(lost["incident"], "evicting m5 would exceed the breaker")
    out = c.jobs.release("team")
    assert out["evicted"] == ["m5"] and sorted(out["released"]) == ["m4", "m5"]
    assert c.fleet.machine("m5").state == states.EVICTED and c.fleet.free_machines() == ["m4"]
    inc = c.fleet.incident(lost["incident"])
    assert inc.state == "failed" and inc.summary.startswith("superseded: job team was stopped")
    assert inc.closed_ts is not None
    # stopping again changes nothing
    assert c.jobs.release("team")["released"] == []


def test_submitting_a_job_again_supersedes_its_incidents_and_its_next_fault_opens_its_own(tmp_path, monkeypatch):
    c, _fleet = fleet_controller(tmp_path, machines=7)
    use_controller(monkeypatch, c)
    _launch(c, SPEC)
    [hang] = c.ingest([{**_gpu_lost("m5", 100.0), "kind": "rank_hang", "rank": 1, "id": "hang-1"}])
    c.fleet.wait_for_human(hang["incident"], "the breaker")
    c.fleet.set_job_state("team", "failed")  # the job died meanwhile; nobody ran 'job stop'
    c.fleet.release_job("team", state="failed")
    _launch(c, SPEC)
    assert c.fleet.incident(hang["incident"]).state == "failed"
    assert "submitted again" in c.fleet.incident(hang["incident"]).summary
    [crash] = c.ingest([{**_gpu_lost("m4", 300.0), "kind": "rank_exit", "rank": 0, "id": "crash-1"}])
    assert crash["opened"] and crash["incident"] != hang["incident"]

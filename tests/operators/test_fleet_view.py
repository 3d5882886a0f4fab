"""The Fleet page of the Airflow UI (trainguard.operators.fleet_view, trainguard.operators.plugins.fleet) on the
scripted fleet: the state a job's machines report wins over what the fleet database records."""

from __future__ import annotations

from tests.fakes import alert, fleet_controller
from trainguard.operators import fleet_view
from trainguard.operators.plugins import fleet as ui


def test_a_running_job_shows_running_with_its_machines_revision_step_and_the_pool(tmp_path):
    c, fleet = fleet_controller(tmp_path, revision="r7")
    doc = fleet_view.collect(c)
    [job] = doc["jobs"]
    assert job["state"] == job["recorded_state"] == "running" and job["problem"] == ""
    assert job["revision"] == "r7" and 0 < job["step"] <= fleet.step
    assert [(m["machine"], m["state"], m["job_process"]) for m in job["machines"]] == [
        (f"m{i}", "active", "running") for i in range(4)]
    assert doc["pool"]["standbys"] == ["m4", "m5"] and doc["pool"]["serving"] == 4


def test_a_job_stopped_behind_the_control_planes_back_shows_stopped_and_says_it_is_not_training(tmp_path):
    c, fleet = fleet_controller(tmp_path)
    fleet.running.clear()  # every machine's part ended; the fleet database still says running
    [job] = fleet_view.collect(c)["jobs"]
    assert job["recorded_state"] == "running" and job["state"] == "stopped"
    assert "not training" in job["problem"]
    fleet.launch(["m0", "m1"])  # half of it back
    assert fleet_view.collect(c)["jobs"][0]["state"] == "partly running"


def test_an_open_incident_shows_with_the_rung_that_handles_it(tmp_path):
    c, _fleet = fleet_controller(tmp_path)
    [item] = c.ingest([alert("gpu_lost", "m1")])
    c.triage(item["incident"])
    [job] = fleet_view.collect(c)["jobs"]
    [inc] = job["incidents"]
    assert inc["incident"] == item["incident"] and inc["category"] == "machine_fault" and inc["rung"] == "evict"


def test_a_running_job_whose_incident_waits_for_a_human_or_whose_ranks_hold_still_is_a_problem(tmp_path):
    """The Fleet page once showed a job green "running" with an empty problem column while both its ranks held
    still on a NaN, and while its incident waited for a human."""
    c, fleet = fleet_controller(tmp_path)
    fleet.held = frozenset({0, 1})
    [job] = fleet_view.collect(c)["jobs"]
    assert job["state"] == "running" and "rank(s) 0, 1 hold still" in job["problem"]
    fleet.held = frozenset()
    [item] = c.ingest([alert("rank_hang", "m1")])
    c.fleet.wait_for_human(item["incident"], "the breaker: raise TG_BREAKER_SHARE")
    [job] = fleet_view.collect(c)["jobs"]
    assert f"incident {item['incident']} waits for a human: the breaker" in job["problem"]
    page = ui.render(fleet_view.collect(c))
    assert 'data-state="running" data-problem>' in page


def test_status_tells_a_job_the_database_calls_running_from_one_its_machines_say_exited(tmp_path):
    from trainguard.operators import status

    c, fleet = fleet_controller(tmp_path)
    doc = status.collect(c.fleet, silent_s=15.0, reconcile_period_s=0, observed=status.observe(c, c.fleet.jobs()))
    assert doc["healthy"] and doc["jobs"][0]["observed"] == "running"
    fleet.running.clear()
    doc = status.collect(c.fleet, silent_s=15.0, reconcile_period_s=0, observed=status.observe(c, c.fleet.jobs()))
    assert not doc["healthy"] and doc["jobs"][0]["observed"] == "stopped"
    assert any("says running, its machines say stopped" in p for p in doc["problems"])
    assert "j running (its machines say stopped)" in status.render(doc)


def test_the_observed_state_needs_every_machine_to_run_the_job():
    assert fleet_view.observed_state({"states": {"a": "running", "b": "running"}}) == "running"
    assert fleet_view.observed_state({"states": {"a": "exited", "b": "absent"}}) == "stopped"
    assert fleet_view.observed_state({"states": {"a": "running", "b": "ssh: unreachable"}}) == "partly running"
    assert fleet_view.observed_state({"states": {"a": "ssh: unreachable"}}) == "unreachable"
    assert fleet_view.observed_state({"states": {}}) == "unreachable"


def test_the_page_escapes_every_value_and_marks_each_jobs_state():
    doc = {"jobs": [{"job": "<b>j</b>", "state": "stopped", "recorded_state": "running", "revision": "r'1",
                     "step": 5, "machines": [{"machine": "m&0", "state": "active", "job_process": "exited"}],
                     "incidents": [], "ettr": {"cumulative": 0.9512, "sliding": None},
                     "problem": "not training"}],
            "pool": {"standbys": [], "target": 2, "serving": 1, "short": 2}}
    page = ui.render(doc)
    assert "<b>j</b>" not in page and "&lt;b&gt;j&lt;/b&gt;" in page and "m&amp;0" in page
    assert 'class="state" data-state="stopped" data-problem>stopped<' in page
    assert "95.1% / -" in page and "2 short" in page


def test_the_plugin_registers_its_app_and_a_page_in_the_uis_navigation():
    assert ui.TrainguardPlugin.fastapi_apps[0]["url_prefix"] == "/trainguard"
    [view] = ui.TrainguardPlugin.external_views
    assert view["href"] == "/trainguard/fleet" and view["destination"] == "nav"
    routes = {r.path for r in ui.app.routes}
    assert {"/fleet", "/fleet.json"} <= routes


def test_loading_the_plugin_preloads_what_a_task_process_imports():
    """The scheduler loads its plugins before the LocalExecutor forks workers: loading this one leaves the
    task modules, the SSH hooks and the fleet's models imported, for every task process to inherit."""
    import subprocess
    import sys

    wanted = ["airflow.sdk.execution_time.task_runner", "trainguard.operators.fleet.models",
              "trainguard.operators.hooks.fleet", "trainguard.operators.hooks.node",
              "trainguard.operators.tasks.incident", "trainguard.operators.tasks.rungs", "paramiko"]
    code = ("import sys; import trainguard.operators.plugins.fleet; "
            f"print(' '.join(m for m in {wanted!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.splitlines()[-1].split() == wanted


def test_a_task_process_parsing_its_dag_file_imports_nothing_the_plugin_did_not_preload():
    """Each task process parses its DAG file again: what the DAG files build (trainguard's operators, sensors
    and triggers, Airflow's ``@task`` and sensor bases) is in memory already, not imported in every task."""
    import subprocess
    import sys

    from tests import REPO

    code = ("import glob, importlib.util, sys\n"
            "import trainguard.operators.plugins.fleet\n"
            "before = set(sys.modules)\n"
            "for f in sorted(glob.glob('dags/tg_*.py')):\n"
            "    spec = importlib.util.spec_from_file_location(f.replace('/', '_'), f)\n"
            "    spec.loader.exec_module(importlib.util.module_from_spec(spec))\n"
            "print('NEW', *sorted(set(sys.modules) - before))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    new = out.stdout.splitlines()[-1].split()[1:]
    late = [m for m in new if m.startswith(("trainguard", "airflow.providers", "airflow.sdk.bases",
                                            "airflow.sdk.definitions", "paramiko"))]
    assert not late, late


def test_the_job_forms_offer_the_fleets_jobs_and_prefill_the_first_without_creating_anything(tmp_path, monkeypatch):
    from trainguard.operators.utils.forms import fleet_jobs, job_param

    missing = tmp_path / "nothing-here.db"
    monkeypatch.setenv("TG_FLEET_URL", str(missing))
    assert fleet_jobs() == [] and not missing.exists()  # read only: no database made at parse time
    assert not job_param("the job").has_value  # no job yet: the field is empty and required
    c, _fleet = fleet_controller(tmp_path)
    c.fleet.upsert_job("a_b", tp=1, pp=1, dp=1, ranks_per_machine=1, machines=["m5"], revision="r1")
    monkeypatch.setenv("TG_FLEET_URL", str(tmp_path / "fleet.db"))
    p = job_param("the job")
    assert p.value == "a_b" and p.schema["examples"] == ["a_b", "j"]

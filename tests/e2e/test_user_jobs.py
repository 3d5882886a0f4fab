"""A team's own training script under guard, end to end: submitted with ``trainguard job submit`` (a real
tg_job_launch run in a real ``airflow standalone``), launched on a namespace cluster by torchrun, and recovered
from real faults by tg_incident, with every restart running the team's own command from its own folder (which
holds a ``checkpoint.py`` and an ``operators.py`` of its own).

Four programs, each in a folder of its own copied from ``examples/``, on two machines with gloo:

* ``plain``: a plain PyTorch DDP script (job "team", its folder also holds a ``checkpoint.py`` and an
  ``operators.py`` of its own that raise if anything imports them);
* ``fsdp2``: a plain FSDP2 (``fully_shard``) script with its own ``checkpoint.py`` module, which it imports;
* ``lightning``: a Lightning ``Trainer`` with DDP on Lightning's own demo transformer
  (``trainguard.lightning.TrainguardCallback``);
* ``hf``: the Hugging Face ``Trainer`` on GPT-2 built from a configuration
  (``trainguard.transformers.TrainguardCallback``).

The module's Airflow is one trainguard did not provision: ``airflow standalone`` after the commands of
docs/deploy.md's "Into an Airflow you run" (its DAG bundle, ``trainguard airflow install``), run as the page writes
them.

Each recovery must lose at most one step, and every step's loss, before and after each restore, must equal bit
for bit the loss of an uninterrupted run of the same program on this host.

CI (``make test``): the FSDP2 script through a crash and a lost GPU, the Lightning fit through a NaN and a
crash, the HF Trainer through a lost GPU and a NaN, each submitted and stopped with the command line.
``make test-all`` adds the plain script's submission, four faults and stop, the launch form in a browser, and
each other program's remaining two faults.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import shutil
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import REPO
from tests.conftest import deploy_page_environment, own_cluster, wait_until
from trainguard.emulation import cluster, inject
from trainguard.emulation.standalone import Standalone
from trainguard.node_tools.inventory import Inventory
from trainguard.node_tools.monitor import read_steps
from trainguard.node_tools.transport import transport_for
from trainguard.operators.control import ControlConfig, Controller

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.airflow, pytest.mark.timeout(900)]


# four standbys: each lost GPU takes one (two in CI, four in make test-all)
SPEC = cluster.ClusterSpec(name="tgu", machines=8, standbys=4, subnet="10.213.21.0/24", disk_mb=128, gpus=2)
JOB = "team"
STEP_S = "0.25"  # the script's stand-in for a model's compute: faults land between steps, not after the run
REFERENCE_STEPS = 400


@pytest.fixture(scope="module")
def user_cluster() -> Iterator[Inventory]:
    with own_cluster(SPEC, "tg-test-user-") as inv:
        yield inv


@pytest.fixture(scope="module")
def team_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The team's folder: its training script and modules of its own named like trainguard's packages."""
    d = tmp_path_factory.mktemp("team")
    shutil.copy(REPO / "examples" / "plain" / "train.py", d / "train.py")
    (d / "checkpoint.py").write_text("raise ImportError('the team never imports this module from trainguard')\n")
    (d / "operators.py").write_text("raise ImportError('nor this one')\n")
    return d


@pytest.fixture(scope="module")
def reference(team_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, Any]:
    """step -> loss of an uninterrupted run of the script (two ranks under torchrun on this host)."""
    run = tmp_path_factory.mktemp("reference")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TG_") or k == "TG_TEST_SESSION"}
    env |= {"TG_RUN_DIR": str(run), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "train.py", "--steps", str(REFERENCE_STEPS)], cwd=team_dir, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = {r["step"]: r["loss"] for r in read_steps(run, 0)}
    assert sorted(losses) == list(range(REFERENCE_STEPS))
    return losses


@pytest.fixture(scope="module")
def plane(user_cluster: Inventory) -> Iterator[tuple[Controller, Standalone, Path]]:
    assert user_cluster.path is not None
    home = user_cluster.path.parent.parent / "control"
    home.mkdir()
    cfg = ControlConfig(fleet_url=str(home / "fleet.db"), inventory=str(user_cluster.path))
    ctl = Controller(cfg)
    ctl.sync_inventory()
    # an Airflow trainguard did not provision: docs/deploy.md's commands do ("Into an Airflow you run")
    airflow = Standalone(home / "airflow", {"TG_FLEET_URL": cfg.fleet_url, "TG_INVENTORY": cfg.inventory,
                                            "TG_CONTROL_HOME": str(home), "TG_ESCALATION_WINDOW_S": "5",
                                            "TG_POOL_SCHEDULE": "", "TG_CODE_UPDATE_SCHEDULE": "",
                                            "TG_VERIFY_SCHEDULE": "", "TG_VERIFY_ON_COMMIT": "0",
                                            "TG_AGENT_SILENT_S": "8",
                                            # the reconciler looks every 30 s here (10 s by default): this tier
                                            # shares 2 cores, and the guardian's alerts handle its faults
                                            "TG_RECONCILE_PERIOD_S": "30",
                                            # a two-machine job loses a machine per scenario here: the breaker
                                            # (at most half the job's machines an hour) would stop the second
                                            "TG_BREAKER_SHARE": "1.0", "TG_BREAKER_WINDOW_S": "20"}, stock=True)
    (home / "airflow").mkdir()
    try:
        airflow.env, printed = deploy_page_environment(airflow.env)
        assert "pool tg_ssh: 16 slots" in printed and "connection tg_airflow_api: http://127.0.0.1:" in printed, printed
        airflow.launch()
        parked = transport_for(user_cluster).run_many(user_cluster.by_role("standby"), lambda _m: [
            user_cluster.tg_node, "standby", "park", "--nproc", "1"], timeout=240)
        assert all(r.ok for r in parked.values()), {n: r.describe() for n, r in parked.items()}
        airflow.ready()
        yield ctl, airflow, home
    finally:
        with contextlib.suppress(Exception):
            ctl.release(JOB)
        airflow.stop(grace_s=5)  # nothing of it is kept: no need to wait for a clean shutdown


def _rank0_records(inv: Inventory, job: str = JOB, machine: str = "m0") -> list[dict[str, Any]]:
    """Rank 0's step records on its machine (rank 0 stays there: the faults hit the job's second machine, or
    rank 0 itself for a NaN)."""
    return read_steps(Path(inv.machine(machine).workdir) / "jobs" / job, 0)


def _incident_after(ctl: Controller, last: int, job: str = JOB, timeout: float = 300) -> Any:
    return wait_until(lambda: next((i for i in ctl.fleet.incidents(job) if i.id > last and i.state in (
        "resolved", "failed", "waiting_human")), None), timeout=timeout, interval=1.0,
        what=f"an incident of job {job} to close")


def _last(ctl: Controller, job: str = JOB) -> int:
    return max((i.id for i in ctl.fleet.incidents(job)), default=0)


def _fault(ctl: Controller, inv: Inventory, machine: str, fault: str, rank: int | None = None, *, job: str = JOB,
           first: str = "m0") -> tuple[Any, int]:
    """Inject ``fault`` once the job trains; the incident it caused (closed) and the step rank 0 had reached."""
    step = ctl.progress(job)["step"]
    wait_until(lambda: ctl.progress(job)["step"] >= step + 3, timeout=120, what="the job to train")
    last = _last(ctl, job)
    before = max(r["step"] for r in _rank0_records(inv, job, first))
    inject.inject(inv, machine, fault, rank=rank)
    inc = _incident_after(ctl, last, job)
    return inc, before


def _check_resumed(ctl: Controller, inv: Inventory, reference: dict[int, Any], before: int, *, job: str = JOB,
                   first: str = "m0") -> dict[str, Any]:
    """After a recovery: the job trains past the fault; the step it restored is at most one behind the last step
    the job had finished before it was stopped; every loss ever recorded equals the uninterrupted run's."""
    wait_until(lambda: max(r["step"] for r in _rank0_records(inv, job, first)) >= before + 3, timeout=180,
               what="the job to train past the fault")
    records = _rank0_records(inv, job, first)
    assert max(r["step"] for r in records) < len(reference), "the reference run is too short for this test"
    incarnation = max(r["incarnation"] for r in records)
    first = next(r for r in records if r["incarnation"] == incarnation)
    done = max((r["step"] for r in records if r["incarnation"] < incarnation), default=-1)
    if incarnation > 0:
        restored = first["ckpt_restored_step"]
        assert restored >= done - 1, f"restored step {restored}, but step {done} was finished before the fault"
        assert first["step"] == restored + 1
    differ = {r["step"]: (r["loss"], reference[r["step"]]) for r in records if r["loss"] != reference[r["step"]]}
    assert not differ, f"losses that differ from the uninterrupted run (step: (guarded, reference)): {differ}"
    return first


@pytest.mark.full
def test_a_job_submitted_from_the_command_line_is_launched_by_a_dag_run_and_trains(plane, user_cluster, team_dir,
                                                                                     reference, tmp_path):
    ctl, airflow, _home = plane
    spec = tmp_path / "team.yaml"
    spec.write_text(f"name: {JOB}\n"
                    f"command: [train.py, --steps, '0', --step-time-s, '{STEP_S}']\n"
                    f"workdir: {team_dir}\n"
                    "machines: [m0, m1]\n"
                    "env: {TEAM_SETTING: kept}\n")
    password = json.loads((airflow.home / "simple_auth_manager_passwords.json.generated").read_text())["admin"]
    env = {**os.environ, "TG_FLEET_URL": ctl.cfg.fleet_url, "TG_INVENTORY": ctl.cfg.inventory,
           "TG_AIRFLOW_USER": "admin", "TG_AIRFLOW_PASSWORD": password}
    out = subprocess.run([sys.executable, "-m", "trainguard.operators.cli", "job", "submit", str(spec), "--wait", "420",
                          "--airflow-url", airflow.url], env=env, capture_output=True, text=True, timeout=480)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.startswith(f"job {JOB} submitted: tg_job_launch run ") and "(success)" in out.stdout
    run_id = out.stdout.split("tg_job_launch run ", 1)[1].split(" ", 1)[0]
    assert airflow.task_states("tg_job_launch", run_id) == {t: "success" for t in (
        "validate", "reserve", "check_machines", "start_job", "first_step", "arm_job")}
    job = ctl.fleet.job(JOB)
    assert job.state == "running" and job.machine_list == ["m0", "m1"] and job.spec["workdir"] == str(team_dir)
    record = json.loads((Path(user_cluster.machine("m0").workdir) / "jobs" / JOB / "job.json").read_text())
    assert record["spec"]["entry"] == "train.py" and record["spec"]["env"] == {"TEAM_SETTING": "kept"}
    # (the same submission again is the same job: tests/operators/tasks/test_launch.py)
    wait_until(lambda: ctl.progress(JOB)["step"] >= 3, timeout=120, what="the job to train")
    _check_resumed(ctl, user_cluster, reference, -1)


@pytest.mark.full
def test_a_crashed_rank_of_the_teams_job_is_restarted_with_its_own_command_and_loses_at_most_one_step(
        plane, user_cluster, reference, team_dir):
    ctl, _airflow, _home = plane
    inc, before = _fault(ctl, user_cluster, "m1", "crash", rank=1)
    assert inc.state == "resolved", inc.summary
    first = _check_resumed(ctl, user_cluster, reference, before)
    assert first["incarnation"] >= 1
    record = json.loads((Path(user_cluster.machine("m1").workdir) / "jobs" / JOB / "job.json").read_text())
    assert record["spec"]["workdir"] == str(team_dir) and record["spec"]["args"][:1] == ["--steps"]
    assert record["incarnation"] >= 1 and "--tp" not in record["command"]


@pytest.mark.full
def test_a_lost_gpu_swaps_the_machine_for_a_standby_and_the_team_job_resumes_bit_for_bit(plane, user_cluster,
                                                                                         reference):
    ctl, _airflow, _home = plane
    inc, before = _fault(ctl, user_cluster, "m1", "gpu_lost")
    assert inc.state == "resolved", inc.summary
    machines = ctl.fleet.job(JOB).machine_list
    assert machines[0] == "m0" and machines[1] in ("m2", "m3"), machines
    _check_resumed(ctl, user_cluster, reference, before)


@pytest.mark.full
def test_a_hung_rank_of_the_teams_job_is_found_and_the_job_resumes(plane, user_cluster, reference):
    ctl, _airflow, _home = plane
    machine = ctl.fleet.job(JOB).machine_list[1]
    inc, before = _fault(ctl, user_cluster, machine, "hang", rank=1)
    assert inc.state == "resolved", inc.summary
    _check_resumed(ctl, user_cluster, reference, before)


@pytest.mark.full
def test_a_nan_in_the_teams_job_is_never_trained_on_and_the_job_resumes_from_the_last_finite_step(
        plane, user_cluster, reference):
    ctl, _airflow, _home = plane
    inc, _before = _fault(ctl, user_cluster, "m0", "nan", rank=0)
    assert inc.state == "resolved", inc.summary
    records = _rank0_records(user_cluster)
    nan_steps = [r["step"] for r in records if r["loss"] == "nan"]
    assert nan_steps, "the NaN step was recorded"
    # the NaN step is recorded as such; every finite loss still equals the uninterrupted run's
    finite = [r for r in records if r["loss"] != "nan"]
    assert all(r["loss"] == reference[r["step"]] for r in finite)
    wait_until(lambda: max(r["step"] for r in _rank0_records(user_cluster)) >= max(nan_steps) + 3, timeout=180,
               what="the job to train past the NaN")


@pytest.mark.full
def test_stopping_the_teams_job_returns_its_machines_to_the_pool(plane, user_cluster):
    ctl, _airflow, _home = plane
    machines = list(ctl.fleet.job(JOB).machine_list)
    env = {**os.environ, "TG_FLEET_URL": ctl.cfg.fleet_url, "TG_INVENTORY": ctl.cfg.inventory}
    out = subprocess.run([sys.executable, "-m", "trainguard.operators.cli", "job", "stop", JOB], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert ctl.fleet.job(JOB).state == "stopped"
    assert set(machines) <= set(ctl.fleet.free_machines())
    states = ctl.progress(JOB)["states"]
    assert states and all(s in ("exited", "absent") for s in states.values()), states


@pytest.mark.full
@pytest.mark.timeout(1200)  # a first run installs chromium
def test_a_job_submitted_from_the_launch_form_in_a_browser_trains_on_the_fleet_page(plane, user_cluster, team_dir):
    """Headless Chromium: log in, open tg_job_launch, fill its form (name, command, folder, two free machines by
    count), trigger; the run succeeds, and the Fleet page lists the job running."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    from tests.browser import artifacts_dir, chrome, login

    ctl, airflow, _home = plane
    name = "from-form"
    assert len(ctl.fleet.free_machines()) >= 2  # the team's job above gave its machines back
    before = {r["dag_run_id"] for r in airflow.runs("tg_job_launch")}
    d = chrome()
    shots = artifacts_dir()
    try:
        wait = WebDriverWait(d, 120)
        login(d, airflow)
        d.get(f"{airflow.url}/dags/tg_job_launch")
        wait.until(ec.element_to_be_clickable((By.CSS_SELECTOR, "button[aria-label='Trigger Dag']"))).click()
        form = wait.until(ec.presence_of_element_located(
            (By.XPATH, "//*[@role='dialog'][.//*[@name='element_command']]")))
        for field, value in (("name", name), ("command", f"train.py --steps 0 --step-time-s {STEP_S}"),
                             ("workdir", str(team_dir))):
            box = form.find_element(By.NAME, f"element_{field}")
            box.clear()
            box.send_keys(value)
        count = form.find_element(By.NAME, "element_count")
        count.send_keys("\b2")
        d.save_screenshot(str(shots / "airflow-ui-tg_job_launch-form.png"))
        trigger = next(b for b in form.find_elements(By.TAG_NAME, "button")
                       if b.get_attribute("textContent").strip() == "Trigger")
        d.execute_script("arguments[0].scrollIntoView(true);", trigger)
        trigger.click()
        wait.until(lambda drv: "/dags/tg_job_launch/runs/" in drv.current_url)
        run_id = urllib.parse.unquote(d.current_url.split("/runs/", 1)[1].split("?")[0])
        assert run_id not in before
        assert airflow.finished("tg_job_launch", run_id, timeout=420) == "success"
        assert ctl.fleet.job(name).state == "running" and len(ctl.fleet.job(name).machine_list) == 2
        d.get(f"{airflow.url}/plugin/trainguard-fleet")
        frame = WebDriverWait(d, 60).until(ec.presence_of_element_located((By.TAG_NAME, "iframe")))
        d.switch_to.frame(frame)
        cell = WebDriverWait(d, 60).until(ec.presence_of_element_located(
            (By.CSS_SELECTOR, f"tr[data-job='{name}'] td.state")))
        assert cell.text == "running", d.find_element(By.TAG_NAME, "body").text
        d.switch_to.default_content()
        d.save_screenshot(str(shots / "airflow-ui-fleet-submitted-job.png"))
    finally:
        d.quit()
        with contextlib.suppress(Exception):
            ctl.release(name)


# ---- the third-party programs: each a campaign of its own (submitted, faulted, stopped) ----------------------
PROGRAMS: dict[str, dict[str, Any]] = {
    # example folder, files copied, arguments beyond --steps/--step-time-s
    "fsdp2": {"files": ("train.py", "checkpoint.py"), "args": ()},
    "lightning": {"files": ("train.py",), "args": ()},
    "hf": {"files": ("train.py",), "args": ()},
}


@pytest.fixture(scope="module")
def programs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each program's folder: its files copied from examples/, and an ``operators.py`` of the team's own that
    raises if imported."""
    out: dict[str, Path] = {}
    for name, p in PROGRAMS.items():
        d = tmp_path_factory.mktemp(name)
        for f in p["files"]:
            shutil.copy(REPO / "examples" / name / f, d / f)
        (d / "operators.py").write_text("raise ImportError('the team never imports this module from trainguard')\n")
        out[name] = d
    return out


def _uninterrupted(folder: Path, name: str, steps: int, run: Path) -> dict[int, Any]:
    """step -> loss of an uninterrupted run of ``steps`` steps of the program (two ranks under torchrun on this
    host), run once the campaign is over and the host's cores are free."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TG_") or k == "TG_TEST_SESSION"}
    env |= {"TG_RUN_DIR": str(run), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "train.py", "--steps", str(steps), *PROGRAMS[name]["args"]], cwd=folder, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = {r["step"]: r["loss"] for r in read_steps(run, 0)}
    assert sorted(losses) == list(range(steps))
    return losses


def _campaign(ctl: Controller, airflow: Standalone, inv: Inventory, programs: dict[str, Path], name: str,
              faults: tuple[str, ...], tmp: Path) -> None:
    """Submit ``name`` on two free machines with ``trainguard job submit``; inject each fault in turn (a crash,
    a hang and a lost GPU on the second machine's rank, a NaN on rank 0) and check each recovery; check that the
    restarts ran the team's own command and environment; stop the job, which frees its machines; then run the
    program uninterrupted on this host as far as the job got, and compare every loss the job recorded."""
    folder = programs[name]
    job = f"{name}-{'-'.join(faults)}"
    spec = tmp / f"{job}.yaml"
    args = ", ".join(f"'{a}'" for a in PROGRAMS[name]["args"])
    spec.write_text(f"name: {job}\n"
                    f"command: [train.py, --steps, '0', --step-time-s, '{STEP_S}'{', ' + args if args else ''}]\n"
                    f"workdir: {folder}\n"
                    "machines: 2\n"
                    "env: {TEAM_SETTING: kept, HF_HUB_OFFLINE: '1'}\n")
    env, out = _submit(ctl, airflow, spec)
    assert out.stdout.startswith(f"job {job} submitted: tg_job_launch run ") and "(success)" in out.stdout
    run_id = out.stdout.split("tg_job_launch run ", 1)[1].split(" ", 1)[0]
    assert airflow.task_states("tg_job_launch", run_id) == {t: "success" for t in (
        "validate", "reserve", "check_machines", "start_job", "first_step", "arm_job")}
    try:
        first, second = ctl.fleet.job(job).machine_list
        wait_until(lambda: ctl.progress(job)["step"] >= 3, timeout=180, what=f"{job} to train")
        for fault in faults:
            target = first if fault == "nan" else ctl.fleet.job(job).machine_list[1]
            rank = {"nan": 0, "gpu_lost": None}.get(fault, 1)  # a lost GPU acts on the whole machine
            inc, before = _fault(ctl, inv, target, fault, rank=rank, job=job, first=first)
            if inc.state != "resolved":
                pytest.fail(f"{fault}: incident {inc.state}: {inc.summary}\n"
                            f"{_job_logs(inv, job, ctl.fleet.job(job).machine_list)}", pytrace=False)
            assert ctl.fleet.job(job).machine_list[0] == first  # rank 0 stayed: its records are the job's
            if fault == "gpu_lost":
                assert second not in ctl.fleet.job(job).machine_list
            _check_campaign(ctl, inv, before, job, first)
        record = json.loads((Path(inv.machine(first).workdir) / "jobs" / job / "job.json").read_text())
        assert record["incarnation"] >= len(faults)  # one restart a fault, each with the command above
        assert record["spec"]["entry"] == "train.py" and record["spec"]["workdir"] == str(folder)
        assert record["spec"]["args"][:2] == ["--steps", "0"] and record["spec"]["env"]["TEAM_SETTING"] == "kept"
        records = _rank0_records(inv, job, first)
        machines = list(ctl.fleet.job(job).machine_list)
        # what the job printed, rank by rank, with one command
        out = subprocess.run([sys.executable, "-m", "trainguard.operators.cli", "job", "logs", job, "--stream",
                              "stderr", "--tail", "5"], env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and f"== rank 0 on {first} (local rank 0" in out.stdout, out.stdout + out.stderr
        out = subprocess.run([sys.executable, "-m", "trainguard.operators.cli", "job", "stop", job], env=env,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert ctl.fleet.job(job).state == "stopped" and set(machines) <= set(ctl.fleet.free_machines())
    finally:
        if ctl.fleet.job(job).state != "stopped":
            ctl.release(job)
    reference = _uninterrupted(folder, name, max(r["step"] for r in records) + 1, tmp / "reference")
    differ = {r["step"]: (r["loss"], reference[r["step"]]) for r in records
              if r["loss"] != "nan" and r["loss"] != reference[r["step"]]}
    assert not differ, f"losses that differ from the uninterrupted run (step: (guarded, reference)): {differ}"
    assert any(r["loss"] == "nan" for r in records) == ("nan" in faults)  # the NaN step, recorded as such


def _submit(ctl: Controller, airflow: Standalone, spec: Path) -> tuple[dict[str, str], Any]:
    """``trainguard job submit SPEC --wait`` as a user runs it against this Airflow: the environment it ran with
    and what it answered (exit 0 asserted)."""
    password = json.loads((airflow.home / "simple_auth_manager_passwords.json.generated").read_text())["admin"]
    env = {**os.environ, "TG_FLEET_URL": ctl.cfg.fleet_url, "TG_INVENTORY": ctl.cfg.inventory,
           "TG_AIRFLOW_USER": "admin", "TG_AIRFLOW_PASSWORD": password}
    out = subprocess.run([sys.executable, "-m", "trainguard.operators.cli", "job", "submit", str(spec), "--wait",
                          "420", "--airflow-url", airflow.url], env=env, capture_output=True, text=True, timeout=480)
    assert out.returncode == 0, out.stdout + out.stderr
    return env, out


def _job_logs(inv: Inventory, job: str, machines: list[str]) -> str:
    """The ends of the job's logs on its machines (torchrun's and each rank's), for a failure's message."""
    out = []
    for m in machines:
        folder = Path(inv.machine(m).workdir) / "jobs" / job
        for path in [folder / "supervisor.log", *sorted(folder.glob("**/attempt_*/*/std*.log"))]:
            if path.is_file():
                out.append(f"--- {m}: {path.relative_to(folder)}\n{path.read_text(errors='replace')[-1500:]}")
    return "\n".join(out)


def _check_campaign(ctl: Controller, inv: Inventory, before: int, job: str, first: str) -> None:
    """After a recovery: the job trains past the fault, and the step it restored is at most one behind the last
    step it had finished before it was stopped (a step the NaN fault touched is recorded as "nan": the guard saw
    the corrupted loss, skipped the update and held, and the restart restored the last finite step). The losses
    are compared with an uninterrupted run's at the end of the campaign."""
    wait_until(lambda: max(r["step"] for r in _rank0_records(inv, job, first)) >= before + 3, timeout=180,
               what=f"{job} to train past the fault")
    records = _rank0_records(inv, job, first)
    incarnation = max(r["incarnation"] for r in records)
    head = next(r for r in records if r["incarnation"] == incarnation)
    done = max((r["step"] for r in records if r["incarnation"] < incarnation and r["loss"] != "nan"), default=-1)
    assert head["ckpt_restored_step"] >= done - 1, (head, done)
    assert head["step"] == head["ckpt_restored_step"] + 1


def test_an_fsdp2_script_with_its_own_checkpoint_module_recovers_from_a_crash_and_a_lost_gpu(
        plane, user_cluster, programs, tmp_path):
    ctl, airflow, _home = plane
    _campaign(ctl, airflow, user_cluster, programs, "fsdp2", ("crash", "gpu_lost"), tmp_path)


def test_a_lightning_fit_recovers_from_a_nan_and_a_crash(plane, user_cluster, programs, tmp_path):
    ctl, airflow, _home = plane
    _campaign(ctl, airflow, user_cluster, programs, "lightning", ("nan", "crash"), tmp_path)


def test_an_hf_trainer_recovers_from_a_lost_gpu_and_a_nan(plane, user_cluster, programs, tmp_path):
    ctl, airflow, _home = plane
    _campaign(ctl, airflow, user_cluster, programs, "hf", ("gpu_lost", "nan"), tmp_path)


@pytest.mark.full
def test_an_fsdp2_script_recovers_from_a_hang_and_a_nan(plane, user_cluster, programs, tmp_path):
    ctl, airflow, _home = plane
    _campaign(ctl, airflow, user_cluster, programs, "fsdp2", ("hang", "nan"), tmp_path)


@pytest.mark.full
def test_a_lightning_fit_recovers_from_a_lost_gpu_and_a_hang(plane, user_cluster, programs, tmp_path):
    ctl, airflow, _home = plane
    _campaign(ctl, airflow, user_cluster, programs, "lightning", ("gpu_lost", "hang"), tmp_path)


@pytest.mark.full
def test_an_hf_trainer_recovers_from_a_crash_and_a_hang(plane, user_cluster, programs, tmp_path):
    ctl, airflow, _home = plane
    _campaign(ctl, airflow, user_cluster, programs, "hf", ("crash", "hang"), tmp_path)


@pytest.fixture(scope="module")
def lighthouse(user_cluster: Inventory, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A torchft lighthouse on the cluster's bridge, outside the job's machines, as a deployment runs one."""
    from trainguard.emulation.replicas import Lighthouse

    lh = Lighthouse(SPEC.host_address, tmp_path_factory.mktemp("lighthouse") / "lighthouse.log").start()
    try:
        yield lh.url
    finally:
        lh.stop()


def test_a_job_of_replica_groups_trains_through_a_lost_gpu_on_its_other_replica_which_heals_from_a_live_one(
        plane, user_cluster, lighthouse, tmp_path):
    """The degrade path end to end: ``examples/replicas`` submitted with ``replicas:`` in its spec runs as two
    replica groups (one machine each); a GPU lost on the second group's machine takes that group alone out, its
    machine is swapped for a warm standby where the group heals from the first, and the first never stops: its
    process is the same, its longest pause is a quorum change, it trained alone meanwhile and with both again after;
    both end with the same state bit for bit; the run's rung says it took the degrade path."""
    from trainguard.emulation.replicas import rank_digests

    ctl, airflow, _home = plane
    job = "replicas"
    spec = tmp_path / "replicas.yaml"
    spec.write_text(f"name: {job}\n"
                    f"command: [-m, examples.replicas.train, --steps, '0', --step-time-s, '{STEP_S}', --digest-every, "
                    f"'10', --timeout-s, '3']\n"
                    "machines: 2\n"
                    f"replicas: {{lighthouse: '{lighthouse}', min_replicas: 1}}\n")
    _submit(ctl, airflow, spec)
    try:
        first, second = ctl.fleet.job(job).machine_list

        def records(machine: str, rank: int) -> list[dict[str, Any]]:
            return read_steps(Path(user_cluster.machine(machine).workdir) / "jobs" / job, rank)

        wait_until(lambda: sum(r.get("participants") == 2 for r in records(first, 0)) >= 10, timeout=180,
                   what="both replica groups to train together")
        last = _last(ctl, job)
        at = time.time()
        inject.inject(user_cluster, second, "gpu_lost", job_name=job)  # (its machine may hold another job's leftovers)
        # the machine's incident: opened by its first explicit alert (the NVML loss or the kernel's Xid, whichever
        # the guardian reads first; the other, from a machine no longer in the job, joins nothing)
        inc = wait_until(lambda: next((i for i in ctl.fleet.incidents(job) if i.id > last and i.state in (
            "resolved", "failed", "waiting_human") and i.category == "machine_fault"), None),
            timeout=300, interval=1.0, what="the lost GPU's incident to close")
        if inc.state != "resolved":
            pytest.fail(f"incident {inc.state}: {inc.summary}\n{_job_logs(user_cluster, job, [first, second])}",
                        pytrace=False)
        now = ctl.fleet.job(job).machine_list
        assert now[0] == first and second not in now, now
        assert "path: degrade" in inc.summary and "path degrade" in inc.summary, inc.summary
        [done] = [a for a in ctl.fleet.actions(inc.id) if a.kind == "degrade"]
        assert done.outcome == "done" and done.evidence["replicas"] == [1]
        assert not [a for a in ctl.fleet.actions(inc.id) if a.kind == "launch"]  # the whole job never restarted
        rung = _rung_output(airflow, inc.id, "evict_now")
        assert rung["path"] == "degrade" and rung["degraded"]["machines"] == [now[1]], rung
        wait_until(lambda: sum(r.get("participants") == 2 and r["ts"] > inc.resumed_ts for r in records(first, 0))
                   >= 12, timeout=120, what="both groups to train together again")
        survivor = records(first, 0)
        assert {r["incarnation"] for r in survivor} == {0}  # the first group's process never restarted
        around = [b["ts"] - a["ts"] for a, b in itertools.pairwise(survivor) if at - 1 <= b["ts"]]
        assert max(around) < float(STEP_S) + 6.0, max(around)  # a step and a quorum change, not a restart
        after = [r for r in survivor if r["ts"] > at]
        alone = [i for i, r in enumerate(after) if r.get("participants") == 1]
        assert alone and any(r.get("participants") == 2 for r in after[alone[0]:]), "it trained alone, then both"
        steps = [r["step"] for r in survivor]
        assert steps == sorted(set(steps))  # every step once: nothing redone
        healed = [r for r in records(now[1], 1) if r.get("healed_from_step") is not None]
        assert healed and healed[0]["step"] > max(r["step"] for r in survivor if r["ts"] < at)
        d0, d1 = (rank_digests(Path(user_cluster.machine(m).workdir) / "jobs" / job) for m in now)
        common = [s for s in set(d0) & set(d1) if s > healed[0]["step"]]
        assert common and all(d0[s] == d1[s] for s in common), (d0, d1)

        # what must stop the world still does: a NaN on the first replica reaches both through the average; neither
        # applies it, the incident stops every group, and each restores its own checkpoint, at most a step lost
        last = _last(ctl, job)
        inject.inject(user_cluster, first, "nan", rank=0, job_name=job)  # (as the lost GPU above)
        nan = wait_until(lambda: next((i for i in ctl.fleet.incidents(job) if i.id > last and i.category == "nan"
                                       and i.state in ("resolved", "failed", "waiting_human")), None),
                         timeout=300, interval=1.0, what="the NaN's incident to close")
        assert nan.state == "resolved", f"{nan.summary}\n{_job_logs(user_cluster, job, now)}"
        assert nan.lost_steps is not None and nan.lost_steps <= 1, (nan.lost_steps, nan.summary)
        world = _rung_output(airflow, nan.id, "stop_time_diagnosis")
        assert world["path"] == "stop_world" and "nan" in world["path_reason"], world
        after = [r for r in records(first, 0) if r["incarnation"] >= 1]  # the first group's process, restarted
        assert after and after[0].get("ckpt_restored_step") is not None, after[:1]
        assert all(math.isfinite(float(r["loss"])) for r in after)
    finally:
        inject.clear(user_cluster, second, "gpu_lost")
        ctl.release(job)


def _rung_output(airflow: Standalone, incident_id: int, task: str) -> dict[str, Any]:
    """What ``task`` of the incident's tg_incident run returned (its XCom)."""
    run = airflow.incident_run(incident_id)
    assert run is not None, f"no tg_incident run for incident {incident_id}"
    return airflow.xcom("tg_incident", run["dag_run_id"], task)

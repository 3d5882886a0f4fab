"""The scale-out control plane end to end (in ``make test``; alone: ``make test-scaleout``): PostgreSQL as
Airflow's metadata database and the fleet database, the CeleryExecutor with Redis, two Celery workers each in a
network namespace of its own (its own Airflow home, its own copy of the deployment's files), two schedulers, a
separate api-server, dag-processor and triggerer, and the alert bus on S3 (``moto_server``), over a namespace
cluster whose agents publish to that bus (:mod:`trainguard.emulation.scaleout`).

Three of the shared tier's scenarios run under it (the crash and the hang in the full tier only). A GPU falls off
the bus on one of the guarded job's machines: the machine is evicted and a warm standby takes its place, while one
of the two schedulers is killed (SIGKILL, as a host that dies) as soon as the incident's run is under way: the
other one carries the run to its end, and the fleet database holds each of the recovery's actions exactly once.
Then a rank crashes: the workers restart it at once in place, L1 of its machine passing over SSH from their
namespaces beside the restore, on the one scheduler left. Last a rank hangs in a collective: the
workers take every rank's stacks (py-spy over SSH), and the stuck rank's whole pipeline is evicted onto warm
standbys.
"""

from __future__ import annotations

import collections
import json
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from tests.conftest import can_namespace
from trainguard.emulation import cluster, scaleout
from trainguard.emulation.guarded import FAULTS, NO_SCHEDULES, TOPOLOGY, GuardedJob
from trainguard.operators.fleet import states

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.airflow, pytest.mark.scaleout,
              pytest.mark.timeout(1200)]

SPEC = cluster.ClusterSpec(name="tgs", machines=6, standbys=2, subnet="10.213.23.0/24", disk_mb=256, gpus=8)
JOB = "scaled"


@pytest.fixture(scope="module")
def plane(monkeypatch_module: pytest.MonkeyPatch) -> Iterator[tuple[GuardedJob, scaleout.ScaleOut]]:
    reason = can_namespace()
    if reason:
        pytest.skip(reason)
    root = Path(tempfile.mkdtemp(prefix="tg-test-so-"))
    state = root / "state"
    spec = replace(SPEC, bus_url=scaleout.bus_url(SPEC))
    # the demo's breaker: the hang's pipeline (2 machines) after the explicit fault's (1) is 3 of the job's 4
    # machines evicted, which the default (half the job an hour) leaves to a human
    # the reconciler looks every 30 s here (10 s by default): this tier shares 2 cores with its own plane
    settings = {**NO_SCHEDULES, "TG_INVENTORY": str(state / "inventory.json"), "TG_BREAKER_SHARE": "0.75",
                "TG_BREAKER_WINDOW_S": "60", "TG_RECONCILE_PERIOD_S": "30"}
    so = scaleout.ScaleOut(root / "control", settings, spec)
    job: GuardedJob | None = None
    try:
        cluster.down(state, name=spec.name, log=lambda *_: None)  # leftovers of an aborted run
        so.servers_up()
        inv = cluster.up(spec, state, log=lambda *_: None)
        # this process is the operator's host: it reaches the fleet database as the plane's components do
        for key in ("PGPASSFILE", "AWS_SHARED_CREDENTIALS_FILE", "AWS_DEFAULT_REGION"):
            monkeypatch_module.setenv(key, so.env[key])
        for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):  # the file's, not another test's
            monkeypatch_module.delenv(key, raising=False)
        job = GuardedJob(inv, root / "control", job=JOB, settings={**settings, "TG_FLEET_URL": so.fleet_url},
                         airflow=so)
        job.start()
        yield job, so
    finally:
        try:
            if job is not None:
                job.stop()
        finally:
            so.stop(grace_s=10.0)
            so.servers_down()
            cluster.down(state, name=spec.name, log=lambda *_: None)
            shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def monkeypatch_module() -> Iterator[pytest.MonkeyPatch]:
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_the_plane_is_postgres_celery_and_two_workers_in_namespaces_of_their_own(plane):
    job, so = plane
    assert job.ctl.fleet.url.startswith("postgresql+psycopg://trainguard@")
    homes = {name: so.root / "workers" / f"w{i}" for i, name in enumerate(("worker-0", "worker-1"))}
    for name, home in homes.items():
        # a host of its own: its Airflow home and deployment files, none of them the scheduler's
        assert (home / "airflow" / "airflow.cfg").stat().st_mode & 0o077 == 0
        assert (home / "deploy" / "inventory.json").exists() and home.resolve() != so.home.resolve()
        assert so.procs[name].poll() is None
    namespaces = {scaleout.worker_netns(so.spec, i) for i in range(2)}
    assert namespaces <= cluster._netns_list()
    assert so.env["AIRFLOW__CORE__EXECUTOR"] == "CeleryExecutor"
    assert not any("airflow" in v and ":" in v.split("@")[0].removeprefix("postgresql+psycopg://")
                   for v in so.env.values() if v.startswith("postgresql")), "a password in the environment"


def test_an_explicit_fault_evicts_onto_a_warm_standby_while_a_scheduler_dies_mid_incident(plane):
    job, so = plane
    fault = FAULTS["gpu_lost"]
    last = job.last_incident()
    killed: list[str] = []

    def kill_a_scheduler_once_the_incident_runs() -> None:
        if killed:
            return
        newest = job.last_incident()
        # the run the scheduler started from the alert's asset event: it has no conf; its triage claimed the incident
        run = so.incident_run(newest, job.ctl.fleet) if newest > last else None
        if run is not None and run["state"] == "running":
            so.kill("scheduler-0")
            killed.append(run["dag_run_id"])

    inc, machine, _t = job.fault_and_incident(fault, on_tick=kill_a_scheduler_once_the_incident_runs)
    assert killed, "the incident closed before its run was seen running"
    assert so.procs["scheduler-0"].poll() is not None and so.procs["scheduler-1"].poll() is None
    assert inc.state == "resolved", (inc.state, inc.reason)
    swaps = job.swaps(inc.id)
    assert list(swaps) == [machine]
    assert job.ctl.fleet.machine(machine).state == states.EVICTED
    assert swaps[machine] in job.ctl.fleet.job(JOB).machine_list
    actions = job.ctl.fleet.actions(inc.id)
    done = collections.Counter(a.kind for a in actions if a.outcome == "done")
    # on failure: each action, the incident's summary and its runs (who made a second launch, and when)
    why = (done, inc.summary, [(a.key, a.outcome, a.started_ts, a.finished_ts, a.detail) for a in actions],
           [(c["run"], c.get("first_seen_ts")) for c in job.ctl.fleet.claims_of(inc.id)], killed)
    assert done["evict"] == 1 and done["launch"] == 1, why
    assert all(n == 1 for n in done.values()), f"an action done twice: {why}"
    # the run the dead scheduler had a hand in ended, run by the workers in their namespaces
    run_id = killed[0]
    assert so.finished("tg_incident", run_id, timeout=600) == "success"
    tis = so.task_instances("tg_incident", run_id)
    hosts = {t["hostname"] for t in tis if t["state"] == "success"}
    workers = {scaleout.worker_address(so.spec, i) for i in range(2)}
    assert hosts and hosts <= workers, hosts
    # a task's log comes from its worker's log server, through the api-server
    ran = next(t for t in tis if t["state"] == "success" and t["task_id"] == "triage")
    log = so.task_log("tg_incident", run_id, "triage", ran["try_number"])
    assert f"http://{ran['hostname']}:" in log and "Following branch" in log, log[:2000]
    job.training(2, timeout=300)  # the job trains on, with the standby in the evicted machine's place


@pytest.mark.full  # (the CI tier's budget: the workers' diagnosis runs in the hang's scenario too)
def test_a_crash_is_restarted_at_once_by_the_workers_in_place_on_the_surviving_scheduler(plane):
    job, so = plane
    machines = list(job.ctl.fleet.job(JOB).machine_list)
    job.settled()
    inc, _machine, _t = job.fault_and_incident(FAULTS["crash"])
    assert inc.state == "resolved" and inc.category == "crash", (inc.state, inc.category, inc.summary)
    _conf, tasks = job.incident_run(inc.id)
    assert job.branch(tasks)["task_id"] == "restart_at_once"
    assert not [a for a in job.ctl.fleet.actions(inc.id) if a.kind == "evict"]  # L1 of its machine passed
    assert job.ctl.fleet.job(JOB).machine_list == machines  # restarted in place
    assert inc.lost_steps is not None and inc.lost_steps <= 1
    run = so.incident_run(inc.id)
    hosts = {t["hostname"] for t in so.task_instances("tg_incident", run["dag_run_id"]) if t["state"] == "success"}
    assert hosts <= {scaleout.worker_address(so.spec, i) for i in range(2)}, hosts


@pytest.mark.full  # (the CI tier's budget: the embedded tier's hang, also full, and the stacks' unit tests)
def test_a_hang_over_evicts_the_stuck_ranks_pipeline_from_the_stacks_the_workers_took(plane):
    job, so = plane
    job.settled()
    assert job.repair()  # the machine the explicit fault evicted is fixed and parked warm again
    before = list(job.ctl.fleet.job(JOB).machine_list)
    fault = FAULTS["hang"]
    inc, machine, _t = job.fault_and_incident(fault)
    assert inc.state == "resolved" and inc.category == "hang", (inc.state, inc.category, inc.summary)
    _conf, tasks = job.incident_run(inc.id)
    assert job.branch(tasks)["task_id"] == "runtime_analysis"
    evicted = [a for a in job.ctl.fleet.actions(inc.id) if a.kind == "evict" and a.outcome == "done"]
    pipeline = {before[i] for i in TOPOLOGY.machines_of_group("pp", fault.rank)}
    assert len(evicted) == 1 and set(evicted[0].machines) == pipeline and machine in pipeline, evicted
    after = job.ctl.fleet.job(JOB).machine_list
    assert not set(after) & pipeline and len(after) == len(before)
    assert inc.lost_steps is not None and inc.lost_steps <= 1  # the pipeline's state came from the replicas
    run = so.incident_run(inc.id)
    hosts = {t["hostname"] for t in so.task_instances("tg_incident", run["dag_run_id"]) if t["state"] == "success"}
    assert hosts <= {scaleout.worker_address(so.spec, i) for i in range(2)}, hosts


def test_bringing_the_plane_up_again_restarts_only_what_died(plane):
    _job, so = plane
    before = json.loads((so.root / scaleout.STATE).read_text())["pids"]
    assert so.procs["scheduler-0"].poll() is not None  # killed by the first scenario
    so.launch()
    so.ready(timeout=120)
    after = json.loads((so.root / scaleout.STATE).read_text())["pids"]
    assert after["scheduler-0"] != before["scheduler-0"] and so.procs["scheduler-0"].poll() is None
    assert {k: v for k, v in after.items() if k != "scheduler-0"} == \
        {k: v for k, v in before.items() if k != "scheduler-0"}  # nothing else started twice

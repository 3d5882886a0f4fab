"""A guarded job on an emulated cluster, under the real control plane.

:class:`GuardedJob` runs ``airflow standalone`` with trainguard's DAGs over a namespace cluster and a
fleet database, launches the reference job on the cluster's active machines, and does the chores a
person or a repair crew does around it: park standbys warm, send evicted machines through repair,
inject a fault and wait for the incident it causes to close. ``trainguard demo``, the recovery
benchmark and the fault campaign are built on it.

:data:`FAULTS` names the faults it can script, one per rung of the decision ladder and more: where
each hits (a node of the job, a rank of it), how it is undone, how long its recovery may take.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from trainguard.core.topology import Topology
from trainguard.emulation import inject
from trainguard.emulation.standalone import Standalone, poll
from trainguard.node_tools.bus import BusReader, open_bus
from trainguard.node_tools.inventory import Inventory
from trainguard.node_tools.transport import transport_for
from trainguard.operators.control import ControlConfig, Controller
from trainguard.operators.fleet import states
from trainguard.operators.jobspec import JobSpec, reference_spec
from trainguard.operators.policy import rungs

TOPOLOGY = Topology(tp=2, pp=2, dp=2)
TRAIN_ARGS = ("--checkpoint", "--step-delay-s", "0.2")
# an accelerator's 0.2 s of kernels per step: the host thread waits inside the step (it counts as training)
DEVICE_TRAIN_ARGS = ("--checkpoint", "--emulate-device-s", "0.2")
# the harness is the repair crew and deploys its own revisions: no scheduled pool, code or checkpoint runs
NO_SCHEDULES = {"TG_POOL_SCHEDULE": "", "TG_CODE_UPDATE_SCHEDULE": "", "TG_VERIFY_SCHEDULE": "",
                "TG_VERIFY_ON_COMMIT": "0"}
# the tg_incident tasks that decide an incident (the branches of the ladder)
HANDLERS = frozenset(rungs.TASK_IDS)


@dataclass(frozen=True)
class Fault:
    """How a scripted fault is injected (with :func:`trainguard.emulation.inject.inject`)."""

    kind: str  # the injector's fault kind
    node: int  # the node rank (index in the job's machine list) of the machine it hits
    rank: int | None = None  # the rank it hits; None: the whole machine
    params: Mapping[str, str] = field(default_factory=dict)
    flap: tuple[str, ...] = ()  # undo the fault once the machine reported one of these alert kinds
    repeats: int = 1  # injections in a row (a repeated network fault); the last one's incident counts
    bad_revision: bool = False  # the job first switches to a revision whose code fails (a user-code error)
    timeout: float = 300.0  # seconds its incident may take to close
    what: str = ""  # one line for people


def faults_for(topo: Topology) -> dict[str, Fault]:
    """The scriptable faults for a job of ``topo`` (at least 4 machines: the faults spread over them)."""
    first = [topo.ranks_on(n)[0] for n in range(topo.machines)]
    n = topo.machines
    return {
        "gpu_lost": Fault("gpu_lost", node=1 % n, what="a GPU falls off the bus (explicit fault)"),
        "nic_down": Fault("nic_down", node=2 % n, flap=("kernel_link", "nic_down"), repeats=2,
                          what="a NIC flaps twice within the hour"),
        "disk_full": Fault("disk_full", node=1 % n, what="the checkpoint disk fills up"),
        "crash": Fault("crash", node=2 % n, rank=first[2 % n], what="a rank dies with no log to blame"),
        "hang": Fault("hang", node=(n - 1), rank=first[n - 1], what="a rank stops in a collective (hang)"),
        "user_error": Fault("user_error", node=0, rank=0, bad_revision=True,
                            what="a new code revision raises in the training loop"),
        "nan": Fault("nan", node=1 % n, rank=first[1 % n], what="the loss turns NaN"),
        "sdc": Fault("sdc", node=2 % n, what="a GPU computes wrong (silent data corruption)"),
        "bitflip": Fault("bitflip", node=n - 1, rank=first[n - 1], timeout=480.0,
                         what="a GPU flips a gradient bit only while training"),
        "slow": Fault("slow", node=1 % n, rank=first[1 % n], params={"seconds": "3.0"},
                      what="a rank slows down 3 s per step (fail-slow)"),
    }


FAULTS = faults_for(TOPOLOGY)


def iso_ts(ts: str | None) -> float | None:
    """An Airflow API timestamp as epoch seconds."""
    return datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp() if ts else None


class GuardedJob:
    """The control plane and one guarded job on an emulated cluster (``inv``); ``home`` holds the fleet
    database and the Airflow home. ``settings`` are the control plane's ``TG_*`` environment (they go
    to the DAGs' tasks and to this process's :class:`Controller` alike). ``spec``: a job of one's own to
    run instead of the reference job (its ``name`` is ``job``; its machines are the cluster's active ones)."""

    def __init__(self, inv: Inventory, home: Path, *, job: str, topology: Topology = TOPOLOGY,
                 train_args: Sequence[str] = TRAIN_ARGS, settings: Mapping[str, str] | None = None,
                 port: int | None = None, remote_tier: bool = True, airflow: Standalone | None = None,
                 spec: JobSpec | None = None) -> None:
        self.inv, self.home, self.job, self.topology = inv, home, job, topology
        self.spec = spec  # what the job runs (None: the reference job with ``train_args``)
        self.train_args = spec.args if spec is not None else list(train_args)
        # the third tier: a directory of this host stands for the shared storage every machine mounts (the
        # machines are namespaces of this host); the control plane rescues copies into it before an eviction
        # that would take their last copy
        self.remote_url = f"file://{(home / 'remote-tier' / job).resolve()}" if remote_tier and spec is None else ""
        if self.remote_url and "--checkpoint" in self.train_args and not any(
                a.startswith(("--checkpoint-remote", "--checkpoint-s3")) for a in self.train_args):
            self.train_args += ["--checkpoint-remote", self.remote_url]
        self.transport = transport_for(inv)
        env = {"TG_FLEET_URL": str(home / "fleet.db"), "TG_INVENTORY": str(inv.path), "TG_CONTROL_HOME": str(home),
               **(settings or {})}
        self.ctl = Controller(ControlConfig.from_env(env))
        self.ctl.sync_inventory()
        (home / "airflow").mkdir(parents=True, exist_ok=True)
        # the control plane: ``airflow standalone`` (the embedded default), or the caller's (the scale-out
        # profile, :class:`trainguard.emulation.scaleout.ScaleOut`, whose settings ``settings`` must be)
        self.airflow = airflow or Standalone(home / "airflow", env, port=port)
        self._arming: threading.Thread | None = None  # the job's machines being armed again (see start)

    # ---- bring-up and teardown --------------------------------------------------------------------
    def start(self, *, log: Callable[[str], None] = lambda _m: None, submit: bool = False,
              launch_airflow: bool = True) -> None:
        """Park every machine warm (the standbys, and the job's own machines) while Airflow starts, then
        launch the job on its warm interpreters and wait for it to train. The job's machines are armed
        again (warm interpreters for the first restart) while it trains: :meth:`armed` waits for that.

        ``submit``: launch it as a user would, through a ``tg_job_launch`` run (the reference job's spec on the
        job's machines: validate, reserve, check, start, first step, arm), visible in the UI. ``launch_airflow``
        False: the Airflow this harness was handed runs already (a second job on the same control plane)."""
        standbys = [m.name for m in self.inv.by_role("standby")]
        active = [m.name for m in self.inv.by_role("active")][: self.topology.machines]
        log(f"parking warm standbys {', '.join(standbys)} and the job's machines; starting airflow standalone "
            f"on {self.airflow.url}")
        if launch_airflow:
            self.airflow.launch()  # it boots while the machines park
        # the job's machines park the interpreters of its launch and of its first restart at once: one import on
        # each, before the job runs, instead of a second one at the lowest priority beside its ranks (on 2 busy
        # cores that arming took 40-60 s, and the first fault waits for it)
        # (a submission's own tg_job_launch run arms the job: there the machines park for its launch alone)
        self.park(standbys, sets=dict.fromkeys(active, 1 if submit else 2))
        self.airflow.ready()
        log(f"airflow up: DAGs {', '.join(sorted(self.airflow.dag_ids()))}")
        own = self.spec.document() if self.spec is not None else None
        if submit:
            ref = self.spec or reference_spec(self.job, self.topology, train_args=self.train_args)
            spec = JobSpec.model_validate({**ref.document(), "machines": active})
            run_id = self.airflow.trigger("tg_job_launch", {"spec": spec.document()})
            log(f"submitted job {self.job} ({self.topology}) on {', '.join(active)}: tg_job_launch run {run_id}")
            state = self.airflow.finished("tg_job_launch", run_id, timeout=600)
            if state != "success":
                raise RuntimeError(f"tg_job_launch run {run_id} ended {state}; its tasks' logs are in the UI")
            log(f"job {self.job} launched and armed by tg_job_launch run {run_id}")
            self.training(2, timeout=300)
            return
        self.ctl.launch_job(self.job, self.topology, active, train_args=self.train_args, arm=False, warm=active,
                            spec=own)
        log(f"launched job {self.job} ({self.topology}) on {', '.join(active)} (warm)")
        self.training(2, timeout=300)
        self._arming = threading.Thread(target=self.ctl.arm, args=(self.job,), name="arm", daemon=True)
        self._arming.start()

    def armed(self, timeout: float = 300) -> None:
        """Wait until the job's machines have their warm interpreters for a restart (see :meth:`start`)."""
        if self._arming is not None:
            self._arming.join(timeout)
            if self._arming.is_alive():
                raise TimeoutError(f"the job's machines were not armed within {timeout:g} s")
            self._arming = None

    def stop(self) -> None:
        """Stop Airflow and the job (the cluster is its owner's to bring down)."""
        try:
            # its components are given 10 s: this Airflow home is the run's own, nothing in it is kept
            self.airflow.stop(grace_s=10.0)
        finally:
            if any(j.name == self.job for j in self.ctl.fleet.jobs()):
                self.ctl.stop(self.job)

    # ---- chores between faults ---------------------------------------------------------------------
    def park(self, names: Sequence[str], *, sets: Mapping[str, int] | None = None) -> None:
        """Park warm interpreters on ``names`` for one launch each (ranks + torchrun), and on each machine of
        ``sets`` for that many launches (one interpreter imports, then forks one copy per slot)."""
        want = {**dict.fromkeys(names, 1), **(sets or {})}
        if not want:
            return
        rpm = self.topology.ranks_per_machine
        done = self.transport.run_many([self.inv.machine(n) for n in want],
                                       lambda m: [self.inv.tg_node, "standby", "park", "--nproc",
                                                  str(want[m.name] * (rpm + 1) - 1)], timeout=240)
        bad = {n: r.describe() for n, r in done.items() if not r.ok}
        if bad:
            raise RuntimeError(f"parking standbys failed: {bad}")

    def repair(self) -> list[str]:
        """What a repair crew does for evicted machines: clear the fault, self-check, park warm.
        Returns the machines that went back to the pool."""
        evicted = [m.name for m in self.ctl.fleet.machines(state=states.EVICTED)]
        for name in evicted:
            inject.clear(self.inv, name)
            self.ctl.fleet.transition(name, states.REPAIR, reason="sent to repair")
            self.ctl.fleet.transition(name, states.SELF_CHECK, reason="repaired")
        self.park(evicted)
        for name in evicted:
            self.ctl.fleet.transition(name, states.STANDBY, reason="self-check passed (parked warm)",
                                      checked=True)
        return evicted

    def step(self) -> int:
        return int(self.ctl.progress(self.job)["step"])

    def training(self, steps: int = 2, *, timeout: float = 180) -> None:
        start = self.step()
        poll(lambda: self.step() >= start + steps, timeout=timeout, interval=0.5, what="the job to train")

    def settled(self, timeout: float = 300) -> None:
        """Wait until no tg_incident run is left running (the last one's rearm included)."""
        poll(lambda: all(r["state"] in ("success", "failed") for r in self.airflow.runs("tg_incident")),
             timeout=timeout, interval=1.0, what="the last incident's run to finish")

    def last_incident(self) -> int:
        return max((i.id for i in self.ctl.fleet.incidents(self.job)), default=0)

    def deploy_bad_revision(self, *, lazy: bool = False) -> str:
        """Mark the running revision known-good and update to a next one (whose code will fail): a hot
        update now, or with ``lazy`` a lazy one, which the next restart applies (the restart after the
        next incident: its machines park warm interpreters afterwards, so a failure of the new code
        restarts warm, where one right after a hot update finds them used up)."""
        job = self.ctl.fleet.job(self.job)
        self.ctl.fleet.mark_known_good(self.job, job.revision)
        revision = f"{job.revision}-next"
        if lazy:
            from trainguard.operators import code_updates

            self.ctl.fleet.record_revision(self.job, revision, reason="a revision with a bug")
            code_updates.request(self.ctl, self.job, revision, "lazy", reason="a revision with a bug")
        else:
            self.ctl.hot_update(self.job, revision, reason="a revision with a bug")
        return revision

    # ---- faults --------------------------------------------------------------------------------------
    def inject(self, fault: Fault, *, machine: str | None = None) -> tuple[str, float]:
        """Inject ``fault`` (undone at once for a flap, once the machine reported it); returns the machine
        and the time of the injection."""
        self.armed()
        machine = machine or self.ctl.fleet.job(self.job).machine_list[fault.node]
        reader = BusReader.from_now(open_bus(self.inv.bus_url))
        sent = time.time()
        done = inject.inject(self.inv, machine, fault.kind, rank=fault.rank, params=dict(fault.params) or None)
        t_fault = fault_time(done, sent, time.time())
        if fault.flap:
            try:
                poll(lambda: [a for a in reader.read() if a.machine == machine and a.kind in fault.flap],
                     timeout=30, interval=0.1, what=f"{machine} to report {' or '.join(fault.flap)}")
            finally:
                inject.clear(self.inv, machine, fault.kind)
        return machine, t_fault

    def incident_since(self, after_id: int, since_ts: float) -> Any:
        """The first closed incident after ``after_id`` holding an alert raised at ``since_ts`` or later
        (one that closed on alerts from before is not the fault's); None while there is none."""
        for inc in self.ctl.fleet.incidents(self.job):
            if inc.id > after_id and inc.state in ("resolved", "failed", "waiting_human") and \
                    any(a.ts >= since_ts for a in self.ctl.fleet.alerts_of(inc.id)):
                return inc
        return None

    def fault_and_incident(self, fault: Fault, *, machine: str | None = None,
                           on_tick: Callable[[], None] = lambda: None) -> tuple[Any, str, float]:
        """Inject ``fault`` (``repeats`` times, each after the last was handled), wait for the incident
        it causes to close, undo it; returns (incident, machine, time of the last injection)."""
        machine = machine or self.ctl.fleet.job(self.job).machine_list[fault.node]
        inc, t_fault = None, time.time()
        for attempt in range(fault.repeats):
            if attempt:  # the next one comes once the last was handled, within the repeat window
                self.settled()
                self.training()
            last = self.last_incident()
            try:
                _, t_fault = self.inject(fault, machine=machine)

                def closed(after: int = last, since: float = t_fault) -> Any:
                    on_tick()
                    return self.incident_since(after, since)

                try:
                    inc = poll(closed, timeout=fault.timeout, interval=0.5,
                               what=f"the {fault.kind} incident to close")
                except TimeoutError as exc:  # say where it stands: which incident, which task of its run
                    raise TimeoutError(f"{exc}; {self.where_incidents_stand(last)}") from None
            finally:
                inject.clear(self.inv, machine, fault.kind)
        return inc, machine, t_fault

    def where_incidents_stand(self, after_id: int) -> str:
        """The incidents of the job after ``after_id``, each with its state and its run's unfinished tasks."""
        said = []
        for inc in self.ctl.fleet.incidents(self.job):
            if inc.id <= after_id:
                continue
            _conf, tasks = self.incident_run(inc.id)
            open_tasks = sorted(f"{t['task_id']}={t['state']}" for t in tasks.values()
                                if t["state"] not in ("success", "skipped"))
            said.append(f"incident {inc.id} {inc.state} ({inc.category}): run "
                        f"{'tasks ' + ', '.join(open_tasks) if open_tasks else 'done' if tasks else 'not found'}")
        return "; ".join(said) or "no incident opened"

    def swaps(self, incident_id: int) -> dict[str, str]:
        """The incident's evictions done: evicted machine -> the standby in its place."""
        return {old: new for a in self.ctl.fleet.actions(incident_id) for old, new in action_swaps(a).items()}

    def incident_run(self, incident_id: int) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
        """The incident's tg_incident run (its conf, with ``first_seen_ts``: when the alert watcher first saw the
        batch that opened it) and its task instances' states and times."""
        run = self.airflow.incident_run(incident_id, self.ctl.fleet)
        if run is None:
            return {}, {}
        first = next((c["first_seen_ts"] for c in self.ctl.fleet.claims_of(incident_id)
                      if c["run"] == run["dag_run_id"]), None)
        return {**(run.get("conf") or {}), "first_seen_ts": first or (run.get("conf") or {}).get("first_seen_ts")}, {
            t["task_id"]: {"task_id": t["task_id"], "state": t["state"], "start": iso_ts(t["start_date"]),
                           "end": iso_ts(t["end_date"])}
            for t in self.airflow.task_instances("tg_incident", run["dag_run_id"])}

    def branch(self, tasks: Mapping[str, Mapping[str, Any]]) -> Mapping[str, Any]:
        """The handler task that decided the incident (from :meth:`incident_run`'s tasks)."""
        return next((t for t in tasks.values() if t["task_id"] in HANDLERS and t["state"] == "success"), {})


def fault_time(done: Mapping[str, Any], sent: float, back: float) -> float:
    """When an injected fault took effect: the time the machine recorded it (``done["ts"]``: the injection's
    own clock, so not the SSH connection and the command's start before it), kept within ``sent`` .. ``back``
    (when the host asked and when the answer came) should that clock be off or the answer lack it."""
    ts = done.get("ts") if isinstance(done, Mapping) else None
    return min(max(float(ts), sent), back) if isinstance(ts, (int, float)) else sent


def action_swaps(action: Any) -> dict[str, str]:
    """What an eviction action did (its detail: evicted machine -> standby); empty unless it was done."""
    if action.kind != "evict" or action.outcome != "done":
        return {}
    try:
        return dict(json.loads(action.detail or "{}"))
    except ValueError:
        return {}

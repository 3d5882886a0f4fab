"""Side by side with the peers on one emulated cluster: the same small job (``bench/peers_job.py``), the same
machines, the same faults, under trainguard (the job's spec submitted to its control plane in a real ``airflow
standalone``, with one warm standby: as one DDP job, ``trainguard``, and as replica groups meeting at a lighthouse,
``trainguard_replicas``), NVIDIA's nvidia-resiliency-ext (``ft_launcher``, rank monitors, in-job restart) and
torchft (replica groups and a lighthouse; the survivors train on, a restarted group heals from a live peer).
A plain DDP job is compared with NVRx, a replica-group job with torchft.

Each peer is run the way its documentation integrates it, with its real launcher on the emulated machines
(network namespaces of this host, gloo): nothing is imitated. The peers are not trainguard's dependencies;
install them first (versions that install on CPU-only Python 3.11: ``bench/requirements-peers.txt``)::

    uv pip install --python .venv/bin/python --no-deps -r bench/requirements-peers.txt
    python bench/peers.py [--trials 3] [--peers trainguard,trainguard_replicas,nvrx,torchft]
                          [--faults crash,hang,hang_collective,machine_lost,nan,slow]
                          [--out bench/results/peers.json] [--logs DIR]

Faults (the machine it hits is never the rendezvous host m0):

- ``crash``: SIGKILL of one rank;
- ``hang``: SIGSTOP of one rank (every thread of it stops: a rank that hangs outside a collective);
- ``hang_collective``: one rank stalls before its backward pass, alive (its background threads run on), so every
  other rank hangs inside the gradient all-reduce;
- ``machine_lost``: every process of one machine killed and its link set down (no RST: peers see silence);
- ``nan``: the job's loss is NaN on one machine from the next step on (until the harness clears it);
- ``slow``: every step of one machine takes 3 s longer from the next step on (a throttled GPU, fail-slow).

Each peer runs tuned as its own documentation and maintainers say (:data:`TUNING`: every setting that is not a
default, with its source, recorded in the result's setup; ``--logs`` keeps every launcher's and lighthouse's output).

Per trial, read from the ranks' step lines: the GPU-seconds lost over the :data:`WATCH_S` window after the fault
(:func:`gpu_seconds_lost`: stopped time, a slot left out, slower steps and steps done again all count; the figure
the tables lead with), whether training went on (``resumed``), fault -> the first step finished after it
(``resume_s``), fault -> training at its full width again (``full_width_s``: every replica back,
for torchft its throughput before the fault), steps done again (``steps_lost``), healthy machines taken out, and
what a human had to do. For ``slow``, training never stops: ``resume_s`` is fault -> the first of
:data:`RESUMED_STEPS` steps in a row at the pace before the fault. Metric names carry the system
(``nvrx.crash.resume_s``).

Each trainguard trial gets a control plane of its own (a fresh fleet database and Airflow), as each NVRx and
torchft trial gets fresh launchers; the harness then does what a repair crew does (the lost machine brought back,
the cluster's roles as they were) before the next trial. Airflow's start is outside every measurement.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import emulated_cluster, stop_on_sigterm, summarize, timeline, write_result
from trainguard.emulation import cluster, inject
from trainguard.emulation.guarded import NO_SCHEDULES, GuardedJob
from trainguard.emulation.replicas import Lighthouse
from trainguard.emulation.standalone import poll
from trainguard.node_tools.inventory import Inventory
from trainguard.operators.jobspec import JobSpec

ROOT = Path(__file__).resolve().parent.parent
SPEC = cluster.ClusterSpec(name="tgq", machines=5, standbys=1, subnet="10.213.24.0/24", disk_mb=64, gpus=1)
MACHINES = ["m0", "m1", "m2", "m3"]
SPARE = "m4"
VICTIM = "m2"
LIGHTHOUSE_PORT = 29510
RDZV_PORT = 29500
WARMUP_STEPS = 25  # steps every replica finishes before a fault (the last 10 set the pace)
WATCH_S = 90.0  # how long after a fault the trial watches, at most
SETTLED_STEPS = 5  # steps at full width after recovery before a trial may end early
HEARTBEAT_S = 5.0  # NVRx's first rank heartbeat timeout, until the job calculates its own (below)
MONITOR_S = 0.1  # the launchers' worker monitor interval (torchrun's and ft_launcher's default)
# every peer setting that is not the default, with where it comes from (recorded in the result's setup)
TUNING: dict[str, dict[str, Any]] = {
    "nvrx": {
        "spare": {"value": "a fifth ft_launcher on the standby machine, started once the job trains: it waits on the "
                           "rendezvous' redundancy list and takes a lost node's place",
                  "source": "nvidia_resiliency_ext 0.4.1 fault_tolerance/_ft_rendezvous.py: nodes past max_nodes "
                            "join the redundancy list and are migrated into the next round"},
        "nnodes": {"value": "4:4", "source": "the job's fixed width: max_nodes participants, the rest spares "
                                             "(_ft_rendezvous.py, as above)"},
        "last_call_timeout": {"value": 1, "source": "torch.distributed.elastic rendezvous --rdzv-conf "
                                                    "last_call_timeout (default 30 s); ft_launcher passes it on"},
        "monitor_interval": {"value": MONITOR_S, "source": "torchrun --monitor-interval default (0.1 s)"},
        "heartbeat_timeouts": {"value": "calculated by the job after 10 steps (RankMonitorClient."
                                        "calculate_and_set_hb_timeouts), from 5 s before",
                               "source": "NVRx fault-tolerance usage guide: timeouts calculated from the observed "
                                         "heartbeat intervals (safety_factor 5)"},
        "workload_check_interval": {"value": 1, "source": "FaultToleranceConfig (default 5 s): the rank monitor's "
                                                          "check period"},
        "in_process_restart": {"value": "not run here", "source": "nvidia_resiliency_ext.inprocess needs NCCL "
                                                                  "(kept for bench/gpu.py)"}},
    "torchft": {
        "heartbeat_timeout_ms": {"value": 1000, "source": "meta-pytorch/torchft#35: replicas heartbeat every 100 ms, "
                                                          "so a 1 s timeout"},
        "heartbeat_interval_ms": {"value": 100, "source": "torchft Manager(heartbeat_interval=100 ms), its default"},
        "join_timeout_ms": {"value": 300, "source": "bench/degrade.py's lighthouse (the Python lighthouse's default, "
                                                    "100 ms, meta-pytorch/torchft#61, left a restarted group a step "
                                                    "behind and healing at every other step on these two cores)"},
        "quorum_tick_ms": {"value": 100, "source": "torchft_lighthouse --quorum_tick_ms default"},
        "collective_timeout_s": {"value": 2, "source": "the collective timeout trainguard's replica job uses "
                                                       "(bench/degrade.py --collective-timeout-s)"},
        "checkpoint": {"value": "every step, each replica group its own (model, optimizer, manager)",
                       "source": "torchft train_ddp.py: the user checkpoints model, optimizer and manager "
                                 "periodically"},
        "monitor_interval": {"value": MONITOR_S, "source": "torchrun --monitor-interval default (0.1 s)"}},
    "trainguard": {"settings": {"value": "defaults", "source": "operators/settings.py"}},
    "trainguard_replicas": {
        "settings": {"value": "defaults", "source": "operators/settings.py"},
        "replicas": {"value": "one replica group a machine, min_replicas 1", "source": "the job's spec (replicas:)"},
        "lighthouse": {"value": "heartbeat timeout 1000 ms, join timeout 300 ms, quorum tick 100 ms",
                       "source": "the same lighthouse settings as torchft's above"},
        "collective_timeout_s": {"value": 2, "source": "as torchft's above (bench/degrade.py --collective-timeout-s)"}},
}
RESUMED_STEPS = 5  # steps begun after the fault that must finish before training counts as resumed
SLOW_S = 3.0  # the slow fault's extra seconds a step
SLOW_FACTOR = 1.5  # a step this many times the median step before the fault is a slow one

FAULTS = ("crash", "hang", "hang_collective", "machine_lost", "nan", "slow")
PEERS = ("trainguard", "trainguard_replicas", "nvrx", "torchft")
#: the systems whose job is replica groups: a slot of the job is a group, and the groups step apart
GROUPS = ("trainguard_replicas", "torchft")


def venv_bin(name: str) -> str:
    return str(Path(sys.executable).parent / name)


def versions() -> dict[str, str]:
    out = {}
    for dist in ("trainguard", "torch", "torchft", "nvidia-resiliency-ext"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "not installed"
    return out


class Machines:
    """Processes started inside the emulated machines' namespaces, each in a session of its own."""

    def __init__(self, inv: Inventory, work: Path) -> None:
        self.inv, self.work = inv, work
        self.procs: dict[str, list[subprocess.Popen[bytes]]] = {}

    def address(self, name: str) -> str:
        return self.inv.machine(name).address

    def faults_dir(self, name: str) -> Path:
        d = self.work / "faults" / name
        d.mkdir(parents=True, exist_ok=True)
        return d

    def spawn(self, name: str, argv: list[str], env: dict[str, str], tag: str) -> subprocess.Popen[bytes]:
        netns = self.inv.machine(name).extra["netns"]
        full = {**os.environ, "PYTHONPATH": str(ROOT), "PEERS_MACHINE": name, "PEERS_ADDRESS": self.address(name),
                "PEERS_FAULTS": str(self.faults_dir(name)), "OMP_NUM_THREADS": "1",
                "GLOO_SOCKET_IFNAME": "eth0", **env}
        out = open(self.work / f"{tag}-{name}.out", "ab")  # noqa: SIM115
        proc = subprocess.Popen(["ip", "netns", "exec", netns, *argv], env=full, stdout=out, stderr=subprocess.STDOUT,
                                cwd=ROOT, start_new_session=True)
        self.procs.setdefault(name, []).append(proc)
        return proc

    def kill_machine(self, name: str) -> None:
        """Every process of the machine ends (SIGKILL), as when it loses power."""
        netns = self.inv.machine(name).extra["netns"]
        pids = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True).stdout.split()
        for proc in self.procs.get(name, []):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)

    def stop_all(self) -> None:
        for name, procs in self.procs.items():
            for proc in procs:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGCONT)
                    os.killpg(proc.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(10)
            self.kill_machine(name)
            for f in self.faults_dir(name).iterdir():
                f.unlink()
        self.procs = {}


# ---- the peers, as each documents its integration ------------------------------------------------------------
def job_argv(mode: str, state_dir: Path) -> list[str]:
    return [str(ROOT / "bench" / "peers_job.py"), "--mode", mode, "--state-dir", str(state_dir)]


def start_nvrx(ms: Machines, trial_dir: Path, names: list[str] = MACHINES) -> None:
    """``ft_launcher`` on ``names``: one c10d rendezvous on m0, in-job restarts, a rank monitor per rank (its
    heartbeat timeouts :data:`HEARTBEAT_S` until the job calculates its own), the job 4 nodes wide (``--nnodes
    4:4``): a launcher started once the job trains (:data:`SPARE`, see :func:`run_trial`) is a hot spare on the
    rendezvous' redundancy list. Every setting that is not a default: :data:`TUNING`."""
    state = trial_dir / "nvrx-state"
    state.mkdir(parents=True, exist_ok=True)
    for name in names:
        argv = [venv_bin("ft_launcher"), "--nnodes", "4:4", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"{ms.address('m0')}:{RDZV_PORT}", "--rdzv-id", trial_dir.name,
                "--local-addr", ms.address(name), "--max-restarts", "20", "--monitor-interval", str(MONITOR_S),
                # the rendezvous store lives in m0's agent: it cannot tell from its host name (every namespace of
                # this host shares one) that the endpoint is its own address
                "--rdzv-conf", f"is_host={'true' if name == 'm0' else 'false'},last_call_timeout="
                               f"{TUNING['nvrx']['last_call_timeout']['value']}",
                "--ft-param-initial_rank_heartbeat_timeout", str(HEARTBEAT_S),
                "--ft-param-rank_heartbeat_timeout", str(HEARTBEAT_S), "--ft-param-workload_check_interval",
                str(TUNING["nvrx"]["workload_check_interval"]["value"]),
                "--ft-param-rank_termination_signal", "SIGKILL", *job_argv("nvrx", state)]
        ms.spawn(name, argv, {"PEERS_LOG": str(trial_dir / "steps")}, "nvrx")


def start_torchft(ms: Machines, trial_dir: Path) -> subprocess.Popen[bytes]:
    """The lighthouse on the host's bridge address, then one replica group per machine: ``torchrun`` of one rank
    with restarts (a crashed group comes back and heals from a live peer), ``min_replicas`` 1."""
    host = SPEC.host_address
    tf = {k: str(v["value"]) for k, v in TUNING["torchft"].items()}
    lighthouse = subprocess.Popen(
        [venv_bin("torchft_lighthouse"), "--min_replicas", "1", "--quorum_tick_ms", tf["quorum_tick_ms"],
         "--join_timeout_ms", tf["join_timeout_ms"], "--heartbeat_timeout_ms", tf["heartbeat_timeout_ms"],
         "--bind", f"{host}:{LIGHTHOUSE_PORT}"],
        stdout=open(trial_dir / "lighthouse.out", "ab"), stderr=subprocess.STDOUT, start_new_session=True)  # noqa: SIM115
    for i, name in enumerate(MACHINES):
        ms.spawn(name, [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "1",
                        "--max-restarts", "20", "--monitor-interval", str(MONITOR_S), "--master-addr",
                        ms.address(name), "--master-port", str(RDZV_PORT), *job_argv("torchft", trial_dir),
                        "--collective-timeout-s", tf["collective_timeout_s"]],
                 {"PEERS_LOG": str(trial_dir / "steps"), "REPLICA_GROUP_ID": str(i),
                  "TORCHFT_LIGHTHOUSE": f"http://{host}:{LIGHTHOUSE_PORT}"}, "torchft")
    return lighthouse


def start_trainguard(inv: Inventory, trial_dir: Path, job: str, *, lighthouse: str = "") -> GuardedJob:
    """The job's spec (``-m bench.peers_job --mode trainguard``, one rank a machine on :data:`MACHINES`; with a
    ``lighthouse`` URL, ``--mode trainguard_replicas`` as one replica group a machine meeting there) launched by a
    control plane of its own: a fleet database and ``airflow standalone`` with trainguard's DAGs, the standby
    parked warm, its settings the defaults (the harness repairs machines and deploys no code: no scheduled pool,
    code or checkpoint runs)."""
    mode = "trainguard_replicas" if lighthouse else "trainguard"
    timeout = str(TUNING["trainguard_replicas"]["collective_timeout_s"]["value"])
    spec = JobSpec(name=job, command=["-m", "bench.peers_job", "--mode", mode,
                                      *(["--collective-timeout-s", timeout] if lighthouse else [])],
                   workdir=str(ROOT), machines=MACHINES, processes_per_machine=1,
                   env={"PEERS_LOG": str(trial_dir / "steps"), "PEERS_FAULTS": str(trial_dir / "faults" / "{machine}")},
                   replicas={"lighthouse": lighthouse, "min_replicas": 1} if lighthouse else None)
    home = trial_dir / "control"
    home.mkdir()
    g = GuardedJob(inv, home, job=job, topology=spec.topology(), settings=NO_SCHEDULES, spec=spec)
    try:
        g.start()
        g.armed()
    except BaseException:
        g.stop()
        raise
    return g


def trainguard_record(g: GuardedJob, t_fault: float) -> dict[str, Any]:
    """What trainguard's fleet database says of the trial: the incidents opened after the fault (category, state,
    its swaps) and the machines it evicted."""
    incidents = [(i, g.swaps(i.id)) for i in g.ctl.fleet.incidents(g.job) if i.opened_ts >= t_fault - 1.0]
    evicted = sorted({old for _, swaps in incidents for old in swaps})

    def tasks(incident_id: int) -> list[list[Any]]:
        with contextlib.suppress(Exception):  # (the api-server is still up: the record is read before it stops)
            return timeline(g.incident_run(incident_id)[1], t_fault)
        return []

    def actions(incident_id: int) -> list[list[Any]]:
        return [[a.kind, ",".join(a.machines), a.outcome, round(a.started_ts - t_fault, 2),
                 round(a.finished_ts - a.started_ts, 2) if a.finished_ts else None]
                for a in g.ctl.fleet.actions(incident_id)]

    return {"incidents": [{"id": i.id, "category": i.category, "state": i.state, "swaps": swaps,
                           "alert_s": round(i.first_alert_ts - t_fault, 2), "summary": i.summary,
                           "tasks": tasks(i.id), "actions": actions(i.id)} for i, swaps in incidents],
            "evicted": evicted, "healthy_taken_out": [m for m in evicted if m != VICTIM]}


def reset_cluster(inv: Inventory) -> None:
    """What a repair crew does between trainguard trials: the victim machine's sshd and agent back (a lost
    machine's were killed), its faults cleared, every machine's role as the cluster came up."""
    assert inv.path is not None
    inject.clear(inv, VICTIM, "nic_down")  # its link up (from the host)
    fresh = cluster.up(SPEC, inv.path.parent, log=lambda *_: None)  # its sshd and agent again
    for i, m in enumerate(fresh.machines):
        m.role = SPEC.role(i)
    fresh.save(inv.path)
    inject.clear(fresh, VICTIM)  # then the rest of its faults, over SSH


# ---- reading the steps ------------------------------------------------------------------------------------------
def step_lines(trial_dir: Path) -> list[dict[str, Any]]:
    out = []
    for f in sorted((trial_dir / "steps").glob("*.jsonl")):
        for line in f.read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                out.append(json.loads(line))
    return sorted(out, key=lambda d: d["ts"])


def warmed_up(trial_dir: Path, replicas: int, steps: int) -> bool:
    """Every one of ``replicas`` finished ``steps`` steps (each step line names its replica)."""
    done: dict[str, int] = {}
    for d in step_lines(trial_dir):
        done[d["replica"]] = done.get(d["replica"], 0) + 1
    return len(done) >= replicas and min(done.values()) >= steps


def judge(lines: list[dict[str, Any]], t_fault: float, width: int) -> dict[str, Any]:
    """What the step lines say about the fault at ``t_fault``: the newest step finished before it, the first step
    begun after it that finished (resume), the first time every one of ``width`` replicas/ranks finished a step together
    again after a step at a narrower width or a restart (full width), and the steps finished again (a step
    number finished both before and after the fault)."""
    before = [d for d in lines if d["ts"] < t_fault]
    after = [d for d in lines if d["ts"] >= t_fault]
    last = max((d["step"] for d in before), default=-1)
    out: dict[str, Any] = {"last_step_before": last, "resumed": False, "resume_s": None, "full_width_s": None,
                           "steps_lost": None, "steps_after": 0, "restarted": False, "narrowed": False}
    if not after:
        return out
    # training resumed: a step that began after the fault finished (one past the step in flight at the fault,
    # or any step of a process started after it); the step in flight may still finish on the survivors
    pids_before = {d["pid"] for d in before}
    # something acted: a rank that was not there before logged a step, or steps ran narrower than the job
    out["restarted"] = any(d["pid"] not in pids_before for d in after)
    out["narrowed"] = any(d["participants"] < width for d in after)
    # (with a finite loss: a model whose parameters a NaN reached "trains" on, but learns nothing)
    resumed = [d for d in after if (d["step"] > last + 1 or d["pid"] not in pids_before)
               and math.isfinite(d["loss"])]
    out["steps_after"] = len({d["step"] for d in after})
    if len({d["step"] for d in resumed}) < RESUMED_STEPS:  # a step or two, then down again, is not training
        return out
    out.update(resumed=True, resume_s=round(resumed[0]["ts"] - t_fault, 2))
    # steps the job finished again: a restart from an older checkpoint redoes them from the lowest step a new
    # process finished (a restart from nothing, from step 0: every step), replicas that train on redo none
    done_before = {d["step"] for d in before}
    redone = [d["step"] for d in after if d["pid"] not in pids_before and d["step"] in done_before]
    out["steps_lost"] = len({s for s in done_before if s >= min(redone)}) if redone else 0
    # full width again: steps in the order they finished (a restarted process counts its steps again from
    # where it restored, even from 0), the step in flight at the fault left out
    by_step: dict[int, list[dict[str, Any]]] = {}
    for d in after:
        if d["step"] <= last + 1 and d["pid"] in pids_before:  # in flight at the fault on the same processes
            continue
        by_step.setdefault(d["step"], []).append(d)
    narrowed = False
    for step in sorted(by_step, key=lambda k: min(d["ts"] for d in by_step[k])):
        ds = by_step[step]
        full = max(d["participants"] for d in ds) >= width and len({d["replica"] for d in ds}) >= width
        if not full:
            narrowed = True
        elif narrowed or any(d["pid"] not in pids_before for d in ds):
            out["full_width_s"] = round(max(d["ts"] for d in ds) - t_fault, 2)
            break
    return out


def gpu_seconds_lost(lines: list[dict[str, Any]], t_fault: float, until: float, *, by_replica: bool,
                     window_s: float = WATCH_S, slots: int = len(MACHINES)) -> dict[str, Any]:
    """The job's GPU-seconds lost to the fault at ``t_fault`` over the window of ``window_s`` after it, one GPU a
    slot of the job (a rank; a replica group for torchft, ``by_replica``): per slot, the time in the window it
    spent on no kept step (every interval between two kept steps beyond one step of the job's pace before the
    fault, the median of its last intervals), plus the steps it had done before the fault and did again after (a
    restore went back past them). A step is kept when its loss is finite and no later run of it followed. Stopped
    time, a slot left out (narrower steps), slower steps and steps done again all count; a pace faster than before
    the fault (fewer processes on the emulation's two cores) earns nothing back. The trial watches until
    ``until``: a job back at its pace before the window ended is charged nothing after it. Returns the total, per
    slot, and the step time it used."""
    def slot(d: dict[str, Any]) -> str:
        return str(d["replica"] if by_replica else d["rank"])

    first = sorted({slot(d) for d in lines})[:1]
    before = sorted(d["ts"] for d in lines if d["ts"] < t_fault and slot(d) in first)[-11:]
    gaps = sorted(b - a for a, b in itertools.pairwise(before))
    if not gaps:
        return {"gpu_s_lost": None, "step_s": None, "by_slot": {}}
    step_s = gaps[len(gaps) // 2]
    end = min(t_fault + window_s, until)
    by_slot: dict[str, float] = {}
    for s in sorted({slot(d) for d in lines})[:slots]:
        mine = sorted((d for d in lines if slot(d) == s), key=lambda d: d["ts"])
        last_run = {d["step"]: d["ts"] for d in mine}  # the latest run of each step
        kept = [d["ts"] for d in mine if t_fault < d["ts"] <= end and math.isfinite(d["loss"])
                and last_run[d["step"]] == d["ts"]]
        prior = [d["ts"] for d in mine if d["ts"] <= t_fault]
        points = [prior[-1] if prior else t_fault, *kept, end]
        stalled = sum(max(0.0, min(b - a - step_s, b - t_fault)) for a, b in itertools.pairwise(points))
        done_before = {d["step"] for d in mine if d["ts"] <= t_fault}
        redone = len({d["step"] for d in mine if d["ts"] > t_fault and d["step"] in done_before})
        by_slot[s] = round(stalled + redone * step_s, 2)
    missing = slots - len(by_slot)  # a slot that never logged a step lost all of it
    total = sum(by_slot.values()) + missing * (end - t_fault)
    return {"gpu_s_lost": round(total, 2), "step_s": round(step_s, 4), "by_slot": by_slot}


def judge_slow(lines: list[dict[str, Any]], t_fault: float, replica: str) -> dict[str, Any]:
    """The pace of ``replica``'s rank 0 around a slow fault at ``t_fault``: its median step before (the last 20),
    whether steps slowed (one over :data:`SLOW_FACTOR` x that), and fault -> the first of :data:`RESUMED_STEPS`
    steps in a row back at the pace before (after the slow ones; a restart's gap counts as slow)."""
    mine = sorted(d["ts"] for d in lines if d["replica"] == replica and d["rank"] == 0)
    before = [t for t in mine if t < t_fault]
    gaps_before = [b - a for a, b in itertools.pairwise(before)][-20:]
    out: dict[str, Any] = {"step_s_before": None, "slowed": False, "slow_step_s": None, "resumed": False,
                           "resume_s": None}
    if not gaps_before:
        return out
    base = sorted(gaps_before)[len(gaps_before) // 2]
    ts = [before[-1], *(t for t in mine if t >= t_fault)]
    slow: list[float] = []
    fast_run = 0
    for i in range(1, len(ts)):
        gap = ts[i] - ts[i - 1]
        if gap > SLOW_FACTOR * base:
            slow.append(gap)
            fast_run = 0
        elif slow:
            fast_run += 1
            if fast_run == RESUMED_STEPS:
                out.update(resumed=True, resume_s=round(ts[i - RESUMED_STEPS + 1] - t_fault, 2))
                break
    out.update(step_s_before=round(base, 3), slowed=bool(slow),
               slow_step_s=round(sorted(slow)[len(slow) // 2], 3) if slow else None)
    return out


def judge_slow_job(lines: list[dict[str, Any]], t_fault: float, peer: str) -> dict[str, Any]:
    """:func:`judge_slow` of the job: its first rank's pace for a job whose ranks step together (trainguard's,
    NVRx's), every replica group's for torchft's, whose groups step apart (a slow group left out of some quorums
    is slow still): resumed when all of them are, at the latest of their times, with the slowest slow step."""
    if peer not in GROUPS:
        return judge_slow(lines, t_fault, MACHINES[0])
    each = [judge_slow(lines, t_fault, str(i)) for i in range(len(MACHINES))]
    slowed = [v for v in each if v["slowed"]]  # (a group that never slowed has nothing to be back from)
    resumed = bool(slowed) and all(v["resumed"] for v in slowed)
    slow = [v["slow_step_s"] for v in slowed if v["slow_step_s"] is not None]
    return {**each[0], "resumed": resumed, "slowed": bool(slowed),
            "resume_s": max(v["resume_s"] for v in slowed) if resumed else None,
            "slow_step_s": max(slow) if slow else None}


def settled(lines: list[dict[str, Any]], t_fault: float, fault: str, peer: str, g: GuardedJob | None) -> bool:
    """Nothing more for the trial to see: training resumed, at its full width again (for ``slow``: back at its
    pace) :data:`SETTLED_STEPS` steps ago, and no incident of trainguard's open."""
    if fault == "slow":
        verdict = judge_slow_job(lines, t_fault, peer)
        done = verdict["resumed"] and max(d["ts"] for d in lines) >= t_fault + verdict["resume_s"] + SLOW_S
    else:
        verdict = judge(lines, t_fault, len(MACHINES))
        full = verdict["full_width_s"]
        done = full is not None and sum(d["ts"] > t_fault + full for d in lines) >= SETTLED_STEPS * len(MACHINES)
    return bool(done) and (g is None or all(i.state != "open" for i in g.ctl.fleet.incidents(g.job)
                                            if i.opened_ts >= t_fault - 1.0))


def human_work(fault: str, verdict: dict[str, Any]) -> str:
    """What a person had to do for the job to train at its full width and pace again, read from the verdict."""
    if not verdict.get("resumed"):
        if fault == "slow":
            return "find the slow machine and take it out of the job (nothing noticed it)"
        return "find the faulty machine, take it out and restart the job (training did not resume on its own)"
    if fault != "slow" and verdict.get("full_width_s") is None and verdict.get("narrowed"):
        return "bring a machine in place of the lost one and restart the job at its full width"
    return "nothing"


def victim_pid(trial_dir: Path, machine: str) -> int:
    """The pid of the rank that last logged a step on ``machine``."""
    mine = [d for d in step_lines(trial_dir) if d["replica"] in (machine, str(MACHINES.index(machine)))]
    return int(mine[-1]["pid"])


def inflict(ms: Machines, trial_dir: Path, fault: str) -> Any:
    """Inject ``fault`` on :data:`VICTIM`; returns the undo (called when the trial ends)."""
    if fault == "crash":
        os.kill(victim_pid(trial_dir, VICTIM), signal.SIGKILL)
        return lambda: None
    if fault == "hang":
        pid = victim_pid(trial_dir, VICTIM)
        os.kill(pid, signal.SIGSTOP)
        return lambda: _cont(pid)
    if fault == "machine_lost":
        inject.inject(ms.inv, VICTIM, "nic_down")
        ms.kill_machine(VICTIM)
        return lambda: inject.clear(ms.inv, VICTIM, "nic_down")
    if fault in ("nan", "slow", "hang_collective"):
        flag = ms.faults_dir(VICTIM) / {"hang_collective": "stall"}.get(fault, fault)
        flag.write_text(str(SLOW_S) if fault == "slow" else "1")
        return flag.unlink
    raise ValueError(f"unknown fault {fault!r}")


def _cont(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)


def run_trial(inv: Inventory, work: Path, peer: str, fault: str, n: int, watch_s: float = WATCH_S,
              logs: Path | None = None) -> dict[str, Any]:
    trial_dir = work / f"{peer}-{fault}-{n}"
    (trial_dir / "steps").mkdir(parents=True)
    ms = Machines(inv, trial_dir)
    lighthouse = None
    guarded: GuardedJob | None = None
    undo: Any = None
    try:
        if peer in ("trainguard", "trainguard_replicas"):
            reset_cluster(inv)  # a machine another system's trial lost comes back first (trainguard needs its sshd)
            if peer == "trainguard_replicas":  # the deployment's lighthouse, outside the job's machines
                lh = {k: int(TUNING["torchft"][k]["value"]) for k in ("heartbeat_timeout_ms", "join_timeout_ms")}
                lighthouse = Lighthouse(SPEC.host_address, trial_dir / "lighthouse.out", **lh).start()
            # a job of its own name: the machines keep each trial's checkpoint copies, and a replica job would find
            # the plain job's copies of the same trial number (another layout) and refuse to start
            guarded = start_trainguard(inv, trial_dir, f"peers-{peer}-{fault}-{n}",
                                       lighthouse=lighthouse.url if lighthouse is not None else "")
        elif peer == "nvrx":
            start_nvrx(ms, trial_dir)
        else:
            lighthouse = start_torchft(ms, trial_dir)
        try:
            poll(lambda: warmed_up(trial_dir, len(MACHINES), WARMUP_STEPS), timeout=180.0, interval=1.0,
                 what="the job's warm-up steps")
        except TimeoutError:
            return {"peer": peer, "fault": fault, "error": "the job did not reach its warm-up steps",
                    "output": {f.name: f.read_text(errors="replace").splitlines()[-12:]
                               for f in sorted(trial_dir.glob("*.out"))}}
        if peer == "nvrx":  # the hot spare joins the trained job: the rendezvous' redundancy list
            start_nvrx(ms, trial_dir, [SPARE])
            spare = trial_dir / f"nvrx-{SPARE}.out"
            poll(lambda: spare.exists() and "Starting elastic_operator" in spare.read_text(errors="replace"),
                 timeout=60.0, interval=0.5, what="the spare launcher to start")
            # it joined without a new round: the job trains on, as wide as before, with no restart
            poll(lambda: warmed_up(trial_dir, len(MACHINES), WARMUP_STEPS + 10), timeout=120.0, interval=1.0,
                 what="the job to train on beside its spare")
        t_fault = time.time()
        undo = inflict(ms, trial_dir, fault)
        # the trial's observation window: the peers act on their own in it; it ends early once training is
        # back at its full width (and pace) with nothing of trainguard's still open
        with contextlib.suppress(TimeoutError):
            poll(lambda: settled(step_lines(trial_dir), t_fault, fault, peer, guarded), timeout=watch_s,
                 interval=2.0, what="the fault's recovery")
        until = time.time()
        lines = step_lines(trial_dir)
        verdict = judge(lines, t_fault, len(MACHINES))
        lost = gpu_seconds_lost(lines, t_fault, until, by_replica=peer in GROUPS)
        verdict.update(gpu_s_lost=lost["gpu_s_lost"], gpu_s_lost_by_slot=lost["by_slot"], step_s=lost["step_s"])
        if fault == "slow":  # training never stopped: back at its pace is what counts
            verdict.update(judge_slow_job(lines, t_fault, peer))
        record = trainguard_record(guarded, t_fault) if guarded is not None else {"healthy_taken_out": []}
        detected = bool(record.get("incidents")) if guarded is not None else (
            verdict["resumed"] if fault == "slow" else verdict["restarted"] or verdict["narrowed"])
        return {"peer": peer, "fault": fault, "t_fault": round(t_fault, 3), "detected": detected, **verdict, **record,
                "human": human_work(fault, verdict)}
    finally:
        if undo is not None:
            with contextlib.suppress(Exception):
                undo()
        if guarded is not None:
            try:
                guarded.airflow.stop(grace_s=10.0)  # nothing acts on the fleet while the crew resets it
            finally:
                reset_cluster(inv)  # the lost machine reachable again, so that the job's stop reaches it
                with contextlib.suppress(Exception):  # (a job already down everywhere has nothing to stop)
                    guarded.ctl.stop(guarded.job)
        ms.stop_all()
        if peer == "nvrx":
            remove_ft_sockets()
        if isinstance(lighthouse, Lighthouse):
            lighthouse.stop()
        elif lighthouse is not None:
            lighthouse.kill()
            lighthouse.wait(10)
        if logs is not None:  # every launcher's and lighthouse's output, kept with the result
            keep = logs / trial_dir.name
            keep.mkdir(parents=True, exist_ok=True)
            for f in trial_dir.glob("*.out"):
                shutil.copy2(f, keep / f.name)


def remove_ft_sockets(tmp: Path | None = None) -> list[str]:
    """The Unix sockets ``ft_launcher`` and its rank monitors leave in the temporary folder
    (``_ft_launcher<pid>...socket``) once their processes are gone: removed (a live one is left alone)."""
    import re
    import tempfile

    gone = []
    for path in Path(tmp or tempfile.gettempdir()).glob("_ft_launcher*.socket"):
        m = re.match(r"_ft_launcher(\d+)", path.name)
        if m and not Path(f"/proc/{m.group(1)}").exists():
            path.unlink(missing_ok=True)
            gone.append(path.name)
    return gone


def metrics_of(trials: list[dict[str, Any]], peers: list[str], faults: list[str]
               ) -> tuple[dict[str, Any], dict[str, list[str]]]:
    """Per system and fault (``<system>.<fault>.<metric>``): the shares of trials detected and resumed, healthy
    machines taken out, and medians of resume, full width and steps lost over the trials that have them; and
    what a human had to do (each distinct answer)."""
    metrics: dict[str, Any] = {}
    human: dict[str, list[str]] = {}
    for peer in peers:
        for fault in faults:
            ts = [t for t in trials if t["peer"] == peer and t["fault"] == fault and "error" not in t]
            if not ts:
                continue
            key, n = f"{peer}.{fault}", len(ts)
            for name in ("detected", "resumed"):
                metrics[f"{key}.{name}_rate"] = {"value": round(sum(bool(t[name]) for t in ts) / n, 3), "n": n,
                                                 "unit": "share"}
            metrics[f"{key}.healthy_taken_out"] = {"value": sum(len(t["healthy_taken_out"]) for t in ts), "n": n,
                                                   "unit": "machines"}
            for field, unit in (("gpu_s_lost", "GPU-s"), ("resume_s", "s"), ("full_width_s", "s"),
                                ("steps_lost", "steps")):
                values = [float(t[field]) for t in ts if t.get(field) is not None]
                if values:
                    metrics[f"{key}.{field}"] = summarize(values, unit)
            human[key] = sorted({t["human"] for t in ts})
    return metrics, human


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--peers", default=",".join(PEERS))
    ap.add_argument("--faults", default=",".join(FAULTS))
    ap.add_argument("--watch-s", type=float, default=WATCH_S, help="how long each trial watches after its fault")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--logs", type=Path, help="a folder for every trial's launcher and lighthouse output")
    ap.add_argument("--why", default="", help="with --into: why these trials ran again (recorded with the rerun)")
    ap.add_argument("--into", type=Path, help="an earlier result of this script: the trials run now replace its "
                                              "trials of the same system and fault, the rest are kept, and the rerun "
                                              "is listed in its setup's reruns")
    args = ap.parse_args()
    stop_on_sigterm()
    peers = [p for p in args.peers.split(",") if p]
    faults = [f for f in args.faults.split(",") if f]
    trials: list[dict[str, Any]] = []
    with emulated_cluster(SPEC, "tg-bench-peers-") as (inv, home):
        for n in range(args.trials):
            for peer in peers:
                for fault in faults:
                    try:
                        t = run_trial(inv, home, peer, fault, n, args.watch_s, args.logs)
                    except Exception as exc:  # one trial's harness failure is reported, the others still run
                        t = {"peer": peer, "fault": fault, "error": f"{type(exc).__name__}: {exc}"[:500]}
                    print(json.dumps(t), flush=True)
                    trials.append(t)
    setup: dict[str, Any] = {"spec": SPEC.__dict__, "machines": MACHINES, "spare": SPARE, "versions": versions(),
                             "watch_s": args.watch_s, "window_s": WATCH_S, "heartbeat_s": HEARTBEAT_S,
                             "slow_s": SLOW_S, "tuning": TUNING, "logs": args.logs.name if args.logs else None,
                             "commit": _commit(), "reruns": []}
    if args.into:
        setup, trials = merged(json.loads(args.into.read_text())["setup"], trials, peers, faults, why=args.why)
    peers = [p for p in PEERS if any(t["peer"] == p for t in trials)]
    faults = [f for f in FAULTS if any(t["fault"] == f for t in trials)]
    metrics, human = metrics_of(trials, peers, faults)
    print(write_result("peers", quick=False, setup={**setup, "human": human, "trials": trials},
                       metrics=metrics, out=args.out))
    return 0


def merged(setup: dict[str, Any], trials: list[dict[str, Any]], peers: list[str], faults: list[str], *,
           why: str = "") -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """An earlier run's setup and trials with ``trials`` (of ``peers`` x ``faults``) in place of its own of the
    same system and fault; the rerun listed (when, at which commit, what, why: the trials it replaced)."""
    redo = {(p, f) for p in peers for f in faults}
    kept = [t for t in setup["trials"] if (t["peer"], t["fault"]) not in redo]
    rerun = {"when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "commit": _commit(),
             "peers": peers, "faults": faults, "trials": len(trials),
             "replaced": len(setup["trials"]) - len(kept), **({"why": why} if why else {})}
    return ({**setup, "tuning": TUNING, "reruns": [*setup.get("reruns", []), rerun]}, kept + trials)


def _commit() -> str:
    out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() or "?"


if __name__ == "__main__":
    sys.exit(main())

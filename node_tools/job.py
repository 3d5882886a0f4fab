"""This machine's part of a training job: start it, stop it, report it.

``tg-node job start`` launches torchrun (static rendezvous) under a small
supervisor that records torchrun's exit code, in a session of its own, and
returns as soon as the processes run. Everything it starts carries
``TG_JOB_TOKEN`` in its environment, so ``stop`` finds every process of the job
(torchrun puts its workers in sessions of their own) and ends them; ``stop`` on a
job that is not running does nothing. ``status`` reports the supervisor, the
exit code once it has ended, and each rank's heartbeat and last step.

Layout of a job on a machine (``<workdir>/jobs/<job>/``)::

    job.json          what was started (spec, token, pids, incarnation)
    exit.json         torchrun's exit code, written by the supervisor
    supervisor.log    torchrun's own output
    logs/inc<N>/...   each rank's stdout/stderr (torchrun --redirects 3)
    ranks/            heartbeats and step records of the in-job hook
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from trainguard.core import procs
from trainguard.core.errors import TrainguardError
from trainguard.node_tools import monitor
from trainguard.node_tools.config import NodeConfig

JOB_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def check_job_name(job: str) -> str:
    if not JOB_NAME_RE.match(job or ""):
        raise TrainguardError(f"job name {job!r} must be 1-64 letters, digits or -_. (starting with a letter or digit)")
    return job


@dataclass
class JobSpec:
    """How to start this machine's part of a job.

    Attributes:
        job: the job's name (the same on every machine).
        nnodes: machines in the job.
        node_rank: this machine's index among them (0 holds the rendezvous store).
        nproc_per_node: ranks on this machine.
        master_addr: address of the machine with node_rank 0.
        master_port: rendezvous port on it.
        entry: the training script, absolute or relative to the install directory.
        args: arguments for the training script.
        revision: the code revision the job runs (recorded, for rollback).
        checkpoint: where the job restores from and saves to (a path or URL), handed to it
            as ``TG_CHECKPOINT``; "" lets the job decide.
        warm: run on this machine's parked warm interpreters (``tg-node standby park``)
            instead of starting torchrun and its workers cold.
        warm_if_parked: run on the parked warm interpreters when enough are free, else cold (a
            restart need not ask every machine first which it has).
        launcher: ``torchrun`` (the default), or ``direct``: one process per machine (``nproc_per_node``
            1) started without torchrun, with torchrun's variables set (``RANK`` = the node rank,
            ``WORLD_SIZE`` = the machines): a job of plain processes, such as the fan-out benchmark's
            stand-in (``examples/standin.py``), which needs no torch.
        module: ``entry`` names a module, run as ``python -m`` (torchrun's ``--module``), not a script.
        workdir: the directory the job runs in, where a relative ``entry`` is found ("" = the install
            directory).
        env: environment variables for every rank (a launch's own variables win over them).
        restore_max_step: restore no checkpoint step newer than this (``TG_RESTORE_MAX_STEP``; None: the newest).
        hang_floor_s: the least time without progress that this machine's agent calls a hang of the job's ranks
            (recorded in ``job.json``, read by :class:`trainguard.node_tools.rankcheck.RankCheck`; None: the
            agent's own floor).
        replica: this machine's part belongs to data-parallel replica group ``replica`` of ``replicas`` (a job
            whose replicas train on when one is lost: :mod:`trainguard.replicas`); ``nnodes`` and ``node_rank``
            are then the group's. None: the job is one group.
        replicas: the job's replica groups (with ``replica``).
        lighthouse: the replica groups' lighthouse (``http://host:port``; ``TORCHFT_LIGHTHOUSE``).
        replica_host: the address other groups reach this machine's group at (``TG_REPLICA_HOST``).
        min_replicas: the fewest groups that may train a step (``TG_MIN_REPLICAS``).
    """

    job: str
    nnodes: int
    node_rank: int
    nproc_per_node: int
    master_addr: str
    master_port: int
    entry: str = ""
    args: list[str] = field(default_factory=list)
    revision: str = ""
    checkpoint: str = ""
    warm: bool = False
    warm_if_parked: bool = False
    launcher: str = "torchrun"
    module: bool = False
    workdir: str = ""
    env: dict[str, str] = field(default_factory=dict)
    restore_max_step: int | None = None
    hang_floor_s: float | None = None
    replica: int | None = None
    replicas: int = 0
    lighthouse: str = ""
    replica_host: str = ""
    min_replicas: int = 1

    def validate(self) -> None:
        check_job_name(self.job)
        if self.replica is not None:
            if not 0 <= self.replica < self.replicas:
                raise TrainguardError(f"job {self.job}: --replica {self.replica} is outside 0..{self.replicas - 1} "
                                      f"(--replicas {self.replicas})")
            if not re.fullmatch(r"https?://[A-Za-z0-9.:\[\]_-]+", self.lighthouse or ""):
                raise TrainguardError(f"job {self.job}: --lighthouse {self.lighthouse!r} must be http://host:port, "
                                      f"the replica groups' lighthouse")
            if not 1 <= self.min_replicas <= self.replicas:
                raise TrainguardError(f"job {self.job}: --min-replicas {self.min_replicas} must be 1..{self.replicas}")
        if not self.entry:
            raise TrainguardError(f"job {self.job}: no training script (--entry) to start")
        for key in self.env:
            check_env_name(key)
        if self.restore_max_step is not None and self.restore_max_step < 0:
            raise TrainguardError(f"job {self.job}: --restore-max-step {self.restore_max_step} must be >= 0")
        if self.hang_floor_s is not None and not HANG_FLOOR_RANGE[0] <= self.hang_floor_s <= HANG_FLOOR_RANGE[1]:
            raise TrainguardError(f"job {self.job}: --hang-floor-s {self.hang_floor_s:g} must be "
                                  f"{HANG_FLOOR_RANGE[0]:g}..{HANG_FLOOR_RANGE[1]:g} seconds")
        if self.module and not re.fullmatch(r"[A-Za-z_][\w.]*", self.entry):
            raise TrainguardError(f"job {self.job}: --module {self.entry!r} is not a module name (pkg.train)")
        if self.nnodes < 1 or self.nproc_per_node < 1:
            raise TrainguardError(f"job {self.job}: nnodes and nproc-per-node must be >= 1")
        if self.launcher not in LAUNCHERS:
            raise TrainguardError(f"job {self.job}: launcher {self.launcher!r} must be one of {', '.join(LAUNCHERS)}")
        if self.launcher == "direct" and (self.nproc_per_node != 1 or self.warm or self.warm_if_parked):
            raise TrainguardError(f"job {self.job}: the direct launcher starts one cold process per machine; "
                                  f"use --nproc-per-node 1 without --warm, or --launcher torchrun")
        if not 0 <= self.node_rank < self.nnodes:
            raise TrainguardError(f"job {self.job}: node-rank {self.node_rank} is outside 0..{self.nnodes - 1}")
        if not 0 < self.master_port < 65536:
            raise TrainguardError(f"job {self.job}: master-port {self.master_port} must be 1..65535")


LAUNCHERS = ("torchrun", "direct")
#: the hang floor a job may ask for (``--hang-floor-s``), seconds: not below the agent's check of a rank (0.25 s) by
#: much, not above an hour (past that, a rank without progress is not a job's own pause)
HANG_FLOOR_RANGE = (0.5, 3600.0)
ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
#: what a launch sets itself: a job's own environment may not set these
RESERVED_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
                "PYTHONPATH")


def check_env_name(name: str) -> str:
    if not ENV_NAME_RE.match(name):
        raise TrainguardError(f"environment variable name {name!r} must be letters, digits and _", exit_code=2)
    if name.startswith("TG_") or name in RESERVED_ENV:
        raise TrainguardError(f"environment variable {name} is set by the launch itself; leave it out", exit_code=2)
    return name


def parse_env(items: list[str]) -> dict[str, str]:
    """``["A=1", "B=x=y"]`` -> ``{"A": "1", "B": "x=y"}``; a malformed item is a one-line error."""
    out: dict[str, str] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep:
            raise TrainguardError(f"--env {item!r} must be NAME=VALUE", exit_code=2)
        out[check_env_name(name)] = value
    return out


def run_dir(cfg: NodeConfig, job: str) -> Path:
    return cfg.workdir / "jobs" / check_job_name(job)


def read_record(cfg: NodeConfig, job: str) -> dict[str, Any] | None:
    """The job's record on this machine (``job.json``: spec, token, pids, incarnation), or None."""
    return _read_json(run_dir(cfg, job) / "job.json")


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def job_pids(record: dict[str, Any] | None) -> list[int]:
    """Every live process of the job: those started with its token, and warm interpreters serving it."""
    if not record or not record.get("token"):
        return []
    pids = set(procs.pids_with_env("TG_JOB_TOKEN", record["token"]))
    if record.get("standby_dir"):
        from trainguard.node_tools.standby import claimed_pids

        pids.update(claimed_pids(Path(record["standby_dir"]), record["token"]))
    return sorted(pids)


def start(cfg: NodeConfig, spec: JobSpec) -> dict[str, Any]:
    spec.validate()
    rd = run_dir(cfg, spec.job)
    record = _read_json(rd / "job.json")
    if record and job_pids(record):
        return status(cfg, spec.job) | {"already_running": True}
    workdir = Path(spec.workdir) if spec.workdir else cfg.install_dir
    if not workdir.is_dir():
        raise TrainguardError(f"machine {cfg.machine}: job {spec.job}'s working directory {workdir} does not exist")
    if spec.module:
        entry: Path | str = spec.entry
        target = ["--module", spec.entry]  # torchrun's and the warm client's way of saying python -m
    else:
        entry = Path(spec.entry)
        if not entry.is_absolute():
            entry = workdir / entry
        if not entry.is_file():
            raise TrainguardError(f"machine {cfg.machine}: training script {entry} does not exist")
        target = [str(entry)]
    (rd / "ranks").mkdir(parents=True, exist_ok=True)
    for stale in (rd / "ranks").glob("rank*.json"):
        stale.unlink()
    (rd / "exit.json").unlink(missing_ok=True)
    incarnation = int(record.get("incarnation", -1)) + 1 if record else 0
    token = uuid.uuid4().hex
    log_dir = rd / "logs" / f"inc{incarnation}"
    torchrun = [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", str(spec.nnodes),
        "--nproc-per-node", str(spec.nproc_per_node),
        "--node-rank", str(spec.node_rank),
        "--master-addr", spec.master_addr,
        "--master-port", str(spec.master_port),
        "--max-restarts", "0",
        "--monitor-interval", "0.5",
        "--log-dir", str(log_dir),
        "--redirects", "3",
        *target, *spec.args,
    ]
    if spec.launcher == "direct":
        torchrun = [sys.executable, *(["-m", spec.entry] if spec.module else [str(entry)]), *spec.args]
    env = dict(os.environ)
    env.update(spec.env)  # the job's own variables; the launch's below win over them
    if spec.launcher == "direct":  # what torchrun would have set for this machine's one rank
        env.update({"RANK": str(spec.node_rank), "GROUP_RANK": str(spec.node_rank), "LOCAL_RANK": "0",
                    "WORLD_SIZE": str(spec.nnodes), "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": spec.master_addr,
                    "MASTER_PORT": str(spec.master_port)})
    env.update({
        "TG_JOB": spec.job,
        "TG_JOB_TOKEN": token,
        "TG_INCARNATION": str(incarnation),
        "TG_RUN_DIR": str(rd),
        "TG_MACHINE": cfg.machine,
        "TG_REVISION": spec.revision,
        "TG_CHECKPOINT": spec.checkpoint,
        "TG_RESTORE_MAX_STEP": "" if spec.restore_max_step is None else str(spec.restore_max_step),
        **({"TG_REPLICA": str(spec.replica), "TG_REPLICAS": str(spec.replicas),
            "TORCHFT_LIGHTHOUSE": spec.lighthouse, "TG_REPLICA_HOST": spec.replica_host or spec.master_addr,
            "TG_MIN_REPLICAS": str(spec.min_replicas)} if spec.replica is not None else {}),
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(cfg.install_dir), os.environ.get("PYTHONPATH", "")])),
    })
    if cfg.iface:
        env.setdefault("GLOO_SOCKET_IFNAME", cfg.iface)
        env.setdefault("NCCL_SOCKET_IFNAME", cfg.iface)
    if cfg.fault_file:
        env["TG_FAULT_FILE"] = str(cfg.fault_file)
    if cfg.job_nice:  # the supervisor and the warm interpreters that run the job apply it
        env[procs.NICE_ENV] = str(cfg.job_nice)
    standby = None
    if spec.warm or spec.warm_if_parked:
        from trainguard.node_tools import standby as sb

        free = len(sb.free_slots(cfg.workdir))
        warm = free >= spec.nproc_per_node + 1
        standby = sb.standby_dir(cfg.workdir) if warm else None
        if spec.warm and not warm:
            raise TrainguardError(
                f"machine {cfg.machine} has {free} warm interpreters, job {spec.job} needs "
                f"{spec.nproc_per_node + 1} (ranks + torchrun); run 'tg-node standby park --nproc "
                f"{spec.nproc_per_node}' first, or start it cold"
            )
    if standby is not None:
        client = [sys.executable, sb.client_entry(), "client", "--dir", str(standby)]
        # torchrun itself runs in a warm interpreter, and its workers are thin clients of the others
        at = torchrun.index(target[0])
        torchrun = [*client, "--module", "torch.distributed.run", "--", *torchrun[3:at],
                    sb.client_entry(), "client", "--dir", str(standby), *target, "--", *torchrun[at + len(target):]]
        env["TG_STANDBY_TOKEN"] = (sb.read_state(cfg.workdir) or {}).get("token", "")
    supervisor = [sys.executable, "-m", "trainguard.node_tools.job", str(rd), "--", *torchrun]
    with open(rd / "supervisor.log", "ab") as log:
        proc = subprocess.Popen(
            supervisor, cwd=str(workdir), env=env, stdin=subprocess.DEVNULL,
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
    record = {
        "job": spec.job,
        "token": token,
        "incarnation": incarnation,
        "supervisor_pid": proc.pid,
        "started_ts": time.time(),
        "machine": cfg.machine,
        "log_dir": str(log_dir),
        "standby_dir": str(standby) if standby else None,
        "spec": asdict(spec),
        "command": torchrun,
    }
    monitor.write_json_atomic(rd / "job.json", record)
    # until the supervisor has exec'd, its environment is still this process's (no token): the job's
    # processes are found by their token, so the state read right after would say "exited"
    deadline = time.monotonic() + 10.0
    while proc.poll() is None and procs.environ(proc.pid).get("TG_JOB_TOKEN") != token \
            and time.monotonic() < deadline:
        time.sleep(0.005)
    if proc.poll() is not None:
        raise TrainguardError(
            f"machine {cfg.machine}: job {spec.job} exited at once (code {proc.returncode}); "
            f"see {rd / 'supervisor.log'}"
        )
    return status(cfg, spec.job) | {"warm": standby is not None}


def stop(cfg: NodeConfig, job: str, *, grace_s: float = 10.0, mark_only: bool = False,
         wait_go: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Stop this machine's part of ``job``. With ``mark_only``, only record that a stop was requested:
    stopping a job across machines marks every machine first, so ranks that die because a peer already
    stopped are not reported as failures. ``wait_go``: called with the mark's document between the mark
    and the stop (both phases in one session: it returns once every machine is marked)."""
    rd = run_dir(cfg, job)
    record = _read_json(rd / "job.json")
    pids = job_pids(record)
    marked = True
    if record and pids and not record.get("stop_requested_ts"):
        # tell the agent first: ranks ended on purpose are not failures (best effort: a full disk must not
        # keep the job running)
        marked = _mark_stopped(rd, record)
    mark = {"job": job, "machine": cfg.machine, "stopped_pids": [], "state": _state(record),
            "marked_stopped": marked and bool(pids)}
    if mark_only:
        return mark
    if wait_go is not None:
        wait_go(mark)
        pids = job_pids(record)
    signalled = procs.terminate(pids, grace_s=grace_s) if pids else []
    # a start that ran beside this stop (a restart in flight) wrote a job.json of its own: its processes are ended
    # too, not left running unseen under a token this stop never read
    now = _read_json(rd / "job.json")
    if now and now.get("token") != (record or {}).get("token") and (late := job_pids(now)):
        _mark_stopped(rd, now)  # its ranks end on purpose too: not failures for the agent
        signalled += procs.terminate(late, grace_s=0.0)
    if record and record.get("standby_dir") and record.get("token"):
        from trainguard.node_tools.standby import drop_claims

        drop_claims(Path(record["standby_dir"]), record["token"])
    return {"job": job, "machine": cfg.machine, "stopped_pids": signalled, "state": _state(now or record),
            "marked_stopped": marked}


def _mark_stopped(rd: Path, record: dict[str, Any]) -> bool:
    """Record in the job's ``job.json`` that its stop was requested (the agent reads its ranks' ends as on purpose);
    False when the file could not be written."""
    try:
        monitor.write_json_atomic(rd / "job.json", record | {"stop_requested_ts": time.time()})
    except OSError:
        return False
    return True


def _state(record: dict[str, Any] | None) -> str:
    if not record:
        return "absent"
    if job_pids(record):
        return "running"
    return "exited"


#: the fail-slow vote's look at a rank: its steps of the last RECENT_S seconds (at least RECENT_MIN_STEPS of them,
#: at most RECENT_MAX_STEPS): a few 10 ms steps are one scheduling hiccup, a few seconds of them are the rank's pace
RECENT_S, RECENT_MIN_STEPS, RECENT_MAX_STEPS = 3.0, 5, 2000


def _recent_compute(steps: list[dict[str, Any]], incarnation: Any) -> dict[str, float | int] | None:
    """The rank's recent compute time (each step's :func:`~trainguard.node_tools.monitor.step_compute`: its local
    part, else the step less its wait in counted collectives) over its last steps of this incarnation
    (:data:`RECENT_S` seconds of them): ``recent_compute_s`` (their median), ``recent_compute_spread_s`` (1.4826 x
    their median absolute deviation: the step-to-step noise), ``recent_steps`` and ``recent_step_s`` (the median of
    the steps' own times); what the fail-slow vote compares. None without such a step."""
    values: list[float] = []
    walls: list[float] = []
    spent = 0.0
    for r in reversed(steps):
        if r.get("incarnation") != incarnation or len(values) >= RECENT_MAX_STEPS or (
                len(values) >= RECENT_MIN_STEPS and spent >= RECENT_S):
            break
        t, compute = r.get("step_time_s"), monitor.step_compute(r)
        if isinstance(t, (int, float)) and math.isfinite(compute):
            values.append(max(0.0, compute))
            walls.append(max(0.0, float(t)))
            spent += max(0.0, float(t))
    if not values:
        return None
    median = statistics.median(values)
    spread = 1.4826 * statistics.median(abs(v - median) for v in values)
    return {"recent_compute_s": round(median, 6), "recent_compute_spread_s": round(spread, 6),
            "recent_steps": len(values), "recent_step_s": round(statistics.median(walls), 6)}


def rank_status(rd: Path, rank: int, now: float, *, brief: bool = False) -> dict[str, Any]:
    """A rank as its heartbeat and the process table say; with its step history's last record and recent
    compute time unless ``brief`` (the history is not read)."""
    hb = monitor.read_heartbeat(rd, rank) or {}
    pid = hb.get("pid")
    state = procs.proc_state(pid, hb.get("pid_start")) if pid else None
    out = {
        "rank": rank,
        "pid": pid,
        "process_state": state or "gone",
        "status": hb.get("status"),
        "step": hb.get("step"),
        "alive_age_s": round(now - hb["alive_ts"], 3) if "alive_ts" in hb else None,
        "progress_age_s": round(now - hb["progress_ts"], 3) if "progress_ts" in hb else None,
    }
    if brief:
        return out
    # the file's tail only: a job of 7 ms steps writes 200,000 records in half an hour, and a stop, a vote's round
    # or the Fleet page asks for this
    steps = monitor.read_steps_since(rd, rank, -math.inf, limit=RECENT_MAX_STEPS + 1)
    return {**out, "collectives": hb.get("collectives", {}),
            "last_step": steps[-1] if steps else None,
            **((_recent_compute(steps, steps[-1].get("incarnation")) if steps else None)
               or {"recent_compute_s": None})}


def status(cfg: NodeConfig, job: str, *, brief: bool = False) -> dict[str, Any]:
    """The job's part on this machine: its state (running, exited, absent), incarnation, revision, exit code and
    every rank's status (:func:`rank_status`; ``brief``: from the heartbeats only)."""
    rd = run_dir(cfg, job)
    record = _read_json(rd / "job.json")
    now = time.time()
    ranks = sorted(int(p.stem[4:]) for p in (rd / "ranks").glob("rank*.json") if p.stem[4:].isdigit())
    exit_doc = _read_json(rd / "exit.json")
    return {
        "job": job,
        "machine": cfg.machine,
        "state": _state(record),
        "incarnation": record.get("incarnation") if record else None,
        "revision": (record.get("spec") or {}).get("revision") if record else None,
        "returncode": exit_doc.get("returncode") if exit_doc else None,
        "run_dir": str(rd),
        "ranks": [rank_status(rd, r, now, brief=brief) for r in ranks],
    }


def steps(cfg: NodeConfig, job: str, rank: int, *, since: int = -1, incarnation: int | None = None,
          since_ts: float | None = None) -> dict[str, Any]:
    """The step records of ``rank`` on this machine after step ``since`` (of one incarnation, if given;
    ended after ``since_ts``, if given). Either bound reads the history from its end: ``since`` (0 or more) gives
    the newest stretch of records after that step, back to the last record of step ``since`` or before (a
    restore that went back before it ends the stretch), ``since_ts`` the records ended after that time. With
    neither, the whole history."""
    rd = run_dir(cfg, job)
    if not (rd / "ranks" / f"rank{rank}.json").exists() and not monitor.steps_path(rd, rank).exists():
        raise TrainguardError(f"machine {cfg.machine} has no rank {rank} of job {job}")
    if since_ts is not None:
        read = monitor.read_steps_since(rd, rank, since_ts)
    elif since >= 0:
        read = monitor.read_steps_after(rd, rank, since)
    else:
        read = monitor.read_steps(rd, rank)
    records = [
        r for r in read
        if r.get("step", -1) > since and (incarnation is None or r.get("incarnation") == incarnation)
    ]
    return {"job": job, "machine": cfg.machine, "rank": rank, "steps": records}


def output(cfg: NodeConfig, job: str, *, rank: int | None = None, stream: str = "stdout",
           tail: int = 50) -> dict[str, Any]:
    """Where the newest incarnation of ``job`` on this machine writes, and its last lines: each rank's ``stream``
    file (torchrun's per-rank ``stdout.log``/``stderr.log`` under the job's run directory) with its global rank
    (from its heartbeat) and last ``tail`` lines, and the supervisor's log (torchrun's own lines); of one global
    ``rank`` when given. Every line is the rank's own output, as the job printed it."""
    rd = run_dir(cfg, job)
    record = _read_json(rd / "job.json")
    if not record:
        raise TrainguardError(f"machine {cfg.machine} has no job {job}")
    incarnation = record.get("incarnation")
    global_of: dict[int, int] = {}
    for path in (rd / "ranks").glob("rank*.json"):
        hb = monitor.read_heartbeat(rd, int(path.stem[4:])) if path.stem[4:].isdigit() else None
        if hb and hb.get("incarnation", incarnation) == incarnation and isinstance(hb.get("local_rank"), int):
            global_of[int(hb["local_rank"])] = int(hb.get("rank", path.stem[4:]))
    ranks = []
    for local_rank, files in sorted(rank_logs(cfg, job).items()):
        glob_rank = global_of.get(local_rank)
        if rank is not None and glob_rank != rank:
            continue
        path = files.get(stream)
        lines: list[str] = []
        if path is not None and tail > 0:
            with contextlib.suppress(OSError), open(path, "rb") as fh:
                fh.seek(0, os.SEEK_END)
                fh.seek(max(0, fh.tell() - 256 * 1024))
                lines = fh.read().decode(errors="replace").splitlines()[-tail:]
        ranks.append({"local_rank": local_rank, "rank": glob_rank, "path": str(path) if path else None,
                      "lines": lines})
    return {"job": job, "machine": cfg.machine, "incarnation": incarnation, "stream": stream,
            "supervisor_log": str(rd / "supervisor.log"), "ranks": ranks}


def rank_logs(cfg: NodeConfig, job: str) -> dict[int, dict[str, Path]]:
    """The newest incarnation's log files per local rank: {local_rank: {"stdout": p, "stderr": p}}."""
    record = _read_json(run_dir(cfg, job) / "job.json")
    if not record:
        return {}
    found: dict[int, dict[str, Path]] = {}
    for path in sorted(Path(record["log_dir"]).glob("*/attempt_*/*/std*.log")):
        if path.parent.name.isdigit():
            found.setdefault(int(path.parent.name), {})[path.stem] = path
    return found


# ---------------------------------------------------------------------------------------
# The supervisor: ``python -m trainguard.node_tools.job RUN_DIR -- COMMAND...``
# ---------------------------------------------------------------------------------------
def _supervise(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="trainguard.node_tools.job")
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    ns = parser.parse_args(argv)
    command = ns.command[1:] if ns.command[:1] == ["--"] else ns.command
    procs.nice_from_env()  # torchrun and its workers inherit it
    child = subprocess.Popen(command)

    def forward(signum: int, _frame: Any) -> None:
        child.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    returncode = child.wait()
    monitor.write_json_atomic(ns.run_dir / "exit.json", {"returncode": returncode, "ended_ts": time.time()})
    return 0


if __name__ == "__main__":
    sys.exit(_supervise(sys.argv[1:]))

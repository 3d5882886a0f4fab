"""Start, stop and watch a training job across machines from the host.

A job runs on an ordered list of machines; machine ``i`` gets ``node_rank = i``
and the first machine holds the rendezvous store. Start is all-or-nothing: if
any machine fails to start its part, the parts that did start are stopped and
the error names the machine and what it said.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from trainguard.core.errors import ClusterError
from trainguard.core.topology import Topology
from trainguard.node_tools.inventory import Inventory, Machine
from trainguard.node_tools.job import check_job_name
from trainguard.node_tools.transport import RunResult, Transport, transport_for


@dataclass(frozen=True)
class ReplicaGroups:
    """A job run as one replica group per data-parallel replica (:mod:`trainguard.replicas`): each group is a
    ``torchrun`` of its own across the replica's machines (its own rendezvous on its first machine), and the groups
    meet at ``lighthouse`` (``http://host:port``, a ``torchft_lighthouse`` outside the job's machines);
    ``min_replicas``: the fewest groups that may train a step."""

    lighthouse: str
    min_replicas: int = 1


@dataclass
class JobPlan:
    """What to launch.

    Attributes:
        job: the job's name.
        topology: its TP x PP x DP layout (ranks_per_machine = ranks started per machine).
        machines: the machines, in node-rank order.
        train_args: extra arguments for the training script (besides --tp/--pp/--dp).
        master_port: rendezvous port on the first machine.
        entry: the training script (relative to ``workdir``), or the module when ``module``; required.
        revision: code revision to record.
        checkpoint: checkpoint location handed to every machine's part of the job.
        warm: names of machines that start their part on parked warm interpreters
            (``tg-node standby activate``) instead of cold.
        warm_if_parked: the others start on their warm interpreters when they have them parked,
            else cold (``tg-node job start --warm-if-parked``; each answer's ``warm`` says which).
        launcher: "torchrun", or "direct" (one process a machine, no torchrun: see
            :class:`trainguard.node_tools.job.JobSpec`).
        module: ``entry`` is a module (``python -m``).
        workdir: the directory the job runs in on every machine ("" = the install directory).
        env: environment variables for every rank.
        pass_layout: append ``--tp/--pp/--dp`` to the arguments (for scripts that read them, as the reference
            job does).
        restore_max_step: restore no checkpoint step newer than this (``TG_RESTORE_MAX_STEP`` for the job's
            guard; None: the newest).
        replicas: run each data-parallel replica as a group of its own (None: the job is one ``torchrun``).
        hang_floor_s: the least time without progress the agents call a hang of the job's ranks (None: theirs).
    """

    job: str
    topology: Topology
    machines: list[Machine]
    train_args: list[str] = field(default_factory=list)
    master_port: int = 29500
    entry: str = ""
    revision: str = ""
    checkpoint: str = ""
    warm: set[str] = field(default_factory=set)
    warm_if_parked: bool = False
    launcher: str = "torchrun"
    module: bool = False
    workdir: str = ""
    env: dict[str, str] = field(default_factory=dict)
    pass_layout: bool = False
    restore_max_step: int | None = None
    replicas: ReplicaGroups | None = None
    hang_floor_s: float | None = None

    def validate(self) -> None:
        """Refuse a plan whose machines do not fit its topology or name a machine twice (linear in the
        machines)."""
        check_job_name(self.job)
        if not self.entry:
            raise ClusterError(f"job {self.job}: no training script (entry) to launch; the job's spec names one")
        if len(self.machines) != self.topology.machines:
            raise ClusterError(
                f"topology {self.topology} with {self.topology.ranks_per_machine} ranks per machine needs "
                f"{self.topology.machines} machines, but {len(self.machines)} were given "
                f"({_some([m.name for m in self.machines])})"
            )
        repeated = sorted(name for name, times in Counter(m.name for m in self.machines).items() if times > 1)
        if repeated:
            raise ClusterError(f"a machine appears twice in the job's machine list: {_some(repeated)}; "
                               f"list each machine once")
        if self.replicas is not None:
            t = self.topology
            if (t.tp * t.pp) % t.ranks_per_machine:
                raise ClusterError(f"job {self.job}: replica groups need every machine inside one data-parallel "
                                   f"replica, but {t.ranks_per_machine} ranks a machine do not divide a replica's "
                                   f"{t.tp * t.pp} (TP x PP) ranks; use fewer processes per machine")
            if not 1 <= self.replicas.min_replicas <= t.dp:
                raise ClusterError(f"job {self.job}: min_replicas {self.replicas.min_replicas} must be 1..{t.dp} "
                                   f"(the job's data-parallel replicas)")

    def replica_of(self, machine: Machine) -> tuple[int, list[Machine]]:
        """``machine``'s data-parallel replica and that replica's machines, in node-rank order (a replica holds
        ``tp * pp / ranks_per_machine`` consecutive machines)."""
        per = self.topology.tp * self.topology.pp // self.topology.ranks_per_machine
        replica = self.node_rank(machine) // per
        return replica, self.machines[replica * per: (replica + 1) * per]

    def node_rank(self, machine: Machine) -> int:
        """``machine``'s node rank: its position in ``machines`` (the first machine equal to it, as
        ``list.index`` finds it; ValueError when there is none). O(1) on average; follows any change to
        ``machines``."""
        index: tuple[list[Machine], dict[str, int]] | None = self.__dict__.get("_node_ranks")
        if index is None or index[0] is not self.machines:
            index = self._index_node_ranks()
        at = index[1].get(machine.name)
        if at is not None and at < len(self.machines) and self.machines[at] == machine:
            return at
        at = self.machines.index(machine)  # the list changed since it was indexed, or an unknown machine
        self._index_node_ranks()
        return at

    def _index_node_ranks(self) -> tuple[list[Machine], dict[str, int]]:
        positions: dict[str, int] = {}
        for at, m in enumerate(self.machines):
            positions.setdefault(m.name, at)
        index = (self.machines, positions)  # the list itself kept: its identity cannot be reused
        self.__dict__["_node_ranks"] = index
        return index

    def start_argv(self, inv: Inventory, machine: Machine) -> list[str]:
        """The command that starts ``machine``'s part of the job (O(1) in the machines, on average)."""
        t = self.topology
        command = (["standby", "activate"] if machine.name in self.warm
                   else ["job", "start", "--warm-if-parked"] if self.warm_if_parked else ["job", "start"])
        group, rank, group_args = self.machines, self.node_rank(machine), []
        if self.replicas is not None:  # the replica's own torchrun, rendezvous on its first machine
            replica, group = self.replica_of(machine)
            rank = group.index(machine)
            group_args = ["--replica", str(replica), "--replicas", str(t.dp), "--lighthouse", self.replicas.lighthouse,
                          "--replica-host", machine.address, "--min-replicas", str(self.replicas.min_replicas)]
        return [
            inv.tg_node, *command,
            "--job", self.job,
            "--nnodes", str(len(group)),
            "--node-rank", str(rank),
            "--nproc-per-node", str(t.ranks_per_machine),
            "--master-addr", group[0].address,
            "--master-port", str(self.master_port),
            *group_args,
            "--entry", self.entry,
            "--revision", self.revision,
            "--checkpoint", self.checkpoint,
            *(["--launcher", self.launcher] if self.launcher != "torchrun" else []),
            *(["--module"] if self.module else []),
            *(["--workdir", self.workdir] if self.workdir else []),
            *[f"--env={k}={v}" for k, v in sorted(self.env.items())],
            *(["--restore-max-step", str(self.restore_max_step)] if self.restore_max_step is not None else []),
            *(["--hang-floor-s", f"{self.hang_floor_s:g}"] if self.hang_floor_s is not None else []),
            "--",
            *(["--tp", str(t.tp), "--pp", str(t.pp), "--dp", str(t.dp)] if self.pass_layout else []),
            *self.train_args,
        ]


def _some(names: Sequence[str], shown: int = 20) -> str:
    """``names`` for an error line: the first ``shown`` of them, then how many more there are."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


class PartsFailed(ClusterError):
    """Some machines did not do their part: ``failed`` names each with what it said (``unreachable``: those
    whose ssh failed)."""

    def __init__(self, message: str, failed: dict[str, str], unreachable: set[str]) -> None:
        super().__init__(message)
        self.failed = failed
        self.unreachable = unreachable


def _check(results: dict[str, RunResult], what: str) -> dict[str, Any]:
    docs: dict[str, Any] = {}
    failed: dict[str, str] = {}
    for name, res in results.items():
        doc = res.json()
        if res.ok and isinstance(doc, dict):
            docs[name] = doc
        elif isinstance(doc, dict) and "error" in doc:
            failed[name] = f"{name}: {doc['error']}"
        else:
            failed[name] = res.describe()
    if failed:
        raise PartsFailed(f"{what} failed on {len(failed)} machine(s): " + "; ".join(failed.values()), failed,
                          {n for n, r in results.items() if not r.reachable})
    return docs


def launch(inv: Inventory, plan: JobPlan, *, timeout: float = 60.0, transport: Transport | None = None,
           only: Sequence[str] | None = None) -> dict[str, Any]:
    """Start the job on every machine of the plan; all or nothing. ``only``: start the parts of these machines of
    the plan alone (a replica group that rejoins while the others train on)."""
    plan.validate()
    transport = transport or transport_for(inv)
    machines = plan.machines if only is None else [m for m in plan.machines if m.name in set(only)]
    if only is not None and len(machines) != len(set(only)):
        missing = sorted(set(only) - {m.name for m in machines})
        raise ClusterError(f"job {plan.job}: {_some(missing)} not in its machine list; start only machines of it")
    results = transport.run_many(machines, lambda m: plan.start_argv(inv, m), timeout=timeout)
    try:
        return _check(results, f"starting job {plan.job}")
    except ClusterError:
        stop(inv, plan.job, machines, transport=transport)
        raise


def stop(inv: Inventory, job: str, machines: Sequence[Machine], *, grace_s: float = 10.0,
         transport: Transport | None = None) -> dict[str, Any]:
    """Stop the job on ``machines`` (see :func:`stop_sessions`); raises when a machine did not stop."""
    return _check(stop_sessions(inv, job, machines, grace_s=grace_s, transport=transport), f"stopping job {job}")


def stop_sessions(inv: Inventory, job: str, machines: Sequence[Machine], *, grace_s: float = 10.0,
                  transport: Transport | None = None, logs_since: float | None = None,
                  status: bool = False, copies: bool = False, limit_s: float = 30.0) -> dict[str, RunResult]:
    """Stop the job on ``machines`` in one round of sessions of two phases: mark the stop on all of them
    (so ranks that die because a peer stopped first are not reported as failures), then, once every
    machine is marked, stop each. ``logs_since``: each answer also holds the machine's log verdict
    after the stop (``tg-node logs --since``), a round of sessions less for stop-time diagnosis;
    ``status``: and its ``tg-node job status`` (the steps each rank finished); ``copies``: and the job's
    checkpoint copies it holds (``tg-node ckpt list``), what an eviction checks before it takes a machine.
    ``limit_s``: how long every machine has to be marked, and each session beyond the grace."""
    check_job_name(job)
    transport = transport or transport_for(inv)
    extra = ["--logs-since", str(logs_since)] if logs_since is not None else []
    extra += ["--status"] if status else []
    extra += ["--copies"] if copies else []
    stop = [inv.tg_node, "job", "stop", "--job", job, "--grace-s", str(grace_s)]
    if len(machines) > transport.max_two_phase:  # more sessions than one may hold open: a round per phase
        transport.run_many(machines, lambda m: [*stop, "--mark-only"], timeout=limit_s)
        return transport.run_many(machines, lambda m: [*stop, *extra], timeout=grace_s + limit_s)
    return transport.run_two_phase(machines, lambda m: [*stop, "--wait-go", *extra], timeout=grace_s + limit_s,
                                   ready_timeout=limit_s)


def status(inv: Inventory, job: str, machines: Sequence[Machine], *, timeout: float = 20.0,
           transport: Transport | None = None, brief: bool = False) -> dict[str, Any]:
    """Each machine's ``tg-node job status`` (``--brief`` with ``brief``); unreachable machines appear with an
    "error"."""
    check_job_name(job)
    transport = transport or transport_for(inv)
    extra = ["--brief"] if brief else []
    results = transport.run_many(machines, lambda m: [inv.tg_node, "job", "status", "--job", job, *extra],
                                 timeout=timeout)
    out: dict[str, Any] = {}
    for name, res in results.items():
        doc = res.json()
        out[name] = doc if res.ok and isinstance(doc, dict) else {"error": res.describe()}
    return out


def steps(inv: Inventory, job: str, machine: Machine, *, rank: int, since: int = -1,
          incarnation: int | None = None, since_ts: float | None = None, timeout: float = 20.0,
          transport: Transport | None = None) -> list[dict[str, Any]]:
    """A rank's step records (after step ``since``, of one incarnation if given, ended after ``since_ts`` if
    given: the machine then reads only the tail of the history), read on its machine."""
    check_job_name(job)
    transport = transport or transport_for(inv)
    argv = [inv.tg_node, "job", "steps", "--job", job, "--rank", str(rank), "--since", str(since)]
    if incarnation is not None:
        argv += ["--incarnation", str(incarnation)]
    if since_ts is not None:
        argv += ["--since-ts", repr(float(since_ts))]
    doc = _check({machine.name: transport.run(machine, argv, timeout=timeout)}, f"reading steps of job {job}")
    return doc[machine.name]["steps"]


def min_step(statuses: dict[str, Any]) -> int:
    """The lowest step that every reported rank has finished (-1 if any has none)."""
    steps = [r.get("step") for doc in statuses.values() for r in doc.get("ranks", [])]
    if not steps or any(s is None for s in steps):
        return -1
    return min(steps)

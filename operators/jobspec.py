"""A job's specification: what a team submits to put its own training job under guard.

Written in YAML or JSON and checked by :class:`JobSpec` (pydantic); every error is one line naming the field and
what to write instead. The spec is stored with the job in the fleet database and drives every launch the
control plane performs: the first, and each restart after a recovery, a code update or an operator's start::

    name: llm-7b
    command: [train.py, --config, configs/7b.yaml]   # a script and its arguments (or [-m, package.module, ...])
    workdir: /srv/llm                                 # where the script is, on every machine (default: install dir)
    machines: 4                                       # a count taken from the free pool, or a list of names
    processes_per_machine: 8                          # torchrun's --nproc-per-node
    standbys: 1                                       # warm standbys kept for this job
    checkpoint: s3://ckpt/llm-7b                      # handed to the job as TG_CHECKPOINT
    env: {NCCL_DEBUG: WARN}
    revision: v1.4.2
    hang_floor_s: 10                                  # its first evaluation pauses 8 s outside a step (default 3)

A job whose data-parallel replicas train on when one is lost (its script uses :class:`trainguard.replicas.Replicas`)
says so with ``replicas``: each replica then runs as a ``torchrun`` group of its own, the groups meet at a torchft
lighthouse the deployment runs outside the job's machines, and an incident confined to one replica takes that
replica out, swaps its machines and heals it from a live one while the others train (the degrade path,
:mod:`trainguard.operators.policy.degrade`)::

    replicas: {lighthouse: "http://10.0.0.2:29510", min_replicas: 1}

A data-parallel job needs no layout (``dp`` is every rank); a job with tensor or pipeline parallelism says
``layout: {tp: 8, pp: 4}`` so that eviction takes whole parallel groups out, and ``pass_layout: true`` when its
script reads ``--tp/--pp/--dp`` from its command line (the reference job does).

Plain Python: no Airflow import; the CLI, the launch DAG and the controller share it.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from trainguard.core.errors import TrainguardError
from trainguard.core.topology import Topology
from trainguard.node_tools.job import ENV_NAME_RE, HANG_FLOOR_RANGE, JOB_NAME_RE, RESERVED_ENV

REVISION_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]{0,127}\Z")
MAX_SPEC_BYTES = 64 * 1024


class JobSpecError(TrainguardError):
    """A job spec that cannot be used; the message names the field and what to write."""

    def __init__(self, message: str) -> None:
        super().__init__(message, exit_code=2)


class Layout(BaseModel):
    """Tensor and pipeline parallel degrees; data parallel fills the rest (``dp`` may be given to check it)."""

    model_config = ConfigDict(extra="forbid")
    tp: int = Field(1, ge=1, le=1024)
    pp: int = Field(1, ge=1, le=1024)
    dp: int | None = Field(None, ge=1)


class Replicas(BaseModel):
    """The job runs one replica group per data-parallel replica (see the module)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    lighthouse: str = Field(description="the torchft lighthouse the groups meet at, http://host:port")
    min_replicas: int = Field(1, ge=1, description="the fewest groups that may train a step")
    degrade: bool = Field(True, description="an incident confined to some replicas takes them out while the others "
                                            "train on; false: every incident stops the whole job")

    @field_validator("lighthouse")
    @classmethod
    def _lighthouse(cls, v: str) -> str:
        if not re.fullmatch(r"https?://[A-Za-z0-9.:\[\]_-]+", v):
            raise ValueError(f"{v!r} is not the lighthouse's URL; write http://host:port (torchft_lighthouse --bind)")
        return v


class JobSpec(BaseModel):
    """What to run, where, and how to keep it running.

    Attributes:
        name: the job's name: 1-64 letters, digits or ``-_.``, starting with a letter or digit.
        command: the training script and its arguments (``[train.py, --lr, "3e-4"]``), or a module run with
            ``-m`` (``[-m, mypkg.train, ...]``); a string is split as a shell would (no shell runs it).
        workdir: the directory the command runs in on every machine; a relative script is found there.
            "" = trainguard's install directory (where ``examples/`` lives).
        launcher: ``torchrun`` (``processes_per_machine`` ranks a machine) or ``direct`` (one process a
            machine, torchrun's variables set, no torchrun).
        machines: the machines, in node-rank order, or how many to take from the free pool at launch.
        processes_per_machine: ranks per machine (torchrun's ``--nproc-per-node``; one per GPU).
        layout: tensor/pipeline parallel degrees (None: data parallel only).
        pass_layout: append ``--tp N --pp N --dp N`` to the command (for scripts that read them).
        standbys: warm standbys the pool keeps for this job (machines checked and parked beforehand).
        checkpoint: where the job checkpoints: a local root (may hold ``{machine}``, ``{rank}``) or a remote
            tier (``s3://bucket/prefix``), handed to every rank as ``TG_CHECKPOINT``; "" = the job decides.
        env: environment variables for every rank (names torchrun sets and ``TG_*`` are refused).
        revision: the code revision the job runs (recorded; a code update or rollback changes it).
        replicas: run each data-parallel replica as a group of its own (:class:`Replicas`; None: one group).
        hang_floor_s: the least time without progress that the agents call a hang of the job's ranks, seconds
            (None: the agents' own, 3 s). The timeout is calibrated from the steps each rank showed (five times the
            longest recent one); the floor covers a pause the steps never showed, such as a first evaluation or
            save outside a step: raise it when the job's first one takes longer.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    command: list[str] = Field(min_length=1)
    workdir: str = ""
    launcher: Literal["torchrun", "direct"] = "torchrun"
    machines: list[str] | int
    processes_per_machine: int = Field(1, ge=1, le=512)
    layout: Layout | None = None
    pass_layout: bool = False
    standbys: int = Field(0, ge=0, le=1000)
    checkpoint: str = ""
    env: dict[str, str] = Field(default_factory=dict)
    revision: str = "r0"
    replicas: Replicas | None = None
    hang_floor_s: float | None = Field(None, ge=HANG_FLOOR_RANGE[0], le=HANG_FLOOR_RANGE[1])

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not JOB_NAME_RE.match(v):
            raise ValueError("must be 1-64 letters, digits or -_. starting with a letter or digit")
        return v

    @field_validator("command", mode="before")
    @classmethod
    def _command(cls, v: Any) -> Any:
        if isinstance(v, str):
            try:
                return shlex.split(v)
            except ValueError as exc:
                raise ValueError(f"cannot be split into words ({exc}); write it as a list") from None
        return v

    @field_validator("command")
    @classmethod
    def _command_words(cls, v: list[str]) -> list[str]:
        if not v[0]:
            raise ValueError("starts with an empty word; name the script first")
        if v[0] in ("-m", "--module") and (len(v) < 2 or not re.fullmatch(r"[A-Za-z_][\w.]*", v[1])):
            raise ValueError("-m must be followed by a module name such as mypkg.train")
        if v[0].startswith("-") and v[0] not in ("-m", "--module"):
            raise ValueError(f"starts with the option {v[0]!r}; name the script (or -m module) first")
        if any("\x00" in w for w in v):
            raise ValueError("holds a NUL character")
        return v

    @field_validator("machines")
    @classmethod
    def _machines(cls, v: list[str] | int) -> list[str] | int:
        if isinstance(v, int):
            if not 1 <= v <= 100_000:
                raise ValueError("a count must be 1..100000")
            return v
        if not v:
            raise ValueError("lists no machine; name them, or give a count to take from the free pool")
        repeated = sorted({n for n in v if v.count(n) > 1})
        if repeated:
            raise ValueError(f"names {', '.join(repeated)} twice; list each machine once")
        return v

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        for key in v:
            if not ENV_NAME_RE.match(key):
                raise ValueError(f"{key!r} is not a variable name (letters, digits, _)")
            if key.startswith("TG_") or key in RESERVED_ENV:
                raise ValueError(f"{key} is set by the launch itself; remove it")
        return v

    @field_validator("revision")
    @classmethod
    def _revision(cls, v: str) -> str:
        if not REVISION_RE.match(v):
            raise ValueError("must be 1-128 letters, digits or ._+- (a tag or commit id)")
        return v

    @model_validator(mode="after")
    def _fits(self) -> JobSpec:
        if self.launcher == "direct" and self.processes_per_machine != 1:
            raise ValueError("launcher direct starts one process a machine: set processes_per_machine: 1 "
                             "or launcher: torchrun")
        topo = self.topology(self.machine_count)  # the layout fits the ranks
        if self.replicas is not None:
            if self.launcher != "torchrun":
                raise ValueError("replicas: each replica group is a torchrun of its own; set launcher: torchrun")
            if (topo.tp * topo.pp) % topo.ranks_per_machine:
                raise ValueError(f"replicas: every machine must hold ranks of one replica only, but "
                                 f"{topo.ranks_per_machine} processes a machine do not divide a replica's "
                                 f"{topo.tp * topo.pp} (tp x pp) ranks")
            if isinstance(self.machines, list) and self.replicas.min_replicas > topo.dp:
                raise ValueError(f"replicas: min_replicas {self.replicas.min_replicas} is more than the job's "
                                 f"{topo.dp} data-parallel replicas")
        return self

    # ---- derived -------------------------------------------------------------------
    @property
    def machine_count(self) -> int:
        return self.machines if isinstance(self.machines, int) else len(self.machines)

    @property
    def module(self) -> str:
        """The module a ``-m`` command runs, or ""."""
        return self.command[1] if self.command[0] in ("-m", "--module") else ""

    @property
    def entry(self) -> str:
        """The script (or the module, when :attr:`module`)."""
        return self.module or self.command[0]

    @property
    def args(self) -> list[str]:
        """The command's arguments after the script or module."""
        return list(self.command[2:] if self.module else self.command[1:])

    def topology(self, machines: int | None = None) -> Topology:
        """The job's layout on ``machines`` machines (default: its own count)."""
        machines = self.machine_count if machines is None else machines
        ranks = machines * self.processes_per_machine
        tp = self.layout.tp if self.layout else 1
        pp = self.layout.pp if self.layout else 1
        if ranks % (tp * pp):
            raise ValueError(f"layout tp={tp} x pp={pp} does not divide the {ranks} ranks "
                             f"({machines} machines x {self.processes_per_machine} processes)")
        dp = ranks // (tp * pp)
        if self.layout and self.layout.dp is not None and self.layout.dp != dp:
            raise ValueError(f"layout dp={self.layout.dp} but {ranks} ranks / (tp={tp} x pp={pp}) = {dp}; "
                             f"leave dp out, or change the machines")
        return Topology(tp, pp, dp, ranks_per_machine=self.processes_per_machine)

    def launch_args(self) -> list[str]:
        """The arguments the script is started with: the command's, and the layout when asked."""
        t = self.topology()
        return [*self.args, *(["--tp", str(t.tp), "--pp", str(t.pp), "--dp", str(t.dp)] if self.pass_layout else [])]

    def document(self) -> dict[str, Any]:
        """The spec as stored (JSON); ``replicas`` only when the job has them (a spec stored before the field
        existed reads the same)."""
        return self.model_dump(mode="json", exclude={"replicas"} if self.replicas is None else None)

    @property
    def is_reference(self) -> bool:
        """The reference job, which takes its checkpoint settings as flags on its command line."""
        return self.pass_layout and self.entry == REFERENCE_ENTRY

    def keeps_checkpoints(self, args: list[str]) -> bool:
        """Whether the job checkpoints when run with ``args``: the reference job with ``--checkpoint``; a job on
        the public face (:class:`trainguard.torch.Guard`) always does under a launch."""
        return "--checkpoint" in args if self.is_reference else True

    def remote_url(self, args: list[str]) -> str:
        """The job's remote checkpoint tier, or "": the reference job's ``--checkpoint-remote`` or
        ``--checkpoint-s3`` flag in ``args``, else the spec's ``checkpoint`` when it is an ``s3://`` or
        ``file://`` URL."""
        if self.is_reference:
            for i, a in enumerate(args):
                for flag in ("--checkpoint-remote", "--checkpoint-s3"):
                    if a == flag and i + 1 < len(args):
                        return args[i + 1]
                    if a.startswith(flag + "="):
                        return a.split("=", 1)[1]
            return ""
        return self.checkpoint if self.checkpoint.startswith(("s3://", "file://")) else ""

    def plan(self, *, job: str, topology: Topology, machines: list[Any], train_args: list[str], revision: str,
             **plan_fields: Any) -> Any:
        """The :class:`trainguard.node_tools.launcher.JobPlan` that runs this spec's command on ``machines``
        (``train_args``: the arguments recorded with the job, which a launch may extend)."""
        from trainguard.node_tools.launcher import JobPlan, ReplicaGroups

        groups = (ReplicaGroups(self.replicas.lighthouse, min(self.replicas.min_replicas, topology.dp))
                  if self.replicas is not None else None)
        return JobPlan(job=job, topology=topology, machines=machines, train_args=list(train_args),
                       entry=self.entry, module=bool(self.module), workdir=self.workdir, env=dict(self.env),
                       launcher=self.launcher, pass_layout=self.pass_layout, checkpoint=self.checkpoint,
                       revision=revision, replicas=groups, hang_floor_s=self.hang_floor_s, **plan_fields)


def _one_line(exc: ValidationError, source: str) -> str:
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err["loc"])
    msg = str(err["msg"]).removeprefix("Value error, ")
    more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    if not where:  # a check across fields: its message names them
        return f"{source}: {msg}{more}"
    if err["type"] == "missing":
        return f"{source}: {where} is missing; add it{more}"
    if err["type"] == "extra_forbidden":
        return f"{source}: {where} is not a field of a job spec; remove it (fields: {', '.join(JobSpec.model_fields)})"
    return f"{source}: {where}: {msg}{more}"


def stored_spec(job: Any) -> JobSpec:
    """The spec a fleet database's job row stores (every row has one from migration 5 on)."""
    return parse_spec(job.spec, source=f"job {job.name}'s stored spec")


def replica_groups(job: Any, *, degrading: bool = False) -> Replicas | None:
    """The ``replicas`` of a fleet database's job row: None when the job runs as one group (or, with ``degrading``,
    when its spec turned the degrade path off)."""
    groups = stored_spec(job).replicas if job.spec else None
    return None if groups is None or (degrading and not groups.degrade) else groups


def parse_spec(document: Any, *, source: str = "job spec") -> JobSpec:
    """A :class:`JobSpec` from a parsed document, or :class:`JobSpecError` in one line."""
    if not isinstance(document, dict):
        raise JobSpecError(f"{source}: must be a mapping of fields (name, command, machines, ...), "
                           f"not {type(document).__name__}")
    try:
        return JobSpec.model_validate(document)
    except ValidationError as exc:
        raise JobSpecError(_one_line(exc, source)) from None


def load_spec(path: Path) -> JobSpec:
    """Read a YAML or JSON job spec file (a JSON document is YAML too)."""
    import yaml

    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise JobSpecError(f"job spec {path}: cannot be read ({exc.strerror}); give the path of a YAML or JSON "
                           f"file") from None
    if len(raw) > MAX_SPEC_BYTES:
        raise JobSpecError(f"job spec {path}: {len(raw)} bytes, more than {MAX_SPEC_BYTES}; a spec is a few lines")
    try:
        document = json.loads(raw) if path.suffix == ".json" else yaml.safe_load(raw)
    except (ValueError, yaml.YAMLError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise JobSpecError(f"job spec {path}: not valid {'JSON' if path.suffix == '.json' else 'YAML'} "
                           f"({first})") from None
    return parse_spec(document, source=f"job spec {path}")


#: the reference job (``examples/gpt3d``): a 3D-parallel GPT that reads ``--tp/--pp/--dp`` from its command line
REFERENCE_ENTRY = "examples/gpt3d/train.py"


def reference_spec(name: str, topology: Topology, *, train_args: list[str] | tuple[str, ...] = (),
                   revision: str = "") -> JobSpec:
    """The spec of the reference job on ``machines`` with ``topology`` (what the emulation's ``job launch``, the
    demo and the benchmarks run; a job recorded before specs existed ran it too)."""
    # the count its layout fills (the row's machine list is where it runs; it may be short while a swap is due)
    return JobSpec(name=name, command=[REFERENCE_ENTRY, *train_args], machines=topology.machines,
                   processes_per_machine=topology.ranks_per_machine,
                   layout=Layout(tp=topology.tp, pp=topology.pp, dp=topology.dp), pass_layout=True,
                   revision=revision or "r0")

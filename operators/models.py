"""What the tasks of ``tg_incident`` hand each other through XCom, as typed models: a task writes
``model.dump()`` (plain JSON) and the next one reads it back with ``Model.read(value)``, which validates
it: a payload that lost a field or holds a wrong type fails the reading task with the field's name,
instead of a ``KeyError`` three functions further on.

The rungs' own results keep their evidence (logs, diagnosis reports, votes ...) as extra fields: only what
the next tasks act on is typed.
"""

from __future__ import annotations

from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from trainguard.operators.policy.ladder import Action, Category


class _Payload(BaseModel):
    model_config = ConfigDict(extra="forbid")

    def dump(self) -> dict[str, Any]:
        """The JSON document for XCom (enums as their values)."""
        return self.model_dump(mode="json")

    @classmethod
    def read(cls, value: Any) -> Self:
        """``value`` (an XCom document) validated; a model passes through."""
        return value if isinstance(value, cls) else cls.model_validate(value or {})


class IncidentDecision(_Payload):
    """Triage's verdict on an incident: its category and the ladder's next action (the branch to take)."""

    incident: int = Field(ge=1)
    job: str
    level: int = Field(ge=0)
    category: Category
    machines: list[str] = []
    action: Action
    reason: str
    rollback_to: str | None = None
    diagnose: dict[str, Any] = {}


class Logs(_Payload):
    """What the job's logs said as a rung stopped it: the verdict across its machines (``user_code``,
    ``infrastructure``, ``unknown``, ``none``), each machine's, and the machine whose rank failed first of its own
    accord (``culprit``), when they tell."""

    model_config = ConfigDict(extra="allow")

    verdict: str
    machines: dict[str, Any] = {}
    culprit: str | None = None
    # the job's other incidents that implicated the culprit and left it in the job (None: none was implicated)
    implicated: list[int] | None = None


class DiagnosisReport(_Payload):
    """A stop-time diagnosis (:meth:`trainguard.operators.control.diagnosis.Diagnosis.diagnose`): the machines
    tested, those that failed (machine -> why) and every level's report."""

    model_config = ConfigDict(extra="allow")

    job: str
    machines: list[str]
    failed: dict[str, str] = {}
    report: dict[str, Any] = {}
    seconds: float = 0.0


class Evidence(_Payload):
    """What a rung gathered before it decided, carried in its result for the audit trail: the logs as it stopped
    the job, the stop-time diagnosis, a hang's stacks, the slow vote's rounds, a silent agent's probe, the
    replay's verdict; the machine evicted as a repeat offender; the newest step the restart may restore (the steps
    after it hold corrupted parameters)."""

    logs: Logs | None = None
    diagnosis: DiagnosisReport | None = None
    analysis: dict[str, Any] | None = None
    vote: dict[str, Any] | None = None
    probe: dict[str, Any] | None = None
    replay: dict[str, Any] | None = None
    repeat_offender: str | None = None
    restore_max_step: int | None = Field(default=None, ge=0)


class StopFound(_Payload):
    """What a stop found when it ended the job on every machine: the machines, the lowest step every rank
    had finished (a restart right after needs no round of reads) and the checkpoint copies each machine
    held once nothing wrote them (``[tier, step, rank]`` each; None: it did not say), which an eviction
    checks before it takes a machine away."""

    machines: list[str]
    step: int
    copies: dict[str, list[tuple[str, int, int]] | None] | None = None


class Eviction(_Payload):
    """What a rung decided to evict: the machines, why, and the newest step the restart may restore (the
    steps after it hold corrupted parameters)."""

    machines: list[str] = Field(min_length=1)
    reason: str
    max_step: int | None = Field(default=None, ge=0)
    # the machines with direct evidence (a hang's outlier ranks) among an over-evicted group: when the pool
    # holds fewer standbys than the group, these are swapped first and the job restarts (the rest stay,
    # recorded as deferred) instead of waiting for a human; empty: the whole group or nothing
    priority: list[str] = []


class RungResult(_Payload):
    """What a rung found and decided. ``restart`` says whether the job is to be stopped and started again
    (False: the rung left it alone, it waits for a human, or it was a dry run); ``evict``: the machines
    ``swap_machines`` replaces first; ``stopped``: what the rung's own stop found, when its evidence needed
    the job stopped (else ``stop_job`` stops it)."""

    model_config = ConfigDict(extra="allow")

    rung: str
    restart: bool
    evict: Eviction | None = None
    stopped: StopFound | None = None
    restore_max_step: int | None = Field(default=None, ge=0)
    swaps: dict[str, str] = {}
    error: str | None = None
    waiting_human: bool = False
    dry_run: bool = False
    resolved: str | None = None
    # a group the rung would evict but could not (breaker, pool short) while the job trains on: why
    not_evicted: str | None = None
    # the rung restarted the job itself (the restart at once): what the restart said (``restart_job`` adopts it)
    relaunched: dict[str, Any] | None = None
    rung_launched_ts: float | None = None  # when the rung's own launches ended (they are not restart_job's)


class Stop(_Payload):
    """What ``stop_job`` did: ``found`` is what the stop found when it ended the job on every machine (None:
    some machine did not say); ``said``: each machine's answer; ``skipped``: the job is left running (the
    rung restarts nothing); ``by_rung``: the rung had stopped it already for its evidence."""

    stopped: bool
    found: StopFound | None = None
    said: dict[str, str] = {}
    skipped: bool = False
    by_rung: bool = False


class Swap(_Payload):
    """What ``swap_machines`` did: the standbys that took the evicted machines' places (old -> new), the
    explicit machine faults that joined the incident and were evicted too (``joined``), or why nothing
    could be swapped (``waiting_human`` with the reason: the breaker, too few standbys, the last copy of a
    checkpoint)."""

    model_config = ConfigDict(extra="allow")

    swaps: dict[str, str] = {}
    joined: dict[str, str] = {}  # machine -> the explicit fault kinds that joined
    waiting_human: bool = False
    dry_run: bool = False
    reason: str = ""
    skipped: bool = False


class Restart(_Payload):
    """What ``restart_job`` did: the restart's time and the steps finished before it (for the resume
    check and the lost-steps count), or why it did not restart (then the rung's result says the rest)."""

    model_config = ConfigDict(extra="allow")

    restarted: bool
    job: str | None = None
    restart_ts: float | None = None
    steps_before: int = -1
    again: bool = False  # a restart of an incident whose job had been restarted before (the task was cleared)
    # the run's own limit on the resume wait (its ``resume_timeout_s`` Param); None: the setting's
    resume_timeout_s: float | None = Field(None, gt=0)


class Resume(_Payload):
    """The resume check's answer: training passed the restored step (``first_step``), or why not."""

    first_step: int | None = None
    restored_step: int | None = None
    ts: float | None = None
    failed: str | None = None
    pending: dict[str, str] | None = None  # explicit machine faults that joined after the restart
    skipped: bool = False  # nothing was restarted
    healed_from_step: int | None = None  # a replica group that rejoined: the step it received a live replica's state at
    participants: int | None = None  # ... and the replica groups that trained its first step

    def dump(self) -> dict[str, Any]:
        """Only what it says (``{"pending": {...}}``, ``{"failed": why}``, the resume's step and time)."""
        return self.model_dump(mode="json", exclude_defaults=True)

    @property
    def resumed(self) -> bool:
        return self.first_step is not None and not (self.failed or self.pending or self.skipped)


class EscalationWatch(_Payload):
    """An escalation's restart whose resume is awaited: the restart (a :class:`Restart`), its number among the
    incident's escalation restarts, what was changed before each, why the recovery did not hold, and the run's own
    limit on each resume wait (None: the setting's)."""

    recovery: dict[str, Any]
    attempt: int = Field(ge=1)
    tried: list[str] = []
    why: str = ""
    resume_timeout_s: float | None = Field(None, gt=0)


class Escalation(_Payload):
    """Where the close of an incident stands, one of two states:

    * ``done``: the incident closed (resolved or failed), waits for a human, or was handed to another run;
      ``timeline`` says how it stands;
    * ``watching``: the close restarted the job again (its recovery did not hold) and waits for that restart's resume
      (``watch``); the resume check's answer moves it on (:func:`trainguard.operators.tasks.incident.escalation_after`):
      to ``done`` (resumed: resolved; out of restarts: a human) or ``watching`` the next restart."""

    state: Literal["done", "watching"]
    timeline: dict[str, Any] | None = None
    watch: EscalationWatch | None = None

    @model_validator(mode="after")
    def _one_of(self) -> Self:
        if (self.state == "done") != (self.timeline is not None) or (self.state == "watching") != (self.watch
                                                                                                 is not None):
            raise ValueError(f"an escalation {self.state} holds {'its timeline' if self.state == 'done' else 'a watch'}"
                             f" and nothing else")
        return self

    @classmethod
    def done(cls, timeline: dict[str, Any]) -> Escalation:
        return cls(state="done", timeline=dict(timeline))

    @classmethod
    def watching(cls, watch: EscalationWatch) -> Escalation:
        return cls(state="watching", watch=watch)

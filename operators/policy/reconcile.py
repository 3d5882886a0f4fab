"""The reconciler's judgement, as plain functions: what should be against what is, level-triggered.

Alerts open incidents on edges: a rank exits, a GPU falls off the bus, an agent goes quiet. An edge can be
lost: an alert absorbed by an incident about something else that closed, a run that failed while the fleet
database restarted, an alert that never left a machine. The reconciler looks again on its own period (in the
spirit of a Kubernetes controller's resync), from observation, and finds each difference that no incident
handles:

* ``job_down``: a job the fleet database calls running whose job process does not run on some of its
  machines, seen so on two looks at least ``confirm_s`` apart with nothing started in between (a restart,
  a code update or a launch in flight is not a job down);
* ``job_stalled``: every machine runs the job, but its lowest finished step has not moved for ``stall_s``
  (by the reconciler's clock) while no rank holds still on purpose (a rank that found a NaN holds);
* ``job_held``: a rank holds still on purpose (the NaN guard waits for the control plane to restart the job
  from its last finite step) on two looks at least ``confirm_s`` apart, and no incident handles it: the
  wait would last for ever (the NaN's alert joined an incident that closed, or never left the machine);
* ``unhandled_fault``: a machine still serving the job with an explicit machine fault (a lost GPU, a fatal
  Xid ...) recorded after it joined the job, in an incident that closed without evicting it;
* ``agent_silent``: an agent the guardian finds silent on a machine of the job;
* ``stuck_incident``: an incident ``open`` with no live tg_incident run (its run failed, or was never
  started) for longer than ``grace_s``.

A job with an incident being handled (open) is left to it; one whose incident waits for a human is looked at,
and its next failure opens an incident of its own, once after each wait (:func:`waiting_blocks`). Each
finding becomes an incident through the same ladder (an alert of the kind above, ``source: reconciler``), or
for a stuck incident a new run of it; after :data:`MAX_REDRIVES` runs that failed, it waits for a human.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

#: the kinds of finding, and the alert kind each opens its incident with
FINDING_KINDS = ("job_down", "job_stalled", "job_held", "unhandled_fault", "agent_silent", "stuck_incident")
#: runs started again for one stuck incident before it waits for a human
MAX_REDRIVES = 3


@dataclass(frozen=True)
class Look:
    """One look at one job's machines (``tg-node job status --brief`` on each).

    Attributes:
        ts: when it was taken, by the reconciler's clock.
        states: machine -> ``running``, ``exited``, ``absent``, or why it could not be read.
        incarnations: machine -> the incarnation of its part (changes with every start).
        step: the lowest step every rank finished (-1: some rank has none yet).
        held: ranks holding still on purpose (the NaN guard waiting for the control plane).
    """

    ts: float
    states: Mapping[str, str]
    incarnations: Mapping[str, Any] = field(default_factory=dict)
    step: int = -1
    held: tuple[int, ...] = ()
    progress_age: float | None = None  # the longest time since a rank's last progress (a step or a collective)

    @staticmethod
    def of(statuses: Mapping[str, Mapping[str, Any]], ts: float) -> Look:
        """A look from each machine's status document (an ``error`` for a machine that did not answer)."""
        states, incarnations, steps, held, ages = {}, {}, [], [], []
        for name, doc in statuses.items():
            state = str(doc.get("state") or f"unreadable: {str(doc.get('error', ''))[:120]}")
            if state == "exited" and doc.get("returncode") == 0:
                state = "finished"  # the job's part ended as it should: not a failure
            states[name] = state
            incarnations[name] = doc.get("incarnation")
            for r in doc.get("ranks") or ():
                steps.append(r.get("step"))
                if r.get("status") == "held":
                    held.append(r.get("rank") if isinstance(r.get("rank"), int) else -1)
                if isinstance(r.get("progress_age_s"), (int, float)):
                    ages.append(float(r["progress_age_s"]))
        step = -1 if not steps or any(not isinstance(s, int) for s in steps) else min(steps)
        return Look(ts=ts, states=states, incarnations=incarnations, step=step, held=tuple(sorted(held)),
                    progress_age=max(ages) if ages else None)

    def down(self) -> list[str]:
        """Machines whose part of the job does not run (exited or absent; unreadable ones are not counted:
        a machine that cannot be reached is the agent watch's and the probe's to judge)."""
        return sorted(m for m, st in self.states.items() if st in ("exited", "absent"))


@dataclass
class JobMemory:
    """What the reconciler remembers of a job between its looks: the last look, when the lowest step last
    moved, and a difference seen once and waiting for its confirmation."""

    last: Look | None = None
    step_moved_ts: float | None = None
    down_since: Look | None = None
    held_since: float | None = None


@dataclass(frozen=True)
class Finding:
    """A difference between what should be and what is that no incident handles."""

    job: str
    kind: str
    machines: tuple[str, ...] = ()
    reason: str = ""
    incident: int | None = None
    evidence: Mapping[str, Any] = field(default_factory=dict)

    def dump(self) -> dict[str, Any]:
        return {"job": self.job, "kind": self.kind, "machines": list(self.machines), "reason": self.reason,
                "incident": self.incident, "evidence": dict(self.evidence)}

    @staticmethod
    def read(doc: Mapping[str, Any]) -> Finding:
        return Finding(job=str(doc["job"]), kind=str(doc["kind"]), machines=tuple(doc.get("machines") or ()),
                       reason=str(doc.get("reason") or ""), incident=doc.get("incident"),
                       evidence=dict(doc.get("evidence") or {}))


def judge_look(job: str, look: Look, memory: JobMemory, *, confirm_s: float, stall_s: float) -> list[Finding]:
    """Whether one look at a job the fleet database calls running (and no incident handles) shows it down
    or stalled; updates ``memory``. A machine down is reported on the second look that finds the same machines
    down with the same incarnations at least ``confirm_s`` after the first; a stall once the lowest step has
    not moved for ``stall_s`` and no rank holds still."""
    out: list[Finding] = []
    last, memory.last = memory.last, look
    if last is None or look.step != last.step or memory.step_moved_ts is None:
        memory.step_moved_ts = look.ts
    down = look.down()
    if not down:
        memory.down_since = None
    else:
        first = memory.down_since
        same = first is not None and first.down() == down and all(
            first.incarnations.get(m) == look.incarnations.get(m) for m in look.states)
        if not same:
            memory.down_since = look
        elif look.ts - first.ts >= confirm_s:
            seen = ", ".join(f"{m} ({look.states[m]})" for m in down)
            out.append(Finding(job, "job_down", tuple(down),
                               reason=f"job {job} is running in the fleet database but its process does not run "
                                      f"on {seen} (seen {look.ts - first.ts:.0f}s apart) and no incident handles it",
                               evidence={"states": dict(look.states), "step": look.step}))
            memory.down_since = None  # reported: the next one needs two looks again
        return out
    if not look.held:
        memory.held_since = None
    elif memory.held_since is None:
        memory.held_since = look.ts
    elif look.ts - memory.held_since >= confirm_s:
        out.append(Finding(job, "job_held", tuple(sorted(look.states)),
                           reason=f"rank(s) {list(look.held)} of job {job} hold still at step {look.step} (the NaN "
                                  f"guard waits for a restart from the last finite step) for "
                                  f"{look.ts - memory.held_since:.0f}s and no incident handles it",
                           evidence={"step": look.step, "held": list(look.held),
                                     "incarnations": dict(look.incarnations)}))
        memory.held_since = None  # reported: the next one needs two looks again
        return out
    quiet = look.ts - memory.step_moved_ts
    # a long step (an evaluation, a checkpoint) still shows progress in the ranks' heartbeats: not a stall
    stuck = look.progress_age is None or look.progress_age >= stall_s
    if quiet >= stall_s and stuck and not look.held and look.step >= 0:
        out.append(Finding(job, "job_stalled", tuple(sorted(look.states)),
                           reason=f"job {job} runs on every machine but finished no step past {look.step} for "
                                  f"{quiet:.0f}s (no rank holds still) and no incident handles it",
                           evidence={"step": look.step, "quiet_s": round(quiet, 1)}))
        memory.step_moved_ts = look.ts
    return out


def stuck_incidents(incidents: Sequence[Mapping[str, Any]], live_runs: Collection[str], now: float, *,
                    grace_s: float) -> list[Finding]:
    """Open incidents (``{"id", "job", "opened_ts", "redrives", "runs"}``) without a live tg_incident run for longer
    than ``grace_s``. ``live_runs``: the run ids of the runs queued or running (the runs started for an incident are
    named ``incident__<id>`` and ``incident__<id>__<more>``; a run started by hand for one says ``conf:<id>``); an
    incident's ``runs``: the runs that took it as theirs (a run Airflow started for the batch that opened it)."""
    running = set(live_runs)
    live = {r.split("__")[1] for r in running if r.startswith("incident__") and len(r.split("__")) >= 2}
    live |= {r.removeprefix("conf:") for r in running if r.startswith("conf:")}  # a run started by hand
    out = []
    for inc in incidents:
        if str(inc["id"]) in live or set(inc.get("runs") or ()) & running or now - float(inc["opened_ts"]) < grace_s:
            continue
        out.append(Finding(str(inc["job"]), "stuck_incident", incident=int(inc["id"]),
                           reason=f"incident {inc['id']} of job {inc['job']} is open and no run of it is live "
                                  f"(its run failed or never started)",
                           evidence={"redrives": int(inc.get("redrives", 0))}))
    return out


def waiting_blocks(incidents: Sequence[tuple[int, str]]) -> bool:
    """Whether the job's incidents (``(id, state)`` each) keep the reconciler off it: an incident waits for a human
    and the job already had its one incident after it (opened later, now closed: it acted on the job's next failure
    and did not hold). A job whose incident waits is otherwise looked at as any running job, so that a dead job
    behind a waiting incident is raised: once, not in a loop of restarts while nobody comes."""
    waiting = [i for i, state in incidents if state == "waiting_human"]
    return bool(waiting) and any(i > max(waiting) for i, _state in incidents)


def unhandled_faults(job: str, faults: Sequence[Mapping[str, Any]], joined: Mapping[str, float]) -> list[Finding]:
    """Explicit machine faults (``{"id", "machine", "kind", "ts", "incident"}``, each of an incident that is
    closed) on machines still serving ``job``, recorded after the machine joined it (``joined``: machine -> when
    it last became active for the job): one finding per machine."""
    by_machine: dict[str, list[Mapping[str, Any]]] = {}
    for f in faults:
        since = joined.get(str(f["machine"]))
        if since is not None and float(f["ts"]) >= since:
            by_machine.setdefault(str(f["machine"]), []).append(f)
    out = []
    for machine, found in sorted(by_machine.items()):
        kinds = sorted({str(f["kind"]) for f in found})
        incidents = sorted({int(f["incident"]) for f in found if f.get("incident") is not None})
        out.append(Finding(job, "unhandled_fault", (machine,),
                           reason=f"machine {machine} serves job {job} with {', '.join(kinds)} unhandled (recorded "
                                  f"in incident {', '.join(map(str, incidents)) or '-'}, which closed without "
                                  f"evicting it)",
                           evidence={"alerts": [str(f["id"]) for f in found][:20], "kinds": kinds,
                                     "incidents": incidents}))
    return out


def silent_agents(job: str, serving: Collection[str], silent: Mapping[str, float], now: float) -> list[Finding]:
    """Machines serving ``job`` whose agent the guardian finds silent (``silent``: machine -> since when)."""
    quiet = sorted(m for m in serving if m in silent)
    if not quiet:
        return []
    return [Finding(job, "agent_silent", tuple(quiet),
                    reason=f"the agent of {', '.join(quiet)} (job {job}) is silent and no incident handles it",
                    evidence={"silent_s": {m: round(now - float(silent[m]), 1) for m in quiet}})]

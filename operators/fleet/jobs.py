"""The fleet database: jobs: their shapes and specs, submission onto free standbys, release, and their code
revisions.

One of :class:`~trainguard.operators.fleet.store.FleetStore`'s bases: its methods use the store's engine,
transactions and retries."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from trainguard.operators.fleet import states
from trainguard.operators.fleet.db import FREE, OPEN_INCIDENT_STATES, FleetError, JobReleased
from trainguard.operators.fleet.models import (
    Incident,
    Job,
    Machine,
    Revision,
)


class JobRecords:
    """Jobs, a part of :class:`~trainguard.operators.fleet.store.FleetStore`."""

    def upsert_job(self, name: str, *, tp: int, pp: int, dp: int, ranks_per_machine: int,
                   machines: Sequence[str], revision: str = "", train_args: Sequence[str] = (),
                   spec: Mapping[str, Any] | None = None) -> bool:
        """Record a job running on ``machines`` (node-rank order); they become active for it. A job
        already recorded keeps its state (returns False). ``spec``: the job's spec
        (:class:`trainguard.operators.jobspec.JobSpec` as JSON), which every launch runs; None records the
        reference job with these arguments."""
        with self.tx() as s:
            if s.get(Job, name) is not None:
                return False
            if spec is None:
                from trainguard.core.topology import Topology
                from trainguard.operators.jobspec import reference_spec

                spec = reference_spec(name, Topology(tp, pp, dp, ranks_per_machine=ranks_per_machine),
                                      train_args=list(train_args), revision=revision).document()
            now = self.clock()
            s.add(Job(name=name, tp=tp, pp=pp, dp=dp, ranks_per_machine=ranks_per_machine,
                      machine_list=list(machines), state="running", revision=revision,
                      train_args=list(train_args), spec=dict(spec), created_ts=now, updated_ts=now))
            s.flush()
            for mname in machines:
                m = s.get(Machine, mname, with_for_update=True)
                if m is None:
                    raise FleetError(f"job {name}: machine {mname} is not in the fleet database", exit_code=2)
                if m.job not in (None, name):
                    raise FleetError(f"job {name}: machine {mname} already serves job {m.job}")
                self._move(s, m, states.ACTIVE, f"serves job {name}", None, job=name)
                m.job = name
            if revision:
                s.add(Revision(job=name, revision=revision, recorded_ts=now, known_good=False,
                               reason="the job's revision at start"))
            return True

    def submit_job(self, name: str, *, spec: Mapping[str, Any], machines: Sequence[str], tp: int, pp: int, dp: int,
                   ranks_per_machine: int, train_args: Sequence[str], revision: str) -> bool:
        """Record a submitted job (state ``launching``) on ``machines`` (node-rank order), which become active for
        it, in one transaction. The same spec submitted again while it launches or runs is a no-op (False); a job
        of that name that was stopped or failed is replaced; one that runs another spec is refused."""
        with self.tx() as s:
            j = s.get(Job, name, with_for_update=True)
            if j is not None and j.state in ("launching", "running"):
                if j.spec == dict(spec):
                    return False
                raise FleetError(f"job {name} is {j.state} with another spec; stop it first "
                                 f"('trainguard job stop {name}') or submit under another name")
            now = self.clock()
            fields = {"tp": tp, "pp": pp, "dp": dp, "ranks_per_machine": ranks_per_machine,
                      "machine_list": list(machines), "state": "launching", "revision": revision,
                      "pending_revision": None, "train_args": list(train_args), "spec": dict(spec), "updated_ts": now}
            if j is None:
                s.add(Job(name=name, created_ts=now, **fields))
            else:  # a stopped or failed job of that name: the new spec replaces it (its history stays)
                for key, value in {**fields, "created_ts": now}.items():
                    setattr(j, key, value)
                self._supersede(s, name, f"job {name} was submitted again")
            s.flush()
            for mname in machines:
                m = s.get(Machine, mname, with_for_update=True)
                if m is None:
                    raise FleetError(f"job {name}: machine {mname} is not in the fleet database; add it to the "
                                     f"inventory and run 'trainguard fleet migrate'", exit_code=2)
                if m.job not in (None, name):
                    raise FleetError(f"job {name}: machine {mname} already serves job {m.job}; name another")
                if m.state not in (states.STANDBY, states.SELF_CHECK, states.ACTIVE):
                    raise FleetError(f"job {name}: machine {mname} is {m.state}; name a checked machine "
                                     f"(a standby)")
                self._move(s, m, states.ACTIVE, f"serves job {name}", None, job=name)
                m.job = name
            if not s.scalars(select(Revision).where(Revision.job == name, Revision.revision == revision)).first():
                s.add(Revision(job=name, revision=revision, recorded_ts=now, known_good=False,
                               reason="the job's revision at submission"))
            return True

    def free_machines(self) -> list[str]:
        """Machines a job may take: checked standbys that serve no job, by name."""
        with self.tx() as s:
            return list(s.scalars(FREE))

    def release_job(self, name: str, *, state: str = "stopped", reason: str = "",
                    faulty: Mapping[str, str] | None = None, supersede: str = "") -> list[str]:
        """End a job in the fleet database: its state becomes ``state`` ("stopped" or "failed") and its machines
        return to the pool (standby), in one transaction. A machine under suspicion, or one in ``faulty``
        (machine -> the fault no incident acted on yet: a lost GPU whose eviction waited for a human), is evicted
        instead, never handed to the next job. ``supersede``: the job's incidents still open or waiting for a
        human are closed (failed) with this note, so that the next fault of the job opens its own. Returns the
        machines released; a job already released releases nothing."""
        released: list[str] = []
        faulty = dict(faulty or {})
        with self.tx() as s:
            j = self._required(s, Job, name, lock=True)
            for mname in j.machine_list:
                m = s.get(Machine, mname, with_for_update=True)
                if m is None or m.job != name:
                    continue
                why = f"released by job {name}" + (f": {reason}" if reason else "")
                if mname in faulty:
                    why = f"{why}; unhandled fault: {faulty[mname]}"
                bad = m.state == states.SUSPECT or mname in faulty
                self._move(s, m, states.EVICTED if bad else states.STANDBY, why, None, job=name)
                m.job = None
                released.append(mname)
            if j.state != state and j.state != "stopped":  # stopped by a person: a launch that fails after says
                j.state, j.updated_ts = state, self.clock()   # nothing new
            if supersede:
                self._supersede(s, name, supersede)
        return released

    def _supersede(self, s: Session, job: str, note: str) -> list[int]:
        """Close the job's incidents still open or waiting for a human (failed, ``note`` added to the summary)
        within ``s``; their ids."""
        now = self.clock()
        closed = []
        for inc in s.scalars(select(Incident).where(Incident.job == job, Incident.state.in_(OPEN_INCIDENT_STATES))
                             .with_for_update()):
            inc.state = states.IncidentState.FAILED
            inc.closed_ts = inc.closed_ts or now
            inc.summary = f"superseded: {note}" + (f" (was: {inc.summary})" if inc.summary else "")
            closed.append(inc.id)
        return closed

    def jobs(self) -> list[Job]:
        with self.tx() as s:
            return list(s.scalars(select(Job).order_by(Job.name)))

    def job(self, name: str) -> Job:
        with self.tx() as s:
            return self._required(s, Job, name)

    def set_job_state(self, name: str, state: str, *, unless: Collection[str] = ()) -> bool:
        """Set the job's state; True when it changed. ``unless``: states the job must not leave this way (a job
        released while a launch of it ran stays released): a job in one raises :class:`JobReleased` (exit 3) and
        nothing changes."""
        with self.tx() as s:
            j = self._required(s, Job, name, lock=True)
            if j.state in unless:
                raise JobReleased(f"job {name} is {j.state}, not set {state}: submit it again")
            if j.state == state:
                return False
            j.state, j.updated_ts = state, self.clock()
            return True

    def record_revision(self, job: str, revision: str, *, reason: str = "") -> bool:
        with self.tx() as s:
            if s.scalar(select(Revision).where(Revision.job == job, Revision.revision == revision)):
                return False
            s.add(Revision(job=job, revision=revision, recorded_ts=self.clock(), known_good=False, reason=reason))
            return True

    def revisions(self, job: str) -> list[Revision]:
        """The job's recorded revisions, oldest first."""
        with self.tx() as s:
            self._required(s, Job, job)
            return list(s.scalars(select(Revision).where(Revision.job == job).order_by(Revision.id)))

    def mark_known_good(self, job: str, revision: str) -> bool:
        with self.tx() as s:
            r = s.scalar(select(Revision).where(Revision.job == job, Revision.revision == revision))
            if r is None:
                raise FleetError(f"job {job} has no revision {revision} recorded", exit_code=2)
            if r.known_good:
                return False
            r.known_good, r.good_ts = True, self.clock()
            return True

    def last_known_good(self, job: str, *, other_than: str = "") -> str | None:
        with self.tx() as s:
            q = (select(Revision.revision).where(Revision.job == job, Revision.known_good.is_(True),
                                                 Revision.revision != other_than)
                 .order_by(Revision.good_ts.desc(), Revision.id.desc()))
            return s.scalar(q)

    def set_revision(self, job: str, revision: str, *, pending: bool = False) -> bool:
        """Switch the job to ``revision`` now, or (``pending``) at its next restart."""
        with self.tx() as s:
            j = self._required(s, Job, job, lock=True)
            if pending:
                if j.pending_revision == revision:
                    return False
                j.pending_revision = revision
            else:
                if j.revision == revision and j.pending_revision is None:
                    return False
                j.revision, j.pending_revision = revision, None
            j.updated_ts = self.clock()
            return True

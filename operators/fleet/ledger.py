"""The fleet database: what the control plane did and saw: actions, bus cursors and the agents' liveness, its
components' beats, checkpoints and ETTR events.

One of :class:`~trainguard.operators.fleet.store.FleetStore`'s bases: its methods use the store's engine,
transactions and retries."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from trainguard.operators.fleet import states
from trainguard.operators.fleet.db import FleetError
from trainguard.operators.fleet.models import (
    Action,
    AgentLiveness,
    BusCursor,
    Checkpoint,
    Component,
    EttrEvent,
    Incident,
    MachineEvent,
    QuarantinedAlert,
)


class LedgerRecords:
    """What the control plane did and saw, a part of :class:`~trainguard.operators.fleet.store.FleetStore`."""

    def record_liveness(self, liveness: Mapping[str, Mapping[str, Any]]) -> None:
        """The agents' ``liveness`` as a reader sees it now (the machines whose record changed are written)."""
        with self.tx() as s:
            self._record_liveness(s, {m: dict(v) for m, v in liveness.items()})

    def _record_liveness(self, s: Session, liveness: dict[str, dict[str, Any]]) -> None:
        """The agents' ``liveness`` as the reader last saw it, within ``s``: only the machines whose record
        changed are written (the reader sends every watched machine's each time; most have not changed)."""
        held = {r.machine: (r.token, r.changed_ts, r.reported_ts) for r in s.execute(select(
            AgentLiveness.machine, AgentLiveness.token, AgentLiveness.changed_ts, AgentLiveness.reported_ts))}
        rows = []
        for machine, st in liveness.items():
            row = {"machine": machine, "token": str(st.get("token", ""))[:256], "changed_ts": float(st["changed_ts"]),
                   "reported_ts": st.get("reported_ts")}
            if held.get(machine) != (row["token"], row["changed_ts"], row["reported_ts"]):
                rows.append(row)
        self._upsert(s, AgentLiveness, rows, keys=("machine",))

    def cursor(self, reader: str) -> dict[str, float]:
        """The ``reader``'s cursor: name -> when it first read it."""
        with self.tx() as s:
            return {c.name: c.seen_ts for c in s.scalars(select(BusCursor).where(BusCursor.reader == reader))}

    def advance_cursor(self, reader: str, read: dict[str, float], gone: Sequence[str] = ()) -> None:
        """The ``reader``'s cursor alone (a reader that records nothing else in the fleet database)."""
        self.ingest({}, escalation_window_s=0.0, reader=reader, read=read, gone=gone)

    def quarantined(self, *, since: float = 0.0) -> list[QuarantinedAlert]:
        with self.tx() as s:
            return list(s.scalars(select(QuarantinedAlert).where(QuarantinedAlert.ts >= since)
                                  .order_by(QuarantinedAlert.id)))

    def liveness(self) -> dict[str, AgentLiveness]:
        with self.tx() as s:
            return {a.machine: a for a in s.scalars(select(AgentLiveness))}

    def beat(self, component: str, detail: dict[str, Any] | None = None) -> None:
        """``component`` (the guardian ...) is alive now."""
        with self.tx() as s:
            s.merge(Component(name=component, seen_ts=self.clock(), detail=dict(detail or {})))

    def components(self) -> dict[str, Component]:
        with self.tx() as s:
            return {c.name: c for c in s.scalars(select(Component))}

    def in_flight(self, key_prefix: str) -> list[Action]:
        """Actions whose key starts with ``key_prefix`` that started and have not finished (a launch under way)."""
        with self.tx() as s:
            return list(s.scalars(select(Action).where(Action.key.startswith(key_prefix, autoescape=True),
                                                       Action.finished_ts.is_(None))))

    def record_action(self, key: str, *, kind: str, incident_id: int | None = None,
                      machines: Sequence[str] = (), evidence: dict[str, Any] | None = None,
                      dry_run: bool = False) -> tuple[Action, bool]:
        """Record a decision under an idempotency ``key``; the same key again returns the first record
        (created False)."""
        with self.tx() as s:
            row = {"key": key, "kind": kind, "incident_id": incident_id, "machines": list(machines),
                   "evidence": evidence or {}, "outcome": "dry_run" if dry_run else "pending", "detail": "",
                   "dry_run": dry_run, "started_ts": self.clock()}
            # one statement that inserts or leaves the first record: two handlers claiming the same key at once
            # (a duplicate task, a takeover) get one record, and the second its "created False"
            created = self._insert_new(s, Action, [row], keys=("key",))
            a = s.scalar(select(Action).where(Action.key == key))
            return a, bool(created)

    def finish_action(self, action_id: int, outcome: str, detail: str = "",
                      evidence: dict[str, Any] | None = None) -> bool:
        """Record how an action ended; ``evidence``: what it learnt on the way, added to its evidence."""
        with self.tx() as s:
            a = self._required(s, Action, action_id, lock=True)
            if a.finished_ts is not None:
                return False
            a.outcome, a.detail, a.finished_ts = outcome, detail, self.clock()
            if evidence:
                a.evidence = {**(a.evidence or {}), **evidence}
            return True

    def actions(self, incident_id: int | None = None) -> list[Action]:
        with self.tx() as s:
            q = select(Action).order_by(Action.id)
            if incident_id is not None:
                q = q.where(Action.incident_id == incident_id)
            return list(s.scalars(q))

    def implicated(self, job: str, machine: str, *, since: float, other_than: int) -> list[int]:
        """The job's incidents whose first alert came at or after ``since`` (but ``other_than``) that implicated
        ``machine`` (an ``implicate`` action: their logs said the failure started there) and left it in the job (no
        eviction of it done): what makes a repeat offender."""
        with self.tx() as s:
            ids = select(Incident.id).where(Incident.job == job, Incident.id != other_than,
                                            Incident.first_alert_ts >= since)
            rows = s.scalars(select(Action).where(Action.incident_id.in_(ids),
                                                  Action.kind.in_(("implicate", "evict")))).all()
            named = [a for a in rows if machine in (a.machines or ())]
        evicted = {a.incident_id for a in named if a.kind == "evict" and a.outcome == "done"}
        return sorted({a.incident_id for a in named if a.kind == "implicate"} - evicted)

    def evicted_recently(self, job: str, window_s: float) -> set[str]:
        """Machines evicted from ``job`` (for real, not dry runs) within the last ``window_s`` seconds."""
        since = self.clock() - window_s
        with self.tx() as s:
            q = (select(MachineEvent.machine).where(MachineEvent.to_state == states.EVICTED,
                                                    MachineEvent.ts >= since, MachineEvent.job == job))
            return set(s.scalars(q))

    def record_checkpoint(self, job: str, step: int, *, committed_ts: float | None = None) -> bool:
        row = {"job": job, "step": step, "problems": [], "verified": None, "verified_ts": None,
               "committed_ts": committed_ts or self.clock()}
        with self.tx() as s:  # one statement: two recorders of the same step at once make one row
            return self._insert_new(s, Checkpoint, [row], keys=("job", "step")) == 1

    def mark_checkpoint(self, job: str, step: int, *, verified: bool, problems: Sequence[str] = ()) -> None:
        with self.tx() as s:
            c = s.scalar(select(Checkpoint).where(Checkpoint.job == job, Checkpoint.step == step)
                         .with_for_update())
            if c is None:
                raise FleetError(f"job {job} has no checkpoint step {step} recorded", exit_code=2)
            c.verified, c.verified_ts, c.problems = verified, self.clock(), list(problems)

    def checkpoints(self, job: str) -> list[Checkpoint]:
        with self.tx() as s:
            return list(s.scalars(select(Checkpoint).where(Checkpoint.job == job).order_by(Checkpoint.step)))

    def add_ettr(self, job: str, kind: str, start_ts: float, end_ts: float, *, incident_id: int | None = None,
                 detail: str = "") -> None:
        """Record a stretch of the job's time; the same stretch again (job, kind, start and incident: an
        incident closed a second time) is a no-op."""
        if end_ts < start_ts:
            raise FleetError(f"ETTR event {kind} of job {job} ends before it starts ({start_ts} > {end_ts})")
        with self.tx() as s:
            same = s.scalar(select(EttrEvent.id).where(
                EttrEvent.job == job, EttrEvent.kind == kind, EttrEvent.start_ts == start_ts,
                EttrEvent.incident_id.is_(None) if incident_id is None else EttrEvent.incident_id == incident_id))
            if same is not None:
                return
            s.add(EttrEvent(job=job, kind=kind, start_ts=start_ts, end_ts=end_ts, incident_id=incident_id,
                            detail=detail))

    def ettr_events(self, job: str) -> list[EttrEvent]:
        with self.tx() as s:
            return list(s.scalars(select(EttrEvent).where(EttrEvent.job == job).order_by(EttrEvent.start_ts)))

"""The fleet database: incidents and their alerts: opening, ingesting a batch from the bus with its cursor,
levels, splits, hand-overs.

One of :class:`~trainguard.operators.fleet.store.FleetStore`'s bases: its methods use the store's engine,
transactions and retries."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy import and_, or_, select
from sqlalchemy.orm import Session

from trainguard.operators.fleet import states
from trainguard.operators.fleet.db import INCIDENT_STATES, FleetError, chunks
from trainguard.operators.fleet.models import (
    Action,
    Alert,
    BusCursor,
    Incident,
    Job,
    QuarantinedAlert,
)
from trainguard.operators.policy import ladder

# actions that say who handles an incident (a tg_incident run's claim, the reconciler's redrive), not what was done
# about it: a watched incident with only these may still be taken over by stronger alerts
CLAIMS = ("run", "redrive")


class IncidentRecords:
    """Incidents and their alerts, a part of :class:`~trainguard.operators.fleet.store.FleetStore`."""

    def open_incident(self, job: str, alerts: Iterable[dict[str, Any]], *, category: str = "",
                      escalation_window_s: float = 1800.0) -> tuple[Incident, bool]:
        """Attach ``alerts`` to the job's open incident, or open one. Returns (incident, opened). A new
        incident within ``escalation_window_s`` of the job's last closed one starts a level above it."""
        with self.tx() as s:
            return self._attach(s, job, list(alerts), category=category, escalation_window_s=escalation_window_s)

    def _attach(self, s: Session, job: str, alerts: list[dict[str, Any]], *, category: str = "",
                escalation_window_s: float) -> tuple[Incident, bool]:
        """Attach ``alerts`` to the job's open incident (or open one) within ``s``. An alert whose id is
        recorded already keeps its incident; one that comes twice in ``alerts`` is attached once. The alerts
        are written in bulk: a statement per :data:`CHUNK` alerts, not per alert."""
        # the job's row first: two writers attaching to a job that has no open incident yet (two guardians, a
        # retried event) queue here, so the second sees the incident the first opened (Postgres runs them
        # concurrently at READ COMMITTED; SQLite's BEGIN IMMEDIATE had serialised them already)
        s.execute(select(Job.name).where(Job.name == job).with_for_update())
        # an incident that waits for a human takes no alert: a new fault (of a job restarted by hand, or one the
        # waiting incident does not cover) opens an incident of its own, which the ladder acts on
        inc = s.scalar(select(Incident).where(Incident.job == job, Incident.state == states.IncidentState.OPEN)
                       .order_by(Incident.id.desc()).with_for_update())
        opened = inc is None
        if inc is None:
            first = min((float(a.get("ts", self.clock())) for a in alerts), default=self.clock())
            what, machines = self._what_failed(job, alerts, category)
            inc = Incident(job=job, state=states.IncidentState.OPEN, category=category,
                           level=self._next_level(s, job, escalation_window_s, failed_ts=first, category=what,
                                                  machines=machines),
                           opened_ts=self.clock(), first_alert_ts=first, summary="")
            s.add(inc)
            s.flush()
        rows, batch = [], set()
        for a in alerts:
            alert_id = str(a["id"])
            if alert_id in batch:
                continue
            batch.add(alert_id)
            rows.append({"id": alert_id, "ts": float(a.get("ts", 0.0)), "job": a.get("job") or "",
                         "machine": a.get("machine") or "", "rank": a.get("rank"), "kind": a["kind"],
                         "severity": a.get("severity") or "", "incident_id": inc.id, "document": a})
        self._insert_new(s, Alert, rows, keys=("id",))
        return inc, opened

    @staticmethod
    def _recorded_alerts(s: Session, ids: Sequence[str]) -> set[str]:
        """Which of ``ids`` are recorded already (within ``s``), read in chunks of :data:`CHUNK` ids."""
        found: set[str] = set()
        for chunk in chunks(sorted(set(ids))):
            found.update(s.scalars(select(Alert.id).where(Alert.id.in_(chunk))))
        return found

    def ingest(self, by_job: dict[str, list[dict[str, Any]]], *, escalation_window_s: float, reader: str = "",
               read: dict[str, float] | None = None, gone: Sequence[str] = (),
               quarantined: Sequence[dict[str, Any]] = (), liveness: dict[str, dict[str, Any]] | None = None,
               unattached: Sequence[dict[str, Any]] = (), claim: dict[str, Any] | None = None
               ) -> list[tuple[Incident, bool]]:
        """One batch of the bus in one transaction: each job's alerts attached to its open incident (or one
        opened; ``unattached``: alerts recorded without an incident), the ``reader``'s cursor advanced (the
        names ``read`` with the reader's time; ``gone``: names that left the bus), ``quarantined`` documents
        recorded, the agents' ``liveness`` as the reader last saw it; ``claim`` (``{"run", "first_seen_ts"}``):
        the tg_incident run recording the batch, which handles the first incident the batch opens (a ``run`` action
        of it, :meth:`runs_of`). Returns (incident, opened) per job, in job order. Either all of it is recorded or
        none. Recording the same batch again changes nothing. Every part is written in bulk (a statement per
        :data:`CHUNK` rows), so a burst of 100,000 alerts and names costs about a hundred statements per part."""
        with self.tx() as s:
            out = [self._attach(s, job, list(alerts), escalation_window_s=escalation_window_s)
                   for job, alerts in sorted(by_job.items())]
            opened_now = [inc.id for inc, opened in out if opened]
            if claim and opened_now:  # the run handles the first; the others get runs of their own
                self._insert_new(s, Action, [self._claim_row(opened_now[0], claim)], keys=("key",))
            # alerts recorded for the record only (a slowdown the whole job shares): no incident
            self._insert_new(s, Alert, [{"id": str(a["id"]), "ts": float(a.get("ts", 0.0)), "job": a.get("job") or "",
                                         "machine": a.get("machine") or "", "rank": a.get("rank"), "kind": a["kind"],
                                         "severity": a.get("severity") or "", "incident_id": None, "document": a}
                                        for a in {str(a["id"]): a for a in unattached}.values()], keys=("id",))
            self._upsert(s, BusCursor, [{"reader": reader, "name": name, "seen_ts": float(ts)}
                                        for name, ts in (read or {}).items()], keys=("reader", "name"))
            for chunk in chunks(sorted(set(gone))):
                s.execute(sa.delete(BusCursor).where(BusCursor.reader == reader, BusCursor.name.in_(chunk)))
            rows = [{"reader": reader, "name": str(q.get("name", ""))[:256], "machine": str(q.get("machine", ""))[:128],
                     "kind": str(q.get("kind", ""))[:64], "reason": str(q.get("reason", ""))[:2000],
                     "ts": float(q.get("ts") or self.clock()), "document": dict(q.get("document") or {})}
                    for q in quarantined]
            for chunk in chunks(rows):
                s.execute(sa.insert(QuarantinedAlert.__table__), chunk)
            if liveness:
                self._record_liveness(s, liveness)
            return out

    @staticmethod
    def _what_failed(job: str, alerts: Sequence[dict[str, Any]], category: str = "") -> tuple[str, tuple[str, ...]]:
        """A failure's category and implicated machines for the escalation rule: ``category`` when the caller
        names one (a manual incident), else what :func:`ladder.triage` makes of ``alerts`` (all of them: they
        were routed to this job already). The triage task judges the incident again with all its evidence and
        re-levels it (:meth:`relevel`)."""
        if category:
            return category, ()
        t = ladder.triage(job, alerts)
        return t.category.value, t.machines

    def split_off(self, incident_id: int, alert_ids: Collection[str], *, level: int) -> Incident | None:
        """Move ``alert_ids`` of the incident to a new open incident of its job at ``level``, in one
        transaction (its category left for its triage); None when none of them is the incident's any more (a
        retry after the move). What a recovery that held but saw its failure come back hands on: the failure
        after the restart is a new failure, a level up, not part of the incident that restarted the job."""
        with self.tx() as s:
            old = s.get(Incident, incident_id, with_for_update=True)
            if old is None:
                raise FleetError(f"no incident {incident_id}")
            ids = sorted(set(map(str, alert_ids)))
            mine = list(s.scalars(select(Alert).where(Alert.incident_id == incident_id, Alert.id.in_(ids))))
            if not mine:
                return None
            inc = Incident(job=old.job, state=states.IncidentState.OPEN, category="", level=level,
                           opened_ts=self.clock(), first_alert_ts=min(a.ts for a in mine), summary="")
            s.add(inc)
            s.flush()
            s.execute(sa.update(Alert).where(Alert.id.in_([a.id for a in mine])).values(incident_id=inc.id))
            new_id = inc.id
        return self.incident(new_id)

    def _next_level(self, s: Session, job: str, window_s: float, *, failed_ts: float, category: str,
                    machines: Sequence[str], before: int | None = None) -> int:
        """The level of a failure of ``job`` (its first alert at ``failed_ts``, triaged as ``category`` on
        ``machines``) by :func:`ladder.escalation_level`: one above the job's last recovery when it comes within
        ``window_s`` of that recovery's end and repeats it, else 0. The failure's own time counts, not when the
        control plane got to it. Incidents closed without a recovery (a tolerated network blip, a passing
        slowdown) are not recoveries and do not count. The last incident's category and machines are what its
        triage recorded; one closed before its triage ran is judged by :func:`ladder.triage` of its alerts.
        ``before``: only incidents older than this one (re-levelling an open incident)."""
        q = select(Incident).where(
            Incident.job == job,
            or_(Incident.state == states.IncidentState.FAILED,
                and_(Incident.state == states.IncidentState.RESOLVED, Incident.resumed_ts.is_not(None))))
        if before is not None:
            q = q.where(Incident.id < before)
        last = s.scalar(q.order_by(Incident.id.desc()))
        if last is None:
            return 0
        last_category, last_machines = last.category, tuple(last.machines or ())
        if not last_category:
            alerts = s.scalars(select(Alert.document).where(Alert.incident_id == last.id).order_by(Alert.ts))
            last_category, last_machines = self._what_failed(job, list(alerts))
        return ladder.escalation_level(last_level=last.level, last_recovery_end_ts=last.resumed_ts or last.closed_ts,
                                       failed_ts=failed_ts, window_s=window_s, last_category=last_category,
                                       last_machines=last_machines, category=category, machines=machines)

    def relevel(self, incident_id: int, *, category: str, machines: Sequence[str], window_s: float) -> int:
        """Record the triage's ``category`` and ``machines`` on the open incident and its level from them
        (:meth:`_next_level`): the level set when it opened came from its first alerts alone. Returns the
        level."""
        with self.tx() as s:
            inc = self._required(s, Incident, incident_id, lock=True)
            inc.level = self._next_level(s, inc.job, window_s, failed_ts=inc.first_alert_ts, category=category,
                                         machines=machines, before=inc.id)
            inc.category, inc.machines = category, sorted(machines)
            return inc.level

    def known_alerts(self, ids: Sequence[str]) -> set[str]:
        """Which of ``ids`` are recorded already (read in chunks of :data:`CHUNK` ids)."""
        if not ids:
            return set()
        with self.tx() as s:
            return self._recorded_alerts(s, ids)

    def alerts_on(self, machines: Collection[str], *, kinds: Collection[str], since: float = 0.0) -> list[Alert]:
        """The alerts of ``kinds`` about ``machines`` recorded at ``since`` or later, oldest first."""
        out: list[Alert] = []
        with self.tx() as s:
            for chunk in chunks(sorted(set(machines))):
                out += s.scalars(select(Alert).where(Alert.machine.in_(chunk), Alert.kind.in_(sorted(kinds)),
                                                     Alert.ts >= since))
        return sorted(out, key=lambda a: a.ts)

    def incident(self, incident_id: int) -> Incident:
        with self.tx() as s:
            return self._required(s, Incident, incident_id)

    def incidents(self, job: str | None = None) -> list[Incident]:
        with self.tx() as s:
            q = select(Incident).order_by(Incident.id)
            if job is not None:
                q = q.where(Incident.job == job)
            return list(s.scalars(q))

    def alerts_of(self, incident_id: int, *, kinds: Collection[str] | None = None, limit: int | None = None
                  ) -> list[Alert]:
        """The incident's alerts, oldest first; only those of ``kinds`` and the first ``limit`` when given (an
        incident of an alert storm holds one alert per rank: a question about a few kinds need not load them
        all)."""
        q = select(Alert).where(Alert.incident_id == incident_id)
        if kinds is not None:
            q = q.where(Alert.kind.in_(sorted(kinds)))
        q = q.order_by(Alert.ts, Alert.id)
        if limit is not None:
            q = q.limit(limit)
        with self.tx() as s:
            return list(s.scalars(q))

    def update_incident(self, incident_id: int, **fields: Any) -> None:
        allowed = {"state", "category", "level", "diagnosis_start_ts", "decided_ts", "resumed_ts", "closed_ts",
                   "summary", "lost_steps"}
        unknown = set(fields) - allowed
        if unknown:
            raise FleetError(f"incident fields {sorted(unknown)} cannot be set")
        if "state" in fields and fields["state"] not in INCIDENT_STATES:
            raise FleetError(f"incident state {fields['state']!r} is not one of {', '.join(INCIDENT_STATES)}")
        with self.tx() as s:
            _set_fields(self._required(s, Incident, incident_id, lock=True), fields)

    def close_open(self, incident_id: int, outcome: str, **fields: Any) -> bool:
        """Close an incident that is still open with ``outcome`` (and ``fields``: milestones, lost steps, summary), in
        one transaction. One that a person closed, or a stop or a resubmit superseded, or that waits for a human,
        while its run was still acting keeps its state and summary: the run's late close changes nothing (False)."""
        if outcome not in (states.IncidentState.RESOLVED, states.IncidentState.FAILED):
            raise FleetError(f"an incident closes resolved or failed, not {outcome!r}")
        with self.tx() as s:
            inc = self._required(s, Incident, incident_id, lock=True)
            if inc.state != states.IncidentState.OPEN:
                return False
            unknown = set(fields) - {"resumed_ts", "closed_ts", "summary", "lost_steps"}
            if unknown:
                raise FleetError(f"incident fields {sorted(unknown)} are not set on close")
            inc.state = outcome
            _set_fields(inc, fields)
            return True

    def _claim_row(self, incident_id: int, claim: dict[str, Any]) -> dict[str, Any]:
        now = self.clock()
        return {"key": f"run:{incident_id}:{claim['run']}", "kind": "run", "incident_id": incident_id, "machines": [],
                "evidence": {"run": str(claim["run"]), "first_seen_ts": claim.get("first_seen_ts")},
                "outcome": "done", "detail": "", "dry_run": False, "started_ts": now, "finished_ts": now}

    def claim_run(self, incident_id: int, run: str, *, first_seen_ts: float | None = None) -> None:
        """Record that the tg_incident run ``run`` handles the incident now (a run started for it, or one that took it
        over); claiming twice is a no-op."""
        with self.tx() as s:
            self._required(s, Incident, incident_id)
            self._insert_new(s, Action, [self._claim_row(incident_id, {"run": run, "first_seen_ts": first_seen_ts})],
                             keys=("key",))

    def runs_of(self, incident_ids: Collection[int] | None = None) -> dict[int, list[str]]:
        """The tg_incident runs that handled each incident (oldest first): incident -> run ids (every incident with a
        run when ``incident_ids`` is None)."""
        with self.tx() as s:
            q = select(Action.incident_id, Action.evidence).where(Action.kind == "run").order_by(Action.id)
            if incident_ids is not None:
                q = q.where(Action.incident_id.in_(sorted(set(incident_ids))))
            out: dict[int, list[str]] = {}
            for incident_id, evidence in s.execute(q):
                out.setdefault(int(incident_id), []).append(str((evidence or {}).get("run")))
            return out

    def claims_of(self, incident_id: int) -> list[dict[str, Any]]:
        """The tg_incident runs that handled the incident, oldest first: ``{"run", "first_seen_ts"}`` each (when the
        alert watcher first saw the batch that opened it, for the run that opened it)."""
        with self.tx() as s:
            rows = s.scalars(select(Action).where(Action.kind == "run", Action.incident_id == incident_id)
                             .order_by(Action.id))
            return [{"run": str((a.evidence or {}).get("run")),
                     "first_seen_ts": (a.evidence or {}).get("first_seen_ts")} for a in rows]

    def claimed_by(self, run: str) -> list[int]:
        """The incidents the tg_incident run ``run`` handles (claimed when it recorded the batch that opened them, or
        when it was started for them), oldest first."""
        pattern = "run:%:" + str(run).replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
        with self.tx() as s:
            keys = s.scalars(select(Action.incident_id).where(Action.kind == "run",
                                                              Action.key.like(pattern, escape="\\"))
                             .order_by(Action.id))
            return [int(k) for k in keys if k is not None]

    def wait_for_human(self, incident_id: int, reason: str) -> dict[str, Any]:
        """The incident waits for a human, and so does its job, in one transaction (``reason``: why, and what to
        do). Returns what the action that stopped there answers (``waiting_human`` with the reason)."""
        with self.tx() as s:
            inc = self._required(s, Incident, incident_id, lock=True)
            if inc.state not in states.OPEN_INCIDENT_STATES:
                # a person closed it, or a stop or a resubmit superseded it, while its run still acted: theirs stands
                return {"swaps": {}, "waiting_human": True, "reason": f"incident {inc.id} was closed ({inc.state}) "
                                                                      f"while its run acted: {inc.summary[:300]}"}
            inc.state, inc.summary = states.IncidentState.WAITING_HUMAN, reason
            job = self._required(s, Job, inc.job, lock=True)
            if job.state != "waiting_human":
                job.state, job.updated_ts = "waiting_human", self.clock()
        return {"swaps": {}, "waiting_human": True, "reason": reason}

    def close_by_hand(self, incident_id: int, note: str = "") -> dict[str, Any]:
        """A person closes an incident that is open or waits for a human (``trainguard incident close``), in one
        transaction: it is failed (its summary keeps ``note`` and what it said), and a job that waited for it alone
        is ``running`` again in the database, so the reconciler looks at its machines (a job found down opens an
        incident of its own). Closing a closed incident changes nothing (``closed`` False)."""
        with self.tx() as s:
            inc = self._required(s, Incident, incident_id, lock=True)
            job = self._required(s, Job, inc.job, lock=True)
            if inc.state not in (states.IncidentState.OPEN, states.IncidentState.WAITING_HUMAN):
                return {"incident": inc.id, "job": job.name, "closed": False, "state": inc.state,
                        "job_state": job.state}
            now = self.clock()
            inc.state, inc.closed_ts = states.IncidentState.FAILED, inc.closed_ts or now
            inc.summary = f"closed by hand: {note or 'no note'}" + (f" (was: {inc.summary})" if inc.summary else "")
            waiting = s.scalar(select(Incident.id).where(Incident.job == job.name, Incident.id != inc.id,
                                                         Incident.state == states.IncidentState.WAITING_HUMAN)
                               .limit(1))
            if job.state == "waiting_human" and waiting is None:
                job.state, job.updated_ts = "running", now
            return {"incident": inc.id, "job": job.name, "closed": True, "state": inc.state, "job_state": job.state}

    def claim_watched(self, incident_id: int, key: str, *, watched: Collection[str], kind: str,
                      machines: Sequence[str] = (), evidence: dict[str, Any] | None = None, detail: str = "") -> bool:
        """A watched incident's verdict (a fail-slow vote's), recorded as a done action in the same
        transaction that checks the incident is still of a ``watched`` category: after it, stronger
        alerts can no longer take the incident over (:meth:`take_over`); when they did first, nothing is
        recorded and the answer is False. Claiming twice is a no-op (True)."""
        with self.tx() as s:
            inc = self._required(s, Incident, incident_id, lock=True)
            if s.scalar(select(Action).where(Action.key == key)) is not None:
                return True
            if inc.category not in watched:
                return False
            now = self.clock()
            s.add(Action(key=key, kind=kind, incident_id=incident_id, machines=list(machines), evidence=evidence or {},
                         outcome="done", detail=detail, dry_run=False, started_ts=now, finished_ts=now))
            return True

    def take_over(self, incident_id: int, *, watched: Collection[str], category: str, summary: str) -> bool:
        """Give an open incident of a ``watched`` category on which nothing was acted yet (no action, no
        claimed verdict) the stronger ``category``, in one transaction; False when it is too late."""
        with self.tx() as s:
            inc = self._required(s, Incident, incident_id, lock=True)
            if inc.state != states.IncidentState.OPEN or inc.category not in watched:
                return False
            if s.scalar(select(Action.id).where(Action.incident_id == incident_id, Action.kind.not_in(CLAIMS))
                        .limit(1)) is not None:
                return False
            inc.category, inc.summary = category, summary
            return True


def _set_fields(inc: Incident, fields: Mapping[str, Any]) -> None:
    """Set an incident's ``fields``; a milestone (``*_ts``) already reached keeps its first time."""
    for key, value in fields.items():
        if not (key.endswith("_ts") and getattr(inc, key) is not None):
            setattr(inc, key, value)

"""The fleet database: machines: registering them, their states and the events of their moves, swaps between a
job's machines and standbys.

One of :class:`~trainguard.operators.fleet.store.FleetStore`'s bases: its methods use the store's engine,
transactions and retries."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy import select
from sqlalchemy.orm import Session

from trainguard.operators.fleet import states
from trainguard.operators.fleet.db import FleetError, chunks
from trainguard.operators.fleet.models import (
    Job,
    Machine,
    MachineEvent,
)


class MachineRecords:
    """Machines, a part of :class:`~trainguard.operators.fleet.store.FleetStore`."""

    def register_machine(self, name: str, *, address: str = "", state: str = states.STANDBY,
                         reason: str = "registered") -> bool:
        """Add a machine in ``state``; a machine already known is left as it is (returns False)."""
        if state not in states.STATES:
            raise FleetError(f"unknown machine state {state!r}; use one of {', '.join(states.STATES)}")
        with self.tx() as s:
            if s.get(Machine, name) is not None:
                return False
            now = self.clock()
            s.add(Machine(name=name, address=address, state=state, state_since=now, reason=reason, evictions=0))
            s.add(MachineEvent(machine=name, from_state=None, to_state=state, ts=now, reason=reason))
            return True

    def register_machines(self, machines: Sequence[tuple[str, str, str, str]]) -> list[str]:
        """Add each of ``machines`` (``(name, address, state, reason)``) the database does not know yet, in one
        transaction (a statement per :data:`CHUNK` machines: an inventory of 12,500 machines is not 12,500
        transactions), each with its first event; machines already known (or registered meanwhile by another
        writer) are left as they are. Returns the names added, in order."""
        bad = sorted({state for _n, _a, state, _r in machines} - set(states.STATES))
        if bad:
            raise FleetError(f"unknown machine state {bad[0]!r}; use one of {', '.join(states.STATES)}")
        now = self.clock()
        rows: dict[str, dict[str, Any]] = {}
        for name, address, state, reason in machines:
            rows.setdefault(name, {"name": name, "address": address, "state": state, "state_since": now,
                                   "reason": reason, "evictions": 0})
        added: set[str] = set()
        with self.tx() as s:
            known: set[str] = set()
            for chunk in chunks(list(rows)):
                known.update(s.scalars(select(Machine.name).where(Machine.name.in_(chunk))))
            fresh = [r for n, r in rows.items() if n not in known]
            insert = self._dialect_insert(s)
            table = Machine.__table__  # type: ignore[attr-defined]
            for chunk in chunks(fresh):
                if insert is None:
                    s.execute(sa.insert(table), chunk)
                    added.update(r["name"] for r in chunk)
                else:  # the names this statement inserted: not those another writer registered meanwhile
                    stmt = insert(table).on_conflict_do_nothing(index_elements=["name"]).returning(table.c.name)
                    added.update(s.execute(stmt, chunk).scalars().all())
            events = [{"machine": n, "from_state": None, "to_state": rows[n]["state"], "ts": now,
                       "reason": rows[n]["reason"], "incident_id": None, "job": None} for n in rows if n in added]
            for chunk in chunks(events):
                s.execute(sa.insert(MachineEvent.__table__), chunk)  # type: ignore[attr-defined]
        return [n for n in rows if n in added]

    def machine(self, name: str) -> Machine:
        with self.tx() as s:
            return self._required(s, Machine, name)

    def machines(self, *, state: str | None = None, job: str | None = None) -> list[Machine]:
        with self.tx() as s:
            q = select(Machine).order_by(Machine.name)
            if state is not None:
                q = q.where(Machine.state == state)
            if job is not None:
                q = q.where(Machine.job == job)
            return list(s.scalars(q))

    def jobs_of(self, names: Collection[str]) -> dict[str, str | None]:
        """The job each machine of ``names`` serves (None: it serves none), read in chunks of :data:`CHUNK`
        names; a machine the fleet database does not know is left out."""
        out: dict[str, str | None] = {}
        with self.tx() as s:
            for chunk in chunks(sorted(set(names))):
                rows = s.execute(select(Machine.name, Machine.job).where(Machine.name.in_(chunk)))
                out.update((name, job) for name, job in rows)
        return out

    def _move(self, s: Session, m: Machine, to_state: str, reason: str, incident_id: int | None, *,
              job: str | None = None, checked: bool = False) -> bool:
        if m.state == to_state:
            return False
        if not states.allowed(m.state, to_state):
            raise FleetError(f"machine {m.name} cannot go from {m.state} to {to_state}; allowed: "
                             f"{', '.join(sorted(states.TRANSITIONS[m.state])) or 'none'}")
        now = self.clock()
        s.add(MachineEvent(machine=m.name, from_state=m.state, to_state=to_state, ts=now, reason=reason,
                           incident_id=incident_id, job=job or m.job))
        m.state, m.state_since, m.reason = to_state, now, reason
        if to_state == states.EVICTED:
            m.evictions += 1
        if to_state in (states.EVICTED, states.STANDBY, states.REPAIR, states.RETIRED, states.SELF_CHECK):
            m.job = None
        if checked and to_state == states.STANDBY:
            m.checked_ts = now
        return True

    def transition(self, name: str, to_state: str, *, reason: str, incident_id: int | None = None,
                   checked: bool = False) -> bool:
        """Move a machine to ``to_state``. Already there: no-op (False). Not allowed: FleetError.
        ``checked``: a standby that has just passed its self-check (its ``checked_ts`` is now)."""
        with self.tx() as s:
            return self._move(s, self._required(s, Machine, name, lock=True), to_state, reason, incident_id,
                              checked=checked)

    def events(self, name: str) -> list[MachineEvent]:
        with self.tx() as s:
            return list(s.scalars(select(MachineEvent).where(MachineEvent.machine == name)
                                  .order_by(MachineEvent.id)))

    def all_events(self, *, since: float = 0.0) -> list[MachineEvent]:
        """Every machine's state changes at ``since`` or later, oldest first, with each machine's last
        change before ``since`` (the state it entered the period in)."""
        with self.tx() as s:
            later = list(s.scalars(select(MachineEvent).where(MachineEvent.ts >= since).order_by(MachineEvent.id)))
            last_before = (select(sa.func.max(MachineEvent.id)).where(MachineEvent.ts < since)
                           .group_by(MachineEvent.machine))
            before = list(s.scalars(select(MachineEvent).where(MachineEvent.id.in_(last_before))))
            return sorted(before + later, key=lambda e: e.id)

    def joined_ts(self, names: Collection[str]) -> dict[str, float]:
        """When each of ``names`` last became active (joined the job it serves), from its audit trail; machines
        never active are left out."""
        out: dict[str, float] = {}
        with self.tx() as s:
            for chunk in chunks(sorted(set(names))):
                rows = s.execute(select(MachineEvent.machine, sa.func.max(MachineEvent.ts))
                                 .where(MachineEvent.machine.in_(chunk), MachineEvent.to_state == states.ACTIVE)
                                 .group_by(MachineEvent.machine))
                out.update({str(m): float(ts) for m, ts in rows})
        return {m: float(ts) for m, ts in out.items()}

    def swap(self, job: str, replacements: dict[str, str], *, reason: str, incident_id: int | None = None,
             ) -> dict[str, str]:
        """Evict each machine of ``replacements`` from ``job`` and put its standby in its place (same
        node rank), all in one transaction. Returns the swaps done; a swap already done is skipped."""
        done: dict[str, str] = {}
        with self.tx() as s:
            j = self._required(s, Job, job, lock=True)
            order = list(j.machine_list)
            at = {n: i for i, n in enumerate(order)}  # node rank by machine: a swap per machine, not a scan
            for old, new in replacements.items():
                if old not in at and new in at:
                    continue  # done before
                if old not in at:
                    raise FleetError(f"machine {old} does not serve job {job} ({', '.join(order)})")
                m_old = s.get(Machine, old, with_for_update=True)
                m_new = s.get(Machine, new, with_for_update=True)
                if m_new is None or m_new.state != states.STANDBY:
                    state = m_new.state if m_new else "unknown"
                    raise FleetError(f"machine {new} cannot replace {old}: it is {state}, not a standby")
                assert m_old is not None
                self._move(s, m_old, states.EVICTED, f"evicted from {job}: {reason}", incident_id, job=job)
                self._move(s, m_new, states.ACTIVE, f"replaces {old} in {job}", incident_id)
                m_new.job = job
                order[at[old]] = new
                at[new] = at.pop(old)
                done[old] = new
            if done:
                j.machine_list, j.updated_ts = order, self.clock()
        return done

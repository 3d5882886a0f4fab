"""The ETTR ledger: every step record of a rank from every machine that ran it, and the job's effective training
time ratio, cumulative and sliding, with each incident's time by phase and cause."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from trainguard.core.errors import TrainguardError
from trainguard.operators.control.base import Part
from trainguard.operators.fleet.states import IncidentState
from trainguard.operators.fleet.store import OPEN_INCIDENT_STATES
from trainguard.operators.policy import ettr


class Ettr(Part):
    """The job's effective training time."""

    def step_history(self, job: str, rank: int = 0, *, unanswered: list[str] | None = None
                     ) -> list[dict[str, Any]]:
        """Every step record of ``rank`` of the job, from every machine that ran it (the rank moves when
        its machine is evicted), oldest first. Each machine counts its own incarnations; here
        ``incarnation`` is renumbered across machines in the order the parts started, so a later restart
        always has the higher number. ``unanswered``: gets the machines that could not be asked (unreachable,
        or no answer in time), whose records, if they hold any, are missing from the history."""
        argv = [self.inventory.tg_node, "job", "steps", "--job", job, "--rank", str(rank)]
        results = self.transport.run_many(self.inventory.machines, lambda m: argv, timeout=30)
        if unanswered is not None:
            unanswered.extend(sorted(n for n, res in results.items() if not res.reachable or res.timed_out))
        records = [dict(r, machine=name) for name, res in results.items() if res.ok
                   for r in (res.json() or {}).get("steps", [])]
        records.sort(key=lambda r: float(r.get("ts", 0.0)))
        order: dict[tuple[str, int], int] = {}
        for r in records:
            key = (r["machine"], int(r.get("incarnation", 0)))
            r["incarnation"] = order.setdefault(key, len(order))
        return records

    def _replica_first_ranks(self, job: str) -> list[int]:
        """The first rank of each data-parallel replica of a job run as replica groups (its spec's ``replicas``);
        ``[0]`` for any other job."""
        from trainguard.operators.jobspec import replica_groups

        j = self.fleet.job(job)
        if replica_groups(j) is None:
            return [0]
        return [d * j.tp * j.pp for d in range(j.dp)]

    def ettr_report(self, job: str, *, window_s: float = 3600.0,
                    records: Sequence[Mapping[str, Any]] | None = None, as_of: float | None = None
                    ) -> dict[str, Any]:
        """The job's effective training time ratio, cumulative (since its first step) and over the last
        ``window_s``, and each closed incident's time split into detection, diagnosis, recovery and lost
        work (steps recomputed after the restore), summed by failure cause. ``records``: the job's
        :meth:`step_history` when the caller has it already (one round of sessions less), read at
        ``as_of`` (default: now).

        The step records are read once into a :class:`~trainguard.operators.policy.ettr.StepHistory` (kept and lost
        marked once for the whole history); each incident's lost work comes from its own window of it (after
        the previous incident's resumption, by its opening), so the report is linear in the steps."""
        now = time.time() if as_of is None else as_of
        unanswered: list[str] = []
        records = list(self.step_history(job, unanswered=unanswered) if records is None else records)
        if not records:
            raise TrainguardError(f"job {job} has no step records on any machine of the inventory; has it run?")
        # a job run as replica groups: every replica's first rank (each group's records are its own replica's)
        others = [ettr.StepHistory(ettr.continued(self.step_history(job, rank=q, unanswered=unanswered)))
                  for q in self._replica_first_ranks(job)[1:]]
        first = min(float(r["ts"]) - float(r.get("step_time_s") or 0.0) for r in records)
        steps = ettr.StepHistory(ettr.continued(records))  # the program's own pauses between its steps count
        job_incidents = self.fleet.incidents(job)
        # an incident handled by the degrade path: the job trained on at reduced width, its stretches count for the
        # share of replicas that were out
        out_share = {a.incident_id: 1.0 - float((a.evidence or {}).get("width") or 0.0) for a in self.fleet.actions()
                     if a.kind == "degrade" and a.outcome == "done"}
        incidents, by_cause = [], {}
        since = first
        for inc in job_incidents:
            if inc.state not in (IncidentState.RESOLVED, IncidentState.FAILED) or inc.first_alert_ts is None:
                continue
            split = ettr.incident_split({"first_alert_ts": inc.first_alert_ts, "opened_ts": inc.opened_ts,
                                         "diagnosis_start_ts": inc.diagnosis_start_ts, "decided_ts": inc.decided_ts,
                                         "resumed_ts": inc.resumed_ts}, steps, since_ts=since)
            if inc.id in out_share:
                split = {k: v * out_share[inc.id] for k, v in split.items()}
            incidents.append({"incident": inc.id, "category": inc.category, "state": inc.state,
                              **{k: round(v, 3) for k, v in split.items()}})
            cause = by_cause.setdefault(inc.category or "unknown", {"incidents": 0, "seconds": 0.0})
            cause["incidents"] += 1
            cause["seconds"] = round(cause["seconds"] + sum(split.values()), 3)
            since = inc.resumed_ts or since
        # the window ends at the last finished step while the job steps on (no incident open, no stall)
        now = steps.window_end(now, incident_open=any(i.state in OPEN_INCIDENT_STATES for i in job_incidents))

        def over(start: float) -> dict[str, Any]:
            return ettr.across_replicas([h.ettr(start_ts=start, end_ts=now) for h in (steps, *others)]).as_dict()

        return {"job": job, "cumulative": over(first),
                "sliding": {"window_s": window_s, **over(max(first, now - window_s))},
                "incidents": incidents, "by_cause": by_cause,
                # machines whose step records could not be read: the report may miss their steps (it is partial)
                "unanswered": unanswered}

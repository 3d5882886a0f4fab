"""Incidents: alerts read off the bus recorded into incidents (what may be trusted, in one transaction with the
bus cursor), the triage, the repeat-offender record, the close and its timeline."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from trainguard.core.errors import TrainguardError
from trainguard.core.topology import Topology
from trainguard.operators.control.base import Part, asdict_action
from trainguard.operators.fleet import states
from trainguard.operators.fleet.incidents import CLAIMS
from trainguard.operators.fleet.states import IncidentState
from trainguard.operators.policy import ladder

if TYPE_CHECKING:
    from trainguard.operators.control.jobs import Jobs

#: a machine named by an alert of a job it does not serve: the job's machines the reason lists, at most
LISTED_MACHINES = 16


class Roster:
    """What alerts read off the bus are checked against, read once per batch: the inventory's machine names,
    the fleet's jobs, and for each job the set of machines serving it, so that checking an alert costs the
    same whatever the size of the fleet and of its job."""

    def __init__(self, machines: Collection[str], jobs: Iterable[Any]) -> None:
        self.machines = frozenset(machines)
        self.jobs: dict[str, Any] = {j.name: j for j in jobs}
        self._serving: dict[str, frozenset[str]] = {}
        self._listed: dict[str, str] = {}

    def serving(self, job: str) -> frozenset[str]:
        """The machines serving ``job`` (a job the roster holds)."""
        if job not in self._serving:
            self._serving[job] = frozenset(self.jobs[job].machine_list)
        return self._serving[job]

    def listed(self, job: str) -> str:
        """The machines of ``job`` as a reason names them: all of a small job, the first few of a large one."""
        if job not in self._listed:
            order = list(self.jobs[job].machine_list)
            text = ", ".join(order[:LISTED_MACHINES])
            self._listed[job] = text if len(order) <= LISTED_MACHINES else f"{text}, ... {len(order)} in all"
        return self._listed[job]

    def untrusted(self, alert: Mapping[str, Any]) -> str:
        """See :meth:`Incidents.untrusted`."""
        machine, job_name = str(alert.get("machine", "")), str(alert.get("job") or "")
        if machine not in self.machines:
            return f"machine {machine[:63]!r} is not in the inventory"
        if not job_name:
            return ""
        job = self.jobs.get(job_name)
        if job is None:
            return f"job {job_name[:64]!r} is not in the fleet database"
        if machine not in self.serving(job_name):
            return f"machine {machine} does not serve job {job_name} ({self.listed(job_name)})"
        rank = alert.get("rank")
        if isinstance(rank, int) and not 0 <= rank < job.tp * job.pp * job.dp:
            return f"rank {rank} is outside job {job_name}'s {job.tp * job.pp * job.dp} ranks"
        return ""


class Incidents(Part):
    """Alerts into incidents, triage, close."""

    def __init__(self, *base: Any, jobs: Jobs) -> None:
        super().__init__(*base)
        self.jobs = jobs

    def roster(self) -> Roster:
        """The inventory's machines and the fleet's jobs as they are now (one read of each)."""
        return Roster(self.inventory.names(), self.fleet.jobs())

    def untrusted(self, alert: Mapping[str, Any], roster: Roster | None = None) -> str:
        """Why an alert read off the bus must not be acted on ("" when it may): a machine the inventory does not
        list, a job the fleet does not know, a machine that does not serve the job it names, a rank outside
        the job. ``roster``: what to check against (read now when None; a batch reads it once)."""
        return (roster or self.roster()).untrusted(alert)

    def ingest(self, alerts: Sequence[Mapping[str, Any]], *, reader: str = "guardian",
               read: Mapping[str, float] | None = None, gone: Sequence[str] = (),
               quarantined: Sequence[Mapping[str, Any]] = (),
               liveness: Mapping[str, Mapping[str, Any]] | None = None,
               claim: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
        """Group a batch by job and attach it to the job's open incident (or open one), in one transaction
        with the bus cursor (``read``, ``gone``: see :meth:`trainguard.operators.fleet.store.FleetStore.ingest`), the
        documents the reader ``quarantined`` and the agents' ``liveness``. An alert naming a machine or a job
        the inventory and the fleet do not know (or a machine that does not serve the job it names) is
        quarantined with the reason and never acted on; one whose writer's clock is off (``clock_skew_s``)
        counts from when it arrived. Alerts about machines serving no job are recorded against nothing; an
        explicit fault on a standby sends it to repair. An alert recorded before, or delivered twice in the
        batch, is recorded once. ``claim`` (``{"run", "first_seen_ts"}``): the tg_incident run recording the batch
        handles the incidents it opens. Returns ``[{incident, job, opened, taken_over, alerts}]`` for the incidents
        to work on.

        The cost grows with the batch, not with the batch times the fleet: the inventory, the jobs and the
        machines the batch names are read once, and the fleet database is written in bulk (a burst from
        every rank of a 100,000-rank job is one transaction of a few hundred statements)."""
        by_job: dict[str, list[dict[str, Any]]] = {}
        rejected: list[dict[str, Any]] = []
        known = self.fleet.known_alerts([str(a["id"]) for a in alerts])
        roster = self.roster()
        taken: set[str] = set()
        trusted: list[dict[str, Any]] = []
        for a in alerts:
            alert_id = str(a["id"])
            if alert_id in known:
                continue  # delivered again after a failed guardian run: recorded already
            why = roster.untrusted(a)
            if why:
                rejected.append({"name": a.get("bus_name") or "", "reason": why, "machine": str(a.get("machine", "")),
                                 "kind": a.get("kind", ""), "ts": a.get("received_ts") or time.time(),
                                 "document": dict(a)})
                continue
            if alert_id in taken:
                continue  # the same alert twice in the batch
            taken.add(alert_id)
            doc = dict(a)
            if doc.get("clock_skew_s") is not None and doc.get("received_ts") is not None:
                doc["sent_ts"], doc["ts"] = doc["ts"], doc["received_ts"]  # handled by its arrival time
            trusted.append(doc)
        # an alert naming no job belongs to the job its machine serves now (the fleet database's, read once)
        serves = self.fleet.jobs_of({str(d["machine"]) for d in trusted if not d.get("job")})
        for doc in trusted:
            job = str(doc["job"]) if doc.get("job") else serves.get(str(doc["machine"]))
            if job is not None:
                by_job.setdefault(job, []).append(doc)
            elif ladder.triage("", [doc]).category == "machine_fault":
                self._standby_fault(doc)
        # whether an open incident handles a job (its alerts join it whatever they are): read once per job, and only
        # for a batch that could be recorded without one
        handling: dict[str, bool] = {}

        def handled(job: str) -> bool:
            if job not in handling:
                handling[job] = any(i.state == IncidentState.OPEN for i in self.fleet.incidents(job))
            return handling[job]

        shared = self._shared_slowdowns(by_job, roster, handled)
        observed = self._observed_only(by_job, handled)
        for job in (*shared, *observed):
            by_job.pop(job)
        results = self.fleet.ingest(by_job, escalation_window_s=self.cfg.escalation_window_s, reader=reader,
                                    read=dict(read or {}), gone=list(gone),
                                    quarantined=[*quarantined, *rejected],
                                    liveness={m: dict(v) for m, v in liveness.items()} if liveness else None,
                                    unattached=[*({**a, "shared_slowdown": why} for why, batch in shared.values()
                                                  for a in batch),
                                                *({**a, "observed_only": why} for why, batch in observed.values()
                                                  for a in batch)], claim=dict(claim) if claim else None)
        if rejected:
            # a bus object may hold a batch of one machine's alerts: it leaves the folder only when none of them
            # was trusted (the trusted ones are recorded; the untrusted ones are recorded as quarantined)
            kept = {str(d.get("bus_name") or "") for d in trusted}
            self._quarantine_on_bus([r for r in rejected if r["name"] not in kept])
        out = []
        for (job, batch), (incident, opened) in zip(sorted(by_job.items()), results, strict=True):
            taken_over = not opened and self._take_over(incident.id)
            out.append({"incident": incident.id, "job": job, "opened": opened, "taken_over": taken_over,
                        "alerts": len(batch)})
        return out

    def _shared_slowdowns(self, by_job: Mapping[str, list[dict[str, Any]]], roster: Roster,
                          handled: Callable[[str], bool]) -> dict[str, tuple[str, list[dict[str, Any]]]]:
        """The jobs whose batch is a slowdown every rank shares (:func:`ladder.shared_slowdown`) and that no incident
        handles: job -> (why, its alerts). Those alerts are recorded without an incident: a busy host or a slower
        input is not a straggler, and a fail-slow vote on it is an incident that could absorb a real fault."""
        out: dict[str, tuple[str, list[dict[str, Any]]]] = {}
        for job, batch in by_job.items():
            j = roster.jobs.get(job)
            if j is None or any(a.get("kind") not in ladder.SLOW for a in batch):
                continue
            if handled(job):
                continue  # they join the incident that handles the job
            topo = Topology(tp=j.tp, pp=j.pp, dp=j.dp)
            why = ladder.shared_slowdown(batch, ranks=j.tp * j.pp * j.dp, factor=self.cfg.slow_factor, topology=topo)
            out_of_step = "" if why else self._confirm_straggler(job, topo)
            if why or out_of_step:
                out[job] = (why or out_of_step, batch)
        return out

    @staticmethod
    def _observed_only(by_job: Mapping[str, list[dict[str, Any]]], handled: Callable[[str], bool]
                       ) -> dict[str, tuple[str, list[dict[str, Any]]]]:
        """The jobs whose batch holds observations only (:func:`ladder.observed_only`) and that no incident handles
        (``handled``): job -> (why, its alerts), recorded without an incident. With an incident open they join it as
        evidence."""
        out: dict[str, tuple[str, list[dict[str, Any]]]] = {}
        for job, batch in by_job.items():
            why = ladder.observed_only(batch)
            if why and not handled(job):
                out[job] = (why, batch)
        return out

    def _confirm_straggler(self, job: str, topo: Topology) -> str:
        """A fail-slow alert is a rank's claim about its own last steps; the job's machines are the evidence. One
        look at every rank's compute over its last seconds (a round of the vote, :meth:`Analysis.compute_round`):
        why no rank stands out against its stage's now, noise counted (no incident: a rank's scheduling hiccup,
        an evaluation, a busy host), or "" when one does, or the look cannot say (a machine did not answer)."""
        from trainguard.operators.control.analysis import Analysis
        from trainguard.operators.policy.runtime import SlowVoter

        try:
            taken = Analysis.sharing(self).compute_round(job)
        except TrainguardError:
            return ""
        times = {r: t for r, t in taken["times"].items() if 0 <= r < topo.world_size}
        if len(times) < topo.world_size:
            return ""
        flagged = SlowVoter(topo, rounds=1).add_round(times, factor=self.cfg.slow_factor, noise=taken["noise"],
                                                      walls=taken["walls"])
        if flagged:
            return ""
        return (f"not confirmed: no rank of {len(times)} computes above {self.cfg.slow_factor:g}x its stage's median "
                f"(beyond its steps' noise) over its last seconds; a passing slowdown, not a straggler")

    def _quarantine_on_bus(self, rejected: Sequence[Mapping[str, Any]]) -> None:
        """Move rejected alerts out of the bus's alerts folder, the reason beside them (best effort: they are
        recorded as quarantined already, and the cursor keeps them from being read again)."""
        from trainguard.node_tools.bus import BusError, open_bus

        try:
            bus = open_bus(self.inventory.bus_url)
            for r in rejected:
                if r["name"]:
                    bus.quarantine(r["name"], f"{r['name']}: {r['reason']}")
        except (BusError, OSError):
            return

    def _take_over(self, incident_id: int) -> bool:
        """An incident still being watched (a slow vote, the job training on) whose alerts now say
        something stronger gets the stronger category; its vote stops at its next round and a new
        tg_incident run handles it. Returns whether that happened."""
        inc = self.fleet.incident(incident_id)
        if inc.state != IncidentState.OPEN or inc.category not in ladder.WATCHED or any(
                a.kind not in CLAIMS for a in self.fleet.actions(incident_id)):
            return False
        t = self._triage(inc.job, incident_id)
        if not ladder.supersedes(inc.category, t):
            return False
        # atomic against the vote's claim of its verdict: exactly one of the two acts on the incident
        return self.fleet.take_over(incident_id, watched=ladder.WATCHED, category=t.category,
                                    summary=f"{inc.category} vote taken over: {t.reason}")

    def triage_again(self, incident_id: int) -> ladder.Triage:
        """Every alert of the incident triaged again, those that joined after its decision included."""
        return self._triage(self.fleet.incident(incident_id).job, incident_id)

    def not_training(self, job: str) -> str:
        """"" when the job trains: every rank finishes a step now (:meth:`trains`), or, for a job whose steps are
        longer than that wait, every machine runs it and every rank made progress (a step or a collective)
        within ``reconcile_stall_s``; else what its machines say."""
        if self.jobs.trains(job):
            return ""
        from trainguard.node_tools import launcher

        try:
            st = launcher.status(self.inventory, job, self.inventory.named(self.fleet.job(job).machine_list),
                                 transport=self.transport, brief=True)
        except TrainguardError as exc:
            return f"its machines cannot be read ({exc})"[:300]
        if st and all(d.get("state") == "exited" and d.get("returncode") == 0 for d in st.values()):
            return ""  # it finished on every machine, as a job does: nothing to bring back
        down = {m: d.get("state", "unreadable") for m, d in st.items() if d.get("state") != "running"}
        if down:
            return "not running on " + ", ".join(f"{m} ({s})" for m, s in sorted(down.items()))[:300]
        ages = [r.get("progress_age_s") for d in st.values() for r in d.get("ranks") or ()]
        if ages and all(isinstance(a, (int, float)) and a <= self.cfg.reconcile_stall_s for a in ages):
            return ""  # long steps: every rank still makes progress
        stale = max((a for a in ages if isinstance(a, (int, float))), default=None)
        return f"no step within 15s and no progress for {stale:.0f}s" if stale is not None else \
            "no step within 15s and no rank reports progress"

    def _triage(self, job_name: str, incident_id: int) -> ladder.Triage:
        job = self.fleet.job(job_name)
        alerts = [a.document for a in self.fleet.alerts_of(incident_id)]
        history = [a.document for i in self.fleet.incidents(job_name) if i.id != incident_id
                   for a in self.fleet.alerts_of(i.id) if a.kind in ladder.NETWORK]
        # the job's machines as a set: each of the incident's alerts (every rank of a hung job) is looked up in it
        return ladder.triage(job_name, alerts, job_machines=frozenset(job.machine_list), network_history=history,
                             now=max((a["ts"] for a in alerts), default=time.time()))

    def _standby_fault(self, alert: Mapping[str, Any]) -> None:
        try:
            m = self.fleet.machine(alert["machine"])
        except TrainguardError:
            return
        # an alert older than the standby's self-check (one delivered again after the machine was repaired and
        # parked: a lost event's batch emitted a minute late) speaks of the machine it was, not of this standby
        if m.state == states.STANDBY and not self.cfg.dry_run and float(alert.get("ts") or 0) >= m.state_since:
            self.fleet.transition(m.name, states.REPAIR, reason=f"{alert['kind']} while standby")

    def triage(self, incident_id: int) -> dict[str, Any]:
        """The incident's category and first decision (recorded on the incident)."""
        inc = self.fleet.incident(incident_id)
        job = self.fleet.job(inc.job)
        t = self._triage(inc.job, incident_id)
        rollback_to = self.fleet.last_known_good(inc.job, other_than=job.revision)
        d = ladder.decide(t, level=inc.level, rollback_to=rollback_to)
        if d.action in ("tolerate", "observe") and job.state == "running":
            states_now = self.jobs.progress(inc.job)["states"]
            down = sorted(n for n, st in states_now.items() if st != "running")
            if down:  # what the alerts say needs nothing, but the job is not running: a crash to diagnose
                t = ladder.Triage(inc.job, "crash", tuple(down), reason=f"{t.reason}; but the job does not run "
                                                                     f"on {', '.join(down)}")
        # the level set when the incident opened came from its first alerts; whether it repeats the job's last
        # incident is judged on this triage (its category and machines), which is also what the next one reads
        level = self.fleet.relevel(incident_id, category=t.category, machines=t.machines,
                                   window_s=self.cfg.escalation_window_s)
        d = ladder.decide(t, level=level, rollback_to=rollback_to)
        self.fleet.update_incident(incident_id, summary=f"{t.reason}; next: {d.action}")
        if d.action in ("diagnose", "analyze", "replay", "vote"):
            self.fleet.update_incident(incident_id, diagnosis_start_ts=time.time())
        return {"incident": incident_id, "job": inc.job, "level": level, "category": t.category,
                "machines": list(t.machines), "action": d.action, "reason": d.reason, "rollback_to": rollback_to,
                "diagnose": dict(d.diagnose)}

    def close(self, incident_id: int, *, outcome: str, resumed: Mapping[str, Any] | None = None,
              steps_before: int = -1, note: str = "") -> dict[str, Any]:
        """Close the incident with its timeline; ETTR events for its stretches."""
        inc = self.fleet.incident(incident_id)
        now = time.time()
        fields: dict[str, Any] = {"closed_ts": now}
        if resumed:
            fields["resumed_ts"] = resumed["ts"]
            restored = resumed.get("restored_step")
            if restored is not None and steps_before >= 0:
                fields["lost_steps"] = max(0, steps_before - restored)
        if note:
            fields["summary"] = f"{inc.summary}; {note}" if inc.summary else note
        # closed by a person or superseded by a stop or a resubmit meanwhile: theirs stands, and so do its stretches
        self.fleet.close_open(incident_id, outcome, **fields)
        inc = self.fleet.incident(incident_id)
        # a degrade path: the job trained on at reduced width through every stretch (the ledger weighs them by the
        # share of replicas that left), not stopped
        degraded = next((a.evidence for a in self.fleet.actions(incident_id) if a.kind == "degrade"
                         and a.outcome == "done"), None)
        # closed again (its restart_job cleared): the same stretches again, which the ledger keeps once
        for kind, start, end in (("detection", inc.first_alert_ts, inc.opened_ts),
                                 ("diagnosis", inc.diagnosis_start_ts, inc.decided_ts),
                                 ("recovery", inc.decided_ts, inc.resumed_ts)):
            if start is not None and end is not None and end >= start:
                if degraded is not None:
                    self.fleet.add_ettr(inc.job, "degraded", start, end, incident_id=incident_id,
                                        detail=json.dumps({"phase": kind, "width": degraded.get("width"),
                                                           "replicas": degraded.get("replicas")}))
                else:
                    self.fleet.add_ettr(inc.job, kind, start, end, incident_id=incident_id)
        return {"incident": incident_id, "state": inc.state, "timeline": self.timeline(incident_id)}

    def timeline(self, incident_id: int) -> dict[str, Any]:
        inc = self.fleet.incident(incident_id)
        return {
            "job": inc.job, "category": inc.category, "level": inc.level, "state": inc.state,
            "summary": inc.summary, "first_alert_ts": inc.first_alert_ts, "opened_ts": inc.opened_ts,
            "diagnosis_start_ts": inc.diagnosis_start_ts, "decided_ts": inc.decided_ts,
            "resumed_ts": inc.resumed_ts, "closed_ts": inc.closed_ts, "lost_steps": inc.lost_steps,
            "alerts": [f"{a.machine}:{a.kind}" for a in self.fleet.alerts_of(incident_id)],
            "actions": [{k: v for k, v in asdict_action(a).items() if k != "evidence"}
                        for a in self.fleet.actions(incident_id)],
        }

    def unhandled_faults(self, incident_id: int) -> dict[str, str]:
        """Explicit machine faults among the incident's alerts (those that joined it after its triage too) on
        machines that still serve the job: machine -> the alerts' kinds. Every one is acted on before the
        incident closes."""
        return self.jobs.faults_left(incident_id)

    def recurred(self, incident_id: int, *, since: float) -> list[Any]:
        """The incident's alerts stamped at or after ``since`` (its restart) that say the job failed again the
        way the ladder handles by restarting (a crash, a hang, a NaN, diverged parameters): the failure came
        back after the recovery. Explicit machine faults are not among them (they are pending faults, evicted
        before the incident closes), nor slowdowns (a restart's first steps are slow)."""
        kinds = ladder.CRASH | ladder.HANG | ladder.NUMERIC | ladder.SDC
        late = [a for a in self.fleet.alerts_of(incident_id, kinds=kinds) if a.ts >= since]
        if not late:
            return []
        t = ladder.triage("", [a.document for a in late])
        return late if t.category in ("crash", "hang", "nan", "sdc") else []

    def implicate(self, incident_id: int, machine: str, why: str) -> None:
        """Record that the incident's failure started on ``machine`` (its logs say so)."""
        self.fleet.record_action(f"implicate:{incident_id}:{machine}", kind="implicate", incident_id=incident_id,
                                 machines=[machine], evidence={"why": why[:300]})

    def failures_of(self, job: str, machine: str, *, other_than: int, now: float | None = None) -> list[int]:
        """The job's incidents within ``repeat_window_s`` before ``now`` (the wall clock when None) that
        implicated ``machine`` and left it in the job (a clean diagnosis, a restart in place): what makes a
        repeat offender."""
        since = (time.time() if now is None else now) - self.cfg.repeat_window_s
        return self.fleet.implicated(job, machine, since=since, other_than=other_than)

    def first_step_of(self, incident_id: int, kinds: Sequence[str]) -> int | None:
        """The earliest training step the incident's alerts of ``kinds`` name (their evidence's step)."""
        steps = [a.document.get("evidence", {}).get("step") for a in self.fleet.alerts_of(incident_id)
                 if a.kind in kinds]
        return min((s for s in steps if isinstance(s, int)), default=None)


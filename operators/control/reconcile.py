"""The reconciler's looks and what it does about a finding (:mod:`trainguard.operators.policy.reconcile` judges).

:meth:`Reconciliation.reconcile_pass` reads what should be (the fleet database: running jobs, open incidents, the
machines serving each job and when they joined) and what is (one ``tg-node job status --brief`` round over the
machines of each running job no incident handles, the guardian's view of the agents, the live tg_incident runs),
and returns the findings no incident handles yet. Its cost per pass is one SSH round per machine of those jobs
and a few queries per job. :meth:`Reconciliation.reconcile_act` turns each finding into an incident (an alert
of its kind, ``source: reconciler``, recorded through the same ingest as the bus's) or, for a stuck incident,
into a new run of it. Each finding's alert id is derived from what was observed (the machines down and their
incarnations, the step a stall stopped at, the original alert of an unhandled fault), so the same difference
is raised once, never once per pass.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Collection, Mapping, MutableMapping
from typing import TYPE_CHECKING, Any

from trainguard.core.errors import TrainguardError
from trainguard.node_tools import launcher
from trainguard.operators.control.base import Part
from trainguard.operators.fleet.states import IncidentState
from trainguard.operators.policy import ladder
from trainguard.operators.policy import reconcile as policy
from trainguard.operators.policy.reconcile import Finding, JobMemory, Look
from trainguard.operators.policy.rungs import run_id, run_start

if TYPE_CHECKING:
    from trainguard.operators.control.incidents import Incidents

#: the alert kind each finding opens its incident with
ALERT_KIND = {"job_down": "job_down", "job_stalled": "job_stalled", "job_held": "job_held",
              "agent_silent": "agent_silent"}
#: a look at a job's machines waits this long for each
LOOK_TIMEOUT_S = 10.0
#: a launch of the job started this recently and not finished is under way (an older one died with its task)
LAUNCH_IN_FLIGHT_S = 600.0
log = logging.getLogger(__name__)


def finding_alert_id(f: Finding) -> str:
    """The id of the alert a finding raises: the same observation gives the same id (recorded once)."""
    ev = f.evidence
    basis = {"job_down": lambda: [sorted(f.machines), sorted((ev.get("incarnations") or {}).items())],
             "job_stalled": lambda: [ev.get("step"), sorted((ev.get("incarnations") or {}).items())],
             "job_held": lambda: [ev.get("step"), ev.get("held"), sorted((ev.get("incarnations") or {}).items())],
             "unhandled_fault": lambda: sorted(ev.get("alerts") or []),
             "agent_silent": lambda: sorted((ev.get("since") or {}).items())}[f.kind]()
    return hashlib.sha256(repr([f.job, f.kind, basis]).encode()).hexdigest()[:32]


class Reconciliation(Part):
    """The level-triggered look behind the incidents."""

    def __init__(self, *base: Any, incidents: Incidents) -> None:
        super().__init__(*base)
        self.incidents = incidents

    def look(self, job: str) -> Look:
        """One look at ``job``'s machines (brief status: heartbeats and the process table, no history read)."""
        j = self.fleet.job(job)
        st = launcher.status(self.inventory, job, self.inventory.named(j.machine_list), transport=self.transport,
                             timeout=LOOK_TIMEOUT_S, brief=True)
        return Look.of(st, time.time())

    def reconcile_pass(self, memory: MutableMapping[str, JobMemory], *, live_runs: Collection[str] | None,
                       silent: Mapping[str, float] | None = None, now: float | None = None) -> list[Finding]:
        """Every difference no incident handles, for every job the fleet database calls running (``memory``:
        what earlier passes saw, kept by the caller). ``live_runs``: the tg_incident runs queued or running
        (None: unknown, the stuck-incident check is skipped); ``silent``: machine -> since when the guardian
        finds its agent silent."""
        now = time.time() if now is None else now
        findings: list[Finding] = []
        # a job whose incident waits for a human is looked at too: its next failure (its machines found down, a
        # fault left on one) opens an incident of its own, once after each wait (policy.waiting_blocks)
        running = [j for j in self.fleet.jobs() if j.state in ("running", "waiting_human")]
        for j in running:
            try:
                findings += self._reconcile_job(j, memory, live_runs=live_runs, silent=silent, now=now)
            except Exception as exc:  # one job's odd document must not blind the pass to the others
                log.warning("reconciler: job %s not judged this pass: %s", j.name, exc)
        # the same observation raised before (its alert is recorded): not again
        raised = self.fleet.known_alerts([finding_alert_id(f) for f in findings if f.kind != "stuck_incident"])
        return [f for f in findings if f.kind == "stuck_incident" or finding_alert_id(f) not in raised]

    def _reconcile_job(self, j: Any, memory: MutableMapping[str, JobMemory], *, live_runs: Collection[str] | None,
                       silent: Mapping[str, float] | None, now: float) -> list[Finding]:
        cfg = self.cfg
        findings: list[Finding] = []
        incidents = self.fleet.incidents(j.name)
        # incidents of the guardian's (they hold alerts): one opened by hand has a DAG of its own watching it
        open_ = [i for i in incidents if i.state == IncidentState.OPEN and self.fleet.alerts_of(i.id, limit=1)]
        if live_runs is not None and open_:
            runs = self.fleet.runs_of([i.id for i in open_])
            findings += policy.stuck_incidents(
                [{"id": i.id, "job": i.job, "opened_ts": i.opened_ts, "redrives": self._redrives(i.id),
                  "runs": runs.get(i.id, [])} for i in open_], live_runs, now, grace_s=cfg.reconcile_grace_s)
        launching = [a for a in self.fleet.in_flight(f"launch:{j.name}:")
                     if now - (a.started_ts or 0.0) < LAUNCH_IN_FLIGHT_S]
        if any(i.state == IncidentState.OPEN for i in incidents) or launching or policy.waiting_blocks(
                [(i.id, i.state) for i in incidents]):
            memory.pop(j.name, None)  # an incident (or a launch) handles the job: look afresh after it
            return findings
        try:
            look = self.look(j.name)
        except TrainguardError:
            return findings
        if look.states and all(s == "finished" for s in look.states.values()):
            return findings  # the job ended as it should on every machine: nothing to bring back
        found = policy.judge_look(j.name, look, memory.setdefault(j.name, JobMemory()),
                                  confirm_s=cfg.reconcile_confirm_s, stall_s=cfg.reconcile_stall_s)
        findings += [Finding(f.job, f.kind, f.machines, f.reason, f.incident,
                             {**f.evidence, "incarnations": dict(look.incarnations)}) for f in found]
        findings += self._unhandled(j.name, list(j.machine_list), incidents)
        if silent:
            findings += [Finding(f.job, f.kind, f.machines, f.reason, f.incident,
                                 {**f.evidence, "since": {m: silent[m] for m in f.machines}})
                         for f in policy.silent_agents(j.name, j.machine_list, silent, now)]
        return findings

    def _redrives(self, incident_id: int) -> int:
        return sum(1 for a in self.fleet.actions(incident_id) if a.kind == "redrive")

    def _unhandled(self, job: str, machines: list[str], incidents: list[Any]) -> list[Finding]:
        """Explicit machine faults on the job's machines, recorded after each joined it, in closed incidents."""
        closed = {i.id for i in incidents if i.state in (IncidentState.RESOLVED, IncidentState.FAILED)}
        joined = self.fleet.joined_ts(machines)
        since = min(joined.values(), default=0.0)
        faults = [{"id": a.id, "machine": a.machine, "kind": a.kind, "ts": a.ts, "incident": a.incident_id}
                  for a in self.fleet.alerts_on(machines, kinds=ladder.EXPLICIT | ladder.XID, since=since)
                  if a.incident_id in closed and ladder.triage("", [a.document]).category == "machine_fault"
                  # its own copy raised before is not a fault of its own: the original is raised once
                  and (a.document.get("evidence") or {}).get("source") != "reconciler"]
        return policy.unhandled_faults(job, faults, joined)

    # ---- acting on what a pass found ----------------------------------------------------------------------
    def reconcile_act(self, findings: list[Finding]) -> dict[str, Any]:
        """Each finding handled: an incident opened with its alert (the ladder decides from there), or a stuck
        incident's next run (after :data:`~trainguard.operators.policy.reconcile.MAX_REDRIVES` runs, it waits
        for a human). Returns ``{"starts": [...the tg_incident runs to start], "done": [one line each]}``;
        acting on the same findings again changes nothing."""
        from trainguard.node_tools.alerts import Alert

        starts: list[dict[str, Any]] = []
        done: list[str] = []
        alerts: list[dict[str, Any]] = []
        for f in findings:
            if f.kind == "stuck_incident":
                step = self._redrive(int(f.incident or 0), f.reason, int(f.evidence.get("redrives", 0)))
                done.append(step["line"])
                starts += step["starts"]
                continue
            for machine in f.machines:
                # an unhandled fault is raised again as the kind it was recorded as
                kind = ALERT_KIND.get(f.kind) or next(iter(f.evidence.get("kinds") or ()), "gpu_lost")
                a = Alert(kind, machine, severity="fault", job=f.job, ts=time.time(),
                          evidence={**{k: v for k, v in f.evidence.items() if k != "states"}, "source": "reconciler",
                                    "reason": f.reason[:500]})
                doc = a.record()
                doc["id"] = finding_alert_id(f) if machine == f.machines[0] else \
                    hashlib.sha256(f"{finding_alert_id(f)}:{machine}".encode()).hexdigest()[:32]
                doc["received_ts"] = doc["ts"]
                alerts.append(doc)
            done.append(f.reason)
        if alerts:
            for item in self.incidents.ingest(alerts, reader="reconciler"):
                if item["opened"] or item["taken_over"]:  # as the guardian starts them
                    taken = self.fleet.incident(item["incident"]).category if item["taken_over"] else ""
                    starts.append(run_start(item["incident"], item["job"], run_id(item["incident"], taken)))
        return {"starts": starts, "done": done}

    def _redrive(self, incident_id: int, why: str, n: int) -> dict[str, Any]:
        """The next run of an open incident whose run ended without closing it (``n`` runs of it were started
        again when it was found: acting on the same finding twice starts one), or a human after
        :data:`MAX_REDRIVES` of them."""
        inc = self.fleet.incident(incident_id)
        if inc.state != IncidentState.OPEN:
            return {"line": f"incident {incident_id} is {inc.state} now: nothing to do", "starts": []}
        if n >= policy.MAX_REDRIVES:
            reason = (f"{why}; {n} runs of it were started again and none closed it; next: read the failed "
                      f"tasks' logs of its runs (incident__{incident_id}...), fix what fails, then clear the "
                      f"failed task or resolve the incident")
            self.fleet.wait_for_human(incident_id, reason[:1500])
            return {"line": f"incident {incident_id}: waits for a human after {n} runs started again", "starts": []}
        rid = run_id(incident_id, f"redrive{n + 1}")
        action, created = self.fleet.record_action(f"redrive:{incident_id}:{n + 1}", kind="redrive",
                                                   incident_id=incident_id, evidence={"why": why[:500], "run": rid})
        if not created:  # another act on the same finding got there first
            return {"line": f"incident {incident_id}: run {rid} started already", "starts": []}
        self.fleet.finish_action(action.id, "done")
        self.fleet.update_incident(incident_id, summary=f"{inc.summary}; its run ended without closing it: "
                                                        f"run {rid} started"[-2000:])
        return {"line": f"incident {incident_id}: run {rid} started ({why})",
                "starts": [run_start(incident_id, inc.job, rid)]}

"""Train through the loss of a data-parallel replica: an incident confined to some replica groups of a job run as
replica groups (its spec's ``replicas``) takes those groups out, swaps their machines for warm standbys and starts
the groups there, where they heal from a live replica, while the other groups never stop
(:mod:`trainguard.operators.policy.degrade` says when; :mod:`trainguard.replicas` is the job's side)."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from trainguard.core.errors import TrainguardError
from trainguard.node_tools import launcher
from trainguard.operators.control.base import Part
from trainguard.operators.control.jobs import _verdict, held_copies
from trainguard.operators.policy import degrade

if TYPE_CHECKING:
    from trainguard.operators.control.evictions import Evictions
    from trainguard.operators.control.jobs import Jobs

#: seconds before the first alert from which the stopped group's logs are read for the verdict
LOGS_BEFORE_S = 120.0


class Degrade(Part):
    """The degrade path of an incident (see the module)."""

    def __init__(self, *base: Any, jobs: Jobs, evictions: Evictions) -> None:
        super().__init__(*base)
        self.jobs = jobs
        self.evictions = evictions

    def degrade_plan(self, decision: Mapping[str, Any]) -> degrade.DegradePlan | None:
        """The path the incident's ``decision`` (an :class:`~trainguard.operators.models.IncidentDecision` document)
        takes on its job: None when the job is not run as replica groups, or its spec turned the degrade path off
        (every incident then stops the whole job)."""
        from trainguard.operators.jobspec import replica_groups

        prior = next((a for a in self.fleet.actions(int(decision["incident"])) if a.kind == "degrade"
                      and a.outcome in ("done", "stop_world")), None)
        if prior is not None:  # the rung's task run again: the path it took (its machines may have been swapped since)
            ev = prior.evidence
            return degrade.DegradePlan(str(ev["path"]), tuple(ev["replicas"]), tuple(ev.get("machines") or ()),
                                       float(ev["width"]), str(ev["reason"]))
        j = self.fleet.job(decision["job"])
        groups = replica_groups(j, degrading=True)
        if groups is None:
            return None
        at = {name: i for i, name in enumerate(j.machine_list)}
        return degrade.plan(j.topology, category=str(decision["category"]), action=str(decision["action"]),
                            machines=[at[m] for m in decision.get("machines") or () if m in at],
                            level=int(decision.get("level") or 0), min_replicas=groups.min_replicas)

    def take_out(self, incident_id: int, p: degrade.DegradePlan) -> dict[str, Any]:
        """Take ``p``'s replica groups out while the others train on: stop the groups on their machines (reading
        their logs in the same sessions), swap those machines for warm standbys (the whole group: over-evicted,
        the pool checks them before they serve again; in place when no standby is free), and start the groups
        there; each heals from a live replica before it trains. Returns ``{"degraded": ...}``: the groups, the
        machines that left and those that serve them now, when they were started (the resume check's clock);
        ``{"stop_world": why}`` when the groups' logs blame the job's own code (every replica runs it: the ladder's
        rung takes over). Done once per incident: asked again, it answers what was done."""
        inc = self.fleet.incident(incident_id)
        job = self.fleet.job(inc.job)
        names = [job.machine_list[i] for i in p.machines]
        key = f"degrade:{incident_id}:{','.join(map(str, p.replicas))}"
        action, created = self.fleet.record_action(
            key, kind="degrade", incident_id=incident_id, machines=names, dry_run=self.cfg.dry_run,
            evidence={"path": p.path, "replicas": list(p.replicas), "machines": list(p.machines), "width": p.width,
                      "reason": p.reason})
        if not created and action.outcome in ("done", "stop_world"):
            return json.loads(action.detail or "{}")
        if self.cfg.dry_run:
            self.fleet.finish_action(action.id, "dry_run", p.reason)
            return {"degraded": {"replicas": list(p.replicas), "left": names, "dry_run": True}}
        since = (inc.first_alert_ts or time.time()) - LOGS_BEFORE_S
        results = launcher.stop_sessions(self.inventory, inc.job, self.inventory.named(names),
                                         grace_s=self.cfg.stop_grace_s, transport=self.transport, logs_since=since,
                                         copies=True)
        verdict = _verdict({n: r.reachable and ((r.answer() or {}).get("logs") or {}).get("verdict")
                            for n, r in results.items()})
        if verdict["verdict"] == "user_code":
            out = {"stop_world": f"the logs of replica(s) {', '.join(map(str, p.replicas))} blame the job's own code, "
                                 f"which every replica runs: the whole job stops"}
            self.fleet.finish_action(action.id, "stop_world", json.dumps(out))
            return out
        copies = {n: held_copies((r.answer() or {}).get("copies")) if r.ok else None for n, r in results.items()}

        def waiting(ev: Mapping[str, Any]) -> dict[str, Any]:  # an eviction that waits for a human
            self.fleet.finish_action(action.id, "failed", str(ev.get("reason", ""))[:900])
            return {"degraded": {"replicas": list(p.replicas), "left": names, "waiting_human": True,
                                 "reason": ev.get("reason", "")}}

        swaps: dict[str, str] = {}
        why = f"degrade: {p.reason}"
        if len(self.evictions.pool()) >= len(names):
            ev = self.evictions.evict(incident_id, names, reason=why, copies=copies)
            if ev.get("waiting_human"):  # the breaker, or the checkpoints: the others train on meanwhile
                return waiting(ev)
            swaps = dict(ev.get("swaps") or {})
        serving = [swaps.get(n, n) for n in names]
        attempts = max(1, self.cfg.restart_attempts)
        for attempt in range(attempts):
            try:
                started_ts, warm = self._start_groups(incident_id, inc.job, p, serving)
                break
            except launcher.PartsFailed as exc:
                # a standby that fails to start (broken, gone) is replaced by the next, as a restart's would be;
                # out of standbys or tries, the whole job goes the ladder's way (its restart has its own retries)
                bad = sorted(n for n in exc.failed if n in serving and n not in names)
                if attempt + 1 >= attempts or not bad or len(self.evictions.pool()) < len(bad):
                    out = {"stop_world": f"the replica group(s) did not start on {', '.join(serving)} ({exc}); the "
                                         f"whole job restarts instead"[:900]}
                    self.fleet.finish_action(action.id, "stop_world", json.dumps(out))
                    return out
                ev = self.evictions.evict(incident_id, bad, breaker=False, reason="failed to start: " + "; ".join(
                    exc.failed[n] for n in bad)[:300])
                if ev.get("waiting_human"):
                    return waiting(ev)
                serving = [(ev.get("swaps") or {}).get(n, n) for n in serving]
        swaps = {old: new for old, new in zip(names, serving, strict=True) if old != new}
        out = {"degraded": {"replicas": list(p.replicas), "width": p.width, "left": names, "machines": serving,
                            "swaps": swaps, "in_place": not swaps, "warm": warm, "restart_ts": started_ts,
                            "reason": p.reason, "logs": verdict["verdict"]}}
        self.fleet.finish_action(action.id, "done", json.dumps(out))
        self.fleet.update_incident(incident_id, decided_ts=started_ts)
        return out

    def _start_groups(self, incident_id: int, job: str, p: degrade.DegradePlan, serving: list[str]
                      ) -> tuple[float, list[str]]:
        """Start ``p``'s replica groups on ``serving`` (an action of the incident): when, and which started warm."""
        plan = self.jobs.plan_launch(job, set(), warm_if_parked=True)
        # a kind of its own: a launch of the whole job is what a cleared restart_job repeats (restart_again)
        launch, _ = self.fleet.record_action(f"replica_launch:{job}:{incident_id}:{','.join(serving)}",
                                             kind="replica_launch", incident_id=incident_id, machines=serving,
                                             evidence={"replicas": list(p.replicas), "port": plan.master_port})
        started_ts = time.time()
        try:
            docs = launcher.launch(self.inventory, plan, transport=self.transport, only=serving)
            self.jobs.running_or_end(job, serving)  # a stop that crossed this start ends it again
        except TrainguardError as exc:
            self.fleet.finish_action(launch.id, "failed", str(exc)[:900])
            raise
        warm = sorted(n for n, d in docs.items() if d.get("warm"))
        self.fleet.finish_action(launch.id, "done", f"replica(s) {', '.join(map(str, p.replicas))} started on "
                                                    f"{', '.join(serving)} (warm: {', '.join(warm) or 'none'})",
                                 evidence={"warm": warm})
        return started_ts, warm


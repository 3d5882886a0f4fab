"""The recovery workflow as plain Python: what each task of ``tg_guardian`` / ``tg_incident`` /
``tg_diagnose`` does, with no Airflow import (the DAGs call these methods and pass their results on).

A :class:`Controller` holds the fleet database, the inventory and a transport (the NodeHook's SSH
sessions in Airflow; the inventory's own transport elsewhere). Every method that changes fleet state
goes through :class:`operators.fleet.store.FleetStore` (one transaction, idempotent), records an
action with its evidence, and in dry-run mode records the decision without acting.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from node_tools import launcher
from node_tools.errors import TrainguardError
from node_tools.inventory import Inventory, Machine
from node_tools.logs import UNRESTORABLE_KIND
from node_tools.topology import Topology
from node_tools.transport import RunResult, Transport, transport_for
from operators.fleet import FleetStore, states
from operators.fleet.store import OPEN_INCIDENT_STATES
from operators.policy import ettr, ladder, runtime, sdc
from operators.settings import ControlSettings

ROLE_STATE = {"active": states.STANDBY, "standby": states.STANDBY, "free": states.PROVISIONING,
              "evicted": states.REPAIR}
PORT_BASE = 29400
PORT_SPAN = 400
REPLAY_PORT_BASE = 29900  # a replay's groups rendezvous on 29900.. (the job uses 29400..29799)


# The control plane's settings (one typed, bounded object read from TG_* variables): see operators.settings.
ControlConfig = ControlSettings


class Controller:
    """The control plane's actions on one fleet."""

    def __init__(self, config: ControlConfig, *, transport: Transport | None = None,
                 inventory: Inventory | None = None) -> None:
        self.cfg = config
        self.inventory = inventory or Inventory.load(Path(config.inventory))
        self.transport = transport or transport_for(self.inventory)
        self.fleet = FleetStore(config.fleet_url)
        # what this controller's last stop of each job found when it ended the job everywhere: its machines
        # and the lowest step every rank finished; a restart right after needs no round of reads
        self._stopped: dict[str, dict[str, Any]] = {}
        # the checkpoint copies each machine of a job held when this controller last stopped it
        self._copies: dict[str, dict[str, list[tuple[str, int, int]] | None]] = {}

    # ---- fleet and jobs ---------------------------------------------------------------------------
    def sync_inventory(self) -> list[str]:
        """Register the inventory's machines that the fleet database does not know yet."""
        added = []
        for m in self.inventory.machines:
            if self.fleet.register_machine(m.name, address=m.address, state=ROLE_STATE.get(m.role, states.STANDBY),
                                           reason=f"from the inventory (role {m.role})"):
                added.append(m.name)
        return added

    def machines(self, names: Sequence[str]) -> list[Machine]:
        return [self.inventory.machine(n) for n in names]

    def topology(self, job: str) -> Topology:
        j = self.fleet.job(job)
        return Topology(j.tp, j.pp, j.dp, ranks_per_machine=j.ranks_per_machine)

    def launch_job(self, job: str, topology: Topology, machine_names: Sequence[str], *,
                   train_args: Sequence[str] = (), revision: str = "r0", arm: bool = True,
                   warm: Sequence[str] = ()) -> dict[str, Any]:
        """Record a job in the fleet database and start it on ``machine_names`` (node-rank order); the
        machines in ``warm`` (parked beforehand, as standbys are) start on their warm interpreters. With
        ``arm``, then park warm interpreters beside it on every machine (:meth:`arm`)."""
        self.sync_inventory()
        self.fleet.upsert_job(job, tp=topology.tp, pp=topology.pp, dp=topology.dp,
                              ranks_per_machine=topology.ranks_per_machine, machines=machine_names,
                              revision=revision, train_args=train_args)
        out = self._start(job, warm=set(warm) & set(machine_names))
        if arm and out.get("launched"):
            out["armed"] = self.arm(job)
        return out

    def arm(self, job: str) -> dict[str, Any]:
        """Park warm interpreters (one per rank and one for torchrun) on every machine of the job that has
        none ready, so the next restart starts every part warm, survivors included, as a standby's does.
        They idle beside the running job (memory, no CPU). Best effort: a machine that cannot park
        restarts cold. Returns ``{"parked": [...], "failed": {machine: why}}``."""
        j = self.fleet.job(job)
        if self.cfg.dry_run:
            return {"parked": [], "failed": {}, "dry_run": True}
        ready = self.parked(j.machine_list)
        todo = [n for n in j.machine_list if n not in ready]
        results = self._run(self.machines(todo), lambda m: [self.inventory.tg_node, "standby", "park", "--nproc",
                                                              str(j.ranks_per_machine)], timeout=300)
        return {"parked": sorted(ready | {n for n, r in results.items() if r.ok}),
                "failed": {n: r.describe() for n, r in results.items() if not r.ok}}

    def _plan(self, job: str, warm: set[str], extra_args: Sequence[str] = (), *, warm_if_parked: bool = False
              ) -> launcher.JobPlan:
        j = self.fleet.job(job)
        launches = sum(1 for a in self.fleet.actions() if a.kind == "launch" and a.key.startswith(f"launch:{job}:"))
        return launcher.JobPlan(job=job, topology=self.topology(job), machines=self.machines(j.machine_list),
                                train_args=[*j.train_args, *extra_args], master_port=PORT_BASE + launches % PORT_SPAN,
                                revision=j.revision, warm=warm, warm_if_parked=warm_if_parked)

    def _start(self, job: str, *, warm: set[str] | None = None, warm_if_parked: bool = False,
               incident_id: int | None = None, restore_max_step: int | None = None, tag: str = "") -> dict[str, Any]:
        """Launch the job on its machine list: those in ``warm`` on their parked interpreters; with
        ``warm_if_parked``, every other one on its parked interpreters if it has them, else cold."""
        warm = set(warm or ())
        self._stopped.pop(job, None)  # what a stop found no longer holds once the job runs again
        self._copies.pop(job, None)
        j = self.fleet.job(job)
        if j.pending_revision:  # a lazy code update waits for the next restart: this one
            self.fleet.set_revision(job, j.pending_revision)
        # this launch only: later restarts restore the newest step again
        extra = ["--restore-max-step", str(restore_max_step)] if restore_max_step is not None else []
        plan = self._plan(job, warm, extra, warm_if_parked=warm_if_parked)
        tag = tag or (str(incident_id) if incident_id is not None else "initial")
        key = f"launch:{job}:{tag}:{','.join(j.machine_list)}"
        action, created = self.fleet.record_action(key, kind="launch", incident_id=incident_id,
                                                   machines=j.machine_list, dry_run=self.cfg.dry_run,
                                                   evidence={"revision": plan.revision, "port": plan.master_port,
                                                             "warm": sorted(warm), "warm_if_parked": warm_if_parked,
                                                             "restore_max_step": restore_max_step})
        if not created and action.outcome == "done":
            return {"launched": False, "reason": "already launched", "machines": j.machine_list}
        if self.cfg.dry_run:
            return {"launched": False, "dry_run": True, "machines": j.machine_list}
        try:
            docs = launcher.launch(self.inventory, plan, transport=self.transport)
        except TrainguardError as exc:
            self.fleet.finish_action(action.id, "failed", str(exc))
            raise
        started_warm = sorted(n for n, d in docs.items() if n in warm or d.get("warm"))
        self.fleet.finish_action(action.id, "done", f"started on {', '.join(j.machine_list)}"
                                                    f" (warm: {', '.join(started_warm) or 'none'})",
                                 evidence={"warm": started_warm})
        self.fleet.set_job_state(job, "running")
        return {"launched": True, "machines": j.machine_list, "port": plan.master_port, "warm": started_warm,
                "incarnations": {n: d.get("incarnation") for n, d in docs.items()}}

    def start(self, job: str) -> dict[str, Any]:
        """Start the job again on its machine list (an operator's start of a job stopped by hand): on warm
        interpreters where they are parked, restoring its newest committed checkpoint. Each call is a launch
        of its own (recorded); stop the job first when it runs."""
        starts = sum(1 for a in self.fleet.actions() if a.key.startswith(f"launch:{job}:start-"))
        return self._start(job, warm_if_parked=True, tag=f"start-{starts + 1}")

    def hot_update(self, job: str, revision: str, *, reason: str = "") -> dict[str, Any]:
        """Switch the job to ``revision`` now, in place: stop it, record the revision, start it again on
        the same machines (on their parked warm interpreters where there are some; nothing rescheduled),
        restoring its newest committed checkpoint. Repeating it is a no-op."""
        self.fleet.record_revision(job, revision, reason=reason)
        if self.fleet.job(job).revision == revision:
            return {"updated": False, "job": job, "reason": f"job {job} already runs {revision}"}
        stopped = self.stop(job)
        # the steps every rank finished: what the stop found (no more come after it)
        before = self._stopped.pop(job, None) or self.progress(job)
        self.fleet.set_revision(job, revision)
        machines = self.fleet.job(job).machine_list
        restart_ts = time.time()
        updates = sum(1 for a in self.fleet.actions() if a.key.startswith(f"launch:{job}:update-"))
        started = self._start(job, warm_if_parked=True, tag=f"update-{updates + 1}-{revision}")
        return {"updated": bool(started.get("launched")), "job": job, "revision": revision, "machines": machines,
                "stopped": stopped, "started": started, "warm": started.get("warm", []),
                "steps_before": before.get("step", -1), "restart_ts": restart_ts}

    # ---- guardian: alerts -> incidents ------------------------------------------------------------
    def job_of(self, alert: Mapping[str, Any]) -> str | None:
        if alert.get("job"):
            try:
                return self.fleet.job(alert["job"]).name
            except TrainguardError:
                return None
        try:
            return self.fleet.machine(alert["machine"]).job
        except TrainguardError:
            return None

    def untrusted(self, alert: Mapping[str, Any], jobs: Mapping[str, Any]) -> str:
        """Why an alert read off the bus must not be acted on ("" when it may): a machine the inventory does not
        list, a job the fleet does not know, a machine that does not serve the job it names, a rank outside
        the job. ``jobs``: the fleet's jobs by name."""
        machine, job_name = str(alert.get("machine", "")), str(alert.get("job") or "")
        if machine not in self.inventory.names():
            return f"machine {machine[:63]!r} is not in the inventory"
        if not job_name:
            return ""
        job = jobs.get(job_name)
        if job is None:
            return f"job {job_name[:64]!r} is not in the fleet database"
        if machine not in job.machine_list:
            return f"machine {machine} does not serve job {job_name} ({', '.join(job.machine_list)})"
        rank = alert.get("rank")
        if isinstance(rank, int) and not 0 <= rank < job.tp * job.pp * job.dp:
            return f"rank {rank} is outside job {job_name}'s {job.tp * job.pp * job.dp} ranks"
        return ""

    def ingest(self, alerts: Sequence[Mapping[str, Any]], *, reader: str = "guardian",
               read: Mapping[str, float] | None = None, gone: Sequence[str] = (),
               quarantined: Sequence[Mapping[str, Any]] = (),
               liveness: Mapping[str, Mapping[str, Any]] | None = None) -> list[dict[str, Any]]:
        """Group a batch by job and attach it to the job's open incident (or open one), in one transaction
        with the bus cursor (``read``, ``gone``: see :meth:`operators.fleet.store.FleetStore.ingest`), the
        documents the reader ``quarantined`` and the agents' ``liveness``. An alert naming a machine or a job
        the inventory and the fleet do not know (or a machine that does not serve the job it names) is
        quarantined with the reason and never acted on; one whose writer's clock is off (``clock_skew_s``)
        counts from when it arrived. Alerts about machines serving no job are recorded against nothing; an
        explicit fault on a standby sends it to repair. Returns ``[{incident, job, opened, taken_over,
        alerts}]`` for the incidents to work on."""
        by_job: dict[str, list[dict[str, Any]]] = {}
        rejected: list[dict[str, Any]] = []
        known = self.fleet.known_alerts([str(a["id"]) for a in alerts])
        jobs = {j.name: j for j in self.fleet.jobs()}
        for a in alerts:
            if str(a["id"]) in known:
                continue  # delivered again after a failed guardian run: recorded already
            why = self.untrusted(a, jobs)
            if why:
                rejected.append({"name": a.get("bus_name") or "", "reason": why, "machine": str(a.get("machine", "")),
                                 "kind": a.get("kind", ""), "ts": a.get("received_ts") or time.time(),
                                 "document": dict(a)})
                continue
            doc = dict(a)
            if doc.get("clock_skew_s") is not None and doc.get("received_ts") is not None:
                doc["sent_ts"], doc["ts"] = doc["ts"], doc["received_ts"]  # handled by its arrival time
            job = self.job_of(doc)
            if job is not None:
                by_job.setdefault(job, []).append(doc)
            elif ladder.triage("", [doc]).category == "machine_fault":
                self._standby_fault(doc)
        results = self.fleet.ingest(by_job, escalation_window_s=self.cfg.escalation_window_s, reader=reader,
                                    read=dict(read or {}), gone=list(gone),
                                    quarantined=[*quarantined, *rejected],
                                    liveness={m: dict(v) for m, v in liveness.items()} if liveness else None)
        if rejected:
            self._quarantine_on_bus(rejected)
        out = []
        for (job, batch), (incident, opened) in zip(sorted(by_job.items()), results, strict=True):
            taken_over = not opened and self._take_over(incident.id)
            out.append({"incident": incident.id, "job": job, "opened": opened, "taken_over": taken_over,
                        "alerts": len(batch)})
        return out

    def _quarantine_on_bus(self, rejected: Sequence[Mapping[str, Any]]) -> None:
        """Move rejected alerts out of the bus's alerts folder, the reason beside them (best effort: they are
        recorded as quarantined already, and the cursor keeps them from being read again)."""
        from node_tools.bus import BusError, open_bus

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
        if inc.state != "open" or inc.category not in ladder.WATCHED or self.fleet.actions(incident_id):
            return False
        t = self._triage(inc.job, incident_id)
        if not ladder.supersedes(inc.category, t):
            return False
        # atomic against the vote's claim of its verdict: exactly one of the two acts on the incident
        return self.fleet.take_over(incident_id, watched=ladder.WATCHED, category=t.category,
                                    summary=f"{inc.category} vote taken over: {t.reason}")

    def _triage(self, job_name: str, incident_id: int) -> ladder.Triage:
        job = self.fleet.job(job_name)
        alerts = [a.document for a in self.fleet.alerts_of(incident_id)]
        history = [a.document for i in self.fleet.incidents(job_name) if i.id != incident_id
                   for a in self.fleet.alerts_of(i.id) if a.kind in ladder.NETWORK]
        return ladder.triage(job_name, alerts, job_machines=job.machine_list, network_history=history,
                             now=max((a["ts"] for a in alerts), default=time.time()))

    def _standby_fault(self, alert: Mapping[str, Any]) -> None:
        try:
            m = self.fleet.machine(alert["machine"])
        except TrainguardError:
            return
        if m.state == states.STANDBY and not self.cfg.dry_run:
            self.fleet.transition(m.name, states.REPAIR, reason=f"{alert['kind']} while standby")

    # ---- incident: triage ---------------------------------------------------------------------------
    def triage(self, incident_id: int) -> dict[str, Any]:
        """The incident's category and first decision (recorded on the incident)."""
        inc = self.fleet.incident(incident_id)
        job = self.fleet.job(inc.job)
        t = self._triage(inc.job, incident_id)
        rollback_to = self.fleet.last_known_good(inc.job, other_than=job.revision)
        d = ladder.decide(t, level=inc.level, rollback_to=rollback_to)
        if d.action in ("tolerate", "observe") and job.state == "running":
            states_now = self.progress(inc.job)["states"]
            down = sorted(n for n, st in states_now.items() if st != "running")
            if down:  # what the alerts say needs nothing, but the job is not running: a crash to diagnose
                t = ladder.Triage(inc.job, "crash", tuple(down), reason=f"{t.reason}; but the job does not run "
                                                                     f"on {', '.join(down)}")
                d = ladder.decide(t, level=inc.level, rollback_to=rollback_to)
        self.fleet.update_incident(incident_id, category=t.category, summary=f"{t.reason}; next: {d.action}")
        if d.action in ("diagnose", "analyze", "replay", "vote"):
            self.fleet.update_incident(incident_id, diagnosis_start_ts=time.time())
        return {"incident": incident_id, "job": inc.job, "level": inc.level, "category": t.category,
                "machines": list(t.machines), "action": d.action, "reason": d.reason, "rollback_to": rollback_to,
                "diagnose": dict(d.diagnose)}

    # ---- no decision may destroy the last copy of a checkpoint ------------------------------------------
    def remote_url(self, job: str) -> str:
        """The job's remote checkpoint tier (its ``--checkpoint-remote`` / ``--checkpoint-s3``), or ""."""
        args = list(self.fleet.job(job).train_args)
        for i, a in enumerate(args):
            for flag in ("--checkpoint-remote", "--checkpoint-s3"):
                if a == flag and i + 1 < len(args):
                    return args[i + 1]
                if a.startswith(flag + "="):
                    return a.split("=", 1)[1]
        return ""

    def remote_copies(self, url: str) -> tuple[set[tuple[int, int]], str]:
        """The ``(step, rank)`` copies in a remote tier, and why not ("" when it answered)."""
        from checkpoint.errors import S3TierError
        from checkpoint.s3 import open_tier

        try:
            tier = open_tier(url, endpoint_url=os.environ.get("TG_S3_ENDPOINT_URL", ""), timeout_s=5.0)
            return set(tier.list_copies()), ""
        except S3TierError as exc:
            return set(), str(exc)

    def copies(self, job: str, names: Sequence[str]) -> dict[str, list[tuple[str, int, int]] | None]:
        """The checkpoint copies each of ``names`` holds (``(tier, step, rank)``; None: it did not answer): from
        the stop this controller just made, else read now (``tg-node ckpt list``)."""
        known = self._copies.get(job) or {}
        if all(n in known for n in names):
            return {n: known[n] for n in names}
        results = self._run(self.machines(names), lambda m: [self.inventory.tg_node, "ckpt", "list", "--job", job],
                            timeout=30)
        out: dict[str, list[tuple[str, int, int]] | None] = {}
        for n, r in results.items():
            doc = r.answer()
            if r.ok:
                out[n] = _held((doc or {}).get("copies"))
            elif doc is not None and "no checkpoint root" in str(doc.get("error", "")):
                out[n] = []
            else:
                out[n] = None
        return out

    def protect_checkpoints(self, job: str, evict: Sequence[str], *, fresh: bool = False, force: bool = False,
                            max_step: int | None = None) -> dict[str, Any]:
        """Before evicting ``evict``: every rank of the step the job will restore must keep a copy on a machine
        that stays or in the remote tier. If not, the missing copies are rescued from the evicted machines
        (reachable ones) into the remote tier first; failing that the restart falls back to the newest step
        that stays complete; failing that the eviction is ``refused`` (it would destroy the job's progress).
        Returns what was found and done, for the eviction's evidence."""
        from operators.policy.checkpoints import eviction_safety

        j = self.fleet.job(job)
        if "--checkpoint" not in j.train_args:
            return {"checked": False, "reason": "the job keeps no checkpoints"}
        world = j.tp * j.pp * j.dp
        if fresh:
            self._copies.pop(job, None)
        names = [*j.machine_list, *(n for n in evict if n not in j.machine_list and n in self.inventory.names())]
        copies = self.copies(job, names)
        if max_step is not None:  # the restart restores no newer step: only those count
            copies = {n: None if c is None else [x for x in c if x[1] <= max_step] for n, c in copies.items()}
        url = self.remote_url(job)
        remote, remote_error = self.remote_copies(url) if url else (set(), "no remote tier")
        if max_step is not None:
            remote = {x for x in remote if x[0] <= max_step}
        safety = eviction_safety(copies, remote, evict=evict, world_size=world)
        out: dict[str, Any] = {"step": safety.step, "safe": safety.safe, "reason": safety.reason,
                               "unanswered": sorted(n for n, c in copies.items() if c is None)}
        if force and safety.step is not None:  # the listing said safe, the restore said otherwise: take them all
            held = {n: sorted({r for _t, st, r in copies.get(n) or () if st == safety.step}) for n in evict}
            safety = dataclasses.replace(safety, lacking=tuple(sorted({r for rs in held.values() for r in rs})),
                                         rescue={n: rs for n, rs in held.items() if rs})
        elif safety.safe:
            return out
        why = remote_error or "nothing to rescue from"
        if url and safety.rescue and not self.cfg.dry_run:
            env = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}
            step = str(safety.step)
            done = self._run(self.machines(sorted(safety.rescue)), lambda m: [
                self.inventory.tg_node, "ckpt", "rescue", "--job", job, "--step", step, "--to", url,
                "--endpoint-url", os.environ.get("TG_S3_ENDPOINT_URL", "")], timeout=600, env=env)
            out["rescued"] = {n: [u["rank"] for u in (r.answer() or {}).get("uploaded", [])] if r.ok else r.describe()
                              for n, r in done.items()}
            remote, remote_error = self.remote_copies(url)
            remote = {x for x in remote if max_step is None or x[0] <= max_step}
            again = eviction_safety(copies, remote, evict=evict, world_size=world)
            if again.step == safety.step and again.safe and all(isinstance(v, list) and v
                                                                for v in out["rescued"].values()):
                out.update(safe=True, reason=f"step {safety.step}: the last copies of rank(s) {list(safety.lacking)} "
                                             f"were rescued from {', '.join(sorted(safety.rescue))} to the remote tier")
                return out
            why = "; ".join(f"{n}: {v}" for n, v in out["rescued"].items() if isinstance(v, str)) or remote_error \
                or "the rescued copies are not in the remote tier"
        if safety.fallback is not None:
            out.update(fallback=safety.fallback,
                       reason=f"{safety.reason}; they could not be rescued ({why}); the job restarts from step "
                              f"{safety.fallback}, the newest step complete without them")
            return out
        out["refused"] = (f"{safety.reason}; they could not be rescued ({why}) and no older step is complete "
                          f"without them: evicting would destroy the job's progress; bring those machines (or a copy "
                          f"of their checkpoints) back, then resolve the incident")
        return out

    # ---- a recovery that did not hold -----------------------------------------------------------------
    def job_logs(self, job: str) -> dict[str, dict[str, Any] | None]:
        """Each machine's ``tg-node logs --job J`` (None: it did not answer)."""
        names = self.fleet.job(job).machine_list
        results = self._run(self.machines(names), lambda m: [self.inventory.tg_node, "logs", "--job", job],
                            timeout=60)
        return {n: (r.answer() if r.reachable and not r.timed_out else None) for n, r in results.items()}

    def before_retry(self, incident_id: int, why: str) -> dict[str, Any]:
        """What to change before restarting a recovery that did not hold (``why``): explicit faults that joined
        the incident are evicted; machines that no longer answer are replaced; when no step could be restored,
        the last copies are rescued from the incident's evicted machines into the remote tier; when the job's
        own code failed, it rolls back to the last known-good revision; else it is tried again as it is (a
        transient failure). Returns ``{"did": what}``, or ``{"give_up": why}`` when nothing is left to try."""
        inc = self.fleet.incident(incident_id)
        job = inc.job
        pending = self.unhandled_faults(incident_id)
        if pending:
            self.stop(job)
            ev = self.evict(incident_id, sorted(pending), reason="explicit machine fault that joined the "
                            "incident: " + "; ".join(f"{m}: {k}" for m, k in pending.items()))
            return {"give_up": ev["reason"]} if ev.get("waiting_human") else \
                {"did": "evicted " + ", ".join(f"{a} -> {b}" for a, b in (ev.get("swaps") or {}).items())}
        logs = self.job_logs(job)
        silent = sorted(n for n, doc in logs.items() if doc is None)
        if silent:
            self.stop(job)
            ev = self.evict(incident_id, silent, reason=f"unreachable after the restart ({why[:200]})")
            return {"give_up": ev["reason"]} if ev.get("waiting_human") else \
                {"did": "replaced unreachable " + ", ".join(f"{a} -> {b}" for a, b in (ev.get("swaps") or {}).items())}
        if any((doc or {}).get("verdict", {}).get("kind") == UNRESTORABLE_KIND for doc in logs.values()):
            evicted = sorted({m for a in self.fleet.actions(incident_id) if a.kind == "evict" and a.outcome == "done"
                              for m in a.machines})
            if not evicted:
                return {"give_up": f"no step can be restored on all ranks and this incident evicted no machine that "
                                   f"could hold the missing copies ({why[:300]})"}
            kept = self.protect_checkpoints(job, evicted, fresh=True, force=True)
            if kept.get("rescued") and kept.get("safe"):
                return {"did": kept["reason"]}
            return {"give_up": f"no step can be restored on all ranks: {kept.get('refused') or kept['reason']}"}
        verdicts = {(doc or {}).get("verdict", {}).get("class") for doc in logs.values()}
        rolled = any(a.kind == "rollback" for a in self.fleet.actions(incident_id))
        good = self.fleet.last_known_good(job, other_than=self.fleet.job(job).revision)
        if "user_code" in verdicts and good and not rolled:
            self.stop(job)
            self.rollback(incident_id, good)
            return {"did": f"rolled back to {good} (the job's own code failed after the restart)"}
        return {"did": f"restarted again as it was ({why[:160]})"}

    # ---- repeat offenders ----------------------------------------------------------------------------
    def implicate(self, incident_id: int, machine: str, why: str) -> None:
        """Record that the incident's failure started on ``machine`` (its logs say so)."""
        self.fleet.record_action(f"implicate:{incident_id}:{machine}", kind="implicate", incident_id=incident_id,
                                 machines=[machine], evidence={"why": why[:300]})

    def failures_of(self, job: str, machine: str, *, other_than: int) -> list[int]:
        """The job's incidents within ``repeat_window_s`` that implicated ``machine`` and left it in the job
        (a clean diagnosis, a restart in place): what makes a repeat offender."""
        since = time.time() - self.cfg.repeat_window_s
        ids = {i.id for i in self.fleet.incidents(job) if i.id != other_than and i.first_alert_ts >= since}
        actions = [a for a in self.fleet.actions() if a.incident_id in ids]
        evicted = {a.incident_id for a in actions
                   if a.kind == "evict" and a.outcome == "done" and machine in a.machines}
        return sorted({a.incident_id for a in actions if a.kind == "implicate" and machine in a.machines} - evicted)

    # ---- a silent agent -----------------------------------------------------------------------------
    def probe(self, incident_id: int, machine_names: Sequence[str], *, timeout_s: float = 60.0) -> dict[str, Any]:
        """Machines whose agent went silent: reach each over SSH and run L1 (``tg-node diag --level 1``).
        Unreachable, timed out or unhealthy: ``faulty`` (machine -> why). Healthy: its agent is restarted
        (``tg-node agent --restart``; ``restarted``: machine -> what happened). Every probe is an action of
        the incident with its evidence."""
        names = [n for n in machine_names if n in self.inventory.names()]
        results = self._run(self.machines(names), lambda m: [self.inventory.tg_node, "diag", "--level", "1"],
                            timeout=timeout_s)
        faulty: dict[str, str] = {}
        healthy = []
        for n, r in results.items():
            doc = r.answer() or {}
            if not r.reachable or r.timed_out:
                faulty[n] = r.describe()[:300]
            elif not doc.get("healthy"):
                faulty[n] = "failed L1: " + "; ".join(doc.get("reasons") or [r.describe()])[:300]
            else:
                healthy.append(n)
        restarted: dict[str, str] = {}
        if healthy and not self.cfg.dry_run:
            again = self._run(self.machines(healthy), lambda m: [self.inventory.tg_node, "agent", "--restart"],
                              timeout=30)
            for n, r in again.items():
                doc = r.answer() or {}
                restarted[n] = (f"passed L1; its agent was {doc.get('before', {}).get('agent', {}).get('state', '?')}"
                                f" and runs again (pid {doc.get('after', {}).get('agent', {}).get('pid')})"
                                if r.ok else f"passed L1, but its agent could not be restarted: {r.describe()[:200]}")
        for n in names:
            self.fleet.record_action(f"probe:{incident_id}:{n}", kind="probe", incident_id=incident_id, machines=[n],
                                     dry_run=self.cfg.dry_run,
                                     evidence={"faulty": faulty.get(n), "restarted": restarted.get(n)})
        self.fleet.update_incident(incident_id, decided_ts=time.time())
        return {"machines": names, "faulty": faulty, "restarted": restarted}

    # ---- stop-time diagnosis -------------------------------------------------------------------------
    def _run(self, machines: Sequence[Machine], argv_for: Any, timeout: float,
             env: Mapping[str, str] | None = None) -> dict[str, RunResult]:
        return self.transport.run_many(list(machines), argv_for, timeout=timeout, env=env)

    def stop(self, job: str, *, grace_s: float | None = None) -> dict[str, str]:
        """Stop the job on every machine of it that answers (SIGKILL after ``grace_s``, default the
        configured ``stop_grace_s``); returns what each said."""
        return _described(self._stop(job, grace_s))

    def _stop(self, job: str, grace_s: float | None = None, logs_since: float | None = None
              ) -> dict[str, RunResult]:
        # marked everywhere before anything is stopped: ranks ended by a peer's stop are then not reported
        # as new failures (both phases in one round of sessions)
        names = self.fleet.job(job).machine_list
        results = launcher.stop_sessions(self.inventory, job, self.machines(names),
                                         grace_s=self.cfg.stop_grace_s if grace_s is None else grace_s,
                                         transport=self.transport, logs_since=logs_since, status=True, copies=True)
        statuses = {n: (r.answer() or {}).get("status") if r.ok else None for n, r in results.items()}
        # the checkpoint copies each machine holds now that nothing writes them: what an eviction checks
        self._copies[job] = {n: _held((r.answer() or {}).get("copies")) if r.ok else None
                             for n, r in results.items()}
        self._stopped.pop(job, None)
        if all(isinstance(st, dict) and st.get("state") in ("exited", "absent") for st in statuses.values()):
            self._stopped[job] = {"machines": list(names), "step": launcher.min_step(statuses)}
        return results

    def stop_and_read_logs(self, job: str, since: float = 0.0) -> tuple[dict[str, str], dict[str, Any]]:
        """:meth:`stop`, and the logs' verdict across the job's machines, read in the same sessions after
        the stop: user_code if any rank's first failure is the job's own code, infrastructure, unknown,
        or none."""
        results = self._stop(job, logs_since=since)
        return _described(results), _verdict({n: r.reachable and ((r.answer() or {}).get("logs") or {}).get("verdict")
                                  for n, r in results.items()})

    def diagnose(self, job: str, machine_names: Sequence[str] | None = None, *, levels: Sequence[int] = (1, 2, 3),
                 align: bool = False) -> dict[str, Any]:
        """Stop-time diagnosis on the job's machines (or ``machine_names``): L1, then L2, then L3 in pairs
        of neighbours; a machine failing a level (or unreachable) is not tested further. L2 runs every test
        of L1 in the same process, so with both asked only L2 runs (one round of sessions and one import
        of torch per machine less; the report has no ``L1`` then), and with L3 asked too, L2 and L3 run in
        one test process per machine (:meth:`_l2_l3`). NaN adds the alignment test, run in L3's test process
        after its collective (alone when L3 does not run): a machine whose digest differs from a strict
        majority fails (a tie is broken by self-checked standbys). Robust to load
        (:mod:`operators.policy.diagnosis`): at most ``diag_concurrency`` machines at once, measurements
        judged against the peers of the same round, and a failed L1 or L2 repeated alone before it counts."""
        names = list(machine_names or self.fleet.job(job).machine_list)
        failed: dict[str, str] = {}
        report: dict[str, Any] = {}
        t0 = time.time()
        aligned: dict[str, RunResult] | None = None
        todo = [lv for lv in levels if not (lv == 1 and 2 in levels)]
        if 2 in todo and 3 in todo and len(names) >= 2:
            aligned = self._l2_l3(names, align=align, failed=failed, report=report)
            todo = [lv for lv in todo if lv not in (2, 3)]
        for level in todo:
            alive = [n for n in names if n not in failed]
            if not alive:
                break
            if level == 3:
                results = self._l3(alive, align=align)
                if align and results:
                    aligned = results
                docs = {n: r.answer() for n, r in results.items()}
                bad = {n: (doc or {}).get("reasons") or [results[n].describe()] for n, doc in docs.items()
                       if not (doc and doc.get("healthy"))}
                report["L3"] = {}
            else:
                docs, bad, report[f"L{level}"] = self._judged(alive, level)
            for n in docs:
                report[f"L{level}"].setdefault(n, {"healthy": n not in bad, "reasons": bad.get(n, [])})
                if n in bad:
                    failed[n] = f"L{level}: " + "; ".join(bad[n])[:300]
        if align:
            alive = [n for n in names if n not in failed]
            if aligned is None:
                aligned = self._align(alive)
            digests = {n: _digest(r) for n, r in aligned.items() if n in alive}
            trusted, odd, why = sdc.align_outliers(digests)
            if trusted is None and len(digests) > 1:  # no majority: a tie is broken by evidence, never by order
                reference = self.reference_digest(exclude=names)
                report["align_reference"] = reference
                if reference is not None:
                    trusted, odd, why = sdc.align_outliers(digests, reference)
            for n in odd:
                failed[n] = f"align: digest {digests.get(n)} differs from {trusted} ({why})"
            report["align"] = digests
            if trusted is None:
                report["align_inconclusive"] = why
        return {"job": job, "machines": names, "failed": failed, "report": report,
                "seconds": round(time.time() - t0, 3)}

    def _waves(self, machines: Sequence[Machine], argv_for: Any, *, timeout: float) -> dict[str, RunResult]:
        """Run on ``machines`` at most ``diag_concurrency`` at a time."""
        out: dict[str, RunResult] = {}
        size = max(1, self.cfg.diag_concurrency)
        for i in range(0, len(machines), size):
            out.update(self._run(machines[i:i + size], argv_for, timeout=timeout))
        return out

    def _l2_bad(self, docs: Mapping[str, Any], results: Mapping[str, RunResult]) -> tuple[dict[str, list[str]],
                                                                                         dict[str, str]]:
        """The L1/L2 failures of one round (machine -> reasons, the collective left out) after the peers'
        judgement, and the machines it forgave (machine -> why)."""
        from operators.policy.diagnosis import forgiven_by_peers

        bad: dict[str, list[str]] = {}
        for n, doc in docs.items():
            tests = (doc or {}).get("tests") or []
            reasons = [f"{t['name']}: {t['reason']}" for t in tests
                       if t["name"] != "collective_neighbours" and not t["ok"]]
            if doc is None or (reasons if tests else not doc.get("healthy")):
                bad[n] = reasons or (doc or {}).get("reasons") or [results[n].describe()]
        forgiven = forgiven_by_peers({n: d for n, d in docs.items() if d})
        return {n: r for n, r in bad.items() if n not in forgiven}, forgiven

    def _judged(self, names: Sequence[str], level: int, *, first: Mapping[str, Any] | None = None
                ) -> tuple[dict[str, Any], dict[str, list[str]], dict[str, Any]]:
        """L1 or L2 on ``names`` (in waves), judged with their peers, a failed machine run again alone: the
        documents, the machines that failed twice (machine -> reasons) and the report. ``first``: the
        documents of a round these machines already failed once (they run once more, alone, and are judged
        with that round's peers)."""
        argv = [self.inventory.tg_node, "diag", "--level", str(level)]
        if first is not None:
            results = {n: r for n in names for n, r in self._run(self.machines([n]), lambda m: argv,
                                                                  timeout=self.cfg.diag_timeout_s).items()}
        else:
            results = self._waves(self.machines(names), lambda m: argv, timeout=self.cfg.diag_timeout_s)
        docs = {n: r.answer() for n, r in results.items()}
        bad, forgiven = self._l2_bad({**(first or {}), **docs}, results)
        bad = {n: r for n, r in bad.items() if n in docs}
        report: dict[str, Any] = {n: {"healthy": True, "reasons": [], "forgiven": why} for n, why in forgiven.items()
                                  if n in docs}
        if first is not None:
            for n in names:
                report[n] = {"healthy": n not in bad, "reasons": bad.get(n, []), "again": True,
                             **({"forgiven": forgiven[n]} if n in forgiven else {})}
            return docs, bad, report
        if bad:  # one failed reading does not evict: each is run again, alone
            _again, bad, again = self._judged(sorted(bad), level, first=docs)
            report.update(again)
        return docs, bad, report

    def _l2_l3(self, names: Sequence[str], *, align: bool, failed: dict[str, str],
               report: dict[str, Any]) -> dict[str, RunResult] | None:
        """L2 and then L3 (and the alignment test) in one round of sessions and one test process per
        machine: every machine of a pair runs its L2 tests, then they meet at the collective. L2 is judged
        with the peers of the round and a failure run again alone (:meth:`_judged`); a machine failing L2
        twice fails; a failed collective counts against a machine whose partners passed L2 the first time,
        and one whose partner failed L2 (or that passed L2 only the second time) is tested again with a
        healthy peer (L3 alone). Fills ``failed`` and ``report`` (``L2``, ``L3``); returns the runs when they
        carry the alignment digests."""
        results = self._l3(names, align=align, level=2)
        docs = {n: r.answer() for n, r in results.items()}
        first_bad, forgiven = self._l2_bad(docs, results)
        report["L2"] = {n: {"healthy": True, "reasons": [], "forgiven": why} for n, why in forgiven.items()}
        report["L3"] = {}
        l2_failed: dict[str, list[str]] = {}
        if first_bad:  # the combined run was the first reading: each failure runs once more, alone
            _docs, l2_failed, again = self._judged(sorted(first_bad), 2, first=docs)
            report["L2"].update(again)
        for n, reasons in l2_failed.items():
            report["L2"][n] = {**report["L2"].get(n, {}), "healthy": False, "reasons": reasons}
            failed[n] = "L2: " + "; ".join(reasons)[:300]
        group_of = {n: g for g in neighbour_groups(names) for n in g}
        l3_failed: dict[str, str] = {}
        for n in names:
            report["L2"].setdefault(n, {"healthy": n not in l2_failed, "reasons": []})
            if n in first_bad:
                continue
            coll = next((t for t in (docs.get(n) or {}).get("tests") or [] if t["name"] == "collective_neighbours"),
                        None)
            ok = bool(coll and coll["ok"])
            report["L3"][n] = {"healthy": ok, "reasons": [] if ok else [
                f"collective_neighbours: {coll['reason']}" if coll else "collective_neighbours: did not run"]}
            if not ok:
                l3_failed[n] = report["L3"][n]["reasons"][0]
        unsure = [n for n in l3_failed if any(p in first_bad for p in group_of[n] if p != n)]
        unsure += [n for n in first_bad if n not in l2_failed]  # passed L2 the second time: L3 not yet seen
        for n, why in l3_failed.items():
            if n not in unsure:
                failed[n] = f"L3: {why}"[:300]
        if unsure:  # their partner failed L2 (or they did, once): the collective said nothing of them
            peers = [n for n, v in report["L3"].items() if v["healthy"]][: 1 if len(unsure) == 1 else 0]
            for n, r in self._l3(unsure + peers).items():
                if n not in unsure:
                    continue
                doc = r.answer()
                ok = bool(doc and doc.get("healthy"))
                report["L3"][n] = {"healthy": ok, "again": True,
                                   "reasons": [] if ok else (doc or {}).get("reasons") or [r.describe()]}
                if not ok:
                    failed[n] = "L3: " + "; ".join(report["L3"][n]["reasons"])[:300]
        return results if align else None

    def reference_digest(self, *, exclude: Sequence[str] = (), standbys: int = 2) -> str | None:
        """The alignment digest of self-checked standbys (up to ``standbys`` of them, when they agree): the
        reference a split of the job's machines is judged by. None when no standby answers or they differ."""
        names = [m.name for m in self.fleet.machines(state=states.STANDBY)
                 if m.name not in exclude and m.name in self.inventory.names()][:standbys]
        if not names:
            return None
        digests = {_digest(r) for r in self._align(names).values()}
        return digests.pop() if len(digests) == 1 and None not in digests else None

    def _align(self, names: Sequence[str]) -> dict[str, RunResult]:
        return self._run(self.machines(names), lambda m: [self.inventory.tg_node, "align"], timeout=60)

    def _l3(self, names: Sequence[str], *, align: bool = False, level: int = 3) -> dict[str, RunResult]:
        """L3 in pairs of neighbours (an odd one out joins the last pair); with ``align``, each machine's
        alignment test in the same test process, after the collective; with ``level`` 2, L2's tests first,
        in that process too."""
        groups = neighbour_groups(names)
        argv: dict[str, list[str]] = {}
        for gi, group in enumerate(groups):
            master = self.inventory.machine(group[0])
            for rank, n in enumerate(group):
                argv[n] = [self.inventory.tg_node, "diag", "--level", str(level), "--rank", str(rank), "--world-size",
                           str(len(group)), "--master-addr", master.address, "--master-port", str(29300 + gi),
                           "--timeout-s", "60", *(["--align"] if align else [])]
        if len(names) < 2:
            return {}
        out: dict[str, RunResult] = {}
        size = max(2, self.cfg.diag_concurrency)
        wave: list[str] = []
        for group in [*groups, []]:  # whole groups only: a pair meets at its collective
            if wave and (not group or len(wave) + len(group) > size):
                out.update(self._run(self.machines(wave), lambda m: argv[m.name], timeout=self.cfg.diag_timeout_s))
                wave = []
            wave += group
        return out

    # ---- dual-phase replay --------------------------------------------------------------------------
    def replay_plan(self, job: str, *, k: int = 1) -> dict[str, Any]:
        """The replay groups of the job (:func:`operators.policy.sdc.plan_replay`), and a reference
        group of self-checked standbys (``k * PP`` of them, or none when too few are free)."""
        j = self.fleet.job(job)
        topo = self.topology(job)
        plan = sdc.plan_replay(topo, j.machine_list, k=k)
        standbys = sorted(m.name for m in self.fleet.machines(state=states.STANDBY))
        size = k * topo.pp
        return {"job": job, "k": k, "horizontal": plan.horizontal, "vertical": plan.vertical,
                "reference": standbys[:size] if len(standbys) >= size else []}

    def replay(self, job: str, groups: Mapping[str, Sequence[str]], *, k: int, steps: int = 2,
               timeout_s: float = 300.0) -> dict[str, str]:
        """Run the job's model and data (its code revision and training arguments, TP and PP, DP = ``k``)
        on each group of machines at once, from the same seed, ``steps`` steps, no checkpoint: a
        sub-job named ``<job>-replay-<group>`` per group. Every group computes the same thing, so
        healthy groups agree bit for bit. Returns each group's result: its ranks' parameter digests
        after the last step, or ``failed: ...``. The job itself must be stopped."""
        j = self.fleet.job(job)
        topo = Topology(j.tp, j.pp, k, ranks_per_machine=j.ranks_per_machine)
        args = [*j.train_args, "--no-checkpoint", "--no-restore", "--steps", str(steps), "--step-delay-s", "0"]
        plans = {tag: launcher.JobPlan(job=f"{job}-replay-{tag}", topology=topo, machines=self.machines(names),
                                       train_args=args, master_port=REPLAY_PORT_BASE + i, revision=j.revision)
                 for i, (tag, names) in enumerate(groups.items())}
        if self.cfg.dry_run:
            return {tag: "dry run" for tag in plans}
        out: dict[str, str] = {}
        try:
            for tag, plan in plans.items():
                try:
                    launcher.launch(self.inventory, plan, transport=self.transport)
                except TrainguardError as exc:
                    out[tag] = f"failed: {exc}"[:300]
            deadline = time.monotonic() + timeout_s
            while len(out) < len(plans) and time.monotonic() < deadline:
                for tag, plan in plans.items():
                    if tag not in out:
                        result = _replay_result(launcher.status(self.inventory, plan.job, plan.machines,
                                                                transport=self.transport),
                                                steps, topo.world_size)
                        if result is not None:
                            out[tag] = result
                if len(out) < len(plans):
                    time.sleep(1.0)
            for tag in plans:
                out.setdefault(tag, f"failed: no result within {timeout_s:.0f}s")
        finally:
            for plan in plans.values():  # ended, or ended now: marked stopped, out of the ranks check
                with contextlib.suppress(TrainguardError):
                    launcher.stop(self.inventory, plan.job, plan.machines, grace_s=2.0, transport=self.transport)
        return out

    def dual_phase_replay(self, job: str, *, k: int = 1) -> dict[str, Any]:
        """Replay a fixed step on the horizontal groups (with the standbys' reference group beside them),
        then on the vertical groups; the culprits are the machines in both a failing horizontal and a
        failing vertical group (:func:`operators.policy.sdc.culprits`). With two groups and no reference,
        a difference cannot be placed: ``inconclusive``."""
        plan = self.replay_plan(job, k=k)
        t0 = time.time()
        h = self.replay_phase(plan, "horizontal")
        v = self.replay_phase(plan, "vertical")
        return {**plan, **self.replay_verdict(plan, h, v), "seconds": round(time.time() - t0, 3)}

    def replay_phase(self, plan: Mapping[str, Any], phase: str) -> dict[str, str]:
        """One phase of :meth:`replay_plan`'s replay: ``horizontal`` (groups ``h0``.., with the standbys'
        reference group ``ref``) or ``vertical`` (``v0``..)."""
        groups = {f"{phase[0]}{i}": g for i, g in enumerate(plan[phase])}
        if phase == "horizontal" and plan["reference"]:
            groups["ref"] = plan["reference"]
        return self.replay(plan["job"], groups, k=int(plan["k"]))

    @staticmethod
    def replay_verdict(plan: Mapping[str, Any], h: Mapping[str, str], v: Mapping[str, str]) -> dict[str, Any]:
        """The culprits from both phases' results (``h0``.., ``ref``; ``v0``..)."""
        groups = sdc.ReplayPlan(plan["k"], plan["horizontal"], plan["vertical"])
        h_res = {i: h[f"h{i}"] for i in range(len(groups.horizontal))}
        v_res = {i: v[f"v{i}"] for i in range(len(groups.vertical))}
        reference = h.get("ref")
        if reference is not None and reference.startswith("failed"):
            reference = None  # the reference did not run: judge by the majority
        suspects = sdc.culprits(groups, h_res, v_res, reference=reference)
        inconclusive = reference is None and len(h_res) == 2 and len(set(h_res.values()) | set(v_res.values())) > 1
        return {"horizontal_results": h, "vertical_results": v, "reference_result": reference,
                "culprits": [] if inconclusive else sorted(suspects), "inconclusive": inconclusive}

    # ---- runtime analysis -----------------------------------------------------------------------------
    def analyze(self, job: str, incident_id: int | None = None) -> dict[str, Any]:
        """Stacks and collective counters of every rank, grouped; the outliers' parallel group, at least
        a pipeline (hangs and slow ranks are over-evicted by group). The incident's alerts name the
        ranks to prefer when the outliers do not fit one group: a stopped process, else the first rank
        to stall or slow down."""
        j = self.fleet.job(job)
        alerts = sorted(self.fleet.alerts_of(incident_id), key=lambda a: a.ts) if incident_id is not None else []
        claimed = sorted({a.rank for a in alerts if a.kind == "rank_stopped" and a.rank is not None})
        first = next((a.rank for a in alerts if a.kind in ("rank_hang", "rank_slow") and a.rank is not None), None)
        topo = self.topology(job)
        # scikit-learn takes seconds to import: in the background while the stacks are taken
        preload = threading.Thread(target=runtime.preload, name="preload-sklearn", daemon=True)
        preload.start()
        results = self._run(self.machines(j.machine_list),
                            lambda m: [self.inventory.tg_node, "stacks", "--job", job], timeout=60)
        preload.join()
        docs = {n: r.json() for n, r in results.items() if r.reachable and not r.timed_out and r.json()}
        # an alert saying a rank stopped is a claim; the process the stacks see is the evidence
        stopped = runtime.confirmed_stopped(claimed, docs)
        named = stopped or ([first] if first is not None else [])
        machine_of = {r: j.machine_list[topo.machine_of(r)] for r in range(topo.world_size)}
        a = runtime.analyze(topo, runtime.rank_stacks(docs, topo.world_size, machine_of), named=named,
                            kinds=("pp", "dp"), stopped=stopped)
        return {"job": job, "outliers": a.outliers, "named": named, "claimed_stopped": claimed,
                "refuted": sorted(set(claimed) - set(stopped)),
                "reasons": {str(k): v for k, v in a.reasons.items()},
                "group_kind": a.group_kind, "groups": [len(g) for g in a.groups],
                "machines": [j.machine_list[i] for i in a.evict_machines]}

    def compute_times(self, job: str) -> dict[int, float]:
        """Each rank's compute time in its last step (step time less the time spent in collectives),
        from every machine's ``tg-node job status``: one round of the fail-slow vote."""
        j = self.fleet.job(job)
        st = launcher.status(self.inventory, job, self.machines(j.machine_list), transport=self.transport)
        out: dict[int, float] = {}
        for doc in st.values():
            for r in doc.get("ranks", []):
                recent = r.get("recent_compute_s")  # the median of its last steps, when the machine says it
                if isinstance(recent, (int, float)):
                    out[int(r["rank"])] = float(recent)
                    continue
                last = r.get("last_step") or {}
                step_time, comm = last.get("step_time_s"), last.get("comm_s")
                if isinstance(step_time, (int, float)) and isinstance(comm, (int, float)):
                    out[int(r["rank"])] = max(0.0, float(step_time) - float(comm))
        return out

    def vote_slow(self, incident_id: int) -> dict[str, Any]:
        """The fail-slow vote (:class:`operators.policy.runtime.SlowVoter`): ``slow_rounds`` rounds,
        ``slow_interval_s`` apart, while the job trains. Stops early, with ``superseded``, when stronger
        alerts took the incident over. Returns the rounds, the verdict (kind and machines) or None."""
        inc = self.fleet.incident(incident_id)
        voter = runtime.SlowVoter(self.topology(inc.job), rounds=self.cfg.slow_rounds)
        j = self.fleet.job(inc.job)
        rounds: list[list[int]] = []
        while not voter.done:
            if rounds:
                time.sleep(self.cfg.slow_interval_s)  # the sampling interval of the vote
            if self.fleet.incident(incident_id).category not in ladder.WATCHED:
                return {"job": inc.job, "superseded": True, "rounds": rounds}
            rounds.append(voter.add_round(self.compute_times(inc.job), factor=self.cfg.slow_factor))
        verdict = voter.verdict()
        kind, machines = (None, []) if verdict is None else (verdict[0], [j.machine_list[i] for i in verdict[1]])
        # the verdict is claimed before anything is acted on: stronger alerts arriving from here on (the
        # job being stopped, say) cannot start a second handler on the same incident
        if not self.fleet.claim_watched(incident_id, f"vote:{incident_id}", watched=ladder.WATCHED, kind="vote",
                                        machines=machines, evidence={"rounds": rounds, "verdict": kind},
                                        detail=f"{kind or 'no'} group flagged in most of {len(rounds)} rounds"):
            return {"job": inc.job, "superseded": True, "rounds": rounds}
        return {"job": inc.job, "rounds": rounds, "verdict": kind, "machines": machines}

    # ---- eviction, recovery ---------------------------------------------------------------------------
    def wait_for_human(self, incident_id: int, reason: str) -> dict[str, Any]:
        """The incident waits for a human, and so does its job (its state in the fleet database says so):
        ``reason`` says why and what to do."""
        inc = self.fleet.incident(incident_id)
        self.fleet.update_incident(incident_id, state="waiting_human", summary=reason)
        self.fleet.set_job_state(inc.job, "waiting_human")
        return {"swaps": {}, "waiting_human": True, "reason": reason}

    def pool(self) -> list[str]:
        """The standbys of the fleet database that the inventory holds, in the fleet's order."""
        return [m.name for m in self.fleet.machines(state=states.STANDBY) if m.name in self.inventory.names()]

    def ready_standbys(self, wanted: int, *, why: str = "") -> list[str]:
        """Up to ``wanted`` standbys checked reachable now (``tg-node standby status``), in the fleet's order;
        one that does not answer goes to repair (``why``: whom it was called to replace) and the next is
        tried."""
        ready: list[str] = []
        tried: set[str] = set()
        while len(ready) < wanted:
            todo = [n for n in self.pool() if n not in tried][: wanted - len(ready)]
            if not todo:
                break
            tried.update(todo)
            results = self._run(self.machines(todo), lambda m: [self.inventory.tg_node, "standby", "status"],
                                timeout=15)
            for n in todo:
                r = results[n]
                if r.ok and isinstance(r.answer(), dict):
                    ready.append(n)
                elif not self.cfg.dry_run:
                    self.fleet.transition(n, states.REPAIR, reason=f"standby did not answer when called{why}: "
                                                                   f"{r.describe()[:200]}")
        return ready

    def _breaker(self, job: Any, wanted: Sequence[str]) -> ladder.BreakerVerdict:
        return ladder.breaker(job_machines=len(job.machine_list),
                              evicted_recently=self.fleet.evicted_recently(job.name, self.cfg.breaker_window_s),
                              to_evict=wanted, max_share=self.cfg.breaker_share, window_s=self.cfg.breaker_window_s)

    def eviction_blocked(self, incident_id: int, machine_names: Sequence[str]) -> str:
        """Why evicting ``machine_names`` from the incident's job could not happen now (the breaker, fewer
        standbys in the pool than machines to replace), or "" when it may: asked before a rung stops a job
        that still trains, however slowly, for an eviction (:meth:`evict` checks again, reachability too)."""
        job = self.fleet.job(self.fleet.incident(incident_id).job)
        wanted = [n for n in machine_names if n in job.machine_list]
        verdict = self._breaker(job, wanted)
        if not verdict.allowed:
            return verdict.reason
        pool = self.pool()
        if len(pool) < len(wanted):
            return (f"{len(wanted)} machines to replace ({', '.join(wanted)}), {len(pool)} standbys in the pool; "
                    f"add machines to the pool (tg_standby_pool) or repair the standbys, then resolve the incident")
        return ""

    def evict(self, incident_id: int, machine_names: Sequence[str], *, reason: str,
              breaker: bool = True, max_step: int | None = None) -> dict[str, Any]:
        """Replace ``machine_names`` in the incident's job with standbys (each checked reachable first),
        through the breaker (``breaker`` False: machines that failed to start, not a judgement of the ladder)
        and the checkpoint check (no eviction takes the last copy of a step; ``max_step``: the restart will
        restore no newer step). Returns the swaps;
        ``waiting_human`` when the breaker, a lack of standbys or the checkpoints stop it."""
        inc = self.fleet.incident(incident_id)
        job = self.fleet.job(inc.job)
        wanted = [n for n in machine_names if n in job.machine_list]
        if not wanted:
            return {"swaps": {}, "reason": "nothing to evict"}
        verdict = self._breaker(job, wanted)
        key = f"evict:{incident_id}:{','.join(sorted(wanted))}"
        action, created = self.fleet.record_action(
            key, kind="evict", incident_id=incident_id, machines=wanted, dry_run=self.cfg.dry_run,
            evidence={"reason": reason, "breaker": verdict.reason if breaker else "not applied (failed to start)"})
        if not created and action.outcome == "done":
            return {"swaps": json.loads(action.detail or "{}"), "reason": "done before"}
        if breaker and not verdict.allowed:
            self.fleet.finish_action(action.id, "skipped", verdict.reason)
            return self.wait_for_human(incident_id, verdict.reason)
        standbys = self.ready_standbys(len(wanted), why=f" to replace {', '.join(wanted)} in {inc.job}")
        if len(standbys) < len(wanted):
            why = (f"{len(wanted)} machines to replace ({', '.join(wanted)}), {len(standbys)} standbys answer; add "
                   f"machines to the pool (tg_standby_pool) or repair the standbys, then resolve the incident")
            self.fleet.finish_action(action.id, "skipped", why, evidence={"standbys": standbys})
            return self.wait_for_human(incident_id, why)
        kept = self.protect_checkpoints(inc.job, wanted, max_step=max_step)
        if kept.get("refused"):
            self.fleet.finish_action(action.id, "skipped", kept["refused"], evidence={"checkpoint": kept})
            return {**self.wait_for_human(incident_id, kept["refused"]), "checkpoint": kept}
        plan = dict(zip(sorted(wanted), standbys, strict=False))
        if self.cfg.dry_run:
            self.fleet.finish_action(action.id, "dry_run", json.dumps(plan), evidence={"checkpoint": kept})
            return {"swaps": plan, "dry_run": True, "reason": reason, "checkpoint": kept}
        swaps = self.fleet.swap(inc.job, plan, reason=reason, incident_id=incident_id)
        self.fleet.finish_action(action.id, "done", json.dumps(swaps), evidence={"checkpoint": kept,
                                                                               "standbys": standbys})
        self.fleet.update_incident(incident_id, decided_ts=time.time())
        return {"swaps": swaps, "reason": reason, "checkpoint": kept}

    def unhandled_faults(self, incident_id: int) -> dict[str, str]:
        """Explicit machine faults among the incident's alerts (those that joined it after its triage too) on
        machines that still serve the job: machine -> the alerts' kinds. Every one is acted on before the
        incident closes."""
        inc = self.fleet.incident(incident_id)
        serving = set(self.fleet.job(inc.job).machine_list)
        out: dict[str, set[str]] = {}
        for a in self.fleet.alerts_of(incident_id):
            if a.machine in serving and ladder.decisive(a.document) and ladder.triage("", [a.document]).category \
                    == "machine_fault":
                out.setdefault(a.machine, set()).add(a.kind)
        return {m: ", ".join(sorted(k)) for m, k in sorted(out.items())}

    def rollback(self, incident_id: int, revision: str) -> dict[str, Any]:
        inc = self.fleet.incident(incident_id)
        action, created = self.fleet.record_action(f"rollback:{incident_id}:{revision}", kind="rollback",
                                                   incident_id=incident_id, dry_run=self.cfg.dry_run,
                                                   evidence={"to": revision, "from": self.fleet.job(inc.job).revision})
        if created and not self.cfg.dry_run:
            self.fleet.set_revision(inc.job, revision)
            self.fleet.finish_action(action.id, "done", f"revision {revision}")
        self.fleet.update_incident(incident_id, decided_ts=time.time())
        return {"revision": revision}

    def parked(self, names: Sequence[str]) -> set[str]:
        """Which of ``names`` have warm interpreters parked."""
        results = self._run(self.machines(names), lambda m: [self.inventory.tg_node, "standby", "status"], timeout=20)
        return {n for n, r in results.items() if r.ok and (r.json() or {}).get("state") == "parked"}

    def first_step_of(self, incident_id: int, kinds: Sequence[str]) -> int | None:
        """The earliest training step the incident's alerts of ``kinds`` name (their evidence's step)."""
        steps = [a.document.get("evidence", {}).get("step") for a in self.fleet.alerts_of(incident_id)
                 if a.kind in kinds]
        return min((s for s in steps if isinstance(s, int)), default=None)

    def stop_found(self, job: str) -> dict[str, Any] | None:
        """What this controller's last stop of ``job`` found, when it ended the job on every machine: its
        machines and the lowest step every rank finished (a rung hands it to ``restart_job`` through XCom)."""
        found = self._stopped.get(job)
        return dict(found) if found else None

    def recover(self, incident_id: int, *, restore_max_step: int | None = None,
                found: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Stop the job everywhere it answers, then start it on its machine list (replacements already
        swapped in by :meth:`evict`): every machine with warm interpreters parked (standbys, and survivors
        armed by :meth:`arm`) starts on them, the others cold. The job restores its newest committed
        checkpoint itself. A machine that fails to start (unreachable, a broken standby) is replaced by the
        next standby and the launch tried again, up to ``restart_attempts`` times; then the incident waits
        for a human. Returns the steps every rank had finished before (for the resume check). ``found``: what
        the stop right before it found (:meth:`stop_found`, handed on by the rung through XCom): then no round
        of reads before the launch."""
        inc = self.fleet.incident(incident_id)
        job = inc.job
        self._stopped.pop(job, None)
        before: dict[str, Any] | None = dict(found) if found else None
        if before is not None:
            stopped = {n: "stopped" for n in before["machines"]}
        else:
            before = self.progress(job)
            # the handler has usually stopped it already: no stop when no machine runs it
            done = before["states"] and all(s in ("exited", "absent") for s in before["states"].values())
            stopped = {n: "not running" for n in before["states"]} if done else self.stop(job)
        replaced: dict[str, str] = {}
        attempts = self.cfg.restart_attempts
        launches = sum(1 for a in self.fleet.actions(incident_id) if a.kind == "launch")
        for attempt in range(attempts):
            n = launches + attempt  # each restart of the incident is an action of its own (a repeat is a no-op)
            try:
                started = self._start(job, warm_if_parked=True, incident_id=incident_id,
                                      restore_max_step=restore_max_step,
                                      tag=f"{incident_id}" if not n else f"{incident_id}-restart{n + 1}")
                break
            except launcher.PartsFailed as exc:
                bad = {n: why for n, why in exc.failed.items() if n in self.fleet.job(job).machine_list}
                if attempt + 1 >= attempts or not bad:
                    return {"job": job, "stopped": stopped, "started": {"launched": False, "error": str(exc)},
                            **self.wait_for_human(incident_id, f"the restart failed {attempt + 1} times: {exc}"[:900]
                                                  + "; next: repair or replace those machines, then resolve the "
                                                    "incident (trigger tg_diagnose with evict to swap them)"),
                            "replaced": replaced}
                fresh = set(self.fleet.job(job).machine_list) - set(before.get("states") or before.get("machines")
                                                                    or [])
                ev = self.evict(incident_id, sorted(bad), breaker=not set(bad) <= fresh,
                                reason="failed to start: " + "; ".join(bad.values())[:300])
                if ev.get("waiting_human"):
                    return {"job": job, "stopped": stopped, "started": {"launched": False, "error": str(exc)},
                            **ev, "replaced": replaced}
                replaced.update(ev.get("swaps") or {})
        self.fleet.update_incident(incident_id, decided_ts=time.time())
        return {"job": job, "stopped": stopped, "started": started, "warm": started.get("warm", []),
                "steps_before": before.get("step", -1), "restart_ts": time.time(), "replaced": replaced}

    def progress(self, job: str) -> dict[str, Any]:
        """The lowest step every rank finished and each machine's incarnation and state."""
        j = self.fleet.job(job)
        st = launcher.status(self.inventory, job, self.machines(j.machine_list), transport=self.transport)
        return {"step": launcher.min_step(st),
                "incarnations": {n: d.get("incarnation") for n, d in st.items()},
                "states": {n: d.get("state", d.get("error")) for n, d in st.items()}}

    def trains(self, job: str, *, within_s: float = 15.0, poll_s: float = 1.0) -> bool:
        """Whether every rank of the job finishes a step within ``within_s`` (the job trains right now)."""
        start = self.progress(job)
        if start["step"] < 0 or not all(s == "running" for s in start["states"].values()):
            return False
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            now = self.progress(job)
            if now["step"] > start["step"]:
                return True
            if not all(s == "running" for s in now["states"].values()):
                return False
            time.sleep(poll_s)
        return False

    def resumed(self, job: str, restart_ts: float) -> dict[str, Any] | None:
        """Whether every rank of the restarted job finished a step after ``restart_ts``; then the restored
        step and the first step run, else None."""
        j = self.fleet.job(job)
        m0 = self.inventory.machine(j.machine_list[0])
        try:
            records = launcher.steps(self.inventory, job, m0, rank=0, transport=self.transport)
        except TrainguardError:
            return None
        fresh = [r for r in records if r.get("ts", 0) > restart_ts]
        if not fresh:
            st = launcher.status(self.inventory, job, self.machines(j.machine_list), transport=self.transport)
            if st and all(d.get("state") == "exited" for d in st.values()):
                raise TrainguardError(f"job {job} ended on every machine after the restart without a step; "
                                      f"see 'tg-node logs --job {job}' on its machines")
            return None
        st = launcher.status(self.inventory, job, self.machines(j.machine_list), transport=self.transport)
        steps = [r.get("step") for d in st.values() for r in d.get("ranks", [])]
        if not steps or any(s is None or s < fresh[0]["step"] for s in steps):
            return None
        return {"first_step": fresh[0]["step"], "restored_step": fresh[0].get("ckpt_restored_step"),
                "ts": fresh[0]["ts"]}

    def close(self, incident_id: int, *, outcome: str, resumed: Mapping[str, Any] | None = None,
              steps_before: int = -1, note: str = "") -> dict[str, Any]:
        """Close the incident with its timeline; ETTR events for its stretches."""
        inc = self.fleet.incident(incident_id)
        now = time.time()
        fields: dict[str, Any] = {"state": outcome, "closed_ts": now}
        if resumed:
            fields["resumed_ts"] = resumed["ts"]
            restored = resumed.get("restored_step")
            if restored is not None and steps_before >= 0:
                fields["lost_steps"] = max(0, steps_before - restored)
        if note:
            fields["summary"] = f"{inc.summary}; {note}" if inc.summary else note
        self.fleet.update_incident(incident_id, **fields)
        inc = self.fleet.incident(incident_id)
        # closed again (its restart_job cleared): the same stretches again, which the ledger keeps once
        for kind, start, end in (("detection", inc.first_alert_ts, inc.opened_ts),
                                 ("diagnosis", inc.diagnosis_start_ts, inc.decided_ts),
                                 ("recovery", inc.decided_ts, inc.resumed_ts)):
            if start is not None and end is not None and end >= start:
                self.fleet.add_ettr(inc.job, kind, start, end, incident_id=incident_id)
        return {"incident": incident_id, "state": inc.state, "timeline": self.timeline(incident_id)}

    # ---- ETTR ------------------------------------------------------------------------------------------
    def step_history(self, job: str, rank: int = 0) -> list[dict[str, Any]]:
        """Every step record of ``rank`` of the job, from every machine that ran it (the rank moves when
        its machine is evicted), oldest first. Each machine counts its own incarnations; here
        ``incarnation`` is renumbered across machines in the order the parts started, so a later restart
        always has the higher number."""
        argv = [self.inventory.tg_node, "job", "steps", "--job", job, "--rank", str(rank)]
        results = self._run(self.inventory.machines, lambda m: argv, timeout=30)
        records = [dict(r, machine=name) for name, res in results.items() if res.ok
                   for r in (res.json() or {}).get("steps", [])]
        records.sort(key=lambda r: float(r.get("ts", 0.0)))
        order: dict[tuple[str, int], int] = {}
        for r in records:
            key = (r["machine"], int(r.get("incarnation", 0)))
            r["incarnation"] = order.setdefault(key, len(order))
        return records

    def ettr_report(self, job: str, *, window_s: float = 3600.0,
                    records: Sequence[Mapping[str, Any]] | None = None, as_of: float | None = None
                    ) -> dict[str, Any]:
        """The job's effective training time ratio, cumulative (since its first step) and over the last
        ``window_s``, and each closed incident's time split into detection, diagnosis, recovery and lost
        work (steps recomputed after the restore), summed by failure cause. ``records``: the job's
        :meth:`step_history` when the caller has it already (one round of sessions less), read at
        ``as_of`` (default: now)."""
        now = time.time() if as_of is None else as_of
        records = list(self.step_history(job) if records is None else records)
        if not records:
            raise TrainguardError(f"job {job} has no step records on any machine of the inventory; has it run?")
        first = min(float(r["ts"]) - float(r.get("step_time_s") or 0.0) for r in records)
        incidents, by_cause = [], {}
        since = first
        for inc in self.fleet.incidents(job):
            if inc.state not in ("resolved", "failed") or inc.first_alert_ts is None:
                continue
            split = ettr.incident_split({"first_alert_ts": inc.first_alert_ts, "opened_ts": inc.opened_ts,
                                         "diagnosis_start_ts": inc.diagnosis_start_ts, "decided_ts": inc.decided_ts,
                                         "resumed_ts": inc.resumed_ts}, records, since_ts=since)
            incidents.append({"incident": inc.id, "category": inc.category, "state": inc.state,
                              **{k: round(v, 3) for k, v in split.items()}})
            cause = by_cause.setdefault(inc.category or "unknown", {"incidents": 0, "seconds": 0.0})
            cause["incidents"] += 1
            cause["seconds"] = round(cause["seconds"] + sum(split.values()), 3)
            since = inc.resumed_ts or since
        # the window ends at the last finished step while the job steps on (no incident open, no stall)
        now = ettr.window_end(records, now, incident_open=any(i.state in OPEN_INCIDENT_STATES
                                                              for i in self.fleet.incidents(job)))
        return {"job": job, "cumulative": ettr.ettr(records, start_ts=first, end_ts=now).as_dict(),
                "sliding": {"window_s": window_s,
                            **ettr.ettr(records, start_ts=max(first, now - window_s), end_ts=now).as_dict()},
                "incidents": incidents, "by_cause": by_cause}

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


def _described(results: Mapping[str, RunResult]) -> dict[str, str]:
    """What each machine's stop said: "stopped", or why not."""
    return {n: ("stopped" if r.ok else r.describe()) for n, r in results.items()}


def _held(copies: Any) -> list[tuple[str, int, int]]:
    """``(tier, step, rank)`` of the copies a ``tg-node ckpt list`` document lists."""
    return [(str(c["tier"]), int(c["step"]), int(c["rank"])) for c in copies or []
            if isinstance(c, Mapping) and isinstance(c.get("step"), int) and isinstance(c.get("rank"), int)]


SECONDARY_KINDS = ("peer_connection", "collective_timeout", "network")


def _verdict(by_machine: Mapping[str, Any]) -> dict[str, Any]:
    """The logs' verdict across machines from each one's (False: unreachable; None: no verdict), and the
    ``culprit``: the machine whose rank failed first of its own accord (not echoing a peer's end), when the
    logs tell."""
    verdicts = {n: v or {"class": "unreachable" if v is False else "unknown"} for n, v in by_machine.items()}
    classes = {v.get("class") for v in verdicts.values()}
    overall = next((c for c in ("user_code", "infrastructure", "unknown") if c in classes), "none")
    first: list[tuple[float, str]] = []
    for n, v in verdicts.items():
        ts = (v.get("first_failure") or {}).get("ts")
        if v.get("class") in ("user_code", "infrastructure", "unknown") and v.get("kind") not in SECONDARY_KINDS \
                and isinstance(ts, (int, float)):
            first.append((float(ts), n))
    return {"verdict": overall, "machines": verdicts, "culprit": min(first)[1] if first else None}


def _digest(r: RunResult) -> str | None:
    """The alignment digest of a ``tg-node align`` or ``tg-node diag --level 3 --align`` run (None when
    it did not run through: that machine disagrees with any majority)."""
    doc = r.answer() or {}
    part = doc if doc.get("test") == "align" else doc.get("align") or {}
    return part.get("digest") if part.get("exit_code", 1) == 0 else None


def neighbour_groups(names: Sequence[str]) -> list[list[str]]:
    """L3's groups: neighbours in pairs, an odd one out joining the last pair."""
    groups = [list(names[i:i + 2]) for i in range(0, len(names), 2)]
    if len(groups) > 1 and len(groups[-1]) == 1:
        odd = groups.pop()
        groups[-1] += odd
    return groups


def _replay_result(statuses: Mapping[str, Any], steps: int, world_size: int) -> str | None:
    """A replay group's result once every machine's part ended: the ranks' parameter digests after the
    last step (``rank:digest`` in rank order), or ``failed: ...``; None while it runs."""
    if any(d.get("error") for d in statuses.values()):
        return "failed: " + "; ".join(f"{n}: {d['error']}" for n, d in statuses.items() if d.get("error"))[:300]
    if any(d.get("state") == "running" for d in statuses.values()):
        return None
    bad = {n: d.get("returncode") for n, d in statuses.items() if d.get("returncode") not in (0, None)}
    if bad:
        return f"failed: exit codes {bad}"
    digests = {}
    for d in statuses.values():
        for r in d.get("ranks", []):
            last = r.get("last_step") or {}
            if last.get("step") != steps - 1 or last.get("incarnation") != d.get("incarnation"):
                return f"failed: rank {r.get('rank')} ended at step {last.get('step')}, not {steps - 1}"
            digests[int(r["rank"])] = last.get("param_digest")
    if len(digests) != world_size:
        return f"failed: {len(digests)} of {world_size} ranks reported"
    return ",".join(f"{r}:{digests[r]}" for r in sorted(digests))


def asdict_action(a: Any) -> dict[str, Any]:
    return {"id": a.id, "kind": a.kind, "machines": a.machines, "outcome": a.outcome, "detail": a.detail,
            "dry_run": a.dry_run, "evidence": a.evidence}



"""A job's lifecycle on its machines: launch, warm interpreters (arm), stop (reading logs, status and checkpoint
copies in the same sessions), restart after a recovery, progress, resume."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from trainguard.core.errors import TrainguardError
from trainguard.core.topology import Topology
from trainguard.node_tools import launcher
from trainguard.node_tools.transport import RunResult
from trainguard.operators.control.base import PORT_BASE, PORT_SPAN, ROLE_STATE, Part
from trainguard.operators.fleet import states
from trainguard.operators.fleet.db import JobReleased
from trainguard.operators.policy import ladder

if TYPE_CHECKING:
    from trainguard.operators.jobspec import JobSpec

SECONDARY_KINDS = ("peer_connection", "collective_timeout", "network")
#: seconds between two rounds over every machine asking whether a restarted job ended without a step
EXITED_CHECK_S = 10.0


def described(results: Mapping[str, RunResult]) -> dict[str, str]:
    """What each machine's stop said: "stopped", or why not."""
    return {n: ("stopped" if r.ok else r.describe()) for n, r in results.items()}


def held_copies(copies: Any) -> list[tuple[str, int, int]]:
    """``(tier, step, rank)`` of the copies a ``tg-node ckpt list`` document lists."""
    return [(str(c["tier"]), int(c["step"]), int(c["rank"])) for c in copies or []
            if isinstance(c, Mapping) and isinstance(c.get("step"), int) and isinstance(c.get("rank"), int)]


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


class Jobs(Part):
    """Starting, stopping and restarting a job; reading its progress."""

    def sync_inventory(self) -> list[str]:
        """Register the inventory's machines that the fleet database does not know yet."""
        return self.fleet.register_machines([(m.name, m.address, ROLE_STATE.get(m.role, states.STANDBY),
                                              f"from the inventory (role {m.role})") for m in self.inventory.machines])

    def launch_job(self, job: str, topology: Topology, machine_names: Sequence[str], *,
                   train_args: Sequence[str] = (), revision: str = "r0", arm: bool = True,
                   warm: Sequence[str] = (), spec: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Record a job in the fleet database and start it on ``machine_names`` (node-rank order); the
        machines in ``warm`` (parked beforehand, as standbys are) start on their warm interpreters. With
        ``arm``, then park warm interpreters beside it on every machine (:meth:`arm`). ``spec``: what the job
        runs (:class:`trainguard.operators.jobspec.JobSpec` as JSON; None: the reference job with
        ``train_args``)."""
        self.sync_inventory()
        self.fleet.upsert_job(job, tp=topology.tp, pp=topology.pp, dp=topology.dp,
                              ranks_per_machine=topology.ranks_per_machine, machines=machine_names,
                              revision=revision, train_args=train_args, spec=spec)
        out = self.launch(job, warm=set(warm) & set(machine_names))
        if arm and out.get("launched"):
            out["armed"] = self.arm(job)
        return out

    # ---- a submitted job (trainguard job submit, tg_job_launch) -----------------------------------------
    def submit(self, spec: JobSpec) -> dict[str, Any]:
        """Reserve the spec's machines (named, or a count of free checked standbys) and record the job
        (``launching``) with its spec, in one transaction. Submitting the same spec again is a no-op."""
        self.sync_inventory()
        existing = next((j for j in self.fleet.jobs() if j.name == spec.name), None)
        if existing is not None and existing.state in ("launching", "running"):
            if existing.spec != spec.document():
                raise TrainguardError(f"job {spec.name} is {existing.state} with another spec; stop it first "
                                      f"('trainguard job stop {spec.name}') or submit under another name",
                                      exit_code=3)
            return {"job": spec.name, "machines": list(existing.machine_list), "submitted": False}
        if isinstance(spec.machines, int):
            free = self.fleet.free_machines()
            if len(free) < spec.machines:
                raise TrainguardError(f"job {spec.name} needs {spec.machines} machines, {len(free)} are free "
                                      f"({', '.join(free) or 'none'}); free more (tg_standby_pool) or ask for fewer",
                                      exit_code=3)
            names = free[: spec.machines]
        else:
            names = list(spec.machines)
            for name in names:
                self.inventory.machine(name)  # a one-line error naming the machines there are
        topo = spec.topology(len(names))
        created = self.fleet.submit_job(spec.name, spec=spec.document(), machines=names, tp=topo.tp, pp=topo.pp,
                                        dp=topo.dp, ranks_per_machine=topo.ranks_per_machine,
                                        train_args=spec.args, revision=spec.revision)
        return {"job": spec.name, "machines": list(self.fleet.job(spec.name).machine_list), "submitted": created}

    def launch_submitted(self, job: str) -> dict[str, Any]:
        """Start a submitted job on its reserved machines (each start recorded; repeating it is a no-op)."""
        # one launch per submission: a job submitted again after a stop starts again
        return self.launch(job, warm_if_parked=True, tag=f"submitted-{int(self.fleet.job(job).created_ts * 1000)}")

    def first_step(self, job: str, *, timeout_s: float, poll_s: float = 1.0) -> dict[str, Any]:
        """Wait until every rank of the job finished a step: ``{"step": N, "seconds": S}``; raises when a machine's
        part ended first (with the logs' verdict) or ``timeout_s`` passed."""
        t0 = time.monotonic()
        while True:
            now = self.progress(job)
            if now["step"] >= 0:
                self.fleet.set_job_state(job, "running", unless=states.RELEASED_JOB_STATES)
                return {"step": now["step"], "seconds": round(time.monotonic() - t0, 3), "states": now["states"]}
            ended = sorted(n for n, s in now["states"].items() if s == "exited")
            if ended:
                raise TrainguardError(f"job {job} ended on {', '.join(ended)} before its first step "
                                      f"({', '.join(str(now['states'][n]) for n in ended[:3])}); read its logs "
                                      f"with 'tg-node logs --job {job}' on that machine")
            if time.monotonic() - t0 > timeout_s:
                raise TrainguardError(f"job {job} finished no step within {timeout_s:.0f} s of its start")
            time.sleep(poll_s)

    def release(self, job: str, *, state: str = "stopped", reason: str = "",
                faulty: Mapping[str, str] | None = None) -> dict[str, Any]:
        """Stop the job on its machines and return them to the pool (``trainguard job stop``); repeating it is a
        no-op. The job's incidents still open or waiting for a human are closed as superseded. ``faulty``
        (machine -> why) and the machines whose explicit fault no incident acted on are evicted, not pooled."""
        running = self.fleet.job(job).state not in states.RELEASED_JOB_STATES
        # a machine whose explicit fault no incident acted on (its eviction waited for a human) is no machine to
        # hand to the next job: it goes to repair, not to the pool
        faulty = dict(faulty or {})
        for inc in self.fleet.incidents(job):
            if inc.state in states.OPEN_INCIDENT_STATES:
                faulty |= self.faults_left(inc.id)
        released = self.fleet.release_job(job, state=state, reason=reason, faulty=faulty,
                                          supersede=f"job {job} was {state}" + (f" ({reason})" if reason else ""))
        # released first, then stopped: a launch of the job under way (an incident's restart) either set it running
        # before the release, and this stop ends what it started, or finds it released and ends that itself
        stopped = self.stop(job) if running else {}
        return {"job": job, "state": state, "stopped": stopped, "released": released,
                **({"evicted": sorted(faulty)} if faulty else {})}

    def faults_left(self, incident_id: int) -> dict[str, str]:
        """Explicit machine faults among the incident's alerts (those that joined it after its triage too) on
        machines that still serve the job: machine -> the alerts' kinds. Every one is acted on before the
        incident closes, and none goes back to the pool with its machine."""
        inc = self.fleet.incident(incident_id)
        # only the kinds that can be explicit machine faults: the resume wait asks every second, and the
        # incident may hold an alert storm of another kind (every rank's hang)
        return ladder.explicit_faults([a.document for a in self.fleet.alerts_of(incident_id, kinds=ladder.EXPLICIT
                                                                                 | ladder.XID)],
                                      self.fleet.job(inc.job).machine_list)

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
        program = self.park_program(j)
        results = self.transport.run_many(self.inventory.named(todo), lambda m: [
            self.inventory.tg_node, "standby", "park", "--nproc", str(j.ranks_per_machine), *program], timeout=300)
        return {"parked": sorted(ready | {n for n, r in results.items() if r.ok}),
                "failed": {n: r.describe() for n, r in results.items() if not r.ok}}

    @staticmethod
    def park_program(j: Any) -> list[str]:
        """``tg-node standby park``'s arguments naming the job's own program (its script or module in its
        working directory: what its warm interpreters import ahead); none for the reference job (the demo's
        program is the default)."""
        from trainguard.operators.jobspec import stored_spec

        if not j.spec:
            return []
        spec = stored_spec(j)
        if spec.is_reference:
            return []
        return [*(["--workdir", spec.workdir] if spec.workdir else []), "--entry", spec.entry,
                *(["--module"] if spec.module else [])]

    def plan_launch(self, job: str, warm: set[str], *, warm_if_parked: bool = False,
              restore_max_step: int | None = None) -> launcher.JobPlan:
        """The launch of the job's stored spec on its machine list. ``restore_max_step`` (this launch only):
        the reference job takes it as a flag, a job on the public face as ``TG_RESTORE_MAX_STEP``."""
        from trainguard.operators.jobspec import stored_spec

        j = self.fleet.job(job)
        spec = stored_spec(j)
        extra_args: list[str] = []
        if restore_max_step is not None and spec.is_reference:
            extra_args, restore_max_step = ["--restore-max-step", str(restore_max_step)], None
        launches = sum(1 for a in self.fleet.actions() if a.kind == "launch" and a.key.startswith(f"launch:{job}:"))
        # the job's own command, working directory, environment and launcher, from its stored spec
        return spec.plan(job=job, topology=j.topology, machines=self.inventory.named(j.machine_list),
                         train_args=[*j.train_args, *extra_args], revision=j.revision,
                         master_port=PORT_BASE + launches % PORT_SPAN, warm=warm, warm_if_parked=warm_if_parked,
                         restore_max_step=restore_max_step)

    def launch(self, job: str, *, warm: set[str] | None = None, warm_if_parked: bool = False,
               incident_id: int | None = None, restore_max_step: int | None = None, tag: str = "") -> dict[str, Any]:
        """Launch the job on its machine list: those in ``warm`` on their parked interpreters; with
        ``warm_if_parked``, every other one on its parked interpreters if it has them, else cold."""
        warm = set(warm or ())
        if self.fleet.job(job).state in states.RELEASED_JOB_STATES:  # its machines may serve another job now
            raise TrainguardError(f"job {job} was stopped (or its launch failed) and its machines released; submit "
                                  f"it again ('trainguard job submit')", exit_code=3)
        self.memory.stopped.pop(job, None)  # what a stop found no longer holds once the job runs again
        self.memory.copies.pop(job, None)
        j = self.fleet.job(job)
        if j.pending_revision:  # a lazy code update waits for the next restart: this one
            self.fleet.set_revision(job, j.pending_revision)
        # this launch only: later restarts restore the newest step again
        plan = self.plan_launch(job, warm, warm_if_parked=warm_if_parked, restore_max_step=restore_max_step)
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
        self.running_or_end(job, j.machine_list)
        return {"launched": True, "machines": j.machine_list, "port": plan.master_port, "warm": started_warm,
                "incarnations": {n: d.get("incarnation") for n, d in docs.items()}}

    def running_or_end(self, job: str, started: Sequence[str]) -> None:
        """After a start of the job on ``started``: the job is set running, unless a person stopped it meanwhile (a
        restart of an incident that a stop crossed); then what was started is ended again, not left training on
        machines that went back to the pool, and it raises (exit 3)."""
        try:
            self.fleet.set_job_state(job, "running", unless=states.RELEASED_JOB_STATES)
        except JobReleased:
            launcher.stop_sessions(self.inventory, job, self.inventory.named(started), grace_s=0.0,
                                   transport=self.transport)
            raise TrainguardError(f"job {job} was stopped while it launched: what the launch started was ended "
                                  f"again; submit it again ('trainguard job submit')", exit_code=3) from None

    def start(self, job: str) -> dict[str, Any]:
        """Start the job again on its machine list (an operator's start of a job stopped by hand): on warm
        interpreters where they are parked, restoring its newest committed checkpoint. Each call is a launch
        of its own (recorded); stop the job first when it runs."""
        starts = sum(1 for a in self.fleet.actions() if a.key.startswith(f"launch:{job}:start-"))
        return self.launch(job, warm_if_parked=True, tag=f"start-{starts + 1}")

    def hot_update(self, job: str, revision: str, *, reason: str = "") -> dict[str, Any]:
        """Switch the job to ``revision`` now, in place: stop it, record the revision, start it again on
        the same machines (on their parked warm interpreters where there are some; nothing rescheduled),
        restoring its newest committed checkpoint. Repeating it is a no-op."""
        self.fleet.record_revision(job, revision, reason=reason)
        if self.fleet.job(job).revision == revision:
            return {"updated": False, "job": job, "reason": f"job {job} already runs {revision}"}
        stopped = self.stop(job)
        # the steps every rank finished: what the stop found (no more come after it)
        before = self.memory.stopped.pop(job, None) or self.progress(job)
        self.fleet.set_revision(job, revision)
        machines = self.fleet.job(job).machine_list
        restart_ts = time.time()
        updates = sum(1 for a in self.fleet.actions() if a.key.startswith(f"launch:{job}:update-"))
        started = self.launch(job, warm_if_parked=True, tag=f"update-{updates + 1}-{revision}")
        return {"updated": bool(started.get("launched")), "job": job, "revision": revision, "machines": machines,
                "stopped": stopped, "started": started, "warm": started.get("warm", []),
                "steps_before": before.get("step", -1), "restart_ts": restart_ts}

    def stop(self, job: str, *, grace_s: float | None = None) -> dict[str, str]:
        """Stop the job on every machine of it that answers (SIGKILL after ``grace_s``, default the
        configured ``stop_grace_s``); returns what each said."""
        return described(self._stop(job, grace_s))

    def _stop(self, job: str, grace_s: float | None = None, logs_since: float | None = None
              ) -> dict[str, RunResult]:
        # marked everywhere before anything is stopped: ranks ended by a peer's stop are then not reported
        # as new failures (both phases in one round of sessions)
        names = self.fleet.job(job).machine_list
        if grace_s is None and set(names) & set(getattr(self.transport, "gone", ())):
            # a machine of the job is gone: the survivors hang in a collective with it and cannot act on a SIGTERM
            grace_s = 0.0
        results = launcher.stop_sessions(self.inventory, job, self.inventory.named(names),
                                         grace_s=self.cfg.stop_grace_s if grace_s is None else grace_s,
                                         transport=self.transport, logs_since=logs_since, status=True, copies=True)
        statuses = {n: (r.answer() or {}).get("status") if r.ok else None for n, r in results.items()}
        # the checkpoint copies each machine holds now that nothing writes them: what an eviction checks
        self.memory.copies[job] = {n: held_copies((r.answer() or {}).get("copies")) if r.ok else None
                             for n, r in results.items()}
        self.memory.stopped.pop(job, None)
        if all(isinstance(st, dict) and st.get("state") in ("exited", "absent") for st in statuses.values()):
            self.memory.stopped[job] = {"machines": list(names), "step": launcher.min_step(statuses),
                                  "copies": {n: None if c is None else [list(x) for x in c]
                                             for n, c in self.memory.copies[job].items()}}
        return results

    def stop_and_read_logs(self, job: str, since: float = 0.0, *, incident: int | None = None
                           ) -> tuple[dict[str, str], dict[str, Any]]:
        """:meth:`stop`, and the logs' verdict across the job's machines, read in the same sessions after
        the stop: user_code if any rank's first failure is the job's own code, infrastructure, unknown,
        or none. With ``incident``: the machine where the failure started (the ``culprit``, when the logs tell
        and it is not the job's own code) is recorded against that incident, and ``implicated`` lists the job's
        other incidents within ``repeat_window_s`` that implicated it and left it in the job (what makes a repeat
        offender; None when nothing was implicated)."""
        results = self._stop(job, logs_since=since)
        logs = _verdict({n: r.reachable and ((r.answer() or {}).get("logs") or {}).get("verdict")
                         for n, r in results.items()})
        culprit = logs.get("culprit")
        logs["implicated"] = None
        if incident is not None and logs["verdict"] != "user_code" and culprit \
                and culprit in self.fleet.job(job).machine_list:
            first = logs["machines"].get(culprit) or {}
            why = f"{first.get('class')} {first.get('kind') or ''}: {first.get('evidence') or ''}"
            self.fleet.record_action(f"implicate:{incident}:{culprit}", kind="implicate", incident_id=incident,
                                     machines=[culprit], evidence={"why": why[:300]})
            logs["implicated"] = self.fleet.implicated(job, culprit, since=time.time() - self.cfg.repeat_window_s,
                                                       other_than=incident)
        return described(results), logs

    def stop_found(self, job: str) -> dict[str, Any] | None:
        """What this controller's last stop of ``job`` found, when it ended the job on every machine: its
        machines, the lowest step every rank finished and the checkpoint copies each held (handed on to the
        tasks after the stop through XCom: :class:`~trainguard.operators.models.StopFound`)."""
        found = self.memory.stopped.get(job)
        return dict(found) if found else None

    def progress(self, job: str, machines: Sequence[str] | None = None) -> dict[str, Any]:
        """The lowest step every rank finished and each machine's incarnation and state (of ``machines`` of the
        job only, when given)."""
        j = self.fleet.job(job)
        names = j.machine_list if machines is None else list(machines)
        st = launcher.status(self.inventory, job, self.inventory.named(names), transport=self.transport)
        return {"step": launcher.min_step(st),
                "incarnations": {n: d.get("incarnation") for n, d in st.items()},
                "states": {n: d.get("state", d.get("error")) for n, d in st.items()},
                # ranks that hold still on purpose (a non-finite step: they wait for the control plane)
                "held": sorted(int(r["rank"]) for d in st.values() for r in d.get("ranks") or []
                               if isinstance(r, dict) and r.get("status") == "held" and "rank" in r)}

    def trains(self, job: str, *, within_s: float = 15.0, poll_s: float = 1.0) -> bool:
        """Whether every rank of the job finishes a step within ``within_s`` (the job trains right now). A job run as
        replica groups trains while the groups that run (at least its ``min_replicas``) do: a group that stopped
        is its own failure, whose alerts open an incident of their own (:meth:`training_groups`)."""
        start = self.progress(job)
        names: list[str] | None = None
        if not all(s == "running" for s in start["states"].values()):
            names = self.training_groups(job, start["states"])
            if not names:
                return False
            start = self.progress(job, names)
        if start["step"] < 0 or not all(s == "running" for s in start["states"].values()):
            return False
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            now = self.progress(job, names)
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
        try:  # only what rank 0 ran since the restart: its machine reads the tail of its history
            records = launcher.steps(self.inventory, job, m0, rank=0, since_ts=restart_ts, transport=self.transport)
        except TrainguardError:
            return None
        fresh = [r for r in records if r.get("ts", 0) > restart_ts]
        if not fresh:
            # whether the job ended everywhere without a step: a round over every machine, so at most every
            # EXITED_CHECK_S per job (a crash also comes as alerts, which end the wait at once)
            checked = self.memory.exited_checked.get((job, restart_ts), 0.0)
            if time.monotonic() - checked < EXITED_CHECK_S:
                return None
            self.memory.exited_checked[(job, restart_ts)] = time.monotonic()
            st = launcher.status(self.inventory, job, self.inventory.named(j.machine_list), transport=self.transport)
            if st and all(d.get("state") == "exited" for d in st.values()):
                raise TrainguardError(f"job {job} ended on every machine after the restart without a step; "
                                      f"see 'tg-node logs --job {job}' on its machines")
            return None
        st = launcher.status(self.inventory, job, self.inventory.named(j.machine_list), transport=self.transport)
        steps = [r.get("step") for d in st.values() for r in d.get("ranks", [])]
        if not steps or any(s is None or s < fresh[0]["step"] for s in steps):
            return None
        return {"first_step": fresh[0]["step"], "restored_step": fresh[0].get("ckpt_restored_step"),
                "ts": fresh[0]["ts"]}

    def parked(self, names: Sequence[str]) -> set[str]:
        """Which of ``names`` have warm interpreters parked."""
        results = self.transport.run_many(self.inventory.named(names),
                                          lambda m: [self.inventory.tg_node, "standby", "status"], timeout=20)
        return {n for n, r in results.items() if r.ok and (r.json() or {}).get("state") == "parked"}

    def training_groups(self, job: str, states: Mapping[str, Any]) -> list[str] | None:
        """For a job run as replica groups with the degrade path on: the machines of its groups whose every machine
        runs (``states``: each machine's job state), when they are at least its ``min_replicas``; else None."""
        from trainguard.operators.jobspec import replica_groups

        j = self.fleet.job(job)
        groups = replica_groups(j, degrading=True)
        if groups is None:
            return None
        per = len(j.machine_list) // max(1, j.dp)  # a replica's consecutive machines (the launch's replica_of)
        groups_of = [j.machine_list[i:i + per] for i in range(0, len(j.machine_list), per)]
        running = [g for g in groups_of if all(states.get(n) == "running" for n in g)]
        return [n for g in running for n in g] if len(running) >= groups.min_replicas else None

    def rejoined(self, job: str, machines: list[str], restart_ts: float) -> dict[str, Any] | None:
        """Whether the replica groups started on ``machines`` at ``restart_ts`` train again: the first rank of
        their first machine committed a step after the start, and every rank of those machines reports a step
        at least as far. Then the step it rejoined at, the step it healed from (a live replica's state, not a
        checkpoint) and how many groups trained it; else None."""
        first = self.inventory.machine(machines[0])
        j = self.fleet.job(job)
        ranks = j.topology.ranks_on(j.machine_list.index(machines[0]))
        try:
            records = launcher.steps(self.inventory, job, first, rank=ranks[0], since_ts=restart_ts,
                                     transport=self.transport)
        except TrainguardError:
            return None
        fresh = [r for r in records if r.get("ts", 0) > restart_ts]
        if not fresh:
            return None
        st = launcher.status(self.inventory, job, self.inventory.named(machines), transport=self.transport)
        steps = [r.get("step") for d in st.values() for r in d.get("ranks", [])]
        expected = len(machines) * j.topology.ranks_per_machine
        if len(steps) < expected or any(s is None or s < fresh[0]["step"] for s in steps):
            return None
        return {"first_step": fresh[0]["step"], "healed_from_step": fresh[0].get("healed_from_step"),
                "participants": fresh[0].get("participants"), "ts": fresh[0]["ts"]}

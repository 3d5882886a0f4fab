"""A job restarted after a recovery's evictions: on warm interpreters where they are parked, from its newest committed
checkpoint (or the step the incident caps it at), a machine that fails to start replaced by the next standby."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from trainguard.core.errors import TrainguardError
from trainguard.node_tools import launcher
from trainguard.operators.control.base import Part

if TYPE_CHECKING:
    from trainguard.operators.control.evictions import Evictions
    from trainguard.operators.control.jobs import Jobs


class Recovery(Part):
    """The restart of an incident's job (the tasks' ``restart_job``, the escalation's restarts)."""

    def __init__(self, *base: Any, jobs: Jobs, evictions: Evictions) -> None:
        super().__init__(*base)
        self.jobs = jobs
        self.evictions = evictions

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
        if self.fleet.job(job).state == "stopped":  # a person's stop wins over an incident still recovering the job
            raise TrainguardError(f"job {job} was stopped by hand while incident {incident_id} recovered it; not "
                                  f"restarted (start it again with 'trainguard job start {job}')")
        self.memory.stopped.pop(job, None)
        before: dict[str, Any] | None = dict(found) if found else None
        if before is not None:
            stopped = {n: "stopped" for n in before["machines"]}
        else:
            before = self.jobs.progress(job)
            # the handler has usually stopped it already: no stop when no machine runs it
            done = before["states"] and all(s in ("exited", "absent") for s in before["states"].values())
            stopped = {n: "not running" for n in before["states"]} if done else self.jobs.stop(job)
        replaced: dict[str, str] = {}
        attempts = self.cfg.restart_attempts
        launches = sum(1 for a in self.fleet.actions(incident_id) if a.kind == "launch")
        for attempt in range(attempts):
            n = launches + attempt  # each restart of the incident is an action of its own (a repeat is a no-op)
            try:
                started = self.jobs.launch(job, warm_if_parked=True, incident_id=incident_id,
                                      restore_max_step=restore_max_step,
                                      tag=f"{incident_id}" if not n else f"{incident_id}-restart{n + 1}")
                break
            except launcher.PartsFailed as exc:
                serving = set(self.fleet.job(job).machine_list)
                bad = {n: why for n, why in exc.failed.items() if n in serving}
                if attempt + 1 >= attempts or not bad:
                    return {"job": job, "stopped": stopped, "started": {"launched": False, "error": str(exc)},
                            **self.fleet.wait_for_human(incident_id,
                                                        f"the restart failed {attempt + 1} times: {exc}"[:900]
                                                        + "; next: repair or replace those machines, then resolve the "
                                                          "incident (trigger tg_diagnose with evict to swap them)"),
                            "replaced": replaced}
                fresh = set(self.fleet.job(job).machine_list) - set(before.get("states") or before.get("machines")
                                                                    or [])
                ev = self.evictions.evict(incident_id, sorted(bad), breaker=not set(bad) <= fresh,
                                reason="failed to start: " + "; ".join(bad.values())[:300])
                if ev.get("waiting_human"):
                    return {"job": job, "stopped": stopped, "started": {"launched": False, "error": str(exc)},
                            **ev, "replaced": replaced}
                replaced.update(ev.get("swaps") or {})
        self.fleet.update_incident(incident_id, decided_ts=time.time())
        return {"job": job, "stopped": stopped, "started": started, "warm": started.get("warm", []),
                "steps_before": before.get("step", -1), "restart_ts": time.time(), "replaced": replaced}

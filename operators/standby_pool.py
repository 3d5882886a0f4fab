"""The warm standby pool's operations, as plain Python for ``tg_standby_pool`` (no Airflow import).

One pool run: :func:`plan` sizes the pool from the fleet's history (:mod:`trainguard.operators.policy.pool`) and
picks the machines to provision, re-check and retire; :func:`claim` applies the retirements and moves
the picked machines to ``self_check`` (so no activation takes one mid-check); :func:`check` runs one
machine's self-check (``tg-node diag`` L1 + L2) and parks the healthy ones warm (``tg-node standby
park``) as standbys, sending failures to repair. Every step is a fleet transaction; running a pool job
again on a full, fresh pool changes nothing.

Where free machines come from is a :class:`Provider`: :class:`InventoryProvider` (the static inventory:
machines of role ``free`` the fleet holds as ``provisioning``) by default; a cloud or Kubernetes
provider would allocate machines and register them the same way.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

from trainguard.operators.control import Controller
from trainguard.operators.fleet import FleetStore, states
from trainguard.operators.policy import pool

PARK_TIMEOUT_S = 240.0


class Provider(Protocol):
    def free(self, ctl: Controller) -> list[str]:
        """Machines that may join the pool now, in the order to use them."""
        ...


class InventoryProvider:
    """The static inventory: machines the fleet holds as ``provisioning``, in inventory order."""

    def free(self, ctl: Controller) -> list[str]:
        provisioning = {m.name for m in ctl.fleet.machines(state=states.PROVISIONING)}
        return [m.name for m in ctl.inventory.machines if m.name in provisioning]


def _ranks_per_machine(ctl: Controller) -> int:
    """What a parked standby pre-warms: one interpreter per rank of the running jobs' machines."""
    jobs = [j for j in ctl.fleet.jobs() if j.state == "running"]
    return max((j.ranks_per_machine for j in jobs), default=0) or 2


def _standby_program(ctl: Controller) -> list[str]:
    """What a parked standby pre-warms besides torch: ``tg-node standby park``'s arguments for the program of the
    largest running job (its imports and its own modules), and the third-party imports of the other running
    jobs' scripts (``--also``); none (the demo's program) when no job other than the reference job runs."""
    from trainguard.operators.jobspec import stored_spec

    running = sorted((j for j in ctl.fleet.jobs() if j.state == "running" and j.spec),
                     key=lambda j: (-len(j.machine_list), j.name))
    if not running:
        return []
    out = ctl.jobs.park_program(running[0])
    for j in running[1:]:
        spec = stored_spec(j)
        if not spec.is_reference and not spec.module and spec.workdir:
            out += ["--also", f"{spec.workdir.rstrip('/')}/{spec.entry}"]
    return out


def sizing(fleet: FleetStore, now: float) -> tuple[list[pool.Event], dict[str, float], int, int]:
    """The fleet's last window of machine state changes, the failure rate they give, the machines
    serving running jobs, and the pool target those make: the P99 of a day's failures, and never fewer
    than one pipeline's machines (what one over-eviction takes: :func:`pool.over_eviction_floor`)."""
    history = [pool.Event(e.machine, e.to_state, e.ts, e.reason)
               for e in fleet.all_events(since=now - pool.HISTORY_WINDOW_S)]
    rate = pool.failure_rate(history, now)
    running = [j for j in fleet.jobs() if j.state == "running"]
    serving = sum(len(j.machine_list) for j in running)
    floor = pool.over_eviction_floor((j.tp, j.pp, j.dp, j.ranks_per_machine) for j in running)
    return history, rate, serving, max(pool.pool_target(serving, rate["rate"]), floor)


def plan(ctl: Controller, *, target: int | None = None, provider: Provider | None = None,
         now: float | None = None, recheck_age_s: float = pool.RECHECK_AGE_S,
         retire_after: int = pool.RETIRE_AFTER) -> dict[str, Any]:
    """The pool run's plan (changes nothing). ``target``: a pool size given by hand instead of the
    computed one; larger than the standbys plus the free inventory, it is refused (PoolError)."""
    now = time.time() if now is None else now
    ctl.jobs.sync_inventory()
    since = now - pool.HISTORY_WINDOW_S
    history, rate, serving, computed = sizing(ctl.fleet, now)
    evictions: dict[str, int] = {}
    for e in history:
        if e.to_state == states.EVICTED and e.ts >= since:
            evictions[e.machine] = evictions.get(e.machine, 0) + 1
    # a standby the inventory brought in counts as checked when it became one
    standbys = [pool.Standby(m.name, m.checked_ts or m.state_since) for m in ctl.fleet.machines(state=states.STANDBY)]
    free = (provider or InventoryProvider()).free(ctl)
    checking = [m.name for m in ctl.fleet.machines(state=states.SELF_CHECK)]
    if target is not None:
        room = len([n for n in [*(s.name for s in standbys), *checking, *free] if evictions.get(n, 0) < retire_after])
        if target > room:
            raise pool.PoolError(f"pool target {target} is larger than the free inventory ({room} machines: "
                                 f"standbys plus free); add machines to the inventory or ask for at most {room}")
    p = pool.plan_pool(computed if target is None else target, standbys, free, evictions, now, checking=checking,
                       recheck_age_s=recheck_age_s, retire_after=retire_after)
    return {**p.as_dict(), "free": free, "computed_target": computed, "serving_machines": serving,
            "failure_rate": {k: round(v, 6) if isinstance(v, float) else v for k, v in rate.items()},
            "nproc": _ranks_per_machine(ctl), "program": _standby_program(ctl)}


def claim(ctl: Controller, the_plan: dict[str, Any]) -> list[dict[str, Any]]:
    """Retire the plan's repeat offenders and move its machines to ``self_check``; returns one target per
    machine to check (for the mapped task). Idempotent: a machine already there is a no-op."""
    for name in the_plan["retire"]:
        ctl.fleet.transition(name, states.RETIRED, reason="retired: evicted too often")
    targets = []
    for why, names in (("provision", the_plan["provision"]), ("recheck", the_plan["recheck"])):
        for name in names:
            ctl.fleet.transition(name, states.SELF_CHECK, reason=f"pool: {why}")
            targets.append({"machine": name, "why": why, "nproc": int(the_plan["nproc"]),
                            "program": list(the_plan.get("program") or [])})
    return targets


def check(ctl: Controller, target: dict[str, Any]) -> dict[str, Any]:
    """Self-check one machine (L1 + L2); healthy: park it warm and make it a standby; not: repair."""
    name = target["machine"]
    t0 = time.time()
    if ctl.fleet.machine(name).state != states.SELF_CHECK:  # a rerun after it was concluded
        return {"machine": name, "why": target["why"], "state": ctl.fleet.machine(name).state, "skipped": True}
    diag = ctl.diagnosis.diagnose("", [name], levels=(1, 2))
    failed = diag["failed"].get(name)
    if not failed:
        parked = ctl.transport.run(ctl.inventory.machine(name), [ctl.inventory.tg_node, "standby", "park", "--nproc",
                                                                 str(int(target["nproc"])),
                                                                 *map(str, target.get("program") or [])],
                                   timeout=PARK_TIMEOUT_S)
        if not parked.ok:
            failed = f"park: {parked.describe()}"[:300]
    if failed:
        ctl.fleet.transition(name, states.REPAIR, reason=f"self-check failed: {failed}")
    else:
        ctl.fleet.transition(name, states.STANDBY, reason="self-check passed (parked warm)", checked=True)
    return {"machine": name, "why": target["why"], "healthy": not failed, "failed": failed,
            "state": ctl.fleet.machine(name).state, "seconds": round(time.time() - t0, 3)}


def summary(the_plan: dict[str, Any], results: list[dict[str, Any]]) -> dict[str, Any]:
    """What the run did, with a one-line note for the run's page in the UI."""
    joined = [r["machine"] for r in results if r.get("healthy")]
    failed = {r["machine"]: r["failed"] for r in results if r.get("failed")}
    have = the_plan["have"] - len([r for r in results if r["why"] == "recheck" and r.get("failed")]) + \
        len([r for r in results if r["why"] == "provision" and r.get("healthy")])
    parts = [f"pool {have}/{the_plan['target']}"]
    if joined:
        parts.append(f"joined or re-checked: {', '.join(joined)}")
    if failed:
        parts.append(f"to repair: {', '.join(f'{n} ({why})' for n, why in failed.items())}")
    if the_plan["retire"]:
        parts.append(f"retired: {', '.join(the_plan['retire'])}")
    if have < the_plan["target"]:
        left = [n for n in the_plan.get("free", []) if n not in the_plan["provision"]]
        short = the_plan["target"] - have
        parts.append(f"short by {short}: " + ("the next run provisions more" if len(left) >= short
                                              else "add machines to the inventory"))
    return {"standbys": have, "target": the_plan["target"], "joined": joined, "failed": failed,
            "retired": the_plan["retire"], "note": "; ".join(parts)}

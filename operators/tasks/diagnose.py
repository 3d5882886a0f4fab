"""The bodies of ``tg_diagnose``'s tasks: the stop-time diagnosis by hand, one mapped task per machine (per
batch of machines past Airflow's ``max_map_length``: :mod:`trainguard.operators.utils.mapping`).
"""

from __future__ import annotations

from typing import Any

from trainguard.operators.control import Controller
from trainguard.operators.tasks import common
from trainguard.operators.utils import mapping


def diagnose_targets(c: Controller, job: str, machines: list[str], level: int, *, max_tasks: int | None = None
                     ) -> list[dict[str, Any]]:
    """One target per machine to diagnose (the job's machines when none are named), or per batch of machines
    when there are more than ``max_tasks`` (default: Airflow's ``max_map_length``)."""
    names = list(machines) or list(c.fleet.job(job).machine_list)
    known = c.inventory.names()
    unknown = [n for n in names if n not in known]
    if unknown:
        c.inventory.machine(unknown[0])  # a one-line error naming the machines there are
    cap = common.max_mapped_tasks() if max_tasks is None else max_tasks
    return [{"job": job, "machines": batch, "level": int(level)} for batch in mapping.batches(names, max_tasks=cap)]


def diagnose_machine(c: Controller, target: dict[str, Any]) -> list[dict[str, Any]]:
    """L1, then L2 (when the level asks) on the target's machines, one after another (one SSH session at a
    time: the task holds one slot of the SSH pool); a verdict per machine."""
    machines = list(target.get("machines") or [target["machine"]])
    common.name_mapped_task(mapping.label(machines))
    levels = tuple(range(1, min(int(target["level"]), 2) + 1))
    out = []
    for name in machines:
        d = c.diagnosis.diagnose(target["job"], [name], levels=levels)
        out.append({"machine": name, "failed": d["failed"].get(name),
                    "report": {lv: r.get(name) for lv, r in d["report"].items()}, "seconds": d["seconds"]})
    return out


def diagnose_neighbours(c: Controller, job: str, results: list[dict[str, Any]], level: int) -> dict[str, Any]:
    """L3 (collectives with neighbours, in pairs) on the machines that passed L1/L2, when asked."""
    results = mapping.flatten(results)
    passed = [r["machine"] for r in results if not r["failed"]]
    if int(level) < 3 or len(passed) < 2:
        return {"failed": {}, "skipped": True}
    out = c.diagnosis.diagnose(job, passed, levels=(3,))
    return {"failed": out["failed"], "report": out["report"].get("L3", {})}


def diagnose_conclude(c: Controller, job: str, results: list[dict[str, Any]], neighbours: dict[str, Any] | None,
                      evict: bool) -> dict[str, Any]:
    """Every machine's verdict; with ``evict``, the failed ones are replaced by standbys, the job restarts
    on its new machine list, and an incident records it."""
    results = mapping.flatten(results)
    failed = {r["machine"]: r["failed"] for r in results if r["failed"]}
    failed.update((neighbours or {}).get("failed") or {})
    out: dict[str, Any] = {"job": job, "machines": [r["machine"] for r in results], "failed": failed}
    if evict and failed:
        incident = common.incident_by_hand(c, job, f"diagnosis by hand: {', '.join(sorted(failed))} failed")
        out.update(common.finish_by_hand(c, incident, sorted(failed), evict=True, restart=False,
                                   reason="failed a diagnosis run by hand",
                                   note=f"{', '.join(sorted(failed))} failed a diagnosis run by hand"))
    verdicts = "; ".join(f"{m} failed {str(why)[:80]}" for m, why in sorted(failed.items()))
    n = len(out["machines"])
    common.note(f"{job}: {n} machine{'' if n == 1 else 's'} diagnosed; " + (verdicts + ("; evicted" if evict else "")
                                                                      if failed else "all passed"))
    return out

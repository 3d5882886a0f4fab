"""The bodies of ``tg_diagnose``'s tasks: the stop-time diagnosis by hand, one mapped task per machine.
"""

from __future__ import annotations

from typing import Any

from operators.tasks import common


def diagnose_targets(job: str, machines: list[str], level: int) -> list[dict[str, Any]]:
    """One target per machine to diagnose (the job's machines when none are named)."""
    c = common.controller()
    names = list(machines) or list(c.fleet.job(job).machine_list)
    for n in names:
        c.inventory.machine(n)  # an unknown name: a one-line error naming the machines there are
    return [{"job": job, "machine": n, "level": int(level)} for n in names]


def diagnose_machine(target: dict[str, Any]) -> dict[str, Any]:
    """L1, then L2 (when the level asks) on one machine: one mapped task each, in the SSH pool."""
    common.name_mapped_task(target["machine"])
    levels = tuple(range(1, min(int(target["level"]), 2) + 1))
    out = common.controller().diagnose(target["job"], [target["machine"]], levels=levels)
    return {"machine": target["machine"], "failed": out["failed"].get(target["machine"]),
            "report": {lv: r.get(target["machine"]) for lv, r in out["report"].items()}, "seconds": out["seconds"]}


def diagnose_neighbours(job: str, results: list[dict[str, Any]], level: int) -> dict[str, Any]:
    """L3 (collectives with neighbours, in pairs) on the machines that passed L1/L2, when asked."""
    passed = [r["machine"] for r in results if not r["failed"]]
    if int(level) < 3 or len(passed) < 2:
        return {"failed": {}, "skipped": True}
    out = common.controller().diagnose(job, passed, levels=(3,))
    return {"failed": out["failed"], "report": out["report"].get("L3", {})}


def diagnose_conclude(job: str, results: list[dict[str, Any]], neighbours: dict[str, Any] | None,
                      evict: bool) -> dict[str, Any]:
    """Every machine's verdict; with ``evict``, the failed ones are replaced by standbys, the job restarts
    on its new machine list, and an incident records it."""
    failed = {r["machine"]: r["failed"] for r in results if r["failed"]}
    failed.update((neighbours or {}).get("failed") or {})
    out: dict[str, Any] = {"job": job, "machines": [r["machine"] for r in results], "failed": failed}
    if evict and failed:
        c = common.controller()
        incident = common.incident_by_hand(c, job, f"diagnosis by hand: {', '.join(sorted(failed))} failed")
        out.update(common.finish_by_hand(c, incident, sorted(failed), evict=True, restart=False,
                                   reason="failed a diagnosis run by hand",
                                   note=f"{', '.join(sorted(failed))} failed a diagnosis run by hand"))
    verdicts = "; ".join(f"{m} failed {str(why)[:80]}" for m, why in sorted(failed.items()))
    n = len(out["machines"])
    common.note(f"{job}: {n} machine{'' if n == 1 else 's'} diagnosed; " + (verdicts + ("; evicted" if evict else "")
                                                                      if failed else "all passed"))
    return out

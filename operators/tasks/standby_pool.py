"""The bodies of ``tg_standby_pool``'s tasks: the pool's target, each machine's self-check, the summary.
"""

from __future__ import annotations

from typing import Any

from operators.tasks import common


def pool_plan(target: int) -> dict[str, Any]:
    """Size the pool (``target`` < 0: from the fleet's failure history), retire repeat offenders and claim
    the machines to self-check; returns the plan and one target per machine."""
    from operators import standby_pool

    c = common.controller()
    the_plan = standby_pool.plan(c, target=None if int(target) < 0 else int(target))
    return {"plan": the_plan, "targets": standby_pool.claim(c, the_plan)}


def pool_check(target: dict[str, Any]) -> dict[str, Any]:
    """One machine's self-check (L1 + L2); healthy ones are parked warm as standbys, the rest repaired."""
    common.name_mapped_task(target["machine"])
    from operators import standby_pool

    return standby_pool.check(common.controller(), target)


def pool_conclude(planned: dict[str, Any], results: list[dict[str, Any]] | None) -> dict[str, Any]:
    from operators import standby_pool

    out = standby_pool.summary(planned["plan"], list(results or []))
    common.note(out["note"])
    return out

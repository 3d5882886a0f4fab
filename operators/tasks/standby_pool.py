"""The bodies of ``tg_standby_pool``'s tasks: the pool's target, each machine's self-check, the summary.
"""

from __future__ import annotations

from typing import Any

from trainguard.operators.control import Controller
from trainguard.operators.tasks import common
from trainguard.operators.utils import mapping


def pool_plan(c: Controller, target: int, *, max_tasks: int | None = None) -> dict[str, Any]:
    """Size the pool (``target`` < 0: from the fleet's failure history), retire repeat offenders and claim
    the machines to self-check; returns the plan and the mapped tasks' targets: a list of machines each, one
    machine per task while they fit in ``max_tasks`` (default: Airflow's ``max_map_length``), else batches."""
    from trainguard.operators import standby_pool
    the_plan = standby_pool.plan(c, target=None if int(target) < 0 else int(target))
    cap = common.max_mapped_tasks() if max_tasks is None else max_tasks
    return {"plan": the_plan, "targets": mapping.batches(standby_pool.claim(c, the_plan), max_tasks=cap)}


def pool_check(c: Controller, target: dict[str, Any] | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The self-check (L1 + L2) of a batch of machines, one after another; healthy ones are parked warm as
    standbys, the rest repaired."""
    from trainguard.operators import standby_pool

    batch = target if isinstance(target, list) else [target]
    common.name_mapped_task(mapping.label([t["machine"] for t in batch]))
    return [standby_pool.check(c, t) for t in batch]


def pool_conclude(planned: dict[str, Any], results: list[Any] | None) -> dict[str, Any]:
    from trainguard.operators import standby_pool

    out = standby_pool.summary(planned["plan"], mapping.flatten(results or []))
    common.note(out["note"])
    return out

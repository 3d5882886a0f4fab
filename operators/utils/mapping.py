"""Dynamic task mapping past Airflow's ``max_map_length``: machines in batches.

A mapped task per machine shows each machine in the UI, and Airflow refuses to expand a list longer than
``[core] max_map_length`` (1,024 by default): a diagnosis of 2,000 machines, or a standby pool refilled with
1,500 new ones, would fail before a single SSH session. :func:`batches` keeps one machine per mapped task
while the list fits, and otherwise splits it into at most ``max_tasks`` contiguous batches of equal size (the
last one shorter), every item exactly once, in order. A batch's task handles its machines one after another,
so the ``tg_ssh`` pool still bounds the SSH sessions open at once (a task holds one slot, one session).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

T = TypeVar("T")

#: Airflow's default ``[core] max_map_length``.
DEFAULT_MAX_MAP_LENGTH = 1024


def batches(items: Sequence[T], *, max_tasks: int = DEFAULT_MAX_MAP_LENGTH) -> list[list[T]]:
    """``items`` as at most ``max_tasks`` lists: one item each while they fit, else ``ceil(n / max_tasks)``
    items each (the last shorter), in order."""
    if max_tasks < 1:
        raise ValueError(f"max_tasks={max_tasks} must be at least 1; set [core] max_map_length to 1 or more")
    size = max(1, -(-len(items) // max_tasks))
    return [list(items[i:i + size]) for i in range(0, len(items), size)]


def label(machines: Sequence[str]) -> str:
    """A mapped task's name in the UI: its machine, or its batch's first and last machines and their count."""
    if len(machines) == 1:
        return machines[0]
    return f"{machines[0]} .. {machines[-1]} ({len(machines)})" if machines else "(none)"


def flatten(results: Sequence[Any]) -> list[Any]:
    """The mapped tasks' results as one list: a batch's task returns a list, a single machine's a document."""
    out: list[Any] = []
    for r in results or []:
        if isinstance(r, list):
            out.extend(r)
        elif r is not None:
            out.append(r)
    return out

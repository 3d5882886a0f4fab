"""Dual-phase replay: finding the machine that silently corrupts data (ByteRobust, SOSP 2025, §5.3).

The job's machines form a grid, data-parallel replica ``d`` by pipeline stage ``p`` (tensor parallelism
stays inside a machine). Two partitions of the grid into replay groups, each of ``k`` whole replicas
(``m = k * PP`` machines, ``n = DP / k`` groups):

* **horizontal**: group ``i`` holds replicas ``i*k .. i*k+k-1``, every stage of them;
* **vertical**: group ``j`` takes, at stage ``p``, the replicas of block ``(j + p) mod n``: a shifted
  diagonal, so it also forms ``k`` complete pipelines.

Every group replays the same step from the same checkpoint; a group whose result differs from the
others' (or from the same replay on self-checked standbys, needed when there are only two groups)
holds the culprit. A horizontal and a vertical group share exactly the machines of one block at
the stages ``p`` with ``(j + p) mod n == i``: with ``k = 1`` and ``DP >= PP`` that is one machine. The
culprit is the intersection of the failing horizontal and the failing vertical group.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from trainguard.core.errors import TrainguardError
from trainguard.core.topology import Topology


@dataclass(frozen=True)
class ReplayPlan:
    k: int
    horizontal: list[list[str]]  # machine names, in node-rank order of a (tp, pp, dp=k) sub-job
    vertical: list[list[str]]


def _machine(topo: Topology, machines: Sequence[str], d: int, p: int) -> str:
    return machines[topo.machine_of(topo.rank_of(tp=0, pp=p, dp=d))]


def plan_replay(topo: Topology, machines: Sequence[str], *, k: int = 1) -> ReplayPlan:
    """The horizontal and vertical replay groups of a job running on ``machines`` (node-rank order)."""
    if topo.ranks_per_machine != topo.tp:
        raise TrainguardError(f"dual-phase replay needs one pipeline stage of one replica per machine "
                              f"(ranks per machine = TP = {topo.tp}); this job has {topo.ranks_per_machine}")
    if k < 1 or topo.dp % k:
        raise TrainguardError(f"replay group size k={k} must divide DP={topo.dp}")
    n = topo.dp // k
    if n < 2:
        raise TrainguardError(f"replay needs at least two groups; DP={topo.dp} with k={k} gives {n}")
    horizontal = [[_machine(topo, machines, d, p) for d in range(i * k, i * k + k) for p in range(topo.pp)]
                  for i in range(n)]
    vertical = []
    for j in range(n):
        group = []
        for d_in in range(k):
            for p in range(topo.pp):
                block = (j + p) % n
                group.append(_machine(topo, machines, block * k + d_in, p))
        vertical.append(group)
    return ReplayPlan(k, horizontal, vertical)


def odd_ones(results: Mapping[int, str], reference: str | None = None) -> set[int]:
    """Groups whose replay result (a digest) differs from ``reference`` (the same replay on machines known
    to be healthy, e.g. self-checked standbys), else from the most common result. With neither a
    reference nor a majority (two groups, two results) every group is suspect."""
    if reference is not None:
        return {g for g, digest in results.items() if digest != reference}
    counts = Counter(results.values())
    if len(counts) <= 1:
        return set()
    (top, n_top), *rest = counts.most_common()
    if rest and rest[0][1] == n_top:
        return set(results)
    return {g for g, digest in results.items() if digest != top}


def culprits(plan: ReplayPlan, horizontal_results: Mapping[int, str], vertical_results: Mapping[int, str], *,
             reference: str | None = None) -> set[str]:
    """Machines in both a failing horizontal and a failing vertical group (empty: no corruption seen)."""
    h = {m for i in odd_ones(horizontal_results, reference) for m in plan.horizontal[i]}
    v = {m for j in odd_ones(vertical_results, reference) for m in plan.vertical[j]}
    return h & v


def align_outliers(digests: Mapping[str, str | None], reference: str | None = None
                   ) -> tuple[str | None, list[str], str]:
    """Which machines computed the alignment test differently, by evidence, never by order: ``(the digest
    trusted, the machines that differ from it, why)``. The trusted digest is the ``reference`` (the same test
    on self-checked standbys) when one is given and some machine matches it, else a strict majority's (more
    than half of the machines). A tie (two against two) or a reference no machine matches trusts nothing:
    no machine is called wrong (the caller replays, or asks for a reference)."""
    counts = Counter(digests.values())
    if not counts:
        return None, [], "no digest"
    if reference is not None:
        if counts.get(reference):
            return reference, sorted(n for n, d in digests.items() if d != reference), \
                f"the self-checked standbys' digest {reference} is the reference"
        return None, [], f"no machine matches the self-checked standbys' digest {reference}: inconclusive"
    top, n_top = counts.most_common(1)[0]
    if top is not None and n_top * 2 > len(digests):
        return top, sorted(n for n, d in digests.items() if d != top), f"{n_top} of {len(digests)} machines agree"
    split = ", ".join(f"{n} x {d}" for d, n in counts.most_common())
    return None, [], f"no majority ({split}): a tie is broken by a reference, never by order"

"""Checkpoint policy: which step to verify, which S3 steps retention deletes, and whether an eviction would
destroy the last copy of a rank's state.

Pure functions (no I/O, no Airflow) over what the machines and the S3 tier report.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any


class VerifyError(ValueError):
    """A verification request that cannot be carried out (unknown job, no machines, bad step)."""


def newest_per_job(payloads: Iterable[Mapping[str, Any]]) -> dict[str, int]:
    """The newest step announced per job, from ``checkpoint_committed`` notices (``{"job", "step"}``).
    Older announced steps are not verified: the newest one supersedes them (retention drops them anyway)."""
    out: dict[str, int] = {}
    for p in payloads:
        job, step = p.get("job"), p.get("step")
        if not job or not isinstance(step, int) or isinstance(step, bool) or step < 0:
            continue
        out[str(job)] = max(step, out.get(str(job), -1))
    return out


def newest_candidate(copies: Iterable[Mapping[str, Any]]) -> int | None:
    """From ``tg-node ckpt list`` on the machine holding rank 0: the newest committed step that its
    checkpointer marked as a verification candidate (rank 0's own copy)."""
    steps = [int(c["step"]) for c in copies
             if c.get("tier") == "local" and c.get("rank") == 0 and c.get("committed") and c.get("candidate")]
    return max(steps, default=None)


def s3_deletions(steps: Mapping[int, Mapping[int, bool]], *, world_size: int, keep: int) -> list[int]:
    """Steps of the S3 tier that retention deletes. ``steps``: ``{step: {rank: verified}}``.

    Kept: the newest ``keep`` steps verified on every rank (so always the newest verified one), and every
    step newer than the newest verified one (uploads in flight or being checked). Deleted: the rest. With
    no verified step at all nothing is deleted: the tier may be all a restore has."""
    if keep < 1:
        raise VerifyError(f"S3 retention keep={keep}: must be >= 1")
    complete = sorted((s for s, ranks in steps.items()
                       if len(ranks) >= world_size and all(ranks.get(r) for r in range(world_size))), reverse=True)
    if not complete:
        return []
    kept = set(complete[:keep])
    newest = complete[0]
    return sorted(s for s in steps if s < newest and s not in kept)


# ---- no decision may destroy the last copy ----------------------------------------------------------------
@dataclass(frozen=True)
class Safety:
    """What an eviction does to the job's checkpoints (see :func:`eviction_safety`).

    Attributes:
        step: the newest step every rank can be restored from before the eviction (None: there is none).
        lacking: ranks of ``step`` whose every copy is on machines being evicted (and not in the remote tier).
        rescue: evicted machine (reachable) -> the lacking ranks it holds: copy them out before it goes.
        fallback: the newest step complete on the machines that stay and the remote tier (None: none).
        reason: one line for the record.
    """

    step: int | None
    lacking: tuple[int, ...] = ()
    rescue: dict[str, list[int]] = field(default_factory=dict)
    fallback: int | None = None
    reason: str = ""

    @property
    def safe(self) -> bool:
        return not self.lacking


Copies = Mapping[str, Iterable[tuple[str, int, int]] | None]


def _complete(holders: Mapping[int, Mapping[int, set[str]]], world_size: int, allowed: Collection[str] | None
              ) -> int | None:
    """The newest step every rank has a copy of on ``allowed`` holders (None: any holder)."""
    for step in sorted(holders, reverse=True):
        ranks = holders[step]
        if all(ranks.get(r) and (allowed is None or ranks[r] & set(allowed)) for r in range(world_size)):
            return step
    return None


def eviction_safety(copies: Copies, remote: Iterable[tuple[int, int]], *, evict: Collection[str],
                    world_size: int) -> Safety:
    """Whether evicting ``evict`` leaves every rank of the newest restorable step a copy: on a machine that
    stays or in the remote tier. ``copies``: machine -> the ``(tier, step, rank)`` copies it holds (None: it did
    not answer; its copies count nowhere); ``remote``: the ``(step, rank)`` copies in the remote tier. When
    some ranks would lose their last copy, ``rescue`` says which evicted machine holds each, and
    ``fallback`` the newest step that stays complete without them."""
    remote_name = "<remote tier>"
    holders: dict[int, dict[int, set[str]]] = {}
    for machine, held in copies.items():
        for _tier, step, rank in held or ():
            holders.setdefault(step, {}).setdefault(rank, set()).add(machine)
    for step, rank in remote:
        holders.setdefault(step, {}).setdefault(rank, set()).add(remote_name)
    step = _complete(holders, world_size, None)
    if step is None:
        return Safety(None, reason="no step is complete on every rank: nothing an eviction could lose")
    staying = {m for m in copies if m not in evict} | {remote_name}
    lacking = tuple(r for r in range(world_size) if not holders[step][r] & staying)
    if not lacking:
        return Safety(step, reason=f"every rank of step {step} keeps a copy on a machine that stays or in the "
                                   f"remote tier")
    rescue: dict[str, list[int]] = {}
    for r in lacking:
        source = sorted(m for m in holders[step][r] if m in evict and copies.get(m) is not None)
        if source:
            rescue.setdefault(source[0], []).append(r)
    fallback = _complete(holders, world_size, staying)
    return Safety(step, lacking, rescue, fallback,
                  f"step {step}: rank(s) {list(lacking)} have copies only on {', '.join(sorted(evict))}")

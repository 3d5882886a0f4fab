"""Checkpoint verification policy: which step to verify, and which S3 steps retention deletes.

Pure functions (no I/O, no Airflow) over what the machines and the S3 tier report.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
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

"""Code update policy (ByteRobust §6.1, "lazy hot-update"): what a requested revision change does.

* ``urgent``: a hot update now: stop the job, switch every machine to the revision, restart in place
  (same machines), restore the newest committed checkpoint.
* ``lazy``: the revision waits as the job's pending revision and is applied at the next restart the
  ladder makes anyway; if none comes within the force window (default 24 h), it is applied then.
* ``rollback``: back to the last known-good revision (the ladder's user-code rung uses the same path).

A revision becomes known-good once the job trained a configured number of healthy steps on it.
Plain Python (no Airflow).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from trainguard.core.errors import TrainguardError

URGENCIES = ("urgent", "lazy", "rollback")
LAZY_FORCE_S = 24 * 3600.0
KNOWN_GOOD_STEPS = 200


class UpdateError(TrainguardError):
    """A code update that cannot be made: what is wrong and what to do, in one line."""


@dataclass(frozen=True)
class UpdatePlan:
    """``action``: ``hot`` (switch now, in place), ``pending`` (wait for the next restart), ``none``."""

    action: str
    revision: str
    reason: str


def plan_update(*, job: str, current: str, pending: str | None, requested: str, urgency: str,
                recorded: Sequence[str], known_good: Sequence[str]) -> UpdatePlan:
    """What a ``tg_code_update`` request does. ``recorded``: the job's revisions in the fleet database;
    ``known_good``: those of them known good, oldest first. For ``rollback``, ``requested`` may be
    empty (the newest known-good revision other than the current one)."""
    if urgency not in URGENCIES:
        raise UpdateError(f"urgency {urgency!r} is not one of {', '.join(URGENCIES)}; pick one")
    if urgency == "rollback":
        good = [r for r in known_good if r != current]
        target = requested or (good[-1] if good else "")
        if not target:
            raise UpdateError(f"job {job} has no known-good revision other than {current!r} to roll back to; "
                              f"name one with a revision")
        if target not in known_good:
            raise UpdateError(f"revision {target!r} of job {job} is not known good; roll back to one of "
                              f"{', '.join(known_good) or '(none yet)'}")
        if target == current:
            return UpdatePlan("none", target, f"job {job} already runs {target}")
        return UpdatePlan("hot", target, f"roll back {current} -> {target}")
    if not requested:
        raise UpdateError(f"no revision given for job {job}; name one of {', '.join(recorded) or '(none recorded)'}")
    if requested not in recorded:
        raise UpdateError(f"job {job} has no revision {requested!r}; record it first "
                          f"(trainguard revision add --job {job} --revision REV) or pick one of "
                          f"{', '.join(recorded) or '(none recorded)'}")
    if requested == current:
        return UpdatePlan("none", requested, f"job {job} already runs {requested}")
    if urgency == "urgent":
        return UpdatePlan("hot", requested, f"hot update {current} -> {requested}")
    if pending == requested:
        return UpdatePlan("none", requested, f"{requested} already waits for job {job}'s next restart")
    return UpdatePlan("pending", requested, f"{requested} waits for the next restart of job {job}")


def lazy_due(pending_since: float | None, now: float, *, force_after_s: float = LAZY_FORCE_S) -> bool:
    """A pending revision that waited ``force_after_s`` for a restart is applied by a hot update."""
    return pending_since is not None and now - pending_since >= force_after_s


def becomes_known_good(healthy_steps: int, *, threshold: int = KNOWN_GOOD_STEPS) -> bool:
    return healthy_steps >= threshold

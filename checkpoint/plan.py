"""Which step to restore, and where each rank's state comes from: a pure function of what ranks hold.

At start-up every rank reports the copies it holds (its own, the replicas it
keeps for others) and rank 0 adds what the S3 tier lists; every rank gets the
same list and computes the same :class:`RestorePlan`:

* the newest step of the job's layout for which *every* rank's state can be
  had: from the saver's memory on the rank's machine, else its own local copy,
  else the replica on its holder, else a copy left on a machine that now runs
  other ranks (a job submitted again on its machines in another order), else S3;
* all of a step's copies must come from one *segment* (the stretch of training
  between two restores; its id is in every manifest), so a step saved again
  after a restore from an older one is never mixed with the abandoned run's
  copy of the same step;
* copies found bad while restoring are excluded and the plan is made again, so
  a corrupt copy falls back to the next copy of the same step, then to an older
  step.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

TIER_ORDER = {"memory": 0, "local": 1, "replica": 2, "moved": 3, "s3": 4}
OWN_TIERS = ("memory", "local")  # copies only the rank that saved them (on its machine) can use
# copies a rank on another machine holds and sends over the job's own group: replicas, and "moved" copies (a rank's
# copy left on a machine that now runs other ranks: the job submitted again on its machines in another order)
PEER_TIERS = ("replica", "moved")
S3_HOLDER = -1


@dataclass(frozen=True, order=True)
class Holding:
    """One copy of ``rank``'s state at ``step``, held by ``holder`` (a rank; -1 = the S3 tier).

    ``layout`` is the topology it was saved with (``tp=..,pp=..,dp=..``), ``segment`` the
    id of the training segment that saved it ("" = unknown, as for S3 listings, which
    are checked when downloaded).
    """

    step: int
    rank: int
    tier: str
    holder: int
    layout: str
    segment: str = ""

    def as_list(self) -> list[object]:
        return [self.step, self.rank, self.tier, self.holder, self.layout, self.segment]

    @classmethod
    def from_list(cls, item: list[object]) -> Holding:
        step, rank, tier, holder, lay, segment = item
        return cls(int(step), int(rank), str(tier), int(holder), str(lay), str(segment))  # type: ignore[arg-type]

    @property
    def key(self) -> tuple[int, int, str, int]:
        return (self.step, self.rank, self.tier, self.holder)


@dataclass
class RestorePlan:
    """The step to restore, the segment its copies come from, and each rank's source."""

    step: int
    segment: str = ""
    sources: dict[int, Holding] = field(default_factory=dict)

    def transfers(self) -> list[tuple[int, int]]:
        """``(holder, owner)`` of every peer transfer, in the order every rank performs them."""
        return sorted(((h.holder, h.rank) for h in self.sources.values() if h.tier in PEER_TIERS
                       and h.holder != h.rank), key=lambda t: (t[1], t[0]))

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for h in self.sources.values():
            out[h.tier] = out.get(h.tier, 0) + 1
        return out


def _best(copies: Iterable[Holding], rank: int) -> Holding | None:
    usable = [h for h in copies if h.tier not in OWN_TIERS or h.holder == rank]
    return min(usable, key=lambda h: (TIER_ORDER[h.tier], h.holder), default=None)


def plan_restore(holdings: Iterable[Holding], *, world_size: int, layout: str,
                 excluded: Iterable[tuple[int, int, str, int]] = ()) -> RestorePlan | None:
    """The newest step every rank of ``world_size`` can restore, or None."""
    skip = set(excluded)
    by_step: dict[int, list[Holding]] = {}
    for h in holdings:
        if h.layout != layout or h.key in skip or not 0 <= h.rank < world_size:
            continue
        by_step.setdefault(h.step, []).append(h)
    for step in sorted(by_step, reverse=True):
        copies = by_step[step]
        # one segment at a time, the best-covered first; "" (unknown) copies may join any segment
        segments = sorted({h.segment for h in copies if h.segment},
                          key=lambda s: (-len({h.rank for h in copies if h.segment == s}), s)) or [""]
        for segment in segments:
            plan = RestorePlan(step, segment)
            for rank in range(world_size):
                best = _best([h for h in copies if h.rank == rank and h.segment in (segment, "")], rank)
                if best is None:
                    break
                plan.sources[rank] = best
            else:
                return plan
    return None


def explain(holdings: Iterable[Holding], *, world_size: int, layout: str,
            excluded: Iterable[tuple[int, int, str, int]] = ()) -> str:
    """Why no step is restorable, in a few words (for the one-line error)."""
    holdings = list(holdings)
    skip = set(excluded)
    other = sorted({h.layout for h in holdings if h.layout != layout})
    mine = [h for h in holdings if h.layout == layout and 0 <= h.rank < world_size]
    if not mine:
        if other:
            return f"the copies found were saved with another layout ({', '.join(other)}), this job is {layout}"
        return "no copies found"
    newest = max(h.step for h in mine)
    have = {h.rank for h in mine if h.step == newest and h.key not in skip}
    lacking = [r for r in range(world_size) if r not in have]
    text = f"newest step {newest} has no usable copy for rank(s) {lacking[:8]}"
    if skip:
        text += f" ({len(skip)} copies failed verification, {len([k for k in skip if k[0] == newest])} of this step)"
    return text

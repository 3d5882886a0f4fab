"""Warm standby pool policy (ByteRobust §6, Table 5): how many standbys a job needs, and what the pool
job does about it.

The pool covers the P99 of the job's machine failures over a day: with N machines that each fail on a
given day with probability p, failures follow Binomial(N, p) and the target is its 0.99 quantile; and it
never holds fewer than the machines of one pipeline (:func:`over_eviction_floor`): a hang or a straggler is
over-evicted by its whole pipeline at once, and a pool sized by single-machine failures (5 standbys at 1,200
machines) would leave every hang of a job with 8 or more machines per pipeline waiting for a human.
p comes from the fleet's own history (evictions per machine-day in service) smoothed with a prior, so a
young fleet starts from the paper's rate (~0.0012 per machine-day reproduces Table 5: 128 -> 2,
256 -> 2, 512 -> 3, 1024 -> 4) and moves toward what it observes as machine-days accumulate.

Plain Python (no Airflow): ``tg_standby_pool`` calls it, the tests and the simulator reuse it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from trainguard.core.errors import TrainguardError

DAY_S = 86400.0
PRIOR_RATE = 0.0012  # failures per machine-day (reproduces ByteRobust's Table 5)
PRIOR_MACHINE_DAYS = 5000.0  # the prior weighs as much as this much observed exposure
QUANTILE = 0.99
HISTORY_WINDOW_S = 30 * DAY_S
RECHECK_AGE_S = 6 * 3600.0  # a standby idle longer than this is self-checked again
RETIRE_AFTER = 3  # evictions within the history window that retire a machine


class PoolError(TrainguardError):
    """Bad pool input: what is wrong and what to do, in one line."""


@dataclass(frozen=True)
class Event:
    """One machine state change, as the fleet database records it."""

    machine: str
    to_state: str
    ts: float
    reason: str = ""


def failure_rate(events: Iterable[Event], now: float, *, window_s: float = HISTORY_WINDOW_S,
                 in_service: Sequence[str] = ("active", "suspect", "standby"), failed: str = "evicted",
                 prior_rate: float = PRIOR_RATE, prior_days: float = PRIOR_MACHINE_DAYS) -> dict[str, float]:
    """Failures per machine-day from the last ``window_s`` of state changes: evictions over the time
    machines spent in service, as the posterior mean of a Gamma prior (``prior_rate`` weighted as
    ``prior_days`` machine-days) and Poisson counts. Returns the rate and what it came from."""
    if window_s <= 0:
        raise PoolError(f"history window {window_s} s must be positive")
    start = now - window_s
    by_machine: dict[str, list[Event]] = {}
    for e in events:
        by_machine.setdefault(e.machine, []).append(e)
    exposure_s = 0.0
    failures = 0
    for history in by_machine.values():
        history.sort(key=lambda e: e.ts)
        for e, nxt in zip(history, [*history[1:], None], strict=True):
            end = min(now, nxt.ts if nxt else now)
            if e.to_state in in_service and end > start:
                exposure_s += end - max(e.ts, start)
            if e.to_state == failed and start <= e.ts <= now:
                failures += 1
    days = exposure_s / DAY_S
    rate = (failures + prior_rate * prior_days) / (days + prior_days)
    return {"rate": rate, "failures": failures, "machine_days": days, "prior_rate": prior_rate,
            "prior_days": prior_days}


def pool_target(machines: int, rate: float, *, quantile: float = QUANTILE, horizon_days: float = 1.0) -> int:
    """Standbys for a job of ``machines`` machines: the ``quantile`` of Binomial(machines, p), p the
    chance that one machine fails within ``horizon_days`` at ``rate`` failures per machine-day."""
    if machines < 0:
        raise PoolError(f"a job has {machines} machines; it must be 0 or more")
    if not 0 <= rate < 1 or not 0 < quantile < 1:
        raise PoolError(f"failure rate {rate} must be in [0, 1) and quantile {quantile} in (0, 1)")
    if machines == 0 or rate == 0:
        return 0
    from scipy.stats import binom

    p = -math.expm1(-rate * horizon_days)
    return int(binom.ppf(quantile, machines, p))


def over_eviction_floor(layouts: Iterable[tuple[int, int, int, int]]) -> int:
    """The most machines one automatic over-eviction takes among the jobs of ``layouts`` (``(tp, pp, dp,
    ranks_per_machine)`` each): the ladder evicts a hang's or a straggler's pipeline (every stage of one
    data-parallel replica), so the pool must hold a pipeline's machines to swap it in one step."""
    from trainguard.core.topology import Topology

    most = 0
    for tp, pp, dp, rpm in layouts:
        topo = Topology(tp=tp, pp=pp, dp=dp, ranks_per_machine=rpm)
        # the pipelines of a layout span equally many machines but where a machine holds part of two
        most = max(most, *(len(topo.machines_of_group("pp", r)) for r in {0, topo.world_size - 1}))
    return most


@dataclass(frozen=True)
class Standby:
    name: str
    checked_ts: float | None  # the last self-check it passed


@dataclass
class PoolPlan:
    """What one pool run does: provision (self-check, then park) free machines, re-check stale standbys,
    retire repeat offenders. ``unmet``: standbys the free inventory cannot supply."""

    target: int
    have: int
    provision: list[str] = field(default_factory=list)
    recheck: list[str] = field(default_factory=list)
    retire: list[str] = field(default_factory=list)
    unmet: int = 0

    def as_dict(self) -> dict[str, object]:
        return {"target": self.target, "have": self.have, "provision": self.provision, "recheck": self.recheck,
                "retire": self.retire, "unmet": self.unmet}


def plan_pool(target: int, standbys: Sequence[Standby], free: Sequence[str], evictions: Mapping[str, int], now: float,
              *, checking: Sequence[str] = (), recheck_age_s: float = RECHECK_AGE_S,
              retire_after: int = RETIRE_AFTER) -> PoolPlan:
    """The pool run's plan. ``free``: machines no job holds and that may join the pool (in inventory
    order, the provider's preference); ``checking``: machines in their self-check now (counted as
    coming); ``evictions``: each machine's evictions within the history window. A machine evicted
    ``retire_after`` times or more is retired instead of used again."""
    if target < 0:
        raise PoolError(f"pool target {target} must be 0 or more")
    retire = sorted(n for n, count in evictions.items() if count >= retire_after)
    usable = [s for s in standbys if s.name not in retire]
    candidates = [n for n in free if n not in retire and n not in {s.name for s in standbys}]
    have = len(usable) + len([n for n in checking if n not in retire])
    short = max(0, target - have)
    provision = candidates[:short]
    stale = [s.name for s in usable if s.checked_ts is None or now - s.checked_ts > recheck_age_s]
    return PoolPlan(target=target, have=have, provision=provision, recheck=stale,
                    retire=[n for n in retire if n in {s.name for s in standbys} or n in free],
                    unmet=short - len(provision))
